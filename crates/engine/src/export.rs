//! `tessera export`: the full device as a sparse raw file, read through the engine.
//!
//! The device is cut into pieces (contiguous chunk runs joined up to 4 MiB, prefix runs split
//! into 4 MiB); the chunks of the pieces ahead of the writer are fetched in parallel by the
//! source ([`BlockDevice::fetch_ahead`]: the memory tier's chunk fetcher, each chunk once, so a
//! remote store keeps many requests in flight), and the calling thread copies each piece out of
//! memory into the file in device order, skipping all-zero blocks.

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{mpsc, Arc};

use tessera_image::{RunSource, BLOCK_SIZE};
use tessera_store::{OpenImage, StoreError};
use thiserror::Error;
use tracing::debug;

use crate::device::BlockDevice;
use crate::error::ReadError;
use crate::fetcher::{no_outcome, FetchResult};

const BS: usize = BLOCK_SIZE as usize;
/// The most bytes of contiguous chunk runs joined into one piece.
const READ_STEP: u64 = 4 << 20;
/// Prefix runs are split into pieces of this size.
const PREFIX_PIECE: u64 = 4 << 20;
/// Bytes between two progress reports.
const BATCH_BYTES: u64 = 64 << 20;

/// An export that failed (the output file is removed).
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ExportError {
    /// The image could not be read.
    #[error(transparent)]
    Read(#[from] ReadError),
    /// The output could not be written (a full disk is named as such).
    #[error(transparent)]
    Output(StoreError),
}

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

/// A byte range of the device copied as a unit.
#[derive(Debug, Clone, Copy)]
struct Piece {
    offset: u64,
    len: u64,
}

/// How far ahead of the writer an export fetches: bytes of pieces whose chunks are being
/// fetched or are waiting in memory (keep it within half the memory tier, so nothing fetched is
/// evicted before it is copied).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportOptions {
    pub ahead_bytes: u64,
}

impl Default for ExportOptions {
    fn default() -> Self {
        Self { ahead_bytes: 64 << 20 }
    }
}

/// Write the whole device of `image`, read through `source`, to `path` as a sparse file.
///
/// The file is created (or truncated), sized to the device, and only the mapped blocks that are
/// not all zeros are written; everything else stays a hole. Every byte goes through `source`'s
/// verified read path. `progress` is called on the calling thread. The file is fsynced before
/// returning; on error it is removed.
pub fn export_raw(
    image: &OpenImage,
    source: &dyn BlockDevice,
    options: ExportOptions,
    path: &Path,
    mut progress: impl FnMut(ExportProgress),
) -> Result<ExportStats, ExportError> {
    let result = export_inner(image, source, options, path, &mut progress);
    if result.is_err() && fs::metadata(path).is_ok_and(|m| m.is_file()) {
        if let Err(e) = fs::remove_file(path) {
            debug!(path = %path.display(), error = &e as &dyn std::error::Error, "could not remove a failed export");
        }
    }
    result
}

/// The pieces of the device's mapped runs, in device order.
fn pieces(image: &OpenImage) -> Vec<Piece> {
    let bs = u64::from(BLOCK_SIZE);
    let mut pieces: Vec<(Piece, bool)> = Vec::new();
    for run in image.record().block_map.runs() {
        let (start, len) = (run.start * bs, run.blocks * bs);
        match run.source {
            RunSource::Chunk { .. } => match pieces.last_mut() {
                Some((last, true)) if last.offset + last.len == start && last.len + len <= READ_STEP => {
                    last.len += len;
                }
                _ => pieces.push((Piece { offset: start, len }, true)),
            },
            RunSource::Prefix { .. } => {
                let mut at = 0;
                while at < len {
                    let n = PREFIX_PIECE.min(len - at);
                    pieces.push((Piece { offset: start + at, len: n }, false));
                    at += n;
                }
            }
        }
    }
    pieces.into_iter().map(|(p, _)| p).collect()
}

fn export_inner(
    image: &OpenImage,
    source: &dyn BlockDevice,
    options: ExportOptions,
    path: &Path,
    progress: &mut dyn FnMut(ExportProgress),
) -> Result<ExportStats, ExportError> {
    let out = |what, e| ExportError::Output(StoreError::write(what, path, e));
    let device_bytes = image.device_bytes();
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(|e| out("create export file", e))?;
    file.set_len(device_bytes).map_err(|e| out("size export file", e))?;

    let pieces = pieces(image);
    let total_bytes: u64 = pieces.iter().map(|p| p.len).sum();
    let mut stats = ExportStats { device_bytes, mapped_bytes: total_bytes, written_bytes: 0 };
    progress(ExportProgress { done_bytes: 0, total_bytes });

    // Pieces `next..` are not asked for yet; `ready` holds the outcomes of fetches that
    // finished, by piece; `ahead` is the bytes asked for and not yet written.
    let (tx, rx) = mpsc::channel::<(usize, FetchResult)>();
    let mut ready: BTreeMap<usize, FetchResult> = BTreeMap::new();
    let (mut next, mut ahead, mut done, mut reported) = (0usize, 0u64, 0u64, 0u64);
    let mut buf = Vec::new();
    for (i, piece) in pieces.iter().enumerate() {
        while next < pieces.len() && (next <= i || ahead + pieces[next].len <= options.ahead_bytes) {
            let report = PieceDone { piece: next, tx: Some(tx.clone()) };
            source.fetch_ahead(pieces[next].offset, pieces[next].len, Box::new(move |r| report.send(r)));
            ahead += pieces[next].len;
            next += 1;
        }
        let fetched = loop {
            if let Some(r) = ready.remove(&i) {
                break r;
            }
            match rx.recv() {
                Ok((k, r)) => {
                    ready.insert(k, r);
                }
                // `tx` is alive, so this cannot happen; if it did, it is an error, not a success.
                Err(_) => break Err(Arc::new(no_outcome())),
            }
        };
        fetched.map_err(|e| ReadError::store(piece.offset, e))?;
        buf.resize(usize::try_from(piece.len).unwrap_or(0), 0);
        source.read_at(piece.offset, &mut buf)?;
        stats.written_bytes +=
            write_nonzero(&file, piece.offset, &buf).map_err(|e| out("write export file", e))?;
        ahead -= piece.len;
        done += piece.len;
        if done - reported >= BATCH_BYTES || done == total_bytes {
            reported = done;
            progress(ExportProgress { done_bytes: done, total_bytes });
        }
    }
    file.sync_all().map_err(|e| out("fsync export file", e))?;
    debug!(path = %path.display(), ?stats, "exported raw device");
    Ok(stats)
}

/// Reports the outcome of one piece's fetch to the writer; dropped without reporting (a
/// callback the source lost), it reports a failure, so the writer never waits forever nor takes
/// a lost fetch for a success.
struct PieceDone {
    piece: usize,
    tx: Option<mpsc::Sender<(usize, FetchResult)>>,
}

impl PieceDone {
    fn send(mut self, result: FetchResult) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send((self.piece, result));
        }
    }
}

impl Drop for PieceDone {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send((self.piece, Err(Arc::new(no_outcome()))));
        }
    }
}

/// Write the blocks of `data` (device bytes at `base`) that are not all zeros, consecutive
/// non-zero blocks in one write; returns the bytes written.
fn write_nonzero(file: &fs::File, base: u64, data: &[u8]) -> std::io::Result<u64> {
    let mut written = 0u64;
    let mut run_start: Option<usize> = None;
    for (i, block) in data.chunks(BS).enumerate() {
        let nonzero = block.iter().any(|&b| b != 0);
        match (nonzero, run_start) {
            (true, None) => run_start = Some(i * BS),
            (false, Some(s)) => {
                file.write_all_at(&data[s..i * BS], base + s as u64)?;
                written += (i * BS - s) as u64;
                run_start = None;
            }
            _ => {}
        }
    }
    if let Some(s) = run_start {
        file.write_all_at(&data[s..], base + s as u64)?;
        written += (data.len() - s) as u64;
    }
    Ok(written)
}
