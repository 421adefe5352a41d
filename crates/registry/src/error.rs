//! The client's one error type. Every remote failure names the URL it concerns (which carries the
//! host, repository and tag or digest); local ones name the file.

use std::path::PathBuf;

use thiserror::Error;

/// Why a registry operation failed. A message never repeats its source (the transport or I/O
/// error is [`std::error::Error::source`]): print the chain to see it.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RegistryError {
    #[error("invalid image reference {reference:?}: {reason}")]
    BadReference { reference: String, reason: &'static str },
    #[error("invalid credentials {0}: expected USER:PASS with a non-empty USER")]
    BadCredentials(&'static str),
    #[error("{url}")]
    Transport { url: String, source: tessera_transport::TransportError },
    #[error("{url}: reading the response")]
    Read { url: String, source: std::io::Error },
    /// The caller's sink stopped a streamed read ([`crate::Client::get_blob_range_streamed`]).
    #[error("{url}: the reader stopped the read")]
    Stopped { url: String },
    #[error("{url}: not found (HTTP 404){detail}")]
    NotFound { url: String, detail: String },
    #[error("{url}: unauthorized (HTTP {status}){detail}: {hint}")]
    Unauthorized { url: String, status: u16, detail: String, hint: &'static str },
    #[error("{url}: HTTP {status}{detail}")]
    Status { url: String, status: u16, detail: String },
    #[error("{url}: the registry does not allow deleting manifests (HTTP {status}){detail}; distribution allows it with `storage: delete: enabled: true` (REGISTRY_STORAGE_DELETE_ENABLED=true)")]
    DeleteRefused { url: String, status: u16, detail: String },
    #[error("{url}: bad WWW-Authenticate challenge {header:?}")]
    BadChallenge { url: String, header: String },
    #[error("{url}: token request failed: {reason}")]
    Token { url: String, reason: String },
    #[error("{url}: {what}: digest mismatch: expected {expected}, got {actual}")]
    DigestMismatch { url: String, what: &'static str, expected: String, actual: String },
    #[error("{url}: {what}: size mismatch: expected {expected} bytes, got {actual}")]
    SizeMismatch { url: String, what: &'static str, expected: u64, actual: u64 },
    #[error("{url}: {what} is larger than {limit} bytes")]
    TooLarge { url: String, what: &'static str, limit: u64 },
    #[error("{url}: unsupported manifest media type {media_type:?} (expected an OCI or Docker schema 2 manifest or index)")]
    UnsupportedMediaType { url: String, media_type: String },
    #[error("{url}: bad Content-Range {header:?} for the requested bytes {start}..{end}")]
    BadRange { url: String, header: String, start: u64, end: u64 },
    #[error("{url}: not an OCI distribution registry (GET /v2/ answered HTTP {status})")]
    NotARegistry { url: String, status: u16 },
    #[error("{path}: {reason}")]
    AuthFile { path: PathBuf, reason: String },
}

impl RegistryError {
    /// Errors in how the command was written (exit status 2).
    pub fn is_usage_error(&self) -> bool {
        matches!(self, Self::BadReference { .. } | Self::BadCredentials(_))
    }
}
