//! A raw vhost-user frontend, for hostile-guest tests of a whole daemon: the protocol through
//! the `vhost` crate's `Frontend` (what a VMM sends: features, memory table, one split
//! virtqueue), guest memory a memfd this process maps too, and descriptors the test writes
//! itself — out-of-range addresses, loops, absurd lengths, rings that lie. libblkio and QEMU
//! only ever send well-formed chains; this sends anything.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{Address, Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

/// Guest-physical base and length of the one memory region.
pub const MEM_BASE: u64 = 0x10_0000;
pub const MEM_LEN: u64 = 4 << 20;
/// Entries in the virtqueue.
pub const QUEUE_SIZE: u16 = 256;
const DESC_TABLE: u64 = MEM_BASE;
const AVAIL_RING: u64 = MEM_BASE + 0x1000;
const USED_RING: u64 = MEM_BASE + 0x2000;
/// Where request headers, data buffers and status bytes go: one 8 KiB slot per descriptor
/// head, past the rings.
pub const DATA: u64 = MEM_BASE + 0x1_0000;
const SLOT: u64 = 8 << 10;

/// `VRING_DESC_F_NEXT`, `VRING_DESC_F_WRITE` (device-writable), `VRING_DESC_F_INDIRECT`.
pub const NEXT: u16 = 1;
pub const WRITE: u16 = 2;
pub const INDIRECT: u16 = 4;
/// `VIRTIO_BLK_T_IN` (read), `_OUT` (write).
pub const T_IN: u32 = 0;
pub const T_OUT: u32 = 1;

/// VIRTIO_F_VERSION_1, VIRTIO_RING_F_INDIRECT_DESC, VHOST_USER_F_PROTOCOL_FEATURES: the
/// features this frontend takes when offered (no EVENT_IDX: every completion notifies).
const WANTED: u64 = (1 << 32) | (1 << 28) | (1 << 30);

/// One descriptor, as the guest writes it.
#[derive(Debug, Clone, Copy)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub flags: u16,
    pub next: u16,
}

/// A connected frontend with queue 0 running.
pub struct RawFrontend {
    // Dropped first: the backend sees the disconnect while the memory is still mapped here.
    frontend: Frontend,
    mem: GuestMemoryMmap<()>,
    kick: EventFd,
    _call: EventFd,
    /// The next avail ring index to publish, and the used ring index read up to.
    avail: u16,
    used: u16,
}

impl std::fmt::Debug for RawFrontend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawFrontend")
            .field("avail", &self.avail)
            .field("used", &self.used)
            .finish_non_exhaustive()
    }
}

impl RawFrontend {
    /// Connect to `socket` and set up queue 0 the way a VMM does.
    pub fn connect(socket: &Path) -> Result<Self> {
        let mut f = Frontend::connect(socket, 1).context("vhost-user connect")?;
        let offered = f.get_features()?;
        f.set_features(offered & WANTED)?;
        if offered & (1 << 30) != 0 {
            let proto = f.get_protocol_features()?;
            let keep = VhostUserProtocolFeatures::MQ
                | VhostUserProtocolFeatures::CONFIG
                | VhostUserProtocolFeatures::REPLY_ACK;
            f.set_protocol_features(proto & keep)?;
        }
        f.set_owner()?;
        let file = memfd("tessera-hostile-guest")?;
        file.set_len(MEM_LEN)?;
        let raw_fd = file.as_raw_fd();
        let mem = GuestMemoryMmap::<()>::from_ranges_with_files(&[(
            GuestAddress(MEM_BASE),
            MEM_LEN as usize,
            Some(FileOffset::new(file, 0)),
        )])
        .context("mapping guest memory")?;
        let host = mem.get_host_address(GuestAddress(MEM_BASE)).context("host address")? as u64;
        let region = VhostUserMemoryRegionInfo::new(MEM_BASE, MEM_LEN, host, 0, raw_fd);
        f.set_mem_table(&[region])?;
        f.set_vring_num(0, QUEUE_SIZE)?;
        f.set_vring_addr(
            0,
            &VringConfigData {
                queue_max_size: QUEUE_SIZE,
                queue_size: QUEUE_SIZE,
                flags: 0,
                desc_table_addr: host + (DESC_TABLE - MEM_BASE),
                used_ring_addr: host + (USED_RING - MEM_BASE),
                avail_ring_addr: host + (AVAIL_RING - MEM_BASE),
                log_addr: None,
            },
        )?;
        f.set_vring_base(0, 0)?;
        let (kick, call) = (EventFd::new(0)?, EventFd::new(0)?);
        f.set_vring_call(0, &call)?;
        f.set_vring_kick(0, &kick)?;
        if offered & (1 << 30) != 0 {
            f.set_vring_enable(0, true)?;
        }
        Ok(Self { frontend: f, mem, kick, _call: call, avail: 0, used: 0 })
    }

    /// Write descriptor `index` of the table (any index: the table wraps at [`QUEUE_SIZE`]).
    pub fn put_desc(&self, index: u16, d: Desc) -> Result<()> {
        let at = GuestAddress(DESC_TABLE + 16 * u64::from(index % QUEUE_SIZE));
        self.mem.write_obj(d.addr, at)?;
        self.mem.write_obj(d.len, at.unchecked_add(8))?;
        self.mem.write_obj(d.flags, at.unchecked_add(12))?;
        self.mem.write_obj(d.next, at.unchecked_add(14))?;
        Ok(())
    }

    /// Write `bytes` at guest address `addr`.
    pub fn write(&self, addr: u64, bytes: &[u8]) -> Result<()> {
        self.mem.write_slice(bytes, GuestAddress(addr))?;
        Ok(())
    }

    /// Read `len` bytes at guest address `addr`.
    pub fn read(&self, addr: u64, len: usize) -> Result<Vec<u8>> {
        let mut out = vec![0u8; len];
        self.mem.read_slice(&mut out, GuestAddress(addr))?;
        Ok(out)
    }

    /// The data slot of descriptor head `head`: 8 KiB of guest memory for its header, data and
    /// status.
    pub fn slot(head: u16) -> u64 {
        DATA + SLOT * u64::from(head % QUEUE_SIZE)
    }

    /// Put `heads` in the avail ring, publish them and kick.
    pub fn submit(&mut self, heads: &[u16]) -> Result<()> {
        for &h in heads {
            let at = GuestAddress(AVAIL_RING + 4 + 2 * u64::from(self.avail % QUEUE_SIZE));
            self.mem.write_obj(h, at)?;
            self.avail = self.avail.wrapping_add(1);
        }
        self.publish(self.avail)
    }

    /// The avail ring index published last.
    pub fn avail(&self) -> u16 {
        self.avail
    }

    /// Set the avail ring's index to `idx` (a well-behaved guest only ever moves it past the
    /// heads it wrote) and kick.
    pub fn publish(&self, idx: u16) -> Result<()> {
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        self.mem.write_obj(idx, GuestAddress(AVAIL_RING + 2))?;
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        self.kick.write(1)?;
        Ok(())
    }

    /// Wait until `n` more used entries were published, at most `limit`: each as (head, length
    /// written).
    pub fn wait_used(&mut self, n: usize, limit: Duration) -> Result<Vec<(u32, u32)>> {
        let deadline = Instant::now() + limit;
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let idx: u16 = self.mem.read_obj(GuestAddress(USED_RING + 2))?;
            while self.used != idx && out.len() < n {
                let at = GuestAddress(USED_RING + 4 + 8 * u64::from(self.used % QUEUE_SIZE));
                let id: u32 = self.mem.read_obj(at)?;
                let len: u32 = self.mem.read_obj(at.unchecked_add(4))?;
                out.push((id, len));
                self.used = self.used.wrapping_add(1);
            }
            if out.len() < n {
                ensure!(Instant::now() < deadline, "{} of {n} completions within {limit:?}", out.len());
                std::thread::sleep(Duration::from_millis(1)); // polling interval
            }
        }
        Ok(out)
    }

    /// A well-formed block request with head descriptor `head` (it uses descriptors `head`,
    /// `head+1`, `head+2`, and the head's data slot): type `kind`, `sector`, a data buffer of
    /// `len` bytes (device-writable for reads), and the status byte. Returns the status byte's
    /// address.
    pub fn request(&self, head: u16, kind: u32, sector: u64, len: u32) -> Result<u64> {
        let slot = Self::slot(head);
        let mut hdr = [0u8; 16];
        hdr[..4].copy_from_slice(&kind.to_le_bytes());
        hdr[8..].copy_from_slice(&sector.to_le_bytes());
        self.write(slot, &hdr)?;
        let (data, status) = (slot + 16, slot + 16 + u64::from(len));
        self.write(status, &[0xff])?;
        let data_flags = if kind == T_IN { WRITE } else { 0 };
        self.put_desc(
            head,
            Desc { addr: slot, len: 16, flags: NEXT, next: head.wrapping_add(1) % QUEUE_SIZE },
        )?;
        self.put_desc(
            head.wrapping_add(1),
            Desc { addr: data, len, flags: data_flags | NEXT, next: head.wrapping_add(2) % QUEUE_SIZE },
        )?;
        self.put_desc(head.wrapping_add(2), Desc { addr: status, len: 1, flags: WRITE, next: 0 })?;
        Ok(status)
    }

    /// The number of queues the backend offers (a harmless request between hostile ones).
    pub fn queue_num(&mut self) -> Result<u64> {
        Ok(self.frontend.get_queue_num()?)
    }
}

fn memfd(name: &str) -> Result<File> {
    let name = std::ffi::CString::new(name)?;
    // SAFETY: memfd_create(2) with a NUL-terminated name; the descriptor it returns is owned by
    // the File from here on.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    ensure!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    Ok(unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}
