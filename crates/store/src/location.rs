//! Parsing the `--store STORE` argument.

use std::path::{Path, PathBuf};

use std::sync::Arc;

use crate::cache::{CacheConfig, CacheTrust, CachedStore, DiskCache};
use crate::error::StoreError;
use crate::local::LocalStore;
use crate::origin::http::{HttpConfig, HttpStore};
use crate::origin::registry::RegistryStore;
use crate::origin::s3::{S3Config, S3Location, S3Store};
use crate::read_store::ReadStore;
use tessera_registry::ClientOptions;

/// How remote stores are reached: the HTTP(S) store settings and the registry client options
/// (credentials, `--insecure`, TLS roots). Built once by the binary from its flags and its
/// environment; libraries read no environment.
#[derive(Debug, Clone, Default)]
pub struct OriginOptions {
    /// Settings of `http(s)://` stores.
    pub http: HttpConfig,
    /// Options of `docker://` stores.
    pub registry: ClientOptions,
    /// Endpoint, region and credentials of `s3://` stores.
    pub s3: S3Config,
    /// Behind a disk cache: what is taken from it without asking the origin
    /// ([`crate::CachedStore::with_trust`]; `serve`: a warmed cache then starts an image named
    /// by ID, or by a tag looked up within `--tag-max-age`, with no origin round trip).
    pub trust: CacheTrust,
}

/// A store opened for reading ([`StoreLocation::open_read_store`]), with what only some kinds
/// have, typed: the local directory, the host disk cache in front of a remote store, and the
/// remote origin's transport (its counters and request-duration histogram).
#[derive(Debug, Clone)]
pub struct OpenedStore {
    /// The store, whatever its kind.
    pub store: Arc<dyn ReadStore>,
    /// The local store, when the location is a local directory.
    pub local: Option<LocalStore>,
    /// The host disk cache in front of a remote store (`--cache-dir`).
    pub cache: Option<DiskCache>,
    /// A remote store's origin transport (`http(s)://` or `docker://`).
    pub origin: Option<tessera_transport::Transport>,
}

/// Where a store lives, as given by `--store`.
///
/// - `PATH` or `file://PATH`: a local directory (read-write, the embedded default);
/// - `http://…` / `https://…`: a static HTTP server holding the same layout (read-only);
/// - `docker://HOST[:PORT]/REPO`: an OCI registry (read-write through the registry API);
/// - `s3://BUCKET[/PREFIX]`: an S3 bucket (read; written by `tessera copy --to`).
///
/// Every kind can be read ([`Self::open_read_store`]). Only local stores are written by `build`
/// ([`Self::open_for_write`]); a registry store is written by `tessera push` ([`crate::push_image`])
/// and is [`StoreError::Unsupported`] for `build`. Writing to an HTTP store is
/// [`StoreError::ReadOnlyStore`], a usage error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    /// A local directory.
    Local(PathBuf),
    /// An HTTP(S) base URL, as given.
    Http(String),
    /// A registry repository `HOST[:PORT]/REPO`, without the `docker://` scheme.
    Registry(String),
    /// An S3 bucket and key prefix.
    S3(S3Location),
}

impl StoreLocation {
    /// Parse a `--store` value.
    pub fn parse(text: &str) -> Result<Self, StoreError> {
        let invalid = |reason| StoreError::InvalidLocation { location: text.to_owned(), reason };
        if text.is_empty() {
            return Err(invalid("empty"));
        }
        if let Some(path) = text.strip_prefix("file://") {
            if path.is_empty() {
                return Err(invalid("file:// needs a path"));
            }
            return Ok(StoreLocation::Local(PathBuf::from(path)));
        }
        let lower = text.to_ascii_lowercase();
        if lower.starts_with("http://") || lower.starts_with("https://") {
            let rest = text.split_once("://").map(|(_, r)| r).unwrap_or("");
            if rest.is_empty() || rest.starts_with('/') {
                return Err(invalid("an http(s) store needs a host"));
            }
            return Ok(StoreLocation::Http(text.to_owned()));
        }
        if let Some(rest) = text.strip_prefix("docker://") {
            match rest.split_once('/') {
                Some((host, repo)) if !host.is_empty() && !repo.is_empty() => {
                    return Ok(StoreLocation::Registry(rest.to_owned()));
                }
                _ => return Err(invalid("expected docker://HOST[:PORT]/REPO")),
            }
        }
        if let Some(rest) = text.strip_prefix("s3://") {
            return S3Location::parse(rest).map(StoreLocation::S3).map_err(invalid);
        }
        if let Some((scheme, _)) = text.split_once("://") {
            if !scheme.is_empty() && scheme.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'+') {
                return Err(invalid(
                    "unknown scheme (expected a path, file://, http(s)://, docker:// or s3://)",
                ));
            }
        }
        Ok(StoreLocation::Local(PathBuf::from(text)))
    }

    /// The local directory, if this is a local store.
    pub fn local_path(&self) -> Option<&Path> {
        match self {
            StoreLocation::Local(p) => Some(p),
            _ => None,
        }
    }

    /// Whether the store kind accepts writes at all (HTTP stores never do).
    pub fn is_writable_kind(&self) -> bool {
        !matches!(self, StoreLocation::Http(_))
    }

    /// Open any readable store kind: a local directory (which must exist), an HTTP origin or a
    /// registry (both reached as `origins` says) — remote ones behind the host disk cache
    /// `cache` if given. A local store is its own disk tier, so `cache` is ignored for it.
    pub fn open_read_store(
        &self,
        origins: &OriginOptions,
        cache: Option<&CacheConfig>,
    ) -> Result<OpenedStore, StoreError> {
        let trust = origins.trust;
        fn remote<O: crate::Origin>(
            origin: O,
            transport: tessera_transport::Transport,
            cache: Option<&CacheConfig>,
            trust: CacheTrust,
        ) -> Result<OpenedStore, StoreError> {
            let (store, cache): (Arc<dyn ReadStore>, _) = match cache {
                Some(config) => {
                    let cache = DiskCache::open(config)?;
                    let store = CachedStore::new(origin, cache.clone()).with_trust(trust);
                    (Arc::new(store), Some(cache))
                }
                None => (Arc::new(origin), None),
            };
            Ok(OpenedStore { store, local: None, cache, origin: Some(transport) })
        }
        match self {
            StoreLocation::Local(p) => {
                if cache.is_some() {
                    tracing::debug!("--cache-dir is ignored for a local store");
                }
                let local = LocalStore::open(p)?;
                Ok(OpenedStore {
                    store: Arc::new(local.clone()),
                    local: Some(local),
                    cache: None,
                    origin: None,
                })
            }
            StoreLocation::Http(url) => {
                // The disk cache also keeps whole packs if the server turns out to ignore Range.
                let disk = cache.map(DiskCache::open).transpose()?;
                let origin = HttpStore::with_cache(url, origins.http.clone(), disk.clone());
                let transport = origin.transport().clone();
                let store: Arc<dyn ReadStore> = match &disk {
                    Some(d) => Arc::new(CachedStore::new(origin, d.clone()).with_trust(trust)),
                    None => Arc::new(origin),
                };
                Ok(OpenedStore { store, local: None, cache: disk, origin: Some(transport) })
            }
            StoreLocation::Registry(r) => {
                let origin = RegistryStore::new(r, origins.registry.clone())?;
                let transport = origin.client().transport().clone();
                remote(origin, transport, cache, trust)
            }
            StoreLocation::S3(l) => {
                let disk = cache.map(DiskCache::open).transpose()?;
                let origin = S3Store::new(l, &origins.s3, origins.http.clone(), disk.clone());
                let transport = origin.transport().clone();
                let store: Arc<dyn ReadStore> = match &disk {
                    Some(d) => Arc::new(CachedStore::new(origin, d.clone()).with_trust(trust)),
                    None => Arc::new(origin),
                };
                Ok(OpenedStore { store, local: None, cache: disk, origin: Some(transport) })
            }
        }
    }

    /// Open an `s3://` store for writing (`tessera copy --to`); other kinds are
    /// [`StoreError::Unsupported`].
    pub fn open_s3(&self, origins: &OriginOptions) -> Result<S3Store, StoreError> {
        match self {
            StoreLocation::S3(l) => Ok(S3Store::new(l, &origins.s3, origins.http.clone(), None)),
            other => Err(StoreError::Unsupported { location: other.to_string(), kind: "non-s3" }),
        }
    }

    /// Open a registry store with `options` (credentials, `--insecure`); other kinds are
    /// [`StoreError::Unsupported`].
    pub fn open_registry(&self, options: ClientOptions) -> Result<RegistryStore, StoreError> {
        match self {
            StoreLocation::Registry(r) => RegistryStore::new(r, options),
            other => Err(StoreError::Unsupported { location: other.to_string(), kind: "non-registry" }),
        }
    }

    /// Open a local store for reading (it must exist). Other kinds: see
    /// [`Self::open_read_store`].
    pub fn open_for_read(&self) -> Result<LocalStore, StoreError> {
        match self {
            StoreLocation::Local(p) => LocalStore::open(p),
            StoreLocation::Http(url) => {
                Err(StoreError::Unsupported { location: url.clone(), kind: "http(s)" })
            }
            StoreLocation::Registry(r) => {
                Err(StoreError::Unsupported { location: format!("docker://{r}"), kind: "registry" })
            }
            StoreLocation::S3(l) => Err(StoreError::Unsupported { location: l.to_string(), kind: "s3" }),
        }
    }

    /// Open the store for writing, creating a local store if needed. Writing to an HTTP store is
    /// [`StoreError::ReadOnlyStore`].
    pub fn open_for_write(&self) -> Result<LocalStore, StoreError> {
        match self {
            StoreLocation::Local(p) => LocalStore::create_or_open(p),
            StoreLocation::Http(url) => Err(StoreError::ReadOnlyStore { location: url.clone() }),
            StoreLocation::Registry(r) => {
                Err(StoreError::Unsupported { location: format!("docker://{r}"), kind: "registry" })
            }
            StoreLocation::S3(l) => Err(StoreError::Unsupported { location: l.to_string(), kind: "s3" }),
        }
    }
}

impl std::fmt::Display for StoreLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreLocation::Local(p) => write!(f, "{}", p.display()),
            StoreLocation::Http(url) => f.write_str(url),
            StoreLocation::Registry(r) => write!(f, "docker://{r}"),
            StoreLocation::S3(l) => write!(f, "{l}"),
        }
    }
}

impl std::str::FromStr for StoreLocation {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_kind() {
        assert_eq!(StoreLocation::parse("/a/b").unwrap(), StoreLocation::Local("/a/b".into()));
        assert_eq!(StoreLocation::parse("rel").unwrap(), StoreLocation::Local("rel".into()));
        assert_eq!(StoreLocation::parse("file:///a/b").unwrap(), StoreLocation::Local("/a/b".into()));
        assert_eq!(StoreLocation::parse("file://rel").unwrap(), StoreLocation::Local("rel".into()));
        assert_eq!(
            StoreLocation::parse("http://h:8080/p").unwrap(),
            StoreLocation::Http("http://h:8080/p".into())
        );
        assert!(matches!(StoreLocation::parse("https://cdn").unwrap(), StoreLocation::Http(_)));
        assert_eq!(
            StoreLocation::parse("docker://localhost:5000/tessera/img").unwrap(),
            StoreLocation::Registry("localhost:5000/tessera/img".into())
        );
        assert_eq!(StoreLocation::parse("docker://h/r").unwrap().to_string(), "docker://h/r");
        assert_eq!(StoreLocation::parse("file:///x").unwrap().to_string(), "/x");
        assert_eq!(
            StoreLocation::parse("s3://bkt/a/b").unwrap(),
            StoreLocation::S3(S3Location { bucket: "bkt".into(), prefix: "a/b".into() })
        );
        assert_eq!(StoreLocation::parse("s3://bkt/").unwrap().to_string(), "s3://bkt");
        for bad in ["", "file://", "http://", "docker://host", "docker:///repo", "s3://", "s3://B", "gs://b"]
        {
            let e = StoreLocation::parse(bad).unwrap_err();
            assert!(matches!(e, StoreError::InvalidLocation { .. }), "{bad}: {e}");
            assert!(e.is_usage_error());
        }
    }

    #[test]
    fn remote_kinds_are_typed_errors() {
        let http = StoreLocation::parse("http://h/p").unwrap();
        let w = http.open_for_write().unwrap_err();
        assert!(matches!(w, StoreError::ReadOnlyStore { .. }));
        assert!(w.is_usage_error());
        let r = http.open_for_read().unwrap_err();
        assert!(matches!(r, StoreError::Unsupported { .. }));
        assert!(!r.is_usage_error());
        let reg = StoreLocation::parse("docker://h/r").unwrap();
        assert!(matches!(reg.open_for_write(), Err(StoreError::Unsupported { .. })));
        assert!(matches!(reg.open_for_read(), Err(StoreError::Unsupported { .. })));
    }
}
