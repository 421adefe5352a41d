//! Block and inode bitmaps, one 4096-byte block each per group. Reference §5.
//!
//! Bit i (LSB first within byte i/8) marks block `g*32768+i` or inode `g*ipg+i+1` as used.

use crate::checksum::crc32c_raw;
use tessera_image::BlockSize;

/// One bitmap block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bitmap {
    bytes: Vec<u8>,
}

impl Default for Bitmap {
    fn default() -> Self {
        Self::new()
    }
}

impl Bitmap {
    pub fn new() -> Self {
        Bitmap { bytes: vec![0; BlockSize::USIZE] }
    }

    /// Set bits `[start, start+len)`, a whole byte at a time where possible (files of GiBs set millions of
    /// bits).
    pub fn set_range(&mut self, start: usize, len: usize) {
        let end = start + len;
        let mut i = start;
        while i < end && i % 8 != 0 {
            self.bytes[i / 8] |= 1 << (i % 8);
            i += 1;
        }
        while i + 8 <= end {
            self.bytes[i / 8] = 0xFF;
            i += 8;
        }
        while i < end {
            self.bytes[i / 8] |= 1 << (i % 8);
            i += 1;
        }
    }

    pub fn get(&self, i: usize) -> bool {
        self.bytes[i / 8] & (1 << (i % 8)) != 0
    }

    /// Number of zero bits in `[0, len)`.
    pub fn count_zeros(&self, len: usize) -> usize {
        let full = len / 8;
        let mut zeros: usize = self.bytes[..full].iter().map(|b| b.count_zeros() as usize).sum();
        for i in full * 8..len {
            if !self.get(i) {
                zeros += 1;
            }
        }
        zeros
    }

    /// crc32c_raw over the first `meaningful_bytes` (4096 for block bitmaps, ipg/8 for inode bitmaps),
    /// seeded with the filesystem seed and no group number.
    pub fn checksum(&self, meaningful_bytes: usize, fs_seed: u32) -> u32 {
        crc32c_raw(fs_seed, &self.bytes[..meaningful_bytes])
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// A block bitmap for a group of `blocks_in_group` real blocks: bits past the end of the filesystem
/// are set, as e2fsck expects ("Padding at end of block bitmap is not set").
pub fn block_bitmap(blocks_in_group: usize) -> Bitmap {
    let mut b = Bitmap::new();
    if blocks_in_group < BlockSize::USIZE * 8 {
        b.set_range(blocks_in_group, BlockSize::USIZE * 8 - blocks_in_group);
    }
    b
}

/// An inode bitmap for `ipg` inodes: bits ipg..32767 are set (e2fsck exits 4 otherwise).
pub fn inode_bitmap(ipg: usize) -> Bitmap {
    let mut b = Bitmap::new();
    if ipg < BlockSize::USIZE * 8 {
        b.set_range(ipg, BlockSize::USIZE * 8 - ipg);
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_range_edges() {
        let mut b = Bitmap::new();
        b.set_range(3, 20);
        assert!(!b.get(2));
        assert!((3..23).all(|i| b.get(i)));
        assert!(!b.get(23));
        assert_eq!(b.count_zeros(64), 64 - 20);
    }

    #[test]
    fn padding() {
        let b = inode_bitmap(16);
        assert_eq!(b.as_bytes()[0], 0);
        assert_eq!(b.as_bytes()[1], 0);
        assert_eq!(b.as_bytes()[2], 0xFF);
        assert_eq!(b.as_bytes()[4095], 0xFF);
        let full = inode_bitmap(32768);
        assert!(full.as_bytes().iter().all(|&x| x == 0));
        let bb = block_bitmap(100);
        assert!(!bb.get(99));
        assert!(bb.get(100));
        assert_eq!(bb.count_zeros(100), 100);
    }

    #[test]
    fn checksum_covers_only_meaningful_bytes() {
        let a = inode_bitmap(16);
        let b = inode_bitmap(32);
        // The first 2 bytes are equal (zero); padding beyond differs but is not covered.
        assert_eq!(a.checksum(2, 1), b.checksum(2, 1));
        assert_eq!(a.checksum(2, 1), crc32c_raw(1, &[0, 0]));
    }
}
