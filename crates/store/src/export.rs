//! `tessera export`: the full device as a sparse raw file.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

use rayon::prelude::*;
use tessera_image::{RunSource, BLOCK_SIZE};
use tracing::debug;

use crate::error::StoreError;
use crate::reader::ImageReader;
use crate::source::ChunkSource;

const BS: usize = BLOCK_SIZE as usize;
/// Bytes read through [`ImageReader::read_at`] at a time, and the most bytes of contiguous
/// chunk runs joined into one piece: one read then needs several chunks, which a remote source
/// fetches in one request (near ranges of a pack are coalesced).
const READ_STEP: u64 = 4 << 20;
/// Prefix runs are split into pieces of this size for parallelism.
const PREFIX_PIECE: u64 = 4 << 20;
/// Bytes of pieces handed to the thread pool between two progress reports.
const BATCH_BYTES: u64 = 64 << 20;

/// Progress of an export: bytes of mapped (non-hole) device ranges processed so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportProgress {
    pub done_bytes: u64,
    pub total_bytes: u64,
}

/// What an export did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExportStats {
    /// Size of the output file (the device).
    pub device_bytes: u64,
    /// Bytes covered by BlockMap runs (prefix and chunks).
    pub mapped_bytes: u64,
    /// Bytes actually written (mapped blocks that are not all zeros).
    pub written_bytes: u64,
}

/// A byte range of the device read as a unit by one thread.
#[derive(Debug, Clone, Copy)]
struct Piece {
    offset: u64,
    len: u64,
    /// Made of chunk runs (not prefix runs).
    chunks: bool,
}

/// Write the whole device of `reader` to `path` as a sparse file.
///
/// The file is created (or truncated), sized to the device, and only the mapped blocks that are
/// not all zeros are written; everything else stays a hole. Every byte goes through
/// [`ImageReader::read_at`], so an export proves the read path, chunk verification included.
/// Runs are processed in parallel on the rayon pool (a chunk run stays on one thread, so the
/// chunk is decompressed once; contiguous chunk runs are joined into pieces of up to 4 MiB, so
/// a remote store fetches their chunks in one request). `progress` is called on the calling thread after each batch.
/// The file is fsynced before returning; on error it is removed.
pub fn export_raw<S: ChunkSource>(
    reader: &ImageReader<S>,
    path: &Path,
    mut progress: impl FnMut(ExportProgress),
) -> Result<ExportStats, StoreError> {
    let result = export_inner(reader, path, &mut progress);
    if result.is_err() && fs::metadata(path).is_ok_and(|m| m.is_file()) {
        if let Err(e) = fs::remove_file(path) {
            debug!(path = %path.display(), error = %e, "could not remove a failed export");
        }
    }
    result
}

fn export_inner<S: ChunkSource>(
    reader: &ImageReader<S>,
    path: &Path,
    progress: &mut dyn FnMut(ExportProgress),
) -> Result<ExportStats, StoreError> {
    let device_bytes = reader.device_bytes();
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(|e| StoreError::write("create export file", path, e))?;
    file.set_len(device_bytes).map_err(|e| StoreError::write("size export file", path, e))?;

    let bs = u64::from(BLOCK_SIZE);
    let mut pieces: Vec<Piece> = Vec::new();
    for run in reader.image().record().block_map.runs() {
        let (start, len) = (run.start * bs, run.blocks * bs);
        match run.source {
            RunSource::Chunk { .. } => match pieces.last_mut() {
                Some(last)
                    if last.chunks && last.offset + last.len == start && last.len + len <= READ_STEP =>
                {
                    last.len += len;
                }
                _ => pieces.push(Piece { offset: start, len, chunks: true }),
            },
            RunSource::Prefix { .. } => {
                let mut at = 0;
                while at < len {
                    let n = PREFIX_PIECE.min(len - at);
                    pieces.push(Piece { offset: start + at, len: n, chunks: false });
                    at += n;
                }
            }
        }
    }
    let total_bytes: u64 = pieces.iter().map(|p| p.len).sum();
    let mut stats = ExportStats { device_bytes, mapped_bytes: total_bytes, written_bytes: 0 };
    progress(ExportProgress { done_bytes: 0, total_bytes });

    let mut done = 0u64;
    let mut rest = &pieces[..];
    while !rest.is_empty() {
        let mut n = 0;
        let mut batch_bytes = 0;
        while n < rest.len() && (n == 0 || batch_bytes < BATCH_BYTES) {
            batch_bytes += rest[n].len;
            n += 1;
        }
        let (batch, tail) = rest.split_at(n);
        rest = tail;
        let written: Vec<u64> =
            batch.par_iter().map(|p| export_piece(reader, &file, path, *p)).collect::<Result<_, _>>()?;
        stats.written_bytes += written.iter().sum::<u64>();
        done += batch_bytes;
        progress(ExportProgress { done_bytes: done, total_bytes });
    }
    file.sync_all().map_err(|e| StoreError::write("fsync export file", path, e))?;
    debug!(path = %path.display(), ?stats, "exported raw device");
    Ok(stats)
}

/// Read one piece through the read path and write its non-zero blocks; returns bytes written.
fn export_piece<S: ChunkSource>(
    reader: &ImageReader<S>,
    file: &fs::File,
    path: &Path,
    piece: Piece,
) -> Result<u64, StoreError> {
    let mut buf = vec![0u8; usize::try_from(READ_STEP.min(piece.len)).unwrap_or(0)];
    let mut written = 0u64;
    let mut at = 0u64;
    while at < piece.len {
        let n = READ_STEP.min(piece.len - at);
        let base = piece.offset + at;
        let data = &mut buf[..usize::try_from(n).unwrap_or(0)];
        reader.read_at(base, data)?;
        // Coalesce consecutive non-zero blocks into one write.
        let mut run_start: Option<usize> = None;
        for (i, block) in data.chunks(BS).enumerate() {
            let nonzero = block.iter().any(|&b| b != 0);
            match (nonzero, run_start) {
                (true, None) => run_start = Some(i * BS),
                (false, Some(s)) => {
                    written += write_run(file, path, base, s, &data[s..i * BS])?;
                    run_start = None;
                }
                _ => {}
            }
        }
        if let Some(s) = run_start {
            written += write_run(file, path, base, s, &data[s..])?;
        }
        at += n;
    }
    Ok(written)
}

fn write_run(file: &fs::File, path: &Path, base: u64, start: usize, bytes: &[u8]) -> Result<u64, StoreError> {
    file.write_all_at(bytes, base + start as u64)
        .map_err(|e| StoreError::write("write export file", path, e))?;
    Ok(bytes.len() as u64)
}
