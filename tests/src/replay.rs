//! Replay a request trace (`tessera serve --record-requests`, `docs/formats/requests.md`) against
//! any vhost-user-blk socket through libblkio, as fast as its dependencies allow.
//!
//! A request is issued once every request that had completed before it was issued in the
//! recording has completed in the replay; think time is dropped. Two requests overlap in the
//! replay only if they overlapped in the recording, so the replay's concurrency is the
//! recording's; each goes to its recorded queue. GET_ID (libblkio has no call for it) and
//! unsupported or invalid requests are skipped (they count as complete at once). With a raw
//! export, every byte read is compared with it, except ranges the replay itself changed.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use tessera_e2e::replay::{replay, ReplayOptions};
//! let trace = tessera_e2e::replay::load("boot.requests".as_ref())?;
//! let opts = ReplayOptions { raw: Some("web.raw".into()), writes: false };
//! let report = replay(&trace, "/tmp/vm.sock".as_ref(), &opts)?;
//! println!("{}", report.summary());
//! # Ok(()) }
//! ```

use std::fs::File;
use std::mem::MaybeUninit;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use blkio::{Blkioq, Completion, ReqFlags};
use tessera_image::{RequestOp, RequestRecord, RequestStatus, RequestTrace};

use crate::daemon::BlkClient;

/// Largest buffer region the replayer maps (slots × the largest request).
const MAX_REGION: usize = 1 << 30;
/// How long the replay waits for any completion before it gives up.
const STALL: Duration = Duration::from_secs(60);

/// How to replay.
#[derive(Debug, Clone, Default)]
pub struct ReplayOptions {
    /// The raw export to check every byte read against.
    pub raw: Option<PathBuf>,
    /// Replay writes, discards and write-zeroes too (a scratch device only!); without it a trace
    /// holding any is refused.
    pub writes: bool,
}

/// One request as the replay issued it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Issued {
    pub queue: u16,
    pub sector: u64,
    pub len: u64,
    /// The op's trace code ([`RequestOp::code`]).
    pub op: u8,
}

impl Issued {
    /// The request `r` asks for.
    pub fn of(r: &RequestRecord) -> Self {
        Self { queue: r.queue, sector: r.sector, len: r.len, op: r.op.code() }
    }
}

/// What a replay did.
#[derive(Debug, Clone, Default)]
pub struct ReplayReport {
    /// From the first request issued to the last completion.
    pub wall: Duration,
    /// The same span in the recording.
    pub recorded_wall: Duration,
    /// Requests issued, in issue order.
    pub issued: Vec<Issued>,
    /// Requests skipped (GET_ID, unsupported, invalid).
    pub skipped: u64,
    /// Bytes read, written (discard and write-zeroes ranges not counted).
    pub read_bytes: u64,
    pub written_bytes: u64,
    /// Bytes read that were compared with the raw export (all equal, or the replay failed).
    pub checked_bytes: u64,
    /// Requests whose status differs from the recorded one.
    pub status_mismatches: u64,
    /// Requests that failed in the replay.
    pub failed: u64,
    /// Most requests in flight at once.
    pub max_in_flight: usize,
    /// Replay latency per issued request (issue to completion seen), sorted.
    pub latencies: Vec<Duration>,
}

impl ReplayReport {
    /// The latency at quantile `q` (0..=1), zero if nothing was issued.
    pub fn percentile(&self, q: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.latencies.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
        self.latencies[i]
    }

    /// Human-readable lines.
    pub fn summary(&self) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        format!(
            "wall {:.1} ms (recorded {:.1} ms); {} requests ({} skipped), max {} in flight; \
             read {} B, written {} B, {} B checked against the raw export; {} failed, {} status mismatches\n\
             latency ms: p50 {:.3} p90 {:.3} p99 {:.3} max {:.3}",
            ms(self.wall),
            ms(self.recorded_wall),
            self.issued.len(),
            self.skipped,
            self.max_in_flight,
            self.read_bytes,
            self.written_bytes,
            self.checked_bytes,
            self.failed,
            self.status_mismatches,
            ms(self.percentile(0.5)),
            ms(self.percentile(0.9)),
            ms(self.percentile(0.99)),
            ms(self.percentile(1.0)),
        )
    }

    /// The report as JSON (durations in ns).
    pub fn json(&self) -> serde_json::Value {
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        serde_json::json!({
            "wall_ns": ns(self.wall),
            "recorded_wall_ns": ns(self.recorded_wall),
            "requests": self.issued.len(),
            "skipped": self.skipped,
            "max_in_flight": self.max_in_flight,
            "read_bytes": self.read_bytes,
            "written_bytes": self.written_bytes,
            "checked_bytes": self.checked_bytes,
            "failed": self.failed,
            "status_mismatches": self.status_mismatches,
            "latency_ns": {
                "p50": ns(self.percentile(0.5)),
                "p90": ns(self.percentile(0.9)),
                "p99": ns(self.percentile(0.99)),
                "max": ns(self.percentile(1.0)),
            },
        })
    }
}

/// Read and decode the request trace at `path`.
pub fn load(path: &Path) -> Result<RequestTrace> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    RequestTrace::decode(&bytes).with_context(|| format!("decoding the request trace {}", path.display()))
}

/// Whether the replay issues `op` (else it is skipped).
fn replayed(op: RequestOp) -> bool {
    matches!(
        op,
        RequestOp::Read | RequestOp::Write | RequestOp::Flush | RequestOp::Discard | RequestOp::WriteZeroes
    )
}

/// The dependency schedule of a trace: issue order, and for each request (in issue order) how
/// many requests of the completion order must be done before it may be issued.
#[derive(Debug)]
struct Schedule {
    /// Record indexes by (issued_ns, completed_ns).
    issue: Vec<usize>,
    /// Record indexes by completed_ns.
    completion: Vec<usize>,
    /// Per position of `issue`: requests that completed strictly before it was issued.
    need: Vec<usize>,
    /// Most requests that overlap (none completed before another was issued).
    max_overlap: usize,
}

impl Schedule {
    fn new(records: &[RequestRecord]) -> Self {
        let mut issue: Vec<usize> = (0..records.len()).collect();
        issue.sort_by_key(|&i| (records[i].issued_ns, records[i].completed_ns, i));
        let mut completion: Vec<usize> = (0..records.len()).collect();
        completion.sort_by_key(|&i| (records[i].completed_ns, i));
        let done_times: Vec<u64> = completion.iter().map(|&i| records[i].completed_ns).collect();
        let need: Vec<usize> =
            issue.iter().map(|&i| done_times.partition_point(|&t| t < records[i].issued_ns)).collect();
        // In flight at the issue of the k-th request: those issued before it (k) minus those
        // it depends on (need[k]).
        let max_overlap = need.iter().enumerate().map(|(k, &n)| k + 1 - n).max().unwrap_or(0);
        Self { issue, completion, need, max_overlap }
    }
}

/// Replay `trace` against the vhost-user-blk socket `socket`.
pub fn replay(trace: &RequestTrace, socket: &Path, opts: &ReplayOptions) -> Result<ReplayReport> {
    let records = &trace.records;
    let modifies = records.iter().filter(|r| r.op.modifies()).count();
    ensure!(
        modifies == 0 || opts.writes,
        "the trace holds {modifies} writes, discards or write-zeroes: replay it with --writes, \
         against a scratch device only (tessera serve with a temporary overlay, or \
         qemu-storage-daemon on a copy of the raw export)"
    );
    let raw = opts
        .raw
        .as_deref()
        .map(|p| File::open(p).with_context(|| format!("opening the raw export {}", p.display())))
        .transpose()?;
    let sched = Schedule::new(records);
    let slot_len = records
        .iter()
        .filter(|r| matches!(r.op, RequestOp::Read | RequestOp::Write))
        .map(|r| r.len)
        .max()
        .unwrap_or(0)
        .max(4096);
    let slot_len = usize::try_from(slot_len.next_multiple_of(4096))?;
    let slots = sched.max_overlap.max(1);
    let region_len = slots.checked_mul(slot_len).filter(|&n| n <= MAX_REGION).with_context(|| {
        format!("{slots} requests of up to {slot_len} bytes in flight do not fit a {MAX_REGION}-byte region")
    })?;
    let queues = i32::from(trace.header.queues);
    let mut client = BlkClient::connect_with_region(socket, queues, modifies == 0, region_len)?;
    ensure!(
        client.capacity() >= trace.header.device_bytes,
        "the device has {} bytes, the trace was recorded on {}",
        client.capacity(),
        trace.header.device_bytes
    );
    let (qs, region) = client.raw_parts();
    let base = region.addr;
    let multi = qs.len() > 1;
    if multi {
        qs.iter_mut().for_each(|q| q.set_completion_fd_enabled(true));
    }

    let mut report = ReplayReport {
        recorded_wall: recorded_wall(records),
        skipped: records.iter().filter(|r| !replayed(r.op)).count() as u64,
        ..Default::default()
    };
    let mut done = vec![false; records.len()];
    let mut free: Vec<usize> = (0..slots).rev().collect();
    // Per record: (slot, issued at) while in flight.
    let mut flying: Vec<Option<(usize, Instant)>> = vec![None; records.len()];
    let mut in_flight_per_queue = vec![0usize; qs.len()];
    let mut in_flight = 0usize;
    // Device ranges the replay changed: reads overlapping them are not checked.
    let mut changed: Vec<(u64, u64)> = Vec::new();
    let mut scratch = Vec::new();
    let mut completions: Vec<MaybeUninit<Completion>> = (0..slots).map(|_| MaybeUninit::uninit()).collect();
    let (mut next, mut completed_prefix) = (0usize, 0usize);
    let start = Instant::now();
    let mut last_progress = start;
    while completed_prefix < records.len() {
        // Issue everything whose dependencies are done.
        while next < records.len() && sched.need[next] <= completed_prefix {
            let i = sched.issue[next];
            next += 1;
            let r = &records[i];
            if !replayed(r.op) {
                done[i] = true;
                continue;
            }
            let q = usize::from(r.queue);
            let queue = qs.get_mut(q).with_context(|| format!("the trace uses queue {q}"))?;
            let slot = free.pop().context("more requests in flight than the trace overlaps")?;
            let ptr = (base + slot * slot_len) as *mut u8;
            let offset = r.sector * 512;
            let len = usize::try_from(r.len)?;
            match r.op {
                RequestOp::Read => queue.read(offset, ptr, len, i, ReqFlags::empty()),
                RequestOp::Write => {
                    // SAFETY: the slot lies inside the mapped region (slot < slots, len ≤
                    // slot_len) and no request in flight uses it.
                    let buf = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
                    buf.iter_mut().enumerate().for_each(|(k, b)| *b = (r.sector as usize + k / 512) as u8);
                    queue.write(offset, ptr, len, i, ReqFlags::empty());
                    changed.push((offset, offset + r.len));
                }
                RequestOp::Flush => queue.flush(i, ReqFlags::empty()),
                RequestOp::Discard => {
                    queue.discard(offset, r.len, i, ReqFlags::empty());
                    changed.push((offset, offset + r.len));
                }
                RequestOp::WriteZeroes => {
                    queue.write_zeroes(offset, r.len, i, ReqFlags::empty());
                    changed.push((offset, offset + r.len));
                }
                other => bail!("cannot replay {other:?}"),
            }
            flying[i] = Some((slot, Instant::now()));
            in_flight_per_queue[q] += 1;
            in_flight += 1;
            report.max_in_flight = report.max_in_flight.max(in_flight);
            report.issued.push(Issued::of(r));
        }
        // Advance the completed prefix.
        while completed_prefix < records.len() && done[sched.completion[completed_prefix]] {
            completed_prefix += 1;
        }
        if completed_prefix == records.len() {
            break;
        }
        if in_flight == 0 {
            continue; // Skipped requests completed: issue more.
        }
        // Wait for completions: blocking on the one busy queue, else polling the busy ones.
        let busy = in_flight_per_queue.iter().filter(|&&n| n > 0).count();
        let mut got_any = false;
        for (q, queue) in qs.iter_mut().enumerate() {
            if in_flight_per_queue[q] == 0 {
                continue;
            }
            let got = wait(queue, &mut completions, usize::from(busy == 1))?;
            for c in &completions[..got] {
                // SAFETY: do_io initialized the first `got` entries.
                let c = unsafe { c.assume_init_ref() };
                let i = c.user_data;
                let (slot, at) = flying.get_mut(i).and_then(Option::take).context("an unknown completion")?;
                report.latencies.push(at.elapsed());
                let r = &records[i];
                let ok = c.ret == 0;
                if !ok {
                    report.failed += 1;
                }
                if ok != (r.status == RequestStatus::Ok) {
                    report.status_mismatches += 1;
                }
                match r.op {
                    RequestOp::Read if ok => {
                        report.read_bytes += r.len;
                        if let Some(raw) = &raw {
                            let len = usize::try_from(r.len)?;
                            let offset = r.sector * 512;
                            if !changed.iter().any(|&(a, b)| a < offset + r.len && offset < b) {
                                // SAFETY: as for the write above; this read has completed, so
                                // nothing writes to its slot now.
                                let got = unsafe {
                                    std::slice::from_raw_parts((base + slot * slot_len) as *const u8, len)
                                };
                                check(raw, offset, got, &mut scratch)?;
                                report.checked_bytes += r.len;
                            }
                        }
                    }
                    RequestOp::Write if ok => report.written_bytes += r.len,
                    _ => {}
                }
                free.push(slot);
                done[i] = true;
                in_flight_per_queue[q] -= 1;
                in_flight -= 1;
                got_any = true;
            }
        }
        if got_any {
            last_progress = Instant::now();
        } else {
            if busy > 1 {
                wait_fds(qs, &in_flight_per_queue)?;
            }
            ensure!(
                last_progress.elapsed() < STALL,
                "{in_flight} requests did not complete within {STALL:?}"
            );
        }
    }
    report.wall = start.elapsed();
    report.latencies.sort();
    Ok(report)
}

/// Up to `completions.len()` completions of `queue`, waiting for at least `min`.
fn wait(queue: &mut Blkioq, completions: &mut [MaybeUninit<Completion>], min: usize) -> Result<usize> {
    let mut timeout = STALL;
    queue
        .do_io(completions, min, Some(&mut timeout), None)
        .map_err(|e| anyhow::anyhow!("libblkio do_io: {e}"))
}

/// Block until a busy queue's completion fd is readable (at most 1 ms), and reset it.
fn wait_fds(qs: &[Blkioq], busy: &[usize]) -> Result<()> {
    let mut fds: Vec<libc::pollfd> = qs
        .iter()
        .zip(busy)
        .filter(|(_, &n)| n > 0)
        .filter_map(|(q, _)| q.get_completion_fd())
        .map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })
        .collect();
    if fds.is_empty() {
        return Ok(());
    }
    // SAFETY: `fds` is a valid array of pollfd for the duration of the call.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 1) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            bail!("poll on the completion fds: {e}");
        }
    }
    for p in fds.iter().filter(|p| p.revents & libc::POLLIN != 0) {
        let mut b = [0u8; 8];
        // SAFETY: reading 8 bytes into a local buffer from an eventfd libblkio owns; a failed
        // read (EAGAIN) is harmless.
        let _ = unsafe { libc::read(p.fd, b.as_mut_ptr().cast(), b.len()) };
    }
    Ok(())
}

/// Compare `got` with the raw export's bytes at `offset` (zeros past its end).
fn check(raw: &File, offset: u64, got: &[u8], scratch: &mut Vec<u8>) -> Result<()> {
    scratch.clear();
    scratch.resize(got.len(), 0);
    let mut at = 0usize;
    while at < scratch.len() {
        let n = raw.read_at(&mut scratch[at..], offset + at as u64).context("reading the raw export")?;
        if n == 0 {
            break; // Past the end: zeros.
        }
        at += n;
    }
    if got == &scratch[..] {
        return Ok(());
    }
    if let Some(k) = got.iter().zip(scratch.iter()).position(|(a, b)| a != b) {
        bail!(
            "the read of {} bytes at {offset} differs from the raw export at byte {}",
            got.len(),
            offset + k as u64
        );
    }
    Ok(())
}

fn recorded_wall(records: &[RequestRecord]) -> Duration {
    let first = records.iter().map(|r| r.issued_ns).min().unwrap_or(0);
    let last = records.iter().map(|r| r.completed_ns).max().unwrap_or(0);
    Duration::from_nanos(last - first)
}

#[cfg(test)]
mod tests {
    use tessera_image::RequestStatus;

    use super::*;

    fn rec(issued_ns: u64, completed_ns: u64) -> RequestRecord {
        RequestRecord {
            queue: 0,
            op: RequestOp::Read,
            status: RequestStatus::Ok,
            sector: 0,
            len: 4096,
            issued_ns,
            completed_ns,
        }
    }

    #[test]
    fn dependencies_follow_the_recording() {
        // 0 and 1 overlap; 2 starts after both; 3 after 2 completed but overlapping nothing else.
        let records = [rec(0, 10), rec(5, 12), rec(20, 30), rec(31, 40), rec(25, 50)];
        let s = Schedule::new(&records);
        assert_eq!(s.issue, [0, 1, 2, 4, 3]);
        assert_eq!(s.need, [0, 0, 2, 2, 3]);
        // 2 and 4 overlap, then 4 and 3.
        assert_eq!(s.max_overlap, 2);
        // Completion at the very issue time of another is not "before" it: they overlap.
        let s = Schedule::new(&[rec(0, 10), rec(10, 20)]);
        assert_eq!((s.need.as_slice(), s.max_overlap), ([0usize, 0].as_slice(), 2));
        assert_eq!(Schedule::new(&[]).max_overlap, 0);
    }
}
