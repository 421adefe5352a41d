//! Boot traces, prefetch profiles and cache warming, end to end with the real parts: `tessera serve
//! --record-trace` read by a libblkio client, `tessera profile`, `tessera inspect`, and (below)
//! `tessera warm` against nginx.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};

use anyhow::{ensure, Context, Result};
use tessera_e2e::daemon::{BlkClient, Daemon};
use tessera_e2e::metrics::{scrape, spawn_with_metrics};
use tessera_e2e::prng::Prng;
use tessera_e2e::tessera::{self, ImageId};
use tessera_e2e::testutil::tmp;

const CHUNK: u64 = 64 << 10;

/// An image whose data spans many 64 KiB chunks, tagged `demo`, and its exported bytes.
struct Fixture {
    t: tempfile::TempDir,
    store: PathBuf,
    id: ImageId,
    raw: Vec<u8>,
    /// Device byte range of the file data.
    data: (u64, u64),
    chunks: u64,
}

fn fixture(name: &str, label: &str) -> Result<Fixture> {
    let t = tmp(name)?;
    let (src, store) = (t.path().join("src"), t.path().join("store"));
    let mut rng = Prng::from_label(label);
    fs::create_dir_all(src.join("etc"))?;
    fs::write(src.join("random.bin"), rng.bytes(1_200_000))?;
    fs::write(src.join("text.txt"), rng.text(300_000))?;
    for i in 0..8 {
        fs::write(src.join(format!("etc/conf{i}")), rng.text(500 + i * 300))?;
    }
    let id = tessera::build(&src, &store, &["--tag", "demo", "--chunk-size", "64K"])?;
    let raw_path = t.path().join("demo.raw");
    tessera::export("demo", &store, &raw_path)?;
    let raw = fs::read(&raw_path)?;
    let v = tessera::inspect_json("demo", &store)?;
    let block = |k: &str| v["geometry"][k].as_u64().with_context(|| format!("geometry.{k}: {v}"));
    let data = (block("data_start_block")? * 4096, block("data_end_block")? * 4096);
    let chunks = v["chunks"].as_u64().context("chunks")?;
    ensure!(chunks >= 20, "the fixture should span many chunks, has {chunks}");
    Ok(Fixture { t, store, id, raw, data, chunks })
}

fn s(p: &Path) -> Result<&str> {
    p.to_str().context("non-UTF-8 path")
}

fn ok(o: Output, what: &str) -> Result<Output> {
    ensure!(o.status.success(), "{what}: {}\n{}", o.status, String::from_utf8_lossy(&o.stderr));
    Ok(o)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Serve `image` from `store` with `--record-trace trace`, read `ranges` with libblkio (checking
/// the bytes against `raw`), stop with SIGTERM.
fn record(
    store: &str,
    image: &str,
    trace: &Path,
    ranges: &[(u64, u64)],
    raw: &[u8],
    extra: &[&str],
) -> Result<()> {
    let socket = trace.with_extension("sock");
    let mut args = vec!["--read-only", "--record-trace", s(trace)?];
    args.extend_from_slice(extra);
    let d = Daemon::start(image, store, &socket, &args)?;
    let mut c = BlkClient::connect(d.socket(), 1, true)?;
    for &(start, end) in ranges {
        let mut at = start;
        while at < end {
            let len = (end - at).min(1 << 20);
            let got = c.read(at, len as usize)?.map_err(|e| anyhow::anyhow!("read at {at}: errno {e}"))?;
            ensure!(got == raw[at as usize..(at + len) as usize], "wrong bytes at {at}");
            at += len;
        }
    }
    drop(c);
    d.stop()
}

/// The trace's chunk lines (after the header), checked for shape.
fn trace_lines(path: &Path, id: &ImageId) -> Result<Vec<(u64, String)>> {
    let text = fs::read_to_string(path)?;
    let mut lines = text.lines();
    ensure!(lines.next() == Some(&format!("tessera-trace 1 {id}")), "trace header: {text}");
    let entries: Vec<(u64, String)> = lines
        .map(|l| {
            let (t, c) = l.split_once(' ').context("line shape")?;
            Ok((t.parse()?, c.to_owned()))
        })
        .collect::<Result<_>>()?;
    ensure!(entries.windows(2).all(|w| w[0].0 <= w[1].0), "times go backwards: {text}");
    Ok(entries)
}

fn entry_bytes(f: &Fixture) -> Result<Vec<u8>> {
    Ok(fs::read(f.store.join("images").join(format!("{}.json", f.id.hex())))?)
}

#[test]
fn record_then_profile_then_inspect() -> Result<()> {
    let f = fixture("warm-profile", "warm-profile")?;
    let store = s(&f.store)?.to_owned();
    let (t1, t2) = (f.t.path().join("boot1.trace"), f.t.path().join("boot2.trace"));
    // Run 1 reads the superblock and all the data; run 2 the superblock and the first chunk's worth.
    record(&store, "demo", &t1, &[(0, 4096), f.data], &f.raw, &[])?;
    record(
        &store,
        f.id.as_str(),
        &t2,
        &[(0, 4096), (f.data.0, f.data.0 + CHUNK)],
        &f.raw,
        &["--mem-cache", "0"],
    )?;
    let run1 = trace_lines(&t1, &f.id)?;
    let run2 = trace_lines(&t2, &f.id)?;
    ensure!(run1.len() as u64 == f.chunks, "run 1 touched {} chunks of {}", run1.len(), f.chunks);
    ensure!((1..=2).contains(&run2.len()), "run 2 read one chunk's worth, touched {}", run2.len());
    ensure!(run1[0].0 == 0 && run2[0].0 == 0, "times start at 0");

    let before = tessera::inspect_json("demo", &f.store)?;
    ensure!(before["has_profile"] == false && before["profile"].is_null(), "{before}");
    let profile = |extra: &[&str]| {
        let mut a = vec!["profile", "demo", "--store", &store, "--trace", s(&t1)?, s(&t2)?];
        a.extend_from_slice(extra);
        tessera::run(&a)
    };
    // Default threshold with two traces: 1 — every chunk either run touched.
    let o = ok(profile(&[])?, "profile")?;
    let digest = String::from_utf8(o.stdout)?;
    let v = tessera::inspect_json("demo", &f.store)?;
    tessera::check_inspect(&v, &f.id)?;
    let p = &v["profile"];
    ensure!(v["has_profile"] == true && p["digest"].as_str() == Some(digest.trim()), "{v}");
    ensure!(p["chunks"].as_u64() == Some(f.chunks) && p["traces"] == 2 && p["min_runs"] == 1, "{v}");
    ensure!(p["bytes"] == v["unique_chunk_bytes"] && p["percent_of_data"].as_f64() == Some(100.0), "{v}");
    // Both runs: only what run 2 read too. The image ID and the tag stay.
    ok(profile(&["--min-runs", "2"])?, "profile --min-runs 2")?;
    let v = tessera::inspect_json("demo", &f.store)?;
    ensure!(v["profile"]["chunks"].as_u64() == Some(run2.len() as u64), "{v}");
    let pct = v["profile"]["percent_of_data"].as_f64().context("percent")?;
    ensure!(pct > 0.0 && pct < 20.0, "{v}");
    ensure!(v["id"].as_str() == Some(f.id.as_str()) && v["tags"] == serde_json::json!(["demo"]), "{v}");
    let text = ok(tessera::run(["inspect", "demo", "--store", &store])?, "inspect")?;
    let text = String::from_utf8(text.stdout)?;
    ensure!(text.contains(&format!("Profile    {} chunks", run2.len())), "{text}");
    tessera::check_store(&f.store)?;

    // Usage errors (exit 2): a threshold above the number of traces, an http store.
    let o = profile(&["--min-runs", "3"])?;
    ensure!(o.status.code() == Some(2) && stderr(&o).contains("--min-runs"), "{}", stderr(&o));
    let o = tessera::run(["profile", "demo", "--store", "http://127.0.0.1:9/store", "--trace", s(&t1)?])?;
    ensure!(o.status.code() == Some(2) && stderr(&o).contains("local store"), "{}", stderr(&o));
    Ok(())
}

#[test]
fn traces_for_another_image_or_its_chunks_are_refused() -> Result<()> {
    let f = fixture("warm-refuse", "warm-refuse")?;
    let store = s(&f.store)?.to_owned();
    // A second image in the same store (other content, so other chunks).
    let other_src = f.t.path().join("other");
    fs::create_dir_all(&other_src)?;
    fs::write(other_src.join("data.bin"), Prng::from_label("another image").bytes(400_000))?;
    let other = tessera::build(&other_src, &f.store, &["--tag", "other", "--chunk-size", "64K"])?;
    let other_raw = f.t.path().join("other.raw");
    tessera::export("other", &f.store, &other_raw)?;
    let v = tessera::inspect_json("other", &f.store)?;
    let start = v["geometry"]["data_start_block"].as_u64().context("data_start_block")? * 4096;
    let foreign = f.t.path().join("other.trace");
    record(&store, "other", &foreign, &[(start, start + 3 * CHUNK)], &fs::read(&other_raw)?, &[])?;
    ensure!(!trace_lines(&foreign, &other)?.is_empty());
    let entry = entry_bytes(&f)?;

    let o = tessera::run(["profile", "demo", "--store", &store, "--trace", s(&foreign)?])?;
    let e = stderr(&o);
    ensure!(o.status.code() == Some(1), "{}: {e}", o.status);
    ensure!(e.contains(other.as_str()) && e.contains(f.id.as_str()) && e.contains("other.trace"), "{e}");

    // The same chunks under this image's header: chunks the image does not have.
    let text = fs::read_to_string(&foreign)?;
    let (_, body) = text.split_once('\n').context("header")?;
    let first_chunk = body.lines().next().and_then(|l| l.split_once(' ')).context("a line")?.1.to_owned();
    let forged = f.t.path().join("forged.trace");
    fs::write(&forged, format!("tessera-trace 1 {}\n{body}", f.id))?;
    let o = tessera::run(["profile", "demo", "--store", &store, "--trace", s(&forged)?])?;
    let e = stderr(&o);
    ensure!(o.status.code() == Some(1), "{}: {e}", o.status);
    ensure!(e.contains("not part of image") && e.contains(&first_chunk), "{e}");

    // A cut-short trace names its line.
    let cut = f.t.path().join("cut.trace");
    fs::write(&cut, &text[..text.len() - 5])?;
    let o = tessera::run(["profile", "other", "--store", &store, "--trace", s(&cut)?])?;
    ensure!(o.status.code() == Some(1) && stderr(&o).contains("final newline"), "{}", stderr(&o));

    ensure!(entry_bytes(&f)? == entry, "a refused profile must leave the image entry alone");
    ensure!(tessera::inspect_json("demo", &f.store)?["profile"].is_null());
    Ok(())
}

/// `tessera warm IMAGE --store URL --cache-dir CACHE EXTRA... --json`.
fn warm(image: &str, url: &str, cache: &Path, extra: &[&str]) -> Result<Output> {
    let mut a = vec!["warm", image, "--store", url, "--cache-dir", s(cache)?, "--json"];
    a.extend_from_slice(extra);
    tessera::run(&a)
}

fn warm_json(o: Output, what: &str) -> Result<serde_json::Value> {
    let o = ok(o, what)?;
    serde_json::from_slice(&o.stdout).with_context(|| format!("{what}: stdout is not JSON"))
}

/// Requests for blob data (records, prefixes, indexes, profiles, packs) in an nginx access log.
fn data_requests(log: &str) -> Vec<&str> {
    log.lines().filter(|l| l.contains("/blobs/")).collect()
}

/// [`data_requests`] of packs (chunk reads): not of the blobs the store's image entries name,
/// which a start reads whole (in ranged pieces from nginx).
fn pack_requests<'a>(log: &'a str, store: &Path) -> Vec<&'a str> {
    let parts = tessera_e2e::testutil::image_part_digests(store);
    data_requests(log).into_iter().filter(|l| !parts.iter().any(|p| l.contains(p.as_str()))).collect()
}

/// The byte ranges of every [`pack_requests`] line of `log`, each as `[A, B]`.
fn pack_ranges(log: &str, store: &Path) -> Result<Vec<(u64, u64)>> {
    Ok(pack_requests(log, store).iter().filter_map(|l| range_of(l)).collect::<Result<Vec<_>>>()?.concat())
}

/// The ranges `bytes=A-B[,C-D…]` in a request (log line or header), each as `[A, B]`.
fn range_of(text: &str) -> Option<Result<Vec<(u64, u64)>>> {
    let spec = text.split("bytes=").nth(1)?;
    let spec: String = spec.chars().take_while(|c| c.is_ascii_digit() || *c == '-' || *c == ',').collect();
    Some(tessera_e2e::nginx::parse_range_header(&format!("bytes={spec}")).context("not a byte range"))
}

/// No byte asked for twice, and exactly `total` bytes asked for (one pack in these fixtures).
fn ensure_disjoint_totalling(ranges: &[(u64, u64)], total: u64) -> Result<()> {
    let mut sorted = ranges.to_vec();
    sorted.sort_unstable();
    ensure!(sorted.windows(2).all(|w| w[0].1 < w[1].0), "a byte was asked for twice: {sorted:?}");
    let asked: u64 = sorted.iter().map(|(a, b)| b - a + 1).sum();
    ensure!(asked == total, "{asked} bytes asked for in ranged GETs, {total} fetched: {sorted:?}");
    Ok(())
}

/// Chunk entries in a cache directory.
fn cached_chunks(cache: &Path) -> Result<usize> {
    let mut n = 0;
    let root = cache.join("v1/chunks");
    if !root.is_dir() {
        return Ok(0);
    }
    for d in fs::read_dir(root)? {
        n += fs::read_dir(d?.path())?.count();
    }
    Ok(n)
}

/// The fill's progress gauges of the daemon whose metrics are at `addr`: (target, done) bytes.
fn fill_progress(addr: &str) -> Result<(f64, f64)> {
    let m = scrape(addr)?;
    Ok((
        m.value("tessera_disk_cache_fill_target_bytes", &[])?,
        m.value("tessera_disk_cache_fill_done_bytes", &[])?,
    ))
}

/// Wait (at most 60 s) until the gauges say the fill is done.
fn wait_filled(addr: &str) -> Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let (target, done) = fill_progress(addr)?;
        if target > 0.0 && done == target {
            return Ok(());
        }
        ensure!(std::time::Instant::now() < deadline, "the fill did {done} of {target} bytes in 60 s");
        std::thread::sleep(std::time::Duration::from_millis(20)); // polling interval
    }
}

fn field(v: &serde_json::Value, k: &str) -> Result<u64> {
    v[k].as_u64().with_context(|| format!("{k} missing: {v}"))
}

#[test]
fn record_profile_warm_round_trip_then_serve_with_the_origin_stopped() -> Result<()> {
    let f = fixture("warm-round-trip", "warm-round-trip")?;
    let store = s(&f.store)?.to_owned();
    // A boot that reads the superblock and three chunks' worth of data, recorded and profiled.
    let trace = f.t.path().join("boot.trace");
    let boot = [(0, 4096), (f.data.0, f.data.0 + 3 * CHUNK)];
    record(&store, "demo", &trace, &boot, &f.raw, &[])?;
    ok(tessera::run(["profile", "demo", "--store", &store, "--trace", s(&trace)?])?, "profile")?;
    let profiled = trace_lines(&trace, &f.id)?.len() as u64;
    ensure!((3..=5).contains(&profiled), "a 3-chunk read touched {profiled} chunks");

    let mut origin = tessera_e2e::nginx::Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    let cache = f.t.path().join("cache");
    // --profile-only: exactly the profile's chunks, each fetched once.
    let v = warm_json(warm("demo", &url, &cache, &["--profile-only"])?, "warm --profile-only")?;
    ensure!(v["image"].as_str() == Some(f.id.as_str()) && v["profile_only"] == true, "{v}");
    ensure!(field(&v, "chunks")? == profiled && field(&v, "fetched_chunks")? == profiled, "{v}");
    ensure!(field(&v, "present_chunks")? == 0 && field(&v, "failed_chunks")? == 0, "{v}");
    ensure!(field(&v, "bytes")? == field(&v, "fetched_bytes")? && field(&v, "bytes")? > 0, "{v}");
    ensure!(cached_chunks(&cache)? as u64 == profiled, "cache holds {} chunks", cached_chunks(&cache)?);
    let log = origin.access_log();
    // Each chunk's bytes asked for exactly once (adjacent chunks may share one ranged GET).
    let ranges = pack_ranges(&log, &f.store)?;
    ensure!(!ranges.is_empty() && ranges.len() as u64 <= profiled, "{log}");
    ensure_disjoint_totalling(&ranges, field(&v, "fetched_bytes")?)?;

    // Again: everything present, no data asked of the origin (only the tag and the entry).
    let before = origin.access_log().lines().count();
    let v = warm_json(warm("demo", &url, &cache, &["--profile-only"])?, "second warm --profile-only")?;
    ensure!(field(&v, "present_chunks")? == profiled && field(&v, "fetched_chunks")? == 0, "{v}");
    let log = origin.access_log();
    let new: Vec<&str> = log.lines().skip(before).collect();
    ensure!(data_requests(&new.join("\n")).is_empty(), "second run asked for data: {new:?}");
    ensure!(
        !new.is_empty() && new.iter().all(|l| l.contains("/refs/demo ") || l.contains("/images/")),
        "second run: only the tag and the entry (which may change) are asked for: {new:?}"
    );

    // The whole image: the rest is fetched, with 4 jobs, in runs of chunks stored back to back
    // (one ranged GET per run, not per chunk: the profiled chunks split the pack in at most
    // `profiled + 1` runs, each within 4 MiB); then a whole second run fetches nothing.
    let before = origin.access_log().lines().count();
    let v = warm_json(warm(f.id.as_str(), &url, &cache, &["--jobs", "4"])?, "warm")?;
    ensure!(field(&v, "chunks")? == f.chunks && field(&v, "present_chunks")? == profiled, "{v}");
    ensure!(field(&v, "fetched_chunks")? == f.chunks - profiled, "{v}");
    let log = origin.access_log();
    let new: Vec<&str> = log.lines().skip(before).collect();
    let ranges = pack_ranges(&new.join("\n"), &f.store)?;
    ensure!(
        !ranges.is_empty() && ranges.len() as u64 <= profiled + 1,
        "{} ranged GETs for {} chunks: {new:?}",
        ranges.len(),
        f.chunks - profiled
    );
    ensure_disjoint_totalling(&ranges, field(&v, "fetched_bytes")?)?;
    let before = origin.access_log().lines().count();
    let v = warm_json(warm("demo", &url, &cache, &[])?, "second warm")?;
    ensure!(field(&v, "fetched_chunks")? == 0 && field(&v, "present_chunks")? == f.chunks, "{v}");
    let log = origin.access_log();
    let new: Vec<&str> = log.lines().skip(before).collect();
    ensure!(data_requests(&new.join("\n")).is_empty(), "second full run asked for data: {new:?}");
    // The text summary too.
    let o = ok(tessera::run(["warm", "demo", "--store", &url, "--cache-dir", s(&cache)?])?, "warm (text)")?;
    let line = String::from_utf8(o.stdout)?;
    ensure!(line.contains(&format!("{} chunks", f.chunks)) && line.contains("0 failed"), "{line}");

    // Warmed, an image named by ID starts and reads without asking the origin anything: the
    // entry, record, prefix, pack index and chunks are all in the cache (only a tag needs the
    // origin).
    let before = origin.access_log().lines().count();
    let socket = f.t.path().join("by-id.sock");
    let d = Daemon::start(f.id.as_str(), &url, &socket, &["--read-only", "--cache-dir", s(&cache)?])?;
    let mut c = BlkClient::connect(d.socket(), 1, true)?;
    let got = c.read(f.data.0, 4096)?.map_err(|e| anyhow::anyhow!("read by ID: errno {e}"))?;
    ensure!(got[..] == f.raw[f.data.0 as usize..f.data.0 as usize + 4096], "read by ID: wrong bytes");
    drop(c);
    d.stop()?;
    let log = origin.access_log();
    let new: Vec<&str> = log.lines().skip(before).collect();
    ensure!(new.is_empty(), "serving a warmed image by ID asked the origin: {new:?}");

    // Origin down: the cache alone serves every block, by tag, to export and to the daemon.
    origin.stop();
    let out = f.t.path().join("from-cache.raw");
    ok(
        tessera::run(["export", "demo", "--store", &url, "--cache-dir", s(&cache)?, "-o", s(&out)?])?,
        "export from the warmed cache with nginx stopped",
    )?;
    ensure!(fs::read(&out)? == f.raw, "export from the cache differs from the local export");
    let socket = f.t.path().join("cached.sock");
    let d = Daemon::start("demo", &url, &socket, &["--read-only", "--cache-dir", s(&cache)?])?;
    let mut c = BlkClient::connect(d.socket(), 1, true)?;
    let (device, failed) = c.read_device(1 << 20, 8)?;
    ensure!(failed.is_empty(), "reads failed with the origin stopped: {failed:?}");
    ensure!(device == f.raw, "the daemon served other bytes from the cache");
    drop(c);
    d.stop()?;
    Ok(())
}

/// `serve --fill-cache`: once a VM connected (and `--fill-after`), the daemon fetches the rest of
/// the image into its disk cache while the guest reads (each byte of the pack asked of the origin
/// once, demand and fill together); the origin can then go away and the same daemon still serves
/// every block.
#[test]
fn serve_fill_cache_fetches_the_whole_image_in_the_background() -> Result<()> {
    let f = fixture("serve-fill", "serve-fill")?;
    let mut origin = tessera_e2e::nginx::Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    let cache = f.t.path().join("cache");
    // Usage: a cache to fill, of a remote store.
    let socket = f.t.path().join("fill.sock");
    let usage = |o: Output, want: &str| -> Result<()> {
        ensure!(o.status.code() == Some(2) && stderr(&o).contains(want), "{}", stderr(&o));
        Ok(())
    };
    let sock = s(&socket)?;
    usage(
        tessera::run(["serve", "demo", "--store", &url, "--socket", sock, "--fill-cache"])?,
        "--cache-dir",
    )?;
    let local = ["serve", "demo", "--store", s(&f.store)?, "--socket", sock, "--fill-cache"];
    usage(tessera::run(local.iter().chain(&["--cache-dir", s(&cache)?]))?, "local store")?;

    let mut cmd = tessera::command(["serve", "demo", "--store", &url, "--socket", sock, "--read-only"]);
    cmd.args(["--cache-dir", s(&cache)?, "--fill-cache", "--fill-after", "1s"]).stdout(Stdio::null());
    let (child, addr) = spawn_with_metrics(&mut cmd)?;
    let daemon = Daemon::adopt(child, &socket);
    let progress = || fill_progress(&addr);
    // The fill waits for a VM, and then --fill-after.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    ensure!(cached_chunks(&cache)? == 0, "the fill started before a VM connected");
    ensure!(progress()? == (0.0, 0.0), "fill progress before a VM connected: {:?}", progress()?);
    let mut c = BlkClient::connect(&socket, 1, true)?;
    let at = f.data.0 as usize + 5 * CHUNK as usize;
    let got = c.read(at as u64, 8192)?.map_err(|e| anyhow::anyhow!("read: errno {e}"))?;
    ensure!(got[..] == f.raw[at..at + 8192], "a read while filling: wrong bytes");
    // Done when the metrics say so; then the cache holds every chunk.
    wait_filled(&addr)?;
    ensure!(
        cached_chunks(&cache)? as u64 == f.chunks,
        "{} of {} chunks cached",
        cached_chunks(&cache)?,
        f.chunks
    );
    // `tessera warm` finds the whole image there, and the origin was asked for each byte once.
    let v = warm_json(warm("demo", &url, &cache, &[])?, "warm after the fill")?;
    ensure!(field(&v, "present_chunks")? == f.chunks && field(&v, "fetched_chunks")? == 0, "{v}");
    let log = origin.access_log();
    let ranges = pack_ranges(&log, &f.store)?;
    ensure_disjoint_totalling(&ranges, field(&v, "bytes")?)?;
    ensure!(progress()?.0 == field(&v, "bytes")? as f64, "fill target {:?} against {v}", progress()?);
    // Origin gone: the daemon that filled its cache serves every block from it.
    origin.stop();
    let (device, failed) = c.read_device(1 << 20, 8)?;
    ensure!(failed.is_empty(), "reads failed with the origin stopped: {failed:?}");
    ensure!(device == f.raw, "the daemon served other bytes from its filled cache");
    drop(c);
    daemon.stop()
}

#[test]
fn warm_rate_and_fill_rate_cap_the_bandwidth() -> Result<()> {
    let f = fixture("warm-rate", "warm-rate")?;
    let origin = tessera_e2e::nginx::Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    // Uncapped, the image's ~1.3 MB come from a local nginx in a fraction of a second; capped at
    // RATE, everything past the first second's worth waits for its tokens.
    const RATE: u64 = 400 << 10;
    let v = warm_json(warm("demo", &url, &f.t.path().join("fast"), &[])?, "uncapped warm")?;
    let bytes = field(&v, "bytes")?;
    ensure!(bytes > 3 * RATE, "the fixture should take seconds at the cap: {bytes} bytes");
    // The cap lets a second's worth and one run (64 KiB at this rate) go early, no more.
    let least = bytes.saturating_sub(RATE + (64 << 10)) as f64 / RATE as f64;
    let fast = v["seconds"].as_f64().context("seconds")?;
    ensure!(fast < least / 2.0, "the uncapped warm took {fast} s: too slow to tell a cap from it");
    let v = warm_json(warm("demo", &url, &f.t.path().join("capped"), &["--rate", "400K"])?, "capped warm")?;
    let took = v["seconds"].as_f64().context("seconds")?;
    ensure!(field(&v, "fetched_chunks")? == f.chunks, "{v}");
    ensure!(took >= least, "warm --rate 400K of {bytes} bytes took {took} s, under {least} s");
    let o = warm("demo", &url, &f.t.path().join("zero"), &["--rate", "0"])?;
    ensure!(o.status.code() == Some(2) && stderr(&o).contains("never finish"), "{}", stderr(&o));

    // The daemon's fill, paced the same way: from its start (a VM connected, --fill-after 0)
    // to its last byte.
    let socket = f.t.path().join("fill.sock");
    let (sock, cache) = (s(&socket)?, f.t.path().join("fill-cache"));
    let o = tessera::run(["serve", "demo", "--store", &url, "--socket", sock, "--fill-rate", "1M"])?;
    ensure!(o.status.code() == Some(2) && stderr(&o).contains("--fill-cache"), "{}", stderr(&o));
    let mut cmd = tessera::command(["serve", "demo", "--store", &url, "--socket", sock, "--read-only"]);
    cmd.args(["--cache-dir", s(&cache)?, "--fill-cache", "--fill-after", "0s", "--fill-rate", "400K"]);
    let (child, addr) = spawn_with_metrics(cmd.stdout(Stdio::null()))?;
    let daemon = Daemon::adopt(child, &socket);
    let c = BlkClient::connect(&socket, 1, true)?;
    let began = std::time::Instant::now();
    wait_filled(&addr)?;
    let took = began.elapsed().as_secs_f64();
    ensure!(took >= least, "--fill-rate 400K filled {bytes} bytes in {took} s, under {least} s");
    ensure!(
        cached_chunks(&cache)? as u64 == f.chunks,
        "{} of {} chunks cached",
        cached_chunks(&cache)?,
        f.chunks
    );
    drop(c);
    daemon.stop()
}

#[test]
fn warm_resumes_after_kill_9_and_fails_on_bad_chunks() -> Result<()> {
    use tessera_e2e::proxy::{Proxy, ProxyConfig};
    let f = fixture("warm-resume", "warm-resume")?;
    let origin = tessera_e2e::nginx::Nginx::serve(&f.store, "store")?;
    // A 1 MB/s link and one job: slow enough to kill mid-way. No RTT: the proxy then reads each
    // request head as it arrives, so the killed run's last request is logged before the kill.
    let link =
        ProxyConfig { rtt: std::time::Duration::ZERO, bandwidth: Some(1_000_000), ..Default::default() };
    let proxy = Proxy::start(origin.addr(), link)?;
    let url = proxy.url("store");
    let cache = f.t.path().join("cache");

    let o = warm("demo", &url, &cache, &["--profile-only"])?;
    ensure!(o.status.code() == Some(1) && stderr(&o).contains("no prefetch profile"), "{}", stderr(&o));
    let o = tessera::run(["warm", "demo", "--store", &url])?;
    ensure!(o.status.code() == Some(2) && stderr(&o).contains("--cache-dir"), "{}", stderr(&o));
    let o = tessera::run(["warm", "demo", "--store", s(&f.store)?, "--cache-dir", s(&cache)?])?;
    ensure!(o.status.code() == Some(2) && stderr(&o).contains("local store"), "{}", stderr(&o));

    let mut child =
        tessera::command(["warm", "demo", "--store", &url, "--cache-dir", s(&cache)?, "--jobs", "1"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    // Killed once some chunks are cached and no write has been seen for 200 ms: a run's chunks
    // are written together when its request ends, so the kill then lands in the next run's
    // request (a writer killed inside a write leaves a temp file that only a cleaner after
    // TEMP_GRACE may remove, which is not what this checks).
    let (mut seen, mut since) = (0, std::time::Instant::now());
    loop {
        ensure!(child.try_wait()?.is_none(), "warm finished before it could be killed");
        ensure!(std::time::Instant::now() < deadline, "warm cached no chunks within 60 s");
        let n = cached_chunks(&cache)?;
        if n != seen {
            (seen, since) = (n, std::time::Instant::now());
        } else if n >= 4 && since.elapsed() >= std::time::Duration::from_millis(200) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10)); // polling interval
    }
    child.kill()?; // SIGKILL
    child.wait()?;
    let kept = cached_chunks(&cache)? as u64;
    ensure!(kept < f.chunks, "warm was not killed mid-way ({kept} of {} chunks)", f.chunks);

    // Requests are counted by when the proxy received them: the killed run's last request may
    // still reach nginx after the kill.
    let resumed_at = std::time::Instant::now();
    let v = warm_json(warm("demo", &url, &cache, &["--jobs", "4"])?, "resumed warm")?;
    ensure!(field(&v, "present_chunks")? >= kept, "{v}");
    let fetched = field(&v, "fetched_chunks")?;
    ensure!(fetched + field(&v, "present_chunks")? == f.chunks && fetched > 0, "{v}");
    let ranges = proxy
        .log()
        .iter()
        .filter(|r| r.at >= resumed_at && r.path.contains("/blobs/"))
        .filter_map(|r| r.range.as_deref().and_then(range_of))
        .collect::<Result<Vec<_>>>()?
        .concat();
    ensure_disjoint_totalling(&ranges, field(&v, "fetched_bytes")?).with_context(|| {
        format!("{:#?}", proxy.log().iter().filter(|r| r.at >= resumed_at).collect::<Vec<_>>())
    })?;
    ensure!(cached_chunks(&cache)? as u64 == f.chunks);
    let leftovers = fs::read_dir(cache.join("v1/tmp"))?.count();
    ensure!(leftovers == 0, "{leftovers} temp files left after the resumed run");

    // A cache bound smaller than the image: warm says so (the cache keeps what fits).
    let small = f.t.path().join("small-cache");
    let o = warm("demo", &url, &small, &["--cache-size", "256K"])?;
    ensure!(o.status.success() && stderr(&o).contains("exceed --cache-size"), "{}", stderr(&o));

    // A corrupt pack on the origin: those chunks fail (exit 1, listed), the others are cached.
    let cache2 = f.t.path().join("cache2");
    let v = tessera::inspect_json("demo", &f.store)?;
    ensure!(v["packs"] == 1, "{v}");
    let pack = largest_blob(&f.store)?;
    let mut bytes = fs::read(&pack)?;
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x5a;
    fs::write(&pack, &bytes)?;
    let o = warm("demo", &url, &cache2, &[])?;
    ensure!(o.status.code() == Some(1), "warm with a corrupt pack: {}", o.status);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    let failed = field(&v, "failed_chunks")?;
    ensure!(failed >= 1 && v["failed"].as_array().map(Vec::len) == Some(failed as usize), "{v}");
    ensure!(field(&v, "fetched_chunks")? + failed == f.chunks, "{v}");
    ensure!(stderr(&o).contains("could not be warmed"), "{}", stderr(&o));
    ensure!(cached_chunks(&cache2)? as u64 == f.chunks - failed, "bad chunks must not be cached");
    Ok(())
}

/// The keys of `copy --json`, for a copy run.
fn copy(image: &str, from: &str, to: &str, extra: &[&str]) -> Result<serde_json::Value> {
    let mut a = vec!["copy", image, "--store", from, "--to", to, "--json"];
    a.extend_from_slice(extra);
    let o = ok(tessera::run(&a)?, &format!("copy {image} from {from} to {to}"))?;
    serde_json::from_slice(&o.stdout).context("copy --json")
}

/// The destination must hold an image indistinguishable from the source's: same inspect output
/// (profile and tags included), same device bytes, a valid store layout.
fn same_image(f: &Fixture, dest: &Path, want_tags: serde_json::Value) -> Result<()> {
    tessera::check_store(dest)?;
    let mut want = tessera::inspect_json(f.id.as_str(), &f.store)?;
    let got = tessera::inspect_json(f.id.as_str(), dest)?;
    want["tags"] = want_tags;
    ensure!(got == want, "inspect differs after copy:\n{got}\n{want}");
    let out = dest.join("copy.raw");
    tessera::export(f.id.as_str(), dest, &out)?;
    ensure!(fs::read(&out)? == f.raw, "the copy exports other bytes");
    fs::remove_file(out)?;
    Ok(())
}

/// Record a boot reading two chunks' worth of data and attach its profile; returns the store path.
fn with_profile(f: &Fixture) -> Result<String> {
    let store = s(&f.store)?.to_owned();
    let trace = f.t.path().join("boot.trace");
    record(&store, "demo", &trace, &[(f.data.0, f.data.0 + 2 * CHUNK)], &f.raw, &[])?;
    ok(tessera::run(["profile", "demo", "--store", &store, "--trace", s(&trace)?])?, "profile")?;
    Ok(store)
}

#[test]
fn copy_between_stores_with_profile_and_tag() -> Result<()> {
    let f = fixture("warm-copy", "warm-copy")?;
    let store = with_profile(&f)?;
    let blobs = fs::read_dir(f.store.join("blobs/sha256"))?.count();

    // local → local, by tag: every blob, the entry (with its profile), the tag.
    let d1 = f.t.path().join("mirror");
    let v = copy("demo", &store, s(&d1)?, &[])?;
    ensure!(v["tag"] == "demo" && v["copied"] == blobs && v["present"] == 0, "{v}");
    same_image(&f, &d1, serde_json::json!(["demo"]))?;
    // The tag's ref as the source's, the places of the profile's chunks included (a local
    // store works them out from its own copy).
    let source_ref = fs::read_to_string(std::path::Path::new(&store).join("refs/demo"))?;
    ensure!(source_ref.contains("\nprofile "), "the source's ref names the profile's chunks: {source_ref}");
    let copied_ref = fs::read_to_string(d1.join("refs/demo"))?;
    ensure!(copied_ref == source_ref, "copied ref {copied_ref:?}, source's {source_ref:?}");
    // Again: nothing to copy.
    let v = copy("demo", &store, s(&d1)?, &[])?;
    ensure!(v["copied"] == 0 && v["present"] == blobs, "{v}");
    // An interrupted copy (a pack, the entry and the tag missing) is finished by a rerun.
    let pack = largest_blob(&d1)?;
    fs::remove_file(&pack)?;
    fs::remove_file(d1.join("images").join(format!("{}.json", f.id.hex())))?;
    fs::remove_file(d1.join("refs/demo"))?;
    let v = copy("demo", &store, s(&d1)?, &[])?;
    ensure!(v["copied"] == 1 && v["present"] == blobs - 1, "{v}");
    same_image(&f, &d1, serde_json::json!(["demo"]))?;

    // http → local, by ID (no tag written), through nginx.
    let origin = tessera_e2e::nginx::Nginx::serve(&f.store, "store")?;
    let d2 = f.t.path().join("from-http");
    let v = copy(f.id.as_str(), &origin.url(), s(&d2)?, &[])?;
    ensure!(v["tag"].is_null() && v["copied"] == blobs, "{v}");
    same_image(&f, &d2, serde_json::json!([]))?;

    // An http(s) destination is read-only: a usage error.
    let o = tessera::run(["copy", "demo", "--store", &store, "--to", &origin.url()])?;
    ensure!(o.status.code() == Some(2) && stderr(&o).contains("read-only"), "{}", stderr(&o));
    // A source whose pack does not hash to its name: refused, no entry written.
    let d3 = f.t.path().join("from-corrupt");
    let mut bytes = fs::read(largest_blob(&f.store)?)?;
    bytes[100] ^= 1;
    fs::write(largest_blob(&f.store)?, bytes)?;
    let o = tessera::run(["copy", "demo", "--store", &store, "--to", s(&d3)?])?;
    ensure!(o.status.code() == Some(1) && stderr(&o).contains("hash to"), "{}", stderr(&o));
    ensure!(!d3.join("images").join(format!("{}.json", f.id.hex())).exists(), "entry written");
    Ok(())
}

fn largest_blob(store: &Path) -> Result<PathBuf> {
    fs::read_dir(store.join("blobs/sha256"))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<Vec<_>>>()?
        .into_iter()
        .max_by_key(|p| fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .context("no blobs")
}

#[test]
fn copy_to_a_registry_keeps_the_profile() -> Result<()> {
    tessera_e2e::registry::require_registry()?;
    let f = fixture("warm-copy-registry", "warm-copy-registry")?;
    let store = with_profile(&f)?;
    let reg = tessera_e2e::registry::Registry::start()?;
    let repo = format!("docker://{}/ci/web", reg.addr());
    let v = copy("demo", &store, &repo, &[])?;
    ensure!(v["tag"] == "demo" && v["copied"].as_u64() > Some(0), "{v}");
    let v = copy("demo", &store, &repo, &[])?;
    ensure!(v["copied"] == 0, "a second copy uploads nothing: {v}");
    // Read back from the registry: the same device, the same profile.
    let out = f.t.path().join("from-registry.raw");
    ok(tessera::run(["export", "demo", "--store", &repo, "-o", s(&out)?])?, "export docker://")?;
    ensure!(fs::read(&out)? == f.raw, "the registry copy exports other bytes");
    let local = tessera::inspect_json("demo", &f.store)?;
    let o = ok(tessera::run(["inspect", "demo", "--store", &repo, "--json"])?, "inspect docker://")?;
    let remote: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    ensure!(remote["profile"] == local["profile"] && !remote["profile"].is_null(), "{remote}\n{local}");
    Ok(())
}

/// Start `tessera serve demo` from `origin` over the disk cache `cache` with `extra` arguments,
/// read the whole device, stop; the device's bytes and the origin requests the daemon made.
fn serve_warmed(
    f: &Fixture,
    origin: &tessera_e2e::nginx::Nginx,
    cache: &Path,
    sock: &str,
    extra: &[&str],
) -> Result<(Vec<u8>, Vec<String>)> {
    let before = origin.access_log().lines().count();
    let socket = f.t.path().join(sock);
    let args = [&["--read-only", "--cache-dir", s(cache)?][..], extra].concat();
    let d = Daemon::start("demo", origin.url(), &socket, &args)?;
    let mut c = BlkClient::connect(d.socket(), 1, true)?;
    let (device, failed) = c.read_device(1 << 20, 8)?;
    ensure!(failed.is_empty(), "reads failed: {failed:?}");
    drop(c);
    d.stop()?;
    Ok((device, origin.access_log().lines().skip(before).map(str::to_owned).collect()))
}

/// A warmed start by tag asks the origin for the tag only, and opens the image the cache's
/// lookup names while that answer is on its way; when the tag has moved, the daemon serves the
/// image the origin names now, never the cached one. (This checks the guess is never trusted;
/// what the overlap saves is measured by `cargo xtask bench cold`, docs/benchmarks.md.)
#[test]
fn a_warmed_tag_is_confirmed_by_the_origin_and_followed_when_it_moved() -> Result<()> {
    let f = fixture("warm-tag-moved", "warm-tag-moved")?;
    let origin = tessera_e2e::nginx::Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    let cache = f.t.path().join("cache");
    warm_json(warm("demo", &url, &cache, &[])?, "warm")?;

    let (device, new) = serve_warmed(&f, &origin, &cache, "warm.sock", &[])?;
    ensure!(device == f.raw, "a warmed start by tag served other bytes");
    ensure!(
        new.len() == 1 && new[0].contains("/refs/demo "),
        "a warmed start by tag asks for the tag and nothing else: {new:?}"
    );

    // The tag moves to another image at the origin: the daemon serves that one.
    let src = f.t.path().join("src2");
    fs::create_dir_all(&src)?;
    fs::write(src.join("other.bin"), Prng::from_label("warm-tag-moved-2").bytes(700_000))?;
    let moved = tessera::build(&src, &f.store, &["--tag", "demo", "--chunk-size", "64K"])?;
    ensure!(moved != f.id, "the second build is another image");
    let raw2 = f.t.path().join("moved.raw");
    tessera::export("demo", &f.store, &raw2)?;
    let (device, _) = serve_warmed(&f, &origin, &cache, "moved.sock", &[])?;
    ensure!(device == fs::read(&raw2)?, "after the tag moved, the daemon served the old image");
    Ok(())
}

/// `serve --tag-max-age`: a tag the cache looked up within the window is trusted, and the start
/// asks the origin nothing — even after the tag moved there (the staleness the flag allows);
/// a lookup older than the window is asked again, and the start follows the moved tag.
#[test]
fn a_recent_tag_lookup_is_trusted_within_tag_max_age() -> Result<()> {
    let f = fixture("warm-tag-max-age", "warm-tag-max-age")?;
    let origin = tessera_e2e::nginx::Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    let cache = f.t.path().join("cache");
    warm_json(warm("demo", &url, &cache, &[])?, "warm")?;

    let serve =
        |sock: &str, max_age: &str| serve_warmed(&f, &origin, &cache, sock, &["--tag-max-age", max_age]);
    let (device, asked) = serve("fresh.sock", "10m")?;
    ensure!(device == f.raw, "a start on a fresh lookup served other bytes");
    ensure!(asked.is_empty(), "a start on a lookup within --tag-max-age asks nothing: {asked:?}");

    // The tag moves at the origin: within the window the cached lookup still names the old image.
    let src = f.t.path().join("src2");
    fs::create_dir_all(&src)?;
    fs::write(src.join("other.bin"), Prng::from_label("warm-tag-max-age-2").bytes(700_000))?;
    let moved = tessera::build(&src, &f.store, &["--tag", "demo", "--chunk-size", "64K"])?;
    ensure!(moved != f.id, "the second build is another image");
    let raw2 = f.t.path().join("moved.raw");
    tessera::export("demo", &f.store, &raw2)?;
    let (device, asked) = serve("stale.sock", "10m")?;
    ensure!(
        device == f.raw && asked.is_empty(),
        "within the window: the cached image, nothing asked: {asked:?}"
    );

    // The lookup ages past the window: the start asks for the tag and serves where it moved.
    let refs = fs::read_dir(cache.join("v1/origins"))?
        .map(|e| e.map(|e| e.path().join("refs/demo")))
        .collect::<std::io::Result<Vec<_>>>()?;
    let lookup = refs.iter().find(|p| p.exists()).context("no cached lookup of the tag")?;
    let hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    fs::File::options().write(true).open(lookup)?.set_modified(hour_ago)?;
    let (device, asked) = serve("expired.sock", "10m")?;
    ensure!(device == fs::read(&raw2)?, "past the window, the daemon served the old image");
    ensure!(
        asked.first().is_some_and(|r| r.contains("/refs/demo ")),
        "past the window, a start asks for the tag first: {asked:?}"
    );
    // That answer renewed the lookup (and the read cached the new image): trusted again.
    let (device, asked) = serve("renewed.sock", "10m")?;
    ensure!(device == fs::read(&raw2)? && asked.is_empty(), "a renewed lookup is trusted: {asked:?}");
    Ok(())
}
