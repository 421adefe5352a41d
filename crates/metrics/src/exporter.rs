//! The `/metrics` endpoint: one thread, one connection at a time, HTTP/1.x, `Connection:
//! close`. A scrape is rare (seconds apart) and small, so nothing here needs a runtime.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tracing::{debug, warn};

use crate::{Metrics, CONTENT_TYPE};

/// Longest request head accepted.
const MAX_HEAD: usize = 8 << 10;
/// A client that sends or reads nothing for this long is dropped.
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the endpoint could not start.
#[derive(Debug, thiserror::Error)]
pub enum ExporterError {
    #[error("metrics address {addr:?}")]
    Bind { addr: String, source: std::io::Error },
    #[error("starting the metrics thread")]
    Thread(#[source] std::io::Error),
}

/// Serves [`Metrics::render`] at `http://ADDR/metrics` on its own thread until dropped.
#[derive(Debug)]
pub struct Exporter {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Exporter {
    /// Listen on `addr` (`HOST:PORT`; port 0 picks a free one, see [`Self::local_addr`]).
    pub fn start(addr: &str, metrics: Arc<Metrics>) -> Result<Self, ExporterError> {
        let bind_err = |source| ExporterError::Bind { addr: addr.to_owned(), source };
        let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(bind_err)?.collect();
        let listener = TcpListener::bind(&addrs[..]).map_err(bind_err)?;
        let local = listener.local_addr().map_err(bind_err)?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("tessera-metrics".to_owned())
                .spawn(move || accept_loop(&listener, &metrics, &stop))
                .map_err(ExporterError::Thread)?
        };
        Ok(Self { addr: local, stop, thread: Some(thread) })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The scrape URL.
    pub fn url(&self) -> String {
        format!("http://{}/metrics", self.addr)
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept with a connection of our own.
        let _ = TcpStream::connect_timeout(&self.addr, IO_TIMEOUT);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                warn!("the metrics thread panicked");
            }
        }
    }
}

fn accept_loop(listener: &TcpListener, metrics: &Metrics, stop: &AtomicBool) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        match conn {
            Ok(stream) => {
                if let Err(e) = answer(stream, metrics) {
                    debug!(error = &e as &dyn std::error::Error, "metrics client");
                }
            }
            Err(e) => {
                warn!(error = &e as &dyn std::error::Error, "accepting a metrics client");
                // EMFILE and the like: do not spin.
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Read one request head and answer it.
fn answer(mut stream: TcpStream, metrics: &Metrics) -> std::io::Result<()> {
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    let route = loop {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&head) {
            Ok(httparse::Status::Complete(_)) => break route(req.method, req.path),
            Ok(httparse::Status::Partial) if head.len() < MAX_HEAD => continue,
            Ok(httparse::Status::Partial) => break Route::Bad("request head too long\n"),
            Err(_) => break Route::Bad("malformed request\n"),
        }
    };
    let (status, content_type, body, head_only) = match route {
        Route::Metrics { head_only } => ("200 OK", CONTENT_TYPE, metrics.render(), head_only),
        Route::NotFound => ("404 Not Found", "text/plain", "try /metrics\n".to_owned(), false),
        Route::Method => ("405 Method Not Allowed", "text/plain", "GET or HEAD\n".to_owned(), false),
        Route::Bad(why) => ("400 Bad Request", "text/plain", why.to_owned(), false),
    };
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body.as_bytes());
    }
    stream.write_all(&out)?;
    stream.flush()
}

enum Route {
    Metrics { head_only: bool },
    NotFound,
    Method,
    Bad(&'static str),
}

fn route(method: Option<&str>, path: Option<&str>) -> Route {
    let path = path.unwrap_or("");
    let path = path.split_once('?').map_or(path, |(p, _)| p);
    if path != "/metrics" {
        return Route::NotFound;
    }
    match method {
        Some("GET") => Route::Metrics { head_only: false },
        Some("HEAD") => Route::Metrics { head_only: true },
        _ => Route::Method,
    }
}
