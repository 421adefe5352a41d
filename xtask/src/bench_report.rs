//! `cargo xtask bench` with no subcommand: every comparison in one run, on one machine, under one
//! load — each part is the measuring function of its own subcommand (`bench build`, `build-oci`,
//! `serve`, `lazy`, `cold`, `scale`, `mounts`, and with `--guest` `boot-profile` and `virtiofs`),
//! called with the report's sizes; this file only chooses the sizes, turns each part's result
//! into the report's comparisons, figures and plots (`report.rs`, `plot.rs`), records the machine
//! and the load average before and after each part, and writes:
//!
//! - the generated section of `docs/benchmarks.md` (between `report::BEGIN` and `report::END`;
//!   the hand-written history around it is kept byte for byte),
//! - `docs/benchmarks.json`, every raw sample (`docs/formats/bench-report.md`),
//! - `docs/plots/*.svg`.
//!
//! All three are rewritten after every part, so a run stopped half-way leaves what it measured.
//! A part that fails is recorded as failed and the others still run; the command then fails.
//! A run of some parts (`--only`) is merged into the report the JSON file holds
//! (`report::merge`): its parts replace those of the same names and name the run they come from.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::plot::{self, Plot, Series};
use crate::report::{self, Better, Comparison, Figure, Machine, Part, Report, Samples};
use crate::{
    bench_cold, bench_devices, bench_lazy, bench_mounts, bench_oci, bench_scale, bench_serve, bench_virtiofs,
    bench_warm,
};

/// Options of `cargo xtask bench` (no subcommand).
#[derive(Debug, Args)]
pub struct ReportBench {
    /// A smaller run: fewer rounds, smaller inputs (≤ 10 minutes on the project's machine once
    /// the lazy bench's image and traces are cached; the full run ≤ 75 minutes).
    #[arg(long)]
    pub quick: bool,
    /// Also the guest (TCG) figures: `boot-profile` and `virtiofs`.
    #[arg(long)]
    pub guest: bool,
    /// Measure this prebuilt release `tessera` binary instead of building one.
    #[arg(long, value_name = "PATH")]
    pub tessera: Option<PathBuf>,
    /// Only these parts, comma-separated: build, oci, serve, lazy, cold, scale, devices, mounts, and with
    /// --guest boot-profile, virtiofs. They are merged into the report already in the JSON file
    /// (--json): each replaces the part of the same name, which then names the run it comes from,
    /// and the other parts stay as they were.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// With --only: start the report afresh (the page and the JSON file then hold these parts
    /// alone) instead of merging them into the earlier report.
    #[arg(long, requires = "only")]
    pub replace: bool,
    /// The page whose generated section is rewritten (relative to the workspace root).
    #[arg(long, default_value = "docs/benchmarks.md")]
    pub docs: PathBuf,
    /// The JSON file of every raw sample.
    #[arg(long, default_value = "docs/benchmarks.json")]
    pub json: PathBuf,
    /// The directory of the SVG plots.
    #[arg(long, default_value = "docs/plots")]
    pub plots: PathBuf,
    /// Measure nothing: render the page's generated section and the plots again from the JSON
    /// file of an earlier run (after a change to how the report is written).
    #[arg(long)]
    pub render: bool,
}

/// The parts, in the order they run: `--only` name and title.
const PARTS: [(&str, &str); 10] = [
    ("build", "Build: `tessera build` vs `mkfs.ext4 -d`"),
    ("oci", "Build from an OCI image: `tessera build oci:…` vs `umoci unpack` + `mkfs.ext4 -d`"),
    ("serve", "Serve: `tessera serve` vs `qemu-storage-daemon`, and write + FLUSH vs fio fdatasync"),
    ("lazy", "Lazy loading: time to ready vs the eager peers"),
    ("cold", "Cold daemons: one and N at once against the link floor"),
    ("scale", "Scaling: build time and memory vs entries, daemon RSS"),
    ("devices", "Devices per host: p99 latency vs devices served at once"),
    ("mounts", "One image, one device: container starts over overlayfs layer mounts vs `tessera serve`"),
    ("boot-profile", "Guest start-up (TCG): no profile, profile, warmed cache, local store"),
    ("virtiofs", "Metadata-heavy guest work (TCG): virtio-fs vs ext4 on Tessera"),
];

/// The parts that boot the QEMU guest (TCG): only with `--guest`.
const GUEST_PARTS: [&str; 2] = ["boot-profile", "virtiofs"];

fn loadavg() -> [f64; 3] {
    let s = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut it = s.split_whitespace().map(|x| x.parse::<f64>().unwrap_or(f64::NAN));
    [it.next().unwrap_or(f64::NAN), it.next().unwrap_or(f64::NAN), it.next().unwrap_or(f64::NAN)]
}

fn output(cmd: &mut Command) -> String {
    cmd.output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()).unwrap_or_default()
}

fn machine(bin: &Path) -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |text: &str, key: &str| {
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_once([':', '=']))
            .map(|(_, v)| v.trim().trim_matches('"').to_owned())
            .unwrap_or_default()
    };
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib: u64 = field(&meminfo, "MemTotal").trim_end_matches("kB").trim().parse().unwrap_or_default();
    Machine {
        cpu: field(&cpuinfo, "model name"),
        cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
        memory_bytes: mem_kib * 1024,
        kernel: output(Command::new("uname").arg("-r")),
        os: field(&std::fs::read_to_string("/etc/os-release").unwrap_or_default(), "PRETTY_NAME"),
        tessera: bin.display().to_string(),
        tessera_version: output(Command::new(bin).arg("--version")),
        commit: output(
            Command::new("git")
                .args(["describe", "--always", "--dirty"])
                .current_dir(crate::workspace_root()),
        ),
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / f64::from(1u32 << 20)
}

fn cmp(
    what: impl Into<String>,
    unit: &str,
    better: Better,
    ours: (&str, Vec<f64>),
    peer: (&str, Vec<f64>),
) -> Comparison {
    Comparison {
        what: what.into(),
        unit: unit.into(),
        better,
        ours: Samples { label: ours.0.into(), values: ours.1 },
        peer: Samples { label: peer.0.into(), values: peer.1 },
        target: None,
    }
}

fn target(mut c: Comparison, t: &str) -> Comparison {
    c.target = Some(t.into());
    c
}

fn fig(what: impl Into<String>, unit: &str, values: Vec<f64>) -> Figure {
    Figure { what: what.into(), unit: unit.into(), values }
}

fn median(v: &[f64]) -> f64 {
    report::spread(v).map_or(f64::NAN, |s| s.median)
}

fn series(label: &str, points: Vec<(f64, f64)>, line: bool) -> Series {
    Series {
        label: label.into(),
        points: points.into_iter().filter(|p| p.0.is_finite() && p.1.is_finite()).collect(),
        line,
    }
}

struct Plotted {
    id: String,
    title: String,
    x: &'static str,
    y: &'static str,
    x_log: bool,
    y_log: bool,
    categories: Vec<String>,
}

fn plot_of(p: Plotted, series: Vec<Series>) -> Plot {
    Plot {
        id: p.id,
        title: p.title,
        x_label: p.x.into(),
        y_label: p.y.into(),
        x_log: p.x_log,
        y_log: p.y_log,
        categories: p.categories,
        series: series.into_iter().filter(|s| !s.points.is_empty()).collect(),
    }
}

/// What the lazy part prepared, for the cold part: the store, the image and the trace.
struct Prepared {
    store: PathBuf,
    trace: PathBuf,
}

struct Ctx<'a> {
    o: &'a ReportBench,
    bin: PathBuf,
    prepared: Option<Prepared>,
}

impl Ctx<'_> {
    fn quick(&self) -> bool {
        self.o.quick
    }

    fn build(&self, p: &mut Part) -> Result<()> {
        let (files, runs) = if self.quick() { (5_000, 3) } else { (22_000, 5) };
        let r = crate::measure_build(&self.bin, files, runs, false)?;
        p.inputs.push(format!(
            "`generate_bench_tree` with {} files: {} inodes, {:.0} MB allocated; image {:.0} MiB, {} inodes \
             (the same size and inode count for `mkfs.ext4`)",
            r.files,
            r.entries,
            r.alloc_bytes as f64 / 1e6,
            mib(r.image_bytes),
            r.inodes
        ));
        p.inputs.push(format!(
            "{runs} runs each, caches {}; both timed including a final `sync`",
            if r.cold { "dropped before every run" } else { "warm (the tree read once before timing)" }
        ));
        p.commands.push(("tessera".into(), format!("{} build TREE --store STORE", self.bin.display())));
        p.commands.push(("mkfs.ext4".into(), r.mkfs_command.clone()));
        p.comparisons.push(target(
            cmp("build time", "s", Better::Lower, ("tessera build", r.tessera), ("mkfs.ext4 -d", r.mkfs)),
            "≤ 0.5×",
        ));
        Ok(())
    }

    fn oci(&self, p: &mut Part) -> Result<()> {
        let opts = bench_oci::OciBench {
            runs: if self.quick() { 3 } else { 5 },
            cold: false,
            tessera: Some(self.bin.clone()),
        };
        let r = bench_oci::measure(&opts)?;
        p.inputs.push(format!(
            "{}: {} gzip layers, {:.1} MB compressed; image {:.0} MiB, {} inodes; {} runs each, warm (blobs read once first)",
            r.source,
            r.layers,
            r.compressed_bytes as f64 / 1e6,
            mib(r.image_bytes),
            r.inodes,
            opts.runs
        ));
        p.commands.push((
            "tessera".into(),
            format!("{} build {} --store STORE [--reference-layers]", self.bin.display(), r.source),
        ));
        for (i, c) in r.peer_commands.iter().enumerate() {
            p.commands.push((format!("peer step {}", i + 1), c.clone()));
        }
        let peer = ("umoci unpack + mkfs.ext4 -d", r.peer.clone());
        p.comparisons.push(target(
            cmp(
                "first build (fresh store)",
                "s",
                Better::Lower,
                ("tessera build", r.tessera.clone()),
                peer.clone(),
            ),
            "≤ 0.25×",
        ));
        p.comparisons.push(cmp(
            "rebuild (same store, every blob there)",
            "s",
            Better::Lower,
            ("tessera build", r.rebuild.clone()),
            peer.clone(),
        ));
        p.comparisons.push(target(
            cmp(
                format!(
                    "rebuild after one new top layer ({:.1} MB compressed) into the store holding the base",
                    r.top_layer_compressed as f64 / 1e6
                ),
                "s",
                Better::Lower,
                ("tessera build", r.top_layer.clone()),
                ("umoci unpack + mkfs.ext4 -d of that image", r.top_layer_peer.clone()),
            ),
            "≤ 0.05×",
        ));
        p.comparisons.push(target(
            cmp(
                "--reference-layers build",
                "s",
                Better::Lower,
                ("tessera build --reference-layers", r.reference_layers.clone()),
                peer,
            ),
            "≤ 0.15×",
        ));
        p.figures.push(fig("tessera export of the built image (not in the ratio)", "s", r.export.clone()));
        p.figures.push(fig("umoci unpack", "s", r.umoci.clone()));
        p.figures.push(fig("mkfs.ext4 -d of the unpacked rootfs", "s", r.mkfs.clone()));
        p.figures.push(fig(
            "--reference-layers: store besides the layer blobs, % of the compressed layers (target ≤ 5%)",
            "%",
            vec![100.0 * r.reference_extra_bytes as f64 / r.compressed_bytes.max(1) as f64],
        ));
        Ok(())
    }

    fn serve(&self, p: &mut Part) -> Result<()> {
        let quick = self.quick();
        let opts = bench_serve::ServeBench {
            files: None,
            secs: if quick { 1.0 } else { 2.0 },
            rounds: if quick { 2 } else { 3 },
            layout: "both".into(),
            mem_cache: "auto".into(),
            baseline: None,
            tessera: vec!["default".into()],
            qsd: vec!["tuned".into(), "defaults".into()],
            queue_size: None,
            client_poll: false,
            check: "sample".into(),
            queues: if quick { vec![1, 2] } else { vec![1, 2, 4] },
            allow_small_span: false,
            no_writes: false,
            bin: Some(self.bin.clone()),
            qd: if quick { vec![1, 16, 32] } else { vec![1, 4, 16, 32, 64] },
        };
        let r = bench_serve::measure(&opts)?;
        p.inputs.push(format!(
            "`generate_bench_tree` with {} files: {:.0} MiB device; random 4 KiB reads uniformly over the {:.0} MiB \
             file-data region, 1 MiB sequential reads through it ({:.1}× the {:.0} MiB last-level cache), after one \
             warm pass; {:.0} s per measurement, {} rounds, the first daemon rotating",
            r.files,
            mib(r.device_bytes),
            mib(r.span_bytes),
            r.span_bytes as f64 / r.llc_bytes.max(1) as f64,
            mib(r.llc_bytes),
            opts.secs,
            opts.rounds
        ));
        p.inputs.push(
            "the same client for every daemon: `crates/vhost/examples/blkbench.rs` (libblkio), checking the bytes \
             read against the raw export; everything at nice -20"
                .into(),
        );
        p.commands.extend(r.commands.iter().cloned());
        p.commands.push(("fio".into(), r.fio_command.clone()));
        let get = |l: &bench_serve::LayoutRun, daemon: &str, key: &str| -> Vec<f64> {
            l.rounds.iter().filter_map(|round| round.get(daemon).and_then(|f| f.get(key)).copied()).collect()
        };
        let mut keys: Vec<(String, String, &str, Better)> = vec![
            ("4 KiB random read QD1".into(), "randread4k_qd1.iops".into(), "IOPS", Better::Higher),
            ("4 KiB random read QD32".into(), "randread4k_qd32.iops".into(), "IOPS", Better::Higher),
            ("1 MiB sequential read QD1".into(), "seqread1m_qd1.mbps".into(), "MB/s", Better::Higher),
            ("1 MiB sequential read QD8".into(), "seqread1m_qd8.mbps".into(), "MB/s", Better::Higher),
        ];
        for &q in opts.queues.iter().filter(|&&q| q > 1) {
            keys.push((
                format!("4 KiB random read, {q} queues × QD32"),
                format!("randread4k_qd32_q{q}.iops"),
                "IOPS",
                Better::Higher,
            ));
        }
        keys.push(("4 KiB random read QD1, p50".into(), "randread4k_qd1.p50_us".into(), "µs", Better::Lower));
        keys.push(("4 KiB random read QD1, p99".into(), "randread4k_qd1.p99_us".into(), "µs", Better::Lower));
        keys.push(("4 KiB write + FLUSH, p99".into(), "write4k_flush.p99_us".into(), "µs", Better::Lower));
        for l in &r.layouts {
            let where_ = format!("layout {} (client CPU {}, daemon CPU {})", l.name, l.client, l.daemon);
            for peer in r.names.iter().filter(|n| n.starts_with("qsd ")) {
                for (what, key, unit, better) in &keys {
                    let mut c = cmp(
                        format!("{what}, {where_}"),
                        unit,
                        *better,
                        ("tessera", get(l, "tessera", key)),
                        (peer, get(l, peer, key)),
                    );
                    if c.ours.values.is_empty() || c.peer.values.is_empty() {
                        continue;
                    }
                    if peer == "qsd tuned" {
                        match key.as_str() {
                            "randread4k_qd1.iops" => c.target = Some("≥ 2×".into()),
                            "randread4k_qd32.iops" => {
                                c.target = Some(if l.name == "split" { "≥ 2.5×" } else { "≥ 4×" }.into())
                            }
                            _ => {}
                        }
                    }
                    p.comparisons.push(c);
                }
            }
            let fio = get(l, bench_serve::FIO, bench_serve::FIO_P99);
            if !fio.is_empty() {
                p.comparisons.push(target(
                    cmp(
                        format!(
                            "4 KiB write + FLUSH p99 vs fio fdatasync p99 (fio in the same round), {where_}"
                        ),
                        "µs",
                        Better::Lower,
                        ("tessera", get(l, "tessera", "write4k_flush.p99_us")),
                        ("fio fdatasync", fio),
                    ),
                    "≤ 2×",
                ));
            }
            // The floor of a QD1 read in this layout, and each daemon's time per QD1 request
            // above it (round by round: the floor moves with the machine's moment).
            let floor: Vec<f64> =
                get(l, bench_serve::WAKEUP, "wakeup.iops").iter().map(|r| 1e6 / r).collect();
            if !floor.is_empty() {
                p.figures.push(fig(
                    format!(
                        "4 KiB QD1 floor: an empty request's round trip (`blkbench wakeup`: a client blocking \
                         for its completion, a peer polling on the daemon's CPU), {where_}"
                    ),
                    "µs",
                    floor.clone(),
                ));
                let above = |daemon: &str| -> Vec<f64> {
                    get(l, daemon, "randread4k_qd1.iops")
                        .iter()
                        .zip(&floor)
                        .map(|(r, f)| 1e6 / r - f)
                        .collect()
                };
                if let Some(peer) = r.names.iter().find(|n| *n == "qsd tuned") {
                    p.comparisons.push(cmp(
                        format!("4 KiB random read QD1, time per request above the floor, {where_}"),
                        "µs",
                        Better::Lower,
                        ("tessera", above("tessera")),
                        (peer, above(peer)),
                    ));
                }
            }
            let memcpy = get(l, "memcpy", "memcpy1m.mbps");
            p.comparisons.push(target(
                cmp(
                    format!("1 MiB QD8 read vs a single-thread 1 MiB memcpy (the bound), {where_}"),
                    "MB/s",
                    Better::Higher,
                    ("tessera", get(l, "tessera", "seqread1m_qd8.mbps")),
                    ("memcpy", memcpy),
                ),
                "≥ 0.9×",
            ));
            // Plots: the latency CDF at QD1, IOPS vs queue depth and vs queues.
            let pcts = [
                ("p1", 0.01),
                ("p10", 0.10),
                ("p25", 0.25),
                ("p50", 0.50),
                ("p75", 0.75),
                ("p90", 0.90),
                ("p95", 0.95),
                ("p99", 0.99),
                ("p999", 0.999),
            ];
            let med = |d: &str, key: String| median(&get(l, d, &key));
            let curves = |f: &dyn Fn(&str) -> Vec<(f64, f64)>| -> Vec<Series> {
                r.names.iter().map(|d| series(d, f(d), true)).collect()
            };
            let qd32 = |q: u16| {
                if q > 1 {
                    format!("randread4k_qd32_q{q}.iops")
                } else {
                    "randread4k_qd32.iops".into()
                }
            };
            let plots = [
                (
                    "latency-cdf",
                    "4 KiB random read QD1 latency CDF",
                    "latency, µs (log)",
                    "share of requests",
                    true,
                    curves(&|d| {
                        pcts.iter().map(|(k, f)| (med(d, format!("randread4k_qd1.{k}_us")), *f)).collect()
                    }),
                ),
                (
                    "iops-qd",
                    "4 KiB random read IOPS vs queue depth (one queue)",
                    "queue depth (log)",
                    "IOPS",
                    true,
                    curves(&|d| {
                        opts.qd
                            .iter()
                            .map(|&q| (f64::from(q), med(d, format!("randread4k_qd{q}.iops"))))
                            .collect()
                    }),
                ),
                (
                    "iops-queues",
                    "4 KiB random read IOPS vs queues (QD32 each)",
                    "queues",
                    "IOPS",
                    false,
                    curves(&|d| opts.queues.iter().map(|&q| (f64::from(q), med(d, qd32(q)))).collect()),
                ),
            ];
            for (id, title, x, y, x_log, curves) in plots {
                p.plots.push(plot_of(
                    Plotted {
                        id: format!("serve-{id}-{}", l.name),
                        title: format!("{title}, layout {}", l.name),
                        x,
                        y,
                        x_log,
                        y_log: false,
                        categories: vec![],
                    },
                    curves,
                ));
            }
        }
        let fio = |key: &str| -> Vec<f64> {
            r.layouts.iter().flat_map(|l| get(l, bench_serve::FIO, key)).collect()
        };
        if r.fio.is_some() {
            p.figures.push(fig(
                "fio fdatasync p50 (same disk, every round)",
                "µs",
                fio(bench_serve::FIO_P50),
            ));
            p.figures.push(fig(
                "fio fdatasync p99 (same disk, every round)",
                "µs",
                fio(bench_serve::FIO_P99),
            ));
        }
        Ok(())
    }

    fn lazy_opts(&self, prepare_only: bool) -> bench_lazy::LazyBench {
        let quick = self.quick() || prepare_only;
        bench_lazy::LazyBench {
            rtt_ms: 20,
            mbit: if quick { vec![200] } else { vec![200, 1000] },
            rounds: if quick { 2 } else { 3 },
            workload: if quick { vec!["python".into()] } else { vec![] },
            quick: false,
            data_percent: 10,
            prepare_only,
            no_peers: false,
            serve_arg: vec![],
            tessera: Some(self.bin.clone()),
            no_pin: false,
            no_slow_start: false,
        }
    }

    fn keep_prepared(&mut self, r: &bench_lazy::LazyResult) {
        if let Some(w) = r.workloads.iter().find(|w| w.name == "python").or(r.workloads.first()) {
            self.prepared = Some(Prepared { store: r.store.clone(), trace: w.requests.clone() });
        }
    }

    fn lazy(&mut self, p: &mut Part) -> Result<()> {
        let opts = self.lazy_opts(false);
        let r = bench_lazy::measure(&opts)?;
        self.keep_prepared(&r);
        p.inputs.push(format!(
            "image {}: Debian bookworm minbase plus the workloads' package set; {} files, {:.0} MiB of file data, \
             device {:.0} MiB; stored {:.0} MiB (tessera), OCI layers {:.0} MiB (gzip), raw export {:.0} MiB (zstd -3)",
            r.image_id,
            r.files,
            mib(r.data_bytes),
            mib(r.device_bytes),
            mib(r.stored_bytes),
            mib(r.layer_bytes),
            mib(r.zst_bytes)
        ));
        for w in &r.workloads {
            p.inputs.push(format!(
                "workload {}: {} reads, {:.1} MiB (recorded once in the guest under TCG, {:.1} s; replayed on the host)",
                w.name,
                w.reads,
                mib(w.read_bytes),
                w.guest_secs
            ));
        }
        p.inputs.push(format!(
            "link: {} ms RTT at {} Mbit/s (the latency proxy in front of nginx and the registry); {} round(s); \
             every time from nothing local to the workload's last request",
            r.rtt_ms,
            r.rates.iter().map(|x| x.mbit.to_string()).collect::<Vec<_>>().join(" and "),
            r.rounds
        ));
        p.commands.push((
            "tessera".into(),
            format!(
                "{} serve bench --store URL --socket SOCK --read-only [--cache-dir DIR]",
                self.bin.display()
            ),
        ));
        p.commands.push((
            "peer (a) OCI".into(),
            "skopeo copy docker://REGISTRY/pkgset:bench oci:LAYOUT:bench; umoci unpack --image LAYOUT:bench BUNDLE; \
             mkfs.ext4 -q -F -d BUNDLE/rootfs image.ext4; qemu-storage-daemon (vhost-user-blk, read-only)"
                .into(),
        ));
        p.commands.push((
            "peer (b) zstd raw".into(),
            "curl -sS --fail URL/image.raw.zst | zstd -d -q -f -o image.raw; qemu-storage-daemon (vhost-user-blk, read-only)".into(),
        ));
        let secs = |v: &[tessera_e2e::floor::Breakdown]| -> Vec<f64> {
            v.iter().map(|b| b.total().as_secs_f64()).collect()
        };
        for rate in &r.rates {
            let cats: Vec<String> = r.workloads.iter().map(|w| w.name.clone()).collect();
            let mut ready: Vec<(&str, Vec<(f64, f64)>)> = [
                "cold",
                "profile",
                "warmed cache",
                "local store",
                "peer (a) OCI",
                "peer (b) zstd raw",
                "link floor",
            ]
            .iter()
            .map(|n| (*n, Vec::new()))
            .collect();
            let mut bytes: Vec<(&str, Vec<(f64, f64)>)> =
                ["cold", "profile", "link floor"].iter().map(|n| (*n, Vec::new())).collect();
            for (i, (w, row)) in r.workloads.iter().zip(&rate.rows).enumerate() {
                let faster: Vec<f64> = row.peer_a.iter().zip(&row.peer_b).map(|(a, b)| a.min(*b)).collect();
                let at = format!("{}, {} Mbit/s", w.name, rate.mbit);
                // Issue 15's targets: the whole-file workload has its own; the eager-peer
                // ratios are set at 200 Mbit/s.
                let whole_files = w.name == "data";
                for (label, v) in [
                    ("cold", secs(&row.cold)),
                    ("profile", secs(&row.profile)),
                    ("warmed cache", row.warm.clone()),
                ] {
                    let c = cmp(
                        format!("time to ready, {at}: {label} vs the faster eager peer"),
                        "s",
                        Better::Lower,
                        (&format!("tessera {label}"), v),
                        ("faster peer", faster.clone()),
                    );
                    p.comparisons.push(match (label, rate.mbit) {
                        ("cold", 200) => target(c, if whole_files { "≤ 0.25×" } else { "≤ 0.1×" }),
                        _ => c,
                    });
                }
                if rate.mbit == 200 && !row.reference.is_empty() {
                    // Issue 12: an image served from its original gzip layers.
                    p.comparisons.push(target(
                        cmp(
                            format!("time to ready, {at}: cold, the --reference-layers image vs the converted one"),
                            "s",
                            Better::Lower,
                            ("tessera cold, --reference-layers", secs(&row.reference)),
                            ("tessera cold, converted", secs(&row.cold)),
                        ),
                        "≤ 1.3×",
                    ));
                }
                if let Some(f) = row.floor {
                    // Cold against the floor; with a profile too, except for the whole files.
                    let mut floor_rows =
                        vec![("cold", &row.cold, if whole_files { "≤ 1.5×" } else { "≤ 3×" })];
                    if !whole_files {
                        floor_rows.push(("profile", &row.profile, "≤ 1.5×"));
                    }
                    for (label, runs, goal) in floor_rows {
                        p.comparisons.push(target(
                            cmp(
                                format!("time to ready, {at}: {label} vs the link floor"),
                                "s",
                                Better::Lower,
                                (&format!("tessera {label}"), secs(runs)),
                                ("floor", vec![f.time().as_secs_f64()]),
                            ),
                            goal,
                        ));
                    }
                    p.comparisons.push(target(
                        cmp(
                            format!("origin bytes, {at}: cold vs the floor's bytes"),
                            "MiB",
                            Better::Lower,
                            ("tessera cold", row.cold.iter().map(|b| mib(b.origin_bytes)).collect()),
                            ("floor", vec![mib(f.bytes())]),
                        ),
                        "≤ 1.5×",
                    ));
                    ready[6].1.push((i as f64, f.time().as_secs_f64()));
                    let x = mib(w.read_bytes);
                    bytes[0]
                        .1
                        .push((x, median(&row.cold.iter().map(|b| mib(b.origin_bytes)).collect::<Vec<_>>())));
                    bytes[1].1.push((
                        x,
                        median(&row.profile.iter().map(|b| mib(b.origin_bytes)).collect::<Vec<_>>()),
                    ));
                    bytes[2].1.push((x, mib(f.bytes())));
                }
                p.figures.push(fig(format!("local store, {at}"), "s", row.local.clone()));
                p.figures.push(fig(format!("peer (a) OCI, {at}"), "s", row.peer_a.clone()));
                p.figures.push(fig(format!("peer (b) zstd raw, {at}"), "s", row.peer_b.clone()));
                for (k, v) in [
                    (0, secs(&row.cold)),
                    (1, secs(&row.profile)),
                    (2, row.warm.clone()),
                    (3, row.local.clone()),
                    (4, row.peer_a.clone()),
                    (5, row.peer_b.clone()),
                ] {
                    ready[k].1.push((i as f64, median(&v)));
                }
            }
            for (name, preps) in
                [("peer (a) preparation", &rate.preps_a), ("peer (b) preparation", &rate.preps_b)]
            {
                if let Some(first) = preps.first() {
                    for (k, (step, _)) in first.steps.iter().enumerate() {
                        p.figures.push(fig(
                            format!("{name} at {} Mbit/s: {step}", rate.mbit),
                            "s",
                            preps.iter().filter_map(|x| x.steps.get(k).map(|s| s.1)).collect(),
                        ));
                    }
                }
            }
            p.plots.push(plot_of(
                Plotted {
                    id: format!("lazy-time-to-ready-{}mbit", rate.mbit),
                    title: format!(
                        "Time to ready per workload, {} ms RTT, {} Mbit/s (medians)",
                        r.rtt_ms, rate.mbit
                    ),
                    x: "workload",
                    y: "seconds (log)",
                    x_log: false,
                    y_log: true,
                    categories: cats,
                },
                ready.into_iter().map(|(l, pts)| series(l, pts, false)).collect(),
            ));
            p.plots.push(plot_of(
                Plotted {
                    id: format!("lazy-origin-bytes-{}mbit", rate.mbit),
                    title: format!("Origin bytes vs bytes the workload read, {} Mbit/s (medians)", rate.mbit),
                    x: "bytes read by the workload, MiB (log)",
                    y: "bytes from the origin, MiB (log)",
                    x_log: true,
                    y_log: true,
                    categories: vec![],
                },
                bytes.into_iter().map(|(l, pts)| series(l, pts, false)).collect(),
            ));
        }
        Ok(())
    }

    fn cold(&mut self, p: &mut Part) -> Result<()> {
        if self.prepared.is_none() {
            let r = bench_lazy::measure(&self.lazy_opts(true))?;
            self.keep_prepared(&r);
        }
        let prepared = self.prepared.as_ref().context("the lazy bench prepared no workload")?;
        let quick = self.quick();
        let opts = bench_cold::ColdBench {
            store: prepared.store.clone(),
            image: "bench".into(),
            trace: prepared.trace.clone(),
            raw: None,
            rtt_ms: 20,
            mbit: 200,
            rounds: if quick { 2 } else { 3 },
            arm: vec![],
            bin: Some(self.bin.clone()),
            daemons: if quick { vec![4] } else { vec![2, 4, 8] },
            shared_cache: true,
            tls: false,
            // N daemons at once share the machine as they would a host: none is pinned.
            no_pin: true,
            no_slow_start: false,
            requests: false,
        };
        let r = bench_cold::measure(&opts)?;
        let floor = r.floor;
        p.inputs.push(format!(
            "the lazy bench's image (store {}) and its workload trace {}: floor {} chunks, {:.1} MiB, {:.0} ms at \
             {} ms RTT and {} Mbit/s; {} rounds; every daemon fresh (no cache), `--read-only`; the N-daemon rows \
             again with the N daemons sharing one host disk cache (`--cache-dir`, empty at each round's start)",
            opts.store.display(),
            opts.trace.display(),
            floor.chunks,
            mib(floor.bytes()),
            floor.time().as_secs_f64() * 1e3,
            opts.rtt_ms,
            opts.mbit,
            opts.rounds
        ));
        p.commands.push((
            "tessera".into(),
            format!("{} serve bench --store URL --socket SOCK --read-only", self.bin.display()),
        ));
        let single: Vec<f64> = r
            .arms
            .first()
            .map(|(_, b)| b.iter().map(|x| x.total().as_secs_f64()).collect())
            .unwrap_or_default();
        if let Some((_, runs)) = r.arms.first() {
            p.comparisons.push(cmp(
                "one cold daemon: start to the last request vs the link floor",
                "s",
                Better::Lower,
                ("tessera", single.clone()),
                ("floor", vec![floor.time().as_secs_f64()]),
            ));
            p.comparisons.push(cmp(
                "one cold daemon: origin bytes vs the floor's bytes",
                "MiB",
                Better::Lower,
                ("tessera", runs.iter().map(|b| mib(b.origin_bytes)).collect()),
                ("floor", vec![mib(floor.bytes())]),
            ));
            p.figures.push(fig(
                "one cold daemon: start (spawn to ready)",
                "ms",
                runs.iter().map(|b| b.start.as_secs_f64() * 1e3).collect(),
            ));
        }
        let mut pts = vec![(1.0, median(&single))];
        let mut shared_pts = vec![(1.0, median(&single))];
        for c in &r.concurrent {
            let (who, cache) = if c.shared_cache {
                (format!("{} daemons, one cache", c.daemons), ", one shared disk cache")
            } else {
                (format!("{} daemons", c.daemons), "")
            };
            p.comparisons.push(cmp(
                format!("{} daemons at once{cache}: until the last is done vs one daemon", c.daemons),
                "s",
                Better::Lower,
                (&who, c.wall.clone()),
                ("one daemon", single.clone()),
            ));
            // Without a shared cache each daemon fetches what it needs; with one, each chunk
            // should cross the link once for all of them.
            let (peer, floor_bytes) = if c.shared_cache {
                ("floor (once)", mib(floor.bytes()))
            } else {
                ("floor × N", mib(floor.bytes()) * c.daemons as f64)
            };
            p.comparisons.push(cmp(
                format!(
                    "{} daemons at once{cache}: origin bytes vs the floor's bytes{}",
                    c.daemons,
                    if c.shared_cache { "" } else { " × N" }
                ),
                "MiB",
                Better::Lower,
                (&who, c.origin_bytes.iter().map(|&b| mib(b)).collect()),
                (peer, vec![floor_bytes]),
            ));
            if c.shared_cache {
                shared_pts.push((c.daemons as f64, median(&c.wall)));
            } else {
                pts.push((c.daemons as f64, median(&c.wall)));
            }
        }
        p.plots.push(plot_of(
            Plotted {
                id: "cold-daemons".into(),
                title: "N cold daemons of one image at once: until the last is done (medians)".into(),
                x: "daemons",
                y: "seconds",
                x_log: false,
                y_log: false,
                categories: vec![],
            },
            vec![
                series("tessera serve, cold", pts, true),
                series("sharing one disk cache", shared_pts, true),
            ],
        ));
        Ok(())
    }

    fn scale(&self, p: &mut Part) -> Result<()> {
        let quick = self.quick();
        let opts = bench_scale::ScaleBench {
            million: false,
            entries: if quick { vec![1_000, 10_000] } else { vec![1_000, 10_000, 100_000, 1_000_000] },
            bin: Some(self.bin.clone()),
            no_large: quick,
            no_daemon: false,
            json: false,
            generate_only: None,
            daemon_every_size: true,
            data_gib: if quick { None } else { Some(5) },
        };
        let r = bench_scale::measure(&opts)?;
        p.inputs.push(format!(
            "generated trees (`tests/src/scale.rs`) of {} entries{}: mostly small files over a realistic directory \
             fan-out; one build of each into a fresh store, peak RSS (VmHWM) from GNU time; the daemon serving each \
             image from the local store, read-only",
            opts.entries.iter().map(|e| e.to_string()).collect::<Vec<_>>().join(", "),
            if opts.no_large { "" } else { " plus three large files (24, 40 and 64 MiB)" }
        ));
        if let Some(gib) = opts.data_gib {
            p.inputs.push(format!(
                "the data-size point: the {}-entry tree brought up to {gib} GiB of file data by incompressible 256 MiB files",
                opts.entries.first().copied().unwrap_or(1_000)
            ));
        }
        p.notes.push(
            "Targets (issue 16): build VmHWM ≤ 256 MiB up to 100 k entries and ≤ 512 B per entry beyond; daemon RSS \
             ≤ 64 MiB plus the memory-tier budget. One build per size: memory does not depend on load, times do."
                .into(),
        );
        let mut time = Vec::new();
        let mut hwm = Vec::new();
        for b in &r.runs {
            let e = b.tree.entries;
            p.figures.push(fig(
                format!("build, {e} entries ({:.0} MB of data): time", b.tree.bytes as f64 / 1e6),
                "s",
                vec![b.seconds],
            ));
            p.figures.push(fig(format!("build, {e} entries: VmHWM"), "MiB", vec![mib(b.peak)]));
            p.figures.push(fig(
                format!("build, {e} entries: VmHWM per entry"),
                "B",
                vec![b.peak as f64 / e.max(1) as f64],
            ));
            if !b.bulk {
                time.push((e as f64, b.seconds));
                hwm.push((e as f64, mib(b.peak)));
            }
        }
        // The target beyond 100 k entries is a slope: what each entry past 100 k adds to the peak.
        let at = |n: u64| r.runs.iter().find(|b| b.tree.entries == n);
        if let (Some(a), Some(b)) = (at(100_000), at(1_000_000)) {
            p.figures.push(fig(
                "build VmHWM per entry beyond 100 k: (peak at 1 M − peak at 100 k) / 900 k (target ≤ 512)",
                "B",
                vec![(b.peak as f64 - a.peak as f64) / 900_000.0],
            ));
        }
        let (mut started, mut after) = (Vec::new(), Vec::new());
        for (n, d) in &r.daemons {
            p.figures.push(fig(
                format!("daemon, {n}-entry image: VmRSS after start"),
                "MiB",
                vec![mib(d.started.0)],
            ));
            p.figures.push(fig(
                format!(
                    "daemon, {n}-entry image: VmRSS after reading all {:.1} MiB of metadata",
                    mib(d.metadata_bytes)
                ),
                "MiB",
                vec![mib(d.after.0)],
            ));
            started.push((*n as f64, mib(d.started.0)));
            after.push((*n as f64, mib(d.after.0)));
        }
        let axes = |id: &str, title: &str, y: &'static str| Plotted {
            id: id.into(),
            title: title.into(),
            x: "entries (log)",
            y,
            x_log: true,
            y_log: true,
            categories: vec![],
        };
        p.plots.push(plot_of(
            axes("scale-build-time", "tessera build: time vs entries", "seconds (log)"),
            vec![series("build time", time, true)],
        ));
        p.plots.push(plot_of(
            axes("scale-build-memory", "tessera build: peak RSS vs entries", "VmHWM, MiB (log)"),
            vec![series("VmHWM", hwm, true)],
        ));
        p.plots.push(plot_of(
            axes("scale-daemon-rss", "tessera serve: RSS vs image size", "VmRSS, MiB (log)"),
            vec![series("after start", started, true), series("after reading all metadata", after, true)],
        ));
        Ok(())
    }

    fn devices(&self, p: &mut Part) -> Result<()> {
        let quick = self.quick();
        let opts = bench_devices::DevicesBench {
            devices: if quick { vec![1, 4, 16] } else { vec![1, 2, 4, 8, 16, 32, 64] },
            rate: 1000,
            secs: if quick { 2.0 } else { 5.0 },
            rounds: if quick { 1 } else { 2 },
            files: 2000,
            bin: Some(self.bin.clone()),
            json: false,
        };
        let r = bench_devices::measure(&opts)?;
        p.inputs.push(format!(
            "the serve bench's generated tree of {} files ({:.0} MiB of file data), built into a local store; per \
             device one `tessera serve` (its own memory tier, warmed) and one libblkio client (`blkbench`) reading \
             4 KiB at random offsets of the data at QD1, {} reads/s (open loop: a late read's latency counts from \
             when it was due), all devices at once for {} s; {} round(s), every read checked against the raw export",
            opts.files,
            mib(r.span_bytes),
            opts.rate,
            opts.secs,
            opts.rounds
        ));
        p.commands.push((
            "tessera".into(),
            format!("{} serve IMAGE --store STORE --socket SOCK --mem-cache SIZE", self.bin.display()),
        ));
        p.commands.push((
            "client".into(),
            format!(
                "blkbench --socket SOCK --lo LO --hi HI --verify RAW --secs {} --rate {} randread:1",
                opts.secs, opts.rate
            ),
        ));
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let (mut p50s, mut p99s) = (Vec::new(), Vec::new());
        for &n in &opts.devices {
            let steps: Vec<&bench_devices::Step> =
                r.rounds.iter().flatten().filter(|s| s.devices == n).collect();
            let of = |f: fn(&bench_devices::Step) -> f64| steps.iter().map(|s| f(s)).collect::<Vec<f64>>();
            p.figures.push(fig(
                format!("{n} devices: p99 latency (median over the clients)"),
                "µs",
                of(bench_devices::Step::p99),
            ));
            p.figures.push(fig(
                format!("{n} devices: p50 latency (median over the clients)"),
                "µs",
                of(bench_devices::Step::p50),
            ));
            p.figures.push(fig(
                format!("{n} devices: reads done per second (offered {})", n as u64 * u64::from(opts.rate)),
                "1/s",
                of(bench_devices::Step::iops),
            ));
            p.figures.push(fig(
                format!("{n} devices: the daemons' CPU, share of the machine's {cores:.0} CPUs"),
                "%",
                steps.iter().map(|s| 100.0 * s.daemon_cpu / s.secs / cores).collect(),
            ));
            p50s.push((n as f64, median(&of(bench_devices::Step::p50))));
            p99s.push((n as f64, median(&of(bench_devices::Step::p99))));
        }
        p.notes.push(match bench_devices::doubling_point(&opts, &r) {
            Some(n) => format!(
                "The p99 latency at least doubles (against one device) from {n} devices on. The clients share the \
                 daemons' CPUs here (a VM's vCPUs would not), so this is a lower bound for a host whose guests run \
                 on other cores."
            ),
            None => format!(
                "The p99 latency does not double up to {} devices. The clients share the daemons' CPUs here (a VM's \
                 vCPUs would not).",
                opts.devices.iter().max().copied().unwrap_or(0)
            ),
        });
        p.plots.push(plot_of(
            Plotted {
                id: "devices-latency".into(),
                title: format!(
                    "Devices served at once, {} reads/s each: latency (medians over the clients)",
                    opts.rate
                ),
                x: "devices (log)",
                y: "µs (log)",
                x_log: true,
                y_log: true,
                categories: vec![],
            },
            vec![series("p50", p50s, true), series("p99", p99s, true)],
        ));
        Ok(())
    }

    fn mounts(&self, p: &mut Part) -> Result<()> {
        let mut opts =
            if self.quick() { bench_mounts::MountsBench::quick() } else { bench_mounts::MountsBench::full() };
        opts.bin = Some(self.bin.clone());
        let r = bench_mounts::measure(&opts)?;
        p.inputs.push(format!(
            "{} containers from one {}-layer image ({} files per layer), started one after the other, all alive, \
             then stopped; each timed from its start to its first read",
            r.containers, r.layers, r.files_per_layer
        ));
        let ms = |v: &[u64]| v.iter().map(|&n| n as f64 / 1e6).collect::<Vec<f64>>();
        let peers = [
            ("overlayfs (a directory per layer)", Some(&r.overlay)),
            ("overlayfs (a loop image per layer)", r.layer_images.as_ref()),
        ];
        for (name, side) in peers {
            match side {
                Some(Ok(s)) => {
                    p.comparisons.push(cmp(
                        format!("container start to its first read vs {name}, container by container in start order"),
                        "ms",
                        Better::Lower,
                        ("tessera serve", ms(&r.tessera.first_read_ns)),
                        (name, ms(&s.first_read_ns)),
                    ));
                    p.figures.push(fig(
                        format!("{name}: host mounts per container"),
                        "mounts",
                        vec![s.mounts_per_container as f64],
                    ));
                }
                Some(Err(e)) => p.notes.push(format!("{name}: not measured: {e}")),
                None => {}
            }
        }
        p.figures.push(fig(
            "tessera serve: host mounts per container",
            "mounts",
            vec![r.tessera.mounts_per_container as f64],
        ));
        p.figures.push(fig(
            format!("tessera serve: the {} daemons' RSS, each", r.containers),
            "MiB",
            vec![mib(r.tessera_rss_total) / r.containers.max(1) as f64],
        ));
        p.notes.push(format!("The bench's own table:\n\n```text\n{}```", r.table()));
        Ok(())
    }

    fn virtiofs(&self, p: &mut Part) -> Result<()> {
        let mut opts = if self.quick() {
            bench_virtiofs::VirtiofsBench::quick()
        } else {
            bench_virtiofs::VirtiofsBench::full()
        };
        opts.bin = Some(self.bin.clone());
        let r = bench_virtiofs::measure(&opts)?;
        p.inputs.push(format!(
            "tree {} ({} entries, {} files); untar of {} entries, {:.1} MB; {} round(s); the guest runs under TCG \
             (guest CPU work {:.0}× slower than on the host; guest clock {})",
            r.tree,
            r.entries,
            r.files,
            r.untar_entries,
            r.untar_bytes as f64 / 1e6,
            r.rounds,
            r.tcg_slowdown,
            r.clocksource
        ));
        p.commands.push(("virtiofsd".into(), r.virtiofsd_command.clone()));
        p.commands.push(("tessera".into(), r.tessera_command.clone()));
        let ms = |v: &[u64]| v.iter().map(|&n| n as f64 / 1e6).collect::<Vec<f64>>();
        for w in &r.workloads {
            p.comparisons.push(cmp(
                format!("{} ({} operations), in the guest", w.name, w.ops),
                "ms",
                Better::Lower,
                ("tessera (ext4 on vhost-user-blk)", ms(&w.tessera.op_ns)),
                ("virtio-fs", ms(&w.virtiofs.op_ns)),
            ));
        }
        p.notes.push(format!("The bench's own table:\n\n```text\n{}```", r.table()));
        Ok(())
    }

    fn boot_profile(&self, p: &mut Part) -> Result<()> {
        let opts = bench_warm::BootProfileBench {
            runs: if self.quick() { 2 } else { 3 },
            rtt_ms: 20,
            files: 40,
            read_files: 8,
            bin: Some(self.bin.clone()),
        };
        let r = bench_warm::measure(&opts)?;
        p.inputs.push(format!(
            "a busybox root with {} 1 MB files; the start-up reads {} of them; origin at {} ms RTT; {} runs; the \
             guest (QEMU, TCG) clock",
            opts.files, opts.read_files, opts.rtt_ms, opts.runs
        ));
        let s = |i: usize| r.seconds.get(i).cloned().unwrap_or_default();
        p.comparisons.push(target(
            cmp(
                "start-up: cold with the profile vs cold without",
                "s",
                Better::Lower,
                ("profile", s(2)),
                ("no profile", s(1)),
            ),
            "≤ 0.5×",
        ));
        p.comparisons.push(target(
            cmp(
                "start-up: warmed cache vs local store",
                "s",
                Better::Lower,
                ("warmed cache", s(3)),
                ("local store", s(0)),
            ),
            "≤ 1.10×",
        ));
        p.plots.push(plot_of(
            Plotted {
                id: "boot-profile".into(),
                title: "Guest start-up (TCG) from an origin 20 ms away (medians)".into(),
                x: "configuration",
                y: "seconds",
                x_log: false,
                y_log: false,
                categories: bench_warm::CONFIGS.iter().map(|c| c.to_string()).collect(),
            },
            vec![series("start-up", (0..4).map(|i| (i as f64, median(&s(i)))).collect(), false)],
        ));
        Ok(())
    }
}

/// Write the JSON, the plots and the generated section for `r` (every part so far).
/// Write the plots, the JSON file (`json`: not when only rendering again) and the page's
/// generated section.
fn write_outputs(o: &ReportBench, r: &mut Report, json_too: bool) -> Result<()> {
    let root = crate::workspace_root();
    let at = |p: &Path| if p.is_absolute() { p.to_path_buf() } else { root.join(p) };
    let (docs, json, plots) = (at(&o.docs), at(&o.json), at(&o.plots));
    std::fs::create_dir_all(&plots)?;
    // Plots first: one that cannot be drawn is dropped from the page, with a note.
    for part in &mut r.parts {
        let mut kept = Vec::new();
        for pl in std::mem::take(&mut part.plots) {
            match plot::render(&pl) {
                Ok(svg) => {
                    std::fs::write(plots.join(format!("{}.svg", pl.id)), svg)?;
                    kept.push(pl);
                }
                Err(e) => {
                    let note = format!("(plot not drawn: {e})");
                    if !part.notes.contains(&note) {
                        part.notes.push(note);
                    }
                }
            }
        }
        part.plots = kept;
    }
    if json_too {
        if let Some(dir) = json.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(&json, serde_json::to_string_pretty(r)? + "\n")
            .with_context(|| format!("{}", json.display()))?;
    }
    let rel = docs
        .parent()
        .and_then(|d| plots.strip_prefix(d).ok())
        .map_or(plots.display().to_string(), |p| p.display().to_string());
    let doc = std::fs::read_to_string(&docs).unwrap_or_default();
    let out = report::replace_generated(&doc, &report::render_markdown(r, &rel))
        .context(docs.display().to_string())?;
    std::fs::write(&docs, out).with_context(|| format!("{}", docs.display()))?;
    Ok(())
}

pub fn run(o: &ReportBench) -> Result<()> {
    if o.render {
        let json = crate::workspace_root().join(&o.json);
        let text = std::fs::read_to_string(&json).with_context(|| format!("{}", json.display()))?;
        let mut r: Report = serde_json::from_str(&text).with_context(|| format!("{}", json.display()))?;
        // The raw samples stay byte for byte (a float read back may print a last digit apart).
        return write_outputs(o, &mut r, false);
    }
    for n in &o.only {
        if !PARTS.iter().any(|(p, _)| p == n) {
            bail!("--only {n}: no such part ({})", PARTS.map(|p| p.0).join(", "));
        }
        if GUEST_PARTS.contains(&n.as_str()) && !o.guest {
            bail!("--only {n}: a guest part, run only with --guest");
        }
    }
    // The earlier report a run of some parts is merged into.
    let base: Option<Report> = if o.only.is_empty() || o.replace {
        None
    } else {
        let json = crate::workspace_root().join(&o.json);
        match std::fs::read_to_string(&json) {
            Ok(text) => Some(serde_json::from_str(&text).with_context(|| {
                format!("{}: cannot merge into this report (--replace starts afresh)", json.display())
            })?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).with_context(|| format!("{}", json.display())),
        }
    };
    crate::fixtures::require_root()?;
    let start = Instant::now();
    let started = output(Command::new("date").args(["-u", "+%FT%TZ"]));
    let bin = match &o.tessera {
        Some(b) => b.canonicalize().with_context(|| format!("--tessera {}", b.display()))?,
        None => {
            crate::status(crate::cargo().args(["build", "--release", "-p", "tessera-cli"]))?;
            crate::target_dir()?.join("release").join("tessera")
        }
    };
    let wants = |part: &str| if o.only.is_empty() { true } else { o.only.iter().any(|n| n == part) };
    if wants("serve") {
        // The serve part's client, built now so that its (release) build is not inside the
        // part's time and load figures.
        crate::status(crate::cargo().args([
            "build",
            "--release",
            "-p",
            "tessera-vhost",
            "--example",
            "blkbench",
        ]))?;
    }
    let mut command = "cargo xtask bench".to_owned();
    for (on, flag) in [(o.quick, "--quick"), (o.guest, "--guest")] {
        if on {
            command += &format!(" {flag}");
        }
    }
    if !o.only.is_empty() {
        command += &format!(" --only {}", o.only.join(","));
    }
    let mut r = Report {
        schema: report::SCHEMA,
        command,
        started,
        seconds: 0.0,
        quick: o.quick,
        machine: machine(&bin),
        parts: vec![],
    };
    let mut ctx = Ctx { o, bin, prepared: None };
    for (name, title) in PARTS {
        let wanted = if o.only.is_empty() {
            name != "boot-profile" || o.guest
        } else {
            o.only.iter().any(|n| n == name)
        };
        if !wanted {
            continue;
        }
        eprintln!("\n==== bench report: {name} ====");
        let mut p = Part {
            name: name.into(),
            title: title.into(),
            seconds: 0.0,
            load_before: loadavg(),
            load_after: [0.0; 3],
            inputs: vec![],
            commands: vec![],
            comparisons: vec![],
            figures: vec![],
            plots: vec![],
            notes: vec![],
            error: None,
            run: None,
        };
        let t = Instant::now();
        let res = match name {
            "build" => ctx.build(&mut p),
            "oci" => ctx.oci(&mut p),
            "serve" => ctx.serve(&mut p),
            "lazy" => ctx.lazy(&mut p),
            "cold" => ctx.cold(&mut p),
            "scale" => ctx.scale(&mut p),
            "devices" => ctx.devices(&mut p),
            "mounts" => ctx.mounts(&mut p),
            "boot-profile" => ctx.boot_profile(&mut p),
            _ => ctx.virtiofs(&mut p),
        };
        p.seconds = t.elapsed().as_secs_f64();
        p.load_after = loadavg();
        if let Err(e) = res {
            eprintln!("==== bench report: {name} FAILED: {e:#}");
            p.error = Some(format!("{e:#}"));
        }
        eprintln!("==== bench report: {name} took {:.0} s", p.seconds);
        r.parts.push(p);
        r.seconds = start.elapsed().as_secs_f64();
        match &base {
            Some(b) => write_outputs(o, &mut report::merge(b.clone(), &r, &PARTS.map(|p| p.0)), true)?,
            None => write_outputs(o, &mut r, true)?,
        }
    }
    let failed: Vec<&str> = r.parts.iter().filter(|p| p.error.is_some()).map(|p| p.name.as_str()).collect();
    eprintln!(
        "\n==== bench report: {} part(s) in {:.0} s; wrote {}, {} and {}",
        r.parts.len(),
        r.seconds,
        o.docs.display(),
        o.json.display(),
        o.plots.display()
    );
    if !failed.is_empty() {
        bail!("part(s) failed: {}", failed.join(", "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// docs/benchmarks.md has the generated section's markers once each, in order, so that a
    /// run replaces only that section.
    #[test]
    fn the_docs_page_has_the_generated_section() {
        let doc =
            std::fs::read_to_string(crate::workspace_root().join("docs/benchmarks.md")).expect("read docs");
        assert!(crate::report::replace_generated(&doc, "x").is_ok());
        assert_eq!(doc.matches(crate::report::BEGIN).count(), 1);
    }

    #[test]
    fn command_lines_read_as_a_shell_would_take_them() {
        let mut c = std::process::Command::new("mkfs.ext4");
        c.args(["-N", "9456", "-d", "/t/a b", "x'y", ""]);
        assert_eq!(crate::command_line(&c), r"mkfs.ext4 -N 9456 -d '/t/a b' 'x'\''y' ''");
    }
}
