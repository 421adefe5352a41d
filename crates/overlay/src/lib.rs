//! The copy-on-write overlay: the guest's writes on top of a read-only base image, in one file
//! (format and crash argument in `docs/formats/overlay.md`). No virtio knowledge: byte offsets
//! in, bytes out.
//!
//! The file is an array of `block_size` slots. Slot 0 holds two header copies; the other slots
//! hold written blocks or log segments. The block map (device block → slot run, or zeros) lives
//! in memory and is persisted as a checksummed log of map updates, chained through log segment
//! slots. A write goes to fresh slots (never over a slot the durable map still references) and
//! appends its map record to the log before it completes (no sync: a `kill -9` keeps every
//! completed write, as the page cache outlives the process); FLUSH closes the open flush group
//! and calls `sync_data` once. Slots released by a write or a discard become reusable once the
//! FLUSH closing the group that logged their release *and the two after it* have completed (so
//! that no record of the two groups a power loss can leave in doubt points into a slot holding
//! other data: a record partly superseded must still check). Opening replays the log up to
//! the last valid record, checks the data of the last two flush groups (the ones a power loss
//! can leave in doubt) against the checksums in their records, and writes a compacted log
//! under a new salt (a checkpoint), so stale records past the old log's end can never validate.

pub mod extents;
pub mod format;
pub mod io;

use std::collections::hash_map::RandomState;
use std::fs::{self, File, OpenOptions};
use std::hash::BuildHasher;
use std::io as stdio;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use tessera_engine::{BlockDevice, FetchDone, ReadError, Sink, SinkError, Visit};
use tessera_image::ImageId;
use thiserror::Error;
use tracing::{debug, info, warn};

use crate::extents::{ExtentMap, FreeSpace, Mapping};
use crate::format::{
    Header, HeaderProblem, Op, Record, RecordProblem, HEADER_B_OFFSET, HEADER_LEN, RECORD_LEN, VERSION,
};
use crate::io::{FileIo, LoseUnsyncedIo, OverlayIo};

/// What an overlay belongs to; an overlay made for other parameters is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverlayParams {
    pub image_id: ImageId,
    /// Bytes per block (the image's block size, 4096).
    pub block_size: u32,
    pub device_bytes: u64,
}

/// Errors of the overlay.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum OverlayError {
    #[error("{what} at byte {offset} of the overlay")]
    Io {
        what: &'static str,
        offset: u64,
        #[source]
        source: stdio::Error,
    },
    #[error("reading the base image")]
    Base(#[from] ReadError),
    #[error(transparent)]
    Sink(#[from] SinkError),
    #[error("not a Tessera overlay ({0})")]
    NotAnOverlay(&'static str),
    #[error("overlay format version {0} is not supported (this tessera reads versions 1 and 2)")]
    UnsupportedVersion(u32),
    #[error("the overlay was made for image {found}, not {expected}")]
    ImageMismatch { expected: ImageId, found: ImageId },
    #[error("the overlay has {found}-byte blocks, the image {expected}-byte blocks")]
    BlockSizeMismatch { expected: u32, found: u32 },
    #[error("the overlay was made for a {found}-byte device, the image is {expected} bytes")]
    DeviceSizeMismatch { expected: u64, found: u64 },
    #[error("corrupt overlay: {what} (slot {slot})")]
    Corrupt { what: &'static str, slot: u64 },
    #[error("bytes {offset}+{len} are beyond the end of the device ({device_bytes} bytes)")]
    OutOfRange { offset: u64, len: u64, device_bytes: u64 },
    #[error("unsupported block size {0} (a power of two from 4096 to 65536)")]
    BadBlockSize(u32),
    #[error("an earlier overlay write or flush failed; the overlay refuses writes until restarted")]
    Failed,
    #[error(
        "the overlay's file system was full when the overlay was opened; it refuses writes until it is opened \
         again with space"
    )]
    FullAtOpen,
    #[error("the overlay was opened read-only")]
    ReadOnly,
    #[error("the overlay is in use by another process")]
    InUse,
    #[error("overlay {}", path.display())]
    At {
        path: PathBuf,
        #[source]
        source: Box<OverlayError>,
    },
}

impl OverlayError {
    fn io(what: &'static str, offset: u64) -> impl FnOnce(stdio::Error) -> OverlayError {
        move |source| OverlayError::Io { what, offset, source }
    }

    fn at(self, path: &Path) -> OverlayError {
        OverlayError::At { path: path.to_owned(), source: Box::new(self) }
    }

    /// Whether the error is the file system's lack of space (ENOSPC, or EDQUOT: a quota).
    pub fn is_out_of_space(&self) -> bool {
        match self {
            OverlayError::Io { source, .. } => {
                matches!(source.kind(), stdio::ErrorKind::StorageFull | stdio::ErrorKind::QuotaExceeded)
            }
            OverlayError::At { source, .. } => source.is_out_of_space(),
            _ => false,
        }
    }
}

/// How an overlay is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Reads and writes; FLUSH makes writes durable (one `sync_data` per FLUSH with writes).
    Durable,
    /// Reads and writes, never synced: a temporary overlay that dies with the process.
    Volatile,
    /// Reads only (e.g. to export base plus overlay); nothing is written, not even a checkpoint.
    ReadOnly,
}

/// Figures about an overlay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OverlayStats {
    /// Extents of the block map.
    pub extents: u64,
    /// Device blocks held in slots.
    pub written_blocks: u64,
    /// Device blocks reading as zeros.
    pub zero_blocks: u64,
    /// Slots in the file (including the header and log segments).
    pub file_slots: u64,
    /// Slots free for reuse below the end of the file.
    pub free_slots: u64,
    /// Map records logged since the last FLUSH began (not yet synced).
    pub pending_records: u64,
    /// FLUSHes that synced something.
    pub syncs: u64,
    /// Checkpoints written: at open, and by compaction while serving.
    pub checkpoints: u64,
    /// Slots zero-filled and synced ahead of the allocation frontier
    /// ([`Overlay::prepare_ahead`]).
    pub prepared_slots: u64,
    /// Slots released by overwrites and discards, not reusable yet.
    pub held_slots: u64,
}

/// The copy-on-write overlay of one device.
pub struct Overlay {
    io: Box<dyn OverlayIo>,
    base: Arc<dyn BlockDevice>,
    params: OverlayParams,
    bs: u64,
    mode: Mode,
    state: RwLock<State>,
    /// Serializes writers (a sub-block write reads, merges and writes a whole block).
    write_lock: Mutex<()>,
    /// The log's write position: held to append a record, to close a flush group, and
    /// throughout a checkpoint. Never held across a FLUSH's sync.
    log: Mutex<LogTail>,
    /// Serializes FLUSHes and compactions (held across their syncs).
    commit_lock: Mutex<()>,
    /// Opened on a full file system ([`Self::open`]): reads served, writes refused, and no
    /// write accepted since, so a FLUSH has nothing to make durable.
    full_at_open: AtomicBool,
    failed: AtomicBool,
    syncs: AtomicU64,
    /// FLUSHes waiting for the group commit ([`Overlay::flush_async`]).
    commits: Mutex<Commits>,
    /// Checkpoints written (at open and by compaction).
    checkpoints: AtomicU64,
    /// A compaction is queued or running.
    compacting: AtomicBool,
    /// The group commit compacts the log once it holds this many records (and 4× the map's).
    compact_min_records: u64,
    /// Bytes of zero-filled free slots kept ready past the allocation frontier (0: none).
    prepare_ahead: u64,
    /// A preparation is queued or running.
    preparing: AtomicBool,
    /// No preparation before this instant (one failed to write, e.g. on a full disk).
    prepare_paused: Mutex<Option<Instant>>,
    /// Slots zero-filled by preparations.
    prepared: AtomicU64,
}

/// Free space kept ready ahead of the allocation frontier by overlay files opened for durable
/// writes ([`Overlay::prepare_ahead`]). A write into a slot past the end of the file grows it,
/// and the FLUSH's `fdatasync` then also commits the file system's allocation (a journal commit
/// on ext4: measured at 1.7× the latency of an overwrite's); slots zero-filled and synced
/// beforehand, off the FLUSH's path, make the FLUSH's writes overwrites.
pub const PREPARE_AHEAD_BYTES: u64 = 16 << 20;

/// Zeros written (and synced) per step of a preparation: small enough that a FLUSH arriving
/// meanwhile waits for little write-back of them.
const PREPARE_CHUNK_BYTES: u64 = 1 << 20;

/// How long preparations stop after one failed to write.
const PREPARE_PAUSE: Duration = Duration::from_secs(10);

/// Slots released by flush group *G* become reusable once the FLUSH closing group
/// *G* + `REUSE_AFTER_GROUPS` has synced. Then every group up to *G* + 2 is durable, so a power
/// loss leaves only groups after *G* in doubt (the last two read), and no record of group *G* or
/// earlier is checked against its data again: a record only partly superseded (a run of blocks
/// of which some were overwritten) still covers its other blocks.
const REUSE_AFTER_GROUPS: u64 = 2;

/// Log records since the last checkpoint before the group commit compacts the log (a record is
/// 64 bytes: 4 MiB of log, replayed at every open until compacted).
pub const COMPACT_MIN_RECORDS: u64 = 65_536;

/// Called once a FLUSH given to [`Overlay::flush_async`] is durable (or failed).
pub type FlushDone = Box<dyn FnOnce(Result<(), Arc<OverlayError>>) + Send>;

/// The group commit's queue: FLUSHes that arrived while a commit was running wait here and are
/// all answered by the next one.
#[derive(Default)]
struct Commits {
    waiting: Vec<FlushDone>,
    /// A commit is running (on the base's worker threads).
    running: bool,
}

impl std::fmt::Debug for Overlay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Overlay")
            .field("params", &self.params)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

struct State {
    map: ExtentMap,
    /// Slots that no durable state references.
    free: FreeSpace,
}

/// Where the next log record goes.
#[derive(Debug, Clone)]
struct LogTail {
    salt: u64,
    segment: u64,
    index: u64,
    seq: u64,
    /// The open flush group: the group of records appended now (the next FLUSH closes it).
    group: u64,
    /// Records appended to the open group.
    unsynced: u64,
    /// Header generation (the copy to overwrite next is the other one).
    generation: u64,
    /// Slots released by the open group's records.
    released: Vec<(u64, u64)>,
    /// Slots released by closed groups, oldest first, with their group: free once the FLUSH
    /// closing group + 2 has synced ([`REUSE_AFTER_GROUPS`]).
    held: std::collections::VecDeque<(u64, Vec<(u64, u64)>)>,
    /// The log's segments, head first (freed once a checkpoint replaces the log).
    segments: Vec<u64>,
    /// Whether the header naming this log is copy B (a checkpoint writes the other copy).
    header_in_b: bool,
}

/// How an overlay file is accessed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileAccess {
    /// Positional reads and writes, `fdatasync` ([`FileIo`]): what serving uses.
    Direct,
    /// Through the power-loss double [`LoseUnsyncedIo`] (seeded): a `kill -9` of the process
    /// loses what a power loss could. For whole-process reliability tests only.
    LoseUnsynced { seed: u64 },
}

impl FileAccess {
    fn io(self, file: File) -> Box<dyn OverlayIo> {
        match self {
            Self::Direct => Box::new(FileIo::new(file)),
            Self::LoseUnsynced { seed } => Box::new(LoseUnsyncedIo::new(FileIo::new(file), seed)),
        }
    }
}

/// Largest count of one record.
const MAX_RUN: u64 = u32::MAX as u64;

impl Overlay {
    /// Create a new overlay file at `path` (written under a temporary name, synced, renamed,
    /// the directory synced) and open it for durable writes.
    pub fn create_file(
        path: &Path,
        params: OverlayParams,
        base: Arc<dyn BlockDevice>,
    ) -> Result<Self, OverlayError> {
        Self::create_file_through(path, params, base, FileAccess::Direct)
    }

    fn create_file_through(
        path: &Path,
        params: OverlayParams,
        base: Arc<dyn BlockDevice>,
        access: FileAccess,
    ) -> Result<Self, OverlayError> {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
        let made = (|| -> Result<Self, OverlayError> {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&tmp)
                .map_err(OverlayError::io("creating", 0))?;
            lock(&file, true)?;
            let overlay = Self::create(access.io(file), params, base, Mode::Durable)?
                .prepare_ahead(PREPARE_AHEAD_BYTES);
            fs::rename(&tmp, path).map_err(OverlayError::io("renaming into place", 0))?;
            if let Some(dir) =
                path.parent().map(|p| if p.as_os_str().is_empty() { Path::new(".") } else { p })
            {
                File::open(dir)
                    .and_then(|d| d.sync_all())
                    .map_err(OverlayError::io("syncing the directory", 0))?;
            }
            Ok(overlay)
        })();
        if made.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        made.map_err(|e| e.at(path))
    }

    /// Open the overlay at `path`, creating it if it does not exist.
    pub fn open_or_create_file(
        path: &Path,
        params: OverlayParams,
        base: Arc<dyn BlockDevice>,
    ) -> Result<Self, OverlayError> {
        Self::open_or_create_file_through(path, params, base, FileAccess::Direct)
    }

    /// [`Self::open_or_create_file`], the file accessed as `access` says.
    pub fn open_or_create_file_through(
        path: &Path,
        params: OverlayParams,
        base: Arc<dyn BlockDevice>,
        access: FileAccess,
    ) -> Result<Self, OverlayError> {
        if path.exists() {
            Self::open_file_through(path, params, base, Mode::Durable, access)
        } else {
            Self::create_file_through(path, params, base, access)
        }
    }

    /// Open an existing overlay file (`mode` [`Mode::Durable`] or [`Mode::ReadOnly`]).
    pub fn open_file(
        path: &Path,
        params: OverlayParams,
        base: Arc<dyn BlockDevice>,
        mode: Mode,
    ) -> Result<Self, OverlayError> {
        Self::open_file_through(path, params, base, mode, FileAccess::Direct)
    }

    fn open_file_through(
        path: &Path,
        params: OverlayParams,
        base: Arc<dyn BlockDevice>,
        mode: Mode,
        access: FileAccess,
    ) -> Result<Self, OverlayError> {
        let writable = mode != Mode::ReadOnly;
        let file = OpenOptions::new()
            .read(true)
            .write(writable)
            .open(path)
            .map_err(|e| OverlayError::io("opening", 0)(e).at(path))?;
        lock(&file, writable).map_err(|e| e.at(path))?;
        Self::open(access.io(file), params, base, mode)
            .map(|o| o.prepare_ahead(PREPARE_AHEAD_BYTES))
            .map_err(|e| e.at(path))
    }

    /// A temporary overlay: an unlinked file in `dir`, gone with the process, never synced.
    pub fn temporary(
        dir: &Path,
        params: OverlayParams,
        base: Arc<dyn BlockDevice>,
    ) -> Result<Self, OverlayError> {
        let file = tempfile::tempfile_in(dir).map_err(|e| OverlayError::io("creating", 0)(e).at(dir))?;
        Self::create(Box::new(FileIo::new(file)), params, base, Mode::Volatile)
    }

    /// Write a fresh overlay through `io` (header copy A, an empty first log segment).
    pub fn create(
        io: Box<dyn OverlayIo>,
        params: OverlayParams,
        base: Arc<dyn BlockDevice>,
        mode: Mode,
    ) -> Result<Self, OverlayError> {
        let bs = check_params(&params)?;
        if mode == Mode::ReadOnly {
            return Err(OverlayError::ReadOnly);
        }
        let salt = new_salt(0);
        let header = Header {
            version: VERSION,
            block_size: params.block_size,
            image_id: params.image_id,
            device_bytes: params.device_bytes,
            generation: 1,
            salt,
            log_head: 1,
            first_seq: 0,
        };
        let mut slot0 = vec![0u8; usize::try_from(2 * bs).unwrap_or(0)];
        slot0[..HEADER_LEN].copy_from_slice(&header.encode());
        io.write_at(&slot0, 0).map_err(OverlayError::io("writing the header", 0))?;
        if mode == Mode::Durable {
            io.sync_data().map_err(OverlayError::io("syncing the header", 0))?;
        }
        let tail = LogTail {
            salt,
            segment: 1,
            index: 0,
            seq: 0,
            group: 1,
            unsynced: 0,
            generation: 1,
            released: Vec::new(),
            held: Default::default(),
            segments: vec![1],
            header_in_b: false,
        };
        Ok(Self::assemble(io, base, params, mode, ExtentMap::default(), FreeSpace::new(2), tail))
    }

    /// Open an existing overlay through `io`: pick the newest valid header copy, check it
    /// belongs to `params`, replay the log and (unless read-only) write a checkpoint.
    pub fn open(
        io: Box<dyn OverlayIo>,
        params: OverlayParams,
        base: Arc<dyn BlockDevice>,
        mode: Mode,
    ) -> Result<Self, OverlayError> {
        let bs = check_params(&params)?;
        let file_len = io.size().map_err(OverlayError::io("reading the size", 0))?;
        if file_len == 0 {
            return Err(OverlayError::NotAnOverlay("the file is empty"));
        }
        let mut slot0 = vec![0u8; (HEADER_B_OFFSET as usize) + HEADER_LEN];
        io.read_at(&mut slot0, 0).map_err(OverlayError::io("reading the header", 0))?;
        let a = Header::decode(&slot0[..HEADER_LEN]);
        let b = Header::decode(&slot0[HEADER_B_OFFSET as usize..]);
        let (header, in_b) = match (a, b) {
            (Ok(a), Ok(b)) if b.generation > a.generation => (b, true),
            (Ok(a), _) => (a, false),
            (Err(_), Ok(b)) => (b, true),
            (Err(e), Err(_)) => {
                return Err(match e {
                    HeaderProblem::Version(v) => OverlayError::UnsupportedVersion(v),
                    HeaderProblem::Short | HeaderProblem::Magic => {
                        OverlayError::NotAnOverlay("no overlay header")
                    }
                    HeaderProblem::Checksum => {
                        OverlayError::NotAnOverlay("both header copies fail their checksum")
                    }
                })
            }
        };
        if header.image_id != params.image_id {
            return Err(OverlayError::ImageMismatch { expected: params.image_id, found: header.image_id });
        }
        if header.block_size != params.block_size {
            return Err(OverlayError::BlockSizeMismatch {
                expected: params.block_size,
                found: header.block_size,
            });
        }
        if header.device_bytes != params.device_bytes {
            return Err(OverlayError::DeviceSizeMismatch {
                expected: params.device_bytes,
                found: header.device_bytes,
            });
        }
        let file_slots = file_len.div_ceil(bs);
        let replayed = replay(&*io, &header, bs, params.device_bytes / bs, file_slots)?;
        info!(
            records = replayed.records,
            dropped = replayed.dropped,
            extents = replayed.map.len(),
            log_segments = replayed.segments.len(),
            "overlay log replayed"
        );
        // Free space: everything the map and the log do not use.
        let mut used: Vec<(u64, u64)> = vec![(0, 1)];
        used.extend(replayed.segments.iter().map(|&s| (s, 1)));
        used.extend(replayed.map.iter().filter_map(|(_, len, m)| match m {
            Mapping::Slot(s) => Some((s, len)),
            Mapping::Zero => None,
        }));
        used.sort_unstable();
        let mut end = file_slots.max(2);
        let mut prev_end = 0u64;
        let mut gaps = Vec::new();
        for &(s, l) in &used {
            if s < prev_end {
                return Err(OverlayError::Corrupt { what: "a slot is used twice", slot: s });
            }
            if s > prev_end {
                gaps.push((prev_end, s - prev_end));
            }
            prev_end =
                s.checked_add(l).ok_or(OverlayError::Corrupt { what: "a slot range overflows", slot: s })?;
        }
        end = end.max(prev_end);
        if prev_end < end {
            gaps.push((prev_end, end - prev_end));
        }
        let mut free = FreeSpace::new(end);
        for (s, l) in gaps {
            free.free(s, l);
        }
        let tail = LogTail {
            salt: header.salt,
            segment: replayed.tail_segment,
            index: replayed.tail_index,
            seq: replayed.next_seq,
            group: replayed.last_group + 1,
            unsynced: 0,
            generation: header.generation,
            released: Vec::new(),
            held: Default::default(),
            segments: replayed.segments,
            header_in_b: in_b,
        };
        let overlay = Self::assemble(io, base, params, mode, replayed.map, free, tail);
        if mode != Mode::ReadOnly {
            let mut log = lock_mutex(&overlay.log);
            if let Err(e) = overlay.checkpoint(&mut log) {
                if !e.is_out_of_space() {
                    return Err(e);
                }
                // The file system is full: the checkpoint's new log found no room. The replayed
                // map is what the file holds whichever header a partial checkpoint left (both
                // logs describe the same blocks), so reads are served from it; writes are
                // refused until a daemon opens it with space again (the tail of the log may
                // be a partial checkpoint's, so nothing may be appended). FLUSHes succeed: no
                // write was accepted, so nothing is waiting to become durable.
                warn!(
                    error = &e as &dyn std::error::Error,
                    "the overlay's file system is full: serving reads, refusing writes until it has space \
                     and the overlay is opened again"
                );
                overlay.full_at_open.store(true, Ordering::Release);
                drop(log);
                return Ok(overlay);
            }
            if header.version < VERSION {
                // Upgrade: the checkpoint wrote one header copy in this version; a second one
                // writes the other, so that no copy of the old version is left for an older
                // tessera to fall back to (it would read the log by the old version's rules).
                overlay.checkpoint(&mut log)?;
                info!(from = header.version, to = VERSION, "overlay format upgraded");
            }
        }
        Ok(overlay)
    }

    fn assemble(
        io: Box<dyn OverlayIo>,
        base: Arc<dyn BlockDevice>,
        params: OverlayParams,
        mode: Mode,
        map: ExtentMap,
        free: FreeSpace,
        tail: LogTail,
    ) -> Self {
        let bs = u64::from(params.block_size);
        Self {
            io,
            base,
            bs,
            params,
            mode,
            state: RwLock::new(State { map, free }),
            write_lock: Mutex::new(()),
            log: Mutex::new(tail),
            commit_lock: Mutex::new(()),
            full_at_open: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            syncs: AtomicU64::new(0),
            commits: Mutex::new(Commits::default()),
            checkpoints: AtomicU64::new(0),
            compacting: AtomicBool::new(false),
            compact_min_records: COMPACT_MIN_RECORDS,
            prepare_ahead: 0,
            preparing: AtomicBool::new(false),
            prepare_paused: Mutex::new(None),
            prepared: AtomicU64::new(0),
        }
    }

    /// Rewrite the log as a compact copy of the map under a new salt, then switch the header
    /// (the copy not holding the current header): two syncs. At open, and while serving when
    /// the log has grown ([`Self::compact`]); `log` is the held log lock, so writes wait to
    /// append their records meanwhile (reads go on). The map read here holds every write that
    /// appended its record to the old log; a write that updated the map but had not appended its
    /// record yet is in it too, and appends its record to the new log afterwards (replaying a
    /// record twice, in order, is harmless). The checkpoint's sync makes all of their data
    /// durable, so the slots the old log's groups released are free once the new header is
    /// synced: no log an open can read references them (and the checkpoint's own records are
    /// never checked against their data).
    fn checkpoint(&self, log: &mut LogTail) -> Result<(), OverlayError> {
        let mut ops = Vec::new();
        for (start, len, m) in read_state(&self.state).map.iter() {
            split_runs(start, len, |block, count, delta| {
                ops.push(match m {
                    Mapping::Zero => Op::Zero { block, count },
                    Mapping::Slot(s) => Op::Map { block, count, slot: s + delta, data_crc: None },
                })
            });
        }
        let salt = new_salt(log.generation);
        let head = write_state(&self.state).free.alloc(1)[0].0;
        let mut new_log = LogTail {
            salt,
            segment: head,
            index: 0,
            seq: 0,
            group: 0,
            unsynced: 0,
            generation: log.generation + 1,
            released: Vec::new(),
            held: Default::default(),
            segments: vec![head],
            header_in_b: !log.header_in_b,
        };
        let writes = self.encode_log(&mut new_log, &ops);
        self.write_log(&writes)?;
        let header = Header {
            version: VERSION,
            block_size: self.params.block_size,
            image_id: self.params.image_id,
            device_bytes: self.params.device_bytes,
            generation: new_log.generation,
            salt,
            log_head: head,
            first_seq: 0,
        };
        let at = if log.header_in_b { 0 } else { HEADER_B_OFFSET };
        let sync = |what| self.io.sync_data().map_err(OverlayError::io(what, 0));
        if self.mode == Mode::Durable {
            sync("syncing the checkpoint")?;
        }
        self.io.write_at(&header.encode(), at).map_err(OverlayError::io("writing the header", at))?;
        if self.mode == Mode::Durable {
            sync("syncing the header")?;
        }
        let mut st = write_state(&self.state);
        for &s in &log.segments {
            st.free.free(s, 1);
        }
        for &(s, c) in log.released.iter().chain(log.held.iter().flat_map(|(_, r)| r)) {
            st.free.free(s, c);
        }
        drop(st);
        debug!(records = ops.len(), generation = new_log.generation, "overlay checkpoint written");
        // Records appended from now on belong to the first group after the checkpoint's.
        new_log.group = 1;
        *log = new_log;
        self.checkpoints.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Compact the log while serving: a checkpoint ([`Self::checkpoint`]) now. Reads go on
    /// meanwhile; writes wait to log their records, FLUSHes to start. A failure leaves the
    /// durable state unknown (the header may name either log), so the overlay then refuses
    /// writes, as after a failed FLUSH.
    pub fn compact(&self) -> Result<(), OverlayError> {
        if self.mode == Mode::ReadOnly {
            return Ok(());
        }
        self.check_writable()?;
        let _commit = lock_mutex(&self.commit_lock);
        let mut log = lock_mutex(&self.log);
        self.checkpoint(&mut log).inspect_err(|e| {
            warn!(error = e as &dyn std::error::Error, "overlay compaction failed; refusing further writes");
            self.failed.store(true, Ordering::Release);
        })
    }

    /// Whether the log has grown enough to compact: [`COMPACT_MIN_RECORDS`] records since the
    /// last checkpoint, and four times as many as a checkpoint of the map would write.
    fn compaction_due(&self) -> bool {
        let records = lock_mutex(&self.log).seq;
        records >= self.compact_min_records && records >= 4 * read_state(&self.state).map.len() as u64
    }

    /// Records per log segment (the last position of a segment is its link).
    fn records_per_segment(&self) -> u64 {
        self.bs / RECORD_LEN as u64
    }

    /// Encode `ops` at the log tail (allocating and linking segments as needed); returns the
    /// byte runs to write.
    fn encode_log(&self, log: &mut LogTail, ops: &[Op]) -> Vec<(u64, Vec<u8>)> {
        let per = self.records_per_segment();
        let mut writes: Vec<(u64, Vec<u8>)> = Vec::new();
        let mut emit = |log: &mut LogTail, op: Op| {
            let offset = log.segment * self.bs + log.index * RECORD_LEN as u64;
            let bytes = Record { seq: log.seq, group: log.group, op }.encode(log.salt);
            match writes.last_mut() {
                Some((o, b)) if *o + b.len() as u64 == offset => b.extend_from_slice(&bytes),
                _ => writes.push((offset, bytes.to_vec())),
            }
            log.seq += 1;
            log.index += 1;
        };
        for &op in ops {
            if log.index == per - 1 {
                let next = write_state(&self.state).free.alloc(1)[0].0;
                emit(log, Op::Link { slot: next });
                log.segments.push(next);
                log.segment = next;
                log.index = 0;
            }
            emit(log, op);
        }
        writes
    }

    fn write_log(&self, writes: &[(u64, Vec<u8>)]) -> Result<(), OverlayError> {
        for (offset, bytes) in writes {
            self.io.write_at(bytes, *offset).map_err(OverlayError::io("writing the log", *offset))?;
        }
        Ok(())
    }

    /// The parameters the overlay was opened with.
    pub fn params(&self) -> &OverlayParams {
        &self.params
    }

    /// Current figures.
    pub fn stats(&self) -> OverlayStats {
        // The log lock before the state's, never while holding it (a checkpoint takes them in
        // that order).
        let (pending_records, held_slots) = {
            let log = lock_mutex(&self.log);
            let runs = log.released.iter().chain(log.held.iter().flat_map(|(_, r)| r));
            (log.unsynced, runs.map(|&(_, c)| c).sum())
        };
        let st = read_state(&self.state);
        let mut s = OverlayStats {
            extents: st.map.len() as u64,
            file_slots: st.free.end(),
            free_slots: st.free.free_below_end(),
            pending_records,
            held_slots,
            syncs: self.syncs.load(Ordering::Relaxed),
            checkpoints: self.checkpoints.load(Ordering::Relaxed),
            prepared_slots: self.prepared.load(Ordering::Relaxed),
            ..OverlayStats::default()
        };
        for (_, len, m) in st.map.iter() {
            match m {
                Mapping::Zero => s.zero_blocks += len,
                Mapping::Slot(_) => s.written_blocks += len,
            }
        }
        s
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), OverlayError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.params.device_bytes => Ok(()),
            _ => Err(OverlayError::OutOfRange { offset, len, device_bytes: self.params.device_bytes }),
        }
    }

    /// Keep `bytes` of zero-filled, synced free slots ready past the allocation frontier: after a
    /// group commit finds fewer than half of them left, a worker thread prepares more
    /// ([`Self::prepare`]). Durable overlays only; 0 (the default of [`Self::create`] and
    /// [`Self::open`]) turns it off; overlay files ([`Self::create_file`], [`Self::open_file`])
    /// keep [`PREPARE_AHEAD_BYTES`].
    pub fn prepare_ahead(mut self, bytes: u64) -> Self {
        if self.mode == Mode::Durable {
            self.prepare_ahead = bytes;
        }
        self
    }

    /// Whether the group commit should start a preparation ([`Self::prepare`]): fewer than
    /// half the prepared bytes are left, and the file is below its cap.
    fn prepare_due(&self) -> bool {
        if self.prepare_ahead == 0 || self.preparing.load(Ordering::Acquire) {
            return false;
        }
        let low = {
            let st = read_state(&self.state);
            st.free.free_below_end() * self.bs < self.prepare_ahead / 2 && st.free.end() < self.prepare_cap()
        };
        low && lock_mutex(&self.prepare_paused).is_none_or(|until| Instant::now() >= until)
    }

    /// Preparations stop at a file of this many slots: room for every device block, and an
    /// eighth more (plus 64) for blocks released but not yet reusable and log segments; more
    /// than that the device can never use.
    fn prepare_cap(&self) -> u64 {
        let blocks = self.params.device_bytes / self.bs;
        blocks + blocks / 8 + 64
    }

    /// Zero-fill and sync slots past the end of the file, a step at a time, until
    /// [`Self::prepare_ahead`] bytes of free slots are ready; each step's slots become free (the
    /// next allocations take them) once synced. Returns the slots prepared. Slots being
    /// zero-filled are taken from the end first, so no write can be placed in them meanwhile;
    /// the zeros land only in slots no durable state references, so a crash at any point is
    /// harmless. A step that fails to write (a full disk) gives its slots back and pauses
    /// preparations for a while; a failed sync fails the overlay like a failed FLUSH (it may
    /// have reported, and so consumed, a write-back error of the guest's data).
    pub fn prepare(&self) -> Result<u64, OverlayError> {
        let bs = self.bs;
        let want = self.prepare_ahead / bs;
        let step = (PREPARE_CHUNK_BYTES.min(self.prepare_ahead) / bs).max(1);
        let cap = self.prepare_cap();
        let zeros = vec![0u8; usize::try_from(step * bs).unwrap_or(0)];
        let mut made = 0;
        while !self.failed.load(Ordering::Acquire) {
            let (first, n) = {
                let mut st = write_state(&self.state);
                let n = step.min(cap.saturating_sub(st.free.end()));
                if st.free.free_below_end() >= want || n == 0 {
                    break;
                }
                (st.free.take_end(n), n)
            };
            let at = first * bs;
            let written = self.io.write_at(&zeros[..(n * bs) as usize], at);
            let synced = written.is_ok().then(|| self.io.sync_data());
            write_state(&self.state).free.free(first, n);
            if let Err(e) = written {
                *lock_mutex(&self.prepare_paused) = Some(Instant::now() + PREPARE_PAUSE);
                debug!(
                    error = &e as &dyn std::error::Error,
                    "overlay: zero-filling free slots failed; pausing"
                );
                return Err(OverlayError::io("zero-filling free slots", at)(e));
            }
            if let Some(Err(e)) = synced {
                warn!(error = &e as &dyn std::error::Error, "overlay sync failed; refusing further writes");
                self.failed.store(true, Ordering::Release);
                return Err(OverlayError::io("syncing zero-filled slots", at)(e));
            }
            self.prepared.fetch_add(n, Ordering::Relaxed);
            made += n;
        }
        Ok(made)
    }

    /// Let the group commit compact the log once it holds `records` records (and four times as
    /// many as the map needs); default [`COMPACT_MIN_RECORDS`].
    pub fn compact_after(mut self, records: u64) -> Self {
        self.compact_min_records = records;
        self
    }

    /// How the overlay was opened.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    fn check_writable(&self) -> Result<(), OverlayError> {
        if self.mode == Mode::ReadOnly {
            return Err(OverlayError::ReadOnly);
        }
        if self.full_at_open.load(Ordering::Acquire) {
            return Err(OverlayError::FullAtOpen);
        }
        if self.failed.load(Ordering::Acquire) {
            return Err(OverlayError::Failed);
        }
        Ok(())
    }

    /// Fill `buf` with the device bytes at `offset`: overlay slots, zeros, or the base.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), OverlayError> {
        let len = buf.len() as u64;
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let first = offset / self.bs;
        let end = (offset + len).div_ceil(self.bs);
        let mut base_ranges: Vec<(u64, u64)> = Vec::new();
        {
            // Slots are read under the read lock: a slot released meanwhile could otherwise be
            // reused for another block before we read it.
            let st = read_state(&self.state);
            if st.map.is_empty() {
                base_ranges.push((offset, len));
            } else {
                for piece in st.map.lookup(first, end - first) {
                    let lo = (piece.block * self.bs).max(offset);
                    let hi = ((piece.block + piece.len) * self.bs).min(offset + len);
                    let out = &mut buf[(lo - offset) as usize..(hi - offset) as usize];
                    match piece.mapping {
                        None => base_ranges.push((lo, hi - lo)),
                        Some(Mapping::Zero) => out.fill(0),
                        Some(Mapping::Slot(s)) => {
                            let at = s * self.bs + (lo - piece.block * self.bs);
                            self.io.read_at(out, at).map_err(OverlayError::io("reading", at))?;
                        }
                    }
                }
            }
        }
        for (lo, n) in base_ranges {
            let out = &mut buf[(lo - offset) as usize..(lo - offset + n) as usize];
            self.base.read_at(lo, out)?;
        }
        Ok(())
    }

    /// Fetch ahead what the base needs for `[offset, offset + len)` (see
    /// [`BlockDevice::fetch_ahead`]; blocks the overlay holds may be fetched needlessly).
    pub fn fetch_ahead(&self, offset: u64, len: u64, done: FetchDone) {
        self.base.fetch_ahead(offset, len, done)
    }

    /// Hand the device bytes `[offset, offset + len)` to `sink` in order: overlay slots (read
    /// from the file), zeros, or the base's [`BlockDevice::visit`] (straight from its memory
    /// tier). Without `fetch`, [`Visit::Missing`] when the base would have to fetch a chunk.
    /// The map's read lock is held throughout (a slot released meanwhile could otherwise be
    /// reused before it is read), so with `fetch` a writer waits for the base's fetch.
    pub fn visit(
        &self,
        offset: u64,
        len: u64,
        fetch: bool,
        sink: &mut dyn Sink,
    ) -> Result<Visit, OverlayError> {
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(Visit::Done);
        }
        let st = read_state(&self.state);
        if st.map.is_empty() {
            return Ok(self.base.visit(offset, len, fetch, sink)?);
        }
        let first = offset / self.bs;
        let end = (offset + len).div_ceil(self.bs);
        let mut buf = Vec::new();
        for piece in st.map.lookup(first, end - first) {
            let lo = (piece.block * self.bs).max(offset);
            let hi = ((piece.block + piece.len) * self.bs).min(offset + len);
            match piece.mapping {
                None => {
                    if self.base.visit(lo, hi - lo, fetch, sink)? == Visit::Missing {
                        return Ok(Visit::Missing);
                    }
                }
                Some(Mapping::Zero) => sink.zeros(hi - lo)?,
                Some(Mapping::Slot(s)) => {
                    let at = s * self.bs + (lo - piece.block * self.bs);
                    buf.resize(usize::try_from(hi - lo).unwrap_or(usize::MAX), 0);
                    self.io.read_at(&mut buf, at).map_err(OverlayError::io("reading", at))?;
                    sink.put(&buf)?;
                }
            }
        }
        Ok(Visit::Done)
    }

    /// Write `data` at device byte `offset` (any alignment: partial blocks are merged with
    /// their current content). Durable after the next [`Self::flush`].
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), OverlayError> {
        self.check_writable()?;
        self.check_range(offset, data.len() as u64)?;
        if data.is_empty() {
            return Ok(());
        }
        let _w = lock_mutex(&self.write_lock);
        self.write_locked(offset, data)
    }

    fn write_locked(&self, offset: u64, data: &[u8]) -> Result<(), OverlayError> {
        let bs = self.bs;
        let len = data.len() as u64;
        let first = offset / bs;
        let end = (offset + len).div_ceil(bs);
        let n = end - first;
        let merged;
        let blocks: &[u8] = if offset % bs == 0 && len % bs == 0 {
            data
        } else {
            let mut buf = vec![0u8; usize::try_from(n * bs).unwrap_or(0)];
            let bsu = bs as usize;
            if offset % bs != 0 {
                self.read_at(first * bs, &mut buf[..bsu])?;
            }
            if (offset + len) % bs != 0 && (n > 1 || offset % bs == 0) {
                let at = buf.len() - bsu;
                self.read_at((end - 1) * bs, &mut buf[at..])?;
            }
            let skip = (offset - first * bs) as usize;
            buf[skip..skip + data.len()].copy_from_slice(data);
            merged = buf;
            &merged
        };
        let runs = write_state(&self.state).free.alloc(n);
        let mut done = 0u64;
        let mut placed = Vec::with_capacity(runs.len());
        for &(slot, count) in &runs {
            let bytes = &blocks[(done * bs) as usize..((done + count) * bs) as usize];
            if let Err(e) = self.io.write_at(bytes, slot * bs) {
                let mut st = write_state(&self.state);
                for &(s, c) in &runs {
                    st.free.free(s, c);
                }
                return Err(OverlayError::io("writing data", slot * bs)(e));
            }
            split_runs(first + done, count, |block, c, delta| {
                let from = ((done + delta) * bs) as usize;
                let crc = crc32c::crc32c(&blocks[from..from + (u64::from(c) * bs) as usize]);
                placed.push(Op::Map { block, count: c, slot: slot + delta, data_crc: Some(crc) });
            });
            done += count;
        }
        let mut freed = Vec::new();
        {
            let mut st = write_state(&self.state);
            for op in &placed {
                if let Op::Map { block, count, slot, .. } = *op {
                    freed.extend(st.map.set(block, u64::from(count), Mapping::Slot(slot)));
                }
            }
        }
        self.append(&placed, freed)
    }

    /// Log the map records of a write (or discard) that is about to complete, with the slots
    /// it released: under the log lock, in order, into the open flush group, without a sync.
    /// A record that fails to be written leaves a hole that would end every later replay
    /// there, so the overlay then refuses writes.
    fn append(&self, ops: &[Op], freed: Vec<(u64, u64)>) -> Result<(), OverlayError> {
        let mut log = lock_mutex(&self.log);
        let writes = self.encode_log(&mut log, ops);
        log.unsynced += ops.len() as u64;
        log.released.extend(freed);
        self.write_log(&writes).inspect_err(|e| {
            warn!(error = e as &dyn std::error::Error, "overlay log write failed; refusing further writes");
            self.failed.store(true, Ordering::Release);
        })
    }

    /// Make `len` bytes at `offset` read as zeros (WRITE_ZEROES and DISCARD). Whole blocks
    /// become zero extents (their slots are released); partial blocks are merged.
    pub fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), OverlayError> {
        self.check_writable()?;
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let bs = self.bs;
        let _w = lock_mutex(&self.write_lock);
        let end = offset + len;
        let whole_first = offset.div_ceil(bs);
        let whole_end = end / bs;
        if whole_first >= whole_end {
            // Within one block, or two partial blocks.
            let zeros = vec![0u8; usize::try_from(len).unwrap_or(0)];
            return self.write_locked(offset, &zeros);
        }
        let head = whole_first * bs - offset;
        if head > 0 {
            self.write_locked(offset, &vec![0u8; head as usize])?;
        }
        let tail = end - whole_end * bs;
        if tail > 0 {
            self.write_locked(whole_end * bs, &vec![0u8; tail as usize])?;
        }
        let freed = write_state(&self.state).map.set(whole_first, whole_end - whole_first, Mapping::Zero);
        let mut ops = Vec::new();
        split_runs(whole_first, whole_end - whole_first, |block, count, _| {
            ops.push(Op::Zero { block, count });
        });
        self.append(&ops, freed)
    }

    /// Make every write completed before this call durable: close the open flush group (its
    /// records are in the log already) and sync once. Nothing to do (no sync) when nothing was
    /// written since the last flush, or when the overlay is read-only. Writes go on during the
    /// sync, into the next group. After a failure the overlay refuses writes (the page cache
    /// state is unknown).
    pub fn flush(&self) -> Result<(), OverlayError> {
        if self.mode == Mode::ReadOnly || self.full_at_open.load(Ordering::Acquire) {
            return Ok(()); // nothing was written
        }
        self.check_writable()?;
        let _commit = lock_mutex(&self.commit_lock);
        let closed = {
            let mut log = lock_mutex(&self.log);
            if log.unsynced == 0 && log.released.is_empty() {
                return Ok(());
            }
            let (closed, released) = (log.group, std::mem::take(&mut log.released));
            if !released.is_empty() {
                log.held.push_back((closed, released));
            }
            log.group += 1;
            log.unsynced = 0;
            closed
        };
        if self.mode == Mode::Durable {
            if let Err(e) = self.io.sync_data() {
                let e = OverlayError::io("syncing", 0)(e);
                warn!(error = &e as &dyn std::error::Error, "overlay flush failed; refusing further writes");
                self.failed.store(true, Ordering::Release);
                return Err(e);
            }
            self.syncs.fetch_add(1, Ordering::Relaxed);
        }
        // Groups up to `closed` are synced, so a power loss leaves at most `closed` and later
        // groups in doubt: slots released by groups before `closed - 1` no longer matter to any
        // record an open would check.
        let reusable: Vec<_> = {
            let mut log = lock_mutex(&self.log);
            let mut out = Vec::new();
            while log.held.front().is_some_and(|&(g, _)| g + REUSE_AFTER_GROUPS <= closed) {
                out.extend(log.held.pop_front().map(|(_, r)| r).unwrap_or_default());
            }
            out
        };
        let mut st = write_state(&self.state);
        for (s, c) in reusable {
            st.free.free(s, c);
        }
        Ok(())
    }

    /// [`Self::flush`] off the caller's thread, with group commit: `done` is called once every
    /// write completed before this call is durable. FLUSHes arriving while a commit runs (from
    /// any queue) wait and are all answered by the next commit, one log append and one
    /// `sync_data` for the lot; at most one commit runs at a time, on one of the base's worker
    /// threads ([`BlockDevice::spawn`]), so the callers (queue workers) never wait for a sync.
    pub fn flush_async(self: &Arc<Self>, done: FlushDone) {
        self.join_commit(done, false);
    }

    /// [`Self::flush_async`] for a caller with nothing else to do meanwhile (a queue worker
    /// whose ring is empty): if no commit is running, run it here, on the caller's thread,
    /// saving the two thread hand-offs of a lone FLUSH; FLUSHes arriving meanwhile (other
    /// queues) still join it. If one is running, join it and return at once.
    pub fn flush_here(self: &Arc<Self>, done: FlushDone) {
        self.join_commit(done, true);
    }

    fn join_commit(self: &Arc<Self>, done: FlushDone, here: bool) {
        if self.mode == Mode::ReadOnly {
            return done(Ok(()));
        }
        let start = {
            let mut c = lock_mutex(&self.commits);
            c.waiting.push(done);
            !std::mem::replace(&mut c.running, true)
        };
        if start && here {
            self.commit();
        } else if start {
            let me = Arc::clone(self);
            self.base.spawn(Box::new(move || me.commit()));
        }
    }

    /// Run commits until no FLUSH waits: each takes every FLUSH waiting at its start, then
    /// closes the open group, whose records (logged by then) include every write completed
    /// before those FLUSHes.
    fn commit(self: &Arc<Self>) {
        loop {
            let batch = {
                let mut c = lock_mutex(&self.commits);
                if c.waiting.is_empty() {
                    c.running = false;
                    return;
                }
                std::mem::take(&mut c.waiting)
            };
            let result = self.flush().map_err(Arc::new);
            debug!(flushes = batch.len(), ok = result.is_ok(), "group commit");
            for done in batch {
                done(result.clone());
            }
            // After answering, on a worker thread (never a queue worker's, which may be running
            // this commit): the FLUSHes arriving meanwhile wait for the compaction, reads and
            // writes do not.
            if result.is_ok() && self.compaction_due() && !self.compacting.swap(true, Ordering::AcqRel) {
                let me = Arc::clone(self);
                self.base.spawn(Box::new(move || {
                    let _ = me.compact();
                    me.compacting.store(false, Ordering::Release);
                }));
            }
            if result.is_ok() && self.prepare_due() && !self.preparing.swap(true, Ordering::AcqRel) {
                let me = Arc::clone(self);
                self.base.spawn(Box::new(move || {
                    let _ = me.prepare();
                    me.preparing.store(false, Ordering::Release);
                }));
            }
        }
    }

    /// Write every mapped extent into `file` (an export of the base image): written blocks
    /// copied, zero extents punched (or written as zeros). Returns the bytes copied.
    pub fn apply_to(&self, file: &File) -> Result<u64, OverlayError> {
        use std::os::unix::fs::FileExt;
        let extents: Vec<_> = read_state(&self.state).map.iter().collect();
        let step = (1u64 << 20).max(self.bs);
        let mut buf = vec![0u8; step as usize];
        let mut copied = 0;
        for (start, len, m) in extents {
            let (mut at, end) = (start * self.bs, (start + len) * self.bs);
            match m {
                Mapping::Slot(s) => {
                    let mut src = s * self.bs;
                    while at < end {
                        let n = step.min(end - at);
                        let b = &mut buf[..n as usize];
                        self.io.read_at(b, src).map_err(OverlayError::io("reading", src))?;
                        file.write_all_at(b, at).map_err(OverlayError::io("writing the export", at))?;
                        (at, src, copied) = (at + n, src + n, copied + n);
                    }
                }
                Mapping::Zero => {
                    use rustix::fs::{fallocate, FallocateFlags};
                    if fallocate(file, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, at, end - at)
                        .is_err()
                    {
                        buf.fill(0);
                        while at < end {
                            let n = step.min(end - at);
                            file.write_all_at(&buf[..n as usize], at)
                                .map_err(OverlayError::io("writing the export", at))?;
                            at += n;
                        }
                    }
                }
            }
        }
        Ok(copied)
    }
}

/// The result of replaying a log.
struct Replayed {
    map: ExtentMap,
    segments: Vec<u64>,
    tail_segment: u64,
    tail_index: u64,
    next_seq: u64,
    last_group: u64,
    records: u64,
    dropped: u64,
}

/// Read the log from the header's head up to the last valid record and rebuild the map. Map
/// records of the last two flush groups are applied only if their data matches their checksum
/// (a record of group *L* is written while the sync of *L − 1* may still be running, so neither
/// sync may have completed); a record that is valid but impossible is corruption.
fn replay(
    io: &dyn OverlayIo,
    header: &Header,
    bs: u64,
    blocks: u64,
    file_slots: u64,
) -> Result<Replayed, OverlayError> {
    let per = bs / RECORD_LEN as u64;
    let mut segments = vec![header.log_head];
    if header.log_head == 0 {
        return Err(OverlayError::Corrupt { what: "the log starts in the header slot", slot: 0 });
    }
    let (mut segment, mut index, mut seq, mut group) = (header.log_head, 0u64, header.first_seq, 0u64);
    let mut records: Vec<Record> = Vec::new();
    let mut seg_buf = vec![0u8; bs as usize];
    let mut loaded = None;
    while index < per {
        // A segment past the end of the file was never written: it reads as zeros, so the log
        // ends there. Stopping before the read also keeps `segment * bs` in range (fuzzing F4).
        if segment >= file_slots {
            break;
        }
        if loaded != Some(segment) {
            io.read_at(&mut seg_buf, segment * bs)
                .map_err(OverlayError::io("reading the log", segment * bs))?;
            loaded = Some(segment);
        }
        let at = (index as usize) * RECORD_LEN;
        let mut raw = [0u8; RECORD_LEN];
        raw.copy_from_slice(&seg_buf[at..at + RECORD_LEN]);
        let r = match Record::decode(&raw, header.salt) {
            Ok(r) => r,
            Err(RecordProblem::Checksum) => break,
            Err(RecordProblem::Malformed) => {
                return Err(OverlayError::Corrupt {
                    what: "a log record with a valid checksum is malformed",
                    slot: segment,
                })
            }
        };
        if r.seq != seq || r.group < group {
            break;
        }
        // Groups count FLUSHes from 1: one near u64::MAX cannot have been written, and would
        // overflow the in-doubt test and the next group (fuzzing F10).
        if r.group >= MAX_GROUP {
            return Err(OverlayError::Corrupt {
                what: "a log record's group is out of range",
                slot: segment,
            });
        }
        seq += 1;
        group = r.group;
        if let Op::Link { slot } = r.op {
            if slot == 0 || segments.contains(&slot) {
                return Err(OverlayError::Corrupt { what: "a log link points to the header or loops", slot });
            }
            // A link may name a segment past the end of the file (allocated, its first record
            // never written: the log ends there), but never one beyond every slot the device
            // could use: its byte offset would overflow, and open's free-space scan (fuzzing F8).
            if slot > max_slots(bs, blocks) {
                return Err(OverlayError::Corrupt { what: "a log link points past any usable slot", slot });
            }
            segments.push(slot);
            segment = slot;
            index = 0;
            continue;
        }
        records.push(r);
        index += 1;
    }
    let last_group = group;
    let mut map = ExtentMap::default();
    let mut dropped = 0;
    let mut data = Vec::new();
    for r in &records {
        // Group 0 is a checkpoint's, synced before the header naming it.
        let in_doubt = r.group > 0 && r.group + 1 >= last_group;
        match r.op {
            Op::Map { block, count, slot, data_crc } => {
                let count = u64::from(count);
                // A record of an in-doubt group whose data lies past the end of the file was torn:
                // its flush never completed (after an fdatasync the data is inside the file). It
                // is dropped, not checked against the zeros a read past the end returns (F3).
                let sane = block.checked_add(count).is_some_and(|e| e <= blocks)
                    && slot > 0
                    && slot.checked_add(count).is_some_and(|e| e <= file_slots);
                if !sane {
                    if in_doubt {
                        dropped += 1;
                        continue;
                    }
                    return Err(OverlayError::Corrupt {
                        what: "a map record points outside the device or file",
                        slot,
                    });
                }
                if let (true, Some(crc)) = (in_doubt, data_crc) {
                    // Checksum in pieces of at most CHECK_PIECE bytes: the record's size comes
                    // from the file, so it must not size an allocation (F5).
                    let piece_blocks = (CHECK_PIECE / bs).max(1);
                    data.resize((piece_blocks * bs) as usize, 0);
                    let mut sum = 0u32;
                    let mut done = 0;
                    while done < count {
                        let n = (count - done).min(piece_blocks);
                        let buf = &mut data[..(n * bs) as usize];
                        let at = (slot + done) * bs;
                        io.read_at(buf, at).map_err(OverlayError::io("reading", at))?;
                        sum = crc32c::crc32c_append(sum, buf);
                        done += n;
                    }
                    if sum != crc {
                        dropped += 1;
                        continue;
                    }
                }
                map.set(block, count, Mapping::Slot(slot));
            }
            Op::Zero { block, count } => {
                let count = u64::from(count);
                if block.checked_add(count).is_none_or(|e| e > blocks) {
                    return Err(OverlayError::Corrupt {
                        what: "a zero record is outside the device",
                        slot: 0,
                    });
                }
                map.set(block, count, Mapping::Zero);
            }
            Op::Link { .. } => {}
        }
    }
    Ok(Replayed {
        map,
        tail_segment: segment,
        tail_index: index,
        segments,
        next_seq: seq,
        last_group,
        records: records.len() as u64,
        dropped,
    })
}

fn check_params(p: &OverlayParams) -> Result<u64, OverlayError> {
    let bs = p.block_size;
    // Slot 0 holds two header copies, the second at byte 2048: smaller blocks would put it in
    // block 1's slot (found by fuzzing, F2).
    if !bs.is_power_of_two() || !(4096..=65536).contains(&bs) {
        return Err(OverlayError::BadBlockSize(bs));
    }
    let bs = u64::from(bs);
    if p.device_bytes % bs != 0 {
        return Err(OverlayError::DeviceSizeMismatch {
            expected: p.device_bytes.checked_next_multiple_of(bs).unwrap_or(u64::MAX),
            found: p.device_bytes,
        });
    }
    Ok(bs)
}

/// Groups at or above this are refused as corrupt (see [`replay`]).
const MAX_GROUP: u64 = u64::MAX / 2;

/// A bound on the slots an overlay of `blocks` device blocks can ever use: every device block,
/// twice (blocks released but not yet reusable), and room for log segments — well above
/// [`Overlay::prepare_cap`], and far below any offset that overflows.
fn max_slots(bs: u64, blocks: u64) -> u64 {
    blocks.saturating_mul(2).saturating_add(1 << 20).min(u64::MAX / bs)
}

/// Largest buffer used to check the data of an in-doubt map record.
const CHECK_PIECE: u64 = 1 << 20;

/// Call `f(block, count, delta)` for pieces of at most `u32::MAX` blocks of `start..start + len`.
fn split_runs(start: u64, len: u64, mut f: impl FnMut(u64, u32, u64)) {
    let mut delta = 0;
    while delta < len {
        let n = (len - delta).min(MAX_RUN);
        f(start + delta, n as u32, delta);
        delta += n;
    }
}

/// A salt differing between log generations and processes (not a secret key; the guest never
/// sees the overlay file).
fn new_salt(generation: u64) -> u64 {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    RandomState::new().hash_one((generation, nanos, std::process::id()))
}

/// Take the overlay's advisory lock: exclusive to write, shared to read.
fn lock(file: &File, exclusive: bool) -> Result<(), OverlayError> {
    use rustix::fs::{flock, FlockOperation};
    let op = if exclusive {
        FlockOperation::NonBlockingLockExclusive
    } else {
        FlockOperation::NonBlockingLockShared
    };
    match flock(file, op) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::WOULDBLOCK) => Err(OverlayError::InUse),
        Err(e) => Err(OverlayError::io("locking", 0)(e.into())),
    }
}

fn lock_mutex<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn read_state(s: &RwLock<State>) -> RwLockReadGuard<'_, State> {
    s.read().unwrap_or_else(|p| p.into_inner())
}

fn write_state(s: &RwLock<State>) -> RwLockWriteGuard<'_, State> {
    s.write().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests;
