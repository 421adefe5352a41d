//! The contract between the Tessera builder and the daemon.
//!
//! Everything here is pure data and byte formats: no I/O, no async runtime.
//!
//! - [`ChunkId`]: blake3 of a chunk's uncompressed bytes.
//! - [`Sha256Digest`] / [`ImageId`]: content addresses of store blobs and images.
//! - [`BlockMap`]: which device blocks come from the metadata prefix, which from chunks; the rest is zeros.
//! - [`ImageRecord`]: the canonical, versioned binary record whose sha256 is the image ID.
//! - [`PackIndex`]: where each chunk sits inside the store's packs (per store, not part of the ID).
//! - [`RefIndex`]: the same for `--reference-layers` images, whose chunks stay in the source
//!   image's gzip layers (with the checkpoints that decode any span of them).
//! - [`Trace`] / [`Profile`]: boot traces and the prefetch profiles merged from them (per store).
//! - [`RequestTrace`]: every virtio request a daemon answered (`serve --record-requests`).
//! - [`ImageEntry`]: the JSON document tying an image ID to its blobs in one store.
//!
//! ```
//! use tessera_image::{BlockMap, ChunkId, Segment};
//! let id = ChunkId::of(b"hello");
//! let mut map = BlockMap::builder(16);
//! map.push_prefix(0, 2, 0).unwrap();
//! let c = map.add_chunk(id, 5);
//! map.push_chunk(4, 1, c, 0).unwrap();
//! let map = map.finish().unwrap();
//! let plan: Vec<Segment> = map.plan(0, 6 * 4096).unwrap().collect();
//! assert_eq!(plan.len(), 4); // prefix, zeros, chunk, zeros
//! ```
#![forbid(unsafe_code)]

mod blockmap;
pub mod codec;
mod digest;
mod entry;
mod error;
mod packindex;
mod profile;
mod record;
mod refindex;
mod requests;
mod units;

pub use blockmap::{BlockMap, BlockMapBuilder, ChunkRef, Run, RunSource, Segment, SegmentSource};
pub use digest::{ChunkId, ImageId, Sha256Digest};
pub use entry::ImageEntry;
pub use error::{DecodeError, Error};
pub use packindex::{
    AlignedIndex, ChunkListHasher, Compression, IndexMismatch, PackIndex, PackIndexBlob, PackIndexEncoder,
    PackLocation,
};
pub use profile::{
    default_min_runs, Coverage, Profile, ProfileEntry, ProfileError, Trace, TraceEntry, PROFILE_VERSION,
};
pub use record::{
    BuildOptions, Geometry, ImageRecord, ImageStats, PrefixInfo, RuntimeConfig, RECORD_VERSION,
};
pub use refindex::{
    AnyPackIndex, RefCheckpoint, RefCodec, RefIndex, RefLayer, RefLocation, Window, WindowsBlob,
    MAX_STORED_WINDOW, REF_INDEX_MAGIC, REF_INDEX_VERSION,
};
pub use requests::{
    RequestOp, RequestRecord, RequestStatus, RequestTrace, RequestTraceHeader, REQUEST_HEADER_LEN,
    REQUEST_RECORD_LEN, REQUEST_TRACE_MAGIC, REQUEST_TRACE_UNFINISHED, REQUEST_TRACE_VERSION,
};
pub use units::{parse_size, validate_tag, BlockSize, SizeParseError, BLOCK_SIZE};
