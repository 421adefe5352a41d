//! Hash-indexed directories (dir_index, reference §8): a dx_root in logical block 0, optionally one level
//! of interior nodes, and leaves that are ordinary linear blocks sorted by hash.

use crate::bytes::{put_u16, put_u32, put_u8};
use crate::checksum::{crc32c_raw, inode_seed};
use crate::dir::{put_entry, rec_len, render_leaf, DirEnt, FT_DIR, LEAF_CAPACITY};
use crate::hash::dx_hash;
use tessera_image::BlockSize;

/// Index entries in the root with a dx_tail: (4096 − 32 − 8) / 8.
pub const ROOT_LIMIT: usize = 507;
/// Index entries in an interior node with a dx_tail: (4096 − 8 − 8) / 8.
pub const NODE_LIMIT: usize = 510;
const ROOT_COUNT_OFF: usize = 32;
const NODE_COUNT_OFF: usize = 8;
/// The hash version stored in dx_root_info: half_md4 (signedness comes from `s_flags`).
pub const HASH_HALF_MD4: u8 = 1;

/// One leaf: a range of the hash-sorted entries and the hash its index entry carries.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Leaf {
    range: std::ops::Range<usize>,
    /// Index hash: the first entry's hash, with bit 0 set if the leaf continues an equal-hash run
    /// from the previous leaf (the kernel's and e2fsck's collision continuation).
    index_hash: u32,
}

/// Pack hash-sorted entries into leaves without splitting a run of equal hashes, unless one run alone
/// exceeds a block (then later pieces are marked as continuations).
fn pack_leaves(entries: &[(u32, DirEnt<'_>)]) -> Vec<Leaf> {
    let mut leaves = Vec::new();
    let mut i = 0;
    let mut start = 0;
    let mut used = 0;
    let mut start_cont = false;
    while i < entries.len() {
        let h = entries[i].0;
        let mut j = i;
        let mut run_bytes = 0;
        while j < entries.len() && entries[j].0 == h {
            run_bytes += rec_len(entries[j].1.name.len());
            j += 1;
        }
        if used + run_bytes <= LEAF_CAPACITY {
            used += run_bytes;
            i = j;
            continue;
        }
        if used > 0 {
            leaves.push(Leaf { range: start..i, index_hash: entries[start].0 | start_cont as u32 });
            start = i;
            used = 0;
            start_cont = false;
            continue;
        }
        // A single run larger than a block: split it entry by entry.
        let mut k = i;
        while k < j {
            let r = rec_len(entries[k].1.name.len());
            if used + r > LEAF_CAPACITY {
                leaves.push(Leaf { range: start..k, index_hash: entries[start].0 | start_cont as u32 });
                start = k;
                used = 0;
                start_cont = true;
            }
            used += r;
            k += 1;
        }
        i = j;
    }
    if start < entries.len() {
        leaves.push(Leaf { range: start..entries.len(), index_hash: entries[start].0 | start_cont as u32 });
    }
    leaves
}

/// Write an index block's count/limit header and entries, then the dx_tail checksum.
fn put_index(b: &mut [u8], count_off: usize, limit: usize, entries: &[(u32, u32)], seed: u32) {
    put_u16(b, count_off, limit as u16);
    put_u16(b, count_off + 2, entries.len() as u16);
    for (i, &(hash, block)) in entries.iter().enumerate() {
        let off = count_off + 8 * i;
        // The first entry's hash slot holds count/limit; its hash is implicitly 0.
        if i > 0 {
            put_u32(b, off, hash);
        }
        put_u32(b, off + 4, block);
    }
    let tail = count_off + 8 * limit;
    debug_assert_eq!(tail, BlockSize::USIZE - 8);
    put_u32(b, tail, 0); // dt_reserved
    let c = crc32c_raw(seed, &b[..count_off + 8 * entries.len()]);
    let c = crc32c_raw(c, &b[tail..tail + 4]);
    let c = crc32c_raw(c, &[0; 4]);
    put_u32(b, tail + 4, c);
}

/// Render an indexed directory, or `None` if it needs more than two index levels (callers then fall back
/// to a linear directory, which is always valid).
pub fn render_htree(
    dir_ino: u32,
    parent_ino: u32,
    children: &[DirEnt<'_>],
    hash_seed: &[u32; 4],
    fs_seed: u32,
) -> Option<Vec<Vec<u8>>> {
    let mut sorted: Vec<(u32, DirEnt<'_>)> =
        children.iter().map(|e| (dx_hash(e.name, hash_seed), *e)).collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.name.cmp(b.1.name)));
    let leaves = pack_leaves(&sorted);
    let seed = inode_seed(fs_seed, dir_ino, 0);

    let (levels, nodes) = if leaves.len() <= ROOT_LIMIT {
        (0u8, 0usize)
    } else {
        let n = leaves.len().div_ceil(NODE_LIMIT);
        if n > ROOT_LIMIT {
            return None;
        }
        (1, n)
    };
    let first_leaf = 1 + nodes;
    let leaf_index: Vec<(u32, u32)> =
        leaves.iter().enumerate().map(|(i, l)| (l.index_hash, (first_leaf + i) as u32)).collect();

    let mut out = Vec::with_capacity(first_leaf + leaves.len());
    let mut root = vec![0u8; BlockSize::USIZE];
    put_entry(&mut root, 0, &DirEnt { ino: dir_ino, file_type: FT_DIR, name: b"." }, 12);
    put_entry(
        &mut root,
        12,
        &DirEnt { ino: parent_ino, file_type: FT_DIR, name: b".." },
        BlockSize::USIZE - 12,
    );
    put_u32(&mut root, 24, 0); // reserved_zero
    put_u8(&mut root, 28, HASH_HALF_MD4);
    put_u8(&mut root, 29, 8); // info_length
    put_u8(&mut root, 30, levels);
    put_u8(&mut root, 31, 0);
    if levels == 0 {
        put_index(&mut root, ROOT_COUNT_OFF, ROOT_LIMIT, &leaf_index, seed);
        out.push(root);
    } else {
        let node_chunks: Vec<&[(u32, u32)]> = leaf_index.chunks(NODE_LIMIT).collect();
        let root_index: Vec<(u32, u32)> =
            node_chunks.iter().enumerate().map(|(i, c)| (c[0].0, (1 + i) as u32)).collect();
        put_index(&mut root, ROOT_COUNT_OFF, ROOT_LIMIT, &root_index, seed);
        out.push(root);
        for chunk in node_chunks {
            let mut b = vec![0u8; BlockSize::USIZE];
            // A fake empty dirent spanning the block, so linear readers skip the node.
            put_u32(&mut b, 0, 0);
            put_u16(&mut b, 4, BlockSize::USIZE as u16);
            put_index(&mut b, NODE_COUNT_OFF, NODE_LIMIT, chunk, seed);
            out.push(b);
        }
    }
    for leaf in &leaves {
        let ents: Vec<DirEnt<'_>> = sorted[leaf.range.clone()].iter().map(|(_, e)| *e).collect();
        out.push(render_leaf(&ents, dir_ino, fs_seed));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::{get_u16, get_u32};
    use crate::dir::FT_REG;

    const SEED: [u32; 4] = [0x1111, 0x2222, 0x3333, 0x4444];

    fn names(n: usize, len: usize) -> Vec<Vec<u8>> {
        (0..n).map(|i| format!("{i:0len$}").into_bytes()).collect()
    }

    fn ents(names: &[Vec<u8>]) -> Vec<DirEnt<'_>> {
        names
            .iter()
            .enumerate()
            .map(|(i, n)| DirEnt { ino: 100 + i as u32, file_type: FT_REG, name: n })
            .collect()
    }

    /// Decode (hash, block) pairs from an index block.
    fn index(b: &[u8], off: usize) -> (u16, Vec<(u32, u32)>) {
        let limit = get_u16(b, off);
        let count = get_u16(b, off + 2) as usize;
        (
            limit,
            (0..count)
                .map(|i| (if i == 0 { 0 } else { get_u32(b, off + 8 * i) }, get_u32(b, off + 8 * i + 4)))
                .collect(),
        )
    }

    #[test]
    fn one_level() {
        let n = names(2000, 20);
        let blocks = render_htree(12, 2, &ents(&n), &SEED, 5).expect("fits");
        let root = &blocks[0];
        assert_eq!(get_u16(root, 16), 4084); // `..` rec_len
        assert_eq!(&root[28..32], &[1, 8, 0, 0]);
        let (limit, idx) = index(root, 32);
        assert_eq!(limit as usize, ROOT_LIMIT);
        assert_eq!(idx.len(), blocks.len() - 1);
        // Hashes ascend and each leaf's entries lie within its range.
        for w in idx.windows(2) {
            assert!(w[0].0 < w[1].0);
        }
        for (i, &(h, blk)) in idx.iter().enumerate() {
            let leaf = &blocks[blk as usize];
            let next = idx.get(i + 1).map(|x| x.0).unwrap_or(u32::MAX);
            let mut off = 0;
            while off < LEAF_CAPACITY {
                let rec = get_u16(leaf, off + 4) as usize;
                let nl = leaf[off + 6] as usize;
                let hash = dx_hash(&leaf[off + 8..off + 8 + nl], &SEED);
                assert!(hash >= h && hash < next);
                off += rec;
            }
            assert_eq!(off, LEAF_CAPACITY);
        }
        // Root checksum.
        let seed = inode_seed(5, 12, 0);
        let c = crc32c_raw(seed, &root[..32 + 8 * idx.len()]);
        let c = crc32c_raw(crc32c_raw(c, &[0; 4]), &[0; 4]);
        assert_eq!(get_u32(root, 4092), c);
    }

    #[test]
    fn two_levels() {
        let n = names(100_000, 40);
        let blocks = render_htree(12, 2, &ents(&n), &SEED, 5).expect("fits");
        let root = &blocks[0];
        assert_eq!(root[30], 1);
        let (_, ridx) = index(root, 32);
        let (limit, nidx) = index(&blocks[1], 8);
        assert_eq!(limit as usize, NODE_LIMIT);
        assert_eq!(get_u16(&blocks[1], 4), 4096);
        assert_eq!(nidx.len(), NODE_LIMIT);
        let total: usize = ridx.iter().map(|&(_, b)| index(&blocks[b as usize], 8).1.len()).sum();
        assert_eq!(total, blocks.len() - 1 - ridx.len());
    }

    #[test]
    fn collisions_are_not_split() {
        // Fake hashes: a run of 10 equal hashes must end up in one leaf.
        let n = names(400, 200);
        let e = ents(&n);
        let sorted: Vec<(u32, DirEnt<'_>)> =
            e.iter().enumerate().map(|(i, x)| ((i as u32 / 10) * 2, *x)).collect();
        let leaves = pack_leaves(&sorted);
        for l in &leaves {
            assert_eq!(l.range.start % 10, 0, "{l:?}");
            assert_eq!(l.index_hash & 1, 0);
        }
        // One giant run must be split with continuation bits.
        let same: Vec<(u32, DirEnt<'_>)> = e.iter().map(|x| (42, *x)).collect();
        let leaves = pack_leaves(&same);
        assert!(leaves.len() > 1);
        assert_eq!(leaves[0].index_hash, 42);
        assert!(leaves[1..].iter().all(|l| l.index_hash == 43));
    }
}
