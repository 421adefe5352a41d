//! The store's metrics: chunk reads per tier, the memory tier and disk cache sizes, origin
//! requests, prefetch.

use std::time::Duration;

use prometheus::{Histogram, IntCounter, IntGauge};

use crate::Reg;

/// Where a chunk read was served from, as a label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Decoded chunks in the daemon's memory (`--mem-cache`).
    Memory,
    /// The host disk cache (`--cache-dir`).
    DiskCache,
    /// A remote origin (HTTP store or registry).
    Origin,
    /// A local store directory (its own disk tier).
    Local,
}

impl Tier {
    /// Every tier, in label order.
    pub const ALL: [Tier; 4] = [Tier::Memory, Tier::DiskCache, Tier::Origin, Tier::Local];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            Tier::Memory => "memory",
            Tier::DiskCache => "disk_cache",
            Tier::Origin => "origin",
            Tier::Local => "local",
        }
    }
}

/// The handles of one tier.
#[derive(Clone, Debug)]
pub struct TierMetrics {
    /// Chunk reads this tier served.
    pub hits: IntCounter,
    /// Chunk lookups this tier could not serve (passed to the tier below).
    pub misses: IntCounter,
    /// Bytes this tier returned (stored bytes, i.e. compressed, for the disk tiers and the
    /// origin).
    pub bytes: IntCounter,
    /// Chunk reads that failed with an error (I/O, HTTP, verification).
    pub errors: IntCounter,
    /// Time to serve one chunk read from this tier (not observed for memory hits).
    pub latency: Histogram,
}

impl TierMetrics {
    /// A chunk read served: `bytes` returned after `latency`.
    #[inline]
    pub fn hit(&self, bytes: u64, latency: Duration) {
        self.hits.inc();
        self.bytes.inc_by(bytes);
        self.latency.observe(latency.as_secs_f64());
    }

    /// A chunk lookup this tier could not serve.
    #[inline]
    pub fn miss(&self) {
        self.misses.inc();
    }

    /// A chunk read that failed after `latency`.
    #[inline]
    pub fn error(&self, latency: Duration) {
        self.errors.inc();
        self.latency.observe(latency.as_secs_f64());
    }
}

/// Chunk reads per tier: `tessera_tier_{hits,misses,errors}_total{tier}`,
/// `tessera_tier_bytes_total{tier}`, `tessera_tier_read_duration_seconds{tier}`.
#[derive(Clone, Debug)]
pub struct TierSet {
    tiers: [TierMetrics; 4],
}

impl TierSet {
    pub(crate) fn new(r: &mut Reg) -> Self {
        let [hits, misses, bytes, errors] = [
            ("tessera_tier_hits_total", "Chunk reads served by the tier"),
            (
                "tessera_tier_misses_total",
                "Chunk lookups the tier could not serve (passed to the tier below)",
            ),
            (
                "tessera_tier_bytes_total",
                "Bytes the tier returned for chunk reads (stored bytes below the memory tier)",
            ),
            ("tessera_tier_errors_total", "Chunk reads that failed in the tier"),
        ]
        .map(|(name, help)| r.counter_vec(name, help, &["tier"]));
        let latency = r.histogram_vec(
            "tessera_tier_read_duration_seconds",
            "Time to serve one chunk read from the tier (memory hits are not timed)",
            &["tier"],
        );
        let tiers = Tier::ALL.map(|t| {
            let l = [t.label()];
            TierMetrics {
                hits: hits.with_label_values(&l),
                misses: misses.with_label_values(&l),
                bytes: bytes.with_label_values(&l),
                errors: errors.with_label_values(&l),
                latency: latency.with_label_values(&l),
            }
        });
        Self { tiers }
    }

    /// The handles of tier `t`.
    #[inline]
    pub fn of(&self, t: Tier) -> &TierMetrics {
        &self.tiers[t as usize]
    }
}

/// The memory tier's size (copied from moka at each scrape).
#[derive(Clone, Debug)]
pub struct MemoryTierMetrics {
    /// Decoded bytes held.
    pub bytes: IntGauge,
    /// The budget (`--mem-cache`).
    pub capacity_bytes: IntGauge,
    /// Chunks held.
    pub chunks: IntGauge,
    /// Chunks fetched into the memory tier (from whatever tier is below it).
    pub fills: IntCounter,
    /// Decoded bytes fetched into the memory tier.
    pub fill_bytes: IntCounter,
    /// Chunks fetched a second time because the first copy failed verification.
    pub refetches: IntCounter,
    /// Decoded checkpoint spans of a `--reference-layers` image held.
    pub span_bytes: IntGauge,
    /// Checkpoint spans of a `--reference-layers` image kept in their stored form.
    pub span_stored_bytes: IntGauge,
}

impl MemoryTierMetrics {
    pub(crate) fn new(r: &mut Reg) -> Self {
        Self {
            bytes: r.gauge("tessera_memory_tier_bytes", "Decoded chunk bytes held in the memory tier"),
            capacity_bytes: r
                .gauge("tessera_memory_tier_capacity_bytes", "Budget of the memory tier (--mem-cache)"),
            chunks: r.gauge("tessera_memory_tier_chunks", "Chunks held in the memory tier"),
            fills: r.counter(
                "tessera_memory_tier_fills_total",
                "Chunks fetched, decoded and verified into the memory tier",
            ),
            fill_bytes: r.counter(
                "tessera_memory_tier_fill_bytes_total",
                "Decoded bytes fetched into the memory tier",
            ),
            refetches: r.counter(
                "tessera_chunk_refetches_total",
                "Chunks fetched again because the first copy failed verification",
            ),
            span_bytes: r.gauge(
                "tessera_memory_span_bytes",
                "Decoded checkpoint spans of a --reference-layers image held in memory",
            ),
            span_stored_bytes: r.gauge(
                "tessera_memory_span_stored_bytes",
                "Checkpoint spans of a --reference-layers image kept compressed in memory so that none is fetched twice (at most half of --mem-cache)",
            ),
        }
    }
}

/// The host disk cache.
#[derive(Clone, Debug)]
pub struct DiskCacheMetrics {
    /// Bytes of entries in the cache directory.
    pub bytes: IntGauge,
    /// The budget (`--cache-size`; 0 when unbounded).
    pub capacity_bytes: IntGauge,
    /// Entries evicted to stay within the budget.
    pub evictions: IntCounter,
    /// Bytes evicted.
    pub evicted_bytes: IntCounter,
    /// Entries dropped because they failed verification (then refetched).
    pub corrupt: IntCounter,
    /// Entries not written because the cache's filesystem was full.
    pub full_skips: IntCounter,
    /// `serve --fill-cache`: the stored bytes the fill covers (0 until it starts, or without).
    pub fill_target_bytes: IntGauge,
    /// Of those, the bytes done so far (found in the cache, fetched, or failed).
    pub fill_done_bytes: IntGauge,
}

impl DiskCacheMetrics {
    pub(crate) fn new(r: &mut Reg) -> Self {
        Self {
            bytes: r.gauge("tessera_disk_cache_bytes", "Bytes held in the host disk cache"),
            capacity_bytes: r.gauge(
                "tessera_disk_cache_capacity_bytes",
                "Budget of the host disk cache (--cache-size; 0: unbounded)",
            ),
            evictions: r.counter("tessera_disk_cache_evictions_total", "Disk cache entries evicted"),
            evicted_bytes: r
                .counter("tessera_disk_cache_evicted_bytes_total", "Bytes evicted from the disk cache"),
            corrupt: r.counter(
                "tessera_disk_cache_corrupt_total",
                "Disk cache entries that failed verification and were dropped",
            ),
            full_skips: r.counter(
                "tessera_disk_cache_full_skips_total",
                "Disk cache writes skipped because the cache's filesystem was full",
            ),
            fill_target_bytes: r.gauge(
                "tessera_disk_cache_fill_target_bytes",
                "Stored bytes of the image the background fill (--fill-cache) covers; 0 until it starts",
            ),
            fill_done_bytes: r.gauge(
                "tessera_disk_cache_fill_done_bytes",
                "Bytes of the background fill done so far: found in the cache, fetched, or failed",
            ),
        }
    }
}

/// Requests to a remote origin (one per HTTP request, retries included). The request
/// duration histogram is the origin client's own, adopted with [`crate::Metrics::adopt_origin_latency`].
#[derive(Clone, Debug)]
pub struct OriginMetrics {
    /// HTTP requests sent (each try counts).
    pub requests: IntCounter,
    /// Requests that failed, by kind.
    pub errors: OriginErrorMetrics,
    /// Tries after a failure.
    pub retries: IntCounter,
    /// First tries given up because their response head was late, and sent again.
    pub resends: IntCounter,
    /// Body bytes received.
    pub bytes: IntCounter,
}

/// `tessera_origin_errors_total{kind}`: failed origin requests (attempts), by kind.
#[derive(Clone, Debug)]
pub struct OriginErrorMetrics {
    /// An unexpected status.
    pub status: IntCounter,
    /// Connection refused, reset or closed early; TLS or protocol errors.
    pub transport: IntCounter,
    /// A connect, first-byte, stall or whole-request timeout.
    pub timeout: IntCounter,
    /// A body or `Content-Range` that does not describe the bytes asked for.
    pub body: IntCounter,
    /// Bytes that do not match their digest.
    pub digest: IntCounter,
}

impl OriginMetrics {
    pub(crate) fn new(r: &mut Reg) -> Self {
        let errors = r.counter_vec(
            "tessera_origin_errors_total",
            "Origin requests that failed, by kind (status, transport, timeout, body, digest)",
            &["kind"],
        );
        Self {
            requests: r
                .counter("tessera_origin_requests_total", "HTTP requests sent to the origin (every try)"),
            errors: OriginErrorMetrics {
                status: errors.with_label_values(&["status"]),
                transport: errors.with_label_values(&["transport"]),
                timeout: errors.with_label_values(&["timeout"]),
                body: errors.with_label_values(&["body"]),
                digest: errors.with_label_values(&["digest"]),
            },
            retries: r.counter("tessera_origin_retries_total", "Origin requests retried after a failure"),
            resends: r.counter(
                "tessera_origin_late_resends_total",
                "Origin requests sent again because their response head was later than the origin's usual latency",
            ),
            bytes: r.counter("tessera_origin_bytes_total", "Body bytes received from the origin"),
        }
    }
}

/// Name of the origin request-duration histogram.
pub(crate) const ORIGIN_LATENCY: &str = "tessera_origin_request_duration_seconds";

/// A fresh, unregistered origin request-duration histogram (the HTTP and registry clients each
/// keep one and observe every attempt into it; the daemon adopts it into its registry).
pub fn origin_latency_histogram() -> Histogram {
    let opts = prometheus::HistogramOpts::new(ORIGIN_LATENCY, "Time per origin request (each try)")
        .buckets(crate::LATENCY_BUCKETS.to_vec());
    Histogram::with_opts(opts).unwrap_or_else(|e| crate::panic_bad_metric(ORIGIN_LATENCY, e))
}

/// Prefetch (profile-driven) and readahead: what was fetched ahead of demand, and whether a
/// demand read used it before it was evicted.
#[derive(Clone, Debug)]
pub struct PrefetchMetrics {
    /// Chunks queued for readahead (a file read sequentially).
    pub readahead_queued: IntCounter,
    /// Chunks queued as a miss's pack window (the chunks stored after it).
    pub pack_window_queued: IntCounter,
    /// Chunks queued from the image's prefetch profile.
    pub profile_queued: IntCounter,
    /// Chunks queued because their file is fetched whole (its reads missed several times).
    pub whole_file_queued: IntCounter,
    /// Chunks queued because their pack stretch is fetched whole (reads missed in several of
    /// its files).
    pub stretch_queued: IntCounter,
    /// Chunks queued because a program that missed needs the shared library they belong to.
    pub elf_deps_queued: IntCounter,
    /// Chunks fetched ahead of demand.
    pub chunks: IntCounter,
    /// Bytes fetched ahead of demand (decoded).
    pub bytes: IntCounter,
    /// Prefetched bytes a demand read used (counted at the first use).
    pub used_bytes: IntCounter,
    /// Prefetched bytes evicted before any demand read used them.
    pub wasted_bytes: IntCounter,
    /// Prefetched bytes held in memory that no demand read has used yet.
    pub unused_bytes: IntGauge,
    /// The bytes fetched ahead, used and wasted, by reason (labels `reason`: readahead,
    /// pack_window, whole_file, stretch, elf_deps, profile; `outcome`: fetched, used, wasted):
    /// which of the daemon's guesses pay for their bytes.
    pub reason_bytes: prometheus::IntCounterVec,
}

impl PrefetchMetrics {
    pub(crate) fn new(r: &mut Reg) -> Self {
        let queued = r.counter_vec(
            "tessera_prefetch_queued_chunks_total",
            "Chunks queued for fetching ahead of demand, by reason",
            &["reason"],
        );
        Self {
            readahead_queued: queued.with_label_values(&["readahead"]),
            pack_window_queued: queued.with_label_values(&["pack_window"]),
            profile_queued: queued.with_label_values(&["profile"]),
            whole_file_queued: queued.with_label_values(&["whole_file"]),
            stretch_queued: queued.with_label_values(&["stretch"]),
            elf_deps_queued: queued.with_label_values(&["elf_deps"]),
            chunks: r.counter("tessera_prefetch_chunks_total", "Chunks fetched ahead of demand"),
            bytes: r.counter("tessera_prefetch_bytes_total", "Bytes fetched ahead of demand"),
            used_bytes: r
                .counter("tessera_prefetch_used_bytes_total", "Prefetched bytes later used by a demand read"),
            wasted_bytes: r.counter(
                "tessera_prefetch_wasted_bytes_total",
                "Prefetched bytes evicted before any demand read used them",
            ),
            unused_bytes: r.gauge(
                "tessera_prefetch_unused_bytes",
                "Prefetched bytes held in memory that no demand read has used yet",
            ),
            reason_bytes: r.counter_vec(
                "tessera_prefetch_reason_bytes_total",
                "Decoded bytes fetched ahead of demand, by reason, and whether a demand read used them \
                 or they were evicted unused",
                &["reason", "outcome"],
            ),
        }
    }
}
