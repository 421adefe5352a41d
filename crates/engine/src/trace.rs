//! `tessera serve --record-trace FILE`: the chunks the guest touches, in first-touch order.
//!
//! The memory tier calls [`TraceRecorder::touch`] for every chunk a guest read needs. After a
//! chunk's first touch that is one relaxed atomic load (a bit per chunk of the image); the first
//! touch sets the bit and appends `(chunk, µs since the first touch of the run)` to a buffer under
//! a short lock. [`TraceRecorder::flush`] appends the buffered lines to the file (the daemon calls
//! it periodically and on exit), so memory stays bounded by the image's chunk count and the file
//! holds whole lines. File format: `docs/formats/profile.md`.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use tessera_image::{BlockMap, ChunkId, ImageId, Trace, TraceEntry};
use thiserror::Error;

/// A trace file that could not be written.
#[derive(Debug, Error)]
#[error("trace file {}: {source}", path.display())]
pub struct TraceError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// First touches not yet written.
#[derive(Debug, Default)]
struct Pending {
    /// The run's first touch (time 0).
    start: Option<Instant>,
    /// (chunk index, µs since `start`), in time order.
    batch: Vec<(u32, u64)>,
}

/// Records first touches of an image's chunks into a trace file.
#[derive(Debug)]
pub struct TraceRecorder {
    path: PathBuf,
    chunk_ids: Box<[ChunkId]>,
    /// One bit per chunk index: touched already.
    seen: Box<[AtomicU64]>,
    pending: Mutex<Pending>,
    file: Mutex<File>,
    recorded: AtomicU64,
}

impl TraceRecorder {
    /// Create (or truncate) `path` and write the header for `image`, whose block map is `map`.
    pub fn create(path: &Path, image: ImageId, map: &BlockMap) -> Result<Self, TraceError> {
        let err = |source| TraceError { path: path.to_owned(), source };
        let mut file = OpenOptions::new().create(true).truncate(true).write(true).open(path).map_err(err)?;
        file.write_all(Trace::header_line(image).as_bytes()).map_err(err)?;
        let chunk_ids: Box<[ChunkId]> = map.chunks().iter().map(|c| c.id).collect();
        let seen = (0..chunk_ids.len().div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
        Ok(Self {
            path: path.to_owned(),
            chunk_ids,
            seen,
            pending: Mutex::new(Pending::default()),
            file: Mutex::new(file),
            recorded: AtomicU64::new(0),
        })
    }

    /// The guest needed chunk `index` (of the block map): note it if this is its first touch.
    pub fn touch(&self, index: u32) {
        if index as usize >= self.chunk_ids.len() {
            return; // Not a chunk of this image; the block map never produces one.
        }
        let Some(word) = self.seen.get(index as usize / 64) else {
            return;
        };
        let bit = 1u64 << (index % 64);
        if word.load(Ordering::Relaxed) & bit != 0 {
            return;
        }
        if word.fetch_or(bit, Ordering::Relaxed) & bit != 0 {
            return; // Another thread won the race.
        }
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        // The time is taken under the lock so the buffer (and the file) stay in time order.
        let now = Instant::now();
        let start = *pending.start.get_or_insert(now);
        let at_us = u64::try_from(now.duration_since(start).as_micros()).unwrap_or(u64::MAX);
        pending.batch.push((index, at_us));
    }

    /// Chunks written to the file so far.
    pub fn recorded(&self) -> u64 {
        self.recorded.load(Ordering::Relaxed)
    }

    /// Append the buffered first touches to the file; returns how many were written.
    pub fn flush(&self) -> Result<usize, TraceError> {
        // The file lock is held across taking the buffer and writing it, so two flushes cannot
        // reorder lines.
        let mut file = self.file.lock().unwrap_or_else(PoisonError::into_inner);
        let batch = std::mem::take(&mut self.pending.lock().unwrap_or_else(PoisonError::into_inner).batch);
        if batch.is_empty() {
            return Ok(0);
        }
        let mut text = String::with_capacity(batch.len() * 82);
        for &(index, at_us) in &batch {
            // `touch` only records indexes below the chunk count.
            if let Some(&chunk) = self.chunk_ids.get(index as usize) {
                text.push_str(&Trace::entry_line(&TraceEntry { chunk, at_us }));
            }
        }
        file.write_all(text.as_bytes()).map_err(|source| TraceError { path: self.path.clone(), source })?;
        self.recorded.fetch_add(batch.len() as u64, Ordering::Relaxed);
        Ok(batch.len())
    }

    /// Flush and make the file durable (on exit).
    pub fn finish(&self) -> Result<u64, TraceError> {
        self.flush()?;
        let file = self.file.lock().unwrap_or_else(PoisonError::into_inner);
        file.sync_data().map_err(|source| TraceError { path: self.path.clone(), source })?;
        Ok(self.recorded())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tessera_image::Sha256Digest;

    use super::*;

    fn map(chunks: u32) -> BlockMap {
        let mut b = BlockMap::builder(u64::from(chunks) + 1);
        for i in 0..chunks {
            let c = b.add_chunk(ChunkId::of(&i.to_le_bytes()), 4096);
            b.push_chunk(u64::from(i), 1, c, 0).unwrap();
        }
        b.finish().unwrap()
    }

    #[test]
    fn first_touches_in_order_once_each() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.trace");
        let image = ImageId(Sha256Digest::of(b"img"));
        let map = map(200);
        let rec = Arc::new(TraceRecorder::create(&path, image, &map).unwrap());
        rec.touch(5);
        rec.touch(5);
        rec.touch(130);
        assert_eq!(rec.flush().unwrap(), 2);
        rec.touch(130);
        rec.touch(199);
        rec.touch(200); // out of range: ignored
                        // Many threads touching overlapping chunks: each recorded once.
        std::thread::scope(|s| {
            for t in 0..4u32 {
                let rec = &rec;
                s.spawn(move || (0..200).for_each(|i| rec.touch((i * 7 + t) % 200)));
            }
        });
        assert_eq!(rec.finish().unwrap(), 200);

        let trace = Trace::decode(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(trace.image(), image);
        let ids: Vec<ChunkId> = trace.entries().iter().map(|e| e.chunk).collect();
        assert_eq!(ids.len(), 200);
        let idx = |i: u32| map.chunks()[i as usize].id;
        assert_eq!(&ids[..3], &[idx(5), idx(130), idx(199)]);
        assert_eq!(trace.entries()[0].at_us, 0);
    }

    #[test]
    fn unwritable_path_names_the_file() {
        let image = ImageId(Sha256Digest::of(b"img"));
        let err = TraceRecorder::create("/nonexistent-dir/x.trace".as_ref(), image, &map(1)).unwrap_err();
        assert!(err.to_string().contains("/nonexistent-dir/x.trace"), "{err}");
    }
}
