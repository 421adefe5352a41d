//! The overlay's on-disk structures (see `docs/formats/overlay.md`): the header (two copies in
//! slot 0) and the 64-byte log records (64 per log segment slot). Pure encode / decode.

use tessera_image::{ImageId, Sha256Digest};

/// `magic` of a header copy.
pub const MAGIC: [u8; 8] = *b"TESSOVL1";
/// The format version this code writes. Version 2 writes each write's map record at completion,
/// so its last *two* flush groups may be in doubt after a power loss; it also reads version 1
/// (whose last group alone was), and upgrades both header copies at the first writable open so
/// that a reader of version 1 only refuses the file.
pub const VERSION: u32 = 2;
/// The oldest format version this code reads.
pub const OLDEST_VERSION: u32 = 1;
/// Bytes of one header copy (copy A at offset 0, copy B at [`HEADER_B_OFFSET`]).
pub const HEADER_LEN: usize = 128;
/// Offset of header copy B inside slot 0.
pub const HEADER_B_OFFSET: u64 = 2048;
/// Bytes of one log record.
pub const RECORD_LEN: usize = 64;

/// What the header says about the overlay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// [`OLDEST_VERSION`]..=[`VERSION`] (encoding writes this value).
    pub version: u32,
    pub block_size: u32,
    pub image_id: ImageId,
    pub device_bytes: u64,
    /// Higher wins between the two copies.
    pub generation: u64,
    /// Mixed into every record checksum: records of another log generation never validate.
    pub salt: u64,
    /// Slot of the first log segment.
    pub log_head: u64,
    /// Sequence number of the first record.
    pub first_seq: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[12..16].copy_from_slice(&self.block_size.to_le_bytes());
        b[16..48].copy_from_slice(&self.image_id.0 .0);
        b[48..56].copy_from_slice(&self.device_bytes.to_le_bytes());
        b[56..64].copy_from_slice(&self.generation.to_le_bytes());
        b[64..72].copy_from_slice(&self.salt.to_le_bytes());
        b[72..80].copy_from_slice(&self.log_head.to_le_bytes());
        b[80..88].copy_from_slice(&self.first_seq.to_le_bytes());
        let crc = crc32c::crc32c(&b[..124]);
        b[124..128].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decode one copy. `Err` tells why it is not a valid header copy.
    pub fn decode(b: &[u8]) -> Result<Header, HeaderProblem> {
        let b: &[u8; HEADER_LEN] =
            b.get(..HEADER_LEN).and_then(|s| s.try_into().ok()).ok_or(HeaderProblem::Short)?;
        if b[0..8] != MAGIC {
            return Err(HeaderProblem::Magic);
        }
        if crc32c::crc32c(&b[..124]) != le32(b, 124) {
            return Err(HeaderProblem::Checksum);
        }
        let version = le32(b, 8);
        if !(OLDEST_VERSION..=VERSION).contains(&version) {
            return Err(HeaderProblem::Version(version));
        }
        let mut id = [0u8; 32];
        id.copy_from_slice(&b[16..48]);
        Ok(Header {
            version,
            block_size: le32(b, 12),
            image_id: ImageId(Sha256Digest(id)),
            device_bytes: le64(b, 48),
            generation: le64(b, 56),
            salt: le64(b, 64),
            log_head: le64(b, 72),
            first_seq: le64(b, 80),
        })
    }
}

/// Why a header copy is not valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderProblem {
    Short,
    Magic,
    Checksum,
    Version(u32),
}

/// A block-map update or a log link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Blocks `block..block + count` now live in slots `slot..slot + count`; `data_crc` is the
    /// crc32c of those `count` blocks, or `None` for checkpoint records (synced before use).
    Map { block: u64, count: u32, slot: u64, data_crc: Option<u32> },
    /// Blocks `block..block + count` read as zeros.
    Zero { block: u64, count: u32 },
    /// The log continues at record 0 of segment slot `slot`.
    Link { slot: u64 },
}

const KIND_MAP: u8 = 1;
const KIND_ZERO: u8 = 2;
const KIND_LINK: u8 = 3;
const FLAG_NO_DATA_CRC: u8 = 1;

/// One log record: an [`Op`] with its sequence number and flush group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// Consecutive from the header's `first_seq`.
    pub seq: u64,
    /// The FLUSH that wrote it (non-decreasing along the log; 0 = the checkpoint).
    pub group: u64,
    pub op: Op,
}

/// Why bytes at a record position are not a record: the end of the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordProblem {
    Checksum,
    /// The checksum matches but the content is not a record this version writes.
    Malformed,
}

impl Record {
    pub fn encode(&self, salt: u64) -> [u8; RECORD_LEN] {
        let mut b = [0u8; RECORD_LEN];
        b[0..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..16].copy_from_slice(&self.group.to_le_bytes());
        let (kind, flags, count, block, slot, crc) = match self.op {
            Op::Map { block, count, slot, data_crc } => (
                KIND_MAP,
                if data_crc.is_none() { FLAG_NO_DATA_CRC } else { 0 },
                count,
                block,
                slot,
                data_crc.unwrap_or(0),
            ),
            Op::Zero { block, count } => (KIND_ZERO, 0, count, block, 0, 0),
            Op::Link { slot } => (KIND_LINK, 0, 0, 0, slot, 0),
        };
        b[16] = kind;
        b[17] = flags;
        b[20..24].copy_from_slice(&count.to_le_bytes());
        b[24..32].copy_from_slice(&block.to_le_bytes());
        b[32..40].copy_from_slice(&slot.to_le_bytes());
        b[40..44].copy_from_slice(&crc.to_le_bytes());
        let c = record_crc(salt, &b);
        b[60..64].copy_from_slice(&c.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; RECORD_LEN], salt: u64) -> Result<Record, RecordProblem> {
        if record_crc(salt, b) != le32(b, 60) {
            return Err(RecordProblem::Checksum);
        }
        let (kind, flags, count) = (b[16], b[17], le32(b, 20));
        let (block, slot, data_crc) = (le64(b, 24), le64(b, 32), le32(b, 40));
        if b[18..20] != [0, 0] || b[44..60].iter().any(|&x| x != 0) {
            return Err(RecordProblem::Malformed);
        }
        let op = match (kind, flags) {
            (KIND_MAP, 0 | FLAG_NO_DATA_CRC) if count > 0 => {
                Op::Map { block, count, slot, data_crc: if flags == 0 { Some(data_crc) } else { None } }
            }
            (KIND_ZERO, 0) if count > 0 && slot == 0 && data_crc == 0 => Op::Zero { block, count },
            (KIND_LINK, 0) if count == 0 && block == 0 && data_crc == 0 => Op::Link { slot },
            _ => return Err(RecordProblem::Malformed),
        };
        Ok(Record { seq: le64(b, 0), group: le64(b, 8), op })
    }
}

fn record_crc(salt: u64, b: &[u8; RECORD_LEN]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&salt.to_le_bytes()), &b[..60])
}

fn le32(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

fn le64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            version: VERSION,
            block_size: 4096,
            image_id: ImageId(Sha256Digest::of(b"img")),
            device_bytes: 64 << 20,
            generation: 3,
            salt: 0x1234_5678_9abc_def0,
            log_head: 7,
            first_seq: 99,
        }
    }

    #[test]
    fn header_round_trip_and_damage() {
        let h = header();
        let b = h.encode();
        assert_eq!(Header::decode(&b), Ok(h));
        let mut bad = b;
        bad[50] ^= 1;
        assert_eq!(Header::decode(&bad), Err(HeaderProblem::Checksum));
        bad = b;
        bad[0] = b'X';
        assert_eq!(Header::decode(&bad), Err(HeaderProblem::Magic));
        assert_eq!(Header::decode(&b[..100]), Err(HeaderProblem::Short));
        assert_eq!(Header::decode(&[0u8; HEADER_LEN]), Err(HeaderProblem::Magic));
        // Version 1 is read (and says so); another version, with a valid checksum, is refused.
        let v1 = Header { version: 1, ..h };
        assert_eq!(Header::decode(&v1.encode()), Ok(v1));
        for v in [0u32, 3, 0x0100_0002] {
            bad = b;
            bad[8..12].copy_from_slice(&v.to_le_bytes());
            let crc = crc32c::crc32c(&bad[..124]);
            bad[124..].copy_from_slice(&crc.to_le_bytes());
            assert_eq!(Header::decode(&bad), Err(HeaderProblem::Version(v)));
        }
    }

    #[test]
    fn record_round_trip_salt_and_damage() {
        let salt = 42;
        for op in [
            Op::Map { block: 5, count: 3, slot: 9, data_crc: Some(0xdead_beef) },
            Op::Map { block: 5, count: 3, slot: 9, data_crc: None },
            Op::Zero { block: 1 << 40, count: u32::MAX },
            Op::Link { slot: 77 },
        ] {
            let r = Record { seq: 10, group: 2, op };
            let b = r.encode(salt);
            assert_eq!(Record::decode(&b, salt), Ok(r));
            // A record of another log generation (salt) never validates.
            assert_eq!(Record::decode(&b, salt + 1), Err(RecordProblem::Checksum));
            for i in [0, 17, 33, 63] {
                let mut bad = b;
                bad[i] ^= 0x10;
                assert_eq!(Record::decode(&bad, salt), Err(RecordProblem::Checksum), "byte {i}");
            }
        }
        assert_eq!(Record::decode(&[0u8; RECORD_LEN], salt), Err(RecordProblem::Checksum));
    }

    #[test]
    fn malformed_records_with_valid_checksums() {
        let salt = 7;
        let reseal = |mut b: [u8; RECORD_LEN]| {
            let c = record_crc(salt, &b);
            b[60..64].copy_from_slice(&c.to_le_bytes());
            b
        };
        let good = Record { seq: 1, group: 1, op: Op::Zero { block: 0, count: 1 } }.encode(salt);
        for (at, v) in [(16usize, 9u8), (17, 4), (20, 0), (32, 1), (50, 1), (18, 1)] {
            let mut b = good;
            b[at] = v;
            if at == 20 {
                b[20..24].fill(0);
            }
            assert_eq!(Record::decode(&reseal(b), salt), Err(RecordProblem::Malformed), "byte {at}");
        }
    }
}
