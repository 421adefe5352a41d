//! Parse → plan → execute on crafted descriptor chains (virtio-queue's driver-side mock queue):
//! hostile guests get the right status, never a panic, never an access outside guest memory.
#![allow(clippy::unwrap_used)]

use rand::{Rng, SeedableRng};
use std::sync::Arc;
use tessera_engine::ReadError;
use tessera_image::{ImageId, Sha256Digest};

use tessera_engine::BlockDevice;
use tessera_vhost::{serve_chain, Completion, DeviceConfig, Disk, RequestType, Status};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

mod failing;
use failing::Failing;

const MEM_LEN: u64 = 1 << 20;
const CAPACITY: u64 = 4 << 20;
const W: u16 = 2; // VRING_DESC_F_WRITE
const HDR: u64 = 0x10000;
const DATA: u64 = 0x20000;
const STATUS: u64 = 0x80000;

/// Device byte `o` is `o % 251`.
struct Pattern;

impl BlockDevice for Pattern {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = ((offset + i as u64) % 251) as u8;
        }
        Ok(())
    }
}

fn device() -> DeviceConfig {
    DeviceConfig::new(&ImageId(Sha256Digest::of(b"hostile")), CAPACITY, 1, true)
}

fn mem() -> GuestMemoryMmap<()> {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_LEN as usize)]).unwrap()
}

fn d(addr: u64, len: u32, flags: u16) -> RawDescriptor {
    RawDescriptor::from(Descriptor::new(addr, len, flags, 0))
}

fn header(mem: &GuestMemoryMmap<()>, at: u64, kind: u32, sector: u64) {
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&kind.to_le_bytes());
    h[8..].copy_from_slice(&sector.to_le_bytes());
    mem.write_slice(&h, GuestAddress(at)).unwrap();
}

/// Serve one chain made of `descs` (NEXT links added) with `base`.
fn run_with(
    mem: &GuestMemoryMmap<()>,
    descs: &[RawDescriptor],
    base: impl BlockDevice + 'static,
) -> Completion {
    let q = MockSplitQueue::new(mem, 512);
    let chain = q.build_desc_chain(descs).unwrap();
    mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    serve_chain(chain, mem, &Disk::Base(Arc::new(base)), &device(), &mut Vec::new())
}

fn run(mem: &GuestMemoryMmap<()>, descs: &[RawDescriptor]) -> Completion {
    run_with(mem, descs, Pattern)
}

fn status_byte(mem: &GuestMemoryMmap<()>) -> u8 {
    mem.read_obj(GuestAddress(STATUS)).unwrap()
}

fn expect(c: Completion, status: Status, used_len: u32, mem: &GuestMemoryMmap<()>) {
    assert_eq!(c.status, Some(status));
    assert_eq!(c.used_len, used_len);
    assert_eq!(status_byte(mem), status.byte());
}

fn pattern(offset: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    Pattern.read_at(offset, &mut v).unwrap();
    v
}

#[test]
fn read_ok_and_layout_independent() {
    let m = mem();
    header(&m, HDR, 0, 8);
    let c = run(&m, &[d(HDR, 16, 0), d(DATA, 4096, W), d(STATUS, 1, W)]);
    expect(c, Status::Ok, 4097, &m);
    let mut got = vec![0u8; 4096];
    m.read_slice(&mut got, GuestAddress(DATA)).unwrap();
    assert_eq!(got, pattern(8 * 512, 4096));

    // Header split 5 + 11, data in three uneven pieces, the status byte at the end of the last
    // data descriptor.
    let m = mem();
    header(&m, HDR, 0, 3);
    let mut h = [0u8; 16];
    m.read_slice(&mut h, GuestAddress(HDR)).unwrap();
    m.write_slice(&h[5..], GuestAddress(HDR + 0x100)).unwrap();
    let c = run(
        &m,
        &[
            d(HDR, 5, 0),
            d(HDR + 0x100, 11, 0),
            d(DATA, 100, W),
            d(DATA + 0x1000, 0, W),
            d(DATA + 0x2000, 312, W),
            d(STATUS - 100, 101, W),
        ],
    );
    expect(c, Status::Ok, 513, &m);
    let mut got = vec![0u8; 512];
    m.read_slice(&mut got[..100], GuestAddress(DATA)).unwrap();
    m.read_slice(&mut got[100..412], GuestAddress(DATA + 0x2000)).unwrap();
    m.read_slice(&mut got[412..], GuestAddress(STATUS - 100)).unwrap();
    assert_eq!(got, pattern(3 * 512, 512));
}

#[test]
fn flush_get_id_and_refused_requests() {
    let m = mem();
    header(&m, HDR, 4, 0);
    expect(run(&m, &[d(HDR, 16, 0), d(STATUS, 1, W)]), Status::Ok, 1, &m);

    header(&m, HDR, 8, 0);
    let c = run(&m, &[d(HDR, 16, 0), d(DATA, 20, W), d(STATUS, 1, W)]);
    expect(c, Status::Ok, 21, &m);
    let mut id = [0u8; 20];
    m.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    assert_eq!(id, device().serial);

    // A write to the read-only device.
    header(&m, HDR, 1, 0);
    expect(run(&m, &[d(HDR, 16, 0), d(DATA, 4096, 0), d(STATUS, 1, W)]), Status::IoErr, 1, &m);
    // DISCARD and WRITE_ZEROES with one valid segment.
    let mut seg = [0u8; 16];
    seg[8..12].copy_from_slice(&8u32.to_le_bytes());
    m.write_slice(&seg, GuestAddress(DATA)).unwrap();
    for kind in [11, 13] {
        header(&m, HDR, kind, 0);
        expect(run(&m, &[d(HDR, 16, 0), d(DATA, 16, 0), d(STATUS, 1, W)]), Status::IoErr, 1, &m);
    }
    // DISCARD with reserved flags is unsupported; a payload that is not whole segments is an error.
    seg[12] = 0x80;
    m.write_slice(&seg, GuestAddress(DATA)).unwrap();
    header(&m, HDR, 11, 0);
    expect(run(&m, &[d(HDR, 16, 0), d(DATA, 16, 0), d(STATUS, 1, W)]), Status::Unsupp, 1, &m);
    expect(run(&m, &[d(HDR, 16, 0), d(DATA, 15, 0), d(STATUS, 1, W)]), Status::IoErr, 1, &m);
    // Unknown request types, including the legacy SCSI command.
    for kind in [2, 99, u32::MAX] {
        header(&m, HDR, kind, 0);
        expect(run(&m, &[d(HDR, 16, 0), d(DATA, 512, W), d(STATUS, 1, W)]), Status::Unsupp, 1, &m);
    }
}

#[test]
fn out_of_range_and_malformed() {
    let m = mem();
    let cap = CAPACITY / 512;
    for sector in [cap, cap - 7, u64::MAX, u64::MAX - 7] {
        header(&m, HDR, 0, sector);
        expect(run(&m, &[d(HDR, 16, 0), d(DATA, 4096, W), d(STATUS, 1, W)]), Status::IoErr, 1, &m);
    }
    header(&m, HDR, 0, cap - 8);
    expect(run(&m, &[d(HDR, 16, 0), d(DATA, 4096, W), d(STATUS, 1, W)]), Status::Ok, 4097, &m);
    // Length not a multiple of 512.
    header(&m, HDR, 0, 0);
    expect(run(&m, &[d(HDR, 16, 0), d(DATA, 1000, W), d(STATUS, 1, W)]), Status::IoErr, 1, &m);
    // Header too short.
    expect(run(&m, &[d(HDR, 8, 0), d(DATA, 512, W), d(STATUS, 1, W)]), Status::IoErr, 1, &m);
    // A device-readable descriptor after a device-writable one.
    expect(
        run(&m, &[d(HDR, 16, 0), d(DATA, 512, W), d(DATA + 4096, 512, 0), d(STATUS, 1, W)]),
        Status::IoErr,
        1,
        &m,
    );
    // A data buffer outside guest memory, one straddling its end, one whose end overflows u64.
    for (addr, len) in [(MEM_LEN + 4096, 4096), (MEM_LEN - 512, 4096), (u64::MAX - 100, 4096)] {
        expect(run(&m, &[d(HDR, 16, 0), d(addr, len, W), d(STATUS, 1, W)]), Status::IoErr, 1, &m);
    }
    // A chain longer than seg_max + 2.
    let mut long = vec![d(HDR, 16, 0)];
    long.extend((0..300).map(|i| d(DATA + i * 512, 512, W)));
    long.push(d(STATUS, 1, W));
    expect(run(&m, &long), Status::IoErr, 1, &m);
    // A read error from the image.
    expect(run_with(&m, &[d(HDR, 16, 0), d(DATA, 512, W), d(STATUS, 1, W)], Failing), Status::IoErr, 1, &m);
}

#[test]
fn chains_without_a_usable_status_are_dropped() {
    let m = mem();
    header(&m, HDR, 0, 0);
    let untouched = |m: &GuestMemoryMmap<()>| assert_eq!(status_byte(m), 0xff);
    // Status descriptor not device-writable.
    let c = run(&m, &[d(HDR, 16, 0), d(DATA, 512, W), d(STATUS, 1, 0)]);
    assert_eq!(c.status, Some(Status::IoErr), "the readable-after-writable chain still has a status byte");
    let c = run(&m, &[d(HDR, 16, 0), d(STATUS, 1, 0)]);
    assert_eq!(
        c,
        Completion { used_len: 0, status: None, kind: RequestType::Invalid, bytes: 0, sector: 0, len: 0 }
    );
    untouched(&m);
    // Status outside guest memory.
    let c = run(&m, &[d(HDR, 16, 0), d(DATA, 512, W), d(MEM_LEN, 1, W)]);
    assert_eq!(
        c,
        Completion { used_len: 0, status: None, kind: RequestType::Invalid, bytes: 0, sector: 0, len: 0 }
    );
    // A zero-length writable descriptor is no status byte.
    let c = run(&m, &[d(HDR, 16, 0), d(STATUS, 0, W)]);
    assert_eq!(
        c,
        Completion { used_len: 0, status: None, kind: RequestType::Invalid, bytes: 0, sector: 0, len: 0 }
    );
    untouched(&m);
    // A `next` pointing outside the descriptor table ends the chain after the header.
    let q = MockSplitQueue::new(&m, 16);
    let broken = [RawDescriptor::from(Descriptor::new(HDR, 16, 1, 1000))];
    let chain = q.build_multiple_desc_chains(&broken).unwrap();
    let c = serve_chain(chain, &m, &Disk::Base(Arc::new(Pattern)), &device(), &mut Vec::new());
    assert_eq!(
        c,
        Completion { used_len: 0, status: None, kind: RequestType::Invalid, bytes: 0, sector: 0, len: 0 }
    );
    untouched(&m);
}

/// Random chains (addresses in, at the edge of and far outside memory; random flags, lengths and
/// headers): never a panic, and a reply's used length never exceeds its writable bytes.
#[test]
fn random_chains_never_panic() {
    let m = mem();
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    for _ in 0..3000 {
        let n = rng.gen_range(1..8);
        let descs: Vec<RawDescriptor> = (0..n)
            .map(|_| {
                let addr = match rng.gen_range(0..4) {
                    0 => rng.gen_range(0x10000..MEM_LEN),
                    1 => MEM_LEN - rng.gen_range(0..64),
                    2 => rng.gen::<u64>(),
                    _ => HDR,
                };
                let len = match rng.gen_range(0..4) {
                    0 => rng.gen_range(0..32),
                    1 => 512 * rng.gen_range(0..16),
                    2 => rng.gen::<u32>(),
                    _ => 16,
                };
                d(addr, len, if rng.gen_bool(0.5) { W } else { 0 })
            })
            .collect();
        let kind = [0u32, 1, 4, 8, 11, 13, rng.gen()][rng.gen_range(0..7)];
        header(&m, HDR, kind, rng.gen_range(0..CAPACITY / 512 + 16));
        let q = MockSplitQueue::new(&m, 16);
        let chain = q.build_desc_chain(&descs).unwrap();
        let writable: u64 = descs
            .iter()
            .map(|r| Descriptor::from(*r))
            .filter(|x| x.flags() & W != 0)
            .map(|x| u64::from(x.len()))
            .sum();
        let c = serve_chain(chain, &m, &Disk::Base(Arc::new(Pattern)), &device(), &mut Vec::new());
        assert!(u64::from(c.used_len) <= writable);
    }
}

/// What a completion reports for the metrics: the request type and the bytes it moved.
#[test]
fn completions_carry_type_and_bytes() {
    let m = mem();
    let kind_bytes = |c: Completion| (c.kind, c.bytes);
    header(&m, HDR, 0, 8);
    let c = run(&m, &[d(HDR, 16, 0), d(DATA, 4096, W), d(STATUS, 1, W)]);
    assert_eq!(kind_bytes(c), (RequestType::Read, 4096));
    header(&m, HDR, 8, 0);
    let c = run(&m, &[d(HDR, 16, 0), d(DATA, 12, W), d(STATUS, 1, W)]);
    assert_eq!(kind_bytes(c), (RequestType::GetId, 12), "what fits of the serial");
    header(&m, HDR, 4, 0);
    assert_eq!(kind_bytes(run(&m, &[d(HDR, 16, 0), d(STATUS, 1, W)])), (RequestType::Flush, 0));
    // Refused requests keep their type (bytes count only for successes).
    header(&m, HDR, 1, 0);
    let c = run(&m, &[d(HDR, 16, 0), d(DATA, 4096, 0), d(STATUS, 1, W)]);
    assert_eq!((c.status, c.kind), (Some(Status::IoErr), RequestType::Write));
    let mut seg = [0u8; 16];
    seg[8..12].copy_from_slice(&8u32.to_le_bytes());
    m.write_slice(&seg, GuestAddress(DATA)).unwrap();
    header(&m, HDR, 13, 0);
    let c = run(&m, &[d(HDR, 16, 0), d(DATA, 16, 0), d(STATUS, 1, W)]);
    assert_eq!(kind_bytes(c), (RequestType::WriteZeroes, 8 * 512));
    header(&m, HDR, 99, 0);
    let c = run(&m, &[d(HDR, 16, 0), d(DATA, 512, W), d(STATUS, 1, W)]);
    assert_eq!((c.status, c.kind), (Some(Status::Unsupp), RequestType::Unsupported));
    // Refused before the type was accepted: a short header.
    let c = run(&m, &[d(HDR, 8, 0), d(DATA, 512, W), d(STATUS, 1, W)]);
    assert_eq!((c.status, c.kind), (Some(Status::IoErr), RequestType::Invalid));
}

#[test]
fn a_buffer_spanning_two_memory_regions_is_filled_across_them() {
    // Two adjacent regions (a VMM may map guest RAM in pieces); the data buffer crosses the
    // boundary at 0x30000, so no one host slice covers it: the sink writes it piece by piece.
    let m: GuestMemoryMmap<()> =
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x30000), (GuestAddress(0x30000), 0xd0000)])
            .unwrap();
    header(&m, HDR, 0, 16);
    let len = 0x20000u32;
    let c = run(&m, &[d(HDR, 16, 0), d(DATA, len, W), d(STATUS, 1, W)]);
    expect(c, Status::Ok, len + 1, &m);
    let mut got = vec![0u8; len as usize];
    m.read_slice(&mut got, GuestAddress(DATA)).unwrap();
    assert_eq!(got, pattern(16 * 512, len as usize));
    // And a buffer inside one region next to it, in the same chain: both right.
    header(&m, HDR, 0, 2);
    let c = run(&m, &[d(HDR, 16, 0), d(0x40000, 4096, W), d(DATA, 4096, W), d(STATUS, 1, W)]);
    expect(c, Status::Ok, 8193, &m);
    let mut got = vec![0u8; 8192];
    m.read_slice(&mut got[..4096], GuestAddress(0x40000)).unwrap();
    m.read_slice(&mut got[4096..], GuestAddress(DATA)).unwrap();
    assert_eq!(got, pattern(2 * 512, 8192));
}
