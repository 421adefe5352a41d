//! Image sources other than a directory: OCI image layouts, docker archives and registries, their layers
//! (tar, tar+gzip, tar+zstd) and the flattener that applies them.
//!
//! One pass over each new layer, never unpacking to disk: [`read_layer`] parses its headers into
//! [`LayerEntry`]s and hands each regular file's bytes to the chunker as the stream passes them,
//! which makes the layer's content manifest (`crate::manifest`); the [`Flattener`] then applies
//! the layers' manifests in order.

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
pub(crate) use layer::parse_pax_time;
pub use layer::{read_layer, scan_layer, Digest, FileSink, GzipIndexHandle, LayerBlob, LayerStream, Opener};
pub use oci::{
    normalize_config, open_docker_archive, open_oci_layout, ImageSource, Platform, SourceSpec, MAX_DOCUMENT,
};
pub use registry::{open_registry, RegistrySpec};
