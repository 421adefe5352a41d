//! Single-flight for cache misses: one fetch per entry per host.
//!
//! - [`KeyedLocks`]: threads of one process missing the same entry queue on one in-process mutex
//!   (no file descriptor per waiter).
//! - [`EntryLock`]: processes missing the same entry queue on `flock(LOCK_EX)` of the entry's lock
//!   file in `locks/`. The kernel drops a flock when its holder dies, so a killed process never
//!   leaves a lock that blocks others; its lock *file* stays until the next holder or
//!   `tessera cache gc` removes it.
//!
//! A holder unlinks the lock file before releasing it. A waiter that then wins the lock holds an
//! unlinked inode, while a newcomer could create and lock a fresh file of the same name: two
//! "holders". So after every acquisition the holder checks that its descriptor is still the file
//! at the path (same device and inode) and starts over if not.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, PoisonError};

use rustix::fs::FlockOperation;

/// An exclusive `flock` on a lock file, released (and the file unlinked, if asked) on drop.
#[derive(Debug)]
pub struct EntryLock {
    file: File,
    path: PathBuf,
    remove_on_drop: bool,
}

/// Whether `file` is still the file at `path` (not unlinked or replaced).
fn is_current(file: &File, path: &Path) -> std::io::Result<bool> {
    let held = rustix::fs::fstat(file)?;
    match rustix::fs::stat(path) {
        Ok(now) => Ok(now.st_dev == held.st_dev && now.st_ino == held.st_ino),
        Err(rustix::io::Errno::NOENT) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

fn flock_retrying(file: &File, op: FlockOperation) -> rustix::io::Result<()> {
    loop {
        match rustix::fs::flock(file, op) {
            Err(rustix::io::Errno::INTR) => continue,
            other => return other,
        }
    }
}

impl EntryLock {
    /// Wait for the exclusive lock of `path` (creating the file if needed).
    pub fn acquire(path: &Path) -> std::io::Result<Self> {
        loop {
            let file = open_lock_file(path)?;
            flock_retrying(&file, FlockOperation::LockExclusive)?;
            if is_current(&file, path)? {
                return Ok(Self { file, path: path.to_owned(), remove_on_drop: false });
            }
            // The previous holder unlinked it after publishing: take the lock anew.
        }
    }

    /// The lock of `path` if nobody holds it; `None` if somebody does or the file is gone.
    pub fn try_acquire_existing(path: &Path) -> std::io::Result<Option<Self>> {
        let file = match OpenOptions::new().read(true).write(true).open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        match flock_retrying(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => return Ok(None),
            Err(e) => return Err(e.into()),
        }
        if !is_current(&file, path)? {
            return Ok(None);
        }
        Ok(Some(Self { file, path: path.to_owned(), remove_on_drop: false }))
    }

    /// Unlink the lock file when the lock is released: done once the entry is published (or found
    /// published), so lock files do not pile up.
    pub fn remove_on_drop(&mut self) {
        self.remove_on_drop = true;
    }
}

impl Drop for EntryLock {
    fn drop(&mut self) {
        // Unlink while still holding the lock: a waiter then sees a stale inode and retries.
        if self.remove_on_drop {
            let _ = std::fs::remove_file(&self.path);
        }
        let _ = flock_retrying(&self.file, FlockOperation::Unlock);
    }
}

/// Take the shared flock a writer holds on its temp file until the rename (so a cleaner can tell
/// it from one a killed writer left: see [`temp_is_abandoned`]).
pub fn hold_temp(file: &File) -> std::io::Result<()> {
    flock_retrying(file, FlockOperation::LockShared).map_err(Into::into)
}

/// A writer takes its temp file's flock right after creating it; a file younger than this may be
/// in that gap, so it is never taken for abandoned.
pub const TEMP_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether the temp file at `path` was left by a dead writer: older than [`TEMP_GRACE`] and
/// nobody holds its flock.
pub fn temp_is_abandoned(path: &Path) -> std::io::Result<bool> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    let age = file.metadata()?.modified()?.elapsed().unwrap_or_default();
    if age < TEMP_GRACE {
        return Ok(false);
    }
    match flock_retrying(&file, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(true),
        Err(rustix::io::Errno::WOULDBLOCK) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

fn open_lock_file(path: &Path) -> std::io::Result<File> {
    let open = || OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path);
    match open() {
        Err(e) if e.kind() == ErrorKind::NotFound => {
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)?;
            }
            open()
        }
        other => other,
    }
}

/// In-process single-flight: at most one thread per key at a time.
#[derive(Debug, Default)]
pub struct KeyedLocks {
    held: Mutex<HashSet<String>>,
    released: Condvar,
}

/// Holds the in-process lock of one key until dropped.
#[derive(Debug)]
pub struct KeyGuard<'a> {
    locks: &'a KeyedLocks,
    key: String,
}

impl KeyedLocks {
    /// Wait until no other thread holds `key`, then hold it.
    pub fn lock(&self, key: &str) -> KeyGuard<'_> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        while held.contains(key) {
            held = self.released.wait(held).unwrap_or_else(PoisonError::into_inner);
        }
        held.insert(key.to_owned());
        KeyGuard { locks: self, key: key.to_owned() }
    }
}

impl Drop for KeyGuard<'_> {
    fn drop(&mut self) {
        let mut held = self.locks.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.remove(&self.key);
        drop(held);
        self.locks.released.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn keyed_locks_serialize_one_key_only() {
        let locks = Arc::new(KeyedLocks::default());
        let inside = Arc::new(AtomicUsize::new(0));
        let max_inside = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (locks, inside, max_inside) = (locks.clone(), inside.clone(), max_inside.clone());
                std::thread::spawn(move || {
                    let _g = locks.lock("a");
                    let n = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    max_inside.fetch_max(n, Ordering::SeqCst);
                    // Another key is not blocked by "a".
                    drop(locks.lock("b"));
                    std::thread::sleep(Duration::from_millis(2));
                    inside.fetch_sub(1, Ordering::SeqCst);
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(max_inside.load(Ordering::SeqCst), 1);
        assert!(locks.held.lock().unwrap().is_empty(), "released keys are forgotten");
    }

    #[test]
    fn entry_lock_excludes_and_survives_unlink_races() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("locks/x.lock");
        let mut first = EntryLock::acquire(&path).unwrap();
        assert!(EntryLock::try_acquire_existing(&path).unwrap().is_none(), "held: not acquirable");
        let waiter = {
            let path = path.clone();
            std::thread::spawn(move || {
                let l = EntryLock::acquire(&path).unwrap();
                // The waiter must hold the file now at the path, not the unlinked one.
                assert!(is_current(&l.file, &path).unwrap());
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        first.remove_on_drop();
        drop(first);
        waiter.join().unwrap();
        // Released and not removed by the waiter: acquirable, then removable.
        let mut l = EntryLock::try_acquire_existing(&path).unwrap().expect("free lock");
        l.remove_on_drop();
        drop(l);
        assert!(!path.exists());
        assert!(EntryLock::try_acquire_existing(&path).unwrap().is_none(), "no file: nothing to take");
    }
}
