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

mod lock;

use std::collections::HashMap;
use std::fs::{self, OpenOptions};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use self::lock::{EntryLock, KeyedLocks};
use tessera_image::{ChunkRef, Compression, ImageEntry, ImageId, PackLocation, Sha256Digest};
use tracing::{debug, trace, warn};

use crate::error::StoreError;
use tessera_registry::RegistryError;

use crate::http::{parse_ref, resolve_with, HttpError, HttpStore};
use crate::read_store::ReadStore;
use crate::reader::{decode_stored_chunk, OpenImage};
use crate::source::ChunkSource;

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
}

impl CacheConfig {
    /// An unbounded cache at `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into(), max_bytes: None }
    }

    /// Bound the cache to `max_bytes` (`None`: unbounded).
    pub fn with_max_bytes(mut self, max_bytes: Option<u64>) -> Self {
        self.max_bytes = max_bytes;
        self
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
    /// Entries fetched from the origin and written to the cache by this process.
    pub fills: u64,
    /// Bytes of those entries.
    pub fill_bytes: u64,
    /// Entries that failed their check and were removed.
    pub corrupt: u64,
}

#[derive(Debug, Default)]
struct Counters {
    hits: AtomicU64,
    hit_bytes: AtomicU64,
    misses: AtomicU64,
    shared_fetches: AtomicU64,
    fills: AtomicU64,
    fill_bytes: AtomicU64,
    corrupt: AtomicU64,
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
        if config.max_bytes.is_some() {
            warn!("--cache-size is not enforced yet (LRU eviction lands next); the cache is unbounded");
        }
        let cache = Self {
            inner: Arc::new(Inner {
                root,
                max_bytes: config.max_bytes,
                flights: KeyedLocks::default(),
                stats: Counters::default(),
            }),
        };
        cache.remove_leftovers();
        Ok(cache)
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
            fills: get(&c.fills),
            fill_bytes: get(&c.fill_bytes),
            corrupt: get(&c.corrupt),
        }
    }

    /// The versioned root (`DIR/v1`).
    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// Where blob `digest` is cached.
    pub fn blob_path(&self, digest: &Sha256Digest) -> PathBuf {
        self.inner.root.join("blobs/sha256").join(digest.hex())
    }

    /// Where the stored form of `chunk` described by `loc` is cached: `.raw` for an uncompressed
    /// chunk, `.zst.<stored_len>` for a zstd frame (one chunk may be compressed differently in
    /// different stores; each form is its own entry).
    pub fn chunk_path(&self, chunk: &ChunkRef, loc: &PackLocation) -> PathBuf {
        let hex = chunk.id.to_hex();
        let name = match loc.compression {
            Compression::None => format!("{hex}.raw"),
            Compression::Zstd => format!("{hex}.zst.{}", loc.stored_len),
        };
        self.inner.root.join("chunks").join(&hex[..2]).join(name)
    }

    /// The directory of the mutable documents (entries, refs) of origin `base`.
    pub fn origin_dir(&self, base: &str) -> PathBuf {
        self.inner.root.join("origins").join(Sha256Digest::of(base.as_bytes()).hex())
    }

    /// A cached blob, checked against its sha256 (a corrupt one is removed: `None`).
    pub fn get_blob(&self, digest: &Sha256Digest) -> Option<Vec<u8>> {
        self.read_checked(&self.blob_path(digest), &|b| blob_ok(digest, b))
    }

    /// Cache a blob whose digest the caller has checked. Failures are logged, not returned: the
    /// cache is an optimization.
    pub fn put_blob(&self, digest: &Sha256Digest, bytes: &[u8]) {
        self.write_atomic(&self.blob_path(digest), bytes);
    }

    /// Blob `digest` from the cache, else from `fetch` — called at most once per host for
    /// concurrent misses of the same blob (see [`Self::get_or_fetch`]).
    pub fn fetch_blob(
        &self,
        digest: &Sha256Digest,
        fetch: impl FnOnce() -> Result<Vec<u8>, StoreError>,
    ) -> Result<Vec<u8>, StoreError> {
        let lock = format!("blob-{}", digest.hex());
        self.get_or_fetch(&self.blob_path(digest), &lock, &|b| blob_ok(digest, b), fetch)
    }

    /// A cached chunk in the stored form `loc` describes, fully checked (decoded, length and
    /// blake3 against the ChunkId). A corrupt entry is removed: `None`.
    pub fn get_chunk(&self, chunk: &ChunkRef, pack: &Sha256Digest, loc: &PackLocation) -> Option<Vec<u8>> {
        self.read_checked(&self.chunk_path(chunk, loc), &|b| decode_stored_chunk(chunk, pack, loc, b).is_ok())
    }

    /// Cache stored chunk bytes, only if they check out (bad bytes from the origin never enter).
    pub fn put_chunk(&self, chunk: &ChunkRef, pack: &Sha256Digest, loc: &PackLocation, stored: &[u8]) {
        if decode_stored_chunk(chunk, pack, loc, stored).is_ok() {
            self.write_atomic(&self.chunk_path(chunk, loc), stored);
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
        let path = self.chunk_path(chunk, loc);
        let lock = format!("chunk-{}", path.file_name().and_then(|n| n.to_str()).unwrap_or_default());
        self.get_or_fetch(&path, &lock, &|b| decode_stored_chunk(chunk, pack, loc, b).is_ok(), fetch)
    }

    /// A cached image entry of origin `base` for `id` (it must parse and name `id` as its
    /// record; otherwise it is removed: `None`).
    pub fn get_entry(&self, base: &str, id: &ImageId) -> Option<ImageEntry> {
        let bytes = self.read_checked(
            &self.entry_path(base, id),
            &|b| matches!(ImageEntry::from_json(b), Ok(e) if e.record == id.digest()),
        )?;
        ImageEntry::from_json(&bytes).ok()
    }

    /// Cache an image entry of origin `base`.
    pub fn put_entry(&self, base: &str, id: &ImageId, entry: &ImageEntry) {
        self.write_atomic(&self.entry_path(base, id), &entry.to_json());
    }

    /// A cached tag lookup of origin `base` (a corrupt one is removed: `None`).
    pub fn get_ref(&self, base: &str, tag: &str) -> Option<ImageId> {
        let bytes = self.read_checked(&self.ref_path(base, tag), &|b| parse_ref(b).is_some())?;
        parse_ref(&bytes)
    }

    /// Cache a tag lookup of origin `base` (the tag must be validated).
    pub fn put_ref(&self, base: &str, tag: &str, id: &ImageId) {
        self.write_atomic(&self.ref_path(base, tag), format!("{id}\n").as_bytes());
    }

    fn entry_path(&self, base: &str, id: &ImageId) -> PathBuf {
        self.origin_dir(base).join("images").join(format!("{}.json", id.digest().hex()))
    }

    fn ref_path(&self, base: &str, tag: &str) -> PathBuf {
        self.origin_dir(base).join("refs").join(tag)
    }

    /// The entry at `path` from the cache, else from `fetch`, with single-flight: concurrent
    /// misses of one entry — from threads of this process and from other processes sharing the
    /// directory — call `fetch` once; the others wait and then read what it published.
    ///
    /// Miss protocol: in-process key lock → `flock` on `locks/<lock>` → look again (another
    /// process may have published while we waited) → fetch → publish (temp file + rename) if
    /// `check` passes → unlink the lock file → release. A holder that dies mid-fetch releases
    /// its flock with its last descriptor, so the next waiter takes over; nothing stays blocked.
    /// If the lock file cannot be used (permissions, full disk), the fetch goes ahead unlocked.
    pub fn get_or_fetch(
        &self,
        path: &Path,
        lock: &str,
        check: &dyn Fn(&[u8]) -> bool,
        fetch: impl FnOnce() -> Result<Vec<u8>, StoreError>,
    ) -> Result<Vec<u8>, StoreError> {
        if let Some(bytes) = self.read_checked(path, check) {
            return Ok(bytes);
        }
        bump(&self.inner.stats.misses, 1);
        let _in_process = self.inner.flights.lock(lock);
        if let Some(bytes) = self.read_checked_quiet(path, check) {
            bump(&self.inner.stats.shared_fetches, 1);
            return Ok(bytes);
        }
        let lock_path = self.inner.root.join("locks").join(lock);
        let mut host_lock = match EntryLock::acquire(&lock_path) {
            Ok(l) => Some(l),
            Err(e) => {
                warn!(path = %lock_path.display(), error = %e, "cannot take a cache lock; fetching without it");
                None
            }
        };
        if let Some(l) = host_lock.as_mut() {
            // Whatever happens next, the lock file has served its purpose once we release it.
            l.remove_on_drop();
        }
        if let Some(bytes) = self.read_checked_quiet(path, check) {
            bump(&self.inner.stats.shared_fetches, 1);
            return Ok(bytes);
        }
        let bytes = fetch()?;
        if check(&bytes) {
            if self.try_write_atomic(path, &bytes).is_ok() {
                bump(&self.inner.stats.fills, 1);
                bump(&self.inner.stats.fill_bytes, bytes.len() as u64);
            }
        } else {
            debug!(path = %path.display(), "fetched bytes fail their check; not cached");
        }
        drop(host_lock);
        Ok(bytes)
    }

    /// A valid entry at `path`, counted as a hit; an invalid one is removed (`None`).
    fn read_checked(&self, path: &Path, check: &dyn Fn(&[u8]) -> bool) -> Option<Vec<u8>> {
        let bytes = self.read_checked_quiet(path, check)?;
        bump(&self.inner.stats.hits, 1);
        bump(&self.inner.stats.hit_bytes, bytes.len() as u64);
        trace!(path = %path.display(), "cache hit");
        Some(bytes)
    }

    fn read_checked_quiet(&self, path: &Path, check: &dyn Fn(&[u8]) -> bool) -> Option<Vec<u8>> {
        let bytes = match fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == ErrorKind::NotFound => return None,
            Err(e) => {
                warn!(path = %path.display(), error = %e, "cannot read a cache entry; treating it as a miss");
                return None;
            }
        };
        if check(&bytes) {
            Some(bytes)
        } else {
            self.drop_corrupt(path);
            None
        }
    }

    fn drop_corrupt(&self, path: &Path) {
        warn!(path = %path.display(), "dropping a cache entry that fails its check");
        bump(&self.inner.stats.corrupt, 1);
        if let Err(e) = fs::remove_file(path) {
            if e.kind() != ErrorKind::NotFound {
                warn!(path = %path.display(), error = %e, "cannot remove a corrupt cache entry");
            }
        }
    }

    /// Write `bytes` to `dest`: a unique temp file in `tmp/`, then rename. Not fsynced: every
    /// entry is checked when read, so one torn by a crash is dropped and refetched.
    fn write_atomic(&self, dest: &Path, bytes: &[u8]) {
        if let Err(e) = self.try_write_atomic(dest, bytes) {
            warn!(path = %dest.display(), error = %e, "cannot write a cache entry");
        }
    }

    fn try_write_atomic(&self, dest: &Path, bytes: &[u8]) -> std::io::Result<()> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        if let Some(parent) = dest.parent() {
            fs::create_dir_all(parent)?;
        }
        let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let (tmp, file) = loop {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let tmp = self.inner.root.join("tmp").join(format!("{}-{nanos:x}-{n}.tmp", std::process::id()));
            match OpenOptions::new().write(true).create_new(true).open(&tmp) {
                Ok(f) => break (tmp, f),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        };
        // The writer holds a shared flock on its temp file until the rename, so `tessera cache
        // gc` can tell a live writer's file (lock refused) from one left by a killed process.
        let written = lock::hold_temp(&file).and_then(|()| (&file).write_all(bytes));
        let result = written.and_then(|()| fs::rename(&tmp, dest));
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        drop(file);
        result
    }
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
}

impl Origin for HttpStore {
    fn cache_key(&self) -> String {
        self.base().to_owned()
    }

    fn read_ref(&self, tag: &str) -> Result<Option<ImageId>, StoreError> {
        HttpStore::read_ref(self, tag)
    }
}

impl Origin for crate::registry::RegistryStore {
    fn cache_key(&self) -> String {
        self.location()
    }

    fn read_ref(&self, tag: &str) -> Result<Option<ImageId>, StoreError> {
        crate::registry::RegistryStore::read_ref(self, tag)
    }
}

/// Whether an origin error means "unreachable or failing" (so cached mutable documents may be
/// used) rather than an authoritative answer.
fn origin_unavailable(e: &StoreError) -> bool {
    match e {
        StoreError::Http { source: HttpError::Transport(_), .. } => true,
        StoreError::Http { source: HttpError::Status(s), .. } => *s >= 500 || *s == 429 || *s == 408,
        StoreError::Registry(r) => match r {
            RegistryError::Transport { .. } | RegistryError::Read { .. } => true,
            RegistryError::Status { status, .. } => *status >= 500 || *status == 429 || *status == 408,
            _ => false,
        },
        _ => false,
    }
}

/// A remote store (an [`HttpStore`] by default) behind a [`DiskCache`]. Cheap to clone.
#[derive(Debug, Clone)]
pub struct CachedStore<O = HttpStore> {
    origin: O,
    cache: DiskCache,
}

impl<O: Origin> CachedStore<O> {
    /// The origin behind the cache.
    pub fn new(origin: O, cache: DiskCache) -> Self {
        Self { origin, cache }
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
        match self.origin.read_ref(tag) {
            Ok(Some(id)) => {
                self.cache.put_ref(base, tag, &id);
                Ok(Some(id))
            }
            Ok(None) => Ok(None),
            Err(e) if origin_unavailable(&e) => match self.cache.get_ref(base, tag) {
                Some(id) => {
                    warn!(tag, error = %e, "origin unavailable; using the cached tag lookup");
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
        resolve_with(reference, |tag| self.read_ref(tag), |id| self.get_entry(id).map(|_| ()))
    }

    fn get_entry(&self, id: &ImageId) -> Result<ImageEntry, StoreError> {
        let base = &self.origin.cache_key();
        match self.origin.get_entry(id) {
            Ok(entry) => {
                self.cache.put_entry(base, id, &entry);
                Ok(entry)
            }
            Err(e) if origin_unavailable(&e) => match self.cache.get_entry(base, id) {
                Some(entry) => {
                    warn!(image = %id, error = %e, "origin unavailable; using the cached image entry");
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

    fn list_refs(&self) -> Result<Vec<(String, ImageId)>, StoreError> {
        self.origin.list_refs()
    }

    fn chunk_source(&self, image: &OpenImage) -> Arc<dyn ChunkSource> {
        Arc::new(CachedSource::new(self.cache.clone(), self.origin.clone(), image))
    }
}

/// The chunk source of one open image: the disk cache, then the origin (whose verified answers
/// are cached). Ranges that are not a chunk of the image go straight to the origin.
pub struct CachedSource<S> {
    cache: DiskCache,
    origin: S,
    chunks: HashMap<(Sha256Digest, u64), (ChunkRef, PackLocation)>,
}

impl<S> std::fmt::Debug for CachedSource<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedSource")
            .field("cache", &self.cache)
            .field("chunks", &self.chunks.len())
            .finish()
    }
}

impl<S: ChunkSource> CachedSource<S> {
    /// A source for `image`'s chunks over `cache` and `origin`.
    pub fn new(cache: DiskCache, origin: S, image: &OpenImage) -> Self {
        let chunks = (0..u32::try_from(image.record().block_map.chunks().len()).unwrap_or(u32::MAX))
            .filter_map(|i| image.chunk_location(i))
            .map(|(c, pack, loc)| ((pack, loc.offset), (c, loc)))
            .collect();
        Self { cache, origin, chunks }
    }
}

impl<S: ChunkSource> ChunkSource for CachedSource<S> {
    fn read_stored(&self, pack: &Sha256Digest, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
        let Some((chunk, loc)) = self.chunks.get(&(*pack, offset)).filter(|(_, l)| l.stored_len == len)
        else {
            debug!(%pack, offset, len, "range is not a chunk of the image; not cached");
            return self.origin.read_stored(pack, offset, len);
        };
        self.cache.fetch_chunk(chunk, pack, loc, || self.origin.read_stored(pack, offset, len))
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
        fs::copy(cache.entry_path("http://a", &id), cache.entry_path("http://a", &other)).unwrap();
        assert!(cache.get_entry("http://a", &other).is_none(), "an entry for another record is refused");
        cache.put_ref("http://a", "latest", &id);
        assert_eq!(cache.get_ref("http://a", "latest"), Some(id));
        fs::write(cache.origin_dir("http://a").join("refs/latest"), b"garbage").unwrap();
        assert_eq!(cache.get_ref("http://a", "latest"), None);
        assert!(!cache.origin_dir("http://a").join("refs/latest").exists());
    }
}
