//! Execute a [`Plan`] against guest memory, and the whole per-chain pipeline
//! (parse → plan → execute → status) in [`serve_chain`].

use std::sync::Arc;

use tessera_store::{ChunkSource, ImageReader, StoreError};
use tracing::{debug, debug_span, warn};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress, GuestMemory};

use crate::config::DeviceConfig;
use crate::error::{RequestError, Status};
use crate::plan::{plan, Plan};
use crate::request::{parse, GuestSeg, Parsed, RequestKind};

/// Largest piece of a read assembled in the bounce buffer at once.
pub const BOUNCE_MAX: usize = 1 << 20;

/// Device bytes to serve: the image read path (or a test double).
pub trait BlockSource: Send + Sync {
    /// Fill `buf` with the device bytes at `offset` (the range is within the device).
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError>;
}

impl<S: ChunkSource> BlockSource for ImageReader<S> {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        ImageReader::read_at(self, offset, buf)
    }
}

impl<T: BlockSource + ?Sized> BlockSource for Arc<T> {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        (**self).read_at(offset, buf)
    }
}

/// Execute `plan`; returns the number of bytes written into device-writable guest buffers
/// (not counting the status byte).
pub fn execute<M: GuestMemory + ?Sized>(
    plan: &Plan,
    mem: &M,
    source: &dyn BlockSource,
    device: &DeviceConfig,
    bounce: &mut Vec<u8>,
) -> Result<u32, RequestError> {
    match plan {
        Plan::Flush => Ok(0),
        Plan::GetId { data } => {
            let mut written = 0u32;
            let mut rest: &[u8] = &device.serial;
            for s in data {
                if rest.is_empty() {
                    break;
                }
                let n = rest.len().min(s.len as usize);
                mem.write_slice(&rest[..n], s.addr)
                    .map_err(|_| RequestError::GuestMemory { addr: s.addr.0, len: s.len })?;
                rest = &rest[n..];
                written += n as u32;
            }
            Ok(written)
        }
        Plan::Read { offset, len, data } => {
            let mut cursor = Scatter { segs: data, index: 0, within: 0 };
            let mut pos = 0u64;
            while pos < *len {
                let n = usize::try_from(*len - pos).unwrap_or(BOUNCE_MAX).min(BOUNCE_MAX);
                if bounce.len() < n {
                    bounce.resize(n, 0);
                }
                let buf = &mut bounce[..n];
                let at = offset + pos;
                source
                    .read_at(at, buf)
                    .map_err(|e| RequestError::Read { offset: at, source: Arc::new(e) })?;
                cursor.write(mem, buf)?;
                pos += n as u64;
            }
            // A chain is at most 2^32 bytes, so the data length fits.
            Ok(u32::try_from(*len).unwrap_or(u32::MAX))
        }
    }
}

/// Writes consecutive bytes across a list of guest buffers.
struct Scatter<'a> {
    segs: &'a [GuestSeg],
    index: usize,
    within: u32,
}

impl Scatter<'_> {
    fn write<M: GuestMemory + ?Sized>(&mut self, mem: &M, mut bytes: &[u8]) -> Result<(), RequestError> {
        while !bytes.is_empty() {
            let Some(s) = self.segs.get(self.index) else {
                // The plan's length is the sum of the segments: cannot happen.
                return Err(RequestError::GuestMemory { addr: 0, len: bytes.len() as u32 });
            };
            let room = (s.len - self.within) as usize;
            let n = room.min(bytes.len());
            let addr = GuestAddress(s.addr.0 + u64::from(self.within));
            mem.write_slice(&bytes[..n], addr)
                .map_err(|_| RequestError::GuestMemory { addr: addr.0, len: n as u32 })?;
            bytes = &bytes[n..];
            self.within += n as u32;
            if self.within == s.len {
                self.index += 1;
                self.within = 0;
            }
        }
        Ok(())
    }
}

/// What happened to one chain, for the used ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// Bytes written into the chain's device-writable buffers, status byte included (0 when the
    /// chain was dropped).
    pub used_len: u32,
    /// The status written, or `None` for a dropped chain.
    pub status: Option<Status>,
}

/// Parse, plan and execute one descriptor chain and write its status byte.
pub fn serve_chain<M: GuestMemory + ?Sized>(
    descs: impl IntoIterator<Item = Descriptor>,
    mem: &M,
    source: &dyn BlockSource,
    device: &DeviceConfig,
    bounce: &mut Vec<u8>,
) -> Completion {
    let (status_addr, request) = match parse(descs, mem) {
        Parsed::Drop(reason) => {
            warn!(%reason, "dropping a malformed descriptor chain");
            return Completion { used_len: 0, status: None };
        }
        Parsed::Reply { status, request } => (status, request),
    };
    let result = request.and_then(|req| {
        let span =
            debug_span!("request", kind = kind_name(&req.kind), sector = req.sector, len = req.data_len);
        let _enter = span.enter();
        let p = plan(req, device)?;
        execute(&p, mem, source, device, bounce)
    });
    let (status, written) = match result {
        Ok(n) => (Status::Ok, n),
        Err(e) => {
            match &e {
                RequestError::Read { .. } | RequestError::GuestMemory { .. } => {
                    warn!(error = %e, "request failed")
                }
                _ => debug!(error = %e, "request refused"),
            }
            (e.status(), 0)
        }
    };
    if mem.write_obj(status.byte(), status_addr).is_err() {
        // parse() checked the address; memory cannot shrink under a held guard.
        return Completion { used_len: 0, status: None };
    }
    Completion { used_len: written.saturating_add(1), status: Some(status) }
}

fn kind_name(kind: &RequestKind) -> &'static str {
    match kind {
        RequestKind::In => "in",
        RequestKind::Out => "out",
        RequestKind::Flush => "flush",
        RequestKind::GetId => "get_id",
        RequestKind::Discard(_) => "discard",
        RequestKind::WriteZeroes(_) => "write_zeroes",
    }
}

impl std::fmt::Debug for dyn BlockSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BlockSource")
    }
}
