//! Synthetic trees for the scaling measurements (issue 16 point 5: build and daemon memory per
//! entry): `entries` nodes (files, directories, symlinks, a few hard links) across a realistic
//! directory fan-out — most directories hold a handful to a few dozen entries, a few hold
//! hundreds to thousands (hash-indexed on disk) — mostly small files, optionally a few large ones.
//!
//! Deterministic: the same `entries` and `large` give the same names, content, modes and times (the
//! owner is whoever runs the generator). Fast enough for a million entries: one create, one write
//! and one `futimens` per file, no per-node bookkeeping kept after a directory is done.

use std::collections::VecDeque;
use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};

use crate::prng::Prng;

/// What a generated tree holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScaleTree {
    /// Every node except the root: files + dirs + symlinks (a hard link is not a node).
    pub entries: u64,
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    /// Extra names of existing files.
    pub hardlinks: u64,
    /// Content bytes of all regular files.
    pub bytes: u64,
}

/// The large files of a tree made with `large: true` (random content, one chunk list each).
pub const LARGE_FILES: [u64; 3] = [24 << 20, 40 << 20, 64 << 20];

fn time_of(n: u64) -> SystemTime {
    UNIX_EPOCH + Duration::new(1_600_000_000 + n * 7, ((n * 123_456_791) % 1_000_000_000) as u32)
}

/// How many children the next directory gets: mostly 3..=24, sometimes up to 120, rarely up to
/// 2000 (a `/usr/lib`, a `node_modules`).
fn fan_out(rng: &mut Prng) -> u64 {
    match rng.below(100) {
        0..=74 => rng.range(3, 24),
        75..=96 => rng.range(25, 120),
        _ => rng.range(300, 2000),
    }
}

/// A file's length: mostly under 1 KiB, a quarter up to 8 KiB, a few up to 48 KiB.
fn small_len(rng: &mut Prng) -> u64 {
    match rng.below(100) {
        0..=3 => 0,
        4..=69 => rng.range(1, 1024),
        70..=94 => rng.range(1025, 8192),
        _ => rng.range(8193, 48 << 10),
    }
}

/// Generate the tree at `dest` (replaced if it exists).
pub fn generate_scale_tree(dest: &Path, entries: u64, large: bool) -> Result<ScaleTree> {
    if dest.symlink_metadata().is_ok() {
        fs::remove_dir_all(dest).with_context(|| format!("remove {}", dest.display()))?;
    }
    fs::create_dir_all(dest).with_context(|| format!("create {}", dest.display()))?;
    let mut rng = Prng::from_label("scale-tree-v1");
    let mut st = ScaleTree::default();
    let mut stamp = 0u64;
    // Directories still to fill, breadth-first; every directory's time is set once it is full.
    let mut todo: VecDeque<PathBuf> = VecDeque::from([dest.to_path_buf()]);
    let mut done_dirs: Vec<PathBuf> = Vec::new();
    let mut last_file: Option<PathBuf> = None;
    let mut buf = Vec::new();
    if large {
        for (i, len) in LARGE_FILES.iter().enumerate() {
            let p = dest.join(format!("large{i}.bin"));
            let mut f = File::create(&p).with_context(|| format!("create {}", p.display()))?;
            let mut left = *len;
            let mut block = vec![0u8; 1 << 20];
            while left > 0 {
                let n = left.min(block.len() as u64) as usize;
                rng.fill(&mut block[..n]);
                f.write_all(&block[..n])?;
                left -= n as u64;
            }
            f.set_permissions(fs::Permissions::from_mode(0o644))?;
            stamp += 1;
            f.set_modified(time_of(stamp))?;
            st.files += 1;
            st.entries += 1;
            st.bytes += len;
        }
    }
    while st.entries < entries {
        let Some(dir) = todo.pop_front() else { break };
        let children = fan_out(&mut rng).min(entries - st.entries);
        // Keep at least one subdirectory queued while entries remain, so the walk never runs dry.
        let must_subdir = todo.is_empty() && st.entries + children < entries;
        for c in 0..children {
            stamp += 1;
            let pick = rng.below(100);
            if pick < 8 || (must_subdir && c == 0) {
                let p = dir.join(format!("d{stamp:x}"));
                fs::create_dir(&p).with_context(|| format!("create {}", p.display()))?;
                fs::set_permissions(&p, fs::Permissions::from_mode(0o755))?;
                todo.push_back(p);
                st.dirs += 1;
            } else if pick < 10 {
                let p = dir.join(format!("l{stamp:x}"));
                let target = format!("../lib/target-{}.so.{}", rng.below(1000), rng.below(10));
                std::os::unix::fs::symlink(&target, &p)
                    .with_context(|| format!("symlink {}", p.display()))?;
                rustix::fs::utimensat(
                    rustix::fs::CWD,
                    &p,
                    &timestamps(time_of(stamp)),
                    rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
                )
                .with_context(|| format!("set the times of {}", p.display()))?;
                st.symlinks += 1;
            } else {
                let ext = ["so", "py", "h", "txt", "conf", "js"][rng.below(6) as usize];
                let p = dir.join(format!("f{stamp:x}.{ext}"));
                let len = small_len(&mut rng);
                buf.clear();
                buf.extend_from_slice(format!("{stamp}\n").as_bytes());
                buf.extend_from_slice(&rng.text(len as usize));
                buf.truncate(len as usize);
                let mut f = File::create(&p).with_context(|| format!("create {}", p.display()))?;
                f.write_all(&buf)?;
                let mode = if rng.below(10) == 0 { 0o755 } else { 0o644 };
                f.set_permissions(fs::Permissions::from_mode(mode))?;
                f.set_modified(time_of(stamp))?;
                st.files += 1;
                st.bytes += len;
                if stamp % 500 == 0 {
                    if let Some(prev) = &last_file {
                        let h = dir.join(format!("h{stamp:x}"));
                        fs::hard_link(prev, &h).with_context(|| format!("link {}", h.display()))?;
                        st.hardlinks += 1;
                    }
                }
                last_file = Some(p);
            }
            st.entries += 1;
        }
        done_dirs.push(dir);
    }
    done_dirs.extend(todo);
    // Children first (the reverse of breadth-first order), so a parent's time is set last.
    for (i, d) in done_dirs.iter().enumerate().rev() {
        let f = File::open(d).with_context(|| format!("open {}", d.display()))?;
        f.set_modified(time_of(i as u64))?;
    }
    Ok(st)
}

fn timestamps(t: SystemTime) -> rustix::fs::Timestamps {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let ts = rustix::fs::Timespec { tv_sec: d.as_secs() as i64, tv_nsec: i64::from(d.subsec_nanos()) as _ };
    rustix::fs::Timestamps { last_access: ts, last_modification: ts }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_determinism() -> Result<()> {
        let t = tempfile::tempdir()?;
        let a = generate_scale_tree(&t.path().join("a"), 3000, false)?;
        assert_eq!(a.entries, 3000);
        assert_eq!(a.entries, a.files + a.dirs + a.symlinks);
        assert!(a.dirs > 50 && a.symlinks > 10 && a.hardlinks > 0, "{a:?}");
        let b = generate_scale_tree(&t.path().join("b"), 3000, false)?;
        assert_eq!(a, b);
        let (na, nb) = (
            crate::reference::tree_usage(&t.path().join("a"))?,
            crate::reference::tree_usage(&t.path().join("b"))?,
        );
        assert_eq!(na.0, nb.0);
        // entries + the root; hard links share inodes
        assert_eq!(na.0, a.entries + 1, "{na:?}");
        Ok(())
    }
}
