//! `cargo xtask bench devices`: how many devices one host serves before the p99 latency doubles
//! (issue 16, point 5). N `tessera serve` daemons of one image (one per device, as a VMM runs
//! them; local store, each with its own memory tier, warmed), and N libblkio clients
//! (`blkbench`), one per device, each issuing 4 KiB random reads at QD1 at a steady rate
//! (`--rate`, open loop: a late request's latency counts from when it was due), all at once.
//! For each N: every client's p50 and p99, the reads done against those offered, and the CPU
//! the daemons used; the answer is the first N whose median client p99 is at least twice the
//! one-device p99 — the point where the host's CPUs run out.
//!
//! The clients run on the same CPUs as the daemons (a VM's vCPUs would not), so the curve is a
//! lower bound on the devices a host with separate guest CPUs serves. Every read is checked
//! (sampled) against the raw export.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use serde_json::json;
use tessera_e2e::cold::median;
use tessera_e2e::daemon::Daemon;
use tessera_e2e::fixtures;

use super::bench_serve::{build_image, BuiltImage};
use super::{cargo, status, target_dir};

/// Options of `cargo xtask bench devices`.
#[derive(Debug, Args)]
pub struct DevicesBench {
    /// Device counts to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 4, 8, 16, 32])]
    pub(crate) devices: Vec<usize>,
    /// Reads per second each device's client issues.
    #[arg(long, default_value_t = 1000)]
    pub(crate) rate: u32,
    /// Seconds each step runs.
    #[arg(long, default_value_t = 5.0)]
    pub(crate) secs: f64,
    /// Rounds: each measures every device count once, in turn.
    #[arg(long, default_value_t = 1)]
    pub(crate) rounds: usize,
    /// Files of the generated image (the serve bench's tree; 2000 files ≈ 32 MiB of data).
    #[arg(long, default_value_t = 2000)]
    pub(crate) files: u64,
    /// The `tessera` binary (default: the release build, built now).
    #[arg(long)]
    pub(crate) bin: Option<PathBuf>,
    /// Print the results as JSON on stdout (the table goes to stderr).
    #[arg(long)]
    pub(crate) json: bool,
}

/// One client's figures (a `blkbench` result line).
#[derive(Debug, Clone)]
pub(crate) struct ClientRun {
    pub(crate) ops: u64,
    pub(crate) p50_us: f64,
    pub(crate) p99_us: f64,
}

/// One step: N devices at once.
#[derive(Debug, Clone)]
pub(crate) struct Step {
    pub(crate) devices: usize,
    pub(crate) secs: f64,
    pub(crate) clients: Vec<ClientRun>,
    /// CPU seconds all daemons used during the step.
    pub(crate) daemon_cpu: f64,
}

impl Step {
    pub(crate) fn p50(&self) -> f64 {
        median(self.clients.iter().map(|c| c.p50_us).collect())
    }
    /// The median over the clients of each client's p99.
    pub(crate) fn p99(&self) -> f64 {
        median(self.clients.iter().map(|c| c.p99_us).collect())
    }
    pub(crate) fn worst_p99(&self) -> f64 {
        self.clients.iter().map(|c| c.p99_us).fold(0.0, f64::max)
    }
    pub(crate) fn iops(&self) -> f64 {
        self.clients.iter().map(|c| c.ops).sum::<u64>() as f64 / self.secs
    }
}

/// What a run measured.
pub(crate) struct DevicesResult {
    pub(crate) bin: PathBuf,
    pub(crate) span_bytes: u64,
    /// Per round, one step per device count.
    pub(crate) rounds: Vec<Vec<Step>>,
}

/// The first device count whose p99 (median over rounds) is ≥ 2× the smallest count's.
pub(crate) fn doubling_point(o: &DevicesBench, r: &DevicesResult) -> Option<usize> {
    let p99 = |n: usize| {
        let v: Vec<f64> = r.rounds.iter().flatten().filter(|s| s.devices == n).map(Step::p99).collect();
        median(v)
    };
    let base = p99(*o.devices.iter().min()?);
    o.devices.iter().copied().filter(|&n| p99(n) >= 2.0 * base).min()
}

/// utime + stime of `pid` (all threads), in seconds.
fn cpu_secs(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    let Some(rest) = stat.rfind(')').and_then(|i| stat.get(i + 2..)) else { return 0.0 };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|t| t.parse::<u64>().ok()).unwrap_or(0);
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1);
    (ticks(11) + ticks(12)) as f64 / hz as f64
}

/// `blkbench` with `args`, its `result` line's fields.
fn parse_result(out: &str) -> Result<ClientRun> {
    let line = out.lines().find(|l| l.starts_with("result ")).context("blkbench printed no result")?;
    let field = |k: &str| -> Result<f64> {
        let v = line
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(k).and_then(|r| r.strip_prefix('=')))
            .with_context(|| format!("no {k} in {line:?}"))?;
        Ok(v.parse()?)
    };
    Ok(ClientRun { ops: field("ops")? as u64, p50_us: field("p50_us")?, p99_us: field("p99_us")? })
}

pub(crate) fn measure(o: &DevicesBench) -> Result<DevicesResult> {
    ensure!(!o.devices.is_empty() && o.devices.iter().all(|&n| n > 0), "--devices: counts above 0");
    let target = target_dir()?;
    status(cargo().args(["build", "--release", "-p", "tessera-vhost", "--example", "blkbench"]))?;
    let bin = match &o.bin {
        Some(b) => b.clone(),
        None => {
            status(cargo().args(["build", "--release", "-p", "tessera-cli", "--bin", "tessera"]))?;
            target.join("release").join("tessera")
        }
    };
    let client = target.join("release").join("examples").join("blkbench");
    // The e2e daemon helper runs `$TESSERA_BIN`; nothing else runs yet.
    std::env::set_var("TESSERA_BIN", &bin);
    let dir = target.join("bench-devices");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let tree = dir.join("tree");
    fixtures::generate_bench_tree(&tree, o.files)?;
    let store = dir.join("store");
    let BuiltImage { id, lo, hi, .. } = build_image(&bin, &tree, &store)?;
    let reference = dir.join("reference.raw");
    status(Command::new(&bin).args(["export", &id, "--store"]).arg(&store).arg("-o").arg(&reference))?;
    // Earlier work's dirty pages (a bench part before this one may have written gigabytes) would
    // be written back under the first steps and show as their latency.
    status(&mut Command::new("sync"))?;
    // Each daemon's memory tier holds the whole span, twice over.
    let tier = format!("{}M", ((hi - lo) >> 20) * 2 + 16);
    let range = ["--lo".to_owned(), lo.to_string(), "--hi".to_owned(), hi.to_string()];

    let mut rounds = Vec::new();
    for round in 0..o.rounds {
        let mut steps = Vec::new();
        for &n in &o.devices {
            let daemons = (0..n)
                .map(|k| {
                    let sock = dir.join(format!("dev{k}.sock"));
                    Daemon::start(&id, &store, &sock, &["--mem-cache", tier.as_str()])
                })
                .collect::<Result<Vec<_>>>()?;
            for d in &daemons {
                let out = Command::new(&client)
                    .arg("--socket")
                    .arg(d.socket())
                    .args(&range)
                    .arg("--verify")
                    .arg(&reference)
                    .arg("warm")
                    .output()?;
                ensure!(out.status.success(), "warming: {}", String::from_utf8_lossy(&out.stderr));
            }
            let pids: Vec<u32> = daemons.iter().filter_map(Daemon::pid).collect();
            let cpu0: f64 = pids.iter().map(|&p| cpu_secs(p)).sum();
            let t = Instant::now();
            let children = daemons
                .iter()
                .map(|d| {
                    Command::new(&client)
                        .arg("--socket")
                        .arg(d.socket())
                        .args(&range)
                        .arg("--verify")
                        .arg(&reference)
                        .args(["--secs", &o.secs.to_string(), "--rate", &o.rate.to_string(), "randread:1"])
                        .stdout(Stdio::piped())
                        .stderr(Stdio::piped())
                        .spawn()
                        .context("blkbench")
                })
                .collect::<Result<Vec<Child>>>()?;
            let mut clients = Vec::new();
            for c in children {
                let out = c.wait_with_output()?;
                if !out.status.success() {
                    bail!("blkbench: {}", String::from_utf8_lossy(&out.stderr));
                }
                clients.push(parse_result(&String::from_utf8_lossy(&out.stdout))?);
            }
            let wall = t.elapsed().as_secs_f64();
            let daemon_cpu = pids.iter().map(|&p| cpu_secs(p)).sum::<f64>() - cpu0;
            for d in daemons {
                d.stop()?;
            }
            let step = Step { devices: n, secs: o.secs, clients, daemon_cpu };
            eprintln!(
                "round {} — {n} devices: {:.0} of {} reads/s, p50 {:.0} µs, p99 {:.0} µs (worst client {:.0}), \
                 daemons' CPU {:.2} of {wall:.1} s",
                round + 1,
                step.iops(),
                n as u64 * u64::from(o.rate),
                step.p50(),
                step.p99(),
                step.worst_p99(),
                daemon_cpu
            );
            steps.push(step);
        }
        rounds.push(steps);
    }
    let _ = std::fs::remove_dir_all(&tree);
    Ok(DevicesResult { bin, span_bytes: hi - lo, rounds })
}

pub fn run(o: &DevicesBench) -> Result<()> {
    let r = measure(o)?;
    print_result(o, &r)
}

fn print_result(o: &DevicesBench, r: &DevicesResult) -> Result<()> {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut table = format!(
        "tessera serve (binary {}), one daemon and one QD1 client per device, {} reads/s each over a \
         {:.0} MiB span; {cores} cores, load average at the end: {}\n\
         {:>8} {:>6} {:>10} {:>10} {:>8} {:>8} {:>12} {:>12}\n",
        r.bin.display(),
        o.rate,
        r.span_bytes as f64 / 1048576.0,
        load.trim(),
        "devices",
        "round",
        "offered/s",
        "done/s",
        "p50 µs",
        "p99 µs",
        "worst p99",
        "daemon CPU"
    );
    let mut steps_json = Vec::new();
    for (i, steps) in r.rounds.iter().enumerate() {
        for s in steps {
            table.push_str(&format!(
                "{:>8} {:>6} {:>10} {:>10.0} {:>8.0} {:>8.0} {:>12.0} {:>11.0}%\n",
                s.devices,
                i + 1,
                s.devices as u64 * u64::from(o.rate),
                s.iops(),
                s.p50(),
                s.p99(),
                s.worst_p99(),
                100.0 * s.daemon_cpu / s.secs / cores as f64
            ));
            steps_json.push(json!({
                "round": i + 1, "devices": s.devices, "secs": s.secs, "daemon_cpu_secs": s.daemon_cpu,
                "clients": s.clients.iter().map(|c| json!({"ops": c.ops, "p50_us": c.p50_us, "p99_us": c.p99_us}))
                    .collect::<Vec<_>>(),
            }));
        }
    }
    let point = doubling_point(o, r);
    table.push_str(&match point {
        Some(n) => format!("p99 at least doubles (vs the fewest devices) from {n} devices on\n"),
        None => "p99 does not double within the measured counts\n".to_owned(),
    });
    if o.json {
        eprint!("{table}");
        let v = json!({
            "binary": r.bin.display().to_string(), "rate": o.rate, "span_bytes": r.span_bytes, "cores": cores,
            "load_average": load.trim(), "steps": steps_json, "p99_doubles_at": point,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{table}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_line_is_read_field_by_field() {
        let r = parse_result("noise\nresult name=randread4k_qd1_rate1000 ops=4999 secs=5.000 iops=1000 mbps=4.1 p50_us=35.5 p99_us=80.2 p1_us=20.0\n")
            .unwrap();
        assert_eq!(r.ops, 4999);
        assert_eq!(r.p50_us, 35.5);
        assert_eq!(r.p99_us, 80.2);
        assert!(parse_result("result name=x ops=1").is_err(), "missing fields");
    }

    #[test]
    fn the_doubling_point_is_the_first_count_whose_median_p99_doubles() {
        let o = DevicesBench {
            devices: vec![1, 2, 4, 8],
            rate: 1000,
            secs: 1.0,
            rounds: 1,
            files: 1,
            bin: None,
            json: false,
        };
        let step = |devices: usize, p99: f64| Step {
            devices,
            secs: 1.0,
            clients: vec![ClientRun { ops: 1000, p50_us: 10.0, p99_us: p99 }; devices],
            daemon_cpu: 0.0,
        };
        let r = |p: [f64; 4]| DevicesResult {
            bin: PathBuf::new(),
            span_bytes: 0,
            rounds: vec![vec![step(1, p[0]), step(2, p[1]), step(4, p[2]), step(8, p[3])]],
        };
        assert_eq!(doubling_point(&o, &r([50.0, 60.0, 100.0, 400.0])), Some(4));
        assert_eq!(doubling_point(&o, &r([50.0, 60.0, 99.0, 99.0])), None);
    }
}
