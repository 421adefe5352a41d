//! The benchmark client of `cargo xtask bench serve`: libblkio's pure-Rust vhost-user driver
//! (the `blkio` crate) driving any vhost-user-blk backend (`tessera serve`,
//! `qemu-storage-daemon`) with the same code, pinned to one CPU.
//!
//! ```text
//! blkbench --socket SOCK [--cpu N] [--secs S] [--lo BYTES --hi BYTES] TEST...
//! TEST: warm | randread:QD | seqread:QD | writeflush
//! ```
//!
//! Random and sequential reads stay within `[lo, hi)` (e.g. the image's file-data region).
//! Each test prints one line `result name=… ops=… secs=… iops=… mbps=… p50_us=… p99_us=…`.
#![allow(clippy::unwrap_used)]

use std::mem::MaybeUninit;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use rand::{Rng, SeedableRng};

struct Args {
    socket: String,
    cpu: Option<usize>,
    secs: f64,
    lo: Option<u64>,
    hi: Option<u64>,
    tests: Vec<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args { socket: String::new(), cpu: None, secs: 3.0, lo: None, hi: None, tests: Vec::new() };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--socket" => a.socket = value("--socket")?,
            "--cpu" => a.cpu = Some(value("--cpu")?.parse().map_err(|e| format!("--cpu: {e}"))?),
            "--secs" => a.secs = value("--secs")?.parse().map_err(|e| format!("--secs: {e}"))?,
            "--lo" => a.lo = Some(value("--lo")?.parse().map_err(|e| format!("--lo: {e}"))?),
            "--hi" => a.hi = Some(value("--hi")?.parse().map_err(|e| format!("--hi: {e}"))?),
            t if !t.starts_with('-') => a.tests.push(t.to_owned()),
            other => return Err(format!("unknown option {other}")),
        }
    }
    if a.socket.is_empty() {
        return Err("--socket is required".into());
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

const REGION: usize = 64 << 20;
const MAX_QD: usize = 64;

struct Client {
    _blkio: Blkio,
    q: Blkioq,
    region: MemoryRegion,
    capacity: u64,
    completions: Vec<MaybeUninit<Completion>>,
}

impl Client {
    fn connect(socket: &str) -> Client {
        let mut blkio = Blkio::new("virtio-blk-vhost-user").unwrap();
        blkio.set_str("path", socket).unwrap();
        blkio.connect().unwrap();
        let capacity = blkio.get_u64("capacity").unwrap();
        blkio.set_i32("num-queues", 1).unwrap();
        let mut started = blkio.start().unwrap();
        let region = blkio.alloc_mem_region(REGION).unwrap();
        blkio.map_mem_region(&region).unwrap();
        let q = started.queues.remove(0);
        let completions = (0..MAX_QD).map(|_| MaybeUninit::uninit()).collect();
        Client { _blkio: blkio, q, region, capacity, completions }
    }

    fn ptr(&self, offset: usize) -> *mut u8 {
        assert!(offset < self.region.len);
        (self.region.addr + offset) as *mut u8
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
    fn print(&mut self, name: &str) {
        self.lat_ns.sort_unstable();
        let pct = |p: f64| {
            if self.lat_ns.is_empty() {
                return 0.0;
            }
            let i = ((self.lat_ns.len() as f64 * p).ceil() as usize).clamp(1, self.lat_ns.len()) - 1;
            self.lat_ns[i] as f64 / 1000.0
        };
        println!(
            "result name={name} ops={} secs={:.3} iops={:.0} mbps={:.1} p50_us={:.1} p99_us={:.1}",
            self.ops,
            self.secs,
            self.ops as f64 / self.secs,
            self.bytes as f64 / self.secs / 1e6,
            pct(0.50),
            pct(0.99)
        );
    }
}

/// Keep `qd` reads of `len` bytes in flight for `secs` (or until `max_ops` were issued), at
/// offsets chosen by `next`.
fn reads(
    c: &mut Client,
    qd: usize,
    len: usize,
    secs: f64,
    max_ops: u64,
    mut next: impl FnMut() -> u64,
) -> Figures {
    assert!(qd <= MAX_QD && qd * len <= REGION);
    let mut f = Figures::default();
    let mut started = vec![Instant::now(); qd];
    for (slot, s) in started.iter_mut().enumerate() {
        let ptr = c.ptr(slot * len);
        *s = Instant::now();
        c.q.read(next(), ptr, len, slot, ReqFlags::empty());
    }
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs_f64(secs);
    let mut done = Vec::new();
    let mut in_flight = qd;
    let mut issued = qd as u64;
    while in_flight > 0 {
        c.wait(&mut done);
        let now = Instant::now();
        for &(slot, ret) in &done {
            assert_eq!(ret, 0, "read failed: {ret}");
            f.ops += 1;
            f.bytes += len as u64;
            f.lat_ns.push(now.duration_since(started[slot]).as_nanos() as u64);
            if now < deadline && issued < max_ops {
                issued += 1;
                let ptr = c.ptr(slot * len);
                started[slot] = Instant::now();
                c.q.read(next(), ptr, len, slot, ReqFlags::empty());
            } else {
                in_flight -= 1;
            }
        }
    }
    f.secs = t0.elapsed().as_secs_f64();
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
    let mut c = Client::connect(&args.socket);
    let lo = args.lo.unwrap_or(0) / 4096 * 4096;
    let hi = args.hi.unwrap_or(c.capacity).min(c.capacity) / 4096 * 4096;
    assert!(hi > lo + (1 << 20), "the range [{lo}, {hi}) is too small");
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    for test in &args.tests {
        let (name, qd) = match test.split_once(':') {
            Some((n, q)) => (n, q.parse::<usize>().expect("QD")),
            None => (test.as_str(), 1),
        };
        match name {
            // Read the range once, sequentially (fills the memory tier or the page cache).
            "warm" => {
                let mut pos = lo;
                let sweep = (hi - lo).div_ceil(1 << 20);
                let mut f = reads(&mut c, 4, 1 << 20, 600.0, sweep, || {
                    let at = pos.min(hi - (1 << 20));
                    pos += 1 << 20;
                    at
                });
                f.print("warm");
            }
            "randread" => {
                let blocks = (hi - lo) / 4096;
                let mut f =
                    reads(&mut c, qd, 4096, args.secs, u64::MAX, || lo + rng.gen_range(0..blocks) * 4096);
                f.print(&format!("randread4k_qd{qd}"));
            }
            "seqread" => {
                let mut pos = lo;
                let mut f = reads(&mut c, qd, 1 << 20, args.secs, u64::MAX, || {
                    let at = pos;
                    pos = if pos + (2 << 20) > hi { lo } else { pos + (1 << 20) };
                    at
                });
                f.print(&format!("seqread1m_qd{qd}"));
            }
            "writeflush" => {
                let blocks = (hi - lo) / 4096;
                let mut f = Figures::default();
                // SAFETY: the region is a live mapping of REGION bytes owned by the client, and
                // no request is in flight.
                unsafe { std::ptr::write_bytes(c.ptr(0), 0x5a, 4096) };
                let t0 = Instant::now();
                let deadline = t0 + Duration::from_secs_f64(args.secs);
                let mut done = Vec::new();
                while Instant::now() < deadline {
                    let t = Instant::now();
                    let ptr = c.ptr(0);
                    c.q.write(lo + rng.gen_range(0..blocks) * 4096, ptr, 4096, 0, ReqFlags::empty());
                    c.wait(&mut done);
                    assert!(done.iter().all(|d| d.1 == 0), "write failed");
                    c.q.flush(1, ReqFlags::empty());
                    c.wait(&mut done);
                    assert!(done.iter().all(|d| d.1 == 0), "flush failed");
                    f.ops += 1;
                    f.bytes += 4096;
                    f.lat_ns.push(t.elapsed().as_nanos() as u64);
                }
                f.secs = t0.elapsed().as_secs_f64();
                f.print("write4k_flush");
            }
            other => panic!("unknown test {other}"),
        }
    }
}
