//! The daemon driven by libblkio's pure-Rust vhost-user client, in process, over a real socket.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};

use blkio::ReqFlags;
use common::{fixture, Client, Running, REGION_LEN};
use rand::{Rng, SeedableRng};

#[test]
fn capacity_socket_and_whole_device() {
    let f = fixture();
    let server = Running::start(&f, 1);
    let meta = std::fs::metadata(&server.socket).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);

    let mut c = Client::connect(&server.socket, 1);
    assert_eq!(c.capacity, f.raw.len() as u64);
    assert_eq!(c.capacity, 64 << 20);
    // Read the whole device in 1 MiB requests and compare with export_raw.
    let step = 1 << 20;
    let mut off = 0usize;
    while off < f.raw.len() {
        let n = step.min(f.raw.len() - off);
        assert_eq!(c.read(off as u64, 0, n), 0, "read at {off}");
        assert!(c.buf(0, n) == &f.raw[off..off + n], "bytes differ in [{off}, {})", off + n);
        off += n;
    }
    drop(c);
    server.finish();
    assert!(!f.dir.path().join("vhost-1.sock").exists(), "socket removed on stop");
}

#[test]
fn random_reads_qd32_two_queues() {
    let f = fixture();
    let server = Running::start(&f, 2);
    let mut c = Client::connect(&server.socket, 2);
    assert_eq!(c.queues.len(), 2);
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let blocks = f.raw.len() / 4096;
    let slot = 64 << 10; // each request gets its own 64 KiB of the region
    let per_queue = 32;
    assert!(2 * per_queue * slot <= REGION_LEN);
    for _round in 0..20 {
        let mut expect = Vec::new();
        for q in 0..2 {
            for i in 0..per_queue {
                let len = 4096 * rng.gen_range(1..=16);
                let block = rng.gen_range(0..blocks - 16);
                let user = q * per_queue + i;
                let ptr = c.ptr(user * slot);
                c.queues[q].read((block * 4096) as u64, ptr, len, user, ReqFlags::empty());
                expect.push((user, block * 4096, len));
            }
        }
        let mut done = c.complete(0, per_queue);
        done.extend(c.complete(1, per_queue));
        assert_eq!(done.len(), 2 * per_queue);
        for (user, ret) in done {
            assert_eq!(ret, 0, "request {user}");
        }
        for (user, off, len) in expect {
            assert!(c.buf(user * slot, len) == &f.raw[off..off + len], "request {user} at {off}+{len}");
        }
    }
    drop(c);
    server.finish();
}

/// A driver with several requests in flight hears of completions before the ring is drained
/// (`notify`: the early signal at the latest at the completion before the last), and every
/// request still completes with the right bytes.
#[test]
fn early_signals_reach_a_driver_with_requests_queued() {
    let f = fixture();
    let socket = f.dir.path().join("vhost-early.sock");
    let r = common::reader(&f.store, &f.id);
    let device = tessera_vhost::DeviceConfig::new(&f.id, r.device_bytes(), 1, true);
    let server = tessera_vhost::Server::bind(
        &socket,
        tessera_vhost::DEFAULT_SOCKET_MODE,
        device,
        tessera_vhost::Disk::Base(std::sync::Arc::new(r)),
    )
    .unwrap();
    let metrics = tessera_metrics::Metrics::unregistered();
    let server = Running::run(server.with_metrics(std::sync::Arc::clone(&metrics)));
    let mut c = Client::connect(&server.socket, 1);
    let slot = 128 << 10;
    let per_round = REGION_LEN / slot;
    for round in 0..20 {
        // The requests go to the ring together, when `complete` submits them.
        let mut expect = Vec::new();
        for i in 0..per_round {
            let off = ((round * per_round + i) * slot) % (f.raw.len() - slot);
            let ptr = c.ptr(i * slot);
            c.queues[0].read(off as u64, ptr, slot, i, ReqFlags::empty());
            expect.push((i, off));
        }
        let done = c.complete(0, per_round);
        assert!(done.iter().all(|&(_, ret)| ret == 0), "{done:?}");
        for (i, off) in expect {
            assert!(c.buf(i * slot, slot) == &f.raw[off..off + slot], "request {i} at {off}");
        }
    }
    let early = metrics.requests.early_signals.get();
    assert!(early > 0, "no early signal in 20 rounds of {per_round} requests");
    drop(c);
    server.finish();
}

#[test]
fn read_only_device_and_out_of_range() {
    let f = fixture();
    let server = Running::start(&f, 1);
    // A read-write client is refused: the device offers VIRTIO_BLK_F_RO.
    let e = Client::try_connect(&server.socket, 1, false).err().expect("rw connect must fail");
    assert!(e.message().contains("read-only"), "{}", e.message());
    // The server keeps serving the next client.
    let mut c = Client::connect(&server.socket, 1);
    // libblkio refuses writes to a read-only device itself (the backend's answer to a write is
    // tested with crafted chains in tests/hostile.rs).
    let ptr = c.ptr(0);
    c.queues[0].write(0, ptr, 4096, 1, ReqFlags::empty());
    let done = c.complete(0, 1);
    assert!(done[0].1 < 0);
    // Out of range: the backend answers VIRTIO_BLK_S_IOERR → EIO.
    let ret = c.read(c.capacity, 0, 4096);
    assert_eq!(ret, -libc::EIO, "read past the end");
    let ret = c.read(c.capacity - 4096, 0, 8192);
    assert_eq!(ret, -libc::EIO, "read straddling the end");
    // Still serving after errors.
    assert_eq!(c.read(0, 0, 4096), 0);
    assert!(c.buf(0, 4096) == &f.raw[..4096]);
    drop(c);
    server.finish();
}

#[test]
fn disconnect_and_reconnect() {
    let f = fixture();
    let server = Running::start(&f, 2);
    for round in 0..5u64 {
        let mut c = Client::connect(&server.socket, if round % 2 == 0 { 1 } else { 2 });
        let off = (round * 1_048_576 + 4096 * round) as usize;
        assert_eq!(c.read(off as u64, 0, 65536), 0);
        assert!(c.buf(0, 65536) == &f.raw[off..off + 65536], "round {round}");
        drop(c);
    }
    server.finish();
}

/// Rough figures, not a benchmark (that is `cargo xtask bench serve`, next): run with
/// `cargo test --release -p tessera-vhost --test blkio -- --ignored --nocapture`.
#[test]
#[ignore]
fn rough_throughput() {
    use std::time::Instant;
    let f = fixture();
    let server = Running::start(&f, 1);
    let mut c = Client::connect(&server.socket, 1);
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let g = common::reader(&f.store, &f.id).image().record().geometry;
    let (lo, hi) = (g.data_start_block, g.data_end_block);
    eprintln!("file data in device blocks {lo}..{hi} (the rest is metadata and free space)");
    for (what, range) in [("whole device", 0..(f.raw.len() / 4096) as u64), ("file data only", lo..hi)] {
        for qd in [1usize, 32] {
            let n = 100_000;
            let t = Instant::now();
            let mut done = 0;
            while done < n {
                for i in 0..qd {
                    let ptr = c.ptr(i * 4096);
                    c.queues[0].read(rng.gen_range(range.clone()) * 4096, ptr, 4096, i, ReqFlags::empty());
                }
                assert!(c.complete(0, qd).iter().all(|x| x.1 == 0));
                done += qd;
            }
            let s = t.elapsed().as_secs_f64();
            eprintln!("4 KiB random read QD{qd}, {what}: {:.0} IOPS", done as f64 / s);
        }
    }
    let t = Instant::now();
    let mut bytes = 0u64;
    for _ in 0..8 {
        let mut off = 0u64;
        while off < c.capacity {
            assert_eq!(c.read(off, 0, 1 << 20), 0);
            off += 1 << 20;
            bytes += 1 << 20;
        }
    }
    eprintln!("1 MiB sequential read QD1: {:.0} MB/s", bytes as f64 / t.elapsed().as_secs_f64() / 1e6);
    drop(c);
    server.finish();
}
