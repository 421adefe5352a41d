//! Extent trees (reference §7): the in-inode root (up to 4 entries) and, for more extents, packed
//! 340-entry tree blocks with checksum tails.
//!
//! Trees are minimal (fewest levels) and packed (every node full except the last at each level), which is
//! exactly what e2fsck considers optimal; anything looser prints "extent tree could be narrower/shorter".

use crate::bytes::{put_u16, put_u32};
use crate::checksum::{crc32c_raw, inode_seed};
use tessera_image::BlockSize;

pub const EXTENT_MAGIC: u16 = 0xF30A;
/// Entries in the 60-byte in-inode root: (60 − 12) / 12.
pub const ROOT_MAX: usize = 4;
/// Entries in a tree block: (4096 − 12) / 12; the checksum tail follows at 12 + 12·340 = 4092.
pub const NODE_MAX: usize = 340;
/// Longest initialized extent (`EXT_INIT_MAX_LEN`); longer lengths mean "unwritten".
pub const MAX_EXTENT_LEN: u64 = 32768;

/// One leaf extent: `len` file blocks from `lblk` mapped to device blocks from `pblk`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub lblk: u32,
    pub len: u16,
    pub pblk: u64,
}

/// Number of tree blocks (index + leaf, excluding the in-inode root) a tree of `n` extents needs.
pub fn tree_blocks(n: usize) -> usize {
    level_sizes(n).iter().sum()
}

/// Node counts per on-disk level, leaves first; empty when the root holds all extents.
fn level_sizes(n: usize) -> Vec<usize> {
    let mut levels = Vec::new();
    let mut count = n;
    while count > ROOT_MAX {
        count = count.div_ceil(NODE_MAX);
        levels.push(count);
    }
    levels
}

fn put_header(buf: &mut [u8], entries: usize, max: usize, depth: usize) {
    put_u16(buf, 0, EXTENT_MAGIC);
    put_u16(buf, 2, entries as u16);
    put_u16(buf, 4, max as u16);
    put_u16(buf, 6, depth as u16);
    put_u32(buf, 8, 0); // eh_generation
}

fn put_leaf_entry(buf: &mut [u8], off: usize, e: &Extent) {
    put_u32(buf, off, e.lblk);
    put_u16(buf, off + 4, e.len);
    put_u16(buf, off + 6, (e.pblk >> 32) as u16);
    put_u32(buf, off + 8, e.pblk as u32);
}

fn put_index_entry(buf: &mut [u8], off: usize, lblk: u32, child: u64) {
    put_u32(buf, off, lblk);
    put_u32(buf, off + 4, child as u32);
    put_u16(buf, off + 8, (child >> 32) as u16);
    put_u16(buf, off + 10, 0);
}

/// A rendered extent tree: the inode's `i_block` plus the tree blocks with their device numbers.
#[derive(Debug, Clone)]
pub struct RenderedTree {
    pub i_block: [u8; 60],
    pub blocks: Vec<(u64, Vec<u8>)>,
}

/// Build the tree for `extents` (sorted, non-overlapping) owned by inode `ino`, placing tree blocks at
/// `tree_block_nrs` (exactly [`tree_blocks`]`(extents.len())` of them).
pub fn build_tree(extents: &[Extent], tree_block_nrs: &[u64], ino: u32, fs_seed: u32) -> RenderedTree {
    let levels = level_sizes(extents.len());
    debug_assert_eq!(levels.iter().sum::<usize>(), tree_block_nrs.len());
    let seed = inode_seed(fs_seed, ino, 0);
    let mut i_block = [0u8; 60];
    if levels.is_empty() {
        put_header(&mut i_block, extents.len(), ROOT_MAX, 0);
        for (i, e) in extents.iter().enumerate() {
            put_leaf_entry(&mut i_block, 12 + 12 * i, e);
        }
        return RenderedTree { i_block, blocks: Vec::new() };
    }

    // Assign block numbers top-down: the highest level first, so a reader walks forward on disk.
    let mut level_blocks: Vec<&[u64]> = vec![&[]; levels.len()];
    let mut next = 0;
    for (lvl, &count) in levels.iter().enumerate().rev() {
        level_blocks[lvl] = &tree_block_nrs[next..next + count];
        next += count;
    }

    let mut blocks = Vec::with_capacity(tree_block_nrs.len());
    // Leaves: chunks of 340 extents.
    let mut first_lblks: Vec<u32> = Vec::with_capacity(levels[0]);
    for (i, chunk) in extents.chunks(NODE_MAX).enumerate() {
        let mut b = vec![0u8; BlockSize::USIZE];
        put_header(&mut b, chunk.len(), NODE_MAX, 0);
        for (j, e) in chunk.iter().enumerate() {
            put_leaf_entry(&mut b, 12 + 12 * j, e);
        }
        seal(&mut b, seed);
        first_lblks.push(chunk[0].lblk);
        blocks.push((level_blocks[0][i], b));
    }
    // Index levels above the leaves.
    for lvl in 1..levels.len() {
        let children = level_blocks[lvl - 1];
        let mut next_first = Vec::with_capacity(levels[lvl]);
        for (i, chunk) in first_lblks.chunks(NODE_MAX).enumerate() {
            let mut b = vec![0u8; BlockSize::USIZE];
            put_header(&mut b, chunk.len(), NODE_MAX, lvl);
            for (j, &lblk) in chunk.iter().enumerate() {
                put_index_entry(&mut b, 12 + 12 * j, lblk, children[i * NODE_MAX + j]);
            }
            seal(&mut b, seed);
            next_first.push(chunk[0]);
            blocks.push((level_blocks[lvl][i], b));
        }
        first_lblks = next_first;
    }
    // The root indexes the top level.
    let top = levels.len() - 1;
    put_header(&mut i_block, first_lblks.len(), ROOT_MAX, levels.len());
    for (j, &lblk) in first_lblks.iter().enumerate() {
        put_index_entry(&mut i_block, 12 + 12 * j, lblk, level_blocks[top][j]);
    }
    blocks.sort_by_key(|(nr, _)| *nr);
    RenderedTree { i_block, blocks }
}

/// Write the checksum tail of a tree block: crc32c over the header and all 340 entry slots.
fn seal(b: &mut [u8], seed: u32) {
    let end = 12 + 12 * NODE_MAX;
    let c = crc32c_raw(seed, &b[..end]);
    put_u32(b, end, c);
}

/// Split a mapping of `blocks` file blocks at `lblk` onto device blocks at `pblk` into extents of at
/// most 32768 blocks.
pub fn split_extents(lblk: u64, pblk: u64, blocks: u64, out: &mut Vec<Extent>) {
    let mut done = 0;
    while done < blocks {
        let len = (blocks - done).min(MAX_EXTENT_LEN);
        out.push(Extent { lblk: (lblk + done) as u32, len: len as u16, pblk: pblk + done });
        done += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::get_u16;
    use crate::bytes::get_u32;

    fn extents(n: usize) -> Vec<Extent> {
        (0..n).map(|i| Extent { lblk: (i * 2) as u32, len: 1, pblk: 1000 + i as u64 * 2 }).collect()
    }

    #[test]
    fn shapes() {
        assert_eq!(tree_blocks(0), 0);
        assert_eq!(tree_blocks(4), 0);
        assert_eq!(tree_blocks(5), 1);
        assert_eq!(tree_blocks(340), 1);
        assert_eq!(tree_blocks(341), 2);
        assert_eq!(tree_blocks(1360), 4);
        // 1361 extents: 5 leaves need one index block (depth 2).
        assert_eq!(tree_blocks(1361), 6);
        assert_eq!(tree_blocks(4 * 340 * 340), 4 * 340 + 4);
        assert_eq!(tree_blocks(4 * 340 * 340 + 1), 1361 + 5 + 1);
    }

    #[test]
    fn depth0_and_empty() {
        let t = build_tree(&[], &[], 12, 0);
        assert_eq!(&t.i_block[..12], &[0x0A, 0xF3, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0]);
        let t = build_tree(&extents(4), &[], 12, 0);
        assert_eq!(get_u16(&t.i_block, 2), 4);
        assert_eq!(get_u32(&t.i_block, 12 + 36), 6);
    }

    #[test]
    fn depth1_and_depth2() {
        let ex = extents(700);
        let t = build_tree(&ex, &[50, 51, 52], 12, 7);
        assert_eq!(get_u16(&t.i_block, 2), 3);
        assert_eq!(get_u16(&t.i_block, 6), 1);
        assert_eq!(get_u32(&t.i_block, 12 + 12), 680); // second leaf starts at extent 340
        assert_eq!(get_u32(&t.i_block, 12 + 12 + 4), 51);
        let (nr, leaf) = &t.blocks[2];
        assert_eq!(*nr, 52);
        assert_eq!(get_u16(leaf, 2), 20);
        assert_eq!(get_u32(leaf, 4092), crc32c_raw(inode_seed(7, 12, 0), &leaf[..4092]));

        let ex = extents(1361);
        let nrs: Vec<u64> = (100..106).collect();
        let t = build_tree(&ex, &nrs, 12, 7);
        assert_eq!(get_u16(&t.i_block, 6), 2);
        assert_eq!(get_u16(&t.i_block, 2), 1);
        assert_eq!(get_u32(&t.i_block, 16), 100); // the index block comes first
        let (_, idx) = &t.blocks[0];
        assert_eq!(get_u16(idx, 2), 5);
        assert_eq!(get_u16(idx, 6), 1);
        assert_eq!(get_u32(idx, 12 + 4 * 12), 4 * 340 * 2); // ei_block of the 5th leaf
    }

    #[test]
    fn splitting() {
        let mut v = Vec::new();
        split_extents(10, 5000, 70_000, &mut v);
        assert_eq!(v.len(), 3);
        assert_eq!(v[1], Extent { lblk: 10 + 32768, len: 32768, pblk: 5000 + 32768 });
        assert_eq!(v[2].len as u64, 70_000 - 65536);
    }
}
