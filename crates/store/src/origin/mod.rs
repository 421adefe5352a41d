//! Origins: where a remote store's bytes come from, every request over the one HTTP transport
//! (`tessera_transport`): a static HTTP(S) server holding the store layout ([`http`]) and an
//! OCI registry ([`registry`]).

pub(crate) mod http;
pub(crate) mod registry;
