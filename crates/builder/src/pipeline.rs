//! The build pipeline: walk → chunk and pack → synthesize ext4 → BlockMap → record → store.

use std::collections::HashMap;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use tessera_ext4::{MetadataRun, NodeKind, Options, PlacedExtent, SizePolicy, Tree};
use tessera_image::{
    BlockMap, BlockMapBuilder, BlockSize, BuildOptions, ChunkId, ChunkRef, Geometry, ImageEntry, ImageId,
    ImageRecord, ImageStats, PackIndexEncoder, PrefixInfo, RuntimeConfig, Sha256Digest,
};
use tessera_store::{BlobWriter, LocalStore};
use tracing::{debug, info};

use crate::chunk::{chunk_tree, ChunkOutput, Reuse};
use crate::error::BuildError;
use crate::seed::tree_seed;
use crate::source::{open_docker_archive, open_oci_layout, open_registry, Platform, SourceSpec};
use crate::source_index::{SourceIndex, SourceIndexEncoder};
use crate::walk::walk_dir;
use crate::Progress;

/// Default chunk size: 512 KiB.
pub const DEFAULT_CHUNK_SIZE: u32 = 512 * 1024;
/// zstd level of the stored metadata prefix.
const PREFIX_ZSTD_LEVEL: i32 = 3;
/// Filesystem time used when no source date is given: 2024-01-01T00:00:00Z.
pub const DEFAULT_FS_TIME: i64 = 1_704_067_200;

/// The filesystem time T: `source_date_epoch` (the caller's `SOURCE_DATE_EPOCH`; this library
/// reads no environment) clamped to now, else [`DEFAULT_FS_TIME`]. Never a file time, so a file
/// dated 2100 cannot put the superblock in the future.
pub fn fs_time(source_date_epoch: Option<i64>) -> i64 {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    match source_date_epoch {
        Some(t) => t.clamp(0, now),
        None => DEFAULT_FS_TIME.min(now),
    }
}

/// Build options.
#[derive(Debug, Clone)]
pub struct BuildConfig {
    /// Chunk size, a power of two from 64 KiB to 16 MiB.
    pub chunk_size: u32,
    /// Device size policy (default: enough for the tree plus max(256 MiB, 25% of data) free).
    pub size: SizePolicy,
    /// Minimum total inodes (default: used + max(4096, 25% of used)).
    pub inodes: Option<u64>,
    /// Filesystem time T (default: [`fs_time`]`(None)`).
    pub fs_time: i64,
    /// Text recorded as the source in the provenance blob (not part of the ID).
    pub source_ref: String,
    /// Limit on the uncompressed bytes of all layers together (`--max-size`; image sources only).
    pub max_size: Option<u64>,
    /// Keep file data in the source image's gzip layers (`--reference-layers`; OCI layouts only):
    /// the store gets the layer blobs as they are and a reference pack index.
    pub reference_layers: bool,
    /// Read every file of a directory source, even those the store's record of the previous build
    /// of the same directory lists as unchanged (`--reread`).
    pub reread: bool,
    /// Called once the content is chunked and what only chunking needed is freed, before ext4
    /// is synthesized (where a build peaks): the binary returns the freed memory to the system
    /// (glibc keeps it otherwise: tens of MiB at a million entries). The library allocates no
    /// differently either way.
    pub release_memory: Option<fn()>,
}

impl Default for BuildConfig {
    fn default() -> Self {
        Self {
            chunk_size: DEFAULT_CHUNK_SIZE,
            size: SizePolicy::Free(None),
            inodes: None,
            fs_time: fs_time(None),
            source_ref: String::new(),
            max_size: None,
            reference_layers: false,
            reread: false,
            release_memory: None,
        }
    }
}

/// What a build produced.
#[derive(Debug, Clone)]
pub struct BuildOutput {
    pub id: ImageId,
    pub record: ImageRecord,
    pub entry: ImageEntry,
    /// Chunks written by this build (not already in the store).
    pub new_chunks: u64,
    pub new_stored_bytes: u64,
    /// Directory sources: the files taken unread from the previous build's source index.
    pub reused: Reuse,
}

pub(crate) fn check_chunk_size(size: u32) -> Result<(), BuildError> {
    if !size.is_power_of_two() || !(64 * 1024..=16 * 1024 * 1024).contains(&size) {
        return Err(BuildError::BadChunkSize(u64::from(size)));
    }
    Ok(())
}

/// The version of the directory walk's rules (what a file's chunks are, how its fingerprint is
/// made) behind a source index; an index made with another is not used.
pub const SOURCE_READER_VERSION: u32 = 1;

/// Build the directory `src` into `store`. Writes blobs, then the image entry; tagging is the
/// caller's (after this returns, so a ref never points at a missing entry).
///
/// A build leaves a source index in the store (`sources/`, `docs/formats/source-index.md`): the
/// next build of the same directory with the same chunk size reads only the files whose inode,
/// size, mtime or ctime changed, unless `config.reread`.
pub fn build_dir(
    src: &Path,
    store: &LocalStore,
    config: &BuildConfig,
    progress: &dyn Progress,
) -> Result<BuildOutput, BuildError> {
    check_chunk_size(config.chunk_size)?;
    let source = walk_dir(src)?;
    info!(nodes = source.tree.nodes.len(), "walked source tree");
    // Keyed by the directory's canonical path: another directory never uses this index.
    let canonical = std::fs::canonicalize(src).map_err(BuildError::io(src, "resolve the source path"))?;
    let key = blake3::hash(canonical.as_os_str().as_encoded_bytes()).to_hex()[..32].to_owned();
    let previous = if config.reread { None } else { previous_index(store, &key, config.chunk_size) };
    let existing = store.known_chunks()?;
    debug!(chunks = existing.len(), "chunks already in the store");
    let mut chunks =
        chunk_tree(&source, store, existing, u64::from(config.chunk_size), previous.as_ref(), progress)?;
    drop(previous);
    info!(
        new_chunks = chunks.new_chunks,
        new_bytes = chunks.new_stored_bytes,
        unchanged_files = chunks.reused.files,
        unchanged_bytes = chunks.reused.bytes,
        "chunked file content"
    );
    let pack_index = image_pack_index(&mut chunks, store)?;
    let index = write_source_index(&source, &chunks.files, &key, config.chunk_size, store)?;
    // Where each chunk is stored (~60 bytes a chunk) and the source paths (~20 bytes an entry)
    // are written or used: gone before ext4 is synthesized, where the build peaks.
    // (Dropped by name: fields a destructuring leaves unbound would live to the end of the scope.)
    let ChunkOutput { files, homes, new_chunks, new_stored_bytes, reused, .. } = chunks;
    drop(homes);
    let tree = source.into_tree();
    let runtime = RuntimeConfig::default();
    let mut out =
        finish_image_with(&tree, &files, store, config, runtime, serde_json::Value::Null, |_, _| {
            Ok(pack_index)
        })?;
    out.new_chunks = new_chunks;
    out.new_stored_bytes = new_stored_bytes;
    out.reused = reused;
    // Only a cache for the next build: the image is complete without it.
    let record = tessera_store::SourceRecord {
        reader: SOURCE_READER_VERSION,
        path: canonical.to_string_lossy().into_owned(),
        index,
        image: out.id.0,
    };
    if let Err(e) = store.put_source_record(&key, config.chunk_size, &record) {
        tracing::warn!(error = %e, "could not record the source index: the next build reads every file");
    }
    Ok(out)
}

/// The source index of the previous build of the directory keyed `key`, if the store has a
/// usable one (any problem with it only means every file is read).
fn previous_index(store: &LocalStore, key: &str, chunk_size: u32) -> Option<SourceIndex> {
    let record = match store.source_record(key, chunk_size) {
        Ok(Some(r)) if r.reader == SOURCE_READER_VERSION => r,
        Ok(_) => return None,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the source record: reading every file");
            return None;
        }
    };
    let index = match store.read_source_index(key, chunk_size, &record) {
        Ok(Some(bytes)) => SourceIndex::decode(bytes).map_err(|e| e.to_string()),
        Ok(None) => return None,
        Err(e) => Err(e.to_string()),
    };
    match index {
        Ok(index) if index.chunk_size() == chunk_size => {
            debug!(files = index.files(), index = %record.index, "using the previous build's source index");
            Some(index)
        }
        Ok(_) => None,
        Err(error) => {
            tracing::warn!(%error, index = %record.index, "ignoring the previous build's source index");
            None
        }
    }
}

/// Write the source index of this build (each regular file's fingerprint and chunks) for the
/// directory keyed `key`.
fn write_source_index(
    source: &crate::walk::SourceTree,
    files: &[crate::seed::FileChunks],
    key: &str,
    chunk_size: u32,
    store: &LocalStore,
) -> Result<Sha256Digest, BuildError> {
    let mut encoder = SourceIndexEncoder::new(chunk_size);
    for (node, chunks) in files.iter().enumerate() {
        if source.has_path(node) && !chunks.is_empty() {
            encoder.add(source.stamp(node), node as u32);
        }
    }
    let mut writer = store.source_index_writer()?;
    encoder.finish(
        |node| files.get(node as usize).map_or(&[][..], |c| &c[..]),
        |piece| writer.append(piece).map(|_| ()),
    )?;
    Ok(store.commit_source_index(key, chunk_size, writer)?)
}

/// Seal `chunks`' homes and write the image's pack index: every chunk of its files, packs numbered
/// by first use in file order.
pub(crate) fn image_pack_index(
    chunks: &mut ChunkOutput,
    store: &LocalStore,
) -> Result<Sha256Digest, BuildError> {
    chunks.homes.seal();
    write_pack_index(chunks.files.iter().flatten().map(|c| (c.1, c.2)), chunks, store)
}

/// Plan the image (ext4 layout, block map, record, pack index), then write its blobs and entry.
pub(crate) fn finish_image(
    tree: &Tree,
    chunks: &mut ChunkOutput,
    store: &LocalStore,
    config: &BuildConfig,
    runtime: RuntimeConfig,
    source_provenance: serde_json::Value,
) -> Result<BuildOutput, BuildError> {
    let pack_index = image_pack_index(chunks, store)?;
    let mut out =
        finish_image_with(tree, &chunks.files, store, config, runtime, source_provenance, |_, _| {
            Ok(pack_index)
        })?;
    out.new_chunks = chunks.new_chunks;
    out.new_stored_bytes = chunks.new_stored_bytes;
    Ok(out)
}

/// [`finish_image`] with the pack index blob written by `pack_index` from the record and the image
/// ID (a reference pack index for `--reference-layers`), or before (a plain one: it needs neither).
pub(crate) fn finish_image_with(
    tree: &Tree,
    files: &[crate::seed::FileChunks],
    store: &LocalStore,
    config: &BuildConfig,
    runtime: RuntimeConfig,
    source_provenance: serde_json::Value,
    pack_index: impl FnOnce(&ImageRecord, ImageId) -> Result<Sha256Digest, BuildError>,
) -> Result<BuildOutput, BuildError> {
    if let Some(release) = config.release_memory {
        release();
    }
    let seed = tree_seed(tree, files);
    let options = Options {
        size: config.size,
        inodes: config.inodes,
        fs_time: config.fs_time,
        seed,
        label: Vec::new(),
    };
    let mut prefix = PrefixSink::new(store)?;
    let fs = tessera_ext4::synthesize_into(tree, &options, &mut prefix)?;
    let g = &fs.geometry;
    info!(blocks = g.blocks, inodes = g.inodes, data_start = g.data_start_block, "synthesized ext4");

    let mut map = BlockMap::builder(g.blocks);
    let prefix = prefix.finish(&mut map)?;
    push_file_data(&mut map, &fs.placements, files)?;
    let geometry = fs.geometry;
    drop(fs);
    let record = ImageRecord {
        options: BuildOptions { chunk_size: config.chunk_size },
        geometry,
        stats: tree_stats(tree, &geometry, files),
        prefix: PrefixInfo { digest: prefix.digest, blocks: prefix.blocks },
        block_map: map.finish()?,
        config: runtime,
    };
    let id = ImageId(Sha256Digest::of(&record.encode()));
    let pack_index = pack_index(&record, id)?;
    let (id, entry) = write_image(store, config, &record, prefix.stored, pack_index, source_provenance)?;
    Ok(BuildOutput { id, record, entry, new_chunks: 0, new_stored_bytes: 0, reused: Reuse::default() })
}

/// The metadata prefix: every non-zero metadata block, concatenated in device order.
struct Prefix {
    /// sha256 of the uncompressed prefix.
    digest: Sha256Digest,
    blocks: u64,
    /// The stored (compressed) prefix's blob.
    stored: Sha256Digest,
}

/// Takes the metadata runs as ext4 renders them, in device order, and hands them to a thread that
/// hashes and zstd-compresses each into a blob of the store while the synthesis goes on: neither
/// the uncompressed prefix (256 bytes per inode plus every directory block) nor the compressed one
/// (~70 MB at a million entries) is held, only where each run goes and the runs on their way
/// (at most [`PREFIX_RUNS_QUEUED`] beside the one being compressed).
struct PrefixSink<'a> {
    store: &'a Path,
    runs_tx: Option<std::sync::mpsc::SyncSender<Vec<u8>>>,
    compressor: Option<std::thread::JoinHandle<std::io::Result<(Sha256Digest, BlobWriter)>>>,
    /// (first device block, blocks, first prefix block) of each run.
    runs: Vec<(u64, u64, u64)>,
    blocks: u64,
}

/// Metadata runs (each at most the ext4 renderer's run size) waiting for the prefix's compressor.
const PREFIX_RUNS_QUEUED: usize = 2;

impl<'a> PrefixSink<'a> {
    fn new(store: &'a LocalStore) -> Result<Self, BuildError> {
        let mut z = zstd::stream::Encoder::new(store.blob_writer()?, PREFIX_ZSTD_LEVEL)
            .map_err(BuildError::io(store.root(), "compress prefix"))?;
        let (runs_tx, runs) = std::sync::mpsc::sync_channel::<Vec<u8>>(PREFIX_RUNS_QUEUED);
        let compressor = std::thread::Builder::new()
            .name("prefix".into())
            .spawn(move || {
                use sha2::Digest as _;
                use std::io::Write as _;
                let mut sha = sha2::Sha256::new();
                // On a failure the receiver goes: the sink stops sending, and `finish` reports it.
                for run in runs {
                    sha.update(&run);
                    z.write_all(&run)?;
                }
                Ok((Sha256Digest(sha.finalize().into()), z.finish()?))
            })
            .map_err(BuildError::io(store.root(), "start the prefix compressor"))?;
        Ok(Self {
            store: store.root(),
            runs_tx: Some(runs_tx),
            compressor: Some(compressor),
            runs: Vec::new(),
            blocks: 0,
        })
    }

    /// Map the prefix runs into `map` and finish the compressed prefix.
    fn finish(mut self, map: &mut BlockMapBuilder) -> Result<Prefix, BuildError> {
        // The compressor writes straight into the prefix's blob: a full or read-only store is
        // told as such (`StoreError::write` classifies the errno), as `put_blob` did.
        let store = self.store;
        let failed = |e| BuildError::from(tessera_store::StoreError::write("write prefix", store, e));
        drop(self.runs_tx.take());
        let (digest, blob) = match self.compressor.take().map(std::thread::JoinHandle::join) {
            Some(Ok(done)) => done.map_err(failed)?,
            _ => return Err(BuildError::Internal { what: "the prefix compressor panicked", chunk: None }),
        };
        for &(start, blocks, at) in &self.runs {
            map.push_prefix(start, blocks, at)?;
        }
        Ok(Prefix { digest, blocks: self.blocks, stored: blob.commit()? })
    }
}

impl tessera_ext4::MetadataSink for PrefixSink<'_> {
    fn put(&mut self, run: MetadataRun) {
        let blocks = run.data.len() as u64 / BlockSize::U64;
        self.runs.push((run.start_block, blocks, self.blocks));
        self.blocks += blocks;
        if let Some(tx) = &self.runs_tx {
            if tx.send(run.data).is_err() {
                // The compressor failed; `finish` says why.
                self.runs_tx = None;
            }
        }
    }
}

/// File data: intersect each file's chunks with where ext4 placed its blocks.
fn push_file_data(
    map: &mut BlockMapBuilder,
    placements: &[Vec<PlacedExtent>],
    files: &[crate::seed::FileChunks],
) -> Result<(), BuildError> {
    for (node, file_chunks) in files.iter().enumerate() {
        let placed = placements.get(node).map(Vec::as_slice).unwrap_or(&[]);
        let mut ext = 0;
        for &(offset, id, len) in file_chunks {
            let idx = map.add_chunk(id, len);
            let first = offset / BlockSize::U64;
            let end = first + u64::from(len).div_ceil(BlockSize::U64);
            let mut fb = first;
            while fb < end {
                while ext < placed.len() && placed[ext].file_block + placed[ext].blocks <= fb {
                    ext += 1;
                }
                let Some(e) = placed.get(ext).filter(|e| e.file_block <= fb) else {
                    // A chunk the ext4 layout did not place: both come from the same DataRanges,
                    // so this is a bug, reported rather than silently dropping data.
                    return Err(BuildError::Internal {
                        what: "file data chunk not placed by the ext4 layout",
                        chunk: Some(id),
                    });
                };
                let n = (e.file_block + e.blocks).min(end) - fb;
                map.push_chunk(e.device_block + (fb - e.file_block), n, idx, (fb - first) as u32)?;
                fb += n;
            }
        }
    }
    Ok(())
}

/// Write the pack index of the chunks `ids` (with their lengths; repeats allowed) into `store`
/// and give its digest: a version-2 index, aligned with the list of those chunks in order of first
/// use (the image record's chunk list, or a layer manifest's), packs numbered by first use (a
/// million-chunk index is a few MB: streamed, never held whole).
pub(crate) fn write_pack_index(
    ids: impl Iterator<Item = (ChunkId, u32)>,
    chunks: &ChunkOutput,
    store: &LocalStore,
) -> Result<Sha256Digest, BuildError> {
    /// Encoded bytes handed to the blob writer at a time.
    const PIECE: usize = 1 << 20;
    let homes = &chunks.homes;
    if !homes.is_sealed() {
        return Err(BuildError::Internal { what: "a pack index written from unsealed homes", chunk: None });
    }
    let mut used = vec![false; homes.len()];
    // Each chunk's home and length, in order of first use.
    let mut order: Vec<(u32, u32)> = Vec::new();
    let mut packs: Vec<Sha256Digest> = Vec::new();
    let mut pack_no: HashMap<Sha256Digest, u32> = HashMap::new();
    for (id, len) in ids {
        let Some(i) = homes.position(&id) else { return Err(missing_chunk(id)) };
        if std::mem::replace(&mut used[i], true) {
            continue;
        }
        order.push((u32::try_from(i).map_err(|_| missing_chunk(id))?, len));
        let digest =
            homes.at(i).and_then(|(_, home)| chunks.pack_of(home)).ok_or_else(|| missing_chunk(id))?;
        pack_no.entry(digest).or_insert_with(|| {
            packs.push(digest);
            (packs.len() - 1) as u32
        });
    }
    drop(used);
    let mut encoder = PackIndexEncoder::new(&packs, order.len());
    let mut blob = store.blob_writer()?;
    for (i, len) in order {
        let (id, home) = homes.at(i as usize).ok_or(BuildError::Internal {
            what: "a chunk's home vanished while its pack index was written",
            chunk: None,
        })?;
        let mut loc = home.location();
        loc.pack =
            chunks.pack_of(home).and_then(|d| pack_no.get(&d).copied()).ok_or_else(|| missing_chunk(*id))?;
        encoder.entry(ChunkRef { id: *id, len }, loc)?;
        if encoder.buffered() >= PIECE {
            blob.append(&encoder.take())?;
        }
    }
    blob.append(&encoder.finish()?)?;
    Ok(blob.commit()?)
}

/// Write the blobs first, then the entry (the caller writes the ref last).
fn write_image(
    store: &LocalStore,
    config: &BuildConfig,
    record: &ImageRecord,
    prefix_digest: Sha256Digest,
    pack_index_digest: Sha256Digest,
    source_provenance: serde_json::Value,
) -> Result<(ImageId, ImageEntry), BuildError> {
    let record_bytes = record.encode();
    let id = ImageId(Sha256Digest::of(&record_bytes));
    let provenance = serde_json::json!({
        "source": config.source_ref,
        "built_at": SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        "builder": concat!("tessera ", env!("CARGO_PKG_VERSION")),
        "image": source_provenance,
    });
    let provenance_digest = store.put_blob(provenance.to_string().as_bytes())?;
    let record_digest = store.put_blob(&record_bytes)?;
    let entry = ImageEntry {
        record: record_digest,
        prefix: prefix_digest,
        pack_index: pack_index_digest,
        profile: None,
        provenance: Some(provenance_digest),
    };
    store.put_entry(&id, &entry)?;
    Ok((id, entry))
}

fn missing_chunk(id: ChunkId) -> BuildError {
    BuildError::Internal { what: "a chunk of the image has no stored location", chunk: Some(id) }
}

fn tree_stats(tree: &Tree, g: &Geometry, files: &[crate::seed::FileChunks]) -> ImageStats {
    let mut s = ImageStats { inodes_used: g.inodes - g.free_inodes, ..Default::default() };
    s.data_bytes = files.iter().flatten().map(|c| u64::from(c.2)).sum();
    for node in &tree.nodes {
        match &node.kind {
            NodeKind::Directory { .. } => s.directories += 1,
            NodeKind::Regular { size, .. } => {
                s.files += 1;
                s.logical_bytes += size;
            }
            NodeKind::Symlink { .. } => s.symlinks += 1,
            _ => s.other_nodes += 1,
        }
    }
    s
}

/// Build any source: a directory, an OCI layout or a docker archive (`docker://` is not supported
/// yet). `platform` picks the image in multi-platform indexes.
pub fn build_source(
    spec: &SourceSpec,
    platform: &Platform,
    store: &LocalStore,
    config: &BuildConfig,
    progress: &dyn Progress,
) -> Result<BuildOutput, BuildError> {
    if config.reference_layers && !matches!(spec, SourceSpec::Oci { .. } | SourceSpec::Registry(_)) {
        return Err(BuildError::Unsupported {
            what: "--reference-layers builds of sources other than OCI layouts (oci:PATH) and registries (docker://)"
                .into(),
        });
    }
    let image = match spec {
        SourceSpec::Dir(path) => return build_dir(path, store, config, progress),
        SourceSpec::Oci { path, reference } => open_oci_layout(path, reference.as_deref(), platform)?,
        SourceSpec::DockerArchive { path, reference } => open_docker_archive(path, reference.as_deref())?,
        SourceSpec::Registry(r) => open_registry(r, platform)?,
        SourceSpec::Manifest(file) => {
            return crate::manifest_text::build_manifest(file, store, config, progress)
        }
    };
    crate::image::build_image(&image, store, config, progress)
}
