//! `cargo xtask bench export`: `tessera export` of a remote image through the read engine, from
//! an nginx origin behind the latency proxy (20 ms RTT, 200 Mbit/s by default), against the
//! link itself: `curl` downloading every blob of the same store through the same proxy, one
//! after the other (the bytes an export needs, at what one client stream gets out of the link).
//! Issue 10's target: the export runs at ≥ 70% of the link rate.
//!
//! Rounds are interleaved (export without a disk cache, export into a cold `--cache-dir`, curl);
//! medians and min–max are reported. Every export is compared byte for byte with the local
//! export of the same image.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use clap::Args;
use tessera_e2e::nginx::Nginx;
use tessera_e2e::proxy::{Proxy, ProxyConfig, ProxyStats};
use tessera_e2e::testutil::same_bytes;

use super::bench_lazy::{build_served, release_bench, write_incompressible};
use super::status;

/// Options of `cargo xtask bench export`.
#[derive(Debug, Args)]
pub struct ExportBench {
    /// Round-trip time of the modelled network, in milliseconds.
    #[arg(long, default_value_t = 20)]
    rtt_ms: u64,
    /// Bandwidth of the modelled network, in Mbit/s.
    #[arg(long, default_value_t = 200)]
    mbit: u64,
    /// Incompressible files in the image.
    #[arg(long, default_value_t = 8)]
    files: u64,
    /// Size of each, in MiB.
    #[arg(long, default_value_t = 32)]
    file_mib: u64,
    /// Interleaved rounds (each: export, export with a cold cache, curl).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// An extra argument for `tessera export` (repeatable), e.g. `--export-arg=--fetch-jobs=8`.
    #[arg(long)]
    export_arg: Vec<String>,
}

/// One timed transfer.
#[derive(Debug, Clone, Copy)]
struct Run {
    secs: f64,
    bytes: u64,
    requests: u64,
    connections: u64,
}

impl Run {
    fn of(t: Instant, before: ProxyStats, after: ProxyStats) -> Self {
        Self {
            secs: t.elapsed().as_secs_f64(),
            bytes: after.body_bytes - before.body_bytes,
            requests: after.requests - before.requests,
            connections: after.connections - before.connections,
        }
    }
}

pub fn run(opts: &ExportBench) -> Result<()> {
    ensure!(opts.rounds >= 1, "--rounds must be at least 1");
    let (bin, dir) = release_bench("bench-export")?;

    // The tree, kept while its recipe holds.
    let tree = dir.join("tree");
    let recipe =
        format!("bench-export tree v1: {} x {} MiB (Prng label bench-export-N)\n", opts.files, opts.file_mib);
    let marker = dir.join("tree.recipe");
    if fs::read_to_string(&marker).ok().as_deref() != Some(recipe.as_str()) {
        let _ = fs::remove_file(&marker);
        let _ = fs::remove_dir_all(&tree);
        write_incompressible(&tree, opts.files, opts.file_mib, "bench-export")?;
        fs::write(&marker, &recipe)?;
    }

    // The store (fresh every run), served by nginx behind the proxy, and the local export.
    let (served, store) = build_served(&bin, &dir, &tree)?;
    let reference = dir.join("reference.raw");
    status(Command::new(&bin).args(["export", "bench", "--store"]).arg(&store).arg("-o").arg(&reference))?;
    let blobs = blob_names(&store)?;
    let stored: u64 = blobs.iter().map(|(_, len)| len).sum();

    let nginx = Nginx::serve(&served, "s")?;
    let link = opts.mbit * 1_000_000 / 8;
    let cfg =
        ProxyConfig { rtt: Duration::from_millis(opts.rtt_ms), bandwidth: Some(link), ..Default::default() };
    let proxy = Proxy::start(nginx.addr(), cfg)?;
    let origin = proxy.url("s/store");

    let output = dir.join("export.raw");
    let cache = dir.join("cache");
    let mut plain = Vec::new();
    let mut cached = Vec::new();
    let mut curl = Vec::new();
    for round in 1..=opts.rounds {
        println!("==> round {round}/{}", opts.rounds);
        for with_cache in [false, true] {
            let _ = fs::remove_file(&output);
            let _ = fs::remove_dir_all(&cache);
            let mut cmd = Command::new(&bin);
            cmd.args(["export", "bench", "--store", &origin, "-o"]).arg(&output).args(&opts.export_arg);
            if with_cache {
                cmd.arg("--cache-dir").arg(&cache);
            }
            let before = proxy.stats();
            let t = Instant::now();
            status(&mut cmd)?;
            let run = Run::of(t, before, proxy.stats());
            ensure!(
                same_bytes(&reference, &output)?,
                "the export through the proxy differs from the local export"
            );
            // Each stored byte crosses the link once (a chunk fetched twice is a defect).
            ensure!(
                run.bytes <= stored + stored / 100,
                "the export pulled {} bytes through the link for {stored} stored bytes",
                run.bytes
            );
            if with_cache { &mut cached } else { &mut plain }.push(run);
        }
        // The peer: every blob of the store, one curl after the other, through the same link.
        let download = dir.join("download");
        let before = proxy.stats();
        let t = Instant::now();
        for (name, _) in &blobs {
            status(
                Command::new("curl")
                    .args(["-sS", "--fail", "-o"])
                    .arg(&download)
                    .arg(format!("{origin}/blobs/sha256/{name}")),
            )?;
        }
        curl.push(Run::of(t, before, proxy.stats()));
        let _ = fs::remove_file(&download);
    }
    let _ = fs::remove_file(&output);

    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    println!(
        "\n== bench export: {} ms RTT, {} Mbit/s ({:.1} MB/s) through the proxy; image {} x {} MiB incompressible, {:.1} MiB stored in {} blobs; {} interleaved rounds, median (min–max)",
        opts.rtt_ms,
        opts.mbit,
        link as f64 / 1e6,
        opts.files,
        opts.file_mib,
        mib(stored),
        blobs.len(),
        opts.rounds
    );
    let curl_rate = stored as f64 / median(&curl, |r| r.secs);
    for (name, runs) in [
        ("tessera export", &plain),
        ("tessera export --cache-dir (cold)", &cached),
        ("curl, blob after blob", &curl),
    ] {
        let secs = median(runs, |r| r.secs);
        let (lo, hi) = spread(runs, |r| r.secs);
        let rate = stored as f64 / secs;
        println!(
            "{name:36} {secs:6.2} s ({lo:.2}–{hi:.2}); {:5.1} MB/s = {:4.1}% of the link, {:.2}× curl; origin {:.1} MiB in {} requests over {} connections",
            rate / 1e6,
            rate * 100.0 / link as f64,
            rate / curl_rate,
            mib(median(runs, |r| r.bytes as f64) as u64),
            median(runs, |r| r.requests as f64),
            median(runs, |r| r.connections as f64),
        );
    }
    println!("target: tessera export ≥ 70% of the link rate");
    Ok(())
}

/// The blobs of a local store, `(hex name, bytes)`, sorted by name.
fn blob_names(store: &Path) -> Result<Vec<(String, u64)>> {
    let dir = store.join("blobs").join("sha256");
    let mut out = Vec::new();
    for e in fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let e = e?;
        let name = e.file_name().into_string().map_err(|n| anyhow::anyhow!("odd blob name {n:?}"))?;
        out.push((name, e.metadata()?.len()));
    }
    out.sort();
    Ok(out)
}

fn median(runs: &[Run], f: impl Fn(&Run) -> f64) -> f64 {
    let mut v: Vec<f64> = runs.iter().map(f).collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn spread(runs: &[Run], f: impl Fn(&Run) -> f64) -> (f64, f64) {
    let v: Vec<f64> = runs.iter().map(f).collect();
    (v.iter().copied().fold(f64::INFINITY, f64::min), v.iter().copied().fold(0.0, f64::max))
}
