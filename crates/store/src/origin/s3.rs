//! A store in an S3 bucket: `s3://BUCKET[/PREFIX]`, the store layout of `docs/formats/store.md`
//! under PREFIX, every request signed with AWS Signature V4 ([`super::sigv4`]).
//!
//! Reading is the HTTP origin's read path ([`HttpStore`]: one transport with its pool, limits,
//! coalescing and retries, ranged GETs, the disk cache) with an [`S3Auth`] that signs each
//! request and turns S3's XML error answers into [`HttpError::S3`] (naming the bucket, the
//! operation and the S3 error code). Writing (`tessera copy --to s3://…`) is [`S3Store`]'s
//! [`crate::CopyDest`]: HEAD to skip objects already there, PUT (`If-None-Match: *`) for small
//! blobs, the entry and the ref, multipart upload for packs larger than one part.
//!
//! Credentials ([`CredentialSource`]): `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`
//! (+`AWS_SESSION_TOKEN`), else the shared credentials file (`AWS_SHARED_CREDENTIALS_FILE` or
//! `~/.aws/credentials`, profile `AWS_PROFILE` or `default`), re-read when the file changes and
//! after a refused request, so a long-running daemon picks up rotated keys and tokens.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tracing::{debug, info, warn};

use std::collections::BTreeMap;
use std::io::Read;

use md5::Md5;
use sha2::{Digest, Sha256};
use tessera_image::{ImageEntry, ImageId, Sha256Digest};
use tessera_transport::{ErrorKind, Failure, FetchError, Request, Transport, TransportError};

use super::http::{http_err, join_url, HttpConfig, HttpError, HttpStore, S3Refusal};
pub use super::sigv4::Credentials;
use super::sigv4::{s3_headers, uri_encode, SignRequest};
use crate::cache::{DiskCache, Origin};
use crate::copy::CopyDest;
use crate::error::StoreError;
use crate::read_store::ReadStore;
use crate::reader::OpenImage;
use crate::source::ChunkSource;
use tessera_transport::Method;

/// Default size of one part of a multipart upload: 16 MiB (S3 needs ≥ 5 MiB but for the last).
pub const DEFAULT_PART_SIZE: u64 = 16 << 20;

/// `s3://BUCKET[/PREFIX]`, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Location {
    /// The bucket name.
    pub bucket: String,
    /// The key prefix of the store, without leading or trailing `/` (may be empty).
    pub prefix: String,
}

impl S3Location {
    /// Parse what follows `s3://`.
    pub fn parse(rest: &str) -> Result<Self, &'static str> {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let ok_char = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'_');
        if bucket.len() < 3 || bucket.len() > 63 || !bucket.bytes().all(ok_char) {
            return Err("expected s3://BUCKET[/PREFIX], a bucket of 3 to 63 characters a-z 0-9 . - _");
        }
        let prefix = prefix.trim_matches('/');
        if prefix.split('/').any(|s| s.is_empty() || s == "." || s == "..") && !prefix.is_empty() {
            return Err("the prefix of an s3:// store has an empty, `.` or `..` segment");
        }
        Ok(Self { bucket: bucket.to_owned(), prefix: prefix.to_owned() })
    }
}

impl std::fmt::Display for S3Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "s3://{}", self.bucket)?;
        if !self.prefix.is_empty() {
            write!(f, "/{}", self.prefix)?;
        }
        Ok(())
    }
}

/// Where the credentials of an `s3://` store come from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum CredentialSource {
    /// No credentials anywhere: requests go unsigned (a public bucket).
    #[default]
    Anonymous,
    /// Fixed credentials (the `AWS_*` environment of the process).
    Static(Credentials),
    /// A profile of a shared credentials file, re-read when the file changes.
    File { path: PathBuf, profile: String },
}

/// How `s3://` stores are reached: endpoint, region, credentials, part size. Built by the binary
/// ([`Self::from_vars`] over its environment and `--s3-endpoint`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Config {
    /// A custom endpoint (`--s3-endpoint`, `AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`) for
    /// S3-compatible servers, addressed path-style (`ENDPOINT/BUCKET/KEY`). Without one, AWS
    /// S3 itself, virtual-hosted (`https://BUCKET.s3.REGION.amazonaws.com/KEY`).
    pub endpoint: Option<String>,
    /// The signing region (`AWS_REGION`, `AWS_DEFAULT_REGION`; default `us-east-1`).
    pub region: String,
    /// The credentials.
    pub credentials: CredentialSource,
    /// Part size of multipart uploads; a blob up to this size is one PUT.
    pub part_size: u64,
}

impl Default for S3Config {
    fn default() -> Self {
        Self {
            endpoint: None,
            region: "us-east-1".into(),
            credentials: CredentialSource::Anonymous,
            part_size: DEFAULT_PART_SIZE,
        }
    }
}

/// The environment variables [`S3Config::from_vars`] reads.
pub const S3_ENV: [&str; 11] = [
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ENDPOINT_URL",
    "HOME",
    "TESSERA_S3_PART_SIZE",
];

impl S3Config {
    /// The settings `get` (the environment) and `endpoint` (`--s3-endpoint`, which wins) give.
    /// A key id without a secret (or the reverse), an endpoint that is not `http(s)://HOST…`
    /// or a part size below 64 KiB is an error naming the setting. Pure.
    pub fn from_vars(
        get: impl Fn(&str) -> Option<String>,
        endpoint: Option<&str>,
    ) -> Result<Self, StoreError> {
        let get = |name: &str| get(name).filter(|v| !v.is_empty());
        let bad = |name: &str, value: &str, expected: &'static str| StoreError::BadSetting {
            name: name.to_owned(),
            value: value.to_owned(),
            expected,
        };
        let credentials = match (get("AWS_ACCESS_KEY_ID"), get("AWS_SECRET_ACCESS_KEY")) {
            (Some(id), Some(secret)) => CredentialSource::Static(Credentials {
                access_key_id: id,
                secret_access_key: secret,
                session_token: get("AWS_SESSION_TOKEN"),
            }),
            (Some(id), None) => {
                return Err(bad("AWS_ACCESS_KEY_ID", &id, "set together with AWS_SECRET_ACCESS_KEY"))
            }
            (None, Some(_)) => {
                return Err(bad("AWS_SECRET_ACCESS_KEY", "(hidden)", "set together with AWS_ACCESS_KEY_ID"))
            }
            (None, None) => {
                let path = get("AWS_SHARED_CREDENTIALS_FILE")
                    .map(PathBuf::from)
                    .or_else(|| get("HOME").map(|h| Path::new(&h).join(".aws/credentials")));
                match path {
                    Some(path) => CredentialSource::File {
                        path,
                        profile: get("AWS_PROFILE").unwrap_or_else(|| "default".into()),
                    },
                    None => CredentialSource::Anonymous,
                }
            }
        };
        let region =
            get("AWS_REGION").or_else(|| get("AWS_DEFAULT_REGION")).unwrap_or_else(|| "us-east-1".into());
        let (name, endpoint) = match endpoint {
            Some(e) => ("--s3-endpoint", Some(e.to_owned())),
            None => match get("AWS_ENDPOINT_URL_S3") {
                Some(e) => ("AWS_ENDPOINT_URL_S3", Some(e)),
                None => ("AWS_ENDPOINT_URL", get("AWS_ENDPOINT_URL")),
            },
        };
        if let Some(e) = &endpoint {
            let rest = e.strip_prefix("http://").or_else(|| e.strip_prefix("https://"));
            if rest.is_none_or(|r| r.is_empty() || r.starts_with('/') || r.contains('?')) {
                return Err(bad(name, e, "an endpoint URL http(s)://HOST[:PORT][/PATH]"));
            }
        }
        let mut part_size = DEFAULT_PART_SIZE;
        if let Some(v) = get("TESSERA_S3_PART_SIZE") {
            part_size = v
                .trim()
                .parse::<u64>()
                .ok()
                .filter(|&n| n >= 64 << 10)
                .ok_or_else(|| bad("TESSERA_S3_PART_SIZE", &v, "a number of bytes ≥ 65536"))?;
        }
        Ok(Self {
            endpoint: endpoint.map(|e| e.trim_end_matches('/').to_owned()),
            region,
            credentials,
            part_size,
        })
    }

    /// The base URL of the store at `location`: path-style under a custom endpoint, else
    /// virtual-hosted on AWS (path-style for a bucket with dots, which no wildcard
    /// certificate covers).
    pub fn base_url(&self, location: &S3Location) -> String {
        let prefix = if location.prefix.is_empty() {
            String::new()
        } else {
            format!("/{}", uri_encode(&location.prefix, true))
        };
        match &self.endpoint {
            Some(e) => format!("{e}/{}{prefix}", location.bucket),
            None if location.bucket.contains('.') => {
                format!("https://s3.{}.amazonaws.com/{}{prefix}", self.region, location.bucket)
            }
            None => format!("https://{}.s3.{}.amazonaws.com{prefix}", location.bucket, self.region),
        }
    }
}

/// The profile `profile` of a shared credentials file's text (`[profile]` sections of
/// `key = value` lines; `#` and `;` comments), if it has a key pair.
pub fn parse_credentials_file(text: &str, profile: &str) -> Option<Credentials> {
    let (mut id, mut secret, mut token) = (None, None, None);
    let mut inside = false;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            let name = name.trim();
            inside = name == profile || name.strip_prefix("profile ").is_some_and(|n| n.trim() == profile);
            continue;
        }
        if !inside {
            continue;
        }
        let Some((k, v)) = line.split_once('=') else { continue };
        let v = v.trim().to_owned();
        match k.trim().to_ascii_lowercase().as_str() {
            "aws_access_key_id" => id = Some(v),
            "aws_secret_access_key" => secret = Some(v),
            "aws_session_token" | "aws_security_token" => token = Some(v),
            _ => {}
        }
    }
    Some(Credentials { access_key_id: id?, secret_access_key: secret?, session_token: token })
}

/// How often a credentials file is checked for changes while requests are signed.
const FILE_CHECK_EVERY: Duration = Duration::from_secs(1);

#[derive(Default)]
struct ProviderState {
    creds: Option<Credentials>,
    /// The file's modification time and length when last read.
    stamp: Option<(SystemTime, u64)>,
    checked: Option<Instant>,
}

/// The credentials in use, from a [`CredentialSource`]: a file is re-read when it changes and
/// when [`Self::reload`] is asked after a refused request.
struct CredentialProvider {
    source: CredentialSource,
    state: Mutex<ProviderState>,
}

fn file_stamp(path: &Path) -> Option<(SystemTime, u64)> {
    std::fs::metadata(path).ok().and_then(|m| Some((m.modified().ok()?, m.len())))
}

impl CredentialProvider {
    fn new(source: CredentialSource) -> Self {
        let p = Self { source, state: Mutex::new(ProviderState::default()) };
        p.reload();
        p
    }

    fn state(&self) -> std::sync::MutexGuard<'_, ProviderState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The credentials to sign with now (`None`: unsigned).
    ///
    /// The check and any re-read happen under the lock: a caller that finds the check not due
    /// while another re-reads a changed file waits for the new credentials rather than signing
    /// with the ones the file no longer holds.
    fn current(&self) -> Option<Credentials> {
        match &self.source {
            CredentialSource::Anonymous => None,
            CredentialSource::Static(c) => Some(c.clone()),
            CredentialSource::File { path, profile } => {
                let mut st = self.state();
                if st.checked.is_none_or(|t| t.elapsed() >= FILE_CHECK_EVERY) {
                    st.checked = Some(Instant::now());
                    if file_stamp(path) != st.stamp {
                        Self::read_file(&mut st, path, profile);
                    }
                }
                st.creds.clone()
            }
        }
    }

    /// Read the file again; whether the credentials changed.
    fn reload(&self) -> bool {
        let CredentialSource::File { path, profile } = &self.source else { return false };
        Self::read_file(&mut self.state(), path, profile)
    }

    /// Read the file into `st` (its lock held); whether the credentials changed.
    fn read_file(st: &mut ProviderState, path: &Path, profile: &str) -> bool {
        let stamp = file_stamp(path);
        let creds = std::fs::read_to_string(path).ok().and_then(|t| parse_credentials_file(&t, profile));
        st.stamp = stamp;
        st.checked = Some(Instant::now());
        let changed = st.creds != creds;
        if changed {
            match &creds {
                Some(c) => info!(
                    path = %path.display(),
                    profile,
                    access_key_id = c.access_key_id,
                    "read S3 credentials"
                ),
                None => {
                    warn!(path = %path.display(), profile, "no S3 credentials in the file: requests go unsigned")
                }
            }
        }
        st.creds = creds;
        changed
    }
}

/// Signs the requests of one bucket and explains its refusals.
pub(crate) struct S3Auth {
    bucket: String,
    region: String,
    provider: CredentialProvider,
    /// When an unauthorized read was last logged (rate-limited warnings).
    last_denied_log: Mutex<Option<Instant>>,
}

impl std::fmt::Debug for S3Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Auth")
            .field("bucket", &self.bucket)
            .field("region", &self.region)
            .finish_non_exhaustive()
    }
}

/// `scheme://AUTHORITY/PATH?QUERY` split into authority, path and query pairs (raw values:
/// this module builds every URL it signs, with already-encoded paths and query values).
fn split_url(url: &str) -> (&str, &str, Vec<(&str, &str)>) {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let query =
        query.split('&').filter(|q| !q.is_empty()).map(|q| q.split_once('=').unwrap_or((q, ""))).collect();
    (host, path, query)
}

/// `text` with `%XX` escapes decoded (the signer encodes query values itself).
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The S3 operation a request is, for messages.
pub(crate) fn operation(method: Method, url: &str) -> &'static str {
    let (_, _, query) = split_url(url);
    let has = |k: &str| query.iter().any(|(q, _)| *q == k);
    match method {
        Method::Get if has("list-type") => "ListObjectsV2",
        Method::Get if has("uploads") => "ListMultipartUploads",
        Method::Get if has("uploadId") => "ListParts",
        Method::Get => "GetObject",
        Method::Head => "HeadObject",
        Method::Put if has("partNumber") => "UploadPart",
        Method::Put => "PutObject",
        Method::Post if has("uploads") => "CreateMultipartUpload",
        Method::Post => "CompleteMultipartUpload",
        Method::Delete if has("uploadId") => "AbortMultipartUpload",
        Method::Delete => "DeleteObject",
        Method::Patch => "PATCH",
    }
}

/// The text of the first `<tag>…</tag>` in `xml`, unescaped.
pub(crate) fn xml_text(xml: &str, tag: &str) -> Option<String> {
    let start = xml.find(&format!("<{tag}>"))? + tag.len() + 2;
    let end = start + xml[start..].find(&format!("</{tag}>"))?;
    Some(xml_unescape(&xml[start..end]))
}

/// `text` with XML's five named entities and numeric character references (`&#34;`, `&#x22;`:
/// Go's encoder writes quotes in ETags so) replaced; anything else is left as it is.
fn xml_unescape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find('&') {
        out.push_str(&rest[..i]);
        rest = &rest[i..];
        let decoded = rest.find(';').filter(|&end| end <= 10).and_then(|end| {
            let name = &rest[1..end];
            let c = match name {
                "lt" => '<',
                "gt" => '>',
                "quot" => '"',
                "apos" => '\'',
                "amp" => '&',
                _ => {
                    let code = match name.strip_prefix("#x").or_else(|| name.strip_prefix("#X")) {
                        Some(hex) => u32::from_str_radix(hex, 16).ok()?,
                        None => name.strip_prefix('#')?.parse().ok()?,
                    };
                    char::from_u32(code)?
                }
            };
            Some((c, end + 1))
        });
        match decoded {
            Some((c, used)) => {
                out.push(c);
                rest = &rest[used..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

impl S3Auth {
    pub(crate) fn new(bucket: &str, config: &S3Config) -> Self {
        Self {
            bucket: bucket.to_owned(),
            region: config.region.clone(),
            provider: CredentialProvider::new(config.credentials.clone()),
            last_denied_log: Mutex::new(None),
        }
    }

    /// The headers that authorize `method url` carrying `headers` (signed too) and a body
    /// hashing to `payload_sha256`; none without credentials.
    pub(crate) fn sign(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        payload_sha256: &str,
    ) -> Vec<(String, String)> {
        let Some(creds) = self.provider.current() else { return Vec::new() };
        let (host, path, query) = split_url(url);
        let query: Vec<(String, String)> =
            query.iter().map(|(k, v)| (percent_decode(k), percent_decode(v))).collect();
        let query: Vec<(&str, &str)> = query.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let unix = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let req = SignRequest { method: method.as_str(), host, path, query: &query, headers, payload_sha256 };
        s3_headers(&req, &creds, &self.region, unix)
    }

    /// After a refusal (`status`, S3 `code`): re-read the credentials; whether to sign again
    /// and retry once (they changed).
    pub(crate) fn refresh_after(&self, status: u16, code: &str) -> bool {
        let auth_failure = matches!(status, 400 | 401 | 403)
            && matches!(
                code,
                "ExpiredToken"
                    | "TokenRefreshRequired"
                    | "InvalidToken"
                    | "InvalidAccessKeyId"
                    | "SignatureDoesNotMatch"
                    | "AccessDenied"
                    | ""
            );
        auth_failure && self.provider.reload()
    }

    /// The error of a refused request: S3's code and message from the XML `body`.
    pub(crate) fn error(&self, method: Method, url: &str, status: u16, body: &[u8]) -> HttpError {
        let text = String::from_utf8_lossy(body);
        let code = xml_text(&text, "Code").unwrap_or_default();
        let mut message = xml_text(&text, "Message").unwrap_or_default();
        let op = operation(method, url);
        if code.is_empty() && message.is_empty() && matches!(status, 401 | 403) {
            message = "refused without an error code (HEAD answers have no body): wrong credentials, \
                       a clock more than 15 minutes off, or a missing permission"
                .into();
        }
        if matches!(status, 401 | 403) {
            // Reads that cannot be authorized keep failing while the credentials are bad: say it
            // at most once a minute.
            let mut last = self.last_denied_log.lock().unwrap_or_else(|p| p.into_inner());
            if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                *last = Some(Instant::now());
                warn!(bucket = self.bucket, op, status, code, "S3 refused the request");
            }
        }
        HttpError::S3(Box::new(S3Refusal { op, bucket: self.bucket.clone(), status, code, message }))
    }
}

/// What to do about an S3 error `code`, for messages.
pub fn s3_hint(code: &str) -> &'static str {
    match code {
        "NoSuchBucket" => "the bucket does not exist (check its name, the region and --s3-endpoint/AWS_ENDPOINT_URL)",
        "InvalidAccessKeyId" => "the access key is unknown to the server (check AWS_ACCESS_KEY_ID or the profile)",
        "SignatureDoesNotMatch" => {
            "the signature does not match: a wrong secret key (check AWS_SECRET_ACCESS_KEY or the profile) or region"
        }
        "RequestTimeTooSkewed" => {
            "this host's clock is more than 15 minutes off the server's: fix the clock (NTP) and retry"
        }
        "ExpiredToken" | "TokenRefreshRequired" => {
            "the session token has expired: renew the credentials (they are re-read when the credentials file changes)"
        }
        "InvalidToken" => "the session token is malformed or not valid for this key (check AWS_SESSION_TOKEN)",
        "AccessDenied" => "the credentials lack a permission this needs (docs/store.md lists them as an IAM policy)",
        "SlowDown" => "the server is throttling requests (retried with backoff)",
        _ => "",
    }
}

/// Largest answer body read from an S3 write call (an error, an upload ID, a completion).
const MAX_ANSWER: u64 = 1 << 20;

/// A store in an S3 bucket (`s3://BUCKET[/PREFIX]`): read through [`HttpStore`] with every
/// request signed; written by `tessera copy --to` ([`crate::CopyDest`]). Cheap to clone.
#[derive(Clone)]
pub struct S3Store {
    http: HttpStore,
    /// The bucket's URL without the store's key prefix (for listing).
    bucket_url: String,
    auth: Arc<S3Auth>,
    location: S3Location,
    part_size: u64,
}

impl std::fmt::Debug for S3Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Store").field("location", &self.location).field("base", &self.http.base()).finish()
    }
}

/// The parts an unfinished multipart upload holds: part number → (size, ETag).
type UploadedParts = BTreeMap<u32, (u64, String)>;

/// What a signed write call answered.
struct Answer {
    status: u16,
    etag: Option<String>,
    len: Option<u64>,
    body: Vec<u8>,
}

impl S3Store {
    /// The store at `location`, reached as `config` and `http` say (the transport settings,
    /// timeouts and retries of every HTTP origin), whole packs kept in `cache` if the server
    /// ignores Range. Nothing is sent yet; the credentials are read.
    pub fn new(location: &S3Location, config: &S3Config, http: HttpConfig, cache: Option<DiskCache>) -> Self {
        let auth = Arc::new(S3Auth::new(&location.bucket, config));
        let http = HttpStore::with_auth(&config.base_url(location), http, cache, Some(Arc::clone(&auth)));
        let bucket_url =
            config.base_url(&S3Location { bucket: location.bucket.clone(), prefix: String::new() });
        Self { http, bucket_url, auth, location: location.clone(), part_size: config.part_size.max(1) }
    }

    /// The read path (an [`HttpStore`] whose requests are signed).
    pub fn http(&self) -> &HttpStore {
        &self.http
    }

    /// Where the store is.
    pub fn location(&self) -> &S3Location {
        &self.location
    }

    /// The transport (its counters and histogram).
    pub fn transport(&self) -> &Transport {
        self.http.transport()
    }

    fn key_url(&self, key: &str) -> String {
        join_url(self.http.base(), key)
    }

    /// What the store's keys start with in the bucket: its prefix and a `/`, or nothing.
    fn key_base(&self) -> String {
        if self.location.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.location.prefix)
        }
    }

    fn blob_key(digest: &Sha256Digest) -> String {
        format!("blobs/sha256/{}", digest.hex())
    }

    /// One signed call within the transport's retry loop (5xx and `SlowDown` are retried with
    /// backoff); an answer whose status `ok` rejects is S3's error, after one more try with
    /// re-read credentials when they changed.
    fn call(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        ok: impl Fn(u16) -> bool,
    ) -> Result<Answer, StoreError> {
        let payload = hex::encode(Sha256::digest(body));
        let mut refreshed = false;
        loop {
            let signed = self.auth.sign(method, url, headers, &payload);
            let mut all = headers.to_vec();
            all.extend(signed.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            let req = Request::new(method, url).headers(&all).body(body);
            let out = self.transport().fetch(&req, |mut resp| {
                let status = resp.status();
                let read = resp.read_to_vec(MAX_ANSWER);
                let body = match read {
                    Ok(Some(b)) => b,
                    Ok(None) => Vec::new(),
                    Err(e) => {
                        let kind = ErrorKind::of_io(&e);
                        let e = http_err(url, HttpError::Transport(TransportError::from_io(e)));
                        return Err(Failure::retry(kind, e));
                    }
                };
                if !ok(status) {
                    let e = self.auth.error(method, url, status, &body);
                    return Err(Failure::fatal(ErrorKind::Status, http_err(url, e)));
                }
                Ok(Answer {
                    status,
                    etag: resp.header("etag").map(str::to_owned),
                    len: resp.header("content-length").and_then(|v| v.trim().parse().ok()),
                    body,
                })
            });
            let out = out.map_err(|e| match e {
                FetchError::Transport(t) => http_err(url, HttpError::Transport(t)),
                FetchError::Rejected(e) => e,
            });
            if let Err(StoreError::Http { source: HttpError::S3(r), .. }) = &out {
                if !refreshed && self.auth.refresh_after(r.status, &r.code) {
                    refreshed = true;
                    continue;
                }
            }
            return out;
        }
    }

    /// The length of object `key` (HEAD), `None` if there is none.
    pub fn head(&self, key: &str) -> Result<Option<u64>, StoreError> {
        let url = self.key_url(key);
        let a = self.call(Method::Head, &url, &[], &[], |s| s == 200 || s == 404)?;
        Ok((a.status == 200).then_some(a.len.unwrap_or(0)))
    }

    /// The objects whose keys (relative to the store's prefix) start with `dir` and have no
    /// further `/` (ListObjectsV2 with a delimiter, page after page): key, size, last modified.
    pub fn list(&self, dir: &str) -> Result<Vec<crate::gc::StoreObject>, StoreError> {
        let base = self.key_base();
        let prefix = format!("{base}{dir}");
        let mut out = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let mut url = format!(
                "{}?list-type=2&delimiter=%2F&prefix={}",
                self.bucket_url,
                uri_encode(&prefix, false)
            );
            if let Some(a) = &after {
                url.push_str(&format!("&start-after={}", uri_encode(a, false)));
            }
            // A listing page of 1000 keys is ~300 KiB of XML: within MAX_ANSWER.
            let a = self.call(Method::Get, &url, &[], &[], |s| s == 200)?;
            let text = String::from_utf8_lossy(&a.body);
            let mut last = None;
            for block in text.split("<Contents>").skip(1) {
                let Some(key) = xml_text(block, "Key") else { continue };
                let len = xml_text(block, "Size").and_then(|s| s.trim().parse().ok()).unwrap_or(0);
                let modified = xml_text(block, "LastModified").and_then(|t| parse_http_date(&t));
                if let Some(rel) = key.strip_prefix(&base) {
                    out.push(crate::gc::StoreObject { key: rel.to_owned(), len, modified });
                }
                last = Some(key);
            }
            let truncated = xml_text(&text, "IsTruncated").is_some_and(|t| t.trim() == "true");
            match last {
                Some(l) if truncated => after = Some(l),
                _ => break,
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// Delete object `key` (DeleteObject; a missing key is not an error).
    pub fn delete(&self, key: &str) -> Result<(), StoreError> {
        let url = self.key_url(key);
        self.call(Method::Delete, &url, &[], &[], |s| matches!(s, 200 | 204 | 404))?;
        Ok(())
    }

    /// The bytes of a small object (a tag, an image entry, a layer record); `None` if missing.
    pub fn get_small(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let url = self.key_url(key);
        let a = self.call(Method::Get, &url, &[], &[], |s| s == 200 || s == 404)?;
        Ok((a.status == 200).then_some(a.body))
    }

    /// PUT `bytes` at `key`; with `create_only`, `If-None-Match: *` (a 412 means the object
    /// is there already: content-addressed blobs are then done).
    fn put(&self, key: &str, bytes: &[u8], create_only: bool) -> Result<(), StoreError> {
        let url = self.key_url(key);
        // Content-Length is the transport's to send (and need not be signed).
        let headers: &[(&str, &str)] = if create_only { &[("if-none-match", "*")] } else { &[] };
        self.call(Method::Put, &url, headers, bytes, |s| s == 200 || (create_only && s == 412))?;
        Ok(())
    }

    /// The newest multipart upload of `key` an earlier copy left unfinished
    /// (ListMultipartUploads) and the parts it holds (ListParts, page after page): part number →
    /// (size, ETag). `None` when there is none, or when the server cannot say (the upload is then
    /// started afresh: resuming is an optimisation, never a condition).
    fn unfinished_upload(&self, key: &str) -> Option<(String, UploadedParts)> {
        let full = format!("{}{key}", self.key_base());
        // A listing the server refuses means starting afresh, not failing the copy.
        let get = |url: &str, what: &str| match self.call(Method::Get, url, &[], &[], |s| s == 200) {
            Ok(a) => Some(a),
            Err(e) => {
                debug!(error = %e, "cannot list {what}: starting afresh");
                None
            }
        };
        let url = format!("{}?prefix={}&uploads", self.bucket_url, uri_encode(&full, false));
        let listed = get(&url, "unfinished multipart uploads")?;
        let text = String::from_utf8_lossy(&listed.body);
        // ISO 8601 times of one server compare as strings.
        let (upload_id, _) = text
            .split("<Upload>")
            .skip(1)
            .filter(|u| xml_text(u, "Key").as_deref() == Some(full.as_str()))
            .filter_map(|u| Some((xml_text(u, "UploadId")?, xml_text(u, "Initiated").unwrap_or_default())))
            .max_by(|a, b| a.1.cmp(&b.1))?;
        let key_url = self.key_url(key);
        let enc_id = uri_encode(&upload_id, false);
        let mut parts = BTreeMap::new();
        let mut marker = 0u32;
        loop {
            let mut url = format!("{key_url}?uploadId={enc_id}");
            if marker > 0 {
                url.push_str(&format!("&part-number-marker={marker}"));
            }
            let page = get(&url, "the parts of an unfinished upload")?;
            let text = String::from_utf8_lossy(&page.body);
            let mut last = marker;
            for block in text.split("<Part>").skip(1) {
                let number = xml_text(block, "PartNumber").and_then(|n| n.trim().parse::<u32>().ok());
                let size = xml_text(block, "Size").and_then(|n| n.trim().parse::<u64>().ok());
                if let (Some(number), Some(size), Some(etag)) = (number, size, xml_text(block, "ETag")) {
                    parts.insert(number, (size, etag));
                    last = last.max(number);
                }
            }
            let truncated = xml_text(&text, "IsTruncated").is_some_and(|t| t.trim() == "true");
            if !truncated || last == marker {
                break;
            }
            marker = last;
        }
        Some((upload_id, parts))
    }

    /// Upload blob `digest` (`len` bytes from `reader`) in parts of the part size, checking its
    /// sha256 before completing (a mismatch aborts the upload: nothing appears under the name).
    /// An upload of the same blob that an earlier copy left unfinished is resumed: a part already
    /// there is kept when its size and ETag (the MD5 of its bytes, which this copy computes from
    /// its own bytes) match, and sent again otherwise. Returns the bytes kept.
    fn put_multipart(
        &self,
        digest: &Sha256Digest,
        len: u64,
        reader: &mut dyn Read,
    ) -> Result<u64, StoreError> {
        let key = Self::blob_key(digest);
        let url = self.key_url(&key);
        let (upload_id, there) = match self.unfinished_upload(&key) {
            Some(found) => found,
            None => {
                let created = self.call(Method::Post, &format!("{url}?uploads"), &[], &[], |s| s == 200)?;
                let id = xml_text(&String::from_utf8_lossy(&created.body), "UploadId").ok_or_else(|| {
                    http_err(&url, HttpError::BadLength("CreateMultipartUpload answered without an UploadId"))
                })?;
                (id, BTreeMap::new())
            }
        };
        if !there.is_empty() {
            debug!(%digest, parts = there.len(), "resuming an unfinished multipart upload");
        }
        let enc_id = uri_encode(&upload_id, false);
        let mut kept = 0u64;
        let result = (|| {
            let mut whole = Sha256::new();
            let mut etags = Vec::new();
            let mut done = 0u64;
            let mut part = Vec::new();
            while done < len {
                let want = self.part_size.min(len - done);
                part.clear();
                reader.take(want).read_to_end(&mut part).map_err(|source| StoreError::Io {
                    op: "read blob from the source",
                    path: digest.hex().into(),
                    source,
                })?;
                if part.len() as u64 != want {
                    return Err(StoreError::Corrupt {
                        what: "blob copied from the source",
                        digest: *digest,
                        path: key.clone().into(),
                        reason: format!("the source ended after {} of {len} bytes", done + part.len() as u64),
                    });
                }
                whole.update(&part);
                let number = u32::try_from(etags.len() + 1).unwrap_or(u32::MAX);
                let md5 = hex::encode(Md5::digest(&part));
                match there.get(&number) {
                    Some((size, etag))
                        if *size == want && etag.trim_matches('"').eq_ignore_ascii_case(&md5) =>
                    {
                        kept += want;
                        etags.push(etag.clone());
                    }
                    _ => {
                        let part_url = format!("{url}?partNumber={number}&uploadId={enc_id}");
                        let a = self.call(Method::Put, &part_url, &[], &part, |s| s == 200)?;
                        etags.push(a.etag.unwrap_or_else(|| format!("\"{md5}\"")));
                    }
                }
                done += want;
            }
            let got = Sha256Digest(whole.finalize().into());
            if got != *digest {
                return Err(StoreError::Corrupt {
                    what: "blob copied from the source",
                    digest: *digest,
                    path: key.clone().into(),
                    reason: format!("its bytes hash to {got}"),
                });
            }
            let mut xml = String::from("<CompleteMultipartUpload>");
            for (i, etag) in etags.iter().enumerate() {
                let etag = etag.replace('&', "&amp;").replace('"', "&quot;");
                xml.push_str(&format!("<Part><PartNumber>{}</PartNumber><ETag>{etag}</ETag></Part>", i + 1));
            }
            xml.push_str("</CompleteMultipartUpload>");
            let a =
                self.call(Method::Post, &format!("{url}?uploadId={enc_id}"), &[], xml.as_bytes(), |s| {
                    s == 200
                })?;
            // A completion can fail after its 200 head: the error is then in the body.
            let text = String::from_utf8_lossy(&a.body);
            if text.contains("<Error>") {
                return Err(http_err(&url, self.auth.error(Method::Post, &url, a.status, &a.body)));
            }
            Ok(kept)
        })();
        // Wrong source bytes can never complete: abort. Anything else (the server or the network
        // failing) leaves the parts for the next copy to resume.
        if matches!(result, Err(StoreError::Corrupt { .. })) {
            let abort = format!("{url}?uploadId={enc_id}");
            if let Err(e) = self.call(Method::Delete, &abort, &[], &[], |s| s == 204 || s == 200 || s == 404)
            {
                warn!(error = %e, "could not abort the unfinished multipart upload (a lifecycle rule cleans it up)");
            }
        }
        result
    }
}

impl CopyDest for S3Store {
    fn describe(&self) -> String {
        self.location.to_string()
    }

    fn has_blob_of_len(&self, digest: &Sha256Digest, len: u64) -> Result<bool, StoreError> {
        Ok(self.head(&Self::blob_key(digest))? == Some(len))
    }

    fn put_blob(&self, digest: &Sha256Digest, bytes: &[u8]) -> Result<(), StoreError> {
        let got = Sha256Digest::of(bytes);
        if got != *digest {
            return Err(StoreError::Corrupt {
                what: "blob copied from the source",
                digest: *digest,
                path: Self::blob_key(digest).into(),
                reason: format!("its bytes hash to {got}"),
            });
        }
        self.put(&Self::blob_key(digest), bytes, true)
    }

    fn put_streamed(
        &self,
        digest: &Sha256Digest,
        len: u64,
        reader: &mut dyn Read,
    ) -> Result<u64, StoreError> {
        if len > self.part_size {
            return self.put_multipart(digest, len, reader);
        }
        let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
        reader.read_to_end(&mut bytes).map_err(|source| StoreError::Io {
            op: "read blob from the source",
            path: digest.hex().into(),
            source,
        })?;
        self.put_blob(digest, &bytes)?;
        Ok(0)
    }

    fn put_entry(&self, id: &ImageId, entry: &ImageEntry) -> Result<(), StoreError> {
        if entry.record != id.digest() {
            return Err(StoreError::Inconsistent {
                image: *id,
                reason: format!("the entry's record is {}, not the image ID", entry.record),
            });
        }
        self.put(&format!("images/{}.json", id.digest().hex()), &entry.to_json(), false)
    }

    fn set_ref(
        &self,
        tag: &str,
        id: &ImageId,
        entry: &ImageEntry,
        profile: &crate::PackRanges,
    ) -> Result<(), StoreError> {
        if !tessera_image::validate_tag(tag) {
            return Err(StoreError::InvalidTag { tag: tag.to_owned() });
        }
        // The lengths of the blobs a start reads first (HEAD: they were put before the entry),
        // for a reader to ask for all their pieces at once; a hint, so left out if a HEAD fails
        // or says nothing, rather than failing the copy at its last step.
        let len = |d: &Sha256Digest| {
            self.head(&format!("blobs/sha256/{}", d.hex())).ok().flatten().filter(|&l| l > 0)
        };
        let lengths = match (len(&id.digest()), len(&entry.prefix), len(&entry.pack_index)) {
            (Some(record), Some(prefix), Some(pack_index)) => {
                Some(crate::RefLengths { record, prefix, pack_index })
            }
            _ => None,
        };
        // The profile's places go with the lengths, as a local store's refs give them.
        let mut text = crate::RefText::of(*id, entry, lengths);
        if lengths.is_some() {
            text.profile = profile.clone();
        }
        self.put(&format!("refs/{tag}"), text.encode().as_bytes(), false)
    }
}

impl ReadStore for S3Store {
    fn describe(&self) -> String {
        self.location.to_string()
    }

    fn resolve(&self, reference: &str) -> Result<ImageId, StoreError> {
        self.http.resolve(reference)
    }

    fn resolve_to_open(&self, reference: &str) -> Result<ImageId, StoreError> {
        self.http.resolve_unchecked(reference)
    }

    fn ref_parts(&self, id: &ImageId) -> Option<crate::RefParts> {
        self.http.ref_parts(id)
    }

    fn get_entry(&self, id: &ImageId) -> Result<ImageEntry, StoreError> {
        self.http.get_entry(id)
    }

    fn read_blob(&self, digest: &Sha256Digest) -> Result<Vec<u8>, StoreError> {
        self.http.read_blob(digest)
    }

    fn read_blob_streamed(
        &self,
        digest: &Sha256Digest,
        sink: &mut dyn crate::BlobSink,
    ) -> Result<(), StoreError> {
        self.http.read_blob_streamed(digest, sink)
    }

    fn list_refs(&self) -> Result<Vec<(String, ImageId)>, StoreError> {
        Ok(self.http.seen_refs())
    }

    fn chunk_source(&self, _image: &Arc<OpenImage>) -> Arc<dyn ChunkSource> {
        Arc::new(self.http.clone())
    }

    fn blob_len(&self, digest: &Sha256Digest) -> Result<u64, StoreError> {
        let key = Self::blob_key(digest);
        self.head(&key)?.ok_or_else(|| StoreError::BlobNotFound { digest: *digest, path: key.into() })
    }
}

/// Reads go through the HTTP store's, which take the ranges a tag's ref had staged
/// ([`HttpStore::stage`]) before asking the bucket.
impl ChunkSource for S3Store {
    fn read_stored(&self, pack: &Sha256Digest, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
        self.http.read_stored(pack, offset, len)
    }

    fn read_stored_streamed(
        &self,
        pack: &Sha256Digest,
        offset: u64,
        len: u32,
        sink: &mut crate::source::RangeSink<'_>,
    ) -> Result<(), StoreError> {
        self.http.read_stored_streamed(pack, offset, len, sink)
    }

    fn read_stored_many(
        &self,
        pack: &Sha256Digest,
        ranges: &[(u64, u32)],
        got: &mut crate::source::RangeGot<'_>,
    ) -> Result<(), StoreError> {
        self.http.read_stored_many(pack, ranges, got)
    }
}

impl Origin for S3Store {
    fn cache_key(&self) -> String {
        self.http.base().to_owned()
    }

    fn read_ref(&self, tag: &str) -> Result<Option<ImageId>, StoreError> {
        self.http.read_ref(tag)
    }
}

/// `2026-12-01T23:33:49.000Z` (S3's `LastModified`) as a time.
pub(crate) fn parse_http_date(text: &str) -> Option<SystemTime> {
    let t = text.trim().strip_suffix('Z')?;
    let (date, time) = t.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let time = time.split('.').next()?;
    let mut h = time.splitn(3, ':').map(|p| p.parse::<i64>().ok());
    let (hh, mm, ss) = (h.next()??, h.next()??, h.next()??);
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) || hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hh * 3600 + mm * 60 + ss;
    Some(UNIX_EPOCH + Duration::from_secs(u64::try_from(secs).ok()?))
}

/// An S3 store as `tessera store gc` sees it: listed with ListObjectsV2, objects removed with
/// DeleteObject. No writer lock: the grace protects copies in flight.
#[derive(Debug)]
pub struct S3Gc {
    store: S3Store,
}

impl S3Gc {
    /// Collect `store`.
    pub fn new(store: S3Store) -> Self {
        Self { store }
    }
}

impl crate::gc::GcBackend for S3Gc {
    fn describe(&self) -> String {
        self.store.location.to_string()
    }

    fn list(&self, dir: &str) -> Result<Vec<crate::gc::StoreObject>, StoreError> {
        self.store.list(dir)
    }

    fn read(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        if let Some(d) = key.strip_prefix("blobs/sha256/").and_then(|h| Sha256Digest::from_hex(h).ok()) {
            // Blobs may be larger than a small answer: the read path (verified against the digest).
            return match self.store.http.read_blob(&d) {
                Ok(b) => Ok(Some(b)),
                Err(e) if self.store.head(key)?.is_none() => {
                    tracing::debug!(key, error = %e, "blob gone");
                    Ok(None)
                }
                Err(e) => Err(e),
            };
        }
        self.store.get_small(key)
    }

    fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.store.delete(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_modified_dates() {
        let t = parse_http_date("2026-12-01T23:33:49.000Z").unwrap();
        assert_eq!(t.duration_since(UNIX_EPOCH).unwrap().as_secs(), 1_796_168_029);
        assert_eq!(parse_http_date("1970-01-01T00:00:00Z"), Some(UNIX_EPOCH));
        assert_eq!(
            parse_http_date("2000-02-29T12:00:00Z").unwrap().duration_since(UNIX_EPOCH).unwrap().as_secs(),
            951_825_600
        );
        for bad in ["", "2026-13-01T00:00:00Z", "2026-12-01 00:00:00", "2026-12-01T00:00:00"] {
            assert_eq!(parse_http_date(bad), None, "{bad}");
        }
    }

    #[test]
    fn query_values_are_signed_decoded() {
        assert_eq!(percent_decode("a%2Fb%20c"), "a/b c");
        assert_eq!(percent_decode("100%"), "100%");
    }

    #[test]
    fn locations() {
        let l = S3Location::parse("my-bucket/some/prefix/").unwrap();
        assert_eq!((l.bucket.as_str(), l.prefix.as_str()), ("my-bucket", "some/prefix"));
        assert_eq!(l.to_string(), "s3://my-bucket/some/prefix");
        assert_eq!(S3Location::parse("bkt").unwrap().to_string(), "s3://bkt");
        for bad in ["", "ab", "Upper", "b/x//y", "b/../y", "bucket name", &"x".repeat(64)] {
            assert!(S3Location::parse(bad).is_err(), "{bad}");
        }
    }

    fn vars(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name: &str| pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| (*v).to_owned())
    }

    #[test]
    fn config_from_the_environment() {
        let c = S3Config::from_vars(vars(&[]), None).unwrap();
        assert_eq!(c, S3Config::default());
        let c = S3Config::from_vars(
            vars(&[
                ("AWS_ACCESS_KEY_ID", "AKID"),
                ("AWS_SECRET_ACCESS_KEY", "SECRET"),
                ("AWS_SESSION_TOKEN", "TOKEN"),
                ("AWS_DEFAULT_REGION", "eu-west-3"),
                ("AWS_ENDPOINT_URL", "http://127.0.0.1:9000/"),
                ("HOME", "/home/u"),
            ]),
            None,
        )
        .unwrap();
        assert_eq!(c.region, "eu-west-3");
        assert_eq!(c.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert!(matches!(c.credentials, CredentialSource::Static(ref k)
            if k.access_key_id == "AKID" && k.session_token.as_deref() == Some("TOKEN")));
        // The flag wins; AWS_REGION over AWS_DEFAULT_REGION; the profile of the shared file.
        let c = S3Config::from_vars(
            vars(&[
                ("AWS_REGION", "ap-south-1"),
                ("AWS_DEFAULT_REGION", "eu-west-3"),
                ("AWS_ENDPOINT_URL", "http://a:1"),
                ("AWS_PROFILE", "ci"),
                ("HOME", "/home/u"),
            ]),
            Some("https://minio.example"),
        )
        .unwrap();
        assert_eq!((c.region.as_str(), c.endpoint.as_deref()), ("ap-south-1", Some("https://minio.example")));
        assert_eq!(
            c.credentials,
            CredentialSource::File { path: "/home/u/.aws/credentials".into(), profile: "ci".into() }
        );
        let c =
            S3Config::from_vars(vars(&[("AWS_SHARED_CREDENTIALS_FILE", "/etc/creds"), ("HOME", "/h")]), None)
                .unwrap();
        assert_eq!(
            c.credentials,
            CredentialSource::File { path: "/etc/creds".into(), profile: "default".into() }
        );
        for (bad, flag) in [
            (&[("AWS_ACCESS_KEY_ID", "AKID")][..], None),
            (&[("AWS_SECRET_ACCESS_KEY", "S")], None),
            (&[("AWS_ENDPOINT_URL", "ftp://x")], None),
            (&[], Some("http://")),
            (&[("TESSERA_S3_PART_SIZE", "100")], None),
        ] {
            let e = S3Config::from_vars(vars(bad), flag).unwrap_err();
            assert!(matches!(e, StoreError::BadSetting { .. }), "{e}");
            assert!(!e.to_string().contains("\"S\""), "a secret never shows: {e}");
        }
    }

    #[test]
    fn base_urls() {
        let l = S3Location::parse("bkt/p q").unwrap();
        let custom = S3Config { endpoint: Some("http://127.0.0.1:9000".into()), ..S3Config::default() };
        assert_eq!(custom.base_url(&l), "http://127.0.0.1:9000/bkt/p%20q");
        let aws = S3Config { region: "eu-west-1".into(), ..S3Config::default() };
        assert_eq!(
            aws.base_url(&S3Location::parse("bkt").unwrap()),
            "https://bkt.s3.eu-west-1.amazonaws.com"
        );
        assert_eq!(
            aws.base_url(&S3Location::parse("a.b.c/x").unwrap()),
            "https://s3.eu-west-1.amazonaws.com/a.b.c/x"
        );
    }

    #[test]
    fn credentials_files() {
        let text = "# comment\n[default]\naws_access_key_id = A1\naws_secret_access_key=S1\n\n\
                    [profile ci]\n; another\naws_access_key_id = A2\naws_secret_access_key = S2\n\
                    aws_session_token = T2\nregion = x\n[broken]\naws_access_key_id = A3\n";
        let d = parse_credentials_file(text, "default").unwrap();
        assert_eq!(
            (d.access_key_id.as_str(), d.secret_access_key.as_str(), d.session_token),
            ("A1", "S1", None)
        );
        let ci = parse_credentials_file(text, "ci").unwrap();
        assert_eq!(ci.session_token.as_deref(), Some("T2"));
        assert_eq!(parse_credentials_file(text, "broken"), None, "no secret");
        assert_eq!(parse_credentials_file(text, "missing"), None);
    }

    #[test]
    fn a_rewritten_credentials_file_is_picked_up() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("credentials");
        std::fs::write(&path, "[default]\naws_access_key_id=OLD\naws_secret_access_key=S\n").unwrap();
        let p =
            CredentialProvider::new(CredentialSource::File { path: path.clone(), profile: "default".into() });
        assert_eq!(p.current().unwrap().access_key_id, "OLD");
        std::fs::write(&path, "[default]\naws_access_key_id=NEWER\naws_secret_access_key=S\n").unwrap();
        // After a refusal, at once; without one, within FILE_CHECK_EVERY.
        assert!(p.reload());
        assert_eq!(p.current().unwrap().access_key_id, "NEWER");
        assert!(!p.reload(), "unchanged");
        std::fs::write(&path, "[default]\naws_access_key_id=NEWEST\naws_secret_access_key=S\n").unwrap();
        std::thread::sleep(FILE_CHECK_EVERY + Duration::from_millis(50));
        assert_eq!(p.current().unwrap().access_key_id, "NEWEST");
        std::fs::remove_file(&path).unwrap();
        assert!(p.reload());
        assert_eq!(p.current(), None, "no file: unsigned");
    }

    /// While one caller re-reads a rewritten file, the others wait for the new credentials
    /// instead of signing with the ones the file no longer holds.
    #[test]
    fn no_caller_signs_with_the_old_key_while_another_rereads_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("credentials");
        let text = |id: &str| format!("[default]\naws_access_key_id={id}\naws_secret_access_key=S\n");
        std::fs::write(&path, text("K0")).unwrap();
        let p =
            CredentialProvider::new(CredentialSource::File { path: path.clone(), profile: "default".into() });
        let callers = 4;
        for round in 1..=100 {
            let id = format!("K{round}");
            std::fs::write(&path, text(&id)).unwrap();
            {
                // The check is due, and the file looks changed, for whichever caller comes first.
                let mut st = p.state();
                st.checked = Instant::now().checked_sub(FILE_CHECK_EVERY * 2);
                st.stamp = None;
            }
            let start = std::sync::Barrier::new(callers);
            let seen: Vec<String> = std::thread::scope(|s| {
                let workers: Vec<_> = (0..callers)
                    .map(|_| {
                        s.spawn(|| {
                            start.wait();
                            p.current().map(|c| c.access_key_id).unwrap_or_default()
                        })
                    })
                    .collect();
                workers.into_iter().map(|w| w.join().unwrap()).collect()
            });
            assert!(
                seen.iter().all(|k| *k == id),
                "round {round}: the file holds {id}, callers signed with {seen:?}"
            );
        }
    }

    #[test]
    fn xml_entities_named_and_numeric() {
        assert_eq!(xml_unescape("&#34;83c5&#34;"), "\"83c5\"");
        assert_eq!(xml_unescape("&quot;a&quot; &lt;b&gt; &amp;amp; &apos;"), "\"a\" <b> &amp; '");
        assert_eq!(xml_unescape("&#x22;&#X41;&#65;"), "\"AA");
        // Not entities: kept as written.
        assert_eq!(xml_unescape("a & b &bogus; &#xZZ; &#1114112; &"), "a & b &bogus; &#xZZ; &#1114112; &");
        assert_eq!(xml_text("<P><ETag>&#34;x&#34;</ETag></P>", "ETag").as_deref(), Some("\"x\""));
        assert_eq!(operation(Method::Get, "http://h/b?prefix=k&uploads"), "ListMultipartUploads");
        assert_eq!(operation(Method::Get, "http://h/b/k?uploadId=u"), "ListParts");
    }

    #[test]
    fn urls_operations_and_errors() {
        let (host, path, query) = split_url("http://h:9000/b/k?partNumber=3&uploadId=abc");
        assert_eq!((host, path), ("h:9000", "/b/k"));
        assert_eq!(query, [("partNumber", "3"), ("uploadId", "abc")]);
        assert_eq!(split_url("https://h").1, "/");
        assert_eq!(operation(Method::Put, "http://h/b/k?partNumber=1&uploadId=x"), "UploadPart");
        assert_eq!(operation(Method::Post, "http://h/b/k?uploads"), "CreateMultipartUpload");
        assert_eq!(operation(Method::Post, "http://h/b/k?uploadId=x"), "CompleteMultipartUpload");
        assert_eq!(operation(Method::Get, "http://h/b/k"), "GetObject");
        let auth = S3Auth::new("bkt", &S3Config::default());
        let body = b"<?xml version=\"1.0\"?><Error><Code>NoSuchBucket</Code><Message>The specified bucket \
                     &amp; more</Message></Error>";
        let e = auth.error(Method::Get, "http://h/bkt/refs/x", 404, body);
        let text = e.to_string();
        assert!(
            text.contains("GetObject") && text.contains("bkt") && text.contains("NoSuchBucket"),
            "{text}"
        );
        assert!(text.contains("bucket & more") && text.contains("does not exist"), "{text}");
        assert!(auth.sign(Method::Get, "http://h/bkt/x", &[], super::super::sigv4::EMPTY_SHA256).is_empty());
        let skew =
            b"<Error><Code>RequestTimeTooSkewed</Code><Message>The difference between the request time \
                     and the current time is too large.</Message></Error>";
        let text = auth.error(Method::Head, "http://h/bkt/blobs/sha256/x", 403, skew).to_string();
        assert!(text.contains("HeadObject") && text.contains("clock") && text.contains("NTP"), "{text}");
    }

    /// A scripted S3 server: answers each request with the next of `answers` (status, body),
    /// recording every request head.
    fn scripted(answers: Vec<(u16, &'static str)>) -> (String, Arc<Mutex<Vec<String>>>) {
        use std::io::{BufRead, BufReader, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let heads = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&heads);
        std::thread::spawn(move || {
            for (status, body) in answers {
                let Ok((mut conn, _)) = listener.accept() else { return };
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut head = String::new();
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    head.push_str(&line);
                }
                seen.lock().unwrap().push(head);
                let answer = format!(
                    "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(answer.as_bytes());
            }
        });
        (base, heads)
    }

    fn quick_http() -> HttpConfig {
        HttpConfig {
            retry: tessera_transport::RetryPolicy {
                attempts: 3,
                base: Duration::from_millis(1),
                max: Duration::from_millis(2),
                ..tessera_transport::RetryPolicy::default()
            },
            coalesce_wait: Duration::ZERO,
            ..HttpConfig::default()
        }
    }

    const ID: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";

    #[test]
    fn slow_down_is_retried_and_an_expired_token_rereads_the_credentials_file() {
        let dir = tempfile::tempdir().unwrap();
        let creds = dir.path().join("credentials");
        std::fs::write(
            &creds,
            "[ci]\naws_access_key_id=OLDKEY\naws_secret_access_key=SECRETONE\naws_session_token=T1\n",
        )
        .unwrap();
        let ref_body: &'static str = Box::leak(format!("{ID}\n").into_boxed_str());
        let (base, heads) = scripted(vec![
            (503, "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"),
            (200, ref_body),
            (
                403,
                "<Error><Code>ExpiredToken</Code><Message>The provided token has expired.</Message></Error>",
            ),
            (200, ref_body),
        ]);
        let config = S3Config {
            endpoint: Some(base),
            credentials: CredentialSource::File { path: creds.clone(), profile: "ci".into() },
            ..S3Config::default()
        };
        let store = S3Store::new(&S3Location::parse("bkt/p").unwrap(), &config, quick_http(), None);
        assert_eq!(store.http().read_ref("a").unwrap().map(|i| i.to_string()).as_deref(), Some(ID));
        // The token expires; the file is rewritten (a credential helper renewed it): the refused
        // request is signed again with the new credentials and succeeds.
        std::fs::write(
            &creds,
            "[ci]\naws_access_key_id=NEWKEY\naws_secret_access_key=SECRETTWO\naws_session_token=T2\n",
        )
        .unwrap();
        assert_eq!(store.http().read_ref("b").unwrap().map(|i| i.to_string()).as_deref(), Some(ID));
        let heads = heads.lock().unwrap().clone();
        assert_eq!(heads.len(), 4, "{heads:?}");
        assert!(heads[0].starts_with("GET /bkt/p/refs/a "), "{}", heads[0]);
        for (i, key, token) in
            [(0, "OLDKEY", "T1"), (1, "OLDKEY", "T1"), (2, "OLDKEY", "T1"), (3, "NEWKEY", "T2")]
        {
            let h = heads[i].to_ascii_lowercase();
            assert!(h.contains(&format!("credential={}/", key.to_ascii_lowercase())), "{i}: {h}");
            assert!(h.contains(&format!("x-amz-security-token: {}", token.to_ascii_lowercase())), "{i}: {h}");
            assert!(!h.contains("secretone") && !h.contains("secrettwo"), "{i}: a secret was sent: {h}");
        }
        assert_eq!(store.transport().stats().retries, 1, "the SlowDown");
    }

    #[test]
    fn a_missing_bucket_is_an_error_a_missing_key_is_not_found() {
        let (base, _) = scripted(vec![
            (404, "<Error><Code>NoSuchKey</Code><Message>The specified key does not exist.</Message></Error>"),
            (404, "<Error><Code>NoSuchBucket</Code><Message>The specified bucket does not exist</Message></Error>"),
        ]);
        let config = S3Config { endpoint: Some(base), ..S3Config::default() };
        let store = S3Store::new(&S3Location::parse("bkt").unwrap(), &config, quick_http(), None);
        assert_eq!(store.http().read_ref("a").unwrap(), None);
        let e = store.http().read_ref("a").unwrap_err();
        let text =
            format!("{e}: {}", std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_default());
        assert!(
            text.contains("NoSuchBucket") && text.contains("bucket bkt") && text.contains("GetObject"),
            "{text}"
        );
    }
}
