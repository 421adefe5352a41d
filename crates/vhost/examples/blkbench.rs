//! The benchmark client of `cargo xtask bench serve`: libblkio's pure-Rust vhost-user driver
//! (the `blkio` crate) driving any vhost-user-blk backend (`tessera serve`,
//! `qemu-storage-daemon`) with the same code, pinned to one CPU.
//!
//! ```text
//! blkbench [--socket SOCK] [--cpu N] [--secs S] [--lo BYTES --hi BYTES] [--queues N]
//!          [--queue-size N] [--poll-queues] [--verify RAW [--check sample|full|none]]
//!          [--daemon-pid PID] [--rate IOPS] [--peer-cpu N] TEST...
//! TEST: warm | randread:QD[/full] | seqread:QD[/full] | writeflush | memcpy | wakeup
//! ```
//!
//! Random and sequential reads stay within `[lo, hi)` (e.g. the image's file-data region).
//! With `--queues N` the read tests run one thread per queue, each keeping QD requests in flight
//! on its own queue (all threads on the client CPU); the figures are the sum over the queues.
//!
//! **Checking the bytes** (`--verify RAW`, the raw export of the same image): every completed
//! read is checked against RAW, and a mismatch ends the run at once (exit status 3, the offset
//! and the differing bytes on stderr). Two depths, so that the timed tests measure the daemon and
//! not the check:
//! - `full`: the read's bytes are compared with RAW's (a `pread` of RAW and a `memcmp`, a few µs
//!   per 4 KiB read). Always used by `warm` (every byte of `[lo, hi)` once) and by a test written
//!   `NAME:QD/full`;
//! - `sample` (the default for the timed tests): 16 bytes of every 4 KiB block, at a position
//!   that depends on the block number, against a table of those bytes taken from RAW at start
//!   (16 B per block, ~0.7 MB for 171 MiB: it stays in the cache); a 1 MiB read checks 16 of its
//!   256 blocks (a different 16 on each read). Some 10 ns per request, under 1% of the cheapest
//!   request measured here; `--check none` turns it off to show that.
//!
//! `--poll-queues`: libblkio poll queues instead of interrupt-driven ones: the client busy-polls
//! the used ring for completions (no completion eventfd, no wake-up; the device is asked not to
//! signal), as a guest driver with `io_poll` would. Same for every daemon; it shows how much of a
//! QD1 round trip is the client's own wake-up.
//!
//! `--daemon-pid PID`: the daemon's CPU time (utime + stime of every thread, from
//! `/proc/PID/stat`) over each test, reported per request (`cpu_us_per_op`) and as a share of
//! the test's wall time (`cpu_util`).
//!
//! `--rate IOPS`: `randread:1` issues a request every 1/IOPS s on each queue (open loop) instead
//! of as soon as the last completed, as a VM with a steady load does; a request that is due while
//! the previous one is still in flight is issued when it completes and its latency counts from
//! when it was due (no coordinated omission: a device slower than the rate shows as latency).
//! Named `randread4k_qd1_rateIOPS`.
//!
//! `memcpy`: a single-thread copy of 1 MiB pieces, sequentially through a `[lo, hi)`-sized
//! source into eight 1 MiB destination slots (as a 1 MiB QD8 read test uses them): the memory
//! speed a warm 1 MiB read (one copy into guest memory) is bounded by. Needs no socket.
//!
//! `wakeup`: the round trip of a QD1 request with no request in it — the floor of `randread:1`
//! on this machine and layout. A client thread (on `--cpu`) publishes a request number and
//! blocks reading an eventfd, as an interrupt-driven client waits for its completion; a peer
//! thread (on `--peer-cpu`, the daemon's CPU) polls for the number, yielding the CPU between
//! looks as a polling daemon's worker does, and writes the eventfd. Per round trip: the peer's
//! wake-up of the client, the switches between them on one CPU (or the cross-CPU wake-up of a
//! client whose CPU went idle) and the system calls — what every daemon pays at QD1 whatever
//! its own work. Needs no socket.
//!
//! Each test prints one line `result name=… ops=… secs=… iops=… mbps=… p50_us=… p99_us=… p1_us=…
//! p10_us=… p25_us=… p75_us=… p90_us=… p95_us=… p999_us=… …` (p999: the 99.9th percentile).
#![allow(clippy::unwrap_used)]

use std::fs::File;
use std::mem::MaybeUninit;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use rand::{Rng, SeedableRng};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Check {
    None,
    Sample,
    Full,
}

struct Args {
    socket: String,
    cpu: Option<usize>,
    secs: f64,
    lo: Option<u64>,
    hi: Option<u64>,
    queues: usize,
    queue_size: Option<i32>,
    poll_queues: bool,
    verify: Option<PathBuf>,
    check: Check,
    daemon_pid: Option<u32>,
    rate: Option<f64>,
    peer_cpu: Option<usize>,
    tests: Vec<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        socket: String::new(),
        cpu: None,
        secs: 3.0,
        lo: None,
        hi: None,
        queues: 1,
        queue_size: None,
        poll_queues: false,
        verify: None,
        check: Check::Sample,
        daemon_pid: None,
        rate: None,
        peer_cpu: None,
        tests: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--socket" => a.socket = value("--socket")?,
            "--cpu" => a.cpu = Some(value("--cpu")?.parse().map_err(|e| format!("--cpu: {e}"))?),
            "--secs" => a.secs = value("--secs")?.parse().map_err(|e| format!("--secs: {e}"))?,
            "--lo" => a.lo = Some(value("--lo")?.parse().map_err(|e| format!("--lo: {e}"))?),
            "--hi" => a.hi = Some(value("--hi")?.parse().map_err(|e| format!("--hi: {e}"))?),
            "--queues" => a.queues = value("--queues")?.parse().map_err(|e| format!("--queues: {e}"))?,
            "--queue-size" => {
                a.queue_size = Some(value("--queue-size")?.parse().map_err(|e| format!("--queue-size: {e}"))?)
            }
            "--verify" => a.verify = Some(value("--verify")?.into()),
            "--poll-queues" => a.poll_queues = true,
            "--check" => {
                a.check = match value("--check")?.as_str() {
                    "none" => Check::None,
                    "sample" => Check::Sample,
                    "full" => Check::Full,
                    other => return Err(format!("--check {other}: expected none, sample or full")),
                }
            }
            "--daemon-pid" => {
                a.daemon_pid = Some(value("--daemon-pid")?.parse().map_err(|e| format!("--daemon-pid: {e}"))?)
            }
            "--rate" => {
                let r: f64 = value("--rate")?.parse().map_err(|e| format!("--rate: {e}"))?;
                if !(r.is_finite() && r > 0.0) {
                    return Err("--rate: a positive number of requests per second".into());
                }
                a.rate = Some(r);
            }
            "--peer-cpu" => {
                a.peer_cpu = Some(value("--peer-cpu")?.parse().map_err(|e| format!("--peer-cpu: {e}"))?)
            }
            t if !t.starts_with('-') => a.tests.push(t.to_owned()),
            other => return Err(format!("unknown option {other}")),
        }
    }
    if a.socket.is_empty() && a.tests.iter().any(|t| t != "memcpy" && t != "wakeup") {
        return Err("--socket is required".into());
    }
    if a.verify.is_some()
        && a.tests.iter().position(|t| t == "writeflush").is_some_and(|i| i + 1 < a.tests.len())
    {
        return Err("with --verify, writeflush must be the last test (it changes the device)".into());
    }
    if !(1..=16).contains(&a.queues) {
        return Err("--queues: 1 to 16".into());
    }
    if a.rate.is_some() && a.tests.iter().any(|t| !t.starts_with("randread:1") && t != "warm") {
        return Err("--rate paces randread:1 only".into());
    }
    Ok(a)
}

fn pin(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes inside it;
    // sched_setaffinity only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            panic!("sched_setaffinity({cpu}): {}", std::io::Error::last_os_error());
        }
    }
}

/// Report a wrong byte and end the run: a benchmark of a daemon returning wrong data is void.
fn mismatch(what: &str, offset: u64, expected: &[u8], got: &[u8]) -> ! {
    let at = expected.iter().zip(got).position(|(a, b)| a != b).unwrap_or(0);
    let show = |b: &[u8]| b.iter().skip(at).take(16).map(|x| format!("{x:02x}")).collect::<String>();
    eprintln!(
        "blkbench: DATA MISMATCH ({what}) at device byte {}: expected {} got {}",
        offset + at as u64,
        show(expected),
        show(got)
    );
    std::process::exit(3);
}

/// The raw export the reads are checked against (`--verify`).
struct Reference {
    file: File,
    lo: u64,
    hi: u64,
    /// For every 4 KiB block of `[lo, hi)`: its 16 bytes at `sample_at(block)`.
    samples: Vec<[u8; 16]>,
}

/// Where in a 4 KiB block its sampled 16 bytes are (spread by a multiplicative hash).
fn sample_at(block: u64) -> usize {
    ((block.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as usize) * 16
}

impl Reference {
    fn open(path: &PathBuf, capacity: u64, lo: u64, hi: u64) -> Reference {
        let file = File::open(path).unwrap_or_else(|e| panic!("--verify {}: {e}", path.display()));
        let len = file.metadata().unwrap().len();
        assert_eq!(len, capacity, "--verify {}: {len} bytes, the device has {capacity}", path.display());
        let mut samples = Vec::with_capacity(((hi - lo) / 4096) as usize);
        let mut buf = vec![0u8; 1 << 20];
        let mut pos = lo;
        while pos < hi {
            let n = ((hi - pos) as usize).min(buf.len());
            file.read_exact_at(&mut buf[..n], pos).unwrap();
            for (i, block) in buf[..n].chunks_exact(4096).enumerate() {
                let at = sample_at((pos - lo) / 4096 + i as u64);
                samples.push(block[at..at + 16].try_into().unwrap());
            }
            pos += n as u64;
        }
        Reference { file, lo, hi, samples }
    }

    /// Check `got`, read at `offset`, with `check`; `op` varies which blocks of a large read are
    /// sampled.
    fn check(&self, check: Check, offset: u64, got: &[u8], op: u64, scratch: &mut Vec<u8>) {
        assert!(offset >= self.lo && offset + got.len() as u64 <= self.hi && offset % 4096 == 0);
        match check {
            Check::None => {}
            Check::Full => {
                scratch.resize(got.len(), 0);
                self.file.read_exact_at(scratch, offset).unwrap();
                if scratch[..] != *got {
                    mismatch("full", offset, scratch, got);
                }
            }
            Check::Sample => {
                let first = (offset - self.lo) / 4096;
                let blocks = got.len() / 4096;
                let (start, step) = if blocks > 16 { ((op % 16) as usize, 16) } else { (0, 1) };
                for i in (start..blocks).step_by(step) {
                    let block = first + i as u64;
                    let at = sample_at(block);
                    let want = &self.samples[block as usize];
                    let have = &got[i * 4096 + at..i * 4096 + at + 16];
                    if have != want {
                        mismatch("sample", offset + (i * 4096 + at) as u64, want, have);
                    }
                }
            }
        }
    }
}

/// utime + stime of every thread of `pid`, in seconds (`/proc/PID/stat`, fields 14 and 15).
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The command name (field 2) is in parentheses and may hold spaces: count after the last ')'.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    ticks as f64 / hz as f64
}

const REGION: usize = 64 << 20;
const MAX_QD: usize = 64;

struct Client {
    _blkio: Blkio,
    queues: Vec<Blkioq>,
    region: MemoryRegion,
    capacity: u64,
}

impl Client {
    fn connect(socket: &str, queues: usize, queue_size: Option<i32>, poll: bool) -> Client {
        let mut blkio = Blkio::new("virtio-blk-vhost-user").unwrap();
        blkio.set_str("path", socket).unwrap();
        blkio.connect().unwrap();
        let capacity = blkio.get_u64("capacity").unwrap();
        if poll {
            blkio.set_i32("num-queues", 0).unwrap();
            blkio.set_i32("num-poll-queues", queues as i32).unwrap();
        } else {
            blkio.set_i32("num-queues", queues as i32).unwrap();
        }
        if let Some(n) = queue_size {
            blkio.set_i32("queue-size", n).unwrap();
        }
        let started = blkio.start().unwrap();
        let queues = if poll { started.poll_queues } else { started.queues };
        let region = blkio.alloc_mem_region(REGION).unwrap();
        blkio.map_mem_region(&region).unwrap();
        Client { _blkio: blkio, queues, region, capacity }
    }
}

/// One queue and its slice of the client's memory region.
struct Lane<'a> {
    q: &'a mut Blkioq,
    base: usize,
    len: usize,
    completions: Vec<MaybeUninit<Completion>>,
}

impl Lane<'_> {
    fn ptr(&self, offset: usize) -> *mut u8 {
        assert!(offset < self.len);
        (self.base + offset) as *mut u8
    }

    /// The bytes of `slot` (`len` bytes at `slot * len`).
    fn bytes(&self, slot: usize, len: usize) -> &[u8] {
        assert!((slot + 1) * len <= self.len);
        // SAFETY: the slice lies inside the client's live memory region (checked above), and no
        // request that writes this slot is in flight while the caller holds the slice.
        unsafe { std::slice::from_raw_parts(self.ptr(slot * len), len) }
    }

    /// Wait for at least one completion; returns (user_data, ret) pairs.
    fn wait(&mut self, out: &mut Vec<(usize, i32)>) {
        out.clear();
        let mut timeout = Duration::from_secs(30);
        let n = self.completions.len();
        let got = self.q.do_io(&mut self.completions[..n], 1, Some(&mut timeout), None).unwrap();
        assert!(got > 0, "no completion within 30 s");
        for c in &self.completions[..got] {
            // SAFETY: do_io initialized the first `got` entries.
            let c = unsafe { c.assume_init_ref() };
            out.push((c.user_data, c.ret));
        }
    }
}

#[derive(Default)]
struct Figures {
    ops: u64,
    bytes: u64,
    secs: f64,
    lat_ns: Vec<u64>,
}

impl Figures {
    fn merge(&mut self, other: Figures) {
        self.ops += other.ops;
        self.bytes += other.bytes;
        self.secs = self.secs.max(other.secs);
        self.lat_ns.extend(other.lat_ns);
    }

    fn print(&mut self, name: &str, cpu: Option<f64>) {
        self.lat_ns.sort_unstable();
        let pct = |p: f64| {
            if self.lat_ns.is_empty() {
                return 0.0;
            }
            let i = ((self.lat_ns.len() as f64 * p).ceil() as usize).clamp(1, self.lat_ns.len()) - 1;
            self.lat_ns[i] as f64 / 1000.0
        };
        let mut line = format!(
            "result name={name} ops={} secs={:.3} iops={:.0} mbps={:.1} p50_us={:.1} p99_us={:.1}",
            self.ops,
            self.secs,
            self.ops as f64 / self.secs,
            self.bytes as f64 / self.secs / 1e6,
            pct(0.50),
            pct(0.99)
        );
        // More of the latency distribution (the report's latency CDF plot).
        for (key, p) in [
            ("p1", 0.01),
            ("p10", 0.10),
            ("p25", 0.25),
            ("p75", 0.75),
            ("p90", 0.90),
            ("p95", 0.95),
            ("p999", 0.999),
        ] {
            line += &format!(" {key}_us={:.1}", pct(p));
        }
        if let Some(cpu) = cpu {
            line += &format!(
                " cpu_us_per_op={:.2} cpu_util={:.2}",
                cpu * 1e6 / self.ops.max(1) as f64,
                cpu / self.secs
            );
        }
        println!("{line}");
    }
}

/// What a read test checks its reads against, and how deep.
struct Verify<'a> {
    reference: Option<&'a Reference>,
    check: Check,
}

/// How long a read test runs and how it issues.
#[derive(Clone, Copy)]
struct Limits {
    secs: f64,
    max_ops: u64,
    /// QD1 only: the k-th request is due `k × pace` after the start.
    pace: Option<Duration>,
}

/// Keep `qd` reads of `len` bytes in flight on one queue for `secs` (or until `max_ops` were
/// issued), at offsets chosen by `next`; check every completed read. With `pace`, a request is
/// issued when due, or at once if late, its latency counted from when it was due.
fn reads(
    lane: &mut Lane,
    qd: usize,
    len: usize,
    Limits { secs, max_ops, pace }: Limits,
    verify: &Verify,
    mut next: impl FnMut() -> u64,
) -> Figures {
    assert!(qd <= MAX_QD && qd * len <= lane.len, "QD {qd} × {len} bytes do not fit the queue's buffers");
    assert!(pace.is_none() || qd == 1, "a paced test runs at QD1");
    let mut f = Figures::default();
    let mut scratch = Vec::new();
    let mut started = vec![Instant::now(); qd];
    let mut offsets = vec![0u64; qd];
    let start = Instant::now();
    // When request `k` is issued: due at its time in the schedule (paced), else now.
    let issue_time = |k: u64| -> Instant {
        let Some(p) = pace else { return Instant::now() };
        let due = start + p.mul_f64(k as f64);
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
            // From the actual issue: the sleep's overshoot is the client's, not the device's.
            Instant::now()
        } else {
            due
        }
    };
    for slot in 0..qd {
        let ptr = lane.ptr(slot * len);
        offsets[slot] = next();
        started[slot] = issue_time(slot as u64);
        lane.q.read(offsets[slot], ptr, len, slot, ReqFlags::empty());
    }
    let t0 = if pace.is_some() { start } else { Instant::now() };
    let deadline = t0 + Duration::from_secs_f64(secs);
    let mut done = Vec::new();
    let mut in_flight = qd;
    let mut issued = qd as u64;
    while in_flight > 0 {
        lane.wait(&mut done);
        let now = Instant::now();
        for &(slot, ret) in &done {
            assert_eq!(ret, 0, "read failed: {ret}");
            if let Some(r) = verify.reference {
                r.check(verify.check, offsets[slot], lane.bytes(slot, len), f.ops, &mut scratch);
            }
            f.ops += 1;
            f.bytes += len as u64;
            f.lat_ns.push(now.duration_since(started[slot]).as_nanos() as u64);
            let due_by_deadline = pace.is_none_or(|p| start + p.mul_f64(issued as f64) < deadline);
            if now < deadline && issued < max_ops && due_by_deadline {
                let ptr = lane.ptr(slot * len);
                offsets[slot] = next();
                started[slot] = issue_time(issued);
                issued += 1;
                lane.q.read(offsets[slot], ptr, len, slot, ReqFlags::empty());
            } else {
                in_flight -= 1;
            }
        }
    }
    f.secs = t0.elapsed().as_secs_f64();
    f
}

/// Run `reads` on every queue of `c` at once (one thread each); `next(queue)` makes each
/// queue's offset generator.
fn all_queues<N: FnMut() -> u64 + Send>(
    c: &mut Client,
    qd: usize,
    len: usize,
    limits: Limits,
    verify: &Verify,
    mut next: impl FnMut(usize) -> N,
) -> Figures {
    let share = REGION / c.queues.len();
    let base = c.region.addr;
    let gens: Vec<N> = (0..c.queues.len()).map(&mut next).collect();
    let mut total = Figures::default();
    std::thread::scope(|s| {
        let handles: Vec<_> = c
            .queues
            .iter_mut()
            .zip(gens)
            .enumerate()
            .map(|(i, (q, gen))| {
                s.spawn(move || {
                    let mut lane = Lane {
                        q,
                        base: base + i * share,
                        len: share,
                        completions: (0..MAX_QD).map(|_| MaybeUninit::uninit()).collect(),
                    };
                    reads(&mut lane, qd, len, limits, verify, gen)
                })
            })
            .collect();
        for h in handles {
            total.merge(h.join().unwrap());
        }
    });
    total
}

/// A single-thread copy of 1 MiB pieces through a `span`-byte source into 8 slots, for `secs`.
fn memcpy(span: u64, secs: f64) -> Figures {
    const PIECE: usize = 1 << 20;
    let span = (span as usize / PIECE).max(1) * PIECE;
    let src: Vec<u8> = (0..span).map(|i| (i >> 12) as u8 | 1).collect();
    let mut dst = vec![0u8; 8 * PIECE];
    let mut f = Figures::default();
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs_f64(secs);
    let (mut pos, mut slot) = (0usize, 0usize);
    while Instant::now() < deadline {
        let t = Instant::now();
        dst[slot * PIECE..(slot + 1) * PIECE].copy_from_slice(&src[pos..pos + PIECE]);
        std::hint::black_box(&dst);
        f.lat_ns.push(t.elapsed().as_nanos() as u64);
        f.ops += 1;
        f.bytes += PIECE as u64;
        pos = (pos + PIECE) % span;
        slot = (slot + 1) % 8;
    }
    f.secs = t0.elapsed().as_secs_f64();
    f
}

/// `wakeup`: round trips between a client blocking on an eventfd (on `client_cpu`) and a peer
/// polling for its requests (on `peer_cpu`, yielding between looks), for `secs`.
fn wakeup(client_cpu: Option<usize>, peer_cpu: Option<usize>, secs: f64) -> Figures {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use vmm_sys_util::eventfd::EventFd;
    // Blocking: the client's read waits for the peer's write.
    let efd = EventFd::new(0).expect("eventfd");
    let request = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let mut f = Figures::default();
    std::thread::scope(|s| {
        s.spawn(|| {
            if let Some(cpu) = peer_cpu {
                pin(cpu);
            }
            let mut served = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if request.load(Ordering::Acquire) > served {
                    served += 1;
                    efd.write(1).expect("eventfd write");
                } else {
                    std::thread::yield_now();
                }
            }
        });
        if let Some(cpu) = client_cpu {
            pin(cpu);
        }
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_secs_f64(secs);
        let mut sent = 0u64;
        while Instant::now() < deadline {
            let t = Instant::now();
            sent += 1;
            request.store(sent, Ordering::Release);
            efd.read().expect("eventfd read");
            f.lat_ns.push(t.elapsed().as_nanos() as u64);
            f.ops += 1;
        }
        f.secs = t0.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
    });
    f
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("blkbench: {e}");
            std::process::exit(2);
        }
    };
    if let Some(cpu) = args.cpu {
        pin(cpu);
    }
    if args.socket.is_empty() {
        // Only tests without a device (parse_args checked).
        let span = args.hi.unwrap_or(256 << 20) - args.lo.unwrap_or(0);
        for test in &args.tests {
            match test.as_str() {
                "wakeup" => wakeup(args.cpu, args.peer_cpu, args.secs).print("wakeup", None),
                _ => memcpy(span, args.secs).print("memcpy1m", None),
            }
        }
        return;
    }
    let mut c = Client::connect(&args.socket, args.queues, args.queue_size, args.poll_queues);
    let lo = args.lo.unwrap_or(0) / 4096 * 4096;
    let hi = args.hi.unwrap_or(c.capacity).min(c.capacity) / 4096 * 4096;
    assert!(hi > lo + (2 << 20), "the range [{lo}, {hi}) is too small");
    let reference = args.verify.as_ref().map(|p| Reference::open(p, c.capacity, lo, hi));
    let nq = c.queues.len();
    let qsuffix = if nq > 1 { format!("_q{nq}") } else { String::new() };
    for test in &args.tests {
        let (test, full) = match test.strip_suffix("/full") {
            Some(t) => (t, true),
            None => (test.as_str(), false),
        };
        let (name, qd) = match test.split_once(':') {
            Some((n, q)) => (n, q.parse::<usize>().expect("QD")),
            None => (test, 1),
        };
        let verify = Verify {
            reference: reference.as_ref(),
            check: if full || name == "warm" { Check::Full } else { args.check },
        };
        let fsuffix = if full { "_full" } else { "" };
        let cpu0 = args.daemon_pid.map(cpu_secs);
        let cpu = || args.daemon_pid.zip(cpu0).map(|(pid, c0)| cpu_secs(pid) - c0);
        match name {
            // Read the range once, sequentially (fills the memory tier or the page cache), on
            // the first queue, every byte checked with --verify.
            "warm" => {
                let sweep = (hi - lo).div_ceil(1 << 20);
                let limits = Limits { secs: 600.0, max_ops: sweep / nq as u64 + 1, pace: None };
                let mut f = all_queues(&mut c, 4, 1 << 20, limits, &verify, |q| {
                    let mut pos = lo + q as u64 * (1 << 20);
                    move || {
                        let at = pos.min(hi - (1 << 20));
                        pos += nq as u64 * (1 << 20);
                        at
                    }
                });
                let used = cpu();
                f.print("warm", used);
            }
            "randread" => {
                let blocks = (hi - lo) / 4096;
                let pace = args.rate.map(|r| Duration::from_secs_f64(1.0 / r));
                let limits = Limits { secs: args.secs, max_ops: u64::MAX, pace };
                let mut f = all_queues(&mut c, qd, 4096, limits, &verify, |q| {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(1 + q as u64);
                    move || lo + rng.gen_range(0..blocks) * 4096
                });
                let used = cpu();
                let rate = args.rate.map_or(String::new(), |r| format!("_rate{r:.0}"));
                f.print(&format!("randread4k_qd{qd}{qsuffix}{fsuffix}{rate}"), used);
            }
            "seqread" => {
                // Each queue starts at its own place in the span and walks it sequentially.
                let span = (hi - lo) / (1 << 20);
                let limits = Limits { secs: args.secs, max_ops: u64::MAX, pace: None };
                let mut f = all_queues(&mut c, qd, 1 << 20, limits, &verify, |q| {
                    let mut mib = q as u64 * span / nq as u64;
                    move || {
                        let at = lo + mib * (1 << 20);
                        mib = (mib + 1) % span;
                        at
                    }
                });
                let used = cpu();
                f.print(&format!("seqread1m_qd{qd}{qsuffix}{fsuffix}"), used);
            }
            "writeflush" => {
                let blocks = (hi - lo) / 4096;
                let mut rng = rand::rngs::StdRng::seed_from_u64(7);
                let mut f = Figures::default();
                let mut lane = Lane {
                    q: &mut c.queues[0],
                    base: c.region.addr,
                    len: REGION,
                    completions: (0..MAX_QD).map(|_| MaybeUninit::uninit()).collect(),
                };
                // SAFETY: the region is a live mapping of REGION bytes owned by the client, and
                // no request is in flight.
                unsafe { std::ptr::write_bytes(lane.ptr(0), 0x5a, 4096) };
                let t0 = Instant::now();
                let deadline = t0 + Duration::from_secs_f64(args.secs);
                let mut done = Vec::new();
                while Instant::now() < deadline {
                    let t = Instant::now();
                    let ptr = lane.ptr(0);
                    lane.q.write(lo + rng.gen_range(0..blocks) * 4096, ptr, 4096, 0, ReqFlags::empty());
                    lane.wait(&mut done);
                    assert!(done.iter().all(|d| d.1 == 0), "write failed");
                    lane.q.flush(1, ReqFlags::empty());
                    lane.wait(&mut done);
                    assert!(done.iter().all(|d| d.1 == 0), "flush failed");
                    f.ops += 1;
                    f.bytes += 4096;
                    f.lat_ns.push(t.elapsed().as_nanos() as u64);
                }
                f.secs = t0.elapsed().as_secs_f64();
                let used = cpu();
                f.print("write4k_flush", used);
            }
            "memcpy" => memcpy(hi - lo, args.secs).print("memcpy1m", None),
            "wakeup" => wakeup(args.cpu, args.peer_cpu, args.secs).print("wakeup", None),
            other => panic!("unknown test {other}"),
        }
    }
}
