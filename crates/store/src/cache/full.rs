//! A cache whose filesystem is full keeps serving: the first write that fails for want of space
//! (ENOSPC, EDQUOT) warns once, then writes are skipped — reads go on, every miss is served from
//! the origin — until a retry interval has passed, when the next write tries again; the first
//! one that succeeds says caching has resumed. Without this, every fetched chunk logged its own
//! warning and paid for a write bound to fail.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::{info, warn};

/// How long writes are skipped after the filesystem was found full, unless told otherwise.
pub const DEFAULT_FULL_RETRY: Duration = Duration::from_secs(10);

/// Whether `e` says the filesystem (or the user's quota) is full.
pub fn is_full(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
}

/// The cache's write state.
#[derive(Debug)]
pub struct FullState {
    retry: Duration,
    /// When a write last failed for want of space (`None`: writes work).
    since: Mutex<Option<Instant>>,
    /// Writes skipped while full.
    pub skipped: AtomicU64,
    /// Times the filesystem was found full (each warned once).
    pub episodes: AtomicU64,
}

impl FullState {
    pub fn new(retry: Duration) -> Self {
        Self { retry, since: Mutex::new(None), skipped: AtomicU64::new(0), episodes: AtomicU64::new(0) }
    }

    fn since(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.since.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether to skip a write now (counted).
    pub fn skip(&self) -> bool {
        let skip = self.since().is_some_and(|t| t.elapsed() < self.retry);
        if skip {
            self.skipped.fetch_add(1, Ordering::Relaxed);
        }
        skip
    }

    /// A write under `root` failed with `e`; true if it was for want of space (then handled
    /// here: the first of an episode warns, the others say nothing).
    pub fn failed(&self, root: &Path, e: &io::Error) -> bool {
        if !is_full(e) {
            return false;
        }
        let mut since = self.since();
        if since.is_none() {
            self.episodes.fetch_add(1, Ordering::Relaxed);
            warn!(
                cache = %root.display(),
                error = e as &dyn std::error::Error,
                retry_secs = self.retry.as_secs_f64(),
                "the cache's filesystem is full: serving without caching new entries, trying again every retry_secs"
            );
        }
        *since = Some(Instant::now());
        true
    }

    /// A write succeeded.
    pub fn succeeded(&self, root: &Path) {
        let mut since = self.since();
        if since.take().is_some() {
            info!(cache = %root.display(), "the cache's filesystem has space again: caching resumes");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_warning_per_episode_and_a_retry_after_the_interval() {
        let s = FullState::new(Duration::from_millis(30));
        let root = Path::new("/cache");
        let full = io::Error::from_raw_os_error(libc::ENOSPC);
        assert!(!s.skip());
        assert!(!s.failed(root, &io::Error::from_raw_os_error(libc::EACCES)), "only space counts");
        assert!(s.failed(root, &full));
        assert!(s.failed(root, &io::Error::from_raw_os_error(libc::EDQUOT)));
        assert_eq!(s.episodes.load(Ordering::Relaxed), 1);
        assert!(s.skip() && s.skip());
        assert_eq!(s.skipped.load(Ordering::Relaxed), 2);
        std::thread::sleep(Duration::from_millis(40));
        assert!(!s.skip(), "after the interval one write tries again");
        s.succeeded(root);
        assert!(!s.skip());
        assert!(s.failed(root, &full));
        assert_eq!(s.episodes.load(Ordering::Relaxed), 2, "a new episode after space came back");
    }
}
