//! The local directory store: layout, atomic writes, blobs, entries and refs.
//!
//! ```text
//! STORE/
//!   blobs/sha256/<hex>     content-addressed blobs (records, prefixes, packs, pack indexes, …)
//!   images/<id hex>.json   image entries
//!   refs/<tag>             `sha256:<64 hex>\n`, then the prefix's and pack index's digests,
//!                          then the three blobs' lengths
//!   tmp/                   in-progress writes (same filesystem, so rename is atomic)
//! ```
//!
//! Every write goes to a fresh file in `tmp/`, is fsynced, renamed into place, and the target
//! directory is fsynced. A file under its final name is therefore always complete.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, ErrorKind, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use sha2::{Digest as _, Sha256};
use tessera_image::{
    validate_tag, ChunkId, ImageEntry, ImageId, ImageRecord, PackIndexBlob, PackLocation, Sha256Digest,
};
use tracing::{debug, trace, warn};

use crate::error::StoreError;
use crate::refs::RefText;
use crate::source::ChunkSource;

const BLOBS: &str = "blobs";
const BLOBS_SHA256: &str = "blobs/sha256";
const IMAGES: &str = "images";
const REFS: &str = "refs";
const TMP: &str = "tmp";
const LAYERS: &str = "layers";
const SOURCES: &str = "sources";

/// Temp files older than this are removed by [`LocalStore::create_or_open`].
const STALE_TEMP_AGE: Duration = Duration::from_secs(3600);
/// Open blob files kept for ranged reads; the cache is cleared when it grows past this.
const OPEN_FILE_CACHE: usize = 256;
/// Buffer of a [`BlobWriter`].
const WRITER_BUFFER: usize = 1 << 20;

/// Chunks already in a store: ChunkId → (pack digest, location in that pack).
///
/// `PackLocation::pack` refers to the pack list of the image the entry was found in; a new build
/// must use the digest, not that number.
pub type KnownChunks = HashMap<ChunkId, (Sha256Digest, PackLocation)>;

/// What the store knows about one layer (`layers/<diff_id hex>-<chunk size>.json`): the layer
/// manifest and the pack index of its chunks, both blobs of the store. Written by the builder
/// after the image that first used the layer; see `docs/formats/store.md`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerRecord {
    /// The builder's version of the tar reading rules that produced the manifest; a reader with
    /// other rules ignores the record (and replaces it).
    pub reader: u32,
    /// The layer manifest blob (`docs/formats/content-manifest.md`).
    pub manifest: Sha256Digest,
    /// A pack index blob locating every chunk the manifest names.
    pub pack_index: Sha256Digest,
    /// Uncompressed bytes of the layer's tar stream (counted against `--max-size` on reuse).
    pub tar_bytes: u64,
}

/// What the store knows about the last build of one source directory
/// (`sources/<key>-<chunk size>.json`, the key a hash of the directory's path): the source index
/// (`sources/<key>-<chunk size>.idx`) that lets the next build of that directory skip files that
/// did not change. Written by the builder after the image; see `docs/formats/source-index.md`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceRecord {
    /// The builder's version of the directory walk that produced the index; a builder with
    /// another ignores the record (and replaces it).
    pub reader: u32,
    /// The directory, as built (canonical path).
    pub path: String,
    /// sha256 of the source index, `sources/<same name>.idx` (not a blob of the store).
    pub index: Sha256Digest,
    /// The ID of the image that build produced (its record's digest): the record lives as long
    /// as the image does (`store gc`).
    pub image: Sha256Digest,
}

/// A store in a local directory. Cheap to clone; safe to share between threads.
#[derive(Debug, Clone)]
pub struct LocalStore {
    root: PathBuf,
    open_files: Arc<Mutex<HashMap<Sha256Digest, Arc<OpenBlob>>>>,
    /// The shared writer lock on `gc.lock` (`crate::gc`), taken by the first write and held
    /// while any clone lives, so `tessera store gc` never runs between a writer's steps.
    write_lock: Arc<std::sync::OnceLock<File>>,
}

#[derive(Debug)]
struct OpenBlob {
    file: File,
    len: u64,
}

impl LocalStore {
    /// Open a store for writing, creating the directory and its layout if needed.
    ///
    /// Fails with [`StoreError::NotAStore`] if the path is a file, or a non-empty directory that
    /// holds none of the store's directories; with [`StoreError::ReadOnly`] if the directory
    /// cannot be written. Temp files older than an hour (left by interrupted runs) are removed.
    pub fn create_or_open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let root = path.as_ref().to_owned();
        match fs::metadata(&root) {
            Ok(m) if !m.is_dir() => {
                return Err(StoreError::NotAStore { path: root, reason: "it exists and is not a directory" })
            }
            Ok(_) => {
                let mut empty = true;
                let mut ours = false;
                let entries =
                    fs::read_dir(&root).map_err(|e| StoreError::read("read directory", &root, e))?;
                for entry in entries {
                    let entry = entry.map_err(|e| StoreError::read("read directory", &root, e))?;
                    empty = false;
                    if [BLOBS, IMAGES, REFS, TMP].iter().any(|n| entry.file_name() == *n) {
                        ours = true;
                    }
                }
                if !empty && !ours {
                    return Err(StoreError::NotAStore {
                        path: root,
                        reason: "a non-empty directory without blobs/, images/ or refs/",
                    });
                }
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {
                fs::create_dir_all(&root)
                    .map_err(|e| StoreError::write("create store directory", &root, e))?;
            }
            Err(e) => return Err(StoreError::read("stat store directory", &root, e)),
        }
        let mut created = false;
        for dir in [BLOBS, BLOBS_SHA256, IMAGES, REFS, TMP] {
            let p = root.join(dir);
            match fs::create_dir(&p) {
                Ok(()) => created = true,
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                    if !p.is_dir() {
                        return Err(StoreError::NotAStore {
                            path: root,
                            reason: "a store entry is not a directory",
                        });
                    }
                }
                Err(e) => return Err(StoreError::write("create store directory", &p, e)),
            }
        }
        if created {
            // Make the new directories durable before anything is written into them.
            for dir in [BLOBS_SHA256, IMAGES, REFS, TMP] {
                sync_parent(&root.join(dir), "create store directory")?;
            }
        }
        let store = Self::at(root);
        // Writers and `tessera store gc` exclude each other (before anything is read for reuse).
        store.lock_for_writing()?;
        // Prove the store is writable now, not halfway through a build.
        let probe = store.temp_file("check that the store is writable")?;
        drop(probe);
        store.clean_stale_temps(STALE_TEMP_AGE);
        debug!(store = %store.root.display(), "opened store for writing");
        Ok(store)
    }

    /// Open an existing store for reading. Nothing is created.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let root = path.as_ref().to_owned();
        match fs::metadata(&root) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(StoreError::NotAStore { path: root, reason: "it is not a directory" }),
            Err(e) if e.kind() == ErrorKind::NotFound => return Err(StoreError::NoSuchStore { path: root }),
            Err(e) => return Err(StoreError::read("stat store directory", &root, e)),
        }
        if !root.join(BLOBS_SHA256).is_dir() || !root.join(IMAGES).is_dir() {
            return Err(StoreError::NotAStore { path: root, reason: "blobs/sha256/ or images/ is missing" });
        }
        debug!(store = %root.display(), "opened store for reading");
        Ok(Self::at(root))
    }

    fn at(root: PathBuf) -> Self {
        Self { root, open_files: Arc::default(), write_lock: Arc::default() }
    }

    /// Hold the store's shared writer lock from now on (waiting while `tessera store gc` runs).
    fn lock_for_writing(&self) -> Result<(), StoreError> {
        if self.write_lock.get().is_some() {
            return Ok(());
        }
        let file = crate::gc::lock_store(&self.root, false)?;
        // A concurrent first write may have won: its lock serves both, this one is dropped.
        let _ = self.write_lock.set(file);
        Ok(())
    }

    /// Pin image `id` while the returned guard lives: `tessera store gc` keeps it even when no
    /// tag names it (a daemon serving it by ID, or whose tag moved). Fails on a store that
    /// cannot be written (then nothing can collect it either).
    pub fn pin(&self, id: &ImageId) -> Result<crate::gc::ImagePin, StoreError> {
        crate::gc::ImagePin::new(&self.root, id)
    }

    /// The store directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where blob `digest` lives (whether or not it exists).
    pub fn blob_path(&self, digest: &Sha256Digest) -> PathBuf {
        self.root.join(BLOBS_SHA256).join(digest.hex())
    }

    /// Where the entry of image `id` lives.
    pub fn entry_path(&self, id: &ImageId) -> PathBuf {
        self.root.join(IMAGES).join(format!("{}.json", id.digest().hex()))
    }

    /// Where tag `tag` lives. The tag must already be validated.
    fn ref_path(&self, tag: &str) -> PathBuf {
        self.root.join(REFS).join(tag)
    }

    // ---- atomic writes -------------------------------------------------------------------------

    /// A new, uniquely named file in `tmp/`, removed when the guard drops.
    fn temp_file(&self, op: &'static str) -> Result<(File, TempGuard), StoreError> {
        self.lock_for_writing()?;
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let dir = self.root.join(TMP);
        let nanos =
            SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        loop {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let path = dir.join(format!("{}-{nanos:x}-{n}.tmp", std::process::id()));
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(file) => return Ok((file, TempGuard { path: Some(path) })),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(StoreError::write(op, &path, e)),
            }
        }
    }

    /// Write `bytes` to `dest` atomically: temp file, fsync, rename, fsync the directory.
    fn write_atomic(&self, dest: &Path, bytes: &[u8], op: &'static str) -> Result<(), StoreError> {
        let (mut file, guard) = self.temp_file(op)?;
        let tmp = guard.path().to_owned();
        file.write_all(bytes).map_err(|e| StoreError::write(op, &tmp, e))?;
        file.sync_all().map_err(|e| StoreError::write(op, &tmp, e))?;
        drop(file);
        rename_into_place(guard, dest, op)
    }

    /// Remove temp files older than `age`. Errors are logged and ignored: stale temps are harmless.
    fn clean_stale_temps(&self, age: Duration) {
        let dir = self.root.join(TMP);
        let Ok(entries) = fs::read_dir(&dir) else { return };
        let now = SystemTime::now();
        for entry in entries.flatten() {
            let old = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| now.duration_since(t).ok())
                .is_some_and(|d| d > age);
            if old {
                match fs::remove_file(entry.path()) {
                    Ok(()) => debug!(path = %entry.path().display(), "removed stale temp file"),
                    Err(e) => {
                        debug!(path = %entry.path().display(), error = &e as &dyn std::error::Error, "could not remove stale temp file")
                    }
                }
            }
        }
    }

    // ---- blobs ---------------------------------------------------------------------------------

    /// Store `bytes` as a blob and return its digest. A blob already present is not rewritten.
    pub fn put_blob(&self, bytes: &[u8]) -> Result<Sha256Digest, StoreError> {
        let digest = Sha256Digest::of(bytes);
        let dest = self.blob_path(&digest);
        if fs::metadata(&dest).is_ok_and(|m| m.is_file() && m.len() == bytes.len() as u64) {
            trace!(%digest, "blob already present");
            return Ok(digest);
        }
        self.write_atomic(&dest, bytes, "write blob")?;
        trace!(%digest, len = bytes.len(), "stored blob");
        Ok(digest)
    }

    /// A streaming writer for a large blob (a pack); see [`BlobWriter`].
    pub fn blob_writer(&self) -> Result<BlobWriter, StoreError> {
        let (file, guard) = self.temp_file("create blob")?;
        Ok(BlobWriter {
            blobs_dir: self.root.join(BLOBS_SHA256),
            file: Some(BufWriter::with_capacity(WRITER_BUFFER, file)),
            hasher: Sha256::new(),
            len: 0,
            written_back: 0,
            failed: None,
            guard,
        })
    }

    /// Whether blob `digest` is present (its content is not checked).
    pub fn has_blob(&self, digest: &Sha256Digest) -> Result<bool, StoreError> {
        let path = self.blob_path(digest);
        path.try_exists().map_err(|e| StoreError::read("stat blob", &path, e))
    }

    /// Length of blob `digest` in bytes.
    pub fn blob_len(&self, digest: &Sha256Digest) -> Result<u64, StoreError> {
        let path = self.blob_path(digest);
        match fs::metadata(&path) {
            Ok(m) => Ok(m.len()),
            Err(e) if e.kind() == ErrorKind::NotFound => {
                Err(StoreError::BlobNotFound { digest: *digest, path })
            }
            Err(e) => Err(StoreError::read("stat blob", &path, e)),
        }
    }

    /// Read a whole blob and verify that it hashes to `digest` ([`StoreError::Corrupt`] if not).
    pub fn read_blob(&self, digest: &Sha256Digest) -> Result<Vec<u8>, StoreError> {
        self.read_blob_as(digest, "blob")
    }

    /// [`Self::read_blob`], naming the kind of blob in errors.
    pub(crate) fn read_blob_as(
        &self,
        digest: &Sha256Digest,
        what: &'static str,
    ) -> Result<Vec<u8>, StoreError> {
        let path = self.blob_path(digest);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                return Err(StoreError::BlobNotFound { digest: *digest, path })
            }
            Err(e) => return Err(StoreError::read("read blob", &path, e)),
        };
        StoreError::check_sha256(what, digest, &bytes, || path)?;
        Ok(bytes)
    }

    /// Read `len` bytes at `offset` of blob `digest` (pread; the blob is not verified as a whole —
    /// callers verify what they read, e.g. chunks by their id).
    pub fn read_blob_range(
        &self,
        digest: &Sha256Digest,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, StoreError> {
        let blob = self.open_blob(digest)?;
        let oob = || StoreError::RangeOutOfBounds { digest: *digest, offset, len, blob_len: blob.len };
        let end = offset.checked_add(len).ok_or_else(oob)?;
        if end > blob.len {
            return Err(oob());
        }
        let n = usize::try_from(len).map_err(|_| oob())?;
        let mut buf = vec![0u8; n];
        blob.file.read_exact_at(&mut buf, offset).map_err(|e| {
            let path = self.blob_path(digest);
            if e.kind() == ErrorKind::UnexpectedEof {
                StoreError::Corrupt {
                    what: "blob",
                    digest: *digest,
                    path,
                    reason: "it shrank while open".into(),
                }
            } else {
                StoreError::read("read blob range", &path, e)
            }
        })?;
        Ok(buf)
    }

    fn open_blob(&self, digest: &Sha256Digest) -> Result<Arc<OpenBlob>, StoreError> {
        let mut cache = self.open_files.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = cache.get(digest) {
            return Ok(Arc::clone(b));
        }
        let path = self.blob_path(digest);
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                return Err(StoreError::BlobNotFound { digest: *digest, path })
            }
            Err(e) => return Err(StoreError::read("open blob", &path, e)),
        };
        let len = file.metadata().map_err(|e| StoreError::read("stat blob", &path, e))?.len();
        let blob = Arc::new(OpenBlob { file, len });
        if cache.len() >= OPEN_FILE_CACHE {
            cache.clear();
        }
        cache.insert(*digest, Arc::clone(&blob));
        Ok(blob)
    }

    // ---- build records (layers/, sources/) ------------------------------------------------------

    /// A build record (a cache: `None` if absent or unreadable as one, with a warning).
    fn read_record<T: serde::de::DeserializeOwned>(&self, path: &Path) -> Result<Option<T>, StoreError> {
        let bytes = match fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(StoreError::read("read build record", path, e)),
        };
        match serde_json::from_slice::<T>(&bytes) {
            Ok(r) => Ok(Some(r)),
            Err(e) => {
                warn!(path = %path.display(), error = %e, "ignoring an unreadable build record");
                Ok(None)
            }
        }
    }

    /// Write (or atomically replace) the build record at `dir/name` once the blobs it names are
    /// present.
    fn write_record<T: serde::Serialize>(
        &self,
        dir: &str,
        name: &str,
        blobs: &[Sha256Digest],
        record: &T,
    ) -> Result<(), StoreError> {
        for digest in blobs {
            if !self.has_blob(digest)? {
                return Err(StoreError::BlobNotFound { digest: *digest, path: self.blob_path(digest) });
            }
        }
        let dir = self.root.join(dir);
        match fs::create_dir(&dir) {
            Ok(()) => sync_parent(&dir, "create a build record directory")?,
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(StoreError::write("create a build record directory", &dir, e)),
        }
        let mut json = serde_json::to_vec_pretty(record).unwrap_or_default();
        json.push(b'\n');
        self.write_atomic(&dir.join(name), &json, "write build record")
    }

    /// The record of the layer whose uncompressed tar has sha256 `diff_id`, as built with
    /// `chunk_size`; `None` if the store has none or it cannot be read as one (a record is only a
    /// cache: the caller reads the layer instead).
    pub fn layer_record(
        &self,
        diff_id: &Sha256Digest,
        chunk_size: u32,
    ) -> Result<Option<LayerRecord>, StoreError> {
        self.read_record(&self.root.join(LAYERS).join(format!("{}-{chunk_size}.json", diff_id.hex())))
    }

    /// Write (or atomically replace) a layer record. The blobs it names must already be present.
    pub fn put_layer_record(
        &self,
        diff_id: &Sha256Digest,
        chunk_size: u32,
        record: &LayerRecord,
    ) -> Result<(), StoreError> {
        let name = format!("{}-{chunk_size}.json", diff_id.hex());
        self.write_record(LAYERS, &name, &[record.manifest, record.pack_index], record)?;
        debug!(%diff_id, chunk_size, manifest = %record.manifest, "stored layer record");
        Ok(())
    }

    fn source_name(key: &str, chunk_size: u32) -> Result<String, StoreError> {
        if key.is_empty() || key.len() > 64 || !key.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(StoreError::BadSetting {
                name: "source record key".into(),
                value: key.into(),
                expected: "1 to 64 hex digits",
            });
        }
        Ok(format!("{key}-{chunk_size}.json"))
    }

    /// The record of the last build of the source directory keyed `key` with `chunk_size`; `None`
    /// if there is none or it cannot be read as one (a record is only a cache).
    pub fn source_record(&self, key: &str, chunk_size: u32) -> Result<Option<SourceRecord>, StoreError> {
        self.read_record(&self.root.join(SOURCES).join(Self::source_name(key, chunk_size)?))
    }

    /// A writer for the source index of directory `key` (`sources/<key>-<chunk size>.idx`, beside
    /// its record): [`Self::commit_source_index`] puts it in place. Not a blob: a build's cache,
    /// which `copy` and `push` never carry.
    pub fn source_index_writer(&self) -> Result<BlobWriter, StoreError> {
        self.blob_writer()
    }

    /// Put the source index written by `writer` in place for directory `key`; its sha256, for the
    /// record to name.
    pub fn commit_source_index(
        &self,
        key: &str,
        chunk_size: u32,
        writer: BlobWriter,
    ) -> Result<Sha256Digest, StoreError> {
        let name = Self::source_name(key, chunk_size)?.replace(".json", ".idx");
        let dir = self.root.join(SOURCES);
        match fs::create_dir(&dir) {
            Ok(()) => sync_parent(&dir, "create a build record directory")?,
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(StoreError::write("create a build record directory", &dir, e)),
        }
        writer.commit_as(&dir.join(name))
    }

    /// The source index `record` names, checked against its sha256; `None` (with a warning) if it
    /// is missing or does not match.
    pub fn read_source_index(
        &self,
        key: &str,
        chunk_size: u32,
        record: &SourceRecord,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let path = self.root.join(SOURCES).join(Self::source_name(key, chunk_size)?.replace(".json", ".idx"));
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(StoreError::read("read source index", &path, e)),
        };
        if Sha256Digest::of(&bytes) != record.index {
            warn!(path = %path.display(), "ignoring a source index that does not match its record");
            return Ok(None);
        }
        Ok(Some(bytes))
    }

    /// Write (or atomically replace) a source record, after its index
    /// ([`Self::commit_source_index`]) and its image.
    pub fn put_source_record(
        &self,
        key: &str,
        chunk_size: u32,
        record: &SourceRecord,
    ) -> Result<(), StoreError> {
        let name = Self::source_name(key, chunk_size)?;
        if !self.has_image(&ImageId(record.image))? {
            return Err(StoreError::UnknownImage { reference: ImageId(record.image).to_string() });
        }
        self.write_record(SOURCES, &name, &[], record)?;
        debug!(key, chunk_size, index = %record.index, "stored source record");
        Ok(())
    }

    // ---- entries and refs ----------------------------------------------------------------------

    /// Write (or atomically replace) the entry of image `id`. The blobs it names must already be
    /// in the store, and `entry.record` must be `id` — the write order that keeps a store valid.
    pub fn put_entry(&self, id: &ImageId, entry: &ImageEntry) -> Result<(), StoreError> {
        if entry.record != id.digest() {
            return Err(StoreError::Inconsistent {
                image: *id,
                reason: format!("the entry's record is {}, not the image ID", entry.record),
            });
        }
        let named =
            [Some(entry.record), Some(entry.prefix), Some(entry.pack_index), entry.profile, entry.provenance];
        for digest in named.into_iter().flatten() {
            if !self.has_blob(&digest)? {
                return Err(StoreError::BlobNotFound { digest, path: self.blob_path(&digest) });
            }
        }
        self.write_atomic(&self.entry_path(id), &entry.to_json(), "write image entry")?;
        debug!(image = %id, "stored image entry");
        Ok(())
    }

    /// The entry of image `id` ([`StoreError::UnknownImage`] if the store does not hold it).
    pub fn get_entry(&self, id: &ImageId) -> Result<ImageEntry, StoreError> {
        let path = self.entry_path(id);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                return Err(StoreError::UnknownImage { reference: id.to_string() })
            }
            Err(e) => return Err(StoreError::read("read image entry", &path, e)),
        };
        ImageEntry::from_json(&bytes).map_err(|source| StoreError::BadEntry { path, source })
    }

    /// Whether the store holds an entry for image `id`.
    pub fn has_image(&self, id: &ImageId) -> Result<bool, StoreError> {
        let path = self.entry_path(id);
        path.try_exists().map_err(|e| StoreError::read("stat image entry", &path, e))
    }

    /// Point tag `tag` at image `id` (atomically replacing an older ref). The image's entry must
    /// already be in the store: the ref names its prefix and pack index too ([`RefText`]).
    pub fn set_ref(&self, tag: &str, id: &ImageId) -> Result<(), StoreError> {
        self.set_refs(&[tag], id, None)
    }

    /// [`Self::set_ref`] for each of `tags`, the ref's text made once; `places`: where the
    /// chunks of the image's profile are stored, when the caller has worked them out already
    /// (else they are, here, if the entry names a profile).
    pub(crate) fn set_refs(
        &self,
        tags: &[&str],
        id: &ImageId,
        places: Option<crate::PackRanges>,
    ) -> Result<(), StoreError> {
        if let Some(tag) = tags.iter().find(|t| !validate_tag(t)) {
            return Err(StoreError::InvalidTag { tag: (*tag).to_owned() });
        }
        let entry = self.get_entry(id)?;
        // The lengths of the blobs a start reads first, so that a remote reader asks for all of
        // their pieces at once; a blob not here (yet) leaves them out.
        let len = |d: &Sha256Digest| std::fs::metadata(self.blob_path(d)).ok().map(|m| m.len());
        let lengths = (|| {
            Some(crate::RefLengths {
                record: len(&id.digest())?,
                prefix: len(&entry.prefix)?,
                pack_index: len(&entry.pack_index)?,
            })
        })();
        let mut text = RefText::of(*id, &entry, lengths);
        if lengths.is_some() && entry.profile.is_some() {
            text.profile = match places {
                Some(places) => places,
                None => self.profile_places(id).unwrap_or_else(|e| {
                    debug!(image = %id, error = %e, "the ref names no profile ranges");
                    Vec::new()
                }),
            };
        }
        let text = text.encode();
        for tag in tags {
            self.write_atomic(&self.ref_path(tag), text.as_bytes(), "write ref")?;
            debug!(tag, image = %id, "stored ref");
        }
        Ok(())
    }

    /// Where the chunks of image `id`'s prefetch profile are stored ([`crate::profile_ranges`];
    /// none without a profile).
    fn profile_places(&self, id: &ImageId) -> Result<crate::PackRanges, StoreError> {
        let image = crate::OpenImage::open(self, id)?;
        let profile = crate::read_profile(self, id, image.entry(), &image.record().block_map)?;
        Ok(profile.map(|(_, p)| crate::profile_ranges(&image, &p)).unwrap_or_default())
    }

    /// Resolve `sha256:<64 hex>` (the store must hold that image) or a tag to an image ID.
    pub fn resolve(&self, reference: &str) -> Result<ImageId, StoreError> {
        let unknown = || StoreError::UnknownImage { reference: reference.to_owned() };
        if reference.starts_with('@') {
            return Err(StoreError::SubjectNeedsRegistry { reference: reference.to_owned() });
        }
        if reference.starts_with("sha256:") {
            let id: ImageId = reference
                .parse()
                .map_err(|_| StoreError::InvalidReference { reference: reference.to_owned() })?;
            return if self.has_image(&id)? { Ok(id) } else { Err(unknown()) };
        }
        if !validate_tag(reference) {
            return Err(StoreError::InvalidReference { reference: reference.to_owned() });
        }
        let id = match self.read_ref(reference)? {
            Some(id) => id,
            None => return Err(unknown()),
        };
        if !self.has_image(&id)? {
            return Err(StoreError::DanglingRef { tag: reference.to_owned(), id });
        }
        Ok(id)
    }

    /// Read `refs/<tag>`; `None` if it does not exist.
    fn read_ref(&self, tag: &str) -> Result<Option<ImageId>, StoreError> {
        let path = self.ref_path(tag);
        let text = match fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(StoreError::read("read ref", &path, e)),
        };
        let id = RefText::parse(&text).ok_or(StoreError::BadRef { path })?.id;
        Ok(Some(id))
    }

    /// Every image with an entry, sorted by ID.
    pub fn list_images(&self) -> Result<Vec<ImageId>, StoreError> {
        let dir = self.root.join(IMAGES);
        let mut out = Vec::new();
        for entry in fs::read_dir(&dir).map_err(|e| StoreError::read("list images", &dir, e))? {
            let entry = entry.map_err(|e| StoreError::read("list images", &dir, e))?;
            let name = entry.file_name();
            let Some(hex) = name.to_str().and_then(|n| n.strip_suffix(".json")) else { continue };
            if let Ok(d) = Sha256Digest::from_hex(hex) {
                out.push(ImageId(d));
            }
        }
        out.sort();
        Ok(out)
    }

    /// Every tag and the image it points to, sorted by tag. Files whose names are not valid tags
    /// are ignored; a valid name with unparsable content is [`StoreError::BadRef`].
    pub fn list_refs(&self) -> Result<Vec<(String, ImageId)>, StoreError> {
        let dir = self.root.join(REFS);
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(StoreError::read("list refs", &dir, e)),
        };
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| StoreError::read("list refs", &dir, e))?;
            let Some(tag) = entry.file_name().to_str().map(str::to_owned) else { continue };
            if !validate_tag(&tag) {
                continue;
            }
            if let Some(id) = self.read_ref(&tag)? {
                out.push((tag, id));
            }
        }
        out.sort();
        Ok(out)
    }

    /// The chunks already stored, gathered from the pack index of every image in the store, so a
    /// new build can reuse them instead of storing them again.
    ///
    /// Cost: reads and verifies every image's entry, pack index and record (whose chunk list a
    /// version-2 index follows; ≈45 bytes per chunk in all) and stats each pack once, so it is
    /// linear in the number of chunks in the store — fine for stores of a few hundred images; a
    /// persistent store-wide index can replace it later. Images whose entry, pack index or record
    /// cannot be read, and chunks whose pack is missing, are skipped with a warning:
    /// deduplication is an optimization, never a reason to fail a build.
    pub fn known_chunks(&self) -> Result<KnownChunks, StoreError> {
        let mut out = KnownChunks::new();
        let mut pack_present: HashMap<Sha256Digest, bool> = HashMap::new();
        for id in self.list_images()? {
            let located = self.get_entry(&id).and_then(|e| {
                let bytes = self.read_blob_as(&e.pack_index, "pack index")?;
                if tessera_image::RefIndex::sniff(&bytes) {
                    // A --reference-layers image: its chunks are in layer blobs, not packs.
                    return Ok(Vec::new());
                }
                let index = PackIndexBlob::decode(&bytes).map_err(|source| StoreError::Decode {
                    what: "pack index",
                    digest: e.pack_index,
                    source,
                })?;
                let record = self.read_blob_as(&e.record, "image record")?;
                let record = ImageRecord::decode(&record).map_err(|source| StoreError::Decode {
                    what: "image record",
                    digest: e.record,
                    source,
                })?;
                let chunks = record.block_map.chunks();
                let places = index
                    .locate(chunks)
                    .map_err(|m| StoreError::Inconsistent { image: id, reason: m.to_string() })?;
                Ok(chunks.iter().map(|c| c.id).zip(places).collect())
            });
            let located: Vec<(ChunkId, (Sha256Digest, PackLocation))> = match located {
                Ok(l) => l,
                Err(e) => {
                    warn!(image = %id, error = &e as &dyn std::error::Error, "skipping an image whose pack index cannot be read");
                    continue;
                }
            };
            for (chunk, (pack, loc)) in located {
                if out.contains_key(&chunk) {
                    continue;
                }
                let present = match pack_present.get(&pack) {
                    Some(&p) => p,
                    None => {
                        let p = self.has_blob(&pack)?;
                        if !p {
                            warn!(image = %id, %pack, "pack is missing; its chunks will not be reused");
                        }
                        pack_present.insert(pack, p);
                        p
                    }
                };
                if present {
                    out.insert(chunk, (pack, loc));
                }
            }
        }
        debug!(chunks = out.len(), "gathered known chunks");
        Ok(out)
    }
}

impl ChunkSource for LocalStore {
    fn read_stored(&self, pack: &Sha256Digest, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
        self.read_blob_range(pack, offset, u64::from(len))
    }
}

/// Removes its file on drop unless disarmed.
#[derive(Debug)]
struct TempGuard {
    path: Option<PathBuf>,
}

impl TempGuard {
    fn path(&self) -> &Path {
        self.path.as_deref().unwrap_or(Path::new(""))
    }

    fn disarm(&mut self) {
        self.path = None;
    }
}

impl Drop for TempGuard {
    fn drop(&mut self) {
        if let Some(p) = self.path.take() {
            if let Err(e) = fs::remove_file(&p) {
                if e.kind() != ErrorKind::NotFound {
                    warn!(path = %p.display(), error = &e as &dyn std::error::Error, "could not remove temp file");
                }
            }
        }
    }
}

/// Rename the (complete, fsynced) temp file to `dest` and fsync `dest`'s directory.
fn rename_into_place(mut guard: TempGuard, dest: &Path, op: &'static str) -> Result<(), StoreError> {
    fs::rename(guard.path(), dest).map_err(|e| StoreError::write(op, dest, e))?;
    guard.disarm();
    sync_parent(dest, op)
}

fn sync_parent(path: &Path, op: &'static str) -> Result<(), StoreError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| StoreError::write(op, dir, e))
}

/// Streams a large blob into the store, hashing it on the fly.
///
/// Bytes go to a temp file in `tmp/`; [`BlobWriter::commit`] fsyncs it and renames it to
/// `blobs/sha256/<hex>`. Dropping the writer without committing removes the temp file, so a
/// failed or abandoned write never leaves anything under a blob name.
///
/// Writing through [`std::io::Write`] returns plain `io::Error`s; the first failure is also kept
/// as a typed [`StoreError`] (e.g. [`StoreError::Full`]) and returned by [`BlobWriter::commit`].
#[derive(Debug)]
pub struct BlobWriter {
    blobs_dir: PathBuf,
    file: Option<BufWriter<File>>,
    hasher: Sha256,
    len: u64,
    /// Bytes up to which writeback was started ([`WRITEBACK_STEP`]).
    written_back: u64,
    failed: Option<StoreError>,
    guard: TempGuard,
}

/// A blob writer starts the kernel's writeback of every this many bytes written, so that the
/// commit's fsync waits for the last few MiB instead of the whole blob: a build's 128 MiB pack
/// would otherwise sit dirty in the page cache (writeback starts at 10 % of RAM or after 30 s)
/// and be written out while the build waits at its end.
const WRITEBACK_STEP: u64 = 16 << 20;

impl BlobWriter {
    /// Bytes written so far (the offset the next byte lands at).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether nothing has been written yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Append `bytes` and return the offset they start at.
    pub fn append(&mut self, bytes: &[u8]) -> Result<u64, StoreError> {
        let offset = self.len;
        if let Err(e) = self.write_all(bytes) {
            return Err(self
                .failed
                .take()
                .unwrap_or_else(|| StoreError::write("write blob", self.guard.path(), e)));
        }
        Ok(offset)
    }

    /// Flush and fsync the temp file; its sha256.
    fn finish(&mut self) -> Result<Sha256Digest, StoreError> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        let tmp = self.guard.path().to_owned();
        let Some(buffered) = self.file.take() else {
            return Err(StoreError::Io {
                op: "commit blob",
                path: tmp,
                source: io::Error::other("writer already finished"),
            });
        };
        let file =
            buffered.into_inner().map_err(|e| StoreError::write("write blob", &tmp, e.into_error()))?;
        file.sync_all().map_err(|e| StoreError::write("fsync blob", &tmp, e))?;
        drop(file);
        Ok(Sha256Digest(std::mem::take(&mut self.hasher).finalize().into()))
    }

    /// Finish and move the bytes to `dest` instead of the blob directory (a build record's file,
    /// which is not a blob: `sources/`); its sha256 is returned for the record to name.
    pub(crate) fn commit_as(mut self, dest: &Path) -> Result<Sha256Digest, StoreError> {
        let digest = self.finish()?;
        let guard = std::mem::replace(&mut self.guard, TempGuard { path: None });
        rename_into_place(guard, dest, "commit file")?;
        Ok(digest)
    }

    /// Fsync, rename into `blobs/sha256/<hex>`, fsync the directory; return the digest. If the
    /// blob already exists the temp file is discarded.
    pub fn commit(mut self) -> Result<Sha256Digest, StoreError> {
        let digest = self.finish()?;
        let dest = self.blobs_dir.join(digest.hex());
        if fs::metadata(&dest).is_ok_and(|m| m.is_file() && m.len() == self.len) {
            trace!(%digest, "streamed blob already present");
            return Ok(digest);
        }
        let guard = std::mem::replace(&mut self.guard, TempGuard { path: None });
        rename_into_place(guard, &dest, "commit blob")?;
        debug!(%digest, len = self.len, "stored streamed blob");
        Ok(digest)
    }
}

impl Write for BlobWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.failed.is_some() {
            return Err(io::Error::other("an earlier write to this blob failed"));
        }
        let Some(file) = self.file.as_mut() else {
            return Err(io::Error::other("writer already finished"));
        };
        match file.write(buf) {
            Ok(n) => {
                self.hasher.update(&buf[..n]);
                self.len += n as u64;
                if self.len - self.written_back >= WRITEBACK_STEP {
                    self.start_writeback();
                }
                Ok(n)
            }
            Err(e) => Err(self.remember(e)),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self.file.as_mut().map(|f| f.flush()) {
            Some(Err(e)) => Err(self.remember(e)),
            _ => Ok(()),
        }
    }
}

impl BlobWriter {
    /// Start writing back what the kernel holds of the blob beyond [`Self::written_back`]
    /// (`sync_file_range(SYNC_FILE_RANGE_WRITE)`: it does not wait for the writes, and what it
    /// cannot do is left to the commit's fsync, which reports errors). rustix has no
    /// `sync_file_range`, hence libc's.
    #[allow(unsafe_code)]
    fn start_writeback(&mut self) {
        use std::os::fd::AsRawFd;
        let Some(file) = self.file.as_ref() else { return };
        let in_kernel = self.len - file.buffer().len() as u64;
        let (Ok(from), Ok(len)) =
            (i64::try_from(self.written_back), i64::try_from(in_kernel - self.written_back))
        else {
            return;
        };
        if len > 0 {
            // SAFETY: a system call on a file descriptor this writer owns and keeps open for the
            // call; no memory is passed.
            unsafe {
                libc::sync_file_range(file.get_ref().as_raw_fd(), from, len, libc::SYNC_FILE_RANGE_WRITE)
            };
            self.written_back = in_kernel;
        }
    }

    /// Keep a typed copy of the first write error; return the original.
    fn remember(&mut self, e: io::Error) -> io::Error {
        if e.kind() != ErrorKind::Interrupted && self.failed.is_none() {
            let copy = match e.raw_os_error() {
                Some(code) => io::Error::from_raw_os_error(code),
                None => io::Error::new(e.kind(), e.to_string()),
            };
            self.failed = Some(StoreError::write("write blob", self.guard.path(), copy));
        }
        e
    }
}
