//! nginx (Debian `nginx`) as a real HTTP origin: serves a directory under a URL prefix on a
//! loopback port, with Range support as any static server or CDN has.
//!
//! [`Nginx::serve_tls`] adds TLS (1.2 and 1.3; HTTP/1.1 only); [`Nginx::serve_tls_h2`] also offers
//! HTTP/2 through ALPN (`listen … ssl http2`, nginx 1.22's syntax), with nginx's defaults for
//! everything h2 (128 concurrent streams per connection, …): a CDN-like origin for clients that
//! multiplex.
//!
//! One foreground process (`daemon off; master_process off;`) with its config, pid file and logs
//! in a temp dir; readiness is polled (TCP connect); the process is killed on drop.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! let origin = tessera_e2e::nginx::Nginx::serve("/tmp/store".as_ref(), "store")?;
//! let url = origin.url(); // http://127.0.0.1:PORT/store
//! # Ok(()) }
//! ```

use std::fs;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// The nginx binary: `$NGINX`, else `/usr/sbin/nginx`.
pub fn nginx_bin() -> PathBuf {
    std::env::var_os("NGINX").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/usr/sbin/nginx"))
}

/// A running nginx serving one directory; stopped on drop.
#[derive(Debug)]
pub struct Nginx {
    child: Option<Child>,
    port: u16,
    prefix: String,
    scheme: &'static str,
    root: PathBuf,
    dir: tempfile::TempDir,
}

/// A server certificate and its key (PEM files), for [`Nginx::serve_tls`] and
/// [`Nginx::serve_tls_h2`].
#[derive(Debug, Clone, Copy)]
pub struct ServerCert<'a> {
    pub cert: &'a Path,
    pub key: &'a Path,
}

impl Nginx {
    /// Serve `root` at `http://127.0.0.1:PORT/<prefix>/` (prefix without slashes; may be empty).
    pub fn serve(root: &Path, prefix: &str) -> Result<Self> {
        Self::start(root, prefix, None)
    }

    /// Serve `root` at `https://127.0.0.1:PORT/<prefix>/` with `cert`, HTTP/1.1 only.
    pub fn serve_tls(root: &Path, prefix: &str, cert: ServerCert<'_>) -> Result<Self> {
        Self::start(root, prefix, Some(Tls { cert, http2: false }))
    }

    /// Serve `root` at `https://127.0.0.1:PORT/<prefix>/` with `cert`, offering HTTP/2 (ALPN `h2`,
    /// HTTP/1.1 for clients that do not ask for it). nginx's h2 defaults are kept as they are —
    /// notably 128 concurrent streams per connection (`http2_max_concurrent_streams`) — so that
    /// a client is measured against a default h2 server, not a tuned one.
    pub fn serve_tls_h2(root: &Path, prefix: &str, cert: ServerCert<'_>) -> Result<Self> {
        Self::start(root, prefix, Some(Tls { cert, http2: true }))
    }

    fn start(root: &Path, prefix: &str, tls: Option<Tls<'_>>) -> Result<Self> {
        let root = root.canonicalize().with_context(|| format!("canonicalize {}", root.display()))?;
        let dir = crate::testutil::tmp("nginx")?;
        let conf_path = dir.path().join("nginx.conf");
        let error_log = dir.path().join("error.log");
        let mut last_err = None;
        // A free port can be taken between probing and nginx binding it: try a few.
        for _ in 0..5 {
            let port = free_port()?;
            fs::write(&conf_path, config(dir.path(), &root, prefix, port, tls))?;
            let mut child = spawn(dir.path())?;
            match wait_ready(&mut child, port, &error_log, Duration::from_secs(10)) {
                Ok(()) => {
                    let prefix = prefix.trim_matches('/').to_owned();
                    let scheme = if tls.is_some() { "https" } else { "http" };
                    return Ok(Nginx { child: Some(child), port, prefix, scheme, root, dir });
                }
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    last_err = Some(e);
                }
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow::anyhow!("nginx did not start")))
    }

    /// The directory served (canonical).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The base URL: `http://127.0.0.1:PORT/<prefix>` (`https://` with TLS).
    pub fn url(&self) -> String {
        if self.prefix.is_empty() {
            format!("{}://127.0.0.1:{}", self.scheme, self.port)
        } else {
            format!("{}://127.0.0.1:{}/{}", self.scheme, self.port, self.prefix)
        }
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:PORT`, for a proxy in front of it.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// The access log so far (one line per request: method, URI, status, bytes, Range).
    pub fn access_log(&self) -> String {
        fs::read_to_string(self.dir.path().join("access.log")).unwrap_or_default()
    }

    /// The access log so far, parsed (see [`parse_access_log`]).
    pub fn requests(&self) -> Result<Vec<LoggedRequest>> {
        parse_access_log(&self.access_log())
    }

    /// The error log so far.
    pub fn error_log(&self) -> String {
        fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default()
    }

    /// Start a [stopped](Self::stop) nginx again, on the same port with the same configuration:
    /// the origin comes back at the same URL. Nothing if it runs.
    pub fn restart(&mut self) -> Result<()> {
        if self.child.is_some() {
            return Ok(());
        }
        let mut child = spawn(self.dir.path())?;
        if let Err(e) =
            wait_ready(&mut child, self.port, &self.dir.path().join("error.log"), Duration::from_secs(10))
        {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        self.child = Some(child);
        Ok(())
    }

    /// Stop nginx (kill and reap); the origin is then unreachable. Idempotent.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One access-log line: `METHOD URI STATUS BODY_BYTES "RANGE"` (RANGE is `-` without a Range
/// header).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoggedRequest {
    /// `GET`, `HEAD`, …
    pub method: String,
    /// The decoded path, without the query.
    pub uri: String,
    /// The status sent.
    pub status: u16,
    /// Body bytes sent (`$body_bytes_sent`).
    pub body_bytes: u64,
    /// The ranges of the `Range` header as `(first, last)` (inclusive), in the order sent; empty
    /// if none was sent (several: a multi-range GET).
    pub ranges: Vec<(u64, u64)>,
}

impl LoggedRequest {
    /// The byte intervals `[start, end)` of the resource whose body was sent: the range for a
    /// 206 of one range (as long as the body), each range asked for in a multi-range 206 (its
    /// body also holds the parts' headers), `[0, body_bytes)` for a 200; none for other statuses
    /// or an empty body.
    pub fn sent_intervals(&self) -> Vec<(u64, u64)> {
        match (self.status, self.ranges.as_slice()) {
            (_, _) if self.body_bytes == 0 => Vec::new(),
            (206, [(first, _)]) => vec![(*first, first + self.body_bytes)],
            (206, ranges) => ranges.iter().map(|&(a, b)| (a, b + 1)).collect(),
            (200, _) => vec![(0, self.body_bytes)],
            _ => Vec::new(),
        }
    }
}

/// The ranges `(first, last)` (inclusive) of a `Range` header value (`bytes=A-B[,C-D…]`), in
/// order; `None` if it is not one.
pub fn parse_range_header(value: &str) -> Option<Vec<(u64, u64)>> {
    value
        .trim()
        .strip_prefix("bytes=")?
        .split(',')
        .map(|r| {
            let (a, b) = r.trim().split_once('-')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .collect()
}

/// Parse the access log the helper configures (`log_format ranges`).
pub fn parse_access_log(log: &str) -> Result<Vec<LoggedRequest>> {
    log.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let bad = || anyhow::anyhow!("unexpected access-log line {line:?}");
            let mut f = line.splitn(5, ' ');
            let method = f.next().ok_or_else(bad)?.to_owned();
            let uri = f.next().ok_or_else(bad)?.to_owned();
            let status = f.next().ok_or_else(bad)?.parse().map_err(|_| bad())?;
            let body_bytes = f.next().ok_or_else(bad)?.parse().map_err(|_| bad())?;
            let range_field = f.next().ok_or_else(bad)?.trim_matches('"');
            let ranges = match range_field {
                "-" | "" => Vec::new(),
                r => parse_range_header(r).ok_or_else(bad)?,
            };
            Ok(LoggedRequest { method, uri, status, body_bytes, ranges })
        })
        .collect()
}

/// For every URI starting with `prefix`: the bytes the origin sent more than once (overlaps of
/// the intervals sent). Empty when no byte of any such resource was sent twice.
pub fn bytes_sent_twice(requests: &[LoggedRequest], prefix: &str) -> Vec<(String, u64)> {
    let mut by_uri: std::collections::BTreeMap<&str, Vec<(u64, u64)>> = Default::default();
    for r in requests.iter().filter(|r| r.uri.starts_with(prefix)) {
        by_uri.entry(r.uri.as_str()).or_default().extend(r.sent_intervals());
    }
    let mut out = Vec::new();
    for (uri, mut ivs) in by_uri {
        ivs.sort_unstable();
        let (mut twice, mut covered_to) = (0u64, 0u64);
        for (start, end) in ivs {
            if start < covered_to {
                twice += covered_to.min(end) - start;
            }
            covered_to = covered_to.max(end);
        }
        if twice > 0 {
            out.push((uri.to_owned(), twice));
        }
    }
    out
}

fn wait_ready(child: &mut Child, port: u16, error_log: &Path, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    loop {
        if let Some(status) = child.try_wait()? {
            let log = fs::read_to_string(error_log).unwrap_or_default();
            bail!("nginx exited with {status} before listening: {log}");
        }
        if TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok() {
            return Ok(());
        }
        if Instant::now() > deadline {
            let log = fs::read_to_string(error_log).unwrap_or_default();
            bail!("nginx did not listen on {addr} within {timeout:?}: {log}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn free_port() -> Result<u16> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("bind a loopback port")?;
    Ok(l.local_addr()?.port())
}

/// How a TLS server listens.
#[derive(Debug, Clone, Copy)]
struct Tls<'a> {
    cert: ServerCert<'a>,
    /// Offer HTTP/2 by ALPN.
    http2: bool,
}

fn config(dir: &Path, root: &Path, prefix: &str, port: u16, tls: Option<Tls<'_>>) -> String {
    let d = dir.display();
    let (ssl, certs) = match tls {
        Some(Tls { cert: c, http2 }) => (
            // nginx 1.22 enables h2 per listen socket (`http2 on;` came in 1.25.1).
            if http2 { " ssl http2" } else { " ssl" },
            // TLS 1.3 as nginx ≥ 1.23.4 and Debian's packaged nginx.conf enable it (1.22's
            // built-in default stops at 1.2, a round trip more per handshake than any current
            // server charges); the same for HTTP/1.1 and h2, so that they compare fairly.
            format!(
                "ssl_certificate {};\n        ssl_certificate_key {};\n        \
                 ssl_protocols TLSv1.2 TLSv1.3;\n        ",
                c.cert.display(),
                c.key.display()
            ),
        ),
        None => ("", String::new()),
    };
    let prefix = prefix.trim_matches('/');
    let location = if prefix.is_empty() { "/".to_owned() } else { format!("/{prefix}/") };
    format!(
        r#"daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    default_type application/octet-stream;
    log_format ranges '$request_method $uri $status $body_bytes_sent "$http_range"';
    access_log {d}/access.log ranges;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    sendfile on;
    keepalive_requests 10000;
    server {{
        listen 127.0.0.1:{port}{ssl};
        {certs}location {location} {{
            alias {root}/;
        }}
    }}
}}
"#,
        root = root.display()
    )
}

/// nginx with the configuration `dir/nginx.conf` (errors to `dir/error.log`).
fn spawn(dir: &Path) -> Result<std::process::Child> {
    Command::new(nginx_bin())
        .arg("-p")
        .arg(dir)
        .arg("-c")
        .arg(dir.join("nginx.conf"))
        .arg("-e")
        .arg(dir.join("error.log"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("spawn {} (apt-get install nginx)", nginx_bin().display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_log_lines_and_overlaps() {
        let log = "GET /s/blobs/sha256/aa 206 10 \"bytes=0-9\"\n\
                   GET /s/blobs/sha256/aa 206 10 \"bytes=10-19\"\n\
                   GET /s/blobs/sha256/bb 200 30 \"-\"\n\
                   GET /s/blobs/sha256/bb 206 5 \"bytes=20-24\"\n\
                   GET /s/images/x.json 200 99 \"-\"\n\
                   GET /s/images/x.json 200 99 \"-\"\n\
                   GET /s/blobs/sha256/cc 206 400 \"bytes=0-9,100-109\"\n";
        let reqs = parse_access_log(log).unwrap();
        assert_eq!(reqs.len(), 7);
        assert_eq!(reqs[0].ranges, vec![(0, 9)]);
        assert_eq!(reqs[2].ranges, vec![]);
        assert_eq!(reqs[6].sent_intervals(), vec![(0, 10), (100, 110)], "a multi-range GET's ranges");
        assert_eq!(bytes_sent_twice(&reqs, "/s/blobs/"), vec![("/s/blobs/sha256/bb".to_owned(), 5)]);
        assert_eq!(bytes_sent_twice(&reqs, "/s/images/").len(), 1);
        assert!(parse_access_log("GET / x 1 \"-\"").is_err());
    }
}
