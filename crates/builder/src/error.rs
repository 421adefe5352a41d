use std::path::PathBuf;

use thiserror::Error;

/// Why a build failed. Every variant names the path or object it concerns.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum BuildError {
    #[error("{path}: {op}")]
    Io { path: PathBuf, op: &'static str, source: std::io::Error },
    #[error("{path}: source is not a directory")]
    NotADirectory { path: PathBuf },
    #[error("{path}: file changed while it was being read (expected {expected} bytes at offset {offset})")]
    FileChanged { path: PathBuf, offset: u64, expected: u64 },
    #[error("{path}: unsupported file type")]
    UnsupportedType { path: PathBuf },
    #[error("{path}: too many files for one image")]
    TooManyNodes { path: PathBuf },
    #[error("invalid chunk size {0}: must be a power of two from 64 KiB to 16 MiB")]
    BadChunkSize(u64),
    #[error(transparent)]
    Source(#[from] crate::source::SourceError),
    #[error("{what} are not supported yet")]
    Unsupported { what: String },
    #[error(transparent)]
    Ext4(#[from] tessera_ext4::Ext4Error),
    #[error(transparent)]
    Store(#[from] tessera_store::StoreError),
    #[error("internal error")]
    Contract(#[from] tessera_image::Error),
    #[error("{file}: entry {path:?}: {reason}")]
    Manifest { file: PathBuf, path: String, reason: String },
    #[error("{path}: content chunk {chunk} is missing: {reason}")]
    MissingContent { path: String, chunk: tessera_image::ChunkId, reason: String },
    #[error("internal error: {what} (chunk {chunk:?})")]
    Internal { what: &'static str, chunk: Option<tessera_image::ChunkId> },
}

impl BuildError {
    pub(crate) fn io(path: impl Into<PathBuf>, op: &'static str) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, op, source }
    }
}
