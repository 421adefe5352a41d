//! The findings of docs/fuzzing.md as regression tests. Each asserts the *correct* behaviour
//! (each failed or panicked before its fix); they run in the gate with the rest of the fuzz
//! crate's tests (`cargo xtask test`).
#![allow(clippy::unwrap_used)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tessera_fuzz::overlay_replay::{image_id, MemIo};
use tessera_fuzz::vhost_request::SectorPattern;
use tessera_image::BlockMap;
use tessera_overlay::format::{Header, Op, Record};
use tessera_overlay::{Mode as OverlayMode, Overlay, OverlayParams};

/// Records the largest single allocation (F5).
struct Peak;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged.
unsafe impl GlobalAlloc for Peak {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Peak = Peak;

const BS: u64 = 4096;

fn params(block_size: u32, device_bytes: u64) -> OverlayParams {
    OverlayParams { image_id: image_id(), block_size, device_bytes }
}

fn header(device_bytes: u64, salt: u64, log_head: u64) -> [u8; 128] {
    Header {
        version: tessera_overlay::format::VERSION,
        block_size: BS as u32,
        image_id: image_id(),
        device_bytes,
        generation: 1,
        salt,
        log_head,
        first_seq: 0,
    }
    .encode()
}

/// A 4 KiB-block overlay file: header copy A, then `records` from slot 1 on, then `slots`.
fn craft(
    device_bytes: u64,
    log_head: u64,
    records: &[(u64, Op)],
    slots: &[(u64, Vec<u8>)],
    len_slots: u64,
) -> Vec<u8> {
    let salt = 0x5eed;
    let mut f = vec![0u8; (len_slots * BS) as usize];
    f[..128].copy_from_slice(&header(device_bytes, salt, log_head));
    for (i, &(group, op)) in records.iter().enumerate() {
        let at = (BS as usize) + i * 64;
        f[at..at + 64].copy_from_slice(&Record { seq: i as u64, group, op }.encode(salt));
    }
    for (slot, bytes) in slots {
        let at = (slot * BS) as usize;
        f[at..at + bytes.len()].copy_from_slice(bytes);
    }
    f
}

/// F1: a record whose device size in bytes overflows u64 decodes, and planning on it overflows
/// (`BlockMap::device_bytes`, `Plan::next`: `blocks * 4096` unchecked).
#[test]
fn f1_record_device_size_overflows() {
    // Fixed: such a map can no longer be built, nor decoded.
    let b = BlockMap::builder((1 << 52) + 256);
    assert!(b.finish().is_err(), "a device of 2^52 + 256 blocks (> 2^64 bytes) builds");
    // The minimized fuzz input (structured mode): device_blocks 0x4345525353455400, one prefix
    // run at block 0x1000_0008_0000_fe.
    tessera_fuzz::image_record::run(&[
        0xf8, 0x00, 0x54, 0x45, 0x53, 0x53, 0x52, 0x45, 0x43, 0x00, 0x01, 0x00, 0xfe, 0x00, 0x00, 0x08, 0x00,
        0x00, 0x10, 0x00, 0x10,
    ]);
}

/// F2: below 4 KiB blocks, header copy B (byte 2048) is not in slot 0: the checkpoint at open
/// overwrites whatever data or log slot holds byte 2048.
#[test]
fn f2_small_block_sizes_overwrite_a_slot() {
    // Fixed: block sizes under 4 KiB are refused.
    let r = Overlay::create(
        Box::new(MemIo::default()),
        params(512, 64 << 10),
        Arc::new(SectorPattern),
        OverlayMode::Durable,
    );
    assert!(r.is_err(), "a 512-byte-block overlay was created");
}

/// F3: a last-group MAP past the end of the file (its data write torn away) whose data CRC is
/// that of zeros is *applied*, the checkpoint logs it as durable, and the next open refuses the
/// overlay ("a map record points outside the device or file").
#[test]
fn f3_torn_zero_write_makes_the_overlay_unopenable() {
    let dev = 1 << 20;
    let zeros = crc32c::crc32c(&vec![0u8; BS as usize]);
    let file = craft(
        dev,
        1,
        &[
            // A checkpoint record (slot 2 is a free gap), then group 1: block 5 into slot 4,
            // past the end of the 4-slot file.
            (0, Op::Map { block: 0, count: 1, slot: 3, data_crc: None }),
            (1, Op::Map { block: 5, count: 1, slot: 4, data_crc: Some(zeros) }),
        ],
        &[(3, vec![0xab; BS as usize])],
        4,
    );
    let io = MemIo::new(file);
    drop(
        Overlay::open(
            Box::new(io.clone()),
            params(BS as u32, dev),
            Arc::new(SectorPattern),
            OverlayMode::Durable,
        )
        .unwrap(),
    );
    Overlay::open(Box::new(io), params(BS as u32, dev), Arc::new(SectorPattern), OverlayMode::Durable)
        .expect("the overlay opened (and checkpointed) a moment ago no longer opens");
}

/// F4: a log head (or LINK / last-group MAP slot) whose byte offset overflows u64:
/// `segment * bs` in `replay` panics in a debug build and wraps in a release build (here to
/// slot 1, which is then read as the log).
#[test]
fn f4_log_head_offset_overflows() {
    let dev = 1 << 20;
    let head = (1u64 << 52) + 1; // * 4096 wraps to 4096
    let file = craft(dev, head, &[(0, Op::Zero { block: 0, count: 1 })], &[], 2);
    let r = std::panic::catch_unwind(|| {
        Overlay::open(
            Box::new(MemIo::new(file)),
            params(BS as u32, dev),
            Arc::new(SectorPattern),
            OverlayMode::ReadOnly,
        )
        .map(|_| ())
    });
    match r {
        Err(_) => panic!("Overlay::open panicked on a log head of {head}"),
        // A log head past the end of the file is an empty log (a segment that was never
        // written), which is fine as long as slot 1 is not read as the log (the wrap).
        Ok(Ok(())) => {}
        Ok(Err(_)) => {}
    }
    let o = Overlay::open(
        Box::new(MemIo::new(craft(dev, head, &[(0, Op::Zero { block: 0, count: 1 })], &[], 2))),
        params(BS as u32, dev),
        Arc::new(SectorPattern),
        OverlayMode::ReadOnly,
    );
    if let Ok(o) = o {
        let mut block0 = vec![0u8; BS as usize];
        o.read_at(0, &mut block0).unwrap();
        assert!(block0.iter().any(|&b| b != 0), "slot 1's ZERO record was applied: the log head wrapped");
    }
}

/// F5: checking the data CRC of a last-group MAP record reads all its `count` blocks into one
/// buffer: a hostile overlay makes `open` allocate up to the device size at once.
#[test]
fn f5_data_check_allocates_the_record_size() {
    let dev = 256 << 20;
    let count = 32768u32; // 128 MiB
    let file = craft(dev, 1, &[(1, Op::Map { block: 0, count, slot: 2, data_crc: Some(1) })], &[], 2);
    LARGEST.store(0, Ordering::Relaxed);
    let _ = Overlay::open(
        Box::new(MemIo::new(file)),
        params(BS as u32, dev),
        Arc::new(SectorPattern),
        OverlayMode::ReadOnly,
    );
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(largest < 16 << 20, "opening allocated {largest} bytes at once");
}

/// F6: `BlockMapBuilder::finish` added a prefix run's block and length unchecked before
/// validating: a prefix run ending past `u64::MAX` panicked with overflow checks.
#[test]
fn f6_prefix_run_end_overflows() {
    let mut b = BlockMap::builder(16);
    if b.push_prefix(0, 2, u64::MAX).is_ok() {
        assert!(b.finish().is_err(), "a prefix run ending past u64::MAX builds");
    }
}

/// F7: refusing a device size that is not a multiple of the block size and within one block
/// of 2^64 overflowed (`next_multiple_of`) instead of returning the error.
#[test]
fn f7_refusing_a_device_size_near_2_64_overflows() {
    for device_bytes in [u64::MAX, u64::MAX - 1, u64::MAX - BS + 2] {
        let r = Overlay::create(
            Box::new(MemIo::default()),
            params(BS as u32, device_bytes),
            Arc::new(SectorPattern),
            OverlayMode::Durable,
        );
        assert!(r.is_err(), "a device of {device_bytes} bytes (not a multiple of 4096) was accepted");
    }
}

/// F8 (campaign 2026-12-03, `overlay_replay`): `replay` followed a LINK record to any slot but
/// the header's and stopped at a segment past the end of the file without dropping it, so a LINK
/// to slot `u64::MAX` reached `Overlay::open`'s free-space scan, where `prev_end = s + l`
/// overflowed (a panic with overflow checks; in release the scan wrapped and the log tail sat at
/// slot `u64::MAX`, whose byte offset wrapped too). Fixed: a link past every slot the device can
/// use is corrupt, and the scan's ends are checked.
#[test]
fn f8_log_link_to_slot_u64_max_overflows_at_open() {
    let dev = 1 << 20;
    for group in [0, 1] {
        let file = craft(dev, 1, &[(group, Op::Link { slot: u64::MAX })], &[], 3);
        opens_as_corrupt(&file, dev, &format!("a link to slot u64::MAX in group {group}"));
    }
}

/// `file`, an overlay of a `dev`-byte device, is refused as corrupt when opened read-only and
/// when opened for writes.
fn opens_as_corrupt(file: &[u8], dev: u64, what: &str) {
    for mode in [OverlayMode::ReadOnly, OverlayMode::Durable] {
        let r = Overlay::open(
            Box::new(MemIo::new(file.to_vec())),
            params(BS as u32, dev),
            Arc::new(SectorPattern),
            mode,
        );
        assert!(
            matches!(r, Err(tessera_overlay::OverlayError::Corrupt { .. })),
            "{what}, {mode:?}: {:?}",
            r.map(|_| ())
        );
    }
}

/// F9 (campaign 2026-12-03, `ext4_roundtrip`; in the judge, not in Tessera): a symlink whose
/// target has a component over 255 bytes — valid on ext4 and Linux, and synthesized correctly —
/// is refused by `ext4-view`'s `read_link` ("invalid symlink path": it makes a `PathBuf` of the
/// target). The target now checks such a symlink's length only. Input: the seed
/// `symlink-long-component`, one symlink `l` → 279 bytes without a slash (which
/// `tests/ext4_e2fsck.rs` also runs through e2fsck).
#[test]
fn f9_symlink_target_with_a_long_component() {
    let seeds = tessera_fuzz::ext4_roundtrip::seeds();
    let (_, input) = seeds.iter().find(|s| s.0 == "symlink-long-component").unwrap();
    tessera_fuzz::ext4_roundtrip::run(input);
}

/// F10 (campaign 2026-12-03, `overlay_replay` in fork mode): a record of group `u64::MAX` made
/// `replay`'s in-doubt test `r.group + 1 >= last_group` overflow (a panic with overflow checks;
/// in release it wrapped to 0, so the last group was not in doubt and its data CRC not checked),
/// and `Overlay::open`'s new log tail `last_group + 1` overflowed the same way. Fixed: a group
/// no FLUSH count can reach (≥ 2^63) is corrupt.
#[test]
fn f10_record_group_u64_max_overflows_at_open() {
    let dev = 1 << 20;
    let file = craft(dev, 1, &[(u64::MAX, Op::Zero { block: 0, count: 1 })], &[], 3);
    opens_as_corrupt(&file, dev, "a record of group u64::MAX");
}
