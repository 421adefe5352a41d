//! Compare two trees the way the judge sees them: every attribute Tessera promises to keep.
//!
//! Walks both trees without following symlinks and reports every difference on type, mode
//! (incl. setuid/setgid/sticky), uid, gid, size, mtime with nanoseconds, symlink target, device
//! numbers, xattrs in all namespaces (ACLs compared by value, as `getxattr` returns them),
//! hard-link groups and regular-file content. Content is compared over the union of both files'
//! data ranges (`SEEK_DATA`/`SEEK_HOLE`), so a 5 GiB sparse file compares in milliseconds.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::fmt;
use std::fs::{self, File};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rustix::fs::SeekFrom;

/// Node kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// Character device.
    Char,
    /// Block device.
    Block,
    /// FIFO.
    Fifo,
    /// Unix socket.
    Socket,
}

/// What is kept of one node.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Kind.
    pub kind: Kind,
    /// Permission bits (0o7777).
    pub perm: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Size (meaningful for files and symlinks).
    pub size: u64,
    /// mtime seconds.
    pub mtime: i64,
    /// mtime nanoseconds.
    pub mtime_nsec: i64,
    /// (major, minor) for devices.
    pub rdev: (u32, u32),
    /// Symlink target.
    pub target: Option<Vec<u8>>,
    /// Every xattr, by full name.
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    /// Inode number (for hard-link groups).
    pub ino: u64,
    /// Link count.
    pub nlink: u64,
}

/// Which attribute differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Field {
    /// Present in the source, absent in the image.
    Missing,
    /// Present in the image, absent in the source.
    Extra,
    /// File type.
    Kind,
    /// Permission bits.
    Mode,
    /// uid.
    Uid,
    /// gid.
    Gid,
    /// Size.
    Size,
    /// mtime whole seconds.
    MtimeSec,
    /// mtime nanoseconds only (seconds equal).
    MtimeNsec,
    /// Symlink target.
    Target,
    /// Device numbers.
    Rdev,
    /// Extended attribute (name in the detail).
    Xattr,
    /// Hard-link group.
    Links,
    /// Regular-file content.
    Content,
}

/// One difference between source and image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    /// Path relative to the tree root, as raw bytes (empty = the root itself).
    pub path: Vec<u8>,
    /// What differs.
    pub field: Field,
    /// Human-readable detail: source vs image values.
    pub detail: String,
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "/{:?}: {:?}: {}", OsStr::from_bytes(&self.path), self.field, self.detail)
    }
}

/// Render differences one per line (for assertion messages).
pub fn render(diffs: &[Difference]) -> String {
    let mut s = String::new();
    for d in diffs {
        s.push_str(&d.to_string());
        s.push('\n');
    }
    s
}

/// A tree's entries, keyed by relative path bytes ("" = root).
pub type Tree = BTreeMap<Vec<u8>, Entry>;

/// Read every xattr of a path (not following symlinks).
pub fn xattrs(path: &Path) -> Result<BTreeMap<Vec<u8>, Vec<u8>>> {
    let mut out = BTreeMap::new();
    let n = rustix::fs::llistxattr_query(path).with_context(|| format!("listxattr {}", path.display()))?;
    if n == 0 {
        return Ok(out);
    }
    let mut names = vec![0u8; n];
    let n = rustix::fs::llistxattr(path, &mut names[..])
        .with_context(|| format!("listxattr {}", path.display()))?;
    names.truncate(n);
    for name in names.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let os = OsStr::from_bytes(name);
        let len = rustix::fs::lgetxattr_query(path, os)
            .with_context(|| format!("getxattr {} {}", path.display(), String::from_utf8_lossy(name)))?;
        let mut v = vec![0u8; len];
        let got = if len == 0 {
            0
        } else {
            rustix::fs::lgetxattr(path, os, &mut v[..])
                .with_context(|| format!("getxattr {} {}", path.display(), String::from_utf8_lossy(name)))?
        };
        v.truncate(got);
        out.insert(name.to_vec(), v);
    }
    Ok(out)
}

/// lstat one node into an [`Entry`].
pub fn entry(path: &Path) -> Result<Entry> {
    let md = fs::symlink_metadata(path).with_context(|| format!("lstat {}", path.display()))?;
    let ft = md.file_type();
    let kind = if ft.is_file() {
        Kind::File
    } else if ft.is_dir() {
        Kind::Dir
    } else if ft.is_symlink() {
        Kind::Symlink
    } else if ft.is_char_device() {
        Kind::Char
    } else if ft.is_block_device() {
        Kind::Block
    } else if ft.is_fifo() {
        Kind::Fifo
    } else {
        Kind::Socket
    };
    let target = if kind == Kind::Symlink {
        Some(
            fs::read_link(path)
                .with_context(|| format!("readlink {}", path.display()))?
                .into_os_string()
                .into_vec(),
        )
    } else {
        None
    };
    let rdev = rustix::fs::Dev::from(md.rdev());
    Ok(Entry {
        kind,
        perm: md.mode() & 0o7777,
        uid: md.uid(),
        gid: md.gid(),
        size: md.size(),
        mtime: md.mtime(),
        mtime_nsec: md.mtime_nsec(),
        rdev: (rustix::fs::major(rdev), rustix::fs::minor(rdev)),
        target,
        xattrs: xattrs(path)?,
        ino: md.ino(),
        nlink: md.nlink(),
    })
}

use std::os::unix::ffi::OsStringExt;

/// Walk a tree (not following symlinks, sorted by name bytes).
pub fn walk(root: &Path) -> Result<Tree> {
    let mut tree = Tree::new();
    let mut stack: Vec<Vec<u8>> = vec![Vec::new()];
    while let Some(rel) = stack.pop() {
        let abs = join(root, &rel);
        let e = entry(&abs)?;
        let is_dir = e.kind == Kind::Dir;
        tree.insert(rel.clone(), e);
        if is_dir {
            let mut names: Vec<Vec<u8>> = fs::read_dir(&abs)
                .with_context(|| format!("readdir {}", abs.display()))?
                .map(|d| d.map(|d| d.file_name().into_vec()))
                .collect::<std::io::Result<_>>()
                .with_context(|| format!("readdir {}", abs.display()))?;
            names.sort();
            for n in names.into_iter().rev() {
                let mut child = rel.clone();
                if !child.is_empty() {
                    child.push(b'/');
                }
                child.extend_from_slice(&n);
                stack.push(child);
            }
        }
    }
    Ok(tree)
}

/// `root` joined with relative path bytes.
pub fn join(root: &Path, rel: &[u8]) -> PathBuf {
    if rel.is_empty() {
        root.to_path_buf()
    } else {
        root.join(OsStr::from_bytes(rel))
    }
}

/// Data ranges of a file `[start, end)` from SEEK_DATA/SEEK_HOLE (whole file if unsupported).
pub fn data_ranges(f: &File, size: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut pos = 0u64;
    while pos < size {
        let start = match rustix::fs::seek(f, SeekFrom::Data(pos)) {
            Ok(s) => s,
            Err(rustix::io::Errno::NXIO) => break,
            Err(_) => return vec![(0, size)],
        };
        let end = match rustix::fs::seek(f, SeekFrom::Hole(start)) {
            Ok(e) => e.min(size),
            Err(_) => size,
        };
        if end <= start {
            break;
        }
        out.push((start, end));
        pos = end;
    }
    out
}

fn union(mut a: Vec<(u64, u64)>, b: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    a.extend(b);
    a.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (s, e) in a {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// Compare two regular files' bytes; `Some(offset)` of the first difference.
pub fn first_content_difference(a: &Path, b: &Path, size: u64) -> Result<Option<u64>> {
    let fa = File::open(a).with_context(|| format!("open {}", a.display()))?;
    let fb = File::open(b).with_context(|| format!("open {}", b.display()))?;
    let ranges = union(data_ranges(&fa, size), data_ranges(&fb, size));
    const BUF: usize = 1 << 20;
    let mut ba = vec![0u8; BUF];
    let mut bb = vec![0u8; BUF];
    for (start, end) in ranges {
        let mut pos = start;
        while pos < end {
            let n = ((end - pos) as usize).min(BUF);
            fa.read_exact_at(&mut ba[..n], pos).with_context(|| format!("read {} at {pos}", a.display()))?;
            fb.read_exact_at(&mut bb[..n], pos).with_context(|| format!("read {} at {pos}", b.display()))?;
            if ba[..n] != bb[..n] {
                let i = ba[..n].iter().zip(&bb[..n]).position(|(x, y)| x != y).unwrap_or(0);
                return Ok(Some(pos + i as u64));
            }
            pos += n as u64;
        }
    }
    // Past EOF both must end: a longer file shows up as a size difference.
    Ok(None)
}

fn show(v: &[u8]) -> String {
    if v.len() > 64 {
        format!("{} bytes {:?}...", v.len(), OsStr::from_bytes(&v[..64]))
    } else {
        format!("{:?}", OsStr::from_bytes(v))
    }
}

/// Hard-link groups: for every non-directory path whose inode has other names in the tree, the
/// sorted set of its names.
fn link_groups(t: &Tree) -> BTreeMap<Vec<u8>, BTreeSet<Vec<u8>>> {
    let mut by_ino: BTreeMap<u64, BTreeSet<Vec<u8>>> = BTreeMap::new();
    for (p, e) in t {
        if e.kind != Kind::Dir {
            by_ino.entry(e.ino).or_default().insert(p.clone());
        }
    }
    let mut out = BTreeMap::new();
    for group in by_ino.values() {
        for p in group {
            out.insert(p.clone(), group.clone());
        }
    }
    out
}

/// Compare `source` (the input tree) with `image` (e.g. the mounted image). `lost+found` at the
/// image root is ignored when the source has none. Directory sizes and link counts are not
/// compared (they depend on the filesystem's layout); everything else is.
pub fn compare_trees(source: &Path, image: &Path) -> Result<Vec<Difference>> {
    let a = walk(source)?;
    let mut b = walk(image)?;
    if !a.contains_key(b"lost+found".as_slice()) {
        let lf: Vec<Vec<u8>> = b
            .keys()
            .filter(|k| k.as_slice() == b"lost+found" || k.starts_with(b"lost+found/"))
            .cloned()
            .collect();
        for k in lf {
            b.remove(&k);
        }
    }
    let mut diffs = Vec::new();
    let mut d = |path: &[u8], field: Field, detail: String| {
        diffs.push(Difference { path: path.to_vec(), field, detail })
    };
    for p in a.keys() {
        if !b.contains_key(p) {
            d(p, Field::Missing, "in the source, not in the image".into());
        }
    }
    for p in b.keys() {
        if !a.contains_key(p) {
            d(p, Field::Extra, "in the image, not in the source".into());
        }
    }
    let (la, lb) = (link_groups(&a), link_groups(&b));
    for (p, ea) in &a {
        let Some(eb) = b.get(p) else { continue };
        if ea.kind != eb.kind {
            d(p, Field::Kind, format!("{:?} != {:?}", ea.kind, eb.kind));
            continue;
        }
        if ea.perm != eb.perm {
            d(p, Field::Mode, format!("{:04o} != {:04o}", ea.perm, eb.perm));
        }
        if ea.uid != eb.uid {
            d(p, Field::Uid, format!("{} != {}", ea.uid, eb.uid));
        }
        if ea.gid != eb.gid {
            d(p, Field::Gid, format!("{} != {}", ea.gid, eb.gid));
        }
        if ea.kind != Kind::Dir && ea.size != eb.size {
            d(p, Field::Size, format!("{} != {}", ea.size, eb.size));
        }
        if ea.mtime != eb.mtime {
            d(
                p,
                Field::MtimeSec,
                format!("{}.{:09} != {}.{:09}", ea.mtime, ea.mtime_nsec, eb.mtime, eb.mtime_nsec),
            );
        } else if ea.mtime_nsec != eb.mtime_nsec {
            d(
                p,
                Field::MtimeNsec,
                format!("{}.{:09} != {}.{:09}", ea.mtime, ea.mtime_nsec, eb.mtime, eb.mtime_nsec),
            );
        }
        if ea.target != eb.target {
            d(
                p,
                Field::Target,
                format!(
                    "{} != {}",
                    show(ea.target.as_deref().unwrap_or_default()),
                    show(eb.target.as_deref().unwrap_or_default())
                ),
            );
        }
        if matches!(ea.kind, Kind::Char | Kind::Block) && ea.rdev != eb.rdev {
            d(p, Field::Rdev, format!("{}:{} != {}:{}", ea.rdev.0, ea.rdev.1, eb.rdev.0, eb.rdev.1));
        }
        let names: BTreeSet<&Vec<u8>> = ea.xattrs.keys().chain(eb.xattrs.keys()).collect();
        for n in names {
            let (va, vb) = (ea.xattrs.get(n), eb.xattrs.get(n));
            if va != vb {
                let f = |v: Option<&Vec<u8>>| v.map_or("absent".to_string(), |v| show(v));
                d(p, Field::Xattr, format!("{}: {} != {}", String::from_utf8_lossy(n), f(va), f(vb)));
            }
        }
        if ea.kind != Kind::Dir {
            let (ga, gb) = (la.get(p), lb.get(p));
            if ga != gb {
                let f = |g: Option<&BTreeSet<Vec<u8>>>| {
                    g.map_or(String::new(), |g| {
                        g.iter().map(|x| format!("{:?}", OsStr::from_bytes(x))).collect::<Vec<_>>().join(", ")
                    })
                };
                d(p, Field::Links, format!("{{{}}} != {{{}}}", f(ga), f(gb)));
            }
        }
        if ea.kind == Kind::File && ea.size == eb.size {
            if let Some(off) = first_content_difference(&join(source, p), &join(image, p), ea.size)? {
                d(p, Field::Content, format!("first difference at byte {off}"));
            }
        }
    }
    Ok(diffs)
}
