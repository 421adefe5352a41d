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

use std::collections::HashMap;
use std::fs::{self, OpenOptions};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

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

/// A host disk cache directory. Cheap to clone.
#[derive(Debug, Clone)]
pub struct DiskCache {
    root: Arc<PathBuf>,
    max_bytes: Option<u64>,
}

impl DiskCache {
    /// Open (creating if needed) the cache `config` describes.
    pub fn open(config: &CacheConfig) -> Result<Self, StoreError> {
        let root = config.dir.join(VERSION_DIR);
        for sub in ["blobs/sha256", "chunks", "origins", "tmp"] {
            let p = root.join(sub);
            fs::create_dir_all(&p).map_err(|source| StoreError::Cache { op: "create", path: p, source })?;
        }
        if config.max_bytes.is_some() {
            warn!("--cache-size is not enforced yet (LRU eviction lands next); the cache is unbounded");
        }
        Ok(Self { root: Arc::new(root), max_bytes: config.max_bytes })
    }

    /// The bound on cached bytes, if any.
    pub fn max_bytes(&self) -> Option<u64> {
        self.max_bytes
    }

    /// The versioned root (`DIR/v1`).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where blob `digest` is cached.
    pub fn blob_path(&self, digest: &Sha256Digest) -> PathBuf {
        self.root.join("blobs/sha256").join(digest.hex())
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
        self.root.join("chunks").join(&hex[..2]).join(name)
    }

    /// The directory of the mutable documents (entries, refs) of origin `base`.
    pub fn origin_dir(&self, base: &str) -> PathBuf {
        self.root.join("origins").join(Sha256Digest::of(base.as_bytes()).hex())
    }

    /// A cached blob, checked against its sha256 (a corrupt one is removed: `None`).
    pub fn get_blob(&self, digest: &Sha256Digest) -> Option<Vec<u8>> {
        let path = self.blob_path(digest);
        let bytes = self.read(&path)?;
        if Sha256Digest::of(&bytes) == *digest {
            trace!(%digest, "cache hit: blob");
            Some(bytes)
        } else {
            self.drop_corrupt(&path, "its sha256 does not match");
            None
        }
    }

    /// Cache a blob whose digest the caller has checked. Failures are logged, not returned: the
    /// cache is an optimization.
    pub fn put_blob(&self, digest: &Sha256Digest, bytes: &[u8]) {
        self.write_atomic(&self.blob_path(digest), bytes);
    }

    /// A cached chunk in the stored form `loc` describes, fully checked (decoded, length and
    /// blake3 against the ChunkId). A corrupt entry is removed: `None`.
    pub fn get_chunk(&self, chunk: &ChunkRef, pack: &Sha256Digest, loc: &PackLocation) -> Option<Vec<u8>> {
        let path = self.chunk_path(chunk, loc);
        let bytes = self.read(&path)?;
        match decode_stored_chunk(chunk, pack, loc, &bytes) {
            Ok(_) => {
                trace!(chunk = %chunk.id, "cache hit: chunk");
                Some(bytes)
            }
            Err(_) => {
                self.drop_corrupt(&path, "it does not decode to its chunk id");
                None
            }
        }
    }

    /// Cache stored chunk bytes, only if they check out (bad bytes from the origin never enter).
    pub fn put_chunk(&self, chunk: &ChunkRef, pack: &Sha256Digest, loc: &PackLocation, stored: &[u8]) {
        if decode_stored_chunk(chunk, pack, loc, stored).is_ok() {
            self.write_atomic(&self.chunk_path(chunk, loc), stored);
        }
    }

    /// A cached image entry of origin `base` for `id` (it must parse and name `id` as its
    /// record; otherwise it is removed: `None`).
    pub fn get_entry(&self, base: &str, id: &ImageId) -> Option<ImageEntry> {
        let path = self.entry_path(base, id);
        let bytes = self.read(&path)?;
        match ImageEntry::from_json(&bytes) {
            Ok(e) if e.record == id.digest() => Some(e),
            _ => {
                self.drop_corrupt(&path, "it is not a valid entry for this image");
                None
            }
        }
    }

    /// Cache an image entry of origin `base`.
    pub fn put_entry(&self, base: &str, id: &ImageId, entry: &ImageEntry) {
        self.write_atomic(&self.entry_path(base, id), &entry.to_json());
    }

    /// A cached tag lookup of origin `base` (a corrupt one is removed: `None`).
    pub fn get_ref(&self, base: &str, tag: &str) -> Option<ImageId> {
        let path = self.origin_dir(base).join("refs").join(tag);
        let bytes = self.read(&path)?;
        let id = parse_ref(&bytes);
        if id.is_none() {
            self.drop_corrupt(&path, "it is not `sha256:<64 hex>` and a newline");
        }
        id
    }

    /// Cache a tag lookup of origin `base` (the tag must be validated).
    pub fn put_ref(&self, base: &str, tag: &str, id: &ImageId) {
        self.write_atomic(&self.origin_dir(base).join("refs").join(tag), format!("{id}\n").as_bytes());
    }

    fn entry_path(&self, base: &str, id: &ImageId) -> PathBuf {
        self.origin_dir(base).join("images").join(format!("{}.json", id.digest().hex()))
    }

    fn read(&self, path: &Path) -> Option<Vec<u8>> {
        match fs::read(path) {
            Ok(b) => Some(b),
            Err(e) if e.kind() == ErrorKind::NotFound => None,
            Err(e) => {
                warn!(path = %path.display(), error = %e, "cannot read a cache entry; treating it as a miss");
                None
            }
        }
    }

    fn drop_corrupt(&self, path: &Path, reason: &str) {
        warn!(path = %path.display(), reason, "dropping a corrupt cache entry");
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
        let tmp = loop {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let tmp = self.root.join("tmp").join(format!("{}-{nanos:x}-{n}.tmp", std::process::id()));
            match OpenOptions::new().write(true).create_new(true).open(&tmp) {
                Ok(mut f) => {
                    let written = f.write_all(bytes);
                    if let Err(e) = written {
                        let _ = fs::remove_file(&tmp);
                        return Err(e);
                    }
                    break tmp;
                }
                Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        };
        fs::rename(&tmp, dest).inspect_err(|_| {
            let _ = fs::remove_file(&tmp);
        })
    }
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
        if let Some(bytes) = self.cache.get_blob(digest) {
            return Ok(bytes);
        }
        let bytes = self.origin.read_blob(digest)?;
        self.cache.put_blob(digest, &bytes);
        Ok(bytes)
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
        if let Some(bytes) = self.cache.get_chunk(chunk, pack, loc) {
            return Ok(bytes);
        }
        let bytes = self.origin.read_stored(pack, offset, len)?;
        self.cache.put_chunk(chunk, pack, loc, &bytes);
        Ok(bytes)
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
