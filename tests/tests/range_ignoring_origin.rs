//! An origin that ignores `Range` (Python's `http.server` answers a ranged GET with 200 and the
//! whole blob): without `--cache-dir` the export is refused with an error that says why; with
//! one, each blob crosses the wire once (the server's access log) and the export is exact.

use std::fs;
use std::path::Path;

use anyhow::{ensure, Context, Result};
use tessera_e2e::prng::Prng;
use tessera_e2e::pyhttp::PyHttp;
use tessera_e2e::tessera;
use tessera_e2e::testutil::built_store;

/// Several packs' worth of 64 KiB chunks.
fn tree(dir: &Path) -> Result<()> {
    let mut rng = Prng::from_label("range-ignoring");
    fs::create_dir_all(dir.join("sub"))?;
    fs::write(dir.join("random.bin"), rng.bytes(3_000_000))?;
    fs::write(dir.join("text.txt"), rng.text(900_000))?;
    fs::write(dir.join("sub/small"), b"hello\n")?;
    Ok(())
}

fn export(url: &str, out: &Path, cache: Option<&Path>) -> Result<std::process::Output> {
    let mut args = vec!["export".into(), "demo".into(), "--store".into(), url.to_owned(), "-o".into()];
    args.push(out.to_str().context("utf-8 path")?.to_owned());
    if let Some(c) = cache {
        args.extend(["--cache-dir".into(), c.to_str().context("utf-8 path")?.to_owned()]);
    }
    tessera::run(&args)
}

#[test]
fn range_ignoring_origin_refused_without_a_cache_fetched_once_with_one() -> Result<()> {
    let f = built_store("range-ignoring", "demo", "64K", tree)?;
    let origin = PyHttp::serve(&f.store)?;
    let url = origin.url();

    let o = export(&url, &f.t.path().join("no-cache.raw"), None)?;
    let stderr = String::from_utf8_lossy(&o.stderr);
    ensure!(o.status.code() == Some(1), "export without a cache: {} — {stderr}", o.status);
    ensure!(
        stderr.contains("ignores Range requests") && stderr.contains("--cache-dir"),
        "the error does not say why: {stderr}"
    );
    eprintln!("without --cache-dir: {}", stderr.trim());

    let cache = f.t.path().join("cache");
    let log_before = origin.access_log().lines().count();
    let out = f.t.path().join("cached.raw");
    let o = export(&url, &out, Some(&cache))?;
    ensure!(o.status.success(), "export with a cache: {} — {}", o.status, String::from_utf8_lossy(&o.stderr));
    ensure!(
        fs::read(&out)? == f.local_raw,
        "export through a Range-ignoring origin differs from the local one"
    );
    let log: Vec<String> = origin.access_log().lines().skip(log_before).map(str::to_owned).collect();
    let mut blobs = Vec::new();
    for e in fs::read_dir(f.store.join("blobs/sha256"))? {
        let e = e?;
        blobs.push((e.file_name().to_string_lossy().into_owned(), e.metadata()?.len()));
    }
    let mut fetched_bytes = 0;
    for (hex, len) in &blobs {
        let path = format!("/blobs/sha256/{hex}");
        let n = log.iter().filter(|l| l.contains(&format!("\"GET {path} "))).count();
        ensure!(n <= 1, "{path} ({len} bytes) crossed the wire {n} times:\n{}", log.join("\n"));
        fetched_bytes += if n == 1 { *len } else { 0 };
    }
    // Every pack (the store's large blobs) was needed, each once.
    let packs: Vec<_> = blobs.iter().filter(|(_, len)| *len > 1 << 20).collect();
    ensure!(!packs.is_empty(), "no pack over 1 MiB in the store: {blobs:?}");
    for (hex, _) in &packs {
        let n = log.iter().filter(|l| l.contains(&format!("\"GET /blobs/sha256/{hex} "))).count();
        ensure!(n == 1, "pack {hex} fetched {n} times with the cache");
    }
    ensure!(origin.gets("/refs/demo") >= 1, "the access log is not what the test reads");
    eprintln!(
        "with --cache-dir: {} requests, {} blobs fetched once ({fetched_bytes} bytes; the image is {} bytes)",
        log.len(),
        blobs.len(),
        f.local_raw.len()
    );
    // A second export reads the packs from the cache.
    let before = origin.access_log().lines().count();
    let o = export(&url, &f.t.path().join("again.raw"), Some(&cache))?;
    ensure!(o.status.success(), "second export: {}", String::from_utf8_lossy(&o.stderr));
    let again: Vec<String> = origin.access_log().lines().skip(before).map(str::to_owned).collect();
    ensure!(
        !again.iter().any(|l| packs.iter().any(|(hex, _)| l.contains(hex.as_str()))),
        "a pack crossed the wire again: {again:?}"
    );
    Ok(())
}
