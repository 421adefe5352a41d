//! Writes through the copy-on-write overlay, driven by libblkio in process over a real socket:
//! write / flush / read back, sub-block writes, DISCARD and WRITE_ZEROES, restart with the same
//! overlay, refusal of an overlay made for another image.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::{fixture, overlay_params, reader, Client, Running};
use rand::{Rng, SeedableRng};
use tessera_overlay::{Mode as OverlayMode, Overlay, OverlayError, OverlayParams};

/// Read the whole device through the client and compare with `model`.
fn check_device(c: &mut Client, model: &[u8]) {
    let step = 1 << 20;
    let mut off = 0;
    while off < model.len() {
        assert_eq!(c.read(off as u64, 0, step), 0, "read at {off}");
        assert!(c.buf(0, step) == &model[off..off + step], "device differs in [{off}, {})", off + step);
        off += step;
    }
}

#[test]
fn writes_flush_discard_zeroes_and_restart() {
    let f = fixture();
    let overlay = f.dir.path().join("vm.overlay");
    let mut model = f.raw.clone();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    {
        let server = Running::start_rw(&f, 1, &overlay);
        let mut c = Client::try_connect(&server.socket, 1, false).unwrap();
        // Whole blocks, 1 MiB, sub-block (512 bytes inside a block), a 512-byte write straddling
        // two blocks, the last sector of the device.
        let cap = c.capacity;
        for (off, len) in
            [(0u64, 4096usize), (5 << 20, 1 << 20), (8192 + 1024, 512), (12288 - 512, 1024), (cap - 512, 512)]
        {
            let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            c.buf_mut(0, len).copy_from_slice(&data);
            assert_eq!(c.write(off, 0, len), 0, "write at {off}+{len}");
            model[off as usize..off as usize + len].copy_from_slice(&data);
            assert_eq!(c.read(off & !4095, 2 << 20, 8192.min(cap as usize - (off & !4095) as usize)), 0);
        }
        assert_eq!(c.flush(), 0);
        // DISCARD and WRITE_ZEROES read back as zeros (file data of the base included).
        assert_eq!(c.discard(5 << 20, 64 << 10), 0);
        model[(5 << 20)..(5 << 20) + (64 << 10)].fill(0);
        assert_eq!(c.write_zeroes(1 << 20, 3 << 20), 0);
        model[(1 << 20)..(4 << 20)].fill(0);
        assert_eq!(c.write_zeroes(4096 + 512, 1024), 0);
        model[4096 + 512..4096 + 1536].fill(0);
        check_device(&mut c, &model);
        assert_eq!(c.flush(), 0);
        // Out of range writes are refused.
        assert_eq!(c.write(cap, 0, 4096), -libc::EIO);
        drop(c);
        server.finish();
    }
    // A new server on the same overlay (the stop flushed; the overlay replays its log).
    {
        let server = Running::start_rw(&f, 2, &overlay);
        let mut c = Client::try_connect(&server.socket, 2, false).unwrap();
        check_device(&mut c, &model);
        // Random writes on both queues at QD 16, then flush, then a read-back.
        let slot = 64 << 10;
        let mut writes = Vec::new();
        for q in 0..2 {
            for i in 0..16 {
                let user = q * 16 + i;
                let len = 512 * rng.gen_range(1..=64);
                // A distinct MiB per request, so that concurrent writes never overlap.
                let off = (user as u64) * (1 << 20) + 512 * rng.gen_range(0..1024);
                let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
                c.buf_mut(user * slot, len).copy_from_slice(&data);
                let ptr = c.ptr(user * slot);
                c.queues[q].write(off, ptr, len, user, blkio::ReqFlags::empty());
                writes.push((q, off, data));
            }
        }
        for q in 0..2 {
            let n = writes.iter().filter(|w| w.0 == q).count();
            assert!(c.complete(q, n).iter().all(|x| x.1 == 0));
        }
        for (_, off, data) in &writes {
            model[*off as usize..*off as usize + data.len()].copy_from_slice(data);
        }
        assert_eq!(c.flush(), 0);
        check_device(&mut c, &model);
        drop(c);
        server.finish();
    }
    // Read-only view of base plus overlay, and the overlay's own export hook.
    let base = Arc::new(reader(&f.store, &f.id));
    let o = Overlay::open_file(&overlay, overlay_params(&f), base, OverlayMode::ReadOnly).unwrap();
    let export = f.dir.path().join("export.img");
    let r = reader(&f.store, &f.id);
    tessera_engine::export_raw(r.image(), &r, tessera_engine::ExportOptions::default(), &export, |_| {})
        .unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(&export).unwrap();
    o.apply_to(&file).unwrap();
    drop(file);
    assert!(std::fs::read(&export).unwrap() == model, "export with the overlay equals what the client wrote");
}

#[test]
fn an_overlay_of_another_image_is_refused() {
    let f = fixture();
    let overlay = f.dir.path().join("other.overlay");
    let base = Arc::new(reader(&f.store, &f.id));
    let other = OverlayParams {
        image_id: tessera_image::ImageId(tessera_image::Sha256Digest::of(b"another image")),
        ..overlay_params(&f)
    };
    drop(Overlay::open_or_create_file(&overlay, other, base.clone()).unwrap());
    let e = Overlay::open_or_create_file(&overlay, overlay_params(&f), base.clone()).unwrap_err();
    let msg = tessera_engine::Chain(&e).to_string();
    assert!(msg.contains("was made for image"), "{msg}");
    assert!(
        matches!(e, OverlayError::At { ref source, .. } if matches!(**source, OverlayError::ImageMismatch { .. }))
    );
    // In use by another opener (advisory lock).
    let held =
        Overlay::open_or_create_file(&f.dir.path().join("held.overlay"), overlay_params(&f), base.clone())
            .unwrap();
    let e = Overlay::open_or_create_file(&f.dir.path().join("held.overlay"), overlay_params(&f), base)
        .unwrap_err();
    let msg = tessera_engine::Chain(&e).to_string();
    assert!(msg.contains("in use"), "{msg}");
    drop(held);
}

/// Rough figures, not the benchmark (`cargo xtask bench serve`): 4 KiB write + FLUSH round trips
/// through libblkio against a bare 2300-byte write + fdatasync on a file in the same directory.
/// Run with `cargo test --release -p tessera-vhost --test overlay -- --ignored --nocapture`.
#[test]
#[ignore]
fn rough_flush_latency() {
    use std::io::Write;
    use std::time::Instant;
    let f = fixture();
    let overlay = f.dir.path().join("lat.overlay");
    let server = Running::start_rw(&f, 1, &overlay);
    let mut c = Client::try_connect(&server.socket, 1, false).unwrap();
    let n = 2000;
    let pct = |mut v: Vec<f64>, p: f64| {
        v.sort_by(f64::total_cmp);
        v[((v.len() as f64 * p) as usize).min(v.len() - 1)]
    };
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        assert_eq!(c.write((i as u64 % 4096) * 4096, 0, 4096), 0);
        assert_eq!(c.flush(), 0);
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let mut file = std::fs::File::create(f.dir.path().join("fdatasync.bin")).unwrap();
    let mut bare = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        file.write_all(&[7u8; 2300]).unwrap();
        file.sync_data().unwrap();
        bare.push(t.elapsed().as_secs_f64() * 1e6);
    }
    eprintln!(
        "4 KiB write + flush: p50 {:.0} µs p99 {:.0} µs; bare 2300 B write + fdatasync: p50 {:.0} µs p99 {:.0} µs",
        pct(lat.clone(), 0.5),
        pct(lat, 0.99),
        pct(bare.clone(), 0.5),
        pct(bare, 0.99)
    );
    drop(c);
    server.finish();
}
