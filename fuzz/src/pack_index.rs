//! `pack_index`: the pack index decoder ([`PackIndexBlob::decode`], `TESSPIX` versions 1 and 2,
//! `docs/formats/pack-index.md`), read from the store for every image the daemon serves or
//! `export`/`copy` reads. `image_record` reaches it too (one mode of six); this target fuzzes it
//! alone.
//!
//! Input: raw pack index bytes. Properties: never a panic, no allocation beyond the input's size;
//! what decodes re-encodes to the identical bytes; the encoding cut short by a byte does not
//! decode (the decoder is strict). Version 1: [`PackIndex::new`] on its packs and entries gives
//! the same index, and every entry is found by `get` in its pack. Version 2: its stored bytes are
//! the sum of its entries', and a list of as many chunks made up here is refused unless the input
//! names that list's digest (then each location carries the list's length).

use tessera_image::{
    ChunkId, ChunkRef, Compression, PackIndex, PackIndexBlob, PackIndexEncoder, PackLocation, Sha256Digest,
};

/// The fuzz target body.
pub fn run(data: &[u8]) {
    let Ok(blob) = PackIndexBlob::decode(data) else { return };
    assert!(blob.encode() == data, "pack index decode/encode is not the identity");
    assert!(PackIndexBlob::decode(&data[..data.len() - 1]).is_err(), "a cut-short pack index decodes");
    let idx = match &blob {
        PackIndexBlob::Keyed(idx) => idx.clone(),
        PackIndexBlob::Aligned(_) => {
            // A list of as many chunks, which this input was almost surely not made for: refused,
            // unless the input carries that list's digest (a fuzzer can learn it from the
            // comparison); then every location has the list's length, in a pack of the table.
            let made_up: Vec<ChunkRef> = (0..blob.len() as u32)
                .map(|i| ChunkRef { id: ChunkId::of(&i.to_le_bytes()), len: 1 })
                .collect();
            if let Ok(located) = blob.locate(&made_up) {
                for (pack, loc) in located {
                    assert_eq!(loc.raw_len, 1);
                    assert_eq!(Some(&pack), blob.packs().get(loc.pack as usize));
                }
            }
            let _ = blob.stored_bytes();
            return;
        }
    };
    let bytes = idx.encode();
    assert!(bytes == data, "pack index decode/encode is not the identity");
    assert_eq!(PackIndex::new(idx.packs().to_vec(), idx.entries().to_vec()), idx);
    for (id, loc) in idx.entries() {
        let (pack, got) = idx.get(id).expect("an indexed chunk is not found");
        assert_eq!(got, *loc);
        assert_eq!(Some(&pack), idx.packs().get(loc.pack as usize), "an entry names a missing pack");
        assert!(loc.compression == Compression::Zstd || loc.stored_len == loc.raw_len);
    }
    let sum: u64 = idx.entries().iter().map(|e| u64::from(e.1.stored_len)).sum();
    assert_eq!(idx.stored_bytes(), sum);
    assert!(PackIndex::decode(&bytes[..bytes.len() - 1]).is_err(), "a cut-short pack index decodes");
}

/// A pack index of two packs with zstd and raw chunks (a seed here and of `image_record`, and a
/// fixture of `tests/formats.rs`).
pub fn example() -> PackIndex {
    let loc = |pack, offset, stored_len, raw_len, compression| PackLocation {
        pack,
        offset,
        stored_len,
        raw_len,
        compression,
    };
    PackIndex::new(
        vec![Sha256Digest::of(b"pack"), Sha256Digest::of(b"pack2")],
        vec![
            (ChunkId::of(b"a"), loc(0, 0, 100, 4096, Compression::Zstd)),
            (ChunkId::of(b"b"), loc(0, 100, 4096, 4096, Compression::None)),
            (ChunkId::of(b"c"), loc(1, 0, 7, 65536, Compression::Zstd)),
        ],
    )
}

/// A version-2 index of the chunks "a", "b", "c" (as in [`example`], in that list order), and the
/// list (a fixture of `tests/formats.rs` and a seed).
pub fn aligned_example() -> (Vec<u8>, Vec<ChunkRef>) {
    let ex = example();
    let mut e = PackIndexEncoder::new(ex.packs(), ex.entries().len());
    let mut list = Vec::new();
    for name in [b"a", b"b", b"c"] {
        let id = ChunkId::of(name);
        let (_, loc) = ex.get(&id).expect("the example holds a, b and c");
        let chunk = ChunkRef { id, len: loc.raw_len };
        e.entry(chunk, loc).expect("the example fits the format");
        list.push(chunk);
    }
    (e.finish().expect("three entries announced, three given"), list)
}

/// Seeds: [`example`]; it with a chunk at the largest offset and lengths; one of a pack and no
/// chunk; an empty one; [`aligned_example`].
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let two = example();
    let mut entries = two.entries().to_vec();
    let max = PackLocation {
        pack: 1,
        offset: u64::MAX - 8,
        stored_len: u32::MAX,
        raw_len: u32::MAX,
        compression: Compression::None,
    };
    entries.push((ChunkId([0xff; 32]), max));
    vec![
        ("two-packs".into(), two.encode()),
        ("largest".into(), PackIndex::new(two.packs().to_vec(), entries).encode()),
        ("one-pack-no-chunks".into(), PackIndex::new(vec![Sha256Digest::of(b"p")], vec![]).encode()),
        ("empty".into(), PackIndex::default().encode()),
        ("aligned".into(), aligned_example().0),
    ]
}
