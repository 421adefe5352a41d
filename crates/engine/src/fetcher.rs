//! The chunk fetcher: the engine's one pool of worker threads. It fetches chunks by priority,
//! and runs the frontends' jobs (finishing a deferred guest read, an export's piece) beside the
//! demand fetches, so serve, export and warm need no thread pool of their own.
//!
//! - **Demand** fetches (a guest read is waiting) always go first; any free thread takes one.
//! - **Background** fetches (readahead, profile prefetch) run only when no demand fetch is
//!   queued, at most [`FetchLimits::background_jobs`] at a time (so demand fetches always find
//!   free threads) and within [`FetchLimits::background_bytes_per_sec`] of stored bytes.
//! - **Single flight**: a chunk is fetched once however many reads (and background requests)
//!   want it at the same time; every waiter is told when it arrives. A demand request for a chunk
//!   still queued in the background promotes it.
//! - **Batches**: a thread taking a chunk off a queue also takes the chunks queued right behind
//!   it that are stored right behind it in the same pack, up to [`FetchLimits::batch_bytes`]:
//!   one request to the origin brings the run (an export's pieces, a large guest read, a
//!   readahead window), and the threads keep separate runs in flight in parallel. Given the
//!   pack order ([`ChunkFetcher::start_in_order`]) the run follows it through every queued
//!   chunk of its kind (demand, or background), whatever its queue or position: the chunks
//!   stored right before and after the one taken, so a profile's chunks queued in first-touch
//!   order still go out as runs. A demand batch carries no background chunk: a miss's
//!   pack-order window goes out as a request of its own beside the miss, so the read waits for
//!   its own bytes only (measured: `docs/benchmarks.md`, "Demand batches without the window").
//!
//! The fetcher knows chunks only by BlockMap index and where they are stored ([`ChunkPlace`]);
//! what "fetch" means (the memory tier's verified fetch through the disk cache to the origin) is
//! the closure it is built with.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tessera_store::StoreError;
use tracing::{trace, warn};

use crate::packorder::PackOrder;

/// What a waiter learns once every chunk it asked for is in memory (or one failed).
pub type FetchResult = Result<(), Arc<StoreError>>;

/// Called once the chunks a read needs are all fetched (or one failed), on a fetcher thread.
pub type FetchDone = Box<dyn FnOnce(FetchResult) + Send>;

/// Work a frontend runs on the fetcher's threads ([`ChunkFetcher::run`]).
pub type Job = Box<dyn FnOnce() + Send>;

/// [`FetchLimits::batch_bytes`] for a remote store: stored bytes one fetch (one request) may
/// bring.
pub const DEFAULT_BATCH_BYTES: u64 = 4 << 20;

/// The cap on a batch a prefetch (profile) chunk starts, within [`FetchLimits::batch_bytes`]: a
/// profile's prefetch goes out over more of the connections the start has opened up instead of a
/// few long runs on one connection each (python's 8.6 MiB at 1 Gbit/s took 13 requests, the
/// last two of 1.8 and 2.0 MB ending 30 ms after the others: docs/benchmarks.md). Readahead keeps
/// the whole cap: 1 MiB for every batch cost a cold gcc start at 1 Gbit/s ~3 % (its whole-file
/// readahead in more parallel requests, sharing the link with the guest's misses).
pub const PREFETCH_BATCH_BYTES: u64 = 1 << 20;

/// Most stored bytes of a background batch that takes runs apart in its pack (a source that
/// fetches several ranges in one request: [`ChunkFetcher::set_ranges_per_request`]): about one
/// round trip's worth of a 200 Mbit/s link at 20 ms, so a guest read that catches up with the
/// batch does not wait long for the rest of it.
pub const SPARSE_BATCH_BYTES: u64 = 512 << 10;

/// Queued background chunks a background batch looks through for runs apart in its pack.
const SPARSE_SCAN: usize = 1024;

/// Failed chunks remembered at most (a storm of failures costs bounded memory).
const MAX_REMEMBERED_FAILURES: usize = 4096;

/// [`FetchLimits::failure_memory`] unless told otherwise.
pub const DEFAULT_FAILURE_MEMORY: Duration = Duration::from_secs(2);

/// Default number of fetcher threads for a local store (a `pread` each).
pub const DEFAULT_LOCAL_FETCH_JOBS: usize = 4;
/// Default number of fetcher threads for a remote store: enough concurrent requests to hide the
/// origin's round trip for a queue full of cold reads (brief §7: 32 cold reads in ≤ 3 RTTs).
pub const DEFAULT_REMOTE_FETCH_JOBS: usize = 64;

/// Why a chunk is fetched, most urgent first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Priority {
    /// A guest read waits for it.
    Demand,
    /// A sequential reader will want it soon (background: only when no demand fetch waits).
    Readahead,
    /// A prefetch profile names it (background, behind readahead).
    Prefetch,
}

impl Priority {
    fn queue(self) -> usize {
        match self {
            Priority::Demand => 0,
            Priority::Readahead => 1,
            Priority::Prefetch => 2,
        }
    }
}

/// How many fetches run at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchLimits {
    /// Threads (concurrent fetches of any kind), at least 1.
    pub jobs: usize,
    /// Background fetches running at once (at most `jobs - 1` when `jobs > 1`, so demand
    /// always has a thread).
    pub background_jobs: usize,
    /// Stored bytes per second background fetches may start (`None`: unlimited).
    pub background_bytes_per_sec: Option<u64>,
    /// Most stored bytes of adjacent chunks one fetch takes together (a chunk larger than it
    /// is fetched alone; 0: one chunk per fetch).
    pub batch_bytes: u64,
    /// How long a chunk whose fetch failed for a reason of its own fails again at once, without
    /// a new fetch (zero: never remembered). Its own reasons: its bytes failed verification in
    /// every copy the refetch policy took ([`tessera_store::VERIFY_ATTEMPTS`]), or its pack or
    /// range is not at the origin (404, 410, a range past the blob's end) — asking again at once
    /// gets the same answer, at the cost of that many requests per guest read. A failure of the
    /// origin itself (refused connections, timeouts, 5xx) is not remembered: the transport's
    /// failing state makes those single attempts, and a read right after the origin is back
    /// must succeed.
    pub failure_memory: Duration,
    /// Whether demand batches, too, take runs apart in their pack (given a source that fetches
    /// them in one request: [`ChunkFetcher::set_ranges_per_request`]). Off for a daemon, whose
    /// guest reads each wait for their whole batch; on for `tessera warm`, where every chunk is
    /// queued as demand and nobody waits for one in particular.
    pub sparse_demand: bool,
}

impl FetchLimits {
    /// `jobs` threads; half of them (at least 1) for background fetches; no bandwidth cap; one
    /// chunk per fetch (a local store: a `pread` each).
    pub fn new(jobs: usize) -> Self {
        let jobs = jobs.max(1);
        Self {
            jobs,
            background_jobs: (jobs / 2).max(1),
            background_bytes_per_sec: None,
            batch_bytes: 0,
            failure_memory: DEFAULT_FAILURE_MEMORY,
            sparse_demand: false,
        }
    }

    /// The limits for a store of this kind: [`DEFAULT_LOCAL_FETCH_JOBS`], one chunk per fetch
    /// for a local one; [`DEFAULT_REMOTE_FETCH_JOBS`] and batches of [`DEFAULT_BATCH_BYTES`] for
    /// a remote one (a request costs a round trip); `jobs` overrides the thread count.
    pub fn for_store(remote: bool, jobs: Option<usize>) -> Self {
        let (default_jobs, batch_bytes) = if remote {
            (DEFAULT_REMOTE_FETCH_JOBS, DEFAULT_BATCH_BYTES)
        } else {
            (DEFAULT_LOCAL_FETCH_JOBS, 0)
        };
        Self { batch_bytes, ..Self::new(jobs.unwrap_or(default_jobs)) }
    }

    fn background_cap(&self) -> usize {
        let cap = self.background_jobs.max(1);
        if self.jobs > 1 {
            cap.min(self.jobs - 1)
        } else {
            cap
        }
    }
}

/// Counters of a [`ChunkFetcher`].
#[derive(Debug, Default)]
pub struct FetcherStats {
    /// Chunks fetched for demand.
    pub demand: std::sync::atomic::AtomicU64,
    /// Chunks fetched in the background.
    pub background: std::sync::atomic::AtomicU64,
    /// Requests for a chunk already being fetched or queued (single flight).
    pub joined: std::sync::atomic::AtomicU64,
    /// Queued fetches promoted to a more urgent priority before they started.
    pub promoted: std::sync::atomic::AtomicU64,
    /// Most fetches running at the same time.
    pub max_running: AtomicUsize,
    /// Chunks fetched in a batch behind another chunk (a request saved: fetches run are
    /// `demand + background - batched`).
    pub batched: std::sync::atomic::AtomicU64,
    /// Demand requests for a chunk a background fetch had already started (the read waits for
    /// readahead or prefetch instead of being first in line).
    pub behind_background: std::sync::atomic::AtomicU64,
    /// Requests for a chunk that had failed moments before ([`FetchLimits::failure_memory`]),
    /// failed at once without a fetch.
    pub remembered_failures: std::sync::atomic::AtomicU64,
    /// Fetch threads started (they start as work needs them, up to [`FetchLimits::jobs`]).
    pub threads: AtomicUsize,
}

/// Where a chunk is stored: what batching and the background bandwidth cap look at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkPlace {
    /// The pack holding it (its number in the image's pack index).
    pub pack: u32,
    /// Offset of its stored bytes in the pack.
    pub offset: u64,
    /// Stored (compressed) length.
    pub stored_len: u32,
}

impl ChunkPlace {
    /// Whether `next` is stored right after this one in the same pack.
    fn followed_by(&self, next: &ChunkPlace) -> bool {
        self.pack == next.pack && self.offset.checked_add(u64::from(self.stored_len)) == Some(next.offset)
    }
}

/// Where a fetch hands each chunk's outcome (the chunk's position in the batch) as soon as it is
/// known ([`ChunkFetcher::start_handing_over`]).
pub type Arrived<'a> = dyn FnMut(usize, FetchResult) + 'a;

/// Fetch chunks `indexes` (a batch stored back to back in one pack, or a single chunk) into
/// memory, handing each chunk's outcome over as it is known; `background[i]`: chunk `i` is for
/// readahead or prefetch (no guest read asked for it).
type FetchFn = dyn Fn(&[u32], &[bool], &mut Arrived<'_>) + Send + Sync;
type PlaceFn = dyn Fn(u32) -> Option<ChunkPlace> + Send + Sync;
type RangesFn = dyn Fn() -> usize + Send + Sync;

/// The fetcher threads and their queues. Dropping it stops the threads once the demand queue is
/// empty (queued background fetches are dropped); it does not join them (a thread may be the one
/// dropping it, from a completion callback).
pub struct ChunkFetcher {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ChunkFetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkFetcher").field("limits", &self.shared.limits).finish_non_exhaustive()
    }
}

struct Shared {
    limits: FetchLimits,
    fetch: Box<FetchFn>,
    place: Box<PlaceFn>,
    /// Pack order: batches follow it through queued chunks.
    order: Option<Arc<PackOrder>>,
    /// Separate ranges of one pack the source fetches in one request (unset: 1).
    ranges: std::sync::OnceLock<Box<RangesFn>>,
    state: Mutex<State>,
    wake: Condvar,
    stats: FetcherStats,
    /// The CPUs of the thread that started the fetcher (`serve --cpus fetch=LIST` pins it):
    /// threads started later, from a queue worker's read, take these instead of their creator's.
    cpus: Option<rustix::thread::CpuSet>,
}

struct State {
    /// One queue per [`Priority`] (a promoted chunk also stays in its old queue, where it is
    /// skipped once started).
    queues: [VecDeque<u32>; 3],
    /// Frontend jobs, run with demand priority (after the queued demand fetches).
    jobs: VecDeque<Job>,
    entries: HashMap<u32, Entry>,
    running: usize,
    running_background: usize,
    /// Background byte budget (token bucket; may go negative by one chunk).
    tokens: f64,
    refilled: Instant,
    stopped: bool,
    /// Threads started (at most `limits.jobs`: they are started as work needs them).
    threads: usize,
    /// Threads waiting for work; threads telling the waiters of a finished fetch (they look at
    /// the queues again before they wait); and how many of either were claimed for new work
    /// and have not yet taken it.
    idle: usize,
    finishing: usize,
    woken: usize,
    /// Chunks whose last fetch failed for a reason of their own, until when that is remembered
    /// ([`FetchLimits::failure_memory`]).
    failed: HashMap<u32, (Instant, Arc<StoreError>)>,
}

/// Whether fetching the chunk again at once would fail the same way (see
/// [`FetchLimits::failure_memory`]).
fn failure_of_the_chunk(e: &StoreError) -> bool {
    use tessera_store::HttpError;
    matches!(
        e,
        StoreError::CorruptChunk { .. }
            | StoreError::CorruptSpan { .. }
            | StoreError::RangeOutOfBounds { .. }
            | StoreError::Http { source: HttpError::Status(404 | 410 | 416), .. }
    )
}

struct Entry {
    started: bool,
    priority: Priority,
    waiters: Vec<Arc<Waiter>>,
}

/// One request waiting for several chunks.
struct Waiter {
    /// Chunks not arrived yet, plus one while they are being registered.
    remaining: AtomicUsize,
    error: Mutex<Option<Arc<StoreError>>>,
    done: Mutex<Option<FetchDone>>,
}

impl Waiter {
    fn arrived(&self, result: &FetchResult) {
        if let Err(e) = result {
            lock(&self.error).get_or_insert_with(|| Arc::clone(e));
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            let error = lock(&self.error).take();
            let done = lock(&self.done).take();
            if let Some(done) = done {
                done(error.map_or(Ok(()), Err));
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves the state consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ChunkFetcher {
    /// Start `limits.jobs` threads running `fetch(indexes, background)` (fetch those chunks into
    /// memory and return one outcome per chunk, in order; `background[i]` when no guest read
    /// asked for chunk `i`, i.e. readahead or prefetch). `place(index)` says where the chunk is
    /// stored: chunks stored back to back and queued together are fetched in one batch, and the
    /// stored size is charged against the background bandwidth (`None`: not batched, costs
    /// nothing).
    pub fn start(
        limits: FetchLimits,
        fetch: impl Fn(&[u32], &[bool]) -> Vec<FetchResult> + Send + Sync + 'static,
        place: impl Fn(u32) -> Option<ChunkPlace> + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        Self::start_in_order(limits, fetch, place, None)
    }

    /// [`Self::start`] with the pack order of `place` (its [`PackOrder`]): a batch takes every
    /// queued chunk stored right before or after the ones it holds, in any queue, within
    /// [`FetchLimits::batch_bytes`] (batches on: `batch_bytes > 0`).
    pub fn start_in_order(
        limits: FetchLimits,
        fetch: impl Fn(&[u32], &[bool]) -> Vec<FetchResult> + Send + Sync + 'static,
        place: impl Fn(u32) -> Option<ChunkPlace> + Send + Sync + 'static,
        order: Option<Arc<PackOrder>>,
    ) -> std::io::Result<Self> {
        let each = move |chunks: &[u32], background: &[bool], arrived: &mut Arrived<'_>| {
            for (k, outcome) in fetch(chunks, background).into_iter().enumerate() {
                arrived(k, outcome);
            }
        };
        Self::start_handing_over(limits, each, place, order)
    }

    /// [`Self::start_in_order`] with a fetch that hands each chunk's outcome to `arrived` (its
    /// position in the batch) as soon as it is known — each once, in any order; a chunk it never
    /// hands over fails. The chunk's waiters are told at once: a read waiting for the first
    /// chunk of a long batch (a readahead window it caught up with) goes on while the rest of
    /// the batch is on the wire.
    pub fn start_handing_over(
        limits: FetchLimits,
        fetch: impl Fn(&[u32], &[bool], &mut Arrived<'_>) + Send + Sync + 'static,
        place: impl Fn(u32) -> Option<ChunkPlace> + Send + Sync + 'static,
        order: Option<Arc<PackOrder>>,
    ) -> std::io::Result<Self> {
        let limits = FetchLimits { jobs: limits.jobs.max(1), ..limits };
        let shared = Arc::new(Shared {
            limits,
            fetch: Box::new(fetch),
            place: Box::new(place),
            order,
            ranges: std::sync::OnceLock::new(),
            state: Mutex::new(State {
                queues: Default::default(),
                jobs: VecDeque::new(),
                entries: HashMap::new(),
                running: 0,
                running_background: 0,
                tokens: 0.0,
                refilled: Instant::now(),
                stopped: false,
                failed: HashMap::new(),
                threads: 1,
                idle: 0,
                finishing: 0,
                woken: 0,
            }),
            wake: Condvar::new(),
            stats: FetcherStats::default(),
            cpus: rustix::thread::sched_getaffinity(None).ok(),
        });
        let fetcher = Self { shared };
        fetcher.spawn_thread(0)?;
        Ok(fetcher)
    }

    fn spawn_thread(&self, number: usize) -> std::io::Result<()> {
        let s = Arc::clone(&self.shared);
        std::thread::Builder::new().name(format!("tessera-chunk-{number}")).spawn(move || {
            if let Some(cpus) = &s.cpus {
                if let Err(e) = rustix::thread::sched_setaffinity(None, cpus) {
                    warn!(error = %e, "cannot keep a fetch thread on the fetcher's CPUs");
                }
            }
            s.run()
        })?;
        self.shared.stats.threads.fetch_max(number + 1, Ordering::Relaxed);
        Ok(())
    }

    /// Set `want` threads to work on what was just queued (at most all of them): idle ones are
    /// woken; while fewer than `limits.jobs` exist, new ones are started instead of waiting for a
    /// busy one to finish (a cold burst of reads gets its fetches in flight at once; a warmed
    /// daemon whose reads come one at a time keeps a thread or two, not 64 to start and to
    /// schedule). Called with the state locked; the threads are started after.
    fn find_threads(&self, st: &mut State, want: usize) -> Spawn {
        let want = want.min(self.shared.limits.jobs);
        let spare = (st.idle + st.finishing).saturating_sub(st.woken);
        let wake = want.min(spare);
        st.woken += wake;
        let new = (want - wake).min(self.shared.limits.jobs.saturating_sub(st.threads));
        st.threads += new;
        Spawn { wake, first: st.threads - new, new }
    }

    fn start_threads(&self, spawn: Spawn) {
        for _ in 0..spawn.wake {
            self.shared.wake.notify_one();
        }
        for number in spawn.first..spawn.first + spawn.new {
            if let Err(e) = self.spawn_thread(number) {
                // The threads running take the work in turn.
                warn!(error = &e as &dyn std::error::Error, "cannot start a fetch thread");
                lock(&self.shared.state).threads -= 1;
            }
        }
    }

    /// Let background batches (given the pack order) take runs of queued chunks apart in their
    /// pack, up to `ranges()` runs and [`SPARSE_BATCH_BYTES`]: the source fetches that many
    /// separate ranges of a pack in one request (an HTTP origin answering multi-range GETs). A
    /// profile's chunks of files scattered over a pack then cost a few requests, not one per
    /// file. Asked at every batch (the source may find out it cannot). Set once; later calls are
    /// ignored.
    pub fn set_ranges_per_request(&self, ranges: impl Fn() -> usize + Send + Sync + 'static) {
        let _ = self.shared.ranges.set(Box::new(ranges));
    }

    /// The limits.
    pub fn limits(&self) -> FetchLimits {
        self.shared.limits
    }

    /// Counters.
    pub fn stats(&self) -> &FetcherStats {
        &self.shared.stats
    }

    /// Whether chunk `index` is queued or being fetched.
    pub fn is_pending(&self, index: u32) -> bool {
        lock(&self.shared.state).entries.contains_key(&index)
    }

    /// Fetches queued or running.
    pub fn pending(&self) -> usize {
        lock(&self.shared.state).entries.len()
    }

    /// Run `job` on a fetcher thread with demand priority (behind the demand fetches queued
    /// before it, ahead of every background fetch). Jobs queued when the fetcher is dropped
    /// still run.
    pub fn run(&self, job: Job) {
        let spawn = {
            let mut st = lock(&self.shared.state);
            st.jobs.push_back(job);
            self.find_threads(&mut st, 1)
        };
        self.start_threads(spawn);
    }

    /// Fetch `chunks` (the caller has checked they are not in memory; one that arrived meanwhile
    /// costs a memory lookup) with `priority`; call `done` once all are in (or one failed). With
    /// no chunks, `done` runs at once on this thread.
    pub fn fetch(&self, chunks: &[u32], priority: Priority, done: Option<FetchDone>) {
        self.fetch_with_ahead(chunks, priority, done, &[]);
    }

    /// [`Self::fetch`], and `ahead` queued for readahead in the same step (before any thread can
    /// take one of `chunks`): a miss and its window go out at once, as requests of their own
    /// ([`Self::start_in_order`]), so the read waits for its own bytes only.
    pub fn fetch_with_ahead(
        &self,
        chunks: &[u32],
        priority: Priority,
        done: Option<FetchDone>,
        ahead: &[u32],
    ) {
        let waiter = done.map(|d| {
            Arc::new(Waiter {
                remaining: AtomicUsize::new(1),
                error: Mutex::new(None),
                done: Mutex::new(Some(d)),
            })
        });
        let (failed, spawn) = {
            let mut st = lock(&self.shared.state);
            let mut queued = Vec::new();
            let failed = self.register(&mut st, chunks, priority, waiter.as_ref(), &mut queued);
            let mut queued_ahead = Vec::new();
            self.register(&mut st, ahead, Priority::Readahead, None, &mut queued_ahead);
            // One thread per batch the queued chunks can form, not one per chunk nor all of them:
            // with 64 threads on a few CPUs, waking every one for each guest read cost ~0.2 ms a
            // miss (measured: a warmed daemon's serial reads 83.5 → 41.8 ms in all with 4
            // threads instead of 64), and a miss with a 100-chunk window woke a hundred threads
            // for two batches, each to find nothing and sleep again.
            let want = self.shared.batches_in(&queued, priority)
                + self.shared.batches_in(&queued_ahead, Priority::Readahead);
            (failed, self.find_threads(&mut st, want))
        };
        self.start_threads(spawn);
        for (w, e) in failed {
            w.arrived(&Err(e));
        }
        if let Some(w) = waiter {
            // Release the registration guard: done runs here if everything already arrived.
            w.arrived(&Ok(()));
        }
    }

    /// Queue `chunks` (joining fetches already queued or running), noting in `queued` those
    /// put on a queue (new, or promoted); the waiters of those that failed moments before, each
    /// with its error, to be told once the state is unlocked.
    fn register(
        &self,
        st: &mut State,
        chunks: &[u32],
        priority: Priority,
        waiter: Option<&Arc<Waiter>>,
        queued: &mut Vec<u32>,
    ) -> Vec<(Arc<Waiter>, Arc<StoreError>)> {
        let mut failed = Vec::new();
        let now = (!st.failed.is_empty()).then(Instant::now);
        for &c in chunks {
            if let Some(w) = waiter {
                w.remaining.fetch_add(1, Ordering::AcqRel);
            }
            if let Some(now) = now {
                match st.failed.get(&c) {
                    Some((until, e)) if now < *until => {
                        self.shared.stats.remembered_failures.fetch_add(1, Ordering::Relaxed);
                        if let Some(w) = waiter {
                            failed.push((Arc::clone(w), Arc::clone(e)));
                        }
                        continue;
                    }
                    Some(_) => {
                        st.failed.remove(&c);
                    }
                    None => {}
                }
            }
            match st.entries.get_mut(&c) {
                Some(e) => {
                    self.shared.stats.joined.fetch_add(1, Ordering::Relaxed);
                    if let Some(w) = waiter {
                        e.waiters.push(Arc::clone(w));
                    }
                    if priority == Priority::Demand && e.started && e.priority != Priority::Demand {
                        self.shared.stats.behind_background.fetch_add(1, Ordering::Relaxed);
                    }
                    if priority < e.priority && !e.started {
                        e.priority = priority;
                        st.queues[priority.queue()].push_back(c);
                        queued.push(c);
                        self.shared.stats.promoted.fetch_add(1, Ordering::Relaxed);
                    }
                }
                None => {
                    let waiters = waiter.into_iter().cloned().collect();
                    st.entries.insert(c, Entry { started: false, priority, waiters });
                    st.queues[priority.queue()].push_back(c);
                    queued.push(c);
                }
            }
        }
        failed
    }
}

/// Threads to wake and to start ([`ChunkFetcher::find_threads`]): `new` of them numbered from
/// `first`.
struct Spawn {
    wake: usize,
    first: usize,
    new: usize,
}

impl Drop for ChunkFetcher {
    fn drop(&mut self) {
        lock(&self.shared.state).stopped = true;
        self.shared.wake.notify_all();
    }
}

impl Shared {
    /// How many batches `chunks` (in the order given, queued with `priority`) form at most
    /// ([`Self::gather`]): one per run stored back to back within the batch cap of their
    /// priority; one per chunk without batches. An upper bound (given the pack order, a batch
    /// also takes a run's neighbours queued before, and a background batch runs apart in its
    /// pack).
    fn batches_in(&self, chunks: &[u32], priority: Priority) -> usize {
        if self.limits.batch_bytes == 0 {
            return chunks.len();
        }
        let cap = self.batch_cap(priority.queue());
        let mut batches = 0;
        let mut last: Option<(ChunkPlace, u64)> = None;
        for &c in chunks {
            let place = (self.place)(c);
            last = match (last, place) {
                (Some((prev, bytes)), Some(p))
                    if prev.followed_by(&p) && bytes + u64::from(p.stored_len) <= cap =>
                {
                    Some((p, bytes + u64::from(p.stored_len)))
                }
                _ => {
                    batches += 1;
                    place.map(|p| (p, u64::from(p.stored_len)))
                }
            };
        }
        batches
    }

    /// The most stored bytes of a batch taken off queue `queue` ([`PREFETCH_BATCH_BYTES`] at
    /// most for one a prefetch chunk starts).
    fn batch_cap(&self, queue: usize) -> u64 {
        if queue == Priority::Prefetch.queue() {
            self.limits.batch_bytes.min(PREFETCH_BATCH_BYTES)
        } else {
            self.limits.batch_bytes
        }
    }

    fn run(&self) {
        let mut st = lock(&self.state);
        loop {
            if let Some(c) = st.queues[0].pop_front() {
                if claim(&mut st, c) {
                    let batch = self.gather(&mut st, 0, c);
                    st = self.fetch_batch(st, batch, false);
                }
                continue;
            }
            if let Some(job) = st.jobs.pop_front() {
                st.running += 1;
                drop(st);
                job();
                st = lock(&self.state);
                st.running -= 1;
                continue;
            }
            if st.stopped {
                // Nobody waits for background fetches once the tier is gone.
                let st_ref = &mut *st;
                let [_, readahead, prefetch] = &mut st_ref.queues;
                let background: Vec<u32> = readahead.drain(..).chain(prefetch.drain(..)).collect();
                for c in background {
                    if let Some(e) = st.entries.get(&c) {
                        if !e.started && e.waiters.is_empty() {
                            st.entries.remove(&c);
                        }
                    }
                }
                return;
            }
            let background_queued = !st.queues[1].is_empty() || !st.queues[2].is_empty();
            if background_queued && st.running_background < self.limits.background_cap() {
                if let Some(wait) = self.bandwidth_wait(&mut st) {
                    st = match self.wake.wait_timeout(st, wait) {
                        Ok((g, _)) => g,
                        Err(p) => p.into_inner().0,
                    };
                    continue;
                }
                let taken = match st.queues[1].pop_front() {
                    Some(c) => Some((1, c)),
                    None => st.queues[2].pop_front().map(|c| (2, c)),
                };
                if let Some((queue, c)) = taken {
                    if claim(&mut st, c) {
                        let batch = self.gather(&mut st, queue, c);
                        st.running_background += 1;
                        st.tokens -= batch.iter().map(|&c| self.cost(c)).sum::<u64>() as f64;
                        st = self.fetch_batch(st, batch, true);
                    }
                }
                continue;
            }
            st.idle += 1;
            st = match self.wake.wait(st) {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            st.idle -= 1;
            st.woken = st.woken.saturating_sub(1);
        }
    }

    /// With a bandwidth cap: refill the bucket; how long to wait if it is empty.
    fn bandwidth_wait(&self, st: &mut State) -> Option<Duration> {
        let rate = self.limits.background_bytes_per_sec? as f64;
        if rate <= 0.0 {
            return Some(Duration::from_secs(1));
        }
        let now = Instant::now();
        let elapsed = now.duration_since(st.refilled).as_secs_f64();
        st.refilled = now;
        // At most one second of burst.
        st.tokens = (st.tokens + elapsed * rate).min(rate);
        if st.tokens >= 0.0 {
            None
        } else {
            Some(Duration::from_secs_f64((-st.tokens / rate).clamp(0.001, 1.0)))
        }
    }

    /// Stored bytes of chunk `c`.
    fn cost(&self, c: u32) -> u64 {
        (self.place)(c).map_or(0, |p| u64::from(p.stored_len))
    }

    /// The batch started by `first` (claimed off queue `queue`): `first` and the chunks queued
    /// right behind it (same priority, not started) that are stored right behind it in the same
    /// pack — or, given the pack order, every queued chunk of the same kind (demand, or
    /// background in either background queue) not started that is stored right before or after
    /// the run — while the batch stays within
    /// [`FetchLimits::batch_bytes`] ([`PREFETCH_BATCH_BYTES`] at most for a batch a prefetch chunk
    /// starts). Claims them; returns them in pack order.
    fn gather(&self, st: &mut State, queue: usize, first: u32) -> Vec<u32> {
        let mut batch = vec![first];
        if self.limits.batch_bytes == 0 {
            // One chunk per fetch (a local store): no lookups under the lock.
            return batch;
        }
        let Some(start) = (self.place)(first) else { return batch };
        let mut bytes = u64::from(start.stored_len);
        let cap = self.batch_cap(queue);
        if let Some(order) = &self.order {
            batch = self.run_around(st, order, queue, first, start, &mut bytes, cap);
            let ranges = self.ranges.get().map_or(1, |f| f());
            if ranges > 1 && (queue != 0 || self.limits.sparse_demand) {
                self.add_runs_apart(st, order, queue, start.pack, ranges, &mut batch, &mut bytes);
            }
        } else {
            let mut last = start;
            while let Some(&next) = st.queues[queue].front() {
                match st.entries.get(&next) {
                    // Started, or fetched already: a stale copy left by a promotion.
                    None => {}
                    Some(e) if e.started => {}
                    Some(e) if e.priority.queue() != queue => break,
                    Some(_) => {
                        let Some(place) = (self.place)(next) else { break };
                        if !last.followed_by(&place) || bytes + u64::from(place.stored_len) > cap {
                            break;
                        }
                        claim(st, next);
                        batch.push(next);
                        bytes += u64::from(place.stored_len);
                        last = place;
                    }
                }
                st.queues[queue].pop_front();
            }
        }
        if batch.len() > 1 {
            self.stats.batched.fetch_add(batch.len() as u64 - 1, Ordering::Relaxed);
        }
        batch
    }

    /// The run around `first` (claimed off queue `queue`, stored at `start`): the queued chunks
    /// of its kind (demand; or background, in either queue) not started that are stored right
    /// before or after it, while `bytes` stays within `cap`. Claims them; returns the run, `first`
    /// included, in pack order.
    #[allow(clippy::too_many_arguments)]
    fn run_around(
        &self,
        st: &mut State,
        order: &PackOrder,
        queue: usize,
        first: u32,
        start: ChunkPlace,
        bytes: &mut u64,
        cap: u64,
    ) -> Vec<u32> {
        let (mut ahead, mut before) = (Vec::new(), Vec::new());
        for (forward, out) in [(true, &mut ahead), (false, &mut before)] {
            let (mut at, mut at_place) = (first, start);
            loop {
                let next = if forward { order.next(at) } else { order.prev(at) };
                let Some(n) = next else { break };
                let Some(e) = st.entries.get(&n).filter(|e| !e.started) else { break };
                // A background batch leaves demand chunks to the demand threads; a demand batch
                // leaves background chunks to a request of their own (the read waits for its own
                // bytes only).
                if (e.priority == Priority::Demand) != (queue == 0) {
                    break;
                }
                let Some(place) = (self.place)(n) else { break };
                let adjacent =
                    if forward { at_place.followed_by(&place) } else { place.followed_by(&at_place) };
                if !adjacent || *bytes + u64::from(place.stored_len) > cap {
                    break;
                }
                claim(st, n);
                out.push(n);
                *bytes += u64::from(place.stored_len);
                (at, at_place) = (n, place);
            }
        }
        before.reverse();
        before.push(first);
        before.extend(ahead);
        before
    }

    /// Add to `batch` (of pack `pack`, taken off queue `queue`) runs of queued chunks of its kind
    /// (demand, or background) stored apart from it in the same pack, found among the first
    /// [`SPARSE_SCAN`] of each queue of that kind, up to `ranges` runs in all and
    /// [`SPARSE_BATCH_BYTES`]. Claims them; the batch ends in pack order.
    #[allow(clippy::too_many_arguments)]
    fn add_runs_apart(
        &self,
        st: &mut State,
        order: &PackOrder,
        queue: usize,
        pack: u32,
        ranges: usize,
        batch: &mut Vec<u32>,
        bytes: &mut u64,
    ) {
        let cap = self.limits.batch_bytes.min(SPARSE_BATCH_BYTES);
        let mut runs = 1;
        let kinds: &[usize] = if queue == 0 { &[0] } else { &[1, 2] };
        let candidates: Vec<u32> =
            kinds.iter().flat_map(|&q| st.queues[q].iter().take(SPARSE_SCAN)).copied().collect();
        for c in candidates {
            if runs >= ranges || *bytes >= cap {
                break;
            }
            let Some(e) = st.entries.get(&c) else { continue };
            if e.started || (e.priority == Priority::Demand) != (queue == 0) {
                continue;
            }
            let Some(place) = (self.place)(c).filter(|p| p.pack == pack) else { continue };
            if *bytes + u64::from(place.stored_len) > cap {
                continue;
            }
            claim(st, c);
            *bytes += u64::from(place.stored_len);
            batch.extend(self.run_around(st, order, queue, c, place, bytes, cap));
            runs += 1;
        }
        if runs > 1 {
            batch.sort_by_key(|&c| (self.place)(c).map_or(0, |p| p.offset));
        }
    }

    /// Fetch the claimed chunks `batch` without the lock, then tell their waiters.
    /// `background`: the batch runs in a background slot; each chunk is background or not by
    /// its own priority.
    fn fetch_batch<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        batch: Vec<u32>,
        background: bool,
    ) -> MutexGuard<'a, State> {
        st.running += 1;
        self.stats.max_running.fetch_max(st.running, Ordering::Relaxed);
        let quiet: Vec<bool> =
            batch.iter().map(|c| st.entries.get(c).is_none_or(|e| e.priority != Priority::Demand)).collect();
        drop(st);
        let quiet_chunks = quiet.iter().filter(|&&q| q).count() as u64;
        self.stats.background.fetch_add(quiet_chunks, Ordering::Relaxed);
        self.stats.demand.fetch_add(batch.len() as u64 - quiet_chunks, Ordering::Relaxed);
        trace!(first = batch[0], chunks = batch.len(), background, "chunk fetch");
        let mut told = vec![false; batch.len()];
        (self.fetch)(&batch, &quiet, &mut |k, result| {
            if told.get(k) == Some(&false) {
                told[k] = true;
                self.arrived(batch[k], quiet[k], &result);
            }
        });
        let mut st = lock(&self.state);
        st.running -= 1;
        st.finishing += 1;
        if background {
            st.running_background -= 1;
        }
        // This thread goes on with the queues itself; one more may now proceed (a background
        // slot freed while this thread takes demand work).
        let wake = st.idle > st.woken && (!st.queues[1].is_empty() || !st.queues[2].is_empty());
        if wake {
            st.woken += 1;
        }
        drop(st);
        if wake {
            self.wake.notify_one();
        }
        for (k, _) in told.iter().enumerate().filter(|(_, &told)| !told) {
            self.arrived(batch[k], quiet[k], &Err(Arc::new(no_outcome())));
        }
        let mut st = lock(&self.state);
        st.finishing -= 1;
        st.woken = st.woken.saturating_sub(1);
        st
    }

    /// Chunk `c`'s fetch is over (`quiet`: a background chunk): a failure of its own is
    /// remembered ([`FetchLimits::failure_memory`]), and its waiters are told.
    fn arrived(&self, c: u32, quiet: bool, result: &FetchResult) {
        if let Err(e) = result {
            if quiet {
                // Nobody may be waiting; a demand read of the chunk tries again.
                warn!(chunk = c, error = &**e as &dyn std::error::Error, "background chunk fetch failed");
            }
        }
        let mut st = lock(&self.state);
        let memory = self.limits.failure_memory;
        if let Err(e) = result {
            if !memory.is_zero() && failure_of_the_chunk(e) {
                let now = Instant::now();
                if st.failed.len() >= MAX_REMEMBERED_FAILURES {
                    st.failed.retain(|_, (until, _)| now < *until);
                }
                if let Some(until) = now.checked_add(memory) {
                    if st.failed.len() < MAX_REMEMBERED_FAILURES {
                        st.failed.insert(c, (until, Arc::clone(e)));
                    }
                }
            }
        }
        let waiters = st.entries.remove(&c).map(|e| e.waiters).unwrap_or_default();
        drop(st);
        for w in waiters {
            w.arrived(result);
        }
    }
}

/// What a waiter learns if its fetch produced no outcome (a fetch closure returning fewer
/// outcomes than chunks, a completion dropped uncalled): an error, never a silent success.
pub(crate) fn no_outcome() -> StoreError {
    StoreError::Io {
        op: "chunk fetch",
        path: Default::default(),
        source: std::io::Error::other("the fetch returned no outcome for this chunk"),
    }
}

/// Mark a queued chunk as started; false if it already is (a promoted duplicate) or is gone.
fn claim(st: &mut State, c: u32) -> bool {
    match st.entries.get_mut(&c) {
        Some(e) if !e.started => {
            e.started = true;
            true
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// A fetch function that blocks each chunk until released, recording the order.
    struct Gates {
        state: Mutex<(Vec<u32>, Vec<u32>)>, // (started, released)
        changed: Condvar,
    }

    impl Gates {
        fn new() -> Arc<Self> {
            Arc::new(Self { state: Mutex::new((Vec::new(), Vec::new())), changed: Condvar::new() })
        }
        fn fetch(&self, c: u32) -> FetchResult {
            let mut s = self.state.lock().unwrap();
            s.0.push(c);
            self.changed.notify_all();
            while !s.1.contains(&c) {
                s = self.changed.wait(s).unwrap();
            }
            Ok(())
        }
        fn release(&self, c: u32) {
            self.state.lock().unwrap().1.push(c);
            self.changed.notify_all();
        }
        fn wait_started(&self, n: usize) -> Vec<u32> {
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut s = self.state.lock().unwrap();
            while s.0.len() < n {
                assert!(Instant::now() < deadline, "only {:?} started", s.0);
                s = self.changed.wait_timeout(s, Duration::from_millis(50)).unwrap().0;
            }
            s.0.clone()
        }
    }

    /// Chunk `c` stored at `c * 2000` of pack 0, 1000 bytes: never back to back (no batches).
    fn apart(c: u32) -> Option<ChunkPlace> {
        Some(ChunkPlace { pack: 0, offset: u64::from(c) * 2000, stored_len: 1000 })
    }

    fn fetcher(limits: FetchLimits, gates: &Arc<Gates>) -> ChunkFetcher {
        let g = Arc::clone(gates);
        ChunkFetcher::start(limits, move |cs, _| cs.iter().map(|&c| g.fetch(c)).collect(), apart).unwrap()
    }

    fn done_channel() -> (FetchDone, mpsc::Receiver<FetchResult>) {
        let (tx, rx) = mpsc::channel();
        (
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
            rx,
        )
    }

    #[test]
    fn distinct_demand_chunks_run_in_parallel() {
        let gates = Gates::new();
        let f = fetcher(FetchLimits::new(32), &gates);
        let mut rxs = Vec::new();
        for c in 0..32 {
            let (done, rx) = done_channel();
            f.fetch(&[c], Priority::Demand, Some(done));
            rxs.push(rx);
        }
        // All 32 are running at the same time before any is released.
        let started = gates.wait_started(32);
        assert_eq!(started.len(), 32);
        for c in 0..32 {
            gates.release(c);
        }
        for rx in rxs {
            assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap().is_ok());
        }
        assert_eq!(f.stats().max_running.load(Ordering::Relaxed), 32);
        // Threads start as the burst needs them: one per chunk (plus, at most, the thread
        // started with the fetcher if it was not yet waiting for work when the burst came).
        let burst = f.stats().threads.load(Ordering::Relaxed);
        assert!((32..=33).contains(&burst), "a burst of 32 started {burst} threads");
    }

    /// Threads start as work needs them: reads that come one at a time (a warmed daemon's)
    /// keep a thread or two of the 64 allowed, not 64 to start and schedule on a few CPUs (a
    /// burst starts one per chunk at once: `distinct_demand_chunks_run_in_parallel`).
    #[test]
    fn serial_fetches_keep_a_thread_or_two() {
        let f = ChunkFetcher::start(FetchLimits::new(64), |cs, _| cs.iter().map(|_| Ok(())).collect(), apart)
            .unwrap();
        assert_eq!(f.stats().threads.load(Ordering::Relaxed), 1);
        for c in 0..200 {
            let (done, rx) = done_channel();
            f.fetch(&[c], Priority::Demand, Some(done));
            assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap().is_ok());
        }
        let serial = f.stats().threads.load(Ordering::Relaxed);
        assert!(serial <= 3, "200 reads one at a time started {serial} threads");
    }

    /// A thread started for a burst that a reader queued (a queue worker, pinned elsewhere by
    /// `serve --cpus`) runs on the CPUs of the thread that started the fetcher, not the reader's.
    #[test]
    fn threads_started_later_keep_the_fetchers_cpus() {
        use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};
        let all = sched_getaffinity(None).unwrap();
        let cpus: Vec<usize> = (0..CpuSet::MAX_CPU).filter(|&c| all.is_set(c)).collect();
        assert!(cpus.len() >= 2, "this test needs 2 CPUs (the CI machine has 2): {cpus:?}");
        let only = |cpu: usize| {
            let mut set = CpuSet::new();
            set.set(cpu);
            set
        };
        let ran_on = Arc::new(Mutex::new(Vec::new()));
        let gates = Gates::new();
        let f = std::thread::scope(|s| {
            s.spawn(|| {
                sched_setaffinity(None, &only(cpus[0])).unwrap();
                let (g, r) = (Arc::clone(&gates), Arc::clone(&ran_on));
                ChunkFetcher::start(
                    FetchLimits::new(16),
                    move |cs, _| {
                        let set = sched_getaffinity(None).unwrap();
                        r.lock()
                            .unwrap()
                            .push((0..CpuSet::MAX_CPU).filter(|&c| set.is_set(c)).collect::<Vec<_>>());
                        cs.iter().map(|&c| g.fetch(c)).collect()
                    },
                    apart,
                )
                .unwrap()
            })
            .join()
            .unwrap()
        });
        let rxs = std::thread::scope(|s| {
            s.spawn(|| {
                sched_setaffinity(None, &only(cpus[1])).unwrap();
                (0..8)
                    .map(|c| {
                        let (done, rx) = done_channel();
                        f.fetch(&[c], Priority::Demand, Some(done));
                        rx
                    })
                    .collect::<Vec<_>>()
            })
            .join()
            .unwrap()
        });
        gates.wait_started(8);
        for c in 0..8 {
            gates.release(c);
        }
        for rx in rxs {
            assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap().is_ok());
        }
        assert!(f.stats().threads.load(Ordering::Relaxed) >= 8);
        let ran_on = ran_on.lock().unwrap();
        assert_eq!(ran_on.len(), 8);
        assert!(ran_on.iter().all(|set| *set == [cpus[0]]), "fetches ran on {ran_on:?}, not CPU {}", cpus[0]);
    }

    #[test]
    fn one_fetch_serves_every_waiter() {
        let gates = Gates::new();
        let f = fetcher(FetchLimits::new(8), &gates);
        let mut rxs = Vec::new();
        for _ in 0..5 {
            let (done, rx) = done_channel();
            f.fetch(&[7, 8], Priority::Demand, Some(done));
            rxs.push(rx);
        }
        gates.wait_started(2);
        gates.release(7);
        gates.release(8);
        for rx in rxs {
            assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap().is_ok());
        }
        let started = gates.state.lock().unwrap().0.clone();
        assert_eq!(started.len(), 2, "each chunk fetched once: {started:?}");
        assert_eq!(f.stats().joined.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn demand_goes_before_background_and_promotes_it() {
        let gates = Gates::new();
        // 2 threads, 1 background slot.
        let f = fetcher(FetchLimits { background_jobs: 1, ..FetchLimits::new(2) }, &gates);
        f.fetch(&[100, 101, 102], Priority::Prefetch, None);
        // One background fetch runs; the other thread stays free for demand.
        assert_eq!(gates.wait_started(1), vec![100]);
        let (done, rx) = done_channel();
        f.fetch(&[1], Priority::Demand, Some(done));
        assert_eq!(gates.wait_started(2), vec![100, 1]);
        gates.release(1);
        assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap().is_ok());
        // 102 is still queued in the background: a demand read promotes it past 101.
        let (done, rx) = done_channel();
        f.fetch(&[102], Priority::Demand, Some(done));
        assert_eq!(gates.wait_started(3), vec![100, 1, 102]);
        gates.release(102);
        assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap().is_ok());
        gates.release(100);
        assert_eq!(gates.wait_started(4), vec![100, 1, 102, 101]);
        gates.release(101);
        assert_eq!(f.stats().promoted.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn errors_reach_every_waiter_and_empty_requests_finish_at_once() {
        let f = ChunkFetcher::start(
            FetchLimits::new(2),
            |cs, _| {
                cs.iter()
                    .map(|&c| {
                        if c == 3 {
                            Err(Arc::new(StoreError::InvalidTag { tag: "x".into() }))
                        } else {
                            Ok(())
                        }
                    })
                    .collect()
            },
            |_| None,
        )
        .unwrap();
        let (done, rx) = done_channel();
        f.fetch(&[1, 3, 5], Priority::Demand, Some(done));
        assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap().is_err());
        let (done, rx) = done_channel();
        f.fetch(&[], Priority::Demand, Some(done));
        assert!(rx.try_recv().unwrap().is_ok(), "no chunks: done at once");
    }

    #[test]
    fn jobs_run_on_fetch_threads_ahead_of_queued_background_fetches() {
        let gates = Gates::new();
        // 2 threads, 1 background slot: 100 runs, 101 waits for the slot.
        let f = fetcher(FetchLimits { background_jobs: 1, ..FetchLimits::new(2) }, &gates);
        f.fetch(&[100, 101], Priority::Prefetch, None);
        assert_eq!(gates.wait_started(1), vec![100]);
        let (tx, rx) = mpsc::channel();
        f.run(Box::new(move || {
            let _ = tx.send(std::thread::current().name().map(str::to_owned));
        }));
        let thread = rx.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
        assert!(thread.starts_with("tessera-chunk-"), "ran on {thread}");
        assert_eq!(gates.state.lock().unwrap().0, vec![100], "101 still waits for the background slot");
        gates.release(100);
        assert_eq!(gates.wait_started(2), vec![100, 101]);
        gates.release(101);
        // A job queued when the fetcher is dropped still runs.
        let (tx, rx) = mpsc::channel();
        f.run(Box::new(move || {
            let _ = tx.send(());
        }));
        drop(f);
        assert!(rx.recv_timeout(Duration::from_secs(10)).is_ok());
    }

    #[test]
    fn background_bandwidth_is_capped() {
        let f = ChunkFetcher::start(
            FetchLimits {
                background_jobs: 3,
                background_bytes_per_sec: Some(100_000),
                batch_bytes: 0,
                ..FetchLimits::new(4)
            },
            |cs, _| cs.iter().map(|_| Ok(())).collect(),
            |c| Some(ChunkPlace { pack: 0, offset: u64::from(c) * 10_000, stored_len: 10_000 }),
        )
        .unwrap();
        let start = Instant::now();
        let chunks: Vec<u32> = (0..12).collect();
        f.fetch(&chunks, Priority::Prefetch, None);
        let deadline = Instant::now() + Duration::from_secs(20);
        while f.pending() > 0 {
            assert!(Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(10));
        }
        // 120 kB at 100 kB/s, the bucket starting empty: about 1.1 s (the first chunk starts at
        // once, each later one when the bucket is back to zero).
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(1000), "took {took:?}");
    }

    /// A fetch function recording each call's batch; chunk 13 fails.
    fn recording(log: &Arc<Mutex<Vec<Vec<u32>>>>) -> impl Fn(&[u32], &[bool]) -> Vec<FetchResult> {
        let log = Arc::clone(log);
        move |cs, _| {
            log.lock().unwrap().push(cs.to_vec());
            cs.iter()
                .map(
                    |&c| {
                        if c == 13 {
                            Err(Arc::new(StoreError::InvalidTag { tag: "x".into() }))
                        } else {
                            Ok(())
                        }
                    },
                )
                .collect()
        }
    }

    /// One thread, batches on, every chunk `c` stored at `c * 1000` (all back to back): chunk
    /// `blocker` waits at the gates (holding the thread), the others go to `recording(log)`.
    fn blocked_batcher(
        limits: FetchLimits,
        blocker: u32,
        gates: &Arc<Gates>,
        log: &Arc<Mutex<Vec<Vec<u32>>>>,
    ) -> ChunkFetcher {
        let (g, rec) = (Arc::clone(gates), recording(log));
        let back_to_back =
            |c: u32| Some(ChunkPlace { pack: 0, offset: u64::from(c) * 1000, stored_len: 1000 });
        let limits = FetchLimits { jobs: 1, batch_bytes: DEFAULT_BATCH_BYTES, ..limits };
        ChunkFetcher::start(
            limits,
            move |cs, bg| if cs == [blocker] { vec![g.fetch(blocker)] } else { rec(cs, bg) },
            back_to_back,
        )
        .unwrap()
    }

    #[test]
    fn chunks_stored_back_to_back_are_fetched_in_batches_within_the_byte_cap() {
        let log = Arc::new(Mutex::new(Vec::new()));
        // Pack 0 holds chunks 0..=9 back to back (1000 bytes each) except for a gap before 6;
        // chunk 10 is in pack 1, right where chunk 9 ends in pack 0.
        let place = |c: u32| {
            let offset = u64::from(c) * 1000 + if c >= 6 { 500 } else { 0 };
            Some(ChunkPlace { pack: u32::from(c >= 10), offset, stored_len: 1000 })
        };
        // One thread, so the queue is whole when the thread looks at it.
        let f = ChunkFetcher::start(
            FetchLimits { batch_bytes: 3000, ..FetchLimits::new(1) },
            recording(&log),
            place,
        )
        .unwrap();
        let (done, rx) = done_channel();
        f.fetch(&(0..=10).collect::<Vec<_>>(), Priority::Demand, Some(done));
        assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap().is_ok());
        // At most 3000 bytes, never across the gap or into another pack.
        assert_eq!(
            *log.lock().unwrap(),
            vec![vec![0, 1, 2], vec![3, 4, 5], vec![6, 7, 8], vec![9], vec![10]]
        );
        assert_eq!(f.stats().batched.load(Ordering::Relaxed), 6);
        assert_eq!(f.stats().demand.load(Ordering::Relaxed), 11);
    }

    #[test]
    fn a_batch_a_prefetch_chunk_starts_stays_within_the_prefetch_cap() {
        // Eight chunks of 300 000 bytes back to back: three fit in 1 MiB, all eight in 4 MiB.
        let place =
            |c: u32| Some(ChunkPlace { pack: 0, offset: u64::from(c) * 300_000, stored_len: 300_000 });
        let cases = [
            (Priority::Prefetch, vec![vec![0, 1, 2], vec![3, 4, 5], vec![6, 7]]),
            (Priority::Readahead, vec![(0..8).collect()]),
        ];
        for (priority, expected) in cases {
            let log = Arc::new(Mutex::new(Vec::new()));
            let limits = FetchLimits { batch_bytes: DEFAULT_BATCH_BYTES, ..FetchLimits::new(1) };
            let f = ChunkFetcher::start(limits, recording(&log), place).unwrap();
            let (done, rx) = done_channel();
            f.fetch(&(0..8).collect::<Vec<_>>(), priority, Some(done));
            assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap().is_ok());
            assert_eq!(*log.lock().unwrap(), expected, "{priority:?}");
        }
    }

    #[test]
    fn a_chunk_that_failed_for_its_own_reason_fails_again_at_once_for_a_while() {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&calls);
        // Chunk 1 is corrupt at the origin (every copy); chunk 2's origin is unreachable.
        let f = ChunkFetcher::start(
            FetchLimits { failure_memory: Duration::from_millis(300), ..FetchLimits::new(2) },
            move |cs, _| {
                log.lock().unwrap().extend_from_slice(cs);
                cs.iter()
                    .map(|&c| match c {
                        1 => Err(Arc::new(StoreError::CorruptChunk {
                            chunk: tessera_image::ChunkId([1; 32]),
                            pack: tessera_image::Sha256Digest([2; 32]),
                            offset: 0,
                            reason: "blake3 mismatch",
                        })),
                        2 => Err(Arc::new(StoreError::Io {
                            op: "connect",
                            path: Default::default(),
                            source: std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
                        })),
                        _ => Ok(()),
                    })
                    .collect()
            },
            |_| None,
        )
        .unwrap();
        let fetch = |chunks: &[u32]| {
            let (done, rx) = done_channel();
            f.fetch(chunks, Priority::Demand, Some(done));
            rx.recv_timeout(Duration::from_secs(10)).unwrap()
        };
        let count = |c: u32| calls.lock().unwrap().iter().filter(|&&x| x == c).count();
        let corrupt =
            |r: FetchResult| matches!(r.as_ref().map_err(|e| &**e), Err(StoreError::CorruptChunk { .. }));
        assert!(corrupt(fetch(&[1])));
        assert_eq!(count(1), 1);
        // Asked again at once, alone or with a good chunk: the same error, no new fetch of it.
        assert!(corrupt(fetch(&[1])));
        assert!(corrupt(fetch(&[3, 1])));
        assert_eq!((count(1), count(3)), (1, 1));
        assert_eq!(f.stats().remembered_failures.load(Ordering::Relaxed), 2);
        // Background requests skip it too.
        f.fetch(&[1], Priority::Readahead, None);
        // An unreachable origin is not remembered: every read tries again.
        assert!(fetch(&[2]).is_err());
        assert!(fetch(&[2]).is_err());
        assert_eq!(count(2), 2);
        // Once the memory has passed, the chunk is fetched again.
        std::thread::sleep(Duration::from_millis(350));
        assert!(fetch(&[1]).is_err());
        assert_eq!(count(1), 2);
        // A memory of zero remembers nothing.
        let again = Arc::new(Mutex::new(0));
        let n = Arc::clone(&again);
        let g = ChunkFetcher::start(
            FetchLimits { failure_memory: Duration::ZERO, ..FetchLimits::new(1) },
            move |cs, _| {
                *n.lock().unwrap() += 1;
                cs.iter()
                    .map(|_| {
                        Err(Arc::new(StoreError::RangeOutOfBounds {
                            digest: tessera_image::Sha256Digest([3; 32]),
                            offset: 10,
                            len: 5,
                            blob_len: 12,
                        }))
                    })
                    .collect()
            },
            |_| None,
        )
        .unwrap();
        for _ in 0..3 {
            let (done, rx) = done_channel();
            g.fetch(&[7], Priority::Demand, Some(done));
            assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap().is_err());
        }
        assert_eq!(*again.lock().unwrap(), 3);
    }

    #[test]
    fn a_batch_fails_only_the_waiters_of_its_failed_chunk() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let gates = Gates::new();
        // Chunk 0 holds the only thread while 12, 13 and 14 are queued behind it.
        let f = blocked_batcher(FetchLimits::new(1), 0, &gates, &log);
        f.fetch(&[0], Priority::Demand, None);
        gates.wait_started(1);
        let mut rxs = Vec::new();
        for c in [12, 13, 14] {
            let (done, rx) = done_channel();
            f.fetch(&[c], Priority::Demand, Some(done));
            rxs.push(rx);
        }
        gates.release(0);
        let outcomes: Vec<bool> =
            rxs.iter().map(|rx| rx.recv_timeout(Duration::from_secs(10)).unwrap().is_ok()).collect();
        assert_eq!(outcomes, vec![true, false, true]);
        assert_eq!(*log.lock().unwrap(), vec![vec![12, 13, 14]], "one fetch for the three");
    }

    #[test]
    fn in_pack_order_a_batch_takes_queued_neighbours_of_its_own_kind() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let gates = Gates::new();
        // Chunks 0..=20 back to back, 1000 bytes each; chunk 100 elsewhere (it holds the thread).
        let place = |c: u32| {
            Some(ChunkPlace { pack: u32::from(c == 100), offset: u64::from(c) * 1000, stored_len: 1000 })
        };
        let order = Arc::new(PackOrder::new(101, place));
        let (g, rec) = (Arc::clone(&gates), recording(&log));
        let limits = FetchLimits { jobs: 1, batch_bytes: 10_000, ..FetchLimits::new(1) };
        let f = ChunkFetcher::start_in_order(
            limits,
            move |cs, bg| if cs == [100] { vec![g.fetch(100)] } else { rec(cs, bg) },
            place,
            Some(order),
        )
        .unwrap();
        f.fetch(&[100], Priority::Demand, None);
        gates.wait_started(1);
        // Queued in no useful order: a profile (prefetch) 12, 3, 4; then a read missing 4 (the
        // profile's, promoted) and 5, with its readahead window 6, 7.
        f.fetch(&[12, 3, 4], Priority::Prefetch, None);
        let (done, rx) = done_channel();
        f.fetch_with_ahead(&[4, 5], Priority::Demand, Some(done), &[6, 7]);
        gates.release(100);
        assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap().is_ok());
        let deadline = Instant::now() + Duration::from_secs(10);
        while f.pending() > 0 {
            assert!(Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(5));
        }
        let log = log.lock().unwrap().clone();
        // The read's batch is its own two chunks, in pack order; the window (readahead before
        // prefetch) and the profile's runs follow as batches of their own (3's neighbour 4 went
        // with the read).
        assert_eq!(log, vec![vec![4, 5], vec![6, 7], vec![12], vec![3]], "{log:?}");
        assert_eq!(f.stats().demand.load(Ordering::Relaxed), 3, "100, 4 and 5");
        assert_eq!(f.stats().background.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn a_background_batch_takes_runs_apart_in_its_pack_when_the_source_fetches_them_at_once() {
        for ranges in [1, 3] {
            let log = Arc::new(Mutex::new(Vec::new()));
            // Chunks 0..=40 back to back in pack 0, 1000 bytes each; 50 in pack 1.
            let place = |c: u32| {
                Some(ChunkPlace { pack: u32::from(c == 50), offset: u64::from(c) * 1000, stored_len: 1000 })
            };
            let order = Arc::new(PackOrder::new(51, place));
            let limits = FetchLimits { jobs: 1, batch_bytes: 10_000, ..FetchLimits::new(1) };
            let f = ChunkFetcher::start_in_order(limits, recording(&log), place, Some(order)).unwrap();
            f.set_ranges_per_request(move || ranges);
            // A profile: files apart in pack 0 (20 and 21 one file), one in pack 1.
            f.fetch(&[10, 50, 20, 21, 30, 40], Priority::Prefetch, None);
            let deadline = Instant::now() + Duration::from_secs(10);
            while f.pending() > 0 {
                assert!(Instant::now() < deadline);
                std::thread::sleep(Duration::from_millis(5));
            }
            let log = log.lock().unwrap().clone();
            let expected: Vec<Vec<u32>> = if ranges == 1 {
                vec![vec![10], vec![50], vec![20, 21], vec![30], vec![40]]
            } else {
                // Three runs of pack 0 in the first request, in pack order; the rest after.
                vec![vec![10, 20, 21, 30], vec![50], vec![40]]
            };
            assert_eq!(log, expected, "{ranges} ranges per request");
        }
    }

    #[test]
    fn demand_batches_take_runs_apart_only_when_told() {
        for sparse_demand in [false, true] {
            let log = Arc::new(Mutex::new(Vec::new()));
            let place = |c: u32| Some(ChunkPlace { pack: 0, offset: u64::from(c) * 1000, stored_len: 1000 });
            let order = Arc::new(PackOrder::new(41, place));
            let limits = FetchLimits { jobs: 1, batch_bytes: 10_000, sparse_demand, ..FetchLimits::new(1) };
            let f = ChunkFetcher::start_in_order(limits, recording(&log), place, Some(order)).unwrap();
            f.set_ranges_per_request(|| 64);
            let (done, rx) = done_channel();
            f.fetch(&[10, 20, 30], Priority::Demand, Some(done));
            assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap().is_ok());
            let log = log.lock().unwrap().clone();
            let expected: Vec<Vec<u32>> =
                if sparse_demand { vec![vec![10, 20, 30]] } else { vec![vec![10], vec![20], vec![30]] };
            assert_eq!(log, expected, "sparse demand: {sparse_demand}");
        }
    }

    #[test]
    fn a_background_batch_leaves_demand_chunks_to_the_demand_threads() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let place = |c: u32| Some(ChunkPlace { pack: 0, offset: u64::from(c) * 1000, stored_len: 1000 });
        let order = Arc::new(PackOrder::new(10, place));
        let f = ChunkFetcher::start_in_order(
            FetchLimits { batch_bytes: 10_000, ..FetchLimits::new(1) },
            recording(&log),
            place,
            Some(order),
        )
        .unwrap();
        // One thread: a demand chunk queued while the prefetch run is gathered stays out of it.
        let (done, rx) = done_channel();
        {
            let mut st = lock(&f.shared.state);
            f.register(&mut st, &[1, 2], Priority::Prefetch, None, &mut Vec::new());
            st.entries.insert(3, Entry { started: false, priority: Priority::Demand, waiters: Vec::new() });
            f.register(&mut st, &[4], Priority::Prefetch, None, &mut Vec::new());
            // Take the prefetch run as a background thread would.
            claim(&mut st, 1);
            let batch = f.shared.gather(&mut st, 2, 1);
            assert_eq!(batch, vec![1, 2], "stops before the demand chunk 3");
            for c in batch {
                st.entries.remove(&c);
            }
            st.entries.remove(&3);
        }
        f.fetch(&[3], Priority::Demand, Some(done));
        assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap().is_ok());
    }

    #[test]
    fn batches_do_not_mix_priorities_and_skip_promoted_copies() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let gates = Gates::new();
        let f = blocked_batcher(FetchLimits { background_jobs: 1, ..FetchLimits::new(1) }, 100, &gates, &log);
        // 100 holds the thread; 1..=4 wait in the prefetch queue; 2 and 3 are then demanded
        // (promoted: their prefetch copies stay behind, stale).
        f.fetch(&[100], Priority::Demand, None);
        gates.wait_started(1);
        f.fetch(&[1, 2, 3, 4], Priority::Prefetch, None);
        let (done, rx) = done_channel();
        f.fetch(&[2, 3], Priority::Demand, Some(done));
        gates.release(100);
        assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap().is_ok());
        let deadline = Instant::now() + Duration::from_secs(10);
        while f.pending() > 0 {
            assert!(Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(5));
        }
        // Demand first (2, 3 together); then the prefetch run 1, and 4 (the stale copies of 2 and
        // 3 between them are skipped, and 1 and 4 are not back to back).
        assert_eq!(*log.lock().unwrap(), vec![vec![2, 3], vec![1], vec![4]]);
    }

    /// A read waiting for a chunk of a batch already on the wire (a readahead window it caught
    /// up with) is told when that chunk arrives, not when the whole batch does; a read waiting
    /// for a later chunk of the batch still waits for it.
    #[test]
    fn waiters_are_told_as_their_chunks_arrive_not_when_the_batch_ends() {
        // Chunks 0..4 stored back to back; the fetch hands over chunk 0 at stage 1 and the rest
        // at stage 2, and says which batch it started.
        let stage = Arc::new((Mutex::new(0u32), Condvar::new()));
        let (started_tx, started) = mpsc::channel();
        let gate = Arc::clone(&stage);
        let wait_for = move |n: u32| {
            let (m, cv) = &*gate;
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut at = m.lock().unwrap();
            while *at < n && Instant::now() < deadline {
                at = cv.wait_timeout(at, Duration::from_millis(50)).unwrap().0;
            }
        };
        let limits = FetchLimits { batch_bytes: 1 << 20, ..FetchLimits::new(2) };
        let f = ChunkFetcher::start_handing_over(
            limits,
            move |chunks: &[u32], _: &[bool], arrived: &mut Arrived<'_>| {
                let _ = started_tx.send(chunks.to_vec());
                wait_for(1);
                arrived(0, Ok(()));
                wait_for(2);
                (1..chunks.len()).for_each(|k| arrived(k, Ok(())));
            },
            |c| Some(ChunkPlace { pack: 0, offset: u64::from(c) * 1000, stored_len: 1000 }),
            None,
        )
        .unwrap();
        let go = |n: u32| {
            *stage.0.lock().unwrap() = n;
            stage.1.notify_all();
        };
        f.fetch(&[0, 1, 2, 3], Priority::Readahead, None);
        assert_eq!(started.recv_timeout(Duration::from_secs(10)).unwrap(), [0, 1, 2, 3], "one batch");
        let (first, first_rx) = done_channel();
        let (last, last_rx) = done_channel();
        f.fetch(&[0], Priority::Demand, Some(first));
        f.fetch(&[3], Priority::Demand, Some(last));
        assert_eq!(f.stats().behind_background.load(Ordering::Relaxed), 2);
        go(1);
        assert!(first_rx.recv_timeout(Duration::from_secs(10)).unwrap().is_ok(), "told as chunk 0 arrived");
        std::thread::sleep(Duration::from_millis(50)); // time for a wrong early answer to show
        assert!(last_rx.try_recv().is_err(), "chunk 3 has not arrived");
        go(2);
        assert!(last_rx.recv_timeout(Duration::from_secs(10)).unwrap().is_ok());
        assert!(started.try_recv().is_err(), "nothing fetched twice");
    }

    /// A miss and its window wake a thread per batch they form, not one per chunk: a miss with a
    /// 100-chunk window starts two threads beside the first, not 64 (each woken thread would find
    /// nothing and sleep again on the daemon's CPU).
    #[test]
    fn a_miss_and_its_window_wake_a_thread_per_batch() {
        let back_to_back =
            |c: u32| Some(ChunkPlace { pack: 0, offset: u64::from(c) * 1000, stored_len: 1000 });
        let limits = FetchLimits { batch_bytes: DEFAULT_BATCH_BYTES, ..FetchLimits::new(64) };
        let f =
            ChunkFetcher::start(limits, |cs, _| cs.iter().map(|_| Ok(())).collect(), back_to_back).unwrap();
        let window: Vec<u32> = (1..=100).collect();
        let (done, rx) = done_channel();
        f.fetch_with_ahead(&[0], Priority::Demand, Some(done), &window);
        assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap().is_ok());
        let deadline = Instant::now() + Duration::from_secs(10);
        while f.pending() > 0 {
            assert!(Instant::now() < deadline, "the window was not fetched");
            std::thread::sleep(Duration::from_millis(5)); // polling interval
        }
        let threads = f.stats().threads.load(Ordering::Relaxed);
        assert!(threads <= 3, "a miss and its window started {threads} threads");
    }

    /// A profile's run larger than a prefetch batch wakes a thread for each of its batches: the
    /// batches go out in parallel.
    #[test]
    fn a_long_prefetch_run_goes_out_as_parallel_batches() {
        // 30 chunks of 100 KiB back to back: three prefetch batches of at most 1 MiB.
        let big =
            |c: u32| Some(ChunkPlace { pack: 0, offset: u64::from(c) * (100 << 10), stored_len: 100 << 10 });
        let limits = FetchLimits { batch_bytes: DEFAULT_BATCH_BYTES, ..FetchLimits::new(8) };
        let running = Arc::new((Mutex::new((0usize, 0usize)), Condvar::new())); // (running, most)
        let r = Arc::clone(&running);
        let f = ChunkFetcher::start(
            limits,
            move |cs, _| {
                let (m, cv) = &*r;
                let mut st = m.lock().unwrap();
                st.0 += 1;
                st.1 = st.1.max(st.0);
                cv.notify_all();
                // Wait (at most 10 s) until three batches run together.
                let deadline = Instant::now() + Duration::from_secs(10);
                while st.1 < 3 && Instant::now() < deadline {
                    st = cv.wait_timeout(st, Duration::from_millis(50)).unwrap().0;
                }
                st.0 -= 1;
                cs.iter().map(|_| Ok(())).collect()
            },
            big,
        )
        .unwrap();
        let profile: Vec<u32> = (0..30).collect();
        f.fetch(&profile, Priority::Prefetch, None);
        let deadline = Instant::now() + Duration::from_secs(20);
        while f.pending() > 0 {
            assert!(Instant::now() < deadline, "the profile was not fetched");
            std::thread::sleep(Duration::from_millis(5)); // polling interval
        }
        assert_eq!(running.0.lock().unwrap().1, 3, "three batches at once");
    }
}
