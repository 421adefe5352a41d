//! Retry policy: which failures are retried and how long to wait. Pure apart from the jitter's
//! randomness (std's per-process random hash keys; no RNG dependency).
//!
//! The one policy of every Tessera origin: [`crate::Transport`] applies it to every request of
//! the store's HTTP origin and of the registry client.

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

/// Bounded retries with exponential backoff and jitter, for 5xx (500, 502, 503, 504), 408, 429
/// and transport failures (connection refused or reset, timeouts, broken responses, a failed
/// name lookup).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (default 5). 1 disables retries.
    pub attempts: u32,
    /// Backoff before the first retry (default 100 ms: a guest read may be waiting); doubles
    /// every retry.
    pub base: Duration,
    /// Cap on one backoff, and on a server's `Retry-After` (default 4 s). With the defaults the
    /// waits before giving up add up to at most 1.5 s.
    pub max: Duration,
    /// Requests in a row that spent every attempt on retryable failures, none answered in
    /// between, after which the origin counts as failing (default 2; 0: never): from then on
    /// every request makes one attempt, without backoff, until one is answered. An origin that
    /// is gone then costs a read one attempt instead of the whole retry cycle, and a read
    /// succeeds again as soon as the origin is back; an origin failing a share of requests
    /// (a storm of 5xx and resets) almost never spends two requests' attempts in a row.
    pub failing_after: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self { attempts: 5, base: Duration::from_millis(100), max: Duration::from_secs(4), failing_after: 2 }
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

    /// The wait before a retry the server asked for with `Retry-After: SECONDS` (capped at `max`;
    /// HTTP dates and garbage fall back to the backoff).
    pub fn retry_after(&self, retry: u32, header: Option<&str>) -> Duration {
        match header.and_then(|h| h.trim().parse::<u64>().ok()) {
            Some(s) => Duration::from_secs(s).min(self.max),
            None => self.backoff(retry),
        }
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
        for s in [500, 502, 503, 504, 429, 408] {
            assert!(retryable_status(s), "{s}");
        }
        for s in [200, 206, 400, 403, 404, 416, 501] {
            assert!(!retryable_status(s), "{s}");
        }
    }
}
