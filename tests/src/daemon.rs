//! `tessera serve` as a child process, and a libblkio client (the `blkio` crate, libblkio's own
//! Rust implementation) to read from it the way a VMM does.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use tessera_e2e::daemon::{BlkClient, Daemon};
//! let d = Daemon::start("web", "http://127.0.0.1:8080/store", "/tmp/vm.sock".as_ref(), &["--read-only"])?;
//! let mut c = BlkClient::connect(d.socket(), 1, true)?;
//! let first = c.read(0, 4096)?.expect("status ok");
//! drop(c);
//! d.stop()?;
//! # Ok(()) }
//! ```

use std::ffi::OsStr;
use std::fs;
use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};

use crate::tessera;

/// A running `tessera serve`; SIGTERM and reaped on drop unless [`Daemon::stop`] did it.
#[derive(Debug)]
pub struct Daemon {
    child: Option<Child>,
    socket: PathBuf,
}

impl Daemon {
    /// Start `tessera serve IMAGE --store STORE --socket SOCKET EXTRA...` and wait (polling)
    /// until the socket exists: it appears only once it accepts. A stale socket file is removed
    /// first so the poll cannot see it.
    pub fn start<S: AsRef<OsStr>>(
        image: &str,
        store: impl AsRef<OsStr>,
        socket: &Path,
        extra: &[S],
    ) -> Result<Self> {
        let _ = fs::remove_file(socket);
        let child = tessera::command(["serve", image])
            .arg("--store")
            .arg(store)
            .arg("--socket")
            .arg(socket)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting tessera serve")?;
        let mut d = Daemon { child: Some(child), socket: socket.to_owned() };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !d.socket.exists() {
            if let Some(status) = d.child_mut()?.try_wait()? {
                d.child = None;
                bail!("tessera serve exited with {status} before its socket appeared");
            }
            ensure!(
                Instant::now() < deadline,
                "tessera serve did not create {} within 30 s",
                socket.display()
            );
            std::thread::sleep(Duration::from_millis(10)); // polling interval, not a fixed wait
        }
        Ok(d)
    }

    /// A `tessera serve` started otherwise (e.g. [`crate::metrics::spawn_with_metrics`]) whose
    /// socket is `socket`: stopped and checked as [`Self::start`]'s.
    pub fn adopt(child: Child, socket: &Path) -> Self {
        Daemon { child: Some(child), socket: socket.to_owned() }
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn child_mut(&mut self) -> Result<&mut Child> {
        self.child.as_mut().context("the daemon is gone")
    }

    /// SIGTERM: the daemon must exit 0 and remove its socket.
    pub fn stop(mut self) -> Result<()> {
        let mut child = self.child.take().context("the daemon is gone")?;
        terminate(&child);
        let status = child.wait()?;
        ensure!(status.success(), "tessera serve exited with {status} after SIGTERM");
        ensure!(!self.socket.exists(), "tessera serve left its socket {} behind", self.socket.display());
        Ok(())
    }
}

fn terminate(child: &Child) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill(2) on our own child, which has not been reaped yet (we hold its Child).
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            terminate(&child);
            let _ = child.wait();
        }
    }
}

/// Bytes of the client's buffer region: the most one batch of reads can ask for.
pub const REGION_LEN: usize = 16 << 20;

/// A libblkio `virtio-blk-vhost-user` client with one mapped buffer region.
pub struct BlkClient {
    // Dropped after the queues (field order): the region and queues belong to it.
    queues: Vec<Blkioq>,
    region: MemoryRegion,
    blkio: Blkio,
    capacity: u64,
}

impl std::fmt::Debug for BlkClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlkClient").field("capacity", &self.capacity).finish_non_exhaustive()
    }
}

/// The outcome of one read: the bytes, or libblkio's negative errno (`-EIO` for
/// `VIRTIO_BLK_S_IOERR`).
pub type ReadResult = std::result::Result<Vec<u8>, i32>;

/// A read that failed: its device offset and libblkio's negative errno.
pub type FailedRead = (u64, i32);

impl BlkClient {
    /// Connect with `queues` queues (`read_only`: set before connecting, as libblkio needs).
    pub fn connect(socket: &Path, queues: i32, read_only: bool) -> Result<Self> {
        Self::connect_with_region(socket, queues, read_only, REGION_LEN)
    }

    /// [`Self::connect`] with a buffer region of `region_len` bytes.
    pub fn connect_with_region(
        socket: &Path,
        queues: i32,
        read_only: bool,
        region_len: usize,
    ) -> Result<Self> {
        let err = |what: &'static str| move |e: blkio::Error| anyhow::anyhow!("libblkio {what}: {e}");
        let mut blkio = Blkio::new("virtio-blk-vhost-user").map_err(err("new"))?;
        blkio.set_str("path", socket.to_str().context("socket path is not UTF-8")?).map_err(err("path"))?;
        blkio.set_bool("read-only", read_only).map_err(err("read-only"))?;
        blkio.connect().map_err(err("connect"))?;
        let capacity = blkio.get_u64("capacity").map_err(err("capacity"))?;
        blkio.set_i32("num-queues", queues).map_err(err("num-queues"))?;
        let started = blkio.start().map_err(err("start"))?;
        let region = blkio.alloc_mem_region(region_len).map_err(err("alloc_mem_region"))?;
        blkio.map_mem_region(&region).map_err(err("map_mem_region"))?;
        Ok(Self { queues: started.queues, region, blkio, capacity })
    }

    /// Device size in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The queues and the mapped buffer region, for a caller driving requests itself (the
    /// replayer): buffers must lie inside the region.
    pub fn raw_parts(&mut self) -> (&mut [Blkioq], &MemoryRegion) {
        (&mut self.queues, &self.region)
    }

    /// The libblkio instance (for properties).
    pub fn blkio(&self) -> &Blkio {
        &self.blkio
    }

    /// One read on queue 0.
    pub fn read(&mut self, offset: u64, len: usize) -> Result<ReadResult> {
        Ok(self.read_batch(0, &[(offset, len)])?.remove(0))
    }

    /// Submit all `reads` (`(offset, len)`) at once on queue `q` — the queue depth is their
    /// number — and wait for every completion (at most 60 s). Their lengths must fit the buffer
    /// region together.
    pub fn read_batch(&mut self, q: usize, reads: &[(u64, usize)]) -> Result<Vec<ReadResult>> {
        let total: usize = reads.iter().map(|r| r.1).sum();
        ensure!(total <= self.region.len, "{total} bytes of reads do not fit the {REGION_LEN}-byte region");
        let queue = self.queues.get_mut(q).with_context(|| format!("no queue {q}"))?;
        let mut at = 0usize;
        let mut placed = Vec::with_capacity(reads.len());
        for (i, &(offset, len)) in reads.iter().enumerate() {
            let ptr = (self.region.addr + at) as *mut u8;
            queue.read(offset, ptr, len, i, ReqFlags::empty());
            placed.push(at);
            at += len;
        }
        let rets = wait_all(queue, reads.len(), Duration::from_secs(60))?;
        let mut out = Vec::with_capacity(reads.len());
        for ((ret, &(_, len)), at) in rets.into_iter().zip(reads).zip(placed) {
            match ret {
                Some(0) => {
                    // SAFETY: the region is a live mapping of `region.len` bytes owned by
                    // `self.blkio`; `at + len <= total <= region.len`; its read has completed, so
                    // nothing writes to this range now.
                    let bytes =
                        unsafe { std::slice::from_raw_parts((self.region.addr + at) as *const u8, len) };
                    out.push(Ok(bytes.to_vec()));
                }
                Some(errno) => out.push(Err(errno)),
                None => bail!("a read never completed"),
            }
        }
        Ok(out)
    }

    /// Write every `(offset, bytes)` of `writes` at once on queue 0 (together they must fit the
    /// buffer region), wait for them, then FLUSH and wait for it (each at most `timeout`): the
    /// writes' statuses and the FLUSH's (0 or libblkio's negative errno).
    pub fn write_and_flush(
        &mut self,
        writes: &[(u64, Vec<u8>)],
        timeout: Duration,
    ) -> Result<(Vec<i32>, i32)> {
        let total: usize = writes.iter().map(|w| w.1.len()).sum();
        ensure!(total <= self.region.len, "{total} bytes of writes do not fit the region");
        let queue = self.queues.first_mut().context("no queue 0")?;
        let mut at = 0usize;
        for (i, (offset, bytes)) in writes.iter().enumerate() {
            // SAFETY: the region is a live mapping of `region.len` bytes owned by `self.blkio`,
            // `at + len <= total <= region.len`, and no request uses it now.
            let buf =
                unsafe { std::slice::from_raw_parts_mut((self.region.addr + at) as *mut u8, bytes.len()) };
            buf.copy_from_slice(bytes);
            queue.write(*offset, buf.as_ptr(), bytes.len(), i, ReqFlags::empty());
            at += bytes.len();
        }
        let rets = wait_all(queue, writes.len(), timeout)?;
        let rets: Vec<i32> = rets.into_iter().map(|r| r.unwrap_or(i32::MIN)).collect();
        queue.flush(0, ReqFlags::empty());
        let flush = wait_all(queue, 1, timeout)?.remove(0).unwrap_or(i32::MIN);
        Ok((rets, flush))
    }

    /// Submit `reads` on queue 0 and return without waiting for them (a client about to go away
    /// with requests in flight).
    pub fn submit_reads(&mut self, reads: &[(u64, usize)]) -> Result<()> {
        let total: usize = reads.iter().map(|r| r.1).sum();
        ensure!(total <= self.region.len, "{total} bytes of reads do not fit the region");
        let queue = self.queues.first_mut().context("no queue 0")?;
        let mut at = 0usize;
        for (i, &(offset, len)) in reads.iter().enumerate() {
            queue.read(offset, (self.region.addr + at) as *mut u8, len, i, ReqFlags::empty());
            at += len;
        }
        let mut none: [MaybeUninit<Completion>; 0] = [];
        let mut zero = Duration::ZERO;
        queue
            .do_io(&mut none, 0, Some(&mut zero), None)
            .map_err(|e| anyhow::anyhow!("libblkio do_io: {e}"))?;
        Ok(())
    }

    /// Read the whole device in `piece`-byte requests on queue 0, keeping `depth` in flight (a
    /// new one is submitted as each completes, as fio's `iodepth` does — not in lockstep
    /// batches, where the slowest of each batch would hold the others). Returns the bytes
    /// (zeros where a read failed) and the offsets of the failed reads with their errno.
    pub fn read_device(&mut self, piece: usize, depth: usize) -> Result<(Vec<u8>, Vec<FailedRead>)> {
        ensure!(piece > 0 && depth > 0 && piece * depth <= self.region.len, "bad piece or depth");
        let cap = usize::try_from(self.capacity)?;
        let mut out = vec![0u8; cap];
        let mut failed = Vec::new();
        let region = self.region.addr;
        let queue = self.queues.first_mut().context("no queue 0")?;
        // Slot k reads into region[k·piece..]; `inflight[k]` is its request's device offset.
        let mut inflight: Vec<Option<usize>> = vec![None; depth];
        let mut next = 0usize;
        let submit = |queue: &mut Blkioq,
                      slot: usize,
                      inflight: &mut Vec<Option<usize>>,
                      next: &mut usize| {
            if *next < cap {
                let len = piece.min(cap - *next);
                queue.read(*next as u64, (region + slot * piece) as *mut u8, len, slot, ReqFlags::empty());
                inflight[slot] = Some(*next);
                *next += len;
            }
        };
        for slot in 0..depth {
            submit(queue, slot, &mut inflight, &mut next);
        }
        let mut completions: Vec<MaybeUninit<Completion>> =
            (0..depth).map(|_| MaybeUninit::uninit()).collect();
        let limit = Duration::from_secs(60);
        while inflight.iter().any(Option::is_some) {
            let mut timeout = limit;
            let got = queue
                .do_io(&mut completions, 1, Some(&mut timeout), None)
                .map_err(|e| anyhow::anyhow!("libblkio do_io: {e}"))?;
            ensure!(got > 0, "no read completed within {limit:?}");
            for c in &completions[..got] {
                // SAFETY: do_io initialized the first `got` entries.
                let c = unsafe { c.assume_init_ref() };
                let slot = c.user_data;
                let at = inflight
                    .get_mut(slot)
                    .and_then(Option::take)
                    .context("a completion for a slot with nothing in flight")?;
                let len = piece.min(cap - at);
                if c.ret == 0 {
                    // SAFETY: the region is a live mapping of `region.len` bytes owned by
                    // `self.blkio`; `slot·piece + len <= depth·piece <= region.len`; this slot's
                    // read has completed and the next one is submitted only below.
                    let bytes =
                        unsafe { std::slice::from_raw_parts((region + slot * piece) as *const u8, len) };
                    out[at..at + len].copy_from_slice(bytes);
                } else {
                    failed.push((at as u64, c.ret));
                }
                submit(queue, slot, &mut inflight, &mut next);
            }
        }
        failed.sort_unstable();
        Ok((out, failed))
    }
}

/// Wait for the completions of the `n` requests submitted on `queue` (user_data `0..n`), at most
/// `limit` in all: each request's `ret` (`None`: never completed — an error is returned first).
fn wait_all(queue: &mut Blkioq, n: usize, limit: Duration) -> Result<Vec<Option<i32>>> {
    let mut rets = vec![None; n];
    let mut completions: Vec<MaybeUninit<Completion>> = (0..n).map(|_| MaybeUninit::uninit()).collect();
    let deadline = Instant::now() + limit;
    let mut done = 0;
    while done < n {
        let want = n - done;
        let mut timeout = deadline.saturating_duration_since(Instant::now());
        let got = queue
            .do_io(&mut completions[..want], 1, Some(&mut timeout), None)
            .map_err(|e| anyhow::anyhow!("libblkio do_io: {e}"))?;
        ensure!(got > 0, "{want} of {n} requests did not complete within {limit:?}");
        for c in &completions[..got] {
            // SAFETY: do_io initialized the first `got` entries.
            let c = unsafe { c.assume_init_ref() };
            let slot = rets.get_mut(c.user_data).context("a completion with an unknown user_data")?;
            ensure!(slot.is_none(), "request {} completed twice", c.user_data);
            *slot = Some(c.ret);
            done += 1;
        }
    }
    Ok(rets)
}
