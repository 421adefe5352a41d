//! Small reads and writes of guest memory with one region lookup.
//!
//! vm-memory's `Bytes::read_slice` / `write_obj` on guest memory go through its general
//! region-crossing path (a slice iterator, `stop_on_error`, a fold): ~230 instructions for the
//! 16-byte request header or the 1-byte status byte, most of a request's own guest-memory work
//! (callgrind, 2026-12-06). Almost every buffer lies in one region, so these translate the range
//! once and copy through that region's slice; a range across regions (or outside memory) takes
//! vm-memory's path, which gives the same answer.

use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions};

/// Fill `buf` from guest memory at `addr`; `false` if any of it lies outside guest memory.
pub fn read<M: GuestMemory + ?Sized>(mem: &M, addr: GuestAddress, buf: &mut [u8]) -> bool {
    if let Ok(mut slices) = mem.get_slices(addr, buf.len(), Permissions::Read) {
        if let Some(Ok(s)) = slices.next() {
            if s.len() == buf.len() {
                return s.copy_to(buf) == buf.len();
            }
        }
    }
    mem.read_slice(buf, addr).is_ok()
}

/// Write `bytes` into guest memory at `addr`; `false` if any of it lies outside guest memory.
pub fn write<M: GuestMemory + ?Sized>(mem: &M, addr: GuestAddress, bytes: &[u8]) -> bool {
    if let Ok(mut slices) = mem.get_slices(addr, bytes.len(), Permissions::Write) {
        if let Some(Ok(s)) = slices.next() {
            if s.len() == bytes.len() {
                s.copy_from(bytes);
                return true;
            }
        }
    }
    mem.write_slice(bytes, addr).is_ok()
}

#[cfg(test)]
mod tests {
    use vm_memory::GuestMemoryMmap;

    use super::*;

    /// Inside a region, across the two regions' boundary, into the hole, past the end: the same
    /// outcome and bytes as vm-memory's own calls.
    #[test]
    fn agrees_with_vm_memory() {
        // Two adjacent regions (a buffer may span them), then a hole, then a third.
        let mem = GuestMemoryMmap::<()>::from_ranges(&[
            (GuestAddress(0), 0x1000),
            (GuestAddress(0x1000), 0x1000),
            (GuestAddress(0x3000), 0x1000),
        ])
        .expect("memory");
        let fill: Vec<u8> = (0..0x2000u32).map(|i| (i * 7 + 3) as u8).collect();
        mem.write_slice(&fill, GuestAddress(0)).expect("fill");
        for (addr, len) in [
            (0x10, 16),
            (0xff8, 16),
            (0x1ff0, 16),
            (0x1fff, 1),
            (0x2000, 1),
            (0x3ff8, 16),
            (0x3fff, 1),
            (0x4000, 1),
            (u64::MAX, 1),
        ] {
            let a = GuestAddress(addr);
            let (mut ours, mut theirs) = (vec![0u8; len], vec![0u8; len]);
            let ok = read(&mem, a, &mut ours);
            assert_eq!(ok, mem.read_slice(&mut theirs, a).is_ok(), "read at {addr:#x}");
            if ok {
                assert_eq!(ours, theirs, "read at {addr:#x}");
            }
            let bytes = vec![0xa5u8; len];
            let ok = write(&mem, a, &bytes);
            assert_eq!(ok, mem.check_range(a, len, Permissions::Write), "write at {addr:#x}");
            if ok {
                mem.read_slice(&mut theirs, a).expect("read back");
                assert_eq!(theirs, bytes, "write at {addr:#x}");
            }
        }
    }
}
