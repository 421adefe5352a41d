//! Tessera's metrics: typed handles the daemon and the store update on their hot paths, one
//! registry they are gathered from, and a Prometheus text endpoint ([`Exporter`]).
//!
//! Every handle is a `prometheus` counter, gauge or histogram resolved once, up front: updating
//! one is an atomic operation (a histogram observation a few), never a lock or a label lookup.
//! A component takes an `Arc<Metrics>` (or a clone of one group) from whoever builds it;
//! without one it uses [`Metrics::unregistered`], which counts into atomics that nobody reads.
//! Values that already live elsewhere (the memory tier's hit counters, the overlay's block map)
//! are copied in when a scrape asks for them, through [`Metrics::on_scrape`], so the hot path
//! does not pay twice. Every metric is documented in `docs/metrics.md`.
//!
//! ```
//! use tessera_metrics::{Metrics, RequestStatus, RequestType, Tier};
//! let metrics = Metrics::new();
//! let reads = metrics.requests.of(RequestType::Read);
//! reads.record(RequestStatus::Ok, 4096, std::time::Duration::from_micros(7));
//! metrics.tiers.of(Tier::Local).hit(65536, std::time::Duration::from_micros(40));
//! let text = metrics.render();
//! assert!(text.contains("tessera_requests_total{status=\"ok\",type=\"read\"} 1"));
//! ```

mod daemon;
mod exporter;
mod store;

use std::sync::{Arc, Mutex};

use prometheus::core::Collector;
use prometheus::{Encoder, Registry, TextEncoder};

pub use daemon::{
    DeviceMetrics, FetchMetrics, OverlayMetrics, RequestMetrics, RequestStatus, RequestType, TypeMetrics,
};
pub use exporter::{Exporter, ExporterError};
pub use prometheus::{Histogram, IntCounter, IntGauge};
pub use store::{
    origin_latency_histogram, DiskCacheMetrics, OriginErrorMetrics, OriginMetrics, PrefetchMetrics, Tier,
    TierMetrics, TierSet,
};

/// The content type of [`Metrics::render`]'s text (Prometheus text exposition format 0.0.4).
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Latency buckets in seconds, from 2 µs (a read served from memory) to 10 s (an origin
/// fetch with retries).
pub const LATENCY_BUCKETS: &[f64] = &[
    2e-6, 5e-6, 10e-6, 20e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3,
    250e-3, 500e-3, 1.0, 2.5, 10.0,
];

/// A callback run before each scrape.
type Refresh = Box<dyn Fn() + Send + Sync>;

/// All of Tessera's metrics, registered in one registry.
pub struct Metrics {
    registry: Registry,
    /// virtio-blk requests, by type.
    pub requests: RequestMetrics,
    /// Deferred reads and the fetch pool.
    pub fetch: FetchMetrics,
    /// The served device and image.
    pub device: DeviceMetrics,
    /// The copy-on-write overlay.
    pub overlay: OverlayMetrics,
    /// Chunk reads per tier (memory, disk cache, origin, local store).
    pub tiers: TierSet,
    /// The memory tier's size.
    pub memory_tier: store::MemoryTierMetrics,
    /// The host disk cache's size and evictions.
    pub disk_cache: DiskCacheMetrics,
    /// Requests to a remote origin.
    pub origin: OriginMetrics,
    /// Prefetch and readahead.
    pub prefetch: PrefetchMetrics,
    /// The origin request-duration histogram currently registered (a placeholder until an
    /// origin client's own is adopted).
    origin_latency: Mutex<Histogram>,
    refresh: Mutex<Vec<Refresh>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// Every metric, registered in a fresh registry.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::build())
    }

    /// Handles for a component that was given none: they count, nobody reads them.
    pub fn unregistered() -> Arc<Self> {
        Self::new()
    }

    fn build() -> Self {
        let mut r = Reg { registry: Registry::new() };
        let origin_latency = r.register(store::origin_latency_histogram());
        Self {
            requests: RequestMetrics::new(&mut r),
            fetch: FetchMetrics::new(&mut r),
            device: DeviceMetrics::new(&mut r),
            overlay: OverlayMetrics::new(&mut r),
            tiers: TierSet::new(&mut r),
            memory_tier: store::MemoryTierMetrics::new(&mut r),
            disk_cache: DiskCacheMetrics::new(&mut r),
            origin: OriginMetrics::new(&mut r),
            prefetch: PrefetchMetrics::new(&mut r),
            registry: r.registry,
            origin_latency: Mutex::new(origin_latency),
            refresh: Mutex::new(Vec::new()),
        }
    }

    /// Run `f` before every scrape, to copy values kept elsewhere into gauges or counters
    /// (see [`mirror`]). It runs on the exporter's thread; keep it short.
    pub fn on_scrape(&self, f: impl Fn() + Send + Sync + 'static) {
        self.refresh.lock().unwrap_or_else(|p| p.into_inner()).push(Box::new(f));
    }

    /// Export `h` (an origin client's own histogram, see [`origin_latency_histogram`]) as
    /// `tessera_origin_request_duration_seconds`, in place of the one exported so far: the
    /// client observes every attempt into it, before and after this call.
    pub fn adopt_origin_latency(&self, h: Histogram) {
        let mut current = self.origin_latency.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = self.registry.unregister(Box::new(current.clone())) {
            tracing::error!(
                error = &e as &dyn std::error::Error,
                "cannot unregister the origin latency histogram"
            );
        }
        if let Err(e) = self.registry.register(Box::new(h.clone())) {
            tracing::error!(
                error = &e as &dyn std::error::Error,
                "cannot register the origin latency histogram"
            );
        }
        *current = h;
    }

    /// The Prometheus text exposition of every metric (after the [`Self::on_scrape`]
    /// callbacks ran).
    pub fn render(&self) -> String {
        for f in self.refresh.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            f();
        }
        let mut out = Vec::new();
        // Encoding into a Vec fails only on a malformed family, which registration rules out.
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::warn!(error = &e as &dyn std::error::Error, "cannot encode the metrics");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

/// Bring counter `c` up to `total`, a cumulative count kept elsewhere (a counter never goes
/// down: a smaller `total` changes nothing).
pub fn mirror(c: &IntCounter, total: u64) {
    let now = c.get();
    if total > now {
        c.inc_by(total - now);
    }
}

/// Registration helper: every metric is created and registered here, so a name clash is a bug
/// found by the first unit test rather than a runtime error to handle.
pub(crate) struct Reg {
    registry: Registry,
}

impl Reg {
    fn register<C: Collector + Clone + 'static>(&mut self, c: C) -> C {
        if let Err(e) = self.registry.register(Box::new(c.clone())) {
            // Only a programming error (a duplicate name) gets here; the metric still counts.
            tracing::error!(error = &e as &dyn std::error::Error, "metric registration failed");
        }
        c
    }

    pub(crate) fn counter(&mut self, name: &str, help: &str) -> IntCounter {
        self.register(IntCounter::new(name, help).unwrap_or_else(|e| panic_bad_metric(name, e)))
    }

    pub(crate) fn gauge(&mut self, name: &str, help: &str) -> IntGauge {
        self.register(IntGauge::new(name, help).unwrap_or_else(|e| panic_bad_metric(name, e)))
    }

    pub(crate) fn counter_vec(
        &mut self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> prometheus::IntCounterVec {
        let opts = prometheus::Opts::new(name, help);
        self.register(
            prometheus::IntCounterVec::new(opts, labels).unwrap_or_else(|e| panic_bad_metric(name, e)),
        )
    }

    pub(crate) fn histogram_vec(
        &mut self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> prometheus::HistogramVec {
        let opts = prometheus::HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec());
        self.register(
            prometheus::HistogramVec::new(opts, labels).unwrap_or_else(|e| panic_bad_metric(name, e)),
        )
    }
}

/// Metric names and help texts are constants of this crate: a bad one is a bug caught by every
/// test that builds [`Metrics`].
#[track_caller]
fn panic_bad_metric(name: &str, e: prometheus::Error) -> ! {
    panic!("invalid metric definition {name}: {e}")
}

#[cfg(test)]
mod tests;
