//! Connections opened ahead of need ([`crate::Transport::preconnect`]).
//!
//! ureq opens a connection when a request finds none idle in its pool, and offers no way to put
//! one there without a request. So an agent's connector is [`Stashing`]: ureq's usual chain (a
//! CONNECT proxy from the environment, TCP, rustls) behind a [`Stash`] of connections that chain
//! made earlier, on [`open`]'s threads — TCP connected and, for `https://`, the TLS handshake
//! done. A request that needs a new connection to that scheme, host and port takes one from the
//! stash if one is there and still open, else the chain makes one as before. Nothing is sent on
//! a stashed connection until a request takes it, so an origin sees connects and handshakes
//! only (the `HEAD` of the base URL per connection that this replaced was logged as a 403 by
//! origins that refuse it, and counted as requests).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ureq::config::Config;
use ureq::http::Uri;
use ureq::unversioned::resolver::{DefaultResolver, Resolver};
use ureq::unversioned::transport::{time, ConnectionDetails, Connector, Either, NextTimeout, Transport};
use ureq::{Error, Timeout};

/// A stashed connection older than this is closed instead of used: servers close connections
/// that send no request for a while (nginx after `client_header_timeout`, 60 s by default).
pub(crate) const MAX_AGE: Duration = Duration::from_secs(10);

/// Where a connection goes: scheme, host and port, as a request's URI names them.
fn key_of(uri: &Uri) -> Option<String> {
    let scheme = uri.scheme_str()?;
    let port = uri.port_u16().unwrap_or(if scheme == "https" { 443 } else { 80 });
    Some(format!("{scheme}://{}:{port}", uri.host()?))
}

/// A connection waiting: where it goes ([`key_of`]), and since when.
type Waiting = (String, Box<dyn Transport>, Instant);

/// Connections made ahead of need, waiting for a request.
#[derive(Debug, Default)]
pub(crate) struct Stash {
    connections: Mutex<Vec<Waiting>>,
}

impl Stash {
    /// Connections waiting.
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    /// Close the connections older than [`MAX_AGE`].
    pub(crate) fn expire(&self) {
        self.lock().retain(|(_, _, at)| at.elapsed() < MAX_AGE);
    }

    /// An open connection for `key`, if any: those too old or closed by the server are dropped
    /// on the way.
    fn take(&self, key: &str) -> Option<Box<dyn Transport>> {
        let mut connections = self.lock();
        connections.retain(|(_, _, at)| at.elapsed() < MAX_AGE);
        while let Some(i) = connections.iter().position(|(k, _, _)| k == key) {
            let (_, mut connection, _) = connections.swap_remove(i);
            let open = if connection.is_tls() { tls_open(&mut connection) } else { connection.is_open() };
            if open {
                return Some(connection);
            }
        }
        None
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Waiting>> {
        self.connections.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Whether a stashed TLS connection is open. A TLS 1.3 server sends session tickets after the
/// handshake, which nothing has read on a connection that carried no request yet; ureq's check
/// of an idle connection (`is_open`: a one-byte read of the socket) would take them for garbage
/// from the server — and, reading that byte, break the TLS stream. So the TLS layer reads first
/// (a short wait for input, which takes the tickets and finds no application data), then the
/// socket is checked.
fn tls_open(connection: &mut Box<dyn Transport>) -> bool {
    let short = NextTimeout {
        after: Duration::from_millis(1).into(),
        reason: Timeout::RecvResponse,
        per_read: None,
        per_write: None,
    };
    // Application data nobody asked for (`Ok(true)`), the server's close (`Ok(false)`) or a
    // TLS alert: not a connection to send a request on. Only a wait that ran out qualifies.
    matches!(connection.await_input(short), Err(Error::Timeout(_)))
        && connection.buffers().input().is_empty()
        && connection.is_open()
}

/// A connector chain making boxed connections.
pub(crate) type Chain = dyn Connector<(), Out = Box<dyn Transport>>;

/// `C` with its connections boxed, to be a [`Chain`].
#[derive(Debug)]
pub(crate) struct Boxing<C>(pub(crate) C);

impl<C: Connector> Connector for Boxing<C> {
    type Out = Box<dyn Transport>;

    fn connect(&self, details: &ConnectionDetails, chained: Option<()>) -> Result<Option<Self::Out>, Error> {
        Ok(self.0.connect(details, chained)?.map(Transport::boxed))
    }
}

/// An agent's connector: a stashed connection if one is waiting, else the chain's (module doc).
#[derive(Debug)]
pub(crate) struct Stashing {
    pub(crate) stash: Arc<Stash>,
    pub(crate) chain: Arc<Chain>,
}

impl Connector for Stashing {
    type Out = Either<Box<dyn Transport>, Box<dyn Transport>>;

    fn connect(&self, details: &ConnectionDetails, chained: Option<()>) -> Result<Option<Self::Out>, Error> {
        if let Some(connection) = key_of(details.uri).and_then(|k| self.stash.take(&k)) {
            return Ok(Some(Either::A(connection)));
        }
        Ok(self.chain.connect(details, chained)?.map(Either::B))
    }
}

/// Make up to `n` connections to the host of `url` at once through `chain`, with `config`
/// (each within `timeout`, TLS included), and stash those made. Returns when all are made or
/// failed; a failure is the first request's to report.
pub(crate) fn open(stash: &Stash, chain: &Chain, config: &Config, url: &str, n: usize, timeout: Duration) {
    let Ok(uri) = url.parse::<Uri>() else { return };
    let Some(key) = key_of(&uri) else { return };
    let next =
        NextTimeout { after: timeout.into(), reason: Timeout::Connect, per_read: None, per_write: None };
    let Ok(addrs) = DefaultResolver::default().resolve(&uri, config, next) else { return };
    let resolver = DefaultResolver::default();
    std::thread::scope(|s| {
        for _ in 0..n {
            s.spawn(|| {
                let details = ConnectionDetails {
                    uri: &uri,
                    addrs: addrs.clone(),
                    config,
                    request_level: false,
                    resolver: &resolver,
                    now: time::Instant::now(),
                    timeout: next,
                    current_time: Arc::new(time::Instant::now),
                    // Only a CONNECT proxy runs the chain again; none is used here.
                    run_connector: Arc::new(|_: &ConnectionDetails| {
                        Err(Error::Io(std::io::Error::other("no proxy when preconnecting")))
                    }),
                    // Nothing here calls `Agent::shutdown`.
                    register_shutdown: Arc::new(|_| Ok(())),
                };
                if let Ok(Some(connection)) = chain.connect(&details, None) {
                    stash.lock().push((key.clone(), connection, Instant::now()));
                }
            });
        }
    });
}
