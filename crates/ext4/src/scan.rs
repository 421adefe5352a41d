//! Reading side, for the daemon: the regular files an ext4 image's metadata describes, with their
//! mode, size and first data block — the one question the serving path asks of inodes (which
//! files are programs, and where they start), answered without mounting or walking directories.
//!
//! Pure: metadata blocks come through a closure (the daemon holds the image's metadata in
//! memory); any ext4 with 4 KiB blocks and extent-mapped files is read, not only what
//! [`crate::synthesize`] writes. Bytes that do not make sense (a bad magic, fields out of range,
//! a block the closure does not have) end the scan of what they describe, never panic.

/// One regular file of the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegularFile {
    pub inode: u32,
    /// `i_mode`: permission bits and the file type.
    pub mode: u16,
    pub size: u64,
    /// The device block holding the file's first byte (its logical block 0); `None` for a file
    /// whose first block is a hole or is not mapped by an extent this scan could read.
    pub first_block: Option<u64>,
}

impl RegularFile {
    /// Whether any execute bit is set.
    pub fn executable(&self) -> bool {
        self.mode & 0o111 != 0
    }
}

const BLOCK: usize = 4096;
const SB_OFFSET: usize = 1024;
const S_MAGIC: u16 = 0xEF53;
const INCOMPAT_64BIT: u32 = 0x80;
const S_IFMT: u16 = 0xF000;
const S_IFREG: u16 = 0x8000;
const EXTENTS_FL: u32 = 0x80000;
const EXTENT_MAGIC: u16 = 0xF30A;
/// Deeper extent trees are not ext4's (its limit is 5).
const MAX_DEPTH: u16 = 5;

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// The geometry the scan needs, from the superblock in device block 0.
struct Layout {
    inodes_per_group: u32,
    groups: u32,
    inode_size: usize,
    /// The first inode that is not reserved (the journal's and the others below are not files
    /// of the tree).
    first_ino: u32,
    desc_size: usize,
    /// The group descriptor table's first block.
    gdt: u64,
}

fn layout(block0: &[u8]) -> Option<Layout> {
    let sb = block0.get(SB_OFFSET..SB_OFFSET + 1024)?;
    if u16_at(sb, 0x38)? != S_MAGIC || u32_at(sb, 0x18)? != 2 {
        return None; // not ext4, or blocks other than 4 KiB
    }
    let inodes = u32_at(sb, 0x00)?;
    let inodes_per_group = u32_at(sb, 0x28)?;
    let inode_size = usize::from(u16_at(sb, 0x58)?);
    // An inode bitmap is one block: at most 8 × 4096 inodes a group.
    let ipg_ok = (1..=8 * BLOCK as u32).contains(&inodes_per_group);
    if !ipg_ok || !(128..=BLOCK).contains(&inode_size) || !inode_size.is_power_of_two() {
        return None;
    }
    let desc_size = if u32_at(sb, 0x60)? & INCOMPAT_64BIT != 0 { usize::from(u16_at(sb, 0xFE)?) } else { 32 };
    if !(32..=1024).contains(&desc_size) || !desc_size.is_power_of_two() {
        return None;
    }
    Some(Layout {
        inodes_per_group,
        groups: inodes.div_ceil(inodes_per_group),
        inode_size,
        first_ino: u32_at(sb, 0x54)?,
        desc_size,
        gdt: u64::from(u32_at(sb, 0x14)?) + 1,
    })
}

/// Every in-use regular file (reserved inodes aside) of the image whose metadata `block` gives
/// (device block number → its 4096 bytes, `None` for a block it does not hold), in inode order.
pub fn regular_files<B: AsRef<[u8]>>(block: impl Fn(u64) -> Option<B>) -> Vec<RegularFile> {
    let mut out = Vec::new();
    let Some(l) = block(0).and_then(|b| layout(b.as_ref())) else { return out };
    let per_block = BLOCK / l.inode_size;
    for group in 0..l.groups {
        let at = group as usize * l.desc_size;
        // The descriptor table is contiguous: a block of it missing ends the scan (so the work
        // is bounded by the metadata at hand, whatever the superblock claims).
        let Some(desc) = block(l.gdt + (at / BLOCK) as u64) else { break };
        let desc = desc.as_ref().get(at % BLOCK..at % BLOCK + l.desc_size).map(<[u8]>::to_vec);
        let Some(desc) = desc else { break };
        let hi = if l.desc_size >= 64 { u32_at(&desc, 0x28).unwrap_or(0) } else { 0 };
        let Some(table) = u32_at(&desc, 0x08).map(|lo| u64::from(hi) << 32 | u64::from(lo)) else { continue };
        let unused = if l.desc_size >= 64 {
            u32::from(u16_at(&desc, 0x1C).unwrap_or(0)) | u32::from(u16_at(&desc, 0x32).unwrap_or(0)) << 16
        } else {
            u32::from(u16_at(&desc, 0x1C).unwrap_or(0))
        };
        let used = l.inodes_per_group.saturating_sub(unused);
        // Block by block; a block the metadata does not hold (all zeros: no inode in use) is
        // skipped whole.
        for first in (0..used).step_by(per_block) {
            let Some(data) = table.checked_add(u64::from(first) / per_block as u64).and_then(&block) else {
                continue;
            };
            for i in first..used.min(first.saturating_add(per_block as u32)) {
                let within = (i - first) as usize;
                let Some(raw) = data.as_ref().get(within * l.inode_size..(within + 1) * l.inode_size) else {
                    break;
                };
                let inode = group.checked_mul(l.inodes_per_group).and_then(|n| n.checked_add(i + 1));
                let inode = inode.filter(|&ino| ino >= l.first_ino);
                if let Some(file) = inode.and_then(|ino| regular_file(ino, raw, &block)) {
                    out.push(file);
                }
            }
        }
    }
    out
}

/// Inode `ino` (its `raw` bytes) if it is an in-use regular file.
fn regular_file<B: AsRef<[u8]>>(
    ino: u32,
    raw: &[u8],
    block: &impl Fn(u64) -> Option<B>,
) -> Option<RegularFile> {
    let mode = u16_at(raw, 0x00)?;
    if mode & S_IFMT != S_IFREG || u16_at(raw, 0x1A)? == 0 {
        return None; // not a regular file, or not linked (free)
    }
    let size = u64::from(u32_at(raw, 0x04)?) | u64::from(u32_at(raw, 0x6C)?) << 32;
    let extents = u32_at(raw, 0x20)? & EXTENTS_FL != 0;
    let first_block = if extents { first_block(raw.get(0x28..0x28 + 60)?, block, 0) } else { None };
    Some(RegularFile { inode: ino, mode, size, first_block })
}

/// The device block of logical block 0 in the extent (sub)tree `node` (a header and its
/// entries), at most [`MAX_DEPTH`] levels below.
fn first_block<B: AsRef<[u8]>>(node: &[u8], block: &impl Fn(u64) -> Option<B>, level: u16) -> Option<u64> {
    if u16_at(node, 0)? != EXTENT_MAGIC {
        return None;
    }
    let (entries, depth) = (usize::from(u16_at(node, 2)?), u16_at(node, 6)?);
    if entries == 0 || depth > MAX_DEPTH || level > MAX_DEPTH {
        return None;
    }
    // Entries are sorted by logical block: the first covers block 0 if any does.
    let e = node.get(12..24)?;
    if u32_at(e, 0)? != 0 {
        return None; // block 0 is a hole
    }
    if depth == 0 {
        // ee_len over 32768: an unwritten extent (reads as zeros): no data block there.
        let start = u64::from(u16_at(e, 6)?) << 32 | u64::from(u32_at(e, 8)?);
        (u16_at(e, 4)? <= 32768).then_some(start)
    } else {
        let child = u64::from(u16_at(e, 8)?) << 32 | u64::from(u32_at(e, 4)?);
        let data = block(child)?;
        first_block(data.as_ref(), block, level + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        synthesize, DataRange, DirEntry, Meta, Node, NodeId, NodeKind, Options, SizePolicy, Timestamp, Tree,
    };

    fn meta(mode: u16) -> Meta {
        let t = Timestamp::default();
        Meta { mode, uid: 0, gid: 0, atime: t, mtime: t, ctime: t }
    }

    /// A regular file of `size` bytes with data in logical blocks `from..from + blocks`.
    fn file(mode: u16, size: u64, from: u64, blocks: u64) -> Node {
        let data = if blocks == 0 {
            crate::smallvec::smallvec![]
        } else {
            crate::smallvec::smallvec![DataRange { start_block: from, blocks }]
        };
        Node { meta: meta(mode), kind: NodeKind::Regular { size, data }, xattrs: vec![] }
    }

    /// `/prog` (0755, 3 blocks), `/data` (0644, 2 blocks), `/empty` (0755, no data), `/dir/big`
    /// (0700, 40 000 blocks: two extents), `/holed` (0755, block 0 a hole), `/link` a symlink.
    fn image() -> crate::Ext4Image {
        let entry = |name: &str, node: u32| DirEntry { name: name.as_bytes().into(), node: NodeId(node) };
        let dir = |entries| Node { meta: meta(0o755), kind: NodeKind::Directory { entries }, xattrs: vec![] };
        let tree = Tree {
            nodes: vec![
                dir(vec![
                    entry("prog", 1),
                    entry("data", 2),
                    entry("empty", 3),
                    entry("dir", 4),
                    entry("holed", 6),
                    entry("link", 7),
                ]),
                file(0o755, 3 * 4096 - 10, 0, 3),
                file(0o644, 2 * 4096, 0, 2),
                file(0o755, 0, 0, 0),
                dir(vec![entry("big", 5)]),
                file(0o700, 40_000 * 4096, 0, 40_000),
                file(0o755, 2 * 4096, 1, 1),
                Node {
                    meta: meta(0o777),
                    kind: NodeKind::Symlink { target: b"prog".to_vec() },
                    xattrs: vec![],
                },
            ],
        };
        let opts = Options {
            size: SizePolicy::Free(None),
            inodes: None,
            fs_time: 1_700_000_000,
            seed: [0; 32],
            label: vec![],
        };
        synthesize(&tree, &opts).unwrap()
    }

    /// The image's metadata by device block (all-zero blocks left out, as the image leaves them).
    fn blocks(img: &crate::Ext4Image) -> std::collections::HashMap<u64, Vec<u8>> {
        let mut out = std::collections::HashMap::new();
        for run in &img.metadata {
            for (i, b) in run.data.chunks(BLOCK).enumerate() {
                out.insert(run.start_block + i as u64, b.to_vec());
            }
        }
        out
    }

    #[test]
    fn finds_each_regular_file_with_its_mode_size_and_first_block() {
        let img = image();
        let meta = blocks(&img);
        let mut files = regular_files(|b| meta.get(&b));
        files.sort_by_key(|f| (f.size, f.mode));
        let placed = |node: usize| img.placements[node].first().map(|p| p.device_block);
        let found: Vec<(u16, u64, Option<u64>)> =
            files.iter().map(|f| (f.mode & 0o7777, f.size, f.first_block)).collect();
        assert!(img.placements[5].len() > 1, "big spans several extents: {:?}", img.placements[5]);
        assert_eq!(
            found,
            [
                (0o755, 0, None),
                (0o644, 2 * 4096, placed(2)),
                (0o755, 2 * 4096, None),
                (0o755, 3 * 4096 - 10, placed(1)),
                (0o700, 40_000 * 4096, placed(5)),
            ],
            "{files:?}"
        );
        assert!(placed(1).is_some() && placed(5).is_some());
        let executable: Vec<bool> = files.iter().map(RegularFile::executable).collect();
        assert_eq!(executable, [true, false, true, true, true]);
        assert!(files.iter().all(|f| f.inode >= 11), "a reserved inode (the journal's) listed");
    }

    #[test]
    fn bytes_that_make_no_sense_give_nothing_and_never_panic() {
        let meta = blocks(&image());
        // No superblock, or not ext4.
        assert!(regular_files(|_| None::<Vec<u8>>).is_empty());
        assert!(regular_files(|_| Some(vec![0u8; BLOCK])).is_empty());
        // Every block cut short.
        assert!(regular_files(|b| meta.get(&b).map(|d| d[..100].to_vec())).is_empty());
        // Bits flipped at random in each of the first blocks (superblock, descriptors, inode
        // tables, directories): whatever the scan makes of them, it ends.
        let mut rng = 0x5eed_u64;
        for b in 0..64u64 {
            for _ in 0..64 {
                rng = rng.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                let at = (rng >> 33) as usize % BLOCK;
                let mut bad = meta.clone();
                if let Some(d) = bad.get_mut(&b) {
                    d[at] ^= 1 << (rng >> 61);
                }
                let _ = regular_files(|n| bad.get(&n));
            }
        }
    }
}
