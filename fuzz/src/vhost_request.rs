//! `vhost_request`: virtio-blk request parsing ([`tessera_vhost::request::parse`]), planning
//! ([`tessera_vhost::plan::plan`]) and the whole per-chain pipeline
//! ([`tessera_vhost::serve_chain`]) on descriptor chains built from the fuzz input.
//!
//! Input (little-endian, missing bytes are zeros; [`Case::encode`] writes it):
//!
//! ```text
//! u8   flags      bit 0: walk a real split virtqueue (virtio-queue's mock ring, indirect tables,
//!                        `next` links) instead of handing the descriptors to parse directly
//!                 bit 1: read-only device        bit 2: a second memory region after a hole
//!                 bit 3: also run serve_chain (parse → plan → execute → status) on an overlay
//! u64  capacity   device bytes (rounded down to 4 KiB)
//! [16] header     type u32, ioprio u32, sector u64: written into the chain's device-readable
//!                 bytes (however they are split), followed by
//! u16  n, [n]     payload bytes (DISCARD / WRITE_ZEROES segments, write data), at most 4 KiB
//! u16  n          descriptors (at most 320 direct, 512 through the queue), each the raw
//!                 16-byte virtq_desc: u64 addr, u32 len, u16 flags, u16 next
//! u16  n          indirect-table descriptors (queue mode, at most 64), stored at 0x4000
//! ```
//!
//! Properties: never a panic; a parsed request only names buffers inside guest memory, its
//! lengths add up, IN/OUT data is whole sectors, the header fields are the bytes the guest
//! wrote; a plan stays inside the device and refuses writes on a read-only one; a served chain
//! writes its status byte and never reports more used bytes than the chain can hold.

use std::sync::Arc;

use tessera_engine::{BlockDevice, ReadError};
use tessera_image::{ImageId, Sha256Digest};
use tessera_overlay::{Mode as OverlayMode, Overlay, OverlayParams};
use tessera_vhost::inflight::Walk;
use tessera_vhost::plan::{plan, Plan};
use tessera_vhost::request::{
    parse, GuestSeg, Parsed, RequestKind, HEADER_LEN, MAX_DESCRIPTORS, SECTOR_SIZE,
};
use tessera_vhost::{serve_chain, DeviceConfig, Disk, RequestError};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryMmap};

use crate::overlay_replay::MemIo;
use crate::{Input, Output};

/// Guest memory: `[0, MEM_LEN)` and, with flag bit 2, `[REGION2, REGION2 + REGION2_LEN)`.
pub const MEM_LEN: u64 = 1 << 20;
pub const REGION2: u64 = MEM_LEN + (64 << 10);
pub const REGION2_LEN: u64 = 64 << 10;
/// Where the virtqueue's descriptor table starts (rings follow it) in queue mode.
pub const QUEUE_SIZE: u16 = 512;
/// Where the indirect table is stored in queue mode.
pub const INDIRECT: u64 = 0x4000;
/// Conventional buffer addresses used by the seeds.
pub const HDR: u64 = 0x10000;
pub const DATA: u64 = 0x20000;
pub const STATUS: u64 = 0x80000;

pub const F_QUEUE: u8 = 1;
pub const F_READ_ONLY: u8 = 2;
pub const F_REGION2: u8 = 4;
pub const F_SERVE: u8 = 8;

/// `VRING_DESC_F_*`.
pub const NEXT: u16 = 1;
pub const WRITE: u16 = 2;
pub const INDIRECT_F: u16 = 4;

/// Chains whose data is longer than this are parsed and planned but not executed (the copy
/// would only cost time).
const SERVE_MAX: u64 = 4 << 20;

/// One fuzz case, decoded.
#[derive(Debug, Clone, Default)]
pub struct Case {
    pub flags: u8,
    pub capacity: u64,
    pub header: [u8; 16],
    pub payload: Vec<u8>,
    pub descs: Vec<(u64, u32, u16, u16)>,
    pub indirect: Vec<(u64, u32, u16, u16)>,
}

impl Case {
    pub fn decode(data: &[u8]) -> Case {
        let mut i = Input::new(data);
        let flags = i.u8();
        let capacity = i.u64();
        let mut header = [0u8; 16];
        let h = i.bytes(16);
        header[..h.len()].copy_from_slice(h);
        let n = usize::from(i.u16()).min(4096);
        let payload = i.bytes(n).to_vec();
        let max = if flags & F_QUEUE != 0 { usize::from(QUEUE_SIZE) } else { 320 };
        let n = usize::from(i.u16()).min(max);
        let mut descs = Vec::with_capacity(n);
        for _ in 0..n {
            descs.push((i.u64(), i.u32(), i.u16(), i.u16()));
            if i.is_empty() {
                break;
            }
        }
        let mut indirect = Vec::new();
        if flags & F_QUEUE != 0 {
            let n = usize::from(i.u16()).min(64);
            for _ in 0..n {
                indirect.push((i.u64(), i.u32(), i.u16(), i.u16()));
                if i.is_empty() {
                    break;
                }
            }
        }
        Case { flags, capacity, header, payload, descs, indirect }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut o = Output::default();
        o.u8(self.flags).u64(self.capacity).bytes(&self.header);
        o.u16(self.payload.len() as u16).bytes(&self.payload);
        o.u16(self.descs.len() as u16);
        for &(a, l, f, n) in &self.descs {
            o.u64(a).u32(l).u16(f).u16(n);
        }
        if self.flags & F_QUEUE != 0 {
            o.u16(self.indirect.len() as u16);
            for &(a, l, f, n) in &self.indirect {
                o.u64(a).u32(l).u16(f).u16(n);
            }
        }
        o.buf
    }
}

/// A header: type, sector.
pub fn header(kind: u32, sector: u64) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&kind.to_le_bytes());
    h[8..].copy_from_slice(&sector.to_le_bytes());
    h
}

/// A DISCARD / WRITE_ZEROES segment.
pub fn segment(sector: u64, sectors: u32, flags: u32) -> Vec<u8> {
    let mut s = Vec::with_capacity(16);
    s.extend_from_slice(&sector.to_le_bytes());
    s.extend_from_slice(&sectors.to_le_bytes());
    s.extend_from_slice(&flags.to_le_bytes());
    s
}

/// Base device bytes: each 512-byte sector filled with its number mod 251.
#[derive(Debug)]
pub struct SectorPattern;

impl BlockDevice for SectorPattern {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        let mut at = offset;
        let mut rest = &mut buf[..];
        while !rest.is_empty() {
            let n = ((SECTOR_SIZE - at % SECTOR_SIZE) as usize).min(rest.len());
            let (head, tail) = rest.split_at_mut(n);
            head.fill(((at / SECTOR_SIZE) % 251) as u8);
            at += n as u64;
            rest = tail;
        }
        Ok(())
    }
}

fn memory(flags: u8) -> GuestMemoryMmap<()> {
    let mut ranges = vec![(GuestAddress(0), MEM_LEN as usize)];
    if flags & F_REGION2 != 0 {
        ranges.push((GuestAddress(REGION2), REGION2_LEN as usize));
    }
    GuestMemoryMmap::from_ranges(&ranges).unwrap()
}

fn desc((a, l, f, n): (u64, u32, u16, u16)) -> Descriptor {
    Descriptor::new(a, l, f, n)
}

/// Write `stream` into the device-readable descriptors in order, as far as they lie in memory
/// (what a driver does when it fills its buffers).
fn fill_readable(mem: &GuestMemoryMmap<()>, descs: &[Descriptor], stream: &[u8]) {
    let mut rest = stream;
    for d in descs.iter().filter(|d| !d.is_write_only()) {
        if rest.is_empty() {
            break;
        }
        let n = (d.len() as usize).min(rest.len());
        let _ = mem.write_slice(&rest[..n], d.addr());
        rest = &rest[n..];
    }
}

/// The fuzz target body.
pub fn run(data: &[u8]) {
    let case = Case::decode(data);
    let mem = memory(case.flags);
    let read_only = case.flags & F_READ_ONLY != 0;
    let capacity = case.capacity & !4095;

    // The chain, as the device sees it.
    let descs: Vec<Descriptor> = if case.flags & F_QUEUE != 0 {
        if case.descs.is_empty() {
            return;
        }
        for (i, &d) in case.indirect.iter().enumerate() {
            mem.write_obj(RawDescriptor::from(desc(d)), GuestAddress(INDIRECT + 16 * i as u64)).unwrap();
        }
        let q = MockSplitQueue::new(&mem, QUEUE_SIZE);
        let raw: Vec<RawDescriptor> = case.descs.iter().map(|&d| RawDescriptor::from(desc(d))).collect();
        let Ok(chain) = q.build_multiple_desc_chains(&raw) else { return };
        let head = chain.head_index();
        // The walk itself is bounded by the queue size (or the indirect table's length).
        let v: Vec<Descriptor> = chain.collect();
        // The daemon's own walker reads what virtio-queue's does.
        let fields = |d: &Descriptor| (d.addr().0, d.len(), d.flags(), d.next());
        let ours: Vec<Descriptor> = Walk::new(&mem, q.desc_table_addr(), QUEUE_SIZE, head).collect();
        assert_eq!(
            ours.iter().map(fields).collect::<Vec<_>>(),
            v.iter().map(fields).collect::<Vec<_>>(),
            "inflight::Walk and DescriptorChain disagree"
        );
        // (an indirect table holds at most 2^16 descriptors).
        assert!(v.len() <= usize::from(QUEUE_SIZE) + 65536, "chain walk not bounded: {}", v.len());
        v
    } else {
        case.descs.iter().map(|&d| desc(d)).collect()
    };

    let mut stream = case.header.to_vec();
    stream.extend_from_slice(&case.payload);
    fill_readable(&mem, &descs, &stream);

    let parsed = parse(descs.iter().copied(), &mem);
    let device = DeviceConfig::new(&ImageId(Sha256Digest::of(b"fuzz")), capacity, 1, read_only);
    let mut serve = case.flags & F_SERVE != 0;
    check_parse(&parsed, &descs, &mem, &device, &mut serve);

    if serve {
        let base: Arc<dyn BlockDevice> = Arc::new(SectorPattern);
        let disk = if read_only {
            Disk::Base(base)
        } else {
            let params = OverlayParams { image_id: device_id(), block_size: 4096, device_bytes: capacity };
            let o = Overlay::create(Box::new(MemIo::default()), params, base, OverlayMode::Volatile).unwrap();
            Disk::Overlay(Arc::new(o))
        };
        let c = serve_chain(descs.iter().copied(), &mem, &disk, &device, &mut Vec::new());
        match (&parsed, c.status) {
            (Parsed::Drop(_), None) => assert_eq!(c.used_len, 0),
            (Parsed::Drop(r), Some(s)) => panic!("dropped chain ({r}) got status {s:?}"),
            (Parsed::Reply { .. }, None) => panic!("a parsed chain got no status"),
            (Parsed::Reply { status, request }, Some(s)) => {
                let byte: u8 = mem.read_obj(*status).unwrap();
                assert_eq!(byte, s.byte(), "status byte in guest memory");
                let writable: u64 =
                    descs.iter().filter(|d| d.is_write_only()).map(|d| u64::from(d.len())).sum();
                assert!(u64::from(c.used_len) <= writable, "used {} > writable {writable}", c.used_len);
                if let (Ok(r), tessera_vhost::Status::Ok) = (request, s) {
                    if r.kind == RequestKind::In {
                        assert_eq!(u64::from(c.used_len), r.data_len + 1);
                    }
                }
            }
        }
    }
}

fn device_id() -> ImageId {
    ImageId(Sha256Digest::of(b"fuzz"))
}

fn in_memory(mem: &GuestMemoryMmap<()>, s: &GuestSeg) -> bool {
    s.len > 0 && mem.check_range(s.addr, s.len as usize, vm_memory::Permissions::Read)
}

/// Properties of `parse` and `plan` against a model built from the descriptors.
fn check_parse(
    parsed: &Parsed,
    descs: &[Descriptor],
    mem: &GuestMemoryMmap<()>,
    device: &DeviceConfig,
    serve: &mut bool,
) {
    let Parsed::Reply { status, request } = parsed else { return };
    assert!(mem.check_range(*status, 1, vm_memory::Permissions::Write), "status outside memory");
    let req = match request {
        Ok(r) => r.clone(),
        Err(e) => {
            // Every error maps to a status; a refused chain is cheap to serve.
            let _ = e.status();
            return;
        }
    };
    assert!(descs.len() <= MAX_DESCRIPTORS, "{} descriptors accepted", descs.len());
    let readable: Vec<&Descriptor> = descs.iter().filter(|d| !d.is_write_only()).collect();
    let writable: Vec<&Descriptor> = descs.iter().filter(|d| d.is_write_only()).collect();
    assert!(
        descs
            .iter()
            .position(|d| d.is_write_only())
            .is_none_or(|w| descs[w..].iter().all(|d| d.is_write_only())),
        "readable after writable accepted"
    );
    let readable_len: u64 = readable.iter().map(|d| u64::from(d.len())).sum();
    let writable_len: u64 = writable.iter().map(|d| u64::from(d.len())).sum();
    // The status is the last byte of the last non-empty writable descriptor.
    let last = writable.iter().rev().find(|d| d.len() > 0).expect("a status without writable bytes");
    assert_eq!(status.0, last.addr().0 + u64::from(last.len()) - 1);
    // The header the guest wrote (every readable buffer is in memory, so read it back).
    let mut bytes = Vec::new();
    for d in &readable {
        let want = (32 - bytes.len()).min(d.len() as usize);
        let mut b = vec![0u8; want];
        mem.read_slice(&mut b, d.addr()).unwrap();
        bytes.extend_from_slice(&b);
        if bytes.len() >= 32 {
            break;
        }
    }
    assert!(bytes.len() >= HEADER_LEN as usize);
    let sector = u64::from_le_bytes(bytes[8..16].try_into().unwrap());
    assert_eq!(req.sector, sector, "sector differs from the header");
    let data_len: u64 = req.data.iter().map(|s| u64::from(s.len)).sum();
    assert_eq!(data_len, req.data_len);
    for s in &req.data {
        assert!(in_memory(mem, s), "data segment {s:?} empty or outside guest memory");
    }
    match &req.kind {
        RequestKind::In | RequestKind::GetId => {
            assert_eq!(req.data_len, writable_len - 1);
            for s in &req.data {
                assert!(
                    writable.iter().any(|d| d.addr().0 <= s.addr.0
                        && s.addr.0 + u64::from(s.len) <= d.addr().0 + u64::from(d.len())),
                    "IN data {s:?} is not inside a writable descriptor"
                );
            }
        }
        RequestKind::Out => assert_eq!(req.data_len, readable_len - HEADER_LEN),
        RequestKind::Flush => assert!(req.data.is_empty()),
        RequestKind::Discard(r) | RequestKind::WriteZeroes(r) => {
            assert!(req.data.is_empty());
            assert_eq!((readable_len - HEADER_LEN) / 16, r.len() as u64);
            assert!(r.len() == 1, "max_discard_seg is 1");
            if bytes.len() >= 32 {
                let s = u64::from_le_bytes(bytes[16..24].try_into().unwrap());
                let n = u32::from_le_bytes(bytes[24..28].try_into().unwrap());
                assert_eq!((r[0].sector, r[0].sectors), (s, n), "discard segment differs from the guest's");
            }
        }
    }
    if matches!(req.kind, RequestKind::In | RequestKind::Out) {
        assert_eq!(req.data_len % SECTOR_SIZE, 0);
    }
    if req.data_len > SERVE_MAX {
        *serve = false;
    }

    let cap = device.capacity_sectors();
    let fits = |sector: u64, sectors: u64| sector.checked_add(sectors).is_some_and(|e| e <= cap);
    let kind = req.kind.clone();
    let (sector, data_len) = (req.sector, req.data_len);
    match (plan(req, device), kind) {
        (Ok(Plan::Read { offset, len, data }), RequestKind::In) => {
            assert!(fits(sector, data_len / SECTOR_SIZE));
            assert_eq!((offset, len), (sector * SECTOR_SIZE, data_len));
            assert_eq!(data.iter().map(|s| u64::from(s.len)).sum::<u64>(), len);
        }
        (Ok(Plan::Write { offset, len, .. }), RequestKind::Out) => {
            assert!(!device.read_only);
            assert!(offset.checked_add(len).is_some_and(|e| e <= device.capacity_bytes));
        }
        (Ok(Plan::Zeroes { ranges }), RequestKind::Discard(r) | RequestKind::WriteZeroes(r)) => {
            assert!(!device.read_only);
            assert_eq!(ranges.len(), r.len());
            for (o, l) in ranges {
                assert!(o.checked_add(l).is_some_and(|e| e <= device.capacity_bytes));
            }
        }
        (Ok(Plan::GetId { .. }), RequestKind::GetId) | (Ok(Plan::Flush), RequestKind::Flush) => {}
        (Ok(p), k) => panic!("{k:?} planned as {p:?}"),
        (Err(RequestError::ReadOnly), k) => {
            assert!(
                device.read_only
                    && matches!(k, RequestKind::Out | RequestKind::Discard(_) | RequestKind::WriteZeroes(_))
            )
        }
        (Err(RequestError::OutOfRange { .. }), k) => match k {
            RequestKind::In | RequestKind::Out => assert!(!fits(sector, data_len / SECTOR_SIZE)),
            RequestKind::Discard(r) | RequestKind::WriteZeroes(r) => {
                assert!(r.iter().any(|r| !fits(r.sector, u64::from(r.sectors))))
            }
            k => panic!("{k:?} out of range"),
        },
        (Err(e), k) => panic!("plan({k:?}) failed with {e}"),
    }
}
