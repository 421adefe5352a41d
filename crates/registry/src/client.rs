//! The blocking registry client: scheme selection, auth (anonymous, basic, bearer tokens with
//! refresh), retries, manifests, blobs and ranges.
//!
//! One [`Client`] talks to one registry host and is cheap to clone (an `Arc`); it is `Send +
//! Sync` and meant to be shared by the threads of a build (or a daemon's fetch workers).

use std::collections::HashMap;
use std::io::Read;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tessera_transport::{
    Failure, FetchError, HttpVersion, Method, Request, Response, RetryPolicy, Stats, TlsOptions, Transport,
    TransportConfig,
};
use tracing::debug;

use crate::auth::{repository_scope, Challenge, CredentialSource, Credentials};
use crate::blob::BlobReader;
use crate::error::RegistryError;
use crate::media::{accept_header, classify, effective_media_type, ManifestKind, ACCEPT_ALL};
use crate::reference::{is_loopback_host, Digest, Reference, Target};

/// Largest manifest or index read (distribution itself refuses more than 4 MiB).
pub const MAX_MANIFEST: u64 = 8 << 20;
/// Tags asked for per page of a tag list.
const TAG_PAGE: usize = 1000;
/// Pages of a tag list followed at most (ten million tags).
const MAX_TAG_PAGES: usize = 10_000;
/// Largest registry error body read for a message.
const MAX_ERROR_BODY: u64 = 64 << 10;

/// Network timeouts of a registry. There is deliberately no whole-request timeout: a multi-GiB
/// blob may take long, but it must keep moving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// TCP connect plus TLS handshake (default 15 s).
    pub connect: Duration,
    /// From sending the request to the end of the response headers (default 60 s).
    pub first_byte: Duration,
    /// Longest stall between two reads of a body (default 60 s).
    pub read: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(15),
            first_byte: Duration::from_secs(60),
            read: Duration::from_secs(60),
        }
    }
}

/// How a [`Client`] connects and authenticates. Every field documents its default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOptions {
    /// Allow plain HTTP and unverified TLS (default false). Loopback registries (`localhost`,
    /// 127.0.0.0/8, `::1`) are always treated as insecure, as docker does.
    pub insecure: bool,
    /// Where credentials come from (default: anonymous; the binary passes `--creds` or the auth
    /// files its environment names).
    pub credentials: CredentialSource,
    /// Retries (default: 5 attempts, 100 ms doubling to at most 4 s, with jitter).
    pub retry: RetryPolicy,
    /// Timeouts (default: connect 15 s, first byte 60 s, read stall 60 s).
    pub timeouts: Timeouts,
    /// Requests in flight at once (range reads, streamed blobs, everything), across all threads
    /// sharing the client (default [`DEFAULT_MAX_RANGES`]); more wait. Also the idle
    /// connections kept.
    pub max_ranges: usize,
    /// Trusted roots (`--ca-file`); verification is skipped for `insecure` and loopback
    /// registries whatever `tls.skip_verify` says.
    pub tls: TlsOptions,
    /// The HTTP versions spoken (default HTTP/1.1 only; see [`HttpVersion`]).
    pub http: HttpVersion,
}

/// Default [`ClientOptions::max_ranges`]: 32.
pub const DEFAULT_MAX_RANGES: usize = 32;

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            insecure: false,
            credentials: CredentialSource::default(),
            retry: RetryPolicy::default(),
            timeouts: Timeouts::default(),
            max_ranges: DEFAULT_MAX_RANGES,
            tls: TlsOptions::default(),
            http: HttpVersion::Http1,
        }
    }
}

/// A fetched manifest or index, its digest verified (by-digest fetches) or computed (by tag).
#[derive(Debug, Clone)]
pub struct Manifest {
    pub media_type: String,
    pub kind: ManifestKind,
    /// sha256 of `bytes`.
    pub digest: Digest,
    pub bytes: Vec<u8>,
    /// Where it came from, for messages.
    pub url: String,
}

/// What a request needs to be allowed to do, which decides the bearer token's scopes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access<'a> {
    /// `repository:REPO:pull`.
    Pull,
    /// `repository:REPO:pull,push`, plus `repository:FROM:pull` to mount a blob from `FROM`.
    Push { mount_from: Option<&'a str> },
    /// `repository:REPO:delete` (deleting manifests and tags).
    Delete,
}

impl Access<'_> {
    /// The token scopes, space-separated (also the token cache key).
    fn scopes(&self, repo: &str) -> String {
        match self {
            Access::Pull => repository_scope(repo, "pull"),
            Access::Push { mount_from: None } => repository_scope(repo, "pull,push"),
            Access::Push { mount_from: Some(from) } => {
                format!("{} {}", repository_scope(repo, "pull,push"), repository_scope(from, "pull"))
            }
            Access::Delete => repository_scope(repo, "delete"),
        }
    }
}

#[derive(Debug)]
struct Token {
    header: String,
    refresh_at: Instant,
}

#[derive(Debug, Default)]
struct State {
    /// `https://host[:port]` or `http://host[:port]`, once the `/v2/` ping chose it.
    base: Option<String>,
    /// The registry's last auth challenge (`None`: anonymous access works).
    challenge: Option<Challenge>,
    /// Bearer tokens by scope.
    tokens: HashMap<String, Token>,
    /// Resolved credentials by repository.
    creds: HashMap<String, Option<Credentials>>,
}

struct Inner {
    registry: String,
    insecure: bool,
    transport: Transport,
    options: ClientOptions,
    state: Mutex<State>,
}

/// A client for one registry host.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("registry", &self.inner.registry)
            .field("insecure", &self.inner.insecure)
            .finish()
    }
}

/// Percent-encode a query value (RFC 3986 unreserved characters pass).
fn query_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The distribution error body's `errors[].code: message`, for messages.
pub(crate) fn error_detail(resp: Response) -> String {
    let mut body = Vec::new();
    let _ = resp.into_reader().take(MAX_ERROR_BODY).read_to_end(&mut body);
    #[derive(serde::Deserialize)]
    struct Errors {
        errors: Vec<ErrorItem>,
    }
    #[derive(serde::Deserialize)]
    struct ErrorItem {
        #[serde(default)]
        code: String,
        #[serde(default)]
        message: String,
    }
    match serde_json::from_slice::<Errors>(&body) {
        Ok(e) if !e.errors.is_empty() => {
            let parts: Vec<String> = e.errors.iter().map(|e| format!("{}: {}", e.code, e.message)).collect();
            format!(" ({})", parts.join("; "))
        }
        _ => {
            let text = String::from_utf8_lossy(&body);
            let text = text.trim();
            if text.is_empty() || text.len() > 200 {
                String::new()
            } else {
                format!(" ({text})")
            }
        }
    }
}

/// Turn a non-success response into the matching error.
pub(crate) fn status_error(url: &str, resp: Response, has_creds: bool) -> RegistryError {
    let status = resp.status();
    let detail = error_detail(resp);
    let url = url.to_owned();
    match status {
        404 => RegistryError::NotFound { url, detail },
        401 | 403 => RegistryError::Unauthorized {
            url,
            status,
            detail,
            hint: if has_creds {
                "the credentials were rejected or lack access (pull, or push for uploads) to the repository"
            } else {
                "no credentials: pass --creds USER:PASS or add the registry to REGISTRY_AUTH_FILE or ~/.docker/config.json"
            },
        },
        _ => RegistryError::Status { url, status, detail },
    }
}

/// The path (after the registry's base URL) of a `Link` header's `rel="next"` target, e.g.
/// `</v2/r/tags/list?last=b&n=2>; rel="next"` → `/v2/r/tags/list?last=b&n=2`. Only paths on the
/// registry are followed (an absolute URL is cut to its path).
fn next_link(header: &str) -> Option<String> {
    header.split(',').find_map(|part| {
        let (target, params) = part.trim().split_once(';')?;
        let is_next = params.split(';').any(|p| {
            let p = p.trim().replace(' ', "");
            p == "rel=\"next\"" || p == "rel=next"
        });
        let target = target.trim().strip_prefix('<')?.strip_suffix('>')?;
        let path = match target.find("://") {
            Some(i) => &target[i + 3..][target[i + 3..].find('/')?..],
            None => target,
        };
        (is_next && path.starts_with("/v2/")).then(|| path.to_owned())
    })
}

pub(crate) fn read_limited(
    url: &str,
    mut resp: Response,
    what: &'static str,
    limit: u64,
) -> Result<Vec<u8>, RegistryError> {
    resp.read_to_vec(limit)
        .map_err(|source| RegistryError::Read { url: url.to_owned(), source })?
        .ok_or_else(|| RegistryError::TooLarge { url: url.to_owned(), what, limit })
}

/// The transport settings of `options`.
fn transport_config(options: &ClientOptions) -> TransportConfig {
    let t = &options.timeouts;
    TransportConfig {
        timeouts: tessera_transport::Timeouts {
            connect: t.connect,
            first_byte: t.first_byte,
            stall: t.read,
            whole: None,
        },
        retry: options.retry,
        max_concurrency: options.max_ranges.max(1),
        tls: options.tls.clone(),
        http: options.http,
    }
}

impl Client {
    /// A client for the registry of `reference`.
    pub fn for_reference(reference: &Reference, options: ClientOptions) -> Self {
        Self::new_unchecked(&reference.registry, options)
    }

    /// A client for `registry` (`HOST[:PORT]`).
    pub fn new(registry: &str, options: ClientOptions) -> Result<Self, RegistryError> {
        // Validate through the reference grammar.
        let r = Reference::parse(&format!("{registry}/x"))?;
        Ok(Self::new_unchecked(&r.registry, options))
    }

    fn new_unchecked(registry: &str, options: ClientOptions) -> Self {
        let insecure = options.insecure || is_loopback_host(registry);
        Self {
            inner: Arc::new(Inner {
                registry: registry.to_owned(),
                insecure,
                transport: Transport::new(transport_config(&options)),
                options,
                state: Mutex::new(State::default()),
            }),
        }
    }

    /// `HOST[:PORT]`.
    pub fn registry(&self) -> &str {
        &self.inner.registry
    }

    /// Requests, retries, body bytes and failed tries so far (the transport's).
    pub fn stats(&self) -> Stats {
        self.inner.transport.stats()
    }

    /// The transport's request-duration histogram ([`Transport::latency_histogram`]).
    pub fn latency_histogram(&self) -> tessera_metrics::Histogram {
        self.inner.transport.latency_histogram()
    }

    /// The transport (its counters and duration histogram).
    pub fn transport(&self) -> &Transport {
        &self.inner.transport
    }

    pub(crate) fn retry(&self) -> RetryPolicy {
        self.inner.options.retry
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind: keep using it.
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether TLS goes unverified for `url`: `--insecure`, and loopback hosts (the registry's
    /// or a token realm's).
    fn skip_verify(&self, url: &str) -> bool {
        let rest = url.split_once("://").map_or(url, |(_, r)| r);
        let host = rest.split('/').next().unwrap_or(rest);
        self.inner.options.insecure || is_loopback_host(host)
    }

    /// One HTTP exchange through the transport's retry loop, each answer judged by
    /// `on_response`. `body` is sent with POST, PUT and PATCH (and again on a retry).
    /// `probe`: one uncounted try (the scheme probe's TLS try, which fails against every
    /// plain-HTTP registry).
    #[allow(clippy::too_many_arguments)]
    fn exchange<T>(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, String)],
        auth: Option<&str>,
        body: &[u8],
        probe: bool,
        on_response: impl FnMut(Response) -> Result<T, Failure<RegistryError>>,
    ) -> Result<T, RegistryError> {
        let mut all: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        if let Some(a) = auth {
            all.push(("Authorization", a));
        }
        let req = Request {
            skip_tls_verify: self.skip_verify(url),
            probe,
            ..Request::new(method, url).headers(&all).body(body)
        };
        self.inner.transport.fetch(&req, on_response).map_err(|e| match e {
            FetchError::Transport(source) => RegistryError::Transport { url: url.to_owned(), source },
            FetchError::Rejected(e) => e,
        })
    }

    /// The base URL, choosing the scheme with a `GET /v2/` ping the first time: HTTPS; for an
    /// insecure (or loopback) registry, HTTPS without verification and then plain HTTP.
    fn base(&self) -> Result<String, RegistryError> {
        let mut st = self.state();
        if let Some(b) = &st.base {
            return Ok(b.clone());
        }
        let registry = &self.inner.registry;
        let resp = if self.inner.insecure {
            let https = format!("https://{registry}/v2/");
            // One uncounted try: a plain-HTTP server fails the TLS handshake at once.
            match self.exchange(Method::Get, &https, &[], None, &[], true, Ok) {
                Ok(r) => Ok((format!("https://{registry}"), https, r)),
                Err(e) => {
                    debug!(
                        registry,
                        error = &e as &dyn std::error::Error,
                        "registry: no TLS, trying plain HTTP"
                    );
                    let http = format!("http://{registry}/v2/");
                    self.exchange(Method::Get, &http, &[], None, &[], false, Ok)
                        .map(|r| (format!("http://{registry}"), http, r))
                }
            }
        } else {
            let https = format!("https://{registry}/v2/");
            self.exchange(Method::Get, &https, &[], None, &[], false, Ok)
                .map(|r| (format!("https://{registry}"), https, r))
        };
        let (base, url, resp) = resp?;
        match resp.status() {
            200 => st.challenge = None,
            401 => {
                let h = resp.header("www-authenticate").unwrap_or("").to_owned();
                st.challenge = Some(
                    Challenge::parse(&h)
                        .ok_or(RegistryError::BadChallenge { url: url.clone(), header: h })?,
                );
            }
            status => return Err(RegistryError::NotARegistry { url, status }),
        }
        debug!(registry, base, challenge = ?st.challenge, "registry: ready");
        st.base = Some(base.clone());
        Ok(base)
    }

    fn credentials(&self, st: &mut State, repo: &str) -> Result<Option<Credentials>, RegistryError> {
        if let Some(c) = st.creds.get(repo) {
            return Ok(c.clone());
        }
        let c = self.inner.options.credentials.resolve(&self.inner.registry, repo)?;
        st.creds.insert(repo.to_owned(), c.clone());
        Ok(c)
    }

    /// The `Authorization` value for a request in `repo` needing `scope` (space-separated
    /// scopes), fetching a bearer token when the registry wants one and none is fresh.
    fn authorization(&self, repo: &str, scope: &str) -> Result<Option<String>, RegistryError> {
        let mut st = self.state();
        let Some(challenge) = st.challenge.clone() else { return Ok(None) };
        let creds = self.credentials(&mut st, repo)?;
        match challenge {
            Challenge::Basic => Ok(creds.map(|c| c.basic_header())),
            Challenge::Bearer { realm, service, scope: wanted } => {
                if let Some(t) = st.tokens.get(scope).filter(|t| t.refresh_at > Instant::now()) {
                    return Ok(Some(t.header.clone()));
                }
                // Held lock: concurrent requests wait for one token fetch instead of racing.
                let mut token =
                    self.fetch_token(&realm, service.as_deref(), scope, wanted.as_deref(), creds.as_ref());
                if matches!(token, Err(RegistryError::Unauthorized { .. })) {
                    // The token server refused them: read the credentials again (a rewritten auth
                    // file) and try once more if they changed.
                    st.creds.remove(repo);
                    let fresh = self.credentials(&mut st, repo)?;
                    if fresh != creds {
                        debug!(repo, "registry: credentials re-read after the token server refused them");
                        token = self.fetch_token(
                            &realm,
                            service.as_deref(),
                            scope,
                            wanted.as_deref(),
                            fresh.as_ref(),
                        );
                    }
                }
                let token = token?;
                let header = token.header.clone();
                st.tokens.insert(scope.to_owned(), token);
                Ok(Some(header))
            }
        }
    }

    fn fetch_token(
        &self,
        realm: &str,
        service: Option<&str>,
        scope: &str,
        wanted: Option<&str>,
        creds: Option<&Credentials>,
    ) -> Result<Token, RegistryError> {
        let mut url = realm.to_owned();
        let mut sep = if realm.contains('?') { '&' } else { '?' };
        let mut param = |k: &str, v: &str| {
            url.push(sep);
            url.push_str(k);
            url.push('=');
            url.push_str(&query_escape(v));
            sep = '&';
        };
        if let Some(s) = service {
            param("service", s);
        }
        for one in scope.split(' ') {
            param("scope", one);
        }
        if let Some(w) = wanted.filter(|w| !scope.split(' ').any(|one| one == *w)) {
            param("scope", w);
        }
        let auth = creds.map(Credentials::basic_header);
        let resp = self.exchange(Method::Get, &url, &[], auth.as_deref(), &[], false, Ok)?;
        if resp.status() != 200 {
            let status = resp.status();
            if matches!(status, 401 | 403) {
                // The token server refused the credentials (or their absence): say so.
                return Err(status_error(&url, resp, creds.is_some()));
            }
            return Err(RegistryError::Token { url, reason: format!("HTTP {status}{}", error_detail(resp)) });
        }
        let body = read_limited(&url, resp, "token response", 1 << 20)?;
        #[derive(serde::Deserialize)]
        struct TokenResponse {
            #[serde(default)]
            token: Option<String>,
            #[serde(default)]
            access_token: Option<String>,
            #[serde(default)]
            expires_in: Option<u64>,
        }
        let t: TokenResponse = serde_json::from_slice(&body)
            .map_err(|e| RegistryError::Token { url: url.clone(), reason: e.to_string() })?;
        let value = t.token.or(t.access_token).filter(|v| !v.is_empty()).ok_or_else(|| {
            RegistryError::Token { url: url.clone(), reason: "no token in the response".into() }
        })?;
        // The token spec's default lifetime is 60 s; refresh at 90% of it.
        let life = Duration::from_secs(t.expires_in.unwrap_or(60).max(1));
        debug!(realm, scope, ?life, "registry: got a bearer token");
        Ok(Token { header: format!("Bearer {value}"), refresh_at: Instant::now() + life.mul_f64(0.9) })
    }

    /// Send a request for `path` (after the base URL) in `repo` with pull access; see
    /// [`Self::send_then`].
    pub(crate) fn send(
        &self,
        method: Method,
        repo: &str,
        path: &str,
        headers: &[(&str, String)],
    ) -> Result<(String, Response), RegistryError> {
        let base = self.base()?;
        self.send_then(method, repo, &format!("{base}{path}"), headers, &[], Access::Pull, Ok)
    }

    /// The absolute URL of `location` (a `Location` header: absolute, or a path on the registry).
    pub(crate) fn resolve_location(&self, location: &str) -> Result<String, RegistryError> {
        if location.starts_with("http://") || location.starts_with("https://") {
            return Ok(location.to_owned());
        }
        let base = self.base()?;
        Ok(format!("{base}/{}", location.trim_start_matches('/')))
    }

    /// Whether `url` is on the registry itself (credentials are only ever sent there).
    fn on_registry(&self, url: &str, base: &str) -> bool {
        url.strip_prefix(base).is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    }

    /// Send a request to `url` in `repo`, authenticating as `access` needs, and judge each
    /// answer with `on_response` (within the transport's retry loop): a 401 (first contact, or
    /// a token that expired mid-transfer) updates the challenge, drops the cached token and
    /// retries once with fresh credentials. Credentials go only to the registry's own URLs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn send_then<T>(
        &self,
        method: Method,
        repo: &str,
        url: &str,
        headers: &[(&str, String)],
        body: &[u8],
        access: Access<'_>,
        mut on_response: impl FnMut(Response) -> Result<T, Failure<RegistryError>>,
    ) -> Result<(String, T), RegistryError> {
        /// An answer, or a 401 to authenticate again for.
        enum Answer<T> {
            Done(T),
            Challenge(Box<Response>),
        }
        let base = self.base()?;
        let url = url.to_owned();
        let ours = self.on_registry(&url, &base);
        let scope = access.scopes(repo);
        let mut reauthenticated = false;
        loop {
            let auth = if ours { self.authorization(repo, &scope)? } else { None };
            let answer = self.exchange(method, &url, headers, auth.as_deref(), body, false, |resp| {
                if resp.status() == 401 && ours && !reauthenticated {
                    return Ok(Answer::Challenge(Box::new(resp)));
                }
                on_response(resp).map(Answer::Done)
            })?;
            let resp = match answer {
                Answer::Done(v) => return Ok((url, v)),
                Answer::Challenge(resp) => *resp,
            };
            reauthenticated = true;
            let h = resp.header("www-authenticate").unwrap_or("").to_owned();
            let challenge = Challenge::parse(&h)
                .ok_or_else(|| RegistryError::BadChallenge { url: url.clone(), header: h })?;
            let mut st = self.state();
            debug!(url, had_auth = auth.is_some(), ?challenge, "registry: 401, authenticating again");
            st.tokens.remove(&scope);
            // Credentials refused (or a token gone stale) are read again: an auth file rewritten
            // under a long-running daemon (a rotated password) is picked up here.
            let old = st.creds.remove(repo).flatten();
            let creds = self.credentials(&mut st, repo)?;
            let changed = creds != old;
            if changed {
                debug!(url, "registry: credentials changed since they were read");
            }
            // Basic auth has nothing new to try when the same credentials were refused, or none.
            let hopeless = challenge == Challenge::Basic && ((auth.is_some() && !changed) || creds.is_none());
            st.challenge = Some(challenge);
            drop(st);
            if hopeless {
                return Err(status_error(&url, resp, creds.is_some()));
            }
        }
    }

    pub(crate) fn has_credentials(&self, repo: &str) -> bool {
        let mut st = self.state();
        self.credentials(&mut st, repo).ok().flatten().is_some()
    }

    /// `https://host[:port]` or `http://host[:port]`, pinging `/v2/` the first time.
    pub(crate) fn base_url(&self) -> Result<String, RegistryError> {
        self.base()
    }

    /// Check `/v2/` (scheme choice and the auth challenge) without fetching anything else.
    pub fn ping(&self) -> Result<(), RegistryError> {
        self.base().map(drop)
    }

    /// GET a manifest or index by tag or digest, accepting OCI and Docker schema 2 manifests and
    /// indexes. By digest, the bytes must hash to it; by tag, the digest is computed (and must
    /// match `Docker-Content-Digest` when the registry sends one).
    pub fn get_manifest(&self, repo: &str, target: &Target) -> Result<Manifest, RegistryError> {
        let path = format!("/v2/{repo}/manifests/{}", target.as_path());
        let (url, resp) = self.send(Method::Get, repo, &path, &[("Accept", accept_header(ACCEPT_ALL))])?;
        if resp.status() != 200 {
            return Err(status_error(&url, resp, self.has_credentials(repo)));
        }
        let content_type = resp.header("content-type").map(str::to_owned);
        let claimed = resp.header("docker-content-digest").and_then(Digest::parse);
        let bytes = read_limited(&url, resp, "manifest", MAX_MANIFEST)?;
        let digest = Digest::of(&bytes);
        let expected = match target {
            Target::Digest(d) => Some(d.clone()),
            Target::Tag(_) => claimed,
        };
        if let Some(e) = expected.filter(|e| *e != digest) {
            return Err(RegistryError::DigestMismatch {
                url,
                what: "manifest",
                expected: e.to_string(),
                actual: digest.to_string(),
            });
        }
        let media_type = effective_media_type(&bytes, content_type.as_deref()).unwrap_or_default();
        let kind = classify(&media_type).ok_or_else(|| RegistryError::UnsupportedMediaType {
            url: url.clone(),
            media_type: media_type.clone(),
        })?;
        Ok(Manifest { media_type, kind, digest, bytes, url })
    }

    /// Every tag of `repo` (`GET /v2/REPO/tags/list`, page by page through the `Link` header's
    /// `rel="next"`, as the distribution spec pages it), in the registry's order.
    pub fn list_tags(&self, repo: &str) -> Result<Vec<String>, RegistryError> {
        #[derive(serde::Deserialize)]
        struct TagList {
            #[serde(default)]
            tags: Option<Vec<String>>,
        }
        let mut tags = Vec::new();
        let mut path = format!("/v2/{repo}/tags/list?n={TAG_PAGE}");
        // A registry that pages back to a page it sent before would loop forever: bound it.
        for _ in 0..MAX_TAG_PAGES {
            let (url, resp) = self.send(Method::Get, repo, &path, &[])?;
            if resp.status() != 200 {
                return Err(status_error(&url, resp, self.has_credentials(repo)));
            }
            let next = resp.header("link").and_then(next_link);
            let body = read_limited(&url, resp, "tag list", MAX_MANIFEST)?;
            let page: TagList = serde_json::from_slice(&body).map_err(|e| RegistryError::Read {
                url: url.clone(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, format!("bad tag list: {e}")),
            })?;
            tags.extend(page.tags.unwrap_or_default());
            match next {
                Some(n) => path = n,
                None => return Ok(tags),
            }
        }
        Err(RegistryError::Status {
            url: format!("{}/v2/{repo}/tags/list", self.base()?),
            status: 200,
            detail: format!(" (more than {MAX_TAG_PAGES} pages of tags: the registry's paging does not end)"),
        })
    }

    /// Stream a blob. The reader verifies the size (when given) and the digest at the end, and
    /// resumes with a Range request when the connection breaks mid-body (bounded by the retry
    /// policy's attempts).
    pub fn get_blob(
        &self,
        repo: &str,
        digest: &Digest,
        size: Option<u64>,
    ) -> Result<BlobReader, RegistryError> {
        BlobReader::open(self.clone(), repo, digest, size)
    }

    /// A small blob (a config) read whole: at most `limit` bytes, size and digest verified.
    pub fn get_blob_bytes(
        &self,
        repo: &str,
        digest: &Digest,
        size: Option<u64>,
        limit: u64,
    ) -> Result<Vec<u8>, RegistryError> {
        let mut r = self.get_blob(repo, digest, size)?;
        if let Some(s) = size.filter(|s| *s > limit) {
            return Err(RegistryError::TooLarge {
                url: r.url().to_owned(),
                what: "blob",
                limit: limit.min(s),
            });
        }
        let mut out = Vec::new();
        let url = r.url().to_owned();
        (&mut r).take(limit + 1).read_to_end(&mut out).map_err(|e| crate::blob::unwrap_io(&url, e))?;
        if out.len() as u64 > limit {
            return Err(RegistryError::TooLarge { url, what: "blob", limit });
        }
        Ok(out)
    }

    /// Bytes `start..start + len` of a blob (for lazy reads of packs). Not verifiable on its own:
    /// the caller checks the content (e.g. chunk ids). A server that ignores `Range` is handled by
    /// skipping, so the result is always exactly the asked range or an error.
    pub fn get_blob_range(
        &self,
        repo: &str,
        digest: &Digest,
        start: u64,
        len: u64,
    ) -> Result<Vec<u8>, RegistryError> {
        crate::blob::get_range(self, repo, digest, start, len)
    }

    /// [`Self::get_blob_range`], handing the bytes to `sink` as they arrive (in order, each byte
    /// once, across retries); `sink` returning `false` stops the read with
    /// [`RegistryError::Stopped`].
    pub fn get_blob_range_streamed(
        &self,
        repo: &str,
        digest: &Digest,
        start: u64,
        len: u64,
        sink: &mut dyn FnMut(&[u8]) -> bool,
    ) -> Result<(), RegistryError> {
        crate::blob::get_range_streamed(self, repo, digest, start, len, sink)
    }

    /// The size of a blob (`HEAD`), or `None` when the registry does not have it.
    pub fn blob_size(&self, repo: &str, digest: &Digest) -> Result<Option<u64>, RegistryError> {
        let (url, resp) = self.send(Method::Head, repo, &format!("/v2/{repo}/blobs/{digest}"), &[])?;
        match resp.status() {
            200 => Ok(resp.header("content-length").and_then(|v| v.parse().ok())),
            404 => Ok(None),
            _ => Err(status_error(&url, resp, self.has_credentials(repo))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_queries() {
        assert_eq!(query_escape("repository:a/b:pull,push"), "repository%3Aa%2Fb%3Apull%2Cpush");
        assert_eq!(query_escape("reg.example_1~-"), "reg.example_1~-");
    }

    #[test]
    fn loopback_is_insecure() {
        let c = Client::new("127.0.0.1:5000", ClientOptions::default()).unwrap();
        assert!(c.inner.insecure);
        let c = Client::new("registry.example.com", ClientOptions::default()).unwrap();
        assert!(!c.inner.insecure);
        let c = Client::new("registry.example.com", ClientOptions { insecure: true, ..Default::default() })
            .unwrap();
        assert!(c.inner.insecure);
        assert!(Client::new("bad host", ClientOptions::default()).is_err());
    }

    #[test]
    fn follows_next_links() {
        assert_eq!(
            next_link(r#"</v2/a/b/tags/list?last=x&n=2>; rel="next""#).as_deref(),
            Some("/v2/a/b/tags/list?last=x&n=2")
        );
        assert_eq!(
            next_link(r#"<https://reg.example/v2/a/tags/list?n=2&last=y>; rel=next"#).as_deref(),
            Some("/v2/a/tags/list?n=2&last=y"),
            "an absolute URL is cut to its path"
        );
        assert_eq!(
            next_link(r#"</v2/a/tags/list?last=p>; rel="prev", </v2/a/tags/list?last=z>; rel="next""#)
                .as_deref(),
            Some("/v2/a/tags/list?last=z")
        );
        for none in ["", r#"</v2/a/tags/list?last=p>; rel="prev""#, r#"</elsewhere>; rel="next""#, "junk"] {
            assert_eq!(next_link(none), None, "{none}");
        }
    }
}
