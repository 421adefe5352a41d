//! End-to-end read path: a hand-built image read back through OpenImage / ImageReader (the
//! export of the same image through the read engine: crates/engine/tests/export.rs).

mod common;

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{build_image, Rng, BS};
use tessera_image::{
    ImageEntry, ImageId, ImageRecord, PackIndex, PackIndexBlob, PackIndexEncoder, Sha256Digest,
};
use tessera_store::{ChunkSource, ImageReader, LocalStore, OpenImage, ReadStore, StoreError};

/// Counts fetches, to prove the chunk cache works.
struct Counting<S> {
    inner: S,
    fetches: AtomicUsize,
}

impl<S: ChunkSource> ChunkSource for Counting<S> {
    fn read_stored(&self, pack: &Sha256Digest, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
        self.fetches.fetch_add(1, Ordering::Relaxed);
        self.inner.read_stored(pack, offset, len)
    }
}

#[test]
fn random_reads_match_the_reference_device() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path()).unwrap();
    let img = build_image(&store, 64);
    let image = std::sync::Arc::new(OpenImage::open(&store, &img.id).unwrap());
    assert_eq!(image.device_bytes(), img.device.len() as u64);
    assert_eq!(image.record(), &img.record);

    for cache in [tessera_store::DEFAULT_CHUNK_CACHE, 1, 0] {
        let reader = ImageReader::new(image.clone(), store.clone()).with_cache_capacity(cache);
        let mut rng = Rng::new(42 + cache as u64);
        let dev = img.device.len() as u64;
        for i in 0..2000 {
            let offset = rng.below(dev);
            let max = (dev - offset).min(if i % 4 == 0 { 40 * BS as u64 } else { 3 * BS as u64 });
            let len = rng.below(max + 1) as usize;
            let mut buf = vec![0xa5u8; len];
            reader.read_at(offset, &mut buf).unwrap();
            let want = &img.device[offset as usize..offset as usize + len];
            assert!(buf == want, "cache {cache}: read {len} at {offset} differs");
        }
        // Whole device in one read, and the very last byte.
        let mut all = vec![0u8; img.device.len()];
        reader.read_at(0, &mut all).unwrap();
        assert!(all == img.device);
        let mut last = [0xffu8; 1];
        reader.read_at(dev - 1, &mut last).unwrap();
        assert_eq!(last[0], img.device[img.device.len() - 1]);
        // Outside the device.
        assert!(matches!(reader.read_at(dev - 1, &mut [0u8; 2]), Err(StoreError::OutOfRange(_))));
        assert!(matches!(reader.read_at(u64::MAX, &mut [0u8; 1]), Err(StoreError::OutOfRange(_))));
        reader.read_at(dev, &mut []).unwrap();
    }
}

#[test]
fn whole_chunk_by_index_and_the_cache_avoids_refetching() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path()).unwrap();
    let img = build_image(&store, 64);
    let source = Counting { inner: store.clone(), fetches: AtomicUsize::new(0) };
    let reader = ImageReader::new(OpenImage::open(&store, &img.id).unwrap(), source);
    // Sequential 512-byte reads over the whole device: each chunk is fetched once.
    let mut buf = [0u8; 512];
    for off in (0..img.device.len()).step_by(512) {
        reader.read_at(off as u64, &mut buf).unwrap();
        assert_eq!(&buf[..], &img.device[off..off + 512]);
    }
    assert_eq!(reader.source().fetches.load(Ordering::Relaxed), img.chunks.len());
    for (i, c) in img.record.block_map.chunks().iter().enumerate() {
        let data = reader.chunk(i as u32).unwrap();
        let want = &img.chunks.iter().find(|t| t.id == c.id).unwrap().data;
        assert_eq!(&data[..], &want[..]);
    }
    assert!(reader.chunk(99).is_err());
}

#[test]
fn corrupt_chunk_bytes_are_an_error_never_data() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path()).unwrap();
    let img = build_image(&store, 64);
    // Flip a byte of chunk a (zstd) and of chunk b (raw) inside their packs.
    for (n, victim) in [&img.chunks[0], &img.chunks[1]].into_iter().enumerate() {
        let path = store.blob_path(&victim.pack);
        let f = OpenOptions::new().read(true).write(true).open(&path).unwrap();
        let at = victim.loc.offset + u64::from(victim.loc.stored_len) / 2;
        let mut byte = [0u8; 1];
        f.read_exact_at(&mut byte, at).unwrap();
        f.write_all_at(&[byte[0] ^ 0x40], at).unwrap();

        let reader = ImageReader::new(OpenImage::open(&store, &img.id).unwrap(), store.clone());
        let start = [10 * BS, 14 * BS][n];
        let mut buf = vec![0u8; BS];
        match reader.read_at(start as u64, &mut buf) {
            Err(StoreError::CorruptChunk { chunk, pack, .. }) => {
                assert_eq!(chunk, victim.id);
                assert_eq!(pack, victim.pack);
            }
            other => panic!("expected CorruptChunk, got {other:?}"),
        }
        // The rest of the device still reads: prefix, and chunk c in the other pack.
        reader.read_at(0, &mut buf).unwrap();
        assert_eq!(&buf[..], &img.device[..BS]);
        reader.read_at(50 * BS as u64, &mut buf).unwrap();
        assert_eq!(&buf[..], &img.device[50 * BS..51 * BS]);
    }
}

#[test]
fn open_checks_the_parts_agree() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path()).unwrap();
    let img = build_image(&store, 64);

    // from_parts with the right bytes works; a swapped blob is caught.
    let rec = store.read_blob(&img.entry.record).unwrap();
    let pre = store.read_blob(&img.entry.prefix).unwrap();
    let pix = store.read_blob(&img.entry.pack_index).unwrap();
    OpenImage::from_parts(img.id, img.entry.clone(), &rec, &pre, &pix).unwrap();
    assert!(matches!(
        OpenImage::from_parts(img.id, img.entry.clone(), &rec, &pix, &pix),
        Err(StoreError::Corrupt { what: "metadata prefix", .. })
    ));

    // A pack index made for another chunk list (two chunks swapped: same count, other order).
    let record = ImageRecord::decode(&rec).unwrap();
    let chunks = record.block_map.chunks();
    let index = PackIndexBlob::decode(&pix).unwrap();
    assert!(matches!(index, PackIndexBlob::Aligned(_)));
    let want = index.locate(chunks).unwrap();
    let mut located = want.clone();
    located.swap(0, 1);
    let mut swapped = chunks.to_vec();
    swapped.swap(0, 1);
    let mut other = PackIndexEncoder::new(index.packs(), chunks.len());
    for (c, (_, loc)) in swapped.iter().zip(&located) {
        other.entry(*c, *loc).unwrap();
    }
    let entry =
        ImageEntry { pack_index: store.put_blob(&other.finish().unwrap()).unwrap(), ..img.entry.clone() };
    store.put_entry(&img.id, &entry).unwrap();
    match OpenImage::open(&store, &img.id) {
        Err(StoreError::Inconsistent { reason, .. }) => {
            assert!(reason.contains("another chunk list"), "{reason}")
        }
        other => panic!("opened with another list's index: {other:?}"),
    }

    // A version-1 index (stores written before version 2) opens, and one missing a chunk does not.
    let keyed = index.keyed(chunks).unwrap();
    let entry = ImageEntry { pack_index: store.put_blob(&keyed.encode()).unwrap(), ..img.entry.clone() };
    store.put_entry(&img.id, &entry).unwrap();
    let opened = OpenImage::open(&store, &img.id).unwrap();
    let got: Vec<_> = (0..chunks.len() as u32).map(|i| opened.chunk_location(i).unwrap()).collect();
    let want: Vec<_> = chunks.iter().zip(&want).map(|(c, (pack, loc))| (*c, *pack, *loc)).collect();
    assert_eq!(got, want);
    let fewer = PackIndex::new(keyed.packs().to_vec(), keyed.entries()[1..].to_vec());
    let entry = ImageEntry { pack_index: store.put_blob(&fewer.encode()).unwrap(), ..img.entry.clone() };
    store.put_entry(&img.id, &entry).unwrap();
    assert!(matches!(OpenImage::open(&store, &img.id), Err(StoreError::Inconsistent { .. })));

    // A prefix blob that decompresses to other bytes.
    let other = zstd::bulk::compress(&vec![1u8; 5 * BS], 3).unwrap();
    let entry = ImageEntry { prefix: store.put_blob(&other).unwrap(), ..img.entry.clone() };
    store.put_entry(&img.id, &entry).unwrap();
    assert!(matches!(
        OpenImage::open(&store, &img.id),
        Err(StoreError::Corrupt { what: "metadata prefix", .. })
    ));

    // A missing pack.
    store.put_entry(&img.id, &img.entry).unwrap();
    std::fs::remove_file(store.blob_path(&img.chunks[2].pack)).unwrap();
    assert!(matches!(OpenImage::open(&store, &img.id), Err(StoreError::BlobNotFound { .. })));
}

#[test]
fn known_chunks_cover_every_stored_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path()).unwrap();
    assert!(store.known_chunks().unwrap().is_empty());
    let img = build_image(&store, 64);
    let known = store.known_chunks().unwrap();
    assert_eq!(known.len(), img.chunks.len());
    for c in &img.chunks {
        let (pack, loc) = known[&c.id];
        assert_eq!(pack, c.pack);
        assert_eq!(loc.offset, c.loc.offset);
        assert_eq!(loc.stored_len, c.loc.stored_len);
    }
    // A missing pack: its chunks are no longer offered.
    std::fs::remove_file(store.blob_path(&img.chunks[0].pack)).unwrap();
    let known = store.known_chunks().unwrap();
    assert_eq!(known.len(), 2);
    assert!(!known.contains_key(&img.chunks[0].id));
}

/// A store read through [`ReadStore`]'s own `open_image_with` (the path of remote stores: parts
/// fetched in parallel), whose entry may be swapped, counting the blobs read.
#[derive(Debug)]
struct Remote {
    store: LocalStore,
    entry: Option<ImageEntry>,
    blobs: AtomicUsize,
}

impl ReadStore for Remote {
    fn describe(&self) -> String {
        "remote double".into()
    }
    fn resolve(&self, reference: &str) -> Result<ImageId, StoreError> {
        self.store.resolve(reference)
    }
    fn get_entry(&self, id: &ImageId) -> Result<ImageEntry, StoreError> {
        match &self.entry {
            Some(e) => Ok(e.clone()),
            None => self.store.get_entry(id),
        }
    }
    fn read_blob(&self, digest: &Sha256Digest) -> Result<Vec<u8>, StoreError> {
        self.blobs.fetch_add(1, Ordering::SeqCst);
        self.store.read_blob(digest)
    }
    fn list_refs(&self) -> Result<Vec<(String, ImageId)>, StoreError> {
        self.store.list_refs()
    }
    fn chunk_source(&self, image: &Arc<OpenImage>) -> Arc<dyn ChunkSource> {
        ReadStore::chunk_source(&self.store, image)
    }
}

#[test]
fn an_entry_naming_another_record_is_inconsistent_before_any_part_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path()).unwrap();
    let img = build_image(&store, 64);
    let remote = Remote { store, entry: None, blobs: AtomicUsize::new(0) };
    remote.open_image(&img.id).unwrap();
    // Record, prefix and pack index.
    assert_eq!(remote.blobs.load(Ordering::SeqCst), 3);

    let other = ImageEntry { record: Sha256Digest::of(b"another image's record"), ..img.entry.clone() };
    let remote = Remote { entry: Some(other), blobs: AtomicUsize::new(0), ..remote };
    let err = remote.open_image(&img.id).unwrap_err();
    assert!(
        matches!(&err, StoreError::Inconsistent { reason, .. } if reason.contains("names record")),
        "{err:?}"
    );
    // The record (its digest is the image ID) may already be on its way; nothing else is read.
    assert!(remote.blobs.load(Ordering::SeqCst) <= 1, "{} blobs read", remote.blobs.load(Ordering::SeqCst));
}

/// Hands over the last range of each call, then fails (a request cut off after its last part
/// came in, as a source handing ranges over out of order may be).
struct LastThenFails<S>(S);

impl<S: ChunkSource> ChunkSource for LastThenFails<S> {
    fn read_stored(&self, pack: &Sha256Digest, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
        self.0.read_stored(pack, offset, len)
    }

    fn read_stored_many(
        &self,
        pack: &Sha256Digest,
        ranges: &[(u64, u32)],
        got: &mut tessera_store::RangeGot<'_>,
    ) -> Result<(), StoreError> {
        let last = ranges.len() - 1;
        got(last, self.0.read_stored(pack, ranges[last].0, ranges[last].1)?);
        Err(StoreError::Io { op: "test", path: "pack".into(), source: std::io::Error::other("cut off") })
    }
}

/// Chunks handed over before their request failed are good; the others share its error.
#[test]
fn chunks_handed_over_before_a_failure_keep_their_bytes_and_the_rest_fail() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path()).unwrap();
    let img = build_image(&store, 64);
    let image = OpenImage::open(&store, &img.id).unwrap();
    let reader = ImageReader::new(image, LastThenFails(store.clone()));
    let map = img.record.block_map.chunks();
    let indexes: Vec<u32> = (0..map.len() as u32).collect();
    let test_chunk = |i: u32| img.chunks.iter().find(|t| t.id == map[i as usize].id).unwrap();
    // The last chunk asked of each pack is the one handed over.
    let last_of_pack = |k: usize| {
        let pack = test_chunk(indexes[k]).pack;
        !indexes[k + 1..].iter().any(|&j| test_chunk(j).pack == pack)
    };
    let mut outcomes = vec![None; indexes.len()];
    reader.fetch_chunks(&indexes, &mut |k, outcome| {
        assert!(outcomes[k].replace(outcome).is_none(), "chunk {k} handed over twice");
    });
    let packs: std::collections::HashSet<Sha256Digest> = img.chunks.iter().map(|t| t.pack).collect();
    assert!(packs.len() >= 2 && indexes.len() > packs.len(), "a pack of several chunks, and another");
    for (k, outcome) in outcomes.into_iter().enumerate() {
        match (last_of_pack(k), outcome.expect("every chunk has an outcome")) {
            (true, Ok(data)) => assert_eq!(data, test_chunk(indexes[k]).data, "chunk {k}"),
            (false, Err(e)) => assert!(e.to_string().contains("test"), "chunk {k}: {e}"),
            (last, other) => panic!("chunk {k} (last of its pack: {last}): {other:?}"),
        }
    }
}

/// Hands a flipped copy of the first range of each batch; single reads (the refetch) are clean,
/// and must not come while a batch is being read (a request inside another's answer could wait
/// for a connection that answer holds).
struct FlipsFirst<S> {
    inner: S,
    in_batch: std::sync::atomic::AtomicBool,
    singles: AtomicUsize,
}

impl<S: ChunkSource> ChunkSource for FlipsFirst<S> {
    fn read_stored(&self, pack: &Sha256Digest, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
        assert!(!self.in_batch.load(Ordering::SeqCst), "a refetch inside a batch's read");
        self.singles.fetch_add(1, Ordering::SeqCst);
        self.inner.read_stored(pack, offset, len)
    }

    fn read_stored_many(
        &self,
        pack: &Sha256Digest,
        ranges: &[(u64, u32)],
        got: &mut tessera_store::RangeGot<'_>,
    ) -> Result<(), StoreError> {
        self.in_batch.store(true, Ordering::SeqCst);
        for (i, &(offset, len)) in ranges.iter().enumerate() {
            let mut bytes = self.inner.read_stored(pack, offset, len)?;
            if i == 0 {
                let mid = bytes.len() / 2;
                bytes[mid] ^= 0x40;
            }
            got(i, bytes);
        }
        self.in_batch.store(false, Ordering::SeqCst);
        Ok(())
    }
}

/// A chunk of a batch whose copy fails verification is fetched again once the batch's read is
/// over, and handed over with the right bytes; the others go over as they come.
#[test]
fn a_corrupt_chunk_of_a_batch_is_fetched_again_after_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path()).unwrap();
    let img = build_image(&store, 64);
    let source =
        FlipsFirst { inner: store.clone(), in_batch: Default::default(), singles: AtomicUsize::new(0) };
    let reader = ImageReader::new(OpenImage::open(&store, &img.id).unwrap(), source);
    let map = img.record.block_map.chunks();
    let indexes: Vec<u32> = (0..map.len() as u32).collect();
    let mut outcomes = vec![None; indexes.len()];
    reader.fetch_chunks(&indexes, &mut |k, outcome| outcomes[k] = Some(outcome));
    for (k, outcome) in outcomes.into_iter().enumerate() {
        let want = &img.chunks.iter().find(|t| t.id == map[k].id).unwrap().data;
        assert_eq!(&outcome.expect("an outcome").unwrap(), want, "chunk {k}");
    }
    let packs: std::collections::HashSet<Sha256Digest> = img.chunks.iter().map(|t| t.pack).collect();
    assert_eq!(reader.source().singles.load(Ordering::SeqCst), packs.len(), "one refetch per batch");
    assert_eq!(reader.refetches(), packs.len() as u64);
}
