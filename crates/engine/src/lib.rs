//! The Tessera read engine: how any frontend reads an image's device bytes fast.
//!
//! - [`MemTier`]: decoded, verified chunks in memory (moka, weighted by bytes) in front of the
//!   store's verified read path (`tessera_store::ImageReader`: disk cache, origin). Reads are
//!   handed to a [`Sink`] straight out of memory ([`BlockDevice::visit`]); a read missing memory
//!   says so ([`Visit::Missing`]) instead of blocking, and [`BlockDevice::fetch_ahead`] calls
//!   back once it can finish.
//! - [`ChunkFetcher`]: the one pool of worker threads — demand fetches, then readahead, then
//!   profile prefetch; each chunk fetched once however many readers want it (single flight);
//!   background fetches capped in threads and bandwidth; frontends' jobs run beside the demand
//!   fetches ([`ChunkFetcher::run`]).
//! - [`TraceRecorder`]: the first touch of every chunk (`serve --record-trace`).
//!
//! - [`warm`]: fill the host disk cache with an image (all of it, or its profile's chunks) on a
//!   [`ChunkFetcher`], each chunk once.
//! - [`export_raw`]: the whole device as a sparse file, fetched in parallel ahead of the writer.
//!
//! Frontends: the vhost-user-blk daemon (`tessera-vhost`), the overlay (`tessera-overlay`),
//! `tessera export` and `tessera warm`.
//!
//! ```no_run
//! use tessera_engine::{BlockDevice, FetchLimits, MemTier};
//! use tessera_store::{ImageReader, LocalStore, OpenImage};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = LocalStore::open("/var/lib/tessera")?;
//! let id = store.resolve("web")?;
//! let reader = ImageReader::new(OpenImage::open(&store, &id)?, store.clone());
//! let tier = MemTier::new(reader, 256 << 20, FetchLimits::new(4))?.with_readahead(2 << 20);
//! let mut block = vec![0u8; 4096];
//! tier.read_at(0, &mut block)?;
//! # Ok(()) }
//! ```

pub mod device;
pub mod elfdeps;
pub mod error;
pub mod export;
pub mod fetcher;
pub mod files;
pub mod hugebuf;
pub mod metrics;
pub mod packorder;
pub mod programs;
pub mod tier;
pub mod trace;
pub mod warm;

pub use device::{BlockDevice, BufSink, Sink};
pub use error::{Chain, ReadError, SinkError, StartError};
pub use export::{export_raw, ExportError, ExportOptions, ExportProgress, ExportStats};
pub use fetcher::{
    Arrived, ChunkFetcher, ChunkPlace, FetchDone, FetchLimits, FetchResult, FetcherStats, Job, Priority,
    DEFAULT_BATCH_BYTES, DEFAULT_LOCAL_FETCH_JOBS, DEFAULT_REMOTE_FETCH_JOBS, PREFETCH_BATCH_BYTES,
};
pub use hugebuf::ChunkBuf;
pub use tessera_store::Visit;
pub use tier::{
    Ahead, AheadStats, Chunk, MemTier, TierStats, DEFAULT_MEM_CACHE, DEFAULT_READAHEAD, WHOLE_FILE_MAX_BYTES,
};
pub use trace::{TraceError, TraceRecorder};
pub use warm::{warm, WarmFailure, WarmOptions, WarmReport, DEFAULT_WARM_JOBS, WARM_RUN_BYTES};
