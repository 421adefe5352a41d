//! The connections of an agent that wait for a request: opened ahead of need
//! ([`crate::Transport::preconnect`]) and idle between requests (the pool).
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
//!
//! The stash is the agent's pool too. ureq's own pool (kept empty) hands out the idle connection
//! that has waited longest, so after a burst of parallel requests (a start's pieces, a
//! prefetch) serial requests go round every connection of the burst; each has then idled long
//! enough for TCP to restart its slow start (after one retransmission timeout idle, Linux
//! halves the window per timeout), and a cold read crosses several round trips of small
//! windows where one warm connection would carry it in one. A connection ureq would pool
//! ([`Pooled`]) goes back to the stash instead, and a request takes the one that came back last.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ureq::config::Config;
use ureq::http::Uri;
use ureq::unversioned::resolver::{DefaultResolver, Resolver};
use ureq::unversioned::transport::{time, Buffers, ConnectionDetails, Connector, NextTimeout, Transport};
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

/// A connection waiting for a request.
#[derive(Debug)]
struct Waiting {
    /// Where it goes ([`key_of`]).
    key: String,
    connection: Box<dyn Transport>,
    /// Since when it waits.
    since: Instant,
    /// It carried a request and its answer (else it was made ahead of need).
    used: bool,
}

/// Connections waiting for a request: made ahead of need, or idle after one.
#[derive(Debug)]
pub(crate) struct Stash {
    connections: Mutex<Vec<Waiting>>,
    /// The most kept; beyond, those waiting longest are closed.
    most: usize,
}

impl Stash {
    /// A stash keeping at most `most` connections.
    pub(crate) fn new(most: usize) -> Self {
        Self { connections: Mutex::new(Vec::new()), most }
    }

    /// Connections waiting.
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    /// Close the connections waiting longer than [`MAX_AGE`].
    pub(crate) fn expire(&self) {
        let old = Self::take_old(&mut self.lock());
        drop(old);
    }

    /// The connections of `connections` waiting longer than [`MAX_AGE`], taken out: to be
    /// dropped (closed) once the lock is released, as everything that leaves the stash unused.
    fn take_old(connections: &mut Vec<Waiting>) -> Vec<Waiting> {
        let (old, young) =
            std::mem::take(connections).into_iter().partition(|w| w.since.elapsed() >= MAX_AGE);
        *connections = young;
        old
    }

    /// An open connection for `key`, if any — the one that came back last (module doc): those
    /// too old or closed by the server are dropped on the way.
    fn take(&self, key: &str) -> Option<Box<dyn Transport>> {
        loop {
            // Checked out of the lock: the check of a TLS connection waits a moment.
            let (Waiting { mut connection, used, .. }, old) = {
                let mut connections = self.lock();
                let old = Self::take_old(&mut connections);
                let i = connections.iter().rposition(|w| w.key == key)?;
                (connections.remove(i), old)
            };
            drop(old);
            // A TLS connection that carried an answer has read the server's session tickets.
            let open =
                if connection.is_tls() && !used { tls_open(&mut connection) } else { connection.is_open() };
            if open {
                return Some(connection);
            }
        }
    }

    /// Keep `connection` to `key`, waiting for a request; `used`: it carried one.
    fn put(&self, key: String, connection: Box<dyn Transport>, used: bool) {
        let (old, over) = {
            let mut connections = self.lock();
            let old = Self::take_old(&mut connections);
            connections.push(Waiting { key, connection, since: Instant::now(), used });
            let over = connections.len().saturating_sub(self.most);
            (old, connections.drain(..over).collect::<Vec<_>>())
        };
        drop((old, over));
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

/// An agent's connector: a stashed connection if one is waiting, else the chain's (module doc);
/// either way one that goes back to the stash when ureq would pool it.
#[derive(Debug)]
pub(crate) struct Stashing {
    pub(crate) stash: Arc<Stash>,
    pub(crate) chain: Arc<Chain>,
    /// Whether connections come from and go back to the stash: not through a proxy, whose
    /// connector opens its hop to the proxy through this one too (that hop must not be pooled
    /// as a connection to the proxy), and whose connections ureq's pool keeps instead.
    pub(crate) pool: bool,
}

impl Connector for Stashing {
    type Out = Pooled;

    fn connect(&self, details: &ConnectionDetails, chained: Option<()>) -> Result<Option<Self::Out>, Error> {
        let key = key_of(details.uri).filter(|_| self.pool);
        let connection = match key.as_deref().and_then(|k| self.stash.take(k)) {
            Some(connection) => Some(connection),
            None => self.chain.connect(details, chained)?,
        };
        Ok(connection.map(|c| Pooled {
            connection: Some(c),
            key,
            stash: Arc::clone(&self.stash),
            offered: false,
        }))
    }
}

/// A connection in ureq's hands. ureq offers a connection to its pool after an answer read to
/// the end (`Connection::reuse`: nothing unread in its buffer, then `is_open`), and with its pool
/// kept empty drops it right there; a connection whose last call was that `is_open`, answered
/// yes, goes back to the stash when dropped. One dropped after a failure or with its answer
/// unread is closed, as ureq would close it.
#[derive(Debug)]
pub(crate) struct Pooled {
    connection: Option<Box<dyn Transport>>,
    key: Option<String>,
    stash: Arc<Stash>,
    /// The last call was `is_open`, answered yes.
    offered: bool,
}

impl Pooled {
    fn inner(&mut self) -> &mut Box<dyn Transport> {
        self.offered = false;
        // Only `Drop` takes the connection out.
        self.connection.as_mut().expect("a pooled connection is held until dropped")
    }
}

impl Transport for Pooled {
    fn buffers(&mut self) -> &mut dyn Buffers {
        // Looking at the buffers is no use of the connection: ureq checks that nothing is left
        // unread in them before it asks `is_open`.
        self.connection.as_mut().expect("a pooled connection is held until dropped").buffers()
    }

    fn transmit_output(&mut self, amount: usize, timeout: NextTimeout) -> Result<(), Error> {
        self.inner().transmit_output(amount, timeout)
    }

    fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, Error> {
        self.inner().await_input(timeout)
    }

    fn is_open(&mut self) -> bool {
        let open = self.inner().is_open();
        self.offered = open;
        open
    }

    fn is_tls(&self) -> bool {
        self.connection.as_ref().is_some_and(|c| c.is_tls())
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let (true, Some(key), Some(connection)) = (self.offered, self.key.take(), self.connection.take()) {
            self.stash.put(key, connection, true);
        }
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
                    stash.put(key.clone(), connection, false);
                }
            });
        }
    });
}
