//! Shared harness for the judge tests: tree building, writing images, e2fsck, loop mounts and
//! ext4-view walks.
#![allow(dead_code, clippy::unwrap_used)]

use std::fs::{File, OpenOptions};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use tessera_ext4::{
    synthesize, DataRange, DirEntry, Ext4Image, Meta, Node, NodeId, NodeKind, Options, SizePolicy, Timestamp,
    Tree, Xattr,
};

pub const T: i64 = 1_700_000_000;

pub fn ts(sec: i64, nsec: u32) -> Timestamp {
    Timestamp { sec, nsec }
}

pub fn meta(mode: u16) -> Meta {
    Meta { mode, uid: 0, gid: 0, atime: ts(T - 10, 1), mtime: ts(T - 100, 123_456_789), ctime: ts(T - 50, 7) }
}

pub fn options() -> Options {
    Options {
        size: SizePolicy::Free(None),
        inodes: None,
        fs_time: T,
        seed: [42; 32],
        label: b"tessera".to_vec(),
    }
}

/// Builds a [`Tree`] by adding children to directories.
pub struct Builder {
    pub tree: Tree,
}

impl Builder {
    pub fn new() -> Self {
        Builder {
            tree: Tree {
                nodes: vec![Node {
                    meta: meta(0o755),
                    kind: NodeKind::Directory { entries: vec![] },
                    xattrs: vec![],
                }],
            },
        }
    }

    pub fn root() -> NodeId {
        NodeId(0)
    }

    pub fn add(&mut self, parent: NodeId, name: &[u8], node: Node) -> NodeId {
        let id = NodeId(self.tree.nodes.len() as u32);
        self.tree.nodes.push(node);
        self.link(parent, name, id);
        id
    }

    pub fn link(&mut self, parent: NodeId, name: &[u8], target: NodeId) {
        match &mut self.tree.nodes[parent.0 as usize].kind {
            NodeKind::Directory { entries } => entries.push(DirEntry { name: name.into(), node: target }),
            _ => panic!("parent is not a directory"),
        }
    }

    pub fn dir(&mut self, parent: NodeId, name: &[u8]) -> NodeId {
        self.add(parent, name, node(meta(0o755), NodeKind::Directory { entries: vec![] }))
    }

    pub fn file(&mut self, parent: NodeId, name: &[u8], size: u64) -> NodeId {
        let blocks = size.div_ceil(4096);
        let data = if blocks > 0 { vec![DataRange { start_block: 0, blocks }] } else { vec![] };
        self.add(parent, name, node(meta(0o644), NodeKind::Regular { size, data: data.into() }))
    }

    pub fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.tree.nodes[id.0 as usize]
    }
}

pub fn node(meta: Meta, kind: NodeKind) -> Node {
    Node { meta, kind, xattrs: vec![] }
}

pub fn xattr(name: &str, value: &[u8]) -> Xattr {
    Xattr { name: name.as_bytes().to_vec(), value: value.to_vec() }
}

/// Deterministic content of block `file_block` of node `node` (before EOF truncation).
pub fn pattern(node: u32, file_block: u64) -> Vec<u8> {
    let mut x: u64 = ((node as u64) << 40) ^ file_block ^ 0x9E37_79B9_7F4A_7C15;
    let mut out = Vec::with_capacity(4096);
    for _ in 0..512 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// Expected bytes of a regular file in `[off, off+len)`: pattern in data ranges, zeros in holes.
pub fn expected(tree: &Tree, id: usize, off: u64, len: u64) -> Vec<u8> {
    let NodeKind::Regular { size, data } = &tree.nodes[id].kind else { panic!("not a file") };
    let end = (off + len).min(*size);
    let mut out = vec![0u8; end.saturating_sub(off) as usize];
    for r in data {
        for b in r.start_block..r.start_block + r.blocks {
            let (bs, be) = (b * 4096, (b + 1) * 4096);
            if be <= off || bs >= end {
                continue;
            }
            let p = pattern(id as u32, b);
            for pos in bs.max(off)..be.min(end) {
                out[(pos - off) as usize] = p[(pos - bs) as usize];
            }
        }
    }
    out
}

/// Write the image as a sparse file: metadata runs plus patterned file data, zero past EOF.
pub fn write_image(path: &Path, tree: &Tree, img: &Ext4Image) {
    let f = File::create(path).unwrap();
    f.set_len(img.geometry.blocks * 4096).unwrap();
    for run in &img.metadata {
        f.write_all_at(&run.data, run.start_block * 4096).unwrap();
    }
    for (id, placed) in img.placements.iter().enumerate() {
        let NodeKind::Regular { size, .. } = &tree.nodes[id].kind else {
            assert!(placed.is_empty());
            continue;
        };
        for p in placed {
            // Write each placed run in one go (block contents computed per block).
            let mut buf = Vec::with_capacity((p.blocks * 4096) as usize);
            for k in 0..p.blocks {
                let fb = p.file_block + k;
                let mut blk = pattern(id as u32, fb);
                let start = fb * 4096;
                if start + 4096 > *size {
                    let keep = size.saturating_sub(start) as usize;
                    blk[keep..].fill(0);
                }
                buf.extend_from_slice(&blk);
            }
            f.write_all_at(&buf, p.device_block * 4096).unwrap();
        }
    }
    f.sync_all().unwrap();
}

fn tool(name: &str) -> String {
    for dir in ["/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
        let p = format!("{dir}/{name}");
        if Path::new(&p).exists() {
            return p;
        }
    }
    name.to_string()
}

/// `e2fsck -fn`: exit 0 and none of the lines that signal a problem even at exit 0.
pub fn e2fsck_clean(img: &Path) {
    let out = Command::new(tool("e2fsck")).arg("-fn").arg(img).output().expect("run e2fsck");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let bad: Vec<&str> = text
        .lines()
        .filter(|l| {
            l.trim_end().ends_with("? no")
                || l.contains("WARNING")
                || l.contains("in the future")
                || l.contains("could be narrower")
                || l.contains("could be shorter")
        })
        .collect();
    assert!(
        out.status.code() == Some(0) && bad.is_empty(),
        "e2fsck -fn {}: {:?}\n{text}",
        img.display(),
        out.status
    );
}

/// `e2fsck -fy` on a copy must also exit 0 (nothing to optimize either).
pub fn e2fsck_fy_clean(img: &Path) {
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("copy.img");
    let st = Command::new("cp").arg("--sparse=always").arg(img).arg(&copy).status().unwrap();
    assert!(st.success());
    let out = Command::new(tool("e2fsck")).arg("-fy").arg(&copy).output().expect("run e2fsck");
    assert_eq!(
        out.status.code(),
        Some(0),
        "e2fsck -fy: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// A mounted loop device, unmounted (and the global loop lock released) on drop, even on panic.
pub struct Mount {
    pub dir: tempfile::TempDir,
    _lock: File,
}

impl Mount {
    pub fn new(img: &Path, rw: bool) -> Mount {
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open("/tmp/tessera-loop.lock")
            .unwrap();
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let opts = if rw { "loop,rw" } else { "loop,ro" };
        let out = Command::new(tool("mount")).args(["-o", opts]).arg(img).arg(dir.path()).output().unwrap();
        assert!(out.status.success(), "mount failed: {}", String::from_utf8_lossy(&out.stderr));
        Mount { dir, _lock: lock }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let out = Command::new(tool("umount")).arg(self.dir.path()).output();
        if let Ok(o) = out {
            if !o.status.success() {
                eprintln!("umount failed: {}", String::from_utf8_lossy(&o.stderr));
            }
        }
    }
}

fn kind_matches(kind: &NodeKind, ft: std::fs::FileType) -> bool {
    use std::os::unix::fs::FileTypeExt;
    match kind {
        NodeKind::Directory { .. } => ft.is_dir(),
        NodeKind::Regular { .. } => ft.is_file(),
        NodeKind::Symlink { .. } => ft.is_symlink(),
        NodeKind::CharDevice { .. } => ft.is_char_device(),
        NodeKind::BlockDevice { .. } => ft.is_block_device(),
        NodeKind::Fifo => ft.is_fifo(),
        NodeKind::Socket => ft.is_socket(),
    }
}

/// Reads at most this much of each file fully; larger files are sampled around their data ranges.
const FULL_READ_LIMIT: u64 = 64 << 20;

fn links_of(tree: &Tree) -> Vec<u64> {
    let mut refs = vec![0u64; tree.nodes.len()];
    for n in &tree.nodes {
        if let NodeKind::Directory { entries } = &n.kind {
            for e in entries {
                refs[e.node.0 as usize] += 1;
            }
        }
    }
    refs
}

fn subdirs(tree: &Tree, id: usize) -> u64 {
    match &tree.nodes[id].kind {
        NodeKind::Directory { entries } => entries
            .iter()
            .filter(|e| matches!(tree.nodes[e.node.0 as usize].kind, NodeKind::Directory { .. }))
            .count() as u64,
        _ => 0,
    }
}

fn file_samples(tree: &Tree, id: usize) -> Vec<(u64, u64)> {
    let NodeKind::Regular { size, data } = &tree.nodes[id].kind else { return vec![] };
    if *size <= FULL_READ_LIMIT {
        return vec![(0, *size)];
    }
    let mut v = vec![(0, 8192), (size.saturating_sub(8192), 8192)];
    for r in data.iter().take(50) {
        let s = (r.start_block * 4096).saturating_sub(100);
        v.push((s, 8192 + 200));
        let e = (r.start_block + r.blocks) * 4096;
        v.push((e.saturating_sub(4096), 4096 + 100));
    }
    v
}

/// Compare what the kernel sees under `mnt` with the tree.
pub fn verify_kernel(mnt: &Path, tree: &Tree) {
    let refs = links_of(tree);
    let root_has_lf = matches!(&tree.nodes[0].kind, NodeKind::Directory { entries } if entries.iter().any(|e| e.name[..] == b"lost+found"[..]));
    verify_kernel_node(mnt, tree, 0, &refs, root_has_lf);
}

fn verify_kernel_node(path: &Path, tree: &Tree, id: usize, refs: &[u64], root_has_lf: bool) {
    let n = &tree.nodes[id];
    let md = std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let ctx = path.display().to_string();
    assert!(kind_matches(&n.kind, md.file_type()), "{ctx}: type {:?}", md.file_type());
    assert_eq!(md.mode() & 0o7777, n.meta.mode as u32 & 0o7777, "{ctx}: mode");
    assert_eq!(md.uid(), n.meta.uid, "{ctx}: uid");
    assert_eq!(md.gid(), n.meta.gid, "{ctx}: gid");
    assert_eq!((md.mtime(), md.mtime_nsec()), (n.meta.mtime.sec, n.meta.mtime.nsec as i64), "{ctx}: mtime");
    assert_eq!((md.ctime(), md.ctime_nsec()), (n.meta.ctime.sec, n.meta.ctime.nsec as i64), "{ctx}: ctime");
    assert_eq!((md.atime(), md.atime_nsec()), (n.meta.atime.sec, n.meta.atime.nsec as i64), "{ctx}: atime");
    match &n.kind {
        NodeKind::Directory { entries } => {
            let extra = if id == 0 && !root_has_lf { 1 } else { 0 };
            let links = 2 + subdirs(tree, id) + extra;
            let want = if links > 65000 { 1 } else { links };
            assert_eq!(md.nlink(), want, "{ctx}: nlink");
            let mut names: Vec<Vec<u8>> = std::fs::read_dir(path)
                .unwrap()
                .map(|e| e.unwrap().file_name().as_bytes().to_vec())
                .collect();
            names.sort();
            let mut want: Vec<Vec<u8>> = entries.iter().map(|e| e.name.to_vec()).collect();
            if extra == 1 {
                want.push(b"lost+found".to_vec());
            }
            want.sort();
            assert_eq!(names.len(), want.len(), "{ctx}: entry count");
            assert!(names == want, "{ctx}: entry names differ");
            for e in entries {
                let child = path.join(std::ffi::OsStr::from_bytes(&e.name));
                verify_kernel_node(&child, tree, e.node.0 as usize, refs, root_has_lf);
            }
        }
        NodeKind::Regular { size, .. } => {
            assert_eq!(md.nlink(), refs[id], "{ctx}: nlink");
            assert_eq!(md.len(), *size, "{ctx}: size");
            let f = File::open(path).unwrap();
            for (off, len) in file_samples(tree, id) {
                let want = expected(tree, id, off, len);
                let mut got = vec![0u8; want.len()];
                f.read_exact_at(&mut got, off).unwrap();
                assert!(got == want, "{ctx}: data differs in [{off}, +{len})");
            }
        }
        NodeKind::Symlink { target } => {
            assert_eq!(md.nlink(), refs[id], "{ctx}: nlink");
            let got = std::fs::read_link(path).unwrap();
            assert_eq!(got.as_os_str().as_bytes(), &target[..], "{ctx}: target");
        }
        NodeKind::CharDevice { major, minor } | NodeKind::BlockDevice { major, minor } => {
            assert_eq!(md.nlink(), refs[id], "{ctx}: nlink");
            let rdev = md.rdev();
            let (ma, mi) = (((rdev >> 8) & 0xFFF) as u32, ((rdev & 0xFF) | ((rdev >> 12) & 0xFFF00)) as u32);
            assert_eq!((ma, mi), (*major, *minor), "{ctx}: rdev");
        }
        NodeKind::Fifo | NodeKind::Socket => assert_eq!(md.nlink(), refs[id], "{ctx}: nlink"),
    }
    verify_xattrs(path, n);
}

fn verify_xattrs(path: &Path, n: &Node) {
    let ctx = path.display().to_string();
    let mut list = vec![0u8; 65536];
    let len = rustix::fs::llistxattr(path, &mut list[..]).unwrap();
    let mut got: Vec<Vec<u8>> =
        list[..len].split(|&b| b == 0).filter(|s| !s.is_empty()).map(|s| s.to_vec()).collect();
    got.sort();
    let mut want: Vec<Vec<u8>> = n.xattrs.iter().map(|x| x.name.clone()).collect();
    want.sort();
    assert!(got == want, "{ctx}: xattr names {:?} != {:?}", names(&got), names(&want));
    for x in &n.xattrs {
        let mut buf = vec![0u8; 65536];
        let name = std::ffi::OsStr::from_bytes(&x.name);
        let l = rustix::fs::lgetxattr(path, name, &mut buf[..]).unwrap();
        assert!(buf[..l] == x.value[..], "{ctx}: xattr {} value", String::from_utf8_lossy(&x.name));
    }
}

fn names(v: &[Vec<u8>]) -> Vec<String> {
    v.iter().map(|n| String::from_utf8_lossy(n).into_owned()).collect()
}

/// Compare what ext4-view reads with the tree (trees with timestamps in 1970..2038 only).
pub fn verify_ext4_view(img: &Path, tree: &Tree) {
    let fs = ext4_view::Ext4::load_from_path(img).unwrap();
    verify_view_node(&fs, b"/".to_vec(), tree, 0);
}

fn verify_view_node(fs: &ext4_view::Ext4, path: Vec<u8>, tree: &Tree, id: usize) {
    use ext4_view::FileType as F;
    let n = &tree.nodes[id];
    let ctx = String::from_utf8_lossy(&path).into_owned();
    let p = ext4_view::Path::new(&path);
    let md = fs.symlink_metadata(p).unwrap_or_else(|e| panic!("{ctx}: {e}"));
    let ok = matches!(
        (&n.kind, md.file_type()),
        (NodeKind::Directory { .. }, F::Directory)
            | (NodeKind::Regular { .. }, F::Regular)
            | (NodeKind::Symlink { .. }, F::Symlink)
            | (NodeKind::CharDevice { .. }, F::CharacterDevice)
            | (NodeKind::BlockDevice { .. }, F::BlockDevice)
            | (NodeKind::Fifo, F::Fifo)
            | (NodeKind::Socket, F::Socket)
    );
    assert!(ok, "{ctx}: type {:?}", md.file_type());
    assert_eq!(md.mode(), n.meta.mode & 0o7777, "{ctx}: mode");
    assert_eq!(md.uid(), n.meta.uid, "{ctx}: uid");
    assert_eq!(md.gid(), n.meta.gid, "{ctx}: gid");
    let m = md.modified();
    assert_eq!((m.seconds(), m.nanoseconds()), (n.meta.mtime.sec, n.meta.mtime.nsec), "{ctx}: mtime");
    match &n.kind {
        NodeKind::Directory { entries } => {
            for e in entries {
                let mut child = path.clone();
                if child.len() > 1 {
                    child.push(b'/');
                }
                child.extend_from_slice(&e.name);
                verify_view_node(fs, child, tree, e.node.0 as usize);
            }
        }
        NodeKind::Regular { size, .. } => {
            assert_eq!(md.len(), *size, "{ctx}: size");
            let mut f = fs.open(p).unwrap();
            // ext4-view walks holes block by block when seeking; sampling at 16 TiB takes minutes, so
            // it only checks the first 8 GiB (the kernel checks the rest).
            for (off, len) in file_samples(tree, id).into_iter().filter(|&(off, _)| off < 8 << 30) {
                let want = expected(tree, id, off, len);
                let mut got = vec![0u8; want.len()];
                f.seek_to(off).unwrap();
                let mut done = 0;
                while done < got.len() {
                    let k = f.read_bytes(&mut got[done..]).unwrap();
                    assert!(k > 0, "{ctx}: short read");
                    done += k;
                }
                assert!(got == want, "{ctx}: ext4-view data differs in [{off}, +{len})");
            }
        }
        NodeKind::Symlink { target } => {
            let got = fs.read_link(p).unwrap();
            assert_eq!(got.as_ref(), &target[..], "{ctx}: target");
        }
        _ => {}
    }
}

/// Synthesize, write, and run e2fsck; returns the image and its temp dir.
pub fn build(tree: &Tree, opts: &Options) -> (Ext4Image, tempfile::TempDir, PathBuf) {
    let img = synthesize(tree, opts).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fs.img");
    write_image(&path, tree, &img);
    // Debugging aid: TESSERA_EXT4_KEEP=DIR keeps a copy of every image (named by UUID) for dumpe2fs.
    if let Some(keep) = std::env::var_os("TESSERA_EXT4_KEEP") {
        let name = img.geometry.uuid.iter().map(|b| format!("{b:02x}")).collect::<String>();
        let dst = Path::new(&keep).join(format!("{name}.img"));
        Command::new("cp").arg("--sparse=always").arg(&path).arg(dst).status().unwrap();
    }
    e2fsck_clean(&path);
    (img, dir, path)
}
