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
    /// `tessera build` of the image with one more top layer into a store that holds the base
    /// image's build (issue 12's rebuild case).
    pub(crate) top_layer: Vec<f64>,
    /// `umoci unpack` + `mkfs.ext4 -d` of that image, one clock.
    pub(crate) top_layer_peer: Vec<f64>,
    /// That image's new layer, compressed bytes.
    pub(crate) top_layer_compressed: u64,
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

/// What [`add_app_layer`] does; part of the cached layout's recipe.
const APP_RECIPE: &str = "app layer v1: 1600 text files + 2 binaries in /opt/app (~11 MB), 12 doc dirs \
                          and 40 man pages whited out, usr/lib/os-release changed";

/// The rebuild case of issue 12: the Debian image plus one top layer a CI build would add — about
/// 10 MB of many new files, whiteouts of lower files, one lower file changed — tagged
/// `APP_TAG` in the same layout (`umoci repack` onto the base's manifest).
fn add_app_layer(work: &Path) -> Result<()> {
    use std::fs;
    let layout = work.join("layout");
    let bundle = work.join("app-bundle");
    let _ = fs::remove_dir_all(&bundle);
    status(
        Command::new("umoci")
            .arg("unpack")
            .arg("--image")
            .arg(format!("{}:{TAG}", layout.display()))
            .arg(&bundle),
    )?;
    let root = bundle.join("rootfs");
    let mut rng = tessera_e2e::prng::Prng::from_label("bench-oci app layer");
    let app = root.join("opt/app");
    for i in 0..1600u64 {
        let dir = app.join(format!("pkg{:02}", i % 40));
        fs::create_dir_all(&dir)?;
        let len = rng.range(1000, 12_000) as usize;
        fs::write(dir.join(format!("module{i:04}.py")), rng.text(len))?;
    }
    for name in ["libapp.so", "libapp-extra.so"] {
        let mut blob = vec![0u8; 1 << 20];
        rng.fill(&mut blob);
        fs::write(app.join(name), blob)?;
    }
    let mut docs: Vec<_> = fs::read_dir(root.join("usr/share/doc"))?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    docs.sort();
    if docs.len() < 12 {
        bail!("only {} doc directories to white out", docs.len());
    }
    for d in &docs[..12] {
        fs::remove_dir_all(d)?;
    }
    let mut man: Vec<_> =
        fs::read_dir(root.join("usr/share/man/man1"))?.filter_map(|e| e.ok()).map(|e| e.path()).collect();
    man.sort();
    if man.len() < 40 {
        bail!("only {} man pages to white out", man.len());
    }
    for m in &man[..40] {
        fs::remove_file(m)?;
    }
    let release = root.join("usr/lib/os-release");
    let mut text = fs::read(&release).context("usr/lib/os-release")?;
    text.extend_from_slice(b"VARIANT=\"tessera bench app\"\n");
    fs::write(&release, text)?;
    status(
        Command::new("umoci")
            .arg("repack")
            .arg("--image")
            .arg(format!("{}:{APP_TAG}", layout.display()))
            .arg(&bundle),
    )?;
    fs::remove_dir_all(&bundle)?;
    Ok(())
}

/// The Debian image as an OCI layout under `dir` (made once, kept while its recipe holds):
/// (`LAYOUT:TAG`, its manifest).
fn layout(dir: &Path) -> Result<(String, serde_json::Value)> {
    let recipe = format!("{}{}\n{APP_RECIPE}\n", debian::recipe()?, debian::IMAGE_RECIPE);
    let marker = dir.join("image.recipe");
    let work = dir.join("image");
    if std::fs::read_to_string(&marker).ok().as_deref() != Some(recipe.as_str()) {
        println!("==> making the layered Debian image at {}", work.display());
        let _ = std::fs::remove_file(&marker);
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work)?;
        let t = Instant::now();
        debian::make_image(&work, TAG)?;
        add_app_layer(&work)?;
        println!("image made in {:.1}s", t.elapsed().as_secs_f64());
        std::fs::write(&marker, &recipe)?;
    }
    let layout = work.join("layout");
    Ok((format!("{}:{TAG}", layout.display()), manifest_of(&layout, TAG)?))
}

/// The manifest tagged `tag` in the OCI layout `layout`.
fn manifest_of(layout: &Path, tag: &str) -> Result<serde_json::Value> {
    let blob = |digest: &str| -> Result<serde_json::Value> {
        let hex = digest.strip_prefix("sha256:").with_context(|| format!("digest {digest}"))?;
        Ok(serde_json::from_slice(&std::fs::read(layout.join("blobs/sha256").join(hex))?)?)
    };
    let index: serde_json::Value = serde_json::from_slice(&std::fs::read(layout.join("index.json"))?)?;
    let desc = index["manifests"]
        .as_array()
        .and_then(|m| {
            m.iter().find(|d| d["annotations"]["org.opencontainers.image.ref.name"].as_str() == Some(tag))
        })
        .with_context(|| format!("index.json has no {tag} tag"))?;
    blob(desc["digest"].as_str().context("descriptor without digest")?)
}

/// The reference pipeline on `image_ref`: `umoci unpack` into `bundle`, then `mkfs.ext4 -d` of
/// its rootfs into `raw` with tessera's geometry `(bytes, inodes)`, one sync at the end: (unpack,
/// mkfs, both on one clock) and the two command lines.
fn peer(
    image_ref: &str,
    bundle: &Path,
    raw: &Path,
    (size, inodes): (u64, u64),
) -> Result<(std::time::Duration, std::time::Duration, std::time::Duration, Vec<String>)> {
    let t0 = Instant::now();
    let out = Command::new("umoci")
        .args(["unpack", "--image"])
        .arg(image_ref)
        .arg(bundle)
        .output()
        .context("spawn umoci unpack")?;
    if !out.status.success() {
        bail!("umoci unpack {image_ref} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let du = t0.elapsed();
    let mut mkfs = Command::new("mkfs.ext4");
    mkfs.args(["-q", "-F", "-b", "4096", "-I", "256", "-N"])
        .arg(inodes.to_string())
        .arg("-d")
        .arg(bundle.join("rootfs"))
        .arg(raw)
        .arg(format!("{}k", size / 1024));
    let commands =
        vec![format!("umoci unpack --image {image_ref} {}", bundle.display()), crate::command_line(&mkfs)];
    let (dm, _) = timed(&mut mkfs)?;
    Ok((du, dm, t0.elapsed(), commands))
}

const TAG: &str = "bookworm";
/// The image with one more layer (see [`add_app_layer`]).
const APP_TAG: &str = "bookworm-app";

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
    let (t, tp) = (median(&mut r.top_layer.clone()), median(&mut r.top_layer_peer.clone()));
    println!(
        "rebuild after a new top layer ({:.1} MB compressed) into the base's store: {t:.3}s; umoci unpack + \
         mkfs.ext4 -d of that image {tp:.2}s; ratio {:.3} (target <= 0.05)",
        r.top_layer_compressed as f64 / 1e6,
        t / tp
    );
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
    let app_store = dir.join("store-app");
    let app_ref = image_ref.replace(&format!(":{TAG}"), &format!(":{APP_TAG}"));
    let app_source = format!("oci:{app_ref}");
    let app_manifest = manifest_of(&dir.join("image/layout"), APP_TAG)?;
    let app_layers = app_manifest["layers"].as_array().context("app manifest without layers")?;
    let top_compressed = app_layers.last().and_then(|l| l["size"].as_u64()).unwrap_or(0);
    let mut app_geometry: Option<(u64, u64)> = None;
    let (mut top, mut top_peer) = (Vec::new(), Vec::new());
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
        let (du, dm, dr, commands) = peer(&image_ref, &bundle, &raw, (size, inodes))?;
        peer_commands = commands;
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

        // The rebuild case (issue 12): the base built into a fresh store first (not timed), then
        // the image with one more top layer into that store; the peer unpacks and formats the
        // whole new image, as it must.
        let _ = std::fs::remove_dir_all(&app_store);
        timed(Command::new(&bin).arg("build").arg(&source).arg("--store").arg(&app_store))?;
        if opts.cold {
            drop_caches()?;
        }
        let first_app = app_geometry.is_none();
        let (dt, app_id, (app_size, app_inodes)) =
            crate::timed_tessera_builder(&bin, app_source.as_ref(), &app_store, &mut app_geometry)?;
        if first_app {
            // The rebuilt image is the one a build from scratch gives.
            let scratch = dir.join("store-app-scratch");
            let _ = std::fs::remove_dir_all(&scratch);
            let (_, out) =
                timed(Command::new(&bin).arg("build").arg(&app_source).arg("--store").arg(&scratch))?;
            let scratch_id = String::from_utf8_lossy(&out).trim().to_owned();
            if scratch_id != app_id {
                bail!("the top-layer rebuild gave {app_id}, a build from scratch {scratch_id}");
            }
            std::fs::remove_dir_all(&scratch)?;
        }
        let _ = std::fs::remove_dir_all(&bundle);
        let _ = std::fs::remove_file(&raw);
        if opts.cold {
            drop_caches()?;
        }
        let (_, _, dp, _) = peer(&app_ref, &bundle, &raw, (app_size, app_inodes))?;
        println!(
            "run {run}: top-layer rebuild {:.3}s   umoci unpack + mkfs.ext4 -d of that image {:.2}s   ratio {:.3}",
            dt.as_secs_f64(),
            dp.as_secs_f64(),
            dt.as_secs_f64() / dp.as_secs_f64()
        );
        top.push(dt.as_secs_f64());
        top_peer.push(dp.as_secs_f64());

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
        top_layer: top,
        top_layer_peer: top_peer,
        top_layer_compressed: top_compressed,
        reference_extra_bytes: ref_extra,
        umoci: tu,
        mkfs: tm,
        peer: tr,
        peer_commands,
    })
}
