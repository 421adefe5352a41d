//! The network model of the tests: an HTTP/1.1 proxy on loopback in front of a real origin
//! (nginx) that adds round-trip time, a shared bandwidth limit and injected faults, and counts
//! what crosses it. This kernel has no netem, so this proxy *is* the WAN: it must charge what a
//! real network charges, or concurrency results flatter the design (brief §6).
//!
//! Costs charged, with `rtt` the configured round-trip time:
//! - **a new connection**: nothing from the client is read for one `rtt` after `accept` (the TCP
//!   handshake; the client's `connect` returns at once on loopback, so its first bytes wait);
//! - **every request**: the response starts no earlier than one `rtt` after the request head
//!   was received (half a round trip each way). A fresh connection's first response therefore
//!   starts 2·`rtt` after `accept`, a reused connection's 1·`rtt` after the request;
//! - **bandwidth** (optional): every byte sent to clients (heads and bodies, all connections
//!   together) passes one shared link of the configured bytes per second.
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
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use std::time::Duration;
//! use tessera_e2e::proxy::{Fault, Proxy, ProxyConfig};
//! let origin = tessera_e2e::nginx::Nginx::serve("/tmp/store".as_ref(), "store")?;
//! let cfg = ProxyConfig { rtt: Duration::from_millis(20), bandwidth: Some(25_000_000) };
//! let proxy = Proxy::start(origin.addr(), cfg)?;
//! proxy.inject("/blobs/", Fault::Status(503), 3);
//! let url = proxy.url("store"); // http://127.0.0.1:PORT/store
//! // ... run tessera against `url`, then:
//! assert!(proxy.stats().connections < 32);
//! # Ok(()) }
//! ```

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// Largest request or response head accepted.
const MAX_HEAD: usize = 64 << 10;
/// Bytes sent to a client per write (and per bandwidth reservation).
const PIECE: usize = 16 << 10;
/// Late wake-ups up to this long are not counted as idle link time.
const LINK_TOLERANCE: Duration = Duration::from_millis(5);

/// The network the proxy models.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProxyConfig {
    /// Round-trip time charged once per new connection and once per request.
    pub rtt: Duration,
    /// Bytes per second of the link shared by all connections (`None`: unlimited).
    pub bandwidth: Option<u64>,
}

impl ProxyConfig {
    /// Only latency: `rtt` per connection and per request, unlimited bandwidth.
    pub fn rtt(rtt: Duration) -> Self {
        Self { rtt, bandwidth: None }
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

struct Shared {
    storm: Mutex<Option<Storm>>,
    upstream: SocketAddr,
    config: ProxyConfig,
    stop: AtomicBool,
    connections: AtomicU64,
    requests: AtomicU64,
    body_bytes: AtomicU64,
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

    /// Send `bytes` to the client through the link.
    fn send(&self, client: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
        for piece in bytes.chunks(PIECE) {
            self.pace(piece.len());
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
/// stalled ones are released).
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("addr", &self.addr)
            .field("upstream", &self.shared.upstream)
            .field("config", &self.shared.config)
            .finish()
    }
}

impl Proxy {
    /// Start a proxy on a loopback port in front of `upstream`.
    pub fn start(upstream: SocketAddr, config: ProxyConfig) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").context("bind the proxy")?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            config,
            stop: AtomicBool::new(false),
            connections: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            body_bytes: AtomicU64::new(0),
            faults: AtomicU64::new(0),
            rules: Mutex::new(Vec::new()),
            storm: Mutex::new(None),
            log: Mutex::new(Vec::new()),
            link_free: Mutex::new(Instant::now()),
        });
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
                    let _ = serve_connection(conn, id, &s);
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
        let prefix = prefix.trim_matches('/');
        if prefix.is_empty() {
            format!("http://{}", self.addr)
        } else {
            format!("http://{}/{prefix}", self.addr)
        }
    }

    /// The next `count` requests whose path contains `pattern` get `fault` (after the rules
    /// added before this one are used up, for requests they match).
    pub fn inject(&self, pattern: &str, fault: Fault, count: usize) {
        lock(&self.shared.rules).push(Rule { pattern: pattern.to_owned(), fault, left: count });
    }

    /// From now on, `percent` % of the requests whose path contains `pattern` (and that no
    /// [`Self::inject`] rule takes) get one of `faults`, each drawn from a generator seeded with
    /// `seed`; replaces an earlier storm. [`Self::clear_faults`] lifts it.
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
        }
    }

    /// Every request so far, in the order received.
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
                s.send(&mut client, head.as_bytes())?;
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
                s.send(&mut client, head.as_bytes())?;
                s.send(&mut client, body.as_bytes())?;
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
        s.send(&mut client, &resp.raw)?;
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
            // Counted before the write, so that a client that has read a byte sees it counted.
            s.body_bytes.fetch_add(n as u64, Ordering::SeqCst);
            s.send(&mut client, &buf[..n])?;
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
        assert!(d >= lo && d <= lo + SLACK, "{what}: {d:?}, expected {lo:?} (+ up to {SLACK:?})");
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

    #[test]
    fn bandwidth_is_shared_by_all_connections() {
        let o = origin();
        // 2 MiB/s: 1 MiB takes 500 ms; two at once on two connections take 1 s.
        let cfg = ProxyConfig { rtt: Duration::ZERO, bandwidth: Some(2 << 20) };
        let p = Proxy::start(o.nginx.addr(), cfg).unwrap();
        let t = Instant::now();
        let (_, body) = Client::connect(p.addr()).get("/s/blob", None);
        assert_eq!(body, o.blob);
        within(t.elapsed(), Duration::from_millis(500), "1 MiB at 2 MiB/s");
        let addr = p.addr();
        // From an idle link: a start within LINK_TOLERANCE of the last transfer's end would be
        // credited the gap (as a late wake-up) and finish that much early.
        std::thread::sleep(LINK_TOLERANCE * 2);
        let t = Instant::now();
        let a = std::thread::spawn(move || Client::connect(addr).get("/s/blob", None));
        let (_, b) = Client::connect(addr).get("/s/blob", None);
        let (_, a) = a.join().unwrap();
        assert!(a == o.blob && b == o.blob);
        within(t.elapsed(), Duration::from_secs(1), "2 MiB at 2 MiB/s over two connections");
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
}
