//! `image_record`: the store's byte formats, as read by the daemon and `export` —
//! [`ImageRecord::decode`], [`PackIndex::decode`], [`RefIndex::decode`], [`ImageEntry::from_json`] — and read planning
//! ([`BlockMap::plan`]) on every record that decodes.
//!
//! Input: `u8 mode` then
//!
//! | mode % 6 | rest |
//! |---|---|
//! | 0 | raw image record bytes |
//! | 1 | raw pack index bytes |
//! | 2 | raw image entry JSON |
//! | 3 | a structured block map + config (see [`structured_record`]), built with the public builder, encoded, decoded |
//! | 4 | a structured pack index, built with [`PackIndex::new`], encoded, decoded |
//! | 5 | raw reference pack index bytes ([`RefIndex::decode`]) |
//!
//! Properties: never a panic, no allocation beyond the input's size; what decodes re-encodes to
//! the identical bytes (the record's sha256 is the image ID); an entry survives a JSON round
//! trip; a decoded record's block map plans any in-range read into segments that add up, stay
//! inside the prefix and their chunks, and refuses out-of-range reads.

use tessera_image::{
    BlockMap, BuildOptions, ChunkId, ChunkRef, Compression, Geometry, ImageEntry, ImageRecord, ImageStats,
    PackIndex, PackIndexBlob, PackIndexEncoder, PackLocation, PrefixInfo, RefIndex, RuntimeConfig, Segment,
    SegmentSource, Sha256Digest,
};

use crate::Input;

pub const MODE_RECORD: u8 = 0;
pub const MODE_PACK_INDEX: u8 = 1;
pub const MODE_ENTRY: u8 = 2;
pub const MODE_STRUCTURED_RECORD: u8 = 3;
pub const MODE_STRUCTURED_PACK_INDEX: u8 = 4;
pub const MODE_REF_INDEX: u8 = 5;

const BS: u64 = 4096;

/// The fuzz target body.
pub fn run(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else { return };
    match mode % 6 {
        MODE_RECORD => record(rest),
        MODE_PACK_INDEX => pack_index(rest),
        MODE_ENTRY => entry(rest),
        MODE_STRUCTURED_RECORD => {
            if let Some(r) = structured_record(rest) {
                let bytes = r.encode();
                let back = ImageRecord::decode(&bytes)
                    .unwrap_or_else(|e| panic!("a record built by the builder does not decode: {e}"));
                assert_eq!(back, r);
                record(&bytes);
            }
        }
        MODE_STRUCTURED_PACK_INDEX => structured_pack_index(rest),
        _ => ref_index(rest),
    }
}

fn ref_index(bytes: &[u8]) {
    let Ok(idx) = RefIndex::decode(bytes) else { return };
    assert!(idx.encode() == bytes, "reference index decode/encode is not the identity");
    // A keyed index's chunks, in id order, as the list an aligned one is checked against; an
    // aligned index against a list of its length made up here (any lengths it accepts must
    // put every chunk inside its layer).
    let list: Vec<ChunkRef> = if idx.keyed_entries().is_empty() {
        (0..idx.len() as u32)
            .map(|i| ChunkRef { id: ChunkId::of(&i.to_le_bytes()), len: 1 + i % 7 })
            .collect()
    } else {
        idx.keyed_entries().iter().map(|(id, loc)| ChunkRef { id: *id, len: loc.len }).collect()
    };
    let Ok(located) = idx.locate(&list) else {
        assert!(idx.keyed_entries().is_empty(), "a keyed index does not locate its own chunks");
        return;
    };
    if !idx.keyed_entries().is_empty() {
        let keyed: Vec<_> = idx.keyed_entries().iter().map(|e| e.1).collect();
        assert_eq!(located, keyed, "a keyed index locates its chunks elsewhere");
    }
    for loc in located {
        let layer = &idx.layers[loc.layer as usize];
        let (first, last) =
            layer.spans_covering(loc.offset, u64::from(loc.len)).expect("a chunk has no spans");
        assert!(first <= last && layer.span_range(first).unwrap().0 <= loc.offset);
        assert!(layer.span_range(last).unwrap().1 >= loc.offset + u64::from(loc.len));
    }
}

fn record(bytes: &[u8]) {
    let Ok(r) = ImageRecord::decode(bytes) else { return };
    assert!(r.encode() == bytes, "record decode/encode is not the identity");
    check_block_map(&r.block_map);
}

fn pack_index(bytes: &[u8]) {
    let Ok(blob) = PackIndexBlob::decode(bytes) else { return };
    assert!(blob.encode() == bytes, "pack index decode/encode is not the identity");
    let PackIndexBlob::Keyed(idx) = blob else { return };
    assert!(idx.encode() == bytes, "pack index decode/encode is not the identity");
    for (id, loc) in idx.entries() {
        let (pack, got) = idx.get(id).expect("an indexed chunk is not found");
        assert_eq!(got, *loc);
        assert_eq!(pack, idx.packs()[loc.pack as usize]);
    }
    let _ = idx.stored_bytes();
}

fn entry(bytes: &[u8]) {
    let Ok(e) = ImageEntry::from_json(bytes) else { return };
    let again = ImageEntry::from_json(&e.to_json()).expect("to_json output does not parse");
    assert_eq!(again, e);
}

/// Planning on a decoded map: the read path's first step on store input.
pub fn check_block_map(map: &BlockMap) {
    // Finding F1 (docs/fuzzing.md, fixed): decode accepted maps whose byte sizes overflow u64.
    assert!(
        map.device_blocks() <= u64::MAX / BS && map.prefix_blocks() <= u64::MAX / BS,
        "F1: a decoded block map of {} device / {} prefix blocks overflows u64 bytes",
        map.device_blocks(),
        map.prefix_blocks()
    );
    let device = map.device_bytes();
    let prefix_bytes = map.prefix_blocks().saturating_mul(BS);
    let mut ranges = vec![(0, device.min(1 << 20)), (device - device.min(1 << 20), device.min(1 << 20))];
    ranges.push((device / 2, (device - device / 2).min(300_000)));
    for run in map.runs().iter().take(8) {
        let start = run.start.saturating_mul(BS);
        let end = run.start.saturating_add(run.blocks).saturating_mul(BS);
        let lo = start.saturating_sub(4096 + 17).min(device);
        let hi = end.saturating_add(4096 + 17).min(device);
        ranges.push((lo, (hi - lo).min(4 << 20)));
    }
    for (offset, len) in ranges {
        let segs: Vec<Segment> = map
            .plan(offset, len)
            .unwrap_or_else(|e| panic!("in-range read {offset}+{len} of {device}: {e}"))
            .take(100_000)
            .collect();
        let mut sum = 0u64;
        for s in &segs {
            assert!(s.len > 0, "empty segment");
            sum = sum.checked_add(s.len).expect("segment lengths overflow");
            match s.source {
                SegmentSource::Zero => {}
                SegmentSource::Prefix { offset } => {
                    assert!(offset.checked_add(s.len).is_some_and(|e| e <= prefix_bytes), "past the prefix")
                }
                SegmentSource::Chunk { chunk, offset } => {
                    let c = map.chunks().get(chunk as usize).expect("segment names a missing chunk");
                    assert!(
                        offset.checked_add(s.len).is_some_and(|e| e <= c.blocks() * BS),
                        "past its chunk"
                    );
                }
            }
        }
        assert_eq!(sum, len, "segments of {offset}+{len} add up to {sum}");
    }
    assert!(map.plan(device, 1).is_err());
    assert!(map.plan(u64::MAX, 2).is_err());
}

/// A record from a small description: `u64 device_blocks`, `u8 chunks` × (`u8 id`, `u32 len`),
/// `u8 runs` × (`u8 kind`, `u64 start`, `u64 blocks`, then `u64 prefix block` or `u8 chunk`,
/// `u32 chunk block`), `u8 env` × (`u8 len`, bytes), `u8 labels` × (`u8 len`, key, `u8 len`,
/// value). `None` when the builder refuses it.
pub fn structured_record(data: &[u8]) -> Option<ImageRecord> {
    let mut i = Input::new(data);
    let device_blocks = i.u64();
    let mut b = BlockMap::builder(device_blocks);
    let chunks: Vec<u32> = (0..i.u8() % 17)
        .map(|_| {
            let id = i.u8();
            let len = i.u32();
            b.add_chunk(ChunkId::of(&[id]), len)
        })
        .collect();
    for _ in 0..i.u8() % 33 {
        let kind = i.u8();
        let (start, blocks) = (i.u64(), i.u64());
        if kind % 2 == 0 {
            let at = i.u64();
            // `finish` must refuse a prefix run whose end overflows (finding F6, fixed).
            b.push_prefix(start, blocks, at).ok()?;
        } else {
            let c = usize::from(i.u8());
            let at = i.u32();
            let chunk = if chunks.is_empty() { c as u32 } else { chunks[c % chunks.len()] };
            b.push_chunk(start, blocks, chunk, at).ok()?;
        }
    }
    let block_map = b.finish().ok()?;
    let string = |i: &mut Input<'_>| {
        let n = usize::from(i.u8());
        String::from_utf8_lossy(i.bytes(n)).into_owned()
    };
    let env = (0..i.u8() % 8).map(|_| string(&mut i)).collect();
    let labels = (0..i.u8() % 8).map(|_| (string(&mut i), string(&mut i))).collect();
    Some(ImageRecord {
        options: BuildOptions { chunk_size: 1 << 20 },
        geometry: Geometry {
            block_size: BS as u32,
            blocks: device_blocks,
            inodes: 1024,
            inodes_per_group: 1024,
            groups: 1,
            journal_blocks: 0,
            free_blocks: 0,
            free_inodes: 0,
            data_start_block: 0,
            data_end_block: 0,
            uuid: [9; 16],
        },
        stats: ImageStats::default(),
        prefix: PrefixInfo { digest: Sha256Digest::of(b"prefix"), blocks: block_map.prefix_blocks() },
        block_map,
        config: RuntimeConfig {
            env,
            entrypoint: None,
            cmd: Some(vec!["/bin/sh".into()]),
            labels,
            ..Default::default()
        },
    })
}

fn structured_pack_index(data: &[u8]) {
    let mut i = Input::new(data);
    let packs: Vec<Sha256Digest> = (0..i.u8() % 5).map(|_| Sha256Digest::of(&[i.u8()])).collect();
    let entries: Vec<(ChunkId, PackLocation)> = (0..i.u8() % 65)
        .map(|_| {
            let id = ChunkId::of(&[i.u8()]);
            let loc = PackLocation {
                pack: u32::from(i.u8()),
                offset: i.u64(),
                stored_len: i.u32(),
                raw_len: i.u32(),
                compression: if i.u8() % 2 == 0 { Compression::None } else { Compression::Zstd },
            };
            (id, loc)
        })
        .collect();
    // The same locations as a version-2 index, aligned with the entries' ids as a list (each
    // id once, its first location).
    let mut list = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut aligned = Vec::new();
    for &(id, loc) in &entries {
        if seen.insert(id) {
            list.push(ChunkRef { id, len: loc.raw_len });
            aligned.push(loc);
        }
    }
    let mut e = PackIndexEncoder::new(&packs, list.len());
    let taken = list.iter().zip(&aligned).all(|(c, l)| e.entry(*c, *l).is_ok());
    if taken {
        let bytes = e.finish().expect("every announced entry was given");
        let back = PackIndexBlob::decode(&bytes)
            .unwrap_or_else(|e| panic!("an aligned index the encoder took does not decode: {e}"));
        let located = back.locate(&list).expect("an aligned index does not locate its own list");
        let want: Vec<_> = aligned.iter().map(|l| (packs[l.pack as usize], *l)).collect();
        assert_eq!(located, want);
        pack_index(&bytes);
    }
    let idx = PackIndex::new(packs, entries);
    let valid = idx.entries().iter().all(|(_, l)| {
        (l.pack as usize) < idx.packs().len()
            && (l.compression == Compression::Zstd || l.stored_len == l.raw_len)
    });
    let bytes = idx.encode();
    match PackIndex::decode(&bytes) {
        Ok(back) => assert_eq!(back, idx),
        Err(e) => assert!(!valid, "a valid index built by PackIndex::new does not decode: {e}"),
    }
    pack_index(&bytes);
}
