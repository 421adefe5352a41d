//! Errors of the image sources (OCI layout, docker archive, registry) and of layer flattening.

use std::io;
use std::path::PathBuf;

use thiserror::Error;

/// Why an image source could not be read or flattened. Every variant names the layer, path, blob or
/// file it concerns; hostile input always ends here, never in a panic.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SourceError {
    #[error("{path}: {op}")]
    Io { path: PathBuf, op: &'static str, source: io::Error },
    #[error("{layer}: entry {path:?}: `..` path components are not allowed")]
    DotDot { layer: String, path: String },
    #[error("{layer}: entry {path:?} would be placed under the symlink {symlink:?}")]
    UnderSymlink { layer: String, path: String, symlink: String },
    #[error("{layer}: entry {path:?}: parent {parent:?} is not a directory")]
    ParentNotDirectory { layer: String, path: String, parent: String },
    #[error("{layer}: the root entry {path:?} is not a directory")]
    RootNotDirectory { layer: String, path: String },
    #[error("{layer}: entry {path:?}: a path component is longer than 255 bytes")]
    NameTooLong { layer: String, path: String },
    #[error("{layer}: hard link {path:?} → {target:?}: the target does not exist")]
    HardLinkMissing { layer: String, path: String, target: String },
    #[error("{layer}: hard link {path:?} → {target:?}: the target is a directory")]
    HardLinkToDirectory { layer: String, path: String, target: String },
    #[error("{layer}: entry {path:?}: unsupported tar entry type {kind:?}")]
    UnsupportedEntry { layer: String, path: String, kind: char },
    #[error("{layer}: entry {path:?}: bad header field {field}: {reason}")]
    BadHeader { layer: String, path: String, field: &'static str, reason: String },
    #[error(
        "{layer} is {format}: --reference-layers serves data from gzip layers and zstd layers of many \
         frames only; build without --reference-layers to convert the image"
    )]
    NotGzip { layer: String, format: &'static str },
    #[error(
        "{layer} is zstd with a frame of {frame_mib} MiB: --reference-layers needs frames it can read \
         alone (at most {max_mib} MiB each, as zstd:chunked writes them: `skopeo copy \
         --dest-compress-format zstd:chunked`); build without --reference-layers to convert the image"
    )]
    ZstdFrameTooLarge { layer: String, frame_mib: u64, max_mib: u64 },
    #[error("{layer}: corrupt or truncated stream")]
    Corrupt { layer: String, source: io::Error },
    #[error("{what}: digest mismatch: expected {expected}, got {actual}")]
    DigestMismatch { what: String, expected: String, actual: String },
    #[error("{what}: size mismatch: the descriptor says {expected} bytes, the blob has {actual}")]
    SizeMismatch { what: String, expected: u64, actual: u64 },
    #[error("{what}: the uncompressed layers exceed --max-size ({limit} bytes)")]
    TooLarge { what: String, limit: u64 },
    #[error("blob {digest} is missing ({path})")]
    MissingBlob { digest: String, path: PathBuf },
    #[error("{what}: invalid digest {digest:?} (expected sha256:<64 hex>)")]
    BadDigest { what: String, digest: String },
    #[error("{what}")]
    Json { what: String, source: serde_json::Error },
    #[error("{what}: larger than {limit} bytes")]
    DocumentTooLarge { what: String, limit: u64 },
    #[error("{what}: unsupported media type {media_type:?}")]
    UnsupportedMediaType { what: String, media_type: String },
    #[error("{path}: no image named {reference:?} (available: {available})")]
    NoSuchRef { path: PathBuf, reference: String, available: String },
    #[error("{path}: {count} images to choose from: use {hint}")]
    AmbiguousRef { path: PathBuf, count: usize, hint: String },
    #[error("{what}: no image for platform {platform} (available: {available})")]
    NoMatchingPlatform { what: String, platform: String, available: String },
    #[error("{what}: indexes nested deeper than {limit}")]
    NestingTooDeep { what: String, limit: usize },
    #[error("{what}: {count} layers but {diff_ids} diff_ids in the config")]
    LayerCountMismatch { what: String, count: usize, diff_ids: usize },
    #[error("{path}: {reason}")]
    Layout { path: PathBuf, reason: String },
    #[error("invalid platform {0:?}: expected OS/ARCH or OS/ARCH/VARIANT")]
    BadPlatform(String),
    #[error("invalid source {0:?}")]
    BadSource(String),
    #[error("{what}")]
    Registry {
        what: String,
        #[source]
        error: tessera_registry::RegistryError,
    },
}

impl SourceError {
    pub(crate) fn io(path: impl Into<PathBuf>, op: &'static str) -> impl FnOnce(io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, op, source }
    }

    /// Errors that are the caller's fault in how the command was written (usage, exit status 2).
    pub fn is_usage_error(&self) -> bool {
        match self {
            Self::BadPlatform(_) | Self::BadSource(_) => true,
            Self::Registry { error, .. } => error.is_usage_error(),
            _ => false,
        }
    }
}

/// A verification failure raised inside a reader chain; carried through `io::Error` and turned back
/// into a [`SourceError`] by [`from_stream_error`].
#[derive(Debug, Error)]
pub(crate) enum StreamFault {
    #[error("digest mismatch: expected {expected}, got {actual}")]
    Digest { expected: String, actual: String },
    #[error("size mismatch: expected {expected}, got {actual}")]
    Size { expected: u64, actual: u64 },
    #[error("more than {limit} uncompressed bytes")]
    TooLarge { limit: u64 },
}

impl StreamFault {
    pub(crate) fn into_io(self) -> io::Error {
        io::Error::other(self)
    }
}

fn find_fault(e: &io::Error) -> Option<&StreamFault> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = e.get_ref().map(|r| r as _);
    let mut depth = 0;
    while let Some(err) = cur {
        if let Some(f) = err.downcast_ref::<StreamFault>() {
            return Some(f);
        }
        depth += 1;
        if depth > 16 {
            return None;
        }
        cur = match err.downcast_ref::<io::Error>() {
            Some(io) => io.get_ref().map(|r| r as _),
            None => err.source(),
        };
    }
    None
}

/// Turn an error from a layer's reader chain into a typed error: verification faults keep their
/// kind, anything else is a corrupt or truncated stream.
pub(crate) fn from_stream_error(layer: &str, e: io::Error) -> SourceError {
    // A registry failure (a layer opener's, or a blob reader's mid-stream) keeps its type.
    if e.get_ref().is_some_and(|r| r.is::<SourceError>() || r.is::<tessera_registry::RegistryError>()) {
        if let Some(inner) = e.into_inner() {
            let inner = match inner.downcast::<SourceError>() {
                Ok(s) => return *s,
                Err(other) => other,
            };
            return match inner.downcast::<tessera_registry::RegistryError>() {
                Ok(r) => SourceError::Registry { what: layer.to_owned(), error: *r },
                Err(other) => {
                    SourceError::Corrupt { layer: layer.to_owned(), source: io::Error::other(other) }
                }
            };
        }
        return SourceError::Corrupt { layer: layer.to_owned(), source: io::Error::other("unknown error") };
    }
    match find_fault(&e) {
        Some(StreamFault::Digest { expected, actual }) => SourceError::DigestMismatch {
            what: layer.to_owned(),
            expected: expected.clone(),
            actual: actual.clone(),
        },
        Some(StreamFault::Size { expected, actual }) => {
            SourceError::SizeMismatch { what: layer.to_owned(), expected: *expected, actual: *actual }
        }
        Some(StreamFault::TooLarge { limit }) => {
            SourceError::TooLarge { what: layer.to_owned(), limit: *limit }
        }
        None => SourceError::Corrupt { layer: layer.to_owned(), source: e },
    }
}

/// Escape raw path bytes for messages.
pub(crate) fn show(path: &[u8]) -> String {
    String::from_utf8_lossy(path).into_owned()
}
