//! Adaptive busy-polling of a queue (`tessera serve --poll-us`), free of I/O.
//!
//! After a queue worker has drained its ring it may keep looking at the avail ring and its
//! completion list for a while before it re-enables notifications and sleeps: a request that
//! arrives in that window costs neither the driver's kick (an eventfd write) nor the worker's
//! wake-up (an epoll return, often on a CPU that had gone idle). Polling is only worth its CPU
//! time when requests do arrive inside the window, so the window adapts as QEMU's event loop
//! does (`poll-max-ns`, `poll-grow`, `poll-shrink` of its iothreads):
//!
//! - a wait that ended within the window (the poll found work, or would have): keep it;
//! - a wait longer than the window but within the maximum: polling a little longer would have
//!   paid, so grow the window (from [`GROW_FROM_NS`], doubling, up to the maximum);
//! - a wait longer than the maximum: the queue is idle, polling only burns CPU, so halve the
//!   window (to nothing once it drops under [`GROW_FROM_NS`]).
//!
//! A window of 0 (or a maximum of 0: `--poll-us 0`) never polls: the worker sleeps as soon as
//! the ring is empty, as it did before polling existed.

use std::time::Duration;

/// The first window a queue that has not been polling grows to.
pub const GROW_FROM_NS: u64 = 4_000;

/// `--poll-us` unless told otherwise: 200 µs. A wait that ended in a wake-up includes the
/// wake-up's own latency, so a maximum below the machine's cross-CPU wake-up time keeps a queue
/// whose driver runs on another CPU from ever growing its window (each measured wait exceeds the
/// maximum): on the project's nested-virtualisation machine a wake-up takes ~70 µs, and with a
/// 50 µs maximum one queue at QD1 stayed at 13 k IOPS (p50 89 µs) where 100–400 µs gave
/// 34–41 k (p50 23–29 µs). An idle queue still closes its window after one wait.
pub const DEFAULT_POLL_US: u64 = 200;

/// One queue's poll window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PollWindow {
    max_ns: u64,
    ns: u64,
}

impl PollWindow {
    /// A window that adapts up to `max` (zero: never poll). It starts closed and opens once
    /// waits show that polling would have caught the next request.
    pub fn new(max: Duration) -> Self {
        Self { max_ns: u64::try_from(max.as_nanos()).unwrap_or(u64::MAX), ns: 0 }
    }

    /// How long to poll now.
    pub fn current(&self) -> Duration {
        Duration::from_nanos(self.ns)
    }

    /// The maximum window.
    pub fn max(&self) -> Duration {
        Duration::from_nanos(self.max_ns)
    }

    /// The worker waited `waited` from the start of its last poll window (or, with a closed
    /// window, from when it went to sleep) until work arrived: adapt the window.
    pub fn waited(&mut self, waited: Duration) {
        let waited = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
        if self.max_ns == 0 || waited <= self.ns {
            return;
        }
        if waited > self.max_ns {
            self.ns /= 2;
            if self.ns < GROW_FROM_NS {
                self.ns = 0;
            }
        } else {
            self.ns = if self.ns == 0 { GROW_FROM_NS } else { self.ns.saturating_mul(2) }.min(self.max_ns);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn off_never_opens() {
        let mut w = PollWindow::new(Duration::ZERO);
        for wait in [1, 3, 10, 1000] {
            w.waited(wait * US);
            assert_eq!(w.current(), Duration::ZERO);
        }
    }

    #[test]
    fn grows_while_waits_fall_inside_the_maximum() {
        let mut w = PollWindow::new(50 * US);
        assert_eq!(w.current(), Duration::ZERO, "starts closed");
        w.waited(10 * US);
        assert_eq!(w.current(), 4 * US);
        w.waited(10 * US);
        assert_eq!(w.current(), 8 * US);
        w.waited(10 * US);
        assert_eq!(w.current(), 16 * US);
        // A wait the window covers changes nothing.
        w.waited(10 * US);
        assert_eq!(w.current(), 16 * US);
        w.waited(40 * US);
        assert_eq!(w.current(), 32 * US);
        w.waited(40 * US);
        assert_eq!(w.current(), 50 * US, "clamped to the maximum");
        w.waited(50 * US);
        assert_eq!(w.current(), 50 * US);
    }

    #[test]
    fn shrinks_to_closed_when_idle() {
        let mut w = PollWindow::new(50 * US);
        for _ in 0..6 {
            w.waited(45 * US);
        }
        assert_eq!(w.current(), 50 * US);
        w.waited(Duration::from_millis(5));
        assert_eq!(w.current(), 25 * US);
        w.waited(Duration::from_millis(5));
        assert_eq!(w.current(), 12_500 * Duration::from_nanos(1));
        w.waited(Duration::from_millis(5));
        assert_eq!(w.current(), 6_250 * Duration::from_nanos(1));
        w.waited(Duration::from_millis(5));
        assert_eq!(w.current(), Duration::ZERO, "under the first window: closed");
        w.waited(Duration::from_secs(10));
        assert_eq!(w.current(), Duration::ZERO);
    }
}
