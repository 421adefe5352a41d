//! Linear directory blocks (reference §8): `ext2_dir_entry_2` records plus the 12-byte checksum tail
//! that metadata_csum requires at the end of every leaf block.

use crate::bytes::{align4, put_u16, put_u32, put_u8};
use crate::checksum::{crc32c_raw, inode_seed};
use tessera_image::BlockSize;

/// Bytes available to entries in a leaf block: everything before the 12-byte tail.
pub const LEAF_CAPACITY: usize = BlockSize::USIZE - 12;

pub const FT_REG: u8 = 1;
pub const FT_DIR: u8 = 2;
pub const FT_CHR: u8 = 3;
pub const FT_BLK: u8 = 4;
pub const FT_FIFO: u8 = 5;
pub const FT_SOCK: u8 = 6;
pub const FT_SYMLINK: u8 = 7;

/// One directory entry to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirEnt<'a> {
    pub ino: u32,
    pub file_type: u8,
    pub name: &'a [u8],
}

/// Minimal record length of an entry with a name of `name_len` bytes.
pub fn rec_len(name_len: usize) -> usize {
    align4(8 + name_len).max(12)
}

/// Write one entry header and name at `off`.
pub fn put_entry(b: &mut [u8], off: usize, e: &DirEnt<'_>, rec: usize) {
    put_u32(b, off, e.ino);
    put_u16(b, off + 4, rec as u16);
    put_u8(b, off + 6, e.name.len() as u8);
    put_u8(b, off + 7, e.file_type);
    b[off + 8..off + 8 + e.name.len()].copy_from_slice(e.name);
}

/// Render a leaf block holding `entries` in order; the last record stretches to the tail.
/// An empty slice gives an "empty" block (one unused record covering the block).
pub fn render_leaf(entries: &[DirEnt<'_>], dir_ino: u32, fs_seed: u32) -> Vec<u8> {
    let mut b = vec![0u8; BlockSize::USIZE];
    let mut off = 0;
    if entries.is_empty() {
        put_u16(&mut b, 4, LEAF_CAPACITY as u16);
    }
    for (i, e) in entries.iter().enumerate() {
        let rec = if i + 1 == entries.len() { LEAF_CAPACITY - off } else { rec_len(e.name.len()) };
        put_entry(&mut b, off, e, rec);
        off += rec;
    }
    seal_leaf(&mut b, dir_ino, fs_seed);
    b
}

/// Write the fake-dirent tail (inode 0, rec_len 12, name_len 0, type 0xDE) and its crc32c.
pub fn seal_leaf(b: &mut [u8], dir_ino: u32, fs_seed: u32) {
    let t = LEAF_CAPACITY;
    put_u32(b, t, 0);
    put_u16(b, t + 4, 12);
    put_u8(b, t + 6, 0);
    put_u8(b, t + 7, 0xDE);
    let c = crc32c_raw(inode_seed(fs_seed, dir_ino, 0), &b[..t]);
    put_u32(b, t + 8, c);
}

/// Greedily pack entries (in the given order) into leaf blocks; returns index ranges per block.
pub fn pack(entries: &[DirEnt<'_>]) -> Vec<std::ops::Range<usize>> {
    let mut blocks = Vec::new();
    let mut start = 0;
    let mut used = 0;
    for (i, e) in entries.iter().enumerate() {
        let r = rec_len(e.name.len());
        if used + r > LEAF_CAPACITY {
            blocks.push(start..i);
            start = i;
            used = 0;
        }
        used += r;
    }
    if start < entries.len() || blocks.is_empty() {
        blocks.push(start..entries.len());
    }
    blocks
}

/// Render a linear directory: `.` and `..` first, then `children` in the given order, then `min_blocks`
/// padding with empty blocks (lost+found gets 4 blocks, as mke2fs does).
pub fn render_linear(
    dir_ino: u32,
    parent_ino: u32,
    children: &[DirEnt<'_>],
    min_blocks: usize,
    fs_seed: u32,
) -> Vec<Vec<u8>> {
    let mut all = Vec::with_capacity(children.len() + 2);
    all.push(DirEnt { ino: dir_ino, file_type: FT_DIR, name: b"." });
    all.push(DirEnt { ino: parent_ino, file_type: FT_DIR, name: b".." });
    all.extend_from_slice(children);
    let mut out: Vec<Vec<u8>> =
        pack(&all).into_iter().map(|r| render_leaf(&all[r], dir_ino, fs_seed)).collect();
    while out.len() < min_blocks {
        out.push(render_leaf(&[], dir_ino, fs_seed));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::{get_u16, get_u32};

    #[test]
    fn rec_lens() {
        assert_eq!(rec_len(1), 12);
        assert_eq!(rec_len(4), 12);
        assert_eq!(rec_len(5), 16);
        assert_eq!(rec_len(255), 264);
    }

    #[test]
    fn leaf_layout_and_tail() {
        let names: Vec<Vec<u8>> = (0..3).map(|i| format!("file{i}").into_bytes()).collect();
        let children: Vec<DirEnt<'_>> = names
            .iter()
            .enumerate()
            .map(|(i, n)| DirEnt { ino: 20 + i as u32, file_type: FT_REG, name: n })
            .collect();
        let blocks = render_linear(12, 2, &children, 1, 99);
        assert_eq!(blocks.len(), 1);
        let b = &blocks[0];
        assert_eq!(get_u32(b, 0), 12);
        assert_eq!(get_u16(b, 4), 12);
        assert_eq!(&b[8..9], b".");
        assert_eq!(get_u32(b, 12), 2);
        assert_eq!(&b[20..22], b"..");
        // Last entry (offset 24 + 16 + 16) stretches to the tail.
        assert_eq!(get_u16(b, 56 + 4) as usize, LEAF_CAPACITY - 56);
        assert_eq!(get_u16(b, 4084 + 4), 12);
        assert_eq!(b[4084 + 7], 0xDE);
        assert_eq!(get_u32(b, 4092), crc32c_raw(inode_seed(99, 12, 0), &b[..4084]));
    }

    #[test]
    fn packing_and_padding() {
        let name = vec![b'x'; 255];
        let children: Vec<DirEnt<'_>> =
            (0..40).map(|i| DirEnt { ino: 100 + i, file_type: FT_REG, name: &name }).collect();
        let blocks = render_linear(11, 2, &children, 4, 0);
        // 15 × 264 = 3960 fit after the 24 bytes of dots in block 0; 15 per following block.
        assert_eq!(blocks.len(), 4);
        let empty = render_leaf(&[], 11, 0);
        assert_eq!(get_u32(&empty, 0), 0);
        assert_eq!(get_u16(&empty, 4) as usize, LEAF_CAPACITY);
        let lf = render_linear(11, 2, &[], 4, 0);
        assert_eq!(lf.len(), 4);
        assert_eq!(lf[3], empty);
    }
}
