//! Building an OCI image (layout, docker archive or registry) from layer manifests.
//!
//! 1. Each layer whose manifest the store holds (a [`LayerRecord`] under its diff_id and the
//!    chunk size) is taken from there: its manifest and the pack index of its chunks are read,
//!    the layer itself is not.
//! 2. Every other layer is read once ([`read_layer`]): its headers become entries and each regular
//!    file's bytes go to the chunker as the stream passes them, so the layer is inflated and
//!    hashed once. That makes the layer's manifest.
//! 3. The manifests are applied in order by the [`Flattener`] (in memory), and the tree is
//!    synthesized as for any source.
//! 4. After the image entry is written, the new layers' manifests, pack indexes and records are
//!    stored, so the next build with those layers reads only the manifests.
//!
//! Up to [`READERS`] new layers are decompressed ahead at once, each into a bounded channel, and
//! consumed in layer order, so memory stays bounded whatever the layer sizes and the chunk order
//! (hence the packs) is deterministic. Chunk ids are content hashes and the flattener sees the
//! same entries either way, so the image ID does not depend on which manifests were reused, nor
//! on the layers' compression or transport.

use std::collections::{HashMap, VecDeque};
use std::io::Read;
use std::sync::atomic::AtomicU64;
use std::sync::mpsc;
use std::sync::Arc;

use tessera_image::{ChunkId, PackIndexBlob, PackLocation, Sha256Digest};
use tessera_store::{KnownChunks, LayerRecord, LocalStore};
use tracing::{debug, info, warn};

use crate::chunk::{chunk_with, Batcher, ChunkOutput, Job, JobData};
use crate::error::BuildError;
use crate::manifest::{data_ranges, ContentManifest};
use crate::pipeline::{check_chunk_size, finish_image, write_pack_index, BuildConfig, BuildOutput};
use crate::seed::FileChunks;
use crate::source::{
    read_layer, EntryKind, FlatTree, Flattener, ImageSource, LayerBlob, LayerEntry, LayerStream, SourceError,
};
use crate::Progress;

/// New layers decompressed at once.
pub const READERS: usize = 3;
/// Bytes of chunk data a layer reader may have waiting in its channel.
const READER_BUFFER: u64 = 8 << 20;
/// The version of the rules that turn a layer's tar into entries (`source/layer.rs`). Bump it
/// whenever they change what a layer yields, so that stored layer manifests made by other rules
/// are not reused (they would give another image than reading the layer).
pub const LAYER_READER_VERSION: u32 = 1;

/// A layer's manifest and where it came from.
pub(crate) struct Layer {
    pub(crate) manifest: ContentManifest,
    /// The stored record it was taken from (`None`: read by this build).
    pub(crate) reused: Option<LayerRecord>,
    pub(crate) tar_bytes: u64,
}

/// Build `source` into `store`.
pub fn build_image(
    source: &ImageSource,
    store: &LocalStore,
    config: &BuildConfig,
    progress: &dyn Progress,
) -> Result<BuildOutput, BuildError> {
    if config.reference_layers {
        return crate::reference::build_referenced(source, store, config, progress);
    }
    check_chunk_size(config.chunk_size)?;
    let mut layers: Vec<Option<Layer>> = Vec::with_capacity(source.layers.len());
    let mut homes: HashMap<ChunkId, (Sha256Digest, PackLocation)> = HashMap::new();
    let mut reused_bytes = 0u64;
    for blob in &source.layers {
        let found = reusable(store, blob, config.chunk_size)?;
        layers.push(found.map(|(record, manifest, located)| {
            for (id, pack, loc) in located {
                homes.entry(id).or_insert((pack, loc));
            }
            reused_bytes += record.tar_bytes;
            Layer { manifest, tar_bytes: record.tar_bytes, reused: Some(record) }
        }));
    }
    if let Some(limit) = config.max_size.filter(|l| reused_bytes > *l) {
        return Err(SourceError::TooLarge { what: "the layers".into(), limit }.into());
    }
    let new: Vec<usize> = (0..layers.len()).filter(|&i| layers[i].is_none()).collect();
    info!(layers = layers.len(), reused = layers.len() - new.len(), "layer manifests");
    let existing = if new.is_empty() { KnownChunks::new() } else { store.known_chunks()? };
    debug!(chunks = existing.len(), "chunks already in the store");
    let (made, mut chunks) =
        read_new_layers(&source.layers, &new, store, existing, config, reused_bytes, progress)?;
    info!(new_chunks = chunks.new_chunks, new_bytes = chunks.new_stored_bytes, "read new layers");
    for (i, layer) in new.iter().zip(made) {
        layers[*i] = Some(layer);
    }
    let layers: Vec<Layer> = layers.into_iter().flatten().collect();
    if layers.len() != source.layers.len() {
        return Err(BuildError::Internal { what: "a layer has no manifest", chunk: None });
    }
    for (id, (pack, loc)) in homes {
        chunks.add_existing(id, pack, loc)?;
    }

    let flat = flatten(&source.layers, &layers, config.fs_time)?;
    info!(nodes = flat.tree.nodes.len(), layers = layers.len(), "flattened layers");
    chunks.files = flat.files;

    // The new manifests are blobs of the image's build (written before its entry); their
    // records come after the entry, once the chunks they name are in a pack index.
    let mut digests = Vec::with_capacity(layers.len());
    for layer in &layers {
        digests.push(match &layer.reused {
            Some(r) => r.manifest,
            None => store.put_blob(&layer.manifest.encode())?,
        });
    }
    let mut provenance = source.provenance.clone();
    if let Some(obj) = provenance.as_object_mut() {
        let list: Vec<serde_json::Value> = source
            .layers
            .iter()
            .zip(&layers)
            .zip(&digests)
            .map(|((blob, layer), digest)| {
                serde_json::json!({
                    "diff_id": blob.diff_id.as_ref().map(|d| d.to_string()),
                    "manifest": digest.to_string(),
                    "reused": layer.reused.is_some(),
                })
            })
            .collect();
        obj.insert("layer_manifests".into(), list.into());
    }
    let out = finish_image(&flat.tree, &mut chunks, store, config, source.config.clone(), provenance)?;
    for ((blob, layer), digest) in source.layers.iter().zip(&layers).zip(&digests) {
        if layer.reused.is_some() {
            continue;
        }
        if let Err(e) = record_layer(store, blob, layer, *digest, &chunks, config.chunk_size) {
            // Only a cache: the image is complete without it.
            warn!(layer = %blob.name, error = %e, "could not store the layer manifest's record");
        }
    }
    Ok(out)
}

fn diff_digest(blob: &LayerBlob) -> Option<Sha256Digest> {
    blob.diff_id.as_ref().and_then(|d| d.to_string().parse().ok())
}

/// Where each chunk of a stored layer manifest is: its id, pack and place there.
type Located = Vec<(ChunkId, Sha256Digest, PackLocation)>;

/// The stored manifest of `blob`, if the store holds a usable one: made by these tar rules, every
/// chunk in its pack index with the right length, every pack present. Anything else is logged
/// and the layer is read instead.
fn reusable(
    store: &LocalStore,
    blob: &LayerBlob,
    chunk_size: u32,
) -> Result<Option<(LayerRecord, ContentManifest, Located)>, BuildError> {
    let Some(diff_id) = diff_digest(blob) else { return Ok(None) };
    let Some(record) = store.layer_record(&diff_id, chunk_size)? else { return Ok(None) };
    if record.reader != LAYER_READER_VERSION {
        debug!(layer = %blob.name, reader = record.reader, "layer manifest made by other tar rules");
        return Ok(None);
    }
    let load = || -> Result<(ContentManifest, Located), String> {
        let bytes = store.read_blob(&record.manifest).map_err(|e| e.to_string())?;
        let manifest = ContentManifest::decode(&bytes).map_err(|e| e.to_string())?;
        let bytes = store.read_blob(&record.pack_index).map_err(|e| e.to_string())?;
        let index = PackIndexBlob::decode(&bytes).map_err(|e| e.to_string())?;
        let list = manifest.chunk_list()?;
        let places = index.locate(&list).map_err(|e| e.to_string())?;
        for pack in index.packs() {
            if !store.has_blob(pack).map_err(|e| e.to_string())? {
                return Err(format!("pack {pack} is missing"));
            }
        }
        let homes = list.iter().zip(places).map(|(c, (pack, loc))| (c.id, pack, loc)).collect();
        Ok((manifest, homes))
    };
    match load() {
        Ok((manifest, index)) => {
            debug!(layer = %blob.name, manifest = %record.manifest, "reusing the layer manifest");
            Ok(Some((record, manifest, index)))
        }
        Err(why) => {
            warn!(layer = %blob.name, %why, "stored layer manifest unusable: reading the layer");
            Ok(None)
        }
    }
}

/// Store a new layer's pack index and record (its manifest blob is already stored).
fn record_layer(
    store: &LocalStore,
    blob: &LayerBlob,
    layer: &Layer,
    manifest: Sha256Digest,
    chunks: &ChunkOutput,
    chunk_size: u32,
) -> Result<(), BuildError> {
    let Some(diff_id) = diff_digest(blob) else { return Ok(()) };
    let pack_index = write_pack_index(layer.manifest.chunk_ids(), chunks, store)?;
    let record =
        LayerRecord { reader: LAYER_READER_VERSION, manifest, pack_index, tar_bytes: layer.tar_bytes };
    store.put_layer_record(&diff_id, chunk_size, &record)?;
    Ok(())
}

/// What flattening the manifests gives: the tree and each node's chunks.
pub struct Flat {
    pub tree: tessera_ext4::Tree,
    pub files: Vec<FileChunks>,
}

impl std::fmt::Debug for Flat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flat").field("nodes", &self.tree.nodes.len()).finish()
    }
}

/// Apply the layers' manifests in order and give each regular file its chunks (and the data
/// ranges they cover).
pub(crate) fn flatten(blobs: &[LayerBlob], layers: &[Layer], fs_time: i64) -> Result<Flat, BuildError> {
    let mut flattener = Flattener::new(fs_time);
    for (i, (blob, layer)) in blobs.iter().zip(layers).enumerate() {
        flattener.apply_layer(i, &blob.name, &layer.manifest.entries)?;
    }
    let manifests: Vec<&ContentManifest> = layers.iter().map(|l| &l.manifest).collect();
    attach_chunks(flattener.finish()?, &manifests)
}

/// Give each regular file of a flattened tree (whose content refs name a manifest and a file of
/// it) its chunk list, and set its data ranges to the blocks those chunks cover.
pub(crate) fn attach_chunks(flat: FlatTree, manifests: &[&ContentManifest]) -> Result<Flat, BuildError> {
    let FlatTree { mut tree, content } = flat;
    let mut files = vec![FileChunks::new(); tree.nodes.len()];
    for (node, c) in content.iter().enumerate() {
        let Some(c) = c else { continue };
        let list = manifests
            .get(c.layer)
            .and_then(|m| usize::try_from(c.offset).ok().and_then(|i| m.files.get(i)))
            .ok_or(BuildError::Internal {
                what: "a file names no chunk list of its manifest",
                chunk: None,
            })?;
        if let Some(tessera_ext4::NodeKind::Regular { data, .. }) =
            tree.nodes.get_mut(node).map(|n| &mut n.kind)
        {
            *data = data_ranges(list);
        }
        files[node] = list.clone();
    }
    Ok(Flat { tree, files })
}

enum Msg {
    Job(Job),
    Done { entries: Vec<LayerEntry>, tar_bytes: u64 },
    Failed(BuildError),
}

/// Read one layer, sending each file's chunks (node = the file's ordinal in the layer).
fn read_one(
    blob: &LayerBlob,
    budget: Option<(Arc<AtomicU64>, u64)>,
    chunk_size: u64,
    tx: &mpsc::SyncSender<Msg>,
) -> Result<(Vec<LayerEntry>, u64), BuildError> {
    let stream = LayerStream::open(blob, budget)?;
    let mut sink = |ordinal: u64, size: u64, _position: u64, data: &mut dyn Read| -> std::io::Result<()> {
        let mut done = 0u64;
        while done < size {
            let len = (size - done).min(chunk_size);
            let mut buf = vec![0u8; len as usize];
            data.read_exact(&mut buf)?;
            // chunk_size ≤ 16 MiB, so the length fits.
            let job =
                Job { node: ordinal as usize, offset: done, len: len as u32, data: JobData::Bytes(buf) };
            // The consumer gave up (an error elsewhere): stop.
            tx.send(Msg::Job(job)).map_err(|_| std::io::Error::other("the build stopped"))?;
            done += len;
        }
        Ok(())
    };
    Ok(read_layer(stream, &mut sink)?)
}

/// Read the layers `new` (indexes into `blobs`) once each, chunking every file, and return their
/// manifests in that order.
fn read_new_layers(
    blobs: &[LayerBlob],
    new: &[usize],
    store: &LocalStore,
    existing: KnownChunks,
    config: &BuildConfig,
    reused_bytes: u64,
    progress: &dyn Progress,
) -> Result<(Vec<Layer>, ChunkOutput), BuildError> {
    let chunk_size = u64::from(config.chunk_size);
    let budget = config.max_size.map(|limit| (Arc::new(AtomicU64::new(reused_bytes)), limit));
    let capacity = (READER_BUFFER / chunk_size).max(1) as usize;
    let work: Vec<&LayerBlob> = new.iter().filter_map(|&i| blobs.get(i)).collect();
    let mut read: Vec<(Vec<LayerEntry>, u64)> = Vec::with_capacity(work.len());
    let mut chunks = chunk_with(0, 0, store, existing, progress, |sink| {
        std::thread::scope(|scope| {
            let mut queue: VecDeque<mpsc::Receiver<Msg>> = VecDeque::new();
            let mut next = 0usize;
            let spawn = |next: &mut usize, queue: &mut VecDeque<mpsc::Receiver<Msg>>| {
                if let Some(&blob) = work.get(*next) {
                    let (tx, rx) = mpsc::sync_channel(capacity);
                    let budget = budget.clone();
                    scope.spawn(move || {
                        let msg = match read_one(blob, budget, chunk_size, &tx) {
                            Ok((entries, tar_bytes)) => Msg::Done { entries, tar_bytes },
                            Err(e) => Msg::Failed(e),
                        };
                        let _ = tx.send(msg);
                    });
                    queue.push_back(rx);
                    *next += 1;
                }
            };
            for _ in 0..READERS {
                spawn(&mut next, &mut queue);
            }
            let mut batch = Batcher::default();
            // Files of earlier layers: a layer's file ordinals are numbered after them.
            let mut base = 0usize;
            while let Some(rx) = queue.pop_front() {
                loop {
                    match rx.recv() {
                        Ok(Msg::Job(mut job)) => {
                            job.node += base;
                            batch.push(job, sink)?;
                        }
                        Ok(Msg::Done { entries, tar_bytes }) => {
                            let files =
                                entries.iter().filter(|e| matches!(e.kind, EntryKind::File { .. })).count();
                            read.push((entries, tar_bytes));
                            base += files;
                            break;
                        }
                        Ok(Msg::Failed(e)) => return Err(e),
                        Err(_) => {
                            return Err(BuildError::Internal {
                                what: "a layer reader thread died",
                                chunk: None,
                            })
                        }
                    }
                }
                spawn(&mut next, &mut queue);
            }
            batch.flush(sink)
        })
    })?;
    let total: usize =
        read.iter().map(|(e, _)| e.iter().filter(|e| matches!(e.kind, EntryKind::File { .. })).count()).sum();
    chunks.files.resize(total.max(chunks.files.len()), FileChunks::new());
    let mut all = std::mem::take(&mut chunks.files).into_iter();
    let mut layers = Vec::with_capacity(read.len());
    for (entries, tar_bytes) in read {
        let count = entries.iter().filter(|e| matches!(e.kind, EntryKind::File { .. })).count();
        let files: Vec<FileChunks> = all.by_ref().take(count).collect();
        layers.push(Layer { manifest: ContentManifest { entries, files }, reused: None, tar_bytes });
    }
    Ok((layers, chunks))
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;

    use sha2::{Digest as _, Sha256};
    use tessera_image::RuntimeConfig;

    use super::*;
    use crate::source::Digest;
    use crate::test_support::{device_header, tar_header as header};
    use crate::NoProgress;

    fn layer(name: &str, tar: Vec<u8>) -> LayerBlob {
        let diff_id = Digest { hex: hex::encode(Sha256::digest(&tar)) };
        let raw = Arc::new(tar);
        LayerBlob {
            name: name.into(),
            open: Box::new(move || Ok(Box::new(Cursor::new(raw.as_ref().clone())) as Box<dyn Read + Send>)),
            digest: None,
            size: None,
            diff_id: Some(diff_id),
        }
    }

    /// A base layer (every kind, a 600 KiB file of two chunks) and a top layer with a whiteout, an
    /// opaque directory, a hard link to a lower file and a replaced file.
    fn layers() -> (Vec<u8>, Vec<u8>) {
        let mut b = tar::Builder::new(Vec::new());
        let big: Vec<u8> = (0..600 * 1024u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
        b.append(&header("opt/big", tar::EntryType::Regular, big.len() as u64, 0o644), &big[..]).unwrap();
        b.append(&header("run/x", tar::EntryType::Regular, 2, 0o644), &b"x\n"[..]).unwrap();
        b.append(&header("bin/ping", tar::EntryType::Regular, 5, 0o4755), &b"pong\n"[..]).unwrap();
        let mut h = header("bin/ping2", tar::EntryType::Link, 0, 0o644);
        b.append_link(&mut h, "bin/ping2", "./bin/ping").unwrap();
        let mut h = header("bin/sh", tar::EntryType::Symlink, 0, 0o777);
        b.append_link(&mut h, "bin/sh", "ping").unwrap();
        b.append(&device_header("dev/sda", tar::EntryType::Block, 0o660, 8, 0), &[][..]).unwrap();
        b.append(&header("run/fifo", tar::EntryType::Fifo, 0, 0o600), &[][..]).unwrap();
        let base = b.into_inner().unwrap();
        let mut b = tar::Builder::new(Vec::new());
        b.append(&header("dev/.wh.sda", tar::EntryType::Regular, 0, 0o644), &[][..]).unwrap();
        b.append(&header("run/.wh..wh..opq", tar::EntryType::Regular, 0, 0o644), &[][..]).unwrap();
        let mut h = header("opt/big-link", tar::EntryType::Link, 0, 0o644);
        b.append_link(&mut h, "opt/big-link", "opt/big").unwrap();
        b.append(&header("bin/ping", tar::EntryType::Regular, 4, 0o755), &b"new\n"[..]).unwrap();
        (base, b.into_inner().unwrap())
    }

    fn image(layers: Vec<LayerBlob>) -> ImageSource {
        ImageSource { layers, config: RuntimeConfig::default(), provenance: serde_json::json!({}) }
    }

    fn reused(store: &LocalStore, out: &BuildOutput) -> Vec<bool> {
        let p = store.read_blob(&out.entry.provenance.unwrap()).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&p).unwrap();
        v["image"]["layer_manifests"].as_array().unwrap().iter().map(|l| l["reused"] == true).collect()
    }

    #[test]
    fn cold_warm_and_hot_stores_give_one_image() {
        let (base, top) = layers();
        let both = || image(vec![layer("layer 0", base.clone()), layer("layer 1", top.clone())]);
        let config = BuildConfig { fs_time: 1000, ..BuildConfig::default() };
        let dir = tempfile::tempdir().unwrap();
        let cold = LocalStore::create_or_open(dir.path().join("cold")).unwrap();
        let a = build_image(&both(), &cold, &config, &NoProgress).unwrap();
        assert_eq!(reused(&cold, &a), [false, false]);

        let warm = LocalStore::create_or_open(dir.path().join("warm")).unwrap();
        let b0 =
            build_image(&image(vec![layer("layer 0", base.clone())]), &warm, &config, &NoProgress).unwrap();
        assert_eq!(reused(&warm, &b0), [false]);
        let b = build_image(&both(), &warm, &config, &NoProgress).unwrap();
        assert_eq!(reused(&warm, &b), [true, false]);
        assert_eq!(b.id, a.id, "a warm store gives the cold store's image");
        assert_eq!(b.record, a.record);
        let c = build_image(&both(), &warm, &config, &NoProgress).unwrap();
        assert_eq!(reused(&warm, &c), [true, true]);
        assert_eq!(c.id, a.id);
        // Every chunk of the image is where its pack index says (the read path verifies them).
        tessera_store::OpenImage::open(&warm, &c.id).unwrap();

        // --max-size counts reused layers too.
        let small = BuildConfig { max_size: Some(1000), ..config.clone() };
        assert!(matches!(
            build_image(&both(), &warm, &small, &NoProgress),
            Err(BuildError::Source(SourceError::TooLarge { .. }))
        ));
        // Another chunk size is another manifest.
        let other = BuildConfig { chunk_size: 64 * 1024, ..config.clone() };
        let d = build_image(&both(), &warm, &other, &NoProgress).unwrap();
        assert_eq!(reused(&warm, &d), [false, false]);
        // A record whose manifest blob is gone: the layer is read again, the image is the same.
        let diff = diff_digest(&layer("layer 0", base.clone())).unwrap();
        let rec = warm.layer_record(&diff, config.chunk_size).unwrap().unwrap();
        std::fs::remove_file(warm.blob_path(&rec.manifest)).unwrap();
        let e = build_image(&both(), &warm, &config, &NoProgress).unwrap();
        assert_eq!(reused(&warm, &e), [false, true]);
        assert_eq!(e.id, a.id);
    }
}
