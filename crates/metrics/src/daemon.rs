//! The daemon's metrics: virtio-blk requests, the fetch pool, the device and the overlay.

use std::time::Duration;

use prometheus::{Histogram, IntCounter, IntGauge};

use crate::Reg;

/// A virtio-blk request type, as a label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestType {
    Read,
    Write,
    Flush,
    Discard,
    WriteZeroes,
    GetId,
    /// A type code the device does not implement (answered `VIRTIO_BLK_S_UNSUPP`).
    Unsupported,
    /// A chain refused before its type was accepted (malformed header, buffers, lengths or
    /// descriptor order), or dropped without a status byte.
    Invalid,
}

impl RequestType {
    /// Every type, in label order.
    pub const ALL: [RequestType; 8] = [
        RequestType::Read,
        RequestType::Write,
        RequestType::Flush,
        RequestType::Discard,
        RequestType::WriteZeroes,
        RequestType::GetId,
        RequestType::Unsupported,
        RequestType::Invalid,
    ];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            RequestType::Read => "read",
            RequestType::Write => "write",
            RequestType::Flush => "flush",
            RequestType::Discard => "discard",
            RequestType::WriteZeroes => "write_zeroes",
            RequestType::GetId => "get_id",
            RequestType::Unsupported => "unsupported",
            RequestType::Invalid => "invalid",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// How a request ended, as a label: the virtio status written, or `dropped` (no status byte
/// could be written; the chain went back with a used length of 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestStatus {
    Ok,
    IoErr,
    Unsupp,
    Dropped,
}

impl RequestStatus {
    /// Every status, in label order.
    pub const ALL: [RequestStatus; 4] =
        [RequestStatus::Ok, RequestStatus::IoErr, RequestStatus::Unsupp, RequestStatus::Dropped];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            RequestStatus::Ok => "ok",
            RequestStatus::IoErr => "ioerr",
            RequestStatus::Unsupp => "unsupp",
            RequestStatus::Dropped => "dropped",
        }
    }
}

/// The handles of one request type.
#[derive(Clone, Debug)]
pub struct TypeMetrics {
    by_status: [IntCounter; 4],
    bytes: IntCounter,
    latency: Histogram,
}

impl TypeMetrics {
    /// One finished request: `bytes` counts only if it succeeded; `latency` from the moment
    /// the device took the chain off the ring to its completion.
    #[inline]
    pub fn record(&self, status: RequestStatus, bytes: u64, latency: Duration) {
        self.by_status[status as usize].inc();
        if status == RequestStatus::Ok && bytes > 0 {
            self.bytes.inc_by(bytes);
        }
        self.latency.observe(latency.as_secs_f64());
    }

    /// Requests of this type that ended with `status` so far.
    pub fn count(&self, status: RequestStatus) -> u64 {
        self.by_status[status as usize].get()
    }

    /// Bytes moved by the successful requests of this type so far.
    pub fn bytes(&self) -> u64 {
        self.bytes.get()
    }
}

/// virtio-blk requests: `tessera_requests_total{type,status}`,
/// `tessera_request_bytes_total{type}`, `tessera_request_duration_seconds{type}`,
/// `tessera_requests_in_flight`, `tessera_early_signals_total`, `tessera_early_signal_pauses_total`.
#[derive(Clone, Debug)]
pub struct RequestMetrics {
    types: [TypeMetrics; 8],
    /// Requests taken off a ring and not completed yet.
    pub in_flight: IntGauge,
    /// Signals sent to a driver before its ring was drained (`tessera_vhost::notify`).
    pub early_signals: IntCounter,
    /// Times a queue paused early signals because two in a row preempted its worker.
    pub early_signal_pauses: IntCounter,
}

impl RequestMetrics {
    pub(crate) fn new(r: &mut Reg) -> Self {
        let total = r.counter_vec(
            "tessera_requests_total",
            "virtio-blk requests completed, by type and status",
            &["type", "status"],
        );
        let bytes = r.counter_vec(
            "tessera_request_bytes_total",
            "Bytes moved by successful requests (read/write: data; discard/write_zeroes: range; get_id: serial)",
            &["type"],
        );
        let latency = r.histogram_vec(
            "tessera_request_duration_seconds",
            "Time from taking a request off the ring to completing it",
            &["type"],
        );
        let types = RequestType::ALL.map(|t| TypeMetrics {
            by_status: RequestStatus::ALL.map(|s| total.with_label_values(&[t.label(), s.label()])),
            bytes: bytes.with_label_values(&[t.label()]),
            latency: latency.with_label_values(&[t.label()]),
        });
        let in_flight =
            r.gauge("tessera_requests_in_flight", "Requests taken off a ring and not completed yet");
        let early_signals = r.counter(
            "tessera_early_signals_total",
            "Signals sent to a driver before its ring was drained, as it was about to run dry",
        );
        let early_signal_pauses = r.counter(
            "tessera_early_signal_pauses_total",
            "Times a queue paused early signals for a second because two in a row preempted its worker (the driver shares its CPU)",
        );
        Self { types, in_flight, early_signals, early_signal_pauses }
    }

    /// The handles of type `t`.
    #[inline]
    pub fn of(&self, t: RequestType) -> &TypeMetrics {
        &self.types[t.index()]
    }
}

/// Reads missing the memory tier and the chunk fetcher behind them.
#[derive(Clone, Debug)]
pub struct FetchMetrics {
    /// Reads deferred until their chunks were fetched (they complete out of order).
    pub deferred_reads: IntCounter,
    /// Chunk fetches queued or running.
    pub queue_depth: IntGauge,
    /// Fetch threads started.
    pub threads: IntGauge,
    /// Chunk fetches run for guest reads.
    pub demand_fetches: IntCounter,
    /// Chunk fetches run ahead of demand (readahead, profile prefetch).
    pub background_fetches: IntCounter,
    /// Requests for a chunk already queued or being fetched (single flight).
    pub joined: IntCounter,
    /// Demand requests for a chunk a background fetch had already started.
    pub behind_background: IntCounter,
    /// Requests for a chunk that had just failed for a reason of its own, failed at once.
    pub remembered_failures: IntCounter,
}

impl FetchMetrics {
    pub(crate) fn new(r: &mut Reg) -> Self {
        let fetches = r.counter_vec(
            "tessera_chunk_fetches_total",
            "Chunk fetches run by the fetcher, by priority",
            &["priority"],
        );
        Self {
            deferred_reads: r.counter(
                "tessera_deferred_reads_total",
                "Reads that missed the memory tier and completed once their chunks were fetched",
            ),
            queue_depth: r.gauge("tessera_fetch_queue_depth", "Chunk fetches queued or running"),
            threads: r.gauge(
                "tessera_fetch_threads",
                "Fetch threads started (they start as work needs them, up to --fetch-jobs)",
            ),
            demand_fetches: fetches.with_label_values(&["demand"]),
            background_fetches: fetches.with_label_values(&["background"]),
            joined: r.counter(
                "tessera_fetch_joined_total",
                "Requests for a chunk already queued or being fetched (single flight)",
            ),
            behind_background: r.counter(
                "tessera_fetch_behind_background_total",
                "Demand requests for a chunk a readahead or prefetch fetch had already started",
            ),
            remembered_failures: r.counter(
                "tessera_fetch_remembered_failures_total",
                "Requests for a chunk whose fetch had just failed for a reason of its own (corrupt at the origin, missing), failed at once without a fetch",
            ),
        }
    }
}

/// The device and the image behind it (set once at start).
#[derive(Clone, Debug)]
pub struct DeviceMetrics {
    /// Capacity of the device.
    pub device_bytes: IntGauge,
    /// Decoded bytes of all the image's chunks (the file data).
    pub image_chunk_bytes: IntGauge,
    /// Chunks of the image.
    pub image_chunks: IntGauge,
    /// Bytes of the image's ext4 metadata prefix (served from memory).
    pub image_prefix_bytes: IntGauge,
    /// Clients (VMM connections) served so far.
    pub connections: IntCounter,
}

impl DeviceMetrics {
    pub(crate) fn new(r: &mut Reg) -> Self {
        Self {
            device_bytes: r.gauge("tessera_device_bytes", "Capacity of the served device in bytes"),
            image_chunk_bytes: r.gauge("tessera_image_chunk_bytes", "Decoded bytes of the image's chunks"),
            image_chunks: r.gauge("tessera_image_chunks", "Chunks of the image"),
            image_prefix_bytes: r.gauge("tessera_image_prefix_bytes", "Bytes of the image's metadata prefix"),
            connections: r.counter("tessera_connections_total", "VMM connections accepted"),
        }
    }
}

/// The copy-on-write overlay (copied from its block map at each scrape).
#[derive(Clone, Debug)]
pub struct OverlayMetrics {
    /// Device blocks whose data lives in the overlay.
    pub written_blocks: IntGauge,
    /// Device blocks that read as zeros (DISCARD, WRITE_ZEROES).
    pub zero_blocks: IntGauge,
    /// Size of the overlay file in bytes (slots, header and log included).
    pub file_bytes: IntGauge,
    /// FLUSHes that synced something (one `fdatasync` each).
    pub syncs: IntCounter,
}

impl OverlayMetrics {
    pub(crate) fn new(r: &mut Reg) -> Self {
        Self {
            written_blocks: r.gauge("tessera_overlay_written_blocks", "Device blocks held in the overlay"),
            zero_blocks: r
                .gauge("tessera_overlay_zero_blocks", "Device blocks reading as zeros in the overlay"),
            file_bytes: r.gauge("tessera_overlay_file_bytes", "Size of the overlay file in bytes"),
            syncs: r.counter(
                "tessera_overlay_syncs_total",
                "FLUSHes that synced the overlay (one fdatasync each)",
            ),
        }
    }
}
