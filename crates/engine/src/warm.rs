//! `tessera warm`: fill the host disk cache with an image before VMs need it — its metadata
//! (tag lookup, entry, record, prefix, pack index, profile) and its chunks (all, or only the
//! profile's), so the cache serves the image with the origin unreachable.
//!
//! Each chunk is first looked up in the cache (present and verified: nothing is fetched), else
//! fetched through the cache's fetch-once path and published atomically. So a second run asks the
//! origin for no data, and a run killed at any point resumes where it stopped. The chunks are
//! warmed on the engine's [`ChunkFetcher`] (the pool `serve` fetches on), `--jobs` requests at a
//! time, each bringing a run of chunks stored back to back in pack order (up to
//! [`WARM_RUN_BYTES`]): one request per chunk kept a 20 ms-RTT link a fifth busy.

use std::collections::HashSet;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_image::{ChunkId, ChunkRef, ImageId, PackLocation, Sha256Digest, Window};
use tessera_store::{
    decode_stored_chunk, read_profile, refetch_if_corrupt, CachedStore, Origin, ReadStore, StoreError,
};
use tracing::{debug, warn};

use crate::fetcher::{ChunkFetcher, ChunkPlace, FetchLimits, Priority};
use crate::packorder::PackOrder;

/// `--jobs` unless told otherwise: requests in flight at once.
pub const DEFAULT_WARM_JOBS: usize = 8;

/// Stored bytes one warm request brings at most (a run of chunks stored back to back): 8 in
/// flight keep 8 MiB on the wire, several times a 1 Gbit/s × 20 ms link's 2.5 MB, and a run's
/// chunks are cached as soon as its request ends.
pub const WARM_RUN_BYTES: u64 = 1 << 20;

/// What to warm.
#[derive(Debug, Clone, Copy)]
pub struct WarmOptions {
    /// Only the chunks of the image's prefetch profile (the image must have one).
    pub profile_only: bool,
    /// Chunk fetches in flight at once (at least 1).
    pub jobs: usize,
    /// At most this many stored bytes per second start fetching (`None`: as fast as the link
    /// and `jobs` allow), through the fetcher's bandwidth cap for background fetches
    /// ([`FetchLimits::background_bytes_per_sec`]: up to a second's worth at once, then paced).
    pub rate: Option<u64>,
}

impl Default for WarmOptions {
    fn default() -> Self {
        Self { profile_only: false, jobs: DEFAULT_WARM_JOBS, rate: None }
    }
}

/// A chunk that could not be warmed.
#[derive(Debug)]
pub struct WarmFailure {
    pub chunk: ChunkId,
    pub error: StoreError,
}

/// The outcome of [`warm`].
#[derive(Debug)]
pub struct WarmReport {
    pub image: ImageId,
    /// Chunks the run covered (all of the image's, or the profile's).
    pub chunks: u64,
    /// Their stored (compressed) bytes.
    pub bytes: u64,
    /// Chunks that were already in the cache (verified), and their stored bytes.
    pub present_chunks: u64,
    pub present_bytes: u64,
    /// Chunks fetched from the origin (or from a concurrent fetch of another process) and cached.
    pub fetched_chunks: u64,
    pub fetched_bytes: u64,
    /// Chunks that could not be fetched or did not verify.
    pub failed: Vec<WarmFailure>,
    /// Whether the image has a prefetch profile.
    pub has_profile: bool,
    pub elapsed: Duration,
}

/// One chunk to warm — or, for a `--reference-layers` image, one checkpoint span (`span`: its
/// blake3; `pack`, `loc.offset` and `loc.stored_len`: its range of the layer blob; `chunk`: the
/// first chunk that needs it, for messages).
#[derive(Debug, Clone, Copy)]
struct Target {
    chunk: ChunkRef,
    pack: Sha256Digest,
    loc: PackLocation,
    span: Option<[u8; 32]>,
}

/// A warmed target: its position and outcome.
type Done = (usize, Result<Outcome, StoreError>);

enum Outcome {
    Present,
    Fetched,
}

/// Warm the cache of `store` with image `reference` (a tag or `sha256:…`): metadata first, then
/// chunks with `options.jobs` workers, in profile order first. `progress` is called with the
/// stored bytes of each chunk done (present, fetched or failed). Metadata failures are errors;
/// chunk failures are collected in the report.
pub fn warm<O: Origin + 'static>(
    store: &Arc<CachedStore<O>>,
    reference: &str,
    options: WarmOptions,
    start: &(dyn Fn(u64) + Sync),
    progress: &dyn Fn(u64),
) -> Result<WarmReport, StoreError> {
    let began = Instant::now();
    // Each of these goes through the cache: the tag lookup and the entry are cached as the
    // origin answers them, the blobs are fetched once and kept.
    let id = store.resolve(reference)?;
    let image = store.open_image(&id)?;
    let map = &image.record().block_map;
    let profile = read_profile(&**store, &id, image.entry(), map)?.map(|(_, p)| p);
    if options.profile_only && profile.is_none() {
        return Err(StoreError::NoProfile { image: id });
    }

    let mut order: Vec<u32> =
        profile.iter().flat_map(|p| p.entries()).filter_map(|e| image.chunk_index(&e.chunk)).collect();
    if !options.profile_only {
        order.extend(0..u32::try_from(map.chunks().len()).unwrap_or(u32::MAX));
    }
    let mut seen = HashSet::new();
    let mut seen_spans = HashSet::new();
    let mut targets = Vec::with_capacity(order.len());
    for index in order {
        if !seen.insert(index) {
            continue;
        }
        let (chunk, pack, loc) = image.chunk_location(index).ok_or_else(|| StoreError::Inconsistent {
            image: id,
            reason: format!("chunk #{index} has no pack location"),
        })?;
        let Some(reference) = image.reference() else {
            targets.push(Target { chunk, pack, loc, span: None });
            continue;
        };
        // A reference image caches checkpoint spans: warm each span a chunk needs, once.
        let Some((layer, place)) = reference.locate(index) else { continue };
        let Some((first, last)) = layer.spans_covering(place.offset, u64::from(place.len)) else { continue };
        for cp in &layer.checkpoints[first..=last] {
            if !seen_spans.insert(cp.span_digest) {
                continue;
            }
            let stored_len = u32::try_from(cp.span_end - cp.start()).unwrap_or(u32::MAX);
            let at = PackLocation { offset: cp.start(), stored_len, ..loc };
            targets.push(Target { chunk, pack, loc: at, span: Some(cp.span_digest) });
            // A version-2 index's window of the span, a range of the windows blob.
            if let (Some(w), Window::Stored { offset, len, digest }) = (&reference.index.windows, &cp.window)
            {
                if *len > 0 && seen_spans.insert(*digest) {
                    let at = PackLocation { offset: *offset, stored_len: *len, ..loc };
                    targets.push(Target { chunk, pack: w.digest, loc: at, span: Some(*digest) });
                }
            }
        }
    }
    let bytes: u64 = targets.iter().map(|t| u64::from(t.loc.stored_len)).sum();
    start(bytes);
    debug!(image = %id, chunks = targets.len(), bytes, "warming");

    // Each target is one fetcher chunk keyed by its position in `targets`: the fetcher runs
    // `options.jobs` requests at once, each target once, and takes the targets stored back to
    // back in pack order as one run (one ranged request); outcomes are collected by position.
    let targets = Arc::new(targets);
    let results: Arc<Mutex<Vec<Done>>> = Arc::new(Mutex::new(Vec::with_capacity(targets.len())));
    let (tx, rx) = mpsc::channel::<u64>();
    let fetcher = {
        let (store, targets, results) = (Arc::clone(store), Arc::clone(&targets), Arc::clone(&results));
        let jobs = options.jobs.clamp(1, targets.len().max(1));
        // A paced warm queues its targets as background fetches, which the cap applies to, on
        // one thread more than `jobs` (the fetcher keeps one for demand, here never used), in
        // runs of at most an eighth of a second's worth (at least 64 KiB): the link sees the cap
        // as a steady rate, not as 1 MiB bursts.
        let limits = match options.rate {
            None => {
                FetchLimits { batch_bytes: WARM_RUN_BYTES, sparse_demand: true, ..FetchLimits::new(jobs) }
            }
            Some(rate) => FetchLimits {
                batch_bytes: WARM_RUN_BYTES.min((rate / 8).max(64 << 10)),
                background_jobs: jobs,
                background_bytes_per_sec: Some(rate.max(1)),
                ..FetchLimits::new(jobs + 1)
            },
        };
        let place = {
            let targets = Arc::clone(&targets);
            move |i: u32| target_place(targets.get(i as usize)?)
        };
        let order = PackOrder::new(targets.len(), |i| targets.get(i as usize).and_then(target_place));
        ChunkFetcher::start_in_order(
            limits,
            move |batch, _| {
                let run: Vec<&Target> = batch.iter().filter_map(|&i| targets.get(i as usize)).collect();
                for (&i, outcome) in batch.iter().zip(warm_run(&store, &run)) {
                    if let Some(t) = targets.get(i as usize) {
                        lock(&results).push((i as usize, outcome));
                        let _ = tx.send(u64::from(t.loc.stored_len));
                    }
                }
                batch.iter().map(|_| Ok(())).collect()
            },
            place,
            Some(Arc::new(order)),
        )
        .map_err(|source| StoreError::Io {
            op: "starting the warm threads",
            path: Default::default(),
            source,
        })?
    };
    // Targets apart in a pack go out together when the origin answers multi-range GETs.
    let origin_store = Arc::clone(store);
    fetcher.set_ranges_per_request(move || origin_store.origin().ranges_per_request());
    let all: Vec<u32> = (0..u32::try_from(targets.len()).unwrap_or(u32::MAX)).collect();
    let priority = if options.rate.is_some() { Priority::Prefetch } else { Priority::Demand };
    fetcher.fetch(&all, priority, None);
    // Every target reports once (single flight); progress is reported on this thread.
    for bytes in rx.iter().take(targets.len()) {
        progress(bytes);
    }
    drop(fetcher);

    let mut report = WarmReport {
        image: id,
        chunks: targets.len() as u64,
        bytes,
        present_chunks: 0,
        present_bytes: 0,
        fetched_chunks: 0,
        fetched_bytes: 0,
        failed: Vec::new(),
        has_profile: profile.is_some(),
        elapsed: Duration::ZERO,
    };
    let mut results = std::mem::take(&mut *lock(&results));
    results.sort_by_key(|r| r.0);
    for (i, outcome) in results {
        let t = &targets[i];
        let len = u64::from(t.loc.stored_len);
        match outcome {
            Ok(Outcome::Present) => {
                report.present_chunks += 1;
                report.present_bytes += len;
            }
            Ok(Outcome::Fetched) => {
                report.fetched_chunks += 1;
                report.fetched_bytes += len;
            }
            Err(error) => {
                warn!(chunk = %t.chunk.id, error = &error as &dyn std::error::Error, "cannot warm a chunk");
                report.failed.push(WarmFailure { chunk: t.chunk.id, error });
            }
        }
    }
    report.elapsed = began.elapsed();
    Ok(report)
}

/// Where a target is stored, for runs (a checkpoint span is warmed alone).
fn target_place(t: &Target) -> Option<ChunkPlace> {
    t.span.is_none().then_some(ChunkPlace {
        pack: t.loc.pack,
        offset: t.loc.offset,
        stored_len: t.loc.stored_len,
    })
}

/// A run of targets (one target, or chunks stored back to back in one pack): each already
/// cached (verified) or fetched, verified and cached — the missing chunks of a run with one
/// ranged request through the cache's fetch-once path ([`tessera_store::DiskCache::fetch_chunks`]).
fn warm_run<O: Origin>(store: &CachedStore<O>, run: &[&Target]) -> Vec<Result<Outcome, StoreError>> {
    let [first, ..] = run else { return Vec::new() };
    if run.len() == 1 || first.span.is_some() {
        return run.iter().map(|t| warm_chunk(store, t)).collect();
    }
    let cache = store.cache();
    let pack = first.pack;
    let mut out: Vec<Option<Result<Outcome, StoreError>>> = run
        .iter()
        .map(|t| cache.get_chunk(&t.chunk, &t.pack, &t.loc).map(|_| Ok(Outcome::Present)))
        .collect();
    let missing: Vec<usize> = (0..run.len()).filter(|&k| out[k].is_none()).collect();
    if !missing.is_empty() {
        let members: Vec<(ChunkRef, PackLocation)> =
            missing.iter().map(|&k| (run[k].chunk, run[k].loc)).collect();
        let origin = store.origin();
        let fetched = cache.fetch_chunks_decoded(&pack, &members, |wanted| {
            let ranges: Vec<(u64, u32)> =
                wanted.iter().map(|&w| (members[w].1.offset, members[w].1.stored_len)).collect();
            tessera_store::read_all(origin, &pack, &ranges)
        });
        match fetched {
            Ok(stored) => {
                for (&k, (bytes, data)) in missing.iter().zip(stored) {
                    let t = run[k];
                    // What the origin sent must decode to its id (the cache keeps only bytes
                    // that check out, but hands back what it got: `data` is what its check
                    // decoded); a chunk that does not is fetched on its own under the read
                    // path's refetch policy: the run's copy was its first.
                    let first = match data {
                        Some(_) => Ok(Outcome::Fetched),
                        None => {
                            decode_stored_chunk(&t.chunk, &t.pack, &t.loc, &bytes).map(|_| Outcome::Fetched)
                        }
                    };
                    out[k] = Some(refetch_if_corrupt(first, || warm_once(store, t)));
                }
            }
            Err(e) => {
                // The run's request failed: each chunk on its own, so one bad range (or a
                // failure of the run's request) costs no chunk that can be warmed.
                debug!(
                    error = &e as &dyn std::error::Error,
                    chunks = missing.len(),
                    "a warm run failed; chunk by chunk"
                );
                for &k in &missing {
                    out[k] = Some(warm_chunk(store, run[k]));
                }
            }
        }
    }
    out.into_iter().map(|o| o.unwrap_or_else(|| Err(crate::fetcher::no_outcome()))).collect()
}

/// One chunk (or span): already cached (verified) or fetched, verified and cached, a copy that
/// fails verification fetched again — the read path's one refetch policy
/// ([`refetch_if_corrupt`]), so `warm` gives up on a chunk exactly when `serve` would.
fn warm_chunk<O: Origin>(store: &CachedStore<O>, t: &Target) -> Result<Outcome, StoreError> {
    refetch_if_corrupt(warm_once(store, t), || warm_once(store, t))
}

/// One attempt at [`warm_chunk`].
fn warm_once<O: Origin>(store: &CachedStore<O>, t: &Target) -> Result<Outcome, StoreError> {
    let cache = store.cache();
    if let Some(digest) = &t.span {
        if cache.get_span(digest).is_some() {
            return Ok(Outcome::Present);
        }
        let origin = store.origin();
        cache.fetch_span(&t.pack, t.loc.offset, digest, || {
            origin.read_stored(&t.pack, t.loc.offset, t.loc.stored_len)
        })?;
        return Ok(Outcome::Fetched);
    }
    if cache.get_chunk(&t.chunk, &t.pack, &t.loc).is_some() {
        return Ok(Outcome::Present);
    }
    let origin = store.origin();
    let got = cache.fetch_chunks_decoded(&t.pack, &[(t.chunk, t.loc)], |_| {
        Ok(vec![origin.read_stored(&t.pack, t.loc.offset, t.loc.stored_len)?])
    })?;
    // The cache keeps only bytes that check out, but hands back what the origin sent: a chunk
    // that does not decode to its id (no data from the check) is a failure, not a warmed chunk.
    match got.into_iter().next() {
        Some((_, Some(_))) => Ok(Outcome::Fetched),
        Some((stored, None)) => {
            decode_stored_chunk(&t.chunk, &t.pack, &t.loc, &stored).map(|_| Outcome::Fetched)
        }
        None => Err(crate::fetcher::no_outcome()),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
