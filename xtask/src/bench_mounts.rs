//! `cargo xtask bench mounts`: one image, one device, any layer count (issue 16 point 4) — the
//! host-side work of starting containers from a `--layers`-layer image (default 50), counted and
//! timed for `--containers` of them (default 100), all alive at once, then stopped:
//!
//! - **overlayfs root, as containerd's overlayfs snapshotter makes it**: every layer is a
//!   directory on the host (unpacked once, not timed); a container start is one
//!   `mount("overlay", …, "lowerdir=L50:…:L1,upperdir=…,workdir=…")` (mount(2) called directly,
//!   timed), plus a first read (open and read 4 KiB of a file of the lowest layer, looked up
//!   through every lower directory); its stop is one umount(2). So 2 host mount operations per
//!   container with directory layers.
//! - **overlayfs over a block image per layer** (`--layer-images`): each layer an ext4 image
//!   (`mkfs.ext4 -d`, made once, not timed); a start attaches each to a loop device and mounts it
//!   read-only, then mounts the overlay over the layer mounts, then the first read; a stop
//!   unmounts all and detaches the loop devices: 2 × (1 + 50 + 50) per container, the published
//!   20 200 for 100 containers. Containers one at a time.
//! - **Tessera**: the same layers as an OCI layout built once into one image (`tessera build
//!   oci:…`, not timed); a container start is one `tessera serve` (its default temporary overlay:
//!   the guest may write), timed from spawn to its `--ready-fd` line and then to the first read
//!   (block 0, the superblock a guest's mount reads first) through libblkio, the client of
//!   `cargo xtask bench serve`; its stop is SIGTERM until exit. No host mount at all: the guest
//!   mounts the device inside its VM.
//!
//! Starts are sequential (one after the other, each timed alone); the stops too. Figures are
//! per-start medians, 90th percentiles and maxima, and totals.

use std::ffi::CString;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use anyhow::{ensure, Context, Result};
use clap::Args;
use serde_json::{json, Value};
use tessera_e2e::daemon::BlkClient;
use tessera_e2e::fixtures;
use tessera_e2e::oci::{TarWriter, UmociImage};
use tessera_e2e::prng::Prng;

use super::bench_lazy::release_bench;
use super::median;

/// Options of `cargo xtask bench mounts`.
#[derive(Debug, Clone, Args)]
pub struct MountsBench {
    /// Layers of the image.
    #[arg(long, default_value_t = 50)]
    pub layers: usize,
    /// Containers started (all alive at once, then stopped).
    #[arg(long, default_value_t = 100)]
    pub containers: usize,
    /// Also measure the per-layer block image design: each layer an ext4 image on a loop device,
    /// mounted, then the overlay over the 50 mounts; containers one at a time (at most one
    /// container's loop devices exist at once).
    #[arg(long)]
    pub layer_images: bool,
    /// Measure this `tessera` binary instead of building the release one.
    #[arg(long)]
    pub bin: Option<PathBuf>,
    /// Print the results as JSON on stdout (the table goes to stderr).
    #[arg(long)]
    pub json: bool,
}

// `full` and `quick` are for the aggregating `cargo xtask bench`, which builds its options itself.
#[allow(dead_code)]
impl MountsBench {
    /// The full run: 50 layers, 100 containers.
    pub fn full() -> Self {
        Self { layers: 50, containers: 100, layer_images: true, bin: None, json: false }
    }

    /// A quick run: 50 layers, 20 containers.
    pub fn quick() -> Self {
        Self { containers: 20, ..Self::full() }
    }
}

/// Per-start timings of one side, ns (one entry per container, in start order).
#[derive(Debug, Clone, Default)]
pub struct Starts {
    /// Until the mount returned (overlayfs) / the daemon announced ready (Tessera).
    pub ready_ns: Vec<u64>,
    /// Until the first read completed (includes `ready_ns`).
    pub first_read_ns: Vec<u64>,
    /// The stop: umount(2) / SIGTERM until the daemon exited.
    pub stop_ns: Vec<u64>,
    /// Host mount operations per container start + stop.
    pub mounts_per_container: u64,
}

/// What `cargo xtask bench mounts` measured.
#[derive(Debug, Clone)]
pub struct MountsReport {
    pub layers: usize,
    pub containers: usize,
    pub files_per_layer: usize,
    /// The overlayfs side, or why it could not run (e.g. mount(2)'s error).
    pub overlay: std::result::Result<Starts, String>,
    /// The per-layer block image design (`--layer-images`), or why it could not run.
    pub layer_images: Option<std::result::Result<Starts, String>>,
    pub tessera: Starts,
    /// Resident memory of all Tessera daemons together with every container started, bytes.
    pub tessera_rss_total: u64,
    pub load_before: String,
    pub load_after: String,
    pub cores: usize,
}

fn pct(v: &[u64], p: f64) -> f64 {
    let mut s: Vec<u64> = v.to_vec();
    s.sort_unstable();
    if s.is_empty() {
        return f64::NAN;
    }
    let i = ((s.len() as f64 - 1.0) * p).round() as usize;
    s[i.min(s.len() - 1)] as f64
}

fn med(v: &[u64]) -> f64 {
    let mut f: Vec<f64> = v.iter().map(|&x| x as f64).collect();
    if f.is_empty() {
        return f64::NAN;
    }
    median(&mut f)
}

impl MountsReport {
    /// Host mount operations a per-layer block image design needs per container start + stop.
    pub fn per_layer_image_mounts(&self) -> u64 {
        2 * (1 + 2 * self.layers as u64)
    }

    /// The table `cargo xtask bench mounts` prints.
    pub fn table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "{} containers from one {}-layer image ({} files per layer), started one after the other, all alive, \
             then stopped; {} cores, load average before {} / after {}",
            self.containers, self.layers, self.files_per_layer, self.cores, self.load_before, self.load_after
        );
        let _ = writeln!(
            t,
            "{:<28} {:>11} {:>13} {:>13} {:>13} {:>13} {:>12} {:>10}",
            "",
            "host mounts",
            "ready ms p50",
            "+read ms p50",
            "+read ms p90",
            "+read ms max",
            "total s",
            "stop ms p50"
        );
        let row = |t: &mut String, name: &str, s: &Starts| {
            let _ = writeln!(
                t,
                "{:<28} {:>11} {:>13.2} {:>13.2} {:>13.2} {:>13.2} {:>12.2} {:>10.2}",
                name,
                s.mounts_per_container * self.containers as u64,
                med(&s.ready_ns) / 1e6,
                med(&s.first_read_ns) / 1e6,
                pct(&s.first_read_ns, 0.9) / 1e6,
                pct(&s.first_read_ns, 1.0) / 1e6,
                s.first_read_ns.iter().sum::<u64>() as f64 / 1e9,
                med(&s.stop_ns) / 1e6,
            );
        };
        match &self.overlay {
            Ok(s) => row(&mut t, "overlayfs (dir per layer)", s),
            Err(e) => {
                let _ = writeln!(t, "{:<28} not measured: {e}", "overlayfs (dir per layer)");
            }
        }
        match &self.layer_images {
            Some(Ok(s)) => row(&mut t, "overlayfs (loop image/layer)*", s),
            Some(Err(e)) => {
                let _ = writeln!(t, "{:<28} not measured: {e}", "overlayfs (loop image/layer)*");
            }
            None => {
                let _ = writeln!(
                    t,
                    "{:<28} {:>11} (not measured: --layer-images)",
                    "overlayfs (loop image/layer)*",
                    self.per_layer_image_mounts() * self.containers as u64,
                );
            }
        }
        row(&mut t, "tessera serve (one device)", &self.tessera);
        if self.layer_images.is_some() {
            let _ = writeln!(t, "* containers one at a time (at most one container's loop devices at once)");
        }
        let _ = writeln!(
            t,
            "tessera: {} daemons' RSS together {:.0} MiB ({:.1} MiB each)",
            self.containers,
            self.tessera_rss_total as f64 / f64::from(1 << 20),
            self.tessera_rss_total as f64 / f64::from(1 << 20) / self.containers.max(1) as f64
        );
        t
    }

    /// The raw samples and the context, as JSON.
    pub fn json(&self) -> Value {
        let side = |s: &Starts| {
            json!({
                "ready_ns": s.ready_ns, "first_read_ns": s.first_read_ns, "stop_ns": s.stop_ns,
                "mounts_per_container": s.mounts_per_container,
            })
        };
        json!({
            "bench": "mounts",
            "layers": self.layers,
            "containers": self.containers,
            "files_per_layer": self.files_per_layer,
            "overlay": match &self.overlay { Ok(s) => side(s), Err(e) => json!({"error": e}) },
            "layer_images": match &self.layer_images {
                Some(Ok(s)) => side(s),
                Some(Err(e)) => json!({"error": e}),
                None => Value::Null,
            },
            "tessera": side(&self.tessera),
            "tessera_rss_total_bytes": self.tessera_rss_total,
            "per_layer_image_mounts_per_container": self.per_layer_image_mounts(),
            "cores": self.cores,
            "load_average_before": self.load_before,
            "load_average_after": self.load_after,
        })
    }
}

pub fn run(o: &MountsBench) -> Result<()> {
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

const FILES_PER_LAYER: usize = 20;

/// Layer `i`'s entries: `etc/version` (every layer replaces it) and `lNN/fMM` files, 1–4 KiB of
/// text each; the same bytes every time.
fn layer_entries(i: usize) -> Vec<(String, Vec<u8>)> {
    let mut rng = Prng::from_label(&format!("bench-mounts-layer-{i}"));
    let mut v = vec![("etc/version".to_owned(), format!("layer {i}\n").into_bytes())];
    for f in 0..FILES_PER_LAYER {
        let n = rng.range(1024, 4096) as usize;
        v.push((format!("l{i:02}/f{f:02}"), rng.text(n)));
    }
    v
}

fn cstr(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes()).context("path with a NUL byte")
}

fn mount_overlay(target: &Path, opts: &str) -> std::io::Result<()> {
    let (src, fstype) = (c"overlay", c"overlay");
    let target = CString::new(target.as_os_str().as_bytes())?;
    let data = CString::new(opts)?;
    // SAFETY: every pointer is a NUL-terminated string that outlives the call.
    let r = unsafe { libc::mount(src.as_ptr(), target.as_ptr(), fstype.as_ptr(), 0, data.as_ptr().cast()) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn umount(target: &Path) -> Result<()> {
    let t = cstr(target)?;
    // SAFETY: a NUL-terminated path that outlives the call.
    let r = unsafe { libc::umount2(t.as_ptr(), 0) };
    ensure!(r == 0, "umount {}: {}", target.display(), std::io::Error::last_os_error());
    Ok(())
}

/// The overlayfs side: every container's overlay mounted, read, then unmounted.
fn overlay_side(
    dir: &Path,
    layers: &[PathBuf],
    containers: usize,
) -> Result<std::result::Result<Starts, String>> {
    // containerd lists the lower directories top first.
    let lower = layers.iter().rev().map(|p| p.display().to_string()).collect::<Vec<_>>().join(":");
    let probe = PathBuf::from("l00/f00");
    let mut s = Starts { mounts_per_container: 2, ..Default::default() };
    let mut mounted = Vec::new();
    let mut failure = None;
    for c in 0..containers {
        let base = dir.join(format!("c{c:03}"));
        let (upper, work, merged) = (base.join("upper"), base.join("work"), base.join("merged"));
        for d in [&upper, &work, &merged] {
            std::fs::create_dir_all(d)?;
        }
        let opts = format!("lowerdir={lower},upperdir={},workdir={}", upper.display(), work.display());
        let t = Instant::now();
        if let Err(e) = mount_overlay(&merged, &opts) {
            failure =
                Some(format!("mount(2) of an overlay of {} lower directories failed: {e}", layers.len()));
            break;
        }
        let ready = t.elapsed();
        mounted.push(merged.clone());
        let mut buf = vec![0u8; 4096];
        let n = std::fs::File::open(merged.join(&probe))?.read(&mut buf)?;
        ensure!(n > 0, "empty first read through the overlay");
        s.ready_ns.push(ready.as_nanos() as u64);
        s.first_read_ns.push(t.elapsed().as_nanos() as u64);
    }
    for m in &mounted {
        let t = Instant::now();
        umount(m)?;
        s.stop_ns.push(t.elapsed().as_nanos() as u64);
    }
    Ok(match failure {
        Some(e) => Err(e),
        None => Ok(s),
    })
}

// <linux/loop.h>
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LO_FLAGS_READ_ONLY: u32 = 1;

/// `struct loop_info64`.
#[repr(C)]
struct LoopInfo64 {
    device: u64,
    inode: u64,
    rdevice: u64,
    offset: u64,
    sizelimit: u64,
    number: u32,
    encrypt_type: u32,
    encrypt_key_size: u32,
    flags: u32,
    file_name: [u8; 64],
    crypt_name: [u8; 64],
    encrypt_key: [u8; 32],
    init: [u64; 2],
}

/// `struct loop_config`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

fn os_err(what: &str) -> anyhow::Error {
    anyhow::anyhow!("{what}: {}", std::io::Error::last_os_error())
}

/// Attach `image` read-only to a free loop device (LOOP_CTL_GET_FREE + LOOP_CONFIGURE): the
/// device's open descriptor and path.
fn loop_attach(control: &std::fs::File, image: &std::fs::File) -> Result<(std::fs::File, PathBuf)> {
    // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number.
    let n = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) };
    ensure!(n >= 0, os_err("LOOP_CTL_GET_FREE"));
    let path = PathBuf::from(format!("/dev/loop{n}"));
    let dev = std::fs::File::open(&path).with_context(|| format!("open {}", path.display()))?;
    let cfg = LoopConfig {
        fd: u32::try_from(image.as_raw_fd())?,
        block_size: 0,
        info: LoopInfo64 {
            device: 0,
            inode: 0,
            rdevice: 0,
            offset: 0,
            sizelimit: 0,
            number: 0,
            encrypt_type: 0,
            encrypt_key_size: 0,
            flags: LO_FLAGS_READ_ONLY,
            file_name: [0; 64],
            crypt_name: [0; 64],
            encrypt_key: [0; 32],
            init: [0; 2],
        },
        reserved: [0; 8],
    };
    // SAFETY: LOOP_CONFIGURE reads one `struct loop_config`, which `cfg` is (repr(C)) and
    // outlives the call.
    let r = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE, &cfg as *const LoopConfig) };
    ensure!(r == 0, os_err(&format!("LOOP_CONFIGURE {}", path.display())));
    Ok((dev, path))
}

fn mount_ro(source: &Path, target: &Path, fstype: &std::ffi::CStr) -> Result<()> {
    let (s, t) = (cstr(source)?, cstr(target)?);
    // SAFETY: NUL-terminated strings that outlive the call; no data argument.
    let r =
        unsafe { libc::mount(s.as_ptr(), t.as_ptr(), fstype.as_ptr(), libc::MS_RDONLY, std::ptr::null()) };
    ensure!(r == 0, os_err(&format!("mount {} on {}", source.display(), target.display())));
    Ok(())
}

/// The per-layer block image design: an ext4 image per layer (`mkfs.ext4 -d`, made once, not
/// timed); a container start attaches each to a loop device and mounts it read-only, then
/// mounts the overlay over the layer mounts; the stop unmounts the overlay and each layer and
/// detaches each loop device. Containers one at a time.
fn layer_image_side(
    dir: &Path,
    layers: &[PathBuf],
    containers: usize,
) -> Result<std::result::Result<Starts, String>> {
    std::fs::create_dir_all(dir)?;
    let mut images = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        let img = dir.join(format!("{i:02}.img"));
        let out = Command::new("mkfs.ext4")
            .args(["-q", "-F", "-b", "4096", "-N", "64", "-O", "^has_journal", "-d"])
            .arg(l)
            .arg(&img)
            .arg("1M")
            .output()
            .context("mkfs.ext4")?;
        ensure!(
            out.status.success(),
            "mkfs.ext4 -d {}: {}",
            l.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        images.push(std::fs::File::open(&img)?);
    }
    let control = match std::fs::OpenOptions::new().read(true).write(true).open("/dev/loop-control") {
        Ok(c) => c,
        Err(e) => return Ok(Err(format!("/dev/loop-control: {e}"))),
    };
    let mut s = Starts { mounts_per_container: 2 * (1 + 2 * layers.len() as u64), ..Default::default() };
    for c in 0..containers {
        let base = dir.join(format!("c{c:03}"));
        let mnts: Vec<PathBuf> = (0..layers.len()).map(|i| base.join(format!("{i:02}"))).collect();
        let (upper, work, merged) = (base.join("u"), base.join("w"), base.join("m"));
        for d in mnts.iter().chain([&upper, &work, &merged]) {
            std::fs::create_dir_all(d)?;
        }
        let t = Instant::now();
        let mut devs = Vec::new();
        for (img, mnt) in images.iter().zip(&mnts) {
            let (dev, path) = loop_attach(&control, img)?;
            mount_ro(&path, mnt, c"ext4")?;
            devs.push(dev);
        }
        let lower = mnts.iter().rev().map(|p| p.display().to_string()).collect::<Vec<_>>().join(":");
        let opts = format!("lowerdir={lower},upperdir={},workdir={}", upper.display(), work.display());
        if let Err(e) = mount_overlay(&merged, &opts) {
            return Ok(Err(format!(
                "mount(2) of the overlay over {} layer mounts failed: {e}",
                layers.len()
            )));
        }
        let ready = t.elapsed();
        let mut buf = vec![0u8; 4096];
        let n = std::fs::File::open(merged.join("l00/f00"))?.read(&mut buf)?;
        ensure!(n > 0, "empty first read through the overlay");
        s.ready_ns.push(ready.as_nanos() as u64);
        s.first_read_ns.push(t.elapsed().as_nanos() as u64);
        let t = Instant::now();
        umount(&merged)?;
        for (dev, mnt) in devs.iter().zip(&mnts) {
            umount(mnt)?;
            // SAFETY: LOOP_CLR_FD takes no argument.
            let r = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CLR_FD) };
            ensure!(r == 0, os_err("LOOP_CLR_FD"));
        }
        s.stop_ns.push(t.elapsed().as_nanos() as u64);
        drop(devs);
    }
    Ok(Ok(s))
}

/// A `tessera serve` started with `--ready-fd`.
struct Served {
    child: Child,
    socket: PathBuf,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Spawn `bin serve IMAGE` and wait for its ready line.
fn serve(bin: &Path, image: &str, store: &Path, socket: &Path) -> Result<Served> {
    let _ = std::fs::remove_file(socket);
    let mut fds = [0i32; 2];
    // SAFETY: pipe2(2) fills two new descriptors, both close-on-exec.
    let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    ensure!(r == 0, "pipe2: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors were just created and nothing else owns them.
    let (rx, tx) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: dup(2) of a descriptor we own; the copy is not close-on-exec, so only the child
    // spawned next inherits it (the parent closes it right after the spawn, on this thread).
    let inherit = unsafe { libc::dup(tx.as_raw_fd()) };
    ensure!(inherit >= 0, "dup: {}", std::io::Error::last_os_error());
    // SAFETY: `inherit` was just created and nothing else owns it.
    let inherit = unsafe { OwnedFd::from_raw_fd(inherit) };
    let spawned = Command::new(bin)
        .args(["serve", image, "--store"])
        .arg(store)
        .arg("--socket")
        .arg(socket)
        .args(["--ready-fd", &inherit.as_raw_fd().to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn();
    drop(inherit);
    drop(tx);
    let child = spawned.context("starting tessera serve")?;
    let served = Served { child, socket: socket.to_owned() };
    let mut line = String::new();
    BufReader::new(std::fs::File::from(rx)).read_line(&mut line)?;
    ensure!(line.starts_with("ready "), "tessera serve did not report ready (read {line:?})");
    Ok(served)
}

fn stop(mut s: Served) -> Result<()> {
    let pid = i32::try_from(s.child.id())?;
    // SAFETY: kill(2) on our own child, not yet reaped (we hold its Child).
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let status = s.child.wait()?;
    ensure!(status.success(), "tessera serve exited with {status} after SIGTERM");
    ensure!(!s.socket.exists(), "tessera serve left its socket behind");
    Ok(())
}

fn tessera_side(bin: &Path, store: &Path, dir: &Path, containers: usize) -> Result<(Starts, u64)> {
    let mut s = Starts { mounts_per_container: 0, ..Default::default() };
    let mut running = Vec::new();
    let mut clients = Vec::new();
    for c in 0..containers {
        let socket = dir.join(format!("c{c:03}.sock"));
        let t = Instant::now();
        let d = serve(bin, "layers", store, &socket)?;
        let ready = t.elapsed();
        let mut client = BlkClient::connect_with_region(&socket, 1, true, 1 << 20)?;
        client.read(0, 4096)?.map_err(|e| anyhow::anyhow!("first read: errno {e}"))?;
        s.ready_ns.push(ready.as_nanos() as u64);
        s.first_read_ns.push(t.elapsed().as_nanos() as u64);
        clients.push(client);
        running.push(d);
    }
    let mut rss = 0;
    for d in &running {
        rss += super::bench_scale::rss_of(d.child.id())?.0;
    }
    drop(clients);
    for d in running {
        let t = Instant::now();
        stop(d)?;
        s.stop_ns.push(t.elapsed().as_nanos() as u64);
    }
    Ok((s, rss))
}

/// Run the measurement.
pub fn measure(o: &MountsBench) -> Result<MountsReport> {
    fixtures::require_root()?;
    ensure!(o.layers >= 1 && o.containers >= 1, "--layers and --containers must be at least 1");
    let load_before = loadavg();
    let (bin, _) = match &o.bin {
        Some(b) => (b.clone(), PathBuf::new()),
        None => release_bench("bench-mounts")?,
    };
    // Short paths: 50 lower directories must fit mount(2)'s one-page option string.
    let dir = PathBuf::from(format!("/tmp/tessera-bench-mounts-{}", std::process::id()));
    let _cleanup = Cleanup(dir.clone());
    std::fs::create_dir_all(&dir)?;

    // The layers, as directories and as an OCI layout of gzip tar layers.
    let mut layer_dirs = Vec::new();
    let image = UmociImage::new(&dir.join("oci"), "layers")?;
    for i in 0..o.layers {
        let ld = dir.join(format!("L/{i:02}"));
        let mut tar = TarWriter::default();
        tar.dir("etc/", 0o755).dir(&format!("l{i:02}/"), 0o755);
        for (name, data) in layer_entries(i) {
            let p = ld.join(&name);
            std::fs::create_dir_all(p.parent().context("no parent")?)?;
            std::fs::write(&p, &data)?;
            tar.file(&name, 0o644, &data);
        }
        image.append_tar_layer(&tar.finish())?;
        layer_dirs.push(ld);
    }
    let store = dir.join("store");
    let out = Command::new(&bin)
        .arg("build")
        .arg(image.source())
        .arg("--store")
        .arg(&store)
        .args(["--tag", "layers"])
        .output()?;
    ensure!(out.status.success(), "tessera build: {}", String::from_utf8_lossy(&out.stderr));

    eprintln!("==> overlayfs: {} mounts of {} lower directories", o.containers, o.layers);
    let overlay = overlay_side(&dir.join("ovl"), &layer_dirs, o.containers)?;
    let layer_images = if o.layer_images {
        eprintln!("==> overlayfs over loop-mounted layer images: {} containers, one at a time", o.containers);
        Some(layer_image_side(&dir.join("img"), &layer_dirs, o.containers)?)
    } else {
        None
    };
    eprintln!("==> tessera: {} daemons", o.containers);
    let sockets = dir.join("sock");
    std::fs::create_dir_all(&sockets)?;
    let (tessera, rss) = tessera_side(&bin, &store, &sockets, o.containers)?;
    Ok(MountsReport {
        layers: o.layers,
        containers: o.containers,
        files_per_layer: FILES_PER_LAYER,
        overlay,
        layer_images,
        tessera,
        tessera_rss_total: rss,
        load_before,
        load_after: loadavg(),
        cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
    })
}

/// Removes the scratch directory (after unmounting anything left below it).
struct Cleanup(PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        tessera_e2e::debian::unmount_below(&self.0);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
