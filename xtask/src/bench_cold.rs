//! `cargo xtask bench cold`: replay a request trace against a cold `tessera serve` (nothing
//! local) from an origin (nginx over a local store) behind the latency proxy, several rounds,
//! and print every run's link floor and where its time went (`tessera_e2e::floor`). With several
//! `--arm`s (other serve arguments, or another binary) the rounds interleave the arms, so that a
//! shared machine's noise falls on all of them, and the medians are compared (issue 15, point 4).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use tessera_e2e::cold::{median, ColdRun};
use tessera_e2e::floor::{Link, StoreImage};
use tessera_e2e::nginx::Nginx;
use tessera_e2e::proxy::{Proxy, ProxyConfig};

use super::{cargo, status, target_dir};

/// Options of `cargo xtask bench cold`.
#[derive(Debug, Args)]
pub struct ColdBench {
    /// The local store holding the image (served by nginx through the proxy).
    #[arg(long)]
    store: PathBuf,
    /// The image: a tag or sha256:<64 hex>.
    #[arg(long)]
    image: String,
    /// The request trace (`tessera serve --record-requests`) to replay.
    #[arg(long)]
    trace: PathBuf,
    /// Check every byte read against this raw export.
    #[arg(long)]
    raw: Option<PathBuf>,
    /// Round-trip time of the modelled network, in milliseconds.
    #[arg(long, default_value_t = 20)]
    rtt_ms: u64,
    /// Bandwidth of the modelled network, in Mbit/s.
    #[arg(long, default_value_t = 200)]
    mbit: u64,
    /// Rounds (each runs every arm once, in turn).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// An arm: `NAME=SERVE ARGS` (space-separated `tessera serve` arguments) or
    /// `NAME@BINARY=SERVE ARGS` (another `tessera` binary); default one arm, `tessera=`.
    #[arg(long)]
    arm: Vec<String>,
    /// The `tessera` binary of arms that name none (default: the release build, built now).
    #[arg(long)]
    bin: Option<PathBuf>,
}

struct Arm {
    name: String,
    bin: PathBuf,
    args: Vec<String>,
}

fn parse_arm(spec: &str, default_bin: &Path) -> Result<Arm> {
    let (head, args) = spec.split_once('=').with_context(|| format!("--arm {spec:?}: no '='"))?;
    let (name, bin) = match head.split_once('@') {
        Some((n, b)) => (n, PathBuf::from(b)),
        None => (head, default_bin.to_path_buf()),
    };
    if name.is_empty() {
        bail!("--arm {spec:?}: no name");
    }
    Ok(Arm { name: name.to_owned(), bin, args: args.split_whitespace().map(str::to_owned).collect() })
}

pub fn run(opts: &ColdBench) -> Result<()> {
    let bin = match &opts.bin {
        Some(b) => b.clone(),
        None => {
            status(cargo().args(["build", "--release", "-p", "tessera-cli"]))?;
            target_dir()?.join("release").join("tessera")
        }
    };
    let specs = if opts.arm.is_empty() { vec!["tessera=".to_owned()] } else { opts.arm.clone() };
    let arms: Vec<Arm> = specs.iter().map(|s| parse_arm(s, &bin)).collect::<Result<_>>()?;
    let store = opts.store.canonicalize().with_context(|| format!("{}", opts.store.display()))?;
    let image = StoreImage::load(&store, &opts.image)?;
    let trace = tessera_e2e::replay::load(&opts.trace)?;
    let link = Link { bytes_per_sec: opts.mbit * 1_000_000 / 8, rtt: Duration::from_millis(opts.rtt_ms) };
    let floor = image.floor(&trace, link)?;
    println!("{}", floor.summary());

    let parent = store.parent().context("the store has no parent directory")?;
    let name = store.file_name().context("the store has no name")?.to_string_lossy().into_owned();
    let nginx = Nginx::serve(parent, "s")?;
    let proxy =
        Proxy::start(nginx.addr(), ProxyConfig { rtt: link.rtt, bandwidth: Some(link.bytes_per_sec) })?;
    let work = target_dir()?.join("bench-cold");
    std::fs::create_dir_all(&work)?;
    let mut results: Vec<Vec<tessera_e2e::floor::Breakdown>> = arms.iter().map(|_| Vec::new()).collect();
    for round in 0..opts.rounds {
        for (i, arm) in arms.iter().enumerate() {
            let run = ColdRun {
                bin: &arm.bin,
                store_url: proxy.url(&format!("s/{name}")),
                image: &opts.image,
                serve_args: &arm.args,
                socket: work.join("cold.sock"),
                raw: opts.raw.clone(),
            };
            let r = run.run(&trace, &proxy, &image, link)?;
            println!("== round {round} {}: replay {}", arm.name, r.replay.summary().replace('\n', "; "));
            print!("{}", r.breakdown.summary());
            results[i].push(r.breakdown);
        }
    }
    println!(
        "\n== medians of {} rounds ({} ms RTT, {} Mbit/s); floor {:.1} ms",
        opts.rounds,
        opts.rtt_ms,
        opts.mbit,
        floor.time().as_secs_f64() * 1e3
    );
    for (arm, runs) in arms.iter().zip(&results) {
        let ms = |f: &dyn Fn(&tessera_e2e::floor::Breakdown) -> Duration| {
            median(runs.iter().map(|b| f(b).as_secs_f64() * 1e3).collect())
        };
        let total = ms(&|b| b.total());
        println!(
            "{:<16} total {:8.1} ms ({:.2}x floor)  start {:7.1} ms  workload {:8.1} ms  origin {:.2} MiB ({:.2}x floor bytes)  rounds {:.0}",
            arm.name,
            total,
            total / (floor.time().as_secs_f64() * 1e3),
            ms(&|b| b.start),
            ms(&|b| b.workload),
            median(runs.iter().map(|b| b.origin_bytes as f64).collect()) / f64::from(1u32 << 20),
            median(runs.iter().map(|b| b.origin_bytes as f64 / floor.bytes().max(1) as f64).collect()),
            median(runs.iter().map(|b| b.rounds as f64).collect()),
        );
    }
    Ok(())
}
