//! One OCI distribution (registry API v2) client for Tessera: image references, manifest and
//! index negotiation (OCI and Docker schema 2), verified streaming blob reads, byte ranges, and
//! auth — anonymous, basic, and bearer tokens from the `WWW-Authenticate` challenge, refreshed
//! when they expire mid-pull — with bounded retries (exponential backoff and jitter) on 5xx, 429
//! and broken connections.
//!
//! Blocking (ureq, rustls): the build pipeline is threaded, and a daemon can call it from its
//! blocking pool. The pure parts ([`Reference`], [`Challenge`], [`lookup_auth_file`],
//! [`media`]) do no I/O. Every request goes through one
//! [`tessera_transport::Transport`] per client (pool, limiter, retries, timeouts, TLS, stats).
//!
//! ```no_run
//! use std::io::Read;
//! use tessera_registry::{Client, ClientOptions, Reference};
//! # fn main() -> Result<(), tessera_registry::RegistryError> {
//! let r = Reference::parse("127.0.0.1:5000/app:v1")?;
//! let client = Client::for_reference(&r, ClientOptions::default());
//! let manifest = client.get_manifest(&r.repository, &r.target())?;
//! println!("{} {}", manifest.digest, manifest.media_type);
//! # let digest = manifest.digest.clone();
//! let mut blob = client.get_blob(&r.repository, &digest, None)?; // verified at EOF
//! std::io::copy(&mut blob, &mut std::io::sink()).map_err(|e| tessera_registry::unwrap_io("blob", e))?;
//! # Ok(()) }
//! ```
//!
//! Push ([`Client::push_blob`], [`Client::put_manifest`]): existence checks, cross-repository
//! mounts, monolithic or chunked uploads with bounded memory, manifests by tag; see `push.rs`.
#![forbid(unsafe_code)]

mod auth;
mod blob;
mod client;
mod error;
pub mod media;
mod push;
mod reference;

pub use auth::{
    auth_file_paths, lookup_auth_file, repository_scope, Challenge, CredentialSource, Credentials,
};
pub use blob::{unwrap_io, BlobReader};
pub use client::{Client, ClientOptions, Manifest, Timeouts, DEFAULT_MAX_RANGES, MAX_MANIFEST};
pub use error::RegistryError;
pub use media::ManifestKind;
pub use push::{BlobPush, PushOptions, UploadSession, DEFAULT_UPLOAD_PIECE};
pub use reference::{is_loopback_host, valid_tag, Digest, Reference, Target};
pub use tessera_transport::{
    retryable_status, HttpVersion, RetryPolicy, Stats as TransferStats, TlsOptions, TransportError,
    TransportErrorKind,
};
