//! The host disk cache (`--cache-dir DIR`) in front of a remote store. Layout and rules:
//! `docs/formats/cache.md`.
//!
//! - [`DiskCache`]: the directory. Content-addressed entries (blobs by sha256, chunks by blake3
//!   ChunkId, in stored form) are checked on **every** read; an entry that fails its check is
//!   deleted and reported as a miss, so it is refetched and never served. Writes go to `tmp/` and
//!   are renamed into place, so concurrent processes only ever see whole entries.
//! - [`CachedStore`]: an [`HttpStore`] behind the cache. Blobs and chunks come from the cache
//!   first; image entries and tag lookups come from the origin first and fall back to the cache
//!   when the origin is unreachable, so a warmed cache serves with the origin down.
//! - [`CachedSource`]: the [`ChunkSource`] of one open image over the cache and the origin.
//!
//! Misses are single-flight per host: concurrent misses of one entry, from threads of one
//! process or from many processes sharing the directory, fetch it from the origin once
//! ([`DiskCache::get_or_fetch`], `lock.rs`).

mod full;
mod gc;
pub mod index;
mod journal;
mod lock;

use std::collections::HashMap;
use std::fs;
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use self::full::{FullState, DEFAULT_FULL_RETRY};
pub use self::gc::GcReport;
use self::index::{disk_bytes, ChunkForm, EntryKey};
pub use self::journal::Evicted;
use self::journal::Journal;
use self::lock::{EntryLock, KeyedLocks};
use tessera_image::{ChunkRef, Compression, ImageEntry, ImageId, PackLocation, Sha256Digest};
use tracing::{debug, trace, warn};

use crate::error::StoreError;
use tessera_registry::RegistryError;

use crate::origin::http::{parse_ref, resolve_with, HttpError, HttpStore};

/// Whether an entry's bytes are valid.
type Check<'a> = dyn Fn(&[u8]) -> bool + 'a;
use crate::read_store::ReadStore;
use crate::reader::{decode_stored_chunk, OpenImage};
use crate::source::{ChunkGot, ChunkSource, RangeGot, RangeSink, SourcedChunk};

/// A chunk's stored bytes, and its data if the check of those bytes decoded it
/// ([`DiskCache::fetch_chunks_decoded`]).
pub type CheckedChunk = (Vec<u8>, Option<Vec<u8>>);

/// The layout version directory under the cache root.
const VERSION_DIR: &str = "v1";

/// How to open a host disk cache: `--cache-dir DIR [--cache-size SIZE]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheConfig {
    /// The cache directory (created if missing; the layout lives in `DIR/v1`).
    pub dir: PathBuf,
    /// Bound on the bytes of cached entries (default `None`: unbounded). Least recently used
    /// entries are evicted to stay within it; see `docs/formats/cache.md`.
    pub max_bytes: Option<u64>,
    /// After a write finds the filesystem full, writes are skipped this long (reads go on).
    pub full_retry: Duration,
}

impl CacheConfig {
    /// An unbounded cache at `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into(), max_bytes: None, full_retry: DEFAULT_FULL_RETRY }
    }

    /// Skip writes for `retry` after one finds the filesystem full (default 10 s).
    pub fn with_full_retry(mut self, retry: Duration) -> Self {
        self.full_retry = retry;
        self
    }

    /// Bound the cache to `max_bytes` (`None`: unbounded).
    pub fn with_max_bytes(mut self, max_bytes: Option<u64>) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// Whether the cache holds any chunk or span (a few directory reads; `false` for a cache
    /// not made yet): a host that has cached nothing yet has none of an image's chunks.
    pub fn holds_chunks(&self) -> bool {
        let root = self.dir.join(VERSION_DIR);
        ["chunks", "spans"].iter().any(|kind| {
            std::fs::read_dir(root.join(kind)).is_ok_and(|fans| {
                fans.flatten().any(|fan| std::fs::read_dir(fan.path()).is_ok_and(|mut d| d.next().is_some()))
            })
        })
    }
}

/// A host disk cache directory. Cheap to clone (clones share their single-flight state and
/// counters).
#[derive(Debug, Clone)]
pub struct DiskCache {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    root: PathBuf,
    max_bytes: Option<u64>,
    /// Threads of this process missing the same entry wait here (one fetch per process) …
    flights: KeyedLocks,
    /// … and processes wait on the entry's lock file in `locks/` (one fetch per host).
    stats: Counters,
    /// The persisted index (sizes and recency of every entry), shared through `DIR/v1/index`.
    journal: Journal,
    /// Whether writes are being skipped because the filesystem is full.
    full: FullState,
}

/// What [`DiskCache::remove_leftovers`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Leftovers {
    /// Temp files of writers that died before publishing.
    pub temp_files: u64,
    /// Their bytes.
    pub temp_bytes: u64,
    /// Lock files nobody held.
    pub lock_files: u64,
}

/// What a [`DiskCache`] did since it was opened (this process only).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Reads answered by a valid cached entry.
    pub hits: u64,
    /// Bytes of those entries.
    pub hit_bytes: u64,
    /// Reads the cache could not answer (the data came from the origin, or from another
    /// process that fetched it while this one waited: see `shared_fetches`).
    pub misses: u64,
    /// Misses answered by another thread or process's fetch after waiting for its lock.
    pub shared_fetches: u64,
    /// Entries this process fetched from the origin on a miss (written to the cache or not:
    /// see `fills`).
    pub fetches: u64,
    /// Their bytes.
    pub fetch_bytes: u64,
    /// Entries fetched from the origin and written to the cache by this process.
    pub fills: u64,
    /// Bytes of those entries.
    pub fill_bytes: u64,
    /// Entries that failed their check and were removed.
    pub corrupt: u64,
    /// Entries evicted by this process to keep the cache within its bound.
    pub evictions: u64,
    /// Their bytes.
    pub evicted_bytes: u64,
    /// Entries not written because the cache's filesystem was full (see `full_episodes`).
    pub full_skips: u64,
    /// Times a write found the cache's filesystem full (each logged once).
    pub full_episodes: u64,
}

#[derive(Debug, Default)]
struct Counters {
    hits: AtomicU64,
    hit_bytes: AtomicU64,
    misses: AtomicU64,
    shared_fetches: AtomicU64,
    fetches: AtomicU64,
    fetch_bytes: AtomicU64,
    fills: AtomicU64,
    fill_bytes: AtomicU64,
    corrupt: AtomicU64,
    evictions: AtomicU64,
    evicted_bytes: AtomicU64,
}

fn bump(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

impl DiskCache {
    /// Open (creating if needed) the cache `config` describes.
    pub fn open(config: &CacheConfig) -> Result<Self, StoreError> {
        let root = config.dir.join(VERSION_DIR);
        for sub in ["blobs/sha256", "chunks", "origins", "tmp", "locks"] {
            let p = root.join(sub);
            fs::create_dir_all(&p).map_err(|source| StoreError::Cache { op: "create", path: p, source })?;
        }
        let cache = Self {
            inner: Arc::new(Inner {
                journal: Journal::new(&root),
                root,
                max_bytes: config.max_bytes,
                flights: KeyedLocks::default(),
                stats: Counters::default(),
                full: FullState::new(config.full_retry),
            }),
        };
        cache.remove_leftovers();
        // A process with a bound reads the index now (rebuilding it by a scan only if it is
        // missing or malformed) to trim the cache to its bound if another process left it
        // larger. One without a bound needs nothing of it to read: it catches up at its first
        // publish (a warmed start reads no journal at all). A cache that cannot be written
        // (read-only media, permissions) still serves what it holds: reads go on, writes are
        // skipped with a warning.
        let Some(bound) = config.max_bytes else { return Ok(cache) };
        match cache.inner.journal.totals() {
            Ok((bytes, entries)) => {
                debug!(bytes, entries, "opened the disk cache");
                if bytes > bound {
                    cache.trim(bound).map_err(|source| StoreError::Cache {
                        op: "trim",
                        path: cache.inner.root.clone(),
                        source,
                    })?;
                }
            }
            Err(e) => warn!(
                path = %cache.inner.root.display(),
                error = &e as &dyn std::error::Error,
                "cannot use the cache index; the cache is read-only for this process"
            ),
        }
        Ok(cache)
    }

    /// Bytes and entries in the cache, per the shared index (after catching up with the other
    /// processes).
    pub fn size(&self) -> std::io::Result<(u64, usize)> {
        self.inner.journal.totals()
    }

    /// [`Self::size`] without waiting: while another process holds the cache-wide lock (a long
    /// `tessera cache gc`), the size this process last read, or `None` if it never read it. For
    /// metrics scrapes.
    pub fn size_now(&self) -> std::io::Result<Option<(u64, usize)>> {
        self.inner.journal.totals_now()
    }

    /// Evict least recently used entries (chunks first, metadata last) until the cache holds at
    /// most `bound` bytes.
    pub fn trim(&self, bound: u64) -> std::io::Result<Evicted> {
        let evicted = self.inner.journal.trim(bound, |k| self.unlink(k))?;
        self.count_evicted(evicted);
        Ok(evicted)
    }

    fn count_evicted(&self, e: Evicted) {
        bump(&self.inner.stats.evictions, e.entries);
        bump(&self.inner.stats.evicted_bytes, e.bytes);
    }

    fn unlink(&self, key: &EntryKey) -> std::io::Result<()> {
        fs::remove_file(self.path_of(key))
    }

    fn path_of(&self, key: &EntryKey) -> PathBuf {
        self.inner.root.join(key.rel_path())
    }

    /// Remove what killed processes left: temp files of writers that died before their rename
    /// (nobody holds their flock) and lock files nobody holds. Cheap when there is nothing: two
    /// directory listings.
    pub fn remove_leftovers(&self) -> Leftovers {
        let mut out = Leftovers::default();
        if let Ok(dir) = fs::read_dir(self.inner.root.join("tmp")) {
            for entry in dir.flatten() {
                let path = entry.path();
                if lock::temp_is_abandoned(&path).unwrap_or(false) {
                    let len = entry.metadata().map_or(0, |m| m.len());
                    if fs::remove_file(&path).is_ok() {
                        debug!(path = %path.display(), "removed a temp file left by a dead writer");
                        out.temp_files += 1;
                        out.temp_bytes += len;
                    }
                }
            }
        }
        if let Ok(dir) = fs::read_dir(self.inner.root.join("locks")) {
            for entry in dir.flatten() {
                if let Ok(Some(mut free)) = EntryLock::try_acquire_existing(&entry.path()) {
                    free.remove_on_drop();
                    out.lock_files += 1;
                }
            }
        }
        out
    }

    /// The bound on cached bytes, if any.
    pub fn max_bytes(&self) -> Option<u64> {
        self.inner.max_bytes
    }

    /// This process's counters.
    pub fn stats(&self) -> CacheStats {
        let c = &self.inner.stats;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CacheStats {
            hits: get(&c.hits),
            hit_bytes: get(&c.hit_bytes),
            misses: get(&c.misses),
            shared_fetches: get(&c.shared_fetches),
            fetches: get(&c.fetches),
            fetch_bytes: get(&c.fetch_bytes),
            fills: get(&c.fills),
            fill_bytes: get(&c.fill_bytes),
            corrupt: get(&c.corrupt),
            evictions: get(&c.evictions),
            evicted_bytes: get(&c.evicted_bytes),
            full_skips: get(&self.inner.full.skipped),
            full_episodes: get(&self.inner.full.episodes),
        }
    }

    /// The versioned root (`DIR/v1`).
    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// Where blob `digest` is cached.
    pub fn blob_path(&self, digest: &Sha256Digest) -> PathBuf {
        self.path_of(&blob_key(digest))
    }

    /// Where the stored form of `chunk` described by `loc` is cached: `.raw` for an uncompressed
    /// chunk, `.zst.<stored_len>` for a zstd frame (one chunk may be compressed differently in
    /// different stores; each form is its own entry).
    pub fn chunk_path(&self, chunk: &ChunkRef, loc: &PackLocation) -> PathBuf {
        self.path_of(&chunk_key(chunk, loc))
    }

    /// The directory of the mutable documents (entries, refs) of origin `base`.
    pub fn origin_dir(&self, base: &str) -> PathBuf {
        self.inner.root.join(origin_rel(base))
    }

    /// A cached blob, checked against its sha256 (a corrupt one is removed: `None`).
    pub fn get_blob(&self, digest: &Sha256Digest) -> Option<Vec<u8>> {
        self.read_checked(&blob_key(digest), &|b| blob_ok(digest, b))
    }

    /// Cache a blob whose digest the caller has checked. Failures are logged, not returned: the
    /// cache is an optimization.
    pub fn put_blob(&self, digest: &Sha256Digest, bytes: &[u8]) {
        self.write_atomic(&blob_key(digest), bytes);
    }

    /// Blob `digest` from the cache, else from `fetch` — called at most once per host for
    /// concurrent misses of the same blob (see [`Self::get_or_fetch`]).
    pub fn fetch_blob(
        &self,
        digest: &Sha256Digest,
        fetch: impl FnOnce() -> Result<Vec<u8>, StoreError>,
    ) -> Result<Vec<u8>, StoreError> {
        self.get_or_fetch(&blob_key(digest), &|b| blob_ok(digest, b), fetch)
    }

    /// A cached chunk in the stored form `loc` describes, fully checked (decoded, length and
    /// blake3 against the ChunkId). A corrupt entry is removed: `None`.
    pub fn get_chunk(&self, chunk: &ChunkRef, pack: &Sha256Digest, loc: &PackLocation) -> Option<Vec<u8>> {
        self.read_checked(&chunk_key(chunk, loc), &|b| decode_stored_chunk(chunk, pack, loc, b).is_ok())
    }

    /// Cache stored chunk bytes, only if they check out (bad bytes from the origin never enter).
    pub fn put_chunk(&self, chunk: &ChunkRef, pack: &Sha256Digest, loc: &PackLocation, stored: &[u8]) {
        if decode_stored_chunk(chunk, pack, loc, stored).is_ok() {
            self.write_atomic(&chunk_key(chunk, loc), stored);
        }
    }

    /// The stored chunk from the cache, else from `fetch` — called at most once per host for
    /// concurrent misses of the same chunk (see [`Self::get_or_fetch`]). Bytes from `fetch`
    /// that do not decode to the ChunkId are returned (the reader reports them) but not cached.
    pub fn fetch_chunk(
        &self,
        chunk: &ChunkRef,
        pack: &Sha256Digest,
        loc: &PackLocation,
        fetch: impl FnOnce() -> Result<Vec<u8>, StoreError>,
    ) -> Result<Vec<u8>, StoreError> {
        self.get_or_fetch(
            &chunk_key(chunk, loc),
            &|b| decode_stored_chunk(chunk, pack, loc, b).is_ok(),
            fetch,
        )
    }

    /// The compressed bytes of a checkpoint span whose blake3 is `digest` (`--reference-layers`
    /// images), from the cache.
    pub fn get_span(&self, digest: &[u8; 32]) -> Option<Vec<u8>> {
        self.read_checked(&EntryKey::Span(*digest), &|b| blake3::hash(b).as_bytes() == digest)
    }

    /// The compressed bytes of the checkpoint span at `offset` of layer blob `layer` whose blake3
    /// is `digest`, from the cache, else from `fetch` (once per host for concurrent misses);
    /// bytes that do not hash to `digest` are not cached and are [`StoreError::CorruptSpan`].
    pub fn fetch_span(
        &self,
        layer: &Sha256Digest,
        offset: u64,
        digest: &[u8; 32],
        fetch: impl FnOnce() -> Result<Vec<u8>, StoreError>,
    ) -> Result<Vec<u8>, StoreError> {
        let check = |b: &[u8]| blake3::hash(b).as_bytes() == digest;
        let bytes = self.get_or_fetch(&EntryKey::Span(*digest), &check, fetch)?;
        if !check(&bytes) {
            return Err(StoreError::CorruptSpan {
                layer: *layer,
                offset,
                reason: "its blake3 does not match the checkpoint index".into(),
            });
        }
        Ok(bytes)
    }

    /// Blob `digest` (a whole pack) as a file of the cache, for an origin that ignores `Range`:
    /// the cached file if there is one, else `fill` streams the whole blob into a temp file,
    /// which is checked against `digest` and published like any entry (counted in the index and
    /// the bound) — once per host for concurrent misses (the single flight of
    /// [`Self::get_or_fetch`]: `fill` runs under the entry's locks). `fill` may write the file
    /// more than once (truncating it first, e.g. on a retry); what it leaves is hashed. A blob larger than the whole bound cannot be cached:
    /// [`BlobFileError::TooLarge`]. Readers take ranges from the file with `pread`; it was
    /// checked on the way in and is not re-hashed on every read.
    pub fn fetch_blob_file<E>(
        &self,
        digest: &Sha256Digest,
        fill: impl FnOnce(&fs::File) -> Result<(), E>,
    ) -> Result<PathBuf, BlobFileError<E>> {
        let key = blob_key(digest);
        let path = self.path_of(&key);
        if path.is_file() {
            bump(&self.inner.stats.hits, 1);
            return Ok(path);
        }
        bump(&self.inner.stats.misses, 1);
        let name = key.lock_name();
        let _in_process = self.inner.flights.lock(&name);
        let _host = self.host_lock(&name);
        if path.is_file() {
            bump(&self.inner.stats.shared_fetches, 1);
            return Ok(path);
        }
        let cache_err = |op: &'static str, p: &Path, source: std::io::Error| {
            BlobFileError::Cache(StoreError::Cache { op, path: p.to_owned(), source })
        };
        let (tmp, file) =
            journal::new_temp(&self.inner.root).map_err(|e| cache_err("create", &self.inner.root, e))?;
        let filled = fill(&file).map_err(BlobFileError::Fill);
        // (The temp file is open for writing only: hash what reached it through a new handle.)
        let hashed = filled.and_then(|()| {
            fs::File::open(&tmp).and_then(|f| hash_file(&f)).map_err(|e| cache_err("read", &tmp, e))
        });
        let checked = hashed.and_then(|(actual, len)| {
            if actual != *digest {
                let reason = format!("its content hashes to {actual}");
                return Err(BlobFileError::Cache(StoreError::Corrupt {
                    what: "pack",
                    digest: *digest,
                    path: tmp.clone(),
                    reason,
                }));
            }
            if let Some(bound) = self.inner.max_bytes.filter(|&b| disk_bytes(len) > b) {
                return Err(BlobFileError::TooLarge { len, bound });
            }
            let rename = || fs::rename(&tmp, &path);
            let evicted = self
                .inner
                .journal
                .publish(&key, len, rename, self.inner.max_bytes, |k| self.unlink(k))
                .map_err(|e| cache_err("publish", &path, e))?;
            self.count_evicted(evicted);
            Ok(())
        });
        if checked.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        drop(file);
        checked.map(|()| {
            debug!(%digest, "cached a whole blob for an origin that ignores Range");
            path
        })
    }

    /// A cached image entry of origin `base` for `id` (it must parse and name `id` as its
    /// record; otherwise it is removed: `None`).
    pub fn get_entry(&self, base: &str, id: &ImageId) -> Option<ImageEntry> {
        let bytes = self.read_checked(&entry_key(base, id), &|b| entry_ok(id, b))?;
        ImageEntry::from_json(&bytes).ok()
    }

    /// Cache an image entry of origin `base`.
    pub fn put_entry(&self, base: &str, id: &ImageId, entry: &ImageEntry) {
        self.write_atomic(&entry_key(base, id), &entry.to_json());
    }

    /// A cached tag lookup of origin `base` (a corrupt one is removed: `None`).
    pub fn get_ref(&self, base: &str, tag: &str) -> Option<ImageId> {
        let bytes = self.read_checked(&ref_key(base, tag), &|b| parse_ref(b).is_some())?;
        parse_ref(&bytes)
    }

    /// A cached tag lookup of origin `base` and how long ago it was made (its file's mtime;
    /// `None` also when that is in the future: a clock that moved back proves nothing).
    pub fn get_ref_aged(&self, base: &str, tag: &str) -> Option<(ImageId, Duration)> {
        let key = ref_key(base, tag);
        let age = fs::metadata(self.path_of(&key)).ok()?.modified().ok()?.elapsed().ok()?;
        Some((self.get_ref(base, tag)?, age))
    }

    /// Cache a tag lookup of origin `base` (the tag must be validated).
    pub fn put_ref(&self, base: &str, tag: &str, id: &ImageId) {
        self.write_atomic(&ref_key(base, tag), format!("{id}\n").as_bytes());
    }

    /// The entry `key` from the cache, else from `fetch`, with single-flight: concurrent
    /// misses of one entry — from threads of this process and from other processes sharing the
    /// directory — call `fetch` once; the others wait and then read what it published.
    ///
    /// Miss protocol: in-process key lock → `flock` on `locks/<name>` → look again (another
    /// process may have published while we waited) → fetch → publish (temp file + rename) if
    /// `check` passes → unlink the lock file → release. A holder that dies mid-fetch releases
    /// its flock with its last descriptor, so the next waiter takes over; nothing stays blocked.
    /// If the lock file cannot be used (permissions, full disk), the fetch goes ahead unlocked.
    fn get_or_fetch(
        &self,
        key: &EntryKey,
        check: &dyn Fn(&[u8]) -> bool,
        fetch: impl FnOnce() -> Result<Vec<u8>, StoreError>,
    ) -> Result<Vec<u8>, StoreError> {
        let mut out = None;
        self.get_or_fetch_each(
            &[(key.clone(), check)],
            |_, each| {
                each(0, fetch()?);
                Ok(())
            },
            &mut |_, bytes| out = Some(bytes),
        )?;
        out.ok_or_else(|| StoreError::Io {
            op: "cache fetch",
            path: self.path_of(key),
            source: std::io::Error::other("the fetch returned nothing"),
        })
    }

    /// The host-wide lock `locks/<name>` (its file removed when it is let go: it has served its
    /// purpose whatever happened meanwhile); `None` if it cannot be used (permissions, a full
    /// disk): the caller goes ahead unlocked.
    fn host_lock(&self, name: &str) -> Option<EntryLock> {
        let lock_path = self.inner.root.join("locks").join(name);
        match EntryLock::acquire(&lock_path) {
            Ok(mut l) => {
                l.remove_on_drop();
                Some(l)
            }
            Err(e) => {
                if !self.inner.full.failed(&self.inner.root, &e) {
                    warn!(path = %lock_path.display(), error = &e as &dyn std::error::Error, "cannot take a cache lock; fetching without it");
                }
                None
            }
        }
    }

    /// [`Self::get_or_fetch`] for several entries fetched together (the chunks of one ranged
    /// request): each entry the cache holds goes to `got` (with its position in `entries`) at
    /// once; those it lacks are locked — in the order of their lock names, so two batches (or a
    /// batch and single fetches) never wait for each other in a cycle — looked up again, and
    /// those still missing fetched in one call: `fetch(missing, each)` gets their positions in
    /// `entries`, ascending, and hands each one's bytes to `each` (with its position in
    /// `missing`) as they arrive, in any order ([`ChunkSource::read_stored_many`]). Each fetched
    /// entry is checked, kept if it passes, unlocked and handed to `got` as it arrives: a reader
    /// waiting for the head of a long request does not wait for the rest. An error ends the call;
    /// the entries not handed over by then failed.
    fn get_or_fetch_each(
        &self,
        entries: &[(EntryKey, &Check<'_>)],
        fetch: impl FnOnce(&[usize], &mut RangeGot<'_>) -> Result<(), StoreError>,
        got: &mut dyn FnMut(usize, Vec<u8>),
    ) -> Result<(), StoreError> {
        let mut missing: Vec<usize> = Vec::new();
        for (i, (key, check)) in entries.iter().enumerate() {
            match self.read_checked(key, *check) {
                Some(bytes) => got(i, bytes),
                None => missing.push(i),
            }
        }
        if missing.is_empty() {
            return Ok(());
        }
        // The locks of the missing entries, each held until its bytes are published.
        let mut guards: Vec<Option<_>> = entries.iter().map(|_| None).collect();
        bump(&self.inner.stats.misses, missing.len() as u64);
        let mut names: Vec<(String, usize)> =
            missing.iter().map(|&i| (entries[i].0.lock_name(), i)).collect();
        names.sort();
        for (name, i) in &names {
            let in_process = self.inner.flights.lock(name);
            let found = self.read_checked_quiet(&entries[*i].0, entries[*i].1);
            let host_lock = if found.is_some() { None } else { self.host_lock(name) };
            // Another thread or process may have published while we waited.
            match found.or_else(|| self.read_checked_quiet(&entries[*i].0, entries[*i].1)) {
                Some(bytes) => {
                    bump(&self.inner.stats.shared_fetches, 1);
                    drop((in_process, host_lock));
                    got(*i, bytes);
                }
                None => guards[*i] = Some((in_process, host_lock)),
            }
        }
        missing.retain(|&i| guards[i].is_some());
        if missing.is_empty() {
            return Ok(());
        }
        let mut handed = vec![false; missing.len()];
        let fetched = fetch(&missing, &mut |k, bytes| {
            let Some(&i) = missing.get(k) else { return };
            if std::mem::replace(&mut handed[k], true) {
                return;
            }
            let (key, check) = &entries[i];
            bump(&self.inner.stats.fetches, 1);
            bump(&self.inner.stats.fetch_bytes, bytes.len() as u64);
            if check(&bytes) {
                if self.write_atomic(key, &bytes) {
                    bump(&self.inner.stats.fills, 1);
                    bump(&self.inner.stats.fill_bytes, bytes.len() as u64);
                }
            } else {
                debug!(entry = %key.rel_path(), "fetched bytes fail their check; not cached");
            }
            guards[i] = None;
            got(i, bytes);
        });
        drop(guards);
        fetched?;
        match handed.iter().position(|&h| !h) {
            None => Ok(()),
            Some(k) => Err(StoreError::Io {
                op: "cache fetch",
                path: self.path_of(&entries[missing[k]].0),
                source: std::io::Error::other("the fetch returned fewer ranges than asked"),
            }),
        }
    }

    /// Stored chunks `members` of pack `pack` from the cache, the missing ones fetched with one
    /// call of `fetch(positions)` (their positions in `members`, ascending; bytes in that order),
    /// with the host-wide single flight of [`Self::fetch_chunk`] for each.
    pub fn fetch_chunks(
        &self,
        pack: &Sha256Digest,
        members: &[(ChunkRef, PackLocation)],
        fetch: impl FnOnce(&[usize]) -> Result<Vec<Vec<u8>>, StoreError>,
    ) -> Result<Vec<Vec<u8>>, StoreError> {
        Ok(self.fetch_chunks_decoded(pack, members, fetch)?.into_iter().map(|(stored, _)| stored).collect())
    }

    /// [`Self::fetch_chunks`], each chunk also with its data when its check decoded it: a cached
    /// entry (checked when read), or fetched bytes that checked out (checked before they are
    /// kept). `None` for fetched bytes that did not decode to the chunk's id.
    pub fn fetch_chunks_decoded(
        &self,
        pack: &Sha256Digest,
        members: &[(ChunkRef, PackLocation)],
        fetch: impl FnOnce(&[usize]) -> Result<Vec<Vec<u8>>, StoreError>,
    ) -> Result<Vec<CheckedChunk>, StoreError> {
        let mut out: Vec<Option<CheckedChunk>> = members.iter().map(|_| None).collect();
        let each_of_all = |missing: &[usize], each: &mut RangeGot<'_>| {
            fetch(missing)?.into_iter().enumerate().for_each(|(k, bytes)| each(k, bytes));
            Ok(())
        };
        self.fetch_chunks_each(pack, members, each_of_all, &mut |i, chunk| out[i] = Some(chunk))?;
        out.into_iter()
            .zip(members)
            .map(|(chunk, (c, loc))| {
                chunk.ok_or_else(|| StoreError::Io {
                    op: "cache fetch",
                    path: self.chunk_path(c, loc),
                    source: std::io::Error::other("the fetch returned fewer ranges than asked"),
                })
            })
            .collect()
    }

    /// [`Self::fetch_chunks_decoded`] handing each chunk to `got` (with its position in
    /// `members`) as soon as it is here: a cached one at once, a fetched one as `fetch` hands
    /// its bytes over ([`Self::get_or_fetch_each`]: `fetch(missing, each)`). An error ends the
    /// call; the chunks not handed over by then failed.
    pub fn fetch_chunks_each(
        &self,
        pack: &Sha256Digest,
        members: &[(ChunkRef, PackLocation)],
        fetch: impl FnOnce(&[usize], &mut RangeGot<'_>) -> Result<(), StoreError>,
        got: &mut dyn FnMut(usize, CheckedChunk),
    ) -> Result<(), StoreError> {
        // A check that passes leaves the data it decoded here (each check of an entry overwrites
        // what an earlier one left; the last one run is the one whose bytes are handed over).
        let decoded: Vec<std::cell::RefCell<Option<Vec<u8>>>> =
            members.iter().map(|_| Default::default()).collect();
        let checks: Vec<Box<Check<'_>>> = members
            .iter()
            .zip(&decoded)
            .map(|((chunk, loc), slot)| {
                Box::new(move |b: &[u8]| {
                    let data = decode_stored_chunk(chunk, pack, loc, b).ok();
                    let ok = data.is_some();
                    *slot.borrow_mut() = data;
                    ok
                }) as Box<Check<'_>>
            })
            .collect();
        let entries: Vec<(EntryKey, &Check<'_>)> = members
            .iter()
            .zip(&checks)
            .map(|((chunk, loc), check)| (chunk_key(chunk, loc), &**check))
            .collect();
        self.get_or_fetch_each(&entries, fetch, &mut |i, stored| {
            let data = decoded.get(i).and_then(|d| d.borrow_mut().take());
            got(i, (stored, data));
        })
    }

    /// A valid entry, counted as a hit (and a use for the LRU order); an invalid one is removed
    /// (`None`).
    fn read_checked(&self, key: &EntryKey, check: &dyn Fn(&[u8]) -> bool) -> Option<Vec<u8>> {
        let bytes = self.read_checked_quiet(key, check)?;
        bump(&self.inner.stats.hits, 1);
        bump(&self.inner.stats.hit_bytes, bytes.len() as u64);
        self.inner.journal.record_use(key.clone());
        trace!(entry = %key.rel_path(), "cache hit");
        Some(bytes)
    }

    fn read_checked_quiet(&self, key: &EntryKey, check: &dyn Fn(&[u8]) -> bool) -> Option<Vec<u8>> {
        let path = self.path_of(key);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == ErrorKind::NotFound => return None,
            Err(e) => {
                warn!(path = %path.display(), error = &e as &dyn std::error::Error, "cannot read a cache entry; treating it as a miss");
                return None;
            }
        };
        if check(&bytes) {
            Some(bytes)
        } else {
            self.drop_corrupt(key);
            None
        }
    }

    fn drop_corrupt(&self, key: &EntryKey) {
        let path = self.path_of(key);
        warn!(path = %path.display(), "dropping a cache entry that fails its check");
        bump(&self.inner.stats.corrupt, 1);
        let removed = self.inner.journal.remove(key, || match fs::remove_file(&path) {
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            other => other,
        });
        if let Err(e) = removed {
            warn!(path = %path.display(), error = &e as &dyn std::error::Error, "cannot remove a corrupt cache entry");
        }
    }

    /// Write `bytes` as entry `key`: a unique temp file in `tmp/`, then journal + rename (and
    /// eviction down to the bound). Not fsynced: every entry is checked when read, so one torn
    /// by a crash is dropped and refetched. Failures are logged: the cache is an optimization.
    /// While the filesystem is full, writes are skipped ([`FullState`]). Whether the entry was
    /// written.
    fn write_atomic(&self, key: &EntryKey, bytes: &[u8]) -> bool {
        let full = &self.inner.full;
        if full.skip() {
            return false;
        }
        match self.try_write_atomic(key, bytes) {
            Ok(written) => {
                full.succeeded(&self.inner.root);
                written
            }
            Err(e) => {
                if !full.failed(&self.inner.root, &e) {
                    warn!(entry = %key.rel_path(), error = &e as &dyn std::error::Error, "cannot write a cache entry");
                }
                false
            }
        }
    }

    /// Whether the entry was written (`false`: larger than the whole bound, not cached).
    fn try_write_atomic(&self, key: &EntryKey, bytes: &[u8]) -> std::io::Result<bool> {
        if let Some(bound) = self.inner.max_bytes {
            if disk_bytes(bytes.len() as u64) > bound {
                debug!(entry = %key.rel_path(), "larger than the whole cache bound; not cached");
                return Ok(false);
            }
        }
        let dest = self.path_of(key);
        if let Some(parent) = dest.parent() {
            fs::create_dir_all(parent)?;
        }
        // The temp file is flock'ed (shared) from its creation to the rename, so a cleaner can
        // tell a live writer's file (lock refused) from one left by a killed process.
        let (tmp, file) = journal::new_temp(&self.inner.root)?;
        let written = (&file).write_all(bytes);
        let result = written.and_then(|()| {
            let rename = || fs::rename(&tmp, &dest);
            let evicted =
                self.inner
                    .journal
                    .publish(key, bytes.len() as u64, rename, self.inner.max_bytes, |k| self.unlink(k))?;
            self.count_evicted(evicted);
            Ok(())
        });
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        drop(file);
        result.map(|()| true)
    }
}

/// Why [`DiskCache::fetch_blob_file`] gave no file.
#[derive(Debug)]
pub enum BlobFileError<E> {
    /// `fill` failed.
    Fill(E),
    /// The cache could not hold it (I/O), or the bytes do not match the digest.
    Cache(StoreError),
    /// The blob is larger than the whole cache bound.
    TooLarge { len: u64, bound: u64 },
}

/// The sha256 and length of a file's content (read from the start).
fn hash_file(file: &fs::File) -> std::io::Result<(Sha256Digest, u64)> {
    use sha2::Digest as _;
    use std::io::{Read, Seek};
    let mut f = file;
    f.seek(std::io::SeekFrom::Start(0))?;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut len = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        len += n as u64;
    }
    Ok((Sha256Digest(hasher.finalize().into()), len))
}

fn blob_key(digest: &Sha256Digest) -> EntryKey {
    EntryKey::Blob(digest.0)
}

fn chunk_key(chunk: &ChunkRef, loc: &PackLocation) -> EntryKey {
    let form = match loc.compression {
        Compression::None => ChunkForm::Raw,
        Compression::Zstd => ChunkForm::Zstd(loc.stored_len),
    };
    EntryKey::Chunk(chunk.id.0, form)
}

fn origin_rel(base: &str) -> String {
    format!("origins/{}", Sha256Digest::of(base.as_bytes()).hex())
}

fn entry_key(base: &str, id: &ImageId) -> EntryKey {
    EntryKey::Doc(format!("{}/images/{}.json", origin_rel(base), id.digest().hex()))
}

fn ref_key(base: &str, tag: &str) -> EntryKey {
    EntryKey::Doc(format!("{}/refs/{tag}", origin_rel(base)))
}

fn entry_ok(id: &ImageId, bytes: &[u8]) -> bool {
    matches!(ImageEntry::from_json(bytes), Ok(e) if e.record == id.digest())
}

fn blob_ok(digest: &Sha256Digest, bytes: &[u8]) -> bool {
    Sha256Digest::of(bytes) == *digest
}

/// What the cache needs of a remote store behind it ([`HttpStore`], [`crate::RegistryStore`]).
pub trait Origin: ReadStore + ChunkSource + Clone + 'static {
    /// A stable name of the origin (its URL), keying its mutable documents in the cache.
    fn cache_key(&self) -> String;
    /// The image tag `tag` names, `None` when the origin says it has no such tag.
    fn read_ref(&self, tag: &str) -> Result<Option<ImageId>, StoreError>;
    /// `@sha256:<digest>`: the image that refers to that source image manifest (registry
    /// stores only; always asked of the origin, since a later push may change the answer).
    fn resolve_subject(&self, reference: &str) -> Result<ImageId, StoreError> {
        Err(StoreError::SubjectNeedsRegistry { reference: reference.to_owned() })
    }
}

impl Origin for HttpStore {
    fn cache_key(&self) -> String {
        self.base().to_owned()
    }

    fn read_ref(&self, tag: &str) -> Result<Option<ImageId>, StoreError> {
        HttpStore::read_ref(self, tag)
    }
}

impl Origin for crate::origin::registry::RegistryStore {
    fn cache_key(&self) -> String {
        self.location()
    }

    fn read_ref(&self, tag: &str) -> Result<Option<ImageId>, StoreError> {
        crate::origin::registry::RegistryStore::read_ref(self, tag)
    }

    fn resolve_subject(&self, reference: &str) -> Result<ImageId, StoreError> {
        ReadStore::resolve(self, reference)
    }
}

/// Whether an origin error means "unreachable or failing" (so cached mutable documents may be
/// used) rather than an authoritative answer.
fn origin_unavailable(e: &StoreError) -> bool {
    match e {
        StoreError::Http { source: HttpError::Transport(_), .. } => true,
        StoreError::Http { source: e @ (HttpError::Status(_) | HttpError::S3(_)), .. } => {
            e.status().is_some_and(|s| s >= 500 || s == 429 || s == 408)
        }
        StoreError::Registry(r) => match r {
            RegistryError::Transport { .. } | RegistryError::Read { .. } => true,
            RegistryError::Status { status, .. } => *status >= 500 || *status == 429 || *status == 408,
            _ => false,
        },
        _ => false,
    }
}

/// What a [`CachedStore`] takes from its cache without asking the origin first (by default
/// nothing: the origin is asked, and the cache answers only when it is unavailable).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheTrust {
    /// Image entries the cache holds. An entry is tied to its image ID — the record, prefix and
    /// pack index it names are digest-addressed — and only its profile and provenance may change
    /// (`tessera profile`); a daemon started from the cached entry prefetches the profile it
    /// names. `tessera warm` asks the origin, so it refreshes it.
    pub entries: bool,
    /// Tag lookups the cache made at most this long ago (the lookup file's mtime: each answer
    /// of the origin rewrites it). Zero: every tag is asked of the origin. Like a cached HTTP
    /// answer's `max-age`: a tag moved within the window is noticed only after it.
    pub tag_max_age: Duration,
}

/// A remote store (an [`HttpStore`] by default) behind a [`DiskCache`]. Cheap to clone.
#[derive(Debug, Clone)]
pub struct CachedStore<O = HttpStore> {
    origin: O,
    cache: DiskCache,
    trust: CacheTrust,
}

impl<O: Origin> CachedStore<O> {
    /// The origin behind the cache.
    pub fn new(origin: O, cache: DiskCache) -> Self {
        Self { origin, cache, trust: CacheTrust::default() }
    }

    /// What to take from the cache without asking the origin ([`CacheTrust`]).
    pub fn with_trust(self, trust: CacheTrust) -> Self {
        Self { trust, ..self }
    }

    /// The origin.
    pub fn origin(&self) -> &O {
        &self.origin
    }

    /// The cache.
    pub fn cache(&self) -> &DiskCache {
        &self.cache
    }

    fn read_ref(&self, tag: &str) -> Result<Option<ImageId>, StoreError> {
        let base = &self.origin.cache_key();
        if !self.trust.tag_max_age.is_zero() {
            if let Some((id, age)) = self.cache.get_ref_aged(base, tag) {
                if age <= self.trust.tag_max_age {
                    debug!(tag, image = %id, age_ms = age.as_millis() as u64, "tag from the disk cache, looked up recently");
                    return Ok(Some(id));
                }
            }
        }
        match self.origin.read_ref(tag) {
            Ok(Some(id)) => {
                self.cache.put_ref(base, tag, &id);
                Ok(Some(id))
            }
            Ok(None) => Ok(None),
            Err(e) if origin_unavailable(&e) => match self.cache.get_ref(base, tag) {
                Some(id) => {
                    warn!(
                        tag,
                        error = &e as &dyn std::error::Error,
                        "origin unavailable; using the cached tag lookup"
                    );
                    Ok(Some(id))
                }
                None => Err(e),
            },
            Err(e) => Err(e),
        }
    }
}

impl<O: Origin> ReadStore for CachedStore<O> {
    fn describe(&self) -> String {
        format!("{} (cache {})", self.origin.describe(), self.cache.root().display())
    }

    fn resolve(&self, reference: &str) -> Result<ImageId, StoreError> {
        if reference.starts_with('@') {
            let id = self.origin.resolve_subject(reference)?;
            self.get_entry(&id)?;
            return Ok(id);
        }
        resolve_with(reference, |tag| self.read_ref(tag), |id| self.get_entry(id).map(|_| ()))
    }

    fn ref_parts(&self, id: &ImageId) -> Option<crate::RefParts> {
        self.origin.ref_parts(id)
    }

    fn resolve_to_open(&self, reference: &str) -> Result<ImageId, StoreError> {
        if reference.starts_with('@') {
            return self.resolve(reference);
        }
        resolve_with(reference, |tag| self.read_ref(tag), |_| Ok(()))
    }

    /// The cached lookup of tag `reference`, when cached entries are used and the cache holds
    /// that image's entry too.
    fn guess_resolve(&self, reference: &str) -> Option<ImageId> {
        // A tag (an ID or an `@` subject is not one: ':' and '@' are not tag characters).
        if !self.trust.entries || !tessera_image::validate_tag(reference) {
            return None;
        }
        let base = &self.origin.cache_key();
        let id = self.cache.get_ref(base, reference)?;
        self.cache.get_entry(base, &id).map(|_| id)
    }

    fn get_entry(&self, id: &ImageId) -> Result<ImageEntry, StoreError> {
        let base = &self.origin.cache_key();
        if self.trust.entries {
            if let Some(entry) = self.cache.get_entry(base, id) {
                debug!(image = %id, "image entry from the disk cache");
                return Ok(entry);
            }
        }
        match self.origin.get_entry(id) {
            Ok(entry) => {
                self.cache.put_entry(base, id, &entry);
                Ok(entry)
            }
            Err(e) if origin_unavailable(&e) => match self.cache.get_entry(base, id) {
                Some(entry) => {
                    warn!(image = %id, error = &e as &dyn std::error::Error, "origin unavailable; using the cached image entry");
                    Ok(entry)
                }
                None => Err(e),
            },
            Err(e) => Err(e),
        }
    }

    fn read_blob(&self, digest: &Sha256Digest) -> Result<Vec<u8>, StoreError> {
        self.cache.fetch_blob(digest, || self.origin.read_blob(digest))
    }

    /// The cache's copy fed whole; else the origin's, streamed into `sink` and kept whole for
    /// the cache on the way.
    fn read_blob_streamed(
        &self,
        digest: &Sha256Digest,
        sink: &mut dyn crate::BlobSink,
    ) -> Result<(), StoreError> {
        let mut tee = Tee { sink, bytes: Vec::new(), fed: false };
        let bytes = self.cache.fetch_blob(digest, || {
            self.origin.read_blob_streamed(digest, &mut tee)?;
            Ok(std::mem::take(&mut tee.bytes))
        })?;
        if !tee.fed {
            tee.sink.restart();
            tee.sink.feed(&bytes);
        }
        Ok(())
    }

    fn list_refs(&self) -> Result<Vec<(String, ImageId)>, StoreError> {
        self.origin.list_refs()
    }

    fn chunk_source(&self, image: &Arc<OpenImage>) -> Arc<dyn ChunkSource> {
        Arc::new(CachedSource::new(self.cache.clone(), self.origin.clone(), image))
    }
}

/// A sink fed through to another while keeping a copy of the bytes ([`CachedStore`]'s streamed
/// blob reads).
struct Tee<'a> {
    sink: &'a mut dyn crate::BlobSink,
    bytes: Vec<u8>,
    /// Whether `sink` was fed (the blob came from the origin).
    fed: bool,
}

impl crate::BlobSink for Tee<'_> {
    fn restart(&mut self) {
        self.bytes.clear();
        self.sink.restart();
        self.fed = true;
    }

    fn feed(&mut self, bytes: &[u8]) {
        self.bytes.extend_from_slice(bytes);
        self.sink.feed(bytes);
    }
}

/// The chunk source of one open image: the disk cache, then the origin (whose verified answers
/// are cached). Ranges that are not a chunk of the image go straight to the origin.
pub struct CachedSource<S> {
    cache: DiskCache,
    origin: S,
    image: Arc<OpenImage>,
    /// The image's chunks by where they are stored, (pack number, offset, chunk index) sorted,
    /// for ranges asked of the origin (`read_stored*`): built at the first such read (17 940
    /// chunks: ~0.4 ms), so a warmed daemon, whose reads name their chunks (`read_chunk`,
    /// `read_chunks`), never builds it. (A map built at start cost a warmed start ~5 ms; built on a thread of its own it
    /// slowed a workload of prefix reads by half on 2 CPUs: `stat` 30 → 50 ms.) Empty for a
    /// `--reference-layers` image.
    chunks: OnceLock<Vec<(u32, u64, u32)>>,
    /// For a `--reference-layers` image: its checkpoint spans, (layer blob, start) → (length,
    /// blake3), the unit it caches; and its stored windows, (windows blob, offset) → the same.
    spans: HashMap<(Sha256Digest, u64), (u32, [u8; 32])>,
}

impl<S> std::fmt::Debug for CachedSource<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedSource")
            .field("cache", &self.cache)
            .field("chunks", &self.chunks.get().map(Vec::len))
            .finish()
    }
}

impl<S: ChunkSource> CachedSource<S> {
    /// A source for `image`'s chunks over `cache` and `origin`.
    pub fn new(cache: DiskCache, origin: S, image: &Arc<OpenImage>) -> Self {
        let chunks = OnceLock::new();
        if let Some(r) = image.reference() {
            let spans = r
                .index
                .layers
                .iter()
                .flat_map(|l| l.checkpoints.iter().map(move |c| (l.digest, c)))
                .filter_map(|(layer, c)| {
                    let len = u32::try_from(c.span_end - c.start()).ok()?;
                    Some(((layer, c.start()), (len, c.span_digest)))
                })
                // A version-2 index's windows are cached the same way: ranges of the windows
                // blob, keyed by their blake3.
                .chain(r.index.windows.iter().flat_map(|w| {
                    r.index.layers.iter().flat_map(|l| &l.checkpoints).filter_map(move |c| match c.window {
                        tessera_image::Window::Stored { offset, len, digest } if len > 0 => {
                            Some(((w.digest, offset), (len, digest)))
                        }
                        _ => None,
                    })
                }))
                .collect();
            let _ = chunks.set(Vec::new());
            return Self { cache, origin, image: Arc::clone(image), chunks, spans };
        }
        Self { cache, origin, image: Arc::clone(image), chunks, spans: HashMap::new() }
    }

    /// The chunk of the image stored at `offset` of `pack`, as `len` stored bytes.
    fn chunk_at(&self, pack: &Sha256Digest, offset: u64, len: u32) -> Option<(ChunkRef, PackLocation)> {
        let number = u32::try_from(self.image.packs().iter().position(|p| p == pack)?).ok()?;
        let map = self.chunks.get_or_init(|| chunk_map(&self.image));
        let found = map.binary_search_by(|e| (e.0, e.1).cmp(&(number, offset))).ok()?;
        let (chunk, stored_in, loc) = self.image.chunk_location(map[found].2)?;
        (stored_in == *pack && loc.offset == offset && loc.stored_len == len).then_some((chunk, loc))
    }
}

/// (pack number, offset, index of the image's chunk stored there), sorted, one per place (the
/// first index, for a chunk the image uses more than once).
fn chunk_map(image: &OpenImage) -> Vec<(u32, u64, u32)> {
    let n = u32::try_from(image.record().block_map.chunks().len()).unwrap_or(u32::MAX);
    let mut map: Vec<(u32, u64, u32)> =
        (0..n).filter_map(|i| image.chunk_location(i).map(|(_, _, loc)| (loc.pack, loc.offset, i))).collect();
    map.sort_unstable();
    map.dedup_by_key(|e| (e.0, e.1));
    map
}

impl<S: ChunkSource> ChunkSource for CachedSource<S> {
    fn read_stored(&self, pack: &Sha256Digest, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
        if let Some((_, digest)) = self.spans.get(&(*pack, offset)).filter(|(l, _)| *l == len) {
            return self
                .cache
                .fetch_span(pack, offset, digest, || self.origin.read_stored(pack, offset, len));
        }
        let Some((chunk, loc)) = self.chunk_at(pack, offset, len) else {
            debug!(%pack, offset, len, "range is not a chunk of the image; not cached");
            return self.origin.read_stored(pack, offset, len);
        };
        self.cache.fetch_chunk(&chunk, pack, &loc, || self.origin.read_stored(pack, offset, len))
    }

    /// A span of a `--reference-layers` image streams from the origin into `sink` while it is
    /// kept for the cache (checked against its blake3 and cached when whole); a cached span is
    /// handed over whole. Any other range: [`Self::read_stored`].
    fn read_stored_streamed(
        &self,
        pack: &Sha256Digest,
        offset: u64,
        len: u32,
        sink: &mut RangeSink<'_>,
    ) -> Result<(), StoreError> {
        let Some((_, digest)) = self.spans.get(&(*pack, offset)).filter(|(l, _)| *l == len) else {
            return sink(&self.read_stored(pack, offset, len)?);
        };
        let mut fed = false;
        let bytes = self.cache.fetch_span(pack, offset, digest, || {
            let mut kept = Vec::with_capacity(len as usize);
            self.origin.read_stored_streamed(pack, offset, len, &mut |bytes| {
                kept.extend_from_slice(bytes);
                sink(bytes)
            })?;
            fed = true;
            Ok(kept)
        })?;
        if fed {
            Ok(())
        } else {
            sink(&bytes)
        }
    }

    /// The chunk from the cache, else from the origin (once per host), decoded by the check that
    /// read or admitted it (its bytes must hash to its id, so no lookup in the image is needed);
    /// fetched bytes that fail it come as they are, for the reader's check and refetch. A
    /// `--reference-layers` image caches spans, not chunks: [`Self::read_stored`].
    fn read_chunk(
        &self,
        chunk: &ChunkRef,
        pack: &Sha256Digest,
        loc: &PackLocation,
    ) -> Result<SourcedChunk, StoreError> {
        if self.image.reference().is_some() {
            return Ok(SourcedChunk::Stored(self.read_stored(pack, loc.offset, loc.stored_len)?));
        }
        let got = self.cache.fetch_chunks_decoded(pack, &[(*chunk, *loc)], |_| {
            Ok(vec![self.origin.read_stored(pack, loc.offset, loc.stored_len)?])
        })?;
        let (stored, data) = got.into_iter().next().ok_or_else(|| StoreError::Io {
            op: "cache fetch",
            path: self.cache.chunk_path(chunk, loc),
            source: std::io::Error::other("the fetch returned nothing"),
        })?;
        Ok(data.map_or(SourcedChunk::Stored(stored), SourcedChunk::Verified))
    }

    /// The chunks the cache holds, decoded by their checks; the others fetched from the origin in
    /// one call and handed over decoded by the check that admitted them to the cache — each chunk
    /// decoded once on its way to the reader (fetched bytes that fail it come as they are, for
    /// the reader's own check and refetch). A `--reference-layers` image caches spans, not
    /// chunks: its ranges as [`ChunkSource::read_stored_many`] reads them.
    fn read_chunks(
        &self,
        pack: &Sha256Digest,
        members: &[(ChunkRef, PackLocation)],
        got: &mut ChunkGot<'_>,
    ) -> Result<(), StoreError> {
        if self.image.reference().is_some() {
            let ranges: Vec<(u64, u32)> =
                members.iter().map(|(_, loc)| (loc.offset, loc.stored_len)).collect();
            return self.read_stored_many(pack, &ranges, &mut |i, bytes| got(i, SourcedChunk::Stored(bytes)));
        }
        let fetch = |missing: &[usize], each: &mut RangeGot<'_>| {
            let wanted: Vec<(u64, u32)> =
                missing.iter().map(|&i| (members[i].1.offset, members[i].1.stored_len)).collect();
            self.origin.read_stored_many(pack, &wanted, each)
        };
        self.cache.fetch_chunks_each(pack, members, fetch, &mut |i, (stored, data)| {
            got(i, data.map_or(SourcedChunk::Stored(stored), SourcedChunk::Verified));
        })
    }

    /// The origin's: the ranges the cache lacks go to it in one call.
    fn ranges_per_request(&self) -> usize {
        self.origin.ranges_per_request()
    }

    /// A chunk of the image whose cache file exists (one `stat`; its bytes are checked when
    /// read).
    fn holds(&self, chunk: &ChunkRef, _pack: &Sha256Digest, loc: &PackLocation) -> bool {
        self.image.reference().is_none() && self.cache.chunk_path(chunk, loc).exists()
    }

    /// The ranges of chunks the cache holds from it; the others from the origin in one call
    /// ([`ChunkSource::read_stored_many`]: near ranges in one request), each cached as it is
    /// checked, with the host-wide single flight of [`DiskCache::fetch_chunks`].
    fn read_stored_many(
        &self,
        pack: &Sha256Digest,
        ranges: &[(u64, u32)],
        got: &mut RangeGot<'_>,
    ) -> Result<(), StoreError> {
        let members: Option<Vec<(ChunkRef, PackLocation)>> =
            ranges.iter().map(|&(offset, len)| self.chunk_at(pack, offset, len)).collect();
        let Some(members) = members else {
            debug!(%pack, ranges = ranges.len(), "ranges are not all chunks of the image; read one by one");
            for (i, &(offset, len)) in ranges.iter().enumerate() {
                got(i, self.read_stored(pack, offset, len)?);
            }
            return Ok(());
        };
        let fetch = |missing: &[usize], each: &mut RangeGot<'_>| {
            let wanted: Vec<(u64, u32)> = missing.iter().map(|&i| ranges[i]).collect();
            self.origin.read_stored_many(pack, &wanted, each)
        };
        self.cache.fetch_chunks_each(pack, &members, fetch, &mut |i, (stored, _)| got(i, stored))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(data: &[u8]) -> (ChunkRef, PackLocation, Vec<u8>) {
        let z = zstd::bulk::compress(data, 3).unwrap();
        let c = ChunkRef { id: tessera_image::ChunkId::of(data), len: data.len() as u32 };
        let loc = PackLocation {
            pack: 0,
            offset: 0,
            stored_len: z.len() as u32,
            raw_len: data.len() as u32,
            compression: Compression::Zstd,
        };
        (c, loc, z)
    }

    #[test]
    fn blobs_are_verified_and_corrupt_ones_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::open(&CacheConfig::new(dir.path())).unwrap();
        let d = Sha256Digest::of(b"blob");
        assert!(cache.get_blob(&d).is_none());
        cache.put_blob(&d, b"blob");
        assert_eq!(cache.get_blob(&d).unwrap(), b"blob");
        fs::write(cache.blob_path(&d), b"blub").unwrap();
        assert!(cache.get_blob(&d).is_none());
        assert!(!cache.blob_path(&d).exists(), "a corrupt entry is removed");
        assert_eq!(fs::read_dir(cache.root().join("tmp")).unwrap().count(), 0, "no temp files left");
    }

    #[test]
    fn a_batch_fetches_only_what_the_cache_lacks_in_one_call() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::open(&CacheConfig::new(dir.path())).unwrap();
        let pack = Sha256Digest::of(b"pack");
        let members: Vec<(ChunkRef, PackLocation, Vec<u8>)> = (1..=3u8).map(|b| chunk(&[b; 5000])).collect();
        let refs: Vec<(ChunkRef, PackLocation)> = members.iter().map(|(c, l, _)| (*c, *l)).collect();
        cache.put_chunk(&members[1].0, &pack, &members[1].1, &members[1].2);
        let mut calls = Vec::new();
        let got = cache
            .fetch_chunks(&pack, &refs, |missing| {
                calls.push(missing.to_vec());
                Ok(missing.iter().map(|&i| members[i].2.clone()).collect())
            })
            .unwrap();
        assert_eq!(calls, vec![vec![0, 2]], "one call for the two the cache lacks");
        assert_eq!(got, members.iter().map(|m| m.2.clone()).collect::<Vec<_>>());
        // All three are cached now; a fetch that returns too little is an error, not a hole.
        let again = cache.fetch_chunks(&pack, &refs, |_| panic!("nothing to fetch")).unwrap();
        assert_eq!(again, got);
        let other: Vec<(ChunkRef, PackLocation)> =
            (4..=5u8).map(|b| chunk(&[b; 5000])).map(|(c, l, _)| (c, l)).collect();
        assert!(cache.fetch_chunks(&pack, &other, |_| Ok(Vec::new())).is_err());
    }

    #[test]
    fn a_batch_hands_over_what_its_checks_decoded_and_nothing_that_failed() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::open(&CacheConfig::new(dir.path())).unwrap();
        let pack = Sha256Digest::of(b"pack");
        let datas: Vec<Vec<u8>> =
            (1..=3u32).map(|n| (0..6000u32).map(|i| (i * n % 241) as u8).collect()).collect();
        let members: Vec<(ChunkRef, PackLocation, Vec<u8>)> = datas.iter().map(|d| chunk(d)).collect();
        let refs: Vec<(ChunkRef, PackLocation)> = members.iter().map(|(c, l, _)| (*c, *l)).collect();
        cache.put_chunk(&members[0].0, &pack, &members[0].1, &members[0].2);
        let mut bad = members[2].2.clone();
        let n = bad.len();
        bad[n / 2] ^= 0x40;
        let got = cache
            .fetch_chunks_decoded(&pack, &refs, |missing| {
                assert_eq!(missing, [1, 2]);
                Ok(vec![members[1].2.clone(), bad.clone()])
            })
            .unwrap();
        assert_eq!(got[0], (members[0].2.clone(), Some(datas[0].clone())), "a hit, decoded by its check");
        assert_eq!(got[1], (members[1].2.clone(), Some(datas[1].clone())), "fetched, decoded by its check");
        assert_eq!(got[2], (bad, None), "bytes that fail come as they are, with no data");
        assert!(!cache.chunk_path(&members[2].0, &members[2].1).exists());
    }

    /// Each chunk of a batch is checked, kept and handed over as its bytes arrive, while the
    /// rest of the batch is still being fetched; a hit goes over at once; a fetch that ends
    /// early fails the chunks it did not hand over, and keeps those it did.
    #[test]
    fn a_batch_hands_over_each_chunk_as_it_arrives() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::open(&CacheConfig::new(dir.path())).unwrap();
        let pack = Sha256Digest::of(b"pack");
        let datas: Vec<Vec<u8>> =
            (1..=4u32).map(|n| (0..6000u32).map(|i| (i * n % 239) as u8).collect()).collect();
        let members: Vec<(ChunkRef, PackLocation, Vec<u8>)> = datas.iter().map(|d| chunk(d)).collect();
        let refs: Vec<(ChunkRef, PackLocation)> = members.iter().map(|(c, l, _)| (*c, *l)).collect();
        cache.put_chunk(&members[0].0, &pack, &members[0].1, &members[0].2);
        let handed = std::cell::RefCell::new(Vec::new());
        let result = cache.fetch_chunks_each(
            &pack,
            &refs,
            |missing, each| {
                assert_eq!(missing, [1, 2, 3]);
                assert_eq!(*handed.borrow(), [0], "the hit goes over before the fetch");
                each(1, members[2].2.clone());
                assert_eq!(*handed.borrow(), [0, 2], "handed over as it arrived");
                assert!(cache.chunk_path(&members[2].0, &members[2].1).exists(), "kept as it arrived");
                each(0, members[1].2.clone());
                assert_eq!(*handed.borrow(), [0, 2, 1]);
                Err(StoreError::Io {
                    op: "test",
                    path: "pack".into(),
                    source: std::io::Error::other("cut off"),
                })
            },
            &mut |i, (stored, data)| {
                assert_eq!((stored, data), (members[i].2.clone(), Some(datas[i].clone())), "chunk {i}");
                handed.borrow_mut().push(i);
            },
        );
        assert!(matches!(result, Err(StoreError::Io { op: "test", .. })), "{result:?}");
        assert_eq!(*handed.borrow(), [0, 2, 1], "chunk 3 was not handed over");
        assert!(cache.chunk_path(&members[1].0, &members[1].1).exists());
        assert!(!cache.chunk_path(&members[3].0, &members[3].1).exists());
    }

    #[test]
    fn chunks_are_verified_on_the_way_in_and_out() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::open(&CacheConfig::new(dir.path())).unwrap();
        let pack = Sha256Digest::of(b"pack");
        let (c, loc, z) = chunk(&[5u8; 9000]);
        let mut bad = z.clone();
        let n = bad.len();
        bad[n / 2] ^= 0x55;
        cache.put_chunk(&c, &pack, &loc, &bad);
        assert!(!cache.chunk_path(&c, &loc).exists(), "bad origin bytes never enter the cache");
        cache.put_chunk(&c, &pack, &loc, &z);
        assert_eq!(cache.get_chunk(&c, &pack, &loc).unwrap(), z);
        fs::write(cache.chunk_path(&c, &loc), &bad).unwrap();
        assert!(cache.get_chunk(&c, &pack, &loc).is_none());
        assert!(!cache.chunk_path(&c, &loc).exists());
        // Another stored form of the same chunk is a different entry.
        let raw = PackLocation { stored_len: 9000, compression: Compression::None, ..loc };
        assert_ne!(cache.chunk_path(&c, &raw), cache.chunk_path(&c, &loc));
    }

    #[test]
    fn a_decoded_read_returns_what_its_check_decoded_and_refetches_a_corrupt_entry() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::open(&CacheConfig::new(dir.path())).unwrap();
        let pack = Sha256Digest::of(b"pack");
        let data: Vec<u8> = (0..20_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let (c, loc, z) = chunk(&data);
        let read = |fetch: &dyn Fn() -> Vec<u8>| {
            cache.fetch_chunks_decoded(&pack, &[(c, loc)], |_| Ok(vec![fetch()])).unwrap().remove(0)
        };
        cache.put_chunk(&c, &pack, &loc, &z);
        let no_fetch = || -> Vec<u8> { panic!("a hit must not fetch") };
        assert_eq!(read(&no_fetch), (z.clone(), Some(data.clone())), "the uncompressed bytes");
        let hits = cache.stats().hits;
        let mut bad = z.clone();
        let n = bad.len();
        bad[n / 2] ^= 0x10;
        fs::write(cache.chunk_path(&c, &loc), &bad).unwrap();
        assert_eq!(read(&|| z.clone()), (z.clone(), Some(data)), "a corrupt entry is fetched again");
        assert_eq!(cache.stats().hits, hits, "a corrupt entry is no hit");
        assert_eq!(cache.stats().corrupt, 1, "it was dropped");
        assert_eq!(fs::read(cache.chunk_path(&c, &loc)).unwrap(), z, "and replaced by the good copy");
    }

    #[test]
    fn concurrent_misses_fetch_once_across_threads_and_instances() {
        use std::sync::atomic::AtomicUsize;
        let dir = tempfile::tempdir().unwrap();
        // Two instances do not share in-process state: between them only the flock works, as
        // between two processes.
        let caches = [
            DiskCache::open(&CacheConfig::new(dir.path())).unwrap(),
            DiskCache::open(&CacheConfig::new(dir.path())).unwrap(),
        ];
        let d = Sha256Digest::of(b"shared blob");
        let fetches = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let (cache, fetches) = (caches[i % 2].clone(), fetches.clone());
                std::thread::spawn(move || {
                    cache
                        .fetch_blob(&d, || {
                            fetches.fetch_add(1, Ordering::SeqCst);
                            std::thread::sleep(std::time::Duration::from_millis(30));
                            Ok(b"shared blob".to_vec())
                        })
                        .unwrap()
                })
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap(), b"shared blob");
        }
        assert_eq!(fetches.load(Ordering::SeqCst), 1, "one fetch for eight concurrent misses");
        let stats: Vec<CacheStats> = caches.iter().map(DiskCache::stats).collect();
        assert_eq!(stats.iter().map(|s| s.fills).sum::<u64>(), 1);
        assert_eq!(stats.iter().map(|s| s.hits + s.shared_fetches).sum::<u64>(), 7);
        assert_eq!(fs::read_dir(caches[0].root().join("locks")).unwrap().count(), 0, "lock files removed");
        assert_eq!(fs::read_dir(caches[0].root().join("tmp")).unwrap().count(), 0);
    }

    #[test]
    fn a_failed_fetch_is_not_cached_and_the_next_caller_fetches() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::open(&CacheConfig::new(dir.path())).unwrap();
        let d = Sha256Digest::of(b"x");
        let e = cache.fetch_blob(&d, || {
            Err(StoreError::Cache { op: "test", path: "/".into(), source: std::io::ErrorKind::Other.into() })
        });
        assert!(e.is_err());
        // Wrong bytes are returned to the caller (who checks them) but never cached.
        assert_eq!(cache.fetch_blob(&d, || Ok(b"y".to_vec())).unwrap(), b"y");
        assert!(!cache.blob_path(&d).exists());
        assert_eq!(cache.fetch_blob(&d, || Ok(b"x".to_vec())).unwrap(), b"x");
        assert_eq!(cache.fetch_blob(&d, || panic!("a hit must not fetch")).unwrap(), b"x");
    }

    #[test]
    fn a_temp_file_is_removed_only_once_its_writer_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::open(&CacheConfig::new(dir.path())).unwrap();
        let path = cache.root().join("tmp/1-2-3.tmp");
        let f = fs::File::create(&path).unwrap();
        lock::hold_temp(&f).unwrap();
        fs::write(&path, b"partial").unwrap();
        let young = cache.root().join("tmp/1-2-4.tmp");
        fs::write(&young, b"just created, not yet locked").unwrap();
        let old = std::time::SystemTime::now() - 2 * lock::TEMP_GRACE;
        f.set_modified(old).unwrap();
        let held = cache.root().join("locks/blob-x");
        let lock = EntryLock::acquire(&held).unwrap();
        fs::write(cache.root().join("locks/blob-y"), b"").unwrap();
        let none = Leftovers { temp_files: 0, temp_bytes: 0, lock_files: 1 };
        assert_eq!(cache.remove_leftovers(), none, "a live writer's file and a held lock stay");
        assert!(path.exists() && held.exists());
        drop(f);
        drop(lock);
        assert_eq!(cache.remove_leftovers(), Leftovers { temp_files: 1, temp_bytes: 7, lock_files: 1 });
        assert!(!path.exists() && !held.exists());
        assert!(young.exists(), "a young unlocked temp file may be a writer between create and flock");
    }

    /// A raw (incompressible) chunk of `len` bytes, distinct per `seed`.
    fn raw_chunk(seed: u64, len: usize) -> (ChunkRef, PackLocation, Vec<u8>) {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let data: Vec<u8> = (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let c = ChunkRef { id: tessera_image::ChunkId::of(&data), len: len as u32 };
        let loc = PackLocation {
            pack: 0,
            offset: 0,
            stored_len: len as u32,
            raw_len: len as u32,
            compression: Compression::None,
        };
        (c, loc, data)
    }

    /// Bytes of the entry files on disk (whole blocks), measured, not taken from the index —
    /// under the cache-wide lock, so that the walk sees a consistent state.
    fn entry_bytes_on_disk(cache: &DiskCache) -> u64 {
        let _consistent = EntryLock::acquire(&cache.root().join("index.lock")).unwrap();
        journal::walk_entries(cache.root()).unwrap().iter().map(|(_, m)| disk_bytes(m.len())).sum()
    }

    #[test]
    fn a_bounded_cache_stays_within_its_bound_evicting_least_recently_used_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let bound = 5 * 8192;
        let cache = DiskCache::open(&CacheConfig::new(dir.path()).with_max_bytes(Some(bound))).unwrap();
        let pack = Sha256Digest::of(b"pack");
        let blob = Sha256Digest::of(b"a record");
        cache.put_blob(&blob, b"a record");
        let chunks: Vec<_> = (0..12).map(|i| raw_chunk(i, 6000)).collect();
        for (i, (c, loc, data)) in chunks.iter().enumerate() {
            cache.put_chunk(c, &pack, loc, data);
            // Chunk 0 stays hot.
            assert!(cache.get_chunk(&chunks[0].0, &pack, &chunks[0].1).is_some(), "hot chunk evicted at {i}");
            assert!(entry_bytes_on_disk(&cache) <= bound, "over the bound after chunk {i}");
        }
        let (indexed, _) = cache.size().unwrap();
        assert_eq!(indexed, entry_bytes_on_disk(&cache), "the index agrees with the disk");
        assert!(cache.get_blob(&blob).is_some(), "metadata is evicted last");
        assert!(cache.get_chunk(&chunks[11].0, &pack, &chunks[11].1).is_some(), "the newest chunk stays");
        assert!(cache.get_chunk(&chunks[1].0, &pack, &chunks[1].1).is_none(), "an old cold chunk went");
        let s = cache.stats();
        assert!(s.evictions >= 7, "{s:?}");
        // An entry larger than the whole bound is not cached at all.
        let (c, loc, data) = raw_chunk(99, bound as usize + 1);
        cache.put_chunk(&c, &pack, &loc, &data);
        assert!(!cache.chunk_path(&c, &loc).exists());
    }

    #[test]
    fn concurrent_bounded_writers_agree_with_the_disk() {
        let dir = tempfile::tempdir().unwrap();
        let bound = 6 * 8192;
        let config = CacheConfig::new(dir.path()).with_max_bytes(Some(bound));
        // Two instances (as two processes: only the flocks and the journal are shared), four
        // threads each, all publishing distinct chunks and reading some back.
        let caches = [DiskCache::open(&config).unwrap(), DiskCache::open(&config).unwrap()];
        let pack = Sha256Digest::of(b"pack");
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let cache = &caches[(t % 2) as usize];
                s.spawn(move || {
                    for i in 0..10 {
                        let (c, loc, data) = raw_chunk(t * 100 + i, 5000);
                        cache.put_chunk(&c, &pack, &loc, &data);
                        let _ = cache.get_chunk(&c, &pack, &loc);
                        assert!(entry_bytes_on_disk(cache) <= bound);
                    }
                });
            }
        });
        for cache in &caches {
            let (indexed, _) = cache.size().unwrap();
            assert_eq!(indexed, entry_bytes_on_disk(cache), "each view of the index agrees with the disk");
        }
        let evicted: u64 = caches.iter().map(|c| c.stats().evictions).sum();
        assert_eq!(evicted, 80 - 6, "every entry beyond the six that fit was evicted once");
        // A fresh open replays the journal to the same state.
        assert_eq!(DiskCache::open(&config).unwrap().size().unwrap(), (bound, 6));
    }

    #[test]
    fn the_index_persists_and_a_broken_one_is_rebuilt_by_a_scan() {
        let dir = tempfile::tempdir().unwrap();
        let config = CacheConfig::new(dir.path());
        let pack = Sha256Digest::of(b"pack");
        let totals = {
            let cache = DiskCache::open(&config).unwrap();
            for i in 0..6 {
                let (c, loc, data) = raw_chunk(i, 5000);
                cache.put_chunk(&c, &pack, &loc, &data);
            }
            cache.size().unwrap()
        };
        assert_eq!(totals, (6 * 8192, 6));
        let index = dir.path().join("v1/index");
        let text = fs::read_to_string(&index).unwrap();
        assert_eq!(text.lines().filter(|l| l.starts_with("+ ")).count(), 6, "{text}");
        // A file dropped in behind the index's back is not seen without a scan (no rescan on
        // open) …
        let (c, loc, data) = raw_chunk(50, 5000);
        let orphan = DiskCache::open(&config).unwrap().chunk_path(&c, &loc);
        fs::create_dir_all(orphan.parent().unwrap()).unwrap();
        fs::write(&orphan, &data).unwrap();
        assert_eq!(DiskCache::open(&config).unwrap().size().unwrap(), totals);
        // … a torn index is rebuilt by scanning, and then it is.
        let mut torn = fs::read(&index).unwrap();
        torn.extend_from_slice(b"+ 40\0\0\0\n");
        fs::write(&index, torn).unwrap();
        assert_eq!(DiskCache::open(&config).unwrap().size().unwrap(), (7 * 8192, 7));
        fs::remove_file(&index).unwrap();
        assert_eq!(DiskCache::open(&config).unwrap().size().unwrap(), (7 * 8192, 7));
        // A bound smaller than what another process left: trimmed on open.
        let small = DiskCache::open(&config.clone().with_max_bytes(Some(3 * 8192))).unwrap();
        assert_eq!(small.size().unwrap().0, 3 * 8192);
        assert_eq!(entry_bytes_on_disk(&small), 3 * 8192);
    }

    #[test]
    fn the_index_is_compacted_and_other_processes_follow() {
        let dir = tempfile::tempdir().unwrap();
        let config = CacheConfig::new(dir.path());
        let a = DiskCache::open(&config).unwrap();
        let b = DiskCache::open(&config).unwrap();
        let pack = Sha256Digest::of(b"pack");
        let (c, loc, data) = raw_chunk(1, 100);
        a.put_chunk(&c, &pack, &loc, &data);
        // Enough uses to pass the compaction threshold several times over.
        for _ in 0..30_000 {
            assert!(a.get_chunk(&c, &pack, &loc).is_some());
        }
        // Uses alone (no publish) keep the journal compacted.
        let len = fs::metadata(dir.path().join("v1/index")).unwrap().len();
        assert!(len < 1 << 20, "the index was compacted by the uses: {len} bytes");
        let (c2, loc2, data2) = raw_chunk(2, 100);
        a.put_chunk(&c2, &pack, &loc2, &data2);
        // `b` only reads: its uses go to the current journal, whoever compacted it.
        for _ in 0..200 {
            assert!(b.get_chunk(&c, &pack, &loc).is_some());
        }
        let text = fs::read_to_string(dir.path().join("v1/index")).unwrap();
        assert!(text.lines().filter(|l| l.starts_with("= ")).count() >= 128, "b's uses are recorded");
        // `b` read the old file; it notices the replacement and agrees.
        assert_eq!(b.size().unwrap(), (2 * 4096, 2));
    }

    #[test]
    fn gc_removes_corrupt_and_foreign_files_and_trims() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::open(&CacheConfig::new(dir.path())).unwrap();
        let pack = Sha256Digest::of(b"pack");
        let chunks: Vec<_> = (0..6).map(|i| raw_chunk(i, 5000)).collect();
        for (c, loc, data) in &chunks {
            cache.put_chunk(c, &pack, loc, data);
        }
        let d = Sha256Digest::of(b"blob");
        cache.put_blob(&d, b"blob");
        fs::write(cache.chunk_path(&chunks[0].0, &chunks[0].1), b"rotten").unwrap();
        fs::write(cache.root().join("blobs/sha256/not-a-digest"), b"junk").unwrap();
        let dead = fs::File::create(cache.root().join("tmp/123-0-0.tmp")).unwrap();
        (&dead).write_all(&[1u8; 100]).unwrap();
        dead.set_modified(std::time::SystemTime::now() - 2 * lock::TEMP_GRACE).unwrap();
        let r = cache.gc(Some(3 * 8192)).unwrap();
        assert_eq!((r.corrupt_entries, r.unknown_files, r.temp_files), (1, 1, 1), "{r:?}");
        assert_eq!(r.entries_before, 8);
        assert_eq!(r.bytes_after, entry_bytes_on_disk(&cache));
        assert!(r.bytes_after <= 3 * 8192);
        assert!(cache.get_blob(&d).is_some(), "metadata kept while chunks can go");
        assert_eq!(r.evicted_entries, 3, "{r:?}");
        assert_eq!(r.freed_bytes(), r.temp_bytes + r.corrupt_bytes + r.unknown_bytes + r.evicted_bytes);
        // Nothing left to do the second time.
        let again = cache.gc(Some(3 * 8192)).unwrap();
        assert_eq!(again.freed_bytes(), 0, "{again:?}");
    }

    #[test]
    fn entries_and_refs_per_origin() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::open(&CacheConfig::new(dir.path())).unwrap();
        let id = ImageId(Sha256Digest::of(b"record"));
        let entry = ImageEntry {
            record: id.digest(),
            prefix: Sha256Digest::of(b"p"),
            pack_index: Sha256Digest::of(b"i"),
            profile: None,
            provenance: None,
        };
        cache.put_entry("http://a", &id, &entry);
        assert_eq!(cache.get_entry("http://a", &id).unwrap(), entry);
        assert!(cache.get_entry("http://b", &id).is_none());
        let other = ImageId(Sha256Digest::of(b"other"));
        fs::copy(cache.path_of(&entry_key("http://a", &id)), cache.path_of(&entry_key("http://a", &other)))
            .unwrap();
        assert!(cache.get_entry("http://a", &other).is_none(), "an entry for another record is refused");
        cache.put_ref("http://a", "latest", &id);
        assert_eq!(cache.get_ref("http://a", "latest"), Some(id));
        fs::write(cache.origin_dir("http://a").join("refs/latest"), b"garbage").unwrap();
        assert_eq!(cache.get_ref("http://a", "latest"), None);
        assert!(!cache.origin_dir("http://a").join("refs/latest").exists());
    }
}
