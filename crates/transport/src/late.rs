//! When a response head is late: a smoothed estimate of the origin's head latency and its
//! variation (RFC 6298's estimator, the one TCP uses for its retransmission timeout), from
//! which the deadline of a request's first attempt is derived. Pure apart from its lock.

use std::sync::Mutex;
use std::time::Duration;

/// The smoothed head latency and its mean deviation, in seconds, once one answer was seen.
#[derive(Debug, Default)]
pub(crate) struct HeadLatency {
    estimate: Mutex<Option<Estimate>>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Estimate {
    srtt: f64,
    rttvar: f64,
}

impl Estimate {
    fn first(sample: f64) -> Self {
        Self { srtt: sample, rttvar: sample / 2.0 }
    }

    /// RFC 6298 §2.3 with α = 1/8, β = 1/4.
    fn update(self, sample: f64) -> Self {
        let rttvar = 0.75 * self.rttvar + 0.25 * (self.srtt - sample).abs();
        Self { srtt: 0.875 * self.srtt + 0.125 * sample, rttvar }
    }

    /// `srtt + 4·rttvar`: a head later than this is rare on this origin.
    fn late_after(self) -> f64 {
        self.srtt + 4.0 * self.rttvar
    }
}

impl HeadLatency {
    /// An answer's head came `latency` after its attempt started.
    pub(crate) fn observe(&self, latency: Duration) {
        let sample = latency.as_secs_f64();
        let mut e = self.estimate.lock().unwrap_or_else(|p| p.into_inner());
        *e = Some(match *e {
            None => Estimate::first(sample),
            Some(est) => est.update(sample),
        });
    }

    /// How long a first attempt may wait for its head before it is sent again: the estimate's
    /// `srtt + 4·rttvar`, at least `floor`; `None` before any answer was seen, or when that is
    /// not shorter than `cap` (the first-byte timeout, which then applies alone).
    pub(crate) fn deadline(&self, floor: Duration, cap: Duration) -> Option<Duration> {
        let e = (*self.estimate.lock().unwrap_or_else(|p| p.into_inner()))?;
        let late = Duration::try_from_secs_f64(e.late_after()).ok()?.max(floor);
        (late < cap).then_some(late)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_deadline_follows_the_latency_and_its_spread() {
        let h = HeadLatency::default();
        let cap = Duration::from_secs(10);
        assert_eq!(h.deadline(MS, cap), None, "no answer seen: the first-byte timeout alone");
        h.observe(20 * MS);
        // srtt 20 ms, rttvar 10 ms: 60 ms.
        assert_eq!(h.deadline(MS, cap), Some(60 * MS));
        // A steady 20 ms origin: the spread decays, the deadline approaches 20 ms (the floor
        // keeps it from ordinary jitter).
        for _ in 0..40 {
            h.observe(20 * MS);
        }
        let steady = h.deadline(MS, cap).unwrap();
        assert!(steady > 20 * MS && steady < 21 * MS, "{steady:?}");
        // The floor wins over a tight estimate; a cap below the deadline turns it off.
        assert_eq!(h.deadline(50 * MS, cap), Some(50 * MS));
        assert_eq!(h.deadline(MS, 20 * MS), None);
        // Jitter widens it: alternating 10 and 30 ms.
        for i in 0..40 {
            h.observe(if i % 2 == 0 { 10 * MS } else { 30 * MS });
        }
        let jittery = h.deadline(MS, cap).unwrap();
        assert!(jittery > 55 * MS && jittery < 75 * MS, "{jittery:?}");
        // A slower origin moves it up within a few answers.
        for _ in 0..8 {
            h.observe(200 * MS);
        }
        assert!(h.deadline(MS, cap).unwrap() > 200 * MS);
    }
}
