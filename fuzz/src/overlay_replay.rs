//! `overlay_replay`: opening a copy-on-write overlay ([`tessera_overlay::Overlay::open`]) from
//! arbitrary file bytes through an in-memory [`OverlayIo`], then using it.
//!
//! Input (little-endian; [`Case::encode`] writes it):
//!
//! ```text
//! u8   flags    bit 0: reseal the header copies (recompute their CRC when the magic is there)
//!               bit 1: reseal log records (every 64-byte record position of slots ≥ 1 whose
//!                      kind byte is MAP/ZERO/LINK gets a valid CRC under the chosen salt)
//!               bit 2: before that, recompute the data CRC of MAP records from the file
//!               bit 3: open read-only (else durable: replay, then a checkpoint)
//!               bit 4: take block size and device size from header copy A, not from below
//! u8   bs       block size 512 << (bs % 8)
//! u64  device   device bytes
//! ...           the overlay file
//! ```
//!
//! Resealing keeps the fuzzer's mutations *past* the checksums, where the replay logic is: a
//! flipped bit in a record is then "a valid record with odd content" rather than "the end of
//! the log".
//!
//! Properties: never a panic and no unbounded allocation; if the overlay opens, every block
//! reads, a write + zeroes + FLUSH succeed, and reopening the file the overlay itself left
//! behind succeeds and shows the same device content; a read-only open writes nothing.

use std::io;
use std::sync::{Arc, Mutex};

use tessera_engine::BlockDevice;
use tessera_image::{ImageId, Sha256Digest};
use tessera_overlay::format::{Header, HEADER_B_OFFSET, HEADER_LEN, MAGIC, RECORD_LEN};
use tessera_overlay::io::OverlayIo;
use tessera_overlay::{Mode as OverlayMode, Overlay, OverlayParams};

use crate::vhost_request::SectorPattern;
use crate::{Input, Output};

pub const F_RESEAL_HEADERS: u8 = 1;
pub const F_RESEAL_RECORDS: u8 = 2;
pub const F_DATA_CRC: u8 = 4;
pub const F_READ_ONLY: u8 = 8;
pub const F_ADOPT: u8 = 16;

/// The overlay file grows past this only with an error (a real file system says EFBIG
/// somewhere too); keeps a runaway slot number from exhausting the fuzzer's memory.
pub const MEM_IO_MAX: u64 = 256 << 20;

/// An in-memory overlay file (shared, so the bytes can be reopened after the overlay is gone).
#[derive(Debug, Clone, Default)]
pub struct MemIo {
    pub bytes: Arc<Mutex<Vec<u8>>>,
}

impl MemIo {
    pub fn new(bytes: Vec<u8>) -> Self {
        Self { bytes: Arc::new(Mutex::new(bytes)) }
    }

    pub fn snapshot(&self) -> Vec<u8> {
        self.bytes.lock().unwrap().clone()
    }
}

impl OverlayIo for MemIo {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let b = self.bytes.lock().unwrap();
        buf.fill(0);
        if let Ok(start) = usize::try_from(offset) {
            if start < b.len() {
                let n = (b.len() - start).min(buf.len());
                buf[..n].copy_from_slice(&b[start..start + n]);
            }
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let end = offset.checked_add(buf.len() as u64).filter(|&e| e <= MEM_IO_MAX);
        let Some(end) = end else {
            return Err(io::Error::new(io::ErrorKind::FileTooLarge, "in-memory overlay file limit"));
        };
        let mut b = self.bytes.lock().unwrap();
        if (b.len() as u64) < end {
            b.resize(end as usize, 0);
        }
        b[offset as usize..end as usize].copy_from_slice(buf);
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        Ok(())
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.bytes.lock().unwrap().len() as u64)
    }
}

/// The image every fuzzed overlay belongs to.
pub fn image_id() -> ImageId {
    ImageId(Sha256Digest::of(b"tessera-fuzz-overlay"))
}

/// One fuzz case, decoded.
#[derive(Debug, Clone)]
pub struct Case {
    pub flags: u8,
    pub bs_shift: u8,
    pub device_bytes: u64,
    pub file: Vec<u8>,
}

impl Case {
    pub fn decode(data: &[u8]) -> Case {
        let mut i = Input::new(data);
        Case { flags: i.u8(), bs_shift: i.u8(), device_bytes: i.u64(), file: i.rest().to_vec() }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut o = Output::default();
        o.u8(self.flags).u8(self.bs_shift).u64(self.device_bytes).bytes(&self.file);
        o.buf
    }
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// The header copy `open` would choose, if any.
fn chosen_header(file: &[u8]) -> Option<Header> {
    let copy = |at: usize| file.get(at..at + HEADER_LEN).and_then(|b| Header::decode(b).ok());
    match (copy(0), copy(HEADER_B_OFFSET as usize)) {
        (Some(a), Some(b)) if b.generation > a.generation => Some(b),
        (Some(a), _) => Some(a),
        (None, b) => b,
    }
}

fn reseal(file: &mut [u8], flags: u8, bs: usize) {
    if flags & F_RESEAL_HEADERS != 0 {
        for at in [0, HEADER_B_OFFSET as usize] {
            if let Some(h) = file.get_mut(at..at + HEADER_LEN) {
                if h[..8] == MAGIC {
                    let crc = crc32c::crc32c(&h[..124]);
                    h[124..].copy_from_slice(&crc.to_le_bytes());
                }
            }
        }
    }
    if flags & (F_RESEAL_RECORDS | F_DATA_CRC) == 0 {
        return;
    }
    let Some(header) = chosen_header(file) else { return };
    let mut at = bs;
    while at + RECORD_LEN <= file.len() {
        let kind = file[at + 16];
        if (1..=3).contains(&kind) {
            if flags & F_DATA_CRC != 0 && kind == 1 && file[at + 17] == 0 {
                let (count, slot) = (u64::from(le32(file, at + 20)), le64(file, at + 32));
                let len = count.saturating_mul(bs as u64);
                if len <= 1 << 20 {
                    let mut data = vec![0u8; len as usize];
                    let start = slot.saturating_mul(bs as u64);
                    if let Ok(start) = usize::try_from(start) {
                        if start < file.len() {
                            let n = (file.len() - start).min(data.len());
                            data[..n].copy_from_slice(&file[start..start + n]);
                        }
                    }
                    let crc = crc32c::crc32c(&data);
                    file[at + 40..at + 44].copy_from_slice(&crc.to_le_bytes());
                }
            }
            if flags & F_RESEAL_RECORDS != 0 {
                let crc =
                    crc32c::crc32c_append(crc32c::crc32c(&header.salt.to_le_bytes()), &file[at..at + 60]);
                file[at + 60..at + 64].copy_from_slice(&crc.to_le_bytes());
            }
        }
        at += RECORD_LEN;
    }
}

/// Device blocks worth comparing: the first 32, the last, and those named by MAP/ZERO records.
fn blocks_of_interest(file: &[u8], bs: usize, blocks: u64) -> Vec<u64> {
    let mut out: Vec<u64> = (0..blocks.min(32)).collect();
    if blocks > 0 {
        out.push(blocks - 1);
    }
    let mut at = bs;
    while at + RECORD_LEN <= file.len() && out.len() < 128 {
        if matches!(file[at + 16], 1 | 2) {
            let (count, block) = (u64::from(le32(file, at + 20)), le64(file, at + 24));
            for b in [block, block.saturating_add(count.saturating_sub(1))] {
                if b < blocks {
                    out.push(b);
                }
            }
        }
        at += RECORD_LEN;
    }
    out.sort_unstable();
    out.dedup();
    out
}

fn read_blocks(o: &Overlay, list: &[u64], bs: usize) -> Vec<Vec<u8>> {
    list.iter()
        .map(|&b| {
            let mut buf = vec![0u8; bs];
            o.read_at(b * bs as u64, &mut buf)
                .unwrap_or_else(|e| panic!("reading block {b} of an open overlay: {e}"));
            buf
        })
        .collect()
}

/// The fuzz target body.
pub fn run(data: &[u8]) {
    let case = Case::decode(data);
    let mut file = case.file;
    let mut params = OverlayParams {
        image_id: image_id(),
        block_size: 512 << (case.bs_shift % 8),
        device_bytes: case.device_bytes,
    };
    if case.flags & F_ADOPT != 0 {
        if let Some(h) = file.get(..HEADER_LEN).and_then(|b| Header::decode(b).ok()) {
            params.block_size = h.block_size;
            params.device_bytes = h.device_bytes;
            params.image_id = h.image_id;
        }
    }
    let Ok(bs) = usize::try_from(params.block_size) else { return };
    // open() refuses these itself; still run it for the error path. Block sizes under 4 KiB are
    // refused since finding F2 (docs/fuzzing.md), and the refusal of a device size just below
    // 2^64 no longer overflows (F7).
    if !(4096..=65536).contains(&bs) || !bs.is_power_of_two() || params.device_bytes % bs as u64 != 0 {
        let io = MemIo::new(file);
        assert!(Overlay::open(Box::new(io), params, Arc::new(SectorPattern), OverlayMode::Durable).is_err());
        return;
    }
    reseal(&mut file, case.flags, bs);
    let blocks = params.device_bytes / bs as u64;
    let interesting = blocks_of_interest(&file, bs, blocks);
    let base: Arc<dyn BlockDevice> = Arc::new(SectorPattern);
    let io = MemIo::new(file.clone());

    if case.flags & F_READ_ONLY != 0 {
        let Ok(o) = Overlay::open(Box::new(io.clone()), params, base, OverlayMode::ReadOnly) else { return };
        let _ = read_blocks(&o, &interesting, bs);
        assert!(o.write_at(0, &[1]).is_err(), "a read-only overlay accepted a write");
        o.flush().unwrap();
        drop(o);
        assert!(io.snapshot() == file, "a read-only open changed the file");
        return;
    }

    // What the file says, without writing anything; replay is deterministic, so a durable open
    // (replay, then a checkpoint rewriting the log) must show the same device.
    let before = {
        let ro = MemIo::new(file.clone());
        let Ok(o) = Overlay::open(Box::new(ro), params, base.clone(), OverlayMode::ReadOnly) else { return };
        read_blocks(&o, &interesting, bs)
    };
    let o = match Overlay::open(Box::new(io.clone()), params, base.clone(), OverlayMode::Durable) {
        Ok(o) => o,
        Err(e) if tessera_engine::Chain(&e).to_string().contains("in-memory overlay file limit") => return,
        Err(e) => panic!("opens read-only but not read-write: {e}"),
    };
    let mut view = read_blocks(&o, &interesting, bs);
    for ((b, want), got) in interesting.iter().zip(&before).zip(&view) {
        assert!(want == got, "block {b} differs between a read-only and a read-write open (bs {bs})");
    }
    // Use it: a block write at the start, zeroes at the end, a FLUSH.
    if blocks > 0 {
        let fill = vec![0xc3u8; bs];
        let limit = |e: &tessera_overlay::OverlayError| {
            tessera_engine::Chain(e).to_string().contains("in-memory overlay file limit")
        };
        match o
            .write_at(0, &fill)
            .and_then(|()| o.write_zeroes((blocks - 1) * bs as u64, bs as u64))
            .and_then(|()| o.flush())
        {
            Ok(()) => {}
            Err(e) if limit(&e) => return,
            Err(e) => panic!("write, zeroes and flush on an opened overlay: {e}"),
        }
        for (b, v) in interesting.iter().zip(view.iter_mut()) {
            if *b == blocks - 1 {
                v.fill(0);
            } else if *b == 0 {
                v.fill(0xc3);
            }
        }
        assert_eq!(read_blocks(&o, &interesting, bs), view, "reads after write + flush");
    }
    drop(o);

    // The file the overlay left behind must open again, with the same content.
    let again = match Overlay::open(Box::new(io.clone()), params, base, OverlayMode::Durable) {
        Ok(o) => o,
        Err(e) if tessera_engine::Chain(&e).to_string().contains("in-memory overlay file limit") => return,
        Err(e) => panic!("reopening an overlay this process opened, wrote and flushed: {e}"),
    };
    let got = read_blocks(&again, &interesting, bs);
    for ((b, want), got) in interesting.iter().zip(&view).zip(&got) {
        assert!(want == got, "block {b} changed across a clean reopen (bs {bs})");
    }
}
