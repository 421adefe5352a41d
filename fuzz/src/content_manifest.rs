//! `content_manifest`: the builder's layer/content manifest decoder
//! ([`ContentManifest::decode`]), which reads blobs of the store a build trusts only as far as
//! they decode (`docs/formats/content-manifest.md`).
//!
//! Input: raw manifest bytes. Properties: never a panic, no allocation beyond the input's size;
//! what decodes re-encodes to the identical bytes, and every file's chunks stay inside the file,
//! aligned and in order.

use tessera_builder::manifest::ContentManifest;

/// The fuzz target body.
pub fn run(data: &[u8]) {
    let Ok(m) = ContentManifest::decode(data) else { return };
    assert_eq!(m.encode(), data, "a decoded manifest re-encodes to other bytes");
    for (entry, chunks) in m.entries.iter().filter_map(|e| match e.kind {
        tessera_builder::source::EntryKind::File { size, offset } => Some((size, &m.files[offset as usize])),
        _ => None,
    }) {
        let mut end = 0u64;
        for &(off, _, len) in chunks {
            assert!(off % 4096 == 0 && off >= end.div_ceil(4096) * 4096 && off + u64::from(len) <= entry);
            end = off + u64::from(len);
        }
    }
}

/// Seeds: the example manifest and an empty one.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    vec![
        ("example".into(), ContentManifest::example().encode()),
        ("empty".into(), ContentManifest::default().encode()),
    ]
}
