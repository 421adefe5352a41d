//! The memory tier: decoded, verified chunks kept in memory (moka, weighted by bytes), in front
//! of an [`ImageReader`]'s chunk source. Reads are served straight out of the cached chunks into
//! the guest's buffers ([`BlockSource::visit`]); a read that needs a chunk not in memory is
//! reported as [`Visit::Missing`] so the daemon can fetch it off the queue thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use moka::sync::Cache;
use tessera_image::SegmentSource;
use tessera_store::{ChunkSource, ImageReader, StoreError};

use crate::error::RequestError;
use crate::source::{BlockSource, BufSink, Sink, Visit};
use crate::trace::TraceRecorder;

/// `--mem-cache` unless told otherwise: 256 MiB of decoded chunks.
pub const DEFAULT_MEM_CACHE: u64 = 256 << 20;

/// Counters of a [`MemTier`].
#[derive(Debug, Default)]
pub struct TierStats {
    /// Chunk lookups served from memory.
    pub hits: AtomicU64,
    /// Chunk lookups that needed the chunk source.
    pub misses: AtomicU64,
    /// Chunks read (and verified) from the chunk source.
    pub fetches: AtomicU64,
    /// Bytes read from the chunk source (decoded bytes of the chunks fetched).
    pub fetched_bytes: AtomicU64,
    /// Chunks fetched a second time because the first copy failed verification.
    pub refetches: AtomicU64,
}

/// An image's device bytes with a byte-weighted memory tier of decoded chunks.
pub struct MemTier<S> {
    reader: ImageReader<S>,
    cache: Cache<u32, Arc<[u8]>>,
    capacity: u64,
    stats: TierStats,
    trace: Option<Arc<TraceRecorder>>,
}

impl<S> std::fmt::Debug for MemTier<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemTier")
            .field("capacity", &self.capacity)
            .field("weighted_size", &self.cache.weighted_size())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<S: ChunkSource> MemTier<S> {
    /// Serve `reader`'s image keeping up to `capacity` bytes of decoded chunks in memory (0
    /// keeps none: every chunk read goes to the source). The reader's own small chunk cache is
    /// turned off.
    pub fn new(reader: ImageReader<S>, capacity: u64) -> Self {
        let cache = Cache::builder()
            .weigher(|_: &u32, v: &Arc<[u8]>| u32::try_from(v.len()).unwrap_or(u32::MAX))
            .max_capacity(capacity)
            .build();
        Self {
            reader: reader.with_cache_capacity(0),
            cache,
            capacity,
            stats: TierStats::default(),
            trace: None,
        }
    }

    /// Record the first touch of every chunk a read needs (`--record-trace`).
    pub fn with_trace(mut self, trace: Arc<TraceRecorder>) -> Self {
        self.trace = Some(trace);
        self
    }

    /// The reader underneath.
    pub fn reader(&self) -> &ImageReader<S> {
        &self.reader
    }

    /// Device size in bytes.
    pub fn device_bytes(&self) -> u64 {
        self.reader.device_bytes()
    }

    /// Counters.
    pub fn stats(&self) -> &TierStats {
        &self.stats
    }

    /// Bytes of decoded chunks held.
    pub fn weighted_size(&self) -> u64 {
        self.cache.run_pending_tasks();
        self.cache.weighted_size()
    }

    /// Chunk `index` if it is in memory.
    fn cached(&self, index: u32) -> Option<Arc<[u8]>> {
        let hit = self.cache.get(&index);
        let counter = if hit.is_some() { &self.stats.hits } else { &self.stats.misses };
        counter.fetch_add(1, Ordering::Relaxed);
        hit
    }

    /// Chunk `index`, fetched, decoded and verified if it is not in memory (concurrent callers
    /// of the same chunk share one fetch, and its error).
    pub fn chunk(&self, index: u32) -> Result<Arc<[u8]>, Arc<StoreError>> {
        if let Some(hit) = self.cached(index) {
            return Ok(hit);
        }
        self.cache.try_get_with(index, || {
            let data = match self.reader.fetch_chunk(index) {
                // A chunk failing its check in any tier below was dropped from it (the disk
                // cache removes a corrupt entry, bad origin bytes never enter it): fetch once
                // more, which now reaches the origin. A second failure fails the read.
                Err(e @ StoreError::CorruptChunk { .. }) => {
                    tracing::warn!(index, error = %e, "chunk failed verification; fetching it once more");
                    self.stats.refetches.fetch_add(1, Ordering::Relaxed);
                    self.reader.fetch_chunk(index)?
                }
                other => other?,
            };
            self.stats.fetches.fetch_add(1, Ordering::Relaxed);
            self.stats.fetched_bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
            Ok::<_, StoreError>(Arc::<[u8]>::from(data))
        })
    }
}

impl<S: ChunkSource> BlockSource for MemTier<S> {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        let len = buf.len() as u64;
        match self.visit(offset, len, true, &mut BufSink::new(buf)) {
            Ok(_) => Ok(()),
            Err(RequestError::Read { source, .. }) => Err(Arc::try_unwrap(source).unwrap_or_else(|e| {
                StoreError::Inconsistent { image: *self.reader.image().id(), reason: e.to_string() }
            })),
            Err(e) => {
                Err(StoreError::Inconsistent { image: *self.reader.image().id(), reason: e.to_string() })
            }
        }
    }

    fn visit(&self, offset: u64, len: u64, fetch: bool, sink: &mut dyn Sink) -> Result<Visit, RequestError> {
        let image = self.reader.image();
        let read_err = |at: u64, e: StoreError| RequestError::Read { offset: at, source: Arc::new(e) };
        let plan = image
            .record()
            .block_map
            .plan(offset, len)
            .map_err(|e| read_err(offset, StoreError::OutOfRange(e)))?;
        let mut at = offset;
        for seg in plan {
            match seg.source {
                SegmentSource::Zero => sink.zeros(seg.len)?,
                SegmentSource::Prefix { offset: p } => {
                    let bytes = usize::try_from(p)
                        .ok()
                        .zip(usize::try_from(seg.len).ok())
                        .and_then(|(p, n)| image.prefix().get(p..p.checked_add(n)?));
                    let Some(bytes) = bytes else {
                        let reason = format!("prefix read {p}+{} out of bounds", seg.len);
                        return Err(read_err(at, StoreError::Inconsistent { image: *image.id(), reason }));
                    };
                    sink.put(bytes)?;
                }
                SegmentSource::Chunk { chunk, offset: within } => {
                    if let Some(trace) = &self.trace {
                        trace.touch(chunk);
                    }
                    let data = if fetch {
                        self.chunk(chunk).map_err(|source| RequestError::Read { offset: at, source })?
                    } else {
                        match self.cached(chunk) {
                            Some(d) => d,
                            None => return Ok(Visit::Missing),
                        }
                    };
                    // Bytes past the chunk's end read as zeros.
                    let start = usize::try_from(within).unwrap_or(usize::MAX).min(data.len());
                    let avail = (data.len() - start).min(usize::try_from(seg.len).unwrap_or(usize::MAX));
                    sink.put(&data[start..start + avail])?;
                    if (avail as u64) < seg.len {
                        sink.zeros(seg.len - avail as u64)?;
                    }
                }
            }
            at += seg.len;
        }
        Ok(Visit::Done)
    }
}
