//! The counters of a [`crate::Transport`] and the limiter of requests in flight.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};

use crate::error::ErrorKind;

/// Requests of one [`crate::Transport`] so far, for tests and the daemon's `tessera_origin_*`
/// metrics. The same meaning for every origin kind (HTTP store, registry).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stats {
    /// Attempts sent (retries included; a registry's scheme probe excluded).
    pub requests: u64,
    /// Attempts after a failure (a retried request, a resumed blob body).
    pub retries: u64,
    /// Response body bytes received (every body read through the transport).
    pub bytes: u64,
    /// Attempts that failed, by kind (each failed attempt counts once, retried or not).
    pub errors: ErrorCounts,
    /// Requests given a single attempt because the origin was failing
    /// ([`crate::RetryPolicy::failing_after`]).
    pub single_attempts: u64,
    /// First attempts given up because their response head was late, and sent again
    /// ([`crate::RetryPolicy::resend_late`]; each resend also counts in `requests` and `retries`,
    /// not in `errors`).
    pub resends: u64,
}

/// Failed attempts by kind (see [`ErrorKind`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ErrorCounts {
    pub status: u64,
    pub transport: u64,
    pub timeout: u64,
    pub body: u64,
    pub digest: u64,
}

impl ErrorCounts {
    /// Every kind.
    pub fn total(&self) -> u64 {
        self.status + self.transport + self.timeout + self.body + self.digest
    }

    /// The count of `kind`.
    pub fn of(&self, kind: ErrorKind) -> u64 {
        match kind {
            ErrorKind::Status => self.status,
            ErrorKind::Transport => self.transport,
            ErrorKind::Timeout => self.timeout,
            ErrorKind::Body => self.body,
            ErrorKind::Digest => self.digest,
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    requests: AtomicU64,
    retries: AtomicU64,
    bytes: AtomicU64,
    errors: [AtomicU64; 5],
    single_attempts: AtomicU64,
    resends: AtomicU64,
}

impl Counters {
    pub(crate) fn request(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn retry(&self) {
        self.retries.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn single_attempt(&self) {
        self.single_attempts.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn resend(&self) {
        self.resends.fetch_add(1, Ordering::Relaxed);
        self.retry();
    }

    pub(crate) fn bytes(&self, n: usize) {
        self.bytes.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn error(&self, kind: ErrorKind) {
        self.errors[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> Stats {
        let e = |k: ErrorKind| self.errors[k as usize].load(Ordering::Relaxed);
        Stats {
            requests: self.requests.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            errors: ErrorCounts {
                status: e(ErrorKind::Status),
                transport: e(ErrorKind::Transport),
                timeout: e(ErrorKind::Timeout),
                body: e(ErrorKind::Body),
                digest: e(ErrorKind::Digest),
            },
            single_attempts: self.single_attempts.load(Ordering::Relaxed),
            resends: self.resends.load(Ordering::Relaxed),
        }
    }
}

/// Counts requests in flight and makes callers wait above the limit.
#[derive(Debug)]
pub(crate) struct Limiter {
    max: usize,
    in_flight: Mutex<usize>,
    freed: Condvar,
}

impl Limiter {
    pub(crate) fn new(max: usize) -> Self {
        Self { max: max.max(1), in_flight: Mutex::new(0), freed: Condvar::new() }
    }

    /// Wait for a free slot and take it (give it back with [`Self::release`]).
    pub(crate) fn acquire(&self) {
        let mut n = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        while *n >= self.max {
            n = self.freed.wait(n).unwrap_or_else(|p| p.into_inner());
        }
        *n += 1;
    }

    pub(crate) fn release(&self) {
        let mut n = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        *n = n.saturating_sub(1);
        self.freed.notify_one();
    }

    pub(crate) fn in_flight(&self) -> usize {
        *self.in_flight.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_limiter_bounds_requests_in_flight() {
        let limiter = Limiter::new(3);
        let peak = AtomicU64::new(0);
        let now = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..12 {
                s.spawn(|| {
                    limiter.acquire();
                    let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(n, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(20));
                    now.fetch_sub(1, Ordering::SeqCst);
                    limiter.release();
                });
            }
        });
        assert_eq!(peak.load(Ordering::SeqCst), 3);
        assert_eq!(limiter.in_flight(), 0);
    }

    #[test]
    fn counts_by_kind() {
        let c = Counters::default();
        c.request();
        c.request();
        c.retry();
        c.bytes(10);
        c.error(ErrorKind::Digest);
        c.error(ErrorKind::Status);
        let s = c.snapshot();
        assert_eq!((s.requests, s.retries, s.bytes), (2, 1, 10));
        assert_eq!((s.errors.digest, s.errors.status, s.errors.total()), (1, 1, 2));
        assert_eq!(s.errors.of(ErrorKind::Digest), 1);
    }
}
