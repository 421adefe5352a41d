//! The Tessera image builder: sources (a directory, OCI layouts, docker archives), chunking and packing, ext4 synthesis,
//! and writing the image into a store.
//!
//! ```no_run
//! use tessera_builder::{build_dir, BuildConfig, NoProgress};
//! let store = tessera_store::LocalStore::create_or_open("store").unwrap();
//! let out = build_dir("rootfs".as_ref(), &store, &BuildConfig::default(), &NoProgress).unwrap();
//! println!("{}", out.id);
//! ```
#![forbid(unsafe_code)]

mod chunk;
mod error;
#[cfg(test)]
mod id_stable;
mod image;
pub mod manifest;
mod manifest_text;
mod pipeline;
mod reference;
mod seed;
pub mod source;
pub mod source_index;
#[cfg(any(test, feature = "test-support"))]
pub mod test_support;
mod walk;

pub use chunk::{Reuse, BATCH_BYTES, PACK_TARGET_BYTES};
pub use error::BuildError;
pub use image::{build_image, LAYER_READER_VERSION};
pub use manifest_text::{build_manifest, TEXT_VERSION};
pub use pipeline::{
    build_dir, build_source, fs_time, BuildConfig, BuildOutput, DEFAULT_CHUNK_SIZE, DEFAULT_FS_TIME,
    SOURCE_READER_VERSION,
};
pub use walk::{walk_dir, SourceTree};

/// Progress of the long phase (reading, hashing, compressing file content), in bytes.
pub trait Progress: Sync {
    fn start(&self, total_bytes: u64);
    fn advance(&self, bytes: u64);
    fn finish(&self);
}

/// A [`Progress`] that reports nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoProgress;

impl Progress for NoProgress {
    fn start(&self, _: u64) {}
    fn advance(&self, _: u64) {}
    fn finish(&self) {}
}
