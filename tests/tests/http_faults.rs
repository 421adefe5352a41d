//! The HTTP origin client under a modelled network: nginx behind the latency/fault proxy
//! (`tessera_e2e::proxy`). Connections are reused and near chunks of a pack share one Range
//! request; a reset or truncated body is retried and the export is still byte-identical; a
//! flipped byte is refetched, and never served when it persists; a silent server hits the
//! first-byte timeout, or (the default) the request is resent when its head is late; bursts of
//! 503 are retried with growing waits, then reported.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use tessera_e2e::nginx::Nginx;
use tessera_e2e::prng::Prng;
use tessera_e2e::proxy::{Fault, Proxy, ProxyConfig};
use tessera_e2e::tessera::{self, ImageId};
use tessera_e2e::testutil::tmp;

struct Setup {
    t: tempfile::TempDir,
    id: ImageId,
    local_raw: Vec<u8>,
    /// Hex digest of the (only) pack.
    pack: String,
    /// Chunks in the image.
    chunks: usize,
    nginx: Nginx,
}

/// Two files over many 64 KiB chunks (incompressible and text) in one pack, served by nginx.
fn setup(name: &str) -> Result<Setup> {
    let t = tmp(name)?;
    let (src, store) = (t.path().join("src"), t.path().join("store"));
    let mut rng = Prng::from_label(name);
    fs::create_dir_all(&src)?;
    fs::write(src.join("random.bin"), rng.bytes(2_000_000))?;
    fs::write(src.join("text.txt"), rng.text(600_000))?;
    let id = tessera::build(&src, &store, &["--tag", "demo", "--chunk-size", "64K"])?;
    let local = t.path().join("local.raw");
    tessera::export("demo", &store, &local)?;
    let local_raw = fs::read(&local)?;
    let v = tessera::inspect_json("demo", &store)?;
    let chunks = v["chunks"].as_u64().context("inspect: chunks")? as usize;
    // The pack is the largest blob.
    let mut blobs: Vec<(u64, String)> = Vec::new();
    for e in fs::read_dir(store.join("blobs/sha256"))? {
        let e = e?;
        blobs.push((e.metadata()?.len(), e.file_name().to_string_lossy().into_owned()));
    }
    blobs.sort();
    let pack = blobs.last().context("no blobs")?.1.clone();
    let nginx = Nginx::serve(&store, "store")?;
    Ok(Setup { t, id, local_raw, pack, chunks, nginx })
}

fn export(url: &str, out: &Path, env: &[(&str, &str)]) -> Result<Output> {
    let mut cmd = tessera::command(["export", "demo", "--store", url, "-o", out.to_str().context("utf-8")?]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    Ok(cmd.output()?)
}

fn export_ok(s: &Setup, url: &str, env: &[(&str, &str)], what: &str) -> Result<PathBuf> {
    let out = s.t.path().join("http.raw");
    let o = export(url, &out, env)?;
    ensure!(o.status.success(), "{what}: {} — {}", o.status, String::from_utf8_lossy(&o.stderr));
    let got = fs::read(&out)?;
    ensure!(got.len() == s.local_raw.len(), "{what}: {} bytes, expected {}", got.len(), s.local_raw.len());
    ensure!(got == s.local_raw, "{what}: the bytes differ from the local export");
    Ok(out)
}

fn proxy(s: &Setup, rtt_ms: u64) -> Result<Proxy> {
    Proxy::start(s.nginx.addr(), ProxyConfig::rtt(Duration::from_millis(rtt_ms)))
}

#[test]
fn connections_are_reused_and_near_chunks_share_a_request() -> Result<()> {
    let s = setup("http-coalesce")?;
    let p = proxy(&s, 10)?;
    export_ok(&s, &p.url("store"), &[], "export through the proxy")?;
    let log = p.log();
    let ranged = log.iter().filter(|r| r.range.is_some() && r.path.contains(&s.pack)).count();
    let st = p.stats();
    eprintln!("{} chunks: {ranged} ranged requests; {st:?}", s.chunks);
    ensure!(s.chunks >= 40, "the fixture should have many chunks, has {}", s.chunks);
    // 64 KiB chunks, 4 MiB export pieces: a handful of requests for the whole pack.
    ensure!(
        ranged * 4 <= s.chunks,
        "{ranged} ranged requests for {} chunks: near chunks were not coalesced\n{log:#?}",
        s.chunks
    );
    // Besides the pack's chunks, only the image's parts (record, prefix, pack index) are asked
    // in ranges: each read whole from its first byte (parallel pieces; these are one each).
    let parts: Vec<_> = log.iter().filter(|r| r.range.is_some() && !r.path.contains(&s.pack)).collect();
    ensure!(
        parts.len() <= 3
            && parts.iter().all(|r| r.range.as_deref().is_some_and(|h| h.starts_with("bytes=0-"))),
        "ranges of blobs other than the pack and the image's parts: {parts:#?}"
    );
    // Every request but the first of each connection reused one: far fewer connections.
    ensure!(
        st.connections <= 4 && st.connections < st.requests,
        "{} connections for {} requests: connections are not reused",
        st.connections,
        st.requests
    );
    // About one chunk per request (coalescing capped at 64 KiB, one span per request), two
    // requests in flight at most:
    // many ranged requests, over two or three reused connections.
    let before = p.stats();
    let env = [
        ("TESSERA_HTTP_COALESCE_MAX", "65536"),
        ("TESSERA_HTTP_MULTI_RANGE", "1"),
        ("TESSERA_HTTP_CONCURRENCY", "2"),
    ];
    export_ok(&s, &p.url("store"), &env, "export, one chunk per request")?;
    let st = p.stats();
    let (requests, conns) = (st.requests - before.requests, st.connections - before.connections);
    eprintln!("one chunk per request: {requests} requests over {conns} connections");
    ensure!(requests as usize > s.chunks / 2, "{requests} requests for {} chunks", s.chunks);
    ensure!(conns <= 4, "{conns} connections for {requests} requests: connections are not reused");
    Ok(())
}

#[test]
fn reset_and_truncated_bodies_are_retried() -> Result<()> {
    let s = setup("http-reset")?;
    let p = proxy(&s, 2)?;
    p.inject(&s.pack, Fault::Reset { after: 30_000 }, 2);
    p.inject(&s.pack, Fault::Truncate { after: 10_000 }, 2);
    // Whole blobs (entry, record, prefix, pack index) break too.
    p.inject("/blobs/", Fault::Reset { after: 10 }, 1);
    export_ok(&s, &p.url("store"), &[], "export with resets and truncations")?;
    ensure!(p.faults_left() == 0, "{} faults were not applied", p.faults_left());
    // Inspect through the same faults.
    p.inject("/images/", Fault::Reset { after: 5 }, 1);
    p.inject("/blobs/", Fault::Truncate { after: 100 }, 2);
    let o = tessera::run(["inspect", s.id.as_str(), "--store", &p.url("store"), "--json"])?;
    ensure!(o.status.success(), "inspect with faults: {}", String::from_utf8_lossy(&o.stderr));
    tessera::check_inspect(&serde_json::from_slice(&o.stdout)?, &s.id)?;
    ensure!(p.faults_left() == 0, "{} faults were not applied", p.faults_left());
    Ok(())
}

#[test]
fn a_flipped_byte_is_refetched_and_never_served() -> Result<()> {
    let s = setup("http-corrupt")?;
    let p = proxy(&s, 2)?;
    // Once per blob kind: the whole-blob sha256 check and the chunk blake3 check both refetch.
    p.inject("/blobs/", Fault::Corrupt { at: 100 }, 1);
    p.inject(&s.pack, Fault::Corrupt { at: 70_000 }, 1);
    export_ok(&s, &p.url("store"), &[], "export with flipped bytes")?;
    ensure!(p.faults_left() == 0, "{} faults were not applied", p.faults_left());
    // A pack that is always corrupt in transit: the export fails (exit 1) naming a corrupt
    // chunk, and leaves no output file.
    p.inject(&s.pack, Fault::Corrupt { at: 1000 }, 10_000);
    let out = s.t.path().join("bad.raw");
    let o = export(&p.url("store"), &out, &[])?;
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(o.status.code() == Some(1), "export of always-corrupt bytes: {} — {err}", o.status);
    ensure!(err.contains("corrupt"), "the message names the corruption: {err}");
    ensure!(!out.exists(), "a failed export leaves no file");
    Ok(())
}

#[test]
fn a_silent_server_hits_the_first_byte_timeout() -> Result<()> {
    let s = setup("http-stall")?;
    let p = proxy(&s, 2)?;
    // The other timeouts far away, and no late-head resends, so that only the first-byte
    // timeout can end a stall within the bounds below (generous: CI machines are loaded).
    let env = [
        ("TESSERA_HTTP_FIRST_BYTE_TIMEOUT", "400ms"),
        ("TESSERA_HTTP_STALL_TIMEOUT", "60s"),
        ("TESSERA_HTTP_TIMEOUT", "120s"),
        ("TESSERA_HTTP_RESEND_LATE", "off"),
    ];
    let bound = Duration::from_secs(30);
    p.inject(&s.pack, Fault::Stall, 2);
    let t = Instant::now();
    export_ok(&s, &p.url("store"), &env, "export with two stalls")?;
    let took = t.elapsed();
    ensure!(p.faults_left() == 0, "the stalls were not all hit");
    ensure!(took >= Duration::from_millis(800), "two 400 ms timeouts took only {took:?}");
    ensure!(took < bound, "the first-byte timeout did not cut the stalls short: {took:?}");
    // Without retries the stall is the error, well before the whole-request timeout.
    p.inject(&s.pack, Fault::Stall, 1);
    let t = Instant::now();
    let mut no_retry = env.to_vec();
    no_retry.push(("TESSERA_HTTP_RETRIES", "1"));
    let o = export(&p.url("store"), &s.t.path().join("x.raw"), &no_retry)?;
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(o.status.code() == Some(1), "export into a stall without retries: {} — {err}", o.status);
    ensure!(err.contains(&s.pack) && err.to_lowercase().contains("timeout"), "message: {err}");
    ensure!(t.elapsed() < bound, "took {:?}", t.elapsed());
    // With late-head resends (the default) the same stall, still without retries, is resent
    // after the origin's usual latency (the refs and entry GETs taught it) and the export
    // succeeds: a resend spends no attempt.
    p.inject(&s.pack, Fault::Stall, 1);
    let resend = [("TESSERA_HTTP_FIRST_BYTE_TIMEOUT", "20s"), ("TESSERA_HTTP_RETRIES", "1")];
    let t = Instant::now();
    export_ok(&s, &p.url("store"), &resend, "export with a stall, resent")?;
    ensure!(p.faults_left() == 0, "the stall was not hit");
    ensure!(t.elapsed() < Duration::from_secs(10), "the stall was waited out: {:?}", t.elapsed());
    Ok(())
}

#[test]
fn bursts_of_503_back_off_then_fail_naming_the_url() -> Result<()> {
    let s = setup("http-503")?;
    let p = proxy(&s, 2)?;
    // Four 503s on the pack, then success (the default policy allows five attempts).
    p.inject(&s.pack, Fault::Status(503), 4);
    let env = [("TESSERA_HTTP_CONCURRENCY", "1")];
    export_ok(&s, &p.url("store"), &env, "export through a 503 burst")?;
    ensure!(p.faults_left() == 0, "the 503s were not all served");
    let pack_reqs: Vec<_> = p.log().into_iter().filter(|r| r.path.contains(&s.pack)).collect();
    ensure!(pack_reqs.len() >= 5, "{pack_reqs:#?}");
    // The export fetches chunks in parallel (one request at a time on the wire here), so the
    // attempts of different ranges interleave. A 503 within the retry budget (ten in reserve:
    // these four are) waits a quarter of the backoff, so every retried range waited at least
    // 12.5, 25, 50, 100 ms before its 2nd, 3rd, 4th, 5th attempt (a quarter of equal jitter's
    // half of 100 ms doubling), and every range's last attempt succeeded (the export did).
    let mut by_range: Vec<(Option<String>, Vec<std::time::Instant>)> = Vec::new();
    for r in &pack_reqs {
        match by_range.iter_mut().find(|(range, _)| *range == r.range) {
            Some((_, at)) => at.push(r.at),
            None => by_range.push((r.range.clone(), vec![r.at])),
        }
    }
    let retries: usize = by_range.iter().map(|(_, at)| at.len() - 1).sum();
    ensure!(retries == 4, "4 faults, {retries} retries: {pack_reqs:#?}");
    for (range, at) in &by_range {
        for (k, w) in at.windows(2).enumerate() {
            let gap = w[1] - w[0];
            let floor = Duration::from_micros(12_500 << k);
            ensure!(gap >= floor, "{range:?} retry {}: waited {gap:?}, expected at least {floor:?}", k + 1);
        }
    }
    // A burst longer than the policy: exit 1, the message names the URL and the status.
    p.inject(&s.pack, Fault::Status(503), 1000);
    let o = export(&p.url("store"), &s.t.path().join("x.raw"), &[])?;
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(o.status.code() == Some(1), "export into endless 503s: {} — {err}", o.status);
    ensure!(err.contains("503") && err.contains(&p.url("store")), "message: {err}");
    Ok(())
}
