//! Running the `tessera` binary under test.
//!
//! The binary is `$TESSERA_BIN`, else `<target dir>/debug/tessera` (the target dir is
//! `$CARGO_TARGET_DIR` or `<workspace>/target`). `cargo xtask test` builds it and sets the variable.

use std::fmt;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use anyhow::{bail, ensure, Context, Result};
use sha2::{Digest, Sha256};

/// The workspace root (parent of this crate).
pub fn workspace_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().unwrap_or(here).to_path_buf()
}

/// The cargo target directory the workspace builds into.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| workspace_root().join("target"))
}

/// Path of the `tessera` binary; panics with instructions when it is missing.
pub fn tessera_bin() -> PathBuf {
    let p = std::env::var_os("TESSERA_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("debug").join("tessera"));
    assert!(
        p.is_file(),
        "tessera binary not found at {} — run `cargo build -p tessera-cli` first, or set \
         TESSERA_BIN, or use `cargo xtask test` (which does both)",
        p.display()
    );
    p
}

/// A `tessera` command with these arguments.
pub fn command<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let mut c = Command::new(tessera_bin());
    c.args(args);
    c.stdin(Stdio::null());
    c
}

/// Run `tessera` and capture everything.
pub fn run<I, S>(args: I) -> Result<Output>
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let mut c = command(args);
    c.output().with_context(|| format!("spawn {c:?}"))
}

/// An image ID, `sha256:<64 lowercase hex>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ImageId(String);

impl ImageId {
    /// Parse and validate.
    pub fn parse(s: &str) -> Result<Self> {
        let hex =
            s.strip_prefix("sha256:").with_context(|| format!("image ID {s:?} lacks the sha256: prefix"))?;
        ensure!(
            hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "image ID {s:?} is not sha256:<64 lowercase hex>"
        );
        Ok(Self(s.to_string()))
    }

    /// The 64 hex digits.
    pub fn hex(&self) -> &str {
        &self.0["sha256:".len()..]
    }

    /// The full `sha256:<hex>` form.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ImageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn describe(out: &Output) -> String {
    format!(
        "{}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The image ID a ref names (its first line; docs/formats/store.md, "Refs").
pub fn ref_text_id(text: &str) -> Result<ImageId> {
    let first = text.split('\n').next().unwrap_or_default();
    ensure!(text.ends_with('\n'), "a ref ends with a newline: {text:?}");
    ImageId::parse(first)
}

/// What a tag's ref of image `id` in the local store at `store` holds: the ID, then the digests
/// of the prefix and pack index its entry names, then the lengths of the record and those two.
pub fn ref_text(store: &Path, id: &ImageId) -> Result<String> {
    let path = store.join("images").join(format!("{}.json", id.hex()));
    let v: serde_json::Value =
        serde_json::from_slice(&fs::read(&path).with_context(|| path.display().to_string())?)?;
    let digest =
        |k: &str| v[k].as_str().map(str::to_owned).with_context(|| format!("{}: {k}", path.display()));
    let len = |d: &str| -> Result<u64> {
        let hex = d.strip_prefix("sha256:").with_context(|| format!("{}: {d}", path.display()))?;
        let blob = store.join("blobs/sha256").join(hex);
        Ok(fs::metadata(&blob).with_context(|| blob.display().to_string())?.len())
    };
    let (prefix, pack_index) = (digest("prefix")?, digest("pack_index")?);
    Ok(format!(
        "{id}\nprefix {prefix}\npack-index {pack_index}\nlengths {} {} {}\n",
        len(&id.to_string())?,
        len(&prefix)?,
        len(&pack_index)?
    ))
}

/// Parse build stdout: exactly one line, the image ID.
pub fn parse_build_stdout(stdout: &[u8]) -> Result<ImageId> {
    let s = std::str::from_utf8(stdout).context("build stdout is not UTF-8")?;
    let body = s
        .strip_suffix('\n')
        .with_context(|| format!("build stdout {s:?} is not one newline-terminated line"))?;
    ensure!(!body.contains('\n'), "build stdout must be exactly one line, got {s:?}");
    ImageId::parse(body)
}

/// `tessera build DIR --store STORE ARGS...` → the image ID (stdout must be exactly one line).
pub fn build(dir: &Path, store: &Path, args: &[&str]) -> Result<ImageId> {
    let mut c = command(["build".as_ref(), dir.as_os_str(), "--store".as_ref(), store.as_os_str()]);
    c.args(args);
    let out = c.output().with_context(|| format!("spawn {c:?}"))?;
    if !out.status.success() {
        bail!("tessera build {} failed: {}", dir.display(), describe(&out));
    }
    parse_build_stdout(&out.stdout)
        .with_context(|| format!("tessera build {}: {}", dir.display(), describe(&out)))
}

/// `tessera export IMAGE --store STORE -o OUT`.
pub fn export(image: &str, store: &Path, out: &Path) -> Result<()> {
    let o = run([
        "export".as_ref(),
        image.as_ref(),
        "--store".as_ref(),
        store.as_os_str(),
        "-o".as_ref(),
        out.as_os_str(),
    ])?;
    if !o.status.success() {
        bail!("tessera export {image} failed: {}", describe(&o));
    }
    Ok(())
}

/// `tessera inspect IMAGE --store STORE --json`, parsed.
pub fn inspect_json(image: &str, store: &Path) -> Result<serde_json::Value> {
    let o =
        run(["inspect".as_ref(), image.as_ref(), "--store".as_ref(), store.as_os_str(), "--json".as_ref()])?;
    if !o.status.success() {
        bail!("tessera inspect {image} failed: {}", describe(&o));
    }
    serde_json::from_slice(&o.stdout)
        .with_context(|| format!("inspect --json output is not JSON: {}", describe(&o)))
}

/// `BIN inspect IMAGE --store STORE --json` with an explicit binary (benchmarks use release).
pub fn inspect_json_with(bin: &Path, image: &str, store: &Path) -> Result<serde_json::Value> {
    let o = Command::new(bin).args(["inspect", image, "--store"]).arg(store).arg("--json").output()?;
    if !o.status.success() {
        bail!("tessera inspect {image} failed: {}", describe(&o));
    }
    Ok(serde_json::from_slice(&o.stdout)?)
}

/// The keys `inspect --json` must have (the contract), with nested geometry keys.
pub const INSPECT_KEYS: &[&str] = &[
    "id",
    "geometry",
    "files",
    "directories",
    "symlinks",
    "other_nodes",
    "inodes_used",
    "logical_bytes",
    "stored_bytes",
    "chunks",
    "packs",
    "dedup_ratio",
    "prefix_bytes",
];

/// Keys of `inspect --json`'s `geometry` object.
pub const GEOMETRY_KEYS: &[&str] =
    &["block_size", "blocks", "size_bytes", "inodes", "groups", "journal_blocks"];

/// Check an `inspect --json` value against the documented keys and the image ID.
pub fn check_inspect(v: &serde_json::Value, id: &ImageId) -> Result<()> {
    let obj = v.as_object().context("inspect --json is not an object")?;
    for k in INSPECT_KEYS {
        ensure!(obj.contains_key(*k), "inspect --json lacks key {k:?}: {v}");
    }
    ensure!(v["id"].as_str() == Some(id.as_str()), "inspect id {} != build id {id}", v["id"]);
    let g = v["geometry"].as_object().context("geometry is not an object")?;
    for k in GEOMETRY_KEYS {
        ensure!(
            g.get(*k).is_some_and(|x| x.is_u64()),
            "geometry.{k} missing or not an unsigned integer: {v}"
        );
    }
    let bs = v["geometry"]["block_size"].as_u64().unwrap_or(0);
    let blocks = v["geometry"]["blocks"].as_u64().unwrap_or(0);
    ensure!(
        v["geometry"]["size_bytes"].as_u64() == Some(bs * blocks),
        "geometry.size_bytes != block_size * blocks: {v}"
    );
    ensure!(v["geometry"]["journal_blocks"].as_u64().unwrap_or(0) >= 1024, "journal under 1024 blocks: {v}");
    Ok(())
}

/// Check the store layout: every `blobs/sha256/<hex>` hashes to its name, the image entry
/// `images/<idhex>.json` names existing blobs, and every `refs/<tag>` holds `sha256:<hex>\n`
/// of an existing image.
pub fn check_store(store: &Path) -> Result<()> {
    let blobs = store.join("blobs/sha256");
    let mut buf = vec![0u8; 1 << 20];
    for e in fs::read_dir(&blobs).with_context(|| format!("readdir {}", blobs.display()))? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if !e.file_type()?.is_file() {
            bail!("{} is not a regular file", e.path().display());
        }
        let mut f = fs::File::open(e.path())?;
        let mut h = Sha256::new();
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        let got = hex::encode(h.finalize());
        ensure!(got == name, "blob {} hashes to {got}", e.path().display());
    }
    let images = store.join("images");
    for e in fs::read_dir(&images).with_context(|| format!("readdir {}", images.display()))? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(idhex) = name.strip_suffix(".json") else {
            bail!("unexpected file in images/: {name}");
        };
        ImageId::parse(&format!("sha256:{idhex}"))?;
        let v: serde_json::Value = serde_json::from_slice(&fs::read(e.path())?)
            .with_context(|| format!("{} is not JSON", e.path().display()))?;
        for k in ["record", "prefix", "pack_index", "profile", "provenance"] {
            ensure!(v.get(k).is_some(), "image entry {} lacks {k:?}: {v}", e.path().display());
        }
        for k in ["record", "prefix", "pack_index"] {
            let d =
                v[k].as_str().with_context(|| format!("image entry {name}: {k} is not a digest string"))?;
            let h = d
                .strip_prefix("sha256:")
                .with_context(|| format!("image entry {name}: {k} {d:?} lacks sha256:"))?;
            ensure!(blobs.join(h).is_file(), "image entry {name}: {k} blob {d} missing");
        }
        // The record's digest is the image ID.
        ensure!(
            v["record"].as_str() == Some(&format!("sha256:{idhex}")),
            "image entry {name}: record digest {} is not the image ID",
            v["record"]
        );
    }
    let refs = store.join("refs");
    if refs.is_dir() {
        for e in fs::read_dir(&refs)? {
            let e = e?;
            let s = fs::read_to_string(e.path())?;
            let id = ref_text_id(&s).with_context(|| format!("ref {}", e.path().display()))?;
            // Then, for an image with a profile, a line per pack of the profile's chunks.
            let head = ref_text(store, &id)?;
            let profiled = fs::read_to_string(images.join(format!("{}.json", id.hex())))
                .is_ok_and(|e| !e.contains("\"profile\": null"));
            let rest = s.strip_prefix(head.as_str());
            let lines_ok = rest.is_some_and(|r| r.lines().all(|l| l.starts_with("profile sha256:")));
            ensure!(
                lines_ok && (profiled || rest == Some("")),
                "ref {} holds {s:?}, not the ID, its entry's prefix and pack index and their lengths (and \
                 its profile's ranges)",
                e.path().display()
            );
            ensure!(
                images.join(format!("{}.json", id.hex())).is_file(),
                "ref {} points to a missing image {id}",
                e.path().display()
            );
        }
    }
    Ok(())
}

/// Run `tessera build` and measure its peak RSS (`ru_maxrss` from `wait4`, which is the child's
/// VmHWM) → (image ID, peak bytes).
pub fn build_peak_rss(dir: &Path, store: &Path, args: &[&str]) -> Result<(ImageId, u64)> {
    let mut all: Vec<&std::ffi::OsStr> =
        vec!["build".as_ref(), dir.as_os_str(), "--store".as_ref(), store.as_os_str()];
    all.extend(args.iter().map(std::ffi::OsStr::new));
    let (stdout, peak) = run_peak_rss(&all)?;
    Ok((parse_build_stdout(&stdout)?, peak))
}

/// Run `tessera ARGS…`, which must succeed, under GNU time (`/usr/bin/time -f %M`, Debian
/// package `time`) and return (stdout, peak RSS in bytes). Not `wait4` from this process: Linux
/// carries the high-water RSS of the memory a process replaces at `exec` into its `ru_maxrss`, and
/// a child spawned with `posix_spawn` (vfork) replaces *this* process's memory — so a test that
/// has held big buffers would be charged for them. GNU time forks from its own small image.
/// stdout/stderr go to files so pipes never block the child.
pub fn run_peak_rss(args: &[&std::ffi::OsStr]) -> Result<(Vec<u8>, u64)> {
    let tmp = tempfile::tempdir()?;
    let (so, se, rss) = (tmp.path().join("stdout"), tmp.path().join("stderr"), tmp.path().join("rss"));
    let mut c = Command::new("/usr/bin/time");
    c.args(["-f", "%M", "-o"]).arg(&rss).arg(tessera_bin()).args(args);
    c.stdin(Stdio::null()).stdout(fs::File::create(&so)?).stderr(fs::File::create(&se)?);
    let status = c.status().with_context(|| format!("spawn {c:?} (Debian package time)"))?;
    let stdout = fs::read(&so)?;
    let stderr = fs::read(&se)?;
    if !status.success() {
        bail!(
            "tessera {args:?} failed ({status}):\n--- stdout ---\n{}\n--- stderr ---\n{}",
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&stderr)
        );
    }
    let text = fs::read_to_string(&rss)?;
    let kib: u64 = text
        .lines()
        .last()
        .and_then(|l| l.trim().parse().ok())
        .with_context(|| format!("/usr/bin/time wrote {text:?}"))?;
    Ok((stdout, kib * 1024))
}
