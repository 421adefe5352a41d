//! `tessera serve` over an http:// store served by a real nginx, read by a real libblkio client:
//! the whole device equals `tessera export` (with and without `--cache-dir`, and from the cache
//! alone with nginx stopped); corrupt cached chunks are dropped and refetched; a chunk whose
//! origin bytes are corrupt is fetched exactly twice and its reads fail with EIO, never wrong
//! bytes; the temporary overlay lives in `--cache-dir`.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use tessera_e2e::daemon::{BlkClient, Daemon};
use tessera_e2e::nginx::Nginx;
use tessera_e2e::prng::Prng;
use tessera_e2e::proxy::{Fault, LoggedRequest, Proxy, ProxyConfig};
use tessera_e2e::tessera::{self, ImageId};
use tessera_e2e::testutil::{cached_chunks, image_part_digests, tmp, Killed};

const MIB: usize = 1 << 20;

struct Fixture {
    t: tempfile::TempDir,
    store: PathBuf,
    id: ImageId,
    raw: Vec<u8>,
}

/// A tree whose data spans many 64 KiB chunks, incompressible (stored raw) and text (zstd).
fn fixture(name: &str) -> Result<Fixture> {
    let t = tmp(name)?;
    let (src, store) = (t.path().join("src"), t.path().join("store"));
    let mut rng = Prng::from_label("serve-origin");
    fs::create_dir_all(src.join("sub"))?;
    fs::write(src.join("random.bin"), rng.bytes(1_500_000))?;
    fs::write(src.join("text.txt"), rng.text(700_000))?;
    fs::write(src.join("sub/small"), b"served over http\n")?;
    let id = tessera::build(&src, &store, &["--tag", "demo", "--chunk-size", "64K"])?;
    let out = t.path().join("local.raw");
    tessera::export("demo", &store, &out)?;
    let raw = fs::read(&out)?;
    Ok(Fixture { t, store, id, raw })
}

fn path_str(p: &Path) -> Result<&str> {
    p.to_str().context("non-UTF-8 path")
}

/// Read the whole device through libblkio (1 MiB reads, 8 in flight); every read must succeed
/// and the bytes must equal the local export.
fn device_equals_export(d: &Daemon, f: &Fixture, what: &str) -> Result<()> {
    let mut c = BlkClient::connect(d.socket(), 1, true)?;
    ensure!(c.capacity() == f.raw.len() as u64, "{what}: capacity {} vs {}", c.capacity(), f.raw.len());
    let (bytes, failed) = c.read_device(MIB, 8)?;
    ensure!(failed.is_empty(), "{what}: failed reads {failed:?}");
    ensure!(bytes == f.raw, "{what}: the device differs from `tessera export`");
    Ok(())
}

#[test]
fn serve_over_http_equals_export_with_and_without_cache() -> Result<()> {
    let f = fixture("serve-http")?;
    let mut origin = Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    let socket = f.t.path().join("vm.sock");
    let cache = f.t.path().join("cache");
    let c = path_str(&cache)?;

    // No --cache-dir: chunks are kept in memory only.
    let d = Daemon::start("demo", &url, &socket, &["--read-only"])?;
    device_equals_export(&d, &f, "http, memory only")?;
    d.stop()?;
    ensure!(!cache.exists(), "nothing may be written to a cache dir that was not given");

    // --cache-dir: cold, then the cache holds the chunks.
    let d = Daemon::start("demo", &url, &socket, &["--read-only", "--cache-dir", c])?;
    device_equals_export(&d, &f, "http with a cold cache")?;
    d.stop()?;
    let chunks = cached_chunks(&cache)?;
    ensure!(chunks.len() > 20, "expected the chunks in the cache, found {}", chunks.len());

    // The origin stopped: the cache alone serves, by tag and by ID, and nothing is missing.
    origin.stop();
    for image in ["demo", f.id.as_str()] {
        let d = Daemon::start(image, &url, &socket, &["--read-only", "--cache-dir", c])?;
        device_equals_export(&d, &f, &format!("{image} from the cache with nginx stopped"))?;
        d.stop()?;
    }

    // Writable without --overlay: the temporary overlay is an unlinked file in --cache-dir.
    let d = Daemon::start("demo", &url, &socket, &["--cache-dir", c])?;
    let pid = d.pid().context("no pid")?;
    let cache_real = cache.canonicalize()?;
    let mut in_cache = Vec::new();
    for e in fs::read_dir(format!("/proc/{pid}/fd"))? {
        if let Ok(target) = fs::read_link(e?.path()) {
            if target.starts_with(&cache_real) && target.to_string_lossy().ends_with("(deleted)") {
                in_cache.push(target);
            }
        }
    }
    ensure!(!in_cache.is_empty(), "no unlinked overlay file under {} is open", cache_real.display());
    let mut client = BlkClient::connect(d.socket(), 1, false)?;
    let head = client.read(0, 8192)?.map_err(|e| anyhow::anyhow!("read: errno {e}"))?;
    ensure!(head == f.raw[..8192], "writable device, first blocks differ");
    drop(client);
    d.stop()?;
    Ok(())
}

/// When the daemon's start asked for each of the image's parts, relative to the entry request:
/// (record, prefix, pack index), and the entry request's time after the tag's.
fn start_requests(log: &[LoggedRequest], store: &Path, id: &ImageId) -> Result<([f64; 3], f64)> {
    let v: serde_json::Value =
        serde_json::from_slice(&fs::read(store.join(format!("images/{}.json", id.hex())))?)?;
    let blob = |k: &str| -> Result<String> {
        let d = v[k].as_str().with_context(|| format!("entry: {k}"))?;
        Ok(format!("/store/blobs/sha256/{}", d.trim_start_matches("sha256:")))
    };
    let at = |path: &str| -> Result<Instant> {
        // The last one: with a wrong ref, the one the entry named.
        let r = log
            .iter()
            .rev()
            .find(|r| r.path == path)
            .with_context(|| format!("no request of {path}: {log:?}"))?;
        Ok(r.at)
    };
    let entry = at(&format!("/store/images/{}.json", id.hex()))?;
    let after = |t: Instant| t.duration_since(entry).as_secs_f64() * 1e3;
    let parts =
        [after(at(&blob("record")?)?), after(at(&blob("prefix")?)?), after(at(&blob("pack_index")?)?)];
    Ok((parts, entry.duration_since(at("/store/refs/demo")?).as_secs_f64() * 1e3))
}

/// A start by tag asks for the entry, the record and — as the tag's ref names them — the prefix
/// and pack index at once; with an old ref (the ID alone) the prefix and pack index wait for the
/// entry's answer; a ref naming the wrong parts costs a fetch, never wrong bytes.
#[test]
fn a_start_by_tag_asks_for_every_part_of_the_image_one_round_trip_after_the_tag() -> Result<()> {
    const RTT: Duration = Duration::from_millis(60);
    let f = fixture("start-parts")?;
    let origin = Nginx::serve(&f.store, "store")?;
    let proxy = Proxy::start(origin.addr(), ProxyConfig::rtt(RTT))?;
    let socket = f.t.path().join("vm.sock");
    let rtt_ms = RTT.as_secs_f64() * 1e3;
    let start = |what: &str| -> Result<([f64; 3], f64)> {
        let seen = proxy.log().len();
        let d = Daemon::start("demo", proxy.url("store"), &socket, &["--read-only"])?;
        device_equals_export(&d, &f, what)?;
        d.stop()?;
        start_requests(&proxy.log()[seen..], &f.store, &f.id)
    };
    let ref_path = f.store.join("refs/demo");
    let current = fs::read_to_string(&ref_path)?;
    ensure!(current.lines().count() == 4, "refs/demo names the prefix, pack index and lengths: {current:?}");

    let (parts, entry) = start("ref with its parts")?;
    eprintln!(
        "ref with its parts: entry {entry:.1} ms after the tag; record, prefix, pack index at {parts:?} ms"
    );
    ensure!(entry >= rtt_ms * 0.9, "the entry was asked {entry:.1} ms after the tag, before its answer");
    for (what, t) in ["record", "prefix", "pack index"].into_iter().zip(parts) {
        ensure!(t.abs() < rtt_ms / 2.0, "the {what} was asked {t:.1} ms after the entry, not with it");
    }

    // A ref written before refs named the parts: the prefix and pack index wait for the entry.
    fs::write(&ref_path, format!("{}\n", f.id))?;
    let (parts, _) = start("old ref")?;
    eprintln!("old ref: record, prefix, pack index at {parts:?} ms after the entry");
    ensure!(parts[0].abs() < rtt_ms / 2.0, "the record was asked {:.1} ms after the entry", parts[0]);
    for (what, t) in ["prefix", "pack index"].into_iter().zip(&parts[1..]) {
        ensure!(
            (rtt_ms * 0.9..rtt_ms * 1.5).contains(t),
            "with an old ref the {what} was asked {t:.1} ms after the entry, not at its answer"
        );
    }

    // A ref naming the wrong parts (here each the other's): the right ones are fetched after
    // the entry, and the device is right.
    let lines: Vec<&str> = current.lines().collect();
    let (p, i) = (lines[1].trim_start_matches("prefix "), lines[2].trim_start_matches("pack-index "));
    let swapped = format!("{}\nprefix {i}\npack-index {p}\n", lines[0]);
    fs::write(&ref_path, swapped)?;
    let seen = proxy.log().len();
    let (parts, _) = start("ref naming the wrong parts")?;
    let asks = |path: &str| proxy.log()[seen..].iter().filter(|r| r.path.ends_with(path)).count();
    for d in [p, i] {
        let hex = d.trim_start_matches("sha256:");
        ensure!(
            asks(hex) == 2,
            "blob {d}: asked {} times, not twice (the wrong hint, then the entry's)",
            asks(hex)
        );
    }
    ensure!(parts[1] >= rtt_ms * 0.9, "the right prefix was asked {:.1} ms after the entry", parts[1]);
    fs::write(&ref_path, current)?;
    Ok(())
}

/// From an origin that honors Range, a start fetches each of the image's parts as parallel
/// ranged GETs (`TESSERA_HTTP_BLOB_PIECE`, here tiny so this small image's parts split): the
/// first piece, then — once its answer says how long the blob is — the rest at once, tiling the
/// blob exactly. A part whose pieces do not add up to its digest is read again whole, and the
/// bytes are right.
#[test]
fn a_start_fetches_the_image_parts_in_parallel_pieces_and_rereads_a_bad_one_whole() -> Result<()> {
    const RTT: Duration = Duration::from_millis(60);
    const PIECE: u64 = 64;
    let f = fixture("start-pieces")?;
    let origin = Nginx::serve(&f.store, "store")?;
    let proxy = Proxy::start(origin.addr(), ProxyConfig::rtt(RTT))?;
    let v: serde_json::Value =
        serde_json::from_slice(&fs::read(f.store.join(format!("images/{}.json", f.id.hex())))?)?;
    let parts: Vec<(&str, String, u64)> = ["record", "prefix", "pack_index"]
        .into_iter()
        .map(|k| {
            let hex = v[k]
                .as_str()
                .with_context(|| format!("entry: {k}"))?
                .trim_start_matches("sha256:")
                .to_owned();
            let len = fs::metadata(f.store.join("blobs/sha256").join(&hex))?.len();
            ensure!(len > 2 * PIECE + PIECE, "the {k} ({len} bytes) is too small to split in pieces");
            Ok((k, format!("/store/blobs/sha256/{hex}"), len))
        })
        .collect::<Result<_>>()?;
    let export = |what: &str| -> Result<Vec<LoggedRequest>> {
        let seen = proxy.log().len();
        let out = f.t.path().join("pieces.raw");
        let o = tessera::command(["export", "demo", "--store", &proxy.url("store"), "-o", path_str(&out)?])
            .env("TESSERA_HTTP_BLOB_PIECE", PIECE.to_string())
            .output()?;
        ensure!(o.status.success(), "{what}: export failed: {}", String::from_utf8_lossy(&o.stderr));
        ensure!(fs::read(&out)? == f.raw, "{what}: the export differs");
        Ok(proxy.log()[seen..].to_vec())
    };
    let ranges = |log: &[LoggedRequest], path: &str| -> Vec<(Option<(u64, u64)>, Instant)> {
        log.iter()
            .filter(|r| r.path == path)
            .map(|r| {
                let range = r.range.as_deref().and_then(|h| {
                    let (a, b) = h.strip_prefix("bytes=")?.split_once('-')?;
                    Some((a.parse().ok()?, b.parse().ok()?))
                });
                (range, r.at)
            })
            .collect()
    };

    // The tag's ref gives the parts' lengths (`build --tag` writes them): every piece goes at
    // once, tiled from the start (with a length learned from the first answer, the first piece
    // would be `2 * PIECE`).
    let log = export("in pieces, lengths known")?;
    for (what, path, len) in &parts {
        let asked = ranges(&log, path);
        let first_at = asked.iter().map(|a| a.1).min().context("nothing asked")?;
        let mut tiles: Vec<(u64, u64)> = Vec::new();
        for &(range, _) in &asked {
            tiles.push(range.with_context(|| format!("the {what} was also asked whole: {asked:?}"))?);
        }
        tiles.sort();
        let count = len.div_ceil(PIECE).min(15);
        let each = len.div_ceil(count);
        let mut next = 0;
        for &(a, b) in &tiles {
            ensure!(a == next && b >= a && b - a < each, "the {what}'s pieces do not tile it: {tiles:?}");
            next = b + 1;
        }
        ensure!(
            next == *len && tiles.len() as u64 == count,
            "the {what}'s {} pieces: {tiles:?}",
            tiles.len()
        );
        // Not waiting for the first answer: a piece on a connection of its own goes one round
        // trip (the connect) after the first, not two (the answer, then the connect); a few may
        // wait one more for a slot of the transport's concurrency.
        let mut after: Vec<Duration> = asked.iter().map(|a| a.1.duration_since(first_at)).collect();
        after.sort();
        let median = after[after.len() / 2];
        ensure!(median < RTT * 3 / 2, "the {what}'s median piece went {median:?} after the first: {asked:?}");
        ensure!(after.iter().all(|&a| a < RTT * 3), "a piece of the {what} went late: {asked:?}");
    }

    // A ref without the lengths (written before refs had them): the first piece, then the rest
    // once its answer gives the length.
    let ref_path = f.store.join("refs/demo");
    let text = fs::read_to_string(&ref_path)?;
    ensure!(
        text.lines().nth(3).is_some_and(|l| l.starts_with("lengths ")),
        "the ref names no lengths: {text:?}"
    );
    fs::write(&ref_path, text.lines().take(3).map(|l| format!("{l}\n")).collect::<String>())?;
    let log = export("in pieces")?;
    for (what, path, len) in &parts {
        let asked = ranges(&log, path);
        let Some(&(Some((0, first_last)), first_at)) = asked.first() else {
            anyhow::bail!("the {what} was not asked for its first piece first: {asked:?}");
        };
        ensure!(first_last == 2 * PIECE - 1, "the {what}'s first piece is bytes 0-{first_last}");
        let mut rest: Vec<(u64, u64, Instant)> = Vec::new();
        for &(range, at) in &asked[1..] {
            let (a, b) = range.with_context(|| format!("the {what} was also asked whole: {asked:?}"))?;
            rest.push((a, b, at));
        }
        rest.sort_by_key(|r| r.0);
        // About a piece each, at most 15: `len - 2 * PIECE` bytes in `count` near-equal pieces.
        let count = (len - 2 * PIECE).div_ceil(PIECE).min(15);
        ensure!(rest.len() as u64 == count, "the {what}'s rest went in {} pieces, not {count}", rest.len());
        let each = (len - 2 * PIECE).div_ceil(count);
        let mut next = 2 * PIECE;
        for &(a, b, _) in &rest {
            ensure!(a == next && b >= a && b - a < each, "the {what}'s pieces do not tile it: {asked:?}");
            next = b + 1;
        }
        ensure!(next == *len, "the {what}'s pieces end at {next}, not at its {len} bytes");
        // The rest waits for the first answer (its length), then goes at once: each piece is
        // asked within a round trip of that answer and one of connecting (one after another on
        // the connection at hand they would take `count` round trips).
        for &(a, _, at) in &rest {
            let after = at.duration_since(first_at);
            ensure!(
                after >= RTT * 9 / 10,
                "the {what}'s piece at {a} went {after:?} after the first, before its answer"
            );
            ensure!(after < RTT * 3, "the {what}'s piece at {a} went {after:?} after the first: not at once");
        }
    }

    // The faults below, still with the ref without lengths: the blob's first request is then
    // its first piece, the one the proxy's fault hits (with every piece at once, it would hit
    // whichever came first, perhaps one whose bytes were only held, which its retry replaces).
    // One bit flipped in one piece of the record: the record is read again whole.
    let (_, record, _) = &parts[0];
    proxy.inject(record, Fault::Corrupt { at: 100 }, 1);
    let log = export("a flipped piece")?;
    let asked = ranges(&log, record);
    ensure!(asked.last().is_some_and(|a| a.0.is_none()), "the record was not read again whole: {asked:?}");
    ensure!(
        asked.iter().filter(|a| a.0.is_none()).count() == 1,
        "the record was read whole more than once: {asked:?}"
    );
    // A piece cut off after bytes already handed on, then asked again: the prefix (its first
    // bytes already inflating) is read again whole.
    let (_, prefix, _) = &parts[1];
    proxy.inject(prefix, Fault::Reset { after: 100 }, 1);
    let log = export("a piece cut off")?;
    let asked = ranges(&log, prefix);
    ensure!(
        asked.iter().filter(|a| a.0.is_none()).count() == 1,
        "the prefix was not read again whole once: {asked:?}"
    );
    fs::write(&ref_path, &text)?;
    Ok(())
}

/// The ranges of `uri` requested in access-log lines (`GET <uri> 206 <bytes> "bytes=a-b"`).
fn ranges_of(lines: &[&str], uri: &str) -> Vec<(u64, u64)> {
    lines
        .iter()
        .filter(|l| l.starts_with("GET ") && l.split(' ').nth(1) == Some(uri))
        .filter_map(|l| {
            let r = l.split('"').nth(1)?;
            tessera_e2e::nginx::parse_range_header(r)
        })
        .flatten()
        .collect()
}

/// Wait (polling: nginx logs a request once it has sent it) until the access log has at least
/// `n` lines; returns it.
/// Copies of a chunk fetched before a read fails on it (`tessera_store::VERIFY_ATTEMPTS`).
const COPIES: usize = 5;

fn log_with_lines(origin: &Nginx, n: usize) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let log = origin.access_log();
        if log.lines().count() >= n || Instant::now() > deadline {
            return log;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn corrupt_chunks_are_refetched_and_bad_origin_bytes_fail_with_eio_remembered_briefly() -> Result<()> {
    let f = fixture("serve-integrity")?;
    let origin = Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    let socket = f.t.path().join("vm.sock");
    let cache = f.t.path().join("cache");
    let c = path_str(&cache)?;

    // Warm the cache, then corrupt every cached chunk.
    let d = Daemon::start("demo", &url, &socket, &["--read-only", "--cache-dir", c])?;
    device_equals_export(&d, &f, "warming")?;
    d.stop()?;
    let chunks = cached_chunks(&cache)?;
    ensure!(chunks.len() > 20, "expected many cached chunks, found {}", chunks.len());
    let mut good = Vec::new();
    for p in &chunks {
        let bytes = fs::read(p)?;
        let mut bad = bytes.clone();
        let mid = bad.len() / 2;
        bad[mid] ^= 0x5a;
        fs::write(p, &bad)?;
        good.push(bytes);
    }
    // A new daemon (empty memory tier) drops each corrupt entry and refetches it: the device is
    // still exactly the export, and every entry holds the origin's bytes again.
    let before = origin.access_log().lines().count();
    let d = Daemon::start("demo", &url, &socket, &["--read-only", "--cache-dir", c])?;
    device_equals_export(&d, &f, "over corrupt cache entries")?;
    d.stop()?;
    for (p, g) in chunks.iter().zip(&good) {
        ensure!(&fs::read(p)? == g, "{} was not healed", p.display());
    }
    // Every entry was fetched again; near chunks may share one ranged GET (the HTTP client
    // coalesces concurrent reads of adjacent chunks), so count the bytes the ranged GETs sent.
    let log = log_with_lines(&origin, before + 1);
    let refetched: u64 = log
        .lines()
        .skip(before)
        .filter(|l| l.contains(" 206 "))
        .filter_map(|l| l.split_whitespace().nth(3)?.parse::<u64>().ok())
        .sum();
    let needed: u64 = good.iter().map(|g| g.len() as u64).sum();
    ensure!(
        refetched >= needed,
        "{} corrupt entries ({needed} bytes) but only {refetched} bytes of ranged GETs after them",
        chunks.len()
    );

    // Corrupt the origin: flip a byte in the middle of the largest pack; a fresh cache.
    let blobs = f.store.join("blobs/sha256");
    let pack = fs::read_dir(&blobs)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .max_by_key(|p| fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .context("no blobs")?;
    let mut bytes = fs::read(&pack)?;
    let flip = (bytes.len() / 2) as u64;
    bytes[flip as usize] ^= 0xff;
    fs::write(&pack, &bytes)?;
    let pack_uri =
        format!("/store/blobs/sha256/{}", pack.file_name().context("pack name")?.to_string_lossy());
    let cache2 = f.t.path().join("cache2");
    // Without readahead, so that every GET of the corrupt chunk is a demand read's.
    let d = Daemon::start(
        "demo",
        &url,
        &socket,
        &["--read-only", "--readahead", "0", "--cache-dir", path_str(&cache2)?],
    )?;
    let mut client = BlkClient::connect(d.socket(), 1, true)?;
    let (whole, failed) = client.read_device(MIB, 8)?;
    ensure!(!failed.is_empty(), "a corrupt chunk at the origin must fail some read");
    ensure!(failed.iter().all(|&(_, e)| e == -libc::EIO), "failed reads must be EIO: {failed:?}");
    // Every read that succeeded has exactly the right bytes.
    for piece in (0..f.raw.len()).step_by(MIB) {
        let end = (piece + MIB).min(f.raw.len());
        if !failed.iter().any(|&(o, _)| o == piece as u64) {
            ensure!(whole[piece..end] == f.raw[piece..end], "read at {piece} succeeded with wrong bytes");
        }
    }
    // Within the failed pieces, read 4 KiB at a time: the first read touching the corrupt chunk
    // fails with EIO after exactly COPIES GETs of its range (the fetch and the refetches of the
    // one policy, `tessera_store::VERIFY_ATTEMPTS`); the reads of it right after fail at once,
    // with no GET (the failure is remembered for 2 s, `FetchLimits::failure_memory`); every
    // other read returns the right bytes.
    let mut eio = 0;
    let mut fetched_eio = None;
    // The whole-device read above failed on the chunk just now: let that memory pass.
    std::thread::sleep(Duration::from_millis(2100));
    for &(piece, _) in &failed {
        let end = (piece + MIB as u64).min(f.raw.len() as u64);
        for at in (piece..end).step_by(4096) {
            let mark = origin.access_log().lines().count();
            let r = client.read(at, 4096)?;
            match r {
                Ok(b) => {
                    let a = at as usize;
                    ensure!(b == f.raw[a..a + 4096], "4 KiB read at {at} succeeded with wrong bytes");
                }
                Err(e) => {
                    ensure!(e == -libc::EIO, "read at {at}: errno {e}, expected EIO");
                    eio += 1;
                    if fetched_eio.is_some() {
                        // Remembered: give a GET time to show in the log, then expect none.
                        std::thread::sleep(Duration::from_millis(50));
                        let log = origin.access_log();
                        let lines: Vec<&str> = log.lines().skip(mark).collect();
                        ensure!(
                            lines.is_empty(),
                            "a read of the chunk that just failed fetched it again:\n{}",
                            lines.join("\n")
                        );
                        continue;
                    }
                    fetched_eio = Some(at);
                    let log = log_with_lines(&origin, mark + COPIES);
                    let lines: Vec<&str> = log.lines().skip(mark).collect();
                    let ranges = ranges_of(&lines, &pack_uri);
                    ensure!(
                        lines.len() == COPIES
                            && ranges.len() == COPIES
                            && ranges.iter().all(|r| *r == ranges[0]),
                        "a corrupt chunk must be fetched exactly {COPIES} times per failed read; log:\n{}",
                        lines.join("\n")
                    );
                    let (a, b) = ranges[0];
                    ensure!(
                        a <= flip && flip <= b,
                        "the refetched range {a}-{b} misses the flipped byte {flip}"
                    );
                }
            }
        }
    }
    ensure!(eio > 1, "{eio} 4 KiB reads hit the corrupt chunk, expected several");
    // Once the memory has passed, a read fetches the chunk again (COPIES GETs) and fails again.
    let at = fetched_eio.context("no read fetched the corrupt chunk")?;
    std::thread::sleep(Duration::from_millis(2100));
    let mark = origin.access_log().lines().count();
    ensure!(
        client.read(at, 4096)?.err() == Some(-libc::EIO),
        "the corrupt chunk read at {at} after the memory"
    );
    let log = log_with_lines(&origin, mark + COPIES);
    ensure!(log.lines().skip(mark).count() == COPIES, "after the memory: {}", log);
    ensure!(!cached_chunks(&cache2)?.is_empty(), "the good chunks are cached");
    drop(client);
    d.stop()?;
    Ok(())
}

/// The ranges of the chunk reads (ranged GETs, status 206, of blobs other than the image's parts)
/// in the access log from line `mark` on, as `(uri, start, end)`: one per range (a multi-range
/// GET gives several).
fn ranged_gets(origin: &Nginx, mark: usize) -> Vec<(String, u64, u64)> {
    let parts = image_part_uris(origin);
    let log = origin.access_log();
    let lines: Vec<&str> = log
        .lines()
        .skip(mark)
        .filter(|l| l.contains(" 206 ") && !parts.iter().any(|u| l.split(' ').nth(1) == Some(u)))
        .collect();
    let mut out = Vec::new();
    for l in &lines {
        let uri = l.split(' ').nth(1).unwrap_or_default().to_owned();
        out.extend(ranges_of(&[l], &uri).into_iter().map(|(a, b)| (uri.clone(), a, b)));
    }
    out
}

/// The URIs of the blobs the served store's image entries name (record, prefix, pack index,
/// profile): a start reads those whole, in ranged pieces; the other ranged GETs are chunk reads.
fn image_part_uris(origin: &Nginx) -> Vec<String> {
    image_part_digests(origin.root()).into_iter().map(|hex| format!("/store/blobs/sha256/{hex}")).collect()
}

/// Bytes the ranged GETs asked for (the HTTP client may merge adjacent chunks into one GET).
fn ranged_bytes(gets: &[(String, u64, u64)]) -> u64 {
    gets.iter().map(|g| g.2 + 1 - g.1).sum()
}

/// Whether no byte of any blob was asked for twice.
fn disjoint(gets: &[(String, u64, u64)]) -> bool {
    let mut sorted = gets.to_vec();
    sorted.sort();
    sorted.windows(2).all(|w| w[0].0 != w[1].0 || w[0].2 < w[1].1)
}

/// Poll until ranged GETs logged from line `mark` on ask for at least `bytes` (at most 20 s).
fn wait_for_ranged(origin: &Nginx, mark: usize, bytes: u64) -> Vec<(String, u64, u64)> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got = ranged_gets(origin, mark);
        if ranged_bytes(&got) >= bytes || Instant::now() > deadline {
            return got;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Stored bytes of all the image's chunks (its pack index).
fn stored_chunk_bytes(store: &Path, id: &ImageId) -> Result<u64> {
    use tessera_image::{ImageEntry, PackIndexBlob};
    let entry = ImageEntry::from_json(&fs::read(store.join("images").join(format!("{}.json", id.hex())))?)?;
    let index = PackIndexBlob::decode(&fs::read(store.join("blobs/sha256").join(entry.pack_index.hex()))?)?;
    Ok(index.stored_bytes())
}

/// Attach a prefetch profile to image `id` in the local store: merge `trace`, store it as a
/// blob, name it in the image entry (what `tessera profile` does).
fn attach_profile(store: &Path, id: &ImageId, trace: &[u8]) -> Result<usize> {
    use tessera_image::{ImageEntry, Profile, Sha256Digest, Trace};
    let trace = Trace::decode(trace)?;
    let image = trace.image();
    ensure!(image.to_string() == id.as_str(), "the trace is of {image}, not {id}");
    let profile = Profile::merge(image, &[trace], 1)?;
    let bytes = profile.encode();
    let digest = Sha256Digest::of(&bytes);
    fs::write(store.join("blobs/sha256").join(digest.hex()), &bytes)?;
    let entry_path = store.join("images").join(format!("{}.json", id.hex()));
    let mut entry = ImageEntry::from_json(&fs::read(&entry_path)?)?;
    entry.profile = Some(digest);
    fs::write(&entry_path, entry.to_json())?;
    Ok(profile.entries().len())
}

#[test]
fn a_prefetch_profile_is_fetched_before_the_guest_reads() -> Result<()> {
    let f = fixture("serve-prefetch")?;
    let socket = f.t.path().join("vm.sock");
    // Record a trace of a whole-device read (from the local store), make it the profile.
    let trace = f.t.path().join("boot.trace");
    let d = Daemon::start("demo", &f.store, &socket, &["--read-only", "--record-trace", path_str(&trace)?])?;
    device_equals_export(&d, &f, "recording a trace")?;
    d.stop()?;
    let chunks = attach_profile(&f.store, &f.id, &fs::read(&trace)?)?;
    ensure!(chunks > 20, "the profile has only {chunks} chunks");

    // A cold daemon over nginx fetches the whole profile (every chunk of the image) before any
    // client connects, each byte once.
    let want = stored_chunk_bytes(&f.store, &f.id)?;
    let origin = Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    let cache = f.t.path().join("cache");
    let mark = origin.access_log().lines().count();
    let d = Daemon::start("demo", &url, &socket, &["--read-only", "--cache-dir", path_str(&cache)?])?;
    let gets = wait_for_ranged(&origin, mark, want);
    let got = ranged_bytes(&gets);
    ensure!(got == want, "{got} bytes of ranged GETs before any read; the profile's chunks are {want} bytes");
    ensure!(disjoint(&gets), "a byte was prefetched twice: {gets:?}");
    // The guest's reads then need nothing from the origin, and get the right bytes.
    let before = origin.access_log().lines().count();
    device_equals_export(&d, &f, "after prefetch")?;
    d.stop()?;
    let after = ranged_gets(&origin, before);
    ensure!(after.is_empty(), "reads after the prefetch still fetched {after:?}");
    Ok(())
}

/// A tag profiled with `tessera profile` names where the profile's chunks are stored, and a
/// daemon started by that tag without a disk cache fetches them with its start, in pieces of at
/// most 192 KiB each on a request of its own (the profile's prefetch would ask for them as a few
/// batches of up to 4 MiB once the image is open), each byte once; reads then need nothing
/// more and get the right bytes.
#[test]
fn a_tag_s_profile_is_fetched_with_the_start() -> Result<()> {
    let f = fixture("serve-staged")?;
    let socket = f.t.path().join("vm.sock");
    let trace = f.t.path().join("boot.trace");
    let d = Daemon::start("demo", &f.store, &socket, &["--read-only", "--record-trace", path_str(&trace)?])?;
    device_equals_export(&d, &f, "recording a trace")?;
    d.stop()?;
    let out =
        tessera::run(["profile", "demo", "--store", path_str(&f.store)?, "--trace", path_str(&trace)?])?;
    ensure!(out.status.success(), "tessera profile: {}", String::from_utf8_lossy(&out.stderr));
    let tag = fs::read_to_string(f.store.join("refs/demo"))?;
    let lines: Vec<&str> = tag.lines().filter(|l| l.starts_with("profile sha256:")).collect();
    ensure!(!lines.is_empty(), "the tag names no profile ranges: {tag:?}");
    tessera::check_store(&f.store)?;

    let want = stored_chunk_bytes(&f.store, &f.id)?;
    // Within what a ref names (2 MiB), in several pieces.
    ensure!(want <= 2 << 20 && want > 4 * (192 << 10), "the image's chunks are {want} bytes");
    let origin = Nginx::serve(&f.store, "store")?;
    let mark = origin.access_log().lines().count();
    let d = Daemon::start("demo", origin.url(), &socket, &["--read-only"])?;
    let gets = wait_for_ranged(&origin, mark, want);
    let got = ranged_bytes(&gets);
    ensure!(got == want, "{got} bytes of ranged GETs before any read; the profile's chunks are {want} bytes");
    ensure!(disjoint(&gets), "a byte was fetched twice: {gets:?}");
    let largest = gets.iter().map(|g| g.2 + 1 - g.1).max().unwrap_or(0);
    ensure!(
        largest <= 192 << 10 && gets.len() as u64 >= want / (192 << 10),
        "{} ranged GETs, the largest {largest} bytes: not the start's pieces",
        gets.len()
    );
    let before = origin.access_log().lines().count();
    device_equals_export(&d, &f, "after the start")?;
    d.stop()?;
    let after = ranged_gets(&origin, before);
    ensure!(after.is_empty(), "reads after the start still fetched {after:?}");

    // A fresh host's empty disk cache: the same, and the chunks land in the cache. A daemon over
    // that cache (which holds chunks now) stages nothing: it asks the origin for no chunk.
    let cache = f.t.path().join("cache");
    for (round, staged) in [("an empty cache", true), ("a cache holding the chunks", false)] {
        let mark = origin.access_log().lines().count();
        let d =
            Daemon::start("demo", origin.url(), &socket, &["--read-only", "--cache-dir", path_str(&cache)?])?;
        let gets = if staged { wait_for_ranged(&origin, mark, want) } else { Vec::new() };
        ensure!(ranged_bytes(&gets) == if staged { want } else { 0 }, "{round}: {gets:?}");
        ensure!(gets.iter().all(|g| g.2 + 1 - g.1 <= 192 << 10), "{round}: not the start's pieces: {gets:?}");
        device_equals_export(&d, &f, round)?;
        d.stop()?;
        let all = ranged_gets(&origin, mark);
        ensure!(ranged_bytes(&all) == ranged_bytes(&gets), "{round}: more chunks fetched: {all:?}");
    }
    ensure!(!cached_chunks(&cache)?.is_empty(), "the staged chunks did not reach the cache");
    Ok(())
}

#[test]
fn a_scattered_profile_goes_out_in_multi_range_gets() -> Result<()> {
    use tessera_image::Trace;
    let f = fixture("serve-multirange")?;
    let socket = f.t.path().join("vm.sock");
    // Every other chunk of a whole-device read: no two profile chunks stored back to back.
    let trace = f.t.path().join("boot.trace");
    let d = Daemon::start("demo", &f.store, &socket, &["--read-only", "--record-trace", path_str(&trace)?])?;
    device_equals_export(&d, &f, "recording a trace")?;
    d.stop()?;
    let full = Trace::decode(&fs::read(&trace)?)?;
    // (A whole-device read touches the chunks in device order, which is pack order here.)
    let half = Trace::new(full.image(), full.entries().iter().step_by(2).cloned().collect())?;
    let chunks = attach_profile(&f.store, &f.id, half.encode().as_bytes())?;
    ensure!(chunks > 10, "the profile has only {chunks} chunks");

    let origin = Nginx::serve(&f.store, "store")?;
    let mark = origin.requests()?.len();
    let cache = f.t.path().join("cache");
    let d = Daemon::start("demo", origin.url(), &socket, &["--read-only", "--cache-dir", path_str(&cache)?])?;
    // The prefetch runs before any client connects; then every byte of the device is read.
    let deadline = Instant::now() + Duration::from_secs(20);
    while cached_chunks(&cache)?.len() < chunks && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    device_equals_export(&d, &f, "after a scattered prefetch")?;
    d.stop()?;
    let requests = origin.requests()?;
    let gets: Vec<_> =
        requests[mark..].iter().filter(|r| r.uri.contains("/blobs/") && r.status == 206).collect();
    let multi = gets.iter().filter(|r| r.ranges.len() > 1).count();
    let ranges: usize = gets.iter().map(|r| r.ranges.len()).sum();
    ensure!(multi > 0, "no multi-range GET: {:#?}", gets);
    ensure!(
        gets.len() < ranges,
        "{} ranged GETs for {ranges} ranges: multi-range GETs saved no request",
        gets.len()
    );
    let twice = tessera_e2e::nginx::bytes_sent_twice(&requests[mark..], "/store/blobs/");
    ensure!(twice.is_empty(), "blob bytes sent twice: {twice:?}");
    eprintln!(
        "{} ranged GETs ({multi} multi-range) for {ranges} ranges; profile of {chunks} chunks",
        gets.len()
    );
    Ok(())
}

/// The device offset of `path`'s first data block, from the exported image (debugfs `bmap`).
fn first_block_offset(raw: &Path, path: &str) -> Result<u64> {
    let out = std::process::Command::new("debugfs")
        .arg("-R")
        .arg(format!("bmap {path} 0"))
        .arg(raw)
        .output()
        .context("running debugfs (e2fsprogs)")?;
    ensure!(out.status.success(), "debugfs: {}", String::from_utf8_lossy(&out.stderr));
    let block: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().context("debugfs bmap output")?;
    ensure!(block > 0, "{path} has no first block");
    Ok(block * 4096)
}

#[test]
fn sequential_reads_fetch_the_next_chunks_ahead() -> Result<()> {
    let f = fixture("serve-readahead")?;
    let start = first_block_offset(&f.t.path().join("local.raw"), "/random.bin")?;
    let origin = Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    let socket = f.t.path().join("vm.sock");
    // (readahead window, chunks fetched after two sequential 64 KiB reads at random.bin's
    // start): the two demand chunks, plus the next four chunks of the file with a 256 KiB
    // window. random.bin's chunks are stored raw: 64 KiB each, in order in one pack.
    for (window, expect) in [("0", 2usize), ("256K", 6)] {
        let cache = f.t.path().join(format!("cache-{window}"));
        let d = Daemon::start(
            "demo",
            &url,
            &socket,
            // File readahead alone (pack-order readahead would add the chunks after the first miss,
            // the first-miss rule the whole file).
            &[
                "--read-only",
                "--readahead",
                window,
                "--pack-readahead=0",
                "--whole-file-first=0",
                "--cache-dir",
                path_str(&cache)?,
            ],
        )?;
        let mut c = BlkClient::connect(d.socket(), 1, true)?;
        let mark = origin.access_log().lines().count();
        for k in 0..2u64 {
            let at = start + k * (64 << 10);
            let bytes = c.read(at, 64 << 10)?.map_err(|e| anyhow::anyhow!("read at {at}: errno {e}"))?;
            let a = at as usize;
            ensure!(bytes == f.raw[a..a + (64 << 10)], "read at {at}: wrong bytes");
        }
        let want = expect as u64 * (64 << 10);
        let gets = wait_for_ranged(&origin, mark, want);
        let got = ranged_bytes(&gets);
        ensure!(got == want, "readahead {window}: {got} bytes fetched, expected {want}: {gets:?}");
        // One pack, consecutive ranges, no byte twice: the file's next chunks.
        let mut ranges: Vec<(u64, u64)> = gets.iter().map(|g| (g.1, g.2)).collect();
        ranges.sort();
        ensure!(gets.iter().all(|g| g.0 == gets[0].0), "readahead {window}: GETs of several packs");
        ensure!(
            ranges.windows(2).all(|w| w[1].0 == w[0].1 + 1),
            "readahead {window}: not the file's next chunks: {ranges:?}"
        );
        // The chunks read ahead are then served from memory: reading them fetches nothing.
        let before = origin.access_log().lines().count();
        let reads = (expect as u64).saturating_sub(2);
        for k in 2..2 + reads {
            let at = start + k * (64 << 10);
            let bytes = c.read(at, 64 << 10)?.map_err(|e| anyhow::anyhow!("read at {at}: errno {e}"))?;
            let a = at as usize;
            ensure!(bytes == f.raw[a..a + (64 << 10)], "read at {at}: wrong bytes");
        }
        drop(c);
        d.stop()?;
        let (lo, hi) = (ranges[0].0, ranges[ranges.len() - 1].1);
        let demand: Vec<_> =
            ranged_gets(&origin, before).into_iter().filter(|g| g.1 <= hi && g.2 >= lo).collect();
        ensure!(demand.is_empty(), "readahead {window}: chunks read ahead were fetched again: {demand:?}");
    }
    // On a warm disk cache (the 256K daemon's) the file's next chunks are a local read away:
    // the same sequential reads queue none of them for readahead, and are served right.
    let _ = fs::remove_file(&socket);
    let cache = f.t.path().join("cache-256K");
    let mut cmd = tessera::command(["serve", "demo", "--read-only", "--store", url.as_str()]);
    cmd.args(["--readahead", "256K", "--pack-readahead=0", "--cache-dir", path_str(&cache)?]);
    let (child, addr) = tessera_e2e::metrics::spawn_with_metrics(cmd.arg("--socket").arg(&socket))?;
    let child = Killed(child);
    let mut c = BlkClient::connect(&socket, 1, true)?;
    for k in 0..2u64 {
        let at = start + k * (64 << 10);
        let bytes = c.read(at, 64 << 10)?.map_err(|e| anyhow::anyhow!("read at {at}: errno {e}"))?;
        let a = at as usize;
        ensure!(bytes == f.raw[a..a + (64 << 10)], "warm cache, read at {at}: wrong bytes");
    }
    drop(c);
    let queued = tessera_e2e::metrics::scrape(&addr)?
        .value("tessera_prefetch_queued_chunks_total", &[("reason", "readahead")])?;
    ensure!(queued == 0.0, "{queued} cached chunks queued for readahead");
    drop(child);
    Ok(())
}

/// `serve` arguments that leave the reads' own misses: no readahead within a file, no pack window.
const MISSES_ONLY: [&str; 4] = ["--readahead", "0", "--pack-readahead", "0"];

/// A file read at random, page by page, as a program reads its binary: after
/// `--whole-file-after` of its reads missed and went to the origin (or at the first, for a file
/// of at most `--whole-file-first`), the rest of the file is fetched in the background (each
/// byte once), and later reads of it fetch nothing; with 0, or a file over a quarter of the
/// memory tier, only what was read is fetched.
#[test]
fn a_file_read_at_random_is_fetched_whole_after_its_misses() -> Result<()> {
    let f = fixture("serve-whole-file")?;
    let start = first_block_offset(&f.t.path().join("local.raw"), "/random.bin")?;
    // random.bin: 1 500 000 bytes, 23 chunks of 64 KiB (the last short), stored raw, in order.
    let (chunks, chunk) = (23u64, 64u64 << 10);
    let file_bytes = 1_500_000u64;
    let origin = Nginx::serve(&f.store, "store")?;
    let url = origin.url();
    let socket = f.t.path().join("vm.sock");
    // (--whole-file-after, --whole-file-first, --mem-cache, the miss that makes the file due)
    for (after, first, mem, due_at) in [
        ("3", "0", "256M", Some(3)),
        ("0", "0", "256M", None),
        ("3", "0", "4M", None),
        ("0", "2M", "256M", Some(1)),
        ("3", "1M", "256M", Some(3)),
        ("0", "2M", "4M", None),
    ] {
        let arms = format!("--whole-file-after {after}, --whole-file-first {first}, --mem-cache {mem}");
        let _ = fs::remove_file(&socket);
        let mut cmd = tessera::command(["serve", "demo", "--read-only", "--store", url.as_str()]);
        // Reads apart (no readahead within the file) and no pack window: misses only.
        cmd.args(MISSES_ONLY);
        cmd.args(["--whole-file-after", after, "--whole-file-first", first, "--mem-cache", mem]);
        let (child, addr) = tessera_e2e::metrics::spawn_with_metrics(cmd.arg("--socket").arg(&socket))?;
        let child = Killed(child);
        let mut c = BlkClient::connect(&socket, 1, true)?;
        let mark = origin.access_log().lines().count();
        let read = |c: &mut BlkClient, k: u64| -> Result<()> {
            let at = start + k * chunk;
            let len = (file_bytes - k * chunk).min(chunk).next_multiple_of(4096) as usize;
            let bytes = c.read(at, len)?.map_err(|e| anyhow::anyhow!("read at {at}: errno {e}"))?;
            ensure!(bytes == f.raw[at as usize..at as usize + len], "read of chunk {k}: wrong bytes");
            Ok(())
        };
        for k in [7, 2, 15] {
            read(&mut c, k)?;
        }
        let queued = |what: &str| -> Result<f64> {
            tessera_e2e::metrics::scrape(&addr)?
                .value("tessera_prefetch_queued_chunks_total", &[("reason", what)])
        };
        if let Some(due_at) = due_at {
            let gets = wait_for_ranged(&origin, mark, file_bytes);
            ensure!(ranged_bytes(&gets) == file_bytes, "{arms}: the file, each byte once: {gets:?}");
            ensure!(disjoint(&gets), "{arms}: a byte fetched twice: {gets:?}");
            ensure!(
                queued("whole_file")? == (chunks - due_at) as f64,
                "{arms}: the chunks not read by miss {due_at} queued, once"
            );
            let before = origin.access_log().lines().count();
            for k in 0..chunks {
                read(&mut c, k)?;
            }
            let again = ranged_gets(&origin, before);
            ensure!(again.is_empty(), "{arms}: reads of a file fetched whole went to the origin: {again:?}");
        } else {
            // Nothing is queued at any miss; the three reads are all that was fetched.
            ensure!(queued("whole_file")? == 0.0, "{arms}: queued");
            let gets = ranged_gets(&origin, mark);
            ensure!(ranged_bytes(&gets) == 3 * chunk, "{arms}: {gets:?}");
        }
        drop(c);
        drop(child);
    }
    Ok(())
}

/// A program read from its start, as an exec reads it: with `--programs-whole`, a miss of its
/// first chunk fetches it whole (each byte once) though it is over `--whole-file-first`; a file
/// as large that is not executable, and any file with the rule turned off, fetch only what was
/// read; a program first read in its middle fetches that chunk, and the rest once its first
/// chunk misses.
#[test]
fn a_program_is_fetched_whole_at_a_miss_of_its_first_chunk() -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let t = tmp("serve-programs")?;
    let (src, store) = (t.path().join("src"), t.path().join("store"));
    fs::create_dir_all(&src)?;
    let mut rng = Prng::from_label("serve-programs");
    // Each 1 500 000 random bytes: 23 chunks of 64 KiB (the last short), stored raw.
    let (chunks, chunk, file_bytes) = (23u64, 64u64 << 10, 1_500_000u64);
    for (name, mode) in [("prog", 0o755), ("other-prog", 0o711), ("data.bin", 0o644)] {
        fs::write(src.join(name), rng.bytes(file_bytes as usize))?;
        fs::set_permissions(src.join(name), fs::Permissions::from_mode(mode))?;
    }
    tessera::build(&src, &store, &["--tag", "demo", "--chunk-size", "64K"])?;
    let raw_path = t.path().join("local.raw");
    tessera::export("demo", &store, &raw_path)?;
    let raw = fs::read(&raw_path)?;
    let origin = Nginx::serve(&store, "store")?;
    let url = origin.url();
    let socket = t.path().join("vm.sock");
    for on in ["true", "false"] {
        let _ = fs::remove_file(&socket);
        let mut cmd = tessera::command(["serve", "demo", "--read-only", "--store", url.as_str()]);
        // Misses only, no other whole-file rule: every file here is over --whole-file-first.
        cmd.args(MISSES_ONLY);
        cmd.args(["--whole-file-after", "0", "--whole-file-first", "1M", "--programs-whole", on]);
        let (child, addr) = tessera_e2e::metrics::spawn_with_metrics(cmd.arg("--socket").arg(&socket))?;
        let child = Killed(child);
        let mut c = BlkClient::connect(&socket, 1, true)?;
        let read = |c: &mut BlkClient, path: &str, k: u64| -> Result<()> {
            let at = first_block_offset(&raw_path, path)? + k * chunk;
            let len = (file_bytes - k * chunk).min(chunk).next_multiple_of(4096) as usize;
            let bytes = c.read(at, len)?.map_err(|e| anyhow::anyhow!("read at {at}: errno {e}"))?;
            ensure!(bytes == raw[at as usize..at as usize + len], "{path}, chunk {k}: wrong bytes");
            Ok(())
        };
        let queued = || -> Result<f64> {
            tessera_e2e::metrics::scrape(&addr)?
                .value("tessera_prefetch_queued_chunks_total", &[("reason", "whole_file")])
        };
        // Not executable: the read's chunk only.
        let mark = origin.access_log().lines().count();
        read(&mut c, "/data.bin", 0)?;
        let gets = ranged_gets(&origin, mark);
        ensure!(ranged_bytes(&gets) == chunk, "--programs-whole {on}, data.bin: {gets:?}");
        // A program first read in its middle: that chunk; then at its start: the rest, if on.
        let mark = origin.access_log().lines().count();
        read(&mut c, "/other-prog", 5)?;
        ensure!(ranged_bytes(&ranged_gets(&origin, mark)) == chunk, "--programs-whole {on}, other-prog");
        // A program read from its start.
        let mark = origin.access_log().lines().count();
        read(&mut c, "/prog", 0)?;
        if on == "true" {
            let gets = wait_for_ranged(&origin, mark, file_bytes);
            ensure!(ranged_bytes(&gets) == file_bytes, "prog, each byte once: {gets:?}");
            ensure!(disjoint(&gets), "prog: a byte fetched twice: {gets:?}");
            ensure!(queued()? == (chunks - 1) as f64, "prog's other chunks queued, once");
            let before = origin.access_log().lines().count();
            for k in 0..chunks {
                read(&mut c, "/prog", k)?;
            }
            let again = ranged_gets(&origin, before);
            ensure!(again.is_empty(), "reads of a program fetched whole went to the origin: {again:?}");
            let mark = origin.access_log().lines().count();
            read(&mut c, "/other-prog", 0)?;
            let gets = wait_for_ranged(&origin, mark, file_bytes - chunk);
            ensure!(ranged_bytes(&gets) == file_bytes - chunk, "other-prog, the rest once: {gets:?}");
        } else {
            ensure!(ranged_bytes(&ranged_gets(&origin, mark)) == chunk, "--programs-whole false, prog");
            ensure!(queued()? == 0.0, "--programs-whole false: queued");
        }
        drop(c);
        drop(child);
    }
    Ok(())
}

/// Small files of one directory read one after another, as an interpreter imports its
/// modules: once reads of `--stretch-after` distinct files stored in one stretch of a pack
/// missed and went to the origin (or of two, within `--stretch-within` misses of each other),
/// the rest of the stretch is fetched in the background (each byte once), and reads of its other
/// files fetch nothing; with 0 only what was read is fetched.
#[test]
fn files_stored_near_several_missed_ones_are_fetched_with_their_stretch() -> Result<()> {
    use tessera_image::{ChunkId, ImageEntry, ImageRecord, PackIndexBlob};
    let t = tmp("serve-stretch")?;
    let (src, store) = (t.path().join("src"), t.path().join("store"));
    fs::create_dir_all(src.join("mods"))?;
    let mut rng = Prng::from_label("serve-stretch");
    // 40 modules of 8000 random bytes: one chunk each, stored raw, in tree order in one pack.
    let files: Vec<(String, Vec<u8>)> =
        (0..40).map(|i| (format!("/mods/m{i:02}.pyc"), rng.bytes(8000))).collect();
    for (path, data) in &files {
        fs::write(src.join(path.trim_start_matches('/')), data)?;
    }
    let id = tessera::build(&src, &store, &["--tag", "demo", "--chunk-size", "64K"])?;
    let raw_path = t.path().join("local.raw");
    tessera::export("demo", &store, &raw_path)?;
    let raw = fs::read(&raw_path)?;
    // Each file's stretch (128 KiB of its pack, aligned) and stored bytes, from the pack index.
    let stretch = 128u64 << 10;
    let entry = ImageEntry::from_json(&fs::read(store.join("images").join(format!("{}.json", id.hex())))?)?;
    let record = ImageRecord::decode(&fs::read(store.join("blobs/sha256").join(entry.record.hex()))?)?;
    let index = PackIndexBlob::decode(&fs::read(store.join("blobs/sha256").join(entry.pack_index.hex()))?)?
        .keyed(record.block_map.chunks())?;
    let placed: Vec<((String, u64), u64)> = files
        .iter()
        .map(|(path, data)| {
            let (pack, loc) =
                index.get(&ChunkId::of(data)).with_context(|| format!("{path}: not in the index"))?;
            Ok(((pack.hex(), loc.offset / stretch), u64::from(loc.stored_len)))
        })
        .collect::<Result<_>>()?;
    let near: Vec<usize> = (0..files.len()).filter(|&i| placed[i].0 == placed[0].0).collect();
    ensure!(near.len() >= 6 && near.len() < files.len(), "the first stretch holds {near:?}");
    let stored = |set: &[usize]| set.iter().map(|&i| placed[i].1).sum::<u64>();
    let read_three = [near[0], near[2], near[4]];

    let origin = Nginx::serve(&store, "store")?;
    let url = origin.url();
    let socket = t.path().join("vm.sock");
    // (--stretch-after, --stretch-within, the read that makes the stretch due: none with 0)
    for (after, within, due_at) in [("3", "0", Some(3)), ("3", "10", Some(2)), ("0", "10", None)] {
        let _ = fs::remove_file(&socket);
        let mut cmd = tessera::command(["serve", "demo", "--read-only", "--store", url.as_str()]);
        // No readahead within a file, no pack window, no whole files: misses and stretches only.
        cmd.args(MISSES_ONLY).args(["--whole-file-after=0", "--whole-file-first=0"]);
        cmd.args(["--stretch-after", after, "--stretch-within", within, "--stretch-size", "128K"]);
        let (child, addr) = tessera_e2e::metrics::spawn_with_metrics(cmd.arg("--socket").arg(&socket))?;
        let child = Killed(child);
        let mut c = BlkClient::connect(&socket, 1, true)?;
        let mark = origin.access_log().lines().count();
        let read = |c: &mut BlkClient, i: usize| -> Result<()> {
            let at = first_block_offset(&raw_path, &files[i].0)?;
            let bytes =
                c.read(at, 8192)?.map_err(|e| anyhow::anyhow!("read of {}: errno {e}", files[i].0))?;
            ensure!(bytes == raw[at as usize..at as usize + 8192], "{}: wrong bytes", files[i].0);
            Ok(())
        };
        for i in read_three {
            read(&mut c, i)?;
        }
        let queued = tessera_e2e::metrics::scrape(&addr)?
            .value("tessera_prefetch_queued_chunks_total", &[("reason", "stretch")])?;
        if let Some(k) = due_at {
            let gets = wait_for_ranged(&origin, mark, stored(&near));
            ensure!(
                ranged_bytes(&gets) == stored(&near),
                "the stretch's files {near:?}, each byte once: {gets:?}"
            );
            ensure!(disjoint(&gets), "a byte fetched twice: {gets:?}");
            ensure!(
                queued == (near.len() - k) as f64,
                "--stretch-after {after} --stretch-within {within}: the stretch's other files queued \
                 once at read {k}: {queued}"
            );
            let before = origin.access_log().lines().count();
            for &i in &near {
                read(&mut c, i)?;
            }
            let again = ranged_gets(&origin, before);
            ensure!(
                again.is_empty(),
                "reads of files fetched with their stretch went to the origin: {again:?}"
            );
        } else {
            ensure!(queued == 0.0, "--stretch-after 0: {queued} chunks queued");
            let gets = ranged_gets(&origin, mark);
            ensure!(ranged_bytes(&gets) == stored(&read_three), "--stretch-after 0: {gets:?}");
        }
        drop(c);
        drop(child);
    }
    Ok(())
}

/// A measurement, not a gate (the HTTP client's tests own the ≤ 3 RTT assertion): 32 cold
/// 4 KiB reads of distinct 64 KiB chunks submitted at once on one queue, nginx behind the
/// latency proxy at 20 ms per connection and per request, with `--fetch-jobs 64` and 4.
/// `cargo test -p tessera-e2e --test serve_origin -- --ignored --nocapture cold_reads`
#[test]
#[ignore]
fn cold_reads_through_a_20ms_origin() -> Result<()> {
    use tessera_e2e::proxy::{Proxy, ProxyConfig};
    let f = fixture("serve-cold")?;
    let start = first_block_offset(&f.t.path().join("local.raw"), "/random.bin")?;
    let origin = Nginx::serve(&f.store, "store")?;
    let rtt = Duration::from_millis(20);
    let proxy = Proxy::start(([127, 0, 0, 1], origin.port()).into(), ProxyConfig::rtt(rtt))?;
    let url = proxy.url("store");
    let socket = f.t.path().join("vm.sock");
    for jobs in ["64", "4"] {
        let d =
            Daemon::start("demo", &url, &socket, &["--read-only", "--readahead", "0", "--fetch-jobs", jobs])?;
        let mut c = BlkClient::connect(d.socket(), 1, true)?;
        // 64 KiB steps from random.bin's start: its 23 chunks, then text.txt's first 9 (the
        // next file on the device) — 32 distinct chunks.
        let reads: Vec<(u64, usize)> = (0..32u64).map(|k| (start + k * (64 << 10), 4096)).collect();
        let t0 = Instant::now();
        let results = c.read_batch(0, &reads)?;
        let took = t0.elapsed();
        for (r, &(at, len)) in results.iter().zip(&reads) {
            let a = at as usize;
            ensure!(r.as_deref() == Ok(&f.raw[a..a + len]), "read at {at}");
        }
        eprintln!(
            "--fetch-jobs {jobs}: 32 cold reads in {took:?} = {:.1} RTT",
            took.as_secs_f64() / rtt.as_secs_f64()
        );
        drop(c);
        d.stop()?;
    }
    Ok(())
}
