//! The format-neutral input tree.

/// Index of a node in [`Tree::nodes`]. The root directory is `NodeId(0)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(pub u32);

/// A point in time: signed seconds since the epoch and nanoseconds (< 1e9).
///
/// 12 bytes, aligned to 4 (`packed(4)`): a node holds three, and a million-entry tree a million
/// nodes, so the 4 bytes of padding each would cost 12 MB. Fields are read by value
/// (`t.sec`), never borrowed (`&t.sec` does not compile: the field may be misaligned).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(C, packed(4))]
pub struct Timestamp {
    pub sec: i64,
    pub nsec: u32,
}

/// Ownership, permissions and times of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Meta {
    /// Permission bits including setuid, setgid and sticky (`mode & 0o7777`); the file type comes from
    /// [`NodeKind`].
    pub mode: u16,
    pub uid: u32,
    pub gid: u32,
    pub atime: Timestamp,
    pub mtime: Timestamp,
    pub ctime: Timestamp,
}

/// An extended attribute with its full name (`user.x`, `security.capability`,
/// `system.posix_acl_access`, ...). POSIX ACL values are in the VFS xattr format (version 2), as
/// `getxattr` returns them; the synthesizer converts them to ext4's on-disk ACL format.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Xattr {
    pub name: Vec<u8>,
    pub value: Vec<u8>,
}

/// A range of a regular file's logical blocks that holds data (everything else is a hole).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DataRange {
    /// First logical block (file offset / 4096).
    pub start_block: u64,
    /// Number of blocks (> 0).
    pub blocks: u64,
}

/// A regular file's data ranges: most files are one range, kept inline (no allocation of its
/// own: 32 bytes a file at a million files).
pub type DataRanges = smallvec::SmallVec<[DataRange; 1]>;

/// A directory entry's name: up to 16 bytes inline (most names; one allocation fewer an entry),
/// longer ones on the heap.
pub type Name = smallvec::SmallVec<[u8; 16]>;

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DirEntry {
    /// The name as raw bytes: 1..=255 bytes, no `/` or NUL, not `.` or `..`.
    pub name: Name,
    pub node: NodeId,
}

/// What a node is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum NodeKind {
    /// A directory. Entries need not be sorted; names must be unique. A directory node is referenced
    /// by exactly one entry (or is the root).
    Directory {
        entries: Vec<DirEntry>,
    },
    /// A regular file of `size` bytes whose data lives in `data` (sorted, non-overlapping, within
    /// `ceil(size / 4096)` blocks); gaps are holes. A regular node referenced by several entries is a
    /// hard link group.
    Regular {
        size: u64,
        data: DataRanges,
    },
    /// A symbolic link with its target (1..=4095 bytes, no NUL).
    Symlink {
        target: Vec<u8>,
    },
    CharDevice {
        major: u32,
        minor: u32,
    },
    BlockDevice {
        major: u32,
        minor: u32,
    },
    Fifo,
    Socket,
}

/// A node: metadata, kind and extended attributes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Node {
    pub meta: Meta,
    pub kind: NodeKind,
    pub xattrs: Vec<Xattr>,
}

/// The whole input: `nodes[0]` is the root directory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tree {
    pub nodes: Vec<Node>,
}
