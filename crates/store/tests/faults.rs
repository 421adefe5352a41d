//! Faults from the real kernel: immutable directories, read-only mounts, a full filesystem.
//! These need root (chattr, mount); without it they print why and pass.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{files_in, Mount, Rng};
use tessera_image::Sha256Digest;
use tessera_store::{LocalStore, StoreError};

/// `chattr +i` on a path, undone on drop.
struct Immutable(PathBuf);

impl Immutable {
    fn set(path: &Path) -> Option<Self> {
        match Command::new("chattr").arg("+i").arg(path).output() {
            Ok(o) if o.status.success() => Some(Self(path.to_owned())),
            Ok(o) => {
                eprintln!("SKIP: chattr +i failed: {}", String::from_utf8_lossy(&o.stderr).trim());
                None
            }
            Err(e) => {
                eprintln!("SKIP: cannot run chattr: {e}");
                None
            }
        }
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        let _ = Command::new("chattr").arg("-i").arg(&self.0).status();
    }
}

#[test]
fn immutable_directories_are_read_only_errors() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path()).unwrap();
    let old = store.put_blob(b"already here").unwrap();
    let blobs = dir.path().join("blobs/sha256");
    {
        let Some(_guard) = Immutable::set(&blobs) else { return };
        // The temp write succeeds; the rename into blobs/sha256 is refused.
        match store.put_blob(b"new content") {
            Err(e @ StoreError::ReadOnly { .. }) => {
                assert!(
                    !e.is_usage_error(),
                    "a refusing filesystem is a failure (exit 1), not a usage error"
                );
                assert!(e.to_string().contains("blobs/sha256"), "names the path: {e}");
            }
            other => panic!("expected ReadOnly, got {other:?}"),
        }
        let mut w = store.blob_writer().unwrap();
        w.write_all(b"streamed").unwrap();
        assert!(matches!(w.commit(), Err(StoreError::ReadOnly { .. })));
        assert!(files_in(&dir.path().join("tmp")).is_empty(), "no temp left behind");
        assert!(!store.has_blob(&Sha256Digest::of(b"new content")).unwrap());
        assert_eq!(store.read_blob(&old).unwrap(), b"already here", "reads still work");
    }
    let tmp = dir.path().join("tmp");
    let Some(_guard) = Immutable::set(&tmp) else { return };
    assert!(matches!(store.put_blob(b"x"), Err(StoreError::ReadOnly { .. })));
    assert!(matches!(store.blob_writer(), Err(StoreError::ReadOnly { .. })));
    assert!(matches!(LocalStore::create_or_open(dir.path()), Err(StoreError::ReadOnly { .. })));
    LocalStore::open(dir.path()).unwrap();
}

#[test]
fn read_only_mount_is_a_read_only_error() {
    let Some(mnt) = Mount::tmpfs("size=4M") else { return };
    let root = mnt.path.join("store");
    let store = LocalStore::create_or_open(&root).unwrap();
    let d = store.put_blob(b"before").unwrap();
    mnt.remount("ro");
    match store.put_blob(b"after") {
        Err(e @ StoreError::ReadOnly { .. }) => assert!(e.to_string().contains(&*root.to_string_lossy())),
        other => panic!("expected ReadOnly, got {other:?}"),
    }
    assert!(matches!(LocalStore::create_or_open(&root), Err(StoreError::ReadOnly { .. })));
    assert!(matches!(
        LocalStore::create_or_open(mnt.path.join("new-store")),
        Err(StoreError::ReadOnly { .. })
    ));
    let reader = LocalStore::open(&root).unwrap();
    assert_eq!(reader.read_blob(&d).unwrap(), b"before");
}

#[test]
fn full_filesystem_is_a_full_error_and_leaves_nothing() {
    let Some(mnt) = Mount::tmpfs("size=1M") else { return };
    let root = mnt.path.join("store");
    let store = LocalStore::create_or_open(&root).unwrap();
    let big = Rng::new(3).bytes(2 << 20);
    match store.put_blob(&big) {
        Err(e @ StoreError::Full { .. }) => {
            assert!(!e.is_usage_error());
            assert!(e.to_string().contains("full"), "{e}");
        }
        other => panic!("expected Full, got {other:?}"),
    }
    assert!(!store.has_blob(&Sha256Digest::of(&big)).unwrap());
    assert!(files_in(&root.join("tmp")).is_empty(), "temp removed after ENOSPC");

    // Streaming: the failure surfaces from append/write or commit, typed, and nothing remains.
    let mut w = store.blob_writer().unwrap();
    let mut failed = None;
    for piece in big.chunks(64 * 1024) {
        if let Err(e) = w.append(piece) {
            failed = Some(e);
            break;
        }
    }
    let err = match failed {
        Some(e) => e,
        None => w.commit().unwrap_err(),
    };
    assert!(matches!(err, StoreError::Full { .. }), "{err:?}");
    assert!(files_in(&root.join("tmp")).is_empty(), "temp removed after a failed stream");
    assert!(files_in(&root.join("blobs/sha256")).is_empty());

    // io::Write: a write error (if the buffer flushed) or commit reports Full, typed.
    let mut w = store.blob_writer().unwrap();
    let big3 = Rng::new(4).bytes(3 << 20);
    let io_err = big3.chunks(64 * 1024).find_map(|p| w.write_all(p).err());
    assert!(io_err.is_some(), "3 MiB through a 1 MiB buffer into a 1 MiB filesystem must fail");
    assert!(matches!(w.commit(), Err(StoreError::Full { .. })));
    assert!(files_in(&root.join("tmp")).is_empty());

    // Small writes work again once the space is back. Space of an unlinked file returns when its
    // last descriptor closes; a child forked by a parallel test (mount, chattr) may hold a copy
    // until it execs, so poll briefly instead of expecting it at once.
    let mut attempt = 0;
    let d = loop {
        match store.put_blob(b"small") {
            Ok(d) => break d,
            Err(StoreError::Full { .. }) if attempt < 200 => {
                attempt += 1;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(e) => panic!("small write after ENOSPC: {e}"),
        }
    };
    assert_eq!(store.read_blob(&d).unwrap(), b"small");
}

/// A disk cache on a full filesystem keeps serving: every fetch returns the origin's bytes, the
/// first failed write is the only one tried (and logged) until the retry interval has passed,
/// and caching resumes once there is space again.
#[test]
fn a_full_cache_filesystem_degrades_to_no_caching() {
    use std::time::Duration;
    use tessera_store::{CacheConfig, DiskCache};

    let Some(mnt) = Mount::tmpfs("size=1M") else { return };
    let retry = Duration::from_millis(300);
    let cache = DiskCache::open(&CacheConfig::new(mnt.path.join("cache")).with_full_retry(retry)).unwrap();
    let blobs: Vec<Vec<u8>> = (0..8).map(|i| Rng::new(10 + i).bytes(300 << 10)).collect();
    for (i, b) in blobs.iter().enumerate() {
        let d = Sha256Digest::of(b);
        let got = cache.fetch_blob(&d, || Ok(b.clone())).unwrap();
        assert!(got == *b, "blob {i}: the origin's bytes, cached or not");
    }
    let s = cache.stats();
    // 1 MiB holds three 300 KiB blobs at most; the write that finds it full starts one episode
    // and the writes after it within the interval are skipped, not tried.
    assert!(s.fills <= 3, "{s:?}");
    assert_eq!(s.full_episodes, 1, "{s:?}");
    assert!(s.full_skips >= 8 - 3 - 1, "{s:?}");
    // Reads of what was cached still come from the cache.
    let before = s.hits;
    for b in &blobs {
        let d = Sha256Digest::of(b);
        assert!(cache.fetch_blob(&d, || Ok(b.clone())).unwrap() == *b);
    }
    assert_eq!(cache.stats().hits - before, s.fills, "{:?}", cache.stats());
    // Space comes back (the cache evicts everything); after the interval caching resumes.
    cache.trim(0).unwrap();
    std::thread::sleep(retry + Duration::from_millis(50));
    let small = b"small blob".to_vec();
    let fills = cache.stats().fills;
    cache.fetch_blob(&Sha256Digest::of(&small), || Ok(small.clone())).unwrap();
    assert_eq!(cache.stats().fills, fills + 1, "caching resumed: {:?}", cache.stats());
}
