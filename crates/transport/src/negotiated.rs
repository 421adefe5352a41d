//! The HTTP/2-capable client: reqwest (hyper, h2) on a small tokio runtime that the transport
//! owns, offering `h2` and `http/1.1` through ALPN on `https://` origins
//! ([`crate::HttpVersion::Negotiate`]). One connection per origin then carries every request
//! in flight as a stream of its own, so concurrency costs no connects or handshakes.
//!
//! The callers are plain threads: each request is driven with [`Handle::block_on`] until its
//! response head, and its body is read chunk by chunk the same way. Timeouts are mapped onto
//! the transport's classification: connect (reqwest's connect timeout), first byte (the head
//! awaited under a deadline), stall (each chunk awaited under a deadline) and whole (reqwest's
//! request timeout).
//!
//! TLS is rustls with the ring provider, the same stack ureq uses, configured here from
//! [`crate::TlsOptions`]: the given CA certificates or the built-in public roots, or no
//! verification at all.

use std::collections::HashMap;
use std::io::{self, Read};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio::runtime::{Handle, Runtime};
use tracing::debug;

use crate::config::TransportConfig;
use crate::error::{TimeoutKind, TransportError, TransportErrorKind};
use crate::{Method, Request};

/// Worker threads of the runtime: they run the connections' I/O and the h2 framing, one core
/// of work at most for the rates an origin link carries.
const WORKERS: usize = 2;

/// The client, with and without certificate verification, and the runtime driving both.
pub(crate) struct Negotiated {
    verified: reqwest::Client,
    unverified: reqwest::Client,
    stall: Duration,
    first_byte: Duration,
    whole: Option<Duration>,
    /// What the origin was found to speak; see [`Negotiated::gate`].
    /// Per host (`scheme://authority`): a registry client's transport also reaches its token
    /// realm and the blob store its redirects name.
    learned: Mutex<HashMap<String, Learned>>,
    learned_cv: Condvar,
    // Dropped last: the clients' connections live on it.
    runtime: Runtime,
}

/// An answer's head and its body.
pub(crate) struct Answer {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Body,
}

/// A response body read from a blocking caller.
pub(crate) struct Body {
    response: reqwest::Response,
    handle: Handle,
    stall: Duration,
    /// The part of the last chunk not yet read.
    pending: Bytes,
    done: bool,
}

impl Negotiated {
    /// The client of `config`.
    pub(crate) fn new(config: &TransportConfig) -> io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(WORKERS)
            .thread_name("tessera-http2")
            .enable_all()
            .build()?;
        let client = |verify: bool| {
            let t = &config.timeouts;
            let builder = reqwest::Client::builder()
                .tls_backend_preconfigured(tls_config(config, verify))
                .connect_timeout(t.connect)
                .pool_max_idle_per_host(config.max_concurrency.max(1))
                .user_agent(concat!("tessera/", env!("CARGO_PKG_VERSION")));
            builder.build().map_err(io::Error::other)
        };
        Ok(Self {
            verified: client(!config.tls.skip_verify)?,
            unverified: client(false)?,
            stall: config.timeouts.stall,
            first_byte: config.timeouts.first_byte,
            whole: config.timeouts.whole,
            learned: Mutex::new(HashMap::new()),
            learned_cv: Condvar::new(),
            runtime,
        })
    }

    /// Send `req`; wait for the response head at most `head_deadline` (default: the first-byte
    /// timeout).
    pub(crate) fn send(
        &self,
        req: &Request<'_>,
        head_deadline: Option<Duration>,
    ) -> Result<Answer, TransportError> {
        let client = if req.skip_tls_verify { &self.unverified } else { &self.verified };
        let method = match req.method {
            Method::Get => reqwest::Method::GET,
            Method::Head => reqwest::Method::HEAD,
            Method::Post => reqwest::Method::POST,
            Method::Put => reqwest::Method::PUT,
            Method::Patch => reqwest::Method::PATCH,
            Method::Delete => reqwest::Method::DELETE,
        };
        let mut rb = client.request(method, req.url);
        for (k, v) in req.headers {
            rb = rb.header(*k, *v);
        }
        if matches!(req.method, Method::Post | Method::Put | Method::Patch) {
            rb = rb.body(req.body.to_vec());
        }
        if let Some(whole) = self.whole {
            rb = rb.timeout(whole);
        }
        let deadline = head_deadline.unwrap_or(self.first_byte);
        let handle = self.runtime.handle();
        let host = host_of(req.url);
        let probing = self.gate(host);
        let response = handle.block_on(async { tokio::time::timeout(deadline, rb.send()).await });
        let version = match &response {
            Ok(Ok(r)) => Some(r.version()),
            _ => None,
        };
        if probing {
            self.learn(host, req.url, version);
        } else if let Some(l) = self.learned.lock().unwrap_or_else(|p| p.into_inner()).get_mut(host) {
            l.last_used = Instant::now();
        }
        let response = match response {
            Err(_) => return Err(timeout(TimeoutKind::FirstByte)),
            Ok(Err(e)) => return Err(TransportError::from_reqwest(e)),
            Ok(Ok(r)) => r,
        };
        Ok(Answer {
            status: response.status().as_u16(),
            headers: response.headers().clone(),
            body: Body {
                response,
                handle: handle.clone(),
                stall: self.stall,
                pending: Bytes::new(),
                done: false,
            },
        })
    }
}

/// What the origin speaks, as far as the client knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Version {
    /// Nothing known: no connection may be open.
    Unknown,
    /// A request is finding out; the others wait for it.
    Probing,
    /// The origin answered over HTTP/2: one connection carries every request.
    Http2,
    /// The origin answered over HTTP/1.x: a connection per request in flight, as usual.
    Http1,
}

/// [`Version`] and when a request last went out: an HTTP/2 connection idle for
/// [`FORGET_AFTER`] may have been closed by the server, so the version is found out again.
#[derive(Debug, Clone, Copy)]
struct Learned {
    version: Version,
    last_used: Instant,
}

/// Idle time after which an open connection is not counted on (nginx closes idle keep-alive
/// connections after 75 s by default, reqwest its own after 90 s).
const FORGET_AFTER: Duration = Duration::from_secs(30);

impl Negotiated {
    /// Wait, if another request is finding out what the origin speaks; return whether this
    /// request is to find out. Without this gate, the requests of a cold burst would each open
    /// a connection and a TLS session (the client learns that the origin speaks HTTP/2 only
    /// when a handshake ends), and all but one would be thrown away: a burst of 256 reads
    /// opened 250 connections. Browsers wait for a pending connection's ALPN the same way. The
    /// cost is one round trip for the waiters of the first burst, and none for an HTTP/1.1
    /// origin after its first answer.
    fn gate(&self, host: &str) -> bool {
        let mut hosts = self.learned.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let l = hosts
                .entry(host.to_owned())
                .or_insert(Learned { version: Version::Unknown, last_used: Instant::now() });
            match l.version {
                Version::Probing => {
                    hosts = self.learned_cv.wait(hosts).unwrap_or_else(|p| p.into_inner());
                }
                Version::Unknown => {
                    l.version = Version::Probing;
                    return true;
                }
                Version::Http2 if l.last_used.elapsed() > FORGET_AFTER => {
                    l.version = Version::Probing;
                    return true;
                }
                Version::Http2 | Version::Http1 => return false,
            }
        }
    }

    /// The probing request of [`Self::gate`] to `host` got `version` (`None`: it failed, and
    /// the next request finds out instead); wake the waiters.
    fn learn(&self, host: &str, url: &str, version: Option<reqwest::Version>) {
        let found = match version {
            None => Version::Unknown,
            Some(reqwest::Version::HTTP_2) => Version::Http2,
            Some(_) => Version::Http1,
        };
        if found != Version::Unknown {
            debug!(url, version = ?found, "the origin's HTTP version");
        }
        let learned = Learned { version: found, last_used: Instant::now() };
        self.learned.lock().unwrap_or_else(|p| p.into_inner()).insert(host.to_owned(), learned);
        self.learned_cv.notify_all();
    }
}

/// `scheme://authority` of `url` (the whole URL when it has no path).
fn host_of(url: &str) -> &str {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    match url[after_scheme..].find(['/', '?', '#']) {
        Some(end) => &url[..after_scheme + end],
        None => url,
    }
}

fn timeout(kind: TimeoutKind) -> TransportError {
    TransportError::new(TransportErrorKind::Timeout(kind), io::Error::from(io::ErrorKind::TimedOut))
}

impl Read for Body {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.pending.is_empty() && !self.done {
            let (response, stall) = (&mut self.response, self.stall);
            let next = self.handle.block_on(async { tokio::time::timeout(stall, response.chunk()).await });
            match next {
                Err(_) => return Err(io::Error::other(timeout(TimeoutKind::Stall))),
                Ok(Err(e)) => return Err(io::Error::other(TransportError::from_reqwest(e))),
                Ok(Ok(Some(chunk))) => self.pending = chunk,
                Ok(Ok(None)) => self.done = true,
            }
        }
        let n = buf.len().min(self.pending.len());
        buf[..n].copy_from_slice(&self.pending.split_to(n));
        Ok(n)
    }
}

/// The rustls configuration of `config`: its CA certificates or the built-in public roots
/// (`verify`), or none; ALPN offers HTTP/2 first.
fn tls_config(config: &TransportConfig, verify: bool) -> rustls::ClientConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .unwrap_or_else(|_| unreachable!("ring supports the default protocol versions"));
    let mut tls = if verify {
        let mut roots = rustls::RootCertStore::empty();
        if config.tls.ca_certs.is_empty() {
            roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        } else {
            for der in config.tls.ca_certs.iter() {
                // A certificate rustls cannot use was checked as PEM only: skip it, as a
                // store of roots would (verification then fails, naming the issuer).
                let _ = roots.add(CertificateDer::from(der.clone()));
            }
        }
        builder.with_root_certificates(roots).with_no_client_auth()
    } else {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
            .with_no_client_auth()
    };
    tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    tls
}

/// Accepts any server certificate (`--insecure`, loopback registries); handshake signatures
/// are still checked, so the session is at least with the holder of the certificate shown.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_told_apart_by_scheme_and_authority() {
        assert_eq!(host_of("https://reg.example:5000/v2/a/blobs/x"), "https://reg.example:5000");
        assert_eq!(host_of("https://cdn.example?x=1"), "https://cdn.example");
        assert_eq!(host_of("https://auth.example"), "https://auth.example");
        assert_ne!(host_of("https://a.example/x"), host_of("https://b.example/x"));
    }
}
