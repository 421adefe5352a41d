//! Rate-limited warnings for what a guest can cause at will: a guest that floods the device with
//! bad requests must not flood the host's logs. Each call site owns one [`LogLimit`] (a
//! `static`): at most [`LogLimit::burst`] messages per window; the rest are counted, and the next
//! message that goes out carries that count (`suppressed = N`).
//!
//! ```
//! use tessera_vhost::log_limit::LogLimit;
//! static BAD: LogLimit = LogLimit::per_10s(5);
//! if let Some(suppressed) = BAD.allow() {
//!     tracing::warn!(suppressed, "dropping a malformed descriptor chain");
//! }
//! ```

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// At most `burst` messages per `window`; the others counted.
#[derive(Debug)]
pub struct LogLimit {
    burst: u32,
    window: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// When the current window began (`None`: nothing logged yet).
    start: Option<Instant>,
    /// Messages let through in the current window.
    emitted: u32,
    /// Messages dropped since the last one let through.
    suppressed: u64,
}

impl LogLimit {
    /// `burst` messages per `window`.
    pub const fn new(burst: u32, window: Duration) -> Self {
        Self { burst, window, state: Mutex::new(State { start: None, emitted: 0, suppressed: 0 }) }
    }

    /// `burst` messages per 10 s.
    pub const fn per_10s(burst: u32) -> Self {
        Self::new(burst, Duration::from_secs(10))
    }

    /// The messages let through per window.
    pub fn burst(&self) -> u32 {
        self.burst
    }

    /// Whether to log this message: `Some(n)` with the messages suppressed since the last one
    /// logged (log it with that count), `None` to drop it (it is counted).
    pub fn allow(&self) -> Option<u64> {
        self.allow_at(Instant::now())
    }

    /// [`Self::allow`] at time `now`.
    pub fn allow_at(&self, now: Instant) -> Option<u64> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let expired = st.start.is_none_or(|s| now.saturating_duration_since(s) >= self.window);
        if expired {
            st.start = Some(now);
            st.emitted = 0;
        }
        if st.emitted < self.burst {
            st.emitted += 1;
            Some(std::mem::take(&mut st.suppressed))
        } else {
            st.suppressed = st.suppressed.saturating_add(1);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_per_window_then_counts() {
        let l = LogLimit::new(3, Duration::from_secs(10));
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_millis(s);
        let first: Vec<_> = (0..1000).map(|i| l.allow_at(at(i))).collect();
        assert_eq!(&first[..3], &[Some(0), Some(0), Some(0)]);
        assert!(first[3..].iter().all(Option::is_none));
        // The next window: the first message carries the 997 dropped ones.
        assert_eq!(l.allow_at(at(10_000)), Some(997));
        assert_eq!(l.allow_at(at(10_001)), Some(0));
        assert_eq!(l.allow_at(at(10_002)), Some(0));
        assert_eq!(l.allow_at(at(10_003)), None);
        // A quiet spell: the window restarts at the next message.
        assert_eq!(l.allow_at(at(60_000)), Some(1));
        assert_eq!(l.allow_at(at(60_001)), Some(0));
    }

    #[test]
    fn threads_share_one_budget() {
        let l = LogLimit::per_10s(5);
        let allowed: usize = std::thread::scope(|s| {
            let hs: Vec<_> =
                (0..8).map(|_| s.spawn(|| (0..1000).filter(|_| l.allow().is_some()).count())).collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).sum()
        });
        assert_eq!(allowed, 5);
    }
}
