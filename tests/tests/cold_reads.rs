//! Cold-read concurrency (issue 5, point 5; issue 15, point 7; brief §7): `tessera serve` from
//! nginx behind the latency proxy (charged per new connection and per request); a libblkio
//! client submits 32 reads of distinct chunks that nothing has fetched yet, on ONE queue at once.
//! They must all complete within 3 round trips plus a margin of at most one round trip — not the
//! 32 round trips of fetching one after the other — whether the chunks are adjacent in one pack
//! (joined into few requests) or spread over three packs with gaps between them (a request
//! each, in parallel), and the proxy must see no connection that carried nothing. The same reads
//! one at a time (the peer) pay one round trip each, over reused connections.
//!
//! The RTT is 100 ms (CI): a debug build on a loaded 2-core machine spends some of the one-RTT
//! margin on its own work, and a longer RTT makes that a smaller part of it.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use tessera_e2e::daemon::{BlkClient, Daemon};
use tessera_e2e::nginx::Nginx;
use tessera_e2e::prng::Prng;
use tessera_e2e::proxy::{Proxy, ProxyConfig};
use tessera_e2e::tessera;
use tessera_e2e::testutil::tmp;

const RTT: Duration = Duration::from_millis(100);
/// Allowed above 3 RTT: at most one RTT (issue 15). On a quiet machine the reads take 2 RTT
/// (a new connection, then the request).
const MARGIN: Duration = RTT;
const CHUNK: u64 = 64 << 10;
const READS: u64 = 32;
/// What the rounds count is the demand reads' own requests: pack-order readahead (which fetches
/// the chunks stored after a missed one, in the background) and whole-file readahead (the rest
/// of a file after its first or third miss) are off, as file readahead is (no read continues
/// another).
const NO_READAHEAD: &[&str] =
    &["--read-only", "--pack-readahead=0", "--whole-file-after=0", "--whole-file-first=0"];

/// Where `data` (a file's content, contiguous on the device) starts in the raw export `raw`.
fn find(raw: &[u8], data: &[u8]) -> Result<u64> {
    let start = (0..raw.len() - 4096)
        .step_by(4096)
        .find(|&o| raw[o..o + 4096] == data[..4096])
        .context("the file's first block is not on the device")?;
    ensure!(raw[start..start + data.len()] == data[..], "the file is not contiguous");
    Ok(start as u64)
}

/// One round on a fresh daemon (nothing in memory): submit `reads` at once, check the bytes and
/// the time; returns the requests and new connections the proxy saw.
fn round(name: &str, proxy: &Proxy, socket: &Path, raw: &[u8], reads: &[(u64, usize)]) -> Result<(u64, u64)> {
    let bound = 3 * RTT + MARGIN;
    let d = Daemon::start("demo", proxy.url("store"), socket, NO_READAHEAD)?;
    let mut c = BlkClient::connect(d.socket(), 1, true)?;
    let before = proxy.stats();
    let t0 = Instant::now();
    let results = c.read_batch(0, reads)?;
    let took = t0.elapsed();
    let after = proxy.stats();
    for ((offset, len), r) in reads.iter().zip(&results) {
        let got = r.as_ref().map_err(|errno| anyhow::anyhow!("read at {offset} failed: errno {errno}"))?;
        let o = *offset as usize;
        ensure!(got[..] == raw[o..o + len], "read at {offset}: wrong bytes");
    }
    let conns = after.connections - before.connections;
    let requests = after.requests - before.requests;
    eprintln!(
        "{name}: {} cold reads in {took:?} ({:.1} RTT); {requests} requests, {conns} new connections",
        reads.len(),
        took.as_secs_f64() / RTT.as_secs_f64()
    );
    for r in proxy.log().iter().filter(|r| r.at >= t0) {
        eprintln!(
            "  request at +{:?} on connection {}: {}",
            r.at - t0,
            r.connection,
            r.range.as_deref().unwrap_or("-")
        );
    }
    ensure!(
        took <= bound,
        "{name}: {} cold reads took {took:?}, more than 3 RTT + {MARGIN:?} = {bound:?}",
        reads.len()
    );
    // What the target is about is the time above (connects are charged by the proxy). This only
    // checks that no connection was opened for nothing.
    ensure!(
        conns <= requests,
        "{name}: {conns} new connections for {requests} requests: a connection carried nothing"
    );
    drop(c);
    d.stop()?;
    Ok((requests, conns))
}

#[test]
fn thirty_two_cold_reads_on_one_queue_finish_within_three_round_trips() -> Result<()> {
    let t = tmp("cold-reads")?;
    let (src, store) = (t.path().join("src"), t.path().join("store"));
    fs::create_dir_all(&src)?;
    // Incompressible data in chunks of 64 KiB, stored raw, in three packs: each build puts the
    // chunks the store does not hold yet into a new pack. Pack 1: a.bin (96 chunks) and b.bin;
    // pack 2: c.bin; pack 3: d.bin (32 chunks each).
    let mut prng = Prng::from_label("cold-reads");
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("a.bin", prng.bytes(96 * CHUNK as usize)),
        ("b.bin", prng.bytes(32 * CHUNK as usize)),
        ("c.bin", prng.bytes(32 * CHUNK as usize)),
        ("d.bin", prng.bytes(32 * CHUNK as usize)),
    ];
    let args = ["--chunk-size", "64K", "--free", "4M"];
    for (k, upto) in [2, 3, 4].into_iter().enumerate() {
        for (name, data) in &files[..upto] {
            fs::write(src.join(name), data)?;
        }
        let tag = if upto == 4 { "demo".to_owned() } else { format!("step{k}") };
        tessera::build(&src, &store, &[&["--tag", tag.as_str()][..], &args[..]].concat())?;
    }
    let packs = tessera::inspect_json("demo", &store)?["packs"].as_u64().context("inspect: packs")?;
    ensure!(packs >= 3, "the image's chunks are in {packs} packs, not 3");
    let raw_path = t.path().join("local.raw");
    tessera::export("demo", &store, &raw_path)?;
    let raw = fs::read(&raw_path)?;
    let starts = files.iter().map(|(_, data)| find(&raw, data)).collect::<Result<Vec<u64>>>()?;

    let nginx = Nginx::serve(&store, "store")?;
    let proxy = Proxy::start(nginx.addr(), ProxyConfig::rtt(RTT))?;
    let socket = t.path().join("vm.sock");
    // Each read is the first 4 KiB of a chunk, so no read continues another (no readahead).
    let chunk = |file: usize, i: u64| (starts[file] + i * CHUNK, 4096usize);
    // Adjacent chunks of one pack: two rounds on a.bin's first 64 chunks.
    for r in 0..2u64 {
        let reads: Vec<_> = (0..READS).map(|i| chunk(0, r * READS + i)).collect();
        let (requests, _) = round(&format!("adjacent, round {r}"), &proxy, &socket, &raw, &reads)?;
        // How the 32 reads split into requests depends on when each arrives (CI saw 2 to 7).
        ensure!(
            requests <= READS / 2,
            "{requests} requests for {READS} reads of adjacent chunks: they were not joined"
        );
    }
    // Spread over three packs, a chunk apart (nothing to join): every other chunk of b.bin,
    // c.bin and d.bin, round-robin over the packs.
    for r in 0..2u64 {
        let reads: Vec<_> = (0..READS).map(|i| chunk(1 + (i % 3) as usize, 2 * (i / 3) + r)).collect();
        let (requests, _) = round(&format!("three packs, round {r}"), &proxy, &socket, &raw, &reads)?;
        ensure!(requests <= READS, "{requests} requests for {READS} reads");
    }

    // The peer: the same number of cold reads one after the other (queue depth 1) pays one
    // round trip each — this also proves the proxy charges what it should.
    let d = Daemon::start("demo", proxy.url("store"), &socket, NO_READAHEAD)?;
    let mut c = BlkClient::connect(d.socket(), 1, true)?;
    let before = proxy.stats();
    let t0 = Instant::now();
    for i in 0..READS {
        let (offset, len) = chunk(0, 2 * READS + i);
        let got = c.read(offset, len)?.map_err(|errno| anyhow::anyhow!("serial read failed: {errno}"))?;
        ensure!(
            got[..] == raw[offset as usize..offset as usize + len],
            "serial read at {offset}: wrong bytes"
        );
    }
    let serial = t0.elapsed();
    let after = proxy.stats();
    eprintln!(
        "serial: {READS} cold reads in {serial:?} ({:.1} RTT); {} requests, {} new connections",
        serial.as_secs_f64() / RTT.as_secs_f64(),
        after.requests - before.requests,
        after.connections - before.connections
    );
    ensure!(
        serial >= READS as u32 * RTT,
        "serial reads took {serial:?}: the proxy did not charge each request"
    );
    // Connection reuse: one after the other, the requests go over connections already open.
    let conns = after.connections - before.connections;
    ensure!(conns <= 1, "{conns} new connections for {READS} serial requests: connections are not reused");
    drop(c);
    d.stop()?;
    Ok(())
}
