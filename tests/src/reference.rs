//! The reference builder, `mkfs.ext4 -d`: validates the harness before (and beside) Tessera.
//!
//! Running the whole judge pipeline on `mkfs.ext4 -d` images proves that the comparator finds
//! real differences (what mkfs loses, see [`MKFS_KNOWN_LOSSES`]) and has no false positives
//! otherwise, and that the mount/workload/e2fsck machinery works, without the CLI.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};

use crate::compare::{Difference, Field};
use crate::judge::run;

/// Entries and allocated bytes of a tree (not following symlinks; hard links counted once).
pub fn tree_usage(root: &Path) -> Result<(u64, u64)> {
    let mut entries = 0;
    let mut bytes = 0;
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let md = fs::symlink_metadata(&p).with_context(|| format!("lstat {}", p.display()))?;
        if !seen.insert(md.ino()) {
            continue;
        }
        entries += 1;
        bytes += md.blocks() * 512;
        if md.is_dir() {
            for e in fs::read_dir(&p)? {
                stack.push(e?.path());
            }
        }
    }
    Ok((entries, bytes))
}

/// Size (bytes) and inode count for a reference image of `src` with room for the rw workload
/// (≥ 256 MiB free plus the data twice over; 8192 spare inodes).
pub fn reference_geometry(src: &Path) -> Result<(u64, u64)> {
    let (entries, bytes) = tree_usage(src)?;
    let size = (bytes * 2 + 384 * (1 << 20)).div_ceil(1 << 20) << 20;
    Ok((size, entries + 8192))
}

/// Build `img` from `src` with `mkfs.ext4 -d` (default features from /etc/mke2fs.conf, but 4 KiB
/// blocks and 256-byte inodes like Tessera: under 512 MiB mke2fs would otherwise pick the "small"
/// type with 1 KiB blocks and 128-byte inodes, which cannot hold a 4095-byte symlink or a
/// 3000-byte xattr).
pub fn mkfs_image(src: &Path, img: &Path) -> Result<()> {
    let (size, inodes) = reference_geometry(src)?;
    let _ = fs::remove_file(img);
    run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-b", "4096", "-I", "256", "-E"])
        .arg("lazy_itable_init=0,lazy_journal_init=0")
        .arg("-N")
        .arg(inodes.to_string())
        .arg("-d")
        .arg(src)
        .arg(img)
        .arg(format!("{}k", size / 1024)))
    .with_context(|| format!("mkfs.ext4 -d {}", src.display()))?;
    Ok(())
}

/// What `mkfs.ext4 -d` (e2fsprogs 1.47.0) is known to lose, as found by this harness (see
/// `fixtures/README.md`). The self-test asserts that mkfs images differ from the source *only*
/// in these ways, and that on the `kinds` fixture the comparator does report each of them.
pub const MKFS_KNOWN_LOSSES: &[&str] = &[
    "nanoseconds of every mtime are dropped (MtimeNsec)",
    "times after 2038-01-19 are stored without the extra epoch bits, so they read back wrapped \
     to 32 bits (MtimeSec)",
    "the root directory's own mode, owner and mtime are not copied (its xattrs are) (path \"\")",
    "hard links to a symlink become separate symlinks (Links)",
];

fn mtime_secs(detail: &str) -> Option<(i64, i64)> {
    let (a, b) = detail.split_once(" != ")?;
    let secs = |x: &str| x.split('.').next()?.parse::<i64>().ok();
    Some((secs(a)?, secs(b)?))
}

/// A predicate accepting exactly the differences in [`MKFS_KNOWN_LOSSES`] for source `src`.
pub fn mkfs_known_loss(src: &Path) -> impl Fn(&Difference) -> bool + '_ {
    move |d: &Difference| match d.field {
        _ if d.path.is_empty() => true,
        Field::MtimeNsec => true,
        Field::MtimeSec => {
            mtime_secs(&d.detail).is_some_and(|(s, i)| s > i64::from(i32::MAX) && i64::from(s as i32) == i)
        }
        Field::Links => {
            fs::symlink_metadata(crate::compare::join(src, &d.path)).is_ok_and(|m| m.file_type().is_symlink())
        }
        _ => false,
    }
}
