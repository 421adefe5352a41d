//! `cargo xtask bench cold`: replay a request trace against a cold `tessera serve` (nothing
//! local) from an origin (nginx over a local store) behind the latency proxy, several rounds,
//! and print every run's link floor and where its time went (`tessera_e2e::floor`). With several
//! `--arm`s (other serve arguments, or another binary) the rounds interleave the arms, so that a
//! shared machine's noise falls on all of them, and the medians are compared (issue 15, point 4).
//! Each round starts one arm further on ([`round_order`]): on a VM that hands free memory back
//! to its host, a cold run depends on what the run before it freed (docs/benchmarks.md, "Cold
//! runs on this VM depend on the run before"), so no arm may always follow the same one.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use tessera_e2e::cold::{median, ColdRun};
use tessera_e2e::floor::{Link, StoreImage};
use tessera_e2e::nginx::{Nginx, ServerCert};
use tessera_e2e::pin::Placement;
use tessera_e2e::proxy::{Proxy, ProxyConfig};
use tessera_e2e::tls::TestPki;

use super::{cargo, status, target_dir};

/// Options of `cargo xtask bench cold`.
#[derive(Debug, Args)]
pub struct ColdBench {
    /// The local store holding the image (served by nginx through the proxy).
    #[arg(long)]
    pub(crate) store: PathBuf,
    /// The image: a tag or sha256:<64 hex>.
    #[arg(long)]
    pub(crate) image: String,
    /// The request trace (`tessera serve --record-requests`) to replay.
    #[arg(long)]
    pub(crate) trace: PathBuf,
    /// Check every byte read against this raw export.
    #[arg(long)]
    pub(crate) raw: Option<PathBuf>,
    /// Round-trip time of the modelled network, in milliseconds.
    #[arg(long, default_value_t = 20)]
    pub(crate) rtt_ms: u64,
    /// Bandwidth of the modelled network, in Mbit/s.
    #[arg(long, default_value_t = 200)]
    pub(crate) mbit: u64,
    /// Rounds (each runs every arm once, in turn, starting one arm further on than the last).
    #[arg(long, default_value_t = 3)]
    pub(crate) rounds: usize,
    /// An arm: `NAME=SERVE ARGS` (space-separated `tessera serve` arguments) or
    /// `NAME@BINARY=SERVE ARGS` (another `tessera` binary); default one arm, `tessera=`. An arm
    /// with its own `--store S` serves from S instead of the origin (e.g. the local store);
    /// `--store origin:DIR` serves the store DIR beside `--store`'s through the same origin and
    /// link (e.g. the same image built with `--reference-layers`; the floor stays `--store`'s).
    /// An arm's `--cache-dir DIR` becomes `DIR/run-ROUND`, which must not exist: every run
    /// starts cold, and no cache is removed while the bench runs (remove DIR afterwards);
    /// `--cache-dir=DIR` (one argument) is passed as it is: every run of the arm uses DIR, e.g.
    /// a cache `tessera warm` filled (with `--tag-max-age 1h`, as `bench lazy`'s warmed runs).
    #[arg(long)]
    pub(crate) arm: Vec<String>,
    /// The `tessera` binary of arms that name none (default: the release build, built now).
    #[arg(long)]
    pub(crate) bin: Option<PathBuf>,
    /// Also N cold daemons at once (comma-separated counts, e.g. `4,8`): each its own fresh
    /// `tessera serve` of the image replaying the trace, all started together; the time until
    /// the last finishes and the origin bytes of all of them (the first arm's arguments).
    #[arg(long, value_delimiter = ',')]
    pub(crate) daemons: Vec<usize>,
    /// With `--daemons`: run every count a second time with the daemons sharing one host disk
    /// cache (`--cache-dir`, empty at the start of each round), as the daemons of one host do:
    /// each chunk should cross the link once, however many daemons need it.
    #[arg(long)]
    pub(crate) shared_cache: bool,
    /// Serve the store over TLS with HTTP/2 offered (nginx `ssl http2`, a throwaway CA given to
    /// every arm as `--ca-file`) behind the TCP-level proxy (a connect RTT, half an RTT each way
    /// for every byte, one shared link, TCP slow start): what TLS and HTTP/2 cost and save. The
    /// proxy sees no requests then, so the breakdown has times and wire bytes only.
    #[arg(long)]
    pub(crate) tls: bool,
    /// Leave the daemons and the replay where the scheduler puts them (default: each daemon on
    /// the second CPU, the replay on the first; `tessera_e2e::pin`).
    #[arg(long)]
    pub(crate) no_pin: bool,
    /// Charge no TCP slow start (default: each connection's answers pass a congestion window
    /// that starts at 10 segments and doubles per round trip, and restarts after an idle RTO, as
    /// Linux's does: what a fresh or idle connection costs on a real path).
    #[arg(long)]
    pub(crate) no_slow_start: bool,
    /// Print every request of every run, as the proxy saw it: ms after the daemon's spawn when
    /// it was asked and when its last byte went, body bytes, the client connection (`*`: its
    /// first request), what it fetched, and the `Range` asked. For finding where a run's time
    /// went (serial misses, windows, which connection carried what).
    #[arg(long)]
    pub(crate) requests: bool,
}

struct Arm {
    name: String,
    bin: PathBuf,
    args: Vec<String>,
    /// The arm's own `--store`, taken out of its arguments.
    store: Option<String>,
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
    let mut args: Vec<String> = args.split_whitespace().map(str::to_owned).collect();
    let store = match args.iter().position(|a| a == "--store") {
        Some(i) if i + 1 < args.len() => {
            let s = args.remove(i + 1);
            args.remove(i);
            Some(s)
        }
        Some(_) => bail!("--arm {spec:?}: --store without a value"),
        None => None,
    };
    Ok(Arm { name: name.to_owned(), bin, args, store })
}

/// N cold daemons at once, every round: seconds until the last one's replay ended, and the
/// origin bytes of all of them.
pub(crate) struct Concurrent {
    pub(crate) daemons: usize,
    /// The daemons shared one disk cache.
    pub(crate) shared_cache: bool,
    pub(crate) wall: Vec<f64>,
    pub(crate) origin_bytes: Vec<u64>,
}

/// `--requests`: one line per request of run `r`.
fn print_requests(r: &tessera_e2e::cold::ColdResult, image: &tessera_e2e::floor::StoreImage) {
    let ms = |t: std::time::Instant| t.saturating_duration_since(r.spawned).as_secs_f64() * 1e3;
    for q in &r.requests {
        let done = q.done.map_or_else(|| "-".to_owned(), |t| format!("{:.1}", ms(t)));
        println!(
            "  request {:8.1} {:>8} ms {:>9} B conn {:>3}{} {:<10} {}",
            ms(q.at),
            done,
            q.body_bytes,
            q.connection,
            if q.fresh { "*" } else { " " },
            format!("{:?}", image.classify(&q.path)),
            q.range.as_deref().unwrap_or("whole"),
        );
    }
}

/// What `measure` found: the floor and every round's breakdown per arm.
pub(crate) struct ColdResult {
    pub(crate) floor: tessera_e2e::floor::Floor,
    pub(crate) arms: Vec<(String, Vec<tessera_e2e::floor::Breakdown>)>,
    pub(crate) concurrent: Vec<Concurrent>,
}

pub fn run(opts: &ColdBench) -> Result<()> {
    let r = measure(opts)?;
    let floor = r.floor;
    println!(
        "\n== medians of {} rounds ({} ms RTT, {} Mbit/s); floor {:.1} ms",
        opts.rounds,
        opts.rtt_ms,
        opts.mbit,
        floor.time().as_secs_f64() * 1e3
    );
    for (arm, runs) in &r.arms {
        let ms = |f: &dyn Fn(&tessera_e2e::floor::Breakdown) -> Duration| {
            median(runs.iter().map(|b| f(b).as_secs_f64() * 1e3).collect())
        };
        let total = ms(&|b| b.total());
        println!(
            "{:<16} total {:8.1} ms ({:.2}x floor)  start {:7.1} ms  workload {:8.1} ms  origin {:.2} MiB ({:.2}x floor bytes)  rounds {:.0}",
            arm,
            total,
            total / (floor.time().as_secs_f64() * 1e3),
            ms(&|b| b.start),
            ms(&|b| b.workload),
            median(runs.iter().map(|b| b.origin_bytes as f64).collect()) / f64::from(1u32 << 20),
            median(runs.iter().map(|b| b.origin_bytes as f64 / floor.bytes().max(1) as f64).collect()),
            median(runs.iter().map(|b| b.rounds as f64).collect()),
        );
    }
    for c in &r.concurrent {
        println!(
            "{} daemons at once{}: last done after {:.1} ms, origin {:.2} MiB in all ({:.2}x one floor's bytes)",
            c.daemons,
            if c.shared_cache { ", one shared disk cache" } else { "" },
            median(c.wall.clone()) * 1e3,
            median(c.origin_bytes.iter().map(|&b| b as f64).collect()) / f64::from(1u32 << 20),
            median(c.origin_bytes.iter().map(|&b| b as f64 / floor.bytes().max(1) as f64).collect()),
        );
    }
    Ok(())
}

/// Replay the trace against cold daemons (every arm, then every `--daemons` count), `rounds`
/// times.
pub(crate) fn measure(opts: &ColdBench) -> Result<ColdResult> {
    let bin = match &opts.bin {
        Some(b) => b.clone(),
        None => {
            status(cargo().args(["build", "--release", "-p", "tessera-cli"]))?;
            target_dir()?.join("release").join("tessera")
        }
    };
    let specs = if opts.arm.is_empty() { vec!["tessera=".to_owned()] } else { opts.arm.clone() };
    let mut arms: Vec<Arm> = specs.iter().map(|s| parse_arm(s, &bin)).collect::<Result<_>>()?;
    let store = opts.store.canonicalize().with_context(|| format!("{}", opts.store.display()))?;
    let image = StoreImage::load(&store, &opts.image)?;
    // A daemon given an entry whose profile blob is gone prefetches nothing and says so only in
    // its log: a saved entry swapped in after the store was rebuilt would measure no profile.
    if let Some(profile) = image.entry.profile {
        let path = store.join("blobs/sha256").join(profile.hex());
        ensure!(path.is_file(), "the image's entry names profile {profile}, which the store does not hold");
    }
    let trace = tessera_e2e::replay::load(&opts.trace)?;
    let link = Link { bytes_per_sec: opts.mbit * 1_000_000 / 8, rtt: Duration::from_millis(opts.rtt_ms) };
    let floor = image.floor(&trace, link)?;
    println!("{}", floor.summary());
    let placement = if opts.no_pin { None } else { Placement::split() };
    match placement {
        Some(p) => println!("pinned: daemon on CPU {}, replay on CPU {}", p.daemon, p.client),
        None => println!("not pinned"),
    }

    let parent = store.parent().context("the store has no parent directory")?;
    let name = store.file_name().context("the store has no name")?.to_string_lossy().into_owned();
    let work = target_dir()?.join("bench-cold");
    std::fs::create_dir_all(&work)?;
    let net =
        ProxyConfig { rtt: link.rtt, bandwidth: Some(link.bytes_per_sec), slow_start: !opts.no_slow_start };
    println!("TCP slow start {}", if net.slow_start { "charged" } else { "not charged" });
    let (nginx, proxy, store_url) = if opts.tls {
        let pki = TestPki::generate(&work.join("pki"), "bench-cold", &[])?;
        let nginx = Nginx::serve_tls_h2(parent, "s", ServerCert { cert: &pki.cert, key: &pki.key })?;
        let proxy = Proxy::start_tcp(nginx.addr(), net)?;
        let url = proxy.https_url(&format!("s/{name}"));
        for arm in &mut arms {
            arm.args.splice(0..0, ["--ca-file".to_owned(), pki.ca.display().to_string()]);
        }
        (nginx, proxy, url)
    } else {
        let nginx = Nginx::serve(parent, "s")?;
        let proxy = Proxy::start(nginx.addr(), net)?;
        let url = proxy.url(&format!("s/{name}"));
        (nginx, proxy, url)
    };
    let _origin = nginx;
    // An arm's store: its own (`origin:DIR`: a sibling store through the same origin and link),
    // else the origin's.
    let arm_url = |arm: &Arm| match arm.store.as_deref().map(|s| (s, s.strip_prefix("origin:"))) {
        None => store_url.clone(),
        Some((_, Some(sibling))) if opts.tls => proxy.https_url(&format!("s/{sibling}")),
        Some((_, Some(sibling))) => proxy.url(&format!("s/{sibling}")),
        Some((local, None)) => local.to_owned(),
    };
    let mut results: Vec<Vec<tessera_e2e::floor::Breakdown>> = arms.iter().map(|_| Vec::new()).collect();
    for round in 0..opts.rounds {
        for i in round_order(round, arms.len()) {
            let arm = &arms[i];
            // A fresh cache directory per run, none removed before the last run: unlinking a
            // cache's thousands of files makes ext4 slow to create files for minutes after
            // (its inode allocator skips recently freed inodes one by one), which the next run
            // would pay.
            let mut args = arm.args.clone();
            if let Some(dir) = args.iter().position(|a| a == "--cache-dir").and_then(|i| args.get_mut(i + 1))
            {
                let fresh = Path::new(dir.as_str()).join(format!("run-{round}"));
                anyhow::ensure!(
                    !fresh.exists(),
                    "{}: remove it first (a run must start cold)",
                    fresh.display()
                );
                *dir = fresh.display().to_string();
            }
            let run = ColdRun {
                bin: &arm.bin,
                store_url: arm_url(arm),
                image: &opts.image,
                serve_args: &args,
                socket: work.join("cold.sock"),
                raw: opts.raw.clone(),
                placement,
            };
            let wire = proxy.stats().wire_bytes;
            let mut r = run.run(&trace, &proxy, &image, link)?;
            if opts.tls {
                // No requests to add up: the bytes that crossed the link, TLS records included.
                r.breakdown.origin_bytes = proxy.stats().wire_bytes - wire;
            }
            println!("== round {round} {}: replay {}", arm.name, r.replay.summary().replace('\n', "; "));
            if opts.requests {
                print_requests(&r, &image);
            }
            print!("{}", r.breakdown.summary());
            results[i].push(r.breakdown);
        }
    }
    let mut concurrent: Vec<Concurrent> = Vec::new();
    let counts = opts.daemons.iter().copied().filter(|&n| n > 1);
    let variants: Vec<(usize, bool)> = counts
        .flat_map(|n| [(n, false), (n, true)])
        .filter(|&(_, shared)| !shared || opts.shared_cache)
        .collect();
    for (n, shared) in variants {
        let arm = &arms[0];
        let mut c =
            Concurrent { daemons: n, shared_cache: shared, wall: Vec::new(), origin_bytes: Vec::new() };
        let cache = work.join("shared-cache");
        for round in 0..opts.rounds {
            let mut serve_args = arm.args.clone();
            if shared {
                let _ = std::fs::remove_dir_all(&cache);
                serve_args.extend(["--cache-dir".to_owned(), cache.display().to_string()]);
            }
            let bytes_so_far = |p: &Proxy| if opts.tls { p.stats().wire_bytes } else { p.stats().body_bytes };
            let before = bytes_so_far(&proxy);
            let t = std::time::Instant::now();
            let runs: Vec<Result<tessera_e2e::cold::ColdResult>> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..n)
                    .map(|k| {
                        let run = ColdRun {
                            bin: &arm.bin,
                            store_url: arm_url(arm),
                            image: &opts.image,
                            serve_args: &serve_args,
                            socket: work.join(format!("cold-{k}.sock")),
                            raw: opts.raw.clone(),
                            placement,
                        };
                        let (trace, proxy, image) = (&trace, &proxy, &image);
                        s.spawn(move || run.run(trace, proxy, image, link))
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a replay thread panicked"))))
                    .collect()
            });
            let wall = t.elapsed().as_secs_f64();
            for r in runs {
                let r = r?;
                if r.replay.failed > 0 {
                    bail!("{n} daemons: {} requests failed", r.replay.failed);
                }
            }
            let bytes = bytes_so_far(&proxy) - before;
            let how = if shared { " (one shared disk cache)" } else { "" };
            println!(
                "== round {round}: {n} daemons at once{how}: {:.1} ms, origin {bytes} bytes",
                wall * 1e3
            );
            c.wall.push(wall);
            c.origin_bytes.push(bytes);
        }
        concurrent.push(c);
    }
    Ok(ColdResult { floor, arms: arms.iter().map(|a| a.name.clone()).zip(results).collect(), concurrent })
}

/// The arms' order in round `round` of `arms`: every arm once, starting at arm `round mod arms`,
/// so that over the rounds each arm runs after each of the others.
fn round_order(round: usize, arms: usize) -> impl Iterator<Item = usize> {
    (0..arms).map(move |k| (round + k) % arms)
}

#[cfg(test)]
mod tests {
    use super::round_order;

    #[test]
    fn rounds_rotate_which_arm_comes_first() {
        let order: Vec<Vec<usize>> = (0..4).map(|r| round_order(r, 3).collect()).collect();
        assert_eq!(order, [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]);
        // Two arms: each runs first in alternate rounds, so each follows the other and itself.
        let two: Vec<usize> = (0..3).flat_map(|r| round_order(r, 2)).collect();
        assert_eq!(two, [0, 1, 1, 0, 0, 1]);
        assert_eq!(round_order(5, 1).collect::<Vec<_>>(), [0]);
    }
}
