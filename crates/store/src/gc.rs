//! Store garbage collection (`tessera store gc`): mark from the roots, sweep what nothing live
//! references and is older than the grace period.
//!
//! A store is seen as keys under its root, the same on a local disk and in an S3 bucket:
//! `refs/<tag>`, `images/<id hex>.json`, `layers/<name>.json`, `sources/<name>.json`,
//! `blobs/sha256/<hex>`
//! (`docs/formats/store.md`). A [`GcBackend`] lists, reads and deletes them.
//!
//! **Roots**: every tag whose image entry exists, every pinned image (a running `serve` of a local
//! store pins its image, [`crate::LocalStore::pin`]), every image entry younger than the grace
//! (a build writes its entry before its tag), and with `keep_untagged` every image entry. **Live**:
//! the roots' blobs (record, prefix, pack index, profile, provenance), the packs or layer blobs
//! their pack index names, and the layer records whose layer manifest a live image's provenance
//! names (or that are younger than the grace) with their manifest, pack index and packs, and the
//! source records and indexes (`sources/`: a directory build's index for its next build) of kept
//! images.
//!
//! **Sweep**, in the reverse of the write order so an interrupted gc never leaves something that
//! looks valid and is not: tags whose image is gone, then image entries, then layer and source
//! records, then blobs; only what is not live *and* older than the grace. A live image whose entry or pack
//! index cannot be read stops the collection before anything is removed (what it references is
//! unknown).
//!
//! **Concurrent writers.** On a local store every writer (build, copy, profile) holds a shared
//! `flock` on `gc.lock` while it has the store open for writing and gc holds it exclusively, so
//! gc and writers never overlap on one host, whatever the grace. An S3 store has no lock: there
//! the grace alone protects a copy in flight, so it must be at least [`MIN_UNLOCKED_GRACE`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::Serialize;
use tessera_image::{AnyPackIndex, ImageEntry, ImageId, Sha256Digest};
use tracing::{debug, info, warn};

use crate::error::StoreError;
use crate::local::{LayerRecord, LocalStore, SourceRecord};

/// The default grace period: objects younger than this are never removed.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(3600);

/// The smallest grace accepted on stores without a writer lock (S3): a copy that runs longer
/// than the grace between uploading a blob and writing its image entry could lose the blob.
pub const MIN_UNLOCKED_GRACE: Duration = Duration::from_secs(600);

/// One object of a store, as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreObject {
    /// The key relative to the store root, e.g. `blobs/sha256/<hex>`.
    pub key: String,
    /// Its size in bytes.
    pub len: u64,
    /// When it was last written (`None`: unknown, treated as young — never removed).
    pub modified: Option<SystemTime>,
}

/// What gc needs of a store: list, read and delete keys.
pub trait GcBackend {
    /// The store, for messages.
    fn describe(&self) -> String;
    /// Every object whose key starts with `dir` (e.g. `refs/`), not recursing below one level.
    fn list(&self, dir: &str) -> Result<Vec<StoreObject>, StoreError>;
    /// The bytes of `key`; `None` if it does not exist.
    fn read(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError>;
    /// Remove `key` (a missing key is not an error).
    fn delete(&self, key: &str) -> Result<(), StoreError>;
    /// Images pinned by running readers.
    fn pinned(&mut self) -> Result<Vec<ImageId>, StoreError> {
        Ok(Vec::new())
    }
    /// Whether writers are locked out for the whole collection (local stores).
    fn locked(&self) -> bool {
        false
    }
}

/// How to collect.
#[derive(Debug, Clone)]
pub struct GcOptions {
    /// Objects younger than this are kept whatever references them.
    pub grace: Duration,
    /// Report what would be removed; remove nothing.
    pub dry_run: bool,
    /// Keep every image that has an entry, tagged or not (collect only unreferenced blobs).
    pub keep_untagged: bool,
    /// The time to measure ages from (now, except in tests).
    pub now: SystemTime,
}

impl Default for GcOptions {
    fn default() -> Self {
        Self { grace: DEFAULT_GRACE, dry_run: false, keep_untagged: false, now: SystemTime::now() }
    }
}

/// Count and bytes of one kind of object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Tally {
    pub count: u64,
    pub bytes: u64,
}

impl Tally {
    pub(crate) fn add(&mut self, bytes: u64) {
        self.count += 1;
        self.bytes += bytes;
    }
}

/// One removed (or, in a dry run, removable) object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Removed {
    /// The key relative to the store root.
    pub key: String,
    /// `tag`, `image`, `layer-record`, or the blob's role: `record`, `prefix`, `pack-index`,
    /// `pack`, `profile`, `provenance`, `layer-manifest`, `layer` (a referenced layer blob), or
    /// `unreferenced` (a blob no entry names: an interrupted build or copy).
    pub kind: &'static str,
    pub bytes: u64,
}

/// What a collection found and did (`tessera store gc --json`; keys in `docs/store.md`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct StoreGcReport {
    pub store: String,
    pub grace_seconds: u64,
    pub dry_run: bool,
    /// Images kept (live) and removed.
    pub images_kept: u64,
    pub images_removed: u64,
    /// Tags kept, and removed (their image was gone).
    pub tags_kept: u64,
    pub tags_removed: u64,
    /// Pinned images among the kept ones.
    pub images_pinned: u64,
    /// Blobs kept because something live references them.
    pub live: Tally,
    /// Objects kept only because they are younger than the grace.
    pub young: Tally,
    /// Everything removed, by kind.
    pub removed: BTreeMap<&'static str, Tally>,
    /// Total removed.
    pub removed_total: Tally,
    /// Each removed object.
    pub objects: Vec<Removed>,
    /// Registry stores: the blobs only the removed images named, which the registry's own
    /// garbage collection frees (gc deletes manifests, not blobs, there).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub released: Option<Tally>,
}

impl StoreGcReport {
    /// Count `removed` (an object removed, or removable in a dry run).
    pub(crate) fn note(&mut self, removed: Removed) {
        self.removed.entry(removed.kind).or_default().add(removed.bytes);
        self.removed_total.add(removed.bytes);
        self.objects.push(removed);
    }
}

fn parse_ref(bytes: &[u8]) -> Option<ImageId> {
    crate::RefText::parse(bytes).map(|r| r.id)
}

fn blob_key(d: &Sha256Digest) -> String {
    format!("blobs/sha256/{}", d.hex())
}

/// The layer manifests a provenance blob names (`image.layer_manifests[].manifest`).
fn provenance_manifests(bytes: &[u8]) -> Vec<Sha256Digest> {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(bytes) else { return Vec::new() };
    let list = v.pointer("/image/layer_manifests").and_then(|l| l.as_array()).cloned().unwrap_or_default();
    list.iter().filter_map(|l| l.get("manifest")?.as_str()?.parse::<Sha256Digest>().ok()).collect()
}

struct Collector<'a, B: GcBackend> {
    backend: &'a B,
    live: HashSet<Sha256Digest>,
    roles: HashMap<Sha256Digest, &'static str>,
}

impl<B: GcBackend> Collector<'_, B> {
    fn mark(&mut self, d: Sha256Digest, role: &'static str) {
        self.live.insert(d);
        self.roles.entry(d).or_insert(role);
    }

    /// A blob, read whole and checked against its digest; `None` if missing.
    fn blob(&self, d: &Sha256Digest, what: &'static str) -> Result<Option<Vec<u8>>, StoreError> {
        let key = blob_key(d);
        let Some(bytes) = self.backend.read(&key)? else { return Ok(None) };
        StoreError::check_sha256(what, d, &bytes, || key.clone().into())?;
        Ok(Some(bytes))
    }

    /// The data blobs (packs or layers) of pack index `d`.
    fn data_blobs(&self, d: &Sha256Digest) -> Result<Option<(Vec<Sha256Digest>, &'static str)>, StoreError> {
        let Some(bytes) = self.blob(d, "pack index")? else { return Ok(None) };
        let index = AnyPackIndex::decode(&bytes).map_err(|source| StoreError::Decode {
            what: "pack index",
            digest: *d,
            source,
        })?;
        let role = if matches!(index, AnyPackIndex::Reference(_)) { "layer" } else { "pack" };
        Ok(Some((index.data_blobs(), role)))
    }
}

/// Collect the garbage of the store behind `backend`.
pub fn collect_garbage<B: GcBackend>(
    backend: &mut B,
    options: &GcOptions,
) -> Result<StoreGcReport, StoreError> {
    if !backend.locked() && options.grace < MIN_UNLOCKED_GRACE {
        return Err(StoreError::BadSetting {
            name: "--grace".into(),
            value: format!("{}s", options.grace.as_secs()),
            expected: "at least 10m on a store without a writer lock (s3://): the grace is what protects a copy in flight",
        });
    }
    let pinned: HashSet<ImageId> = backend.pinned()?.into_iter().collect();
    let backend = &*backend;
    let young = |o: &StoreObject| {
        o.modified.is_none_or(|m| options.now.duration_since(m).unwrap_or(Duration::ZERO) < options.grace)
    };
    let mut report = StoreGcReport {
        store: backend.describe(),
        grace_seconds: options.grace.as_secs(),
        dry_run: options.dry_run,
        ..StoreGcReport::default()
    };
    // Blobs are listed first: a blob written after this listing is not a candidate at all.
    let blobs = backend.list("blobs/sha256/")?;
    let refs = backend.list("refs/")?;
    let entries = backend.list("images/")?;
    let layers = backend.list("layers/")?;
    let sources = backend.list("sources/")?;

    let mut images: HashMap<ImageId, &StoreObject> = HashMap::new();
    for o in &entries {
        let Some(hex) = o.key.strip_prefix("images/").and_then(|n| n.strip_suffix(".json")) else { continue };
        if let Ok(d) = Sha256Digest::from_hex(hex) {
            images.insert(ImageId(d), o);
        }
    }
    let mut tagged: HashSet<ImageId> = HashSet::new();
    let mut dead_refs = Vec::new();
    for o in &refs {
        let Some(tag) = o.key.strip_prefix("refs/") else { continue };
        if !tessera_image::validate_tag(tag) {
            continue;
        }
        let Some(bytes) = backend.read(&o.key)? else { continue };
        match parse_ref(&bytes) {
            Some(id) if images.contains_key(&id) => {
                tagged.insert(id);
                report.tags_kept += 1;
            }
            Some(id) if young(o) => {
                debug!(tag, image = %id, "keeping a young tag whose image is missing");
                report.young.add(o.len);
            }
            Some(id) => {
                debug!(tag, image = %id, "tag of a missing image");
                dead_refs.push(o);
            }
            None => warn!(key = o.key, "leaving a ref that cannot be parsed alone"),
        }
    }

    let mut c = Collector { backend, live: HashSet::new(), roles: HashMap::new() };
    let mut dead_images = Vec::new();
    let mut kept_images: HashSet<ImageId> = HashSet::new();
    let mut live_manifests: HashSet<Sha256Digest> = HashSet::new();
    let mut ids: Vec<_> = images.keys().copied().collect();
    ids.sort();
    for id in ids {
        let o = images[&id];
        let root = tagged.contains(&id) || pinned.contains(&id) || options.keep_untagged;
        let is_young = !root && young(o);
        let entry_bytes = backend.read(&o.key)?;
        let entry = entry_bytes.as_deref().map(ImageEntry::from_json);
        if !root && !is_young {
            // Dead: learn the roles of its blobs for the report (best effort).
            if let Some(Ok(e)) = &entry {
                for (d, role) in entry_blobs(e) {
                    c.roles.entry(d).or_insert(role);
                }
                if let Ok(Some((data, role))) = c.data_blobs(&e.pack_index) {
                    for d in data {
                        c.roles.entry(d).or_insert(role);
                    }
                }
            }
            dead_images.push(o);
            continue;
        }
        if is_young {
            report.young.add(o.len);
        }
        let entry = match entry {
            Some(Ok(e)) => e,
            None => continue, // removed under us (only without the writer lock)
            Some(Err(source)) => return Err(StoreError::BadEntry { path: o.key.clone().into(), source }),
        };
        report.images_kept += 1;
        kept_images.insert(id);
        if pinned.contains(&id) {
            report.images_pinned += 1;
        }
        for (d, role) in entry_blobs(&entry) {
            c.mark(d, role);
        }
        match c.data_blobs(&entry.pack_index)? {
            Some((data, role)) => data.into_iter().for_each(|d| c.mark(d, role)),
            None => {
                warn!(image = %id, pack_index = %entry.pack_index, "a live image's pack index is missing")
            }
        }
        if let Some(p) = entry.provenance {
            if let Ok(Some(bytes)) = c.blob(&p, "provenance") {
                live_manifests.extend(provenance_manifests(&bytes));
            }
        }
    }

    let mut dead_layers = Vec::new();
    for o in &layers {
        if !o.key.ends_with(".json") {
            continue;
        }
        let record = backend.read(&o.key)?.and_then(|b| serde_json::from_slice::<LayerRecord>(&b).ok());
        let live = record.as_ref().is_some_and(|r| live_manifests.contains(&r.manifest));
        if !live && !young(o) {
            if let Some(r) = &record {
                c.roles.entry(r.manifest).or_insert("layer-manifest");
                c.roles.entry(r.pack_index).or_insert("pack-index");
            }
            dead_layers.push(o);
            continue;
        }
        if !live {
            report.young.add(o.len);
        }
        let Some(r) = record else { continue };
        c.mark(r.manifest, "layer-manifest");
        c.mark(r.pack_index, "pack-index");
        // A layer record's index names packs that may be no live image's.
        if let Some((data, role)) = c.data_blobs(&r.pack_index)? {
            data.into_iter().for_each(|d| c.mark(d, role));
        }
    }

    // A source record (a directory build's index for its next build, `.json`) and its index
    // (`.idx`, not a blob) live as long as the record's image.
    let mut dead_sources = Vec::new();
    let mut live_source_names: HashSet<&str> = HashSet::new();
    for o in sources.iter().filter(|o| o.key.ends_with(".json")) {
        let record = backend.read(&o.key)?.and_then(|b| serde_json::from_slice::<SourceRecord>(&b).ok());
        let live = record.as_ref().is_some_and(|r| kept_images.contains(&ImageId(r.image)));
        if live || young(o) {
            if !live {
                report.young.add(o.len);
            }
            live_source_names.insert(o.key.trim_end_matches(".json"));
        } else {
            dead_sources.push((o, "source-record"));
        }
    }
    for o in sources.iter().filter(|o| o.key.ends_with(".idx")) {
        if live_source_names.contains(o.key.trim_end_matches(".idx")) {
            report.live.add(o.len);
        } else if young(o) {
            report.young.add(o.len);
        } else {
            dead_sources.push((o, "source-index"));
        }
    }

    let mut dead_blobs = Vec::new();
    for o in &blobs {
        let Some(d) = o.key.strip_prefix("blobs/sha256/").and_then(|h| Sha256Digest::from_hex(h).ok()) else {
            continue;
        };
        if c.live.contains(&d) {
            report.live.add(o.len);
        } else if young(o) {
            report.young.add(o.len);
        } else {
            dead_blobs.push((o, c.roles.get(&d).copied().unwrap_or("unreferenced")));
        }
    }

    // Sweep: tags, entries, layer records, blobs (the reverse of the write order).
    let mut sweep = |o: &StoreObject, kind: &'static str| -> Result<(), StoreError> {
        if !options.dry_run {
            backend.delete(&o.key)?;
        }
        report.note(Removed { key: o.key.clone(), kind, bytes: o.len });
        Ok(())
    };
    for o in dead_refs {
        sweep(o, "tag")?;
    }
    for o in &dead_images {
        sweep(o, "image")?;
    }
    for o in dead_layers {
        sweep(o, "layer-record")?;
    }
    for (o, kind) in dead_sources {
        sweep(o, kind)?;
    }
    for (o, kind) in dead_blobs {
        sweep(o, kind)?;
    }
    report.tags_removed = report.removed.get("tag").map_or(0, |t| t.count);
    report.images_removed = dead_images.len() as u64;
    info!(
        store = report.store,
        removed = report.removed_total.count,
        bytes = report.removed_total.bytes,
        dry_run = options.dry_run,
        "store gc"
    );
    Ok(report)
}

fn entry_blobs(e: &ImageEntry) -> Vec<(Sha256Digest, &'static str)> {
    let mut out = vec![(e.record, "record"), (e.prefix, "prefix"), (e.pack_index, "pack-index")];
    out.extend(e.profile.map(|p| (p, "profile")));
    out.extend(e.provenance.map(|p| (p, "provenance")));
    out
}

// ---- local stores ------------------------------------------------------------------------------

/// The lock file writers hold shared and gc holds exclusively.
pub(crate) const LOCK_FILE: &str = "gc.lock";
/// Where running readers pin images.
pub(crate) const PINS: &str = "pins";

fn flock(file: &File, op: rustix::fs::FlockOperation) -> std::io::Result<()> {
    loop {
        match rustix::fs::flock(file, op) {
            Err(rustix::io::Errno::INTR) => continue,
            other => return other.map_err(Into::into),
        }
    }
}

/// Take the store's lock at `root` (shared for writers, exclusive for gc), waiting for it (and
/// saying so in the log).
pub(crate) fn lock_store(root: &Path, exclusive: bool) -> Result<File, StoreError> {
    use rustix::fs::FlockOperation as F;
    let path = root.join(LOCK_FILE);
    // Held open read-only (flock needs no write access), so that holding it never keeps a
    // filesystem from being remounted read-only.
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
                .map_err(|e| StoreError::write("create the store lock", &path, e))?;
            File::open(&path).map_err(|e| StoreError::read("open the store lock", &path, e))?
        }
        Err(e) => return Err(StoreError::read("open the store lock", &path, e)),
    };
    let (try_op, op) = if exclusive {
        (F::NonBlockingLockExclusive, F::LockExclusive)
    } else {
        (F::NonBlockingLockShared, F::LockShared)
    };
    match flock(&file, try_op) {
        Ok(()) => return Ok(file),
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        Err(e) => return Err(StoreError::write("lock the store", &path, e)),
    }
    if exclusive {
        warn!(store = %root.display(), "waiting for the store's writers (build, copy, profile) to finish");
    } else {
        warn!(store = %root.display(), "waiting for `tessera store gc` to finish");
    }
    flock(&file, op).map_err(|e| StoreError::write("lock the store", &path, e))?;
    Ok(file)
}

/// A pin on an image of a local store: while it is held (a shared `flock` on a file in
/// `pins/`), `tessera store gc` keeps the image. Dropping it releases the pin; a process that
/// dies releases it too (its file is removed by the next gc).
#[derive(Debug)]
pub struct ImagePin {
    _file: File,
    path: PathBuf,
}

impl Drop for ImagePin {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

impl ImagePin {
    /// Pin image `id` of the store at `root`. The file is locked before it appears under its name
    /// in `pins/`, so gc never sees an unlocked pin that is about to be taken.
    pub(crate) fn new(root: &Path, id: &ImageId) -> Result<Self, StoreError> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let dir = root.join(PINS);
        match fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(StoreError::write("create pins directory", &dir, e)),
        }
        let nanos =
            SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let stem = format!("{}.{}-{nanos:x}-{n}", id.digest().hex(), std::process::id());
        let tmp = dir.join(format!(".{stem}.new"));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| StoreError::write("create pin", &tmp, e))?;
        flock(&file, rustix::fs::FlockOperation::LockShared)
            .map_err(|e| StoreError::write("lock pin", &tmp, e))?;
        let path = dir.join(format!("{stem}.pin"));
        if let Err(e) = fs::rename(&tmp, &path) {
            let _ = fs::remove_file(&tmp);
            return Err(StoreError::write("create pin", &path, e));
        }
        debug!(image = %id, pin = %path.display(), "pinned image");
        Ok(Self { _file: file, path })
    }
}

/// A local store collected under its exclusive lock.
#[derive(Debug)]
pub struct LocalGc {
    store: LocalStore,
    _lock: File,
    dry_run: bool,
}

impl LocalGc {
    /// Open the store at `path` for collection, waiting for its writers to finish and keeping
    /// new ones out until dropped. A read-only store is [`StoreError::ReadOnly`].
    pub fn open(path: &Path, dry_run: bool) -> Result<Self, StoreError> {
        let store = LocalStore::open(path)?;
        let lock = lock_store(store.root(), true)?;
        Ok(Self { store, _lock: lock, dry_run })
    }
}

fn modified(m: &fs::Metadata) -> Option<SystemTime> {
    m.modified().ok()
}

impl GcBackend for LocalGc {
    fn describe(&self) -> String {
        self.store.root().display().to_string()
    }

    fn list(&self, dir: &str) -> Result<Vec<StoreObject>, StoreError> {
        let path = self.store.root().join(dir);
        let entries = match fs::read_dir(&path) {
            Ok(e) => e,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(StoreError::read("list", &path, e)),
        };
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| StoreError::read("list", &path, e))?;
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else { continue };
            let Ok(meta) = entry.metadata() else { continue };
            if !meta.is_file() {
                continue;
            }
            out.push(StoreObject { key: format!("{dir}{name}"), len: meta.len(), modified: modified(&meta) });
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    fn read(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let path = self.store.root().join(key);
        match fs::read(&path) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::read("read", &path, e)),
        }
    }

    fn delete(&self, key: &str) -> Result<(), StoreError> {
        let path = self.store.root().join(key);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::write("remove", &path, e)),
        }
    }

    fn pinned(&mut self) -> Result<Vec<ImageId>, StoreError> {
        use rustix::fs::FlockOperation as F;
        let dir = self.store.root().join(PINS);
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(StoreError::read("list pins", &dir, e)),
        };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let path = entry.path();
            if name.starts_with('.') {
                // A pin being created (locked, then renamed); left by a crash if old.
                let old = entry
                    .metadata()
                    .ok()
                    .and_then(|m| m.modified().ok())
                    .and_then(|t| SystemTime::now().duration_since(t).ok())
                    .is_some_and(|d| d > Duration::from_secs(3600));
                if old && !self.dry_run {
                    let _ = fs::remove_file(&path);
                }
                continue;
            }
            let Some(id) = name.get(..64).and_then(|h| Sha256Digest::from_hex(h).ok()).map(ImageId) else {
                continue;
            };
            let Ok(file) = File::open(&path) else { continue };
            match flock(&file, F::NonBlockingLockExclusive) {
                Err(e) if e.kind() == ErrorKind::WouldBlock => out.push(id),
                Err(e) => return Err(StoreError::read("check pin", &path, e)),
                Ok(()) => {
                    // Nobody holds it: its process is gone.
                    debug!(pin = %path.display(), "removing a stale pin");
                    if !self.dry_run {
                        let _ = fs::remove_file(&path);
                    }
                }
            }
        }
        out.sort();
        out.dedup();
        Ok(out)
    }

    fn locked(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_image::ImageEntry;

    /// A store with an image whose pack index names one pack; returns (id, entry).
    fn image(store: &LocalStore, seed: &str) -> (ImageId, ImageEntry) {
        let pack = store.put_blob(format!("pack {seed}").as_bytes()).unwrap();
        let index = tessera_image::PackIndex::new(vec![pack], Vec::new());
        let pack_index = store.put_blob(&index.encode()).unwrap();
        let prefix = store.put_blob(format!("prefix {seed}").as_bytes()).unwrap();
        let record_bytes = format!("record {seed}");
        let record = store.put_blob(record_bytes.as_bytes()).unwrap();
        let entry = ImageEntry { record, prefix, pack_index, profile: None, provenance: None };
        let id = ImageId(record);
        store.put_entry(&id, &entry).unwrap();
        (id, entry)
    }

    fn later(hours: u64) -> GcOptions {
        GcOptions { now: SystemTime::now() + Duration::from_secs(hours * 3600), ..GcOptions::default() }
    }

    #[test]
    fn collects_untagged_images_and_orphans_keeps_tagged_young_and_pinned() {
        let dir = tempfile::tempdir().unwrap();
        let (kept, gone, pinned);
        {
            let store = LocalStore::create_or_open(dir.path()).unwrap();
            kept = image(&store, "a");
            gone = image(&store, "b");
            pinned = image(&store, "c");
            store.set_ref("web", &kept.0).unwrap();
            store.put_blob(b"orphan").unwrap();
        }
        let store = LocalStore::open(dir.path()).unwrap();
        let pin = store.pin(&pinned.0).unwrap();
        // Everything is younger than the grace: nothing goes.
        let mut gc = LocalGc::open(dir.path(), false).unwrap();
        let r = collect_garbage(&mut gc, &GcOptions::default()).unwrap();
        assert_eq!(r.removed_total.count, 0, "{r:?}");
        assert_eq!(r.images_kept, 3);
        // Two hours later, a dry run says what would go and removes nothing.
        let dry = collect_garbage(&mut gc, &GcOptions { dry_run: true, ..later(2) }).unwrap();
        let r = collect_garbage(&mut gc, &later(2)).unwrap();
        assert_eq!(dry.objects, r.objects);
        assert_eq!((r.images_kept, r.images_removed, r.images_pinned), (2, 1, 1));
        let kinds: Vec<_> = r.objects.iter().map(|o| o.kind).collect();
        assert_eq!(kinds[0], "image");
        for k in ["record", "prefix", "pack-index", "pack", "unreferenced"] {
            assert!(kinds.contains(&k), "{k}: {kinds:?}");
        }
        assert_eq!(r.removed_total.count, 6);
        assert!(!store.has_image(&gone.0).unwrap());
        assert!(!store.has_blob(&gone.1.prefix).unwrap());
        for (id, e) in [&kept, &pinned] {
            assert!(store.has_image(id).unwrap());
            for d in [e.record, e.prefix, e.pack_index] {
                assert!(store.has_blob(&d).unwrap());
            }
        }
        // The pin released: the untagged image goes too; a tag of a missing image goes.
        drop(pin);
        std::fs::write(dir.path().join("refs/stale"), format!("{}\n", gone.0)).unwrap();
        let r = collect_garbage(&mut gc, &later(2)).unwrap();
        assert_eq!((r.images_removed, r.tags_removed), (1, 1), "{r:?}");
        assert!(store.has_image(&kept.0).unwrap());
        assert!(std::fs::read_dir(dir.path().join(PINS)).unwrap().next().is_none(), "no pin left");
        // keep_untagged: an untagged image stays.
        drop(gc);
        let extra = {
            let w = LocalStore::create_or_open(dir.path()).unwrap();
            image(&w, "d")
        };
        let mut gc = LocalGc::open(dir.path(), false).unwrap();
        let r = collect_garbage(&mut gc, &GcOptions { keep_untagged: true, ..later(2) }).unwrap();
        assert_eq!(r.removed_total.count, 0);
        assert!(store.has_image(&extra.0).unwrap());
    }

    #[test]
    fn a_live_image_whose_pack_index_is_corrupt_stops_gc_before_anything_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let kept = {
            let store = LocalStore::create_or_open(dir.path()).unwrap();
            let kept = image(&store, "a");
            store.set_ref("web", &kept.0).unwrap();
            store.put_blob(b"orphan").unwrap();
            kept
        };
        std::fs::write(dir.path().join(blob_key(&kept.1.pack_index)), b"garbage").unwrap();
        let mut gc = LocalGc::open(dir.path(), false).unwrap();
        let e = collect_garbage(&mut gc, &later(2)).unwrap_err();
        assert!(matches!(e, StoreError::Corrupt { .. }), "{e}");
        assert!(dir.path().join(blob_key(&Sha256Digest::of(b"orphan"))).exists());
    }

    #[test]
    fn writers_wait_for_gc() {
        let dir = tempfile::tempdir().unwrap();
        drop(LocalStore::create_or_open(dir.path()).unwrap());
        let gc = LocalGc::open(dir.path(), false).unwrap();
        let path = dir.path().to_owned();
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            let s = LocalStore::create_or_open(&path).unwrap();
            tx.send(()).unwrap();
            drop(s);
        });
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "the writer waits");
        drop(gc);
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
        t.join().unwrap();
    }
}
