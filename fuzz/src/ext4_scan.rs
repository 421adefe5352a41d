//! `ext4_scan`: the inode scan behind `serve --programs-whole` ([`tessera_ext4::scan::regular_files`]):
//! it reads the metadata of any image a daemon serves, which whoever built the image chose.
//!
//! Input: a count of byte flips (one byte), the flips (a little-endian `u32` offset into the
//! metadata, a byte to xor there), then a tree in [`crate::ext4_roundtrip::tree`]'s format.
//! The tree is synthesized; its metadata blocks, as the image holds them (all-zero blocks left
//! out), are scanned.
//!
//! Properties: without flips, the scan lists exactly the tree's regular files — per file node
//! one entry with its permissions, size and first data block (the synthesizer's placement of
//! logical block 0; none for a file whose block 0 is a hole) — and nothing else. With flips:
//! never a panic, and every entry is an in-use regular file (the file type in its mode).

use std::collections::HashMap;

use tessera_ext4::scan::regular_files;
use tessera_ext4::{synthesize, NodeKind};

use crate::Input;

const BLOCK: usize = 4096;

/// The fuzz target body.
pub fn run(data: &[u8]) {
    let mut i = Input::new(data);
    let flips: Vec<(u32, u8)> = (0..i.u8() % 16).map(|_| (i.u32(), i.u8())).collect();
    let (tree, opts) = crate::ext4_roundtrip::tree(i.rest());
    let Ok(img) = synthesize(&tree, &opts) else { return };
    let mut blocks: HashMap<u64, Vec<u8>> = HashMap::new();
    for run in &img.metadata {
        for (k, b) in run.data.chunks(BLOCK).enumerate() {
            blocks.insert(run.start_block + k as u64, b.to_vec());
        }
    }
    if flips.is_empty() {
        let mut found: Vec<(u16, u64, Option<u64>)> = regular_files(|b| blocks.get(&b))
            .iter()
            .map(|f| (f.mode & 0o7777, f.size, f.first_block))
            .collect();
        let mut want: Vec<(u16, u64, Option<u64>)> = tree
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(n, node)| match node.kind {
                NodeKind::Regular { size, .. } => {
                    let first =
                        img.placements[n].first().filter(|p| p.file_block == 0).map(|p| p.device_block);
                    Some((node.meta.mode & 0o7777, size, first))
                }
                _ => None,
            })
            .collect();
        found.sort_unstable();
        want.sort_unstable();
        assert_eq!(found, want, "the scan's files are not the tree's");
        return;
    }
    // Flips land in the metadata in device order (offsets wrap around its length).
    let mut order: Vec<u64> = blocks.keys().copied().collect();
    order.sort_unstable();
    let total = order.len() * BLOCK;
    if total == 0 {
        return;
    }
    for (at, x) in flips {
        let at = at as usize % total;
        if let Some(b) = blocks.get_mut(&order[at / BLOCK]) {
            b[at % BLOCK] ^= x;
        }
    }
    for f in regular_files(|b| blocks.get(&b)) {
        assert_eq!(f.mode & 0xF000, 0x8000, "not a regular file: {f:?}");
    }
}

/// Seeds: `ext4_roundtrip`'s trees, as they are and with a few flips in the superblock, the
/// group descriptors and an inode table.
pub fn seeds() -> crate::seeds::Seeds {
    let mut out = Vec::new();
    for (name, tree) in crate::ext4_roundtrip::seeds() {
        let mut plain = vec![0u8];
        plain.extend_from_slice(&tree);
        out.push((format!("{name}-as-is"), plain));
        let mut flipped = vec![3u8];
        for (at, x) in [(1024 + 0x28, 0x40u8), (4096 + 8, 0x01), (3 * 4096 + 0x20, 0x08)] {
            flipped.extend_from_slice(&(at as u32).to_le_bytes());
            flipped.push(x);
        }
        flipped.extend_from_slice(&tree);
        out.push((format!("{name}-flipped"), flipped));
    }
    out
}
