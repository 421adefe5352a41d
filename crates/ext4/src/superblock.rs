//! The ext4 superblock (1024 bytes at byte 1024 of block 0, and copies in backup groups). Reference §3.

use crate::bytes::{put_u16, put_u32, put_u64, put_u8};
use crate::checksum::crc32c_raw;

pub const SB_SIZE: usize = 1024;
pub const MAGIC: u16 = 0xEF53;
pub const FEATURE_COMPAT: u32 = 0x2C; // has_journal | ext_attr | dir_index
pub const FEATURE_INCOMPAT: u32 = 0x2C2; // filetype | extents | 64bit | flex_bg
pub const FEATURE_RO_COMPAT: u32 = 0x46B; // sparse_super | large_file | huge_file | dir_nlink | extra_isize | metadata_csum
pub const FIRST_INO: u32 = 11;
pub const INODE_SIZE: u16 = 256;
pub const EXTRA_ISIZE: u16 = 32;
pub const DESC_SIZE: u16 = 64;
pub const LOG_GROUPS_PER_FLEX: u8 = 4;
/// `EXT2_FLAGS_SIGNED_HASH`: every reader agrees on signed-char half-MD4 only with this flag (§8).
pub const FLAGS_SIGNED_HASH: u32 = 0x1;

/// Everything that varies between filesystems.
#[derive(Debug, Clone)]
pub struct SuperblockParams {
    pub inodes_count: u32,
    pub blocks_count: u64,
    pub free_blocks: u64,
    pub free_inodes: u32,
    pub inodes_per_group: u32,
    pub blocks_per_group: u32,
    pub fs_time: i64,
    pub uuid: [u8; 16],
    pub label: [u8; 16],
    pub hash_seed: [u32; 4],
    /// `s_jnl_blocks`: the journal inode's i_block (15 words), then i_size_high, i_size.
    pub jnl_blocks: [u32; 17],
}

/// Split a time into the 32-bit low word and the 8-bit `_hi` extension byte.
fn time_lo_hi(t: i64) -> (u32, u8) {
    // Superblock times are unsigned 40-bit; T is never negative in practice, clamp to 0 if it is.
    let t = t.max(0) as u64;
    ((t & 0xFFFF_FFFF) as u32, ((t >> 32) & 0xFF) as u8)
}

impl SuperblockParams {
    /// Render the superblock copy stored in `group` (`s_block_group_nr`), with its checksum.
    pub fn render(&self, group: u32) -> [u8; SB_SIZE] {
        let mut b = [0u8; SB_SIZE];
        put_u32(&mut b, 0x00, self.inodes_count);
        put_u32(&mut b, 0x04, self.blocks_count as u32);
        put_u32(&mut b, 0x08, 0); // s_r_blocks_count_lo: no root reservation
        put_u32(&mut b, 0x0C, self.free_blocks as u32);
        put_u32(&mut b, 0x10, self.free_inodes);
        put_u32(&mut b, 0x14, 0); // s_first_data_block: 0 for 4 KiB blocks
        put_u32(&mut b, 0x18, 2); // s_log_block_size: 1024 << 2
        put_u32(&mut b, 0x1C, 2); // s_log_cluster_size: equal without bigalloc
        put_u32(&mut b, 0x20, self.blocks_per_group);
        put_u32(&mut b, 0x24, self.blocks_per_group);
        put_u32(&mut b, 0x28, self.inodes_per_group);
        let (t_lo, t_hi) = time_lo_hi(self.fs_time);
        put_u32(&mut b, 0x2C, 0); // s_mtime: never mounted
        put_u32(&mut b, 0x30, t_lo); // s_wtime
        put_u16(&mut b, 0x34, 0); // s_mnt_count
        put_u16(&mut b, 0x36, 0xFFFF); // s_max_mnt_count = -1: no forced checks
        put_u16(&mut b, 0x38, MAGIC);
        put_u16(&mut b, 0x3A, 1); // s_state: clean
        put_u16(&mut b, 0x3C, 1); // s_errors: continue (mke2fs default)
        put_u16(&mut b, 0x3E, 0);
        put_u32(&mut b, 0x40, t_lo); // s_lastcheck
        put_u32(&mut b, 0x44, 0); // s_checkinterval
        put_u32(&mut b, 0x48, 0); // s_creator_os: Linux
        put_u32(&mut b, 0x4C, 1); // s_rev_level: dynamic
        put_u32(&mut b, 0x54, FIRST_INO);
        put_u16(&mut b, 0x58, INODE_SIZE);
        put_u16(&mut b, 0x5A, group as u16);
        put_u32(&mut b, 0x5C, FEATURE_COMPAT);
        put_u32(&mut b, 0x60, FEATURE_INCOMPAT);
        put_u32(&mut b, 0x64, FEATURE_RO_COMPAT);
        b[0x68..0x78].copy_from_slice(&self.uuid);
        b[0x78..0x88].copy_from_slice(&self.label);
        put_u16(&mut b, 0xCE, 0); // s_reserved_gdt_blocks: no resize_inode
        put_u32(&mut b, 0xE0, 8); // s_journal_inum
        for (i, w) in self.hash_seed.iter().enumerate() {
            put_u32(&mut b, 0xEC + 4 * i, *w);
        }
        put_u8(&mut b, 0xFC, 1); // s_def_hash_version: half_md4
        put_u8(&mut b, 0xFD, 1); // s_jnl_backup_type: EXT3_JNL_BACKUP_BLOCKS
        put_u16(&mut b, 0xFE, DESC_SIZE);
        put_u32(&mut b, 0x100, 0x0C); // s_default_mount_opts: user_xattr | acl
        put_u32(&mut b, 0x104, 0); // s_first_meta_bg
        put_u32(&mut b, 0x108, t_lo); // s_mkfs_time
        for (i, w) in self.jnl_blocks.iter().enumerate() {
            put_u32(&mut b, 0x10C + 4 * i, *w);
        }
        put_u32(&mut b, 0x150, (self.blocks_count >> 32) as u32);
        put_u32(&mut b, 0x154, 0);
        put_u32(&mut b, 0x158, (self.free_blocks >> 32) as u32);
        put_u16(&mut b, 0x15C, EXTRA_ISIZE); // s_min_extra_isize
        put_u16(&mut b, 0x15E, EXTRA_ISIZE); // s_want_extra_isize
        put_u32(&mut b, 0x160, FLAGS_SIGNED_HASH);
        put_u8(&mut b, 0x174, LOG_GROUPS_PER_FLEX);
        put_u8(&mut b, 0x175, 1); // s_checksum_type: crc32c
        put_u64(&mut b, 0x178, 0); // s_kbytes_written
        put_u8(&mut b, 0x274, t_hi); // s_wtime_hi
        put_u8(&mut b, 0x275, 0); // s_mtime_hi
        put_u8(&mut b, 0x276, t_hi); // s_mkfs_time_hi
        put_u8(&mut b, 0x277, t_hi); // s_lastcheck_hi
        let csum = crc32c_raw(!0, &b[..0x3FC]);
        put_u32(&mut b, 0x3FC, csum);
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::{get_u16, get_u32};

    fn params() -> SuperblockParams {
        SuperblockParams {
            inodes_count: 8192,
            blocks_count: 65536,
            free_blocks: 60000,
            free_inodes: 8000,
            inodes_per_group: 4096,
            blocks_per_group: 32768,
            fs_time: 1_700_000_000,
            uuid: [7; 16],
            label: *b"tessera\0\0\0\0\0\0\0\0\0",
            hash_seed: [1, 2, 3, 4],
            jnl_blocks: [0; 17],
        }
    }

    #[test]
    fn fields_and_checksum() {
        let b = params().render(3);
        assert_eq!(get_u16(&b, 0x38), MAGIC);
        assert_eq!(get_u16(&b, 0x5A), 3);
        assert_eq!(get_u32(&b, 0x5C), 0x2C);
        assert_eq!(get_u32(&b, 0x60), 0x2C2);
        assert_eq!(get_u32(&b, 0x64), 0x46B);
        assert_eq!(get_u32(&b, 0x160), 1);
        assert_eq!(b[0x175], 1);
        assert_eq!(get_u32(&b, 0x3FC), crc32c_raw(!0, &b[..0x3FC]));
    }

    #[test]
    fn copies_differ_only_in_group_and_checksum() {
        let p = params();
        let (a, c) = (p.render(0), p.render(1));
        let diff: Vec<usize> = (0..SB_SIZE).filter(|&i| a[i] != c[i]).collect();
        assert!(diff.iter().all(|&i| i == 0x5A || (0x3FC..0x400).contains(&i)), "{diff:?}");
    }
}
