//! A read-only store behind any static HTTP server: `http(s)://HOST[:PORT][/PREFIX]`.
//!
//! The server holds the store layout of `docs/formats/store.md` under PREFIX: `images/<id>.json`,
//! `refs/<tag>`, `blobs/sha256/<hex>`. Whole blobs (records, prefixes, pack indexes) are fetched
//! with GET and checked against their sha256; chunk bytes are fetched with `Range` GETs
//! ([`ChunkSource`]), several near ranges of one pack in one request
//! ([`HttpStore::read_blob_ranges`]). One connection-pooled client (ureq, rustls) per store, at
//! most [`HttpConfig::max_concurrency`] requests in flight; connect, first-byte, stall and
//! whole-request timeouts; bounded retries with exponential backoff and jitter
//! ([`RetryPolicy`], shared with the registry client) on 5xx, 408, 429, transport failures and
//! bodies that break, come up short or fail their digest. Every error names the URL. Design and
//! settings: `docs/store.md`.
//!
//! The URL building, the Range header, the validation of a ranged answer, coalescing and the
//! settings are pure functions, tested without a server.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use tessera_image::{validate_tag, ImageEntry, ImageId, Sha256Digest};
use tessera_metrics::Histogram;
pub use tessera_transport::RetryPolicy;
use tessera_transport::{
    ErrorKind, Failure, FetchError, HttpVersion, Method, Request, Response, Stats, Timeouts, TlsOptions,
    Transport, TransportConfig, TransportError,
};
use tracing::{debug, trace, warn};

use super::byteranges;
use super::s3::S3Auth;
use super::sigv4::EMPTY_SHA256;
use crate::cache::{BlobFileError, DiskCache};
use crate::error::StoreError;
use crate::read_store::BlobSink;
use crate::refs::{RefParts, RefText};
use crate::source::{ChunkSource, RangeGot, RangeSink};

/// Largest whole blob (record, prefix, pack index) fetched into memory: 1 GiB.
pub const MAX_HTTP_BLOB: u64 = 1 << 30;
/// Largest whole pack streamed into the disk cache from a server that ignores Range: 16 GiB.
const MAX_HTTP_PACK: u64 = 16 << 30;
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
    #[error("transport")]
    Transport(#[source] TransportError),
    /// The answer to a ranged GET does not describe the bytes asked for.
    #[error("bad ranged answer: {0}")]
    BadRange(&'static str),
    /// The body is longer than allowed, or shorter than announced.
    #[error("bad body length: {0}")]
    BadLength(&'static str),
    /// The server answered a Range request with 200 and the whole blob, and there is no disk
    /// cache to keep whole blobs in.
    #[error(
        "the server ignores Range requests (it answered a ranged GET with 200 and the whole blob), so \
         every chunk read would download its whole pack; serve the store from a server that honours \
         Range (nginx, any CDN), or pass --cache-dir DIR to fetch each pack whole once into the cache \
         and read chunks from there"
    )]
    RangeIgnored,
    /// The server ignores Range and a pack is larger than the whole disk cache bound.
    #[error(
        "the server ignores Range requests, and this pack ({len} bytes) is larger than the whole \
         --cache-size ({bound} bytes) it would have to be kept in"
    )]
    PackTooLarge { len: u64, bound: u64 },
    /// An S3 server refused the request: the operation, the bucket, S3's error code and
    /// message, and what to do about it.
    #[error("{0}")]
    S3(Box<S3Refusal>),
}

/// What an S3 server said when it refused a request ([`HttpError::S3`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Refusal {
    /// The S3 operation (`GetObject`, `PutObject`, …).
    pub op: &'static str,
    pub bucket: String,
    pub status: u16,
    /// S3's error code (`NoSuchBucket`, `SignatureDoesNotMatch`, …; empty without a body).
    pub code: String,
    pub message: String,
}

impl std::fmt::Display for S3Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let code = if self.code.is_empty() { "no error code" } else { &self.code };
        write!(
            f,
            "S3 {} in bucket {} failed: {code} (HTTP {}){}",
            self.op,
            self.bucket,
            self.status,
            s3_detail(&self.message, &self.code)
        )
    }
}

fn s3_detail(message: &str, code: &str) -> String {
    let mut out = String::new();
    if !message.is_empty() {
        out.push_str(": ");
        out.push_str(message);
    }
    let hint = super::s3::s3_hint(code);
    if !hint.is_empty() {
        out.push_str(" — ");
        out.push_str(hint);
    }
    out
}

impl HttpError {
    /// The HTTP status of a refusal (plain or S3), if it is one.
    pub fn status(&self) -> Option<u16> {
        match self {
            HttpError::Status(s) => Some(*s),
            HttpError::S3(r) => Some(r.status),
            _ => None,
        }
    }
}

/// What a server has shown of its `Range` support (the first ranged GET finds out).
/// [`HttpConfig::blob_piece`] by default.
pub const DEFAULT_BLOB_PIECE: u64 = 96 << 10;

/// The most ranged GETs one whole-blob read is split into ([`HttpConfig::blob_piece`]).
pub const MAX_BLOB_PIECES: usize = 16;

/// The largest piece of a streamed whole blob ([`HttpStore::read_blob_streamed`]): what a fresh
/// TCP connection carries in two round trips (Linux's initial window of 10 segments of 1448
/// bytes, then 20: 43 440 bytes, less an answer's head), one round trip sooner than a
/// [`DEFAULT_BLOB_PIECE`]. A streamed blob's reader has work to do as its bytes arrive (a
/// metadata prefix: 0.5 MB inflating to 14 MB, hashed: ~25 ms of one CPU), so it is worth its
/// bytes arriving before the other blobs' and that work overlapping their transfer.
pub const STREAMED_BLOB_PIECE: u64 = 40 << 10;

const RANGE_UNKNOWN: u8 = 0;
const RANGE_HONORED: u8 = 1;
const RANGE_IGNORED: u8 = 2;

/// Whether the origin answers a GET of several ranges with them ([`Inner::multi_range`]): not
/// tried yet, yes (`multipart/byteranges`, or one part holding them all), or no (anything else:
/// separate requests from then on).
const MULTI_UNKNOWN: u8 = 0;
const MULTI_HONORED: u8 = 1;
const MULTI_REFUSED: u8 = 2;

/// Most ranges one multi-range GET asks for (its `Range` header stays within ~2 KB, below every
/// server's header limit).
pub const MAX_RANGES_PER_REQUEST: usize = 64;

/// Bytes a `multipart/byteranges` answer may add to the ranges' own: its delimiters and part
/// headers, per part.
const MULTIPART_OVERHEAD_PER_PART: u64 = 512;

/// Client settings of an [`HttpStore`]. Every field documents its default; [`Self::from_vars`]
/// reads overrides from `TESSERA_HTTP_*` variables (`docs/store.md`; the binary passes its
/// environment).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpConfig {
    /// TCP (and TLS) connect timeout (default 5 s).
    pub connect_timeout: Duration,
    /// From the request sent to the response head received (default 10 s): a server that
    /// accepts and then says nothing is given up on (and retried) long before
    /// `request_timeout`.
    pub first_byte_timeout: Duration,
    /// Longest wait for the next bytes of a body in progress (default 30 s).
    pub stall_timeout: Duration,
    /// Timeout of one whole request, body included (default 120 s).
    pub request_timeout: Duration,
    /// Retries on 5xx, 408, 429 and transport failures, body failures included (the one policy
    /// of `tessera_transport`).
    pub retry: RetryPolicy,
    /// Trusted roots and verification (`--ca-file`, `--insecure`).
    pub tls: TlsOptions,
    /// Requests in flight to this origin at most (default 48); also the idle connections
    /// kept for reuse. Enough for a start's parallel pieces (~37 for an image of 18 000
    /// chunks) and the cold reads of a booting guest to proceed in parallel, few enough not to
    /// flood one server.
    pub max_concurrency: usize,
    /// Ranges of one blob read together ([`HttpStore::read_blob_ranges`]) share one request
    /// when at most this many bytes separate them (default 0: only adjacent ranges). A gap is
    /// fetched and dropped; when several processes share one disk cache, the gap's chunks are
    /// fetched again by whoever needs them, and no byte should cross the network twice.
    pub coalesce_gap: u64,
    /// Largest span one coalesced request covers (default 16 MiB).
    pub coalesce_max: u64,
    /// Most separate spans of one blob asked for in one multi-range GET (default
    /// [`MAX_RANGES_PER_REQUEST`]; 1: never several, one request per span).
    pub multi_range_max: usize,
    /// How long a single chunk read waits for concurrent reads of the same pack to join it in
    /// one request, when another single chunk read is already under way (default 2 ms; zero
    /// turns joining off). A read with no other under way goes at once.
    pub coalesce_wait: Duration,
    /// Connections opened at the store's first request, alongside it (default 0: none; `tessera
    /// serve --preconnect N` sets it, 3 by default): TCP connects and TLS handshakes, no request
    /// ([`Transport::preconnect`]), so the requests that follow — a daemon's parallel start
    /// fetches and first misses — that need a new connection find one open instead of paying a
    /// connect round trip (and a TLS handshake) each. A store that is never asked anything
    /// opens none.
    pub preconnect: usize,
    /// A whole blob (an image's record, prefix and pack index at a start; a pack a copy reads)
    /// from an origin known to honor Range is fetched as parallel ranged GETs
    /// ([`HttpStore::read_blob_streamed`]): its first `2 × blob_piece` bytes, and once that
    /// head says how long the blob is, the rest in pieces of about `blob_piece` bytes (at most
    /// [`MAX_BLOB_PIECES`] in all), each on a connection of its own. A fresh TCP connection's
    /// first round trips carry little (slow start from Linux's initial window of 10 segments,
    /// doubling each round trip: 14.6 KB, then 44, 102, 219, 453 KB in all), so a megabyte on
    /// one new connection takes seven round trips. With the default, 96 KiB (three round trips
    /// on a fresh connection) and a first piece of 192 KiB (four, the first of them overlapping
    /// the rest's wait for its head), a blob of up to 1.6 MB is in after four round trips,
    /// given a preconnected connection for each piece (`serve --preconnect`). A streamed blob
    /// (the prefix, decompressed as it arrives) goes in pieces of at most
    /// [`STREAMED_BLOB_PIECE`]. 0: whole blobs go in one GET.
    pub blob_piece: u64,
    /// The HTTP versions spoken (`--http-version`; default HTTP/1.1 only). With
    /// [`HttpVersion::Negotiate`] an `https://` origin that offers HTTP/2 carries every request
    /// in flight on one connection.
    pub http: HttpVersion,
    /// Fetch the chunks of the image's prefetch profile that a ref names at once, while the
    /// start fetches the image's metadata ([`HttpStore::stage`]; default off: `tessera serve`
    /// turns it on when it prefetches the profile and keeps no disk cache or one that holds no
    /// chunk yet — a cache that holds them already would make the fetch a waste).
    pub stage_profile: bool,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            first_byte_timeout: Duration::from_secs(10),
            stall_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(120),
            retry: RetryPolicy::default(),
            tls: TlsOptions::default(),
            max_concurrency: 48,
            coalesce_gap: 0,
            coalesce_max: 16 << 20,
            multi_range_max: MAX_RANGES_PER_REQUEST,
            coalesce_wait: Duration::from_millis(2),
            preconnect: 0,
            blob_piece: DEFAULT_BLOB_PIECE,
            http: HttpVersion::Http1,
            stage_profile: false,
        }
    }
}

/// The environment variables [`HttpConfig::from_env`] reads, with the field each sets.
pub const HTTP_ENV: [&str; 12] = [
    "TESSERA_HTTP_CONNECT_TIMEOUT",
    "TESSERA_HTTP_FIRST_BYTE_TIMEOUT",
    "TESSERA_HTTP_STALL_TIMEOUT",
    "TESSERA_HTTP_TIMEOUT",
    "TESSERA_HTTP_RETRIES",
    "TESSERA_HTTP_CONCURRENCY",
    "TESSERA_HTTP_COALESCE_GAP",
    "TESSERA_HTTP_COALESCE_MAX",
    "TESSERA_HTTP_COALESCE_WAIT",
    "TESSERA_HTTP_RESEND_LATE",
    "TESSERA_HTTP_MULTI_RANGE",
    "TESSERA_HTTP_BLOB_PIECE",
];

impl HttpConfig {
    /// The defaults, overridden by the `TESSERA_HTTP_*` variables ([`HTTP_ENV`]) that `get`
    /// finds: timeouts as `250ms` or `5s`; `TESSERA_HTTP_RETRIES` the attempts in all (≥ 1);
    /// `TESSERA_HTTP_CONCURRENCY` ≥ 1; the coalescing sizes in bytes; `TESSERA_HTTP_RESEND_LATE`
    /// the floor of [`RetryPolicy::resend_late`] or `off`; `TESSERA_HTTP_MULTI_RANGE` the most
    /// spans per multi-range GET (1: none, ≤ [`MAX_RANGES_PER_REQUEST`]); `TESSERA_HTTP_BLOB_PIECE`
    /// [`Self::blob_piece`] in bytes (0: whole blobs in one GET). A malformed value is an
    /// error naming the variable. Pure: the binary passes its environment.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, StoreError> {
        let mut c = Self::default();
        let bad = |name: &str, value: &str, expected: &'static str| StoreError::BadSetting {
            name: name.to_owned(),
            value: value.to_owned(),
            expected,
        };
        let duration = |name: &str, slot: &mut Duration| -> Result<(), StoreError> {
            if let Some(v) = get(name) {
                *slot = parse_duration(&v).ok_or_else(|| bad(name, &v, "a duration like 250ms or 5s"))?;
            }
            Ok(())
        };
        duration(HTTP_ENV[0], &mut c.connect_timeout)?;
        duration(HTTP_ENV[1], &mut c.first_byte_timeout)?;
        duration(HTTP_ENV[2], &mut c.stall_timeout)?;
        duration(HTTP_ENV[3], &mut c.request_timeout)?;
        let number = |name: &str| -> Result<Option<u64>, StoreError> {
            get(name)
                .map(|v| {
                    v.trim()
                        .parse::<u64>()
                        .ok()
                        .filter(|&n| n >= 1)
                        .ok_or_else(|| bad(name, &v, "an integer ≥ 1"))
                })
                .transpose()
        };
        if let Some(n) = number(HTTP_ENV[4])? {
            c.retry.attempts = u32::try_from(n).unwrap_or(u32::MAX);
        }
        if let Some(n) = number(HTTP_ENV[5])? {
            c.max_concurrency = usize::try_from(n).unwrap_or(usize::MAX);
        }
        if let Some(v) = get(HTTP_ENV[6]) {
            c.coalesce_gap = v.trim().parse().map_err(|_| bad(HTTP_ENV[6], &v, "a number of bytes"))?;
        }
        if let Some(n) = number(HTTP_ENV[7])? {
            c.coalesce_max = n;
        }
        duration(HTTP_ENV[8], &mut c.coalesce_wait)?;
        if let Some(n) = number(HTTP_ENV[10])? {
            c.multi_range_max = usize::try_from(n).unwrap_or(usize::MAX).min(MAX_RANGES_PER_REQUEST);
        }
        if let Some(v) = get(HTTP_ENV[11]) {
            c.blob_piece = v.trim().parse().map_err(|_| bad(HTTP_ENV[11], &v, "a number of bytes"))?;
        }
        if let Some(v) = get(HTTP_ENV[9]) {
            c.retry.resend_late = match v.trim() {
                "off" => None,
                d => Some(
                    parse_duration(d).ok_or_else(|| bad(HTTP_ENV[9], &v, "a duration like 50ms, or off"))?,
                ),
            };
        }
        Ok(c)
    }
}

impl HttpConfig {
    /// The transport settings of these.
    pub fn transport(&self) -> TransportConfig {
        TransportConfig {
            timeouts: Timeouts {
                connect: self.connect_timeout,
                first_byte: self.first_byte_timeout,
                stall: self.stall_timeout,
                whole: Some(self.request_timeout),
            },
            retry: self.retry,
            max_concurrency: self.max_concurrency,
            tls: self.tls.clone(),
            http: self.http,
        }
    }
}

/// `250ms`, `5s` (whole numbers only).
fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    if let Some(ms) = s.strip_suffix("ms") {
        return ms.parse().ok().map(Duration::from_millis);
    }
    s.strip_suffix('s')?.parse().ok().map(Duration::from_secs)
}

/// Single chunk reads of one pack that arrive together, gathered into one
/// [`HttpStore::read_blob_ranges`] call by the first of them (the leader).
#[derive(Default)]
struct Batch {
    state: Mutex<BatchState>,
    done: Condvar,
}

#[derive(Default)]
struct BatchState {
    ranges: Vec<(u64, u32)>,
    /// Set by the leader: the bytes of every range, or `None` if the fetch failed (each
    /// follower then reads its range alone, to get its own error or a lucky retry).
    result: Option<Option<Arc<Vec<Vec<u8>>>>>,
}

/// One span of a blob fetched by one request, covering some of the ranges asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoalescedSpan {
    /// Blob offset of the span.
    pub offset: u64,
    /// Length of the span.
    pub len: u64,
    /// Indexes (into the ranges asked for) of the ranges inside the span.
    pub members: Vec<usize>,
}

/// Group `ranges` (`(offset, len)`, any order, overlaps allowed) into spans, one request each:
/// sorted by offset, a range joins the current span when it starts at most `max_gap` bytes
/// after the span's end and the span stays within `max_span` bytes (a single range longer than
/// `max_span` is a span of its own). Empty ranges belong to no span. Pure.
pub fn coalesce(ranges: &[(u64, u32)], max_gap: u64, max_span: u64) -> Vec<CoalescedSpan> {
    let mut order: Vec<usize> = (0..ranges.len()).filter(|&i| ranges[i].1 > 0).collect();
    order.sort_by_key(|&i| (ranges[i].0, ranges[i].1));
    let mut spans: Vec<CoalescedSpan> = Vec::new();
    for i in order {
        let (offset, len) = ranges[i];
        let end = offset.saturating_add(u64::from(len));
        if let Some(span) = spans.last_mut() {
            let span_end = span.offset.saturating_add(span.len);
            let new_end = span_end.max(end);
            if offset <= span_end.saturating_add(max_gap) && new_end - span.offset <= max_span {
                span.len = new_end - span.offset;
                span.members.push(i);
                continue;
            }
        }
        spans.push(CoalescedSpan { offset, len: end - offset, members: vec![i] });
    }
    spans
}

/// Normalize a base URL: no trailing slashes (the prefix may be empty).
pub fn normalize_base(url: &str) -> String {
    url.trim_end_matches('/').to_owned()
}

/// The URL of `path` (relative, no leading slash) under `base`.
pub fn join_url(base: &str, path: &str) -> String {
    format!("{}/{}", base.trim_end_matches('/'), path.trim_start_matches('/'))
}

/// What the threads of a blob read in pieces tell its reader.
enum PieceNews {
    /// The blob's length, from the first piece's answer head.
    Length(u64),
    /// Piece `k` is asked again: what it sent before is void.
    Attempt(usize),
    /// The next bytes of piece `k`.
    Bytes(usize, Vec<u8>),
    /// Piece `k` is in (the blob's length), or failed.
    Done(usize, Result<u64, StoreError>),
}

/// The pieces (`(offset, len)`) of a `total`-byte blob after its first `done` bytes: about
/// `piece` bytes each, at most [`MAX_BLOB_PIECES`] − 1 of them (longer ones for a long blob),
/// none empty.
pub fn rest_of_blob(done: u64, total: u64, piece: u64) -> Vec<(u64, u64)> {
    let rest = total.saturating_sub(done);
    if rest == 0 || piece == 0 {
        return Vec::new();
    }
    let count = rest.div_ceil(piece).min(MAX_BLOB_PIECES as u64 - 1);
    let each = rest.div_ceil(count);
    (0..count)
        .map(|i| done + i * each)
        .take_while(|&offset| offset < total)
        .map(|offset| (offset, each.min(total - offset)))
        .collect()
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
        // Some S3-compatible servers (gofakes3, under `rclone serve s3`) send the range with a
        // 200: its Content-Range says which bytes the body is.
        200 if content_range.is_some() => check_range_answer(206, content_range, offset, len),
        200 => Ok(RangeAnswer::Whole),
        206 => {
            let cr = content_range.ok_or(HttpError::BadRange("206 without Content-Range"))?;
            let (first, last) = byteranges::content_range(cr.trim())?;
            let want_last =
                offset.checked_add(len.saturating_sub(1)).ok_or(HttpError::BadRange("range overflows"))?;
            if first != offset || last != want_last {
                return Err(HttpError::BadRange("Content-Range is not the range asked for"));
            }
            Ok(RangeAnswer::Partial)
        }
        416 => Err(HttpError::BadRange("416: the range is outside the blob")),
        s => Err(HttpError::Status(s)),
    }
}

/// A read-only store served over HTTP(S). Cheap to clone (the connection pool, the concurrency
/// limit and the counters are shared).
#[derive(Clone)]
pub struct HttpStore {
    inner: Arc<Inner>,
}

struct Inner {
    base: String,
    config: HttpConfig,
    transport: Transport,
    /// Open batches of single chunk reads, by pack; a batch leaves the map when its leader
    /// sends it.
    batches: Mutex<std::collections::HashMap<Sha256Digest, Arc<Batch>>>,
    /// Single chunk reads ([`HttpStore::read_chunk_range`]) under way: a read arriving while
    /// another is may be part of a burst, and waits for more to join.
    chunk_reads: std::sync::atomic::AtomicUsize,
    /// Tags resolved through this store (an HTTP server cannot list `refs/`).
    seen_refs: Mutex<Vec<(String, ImageId)>>,
    /// The prefix and pack index the refs read so far named, by image.
    ref_parts: Mutex<std::collections::HashMap<ImageId, RefParts>>,
    /// The lengths of blobs the refs read so far named (unchecked: a piece's answer that says
    /// otherwise makes the blob be read whole).
    blob_lengths: Mutex<std::collections::HashMap<Sha256Digest, u64>>,
    /// Image entries fetched so far, by ID: an ID names its content, so resolving a reference
    /// and then opening the image fetch the entry once.
    entries: Mutex<std::collections::HashMap<ImageId, ImageEntry>>,
    /// [`RANGE_UNKNOWN`], [`RANGE_HONORED`] or [`RANGE_IGNORED`].
    range_support: AtomicU8,
    /// Held by ranged reads while the support is unknown: the first answer decides, before a
    /// burst of concurrent reads could each pull a whole pack from a server that ignores Range.
    range_probe: Mutex<()>,
    /// [`MULTI_UNKNOWN`], [`MULTI_HONORED`] or [`MULTI_REFUSED`].
    multi_range: AtomicU8,
    /// Where whole packs go when the server ignores Range (`--cache-dir`).
    whole_blobs: Option<DiskCache>,
    /// Signs every request and explains refusals (an `s3://` store).
    auth: Option<Arc<S3Auth>>,
    /// Connections still to open at the first request ([`HttpConfig::preconnect`]; 0 once done).
    preconnect: std::sync::atomic::AtomicUsize,
    /// Stored ranges fetched ahead of their readers ([`HttpStore::stage`]).
    staging: super::staged::Staging,
}

impl std::fmt::Debug for HttpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpStore")
            .field("base", &self.inner.base)
            .field("config", &self.inner.config)
            .finish()
    }
}

impl HttpStore {
    /// A store at `base` (`http(s)://HOST[:PORT][/PREFIX]`). Nothing is fetched yet.
    pub fn new(base: &str, config: HttpConfig) -> Self {
        Self::with_cache(base, config, None)
    }

    /// [`Self::new`], keeping whole packs in `cache` if the server turns out to ignore `Range`
    /// (each fetched once per host, chunks then read from the cached file); without a cache such a
    /// server is refused ([`HttpError::RangeIgnored`]).
    pub fn with_cache(base: &str, config: HttpConfig, cache: Option<DiskCache>) -> Self {
        Self::with_auth(base, config, cache, None)
    }

    /// [`Self::with_cache`], every request signed by `auth` (an `s3://` store's read path).
    pub(crate) fn with_auth(
        base: &str,
        config: HttpConfig,
        cache: Option<DiskCache>,
        auth: Option<Arc<S3Auth>>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                base: normalize_base(base),
                transport: Transport::new(config.transport()),
                batches: Mutex::new(Default::default()),
                chunk_reads: std::sync::atomic::AtomicUsize::new(0),
                seen_refs: Mutex::new(Vec::new()),
                ref_parts: Mutex::default(),
                blob_lengths: Mutex::default(),
                entries: Mutex::new(Default::default()),
                range_support: AtomicU8::new(RANGE_UNKNOWN),
                range_probe: Mutex::new(()),
                multi_range: AtomicU8::new(MULTI_UNKNOWN),
                whole_blobs: cache,
                auth,
                preconnect: std::sync::atomic::AtomicUsize::new(config.preconnect),
                staging: Default::default(),
                config,
            }),
        }
    }

    /// The base URL, without a trailing slash.
    pub fn base(&self) -> &str {
        &self.inner.base
    }

    /// The settings.
    pub fn config(&self) -> &HttpConfig {
        &self.inner.config
    }

    /// Requests, retries, body bytes and failed attempts so far.
    pub fn stats(&self) -> Stats {
        self.inner.transport.stats()
    }

    /// The transport (its counters and duration histogram).
    pub fn transport(&self) -> &Transport {
        &self.inner.transport
    }

    /// The transport's request-duration histogram ([`Transport::latency_histogram`]).
    pub fn latency_histogram(&self) -> Histogram {
        self.inner.transport.latency_histogram()
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

    /// GET `url` (with `range` as its Range header) and hand each answer to `on_response`,
    /// within the transport's retry loop ([`Transport::fetch`]): whatever part failed (the
    /// request, the status, or reading and checking the body in `on_response`) is retried per
    /// the policy.
    ///
    /// A signed store (`s3://`) signs each request; a refusal that re-reading the credentials
    /// may cure (an expired token, a rotated key) is signed again and sent once more.
    fn fetch<T>(
        &self,
        url: &str,
        range: Option<&str>,
        mut on_response: impl FnMut(Response) -> Result<T, Failure<StoreError>>,
    ) -> Result<T, StoreError> {
        self.preconnect();
        let plain: Vec<(&str, &str)> = range.map(|r| ("Range", r)).into_iter().collect();
        let mut refreshed = false;
        loop {
            let signed = match &self.inner.auth {
                Some(auth) => auth.sign(Method::Get, url, &plain, EMPTY_SHA256),
                None => Vec::new(),
            };
            let mut headers = plain.clone();
            headers.extend(signed.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            let req = Request::get(url).headers(&headers);
            let out = self.inner.transport.fetch(&req, &mut on_response).map_err(|e| match e {
                FetchError::Transport(t) => http_err(url, HttpError::Transport(t)),
                FetchError::Rejected(e) => e,
            });
            if let (Err(StoreError::Http { source: HttpError::S3(r), .. }), Some(auth)) =
                (&out, &self.inner.auth)
            {
                if !refreshed && auth.refresh_after(r.status, &r.code) {
                    refreshed = true;
                    debug!(url, "credentials changed: signing again");
                    continue;
                }
            }
            return out;
        }
    }

    /// At the first request, open [`HttpConfig::preconnect`] connections on a thread of their
    /// own, which closes those no request took once they are too old to be used.
    fn preconnect(&self) {
        let n = self.inner.preconnect.swap(0, Ordering::Relaxed);
        if n == 0 {
            return;
        }
        let (transport, url) = (self.inner.transport.clone(), format!("{}/", self.inner.base));
        let spawned = std::thread::Builder::new().name("preconnect".into()).spawn(move || {
            transport.preconnect(&url, n);
            std::thread::sleep(Transport::PRECONNECTED_MAX_AGE);
            transport.expire_preconnected();
        });
        if let Err(e) = spawned {
            debug!(error = %e, "no preconnect thread");
        }
    }

    /// The failure for an answer with an unexpected status: for a signed store, S3's error
    /// (its XML body read); otherwise the status. Final.
    fn refused(&self, url: &str, resp: &mut Response) -> Failure<StoreError> {
        match &self.inner.auth {
            Some(auth) => {
                let body = resp.read_to_vec(MAX_SMALL_DOC).ok().flatten().unwrap_or_default();
                let e = auth.error(Method::Get, url, resp.status(), &body);
                Failure::fatal(ErrorKind::Status, http_err(url, e))
            }
            None => status_failure(url, resp.status()),
        }
    }

    /// GET a small document (entry, ref); `None` on 404 (for a signed store: a missing key,
    /// not a missing bucket).
    fn get_small(&self, url: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.fetch(url, None, |mut resp| match resp.status() {
            404 if self.inner.auth.is_none() => Ok(None),
            404 => match self.refused(url, &mut resp) {
                Failure { error: StoreError::Http { source: HttpError::S3(ref r), .. }, .. }
                    if r.code == "NoSuchKey" || r.code.is_empty() =>
                {
                    Ok(None)
                }
                f => Err(f),
            },
            200 => {
                // A tag's answer saying it settles Range support before the image's parts are
                // asked for, so those can go in pieces ([`Self::read_blob_streamed`]).
                self.note_accept_ranges(&resp);
                read_body(url, &mut resp, MAX_SMALL_DOC).map(Some)
            }
            _ => Err(self.refused(url, &mut resp)),
        })
    }

    /// The entry of image `id` ([`StoreError::UnknownImage`] on 404), fetched once per store:
    /// later calls answer from memory.
    pub fn get_entry(&self, id: &ImageId) -> Result<ImageEntry, StoreError> {
        if let Some(entry) = self.inner.entries.lock().unwrap_or_else(|p| p.into_inner()).get(id) {
            return Ok(entry.clone());
        }
        let url = self.entry_url(id);
        let bytes =
            self.get_small(&url)?.ok_or_else(|| StoreError::UnknownImage { reference: id.to_string() })?;
        let entry = ImageEntry::from_json(&bytes)
            .map_err(|source| StoreError::BadEntry { path: url.into(), source })?;
        self.inner.entries.lock().unwrap_or_else(|p| p.into_inner()).insert(*id, entry.clone());
        Ok(entry)
    }

    /// Read `refs/<tag>` (`None` on 404). The prefix and pack index it names, if it does, are
    /// kept for [`Self::ref_parts`], and the lengths it gives for reading those blobs in pieces;
    /// with [`HttpConfig::stage_profile`], the profile's ranges it names are fetched now
    /// ([`Self::stage`]).
    pub fn read_ref(&self, tag: &str) -> Result<Option<ImageId>, StoreError> {
        let url = self.ref_url(tag);
        let Some(text) = self.get_small(&url)? else { return Ok(None) };
        let r = RefText::parse(&text).ok_or(StoreError::BadRef { path: url.into() })?;
        if self.inner.config.stage_profile && !r.profile.is_empty() {
            self.stage(&r.profile);
        }
        if let Some(parts) = r.parts {
            self.inner.ref_parts.lock().unwrap_or_else(|p| p.into_inner()).insert(r.id, parts);
            if let Some(l) = r.lengths {
                let mut known = self.inner.blob_lengths.lock().unwrap_or_else(|p| p.into_inner());
                known.insert(r.id.digest(), l.record);
                known.insert(parts.prefix, l.prefix);
                known.insert(parts.pack_index, l.pack_index);
            }
        }
        Ok(Some(r.id))
    }

    /// The prefix and pack index of image `id` as a ref read through this store named them
    /// (unchecked: [`crate::ReadStore::ref_parts`]).
    pub fn ref_parts(&self, id: &ImageId) -> Option<RefParts> {
        self.inner.ref_parts.lock().unwrap_or_else(|p| p.into_inner()).get(id).copied()
    }

    /// Resolve `sha256:<64 hex>` (its entry must exist) or a tag.
    pub fn resolve(&self, reference: &str) -> Result<ImageId, StoreError> {
        resolve_with(reference, |tag| self.read_ref(tag), |id| self.get_entry(id).map(|_| ()))
            .inspect(|id| self.note_ref(reference, id))
    }

    /// [`Self::resolve`] without the check that the image's entry exists (the caller opens the
    /// image next, which fetches the entry: [`crate::ReadStore::resolve_to_open`]).
    pub fn resolve_unchecked(&self, reference: &str) -> Result<ImageId, StoreError> {
        resolve_with(reference, |tag| self.read_ref(tag), |_| Ok(()))
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

    /// A blob answer saying `Accept-Ranges: bytes` settles the Range support before the first
    /// ranged GET (nginx says it; Python's `http.server`, which ignores Range, does not), so a
    /// burst of cold reads does not wait a round trip for a probe. A server that says it and
    /// ignores Range anyway is still found out by its first `200` to a ranged GET.
    fn note_accept_ranges(&self, resp: &Response) {
        let says = resp
            .header("accept-ranges")
            .is_some_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("bytes")));
        if says {
            let _ = self.inner.range_support.compare_exchange(
                RANGE_UNKNOWN,
                RANGE_HONORED,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
    }

    /// The whole blob `digest`, checked against its sha256 (bytes that do not match are
    /// fetched again, within the retry policy, then reported as [`StoreError::Corrupt`]).
    pub fn read_blob(&self, digest: &Sha256Digest) -> Result<Vec<u8>, StoreError> {
        if self.in_pieces() {
            let mut bytes = Vec::new();
            if self.read_blob_pieces(digest, &mut bytes, self.inner.config.blob_piece) {
                return Ok(bytes);
            }
        }
        let url = self.blob_url(digest);
        let bytes = self.fetch(&url, None, |mut resp| {
            if resp.status() != 200 {
                return Err(self.refused(&url, &mut resp));
            }
            self.note_accept_ranges(&resp);
            let bytes = read_body(&url, &mut resp, MAX_HTTP_BLOB)?;
            StoreError::check_sha256("blob", digest, &bytes, || url.clone().into())
                .map_err(|e| Failure::retry(ErrorKind::Digest, e))?;
            Ok(bytes)
        })?;
        trace!(%digest, len = bytes.len(), "fetched blob");
        Ok(bytes)
    }

    /// [`Self::read_blob`] fed to `sink` as it comes off the connection
    /// ([`crate::ReadStore::read_blob_streamed`]): hashed on the way, checked at its end; an
    /// attempt that fails (a broken body, bytes that do not match) is retried from
    /// [`BlobSink::restart`].
    ///
    /// From an origin known to honor Range (a `bytes` `Accept-Ranges` or a 206 seen), both go
    /// in parallel pieces ([`HttpConfig::blob_piece`], at most [`STREAMED_BLOB_PIECE`] here:
    /// `sink`'s work starts sooner; it is fed in order as each piece and those before it are
    /// in); whatever does not fit that plan (a piece that fails, an answer
    /// that is not the piece asked for, bytes that do not match) is read again whole, as here.
    pub fn read_blob_streamed(
        &self,
        digest: &Sha256Digest,
        sink: &mut dyn BlobSink,
    ) -> Result<(), StoreError> {
        use sha2::Digest;
        let piece = self.inner.config.blob_piece.min(STREAMED_BLOB_PIECE);
        if self.in_pieces() && self.read_blob_pieces(digest, sink, piece) {
            return Ok(());
        }
        let url = self.blob_url(digest);
        self.fetch(&url, None, |mut resp| {
            if resp.status() != 200 {
                return Err(self.refused(&url, &mut resp));
            }
            self.note_accept_ranges(&resp);
            sink.restart();
            let (mut hasher, mut total) = (sha2::Sha256::new(), 0u64);
            let mut piece = vec![0u8; 64 << 10];
            let body = resp.reader();
            loop {
                let n = match body.read(&mut piece) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(broken_body(&url, e)),
                };
                total += n as u64;
                if total > MAX_HTTP_BLOB {
                    let e = http_err(&url, HttpError::BadLength("the body exceeds the limit"));
                    return Err(Failure::fatal(ErrorKind::Body, e));
                }
                hasher.update(&piece[..n]);
                sink.feed(&piece[..n]);
            }
            let actual = Sha256Digest(hasher.finalize().into());
            if actual != *digest {
                let reason = format!("its content hashes to {actual}");
                let e =
                    StoreError::Corrupt { what: "blob", digest: *digest, path: url.clone().into(), reason };
                return Err(Failure::retry(ErrorKind::Digest, e));
            }
            trace!(%digest, len = total, "fetched blob, streamed");
            Ok(())
        })
    }

    /// Whether whole blobs go in pieces: configured, and the origin known to honor Range.
    fn in_pieces(&self) -> bool {
        self.inner.config.blob_piece > 0 && self.inner.range_support.load(Ordering::Acquire) == RANGE_HONORED
    }

    /// Blob `digest` as parallel ranged GETs ([`HttpConfig::blob_piece`]), fed to `sink` in
    /// order — the piece due next as its bytes arrive, the others once those before them are
    /// in — and checked against its digest. All pieces go at once when a ref gave the blob's
    /// length; else the first, and the rest once its answer's head gives the length. `false`:
    /// not read that way (a piece failed or did not fit the plan, or the bytes do not match):
    /// the caller reads it whole, which restarts `sink` and retries and reports as a single GET
    /// does.
    fn read_blob_pieces(&self, digest: &Sha256Digest, sink: &mut dyn BlobSink, piece: u64) -> bool {
        use sha2::Digest;
        let url = self.blob_url(digest);
        let known = self.inner.blob_lengths.lock().unwrap_or_else(|p| p.into_inner()).get(digest).copied();
        // With a length a ref gave, the whole plan: the blob tiled from its first byte.
        let mut plan = known.filter(|&t| t > 0 && t <= MAX_HTTP_BLOB).map(|t| (t, rest_of_blob(0, t, piece)));
        let first = plan.as_ref().and_then(|(_, p)| p.first()).map_or(piece.saturating_mul(2), |p| p.1);
        // Set once the blob is to be read whole: the pieces still running stop reading.
        let stop = std::sync::atomic::AtomicBool::new(false);
        sink.restart();
        let read = std::thread::scope(|s| {
            let (tx, rx) = std::sync::mpsc::channel::<PieceNews>();
            // Whether piece `k` is on its way (a thread the system refuses fails the blob's
            // pieces, not the read). Each ends with its `Done`, a panic included.
            let spawn = |k: usize, offset: u64, len: u64| -> bool {
                let (tx, url, stop) = (tx.clone(), &url, &stop);
                let spawned =
                    std::thread::Builder::new().name("blob-piece".into()).spawn_scoped(s, move || {
                        let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            self.read_piece(url, k, offset, len, &tx, stop)
                        }));
                        let read = read.unwrap_or_else(|_| {
                            Err(http_err(url, HttpError::BadRange("a piece's reader panicked")))
                        });
                        let _ = tx.send(PieceNews::Done(k, read));
                    });
                spawned.is_ok()
            };
            if !spawn(0, 0, first) {
                return false;
            }
            let (mut total, mut pending, mut failed) = (None, 1usize, false);
            // Per piece: bytes held until the pieces before it are in; whether it is in; whether
            // any of its bytes went to the sink.
            let (mut held, mut done, mut streamed) = (vec![Vec::new()], vec![false], vec![false]);
            // The pieces after the first, on their way: (how many went, whether one could not).
            let send_rest = |plan: Vec<(u64, u64)>,
                             held: &mut Vec<Vec<u8>>,
                             done: &mut Vec<bool>,
                             streamed: &mut Vec<bool>| {
                held.resize(1 + plan.len(), Vec::new());
                done.resize(1 + plan.len(), false);
                streamed.resize(1 + plan.len(), false);
                let sent =
                    plan.iter().enumerate().filter(|&(i, &(offset, len))| spawn(1 + i, offset, len)).count();
                (sent, sent < plan.len())
            };
            if let Some((t, all)) = plan.take() {
                // The rest at once too (the first piece's answer must then say the same length).
                total = Some(t);
                let rest = all.get(1..).unwrap_or_default().to_vec();
                let (sent, refused) = send_rest(rest, &mut held, &mut done, &mut streamed);
                pending += sent;
                failed |= refused;
            }
            let (mut next, mut fed, mut hasher) = (0usize, 0u64, sha2::Sha256::new());
            let mut feed = |bytes: &[u8]| {
                hasher.update(bytes);
                sink.feed(bytes);
                fed += bytes.len() as u64;
            };
            while pending > 0 {
                let Ok(news) = rx.recv() else { break };
                match news {
                    // The rest goes at once, while the first piece's body is still arriving.
                    // A length past the limit: the whole read reports it.
                    PieceNews::Length(t) if total.is_none() && t > MAX_HTTP_BLOB => failed = true,
                    PieceNews::Length(t) if total.is_none() => {
                        total = Some(t);
                        let plan = rest_of_blob(first.min(t), t, piece);
                        let (sent, refused) = send_rest(plan, &mut held, &mut done, &mut streamed);
                        pending += sent;
                        failed |= refused;
                    }
                    PieceNews::Length(t) => failed |= total != Some(t),
                    // A retried piece starts over: only bytes not yet fed can be taken back.
                    PieceNews::Attempt(k) => {
                        failed |= streamed[k];
                        held[k].clear();
                    }
                    PieceNews::Bytes(k, bytes) if k == next && !failed => {
                        feed(&bytes);
                        streamed[k] = true;
                    }
                    PieceNews::Bytes(k, bytes) if !failed => held[k].extend_from_slice(&bytes),
                    PieceNews::Bytes(..) => {}
                    PieceNews::Done(k, answer) => {
                        pending -= 1;
                        match answer {
                            Ok(t) if total == Some(t) => done[k] = true,
                            Ok(_) => {
                                debug!(url, "the pieces of a blob disagree on its length: reading it whole");
                                failed = true;
                            }
                            Err(e) => {
                                debug!(url, error = %e, "a piece of a blob failed: reading it whole");
                                failed = true;
                            }
                        }
                        // Past the pieces that are in, feeding what the next one holds so far.
                        while !failed && next < done.len() {
                            let bytes = std::mem::take(&mut held[next]);
                            if !bytes.is_empty() {
                                feed(&bytes);
                                streamed[next] = true;
                            }
                            if !done[next] {
                                break;
                            }
                            next += 1;
                        }
                    }
                }
                if failed {
                    stop.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            }
            if failed || next != done.len() || total != Some(fed) {
                return false;
            }
            let actual = Sha256Digest(hasher.finalize().into());
            if actual != *digest {
                // Counted as a single GET's would be: a digest error, and the whole read a retry.
                warn!(url, %actual, "a blob read in pieces does not match its digest: reading it whole");
                self.inner.transport.record_error(ErrorKind::Digest);
                self.inner.transport.record_retry();
                return false;
            }
            trace!(%digest, len = fed, pieces = done.len(), "fetched blob in pieces");
            true
        });
        if !read && known.is_some() {
            // A length that did not hold (or pieces that failed): learned from the answer next time.
            self.inner.blob_lengths.lock().unwrap_or_else(|p| p.into_inner()).remove(digest);
        }
        read
    }

    /// Piece `k` of a blob read in pieces: at most `len` bytes at `offset`, its bytes told to
    /// `news` as they arrive (each attempt announced first), and the blob's length as the
    /// answer's `Content-Range` says (required: an answer without it, or with other bytes than
    /// asked for, fails the piece); the first piece also tells the length before its body.
    fn read_piece(
        &self,
        url: &str,
        k: usize,
        offset: u64,
        len: u64,
        news: &std::sync::mpsc::Sender<PieceNews>,
        stop: &std::sync::atomic::AtomicBool,
    ) -> Result<u64, StoreError> {
        let range = range_header(offset, len).ok_or(HttpError::BadRange("an empty piece"));
        let range = range.map_err(|e| http_err(url, e))?;
        self.fetch(url, Some(&range), |mut resp| {
            let body_err = |e| Failure::fatal(ErrorKind::Body, http_err(url, e));
            let cr = match (resp.status(), resp.header("content-range")) {
                (200 | 206, Some(cr)) => cr.trim().to_owned(),
                (200, None) => {
                    // The whole blob, which a server may send for a range that covers it: the
                    // first piece's answer, no longer than asked, is the blob.
                    let whole = resp.header("content-length").and_then(|v| v.trim().parse::<u64>().ok());
                    match whole {
                        Some(n) if k == 0 && n > 0 && n <= len => format!("bytes 0-{}/{n}", n - 1),
                        // More than the piece asked for: the server ignores Range after all
                        // (later blobs go whole; chunk reads find out for themselves).
                        Some(n) if n > len => {
                            if self.inner.range_support.swap(RANGE_IGNORED, Ordering::AcqRel) != RANGE_IGNORED
                            {
                                warn!(url, "the server ignores Range requests after all: blobs go whole");
                            }
                            return Err(Failure::fatal(
                                ErrorKind::Body,
                                http_err(url, HttpError::RangeIgnored),
                            ));
                        }
                        _ => {
                            return Err(Failure::fatal(
                                ErrorKind::Body,
                                http_err(url, HttpError::RangeIgnored),
                            ))
                        }
                    }
                }
                (206, None) => return Err(body_err(HttpError::BadRange("no Content-Range"))),
                _ if self.inner.auth.is_some() => return Err(self.refused(url, &mut resp)),
                (status, _) => return Err(status_failure(url, status)),
            };
            let (start, last, total) = byteranges::content_range_of(&cr).map_err(body_err)?;
            let total =
                total.ok_or(HttpError::BadRange("Content-Range without the length")).map_err(body_err)?;
            let want = offset.saturating_add(len).min(total) - offset.min(total);
            if start != offset || want == 0 || last - start + 1 != want {
                return Err(body_err(HttpError::BadRange("Content-Range is not the piece asked for")));
            }
            if k == 0 {
                let _ = news.send(PieceNews::Length(total));
            }
            let _ = news.send(PieceNews::Attempt(k));
            let (mut got, mut body) = (0u64, resp.into_reader());
            loop {
                // One byte more than the piece is asked for: a longer body is found out, and a
                // body read to its end gives its connection back to the pool.
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    return Err(body_err(HttpError::BadRange("the blob is read whole instead")));
                }
                let room = usize::try_from((want.saturating_add(1) - got).min(64 << 10)).unwrap_or(64 << 10);
                let mut buf = vec![0u8; room];
                let n = match body.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(broken_body(url, e)),
                };
                got += n as u64;
                if got > want {
                    return Err(body_err(HttpError::BadLength("the body is longer than the range")));
                }
                buf.truncate(n);
                let _ = news.send(PieceNews::Bytes(k, buf));
            }
            if got < want {
                let e = http_err(url, HttpError::BadLength("the body is shorter than the range"));
                return Err(Failure::retry(ErrorKind::Body, e));
            }
            Ok(total)
        })
    }

    /// `len` bytes at `offset` of blob `digest`, with a Range GET (retried if the body breaks or
    /// comes up short). A server that ignores Range (200 and the whole blob) is found out by the
    /// first ranged GET (ranged reads wait for it while the support is unknown): with a disk
    /// cache, that answer's body and every later pack are fetched whole into the cache once per
    /// host and read from there ([`DiskCache::fetch_blob_file`]); without one, the read fails
    /// with [`HttpError::RangeIgnored`]. Either way every body byte received is counted by the
    /// transport.
    pub fn read_blob_range(
        &self,
        digest: &Sha256Digest,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, StoreError> {
        let mut out = Vec::with_capacity(usize::try_from(len).unwrap_or(0).min(64 << 20));
        self.read_blob_range_streamed(digest, offset, len, &mut |bytes| {
            out.extend_from_slice(bytes);
            Ok(())
        })?;
        Ok(out)
    }

    /// [`Self::read_blob_range`], handing the bytes to `sink` as they arrive: in order, each
    /// byte once (a retry after a broken body resumes the sink where it stopped: the bytes it
    /// had are skipped). An error from `sink` stops the read and is its result.
    pub fn read_blob_range_streamed(
        &self,
        digest: &Sha256Digest,
        offset: u64,
        len: u64,
        sink: &mut RangeSink<'_>,
    ) -> Result<(), StoreError> {
        if len == 0 {
            return Ok(());
        }
        // A whole copy in the disk cache (this or another process met a server that ignores
        // Range) answers without a request.
        if let Some(cache) = &self.inner.whole_blobs {
            if let Ok(bytes) = read_file_range(&cache.blob_path(digest), digest, offset, len) {
                return sink(&bytes);
            }
        }
        let support = || self.inner.range_support.load(Ordering::Acquire);
        if support() == RANGE_IGNORED {
            return sink(&self.read_from_whole_blob(digest, offset, len)?);
        }
        // Only the probe holds the lock through its request: a read that waited for it finds the
        // support settled and goes on in parallel with the others.
        let mut probe = (support() == RANGE_UNKNOWN)
            .then(|| self.inner.range_probe.lock().unwrap_or_else(|p| p.into_inner()))
            .filter(|_| support() == RANGE_UNKNOWN);
        if support() == RANGE_IGNORED {
            drop(probe);
            return sink(&self.read_from_whole_blob(digest, offset, len)?);
        }
        let url = self.blob_url(digest);
        let range = range_header(offset, len).ok_or(StoreError::RangeOutOfBounds {
            digest: *digest,
            offset,
            len,
            blob_len: u64::MAX,
        })?;
        // What `sink` had, over every attempt (a retry's body starts again at the first byte).
        let mut fed = tessera_transport::Resume::default();
        let out = self.fetch(&url, Some(&range), |mut resp| {
            if self.inner.auth.is_some() && !matches!(resp.status(), 200 | 206) {
                return Err(self.refused(&url, &mut resp));
            }
            let answer = check_range_answer(resp.status(), resp.header("content-range"), offset, len)
                .map_err(|e| {
                    let kind =
                        if matches!(e, HttpError::Status(_)) { ErrorKind::Status } else { ErrorKind::Body };
                    Failure::fatal(kind, http_err(&url, e))
                })?;
            if answer == RangeAnswer::Whole {
                let first = self.inner.range_support.swap(RANGE_IGNORED, Ordering::AcqRel) != RANGE_IGNORED;
                if first && self.inner.whole_blobs.is_some() {
                    warn!(url, "the server ignores Range requests; each pack is fetched whole into the disk cache, once");
                }
                return self.spool_whole_blob(digest, &url, resp).map(Some);
            }
            // A 206 settles it: the reads waiting for the probe need not wait for its body (nor
            // for a sink that may read other ranges before it takes more of this one).
            let _ = self.inner.range_support.compare_exchange(
                RANGE_UNKNOWN,
                RANGE_HONORED,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
            drop(probe.take());
            // A 206 body is read to its end (one byte more is asked for): only a body read to
            // the end gives its connection back to the pool for the next request.
            let mut body = resp.into_reader().take(len.saturating_add(1));
            let mut piece = vec![0u8; (64 << 10).min(usize::try_from(len).unwrap_or(usize::MAX).saturating_add(1))];
            let mut got = 0u64;
            loop {
                let n = match body.read(&mut piece) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(broken_body(&url, e)),
                };
                let at = got;
                got += n as u64;
                if got > len {
                    let e = http_err(&url, HttpError::BadLength("the body is longer than the range"));
                    return Err(Failure::fatal(ErrorKind::Body, e));
                }
                let unseen = fed.unseen(at, &piece[..n]);
                if !unseen.is_empty() {
                    sink(unseen).map_err(Failure::uncounted)?;
                }
            }
            if got < len {
                let e = http_err(&url, HttpError::BadLength("the body is shorter than the range"));
                return Err(Failure::retry(ErrorKind::Body, e));
            }
            Ok(None)
        });
        if probe.is_some() && out.is_ok() {
            let _ = self.inner.range_support.compare_exchange(
                RANGE_UNKNOWN,
                RANGE_HONORED,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
        drop(probe);
        if let Some(path) = out? {
            // The whole blob is on disk: hand over the bytes the sink does not have.
            let rest = read_file_range(&path, digest, offset + fed.fed(), len - fed.fed())?;
            sink(&rest)?;
        }
        trace!(%digest, offset, len, "fetched range");
        Ok(())
    }

    /// A range of blob `digest` from its whole copy in the disk cache, fetched (whole, no
    /// Range, once per host) if the cache lacks it: the path for a server that ignores Range.
    fn read_from_whole_blob(
        &self,
        digest: &Sha256Digest,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, StoreError> {
        let url = self.blob_url(digest);
        let Some(cache) = &self.inner.whole_blobs else {
            return Err(http_err(&url, HttpError::RangeIgnored));
        };
        let path = cache
            .fetch_blob_file(digest, |file| {
                self.fetch(&url, None, |mut resp| {
                    if resp.status() != 200 {
                        return Err(self.refused(&url, &mut resp));
                    }
                    copy_body(&url, resp, file)
                })
            })
            .map_err(|e| blob_file_error(&url, e, |e| e))?;
        read_file_range(&path, digest, offset, len)
    }

    /// Stream the whole blob `digest` in `resp` (a 200 answer to a ranged GET) into the disk
    /// cache (if another thread or process cached it meanwhile, the body is dropped unread).
    /// Without a cache: [`HttpError::RangeIgnored`], final.
    fn spool_whole_blob(
        &self,
        digest: &Sha256Digest,
        url: &str,
        resp: Response,
    ) -> Result<PathBuf, Failure<StoreError>> {
        let Some(cache) = &self.inner.whole_blobs else {
            return Err(Failure::fatal(ErrorKind::Status, http_err(url, HttpError::RangeIgnored)));
        };
        cache.fetch_blob_file(digest, |file| copy_body(url, resp, file)).map_err(|e| {
            blob_file_error(url, e, |e| match e {
                e @ StoreError::Corrupt { .. } => Failure::retry(ErrorKind::Digest, e),
                e => Failure::fatal(ErrorKind::Body, e),
            })
        })
    }

    /// Several ranges (`(offset, len)`) of blob `digest`, each handed to `got` (with its index in
    /// `ranges`) as soon as its bytes are in: a range at the head of a long span goes over while
    /// the rest of the span is on the wire. Ranges closer than [`HttpConfig::coalesce_gap`] share
    /// a span (see [`coalesce`]); separate spans go in one multi-range GET each
    /// [`MAX_RANGES_PER_REQUEST`] (an origin that answers it with anything but the ranges is
    /// asked span by span from then on, in parallel within the concurrency limit). An error ends
    /// the read; the ranges not handed over by then failed ([`ChunkSource::read_stored_many`]).
    pub fn read_blob_ranges(
        &self,
        digest: &Sha256Digest,
        ranges: &[(u64, u32)],
        got: &mut RangeGot<'_>,
    ) -> Result<(), StoreError> {
        let cfg = &self.inner.config;
        let spans = coalesce(ranges, cfg.coalesce_gap, cfg.coalesce_max.max(1));
        let mut fetched = vec![false; spans.len()];
        let mut requests = 0;
        let per_request = cfg.multi_range_max.clamp(1, MAX_RANGES_PER_REQUEST);
        if spans.len() > 1 && per_request > 1 {
            for (group, done) in spans.chunks(per_request).zip(fetched.chunks_mut(per_request)) {
                if group.len() < 2 {
                    continue;
                }
                let wanted: Vec<(u64, u64)> = group.iter().map(|s| (s.offset, s.len)).collect();
                let Some(parts) = self.read_blob_multi(digest, &wanted)? else { break };
                requests += 1;
                for ((span, bytes), done) in group.iter().zip(parts).zip(done) {
                    let mut handed = 0;
                    hand_over_ranges(digest, ranges, span, &bytes, &mut handed, got)?;
                    check_all_handed(digest, ranges, span, bytes.len(), handed)?;
                    *done = true;
                }
            }
        }
        let rest: Vec<usize> = (0..spans.len()).filter(|&i| !fetched[i]).collect();
        requests += rest.len();
        if let [i] = rest[..] {
            self.read_span(digest, ranges, &spans[i], got)?;
        } else if !rest.is_empty() {
            // One thread per span; the ranges come back over a channel as each thread's span
            // streams in, and go to `got` on this thread.
            let (tx, rx) = std::sync::mpsc::channel::<Result<(usize, Vec<u8>), StoreError>>();
            std::thread::scope(|scope| {
                for &i in &rest {
                    let (tx, span) = (tx.clone(), &spans[i]);
                    scope.spawn(move || {
                        let sent = self.read_span(digest, ranges, span, &mut |k, bytes| {
                            let _ = tx.send(Ok((k, bytes)));
                        });
                        if let Err(e) = sent {
                            let _ = tx.send(Err(e));
                        }
                    });
                }
                drop(tx);
                let mut first_error = None;
                for message in rx {
                    match message {
                        Ok((k, bytes)) => got(k, bytes),
                        Err(e) => {
                            first_error.get_or_insert(e);
                        }
                    }
                }
                first_error.map_or(Ok(()), Err)
            })?;
        }
        if spans.len() > 1 || ranges.len() > 1 {
            debug!(%digest, ranges = ranges.len(), spans = spans.len(), requests, "coalesced ranged reads");
        }
        Ok(())
    }

    /// The ranges of `span` (one request), each handed to `got` once the span's bytes so far
    /// hold it.
    fn read_span(
        &self,
        digest: &Sha256Digest,
        ranges: &[(u64, u32)],
        span: &CoalescedSpan,
        got: &mut RangeGot<'_>,
    ) -> Result<(), StoreError> {
        let mut members = span.members.clone();
        members.sort_by_key(|&i| ranges[i].0.saturating_add(u64::from(ranges[i].1)));
        let sorted = CoalescedSpan { members, ..span.clone() };
        let mut bytes = Vec::with_capacity(usize::try_from(span.len).unwrap_or(0).min(64 << 20));
        let mut handed = 0;
        self.read_blob_range_streamed(digest, span.offset, span.len, &mut |piece| {
            bytes.extend_from_slice(piece);
            hand_over_ranges(digest, ranges, &sorted, &bytes, &mut handed, got)
        })?;
        // The stream ended whole (`read_blob_range_streamed` checks its length).
        check_all_handed(digest, ranges, &sorted, bytes.len(), handed)
    }
}

/// Every member of `span` was handed over from its `len` bytes, or the first that was not
/// reaches past them: not one of its members.
fn check_all_handed(
    digest: &Sha256Digest,
    ranges: &[(u64, u32)],
    span: &CoalescedSpan,
    len: usize,
    handed: usize,
) -> Result<(), StoreError> {
    match span.members.get(handed) {
        None => Ok(()),
        Some(&i) => Err(StoreError::RangeOutOfBounds {
            digest: *digest,
            offset: ranges[i].0,
            len: u64::from(ranges[i].1),
            blob_len: span.offset + len as u64,
        }),
    }
}

/// Hand to `got` the members of `span` after the first `handed` (members sorted by where they
/// end) that `bytes` (the span's first bytes) now holds whole; `handed` counts them.
fn hand_over_ranges(
    digest: &Sha256Digest,
    ranges: &[(u64, u32)],
    span: &CoalescedSpan,
    bytes: &[u8],
    handed: &mut usize,
    got: &mut RangeGot<'_>,
) -> Result<(), StoreError> {
    while let Some(&i) = span.members.get(*handed) {
        let (offset, len) = ranges[i];
        let out_of_bounds = || StoreError::RangeOutOfBounds {
            digest: *digest,
            offset,
            len: u64::from(len),
            blob_len: span.offset + bytes.len() as u64,
        };
        let start = offset
            .checked_sub(span.offset)
            .and_then(|s| usize::try_from(s).ok())
            .ok_or_else(out_of_bounds)?;
        let end = start.checked_add(len as usize).ok_or_else(out_of_bounds)?;
        let Some(piece) = bytes.get(start..end) else { break };
        got(i, piece.to_vec());
        *handed += 1;
    }
    Ok(())
}

impl HttpStore {
    /// The spans `(offset, len)` of blob `digest` (at least two, sorted, apart) in one GET: the
    /// bytes of each, in order; `None` when this origin is not asked for several ranges at once
    /// (it answered an earlier one with anything else, it signs requests as S3 does, which
    /// serves one range per GET, or it ignores Range), or when it answers this one with the whole blob or a part that lacks some span:
    /// the caller then asks span by span.
    fn read_blob_multi(
        &self,
        digest: &Sha256Digest,
        spans: &[(u64, u64)],
    ) -> Result<Option<Vec<Vec<u8>>>, StoreError> {
        let inner = &self.inner;
        if inner.multi_range.load(Ordering::Acquire) == MULTI_REFUSED
            || inner.auth.is_some()
            || inner.range_support.load(Ordering::Acquire) == RANGE_IGNORED
        {
            return Ok(None);
        }
        let url = self.blob_url(digest);
        let Some(range) = byteranges::multi_range_header(spans) else { return Ok(None) };
        let total: u64 = spans.iter().map(|s| s.1).sum();
        let limit = total.saturating_add(MULTIPART_OVERHEAD_PER_PART * spans.len() as u64);
        let refuse = || {
            if inner.multi_range.swap(MULTI_REFUSED, Ordering::AcqRel) != MULTI_REFUSED {
                debug!(url, "the origin does not answer several ranges in one GET: one request per span");
            }
            Ok(None)
        };
        let answer = self.fetch(&url, Some(&range), |mut resp| {
            let status = resp.status();
            if status == 200 && resp.header("content-range").is_none() {
                // The whole blob: not read (the connection is dropped), asked span by span.
                return refuse();
            }
            if !matches!(status, 200 | 206) {
                let e = check_range_answer(status, None, 0, 1).err().unwrap_or(HttpError::Status(status));
                let kind =
                    if matches!(e, HttpError::Status(_)) { ErrorKind::Status } else { ErrorKind::Body };
                return Err(Failure::fatal(kind, http_err(&url, e)));
            }
            let body_err = |e| Failure::fatal(ErrorKind::Body, http_err(&url, e));
            let boundary = resp.header("content-type").and_then(byteranges::boundary).map(str::to_owned);
            let single = match &boundary {
                Some(_) => None,
                None => {
                    let cr = resp
                        .header("content-range")
                        .ok_or_else(|| body_err(HttpError::BadRange("206 without Content-Range")))?;
                    Some(byteranges::content_range(cr.trim()).map_err(body_err)?)
                }
            };
            if let Some((first, last)) = single {
                // One part: the server joined the spans, or answered the first one only (or
                // sent a part far larger than the spans: their gaps are not worth reading).
                let end = last.saturating_add(1);
                if spans.iter().any(|&(o, l)| o < first || o.saturating_add(l) > end) || end - first > limit {
                    return refuse();
                }
            }
            // A body past the limit (a server that joined spans across wide gaps) is dropped too.
            let body = match resp.read_to_vec(limit) {
                Ok(Some(bytes)) => bytes,
                Ok(None) => return refuse(),
                Err(e) => return Err(broken_body(&url, e)),
            };
            // An answer that does not parse or lacks a span is not retried: the spans are asked
            // for one by one, which loses nothing.
            let parts = match (&boundary, single) {
                (Some(b), _) => match byteranges::parse(&body, b) {
                    Ok(parts) => parts,
                    Err(e) => {
                        warn!(url, error = %e, "a multi-range answer did not parse");
                        return refuse();
                    }
                },
                (None, Some((first, last))) if Some(body.len() as u64) == (last - first).checked_add(1) => {
                    vec![byteranges::Part { offset: first, body: &body }]
                }
                (None, _) => {
                    let e = http_err(&url, HttpError::BadLength("the body is not its Content-Range"));
                    return Err(Failure::retry(ErrorKind::Body, e));
                }
            };
            match byteranges::place(spans, &parts) {
                Ok(bytes) => Ok(Some(bytes)),
                Err(_) => refuse(),
            }
        })?;
        if answer.is_some() {
            let _ = inner.multi_range.compare_exchange(
                MULTI_UNKNOWN,
                MULTI_HONORED,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
            trace!(%digest, spans = spans.len(), "fetched several ranges in one request");
        }
        Ok(answer)
    }

    /// One chunk range of pack `pack`, joined with the concurrent reads of the same pack: when
    /// other single chunk reads are under way (a burst of cold guest reads, one fetch thread
    /// each), the first read of a pack waits [`HttpConfig::coalesce_wait`] for others to join,
    /// then fetches them all with [`Self::read_blob_ranges`] (near ranges in one request, far
    /// ones in parallel). A burst of cold reads thus costs a few requests, not one each. A read
    /// with no other under way goes at once, whatever else is in flight: a batch fetched ahead
    /// (a pack window, a file or stretch fetched whole) is no sign of reads about to join, and
    /// waiting behind one cost each miss of a cold python start 2 ms.
    pub fn read_chunk_range(
        &self,
        pack: &Sha256Digest,
        offset: u64,
        len: u32,
    ) -> Result<Vec<u8>, StoreError> {
        let reads = &self.inner.chunk_reads;
        let others = reads.fetch_add(1, Ordering::AcqRel);
        let _under_way = UnderWay(reads);
        let wait = self.inner.config.coalesce_wait;
        if wait.is_zero() || len == 0 || others == 0 {
            return self.read_blob_range(pack, offset, u64::from(len));
        }
        let (batch, index, leader) = {
            let mut open = self.inner.batches.lock().unwrap_or_else(|p| p.into_inner());
            let batch = open.entry(*pack).or_default();
            let mut st = batch.state.lock().unwrap_or_else(|p| p.into_inner());
            st.ranges.push((offset, len));
            let index = st.ranges.len() - 1;
            drop(st);
            (Arc::clone(batch), index, index == 0)
        };
        if leader {
            std::thread::sleep(wait);
            // Out of the map first: from now on nobody can join.
            {
                let mut open = self.inner.batches.lock().unwrap_or_else(|p| p.into_inner());
                if open.get(pack).is_some_and(|b| Arc::ptr_eq(b, &batch)) {
                    open.remove(pack);
                }
            }
            let ranges = batch.state.lock().unwrap_or_else(|p| p.into_inner()).ranges.clone();
            let result = crate::source::read_all(self, pack, &ranges);
            let shared = result.as_ref().ok().map(|r| Arc::new(r.clone()));
            batch.state.lock().unwrap_or_else(|p| p.into_inner()).result = Some(shared);
            batch.done.notify_all();
            if ranges.len() > 1 {
                trace!(%pack, reads = ranges.len(), "joined concurrent chunk reads");
            }
            // The leader's range is the first.
            return result.and_then(|r| {
                r.into_iter().next().ok_or(StoreError::RangeOutOfBounds {
                    digest: *pack,
                    offset,
                    len: u64::from(len),
                    blob_len: 0,
                })
            });
        }
        let outcome = {
            let mut st = batch.state.lock().unwrap_or_else(|p| p.into_inner());
            while st.result.is_none() {
                st = batch.done.wait(st).unwrap_or_else(|p| p.into_inner());
            }
            st.result.clone().flatten()
        };
        match outcome.and_then(|r| r.get(index).cloned()) {
            Some(bytes) => Ok(bytes),
            None => self.read_blob_range(pack, offset, u64::from(len)),
        }
    }
}

/// Counts a single chunk read under way while it lives ([`Inner::chunk_reads`]).
struct UnderWay<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for UnderWay<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Stored ranges a staged fetch reads in one request at most ([`HttpStore::stage`]): the
/// ranges go out as requests of at most this size, in parallel, each on a connection of its own.
/// With [`STAGE_THREADS`], measured with `xtask bench cold` at 20 ms RTT and 1 Gbit/s (profiled
/// starts, 7 rounds; docs/benchmarks.md): 192 KiB on 12 threads took stat's from 164.5 to 149.7
/// ms, the others within 2 ms; 128 KiB on 16 (before) or 12, 96 KiB on 20 and 64 KiB on 24 made
/// more requests that slowed the start's own by up to 20 ms; 256 KiB on 8 left stat's chunks
/// behind.
const STAGE_PIECE: u64 = 192 << 10;

/// Threads a staged fetch uses at most, each a request at a time: with a start's own ~29 requests
/// (record, prefix and pack index in pieces, entry, profile) within the 48 a store has in flight
/// ([`HttpConfig::max_concurrency`]); 32 delayed those by a whole request each.
const STAGE_THREADS: usize = 12;

impl HttpStore {
    /// Fetch `packs`' ranges (each `(offset, len)`) now, in the background, for readers to come:
    /// a read of bytes inside one of them ([`ChunkSource`]'s reads) takes them from it, waiting
    /// while its fetch is under way ([`super::staged`]). Requests of about [`STAGE_PIECE`] stored
    /// bytes, near ranges together, in parallel. Returns at once.
    pub fn stage(&self, packs: &[(Sha256Digest, Vec<(u64, u32)>)]) {
        // Per request: the pack, its ranges, their slots.
        type Job = (Sha256Digest, Vec<(u64, u32)>, Vec<Arc<super::staged::Slot>>);
        let mut jobs: Vec<Job> = Vec::new();
        for (pack, ranges) in packs {
            // A long range in pieces, each a request on a connection of its own (one fresh
            // connection carries 2 MB only after seven slow-start round trips).
            let mut cut: Vec<(u64, u32)> = Vec::with_capacity(ranges.len());
            for &(mut offset, mut len) in ranges {
                while u64::from(len) > STAGE_PIECE {
                    let piece = STAGE_PIECE as u32;
                    cut.push((offset, piece));
                    (offset, len) = (offset + STAGE_PIECE, len - piece);
                }
                cut.push((offset, len));
            }
            let ranges = &cut;
            let slots = self.inner.staging.add(pack, ranges);
            let mut piece: (Vec<(u64, u32)>, Vec<Arc<super::staged::Slot>>, u64) = Default::default();
            for (&range, slot) in ranges.iter().zip(slots) {
                let Some(slot) = slot else { continue };
                // A request stays within a piece: one more range would make it slow-start a
                // window or two longer than the others.
                if !piece.0.is_empty() && piece.2 + u64::from(range.1) > STAGE_PIECE {
                    let (r, s, _) = std::mem::take(&mut piece);
                    jobs.push((*pack, r, s));
                }
                piece.0.push(range);
                piece.1.push(slot);
                piece.2 += u64::from(range.1);
                if piece.2 >= STAGE_PIECE {
                    let (r, s, _) = std::mem::take(&mut piece);
                    jobs.push((*pack, r, s));
                }
            }
            if !piece.0.is_empty() {
                jobs.push((*pack, piece.0, piece.1));
            }
        }
        if jobs.is_empty() {
            return;
        }
        debug!(requests = jobs.len(), "fetching the profile's ranges the ref names");
        let threads = jobs.len().min(STAGE_THREADS);
        let mut per_thread: Vec<Vec<_>> = (0..threads).map(|_| Vec::new()).collect();
        for (i, job) in jobs.into_iter().enumerate() {
            per_thread[i % threads].push(job);
        }
        for work in per_thread {
            let store = self.clone();
            let spawned = std::thread::Builder::new().name("tessera-stage".into()).spawn(move || {
                for (pack, ranges, slots) in work {
                    // Ranges a reader asked for before their turn are that reader's.
                    let (ranges, slots): (Vec<(u64, u32)>, Vec<_>) =
                        ranges.into_iter().zip(slots).filter(|(_, slot)| slot.start()).unzip();
                    if ranges.is_empty() {
                        continue;
                    }
                    let result = store.read_blob_ranges(&pack, &ranges, &mut |i, bytes| {
                        if let Some(slot) = slots.get(i) {
                            slot.fill(Some(bytes));
                        }
                    });
                    if let Err(e) = result {
                        debug!(%pack, error = %e, "a staged fetch failed; its ranges are read when asked for");
                    }
                    // Ranges the fetch did not hand over (it failed): their readers ask the
                    // origin.
                    slots.iter().for_each(|s| s.fill(None));
                }
            });
            if let Err(e) = spawned {
                debug!(error = %e, "no thread for a staged fetch");
            }
        }
    }

    /// Ranges fetched ahead and not read yet, and their stored bytes ([`Self::stage`]).
    pub fn staged(&self) -> (usize, u64) {
        self.inner.staging.held()
    }
}

impl ChunkSource for HttpStore {
    fn read_stored(&self, pack: &Sha256Digest, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
        if let Some(bytes) = self.inner.staging.take(pack, offset, len) {
            return Ok(bytes);
        }
        self.read_chunk_range(pack, offset, len)
    }

    fn read_stored_streamed(
        &self,
        pack: &Sha256Digest,
        offset: u64,
        len: u32,
        sink: &mut RangeSink<'_>,
    ) -> Result<(), StoreError> {
        if let Some(bytes) = self.inner.staging.take(pack, offset, len) {
            return sink(&bytes);
        }
        self.read_blob_range_streamed(pack, offset, u64::from(len), sink)
    }

    /// Ranges fetched ahead ([`Self::stage`]) are handed over from there; the others fetched.
    fn read_stored_many(
        &self,
        pack: &Sha256Digest,
        ranges: &[(u64, u32)],
        got: &mut RangeGot<'_>,
    ) -> Result<(), StoreError> {
        let mut rest: Vec<usize> = Vec::new();
        for (i, &(offset, len)) in ranges.iter().enumerate() {
            match self.inner.staging.take(pack, offset, len) {
                Some(bytes) => got(i, bytes),
                None => rest.push(i),
            }
        }
        if rest.len() == ranges.len() {
            return self.read_blob_ranges(pack, ranges, got);
        }
        if rest.is_empty() {
            return Ok(());
        }
        let wanted: Vec<(u64, u32)> = rest.iter().map(|&i| ranges[i]).collect();
        self.read_blob_ranges(pack, &wanted, &mut |k, bytes| {
            if let Some(&i) = rest.get(k) {
                got(i, bytes);
            }
        })
    }

    /// [`HttpConfig::multi_range_max`] until the origin is found not to answer multi-range GETs.
    fn ranges_per_request(&self) -> usize {
        let inner = &self.inner;
        if inner.auth.is_some()
            || inner.multi_range.load(Ordering::Relaxed) == MULTI_REFUSED
            || inner.range_support.load(Ordering::Relaxed) == RANGE_IGNORED
        {
            1
        } else {
            inner.config.multi_range_max.clamp(1, MAX_RANGES_PER_REQUEST)
        }
    }
}

/// A whole blob's body into `file` (from its start; truncated first, for a retry).
fn copy_body(url: &str, resp: Response, file: &std::fs::File) -> Result<(), Failure<StoreError>> {
    use std::io::{Seek, Write};
    let mut f = file;
    let io = |e| {
        Failure::fatal(
            ErrorKind::Body,
            StoreError::Cache { op: "write", path: "a temp file".into(), source: e },
        )
    };
    f.set_len(0).map_err(io)?;
    f.seek(std::io::SeekFrom::Start(0)).map_err(io)?;
    let mut reader = resp.into_reader();
    let mut out = std::io::BufWriter::with_capacity(1 << 20, f);
    let n = std::io::copy(&mut (&mut reader).take(MAX_HTTP_PACK.saturating_add(1)), &mut out)
        .map_err(|e| broken_body(url, e))?;
    out.flush().map_err(io)?;
    if n > MAX_HTTP_PACK {
        let e = http_err(url, HttpError::BadLength("the body exceeds the limit"));
        return Err(Failure::fatal(ErrorKind::Body, e));
    }
    Ok(())
}

/// A [`DiskCache::fetch_blob_file`] failure as `E` (`cache` maps the cache's own errors).
fn blob_file_error<E>(url: &str, e: BlobFileError<E>, cache: impl FnOnce(StoreError) -> E) -> E {
    match e {
        BlobFileError::Fill(f) => f,
        BlobFileError::Cache(e) => cache(e),
        BlobFileError::TooLarge { len, bound } => {
            cache(http_err(url, HttpError::PackTooLarge { len, bound }))
        }
    }
}

/// `len` bytes at `offset` of the whole blob `digest` cached at `path`.
fn read_file_range(path: &Path, digest: &Sha256Digest, offset: u64, len: u64) -> Result<Vec<u8>, StoreError> {
    use std::os::unix::fs::FileExt;
    let io = |source| StoreError::Cache { op: "read", path: path.to_owned(), source };
    let file = std::fs::File::open(path).map_err(io)?;
    let blob_len = file.metadata().map_err(io)?.len();
    let out_of_bounds = StoreError::RangeOutOfBounds { digest: *digest, offset, len, blob_len };
    if offset.checked_add(len).is_none_or(|end| end > blob_len) {
        return Err(out_of_bounds);
    }
    let mut out = vec![0u8; usize::try_from(len).map_err(|_| out_of_bounds)?];
    file.read_exact_at(&mut out, offset).map_err(io)?;
    Ok(out)
}

pub(crate) fn http_err(url: &str, source: HttpError) -> StoreError {
    StoreError::Http { url: url.to_owned(), source }
}

/// An unexpected status: final, counted as a status error.
fn status_failure(url: &str, status: u16) -> Failure<StoreError> {
    Failure::fatal(ErrorKind::Status, http_err(url, HttpError::Status(status)))
}

/// A body read that broke: retried, counted as a timeout or transport error.
fn broken_body(url: &str, e: std::io::Error) -> Failure<StoreError> {
    let kind = ErrorKind::of_io(&e);
    Failure::retry(kind, http_err(url, HttpError::Transport(TransportError::from_io(e))))
}

/// A whole body of at most `limit` bytes (a failure mid-body is retried; a longer body is not).
fn read_body(url: &str, resp: &mut Response, limit: u64) -> Result<Vec<u8>, Failure<StoreError>> {
    match resp.read_to_vec(limit) {
        Ok(Some(bytes)) => Ok(bytes),
        Ok(None) => Err(Failure::fatal(
            ErrorKind::Body,
            http_err(url, HttpError::BadLength("the body exceeds the limit")),
        )),
        Err(e) => Err(broken_body(url, e)),
    }
}

/// The image ID a ref's content names ([`RefText`]).
pub(crate) fn parse_ref(text: &[u8]) -> Option<ImageId> {
    RefText::parse(text).map(|r| r.id)
}

/// Resolve a reference given a ref reader and an entry check (shared by the HTTP and cached
/// stores): IDs must have an entry; tags must point at one. `@sha256:` (by subject) is only for
/// registry stores.
pub(crate) fn resolve_with(
    reference: &str,
    read_ref: impl FnOnce(&str) -> Result<Option<ImageId>, StoreError>,
    check_entry: impl FnOnce(&ImageId) -> Result<(), StoreError>,
) -> Result<ImageId, StoreError> {
    if reference.starts_with('@') {
        return Err(StoreError::SubjectNeedsRegistry { reference: reference.to_owned() });
    }
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
    fn the_rest_of_a_blob_tiles_it_in_at_most_fifteen_pieces() {
        let piece = 192 << 10;
        for (done, total) in [(393_216, 1_120_000), (393_216, 393_217), (8, 9), (100, 100 << 20), (10, 7)] {
            let plan = rest_of_blob(done, total, piece);
            let mut at = done;
            for &(offset, len) in &plan {
                assert_eq!(offset, at, "{done}/{total}: contiguous");
                assert!(len > 0, "{done}/{total}: no empty piece");
                at += len;
            }
            assert_eq!(at, total.max(done), "{done}/{total}: covers the rest");
            assert!(plan.len() < MAX_BLOB_PIECES, "{done}/{total}: {} pieces", plan.len());
            if total > done && total - done <= piece * (MAX_BLOB_PIECES as u64 - 1) {
                assert!(
                    plan.iter().all(|&(_, len)| len <= piece),
                    "{done}/{total}: pieces of at most one piece"
                );
            }
        }
        // 1.12 MB after a first 384 KiB: four pieces of at most 192 KiB.
        assert_eq!(rest_of_blob(393_216, 1_120_000, piece).len(), 4);
        assert!(rest_of_blob(0, 100, 0).is_empty());
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
        // A 200 that says (Content-Range) it is the range asked for is one.
        assert_eq!(ok(200, Some("bytes 100-149/1000")).unwrap(), RangeAnswer::Partial);
        assert!(matches!(ok(200, Some("bytes 0-999/1000")), Err(HttpError::BadRange(_))));
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
    fn coalescing_groups_near_ranges_only() {
        // Out of order, adjacent, a small gap, a large gap, an overlap, an empty range.
        let ranges = [(1000, 100), (0, 1000), (1200, 50), (10_000, 10), (10_005, 10), (5, 0)];
        let spans = coalesce(&ranges, 100, 1 << 20);
        assert_eq!(
            spans,
            [
                CoalescedSpan { offset: 0, len: 1250, members: vec![1, 0, 2] },
                CoalescedSpan { offset: 10_000, len: 15, members: vec![3, 4] },
            ]
        );
        // No gap allowed: only touching ranges join.
        let spans = coalesce(&ranges, 0, 1 << 20);
        assert_eq!(
            spans.iter().map(|s| (s.offset, s.len)).collect::<Vec<_>>(),
            [(0, 1100), (1200, 50), (10_000, 15)]
        );
        // The span cap splits a long run; a range longer than the cap stands alone.
        let run: Vec<(u64, u32)> = (0..10).map(|i| (i * 100, 100)).collect();
        let spans = coalesce(&run, 0, 300);
        assert_eq!(spans.iter().map(|s| s.len).collect::<Vec<_>>(), [300, 300, 300, 100]);
        assert_eq!(coalesce(&[(0, 1000)], 0, 10)[0].len, 1000);
        assert!(coalesce(&[], 10, 10).is_empty());
        // Every non-empty range is in exactly one span, inside it.
        for s in coalesce(&ranges, 100, 1 << 20) {
            for &m in &s.members {
                let (o, l) = ranges[m];
                assert!(o >= s.offset && o + u64::from(l) <= s.offset + s.len);
            }
        }
        assert_eq!(coalesce(&[(u64::MAX - 1, 10)], 0, 100)[0].len, 1, "no overflow at the top");
    }

    #[test]
    fn settings_from_the_environment() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| (*v).to_owned())
        };
        assert_eq!(HttpConfig::from_vars(vars(&[])).unwrap(), HttpConfig::default());
        let c = HttpConfig::from_vars(vars(&[
            ("TESSERA_HTTP_CONNECT_TIMEOUT", "2s"),
            ("TESSERA_HTTP_FIRST_BYTE_TIMEOUT", "250ms"),
            ("TESSERA_HTTP_STALL_TIMEOUT", "3s"),
            ("TESSERA_HTTP_TIMEOUT", "9s"),
            ("TESSERA_HTTP_RETRIES", "1"),
            ("TESSERA_HTTP_CONCURRENCY", "4"),
            ("TESSERA_HTTP_COALESCE_GAP", "65536"),
            ("TESSERA_HTTP_COALESCE_MAX", "1048576"),
            ("TESSERA_HTTP_COALESCE_WAIT", "0ms"),
            ("TESSERA_HTTP_RESEND_LATE", "off"),
            ("TESSERA_HTTP_MULTI_RANGE", "1"),
            ("TESSERA_HTTP_BLOB_PIECE", "0"),
        ]))
        .unwrap();
        assert_eq!(c.retry.resend_late, None);
        assert_eq!((c.multi_range_max, c.blob_piece), (1, 0));
        let late = HttpConfig::from_vars(vars(&[("TESSERA_HTTP_RESEND_LATE", "20ms")])).unwrap();
        assert_eq!(late.retry.resend_late, Some(Duration::from_millis(20)));
        assert_eq!(c.connect_timeout, Duration::from_secs(2));
        assert_eq!(c.first_byte_timeout, Duration::from_millis(250));
        assert_eq!(c.stall_timeout, Duration::from_secs(3));
        assert_eq!(c.request_timeout, Duration::from_secs(9));
        assert_eq!((c.retry.attempts, c.max_concurrency), (1, 4));
        assert_eq!((c.coalesce_gap, c.coalesce_max, c.coalesce_wait), (64 << 10, 1 << 20, Duration::ZERO));
        for bad in [
            &[("TESSERA_HTTP_FIRST_BYTE_TIMEOUT", "10")][..],
            &[("TESSERA_HTTP_TIMEOUT", "1.5s")],
            &[("TESSERA_HTTP_CONCURRENCY", "0")],
            &[("TESSERA_HTTP_RETRIES", "many")],
            &[("TESSERA_HTTP_COALESCE_GAP", "-1")],
            &[("TESSERA_HTTP_RESEND_LATE", "never")],
            &[("TESSERA_HTTP_BLOB_PIECE", "192K")],
        ] {
            let e = HttpConfig::from_vars(vars(bad)).unwrap_err();
            assert!(matches!(e, StoreError::BadSetting { ref name, .. } if name == bad[0].0), "{e}");
        }
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
            retry: RetryPolicy {
                attempts: 2,
                base: Duration::from_millis(1),
                max: Duration::from_millis(2),
                ..RetryPolicy::default()
            },
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

/// Against a server that ignores `Range` (it answers every GET with 200 and the whole blob, as
/// Python's `http.server` does).
#[cfg(test)]
mod range_ignoring_server {
    #![allow(clippy::unwrap_used)]
    use std::io::{BufRead, BufReader, Write};
    use std::net::TcpListener;
    use std::sync::atomic::AtomicU64;

    use super::*;
    use crate::cache::CacheConfig;

    /// Serves `blobs` at `/blobs/sha256/<hex>`, ignoring Range; counts GETs per blob.
    fn serve(blobs: Vec<Vec<u8>>) -> (String, Arc<Vec<AtomicU64>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let gets: Arc<Vec<AtomicU64>> = Arc::new(blobs.iter().map(|_| AtomicU64::new(0)).collect());
        let counts = Arc::clone(&gets);
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let (blobs, gets) = (blobs.clone(), Arc::clone(&gets));
                std::thread::spawn(move || {
                    let mut first = String::new();
                    let mut reader = BufReader::new(conn.try_clone().unwrap());
                    reader.read_line(&mut first).unwrap();
                    loop {
                        let mut line = String::new();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                            break;
                        }
                    }
                    let found = blobs.iter().position(|b| first.contains(&Sha256Digest::of(b).hex()));
                    let Some(i) = found else {
                        let _ = conn.write_all(
                            b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                        );
                        return;
                    };
                    gets[i].fetch_add(1, Ordering::Relaxed);
                    let head = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        blobs[i].len()
                    );
                    let _ = conn.write_all(head.as_bytes());
                    let _ = conn.write_all(&blobs[i]);
                });
            }
        });
        (base, counts)
    }

    fn blobs() -> Vec<Vec<u8>> {
        (0..2u8)
            .map(|k| (0..300_000u32).map(|i| (i as u8).wrapping_mul(7).wrapping_add(k)).collect())
            .collect()
    }

    #[test]
    fn refused_without_a_cache_with_the_reason() {
        let blobs = blobs();
        let (base, gets) = serve(blobs.clone());
        let store = HttpStore::new(&base, HttpConfig::default());
        let d = Sha256Digest::of(&blobs[0]);
        let e = store.read_blob_range(&d, 1000, 100).unwrap_err();
        let mut text = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            text = format!("{text}: {s}");
            source = s.source();
        }
        assert!(text.contains("ignores Range requests") && text.contains("--cache-dir"), "{text}");
        // Refused at once: not retried, and later reads do not ask again.
        assert!(store.read_blob_range(&d, 5000, 10).is_err());
        assert_eq!(gets[0].load(Ordering::Relaxed), 1);
    }

    #[test]
    fn with_a_cache_each_blob_crosses_the_wire_once_and_every_byte_counts() {
        let blobs = blobs();
        let (base, gets) = serve(blobs.clone());
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::open(&CacheConfig::new(dir.path())).unwrap();
        let store = HttpStore::with_cache(&base, HttpConfig::default(), Some(cache.clone()));
        std::thread::scope(|s| {
            for t in 0..16u64 {
                let (store, blobs) = (&store, &blobs);
                s.spawn(move || {
                    let which = (t % 2) as usize;
                    let d = Sha256Digest::of(&blobs[which]);
                    let offset = t * 17_000;
                    let got = store.read_blob_range(&d, offset, 4096).unwrap();
                    assert_eq!(got, blobs[which][offset as usize..offset as usize + 4096]);
                });
            }
        });
        assert_eq!(gets.iter().map(|g| g.load(Ordering::Relaxed)).collect::<Vec<_>>(), [1, 1]);
        assert_eq!(store.stats().bytes, 600_000, "every body byte counts");
        assert!(cache.blob_path(&Sha256Digest::of(&blobs[1])).is_file());
        // A second store (another process) on the same cache fetches nothing.
        let again = HttpStore::with_cache(&base, HttpConfig::default(), Some(cache));
        let d = Sha256Digest::of(&blobs[1]);
        assert_eq!(again.read_blob_range(&d, 299_000, 1000).unwrap(), blobs[1][299_000..]);
        assert_eq!(gets[1].load(Ordering::Relaxed), 1);
        assert!(again.read_blob_range(&d, 299_500, 1000).is_err(), "past the end");
    }
}

/// Against servers that honour one range per GET but not several (the answers real servers give
/// that nginx, the e2e origin, never does: the whole blob, or the first range alone).
#[cfg(test)]
mod multi_range_refusing_server {
    #![allow(clippy::unwrap_used)]
    use std::io::{BufRead, BufReader, Write};
    use std::net::TcpListener;

    use super::*;

    /// How the server answers a `Range` listing several ranges.
    #[derive(Clone, Copy)]
    enum Answer {
        WholeBlob,
        FirstRangeOnly,
        /// A single range covering the whole blob: `200` and the blob (as a server may).
        WholeWhenCovered,
        /// The first answer's body breaks off halfway (the connection closes).
        BreakFirstBody,
    }

    /// Serves `blob` at `/blobs/sha256/<hex>`; logs each GET's `Range` header.
    fn serve(blob: Vec<u8>, answer: Answer) -> (String, Arc<Mutex<Vec<String>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let log = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&log);
        let broke = Arc::new(std::sync::atomic::AtomicBool::new(false));
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let (blob, log, broke) = (blob.clone(), Arc::clone(&log), Arc::clone(&broke));
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(conn.try_clone().unwrap());
                    loop {
                        let mut range = String::new();
                        let mut line = String::new();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        loop {
                            let mut h = String::new();
                            if reader.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
                                break;
                            }
                            if let Some(v) = h.strip_prefix("Range: ").or_else(|| h.strip_prefix("range: ")) {
                                range = v.trim().to_owned();
                            }
                        }
                        log.lock().unwrap().push(range.clone());
                        if range.is_empty() {
                            let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", blob.len());
                            let _ = conn.write_all(head.as_bytes());
                            let _ = conn.write_all(&blob);
                            continue;
                        }
                        let ranges: Vec<(usize, usize)> = range
                            .trim_start_matches("bytes=")
                            .split(',')
                            .map(|r| {
                                let (a, b) = r.split_once('-').unwrap();
                                (a.parse().unwrap(), b.parse().unwrap())
                            })
                            .collect();
                        if ranges.len() > 1 && matches!(answer, Answer::WholeBlob) {
                            let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", blob.len());
                            let _ = conn.write_all(head.as_bytes());
                            let _ = conn.write_all(&blob);
                            return; // the client drops the connection unread
                        }
                        let (a, b) = ranges[0];
                        if matches!(answer, Answer::WholeWhenCovered) && a == 0 && b + 1 >= blob.len() {
                            let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", blob.len());
                            let _ = conn.write_all(head.as_bytes());
                            let _ = conn.write_all(&blob);
                            continue;
                        }
                        let head = format!(
                            "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {a}-{b}/{}\r\nContent-Length: {}\r\n\r\n",
                            blob.len(),
                            b + 1 - a
                        );
                        let _ = conn.write_all(head.as_bytes());
                        if matches!(answer, Answer::BreakFirstBody) && !broke.swap(true, Ordering::SeqCst) {
                            let _ = conn.write_all(&blob[a..a + (b + 1 - a) / 2]);
                            let _ = conn.flush();
                            return;
                        }
                        let _ = conn.write_all(&blob[a..=b]);
                    }
                });
            }
        });
        (base, seen)
    }

    /// Ranges staged ahead ([`HttpStore::stage`]) are fetched at once, a long one in pieces; the
    /// reads that come for bytes inside them take them without asking the origin again (in one
    /// piece, across pieces, in a batch with ranges not staged); bytes not staged, or staged and
    /// read whole already, are fetched as usual.
    #[test]
    fn staged_ranges_are_fetched_once_and_read_from_where_they_came() {
        let blob: Vec<u8> = (0..700_000u32).map(|i| (i * 13 % 251) as u8).collect();
        let (base, log) = serve(blob.clone(), Answer::FirstRangeOnly);
        let store = HttpStore::new(&base, HttpConfig::default());
        let d = Sha256Digest::of(&blob);
        let long = (10_000u64, 600_000u32);
        store.stage(&[(d, vec![(100, 50), long])]);
        assert_eq!(store.staged(), (5, 600_050), "the long range in four pieces of at most 192 KiB");
        // Every piece is asked for before any read (this server answers one range a request:
        // pieces asked together in one request are asked again one by one).
        let pieces = [
            "bytes=100-149",
            "bytes=10000-206607",
            "bytes=206608-403215",
            "bytes=403216-599823",
            "bytes=599824-609999",
        ];
        let wait = std::time::Instant::now();
        let all_asked = || pieces.iter().all(|p| log.lock().unwrap().iter().any(|r| r == p));
        while !all_asked() && wait.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(all_asked(), "{:?}", log.lock().unwrap());
        std::thread::sleep(Duration::from_millis(50));
        log.lock().unwrap().clear();
        let at = |o: u64, l: u32| blob[o as usize..o as usize + l as usize].to_vec();
        assert_eq!(store.read_stored(&d, 110, 20).unwrap(), at(110, 20));
        // Across the first two pieces of the long range.
        assert_eq!(store.read_stored(&d, 200_000, 20_000).unwrap(), at(200_000, 20_000));
        let mut got = Vec::new();
        let batch = [(100, 10), (300_000, 1000), (650_000, 100)];
        store.read_stored_many(&d, &batch, &mut |i, b| got.push((i, b))).unwrap();
        got.sort_by_key(|g| g.0);
        assert_eq!(got, batch.iter().enumerate().map(|(i, &(o, l))| (i, at(o, l))).collect::<Vec<_>>());
        let asked = std::mem::take(&mut *log.lock().unwrap());
        assert_eq!(asked, ["bytes=650000-650099"], "only the range not staged went to the origin");
        // The short range, read whole already (20 + 10 of its 50 bytes, then the rest), goes.
        assert_eq!(store.read_stored(&d, 100, 10).unwrap(), at(100, 10));
        assert_eq!(store.read_stored(&d, 130, 20).unwrap(), at(130, 20));
        assert_eq!(store.staged().0, 4, "{:?}", store.staged());
        assert_eq!(store.read_stored(&d, 100, 10).unwrap(), at(100, 10));
        assert_eq!(std::mem::take(&mut *log.lock().unwrap()), ["bytes=100-109"], "fetched again, as usual");
        // Staging is off unless asked for: a ref read with it off fetches nothing.
        assert!(!HttpConfig::default().stage_profile);
    }

    /// A streamed range whose body breaks off is asked again, and its sink gets every byte once:
    /// the bytes it had are skipped in the second answer.
    #[test]
    fn a_streamed_range_resumes_its_sink_where_a_broken_body_left_it() {
        let blob: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let (base, log) = serve(blob.clone(), Answer::BreakFirstBody);
        let store = HttpStore::new(&base, HttpConfig::default());
        let d = Sha256Digest::of(&blob);
        let (mut got, mut pieces) = (Vec::new(), 0);
        store
            .read_blob_range_streamed(&d, 1000, 200_000, &mut |b| {
                got.extend_from_slice(b);
                pieces += 1;
                Ok(())
            })
            .unwrap();
        assert_eq!(got.len(), 200_000, "every byte once");
        assert!(got == blob[1000..201_000], "the bytes of the range, in order");
        assert!(pieces > 1, "handed over as they came");
        assert_eq!(log.lock().unwrap().len(), 2, "asked again once: {:?}", log.lock().unwrap());
        // A sink's error stops the read and is its result, not retried.
        let before = log.lock().unwrap().len();
        let e = store.read_blob_range_streamed(&d, 0, 100_000, &mut |_| {
            Err(StoreError::CorruptSpan { layer: d, offset: 0, reason: "injected".into() })
        });
        assert!(matches!(e, Err(StoreError::CorruptSpan { .. })), "{e:?}");
        assert_eq!(log.lock().unwrap().len(), before + 1);
    }

    /// A span of a `--reference-layers` image streams from an origin whose Range support is not
    /// known yet while its window is read beside it: the span's read must never wait inside its
    /// body for the window's (which may need the Range probe, or a connection, the span's read
    /// holds). Each span on a fresh store, so that either read may be the probe.
    #[test]
    fn a_span_and_its_window_stream_from_an_origin_not_yet_probed() {
        // One blob holds the layer and, after it, the windows: served at every path.
        let (data, gz, windows, mut layer) = crate::reference::test_layer(600_000, 32 << 10);
        let mut blob = gz.clone();
        for cp in &mut layer.checkpoints {
            if let tessera_image::Window::Stored { offset, .. } = &mut cp.window {
                *offset += gz.len() as u64;
            }
        }
        blob.extend_from_slice(&windows);
        let digest = Sha256Digest::of(&blob);
        layer.digest = digest;
        let (base, _) = serve(blob, Answer::FirstRangeOnly);
        let spans: Vec<usize> =
            (1..layer.checkpoints.len()).filter(|&k| !layer.checkpoints[k].window.is_empty()).collect();
        assert!(spans.len() >= 4, "{} spans with a window", spans.len());
        for k in spans {
            let (theirs, base) = (layer.clone(), base.clone());
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let store = HttpStore::new(&base, HttpConfig::default());
                let mut shown = Vec::new();
                let got = crate::reference::stream_span(&store, &theirs, k, Some(&digest), None, &mut |b| {
                    shown.extend_from_slice(b)
                });
                let _ = tx.send((got.map_err(|e| e.to_string()), shown));
            });
            let (got, shown) = rx.recv_timeout(Duration::from_secs(20)).expect("the span's read hangs");
            let (s, e) = layer.span_range(k).unwrap();
            let want = &data[s as usize..e as usize];
            assert!(got.unwrap().0 == want, "span {k}: other bytes");
            assert!(shown == want, "span {k}: the bytes shown as they came differ");
        }
    }

    /// A server may answer a range that covers the whole blob with `200` and the blob: that
    /// answer to a blob's first piece is the blob, and Range support stays known (a chunk read
    /// after it is still one ranged GET, not refused as from a server that ignores Range).
    #[test]
    fn a_whole_blob_answer_to_the_first_piece_is_the_blob() {
        let blob: Vec<u8> = (0..50_000u32).map(|i| (i as u8).wrapping_mul(7)).collect();
        let d = Sha256Digest::of(&blob);
        let (base, log) = serve(blob.clone(), Answer::WholeWhenCovered);
        let store = HttpStore::new(&base, HttpConfig::default());
        // A ranged read settles the support (206); then the blob in pieces, then a range again.
        assert_eq!(store.read_blob_range(&d, 10, 100).unwrap(), blob[10..110]);
        assert_eq!(store.read_blob(&d).unwrap(), blob);
        assert_eq!(store.read_blob_range(&d, 1000, 100).unwrap(), blob[1000..1100]);
        let first = format!("bytes=0-{}", 2 * DEFAULT_BLOB_PIECE - 1);
        assert_eq!(*log.lock().unwrap(), ["bytes=10-109", first.as_str(), "bytes=1000-1099"]);
    }

    /// A blob whose length a ref gave goes in all its pieces at once, tiled as
    /// [`rest_of_blob`] tiles it from 0 — in pieces of at most [`STREAMED_BLOB_PIECE`] when it
    /// is read streamed; a length that turns out wrong costs a whole read, never other bytes.
    #[test]
    fn a_blob_of_known_length_asks_for_all_its_pieces_at_once() {
        let blob: Vec<u8> = (0..300_000u32).map(|i| (i as u8).wrapping_mul(11)).collect();
        let d = Sha256Digest::of(&blob);
        let (base, log) = serve(blob.clone(), Answer::FirstRangeOnly);
        let store = HttpStore::new(&base, HttpConfig::default());
        assert_eq!(store.read_blob_range(&d, 0, 10).unwrap(), blob[..10], "a 206 settles the support");
        store.inner.blob_lengths.lock().unwrap().insert(d, blob.len() as u64);
        // The ranges asked since `log` was cleared, and those of pieces of about `piece` bytes
        // planned from the length; sorted.
        let asked_and_planned = |piece: u64| {
            let mut asked = std::mem::take(&mut *log.lock().unwrap());
            let mut planned: Vec<String> = rest_of_blob(0, blob.len() as u64, piece)
                .iter()
                .map(|&(o, l)| format!("bytes={o}-{}", o + l - 1))
                .collect();
            asked.sort();
            planned.sort();
            (asked, planned)
        };
        log.lock().unwrap().clear();
        assert_eq!(store.read_blob(&d).unwrap(), blob);
        let (asked, planned) = asked_and_planned(DEFAULT_BLOB_PIECE);
        assert!(planned.len() > 2);
        assert_eq!(asked, planned, "the pieces, all planned from the length");
        // Streamed (a reader that works on the bytes as they arrive): smaller pieces, each two
        // round trips on a fresh connection.
        let mut streamed = Vec::new();
        store.read_blob_streamed(&d, &mut streamed).unwrap();
        assert_eq!(streamed, blob);
        let (asked, planned) = asked_and_planned(STREAMED_BLOB_PIECE);
        assert!(STREAMED_BLOB_PIECE < DEFAULT_BLOB_PIECE && planned.len() == 8, "{planned:?}");
        assert_eq!(asked, planned, "the streamed pieces, at most STREAMED_BLOB_PIECE each");
        // A wrong length: the pieces' answers say otherwise, and the blob is read whole.
        store.inner.blob_lengths.lock().unwrap().insert(d, blob.len() as u64 - 5000);
        log.lock().unwrap().clear();
        assert_eq!(store.read_blob(&d).unwrap(), blob);
        assert!(log.lock().unwrap().iter().any(String::is_empty), "read whole: {:?}", log.lock().unwrap());
        assert!(store.inner.blob_lengths.lock().unwrap().get(&d).is_none(), "the wrong length is forgotten");
    }

    #[test]
    fn several_ranges_are_asked_one_by_one_once_the_origin_answers_otherwise() {
        let blob: Vec<u8> = (0..200_000u32).map(|i| (i as u8).wrapping_mul(13)).collect();
        let d = Sha256Digest::of(&blob);
        let ranges = [(1000u64, 100u32), (50_000, 2000), (150_000, 10)];
        for answer in [Answer::WholeBlob, Answer::FirstRangeOnly] {
            let (base, log) = serve(blob.clone(), answer);
            let store = HttpStore::new(&base, HttpConfig::default());
            assert_eq!(store.ranges_per_request(), MAX_RANGES_PER_REQUEST, "tried until refused");
            for round in 0..2 {
                let got = crate::read_all(&store, &d, &ranges).unwrap();
                for (bytes, &(o, l)) in got.iter().zip(&ranges) {
                    assert_eq!(bytes[..], blob[o as usize..(o + u64::from(l)) as usize], "round {round}");
                }
            }
            let log = log.lock().unwrap().clone();
            // One multi-range GET, refused; then each range alone, in both rounds.
            assert_eq!(log.len(), 1 + 2 * ranges.len(), "{log:?}");
            assert_eq!(log[0], "bytes=1000-1099,50000-51999,150000-150009");
            assert!(log[1..].iter().all(|r| !r.contains(',')), "{log:?}");
            assert_eq!(store.ranges_per_request(), 1, "the fetcher is told to group adjacent chunks only");
        }
    }
}

/// The join of single chunk reads ([`HttpStore::read_chunk_range`]), and ranges handed over as
/// they arrive ([`HttpStore::read_blob_ranges`]): against a server that sends the first half of
/// its answer to a range starting at [`single_chunk_reads::HELD`] and holds the rest until told,
/// so that a request stays in flight for as long as a test needs.
#[cfg(test)]
mod single_chunk_reads {
    #![allow(clippy::unwrap_used)]
    use std::io::{BufRead, BufReader, Write};
    use std::net::TcpListener;
    use std::sync::atomic::AtomicBool;
    use std::time::Instant;

    use super::*;

    const HELD: usize = 0;

    /// The `Range` header of every request the server saw, in order.
    type Log = Arc<Mutex<Vec<String>>>;

    /// Serves `blob` at `/blobs/sha256/<hex>`, one range per GET; logs each `Range` header
    /// (when the request arrives); holds the second half of answers to ranges starting at
    /// [`HELD`] until `release`.
    fn serve(blob: Vec<u8>, release: Arc<AtomicBool>) -> (String, Log) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let log = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&log);
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let (blob, log, release) = (blob.clone(), Arc::clone(&log), Arc::clone(&release));
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(conn.try_clone().unwrap());
                    loop {
                        let mut line = String::new();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        let mut range = String::new();
                        loop {
                            let mut h = String::new();
                            if reader.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
                                break;
                            }
                            if let Some(v) = h.to_ascii_lowercase().strip_prefix("range: ") {
                                range = v.trim().to_owned();
                            }
                        }
                        log.lock().unwrap().push(range.clone());
                        let (a, b) = range.trim_start_matches("bytes=").split_once('-').unwrap();
                        let (a, b): (usize, usize) = (a.parse().unwrap(), b.parse().unwrap());
                        let head = format!(
                            "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {a}-{b}/{}\r\nContent-Length: {}\r\n\r\n",
                            blob.len(),
                            b + 1 - a
                        );
                        let _ = conn.write_all(head.as_bytes());
                        let mut at = a;
                        if a == HELD {
                            at = a + (b + 1 - a) / 2;
                            let _ = conn.write_all(&blob[a..at]);
                            let _ = conn.flush();
                            while !release.load(Ordering::SeqCst) {
                                std::thread::sleep(Duration::from_millis(5)); // polling interval
                            }
                        }
                        let _ = conn.write_all(&blob[at..=b]);
                    }
                });
            }
        });
        (base, seen)
    }

    fn wait_for_requests(log: &Mutex<Vec<String>>, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while log.lock().unwrap().len() < n {
            assert!(
                Instant::now() < deadline,
                "the server saw {} requests, not {n}",
                log.lock().unwrap().len()
            );
            std::thread::sleep(Duration::from_millis(5)); // polling interval
        }
    }

    /// A blob of 50 000 bytes served as above, the flag releasing held answers, the server's
    /// log, and a store of it joining reads for `wait`, whose first ranged read is done (until the
    /// first answer says whether the server honours ranges, ranged reads go one at a time).
    fn setup(wait: Duration) -> (Vec<u8>, Arc<AtomicBool>, Log, HttpStore) {
        let blob: Vec<u8> = (0..50_000u32).map(|i| (i % 251) as u8).collect();
        let release = Arc::new(AtomicBool::new(false));
        let (base, log) = serve(blob.clone(), Arc::clone(&release));
        let store = HttpStore::new(&base, HttpConfig { coalesce_wait: wait, ..HttpConfig::default() });
        assert_eq!(
            store.read_blob_range(&Sha256Digest::of(&blob), 40_000, 10).unwrap(),
            blob[40_000..40_010]
        );
        (blob, release, log, store)
    }

    /// A request in flight that is not a single chunk read (a pack window, a file fetched whole)
    /// is no sign of a burst: the read goes at once instead of waiting to be joined.
    #[test]
    fn a_chunk_read_beside_a_batch_in_flight_goes_at_once() {
        let (blob, release, log, store) = setup(Duration::from_secs(5));
        let d = Sha256Digest::of(&blob);
        std::thread::scope(|s| {
            let batch = s.spawn(|| store.read_blob_range(&d, HELD as u64, 1000).unwrap());
            wait_for_requests(&log, 2);
            let t0 = Instant::now();
            assert_eq!(store.read_chunk_range(&d, 20_000, 100).unwrap(), blob[20_000..20_100]);
            let took = t0.elapsed();
            release.store(true, Ordering::SeqCst);
            assert!(took < Duration::from_secs(2), "the read waited {took:?} beside a batch in flight");
            assert_eq!(batch.join().unwrap(), blob[..1000]);
        });
    }

    /// Beside another single chunk read under way, reads arriving together are joined into one
    /// request (a burst of cold guest reads).
    #[test]
    fn chunk_reads_beside_another_under_way_are_joined() {
        let (blob, release, log, store) = setup(Duration::from_millis(300));
        let d = Sha256Digest::of(&blob);
        std::thread::scope(|s| {
            let first = s.spawn(|| store.read_chunk_range(&d, HELD as u64, 100).unwrap());
            wait_for_requests(&log, 2);
            let (a, b) = (
                s.spawn(|| store.read_chunk_range(&d, 10_000, 100).unwrap()),
                s.spawn(|| store.read_chunk_range(&d, 10_100, 100).unwrap()),
            );
            assert_eq!(a.join().unwrap(), blob[10_000..10_100]);
            assert_eq!(b.join().unwrap(), blob[10_100..10_200]);
            release.store(true, Ordering::SeqCst);
            assert_eq!(first.join().unwrap(), blob[..100]);
        });
        // Besides the first range read and the held one (which the transport may send again when
        // its answer is late), one request.
        let log = log.lock().unwrap();
        let others: Vec<&String> = log[2..].iter().filter(|r| !r.starts_with("bytes=0-")).collect();
        assert_eq!(others, ["bytes=10000-10199"], "requests: {log:?}");
    }

    /// The ranges of one span go to the caller as the span's bytes arrive: those in the half
    /// the server sent at once while it holds the rest, the others when it is released.
    #[test]
    fn the_ranges_of_a_span_are_handed_over_as_they_arrive() {
        let (blob, release, log, store) = setup(Duration::ZERO);
        let d = Sha256Digest::of(&blob);
        let ranges = [(300, 100), (0, 100), (100, 100), (200, 100)];
        let (tx, rx) = std::sync::mpsc::channel();
        /// Releases the held answer when dropped: a failed assertion does not leave the read
        /// waiting for it.
        struct ReleaseOnDrop<'a>(&'a AtomicBool);
        impl Drop for ReleaseOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        std::thread::scope(|s| {
            let _release = ReleaseOnDrop(&release);
            let read =
                s.spawn(|| store.read_blob_ranges(&d, &ranges, &mut |i, bytes| tx.send((i, bytes)).unwrap()));
            let next = || rx.recv_timeout(Duration::from_secs(10)).expect("a range handed over");
            let held = [next(), next()];
            std::thread::sleep(Duration::from_millis(50)); // time for a wrong early answer to show
            assert!(rx.try_recv().is_err(), "a range of the held half was handed over");
            release.store(true, Ordering::SeqCst);
            read.join().unwrap().unwrap();
            let mut all: Vec<(usize, Vec<u8>)> = held.into_iter().chain(rx.try_iter()).collect();
            assert_eq!(all[..2].iter().map(|g| g.0).collect::<Vec<_>>(), [1, 2], "the sent half first");
            all.sort();
            let want: Vec<(usize, Vec<u8>)> = ranges
                .iter()
                .enumerate()
                .map(|(i, &(o, l))| (i, blob[o as usize..(o + u64::from(l)) as usize].to_vec()))
                .collect();
            assert_eq!(all, want, "each range once, its own bytes");
        });
        assert_eq!(log.lock().unwrap()[1..], ["bytes=0-399"], "one request for the span");
    }
}
