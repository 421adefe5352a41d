//! When a queue worker signals the driver: once the ring is drained, and earlier when the ring
//! is about to run dry — unless signals preempt the worker. Free of I/O but the switch counter.
//!
//! A worker that signals only once its ring is drained makes a driver that sleeps with QD
//! requests in flight wait for all of them, then idles while the driver wakes up, reaps and
//! issues the next ones. With `VIRTIO_F_EVENT_IDX` the driver says in its `used_event` which
//! completion it wants to hear of; a signal sent when the requests still queued would keep the
//! worker busy for less than the driver's turnaround ([`DRIVER_TURNAROUND`]) after the next
//! completion brings its next requests before the worker runs dry. Where requests are long that
//! is one signal at the completion before the last (1 MiB reads: a signal at every completion
//! the driver asked for lost 14 % of their throughput; one at the drained ring only left the
//! worker idle through every refill, 7 % of its time). Measured with the serve bench's client
//! on another CPU (interrupt-driven libblkio, daemon on CPU 1, client on CPU 0, medians of
//! interleaved rounds of 2 s): 4 KiB random reads QD8 457 k → 547 k IOPS, QD16 463 k → 683 k,
//! QD32 721 k → 981 k (3 rounds, with a signal only once fewer than 16 µs were queued);
//! 1 MiB sequential QD8 21.5 k → 23.4 k (5 rounds, with the signal before the last).
//!
//! When the driver shares the worker's CPU, the same signal hands it the CPU (the woken driver
//! preempts the worker) and each batch is split into many: same-CPU 4 KiB QD32 fell from ~0.95 M
//! to ~0.48 M IOPS with early signals. A worker cannot see where its driver runs, but it can see
//! that a signal cost it its CPU: the thread's count of involuntary context switches moves across
//! the `write`. When it does for two checked signals in a row (one alone may be another thread's
//! preemption that happened to fall there), early signals stop for [`OFF_FOR`] (the ring-drained
//! signal stays), then are tried again. The count is a system call, so it is read around one
//! early signal in [`CHECK_EVERY`], around the next after one that preempted, and around the
//! first after every pause.

use std::time::{Duration, Instant};

/// How long early signals stay off once one preempted the worker.
pub const OFF_FOR: Duration = Duration::from_secs(1);
/// Early signals between two checks of whether one preempts the worker.
pub const CHECK_EVERY: u32 = 64;

/// The time a driver woken by a signal needs before its next requests reach the ring (wake-up,
/// reaping, issuing): a signal is sent early once the requests queued behind the next one would
/// keep the worker busy for less than this.
pub const DRIVER_TURNAROUND: Duration = Duration::from_micros(16);

/// One queue's choice of signalling early, across its worker's wake-ups.
#[derive(Debug, Default, Clone)]
pub struct EarlySignals {
    /// Early signals are off until then: one preempted the worker.
    off_until: Option<Instant>,
    /// Early signals sent since the last check (a check is due at 0).
    since_check: u32,
    /// The last checked signal preempted the worker.
    struck: bool,
    /// The worker's time per request, a moving average (ns; 0 before the first).
    service_ns: u64,
}

impl EarlySignals {
    /// A request was served inline in `took`.
    pub fn served(&mut self, took: Duration) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        // An average over about the last 8 requests.
        self.service_ns =
            if self.service_ns == 0 { ns } else { self.service_ns - self.service_ns / 8 + ns / 8 };
    }

    /// Whether to signal at a completion at `now` with `queued` requests still waiting in the
    /// ring, rather than only once the ring is drained: when waiting for the next completion
    /// would leave less than [`DRIVER_TURNAROUND`] of queued work, so the driver's next requests
    /// arrive before the worker runs dry. With long requests that is the completion before the
    /// last one (1 MiB reads: the driver refills while the last is copied). Never with none
    /// queued: the ring-drained signal follows at once.
    pub fn due(&mut self, queued: u16, now: Instant) -> bool {
        let Some(after_next) = queued.checked_sub(1) else { return false };
        let ahead = u64::from(after_next).saturating_mul(self.service_ns);
        ahead < DRIVER_TURNAROUND.as_nanos() as u64 && self.allowed(now)
    }

    /// Whether early signals are allowed at `now` (not paused after one preempted the worker).
    fn allowed(&mut self, now: Instant) -> bool {
        match self.off_until {
            Some(until) if now < until => false,
            Some(_) => {
                self.off_until = None;
                self.since_check = 0;
                self.struck = false;
                true
            }
            None => true,
        }
    }

    /// An early signal is about to be sent: whether to count the worker's involuntary switches
    /// around it.
    pub fn check_this_one(&mut self) -> bool {
        let due = self.since_check == 0;
        self.since_check = (self.since_check + 1) % CHECK_EVERY;
        due
    }

    /// A checked signal sent at `now` moved the worker's involuntary switch count from `before`
    /// to `after`. If it preempted the worker, the next early signal is checked too; if that one
    /// did as well, early signals stop for [`OFF_FOR`]. Whether they stopped.
    pub fn checked(&mut self, now: Instant, before: u64, after: u64) -> bool {
        let preempted = after != before;
        let pause = preempted && self.struck;
        self.struck = preempted && !pause;
        if self.struck {
            self.since_check = 0;
        }
        if pause {
            self.off_until = Some(now + OFF_FOR);
        }
        pause
    }

    /// Whether early signals are paused at `now`.
    #[cfg(test)]
    fn paused(&self, now: Instant) -> bool {
        self.off_until.is_some_and(|until| now < until)
    }
}

/// The calling thread's involuntary context switches so far (`getrusage(RUSAGE_THREAD)`), or
/// `None` if the kernel does not say.
pub fn involuntary_switches() -> Option<u64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `usage` is a valid, writable `rusage`; getrusage writes only into it, and its
    // result is read only when the call succeeded.
    let ok = unsafe { libc::getrusage(libc::RUSAGE_THREAD, usage.as_mut_ptr()) } == 0;
    // SAFETY: zero-initialised, and filled in by a successful getrusage.
    ok.then(|| unsafe { usage.assume_init() }.ru_nivcsw as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn early_when_the_queued_work_is_shorter_than_the_drivers_turnaround() {
        let now = Instant::now();
        let mut e = EarlySignals::default();
        // Before any request was timed what is queued counts as nothing: early.
        assert!(e.due(32, now));
        // 1 µs a request: with 16 queued, the next completion leaves 15 µs (early); with 17,
        // 16 µs (not yet); none queued: the ring-drained signal follows.
        e.served(Duration::from_micros(1));
        assert!(e.due(1, now) && e.due(16, now));
        assert!(!e.due(17, now) && !e.due(u16::MAX, now) && !e.due(0, now));
        // 45 µs a request (1 MiB reads): at the completion before the last only, so the driver
        // refills while the last is served.
        let mut big = EarlySignals::default();
        big.served(Duration::from_micros(45));
        assert!(big.due(1, now));
        assert!(!big.due(2, now) && !big.due(0, now));
    }

    #[test]
    fn the_time_per_request_is_an_average_of_the_last_few() {
        let mut e = EarlySignals::default();
        e.served(Duration::from_micros(8));
        assert_eq!(e.service_ns, 8_000);
        // One slow request moves it by an eighth of the difference.
        e.served(Duration::from_micros(16));
        assert_eq!(e.service_ns, 9_000);
        for _ in 0..64 {
            e.served(Duration::from_micros(1));
        }
        assert!((1_000..1_100).contains(&e.service_ns), "{}", e.service_ns);
    }

    #[test]
    fn a_paused_queue_is_never_due() {
        let t0 = Instant::now();
        let mut e = EarlySignals::default();
        assert!(e.check_this_one());
        assert!(!e.checked(t0, 1, 2));
        assert!(e.check_this_one());
        assert!(e.checked(t0, 2, 3));
        assert!(!e.due(1, t0 + Duration::from_millis(999)));
        assert!(e.due(1, t0 + OFF_FOR));
    }

    #[test]
    fn a_preemption_between_checks_that_did_not_preempt_is_forgiven() {
        let t0 = Instant::now();
        let mut e = EarlySignals::default();
        assert!(e.check_this_one());
        assert!(!e.checked(t0, 1, 2), "struck once");
        assert!(e.check_this_one(), "the next is checked");
        assert!(!e.checked(t0, 2, 2), "and did not preempt: forgiven");
        for _ in 1..CHECK_EVERY {
            assert!(!e.check_this_one());
        }
        assert!(e.check_this_one());
        assert!(!e.checked(t0, 2, 3), "one preemption again: no pause");
        assert!(!e.paused(t0));
    }

    #[test]
    fn every_sixty_fourth_signal_is_checked_from_the_first() {
        let mut e = EarlySignals::default();
        let now = Instant::now();
        let mut checked = Vec::new();
        for i in 0..200 {
            assert!(e.allowed(now));
            if e.check_this_one() {
                checked.push(i);
            }
        }
        assert_eq!(checked, vec![0, 64, 128, 192]);
    }

    #[test]
    fn a_preempting_signal_pauses_early_signals_for_a_second_then_they_are_checked_again() {
        let mut e = EarlySignals::default();
        let t0 = Instant::now();
        assert!(e.allowed(t0));
        assert!(e.check_this_one());
        assert!(!e.checked(t0, 7, 7), "no switch: not preempted");
        assert!(e.allowed(t0) && !e.paused(t0));
        // Some signals later, the next check finds a switch.
        for _ in 1..CHECK_EVERY {
            assert!(!e.check_this_one());
        }
        assert!(e.check_this_one());
        assert!(!e.checked(t0, 7, 8), "one preemption alone does not pause");
        assert!(e.allowed(t0) && !e.paused(t0));
        // ... but the next early signal is checked too, and a second preemption in a row does.
        assert!(e.check_this_one());
        assert!(e.checked(t0, 8, 9));
        assert!(e.paused(t0));
        assert!(!e.allowed(t0 + OFF_FOR - Duration::from_millis(1)));
        // After the pause the first early signal is checked again.
        assert!(e.allowed(t0 + OFF_FOR));
        assert!(!e.paused(t0 + OFF_FOR));
        assert!(e.check_this_one());
        assert!(!e.check_this_one());
    }

    #[test]
    fn this_threads_switches_are_counted_and_a_yield_to_a_runnable_thread_moves_them() {
        let before = involuntary_switches().expect("getrusage(RUSAGE_THREAD)");
        // A runnable thread on every CPU, and this one yielding until its count moves: a yield
        // that switches to another thread is an involuntary switch, as a preemption is.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        let spinners: Vec<_> = (0..cpus)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut moved = false;
        while Instant::now() < deadline && !moved {
            std::thread::yield_now();
            moved = involuntary_switches().is_some_and(|n| n > before);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for s in spinners {
            s.join().unwrap();
        }
        assert!(moved, "the count never moved");
    }
}
