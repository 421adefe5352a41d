//! Plan a parsed request against the device: range checks and permissions, no I/O.

use crate::config::DeviceConfig;
use crate::error::RequestError;
use crate::request::{GuestSeg, Request, RequestKind, SECTOR_SIZE};

/// What executing a request will do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Copy device bytes `[offset, offset + len)` into `data`, in order.
    Read { offset: u64, len: u64, data: Vec<GuestSeg> },
    /// Write the bytes of `data` (in order) to device bytes `[offset, offset + len)`.
    Write { offset: u64, len: u64, data: Vec<GuestSeg> },
    /// Make each `(offset, len)` byte range read as zeros (DISCARD and WRITE_ZEROES: both are
    /// honoured the same way, so a discarded range reads as zeros).
    Zeroes { ranges: Vec<(u64, u64)> },
    /// Write the serial (at most 20 bytes) into `data`.
    GetId { data: Vec<GuestSeg> },
    /// Make completed writes durable (nothing to do on a read-only device).
    Flush,
}

/// Check `request` against `device` and decide what to do.
///
/// Writes, DISCARD and WRITE_ZEROES on a read-only device are refused with
/// [`RequestError::ReadOnly`].
pub fn plan(request: Request, device: &DeviceConfig) -> Result<Plan, RequestError> {
    match request.kind {
        RequestKind::In => {
            let sectors = request.data_len / SECTOR_SIZE;
            check_range(request.sector, sectors, device)?;
            // sector + sectors <= capacity, so the byte offset fits.
            Ok(Plan::Read { offset: request.sector * SECTOR_SIZE, len: request.data_len, data: request.data })
        }
        RequestKind::GetId => Ok(Plan::GetId { data: request.data }),
        RequestKind::Flush => Ok(Plan::Flush),
        RequestKind::Out | RequestKind::Discard(_) | RequestKind::WriteZeroes(_) if device.read_only => {
            Err(RequestError::ReadOnly)
        }
        RequestKind::Out => {
            let sectors = request.data_len / SECTOR_SIZE;
            check_range(request.sector, sectors, device)?;
            Ok(Plan::Write {
                offset: request.sector * SECTOR_SIZE,
                len: request.data_len,
                data: request.data,
            })
        }
        RequestKind::Discard(ranges) | RequestKind::WriteZeroes(ranges) => {
            let mut out = Vec::with_capacity(ranges.len());
            for r in ranges {
                check_range(r.sector, u64::from(r.sectors), device)?;
                out.push((r.sector * SECTOR_SIZE, u64::from(r.sectors) * SECTOR_SIZE));
            }
            Ok(Plan::Zeroes { ranges: out })
        }
    }
}

fn check_range(sector: u64, sectors: u64, device: &DeviceConfig) -> Result<(), RequestError> {
    let capacity = device.capacity_sectors();
    match sector.checked_add(sectors) {
        Some(end) if end <= capacity => Ok(()),
        _ => Err(RequestError::OutOfRange { sector, sectors, capacity }),
    }
}

#[cfg(test)]
mod tests {
    use tessera_image::{ImageId, Sha256Digest};
    use vm_memory::GuestAddress;

    use super::*;
    use crate::request::DiscardRange;

    fn dev() -> DeviceConfig {
        DeviceConfig::new(&ImageId(Sha256Digest::of(b"x")), 1 << 20, 1, true)
    }

    fn req(kind: RequestKind, sector: u64, len: u32) -> Request {
        Request {
            kind,
            sector,
            data: vec![GuestSeg { addr: GuestAddress(0x1000), len }],
            data_len: u64::from(len),
        }
    }

    #[test]
    fn reads_are_range_checked() {
        let d = dev();
        assert_eq!(
            plan(req(RequestKind::In, 2040, 4096), &d).unwrap(),
            Plan::Read {
                offset: 2040 * 512,
                len: 4096,
                data: vec![GuestSeg { addr: GuestAddress(0x1000), len: 4096 }]
            }
        );
        assert!(matches!(plan(req(RequestKind::In, 2041, 4096), &d), Err(RequestError::OutOfRange { .. })));
        assert!(matches!(
            plan(req(RequestKind::In, u64::MAX, 512), &d),
            Err(RequestError::OutOfRange { .. })
        ));
        assert!(matches!(plan(req(RequestKind::In, 2048, 0), &d), Ok(Plan::Read { len: 0, .. })));
    }

    #[test]
    fn writes_are_refused() {
        let d = dev();
        for kind in [
            RequestKind::Out,
            RequestKind::Discard(vec![DiscardRange { sector: 0, sectors: 8, unmap: false }]),
            RequestKind::WriteZeroes(vec![DiscardRange { sector: 0, sectors: 8, unmap: true }]),
        ] {
            let e = plan(req(kind, 0, 512), &d).unwrap_err();
            assert!(matches!(e, RequestError::ReadOnly));
            assert_eq!(e.status(), crate::Status::IoErr);
        }
        assert_eq!(plan(req(RequestKind::Flush, 0, 0), &d).unwrap(), Plan::Flush);
    }

    #[test]
    fn writable_device_plans_writes_and_zeroes() {
        let d = DeviceConfig { read_only: false, ..dev() };
        assert_eq!(
            plan(req(RequestKind::Out, 8, 1024), &d).unwrap(),
            Plan::Write {
                offset: 4096,
                len: 1024,
                data: vec![GuestSeg { addr: GuestAddress(0x1000), len: 1024 }]
            }
        );
        assert!(matches!(plan(req(RequestKind::Out, 2047, 1024), &d), Err(RequestError::OutOfRange { .. })));
        let z = RequestKind::WriteZeroes(vec![DiscardRange { sector: 1, sectors: 3, unmap: false }]);
        assert_eq!(plan(req(z, 0, 0), &d).unwrap(), Plan::Zeroes { ranges: vec![(512, 1536)] });
        let far = RequestKind::Discard(vec![DiscardRange { sector: u64::MAX, sectors: 1, unmap: false }]);
        assert!(matches!(plan(req(far, 0, 0), &d), Err(RequestError::OutOfRange { .. })));
        let end = RequestKind::Discard(vec![DiscardRange { sector: 2040, sectors: 9, unmap: false }]);
        assert!(matches!(plan(req(end, 0, 0), &d), Err(RequestError::OutOfRange { .. })));
    }
}
