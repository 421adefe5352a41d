//! `cargo xtask bench serve`: `tessera serve` vs `qemu-storage-daemon` (vhost-user-blk export of
//! the raw image), side by side in one run, with the same libblkio client
//! (`crates/vhost/examples/blkbench.rs`) and the same CPU layout; and a 4 KiB write + FLUSH p99
//! against fio's fdatasync p99 on the same disk.

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
    /// Files in the generated tree (`generate_bench_tree`).
    #[arg(long, default_value_t = 8000)]
    files: u64,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 2.0)]
    secs: f64,
    /// Rounds, each running both daemons one after the other (medians are reported: other
    /// load on the machine hits both alike).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// CPU layouts: `same` (client and daemon on CPU 1), `split` (client on CPU 0, daemon on
    /// CPU 1), or `both`.
    #[arg(long, default_value = "both")]
    layout: String,
    /// `--mem-cache` for tessera serve (`none`: do not pass the option).
    #[arg(long, default_value = "1G")]
    mem_cache: String,
    /// Another `tessera` binary (e.g. built from an older commit) run the same way in every
    /// round, right after this one: its figures and the ratios to it are reported (the cost of a
    /// change, such as the metrics, measured under the same load).
    #[arg(long, value_name = "BIN")]
    baseline: Option<PathBuf>,
}

type Results = BTreeMap<String, BTreeMap<String, f64>>;

struct Layout {
    name: &'static str,
    client: usize,
    daemon: usize,
}

pub fn run(opts: &ServeBench) -> Result<()> {
    fixtures::require_root()?;
    for tool in ["qemu-storage-daemon", "fio", "taskset"] {
        if Command::new("which").arg(tool).stdout(Stdio::null()).status().map_or(true, |s| !s.success()) {
            bail!("{tool} is missing (apt-get install qemu-utils fio util-linux)");
        }
    }
    let target = target_dir()?;
    status(cargo().args(["build", "--release", "-p", "tessera-cli"]))?;
    status(cargo().args(["build", "--release", "-p", "tessera-vhost", "--example", "blkbench"]))?;
    let bin = target.join("release").join("tessera");
    let client = target.join("release").join("examples").join("blkbench");
    let dir = target.join("bench-serve");
    std::fs::create_dir_all(&dir)?;

    // The image: a generated tree, built and exported raw (fresh every run).
    let tree = dir.join("tree");
    let recipe = format!("bench-tree v1 files={}\n", opts.files);
    let marker = dir.join("tree.recipe");
    if std::fs::read_to_string(&marker).ok().as_deref() != Some(recipe.as_str()) {
        println!("==> generating the tree ({} files) at {}", opts.files, tree.display());
        fixtures::generate_bench_tree(&tree, opts.files)?;
        std::fs::write(&marker, &recipe)?;
    }
    let store = dir.join("store");
    let _ = std::fs::remove_dir_all(&store);
    let out = Command::new(&bin).arg("build").arg(&tree).arg("--store").arg(&store).output()?;
    if !out.status.success() {
        bail!("tessera build failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let id = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let v = tessera_e2e::tessera::inspect_json_with(&bin, &id, &store)?;
    let g = &v["geometry"];
    let bs = g["block_size"].as_u64().context("block_size")?;
    let lo = g["data_start_block"].as_u64().context("data_start_block")? * bs;
    let hi = g["data_end_block"].as_u64().context("data_end_block")? * bs;
    let size = g["size_bytes"].as_u64().context("size_bytes")?;
    println!(
        "image {id}: {:.0} MiB device, file data in bytes [{lo}, {hi}) ({:.0} MiB), {} files",
        size as f64 / 1048576.0,
        (hi - lo) as f64 / 1048576.0,
        v["files"]
    );

    let layouts: Vec<Layout> = match opts.layout.as_str() {
        "same" => vec![Layout { name: "same", client: 1, daemon: 1 }],
        "split" => vec![Layout { name: "split", client: 0, daemon: 1 }],
        "both" => vec![
            Layout { name: "same", client: 1, daemon: 1 },
            Layout { name: "split", client: 0, daemon: 1 },
        ],
        other => bail!("--layout {other}: expected same, split or both"),
    };
    let tests = ["warm", "randread:1", "randread:32", "seqread:1", "writeflush"];
    let range = [("--lo", lo), ("--hi", hi)];
    let mut all: Vec<(String, Results)> = Vec::new();
    for l in &layouts {
        let mut rounds: Vec<Results> = Vec::new();
        for round in 1..=opts.rounds.max(1) {
            println!("==> layout {}, round {round}", l.name);
            let mut results = Results::new();
            // tessera serve (and the baseline binary), durable overlay (a temporary overlay is
            // never synced). This one serves its metrics endpoint, as in production.
            let sock = dir.join("tessera.sock");
            let serve = |bin: &Path, metrics: bool| {
                let overlay = dir.join("bench.overlay");
                let _ = std::fs::remove_file(&overlay);
                let mut cmd = Command::new("nice");
                cmd.args(["-n", "-20", "taskset", "-c", &l.daemon.to_string()])
                    .arg(bin)
                    .args(["serve", &id, "--store"])
                    .arg(&store)
                    .arg("--socket")
                    .arg(&sock)
                    .arg("--overlay")
                    .arg(&overlay);
                if opts.mem_cache != "none" {
                    cmd.args(["--mem-cache", &opts.mem_cache]);
                }
                if metrics {
                    cmd.args(["--metrics", "127.0.0.1:0"]);
                }
                cmd
            };
            let daemon = Daemon::spawn(serve(&bin, true), &sock, &dir.join("tessera.log"))?;
            results.insert("tessera".into(), drive(&client, &sock, l.client, opts.secs, &range, &tests)?);
            daemon.stop()?;
            if let Some(base) = &opts.baseline {
                let daemon = Daemon::spawn(serve(base, false), &sock, &dir.join("baseline.log"))?;
                results
                    .insert("baseline".into(), drive(&client, &sock, l.client, opts.secs, &range, &tests)?);
                daemon.stop()?;
            }

            // qemu-storage-daemon on the raw export (page cache warmed by the same first pass).
            let raw = dir.join("image.raw");
            let _ = std::fs::remove_file(&raw);
            status(Command::new(&bin).args(["export", &id, "--store"]).arg(&store).arg("-o").arg(&raw))?;
            let qsock = dir.join("qsd.sock");
            let mut cmd = Command::new("nice");
            cmd.args([
                "-n",
                "-20",
                "taskset",
                "-c",
                &l.daemon.to_string(),
                "qemu-storage-daemon",
                "--blockdev",
            ])
            .arg(format!("driver=file,node-name=f,filename={}", raw.display()))
            .args(["--blockdev", "driver=raw,node-name=r,file=f", "--export"])
            .arg(format!(
                "type=vhost-user-blk,id=e,node-name=r,addr.type=unix,addr.path={},writable=on",
                qsock.display()
            ));
            let daemon = Daemon::spawn(cmd, &qsock, &dir.join("qsd.log"))?;
            results.insert("qsd".into(), drive(&client, &qsock, l.client, opts.secs, &range, &tests)?);
            daemon.stop()?;
            rounds.push(results);
        }
        all.push((
            format!(
                "{} (client CPU {}, daemon CPU {}; both at nice -20; median of {} rounds)",
                l.name,
                l.client,
                l.daemon,
                rounds.len()
            ),
            medians(&rounds),
        ));
    }

    let fio = fio_fdatasync(&dir.join("fio"))?;
    println!(
        "\nfio --rw=write --ioengine=sync --fdatasync=1 --bs=2300 --size=22m (same disk): \
         fdatasync p50 {:.0} µs, p99 {:.0} µs",
        fio.0, fio.1
    );
    for (layout, r) in &all {
        report(layout, r, fio.1)?;
    }
    Ok(())
}

/// The median of each figure over the rounds.
fn medians(rounds: &[Results]) -> Results {
    let mut out = Results::new();
    for (daemon, figures) in rounds.first().into_iter().flatten() {
        for key in figures.keys() {
            let mut v: Vec<f64> =
                rounds.iter().filter_map(|r| r.get(daemon).and_then(|f| f.get(key)).copied()).collect();
            out.entry(daemon.clone()).or_default().insert(key.clone(), super::median(&mut v));
        }
    }
    out
}

/// A daemon started under `taskset`, ready once its socket exists.
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

/// Run the client's tests against `sock`; returns `name → {key → value}` of its result lines.
fn drive(
    client: &Path,
    sock: &Path,
    cpu: usize,
    secs: f64,
    range: &[(&str, u64)],
    tests: &[&str],
) -> Result<BTreeMap<String, f64>> {
    let mut cmd = Command::new("nice");
    cmd.args(["-n", "-20"]).arg(client).arg("--socket").arg(sock).args([
        "--cpu",
        &cpu.to_string(),
        "--secs",
        &secs.to_string(),
    ]);
    for (k, v) in range {
        cmd.args([*k, &v.to_string()]);
    }
    cmd.args(tests);
    eprintln!("+ {cmd:?}");
    let out = cmd.stderr(Stdio::inherit()).output()?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", out.status);
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

fn report(layout: &str, r: &Results, fio_p99: f64) -> Result<()> {
    let (t, q) = (&r["tessera"], &r["qsd"]);
    let get = |m: &BTreeMap<String, f64>, k: &str| m.get(k).copied().with_context(|| format!("no {k}"));
    println!("\nlayout {layout}:");
    println!("| | tessera serve | qemu-storage-daemon | ratio | target |");
    println!("|---|---|---|---|---|");
    for (what, key, target) in [
        ("4 KiB random read QD1, IOPS", "randread4k_qd1.iops", "≥ 2.5×"),
        ("4 KiB random read QD32, IOPS", "randread4k_qd32.iops", "≥ 3×"),
        ("1 MiB sequential read QD1, MB/s", "seqread1m_qd1.mbps", "≥ 1.2×"),
    ] {
        let (a, b) = (get(t, key)?, get(q, key)?);
        println!("| {what} | {a:.0} | {b:.0} | **{:.2}×** | {target} |", a / b);
    }
    for (what, key) in [
        ("4 KiB random read QD1, p50 / p99 µs", "randread4k_qd1"),
        ("4 KiB random read QD32, p50 / p99 µs", "randread4k_qd32"),
        ("1 MiB sequential read QD1, p50 / p99 µs", "seqread1m_qd1"),
        ("4 KiB write + FLUSH, p50 / p99 µs", "write4k_flush"),
    ] {
        let p = |m| -> Result<String> {
            Ok(format!("{:.1} / {:.1}", get(m, &format!("{key}.p50_us"))?, get(m, &format!("{key}.p99_us"))?))
        };
        println!("| {what} | {} | {} | | |", p(t)?, p(q)?);
    }
    let w = get(t, "write4k_flush.p99_us")?;
    println!(
        "| 4 KiB write + FLUSH p99 vs fio fdatasync p99 ({fio_p99:.0} µs) | {w:.0} µs | | **{:.2}×** | ≤ 2× |",
        w / fio_p99
    );
    if let Some(b) = r.get("baseline") {
        println!("\nlayout {layout}, this build vs --baseline:");
        println!("| | this build | baseline | ratio |");
        println!("|---|---|---|---|");
        for (what, key) in [
            ("4 KiB random read QD1, IOPS", "randread4k_qd1.iops"),
            ("4 KiB random read QD32, IOPS", "randread4k_qd32.iops"),
            ("1 MiB sequential read QD1, MB/s", "seqread1m_qd1.mbps"),
            ("4 KiB random read QD1, p50 µs", "randread4k_qd1.p50_us"),
            ("4 KiB random read QD1, p99 µs", "randread4k_qd1.p99_us"),
            ("4 KiB write + FLUSH, p99 µs", "write4k_flush.p99_us"),
        ] {
            let (a, z) = (get(t, key)?, get(b, key)?);
            println!("| {what} | {a:.1} | {z:.1} | **{:.3}×** |", a / z);
        }
    }
    Ok(())
}
