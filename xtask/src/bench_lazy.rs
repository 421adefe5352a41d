//! `cargo xtask bench lazy` (issue 15, points 2 and 3): real workloads on a real image, replayed
//! on the host through libblkio against lazy Tessera and against the eager peers a user would
//! pick, all through the same latency proxy.
//!
//! - **The image**: the package set of `tessera_e2e::workloads` (Debian bookworm minbase plus
//!   `workloads::PACKAGES`), a two-layer OCI layout made with debootstrap, apt and umoci, cached
//!   outside the clone; `tessera build oci:…` makes the store, kept in `<target>/bench-lazy`
//!   while the layout and the binary are the same.
//! - **The workloads** (`workloads::workloads`): python imports, `find /usr -exec stat`, a gcc
//!   compile of hello.c, a shell script start, and whole files worth 10% of the file data drawn
//!   at random (fixed seed) from the image's files. Each is recorded once in the QEMU guest (TCG)
//!   with `tessera serve --record-requests` and `--record-trace` (traces cached per image ID) and
//!   replayed here (`tessera_e2e::replay`); the chunk trace becomes the workload's profile.
//! - **The contenders**, each timed from "nothing local" to the replay's last completion:
//!   Tessera cold (no cache, no profile), cold with the workload's profile, from a warmed disk
//!   cache (`tessera warm` first, untimed; `serve --tag-max-age 1h`, as a warmed host runs),
//!   from the local store; peer (a) `skopeo copy` of the gzip OCI layers from a
//!   docker-registry, `umoci unpack`, `mkfs.ext4 -d`, qemu-storage-daemon; peer (b) the
//!   zstd-compressed raw export downloaded and decompressed as it arrives (`curl | zstd -d`),
//!   qemu-storage-daemon. The peers' download, unpack and mkfs are done once
//!   per round and rate; each workload's figure is that time plus its own qemu-storage-daemon
//!   start and replay.
//! - **The network**: nginx (the store and the export) and the registry each behind a
//!   `tessera_e2e::proxy` with the same RTT and rate, TCP slow start charged (`--no-slow-start`:
//!   not); every rate of `--mbit` in turn.
//!
//! Every cold run prints its link floor (`tessera_e2e::floor`); the table gives each contender's
//! median, the floor, and the ratios to the floor and to the faster eager peer.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use tessera_e2e::cold::{median, ColdRun};
use tessera_e2e::floor::{Breakdown, Floor, Link, StoreImage};
use tessera_e2e::nginx::Nginx;
use tessera_e2e::pin::Placement;
use tessera_e2e::prng::Prng;
use tessera_e2e::proxy::{Proxy, ProxyConfig};
use tessera_e2e::registry::Registry;
use tessera_e2e::replay::{self, ReplayOptions};
use tessera_e2e::workloads::{self, Recorded, TraceCache, Workload};

use super::bench_serve::Daemon;
use super::{cargo, status, target_dir};

/// Warmed-cache and local-store runs per round, interleaved in pairs (their medians are over
/// `rounds × WARM_LOCAL_PAIRS` runs).
const WARM_LOCAL_PAIRS: usize = 3;

/// Options of `cargo xtask bench lazy`.
#[derive(Debug, Args)]
pub struct LazyBench {
    /// Round-trip time of the modelled network, in milliseconds.
    #[arg(long, default_value_t = 20)]
    pub(crate) rtt_ms: u64,
    /// Link rates in Mbit/s, comma-separated; each is run in turn.
    #[arg(long, value_delimiter = ',', default_values_t = [200u64, 1000])]
    pub(crate) mbit: Vec<u64>,
    /// Rounds per rate (every contender and workload once per round, interleaved).
    #[arg(long, default_value_t = 3)]
    pub(crate) rounds: usize,
    /// Only these workloads (python, stat, gcc, shell, data; repeatable; default all).
    #[arg(long)]
    pub(crate) workload: Vec<String>,
    /// Development mode: the python workload, the first rate, one round.
    #[arg(long)]
    pub(crate) quick: bool,
    /// Share of the image's file-data bytes the whole-file workload reads, in percent.
    #[arg(long, default_value_t = 10)]
    pub(crate) data_percent: u64,
    /// Prepare everything (package set, store, export, traces, profiles) and stop.
    #[arg(long)]
    pub(crate) prepare_only: bool,
    /// Leave out the eager peers.
    #[arg(long)]
    pub(crate) no_peers: bool,
    /// An extra argument for every `tessera serve` (repeatable), e.g. `--serve-arg=--readahead=8M`.
    #[arg(long)]
    pub(crate) serve_arg: Vec<String>,
    /// Use this `tessera` binary instead of building the release CLI.
    #[arg(long)]
    pub(crate) tessera: Option<PathBuf>,
    /// Leave the daemons (tessera and qemu-storage-daemon) and the replays where the scheduler
    /// puts them (default: each daemon on the second CPU, the replay on the first;
    /// `tessera_e2e::pin`). The peers' downloads and preparation are never pinned.
    #[arg(long)]
    pub(crate) no_pin: bool,
    /// Charge no TCP slow start on the modelled link (default: charged, `bench cold`'s
    /// `--no-slow-start`).
    #[arg(long)]
    pub(crate) no_slow_start: bool,
}

/// The figures of one workload at one rate.
#[derive(Debug, Default)]
pub(crate) struct Row {
    pub(crate) floor: Option<Floor>,
    pub(crate) cold: Vec<Breakdown>,
    /// Cold, the image built with `--reference-layers` (file data read from the gzip layers).
    pub(crate) reference: Vec<Breakdown>,
    pub(crate) profile: Vec<Breakdown>,
    pub(crate) warm: Vec<f64>,
    pub(crate) local: Vec<f64>,
    pub(crate) peer_a: Vec<f64>,
    pub(crate) peer_b: Vec<f64>,
}

/// One round of an eager peer's preparation (download and so on), seconds and origin bytes.
#[derive(Debug, Clone)]
pub(crate) struct PeerPrep {
    pub(crate) steps: Vec<(&'static str, f64)>,
    pub(crate) bytes: u64,
}

/// One recorded workload.
pub(crate) struct LazyWorkload {
    pub(crate) name: String,
    /// The request trace (`tessera serve --record-requests`).
    pub(crate) requests: PathBuf,
    pub(crate) reads: u64,
    pub(crate) read_bytes: u64,
    /// Boot to power-off in the guest (TCG, local store) when it was recorded.
    pub(crate) guest_secs: f64,
}

/// One link rate's figures, a row per workload (in the order of `LazyResult::workloads`).
pub(crate) struct LazyRate {
    pub(crate) mbit: u64,
    pub(crate) rows: Vec<Row>,
    pub(crate) preps_a: Vec<PeerPrep>,
    pub(crate) preps_b: Vec<PeerPrep>,
}

/// What `measure` found, and what it prepared (also used by the report's cold part).
pub(crate) struct LazyResult {
    pub(crate) image_id: String,
    pub(crate) files: u64,
    pub(crate) data_bytes: u64,
    pub(crate) device_bytes: u64,
    pub(crate) stored_bytes: u64,
    pub(crate) layer_bytes: u64,
    pub(crate) zst_bytes: u64,
    /// The local store holding the image (tag `bench`).
    pub(crate) store: PathBuf,
    pub(crate) rtt_ms: u64,
    pub(crate) rounds: usize,
    pub(crate) workloads: Vec<LazyWorkload>,
    pub(crate) rates: Vec<LazyRate>,
}

impl PeerPrep {
    fn total(&self) -> f64 {
        self.steps.iter().map(|s| s.1).sum()
    }
}

fn which(tool: &str) -> bool {
    Command::new("which").arg(tool).stdout(std::process::Stdio::null()).status().is_ok_and(|s| s.success())
}

/// The served directory (`<dir>/served`: `store/`, `image.raw.zst`), the store and the image's
/// raw export (`<dir>/image.raw`), made now unless the recipe (layout, binary) is unchanged.
fn prepare_store(bin: &Path, dir: &Path, set: &workloads::PackageSet) -> Result<(PathBuf, PathBuf, PathBuf)> {
    let served = dir.join("served");
    let store = served.join("store");
    let raw = dir.join("image.raw");
    let m = fs::metadata(bin)?;
    let mtime = m.modified()?.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let recipe = format!(
        "bench-lazy store v3 (+ store-ref)\n{}binary {} ({} bytes, mtime {}.{:09})\nlayout {}\n",
        workloads::recipe()?,
        bin.display(),
        m.len(),
        mtime.as_secs(),
        mtime.subsec_nanos(),
        set.layout().display()
    );
    let marker = dir.join("served.recipe");
    if fs::read_to_string(&marker).ok().as_deref() == Some(recipe.as_str()) {
        return Ok((served, store, raw));
    }
    let _ = fs::remove_file(&marker);
    let _ = fs::remove_dir_all(&served);
    fs::create_dir_all(&served)?;
    let t = Instant::now();
    let out = Command::new(bin)
        .arg("build")
        .arg(set.source())
        .arg("--store")
        .arg(&store)
        .args(["--tag", "bench"])
        .output()?;
    ensure!(out.status.success(), "tessera build: {}", String::from_utf8_lossy(&out.stderr));
    println!("==> tessera build {} in {:.1} s", set.source(), t.elapsed().as_secs_f64());
    // The same image keeping its file data in the layout's gzip layers (issue 12, point 4).
    let t = Instant::now();
    let out_ref = Command::new(bin)
        .arg("build")
        .arg(set.source())
        .arg("--store")
        .arg(served.join("store-ref"))
        .args(["--tag", "bench", "--reference-layers"])
        .output()?;
    ensure!(
        out_ref.status.success(),
        "tessera build --reference-layers: {}",
        String::from_utf8_lossy(&out_ref.stderr)
    );
    ensure!(out_ref.stdout == out.stdout, "--reference-layers gave another image than the converted build");
    println!("==> tessera build --reference-layers in {:.1} s", t.elapsed().as_secs_f64());
    let _ = fs::remove_file(&raw);
    status(Command::new(bin).args(["export", "bench", "--store"]).arg(&store).arg("-o").arg(&raw))?;
    // What a user of the eager peer (b) downloads: the raw export, zstd at its default level.
    status(Command::new("zstd").args(["-q", "-f", "-T0", "-o"]).arg(served.join("image.raw.zst")).arg(&raw))?;
    let image = StoreImage::load(&store, "bench")?;
    fs::copy(entry_path(&store, &image), dir.join("entry.plain.json"))?;
    fs::copy(store.join("refs/bench"), ref_beside(&dir.join("entry.plain.json")))?;
    fs::write(&marker, recipe)?;
    Ok((served, store, raw))
}

fn entry_path(store: &Path, image: &StoreImage) -> PathBuf {
    store.join("images").join(format!("{}.json", image.id.0.hex()))
}

/// The tag's ref saved with the entry `entry` (`entry.W.json` → `ref.W`): a profiled image's
/// tag names where its profile's chunks are, which a start fetches at once.
fn ref_beside(entry: &Path) -> PathBuf {
    let name = entry.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let w = name.strip_prefix("entry.").and_then(|n| n.strip_suffix(".json")).unwrap_or(name);
    entry.with_file_name(format!("ref.{w}"))
}

/// Put the image entry `from` (the plain one, or one with a workload's profile) in place, and
/// the tag's ref saved with it.
fn use_entry(store: &Path, image: &StoreImage, from: &Path) -> Result<()> {
    let to = entry_path(store, image);
    let tmp = to.with_extension("json.bench-tmp");
    fs::copy(from, &tmp).with_context(|| format!("copying {}", from.display()))?;
    fs::rename(&tmp, &to)?;
    let saved = ref_beside(from);
    let tag = store.join("refs/bench");
    let tmp = tag.with_extension("bench-tmp");
    fs::copy(&saved, &tmp).with_context(|| format!("copying {}", saved.display()))?;
    fs::rename(&tmp, &tag)?;
    Ok(())
}

/// The entry with `w`'s profile (`tessera profile` of its chunk trace), saved beside the plain one.
fn profile_entry(
    bin: &Path,
    dir: &Path,
    store: &Path,
    image: &StoreImage,
    w: &Workload,
    rec: &Recorded,
) -> Result<PathBuf> {
    let out = dir.join(format!("entry.{}.json", w.name));
    use_entry(store, image, &dir.join("entry.plain.json"))?;
    status(
        Command::new(bin).args(["profile", "bench", "--store"]).arg(store).arg("--trace").arg(&rec.trace),
    )?;
    fs::copy(entry_path(store, image), &out)?;
    fs::copy(store.join("refs/bench"), ref_beside(&out))?;
    use_entry(store, image, &dir.join("entry.plain.json"))?;
    Ok(out)
}

/// qemu-storage-daemon exporting the raw file `file` read-only with `queues` queues.
fn qsd(file: &Path, socket: &Path, queues: u16, log: &Path, placement: Option<Placement>) -> Result<Daemon> {
    let mut cmd = tessera_e2e::pin::daemon_command(placement, "qemu-storage-daemon");
    cmd.arg("--blockdev")
        .arg(format!("driver=file,node-name=f,filename={}", file.display()))
        .args(["--blockdev", "driver=raw,node-name=r,file=f", "--export"])
        .arg(format!(
            "type=vhost-user-blk,id=e,node-name=r,addr.type=unix,addr.path={},writable=off,num-queues={}",
            socket.display(),
            queues.max(1)
        ));
    Daemon::spawn(cmd, socket, log)
}

/// Seconds from now until qemu-storage-daemon on `file` has served the whole replay of `trace`.
fn qsd_replay(
    file: &Path,
    trace: &tessera_image::RequestTrace,
    dir: &Path,
    raw: Option<&Path>,
    placement: Option<Placement>,
) -> Result<f64> {
    let sock = dir.join("qsd.sock");
    let t = Instant::now();
    let d = qsd(file, &sock, trace.header.queues, &dir.join("qsd.log"), placement)?;
    let replay =
        || replay::replay(trace, &sock, &ReplayOptions { raw: raw.map(Path::to_path_buf), writes: false });
    let r = match placement {
        Some(p) => p.on_client(replay).and_then(|r| r),
        None => replay(),
    };
    let secs = t.elapsed().as_secs_f64();
    d.stop()?;
    let r = r?;
    ensure!(r.failed == 0, "qemu-storage-daemon: {} requests failed", r.failed);
    Ok(secs)
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Peer (a): `skopeo copy` of the OCI layers from the registry behind `proxy`, `umoci unpack`,
/// `mkfs.ext4 -d` into a file of `device_bytes`. Returns the raw file and the steps.
fn peer_a_prepare(proxy: &Proxy, work: &Path, device_bytes: u64) -> Result<(PathBuf, PeerPrep)> {
    let _ = fs::remove_dir_all(work);
    fs::create_dir_all(work)?;
    let before = proxy.stats().body_bytes;
    let t = Instant::now();
    let layout = work.join("layout");
    tessera_e2e::oci::skopeo_copy(
        &format!("docker://{}/pkgset:bench", proxy.addr()),
        &format!("oci:{}:bench", layout.display()),
        &["--src-tls-verify=false"],
    )?;
    let copied = t.elapsed();
    let bytes = proxy.stats().body_bytes - before;
    let t = Instant::now();
    let bundle = work.join("bundle");
    status(
        Command::new("umoci")
            .args(["unpack", "--image"])
            .arg(format!("{}:bench", layout.display()))
            .arg(&bundle),
    )?;
    let unpacked = t.elapsed();
    let t = Instant::now();
    let img = work.join("image.ext4");
    fs::File::create(&img)?.set_len(device_bytes)?;
    let out =
        Command::new("mkfs.ext4").args(["-q", "-F", "-d"]).arg(bundle.join("rootfs")).arg(&img).output()?;
    ensure!(out.status.success(), "mkfs.ext4 -d: {}", String::from_utf8_lossy(&out.stderr));
    let made = t.elapsed();
    Ok((
        img,
        PeerPrep {
            steps: vec![
                ("skopeo copy", secs(copied)),
                ("umoci unpack", secs(unpacked)),
                ("mkfs.ext4 -d", secs(made)),
            ],
            bytes,
        },
    ))
}

/// Peer (b): `curl | zstd -d` of the compressed raw export from nginx behind `proxy`.
fn peer_b_prepare(proxy: &Proxy, work: &Path) -> Result<(PathBuf, PeerPrep)> {
    let _ = fs::remove_dir_all(work);
    fs::create_dir_all(work)?;
    let out = work.join("image.raw");
    let before = proxy.stats().body_bytes;
    let t = Instant::now();
    status(Command::new("bash").arg("-c").arg(format!(
        "set -o pipefail; curl -sS --fail '{}/image.raw.zst' | zstd -d -q -f -o '{}'",
        proxy.url("s"),
        out.display()
    )))?;
    let took = t.elapsed();
    Ok((
        out,
        PeerPrep { steps: vec![("curl | zstd -d", secs(took))], bytes: proxy.stats().body_bytes - before },
    ))
}

pub fn run(opts: &LazyBench) -> Result<()> {
    let r = measure(opts)?;
    if opts.prepare_only {
        return Ok(());
    }
    println!(
        "\n== bench lazy: image {} ({:.0} MiB of file data, {} files)",
        r.image_id,
        r.data_bytes as f64 / f64::from(1u32 << 20),
        r.files
    );
    for w in &r.workloads {
        println!("   {}: guest (TCG, local store, boot to power-off) {:.1} s", w.name, w.guest_secs);
    }
    for rate in &r.rates {
        println!(
            "{}",
            table(rate.mbit, r.rtt_ms, r.rounds, &r.workloads, &rate.rows, &rate.preps_a, &rate.preps_b)
        );
    }
    Ok(())
}

/// Prepare (image, store, traces, profiles) and, unless `--prepare-only`, measure every
/// contender at every rate.
pub(crate) fn measure(opts: &LazyBench) -> Result<LazyResult> {
    tessera_e2e::fixtures::require_root()?;
    for tool in
        ["qemu-storage-daemon", "qemu-system-x86_64", "curl", "zstd", "skopeo", "umoci", "mkfs.ext4", "bash"]
    {
        if !which(tool) {
            bail!("{tool} is missing");
        }
    }
    let (rates, rounds, only): (Vec<u64>, usize, Vec<String>) = if opts.quick {
        (opts.mbit.iter().take(1).copied().collect(), 1, vec!["python".to_owned()])
    } else {
        (opts.mbit.clone(), opts.rounds, opts.workload.clone())
    };
    ensure!(!rates.is_empty() && rounds >= 1, "at least one rate and one round");
    let (bin, dir) = match &opts.tessera {
        Some(b) => {
            let dir = target_dir()?.join("bench-lazy");
            fs::create_dir_all(&dir)?;
            (b.canonicalize().with_context(|| format!("{}", b.display()))?, dir)
        }
        None => release_bench("bench-lazy")?,
    };
    let t = Instant::now();
    let set = workloads::package_set()?;
    println!("==> package set {} ({:.0} s)", set.dir.display(), t.elapsed().as_secs_f64());
    let (served, store, raw) = prepare_store(&bin, &dir, &set)?;
    let image = StoreImage::load(&store, "bench")?;
    use_entry(&store, &image, &dir.join("entry.plain.json"))?;
    let v = tessera_e2e::tessera::inspect_json_with(&bin, "bench", &store)?;
    let get = |k: &str| v[k].as_u64().with_context(|| format!("inspect: no {k}"));
    let (data_bytes, stored_bytes, files) = (get("data_bytes")?, get("stored_bytes")?, get("files")?);
    let device_bytes = v["geometry"]["size_bytes"].as_u64().context("inspect: no geometry.size_bytes")?;
    let zst_bytes = fs::metadata(served.join("image.raw.zst"))?.len();
    let layer_bytes: u64 = {
        let m: serde_json::Value = serde_json::from_slice(&fs::read(
            set.layout().join("blobs/sha256").join(
                serde_json::from_slice::<serde_json::Value>(&fs::read(set.layout().join("index.json"))?)?
                    ["manifests"][0]["digest"]
                    .as_str()
                    .and_then(|d| d.strip_prefix("sha256:"))
                    .context("index.json: no manifest digest")?,
            ),
        )?)?;
        m["layers"].as_array().context("manifest: no layers")?.iter().filter_map(|l| l["size"].as_u64()).sum()
    };
    let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
    println!(
        "==> image {}: {} packages ({}) on bookworm minbase; {files} files, {:.0} MiB of file data, device {:.0} MiB; \
         stored {:.0} MiB (tessera), OCI layers {:.0} MiB (gzip), raw export {:.0} MiB (zstd -3)",
        image.id,
        workloads::PACKAGES.len(),
        workloads::PACKAGES.join(" "),
        mib(data_bytes),
        mib(device_bytes),
        mib(stored_bytes),
        mib(layer_bytes),
        mib(zst_bytes)
    );

    let all = workloads::workloads(&set.files()?, data_bytes, opts.data_percent);
    let chosen: Vec<Workload> = if only.is_empty() {
        all
    } else {
        for n in &only {
            ensure!(all.iter().any(|w| &w.name == n), "no workload {n:?} (python, stat, gcc, shell, data)");
        }
        all.into_iter().filter(|w| only.contains(&w.name)).collect()
    };

    // Record (or find cached) each workload's traces in the guest, from the local store.
    std::env::set_var("TESSERA_BIN", &bin);
    let cache = TraceCache::new(&image.id.0.hex());
    let work = dir.join("work");
    fs::create_dir_all(&work)?;
    let mut recorded = Vec::new();
    for w in &chosen {
        let (r, fresh) = cache.record(w, "bench", &store, &work)?;
        let trace = replay::load(&r.requests)?;
        let (n, bytes) =
            tessera_e2e::floor::reads(&trace).fold((0u64, 0u64), |(n, b), (_, l)| (n + 1, b + l));
        println!(
            "==> {} ({}): {} requests, {n} reads, {:.1} MiB, max {} in flight; guest (TCG, local store) {:.1} s",
            w.name,
            if fresh { "recorded now" } else { "cached" },
            trace.records.len(),
            mib(bytes),
            trace_overlap(&trace),
            r.guest_secs
        );
        let entry = profile_entry(&bin, &dir, &store, &image, w, &r)?;
        recorded.push((w.clone(), r, trace, entry));
    }
    // Each trace replayed against the local store reads exactly the recorded bytes, equal to the
    // raw export's.
    for (w, _, trace, _) in &recorded {
        let sock = work.join("check.sock");
        let d =
            tessera_e2e::daemon::Daemon::start("bench", &store, &sock, &["--read-only", "--no-prefetch"])?;
        let r = replay::replay(trace, &sock, &ReplayOptions { raw: Some(raw.clone()), writes: false });
        d.stop()?;
        let r = r?;
        ensure!(r.failed == 0 && r.status_mismatches == 0, "{}: the replay failed: {}", w.name, r.summary());
        ensure!(
            r.checked_bytes == r.read_bytes,
            "{}: {} of {} bytes checked",
            w.name,
            r.checked_bytes,
            r.read_bytes
        );
        println!(
            "==> {}: replay against the local store checked {} bytes against the raw export",
            w.name, r.read_bytes
        );
    }
    let mut result = LazyResult {
        image_id: image.id.to_string(),
        files,
        data_bytes,
        device_bytes,
        stored_bytes,
        layer_bytes,
        zst_bytes,
        store: store.clone(),
        rtt_ms: opts.rtt_ms,
        rounds,
        workloads: recorded
            .iter()
            .map(|(w, r, trace, _)| {
                let (reads, read_bytes) =
                    tessera_e2e::floor::reads(trace).fold((0u64, 0u64), |(n, b), (_, l)| (n + 1, b + l));
                LazyWorkload {
                    name: w.name.clone(),
                    requests: r.requests.clone(),
                    reads,
                    read_bytes,
                    guest_secs: r.guest_secs,
                }
            })
            .collect(),
        rates: Vec::new(),
    };
    if opts.prepare_only {
        return Ok(result);
    }

    let registry = if opts.no_peers {
        None
    } else {
        let r = Registry::start()?;
        let t = Instant::now();
        r.load(&format!("oci:{}:{}", set.layout().display(), workloads::TAG), "pkgset:bench", &[])?;
        println!(
            "==> the OCI layout pushed to docker-registry {} in {:.1} s",
            r.addr(),
            t.elapsed().as_secs_f64()
        );
        Some(r)
    };
    let nginx = Nginx::serve(&served, "s")?;
    let placement = if opts.no_pin { None } else { Placement::split() };
    match placement {
        Some(p) => println!("==> pinned: each daemon on CPU {}, each replay on CPU {}", p.daemon, p.client),
        None => println!("==> not pinned"),
    }
    for &mbit in &rates {
        let link = Link { bytes_per_sec: mbit * 1_000_000 / 8, rtt: Duration::from_millis(opts.rtt_ms) };
        let cfg = ProxyConfig {
            rtt: link.rtt,
            bandwidth: Some(link.bytes_per_sec),
            slow_start: !opts.no_slow_start,
        };
        let proxy = Proxy::start(nginx.addr(), cfg)?;
        let reg_proxy = registry.as_ref().map(|r| Proxy::start(r.addr(), cfg)).transpose()?;
        let url = proxy.url("s/store");
        // The warmed cache: everything, through this link (untimed).
        let warm_dir = dir.join(format!("warm-{mbit}"));
        let _ = fs::remove_dir_all(&warm_dir);
        let t = Instant::now();
        status(Command::new(&bin).args(["warm", "bench", "--store", &url, "--cache-dir"]).arg(&warm_dir))?;
        println!("==> {mbit} Mbit/s: tessera warm (the whole image) in {:.1} s", t.elapsed().as_secs_f64());
        let mut rows: Vec<Row> = recorded.iter().map(|_| Row::default()).collect();
        let mut preps_a = Vec::new();
        let mut preps_b = Vec::new();
        let sock = work.join("tessera.sock");
        for round in 0..rounds {
            for ((w, _, trace, entry), row) in recorded.iter().zip(rows.iter_mut()) {
                let plain = dir.join("entry.plain.json");
                let arm = |store_url: String, extra: &[String]| -> Result<Breakdown> {
                    let mut args: Vec<String> = extra.to_vec();
                    args.extend(opts.serve_arg.iter().cloned());
                    let run = ColdRun {
                        bin: &bin,
                        store_url,
                        image: "bench",
                        serve_args: &args,
                        socket: sock.clone(),
                        raw: None,
                        placement,
                    };
                    let r = run.run(trace, &proxy, &image, link)?;
                    ensure!(r.replay.failed == 0, "{}: {} requests failed", w.name, r.replay.failed);
                    Ok(r.breakdown)
                };
                use_entry(&store, &image, &plain)?;
                let cold = arm(url.clone(), &[])?;
                println!("== {mbit} Mbit/s round {round} {} cold: {}", w.name, cold.summary().trim_end());
                let reference = arm(proxy.url("s/store-ref"), &[])?;
                println!(
                    "== {mbit} Mbit/s round {round} {} cold, --reference-layers image: {}",
                    w.name,
                    reference.summary().trim_end()
                );
                use_entry(&store, &image, entry)?;
                let prof = arm(url.clone(), &[])?;
                println!("== {mbit} Mbit/s round {round} {} profile: {}", w.name, prof.summary().trim_end());
                use_entry(&store, &image, &plain)?;
                // As a warmed host runs it: the tag lookup `tessera warm` made is trusted
                // (`--tag-max-age`; the rounds of one link take minutes, not an hour).
                let warmed = [
                    "--cache-dir".into(),
                    warm_dir.display().to_string(),
                    "--tag-max-age".into(),
                    "1h".into(),
                ];
                // Runs of 50–400 ms whose ratio has a target (≤ 1.1×): WARM_LOCAL_PAIRS
                // interleaved pairs per round, so one slow run moves the median less.
                for _ in 0..WARM_LOCAL_PAIRS {
                    let warm = arm(url.clone(), &warmed)?;
                    let local = arm(store.display().to_string(), &[])?;
                    println!(
                        "== {mbit} Mbit/s round {round} {}: warmed cache {:.3} s, local store {:.3} s",
                        w.name,
                        secs(warm.total()),
                        secs(local.total())
                    );
                    row.warm.push(secs(warm.total()));
                    row.local.push(secs(local.total()));
                }
                row.floor = Some(cold.floor);
                row.cold.push(cold);
                row.reference.push(reference);
                row.profile.push(prof);
            }
            if let Some(rp) = &reg_proxy {
                let (img, prep) = peer_a_prepare(rp, &work.join("peer-a"), device_bytes)?;
                for ((w, _, trace, _), row) in recorded.iter().zip(rows.iter_mut()) {
                    let t = prep.total() + qsd_replay(&img, trace, &work, None, placement)?;
                    println!("== {mbit} Mbit/s round {round} {} peer (a): {t:.2} s", w.name);
                    row.peer_a.push(t);
                }
                println!("== peer (a) preparation: {}", describe(&prep));
                preps_a.push(prep);
                let _ = fs::remove_dir_all(work.join("peer-a"));
                let (img, prep) = peer_b_prepare(&proxy, &work.join("peer-b"))?;
                for ((w, _, trace, _), row) in recorded.iter().zip(rows.iter_mut()) {
                    let t = prep.total() + qsd_replay(&img, trace, &work, Some(&raw), placement)?;
                    println!("== {mbit} Mbit/s round {round} {} peer (b): {t:.2} s", w.name);
                    row.peer_b.push(t);
                }
                println!("== peer (b) preparation: {}", describe(&prep));
                preps_b.push(prep);
                let _ = fs::remove_dir_all(work.join("peer-b"));
            }
        }
        println!("{}", table(mbit, opts.rtt_ms, rounds, &result.workloads, &rows, &preps_a, &preps_b));
        result.rates.push(LazyRate { mbit, rows, preps_a, preps_b });
    }
    Ok(result)
}

fn describe(p: &PeerPrep) -> String {
    let steps: Vec<String> = p.steps.iter().map(|(n, s)| format!("{n} {s:.2} s")).collect();
    format!("{} ({:.1} MiB through the link)", steps.join(", "), p.bytes as f64 / f64::from(1u32 << 20))
}

/// Most requests of `trace` in flight at once in the recording.
fn trace_overlap(trace: &tessera_image::RequestTrace) -> usize {
    let mut ev: Vec<(u64, i32)> = Vec::new();
    for r in &trace.records {
        ev.push((r.issued_ns, 1));
        ev.push((r.completed_ns, -1));
    }
    ev.sort();
    let (mut n, mut max) = (0i32, 0i32);
    for (_, d) in ev {
        n += d;
        max = max.max(n);
    }
    usize::try_from(max).unwrap_or(0)
}

/// The markdown table of one rate.
fn table(
    mbit: u64,
    rtt_ms: u64,
    rounds: usize,
    recorded: &[LazyWorkload],
    rows: &[Row],
    preps_a: &[PeerPrep],
    preps_b: &[PeerPrep],
) -> String {
    let med = |v: &[f64]| median(v.to_vec());
    let tot = |v: &[Breakdown]| med(&v.iter().map(|b| secs(b.total())).collect::<Vec<_>>());
    let mut s = format!(
        "\n### {rtt_ms} ms RTT, {mbit} Mbit/s — medians of {rounds} round(s) ({} runs each for the warmed cache and the local store), seconds from nothing local to the last request\n\n\
         | workload | floor | cold | cold / floor | profile | profile / floor | warmed cache | local store | peer (a) OCI | peer (b) zstd raw | cold / faster peer | profile / faster peer | cold origin bytes / floor bytes | cold, --reference-layers | its / cold |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        rounds * WARM_LOCAL_PAIRS
    );
    for (w, row) in recorded.iter().zip(rows) {
        let Some(floor) = row.floor else { continue };
        let f = secs(floor.time());
        let (cold, prof) = (tot(&row.cold), tot(&row.profile));
        let reference = tot(&row.reference);
        let peers: Vec<f64> =
            [&row.peer_a, &row.peer_b].iter().filter(|v| !v.is_empty()).map(|v| med(v)).collect();
        let faster = peers.iter().copied().fold(f64::INFINITY, f64::min);
        let ratio = |x: f64| if faster.is_finite() { format!("{:.3}×", x / faster) } else { "–".into() };
        let opt = |v: &[f64]| if v.is_empty() { "–".to_owned() } else { format!("{:.2}", med(v)) };
        let bytes = med(&row
            .cold
            .iter()
            .map(|b| b.origin_bytes as f64 / floor.bytes().max(1) as f64)
            .collect::<Vec<_>>());
        s.push_str(&format!(
            "| {} | {f:.3} | {cold:.3} | {:.2}× | {prof:.3} | {:.2}× | {:.3} | {:.3} | {} | {} | {} | {} | {bytes:.2} | {reference:.3} | {:.2}× |\n",
            w.name,
            cold / f,
            prof / f,
            med(&row.warm),
            med(&row.local),
            opt(&row.peer_a),
            opt(&row.peer_b),
            ratio(cold),
            ratio(prof),
            reference / cold,
        ));
    }
    for (name, preps) in [("peer (a)", preps_a), ("peer (b)", preps_b)] {
        if let Some(p) = preps.first() {
            let steps: Vec<String> = (0..p.steps.len())
                .map(|i| {
                    format!(
                        "{} {:.2} s",
                        p.steps[i].0,
                        med(&preps.iter().map(|p| p.steps[i].1).collect::<Vec<_>>())
                    )
                })
                .collect();
            s.push_str(&format!(
                "\n{name} preparation, median: {}; {:.1} MiB through the link",
                steps.join(", "),
                p.bytes as f64 / f64::from(1u32 << 20)
            ));
        }
    }
    s.push('\n');
    s
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
