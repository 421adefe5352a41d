//! One cold run (issue 15, point 4): `tessera serve` from an origin behind the latency proxy with
//! nothing local, a request trace replayed against it, and what the run cost against the link
//! floor ([`crate::floor`]). Used by `cargo xtask bench cold` and `cargo xtask bench lazy`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tessera_image::RequestTrace;

use crate::floor::{Breakdown, FetchCounts, Floor, Link, StoreImage};
use crate::pin::Placement;
use crate::proxy::Proxy;
use crate::replay::{self, ReplayOptions, ReplayReport};

/// What to run.
#[derive(Debug, Clone)]
pub struct ColdRun<'a> {
    /// The `tessera` binary.
    pub bin: &'a Path,
    /// The store URL (through the proxy).
    pub store_url: String,
    /// The image reference given to `tessera serve`.
    pub image: &'a str,
    /// Extra `tessera serve` arguments.
    pub serve_args: &'a [String],
    /// The socket path (removed first).
    pub socket: PathBuf,
    /// The raw export every byte read is checked against, if any.
    pub raw: Option<PathBuf>,
    /// The daemon on one CPU, the replay on another ([`crate::pin`]); `None`: unpinned.
    pub placement: Option<Placement>,
}

/// What one cold run did.
#[derive(Debug, Clone)]
pub struct ColdResult {
    pub replay: ReplayReport,
    pub breakdown: Breakdown,
    /// The proxy's log of this run's requests, in the order they came.
    pub requests: Vec<crate::proxy::LoggedRequest>,
    /// When the daemon was spawned (the requests' times are read against it).
    pub spawned: Instant,
}

impl ColdRun<'_> {
    /// Start the daemon (fresh: no cache dir), replay `trace` once it is ready, stop it; the
    /// breakdown from `proxy`'s log of this run.
    pub fn run(
        &self,
        trace: &RequestTrace,
        proxy: &Proxy,
        image: &StoreImage,
        link: Link,
    ) -> Result<ColdResult> {
        let floor: Floor = image.floor(trace, link)?;
        let _ = std::fs::remove_file(&self.socket);
        let logged = proxy.log().len();
        let mut cmd = crate::pin::daemon_command(self.placement, self.bin);
        cmd.args(["serve", self.image, "--store", &self.store_url, "--socket"])
            .arg(&self.socket)
            .arg("--read-only")
            .args(self.serve_args)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        let spawned = Instant::now();
        let (mut child, metrics) = crate::metrics::spawn_with_metrics(&mut cmd)?;
        let ready = Instant::now();
        let replay =
            || replay::replay(trace, &self.socket, &ReplayOptions { raw: self.raw.clone(), writes: false });
        let result = match self.placement {
            Some(p) => p.on_client(replay).and_then(|r| r),
            None => replay(),
        };
        let end = Instant::now();
        // Background fetches (readahead, whole files, stretches) may still be running or queued:
        // they are the run's origin bytes too, so the daemon is stopped only once it is idle.
        let idle = wait_idle(&metrics, Duration::from_secs(30));
        let counts = fetch_counts(&metrics).ok();
        let _ = child.kill();
        let _ = child.wait();
        let report = result.context("replaying the trace")?;
        if let Err(e) = idle {
            eprintln!("cold run: origin bytes may be undercounted: {e:#}");
        }
        // The proxy logs a request's end once it has relayed the last byte, a moment after the
        // daemon had it.
        std::thread::sleep(Duration::from_millis(50)); // settling time, not a synchronization
        let log: Vec<_> = proxy.log().into_iter().skip(logged).collect();
        let breakdown = Breakdown::of(|p| image.classify(p), &log, spawned, ready, end, floor, counts);
        Ok(ColdResult { replay: report, breakdown, requests: log, spawned })
    }
}

/// Poll the daemon's metrics at `metrics` until no chunk fetch is queued or running (at most
/// `limit`).
fn wait_idle(metrics: &str, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let depth = crate::metrics::scrape(metrics)?.value("tessera_fetch_queue_depth", &[])?;
        if depth == 0.0 {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "{depth} fetches still queued or running after {limit:?}");
        std::thread::sleep(Duration::from_millis(10)); // polling interval
    }
}

/// The daemon's fetch counters.
pub fn fetch_counts(metrics: &str) -> Result<FetchCounts> {
    let m = crate::metrics::scrape(metrics)?;
    let get = |name: &str, labels: &[(&str, &str)]| m.sum(name, labels) as u64;
    Ok(FetchCounts {
        demand: get("tessera_chunk_fetches_total", &[("priority", "demand")]),
        background: get("tessera_chunk_fetches_total", &[("priority", "background")]),
        joined: get("tessera_fetch_joined_total", &[]),
        behind_background: get("tessera_fetch_behind_background_total", &[]),
        prefetch_unused_bytes: get("tessera_prefetch_unused_bytes", &[]),
        ahead: crate::floor::AHEAD_REASONS.map(|why| {
            let bytes = |outcome| {
                get("tessera_prefetch_reason_bytes_total", &[("reason", why), ("outcome", outcome)])
            };
            (bytes("fetched"), bytes("used"))
        }),
    })
}

/// The median of `v` (the mean of the middle two for an even count); zero when empty.
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}
