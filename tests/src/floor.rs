//! The link floor of a cold run (issue 15, point 4) and where a cold run's time went.
//!
//! **The floor**: the least a cold start and workload can cost on a link — the stored
//! (compressed) bytes of the distinct chunks the workload's reads touch, plus the metadata a
//! start needs (tag, image entry, record, metadata prefix, pack index), at the link's rate, plus
//! 3 round trips (connect, the metadata, the chunks). It is computed from the request trace and
//! the image's record and pack index, never from what a run fetched, so fetching more than
//! needed cannot raise it.
//!
//! **The breakdown** ([`Breakdown::of`]): from the latency proxy's log of one cold run, the
//! daemon's start (each metadata fetch: when it was asked, when its last byte arrived), the
//! chunk requests (bytes, the link time they cost, bytes beyond the floor's), the serial rounds
//! of requests (a request asked only once every earlier one had finished starts a new round: a
//! round trip nothing overlapped), time with no origin request in flight, and (from the daemon's
//! metrics) demand against background fetches and demand reads that waited on a background
//! fetch already running.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use std::time::Duration;
//! use tessera_e2e::floor::{Link, StoreImage};
//! let image = StoreImage::load("/tmp/store".as_ref(), "web")?;
//! let trace = tessera_e2e::replay::load("boot.requests".as_ref())?;
//! let link = Link { bytes_per_sec: 25_000_000, rtt: Duration::from_millis(20) };
//! println!("{}", image.floor(&trace, link)?.summary());
//! # Ok(()) }
//! ```

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use tessera_image::{
    BlockMap, ImageEntry, ImageId, ImageRecord, PackIndex, PackIndexBlob, RequestOp, RequestTrace,
    SegmentSource, Sha256Digest,
};

use crate::proxy::LoggedRequest;

/// Round trips the floor allows: a connection, the metadata, the chunks.
pub const FLOOR_RTTS: u32 = 3;

/// The modelled network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Link {
    /// Bytes per second.
    pub bytes_per_sec: u64,
    /// Round-trip time.
    pub rtt: Duration,
}

impl Link {
    /// How long `bytes` take on the link (no round trip).
    pub fn transfer(&self, bytes: u64) -> Duration {
        if self.bytes_per_sec == 0 {
            return Duration::ZERO;
        }
        Duration::from_secs_f64(bytes as f64 / self.bytes_per_sec as f64)
    }
}

/// An image as a local store holds it: what the floor and the breakdown need.
#[derive(Debug, Clone)]
pub struct StoreImage {
    pub id: ImageId,
    pub entry: ImageEntry,
    pub record: ImageRecord,
    pub pack_index: PackIndex,
    /// Bytes of the tag file (0 when the image was named by ID), the entry, the record, the
    /// stored prefix and the pack index, as an origin serves them.
    pub metadata: MetadataBytes,
}

/// Bytes of what a start fetches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MetadataBytes {
    pub tag: u64,
    pub entry: u64,
    pub record: u64,
    pub prefix: u64,
    pub pack_index: u64,
}

impl MetadataBytes {
    pub fn total(&self) -> u64 {
        self.tag + self.entry + self.record + self.prefix + self.pack_index
    }
}

impl StoreImage {
    /// Image `reference` (a tag or `sha256:<hex>`) of the local store at `store`, read through
    /// the store layout (`refs/`, `images/`, `blobs/sha256/`).
    pub fn load(store: &Path, reference: &str) -> Result<Self> {
        let (id_text, tag) = match reference.strip_prefix("sha256:") {
            Some(_) => (reference.to_owned(), 0),
            None => {
                let path = store.join("refs").join(reference);
                let text =
                    fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
                // The ID line (then, in refs that name them, the prefix and pack index).
                (crate::tessera::ref_text_id(&text)?.as_str().to_owned(), text.len() as u64)
            }
        };
        let id = ImageId(id_text.parse::<Sha256Digest>().with_context(|| format!("image ID {id_text:?}"))?);
        let entry_path = store.join("images").join(format!("{}.json", id.0.hex()));
        let entry_bytes =
            fs::read(&entry_path).with_context(|| format!("reading {}", entry_path.display()))?;
        let entry = ImageEntry::from_json(&entry_bytes)?;
        let blob = |d: &Sha256Digest| -> Result<Vec<u8>> {
            let path = store.join("blobs").join("sha256").join(d.hex());
            fs::read(&path).with_context(|| format!("reading {}", path.display()))
        };
        let record_bytes = blob(&entry.record)?;
        let record = ImageRecord::decode(&record_bytes)?;
        let pack_index_bytes = blob(&entry.pack_index)?;
        let pack_index = PackIndexBlob::decode(&pack_index_bytes)?.keyed(record.block_map.chunks())?;
        let prefix = fs::metadata(store.join("blobs").join("sha256").join(entry.prefix.hex()))?.len();
        let metadata = MetadataBytes {
            tag,
            entry: entry_bytes.len() as u64,
            record: record_bytes.len() as u64,
            prefix,
            pack_index: pack_index_bytes.len() as u64,
        };
        Ok(Self { id, entry, record, pack_index, metadata })
    }

    /// The floor of `trace`'s reads on `link`.
    pub fn floor(&self, trace: &RequestTrace, link: Link) -> Result<Floor> {
        ensure!(
            trace.header.image == self.id,
            "the trace was recorded against {}, not {}",
            trace.header.image,
            self.id
        );
        let chunks = touched_chunks(&self.record.block_map, reads(trace))?;
        Floor::of(&chunks, &self.record.block_map, &self.pack_index, self.metadata.total(), link)
    }

    /// What request `path` (as the proxy logged it) fetched.
    pub fn classify(&self, path: &str) -> Fetch {
        classify(&self.entry, &self.pack_index, path)
    }
}

/// What request `path` fetched from the image with `entry` and `pack_index`.
pub fn classify(entry: &ImageEntry, pack_index: &PackIndex, path: &str) -> Fetch {
    let path = path.split('?').next().unwrap_or(path);
    if path.contains("/refs/") {
        return Fetch::Tag;
    }
    if path.contains("/images/") {
        return Fetch::Entry;
    }
    let hex = path.rsplit('/').next().unwrap_or_default();
    let is = |d: &Sha256Digest| d.hex() == hex;
    if is(&entry.record) {
        Fetch::Record
    } else if is(&entry.prefix) {
        Fetch::Prefix
    } else if is(&entry.pack_index) {
        Fetch::PackIndex
    } else if pack_index.packs().iter().any(is) {
        Fetch::Pack
    } else {
        Fetch::Other
    }
}

/// The `(offset, len)` in bytes of every read in `trace`.
pub fn reads(trace: &RequestTrace) -> impl Iterator<Item = (u64, u64)> + '_ {
    trace.records.iter().filter(|r| r.op == RequestOp::Read).map(|r| (r.sector.saturating_mul(512), r.len))
}

/// The distinct chunks (BlockMap indexes) the reads `[offset, offset + len)` touch.
pub fn touched_chunks(map: &BlockMap, reads: impl Iterator<Item = (u64, u64)>) -> Result<BTreeSet<u32>> {
    let mut out = BTreeSet::new();
    for (offset, len) in reads {
        for seg in map.plan(offset, len).with_context(|| format!("read of {len} bytes at {offset}"))? {
            if let SegmentSource::Chunk { chunk, .. } = seg.source {
                out.insert(chunk);
            }
        }
    }
    Ok(out)
}

/// The link floor of a cold run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Floor {
    /// Distinct chunks the workload touches.
    pub chunks: u64,
    /// Their stored (compressed) bytes.
    pub chunk_bytes: u64,
    /// Bytes a start fetches (tag, entry, record, stored prefix, pack index).
    pub metadata_bytes: u64,
    pub link: Link,
}

impl Floor {
    /// The floor of fetching `chunks` (BlockMap indexes of `map`, stored as `pack_index` says)
    /// after `metadata_bytes` of metadata on `link`.
    pub fn of(
        chunks: &BTreeSet<u32>,
        map: &BlockMap,
        pack_index: &PackIndex,
        metadata_bytes: u64,
        link: Link,
    ) -> Result<Self> {
        let mut chunk_bytes = 0u64;
        for &c in chunks {
            let r =
                map.chunks().get(c as usize).with_context(|| format!("chunk {c} is not in the BlockMap"))?;
            let (_, loc) =
                pack_index.get(&r.id).with_context(|| format!("chunk {c} is not in the pack index"))?;
            chunk_bytes += u64::from(loc.stored_len);
        }
        Ok(Self { chunks: chunks.len() as u64, chunk_bytes, metadata_bytes, link })
    }

    /// Bytes the floor moves.
    pub fn bytes(&self) -> u64 {
        self.chunk_bytes + self.metadata_bytes
    }

    /// The floor: [`Self::bytes`] at the link's rate plus [`FLOOR_RTTS`] round trips.
    pub fn time(&self) -> Duration {
        self.link.transfer(self.bytes()) + self.link.rtt * FLOOR_RTTS
    }

    /// One line.
    pub fn summary(&self) -> String {
        format!(
            "link floor {:.3} s: {} distinct chunks, {:.2} MiB stored + {:.2} MiB metadata at {:.0} Mbit/s + {FLOOR_RTTS} x {} ms RTT",
            self.time().as_secs_f64(),
            self.chunks,
            mib(self.chunk_bytes),
            mib(self.metadata_bytes),
            self.link.bytes_per_sec as f64 * 8.0 / 1e6,
            self.link.rtt.as_millis()
        )
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / f64::from(1u32 << 20)
}

/// `part` in percent of `whole` (0 for nothing).
fn pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 * 100.0 / whole as f64
    }
}

/// What one origin request fetched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fetch {
    Tag,
    Entry,
    Record,
    Prefix,
    PackIndex,
    /// A range (or all) of a pack: chunk data.
    Pack,
    Other,
}

impl Fetch {
    fn name(self) -> &'static str {
        match self {
            Fetch::Tag => "tag",
            Fetch::Entry => "entry",
            Fetch::Record => "record",
            Fetch::Prefix => "prefix",
            Fetch::PackIndex => "pack index",
            Fetch::Pack => "pack",
            Fetch::Other => "other",
        }
    }
}

/// One metadata fetch of a start, times from the daemon's spawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartFetch {
    pub what: Fetch,
    pub asked: Duration,
    /// `None`: it never finished.
    pub done: Option<Duration>,
    pub bytes: u64,
    /// On a new connection (it paid the connect round trip).
    pub fresh: bool,
}

/// The daemon's fetch counters at the end of a run (`tessera serve --metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FetchCounts {
    /// Chunks fetched for a waiting guest read.
    pub demand: u64,
    /// Chunks fetched by readahead or profile prefetch.
    pub background: u64,
    /// Requests for a chunk already queued or being fetched.
    pub joined: u64,
    /// Demand reads that waited on a background fetch already running.
    pub behind_background: u64,
    /// Decoded bytes of background-fetched chunks no read used.
    pub prefetch_unused_bytes: u64,
    /// Per reason of [`AHEAD_REASONS`]: decoded bytes fetched ahead, and of them used by a read.
    pub ahead: [(u64, u64); AHEAD_REASONS.len()],
}

/// The `reason` labels of `tessera_prefetch_reason_bytes_total`, in the order of
/// [`FetchCounts::ahead`].
pub const AHEAD_REASONS: [&str; 6] =
    ["readahead", "pack_window", "whole_file", "stretch", "elf_deps", "profile"];

/// Where a cold run's time went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Breakdown {
    /// From spawning the daemon to its being ready.
    pub start: Duration,
    /// The metadata fetches of the start, in the order asked.
    pub start_fetches: Vec<StartFetch>,
    /// From ready to the workload's last completion.
    pub workload: Duration,
    /// Chunk (pack) requests, their body bytes, and those on new connections.
    pub chunk_requests: u64,
    pub chunk_bytes: u64,
    pub fresh_connections: u64,
    /// Serial rounds of chunk requests (see the module docs).
    pub rounds: u64,
    /// Time with at least one chunk request in flight, during the workload.
    pub busy: Duration,
    /// Every request's body bytes (metadata included), against the floor's bytes.
    pub origin_bytes: u64,
    pub floor: Floor,
    pub counts: Option<FetchCounts>,
}

impl Breakdown {
    /// The breakdown of one cold run whose daemon was spawned at `spawned`, was ready at
    /// `ready`, and whose workload's last request completed at `end`; `log`: the proxy's
    /// requests from this run only; `classify`: what a request path fetched
    /// ([`StoreImage::classify`]).
    pub fn of(
        classify: impl Fn(&str) -> Fetch,
        log: &[LoggedRequest],
        spawned: Instant,
        ready: Instant,
        end: Instant,
        floor: Floor,
        counts: Option<FetchCounts>,
    ) -> Self {
        let since = |t: Instant| t.saturating_duration_since(spawned);
        let mut start_fetches = Vec::new();
        let mut chunk: Vec<(Instant, Instant)> = Vec::new();
        let (mut chunk_requests, mut chunk_bytes, mut fresh_connections, mut origin_bytes) = (0, 0, 0, 0);
        for r in log {
            origin_bytes += r.body_bytes;
            match classify(&r.path) {
                Fetch::Pack => {
                    chunk_requests += 1;
                    chunk_bytes += r.body_bytes;
                    fresh_connections += u64::from(r.fresh);
                    // Rounds are the workload's: a background fetch started after it ended (the
                    // run waits for them) adds bytes, not round trips.
                    if r.at < end {
                        chunk.push((r.at, r.done.unwrap_or(end).max(r.at)));
                    }
                }
                what => start_fetches.push(StartFetch {
                    what,
                    asked: since(r.at),
                    done: r.done.map(since),
                    bytes: r.body_bytes,
                    fresh: r.fresh,
                }),
            }
        }
        let (rounds, busy) = rounds_and_busy(&mut chunk, ready, end);
        Self {
            start: ready.saturating_duration_since(spawned),
            start_fetches,
            workload: end.saturating_duration_since(ready),
            chunk_requests,
            chunk_bytes,
            fresh_connections,
            rounds,
            busy,
            origin_bytes,
            floor,
            counts,
        }
    }

    /// The run's total: start plus workload.
    pub fn total(&self) -> Duration {
        self.start + self.workload
    }

    /// Human-readable lines.
    pub fn summary(&self) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let link = self.floor.link;
        let mut s = format!(
            "cold run {:.1} ms = {:.2}x the floor ({:.1} ms); origin {:.2} MiB = {:.2}x the floor's {:.2} MiB\n",
            ms(self.total()),
            self.total().as_secs_f64() / self.floor.time().as_secs_f64().max(1e-9),
            ms(self.floor.time()),
            mib(self.origin_bytes),
            self.origin_bytes as f64 / self.floor.bytes().max(1) as f64,
            mib(self.floor.bytes()),
        );
        s.push_str(&format!("  start {:.1} ms:", ms(self.start)));
        for f in &self.start_fetches {
            let done = f.done.map_or_else(|| "never".to_owned(), |d| format!("{:.1}", ms(d)));
            s.push_str(&format!(
                " {} {:.1}..{} ({} B{})",
                f.what.name(),
                ms(f.asked),
                done,
                f.bytes,
                if f.fresh { ", new conn" } else { "" }
            ));
        }
        s.push('\n');
        let link_time = link.transfer(self.chunk_bytes);
        let excess = self.chunk_bytes.saturating_sub(self.floor.chunk_bytes);
        s.push_str(&format!(
            "  workload {:.1} ms: {} chunk requests ({} on new connections), {:.2} MiB = {:.1} ms of link ({:.2} MiB / {:.1} ms beyond the floor's chunks); \
             {} serial rounds = {:.1} ms of RTT; requests in flight {:.1} ms, none in flight {:.1} ms\n",
            ms(self.workload),
            self.chunk_requests,
            self.fresh_connections,
            mib(self.chunk_bytes),
            ms(link_time),
            mib(excess),
            ms(link.transfer(excess)),
            self.rounds,
            ms(link.rtt * u32::try_from(self.rounds).unwrap_or(u32::MAX)),
            ms(self.busy),
            ms(self.workload.saturating_sub(self.busy)),
        ));
        if let Some(c) = self.counts {
            s.push_str(&format!(
                "  fetches: {} demand, {} background (readahead/prefetch; {:.2} MiB never used), {} joined, {} demand reads behind a running background fetch\n",
                c.demand,
                c.background,
                mib(c.prefetch_unused_bytes),
                c.joined,
                c.behind_background
            ));
            let ahead: Vec<String> = AHEAD_REASONS
                .iter()
                .zip(c.ahead)
                .filter(|(_, (fetched, _))| *fetched > 0)
                .map(|(why, (fetched, used))| {
                    format!("{why} {:.2} MiB ({:.0}% used)", mib(fetched), pct(used, fetched))
                })
                .collect();
            if !ahead.is_empty() {
                s.push_str(&format!("  fetched ahead, decoded: {}\n", ahead.join(", ")));
            }
        }
        s
    }
}

/// Serial rounds among request spans `[asked, done)` and the time within `[from, to)` with at
/// least one in flight. Sorts `spans` by when they were asked.
fn rounds_and_busy(spans: &mut [(Instant, Instant)], from: Instant, to: Instant) -> (u64, Duration) {
    spans.sort();
    let mut rounds = 0;
    let mut busy = Duration::ZERO;
    let mut current: Option<(Instant, Instant)> = None;
    for &(a, d) in spans.iter() {
        match &mut current {
            Some((_, end)) if a < *end => *end = (*end).max(d),
            _ => {
                if let Some((s, e)) = current.take() {
                    busy += clip(s, e, from, to);
                }
                rounds += 1;
                current = Some((a, d));
            }
        }
    }
    if let Some((s, e)) = current {
        busy += clip(s, e, from, to);
    }
    (rounds, busy)
}

fn clip(s: Instant, e: Instant, from: Instant, to: Instant) -> Duration {
    e.min(to).saturating_duration_since(s.max(from))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_image::{ChunkId, Compression, PackLocation};

    /// Three chunks of 8 KiB (2 blocks each) at device blocks 1..7, after one prefix block,
    /// stored 1000, 2000 and 3000 bytes in one pack.
    fn image() -> (BlockMap, PackIndex) {
        let mut b = BlockMap::builder(16);
        b.push_prefix(0, 1, 0).unwrap();
        let mut entries = Vec::new();
        for i in 0..3u32 {
            let id = ChunkId([i as u8 + 1; 32]);
            let c = b.add_chunk(id, 8192);
            b.push_chunk(1 + u64::from(i) * 2, 2, c, 0).unwrap();
            entries.push((
                id,
                PackLocation {
                    pack: 0,
                    offset: u64::from(i) * 3000,
                    stored_len: (i + 1) * 1000,
                    raw_len: 8192,
                    compression: Compression::Zstd,
                },
            ));
        }
        (b.finish().unwrap(), PackIndex::new(vec![Sha256Digest([9; 32])], entries))
    }

    const LINK: Link = Link { bytes_per_sec: 1_000_000, rtt: Duration::from_millis(20) };

    #[test]
    fn the_floor_counts_each_touched_chunk_once_at_its_stored_size() {
        let (map, index) = image();
        // Two reads of chunk 0 (blocks 1 and 2), one spanning the end of chunk 1 and the start
        // of chunk 2, one of the prefix and one past the data (zeros).
        let reads = [(4096, 4096), (8192, 512), (4 * 4096, 2 * 4096), (0, 4096), (10 * 4096, 4096)];
        let chunks = touched_chunks(&map, reads.into_iter()).unwrap();
        assert_eq!(chunks.into_iter().collect::<Vec<_>>(), vec![0, 1, 2]);
        let only_first = touched_chunks(&map, [(4096, 100), (8000, 100)].into_iter()).unwrap();
        let floor = Floor::of(&only_first, &map, &index, 500, LINK).unwrap();
        assert_eq!((floor.chunks, floor.chunk_bytes, floor.bytes()), (1, 1000, 1500));
        // 1500 bytes at 1 MB/s (1.5 ms) plus 3 RTT.
        assert_eq!(floor.time(), Duration::from_micros(1500) + 3 * LINK.rtt);
        let all = touched_chunks(&map, reads.into_iter()).unwrap();
        assert_eq!(Floor::of(&all, &map, &index, 0, LINK).unwrap().chunk_bytes, 6000);
        // A read outside the device is an error, not a smaller floor.
        assert!(touched_chunks(&map, [(16 * 4096, 1)].into_iter()).is_err());
    }

    #[test]
    fn rounds_count_requests_nothing_overlapped() {
        let t = Instant::now();
        let ms = |n: u64| t + Duration::from_millis(n);
        // Three overlapping (one round), then one alone, then two overlapping: 3 rounds; in
        // flight 0..40, 50..70, 80..110.
        let mut spans = vec![
            (ms(80), ms(100)),
            (ms(0), ms(20)),
            (ms(10), ms(40)),
            (ms(5), ms(15)),
            (ms(50), ms(70)),
            (ms(90), ms(110)),
        ];
        let (rounds, busy) = rounds_and_busy(&mut spans, t, ms(200));
        assert_eq!(rounds, 3);
        assert_eq!(busy, Duration::from_millis(40 + 20 + 30));
        // Clipped to the window asked about.
        let (_, busy) = rounds_and_busy(&mut spans, ms(10), ms(60));
        assert_eq!(busy, Duration::from_millis(30 + 10));
    }

    #[test]
    fn the_breakdown_splits_start_and_chunk_requests() {
        let (map, index) = image();
        let t = Instant::now();
        let ms = |n: u64| t + Duration::from_millis(n);
        let entry = ImageEntry {
            record: Sha256Digest([1; 32]),
            prefix: Sha256Digest([2; 32]),
            pack_index: Sha256Digest([3; 32]),
            profile: None,
            provenance: None,
        };
        let record_hex = entry.record.hex();
        let prefix_hex = entry.prefix.hex();
        let metadata = MetadataBytes { tag: 72, entry: 300, record: 1000, prefix: 2000, pack_index: 500 };
        let req = |path: String, at: u64, done: u64, bytes: u64, fresh: bool| LoggedRequest {
            method: "GET".into(),
            path,
            range: None,
            fault: None,
            at: ms(at),
            connection: 1,
            fresh,
            body_bytes: bytes,
            done: Some(ms(done)),
        };
        let pack = format!("/s/blobs/sha256/{}", Sha256Digest([9; 32]).hex());
        let log = vec![
            req("/s/refs/web".into(), 0, 40, 72, true),
            req(format!("/s/blobs/sha256/{record_hex}"), 40, 60, 1000, false),
            req(format!("/s/blobs/sha256/{prefix_hex}"), 40, 62, 2000, true),
            req(pack.clone(), 100, 140, 3000, true),
            req(pack, 150, 170, 1000, false),
        ];
        let chunks = touched_chunks(&map, [(4096, 4096)].into_iter()).unwrap();
        let floor = Floor::of(&chunks, &map, &index, metadata.total(), LINK).unwrap();
        let b = Breakdown::of(|p| classify(&entry, &index, p), &log, t, ms(70), ms(180), floor, None);
        assert_eq!(b.start, Duration::from_millis(70));
        let whats: Vec<Fetch> = b.start_fetches.iter().map(|f| f.what).collect();
        assert_eq!(whats, vec![Fetch::Tag, Fetch::Record, Fetch::Prefix]);
        assert_eq!(b.start_fetches[2].done, Some(Duration::from_millis(62)));
        assert_eq!((b.chunk_requests, b.chunk_bytes, b.fresh_connections, b.rounds), (2, 4000, 1, 2));
        assert_eq!(b.busy, Duration::from_millis(60));
        assert_eq!(b.workload, Duration::from_millis(110));
        assert_eq!(b.origin_bytes, 7072);
        let text = b.summary();
        assert!(text.contains("2 serial rounds"), "{text}");
    }
}
