//! Execute a [`Plan`] against guest memory, and the whole per-chain pipeline
//! (parse → plan → execute → status) in [`serve_chain`].

use std::sync::Arc;

use tessera_metrics::{RequestStatus, RequestType};
use tracing::{debug, debug_span, warn};
use virtio_queue::desc::split::Descriptor;
use vm_memory::bitmap::BS;
use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions, VolatileSlice};

use crate::config::DeviceConfig;
use crate::error::{RequestError, Status};
use crate::log_limit::LogLimit;
use crate::plan::{plan, Plan};
use crate::request::{parse, GuestSeg, Parsed, RequestKind};
pub use tessera_engine::BlockDevice;
use tessera_engine::{FetchDone, Sink, SinkError, Visit};
use tessera_overlay::{Mode as OverlayMode, Overlay, OverlayError};

/// Largest piece of a write gathered from guest memory at once.
pub const BOUNCE_MAX: usize = 1 << 20;

/// What requests execute against: the image's device bytes alone, or the copy-on-write overlay
/// over them. Whether the guest may write is the device's `read_only` ([`DeviceConfig`]), not
/// this: a read-only device can serve an overlay opened read-only (`serve --read-only --overlay`),
/// only a writable one needs [`Disk::Overlay`].
#[derive(Clone)]
pub enum Disk {
    /// The base image with no overlay: writes, discards and write-zeroes are refused.
    Base(Arc<dyn BlockDevice>),
    /// The copy-on-write overlay over the base image.
    Overlay(Arc<Overlay>),
}

impl std::fmt::Debug for Disk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Disk::Base(_) => f.write_str("Disk::Base"),
            Disk::Overlay(o) => write!(f, "Disk::Overlay({o:?})"),
        }
    }
}

impl Disk {
    /// Fill `buf` with the device bytes at `offset`.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), RequestError> {
        match self {
            Disk::Base(s) => Ok(s.read_at(offset, buf)?),
            Disk::Overlay(o) => o.read_at(offset, buf).map_err(|e| overlay_err(offset, e)),
        }
    }

    /// Hand the device bytes `[offset, offset + len)` to `sink` (see [`BlockDevice::visit`]).
    pub fn visit(
        &self,
        offset: u64,
        len: u64,
        fetch: bool,
        sink: &mut dyn Sink,
    ) -> Result<Visit, RequestError> {
        match self {
            Disk::Base(s) => Ok(s.visit(offset, len, fetch, sink)?),
            Disk::Overlay(o) => o.visit(offset, len, fetch, sink).map_err(|e| overlay_err(offset, e)),
        }
    }

    /// Fetch ahead what a read of `[offset, offset + len)` needs (see
    /// [`BlockDevice::fetch_ahead`]).
    pub fn fetch_ahead(&self, offset: u64, len: u64, done: FetchDone) {
        match self {
            Disk::Base(s) => s.fetch_ahead(offset, len, done),
            Disk::Overlay(o) => o.fetch_ahead(offset, len, done),
        }
    }

    fn overlay(&self) -> Result<&Overlay, RequestError> {
        match self {
            Disk::Base(_) => Err(RequestError::ReadOnly),
            Disk::Overlay(o) => Ok(o),
        }
    }

    /// Whether a FLUSH has work to wait for (an overlay that syncs): the queue workers hand it
    /// to the overlay's group commit ([`Overlay::flush_async`]) instead of running it inline.
    pub fn defers_flush(&self) -> bool {
        matches!(self, Disk::Overlay(o) if o.mode() == OverlayMode::Durable)
    }

    /// Make completed writes durable (nothing to do without an overlay).
    pub fn flush(&self) -> Result<(), RequestError> {
        match self {
            Disk::Base(_) => Ok(()),
            Disk::Overlay(o) => o.flush().map_err(|e| overlay_err(0, e)),
        }
    }
}

fn overlay_err(offset: u64, e: OverlayError) -> RequestError {
    RequestError::Overlay { offset, source: Arc::new(e) }
}

/// What [`execute`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Executed {
    /// Done; this many bytes were written into device-writable guest buffers (not counting the
    /// status byte).
    Done(u32),
    /// Without `fetch`: the read needs a chunk that is not in memory; nothing is complete.
    Missing,
}

/// Execute `plan`. Reads are copied straight from the disk (the memory tier, the prefix,
/// zeros, overlay slots) into the guest's buffers; without `fetch`, a read that would wait for
/// a chunk fetch returns [`Executed::Missing`] instead.
pub fn execute<M: GuestMemory + ?Sized>(
    plan: &Plan,
    mem: &M,
    disk: &Disk,
    device: &DeviceConfig,
    bounce: &mut Vec<u8>,
    fetch: bool,
) -> Result<Executed, RequestError> {
    let done = |n: u32| Ok(Executed::Done(n));
    match plan {
        Plan::Flush => disk.flush().and_then(|()| done(0)),
        Plan::Zeroes { ranges } => {
            let o = disk.overlay()?;
            for &(offset, len) in ranges {
                o.write_zeroes(offset, len).map_err(|e| overlay_err(offset, e))?;
            }
            done(0)
        }
        Plan::Write { offset, len, data } => {
            let o = disk.overlay()?;
            let mut cursor = Cursor { segs: data, index: 0, within: 0 };
            let mut pos = 0u64;
            while pos < *len {
                // Pieces end on BOUNCE_MAX boundaries of the device, so only the first and the
                // last block of the request can be partial.
                let at = offset + pos;
                let to_boundary = BOUNCE_MAX as u64 - at % BOUNCE_MAX as u64;
                let n = usize::try_from((*len - pos).min(to_boundary)).unwrap_or(BOUNCE_MAX);
                if bounce.len() < n {
                    bounce.resize(n, 0);
                }
                let buf = &mut bounce[..n];
                cursor.read(mem, buf)?;
                o.write_at(at, buf).map_err(|e| overlay_err(at, e))?;
                pos += n as u64;
            }
            done(0)
        }
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
            done(written)
        }
        Plan::Read { offset, len, data } => {
            let mut sink = GuestSink::new(mem, data);
            match disk.visit(*offset, *len, fetch, &mut sink)? {
                // A chain is at most 2^32 bytes, so the data length fits.
                Visit::Done => done(u32::try_from(*len).unwrap_or(u32::MAX)),
                Visit::Missing => Ok(Executed::Missing),
            }
        }
    }
}

/// Zeros to copy from.
static ZEROS: [u8; 64 << 10] = [0; 64 << 10];

/// A [`Sink`] scattering device bytes straight into the guest's buffers.
struct GuestSink<'a, M: GuestMemory + ?Sized> {
    mem: &'a M,
    cursor: Cursor<'a>,
    /// The host slice of the guest buffer the cursor is in, by its index: a buffer is
    /// translated once, not once per piece (a 1 MiB read of small files is ~60 pieces, and each
    /// translation searched the memory regions: 1.75% of its CPU).
    open: Option<(usize, VolatileSlice<'a, BS<'a, M::Bitmap>>)>,
}

impl<'a, M: GuestMemory + ?Sized> GuestSink<'a, M> {
    fn new(mem: &'a M, segs: &'a [GuestSeg]) -> Self {
        Self { mem, cursor: Cursor { segs, index: 0, within: 0 }, open: None }
    }

    /// The host slice of guest buffer `index`, when one slice covers it whole.
    fn slice(&mut self, index: usize) -> Option<&VolatileSlice<'a, BS<'a, M::Bitmap>>> {
        if self.open.as_ref().is_none_or(|(i, _)| *i != index) {
            let seg = self.cursor.segs.get(index)?;
            let mut slices = self.mem.get_slices(seg.addr, seg.len as usize, Permissions::Write).ok()?;
            let whole = slices.next()?.ok().filter(|s| s.len() == seg.len as usize)?;
            self.open = Some((index, whole));
        }
        self.open.as_ref().map(|(_, s)| s)
    }
}

impl<M: GuestMemory + ?Sized> Sink for GuestSink<'_, M> {
    fn put(&mut self, mut bytes: &[u8]) -> Result<(), SinkError> {
        while !bytes.is_empty() {
            let (index, within) = (self.cursor.index, self.cursor.within as usize);
            let (addr, n) = self.cursor.next(bytes.len())?;
            let piece = &bytes[..n];
            let written = match self.slice(index) {
                Some(slice) => slice.write_slice(piece, within).is_ok(),
                // A buffer spanning regions: translated piece by piece.
                None => self.mem.write_slice(piece, addr).is_ok(),
            };
            if !written {
                return Err(SinkError { addr: addr.0, len: n as u32 });
            }
            bytes = &bytes[n..];
        }
        Ok(())
    }

    fn zeros(&mut self, mut n: u64) -> Result<(), SinkError> {
        while n > 0 {
            let k = usize::try_from(n).unwrap_or(usize::MAX).min(ZEROS.len());
            self.put(&ZEROS[..k])?;
            n -= k as u64;
        }
        Ok(())
    }
}

/// Consecutive bytes across a list of guest buffers.
struct Cursor<'a> {
    segs: &'a [GuestSeg],
    index: usize,
    within: u32,
}

impl Cursor<'_> {
    /// The next piece of at most `max` bytes, advancing the cursor.
    fn next(&mut self, max: usize) -> Result<(GuestAddress, usize), SinkError> {
        let Some(s) = self.segs.get(self.index) else {
            // The plan's length is the sum of the segments: cannot happen.
            return Err(SinkError { addr: 0, len: u32::try_from(max).unwrap_or(u32::MAX) });
        };
        let room = (s.len - self.within) as usize;
        let n = room.min(max);
        let addr = GuestAddress(s.addr.0 + u64::from(self.within));
        self.within += n as u32;
        if self.within == s.len {
            self.index += 1;
            self.within = 0;
        }
        Ok((addr, n))
    }

    /// Gather the guest buffers into `buf`.
    fn read<M: GuestMemory + ?Sized>(&mut self, mem: &M, mut buf: &mut [u8]) -> Result<(), SinkError> {
        while !buf.is_empty() {
            let (addr, n) = self.next(buf.len())?;
            let (head, rest) = buf.split_at_mut(n);
            mem.read_slice(head, addr).map_err(|_| SinkError { addr: addr.0, len: n as u32 })?;
            buf = rest;
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
    /// What the request was, for the metrics.
    pub kind: RequestType,
    /// Bytes the request moved if it succeeded: data read or written, the range discarded or
    /// zeroed, the serial's bytes; 0 for a flush.
    pub bytes: u64,
    /// The request's first sector (DISCARD / WRITE_ZEROES: of its range; 0 when it could not
    /// be parsed), for `--record-requests`.
    pub sector: u64,
    /// The bytes it asked for: its data buffers, or its DISCARD / WRITE_ZEROES range.
    pub len: u64,
}

impl Completion {
    /// The status as a metrics label.
    pub fn metric_status(&self) -> RequestStatus {
        match self.status {
            Some(Status::Ok) => RequestStatus::Ok,
            Some(Status::IoErr) => RequestStatus::IoErr,
            Some(Status::Unsupp) => RequestStatus::Unsupp,
            None => RequestStatus::Dropped,
        }
    }
}

/// Parse, plan and execute one descriptor chain and write its status byte (a read that needs
/// a chunk fetch blocks for it).
pub fn serve_chain<M: GuestMemory + ?Sized>(
    descs: impl IntoIterator<Item = Descriptor>,
    mem: &M,
    disk: &Disk,
    device: &DeviceConfig,
    bounce: &mut Vec<u8>,
) -> Completion {
    match start_chain(descs, mem, disk, device, bounce, true) {
        Started::Done(c) => c,
        Started::Deferred(d) => d.finish(mem, disk),
        // Not returned with `fetch` (a FLUSH then runs inline); if it were, flush here.
        Started::Flush(f) => f.finish(mem, disk.flush()),
    }
}

/// The outcome of [`start_chain`].
#[derive(Debug)]
pub enum Started {
    /// Complete: add it to the used ring.
    Done(Completion),
    /// A read waiting for a chunk fetch: [`DeferredRead::finish`] it off the queue thread.
    Deferred(DeferredRead),
    /// A FLUSH for the overlay's group commit: [`DeferredFlush::finish`] it once the commit is
    /// done.
    Flush(DeferredFlush),
}

/// A FLUSH handed to the overlay's group commit; everything else about it is checked.
#[derive(Debug)]
pub struct DeferredFlush {
    status: GuestAddress,
}

impl DeferredFlush {
    /// The commit finished with `result`: write the status byte.
    pub fn finish<M: GuestMemory + ?Sized>(self, mem: &M, result: Result<(), RequestError>) -> Completion {
        complete(mem, self.status, result.map(|()| Executed::Done(0)), RequestType::Flush, 0, (0, 0))
    }

    /// [`Self::finish`] with the group commit's outcome.
    pub fn committed<M: GuestMemory + ?Sized>(
        self,
        mem: &M,
        result: Result<(), Arc<OverlayError>>,
    ) -> Completion {
        self.finish(mem, result.map_err(|source| RequestError::Overlay { offset: 0, source }))
    }
}

/// A read that needs a chunk not in memory; everything else about it is checked.
#[derive(Debug)]
pub struct DeferredRead {
    status: GuestAddress,
    offset: u64,
    len: u64,
    data: Vec<GuestSeg>,
}

impl DeferredRead {
    /// The device range read: `(offset, len)`.
    pub fn range(&self) -> (u64, u64) {
        (self.offset, self.len)
    }

    /// Fail the read with `error` (its chunks could not be fetched): write the status byte.
    pub fn fail<M: GuestMemory + ?Sized>(self, mem: &M, error: Arc<tessera_store::StoreError>) -> Completion {
        complete(
            mem,
            self.status,
            Err(RequestError::Read(tessera_engine::ReadError::Store { offset: self.offset, source: error })),
            RequestType::Read,
            self.len,
            self.extent(),
        )
    }

    /// `(sector, len)` as the request asked.
    fn extent(&self) -> (u64, u64) {
        (self.offset / crate::request::SECTOR_SIZE, self.len)
    }

    /// Fetch what is missing (blocking), copy the bytes into the guest's buffers, write the
    /// status byte.
    pub fn finish<M: GuestMemory + ?Sized>(self, mem: &M, disk: &Disk) -> Completion {
        let span =
            debug_span!("request", kind = "read", offset = self.offset, len = self.len, deferred = true);
        let _enter = span.enter();
        let mut sink = GuestSink::new(mem, &self.data);
        let result = disk.visit(self.offset, self.len, true, &mut sink).map(|v| match v {
            Visit::Done => Executed::Done(u32::try_from(self.len).unwrap_or(u32::MAX)),
            Visit::Missing => Executed::Missing,
        });
        let extent = self.extent();
        complete(mem, self.status, result, RequestType::Read, self.len, extent)
    }
}

/// Parse, plan and execute one descriptor chain. Without `fetch`, a read that needs a chunk not
/// in memory is returned as [`Started::Deferred`] (nothing written yet); everything else
/// completes here, status byte included.
pub fn start_chain<M: GuestMemory + ?Sized>(
    descs: impl IntoIterator<Item = Descriptor>,
    mem: &M,
    disk: &Disk,
    device: &DeviceConfig,
    bounce: &mut Vec<u8>,
    fetch: bool,
) -> Started {
    let (status_addr, request) = match parse(descs, mem) {
        Parsed::Drop(reason) => {
            // A guest can send these at will: rate-limited, with a count of those not logged.
            static MALFORMED: LogLimit = LogLimit::per_10s(5);
            if let Some(suppressed) = MALFORMED.allow() {
                warn!(%reason, suppressed, "dropping a malformed descriptor chain");
            }
            return Started::Done(Completion {
                used_len: 0,
                status: None,
                kind: RequestType::Invalid,
                bytes: 0,
                sector: 0,
                len: 0,
            });
        }
        Parsed::Reply { status, request } => (status, request),
    };
    let (kind, bytes, extent) = match &request {
        Ok(req) => (request_type(&req.kind), moved_bytes(req), extent(req)),
        Err(RequestError::Unsupported { .. }) => (RequestType::Unsupported, 0, (0, 0)),
        Err(_) => (RequestType::Invalid, 0, (0, 0)),
    };
    // One span from here to the status byte, so that a refusal logged on completion names the
    // request; disabled (the default filter), it costs a check of the global max level.
    let span = match &request {
        Ok(req) => debug_span!("request", kind = kind.label(), sector = req.sector, len = req.data_len),
        Err(_) => debug_span!("request", kind = kind.label()),
    };
    let _enter = span.enter();
    let result = request.and_then(|req| {
        let p = plan(req, device)?;
        if !fetch && matches!(p, Plan::Flush) && disk.defers_flush() {
            return Ok(Err(p));
        }
        match execute(&p, mem, disk, device, bounce, fetch)? {
            Executed::Done(n) => Ok(Ok(n)),
            Executed::Missing => Ok(Err(p)),
        }
    });
    let result = match result {
        Ok(Err(Plan::Read { offset, len, data })) => {
            return Started::Deferred(DeferredRead { status: status_addr, offset, len, data });
        }
        Ok(Err(Plan::Flush)) => return Started::Flush(DeferredFlush { status: status_addr }),
        // Only reads can miss.
        Ok(Err(_)) => Err(RequestError::GuestMemory { addr: status_addr.0, len: 0 }),
        Ok(Ok(n)) => Ok(Executed::Done(n)),
        Err(e) => Err(e),
    };
    Started::Done(complete(mem, status_addr, result, kind, bytes, extent))
}

/// Write the status byte of a finished request.
fn complete<M: GuestMemory + ?Sized>(
    mem: &M,
    status_addr: GuestAddress,
    result: Result<Executed, RequestError>,
    kind: RequestType,
    bytes: u64,
    (sector, len): (u64, u64),
) -> Completion {
    let (status, written) = match result {
        Ok(Executed::Done(n)) => (Status::Ok, n),
        // Only without `fetch`, which `finish` never uses.
        Ok(Executed::Missing) => (Status::IoErr, 0),
        Err(e) => {
            match &e {
                RequestError::Read(_) | RequestError::GuestMemory { .. } | RequestError::Overlay { .. } => {
                    // A guest can cause these at will (bad buffer addresses), and a failing
                    // origin fails every read: rate-limited, with a count of those not logged.
                    static FAILED: LogLimit = LogLimit::per_10s(5);
                    if let Some(suppressed) = FAILED.allow() {
                        warn!(error = %tessera_engine::Chain(&e), suppressed, "request failed")
                    }
                }
                _ => debug!(error = &e as &dyn std::error::Error, "request refused"),
            }
            (e.status(), 0)
        }
    };
    if !crate::guest::write(mem, status_addr, &[status.byte()]) {
        // parse() checked the address; memory cannot shrink under a held guard.
        return Completion { used_len: 0, status: None, kind, bytes: 0, sector, len };
    }
    // GET_ID moves what fits of the serial.
    let bytes = if kind == RequestType::GetId { u64::from(written) } else { bytes };
    Completion { used_len: written.saturating_add(1), status: Some(status), kind, bytes, sector, len }
}

fn request_type(kind: &RequestKind) -> RequestType {
    match kind {
        RequestKind::In => RequestType::Read,
        RequestKind::Out => RequestType::Write,
        RequestKind::Flush => RequestType::Flush,
        RequestKind::GetId => RequestType::GetId,
        RequestKind::Discard(_) => RequestType::Discard,
        RequestKind::WriteZeroes(_) => RequestType::WriteZeroes,
    }
}

/// `(first sector, bytes)` the request asks for: its data, or its DISCARD / WRITE_ZEROES range.
fn extent(req: &crate::request::Request) -> (u64, u64) {
    match &req.kind {
        RequestKind::Discard(ranges) | RequestKind::WriteZeroes(ranges) => {
            (ranges.first().map_or(0, |r| r.sector), moved_bytes(req))
        }
        RequestKind::Flush => (0, 0),
        _ => (req.sector, req.data_len),
    }
}

/// The bytes a request moves if it succeeds (GET_ID: decided when it completes).
fn moved_bytes(req: &crate::request::Request) -> u64 {
    match &req.kind {
        RequestKind::In | RequestKind::Out => req.data_len,
        RequestKind::Discard(ranges) | RequestKind::WriteZeroes(ranges) => {
            ranges.iter().map(|r| u64::from(r.sectors) * crate::request::SECTOR_SIZE).sum()
        }
        RequestKind::Flush | RequestKind::GetId => 0,
    }
}
