//! Inodes (256 bytes, `i_extra_isize = 32`). Reference §6.

use crate::bytes::{put_u16, put_u32};
use crate::checksum::{crc32c_raw, inode_seed};
use crate::tree::Timestamp;

pub const INODE_SIZE: usize = 256;
pub const EXTRA_ISIZE: u16 = 32;
/// Start of the in-inode extended attribute area (128 + extra_isize).
pub const XATTR_AREA_START: usize = 0xA0;
pub const XATTR_AREA_LEN: usize = INODE_SIZE - XATTR_AREA_START;

pub const S_IFIFO: u16 = 0o010000;
pub const S_IFCHR: u16 = 0o020000;
pub const S_IFDIR: u16 = 0o040000;
pub const S_IFBLK: u16 = 0o060000;
pub const S_IFREG: u16 = 0o100000;
pub const S_IFLNK: u16 = 0o120000;
pub const S_IFSOCK: u16 = 0o140000;

pub const EXT4_INDEX_FL: u32 = 0x1000;
pub const EXT4_EXTENTS_FL: u32 = 0x80000;

/// Seconds representable with the 2 epoch bits: the 32-bit signed base plus up to 3 × 2^32.
pub const MIN_TIME: i64 = i32::MIN as i64;
pub const MAX_TIME: i64 = i32::MAX as i64 + 3 * (1 << 32);

/// Encode a timestamp as (low 32 bits of seconds, `(nsec << 2) | epoch`), or `None` if out of range.
/// The epoch bits extend the signed 32-bit seconds (kernel `ext4_encode_extra_time`).
pub fn encode_time(t: Timestamp) -> Option<(u32, u32)> {
    let sec = t.sec;
    if !(MIN_TIME..=MAX_TIME).contains(&sec) || t.nsec >= 1_000_000_000 {
        return None;
    }
    let lo = t.sec as u32;
    let epoch = ((t.sec - (lo as i32 as i64)) >> 32) as u32 & 3;
    Some((lo, (t.nsec << 2) | epoch))
}

/// Everything needed to render one inode. Times must already be validated (see [`encode_time`]).
#[derive(Debug, Clone)]
pub struct InodeData {
    /// File type and permission bits.
    pub mode: u16,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub atime: Timestamp,
    pub ctime: Timestamp,
    pub mtime: Timestamp,
    pub crtime: Timestamp,
    pub links: u16,
    /// Number of 512-byte sectors owned (data + tree + xattr block).
    pub blocks_512: u64,
    pub flags: u32,
    /// Extent root, fast symlink text, or device number.
    pub i_block: [u8; 60],
    /// External xattr block, or 0.
    pub file_acl: u64,
    /// The in-inode xattr area (0xA0..0x100), already laid out, or all zeros.
    pub xattr_area: [u8; XATTR_AREA_LEN],
}

impl Default for InodeData {
    fn default() -> Self {
        InodeData {
            mode: 0,
            uid: 0,
            gid: 0,
            size: 0,
            atime: Timestamp::default(),
            ctime: Timestamp::default(),
            mtime: Timestamp::default(),
            crtime: Timestamp::default(),
            links: 0,
            blocks_512: 0,
            flags: 0,
            i_block: [0; 60],
            file_acl: 0,
            xattr_area: [0; XATTR_AREA_LEN],
        }
    }
}

impl InodeData {
    /// Render inode `ino` with its checksum (generation 0).
    pub fn render(&self, ino: u32, fs_seed: u32) -> [u8; INODE_SIZE] {
        let mut b = [0u8; INODE_SIZE];
        let time = |t: Timestamp| encode_time(t).unwrap_or((0, 0));
        let (a_lo, a_x) = time(self.atime);
        let (c_lo, c_x) = time(self.ctime);
        let (m_lo, m_x) = time(self.mtime);
        let (cr_lo, cr_x) = time(self.crtime);
        put_u16(&mut b, 0x00, self.mode);
        put_u16(&mut b, 0x02, self.uid as u16);
        put_u32(&mut b, 0x04, self.size as u32);
        put_u32(&mut b, 0x08, a_lo);
        put_u32(&mut b, 0x0C, c_lo);
        put_u32(&mut b, 0x10, m_lo);
        put_u32(&mut b, 0x14, 0); // i_dtime
        put_u16(&mut b, 0x18, self.gid as u16);
        put_u16(&mut b, 0x1A, self.links);
        put_u32(&mut b, 0x1C, self.blocks_512 as u32);
        put_u32(&mut b, 0x20, self.flags);
        b[0x28..0x64].copy_from_slice(&self.i_block);
        put_u32(&mut b, 0x64, 0); // i_generation: 0, deterministic
        put_u32(&mut b, 0x68, self.file_acl as u32);
        put_u32(&mut b, 0x6C, (self.size >> 32) as u32);
        put_u16(&mut b, 0x74, (self.blocks_512 >> 32) as u16);
        put_u16(&mut b, 0x76, (self.file_acl >> 32) as u16);
        put_u16(&mut b, 0x78, (self.uid >> 16) as u16);
        put_u16(&mut b, 0x7A, (self.gid >> 16) as u16);
        put_u16(&mut b, 0x80, EXTRA_ISIZE);
        put_u32(&mut b, 0x84, c_x);
        put_u32(&mut b, 0x88, m_x);
        put_u32(&mut b, 0x8C, a_x);
        put_u32(&mut b, 0x90, cr_lo);
        put_u32(&mut b, 0x94, cr_x);
        b[XATTR_AREA_START..].copy_from_slice(&self.xattr_area);
        let csum = inode_checksum(&b, ino, fs_seed);
        put_u16(&mut b, 0x7C, csum as u16);
        put_u16(&mut b, 0x82, (csum >> 16) as u16);
        b
    }
}

/// crc32c over the whole inode with both checksum halves zeroed, seeded per inode.
pub fn inode_checksum(raw: &[u8; INODE_SIZE], ino: u32, fs_seed: u32) -> u32 {
    let mut copy = *raw;
    copy[0x7C..0x7E].fill(0);
    copy[0x82..0x84].fill(0);
    crc32c_raw(inode_seed(fs_seed, ino, 0), &copy)
}

/// `i_block` for a character or block device: old encoding when both numbers fit a byte, else new.
pub fn device_i_block(major: u32, minor: u32) -> [u8; 60] {
    let mut ib = [0u8; 60];
    if major < 256 && minor < 256 {
        put_u32(&mut ib, 0, (major << 8) | minor);
    } else {
        let v = (minor & 0xFF) | ((major & 0xFFF) << 8) | ((minor & !0xFF) << 12);
        put_u32(&mut ib, 4, v);
    }
    ib
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::{get_u16, get_u32};

    fn ts(sec: i64, nsec: u32) -> Timestamp {
        Timestamp { sec, nsec }
    }

    #[test]
    fn time_encoding() {
        assert_eq!(encode_time(ts(0, 0)), Some((0, 0)));
        assert_eq!(encode_time(ts(1_700_000_000, 5)), Some((1_700_000_000, 20)));
        // 1966-10-31T14:13:20.000000005: negative, epoch 0, low word has bit 31 set.
        let (lo, x) = encode_time(ts(-99_999_200, 5)).expect("in range");
        assert_eq!(lo as i32 as i64, -99_999_200);
        assert_eq!(x, 5 << 2);
        // 2100-01-01: beyond i32, epoch 1.
        let (lo, x) = encode_time(ts(4_102_444_800, 999_999_999)).expect("in range");
        assert_eq!(lo as i32 as i64 + (1 << 32), 4_102_444_800);
        assert_eq!(x, (999_999_999 << 2) | 1);
        assert_eq!(encode_time(ts(MAX_TIME + 1, 0)), None);
        assert_eq!(encode_time(ts(MIN_TIME - 1, 0)), None);
        assert_eq!(encode_time(ts(0, 1_000_000_000)), None);
        // Round trip the kernel decoding: sec = (i32)lo + epoch << 32.
        for s in [MIN_TIME, -1, 0, i32::MAX as i64, 1 << 31, MAX_TIME] {
            let (lo, x) = encode_time(ts(s, 0)).expect("in range");
            assert_eq!(lo as i32 as i64 + (((x & 3) as i64) << 32), s);
        }
    }

    #[test]
    fn render_fields_and_checksum() {
        let d = InodeData {
            mode: S_IFREG | 0o644,
            uid: 4_294_967_294,
            gid: 70_000,
            size: (5 << 32) | 7,
            links: 3,
            blocks_512: (1 << 33) | 8,
            flags: EXT4_EXTENTS_FL,
            mtime: ts(4_102_444_800, 1),
            ..Default::default()
        };
        let b = d.render(12, 0x1234);
        assert_eq!(get_u16(&b, 0x02), 0xFFFE);
        assert_eq!(get_u16(&b, 0x78), 0xFFFF);
        assert_eq!(get_u16(&b, 0x1A), 3);
        assert_eq!(get_u32(&b, 0x6C), 5);
        assert_eq!(get_u32(&b, 0x1C), 8);
        assert_eq!(get_u16(&b, 0x74), 2);
        assert_eq!(get_u16(&b, 0x80), 32);
        assert_eq!(get_u32(&b, 0x88), (1 << 2) | 1);
        let csum = get_u16(&b, 0x7C) as u32 | (get_u16(&b, 0x82) as u32) << 16;
        assert_eq!(csum, inode_checksum(&b, 12, 0x1234));
        assert_ne!(csum, inode_checksum(&b, 13, 0x1234));
    }

    #[test]
    fn device_numbers() {
        let old = device_i_block(8, 1);
        assert_eq!(get_u32(&old, 0), 0x0801);
        assert_eq!(get_u32(&old, 4), 0);
        let new = device_i_block(259, 100_000);
        assert_eq!(get_u32(&new, 0), 0);
        let v = get_u32(&new, 4);
        // Decode as the kernel's new_decode_dev does.
        let major = (v & 0xFFF00) >> 8;
        let minor = (v & 0xFF) | ((v >> 12) & 0xFFF00);
        assert_eq!((major, minor), (259, 100_000));
    }
}
