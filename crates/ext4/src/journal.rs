//! The internal journal (inode 8): a clean JBD2 v2 superblock in its first block, zeros elsewhere.
//! Reference §11. All JBD2 fields are big-endian.

use crate::bytes::put_be32;
use tessera_image::BlockSize;

pub const JBD2_MAGIC: u32 = 0xC03B_3998;
const SUPERBLOCK_V2: u32 = 4;
/// `JBD2_MIN_JOURNAL_BLOCKS`: smaller journals are rejected by e2fsck and the kernel.
pub const MIN_JOURNAL_BLOCKS: u64 = 1024;
/// One 32768-block extent (128 MiB) keeps the journal contiguous and in-inode.
pub const MAX_JOURNAL_BLOCKS: u64 = 32768;

/// mke2fs's default journal size for a filesystem of `blocks` 4 KiB blocks
/// (`ext2fs_default_journal_size`), capped at 128 MiB.
pub fn default_journal_blocks(blocks: u64) -> u64 {
    let j = if blocks < 32768 {
        1024
    } else if blocks < 256 * 1024 {
        4096
    } else if blocks < 512 * 1024 {
        8192
    } else if blocks < 4096 * 1024 {
        16384
    } else {
        32768
    };
    j.clamp(MIN_JOURNAL_BLOCKS, MAX_JOURNAL_BLOCKS)
}

/// Render journal block 0: a clean (s_start = 0) v2 superblock with no features, as mke2fs writes it.
pub fn render_superblock(journal_blocks: u64, uuid: &[u8; 16]) -> Vec<u8> {
    let mut b = vec![0u8; BlockSize::USIZE];
    put_be32(&mut b, 0x00, JBD2_MAGIC);
    put_be32(&mut b, 0x04, SUPERBLOCK_V2);
    put_be32(&mut b, 0x08, 0); // h_sequence
    put_be32(&mut b, 0x0C, BlockSize::U32); // s_blocksize
    put_be32(&mut b, 0x10, journal_blocks as u32); // s_maxlen
    put_be32(&mut b, 0x14, 1); // s_first
    put_be32(&mut b, 0x18, 1); // s_sequence
    put_be32(&mut b, 0x1C, 0); // s_start: nothing to replay
    b[0x30..0x40].copy_from_slice(uuid);
    put_be32(&mut b, 0x40, 1); // s_nr_users
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_mke2fs() {
        assert_eq!(default_journal_blocks(2560), 1024);
        assert_eq!(default_journal_blocks(32768), 4096);
        assert_eq!(default_journal_blocks(300_000), 8192);
        assert_eq!(default_journal_blocks(1 << 21), 16384);
        assert_eq!(default_journal_blocks(1 << 30), 32768);
    }

    #[test]
    fn superblock_fields() {
        let b = render_superblock(4096, &[9; 16]);
        assert_eq!(&b[0..4], &[0xC0, 0x3B, 0x39, 0x98]);
        assert_eq!(&b[4..8], &[0, 0, 0, 4]);
        assert_eq!(&b[0x10..0x14], &[0, 0, 0x10, 0]);
        assert_eq!(&b[0x1C..0x20], &[0, 0, 0, 0]);
        assert_eq!(&b[0x30..0x40], &[9; 16]);
        assert!(b[0x400..].iter().all(|&x| x == 0));
    }
}
