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
use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions};

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
pub fn parse<M: GuestMemory + ?Sized>(descs: impl IntoIterator<Item = Descriptor>, mem: &M) -> Parsed {
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
        read_stream(mem, &readable, 0, &mut header)?;
        let kind = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
        let sector = u64::from_le_bytes([
            header[8], header[9], header[10], header[11], header[12], header[13], header[14], header[15],
        ]);
        let out_data = || cut(&readable, HEADER_LEN, readable_len - HEADER_LEN);
        let in_data = || cut(&writable, 0, writable_len - 1);
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

/// The address of the last byte of a list of segments, skipping empty ones.
fn last_byte(segs: &[GuestSeg]) -> Option<GuestAddress> {
    let s = segs.iter().rev().find(|s| s.len > 0)?;
    s.addr.0.checked_add(u64::from(s.len) - 1).map(GuestAddress)
}

/// The sub-list of `segs` covering stream bytes `[start, start + len)`, without empty pieces.
fn cut(segs: &[GuestSeg], start: u64, len: u64) -> Vec<GuestSeg> {
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

/// Read stream bytes `[start, start + buf.len())` of `segs` from guest memory.
fn read_stream<M: GuestMemory + ?Sized>(
    mem: &M,
    segs: &[GuestSeg],
    start: u64,
    buf: &mut [u8],
) -> Result<(), RequestError> {
    let mut done = 0usize;
    for s in cut(segs, start, buf.len() as u64) {
        let n = s.len as usize;
        mem.read_slice(&mut buf[done..done + n], s.addr)
            .map_err(|_| RequestError::OutsideMemory { addr: s.addr.0, len: s.len })?;
        done += n;
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
    use super::*;

    #[test]
    fn cut_spans_segments() {
        let segs = [
            GuestSeg { addr: GuestAddress(0x1000), len: 10 },
            GuestSeg { addr: GuestAddress(0x2000), len: 0 },
            GuestSeg { addr: GuestAddress(0x3000), len: 20 },
        ];
        assert_eq!(
            cut(&segs, 5, 10),
            vec![
                GuestSeg { addr: GuestAddress(0x1005), len: 5 },
                GuestSeg { addr: GuestAddress(0x3000), len: 5 }
            ]
        );
        assert_eq!(cut(&segs, 30, 0), vec![]);
        assert_eq!(last_byte(&segs), Some(GuestAddress(0x3000 + 19)));
        assert_eq!(last_byte(&segs[1..2]), None);
    }
}
