//! Request traces (issue 15, point 1): `tessera serve --record-requests` records what a libblkio
//! client asked (two queues, overlapping batches, memory misses completed out of order and hits
//! completed inline); the trace holds exactly those requests; replayed against a fresh `tessera
//! serve` and against qemu-storage-daemon exporting the raw export, the replay issues exactly the
//! recorded requests and every byte it reads equals the raw export's.

use std::fs;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use tessera_e2e::daemon::{BlkClient, Daemon};
use tessera_e2e::nginx::Nginx;
use tessera_e2e::prng::Prng;
use tessera_e2e::proxy::{Proxy, ProxyConfig};
use tessera_e2e::replay::{self, Issued, ReplayOptions, ReplayReport};
use tessera_e2e::tessera;
use tessera_e2e::testutil::tmp;
use tessera_image::{RequestOp, RequestStatus};

/// qemu-storage-daemon exporting `raw` read-only as vhost-user-blk at `sock`; killed on drop.
struct Qsd(Child);

impl Qsd {
    fn start(raw: &Path, sock: &Path, queues: u16) -> Result<Self> {
        let _ = fs::remove_file(sock);
        let child = Command::new("qemu-storage-daemon")
            .arg("--blockdev")
            .arg(format!("driver=file,node-name=f,filename={},read-only=on", raw.display()))
            .arg("--export")
            .arg(format!(
                "type=vhost-user-blk,id=e,node-name=f,addr.type=unix,addr.path={},writable=off,num-queues={queues}",
                sock.display()
            ))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting qemu-storage-daemon")?;
        let mut q = Qsd(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !sock.exists() {
            if let Some(status) = q.0.try_wait()? {
                bail!("qemu-storage-daemon exited with {status} before its socket appeared");
            }
            ensure!(Instant::now() < deadline, "qemu-storage-daemon did not create its socket");
            std::thread::sleep(Duration::from_millis(10)); // polling interval
        }
        Ok(q)
    }
}

impl Drop for Qsd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn sorted(mut v: Vec<Issued>) -> Vec<Issued> {
    v.sort();
    v
}

fn check_replay(name: &str, report: &ReplayReport, expected: &[Issued], read_bytes: u64) -> Result<()> {
    eprintln!("replay against {name}: {}", report.summary());
    ensure!(
        sorted(report.issued.clone()) == expected,
        "{name}: the replay did not issue exactly the recorded requests"
    );
    ensure!(report.failed == 0 && report.status_mismatches == 0, "{name}: {} failed", report.failed);
    ensure!(report.skipped == 0, "{name}: {} skipped", report.skipped);
    ensure!(
        report.read_bytes == read_bytes,
        "{name}: read {} bytes, recorded {read_bytes}",
        report.read_bytes
    );
    ensure!(
        report.checked_bytes == read_bytes,
        "{name}: {} of {read_bytes} bytes checked against the raw export",
        report.checked_bytes
    );
    ensure!(report.max_in_flight > 1, "{name}: the replay never overlapped requests");
    Ok(())
}

#[test]
fn recorded_requests_replay_exactly_against_tessera_and_qemu_storage_daemon() -> Result<()> {
    let t = tmp("replay")?;
    let (src, store) = (t.path().join("src"), t.path().join("store"));
    fs::create_dir_all(src.join("dir"))?;
    let mut prng = Prng::from_label("replay");
    let big = prng.bytes(3 << 20);
    fs::write(src.join("big.bin"), &big)?;
    fs::write(src.join("text.txt"), prng.text(700 << 10))?;
    for i in 0..20 {
        fs::write(src.join("dir").join(format!("f{i}")), prng.text(1000 + 3000 * i))?;
    }
    // Little free space, so that random reads mostly land on data.
    tessera::build(&src, &store, &["--tag", "demo", "--chunk-size", "64K", "--free", "4M"])?;
    let raw = t.path().join("demo.raw");
    tessera::export("demo", &store, &raw)?;
    let capacity = fs::metadata(&raw)?.len();
    // Where big.bin's data sits on the device (contiguous): the random reads go there.
    let device = fs::read(&raw)?;
    let start = (0..device.len() - 4096)
        .step_by(4096)
        .find(|&o| device[o..o + 4096] == big[..4096])
        .context("big.bin's first block is not on the device")? as u64;
    drop(device);

    // Record from an HTTP origin a few ms away (so cold reads complete out of order and
    // overlap), in batches on two queues; some ranges read twice (the second time from memory,
    // completed inline).
    let nginx = Nginx::serve(&store, "store")?;
    let proxy = Proxy::start(nginx.addr(), ProxyConfig::rtt(Duration::from_millis(5)))?;
    let trace_path = t.path().join("run.requests");
    let socket = t.path().join("vm.sock");
    let d = Daemon::start(
        "demo",
        proxy.url("store"),
        &socket,
        &["--read-only", "--queues", "2", "--record-requests", trace_path.to_str().context("path")?],
    )?;
    let mut c = BlkClient::connect(d.socket(), 2, true)?;
    ensure!(c.capacity() == capacity, "device of {} bytes, raw export of {capacity}", c.capacity());
    let mut expected = Vec::new();
    let mut read_bytes = 0u64;
    let blocks = (big.len() / 4096) as u64;
    for round in 0..12u64 {
        let q = (round % 2) as usize;
        let depth = 1 + round % 5;
        let reads: Vec<(u64, usize)> = (0..depth)
            .map(|k| {
                let len = 4096 * (1 + prng.below(32)) as usize;
                // Cold reads of big.bin, then (rounds 8..) of the metadata at the start.
                let at =
                    if round >= 8 { (round - 8) * 3 + k } else { start / 4096 + prng.below(blocks - 32) };
                (at * 4096, len)
            })
            .collect();
        for r in c.read_batch(q, &reads)? {
            r.map_err(|e| anyhow::anyhow!("recorded read failed: {e}"))?;
        }
        for &(offset, len) in &reads {
            expected.push(Issued {
                queue: q as u16,
                sector: offset / 512,
                len: len as u64,
                op: RequestOp::Read.code(),
            });
            read_bytes += len as u64;
        }
    }
    // The first two batches again: memory hits now.
    let again: Vec<Issued> = expected[..3].to_vec();
    let reads: Vec<(u64, usize)> = again.iter().map(|r| (r.sector * 512, r.len as usize)).collect();
    for r in c.read_batch(0, &reads)? {
        r.map_err(|e| anyhow::anyhow!("recorded read failed: {e}"))?;
    }
    for r in &again {
        expected.push(Issued { queue: 0, ..*r });
        read_bytes += r.len;
    }
    drop(c);
    d.stop()?;

    let trace = replay::load(&trace_path)?;
    ensure!(
        trace.header.queues == 2 && trace.header.read_only && trace.header.device_bytes == capacity,
        "header {:?}",
        trace.header
    );
    let recorded = sorted(trace.records.iter().map(Issued::of).collect());
    let expected = sorted(expected);
    ensure!(
        recorded == expected,
        "the trace holds {} requests, the client made {}: {recorded:?} vs {expected:?}",
        recorded.len(),
        expected.len()
    );
    ensure!(
        trace.records.iter().all(|r| r.status == RequestStatus::Ok && r.issued_ns <= r.completed_ns),
        "a recorded request failed"
    );

    ensure!(
        trace.records.iter().any(|a| trace
            .records
            .iter()
            .any(|b| a.issued_ns < b.issued_ns && b.issued_ns <= a.completed_ns)),
        "no two recorded requests overlap"
    );
    let opts = ReplayOptions { raw: Some(raw.clone()), writes: false };
    // A fresh tessera serve on the local store: nothing in memory.
    let d = Daemon::start("demo", &store, &socket, &["--read-only", "--queues", "2"])?;
    let report = replay::replay(&trace, d.socket(), &opts)?;
    d.stop()?;
    check_replay("tessera serve", &report, &expected, read_bytes)?;

    // qemu-storage-daemon on the raw export.
    let qsock = t.path().join("qsd.sock");
    let qsd = Qsd::start(&raw, &qsock, 2)?;
    let report = replay::replay(&trace, &qsock, &opts)?;
    drop(qsd);
    check_replay("qemu-storage-daemon", &report, &expected, read_bytes)?;

    // A write-holding trace is refused without --writes.
    let mut writes = trace.clone();
    writes.records[0].op = RequestOp::Write;
    let e = replay::replay(&writes, &qsock, &opts).unwrap_err();
    ensure!(e.to_string().contains("--writes"), "{e:#}");
    Ok(())
}
