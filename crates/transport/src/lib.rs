//! The one HTTP transport of Tessera's origins: the HTTP(S) store and the registry client both
//! send every request through a [`Transport`].
//!
//! One transport holds: one connection pool (idle connections kept = the concurrency limit;
//! the connection that came back last goes first: `preconnect.rs`), one limiter of requests in flight, one retry policy ([`RetryPolicy`]:
//! attempts, backoff with jitter, `Retry-After`), one timeout classification ([`TimeoutKind`]:
//! connect, first byte, stall, whole request), TLS roots and verification ([`TlsOptions`]), and
//! one stats type ([`Stats`]) with one request-duration histogram.
//!
//! **What the histogram measures**, for every origin alike: one attempt, from sending the
//! request to the end of its response — the body read to its end or dropped (a streamed blob:
//! until the reader is dropped), or the failure. The attempt holds one slot of the limiter for
//! the same span; backoff waits hold none.
//!
//! The interface is small so that the HTTP implementation (ureq today) can be swapped:
//! [`Transport::fetch`] (the retry loop, with the caller judging each answer),
//! [`Transport::send`] (retries on transport failures and retryable statuses only),
//! [`Response`] and [`BodyReader`] (counted body bytes). No ureq type appears in it.
#![forbid(unsafe_code)]

mod config;
mod error;
mod late;
mod negotiated;
mod preconnect;
mod retry;
mod stats;

use std::io::{self, Read};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tessera_metrics::Histogram;
use tracing::{debug, info, warn};

pub use config::{BadPem, HttpVersion, Timeouts, TlsOptions, TransportConfig};
pub use error::{ErrorKind, Failure, FetchError, TimeoutKind, TransportError, TransportErrorKind};
pub use retry::{retryable_status, Resume, RetryBudget, RetryPolicy};
pub use stats::{ErrorCounts, Stats};

use stats::{Counters, Limiter};

/// An HTTP method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Get,
    Head,
    Post,
    Put,
    Patch,
    Delete,
}

impl Method {
    /// The method's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Get => "GET",
            Method::Head => "HEAD",
            Method::Post => "POST",
            Method::Put => "PUT",
            Method::Patch => "PATCH",
            Method::Delete => "DELETE",
        }
    }
}

/// One request, sent again as it is on a retry.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub method: Method,
    pub url: &'a str,
    /// Extra headers (`Range`, `Accept`, `Authorization`, …).
    pub headers: &'a [(&'a str, &'a str)],
    /// Sent with POST, PUT and PATCH (an empty one sends `Content-Length: 0`).
    pub body: &'a [u8],
    /// Accept any server certificate for this request (besides [`TlsOptions::skip_verify`]).
    pub skip_tls_verify: bool,
    /// A probe expected to fail (a registry's TLS try against a plain-HTTP server): one
    /// attempt, not counted in [`Stats`] or the histogram.
    pub probe: bool,
}

impl<'a> Request<'a> {
    /// A counted request without headers or body.
    pub fn new(method: Method, url: &'a str) -> Self {
        Self { method, url, headers: &[], body: &[], skip_tls_verify: false, probe: false }
    }

    /// A GET of `url`.
    pub fn get(url: &'a str) -> Self {
        Self::new(Method::Get, url)
    }

    /// With `headers`.
    pub fn headers(self, headers: &'a [(&'a str, &'a str)]) -> Self {
        Self { headers, ..self }
    }

    /// With `body`.
    pub fn body(self, body: &'a [u8]) -> Self {
        Self { body, ..self }
    }
}

struct Shared {
    config: TransportConfig,
    verified: ureq::Agent,
    unverified: ureq::Agent,
    /// Connections made ahead of need for the verifying agent ([`Transport::preconnect`]), and
    /// the connector chain that makes them.
    stash: Arc<preconnect::Stash>,
    chain: Arc<preconnect::Chain>,
    /// The HTTP/2-capable client for `https://` URLs ([`HttpVersion::Negotiate`]).
    negotiated: Option<negotiated::Negotiated>,
    limiter: Limiter,
    counters: Counters,
    latency: Histogram,
    /// Requests in a row that spent their attempts on retryable failures (reset by any answer):
    /// the origin is failing from [`RetryPolicy::failing_after`] on.
    exhausted: AtomicU32,
    /// Wakes the requests waiting out a backoff when the origin starts counting as failing
    /// (their next attempt is their last, and it goes at once); the mutex orders the check of
    /// [`Self::failing`] before a wait against the wake-up.
    backoffs: (Mutex<()>, Condvar),
    /// The origin's head latency, for [`RetryPolicy::resend_late`].
    head: late::HeadLatency,
    /// Immediate retries left.
    budget: RetryBudget,
    /// Requests answered so far (a success or a final refusal): a request whose attempts
    /// failed while others were answered met a flaky origin, not a gone one.
    answers: AtomicU64,
}

impl Shared {
    /// Whether the origin counts as failing: requests make one attempt each.
    fn failing(&self) -> bool {
        let after = self.config.retry.failing_after;
        after > 0 && self.exhausted.load(Ordering::Relaxed) >= after
    }

    /// A request spent its attempts on retryable failures.
    fn exhausted(&self) {
        let after = self.config.retry.failing_after;
        if after > 0 && self.exhausted.fetch_add(1, Ordering::Relaxed) + 1 == after {
            {
                let _order = self.backoffs.0.lock().unwrap_or_else(|e| e.into_inner());
                self.backoffs.1.notify_all();
            }
            warn!(
                requests = after,
                "the origin is failing (requests in a row spent their retries): one attempt per request, \
                 without backoff, until it answers"
            );
        }
    }

    /// The origin answered (a success or a final refusal such as a 404).
    fn answered(&self) {
        self.answers.fetch_add(1, Ordering::Relaxed);
        let after = self.config.retry.failing_after;
        // The common case, a healthy origin, only reads the counter.
        if self.exhausted.load(Ordering::Relaxed) > 0
            && self.exhausted.swap(0, Ordering::Relaxed) >= after
            && after > 0
        {
            info!("the origin answers again: requests are retried as usual");
        }
    }

    /// Wait `wait` before a retry, or less: a request backing off when the origin starts
    /// counting as failing makes its last attempt at once, as a request starting then would
    /// (a guest read that joined it waits one attempt, not the rest of a backoff).
    fn back_off(&self, wait: Duration, probe: bool) {
        let guard = self.backoffs.0.lock().unwrap_or_else(|e| e.into_inner());
        let until_failing = |_: &mut ()| probe || !self.failing();
        drop(self.backoffs.1.wait_timeout_while(guard, wait, until_failing));
    }
}

/// The HTTP client of one origin. Cheap to clone (the pool, the limiter, the counters and the
/// histogram are shared); `Send + Sync`.
#[derive(Clone)]
pub struct Transport {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport").field("config", &self.shared.config).finish_non_exhaustive()
    }
}

/// One attempt in progress: its limiter slot and start, given back (and timed) on drop.
struct Attempt {
    shared: Arc<Shared>,
    started: Instant,
    counted: bool,
}

impl Drop for Attempt {
    fn drop(&mut self) {
        if self.counted {
            self.shared.latency.observe(self.started.elapsed().as_secs_f64());
        }
        self.shared.limiter.release();
    }
}

/// An HTTP answer whatever its status. Holds its attempt's limiter slot until dropped.
pub struct Response {
    status: u16,
    headers: http::HeaderMap,
    body: BodyReader,
}

impl std::fmt::Debug for Response {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Response").field("status", &self.status).finish_non_exhaustive()
    }
}

impl Response {
    /// The status code.
    pub fn status(&self) -> u16 {
        self.status
    }

    /// Header `name` (case-insensitive), if present and text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The body as a stream.
    pub fn into_reader(self) -> BodyReader {
        self.body
    }

    /// The body as a stream, borrowed (the response stays for its headers).
    pub fn reader(&mut self) -> &mut BodyReader {
        &mut self.body
    }

    /// Read the whole body, at most `limit` bytes: `Ok(None)` when it is longer.
    pub fn read_to_vec(&mut self, limit: u64) -> io::Result<Option<Vec<u8>>> {
        let mut out = Vec::new();
        (&mut self.body).take(limit.saturating_add(1)).read_to_end(&mut out)?;
        Ok((out.len() as u64 <= limit).then_some(out))
    }
}

/// A response body; every byte read counts in [`Stats::bytes`]. The attempt ends (for the
/// histogram and the limiter) when it is dropped.
pub struct BodyReader {
    inner: Body,
    attempt: Attempt,
}

/// The body of one HTTP implementation.
enum Body {
    Http1(ureq::BodyReader<'static>),
    Negotiated(negotiated::Body),
}

impl std::fmt::Debug for BodyReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BodyReader").finish_non_exhaustive()
    }
}

impl Read for BodyReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = match &mut self.inner {
            Body::Http1(b) => b.read(buf)?,
            Body::Negotiated(b) => b.read(buf)?,
        };
        if self.attempt.counted {
            self.attempt.shared.counters.bytes(n);
        }
        Ok(n)
    }
}

/// How many times one request is given up for a late head and sent again
/// ([`RetryPolicy::resend_late`]): each deadline twice the last, then the first-byte timeout
/// alone. Two stalled answers in a row are not rare in a storm; a slow origin (every head late)
/// costs at most seven deadlines before an answer teaches the estimate its new latency.
const LATE_RESENDS: u32 = 3;

/// Whether `url` is an `https://` URL.
fn is_https(url: &str) -> bool {
    url.get(..8).is_some_and(|s| s.eq_ignore_ascii_case("https://"))
}

/// Whether `req` teaches the head latency estimate: a counted GET.
fn times_heads(req: &Request<'_>) -> bool {
    !req.probe && req.method == Method::Get
}

/// Whether `req` may be given up when its head is late and sent again: a counted ranged GET —
/// the data path's reads, which a guest may be waiting for. Other requests (a manifest, a
/// token, an upload, a whole blob) are never resent.
fn resends_late(req: &Request<'_>) -> bool {
    times_heads(req) && req.headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("range"))
}

/// `rb` giving up when no response head came within `deadline` (`None`: the agent's first-byte
/// timeout).
fn with_deadline(
    rb: ureq::RequestBuilder<ureq::typestate::WithoutBody>,
    deadline: Option<Duration>,
) -> ureq::RequestBuilder<ureq::typestate::WithoutBody> {
    match deadline {
        Some(d) => rb.config().timeout_recv_response(Some(d)).build(),
        None => rb,
    }
}

fn with_headers<B>(mut rb: ureq::RequestBuilder<B>, headers: &[(&str, &str)]) -> ureq::RequestBuilder<B> {
    for (k, v) in headers {
        rb = rb.header(*k, *v);
    }
    rb
}

impl Transport {
    /// A transport with `config`. Nothing is connected yet.
    pub fn new(config: TransportConfig) -> Self {
        // Preconnected connections are made by the verifying agent's chain, for it alone; each
        // agent pools its own. Idle connections kept: one per request that may be in flight.
        let most = config.max_concurrency.max(1);
        let stash = Arc::new(preconnect::Stash::new(most));
        let (verified, chain) = config::agent(&config, !config.tls.skip_verify, &stash);
        let (unverified, _) = config::agent(&config, false, &Arc::new(preconnect::Stash::new(most)));
        let negotiated = match config.http {
            HttpVersion::Http1 => None,
            HttpVersion::Negotiate => match negotiated::Negotiated::new(&config) {
                Ok(n) => Some(n),
                Err(e) => {
                    warn!(error = &e as &dyn std::error::Error, "no HTTP/2 client: using HTTP/1.1");
                    None
                }
            },
        };
        Self {
            shared: Arc::new(Shared {
                limiter: Limiter::new(config.max_concurrency),
                verified,
                unverified,
                stash,
                chain,
                negotiated,
                config,
                counters: Counters::default(),
                latency: tessera_metrics::origin_latency_histogram(),
                exhausted: AtomicU32::new(0),
                backoffs: (Mutex::new(()), Condvar::new()),
                head: late::HeadLatency::default(),
                budget: RetryBudget::new(),
                answers: AtomicU64::new(0),
            }),
        }
    }

    /// The settings.
    pub fn config(&self) -> &TransportConfig {
        &self.shared.config
    }

    /// The retry policy.
    pub fn retry_policy(&self) -> RetryPolicy {
        self.shared.config.retry
    }

    /// Requests, retries, body bytes and failed attempts so far.
    pub fn stats(&self) -> Stats {
        self.shared.counters.snapshot()
    }

    /// The request-duration histogram (see the crate docs for what it measures), shared with
    /// this transport: every counted attempt since [`Self::new`] is in it. Not registered
    /// anywhere; the daemon adopts it.
    pub fn latency_histogram(&self) -> Histogram {
        self.shared.latency.clone()
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.shared.limiter.in_flight()
    }

    /// Count a failed attempt that the transport did not see (a streamed body found short, or
    /// not matching its digest, after [`Self::send`] returned).
    pub fn record_error(&self, kind: ErrorKind) {
        self.shared.counters.error(kind);
    }

    /// Count a retry that the transport did not make (a streamed body resumed by its reader).
    pub fn record_retry(&self) {
        self.shared.counters.retry();
    }

    /// One attempt: send `req`, return the answer whatever its status. `head_deadline`: give up
    /// when no response head came within it (instead of the first-byte timeout).
    fn attempt(
        &self,
        req: &Request<'_>,
        head_deadline: Option<Duration>,
    ) -> Result<Response, TransportError> {
        let shared = &self.shared;
        shared.limiter.acquire();
        let attempt = Attempt { shared: Arc::clone(shared), started: Instant::now(), counted: !req.probe };
        if !req.probe {
            shared.counters.request();
        }
        let negotiated = shared.negotiated.as_ref().filter(|_| is_https(req.url));
        let sent = match negotiated {
            Some(n) => n.send(req, head_deadline).map(|a| (a.status, a.headers, Body::Negotiated(a.body))),
            None => self.send_http1(req, head_deadline),
        };
        match sent {
            Ok((status, headers, body)) => {
                if times_heads(req) {
                    shared.head.observe(attempt.started.elapsed());
                }
                Ok(Response { status, headers, body: BodyReader { inner: body, attempt } })
            }
            Err(e) => {
                let abandoned = head_deadline.is_some()
                    && e.kind() == TransportErrorKind::Timeout(TimeoutKind::FirstByte);
                if !req.probe && !abandoned {
                    shared.counters.error(e.error_kind());
                }
                Err(e)
            }
        }
    }

    /// Send `req` over HTTP/1.1 (ureq).
    fn send_http1(
        &self,
        req: &Request<'_>,
        head_deadline: Option<Duration>,
    ) -> Result<(u16, http::HeaderMap, Body), TransportError> {
        let shared = &self.shared;
        let agent = if req.skip_tls_verify { &shared.unverified } else { &shared.verified };
        let h = req.headers;
        let sent = match req.method {
            Method::Get => with_deadline(with_headers(agent.get(req.url), h), head_deadline).call(),
            Method::Head => with_headers(agent.head(req.url), h).call(),
            Method::Post => with_headers(agent.post(req.url), h).send(req.body),
            Method::Put => with_headers(agent.put(req.url), h).send(req.body),
            Method::Patch => with_headers(agent.patch(req.url), h).send(req.body),
            Method::Delete => with_headers(agent.delete(req.url), h).call(),
        };
        let (parts, body) = sent.map_err(TransportError::from_ureq)?.into_parts();
        Ok((parts.status.as_u16(), parts.headers, Body::Http1(body.into_reader())))
    }

    /// The retry loop. Send `req` and hand each answer to `on_response`, which reads what it
    /// needs (the body included) and judges it; retry, within the policy, whatever part failed:
    /// the request (a retryable [`TransportError`]), the status (5xx, 408, 429: waiting for
    /// `Retry-After` when the server sends one; the last such answer goes to `on_response`), or
    /// the caller's verdict ([`Failure::retry`]). Every failed attempt counts once in
    /// [`Stats::errors`], by its kind. While the origin is failing
    /// ([`RetryPolicy::failing_after`]) a request makes one attempt.
    pub fn fetch<T, E>(
        &self,
        req: &Request<'_>,
        mut on_response: impl FnMut(Response) -> Result<T, Failure<E>>,
    ) -> Result<T, FetchError<E>> {
        let result = self.fetch_inner(req, &mut on_response);
        if !req.probe {
            match &result {
                Ok(_) | Err(Exhausted::Answered(_)) => self.shared.answered(),
                Err(Exhausted::Retryable(_)) => self.shared.exhausted(),
                Err(Exhausted::Final(_)) => {}
            }
        }
        result.map_err(Exhausted::into_inner)
    }

    fn fetch_inner<T, E>(
        &self,
        req: &Request<'_>,
        on_response: &mut impl FnMut(Response) -> Result<T, Failure<E>>,
    ) -> Result<T, Exhausted<E>> {
        let shared = &*self.shared;
        let policy = shared.config.retry;
        let attempts = if req.probe { 1 } else { policy.attempts.max(1) };
        let counters = &shared.counters;
        let mut retry = 0u32;
        if !req.probe {
            shared.budget.deposit();
        }
        let answers_before = shared.answers.load(Ordering::Relaxed);
        // A first attempt whose head is late is sent again at once, without spending an attempt,
        // up to LATE_RESENDS times with the deadline doubled each time (RetryPolicy::resend_late).
        let mut resends = 0u32;
        let mut head_deadline = match policy.resend_late {
            Some(floor) if resends_late(req) => {
                shared.head.deadline(floor, shared.config.timeouts.first_byte)
            }
            _ => None,
        };
        loop {
            let single = !req.probe && shared.failing();
            if single && retry == 0 {
                counters.single_attempt();
            }
            // Twice the attempts while other requests are being answered: a flaky origin.
            let flaky = !req.probe && shared.answers.load(Ordering::Relaxed) > answers_before;
            let allowed = if flaky && attempts > 1 { attempts.saturating_mul(2) } else { attempts };
            let last = retry + 1 >= allowed || single;
            let deadline = head_deadline.take();
            let (wait, why) = match self.attempt(req, deadline) {
                Err(e)
                    if deadline.is_some()
                        && e.kind() == TransportErrorKind::Timeout(TimeoutKind::FirstByte) =>
                {
                    counters.resend();
                    debug!(
                        method = req.method.as_str(),
                        url = req.url,
                        late_ms = deadline.map_or(0, |d| d.as_millis() as u64),
                        "no response head in the usual time: sending the request again"
                    );
                    resends += 1;
                    if resends < LATE_RESENDS {
                        head_deadline = deadline
                            .map(|d| d.saturating_mul(2))
                            .filter(|&d| d < shared.config.timeouts.first_byte);
                    }
                    continue;
                }
                Err(e) if e.is_retryable() && !last => {
                    // Nobody there: back off. A broken exchange: at once, within the budget.
                    let wait = if e.is_unreachable() {
                        policy.backoff(retry)
                    } else {
                        policy.wait(retry, None, None, &shared.budget)
                    };
                    (wait, e.to_string())
                }
                Err(e) if e.is_retryable() => return Err(Exhausted::Retryable(FetchError::Transport(e))),
                Err(e) => return Err(Exhausted::Final(FetchError::Transport(e))),
                Ok(resp) => {
                    let status = resp.status();
                    let retryable = retryable_status(status);
                    if retryable && !req.probe {
                        counters.error(ErrorKind::Status);
                    }
                    if retryable && !last {
                        let wait =
                            policy.wait(retry, Some(status), resp.header("retry-after"), &shared.budget);
                        (wait, format!("HTTP {status}"))
                    } else {
                        match on_response(resp) {
                            Ok(v) => return Ok(v),
                            Err(f) => {
                                // A retryable status is counted above already.
                                let already = retryable && f.kind == Some(ErrorKind::Status);
                                if let (Some(kind), false, false) = (f.kind, req.probe, already) {
                                    counters.error(kind);
                                }
                                if !f.retry && !retryable {
                                    // A final answer (a 404, a 416): the origin is up.
                                    return Err(Exhausted::Answered(FetchError::Rejected(f.error)));
                                }
                                if !f.retry || last {
                                    return Err(Exhausted::Retryable(FetchError::Rejected(f.error)));
                                }
                                (
                                    policy.wait(retry, None, None, &shared.budget),
                                    "the answer was rejected".to_owned(),
                                )
                            }
                        }
                    }
                }
            };
            retry += 1;
            if !req.probe {
                counters.retry();
            }
            debug!(
                method = req.method.as_str(),
                url = req.url,
                why,
                retry,
                wait_ms = wait.as_millis() as u64,
                "retrying"
            );
            if !wait.is_zero() {
                shared.back_off(wait, req.probe);
            }
        }
    }

    /// Whether the origin counts as failing now ([`RetryPolicy::failing_after`]).
    pub fn is_failing(&self) -> bool {
        self.shared.failing()
    }

    /// Open up to `connections` connections to the host of `url` ahead of need (at most the
    /// pool's size, [`TransportConfig::max_concurrency`]), at once: TCP connected and, for
    /// `https://`, TLS negotiated. Returns when they are made or failed. The next requests that
    /// need a new connection take them (`preconnect.rs`); no request is sent until then, so the
    /// origin sees connects only. A daemon calls it on a thread of its own at its first
    /// request, so the reads of its start and its first misses do not each wait for a connect
    /// round trip and a handshake. Nothing through a proxy, or to an `https://` origin served
    /// by the HTTP/2 client (one connection carries every request there). Connections left
    /// unused are closed by [`Self::expire_preconnected`] or by a request that looks after
    /// [`Self::PRECONNECTED_MAX_AGE`].
    pub fn preconnect(&self, url: &str, connections: usize) {
        let shared = &self.shared;
        if shared.verified.config().proxy().is_some() || (is_https(url) && shared.negotiated.is_some()) {
            return;
        }
        let n = connections.min(shared.config.max_concurrency.max(1));
        preconnect::open(
            &shared.stash,
            &*shared.chain,
            shared.verified.config(),
            url,
            n,
            shared.config.timeouts.connect,
        );
        debug!(url, opened = shared.stash.len(), "preconnected");
    }

    /// Close the connections [`Self::preconnect`] made that no request took within
    /// [`Self::PRECONNECTED_MAX_AGE`] (a daemon that needed fewer than it opened).
    pub fn expire_preconnected(&self) {
        self.shared.stash.expire();
    }

    /// How long a connection made by [`Self::preconnect`] waits for a request.
    pub const PRECONNECTED_MAX_AGE: Duration = preconnect::MAX_AGE;

    /// [`Self::fetch`] returning the answer as it is: retries on transport failures and
    /// retryable statuses only; the caller reads the body (a stream: the attempt lasts until the
    /// response or its reader is dropped).
    pub fn send(&self, req: &Request<'_>) -> Result<Response, TransportError> {
        self.fetch(req, Ok::<_, Failure<std::convert::Infallible>>).map_err(|e| match e {
            FetchError::Transport(t) => t,
            FetchError::Rejected(never) => match never {},
        })
    }
}

/// How a request's retry loop ended without a result.
enum Exhausted<E> {
    /// Its attempts spent on retryable failures: the origin may be failing.
    Retryable(FetchError<E>),
    /// A final answer (a 404, a 416, a body the caller refuses for good): the origin is up.
    Answered(FetchError<E>),
    /// A failure no attempt can help, with no answer (a refused certificate, a bad URL).
    Final(FetchError<E>),
}

impl<E> Exhausted<E> {
    fn into_inner(self) -> FetchError<E> {
        match self {
            Exhausted::Retryable(e) | Exhausted::Answered(e) | Exhausted::Final(e) => e,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;

    /// A server answering each connection's requests from `answers` in turn (one per
    /// connection; `Connection: close`).
    fn serve(answers: Vec<&'static str>) -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for answer in answers {
                let (mut s, _) = l.accept().unwrap();
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf);
                let _ = s.write_all(answer.as_bytes());
            }
        });
        format!("http://{addr}/x")
    }

    fn quick() -> TransportConfig {
        TransportConfig {
            retry: RetryPolicy {
                attempts: 3,
                base: Duration::from_millis(1),
                max: Duration::from_millis(2),
                ..RetryPolicy::default()
            },
            ..TransportConfig::default()
        }
    }

    #[test]
    fn retries_statuses_and_rejections_and_counts_each_attempt() {
        let url = serve(vec![
            "HTTP/1.1 503 Busy\r\nRetry-After: 0\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nbad",
            "HTTP/1.1 200 OK\r\nContent-Length: 4\r\nConnection: close\r\n\r\ngood",
        ]);
        let t = Transport::new(quick());
        let body = t
            .fetch(&Request::get(&url), |mut r| {
                let b = r.read_to_vec(100).unwrap().unwrap();
                if b == b"bad" {
                    Err(Failure::retry(ErrorKind::Digest, "bad"))
                } else {
                    Ok(b)
                }
            })
            .unwrap();
        assert_eq!(body, b"good");
        let s = t.stats();
        assert_eq!((s.requests, s.retries, s.bytes), (3, 2, 7));
        assert_eq!((s.errors.status, s.errors.digest, s.errors.total()), (1, 1, 2));
        assert_eq!(t.latency_histogram().get_sample_count(), 3, "every attempt timed");
        assert_eq!(t.in_flight(), 0);
    }

    #[test]
    fn the_last_retryable_status_goes_to_the_caller_and_counts_once() {
        let busy = "HTTP/1.1 503 Busy\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let url = serve(vec![busy, busy, busy]);
        let t = Transport::new(quick());
        let e = t
            .fetch(&Request::get(&url), |r| Err::<(), _>(Failure::fatal(ErrorKind::Status, r.status())))
            .unwrap_err();
        assert!(matches!(e, FetchError::Rejected(503)));
        let s = t.stats();
        assert_eq!((s.requests, s.retries, s.errors.status), (3, 2, 3));
    }

    #[test]
    fn refused_connections_are_transport_errors_after_the_attempts() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/x", l.local_addr().unwrap());
        drop(l);
        let t = Transport::new(quick());
        let started = Instant::now();
        let e = t.send(&Request::get(&url)).unwrap_err();
        assert_eq!(e.kind(), TransportErrorKind::Connection);
        assert!(e.is_unreachable());
        // Nobody there: the retries backed off (equal jitter: at least half of 1 ms, 2 ms).
        assert!(started.elapsed() >= Duration::from_micros(1500), "{:?}", started.elapsed());
        let s = t.stats();
        assert_eq!((s.requests, s.retries, s.errors.transport), (3, 2, 3));
        // An uncounted probe leaves no trace.
        let probe = Request { probe: true, ..Request::get(&url) };
        assert!(t.send(&probe).is_err());
        assert_eq!(t.stats().requests, 3);
        assert_eq!(t.latency_histogram().get_sample_count(), 3);
    }

    #[test]
    fn a_failing_origin_gets_one_attempt_per_request_until_it_answers() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let url = format!("http://{addr}/x");
        drop(l);
        let t = Transport::new(quick());
        // Two requests spend their 3 attempts each on refused connections: the origin is failing.
        for n in 1..=2 {
            assert!(t.send(&Request::get(&url)).is_err());
            assert_eq!(t.stats().requests, 3 * n);
        }
        assert!(t.is_failing());
        // Now one attempt each, no backoff.
        for n in 1..=3 {
            assert!(t.send(&Request::get(&url)).is_err());
            let s = t.stats();
            assert_eq!((s.requests, s.retries, s.single_attempts), (6 + n, 4, n));
        }
        // The origin is back on the same port: the next request succeeds with its one attempt,
        // and requests are retried as usual again.
        let l = TcpListener::bind(addr).unwrap();
        let busy = "HTTP/1.1 503 Busy\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let ok = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok";
        std::thread::spawn(move || {
            for answer in [ok, busy, ok] {
                let (mut s, _) = l.accept().unwrap();
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf);
                let _ = s.write_all(answer.as_bytes());
            }
        });
        let mut body = String::new();
        t.send(&Request::get(&url)).unwrap().into_reader().read_to_string(&mut body).unwrap();
        assert_eq!(body, "ok");
        assert!(!t.is_failing());
        assert_eq!((t.stats().requests, t.stats().single_attempts), (10, 4));
        // A 503 is retried again.
        let mut body = String::new();
        t.send(&Request::get(&url)).unwrap().into_reader().read_to_string(&mut body).unwrap();
        let s = t.stats();
        assert_eq!((body.as_str(), s.requests, s.retries, s.single_attempts), ("ok", 12, 5, 4));
    }

    #[test]
    fn a_request_backing_off_when_the_origin_starts_failing_makes_its_last_attempt_at_once() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/x", l.local_addr().unwrap());
        drop(l);
        // Backoffs of at least 2 s: a request whose wait is cut short shows it by far.
        let slow = TransportConfig {
            retry: RetryPolicy {
                attempts: 5,
                base: Duration::from_secs(4),
                max: Duration::from_secs(8),
                ..RetryPolicy::default()
            },
            ..TransportConfig::default()
        };
        let t = Transport::new(slow);
        let waiting = t.clone();
        let started = Instant::now();
        let request = std::thread::spawn(move || {
            let r = waiting.send(&Request::get(&url));
            (r.is_err(), started.elapsed())
        });
        // Its first attempt is refused at once; it backs off. Meanwhile two other requests spend
        // their attempts (what a pool of fetchers does when the origin goes; counted here
        // directly): the origin is failing. The 50 ms let it reach its wait first, so the
        // wake-up is what ends it (had the origin been failing before it waited, its wait would
        // have ended at once too).
        while t.stats().requests == 0 {
            std::thread::sleep(Duration::from_millis(1)); // polling, not a fixed wait
        }
        std::thread::sleep(Duration::from_millis(50));
        t.shared.exhausted();
        assert!(!t.is_failing());
        t.shared.exhausted();
        assert!(t.is_failing());
        let (failed, took) = request.join().unwrap();
        assert!(failed);
        assert!(took < Duration::from_millis(1500), "the backing-off request took {took:?}");
        // Two attempts: the first and the last, none in between.
        assert_eq!((t.stats().requests, t.stats().retries), (2, 1));
    }

    #[test]
    fn a_final_answer_or_a_success_between_exhausted_requests_keeps_the_retries() {
        let busy = "HTTP/1.1 503 Busy\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let missing = "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        // Exhausted, a 404 (the origin answers), exhausted: never two in a row.
        let url = serve(vec![busy, busy, busy, missing, busy, busy, busy, busy, busy, busy]);
        let t = Transport::new(quick());
        let judge = |r: Response| match r.status() {
            200 => Ok(()),
            s => Err(if retryable_status(s) {
                Failure::retry(ErrorKind::Status, s)
            } else {
                Failure::fatal(ErrorKind::Status, s)
            }),
        };
        assert!(matches!(t.fetch(&Request::get(&url), judge), Err(FetchError::Rejected(503))));
        assert!(matches!(t.fetch(&Request::get(&url), judge), Err(FetchError::Rejected(404))));
        assert!(matches!(t.fetch(&Request::get(&url), judge), Err(FetchError::Rejected(503))));
        assert!(!t.is_failing(), "a 404 between the exhausted requests: the origin answers");
        assert_eq!(t.stats().requests, 7);
        // The second exhausted request in a row trips it; 0 turns it off.
        assert!(t.fetch(&Request::get(&url), judge).is_err());
        assert!(t.is_failing());
        let mut off = quick();
        off.retry.failing_after = 0;
        let t = Transport::new(off);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/x", l.local_addr().unwrap());
        drop(l);
        for _ in 0..3 {
            assert!(t.send(&Request::get(&url)).is_err());
        }
        assert!(!t.is_failing());
        assert_eq!((t.stats().requests, t.stats().single_attempts), (9, 0));
    }

    /// A server answering each connection from `answers` in turn; `None` accepts, reads the
    /// request and never answers (the connection is kept open until the server ends).
    fn serve_or_stall(answers: Vec<Option<&'static str>>) -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let mut stalled = Vec::new();
            for answer in answers {
                let (mut s, _) = l.accept().unwrap();
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf);
                match answer {
                    Some(a) => drop(s.write_all(a.as_bytes())),
                    None => stalled.push(s),
                }
            }
            std::thread::sleep(Duration::from_secs(30));
        });
        format!("http://{addr}/x")
    }

    const RANGE: [(&str, &str); 1] = [("Range", "bytes=0-1")];

    #[test]
    fn a_late_head_is_sent_again_after_the_usual_latency_without_spending_an_attempt() {
        let ok = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok";
        let mut answers = vec![Some(ok); 8];
        answers.extend([None, None, Some(ok)]);
        let url = serve_or_stall(answers);
        let config = TransportConfig {
            timeouts: Timeouts { first_byte: Duration::from_secs(20), ..TransportConfig::default().timeouts },
            retry: RetryPolicy { attempts: 1, ..RetryPolicy::default() },
            ..TransportConfig::default()
        };
        let t = Transport::new(config);
        let get = || {
            let mut body = String::new();
            let req = Request::get(&url).headers(&RANGE);
            t.send(&req).unwrap().into_reader().read_to_string(&mut body).unwrap();
            body
        };
        for _ in 0..8 {
            assert_eq!(get(), "ok");
        }
        // The ninth read's first two connections never answer: it is sent again after the
        // usual head latency (a loopback server: the 50 ms floor), then after twice that, not
        // after 20 s, and the one attempt allowed is not spent on them.
        let started = Instant::now();
        assert_eq!(get(), "ok");
        let took = started.elapsed();
        assert!(took < Duration::from_secs(2), "{took:?}");
        let s = t.stats();
        assert_eq!((s.requests, s.resends, s.retries, s.errors.total()), (11, 2, 2, 0));

        // Never resent: any request when the setting is off, and a GET without a Range (its
        // latency is not the data path's) when it is on. The stalled request waits out the
        // first-byte timeout and fails (one attempt).
        for (resend_late, ranged) in [(None, true), (Some(Duration::from_millis(50)), false)] {
            let url = serve_or_stall(vec![Some(ok), Some(ok), None]);
            let config = TransportConfig {
                timeouts: Timeouts {
                    first_byte: Duration::from_millis(300),
                    ..TransportConfig::default().timeouts
                },
                retry: RetryPolicy { attempts: 1, resend_late, ..RetryPolicy::default() },
                ..TransportConfig::default()
            };
            let t = Transport::new(config);
            for _ in 0..2 {
                let req = Request::get(&url).headers(&RANGE);
                t.send(&req).unwrap().into_reader().read_to_end(&mut Vec::new()).unwrap();
            }
            let started = Instant::now();
            let req = if ranged { Request::get(&url).headers(&RANGE) } else { Request::get(&url) };
            let e = t.send(&req).unwrap_err();
            assert_eq!(e.kind(), TransportErrorKind::Timeout(TimeoutKind::FirstByte));
            assert!(started.elapsed() >= Duration::from_millis(300));
            let s = t.stats();
            assert_eq!((s.requests, s.resends, s.errors.timeout), (3, 0, 1), "{resend_late:?} {ranged}");
        }
    }

    #[test]
    fn an_error_status_is_retried_at_once_a_busy_server_after_a_pause_a_rate_limit_after_a_backoff() {
        let broken = "HTTP/1.1 500 Broken\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let busy = "HTTP/1.1 503 Busy\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let slow = "HTTP/1.1 429 Slow Down\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let ok = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok";
        let url = serve(vec![broken, ok, slow, ok, busy, ok]);
        let t = Transport::new(TransportConfig::default());
        let timed = || {
            let started = Instant::now();
            let mut body = String::new();
            t.send(&Request::get(&url)).unwrap().into_reader().read_to_string(&mut body).unwrap();
            assert_eq!(body, "ok");
            started.elapsed()
        };
        let after_500 = timed();
        let after_429 = timed();
        let after_503 = timed();
        // The default backoff's first wait is 50–100 ms; a 503 within the budget waits a quarter
        // of it (12.5–25 ms; its upper bound is `retry.rs`'s unit test, free of scheduling).
        assert!(after_500 < Duration::from_millis(50), "{after_500:?}");
        assert!(after_429 >= Duration::from_millis(50), "{after_429:?}");
        assert!(after_503 >= Duration::from_micros(12_500), "{after_503:?}");
    }

    #[test]
    fn a_request_keeps_retrying_while_the_origin_answers_others() {
        // "/ok" always answers; "/flaky" fails its first `fails` requests with a 500.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let flaky = Arc::new(AtomicU64::new(0));
        let seen = Arc::clone(&flaky);
        std::thread::spawn(move || {
            for s in l.incoming() {
                let mut s = s.unwrap();
                let mut buf = [0u8; 4096];
                let n = s.read(&mut buf).unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                let answer = if head.starts_with("GET /flaky") && seen.fetch_add(1, Ordering::Relaxed) < 7 {
                    "HTTP/1.1 500 Broken\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                } else {
                    "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
                };
                let _ = s.write_all(answer.as_bytes());
            }
        });
        let config = TransportConfig {
            retry: RetryPolicy {
                attempts: 5,
                base: Duration::from_millis(20),
                max: Duration::from_millis(20),
                ..RetryPolicy::default()
            },
            ..TransportConfig::default()
        };
        // Alone, /flaky spends its 5 attempts.
        let t = Transport::new(config.clone());
        assert!(t.send(&Request::get(&format!("http://{addr}/flaky"))).unwrap().status() == 500);
        assert_eq!(t.stats().requests, 5);
        // While another thread's requests are answered, the next /flaky request gets up to 10
        // attempts: it fails twice more (7 in all) and then succeeds.
        let t = Transport::new(config);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let other = {
            let (t, stop) = (t.clone(), Arc::clone(&stop));
            let url = format!("http://{addr}/ok");
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    t.send(&Request::get(&url)).unwrap().into_reader().read_to_end(&mut Vec::new()).unwrap();
                    std::thread::sleep(Duration::from_millis(2));
                }
            })
        };
        let r = t.send(&Request::get(&format!("http://{addr}/flaky"))).unwrap();
        stop.store(true, Ordering::Relaxed);
        other.join().unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(flaky.load(Ordering::Relaxed), 8, "5 alone, then 2 failed and 1 answered");
    }

    #[test]
    fn a_streamed_body_holds_its_slot_until_dropped() {
        let url = serve(vec!["HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello"]);
        let t = Transport::new(quick());
        let mut body = t.send(&Request::get(&url)).unwrap().into_reader();
        assert_eq!(t.in_flight(), 1);
        assert_eq!(t.latency_histogram().get_sample_count(), 0, "the attempt is still going");
        let mut s = String::new();
        body.read_to_string(&mut s).unwrap();
        drop(body);
        assert_eq!((s.as_str(), t.in_flight(), t.stats().bytes), ("hello", 0, 5));
        assert_eq!(t.latency_histogram().get_sample_count(), 1);
    }

    /// A keep-alive server answering every request `200` with a 5-byte body (a HEAD after
    /// 100 ms, without it); counts the connections it accepts.
    /// A keep-alive server answering every GET with "hello": its URL, and the connections it
    /// accepted and requests it read so far. With `idle`, it closes a connection on which no
    /// request came within that time.
    fn keep_alive_server(
        idle: Option<Duration>,
    ) -> (String, Arc<std::sync::atomic::AtomicUsize>, Arc<std::sync::atomic::AtomicUsize>) {
        use std::io::BufRead;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let (accepted, requests) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (a, r) = (Arc::clone(&accepted), Arc::clone(&requests));
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(conn) = conn else { return };
                a.fetch_add(1, Ordering::SeqCst);
                let requests = Arc::clone(&r);
                std::thread::spawn(move || {
                    conn.set_read_timeout(idle).unwrap();
                    let mut r = std::io::BufReader::new(conn.try_clone().unwrap());
                    let mut w = conn;
                    loop {
                        let mut first = String::new();
                        if r.read_line(&mut first).unwrap_or(0) == 0 {
                            return; // closed, or idle too long: dropping `w` closes it
                        }
                        requests.fetch_add(1, Ordering::SeqCst);
                        let mut line = String::new();
                        while r.read_line(&mut line).unwrap_or(0) > 2 {
                            line.clear();
                        }
                        if w.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello").is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (format!("http://{addr}/x"), accepted, requests)
    }

    /// Wait (up to 5 s) for `count` to reach `n`.
    fn settle(count: &std::sync::atomic::AtomicUsize, n: usize) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while count.load(std::sync::atomic::Ordering::SeqCst) < n {
            assert!(
                std::time::Instant::now() < deadline,
                "{} of {n}",
                count.load(std::sync::atomic::Ordering::SeqCst)
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn preconnected_connections_carry_the_next_requests_and_send_nothing_before() {
        use std::sync::atomic::Ordering;
        let (url, accepted, requests) = keep_alive_server(None);
        let t = Transport::new(TransportConfig { max_concurrency: 4, ..quick() });
        t.preconnect(&url, 8);
        // (The server counts a connection once its accept loop has run.)
        settle(&accepted, 4);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(accepted.load(Ordering::SeqCst), 4, "at most the pool's size");
        assert_eq!(requests.load(Ordering::SeqCst), 0, "connects only: no request sent");
        assert_eq!(t.stats().requests, 0);
        // Four requests at once take the four connections.
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    let mut resp = t.send(&Request::get(&url)).unwrap();
                    assert_eq!(resp.read_to_vec(100).unwrap().unwrap(), b"hello");
                });
            }
        });
        assert_eq!(accepted.load(Ordering::SeqCst), 4, "no new connection");
        assert_eq!(requests.load(Ordering::SeqCst), 4);
    }

    /// A keep-alive server whose answers name the connection that carried them (`c1`, `c2`, …,
    /// in accept order) after `delay`; a request for `/big` gets 1 MiB.
    fn naming_server(delay: Duration) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        use std::io::BufRead;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let a = Arc::clone(&accepted);
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(conn) = conn else { return };
                let id = a.fetch_add(1, Ordering::SeqCst) + 1;
                std::thread::spawn(move || {
                    let mut r = std::io::BufReader::new(conn.try_clone().unwrap());
                    let mut w = conn;
                    loop {
                        let mut first = String::new();
                        if r.read_line(&mut first).unwrap_or(0) == 0 {
                            return;
                        }
                        let mut line = String::new();
                        while r.read_line(&mut line).unwrap_or(0) > 2 {
                            line.clear();
                        }
                        std::thread::sleep(delay);
                        let body = if first.contains("/big") {
                            vec![b'x'; 1 << 20]
                        } else {
                            format!("c{id}").into_bytes()
                        };
                        let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
                        if w.write_all(head.as_bytes()).and_then(|()| w.write_all(&body)).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (format!("http://{addr}"), accepted)
    }

    /// After a burst on several connections, requests one after another all go on the
    /// connection that came back last (its TCP window is the warmest), not round the burst's.
    #[test]
    fn serial_requests_after_a_burst_reuse_the_connection_that_came_back_last() {
        use std::sync::atomic::Ordering;
        let (base, accepted) = naming_server(Duration::from_millis(30));
        let t = Transport::new(TransportConfig { max_concurrency: 8, ..quick() });
        let get = |t: &Transport| {
            let mut resp = t.send(&Request::get(&format!("{base}/x"))).unwrap();
            String::from_utf8(resp.read_to_vec(100).unwrap().unwrap()).unwrap()
        };
        let burst: Vec<String> = std::thread::scope(|s| {
            let w: Vec<_> = (0..4).map(|_| s.spawn(|| get(&t))).collect();
            w.into_iter().map(|w| w.join().unwrap()).collect()
        });
        assert_eq!(accepted.load(Ordering::SeqCst), 4, "the burst: {burst:?}");
        let serial: Vec<String> = (0..6).map(|_| get(&t)).collect();
        assert_eq!(accepted.load(Ordering::SeqCst), 4, "no new connection");
        assert!(serial.iter().all(|c| *c == serial[0]), "one connection, not round the burst's: {serial:?}");
    }

    /// A connection whose answer was dropped unread is closed, not kept for the next request
    /// (which would read the rest of that answer as its own).
    #[test]
    fn a_connection_with_its_answer_unread_is_not_reused() {
        use std::sync::atomic::Ordering;
        let (base, accepted) = naming_server(Duration::ZERO);
        let t = Transport::new(TransportConfig { max_concurrency: 4, ..quick() });
        let mut first = t.send(&Request::get(&format!("{base}/x"))).unwrap();
        assert_eq!(first.read_to_vec(100).unwrap().unwrap(), b"c1");
        drop(first);
        let mut big = t.send(&Request::get(&format!("{base}/big"))).unwrap();
        let mut some = [0u8; 10];
        std::io::Read::read_exact(big.reader(), &mut some).unwrap();
        drop(big);
        let mut next = t.send(&Request::get(&format!("{base}/x"))).unwrap();
        assert_eq!(next.read_to_vec(100).unwrap().unwrap(), b"c2", "a new connection");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_preconnected_connection_the_server_closed_is_not_used() {
        use std::sync::atomic::Ordering;
        let (url, accepted, requests) = keep_alive_server(Some(Duration::from_millis(50)));
        let t = Transport::new(TransportConfig { max_concurrency: 4, ..quick() });
        t.preconnect(&url, 2);
        settle(&accepted, 2);
        std::thread::sleep(Duration::from_millis(300));
        // Both stashed connections were closed by the server: the request opens a third (a
        // request sent on a closed one would fail or be retried, and count twice).
        let mut resp = t.send(&Request::get(&url)).unwrap();
        assert_eq!(resp.read_to_vec(100).unwrap().unwrap(), b"hello");
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
        assert_eq!((requests.load(Ordering::SeqCst), t.stats().requests), (1, 1));
    }
}
