//! Cold-read concurrency (issue 5, point 5; brief §7): `tessera serve` from nginx behind the
//! latency proxy at 20 ms RTT (charged per new connection and per request); a libblkio client
//! submits 32 reads of distinct chunks that nothing has fetched yet, on ONE queue at once. They
//! must all complete within 3 round trips plus a stated margin — not the 32 round trips of
//! fetching one after the other — and the proxy must see far fewer than 32 connections. The
//! same reads one at a time (the peer) pay one round trip each, over reused connections.

use std::fs;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use tessera_e2e::daemon::{BlkClient, Daemon};
use tessera_e2e::nginx::Nginx;
use tessera_e2e::prng::Prng;
use tessera_e2e::proxy::{Proxy, ProxyConfig};
use tessera_e2e::tessera;
use tessera_e2e::testutil::tmp;

const RTT: Duration = Duration::from_millis(20);
/// Allowed above 3 RTT for the (debug-built) daemon, proxy and client on a loaded CI machine
/// (2 cores shared with builds): 3 RTT + 200 ms = 260 ms is still well under half the 32 RTT
/// (640 ms) of serial fetching. On a quiet machine the reads take about 3 RTT.
const MARGIN: Duration = Duration::from_millis(200);
const CHUNK: u64 = 64 << 10;
const READS: u64 = 32;

#[test]
fn thirty_two_cold_reads_on_one_queue_finish_within_three_round_trips() -> Result<()> {
    let t = tmp("cold-reads")?;
    let (src, store) = (t.path().join("src"), t.path().join("store"));
    fs::create_dir_all(&src)?;
    // 8 MiB of incompressible data: 128 chunks of 64 KiB in one pack, stored raw.
    let data = Prng::from_label("cold-reads").bytes(8 << 20);
    fs::write(src.join("data.bin"), &data)?;
    tessera::build(&src, &store, &["--tag", "demo", "--chunk-size", "64K"])?;
    let raw_path = t.path().join("local.raw");
    tessera::export("demo", &store, &raw_path)?;
    let raw = fs::read(&raw_path)?;
    // The file's data is contiguous on the device: find where it starts.
    let start = (0..raw.len() - 4096)
        .step_by(4096)
        .find(|&o| raw[o..o + 4096] == data[..4096])
        .context("the file's first block is not on the device")? as u64;
    ensure!(raw[start as usize..start as usize + data.len()] == data[..], "the file is not contiguous");

    let nginx = Nginx::serve(&store, "store")?;
    let proxy = Proxy::start(nginx.addr(), ProxyConfig::rtt(RTT))?;
    let socket = t.path().join("vm.sock");
    let bound = 3 * RTT + MARGIN;
    let mut times = Vec::new();
    // Three rounds, each on a fresh daemon (nothing in memory) and its own 32 chunks; each read
    // is the first 4 KiB of a chunk, so no read continues another (no readahead).
    for round in 0..3u64 {
        let d = Daemon::start("demo", proxy.url("store"), &socket, &["--read-only"])?;
        let mut c = BlkClient::connect(d.socket(), 1, true)?;
        let reads: Vec<(u64, usize)> =
            (0..READS).map(|i| (start + (round * READS + i) * CHUNK, 4096)).collect();
        let before = proxy.stats();
        let t0 = Instant::now();
        let results = c.read_batch(0, &reads)?;
        let took = t0.elapsed();
        let after = proxy.stats();
        for ((offset, len), r) in reads.iter().zip(&results) {
            let got =
                r.as_ref().map_err(|errno| anyhow::anyhow!("read at {offset} failed: errno {errno}"))?;
            let o = *offset as usize;
            ensure!(got[..] == raw[o..o + len], "read at {offset}: wrong bytes");
        }
        let conns = after.connections - before.connections;
        let requests = after.requests - before.requests;
        eprintln!(
            "round {round}: {READS} cold reads in {took:?} ({:.1} RTT); {requests} requests, {conns} new connections",
            took.as_secs_f64() / RTT.as_secs_f64()
        );
        for r in proxy.log().iter().filter(|r| r.at >= t0) {
            eprintln!("  request at +{:?}: {}", r.at - t0, r.range.as_deref().unwrap_or("-"));
        }
        times.push(took);
        ensure!(
            took <= bound,
            "round {round}: {READS} cold reads took {took:?}, more than 3 RTT + {MARGIN:?} = {bound:?}"
        );
        // What the target is about is the time above (connects are charged by the proxy). The
        // counts only check that the reads were joined into few requests and that no connection
        // was opened for nothing; how the 32 reads split into requests depends on when each
        // arrives (CI saw 2 to 7 requests, each on its own new connection when they overlap).
        ensure!(
            conns <= requests,
            "round {round}: {conns} new connections for {requests} requests: a connection carried nothing"
        );
        ensure!(
            requests <= READS / 2,
            "round {round}: {requests} requests for {READS} reads of adjacent chunks: they were not joined"
        );
        drop(c);
        d.stop()?;
    }

    // The peer: the same number of cold reads one after the other (queue depth 1) pays one
    // round trip each — this also proves the proxy charges what it should.
    let d = Daemon::start("demo", proxy.url("store"), &socket, &["--read-only"])?;
    let mut c = BlkClient::connect(d.socket(), 1, true)?;
    let before = proxy.stats();
    let t0 = Instant::now();
    for i in 0..READS {
        let offset = start + (3 * READS + i) * CHUNK;
        let got = c.read(offset, 4096)?.map_err(|errno| anyhow::anyhow!("serial read failed: {errno}"))?;
        ensure!(
            got[..] == raw[offset as usize..offset as usize + 4096],
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
