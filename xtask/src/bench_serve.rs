//! `cargo xtask bench serve`: `tessera serve` vs `qemu-storage-daemon` (vhost-user-blk export of
//! the raw image) in its tuned configuration (an iothread, `aio=io_uring`) and its defaults, side
//! by side in one run, with the same libblkio client (`crates/vhost/examples/blkbench.rs`, which
//! checks the bytes it reads against the raw export) and the same CPU layout; a same-size
//! single-thread memcpy as the bound of a warm 1 MiB read; an empty QD1 round trip (`blkbench
//! wakeup`: a blocking client, a polling peer on the daemon's CPU) as the floor of a QD1 read;
//! 1, 2 and 4 queues at QD32 per queue; and a 4 KiB write + FLUSH p99 against fio's fdatasync
//! p99 on the same disk.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use tessera_e2e::fixtures;

use super::{cargo, status, target_dir};

/// Options of `cargo xtask bench serve`.
#[derive(Debug, Args)]
pub struct ServeBench {
    /// Files in the generated tree (`generate_bench_tree`; default: enough for a file-data
    /// region of 4× the last-level cache, at least 8000).
    #[arg(long)]
    pub(crate) files: Option<u64>,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 2.0)]
    pub(crate) secs: f64,
    /// Rounds, each running every daemon one after the other, the first one rotating (medians
    /// and the min–max spread are reported: other load on the machine hits all alike).
    #[arg(long, default_value_t = 3)]
    pub(crate) rounds: usize,
    /// CPU layouts: `same` (client and daemon on CPU 1), `split` (client on CPU 0, daemon on
    /// CPU 1), or `both`.
    #[arg(long, default_value = "both")]
    pub(crate) layout: String,
    /// `--mem-cache` for tessera serve (`none`: do not pass the option; `auto`: the file-data
    /// region and a quarter more, so every timed read is a memory-tier hit after the warm pass).
    #[arg(long, default_value = "auto")]
    pub(crate) mem_cache: String,
    /// Another `tessera` binary (e.g. built from an older commit) run the same way in every
    /// round, right after this one: its figures and the ratios to it are reported (the cost of a
    /// change, such as the metrics, measured under the same load).
    #[arg(long, value_name = "BIN")]
    pub(crate) baseline: Option<PathBuf>,
    /// tessera serve configurations, comma-separated, each `default` or `+`-joined `FLAG=VALUE`
    /// tokens passed as `--FLAG VALUE` (e.g. `poll-us=0`); the first is the one the ratios are
    /// taken of ("tessera" in the tables), the others are named by their tokens. E.g.
    /// `--tessera default,poll-us=0,poll-us=200`.
    #[arg(long, value_delimiter = ',', default_value = "default")]
    pub(crate) tessera: Vec<String>,
    /// qemu-storage-daemon configurations, comma-separated; the first is the peer the ratios
    /// are taken against. Each is `+`-joined tokens: `defaults` (none), `iothread`, `io_uring`
    /// (`aio=io_uring`), `aio=MODE`, `direct` (`cache.direct=on`), `poll=NS` (the iothread's
    /// `poll-max-ns`), `grow=N`, `shrink=N` (`poll-grow`, `poll-shrink`), `noraw` (export the
    /// file node, no raw format node); `tuned` = `iothread+io_uring`.
    /// E.g. `--qsd tuned,defaults,tuned+poll=0,tuned+poll=200000,tuned+direct,tuned+noraw`.
    #[arg(long, value_delimiter = ',', default_value = "tuned,defaults")]
    pub(crate) qsd: Vec<String>,
    /// The client's virtqueue size (libblkio `queue-size`; default: libblkio's, 256), the same
    /// for every daemon.
    #[arg(long, value_name = "N")]
    pub(crate) queue_size: Option<u32>,
    /// The client polls for completions (libblkio poll queues: no completion eventfd, no
    /// wake-up), the same for every daemon: shows how much of a QD1 round trip is the client's
    /// own wake-up.
    #[arg(long)]
    pub(crate) client_poll: bool,
    /// How the client checks the bytes of the timed reads against the raw export: `sample`
    /// (16 bytes of every 4 KiB block), `full` (every byte; slows the client), `none`. The warm
    /// pass and one QD32 random-read pass per daemon are always checked in full.
    #[arg(long, default_value = "sample", value_parser = ["none", "sample", "full"])]
    pub(crate) check: String,
    /// Queue counts for the multi-queue test (4 KiB random reads, QD32 per queue); both daemons
    /// offer the largest. `1` alone skips it.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub(crate) queues: Vec<u16>,
    /// Run even when the data region is smaller than 4× the last-level cache (smoke runs on a
    /// small tree: the sequential figures are then partly cache-resident).
    #[arg(long)]
    pub(crate) allow_small_span: bool,
    /// Skip the write + FLUSH test and fio (e.g. when fio is not installed).
    #[arg(long)]
    pub(crate) no_writes: bool,
    /// Use this `tessera` binary instead of building the release CLI (the client is built).
    #[arg(long, value_name = "BIN")]
    pub(crate) bin: Option<PathBuf>,
    /// Extra queue depths for the one-queue 4 KiB random read (besides 1 and 32), e.g.
    /// `--qd 4,16,64` for an IOPS-vs-queue-depth curve.
    #[arg(long, value_delimiter = ',')]
    pub(crate) qd: Vec<u32>,
}

/// `daemon → {key → value}` of one round.
pub(crate) type Results = BTreeMap<String, BTreeMap<String, f64>>;

/// Median, min and max of one figure over the rounds.
#[derive(Clone, Copy)]
struct Stat {
    median: f64,
    min: f64,
    max: f64,
}

type Stats = BTreeMap<String, BTreeMap<String, Stat>>;

struct Layout {
    name: &'static str,
    client: usize,
    daemon: usize,
}

/// One qemu-storage-daemon configuration (`--qsd`).
#[derive(Debug, Default)]
struct QsdVariant {
    name: String,
    iothread: bool,
    aio: Option<String>,
    direct: bool,
    poll_max_ns: Option<u64>,
    poll_grow: Option<u64>,
    poll_shrink: Option<u64>,
    no_raw: bool,
}

impl QsdVariant {
    fn parse(spec: &str) -> Result<Self> {
        let mut v = QsdVariant { name: spec.to_owned(), ..Default::default() };
        for tok in spec.split('+') {
            let num = |t: &str| -> Result<u64> { t.parse().with_context(|| format!("--qsd {spec}: {tok}")) };
            match tok.split_once('=') {
                None if tok == "defaults" => {}
                None if tok == "tuned" => {
                    v.iothread = true;
                    v.aio = Some("io_uring".into());
                }
                None if tok == "iothread" => v.iothread = true,
                None if tok == "io_uring" => v.aio = Some("io_uring".into()),
                None if tok == "direct" => v.direct = true,
                None if tok == "noraw" => v.no_raw = true,
                Some(("aio", m)) => v.aio = Some(m.to_owned()),
                Some(("poll", n)) => v.poll_max_ns = Some(num(n)?),
                Some(("grow", n)) => v.poll_grow = Some(num(n)?),
                Some(("shrink", n)) => v.poll_shrink = Some(num(n)?),
                _ => bail!("--qsd {spec}: unknown token {tok}"),
            }
        }
        if !v.iothread && (v.poll_max_ns.is_some() || v.poll_grow.is_some() || v.poll_shrink.is_some()) {
            bail!("--qsd {spec}: poll=, grow= and shrink= are iothread options (add +iothread)");
        }
        Ok(v)
    }

    /// qemu-storage-daemon's arguments for this configuration.
    fn args(&self, raw: &Path, sock: &Path, queues: u16) -> Vec<String> {
        let mut a = Vec::new();
        if self.iothread {
            let mut o = "iothread,id=io0".to_owned();
            for (k, v) in [
                ("poll-max-ns", self.poll_max_ns),
                ("poll-grow", self.poll_grow),
                ("poll-shrink", self.poll_shrink),
            ] {
                if let Some(v) = v {
                    o += &format!(",{k}={v}");
                }
            }
            a.extend(["--object".to_owned(), o]);
        }
        let mut file = format!("driver=file,node-name=f,filename={}", raw.display());
        if let Some(aio) = &self.aio {
            file += &format!(",aio={aio}");
        }
        if self.direct {
            file += ",cache.direct=on";
        }
        a.extend(["--blockdev".to_owned(), file]);
        if !self.no_raw {
            a.extend(["--blockdev".to_owned(), "driver=raw,node-name=r,file=f".to_owned()]);
        }
        let mut export = format!(
            "type=vhost-user-blk,id=e,node-name={},addr.type=unix,addr.path={},writable=on,num-queues={queues}",
            if self.no_raw { "f" } else { "r" },
            sock.display()
        );
        if self.iothread {
            export += ",iothread=io0";
        }
        a.extend(["--export".to_owned(), export]);
        a
    }
}

/// The size of the last-level cache of CPU 0 (the highest `level` under
/// `/sys/devices/system/cpu/cpu0/cache`).
/// Files of `generate_bench_tree` for a file-data region of at least `span` bytes (its files
/// average ~18 KiB of device blocks at 22 000 files and ~22 KiB at 8000: 16 KiB leaves room),
/// at least 8000. `measure` checks the region it gets.
fn files_for_span(span: u64) -> u64 {
    span.div_ceil(16 << 10).max(8000)
}

fn last_level_cache() -> Result<u64> {
    let mut best: Option<(u32, u64)> = None;
    for e in std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache")? {
        let p = e?.path();
        let (Ok(level), Ok(size)) =
            (std::fs::read_to_string(p.join("level")), std::fs::read_to_string(p.join("size")))
        else {
            continue;
        };
        let level: u32 = level.trim().parse()?;
        let size = size.trim();
        let bytes = match size.strip_suffix('K') {
            Some(k) => k.parse::<u64>()? << 10,
            None => match size.strip_suffix('M') {
                Some(m) => m.parse::<u64>()? << 20,
                None => size.parse::<u64>()?,
            },
        };
        if best.is_none_or(|(l, _)| level > l) {
            best = Some((level, bytes));
        }
    }
    best.map(|b| b.1).context("no cache sizes under /sys/devices/system/cpu/cpu0/cache")
}

/// What every client invocation shares.
struct Client<'a> {
    bin: &'a Path,
    cpu: usize,
    secs: f64,
    lo: u64,
    hi: u64,
    queue_size: Option<u32>,
    poll: bool,
    check: &'a str,
    reference: &'a Path,
}

impl Client<'_> {
    /// Run `tests` against `sock` with `queues` queues; returns `{name.key → value}` of the
    /// client's result lines.
    fn drive(&self, sock: &Path, pid: u32, queues: u16, tests: &[&str]) -> Result<BTreeMap<String, f64>> {
        let mut cmd = Command::new("nice");
        cmd.args(["-n", "-20"]).arg(self.bin).arg("--socket").arg(sock);
        cmd.args(["--cpu", &self.cpu.to_string(), "--secs", &self.secs.to_string()]);
        cmd.args(["--lo", &self.lo.to_string(), "--hi", &self.hi.to_string()]);
        cmd.args(["--queues", &queues.to_string(), "--daemon-pid", &pid.to_string()]);
        if let Some(n) = self.queue_size {
            cmd.args(["--queue-size", &n.to_string()]);
        }
        if self.poll {
            cmd.arg("--poll-queues");
        }
        cmd.arg("--verify").arg(self.reference).args(["--check", self.check]);
        cmd.args(tests);
        run_client(cmd)
    }
}

pub(crate) fn run_client(mut cmd: Command) -> Result<BTreeMap<String, f64>> {
    eprintln!("+ {cmd:?}");
    let out = cmd.stderr(Stdio::inherit()).output()?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {} (exit status 3: the bytes read differ from the raw export)", out.status);
    }
    let mut r = BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        println!("  {line}");
        let Some(rest) = line.strip_prefix("result ") else { continue };
        let mut name = String::new();
        for kv in rest.split_whitespace() {
            let Some((k, v)) = kv.split_once('=') else { continue };
            if k == "name" {
                name = v.to_owned();
            } else if let Ok(x) = v.parse::<f64>() {
                r.insert(format!("{name}.{k}"), x);
            }
        }
    }
    Ok(r)
}

/// Run the client's tests against a started daemon: the read tests with one queue, the
/// multi-queue reads, then the writes (last: they change the device the reads are checked
/// against).
fn measure_daemon(
    c: &Client,
    daemon: Daemon,
    queues: &[u16],
    qds: &[u32],
    writes: bool,
) -> Result<BTreeMap<String, f64>> {
    let pid = daemon.child.id();
    let sock = daemon.socket.clone();
    let mut tests: Vec<String> =
        ["warm", "randread:32/full", "randread:1", "randread:32", "seqread:1", "seqread:8"]
            .map(str::to_owned)
            .into();
    tests.extend(qds.iter().filter(|&&q| q != 1 && q != 32).map(|q| format!("randread:{q}")));
    let tests: Vec<&str> = tests.iter().map(String::as_str).collect();
    let mut r = c.drive(&sock, pid, 1, &tests)?;
    for &q in queues.iter().filter(|&&q| q > 1) {
        r.extend(c.drive(&sock, pid, q, &["randread:32"])?);
    }
    if writes {
        r.extend(c.drive(&sock, pid, 1, &["writeflush"])?);
    }
    daemon.stop()?;
    Ok(r)
}

/// One CPU layout's rounds.
pub(crate) struct LayoutRun {
    pub(crate) name: &'static str,
    pub(crate) client: usize,
    pub(crate) daemon: usize,
    pub(crate) rounds: Vec<Results>,
}

/// The entry of a round's [`Results`] holding fio's fdatasync latencies ([`FIO_P50`],
/// [`FIO_P99`], µs).
pub(crate) const FIO: &str = "fio";
pub(crate) const FIO_P50: &str = "fdatasync.p50_us";
pub(crate) const FIO_P99: &str = "fdatasync.p99_us";
/// The entry of a round's [`Results`] holding `blkbench wakeup`: the round trip of a QD1 request
/// with no request in it, client and peer on the layout's CPUs (`wakeup.iops`, `wakeup.p50_us`).
pub(crate) const WAKEUP: &str = "wakeup";

/// The median fio fdatasync (p50, p99 µs) over `rounds`; `None` when no round ran fio.
fn fio_median<'a>(rounds: impl Iterator<Item = &'a Results>) -> Option<(f64, f64)> {
    let (mut p50, mut p99): (Vec<f64>, Vec<f64>) =
        rounds.filter_map(|r| r.get(FIO)).filter_map(|f| Some((*f.get(FIO_P50)?, *f.get(FIO_P99)?))).unzip();
    (!p50.is_empty()).then(|| (super::median(&mut p50), super::median(&mut p99)))
}

/// What `measure` found: every round's figures per layout and daemon (fio's fdatasync under
/// [`FIO`] in every round), the median fio fdatasync over all rounds (p50, p99 µs), the inputs'
/// sizes and the daemons' command lines.
pub(crate) struct ServeResult {
    /// The daemons in the order of a round ("tessera", …, "qsd tuned", …).
    pub(crate) names: Vec<String>,
    pub(crate) layouts: Vec<LayoutRun>,
    pub(crate) fio: Option<(f64, f64)>,
    pub(crate) fio_command: String,
    pub(crate) files: u64,
    pub(crate) device_bytes: u64,
    pub(crate) span_bytes: u64,
    pub(crate) llc_bytes: u64,
    pub(crate) commands: Vec<(String, String)>,
}

pub fn run(opts: &ServeBench) -> Result<()> {
    let r = measure(opts)?;
    if let Some(fio) = r.fio {
        println!(
            "\n{} (every round; median): fdatasync p50 {:.0} µs, p99 {:.0} µs",
            r.fio_command, fio.0, fio.1
        );
    }
    for l in &r.layouts {
        let layout = format!(
            "{} (client CPU {}, daemon CPU {}; everything at nice -20; median (min–max) of {} rounds)",
            l.name,
            l.client,
            l.daemon,
            l.rounds.len()
        );
        let fio = fio_median(l.rounds.iter()).map(|f| f.1);
        report(&layout, l.name, &stats(&l.rounds), &r.names, &opts.queues, fio);
    }
    Ok(())
}

/// Run the serve benchmark: every round's figures (see [`ServeResult`]).
pub(crate) fn measure(opts: &ServeBench) -> Result<ServeResult> {
    fixtures::require_root()?;
    let mut tools = vec![("qemu-storage-daemon", "qemu-utils"), ("taskset", "util-linux")];
    if !opts.no_writes {
        tools.push(("fio", "fio"));
    }
    super::ensure_tools(&tools)?;
    let variants = opts.qsd.iter().map(|s| QsdVariant::parse(s)).collect::<Result<Vec<_>>>()?;
    if variants.is_empty() {
        bail!("--qsd: at least one configuration");
    }
    let max_queues = opts.queues.iter().copied().max().unwrap_or(1).max(1);
    if opts.rounds < 3 {
        eprintln!("warning: --rounds {} (the figures to report need at least 3)", opts.rounds);
    }
    let target = target_dir()?;
    let (bin, client_bin) = build_release(opts.bin.as_deref())?;
    let dir = target.join("bench-serve");
    std::fs::create_dir_all(&dir)?;

    // The image: a generated tree, built and exported raw (fresh every run).
    let llc = last_level_cache()?;
    let (tree, files) = bench_tree(opts.files)?;
    let store = dir.join("store");
    let _ = std::fs::remove_dir_all(&store);
    let BuiltImage { id, lo, hi, size, files: file_count } = build_image(&bin, &tree, &store)?;
    let mib = |b: u64| b as f64 / 1048576.0;
    println!(
        "image {id}: {:.0} MiB device, file data in bytes [{lo}, {hi}) ({:.0} MiB), {} files",
        mib(size),
        mib(hi - lo),
        file_count
    );
    println!(
        "random reads: 4 KiB blocks uniformly in [{lo}, {hi}) ({:.1} MiB, the file-data region); \
         sequential reads: 1 MiB pieces through the same {:.1} MiB = {:.1}× the {:.0} MiB last-level cache",
        mib(hi - lo),
        mib(hi - lo),
        (hi - lo) as f64 / llc as f64,
        mib(llc)
    );
    if hi - lo < 4 * llc {
        if !opts.allow_small_span {
            bail!(
                "the data region ({:.0} MiB) is smaller than 4× the last-level cache ({:.0} MiB): raise --files",
                mib(hi - lo),
                mib(llc)
            );
        }
        println!("WARNING: sequential span < 4× the last-level cache (--allow-small-span): a smoke run");
    }
    // The reference the client checks every read against, and the raw image qsd serves (a copy
    // per daemon start: the write test changes it). Synced, so no writeback runs during a test.
    let reference = dir.join("reference.raw");
    let _ = std::fs::remove_file(&reference);
    status(Command::new(&bin).args(["export", &id, "--store"]).arg(&store).arg("-o").arg(&reference))?;
    let raw = dir.join("image.raw");

    let layouts: Vec<Layout> = match opts.layout.as_str() {
        "same" => vec![Layout { name: "same", client: 1, daemon: 1 }],
        "split" => vec![Layout { name: "split", client: 0, daemon: 1 }],
        "both" => vec![
            Layout { name: "same", client: 1, daemon: 1 },
            Layout { name: "split", client: 0, daemon: 1 },
        ],
        other => bail!("--layout {other}: expected same, split or both"),
    };
    let sock = dir.join("tessera.sock");
    let qsock = dir.join("qsd.sock");
    let tessera_flags = |spec: &str| -> Result<Vec<String>> {
        let mut out = Vec::new();
        for tok in spec.split('+').filter(|t| *t != "default") {
            let Some((k, v)) = tok.split_once('=') else {
                bail!("--tessera {spec}: {tok} is not FLAG=VALUE")
            };
            out.extend([format!("--{k}"), v.to_owned()]);
        }
        Ok(out)
    };
    let tessera_variants: Vec<(String, Vec<String>)> = opts
        .tessera
        .iter()
        .enumerate()
        .map(|(i, spec)| {
            Ok((if i == 0 { "tessera".to_owned() } else { format!("tessera {spec}") }, tessera_flags(spec)?))
        })
        .collect::<Result<_>>()?;
    if tessera_variants.is_empty() {
        bail!("--tessera: at least one configuration");
    }
    let tessera_cmd = |bin: &Path, cpu: usize, metrics: bool, flags: &[String]| {
        let overlay = dir.join("bench.overlay");
        let _ = std::fs::remove_file(&overlay);
        let mut cmd = Command::new("nice");
        cmd.args(["-n", "-20", "taskset", "-c", &cpu.to_string()]);
        serve_args(&mut cmd, bin, &id, &store, &sock, &overlay).args(["--queues", &max_queues.to_string()]);
        match opts.mem_cache.as_str() {
            "none" => {}
            "auto" => {
                cmd.args(["--mem-cache", &mem_cache_for(lo, hi)]);
            }
            size => {
                cmd.args(["--mem-cache", size]);
            }
        }
        if metrics {
            cmd.args(["--metrics", "127.0.0.1:0"]);
        }
        cmd.args(flags);
        cmd
    };
    let qsd_cmd = |v: &QsdVariant, cpu: usize| {
        let mut cmd = Command::new("nice");
        cmd.args(["-n", "-20", "taskset", "-c", &cpu.to_string(), "qemu-storage-daemon"]);
        cmd.args(v.args(&raw, &qsock, max_queues));
        cmd
    };
    println!("\ndaemon command lines (CPU of the first layout):");
    let mut commands = Vec::new();
    for (name, flags) in &tessera_variants {
        commands
            .push((name.clone(), crate::command_line(&tessera_cmd(&bin, layouts[0].daemon, true, flags))));
    }
    for v in &variants {
        commands.push((format!("qsd {}", v.name), crate::command_line(&qsd_cmd(v, layouts[0].daemon))));
    }
    for (name, cmd) in &commands {
        println!("  {name}: {cmd}");
    }

    // Daemons in the order of a round: every tessera configuration, the baseline, then every qsd
    // configuration.
    let mut names: Vec<String> = tessera_variants.iter().map(|(n, _)| n.clone()).collect();
    if opts.baseline.is_some() {
        names.push("baseline".to_owned());
    }
    names.extend(variants.iter().map(|v| format!("qsd {}", v.name)));
    let mut all: Vec<LayoutRun> = Vec::new();
    for l in layouts {
        let client = Client {
            bin: &client_bin,
            cpu: l.client,
            secs: opts.secs,
            lo,
            hi,
            queue_size: opts.queue_size,
            poll: opts.client_poll,
            check: &opts.check,
            reference: &reference,
        };
        let mut rounds: Vec<Results> = Vec::new();
        for round in 0..opts.rounds.max(1) {
            println!("==> layout {}, round {}", l.name, round + 1);
            let mut results = Results::new();
            // The bound of a warm 1 MiB read, on the daemon's CPU, while no daemon runs.
            let mut cmd = Command::new("nice");
            cmd.args(["-n", "-20"]).arg(&client_bin).args(["--cpu", &l.daemon.to_string()]);
            cmd.args(["--secs", &opts.secs.to_string(), "--lo", &lo.to_string(), "--hi", &hi.to_string()]);
            cmd.arg("memcpy");
            results.insert("memcpy".into(), run_client(cmd)?);
            // The floor of a QD1 read in this layout: a request's round trip with nothing in it
            // (a client blocking for its completion, a peer polling on the daemon's CPU).
            let mut cmd = Command::new("nice");
            cmd.args(["-n", "-20"]).arg(&client_bin).args(["--cpu", &l.client.to_string()]);
            cmd.args(["--peer-cpu", &l.daemon.to_string(), "--secs", &opts.secs.to_string(), "wakeup"]);
            results.insert(WAKEUP.into(), run_client(cmd)?);
            // Every daemon once, starting with a different one each round.
            for k in 0..names.len() {
                let i = (k + round) % names.len();
                let name = &names[i];
                let daemon = if let Some((_, flags)) = tessera_variants.get(i) {
                    Daemon::spawn(tessera_cmd(&bin, l.daemon, true, flags), &sock, &dir.join("tessera.log"))?
                } else if name == "baseline" {
                    let base = opts.baseline.as_deref().context("baseline")?;
                    let flags = &tessera_variants[0].1;
                    Daemon::spawn(
                        tessera_cmd(base, l.daemon, false, flags),
                        &sock,
                        &dir.join("baseline.log"),
                    )?
                } else {
                    let v = &variants[i - (names.len() - variants.len())];
                    let _ = std::fs::remove_file(&raw);
                    // Holes stay holes: only the image's data is written, not its free space.
                    status(Command::new("cp").arg("--sparse=always").arg(&reference).arg(&raw))?;
                    std::fs::File::open(&raw)?.sync_all()?;
                    Daemon::spawn(qsd_cmd(v, l.daemon), &qsock, &dir.join("qsd.log"))?
                };
                results.insert(
                    name.clone(),
                    measure_daemon(&client, daemon, &opts.queues, &opts.qd, !opts.no_writes)?,
                );
            }
            // fio's fdatasync on the same disk in every round, beside the daemons' write +
            // FLUSH: the shared virtual disk's sync latency drifts between minutes, and a ratio
            // is only fair against the disk of the same round.
            if !opts.no_writes {
                let (p50, p99) = fio_fdatasync(&dir.join("fio"))?;
                results.insert(FIO.into(), [(FIO_P50.into(), p50), (FIO_P99.into(), p99)].into());
            }
            rounds.push(results);
        }
        all.push(LayoutRun { name: l.name, client: l.client, daemon: l.daemon, rounds });
    }

    let fio = fio_median(all.iter().flat_map(|l| &l.rounds));
    Ok(ServeResult {
        names,
        layouts: all,
        fio,
        fio_command: "fio --rw=write --ioengine=sync --fdatasync=1 --bs=2300 --size=22m (same disk)".into(),
        files,
        device_bytes: size,
        span_bytes: hi - lo,
        llc_bytes: llc,
        commands,
    })
}

/// Median, min and max of each figure over the rounds.
fn stats(rounds: &[Results]) -> Stats {
    let mut out = Stats::new();
    for (daemon, figures) in rounds.first().into_iter().flatten() {
        for key in figures.keys() {
            let mut v: Vec<f64> =
                rounds.iter().filter_map(|r| r.get(daemon).and_then(|f| f.get(key)).copied()).collect();
            let (min, max) =
                v.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
            let median = super::median(&mut v);
            out.entry(daemon.clone()).or_default().insert(key.clone(), Stat { median, min, max });
        }
    }
    out
}

/// A benchmarked daemon (also used by `bench lazy`): spawned, waited for (its socket), stopped.
pub(crate) struct Daemon {
    child: Child,
    socket: PathBuf,
}

impl Daemon {
    pub(crate) fn spawn(mut cmd: Command, socket: &Path, log: &Path) -> Result<Self> {
        let _ = std::fs::remove_file(socket);
        let log = std::fs::File::create(log)?;
        eprintln!("+ {cmd:?}");
        let child = cmd.stdout(Stdio::null()).stderr(log).spawn().with_context(|| format!("{cmd:?}"))?;
        let mut d = Daemon { child, socket: socket.to_owned() };
        let t = Instant::now();
        while !socket.exists() {
            if let Some(s) = d.child.try_wait()? {
                bail!("{cmd:?} exited: {s}");
            }
            if t.elapsed() > Duration::from_secs(30) {
                bail!("{cmd:?}: no socket after 30 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(d)
    }

    /// The daemon's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(crate) fn stop(mut self) -> Result<()> {
        status(Command::new("kill").args(["-TERM", &self.child.id().to_string()]))?;
        let s = self.child.wait()?;
        let _ = std::fs::remove_file(&self.socket);
        if !s.success() && s.code().is_some() {
            bail!("daemon exited with {s}");
        }
        Ok(())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// fio's fdatasync latency (p50, p99 in µs) on the disk holding `dir`.
fn fio_fdatasync(dir: &Path) -> Result<(f64, f64)> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let out = Command::new("fio")
        .args(["--name=fdatasync", "--rw=write", "--ioengine=sync", "--fdatasync=1", "--bs=2300"])
        .args(["--size=22m", "--output-format=json"])
        .arg(format!("--directory={}", dir.display()))
        .output()
        .context("fio")?;
    if !out.status.success() {
        bail!("fio failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("fio json")?;
    let p = &v["jobs"][0]["sync"]["lat_ns"]["percentile"];
    let get = |k: &str| p[k].as_f64().map(|ns| ns / 1000.0).with_context(|| format!("fio: no sync p{k}"));
    let r = (get("50.000000")?, get("99.000000")?);
    let _ = std::fs::remove_dir_all(dir);
    Ok(r)
}

/// `1234567` → `1 234 567` (the tables' style).
fn group(x: f64, decimals: usize) -> String {
    let s = format!("{x:.decimals$}");
    let (int, frac) = s.split_once('.').map_or((s.as_str(), None), |(i, f)| (i, Some(f)));
    let (sign, digits) = int.strip_prefix('-').map_or(("", int), |d| ("-", d));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(' ');
        }
        out.push(c);
    }
    match frac {
        Some(f) => format!("{sign}{out}.{f}"),
        None => format!("{sign}{out}"),
    }
}

fn report(layout: &str, kind: &str, r: &Stats, names: &[String], queues: &[u16], fio_p99: Option<f64>) {
    let get = |daemon: &str, key: &str| r.get(daemon).and_then(|m| m.get(key)).copied();
    let cell = |s: Option<Stat>, d: usize| {
        s.map_or("–".to_owned(), |s| {
            format!("{} ({}–{})", group(s.median, d), group(s.min, d), group(s.max, d))
        })
    };
    let peer = names.iter().find(|n| n.starts_with("qsd ")).cloned().unwrap_or_default();
    println!("\nlayout {layout}:");
    println!("| | {} | tessera / {peer} | target |", names.join(" | "));
    println!("|---|{}---|---|", "---|".repeat(names.len()));
    let (qd1, qd32) = if kind == "split" { ("≥ 2×", "≥ 2.5×") } else { ("≥ 2×", "≥ 4×") };
    let mut rows: Vec<(String, String, &str, usize)> = vec![
        ("4 KiB random read QD1, IOPS".into(), "randread4k_qd1.iops".into(), qd1, 0),
        ("  daemon CPU µs per request".into(), "randread4k_qd1.cpu_us_per_op".into(), "", 2),
        ("4 KiB random read QD32, IOPS".into(), "randread4k_qd32.iops".into(), qd32, 0),
        ("  daemon CPU µs per request".into(), "randread4k_qd32.cpu_us_per_op".into(), "", 2),
        ("1 MiB sequential read QD1, MB/s".into(), "seqread1m_qd1.mbps".into(), "", 0),
        ("1 MiB sequential read QD8, MB/s".into(), "seqread1m_qd8.mbps".into(), "", 0),
        ("  daemon CPU µs per request".into(), "seqread1m_qd8.cpu_us_per_op".into(), "", 1),
    ];
    for &q in queues.iter().filter(|&&q| q > 1) {
        rows.push((
            format!("4 KiB random read, {q} queues × QD32, IOPS"),
            format!("randread4k_qd32_q{q}.iops"),
            "",
            0,
        ));
        rows.push((
            "  daemon CPU µs per request".into(),
            format!("randread4k_qd32_q{q}.cpu_us_per_op"),
            "",
            2,
        ));
    }
    for (what, key) in [
        ("4 KiB random read QD1, p50 µs", "randread4k_qd1.p50_us"),
        ("4 KiB random read QD1, p99 µs", "randread4k_qd1.p99_us"),
        ("4 KiB random read QD32, p50 µs", "randread4k_qd32.p50_us"),
        ("4 KiB random read QD32, p99 µs", "randread4k_qd32.p99_us"),
        ("1 MiB sequential read QD8, p50 µs", "seqread1m_qd8.p50_us"),
        ("4 KiB write + FLUSH, p50 µs", "write4k_flush.p50_us"),
        ("4 KiB write + FLUSH, p99 µs", "write4k_flush.p99_us"),
    ] {
        rows.push((what.into(), key.into(), "", 1));
    }
    for (what, key, target, d) in &rows {
        let cells: Vec<String> = names.iter().map(|n| cell(get(n, key), *d)).collect();
        if cells.iter().all(|c| c == "–") {
            continue;
        }
        let ratio = match (get("tessera", key), get(&peer, key)) {
            (Some(a), Some(b)) if b.median > 0.0 && !key.contains("cpu_") && !key.contains("_us") => {
                format!("**{:.2}×**", a.median / b.median)
            }
            _ => String::new(),
        };
        println!("| {what} | {} | {ratio} | {target} |", cells.join(" | "));
    }
    // The floor of a QD1 read, and each daemon's time per QD1 request above it.
    if let Some(w) = get(WAKEUP, "wakeup.iops") {
        let floor_us = 1e6 / w.median;
        let above: Vec<String> = names
            .iter()
            .map(|n| {
                get(n, "randread4k_qd1.iops")
                    .map_or("–".into(), |r| format!("{:.2} µs", 1e6 / r.median - floor_us))
            })
            .collect();
        println!(
            "| 4 KiB QD1: µs per request above the floor of an empty round trip ({floor_us:.2} µs) | {} | | |",
            above.join(" | ")
        );
    }
    // The bound of a warm 1 MiB read: the same-size single-thread memcpy of this layout's rounds.
    if let Some(m) = get("memcpy", "memcpy1m.mbps") {
        let ratios: Vec<String> = names
            .iter()
            .map(|n| {
                get(n, "seqread1m_qd8.mbps")
                    .map_or("–".into(), |s| format!("**{:.2}×**", s.median / m.median))
            })
            .collect();
        println!(
            "| 1 MiB QD8 / single-thread 1 MiB memcpy ({} MB/s, {}–{}) | {} | | ≥ 0.9× |",
            group(m.median, 0),
            group(m.min, 0),
            group(m.max, 0),
            ratios.join(" | ")
        );
    }
    if let (Some(fio), Some(w)) = (fio_p99, get("tessera", "write4k_flush.p99_us")) {
        println!(
            "| 4 KiB write + FLUSH p99 vs fio fdatasync p99 ({fio:.0} µs) | {} µs |{} **{:.2}×** | ≤ 2× |",
            group(w.median, 0),
            " |".repeat(names.len() - 1),
            w.median / fio
        );
    }
    if names.iter().any(|n| n == "baseline") {
        println!("\nlayout {layout}, this build vs --baseline:");
        println!("| | this build | baseline | ratio |");
        println!("|---|---|---|---|");
        for (what, key) in [
            ("4 KiB random read QD1, IOPS", "randread4k_qd1.iops"),
            ("4 KiB random read QD32, IOPS", "randread4k_qd32.iops"),
            ("1 MiB sequential read QD8, MB/s", "seqread1m_qd8.mbps"),
            ("4 KiB random read QD1, p50 µs", "randread4k_qd1.p50_us"),
            ("4 KiB random read QD1, p99 µs", "randread4k_qd1.p99_us"),
            ("4 KiB write + FLUSH, p99 µs", "write4k_flush.p99_us"),
        ] {
            if let (Some(a), Some(z)) = (get("tessera", key), get("baseline", key)) {
                println!(
                    "| {what} | {} | {} | **{:.3}×** |",
                    cell(Some(a), 1),
                    cell(Some(z), 1),
                    a.median / z.median
                );
            }
        }
    }
}

/// The serve bench's generated tree (`target/bench-serve/tree`, made again only when `files`
/// changes): `files` files, by default enough for a file-data region of 4× the last-level cache.
/// The tree and its file count.
pub(crate) fn bench_tree(files: Option<u64>) -> Result<(PathBuf, u64)> {
    let dir = target_dir()?.join("bench-serve");
    std::fs::create_dir_all(&dir)?;
    let files = match files {
        Some(f) => f,
        None => files_for_span(4 * last_level_cache()?),
    };
    let tree = dir.join("tree");
    let recipe = format!("bench-tree v1 files={files}\n");
    let marker = dir.join("tree.recipe");
    if std::fs::read_to_string(&marker).ok().as_deref() != Some(recipe.as_str()) {
        println!("==> generating the tree ({files} files) at {}", tree.display());
        fixtures::generate_bench_tree(&tree, files)?;
        std::fs::write(&marker, &recipe)?;
    }
    Ok((tree, files))
}

/// The release `blkbench`, and `bin` or else the release `tessera` built with it: the daemon's
/// binary and the client's.
pub(crate) fn build_release(bin: Option<&Path>) -> Result<(PathBuf, PathBuf)> {
    let release = target_dir()?.join("release");
    let bin = if let Some(b) = bin {
        status(cargo().args(["build", "--release", "-p", "tessera-vhost", "--example", "blkbench"]))?;
        b.to_path_buf()
    } else {
        // One invocation: built apart, the two resolve features differently and rebuild each other.
        status(cargo().args(["build", "--release", "-p", "tessera-cli", "-p", "tessera-vhost"]).args([
            "--bin",
            "tessera",
            "--example",
            "blkbench",
        ]))?;
        release.join("tessera")
    };
    Ok((bin, release.join("examples").join("blkbench")))
}

/// `BIN serve ID --store STORE --socket SOCK --overlay OVERLAY`, appended to `cmd`.
pub(crate) fn serve_args<'c>(
    cmd: &'c mut Command,
    bin: &Path,
    id: &str,
    store: &Path,
    sock: &Path,
    overlay: &Path,
) -> &'c mut Command {
    cmd.arg(bin)
        .args(["serve", id, "--store"])
        .arg(store)
        .arg("--socket")
        .arg(sock)
        .arg("--overlay")
        .arg(overlay)
}

/// `--mem-cache` large enough for every read of `[lo, hi)` to hit the memory tier after a warm
/// pass: the span and a quarter more.
pub(crate) fn mem_cache_for(lo: u64, hi: u64) -> String {
    format!("{}M", (hi - lo).div_ceil(1 << 20) * 5 / 4)
}

/// An image built from a tree: its ID, the bytes `[lo, hi)` of its file-data region, its size.
pub(crate) struct BuiltImage {
    pub(crate) id: String,
    pub(crate) lo: u64,
    pub(crate) hi: u64,
    pub(crate) size: u64,
    pub(crate) files: serde_json::Value,
}

/// `tessera build TREE --store STORE`, and where the image's file data lies.
pub(crate) fn build_image(bin: &Path, tree: &Path, store: &Path) -> Result<BuiltImage> {
    let out = Command::new(bin).arg("build").arg(tree).arg("--store").arg(store).output()?;
    if !out.status.success() {
        bail!("tessera build failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let id = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let v = tessera_e2e::tessera::inspect_json_with(bin, &id, store)?;
    let g = &v["geometry"];
    let bs = g["block_size"].as_u64().context("block_size")?;
    let lo = g["data_start_block"].as_u64().context("data_start_block")? * bs;
    let hi = g["data_end_block"].as_u64().context("data_end_block")? * bs;
    let size = g["size_bytes"].as_u64().context("size_bytes")?;
    Ok(BuiltImage { id, lo, hi, size, files: v["files"].clone() })
}
