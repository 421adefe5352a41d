//! The chunk fetcher behind the memory tier, through libblkio: cold reads of distinct chunks on
//! one queue are fetched all at once, concurrent reads of one chunk fetch it once, sequential
//! reads fetch the file's next chunks ahead, a prefetch list is fetched in the background — and
//! every read returns the image's bytes. The chunk source counts and holds reads (fault
//! injection: no timing).
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use blkio::ReqFlags;
use common::{fixture, reader, Client, Fixture, Running};
use tessera_engine::{FetchLimits, MemTier};
use tessera_image::{SegmentSource, Sha256Digest};
use tessera_store::{ChunkSource, ImageReader, LocalStore, OpenImage, StoreError};
use tessera_vhost::{DeviceConfig, Disk};

/// A chunk source counting reads per pack range and how many run at once; with `rendezvous`
/// set, each read waits (at most 10 s) until that many are in flight together.
struct Counting {
    inner: LocalStore,
    rendezvous: usize,
    state: Mutex<CountState>,
    changed: Condvar,
}

#[derive(Default)]
struct CountState {
    reads: HashMap<(Sha256Digest, u64), usize>,
    in_flight: usize,
    max_in_flight: usize,
}

impl Counting {
    fn new(inner: LocalStore, rendezvous: usize) -> Arc<Self> {
        Arc::new(Self { inner, rendezvous, state: Mutex::default(), changed: Condvar::new() })
    }

    fn reads_of(&self, pack: &Sha256Digest, offset: u64) -> usize {
        self.state.lock().unwrap().reads.get(&(*pack, offset)).copied().unwrap_or(0)
    }

    fn total_reads(&self) -> usize {
        self.state.lock().unwrap().reads.values().sum()
    }
}

impl ChunkSource for Counting {
    fn read_stored(&self, pack: &Sha256Digest, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
        {
            let mut s = self.state.lock().unwrap();
            *s.reads.entry((*pack, offset)).or_default() += 1;
            s.in_flight += 1;
            s.max_in_flight = s.max_in_flight.max(s.in_flight);
            self.changed.notify_all();
            let deadline = Instant::now() + Duration::from_secs(10);
            while s.max_in_flight < self.rendezvous && Instant::now() < deadline {
                s = self.changed.wait_timeout(s, Duration::from_millis(100)).unwrap().0;
            }
        }
        let r = self.inner.read_stored(pack, offset, len);
        self.state.lock().unwrap().in_flight -= 1;
        r
    }
}

fn tier(f: &Fixture, source: &Arc<Counting>, jobs: usize, readahead: u64) -> Arc<MemTier<Arc<Counting>>> {
    tier_with_memory(f, source, jobs, readahead, 64 << 20)
}

fn tier_with_memory(
    f: &Fixture,
    source: &Arc<Counting>,
    jobs: usize,
    readahead: u64,
    memory: u64,
) -> Arc<MemTier<Arc<Counting>>> {
    let image = OpenImage::open(&f.store, &f.id).unwrap();
    let t = MemTier::new(ImageReader::new(image, Arc::clone(source)), memory, FetchLimits::new(jobs))
        .unwrap()
        .with_readahead(readahead);
    Arc::new(t)
}

fn serve(f: &Fixture, t: &Arc<MemTier<Arc<Counting>>>, name: &str) -> Running {
    let device = DeviceConfig::new(&f.id, t.device_bytes(), 1, true);
    Running::serve(&f.dir.path().join(name), device, Disk::Base(t.clone()))
}

/// `(device offset of the chunk's first block, chunk index)` for every chunk, in device order.
fn chunk_starts(f: &Fixture) -> Vec<(u64, u32)> {
    let plain = reader(&f.store, &f.id);
    let g = plain.image().record().geometry;
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for block in g.data_start_block..g.data_end_block {
        let off = block * 4096;
        let seg = plain.image().record().block_map.plan(off, 4096).unwrap().next().unwrap();
        if let SegmentSource::Chunk { chunk, .. } = seg.source {
            if seen.insert(chunk) {
                out.push((off, chunk));
            }
        }
    }
    out
}

fn check(c: &Client, f: &Fixture, slot: usize, off: u64, len: usize) {
    let o = off as usize;
    assert!(c.buf(slot * len, len) == &f.raw[o..o + len], "read at {off}");
}

#[test]
fn cold_reads_of_distinct_chunks_are_fetched_at_once() {
    let f = fixture();
    let targets: Vec<(u64, u32)> = chunk_starts(&f).into_iter().take(32).collect();
    assert_eq!(targets.len(), 32, "the fixture has 32 chunks");
    // Every read waits until all 32 fetches run together: with fewer concurrent fetches the
    // rendezvous times out and `max_in_flight` tells.
    let source = Counting::new(f.store.clone(), 32);
    let t = tier(&f, &source, 64, 0);
    let server = serve(&f, &t, "cold.sock");
    let mut c = Client::connect(&server.socket, 1);
    let start = Instant::now();
    for (i, &(off, _)) in targets.iter().enumerate() {
        let ptr = c.ptr(i * 4096);
        c.queues[0].read(off, ptr, 4096, i, ReqFlags::empty());
    }
    let done = c.complete(0, 32);
    let took = start.elapsed();
    assert!(done.iter().all(|d| d.1 == 0), "{done:?}");
    assert_eq!(source.state.lock().unwrap().max_in_flight, 32, "all 32 fetches ran at once");
    assert!(took < Duration::from_secs(5), "32 cold reads took {took:?} (a rendezvous timed out)");
    for (i, &(off, _)) in targets.iter().enumerate() {
        check(&c, &f, i, off, 4096);
    }
    drop(c);
    server.finish();
}

#[test]
fn concurrent_reads_of_one_chunk_fetch_it_once() {
    let f = fixture();
    let starts = chunk_starts(&f);
    let plain = reader(&f.store, &f.id);
    // A 64 KiB chunk of big.bin: sixteen 4 KiB blocks, each read by its own request at once.
    let (off, chunk) = *starts
        .iter()
        .find(|(_, c)| plain.image().record().block_map.chunks()[*c as usize].len == 64 << 10)
        .unwrap();
    let (_, pack, loc) = plain.image().chunk_location(chunk).unwrap();
    let source = Counting::new(f.store.clone(), 0);
    let t = tier(&f, &source, 16, 0);
    let server = serve(&f, &t, "once.sock");
    let mut c = Client::connect(&server.socket, 1);
    for i in 0..16 {
        let ptr = c.ptr(i * 4096);
        c.queues[0].read(off + i as u64 * 4096, ptr, 4096, i, ReqFlags::empty());
    }
    let done = c.complete(0, 16);
    assert!(done.iter().all(|d| d.1 == 0), "{done:?}");
    for i in 0..16 {
        check(&c, &f, i, off + i as u64 * 4096, 4096);
    }
    assert_eq!(source.reads_of(&pack, loc.offset), 1, "the chunk was fetched once");
    drop(c);
    server.finish();
}

#[test]
fn sequential_reads_fetch_ahead_within_the_file() {
    let f = fixture();
    let starts = chunk_starts(&f);
    let plain = reader(&f.store, &f.id);
    let chunks = plain.image().record().block_map.chunks();
    // Eight full 64 KiB chunks in a row, consecutive on the device and in the chunk list:
    // big.bin (3 MiB of random bytes, 48 chunks).
    let run = (0..starts.len() - 8)
        .find(|&i| {
            (0..8).all(|k| {
                let (o, c) = starts[i + k];
                chunks[c as usize].len == 64 << 10
                    && c == starts[i].1 + k as u32
                    && o == starts[i].0 + k as u64 * (64 << 10)
            })
        })
        .unwrap();
    let (first_off, first) = starts[run];
    let source = Counting::new(f.store.clone(), 0);
    let t = tier(&f, &source, 8, 256 << 10);
    let server = serve(&f, &t, "ahead.sock");
    let mut c = Client::connect(&server.socket, 1);
    // Two sequential 64 KiB reads: the second continues the first, so the next 256 KiB (four
    // chunks) are fetched ahead.
    assert_eq!(c.read(first_off, 0, 64 << 10), 0);
    assert_eq!(c.read(first_off + (64 << 10), 0, 64 << 10), 0);
    check(&c, &f, 0, first_off + (64 << 10), 64 << 10);
    let ahead: Vec<u32> = (2..6).map(|k| first + k).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ahead.iter().all(|&k| t.contains(k)) {
        assert!(Instant::now() < deadline, "readahead did not fetch chunks {ahead:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(!t.contains(first + 6), "readahead is bounded by its window");
    assert_eq!(t.stats().readahead_chunks.load(Ordering::Relaxed), 4);
    let fetched = source.total_reads();
    // The guest then reads them: memory hits, no new fetch but the next readahead's.
    for k in 2..6u64 {
        assert_eq!(c.read(first_off + k * (64 << 10), 0, 64 << 10), 0);
        check(&c, &f, 0, first_off + k * (64 << 10), 64 << 10);
    }
    assert!(t.stats().hits.load(Ordering::Relaxed) >= 4);
    assert!(source.total_reads() >= fetched, "counts only grow");
    // A random (non-sequential) read triggers nothing.
    let before = t.stats().readahead_chunks.load(Ordering::Relaxed);
    let (far, _) = *starts.last().unwrap();
    assert!(far > first_off + (3 << 20), "the last chunk is past big.bin");
    assert_eq!(c.read(far, 0, 4096), 0);
    check(&c, &f, 0, far, 4096);
    assert_eq!(t.stats().readahead_chunks.load(Ordering::Relaxed), before);
    drop(c);
    server.finish();
}

#[test]
fn a_prefetch_list_is_fetched_in_the_background() {
    let f = fixture();
    let plain = reader(&f.store, &f.id);
    let chunks = plain.image().record().block_map.chunks();
    let source = Counting::new(f.store.clone(), 0);
    let t = tier(&f, &source, 4, 0);
    let wanted: Vec<u32> = (0..10).collect();
    let queued = t.prefetch(wanted.iter().map(|&i| chunks[i as usize].id));
    assert_eq!(queued, 10);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !wanted.iter().all(|&i| t.contains(i)) {
        assert!(Instant::now() < deadline, "prefetch did not complete");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(t.stats().prefetch_chunks.load(Ordering::Relaxed), 10);
    let fetched = source.total_reads();
    assert_eq!(fetched, 10);
    // Demand reads of prefetched chunks need no fetch, and return the right bytes.
    let server = serve(&f, &t, "prefetch.sock");
    let mut c = Client::connect(&server.socket, 1);
    for (off, chunk) in chunk_starts(&f) {
        if wanted.contains(&chunk) {
            assert_eq!(c.read(off, 0, 4096), 0);
            check(&c, &f, 0, off, 4096);
        }
    }
    assert_eq!(source.total_reads(), fetched, "prefetched chunks are not fetched again");
    // Chunks already in memory are not queued again.
    assert_eq!(t.prefetch(wanted.iter().map(|&i| chunks[i as usize].id)), 0);
    drop(c);
    server.finish();
}

#[test]
fn without_memory_each_read_fetches_its_chunk_once() {
    let f = fixture();
    let (off, _) = chunk_starts(&f)[3];
    let source = Counting::new(f.store.clone(), 0);
    // --mem-cache 0: nothing is kept, so nothing may be fetched ahead of the copy (it would be
    // gone) and readahead is off.
    let t = tier_with_memory(&f, &source, 8, 2 << 20, 0);
    let server = serve(&f, &t, "nomem.sock");
    let mut c = Client::connect(&server.socket, 1);
    for round in 1..=3 {
        assert_eq!(c.read(off + (round - 1) * 4096, 0, 4096), 0);
        check(&c, &f, 0, off + (round - 1) * 4096, 4096);
        assert_eq!(source.total_reads(), round as usize, "one fetch per read");
    }
    assert_eq!(t.stats().readahead_chunks.load(Ordering::Relaxed), 0);
    drop(c);
    server.finish();
}

/// Decoded bytes of a full chunk of big.bin.
const CHUNK: u64 = 64 << 10;

/// The value of an unlabelled sample in Prometheus text.
fn sample(text: &str, name: &str) -> u64 {
    let line = text.lines().find(|l| l.split_once(' ').is_some_and(|(n, _)| n == name));
    line.and_then(|l| l.split_once(' ')?.1.parse().ok()).unwrap_or_else(|| panic!("{name} missing"))
}

/// The bytes `tessera_prefetch_reason_bytes_total` counts for `reason` and `outcome` (absent: 0).
fn reason_bytes(text: &str, reason: &str, outcome: &str) -> u64 {
    let (r, o) = (format!("reason=\"{reason}\""), format!("outcome=\"{outcome}\""));
    text.lines()
        .find(|l| l.starts_with("tessera_prefetch_reason_bytes_total{") && l.contains(&r) && l.contains(&o))
        .and_then(|l| l.rsplit_once(' ')?.1.parse().ok())
        .unwrap_or(0)
}

/// Every reason's (fetched, used, wasted) bytes, the reasons with none left out.
fn reasons(text: &str) -> Vec<(&'static str, [u64; 3])> {
    ["readahead", "pack_window", "whole_file", "stretch", "elf_deps", "profile"]
        .into_iter()
        .map(|why| (why, ["fetched", "used", "wasted"].map(|o| reason_bytes(text, why, o))))
        .filter(|(_, n)| n.iter().any(|&b| b > 0))
        .collect()
}

#[test]
fn readahead_chunks_are_used_when_read_and_wasted_when_evicted_unread() {
    let f = fixture();
    let starts = chunk_starts(&f);
    let plain = reader(&f.store, &f.id);
    let chunks = plain.image().record().block_map.chunks();
    let full = |i: usize| chunks[starts[i].1 as usize].len == CHUNK as u32;
    let run = (0..starts.len() - 8)
        .find(|&i| {
            (0..8).all(|k| {
                let (o, c) = starts[i + k];
                full(i + k) && c == starts[i].1 + k as u32 && o == starts[i].0 + k as u64 * CHUNK
            })
        })
        .unwrap();
    let (first_off, first) = starts[run];
    let source = Counting::new(f.store.clone(), 0);
    // Room for eight chunks: what the guest reads later pushes the unread readahead out.
    let t = tier_with_memory(&f, &source, 8, 4 * CHUNK, 8 * CHUNK);
    let metrics = tessera_metrics::Metrics::new();
    tessera_engine::metrics::watch_mem_tier(&metrics, &t);
    let server = serve(&f, &t, "waste.sock");
    let mut c = Client::connect(&server.socket, 1);
    // Two sequential reads: readahead brings the next four chunks (first+2 … first+5).
    assert_eq!(c.read(first_off, 0, CHUNK as usize), 0);
    assert_eq!(c.read(first_off + CHUNK, 0, CHUNK as usize), 0);
    let ahead: Vec<u32> = (2..6).map(|k| first + k).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ahead.iter().all(|&k| t.contains(k)) || t.pending_fetches() > 0 {
        assert!(Instant::now() < deadline, "readahead did not fetch chunks {ahead:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    let text = metrics.render();
    assert_eq!(sample(&text, "tessera_prefetch_chunks_total"), 4);
    assert_eq!(sample(&text, "tessera_prefetch_bytes_total"), 4 * CHUNK);
    assert_eq!(sample(&text, "tessera_prefetch_used_bytes_total"), 0);
    assert_eq!(sample(&text, "tessera_prefetch_unused_bytes"), 4 * CHUNK);
    assert_eq!(reasons(&text), [("readahead", [4 * CHUNK, 0, 0])]);

    // The guest reads one block of two of them (not sequentially: no further readahead), the
    // second one twice: each chunk counts once, whole.
    for k in [3u64, 5, 5] {
        assert_eq!(c.read(first_off + k * CHUNK, 0, 4096), 0);
        check(&c, &f, 0, first_off + k * CHUNK, 4096);
    }
    let text = metrics.render();
    assert_eq!(sample(&text, "tessera_prefetch_used_bytes_total"), 2 * CHUNK);
    assert_eq!(sample(&text, "tessera_prefetch_unused_bytes"), 2 * CHUNK);
    assert_eq!(sample(&text, "tessera_prefetch_wasted_bytes_total"), 0);
    assert_eq!(sample(&text, "tessera_prefetch_chunks_total"), 4, "no readahead from those reads");
    assert_eq!(reasons(&text), [("readahead", [4 * CHUNK, 2 * CHUNK, 0])]);

    // Other chunks, each read several times (so the cache's admission policy keeps them), until
    // the two unread chunks are evicted.
    let others: Vec<u64> =
        (0..starts.len()).filter(|&i| full(i) && !(run..run + 8).contains(&i)).map(|i| starts[i].0).collect();
    let mut reads = 0;
    for &off in &others {
        if t.prefetch_unused_bytes() == 0 {
            break;
        }
        for _ in 0..4 {
            assert_eq!(c.read(off, 0, 4096), 0);
            check(&c, &f, 0, off, 4096);
        }
        reads += 1;
    }
    assert_eq!(t.prefetch_unused_bytes(), 0, "unread readahead still held after {reads} other chunks");
    let text = metrics.render();
    assert_eq!(sample(&text, "tessera_prefetch_wasted_bytes_total"), 2 * CHUNK);
    assert_eq!(sample(&text, "tessera_prefetch_used_bytes_total"), 2 * CHUNK);
    assert_eq!(sample(&text, "tessera_prefetch_unused_bytes"), 0);
    assert_eq!(sample(&text, "tessera_prefetch_bytes_total"), 4 * CHUNK, "demand fills are not prefetch");
    assert_eq!(reasons(&text), [("readahead", [4 * CHUNK, 2 * CHUNK, 2 * CHUNK])]);
    drop(c);
    server.finish();
}
