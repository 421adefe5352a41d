//! A read-only store behind any static HTTP server: `http(s)://HOST[:PORT][/PREFIX]`.
//!
//! The server holds the store layout of `docs/formats/store.md` under PREFIX: `images/<id>.json`,
//! `refs/<tag>`, `blobs/sha256/<hex>`. Whole blobs (records, prefixes, pack indexes) are fetched
//! with GET and checked against their sha256; chunk bytes are fetched with `Range` GETs
//! ([`ChunkSource`]). One connection-pooled client (ureq, rustls) per store; connect and
//! whole-request timeouts; bounded retries with exponential backoff and jitter on 5xx, 429 and
//! transport failures. Every error names the URL.
//!
//! The URL building, the Range header, the validation of a ranged answer and the retry policy are
//! pure functions, tested without a server.

use std::io::Read;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_image::{validate_tag, ImageEntry, ImageId, Sha256Digest};
use tracing::{debug, trace, warn};
use ureq::http::Response;
use ureq::Body;

use crate::error::StoreError;
use crate::source::ChunkSource;

/// Largest whole blob (record, prefix, pack index) fetched into memory: 1 GiB.
pub const MAX_HTTP_BLOB: u64 = 1 << 30;
/// Largest image entry or ref body: 64 KiB.
const MAX_SMALL_DOC: u64 = 64 << 10;

/// A failure talking to an HTTP origin (wrapped in [`StoreError::Http`] with the URL).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HttpError {
    /// The server answered with an unexpected status.
    #[error("HTTP status {0}")]
    Status(u16),
    /// The request did not complete: connection refused or reset, timeout, TLS, protocol.
    #[error("transport: {0}")]
    Transport(#[source] Box<ureq::Error>),
    /// The answer to a ranged GET does not describe the bytes asked for.
    #[error("bad ranged answer: {0}")]
    BadRange(&'static str),
    /// The body is longer than allowed, or shorter than announced.
    #[error("bad body length: {0}")]
    BadLength(&'static str),
}

/// Bounded retries with exponential backoff and "equal jitter".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (default 4). 1 disables retries.
    pub attempts: u32,
    /// Backoff before the first retry (default 100 ms); doubles every retry.
    pub base: Duration,
    /// Cap on one backoff (default 2 s).
    pub max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self { attempts: 4, base: Duration::from_millis(100), max: Duration::from_secs(2) }
    }
}

impl RetryPolicy {
    /// The wait before retry number `retry` (0-based): half of `min(max, base·2^retry)` plus
    /// `random` modulo the other half — never zero, never synchronized across a fleet.
    pub fn backoff(&self, retry: u32, random: u64) -> Duration {
        let factor = 1u32.checked_shl(retry.min(31)).unwrap_or(u32::MAX);
        let exp = self.base.saturating_mul(factor).min(self.max);
        let half = exp / 2;
        let span = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX);
        let jitter = if span == 0 { 0 } else { random % span.saturating_add(1) };
        half + Duration::from_nanos(jitter)
    }
}

/// HTTP statuses worth retrying: the server may answer differently next time.
pub fn retryable_status(status: u16) -> bool {
    matches!(status, 408 | 429 | 500 | 502 | 503 | 504)
}

/// Transport failures worth retrying (refused, reset, timed out, broken answer).
fn retryable_transport(e: &ureq::Error) -> bool {
    matches!(
        e,
        ureq::Error::Io(_)
            | ureq::Error::Timeout(_)
            | ureq::Error::ConnectionFailed
            | ureq::Error::Protocol(_)
    )
}

/// Client settings of an [`HttpStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpConfig {
    /// TCP (and TLS) connect timeout (default 5 s).
    pub connect_timeout: Duration,
    /// Timeout of one whole request, body included (default 60 s).
    pub request_timeout: Duration,
    /// Retries on 5xx, 429 and transport failures.
    pub retry: RetryPolicy,
    /// Idle connections kept per host (default 16).
    pub idle_per_host: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(60),
            retry: RetryPolicy::default(),
            idle_per_host: 16,
        }
    }
}

/// Normalize a base URL: no trailing slashes (the prefix may be empty).
pub fn normalize_base(url: &str) -> String {
    url.trim_end_matches('/').to_owned()
}

/// The URL of `path` (relative, no leading slash) under `base`.
pub fn join_url(base: &str, path: &str) -> String {
    format!("{}/{}", base.trim_end_matches('/'), path.trim_start_matches('/'))
}

/// The `Range` header value for `len` (≥ 1) bytes at `offset`; `None` if it overflows.
pub fn range_header(offset: u64, len: u64) -> Option<String> {
    let last = offset.checked_add(len.checked_sub(1)?)?;
    Some(format!("bytes={offset}-{last}"))
}

/// How the body of an answer to a ranged GET maps to the bytes asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeAnswer {
    /// 206 with a `Content-Range` naming exactly the bytes asked for: the body is them.
    Partial,
    /// 200: the server ignored `Range` and sends the whole blob; skip `offset` bytes, take `len`.
    Whole,
}

/// Check the status and `Content-Range` of an answer to a GET of `len` bytes at `offset`.
pub fn check_range_answer(
    status: u16,
    content_range: Option<&str>,
    offset: u64,
    len: u64,
) -> Result<RangeAnswer, HttpError> {
    match status {
        200 => Ok(RangeAnswer::Whole),
        206 => {
            let cr = content_range.ok_or(HttpError::BadRange("206 without Content-Range"))?;
            let spec = cr
                .trim()
                .strip_prefix("bytes ")
                .ok_or(HttpError::BadRange("Content-Range is not in bytes"))?;
            let (range, total) =
                spec.split_once('/').ok_or(HttpError::BadRange("Content-Range lacks a total"))?;
            let (first, last) =
                range.split_once('-').ok_or(HttpError::BadRange("Content-Range lacks a range"))?;
            let first: u64 =
                first.parse().map_err(|_| HttpError::BadRange("Content-Range start is not a number"))?;
            let last: u64 =
                last.parse().map_err(|_| HttpError::BadRange("Content-Range end is not a number"))?;
            let want_last =
                offset.checked_add(len.saturating_sub(1)).ok_or(HttpError::BadRange("range overflows"))?;
            if first != offset || last != want_last {
                return Err(HttpError::BadRange("Content-Range is not the range asked for"));
            }
            if total != "*" {
                let total: u64 =
                    total.parse().map_err(|_| HttpError::BadRange("Content-Range total is not a number"))?;
                if total <= last {
                    return Err(HttpError::BadRange("Content-Range ends past the total"));
                }
            }
            Ok(RangeAnswer::Partial)
        }
        416 => Err(HttpError::BadRange("416: the range is outside the blob")),
        s => Err(HttpError::Status(s)),
    }
}

/// A read-only store served over HTTP(S). Cheap to clone (the connection pool is shared).
#[derive(Clone)]
pub struct HttpStore {
    inner: Arc<Inner>,
}

struct Inner {
    base: String,
    agent: ureq::Agent,
    config: HttpConfig,
    /// Tags resolved through this store (an HTTP server cannot list `refs/`).
    seen_refs: Mutex<Vec<(String, ImageId)>>,
}

impl std::fmt::Debug for HttpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpStore")
            .field("base", &self.inner.base)
            .field("config", &self.inner.config)
            .finish()
    }
}

/// What a request expects, to map a 404.
#[derive(Clone, Copy)]
enum Missing {
    Error,
    None,
}

impl HttpStore {
    /// A store at `base` (`http(s)://HOST[:PORT][/PREFIX]`). Nothing is fetched yet.
    pub fn new(base: &str, config: HttpConfig) -> Self {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(config.connect_timeout))
            .timeout_global(Some(config.request_timeout))
            .max_idle_connections_per_host(config.idle_per_host.max(1))
            .user_agent(concat!("tessera/", env!("CARGO_PKG_VERSION")))
            .build()
            .new_agent();
        Self {
            inner: Arc::new(Inner {
                base: normalize_base(base),
                agent,
                config,
                seen_refs: Mutex::new(Vec::new()),
            }),
        }
    }

    /// The base URL, without a trailing slash.
    pub fn base(&self) -> &str {
        &self.inner.base
    }

    /// The URL of blob `digest`.
    pub fn blob_url(&self, digest: &Sha256Digest) -> String {
        join_url(&self.inner.base, &format!("blobs/sha256/{}", digest.hex()))
    }

    /// The URL of the entry of image `id`.
    pub fn entry_url(&self, id: &ImageId) -> String {
        join_url(&self.inner.base, &format!("images/{}.json", id.digest().hex()))
    }

    /// The URL of tag `tag` (already validated).
    pub fn ref_url(&self, tag: &str) -> String {
        join_url(&self.inner.base, &format!("refs/{tag}"))
    }

    /// GET `url` with retries; `range` adds a Range header. `Ok(None)` for a 404 when `missing`
    /// allows it. Returns the response with its status not yet judged (except 404 and retryables).
    fn get(
        &self,
        url: &str,
        range: Option<&str>,
        missing: Missing,
    ) -> Result<Option<Response<Body>>, StoreError> {
        let policy = self.inner.config.retry;
        let attempts = policy.attempts.max(1);
        let mut retry = 0u32;
        loop {
            let mut req = self.inner.agent.get(url);
            if let Some(r) = range {
                req = req.header("Range", r);
            }
            let err = match req.call() {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    if status == 404 {
                        return match missing {
                            Missing::None => Ok(None),
                            Missing::Error => Err(http_err(url, HttpError::Status(404))),
                        };
                    }
                    if !retryable_status(status) {
                        return Ok(Some(resp));
                    }
                    HttpError::Status(status)
                }
                Err(e) if retryable_transport(&e) => HttpError::Transport(Box::new(e)),
                Err(e) => return Err(http_err(url, HttpError::Transport(Box::new(e)))),
            };
            retry += 1;
            if retry >= attempts {
                return Err(http_err(url, err));
            }
            let wait = policy.backoff(retry - 1, random_u64());
            debug!(url, error = %err, retry, wait_ms = wait.as_millis() as u64, "retrying HTTP GET");
            std::thread::sleep(wait);
        }
    }

    /// GET a small document (entry, ref); `None` on 404.
    fn get_small(&self, url: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let Some(mut resp) = self.get(url, None, Missing::None)? else { return Ok(None) };
        let status = resp.status().as_u16();
        if status != 200 {
            return Err(http_err(url, HttpError::Status(status)));
        }
        read_body(url, &mut resp, MAX_SMALL_DOC).map(Some)
    }

    /// The entry of image `id` ([`StoreError::UnknownImage`] on 404).
    pub fn get_entry(&self, id: &ImageId) -> Result<ImageEntry, StoreError> {
        let url = self.entry_url(id);
        let bytes =
            self.get_small(&url)?.ok_or_else(|| StoreError::UnknownImage { reference: id.to_string() })?;
        ImageEntry::from_json(&bytes).map_err(|source| StoreError::BadEntry { path: url.into(), source })
    }

    /// Read `refs/<tag>` (`None` on 404).
    pub fn read_ref(&self, tag: &str) -> Result<Option<ImageId>, StoreError> {
        let url = self.ref_url(tag);
        let Some(text) = self.get_small(&url)? else { return Ok(None) };
        let id = parse_ref(&text).ok_or(StoreError::BadRef { path: url.into() })?;
        Ok(Some(id))
    }

    /// Resolve `sha256:<64 hex>` (its entry must exist) or a tag.
    pub fn resolve(&self, reference: &str) -> Result<ImageId, StoreError> {
        resolve_with(reference, |tag| self.read_ref(tag), |id| self.get_entry(id).map(|_| ()))
            .inspect(|id| self.note_ref(reference, id))
    }

    fn note_ref(&self, reference: &str, id: &ImageId) {
        if reference.starts_with("sha256:") {
            return;
        }
        let mut seen = self.inner.seen_refs.lock().unwrap_or_else(|p| p.into_inner());
        if !seen.iter().any(|(t, _)| t == reference) {
            seen.push((reference.to_owned(), *id));
        }
    }

    /// The tags resolved through this store so far (an HTTP server cannot list `refs/`).
    pub fn seen_refs(&self) -> Vec<(String, ImageId)> {
        self.inner.seen_refs.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The whole blob `digest`, checked against its sha256.
    pub fn read_blob(&self, digest: &Sha256Digest) -> Result<Vec<u8>, StoreError> {
        let url = self.blob_url(digest);
        let mut resp =
            self.get(&url, None, Missing::Error)?.ok_or_else(|| http_err(&url, HttpError::Status(404)))?;
        let status = resp.status().as_u16();
        if status != 200 {
            return Err(http_err(&url, HttpError::Status(status)));
        }
        let bytes = read_body(&url, &mut resp, MAX_HTTP_BLOB)?;
        let actual = Sha256Digest::of(&bytes);
        if actual != *digest {
            return Err(StoreError::Corrupt {
                what: "blob",
                digest: *digest,
                path: url.into(),
                reason: format!("its content hashes to {actual}"),
            });
        }
        trace!(%digest, len = bytes.len(), "fetched blob");
        Ok(bytes)
    }

    /// `len` bytes at `offset` of blob `digest`, with a Range GET. A server that ignores Range
    /// (200) is tolerated: the body is skipped to `offset` and cut at `len`.
    pub fn read_blob_range(
        &self,
        digest: &Sha256Digest,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, StoreError> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let url = self.blob_url(digest);
        let range = range_header(offset, len).ok_or(StoreError::RangeOutOfBounds {
            digest: *digest,
            offset,
            len,
            blob_len: u64::MAX,
        })?;
        let mut resp = self
            .get(&url, Some(&range), Missing::Error)?
            .ok_or_else(|| http_err(&url, HttpError::Status(404)))?;
        let status = resp.status().as_u16();
        let cr = resp.headers().get("content-range").and_then(|v| v.to_str().ok());
        let answer = check_range_answer(status, cr, offset, len).map_err(|e| http_err(&url, e))?;
        let mut reader = resp.body_mut().with_config().limit(u64::MAX).reader();
        if answer == RangeAnswer::Whole {
            warn!(url, "the server ignored Range; reading past {offset} bytes");
            let skipped = std::io::copy(&mut (&mut reader).take(offset), &mut std::io::sink())
                .map_err(|e| http_err(&url, HttpError::Transport(Box::new(ureq::Error::Io(e)))))?;
            if skipped != offset {
                return Err(http_err(&url, HttpError::BadLength("the blob ends before the range")));
            }
        }
        let cap = usize::try_from(len).unwrap_or(usize::MAX);
        let mut out = Vec::with_capacity(cap.min(64 << 20));
        (&mut reader)
            .take(len)
            .read_to_end(&mut out)
            .map_err(|e| http_err(&url, HttpError::Transport(Box::new(ureq::Error::Io(e)))))?;
        if out.len() as u64 != len {
            return Err(http_err(&url, HttpError::BadLength("the body is shorter than the range")));
        }
        trace!(%digest, offset, len, "fetched range");
        Ok(out)
    }
}

impl ChunkSource for HttpStore {
    fn read_stored(&self, pack: &Sha256Digest, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
        self.read_blob_range(pack, offset, u64::from(len))
    }
}

fn http_err(url: &str, source: HttpError) -> StoreError {
    StoreError::Http { url: url.to_owned(), source }
}

fn read_body(url: &str, resp: &mut Response<Body>, limit: u64) -> Result<Vec<u8>, StoreError> {
    resp.body_mut().with_config().limit(limit).read_to_vec().map_err(|e| match e {
        ureq::Error::BodyExceedsLimit(_) => http_err(url, HttpError::BadLength("the body exceeds the limit")),
        e => http_err(url, HttpError::Transport(Box::new(e))),
    })
}

/// Parse the content of a ref: `sha256:<64 hex>` and a newline.
pub(crate) fn parse_ref(text: &[u8]) -> Option<ImageId> {
    std::str::from_utf8(text).ok()?.strip_suffix('\n')?.parse().ok()
}

/// Resolve a reference given a ref reader and an entry check (shared by the HTTP and cached
/// stores): IDs must have an entry; tags must point at one.
pub(crate) fn resolve_with(
    reference: &str,
    read_ref: impl FnOnce(&str) -> Result<Option<ImageId>, StoreError>,
    check_entry: impl FnOnce(&ImageId) -> Result<(), StoreError>,
) -> Result<ImageId, StoreError> {
    if reference.starts_with("sha256:") {
        let id: ImageId = reference
            .parse()
            .map_err(|_| StoreError::InvalidReference { reference: reference.to_owned() })?;
        check_entry(&id)?;
        return Ok(id);
    }
    if !validate_tag(reference) {
        return Err(StoreError::InvalidReference { reference: reference.to_owned() });
    }
    let id =
        read_ref(reference)?.ok_or_else(|| StoreError::UnknownImage { reference: reference.to_owned() })?;
    match check_entry(&id) {
        Err(StoreError::UnknownImage { .. }) => {
            Err(StoreError::DanglingRef { tag: reference.to_owned(), id })
        }
        other => other.map(|()| id),
    }
}

/// Jitter without an RNG dependency: std's per-process random hash keys over the clock.
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    h.write_u128(nanos);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(normalize_base("http://h:8080/p/"), "http://h:8080/p");
        assert_eq!(normalize_base("http://h"), "http://h");
        assert_eq!(join_url("http://h/p", "refs/x"), "http://h/p/refs/x");
        assert_eq!(join_url("http://h/p/", "/refs/x"), "http://h/p/refs/x");
        let s = HttpStore::new("https://cdn.example/store/", HttpConfig::default());
        let d = Sha256Digest::of(b"x");
        assert_eq!(s.blob_url(&d), format!("https://cdn.example/store/blobs/sha256/{}", d.hex()));
        let id = ImageId(d);
        assert_eq!(s.entry_url(&id), format!("https://cdn.example/store/images/{}.json", d.hex()));
        assert_eq!(s.ref_url("latest"), "https://cdn.example/store/refs/latest");
    }

    #[test]
    fn range_headers() {
        assert_eq!(range_header(0, 1).as_deref(), Some("bytes=0-0"));
        assert_eq!(range_header(100, 50).as_deref(), Some("bytes=100-149"));
        assert_eq!(range_header(5, 0), None);
        assert_eq!(range_header(u64::MAX, 2), None);
    }

    #[test]
    fn range_answers() {
        let ok = |s, cr: Option<&str>| check_range_answer(s, cr, 100, 50);
        assert_eq!(ok(206, Some("bytes 100-149/1000")).unwrap(), RangeAnswer::Partial);
        assert_eq!(ok(206, Some("bytes 100-149/*")).unwrap(), RangeAnswer::Partial);
        // A server that ignores Range answers 200 with the whole blob.
        assert_eq!(ok(200, None).unwrap(), RangeAnswer::Whole);
        for bad in [
            None,
            Some("bytes 100-148/1000"),
            Some("bytes 99-149/1000"),
            Some("bytes 100-149/149"),
            Some("items 100-149/1000"),
            Some("bytes 100-x/1000"),
            Some("bytes 100-149"),
        ] {
            assert!(matches!(ok(206, bad), Err(HttpError::BadRange(_))), "{bad:?}");
        }
        assert!(matches!(ok(416, None), Err(HttpError::BadRange(_))));
        assert!(matches!(ok(403, None), Err(HttpError::Status(403))));
    }

    #[test]
    fn retry_policy() {
        let p = RetryPolicy { attempts: 4, base: Duration::from_millis(100), max: Duration::from_secs(1) };
        // Equal jitter: within [half, full] of the exponential step, capped.
        for (retry, full) in [(0, 100), (1, 200), (2, 400), (3, 800), (4, 1000), (40, 1000)] {
            for r in [0, 1, 12_345_678, u64::MAX] {
                let d = p.backoff(retry, r);
                assert!(
                    d >= Duration::from_millis(full / 2) && d <= Duration::from_millis(full),
                    "{retry} {r} {d:?}"
                );
            }
        }
        assert_eq!(p.backoff(0, 0), Duration::from_millis(50));
        for s in [500, 502, 503, 504, 429, 408] {
            assert!(retryable_status(s));
        }
        for s in [200, 206, 400, 403, 404, 416, 501] {
            assert!(!retryable_status(s));
        }
        assert!(retryable_transport(&ureq::Error::ConnectionFailed));
        assert!(!retryable_transport(&ureq::Error::HostNotFound));
    }

    #[test]
    fn refs_and_resolution() {
        let id = ImageId(Sha256Digest::of(b"x"));
        assert_eq!(parse_ref(format!("{id}\n").as_bytes()), Some(id));
        assert_eq!(parse_ref(id.to_string().as_bytes()), None);
        let found = |_: &str| Ok(Some(id));
        assert_eq!(resolve_with("t", found, |_| Ok(())).unwrap(), id);
        assert!(matches!(
            resolve_with("t", found, |i| Err(StoreError::UnknownImage { reference: i.to_string() })),
            Err(StoreError::DanglingRef { .. })
        ));
        assert!(matches!(resolve_with("t", |_| Ok(None), |_| Ok(())), Err(StoreError::UnknownImage { .. })));
        assert!(matches!(
            resolve_with("bad tag", found, |_| Ok(())),
            Err(StoreError::InvalidReference { .. })
        ));
        assert!(matches!(
            resolve_with("sha256:zz", found, |_| Ok(())),
            Err(StoreError::InvalidReference { .. })
        ));
        assert_eq!(resolve_with(&id.to_string(), |_| Ok(None), |_| Ok(())).unwrap(), id);
    }

    #[test]
    fn unreachable_origin_is_a_typed_error_naming_the_url() {
        // Port 9 (discard) on loopback: nothing listens; connection refused, retried, then failed.
        let cfg = HttpConfig {
            retry: RetryPolicy { attempts: 2, base: Duration::from_millis(1), max: Duration::from_millis(2) },
            ..HttpConfig::default()
        };
        let s = HttpStore::new("http://127.0.0.1:9/p", cfg);
        let e = s.read_ref("latest").unwrap_err();
        assert!(
            matches!(e, StoreError::Http { ref url, .. } if url == "http://127.0.0.1:9/p/refs/latest"),
            "{e}"
        );
        assert!(e.to_string().contains("http://127.0.0.1:9/p/refs/latest"));
    }
}
