//! Overlay unit tests, and the durability test through an I/O layer that forgets everything not
//! synced (the brief's allowed test double: a `kill -9` cannot show a missing fdatasync).
#![allow(clippy::unwrap_used)]

use std::io;
use std::sync::{Arc, Mutex};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tessera_image::{ImageId, Sha256Digest};

use super::format::{Header, HEADER_LEN};
use super::io::OverlayIo;
use super::*;

const BS: u64 = tessera_image::BLOCK_SIZE as u64;
const BLOCKS: u64 = 96;
const DEV: u64 = BS * BLOCKS;

/// Base device byte `o` is `(o / 7) % 251 + 1` (never all zeros).
struct Pattern;

impl BlockDevice for Pattern {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (((offset + i as u64) / 7) % 251 + 1) as u8;
        }
        Ok(())
    }
}

fn params() -> OverlayParams {
    OverlayParams {
        image_id: ImageId(Sha256Digest::of(b"overlay-test")),
        block_size: BS as u32,
        device_bytes: DEV,
    }
}

fn base_bytes() -> Vec<u8> {
    let mut v = vec![0u8; DEV as usize];
    Pattern.read_at(0, &mut v).unwrap();
    v
}

/// A disk that keeps a durable image and a list of writes not yet synced. `crash` applies an
/// arbitrary subset of the unsynced writes, some torn at 512-byte granularity, in random order.
#[derive(Default)]
struct SimDisk {
    state: Mutex<Sim>,
}

#[derive(Default, Clone)]
struct Sim {
    durable: Vec<u8>,
    volatile: Vec<(u64, Vec<u8>)>,
    /// Writes and syncs allowed before the power goes (None: unlimited).
    budget: Option<usize>,
    syncs: usize,
    /// Writes that went past the end of the file (grew it).
    grew: usize,
    /// How long a sync takes.
    sync_delay: std::time::Duration,
}

impl Sim {
    fn apply(img: &mut Vec<u8>, offset: u64, bytes: &[u8]) {
        let end = offset as usize + bytes.len();
        if img.len() < end {
            img.resize(end, 0);
        }
        img[offset as usize..end].copy_from_slice(bytes);
    }

    /// Size of the file (what the page cache shows).
    fn len(&self) -> u64 {
        let vol_end = self.volatile.iter().map(|(o, b)| o + b.len() as u64).max().unwrap_or(0);
        (self.durable.len() as u64).max(vol_end)
    }

    fn spend(&mut self) -> io::Result<()> {
        match &mut self.budget {
            Some(0) => Err(io::Error::other("power lost")),
            Some(n) => {
                *n -= 1;
                Ok(())
            }
            None => Ok(()),
        }
    }
}

#[derive(Clone)]
struct SimIo(Arc<SimDisk>);

impl OverlayIo for SimIo {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let s = self.0.state.lock().unwrap();
        let mut img = s.durable.clone();
        for (o, b) in &s.volatile {
            Sim::apply(&mut img, *o, b);
        }
        buf.fill(0);
        let start = (offset as usize).min(img.len());
        let end = (offset as usize + buf.len()).min(img.len());
        buf[..end - start].copy_from_slice(&img[start..end]);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let mut s = self.0.state.lock().unwrap();
        s.spend()?;
        if offset + buf.len() as u64 > s.len() {
            s.grew += 1;
        }
        s.volatile.push((offset, buf.to_vec()));
        Ok(())
    }

    /// Makes durable the writes issued before the call, and only those: a write issued while
    /// the sync runs stays volatile (an `fdatasync` promises nothing about it).
    fn sync_data(&self) -> io::Result<()> {
        let (delay, issued) = {
            let s = self.0.state.lock().unwrap();
            (s.sync_delay, s.volatile.len())
        };
        std::thread::sleep(delay);
        let mut s = self.0.state.lock().unwrap();
        s.spend()?;
        let later = s.volatile.split_off(issued);
        let vol = std::mem::replace(&mut s.volatile, later);
        for (o, b) in vol {
            Sim::apply(&mut s.durable, o, &b);
        }
        s.syncs += 1;
        Ok(())
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.0.state.lock().unwrap().len())
    }
}

impl SimDisk {
    fn io(self: &Arc<Self>) -> Box<dyn OverlayIo> {
        Box::new(SimIo(Arc::clone(self)))
    }

    /// Power loss: a disk holding the durable image plus a random, possibly torn and
    /// reordered, subset of the unsynced writes.
    fn power_loss(&self, rng: &mut StdRng) -> Arc<SimDisk> {
        let s = self.state.lock().unwrap();
        let mut img = s.durable.clone();
        let mut vol = s.volatile.clone();
        // Random order.
        for i in (1..vol.len()).rev() {
            vol.swap(i, rng.gen_range(0..=i));
        }
        for (o, b) in vol {
            match rng.gen_range(0..3) {
                0 => {}
                1 => Sim::apply(&mut img, o, &b),
                _ => {
                    for (i, sector) in b.chunks(512).enumerate() {
                        if rng.gen_bool(0.5) {
                            Sim::apply(&mut img, o + (i * 512) as u64, sector);
                        }
                    }
                }
            }
        }
        Arc::new(SimDisk { state: Mutex::new(Sim { durable: img, ..Sim::default() }) })
    }

    /// Power loss that keeps every unsynced write but those `drop` selects (offset, length).
    fn power_loss_dropping(&self, drop: impl Fn(u64, u64) -> bool) -> Arc<SimDisk> {
        let s = self.state.lock().unwrap();
        let mut img = s.durable.clone();
        for (o, b) in s.volatile.iter().filter(|(o, b)| !drop(*o, b.len() as u64)) {
            Sim::apply(&mut img, *o, b);
        }
        Arc::new(SimDisk { state: Mutex::new(Sim { durable: img, ..Sim::default() }) })
    }

    /// Process kill: the page cache survives, so every completed write is there.
    fn kill(&self) -> Arc<SimDisk> {
        let s = self.state.lock().unwrap();
        let mut img = s.durable.clone();
        for (o, b) in &s.volatile {
            Sim::apply(&mut img, *o, b);
        }
        Arc::new(SimDisk { state: Mutex::new(Sim { durable: img, ..Sim::default() }) })
    }

    fn syncs(&self) -> usize {
        self.state.lock().unwrap().syncs
    }
}

fn create(disk: &Arc<SimDisk>) -> Overlay {
    Overlay::create(disk.io(), params(), Arc::new(Pattern), Mode::Durable).unwrap()
}

fn open(disk: &Arc<SimDisk>) -> Result<Overlay, OverlayError> {
    Overlay::open(disk.io(), params(), Arc::new(Pattern), Mode::Durable)
}

fn read_all(o: &Overlay) -> Vec<u8> {
    let mut v = vec![0u8; DEV as usize];
    o.read_at(0, &mut v).unwrap();
    v
}

#[test]
fn reads_base_then_writes_of_any_size() {
    let disk = Arc::new(SimDisk::default());
    let o = create(&disk);
    let mut model = base_bytes();
    assert_eq!(read_all(&o), model);
    // Whole blocks, a sub-block write inside one block, one straddling two blocks, unaligned
    // multi-block, a single byte at the very end.
    for (off, len, v) in [
        (8192u64, 8192usize, 1u8),
        (4096 * 5 + 100, 300, 2),
        (4096 * 7 - 10, 20, 3),
        (4096 * 10 + 1, 4096 * 3, 4),
        (DEV - 1, 1, 5),
    ] {
        let data = vec![v; len];
        o.write_at(off, &data).unwrap();
        model[off as usize..off as usize + len].copy_from_slice(&data);
        assert_eq!(read_all(&o), model, "after write at {off}+{len}");
    }
    // Overwrite part of an already written block.
    o.write_at(8192 + 10, &[9u8; 10]).unwrap();
    model[8202..8212].fill(9);
    assert_eq!(read_all(&o), model);
    let mut piece = vec![0u8; 5000];
    o.read_at(8000, &mut piece).unwrap();
    assert_eq!(piece, model[8000..13000]);
    assert!(matches!(o.write_at(DEV, &[1]), Err(OverlayError::OutOfRange { .. })));
    assert!(matches!(o.write_at(u64::MAX, &[1]), Err(OverlayError::OutOfRange { .. })));
    assert!(matches!(o.read_at(DEV - 1, &mut [0u8; 2]), Err(OverlayError::OutOfRange { .. })));
}

#[test]
fn write_zeroes_and_discard_read_as_zeros() {
    let disk = Arc::new(SimDisk::default());
    let o = create(&disk);
    let mut model = base_bytes();
    o.write_at(0, &vec![7u8; 8 * 4096]).unwrap();
    model[..8 * 4096].fill(7);
    for (off, len) in [(4096u64, 4096u64), (3 * 4096 + 17, 2 * 4096), (100, 50), (20 * 4096 + 5, 40 * 4096)] {
        o.write_zeroes(off, len).unwrap();
        model[off as usize..(off + len) as usize].fill(0);
        assert_eq!(read_all(&o), model, "zeroes at {off}+{len}");
    }
    let st = o.stats();
    assert!(st.zero_blocks >= 40, "{st:?}");
    // Released slots are reused only once the flush closing the group that logged their
    // release and the two after it have synced (the first write of 8 blocks is one record,
    // which must still check after some of its blocks were zeroed or rewritten).
    let held = st.held_slots;
    assert!(held >= 4, "{st:?}");
    for (i, block) in [90u64, 91, 92].into_iter().enumerate() {
        o.flush().unwrap();
        assert_eq!(o.stats().held_slots, if i < 2 { held } else { 0 }, "after flush {}", i + 1);
        // Something new to flush (a fresh block releases nothing).
        o.write_at(block * BS, &[3u8; 4096]).unwrap();
        model[(block * BS) as usize..((block + 1) * BS) as usize].fill(3);
    }
    let before = o.stats();
    o.write_at(0, &[1u8; 4096]).unwrap();
    model[..4096].fill(1);
    assert_eq!(o.stats().file_slots, before.file_slots, "a released slot is reused: {before:?}");
    // The 8-block record of the first write still counts for its other blocks, after a kill
    // (nothing synced since) and after a power loss (once flushed).
    assert!(read_all(&open(&disk.kill()).unwrap()) == model, "after a kill");
    o.flush().unwrap();
    let lost = disk.power_loss(&mut StdRng::seed_from_u64(3));
    assert!(read_all(&open(&lost).unwrap()) == model, "after a power loss");
}

#[test]
fn flush_syncs_once_and_only_with_writes() {
    let disk = Arc::new(SimDisk::default());
    let o = create(&disk);
    let s0 = disk.syncs();
    o.flush().unwrap();
    assert_eq!(disk.syncs(), s0, "nothing written: no sync");
    for i in 0..200 {
        o.write_at(i % BLOCKS * BS, &[i as u8; 4096]).unwrap();
    }
    o.flush().unwrap();
    assert_eq!(disk.syncs(), s0 + 1, "one sync per flush, however many writes and log segments");
    assert_eq!(o.stats().pending_records, 0);
}

/// A base whose worker "pool" is a thread per job (the group commit runs off the caller).
struct Threaded;

impl BlockDevice for Threaded {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        Pattern.read_at(offset, buf)
    }

    fn spawn(&self, job: tessera_engine::Job) {
        std::thread::spawn(job);
    }
}

#[test]
fn concurrent_flushes_share_one_sync() {
    let disk = Arc::new(SimDisk::default());
    disk.state.lock().unwrap().sync_delay = std::time::Duration::from_millis(100);
    let o = Arc::new(Overlay::create(disk.io(), params(), Arc::new(Threaded), Mode::Durable).unwrap());
    let s0 = disk.syncs();
    let (tx, rx) = std::sync::mpsc::channel();
    const FLUSHES: u64 = 16;
    for i in 0..FLUSHES {
        o.write_at(i * BS, &[i as u8 + 1; BS as usize]).unwrap();
        let tx = tx.clone();
        // Each FLUSH follows its own write; the calls return at once (nothing waits here).
        o.flush_async(Box::new(move |r| tx.send((i, r.is_ok())).unwrap()));
    }
    let acks: Vec<(u64, bool)> = (0..FLUSHES).map(|_| rx.recv().unwrap()).collect();
    assert!(acks.iter().all(|&(_, ok)| ok), "{acks:?}");
    let syncs = disk.syncs() - s0;
    // The first FLUSH starts a commit; the 15 arriving during its 100 ms sync share the next.
    assert!((1..=2).contains(&syncs), "{FLUSHES} concurrent FLUSHes took {syncs} syncs");
    assert_eq!(o.stats().syncs as usize, syncs);
    // Everything acknowledged is durable: a power loss now keeps every block.
    let after = disk.power_loss(&mut StdRng::seed_from_u64(7));
    let o2 = open(&after).unwrap();
    let got = read_all(&o2);
    for i in 0..FLUSHES {
        let b = &got[(i * BS) as usize..((i + 1) * BS) as usize];
        assert!(b.iter().all(|&x| x == i as u8 + 1), "block {i} lost after its FLUSH was acknowledged");
    }
    // A FLUSH with nothing written since is answered without a sync.
    o.flush_async(Box::new(move |r| tx.send((99, r.is_ok())).unwrap()));
    assert_eq!(rx.recv().unwrap(), (99, true));
    assert_eq!(disk.syncs() - s0, syncs);
}

#[test]
fn the_group_commit_compacts_the_log_while_serving() {
    let disk = Arc::new(SimDisk::default());
    let o = Arc::new(
        Overlay::create(disk.io(), params(), Arc::new(Threaded), Mode::Durable).unwrap().compact_after(200),
    );
    let mut rng = StdRng::seed_from_u64(11);
    let mut model = base_bytes();
    let (tx, rx) = std::sync::mpsc::channel();
    for i in 0..3000u64 {
        // Overwrites of a few blocks: the map stays small, the log would grow without bound.
        let block = rng.gen_range(0..8);
        let data = vec![(i % 251) as u8 + 1; BS as usize];
        o.write_at(block * BS, &data).unwrap();
        model[(block * BS) as usize..((block + 1) * BS) as usize].copy_from_slice(&data);
        let tx = tx.clone();
        o.flush_async(Box::new(move |r| tx.send(r.is_ok()).unwrap()));
        assert!(rx.recv().unwrap(), "flush {i}");
    }
    let st = o.stats();
    // 3000 flushed writes log ~3000 records: compacting after 200 means ~15 checkpoints.
    assert!(st.checkpoints >= 10, "{st:?}");
    // Without compaction the log alone would take 3000 / 63 ≈ 48 segments; with it the file
    // holds the header, 8 data blocks (plus the ones released but not yet reusable) and a few
    // segments (16 slots when measured).
    assert!(st.file_slots <= 24, "the file grew to {} slots: {st:?}", st.file_slots);
    assert_eq!(read_all(&o), model);
    let o2 = open(&disk.power_loss(&mut rng)).unwrap();
    assert_eq!(read_all(&o2), model, "after a power loss");
}

#[test]
fn reopen_refuses_other_images_and_garbage() {
    let disk = Arc::new(SimDisk::default());
    let o = create(&disk);
    o.write_at(0, b"hello").unwrap();
    o.flush().unwrap();
    drop(o);
    let other = OverlayParams { image_id: ImageId(Sha256Digest::of(b"other")), ..params() };
    let e = Overlay::open(disk.io(), other, Arc::new(Pattern), Mode::Durable).unwrap_err();
    assert!(matches!(e, OverlayError::ImageMismatch { .. }), "{e}");
    let e = Overlay::open(
        disk.io(),
        OverlayParams { block_size: 8192, ..params() },
        Arc::new(Pattern),
        Mode::Durable,
    )
    .unwrap_err();
    assert!(matches!(e, OverlayError::BlockSizeMismatch { found: 4096, expected: 8192 }), "{e}");
    // Blocks under 4 KiB cannot hold the two header copies of slot 0 (fuzzing finding F2).
    let e = Overlay::open(
        disk.io(),
        OverlayParams { block_size: 512, ..params() },
        Arc::new(Pattern),
        Mode::Durable,
    )
    .unwrap_err();
    assert!(matches!(e, OverlayError::BadBlockSize(512)), "{e}");
    let e = Overlay::open(
        disk.io(),
        OverlayParams { device_bytes: DEV * 2, ..params() },
        Arc::new(Pattern),
        Mode::Durable,
    )
    .unwrap_err();
    assert!(matches!(e, OverlayError::DeviceSizeMismatch { .. }), "{e}");
    let empty = Arc::new(SimDisk::default());
    assert!(matches!(open(&empty), Err(OverlayError::NotAnOverlay(_))));
    let junk = Arc::new(SimDisk::default());
    junk.io().write_at(&[0x5a; 8192], 0).unwrap();
    assert!(matches!(open(&junk), Err(OverlayError::NotAnOverlay(_))));
    // Still opens for the right image, with the data.
    let o = open(&disk).unwrap();
    let mut b = [0u8; 5];
    o.read_at(0, &mut b).unwrap();
    assert_eq!(&b, b"hello");
}

#[test]
fn one_torn_header_copy_falls_back_to_the_other() {
    let disk = Arc::new(SimDisk::default());
    let o = create(&disk);
    o.write_at(4096, &[3u8; 4096]).unwrap();
    o.flush().unwrap();
    drop(o);
    // The open writes a checkpoint and header copy B (generation 2).
    drop(open(&disk).unwrap());
    let mut hdr = [0u8; HEADER_LEN];
    disk.io().read_at(&mut hdr, HEADER_B_OFFSET).unwrap();
    assert_eq!(Header::decode(&hdr).unwrap().generation, 2);
    // Tear copy B: copy A (generation 1) and its log, still intact, are used.
    disk.io().write_at(&[0xff; 16], HEADER_B_OFFSET + 40).unwrap();
    let o = open(&disk).unwrap();
    let mut b = [0u8; 4096];
    o.read_at(4096, &mut b).unwrap();
    assert_eq!(b, [3u8; 4096]);
}

/// Byte offset of log record `index` of the log's tail segment, found by scanning.
fn last_record_offset(disk: &Arc<SimDisk>) -> u64 {
    let io = disk.io();
    let mut slot0 = vec![0u8; 4096];
    io.read_at(&mut slot0, 0).unwrap();
    let h = [
        Header::decode(&slot0[..HEADER_LEN]),
        Header::decode(&slot0[HEADER_B_OFFSET as usize..][..HEADER_LEN]),
    ]
    .into_iter()
    .flatten()
    .max_by_key(|h| h.generation)
    .unwrap();
    let (mut seg, mut idx, mut last) = (h.log_head, 0u64, None);
    loop {
        let mut raw = [0u8; RECORD_LEN];
        io.read_at(&mut raw, seg * BS + idx * RECORD_LEN as u64).unwrap();
        match Record::decode(&raw, h.salt) {
            Ok(Record { op: Op::Link { slot }, .. }) => {
                seg = slot;
                idx = 0;
            }
            Ok(_) => {
                last = Some(seg * BS + idx * RECORD_LEN as u64);
                idx += 1;
            }
            Err(_) => return last.unwrap(),
        }
    }
}

#[test]
fn torn_log_tail_drops_only_the_last_record() {
    let disk = Arc::new(SimDisk::default());
    let o = create(&disk);
    o.write_at(0, &[1u8; 4096]).unwrap();
    o.flush().unwrap();
    o.write_at(4096, &[2u8; 4096]).unwrap();
    o.write_at(8192, &[3u8; 4096]).unwrap();
    o.flush().unwrap();
    drop(o);
    let at = last_record_offset(&disk);
    disk.io().write_at(&[0u8; 20], at + 30).unwrap();
    let o = open(&disk).unwrap();
    let got = read_all(&o);
    assert_eq!(&got[..4096], &[1u8; 4096]);
    assert_eq!(&got[4096..8192], &[2u8; 4096]);
    assert_eq!(got[8192..12288], base_bytes()[8192..12288], "the torn record is dropped");
}

#[test]
fn last_group_data_checksum_mismatch_drops_the_record() {
    let disk = Arc::new(SimDisk::default());
    let o = create(&disk);
    o.write_at(0, &[1u8; 4096]).unwrap();
    o.flush().unwrap();
    o.write_at(0, &[2u8; 4096]).unwrap();
    o.write_at(4096, &[4u8; 4096]).unwrap();
    o.flush().unwrap();
    // Find the slot of block 0 now and damage its data, as if the data never reached the
    // disk while its log record did.
    let st = read_state(&o.state);
    let slot = match st.map.lookup(0, 1)[0].mapping {
        Some(Mapping::Slot(s)) => s,
        other => panic!("{other:?}"),
    };
    drop(st);
    drop(o);
    disk.io().write_at(&[0u8; 4096], slot * BS).unwrap();
    let o = open(&disk).unwrap();
    let got = read_all(&o);
    assert_eq!(&got[..4096], &[1u8; 4096], "falls back to the previous (synced) version");
    assert_eq!(&got[4096..8192], &[4u8; 4096], "other records of the group stand");
}

#[test]
fn malformed_record_with_valid_checksum_is_corruption() {
    let disk = Arc::new(SimDisk::default());
    let o = create(&disk);
    o.write_at(0, &[1u8; 4096]).unwrap();
    o.flush().unwrap();
    let salt = lock_mutex(&o.log).salt;
    drop(o);
    let at = last_record_offset(&disk);
    let mut raw = [0u8; RECORD_LEN];
    disk.io().read_at(&mut raw, at).unwrap();
    let mut r = Record::decode(&raw, salt).unwrap();
    // A map record pointing at the header slot, with a valid checksum.
    if let Op::Map { block, count, data_crc, .. } = r.op {
        r.op = Op::Map { block, count, slot: 0, data_crc };
    }
    // Group 0 (the checkpoint's) is never in doubt: an impossible record there is corruption,
    // not a torn tail.
    r.group = 0;
    disk.io().write_at(&r.encode(salt), at).unwrap();
    assert!(matches!(open(&disk), Err(OverlayError::Corrupt { .. })));
}

#[test]
fn log_spans_many_segments_and_reopens_repeatedly() {
    let disk = Arc::new(SimDisk::default());
    let mut o = create(&disk);
    let mut model = base_bytes();
    let mut rng = StdRng::seed_from_u64(5);
    for round in 0..6 {
        for _ in 0..150 {
            // Scattered single blocks: many extents, many records, several segments.
            let b = rng.gen_range(0..BLOCKS);
            let v = rng.gen::<u8>();
            o.write_at(b * BS, &[v; 4096]).unwrap();
            model[(b * BS) as usize..((b + 1) * BS) as usize].fill(v);
        }
        o.flush().unwrap();
        drop(o);
        o = open(&disk).unwrap();
        assert_eq!(read_all(&o), model, "round {round}");
        // The file does not grow without bound: slots are reused.
        assert!(o.stats().file_slots < 3 * BLOCKS, "{:?}", o.stats());
    }
}

#[test]
fn read_only_open_writes_nothing() {
    let disk = Arc::new(SimDisk::default());
    let o = create(&disk);
    o.write_at(0, &[1u8; 100]).unwrap();
    o.flush().unwrap();
    drop(o);
    let before = disk.state.lock().unwrap().durable.clone();
    let o = Overlay::open(disk.io(), params(), Arc::new(Pattern), Mode::ReadOnly).unwrap();
    assert_eq!(read_all(&o)[..100], [1u8; 100]);
    assert!(matches!(o.write_at(0, &[1]), Err(OverlayError::ReadOnly)));
    assert!(o.flush().is_ok(), "nothing to flush");
    let s = disk.state.lock().unwrap();
    assert!(s.volatile.is_empty());
    assert_eq!(s.durable, before);
}

/// The guest's view after a crash: for each block, the versions it may legally show (the
/// content at the last completed FLUSH, then every later version).
struct Model {
    current: Vec<u8>,
    versions: Vec<Vec<Vec<u8>>>,
    /// Per block, the versions of requests that failed since the last adoption (a kill in the
    /// middle of a request may leave any of them).
    torn: Vec<Vec<Vec<u8>>>,
}

impl Model {
    fn new() -> Self {
        let current = base_bytes();
        let versions = (0..BLOCKS).map(|b| vec![Self::block_of(&current, b)]).collect();
        Self { current, versions, torn: vec![Vec::new(); BLOCKS as usize] }
    }

    fn block_of(v: &[u8], b: u64) -> Vec<u8> {
        v[(b * BS) as usize..((b + 1) * BS) as usize].to_vec()
    }

    fn write(&mut self, off: u64, data: &[u8]) {
        self.current[off as usize..off as usize + data.len()].copy_from_slice(data);
        for b in off / BS..(off + data.len() as u64).div_ceil(BS) {
            let v = Self::block_of(&self.current, b);
            self.versions[b as usize].push(v);
        }
    }

    /// A request that failed (the power went during it) may have reached any of its blocks.
    fn maybe_written(&mut self, off: u64, data: &[u8]) {
        let mut next = self.current.clone();
        next[off as usize..off as usize + data.len()].copy_from_slice(data);
        for b in off / BS..(off + data.len() as u64).div_ceil(BS) {
            self.versions[b as usize].push(Self::block_of(&next, b));
            self.torn[b as usize].push(Self::block_of(&next, b));
        }
    }

    /// Check `got` (the device after a process kill: the page cache survived) and adopt it:
    /// every block shows its latest completed write, flushed or not, or a failed request's.
    fn check_kill_and_adopt(&mut self, got: &[u8], what: &str) {
        for b in 0..BLOCKS {
            let block = Self::block_of(got, b);
            assert!(
                block == Self::block_of(&self.current, b) || self.torn[b as usize].contains(&block),
                "{what}: block {b} lost a completed write"
            );
        }
        self.adopt(got);
    }

    fn flushed(&mut self) {
        for b in 0..BLOCKS {
            self.versions[b as usize] = vec![Self::block_of(&self.current, b)];
        }
    }

    /// Adopt the device's content after a crash (the checks are done).
    fn adopt(&mut self, got: &[u8]) {
        self.current = got.to_vec();
        self.flushed();
        self.torn.iter_mut().for_each(Vec::clear);
    }

    /// Check `got` (the device after a crash) and adopt it as the new state.
    fn check_and_adopt(&mut self, got: &[u8], what: &str) {
        for b in 0..BLOCKS {
            let block = Self::block_of(got, b);
            if !self.versions[b as usize].contains(&block) {
                let base = Self::block_of(&base_bytes(), b);
                eprintln!(
                    "block {b}: got {:?} base? {} zeros? {}",
                    &block[..16],
                    block == base,
                    block.iter().all(|&x| x == 0)
                );
                for v in &self.versions[b as usize] {
                    let diff = v.iter().zip(&block).filter(|(a, b)| a != b).count();
                    eprintln!("  version {:?} differs in {diff} bytes", &v[..16]);
                }
            }
            assert!(
                self.versions[b as usize].contains(&block),
                "{what}: block {b} shows content that was never written there since the last flush"
            );
        }
        self.adopt(got);
    }
}

/// Random writes (sizes from 1 byte to 5 blocks, aligned or not), zeroes, flushes and
/// compactions; power losses at random points (also in the middle of a flush, of a compaction
/// or of the checkpoint at open). After
/// each loss the overlay must open, and every block must show its content at the last
/// completed flush or a later version of it.
#[test]
fn durability_under_power_loss() {
    let mut rng = StdRng::seed_from_u64(0xd15c);
    for life_set in 0..40 {
        // Odd sets keep 8 zero-filled slots ready ahead (and prepare them amid the rest).
        let ahead = if life_set % 2 == 1 { 8 * BS } else { 0 };
        let open = |disk: &Arc<SimDisk>| open(disk).map(|o| o.prepare_ahead(ahead));
        let mut disk = Arc::new(SimDisk::default());
        let mut model = Model::new();
        let mut overlay = Some(create(&disk).prepare_ahead(ahead));
        for life in 0..6 {
            // A power budget: the loss may come in the middle of anything, even a flush.
            let budget = rng.gen_range(1..120);
            disk.state.lock().unwrap().budget = Some(budget);
            let o = match overlay.take() {
                Some(o) if rng.gen_bool(0.7) => o,
                previous => {
                    // A restart (kill -9 without power loss; the page cache survives), with
                    // the power budget running during the open and its checkpoint.
                    drop(previous);
                    match open(&disk) {
                        Ok(o) => {
                            model.check_kill_and_adopt(&read_all(&o), "after a restart");
                            o
                        }
                        Err(OverlayError::Io { .. }) => {
                            disk = disk.power_loss(&mut rng);
                            let o = open(&disk).unwrap_or_else(|e| panic!("set {life_set} life {life}: {e}"));
                            model.check_and_adopt(&read_all(&o), "after a loss during open");
                            o
                        }
                        Err(e) => panic!("set {life_set} life {life}: {e}"),
                    }
                }
            };
            for _ in 0..rng.gen_range(1..60) {
                let r = match rng.gen_range(0..11) {
                    0..=5 => {
                        let len = if rng.gen_bool(0.5) {
                            BS * rng.gen_range(1..=5)
                        } else {
                            rng.gen_range(1..3 * BS)
                        };
                        let off = if rng.gen_bool(0.5) {
                            rng.gen_range(0..BLOCKS) * BS
                        } else {
                            rng.gen_range(0..DEV)
                        };
                        let len = len.min(DEV - off);
                        let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
                        let r = o.write_at(off, &data);
                        match r {
                            Ok(()) => model.write(off, &data),
                            Err(_) => model.maybe_written(off, &data),
                        }
                        r
                    }
                    6 => {
                        let off = rng.gen_range(0..DEV);
                        let len = rng.gen_range(1..=(DEV - off).min(8 * BS));
                        let zeros = vec![0u8; len as usize];
                        let r = o.write_zeroes(off, len);
                        match r {
                            Ok(()) => model.write(off, &zeros),
                            Err(_) => model.maybe_written(off, &zeros),
                        }
                        r
                    }
                    // Compaction while serving (a checkpoint; it also makes completed writes
                    // durable, which the model allows: a later version than the last flush).
                    7 => o.compact(),
                    // Zero-filling free slots past the frontier (a no-op in even sets).
                    8 => o.prepare().map(|_| ()),
                    _ => o.flush().map(|()| model.flushed()),
                };
                if r.is_err() {
                    break; // the power is gone
                }
            }
            drop(o);
            // The life ends in a power loss, or in a kill -9 (the page cache survives: every
            // completed write must be there, flushed or not).
            let killed = rng.gen_bool(0.3);
            disk = if killed { disk.kill() } else { disk.power_loss(&mut rng) };
            let o = open(&disk).unwrap_or_else(|e| panic!("set {life_set} life {life}: {e}"));
            let what = format!("set {life_set} life {life}");
            if killed {
                model.check_kill_and_adopt(&read_all(&o), &what);
            } else {
                model.check_and_adopt(&read_all(&o), &what);
            }
            overlay = Some(o);
        }
        // A clean flush is exact.
        let o = overlay.take().unwrap();
        o.write_at(5, b"final").unwrap();
        model.write(5, b"final");
        o.flush().unwrap();
        drop(o);
        let o = open(&disk.power_loss(&mut rng)).unwrap();
        assert_eq!(read_all(&o), model.current);
    }
}

/// A process kill keeps every completed write, flushed or not (the page cache survives).
#[test]
fn kill_keeps_completed_writes_after_a_flush_point() {
    let disk = Arc::new(SimDisk::default());
    let o = create(&disk);
    o.write_at(0, &[1u8; 8192]).unwrap();
    o.flush().unwrap();
    o.write_at(100, &[2u8; 10]).unwrap();
    o.flush().unwrap();
    let o2 = open(&disk.kill()).unwrap();
    let mut b = vec![0u8; 8192];
    o2.read_at(0, &mut b).unwrap();
    assert_eq!(&b[..100], &[1u8; 100]);
    assert_eq!(&b[100..110], &[2u8; 10]);
    assert_eq!(&b[110..], &[1u8; 8082]);
}

/// Prepared slots make a FLUSHed write an overwrite: after the first group commit, writes of
/// fresh blocks (data and log records) never grow the file while prepared slots last; what
/// was written survives a power loss and a reopen.
#[test]
fn prepared_slots_keep_writes_inside_the_file() {
    let disk = Arc::new(SimDisk::default());
    let o = Arc::new(create(&disk).prepare_ahead(32 * BS));
    let mut model = base_bytes();
    let flush = |o: &Arc<Overlay>| {
        let (tx, rx) = std::sync::mpsc::channel();
        o.flush_async(Box::new(move |r| tx.send(r.is_ok()).unwrap()));
        assert!(rx.recv().unwrap());
    };
    o.write_at(0, &[1u8; BS as usize]).unwrap();
    model[..BS as usize].fill(1);
    // The commit finds no free slots and prepares (Pattern runs the job at once).
    flush(&o);
    let st = o.stats();
    assert_eq!(st.prepared_slots, 32, "{st:?}");
    assert_eq!(st.free_slots, 32, "{st:?}");
    let file = disk.state.lock().unwrap().len();
    assert_eq!(file, st.file_slots * BS, "the zeros reach the file's end");
    let grew = disk.state.lock().unwrap().grew;
    // 12 fresh blocks, each flushed: 12 data slots and the log's records, all in prepared slots.
    for b in 1..13u64 {
        let data = vec![b as u8 + 1; BS as usize];
        o.write_at(b * BS, &data).unwrap();
        model[(b * BS) as usize..((b + 1) * BS) as usize].copy_from_slice(&data);
        flush(&o);
    }
    let s = disk.state.lock().unwrap();
    assert_eq!(s.grew, grew, "a write past the end of the file while prepared slots were free");
    assert_eq!(s.len(), file, "the file grew");
    drop(s);
    assert_eq!(read_all(&o), model);
    // Below half of the 32 left, the next commit prepares again, up to 32 free.
    for b in 13..30u64 {
        o.write_at(b * BS, &[7u8; BS as usize]).unwrap();
        model[(b * BS) as usize..((b + 1) * BS) as usize].fill(7);
        flush(&o);
    }
    let st = o.stats();
    assert!(st.prepared_slots > 32 && st.free_slots >= 16, "{st:?}");
    let o2 = open(&disk.power_loss(&mut StdRng::seed_from_u64(3))).unwrap();
    assert_eq!(read_all(&o2), model, "after a power loss");
    assert_eq!(o2.stats().free_slots, st.free_slots, "prepared slots are free after a reopen");
}

/// A preparation never makes the file larger than the device can use (every block, an eighth
/// more, and 64 slots), and is off unless asked for.
#[test]
fn preparation_is_capped_by_the_device_and_off_by_default() {
    let disk = Arc::new(SimDisk::default());
    let o = create(&disk);
    assert_eq!(o.prepare().unwrap(), 0, "off by default");
    let end = o.stats().file_slots;
    let o = o.prepare_ahead(1 << 30);
    let cap = BLOCKS + BLOCKS / 8 + 64;
    assert_eq!(o.prepare().unwrap(), cap - end, "1 GiB asked for, the cap reached");
    let st = o.stats();
    assert_eq!((st.file_slots, st.prepared_slots, st.free_slots), (cap, cap - end, cap - end));
    assert_eq!(disk.state.lock().unwrap().len(), cap * BS);
    assert_eq!(o.prepare().unwrap(), 0, "nothing more past the cap");
    let tmp = Overlay::temporary(&std::env::temp_dir(), params(), Arc::new(Pattern)).unwrap();
    assert_eq!(tmp.prepare_ahead(1 << 20).prepare().unwrap(), 0, "never for a volatile overlay");
}

/// A step that cannot write (a full disk) gives its slots back and pauses; a failed sync of
/// the zeros fails the overlay as a failed FLUSH does.
#[test]
fn a_failed_preparation_pauses_or_fails_the_overlay() {
    let disk = Arc::new(SimDisk::default());
    let o = Arc::new(create(&disk).prepare_ahead(8 * BS));
    let end = o.stats().file_slots;
    disk.state.lock().unwrap().budget = Some(0);
    assert!(o.prepare().is_err());
    let st = o.stats();
    assert_eq!((st.prepared_slots, st.free_slots), (0, 8), "the step's slots are given back: {st:?}");
    assert_eq!(st.file_slots, end + 8);
    disk.state.lock().unwrap().budget = None;
    // Still writable; the slots given back are used; the pause keeps the commit from preparing.
    o.write_at(0, &[3u8; BS as usize]).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    o.flush_async(Box::new(move |r| tx.send(r.is_ok()).unwrap()));
    assert!(rx.recv().unwrap());
    assert_eq!(o.stats().prepared_slots, 0, "paused after the failure");
    // The zeros written, the sync fails: the overlay refuses writes from then on.
    let disk = Arc::new(SimDisk::default());
    let o = create(&disk).prepare_ahead(8 * BS);
    disk.state.lock().unwrap().budget = Some(1);
    assert!(o.prepare().is_err());
    disk.state.lock().unwrap().budget = None;
    assert!(matches!(o.write_at(0, &[1u8; 10]), Err(OverlayError::Failed)));
}

/// The slot block `b` lives in.
fn slot_of(o: &Overlay, b: u64) -> u64 {
    match read_state(&o.state).map.lookup(b, 1)[0].mapping {
        Some(Mapping::Slot(s)) => s,
        other => panic!("block {b}: {other:?}"),
    }
}

/// A record of group *L* written while the sync of *L − 1* runs, and a power loss that keeps
/// the records but not the data of *L − 1*: the open must check *L − 1*'s data too.
#[test]
fn the_group_before_the_last_is_checked_too() {
    let disk = Arc::new(SimDisk::default());
    let o = Arc::new(create(&disk));
    o.write_at(0, &[1u8; 4096]).unwrap();
    o.flush().unwrap();
    // Group 2: two writes; the data of the second will not reach the disk.
    o.write_at(BS, &[9u8; 4096]).unwrap();
    o.write_at(0, &[2u8; 4096]).unwrap();
    let slot = slot_of(&o, 0);
    disk.state.lock().unwrap().sync_delay = std::time::Duration::from_millis(300);
    let flusher = {
        let o = Arc::clone(&o);
        std::thread::spawn(move || o.flush().unwrap())
    };
    // The flush has closed the group once its sync sleeps; then a write of the next group.
    while lock_mutex(&o.log).group < 3 {
        std::thread::yield_now();
    }
    o.write_at(2 * BS, &[3u8; 4096]).unwrap();
    let lost = disk.power_loss_dropping(|off, len| off <= slot * BS && slot * BS < off + len);
    flusher.join().unwrap();
    let got = read_all(&open(&lost).unwrap());
    assert_eq!(&got[..4096], &[1u8; 4096], "block 0: its lost write is dropped, the flushed one shows");
    assert_eq!(&got[4096..8192], &[9u8; 4096]);
    assert_eq!(&got[8192..12288], &[3u8; 4096], "a later write that reached the disk may show");
}

/// Block content of write number `n` (the number in its first 8 bytes, then a filler derived
/// from it): a torn or misplaced block never decodes as a version.
fn numbered_block(n: u64) -> Vec<u8> {
    let mut v = vec![(n % 251) as u8; BS as usize];
    v[..8].copy_from_slice(&n.to_le_bytes());
    v
}

/// Writes keep completing while FLUSHes' syncs run (records of the next group are written
/// during the sync of the previous one), and the power goes at a random moment; a kill keeps
/// everything. After a power loss each block shows the last write to it that completed before
/// the last FLUSH completed *began*, or a later one; after a kill, the last completed write or
/// a later one.
#[test]
fn writes_during_syncs_survive_power_loss_and_kill() {
    use std::sync::atomic::{AtomicBool, AtomicU64};
    let mut rng = StdRng::seed_from_u64(0x5eed);
    for round in 0..12 {
        let disk = Arc::new(SimDisk::default());
        disk.state.lock().unwrap().sync_delay = std::time::Duration::from_micros(rng.gen_range(200..3000));
        let o = Arc::new(create(&disk));
        let clock = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        // (block, write number, completion time) of every completed write.
        let done: Arc<Mutex<Vec<(u64, u64, u64)>>> = Arc::default();
        // (block, write number) of every write begun.
        let begun: Arc<Mutex<Vec<(u64, u64)>>> = Arc::default();
        // (start, end) of every completed FLUSH.
        let flushes: Arc<Mutex<Vec<(u64, u64)>>> = Arc::default();
        let writer = {
            let (o, clock, stop, done) =
                (Arc::clone(&o), Arc::clone(&clock), Arc::clone(&stop), Arc::clone(&done));
            let begun = Arc::clone(&begun);
            let seed = rng.gen();
            std::thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(seed);
                let mut n = 1;
                while !stop.load(Ordering::Acquire) {
                    let b = rng.gen_range(0..BLOCKS);
                    begun.lock().unwrap().push((b, n));
                    o.write_at(b * BS, &numbered_block(n)).unwrap();
                    done.lock().unwrap().push((b, n, clock.fetch_add(1, Ordering::SeqCst)));
                    n += 1;
                }
            })
        };
        let flusher = {
            let (o, clock, stop, flushes) =
                (Arc::clone(&o), Arc::clone(&clock), Arc::clone(&stop), Arc::clone(&flushes));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    let t0 = clock.fetch_add(1, Ordering::SeqCst);
                    o.flush().unwrap();
                    let t1 = clock.fetch_add(1, Ordering::SeqCst);
                    flushes.lock().unwrap().push((t0, t1));
                }
            })
        };
        // Crash after a few syncs (however slow the machine), at a random moment.
        let want = rng.gen_range(2..6);
        while disk.syncs() < want {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        std::thread::sleep(std::time::Duration::from_micros(rng.gen_range(0..4000)));
        // Everything that completed before `snap` is older than the crash.
        let snap = clock.fetch_add(1, Ordering::SeqCst);
        let lost = disk.power_loss(&mut rng);
        let killed = disk.kill();
        stop.store(true, Ordering::Release);
        writer.join().unwrap();
        flusher.join().unwrap();
        let done = done.lock().unwrap().clone();
        let begun = begun.lock().unwrap().clone();
        let flushes = flushes.lock().unwrap().clone();
        // The start of the last FLUSH that completed before the crash.
        let durable_before = flushes.iter().filter(|&&(_, t1)| t1 < snap).map(|&(t0, _)| t0).max();
        let floor = |before: Option<u64>, b: u64| {
            before.and_then(|t| {
                done.iter().filter(|&&(blk, _, tc)| blk == b && tc < t).map(|&(_, n, _)| n).max()
            })
        };
        for (disk, what, before) in [(lost, "power loss", durable_before), (killed, "kill", Some(snap))] {
            let got = read_all(&open(&disk).unwrap_or_else(|e| panic!("round {round}, {what}: {e}")));
            let base = base_bytes();
            for b in 0..BLOCKS {
                let block = Model::block_of(&got, b);
                let shown = u64::from_le_bytes(block[..8].try_into().unwrap());
                match floor(before, b) {
                    None if block == Model::block_of(&base, b) => {}
                    min => {
                        assert_eq!(block, numbered_block(shown), "round {round}, {what}: block {b} is torn");
                        assert!(
                            begun.contains(&(b, shown)),
                            "round {round}, {what}: block {b} shows write {shown} of another block"
                        );
                        assert!(
                            shown >= min.unwrap_or(1),
                            "round {round}, {what}: block {b} shows write {shown}, older than write {min:?}"
                        );
                    }
                }
            }
        }
    }
}

/// A version 1 file (same records, its last group alone in doubt) is read, and its first
/// writable open leaves both header copies at version 2, so that an older tessera refuses it
/// rather than falling back to a copy of its own version.
#[test]
fn version_1_files_are_read_and_upgraded() {
    let disk = Arc::new(SimDisk::default());
    let o = create(&disk);
    o.write_at(0, &[5u8; 3 * 4096]).unwrap();
    o.flush().unwrap();
    drop(o);
    let o = open(&disk).unwrap(); // two header copies now
    drop(o);
    let io = disk.io();
    let mut slot0 = vec![0u8; 4096];
    io.read_at(&mut slot0, 0).unwrap();
    for at in [0usize, HEADER_B_OFFSET as usize] {
        let h = Header::decode(&slot0[at..at + HEADER_LEN]).unwrap();
        io.write_at(&Header { version: 1, ..h }.encode(), at as u64).unwrap();
    }
    let o = open(&disk).unwrap();
    assert_eq!(&read_all(&o)[..3 * 4096], &[5u8; 3 * 4096][..]);
    drop(o);
    io.read_at(&mut slot0, 0).unwrap();
    for at in [0usize, HEADER_B_OFFSET as usize] {
        assert_eq!(
            Header::decode(&slot0[at..at + HEADER_LEN]).unwrap().version,
            format::VERSION,
            "copy at {at}"
        );
    }
}
