//! A realistic OCI image: a Debian minbase root filesystem made with `debootstrap`, split into
//! several layers with `umoci` (issue 3, point 6).
//!
//! The root filesystem is made once per machine and cached outside the clone as a tarball,
//! `/var/cache/tessera-test/debootstrap-<recipe hash>/rootfs.tar` (or under `$TESSERA_TEST_CACHE`),
//! keyed by its recipe: variant, suite, mirror, debootstrap's version and the tar format. It is
//! built under a temporary name and renamed into place, so an interrupted run never leaves a half
//! cache. The mirror is the Debian URI of the machine's apt sources (or `$TESSERA_DEBIAN_MIRROR`).
//!
//! [`make_image`] then writes the layers with `umoci repack --refresh-bundle` on one bundle:
//!
//! 1. the base without `/usr/share/doc` and `/var`;
//! 2. `/usr/share/doc` and `/var` added back (so `/usr/share` and `/` change as directories);
//! 3. changes that make whiteouts and replacements: `apt-get clean` (the `.deb`s and caches go),
//!    docs of the `lib*` packages removed, a hard link removed and one added to a lower file,
//!    file → directory, directory → symlink, metadata-only changes, xattrs, ns mtimes, a new
//!    user with a home, new and duplicated data.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use sha2::{Digest, Sha256};

use crate::compare::{self, Difference, Field, Kind};
use crate::judge::run;
use crate::oci::UmociImage;

/// The debootstrap variant and suite.
pub const VARIANT: &str = "minbase";
/// The Debian suite.
pub const SUITE: &str = "bookworm";
/// What [`make_image`] does to the root filesystem; bumped whenever the layers change (benchmarks
/// key their cached layout by it).
pub const IMAGE_RECIPE: &str = "make_image v1: base -doc -var | +doc +var | changes (tessera_e2e::debian)";
/// Bumped whenever the way the tarball is made changes.
const FORMAT: &str = "tar --format=posix --xattrs --xattrs-include=* --numeric-owner --sort=name (v1)";
/// An upper bound for debootstrap itself (about 2 minutes on the project's machines).
const DEBOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(20 * 60);

/// Where the cached Debian roots (and what is made from them) live: `$TESSERA_TEST_CACHE`, else
/// `/var/cache/tessera-test`.
pub fn cache_root() -> PathBuf {
    std::env::var_os("TESSERA_TEST_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/tessera-test"))
}

/// The Debian mirror: `$TESSERA_DEBIAN_MIRROR`, else the first non-security URI of the machine's
/// deb822 sources (or a one-line `deb` source), else deb.debian.org.
pub fn mirror() -> String {
    if let Some(m) = std::env::var_os("TESSERA_DEBIAN_MIRROR") {
        return m.to_string_lossy().into_owned();
    }
    let deb822 = fs::read_to_string("/etc/apt/sources.list.d/debian.sources").unwrap_or_default();
    let from_deb822 = deb822
        .lines()
        .filter_map(|l| l.strip_prefix("URIs:"))
        .flat_map(str::split_whitespace)
        .find(|u| !u.contains("security"))
        .map(str::to_owned);
    let list = fs::read_to_string("/etc/apt/sources.list").unwrap_or_default();
    let from_list = list.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        (w.next() == Some("deb")).then_some(())?;
        let uri = w.find(|x| !x.starts_with('['))?;
        (!uri.contains("security")).then(|| uri.to_owned())
    });
    from_deb822.or(from_list).unwrap_or_else(|| "http://deb.debian.org/debian".to_owned())
}

fn debootstrap_version() -> Result<String> {
    let out = Command::new("debootstrap").arg("--version").output();
    let out = match out {
        Ok(o) if o.status.success() => o,
        _ => bail!("debootstrap not found: install the Debian package debootstrap (cargo xtask test does)"),
    };
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The recipe of the cached root filesystem (its hash names the cache directory).
pub fn recipe() -> Result<String> {
    Ok(format!(
        "debootstrap --variant={VARIANT} {SUITE} DIR {}\n{}\n{FORMAT}\n",
        mirror(),
        debootstrap_version()?
    ))
}

/// `debootstrap-<first 16 hex digits of sha256(recipe)>`.
pub fn cache_dir() -> Result<PathBuf> {
    let hash = hex::encode(Sha256::digest(recipe()?.as_bytes()));
    Ok(cache_root().join(format!("debootstrap-{}", &hash[..16])))
}

/// Unmount everything mounted at or below `dir` (debootstrap mounts /proc and /sys inside its
/// target; a killed run can leave them).
pub fn unmount_below(dir: &Path) {
    let Ok(mounts) = fs::read_to_string("/proc/self/mounts") else { return };
    let prefix = dir.to_string_lossy().into_owned();
    let mut points: Vec<&str> = mounts
        .lines()
        .filter_map(|l| l.split(' ').nth(1))
        .filter(|p| *p == prefix || p.starts_with(&format!("{prefix}/")))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in points {
        let _ = Command::new("umount").arg("-l").arg(p).status();
    }
}

/// Remove temporary directories of earlier, dead runs (`.debootstrap-<hash>.<pid>`).
fn remove_stale(final_dir: &Path) -> Result<()> {
    let root = final_dir.parent().context("cache dir has no parent")?;
    let name = final_dir.file_name().context("cache dir has no name")?.to_string_lossy().into_owned();
    let prefix = format!(".{name}.");
    let Ok(entries) = fs::read_dir(root) else { return Ok(()) };
    for e in entries.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = n.strip_prefix(&prefix) else { continue };
        if Path::new("/proc").join(pid).exists() {
            continue;
        }
        eprintln!("debian: removing the stale {}", e.path().display());
        unmount_below(&e.path());
        fs::remove_dir_all(e.path()).with_context(|| format!("remove {}", e.path().display()))?;
    }
    Ok(())
}

/// The cached root filesystem as a tarball (made now if missing: about 2 minutes of
/// `debootstrap`, needs root and the Debian mirror).
pub fn rootfs_tarball() -> Result<PathBuf> {
    let dir = cache_dir()?;
    let tarball = dir.join("rootfs.tar");
    if tarball.is_file() {
        return Ok(tarball);
    }
    crate::fixtures::require_root()?;
    fs::create_dir_all(cache_root())?;
    remove_stale(&dir)?;
    let recipe = recipe()?;
    let name = dir.file_name().context("cache dir has no name")?.to_string_lossy().into_owned();
    let tmp = cache_root().join(format!(".{name}.{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)?;
    let root = tmp.join("root");
    let started = Instant::now();
    eprintln!(
        "debian: debootstrap --variant={VARIANT} {SUITE} {} {} (cached afterwards)",
        root.display(),
        mirror()
    );
    let mut last = None;
    for attempt in 1..=2 {
        unmount_below(&root);
        let _ = fs::remove_dir_all(&root);
        let out = Command::new("timeout")
            .args(["--kill-after=30", &DEBOOTSTRAP_TIMEOUT.as_secs().to_string(), "debootstrap"])
            .arg(format!("--variant={VARIANT}"))
            .arg(SUITE)
            .arg(&root)
            .arg(mirror())
            .env("DEBIAN_FRONTEND", "noninteractive")
            .output()
            .context("spawn debootstrap")?;
        if out.status.success() {
            last = None;
            break;
        }
        let log = fs::read_to_string(root.join("debootstrap/debootstrap.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect();
        let msg = format!(
            "debootstrap failed (attempt {attempt}, {}): {}\n{}\n--- debootstrap.log (end) ---\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or(""),
            String::from_utf8_lossy(&out.stderr),
            tail.join("\n")
        );
        eprintln!("debian: {msg}");
        last = Some(msg);
    }
    unmount_below(&root);
    if let Some(msg) = last {
        bail!("{msg}");
    }
    run(Command::new("tar")
        .args([
            "--create",
            "--format=posix",
            "--xattrs",
            "--xattrs-include=*",
            "--numeric-owner",
            "--sort=name",
        ])
        .arg("--file")
        .arg(tmp.join("rootfs.tar"))
        .arg("-C")
        .arg(&root)
        .arg("."))?;
    fs::remove_dir_all(&root)?;
    fs::write(tmp.join("recipe"), &recipe)?;
    if let Err(e) = fs::rename(&tmp, &dir) {
        // Another run finished first: use its cache.
        let _ = fs::remove_dir_all(&tmp);
        ensure!(tarball.is_file(), "rename {} → {}: {e}", tmp.display(), dir.display());
    }
    eprintln!("debian: cached {} in {:.0}s", tarball.display(), started.elapsed().as_secs_f64());
    Ok(tarball)
}

/// Extract (members of) the cached tarball into `dest`, with owners, modes, times and xattrs.
pub fn extract(tarball: &Path, dest: &Path, args: &[&str]) -> Result<()> {
    run(Command::new("tar")
        .args(["--extract", "--xattrs", "--xattrs-include=*", "--numeric-owner", "--same-owner"])
        .arg("--same-permissions")
        .arg("--file")
        .arg(tarball)
        .arg("-C")
        .arg(dest)
        .args(args))?;
    Ok(())
}

/// The layer-3 changes (see the module documentation). Everything named here must exist in a
/// minbase root, so that a changed Debian fails loudly instead of silently testing less.
fn change_top(root: &Path) -> Result<()> {
    let p = |rel: &str| root.join(rel);
    let must = |rel: &str| -> Result<PathBuf> {
        let path = root.join(rel);
        ensure!(path.symlink_metadata().is_ok(), "the minbase root has no {rel}");
        Ok(path)
    };
    // apt-get clean: many whiteouts over large lower files.
    let mut debs = 0;
    for e in fs::read_dir(must("var/cache/apt/archives")?)? {
        let e = e?;
        if e.file_name().to_string_lossy().ends_with(".deb") {
            fs::remove_file(e.path())?;
            debs += 1;
        }
    }
    ensure!(debs > 50, "only {debs} .deb files in var/cache/apt/archives");
    for e in fs::read_dir(p("var/cache/apt"))? {
        let e = e?;
        if e.file_name().to_string_lossy().ends_with(".bin") {
            fs::remove_file(e.path())?;
        }
    }
    // Whole directories whited out.
    let mut docs = 0;
    for e in fs::read_dir(must("usr/share/doc")?)? {
        let e = e?;
        if e.file_name().to_string_lossy().starts_with("lib") && e.file_type()?.is_dir() {
            fs::remove_dir_all(e.path())?;
            docs += 1;
        }
    }
    ensure!(docs > 10, "only {docs} lib* docs");
    fs::remove_dir_all(must("usr/share/locale/af")?)?;
    // A hard link removed (gunzip keeps the inode); a new link to a file of a lower layer.
    fs::remove_file(must("usr/bin/uncompress")?)?;
    fs::hard_link(must("usr/bin/perl")?, p("usr/local/bin/perl-again"))?;
    // file → directory, directory → symlink, symlink → file.
    fs::remove_file(must("etc/motd")?)?;
    fs::create_dir(p("etc/motd"))?;
    fs::write(p("etc/motd/00-tessera"), b"Built by tessera from a layered Debian image.\n")?;
    // The symlink's target must share no names with the directory it replaces: `umoci repack`
    // writes the old directory's whiteouts *after* the new symlink (`doc/bash -> X`, then
    // `doc/bash/.wh.copyright`, …) and `umoci unpack` resolves them through that symlink, deleting
    // `X/copyright` — tessera applies a layer's whiteouts to the lower layers first, as the
    // image spec says, and keeps it. With no shared names both agree.
    fs::remove_dir_all(must("usr/share/doc/bash")?)?;
    std::os::unix::fs::symlink("../bash-completion", p("usr/share/doc/bash"))?;
    fs::remove_file(must("var/lock")?)?;
    fs::write(p("var/lock"), b"not a symlink any more\n")?;
    // Metadata-only changes.
    fs::set_permissions(must("etc/shadow")?, fs::Permissions::from_mode(0o400))?;
    std::os::unix::fs::chown(must("var/mail")?, Some(8), Some(0))?;
    crate::fixtures::set_mtime(&must("etc/debian_version")?, 1_700_000_000, 123_456_789)?;
    // Content changes and additions.
    fs::write(must("etc/hostname")?, b"tessera-e2e\n")?;
    let append = |rel: &str, line: &str| -> Result<()> {
        let mut s = fs::read_to_string(must(rel)?)?;
        s.push_str(line);
        fs::write(p(rel), s)?;
        Ok(())
    };
    append("etc/passwd", "tessera:x:1000:1000:Tessera:/home/tessera:/bin/bash\n")?;
    append("etc/group", "tessera:x:1000:\n")?;
    append("var/log/dpkg.log", "2026-11-30 12:00:00 status installed tessera:amd64 1.0\n")?;
    let home = p("home/tessera");
    fs::create_dir(&home)?;
    fs::set_permissions(&home, fs::Permissions::from_mode(0o700))?;
    fs::write(home.join(".profile"), b"export PATH=/usr/local/bin:$PATH\n")?;
    std::os::unix::fs::chown(home.join(".profile"), Some(1000), Some(1000))?;
    std::os::unix::fs::chown(&home, Some(1000), Some(1000))?;
    let cap = b"\x01\x00\x00\x02\x00\x20\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00";
    rustix::fs::lsetxattr(
        must("usr/bin/sleep")?,
        "security.capability",
        cap,
        rustix::fs::XattrFlags::empty(),
    )?;
    rustix::fs::lsetxattr(p("etc/hostname"), "user.origin", b"tessera e2e", rustix::fs::XattrFlags::empty())?;
    let mut rng = crate::prng::Prng::new(0xDEB1A);
    let mut blob = vec![0u8; 3 << 20];
    rng.fill(&mut blob);
    fs::create_dir(p("opt/data"))?;
    fs::write(p("opt/data/blob.bin"), &blob)?;
    fs::write(p("opt/data/blob-copy.bin"), &blob)?;
    fs::write(p("opt/data/zeros.bin"), vec![0u8; 1 << 20])?;
    Ok(())
}

/// `umoci repack --refresh-bundle`: add the bundle's changes as a layer, keep the bundle.
fn repack(img: &UmociImage, bundle: &Path) -> Result<()> {
    run(Command::new("umoci")
        .args(["repack", "--refresh-bundle", "--image"])
        .arg(img.image_ref())
        .arg(bundle))?;
    Ok(())
}

/// The layered Debian image in an OCI layout under `work` (`work/layout`, tag `tag`); see the
/// module documentation. Takes about a minute on 2 cores once the root filesystem is cached.
pub fn make_image(work: &Path, tag: &str) -> Result<UmociImage> {
    let tarball = rootfs_tarball()?;
    let img = UmociImage::new(work, tag)?;
    let bundle = work.join("debian-bundle");
    let _ = fs::remove_dir_all(&bundle);
    run(Command::new("umoci").arg("unpack").arg("--image").arg(img.image_ref()).arg(&bundle))?;
    let rootfs = bundle.join("rootfs");
    let t = Instant::now();
    extract(&tarball, &rootfs, &["--exclude=./usr/share/doc", "--exclude=./var"])?;
    repack(&img, &bundle)?;
    eprintln!("debian: layer 1 (base without doc and var) in {:.1}s", t.elapsed().as_secs_f64());
    let t = Instant::now();
    extract(&tarball, &rootfs, &["./usr/share/doc", "./var"])?;
    repack(&img, &bundle)?;
    eprintln!("debian: layer 2 (doc and var) in {:.1}s", t.elapsed().as_secs_f64());
    let t = Instant::now();
    change_top(&rootfs)?;
    repack(&img, &bundle)?;
    eprintln!("debian: layer 3 (changes and whiteouts) in {:.1}s", t.elapsed().as_secs_f64());
    fs::remove_dir_all(&bundle)?;
    Ok(img)
}

/// The only difference allowed between `umoci unpack`'s rootfs and the image: directory mtimes
/// (umoci sets them as it unpacks).
pub fn only_dir_mtimes(d: &Difference, reference: &Path) -> bool {
    if !matches!(d.field, Field::MtimeSec | Field::MtimeNsec) {
        return false;
    }
    compare::entry(&compare::join(reference, &d.path)).is_ok_and(|e| e.kind == Kind::Dir)
}
