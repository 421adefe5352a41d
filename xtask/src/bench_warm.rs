//! `cargo xtask bench boot-profile`: how long a guest's start-up takes, in the QEMU guest under TCG,
//! when its image comes from an origin 20 ms away (the fault proxy in front of nginx charges one RTT
//! per connection and per request): cold without the prefetch profile (`--no-prefetch`), cold with
//! it, from a cache filled by `tessera warm`, and from a local store (the reference).
//!
//! The start-up is a command run in the image (chroot): it reads `--read-files` of the image's
//! `--files` 1 MB files. It prints /proc/uptime before and after; the figure is the difference
//! (guest clock, 10 ms resolution). Every remote run uses a fresh cache directory, except the warm
//! one (filled first, then served from). Medians of `--runs`.

use anyhow::{ensure, Context, Result};
use clap::Args;
use tessera_e2e::nginx::Nginx;
use tessera_e2e::prng::Prng;
use tessera_e2e::proxy::{Proxy, ProxyConfig};
use tessera_e2e::{fixtures, guest, record, tessera};

use super::{cargo, median, status, target_dir};

/// Options of `cargo xtask bench boot-profile`.
#[derive(Debug, Args)]
pub struct BootProfileBench {
    /// Timed runs of each configuration.
    #[arg(long, default_value_t = 3)]
    pub(crate) runs: usize,
    /// Round-trip time of the origin, in milliseconds.
    #[arg(long, default_value_t = 20)]
    pub(crate) rtt_ms: u64,
    /// 1 MB files in the image.
    #[arg(long, default_value_t = 40)]
    pub(crate) files: usize,
    /// Files the start-up reads.
    #[arg(long, default_value_t = 8)]
    pub(crate) read_files: usize,
    /// Use this `tessera` binary (as `TESSERA_BIN`) instead of building the debug CLI.
    #[arg(long)]
    pub(crate) bin: Option<std::path::PathBuf>,
}

/// Seconds between the two uptime readings the command prints.
fn startup_seconds(output: &str) -> Result<f64> {
    let line =
        output.lines().find(|l| l.starts_with("BENCH ")).context("no BENCH line in the guest output")?;
    let mut f = line.split_whitespace().skip(1).map(str::parse::<f64>);
    let (Some(Ok(t0)), Some(Ok(t1))) = (f.next(), f.next()) else {
        anyhow::bail!("unreadable BENCH line {line:?}");
    };
    Ok(t1 - t0)
}

/// The configurations, in the order of `BootProfileResult::seconds`.
pub(crate) const CONFIGS: [&str; 4] =
    ["local store", "origin, cold, no profile", "origin, cold, profile", "origin, warmed cache"];

/// Every run's start-up seconds (guest clock) per configuration of [`CONFIGS`].
pub(crate) struct BootProfileResult {
    pub(crate) seconds: Vec<Vec<f64>>,
}

pub fn run(o: &BootProfileBench) -> Result<()> {
    let mut results = measure(o)?.seconds;
    let medians: Vec<f64> = results.iter_mut().map(|r| median(r)).collect();
    println!(
        "\n==> start-up time, guest clock, median of {} runs ({} of {} 1 MB files read, RTT {} ms):",
        o.runs, o.read_files, o.files, o.rtt_ms
    );
    for (name, m) in CONFIGS.iter().zip(&medians) {
        println!("    {name:<28} {m:.2} s");
    }
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    println!("    no profile / profile        {:.2}x (target >= 2x)", ratio(medians[1], medians[2]));
    println!("    warmed cache / local store  {:.2}x (target <= 1.10x)", ratio(medians[3], medians[0]));
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("    load average at the end: {}", load.trim());
    Ok(())
}

/// Boot the guest `o.runs` times in every configuration of [`CONFIGS`].
pub(crate) fn measure(o: &BootProfileBench) -> Result<BootProfileResult> {
    fixtures::require_root()?;
    ensure!(o.read_files <= o.files && o.runs >= 1, "--read-files must not exceed --files");
    match &o.bin {
        Some(b) => std::env::set_var("TESSERA_BIN", b),
        None => status(cargo().args(["build", "-p", "tessera-cli"]))?,
    }
    let kit = guest::kit()?;
    let work = target_dir()?.join("bench-boot-profile");
    let _ = std::fs::remove_dir_all(&work);
    let root = work.join("rootfs");
    guest::bootable_rootfs(&kit, &root, "true")?;
    std::fs::create_dir_all(root.join("data"))?;
    let mut rng = Prng::from_label("bench-boot-profile");
    for i in 0..o.files {
        std::fs::write(root.join(format!("data/f{i:03}")), rng.bytes(1 << 20))?;
    }
    let store = work.join("store");
    tessera::build(&root, &store, &["--tag", "app"])?;
    // Spread the files the start-up reads over the image.
    let step = o.files / o.read_files.max(1);
    let reads: Vec<String> = (0..o.read_files).map(|i| format!("/data/f{:03}", i * step)).collect();
    let command = format!(
        "read t0 rest < /proc/uptime; cat {} > /dev/null; read t1 rest < /proc/uptime; echo BENCH $t0 $t1",
        reads.join(" ")
    );
    let rec = work.join("record");
    std::fs::create_dir_all(&rec)?;
    println!("==> recording the profile (one guest run)");
    record::record_profile("app", &store, &command, 1, &rec)?;

    let origin = Nginx::serve(&store, "store")?;
    let link = ProxyConfig::rtt(std::time::Duration::from_millis(o.rtt_ms));
    let proxy = Proxy::start(origin.addr(), link)?;
    let url = proxy.url("store");
    let store_s = store.to_str().context("utf-8")?.to_owned();

    let configs = CONFIGS;
    let mut results: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    for run in 0..o.runs {
        for (c, name) in configs.iter().enumerate() {
            let dir = work.join(format!("run{run}-{c}"));
            std::fs::create_dir_all(&dir)?;
            let cache = dir.join("cache");
            let cache_s = cache.to_str().context("utf-8")?.to_owned();
            if c == 3 {
                let w = tessera::run(["warm", "app", "--store", &url, "--cache-dir", &cache_s])?;
                ensure!(w.status.success(), "warm: {}", String::from_utf8_lossy(&w.stderr));
            }
            let (store_arg, extra): (&str, Vec<&str>) = match c {
                0 => (&store_s, vec![]),
                1 => (&url, vec!["--cache-dir", &cache_s, "--no-prefetch"]),
                _ => (&url, vec!["--cache-dir", &cache_s]),
            };
            let g = record::run_in_guest(&kit, "app", store_arg, &command, &dir, None, &extra)?;
            ensure!(g.status == 0, "{name}: the start-up failed: {}", g.output);
            let secs = startup_seconds(&g.output)?;
            println!("    run {run} {name:<28} {secs:.2} s");
            results[c].push(secs);
        }
    }
    Ok(BootProfileResult { seconds: results })
}
