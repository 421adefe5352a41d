//! `cargo xtask bench virtiofs`: the comparison that motivates the design (issue 16 point 3) —
//! the same metadata-heavy guest work over virtio-fs and over Tessera (ext4 on virtio-blk).
//!
//! One tree on both sides: the cached debootstrap minbase root (`tessera_e2e::debian`), or a
//! generated tree (`--entries N`, `tessera_e2e::scale`). Tessera serves it as the image built
//! from that tree (release `tessera build`, local store, `tessera serve` with its default
//! temporary overlay, so the guest can write). virtio-fs shares a fresh copy of the same tree
//! (`cp -a`, every round: the workloads change it) through virtiofsd (the Rust one, from the
//! crates registry, installed once per machine under `/var/cache/tessera-test/virtiofsd-VERSION`)
//! with the options its maintainers recommend for a read-mostly root that only this guest
//! changes (`--cache=always`: the guest keeps dentries, attributes and data without
//! revalidating; `--inode-file-handles=prefer`: no O_PATH descriptor held per inode;
//! `--thread-pool-size=0`: requests handled in the queue thread, no hand-off to a pool).
//!
//! In the guest (QEMU `microvm`, TCG — this host has no KVM for a stock kernel), after the
//! mount: the lists of every entry and every regular file are made, then each workload runs
//! with the guest's caches dropped before it (`echo 3 > /proc/sys/vm/drop_caches`: dentries and
//! inodes go, so virtio-fs must LOOKUP again and ext4 must read its metadata from the device;
//! the host's page cache stays warm on both sides) and is timed in the guest
//! (`/proc/timer_list`'s `now at`, ns), followed by a timed `sync`:
//!
//! - `find`: `find .` (readdir + lstat of every entry);
//! - `stat`: `stat -c %i` of every entry (the list made first, split in pieces of 4000 paths,
//!   one `stat` process per piece; busybox `xargs -0` mangles long lists in this guest);
//! - `walk` (`git status`-like): `head -c1` of every regular file the same way (stat, open and
//!   read of each file's first block);
//! - `chown`: `chown -R -h 1000:1000 .` (one lchown per entry);
//! - `untar`: `tar -xf` of a generated node_modules-like tarball (held in the initramfs, i.e.
//!   guest RAM) into a new directory of the mount.
//!
//! Per operation is the total divided by the entries the workload touches (a mean; forking a
//! timer per operation would cost more under TCG than the operation). Rounds interleave the two
//! sides (ABBA…), the figures are medians, the ratio's spread is over rounds. TCG's guest CPU
//! slowdown is measured too: the same busybox `sh` loop in the guest and on the host.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use serde_json::{json, Value};
use tessera_e2e::daemon::Daemon;
use tessera_e2e::guest::{self, Attach, GuestKit, Initramfs};
use tessera_e2e::prng::Prng;
use tessera_e2e::{debian, fixtures};

use super::bench_lazy::release_bench;
use super::median;

/// The virtiofsd release measured (the crates registry's `virtiofsd`).
pub const VIRTIOFSD_VERSION: &str = "1.14.0";
/// The virtio-fs tag the guest mounts.
const TAG: &str = "tessera-bench";
/// Iterations of the busybox `sh` loop that measures TCG's slowdown.
const CPU_LOOP: u32 = 20_000;

/// Options of `cargo xtask bench virtiofs`.
#[derive(Debug, Clone, Args)]
pub struct VirtiofsBench {
    /// Rounds; each boots one guest per side, sides interleaved.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Use a generated tree of this many entries instead of the debootstrap minbase root.
    #[arg(long)]
    pub entries: Option<u64>,
    /// Packages in the generated node_modules-like tarball (about 12 entries each).
    #[arg(long, default_value_t = 400)]
    pub packages: u32,
    /// Measure this `tessera` binary instead of building the release one.
    #[arg(long)]
    pub bin: Option<PathBuf>,
    /// Use this virtiofsd instead of the one installed from the crates registry.
    #[arg(long)]
    pub virtiofsd: Option<PathBuf>,
    /// Print the results as JSON on stdout (the table goes to stderr).
    #[arg(long)]
    pub json: bool,
}

// `full` and `quick` are for the aggregating `cargo xtask bench`, which builds its options itself.
#[allow(dead_code)]
impl VirtiofsBench {
    /// The full run: the minbase root, 3 rounds.
    pub fn full() -> Self {
        Self { rounds: 3, entries: None, packages: 400, bin: None, virtiofsd: None, json: false }
    }

    /// A quick run: a 3000-entry generated tree, a 100-package tarball, one round.
    pub fn quick() -> Self {
        Self { rounds: 1, entries: Some(3000), packages: 100, ..Self::full() }
    }
}

/// The guest workloads, in the order they run.
pub const WORKLOADS: &[&str] = &["find", "stat", "walk", "chown", "untar"];

/// One workload's samples on one side, one per round.
#[derive(Debug, Clone, Default)]
pub struct Samples {
    /// The workload's time in the guest, ns.
    pub op_ns: Vec<u64>,
    /// The `sync` after it, ns.
    pub sync_ns: Vec<u64>,
}

/// One workload on both sides.
#[derive(Debug, Clone)]
pub struct WorkloadResult {
    pub name: &'static str,
    /// Entries the workload touches (the per-operation divisor).
    pub ops: u64,
    pub tessera: Samples,
    pub virtiofs: Samples,
}

impl WorkloadResult {
    /// virtio-fs time / Tessera time of each round.
    pub fn ratios(&self) -> Vec<f64> {
        self.tessera
            .op_ns
            .iter()
            .zip(&self.virtiofs.op_ns)
            .map(|(&t, &v)| v as f64 / (t.max(1)) as f64)
            .collect()
    }
}

/// What `cargo xtask bench virtiofs` measured.
#[derive(Debug, Clone)]
pub struct VirtiofsReport {
    /// What the tree is (`debootstrap minbase bookworm` or `generated N entries`).
    pub tree: String,
    pub entries: u64,
    pub files: u64,
    pub untar_entries: u64,
    pub untar_bytes: u64,
    pub rounds: usize,
    pub workloads: Vec<WorkloadResult>,
    /// Guest (TCG) time / host time of the same busybox `sh` loop, median over boots.
    pub tcg_slowdown: f64,
    /// The guest's clocksource (its resolution bounds the timings': `refined-jiffies` is 4 ms).
    pub clocksource: String,
    pub virtiofsd_command: String,
    pub tessera_command: String,
    pub load_before: String,
    pub load_after: String,
    pub cores: usize,
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

fn med_u64(v: &[u64]) -> f64 {
    let mut f: Vec<f64> = v.iter().map(|&x| x as f64).collect();
    if f.is_empty() {
        return f64::NAN;
    }
    median(&mut f)
}

impl VirtiofsReport {
    /// The table `cargo xtask bench virtiofs` prints.
    pub fn table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "virtio-fs (virtiofsd {VIRTIOFSD_VERSION}) vs Tessera (ext4 on vhost-user-blk), guest under TCG \
             (guest CPU work {:.0}x slower than on the host; guest clock {}); tree: {} ({} entries, {} files); untar: {} entries, \
             {:.1} MB; {} round(s), medians; {} cores, load average before {} / after {}",
            self.tcg_slowdown,
            self.clocksource,
            self.tree,
            self.entries,
            self.files,
            self.untar_entries,
            self.untar_bytes as f64 / 1e6,
            self.rounds,
            self.cores,
            self.load_before,
            self.load_after
        );
        let _ = writeln!(
            t,
            "{:<7} {:>7} {:>12} {:>10} {:>12} {:>10} {:>8} {:>13} {:>15}",
            "work",
            "ops",
            "Tessera ms",
            "µs/op",
            "virtiofs ms",
            "µs/op",
            "ratio",
            "ratio range",
            "sync ms (T/V)"
        );
        for w in &self.workloads {
            let (tm, vm) = (med_u64(&w.tessera.op_ns), med_u64(&w.virtiofs.op_ns));
            let mut r = w.ratios();
            let (lo, hi) = (
                r.iter().copied().fold(f64::INFINITY, f64::min),
                r.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            );
            let rm = if r.is_empty() { f64::NAN } else { median(&mut r) };
            let per = |ns: f64| ns / 1e3 / w.ops.max(1) as f64;
            let _ = writeln!(
                t,
                "{:<7} {:>7} {:>12.1} {:>10.1} {:>12.1} {:>10.1} {:>7.2}x {:>13} {:>15}",
                w.name,
                w.ops,
                tm / 1e6,
                per(tm),
                vm / 1e6,
                per(vm),
                rm,
                format!("{lo:.2}-{hi:.2}"),
                format!("{:.0}/{:.0}", med_u64(&w.tessera.sync_ns) / 1e6, med_u64(&w.virtiofs.sync_ns) / 1e6),
            );
        }
        let _ = writeln!(t, "virtiofsd: {}", self.virtiofsd_command);
        let _ = writeln!(t, "tessera:   {}", self.tessera_command);
        t
    }

    /// The raw samples and the context, as JSON.
    pub fn json(&self) -> Value {
        let side = |s: &Samples| json!({"op_ns": s.op_ns, "sync_ns": s.sync_ns});
        json!({
            "bench": "virtiofs",
            "tree": self.tree,
            "entries": self.entries,
            "files": self.files,
            "untar_entries": self.untar_entries,
            "untar_bytes": self.untar_bytes,
            "rounds": self.rounds,
            "guest": "qemu microvm, TCG",
            "tcg_slowdown": self.tcg_slowdown,
            "guest_clocksource": self.clocksource,
            "virtiofsd_version": VIRTIOFSD_VERSION,
            "virtiofsd_command": self.virtiofsd_command,
            "tessera_command": self.tessera_command,
            "cores": self.cores,
            "load_average_before": self.load_before,
            "load_average_after": self.load_after,
            "workloads": self.workloads.iter().map(|w| json!({
                "name": w.name,
                "ops": w.ops,
                "tessera": side(&w.tessera),
                "virtiofs": side(&w.virtiofs),
                "ratio_per_round": w.ratios(),
            })).collect::<Vec<_>>(),
        })
    }
}

pub fn run(o: &VirtiofsBench) -> Result<()> {
    let r = measure(o)?;
    if o.json {
        eprint!("{}", r.table());
        println!("{}", serde_json::to_string_pretty(&r.json())?);
    } else {
        print!("{}", r.table());
    }
    Ok(())
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn sh(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("spawn {cmd:?}"))?;
    ensure!(out.status.success(), "{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

/// virtiofsd `VIRTIOFSD_VERSION`, installed once per machine with `cargo install --locked` under
/// `/var/cache/tessera-test/virtiofsd-VERSION` (it links libseccomp and libcap-ng: their Debian
/// -dev packages are installed first, as root, when missing).
pub fn virtiofsd() -> Result<PathBuf> {
    let root = debian::cache_root().join(format!("virtiofsd-{VIRTIOFSD_VERSION}"));
    let bin = root.join("bin/virtiofsd");
    if bin.is_file() {
        return Ok(bin);
    }
    let missing: Vec<&str> =
        ["libseccomp-dev", "libcap-ng-dev"].into_iter().filter(|p| !super::installed(p)).collect();
    if !missing.is_empty() {
        fixtures::require_root()?;
        super::apt_install(&missing)?;
    }
    eprintln!("installing virtiofsd {VIRTIOFSD_VERSION} into {} (once per machine)", root.display());
    super::status(
        Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
            .args(["install", "--locked", &format!("virtiofsd@{VIRTIOFSD_VERSION}"), "--root"])
            .arg(&root)
            .current_dir(debian::cache_root()),
    )?;
    ensure!(bin.is_file(), "cargo install left no {}", bin.display());
    Ok(bin)
}

/// The virtiofsd options (after `--socket-path` and `--shared-dir`).
const VIRTIOFSD_OPTS: &[&str] = &["--cache=always", "--inode-file-handles=prefer", "--thread-pool-size=0"];

/// A node_modules-like tree: `packages` packages, each with package.json, README.md, LICENSE,
/// index.js, a lib/ of 3–10 modules and, for one in four, a nested node_modules/ of one or two
/// small packages. Text content, 100 B – 8 KiB per file; the same tree every time.
fn node_modules(dest: &Path, packages: u32) -> Result<()> {
    let _ = std::fs::remove_dir_all(dest);
    let mut rng = Prng::from_label("bench-virtiofs-node-modules-v1");
    let root = dest.join("node_modules");
    let write = |p: &Path, rng: &mut Prng, lo: u64, hi: u64| -> Result<()> {
        let n = rng.range(lo, hi) as usize;
        std::fs::write(p, rng.text(n)).with_context(|| format!("write {}", p.display()))
    };
    for i in 0..packages {
        let pkg = root.join(format!("pkg-{i:04}"));
        std::fs::create_dir_all(pkg.join("lib"))?;
        write(&pkg.join("package.json"), &mut rng, 300, 900)?;
        write(&pkg.join("README.md"), &mut rng, 500, 8192)?;
        write(&pkg.join("LICENSE"), &mut rng, 1000, 1100)?;
        write(&pkg.join("index.js"), &mut rng, 100, 2000)?;
        for m in 0..rng.range(3, 11) {
            write(&pkg.join(format!("lib/mod{m}.js")), &mut rng, 200, 8192)?;
        }
        if rng.below(4) == 0 {
            for d in 0..rng.range(1, 3) {
                let dep = pkg.join(format!("node_modules/dep-{d}"));
                std::fs::create_dir_all(&dep)?;
                write(&dep.join("package.json"), &mut rng, 200, 600)?;
                write(&dep.join("index.js"), &mut rng, 100, 3000)?;
            }
        }
    }
    Ok(())
}

/// The guest script: mount, list, run every workload with caches dropped, print `BENCH-…` lines.
fn guest_script(mount: &str) -> String {
    format!(
        r#"if [ -r /proc/timer_list ]; then now() {{ sed -n '3{{s/[^0-9]//g;p;q}}' /proc/timer_list; }}
else now() {{ IFS=' ' read u r < /proc/uptime; echo $(( ${{u%.*}} * 1000000000 + 1${{u#*.}}0000000 - 1000000000 )); }}; fi
a=$(now); i=0; while [ $i -lt {CPU_LOOP} ]; do i=$((i+1)); done; b=$(now); echo "BENCH-CPU $((b-a))"
{mount} || {{ echo BENCH-MOUNT-FAILED; poweroff -f; }}
cd /mnt
find . > /tmp/all; find . -type f > /tmp/files
for l in all files; do awk -v p=/tmp/$l. '{{ print > (p int((NR - 1) / 4000)) }}' /tmp/$l; done
set -f; nl='
'; IFS=$nl
each() {{ list=$1; shift; set +f; chunks=$(ls /tmp/$list.*); set -f; [ -n "$chunks" ] || return 1
  for c in $chunks; do "$@" $(cat $c) || return; done; }}
echo "BENCH-CLOCK $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource)"
echo "BENCH-COUNT $(find . | wc -l) $(find . -type f | wc -l)"
mkdir /mnt/bench-untar
w() {{ name=$1; shift; sync; echo 3 > /proc/sys/vm/drop_caches; a=$(now); "$@" > /dev/null 2> /tmp/err; rc=$?; b=$(now); sync; c=$(now)
  echo "BENCH-OP $name $rc $((b-a)) $((c-b))"; [ $rc = 0 ] || head -5 /tmp/err; }}
w find find .
w stat each all stat -c %i
w walk each files head -c1
w chown chown -R -h 1000:1000 .
w untar tar -xf /bench/nm.tar -C /mnt/bench-untar
cd /
umount /mnt
echo BENCH-END"#
    )
}

/// One boot's figures.
#[derive(Debug)]
struct Boot {
    cpu_ns: u64,
    clock: String,
    entries: u64,
    files: u64,
    ops: Vec<(String, u64, u64)>,
}

fn parse_boot(log: &str) -> Result<Boot> {
    ensure!(!log.contains("BENCH-MOUNT-FAILED"), "the guest could not mount the tree:\n{log}");
    ensure!(log.contains("BENCH-END"), "the guest script did not finish:\n{log}");
    let field = |l: &str, i: usize| -> Result<u64> {
        l.split_whitespace()
            .nth(i)
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("unreadable line {l:?}"))
    };
    let mut b = Boot { cpu_ns: 0, clock: String::new(), entries: 0, files: 0, ops: Vec::new() };
    for l in log.lines().map(|l| l.trim_end_matches('\r')) {
        if l.starts_with("BENCH-CPU ") {
            b.cpu_ns = field(l, 1)?;
        } else if let Some(c) = l.strip_prefix("BENCH-CLOCK ") {
            c.trim().clone_into(&mut b.clock);
        } else if l.starts_with("BENCH-COUNT ") {
            b.entries = field(l, 1)?;
            b.files = field(l, 2)?;
        } else if l.starts_with("BENCH-OP ") {
            let name = l.split_whitespace().nth(1).unwrap_or_default().to_owned();
            let rc = field(l, 2)?;
            ensure!(rc == 0, "guest workload {name} failed (exit {rc}):\n{log}");
            b.ops.push((name, field(l, 3)?, field(l, 4)?));
        }
    }
    ensure!(
        b.ops.len() == WORKLOADS.len(),
        "expected {} workloads, got {:?}:\n{log}",
        WORKLOADS.len(),
        b.ops
    );
    Ok(b)
}

/// The same busybox `sh` loop on the host, ns (median of 3).
fn host_cpu_loop(busybox: &Path) -> Result<f64> {
    let mut v = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        sh(Command::new(busybox).args([
            "sh",
            "-c",
            &format!("i=0; while [ $i -lt {CPU_LOOP} ]; do i=$((i+1)); done"),
        ]))?;
        v.push(t.elapsed().as_nanos() as f64);
    }
    Ok(median(&mut v))
}

struct Virtiofsd {
    child: Child,
}

impl Drop for Virtiofsd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_virtiofsd(bin: &Path, socket: &Path, shared: &Path, log: &Path) -> Result<Virtiofsd> {
    let _ = std::fs::remove_file(socket);
    let child = Command::new(bin)
        .arg(format!("--socket-path={}", socket.display()))
        .arg(format!("--shared-dir={}", shared.display()))
        .args(VIRTIOFSD_OPTS)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log)?)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let mut d = Virtiofsd { child };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        if let Some(s) = d.child.try_wait()? {
            bail!("virtiofsd exited with {s}: {}", std::fs::read_to_string(log).unwrap_or_default());
        }
        ensure!(Instant::now() < deadline, "virtiofsd made no socket in 30 s");
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(d)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    Tessera,
    Virtiofs,
}

/// Run the comparison.
pub fn measure(o: &VirtiofsBench) -> Result<VirtiofsReport> {
    fixtures::require_root()?;
    ensure!(o.rounds >= 1, "--rounds must be at least 1");
    let load_before = loadavg();
    let (bin, work) = match &o.bin {
        Some(b) => (b.clone(), super::target_dir()?.join("bench-virtiofs")),
        None => release_bench("bench-virtiofs")?,
    };
    std::env::set_var("TESSERA_BIN", &bin);
    let vfsd = match &o.virtiofsd {
        Some(p) => p.clone(),
        None => virtiofsd()?,
    };
    let kit = guest::kit()?;
    let fs_kit: GuestKit = kit.with_virtiofs()?;
    std::fs::create_dir_all(&work)?;

    // The tree, made once per recipe.
    let tree = work.join("tree");
    let (recipe, tree_name) = match o.entries {
        Some(n) => {
            (format!("scale-tree v1 entries={n}"), format!("generated ({n} entries, tessera_e2e::scale)"))
        }
        None => {
            let tarball = debian::rootfs_tarball()?;
            (
                format!("debian {}", tarball.display()),
                format!("debootstrap --variant={} {}", debian::VARIANT, debian::SUITE),
            )
        }
    };
    let marker = work.join("tree.recipe");
    if std::fs::read_to_string(&marker).ok().as_deref() != Some(recipe.as_str()) {
        let _ = std::fs::remove_dir_all(&tree);
        let _ = std::fs::remove_file(&marker);
        eprintln!("==> preparing the tree: {tree_name}");
        match o.entries {
            Some(n) => {
                tessera_e2e::scale::generate_scale_tree(&tree, n, false)?;
            }
            None => {
                std::fs::create_dir_all(&tree)?;
                debian::extract(&debian::rootfs_tarball()?, &tree, &[])?;
            }
        }
        std::fs::write(&marker, &recipe)?;
    }
    // The image, built every run (seconds) by the binary measured, with inodes to spare for the
    // untar (the default keeps 25% of the used inodes free, at least 4096).
    let store = work.join("store");
    let _ = std::fs::remove_dir_all(&store);
    let inodes = walk_count(&tree)? + 20 * u64::from(o.packages) + 8192;
    let out = Command::new(&bin)
        .arg("build")
        .arg(&tree)
        .arg("--store")
        .arg(&store)
        .args(["--tag", "tree", "--inodes", &inodes.to_string()])
        .output()?;
    ensure!(out.status.success(), "tessera build: {}", String::from_utf8_lossy(&out.stderr));

    // The tarball to unpack.
    let nm = work.join("nm");
    node_modules(&nm, o.packages)?;
    let tarball = work.join("nm.tar");
    sh(Command::new("tar")
        .args([
            "--format=gnu",
            "--sort=name",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "--mtime=@1600000000",
            "-cf",
        ])
        .arg(&tarball)
        .arg("-C")
        .arg(&nm)
        .arg("node_modules"))?;
    let untar_entries = walk_count(&nm.join("node_modules"))? + 1;
    let untar_bytes = std::fs::metadata(&tarball)?.len();
    std::fs::remove_dir_all(&nm)?;

    let files = [("bench/nm.tar", tarball.as_path())];
    let blk_initrd = work.join("initramfs-blk.cpio");
    guest::initramfs_with(
        &kit,
        &Initramfs {
            script: &guest_script("mount -t ext4 /dev/vda /mnt"),
            wait_for_vda: true,
            files: &files,
        },
        &blk_initrd,
    )?;
    let fs_initrd = work.join("initramfs-fs.cpio");
    guest::initramfs_with(
        &fs_kit,
        &Initramfs {
            script: &guest_script(&format!("mount -t virtiofs {TAG} /mnt")),
            wait_for_vda: false,
            files: &files,
        },
        &fs_initrd,
    )?;

    let host_loop = host_cpu_loop(&kit.busybox)?;
    let mut samples: Vec<(Samples, Samples)> = vec![Default::default(); WORKLOADS.len()];
    let mut cpu = Vec::new();
    let mut counts = None;
    let mut clocksource = String::new();
    let timeout = Duration::from_secs(1800);
    for round in 0..o.rounds {
        let order =
            if round % 2 == 0 { [Side::Tessera, Side::Virtiofs] } else { [Side::Virtiofs, Side::Tessera] };
        for side in order {
            let t = Instant::now();
            let log = match side {
                Side::Tessera => {
                    let sock = work.join("blk.sock");
                    let d = Daemon::start("tree", &store, &sock, &[] as &[&str])?;
                    let log = guest::boot_attached(&kit, &blk_initrd, &Attach::Blk(&sock), &work, timeout);
                    d.stop()?;
                    log?
                }
                Side::Virtiofs => {
                    let shared = work.join("shared");
                    let _ = std::fs::remove_dir_all(&shared);
                    sh(Command::new("cp").arg("-a").arg(&tree).arg(&shared))?;
                    let sock = work.join("fs.sock");
                    let d = start_virtiofsd(&vfsd, &sock, &shared, &work.join("virtiofsd.log"))?;
                    let log = guest::boot_attached(
                        &fs_kit,
                        &fs_initrd,
                        &Attach::Fs { socket: &sock, tag: TAG },
                        &work,
                        timeout,
                    );
                    drop(d);
                    std::fs::remove_dir_all(&shared)?;
                    log?
                }
            };
            let b = parse_boot(&log)?;
            eprintln!(
                "round {}/{} {side:?}: {} in {:.0}s",
                round + 1,
                o.rounds,
                b.ops
                    .iter()
                    .map(|(n, op, _)| format!("{n} {:.0} ms", ms(*op)))
                    .collect::<Vec<_>>()
                    .join(", "),
                t.elapsed().as_secs_f64()
            );
            match counts {
                None => counts = Some((b.entries, b.files)),
                // The virtio-fs copy and the image hold the same tree; ext4 adds lost+found.
                Some((e, f)) => ensure!(
                    e.abs_diff(b.entries) <= 1 && f == b.files,
                    "the sides see different trees: {e}/{f} vs {}/{}",
                    b.entries,
                    b.files
                ),
            }
            cpu.push(b.cpu_ns as f64 / host_loop);
            clocksource = b.clock.clone();
            for (i, (name, op, sync)) in b.ops.iter().enumerate() {
                ensure!(name == WORKLOADS[i], "workload {i} is {name}, expected {}", WORKLOADS[i]);
                let s = if side == Side::Tessera { &mut samples[i].0 } else { &mut samples[i].1 };
                s.op_ns.push(*op);
                s.sync_ns.push(*sync);
            }
        }
    }
    let (entries, files_n) = counts.context("no rounds")?;
    let workloads = WORKLOADS
        .iter()
        .zip(samples)
        .map(|(&name, (tessera, virtiofs))| {
            let ops = match name {
                "walk" => files_n,
                "untar" => untar_entries,
                _ => entries,
            };
            WorkloadResult { name, ops, tessera, virtiofs }
        })
        .collect();
    Ok(VirtiofsReport {
        tree: tree_name,
        entries,
        files: files_n,
        untar_entries,
        untar_bytes,
        rounds: o.rounds,
        workloads,
        tcg_slowdown: median(&mut cpu),
        clocksource,
        virtiofsd_command: format!(
            "{} --socket-path=SOCKET --shared-dir=DIR {}",
            vfsd.display(),
            VIRTIOFSD_OPTS.join(" ")
        ),
        tessera_command: format!(
            "{} serve tree --store STORE --socket SOCKET (temporary overlay)",
            bin.display()
        ),
        load_before,
        load_after: loadavg(),
        cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
    })
}

/// Entries below `dir` (not counting `dir`).
fn walk_count(dir: &Path) -> Result<u64> {
    let mut n = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            n += 1;
            if e.file_type()?.is_dir() {
                stack.push(e.path());
            }
        }
    }
    Ok(n)
}
