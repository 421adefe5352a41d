//! `cargo xtask bench scale`: how build time and memory grow with the entry count (issue 16
//! point 5). Generated trees of 1 k, 10 k and 100 k entries (`--million`: also 1 M), mostly small
//! files across a realistic directory fan-out plus three large files (`tests/src/scale.rs`), each
//! built once into a fresh store by the release `tessera build`, timed, its peak RSS (VmHWM) taken
//! by GNU time; then `tessera serve` of the 100 k-entry image (local store, read-only): its RSS
//! right after it accepts, and after a libblkio client read every metadata block of the device
//! (what a `find` / `stat` of the whole tree reads).
//!
//! Targets: build VmHWM ≤ 256 MiB up to 100 k entries and ≤ 512 B per entry beyond; the daemon
//! ≤ 64 MiB plus the memory-tier budget (`--mem-cache`). Memory figures do not depend on load;
//! times do. Trees and stores live in a scratch directory under /tmp, removed at the end.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{ensure, Context, Result};
use clap::Args;
use serde_json::json;
use tessera_e2e::daemon::{BlkClient, Daemon};
use tessera_e2e::scale::{generate_scale_tree, ScaleTree};
use tessera_e2e::tessera;

use super::bench_lazy::release_bench;

/// Options of `cargo xtask bench scale`.
#[derive(Debug, Args)]
pub struct ScaleBench {
    /// Also the 1 M-entry tree (about 3 GB on disk; minutes to generate and build).
    #[arg(long)]
    pub(crate) million: bool,
    /// Entry counts to build instead of 1000,10000,100000 (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub(crate) entries: Vec<u64>,
    /// Measure this `tessera` binary instead of building the release one.
    #[arg(long)]
    pub(crate) bin: Option<PathBuf>,
    /// Leave out the three large files (24, 40 and 64 MiB).
    #[arg(long)]
    pub(crate) no_large: bool,
    /// Skip the daemon measurement.
    #[arg(long)]
    pub(crate) no_daemon: bool,
    /// Print the results as JSON on stdout (the table goes to stderr).
    #[arg(long)]
    pub(crate) json: bool,
    /// Only generate the tree of the first `--entries` count at DIR (kept), for profiling by hand.
    #[arg(long, value_name = "DIR")]
    pub(crate) generate_only: Option<PathBuf>,
    /// Measure the daemon on the image of every size (default: only the largest ≤ 100 k).
    #[arg(long)]
    pub(crate) daemon_every_size: bool,
    /// Also, after the entry counts, a tree of `--entries`' first count whose file data is
    /// brought up to this many GiB by incompressible 256 MiB files (the data-size axis).
    #[arg(long, value_name = "GIB")]
    pub(crate) data_gib: Option<u64>,
}

/// One measured build.
pub(crate) struct BuildRun {
    pub(crate) tree: ScaleTree,
    pub(crate) seconds: f64,
    pub(crate) peak: u64,
    /// The data-size point (`--data-gib`): not on the entries axis.
    pub(crate) bulk: bool,
}

/// What `measure` found: a build per size, the daemon's RSS per measured size (entries).
pub(crate) struct ScaleResult {
    pub(crate) bin: PathBuf,
    pub(crate) runs: Vec<BuildRun>,
    pub(crate) daemons: Vec<(u64, DaemonRss)>,
}

/// A scratch directory under /tmp, removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `VmRSS` and `VmHWM` of `pid`, in bytes.
pub(crate) fn rss_of(pid: u32) -> Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> Result<u64> {
        let line = status.lines().find(|l| l.starts_with(name)).with_context(|| format!("no {name}"))?;
        let kib: u64 = line[name.len()..].trim().trim_end_matches("kB").trim().parse()?;
        Ok(kib * 1024)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

fn mib(b: u64) -> f64 {
    b as f64 / f64::from(1 << 20)
}

pub fn run(o: &ScaleBench) -> Result<()> {
    if let Some(dir) = &o.generate_only {
        let n = o.entries.first().copied().unwrap_or(100_000);
        let tree = generate_scale_tree(dir, n, !o.no_large)?;
        println!("{tree:?}");
        return Ok(());
    }
    let ScaleResult { bin, runs, daemons } = measure(o)?;
    print_result(o, &bin, &runs, daemons.last())
}

/// Build a generated tree of every size once (time, VmHWM), and measure the daemon's RSS.
pub(crate) fn measure(o: &ScaleBench) -> Result<ScaleResult> {
    let bin = match &o.bin {
        Some(b) => b.clone(),
        None => release_bench("bench-scale")?.0,
    };
    ensure!(bin.is_file(), "no tessera binary at {}", bin.display());
    // The e2e helpers (GNU time wrapper, Daemon) run `$TESSERA_BIN`; nothing else runs yet.
    std::env::set_var("TESSERA_BIN", &bin);
    let mut sizes = if o.entries.is_empty() { vec![1_000, 10_000, 100_000] } else { o.entries.clone() };
    if o.million {
        sizes.push(1_000_000);
    }
    // (entries, GiB of data to reach): the entry counts as generated, then the data-size point.
    let mut plan: Vec<(u64, Option<u64>)> = sizes.iter().map(|&n| (n, None)).collect();
    if let Some(gib) = o.data_gib {
        plan.push((sizes.first().copied().unwrap_or(1_000), Some(gib)));
    }
    let scratch = Scratch(PathBuf::from(format!("/tmp/tessera-bench-scale-{}", std::process::id())));
    std::fs::create_dir_all(&scratch.0)?;
    let daemon_size = sizes.iter().copied().filter(|&n| n <= 100_000).max();
    let mut runs = Vec::new();
    let mut daemons = Vec::new();
    for (n, gib) in plan {
        let tree_dir = scratch.0.join("tree");
        let store = scratch.0.join(format!("store-{n}"));
        let t = Instant::now();
        let mut tree = generate_scale_tree(&tree_dir, n, !o.no_large)?;
        if let Some(gib) = gib {
            const BULK_MIB: u64 = 256;
            let files = ((gib << 30).saturating_sub(tree.bytes)).div_ceil(BULK_MIB << 20);
            super::bench_lazy::write_incompressible(&tree_dir.join("bulk"), files, BULK_MIB, "scale-bulk")?;
            tree.files += files;
            tree.dirs += 1;
            tree.entries += files + 1;
            tree.bytes += files * (BULK_MIB << 20);
        }
        eprintln!("==> {n} entries generated in {:.1}s: {tree:?}", t.elapsed().as_secs_f64());
        let t = Instant::now();
        let (stdout, peak) = tessera::run_peak_rss(&[
            "build".as_ref(),
            tree_dir.as_os_str(),
            "--store".as_ref(),
            store.as_os_str(),
        ])?;
        let seconds = t.elapsed().as_secs_f64();
        let id = String::from_utf8_lossy(&stdout).trim().to_owned();
        eprintln!("    build {seconds:.2}s, VmHWM {:.1} MiB, {id}", mib(peak));
        std::fs::remove_dir_all(&tree_dir)?;
        runs.push(BuildRun { tree, seconds, peak, bulk: gib.is_some() });
        if (o.daemon_every_size || Some(n) == daemon_size) && !o.no_daemon && gib.is_none() {
            daemons.push((n, measure_daemon(&bin, &id, &store, &scratch.0)?));
        }
        std::fs::remove_dir_all(&store)?;
    }
    Ok(ScaleResult { bin, runs, daemons })
}

/// The table (and with `--json` the JSON) of a measured scale run.
fn print_result(
    o: &ScaleBench,
    bin: &Path,
    runs: &[BuildRun],
    daemon: Option<&(u64, DaemonRss)>,
) -> Result<()> {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let base = runs.first().map(|r| (r.tree.entries, r.peak));
    let mut table = format!(
        "tessera build (binary {}), {cores} cores, load average at the end: {}\n\
         {:>9} {:>8} {:>7} {:>9} {:>9} {:>11} {:>9} {:>15}\n",
        bin.display(),
        load.trim(),
        "entries",
        "files",
        "dirs",
        "data MB",
        "build s",
        "VmHWM MiB",
        "B/entry",
        "B/entry (marg.)"
    );
    let mut builds = Vec::new();
    for r in runs {
        let per = r.peak as f64 / r.tree.entries as f64;
        let marginal = base
            .filter(|&(e, _)| r.tree.entries > e && !r.bulk)
            .map(|(e, p)| (r.peak as f64 - p as f64) / (r.tree.entries - e) as f64);
        table.push_str(&format!(
            "{:>9} {:>8} {:>7} {:>9.1} {:>9.2} {:>11.1} {:>9.0} {:>15}\n",
            r.tree.entries,
            r.tree.files,
            r.tree.dirs,
            r.tree.bytes as f64 / 1e6,
            r.seconds,
            mib(r.peak),
            per,
            marginal.map_or("-".to_owned(), |m| format!("{m:.0}")),
        ));
        builds.push(json!({
            "entries": r.tree.entries, "files": r.tree.files, "dirs": r.tree.dirs,
            "symlinks": r.tree.symlinks, "hardlinks": r.tree.hardlinks, "data_bytes": r.tree.bytes,
            "build_seconds": r.seconds, "vmhwm_bytes": r.peak,
        }));
    }
    let mut daemon_json = serde_json::Value::Null;
    if let Some((n, d)) = daemon {
        table.push_str(&format!(
            "tessera serve of the {n}-entry image (local store, --read-only, memory tier {:.0} MiB):\n\
             \x20 after start: VmRSS {:.1} MiB; after reading all {:.1} MiB of metadata ({:.2}s): \
             VmRSS {:.1} MiB, VmHWM {:.1} MiB\n",
            mib(d.mem_tier),
            mib(d.started.0),
            mib(d.metadata_bytes),
            d.read_seconds,
            mib(d.after.0),
            mib(d.after.1)
        ));
        daemon_json = json!({
            "entries": n, "mem_tier_bytes": d.mem_tier, "metadata_bytes": d.metadata_bytes,
            "rss_after_start": d.started.0, "rss_after_metadata_read": d.after.0,
            "hwm_after_metadata_read": d.after.1, "read_seconds": d.read_seconds,
        });
    }
    if o.json {
        eprint!("{table}");
        let v = json!({
            "cores": cores, "load_average": load.trim(), "binary": bin.display().to_string(),
            "builds": builds, "daemon": daemon_json,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{table}");
    }
    Ok(())
}

pub(crate) struct DaemonRss {
    pub(crate) mem_tier: u64,
    pub(crate) metadata_bytes: u64,
    /// (VmRSS, VmHWM) right after the socket appeared.
    pub(crate) started: (u64, u64),
    /// (VmRSS, VmHWM) after every metadata block was read.
    pub(crate) after: (u64, u64),
    pub(crate) read_seconds: f64,
}

/// Serve `id` from `store` and read every block before the data area through libblkio.
fn measure_daemon(bin: &Path, id: &str, store: &Path, scratch: &Path) -> Result<DaemonRss> {
    let v = tessera::inspect_json_with(bin, id, store)?;
    let data_start = v["geometry"]["data_start_block"].as_u64().context("geometry.data_start_block")?;
    let metadata_bytes = data_start * 4096;
    let mem_tier = 256 << 20; // `tessera serve`'s default --mem-cache
    let sock = scratch.join("serve.sock");
    let d = Daemon::start(id, store, &sock, &["--read-only"])?;
    let pid = d.pid().context("daemon pid")?;
    let mut c = BlkClient::connect(d.socket(), 1, true)?;
    // The first read proves the device is up; RSS is taken after it.
    c.read(0, 4096)?.map_err(|e| anyhow::anyhow!("read 0: errno {e}"))?;
    let started = rss_of(pid)?;
    let t = Instant::now();
    let piece = 1usize << 20;
    let depth = 8usize;
    let mut at = 0u64;
    while at < metadata_bytes {
        let batch: Vec<(u64, usize)> = (0..depth as u64)
            .map(|k| at + k * piece as u64)
            .take_while(|&o| o < metadata_bytes)
            .map(|o| (o, piece.min((metadata_bytes - o) as usize)))
            .collect();
        for r in c.read_batch(0, &batch)? {
            r.map_err(|e| anyhow::anyhow!("metadata read failed: errno {e}"))?;
        }
        at += batch.iter().map(|b| b.1 as u64).sum::<u64>();
    }
    let read_seconds = t.elapsed().as_secs_f64();
    let after = rss_of(pid)?;
    drop(c);
    d.stop()?;
    Ok(DaemonRss { mem_tier, metadata_bytes, started, after, read_seconds })
}
