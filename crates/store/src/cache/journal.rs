//! The persisted cache index: an append-only journal file `DIR/v1/index` shared by every process
//! using the cache (format in `docs/formats/cache.md`; the pure part is `index.rs`).
//!
//! - Publishing, removing and evicting entries happen under an exclusive `flock` on
//!   `DIR/v1/index.lock`, with the journal line written *before* a rename into place and *after*
//!   an unlink: a crash in between can only make the index claim more bytes than the disk holds,
//!   never fewer, so the bound holds across crashes.
//! - Uses (hits) are buffered and appended in batches under the lock, taken without waiting (a
//!   busy lock defers the batch); losing some to a crash only blurs the LRU order.
//! - Each process keeps its own view and catches up by reading the lines appended since its last
//!   read. When the journal grows past a few times its compacted size, the process holding the
//!   lock rewrites it as a snapshot (temp + rename); the others notice the new inode and replay it.
//! - A missing or malformed journal (a torn write after a power loss, a foreign file) is rebuilt by
//!   scanning the directory, under the lock; recency then follows the files' mtimes.

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};

use tracing::{debug, warn};

use super::index::{disk_bytes, EntryKey, LruIndex, Record, HEADER};
use super::lock::{hold_temp, EntryLock};

/// Uses buffered before they are appended.
const USE_BATCH: usize = 64;
/// Uses kept while the cache-wide lock is busy.
pub const MAX_PENDING_USES: usize = 4096;
/// The journal is compacted once it is larger than this …
const COMPACT_MIN: u64 = 1 << 20;
/// … and larger than this many times an estimate of its snapshot.
const COMPACT_FACTOR: u64 = 4;

/// What one trim evicted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Evicted {
    /// Entries removed.
    pub entries: u64,
    /// Their bytes (on disk).
    pub bytes: u64,
}

/// The shared journal as seen by this process.
#[derive(Debug)]
pub struct Journal {
    root: PathBuf,
    state: Mutex<State>,
    /// Uses not appended yet. Apart from `state` so that noting a use, on a guest read's path,
    /// never waits while another thread of this process holds the view (a metrics scrape's or a
    /// publish's catch-up replays the journal: ~20 ms for a 3.6 MB one, longer for big caches).
    /// Taken after `state` when both are held, and never held while waiting for anything.
    uses: Mutex<Vec<EntryKey>>,
}

#[derive(Debug, Default)]
struct State {
    /// The journal file this view was read from, with its (device, inode).
    file: Option<(File, (u64, u64))>,
    /// Bytes of it replayed (whole lines).
    offset: u64,
    /// Lines of it replayed.
    lines: usize,
    /// Its length when this view last caught up with it, or opened it to append uses without
    /// reading it ([`Journal::append_uses`]).
    seen_len: u64,
    index: LruIndex,
}

fn file_id(m: &fs::Metadata) -> (u64, u64) {
    (m.dev(), m.ino())
}

impl Journal {
    /// The journal of the cache rooted at `root` (`DIR/v1`); nothing is read until needed.
    pub fn new(root: &Path) -> Self {
        Self { root: root.to_owned(), state: Mutex::new(State::default()), uses: Mutex::new(Vec::new()) }
    }

    fn path(&self) -> PathBuf {
        self.root.join("index")
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn uses(&self) -> MutexGuard<'_, Vec<EntryKey>> {
        self.uses.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Take the cache-wide lock (writers of the journal and of entries serialize on it).
    fn global_lock(&self) -> std::io::Result<EntryLock> {
        EntryLock::acquire(&self.root.join("index.lock"))
    }

    /// Bytes and entries the index holds (after catching up with other processes).
    pub fn totals(&self) -> std::io::Result<(u64, usize)> {
        let _g = self.global_lock()?;
        let mut st = self.state();
        self.sync(&mut st)?;
        Ok((st.index.total_bytes(), st.index.len()))
    }

    /// [`Self::totals`] if the cache-wide lock is free; while another process or thread holds it
    /// (a long `tessera cache gc`, a trim), the totals this view last read, without waiting for
    /// it — `None` if it never read them. For metrics scrapes, which must not hang on a lock
    /// another process may hold for minutes.
    pub fn totals_now(&self) -> std::io::Result<Option<(u64, usize)>> {
        let path = self.root.join("index.lock");
        if let Some(_g) = EntryLock::try_acquire_existing(&path)? {
            let mut st = self.state();
            self.sync(&mut st)?;
            return Ok(Some((st.index.total_bytes(), st.index.len())));
        }
        if !path.exists() {
            // Never made: nobody holds it. The first take creates it.
            return self.totals().map(Some);
        }
        let st = self.state();
        Ok((st.lines > 0).then(|| (st.index.total_bytes(), st.index.len())))
    }

    /// Note a read of `key`. Uses are buffered and appended in batches under the cache-wide
    /// lock, taken without waiting: when another process holds it (a long `gc` scan), the batch
    /// waits for the next one (at most [`MAX_PENDING_USES`] are kept; older ones are dropped,
    /// which only blurs the LRU order). A batch also catches up with the journal and compacts it
    /// when due, so a read-only fleet keeps it small too.
    pub fn record_use(&self, key: EntryKey) {
        let batch = {
            let mut uses = self.uses();
            uses.push(key);
            uses.len() >= USE_BATCH
        };
        if batch {
            self.flush_uses();
        }
    }

    /// Append the buffered uses if the cache-wide lock and this view are both free now; else
    /// keep them for the next batch (at most [`MAX_PENDING_USES`]).
    fn flush_uses(&self) {
        let lock = EntryLock::try_acquire_existing(&self.root.join("index.lock"));
        let st = match lock {
            Ok(Some(_)) => match self.state.try_lock() {
                Ok(st) => Some(st),
                Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
                Err(TryLockError::WouldBlock) => None,
            },
            _ => None,
        };
        let Some(mut st) = st else {
            let mut uses = self.uses();
            let excess = uses.len().saturating_sub(MAX_PENDING_USES);
            uses.drain(..excess);
            return;
        };
        if let Err(e) = self.append_uses(&mut st) {
            debug!(error = &e as &dyn std::error::Error, "cannot record uses in the cache index");
        }
        drop(st);
        drop(lock);
    }

    /// Append the buffered uses (caller holds the global lock). A use changes no total, so the
    /// journal is not read for it: the lines go to the end of the current file, opened if this
    /// view has not (or it was replaced). Only a compaction needs the index, so this view catches
    /// up (and compacts when due) once the file has doubled since it last read it — a replay on a
    /// guest read's path is then rare, and a fleet that only reads still keeps the journal small.
    fn append_uses(&self, st: &mut State) -> std::io::Result<()> {
        let on_disk = match fs::metadata(self.path()) {
            Ok(m) if m.len() > 0 => file_id(&m),
            // Missing or empty (a creator died before the header): the full path rebuilds or
            // starts it.
            Ok(_) => return self.sync(st).and_then(|()| self.append(st, &[])),
            Err(e) if e.kind() == ErrorKind::NotFound => {
                return self.sync(st).and_then(|()| self.append(st, &[]))
            }
            Err(e) => return Err(e),
        };
        if !matches!(&st.file, Some((_, have)) if *have == on_disk) {
            let file = OpenOptions::new().read(true).append(true).open(self.path())?;
            let meta = file.metadata()?;
            *st = State { file: Some((file, file_id(&meta))), seen_len: meta.len(), ..State::default() };
        }
        self.append(st, &[])?;
        let len = match &st.file {
            Some((file, _)) => file.metadata()?.len(),
            None => return Ok(()),
        };
        if len > COMPACT_MIN && len / 2 > st.seen_len {
            self.sync(st)?;
            self.maybe_compact(st)?;
        }
        Ok(())
    }

    /// Catch up with the journal (caller holds the global lock): reopen it if it was replaced,
    /// rebuild it by scanning if it is missing or malformed, then read what was appended.
    fn sync(&self, st: &mut State) -> std::io::Result<()> {
        let path = self.path();
        let on_disk = match fs::metadata(&path) {
            Ok(m) => Some(file_id(&m)),
            Err(e) if e.kind() == ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        match (on_disk, &st.file) {
            (None, _) => {
                debug!("no cache index: rebuilding it by scanning the cache");
                return self.rebuild(st, None);
            }
            (Some(id), Some((_, have))) if id == *have => {}
            (Some(_), _) => {
                let file = OpenOptions::new().read(true).append(true).open(&path)?;
                let id = file_id(&file.metadata()?);
                *st = State { file: Some((file, id)), ..State::default() };
            }
        }
        let Some((file, _)) = st.file.as_mut() else { return Ok(()) };
        file.seek(SeekFrom::Start(st.offset))?;
        let mut new = Vec::new();
        file.read_to_end(&mut new)?;
        let text = match std::str::from_utf8(&new) {
            Ok(t) => t,
            Err(_) => {
                warn!("the cache index is not text; rebuilding it by scanning the cache");
                return self.rebuild(st, None);
            }
        };
        let before = st.index.len();
        match st.index.replay(text, st.lines) {
            Ok(partial) => {
                st.offset += (text.len() - partial) as u64;
                st.lines += text[..text.len() - partial].matches('\n').count();
                st.seen_len = st.offset;
                if st.lines == 0 && partial == 0 {
                    // An empty file (a creator died before writing the header): start it.
                    st.file
                        .as_mut()
                        .map(|(f, _)| f.write_all(format!("{HEADER}\n").as_bytes()))
                        .transpose()?;
                    st.offset = (HEADER.len() + 1) as u64;
                    st.lines = 1;
                }
                debug!(
                    entries = st.index.len(),
                    new = st.index.len().saturating_sub(before),
                    "cache index read"
                );
                Ok(())
            }
            Err(e) => {
                warn!(error = ?e, "the cache index is malformed; rebuilding it by scanning the cache");
                self.rebuild(st, None)
            }
        }
    }

    /// Replace the journal with a snapshot of `index` (or of a scan of the directory when
    /// `None`), atomically; the caller holds the global lock.
    fn rebuild(&self, st: &mut State, index: Option<LruIndex>) -> std::io::Result<()> {
        let index = match index {
            Some(ix) => ix,
            None => scan(&self.root)?,
        };
        let (tmp, mut file) = new_temp(&self.root)?;
        let written =
            file.write_all(index.snapshot().as_bytes()).and_then(|()| fs::rename(&tmp, self.path()));
        drop(file);
        written.inspect_err(|_| {
            let _ = fs::remove_file(&tmp);
        })?;
        let mut file = OpenOptions::new().read(true).append(true).open(self.path())?;
        let id = file_id(&file.metadata()?);
        let offset = file.seek(SeekFrom::End(0))?;
        let lines = index.len() + 1;
        *st = State { file: Some((file, id)), offset, lines, seen_len: offset, index };
        Ok(())
    }

    fn append(&self, st: &mut State, records: &[Record]) -> std::io::Result<()> {
        let uses = std::mem::take(&mut *self.uses());
        let mut text: String = uses.into_iter().map(|k| Record::Use(k).to_line()).collect();
        for r in records {
            text.push_str(&r.to_line());
        }
        let Some((file, _)) = st.file.as_mut() else { return Ok(()) };
        file.write_all(text.as_bytes())?;
        // Our own lines are read back (and applied) by the next sync, like everyone else's.
        Ok(())
    }

    /// Publish `key` of `len` bytes: evict down to `bound` minus the new entry (calling `unlink`
    /// for each victim), journal it, then `rename` it into place — so the entries on disk never
    /// exceed the bound, not even for a moment. Returns what was evicted.
    pub fn publish(
        &self,
        key: &EntryKey,
        len: u64,
        rename: impl FnOnce() -> std::io::Result<()>,
        bound: Option<u64>,
        unlink: impl Fn(&EntryKey) -> std::io::Result<()>,
    ) -> std::io::Result<Evicted> {
        let _g = self.global_lock()?;
        let mut st = self.state();
        self.sync(&mut st)?;
        let bytes = disk_bytes(len);
        let evicted = match bound {
            Some(bound) => {
                // A replaced entry frees its old size.
                let room = bound.saturating_add(st.index.get(key).unwrap_or(0)).saturating_sub(bytes);
                self.evict_locked(&mut st, room, &unlink)?
            }
            None => Evicted::default(),
        };
        self.append(&mut st, &[Record::Add(key.clone(), bytes)])?;
        if let Err(e) = rename() {
            self.append(&mut st, &[Record::Remove(key.clone())])?;
            return Err(e);
        }
        self.sync(&mut st)?;
        self.maybe_compact(&mut st)?;
        Ok(evicted)
    }

    /// Remove `key` (a corrupt or vanished entry): `unlink`, then journal it.
    pub fn remove(
        &self,
        key: &EntryKey,
        unlink: impl FnOnce() -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let _g = self.global_lock()?;
        let mut st = self.state();
        self.sync(&mut st)?;
        let r = unlink();
        self.append(&mut st, &[Record::Remove(key.clone())])?;
        r
    }

    /// Evict least recently used entries until the index fits in `bound`.
    pub fn trim(
        &self,
        bound: u64,
        unlink: impl Fn(&EntryKey) -> std::io::Result<()>,
    ) -> std::io::Result<Evicted> {
        let _g = self.global_lock()?;
        let mut st = self.state();
        self.sync(&mut st)?;
        let evicted = self.evict_locked(&mut st, bound, &unlink)?;
        self.maybe_compact(&mut st)?;
        Ok(evicted)
    }

    fn evict_locked(
        &self,
        st: &mut State,
        bound: u64,
        unlink: &dyn Fn(&EntryKey) -> std::io::Result<()>,
    ) -> std::io::Result<Evicted> {
        let victims = st.index.victims(bound);
        if victims.is_empty() {
            return Ok(Evicted::default());
        }
        let mut out = Evicted::default();
        let mut records = Vec::with_capacity(victims.len());
        for (key, bytes) in victims {
            match unlink(&key) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => {
                    warn!(entry = %key.rel_path(), error = &e as &dyn std::error::Error, "cannot evict a cache entry");
                    continue;
                }
            }
            out.entries += 1;
            out.bytes += bytes;
            records.push(Record::Remove(key));
        }
        self.append(st, &records)?;
        self.sync(st)?;
        debug!(entries = out.entries, bytes = out.bytes, "evicted from the cache");
        Ok(out)
    }

    fn maybe_compact(&self, st: &mut State) -> std::io::Result<()> {
        let estimate = (st.index.len() as u64 + 1) * 100;
        if st.offset > COMPACT_MIN && st.offset > COMPACT_FACTOR * estimate {
            let index = st.index.clone();
            debug!(bytes = st.offset, entries = index.len(), "compacting the cache index");
            self.rebuild(st, Some(index))?;
        }
        Ok(())
    }

    /// Rebuild the journal from a scan of the directory, keeping the recency order this process
    /// knows for entries still present (`tessera cache gc`). Returns the new index totals.
    pub fn rescan(&self) -> std::io::Result<(u64, usize)> {
        let _g = self.global_lock()?;
        let mut st = self.state();
        // A malformed journal is rebuilt by sync itself; a readable one gives the recency order.
        let known = match self.sync(&mut st) {
            Ok(()) => st.index.clone(),
            Err(_) => LruIndex::default(),
        };
        let scanned = scan(&self.root)?;
        let mut merged = LruIndex::default();
        // Entries the journal did not know (orphans) count as the least recently used …
        for (key, bytes) in scanned.keys() {
            if known.get(key).is_none() {
                merged.apply(&Record::Add(key.clone(), bytes));
            }
        }
        // … then the known ones in their recency order, with the sizes found on disk.
        let snapshot = known.snapshot();
        for line in snapshot.lines().skip(1) {
            if let Some(Record::Add(key, _)) = Record::parse(line) {
                if let Some(bytes) = scanned.get(&key) {
                    merged.apply(&Record::Add(key, bytes));
                }
            }
        }
        let totals = (merged.total_bytes(), merged.len());
        self.rebuild(&mut st, Some(merged))?;
        Ok(totals)
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        let pending = !self.uses().is_empty();
        if pending {
            self.flush_uses();
        }
    }
}

/// A new, unique temp file in `root/tmp`, flock'ed (shared) until dropped so that cleaners
/// (`remove_leftovers`) leave it alone while it is written.
pub fn new_temp(root: &Path) -> std::io::Result<(PathBuf, File)> {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    loop {
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = root.join("tmp").join(format!("{}-{nanos:x}-{n}.tmp", std::process::id()));
        match OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(f) => {
                if let Err(e) = hold_temp(&f) {
                    let _ = fs::remove_file(&tmp);
                    return Err(e);
                }
                return Ok((tmp, f));
            }
            Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Index every entry file under `root` (`DIR/v1`), recency by mtime (oldest first). Files that
/// are not entries are skipped (`tessera cache gc` reports and removes them).
pub fn scan(root: &Path) -> std::io::Result<LruIndex> {
    let mut found: Vec<(i64, i64, EntryKey, u64)> = Vec::new();
    for (rel, meta) in walk_entries(root)? {
        if let Some(key) = EntryKey::parse(&rel) {
            found.push((meta.mtime(), meta.mtime_nsec(), key, disk_bytes(meta.len())));
        }
    }
    found.sort_unstable_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)).then_with(|| a.2.cmp(&b.2)));
    let mut index = LruIndex::default();
    for (_, _, key, bytes) in found {
        index.apply(&Record::Add(key, bytes));
    }
    Ok(index)
}

/// Every regular file in the entry directories (`blobs/sha256`, `chunks/*`, `origins/*/images`,
/// `origins/*/refs`), as (path relative to `root`, metadata).
pub fn walk_entries(root: &Path) -> std::io::Result<Vec<(String, fs::Metadata)>> {
    let mut out = Vec::new();
    let mut dirs = vec!["blobs/sha256".to_owned()];
    for parent in ["chunks", "origins"] {
        for e in read_dir_or_empty(&root.join(parent))? {
            let name = e.file_name().to_string_lossy().into_owned();
            if e.file_type()?.is_dir() {
                if parent == "chunks" {
                    dirs.push(format!("chunks/{name}"));
                } else {
                    dirs.push(format!("origins/{name}/images"));
                    dirs.push(format!("origins/{name}/refs"));
                }
            }
        }
    }
    for dir in dirs {
        for e in read_dir_or_empty(&root.join(&dir))? {
            let meta = match e.metadata() {
                Ok(m) => m,
                Err(err) if err.kind() == ErrorKind::NotFound => continue,
                Err(err) => return Err(err),
            };
            if meta.is_file() {
                out.push((format!("{dir}/{}", e.file_name().to_string_lossy()), meta));
            }
        }
    }
    Ok(out)
}

fn read_dir_or_empty(dir: &Path) -> std::io::Result<Vec<fs::DirEntry>> {
    match fs::read_dir(dir) {
        Ok(rd) => rd.collect(),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::index::ChunkForm;

    /// A cache root (`DIR/v1` with its `tmp/`) in a fresh temp dir, which must outlive it.
    fn cache_root() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("v1");
        fs::create_dir_all(root.join("tmp")).unwrap();
        (dir, root)
    }

    fn chunk(n: u32) -> EntryKey {
        let mut id = [0u8; 32];
        id[..4].copy_from_slice(&n.to_le_bytes());
        EntryKey::Chunk(id, ChunkForm::Zstd(1000))
    }

    /// Noting a use, on a guest read's path, never waits while another thread of this process
    /// holds the view (a metrics scrape's first catch-up replays the whole journal: ~20 ms for
    /// the lazy bench's warmed cache); the uses are kept and go out with a later batch.
    #[test]
    fn noting_uses_never_waits_for_the_view() {
        let (_dir, root) = cache_root();
        let journal = std::sync::Arc::new(Journal::new(&root));
        journal.publish(&chunk(0), 4096, || Ok(()), None, |_| Ok(())).unwrap();
        let held = journal.state();
        let (done, finished) = std::sync::mpsc::channel();
        let noter = std::sync::Arc::clone(&journal);
        std::thread::spawn(move || {
            for n in 0..2 * USE_BATCH as u32 {
                noter.record_use(chunk(n));
            }
            done.send(()).unwrap();
        });
        let waited = finished.recv_timeout(std::time::Duration::from_secs(30));
        drop(held);
        waited.expect("noting a use waited for the view");
        assert_eq!(journal.uses().len(), 2 * USE_BATCH, "kept for a later batch");
        journal.record_use(chunk(0));
        assert!(journal.uses().is_empty(), "appended with the next batch");
        let text = fs::read_to_string(root.join("index")).unwrap();
        let uses = text.lines().filter(|l| matches!(Record::parse(l), Some(Record::Use(_)))).count();
        assert_eq!(uses, 2 * USE_BATCH + 1);
    }

    /// A metrics scrape never waits for the cache-wide lock: while another process holds it (as
    /// `tessera cache gc` does for its whole scan), it gets the totals its view last read.
    #[test]
    fn totals_now_do_not_wait_for_a_busy_lock() {
        let (_dir, root) = cache_root();
        let writer = Journal::new(&root);
        for n in 0..10 {
            writer.publish(&chunk(n), 4096, || Ok(()), None, |_| Ok(())).unwrap();
        }
        let scraper = std::sync::Arc::new(Journal::new(&root));
        let ten = (10 * disk_bytes(4096), 10);
        assert_eq!(scraper.totals_now().unwrap(), Some(ten));
        writer.publish(&chunk(10), 4096, || Ok(()), None, |_| Ok(())).unwrap();

        let gc = EntryLock::acquire(&root.join("index.lock")).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (s, fresh_root) = (std::sync::Arc::clone(&scraper), root.clone());
        std::thread::spawn(move || {
            let _ = tx.send(s.totals_now().unwrap());
            let _ = tx.send(Journal::new(&fresh_root).totals_now().unwrap());
        });
        let wait = std::time::Duration::from_secs(30);
        let last = rx.recv_timeout(wait);
        let never = rx.recv_timeout(wait);
        drop(gc);
        assert_eq!(last.expect("waited for the lock"), Some(ten), "the totals it last read");
        assert_eq!(never.expect("waited for the lock"), None, "a view that never read them");
        assert_eq!(scraper.totals_now().unwrap(), Some((11 * disk_bytes(4096), 11)));
    }

    /// A process that only reads appends its uses without replaying the journal (a replay of a
    /// big cache's index cost a warmed daemon's first reads ~13 ms); it catches up, and compacts,
    /// once the journal has doubled since it last read it, so a fleet that only reads still
    /// keeps the journal small.
    #[test]
    fn uses_are_appended_unread_until_the_journal_doubles_then_compacted() {
        let (_dir, root) = cache_root();
        let writer = Journal::new(&root);
        for n in 0..1000 {
            writer.publish(&chunk(n), 4096, || Ok(()), None, |_| Ok(())).unwrap();
        }
        let path = root.join("index");
        let written = fs::metadata(&path).unwrap().len();

        let reader = Journal::new(&root);
        for n in 0..USE_BATCH as u32 {
            reader.record_use(chunk(n));
        }
        {
            let st = reader.state();
            assert!(reader.uses().is_empty(), "the batch was appended");
            assert_eq!((st.lines, st.index.len()), (0, 0), "appending uses read nothing");
        }
        let use_line = Record::Use(chunk(0)).to_line().len() as u64;
        assert_eq!(fs::metadata(&path).unwrap().len(), written + USE_BATCH as u64 * use_line);
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.ends_with(&Record::Use(chunk(USE_BATCH as u32 - 1)).to_line()));

        // Uses until the journal is past 1 MiB and twice what the reader saw: it catches up and
        // compacts it to a snapshot of the 1000 entries.
        let mut n = 0u64;
        while reader.state().lines == 0 {
            reader.record_use(chunk((n % 1000) as u32));
            n += 1;
            assert!(n < 100_000, "the reader never caught up");
        }
        let st = reader.state();
        assert_eq!(st.index.len(), 1000);
        let len = fs::metadata(&path).unwrap().len();
        assert!(len < COMPACT_MIN, "compacted to a snapshot: {len} bytes");
        let grown = written + (USE_BATCH as u64 + n) * use_line;
        assert!(grown > COMPACT_MIN && grown > 2 * written, "caught up only once past 1 MiB ({n} uses)");
        assert!(grown < COMPACT_MIN + USE_BATCH as u64 * use_line, "caught up at the first batch past it");
    }
}
