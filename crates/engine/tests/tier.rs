//! The memory tier's index (its per-chunk slots) holds exactly what its policy (moka) keeps:
//! under memory pressure, after evictions and refused admissions, every chunk a read finds in
//! memory is one the byte budget counts, and a chunk held is served without the chunk source.
#![allow(clippy::unwrap_used)]

#[path = "../../store/tests/common/mod.rs"]
mod common;
mod engine_common;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use common::{build_image, Counting};
use engine_common::{first_offset_of, read_first_byte_of};
use tessera_engine::{Ahead, BlockDevice, FetchLimits, MemTier};
use tessera_store::{ImageReader, LocalStore, OpenImage};

/// A tier of `capacity` bytes over the test image, its counted source, and the chunks' bytes.
type Fixture =
    (tempfile::TempDir, MemTier<Arc<Counting<LocalStore>>>, Arc<Counting<LocalStore>>, Vec<Vec<u8>>);

fn tier(capacity: u64) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path().join("store")).unwrap();
    let img = build_image(&store, 64);
    let image = Arc::new(OpenImage::open(&store, &img.id).unwrap());
    // Chunk data by the record's chunk index.
    let data = (0..image.record().block_map.chunks().len() as u32)
        .map(|i| ImageReader::new(Arc::clone(&image), store.clone()).fetch_chunk(i).unwrap())
        .collect();
    let source = Arc::new(Counting::new(store));
    let tier =
        MemTier::new(ImageReader::new(image, Arc::clone(&source)), capacity, FetchLimits::new(2)).unwrap();
    (dir, tier, source, data)
}

/// The chunks the slots hold, after moka has run its pending evictions.
fn held(tier: &MemTier<Arc<Counting<LocalStore>>>, n: usize) -> Vec<u32> {
    tier.weighted_size(); // runs pending tasks (evictions, refused admissions)
    (0..n as u32).filter(|&i| tier.contains(i)).collect()
}

#[test]
fn slots_hold_what_the_budget_counts() {
    // The test image's chunks: ~12.4 KB, 8 KiB, 32 KiB, 100 B; 40 KiB holds some, not all.
    let capacity = 40 << 10;
    let (_dir, tier, source, data) = tier(capacity);
    let n = data.len();
    for round in 0..20 {
        for i in 0..n as u32 {
            // Skew the popularity, so the policy has something to choose.
            let times = if i % 2 == 0 { 3 } else { 1 };
            for _ in 0..times {
                let got = tier.chunk(i).unwrap();
                assert_eq!(&got[..], &data[i as usize][..], "round {round}: chunk {i}");
            }
        }
        let h = held(&tier, n);
        assert_eq!(h.len() as u64, tier.chunks(), "round {round}: slots {h:?} vs the policy's entries");
        let bytes: u64 = h.iter().map(|&i| data[i as usize].len() as u64).sum();
        assert_eq!(bytes, tier.weighted_size(), "round {round}: slot bytes vs the policy's weight");
        assert!(bytes <= capacity, "round {round}: {bytes} B held over a {capacity} B budget");
    }
    // A chunk held is served from memory: no read reaches the source.
    let h = held(&tier, n);
    assert!(!h.is_empty());
    let before = source.reads.load(Ordering::Relaxed);
    for &i in &h {
        assert_eq!(&tier.chunk(i).unwrap()[..], &data[i as usize][..]);
    }
    assert_eq!(source.reads.load(Ordering::Relaxed), before, "held chunks {h:?} went to the source");
}

#[test]
fn a_chunk_larger_than_the_budget_is_never_held() {
    let (_dir, tier, _source, data) = tier(16 << 10);
    let n = data.len();
    let big = (0..n).find(|&i| data[i].len() > 16 << 10).unwrap() as u32;
    for _ in 0..5 {
        assert_eq!(&tier.chunk(big).unwrap()[..], &data[big as usize][..]);
    }
    assert!(!held(&tier, n).contains(&big), "a {} B chunk held within 16 KiB", data[big as usize].len());
}

#[test]
fn no_memory_holds_nothing() {
    let (_dir, tier, source, data) = tier(0);
    for i in 0..data.len() as u32 {
        assert_eq!(&tier.chunk(i).unwrap()[..], &data[i as usize][..]);
        assert!(!tier.contains(i));
    }
    let before = source.reads.load(Ordering::Relaxed);
    tier.chunk(0).unwrap();
    assert!(source.reads.load(Ordering::Relaxed) > before, "with no memory every read goes to the source");
}

/// The image's chunks in pack order: (pack, offset, chunk index).
fn pack_order(image: &OpenImage) -> Vec<(u32, u64, u32)> {
    let n = image.record().block_map.chunks().len() as u32;
    let mut order: Vec<(u32, u64, u32)> = (0..n)
        .map(|i| {
            let (_, _, loc) = image.chunk_location(i).unwrap();
            (loc.pack, loc.offset, i)
        })
        .collect();
    order.sort();
    order
}

#[test]
fn a_miss_also_fetches_what_follows_it_in_its_pack() {
    let (_dir, tier, _source, _data) = tier(1 << 20);
    let tier = tier.with_pack_readahead(1 << 20);
    let image = tier.reader().image();
    let n = image.record().block_map.chunks().len() as u32;
    let order = pack_order(image);
    // A one-byte read of the pack's first chunk misses only that chunk.
    assert!(read_first_byte_of(&tier, image, order[0].2));
    // The chunks stored after it in the same pack arrive too, in the background.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let same_pack: Vec<u32> = order.iter().filter(|o| o.0 == order[0].0).map(|o| o.2).collect();
    assert!(same_pack.len() > 1, "the test image packs several chunks together");
    while !same_pack.iter().all(|&c| tier.contains(c)) {
        assert!(
            std::time::Instant::now() < deadline,
            "only {:?} of {same_pack:?} in memory",
            held(&tier, n as usize)
        );
        std::thread::sleep(std::time::Duration::from_millis(5)); // polling interval
    }
    assert_eq!(tier.stats().pack_window_chunks.load(Ordering::Relaxed), same_pack.len() as u64 - 1);
    assert_eq!(tier.stats().readahead_chunks.load(Ordering::Relaxed), 0, "no file was read sequentially");
    // Counted as the pack window's, unused until a read takes one of them (once, however often).
    let window = tier.stats().ahead(Ahead::PackWindow);
    let len = |c: u32| u64::from(image.record().block_map.chunks()[c as usize].len);
    let window_bytes: u64 = same_pack[1..].iter().map(|&c| len(c)).sum();
    assert_eq!(window.fetched_bytes.load(Ordering::Relaxed), window_bytes);
    assert_eq!(window.used_bytes.load(Ordering::Relaxed), 0);
    for _ in 0..2 {
        tier.read_at(first_offset_of(image, same_pack[1]), &mut [0u8; 1]).unwrap();
    }
    assert_eq!(window.used_bytes.load(Ordering::Relaxed), len(same_pack[1]));
    assert_eq!(tier.prefetch_unused_bytes(), window_bytes - len(same_pack[1]));
    for other in Ahead::ALL.into_iter().filter(|&w| w != Ahead::PackWindow) {
        assert_eq!(tier.stats().ahead(other).fetched_bytes.load(Ordering::Relaxed), 0, "{other:?}");
    }
}

#[test]
fn a_miss_on_a_chunk_already_queued_adds_no_pack_window() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path().join("store")).unwrap();
    let img = build_image(&store, 64);
    let image = Arc::new(OpenImage::open(&store, &img.id).unwrap());
    // A background budget of one byte a second: the first prefetched chunk starts, the rest
    // stay queued.
    let limits = FetchLimits { background_bytes_per_sec: Some(1), ..FetchLimits::new(2) };
    let tier = MemTier::new(ImageReader::new(Arc::clone(&image), store), 1 << 20, limits)
        .unwrap()
        .with_pack_readahead(1 << 20);
    let order = pack_order(&image);
    let (first, last) = (order[0].2, order[order.len() - 1].2);
    assert_ne!(first, last);
    let ids = [last, first].map(|i| image.record().block_map.chunks()[i as usize].id);
    assert_eq!(tier.prefetch(ids), 2);
    assert!(tier.fetcher().is_pending(first), "the second prefetched chunk waits for budget");
    assert!(read_first_byte_of(&tier, &image, first), "the read is promoted and served");
    assert!(tier.contains(first));
    assert_eq!(
        tier.stats().pack_window_chunks.load(Ordering::Relaxed),
        0,
        "a chunk the profile had queued carries no pack-order window"
    );
}

/// Counts a source's single chunk reads (the path of the origin's join) and its batch reads.
struct Paths {
    inner: LocalStore,
    single: std::sync::atomic::AtomicUsize,
    many: std::sync::atomic::AtomicUsize,
}

impl tessera_store::ChunkSource for Paths {
    fn read_stored(
        &self,
        pack: &tessera_image::Sha256Digest,
        offset: u64,
        len: u32,
    ) -> Result<Vec<u8>, tessera_store::StoreError> {
        self.single.fetch_add(1, Ordering::Relaxed);
        self.inner.read_stored(pack, offset, len)
    }

    fn read_stored_many(
        &self,
        pack: &tessera_image::Sha256Digest,
        ranges: &[(u64, u32)],
        got: &mut tessera_store::RangeGot<'_>,
    ) -> Result<(), tessera_store::StoreError> {
        self.many.fetch_add(1, Ordering::Relaxed);
        each_range(ranges, got, |offset, len| self.inner.read_stored(pack, offset, len))
    }
}

/// A batch read as single reads, one range after another.
fn each_range(
    ranges: &[(u64, u32)],
    got: &mut tessera_store::RangeGot<'_>,
    read: impl Fn(u64, u32) -> Result<Vec<u8>, tessera_store::StoreError>,
) -> Result<(), tessera_store::StoreError> {
    for (i, &(offset, len)) in ranges.iter().enumerate() {
        got(i, read(offset, len)?);
    }
    Ok(())
}

/// A guest read's single chunk goes through the source's single read (where an origin joins
/// the reads of a burst); a background single chunk through its batch read (nothing to join:
/// and a single read under way makes a demand miss arriving meanwhile wait to be joined).
#[test]
fn a_background_chunk_does_not_take_the_path_of_the_join() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path().join("store")).unwrap();
    let img = build_image(&store, 64);
    let image = Arc::new(OpenImage::open(&store, &img.id).unwrap());
    let source = Arc::new(Paths { inner: store, single: Default::default(), many: Default::default() });
    let tier =
        MemTier::new(ImageReader::new(Arc::clone(&image), Arc::clone(&source)), 1 << 20, FetchLimits::new(2))
            .unwrap();
    let order = pack_order(&image);
    let (first, last) = (order[0].2, order[order.len() - 1].2);
    assert_ne!(first, last);
    assert_eq!(tier.prefetch([image.record().block_map.chunks()[last as usize].id]), 1);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !tier.contains(last) {
        assert!(std::time::Instant::now() < deadline, "the prefetched chunk did not arrive");
        std::thread::sleep(std::time::Duration::from_millis(5)); // polling interval
    }
    let reads = |s: &Paths| (s.single.load(Ordering::Relaxed), s.many.load(Ordering::Relaxed));
    assert_eq!(reads(&source), (0, 1), "the prefetched chunk: one batch read");
    assert!(read_first_byte_of(&tier, &image, first));
    assert_eq!(reads(&source), (1, 1), "the guest read's chunk: one single read");
}

/// A chunk the policy does not keep (here: larger than the whole memory budget; under pressure:
/// refused by TinyLFU's admission, or evicted before the read copies it) is still the bytes of the
/// read that waited for it: the read copies the chunk that was fetched for it instead of fetching
/// it again — inside the fetch that brought it, on a remote store, where it could wait for a
/// connection that fetch holds.
#[test]
fn a_read_gets_the_chunk_fetched_for_it_even_when_memory_does_not_keep_it() {
    // The test image's chunks: ~12.4 KB, 8 KiB, 32 KiB, 100 B; 8 KiB of memory.
    let (_dir, tier, source, data) = tier(8 << 10);
    let tier = Arc::new(tier);
    let image = Arc::clone(tier.reader().shared_image());
    for big in (0..data.len()).filter(|&i| data[i].len() > 8 << 10) {
        let big = big as u32;
        let before = source.reads();
        let got = deferred_read(&tier, first_offset_of(&image, big), 4096);
        assert_eq!(&got[..], &data[big as usize][..4096], "chunk {big}");
        tier.weighted_size();
        assert!(!tier.contains(big), "chunk {big} held: the test shows nothing");
        assert_eq!(source.reads() - before, 1, "chunk {big} fetched again for the read that waited for it");
    }

    // A read across two chunks stored back to back goes out as one batch (whose chunks are
    // handed over as they arrive): the one memory does not keep is not fetched again either.
    let before = source.reads();
    let batched = MemTier::new(
        ImageReader::new(Arc::clone(&image), Arc::clone(&source)),
        8 << 10,
        FetchLimits { batch_bytes: tessera_engine::DEFAULT_BATCH_BYTES, ..FetchLimits::new(2) },
    )
    .unwrap();
    // Chunk a's last block (device block 13: its 100-byte tail, then zeros) and chunk b's first.
    let got = deferred_read(&Arc::new(batched), 13 * 4096, 2 * 4096);
    let a_tail = &data[0][3 * 4096..];
    assert_eq!(&got[..a_tail.len()], a_tail, "the end of chunk a");
    assert_eq!(&got[4096..], &data[1][..4096], "the start of chunk b");
    assert_eq!(source.reads() - before, 2, "each chunk of the batch fetched once");
}

/// A read of `len` bytes at `offset` the way the daemon defers one: its chunks fetched ahead,
/// then, on the fetch's thread once they are in, copied out of the tier — after the policy's
/// pending work has run (on another thread, in a daemon), so what it refuses is gone.
fn deferred_read<S: tessera_store::ChunkSource + 'static>(
    tier: &Arc<MemTier<S>>,
    offset: u64,
    len: usize,
) -> Vec<u8> {
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = Arc::clone(tier);
    tier.fetch_ahead(
        offset,
        len as u64,
        Box::new(move |fetched| {
            reader.weighted_size();
            let mut buf = vec![0u8; len];
            let read = fetched
                .map_err(|e| e.to_string())
                .and_then(|()| reader.read_at(offset, &mut buf).map_err(|e| e.to_string()));
            let _ = tx.send(read.map(|()| buf));
        }),
    );
    rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap().unwrap()
}

/// A source whose reads of one stored chunk wait until the test opens the gate (the other
/// reads go through at once): a fetch held in flight while the test changes memory under it.
struct Gated {
    inner: Arc<Counting<LocalStore>>,
    /// The gated chunk's pack and stored offset.
    at: (tessera_image::Sha256Digest, u64),
    open: std::sync::Mutex<bool>,
    opened: std::sync::Condvar,
    /// Reads that reached the gate.
    waiting: std::sync::atomic::AtomicUsize,
}

impl Gated {
    fn pass(&self, pack: &tessera_image::Sha256Digest, offset: u64) {
        if (*pack, offset) != self.at {
            return;
        }
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.opened.wait(open).unwrap();
        }
    }

    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

impl tessera_store::ChunkSource for Gated {
    fn read_stored(
        &self,
        pack: &tessera_image::Sha256Digest,
        offset: u64,
        len: u32,
    ) -> Result<Vec<u8>, tessera_store::StoreError> {
        self.pass(pack, offset);
        self.inner.read_stored(pack, offset, len)
    }

    fn read_stored_many(
        &self,
        pack: &tessera_image::Sha256Digest,
        ranges: &[(u64, u32)],
        got: &mut tessera_store::RangeGot<'_>,
    ) -> Result<(), tessera_store::StoreError> {
        each_range(ranges, got, |offset, len| self.read_stored(pack, offset, len))
    }
}

/// A deferred read's chunk that was in memory when the read was deferred, and that memory
/// evicts while the read waits for its other chunk, is copied from the copy held for the read:
/// not fetched again (inside the fetch that brings the other chunk).
#[test]
fn a_chunk_in_memory_when_its_read_waits_is_not_fetched_again_if_evicted_meanwhile() {
    // The test image's chunks: a ~12.4 KB at device blocks 10..14, b 8 KiB at 14..16, d 100 B.
    let (_dir, plain, counting, data) = tier(0);
    let image = Arc::clone(plain.reader().shared_image());
    let (a, b, d) = (0u32, 1u32, 3u32);
    assert_eq!((data[b as usize].len(), data[d as usize].len()), (8 << 10, 100));
    let b_at = first_offset_of(&image, b);
    assert_eq!(first_offset_of(&image, a) + 4 * 4096, b_at, "a's four blocks are followed by b's");
    let (_, pack, place) = image.chunk_location(a).unwrap();
    let source = Arc::new(Gated {
        inner: Arc::clone(&counting),
        at: (pack, place.offset),
        open: std::sync::Mutex::new(false),
        opened: std::sync::Condvar::new(),
        waiting: Default::default(),
    });
    // Memory for b, or for d and a, but not for b and d together.
    let tier = Arc::new(
        MemTier::new(
            ImageReader::new(Arc::clone(&image), Arc::clone(&source)),
            (8 << 10) + 50,
            FetchLimits::new(2),
        )
        .unwrap(),
    );
    assert!(read_first_byte_of(&*tier, &image, b));
    tier.weighted_size();
    assert!(tier.contains(b), "b is in memory before the read");

    // A read of a's last block and b's first: b is in memory, a goes to the (gated) source.
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = Arc::clone(&tier);
    let offset = b_at - 4096;
    tier.fetch_ahead(
        offset,
        8192,
        Box::new(move |fetched| {
            let mut buf = vec![0u8; 8192];
            let read = fetched
                .map_err(|e| e.to_string())
                .and_then(|()| reader.read_at(offset, &mut buf).map_err(|e| e.to_string()));
            let _ = tx.send(read.map(|()| buf));
        }),
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while source.waiting.load(Ordering::SeqCst) == 0 {
        assert!(std::time::Instant::now() < deadline, "a's fetch never reached the source");
        std::thread::sleep(std::time::Duration::from_millis(1)); // polling interval
    }
    // While a is in flight, d pushes b out (d read a few times: the policy admits a chunk read
    // more often than the one it would evict).
    for _ in 0..16 {
        if !tier.contains(b) {
            break;
        }
        assert!(read_first_byte_of(&*tier, &image, d));
        tier.weighted_size();
    }
    assert!(!tier.contains(b), "b still in memory: the test shows nothing");
    let before = counting.reads();
    source.open();
    let got = rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap().unwrap();
    let a_tail = &data[a as usize][3 * 4096..];
    assert_eq!(&got[..a_tail.len()], a_tail, "a's last block");
    assert_eq!(&got[4096..], &data[b as usize][..4096], "b's first block");
    assert_eq!(counting.reads() - before, 1, "only a fetched: b was copied from the copy held for the read");
}
