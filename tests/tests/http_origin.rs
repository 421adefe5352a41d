//! An http(s):// store served by a real nginx: export and inspect through Range GETs, read-only
//! (writes exit 2), and the host disk cache (`--cache-dir`): serving with the origin stopped,
//! healing a corrupted cached chunk.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::Output;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use tessera_e2e::nginx::Nginx;
use tessera_e2e::prng::Prng;
use tessera_e2e::tessera;
use tessera_e2e::testutil::{built_store, cached_chunks, BuiltStore};

/// A tree whose data spans many chunks (64 KiB chunks), compressible and not.
fn tree(dir: &Path) -> Result<()> {
    let mut rng = Prng::from_label("http-origin");
    fs::create_dir_all(dir.join("sub"))?;
    fs::write(dir.join("random.bin"), rng.bytes(1_500_000))?;
    fs::write(dir.join("text.txt"), rng.text(700_000))?;
    fs::write(dir.join("sub/small"), b"hello over http\n")?;
    fs::write(dir.join("sub/zeros"), vec![0u8; 300_000])?;
    Ok(())
}

fn fixture(name: &str) -> Result<BuiltStore> {
    built_store(name, "demo", "64K", tree)
}

fn run(args: &[&str]) -> Result<Output> {
    tessera::run(args)
}

fn ok(o: Output, what: &str) -> Result<Output> {
    ensure!(o.status.success(), "{what}: {} — {}", o.status, String::from_utf8_lossy(&o.stderr));
    Ok(o)
}

fn export_http(image: &str, url: &str, out: &Path, cache: Option<&Path>) -> Result<Output> {
    let out_s = out.to_str().context("utf-8 path")?;
    let mut args = vec!["export", image, "--store", url, "-o", out_s];
    let cache_s;
    if let Some(c) = cache {
        cache_s = c.to_str().context("utf-8 path")?.to_owned();
        args.extend(["--cache-dir", cache_s.as_str()]);
    }
    run(&args)
}

fn same_bytes(a: &[u8], path: &Path, what: &str) -> Result<()> {
    let b = fs::read(path)?;
    ensure!(a.len() == b.len(), "{what}: {} bytes, expected {}", b.len(), a.len());
    ensure!(a == b.as_slice(), "{what}: bytes differ from the local export");
    Ok(())
}

#[test]
fn export_over_http_equals_local_export() -> Result<()> {
    let f = fixture("http-export")?;
    let origin = Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    let cache = f.t.path().join("cache");
    for (image, cache) in [("demo", None), (f.id.as_str(), None), ("demo", Some(cache.as_path()))] {
        let out = f.t.path().join("http.raw");
        let before = origin.requests()?.len();
        ok(export_http(image, &url, &out, cache)?, "export over http")?;
        same_bytes(&f.local_raw, &out, &format!("export {image} over http"))?;
        // Resolving the reference and opening the image fetch the entry once (and a tag's ref
        // once), with or without the disk cache.
        let gets = |uri: &str| origin.requests().map(|r| r[before..].iter().filter(|r| r.uri == uri).count());
        let entry = format!("/store/images/{}.json", f.id.hex());
        ensure!(gets(&entry)? == 1, "export {image} (cache {cache:?}): {} GETs of {entry}", gets(&entry)?);
        let refs = usize::from(image == "demo");
        ensure!(
            gets("/store/refs/demo")? == refs,
            "export {image}: {} GETs of the ref",
            gets("/store/refs/demo")?
        );
    }
    // A trailing slash on the base URL is the same store.
    let out = f.t.path().join("slash.raw");
    ok(export_http("demo", &format!("{url}/"), &out, None)?, "export with a trailing slash")?;
    same_bytes(&f.local_raw, &out, "export with a trailing slash")?;
    let log = origin.access_log();
    ensure!(log.lines().any(|l| l.contains(" 206 ") && l.contains("bytes=")), "no ranged GETs in: {log}");
    Ok(())
}

/// A CONNECT proxy on a loopback port: each connection is tunnelled to the `host:port` it asks
/// for. Returns its URL and the count of tunnels opened.
fn connect_proxy() -> Result<(String, Arc<AtomicUsize>)> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let url = format!("http://{}", listener.local_addr()?);
    let tunnels = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&tunnels);
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let count = Arc::clone(&count);
            std::thread::spawn(move || -> std::io::Result<()> {
                let mut reader = BufReader::new(client.try_clone()?);
                let mut first = String::new();
                reader.read_line(&mut first)?;
                let mut line = String::new();
                while reader.read_line(&mut line)? > 2 {
                    line.clear();
                }
                let target =
                    first.strip_prefix("CONNECT ").and_then(|r| r.split(' ').next()).unwrap_or_default();
                let mut writer = client;
                let Ok(upstream) = TcpStream::connect(target) else {
                    return writer.write_all(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n");
                };
                count.fetch_add(1, Ordering::SeqCst);
                writer.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")?;
                let mut up_read = upstream.try_clone()?;
                let mut up_write = upstream;
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut up_read, &mut writer);
                    let _ = writer.shutdown(std::net::Shutdown::Write);
                });
                std::io::copy(&mut reader, &mut up_write)?;
                up_write.shutdown(std::net::Shutdown::Write)
            });
        }
    });
    Ok((url, tunnels))
}

/// Through a proxy from the environment (`HTTP_PROXY`), every request goes through its tunnels,
/// tunnels are reused for later requests, and the export is exact. (Through a proxy ureq's own
/// pool keeps the connections, not the transport's: ureq opens its hop to the proxy through the
/// same connector, and that hop must not be pooled as a connection; docs/store.md.)
#[test]
fn an_export_through_a_connect_proxy_from_the_environment_is_exact() -> Result<()> {
    let f = fixture("http-proxy")?;
    let origin = Nginx::serve(&f.store, "store")?;
    let (proxy, tunnels) = connect_proxy()?;
    let out = f.t.path().join("proxied.raw");
    let mut cmd =
        tessera::command(["export", "demo", "--store", &origin.url(), "-o", out.to_str().context("utf-8")?]);
    for v in ["ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy", "http_proxy", "NO_PROXY", "no_proxy"] {
        cmd.env_remove(v);
    }
    let o = ok(cmd.env("HTTP_PROXY", &proxy).output()?, "export through a proxy")?;
    drop(o);
    same_bytes(&f.local_raw, &out, "export through a proxy")?;
    let (tunnels, requests) = (tunnels.load(Ordering::SeqCst), origin.requests()?.len());
    ensure!(tunnels >= 1, "no request went through the proxy ({requests} reached nginx)");
    ensure!(tunnels < requests, "{tunnels} tunnels for {requests} requests: connections were not reused");
    Ok(())
}

#[test]
fn inspect_over_http_by_tag_and_id() -> Result<()> {
    let f = fixture("http-inspect")?;
    let origin = Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    let local = tessera::inspect_json("demo", &f.store)?;
    for (image, tags) in [("demo", serde_json::json!(["demo"])), (f.id.as_str(), serde_json::json!([]))] {
        let o = ok(run(&["inspect", image, "--store", &url, "--json"])?, "inspect over http")?;
        let mut v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
        tessera::check_inspect(&v, &f.id)?;
        ensure!(
            v["tags"] == tags,
            "inspect {image}: tags {} (an http store lists the tag it resolved)",
            v["tags"]
        );
        let mut l = local.clone();
        v["tags"] = serde_json::Value::Null;
        l["tags"] = serde_json::Value::Null;
        ensure!(v == l, "inspect {image} over http differs from local:\n{v}\n{l}");
    }
    ok(run(&["inspect", "demo", "--store", &url])?, "inspect (text) over http")?;
    // Unknown tag and ID: failures (exit 1) naming the reference.
    for bad in ["nope".to_owned(), format!("sha256:{}", "0".repeat(64))] {
        let o = run(&["inspect", &bad, "--store", &url])?;
        ensure!(o.status.code() == Some(1), "inspect {bad}: {}", o.status);
        ensure!(
            String::from_utf8_lossy(&o.stderr).contains(&bad),
            "inspect {bad}: message lacks the reference"
        );
    }
    Ok(())
}

#[test]
fn writes_to_an_http_store_are_usage_errors() -> Result<()> {
    let f = fixture("http-write")?;
    let origin = Nginx::serve(&f.store, "store")?;
    let src = f.t.path().join("src");
    let o = run(&["build", src.to_str().context("utf-8")?, "--store", &origin.url()])?;
    let e = String::from_utf8_lossy(&o.stderr);
    ensure!(o.status.code() == Some(2), "build into http store: {} — {e}", o.status);
    ensure!(e.contains("read-only") && e.contains(&origin.url()), "message: {e}");
    ensure!(o.stdout.is_empty(), "stdout must be empty");
    Ok(())
}

#[test]
fn a_warm_cache_serves_with_the_origin_stopped() -> Result<()> {
    let f = fixture("http-cache")?;
    let mut origin = Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    let cache = f.t.path().join("cache");
    let out = f.t.path().join("cold.raw");
    ok(export_http("demo", &url, &out, Some(&cache))?, "cold export with a cache")?;
    same_bytes(&f.local_raw, &out, "cold export with a cache")?;
    ok(
        run(&["inspect", "demo", "--store", &url, "--cache-dir", cache.to_str().context("utf-8")?])?,
        "inspect",
    )?;
    origin.stop();
    // Without the cache the origin is needed: a failure naming the URL.
    let o = export_http("demo", &url, &f.t.path().join("x.raw"), None)?;
    ensure!(o.status.code() == Some(1), "export with the origin down and no cache: {}", o.status);
    ensure!(String::from_utf8_lossy(&o.stderr).contains("127.0.0.1"), "the error names the origin");
    for image in ["demo", f.id.as_str()] {
        let out = f.t.path().join("warm.raw");
        ok(export_http(image, &url, &out, Some(&cache))?, "export with the origin down")?;
        same_bytes(&f.local_raw, &out, &format!("export {image} from the cache alone"))?;
    }
    let c = cache.to_str().context("utf-8")?;
    let o =
        ok(run(&["inspect", "demo", "--store", &url, "--cache-dir", c, "--json"])?, "inspect from cache")?;
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    tessera::check_inspect(&v, &f.id)?;
    Ok(())
}

#[test]
fn a_corrupt_cached_chunk_is_healed_never_served() -> Result<()> {
    let f = fixture("http-heal")?;
    let mut origin = Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    let cache = f.t.path().join("cache");
    let out = f.t.path().join("a.raw");
    ok(export_http("demo", &url, &out, Some(&cache))?, "warm the cache")?;
    let chunks = cached_chunks(&cache)?;
    ensure!(chunks.len() > 10, "expected many cached chunks, found {}", chunks.len());
    // Flip bytes in the middle of the largest cached chunk.
    let victim =
        chunks.iter().max_by_key(|p| fs::metadata(p).map(|m| m.len()).unwrap_or(0)).context("no chunk")?;
    let good = fs::read(victim)?;
    let mut bad = good.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 0xa5;
    fs::write(victim, &bad)?;
    let before = origin.access_log().lines().count();
    let out = f.t.path().join("b.raw");
    ok(export_http("demo", &url, &out, Some(&cache))?, "export over a corrupt cache entry")?;
    same_bytes(&f.local_raw, &out, "export over a corrupt cache entry")?;
    ensure!(fs::read(victim)? == good, "the corrupt entry was not replaced by the origin's bytes");
    let log = origin.access_log();
    let refetched = log.lines().skip(before).filter(|l| l.contains(" 206 ")).count();
    ensure!(refetched == 1, "expected exactly one ranged refetch, got {refetched}:\n{log}");
    // With the origin down, a corrupt entry is an error (exit 1), never wrong bytes.
    fs::write(victim, &bad)?;
    origin.stop();
    let out = f.t.path().join("c.raw");
    let o = export_http("demo", &url, &out, Some(&cache))?;
    ensure!(
        o.status.code() == Some(1),
        "corrupt entry and no origin: {} — {}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    ensure!(!victim.exists(), "the corrupt entry is dropped");
    Ok(())
}
