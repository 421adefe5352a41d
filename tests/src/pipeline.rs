//! The whole judge pipeline for one image built from one source tree.

use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::compare::{compare_trees, render, Difference};
use crate::judge::{
    e2fsck, e2fsck_fix_copy, ext4view_agrees, rw_workload, Ext4ViewReport, LoopMount, WorkloadStats,
};

/// What the pipeline saw.
#[derive(Debug, Default)]
pub struct Verdict {
    /// Differences source vs kernel mount that the caller allowed (empty for Tessera).
    pub allowed: Vec<Difference>,
    /// The ext4-view walk.
    pub ext4view: Ext4ViewReport,
    /// The rw workload.
    pub workload: WorkloadStats,
}

/// Judge `img` against `src`: `e2fsck -fn` clean (and `e2fsck -fy` on a copy exits 0) → `mount -o loop,ro` → compare with the source
/// (every difference must satisfy `allowed`; for Tessera nothing is allowed) → ext4-view agrees
/// with the kernel → unmount → mount rw, run the workload, unmount → `e2fsck -fn` clean again.
/// The image is modified by the workload (work on a copy if it matters).
pub fn judge_image(src: &Path, img: &Path, allowed: impl Fn(&Difference) -> bool) -> Result<Verdict> {
    let mut v = Verdict::default();
    e2fsck(img).context("e2fsck on the fresh image")?;
    e2fsck_fix_copy(img).context("e2fsck -fy on a copy of the fresh image")?;
    {
        let mnt = LoopMount::ro(img)?;
        let diffs = compare_trees(src, mnt.path())?;
        let (ok, bad): (Vec<_>, Vec<_>) = diffs.into_iter().partition(|d| allowed(d));
        if !bad.is_empty() {
            bail!(
                "{} difference(s) between the source {} and the mounted image {}:\n{}",
                bad.len(),
                src.display(),
                img.display(),
                render(&bad)
            );
        }
        v.allowed = ok;
        v.ext4view = ext4view_agrees(img, mnt.path())?;
        if !v.ext4view.differences.is_empty() {
            bail!(
                "ext4-view disagrees with the kernel on {}:\n{}",
                img.display(),
                v.ext4view.differences.join("\n")
            );
        }
        mnt.unmount()?;
    }
    {
        let mnt = LoopMount::rw(img)?;
        v.workload = rw_workload(mnt.path()).context("rw workload")?;
        mnt.unmount()?;
    }
    e2fsck(img).context("e2fsck after the rw workload")?;
    Ok(v)
}
