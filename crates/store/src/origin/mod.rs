//! Origins: where a remote store's bytes come from, every request over the one HTTP transport
//! (`tessera_transport`): a static HTTP(S) server holding the store layout ([`http`]), an
//! OCI registry ([`registry`]) and an S3 bucket ([`s3`], signed by [`sigv4`]).

pub mod byteranges;
pub(crate) mod http;
pub(crate) mod registry;
pub(crate) mod s3;
pub(crate) mod sigv4;
pub(crate) mod staged;
