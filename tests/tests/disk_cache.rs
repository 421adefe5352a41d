//! The host disk cache (`--cache-dir`) against a real nginx, with many `tessera` processes:
//!
//! - 8 processes on one host sharing one cache read the same image cold (8 `tessera export`s;
//!   8 `tessera serve` daemons each read whole by its own libblkio client): every process gets
//!   exactly the image's bytes, and nginx's access log proves that no byte of any blob was sent
//!   twice (cross-process single-flight);
//! - a workload larger than `--cache-size` keeps the directory within it (measured on disk,
//!   during and after, with concurrent exports; and a `tessera serve` read whole by libblkio); `tessera cache gc` removes corrupt entries and
//!   leftovers and trims;
//! - a process killed (-9) while it holds a miss lock does not block the next one.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use tessera_e2e::daemon::{BlkClient, Daemon};
use tessera_e2e::nginx::{bytes_sent_twice, Nginx};
use tessera_e2e::prng::Prng;
use tessera_e2e::proxy::{Fault, Proxy, ProxyConfig};
use tessera_e2e::tessera;
use tessera_e2e::testutil::{cached_chunks, tmp};

const FLEET: usize = 8;

struct Fixture {
    t: tempfile::TempDir,
    store: PathBuf,
    raw: Vec<u8>,
}

/// About 5 MiB of file data in 64 KiB chunks (incompressible and text), on a small device so
/// that reading it whole eight times stays cheap.
fn fixture(name: &str) -> Result<Fixture> {
    let t = tmp(name)?;
    let (src, store) = (t.path().join("src"), t.path().join("store"));
    let mut rng = Prng::from_label("cache-fleet");
    fs::create_dir_all(src.join("sub"))?;
    fs::write(src.join("random.bin"), rng.bytes(3_000_000))?;
    fs::write(src.join("text.txt"), rng.text(2_000_000))?;
    for i in 0..20 {
        fs::write(src.join("sub").join(format!("f{i}")), rng.bytes(5_000 + i * 3_000))?;
    }
    tessera::build(&src, &store, &["--tag", "demo", "--chunk-size", "64K", "--free", "8M"])?;
    let out = t.path().join("local.raw");
    tessera::export("demo", &store, &out)?;
    let raw = fs::read(&out)?;
    Ok(Fixture { t, store, raw })
}

fn path_str(p: &Path) -> Result<&str> {
    p.to_str().context("non-UTF-8 path")
}

/// The access log must show blob bytes sent (the fleet started cold) and none sent twice.
fn each_blob_byte_sent_once(origin: &Nginx, store: &Path) -> Result<()> {
    let requests = origin.requests()?;
    let blob_bytes: u64 = requests
        .iter()
        .filter(|r| r.uri.contains("/blobs/"))
        .flat_map(|r| r.sent_intervals())
        .map(|(a, b)| b - a)
        .sum();
    ensure!(blob_bytes > 1_000_000, "the fleet fetched only {blob_bytes} blob bytes: was it cold?");
    let twice = bytes_sent_twice(&requests, "/store/blobs/");
    ensure!(twice.is_empty(), "blob bytes sent more than once: {twice:?}\n{}", origin.access_log());
    let stored: u64 =
        fs::read_dir(store.join("blobs/sha256"))?.map(|e| Ok(e?.metadata()?.len())).sum::<Result<u64>>()?;
    eprintln!(
        "the fleet fetched {blob_bytes} blob bytes in {} requests; the store holds {stored}",
        requests.iter().filter(|r| r.uri.contains("/blobs/")).count()
    );
    ensure!(blob_bytes <= stored, "{blob_bytes} blob bytes fetched, more than the store's {stored}");
    Ok(())
}

#[test]
fn eight_exports_share_one_cold_cache_and_fetch_each_byte_once() -> Result<()> {
    let f = fixture("cache-fleet-export")?;
    let origin = Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    let cache = f.t.path().join("cache");
    let outs: Vec<PathBuf> = (0..FLEET).map(|i| f.t.path().join(format!("out{i}.raw"))).collect();
    let children = outs.iter().map(|o| spawn_export(&url, &cache, None, o)).collect::<Result<Vec<_>>>()?;
    for (i, child) in children.into_iter().enumerate() {
        wait_ok(child, &format!("export {i}"))?;
    }
    for (i, out) in outs.iter().enumerate() {
        ensure!(fs::read(out)? == f.raw, "export {i} differs from the local export");
    }
    each_blob_byte_sent_once(&origin, &f.store)?;
    ensure!(cached_chunks(&cache)?.len() > 50, "the chunks are in the shared cache");
    ensure!(fs::read_dir(cache.join("v1/locks"))?.count() == 0, "lock files are removed after use");
    ensure!(fs::read_dir(cache.join("v1/tmp"))?.count() == 0, "no temp files are left");
    Ok(())
}

#[test]
fn eight_daemons_share_one_cold_cache_and_fetch_each_byte_once() -> Result<()> {
    let f = fixture("cache-fleet-serve")?;
    let origin = Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    let cache = f.t.path().join("cache");
    let c = path_str(&cache)?.to_owned();
    // Start all daemons at once: each opens the image (entry, record, prefix, pack index) cold.
    let daemons = std::thread::scope(|s| {
        let starts: Vec<_> = (0..FLEET)
            .map(|i| {
                let (url, c) = (url.clone(), c.clone());
                let socket = f.t.path().join(format!("d{i}.sock"));
                s.spawn(move || {
                    Daemon::start(
                        "demo",
                        &url,
                        &socket,
                        &["--read-only", "--cache-dir", &c, "--mem-cache", "0"],
                    )
                })
            })
            .collect();
        starts.into_iter().map(|h| h.join().expect("start thread")).collect::<Result<Vec<_>>>()
    })?;
    // One libblkio client per daemon, all reading the whole device at once.
    std::thread::scope(|s| -> Result<()> {
        let reads: Vec<_> = daemons
            .iter()
            .map(|d| {
                s.spawn(move || -> Result<Vec<u8>> {
                    let mut client = BlkClient::connect(d.socket(), 1, true)?;
                    let (bytes, failed) = client.read_device(1 << 20, 4)?;
                    ensure!(failed.is_empty(), "failed reads {failed:?}");
                    Ok(bytes)
                })
            })
            .collect();
        for (i, h) in reads.into_iter().enumerate() {
            let bytes = h.join().expect("client thread")?;
            ensure!(bytes == f.raw, "daemon {i}: the device differs from `tessera export`");
        }
        Ok(())
    })?;
    for d in daemons {
        d.stop()?;
    }
    each_blob_byte_sent_once(&origin, &f.store)?;
    ensure!(fs::read_dir(cache.join("v1/locks"))?.count() == 0, "lock files are removed after use");
    Ok(())
}

/// Allocated bytes (st_blocks) of the regular files under `dir`, recursively; files vanishing
/// during the walk (evicted) are skipped.
fn allocated(dir: &Path) -> u64 {
    let Ok(rd) = fs::read_dir(dir) else { return 0 };
    rd.flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => allocated(&e.path()),
            Ok(m) if m.is_file() => m.blocks() * 512,
            _ => 0,
        })
        .sum()
}

/// Allocated bytes of the cache's entries (blobs, chunks, image entries, tags) — what the bound
/// covers — measured on disk. The walk holds the cache-wide lock (`v1/index.lock`, shared) so
/// that it sees a consistent state: entries are published and evicted under that lock held
/// exclusively, and a walk racing them could count an evicted file and its replacement.
fn entry_bytes(cache: &Path) -> u64 {
    let lock = fs::File::open(cache.join("v1/index.lock")).ok();
    if let Some(l) = &lock {
        let _ = rustix::fs::flock(l, rustix::fs::FlockOperation::LockShared);
    }
    ["blobs", "chunks", "origins"].iter().map(|d| allocated(&cache.join("v1").join(d))).sum()
}

fn spawn_export(url: &str, cache: &Path, size: Option<&str>, out: &Path) -> Result<Child> {
    let mut c = tessera::command(["export", "demo", "--store", url, "--cache-dir", path_str(cache)?]);
    if let Some(size) = size {
        c.args(["--cache-size", size]);
    }
    c.arg("-o").arg(out).stdout(Stdio::null()).stderr(Stdio::piped());
    c.spawn().context("spawn tessera export")
}

fn wait_ok(child: Child, what: &str) -> Result<()> {
    let o = child.wait_with_output()?;
    ensure!(o.status.success(), "{what}: {} — {}", o.status, String::from_utf8_lossy(&o.stderr));
    Ok(())
}

#[test]
fn a_workload_larger_than_cache_size_stays_within_it() -> Result<()> {
    let f = fixture("cache-bound")?;
    let origin = Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    let cache = f.t.path().join("cache");
    const BOUND: u64 = 2 << 20; // the image's chunks are about 5 MiB
                                // Four processes at once, each reading the whole image through a 2 MiB cache, while a
                                // sampler measures the directory.
    let stop = AtomicBool::new(false);
    let peak = AtomicU64::new(0);
    std::thread::scope(|s| -> Result<()> {
        s.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                peak.fetch_max(entry_bytes(&cache), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        let run = || -> Result<()> {
            let outs: Vec<PathBuf> = (0..4).map(|i| f.t.path().join(format!("out{i}.raw"))).collect();
            let children = outs
                .iter()
                .map(|o| spawn_export(&url, &cache, Some("2MiB"), o))
                .collect::<Result<Vec<_>>>()?;
            for (i, c) in children.into_iter().enumerate() {
                wait_ok(c, &format!("bounded export {i}"))?;
            }
            for (i, o) in outs.iter().enumerate() {
                ensure!(fs::read(o)? == f.raw, "bounded export {i} differs from the local export");
            }
            Ok(())
        };
        let r = run();
        stop.store(true, Ordering::SeqCst);
        r
    })?;
    let peak = peak.load(Ordering::SeqCst);
    let now = entry_bytes(&cache);
    let index = fs::metadata(cache.join("v1/index"))?.len();
    eprintln!(
        "bound {BOUND}, entries on disk now {now}, peak {peak}, index {index} bytes, whole dir {}",
        allocated(&cache)
    );
    ensure!(peak <= BOUND, "the entries reached {peak} bytes on disk, over the {BOUND}-byte bound");
    ensure!(
        now <= BOUND && now > BOUND / 2,
        "entries on disk {now} (bound {BOUND}): not trimmed, or trimmed far too much"
    );
    ensure!(index < 256 << 10, "the index is {index} bytes");
    ensure!(!cached_chunks(&cache)?.is_empty());

    // A later run without a bound grows the cache; `cache gc --cache-size` trims it back.
    let out = f.t.path().join("unbounded.raw");
    wait_ok(spawn_export(&url, &cache, None, &out)?, "unbounded export")?;
    ensure!(entry_bytes(&cache) > BOUND, "without a bound the whole image is cached");
    let o = tessera::run(["cache", "gc", "--cache-dir", path_str(&cache)?, "--cache-size", "1M", "--json"])?;
    ensure!(o.status.success(), "cache gc: {}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    let after = entry_bytes(&cache);
    ensure!(after <= 1 << 20, "after gc the entries take {after} bytes");
    ensure!(
        v["bytes_after"].as_u64() == Some(after),
        "gc reports {} bytes, the disk holds {after}",
        v["bytes_after"]
    );
    ensure!(
        v["evicted_bytes"].as_u64().is_some_and(|b| b > 0) && v["freed_bytes"] == v["evicted_bytes"],
        "{v}"
    );
    // Metadata is evicted last: the record, prefix and pack index survive a 1 MiB trim.
    let blobs = allocated(&cache.join("v1/blobs"));
    ensure!(blobs > 0, "metadata blobs were evicted before chunks");
    Ok(())
}

#[test]
fn a_daemon_with_a_small_cache_serves_the_whole_image_within_it() -> Result<()> {
    let f = fixture("cache-bound-serve")?;
    let origin = Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    let cache = f.t.path().join("cache");
    const BOUND: u64 = 1 << 20;
    let socket = f.t.path().join("vm.sock");
    let args = ["--read-only", "--cache-dir", path_str(&cache)?, "--cache-size", "1M", "--mem-cache", "0"];
    let d = Daemon::start("demo", &url, &socket, &args)?;
    let mut client = BlkClient::connect(d.socket(), 1, true)?;
    let (bytes, failed) = client.read_device(1 << 20, 4)?;
    ensure!(failed.is_empty(), "failed reads {failed:?}");
    ensure!(bytes == f.raw, "the device differs from `tessera export`");
    drop(client);
    d.stop()?;
    let on_disk = entry_bytes(&cache);
    ensure!(on_disk <= BOUND && on_disk > BOUND / 2, "entries on disk {on_disk}, bound {BOUND}");
    Ok(())
}

#[test]
fn gc_heals_corruption_and_removes_leftovers() -> Result<()> {
    let f = fixture("cache-gc")?;
    let origin = Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    let cache = f.t.path().join("cache");
    let out = f.t.path().join("a.raw");
    wait_ok(spawn_export(&url, &cache, None, &out)?, "warm the cache")?;
    let chunks = cached_chunks(&cache)?;
    let victim = chunks.first().context("no chunk")?;
    let mut bytes = fs::read(victim)?;
    bytes[100] ^= 0x5a;
    fs::write(victim, &bytes)?;
    // A dead writer's temp file (older than the grace period a live writer gets between creating
    // and locking it).
    let dead = fs::File::create(cache.join("v1/tmp/4242-0-0.tmp"))?;
    std::io::Write::write_all(&mut &dead, &[7u8; 10_000])?;
    dead.set_modified(std::time::SystemTime::now() - Duration::from_secs(60))?;
    drop(dead);
    fs::write(cache.join("v1/locks/blob-dead"), b"")?; // a dead fetcher's lock file
    let o = tessera::run(["cache", "gc", "--cache-dir", path_str(&cache)?])?;
    let text = String::from_utf8_lossy(&o.stdout);
    ensure!(o.status.success(), "cache gc: {}", String::from_utf8_lossy(&o.stderr));
    ensure!(text.contains("Freed") && text.contains("KiB"), "human-readable report expected: {text}");
    ensure!(!victim.exists(), "the corrupt chunk is removed");
    ensure!(fs::read_dir(cache.join("v1/tmp"))?.count() == 0, "temp files removed");
    ensure!(fs::read_dir(cache.join("v1/locks"))?.count() == 0, "stale lock files removed");
    let o = tessera::run(["cache", "gc", "--cache-dir", path_str(&cache)?, "--json"])?;
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    ensure!(v["freed_bytes"] == 0 && v["corrupt_entries"] == 0, "a second gc finds nothing: {v}");
    // The next read refetches just that chunk and the cache is whole again.
    let before = origin.requests()?.len();
    let out = f.t.path().join("b.raw");
    wait_ok(spawn_export(&url, &cache, None, &out)?, "export after gc")?;
    ensure!(fs::read(&out)? == f.raw, "export after gc differs");
    let refetched = origin.requests()?[before..].iter().filter(|r| r.status == 206).count();
    ensure!(refetched == 1, "expected one chunk refetched, got {refetched}");
    // Usage errors: exit 2.
    let o = tessera::run(["cache", "gc", "--cache-dir", path_str(&cache)?, "--cache-size", "12X"])?;
    ensure!(o.status.code() == Some(2), "bad size: {}", o.status);
    Ok(())
}

/// Whether somebody holds an exclusive flock on `path`.
fn lock_is_held(path: &Path) -> bool {
    let Ok(f) = fs::File::open(path) else { return false };
    matches!(
        rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockShared),
        Err(rustix::io::Errno::WOULDBLOCK)
    )
}

#[test]
fn a_process_killed_mid_fetch_does_not_block_the_next() -> Result<()> {
    let f = fixture("cache-kill")?;
    let origin = Nginx::serve(&f.store, "store")?;
    let proxy = Proxy::start(origin.addr(), ProxyConfig::default())?;
    let url = proxy.url("store");
    let cache = f.t.path().join("cache");
    // The record (its digest is the image ID) is the first blob an export fetches: its request
    // never gets an answer.
    let entry_path = fs::read_dir(f.store.join("images"))?.next().context("no image entry")??.path();
    let entry: serde_json::Value = serde_json::from_slice(&fs::read(entry_path)?)?;
    let record = entry["record"].as_str().context("record digest")?.trim_start_matches("sha256:").to_owned();
    proxy.inject(&format!("/blobs/sha256/{record}"), Fault::Stall, 1);
    let mut stuck = spawn_export(&url, &cache, None, &f.t.path().join("stuck.raw"))?;
    let lock = cache.join("v1/locks").join(format!("blob-{record}"));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !lock_is_held(&lock) {
        if let Some(status) = stuck.try_wait()? {
            bail!("the stalled export exited ({status}) before taking its lock");
        }
        ensure!(
            Instant::now() < deadline,
            "the stalled export never held {}; locks: {:?}; proxy log: {:?}",
            lock.display(),
            fs::read_dir(cache.join("v1/locks"))
                .map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>()),
            proxy.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    stuck.kill()?; // SIGKILL, mid-fetch, lock held
    stuck.wait()?;
    ensure!(lock.exists() && !lock_is_held(&lock), "the dead process's lock file stays, released");
    // The next process is not blocked: it finishes long before the 60 s request timeout the
    // stalled fetch would have waited for.
    let started = Instant::now();
    let out = f.t.path().join("next.raw");
    wait_ok(spawn_export(&url, &cache, None, &out)?, "export after the kill")?;
    let took = started.elapsed();
    ensure!(took < Duration::from_secs(20), "the next export took {took:?}");
    ensure!(fs::read(&out)? == f.raw, "the export after the kill differs");
    ensure!(!lock.exists(), "the next holder removed the stale lock file");
    Ok(())
}
