//! Pure ext4 synthesizer: a format-neutral [`Tree`] in, metadata blocks and data placement out.
//!
//! The synthesizer never sees file contents. It decides where every file's data blocks go on the device,
//! and renders every metadata block (superblock and backups, group descriptors, bitmaps, inode tables,
//! journal superblock, directory / extent / xattr / slow-symlink blocks). The caller serves file data
//! from wherever it lives (chunks) at the device blocks given in [`Ext4Image::placements`]; every block
//! that is neither metadata nor file data reads as zeros.
//!
//! Layout (see `docs/formats/ext4-layout.md`):
//! ```text
//! [SB+GDT] [block bitmaps] [inode bitmaps] [inode tables] [journal] [dir/extent/xattr/symlink blocks]
//! [file data, contiguous per file, in NodeId order] ............................ [free space]
//! ```
//! Feature set: has_journal, ext_attr, dir_index, filetype, extents, 64bit, flex_bg, sparse_super,
//! large_file, huge_file, dir_nlink, extra_isize, metadata_csum. Output is a pure function of the input.
//!
//! ```
//! use tessera_ext4::*;
//!
//! let meta = Meta { mode: 0o755, uid: 0, gid: 0, atime: Timestamp::default(),
//!                   mtime: Timestamp::default(), ctime: Timestamp::default() };
//! let tree = Tree {
//!     nodes: vec![
//!         Node { meta, kind: NodeKind::Directory { entries: vec![DirEntry { name: b"hello"[..].into(), node: NodeId(1) }] }, xattrs: vec![] },
//!         Node { meta, kind: NodeKind::Regular { size: 6, data: tessera_ext4::smallvec::smallvec![DataRange { start_block: 0, blocks: 1 }] }, xattrs: vec![] },
//!     ],
//! };
//! let opts = Options { size: SizePolicy::Free(None), inodes: None, fs_time: 1_700_000_000, seed: [0; 32], label: vec![] };
//! let image = synthesize(&tree, &opts)?;
//! // The caller writes `image.metadata` and serves "hello\n" + zeros at the placed block.
//! let placed = image.placements[1][0];
//! assert_eq!((placed.file_block, placed.blocks), (0, 1));
//! assert!(placed.device_block >= image.geometry.data_start_block);
//! # Ok::<(), Ext4Error>(())
//! ```
#![forbid(unsafe_code)]

pub mod error;
pub mod tree;

pub mod acl;
pub mod bitmap;
mod build;
mod bytes;
pub mod checksum;
pub mod dir;
pub mod extent;
pub mod group;
pub mod hash;
pub mod htree;
pub mod inode;
pub mod journal;
pub mod layout;
mod namespace;
pub mod scan;
pub mod superblock;
pub mod xattr;

pub use error::Ext4Error;
/// The small-vector type of [`Name`] and [`DataRanges`], for callers that build them.
pub use smallvec;
pub use tree::{DataRange, DataRanges, DirEntry, Meta, Name, Node, NodeId, NodeKind, Timestamp, Tree, Xattr};

/// How big the filesystem should be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SizePolicy {
    /// Exactly this many bytes (rounded down to a whole block; a tail group too small to hold its
    /// metadata is dropped, as mke2fs does). Too small for the tree is an error.
    Exact(u64),
    /// Enough for the tree plus at least this many free bytes.
    /// `None` means the default: at least 256 MiB and 25% of the data size free.
    Free(Option<u64>),
}

/// Synthesis options. Everything that influences the output bytes is here.
#[derive(Debug, Clone)]
pub struct Options {
    /// Device size policy.
    pub size: SizePolicy,
    /// Minimum total number of inodes. `None`: used inodes plus max(4096, 25% of used) free.
    pub inodes: Option<u64>,
    /// Filesystem time T for the superblock, the journal, lost+found and implicit directories.
    pub fs_time: i64,
    /// Seed from which the UUID and the directory hash seed are derived (e.g. a digest of the tree and
    /// its content). Different seeds give different UUIDs.
    pub seed: [u8; 32],
    /// Volume label, at most 16 bytes.
    pub label: Vec<u8>,
}

/// A contiguous piece of a file's data placed on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlacedExtent {
    /// First logical block of the file (file offset / 4096).
    pub file_block: u64,
    /// First device block.
    pub device_block: u64,
    /// Number of blocks.
    pub blocks: u64,
}

/// A run of consecutive metadata blocks with their bytes (a multiple of 4096 bytes long).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataRun {
    /// First device block.
    pub start_block: u64,
    /// The bytes of the blocks; `data.len()` is a multiple of the block size ([`tessera_image::BLOCK_SIZE`]).
    pub data: Vec<u8>,
}

/// Geometry and statistics of a synthesized filesystem: the image contract's type, which the image
/// record stores as is.
pub use tessera_image::Geometry;

/// The result of synthesis.
#[derive(Debug, Clone)]
pub struct Ext4Image {
    pub geometry: Geometry,
    /// Every metadata block that is not all zeros, sorted by `start_block`, non-overlapping, coalesced.
    /// All-zero blocks (unused inode-table space, the journal body) are left out: they read as zeros.
    pub metadata: Vec<MetadataRun>,
    /// For every regular-file node (by `NodeId` index), where its data ranges went, sorted by
    /// `file_block`. Non-regular nodes have an empty list.
    pub placements: Vec<Vec<PlacedExtent>>,
}

/// What [`synthesize_into`] returns besides the metadata it handed to its sink.
#[derive(Debug, Clone)]
pub struct Ext4Layout {
    pub geometry: Geometry,
    /// As [`Ext4Image::placements`].
    pub placements: Vec<Vec<PlacedExtent>>,
}

/// Receives the metadata as it is rendered: runs of non-zero blocks in device order, each
/// starting after the end of the one before. Contiguous runs may come in several pieces.
pub trait MetadataSink {
    fn put(&mut self, run: MetadataRun);
}

/// Collects the runs, joining contiguous pieces ([`Ext4Image::metadata`]'s form).
impl MetadataSink for Vec<MetadataRun> {
    fn put(&mut self, mut run: MetadataRun) {
        match self.last_mut() {
            Some(last)
                if last.start_block + (last.data.len() / tessera_image::BlockSize::USIZE) as u64
                    == run.start_block =>
            {
                last.data.append(&mut run.data);
            }
            _ => self.push(run),
        }
    }
}

/// Largest regular file ext4 can describe with 32-bit logical block numbers: 16 TiB − 4 KiB.
pub const MAX_FILE_SIZE: u64 = build::MAX_FILE_SIZE;

/// Synthesize an ext4 filesystem for `tree`.
///
/// Validates the tree (names, references, sizes, xattrs), numbers inodes canonically (breadth-first,
/// names sorted by bytes), sizes the device per [`SizePolicy`], lays out metadata then file data with
/// one sequential allocator, and renders every metadata block with its checksum. The output is a pure
/// function of `tree` and `options`.
pub fn synthesize(tree: &Tree, options: &Options) -> Result<Ext4Image, Ext4Error> {
    let mut metadata = Vec::new();
    let Ext4Layout { geometry, placements } = build::synthesize(tree, options, &mut metadata)?;
    Ok(Ext4Image { geometry, metadata, placements })
}

/// [`synthesize`], handing the metadata to `sink` as it is rendered, in device order, instead of
/// returning it: the metadata (256 bytes an inode plus every directory block) is never held whole.
/// The runs are those of [`Ext4Image::metadata`], possibly cut in pieces.
pub fn synthesize_into(
    tree: &Tree,
    options: &Options,
    sink: &mut dyn MetadataSink,
) -> Result<Ext4Layout, Ext4Error> {
    build::synthesize(tree, options, sink)
}
