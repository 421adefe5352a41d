//! Block group descriptors (64 bytes each; the GDT starts at block 1). Reference §4.

use crate::bytes::{put_u16, put_u32};
use crate::checksum::crc32c_raw;

pub const DESC_SIZE: usize = 64;
/// `EXT4_BG_INODE_ZEROED`: unused inode-table space reads as zeros (it is never shipped, so it does),
/// which stops the guest's lazyinit thread from rewriting every inode table on first mount.
pub const BG_INODE_ZEROED: u16 = 0x4;

/// One group descriptor before rendering.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupDesc {
    pub block_bitmap: u64,
    pub inode_bitmap: u64,
    pub inode_table: u64,
    pub free_blocks: u32,
    pub free_inodes: u32,
    pub used_dirs: u32,
    pub itable_unused: u32,
    pub block_bitmap_csum: u32,
    pub inode_bitmap_csum: u32,
}

impl GroupDesc {
    /// Render descriptor `group` with its checksum (low 16 bits of crc32c over group number and bytes).
    pub fn render(&self, group: u32, fs_seed: u32) -> [u8; DESC_SIZE] {
        let mut d = [0u8; DESC_SIZE];
        put_u32(&mut d, 0x00, self.block_bitmap as u32);
        put_u32(&mut d, 0x04, self.inode_bitmap as u32);
        put_u32(&mut d, 0x08, self.inode_table as u32);
        put_u16(&mut d, 0x0C, self.free_blocks as u16);
        put_u16(&mut d, 0x0E, self.free_inodes as u16);
        put_u16(&mut d, 0x10, self.used_dirs as u16);
        put_u16(&mut d, 0x12, BG_INODE_ZEROED);
        put_u16(&mut d, 0x18, self.block_bitmap_csum as u16);
        put_u16(&mut d, 0x1A, self.inode_bitmap_csum as u16);
        put_u16(&mut d, 0x1C, self.itable_unused as u16);
        put_u32(&mut d, 0x20, (self.block_bitmap >> 32) as u32);
        put_u32(&mut d, 0x24, (self.inode_bitmap >> 32) as u32);
        put_u32(&mut d, 0x28, (self.inode_table >> 32) as u32);
        put_u16(&mut d, 0x2C, (self.free_blocks >> 16) as u16);
        put_u16(&mut d, 0x2E, (self.free_inodes >> 16) as u16);
        put_u16(&mut d, 0x30, (self.used_dirs >> 16) as u16);
        put_u16(&mut d, 0x32, (self.itable_unused >> 16) as u16);
        put_u16(&mut d, 0x38, (self.block_bitmap_csum >> 16) as u16);
        put_u16(&mut d, 0x3A, (self.inode_bitmap_csum >> 16) as u16);
        let csum = desc_checksum(&d, group, fs_seed);
        put_u16(&mut d, 0x1E, csum);
        d
    }
}

/// `crc32c_raw(fs_seed, le32(group) ‖ desc with bg_checksum zeroed) & 0xFFFF`.
pub fn desc_checksum(desc: &[u8; DESC_SIZE], group: u32, fs_seed: u32) -> u16 {
    let mut copy = *desc;
    copy[0x1E] = 0;
    copy[0x1F] = 0;
    let c = crc32c_raw(fs_seed, &group.to_le_bytes());
    (crc32c_raw(c, &copy) & 0xFFFF) as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::{get_u16, get_u32};

    #[test]
    fn layout_and_checksum() {
        let gd = GroupDesc {
            block_bitmap: 0x1_0000_0003,
            inode_bitmap: 5,
            inode_table: 7,
            free_blocks: 0x12345,
            free_inodes: 100,
            used_dirs: 2,
            itable_unused: 90,
            block_bitmap_csum: 0xAABB_CCDD,
            inode_bitmap_csum: 0x1122_3344,
        };
        let d = gd.render(9, 0xDEAD_BEEF);
        assert_eq!(get_u32(&d, 0x00), 3);
        assert_eq!(get_u32(&d, 0x20), 1);
        assert_eq!(get_u16(&d, 0x0C), 0x2345);
        assert_eq!(get_u16(&d, 0x2C), 1);
        assert_eq!(get_u16(&d, 0x12), BG_INODE_ZEROED);
        assert_eq!(get_u16(&d, 0x18), 0xCCDD);
        assert_eq!(get_u16(&d, 0x38), 0xAABB);
        assert_eq!(get_u16(&d, 0x1E), desc_checksum(&d, 9, 0xDEAD_BEEF));
        // The checksum depends on the group number.
        assert_ne!(desc_checksum(&d, 9, 0xDEAD_BEEF), desc_checksum(&d, 10, 0xDEAD_BEEF));
    }
}
