//! Cutting file content into chunks, hashing and compressing them in parallel, and appending new
//! ones to packs in tree order.
//!
//! Memory stays bounded: content is processed in batches of at most [`BATCH_BYTES`] raw bytes
//! (or one chunk, if larger); only the stored (compressed) bytes of a batch are held at once.

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

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

fn process(job: &Job, known: &HashMap<ChunkId, ChunkHome>) -> Result<Processed, BuildError> {
    let raw = read_chunk(job)?;
    let id = ChunkId::of(&raw);
    if known.contains_key(&id) {
        return Ok(Processed { id, len: job.len, stored: None });
    }
    let compressed = zstd::bulk::compress(&raw, ZSTD_LEVEL).map_err(BuildError::io(&job.path, "compress"))?;
    let stored =
        if compressed.len() < raw.len() { (compressed, Compression::Zstd) } else { (raw, Compression::None) };
    Ok(Processed { id, len: job.len, stored: Some(stored) })
}

struct PackSink<'a> {
    store: &'a LocalStore,
    current: Option<(BlobWriter, u64)>,
    done: Vec<Sha256Digest>,
}

impl PackSink<'_> {
    fn append(&mut self, bytes: &[u8]) -> Result<(usize, u64), BuildError> {
        if self.current.is_none() {
            self.current = Some((self.store.blob_writer()?, 0));
        }
        let pack = self.done.len();
        let Some((writer, len)) = self.current.as_mut() else { unreachable!("just created") };
        let offset = writer.append(bytes)?;
        *len = offset + bytes.len() as u64;
        if *len >= PACK_TARGET_BYTES {
            self.close()?;
        }
        Ok((pack, offset))
    }

    fn close(&mut self) -> Result<(), BuildError> {
        if let Some((writer, _)) = self.current.take() {
            self.done.push(writer.commit()?);
        }
        Ok(())
    }
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

    let mut known: HashMap<ChunkId, ChunkHome> =
        existing.into_iter().map(|(id, (pack, loc))| (id, ChunkHome::Existing(pack, loc))).collect();
    let mut out = ChunkOutput { files: vec![Vec::new(); src.tree.nodes.len()], ..Default::default() };
    let mut sink = PackSink { store, current: None, done: Vec::new() };

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
        for (job, result) in batch.iter().zip(results) {
            let p = result?;
            out.files[job.node].push((job.offset, p.id, p.len));
            let home = match known.entry(p.id) {
                std::collections::hash_map::Entry::Occupied(e) => *e.get(),
                std::collections::hash_map::Entry::Vacant(slot) => {
                    let (bytes, compression) = match p.stored {
                        Some(s) => s,
                        // `known` only grows between batches, so a chunk judged known while the batch
                        // ran is still known here; this arm exists for robustness only.
                        None => (read_chunk(job)?, Compression::None),
                    };
                    let (pack, offset) = sink.append(&bytes)?;
                    let loc = PackLocation {
                        pack: 0,
                        offset,
                        stored_len: bytes.len() as u32,
                        raw_len: p.len,
                        compression,
                    };
                    out.new_chunks += 1;
                    out.new_stored_bytes += bytes.len() as u64;
                    *slot.insert(ChunkHome::New { pack, loc })
                }
            };
            out.homes.insert(p.id, home);
        }
        progress.advance(bytes);
        start = end;
    }
    sink.close()?;
    out.new_packs = sink.done;
    progress.finish();
    Ok(out)
}
