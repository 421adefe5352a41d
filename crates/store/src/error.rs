//! The store's error type.

use std::io;
use std::path::{Path, PathBuf};

use tessera_image::{ChunkId, DecodeError, ImageId, Sha256Digest};
use thiserror::Error;

/// Everything that can go wrong in the store and on the image read path.
///
/// I/O errors carry the operation and the path. Writes that fail for lack of space become
/// [`StoreError::Full`]; writes refused by the filesystem (read-only mount, immutable directory,
/// permissions) become [`StoreError::ReadOnly`] (a failure, exit 1). [`StoreError::is_usage_error`]
/// tells the CLI which errors are usage errors (exit 2).
///
/// A message never repeats its source: the cause is [`std::error::Error::source`], so print the
/// chain (anyhow's `{:#}`, or log `&e as &dyn Error`) to see it, each cause once.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StoreError {
    /// An I/O error not covered by a more specific variant.
    #[error("{op} {}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The filesystem holding the store (or the export target) has no space left.
    #[error("{op} {}: the filesystem is full (no space left on the device)", path.display())]
    Full { op: &'static str, path: PathBuf },
    /// The filesystem refused a write: a read-only mount, an immutable directory or missing permission.
    #[error("{op} {}: read-only (the filesystem refused the write: read-only mount, immutable directory or permissions)", path.display())]
    ReadOnly { op: &'static str, path: PathBuf },
    /// A write was asked of a store that is read-only by nature (an `http(s)://` store).
    #[error("store {location} is read-only: http(s) stores can only be read")]
    ReadOnlyStore { location: String },
    /// A store location whose kind exists in the contract but is not implemented yet.
    #[error("store {location}: {kind} stores are not supported yet")]
    Unsupported { location: String, kind: &'static str },
    /// A store location that cannot be parsed.
    #[error("invalid store location {location:?}: {reason}")]
    InvalidLocation { location: String, reason: &'static str },
    /// The store directory does not exist (readers never create it).
    #[error("store {} does not exist", path.display())]
    NoSuchStore { path: PathBuf },
    /// The path exists but is not a store.
    #[error("{} is not a Tessera store: {reason}", path.display())]
    NotAStore { path: PathBuf, reason: &'static str },
    /// A blob the store should hold is missing.
    #[error("blob {digest} is missing from the store ({})", path.display())]
    BlobNotFound { digest: Sha256Digest, path: PathBuf },
    /// A blob's content does not hash to its name, or is otherwise unusable.
    #[error("blob {digest} ({what}) is corrupt: {reason} ({})", path.display())]
    Corrupt { what: &'static str, digest: Sha256Digest, path: PathBuf, reason: String },
    /// A blob's bytes could not be decoded.
    #[error("blob {digest} ({what}) cannot be decoded")]
    Decode {
        what: &'static str,
        digest: Sha256Digest,
        #[source]
        source: DecodeError,
    },
    /// An image entry (`images/<id>.json`) that cannot be parsed.
    #[error("image entry {} is corrupt", path.display())]
    BadEntry {
        path: PathBuf,
        #[source]
        source: DecodeError,
    },
    /// A ref file (`refs/<tag>`) whose content is not `sha256:<64 hex>\n`.
    #[error("ref {} is corrupt: expected `sha256:<64 hex>` and a newline", path.display())]
    BadRef { path: PathBuf },
    /// A tag names an image the store does not hold.
    #[error("tag {tag} points to {id}, which is not in the store")]
    DanglingRef { tag: String, id: ImageId },
    /// No image in the store answers to this reference (an unknown tag or ID).
    #[error("unknown image {reference}")]
    UnknownImage { reference: String },
    /// A reference that names more than one image (several Tessera images refer to one source
    /// image manifest).
    #[error("{reference} names several images: {}; name one by its ID", candidates.join(", "))]
    AmbiguousReference { reference: String, candidates: Vec<String> },
    /// A reference that is neither `sha256:<64 hex>` nor a valid tag.
    #[error(
        "invalid image reference {reference:?}: expected sha256:<64 hex> or a tag [A-Za-z0-9_][A-Za-z0-9._-]{{0,127}}"
    )]
    InvalidReference { reference: String },
    /// `@sha256:<digest>` (an image named by the source image manifest it refers to) given to a
    /// store that does not index images by their subject: only registry stores do.
    #[error(
        "{reference} names an image by the source image manifest it refers to, which only a registry \
         store (docker://…) can look up; name the image by its tag or ID in this store"
    )]
    SubjectNeedsRegistry { reference: String },
    /// A tag that does not match `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`.
    #[error("invalid tag {tag:?}: expected [A-Za-z0-9_][A-Za-z0-9._-]{{0,127}}")]
    InvalidTag { tag: String },
    /// A ranged read outside a blob.
    #[error("read of {len} bytes at offset {offset} is outside blob {digest} of {blob_len} bytes")]
    RangeOutOfBounds { digest: Sha256Digest, offset: u64, len: u64, blob_len: u64 },
    /// The image's parts do not agree with each other (entry, record, prefix, pack index).
    #[error("image {image} is inconsistent: {reason}")]
    Inconsistent { image: ImageId, reason: String },
    /// A trace or profile that does not fit the image (made for another image, or naming chunks
    /// the image does not have).
    #[error("image {image}")]
    Profile {
        image: ImageId,
        #[source]
        source: tessera_image::ProfileError,
    },
    /// An operation that needs the image's prefetch profile, on an image without one.
    #[error("image {image} has no prefetch profile (record traces and run `tessera profile` first)")]
    NoProfile { image: ImageId },
    /// A stored chunk does not decompress to the bytes its id names. No bytes are returned.
    #[error("chunk {chunk} in pack {pack} at offset {offset} is corrupt: {reason}")]
    CorruptChunk { chunk: ChunkId, pack: Sha256Digest, offset: u64, reason: &'static str },
    /// A span of a referenced layer blob (`--reference-layers` images) does not match its
    /// checkpoint: the blob changed since the build. No bytes are returned.
    #[error("layer blob {layer}: the span at compressed offset {offset} is corrupt: {reason}")]
    CorruptSpan { layer: Sha256Digest, offset: u64, reason: String },
    /// A read outside the device.
    #[error("read outside the device")]
    OutOfRange(#[source] tessera_image::Error),
    /// A request to an HTTP origin failed (after the retries its policy allows).
    #[error("{url}")]
    Http {
        url: String,
        #[source]
        source: crate::origin::http::HttpError,
    },
    /// A request to a registry store (`docker://`) failed; the message names the URL.
    #[error(transparent)]
    Registry(#[from] tessera_registry::RegistryError),
    /// A registry manifest is not a Tessera image, or disagrees with its image entry.
    #[error("{location}")]
    Artifact {
        location: String,
        #[source]
        source: crate::artifact::ArtifactError,
    },
    /// A setting (e.g. a `TESSERA_HTTP_*` environment variable) has a malformed value.
    #[error("{name}={value:?}: expected {expected}")]
    BadSetting { name: String, value: String, expected: &'static str },
    /// The host disk cache (`--cache-dir`) cannot be used.
    #[error("cache {op} {}", path.display())]
    Cache {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// One failure shared by several reads (the chunks of one request to the origin).
    #[error(transparent)]
    Shared(std::sync::Arc<StoreError>),
}

impl StoreError {
    /// `bytes` (`what`, read from `path`) must hash to `digest`; else [`StoreError::Corrupt`].
    pub fn check_sha256(
        what: &'static str,
        digest: &Sha256Digest,
        bytes: &[u8],
        path: impl FnOnce() -> PathBuf,
    ) -> Result<(), StoreError> {
        let actual = Sha256Digest::of(bytes);
        if actual == *digest {
            return Ok(());
        }
        let reason = format!("its content hashes to {actual}");
        Err(StoreError::Corrupt { what, digest: *digest, path: path(), reason })
    }

    /// Whether the error is a usage error (exit status 2): a write to a store that is read-only by
    /// nature (http), an invalid store location, tag or reference. Unknown images, corruption and a
    /// store whose filesystem refuses writes (full, read-only mount) are failures (exit 1).
    pub fn is_usage_error(&self) -> bool {
        matches!(
            self,
            StoreError::ReadOnlyStore { .. }
                | StoreError::InvalidLocation { .. }
                | StoreError::InvalidReference { .. }
                | StoreError::SubjectNeedsRegistry { .. }
                | StoreError::InvalidTag { .. }
                | StoreError::BadSetting { .. }
        ) || matches!(self, StoreError::Registry(e) if e.is_usage_error())
            || matches!(self, StoreError::Shared(e) if e.is_usage_error())
    }

    /// Classify an error from a write-side operation: ENOSPC/EDQUOT → [`StoreError::Full`],
    /// EROFS/EACCES/EPERM → [`StoreError::ReadOnly`], anything else → [`StoreError::Io`].
    pub fn write(op: &'static str, path: &Path, source: io::Error) -> Self {
        match source.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => StoreError::Full { op, path: path.to_owned() },
            Some(libc::EROFS) | Some(libc::EACCES) | Some(libc::EPERM) => {
                StoreError::ReadOnly { op, path: path.to_owned() }
            }
            _ => StoreError::Io { op, path: path.to_owned(), source },
        }
    }

    /// An error from a read-side operation.
    pub(crate) fn read(op: &'static str, path: &Path, source: io::Error) -> Self {
        StoreError::Io { op, path: path.to_owned(), source }
    }
}
