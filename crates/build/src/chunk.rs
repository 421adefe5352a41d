//! Cutting file content into chunks, hashing and compressing them in parallel, and appending new
//! ones to packs in tree order.
//!
//! Memory stays bounded: content is processed in batches of at most [`BATCH_BYTES`] raw bytes
//! (or one chunk, if larger); only the stored (compressed) bytes of a batch are held at once.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::mpsc;

use rayon::prelude::*;
use tessera_image::{ChunkId, Compression, PackLocation, Sha256Digest};
use tessera_store::{BlobWriter, LocalStore};

use crate::error::BuildError;
use crate::seed::FileChunks;
use crate::walk::{open_noatime, SourceTree};
use crate::Progress;

/// Raw bytes per parallel batch.
pub const BATCH_BYTES: u64 = 32 << 20;
/// A pack is closed once it holds this many bytes.
pub const PACK_TARGET_BYTES: u64 = 128 << 20;
const ZSTD_LEVEL: i32 = 3;

/// Where a chunk lives: in a pack that already existed, or in a pack of this build (by ordinal).
#[derive(Debug, Clone, Copy)]
pub enum ChunkHome {
    Existing(Sha256Digest, PackLocation),
    New { pack: usize, loc: PackLocation },
}

/// What chunking produced.
#[derive(Debug, Default)]
pub struct ChunkOutput {
    /// Per node (by NodeId index): the file's chunks in file order.
    pub files: Vec<FileChunks>,
    /// Every chunk used, with where it is stored.
    pub homes: HashMap<ChunkId, ChunkHome>,
    /// Digests of the packs this build wrote, by ordinal.
    pub new_packs: Vec<Sha256Digest>,
    pub new_chunks: u64,
    pub new_stored_bytes: u64,
}

#[derive(Debug)]
struct Job {
    node: usize,
    path: PathBuf,
    offset: u64,
    len: u32,
}

struct Processed {
    id: ChunkId,
    len: u32,
    /// `None` when the chunk is already stored.
    stored: Option<(Vec<u8>, Compression)>,
}

fn chunk_jobs(src: &SourceTree, chunk_size: u64) -> Vec<Job> {
    let mut jobs = Vec::new();
    for (node, path) in src.file_paths.iter().enumerate() {
        let (Some(path), Some(n)) = (path, src.tree.nodes.get(node)) else { continue };
        let tessera_ext4::NodeKind::Regular { size, data } = &n.kind else { continue };
        for range in data {
            let start = range.start_block * 4096;
            let end = ((range.start_block + range.blocks) * 4096).min(*size);
            let mut off = start;
            while off < end {
                let len = (end - off).min(chunk_size);
                // chunk_size ≤ 16 MiB, so the length always fits.
                jobs.push(Job { node, path: path.clone(), offset: off, len: len as u32 });
                off += len;
            }
        }
    }
    jobs
}

fn read_chunk(job: &Job) -> Result<Vec<u8>, BuildError> {
    let file = open_noatime(&job.path)?;
    let mut buf = vec![0u8; job.len as usize];
    let mut done = 0usize;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], job.offset + done as u64) {
            Ok(0) => {
                return Err(BuildError::FileChanged {
                    path: job.path.clone(),
                    offset: job.offset,
                    expected: u64::from(job.len),
                })
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(BuildError::io(&job.path, "read")(e)),
        }
    }
    Ok(buf)
}

thread_local! {
    /// One zstd context per worker thread: creating a context per chunk cost ~10% of a build.
    static COMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

fn compress(raw: &[u8], path: &std::path::Path) -> Result<Vec<u8>, BuildError> {
    COMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        let compressor = match slot.as_mut() {
            Some(c) => c,
            None => slot.insert(
                zstd::bulk::Compressor::new(ZSTD_LEVEL).map_err(BuildError::io(path, "create compressor"))?,
            ),
        };
        compressor.compress(raw).map_err(BuildError::io(path, "compress"))
    })
}

fn process(job: &Job, known: &HashMap<ChunkId, ChunkHome>) -> Result<Processed, BuildError> {
    let raw = read_chunk(job)?;
    let id = ChunkId::of(&raw);
    if known.contains_key(&id) {
        return Ok(Processed { id, len: job.len, stored: None });
    }
    let compressed = compress(&raw, &job.path)?;
    let stored =
        if compressed.len() < raw.len() { (compressed, Compression::Zstd) } else { (raw, Compression::None) };
    Ok(Processed { id, len: job.len, stored: Some(stored) })
}

/// Decides where each new chunk goes (pack ordinal and offset) on the calling thread, so the
/// layout is deterministic, while a writer thread appends and hashes the bytes in parallel with
/// the next batch's compression.
#[derive(Debug, Default)]
struct PackPlan {
    pack: usize,
    len: u64,
}

impl PackPlan {
    /// Place `n` bytes: (pack ordinal, offset, whether the pack is full afterwards).
    fn place(&mut self, n: u64) -> (usize, u64, bool) {
        let at = (self.pack, self.len);
        self.len += n;
        let full = self.len >= PACK_TARGET_BYTES;
        if full {
            self.pack += 1;
            self.len = 0;
        }
        (at.0, at.1, full)
    }
}

enum PackOp {
    Append(Vec<u8>),
    Close,
}

/// The writer thread: appends to the current pack and commits it on `Close`. If the sender goes
/// away without a final `Close` (the build failed), the unfinished pack is dropped, temp file and all.
fn pack_writer(store: &LocalStore, rx: mpsc::Receiver<Vec<PackOp>>) -> Result<Vec<Sha256Digest>, BuildError> {
    let mut current: Option<BlobWriter> = None;
    let mut done = Vec::new();
    for op in rx.iter().flatten() {
        match op {
            PackOp::Append(bytes) => {
                let writer = match current.as_mut() {
                    Some(w) => w,
                    None => current.insert(store.blob_writer()?),
                };
                writer.append(&bytes)?;
            }
            PackOp::Close => {
                if let Some(writer) = current.take() {
                    done.push(writer.commit()?);
                }
            }
        }
    }
    Ok(done)
}

/// Chunk every regular file of `src`, deduplicating against `existing` (chunks the store holds)
/// and within the build, and write new chunks to packs in `store`.
pub fn chunk_tree(
    src: &SourceTree,
    store: &LocalStore,
    existing: HashMap<ChunkId, (Sha256Digest, PackLocation)>,
    chunk_size: u64,
    progress: &dyn Progress,
) -> Result<ChunkOutput, BuildError> {
    let jobs = chunk_jobs(src, chunk_size);
    let total: u64 = jobs.iter().map(|j| u64::from(j.len)).sum();
    progress.start(total);

    // One batch of stored bytes may wait while another is written: memory stays bounded.
    let (tx, rx) = mpsc::sync_channel::<Vec<PackOp>>(1);
    let (result, written) = std::thread::scope(|scope| {
        let writer = scope.spawn(|| pack_writer(store, rx));
        let result = chunk_batches(src, &jobs, existing, &tx, progress);
        if result.is_ok() {
            // Commit the last pack; a failed build leaves it uncommitted.
            let _ = tx.send(vec![PackOp::Close]);
        }
        drop(tx);
        let panicked = BuildError::Internal { what: "the pack writer thread panicked", chunk: None };
        (result, writer.join().unwrap_or(Err(panicked)))
    });
    let mut out = result?;
    out.new_packs = written?;
    progress.finish();
    Ok(out)
}

fn chunk_batches(
    src: &SourceTree,
    jobs: &[Job],
    existing: HashMap<ChunkId, (Sha256Digest, PackLocation)>,
    tx: &mpsc::SyncSender<Vec<PackOp>>,
    progress: &dyn Progress,
) -> Result<ChunkOutput, BuildError> {
    let mut known: HashMap<ChunkId, ChunkHome> =
        existing.into_iter().map(|(id, (pack, loc))| (id, ChunkHome::Existing(pack, loc))).collect();
    let mut out = ChunkOutput { files: vec![Vec::new(); src.tree.nodes.len()], ..Default::default() };
    let mut plan = PackPlan::default();
    // The writer only stops early on an error, which `chunk_tree` reports after joining it.
    let writer_gone = || BuildError::Internal { what: "the pack writer stopped", chunk: None };

    let mut start = 0;
    while start < jobs.len() {
        let mut end = start;
        let mut bytes = 0u64;
        while end < jobs.len() && (end == start || bytes + u64::from(jobs[end].len) <= BATCH_BYTES) {
            bytes += u64::from(jobs[end].len);
            end += 1;
        }
        let batch = &jobs[start..end];
        let results: Vec<Result<Processed, BuildError>> =
            batch.par_iter().map(|job| process(job, &known)).collect();
        let mut ops = Vec::new();
        for (job, result) in batch.iter().zip(results) {
            let p = result?;
            out.files[job.node].push((job.offset, p.id, p.len));
            let home = match known.entry(p.id) {
                Entry::Occupied(e) => *e.get(),
                Entry::Vacant(slot) => {
                    let (bytes, compression) = match p.stored {
                        Some(s) => s,
                        // `known` only grows between batches, so a chunk judged known while the
                        // batch ran is still known here; this arm exists for robustness only.
                        None => (read_chunk(job)?, Compression::None),
                    };
                    let stored_len = bytes.len() as u32;
                    let (pack, offset, full) = plan.place(u64::from(stored_len));
                    ops.push(PackOp::Append(bytes));
                    if full {
                        ops.push(PackOp::Close);
                    }
                    out.new_chunks += 1;
                    out.new_stored_bytes += u64::from(stored_len);
                    let loc = PackLocation { pack: 0, offset, stored_len, raw_len: p.len, compression };
                    *slot.insert(ChunkHome::New { pack, loc })
                }
            };
            out.homes.insert(p.id, home);
        }
        tx.send(ops).map_err(|_| writer_gone())?;
        progress.advance(bytes);
        start = end;
    }
    Ok(out)
}
