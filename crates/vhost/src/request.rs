//! Parse a virtio-blk descriptor chain into a typed [`Request`].
//!
//! Pure apart from reading the request header (and DISCARD / WRITE_ZEROES segments) out of guest
//! memory through the bounds-checked `Bytes` API. It enforces the spec's MUSTs that the device
//! relies on and never trusts a guest-supplied number: every length sum is checked, every buffer
//! must lie inside guest memory, device-readable descriptors must precede device-writable ones.
//!
//! The chain is handled as the spec's `VIRTIO_F_VERSION_1` layout-independent form: the
//! device-readable bytes are `header (16) | data…` and the device-writable bytes are
//! `data… | status (1)`, however the driver cut them into descriptors.

use virtio_bindings::bindings::virtio_blk::{
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{GuestAddress, GuestMemory, Permissions};

use crate::error::{DropReason, RequestError};

/// Bytes in a sector, the unit of every virtio-blk address.
pub const SECTOR_SIZE: u64 = 512;
/// Size of `struct virtio_blk_outhdr`.
pub const HEADER_LEN: u64 = 16;
/// Size of one `struct virtio_blk_discard_write_zeroes`.
pub const DISCARD_SEGMENT_LEN: u64 = 16;
/// Most data descriptors in one request (advertised as `seg_max`).
pub const SEG_MAX: u32 = 254;
/// Most descriptors in one chain: `seg_max` data descriptors, the header and the status.
pub const MAX_DESCRIPTORS: usize = SEG_MAX as usize + 2;
/// Most DISCARD / WRITE_ZEROES segments in one request (advertised as `max_discard_seg`).
pub const MAX_DISCARD_SEGMENTS: u32 = 1;

/// A buffer in guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestSeg {
    pub addr: GuestAddress,
    pub len: u32,
}

/// One range of a DISCARD or WRITE_ZEROES request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiscardRange {
    pub sector: u64,
    pub sectors: u32,
    /// Only for WRITE_ZEROES: the device may deallocate the range.
    pub unmap: bool,
}

/// What the request asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestKind {
    /// Read `data` (device-writable) from `sector`.
    In,
    /// Write `data` (device-readable) at `sector`.
    Out,
    Flush,
    /// Write the serial into `data` (device-writable).
    GetId,
    Discard(Vec<DiscardRange>),
    WriteZeroes(Vec<DiscardRange>),
}

/// A parsed request. `data` holds the payload buffers only (never the header or the status byte).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub kind: RequestKind,
    pub sector: u64,
    pub data: Vec<GuestSeg>,
    /// Total bytes of `data` (fits in u32: a chain is at most 2^32 bytes).
    pub data_len: u64,
}

/// The outcome of parsing: either a request (or an error) that can be answered through the
/// status byte, or a chain so broken that it has no status byte to write; such a chain is
/// returned to the driver with a used length of 0 and nothing written.
#[derive(Debug, Clone)]
pub enum Parsed {
    Reply { status: GuestAddress, request: Result<Request, RequestError> },
    Drop(DropReason),
}

/// Parse the descriptors of one chain (already walked, indirect tables resolved).
///
/// One allocation per request: the descriptors go into one list (device-readable ones first),
/// which then becomes the request's `data` in place.
pub fn parse<M: GuestMemory + ?Sized>(descs: impl IntoIterator<Item = Descriptor>, mem: &M) -> Parsed {
    // `segs[..readable]` are the device-readable descriptors, the rest the device-writable ones.
    // Four covers the usual chain (header, one or two data buffers, status) without growing.
    let mut segs: Vec<GuestSeg> = Vec::with_capacity(4);
    let mut readable = 0usize;
    let mut readable_len: u64 = 0;
    let mut writable_len: u64 = 0;
    let mut order_error = false;
    let mut count = 0usize;
    // Past the limit only the last non-empty writable descriptor is kept: it holds the status
    // byte used to refuse the chain. The walk itself is bounded by the queue (or indirect table)
    // size.
    let mut tail: Option<GuestSeg> = None;
    for d in descs {
        count += 1;
        let seg = GuestSeg { addr: d.addr(), len: d.len() };
        if count > MAX_DESCRIPTORS {
            if d.is_write_only() && seg.len > 0 {
                tail = Some(seg);
            }
            continue;
        }
        if d.is_write_only() {
            writable_len += u64::from(seg.len);
            segs.push(seg);
        } else if segs.len() > readable {
            // Refused below; what it points at no longer matters.
            order_error = true;
        } else {
            readable_len += u64::from(seg.len);
            segs.push(seg);
            readable += 1;
        }
    }

    // The status byte: the last byte of the device-writable part.
    let Some(status) = last_byte(tail.as_slice()).or_else(|| last_byte(&segs[readable..])) else {
        return Parsed::Drop(DropReason::NoStatus);
    };
    if !mem.check_range(status, 1, Permissions::Write) {
        return Parsed::Drop(DropReason::StatusOutsideMemory);
    }
    let request = if count > MAX_DESCRIPTORS {
        Err(RequestError::TooManyDescriptors { max: MAX_DESCRIPTORS })
    } else if order_error {
        Err(RequestError::ReadableAfterWritable)
    } else {
        request(mem, segs, readable, readable_len, writable_len)
    };
    Parsed::Reply { status, request }
}

/// The request of a well-ordered chain: `segs[..readable]` device-readable (`readable_len`
/// bytes), the rest device-writable (`writable_len` bytes, the status byte last).
fn request<M: GuestMemory + ?Sized>(
    mem: &M,
    segs: Vec<GuestSeg>,
    readable: usize,
    readable_len: u64,
    writable_len: u64,
) -> Result<Request, RequestError> {
    for s in &segs {
        if !mem.check_range(s.addr, s.len as usize, Permissions::Read) {
            return Err(RequestError::OutsideMemory { addr: s.addr.0, len: s.len });
        }
    }
    if readable_len < HEADER_LEN {
        return Err(RequestError::HeaderTooShort { len: readable_len });
    }
    let mut header = [0u8; HEADER_LEN as usize];
    read_stream(mem, &segs[..readable], 0, &mut header)?;
    let kind = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    let sector = u64::from_le_bytes([
        header[8], header[9], header[10], header[11], header[12], header[13], header[14], header[15],
    ]);
    // The data buffers, cut out of `segs` in place: the writable bytes but the status byte, or
    // the readable bytes after the header.
    let in_data = |mut segs: Vec<GuestSeg>| {
        cut_in_place(&mut segs, readable, 0, writable_len - 1);
        segs
    };
    let out_data = |mut segs: Vec<GuestSeg>| {
        segs.truncate(readable);
        cut_in_place(&mut segs, 0, HEADER_LEN, readable_len - HEADER_LEN);
        segs
    };
    let (kind, data) = match kind {
        VIRTIO_BLK_T_IN => (RequestKind::In, in_data(segs)),
        VIRTIO_BLK_T_OUT => (RequestKind::Out, out_data(segs)),
        VIRTIO_BLK_T_FLUSH => (RequestKind::Flush, Vec::new()),
        VIRTIO_BLK_T_GET_ID => (RequestKind::GetId, in_data(segs)),
        VIRTIO_BLK_T_DISCARD => {
            let ranges = discard_ranges(mem, &segs[..readable], readable_len, false)?;
            (RequestKind::Discard(ranges), Vec::new())
        }
        VIRTIO_BLK_T_WRITE_ZEROES => {
            let ranges = discard_ranges(mem, &segs[..readable], readable_len, true)?;
            (RequestKind::WriteZeroes(ranges), Vec::new())
        }
        other => return Err(RequestError::Unsupported { kind: other }),
    };
    let data_len = data.iter().map(|s| u64::from(s.len)).sum::<u64>();
    if matches!(kind, RequestKind::In | RequestKind::Out) && data_len % SECTOR_SIZE != 0 {
        return Err(RequestError::UnalignedLength { len: data_len });
    }
    Ok(Request { kind, sector, data, data_len })
}

/// The address of the last byte of a list of segments, skipping empty ones.
fn last_byte(segs: &[GuestSeg]) -> Option<GuestAddress> {
    let s = segs.iter().rev().find(|s| s.len > 0)?;
    s.addr.0.checked_add(u64::from(s.len) - 1).map(GuestAddress)
}

/// The part of `seg`, which starts at stream byte `at`, inside stream bytes `[start, end)`, if
/// any.
fn piece(seg: &GuestSeg, at: u64, start: u64, end: u64) -> Option<GuestSeg> {
    let lo = at.max(start);
    let hi = (at + u64::from(seg.len)).min(end);
    // lo - at < seg.len and hi - lo <= seg.len, so both fit in u32; the address was checked to
    // lie in guest memory, so it cannot overflow.
    (lo < hi).then(|| GuestSeg {
        addr: GuestAddress(seg.addr.0 + (lo - at)),
        len: u32::try_from(hi - lo).unwrap_or(u32::MAX),
    })
}

/// Keep, in place, the pieces of `segs[from..]` covering its stream bytes `[start, start +
/// len)`, without empty pieces; everything else goes.
fn cut_in_place(segs: &mut Vec<GuestSeg>, from: usize, start: u64, len: u64) {
    let end = start + len;
    let mut at = 0u64;
    let mut kept = 0usize;
    for i in from..segs.len() {
        let s = segs[i];
        if let Some(p) = piece(&s, at, start, end) {
            // kept <= i - from <= i: the slot written was read already.
            segs[kept] = p;
            kept += 1;
        }
        at += u64::from(s.len);
    }
    segs.truncate(kept);
}

/// Read stream bytes `[start, start + buf.len())` of `segs` from guest memory.
fn read_stream<M: GuestMemory + ?Sized>(
    mem: &M,
    segs: &[GuestSeg],
    start: u64,
    buf: &mut [u8],
) -> Result<(), RequestError> {
    let end = start + buf.len() as u64;
    let mut at = 0u64;
    let mut done = 0usize;
    for s in segs {
        if let Some(p) = piece(s, at, start, end) {
            let n = p.len as usize;
            if !crate::guest::read(mem, p.addr, &mut buf[done..done + n]) {
                return Err(RequestError::OutsideMemory { addr: p.addr.0, len: p.len });
            }
            done += n;
        }
        at += u64::from(s.len);
        if at >= end {
            break;
        }
    }
    Ok(())
}

fn discard_ranges<M: GuestMemory + ?Sized>(
    mem: &M,
    readable: &[GuestSeg],
    readable_len: u64,
    write_zeroes: bool,
) -> Result<Vec<DiscardRange>, RequestError> {
    let payload = readable_len - HEADER_LEN;
    if payload == 0 || payload % DISCARD_SEGMENT_LEN != 0 {
        return Err(RequestError::BadDiscardPayload { len: payload });
    }
    let n = payload / DISCARD_SEGMENT_LEN;
    if n > u64::from(MAX_DISCARD_SEGMENTS) {
        return Err(RequestError::TooManyDiscardSegments { count: n, max: MAX_DISCARD_SEGMENTS });
    }
    let mut out = Vec::with_capacity(n as usize);
    for i in 0..n {
        let mut b = [0u8; DISCARD_SEGMENT_LEN as usize];
        read_stream(mem, readable, HEADER_LEN + i * DISCARD_SEGMENT_LEN, &mut b)?;
        let sector = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
        let sectors = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        let flags = u32::from_le_bytes([b[12], b[13], b[14], b[15]]);
        let allowed = if write_zeroes { VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP } else { 0 };
        if flags & !allowed != 0 {
            return Err(RequestError::BadDiscardFlags { flags });
        }
        out.push(DiscardRange { sector, sectors, unmap: flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0 });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use virtio_bindings::bindings::virtio_ring::VRING_DESC_F_WRITE;
    use vm_memory::{Bytes, GuestMemoryMmap};

    use super::*;

    #[test]
    fn cut_spans_segments() {
        let segs = vec![
            GuestSeg { addr: GuestAddress(0x1000), len: 10 },
            GuestSeg { addr: GuestAddress(0x2000), len: 0 },
            GuestSeg { addr: GuestAddress(0x3000), len: 20 },
        ];
        let cut = |from, start, len| {
            let mut v = segs.clone();
            cut_in_place(&mut v, from, start, len);
            v
        };
        assert_eq!(
            cut(0, 5, 10),
            vec![
                GuestSeg { addr: GuestAddress(0x1005), len: 5 },
                GuestSeg { addr: GuestAddress(0x3000), len: 5 }
            ]
        );
        assert_eq!(cut(0, 30, 0), vec![]);
        assert_eq!(cut(1, 0, 19), vec![GuestSeg { addr: GuestAddress(0x3000), len: 19 }]);
        assert_eq!(cut(2, 1, 19), vec![GuestSeg { addr: GuestAddress(0x3001), len: 19 }]);
        assert_eq!(last_byte(&segs), Some(GuestAddress(0x3000 + 19)));
        assert_eq!(last_byte(&segs[1..2]), None);
    }

    /// The parser as it was before it kept one list and cut the data out of it in place
    /// (four allocations per request): the oracle of `parse_matches_the_allocating_parser`.
    #[allow(clippy::type_complexity)]
    fn old_parse<M: GuestMemory + ?Sized>(descs: impl IntoIterator<Item = Descriptor>, mem: &M) -> Parsed {
        let mut readable: Vec<GuestSeg> = Vec::new();
        let mut writable: Vec<GuestSeg> = Vec::new();
        let mut readable_len: u64 = 0;
        let mut writable_len: u64 = 0;
        let mut order_error = false;
        let mut count = 0usize;
        // Past the limit only the last non-empty writable descriptor is kept: it holds the status
        // byte used to refuse the chain. The walk itself is bounded by the queue (or indirect table)
        // size.
        let mut tail: Option<GuestSeg> = None;
        for d in descs {
            count += 1;
            let seg = GuestSeg { addr: d.addr(), len: d.len() };
            if count > MAX_DESCRIPTORS {
                if d.is_write_only() && seg.len > 0 {
                    tail = Some(seg);
                }
                continue;
            }
            if d.is_write_only() {
                writable_len += u64::from(seg.len);
                writable.push(seg);
            } else {
                if !writable.is_empty() {
                    order_error = true;
                }
                readable_len += u64::from(seg.len);
                readable.push(seg);
            }
        }

        // The status byte: the last byte of the device-writable part.
        let Some(status) = last_byte(tail.as_slice()).or_else(|| last_byte(&writable)) else {
            return Parsed::Drop(DropReason::NoStatus);
        };
        if !mem.check_range(status, 1, Permissions::Write) {
            return Parsed::Drop(DropReason::StatusOutsideMemory);
        }
        let request = (|| {
            if count > MAX_DESCRIPTORS {
                return Err(RequestError::TooManyDescriptors { max: MAX_DESCRIPTORS });
            }
            if order_error {
                return Err(RequestError::ReadableAfterWritable);
            }
            for s in readable.iter().chain(&writable) {
                if !mem.check_range(s.addr, s.len as usize, Permissions::Read) {
                    return Err(RequestError::OutsideMemory { addr: s.addr.0, len: s.len });
                }
            }
            if readable_len < HEADER_LEN {
                return Err(RequestError::HeaderTooShort { len: readable_len });
            }
            let mut header = [0u8; HEADER_LEN as usize];
            old_read_stream(mem, &readable, 0, &mut header)?;
            let kind = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
            let sector = u64::from_le_bytes([
                header[8], header[9], header[10], header[11], header[12], header[13], header[14], header[15],
            ]);
            let out_data = || old_cut(&readable, HEADER_LEN, readable_len - HEADER_LEN);
            let in_data = || old_cut(&writable, 0, writable_len - 1);
            let (kind, data) = match kind {
                VIRTIO_BLK_T_IN => (RequestKind::In, in_data()),
                VIRTIO_BLK_T_OUT => (RequestKind::Out, out_data()),
                VIRTIO_BLK_T_FLUSH => (RequestKind::Flush, Vec::new()),
                VIRTIO_BLK_T_GET_ID => (RequestKind::GetId, in_data()),
                VIRTIO_BLK_T_DISCARD => {
                    let ranges = discard_ranges(mem, &readable, readable_len, false)?;
                    (RequestKind::Discard(ranges), Vec::new())
                }
                VIRTIO_BLK_T_WRITE_ZEROES => {
                    let ranges = discard_ranges(mem, &readable, readable_len, true)?;
                    (RequestKind::WriteZeroes(ranges), Vec::new())
                }
                other => return Err(RequestError::Unsupported { kind: other }),
            };
            let data_len = data.iter().map(|s| u64::from(s.len)).sum::<u64>();
            if matches!(kind, RequestKind::In | RequestKind::Out) && data_len % SECTOR_SIZE != 0 {
                return Err(RequestError::UnalignedLength { len: data_len });
            }
            Ok(Request { kind, sector, data, data_len })
        })();
        Parsed::Reply { status, request }
    }

    fn old_cut(segs: &[GuestSeg], start: u64, len: u64) -> Vec<GuestSeg> {
        let mut out = Vec::new();
        let mut pos = 0u64;
        let end = start + len;
        for s in segs {
            let (a, b) = (pos, pos + u64::from(s.len));
            pos = b;
            let lo = a.max(start);
            let hi = b.min(end);
            if lo < hi {
                // lo - a < s.len and hi - lo <= s.len, so both fit in u32; the address was checked
                // to lie in guest memory, so it cannot overflow.
                out.push(GuestSeg {
                    addr: GuestAddress(s.addr.0 + (lo - a)),
                    len: u32::try_from(hi - lo).unwrap_or(u32::MAX),
                });
            }
        }
        out
    }

    fn old_read_stream<M: GuestMemory + ?Sized>(
        mem: &M,
        segs: &[GuestSeg],
        start: u64,
        buf: &mut [u8],
    ) -> Result<(), RequestError> {
        let mut done = 0usize;
        for s in old_cut(segs, start, buf.len() as u64) {
            let n = s.len as usize;
            mem.read_slice(&mut buf[done..done + n], s.addr)
                .map_err(|_| RequestError::OutsideMemory { addr: s.addr.0, len: s.len })?;
            done += n;
        }
        Ok(())
    }

    /// `parse` gives what the parser it replaced gave, requests and errors alike, on random
    /// chains: headers of every kind and odd ones, buffers split anywhere, empty buffers,
    /// readable after writable, buffers outside memory or across a hole between two regions,
    /// chains past the descriptor limit.
    #[test]
    fn parse_matches_the_allocating_parser() {
        const MEM: u64 = 1 << 20;
        let mem = GuestMemoryMmap::<()>::from_ranges(&[
            (GuestAddress(0), MEM as usize),
            (GuestAddress(MEM + 0x1000), 0x10000),
        ])
        .expect("memory");
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let kinds = [
            VIRTIO_BLK_T_IN,
            VIRTIO_BLK_T_OUT,
            VIRTIO_BLK_T_FLUSH,
            VIRTIO_BLK_T_GET_ID,
            VIRTIO_BLK_T_DISCARD,
            VIRTIO_BLK_T_WRITE_ZEROES,
            77,
        ];
        let mut replies = 0usize;
        let mut oks = 0usize;
        for case in 0..20_000u32 {
            // The header's bytes at 0x100: a kind, a sector; a discard segment after it.
            let kind = kinds[rng.gen_range(0..kinds.len())];
            let mut bytes = [0u8; 32];
            bytes[..4].copy_from_slice(&kind.to_le_bytes());
            bytes[8..16].copy_from_slice(&rng.gen_range(0u64..1 << 20).to_le_bytes());
            bytes[16..24].copy_from_slice(&rng.gen_range(0u64..1 << 20).to_le_bytes());
            bytes[24..28].copy_from_slice(&rng.gen_range(1u32..64).to_le_bytes());
            bytes[28..32].copy_from_slice(&rng.gen_range(0u32..3).to_le_bytes());
            mem.write_slice(&bytes, GuestAddress(0x100)).expect("header");
            let mut descs = Vec::new();
            let n = if case % 97 == 0 { MAX_DESCRIPTORS + rng.gen_range(1..4) } else { rng.gen_range(0..7) };
            let readable = rng.gen_range(0..=n.min(3));
            let mut header_at = 0x100u64;
            for i in 0..n {
                let write = i >= readable || rng.gen_ratio(1, 40);
                let arm = if write && i + 1 == n && rng.gen_bool(0.6) { 8 } else { rng.gen_range(0..12) };
                let (addr, len) = match arm {
                    // The header's bytes, in pieces.
                    0..=3 if !write => {
                        let len = rng.gen_range(0..=24u32);
                        let at = header_at;
                        header_at += u64::from(len);
                        (at, len)
                    }
                    4 => (0x8000, 0),
                    5 => (MEM - rng.gen_range(0..0x2000u64), rng.gen_range(1..0x3000u32)),
                    6 => (MEM + 0x1000 + rng.gen_range(0..0x10000u64), rng.gen_range(1..0x1000u32)),
                    7 if case % 5 == 0 => {
                        (u64::MAX - rng.gen_range(0..0x100u64), rng.gen_range(1..0x1000u32))
                    }
                    8 => (0x2_0000, 1),
                    _ => (
                        0x1_0000 + rng.gen_range(0..64u64) * 512,
                        rng.gen_range(0..16u32) * 512 + u32::from(rng.gen_ratio(1, 8)),
                    ),
                };
                let flags = if write { VRING_DESC_F_WRITE as u16 } else { 0 };
                descs.push(Descriptor::new(addr, len, flags, 0));
            }
            let new = format!("{:?}", parse(descs.clone(), &mem));
            let old = format!("{:?}", old_parse(descs.clone(), &mem));
            assert_eq!(new, old, "case {case}: {descs:?}");
            replies += usize::from(new.starts_with("Reply"));
            oks += usize::from(new.contains("request: Ok"));
        }
        // The cases reach every outcome, not only the refusals.
        assert!(replies > 10_000 && oks > 1_500, "{replies} replies, {oks} requests");
    }
}
