//! Retry policy: which failures are retried and how long to wait. Pure apart from the jitter's
//! randomness (std's per-process random hash keys; no RNG dependency).
//!
//! The one policy of every Tessera origin: [`crate::Transport`] applies it to every request of
//! the store's HTTP origin and of the registry client.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Bounded retries with exponential backoff and jitter, for 5xx (500, 502, 503, 504), 408, 429
/// and transport failures (connection refused or reset, timeouts, broken responses, a failed
/// name lookup).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (default 5); twice as many while other requests to
    /// the same origin are being answered (a flaky origin, not a gone one: a guest read would
    /// rather wait than fail). 1 disables retries.
    pub attempts: u32,
    /// Backoff unit (default 100 ms: a guest read may be waiting): a retry that waits
    /// ([`Self::wait`]: an overloaded server, or the immediate retries spent) waits about
    /// `base·2^retry` ([`Self::backoff`]).
    pub base: Duration,
    /// Cap on one backoff, and on a server's `Retry-After` (default 4 s). With the defaults the
    /// waits before giving up add up to at most 1.5 s.
    pub max: Duration,
    /// Requests in a row that spent every attempt on retryable failures, none answered in
    /// between, after which the origin counts as failing (default 2; 0: never): from then on
    /// every request makes one attempt, without backoff, until one is answered (a request
    /// backing off at that moment makes its last attempt at once). An origin that
    /// is gone then costs a read one attempt instead of the whole retry cycle, and a read
    /// succeeds again as soon as the origin is back; an origin failing a share of requests
    /// (a storm of 5xx and resets) almost never spends two requests' attempts in a row.
    pub failing_after: u32,
    /// The least time a ranged read's first attempt (a GET with `Range`: the data path) waits
    /// for its response head before it is given up and sent again at once (default 50 ms;
    /// `None`: never). The wait is the origin's usual head latency for GETs plus four
    /// times its spread (RFC 6298's estimate, as TCP times a retransmission), at least this,
    /// below the first-byte timeout. A resend does not
    /// spend an attempt; up to three are made, each waiting twice as long as the last, and then
    /// the first-byte timeout applies. A server that stalls some requests then costs each about
    /// one usual round trip instead of a first-byte timeout. The floor keeps a busy client's
    /// scheduling delays (milliseconds on a loaded host) from counting as late heads of a
    /// nearby origin.
    pub resend_late: Option<Duration>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            attempts: 5,
            base: Duration::from_millis(100),
            max: Duration::from_secs(4),
            failing_after: 2,
            resend_late: Some(Duration::from_millis(50)),
        }
    }
}

/// HTTP statuses worth retrying: the server may answer differently next time.
pub fn retryable_status(status: u16) -> bool {
    matches!(status, 408 | 429 | 500 | 502 | 503 | 504)
}

fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64),
    );
    h.finish()
}

impl RetryPolicy {
    /// The wait before retry number `retry` (0-based): "equal jitter", half of
    /// `min(max, base·2^retry)` plus a random part of the other half — never zero, never
    /// synchronized across clients.
    pub fn backoff(&self, retry: u32) -> Duration {
        self.backoff_with(retry, random_u64())
    }

    fn backoff_with(&self, retry: u32, random: u64) -> Duration {
        let exp = self.base.saturating_mul(1u32.checked_shl(retry.min(31)).unwrap_or(u32::MAX)).min(self.max);
        let half = exp / 2;
        let span = half.as_nanos() as u64;
        let jitter = if span == 0 { 0 } else { random % (span + 1) };
        half + Duration::from_nanos(jitter)
    }

    /// The wait before retry number `retry` (0-based) after a failed exchange: a server's
    /// `Retry-After` when it sent one; the full backoff ([`Self::backoff`]) for a 429 (the
    /// server limits this client's rate) and whenever `budget` has no immediate retry left;
    /// within the budget, a quarter of the backoff for a 503 (the server, or the one backend a
    /// balancer chose, is busy: a short, jittered pause, not a long one, while the origin fails
    /// less than half of what is asked — past that the budget is spent and every retry backs
    /// off in full) and none for the rest — a reset, a truncated or corrupted body, a 500, 502
    /// or 504 is most often cured by asking again at once. (A connection that could not be
    /// made at all backs off: the transport calls [`Self::backoff`] for it.)
    pub fn wait(
        &self,
        retry: u32,
        status: Option<u16>,
        retry_after: Option<&str>,
        budget: &RetryBudget,
    ) -> Duration {
        if retry_after.is_some() {
            return self.retry_after(retry, retry_after);
        }
        if status == Some(429) || !budget.take() {
            return self.backoff(retry);
        }
        if status == Some(503) {
            return self.backoff(retry) / 4;
        }
        Duration::ZERO
    }

    /// The wait before a retry the server asked for with `Retry-After: SECONDS` (capped at `max`;
    /// HTTP dates and garbage fall back to the backoff).
    pub fn retry_after(&self, retry: u32, header: Option<&str>) -> Duration {
        match header.and_then(|h| h.trim().parse::<u64>().ok()) {
            Some(s) => Duration::from_secs(s).min(self.max),
            None => self.backoff(retry),
        }
    }
}

/// The retries that may go at once, shared by every request of one transport: a token bucket
/// that each request fills by half a retry, holding at most ten. An origin failing a share of
/// requests below one half keeps its retries immediate; one failing more (or gone) soon finds
/// the bucket empty, and its retries back off — immediate retries add at most half the request
/// rate (plus the ten in reserve) to an origin's load, the bound retry budgets (Finagle, Envoy)
/// keep.
#[derive(Debug)]
pub struct RetryBudget {
    /// Thousandths of a retry.
    milli: AtomicU64,
}

impl RetryBudget {
    const UNIT: u64 = 1000;
    /// Half a retry per request.
    const DEPOSIT: u64 = Self::UNIT / 2;
    /// Ten retries in reserve at most.
    const CAP: u64 = 10 * Self::UNIT;

    /// A full budget.
    pub fn new() -> Self {
        Self { milli: AtomicU64::new(Self::CAP) }
    }

    /// A request was made.
    pub fn deposit(&self) {
        let _ = self.milli.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |m| {
            (m < Self::CAP).then(|| (m + Self::DEPOSIT).min(Self::CAP))
        });
    }

    /// Take one immediate retry, if one is left.
    pub fn take(&self) -> bool {
        self.milli.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |m| m.checked_sub(Self::UNIT)).is_ok()
    }
}

impl Default for RetryBudget {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_jitters_and_caps() {
        let p = RetryPolicy { max: Duration::from_secs(1), ..RetryPolicy::default() };
        assert_eq!(p.backoff_with(0, 0), Duration::from_millis(50));
        assert_eq!(
            p.backoff_with(0, u64::MAX),
            Duration::from_millis(50) + Duration::from_nanos(u64::MAX % 50_000_001)
        );
        assert_eq!(p.backoff_with(2, 0), Duration::from_millis(200));
        assert_eq!(p.backoff_with(10, 0), Duration::from_millis(500));
        assert_eq!(p.backoff_with(40, 0), Duration::from_millis(500));
        for r in 0..8 {
            let d = p.backoff(r);
            assert!(d <= p.max && d >= p.backoff_with(r, 0), "{r}: {d:?}");
        }
        assert_eq!(p.retry_after(0, Some("3")), Duration::from_secs(1));
        assert_eq!(p.retry_after(0, Some(" 0 ")), Duration::ZERO);
        assert!(p.retry_after(0, Some("Wed, 21 Oct 2015 07:28:00 GMT")) <= Duration::from_millis(100));
        // A retry goes at once unless the server asked to wait or is overloaded, or the
        // budget is spent.
        let budget = RetryBudget::new();
        assert_eq!(p.wait(0, None, None, &budget), Duration::ZERO);
        assert_eq!(p.wait(3, Some(500), None, &budget), Duration::ZERO);
        assert!(p.wait(0, Some(429), None, &budget) >= Duration::from_millis(50));
        // A 503 within the budget: a quarter of the backoff (12.5-25 ms, then 25-50 ms).
        let busy = p.wait(0, Some(503), None, &budget);
        assert!(busy >= Duration::from_micros(12_500) && busy <= Duration::from_millis(25), "{busy:?}");
        let busy = p.wait(1, Some(503), None, &budget);
        assert!(busy >= Duration::from_millis(25) && busy <= Duration::from_millis(50), "{busy:?}");
        assert_eq!(p.wait(0, Some(502), Some("1"), &budget), Duration::from_secs(1));
        for _ in 0..6 {
            assert_eq!(p.wait(0, Some(504), None, &budget), Duration::ZERO);
        }
        assert!(p.wait(1, None, None, &budget) >= Duration::from_millis(100), "ten spent");
        assert!(p.wait(0, Some(503), None, &budget) >= Duration::from_millis(50), "a 503 past the budget");
        budget.deposit();
        assert!(p.wait(0, None, None, &budget) >= Duration::from_millis(50), "half a retry is none");
        budget.deposit();
        assert_eq!(p.wait(0, None, None, &budget), Duration::ZERO, "two requests: one retry");
        for _ in 0..100 {
            budget.deposit();
        }
        assert_eq!((0..12).filter(|_| budget.take()).count(), 10, "ten in reserve at most");
        for s in [500, 502, 503, 504, 429, 408] {
            assert!(retryable_status(s), "{s}");
        }
        for s in [200, 206, 400, 403, 404, 416, 501] {
            assert!(!retryable_status(s), "{s}");
        }
    }
}

/// Where the consumer of a streamed body is, across the attempts of one request: each attempt's
/// body starts again at the first byte, and the consumer must get each byte once, in order.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Resume {
    fed: u64,
}

impl Resume {
    /// The part of `piece` — the bytes at `at` of this attempt's body — the consumer has not had
    /// (empty if it had all of it); it counts as had from now on.
    pub fn unseen<'a>(&mut self, at: u64, piece: &'a [u8]) -> &'a [u8] {
        let end = at.saturating_add(piece.len() as u64);
        if end <= self.fed {
            return &[];
        }
        let skip = usize::try_from(self.fed.saturating_sub(at)).unwrap_or(usize::MAX).min(piece.len());
        self.fed = end;
        &piece[skip..]
    }

    /// Bytes the consumer has had.
    pub fn fed(&self) -> u64 {
        self.fed
    }
}

#[cfg(test)]
mod resume_tests {
    use super::Resume;

    #[test]
    fn a_second_attempt_hands_over_only_what_the_first_did_not() {
        let body: Vec<u8> = (0..100u8).collect();
        let mut r = Resume::default();
        let mut out = Vec::new();
        // The first attempt breaks after 37 bytes, in pieces of 10.
        for at in (0..37).step_by(10) {
            out.extend_from_slice(r.unseen(at as u64, &body[at..(at + 10).min(37)]));
        }
        // The second gives the whole body again, in pieces of 16.
        for at in (0..100).step_by(16) {
            out.extend_from_slice(r.unseen(at as u64, &body[at..(at + 16).min(100)]));
        }
        assert_eq!(out, body);
        assert_eq!(r.fed(), 100);
    }
}
