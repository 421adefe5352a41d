//! `cargo xtask bench build-oci`: `tessera build oci:…` (release) against the reference pipeline
//! `umoci unpack` + `mkfs.ext4 -d` on the layered Debian minbase image of the e2e tests
//! (`tessera_e2e::debian`), side by side in one run. Both produce an image of the same geometry
//! (tessera's size and inode count, `-b 4096 -I 256`) and both are timed including a final `sync`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use tessera_e2e::{debian, fixtures};

use super::{cargo, drop_caches, median, status, target_dir, timed};

/// Options of `cargo xtask bench build-oci`.
#[derive(Debug, Args)]
pub struct OciBench {
    /// Timed runs of each contender.
    #[arg(long, default_value_t = 5)]
    pub(crate) runs: usize,
    /// Drop the page cache before every timed run (default: both warm, blobs read once first).
    #[arg(long)]
    pub(crate) cold: bool,
    /// Use this tessera binary instead of building the release CLI.
    #[arg(long)]
    pub(crate) tessera: Option<PathBuf>,
}

/// Every run's seconds (see `measure`) and the inputs' sizes.
pub(crate) struct OciResult {
    pub(crate) source: String,
    pub(crate) layers: usize,
    pub(crate) compressed_bytes: u64,
    pub(crate) image_bytes: u64,
    pub(crate) inodes: u64,
    /// `tessera build` into a fresh store.
    pub(crate) tessera: Vec<f64>,
    /// The same build again into the same store (the rebuild: every blob already there).
    pub(crate) rebuild: Vec<f64>,
    /// `tessera export` of the built image (informational).
    pub(crate) export: Vec<f64>,
    /// `tessera build --reference-layers` into a fresh store.
    pub(crate) reference_layers: Vec<f64>,
    /// What the --reference-layers store holds besides the layer blobs (bytes, last run).
    pub(crate) reference_extra_bytes: u64,
    pub(crate) umoci: Vec<f64>,
    pub(crate) mkfs: Vec<f64>,
    /// umoci unpack + mkfs.ext4 -d, one clock.
    pub(crate) peer: Vec<f64>,
    pub(crate) peer_commands: Vec<String>,
}

fn du_bytes(path: &Path) -> u64 {
    Command::new("du")
        .args(["-sb"])
        .arg(path)
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).split_whitespace().next().map(str::to_owned))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// The Debian image as an OCI layout under `dir` (made once, kept while its recipe holds):
/// (`LAYOUT:TAG`, its manifest).
fn layout(dir: &Path) -> Result<(String, serde_json::Value)> {
    let recipe = format!("{}{}\n", debian::recipe()?, debian::IMAGE_RECIPE);
    let marker = dir.join("image.recipe");
    let work = dir.join("image");
    if std::fs::read_to_string(&marker).ok().as_deref() != Some(recipe.as_str()) {
        println!("==> making the layered Debian image at {}", work.display());
        let _ = std::fs::remove_file(&marker);
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work)?;
        let t = Instant::now();
        debian::make_image(&work, TAG)?;
        println!("image made in {:.1}s", t.elapsed().as_secs_f64());
        std::fs::write(&marker, &recipe)?;
    }
    let layout = work.join("layout");
    let blob = |digest: &str| -> Result<serde_json::Value> {
        let hex = digest.strip_prefix("sha256:").with_context(|| format!("digest {digest}"))?;
        Ok(serde_json::from_slice(&std::fs::read(layout.join("blobs/sha256").join(hex))?)?)
    };
    let index: serde_json::Value = serde_json::from_slice(&std::fs::read(layout.join("index.json"))?)?;
    let desc = index["manifests"]
        .as_array()
        .and_then(|m| {
            m.iter().find(|d| d["annotations"]["org.opencontainers.image.ref.name"].as_str() == Some(TAG))
        })
        .context("index.json has no bookworm tag")?;
    let manifest = blob(desc["digest"].as_str().context("descriptor without digest")?)?;
    Ok((format!("{}:{TAG}", layout.display()), manifest))
}

const TAG: &str = "bookworm";

pub fn run(opts: &OciBench) -> Result<()> {
    let r = measure(opts)?;
    let (mut tt, mut te, mut tu, mut tm, mut tr) =
        (r.tessera.clone(), r.export.clone(), r.umoci.clone(), r.mkfs.clone(), r.peer.clone());
    let (a, e, u, m, r_) =
        (median(&mut tt), median(&mut te), median(&mut tu), median(&mut tm), median(&mut tr));
    println!(
        "median: tessera build {a:.2}s (export {e:.2}s); umoci unpack {u:.2}s + mkfs.ext4 -d {m:.2}s = {r_:.2}s; \
         ratio {:.3} (target <= 0.25, issue 12); both timed including a final sync, same image size, {} cores",
        a / r_,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "| {} | {} | {a:.2} s | {u:.2} s + {m:.2} s = {r_:.2} s | **{:.2}×** | {e:.2} s |",
        if opts.cold { "cold" } else { "warm" },
        opts.runs,
        a / r_
    );
    let rb = median(&mut r.rebuild.clone());
    println!("rebuild into the same store: {rb:.2}s, ratio {:.3}", rb / r_);
    let f = median(&mut r.reference_layers.clone());
    let extra = r.reference_extra_bytes;
    println!(
        "--reference-layers: build {f:.2}s, ratio {:.3} (target <= 0.15); store besides the layer blobs {:.2} MB = \
         {:.2}% of the compressed layers (target <= 5%)",
        f / r_,
        extra as f64 / 1e6,
        100.0 * extra as f64 / r.compressed_bytes.max(1) as f64
    );
    println!(
        "| {} --reference-layers | {} | {f:.2} s | {r_:.2} s | **{:.2}×** | uploads {:.2}% |",
        if opts.cold { "cold" } else { "warm" },
        opts.runs,
        f / r_,
        100.0 * extra as f64 / r.compressed_bytes.max(1) as f64
    );
    Ok(())
}

/// `tessera build oci:…` (first build, rebuild, --reference-layers) against `umoci unpack` +
/// `mkfs.ext4 -d`, `opts.runs` times.
pub(crate) fn measure(opts: &OciBench) -> Result<OciResult> {
    fixtures::require_root()?;
    for tool in ["umoci", "mkfs.ext4", "debootstrap"] {
        if Command::new("which").arg(tool).output().map_or(true, |o| !o.status.success()) {
            bail!("{tool} is missing (apt-get install umoci e2fsprogs debootstrap)");
        }
    }
    let target = target_dir()?;
    let bin = match &opts.tessera {
        Some(b) => b.clone(),
        None => {
            status(cargo().args(["build", "--release", "-p", "tessera-cli"]))?;
            target.join("release").join("tessera")
        }
    };
    let dir = target.join("bench-oci");
    std::fs::create_dir_all(&dir)?;
    let (image_ref, manifest) = layout(&dir)?;
    let source = format!("oci:{image_ref}");
    let blobs = dir.join("image/layout/blobs/sha256");
    let layers = manifest["layers"].as_array().context("manifest without layers")?;
    let compressed: u64 = layers.iter().filter_map(|l| l["size"].as_u64()).sum();
    println!(
        "image {}: {} gzip layers, {:.1} MB compressed ({})",
        source,
        layers.len(),
        compressed as f64 / 1e6,
        layers
            .iter()
            .map(|l| format!("{:.1}", l["size"].as_u64().unwrap_or(0) as f64 / 1e6))
            .collect::<Vec<_>>()
            .join(" + ")
    );
    println!(
        "{} runs each, caches {}; tessera {}",
        opts.runs,
        if opts.cold { "dropped before every run" } else { "warm (blobs read once before timing)" },
        bin.display()
    );
    if !opts.cold {
        status(
            Command::new("cat")
                .args(std::fs::read_dir(&blobs)?.filter_map(|e| e.ok().map(|e| e.path())))
                .stdout(std::process::Stdio::null()),
        )?;
    }
    let store = dir.join("store");
    let bundle = dir.join("bundle");
    let raw = dir.join("mkfs.img");
    let exported = dir.join("export.img");
    let ref_store = dir.join("store-ref");
    let (mut tt, mut tu, mut tm, mut tr, mut te, mut tf) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut ref_extra = 0u64;
    let mut rebuild = Vec::new();
    let mut peer_commands = Vec::new();
    let mut geometry: Option<(u64, u64)> = None;
    for run in 1..=opts.runs {
        let _ = std::fs::remove_dir_all(&store);
        if opts.cold {
            drop_caches()?;
        }
        let first = geometry.is_none();
        let (d, id, (size, inodes)) =
            crate::timed_tessera_builder(&bin, source.as_ref(), &store, &mut geometry)?;
        if first {
            println!("store: {:.1} MB", du_bytes(&store) as f64 / 1e6);
        }
        // The rebuild: the same source into the same store (every blob already there).
        let (db, _) = timed(Command::new(&bin).arg("build").arg(&source).arg("--store").arg(&store))?;
        rebuild.push(db.as_secs_f64());
        // Informational: export of the built image to a raw file (not part of the ratio).
        let _ = std::fs::remove_file(&exported);
        let (dx, _) = timed(
            Command::new(&bin).arg("export").arg(&id).arg("--store").arg(&store).arg("-o").arg(&exported),
        )?;

        // --reference-layers (issue 12): the same image keeping its data in the gzip layers; what
        // the store holds besides the layer blobs is what a push would upload.
        let _ = std::fs::remove_dir_all(&ref_store);
        if opts.cold {
            drop_caches()?;
        }
        let (df, out) = timed(
            Command::new(&bin)
                .arg("build")
                .arg(&source)
                .arg("--store")
                .arg(&ref_store)
                .arg("--reference-layers"),
        )?;
        let ref_id = String::from_utf8_lossy(&out).trim().to_owned();
        if ref_id != id {
            bail!("--reference-layers built {ref_id}, the converted build {id}");
        }
        let layer_bytes: u64 = layers
            .iter()
            .filter_map(|l| l["digest"].as_str())
            .filter_map(|d| {
                std::fs::metadata(ref_store.join("blobs/sha256").join(d.trim_start_matches("sha256:"))).ok()
            })
            .map(|m| m.len())
            .sum();
        ref_extra = du_bytes(&ref_store).saturating_sub(layer_bytes);
        tf.push(df.as_secs_f64());

        let _ = std::fs::remove_dir_all(&bundle);
        let _ = std::fs::remove_file(&raw);
        if opts.cold {
            drop_caches()?;
        }
        // The reference: umoci unpack, then mkfs.ext4 -d of its rootfs, one sync at the end.
        let t0 = Instant::now();
        let out = Command::new("umoci")
            .args(["unpack", "--image"])
            .arg(&image_ref)
            .arg(&bundle)
            .output()
            .context("spawn umoci unpack")?;
        if !out.status.success() {
            bail!("umoci unpack failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let du = t0.elapsed();
        let mut mkfs = Command::new("mkfs.ext4");
        mkfs.args(["-q", "-F", "-b", "4096", "-I", "256", "-N"])
            .arg(inodes.to_string())
            .arg("-d")
            .arg(bundle.join("rootfs"))
            .arg(&raw)
            .arg(format!("{}k", size / 1024));
        peer_commands = vec![
            format!("umoci unpack --image {image_ref} {}", bundle.display()),
            crate::command_line(&mkfs),
        ];
        let (dm, _) = timed(&mut mkfs)?;
        let dr = t0.elapsed();
        println!(
            "run {run}: tessera build {:.2}s (+ export {:.2}s; --reference-layers {:.2}s)   umoci unpack {:.2}s + mkfs.ext4 -d {:.2}s = {:.2}s   ratio {:.3}",
            d.as_secs_f64(),
            dx.as_secs_f64(),
            df.as_secs_f64(),
            du.as_secs_f64(),
            dm.as_secs_f64(),
            dr.as_secs_f64(),
            d.as_secs_f64() / dr.as_secs_f64()
        );
        tt.push(d.as_secs_f64());
        te.push(dx.as_secs_f64());
        tu.push(du.as_secs_f64());
        tm.push(dm.as_secs_f64());
        tr.push(dr.as_secs_f64());
    }
    let (image_bytes, inodes) = geometry.unwrap_or_default();
    Ok(OciResult {
        source,
        layers: layers.len(),
        compressed_bytes: compressed,
        image_bytes,
        inodes,
        tessera: tt,
        rebuild,
        export: te,
        reference_layers: tf,
        reference_extra_bytes: ref_extra,
        umoci: tu,
        mkfs: tm,
        peer: tr,
        peer_commands,
    })
}
