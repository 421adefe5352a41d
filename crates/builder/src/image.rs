//! Building an OCI image (layout or docker archive): pass 1 scans every layer's headers in
//! parallel and flattens them; pass 2 re-streams the layers that hold surviving files and feeds
//! those files' bytes to the chunker.
//!
//! Pass 2 order is deterministic: layers in order, each in stream order; up to [`READERS`] layers
//! are decompressed ahead at once, each into a bounded channel, so memory stays bounded whatever
//! the layer sizes. Chunk ids are content hashes, so neither this order nor the compression or
//! transport of the layers can change the image ID.

use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::mpsc;
use std::sync::Arc;

use rayon::prelude::*;
use tessera_store::LocalStore;
use tracing::{debug, info};

use crate::chunk::{chunk_with, Batcher, ChunkOutput, Job, JobData};
use crate::error::BuildError;
use crate::pipeline::{check_chunk_size, finish_image, BuildConfig, BuildOutput};
use crate::source::{scan_layer, FlatTree, Flattener, ImageSource, LayerBlob, LayerStream, SourceError};
use crate::Progress;

/// Layers decompressed at once in pass 2.
pub const READERS: usize = 3;
/// Bytes of chunk data a layer reader may have waiting in its channel.
const READER_BUFFER: u64 = 8 << 20;

/// Build `source` into `store`.
pub fn build_image(
    source: &ImageSource,
    store: &LocalStore,
    config: &BuildConfig,
    progress: &dyn Progress,
) -> Result<BuildOutput, BuildError> {
    check_chunk_size(config.chunk_size)?;
    let flat = flatten(&source.layers, config)?;
    info!(nodes = flat.tree.nodes.len(), layers = source.layers.len(), "flattened layers");
    let existing = store.known_chunks()?;
    debug!(chunks = existing.len(), "chunks already in the store");
    let chunks =
        chunk_layers(&source.layers, &flat, store, existing, u64::from(config.chunk_size), progress)?;
    info!(new_chunks = chunks.new_chunks, new_bytes = chunks.new_stored_bytes, "chunked file content");
    finish_image(&flat.tree, chunks, store, config, source.config.clone(), source.provenance.clone())
}

/// Pass 1: scan every layer (in parallel) and apply them in order.
pub fn flatten(layers: &[LayerBlob], config: &BuildConfig) -> Result<FlatTree, BuildError> {
    let budget = config.max_size.map(|limit| (Arc::new(AtomicU64::new(0)), limit));
    let scanned: Vec<Result<_, SourceError>> = layers
        .par_iter()
        .map(|layer| LayerStream::open(layer, budget.clone()).and_then(scan_layer))
        .collect();
    let mut flattener = Flattener::new(config.fs_time);
    for (i, (layer, entries)) in layers.iter().zip(scanned).enumerate() {
        let entries = entries?;
        debug!(layer = %layer.name, entries = entries.len(), "scanned layer");
        flattener.apply_layer(i, &layer.name, &entries)?;
    }
    Ok(flattener.finish()?)
}

enum Msg {
    Job(Job),
    Done,
    Failed(BuildError),
}

/// Files of one layer to read: (offset in the stream, size, node), sorted by offset.
type Extents = Vec<(u64, u64, usize)>;

fn read_layer(
    blob: &LayerBlob,
    extents: &Extents,
    chunk_size: u64,
    tx: &mpsc::SyncSender<Msg>,
) -> Result<(), BuildError> {
    let mut stream = LayerStream::reopen(blob)?;
    for &(offset, size, node) in extents {
        stream.skip_to(offset)?;
        let mut done = 0u64;
        while done < size {
            let len = (size - done).min(chunk_size);
            let mut buf = vec![0u8; len as usize];
            stream.read_exact_checked(&mut buf)?;
            // chunk_size ≤ 16 MiB, so the length fits.
            let job = Job { node, offset: done, len: len as u32, data: JobData::Bytes(buf) };
            if tx.send(Msg::Job(job)).is_err() {
                // The consumer gave up (an error elsewhere): stop quietly.
                return Ok(());
            }
            done += len;
        }
    }
    stream.finish()?;
    Ok(())
}

/// Pass 2: stream the layers that hold surviving files and chunk those files.
fn chunk_layers(
    layers: &[LayerBlob],
    flat: &FlatTree,
    store: &LocalStore,
    existing: std::collections::HashMap<
        tessera_image::ChunkId,
        (tessera_image::Sha256Digest, tessera_image::PackLocation),
    >,
    chunk_size: u64,
    progress: &dyn Progress,
) -> Result<ChunkOutput, BuildError> {
    let mut extents: Vec<Extents> = vec![Vec::new(); layers.len()];
    let mut total = 0u64;
    for (node, c) in flat.content.iter().enumerate() {
        if let Some(c) = c.filter(|c| c.size > 0) {
            if let Some(list) = extents.get_mut(c.layer) {
                list.push((c.offset, c.size, node));
                total += c.size;
            }
        }
    }
    for list in &mut extents {
        list.sort_unstable();
    }
    let work: Vec<(&LayerBlob, &Extents)> =
        layers.iter().zip(&extents).filter(|(_, e)| !e.is_empty()).collect();
    let capacity = (READER_BUFFER / chunk_size).max(1) as usize;

    chunk_with(flat.tree.nodes.len(), total, store, existing, progress, |sink| {
        std::thread::scope(|scope| {
            let mut queue: VecDeque<mpsc::Receiver<Msg>> = VecDeque::new();
            let mut next = 0usize;
            let spawn = |next: &mut usize, queue: &mut VecDeque<mpsc::Receiver<Msg>>| {
                if let Some(&(blob, ext)) = work.get(*next) {
                    let (tx, rx) = mpsc::sync_channel(capacity);
                    scope.spawn(move || {
                        let msg = match read_layer(blob, ext, chunk_size, &tx) {
                            Ok(()) => Msg::Done,
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
            while let Some(rx) = queue.pop_front() {
                loop {
                    match rx.recv() {
                        Ok(Msg::Job(job)) => batch.push(job, sink)?,
                        Ok(Msg::Done) => break,
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
    })
}
