//! Many `tessera` processes on one host sharing one host disk cache (`--cache-dir`), reading
//! the same image cold from a real nginx: every process gets exactly the image's bytes, and
//! nginx's access log proves that no byte of any blob was sent twice (cross-process
//! single-flight). Variants: 8 `tessera export` processes, and 8 `tessera serve` daemons each
//! read whole by its own libblkio client.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use tessera_e2e::daemon::{BlkClient, Daemon};
use tessera_e2e::nginx::{bytes_sent_twice, Nginx};
use tessera_e2e::prng::Prng;
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
fn each_blob_byte_sent_once(origin: &Nginx) -> Result<()> {
    let requests = origin.requests()?;
    let blob_bytes: u64 = requests
        .iter()
        .filter(|r| r.uri.contains("/blobs/"))
        .filter_map(|r| r.sent_interval())
        .map(|(a, b)| b - a)
        .sum();
    ensure!(blob_bytes > 1_000_000, "the fleet fetched only {blob_bytes} blob bytes: was it cold?");
    let twice = bytes_sent_twice(&requests, "/store/blobs/");
    ensure!(twice.is_empty(), "blob bytes sent more than once: {twice:?}\n{}", origin.access_log());
    Ok(())
}

#[test]
fn eight_exports_share_one_cold_cache_and_fetch_each_byte_once() -> Result<()> {
    let f = fixture("fleet-export")?;
    let origin = Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    let cache = f.t.path().join("cache");
    let outs: Vec<PathBuf> = (0..FLEET).map(|i| f.t.path().join(format!("out{i}.raw"))).collect();
    let children = outs
        .iter()
        .map(|out| {
            tessera::command(["export", "demo", "--store", &url, "--cache-dir", path_str(&cache)?])
                .arg("-o")
                .arg(out)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .context("spawn tessera export")
        })
        .collect::<Result<Vec<_>>>()?;
    for (i, child) in children.into_iter().enumerate() {
        let o = child.wait_with_output()?;
        ensure!(o.status.success(), "export {i}: {} — {}", o.status, String::from_utf8_lossy(&o.stderr));
    }
    for (i, out) in outs.iter().enumerate() {
        ensure!(fs::read(out)? == f.raw, "export {i} differs from the local export");
    }
    each_blob_byte_sent_once(&origin)?;
    ensure!(cached_chunks(&cache)?.len() > 50, "the chunks are in the shared cache");
    ensure!(fs::read_dir(cache.join("v1/locks"))?.count() == 0, "lock files are removed after use");
    ensure!(fs::read_dir(cache.join("v1/tmp"))?.count() == 0, "no temp files are left");
    Ok(())
}

#[test]
fn eight_daemons_share_one_cold_cache_and_fetch_each_byte_once() -> Result<()> {
    let f = fixture("fleet-serve")?;
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
    each_blob_byte_sent_once(&origin)?;
    ensure!(fs::read_dir(cache.join("v1/locks"))?.count() == 0, "lock files are removed after use");
    Ok(())
}
