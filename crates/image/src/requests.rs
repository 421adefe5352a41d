//! Request traces (`tessera serve --record-requests FILE`): every virtio-blk request the daemon
//! answered, with its queue, type, range, issue and completion times and status, as fixed-size
//! little-endian records after a versioned header. Pure encode/decode; the recorder that writes
//! the file lives in `tessera-vhost`, the replayer in the e2e harness. Format:
//! `docs/formats/requests.md`.

use crate::codec::Reader;
use crate::digest::{ImageId, Sha256Digest};
use crate::error::DecodeError;

const WHAT: &str = "request trace";
/// The file's first 8 bytes.
pub const REQUEST_TRACE_MAGIC: [u8; 8] = *b"TESSREQ\0";
/// The version this code writes and reads.
pub const REQUEST_TRACE_VERSION: u32 = 1;
/// Bytes of the header.
pub const REQUEST_HEADER_LEN: usize = 72;
/// Bytes of one record.
pub const REQUEST_RECORD_LEN: usize = 40;
/// The header's record count while the recording is still being written (rewritten with the
/// real count when it finishes).
pub const REQUEST_TRACE_UNFINISHED: u64 = u64::MAX;

/// What a request was (its virtio-blk type; the codes are the spec's where it has one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestOp {
    Read,
    Write,
    Flush,
    GetId,
    Discard,
    WriteZeroes,
    /// A type code the device does not implement.
    Unsupported,
    /// A chain refused before its type was accepted, or dropped without a status byte.
    Invalid,
}

impl RequestOp {
    /// The code stored in a record.
    pub fn code(self) -> u8 {
        match self {
            RequestOp::Read => 0,
            RequestOp::Write => 1,
            RequestOp::Flush => 4,
            RequestOp::GetId => 8,
            RequestOp::Discard => 11,
            RequestOp::WriteZeroes => 13,
            RequestOp::Unsupported => 0xfe,
            RequestOp::Invalid => 0xff,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => RequestOp::Read,
            1 => RequestOp::Write,
            4 => RequestOp::Flush,
            8 => RequestOp::GetId,
            11 => RequestOp::Discard,
            13 => RequestOp::WriteZeroes,
            0xfe => RequestOp::Unsupported,
            0xff => RequestOp::Invalid,
            _ => return None,
        })
    }

    /// Whether replaying the request changes the device.
    pub fn modifies(self) -> bool {
        matches!(self, RequestOp::Write | RequestOp::Discard | RequestOp::WriteZeroes)
    }
}

/// How a request completed: the virtio status byte written, or none for a dropped chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestStatus {
    Ok,
    IoErr,
    Unsupp,
    /// Returned to the driver with nothing written (no status byte).
    Dropped,
}

impl RequestStatus {
    /// The code stored in a record (the virtio status byte; 0xff for a dropped chain).
    pub fn code(self) -> u8 {
        match self {
            RequestStatus::Ok => 0,
            RequestStatus::IoErr => 1,
            RequestStatus::Unsupp => 2,
            RequestStatus::Dropped => 0xff,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => RequestStatus::Ok,
            1 => RequestStatus::IoErr,
            2 => RequestStatus::Unsupp,
            0xff => RequestStatus::Dropped,
            _ => return None,
        })
    }
}

/// One request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestRecord {
    /// The virtqueue it came on.
    pub queue: u16,
    pub op: RequestOp,
    pub status: RequestStatus,
    /// First 512-byte sector (DISCARD / WRITE_ZEROES: of the range; FLUSH: 0).
    pub sector: u64,
    /// Bytes: of the data buffers (read, write, get-id) or of the range (discard, write-zeroes).
    pub len: u64,
    /// When the daemon took it off the ring, ns since the recording started.
    pub issued_ns: u64,
    /// When it was completed (status written), ns since the recording started.
    pub completed_ns: u64,
}

impl RequestRecord {
    /// The record's bytes.
    pub fn encode(&self) -> [u8; REQUEST_RECORD_LEN] {
        let mut b = [0u8; REQUEST_RECORD_LEN];
        b[0..8].copy_from_slice(&self.sector.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..24].copy_from_slice(&self.issued_ns.to_le_bytes());
        b[24..32].copy_from_slice(&self.completed_ns.to_le_bytes());
        b[32..34].copy_from_slice(&self.queue.to_le_bytes());
        b[34] = self.op.code();
        b[35] = self.status.code();
        // 36..40 reserved, zero.
        b
    }

    fn decode(r: &mut Reader<'_>, queues: u16) -> Result<Self, DecodeError> {
        let sector = r.u64()?;
        let len = r.u64()?;
        let issued_ns = r.u64()?;
        let completed_ns = r.u64()?;
        let queue = u16::from_le_bytes(r.array()?);
        let op = RequestOp::from_code(r.u8()?).ok_or(r.not_canonical("op", "unknown request type code"))?;
        let status =
            RequestStatus::from_code(r.u8()?).ok_or(r.not_canonical("status", "unknown status code"))?;
        if r.u32()? != 0 {
            return Err(r.not_canonical("reserved", "must be zero"));
        }
        if queue >= queues {
            return Err(r.not_canonical("queue", "not below the header's queue count"));
        }
        if completed_ns < issued_ns {
            return Err(r.not_canonical("completed_ns", "before issued_ns"));
        }
        if sector.checked_mul(512).and_then(|b| b.checked_add(len)).is_none() {
            return Err(r.not_canonical("len", "the range overflows 64 bits"));
        }
        Ok(Self { queue, op, status, sector, len, issued_ns, completed_ns })
    }
}

/// What a trace was recorded on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestTraceHeader {
    /// The image served.
    pub image: ImageId,
    /// The device's size in bytes.
    pub device_bytes: u64,
    /// Virtqueues the device offered.
    pub queues: u16,
    /// Whether the device refused writes.
    pub read_only: bool,
}

impl RequestTraceHeader {
    /// The header's bytes, with `records` as the record count ([`REQUEST_TRACE_UNFINISHED`] while recording).
    pub fn encode(&self, records: u64) -> [u8; REQUEST_HEADER_LEN] {
        let mut b = [0u8; REQUEST_HEADER_LEN];
        b[0..8].copy_from_slice(&REQUEST_TRACE_MAGIC);
        b[8..12].copy_from_slice(&REQUEST_TRACE_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(REQUEST_RECORD_LEN as u32).to_le_bytes());
        b[16..24].copy_from_slice(&records.to_le_bytes());
        b[24..32].copy_from_slice(&self.device_bytes.to_le_bytes());
        b[32..34].copy_from_slice(&self.queues.to_le_bytes());
        b[34] = u8::from(self.read_only);
        // 35..40 reserved, zero.
        b[40..72].copy_from_slice(&self.image.0 .0);
        b
    }
}

/// A whole recorded trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestTrace {
    pub header: RequestTraceHeader,
    /// In the order the recorder wrote them (about completion order; not sorted).
    pub records: Vec<RequestRecord>,
}

impl RequestTrace {
    /// The file's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(REQUEST_HEADER_LEN + self.records.len() * REQUEST_RECORD_LEN);
        out.extend_from_slice(&self.header.encode(self.records.len() as u64));
        for r in &self.records {
            out.extend_from_slice(&r.encode());
        }
        out
    }

    /// Decode a whole file. Strict: another magic, a newer (or older) version, another record
    /// size, an unfinished recording, fewer or more bytes than the record count says, unknown
    /// codes, non-zero reserved bytes, a queue the device did not offer, a completion before its
    /// issue are all errors.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(bytes, WHAT);
        r.header(&REQUEST_TRACE_MAGIC, REQUEST_TRACE_VERSION)?;
        if r.u32()? as usize != REQUEST_RECORD_LEN {
            return Err(r.not_canonical("record_len", "not the record size of version 1 (40)"));
        }
        let count = r.u64()?;
        if count == REQUEST_TRACE_UNFINISHED {
            return Err(r.not_canonical(
                "records",
                "the recording was not finished (the daemon did not exit cleanly)",
            ));
        }
        let device_bytes = r.u64()?;
        let queues = u16::from_le_bytes(r.array()?);
        let read_only = match r.u8()? {
            0 => false,
            1 => true,
            _ => return Err(r.not_canonical("read_only", "must be 0 or 1")),
        };
        if r.array::<5>()? != [0; 5] {
            return Err(r.not_canonical("reserved", "must be zero"));
        }
        let image = ImageId(Sha256Digest(r.array()?));
        if queues == 0 {
            return Err(r.not_canonical("queues", "must be at least 1"));
        }
        let body = bytes.len() - REQUEST_HEADER_LEN;
        let want = usize::try_from(count).ok().and_then(|c| c.checked_mul(REQUEST_RECORD_LEN));
        match want {
            Some(w) if body > w => return Err(DecodeError::TrailingBytes { what: WHAT, count: body - w }),
            Some(w) if body == w => {}
            _ => {
                return Err(DecodeError::Truncated {
                    what: WHAT,
                    offset: bytes.len(),
                    needed: want.map_or(usize::MAX, |w| w - body),
                })
            }
        }
        let records = (0..count).map(|_| RequestRecord::decode(&mut r, queues)).collect::<Result<_, _>>()?;
        r.finish()?;
        Ok(Self { header: RequestTraceHeader { image, device_bytes, queues, read_only }, records })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace() -> RequestTrace {
        let rec = |queue, op, sector, len, issued_ns, completed_ns| RequestRecord {
            queue,
            op,
            status: RequestStatus::Ok,
            sector,
            len,
            issued_ns,
            completed_ns,
        };
        RequestTrace {
            header: RequestTraceHeader {
                image: ImageId(Sha256Digest::of(b"img")),
                device_bytes: 64 << 20,
                queues: 2,
                read_only: true,
            },
            records: vec![
                rec(0, RequestOp::Read, 0, 4096, 10, 2_000),
                rec(1, RequestOp::Read, 8, 65536, 20, 30),
                rec(0, RequestOp::Flush, 0, 0, 2_100, 2_100),
                RequestRecord {
                    status: RequestStatus::IoErr,
                    ..rec(1, RequestOp::Write, 16, 512, 3_000, 4_000)
                },
                RequestRecord { status: RequestStatus::Dropped, ..rec(0, RequestOp::Invalid, 0, 0, 5, 5) },
            ],
        }
    }

    #[test]
    fn round_trip() {
        let t = trace();
        let bytes = t.encode();
        assert_eq!(bytes.len(), REQUEST_HEADER_LEN + 5 * REQUEST_RECORD_LEN);
        assert_eq!(&bytes[..8], b"TESSREQ\0");
        assert_eq!(RequestTrace::decode(&bytes).unwrap(), t);
        let empty = RequestTrace { records: vec![], ..t };
        assert_eq!(RequestTrace::decode(&empty.encode()).unwrap(), empty);
    }

    fn err(bytes: &[u8]) -> String {
        RequestTrace::decode(bytes).unwrap_err().to_string()
    }

    #[test]
    fn truncated() {
        let bytes = trace().encode();
        for cut in [0, 7, 12, 40, REQUEST_HEADER_LEN - 1] {
            assert!(err(&bytes[..cut]).contains("truncated"), "{cut}: {}", err(&bytes[..cut]));
        }
        // Header intact, records missing: the count says more.
        for cut in [REQUEST_HEADER_LEN, bytes.len() - 1, bytes.len() - REQUEST_RECORD_LEN] {
            assert!(err(&bytes[..cut]).contains("truncated"), "{cut}: {}", err(&bytes[..cut]));
        }
    }

    #[test]
    fn bad_magic() {
        let mut bytes = trace().encode();
        bytes[0] = b'X';
        assert!(err(&bytes).contains("bad magic"));
        assert!(err(b"tessera-trace 1 sha256:").contains("bad magic"));
    }

    #[test]
    fn newer_version() {
        let mut bytes = trace().encode();
        bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
        assert!(err(&bytes).contains("unsupported request trace version 2"), "{}", err(&bytes));
        let mut bytes = trace().encode();
        bytes[12..16].copy_from_slice(&48u32.to_le_bytes());
        assert!(err(&bytes).contains("record_len"));
    }

    #[test]
    fn trailing_garbage() {
        let mut bytes = trace().encode();
        bytes.push(0);
        assert!(err(&bytes).contains("1 trailing bytes"), "{}", err(&bytes));
        let mut bytes = trace().encode();
        bytes.extend_from_slice(&[0; REQUEST_RECORD_LEN]);
        assert!(err(&bytes).contains("trailing"));
    }

    #[test]
    fn unfinished_and_bad_fields() {
        let t = trace();
        let mut bytes = t.encode();
        bytes[16..24].copy_from_slice(&REQUEST_TRACE_UNFINISHED.to_le_bytes());
        assert!(err(&bytes).contains("not finished"));
        let at = |i: usize, f: usize| REQUEST_HEADER_LEN + i * REQUEST_RECORD_LEN + f;
        for (offset, value, what) in [
            (at(1, 34), 3u8, "op"),
            (at(1, 35), 7, "status"),
            (at(2, 38), 1, "reserved"),
            (at(0, 32), 2, "queue"),
            (36, 1, "reserved"),
            (34, 2, "read_only"),
        ] {
            let mut b = bytes.clone();
            b[16..24].copy_from_slice(&5u64.to_le_bytes());
            b[offset] = value;
            assert!(err(&b).contains(what), "{what}: {}", err(&b));
        }
        let mut b = t.encode();
        // Record 0 completes at 2000: make it issued after that.
        b[at(0, 16)..at(0, 24)].copy_from_slice(&5_000u64.to_le_bytes());
        assert!(err(&b).contains("before issued_ns"));
        // A count the input cannot hold is "truncated", never an allocation.
        let mut b = t.encode();
        b[16..24].copy_from_slice(&(u64::MAX - 1).to_le_bytes());
        assert!(err(&b).contains("truncated"));
    }
}
