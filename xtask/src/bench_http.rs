//! `cargo xtask bench http`: the transport decided by numbers (issue 15, point 5). Today's
//! pooled HTTP/1.1 (ureq) against HTTP/2 (reqwest on tokio, `--http-version auto`), both through
//! the TCP-level latency proxy (`tessera_e2e::proxy`, `Proxy::start_tcp`: a connect RTT, half an
//! RTT each way for every byte, one shared link, TCP slow start) in front of nginx serving TLS
//! with h2 offered through ALPN.
//!
//! A trial issues N range reads of distinct chunk-sized ranges of one blob at once, through one
//! fresh `tessera_transport::Transport` whose concurrency limit is `--limit` (default N, so
//! neither protocol is held back by the limiter; 32 is the HTTP store's default): **cold** is
//! the first batch (connects and TLS handshakes included), **warm** a second batch of other
//! ranges on the same transport (connections open). Every byte
//! is checked against the blob. Rounds interleave the versions; medians and the spread are
//! printed, beside the link floor of the batch (its bytes at the link rate plus one RTT, plus
//! two for a cold batch: TCP and TLS).

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use tessera_e2e::cold::median;
use tessera_e2e::nginx::{Nginx, ServerCert};
use tessera_e2e::prng::Prng;
use tessera_e2e::proxy::{Proxy, ProxyConfig};
use tessera_e2e::tls::TestPki;
use tessera_transport::{HttpVersion, Method, Request, TlsOptions, Transport, TransportConfig};

use super::target_dir;

/// Options of `cargo xtask bench http`.
#[derive(Debug, Args)]
pub struct HttpBench {
    /// Round-trip time of the modelled network, in milliseconds.
    #[arg(long, default_value_t = 20)]
    pub(crate) rtt_ms: u64,
    /// Link rates to measure, in Mbit/s (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "200,1000")]
    pub(crate) mbit: Vec<u64>,
    /// Concurrent range reads per batch (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "32,128,256")]
    pub(crate) reads: Vec<usize>,
    /// Bytes of each range read, in KiB (a compressed chunk is about 30–64 KiB).
    #[arg(long, default_value_t = 64)]
    pub(crate) read_kib: u64,
    /// Rounds (each runs every version once per read count, in turn).
    #[arg(long, default_value_t = 3)]
    pub(crate) rounds: usize,
    /// The transport's concurrency limit (0: the batch's read count, so neither version is held
    /// back; 32 is the HTTP store's default).
    #[arg(long, default_value_t = 0)]
    pub(crate) limit: usize,
    /// Do not model TCP slow start (every connection sends at the link rate from its first
    /// byte).
    #[arg(long)]
    pub(crate) no_slow_start: bool,
}

/// Bytes of the blob the reads are drawn from.
const BLOB: u64 = 256 << 20;

/// The versions compared, in the order each round runs them.
const VERSIONS: [(&str, HttpVersion); 2] =
    [("HTTP/1.1", HttpVersion::Http1), ("HTTP/2", HttpVersion::Negotiate)];

/// One batch's result.
#[derive(Debug, Clone, Copy)]
struct Batch {
    secs: f64,
    connections: u64,
}

pub fn run(opts: &HttpBench) -> Result<()> {
    let work = target_dir()?.join("bench-http");
    let root = work.join("root");
    std::fs::create_dir_all(&root)?;
    let blob_path = root.join("blob");
    let blob = Prng::from_label("bench-http").bytes(BLOB as usize);
    std::fs::write(&blob_path, &blob)?;
    let pki = TestPki::generate(&work.join("pki"), "bench-http", &[])?;
    let nginx = Nginx::serve_tls_h2(&root, "s", ServerCert { cert: &pki.cert, key: &pki.key })?;
    let ca = TlsOptions::default().with_ca_pem(&std::fs::read(&pki.ca)?)?;
    let rtt = Duration::from_millis(opts.rtt_ms);
    let read = opts.read_kib << 10;
    ensure!(read > 0, "--read-kib must be at least 1");
    for &mbit in &opts.mbit {
        let rate = mbit * 1_000_000 / 8;
        let cfg = ProxyConfig { rtt, bandwidth: Some(rate), slow_start: !opts.no_slow_start };
        let proxy = Proxy::start_tcp(nginx.addr(), cfg)?;
        let url = format!("{}/blob", proxy.https_url("s"));
        // results[n][version] = (cold, warm) batches of every round.
        let mut results = vec![vec![(Vec::new(), Vec::new()); VERSIONS.len()]; opts.reads.len()];
        let mut rng = Prng::from_label("bench-http-offsets");
        for round in 0..opts.rounds {
            for (i, &n) in opts.reads.iter().enumerate() {
                for (v, &(name, version)) in VERSIONS.iter().enumerate() {
                    let config = TransportConfig {
                        max_concurrency: if opts.limit == 0 { n } else { opts.limit },
                        tls: ca.clone(),
                        http: version,
                        ..TransportConfig::default()
                    };
                    let transport = Transport::new(config);
                    let mut batch = |what: &str| -> Result<Batch> {
                        let offsets = offsets(&mut rng, n, read);
                        let before = proxy.stats().connections;
                        let secs = batch(&transport, &url, &offsets, read, &blob)?;
                        let connections = proxy.stats().connections - before;
                        println!(
                            "round {round} {mbit} Mbit/s {n:>3} reads {name:<8} {what}: {:7.1} ms, {connections} new connections",
                            secs * 1e3
                        );
                        Ok(Batch { secs, connections })
                    };
                    let cold = batch("cold")?;
                    let warm = batch("warm")?;
                    results[i][v].0.push(cold);
                    results[i][v].1.push(warm);
                }
            }
        }
        print_table(opts, mbit, rtt, read, &results);
    }
    Ok(())
}

/// `n` distinct, `len`-aligned offsets in the blob.
fn offsets(rng: &mut Prng, n: usize, len: u64) -> Vec<u64> {
    let slots = BLOB / len;
    let mut picked = std::collections::BTreeSet::new();
    while picked.len() < n.min(slots as usize) {
        picked.insert(rng.below(slots) * len);
    }
    let mut v: Vec<u64> = picked.into_iter().collect();
    // Issue them in no particular order, as a guest's misses come.
    for i in (1..v.len()).rev() {
        v.swap(i, rng.below(i as u64 + 1) as usize);
    }
    v
}

/// Read every range of `offsets` at once (one thread each, released together); seconds until
/// the last one's bytes were read and checked.
fn batch(transport: &Transport, url: &str, offsets: &[u64], len: u64, blob: &[u8]) -> Result<f64> {
    let start = Arc::new(Barrier::new(offsets.len() + 1));
    let (results, elapsed): (Vec<Result<()>>, Duration) = std::thread::scope(|s| {
        let handles: Vec<_> = offsets
            .iter()
            .map(|&at| {
                let start = Arc::clone(&start);
                s.spawn(move || {
                    start.wait();
                    read_range(transport, url, at, len, blob)
                })
            })
            .collect();
        start.wait();
        let t = Instant::now();
        let r = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a reader panicked"))))
            .collect();
        (r, t.elapsed())
    });
    for r in results {
        r?;
    }
    Ok(elapsed.as_secs_f64())
}

fn read_range(transport: &Transport, url: &str, at: u64, len: u64, blob: &[u8]) -> Result<()> {
    let range = format!("bytes={}-{}", at, at + len - 1);
    let headers = [("Range", range.as_str())];
    let req = Request { headers: &headers, ..Request::new(Method::Get, url) };
    let mut resp = transport.send(&req).with_context(|| format!("GET {url} {range}"))?;
    ensure!(resp.status() == 206, "GET {url} {range}: HTTP {}", resp.status());
    let body = resp
        .read_to_vec(len)
        .with_context(|| format!("reading {range}"))?
        .with_context(|| format!("{range}: longer than asked"))?;
    let want = &blob[at as usize..(at + len) as usize];
    if body != want {
        bail!("{range}: {} bytes that differ from the blob", body.len());
    }
    Ok(())
}

fn print_table(
    opts: &HttpBench,
    mbit: u64,
    rtt: Duration,
    read: u64,
    results: &[Vec<(Vec<Batch>, Vec<Batch>)>],
) {
    let ms = |v: &[Batch]| {
        let s: Vec<f64> = v.iter().map(|b| b.secs * 1e3).collect();
        let lo = s.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = s.iter().copied().fold(0.0, f64::max);
        (median(s), lo, hi)
    };
    let rate = (mbit * 1_000_000 / 8) as f64;
    println!(
        "\n== bench http: {} ms RTT, {mbit} Mbit/s, TCP slow start {}; {} KiB ranges; concurrency limit {}; medians of {} rounds (min–max); h2/h1 < 1: HTTP/2 faster",
        rtt.as_millis(),
        if opts.no_slow_start { "off" } else { "on" },
        read >> 10,
        if opts.limit == 0 { "= reads".to_owned() } else { opts.limit.to_string() },
        opts.rounds
    );
    println!(
        "| reads | batch | floor ms | HTTP/1.1 ms | conns | HTTP/2 ms | conns | h2/h1 |\n|---|---|---|---|---|---|---|---|"
    );
    for (i, &n) in opts.reads.iter().enumerate() {
        for (what, pick, rtts) in [("cold", 0usize, 3u32), ("warm", 1, 1)] {
            let floor = (n as u64 * read) as f64 / rate * 1e3 + (rtt * rtts).as_secs_f64() * 1e3;
            let get = |v: usize| if pick == 0 { &results[i][v].0 } else { &results[i][v].1 };
            let (h1, h1lo, h1hi) = ms(get(0));
            let (h2, h2lo, h2hi) = ms(get(1));
            let conns = |v: usize| median(get(v).iter().map(|b| b.connections as f64).collect());
            println!(
                "| {n} | {what} | {floor:.0} | {h1:.0} ({h1lo:.0}–{h1hi:.0}) | {:.0} | {h2:.0} ({h2lo:.0}–{h2hi:.0}) | {:.0} | {:.2} |",
                conns(0),
                conns(1),
                h2 / h1
            );
        }
    }
}
