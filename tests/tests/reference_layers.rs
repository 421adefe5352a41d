//! Images that reference the original gzip layers (issue 12, points 4–5): `tessera build
//! oci:… --reference-layers` gives the converted build's image ID, stores the layer blobs as they
//! are (no packs) and a reference pack index, and its export is byte-identical to the converted
//! image's, e2fsck-clean, with zero differences from `umoci unpack`. A layer blob changed in the
//! store afterwards makes the export fail, naming the blob, rather than give other bytes. Served
//! from a remote origin without a disk cache, the spans fetched are kept compressed in half the
//! memory budget, each fetched once.
//!
//! Needs root and umoci (`cargo xtask test` provides them); run with `--test-threads=1`.

use std::fs;
use std::path::Path;

use anyhow::{ensure, Context, Result};
use tessera_e2e::debian::only_dir_mtimes;
use tessera_e2e::metrics::{scrape, spawn_with_metrics};
use tessera_e2e::oci::{build_ok, require_tools, UmociImage};
use tessera_e2e::pipeline::judge_image;
use tessera_e2e::testutil::{same_bytes, tmp, Killed};
use tessera_e2e::{fixtures, tessera};

/// Files under `dir`, recursively.
fn walkdir_count(dir: &Path) -> Result<usize> {
    let mut n = 0;
    for e in fs::read_dir(dir).with_context(|| format!("readdir {}", dir.display()))? {
        let e = e?;
        n += if e.file_type()?.is_dir() { walkdir_count(&e.path())? } else { 1 };
    }
    Ok(n)
}

#[test]
fn reference_layers_match_the_converted_image_and_umoci_unpack() -> Result<()> {
    fixtures::require_root()?;
    require_tools()?;
    let t = tmp("reflayers")?;
    let img = UmociImage::new(t.path(), "t")?;
    img.layer(|root| {
        fixtures::by_name("kinds")?.generate(root)?;
        fs::remove_file(root.join("dev/socket"))?;
        Ok(())
    })?;
    img.layer(|root| {
        // Several checkpoint spans, chunks across their boundaries, and a whiteout.
        let mut text = Vec::with_capacity(5 << 20);
        let mut x = 0x2545_f491u32;
        while text.len() < 5 << 20 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            text.extend_from_slice(format!("line {} of a log {}\n", x % 9973, x >> 20).as_bytes());
        }
        fs::write(root.join("big.log"), &text)?;
        fs::remove_file(root.join("modes/f0644"))?;
        Ok(())
    })?;
    let reference = img.unpack(&t.path().join("unpacked"))?;

    let converted = t.path().join("converted");
    let id = build_ok(&img.source(), &converted, &[])?;
    let store = t.path().join("store");
    let started = std::time::Instant::now();
    let ref_id = build_ok(&img.source(), &store, &["--reference-layers", "--tag", "t"])?;
    eprintln!("build --reference-layers: {:.2}s → {ref_id}", started.elapsed().as_secs_f64());
    ensure!(ref_id == id, "--reference-layers gave {ref_id}, the converted build {id}");
    tessera::check_store(&store)?;

    // The layer blobs are in the store as they are, and nothing else of that size: no packs.
    let mut layer_bytes = 0u64;
    for i in 0..2 {
        let digest = img.layer_digest(i)?;
        let hex = digest.strip_prefix("sha256:").context("layer digest")?;
        let stored = fs::read(store.join("blobs/sha256").join(hex))?;
        ensure!(stored == fs::read(img.blob(&digest)?)?, "layer {i} is not stored as it is");
        layer_bytes += stored.len() as u64;
    }
    let mut other_bytes = 0u64;
    for e in fs::read_dir(store.join("blobs/sha256"))? {
        other_bytes += e?.metadata()?.len();
    }
    other_bytes -= layer_bytes;
    eprintln!("layers {layer_bytes} bytes; prefix, record, index and provenance {other_bytes} bytes");
    ensure!(other_bytes < layer_bytes / 2, "the store holds {other_bytes} bytes besides the layers");

    let raw = t.path().join("ref.raw");
    tessera::export("t", &store, &raw)?;
    let raw_converted = t.path().join("converted.raw");
    tessera::export(id.as_str(), &converted, &raw_converted)?;
    ensure!(same_bytes(&raw, &raw_converted)?, "the reference export differs from the converted export");
    let verdict = judge_image(&reference, &raw, |d| only_dir_mtimes(d, &reference))?;
    let v = tessera::inspect_json("t", &store)?;
    tessera::check_inspect(&v, &ref_id)?;
    eprintln!("zero differences besides {} directory mtimes", verdict.allowed.len());

    // Remote: warm through nginx into a disk cache (whose unit for this image is the checkpoint
    // span), then the cache alone serves the export with nginx stopped; the daemon serves the
    // same bytes from the local store.
    let mut origin = tessera_e2e::nginx::Nginx::serve(&store, "store")?;
    let url = origin.url();
    let cache = t.path().join("cache");
    let s = |p: &Path| p.display().to_string();
    let out = tessera::run(["warm", "t", "--store", &url, "--cache-dir", &s(&cache), "--json"])?;
    ensure!(out.status.success(), "warm: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    ensure!(v["failed_chunks"] == 0 && v["fetched_chunks"].as_u64() > Some(0), "warm: {v}");
    let spans = walkdir_count(&cache.join("v1/spans"))?;
    ensure!(spans as u64 == v["fetched_chunks"].as_u64().unwrap_or(0), "{spans} spans cached: {v}");
    // From the origin with no disk cache: the daemon keeps the spans it fetched, compressed, in
    // half of --mem-cache, and fetches each once: the origin's bytes (spans and windows) are
    // exactly the stored forms' bytes.
    let remote_socket = t.path().join("remote.sock");
    let mut cmd = tessera::command(["serve", "t", "--store", &url, "--read-only", "--mem-cache", "64M"]);
    let (child, addr) =
        spawn_with_metrics(cmd.arg("--socket").arg(&remote_socket).stdout(std::process::Stdio::null()))?;
    let serving = Killed(child);
    let mut c = tessera_e2e::daemon::BlkClient::connect(&remote_socket, 1, true)?;
    let (device, failed) = c.read_device(1 << 20, 8)?;
    ensure!(failed.is_empty(), "daemon reads from the origin failed: {failed:?}");
    ensure!(device == fs::read(&raw_converted)?, "the daemon served other bytes from the origin");
    drop(c);
    // A read returns once its bytes are decoded, a moment before its span's load is counted and
    // kept: scrape until the two agree (or 5 s pass, and the check below fails).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let m = loop {
        let m = scrape(&addr)?;
        let settled = m.value("tessera_memory_span_stored_bytes", &[])?
            == m.value("tessera_tier_bytes_total", &[("tier", "origin")])?;
        if settled || std::time::Instant::now() > deadline {
            break m;
        }
        std::thread::sleep(std::time::Duration::from_millis(50)); // polling interval
    };
    drop(serving);
    let stored = m.value("tessera_memory_span_stored_bytes", &[])?;
    let origin_bytes = m.value("tessera_tier_bytes_total", &[("tier", "origin")])?;
    eprintln!("from the origin: {origin_bytes} bytes; spans kept compressed: {stored} bytes");
    ensure!(stored > 0.0 && stored == origin_bytes, "stored spans {stored} bytes, fetched {origin_bytes}");
    // At most the layers and the windows blob (one of the store's other blobs).
    ensure!(
        stored <= (layer_bytes + other_bytes) as f64,
        "stored {stored} bytes, more than the {layer_bytes} bytes of layers and {other_bytes} of other blobs"
    );
    let decoded = m.value("tessera_memory_span_bytes", &[])?;
    ensure!(decoded > 0.0 && decoded <= f64::from(32u32 << 20), "decoded spans: {decoded} bytes");
    ensure!(
        m.value("tessera_memory_tier_capacity_bytes", &[])? == f64::from(32u32 << 20),
        "the memory tier keeps the other half"
    );
    origin.stop();
    let from_cache = t.path().join("cache.raw");
    let out =
        tessera::run(["export", "t", "--store", &url, "--cache-dir", &s(&cache), "-o", &s(&from_cache)])?;
    ensure!(out.status.success(), "export from the cache: {}", String::from_utf8_lossy(&out.stderr));
    ensure!(same_bytes(&from_cache, &raw_converted)?, "the export from the cache differs");
    let socket = t.path().join("ref.sock");
    let d = tessera_e2e::daemon::Daemon::start("t", s(&store), &socket, &["--read-only"])?;
    let mut c = tessera_e2e::daemon::BlkClient::connect(d.socket(), 1, true)?;
    let (device, failed) = c.read_device(1 << 20, 8)?;
    ensure!(failed.is_empty(), "daemon reads failed: {failed:?}");
    ensure!(device == fs::read(&raw_converted)?, "the daemon served other bytes");
    drop(c);
    d.stop()?;

    // A referenced blob whose bytes changed: the export fails and says which blob.
    let digest = img.layer_digest(1)?;
    let path = store.join("blobs/sha256").join(&digest["sha256:".len()..]);
    let mut bytes = fs::read(&path)?;
    let at = bytes.len() / 2;
    bytes[at] ^= 0x20;
    fs::write(&path, &bytes)?;
    let out = tessera::run([
        "export",
        "t",
        "--store",
        &store.display().to_string(),
        "-o",
        &t.path().join("bad.raw").display().to_string(),
    ])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "export of a changed layer blob succeeded");
    ensure!(
        stderr.contains(&digest["sha256:".len()..]) || stderr.contains(&digest),
        "stderr does not name the blob: {stderr}"
    );
    bytes[at] ^= 0x20;
    fs::write(&path, &bytes)?;

    // The same image recompressed by skopeo as zstd:chunked (many zstd frames and a skippable
    // table of contents per layer): referenced at frame boundaries, the same image and bytes.
    let zlayout = t.path().join("zstd-layout");
    tessera_e2e::oci::skopeo_copy(
        &format!("oci:{}", img.image_ref()),
        &format!("oci:{}:t", zlayout.display()),
        &["--dest-compress-format", "zstd:chunked"],
    )?;
    let zstore = t.path().join("zstd-store");
    let zid =
        build_ok(&format!("oci:{}:t", zlayout.display()), &zstore, &["--reference-layers", "--tag", "t"])?;
    ensure!(zid == id, "zstd:chunked --reference-layers gave {zid}, the converted build {id}");
    let zraw = t.path().join("zstd.raw");
    tessera::export("t", &zstore, &zraw)?;
    ensure!(same_bytes(&zraw, &raw_converted)?, "the zstd:chunked reference export differs");
    // Served from its frames by the daemon too.
    let socket = t.path().join("zstd.sock");
    let d = tessera_e2e::daemon::Daemon::start("t", zstore.display().to_string(), &socket, &["--read-only"])?;
    let mut c = tessera_e2e::daemon::BlkClient::connect(d.socket(), 1, true)?;
    let (device, failed) = c.read_device(1 << 20, 8)?;
    ensure!(failed.is_empty(), "daemon reads failed: {failed:?}");
    ensure!(device == fs::read(&raw_converted)?, "the daemon served other bytes from the zstd layers");
    drop(c);
    d.stop()?;
    Ok(())
}
