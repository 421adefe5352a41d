//! The synthesizer proper: prepare every inode's content, size and lay out the device, then render.
//!
//! Order of work (reference §15 "order of computation"): content that does not depend on device
//! positions (directory blocks use logical block numbers only, xattr bodies, extent counts) is prepared
//! once; the layout is then computed (possibly several times while sizing); finally inodes, tree/xattr
//! blocks, bitmaps, descriptors and superblocks are rendered with their checksums, in that order.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

use crate::bitmap::{block_bitmap, inode_bitmap, Bitmap};
use crate::dir::{self, DirEnt};
use crate::error::Ext4Error;
use crate::extent::{self, Extent};
use crate::group::GroupDesc;
use crate::inode::{self, InodeData, XATTR_AREA_LEN};
use crate::journal;
use crate::layout::alloc::Allocator;
use crate::layout::geometry::{self, BLOCKS_PER_GROUP, MAX_IPG};
use crate::namespace::{self, Namespace, Slot, LINK_MAX, LOST_FOUND_INO};
use crate::superblock::SuperblockParams;
use crate::tree::{DataRange, Meta, NodeKind, Timestamp, Tree};
use crate::xattr::{self, DiskXattr};
use crate::{Ext4Layout, Geometry, MetadataRun, MetadataSink, Options, PlacedExtent, SizePolicy};
use tessera_image::BlockSize;

/// Largest file: `ee_block` is 32 bits, so the last block index is 2^32 − 2.
pub const MAX_FILE_SIZE: u64 = ((1u64 << 32) - 1) * BlockSize::U64;
/// Largest filesystem we build (64 TiB); far beyond any container image, and keeps bitmaps in memory.
pub const MAX_BLOCKS: u64 = 1 << 34;
/// The kernel stops sharing an xattr block at this many references (`EXT4_XATTR_REFCOUNT_MAX`).
const XATTR_REFCOUNT_MAX: u32 = 1024;
/// Fast symlinks hold targets shorter than the 60-byte `i_block`.
const FAST_SYMLINK_MAX: usize = 59;
const DEFAULT_FREE_BLOCKS: u64 = (256 << 20) / BlockSize::U64;

/// What one inode holds.
#[derive(Debug)]
enum ObjKind<'a> {
    /// A directory of `blocks` blocks. They are rendered twice — once here to count them, again
    /// when written — rather than held from preparation to rendering next to their copy.
    Dir {
        blocks: usize,
        htree: bool,
    },
    /// A regular file and its data ranges, the tree's own (checked by [`check_file_ranges`];
    /// [`merged_ranges`] joins adjacent ones): not copied, ~30 bytes a file.
    File {
        size: u64,
        data: &'a [DataRange],
    },
    /// A symbolic link and its target, the tree's own.
    Symlink {
        target: &'a [u8],
    },
    Chr {
        major: u32,
        minor: u32,
    },
    Blk {
        major: u32,
        minor: u32,
    },
    Fifo,
    Sock,
}

/// One inode to write: root, lost+found or a tree node.
#[derive(Debug)]
struct Obj<'a> {
    ino: u32,
    /// The tree node, or `None` for a lost+found we created. Its metadata is the node's (read
    /// from the tree, not copied: 64 bytes an inode), or [`created_lost_found_meta`].
    node: Option<u32>,
    kind: ObjKind<'a>,
    links: u16,
    /// The in-inode xattr area, `None` when it is all zeros (most inodes): boxed, so an inode
    /// without attributes costs 8 bytes here rather than the area's size.
    xattr_area: Option<Box<[u8; XATTR_AREA_LEN]>>,
    xattr_block: Option<u32>,
}

impl Obj<'_> {
    fn is_slow_symlink(&self) -> bool {
        matches!(&self.kind, ObjKind::Symlink { target } if target.len() > FAST_SYMLINK_MAX)
    }
}

/// A distinct external xattr block and how many inodes share it.
#[derive(Debug)]
struct XBlock {
    body: Vec<u8>,
    refcount: u32,
}

/// Where one object's blocks went: its extents and extent-tree blocks are ranges of
/// [`Layout::extents`] and [`Layout::tree_blocks`] (32 bytes an object, no allocation of its
/// own: a million files used to cost two small allocations each here).
#[derive(Debug, Default, Clone, Copy)]
struct ObjLayout {
    ext_start: u64,
    tree_start: u64,
    symlink_block: u64,
    ext_len: u32,
    tree_len: u32,
}

/// Append `items` to `all` and return where they start and how many there are (an object's
/// extents split at most at every backup range and every 32 768 blocks: far below 2^32).
fn append_span<T: Copy>(all: &mut Vec<T>, items: &[T]) -> (u64, u32) {
    let start = all.len() as u64;
    all.extend_from_slice(items);
    (start, u32::try_from(items.len()).unwrap_or(u32::MAX))
}

#[derive(Debug)]
struct Layout {
    groups: u64,
    ipg: u64,
    blocks_count: u64,
    journal_blocks: u64,
    block_bitmap: Vec<u64>,
    inode_bitmap: Vec<u64>,
    inode_table: Vec<u64>,
    journal_start: u64,
    objs: Vec<ObjLayout>,
    /// Every object's extents, each object's a range ([`ObjLayout`]).
    extents: Vec<Extent>,
    /// Every object's extent-tree blocks, each object's a range.
    tree_blocks: Vec<u64>,
    xblock_nr: Vec<u64>,
    /// Every allocated block range `(start, len)`.
    used: Vec<(u64, u64)>,
    data_start: u64,
    data_end: u64,
}

impl Layout {
    /// Object `l`'s extents.
    fn extents_of(&self, l: &ObjLayout) -> &[Extent] {
        let start = l.ext_start as usize;
        &self.extents[start..start + l.ext_len as usize]
    }

    /// Object `l`'s extent-tree blocks.
    fn tree_blocks_of(&self, l: &ObjLayout) -> &[u64] {
        let start = l.tree_start as usize;
        &self.tree_blocks[start..start + l.tree_len as usize]
    }
}

/// Derive the UUID (version 4 and RFC 4122 variant bits) and the never-zero hash seed (§13).
pub fn derive_ids(seed: &[u8; 32]) -> ([u8; 16], [u32; 4]) {
    let d = Sha256::new().chain_update(b"ext4-uuid").chain_update(seed).finalize();
    let mut uuid = [0u8; 16];
    uuid.copy_from_slice(&d[..16]);
    uuid[6] = (uuid[6] & 0x0F) | 0x40;
    uuid[8] = (uuid[8] & 0x3F) | 0x80;
    let h = Sha256::new().chain_update(b"ext4-hash-seed").chain_update(uuid).finalize();
    let mut hash_seed = [0u32; 4];
    for (i, w) in hash_seed.iter_mut().enumerate() {
        *w = u32::from_le_bytes([h[4 * i], h[4 * i + 1], h[4 * i + 2], h[4 * i + 3]]);
    }
    if hash_seed == [0; 4] {
        // An all-zero seed means "default MD4 IV" to readers; avoid it (astronomically unlikely).
        hash_seed[0] = 1;
    }
    (uuid, hash_seed)
}

pub fn synthesize(tree: &Tree, opts: &Options, out: &mut dyn MetadataSink) -> Result<Ext4Layout, Ext4Error> {
    if opts.label.len() > 16 {
        return Err(Ext4Error::LabelTooLong { len: opts.label.len() });
    }
    let ns = namespace::number(tree)?;
    let (uuid, hash_seed) = derive_ids(&opts.seed);
    let ids = Ids { uuid, hash_seed, fs_seed: crate::checksum::fs_seed(&uuid) };
    let (objs, xblocks) = Nodes { tree, ns: &ns, ids: &ids }.prepare()?;
    // Regular files' data goes in NodeId order.
    let mut files: Vec<usize> =
        (0..objs.len()).filter(|&i| matches!(objs[i].kind, ObjKind::File { .. })).collect();
    files.sort_by_key(|&i| objs[i].node);
    let lay = size_and_layout(&objs, xblocks.len(), &files, ns.last_ino() as u64, opts)?;
    drop(files);
    render(&RenderInput { tree, objs: &objs, xblocks: &xblocks, lay: &lay, ns: &ns, opts, ids }, out)
}

fn check_time(t: Timestamp, path: impl Fn() -> String) -> Result<(), Ext4Error> {
    if inode::encode_time(t).is_none() {
        return Err(Ext4Error::TimestampOutOfRange { path: path(), sec: t.sec, nsec: t.nsec });
    }
    Ok(())
}

fn file_type(kind: &NodeKind) -> u8 {
    match kind {
        NodeKind::Directory { .. } => dir::FT_DIR,
        NodeKind::Regular { .. } => dir::FT_REG,
        NodeKind::Symlink { .. } => dir::FT_SYMLINK,
        NodeKind::CharDevice { .. } => dir::FT_CHR,
        NodeKind::BlockDevice { .. } => dir::FT_BLK,
        NodeKind::Fifo => dir::FT_FIFO,
        NodeKind::Socket => dir::FT_SOCK,
    }
}

/// The metadata of a lost+found we create: 0700 root:root at the filesystem time.
fn created_lost_found_meta(fs_time: i64) -> Meta {
    let t = Timestamp { sec: fs_time, nsec: 0 };
    Meta { mode: 0o700, uid: 0, gid: 0, atime: t, mtime: t, ctime: t }
}

/// mke2fs's lost+found: 0700 root:root, 4 empty blocks so e2fsck can reconnect without allocating.
fn created_lost_found(ino: u32, fs_seed: u32) -> Obj<'static> {
    let blocks = created_lost_found_blocks(ino, fs_seed);
    Obj {
        ino,
        node: None,
        kind: ObjKind::Dir { blocks: blocks.len(), htree: false },
        links: 2,
        xattr_area: None,
        xattr_block: None,
    }
}

fn created_lost_found_blocks(ino: u32, fs_seed: u32) -> Vec<Vec<u8>> {
    dir::render_linear(ino, namespace::ROOT_INO, &[], 4, fs_seed)
}

/// What turning tree nodes into inode content reads: the tree, its numbering and the
/// filesystem's identifiers (directory blocks are checksummed and hash-indexed with them).
struct Nodes<'a> {
    tree: &'a Tree,
    ns: &'a Namespace<'a>,
    ids: &'a Ids,
}

impl<'a> Nodes<'a> {
    /// Validate every node and build its inode content (directory blocks, xattrs, extents-to-be).
    fn prepare(&self) -> Result<(Vec<Obj<'a>>, Vec<XBlock>), Ext4Error> {
        let Self { tree, ns, ids } = *self;
        let order = std::iter::once(Some(0)).chain(ns.slots.iter().map(|s| match s {
            Slot::Node(n) => Some(*n as usize),
            Slot::CreatedLostFound => None,
        }));
        let mut objs = Vec::with_capacity(ns.slots.len() + 1);
        let mut xblocks: Vec<XBlock> = Vec::new();
        // Sharing index: block body → xblocks index of the newest block with that body.
        let mut shared: BTreeMap<Vec<u8>, usize> = BTreeMap::new();

        for (k, node) in order.enumerate() {
            let ino = if k == 0 { namespace::ROOT_INO } else { LOST_FOUND_INO + k as u32 - 1 };
            let Some(n) = node else {
                objs.push(created_lost_found(ino, ids.fs_seed));
                continue;
            };
            let src = &tree.nodes[n];
            let path = || ns.path(n);
            for ts in [src.meta.atime, src.meta.mtime, src.meta.ctime] {
                check_time(ts, path)?;
            }
            let (kind, links) = self.node_kind(n, ino)?;
            let (xattr_area, xattr_block) = place_xattrs(src, ns, n, &mut xblocks, &mut shared)?;
            objs.push(Obj {
                ino,
                node: Some(n as u32),
                kind,
                links: links as u16,
                xattr_area: (xattr_area != [0; XATTR_AREA_LEN]).then(|| Box::new(xattr_area)),
                xattr_block,
            });
        }
        Ok((objs, xblocks))
    }

    /// A directory node's content (its block count) and its link count.
    fn dir_kind(&self, n: usize, ino: u32) -> (ObjKind<'a>, u64) {
        let (blocks, htree, links) = self.dir_blocks(n, ino);
        (ObjKind::Dir { blocks: blocks.len(), htree }, links)
    }

    /// A directory node's blocks (linear, or hash-indexed from 3 blocks on), whether they are
    /// hash-indexed, and its link count.
    fn dir_blocks(&self, n: usize, ino: u32) -> (Vec<Vec<u8>>, bool, u64) {
        let Self { tree, ns, ids } = *self;
        let parent = match ns.parent(n) {
            Some((p, _)) => ns.ino[p],
            None => namespace::ROOT_INO,
        };
        let mut children: Vec<DirEnt<'_>> = ns
            .entries(n)
            .map(|(name, c)| DirEnt { ino: ns.ino[c], file_type: file_type(&tree.nodes[c].kind), name })
            .collect();
        if n == 0 && ns.tree_lost_found.is_none() {
            children.push(DirEnt { ino: LOST_FOUND_INO, file_type: dir::FT_DIR, name: b"lost+found" });
        }
        let subdirs = children.iter().filter(|c| c.file_type == dir::FT_DIR).count() as u64;
        // dir_nlink: a directory with too many subdirectories stores 1.
        let links = if 2 + subdirs > LINK_MAX { 1 } else { 2 + subdirs };
        // Linear blocks are ordered by inode number (then name), like e2fsck writes them.
        children.sort_by(|a, b| a.ino.cmp(&b.ino).then_with(|| a.name.cmp(b.name)));
        let is_lf = ino == LOST_FOUND_INO;
        let min_blocks = if is_lf { 4 } else { 1 };
        let mut blocks = dir::render_linear(ino, parent, &children, min_blocks, ids.fs_seed);
        let mut htree = false;
        // e2fsck -fp would index any linear directory of 3+ blocks (except lost+found); do it
        // ourselves so a later fsck has nothing to change.
        if blocks.len() >= 3 && !is_lf {
            if let Some(h) = crate::htree::render_htree(ino, parent, &children, &ids.hash_seed, ids.fs_seed) {
                blocks = h;
                htree = true;
            }
        }
        (blocks, htree, links)
    }

    /// A tree node's inode content, validated, and its link count.
    fn node_kind(&self, n: usize, ino: u32) -> Result<(ObjKind<'a>, u64), Ext4Error> {
        let ns = self.ns;
        let path = || ns.path(n);
        let kind = match &self.tree.nodes[n].kind {
            NodeKind::Directory { .. } => return Ok(self.dir_kind(n, ino)),
            NodeKind::Regular { size, data } => {
                check_file_ranges(*size, data, path)?;
                ObjKind::File { size: *size, data }
            }
            NodeKind::Symlink { target } => {
                if target.is_empty() || target.len() > 4095 || target.contains(&0) {
                    return Err(Ext4Error::BadSymlink { path: path(), len: target.len() });
                }
                ObjKind::Symlink { target }
            }
            &NodeKind::CharDevice { major, minor } => {
                check_device(major, minor, path)?;
                ObjKind::Chr { major, minor }
            }
            &NodeKind::BlockDevice { major, minor } => {
                check_device(major, minor, path)?;
                ObjKind::Blk { major, minor }
            }
            NodeKind::Fifo => ObjKind::Fifo,
            NodeKind::Socket => ObjKind::Sock,
        };
        Ok((kind, ns.refs(n)))
    }
}

/// Linux dev_t: 12-bit major, 20-bit minor.
fn check_device(major: u32, minor: u32, path: impl Fn() -> String) -> Result<(), Ext4Error> {
    if major >= 1 << 12 || minor >= 1 << 20 {
        return Err(Ext4Error::BadDeviceNumber { path: path(), major, minor });
    }
    Ok(())
}

/// Check a regular file's data ranges: ascending, non-empty, not overlapping, inside the size.
fn check_file_ranges(size: u64, data: &[DataRange], path: impl Fn() -> String) -> Result<(), Ext4Error> {
    if size > MAX_FILE_SIZE {
        return Err(Ext4Error::FileTooLarge { path: path(), size, max: MAX_FILE_SIZE });
    }
    let limit = size.div_ceil(BlockSize::U64);
    let mut prev_end = 0;
    for r in data {
        match r.start_block.checked_add(r.blocks) {
            Some(end) if r.blocks > 0 && end <= limit && r.start_block >= prev_end => prev_end = end,
            _ => return Err(Ext4Error::BadDataRanges { path: path(), size }),
        }
    }
    Ok(())
}

/// A checked file's data ranges as `(first block, blocks)`, adjacent ones joined: they are one
/// run on disk too, and joining keeps the extent count minimal.
fn merged_ranges(data: &[DataRange]) -> impl Iterator<Item = (u64, u64)> + '_ {
    let mut rest = data.iter().peekable();
    std::iter::from_fn(move || {
        let first = rest.next()?;
        let (start, mut blocks) = (first.start_block, first.blocks);
        while let Some(next) = rest.next_if(|n| start + blocks == n.start_block) {
            blocks += next.blocks;
        }
        Some((start, blocks))
    })
}

/// Decide where a node's xattrs go: all in the inode if they fit, else all in a (shared) block, else
/// split greedily; error if even that does not fit.
fn place_xattrs(
    src: &crate::tree::Node,
    ns: &Namespace<'_>,
    n: usize,
    xblocks: &mut Vec<XBlock>,
    shared: &mut BTreeMap<Vec<u8>, usize>,
) -> Result<([u8; XATTR_AREA_LEN], Option<u32>), Ext4Error> {
    let mut list: Vec<DiskXattr> = Vec::with_capacity(src.xattrs.len());
    for x in &src.xattrs {
        let d = xattr::parse(&x.name, &x.value).map_err(|reason| Ext4Error::BadXattr {
            path: ns.path(n),
            name: namespace::escape(&x.name),
            reason,
        })?;
        list.push(d);
    }
    if list.is_empty() {
        return Ok(([0; XATTR_AREA_LEN], None));
    }
    xattr::sort(&mut list);
    for w in list.windows(2) {
        if w[0].index == w[1].index && w[0].name == w[1].name {
            return Err(Ext4Error::BadXattr {
                path: ns.path(n),
                name: namespace::escape(&xattr::full_name(&w[0])),
                reason: "duplicate attribute name",
            });
        }
    }
    let (in_inode, in_block): (Vec<DiskXattr>, Vec<DiskXattr>) = if xattr::fits_in_inode(&list) {
        (list, Vec::new())
    } else if xattr::fits_in_block(&list) {
        (Vec::new(), list)
    } else {
        let mut inode_part = Vec::new();
        let mut block_part = Vec::new();
        for x in list {
            inode_part.push(x);
            if !xattr::fits_in_inode(&inode_part) {
                if let Some(x) = inode_part.pop() {
                    block_part.push(x);
                }
            }
        }
        (inode_part, block_part)
    };
    let too_large = |x: Option<&DiskXattr>| Ext4Error::XattrTooLarge {
        path: ns.path(n),
        name: x.map(|x| namespace::escape(&xattr::full_name(x))).unwrap_or_default(),
        reason: "the attributes exceed the inode area plus one 4 KiB block",
    };
    let area = xattr::render_inode_area(&in_inode).ok_or_else(|| too_large(in_inode.last()))?;
    if in_block.is_empty() {
        return Ok((area, None));
    }
    let body = xattr::render_block_body(&in_block).ok_or_else(|| too_large(in_block.last()))?;
    let idx = match shared.get(&body) {
        Some(&i) if xblocks[i].refcount < XATTR_REFCOUNT_MAX => {
            xblocks[i].refcount += 1;
            i
        }
        _ => {
            xblocks.push(XBlock { body: body.clone(), refcount: 1 });
            shared.insert(body, xblocks.len() - 1);
            xblocks.len() - 1
        }
    };
    Ok((area, Some(idx as u32)))
}

/// Find the geometry for the size policy and lay everything out.
fn size_and_layout(
    objs: &[Obj],
    nxblocks: usize,
    files: &[usize],
    used_inodes: u64,
    opts: &Options,
) -> Result<Layout, Ext4Error> {
    let data_blocks: u64 = files
        .iter()
        .map(|&i| match &objs[i].kind {
            ObjKind::File { data, .. } => data.iter().map(|r| r.blocks).sum::<u64>(),
            _ => 0,
        })
        .sum();
    let want_inodes = match opts.inodes {
        Some(min) => min.max(used_inodes),
        None => used_inodes + (used_inodes / 4).max(4096),
    };
    // s_inodes_count is 32 bits.
    let max_inodes = u32::MAX as u64 / 16 * 16;
    if want_inodes > max_inodes {
        return Err(Ext4Error::TooManyInodes { needed: want_inodes, max: max_inodes });
    }
    let ipg_for = |groups: u64| -> u64 { want_inodes.div_ceil(groups).next_multiple_of(16).max(16) };
    let check_inodes = |groups: u64, ipg: u64| -> Result<(), Ext4Error> {
        if groups.saturating_mul(ipg) > u32::MAX as u64 {
            return Err(Ext4Error::TooManyInodes { needed: want_inodes, max: max_inodes });
        }
        Ok(())
    };
    match opts.size {
        SizePolicy::Free(free) => {
            let free_blocks = match free {
                Some(bytes) => bytes.div_ceil(BlockSize::U64),
                None => DEFAULT_FREE_BLOCKS.max(data_blocks.div_ceil(4)),
            };
            let mut groups = 1u64.max(want_inodes.div_ceil(MAX_IPG));
            loop {
                let ipg = ipg_for(groups);
                if ipg > MAX_IPG {
                    groups += 1;
                    continue;
                }
                check_inodes(groups, ipg)?;
                let blocks = groups * BLOCKS_PER_GROUP;
                if blocks > MAX_BLOCKS {
                    return Err(Ext4Error::ImageTooLarge { blocks, max: MAX_BLOCKS });
                }
                let j = journal::default_journal_blocks(blocks);
                let lay = layout(objs, nxblocks, files, groups, ipg, blocks, j);
                let needed = lay.data_end + free_blocks;
                if needed <= blocks {
                    return Ok(lay);
                }
                // Growing only ever adds room, so this converges.
                groups = groups.max(needed.div_ceil(BLOCKS_PER_GROUP)).max(groups + 1);
            }
        }
        SizePolicy::Exact(bytes) => {
            let requested = bytes / BlockSize::U64;
            if requested > MAX_BLOCKS {
                return Err(Ext4Error::ImageTooLarge { blocks: requested, max: MAX_BLOCKS });
            }
            let mut blocks = requested;
            let (groups, ipg) = loop {
                let groups = blocks.div_ceil(BLOCKS_PER_GROUP).max(1);
                let ipg = ipg_for(groups);
                if ipg > MAX_IPG {
                    return Err(Ext4Error::TooManyInodes { needed: want_inodes, max: groups * MAX_IPG });
                }
                let trimmed = geometry::trim_tail_group(blocks, ipg);
                if trimmed == blocks {
                    break (groups, ipg);
                }
                blocks = trimmed;
            };
            check_inodes(groups, ipg)?;
            let j = journal::default_journal_blocks(blocks);
            // The smallest sensible filesystem: the fixed metadata must fit in what is left.
            if blocks < 1 + geometry::gdt_blocks(groups) + j + 64 {
                return Err(Ext4Error::SizeTooSmall {
                    requested: bytes,
                    needed: (2048 + j) * BlockSize::U64,
                });
            }
            let lay = layout(objs, nxblocks, files, groups, ipg, blocks, j);
            if lay.data_end > blocks {
                return Err(Ext4Error::SizeTooSmall {
                    requested: bytes,
                    needed: lay.data_end * BlockSize::U64,
                });
            }
            Ok(lay)
        }
    }
}

/// Turn allocated pieces into extents, numbering logical blocks from `lblk`.
fn pieces_to_extents(pieces: &[(u64, u64)], mut lblk: u64, out: &mut Vec<Extent>) -> u64 {
    for &(p, len) in pieces {
        extent::split_extents(lblk, p, len, out);
        lblk += len;
    }
    lblk
}

/// Note blocks `start..start + len` as allocated, joined to the range before when they follow it:
/// the allocator is sequential, so the list stays short instead of one entry per object.
fn mark_used(used: &mut Vec<(u64, u64)>, start: u64, len: u64) {
    match used.last_mut() {
        Some(last) if last.0 + last.1 == start => last.1 += len,
        _ => used.push((start, len)),
    }
}

/// Run the sequential allocator over everything for one candidate geometry.
fn layout(
    objs: &[Obj],
    nxblocks: usize,
    files: &[usize],
    groups: u64,
    ipg: u64,
    blocks: u64,
    jblocks: u64,
) -> Layout {
    let gdt = geometry::gdt_blocks(groups);
    let backups = geometry::backup_ranges(groups, blocks);
    let mut used: Vec<(u64, u64)> = vec![(0, 1 + gdt)];
    used.extend(backups.iter().map(|&(s, e)| (s, e - s)));
    let mut a = Allocator::new(1 + gdt, backups);
    let take_one = |a: &mut Allocator, used: &mut Vec<(u64, u64)>| {
        let b = a.alloc_one();
        mark_used(used, b, 1);
        b
    };
    let block_bitmap: Vec<u64> = (0..groups).map(|_| take_one(&mut a, &mut used)).collect();
    let inode_bitmap: Vec<u64> = (0..groups).map(|_| take_one(&mut a, &mut used)).collect();
    let itb = geometry::itable_blocks(ipg);
    let inode_table: Vec<u64> = (0..groups)
        .map(|_| {
            let s = a.alloc_contiguous(itb);
            used.push((s, itb));
            s
        })
        .collect();
    let journal_start = a.alloc_contiguous(jblocks);
    used.push((journal_start, jblocks));

    let mut objl: Vec<ObjLayout> = vec![ObjLayout::default(); objs.len()];
    let mut all_extents: Vec<Extent> = Vec::new();
    let mut all_tree_blocks: Vec<u64> = Vec::new();
    let mut xblock_nr = vec![0u64; nxblocks];
    let mut ext = Vec::new();
    for (i, o) in objs.iter().enumerate() {
        if let ObjKind::Dir { blocks: dblocks, .. } = &o.kind {
            let pieces = a.alloc_run(*dblocks as u64);
            for &(s, n) in &pieces {
                mark_used(&mut used, s, n);
            }
            ext.clear();
            pieces_to_extents(&pieces, 0, &mut ext);
            (objl[i].ext_start, objl[i].ext_len) = append_span(&mut all_extents, &ext);
            let tb: Vec<u64> =
                (0..extent::tree_blocks(ext.len())).map(|_| take_one(&mut a, &mut used)).collect();
            (objl[i].tree_start, objl[i].tree_len) = append_span(&mut all_tree_blocks, &tb);
        }
        if o.is_slow_symlink() {
            objl[i].symlink_block = take_one(&mut a, &mut used);
        }
        if let Some(x) = o.xattr_block.map(|x| x as usize) {
            if xblock_nr[x] == 0 {
                xblock_nr[x] = take_one(&mut a, &mut used);
            }
        }
    }

    // File extent-tree blocks live before the data, but their number depends on how the data is split
    // by backup ranges. Reserve an estimate, place the data, and retry with more if it was short; any
    // unneeded reserved blocks simply stay free.
    let mut estimate: usize = files
        .iter()
        .map(|&i| match &objs[i].kind {
            ObjKind::File { data, .. } => extent::tree_blocks(
                merged_ranges(data).map(|r| r.1.div_ceil(extent::MAX_EXTENT_LEN) as usize).sum(),
            ),
            _ => 0,
        })
        .sum();
    loop {
        let mut b = a.clone();
        let reserve: Vec<u64> = (0..estimate).map(|_| b.alloc_one()).collect();
        let data_start = b.cursor();
        let mut data_used = Vec::new();
        // Each file's extents, in `files` order, flat.
        let mut file_extents: Vec<Extent> = Vec::new();
        let mut file_spans: Vec<(u64, u32)> = Vec::with_capacity(files.len());
        let mut needed = 0;
        for &i in files {
            ext.clear();
            if let ObjKind::File { data, .. } = &objs[i].kind {
                for (start, len) in merged_ranges(data) {
                    let pieces = b.alloc_run(len);
                    for &(s, n) in &pieces {
                        mark_used(&mut data_used, s, n);
                    }
                    pieces_to_extents(&pieces, start, &mut ext);
                }
            }
            needed += extent::tree_blocks(ext.len());
            file_spans.push(append_span(&mut file_extents, &ext));
        }
        if needed > estimate {
            estimate = needed;
            continue;
        }
        let mut next = 0;
        // The files' extents follow the directories' in the flat list.
        let base = all_extents.len() as u64;
        all_extents.extend_from_slice(&file_extents);
        drop(file_extents);
        for (&i, &(start, len)) in files.iter().zip(&file_spans) {
            let tb = extent::tree_blocks(len as usize);
            for &b in &reserve[next..next + tb] {
                mark_used(&mut used, b, 1);
            }
            (objl[i].tree_start, objl[i].tree_len) =
                append_span(&mut all_tree_blocks, &reserve[next..next + tb]);
            next += tb;
            (objl[i].ext_start, objl[i].ext_len) = (base + start, len);
        }
        all_extents.shrink_to_fit();
        all_tree_blocks.shrink_to_fit();
        for (s, n) in data_used {
            mark_used(&mut used, s, n);
        }
        return Layout {
            groups,
            ipg,
            blocks_count: blocks,
            journal_blocks: jblocks,
            block_bitmap,
            inode_bitmap,
            inode_table,
            journal_start,
            objs: objl,
            extents: all_extents,
            tree_blocks: all_tree_blocks,
            xblock_nr,
            used,
            data_start,
            data_end: b.cursor(),
        };
    }
}

/// Runs of non-zero metadata blocks longer than this are handed on in pieces (the consumer's
/// block map merges them again), so the sink never holds more than this of a finished stretch.
const RUN_BYTES: usize = 1 << 20;

/// Takes rendered blocks in any order and hands the non-zero ones on in device order, coalesced,
/// holding back only what lies beyond the point up to which rendering is finished
/// ([`Self::flush_below`]): the rendering steps go in device order, so what is held back is a
/// few blocks (the backup superblocks, file extent-tree blocks), never the whole prefix.
struct MetaSink<'s> {
    /// Rendered regions not handed on yet, by first block.
    pending: BTreeMap<u64, Vec<u8>>,
    /// The run being coalesced: its first block and bytes.
    run: (u64, Vec<u8>),
    /// Every block below this has been handed on (or was zero).
    done: u64,
    /// A block was put below `done`: a rendering step out of device order (a bug, reported).
    misordered: bool,
    out: &'s mut dyn MetadataSink,
}

impl<'s> MetaSink<'s> {
    fn new(out: &'s mut dyn MetadataSink) -> Self {
        Self { pending: BTreeMap::new(), run: (0, Vec::new()), done: 0, misordered: false, out }
    }

    fn put(&mut self, block: u64, data: Vec<u8>) {
        debug_assert_eq!(data.len() % BlockSize::USIZE, 0);
        if data.is_empty() {
            return;
        }
        if block < self.done || self.pending.insert(block, data).is_some() {
            self.misordered = true;
        }
    }

    /// Hand on every region that starts below `limit`: nothing will be put below it any more.
    fn flush_below(&mut self, limit: u64) {
        while let Some(entry) = self.pending.first_entry() {
            if *entry.key() >= limit {
                break;
            }
            let (start, data) = entry.remove_entry();
            self.emit(start, &data);
        }
    }

    fn emit(&mut self, start: u64, data: &[u8]) {
        let bs = BlockSize::USIZE;
        if start < self.done {
            self.misordered = true;
            return;
        }
        for (k, blk) in data.chunks(bs).enumerate() {
            if blk.iter().all(|&b| b == 0) {
                continue;
            }
            let nr = start + k as u64;
            let (run_start, run) = &mut self.run;
            if run.is_empty() || *run_start + (run.len() / bs) as u64 != nr || run.len() >= RUN_BYTES {
                self.hand_on();
                self.run.0 = nr;
            }
            self.run.1.extend_from_slice(blk);
        }
        self.done = start + (data.len() / bs) as u64;
    }

    fn hand_on(&mut self) {
        if !self.run.1.is_empty() {
            let data = std::mem::take(&mut self.run.1);
            self.out.put(MetadataRun { start_block: self.run.0, data });
        }
    }

    /// Hand on the rest; an error if a step rendered out of device order.
    fn finish(mut self) -> Result<(), Ext4Error> {
        self.flush_below(u64::MAX);
        self.hand_on();
        if self.misordered {
            return Err(Ext4Error::Internal { what: "metadata rendered out of device order" });
        }
        Ok(())
    }
}

/// The filesystem's identifiers, derived from the seed.
#[derive(Debug, Clone, Copy)]
struct Ids {
    uuid: [u8; 16],
    hash_seed: [u32; 4],
    fs_seed: u32,
}

/// Everything rendering reads: the prepared objects, the chosen layout and the identifiers.
#[derive(Debug, Clone, Copy)]
struct RenderInput<'a> {
    tree: &'a Tree,
    objs: &'a [Obj<'a>],
    xblocks: &'a [XBlock],
    lay: &'a Layout,
    ns: &'a Namespace<'a>,
    opts: &'a Options,
    ids: Ids,
}

/// Render every metadata block with its checksum into `out`, in device order: first what depends
/// on the layout only (journal, bitmaps, descriptors, superblocks), then the inode tables group by
/// group, then every object's own blocks in allocation order. Nothing rendered is held longer than
/// it takes to reach its place in that order.
fn render(input: &RenderInput<'_>, out: &mut dyn MetadataSink) -> Result<Ext4Layout, Ext4Error> {
    let lay = input.lay;
    let mut sink = MetaSink::new(out);
    let journal = render_journal(input, &mut sink);
    let groups = render_groups(input, &mut sink);
    render_superblocks(input, &groups, &journal.jnl_blocks, &mut sink);
    render_inode_tables(input, &journal.inode, &mut sink);
    let placements = render_object_blocks(input, &mut sink);
    sink.finish()?;
    Ok(Ext4Layout {
        geometry: Geometry {
            block_size: BlockSize::U32,
            blocks: lay.blocks_count,
            inodes: lay.groups * lay.ipg,
            inodes_per_group: lay.ipg as u32,
            groups: lay.groups as u32,
            journal_blocks: lay.journal_blocks,
            free_blocks: groups.free_blocks,
            free_inodes: groups.free_inodes,
            data_start_block: lay.data_start,
            data_end_block: lay.data_end,
            uuid: input.ids.uuid,
        },
        placements,
    })
}

/// Every group's inode table up to its last used inode (the rest reads as zeros), one group at a
/// time: objects are in inode order.
fn render_inode_tables(
    input: &RenderInput<'_>,
    journal_inode: &[u8; inode::INODE_SIZE],
    sink: &mut MetaSink,
) {
    let (lay, fs_seed) = (input.lay, input.ids.fs_seed);
    let (ipg, last_ino) = (lay.ipg, input.ns.last_ino() as u64);
    let itb = geometry::itable_blocks(ipg);
    let mut objs = input.objs.iter().zip(&lay.objs).peekable();
    for g in 0..lay.groups {
        let used = last_ino.saturating_sub(g * ipg).min(ipg);
        let first = g * ipg + 1;
        let mut table = vec![0u8; (used * 256).next_multiple_of(BlockSize::U64) as usize];
        let mut put = |ino: u32, raw: &[u8; inode::INODE_SIZE]| {
            let at = (u64::from(ino) - first) as usize * 256;
            table[at..at + 256].copy_from_slice(raw);
        };
        if g == 0 {
            put(namespace::JOURNAL_INO, journal_inode);
        }
        while let Some((o, l)) = objs.next_if(|(o, _)| u64::from(o.ino) < first + ipg) {
            put(o.ino, &inode_of(input, o, l).render(o.ino, fs_seed));
        }
        sink.put(lay.inode_table[g as usize], table);
        sink.flush_below(lay.inode_table[g as usize] + itb);
    }
}

/// Every object's own blocks (directory, extent-tree, slow-symlink and xattr blocks), in the
/// order the layout allocated them, and where each regular file's data went.
fn render_object_blocks(input: &RenderInput<'_>, sink: &mut MetaSink) -> Vec<Vec<PlacedExtent>> {
    let (lay, fs_seed) = (input.lay, input.ids.fs_seed);
    let mut placements: Vec<Vec<PlacedExtent>> = vec![Vec::new(); input.tree.nodes.len()];
    let mut xblock_done = vec![false; input.xblocks.len()];
    // The end of the blocks allocated so far before the file extent-tree reserve: later
    // objects' blocks all lie beyond it (the allocator only moves forward). File extent-tree
    // blocks lie in the reserve after all of them, in file order; they wait in the sink.
    let mut finished = 0u64;
    for (o, l) in input.objs.iter().zip(&lay.objs) {
        let mut put = |sink: &mut MetaSink, nr: u64, data: Vec<u8>, in_order: bool| {
            if in_order {
                finished = finished.max(nr + (data.len() / BlockSize::USIZE) as u64);
            }
            sink.put(nr, data);
        };
        match &o.kind {
            ObjKind::Dir { blocks: count, .. } => {
                let blocks = match o.node.map(|n| n as usize) {
                    Some(n) => {
                        Nodes { tree: input.tree, ns: input.ns, ids: &input.ids }.dir_blocks(n, o.ino).0
                    }
                    None => created_lost_found_blocks(o.ino, fs_seed),
                };
                debug_assert_eq!(blocks.len(), *count, "a directory rendered to another size");
                let mut lblk = 0;
                for e in lay.extents_of(l) {
                    let mut run = Vec::with_capacity(e.len as usize * BlockSize::USIZE);
                    for b in &blocks[lblk..lblk + e.len as usize] {
                        run.extend_from_slice(b);
                    }
                    put(sink, e.pblk, run, true);
                    lblk += e.len as usize;
                }
                for (nr, b) in
                    extent::build_tree(lay.extents_of(l), lay.tree_blocks_of(l), o.ino, fs_seed).blocks
                {
                    put(sink, nr, b, true);
                }
            }
            ObjKind::File { .. } => {
                if let Some(n) = o.node.map(|n| n as usize) {
                    placements[n] = placed(lay.extents_of(l));
                }
                if l.tree_len > 0 {
                    for (nr, b) in
                        extent::build_tree(lay.extents_of(l), lay.tree_blocks_of(l), o.ino, fs_seed).blocks
                    {
                        put(sink, nr, b, false);
                    }
                }
            }
            ObjKind::Symlink { target } if target.len() > FAST_SYMLINK_MAX => {
                let mut b = vec![0u8; BlockSize::USIZE];
                b[..target.len()].copy_from_slice(target);
                put(sink, l.symlink_block, b, true);
            }
            _ => {}
        }
        if let Some(x) = o.xattr_block.map(|x| x as usize) {
            if let (Some(done), Some(body), Some(&nr)) =
                (xblock_done.get_mut(x), input.xblocks.get(x), lay.xblock_nr.get(x))
            {
                if !*done {
                    *done = true;
                    put(sink, nr, xattr::seal_block(&body.body, body.refcount, nr, fs_seed), true);
                }
            }
        }
        sink.flush_below(finished);
    }
    placements
}

/// One object's inode fields (its own blocks are rendered by [`render_object_blocks`]).
fn inode_of(input: &RenderInput<'_>, o: &Obj, l: &ObjLayout) -> InodeData {
    let (lay, fs_seed) = (input.lay, input.ids.fs_seed);
    let meta = match o.node {
        Some(n) => input.tree.nodes[n as usize].meta,
        None => created_lost_found_meta(input.opts.fs_time),
    };
    let mut d = InodeData {
        uid: meta.uid,
        gid: meta.gid,
        atime: meta.atime,
        ctime: meta.ctime,
        mtime: meta.mtime,
        crtime: meta.mtime,
        links: o.links,
        xattr_area: o.xattr_area.as_deref().copied().unwrap_or([0; XATTR_AREA_LEN]),
        ..Default::default()
    };
    let perm = meta.mode & 0o7777;
    let mut owned_blocks: u64 = u64::from(l.tree_len);
    if let Some(x) = o.xattr_block {
        d.file_acl = lay.xblock_nr[x as usize];
        owned_blocks += 1;
    }
    let extent_root = |d: &mut InodeData| {
        d.i_block = extent::build_tree(lay.extents_of(l), lay.tree_blocks_of(l), o.ino, fs_seed).i_block;
        d.flags |= inode::EXT4_EXTENTS_FL;
    };
    match &o.kind {
        ObjKind::Dir { blocks: count, htree } => {
            d.mode = inode::S_IFDIR | perm;
            d.size = *count as u64 * BlockSize::U64;
            owned_blocks += *count as u64;
            if *htree {
                d.flags |= inode::EXT4_INDEX_FL;
            }
            extent_root(&mut d);
        }
        ObjKind::File { size, .. } => {
            d.mode = inode::S_IFREG | perm;
            d.size = *size;
            owned_blocks += lay.extents_of(l).iter().map(|e| e.len as u64).sum::<u64>();
            extent_root(&mut d);
        }
        ObjKind::Symlink { target } => {
            d.mode = inode::S_IFLNK | perm;
            d.size = target.len() as u64;
            if target.len() <= FAST_SYMLINK_MAX {
                d.i_block[..target.len()].copy_from_slice(target);
            } else {
                owned_blocks += 1;
                let ext = [Extent { lblk: 0, len: 1, pblk: l.symlink_block }];
                d.i_block = extent::build_tree(&ext, &[], o.ino, fs_seed).i_block;
                d.flags |= inode::EXT4_EXTENTS_FL;
            }
        }
        ObjKind::Chr { major, minor } => {
            d.mode = inode::S_IFCHR | perm;
            d.i_block = inode::device_i_block(*major, *minor);
        }
        ObjKind::Blk { major, minor } => {
            d.mode = inode::S_IFBLK | perm;
            d.i_block = inode::device_i_block(*major, *minor);
        }
        ObjKind::Fifo => d.mode = inode::S_IFIFO | perm,
        ObjKind::Sock => d.mode = inode::S_IFSOCK | perm,
    }
    d.blocks_512 = owned_blocks * (BlockSize::U64 / 512);
    d
}

/// The journal's inode record and the superblock's copy of its `i_block` and size.
#[derive(Debug)]
struct JournalInode {
    inode: [u8; inode::INODE_SIZE],
    jnl_blocks: [u32; 17],
}

/// Step 2: the journal inode; block 0 of the journal (its superblock) goes into the sink.
fn render_journal(input: &RenderInput<'_>, sink: &mut MetaSink) -> JournalInode {
    let (lay, fs_seed) = (input.lay, input.ids.fs_seed);
    let t = Timestamp { sec: input.opts.fs_time, nsec: 0 };
    let mut jext = Vec::new();
    extent::split_extents(0, lay.journal_start, lay.journal_blocks, &mut jext);
    let jtree = extent::build_tree(&jext, &[], namespace::JOURNAL_INO, fs_seed);
    let jsize = lay.journal_blocks * BlockSize::U64;
    let jd = InodeData {
        mode: inode::S_IFREG | 0o600,
        size: jsize,
        atime: t,
        ctime: t,
        mtime: t,
        crtime: t,
        links: 1,
        blocks_512: lay.journal_blocks * (BlockSize::U64 / 512),
        flags: inode::EXT4_EXTENTS_FL,
        i_block: jtree.i_block,
        ..Default::default()
    };
    sink.put(lay.journal_start, journal::render_superblock(lay.journal_blocks, &input.ids.uuid));
    let mut jnl_blocks = [0u32; 17];
    for (i, w) in jnl_blocks.iter_mut().take(15).enumerate() {
        *w = crate::bytes::get_u32(&jtree.i_block, 4 * i);
    }
    jnl_blocks[15] = (jsize >> 32) as u32;
    jnl_blocks[16] = jsize as u32;
    JournalInode { inode: jd.render(namespace::JOURNAL_INO, fs_seed), jnl_blocks }
}

/// The rendered group descriptor table and the free counts it sums to.
#[derive(Debug)]
struct Groups {
    /// The descriptors, padded to whole GDT blocks.
    descs: Vec<u8>,
    free_blocks: u64,
    free_inodes: u64,
}

/// Blocks of group `g` that exist (the last group may be short).
fn group_blocks(lay: &Layout, g: u64) -> usize {
    (lay.blocks_count - g * BLOCKS_PER_GROUP).min(BLOCKS_PER_GROUP) as usize
}

/// Every group's block bitmap with the allocated ranges set.
fn block_bitmaps(lay: &Layout) -> Vec<Bitmap> {
    let mut bbitmaps: Vec<Bitmap> = (0..lay.groups).map(|g| block_bitmap(group_blocks(lay, g))).collect();
    for &(start, len) in &lay.used {
        let mut s = start;
        let end = start + len;
        while s < end {
            let g = s / BLOCKS_PER_GROUP;
            let group_end = ((g + 1) * BLOCKS_PER_GROUP).min(end);
            bbitmaps[g as usize].set_range((s % BLOCKS_PER_GROUP) as usize, (group_end - s) as usize);
            s = group_end;
        }
    }
    bbitmaps
}

/// Step 5: block and inode bitmaps into the sink, and the descriptors with their checksums.
fn render_groups(input: &RenderInput<'_>, sink: &mut MetaSink) -> Groups {
    let (lay, fs_seed) = (input.lay, input.ids.fs_seed);
    let ipg = lay.ipg;
    let last_ino = input.ns.last_ino() as u64;
    let mut used_dirs = vec![0u32; lay.groups as usize];
    for o in input.objs {
        if matches!(o.kind, ObjKind::Dir { .. }) {
            used_dirs[((o.ino - 1) as u64 / ipg) as usize] += 1;
        }
    }
    let bbitmaps = block_bitmaps(lay);
    let mut descs = Vec::with_capacity(lay.groups as usize);
    let (mut free_blocks, mut free_inodes) = (0u64, 0u64);
    for g in 0..lay.groups {
        let gi = g as usize;
        let fb = bbitmaps[gi].count_zeros(group_blocks(lay, g)) as u64;
        let used_inodes = last_ino.saturating_sub(g * ipg).min(ipg);
        let mut ib = inode_bitmap(ipg as usize);
        ib.set_range(0, used_inodes as usize);
        let fi = ipg - used_inodes;
        free_blocks += fb;
        free_inodes += fi;
        let gd = GroupDesc {
            block_bitmap: lay.block_bitmap[gi],
            inode_bitmap: lay.inode_bitmap[gi],
            inode_table: lay.inode_table[gi],
            free_blocks: fb as u32,
            free_inodes: fi as u32,
            used_dirs: used_dirs[gi],
            itable_unused: fi as u32,
            block_bitmap_csum: bbitmaps[gi].checksum(BlockSize::USIZE, fs_seed),
            inode_bitmap_csum: ib.checksum(ipg as usize / 8, fs_seed),
        };
        descs.extend_from_slice(&gd.render(g as u32, fs_seed));
        sink.put(lay.inode_bitmap[gi], ib.as_bytes().to_vec());
    }
    for (g, bm) in bbitmaps.into_iter().enumerate() {
        sink.put(lay.block_bitmap[g], bm.as_bytes().to_vec());
    }
    descs.resize((geometry::gdt_blocks(lay.groups) * BlockSize::U64) as usize, 0);
    Groups { descs, free_blocks, free_inodes }
}

/// Step 6: the superblock copies (primary at byte 1024 of block 0, backups at the start of their
/// group), each followed by the descriptor table.
fn render_superblocks(input: &RenderInput<'_>, groups: &Groups, jnl_blocks: &[u32; 17], sink: &mut MetaSink) {
    let (lay, opts) = (input.lay, input.opts);
    let mut label = [0u8; 16];
    label[..opts.label.len()].copy_from_slice(&opts.label);
    let sbp = SuperblockParams {
        inodes_count: (lay.groups * lay.ipg) as u32,
        blocks_count: lay.blocks_count,
        free_blocks: groups.free_blocks,
        free_inodes: groups.free_inodes as u32,
        inodes_per_group: lay.ipg as u32,
        blocks_per_group: BLOCKS_PER_GROUP as u32,
        fs_time: opts.fs_time,
        uuid: input.ids.uuid,
        label,
        hash_seed: input.ids.hash_seed,
        jnl_blocks: *jnl_blocks,
    };
    for g in 0..lay.groups {
        if !geometry::group_has_super(g) {
            continue;
        }
        let sb = sbp.render(g as u32);
        let mut head = vec![0u8; BlockSize::USIZE];
        if g == 0 {
            head[1024..2048].copy_from_slice(&sb);
        } else {
            head[..1024].copy_from_slice(&sb);
        }
        head.extend_from_slice(&groups.descs);
        sink.put(g * BLOCKS_PER_GROUP, head);
    }
}

/// Device placement of a file: its extents with physically contiguous neighbours merged.
fn placed(extents: &[Extent]) -> Vec<PlacedExtent> {
    let mut out: Vec<PlacedExtent> = Vec::new();
    for e in extents {
        let (fb, db, n) = (e.lblk as u64, e.pblk, e.len as u64);
        match out.last_mut() {
            Some(p) if p.file_block + p.blocks == fb && p.device_block + p.blocks == db => p.blocks += n,
            _ => out.push(PlacedExtent { file_block: fb, device_block: db, blocks: n }),
        }
    }
    // One list per file, kept by the caller: no spare room (a first push makes room for four).
    out.shrink_to_fit();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_deterministic_and_well_formed() {
        let (u1, h1) = derive_ids(&[1; 32]);
        let (u2, h2) = derive_ids(&[1; 32]);
        let (u3, _) = derive_ids(&[2; 32]);
        assert_eq!((u1, h1), (u2, h2));
        assert_ne!(u1, u3);
        assert_eq!(u1[6] >> 4, 4);
        assert_eq!(u1[8] & 0xC0, 0x80);
        assert_ne!(h1, [0; 4]);
    }

    #[test]
    fn sink_drops_zero_blocks_and_coalesces() {
        let mut runs: Vec<MetadataRun> = Vec::new();
        let mut s = MetaSink::new(&mut runs);
        let blk = |v: u8| vec![v; 4096];
        s.put(10, [blk(1), blk(0), blk(2)].concat());
        s.put(13, blk(3));
        s.put(5, blk(4));
        s.flush_below(11);
        s.put(20, blk(5));
        s.finish().unwrap();
        let shape: Vec<(u64, usize)> = runs.iter().map(|r| (r.start_block, r.data.len() / 4096)).collect();
        assert_eq!(shape, vec![(5, 1), (10, 1), (12, 2), (20, 1)]);
    }

    #[test]
    fn sink_refuses_blocks_behind_what_it_handed_on() {
        let mut runs: Vec<MetadataRun> = Vec::new();
        let mut s = MetaSink::new(&mut runs);
        s.put(10, vec![1; 4096]);
        s.flush_below(11);
        s.put(9, vec![2; 4096]);
        assert!(matches!(s.finish(), Err(Ext4Error::Internal { .. })));
    }

    #[test]
    fn long_runs_are_handed_on_in_pieces_that_join_up() {
        let mut runs: Vec<MetadataRun> = Vec::new();
        let mut s = MetaSink::new(&mut runs);
        let blocks = 2 * RUN_BYTES / 4096 + 3;
        s.put(7, vec![9; blocks * 4096]);
        s.finish().unwrap();
        assert_eq!(runs.len(), 1, "the Vec sink joins contiguous pieces");
        assert_eq!((runs[0].start_block, runs[0].data.len()), (7, blocks * 4096));
    }

    #[test]
    fn adjacent_data_ranges_are_joined_gaps_kept() {
        let r = |start_block, blocks| DataRange { start_block, blocks };
        let data = [r(0, 2), r(2, 3), r(7, 1), r(8, 1), r(10, 4)];
        assert_eq!(merged_ranges(&data).collect::<Vec<_>>(), [(0, 5), (7, 2), (10, 4)]);
        assert_eq!(merged_ranges(&[]).count(), 0);
        assert!(check_file_ranges(14 * 4096, &data, String::new).is_ok());
        for bad in [&[r(0, 2), r(1, 1)][..], &[r(0, 0)], &[r(0, 15)], &[r(u64::MAX, 2)]] {
            assert!(check_file_ranges(14 * 4096, bad, String::new).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn placements_merge_split_extents() {
        let ext = [
            Extent { lblk: 0, len: 32768, pblk: 100 },
            Extent { lblk: 32768, len: 10, pblk: 100 + 32768 },
            Extent { lblk: 40000, len: 1, pblk: 100 + 32778 },
        ];
        let p = placed(&ext);
        assert_eq!(p.len(), 2);
        assert_eq!(p[0], PlacedExtent { file_block: 0, device_block: 100, blocks: 32778 });
    }

    #[test]
    fn journal_and_data_never_overlap_backups() {
        // Exercise the layout directly on a multi-group geometry with an empty object list.
        let lay = layout(&[], 0, &[], 512, 16, 512 * 32768, 32768);
        let backups = geometry::backup_ranges(512, 512 * 32768);
        let (js, je) = (lay.journal_start, lay.journal_start + lay.journal_blocks);
        for (s, e) in backups {
            assert!(je <= s || js >= e);
        }
        // Used ranges never overlap one another.
        let mut used = lay.used.clone();
        used.sort();
        for w in used.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{w:?}");
        }
    }
}
