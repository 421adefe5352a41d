//! The outside judges: `e2fsck -fn`, the kernel (loop mounts, an rw workload) and ext4-view.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use rustix::fs::FlockOperation;

use crate::compare::{data_ranges, join};
use crate::prng::Prng;

/// The lock file that serializes loop mounts across test processes.
pub const LOOP_LOCK: &str = "/tmp/tessera-loop.lock";

/// Lines of `e2fsck -fn` output that fail the judge even when it exits 0.
pub fn e2fsck_bad_line(line: &str) -> bool {
    let l = line.trim_end();
    l.ends_with("? no")
        || l.contains("WARNING")
        || l.contains("in the future")
        || l.contains("could be narrower")
        || l.contains("could be shorter")
}

/// Run `e2fsck -fn IMG`: it must exit 0 and print no line matching
/// `\? no$|WARNING|in the future|could be (narrower|shorter)`. Returns the output.
pub fn e2fsck(img: &Path) -> Result<String> {
    let out = Command::new("e2fsck")
        .arg("-fn")
        .arg(img)
        .output()
        .context("run e2fsck (is e2fsprogs installed?)")?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let bad: Vec<&str> = text.lines().filter(|l| e2fsck_bad_line(l)).collect();
    if !out.status.success() || !bad.is_empty() {
        bail!(
            "e2fsck -fn {} failed ({}); offending lines: {:?}\n--- full output ---\n{}",
            img.display(),
            out.status,
            bad,
            text
        );
    }
    Ok(text)
}

/// `e2fsck -fy` on a sparse copy of `img` must exit 0 (nothing to fix at `-p` level either).
/// The copy is deleted; `img` is untouched.
pub fn e2fsck_fix_copy(img: &Path) -> Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("tessera-fsck-")
        .tempdir_in(img.parent().unwrap_or(Path::new("/tmp")))?;
    let copy = dir.path().join("copy.img");
    run(Command::new("cp").arg("--sparse=always").arg(img).arg(&copy))?;
    let out = Command::new("e2fsck").arg("-fy").arg(&copy).output()?;
    if !out.status.success() {
        bail!(
            "e2fsck -fy on a copy of {} exited {}:\n{}{}",
            img.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Run a command, failing with its output when it does not exit 0.
pub fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("spawn {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// An exclusive `flock` on [`LOOP_LOCK`]: one loop mount at a time across processes and threads
/// (each guard opens its own file description, so threads exclude each other too).
#[derive(Debug)]
pub struct LoopLock {
    _file: File,
}

impl LoopLock {
    /// Block until the lock is ours.
    pub fn acquire() -> Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(LOOP_LOCK)
            .with_context(|| format!("open {LOOP_LOCK}"))?;
        rustix::fs::flock(&file, FlockOperation::LockExclusive)
            .with_context(|| format!("flock {LOOP_LOCK}"))?;
        Ok(Self { _file: file })
    }
}

/// A loop mount that unmounts (and frees its loop device) when dropped.
#[derive(Debug)]
pub struct LoopMount {
    dir: Option<tempfile::TempDir>,
    _lock: LoopLock,
}

impl LoopMount {
    /// `mount -o loop,ro IMG DIR`.
    pub fn ro(img: &Path) -> Result<Self> {
        Self::mount(img, "loop,ro")
    }

    /// `mount -o loop IMG DIR` (read-write).
    pub fn rw(img: &Path) -> Result<Self> {
        Self::mount(img, "loop")
    }

    fn mount(img: &Path, opts: &str) -> Result<Self> {
        let lock = LoopLock::acquire()?;
        let dir = tempfile::Builder::new().prefix("tessera-mnt-").tempdir().context("mount point")?;
        run(Command::new("mount").arg("-t").arg("ext4").arg("-o").arg(opts).arg(img).arg(dir.path()))
            .with_context(|| format!("mount -o {opts} {}", img.display()))?;
        Ok(Self { dir: Some(dir), _lock: lock })
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        self.dir.as_ref().map_or(Path::new("/nonexistent"), |d| d.path())
    }

    fn do_unmount(&mut self) -> Result<()> {
        let Some(dir) = self.dir.take() else {
            return Ok(());
        };
        let mut last = String::new();
        for attempt in 0..50 {
            let out = Command::new("umount").arg(dir.path()).output()?;
            if out.status.success() {
                return Ok(());
            }
            last = String::from_utf8_lossy(&out.stderr).into_owned();
            // Busy right after a workload: poll, with a bound.
            std::thread::sleep(Duration::from_millis(20 * (attempt + 1)));
        }
        let path = dir.keep();
        bail!("umount {} failed: {last}", path.display())
    }

    /// Unmount now and report failure (dropping unmounts too, but cannot report).
    pub fn unmount(mut self) -> Result<()> {
        self.do_unmount()
    }
}

impl Drop for LoopMount {
    fn drop(&mut self) {
        if let Err(e) = self.do_unmount() {
            eprintln!("warning: {e:#}");
        }
    }
}

/// A tmpfs mount (for stores that are full or read-only), unmounted on drop.
#[derive(Debug)]
pub struct TmpfsMount {
    dir: Option<tempfile::TempDir>,
}

impl TmpfsMount {
    /// Mount a tmpfs of `size` (e.g. `"4M"`).
    pub fn new(size: &str) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("tessera-tmpfs-").tempdir()?;
        run(Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size={size},mode=0755"))
            .arg("tmpfs")
            .arg(dir.path()))?;
        Ok(Self { dir: Some(dir) })
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        self.dir.as_ref().map_or(Path::new("/nonexistent"), |d| d.path())
    }

    /// Remount read-only.
    pub fn remount_ro(&self) -> Result<()> {
        run(Command::new("mount").args(["-o", "remount,ro"]).arg(self.path()))?;
        Ok(())
    }
}

impl Drop for TmpfsMount {
    fn drop(&mut self) {
        if let Some(dir) = self.dir.take() {
            let _ = Command::new("umount").arg(dir.path()).status();
        }
    }
}

/// What the rw workload did.
#[derive(Debug, Default, Clone, Copy)]
pub struct WorkloadStats {
    /// Files created.
    pub created: u64,
    /// Bytes written.
    pub bytes: u64,
    /// Files deleted.
    pub deleted: u64,
    /// Files renamed.
    pub renamed: u64,
    /// Pre-existing entries touched (renamed, deleted, appended, or directories added to).
    pub existing_touched: u64,
}

/// A guest-like write workload on a read-write mount: create 1000 files worth 100 MB in new
/// directories, delete and rename some; then touch the image's own content: add and remove
/// entries in up to 50 existing directories (incl. large htree ones), rename and delete some
/// existing files, append to one; then `syncfs`. The caller unmounts and runs e2fsck.
pub fn rw_workload(mnt: &Path) -> Result<WorkloadStats> {
    let mut st = WorkloadStats::default();
    let mut rng = Prng::from_label("rw-workload");
    // Existing content first (before we add our own).
    let mut existing_dirs = Vec::new();
    let mut existing_files = Vec::new();
    let mut stack = vec![mnt.to_path_buf()];
    while let Some(d) = stack.pop() {
        if d.file_name().is_some_and(|n| n.as_bytes() == b"lost+found") {
            continue;
        }
        existing_dirs.push(d.clone());
        for e in fs::read_dir(&d).with_context(|| format!("readdir {}", d.display()))? {
            let e = e?;
            let ft = e.file_type()?;
            if ft.is_dir() {
                stack.push(e.path());
            } else if ft.is_file() {
                existing_files.push(e.path());
            }
        }
    }
    existing_dirs.sort();
    existing_files.sort();

    let base = mnt.join("tessera-workload");
    fs::create_dir(&base)?;
    let sub: Vec<PathBuf> = (0..10).map(|i| base.join(format!("d{i}"))).collect();
    for s in &sub {
        fs::create_dir(s)?;
    }
    let mut buf = vec![0u8; 910_000];
    let mut created = Vec::new();
    for i in 0..1000u64 {
        // 100 files of 910 000 bytes + 900 of 10 000 = 100 000 000 bytes.
        let len = if i % 10 == 0 { 910_000 } else { 10_000 };
        rng.fill(&mut buf[..len]);
        let p = sub[(i % 10) as usize].join(format!("f{i:04}"));
        fs::write(&p, &buf[..len]).with_context(|| format!("write {}", p.display()))?;
        st.created += 1;
        st.bytes += len as u64;
        created.push(p);
    }
    for (i, p) in created.iter().enumerate() {
        if i % 7 == 3 {
            fs::remove_file(p)?;
            st.deleted += 1;
        } else if i % 5 == 1 {
            let to = sub[(i + 3) % 10].join(format!("renamed-{i:04}"));
            fs::rename(p, &to)?;
            st.renamed += 1;
        }
    }
    // The image's own directories: add 20 entries to each of up to 50, then remove half.
    for d in existing_dirs.iter().take(50) {
        for j in 0..20 {
            let p = d.join(format!("tessera-added-{j:02}-{}", "z".repeat(j * 5)));
            fs::write(&p, format!("{j}\n"))?;
            if j % 2 == 0 {
                fs::remove_file(&p)?;
            }
        }
        st.existing_touched += 1;
    }
    // The image's own files: rename, delete, append.
    for (i, f) in existing_files.iter().enumerate().take(90) {
        match i % 3 {
            0 => {
                let mut to = f.clone().into_os_string();
                if f.file_name().map_or(0, |n| n.len()) > 240 {
                    to = f.with_file_name(format!("tessera-renamed-{i}")).into_os_string();
                } else {
                    to.push(".renamed");
                }
                fs::rename(f, &to)?;
            }
            1 => fs::remove_file(f)?,
            _ => {
                let mut h = OpenOptions::new().append(true).open(f)?;
                h.write_all(&[b'a'; 1000])?;
            }
        }
        st.existing_touched += 1;
    }
    let root = File::open(mnt)?;
    rustix::fs::syncfs(&root)?;
    Ok(st)
}

/// What ext4-view saw.
#[derive(Debug, Default, Clone)]
pub struct Ext4ViewReport {
    /// Entries compared.
    pub checked: u64,
    /// Bytes of file content compared.
    pub bytes: u64,
    /// Entries ext4-view rejected as documented (timestamps outside 1970..2038), with their paths.
    pub skipped: Vec<String>,
    /// Disagreements with the kernel.
    pub differences: Vec<String>,
}

fn in_ext4view_range(secs: i64) -> bool {
    (0..=i64::from(i32::MAX)).contains(&secs)
}

/// Read the image with ext4-view and compare every entry with the kernel's view under `mnt` (a
/// mount of the same image): type, permission bits, owner, size, mtime, symlink target and file
/// content (data ranges as the kernel reports them, plus a check that holes read as zeros).
/// Entries with a timestamp ext4-view documents it rejects (outside 1970..2038) are skipped and
/// listed; an error on any other entry is a difference.
pub fn ext4view_agrees(img: &Path, mnt: &Path) -> Result<Ext4ViewReport> {
    use ext4_view::{Ext4, PathBuf as XPath};
    let fs = Ext4::load_from_path(img).map_err(|e| anyhow::anyhow!("ext4-view load: {e}"))?;
    let mut rep = Ext4ViewReport::default();
    let mut stack: Vec<Vec<u8>> = vec![Vec::new()];
    while let Some(rel) = stack.pop() {
        let kpath = join(mnt, &rel);
        let xpath = {
            let mut b = b"/".to_vec();
            b.extend_from_slice(&rel);
            XPath::try_from(b).map_err(|e| anyhow::anyhow!("path {:?}: {e}", rel))?
        };
        let shown = format!("/{}", String::from_utf8_lossy(&rel));
        let kmd = fs::symlink_metadata(&kpath)?;
        let in_range = in_ext4view_range(kmd.mtime())
            && in_ext4view_range(kmd.atime())
            && in_ext4view_range(kmd.ctime());
        let xmd = match fs.symlink_metadata(&xpath) {
            Ok(m) => m,
            Err(e) => {
                if in_range {
                    rep.differences.push(format!("{shown}: ext4-view error: {e}"));
                } else {
                    rep.skipped.push(shown);
                }
                continue;
            }
        };
        rep.checked += 1;
        let mut diff = |what: &str, k: String, x: String| {
            if k != x {
                rep.differences.push(format!("{shown}: {what}: kernel {k} != ext4-view {x}"));
            }
        };
        let kft = kmd.file_type();
        let xft = xmd.file_type();
        let kind = |d: bool, f: bool, l: bool, c: bool, b: bool, p: bool, s: bool| {
            format!(
                "d{} f{} l{} c{} b{} p{} s{}",
                d as u8, f as u8, l as u8, c as u8, b as u8, p as u8, s as u8
            )
        };
        diff(
            "type",
            kind(
                kft.is_dir(),
                kft.is_file(),
                kft.is_symlink(),
                kft.is_char_device(),
                kft.is_block_device(),
                kft.is_fifo(),
                kft.is_socket(),
            ),
            kind(
                xft.is_dir(),
                xft.is_regular_file(),
                xft.is_symlink(),
                xft.is_char_dev(),
                xft.is_block_dev(),
                xft.is_fifo(),
                xft.is_socket(),
            ),
        );
        diff("mode", format!("{:o}", kmd.mode() & 0o7777), format!("{:o}", xmd.mode()));
        diff("uid", kmd.uid().to_string(), xmd.uid().to_string());
        diff("gid", kmd.gid().to_string(), xmd.gid().to_string());
        if !kft.is_dir() {
            diff("size", kmd.size().to_string(), xmd.len().to_string());
        }
        let xm = xmd.modified();
        diff(
            "mtime",
            format!("{}.{:09}", kmd.mtime(), kmd.mtime_nsec()),
            format!("{}.{:09}", xm.seconds(), xm.nanoseconds()),
        );
        if kft.is_symlink() {
            let kt = fs::read_link(&kpath)?.into_os_string().into_vec();
            match fs.read_link(&xpath) {
                Ok(xt) => diff(
                    "target",
                    String::from_utf8_lossy(&kt).into_owned(),
                    String::from_utf8_lossy(xt.as_ref()).into_owned(),
                ),
                Err(e) => rep.differences.push(format!("{shown}: read_link: {e}")),
            }
        } else if kft.is_file() {
            match compare_content(&fs, &xpath, &kpath, kmd.size()) {
                Ok(n) => rep.bytes += n,
                Err(e) => rep.differences.push(format!("{shown}: content: {e:#}")),
            }
        } else if kft.is_dir() {
            let mut names = Vec::new();
            match fs.read_dir(&xpath) {
                Ok(rd) => {
                    for e in rd {
                        match e {
                            Ok(e) => {
                                let n = e.file_name().as_ref().to_vec();
                                if n != b"." && n != b".." {
                                    names.push(n);
                                }
                            }
                            Err(e) => rep.differences.push(format!("{shown}: read_dir: {e}")),
                        }
                    }
                }
                Err(e) => rep.differences.push(format!("{shown}: read_dir: {e}")),
            }
            names.sort();
            let mut knames: Vec<Vec<u8>> = fs::read_dir(&kpath)?
                .map(|e| e.map(|e| e.file_name().into_vec()))
                .collect::<std::io::Result<_>>()?;
            knames.sort();
            if names != knames {
                rep.differences.push(format!(
                    "{shown}: entries: kernel {} names, ext4-view {}",
                    knames.len(),
                    names.len()
                ));
            }
            for n in knames.into_iter().rev() {
                let mut c = rel.clone();
                if !c.is_empty() {
                    c.push(b'/');
                }
                c.extend_from_slice(&n);
                stack.push(c);
            }
        }
    }
    Ok(rep)
}

fn compare_content(
    fs4: &ext4_view::Ext4,
    xpath: &ext4_view::PathBuf,
    kpath: &Path,
    size: u64,
) -> Result<u64> {
    use std::os::unix::fs::FileExt;
    let kf = File::open(kpath)?;
    let mut xf = fs4.open(xpath).map_err(|e| anyhow::anyhow!("open: {e}"))?;
    let mut ranges = data_ranges(&kf, size);
    // Also check that the first byte of every hole (and the last byte) reads as zero.
    let mut probes = Vec::new();
    let mut pos = 0;
    for &(s, e) in &ranges {
        if s > pos {
            probes.push(pos);
        }
        pos = e;
    }
    if pos < size {
        probes.push(pos);
        probes.push(size - 1);
    }
    for p in probes {
        ranges.push((p, p + 1));
    }
    let mut kb = vec![0u8; 1 << 20];
    let mut xb = vec![0u8; 1 << 20];
    let mut total = 0;
    for (s, e) in ranges {
        xf.seek_to(s).map_err(|e| anyhow::anyhow!("seek: {e}"))?;
        let mut pos = s;
        while pos < e {
            let n = ((e - pos) as usize).min(kb.len());
            kf.read_exact_at(&mut kb[..n], pos)?;
            let mut got = 0;
            while got < n {
                let r = xf
                    .read_bytes(&mut xb[got..n])
                    .map_err(|e| anyhow::anyhow!("read at {}: {e}", pos + got as u64))?;
                ensure!(r > 0, "ext4-view: early EOF at {}", pos + got as u64);
                got += r;
            }
            if kb[..n] != xb[..n] {
                let i = kb[..n].iter().zip(&xb[..n]).position(|(a, b)| a != b).unwrap_or(0);
                bail!("differs at byte {}", pos + i as u64);
            }
            pos += n as u64;
            total += n as u64;
        }
    }
    Ok(total)
}
