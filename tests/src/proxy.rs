//! The network model of the tests: a proxy on loopback in front of a real origin (nginx) that
//! adds round-trip time and a shared bandwidth limit, and counts what crosses it. This kernel has
//! no netem, so this proxy *is* the WAN: it must charge what a real network charges, or
//! concurrency results flatter the design (brief §6). It has two modes.
//!
//! # HTTP mode ([`Proxy::start`])
//!
//! Parses HTTP/1.1, so it can charge per request, log requests and inject faults; TLS and
//! HTTP/2 cannot pass it. Costs charged, with `rtt` the configured round-trip time:
//! - **a new connection**: nothing from the client is read for one `rtt` after `accept` (the TCP
//!   handshake; the client's `connect` returns at once on loopback, so its first bytes wait);
//! - **every request**: the response starts no earlier than one `rtt` after the request head
//!   was received (half a round trip each way). A fresh connection's first response therefore
//!   starts 2·`rtt` after `accept`, a reused connection's 1·`rtt` after the request;
//! - **bandwidth** (optional): every byte sent to clients (heads and bodies, all connections
//!   together) passes one shared link of the configured bytes per second;
//! - **slow start** (optional, [`ProxyConfig::slow_start`]): each client connection's responses
//!   pass the same congestion window as in TCP mode (below): a fresh connection, or one idle for
//!   over an RTO, sends a large answer in flights a round trip apart, from 10 segments up.
//!
//! Requests on one connection are answered in order (keep-alive works; pipelining is not
//! modelled). Each client connection gets its own upstream connection, reopened if the origin
//! closes it between requests. Response bodies must be delimited by `Content-Length` (nginx's
//! static files, ranges and error pages are).
//!
//! Faults ([`Fault`]) are injected per request: [`Proxy::inject`] adds a rule "the next `count`
//! requests whose path contains `pattern` get `fault`"; rules are consumed in the order added.
//! [`Proxy::storm`] adds a standing rule instead: a share of the matching requests (drawn by a
//! seeded generator) get one of several faults, until [`Proxy::clear_faults`].
//!
//! # TCP mode ([`Proxy::start_tcp`])
//!
//! A byte-level delay line: whatever runs over TCP passes unchanged (TLS, HTTP/2, …), and pays
//! what a WAN path pays, round trip by round trip:
//! - **a new connection**: client bytes are forwarded no earlier than one `rtt` after `accept`
//!   (the handshake), and upstream bytes are delivered no earlier than 2·`rtt` after it (the
//!   server's side of the handshake ends half a round trip later). The upstream connection is
//!   opened at `accept`;
//! - **every byte** takes half an `rtt` each way: read from one side at `t`, it is written to
//!   the other at `t + rtt/2` — plus, server→client only, its time on the shared link when a
//!   bandwidth is set. Each direction is a reader thread stamping chunks and a writer thread
//!   sleeping until each stamp, joined by an unbounded queue, so order is kept and a slow
//!   writer never holds up the stamping. A request/response exchange thus costs one `rtt`, a
//!   TLS 1.3 handshake one more, and HTTP/2 streams multiplexed on one connection share their
//!   round trips, as on a real path;
//! - **slow start** ([`ProxyConfig::slow_start`], off by default): each connection's
//!   server→client direction has a congestion window, initially 10 segments of 1448 bytes
//!   (Linux's initial window on a 1500-byte MTU). Bytes leave in flights of at most one window;
//!   a full flight is followed by the next one round trip after its first byte left, with the
//!   window doubled (every acknowledged byte grows it by one; no cap but the shared link). A
//!   flight that used more than half the window grows it by its size when its round trip is
//!   over; a smaller one leaves it as it is (Linux grows the window only when it limits the
//!   sender). After an idle time over one RTO — `rtt` + 200 ms, Linux's RTO on a steady path
//!   — the window halves per RTO idle, down to the initial window (Linux's
//!   `tcp_slow_start_after_idle=1`);
//! - **half-close and close** propagate: one side's EOF becomes a `shutdown(Write)` of the
//!   other, half an `rtt` later and after the bytes queued before it; a read or write error
//!   closes both connections at once.
//!
//! Not modelled: loss and retransmission (so no congestion avoidance, `ssthresh` or HyStart:
//! slow start never ends), ACK clocking within a flight (a flight leaves at the link's rate at
//! once), delayed ACKs, receive windows (a client that reads slowly is not a network limit
//! here), and slow start of client→server bytes (requests are small). Counted: connections and
//! [`ProxyStats::wire_bytes`]; requests, faults and the log stay empty, and
//! [`Proxy::inject`] and [`Proxy::storm`] have no effect.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use std::time::Duration;
//! use tessera_e2e::proxy::{Fault, Proxy, ProxyConfig};
//! let origin = tessera_e2e::nginx::Nginx::serve("/tmp/store".as_ref(), "store")?;
//! let cfg =
//!     ProxyConfig { rtt: Duration::from_millis(20), bandwidth: Some(25_000_000), ..Default::default() };
//! let proxy = Proxy::start(origin.addr(), cfg)?;
//! proxy.inject("/blobs/", Fault::Status(503), 3);
//! let url = proxy.url("store"); // http://127.0.0.1:PORT/store
//! // ... run tessera against `url`, then:
//! assert!(proxy.stats().connections < 32);
//! // TLS and HTTP/2 through the TCP mode, with slow start:
//! let wan = Proxy::start_tcp(origin.addr(), ProxyConfig { slow_start: true, ..cfg })?;
//! let url = wan.https_url("store"); // https://127.0.0.1:PORT/store (given a TLS origin)
//! # Ok(()) }
//! ```

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// Largest request or response head accepted.
const MAX_HEAD: usize = 64 << 10;
/// Bytes sent to a client per write (and per bandwidth reservation).
const PIECE: usize = 16 << 10;
/// Late wake-ups up to this long are not counted as idle link time.
const LINK_TOLERANCE: Duration = Duration::from_millis(5);
/// TCP mode: the most bytes one read of a delay line takes.
const CHUNK: usize = 64 << 10;
/// Slow start: the initial congestion window, 10 segments (RFC 6928, Linux's default) of 1448
/// bytes (a 1500-byte MTU less the IP and TCP headers and the timestamp option).
const INITIAL_WINDOW: usize = 10 * 1448;
/// Slow start: what Linux adds to the smoothed RTT to get its retransmission timeout on a steady
/// path (the RTT variance term never goes below `TCP_RTO_MIN`, 200 ms).
const RTO_MIN: Duration = Duration::from_millis(200);

/// The network the proxy models.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProxyConfig {
    /// Round-trip time: charged once per new connection and once per request (HTTP mode), or
    /// for the handshake and half each way for every byte (TCP mode).
    pub rtt: Duration,
    /// Bytes per second of the link shared by all connections, server→client (`None`:
    /// unlimited).
    pub bandwidth: Option<u64>,
    /// A congestion window in slow start limits each connection's server→client bytes (see the
    /// module doc), in both modes.
    pub slow_start: bool,
}

impl ProxyConfig {
    /// Only latency: `rtt` per connection and per request, unlimited bandwidth, no slow start.
    pub fn rtt(rtt: Duration) -> Self {
        Self { rtt, ..Self::default() }
    }
}

/// What happens to one request's response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Answer this status (empty body, keep-alive) instead of forwarding the request.
    Status(u16),
    /// Answer this status with this XML body (an S3 error document: `SlowDown`,
    /// `RequestTimeTooSkewed`, `ExpiredToken`, …) instead of forwarding the request.
    Answer {
        /// The status code.
        status: u16,
        /// The body, sent as `application/xml`.
        body: &'static str,
    },
    /// Send the head and `after` bytes of the body, then reset the connection (RST).
    Reset {
        /// Body bytes delivered before the reset.
        after: u64,
    },
    /// Send the head and `after` bytes of the body, then close the connection cleanly (FIN):
    /// the body is shorter than its `Content-Length`.
    Truncate {
        /// Body bytes delivered before the close.
        after: u64,
    },
    /// Never answer: hold the connection open, silent, until the client gives up.
    Stall,
    /// Forward the response with one bit flipped in the body byte at `at` (the last byte if the
    /// body is shorter).
    Corrupt {
        /// Body offset of the flipped byte.
        at: u64,
    },
}

/// One request as the proxy saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoggedRequest {
    /// `GET`, `HEAD`, …
    pub method: String,
    /// The request target (path and query).
    pub path: String,
    /// The `Range` header, if any.
    pub range: Option<String>,
    /// The fault applied, if any.
    pub fault: Option<Fault>,
    /// When its head was received.
    pub at: Instant,
    /// The client connection it came on (1 for the first accepted, and so on).
    pub connection: u64,
    /// Whether it was the connection's first request (it paid the connect round trip).
    pub fresh: bool,
    /// Body bytes handed to the client for it.
    pub body_bytes: u64,
    /// When its last byte was handed to the client (`None`: not finished, or failed).
    pub done: Option<Instant>,
}

/// Counters of a [`Proxy`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProxyStats {
    /// Client connections accepted.
    pub connections: u64,
    /// Request heads received.
    pub requests: u64,
    /// Response body bytes handed to client connections (after faults).
    pub body_bytes: u64,
    /// Faults applied.
    pub faults: u64,
    /// Every byte handed to client connections: heads and bodies in HTTP mode, the whole
    /// server→client stream (TLS records and all) in TCP mode.
    pub wire_bytes: u64,
}

struct Rule {
    pattern: String,
    fault: Fault,
    left: usize,
}

/// A standing fault rule: `percent` % of the requests matching `pattern` get one of `faults`.
struct Storm {
    pattern: String,
    percent: u64,
    faults: Vec<Fault>,
    rng: crate::prng::Prng,
}

/// What a proxy understands of the bytes it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// HTTP/1.1, parsed: charges per request, faults, the log.
    Http,
    /// Bytes: a delay line per direction.
    Tcp,
}

struct Shared {
    mode: Mode,
    storm: Mutex<Option<Storm>>,
    upstream: SocketAddr,
    config: ProxyConfig,
    stop: AtomicBool,
    connections: AtomicU64,
    requests: AtomicU64,
    body_bytes: AtomicU64,
    wire_bytes: AtomicU64,
    faults: AtomicU64,
    rules: Mutex<Vec<Rule>>,
    log: Mutex<Vec<LoggedRequest>>,
    /// When the shared link is free again (bandwidth model).
    link_free: Mutex<Instant>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// Log entry `logged` was answered in full: `bytes` of body, its last byte handed over now.
    fn finished(&self, logged: usize, bytes: u64) {
        if let Some(r) = lock(&self.log).get_mut(logged) {
            r.body_bytes = bytes;
            r.done = Some(Instant::now());
        }
    }

    fn take_fault(&self, path: &str) -> Option<Fault> {
        let fault = {
            let mut rules = lock(&self.rules);
            match rules.iter_mut().find(|r| r.left > 0 && path.contains(&r.pattern)) {
                Some(rule) => {
                    rule.left -= 1;
                    Some(rule.fault)
                }
                None => lock(&self.storm).as_mut().and_then(|s| {
                    let hit =
                        path.contains(&s.pattern) && s.rng.below(100) < s.percent && !s.faults.is_empty();
                    hit.then(|| s.faults[s.rng.below(s.faults.len() as u64) as usize])
                }),
            }
        }?;
        self.faults.fetch_add(1, Ordering::SeqCst);
        Some(fault)
    }

    /// Wait until `n` more bytes have crossed the shared link.
    fn pace(&self, n: usize) {
        let Some(bw) = self.config.bandwidth.filter(|&b| b > 0) else { return };
        let cost = Duration::from_secs_f64(n as f64 / bw as f64);
        let done = {
            let mut free = lock(&self.link_free);
            // A sender woken a little late (a loaded machine) does not lose link time: the link
            // is idle only if it has been free for longer than the tolerance.
            let now = Instant::now();
            let start = if now.saturating_duration_since(*free) <= LINK_TOLERANCE { *free } else { now };
            *free = start + cost;
            *free
        };
        sleep_until(done);
    }

    /// [`Self::send`] within the connection's congestion window, if slow start is modelled
    /// (HTTP mode: the bytes reach the client as they are written).
    fn send_windowed(
        &self,
        client: &TcpStream,
        mut bytes: &[u8],
        window: Option<&mut Window>,
    ) -> std::io::Result<()> {
        let Some(w) = window else { return self.send(client, bytes) };
        while !bytes.is_empty() {
            let n = w.admit(Instant::now(), bytes.len());
            self.send(client, &bytes[..n])?;
            w.sent(n);
            bytes = &bytes[n..];
        }
        Ok(())
    }

    /// Send `bytes` to the client through the link.
    fn send(&self, mut client: &TcpStream, bytes: &[u8]) -> std::io::Result<()> {
        for piece in bytes.chunks(PIECE) {
            self.pace(piece.len());
            // Counted before the write, so that a client that has read a byte sees it counted.
            self.wire_bytes.fetch_add(piece.len() as u64, Ordering::SeqCst);
            client.write_all(piece)?;
        }
        Ok(())
    }
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

/// A running proxy; stops accepting when dropped (connections in progress finish on their own,
/// stalled ones are released; in TCP mode, a connection ends when its ends close it).
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("addr", &self.addr)
            .field("mode", &self.shared.mode)
            .field("upstream", &self.shared.upstream)
            .field("config", &self.shared.config)
            .finish()
    }
}

impl Proxy {
    /// Start an HTTP-mode proxy on a loopback port in front of `upstream` (see the module doc).
    pub fn start(upstream: SocketAddr, config: ProxyConfig) -> Result<Self> {
        Self::launch(upstream, config, Mode::Http)
    }

    /// Start a TCP-mode proxy on a loopback port in front of `upstream`: a delay line that any
    /// protocol over TCP crosses, TLS and HTTP/2 included (see the module doc).
    pub fn start_tcp(upstream: SocketAddr, config: ProxyConfig) -> Result<Self> {
        Self::launch(upstream, config, Mode::Tcp)
    }

    fn launch(upstream: SocketAddr, config: ProxyConfig, mode: Mode) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").context("bind the proxy")?;
        // The accept queue of a real server (nginx listens with 511; std's 128 would drop the
        // SYNs of a burst of connections and charge them a 1 s retransmission): listen again
        // with a deeper one, which Linux applies to the listening socket.
        rustix::net::listen(&listener, 1024).context("deepen the proxy's accept queue")?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            mode,
            upstream,
            config,
            stop: AtomicBool::new(false),
            connections: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            body_bytes: AtomicU64::new(0),
            wire_bytes: AtomicU64::new(0),
            faults: AtomicU64::new(0),
            rules: Mutex::new(Vec::new()),
            storm: Mutex::new(None),
            log: Mutex::new(Vec::new()),
            link_free: Mutex::new(Instant::now()),
        });
        let serve: fn(TcpStream, u64, &Shared) -> std::io::Result<()> = match mode {
            Mode::Http => serve_connection,
            Mode::Tcp => serve_tcp,
        };
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new().name("proxy-accept".into()).spawn(move || {
            for conn in listener.incoming() {
                if s.stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let id = s.connections.fetch_add(1, Ordering::SeqCst) + 1;
                let s = Arc::clone(&s);
                let _ = std::thread::Builder::new().name("proxy-conn".into()).spawn(move || {
                    let _ = serve(conn, id, &s);
                });
            }
        })?;
        Ok(Self { addr, shared, thread: Some(thread) })
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT/<prefix>` (prefix without slashes; may be empty).
    pub fn url(&self, prefix: &str) -> String {
        self.url_with("http", prefix)
    }

    /// `https://127.0.0.1:PORT/<prefix>` (prefix without slashes; may be empty), for a TLS
    /// origin behind a TCP-mode proxy.
    pub fn https_url(&self, prefix: &str) -> String {
        self.url_with("https", prefix)
    }

    fn url_with(&self, scheme: &str, prefix: &str) -> String {
        let prefix = prefix.trim_matches('/');
        if prefix.is_empty() {
            format!("{scheme}://{}", self.addr)
        } else {
            format!("{scheme}://{}/{prefix}", self.addr)
        }
    }

    /// The next `count` requests whose path contains `pattern` get `fault` (after the rules
    /// added before this one are used up, for requests they match). HTTP mode only: no effect
    /// in TCP mode.
    pub fn inject(&self, pattern: &str, fault: Fault, count: usize) {
        lock(&self.shared.rules).push(Rule { pattern: pattern.to_owned(), fault, left: count });
    }

    /// From now on, `percent` % of the requests whose path contains `pattern` (and that no
    /// [`Self::inject`] rule takes) get one of `faults`, each drawn from a generator seeded with
    /// `seed`; replaces an earlier storm. [`Self::clear_faults`] lifts it. HTTP mode only: no
    /// effect in TCP mode.
    pub fn storm(&self, pattern: &str, percent: u64, faults: &[Fault], seed: u64) {
        *lock(&self.shared.storm) = Some(Storm {
            pattern: pattern.to_owned(),
            percent,
            faults: faults.to_vec(),
            rng: crate::prng::Prng::new(seed),
        });
    }

    /// Faults injected but not yet applied (a storm's are not counted: it has no end).
    pub fn faults_left(&self) -> usize {
        lock(&self.shared.rules).iter().map(|r| r.left).sum()
    }

    /// Drop the rules not yet used up and lift the storm.
    pub fn clear_faults(&self) {
        lock(&self.shared.rules).clear();
        *lock(&self.shared.storm) = None;
    }

    /// The counters so far.
    pub fn stats(&self) -> ProxyStats {
        let s = &self.shared;
        ProxyStats {
            connections: s.connections.load(Ordering::SeqCst),
            requests: s.requests.load(Ordering::SeqCst),
            body_bytes: s.body_bytes.load(Ordering::SeqCst),
            faults: s.faults.load(Ordering::SeqCst),
            wire_bytes: s.wire_bytes.load(Ordering::SeqCst),
        }
    }

    /// Every request so far, in the order received (HTTP mode; empty in TCP mode).
    pub fn log(&self) -> Vec<LoggedRequest> {
        lock(&self.shared.log).clone()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A parsed message head.
#[derive(Debug)]
struct Head {
    raw: Vec<u8>,
    first_line: String,
    headers: Vec<(String, String)>,
}

impl Head {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    fn content_length(&self) -> std::io::Result<u64> {
        if self.header("transfer-encoding").is_some() {
            return Err(std::io::Error::new(ErrorKind::Unsupported, "chunked bodies are not modelled"));
        }
        match self.header("content-length") {
            None => Ok(0),
            Some(v) => v
                .trim()
                .parse()
                .map_err(|_| std::io::Error::new(ErrorKind::InvalidData, "bad Content-Length")),
        }
    }

    fn wants_close(&self) -> bool {
        self.header("connection").is_some_and(|v| v.trim().eq_ignore_ascii_case("close"))
    }
}

/// Read one head (through the blank line); `None` on a clean EOF before any byte.
fn read_head(r: &mut impl BufRead) -> std::io::Result<Option<Head>> {
    let mut raw = Vec::new();
    loop {
        let before = raw.len();
        let n = r.by_ref().take((MAX_HEAD - raw.len()) as u64 + 1).read_until(b'\n', &mut raw)?;
        if n == 0 {
            if raw.is_empty() {
                return Ok(None);
            }
            return Err(ErrorKind::UnexpectedEof.into());
        }
        if raw.len() > MAX_HEAD {
            return Err(std::io::Error::new(ErrorKind::InvalidData, "head too large"));
        }
        let line = &raw[before..];
        if line == b"\r\n" || line == b"\n" {
            if before == 0 {
                // Stray blank line between messages: skip it.
                raw.clear();
                continue;
            }
            break;
        }
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let mut lines = text.split("\r\n").flat_map(|l| l.split('\n'));
    let first_line = lines.next().unwrap_or_default().to_owned();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
        .collect();
    Ok(Some(Head { raw, first_line, headers }))
}

/// The upstream connection of one client connection.
struct Upstream {
    addr: SocketAddr,
    conn: Option<(TcpStream, BufReader<TcpStream>)>,
}

impl Upstream {
    /// Send a request and read the response head, reconnecting once if a kept-alive connection
    /// turns out to be closed.
    fn exchange(&mut self, request: &[u8]) -> std::io::Result<Head> {
        for attempt in 0..2 {
            let fresh = self.conn.is_none();
            if fresh {
                let s = TcpStream::connect(self.addr)?;
                s.set_nodelay(true)?;
                let r = BufReader::new(s.try_clone()?);
                self.conn = Some((s, r));
            }
            let Some((w, r)) = self.conn.as_mut() else { continue };
            let result = w.write_all(request).and_then(|()| read_head(r));
            match result {
                Ok(Some(head)) => return Ok(head),
                Ok(None) | Err(_) if !fresh && attempt == 0 => self.conn = None,
                Ok(None) => return Err(ErrorKind::UnexpectedEof.into()),
                Err(e) => return Err(e),
            }
        }
        Err(ErrorKind::UnexpectedEof.into())
    }

    fn body(&mut self) -> std::io::Result<&mut BufReader<TcpStream>> {
        self.conn.as_mut().map(|(_, r)| r).ok_or_else(|| ErrorKind::NotConnected.into())
    }
}

fn status_text(code: u16) -> &'static str {
    match code {
        408 => "Request Timeout",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Injected",
    }
}

fn serve_connection(client: TcpStream, id: u64, s: &Shared) -> std::io::Result<()> {
    let accepted = Instant::now();
    client.set_nodelay(true)?;
    // The handshake round trip: nothing the client sent is seen before it.
    sleep_until(accepted + s.config.rtt);
    // A TLS ClientHello (an https probe, e.g. skopeo trying an insecure registry before plain
    // http): close at once, as a plain-HTTP port's server would fail the handshake.
    let mut first = [0u8; 1];
    if client.peek(&mut first).is_ok_and(|n| n == 1 && first[0] == 0x16) {
        return Ok(());
    }
    let mut reader = BufReader::new(client.try_clone()?);
    let mut client = client;
    let mut upstream = Upstream { addr: s.upstream, conn: None };
    let mut window = s.config.slow_start.then(|| Window::new(s.config.rtt));
    let mut send = |client: &TcpStream, bytes: &[u8]| s.send_windowed(client, bytes, window.as_mut());
    let mut fresh = true;
    loop {
        let Some(req) = read_head(&mut reader)? else { return Ok(()) };
        let received = Instant::now();
        s.requests.fetch_add(1, Ordering::SeqCst);
        let mut parts = req.first_line.split_whitespace();
        let method = parts.next().unwrap_or_default().to_owned();
        let path = parts.next().unwrap_or_default().to_owned();
        // A request body (none expected from a store client) is forwarded as is.
        let mut request = req.raw.clone();
        let req_body = req.content_length()?;
        reader.by_ref().take(req_body).read_to_end(&mut request)?;
        let fault = s.take_fault(&path);
        let logged = {
            let mut log = lock(&s.log);
            log.push(LoggedRequest {
                method: method.clone(),
                path: path.clone(),
                range: req.header("range").map(str::to_owned),
                fault,
                at: received,
                connection: id,
                fresh,
                body_bytes: 0,
                done: None,
            });
            log.len() - 1
        };
        fresh = false;
        // Half a round trip to the origin, half back: the answer starts one RTT after the ask.
        let answer_at = received + s.config.rtt;
        match fault {
            Some(Fault::Status(code)) => {
                sleep_until(answer_at);
                let head = format!("HTTP/1.1 {code} {}\r\nContent-Length: 0\r\n\r\n", status_text(code));
                send(&client, head.as_bytes())?;
                s.finished(logged, 0);
                if req.wants_close() {
                    return Ok(());
                }
                continue;
            }
            Some(Fault::Answer { status, body }) => {
                sleep_until(answer_at);
                let head = format!(
                    "HTTP/1.1 {status} {}\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\r\n",
                    status_text(status),
                    body.len()
                );
                send(&client, head.as_bytes())?;
                send(&client, body.as_bytes())?;
                s.body_bytes.fetch_add(body.len() as u64, Ordering::SeqCst);
                s.finished(logged, body.len() as u64);
                if req.wants_close() {
                    return Ok(());
                }
                continue;
            }
            Some(Fault::Stall) => {
                stall(&mut client, s);
                return Ok(());
            }
            _ => {}
        }
        let resp = upstream.exchange(&request)?;
        let status: u16 = resp.first_line.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        let body_len = if method == "HEAD" || status == 204 || status == 304 || (100..200).contains(&status) {
            0
        } else {
            resp.content_length()?
        };
        sleep_until(answer_at);
        send(&client, &resp.raw)?;
        let cut = match fault {
            Some(Fault::Reset { after }) | Some(Fault::Truncate { after }) => Some(after.min(body_len)),
            _ => None,
        };
        let corrupt_at = match fault {
            Some(Fault::Corrupt { at }) if body_len > 0 => Some(at.min(body_len - 1)),
            _ => None,
        };
        let deliver = cut.unwrap_or(body_len);
        let body = upstream.body()?;
        let mut buf = vec![0u8; PIECE];
        let mut pos = 0u64;
        while pos < deliver {
            let n = usize::try_from(deliver - pos).unwrap_or(PIECE).min(PIECE);
            body.read_exact(&mut buf[..n])?;
            if let Some(at) = corrupt_at.filter(|&a| a >= pos && a < pos + n as u64) {
                // `at - pos < n ≤ PIECE`.
                buf[(at - pos) as usize] ^= 0x01;
            }
            // Counted before the write, as `wire_bytes` is.
            s.body_bytes.fetch_add(n as u64, Ordering::SeqCst);
            send(&client, &buf[..n])?;
            pos += n as u64;
        }
        s.finished(logged, deliver);
        match fault {
            Some(Fault::Reset { .. }) => {
                // Linger 0: close sends RST instead of FIN.
                let _ = rustix::net::sockopt::set_socket_linger(&client, Some(Duration::ZERO));
                return Ok(());
            }
            Some(Fault::Truncate { .. }) => {
                let _ = client.shutdown(Shutdown::Write);
                return Ok(());
            }
            _ => {}
        }
        if req.wants_close() || resp.wants_close() {
            return Ok(());
        }
    }
}

/// Hold a connection silently until the client closes it or the proxy stops.
fn stall(client: &mut TcpStream, s: &Shared) {
    let _ = client.set_read_timeout(Some(Duration::from_millis(50)));
    let mut buf = [0u8; 512];
    while !s.stop.load(Ordering::SeqCst) {
        match client.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return,
        }
    }
}

/// TCP mode: what a delay line carries, each with the instant it reaches the other end.
enum Segment {
    Data(Instant, Vec<u8>),
    /// The sender's EOF.
    Fin(Instant),
}

/// TCP mode: the two sockets of one connection (client and upstream), closed together when
/// either fails.
#[derive(Clone, Copy)]
struct Ends<'a> {
    client: &'a TcpStream,
    upstream: &'a TcpStream,
}

impl Ends<'_> {
    /// A failure on either side ends the connection: every thread of it sees EOF or an error.
    fn close(self) {
        let _ = self.client.shutdown(Shutdown::Both);
        let _ = self.upstream.shutdown(Shutdown::Both);
    }
}

/// TCP mode: one direction of a connection.
#[derive(Clone, Copy)]
struct Line<'a> {
    from: &'a TcpStream,
    to: &'a TcpStream,
    ends: Ends<'a>,
    /// Bytes read before this instant count as read at it: until then the handshake is not over
    /// on the sending side.
    open_at: Instant,
    /// Server→client: through the shared link, counted, under the congestion window.
    downstream: bool,
}

/// Serve one TCP-mode connection: two delay lines, each a reader and a writer thread.
fn serve_tcp(client: TcpStream, _id: u64, s: &Shared) -> std::io::Result<()> {
    let accepted = Instant::now();
    let upstream = match TcpStream::connect(s.upstream) {
        Ok(u) => u,
        Err(e) => {
            // A refused connection is a reset, one round trip (SYN, RST) after the attempt.
            sleep_until(accepted + s.config.rtt);
            let _ = rustix::net::sockopt::set_socket_linger(&client, Some(Duration::ZERO));
            return Err(e);
        }
    };
    client.set_nodelay(true)?;
    upstream.set_nodelay(true)?;
    let ends = Ends { client: &client, upstream: &upstream };
    let rtt = s.config.rtt;
    // The SYN-ACK reaches the client one RTT after its SYN; the client's ACK reaches the server
    // half an RTT later.
    let up = Line { from: &client, to: &upstream, ends, open_at: accepted + rtt, downstream: false };
    let down =
        Line { from: &upstream, to: &client, ends, open_at: accepted + rtt + rtt / 2, downstream: true };
    std::thread::scope(|scope| {
        for line in [up, down] {
            let (tx, rx) = mpsc::channel();
            let reader = std::thread::Builder::new()
                .name("proxy-tcp-read".into())
                .spawn_scoped(scope, move || line.read(&tx, s));
            let writer = std::thread::Builder::new()
                .name("proxy-tcp-write".into())
                .spawn_scoped(scope, move || line.write(&rx, s));
            if let Err(e) = reader.and(writer) {
                // The threads already started see the connection closed and end.
                ends.close();
                return Err(e);
            }
        }
        Ok(())
    })
}

impl Line<'_> {
    /// Stamp every chunk read with its arrival time at the other end and queue it.
    fn read(self, tx: &Sender<Segment>, s: &Shared) {
        let half = s.config.rtt / 2;
        let mut buf = vec![0u8; CHUNK];
        let mut from = self.from;
        loop {
            let read = from.read(&mut buf);
            let at = Instant::now().max(self.open_at) + half;
            let segment = match read {
                Ok(0) => Segment::Fin(at),
                Ok(n) => Segment::Data(at, buf[..n].to_vec()),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return self.ends.close(),
            };
            let fin = matches!(segment, Segment::Fin(_));
            // A failed send: the writer has gone, after closing the connection.
            if tx.send(segment).is_err() || fin {
                return;
            }
        }
    }

    /// Deliver every queued chunk at its time, in order; the EOF last, as a half-close.
    fn write(self, rx: &Receiver<Segment>, s: &Shared) {
        let mut window = (self.downstream && s.config.slow_start).then(|| Window::new(s.config.rtt));
        // The queue ends without a FIN only when the reader failed, and it closed the connection.
        for segment in rx {
            match segment {
                Segment::Data(at, bytes) => {
                    sleep_until(at);
                    if self.deliver(at, &bytes, window.as_mut(), s).is_err() {
                        return self.ends.close();
                    }
                }
                Segment::Fin(at) => {
                    sleep_until(at);
                    let _ = self.to.shutdown(Shutdown::Write);
                    return;
                }
            }
        }
    }

    /// Write `bytes`, due at `due`: server→client through the link and the window.
    fn deliver(
        self,
        due: Instant,
        mut bytes: &[u8],
        mut window: Option<&mut Window>,
        s: &Shared,
    ) -> std::io::Result<()> {
        if !self.downstream {
            let mut to = self.to;
            return to.write_all(bytes);
        }
        while !bytes.is_empty() {
            let n = window.as_deref_mut().map_or(bytes.len(), |w| w.admit(due, bytes.len()));
            s.send(self.to, &bytes[..n])?;
            if let Some(w) = window.as_deref_mut() {
                w.sent(n);
            }
            bytes = &bytes[n..];
        }
        Ok(())
    }
}

/// The congestion window of one connection's server→client direction, in slow start (see the
/// module doc). Flights are timed where bytes are delivered, not where the server wrote them: in
/// TCP mode the two are half an RTT apart, which shifts every flight alike.
struct Window {
    rtt: Duration,
    /// Idle time after which the window decays.
    rto: Duration,
    cwnd: usize,
    /// Bytes sent in the current flight.
    in_flight: usize,
    /// When the current flight's first byte was sent.
    flight_start: Instant,
    /// When the last byte was sent (`None`: none yet).
    last_sent: Option<Instant>,
}

impl Window {
    fn new(rtt: Duration) -> Self {
        let now = Instant::now();
        Self {
            rtt,
            rto: rtt + RTO_MIN,
            cwnd: INITIAL_WINDOW,
            in_flight: 0,
            flight_start: now,
            last_sent: None,
        }
    }

    /// How many of `want` bytes, due at `due`, may be sent now; when the window is used up,
    /// first wait for the flight's round trip.
    fn admit(&mut self, due: Instant, want: usize) -> usize {
        self.decay_after_idle(due);
        if self.in_flight >= self.cwnd {
            // The flight's acknowledgements are back one RTT after its first byte left.
            sleep_until(self.flight_start + self.rtt);
            self.end_flight();
        } else if self.in_flight > 0 && Instant::now() >= self.flight_start + self.rtt {
            // A flight the sender did not fill is acknowledged too: a new one begins.
            self.end_flight();
        }
        if self.in_flight == 0 {
            self.flight_start = Instant::now();
        }
        want.min(self.cwnd - self.in_flight)
    }

    /// `n` bytes admitted were sent.
    fn sent(&mut self, n: usize) {
        self.in_flight += n;
        self.last_sent = Some(Instant::now());
    }

    /// Slow start: each acknowledged byte grows the window by one — only if the flight used
    /// more than half of it, as Linux's `tcp_is_cwnd_limited` decides in slow start (otherwise
    /// the sender, not the window, was the limit).
    fn end_flight(&mut self) {
        if 2 * self.in_flight > self.cwnd {
            self.cwnd = self.cwnd.saturating_add(self.in_flight);
        }
        self.in_flight = 0;
    }

    /// Linux's `tcp_cwnd_restart`: after more than one RTO with nothing sent, the window halves
    /// for every RTO idle, down to the initial window.
    fn decay_after_idle(&mut self, due: Instant) {
        let Some(last) = self.last_sent else { return };
        let mut idle = due.saturating_duration_since(last);
        if idle <= self.rto {
            return;
        }
        while idle > self.rto && self.cwnd > INITIAL_WINDOW {
            idle -= self.rto;
            self.cwnd /= 2;
        }
        self.cwnd = self.cwnd.max(INITIAL_WINDOW);
        self.in_flight = 0;
    }
}

#[cfg(test)]
mod tests {
    //! The proxy must be right, or every result measured through it is wrong: these tests check
    //! its charges (connection, request, bandwidth), its transparency and each fault, against
    //! a real nginx.

    use std::fs;

    use super::*;
    use crate::nginx::Nginx;
    use crate::prng::Prng;

    const RTT: Duration = Duration::from_millis(200);
    /// Scheduling slack allowed above an exact charge (the machine may be loaded); less than
    /// one RTT, so that a charge too many is caught.
    const SLACK: Duration = Duration::from_millis(150);

    struct Origin {
        _dir: tempfile::TempDir,
        nginx: Nginx,
        blob: Vec<u8>,
    }

    fn origin() -> Origin {
        let dir = crate::testutil::tmp("proxy").unwrap();
        let blob = Prng::from_label("proxy").bytes(1 << 20);
        fs::write(dir.path().join("blob"), &blob).unwrap();
        let nginx = Nginx::serve(dir.path(), "s").unwrap();
        Origin { _dir: dir, nginx, blob }
    }

    /// A minimal HTTP/1.1 client on one connection, so tests control reuse exactly.
    struct Client {
        w: TcpStream,
        r: BufReader<TcpStream>,
    }

    impl Client {
        fn connect(addr: SocketAddr) -> Self {
            let w = TcpStream::connect(addr).unwrap();
            w.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let r = BufReader::new(w.try_clone().unwrap());
            Self { w, r }
        }

        fn send(&mut self, path: &str, range: Option<&str>) {
            let range = range.map(|r| format!("Range: {r}\r\n")).unwrap_or_default();
            write!(self.w, "GET {path} HTTP/1.1\r\nHost: t\r\n{range}\r\n").unwrap();
        }

        /// Status and body (as many bytes as arrive, up to Content-Length) and the read error.
        fn recv(&mut self) -> (u16, Vec<u8>, u64, Option<std::io::Error>) {
            let head = read_head(&mut self.r).unwrap().expect("a response head");
            let status = head.first_line.split_whitespace().nth(1).unwrap().parse().unwrap();
            let len = head.content_length().unwrap();
            let mut body = Vec::new();
            let err = self.r.by_ref().take(len).read_to_end(&mut body).err();
            (status, body, len, err)
        }

        fn get(&mut self, path: &str, range: Option<&str>) -> (u16, Vec<u8>) {
            self.send(path, range);
            let (status, body, len, err) = self.recv();
            assert!(err.is_none() && body.len() as u64 == len, "{err:?} {} of {len}", body.len());
            (status, body)
        }
    }

    fn within(d: Duration, lo: Duration, what: &str) {
        within_by(d, lo, SLACK, what);
    }

    fn within_by(d: Duration, lo: Duration, slack: Duration, what: &str) {
        eprintln!("{what}: {d:?} (expected {lo:?} + up to {slack:?})");
        assert!(d >= lo && d <= lo + slack, "{what}: {d:?}, expected {lo:?} (+ up to {slack:?})");
    }

    #[test]
    fn charges_one_rtt_per_connection_and_one_per_request() {
        let o = origin();
        let p = Proxy::start(o.nginx.addr(), ProxyConfig::rtt(RTT)).unwrap();
        let t = Instant::now();
        let mut c = Client::connect(p.addr());
        let (status, body) = c.get("/s/blob", None);
        within(t.elapsed(), 2 * RTT, "first request on a new connection");
        assert_eq!((status, body.as_slice()), (200, o.blob.as_slice()), "bytes pass unchanged");
        let t = Instant::now();
        let (status, body) = c.get("/s/blob", Some("bytes=1000-1999"));
        within(t.elapsed(), RTT, "second request on the same connection");
        assert_eq!((status, body.as_slice()), (206, &o.blob[1000..2000]));
        let st = p.stats();
        assert_eq!((st.connections, st.requests, st.faults), (1, 2, 0));
        assert_eq!(st.body_bytes, (1 << 20) + 1000);
        assert!(st.wire_bytes > st.body_bytes && st.wire_bytes < st.body_bytes + 2048, "heads too: {st:?}");
        let log = p.log();
        assert_eq!(log.len(), 2);
        assert_eq!((log[1].method.as_str(), log[1].path.as_str()), ("GET", "/s/blob"));
        assert_eq!(log[1].range.as_deref(), Some("bytes=1000-1999"));
        // A second connection pays the handshake again.
        let t = Instant::now();
        Client::connect(p.addr()).get("/s/blob", Some("bytes=0-0"));
        within(t.elapsed(), 2 * RTT, "a second connection");
        assert_eq!(p.stats().connections, 2);
    }

    #[test]
    fn parallel_connections_are_not_serialized() {
        let o = origin();
        let p = Proxy::start(o.nginx.addr(), ProxyConfig::rtt(RTT)).unwrap();
        let addr = p.addr();
        let t = Instant::now();
        let threads: Vec<_> = (0..16)
            .map(|i| {
                std::thread::spawn(move || {
                    let range = format!("bytes={}-{}", i * 100, i * 100 + 99);
                    Client::connect(addr).get("/s/blob", Some(&range))
                })
            })
            .collect();
        for (i, th) in threads.into_iter().enumerate() {
            let (status, body) = th.join().unwrap();
            assert_eq!((status, body.as_slice()), (206, &o.blob[i * 100..i * 100 + 100]));
        }
        within(t.elapsed(), 2 * RTT, "16 connections at once");
        assert_eq!(p.stats().connections, 16);
    }

    /// 1 MiB at 2 MiB/s takes 500 ms; two at once on two connections take 1 s.
    fn bandwidth_is_shared(start: fn(SocketAddr, ProxyConfig) -> Result<Proxy>, mode: &str) {
        let o = origin();
        let cfg = ProxyConfig { rtt: Duration::ZERO, bandwidth: Some(2 << 20), ..Default::default() };
        let p = start(o.nginx.addr(), cfg).unwrap();
        let t = Instant::now();
        let (_, body) = Client::connect(p.addr()).get("/s/blob", None);
        assert_eq!(body, o.blob);
        within(t.elapsed(), Duration::from_millis(500), &format!("{mode}: 1 MiB at 2 MiB/s"));
        let addr = p.addr();
        // From an idle link: a start within LINK_TOLERANCE of the last transfer's end would be
        // credited the gap (as a late wake-up) and finish that much early.
        std::thread::sleep(LINK_TOLERANCE * 2);
        let t = Instant::now();
        let a = std::thread::spawn(move || Client::connect(addr).get("/s/blob", None));
        let (_, b) = Client::connect(addr).get("/s/blob", None);
        let (_, a) = a.join().unwrap();
        assert!(a == o.blob && b == o.blob);
        within(
            t.elapsed(),
            Duration::from_secs(1),
            &format!("{mode}: 2 MiB at 2 MiB/s over two connections"),
        );
        assert_eq!(p.stats().connections, 3);
    }

    #[test]
    fn bandwidth_is_shared_by_all_connections() {
        bandwidth_is_shared(Proxy::start, "HTTP mode");
    }

    #[test]
    fn injected_status_keeps_the_connection_and_is_counted() {
        let o = origin();
        let p = Proxy::start(o.nginx.addr(), ProxyConfig::default()).unwrap();
        p.inject("/s/blob", Fault::Status(503), 2);
        p.inject("/other", Fault::Status(429), 1);
        let mut c = Client::connect(p.addr());
        assert_eq!(c.get("/s/blob", None).0, 503);
        assert_eq!(c.get("/s/blob", Some("bytes=0-9")).0, 503);
        assert_eq!(p.faults_left(), 1, "the rule for another path is untouched");
        let (status, body) = c.get("/s/blob", Some("bytes=0-9"));
        assert_eq!((status, body.as_slice()), (206, &o.blob[..10]));
        let st = p.stats();
        assert_eq!((st.connections, st.requests, st.faults), (1, 3, 2));
        assert_eq!(p.log()[0].fault, Some(Fault::Status(503)));
        assert_eq!(p.log()[2].fault, None);
    }

    #[test]
    fn reset_truncate_and_corrupt_do_what_they_say() {
        let o = origin();
        let p = Proxy::start(o.nginx.addr(), ProxyConfig::default()).unwrap();
        let len = o.blob.len() as u64;

        p.inject("/s/blob", Fault::Reset { after: 100_000 }, 1);
        let mut c = Client::connect(p.addr());
        c.send("/s/blob", None);
        let (status, body, announced, err) = c.recv();
        assert_eq!((status, announced), (200, len));
        assert!(body.len() <= 100_000, "{}", body.len());
        assert_eq!(body, o.blob[..body.len()], "the bytes before the reset are right");
        let err = err.expect("a reset is an error, not a clean end");
        assert_eq!(err.kind(), ErrorKind::ConnectionReset, "{err}");

        p.inject("/s/blob", Fault::Truncate { after: 5000 }, 1);
        let mut c = Client::connect(p.addr());
        c.send("/s/blob", Some("bytes=100-20099"));
        let (status, body, announced, err) = c.recv();
        assert_eq!((status, announced), (206, 20_000));
        assert!(err.is_none(), "a truncation is a clean close: {err:?}");
        assert_eq!(body, o.blob[100..5100], "exactly the first 5000 bytes, then EOF");

        p.inject("/s/blob", Fault::Corrupt { at: 12_345 }, 1);
        p.inject("/s/blob", Fault::Corrupt { at: u64::MAX }, 1);
        let mut c = Client::connect(p.addr());
        let (_, body) = c.get("/s/blob", None);
        let diffs: Vec<usize> = (0..body.len()).filter(|&i| body[i] != o.blob[i]).collect();
        assert_eq!(diffs, [12_345]);
        assert_eq!(body[12_345] ^ o.blob[12_345], 1, "one bit flipped");
        let (_, body) = c.get("/s/blob", Some("bytes=0-99"));
        let diffs: Vec<usize> = (0..body.len()).filter(|&i| body[i] != o.blob[i]).collect();
        assert_eq!(diffs, [99], "past the end: the last byte");
        assert_eq!(p.stats().faults, 4);
        assert_eq!(p.faults_left(), 0);
    }

    #[test]
    fn stall_sends_nothing_until_the_client_gives_up() {
        let o = origin();
        let p = Proxy::start(o.nginx.addr(), ProxyConfig::default()).unwrap();
        p.inject("/s/blob", Fault::Stall, 1);
        let mut c = Client::connect(p.addr());
        c.w.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        c.send("/s/blob", None);
        let t = Instant::now();
        let mut byte = [0u8; 1];
        let err = c.r.read(&mut byte).expect_err("no byte of a stalled answer");
        assert!(matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut), "{err}");
        assert!(t.elapsed() >= Duration::from_millis(290));
        drop(c);
        // The next connection is served normally.
        let (status, body) = Client::connect(p.addr()).get("/s/blob", Some("bytes=0-9"));
        assert_eq!((status, body.as_slice()), (206, &o.blob[..10]));
    }

    #[test]
    fn connection_close_is_honoured() {
        let o = origin();
        let p = Proxy::start(o.nginx.addr(), ProxyConfig::default()).unwrap();
        let mut c = Client::connect(p.addr());
        // `Connection: close` to the origin only through the request: send it by hand.
        write!(c.w, "GET /s/blob HTTP/1.1\r\nHost: t\r\nRange: bytes=0-9\r\nConnection: close\r\n\r\n")
            .unwrap();
        let (status, body, _, err) = c.recv();
        assert!(err.is_none());
        assert_eq!((status, body.as_slice()), (206, &o.blob[..10]));
        // The proxy closed the client connection too, as asked.
        let mut rest = Vec::new();
        assert_eq!(c.r.read_to_end(&mut rest).unwrap(), 0);
        let (status, _) = Client::connect(p.addr()).get("/s/blob", Some("bytes=0-9"));
        assert_eq!(status, 206);
    }

    /// TCP mode: shorter than RTT, so that the slow-start test stays short; its slack is in the
    /// same proportion as [`SLACK`] to [`RTT`], less than one round trip.
    const TCP_RTT: Duration = Duration::from_millis(100);
    const TCP_SLACK: Duration = Duration::from_millis(75);

    #[test]
    fn tcp_mode_charges_the_handshake_and_half_a_round_trip_each_way() {
        let o = origin();
        let p = Proxy::start_tcp(o.nginx.addr(), ProxyConfig::rtt(TCP_RTT)).unwrap();
        let t = Instant::now();
        let mut c = Client::connect(p.addr());
        let (status, body) = c.get("/s/blob", None);
        within_by(t.elapsed(), 2 * TCP_RTT, TCP_SLACK, "first exchange on a new connection");
        assert_eq!((status, body.as_slice()), (200, o.blob.as_slice()), "bytes pass unchanged");
        let t = Instant::now();
        let (status, body) = c.get("/s/blob", Some("bytes=1000-1999"));
        within_by(t.elapsed(), TCP_RTT, TCP_SLACK, "second exchange on the same connection");
        assert_eq!((status, body.as_slice()), (206, &o.blob[1000..2000]));
        // The client's FIN reaches nginx half a round trip later; nginx's comes back in the other.
        let t = Instant::now();
        c.w.shutdown(Shutdown::Write).unwrap();
        let mut rest = Vec::new();
        assert_eq!(c.r.read_to_end(&mut rest).unwrap(), 0, "a clean close");
        within_by(t.elapsed(), TCP_RTT, TCP_SLACK, "a half-close answered by a close");
        let st = p.stats();
        assert_eq!((st.connections, st.requests, st.body_bytes, st.faults), (1, 0, 0, 0), "{st:?}");
        let bodies = (1 << 20) + 1000;
        assert!(st.wire_bytes > bodies && st.wire_bytes < bodies + 2048, "bodies and heads: {st:?}");
        assert!(p.log().is_empty());
    }

    #[test]
    fn tcp_mode_bandwidth_is_shared_by_all_connections() {
        bandwidth_is_shared(Proxy::start_tcp, "TCP mode");
    }

    #[test]
    fn tcp_slow_start_charges_a_round_trip_per_window() {
        slow_start_charges_a_round_trip_per_window(Proxy::start_tcp, "TCP mode");
    }

    #[test]
    fn http_slow_start_charges_a_round_trip_per_window() {
        slow_start_charges_a_round_trip_per_window(Proxy::start, "HTTP mode");
    }

    /// Both modes charge the same for a new connection, a request and slow start.
    fn slow_start_charges_a_round_trip_per_window(
        start: fn(SocketAddr, ProxyConfig) -> Result<Proxy>,
        mode: &str,
    ) {
        const RANGE: &str = "bytes=0-199999";
        let o = origin();
        let fetch = |c: &mut Client| {
            let t = Instant::now();
            let (status, body) = c.get("/s/blob", Some(RANGE));
            assert_eq!((status, body.as_slice()), (206, &o.blob[..200_000]));
            t.elapsed()
        };

        // Without slow start: the handshake and one exchange.
        let p = start(o.nginx.addr(), ProxyConfig::rtt(TCP_RTT)).unwrap();
        let t = Instant::now();
        let mut c = Client::connect(p.addr());
        fetch(&mut c);
        within_by(
            t.elapsed(),
            2 * TCP_RTT,
            TCP_SLACK,
            &format!("{mode}: 200 KB on a new connection, no slow start"),
        );

        // With it: 200 KB and a head need flights of 14480, 28960, 57920 and 115840 bytes,
        // each one round trip after the one before: 3 more round trips.
        let cfg = ProxyConfig { slow_start: true, ..ProxyConfig::rtt(TCP_RTT) };
        let p = start(o.nginx.addr(), cfg).unwrap();
        let t = Instant::now();
        let mut c = Client::connect(p.addr());
        fetch(&mut c);
        within_by(
            t.elapsed(),
            5 * TCP_RTT,
            TCP_SLACK,
            &format!("{mode}: 200 KB on a new connection, slow start"),
        );
        // At once on the same connection: the window has grown past 200 KB.
        within_by(fetch(&mut c), TCP_RTT, TCP_SLACK, &format!("{mode}: 200 KB again, window open"));
        // After several RTOs (RTT + 200 ms) idle the window is back to 10 segments.
        std::thread::sleep(5 * (TCP_RTT + RTO_MIN));
        within_by(
            fetch(&mut c),
            4 * TCP_RTT,
            TCP_SLACK,
            &format!("{mode}: 200 KB after an idle time, window restarted"),
        );
    }
}
