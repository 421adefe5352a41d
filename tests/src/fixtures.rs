//! Deterministic fixture trees: every input the end-to-end tests build images from.
//!
//! Each fixture is code (no wall clock, no randomness that is not seeded by the fixture's name), so
//! `cargo xtask fixtures` regenerates byte-identical trees with identical metadata, and the same
//! fixture built twice must give the same image ID. Every fixture says which code path it targets
//! ([`Fixture::targets`]); failures then point somewhere.
//!
//! Generation needs root (devices, owners, `trusted.`/`security.` xattrs, capabilities).

use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use rustix::fs::{AtFlags, FileType, Mode, Timespec, Timestamps, XattrFlags, CWD};

use crate::prng::Prng;

/// 1 KiB, 1 MiB, 1 GiB.
pub const KIB: u64 = 1024;
/// One mebibyte.
pub const MIB: u64 = 1024 * KIB;
/// One gibibyte.
pub const GIB: u64 = 1024 * MIB;

/// Attributes for one generated node. Defaults: mode 0644 (files) / 0755 (dirs), owner 0:0, and a
/// deterministic mtime with nanoseconds, distinct per node.
#[derive(Debug, Clone, Default)]
pub struct Meta {
    mode: Option<u32>,
    uid: u32,
    gid: u32,
    mtime: Option<(i64, i64)>,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Meta {
    /// Default attributes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Attributes with these permission bits (incl. setuid/setgid/sticky).
    pub fn mode(mode: u32) -> Self {
        Self::new().with_mode(mode)
    }

    /// Set the permission bits.
    pub fn with_mode(mut self, mode: u32) -> Self {
        self.mode = Some(mode);
        self
    }

    /// Set the owner.
    pub fn owner(mut self, uid: u32, gid: u32) -> Self {
        self.uid = uid;
        self.gid = gid;
        self
    }

    /// Set the mtime (seconds may be negative; nanoseconds `0..1e9`).
    pub fn mtime(mut self, secs: i64, nsec: i64) -> Self {
        self.mtime = Some((secs, nsec));
        self
    }

    /// Add an extended attribute (full name, e.g. `user.x`).
    pub fn xattr(mut self, name: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Self {
        self.xattrs.push((name.as_ref().to_vec(), value.as_ref().to_vec()));
        self
    }
}

#[derive(Debug)]
struct Pending {
    path: PathBuf,
    is_dir: bool,
    is_symlink: bool,
    depth: usize,
    meta: Meta,
}

/// Creates nodes under a root and applies their attributes at the end, in the order that keeps
/// them: owner, then mode (chown clears setuid/setgid and capabilities), then xattrs, then times
/// (non-directories first, directories deepest first, so that filling a directory does not bump
/// its mtime afterwards).
#[derive(Debug)]
pub struct Gen {
    root: PathBuf,
    /// The fixture's own random stream.
    pub rng: Prng,
    pending: Vec<Pending>,
    root_meta: Meta,
    counter: i64,
}

impl Gen {
    /// Start a tree at `root` (created; must not exist).
    pub fn new(root: &Path, seed_label: &str) -> Result<Self> {
        fs::create_dir_all(root).with_context(|| format!("create {}", root.display()))?;
        Ok(Self {
            root: root.to_path_buf(),
            rng: Prng::from_label(seed_label),
            pending: Vec::new(),
            root_meta: Meta::mode(0o755),
            counter: 0,
        })
    }

    /// The tree's root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Absolute path of a node.
    pub fn abs(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.root.join(rel)
    }

    fn record(&mut self, rel: &Path, is_dir: bool, is_symlink: bool, mut meta: Meta) {
        self.counter += 1;
        if meta.mtime.is_none() {
            // 2020-09-13 plus a step per node, with nanoseconds that vary.
            meta.mtime =
                Some((1_600_000_000 + self.counter * 3_607, (self.counter * 123_456_791) % 1_000_000_000));
        }
        if meta.mode.is_none() {
            meta.mode = Some(if is_dir { 0o755 } else { 0o644 });
        }
        self.pending.push(Pending {
            path: self.root.join(rel),
            is_dir,
            is_symlink,
            depth: rel.components().count(),
            meta,
        });
    }

    /// Attributes of the tree's root directory itself.
    pub fn root_meta(&mut self, meta: Meta) {
        self.root_meta = meta;
    }

    /// A directory (parents must exist).
    pub fn dir(&mut self, rel: impl AsRef<Path>, meta: Meta) -> Result<()> {
        let rel = rel.as_ref();
        let p = self.abs(rel);
        fs::create_dir(&p).with_context(|| format!("mkdir {}", p.display()))?;
        self.record(rel, true, false, meta);
        Ok(())
    }

    /// A regular file with this content.
    pub fn file(&mut self, rel: impl AsRef<Path>, content: &[u8], meta: Meta) -> Result<()> {
        let rel = rel.as_ref();
        let p = self.abs(rel);
        fs::write(&p, content).with_context(|| format!("write {}", p.display()))?;
        self.record(rel, false, false, meta);
        Ok(())
    }

    /// A file of `len` random bytes from the fixture's stream, written in pieces.
    pub fn random_file(&mut self, rel: impl AsRef<Path>, len: u64, meta: Meta) -> Result<()> {
        let rel = rel.as_ref();
        let p = self.abs(rel);
        write_stream(&p, len, |buf| self.rng.fill(buf))?;
        self.record(rel, false, false, meta);
        Ok(())
    }

    /// A sparse file: `size` bytes with data only in `islands` (offset, bytes); the rest are holes
    /// made by seeking past them (and by `ftruncate` for a trailing hole).
    pub fn sparse_file(
        &mut self,
        rel: impl AsRef<Path>,
        size: u64,
        islands: &[(u64, Vec<u8>)],
        meta: Meta,
    ) -> Result<()> {
        let rel = rel.as_ref();
        let p = self.abs(rel);
        let f = File::create(&p).with_context(|| format!("create {}", p.display()))?;
        for (off, data) in islands {
            f.write_all_at(data, *off).with_context(|| format!("write {} at {off}", p.display()))?;
        }
        f.set_len(size).with_context(|| format!("ftruncate {} to {size}", p.display()))?;
        self.record(rel, false, false, meta);
        Ok(())
    }

    /// A symlink with raw target bytes.
    pub fn symlink(&mut self, rel: impl AsRef<Path>, target: &[u8], meta: Meta) -> Result<()> {
        let rel = rel.as_ref();
        let p = self.abs(rel);
        std::os::unix::fs::symlink(OsStr::from_bytes(target), &p)
            .with_context(|| format!("symlink {}", p.display()))?;
        self.record(rel, false, true, meta.with_mode(0o777));
        Ok(())
    }

    /// A character or block device (`mknod`), or a FIFO (`kind` = [`FileType::Fifo`]).
    pub fn node(
        &mut self,
        rel: impl AsRef<Path>,
        kind: FileType,
        major: u32,
        minor: u32,
        meta: Meta,
    ) -> Result<()> {
        let rel = rel.as_ref();
        let p = self.abs(rel);
        rustix::fs::mknodat(CWD, &p, kind, Mode::from_raw_mode(0o600), rustix::fs::makedev(major, minor))
            .with_context(|| format!("mknod {}", p.display()))?;
        self.record(rel, false, false, meta);
        Ok(())
    }

    /// A unix socket node (bound, then the listener is dropped; the node stays).
    pub fn socket(&mut self, rel: impl AsRef<Path>, meta: Meta) -> Result<()> {
        let rel = rel.as_ref();
        let p = self.abs(rel);
        drop(UnixListener::bind(&p).with_context(|| format!("bind {}", p.display()))?);
        self.record(rel, false, false, meta);
        Ok(())
    }

    /// A hard link `new` to the existing node `existing` (symlinks are linked, not followed).
    pub fn hardlink(&mut self, existing: impl AsRef<Path>, new: impl AsRef<Path>) -> Result<()> {
        let (a, b) = (self.abs(existing), self.abs(new));
        fs::hard_link(&a, &b).with_context(|| format!("link {} -> {}", b.display(), a.display()))?;
        Ok(())
    }

    /// Apply every recorded attribute, in the safe order.
    pub fn finish(mut self) -> Result<()> {
        let root_meta = std::mem::take(&mut self.root_meta);
        let mut root_meta = root_meta;
        if root_meta.mtime.is_none() {
            root_meta.mtime = Some((1_600_000_000, 1));
        }
        if root_meta.mode.is_none() {
            root_meta.mode = Some(0o755);
        }
        let mut pending = std::mem::take(&mut self.pending);
        pending.push(Pending {
            path: self.root.clone(),
            is_dir: true,
            is_symlink: false,
            depth: 0,
            meta: root_meta,
        });
        // Stable: non-directories in creation order, then directories deepest first.
        pending.sort_by_key(|p| (p.is_dir, std::cmp::Reverse(p.depth)));
        for p in &pending {
            apply(p)?;
        }
        Ok(())
    }
}

fn apply(p: &Pending) -> Result<()> {
    let m = &p.meta;
    let path = &p.path;
    std::os::unix::fs::lchown(path, Some(m.uid), Some(m.gid))
        .with_context(|| format!("lchown {}", path.display()))?;
    if !p.is_symlink {
        let mode = m.mode.unwrap_or(0o644);
        fs::set_permissions(path, fs::Permissions::from_mode(mode))
            .with_context(|| format!("chmod {:o} {}", mode, path.display()))?;
    }
    for (name, value) in &m.xattrs {
        rustix::fs::lsetxattr(path, OsStr::from_bytes(name), value, XattrFlags::empty())
            .with_context(|| format!("setxattr {} on {}", String::from_utf8_lossy(name), path.display()))?;
    }
    let (s, ns) = m.mtime.unwrap_or((0, 0));
    set_mtime(path, s, ns)
}

/// Write `len` bytes produced by `fill` (called on 1 MiB buffers) to a new file.
pub fn write_stream(path: &Path, len: u64, mut fill: impl FnMut(&mut [u8])) -> Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .with_context(|| format!("create {}", path.display()))?;
    let mut buf = vec![0u8; MIB as usize];
    let mut left = len;
    while left > 0 {
        let n = left.min(MIB) as usize;
        fill(&mut buf[..n]);
        f.write_all(&buf[..n]).with_context(|| format!("write {}", path.display()))?;
        left -= n as u64;
    }
    Ok(())
}

/// A named fixture and the code path it targets.
#[derive(Debug, Clone, Copy)]
pub struct Fixture {
    /// Short name (directory name under the fixtures dir).
    pub name: &'static str,
    /// What it covers and which builder / synthesizer path it targets.
    pub targets: &'static str,
    generate: fn(&mut Gen) -> Result<()>,
}

impl Fixture {
    /// Generate this fixture at `dest` (removed first if it exists).
    pub fn generate(&self, dest: &Path) -> Result<()> {
        if dest.symlink_metadata().is_ok() {
            fs::remove_dir_all(dest).with_context(|| format!("remove {}", dest.display()))?;
        }
        let mut g = Gen::new(dest, self.name)?;
        (self.generate)(&mut g).with_context(|| format!("fixture {}", self.name))?;
        g.finish().with_context(|| format!("fixture {}: apply attributes", self.name))
    }
}

/// Every fixture, in the order tests and `cargo xtask fixtures` use.
pub const FIXTURES: &[Fixture] = &[
    Fixture {
        name: "kinds",
        targets: "inode kinds and attributes: regular/dir/symlink/char/block (259:100000, \
                  4095:1048575)/FIFO/socket; setuid/setgid/sticky; uid/gid up to 4294967294; \
                  mtimes with ns incl. 1966, 1969.999999999, 2038 edges, 2100, 2200 (ext4 extra \
                  epoch bits) on files, dirs, symlinks and devices; hard links across directories \
                  (files, a symlink, a FIFO, a device); the root directory's own mode, owner, \
                  mtime and xattrs",
        generate: gen_kinds,
    },
    Fixture {
        name: "sizes",
        targets: "i_size / extents / chunk boundaries: files of 0, 1, 4095, 4096, 4097 bytes, \
                  around the 512 KiB chunk size, several MiB (text and random); fast vs slow \
                  symlinks (1, 59, 60, 61, 4095 bytes, non-UTF-8 target)",
        generate: gen_sizes,
    },
    Fixture {
        name: "names",
        targets: "directory entries: non-UTF-8 names, control characters, 255-byte ASCII and \
                  multibyte (2/3/4-byte UTF-8) names, an htree of 255-byte names, 64 nested \
                  directories, long paths",
        generate: gen_names,
    },
    Fixture {
        name: "bigdir",
        targets: "htree directories: 20 000 entries in one directory (incl. 100 subdirectories, \
                  so its nlink is 102), plus directories just under and over the htree threshold",
        generate: gen_bigdir,
    },
    Fixture {
        name: "sparse",
        targets: "holes via SEEK_DATA/SEEK_HOLE: leading/middle/trailing holes, unaligned \
                  islands, an all-hole file (ftruncate), a 5 GiB sparse file with data islands \
                  at chunk and GiB boundaries, written zeros (not a hole in the source)",
        generate: gen_sparse,
    },
    Fixture {
        name: "xattrs",
        targets: "extended attributes: 30 xattrs on one file, a 3000-byte value (external \
                  block), empty and binary values, user./trusted./security. incl. a v2 \
                  security.capability, POSIX ACLs (access and default, named users/groups), \
                  xattrs on a dir, a symlink and a device, identical xattr sets on several files",
        generate: gen_xattrs,
    },
    Fixture {
        name: "dedup",
        targets: "chunking and dedup: identical small files, identical multi-chunk files, a \
                  file repeating one chunk, shared prefixes, a small file equal to a large \
                  file's first chunk, identical content with different metadata",
        generate: gen_dedup,
    },
];

/// The fixture with this name.
pub fn by_name(name: &str) -> Result<&'static Fixture> {
    match FIXTURES.iter().find(|f| f.name == name) {
        Some(f) => Ok(f),
        None => bail!(
            "unknown fixture {name:?}; known: {}",
            FIXTURES.iter().map(|f| f.name).collect::<Vec<_>>().join(", ")
        ),
    }
}

fn os(b: &[u8]) -> &Path {
    Path::new(OsStr::from_bytes(b))
}

fn gen_kinds(g: &mut Gen) -> Result<()> {
    g.root_meta(
        Meta::mode(0o751)
            .owner(1001, 1002)
            .mtime(1_234_567_890, 987_654_321)
            .xattr("user.root-note", "the root's own xattr")
            .xattr("trusted.root", [0u8, 1, 2, 3]),
    );
    // Permission bits.
    g.dir("modes", Meta::new())?;
    for mode in [0o644, 0o755, 0o600, 0o000, 0o444, 0o4755, 0o2755, 0o6755, 0o7777, 0o1644, 0o640, 0o4000] {
        g.file(format!("modes/f{mode:04o}"), format!("mode {mode:o}\n").as_bytes(), Meta::mode(mode))?;
    }
    g.dir("modes/sticky", Meta::mode(0o1777))?;
    g.dir("modes/setgid", Meta::mode(0o2775).owner(0, 70000))?;
    g.file("modes/setgid/inside", b"x", Meta::mode(0o664).owner(0, 70000))?;
    g.dir("modes/private", Meta::mode(0o700))?;
    g.dir("modes/readonly", Meta::mode(0o555))?;
    g.file("modes/readonly/file", b"ro dir content\n", Meta::mode(0o444))?;
    g.dir("modes/none", Meta::mode(0o000))?;

    // Owners.
    g.dir("owners", Meta::new())?;
    for (uid, gid) in [
        (0u32, 0u32),
        (1, 4_294_967_294),
        (1000, 1000),
        (65534, 65534),
        (65535, 65536),
        (70000, 70001),
        (4_294_967_294, 4_294_967_294),
    ] {
        g.file(format!("owners/u{uid}-g{gid}"), b"owned\n", Meta::new().owner(uid, gid))?;
    }
    g.dir("owners/dir-70000", Meta::mode(0o750).owner(70000, 70000))?;
    g.symlink("owners/link-4294967294", b"../modes/f0644", Meta::new().owner(4_294_967_294, 12345))?;

    // Times (seconds, nanoseconds), on files, dirs, symlinks and a device.
    g.dir("times", Meta::new())?;
    let times: &[(&str, i64, i64)] = &[
        ("epoch", 0, 0),
        ("epoch-plus-1ns", 0, 1),
        ("before-epoch", -1, 999_999_999),
        ("y1966", -115_000_000, 123_456_789),
        ("y1902", -2_100_000_000, 5),
        ("y2038-last", 2_147_483_647, 999_999_999),
        ("y2038-first-after", 2_147_483_648, 0),
        ("y2100", 4_102_444_800, 500_000_000),
        ("y2106", 4_294_967_296, 42),
        ("y2200", 7_258_118_400, 1),
        ("max-ns", 1_700_000_000, 999_999_999),
    ];
    for &(name, s, ns) in times {
        g.file(format!("times/{name}"), name.as_bytes(), Meta::new().mtime(s, ns))?;
        g.symlink(format!("times/{name}.lnk"), name.as_bytes(), Meta::new().mtime(s, ns))?;
        g.dir(format!("times/{name}.d"), Meta::new().mtime(s, ns))?;
    }
    g.node("times/dev-1966", FileType::CharacterDevice, 1, 3, Meta::new().mtime(-115_000_000, 7))?;
    g.dir("times/filled-2100", Meta::new().mtime(4_102_444_800, 3))?;
    for i in 0..5 {
        g.file(format!("times/filled-2100/f{i}"), b"inside", Meta::new())?;
    }

    // Every node kind.
    g.dir("dev", Meta::new())?;
    g.node("dev/null", FileType::CharacterDevice, 1, 3, Meta::mode(0o666))?;
    g.node("dev/tty0", FileType::CharacterDevice, 4, 0, Meta::mode(0o620).owner(0, 5))?;
    g.node("dev/sda", FileType::BlockDevice, 8, 0, Meta::mode(0o660).owner(0, 6))?;
    g.node("dev/nvme-259-100000", FileType::BlockDevice, 259, 100_000, Meta::mode(0o600))?;
    g.node("dev/chr-255-255", FileType::CharacterDevice, 255, 255, Meta::new())?;
    g.node("dev/chr-256-0", FileType::CharacterDevice, 256, 0, Meta::new())?;
    g.node("dev/blk-4095-1048575", FileType::BlockDevice, 4095, 1_048_575, Meta::new())?;
    g.node("dev/fifo", FileType::Fifo, 0, 0, Meta::mode(0o644))?;
    g.socket("dev/socket", Meta::mode(0o755).owner(33, 33))?;

    // Hard links across directories, of several kinds.
    g.dir("links", Meta::new())?;
    g.dir("links/a", Meta::new())?;
    g.dir("links/b", Meta::new())?;
    g.dir("links/b/c", Meta::new())?;
    g.file("links/a/three", b"one inode, three names\n", Meta::mode(0o4755).owner(70000, 70000))?;
    g.hardlink("links/a/three", "links/b/three-2")?;
    g.hardlink("links/a/three", "links/b/c/three-3")?;
    g.file("links/a/pair", b"two names, same dir\n", Meta::new())?;
    g.hardlink("links/a/pair", "links/a/pair-2")?;
    g.symlink("links/a/sym", b"three", Meta::new())?;
    g.hardlink("links/a/sym", "links/b/sym-hardlink")?;
    g.node("links/a/fifo", FileType::Fifo, 0, 0, Meta::new())?;
    g.hardlink("links/a/fifo", "links/b/fifo-hardlink")?;
    g.node("links/a/dev", FileType::CharacterDevice, 10, 200, Meta::new())?;
    g.hardlink("links/a/dev", "links/b/c/dev-hardlink")?;
    g.file("links/a/empty", b"", Meta::new())?;
    g.hardlink("links/a/empty", "links/b/empty-2")?;
    Ok(())
}

fn gen_sizes(g: &mut Gen) -> Result<()> {
    g.dir("files", Meta::new())?;
    for len in [
        0u64,
        1,
        2,
        59,
        60,
        4095,
        4096,
        4097,
        8191,
        8192,
        65_537,
        512 * KIB - 1,
        512 * KIB,
        512 * KIB + 1,
        MIB - 1,
        MIB,
        MIB + 1,
    ] {
        g.random_file(format!("files/random-{len}"), len, Meta::new())?;
    }
    let text = g.rng.text((5 * MIB + 7) as usize);
    g.file("files/text-5MiB+7", &text, Meta::mode(0o600))?;
    g.random_file("files/random-3MiB+123", 3 * MIB + 123, Meta::new())?;
    g.random_file("files/random-12MiB", 12 * MIB, Meta::mode(0o755))?;

    g.dir("symlinks", Meta::new())?;
    for len in [1usize, 2, 58, 59, 60, 61, 255, 256, 1000, 4094, 4095] {
        let mut target = Vec::with_capacity(len);
        while target.len() < len {
            target.extend_from_slice(b"dir/");
        }
        target.truncate(len);
        if target.last() == Some(&b'/') {
            *target.last_mut().unwrap_or(&mut 0) = b'x';
        }
        g.symlink(format!("symlinks/len-{len}"), &target, Meta::new())?;
    }
    g.symlink("symlinks/absolute", b"/etc/passwd", Meta::new())?;
    g.symlink("symlinks/to-dir", b"../files", Meta::new())?;
    g.symlink("symlinks/dangling", b"nowhere/at/all", Meta::new())?;
    g.symlink("symlinks/non-utf8", b"caf\xe9/\xff\xfe", Meta::new())?;
    g.symlink("symlinks/dot", b".", Meta::new())?;
    Ok(())
}

fn gen_names(g: &mut Gen) -> Result<()> {
    g.dir("odd", Meta::new())?;
    let odd: &[&[u8]] = &[
        b"\xff\xfe",
        b"caf\xe9",
        b"latin1-\xe4\xf6\xfc",
        b"with space",
        b"with\nnewline",
        b"tab\there",
        b"ctrl-\x01\x02\x1f",
        b"back\\slash",
        b"-leading-dash",
        b".hidden",
        b"..dotdot-prefix",
        b"...",
        b"a",
        b"UPPER",
        b"upper",
        b"emoji-\xf0\x9f\xa6\x80",
        b"quote\"'`",
        b"star*?[]",
        b"\xc3\x28-invalid-utf8-seq",
    ];
    for (i, name) in odd.iter().enumerate() {
        let mut rel = b"odd/".to_vec();
        rel.extend_from_slice(name);
        g.file(os(&rel), format!("{i}\n").as_bytes(), Meta::new())?;
    }
    g.dir(os(b"odd/dir-\xff"), Meta::new())?;
    g.file(os(b"odd/dir-\xff/inside-\xfe"), b"x", Meta::new())?;

    // 255-byte names: ASCII and 2/3/4-byte UTF-8.
    g.dir("long", Meta::new())?;
    let mut names: Vec<Vec<u8>> = vec![
        vec![b'a'; 255],
        {
            let mut v = "é".repeat(127).into_bytes();
            v.push(b'x');
            v
        },
        "日".repeat(85).into_bytes(),
        {
            let mut v = "🦀".repeat(63).into_bytes();
            v.extend_from_slice(b"abc");
            v
        },
        {
            let mut v = vec![0xffu8; 250];
            v.extend_from_slice(b"tail!");
            v
        },
    ];
    // Enough 255-byte names for the directory to need several blocks (htree).
    for i in 0..60 {
        let mut v = format!("{i:03}-").into_bytes();
        while v.len() < 255 {
            v.push(b'a' + (v.len() % 26) as u8);
        }
        names.push(v);
    }
    for (i, name) in names.iter().enumerate() {
        assert_eq!(name.len(), 255);
        let mut rel = b"long/".to_vec();
        rel.extend_from_slice(name);
        g.file(os(&rel), format!("long {i}\n").as_bytes(), Meta::new())?;
    }
    let mut d = b"long/".to_vec();
    d.extend_from_slice(&"д".repeat(127).into_bytes());
    d.push(b'd');
    g.dir(os(&d), Meta::new())?;

    // 64 nested directories with a file at the bottom.
    let mut p = PathBuf::from("deep");
    g.dir(&p, Meta::new())?;
    for i in 1..=64 {
        p.push(format!("d{i:02}"));
        g.dir(&p, Meta::mode(if i % 2 == 0 { 0o755 } else { 0o750 }))?;
    }
    g.file(p.join("bottom"), b"64 levels down\n", Meta::new())?;
    g.symlink(p.join("up"), "../".repeat(64).as_bytes(), Meta::new())?;

    // A long path: 12 levels of 200-byte names (~2.4 KB).
    let mut p = PathBuf::from("longpath");
    g.dir(&p, Meta::new())?;
    for i in 0..12 {
        p.push(format!("{i:02}-{}", "n".repeat(197)));
        g.dir(&p, Meta::new())?;
    }
    g.file(p.join("end"), b"end of a long path\n", Meta::new())?;
    Ok(())
}

fn gen_bigdir(g: &mut Gen) -> Result<()> {
    g.dir("big", Meta::new())?;
    for i in 0..20_000u32 {
        if i % 200 == 0 {
            g.dir(format!("big/subdir-{i:05}"), Meta::new())?;
        } else {
            // Names of varying length so hashes and record lengths vary.
            let pad = "x".repeat((i % 37) as usize);
            g.file(format!("big/entry-{i:05}{pad}"), format!("{i}\n").as_bytes(), Meta::new())?;
        }
    }
    // Around the htree threshold (3 blocks): ~100 B per entry → ~40 per block.
    for (dir, n) in [("linear-1", 30u32), ("linear-2", 70), ("htree-3", 110), ("htree-big", 1500)] {
        g.dir(dir, Meta::new())?;
        for i in 0..n {
            g.file(format!("{dir}/{}-{i:04}", "n".repeat(80)), b"", Meta::new())?;
        }
    }
    Ok(())
}

fn gen_sparse(g: &mut Gen) -> Result<()> {
    let r = |g: &mut Gen, n: usize| g.rng.bytes(n);
    g.dir("holes", Meta::new())?;
    let a = r(g, 4096);
    g.sparse_file("holes/leading-hole", MIB + 4096, &[(MIB, a)], Meta::new())?;
    let (a, b) = (r(g, 10_000), r(g, 3000));
    g.sparse_file("holes/middle-hole", 3 * MIB, &[(0, a), (3 * MIB - 3000, b)], Meta::new())?;
    let a = r(g, 5000);
    g.sparse_file("holes/trailing-hole", 8 * MIB, &[(0, a)], Meta::new())?;
    let (a, b) = (r(g, 100), r(g, 1));
    g.sparse_file("holes/unaligned", 200_001, &[(5000, a), (200_000, b)], Meta::new())?;
    g.sparse_file("holes/all-hole-10MiB", 10 * MIB, &[], Meta::new())?;
    g.sparse_file("holes/all-hole-1", 1, &[], Meta::new())?;
    // Islands straddling 512 KiB chunk boundaries.
    let (a, b) = (r(g, 8192), r(g, 600 * KIB as usize));
    g.sparse_file(
        "holes/chunk-straddle",
        4 * MIB,
        &[(512 * KIB - 4096, a), (2 * MIB - 100 * KIB, b)],
        Meta::new(),
    )?;
    // Many small islands (fragmented extent tree: more than 4 extents → an extent block).
    let mut islands = Vec::new();
    for i in 0..200u64 {
        islands.push((i * 64 * KIB, r(g, 4096)));
    }
    g.sparse_file("holes/fragmented-200", 200 * 64 * KIB, &islands, Meta::new())?;
    // 5 GiB with a few islands, incl. the very first and very last bytes.
    let islands = vec![
        (0, r(g, 4096)),
        (GIB + 123, r(g, 70_000)),
        (4 * GIB, r(g, MIB as usize)),
        (5 * GIB - 1, r(g, 1)),
    ];
    g.sparse_file("big-5GiB", 5 * GIB, &islands, Meta::mode(0o600))?;
    // Written zeros: data in the source, not a hole.
    g.file("written-zeros", &vec![0u8; MIB as usize + 17], Meta::new())?;
    Ok(())
}

/// VFS-format (`posix_acl_xattr`, version 2) ACL bytes for (tag, perm, id) entries.
pub fn vfs_acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut v = 2u32.to_le_bytes().to_vec();
    for &(tag, perm, id) in entries {
        v.extend_from_slice(&tag.to_le_bytes());
        v.extend_from_slice(&perm.to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
}

/// ACL tags.
pub mod acl {
    /// Owner.
    pub const USER_OBJ: u16 = 0x01;
    /// Named user.
    pub const USER: u16 = 0x02;
    /// Owning group.
    pub const GROUP_OBJ: u16 = 0x04;
    /// Named group.
    pub const GROUP: u16 = 0x08;
    /// Mask.
    pub const MASK: u16 = 0x10;
    /// Others.
    pub const OTHER: u16 = 0x20;
    /// The id of entries that have none.
    pub const UNDEFINED: u32 = u32::MAX;
}

fn gen_xattrs(g: &mut Gen) -> Result<()> {
    use acl::*;
    // 30 xattrs on one file, of varying sizes.
    let mut m = Meta::new();
    for i in 0..30usize {
        let v = g.rng.text(i * 7 % 90);
        m = m.xattr(format!("user.attr.{i:02}"), v);
    }
    g.file("thirty", b"thirty xattrs\n", m)?;
    // A 3000-byte value (needs the external xattr block).
    let big = g.rng.bytes(3000);
    g.file("big-value", b"3000-byte xattr\n", Meta::new().xattr("user.big", &big))?;
    // Edge values.
    g.file(
        "edge-values",
        b"",
        Meta::new()
            .xattr("user.empty", b"")
            .xattr("user.binary", [0u8, 0, 255, 0, 10, 13])
            .xattr("user.a", b"1")
            .xattr(format!("user.{}", "n".repeat(200)), b"long name"),
    )?;
    // All namespaces.
    g.file(
        "namespaces",
        b"ns\n",
        Meta::new()
            .xattr("user.mime_type", b"text/plain")
            .xattr("trusted.tessera", b"trusted value")
            .xattr("security.tessera", b"security value"),
    )?;
    // security.capability v2: cap_net_raw (13) permitted + effective.
    let mut cap = Vec::new();
    cap.extend_from_slice(&(0x0200_0000u32 | 1).to_le_bytes()); // VFS_CAP_REVISION_2 | EFFECTIVE
    cap.extend_from_slice(&(1u32 << 13).to_le_bytes()); // permitted lo
    cap.extend_from_slice(&0u32.to_le_bytes()); // inheritable lo
    cap.extend_from_slice(&0u32.to_le_bytes()); // permitted hi
    cap.extend_from_slice(&0u32.to_le_bytes()); // inheritable hi
    g.file("ping-cap", b"#!/bin/true\n", Meta::mode(0o755).xattr("security.capability", &cap))?;
    // POSIX ACLs: access on a file (mode group bits = mask), access + default on a dir.
    let access = vfs_acl(&[
        (USER_OBJ, 7, UNDEFINED),
        (USER, 5, 1000),
        (USER, 4, 70000),
        (GROUP_OBJ, 4, UNDEFINED),
        (GROUP, 6, 4_294_967_294),
        (MASK, 7, UNDEFINED),
        (OTHER, 4, UNDEFINED),
    ]);
    g.file("acl-file", b"acl\n", Meta::mode(0o774).xattr("system.posix_acl_access", &access))?;
    let minimal_default =
        vfs_acl(&[(USER_OBJ, 7, UNDEFINED), (GROUP_OBJ, 5, UNDEFINED), (OTHER, 0, UNDEFINED)]);
    let dir_access = vfs_acl(&[
        (USER_OBJ, 7, UNDEFINED),
        (GROUP_OBJ, 5, UNDEFINED),
        (GROUP, 7, 70000),
        (MASK, 7, UNDEFINED),
        (OTHER, 5, UNDEFINED),
    ]);
    g.dir(
        "acl-dir",
        Meta::mode(0o775)
            .xattr("system.posix_acl_access", &dir_access)
            .xattr("system.posix_acl_default", &minimal_default)
            .xattr("user.on-dir", b"dir xattr"),
    )?;
    g.file("acl-dir/child", b"child\n", Meta::new())?;
    // xattrs on a symlink and a device (trusted./security.; user. is not allowed there).
    g.symlink("sym-with-xattr", b"thirty", Meta::new().xattr("trusted.sym", b"on a symlink"))?;
    g.node(
        "dev-with-xattr",
        FileType::CharacterDevice,
        1,
        5,
        Meta::new().xattr("security.dev", b"on a device"),
    )?;
    // Identical xattr sets (e2fsprogs would share one refcounted block).
    let shared = g.rng.bytes(2000);
    for i in 0..5 {
        g.file(
            format!("same-xattrs-{i}"),
            format!("{i}\n").as_bytes(),
            Meta::new().xattr("user.shared", &shared),
        )?;
    }
    // In-inode space boundary: values around the ~100 bytes that fit inside a 256-byte inode.
    for n in [60usize, 68, 76, 84, 92, 100] {
        let v = vec![b'v'; n];
        g.file(format!("inline-{n}"), b"", Meta::new().xattr("user.v", &v))?;
    }
    Ok(())
}

fn gen_dedup(g: &mut Gen) -> Result<()> {
    g.dir("small", Meta::new())?;
    for d in 0..10 {
        g.dir(format!("small/d{d}"), Meta::new())?;
        for i in 0..5 {
            g.file(format!("small/d{d}/hello-{i}"), b"hello, world\n", Meta::new())?;
        }
    }
    let big = g.rng.bytes((3 * MIB) as usize);
    g.dir("big", Meta::new())?;
    for i in 0..6 {
        // Same content, different metadata: separate inodes, shared chunks.
        g.file(
            format!("big/copy-{i}"),
            &big,
            Meta::mode(0o600 + i).owner(i, i).mtime(1_500_000_000 + i64::from(i), 0),
        )?;
    }
    let block = g.rng.bytes((512 * KIB) as usize);
    let mut repeated = Vec::new();
    for _ in 0..8 {
        repeated.extend_from_slice(&block);
    }
    g.file("repeated-chunk-4MiB", &repeated, Meta::new())?;
    g.file("first-chunk-alone", &block, Meta::new())?;
    let mut tail_a = big[..MIB as usize].to_vec();
    tail_a.extend_from_slice(&g.rng.bytes(700_000));
    let mut tail_b = big[..MIB as usize].to_vec();
    tail_b.extend_from_slice(&g.rng.bytes(700_001));
    g.file("shared-prefix-a", &tail_a, Meta::new())?;
    g.file("shared-prefix-b", &tail_b, Meta::new())?;
    g.file("zeros-a", &vec![0u8; 2 * MIB as usize], Meta::new())?;
    g.file("zeros-b", &vec![0u8; 2 * MIB as usize], Meta::new())?;
    Ok(())
}

/// Statistics of a generated benchmark tree.
#[derive(Debug, Clone, Copy, Default)]
pub struct TreeStats {
    /// Regular files.
    pub files: u64,
    /// Directories (excluding the root).
    pub dirs: u64,
    /// Symlinks.
    pub symlinks: u64,
    /// Extra hard links.
    pub hardlinks: u64,
    /// Total bytes of regular-file content.
    pub bytes: u64,
}

/// The benchmark tree: ≥ 20 000 files and ≥ 100 MB with a realistic size mix (most files small,
/// a few large), mostly compressible text, some random binaries, ~8% duplicated files, ~1500
/// directories up to 5 deep, symlinks and hard links. Deterministic.
pub fn generate_bench_tree(dest: &Path, files: u64) -> Result<TreeStats> {
    if dest.symlink_metadata().is_ok() {
        fs::remove_dir_all(dest)?;
    }
    let mut g = Gen::new(dest, "bench")?;
    let mut st = TreeStats::default();
    let mut dirs: Vec<PathBuf> = vec![PathBuf::new()];
    let ndirs = (files / 14).max(1);
    for i in 0..ndirs {
        let parent = dirs[g.rng.below(dirs.len() as u64) as usize].clone();
        if parent.components().count() >= 5 {
            continue;
        }
        let d = parent.join(format!("dir{i:04}"));
        g.dir(&d, Meta::new())?;
        dirs.push(d);
        st.dirs += 1;
    }
    let mut recent: Vec<(PathBuf, u64)> = Vec::new();
    for i in 0..files {
        let dir = dirs[g.rng.below(dirs.len() as u64) as usize].clone();
        let bucket = g.rng.below(1000);
        let len = match bucket {
            0..=549 => g.rng.range(0, 2048),
            550..=849 => g.rng.range(2049, 12 * KIB),
            850..=969 => g.rng.range(12 * KIB, 40 * KIB),
            970..=996 => g.rng.range(40 * KIB, 192 * KIB),
            _ => g.rng.range(256 * KIB, 4 * MIB),
        };
        let ext = ["txt", "so", "py", "h", "conf", "bin", "gz"][g.rng.below(7) as usize];
        let rel = dir.join(format!("file{i:05}.{ext}"));
        let kind = g.rng.below(100);
        if kind < 8 && !recent.is_empty() {
            let (src, slen) = recent[g.rng.below(recent.len() as u64) as usize].clone();
            let content = fs::read(g.abs(&src))?;
            g.file(&rel, &content, Meta::new())?;
            st.bytes += slen;
        } else if kind < 28 {
            g.random_file(&rel, len, Meta::mode(0o755))?;
            st.bytes += len;
        } else {
            let t = g.rng.text(len as usize);
            g.file(&rel, &t, Meta::new())?;
            st.bytes += len;
        }
        st.files += 1;
        if len < 64 * KIB {
            if recent.len() < 256 {
                recent.push((rel.clone(), len));
            } else {
                let k = g.rng.below(256) as usize;
                recent[k] = (rel.clone(), len);
            }
        }
        if i % 100 == 7 {
            g.symlink(dir.join(format!("link{i:05}")), format!("file{i:05}.{ext}").as_bytes(), Meta::new())?;
            st.symlinks += 1;
        }
        if i % 400 == 11 {
            g.hardlink(&rel, dir.join(format!("hard{i:05}")))?;
            st.hardlinks += 1;
        }
    }
    g.finish()?;
    Ok(st)
}

/// A tree holding one `bytes`-long incompressible file (`big.bin`) and a few small files: the
/// peak-memory test input. Random content cannot be compressed or deduplicated, so a builder
/// that buffers chunks or packs shows up in VmHWM.
pub fn generate_incompressible(dest: &Path, bytes: u64) -> Result<()> {
    if dest.symlink_metadata().is_ok() {
        fs::remove_dir_all(dest)?;
    }
    let mut g = Gen::new(dest, "incompressible")?;
    g.random_file("big.bin", bytes, Meta::new())?;
    g.file("small.txt", b"small\n", Meta::new())?;
    g.finish()
}

/// Generate every fixture under `out/<name>`.
pub fn generate_all(out: &Path) -> Result<()> {
    fs::create_dir_all(out)?;
    for f in FIXTURES {
        f.generate(&out.join(f.name))?;
    }
    Ok(())
}

/// Whether this process is root (fixtures and judges need it).
pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Fail clearly when not root.
pub fn require_root() -> io::Result<()> {
    if is_root() {
        Ok(())
    } else {
        Err(io::Error::other(
            "the end-to-end harness needs root (mknod, chown, trusted./security. xattrs, loop mounts)",
        ))
    }
}

/// Set atime = mtime = (secs, nsec) on a path, not following symlinks.
pub fn set_mtime(path: &Path, secs: i64, nsec: i64) -> Result<()> {
    let ts = Timespec { tv_sec: secs, tv_nsec: nsec };
    rustix::fs::utimensat(
        CWD,
        path,
        &Timestamps { last_access: ts, last_modification: ts },
        AtFlags::SYMLINK_NOFOLLOW,
    )
    .with_context(|| format!("utimensat {}", path.display()))
}
