//! `cargo xtask bench lazy`: a QEMU guest reads whole files worth about 10% of a ≥ 1 GiB image
//! from an nginx origin behind the latency proxy (20 ms RTT, 200 Mbit/s by default), lazily
//! through `tessera serve`, versus downloading the whole raw image from the same origin through
//! the same proxy and serving it with qemu-storage-daemon to the same guest workload (issue 5,
//! point 8; brief §7). Reports time to finish (target ≤ 0.25×) and origin bytes per file byte
//! read (target ≤ 1.5).
//!
//! The image: the Debian minbase root of `bench build-oci` (`tessera_e2e::debian`, cached) plus
//! large incompressible files. Both runs time everything from "nothing local" to the guest's
//! powering off: daemon start (tessera fetches entry, record, prefix and pack index) or download,
//! the boot, and the workload.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use tessera_e2e::floor::{Breakdown, Link, StoreImage};
use tessera_e2e::nginx::Nginx;
use tessera_e2e::prng::Prng;
use tessera_e2e::proxy::{Proxy, ProxyConfig};
use tessera_e2e::{debian, fixtures, guest};

use super::bench_serve::Daemon;
use super::{cargo, status, target_dir};

/// Options of `cargo xtask bench lazy`.
#[derive(Debug, Args)]
pub struct LazyBench {
    /// Round-trip time of the modelled network, in milliseconds.
    #[arg(long, default_value_t = 20)]
    rtt_ms: u64,
    /// Bandwidth of the modelled network, in Mbit/s.
    #[arg(long, default_value_t = 200)]
    mbit: u64,
    /// Incompressible files added to the Debian root.
    #[arg(long, default_value_t = 16)]
    big_files: u64,
    /// Size of each, in MiB.
    #[arg(long, default_value_t = 64)]
    big_mib: u64,
    /// Share of the image's file bytes the guest reads, in percent.
    #[arg(long, default_value_t = 10)]
    percent: u64,
    /// An extra argument for `tessera serve` (repeatable), e.g. `--serve-arg=--readahead=8M`.
    #[arg(long)]
    serve_arg: Vec<String>,
}

pub fn run(opts: &LazyBench) -> Result<()> {
    fixtures::require_root()?;
    for tool in ["qemu-storage-daemon", "qemu-system-x86_64", "curl", "tar"] {
        if Command::new("which")
            .arg(tool)
            .stdout(std::process::Stdio::null())
            .status()
            .map_or(true, |s| !s.success())
        {
            bail!("{tool} is missing");
        }
    }
    let (bin, dir) = release_bench("bench-lazy")?;

    // The tree: the Debian root plus big incompressible files, kept while its recipe holds.
    let tree = dir.join("tree");
    let recipe = format!(
        "bench-lazy tree v1: {}; big files {} x {} MiB (Prng label bench-lazy-N)\n",
        debian::recipe()?,
        opts.big_files,
        opts.big_mib
    );
    let marker = dir.join("tree.recipe");
    if fs::read_to_string(&marker).ok().as_deref() != Some(recipe.as_str()) {
        let _ = fs::remove_file(&marker);
        let _ = fs::remove_dir_all(&tree);
        fs::create_dir_all(tree.join("big"))?;
        let tarball = debian::rootfs_tarball()?;
        println!("==> unpacking {} into {}", tarball.display(), tree.display());
        status(Command::new("tar").args(["-x", "--numeric-owner", "-f"]).arg(&tarball).arg("-C").arg(&tree))?;
        write_incompressible(&tree.join("big"), opts.big_files, opts.big_mib, "bench-lazy")?;
        fs::write(&marker, &recipe)?;
    }

    // The store (fresh every run) and the raw export beside it, both served by nginx.
    let t = Instant::now();
    let (served, store) = build_served(&bin, &dir, &tree)?;
    println!("==> built in {:.1} s", t.elapsed().as_secs_f64());
    let raw = served.join("image.raw");
    status(Command::new(&bin).args(["export", "bench", "--store"]).arg(&store).arg("-o").arg(&raw))?;
    let v = tessera_e2e::tessera::inspect_json_with(&bin, "bench", &store)?;
    let data_bytes = v["data_bytes"].as_u64().context("data_bytes")?;
    let device_bytes = v["geometry"]["size_bytes"].as_u64().context("size_bytes")?;
    let stored_bytes = v["stored_bytes"].as_u64().context("stored_bytes")?;
    ensure!(data_bytes >= 1 << 30, "the image holds {data_bytes} bytes of file data, less than 1 GiB");

    // The workload: big files while they fit in `percent` of the file bytes, then binaries and
    // libraries (usr/bin, usr/sbin, usr/lib, in path order, as program starts read them) until
    // `percent` is reached. Every file is read whole.
    let want = data_bytes * opts.percent / 100;
    let mut files: Vec<(String, u64)> = Vec::new();
    let mut total = 0u64;
    let big = opts.big_mib << 20;
    for i in 0..opts.big_files {
        if total + big > want {
            break;
        }
        files.push((format!("big/data{i}.bin"), big));
        total += big;
    }
    let mut small = Vec::new();
    for sub in ["usr/bin", "usr/sbin", "usr/lib"] {
        regular_files(&tree, Path::new(sub), &mut small)?;
    }
    for (f, len) in small {
        if total >= want {
            break;
        }
        files.push((f, len));
        total += len;
    }
    let script = workload_script(&files);
    let kit = guest::kit()?;
    let initramfs = dir.join("initramfs.cpio");
    guest::initramfs(&kit, &script, &initramfs)?;

    let nginx = Nginx::serve(&served, "s")?;
    let bandwidth = opts.mbit * 1_000_000 / 8;
    let cfg = ProxyConfig { rtt: Duration::from_millis(opts.rtt_ms), bandwidth: Some(bandwidth) };
    let proxy = Proxy::start(nginx.addr(), cfg)?;
    let guest_timeout = Duration::from_secs(1800);

    // Lazy: tessera serve from the origin, nothing cached.
    let before = proxy.stats();
    let logged = proxy.log().len();
    let requests = dir.join("lazy.requests");
    let t = Instant::now();
    let sock = dir.join("lazy.sock");
    let mut cmd = Command::new(&bin);
    cmd.args(["serve", "bench", "--store"])
        .arg(proxy.url("s/store"))
        .arg("--socket")
        .arg(&sock)
        .arg("--read-only")
        .arg("--record-requests")
        .arg(&requests)
        .args(&opts.serve_arg);
    let daemon = Daemon::spawn(cmd, &sock, &dir.join("serve.log"))?;
    let started = t.elapsed();
    let log = guest::boot(&kit, &initramfs, &sock, &dir, guest_timeout)?;
    let lazy = t.elapsed();
    let lazy_stats = proxy.stats();
    daemon.stop()?;
    check_workload(&log, "tessera serve")?;
    // The link floor of what the guest read, and where the cold run's time went.
    let link = Link { bytes_per_sec: opts.mbit * 1_000_000 / 8, rtt: Duration::from_millis(opts.rtt_ms) };
    let image = StoreImage::load(&store, "bench")?;
    let floor = image.floor(&tessera_e2e::replay::load(&requests)?, link)?;
    let run_log: Vec<_> = proxy.log().into_iter().skip(logged).collect();
    let breakdown = Breakdown::of(|p| image.classify(p), &run_log, t, t + started, t + lazy, floor, None);
    let lazy_bytes = lazy_stats.body_bytes - before.body_bytes;
    let lazy_requests = lazy_stats.requests - before.requests;
    let lazy_conns = lazy_stats.connections - before.connections;

    // Peer: download the raw image through the same proxy, then qemu-storage-daemon.
    let download = dir.join("download.raw");
    let _ = fs::remove_file(&download);
    let before = proxy.stats();
    let t = Instant::now();
    status(
        Command::new("curl")
            .args(["-sS", "--fail", "-o"])
            .arg(&download)
            .arg(format!("{}/image.raw", proxy.url("s"))),
    )?;
    let downloaded = t.elapsed();
    let qsock = dir.join("qsd.sock");
    let mut cmd = Command::new("qemu-storage-daemon");
    cmd.arg("--blockdev")
        .arg(format!("driver=file,node-name=f,filename={}", download.display()))
        .args(["--blockdev", "driver=raw,node-name=r,file=f", "--export"])
        .arg(format!(
            "type=vhost-user-blk,id=e,node-name=r,addr.type=unix,addr.path={},writable=off",
            qsock.display()
        ));
    let qsd = Daemon::spawn(cmd, &qsock, &dir.join("qsd.log"))?;
    let log = guest::boot(&kit, &initramfs, &qsock, &dir, guest_timeout)?;
    let peer = t.elapsed();
    let peer_stats = proxy.stats();
    qsd.stop()?;
    check_workload(&log, "qemu-storage-daemon")?;
    let peer_bytes = peer_stats.body_bytes - before.body_bytes;
    let _ = fs::remove_file(&download);

    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    println!(
        "\n== bench lazy: {} ms RTT, {} Mbit/s (proxy), {} files read by the guest",
        opts.rtt_ms,
        opts.mbit,
        files.len()
    );
    println!(
        "image: {:.0} MiB of file data, device {:.0} MiB, stored {:.0} MiB; the guest reads {:.1} MiB of whole files ({:.1}%)",
        mib(data_bytes),
        mib(device_bytes),
        mib(stored_bytes),
        mib(total),
        total as f64 * 100.0 / data_bytes as f64
    );
    println!(
        "tessera serve (lazy):          {:7.1} s   (daemon ready after {:.2} s); origin {:.1} MiB in {} requests over {} connections",
        lazy.as_secs_f64(),
        started.as_secs_f64(),
        mib(lazy_bytes),
        lazy_requests,
        lazy_conns
    );
    println!(
        "download + qemu-storage-daemon: {:7.1} s   (download {:.1} s); origin {:.1} MiB",
        peer.as_secs_f64(),
        downloaded.as_secs_f64(),
        mib(peer_bytes)
    );
    println!("{}", floor.summary());
    print!("tessera serve (lazy, guest) {}", breakdown.summary());
    println!(
        "time ratio {:.3}× (target ≤ 0.25×); origin bytes / file bytes read {:.3} (target ≤ 1.5)",
        lazy.as_secs_f64() / peer.as_secs_f64(),
        lazy_bytes as f64 / total as f64
    );
    Ok(())
}

/// The release `tessera` (built now) and the bench's directory `<target>/NAME` (created).
pub(crate) fn release_bench(name: &str) -> Result<(PathBuf, PathBuf)> {
    let target = target_dir()?;
    status(cargo().args(["build", "--release", "-p", "tessera-cli"]))?;
    let dir = target.join(name);
    fs::create_dir_all(&dir)?;
    Ok((target.join("release").join("tessera"), dir))
}

/// A fresh store `dir/served/store` with `tree` built into it, tagged `bench`; returns the
/// directory to serve (`dir/served`) and the store.
pub(crate) fn build_served(bin: &Path, dir: &Path, tree: &Path) -> Result<(PathBuf, PathBuf)> {
    let served = dir.join("served");
    let store = served.join("store");
    let _ = fs::remove_dir_all(&served);
    fs::create_dir_all(&served)?;
    let out = Command::new(bin)
        .arg("build")
        .arg(tree)
        .arg("--store")
        .arg(&store)
        .args(["--tag", "bench"])
        .output()?;
    ensure!(out.status.success(), "tessera build: {}", String::from_utf8_lossy(&out.stderr));
    Ok((served, store))
}

/// `dir/data{i}.bin` for i in `0..files`, `mib` MiB each of incompressible bytes (Prng label
/// `{label}-{i}`: the same bytes every time).
pub(crate) fn write_incompressible(dir: &Path, files: u64, mib: u64, label: &str) -> Result<()> {
    println!("==> writing {files} incompressible files of {mib} MiB");
    fs::create_dir_all(dir)?;
    for i in 0..files {
        let mut rng = Prng::from_label(&format!("{label}-{i}"));
        let mut f = std::io::BufWriter::new(fs::File::create(dir.join(format!("data{i}.bin")))?);
        for _ in 0..mib {
            std::io::Write::write_all(&mut f, &rng.bytes(1 << 20))?;
        }
        std::io::Write::flush(&mut f)?;
    }
    Ok(())
}

/// Regular non-empty files under `root/sub`, recursively, in path order (names without
/// whitespace, which the guest script reads line by line).
fn regular_files(root: &Path, sub: &Path, out: &mut Vec<(String, u64)>) -> Result<()> {
    let mut entries: Vec<_> = fs::read_dir(root.join(sub))?.filter_map(|e| e.ok()).collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let rel = sub.join(e.file_name());
        let m = fs::symlink_metadata(e.path())?;
        if m.is_dir() {
            regular_files(root, &rel, out)?;
        } else if m.is_file() && m.len() > 0 {
            let name = rel.to_string_lossy().into_owned();
            if !name.contains(char::is_whitespace) {
                out.push((name, m.len()));
            }
        }
    }
    Ok(())
}

/// Mount the device read-only, read every listed file whole, report success.
fn workload_script(files: &[(String, u64)]) -> String {
    let mut s = String::from(
        "mount -t ext4 -o ro /dev/vda /mnt || { echo TESSERA-MOUNT-FAILED; poweroff -f; }\ncd /mnt\nok=1\n",
    );
    s.push_str("while read -r f; do cat \"$f\" > /dev/null || ok=0; done <<'TESSERA-FILES'\n");
    for (f, _) in files {
        s.push_str(f);
        s.push('\n');
    }
    s.push_str("TESSERA-FILES\n[ $ok = 1 ] && echo TESSERA-READ-OK\ncd /\numount /mnt\n");
    s
}

fn check_workload(log: &str, what: &str) -> Result<()> {
    ensure!(log.contains("TESSERA-READ-OK"), "{what}: the guest could not read every file:\n{log}");
    Ok(())
}
