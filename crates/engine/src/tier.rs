//! The memory tier: decoded, verified chunks kept in memory (moka, weighted by bytes), in front
//! of an [`ImageReader`]'s chunk source. Reads are served straight out of the cached chunks into
//! the guest's buffers ([`BlockDevice::visit`]); a read that needs a chunk not in memory is
//! reported as [`Visit::Missing`] so the daemon can fetch it off the queue thread.
//!
//! On its [`ChunkFetcher`] the chunks a deferred read needs are
//! fetched in parallel, once each however many reads wait for them
//! ([`BlockDevice::fetch_ahead`]); sequential reads within a file fetch the next chunks ahead
//! ([`MemTier::with_readahead`]); and a prefetch profile's chunks can be fetched in the
//! background ([`MemTier::prefetch`]). Demand fetches always go first.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use moka::notification::RemovalCause;
use moka::policy::EvictionPolicy;
use moka::sync::Cache;
use tessera_image::{ChunkId, SegmentSource};
use tessera_store::{ChunkSource, ImageReader, Piece, StoreError, Visit};

use crate::device::{BlockDevice, BufSink, Sink};
use crate::error::{ReadError, StartError};
use crate::fetcher::{Arrived, ChunkFetcher, ChunkPlace, FetchDone, FetchLimits, FetcherStats, Priority};
use crate::files::{FileMap, MissCounts};
use crate::hugebuf::{ChunkBuf, Located};
use crate::packorder::PackOrder;
use crate::trace::TraceRecorder;

/// A decoded chunk in memory, shared by the reads copying from it (its bytes on huge pages when
/// large enough: [`crate::hugebuf`]).
pub type Chunk = Arc<ChunkBuf>;

/// `--mem-cache` unless told otherwise: 256 MiB of decoded chunks.
pub const DEFAULT_MEM_CACHE: u64 = 256 << 20;

/// `--readahead` unless told otherwise: bytes fetched ahead of a sequential reader.
pub const DEFAULT_READAHEAD: u64 = 2 << 20;

/// Sequential streams remembered for readahead (several guest processes reading files at once).
const STREAMS: usize = 16;

/// Counters of a [`MemTier`].
#[derive(Debug, Default)]
pub struct TierStats {
    /// Chunk lookups served from memory.
    pub hits: AtomicU64,
    /// Chunk lookups that needed the chunk source.
    pub misses: AtomicU64,
    /// Chunks read (and verified) from the chunk source.
    pub fetches: AtomicU64,
    /// Bytes read from the chunk source (decoded bytes of the chunks fetched).
    pub fetched_bytes: AtomicU64,
    /// Chunks queued for readahead (a file read sequentially).
    pub readahead_chunks: AtomicU64,
    /// Chunks queued as a miss's pack window ([`MemTier::with_pack_readahead`]).
    pub pack_window_chunks: AtomicU64,
    /// Chunks queued for profile prefetch.
    pub prefetch_chunks: AtomicU64,
    /// Chunks queued because their file is fetched whole ([`MemTier::with_whole_files`]).
    pub whole_file_chunks: AtomicU64,
    /// Files fetched whole.
    pub whole_files: AtomicU64,
    /// Chunks queued because their pack stretch is fetched whole ([`MemTier::with_dense_stretches`]).
    pub stretch_chunks: AtomicU64,
    /// Pack stretches fetched whole.
    pub stretches: AtomicU64,
    /// Chunks queued because a program needs the library they belong to ([`MemTier::with_elf_deps`]).
    pub elf_dep_chunks: AtomicU64,
    /// Chunks fetched into memory by a background (readahead or prefetch) fetch.
    pub prefetched_chunks: AtomicU64,
    /// Decoded bytes of those chunks.
    pub prefetched_bytes: AtomicU64,
    /// Decoded bytes of prefetched chunks a guest read used (counted at the first use).
    pub prefetch_used_bytes: AtomicU64,
    /// Decoded bytes of prefetched chunks evicted before any guest read used them.
    pub prefetch_wasted_bytes: AtomicU64,
    /// The same three figures per reason a chunk was fetched ahead ([`Ahead`], in [`Ahead::ALL`]'s
    /// order).
    pub ahead: [AheadStats; Ahead::ALL.len()],
}

impl TierStats {
    /// The counters of chunks fetched ahead for `why`.
    pub fn ahead(&self, why: Ahead) -> &AheadStats {
        &self.ahead[why as usize - 1]
    }
}

/// What chunks fetched ahead for one reason came to: decoded bytes fetched, used by a guest read
/// (at the first use), and evicted unused.
#[derive(Debug, Default)]
pub struct AheadStats {
    pub fetched_bytes: AtomicU64,
    pub used_bytes: AtomicU64,
    pub wasted_bytes: AtomicU64,
}

/// Why a chunk was fetched ahead of the guest's reads (the `reason` of the prefetch metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Ahead {
    /// Sequential readahead within a file ([`MemTier::with_readahead`]).
    Readahead = 1,
    /// Stored after a missed chunk in its pack ([`MemTier::with_pack_readahead`]).
    PackWindow = 2,
    /// Its file is fetched whole ([`MemTier::with_whole_files`]).
    WholeFile = 3,
    /// Its pack stretch is fetched whole ([`MemTier::with_dense_stretches`]).
    Stretch = 4,
    /// A program that missed needs its library ([`MemTier::with_elf_deps`]).
    ElfDeps = 5,
    /// The image's prefetch profile ([`MemTier::prefetch`]).
    Profile = 6,
}

impl Ahead {
    /// Every reason, in the order of [`TierStats::ahead`].
    pub const ALL: [Ahead; 6] = [
        Ahead::Readahead,
        Ahead::PackWindow,
        Ahead::WholeFile,
        Ahead::Stretch,
        Ahead::ElfDeps,
        Ahead::Profile,
    ];

    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Ahead::Readahead => "readahead",
            Ahead::PackWindow => "pack_window",
            Ahead::WholeFile => "whole_file",
            Ahead::Stretch => "stretch",
            Ahead::ElfDeps => "elf_deps",
            Ahead::Profile => "profile",
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        Ahead::ALL.get(usize::from(code & !HELD).checked_sub(1)?).copied()
    }
}

/// [`PrefetchFlags`]: the chunk is in memory, fetched ahead, and no guest read used it yet.
const HELD: u8 = 0x80;

/// Why each chunk was queued ahead of the guest's reads, and which chunks in memory came from a
/// background fetch and were not read by the guest yet: one byte per chunk index (the [`Ahead`]
/// code, with [`HELD`] while in memory unused), so the read path pays one relaxed load per chunk
/// and no lock.
struct PrefetchFlags {
    why: Box<[AtomicU8]>,
}

impl PrefetchFlags {
    fn new(chunks: usize) -> Self {
        Self { why: (0..chunks).map(|_| AtomicU8::new(0)).collect() }
    }

    /// Chunk `index` is queued ahead for `why` (unless queued or held for a reason already: the
    /// first reason counts).
    fn queued(&self, index: u32, why: Ahead) {
        if let Some(f) = self.why.get(index as usize) {
            let _ = f.compare_exchange(0, why as u8, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// Chunk `index` went into memory, by a background fetch (`ahead`) or a guest read's; the
    /// reason it was fetched ahead for (readahead if none was noted).
    fn filled(&self, index: u32, ahead: bool) -> Option<Ahead> {
        let f = self.why.get(index as usize)?;
        if !ahead {
            f.store(0, Ordering::Relaxed);
            return None;
        }
        let why = Ahead::from_code(f.load(Ordering::Relaxed)).unwrap_or(Ahead::Readahead);
        f.store(why as u8 | HELD, Ordering::Relaxed);
        Some(why)
    }

    /// Clear chunk `index`'s flag; the reason it was fetched ahead for, if it was held unused
    /// (the first use or removal only).
    #[inline]
    fn take(&self, index: u32) -> Option<Ahead> {
        let f = self.why.get(index as usize)?;
        if f.load(Ordering::Relaxed) & HELD == 0 {
            return None;
        }
        let was = f.swap(0, Ordering::Relaxed);
        if was & HELD == 0 {
            return None;
        }
        Ahead::from_code(was)
    }

    /// Whether chunk `index` is held unused.
    fn unused(&self, index: usize) -> bool {
        self.why.get(index).is_some_and(|f| f.load(Ordering::Relaxed) & HELD != 0)
    }
}

/// The memory tier's index, one slot per chunk of the image: the chunk while the cache's policy
/// (moka) keeps it. A hit is one slot lookup by chunk index, with no hashing and none of moka's
/// read bookkeeping; a chunk is put in its slot right before it goes into moka and taken out when
/// moka evicts it (or refuses it: TinyLFU's admission), so the slots hold what moka holds.
///
/// The policy still sees the hits that matter: a hit reports itself to moka (a `get`, which
/// counts for recency and frequency) at most once between two insertions. Only an insertion can
/// evict, so while nothing is inserted the order moka keeps is never used; once insertions come,
/// every chunk read since the last one has been reported.
struct Slots {
    slots: Box<[Slot]>,
    /// Insertions so far (wrapping): a slot whose mark differs has not been reported since.
    epoch: AtomicU32,
}

/// A slot's chunk, borrowed.
type SlotGuard<'a> = parking_lot::RwLockReadGuard<'a, Option<Located>>;

/// A chunk's place in memory, if memory holds it, with the insertion epoch its hits were last
/// reported in ([`Located::mark`]). 32 bytes, aligned to them: a slot never straddles two cache
/// lines (a hit's first miss is its slot's line; at 48 bytes, half the slots cost two).
#[repr(align(32))]
struct Slot {
    chunk: parking_lot::RwLock<Option<Located>>,
}

impl Slots {
    fn new(chunks: usize) -> Self {
        let slots = (0..chunks).map(|_| Slot { chunk: parking_lot::RwLock::new(None) }).collect();
        Self { slots, epoch: AtomicU32::new(0) }
    }

    #[inline]
    fn get(&self, index: u32) -> Option<&Slot> {
        self.slots.get(index as usize)
    }

    /// Whether a hit on `located` must be told to the policy (once per epoch), and noted so.
    #[inline]
    fn report(&self, located: &Located) -> bool {
        let epoch = self.epoch.load(Ordering::Relaxed);
        let report = located.mark.load(Ordering::Relaxed) != epoch;
        if report {
            located.mark.store(epoch, Ordering::Relaxed);
        }
        report
    }

    /// Chunk `index`, if memory holds it; whether the policy must be told of the hit (once per
    /// epoch).
    #[inline]
    fn lookup(&self, index: u32) -> Option<(Chunk, bool)> {
        let held = self.get(index)?.chunk.read();
        let located = held.as_ref()?;
        Some((Arc::clone(located.buf()), self.report(located)))
    }

    /// Chunk `index` borrowed from its slot, if memory holds it: no reference count is taken
    /// (the count sits on the chunk's first cache line, so taking it cost a cache miss per chunk
    /// on the hot path). The guard must be dropped before anything that may evict (a moka call).
    /// Also whether the policy must be told of the hit.
    #[inline]
    fn hold(&self, index: u32) -> Option<(SlotGuard<'_>, bool)> {
        let held = self.get(index)?.chunk.read();
        let report = self.report(held.as_ref()?);
        Some((held, report))
    }

    fn contains(&self, index: u32) -> bool {
        self.get(index).is_some_and(|s| s.chunk.read().is_some())
    }

    /// Chunk `index` if memory holds it, without counting a hit or telling the policy (a look
    /// by the daemon itself, not a guest read).
    fn peek(&self, index: u32) -> Option<Chunk> {
        self.get(index)?.chunk.read().as_ref().map(|l| Arc::clone(l.buf()))
    }

    /// Chunk `index` is about to go into moka (not reported before the next insertion).
    fn put(&self, index: u32, chunk: &Chunk) {
        if let Some(slot) = self.get(index) {
            let epoch = self.epoch.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
            // `None` only for a buffer of 4 GiB or more, which no chunk is (the slot then stays
            // empty and reads fetch it again rather than serve it).
            *slot.chunk.write() = Located::new(Arc::clone(chunk), epoch);
        }
    }

    /// Moka dropped `chunk` (evicted, refused or replaced): empty the slot if it still holds that
    /// copy (not a newer one put since).
    fn remove(&self, index: u32, chunk: &Chunk) {
        if let Some(slot) = self.get(index) {
            let mut held = slot.chunk.write();
            if held.as_ref().is_some_and(|h| Arc::ptr_eq(h.buf(), chunk)) {
                *held = None;
            }
        }
    }
}

/// What one read's lookups ([`Core::held_quiet`]) leave for [`Core::report`].
#[derive(Default)]
struct Heard {
    /// Hits the policy must hear of.
    report: Vec<u32>,
    hits: u64,
    misses: u64,
}

/// A chunk a read copies from: borrowed from its slot (a hit) or owned (just fetched).
enum Held<'a> {
    Slot(SlotGuard<'a>),
    Owned(Chunk),
}

impl std::ops::Deref for Held<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            // `Slots::hold` returns only guards of a full slot.
            Held::Slot(g) => g.as_deref().map_or(&[], |c| c),
            Held::Owned(a) => a,
        }
    }
}

/// An image's device bytes with a byte-weighted memory tier of decoded chunks.
pub struct MemTier<S> {
    core: Arc<Core<S>>,
    fetcher: ChunkFetcher,
    readahead: u64,
    /// The pack order of the image's chunks (remote stores: batches follow it).
    order: Option<Arc<PackOrder>>,
    /// Pack-order readahead: the order and the window in stored bytes ([`Self::with_pack_readahead`]).
    pack_ahead: Option<(Arc<PackOrder>, u64)>,
    /// End offsets of recent reads: a read starting at one of them is sequential.
    streams: Mutex<Streams>,
    trace: Option<Arc<TraceRecorder>>,
    /// Whole-file and dense-stretch readahead, if either is on.
    misses: Option<MissRules>,
    /// The image's files as its block map shows them, built at the first miss a rule counts.
    files: OnceLock<FileMap>,
    /// Libraries fetched as soon as the program needing them is known, if on.
    elf: Option<ElfRules>,
}

/// [`MemTier::with_elf_deps`].
#[derive(Default)]
struct ElfRules {
    state: Mutex<ElfState>,
    /// Libraries are fetched whole up to this size.
    max_file_bytes: u64,
}

#[derive(Default)]
struct ElfState {
    /// Files (of [`FileMap`]) with a recent origin miss or fetched as a library, not examined
    /// yet, oldest first; at most [`ELF_RECENT`].
    recent: std::collections::VecDeque<u32>,
    examined: std::collections::HashSet<u32>,
    /// Files the dynamic loader is loading: libraries of a program seen loading them.
    loading: std::collections::HashSet<u32>,
    /// ELF files examined whose loader was not at work then, with the files of their libraries
    /// and interpreter, oldest first, at most [`ELF_RECENT`]: a later miss on one of those shows
    /// it is (the file's own bytes may arrive before it is first examined, as from a host's
    /// disk, and the loader's next read is what tells a program being loaded from one read).
    idle: std::collections::VecDeque<(u32, Vec<u32>, Option<u32>)>,
}

/// Files [`ElfRules`] keeps waiting for their headers or dynamic section to arrive.
const ELF_RECENT: usize = 16;

/// Readahead by where misses fall ([`MemTier::with_whole_files`],
/// [`MemTier::with_dense_stretches`]).
#[derive(Default)]
struct MissRules {
    /// Larger files are not fetched whole.
    max_file_bytes: u64,
    /// Files up to this size are fetched whole at their first miss (0: none).
    first_file_bytes: u64,
    /// Programs (executable files) up to this size are fetched whole at a miss of their first
    /// chunk (0: none; [`MemTier::with_programs_whole`]).
    program_bytes: u64,
    /// The programs over `first_file_bytes` and up to `program_bytes`, found once they are first
    /// asked about.
    programs: OnceLock<std::collections::HashSet<u32>>,
    /// The stretches' size in stored bytes (0: stretches off).
    stretch_bytes: u64,
    counts: Mutex<MissCounts>,
}

/// The largest file [`MemTier::with_whole_files`] fetches whole in `serve` (a database file
/// read at a few places is not a program's binary).
pub const WHOLE_FILE_MAX_BYTES: u64 = 64 << 20;

/// The chunks of the reads waiting on fetches ([`MemTier::fetch_ahead`]), held from the moment
/// each is in memory (or arrives) until its reads have copied it: the policy may refuse a chunk
/// it fetched for a read (TinyLFU's admission, a chunk over the budget) or evict it before the
/// read copies it, and the read must not fetch it again — that would cost its bytes twice, and
/// happen inside the fetch that handed the chunk over (its waiters are told as it arrives), where
/// a request could wait for a connection that fetch holds. Bounded by the reads in flight.
#[derive(Default)]
struct Pins {
    held: Mutex<HashMap<u32, Pin>>,
}

struct Pin {
    /// Reads waiting for the chunk or copying it.
    reads: u32,
    chunk: Option<Chunk>,
}

impl Pins {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Pin>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A read needs `chunks`; `now(c)` is chunk `c` if memory holds it already.
    fn hold(&self, chunks: &[u32], now: impl Fn(u32) -> Option<Chunk>) {
        let mut held = self.lock();
        for &c in chunks {
            let pin = held.entry(c).or_insert(Pin { reads: 0, chunk: None });
            pin.reads += 1;
            if pin.chunk.is_none() {
                pin.chunk = now(c);
            }
        }
    }

    /// Chunk `c` arrived: kept for the reads that hold it, if any.
    fn arrived(&self, c: u32, chunk: &Chunk) {
        let mut held = self.lock();
        if let Some(pin) = held.get_mut(&c) {
            pin.chunk.get_or_insert_with(|| Arc::clone(chunk));
        }
    }

    /// Chunk `c`, if a read holds it.
    fn chunk(&self, c: u32) -> Option<Chunk> {
        self.lock().get(&c).and_then(|p| p.chunk.clone())
    }

    /// A read is done with `chunks`.
    fn release(&self, chunks: &[u32]) {
        let mut held = self.lock();
        for c in chunks {
            if let Some(pin) = held.get_mut(c) {
                pin.reads = pin.reads.saturating_sub(1);
                if pin.reads == 0 {
                    held.remove(c);
                }
            }
        }
    }
}

struct Core<S> {
    reader: ImageReader<S>,
    /// The policy (what to keep within `capacity`); `slots` is the index reads go through.
    cache: Cache<u32, Chunk>,
    slots: Arc<Slots>,
    capacity: u64,
    stats: Arc<TierStats>,
    prefetched: Arc<PrefetchFlags>,
    /// Chunk buffers of 64 KiB–2 MiB go on huge pages ([`crate::hugebuf`]).
    huge_pages: AtomicBool,
    pins: Pins,
}

#[derive(Default)]
struct Streams {
    ends: [u64; STREAMS],
    next: usize,
}

impl Streams {
    /// Record a read `[offset, end)`; whether it continues an earlier one.
    fn note(&mut self, offset: u64, end: u64) -> bool {
        if offset > 0 {
            if let Some(e) = self.ends.iter_mut().find(|e| **e == offset) {
                *e = end;
                return true;
            }
        }
        self.ends[self.next] = end;
        self.next = (self.next + 1) % STREAMS;
        false
    }
}

impl<S> std::fmt::Debug for MemTier<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemTier")
            .field("capacity", &self.core.capacity)
            .field("weighted_size", &self.core.cache.weighted_size())
            .field("stats", &self.core.stats)
            .field("fetcher", &self.fetcher)
            .field("readahead", &self.readahead)
            .finish_non_exhaustive()
    }
}

impl<S: ChunkSource + 'static> Core<S> {
    /// Chunk `index` if it is in memory.
    fn cached(&self, index: u32) -> Option<Chunk> {
        match self.slots.lookup(index) {
            Some((chunk, report)) => {
                if report {
                    let _ = self.cache.get(&index);
                }
                self.stats.hits.fetch_add(1, Ordering::Relaxed);
                Some(chunk)
            }
            None => {
                self.stats.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Chunk `index` borrowed for a copy, if it is in memory, without telling the policy: the
    /// caller may hold other slots (a moka call may evict one of them, and eviction takes that
    /// slot's write lock), so a hit the policy must hear of is noted in `heard`, for
    /// [`Self::report`] once every slot is let go. The hit or miss is counted there too: one
    /// shared counter update per read, not one per chunk.
    fn held_quiet(&self, index: u32, heard: &mut Heard) -> Option<Held<'_>> {
        let Some((held, tell)) = self.slots.hold(index) else {
            heard.misses += 1;
            return None;
        };
        heard.hits += 1;
        if tell {
            heard.report.push(index);
        }
        Some(Held::Slot(held))
    }

    /// Tell the policy of the hits [`Self::held_quiet`] deferred, and count them. No slot may be
    /// held.
    fn report(&self, heard: &Heard) {
        for index in &heard.report {
            let _ = self.cache.get(index);
        }
        if heard.hits > 0 {
            self.stats.hits.fetch_add(heard.hits, Ordering::Relaxed);
        }
        if heard.misses > 0 {
            self.stats.misses.fetch_add(heard.misses, Ordering::Relaxed);
        }
    }

    /// `chunk`, just fetched, goes into memory (its slot first: see [`Slots`]).
    fn keep(&self, index: u32, chunk: &Chunk) {
        if self.capacity > 0 {
            self.slots.put(index, chunk);
        }
    }

    /// Chunk `index` for a guest read: from memory, else the copy fetched for the read
    /// ([`Pins`]), else fetched now.
    fn chunk(&self, index: u32) -> Result<Chunk, Arc<StoreError>> {
        if let Some(hit) = self.cached(index) {
            return Ok(hit);
        }
        if let Some(held) = self.pins.chunk(index) {
            // Offered to the policy again, as a fetch would have (an insertion counts as an
            // access: a chunk read again has a better chance of being admitted).
            let kept = self.cache.entry(index).or_insert_with(|| {
                self.keep(index, &held);
                Arc::clone(&held)
            });
            return Ok(kept.into_value());
        }
        self.fetch_into_memory(index, false)
    }

    /// Chunk `index`, fetched into memory if missing; `background`: for readahead or prefetch
    /// (a chunk this call fills is then flagged unused until a guest read uses it).
    fn fill(&self, index: u32, background: bool) -> Result<Chunk, Arc<StoreError>> {
        if let Some(hit) = self.cached(index) {
            return Ok(hit);
        }
        self.fetch_into_memory(index, background)
    }

    /// [`Self::fill`] past its lookup.
    fn fetch_into_memory(&self, index: u32, background: bool) -> Result<Chunk, Arc<StoreError>> {
        // The read path's refetch policy applies (a copy failing verification is fetched once
        // more, which reaches the origin: the tiers below drop a corrupt copy).
        self.cache.try_get_with(index, || {
            let chunk = self.admit(index, self.reader.fetch_chunk(index)?, background);
            self.keep(index, &chunk);
            Ok::<_, StoreError>(chunk)
        })
    }

    /// The chunks `indexes` (stored back to back in one pack: the fetcher's batch) fetched into
    /// memory with one request for those missing, each outcome handed to `arrived` as soon as
    /// the chunk is in memory (a read waiting for the head of a long batch goes on while the rest
    /// is on the wire); `background[i]`: chunk `i` is for readahead or prefetch.
    fn fill_batch(&self, indexes: &[u32], background: &[bool], arrived: &mut Arrived<'_>) {
        let quiet = |k: usize| background.get(k).copied().unwrap_or(false);
        if let ([index], false) = (indexes, quiet(0)) {
            // A guest read's chunk goes through the origin's join: reads of adjacent chunks
            // queued a moment apart (a burst of cold guest reads) still share a request there. A
            // background chunk does not: it has nobody to join, and a single read under way is
            // what makes the join wait for others (a demand miss arriving meanwhile would wait).
            let filled = self.fill(*index, false);
            if let Ok(chunk) = &filled {
                self.pins.arrived(*index, chunk);
            }
            arrived(0, filled.map(|_| ()));
            return;
        }
        // Counted as lookups, as a single fill is (one that arrived meanwhile is a hit).
        let mut missing: Vec<usize> = Vec::with_capacity(indexes.len());
        for (k, &c) in indexes.iter().enumerate() {
            if self.cached(c).is_some() {
                arrived(k, Ok(()));
            } else {
                missing.push(k);
            }
        }
        let wanted: Vec<u32> = missing.iter().map(|&k| indexes[k]).collect();
        self.reader.fetch_chunks(&wanted, &mut |m, data| {
            let Some(&k) = missing.get(m) else { return };
            let index = indexes[k];
            // Inserted only if absent, through moka's per-key initialisation (which `fill` shares):
            // a copy in memory is never replaced, so its slot always holds what moka holds.
            let outcome = data.map(|data| {
                let chunk = self.admit(index, data, quiet(k));
                self.pins.arrived(index, &chunk);
                self.cache.entry(index).or_insert_with(|| {
                    self.keep(index, &chunk);
                    chunk
                });
            });
            arrived(k, outcome);
        });
    }

    /// A chunk just fetched, counted (and flagged when a background fetch brought it), ready to
    /// go into memory.
    fn admit(&self, index: u32, data: Vec<u8>, background: bool) -> Chunk {
        self.stats.fetches.fetch_add(1, Ordering::Relaxed);
        self.stats.fetched_bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
        // Flagged before the chunk becomes visible, so no guest read can miss the flag.
        if let Some(why) = self.prefetched.filled(index, background) {
            self.stats.prefetched_chunks.fetch_add(1, Ordering::Relaxed);
            self.stats.prefetched_bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
            self.stats.ahead(why).fetched_bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
        }
        Arc::new(if self.huge_pages.load(Ordering::Relaxed) {
            ChunkBuf::from_vec(data)
        } else {
            ChunkBuf::on_heap(data)
        })
    }

    /// Whether chunk `index` is on this host below memory (the host disk cache): reading it costs
    /// a local read, so there is nothing to fetch ahead of the guest ([`ChunkSource::holds`]).
    fn held_below(&self, index: u32) -> bool {
        self.reader
            .image()
            .chunk_location(index)
            .is_some_and(|(chunk, pack, loc)| self.reader.source().holds(&chunk, &pack, &loc))
    }

    /// Where chunk `index` is stored (what batching and the background bandwidth look at).
    fn place(&self, index: u32) -> Option<ChunkPlace> {
        self.reader.image().chunk_location(index).map(|(_, _, loc)| ChunkPlace {
            pack: loc.pack,
            offset: loc.offset,
            stored_len: loc.stored_len,
        })
    }

    /// The chunks `[offset, offset + len)` needs, and of them those not in memory, in device
    /// order.
    fn needed(&self, offset: u64, len: u64) -> Result<(Vec<u32>, Vec<u32>), StoreError> {
        let plan =
            self.reader.image().record().block_map.plan(offset, len).map_err(StoreError::OutOfRange)?;
        let (mut all, mut missing): (Vec<u32>, Vec<u32>) = (Vec::new(), Vec::new());
        for seg in plan {
            if let SegmentSource::Chunk { chunk, .. } = seg.source {
                if all.last() != Some(&chunk) {
                    all.push(chunk);
                    if !self.slots.contains(chunk) {
                        missing.push(chunk);
                    }
                }
            }
        }
        Ok((all, missing))
    }

    /// The chunks after device byte `end` in the same file, up to `window` bytes: nothing if
    /// the chunk ending at `end` is a file's last (shorter than the chunk size); stops after the
    /// first short chunk and at anything that is not file data.
    fn chunks_after(&self, end: u64, window: u64) -> Vec<u32> {
        let image = self.reader.image();
        let record = image.record();
        let map = &record.block_map;
        let chunk_size = record.options.chunk_size;
        let chunks = map.chunks();
        let full = |c: u32| chunks.get(c as usize).is_some_and(|r| r.len >= chunk_size);
        let window = window.min(image.device_bytes().saturating_sub(end));
        if end == 0 || window == 0 {
            return Vec::new();
        }
        let last = match map.plan(end - 1, 1).ok().and_then(|mut p| p.next()) {
            Some(seg) => match seg.source {
                SegmentSource::Chunk { chunk, .. } => chunk,
                _ => return Vec::new(),
            },
            None => return Vec::new(),
        };
        if !full(last) {
            return Vec::new();
        }
        let Ok(plan) = map.plan(end, window) else { return Vec::new() };
        let mut out: Vec<u32> = Vec::new();
        for seg in plan {
            let SegmentSource::Chunk { chunk, .. } = seg.source else { break };
            if chunk == last || out.last() == Some(&chunk) {
                continue;
            }
            out.push(chunk);
            if !full(chunk) {
                break;
            }
        }
        out
    }
}

impl<S: ChunkSource + 'static> MemTier<S> {
    /// Serve `reader`'s image keeping up to `capacity` bytes of decoded chunks in memory (0
    /// keeps none: every chunk read goes to the source), fetching chunks on a [`ChunkFetcher`]
    /// with `limits`: the chunks of a read missing memory in parallel, each once, demand before
    /// background. The reader's own small chunk cache is turned off. No readahead or prefetch
    /// until asked ([`Self::with_readahead`], [`Self::prefetch`]).
    pub fn new(reader: ImageReader<S>, capacity: u64, limits: FetchLimits) -> Result<Self, StartError>
    where
        S: 'static,
    {
        Self::build(reader, capacity, limits, EvictionPolicy::tiny_lfu())
    }

    /// [`Self::new`] for a reader that goes through the device once, front to back (an
    /// export): memory is kept in plain LRU order. The default policy (TinyLFU) admits a new
    /// chunk only if it looks more popular than the one it would evict, so once memory is full
    /// of chunks already copied out, the chunks fetched ahead of the writer would be turned
    /// away and fetched again.
    pub fn streaming(reader: ImageReader<S>, capacity: u64, limits: FetchLimits) -> Result<Self, StartError>
    where
        S: 'static,
    {
        Self::build(reader, capacity, limits, EvictionPolicy::lru())
    }

    fn build(
        reader: ImageReader<S>,
        capacity: u64,
        limits: FetchLimits,
        policy: EvictionPolicy,
    ) -> Result<Self, StartError>
    where
        S: 'static,
    {
        let stats = Arc::new(TierStats::default());
        let chunks = reader.image().record().block_map.chunks().len();
        let prefetched = Arc::new(PrefetchFlags::new(chunks));
        let slots = Arc::new(Slots::new(if capacity > 0 { chunks } else { 0 }));
        let (listener_stats, listener_flags, listener_slots) =
            (Arc::clone(&stats), Arc::clone(&prefetched), Arc::clone(&slots));
        let cache = Cache::builder()
            .weigher(|_: &u32, v: &Chunk| u32::try_from(v.footprint()).unwrap_or(u32::MAX))
            .max_capacity(capacity)
            .eviction_policy(policy)
            .eviction_listener(move |index: Arc<u32>, chunk: Chunk, cause: RemovalCause| {
                listener_slots.remove(*index, &chunk);
                if cause == RemovalCause::Replaced {
                    return;
                }
                if let Some(why) = listener_flags.take(*index) {
                    listener_stats.prefetch_wasted_bytes.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                    listener_stats.ahead(why).wasted_bytes.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                }
            })
            .build();
        let batched = limits.batch_bytes > 0;
        let core = Arc::new(Core {
            reader: reader.with_cache_capacity(0),
            cache,
            slots,
            capacity,
            stats,
            prefetched,
            huge_pages: AtomicBool::new(true),
            pins: Pins::default(),
        });
        let order = batched.then(|| Arc::new(PackOrder::new(chunks, |c| core.place(c))));
        let (fetch_core, place_core) = (Arc::clone(&core), Arc::clone(&core));
        let fetcher = ChunkFetcher::start_handing_over(
            limits,
            move |chunks, background, arrived| fetch_core.fill_batch(chunks, background, arrived),
            move |c| place_core.place(c),
            order.clone(),
        )
        .map_err(StartError)?;
        if batched {
            let source_core = Arc::clone(&core);
            fetcher.set_ranges_per_request(move || source_core.reader.source().ranges_per_request());
        }
        Ok(Self {
            core,
            fetcher,
            readahead: 0,
            order,
            pack_ahead: None,
            streams: Mutex::default(),
            trace: None,
            misses: None,
            files: OnceLock::new(),
            elf: None,
        })
    }

    /// The image's files (built at first use: a warmed daemon, whose misses the disk cache
    /// answers, never builds it).
    fn file_map(&self) -> &FileMap {
        self.files.get_or_init(|| {
            let record = self.core.reader.image().record();
            FileMap::new(&record.block_map, record.options.chunk_size)
        })
    }

    /// Fetch the shared libraries a program or library needs, whole (up to `max_bytes` each and
    /// a quarter of the memory tier), in the background, as soon as the dynamic section of an
    /// ELF file that missed and went to the origin is in memory ([`crate::elfdeps`]): the
    /// dynamic loader opens them one after another, each first read a round trip of its own
    /// (`find`: libselinux, libm, libpcre2; `cc1`: seven), which this turns into one. Remote
    /// stores.
    pub fn with_elf_deps(mut self, on: bool, max_bytes: u64) -> Self {
        self.elf = (on && self.core.capacity > 0).then(|| ElfRules {
            max_file_bytes: max_bytes.min(self.core.capacity / 4),
            ..ElfRules::default()
        });
        self
    }

    /// The chunks of the libraries that the ELF files among recent misses (`fresh`, this
    /// read's; earlier ones not examined yet) need, once their headers and dynamic section are
    /// in memory — if the dynamic loader is at work: this read (`missed`) is of the file's
    /// interpreter or one of its libraries, or the file is itself a library being loaded (whose
    /// own libraries are then examined as they arrive, so the whole tree is fetched). A reader of
    /// the file's bytes (`cat`, a copy, a random whole-file reader) moves on to something else,
    /// and the libraries are left alone: following every ELF file read cost `bench lazy`'s
    /// whole-file workload 1.22x its origin bytes and 11 % more time.
    fn elf_deps(&self, missed: &[u32], fresh: &[u32]) -> Vec<u32> {
        let Some(rules) = &self.elf else { return Vec::new() };
        if fresh.is_empty() && rules.state.lock().unwrap_or_else(|p| p.into_inner()).recent.is_empty() {
            // Nothing new from the origin and nothing waiting (a warmed daemon's reads).
            return Vec::new();
        }
        let files = self.file_map();
        let map = &self.core.reader.image().record().block_map;
        let size = u64::from(self.core.reader.image().record().options.chunk_size);
        let file_at = |offset: u64| {
            let chunk = map.plan(offset, 1).ok().and_then(|mut p| p.next()).and_then(|s| match s.source {
                SegmentSource::Chunk { chunk, .. } => Some(chunk),
                _ => None,
            });
            chunk.and_then(|c| files.file_of(c))
        };
        let reading: Vec<u32> = missed.iter().filter_map(|&c| files.file_of(c)).collect();
        let mut st = rules.state.lock().unwrap_or_else(|p| p.into_inner());
        let ElfState { recent, examined, loading, idle } = &mut *st;
        let note = |recent: &mut std::collections::VecDeque<u32>, f: u32| {
            if !recent.contains(&f) {
                if recent.len() == ELF_RECENT {
                    recent.pop_front();
                }
                recent.push_back(f);
            }
        };
        for f in fresh.iter().filter_map(|&c| files.file_of(c)) {
            if !examined.contains(&f) {
                note(recent, f);
            }
        }
        let mut libraries = Vec::new();
        let mut waiting = std::collections::VecDeque::new();
        // Files examined before, whose loader this read shows at work now.
        let at_work = |libs: &[u32], interp: Option<u32>| {
            reading.iter().any(|r| libs.contains(r) || Some(*r) == interp)
        };
        let mut woken = Vec::new();
        idle.retain(|(f, libs, interp)| {
            let now = at_work(libs, *interp);
            if now {
                woken.push((*f, libs.clone()));
            }
            !now
        });
        for (f, libs) in woken {
            tracing::trace!(file = f, "an ELF file's loader at work at a later read");
            for &l in &libs {
                if !examined.contains(&l) && loading.insert(l) {
                    waiting.push_back(l);
                }
            }
            libraries.extend(libs);
        }
        while let Some(f) = recent.pop_front() {
            let chunks = files.chunks(f);
            // The file's bytes at `offset`, if memory holds them (its chunks are full-size but
            // the last, FileMap's rule).
            let bytes = |offset: u64, n: usize| -> Option<Vec<u8>> {
                let mut out = Vec::with_capacity(n);
                let end = offset.checked_add(n as u64)?;
                let mut at = offset;
                while at < end {
                    let k = at / size;
                    let data = self.core.slots.peek(*chunks.get(usize::try_from(k).ok()?)?)?;
                    let inner = usize::try_from(at - k * size).ok()?;
                    let take = usize::try_from(end - at).ok()?.min(data.len().checked_sub(inner)?);
                    if take == 0 {
                        return None;
                    }
                    out.extend_from_slice(&data[inner..inner + take]);
                    at += take as u64;
                }
                Some(out)
            };
            match crate::elfdeps::parse(files.bytes(f), bytes) {
                crate::elfdeps::Needs::Later => {
                    waiting.push_back(f);
                    continue;
                }
                crate::elfdeps::Needs::Nothing => {}
                crate::elfdeps::Needs::Libraries { machine, names, interp } => {
                    let image = self.core.reader.shared_image();
                    let found = crate::elfdeps::locate(image, machine, &names, interp.as_deref());
                    let libs: Vec<u32> =
                        found.libraries.into_iter().filter_map(file_at).filter(|&l| l != f).collect();
                    let interp = found.interp.and_then(file_at);
                    let working = loading.contains(&f) || at_work(&libs, interp);
                    tracing::trace!(file = f, ?names, at_work = working, "an ELF file's libraries");
                    if working {
                        for &l in &libs {
                            if !examined.contains(&l) && loading.insert(l) {
                                waiting.push_back(l);
                            }
                        }
                        libraries.extend(libs);
                    } else if !libs.is_empty() || interp.is_some() {
                        if idle.len() == ELF_RECENT {
                            idle.pop_front();
                        }
                        idle.push_back((f, libs, interp));
                    }
                }
            }
            examined.insert(f);
        }
        for f in waiting {
            note(recent, f);
        }
        drop(st);
        libraries.sort_unstable();
        libraries.dedup();
        let mut out = Vec::new();
        for l in libraries {
            if files.bytes(l) <= rules.max_file_bytes {
                out.extend_from_slice(files.chunks(l));
            }
        }
        out
    }

    /// Fetch a file whole in the background (behind demand, with readahead's priority) once
    /// `after` of its chunks missed memory and had to come from the origin — not foreseen by
    /// readahead, a profile or a pack window, and not on this host — if it holds at most
    /// `max_bytes` (and a quarter of the memory tier). A program's binary and libraries are read
    /// at random, page fault by page fault, most of the way (gcc's `cc1`: 240 reads, 22 of its
    /// 32 MiB; python's interpreter: 54 reads, 5.1 of 6.5 MiB): each miss is a round trip of its
    /// own that no window foresees. 0 turns it off.
    pub fn with_whole_files(mut self, after: u32, max_bytes: u64) -> Self {
        let max_file_bytes = max_bytes.min(self.core.capacity / 4);
        if let Some(rules) = self.miss_rules(after > 0) {
            rules.max_file_bytes = max_file_bytes;
            rules.counts.get_mut().unwrap_or_else(|p| p.into_inner()).set_file_after(after);
        }
        self
    }

    /// Fetch a file of at most `max_bytes` (and a quarter of the memory tier) whole in the
    /// background at its first chunk that missed memory and had to come from the origin, as
    /// [`Self::with_whole_files`] does at the `after`-th: a program's first read is its `exec`,
    /// a reader's the first of a file it reads through, and the rest of either is a chain of
    /// round trips each. 0 turns it off.
    pub fn with_whole_files_at_first(mut self, max_bytes: u64) -> Self {
        let first = max_bytes.min(self.core.capacity / 4);
        if let Some(rules) = self.miss_rules(first > 0) {
            rules.first_file_bytes = first;
        }
        self
    }

    /// Fetch a program (an executable regular file of the image's ext4 metadata) of at most
    /// `max_bytes` (and a quarter of the memory tier) whole in the background when a read of its
    /// first chunk missed memory and had to come from the origin, however large it is beside
    /// [`Self::with_whole_files_at_first`]'s files: an `exec` reads the program's header first,
    /// then most of it page fault by page fault (gcc's `cc1`, 32 MiB: 240 reads, 22 MiB), each a
    /// round trip that the third-miss rule of [`Self::with_whole_files`] would have paid twice
    /// over before fetching it all. A large file that is not executable keeps the other rules. 0
    /// turns it off.
    pub fn with_programs_whole(mut self, max_bytes: u64) -> Self {
        let cap = max_bytes.min(self.core.capacity / 4);
        if let Some(rules) = self.miss_rules(cap > 0) {
            rules.program_bytes = cap;
        }
        self
    }

    /// Fetch a stretch of a pack whole in the background (as [`Self::with_whole_files`] does a
    /// file) once reads of `after` distinct files stored in it missed memory and went to the
    /// origin: the stretches are `bytes` (stored) long, aligned in each pack. The builder packs
    /// in tree order, so a stretch holds files of one directory, and a program start that reads
    /// several of them one after another (python's imports: 177 files, most of them small
    /// modules in a few directories) pays a round trip for each that no pack window foresaw.
    /// Reads of two of its files missing within `within` stretch misses of each other also make
    /// a stretch due (0: only the rule of `after`): a start reads a directory's modules one after
    /// another, where a reader of random files comes back to a stretch now and then. Remote
    /// stores; `after` 0 turns stretches off.
    pub fn with_dense_stretches(mut self, after: u32, bytes: u64, within: u32) -> Self {
        let bytes = bytes.min(self.core.capacity / 8);
        let on = after > 0 && bytes > 0;
        if on && self.order.is_none() {
            let chunks = self.core.reader.image().record().block_map.chunks().len();
            self.order = Some(Arc::new(PackOrder::new(chunks, |c| self.core.place(c))));
        }
        if let Some(rules) = self.miss_rules(on) {
            rules.stretch_bytes = if on { bytes } else { 0 };
            let counts = rules.counts.get_mut().unwrap_or_else(|p| p.into_inner());
            counts.set_stretch_after(if on { after } else { 0 }, within);
        }
        self
    }

    /// The miss rules, made if `on` and there is memory to fetch into; `None` if there are none
    /// and `on` is false (nothing to turn off).
    fn miss_rules(&mut self, on: bool) -> Option<&mut MissRules> {
        if on && self.core.capacity > 0 && self.misses.is_none() {
            self.misses = Some(MissRules::default());
        }
        self.misses.as_mut()
    }

    /// Record the first touch of every chunk a read needs (`--record-trace`).
    pub fn with_trace(self, trace: Arc<TraceRecorder>) -> Self {
        Self { trace: Some(trace), ..self }
    }

    /// Fetch up to `bytes` of the following chunks of the same file in the background when a
    /// read continues the previous one (0 turns readahead off).
    pub fn with_readahead(self, bytes: u64) -> Self {
        Self { readahead: bytes, ..self }
    }

    /// Whether chunk buffers of 64 KiB–2 MiB go in huge-page slots ([`crate::hugebuf`]; the
    /// default) or on the heap's ordinary pages.
    pub fn with_huge_pages(self, on: bool) -> Self {
        self.core.huge_pages.store(on, Ordering::Relaxed);
        self
    }

    /// When a read misses memory, fetch up to `bytes` (stored) of the chunks stored after each
    /// missed chunk in its pack, whatever file they belong to, in the same request as the miss
    /// ([`crate::packorder`]; 0 turns it off).
    pub fn with_pack_readahead(self, bytes: u64) -> Self {
        let pack_ahead = (bytes > 0 && self.core.capacity > 0).then(|| {
            let order = self.order.clone().unwrap_or_else(|| {
                let chunks = self.core.reader.image().record().block_map.chunks().len();
                Arc::new(PackOrder::new(chunks, |c| self.core.place(c)))
            });
            (order, bytes)
        });
        Self { pack_ahead, ..self }
    }

    /// The chunks pack-order readahead adds to the demand fetch of `missed`: a window after each
    /// chunk nobody had asked for yet. A chunk already queued or being fetched was foreseen (by
    /// readahead, a profile, another read's window): the reader is following a prediction that
    /// works, and its pack neighbours are no likelier to be read than the prediction's next.
    fn pack_ahead(&self, missed: &[u32], fresh: &[u32]) -> Vec<u32> {
        let Some((order, window)) = &self.pack_ahead else { return Vec::new() };
        let mut out: Vec<u32> = Vec::new();
        for &c in fresh {
            let stored = |n: u32| self.core.place(n).map_or(0, |p| u64::from(p.stored_len));
            let skip = |n: u32| {
                missed.contains(&n)
                    || out.contains(&n)
                    || self.contains(n)
                    || self.fetcher.is_pending(n)
                    || self.core.held_below(n)
            };
            let more = order.after(c, *window, stored, skip);
            out.extend(more);
        }
        out
    }

    /// The chunks of the files and pack stretches that `fresh` (misses of `missed` the origin
    /// answers) make due for fetching whole ([`Self::with_whole_files`],
    /// [`Self::with_dense_stretches`]), less what is read, queued (`queued`), in memory, pending
    /// or held below.
    fn due_on_misses(&self, missed: &[u32], fresh: &[u32], queued: &[u32]) -> Vec<u32> {
        let Some(rules) = &self.misses else { return Vec::new() };
        if fresh.is_empty() {
            return Vec::new();
        }
        let files = self.file_map();
        // A miss of a program's first chunk, if the program is too large for the first-miss
        // rule and small enough for this one (the programs are looked up once, at the first
        // miss that could be one).
        let program_start = |c: u32, f: u32| {
            let bytes = files.bytes(f);
            rules.program_bytes > 0
                && bytes > rules.first_file_bytes
                && bytes <= rules.program_bytes
                && files.chunks(f).first() == Some(&c)
                && rules
                    .programs
                    .get_or_init(|| {
                        let image = self.core.reader.image();
                        let found = crate::programs::programs(
                            image,
                            files,
                            rules.first_file_bytes,
                            rules.program_bytes,
                        );
                        tracing::debug!(programs = found.len(), "looked up the image's large programs");
                        found
                    })
                    .contains(&f)
        };
        let starts: Vec<bool> =
            fresh.iter().map(|&c| files.file_of(c).is_some_and(|f| program_start(c, f))).collect();
        let (mut due_files, mut due_stretches) = (Vec::new(), Vec::new());
        {
            let mut counts = rules.counts.lock().unwrap_or_else(|p| p.into_inner());
            for (&c, &program) in fresh.iter().zip(&starts) {
                let stretch = (rules.stretch_bytes > 0)
                    .then(|| self.core.place(c).map(|p| (p.pack, p.offset / rules.stretch_bytes)))
                    .flatten();
                let file = files.file_of(c);
                let at_once = program || file.is_some_and(|f| files.bytes(f) <= rules.first_file_bytes);
                let (file, stretch) = counts.miss(file, at_once, stretch);
                due_files.extend(file.filter(|&f| {
                    let bytes = files.bytes(f);
                    program || bytes <= rules.max_file_bytes || bytes <= rules.first_file_bytes
                }));
                if stretch.is_some() {
                    due_stretches.push(c);
                }
            }
        }
        if due_files.is_empty() && due_stretches.is_empty() {
            return Vec::new();
        }
        let wanted = |c: &u32| {
            !missed.contains(c)
                && !queued.contains(c)
                && !self.contains(*c)
                && !self.fetcher.is_pending(*c)
                && !self.core.held_below(*c)
        };
        let mut out: Vec<u32> = due_files.iter().flat_map(|&f| files.chunks(f)).copied().collect();
        out.sort_unstable();
        out.dedup();
        out.retain(wanted);
        let from_files = out.len();
        if let Some(order) = &self.order {
            let mut near: Vec<u32> = due_stretches
                .iter()
                .filter_map(|&c| order.stretch(c, rules.stretch_bytes, |n| self.core.place(n)))
                .flat_map(|(_, chunks)| chunks)
                .collect();
            near.sort_unstable();
            near.dedup();
            near.retain(|c| out[..from_files].binary_search(c).is_err() && wanted(c));
            out.extend(near);
        }
        self.mark(&out[..from_files], Ahead::WholeFile);
        self.mark(&out[from_files..], Ahead::Stretch);
        let stats = &self.core.stats;
        stats.whole_files.fetch_add(due_files.len() as u64, Ordering::Relaxed);
        stats.whole_file_chunks.fetch_add(from_files as u64, Ordering::Relaxed);
        stats.stretches.fetch_add(due_stretches.len() as u64, Ordering::Relaxed);
        stats.stretch_chunks.fetch_add((out.len() - from_files) as u64, Ordering::Relaxed);
        out
    }

    /// The reader underneath.
    pub fn reader(&self) -> &ImageReader<S> {
        &self.core.reader
    }

    /// Device size in bytes.
    pub fn device_bytes(&self) -> u64 {
        self.core.reader.device_bytes()
    }

    /// Counters.
    pub fn stats(&self) -> &TierStats {
        &self.core.stats
    }

    /// The fetcher's counters.
    pub fn fetcher_stats(&self) -> &FetcherStats {
        self.fetcher.stats()
    }

    /// The chunk fetcher (its threads also run the jobs of frontends: [`ChunkFetcher::run`]).
    pub fn fetcher(&self) -> &ChunkFetcher {
        &self.fetcher
    }

    /// Chunk fetches queued or running.
    pub fn pending_fetches(&self) -> usize {
        self.fetcher.pending()
    }

    /// Chunks fetched a second time because the first copy failed verification.
    pub fn refetches(&self) -> u64 {
        self.core.reader.refetches()
    }

    /// Chunks held.
    pub fn chunks(&self) -> u64 {
        self.core.cache.entry_count()
    }

    /// The budget in bytes.
    pub fn capacity(&self) -> u64 {
        self.core.capacity
    }

    /// Decoded bytes of the chunks a background fetch brought into memory that no guest read
    /// has used yet (and that are not evicted). Walks one flag per chunk of the image: for
    /// scrapes, not for the read path.
    pub fn prefetch_unused_bytes(&self) -> u64 {
        self.core.cache.run_pending_tasks();
        let chunks = self.core.reader.image().record().block_map.chunks();
        let flags = &self.core.prefetched;
        chunks.iter().enumerate().filter(|(i, _)| flags.unused(*i)).map(|(_, c)| u64::from(c.len)).sum()
    }

    /// Bytes of decoded chunks held.
    pub fn weighted_size(&self) -> u64 {
        self.core.cache.run_pending_tasks();
        self.core.cache.weighted_size()
    }

    /// Whether chunk `index` is in memory (no statistics counted).
    pub fn contains(&self, index: u32) -> bool {
        self.core.slots.contains(index)
    }

    /// Chunk `index`, fetched, decoded and verified if it is not in memory (concurrent callers
    /// of the same chunk share one fetch, and its error). A chunk failing verification is
    /// fetched again ([`tessera_store::refetch_if_corrupt`]) before the error is returned.
    pub fn chunk(&self, index: u32) -> Result<Chunk, Arc<StoreError>> {
        self.core.chunk(index)
    }

    /// Queue the chunks `ids` names (a prefetch profile, in fetch order) for background fetching
    /// behind demand and readahead fetches. Chunks the image lacks or memory holds are skipped;
    /// at most half the memory tier's capacity is queued, so prefetching never evicts what it
    /// fetched (nor much of what the guest read). Returns the number of chunks queued.
    pub fn prefetch(&self, ids: impl IntoIterator<Item = ChunkId>) -> usize {
        let image = self.core.reader.image();
        let map = &image.record().block_map;
        let budget = self.core.capacity / 2;
        let mut bytes = 0u64;
        let mut queued = Vec::new();
        for id in ids {
            let Some(i) = image.chunk_index(&id) else { continue };
            if self.contains(i) {
                continue;
            }
            let len = map.chunks().get(i as usize).map_or(0, |c| u64::from(c.len));
            if bytes + len > budget {
                break;
            }
            bytes += len;
            queued.push(i);
        }
        self.mark(&queued, Ahead::Profile);
        self.fetcher.fetch(&queued, Priority::Prefetch, None);
        self.core.stats.prefetch_chunks.fetch_add(queued.len() as u64, Ordering::Relaxed);
        queued.len()
    }

    /// A read of `[offset, offset + len)` arrived: if it continues an earlier one, queue the
    /// next chunks of the file for readahead.
    /// Note why `chunks` are about to be queued ahead of the guest's reads (before they are:
    /// a fetch may fill them at once).
    fn mark(&self, chunks: &[u32], why: Ahead) {
        for &c in chunks {
            self.core.prefetched.queued(c, why);
        }
    }

    fn note_read(&self, offset: u64, len: u64) {
        if self.readahead == 0 || len == 0 || self.core.capacity == 0 {
            return;
        }
        let end = offset.saturating_add(len);
        let sequential = self.streams.lock().unwrap_or_else(|p| p.into_inner()).note(offset, end);
        if !sequential {
            return;
        }
        // Ahead of the guest only what is not on this host already: a chunk the disk cache holds
        // is a local read away, and decoding it ahead costs CPU for what the guest may not read.
        // (Cheapest checks first: this runs on the queue thread, and `held_below` is a `stat`.)
        let ahead: Vec<u32> = self
            .core
            .chunks_after(end, self.readahead)
            .into_iter()
            .filter(|&c| !self.contains(c) && !self.fetcher.is_pending(c) && !self.core.held_below(c))
            .collect();
        if !ahead.is_empty() {
            self.core.stats.readahead_chunks.fetch_add(ahead.len() as u64, Ordering::Relaxed);
            self.mark(&ahead, Ahead::Readahead);
            self.fetcher.fetch(&ahead, Priority::Readahead, None);
        }
    }
}

impl<S: ChunkSource + 'static> BlockDevice for MemTier<S> {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        let len = buf.len() as u64;
        self.visit(offset, len, true, &mut BufSink::new(buf)).map(|_| ())
    }

    fn visit(&self, offset: u64, len: u64, fetch: bool, sink: &mut dyn Sink) -> Result<Visit, ReadError> {
        // Readahead looks at reads of file data only, on their first visit (the queue thread's,
        // without `fetch`; a deferred read's second visit must not count twice).
        let mut noted = fetch;
        let mut heard = Heard::default();
        let chunk = |chunk: u32, at: u64| {
            if !noted {
                noted = true;
                self.note_read(offset, len);
            }
            if let Some(trace) = &self.trace {
                trace.touch(chunk);
            }
            let data = if fetch {
                Held::Owned(self.core.chunk(chunk).map_err(|source| ReadError::Store { offset: at, source })?)
            } else {
                match self.core.held_quiet(chunk, &mut heard) {
                    Some(d) => d,
                    None => return Ok(None),
                }
            };
            if let Some(why) = self.core.prefetched.take(chunk) {
                let stats = &self.core.stats;
                stats.prefetch_used_bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
                stats.ahead(why).used_bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
            }
            Ok(Some(data))
        };
        // The walk holds every chunk of the range at once (`OpenImage::walk`).
        let visited = self.core.reader.image().walk(offset, len, chunk, |piece| match piece {
            Piece::Bytes(b) => sink.put(b).map_err(ReadError::from),
            Piece::Zeros(n) => sink.zeros(n).map_err(ReadError::from),
        });
        self.core.report(&heard);
        visited
    }

    fn spawn(&self, job: crate::fetcher::Job) {
        self.fetcher.run(job)
    }

    fn fetch_ahead(&self, offset: u64, len: u64, done: FetchDone) {
        if self.core.capacity == 0 {
            // Without memory to keep them in, chunks fetched ahead would be gone before the read
            // copies them: the read fetches inline, on a fetch thread.
            return self.fetcher.run(Box::new(move || done(Ok(()))));
        }
        match self.core.needed(offset, len) {
            Ok((all, chunks)) => {
                // The read's chunks are held for it from now until it has copied them (`Pins`),
                // whatever the policy keeps meanwhile.
                self.core.pins.hold(&all, |c| self.core.slots.peek(c));
                let core = Arc::clone(&self.core);
                let done: FetchDone = Box::new(move |fetched| {
                    done(fetched);
                    core.pins.release(&all);
                });
                // The misses nothing foresaw (not queued or being fetched) that the host does not
                // hold: each is a request to the origin.
                let fresh: Vec<u32> =
                    if self.pack_ahead.is_some() || self.misses.is_some() || self.elf.is_some() {
                        let unforeseen = |&c: &u32| !self.fetcher.is_pending(c) && !self.core.held_below(c);
                        chunks.iter().copied().filter(unforeseen).collect()
                    } else {
                        Vec::new()
                    };
                let mut ahead = self.pack_ahead(&chunks, &fresh);
                self.core.stats.pack_window_chunks.fetch_add(ahead.len() as u64, Ordering::Relaxed);
                self.mark(&ahead, Ahead::PackWindow);
                let whole = self.due_on_misses(&chunks, &fresh, &ahead);
                ahead.extend(whole);
                // In one step: the miss and its window (and a file or stretch due whole) leave
                // together, in requests of their own.
                self.fetcher.fetch_with_ahead(&chunks, Priority::Demand, Some(done), &ahead);
                // After the miss has gone out: looking an ELF file's libraries up does not delay
                // its request.
                let mut libraries = self.elf_deps(&chunks, &fresh);
                if !libraries.is_empty() {
                    libraries.sort_unstable();
                    libraries.dedup();
                    libraries.retain(|c| {
                        !self.contains(*c) && !self.fetcher.is_pending(*c) && !self.core.held_below(*c)
                    });
                    self.core.stats.elf_dep_chunks.fetch_add(libraries.len() as u64, Ordering::Relaxed);
                    self.mark(&libraries, Ahead::ElfDeps);
                    self.fetcher.fetch(&libraries, Priority::Readahead, None);
                }
            }
            Err(e) => done(Err(Arc::new(e))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_takes_half_a_cache_line_and_never_two() {
        assert_eq!(std::mem::size_of::<Slot>(), 32);
        assert_eq!(std::mem::align_of::<Slot>(), 32);
        let slots = Slots::new(5);
        assert!(slots.slots.iter().all(|s| (s as *const Slot as usize) % 32 == 0));
    }

    #[test]
    fn a_hit_is_reported_once_per_insertion() {
        let slots = Slots::new(3);
        let chunk: Chunk = Arc::new(ChunkBuf::on_heap(vec![1, 2, 3]));
        slots.put(1, &chunk);
        // Just inserted: nothing to report until the next insertion.
        assert!(!slots.hold(1).unwrap().1);
        slots.put(2, &chunk);
        assert!(slots.hold(1).unwrap().1, "first hit since an insertion");
        assert!(!slots.lookup(1).unwrap().1, "reported already");
        assert_eq!(&slots.hold(1).unwrap().0.as_deref().map(|l| l.to_vec()).unwrap(), &[1, 2, 3]);
        slots.remove(1, &chunk);
        assert!(slots.hold(1).is_none() && !slots.contains(1) && slots.contains(2));
        assert!(slots.hold(7).is_none(), "past the image's chunks");
    }
}
