use thiserror::Error;

/// Errors from building or querying contract types.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// A BlockMap run overlaps or precedes the previous one.
    #[error("block map run at block {start} overlaps or precedes the previous run ending at {prev_end}")]
    RunOrder { start: u64, prev_end: u64 },
    /// A BlockMap run extends past the device.
    #[error("block map run {start}+{blocks} extends past the device end {device_blocks}")]
    RunPastEnd { start: u64, blocks: u64, device_blocks: u64 },
    /// A run refers to a chunk index that does not exist.
    #[error("block map run refers to chunk #{index}, but only {count} chunks exist")]
    BadChunkIndex { index: u32, count: usize },
    /// A run reads past the end of its chunk.
    #[error("block map run reads blocks {offset}+{blocks} of chunk #{index}, which has only {chunk_blocks} blocks")]
    RunPastChunk { index: u32, offset: u32, blocks: u32, chunk_blocks: u32 },
    /// A run reads past the end of the metadata prefix.
    #[error(
        "block map run reads prefix blocks {offset}+{blocks}, past the prefix of {prefix_blocks} blocks"
    )]
    RunPastPrefix { offset: u64, blocks: u32, prefix_blocks: u64 },
    /// A read range does not fit the device.
    #[error("read of {len} bytes at offset {offset} is outside the device of {device_bytes} bytes")]
    OutOfRange { offset: u64, len: u64, device_bytes: u64 },
    /// A device or prefix too large for its byte size to fit in 64 bits.
    #[error("{what} of {blocks} blocks is too large (at most {max} blocks)")]
    TooLarge { what: &'static str, blocks: u64, max: u64 },
    /// A run of zero blocks.
    #[error("empty block map run at block {start}")]
    EmptyRun { start: u64 },
    /// A pack index encoded piecewise was given entries its format cannot hold.
    #[error("pack index: {reason}")]
    PackIndexEntries { reason: &'static str },
}

/// Errors decoding one of the binary formats (record, pack index) or a digest string.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum DecodeError {
    #[error("bad magic: not a {what}")]
    BadMagic { what: &'static str },
    #[error("unsupported {what} version {version}")]
    UnsupportedVersion { what: &'static str, version: u32 },
    #[error("truncated {what}: needed {needed} more bytes at offset {offset}")]
    Truncated { what: &'static str, offset: usize, needed: usize },
    #[error("{what}: {count} trailing bytes after the end")]
    TrailingBytes { what: &'static str, count: usize },
    #[error("{what}: field {field} is not canonical: {reason}")]
    NotCanonical { what: &'static str, field: &'static str, reason: &'static str },
    #[error("{what}: field {field} is not valid UTF-8")]
    BadUtf8 { what: &'static str, field: &'static str },
    #[error("{what}: line {line}: {reason}")]
    BadLine { what: &'static str, line: usize, reason: &'static str },
    #[error("invalid digest {text:?}: expected `sha256:` and 64 lowercase hex digits")]
    BadDigest { text: String },
    #[error("invalid block map")]
    BlockMap(#[from] Error),
    #[error("invalid image entry JSON")]
    Json(#[from] serde_json::Error),
}
