//! Helpers shared by the integration tests.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{ensure, Context, Result};

use crate::compare::{walk, Kind};

/// A temporary directory under the target dir (the same disk as the build; xattrs supported),
/// world-traversable so that tests that drop privileges can reach inside.
pub fn tmp(prefix: &str) -> Result<tempfile::TempDir> {
    let base = std::env::var_os("TESSERA_E2E_TMPDIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| crate::tessera::target_dir().join("e2e-tmp"));
    std::fs::create_dir_all(&base)?;
    let d = tempfile::Builder::new()
        .prefix(&format!("{prefix}-"))
        .tempdir_in(&base)
        .with_context(|| format!("tempdir in {}", base.display()))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755))?;
    Ok(d)
}

/// Whether two files hold the same bytes, read in 1 MiB pieces (devices are hundreds of MiB).
pub fn same_bytes(a: &Path, b: &Path) -> Result<bool> {
    let (mut fa, mut fb) = (std::fs::File::open(a)?, std::fs::File::open(b)?);
    if fa.metadata()?.len() != fb.metadata()?.len() {
        return Ok(false);
    }
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    loop {
        let n = read_full(&mut fa, &mut ba)?;
        if n != read_full(&mut fb, &mut bb)? || ba[..n] != bb[..n] {
            return Ok(false);
        }
        if n == 0 {
            return Ok(true);
        }
    }
}

/// Read until `buf` is full or the file ends; the bytes read.
fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> Result<usize> {
    use std::io::Read as _;
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// The hex digests of the blobs a local store's image entries name — records, prefixes, pack
/// indexes, profiles, provenance: the blobs a start reads whole (in ranged pieces from an origin
/// that honors Range), as against the packs, whose ranged GETs are chunk reads.
pub fn image_part_digests(store: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(store.join("images")).into_iter().flatten().flatten() {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&std::fs::read(e.path()).unwrap_or_default())
        else {
            continue;
        };
        for k in ["record", "prefix", "pack_index", "profile", "provenance"] {
            if let Some(d) = v[k].as_str() {
                out.push(d.trim_start_matches("sha256:").to_owned());
            }
        }
    }
    out
}

/// The chunk entries of a host disk cache (`--cache-dir`, layout `docs/formats/cache.md`),
/// sorted by path.
pub fn cached_chunks(cache: &Path) -> Result<Vec<std::path::PathBuf>> {
    let mut out = Vec::new();
    for d in std::fs::read_dir(cache.join("v1/chunks"))? {
        for e in std::fs::read_dir(d?.path())? {
            out.push(e?.path());
        }
    }
    out.sort();
    Ok(out)
}

/// Counts of a source tree the way `inspect --json` documents them (inodes, a hard-link group
/// once): (files, directories incl. the root, symlinks, other nodes, logical bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SourceCounts {
    /// Regular-file inodes.
    pub files: u64,
    /// Directories, the root included.
    pub directories: u64,
    /// Symlink inodes.
    pub symlinks: u64,
    /// Device, FIFO and socket inodes.
    pub other_nodes: u64,
    /// Sum of regular-file sizes, once per inode.
    pub logical_bytes: u64,
}

/// Count a source tree.
pub fn source_counts(src: &Path) -> Result<SourceCounts> {
    let t = walk(src)?;
    let mut seen: BTreeMap<u64, Kind> = BTreeMap::new();
    let mut c = SourceCounts::default();
    for e in t.values() {
        if seen.insert(e.ino, e.kind).is_some() {
            continue;
        }
        match e.kind {
            Kind::File => {
                c.files += 1;
                c.logical_bytes += e.size;
            }
            Kind::Dir => c.directories += 1,
            Kind::Symlink => c.symlinks += 1,
            _ => c.other_nodes += 1,
        }
    }
    Ok(c)
}

/// Check `inspect --json` counts against the source tree.
pub fn check_counts(v: &serde_json::Value, src: &Path) -> Result<()> {
    let c = source_counts(src)?;
    let get = |k: &str| v[k].as_u64();
    ensure!(get("files") == Some(c.files), "inspect files != {} (source): {v}", c.files);
    ensure!(get("symlinks") == Some(c.symlinks), "inspect symlinks != {}: {v}", c.symlinks);
    ensure!(get("other_nodes") == Some(c.other_nodes), "inspect other_nodes != {}: {v}", c.other_nodes);
    let dirs: BTreeSet<u64> = [c.directories, c.directories - 1].into();
    ensure!(
        get("directories").is_some_and(|d| dirs.contains(&d)),
        "inspect directories not {} (with the root) or {} (without): {v}",
        c.directories,
        c.directories - 1
    );
    ensure!(
        get("logical_bytes") == Some(c.logical_bytes),
        "inspect logical_bytes != {}: {v}",
        c.logical_bytes
    );
    let used = c.files + c.directories + c.symlinks + c.other_nodes;
    ensure!(
        get("inodes_used").is_some_and(|u| u >= used + 10),
        "inspect inodes_used < {} + reserved: {v}",
        used
    );
    Ok(())
}

/// A local store holding one image built from a generated tree, and its raw export (what a
/// remote read must give back byte for byte). `t` holds `src/`, `store/` and `local.raw`.
#[derive(Debug)]
pub struct BuiltStore {
    pub t: tempfile::TempDir,
    pub store: std::path::PathBuf,
    pub id: crate::tessera::ImageId,
    pub local_raw: Vec<u8>,
}

/// [`BuiltStore`]: `tree` writes the source into the directory it is given; the image is built
/// with `--tag tag --chunk-size chunk_size` and exported locally.
pub fn built_store(
    name: &str,
    tag: &str,
    chunk_size: &str,
    tree: impl FnOnce(&Path) -> Result<()>,
) -> Result<BuiltStore> {
    let t = tmp(name)?;
    let (src, store) = (t.path().join("src"), t.path().join("store"));
    tree(&src)?;
    let id = crate::tessera::build(&src, &store, &["--tag", tag, "--chunk-size", chunk_size])?;
    let local = t.path().join("local.raw");
    crate::tessera::export(tag, &store, &local)?;
    let local_raw = std::fs::read(&local)?;
    Ok(BuiltStore { t, store, id, local_raw })
}

/// A child process (a daemon under test) killed and reaped when the test lets go of it without
/// having stopped it: a failed check must not leave it running.
#[derive(Debug)]
pub struct Killed(pub std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}
