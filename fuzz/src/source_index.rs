//! `source_index`: the directory build's source index decoder ([`SourceIndex::decode`]), which
//! reads a blob of the store that a rebuild trusts only as far as it decodes
//! (`docs/formats/source-index.md`).
//!
//! Input: raw index bytes. Properties: never a panic, no allocation beyond the input's size; what
//! decodes re-encodes to the identical bytes, and every file is found by its fingerprint with its
//! chunks, aligned, in order and within the chunk size.

use tessera_builder::source_index::SourceIndex;

/// The fuzz target body.
pub fn run(data: &[u8]) {
    let Ok(index) = SourceIndex::decode(data.to_vec()) else { return };
    let entries: Vec<_> = index.entries().collect();
    assert_eq!(SourceIndex::encode(index.chunk_size(), &entries), data, "not canonical");
    for (fp, chunks) in &entries {
        let found: Vec<_> = index.lookup(*fp).expect("a listed fingerprint is found").collect();
        assert_eq!(&found, chunks);
        let mut end = 0u64;
        for &(off, _, len) in chunks {
            assert!(off % 4096 == 0 && off >= end && len >= 1 && len <= index.chunk_size());
            end = (off + u64::from(len)).div_ceil(4096) * 4096;
        }
    }
}

/// Seeds: the example index (three files, one of two chunks, one after a hole) and an empty one.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    vec![("example".into(), SourceIndex::example()), ("empty".into(), SourceIndex::encode(512 * 1024, &[]))]
}
