//! The Tessera store: where images live and how their bytes are read back.
//!
//! - [`LocalStore`]: the embedded default store, a directory with `blobs/sha256/<hex>`,
//!   `images/<id hex>.json`, `refs/<tag>` and `tmp/`; every write is atomic (temp file, fsync,
//!   rename, fsync the directory). Layout and protocol: `docs/formats/store.md`.
//! - [`StoreLocation`]: the `--store` argument (`PATH`, `file://`, `http(s)://`, `docker://`);
//!   [`StoreLocation::open_read_store`] opens any readable kind as a [`ReadStore`].
//! - [`HttpStore`]: a read-only store behind a static HTTP server (Range GETs, retries);
//!   [`DiskCache`] + [`CachedStore`] + [`CachedSource`]: the host disk cache in front of it
//!   (`docs/formats/cache.md`).
//! - [`S3Store`]: a store in an S3 bucket (`s3://BUCKET[/PREFIX]`), read through the HTTP
//!   store's path with every request signed (AWS Signature V4), written by [`copy_image`].
//! - [`RegistryStore`]: a store in an OCI registry (`docker://HOST[:PORT]/REPO`), read through
//!   the registry API; [`push_image`] publishes an image there (`docs/formats/registry.md`).
//! - [`ChunkSource`]: where stored chunk bytes come from (one method); tiers slot in behind it;
//!   [`Metered`] counts one tier's reads (`tessera-metrics`).
//! - [`OpenImage`] + [`ImageReader`]: the verified read path under the read engine
//!   (`tessera-engine`, which serve, export and warm read through): BlockMap plan → zeros / prefix bytes / chunk bytes (decompressed and checked against
//!   their blake3 id).
//! - [`attach_profile`] / [`read_profile`]: an image's prefetch profile (`docs/formats/profile.md`).
//! - [`copy_image`]: replicate an image (blobs, entry, tag) into a local or S3 store ([`CopyDest`]).
//!
//! ```no_run
//! use tessera_store::{ImageReader, LocalStore, OpenImage};
//! # fn main() -> Result<(), tessera_store::StoreError> {
//! let store = LocalStore::open("/var/lib/tessera")?;
//! let id = store.resolve("latest")?;
//! let reader = ImageReader::new(OpenImage::open(&store, &id)?, store.clone());
//! let mut first_block = vec![0u8; 4096];
//! reader.read_at(0, &mut first_block)?;
//! # Ok(()) }
//! ```
// No unsafe code but the one CPU prefetch hint of the read path (`reader::prefetch`) and a blob
// writer's `sync_file_range` (`local::BlobWriter::start_writeback`), allowed there.
#![deny(unsafe_code)]

pub mod artifact;
mod cache;
mod copy;
mod error;
pub mod gc;
mod local;
mod location;
mod metered;
mod origin;
mod prefix;
mod profile;
mod read_store;
mod reader;
mod reference;
mod refs;
pub mod registry_gc;
mod source;

/// The disk cache's index, pure: entry keys, journal lines ([`cache_index::Record::parse`]) and
/// their replay ([`cache_index::LruIndex::replay`]); no I/O (the journal file around it stays
/// private). Public for the `cache_index` fuzz target (`docs/fuzzing.md`).
pub use cache::index as cache_index;
pub use cache::{
    BlobFileError, CacheConfig, CacheStats, CacheTrust, CachedSource, CachedStore, DiskCache, Evicted,
    GcReport, Leftovers, Origin,
};
pub use copy::{copy_image, CopyDest, CopyReport};
pub use error::StoreError;
pub use gc::{collect_garbage, GcBackend, GcOptions, ImagePin, LocalGc, StoreGcReport};
pub use local::{BlobWriter, KnownChunks, LayerRecord, LocalStore, SourceRecord};
pub use location::{OpenedStore, OriginOptions, StoreLocation};
pub use metered::Metered;
/// Several ranges of a blob in one GET: the `Range` header and the `multipart/byteranges`
/// answer, pure. Public for the `byteranges` fuzz target (`docs/fuzzing.md`).
pub use origin::byteranges;
pub use origin::http::{
    coalesce, CoalescedSpan, HttpConfig, HttpError, HttpStore, RetryPolicy, S3Refusal, HTTP_ENV,
    MAX_HTTP_BLOB,
};
pub use origin::registry::{
    push_image, PushProgress, PushReport, PushTarget, RegistryStore, MAX_REGISTRY_BLOB,
};
pub use origin::s3::{
    parse_credentials_file, s3_hint, CredentialSource, Credentials, S3Config, S3Gc, S3Location, S3Store,
    DEFAULT_PART_SIZE, S3_ENV,
};
pub use profile::{
    attach_profile, profile_ranges, read_profile, PackRanges, MAX_STAGED_BYTES, MAX_STAGED_RANGES,
};
pub use read_store::{BlobSink, ProfileRead, ReadStore};
pub use reader::{
    decode_stored_chunk, refetch_if_corrupt, ImageReader, OpenImage, Piece, ReadAt, Visit,
    DEFAULT_CHUNK_CACHE, MAX_CHUNK_LEN, VERIFY_ATTEMPTS,
};
pub use reference::{RefImage, DEFAULT_SPAN_CACHE};
pub use refs::{RefLengths, RefParts, RefText};
pub use registry_gc::collect_registry;
pub use source::{not_handed_over, read_all, ChunkGot, ChunkSource, RangeGot, RangeSink, SourcedChunk};
pub use tessera_registry::PushOptions;
pub use tessera_transport::HttpVersion;
/// An origin's request counters (the same meaning for HTTP and registry stores).
pub use tessera_transport::{
    ErrorCounts as OriginErrorCounts, ErrorKind as OriginErrorKind, Stats as OriginStats,
};
