//! Counters of a [`crate::Client`]'s requests to the registry, for the daemon's
//! `tessera_origin_*` metrics: every try, retries, body bytes of blobs and manifests, and
//! failed tries by kind.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

/// A snapshot of [`crate::Client::stats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TransferStats {
    /// HTTP requests sent (each try; the scheme probe's failed TLS try excluded).
    pub requests: u64,
    /// Tries after a failure (a retried request, a resumed or re-read blob body).
    pub retries: u64,
    /// Body bytes of blobs, blob ranges and manifests received.
    pub bytes: u64,
    /// Failed tries: a retryable status (5xx, 429, 408), retried or final.
    pub status_errors: u64,
    /// Failed tries: connection refused, reset or closed early.
    pub transport_errors: u64,
    /// Failed tries: a timeout.
    pub timeout_errors: u64,
    /// Failed tries: a body of the wrong size.
    pub body_errors: u64,
    /// Failed tries: a blob whose bytes do not hash to its digest.
    pub digest_errors: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    requests: AtomicU64,
    retries: AtomicU64,
    bytes: AtomicU64,
    status: AtomicU64,
    transport: AtomicU64,
    timeout: AtomicU64,
    body: AtomicU64,
    digest: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl Counters {
    pub(crate) fn request(&self) {
        add(&self.requests, 1);
    }

    pub(crate) fn retry(&self) {
        add(&self.retries, 1);
    }

    pub(crate) fn bytes(&self, n: usize) {
        add(&self.bytes, n as u64);
    }

    pub(crate) fn status_error(&self) {
        add(&self.status, 1);
    }

    pub(crate) fn body_error(&self) {
        add(&self.body, 1);
    }

    pub(crate) fn digest_error(&self) {
        add(&self.digest, 1);
    }

    /// A failed exchange or body read: a timeout or another transport failure.
    pub(crate) fn transport_error(&self, e: &ureq::Error) {
        let timed_out = match e {
            ureq::Error::Timeout(_) => true,
            ureq::Error::Io(io) => io.kind() == io::ErrorKind::TimedOut,
            _ => false,
        };
        add(if timed_out { &self.timeout } else { &self.transport }, 1);
    }

    /// A body read that broke.
    pub(crate) fn read_error(&self, e: &io::Error) {
        add(if e.kind() == io::ErrorKind::TimedOut { &self.timeout } else { &self.transport }, 1);
    }

    pub(crate) fn snapshot(&self) -> TransferStats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TransferStats {
            requests: g(&self.requests),
            retries: g(&self.retries),
            bytes: g(&self.bytes),
            status_errors: g(&self.status),
            transport_errors: g(&self.transport),
            timeout_errors: g(&self.timeout),
            body_errors: g(&self.body),
            digest_errors: g(&self.digest),
        }
    }
}
