//! The device bytes a frontend serves (the daemon's guest reads, an export, the overlay's base),
//! and how a read visits them without a bounce buffer.

use std::sync::Arc;

use tessera_store::{ChunkSource, ImageReader, Visit};

use crate::error::{ReadError, SinkError};
use crate::fetcher::{FetchDone, Job};

/// Where the bytes of a read go, in device order (the guest's buffers, or a plain buffer).
pub trait Sink {
    /// The next `bytes.len()` bytes of the read.
    fn put(&mut self, bytes: &[u8]) -> Result<(), SinkError>;
    /// The next `n` bytes of the read are zeros.
    fn zeros(&mut self, n: u64) -> Result<(), SinkError>;
}

/// A block device's bytes to serve: the image read path, the memory tier over it (or a test
/// double). The overlay reads its base through one; a frontend serves, exports or warms one.
pub trait BlockDevice: Send + Sync {
    /// Fill `buf` with the device bytes at `offset` (the range is within the device).
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), ReadError>;

    /// Hand the device bytes `[offset, offset + len)` to `sink` in order. Without `fetch`,
    /// return [`Visit::Missing`] instead of blocking on a slow fetch (a device that never
    /// blocks ignores it). The default reads through [`Self::read_at`] in pieces of 1 MiB.
    fn visit(&self, offset: u64, len: u64, fetch: bool, sink: &mut dyn Sink) -> Result<Visit, ReadError> {
        let _ = fetch;
        let mut buf = vec![0u8; usize::try_from(len.min(1 << 20)).unwrap_or(1 << 20)];
        let mut pos = 0u64;
        while pos < len {
            let n = usize::try_from(len - pos).unwrap_or(usize::MAX).min(buf.len());
            self.read_at(offset + pos, &mut buf[..n])?;
            sink.put(&buf[..n])?;
            pos += n as u64;
        }
        Ok(Visit::Done)
    }

    /// Arrange for `done` to be called once a read of `[offset, offset + len)` can finish without
    /// waiting: when the chunks it needs that are not in memory have been fetched (with the
    /// error if a fetch failed, after the refetch policy), on an engine thread — or at once on
    /// the calling thread when nothing needs fetching. A device that cannot fetch in the
    /// background runs `done(Ok(()))` at once and the read then fetches inline (a
    /// [`Self::visit`] with `fetch`), on the caller's thread.
    fn fetch_ahead(&self, offset: u64, len: u64, done: FetchDone) {
        let _ = (offset, len);
        done(Ok(()))
    }

    /// Run `job` off the caller's thread, on the device's worker threads (the memory tier's
    /// chunk fetcher: the process's one worker pool), e.g. an overlay's group commit. A device
    /// without threads runs it at once, on the caller's thread.
    fn spawn(&self, job: Job) {
        job()
    }
}

impl<S: ChunkSource + 'static> BlockDevice for ImageReader<S> {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        ImageReader::read_at(self, offset, buf).map_err(|e| ReadError::store(offset, e))
    }
}

impl<T: BlockDevice + ?Sized> BlockDevice for Arc<T> {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        (**self).read_at(offset, buf)
    }

    fn visit(&self, offset: u64, len: u64, fetch: bool, sink: &mut dyn Sink) -> Result<Visit, ReadError> {
        (**self).visit(offset, len, fetch, sink)
    }

    fn fetch_ahead(&self, offset: u64, len: u64, done: FetchDone) {
        (**self).fetch_ahead(offset, len, done)
    }

    fn spawn(&self, job: Job) {
        (**self).spawn(job)
    }
}

impl std::fmt::Debug for dyn BlockDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BlockDevice")
    }
}

/// A [`Sink`] filling a plain buffer.
#[derive(Debug)]
pub struct BufSink<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl<'a> BufSink<'a> {
    pub fn new(buf: &'a mut [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    fn next(&mut self, n: u64) -> Result<&mut [u8], SinkError> {
        let end =
            usize::try_from(n).ok().and_then(|n| self.pos.checked_add(n)).filter(|&e| e <= self.buf.len());
        let Some(end) = end else {
            return Err(SinkError { addr: self.pos as u64, len: u32::try_from(n).unwrap_or(u32::MAX) });
        };
        let out = &mut self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }
}

impl Sink for BufSink<'_> {
    fn put(&mut self, bytes: &[u8]) -> Result<(), SinkError> {
        self.next(bytes.len() as u64)?.copy_from_slice(bytes);
        Ok(())
    }

    fn zeros(&mut self, n: u64) -> Result<(), SinkError> {
        self.next(n)?.fill(0);
        Ok(())
    }
}
