//! Errors of the synthesizer. Each names the path it concerns where there is one.
use thiserror::Error;

/// Why a tree cannot be synthesized. `path` fields are the slash-separated path from the root,
/// with non-UTF-8 bytes escaped.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Ext4Error {
    #[error("{path}: name is {len} bytes, ext4 allows at most 255")]
    NameTooLong { path: String, len: usize },
    #[error("{path}: invalid name (empty, `.`, `..`, or containing `/` or NUL)")]
    InvalidName { path: String },
    #[error("{path}: duplicate name in directory")]
    DuplicateName { path: String },
    #[error("{path}: file of {size} bytes exceeds ext4's limit of {max} bytes")]
    FileTooLarge { path: String, size: u64, max: u64 },
    #[error("{path}: symlink target of {len} bytes exceeds ext4's limit of 4095 bytes (or is empty / contains NUL)")]
    BadSymlink { path: String, len: usize },
    #[error("{path}: {links} hard links exceed ext4's limit of 65000")]
    TooManyLinks { path: String, links: u64 },
    #[error("{path}: extended attributes do not fit (name {name:?}: {reason})")]
    XattrTooLarge { path: String, name: String, reason: &'static str },
    #[error("{path}: invalid extended attribute {name:?}: {reason}")]
    BadXattr { path: String, name: String, reason: &'static str },
    #[error("{path}: `lost+found` exists but is not a directory")]
    LostFoundNotDirectory { path: String },
    #[error("{path}: invalid data ranges for a file of {size} bytes")]
    BadDataRanges { path: String, size: u64 },
    #[error("node {node} is referenced by {refs} directory entries; a directory needs exactly one (or be the root)")]
    BadDirectoryReferences { node: u32, refs: usize },
    #[error("node {node} does not exist or is unreachable")]
    BadNode { node: u32 },
    #[error("the root node is not a directory")]
    RootNotDirectory,
    #[error("image needs {needed} inodes, ext4 allows at most {max}")]
    TooManyInodes { needed: u64, max: u64 },
    #[error("requested size of {requested} bytes is too small: the tree needs at least {needed} bytes")]
    SizeTooSmall { requested: u64, needed: u64 },
    #[error("image of {blocks} blocks exceeds the supported maximum of {max} blocks")]
    ImageTooLarge { blocks: u64, max: u64 },
    #[error(
        "{path}: timestamp {sec}.{nsec:09} is outside ext4's range (1901-12-13 .. 2446-05-10, nsec < 1e9)"
    )]
    TimestampOutOfRange { path: String, sec: i64, nsec: u32 },
    #[error("{path}: device number {major}:{minor} does not fit Linux's 12-bit major / 20-bit minor")]
    BadDeviceNumber { path: String, major: u32, minor: u32 },
    #[error("label is {len} bytes, at most 16 allowed")]
    LabelTooLong { len: usize },
    #[error("internal error of the synthesizer: {what}")]
    Internal { what: &'static str },
}
