//! Errors: per request (each maps to exactly one virtio status) and for the daemon.

use std::path::PathBuf;
use std::sync::Arc;

use tessera_engine::{ReadError, SinkError};
use tessera_overlay::OverlayError;

use thiserror::Error;
use virtio_bindings::bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP};

/// The status byte the device writes at the end of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok,
    IoErr,
    Unsupp,
}

impl Status {
    /// The byte written to the guest.
    pub fn byte(self) -> u8 {
        let v = match self {
            Status::Ok => VIRTIO_BLK_S_OK,
            Status::IoErr => VIRTIO_BLK_S_IOERR,
            Status::Unsupp => VIRTIO_BLK_S_UNSUPP,
        };
        v as u8
    }
}

/// Why a chain is handed back without a status: there is no byte we may write it to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum DropReason {
    #[error("the chain has no device-writable byte for the status")]
    NoStatus,
    #[error("the status byte lies outside guest memory")]
    StatusOutsideMemory,
}

/// A request the device refuses or fails, answered through the status byte.
#[derive(Debug, Error, Clone)]
#[non_exhaustive]
pub enum RequestError {
    #[error("descriptor chain longer than {max} descriptors")]
    TooManyDescriptors { max: usize },
    #[error("a device-readable descriptor follows a device-writable one")]
    ReadableAfterWritable,
    #[error("buffer {addr:#x}+{len} lies outside guest memory")]
    OutsideMemory { addr: u64, len: u32 },
    #[error("the request header needs 16 device-readable bytes, the chain has {len}")]
    HeaderTooShort { len: u64 },
    #[error("request type {kind} is not supported")]
    Unsupported { kind: u32 },
    #[error("data length {len} is not a multiple of 512")]
    UnalignedLength { len: u64 },
    #[error("discard/write-zeroes payload of {len} bytes is not a positive multiple of 16")]
    BadDiscardPayload { len: u64 },
    #[error("{count} discard/write-zeroes segments, at most {max} supported")]
    TooManyDiscardSegments { count: u64, max: u32 },
    #[error("discard/write-zeroes flags {flags:#x} are not supported")]
    BadDiscardFlags { flags: u32 },
    #[error("sectors {sector}+{sectors} are beyond the end of the device ({capacity} sectors)")]
    OutOfRange { sector: u64, sectors: u64, capacity: u64 },
    #[error("the device is read-only")]
    ReadOnly,
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("guest buffer {addr:#x}+{len} could not be accessed")]
    GuestMemory { addr: u64, len: u32 },
    #[error("overlay access at byte {offset}")]
    Overlay {
        offset: u64,
        #[source]
        source: Arc<OverlayError>,
    },
}

impl From<SinkError> for RequestError {
    fn from(e: SinkError) -> Self {
        RequestError::GuestMemory { addr: e.addr, len: e.len }
    }
}

impl RequestError {
    /// The virtio status for this error: the one exhaustive mapping.
    pub fn status(&self) -> Status {
        match self {
            RequestError::Unsupported { .. } | RequestError::BadDiscardFlags { .. } => Status::Unsupp,
            RequestError::TooManyDescriptors { .. }
            | RequestError::ReadableAfterWritable
            | RequestError::OutsideMemory { .. }
            | RequestError::HeaderTooShort { .. }
            | RequestError::UnalignedLength { .. }
            | RequestError::BadDiscardPayload { .. }
            | RequestError::TooManyDiscardSegments { .. }
            | RequestError::OutOfRange { .. }
            | RequestError::ReadOnly
            | RequestError::Read(_)
            | RequestError::GuestMemory { .. }
            | RequestError::Overlay { .. } => Status::IoErr,
        }
    }
}

/// Errors of the daemon itself (socket, vhost-user framework), not of a guest request.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ServeError {
    #[error("socket {path}")]
    Socket {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid configuration: {0}")]
    Config(&'static str),
    /// The vhost-user framework failed (its error type is not `Sync`, so it is kept as text).
    #[error("vhost-user daemon: {what}: {message}")]
    Daemon { what: &'static str, message: String },
    #[error("{what}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Overlay(#[from] OverlayError),
}
