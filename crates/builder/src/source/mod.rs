//! Image sources other than a directory: OCI image layouts, docker archives and registries, their layers
//! (tar, tar+gzip, tar+zstd) and the flattener that applies them.
//!
//! Two passes over each layer, never unpacking to disk: pass 1 parses headers into
//! [`LayerEntry`]s (all layers in parallel) and the [`Flattener`] applies them in order; pass 2
//! re-streams the layers and cuts the surviving files' bytes into chunks (see `chunk.rs`).

mod error;
mod flatten;
mod layer;
mod oci;
mod registry;
mod tar_ext;
#[cfg(test)]
mod tests;

pub use error::SourceError;
pub use flatten::{ContentRef, EntryKind, FlatTree, Flattener, LayerEntry};
pub use layer::{scan_layer, Digest, LayerBlob, LayerStream, Opener};
pub use oci::{
    normalize_config, open_docker_archive, open_oci_layout, ImageSource, Platform, SourceSpec, MAX_DOCUMENT,
};
pub use registry::{open_registry, RegistrySpec};
