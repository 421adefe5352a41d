//! `tessera serve --metrics` over an http:// store served by a real nginx, with a host disk
//! cache: the origin request and byte counters equal nginx's access log, every chunk is fetched
//! from the origin once into the cache (tier `origin`) and read from it by a second daemon
//! (tier `disk_cache`) without a byte from the origin.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{ensure, Context, Result};
use tessera_e2e::daemon::BlkClient;
use tessera_e2e::metrics::{scrape, spawn_with_metrics, Scrape};
use tessera_e2e::nginx::Nginx;
use tessera_e2e::prng::Prng;
use tessera_e2e::proxy::{Fault, Proxy, ProxyConfig};
use tessera_e2e::tessera;
use tessera_e2e::testutil::{tmp, Killed};

const MIB: usize = 1 << 20;

/// Run `cmd` (a `serve --socket socket` without `--metrics`), read the whole device through
/// libblkio, scrape: the metrics and the device's bytes.
fn read_and_scrape(cmd: &mut Command, socket: &Path) -> Result<(Scrape, Vec<u8>)> {
    let (child, addr) = spawn_with_metrics(cmd.arg("--socket").arg(socket).stdout(Stdio::null()))?;
    let _serving = Killed(child);
    let mut c = BlkClient::connect(socket, 1, true)?;
    let (bytes, failed) = c.read_device(MIB, 8)?;
    ensure!(failed.is_empty(), "failed reads {failed:?}");
    drop(c);
    Ok((scrape(&addr)?, bytes))
}

/// Serve `url` (tag `demo`, read-only), with `--cache-dir cache` if given; read it all, scrape.
fn serve_and_read(url: &str, cache: Option<&Path>, socket: &Path) -> Result<(Scrape, usize)> {
    let _ = fs::remove_file(socket);
    let mut cmd = tessera::command(["serve", "demo", "--read-only", "--store", url]);
    if let Some(cache) = cache {
        cmd.arg("--cache-dir").arg(cache);
    }
    let (m, bytes) = read_and_scrape(&mut cmd, socket)?;
    Ok((m, bytes.len()))
}

/// Build a store `store` in `t` of one random file of `len` bytes (label `label`, tag `tag`,
/// 64 KiB chunks): the store and the names of its blobs, the pack (the largest) first.
fn build_random(t: &Path, label: &str, len: usize, tag: &str) -> Result<(PathBuf, String, Vec<String>)> {
    let (src, store) = (t.join("src"), t.join("store"));
    fs::create_dir_all(&src)?;
    fs::write(src.join("random.bin"), Prng::from_label(label).bytes(len))?;
    tessera::build(&src, &store, &["--tag", tag, "--chunk-size", "64K", "--size", "32M"])?;
    let mut blobs: Vec<(u64, String)> = Vec::new();
    for e in fs::read_dir(store.join("blobs/sha256"))? {
        let e = e?;
        blobs.push((e.metadata()?.len(), e.file_name().to_string_lossy().into_owned()));
    }
    blobs.sort();
    let (_, pack) = blobs.pop().context("no blobs")?;
    Ok((store, pack, blobs.into_iter().map(|(_, b)| b).collect()))
}

#[test]
fn origin_and_disk_cache_metrics_match_nginx() -> Result<()> {
    let t = tmp("metrics-origin")?;
    let (src, store) = (t.path().join("src"), t.path().join("store"));
    let mut rng = Prng::from_label("metrics-origin");
    fs::create_dir_all(&src)?;
    fs::write(src.join("random.bin"), rng.bytes(1_200_000))?;
    fs::write(src.join("text.txt"), rng.text(400_000))?;
    tessera::build(&src, &store, &["--tag", "demo", "--chunk-size", "64K", "--size", "64M"])?;
    let origin = Nginx::serve(&store, "store")?;
    let cache = t.path().join("cache");
    let socket = t.path().join("vm.sock");

    // Cold: everything comes from nginx once, through the cache.
    let (m, device) = serve_and_read(&origin.url(), Some(&cache), &socket)?;
    let logged = origin.requests()?;
    let sent: u64 = logged.iter().map(|r| r.body_bytes).sum();
    let v = |name: &str, labels: &[(&str, &str)]| m.value(name, labels);
    ensure!(v("tessera_origin_requests_total", &[])? == logged.len() as f64, "requests vs nginx: {logged:?}");
    ensure!(v("tessera_origin_bytes_total", &[])? == sent as f64, "bytes vs nginx ({sent})");
    ensure!(v("tessera_origin_retries_total", &[])? == 0.0);
    let chunks = v("tessera_image_chunks", &[])?;
    ensure!(chunks >= 20.0, "1.6 MB in 64 KiB chunks: {chunks}");
    ensure!(v("tessera_memory_tier_fills_total", &[])? == chunks, "each chunk fetched into memory once");
    // Every chunk (and the image's blobs) missed the disk cache and was filled from the origin.
    let fills = v("tessera_tier_hits_total", &[("tier", "origin")])?;
    ensure!(fills >= chunks, "origin fills {fills} vs {chunks} chunks");
    ensure!(v("tessera_tier_misses_total", &[("tier", "disk_cache")])? >= chunks);
    ensure!(v("tessera_tier_bytes_total", &[("tier", "origin")])? <= sent as f64);
    ensure!(v("tessera_request_bytes_total", &[("type", "read")])? == device as f64);
    // The cache holds what it filled (no bound: nothing evicted).
    let held = v("tessera_disk_cache_bytes", &[])?;
    ensure!(held >= v("tessera_tier_bytes_total", &[("tier", "origin")])?, "cache holds {held}");
    ensure!(v("tessera_disk_cache_evictions_total", &[])? == 0.0);

    // Warm: a second daemon on the same cache reads every chunk from it, none from nginx.
    let before = origin.requests()?.len();
    let (m, _) = serve_and_read(&origin.url(), Some(&cache), &socket)?;
    let v = |name: &str, labels: &[(&str, &str)]| m.value(name, labels);
    ensure!(v("tessera_tier_hits_total", &[("tier", "origin")])? == 0.0, "nothing filled from the origin");
    ensure!(v("tessera_tier_hits_total", &[("tier", "disk_cache")])? >= chunks, "chunks from the disk cache");
    ensure!(v("tessera_tier_errors_total", &[("tier", "disk_cache")])? == 0.0);
    let chunk_gets = origin.requests()?[before..].iter().filter(|r| !r.ranges.is_empty()).count();
    ensure!(chunk_gets == 0, "no ranged GET reached nginx when warm");
    ensure!(
        v("tessera_origin_requests_total", &[])? == (origin.requests()?.len() - before) as f64,
        "warm requests (tag and entry lookups) vs nginx"
    );
    Ok(())
}

#[test]
fn origin_errors_and_durations_match_the_faults_injected() -> Result<()> {
    let t = tmp("metrics-origin-errors")?;
    // The pack is the largest blob; the others (image record and the like) are read whole.
    let (store, pack, blobs) = build_random(t.path(), "metrics-origin-errors", 1_000_000, "demo")?;
    let origin = Nginx::serve(&store, "store")?;
    let proxy = Proxy::start(origin.addr(), ProxyConfig::default())?;
    // Two 503s and two resets mid-body on the pack's ranged GETs; one flipped byte in each
    // blob read whole (its digest fails, it is fetched again).
    let blob_path = |hex: &str| format!("blobs/sha256/{hex}");
    proxy.inject(&blob_path(&pack), Fault::Status(503), 2);
    proxy.inject(&blob_path(&pack), Fault::Reset { after: 1000 }, 2);
    for b in &blobs {
        proxy.inject(&blob_path(b), Fault::Corrupt { at: 0 }, 1);
    }
    let (m, _) = serve_and_read(&proxy.url("store"), None, &t.path().join("vm.sock"))?;
    let log = proxy.log();
    let applied =
        |f: fn(&Fault) -> bool| log.iter().filter(|r| r.fault.as_ref().is_some_and(f)).count() as f64;
    let (statuses, resets) =
        (applied(|f| matches!(f, Fault::Status(_))), applied(|f| matches!(f, Fault::Reset { .. })));
    let corrupted = applied(|f| matches!(f, Fault::Corrupt { .. }));
    ensure!(statuses == 2.0 && resets == 2.0, "faults applied: {log:#?}");
    ensure!(corrupted >= 1.0, "no whole blob was read: {log:#?}");
    let v = |name: &str, labels: &[(&str, &str)]| m.value(name, labels);
    let errors = |kind: &str| v("tessera_origin_errors_total", &[("kind", kind)]);
    ensure!(errors("status")? == statuses, "status errors");
    ensure!(errors("transport")? == resets, "transport errors");
    ensure!(errors("digest")? == corrupted, "digest errors");
    ensure!(errors("timeout")? == 0.0 && errors("body")? == 0.0);
    // Every failure was retried (the default policy allows more tries than any blob failed).
    ensure!(v("tessera_origin_retries_total", &[])? == statuses + resets + corrupted, "retries");
    let requests = v("tessera_origin_requests_total", &[])?;
    ensure!(requests == log.len() as f64, "requests {requests} vs the proxy's log: {log:#?}");
    let timed = v("tessera_origin_request_duration_seconds_count", &[])?;
    ensure!(timed == requests, "{timed} requests timed of {requests}");
    ensure!(v("tessera_origin_request_duration_seconds_sum", &[])? > 0.0);
    Ok(())
}

/// A `docker://` store: the registry client's requests, retries, status errors and bytes reach
/// the same `tessera_origin_*` families (the test proxy in front of the CNCF registry answers
/// 503 twice for the pack).
#[test]
fn registry_origin_counts_requests_retries_and_errors() -> Result<()> {
    tessera_e2e::registry::require_registry()?;
    let t = tmp("metrics-registry")?;
    let (store, pack, _) = build_random(t.path(), "metrics-registry", 800_000, "v1")?;
    let reg = tessera_e2e::registry::Registry::start()?;
    let store_arg = store.to_str().context("utf-8 path")?;
    let dest = format!("docker://{}/metrics:v1", reg.addr());
    let o = tessera::run(["push", "v1", "--store", store_arg, &dest])?;
    ensure!(o.status.success(), "push: {}", String::from_utf8_lossy(&o.stderr));
    let proxy = Proxy::start(reg.addr(), ProxyConfig::default())?;
    proxy.inject(&format!("/blobs/sha256:{pack}"), Fault::Status(503), 2);

    let mut cmd = tessera::command(["serve", "v1", "--read-only", "--store"]);
    cmd.arg(format!("docker://{}/metrics", proxy.addr()));
    let (m, device) = read_and_scrape(&mut cmd, &t.path().join("vm.sock"))?;
    ensure!(proxy.faults_left() == 0, "the 503s were not all met");
    let v = |name: &str, labels: &[(&str, &str)]| m.value(name, labels);
    let errors = |kind: &str| v("tessera_origin_errors_total", &[("kind", kind)]);
    ensure!(errors("status")? == 2.0, "status errors");
    for kind in ["transport", "timeout", "body", "digest"] {
        ensure!(errors(kind)? == 0.0, "{kind} errors");
    }
    ensure!(v("tessera_origin_retries_total", &[])? == 2.0, "retries");
    let log = proxy.log();
    let requests = v("tessera_origin_requests_total", &[])?;
    ensure!(requests == log.len() as f64, "requests vs the proxy: {log:#?}");
    ensure!(v("tessera_origin_request_duration_seconds_count", &[])? == requests, "every try timed");
    // Every chunk came from the registry (no disk cache): at least the pack's stored bytes the
    // device needed, which is more than nothing and at most what the proxy relayed.
    let bytes = v("tessera_origin_bytes_total", &[])?;
    ensure!(
        bytes > 0.0 && bytes <= proxy.stats().body_bytes as f64,
        "origin bytes {bytes} vs the proxy's {:?}",
        proxy.stats()
    );
    ensure!(!device.is_empty());
    Ok(())
}

#[test]
fn scrape_reports_http_errors() -> Result<()> {
    // A port nobody listens on: connecting fails with a clear error.
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?.to_string();
    drop(l);
    let e = scrape(&addr).err().context("scrape of a closed port succeeded")?;
    ensure!(e.to_string().contains(&addr), "{e:#}");
    Ok(())
}
