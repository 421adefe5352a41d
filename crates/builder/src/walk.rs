//! The directory source: walk a tree without following symlinks into a [`Tree`].

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::{self, File, Metadata};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::SeekFrom;
use rustix::io::Errno;
use tessera_ext4::{
    DataRange, DataRanges, DirEntry, Meta, Name, Node, NodeId, NodeKind, Timestamp, Tree, Xattr,
};
use tessera_image::BlockSize;

use crate::error::BuildError;
use crate::source_index::{Fingerprint, StatKey};

/// How long before the walk a file's mtime and ctime must be for its fingerprint to be trusted
/// (a generous bound on the filesystem clock's tick and on clock steps).
const RACY_WINDOW_NS: i128 = 1_000_000_000;

/// A walked source: the tree plus, for each regular-file node, where to read its content.
#[derive(Debug, Default)]
pub struct SourceTree {
    pub tree: Tree,
    /// Indexed by `NodeId`: for a regular file, where its first link is — (index in `dirs`, index
    /// of the entry in that directory's entries); [`NO_PATH`] for other nodes. Eight bytes a node
    /// instead of a path each.
    files: Vec<(u32, u32)>,
    /// Every walked directory: its node and its path.
    dirs: Vec<(NodeId, PathBuf)>,
    /// Indexed by `NodeId`: a regular file's stat fingerprint (the source index's key),
    /// [`Fingerprint::NONE`] for other nodes and for files changed within a second of the walk.
    stamps: Vec<Fingerprint>,
}

const NO_PATH: (u32, u32) = (u32::MAX, u32::MAX);

impl SourceTree {
    /// The tree alone, the source paths dropped.
    pub fn into_tree(self) -> Tree {
        self.tree
    }

    /// The stat fingerprint of node `node` (see [`crate::source_index`]).
    pub fn stamp(&self, node: usize) -> Fingerprint {
        self.stamps.get(node).copied().unwrap_or(Fingerprint::NONE)
    }

    /// The source path of regular-file node `node` (its first link), `None` for other nodes.
    pub fn file_path(&self, node: usize) -> Option<PathBuf> {
        let &(dir, entry) = self.files.get(node).filter(|&&f| f != NO_PATH)?;
        let (dir_node, dir_path) = self.dirs.get(dir as usize)?;
        let NodeKind::Directory { entries } = &self.tree.nodes.get(dir_node.0 as usize)?.kind else {
            return None;
        };
        let name = &entries.get(entry as usize)?.name;
        Some(dir_path.join(std::ffi::OsStr::from_bytes(name)))
    }

    /// Whether node `node` is a regular file with a source path.
    pub fn has_path(&self, node: usize) -> bool {
        self.files.get(node).is_some_and(|&f| f != NO_PATH)
    }
}

/// Open a file for reading without updating its atime where the kernel allows it (O_NOATIME needs
/// ownership or CAP_FOWNER; fall back to a plain open otherwise).
pub(crate) fn open_noatime(path: &Path) -> Result<File, BuildError> {
    match fs::OpenOptions::new().read(true).custom_flags(libc::O_NOATIME).open(path) {
        Ok(f) => Ok(f),
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
            File::open(path).map_err(BuildError::io(path, "open"))
        }
        Err(e) => Err(BuildError::io(path, "open")(e)),
    }
}

/// Walk `root` depth-first, names sorted bytewise. Node ids follow that order, so a directory's
/// children are numbered together and data is laid out in the order a guest tends to read it.
///
/// Two phases: the directories are listed and every entry is stat'ed and read (xattrs, holes,
/// symlink target) in parallel, a level of the tree at a time — one task per entry, so a wide
/// directory spreads over the CPUs as well as many small ones, with no recursion however deep
/// the tree —; then one thread numbers the nodes in the order above and joins hard links. The
/// tree, and the first error in that order, are those a walk on one thread gives.
pub fn walk_dir(root: &Path) -> Result<SourceTree, BuildError> {
    let root_md = fs::symlink_metadata(root).map_err(BuildError::io(root, "stat"))?;
    if !root_md.is_dir() {
        return Err(BuildError::NotADirectory { path: root.to_owned() });
    }
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i128);
    let trusted_before = started - RACY_WINDOW_NS;
    let root_node = Node {
        meta: meta_of(&root_md),
        kind: NodeKind::Directory { entries: Vec::new() },
        xattrs: read_xattrs(root)?,
    };
    number_nodes(root_node, list_tree(root, trusted_before))
}

/// A directory as [`list_tree`] found it: its path and its entries, names sorted bytewise (or
/// why it could not be read).
struct Listing {
    path: PathBuf,
    entries: Result<Vec<Listed>, BuildError>,
}

/// One directory entry, stat'ed and read: its node, or why not (reported when its turn comes).
struct Listed {
    name: OsString,
    stat: Result<Stat, BuildError>,
}

struct Stat {
    /// `(dev, ino)` of a non-directory with more than one link: its later links share the node.
    link: Option<(u64, u64)>,
    /// The node, or why it could not be read (not reported for a link whose node exists).
    node: Result<Node, BuildError>,
    /// A regular file's source index fingerprint ([`Fingerprint::NONE`] for other nodes).
    stamp: Fingerprint,
    /// A directory's listing (index in [`list_tree`]'s result).
    listing: Option<usize>,
}

/// The first phase of [`walk_dir`]: every directory under `root` (`root` itself at index 0)
/// listed, and its entries stat'ed and read, in parallel a level at a time.
fn list_tree(root: &Path, trusted_before: i128) -> Vec<Listing> {
    use rayon::prelude::*;
    let mut listings: Vec<Listing> = Vec::new();
    let mut level: Vec<PathBuf> = vec![root.to_owned()];
    while !level.is_empty() {
        let names: Vec<Result<Vec<OsString>, BuildError>> =
            level.par_iter().map(|dir| sorted_names(dir)).collect();
        let jobs: Vec<(usize, &OsString)> = names
            .iter()
            .enumerate()
            .filter_map(|(d, names)| Some(d).zip(names.as_ref().ok()))
            .flat_map(|(d, names)| names.iter().map(move |name| (d, name)))
            .collect();
        let mut stats = jobs
            .into_par_iter()
            .map(|(d, name)| stat_entry(&level[d].join(name), trusted_before))
            .collect::<Vec<_>>()
            .into_iter();
        // This level's listings go at `listings.len()..`, the next level's after them.
        let next_first = listings.len() + level.len();
        let mut next = Vec::new();
        for (path, names) in level.into_iter().zip(names) {
            let entries = names.map(|names| {
                // `stats` holds one result per name, in this order.
                names
                    .into_iter()
                    .zip(stats.by_ref())
                    .map(|(name, mut stat)| {
                        if let Ok(Stat { listing: listing @ Some(_), .. }) = &mut stat {
                            *listing = Some(next_first + next.len());
                            next.push(path.join(&name));
                        }
                        Listed { name, stat }
                    })
                    .collect()
            });
            listings.push(Listing { path, entries });
        }
        level = next;
    }
    listings
}

/// The names in directory `dir`, sorted bytewise.
fn sorted_names(dir: &Path) -> Result<Vec<OsString>, BuildError> {
    let mut names: Vec<OsString> = fs::read_dir(dir)
        .map_err(BuildError::io(dir, "read directory"))?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()
        .map_err(BuildError::io(dir, "read directory"))?;
    names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    Ok(names)
}

/// Stat and read the entry at `path`. A directory's listing is `Some(0)` until [`list_tree`]
/// places it.
fn stat_entry(path: &Path, trusted_before: i128) -> Result<Stat, BuildError> {
    let md = fs::symlink_metadata(path).map_err(BuildError::io(path, "stat"))?;
    let node = node_of(path, &md);
    let is_file = matches!(node, Ok(Node { kind: NodeKind::Regular { .. }, .. }));
    Ok(Stat {
        link: (!md.is_dir() && md.nlink() > 1).then(|| (md.dev(), md.ino())),
        node,
        stamp: if is_file { stat_key(&md).fingerprint(trusted_before) } else { Fingerprint::NONE },
        listing: md.is_dir().then_some(0),
    })
}

/// The second phase of [`walk_dir`]: number the listed nodes depth-first (a directory's entries
/// together, when the directory's turn comes), joining hard links, into a [`SourceTree`].
fn number_nodes(root: Node, mut listings: Vec<Listing>) -> Result<SourceTree, BuildError> {
    let mut out = SourceTree::default();
    out.stamps.push(Fingerprint::NONE);
    out.tree.nodes.push(root);
    out.files.push(NO_PATH);
    let mut hard_links: HashMap<(u64, u64), NodeId> = HashMap::new();
    let mut stack: Vec<(NodeId, usize)> = vec![(NodeId(0), 0)];
    while let Some((dir_id, listing)) = stack.pop() {
        let taken = Listing { path: PathBuf::new(), entries: Ok(Vec::new()) };
        let Some(Listing { path: dir_path, entries: listed }) =
            listings.get_mut(listing).map(|l| std::mem::replace(l, taken))
        else {
            continue;
        };
        let dir_index =
            u32::try_from(out.dirs.len()).map_err(|_| BuildError::TooManyNodes { path: dir_path.clone() })?;
        let listed = listed?;
        let mut entries = Vec::with_capacity(listed.len());
        let mut subdirs = Vec::new();
        for Listed { name, stat } in listed {
            let stat = stat?;
            let id = match stat.link.and_then(|key| hard_links.get(&key).copied()) {
                Some(id) => id,
                None => {
                    let id = NodeId(
                        u32::try_from(out.tree.nodes.len())
                            .map_err(|_| BuildError::TooManyNodes { path: dir_path.join(&name) })?,
                    );
                    let node = stat.node?;
                    let is_file = matches!(node.kind, NodeKind::Regular { .. });
                    out.tree.nodes.push(node);
                    // `entries.len()` < the node count, which fits in u32.
                    out.files.push(if is_file { (dir_index, entries.len() as u32) } else { NO_PATH });
                    out.stamps.push(stat.stamp);
                    if let Some(key) = stat.link {
                        hard_links.insert(key, id);
                    }
                    if let Some(listing) = stat.listing {
                        subdirs.push((id, listing));
                    }
                    id
                }
            };
            entries.push(DirEntry { name: Name::from_slice(name.as_bytes()), node: id });
        }
        if let Some(NodeKind::Directory { entries: slot }) =
            out.tree.nodes.get_mut(dir_id.0 as usize).map(|n| &mut n.kind)
        {
            *slot = entries;
        }
        out.dirs.push((dir_id, dir_path));
        // Reverse so the first name is walked first.
        stack.extend(subdirs.into_iter().rev());
    }
    // Grown by doubling: up to half of it is spare room otherwise, for the whole build.
    out.tree.nodes.shrink_to_fit();
    out.files.shrink_to_fit();
    out.dirs.shrink_to_fit();
    out.stamps.shrink_to_fit();
    Ok(out)
}

fn stat_key(md: &Metadata) -> StatKey {
    StatKey {
        dev: md.dev(),
        ino: md.ino(),
        size: md.len(),
        blocks: md.blocks(),
        mtime: (md.mtime(), md.mtime_nsec()),
        ctime: (md.ctime(), md.ctime_nsec()),
    }
}

fn meta_of(md: &Metadata) -> Meta {
    let mtime = Timestamp { sec: md.mtime(), nsec: u32::try_from(md.mtime_nsec()).unwrap_or(0) };
    // A directory source's atime and ctime change whenever the tree is read or copied, so they carry
    // no information: use mtime for both (brief §4).
    Meta {
        mode: (md.mode() & 0o7777) as u16,
        uid: md.uid(),
        gid: md.gid(),
        atime: mtime,
        mtime,
        ctime: mtime,
    }
}

fn node_of(path: &Path, md: &Metadata) -> Result<Node, BuildError> {
    let ft = md.file_type();
    let kind = if ft.is_dir() {
        NodeKind::Directory { entries: Vec::new() }
    } else if ft.is_file() {
        NodeKind::Regular { size: md.len(), data: data_ranges(path, md)? }
    } else if ft.is_symlink() {
        let target = fs::read_link(path).map_err(BuildError::io(path, "read symlink"))?;
        NodeKind::Symlink { target: target.as_os_str().as_bytes().to_vec() }
    } else if ft.is_char_device() || ft.is_block_device() {
        let rdev = md.rdev();
        let (major, minor) = (rustix::fs::major(rdev), rustix::fs::minor(rdev));
        if ft.is_char_device() {
            NodeKind::CharDevice { major, minor }
        } else {
            NodeKind::BlockDevice { major, minor }
        }
    } else if ft.is_fifo() {
        NodeKind::Fifo
    } else if ft.is_socket() {
        NodeKind::Socket
    } else {
        return Err(BuildError::UnsupportedType { path: path.to_owned() });
    };
    Ok(Node { meta: meta_of(md), kind, xattrs: read_xattrs(path)? })
}

/// The block ranges of a regular file that hold data, found with SEEK_DATA / SEEK_HOLE. Ranges are
/// widened to whole blocks (and clipped to the file's last block).
fn data_ranges(path: &Path, md: &Metadata) -> Result<DataRanges, BuildError> {
    let size = md.len();
    if size == 0 {
        return Ok(DataRanges::new());
    }
    let size_blocks = size.div_ceil(BlockSize::U64);
    // Fully allocated files need no probing (and neither do filesystems without holes).
    if md.blocks().saturating_mul(512) >= size {
        return Ok(DataRanges::from_slice(&[DataRange { start_block: 0, blocks: size_blocks }]));
    }
    let file = open_noatime(path)?;
    let mut ranges = DataRanges::new();
    let mut pos = 0u64;
    while pos < size {
        let data = match rustix::fs::seek(&file, SeekFrom::Data(pos)) {
            Ok(d) => d,
            Err(Errno::NXIO) => break,
            // Filesystems without SEEK_DATA: treat the rest as data.
            Err(Errno::INVAL | Errno::OPNOTSUPP) => pos,
            Err(e) => return Err(BuildError::io(path, "seek data")(e.into())),
        };
        if data >= size {
            break;
        }
        let hole = match rustix::fs::seek(&file, SeekFrom::Hole(data)) {
            Ok(h) => h.min(size),
            Err(Errno::NXIO) => size,
            Err(e) => return Err(BuildError::io(path, "seek hole")(e.into())),
        };
        let start = data / BlockSize::U64;
        let end = hole.div_ceil(BlockSize::U64).min(size_blocks);
        match ranges.last_mut() {
            Some(last) if last.start_block + last.blocks >= start => {
                last.blocks = last.blocks.max(end - last.start_block);
            }
            _ if end > start => ranges.push(DataRange { start_block: start, blocks: end - start }),
            _ => {}
        }
        if hole <= pos {
            break;
        }
        pos = hole;
    }
    Ok(ranges)
}

/// All extended attributes of `path` (not following symlinks), sorted by name.
fn read_xattrs(path: &Path) -> Result<Vec<Xattr>, BuildError> {
    let names = loop {
        let len = match rustix::fs::llistxattr_query(path) {
            Ok(n) => n,
            Err(Errno::OPNOTSUPP) => return Ok(Vec::new()),
            Err(e) => return Err(BuildError::io(path, "list xattrs")(e.into())),
        };
        let mut buf = vec![0u8; len];
        match rustix::fs::llistxattr(path, &mut buf[..]) {
            Ok(n) => {
                buf.truncate(n);
                break buf;
            }
            Err(Errno::RANGE) => continue, // grew in between: ask again
            Err(e) => return Err(BuildError::io(path, "list xattrs")(e.into())),
        }
    };
    let mut out = Vec::new();
    for name in names.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let value = loop {
            let len = match rustix::fs::lgetxattr_query(path, name) {
                Ok(n) => n,
                Err(Errno::NODATA) => break None, // removed in between
                Err(e) => return Err(BuildError::io(path, "read xattr")(e.into())),
            };
            let mut buf = vec![0u8; len];
            match rustix::fs::lgetxattr(path, name, &mut buf[..]) {
                Ok(n) => {
                    buf.truncate(n);
                    break Some(buf);
                }
                Err(Errno::RANGE) => continue,
                Err(Errno::NODATA) => break None,
                Err(e) => return Err(BuildError::io(path, "read xattr")(e.into())),
            }
        };
        if let Some(value) = value {
            out.push(Xattr { name: name.into(), value });
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::io::{Seek, Write};
    use std::os::unix::fs::symlink;

    use super::*;

    #[test]
    fn walks_kinds_links_holes_and_xattrs() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir(root.join("b")).unwrap();
        fs::create_dir(root.join("a")).unwrap();
        fs::write(root.join("a/file"), b"hello").unwrap();
        fs::hard_link(root.join("a/file"), root.join("b/link")).unwrap();
        symlink("a/file", root.join("sym")).unwrap();
        let mut sparse = File::create(root.join("sparse")).unwrap();
        sparse.seek(std::io::SeekFrom::Start(10 << 20)).unwrap();
        sparse.write_all(b"island").unwrap();
        sparse.set_len(20 << 20).unwrap();
        drop(sparse);
        let xattr_ok = rustix::fs::lsetxattr(
            root.join("a/file").as_path(),
            "user.test",
            b"value",
            rustix::fs::XattrFlags::empty(),
        )
        .is_ok();

        let src = walk_dir(root).unwrap();
        let nodes = &src.tree.nodes;
        let NodeKind::Directory { entries } = &nodes[0].kind else { panic!("root is not a dir") };
        let names: Vec<&[u8]> = entries.iter().map(|e| e.name.as_slice()).collect();
        assert_eq!(names, vec![&b"a"[..], b"b", b"sparse", b"sym"]);

        let id_of = |dir: usize, name: &[u8]| {
            let NodeKind::Directory { entries } = &nodes[dir].kind else { panic!("not a dir") };
            entries.iter().find(|e| e.name[..] == *name).map(|e| e.node.0 as usize).unwrap()
        };
        let a = id_of(0, b"a");
        let b = id_of(0, b"b");
        let file = id_of(a, b"file");
        assert_eq!(file, id_of(b, b"link"), "hard links share one node");
        assert_eq!(src.file_path(file), Some(root.join("a/file")), "the first link's path");
        assert!(src.has_path(file) && !src.has_path(a) && src.file_path(a).is_none());
        if xattr_ok {
            assert_eq!(
                nodes[file].xattrs,
                vec![Xattr { name: b"user.test".to_vec(), value: b"value".to_vec() }]
            );
        }
        let NodeKind::Symlink { target } = &nodes[id_of(0, b"sym")].kind else { panic!("not a symlink") };
        assert_eq!(target, b"a/file");

        let NodeKind::Regular { size, data } = &nodes[id_of(0, b"sparse")].kind else { panic!("not a file") };
        assert_eq!(*size, 20 << 20);
        let mapped: u64 = data.iter().map(|r| r.blocks).sum();
        assert!(mapped <= 16, "hole was read as data: {data:?}");
        assert!(data.iter().any(|r| r.start_block <= 2560 && r.start_block + r.blocks > 2560), "{data:?}");
        // atime and ctime follow mtime for directory sources
        assert_eq!(nodes[file].meta.atime, nodes[file].meta.mtime);
        assert_eq!(nodes[file].meta.ctime, nodes[file].meta.mtime);
    }

    #[test]
    fn nodes_are_numbered_depth_first_and_a_hard_link_keeps_its_first_path_in_that_order() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        // "a/b/c/file" comes first depth-first, though "z/link" is found a level-at-a-time first.
        fs::create_dir_all(root.join("a/b/c")).unwrap();
        fs::create_dir(root.join("z")).unwrap();
        fs::write(root.join("a/b/c/file"), b"x").unwrap();
        fs::hard_link(root.join("a/b/c/file"), root.join("z/link")).unwrap();
        fs::write(root.join("a/b/two"), b"y").unwrap();
        fs::write(root.join("a/one"), b"z").unwrap();
        let src = walk_dir(root).unwrap();
        // Each directory's entries numbered together when the directory's turn comes.
        let mut order = Vec::new();
        for (id, _) in src.tree.nodes.iter().enumerate() {
            let path = (0..src.tree.nodes.len())
                .find_map(|d| match &src.tree.nodes[d].kind {
                    NodeKind::Directory { entries } => entries
                        .iter()
                        .find(|e| e.node.0 as usize == id)
                        .map(|e| (d, String::from_utf8_lossy(&e.name).into_owned())),
                    _ => None,
                })
                .map_or_else(|| "/".to_owned(), |(d, name)| format!("{d}/{name}"));
            order.push(path);
        }
        // (Node 7 is in two directories: the test's search finds it in z, node 2, first.)
        assert_eq!(order, ["/", "0/a", "0/z", "1/b", "1/one", "3/c", "3/two", "2/link"]);
        let file = 7;
        let NodeKind::Directory { entries } = &src.tree.nodes[5].kind else { panic!("c is not a dir") };
        assert_eq!(entries[0].node.0 as usize, file, "a/b/c/file is node 7");
        assert_eq!(src.file_path(file), Some(root.join("a/b/c/file")));
        let NodeKind::Directory { entries } = &src.tree.nodes[2].kind else { panic!("z is not a dir") };
        assert_eq!(entries[0].node.0 as usize, file, "the later link shares the node");
    }

    #[test]
    fn the_first_error_depth_first_is_reported() {
        let failed = |what: &str| BuildError::UnsupportedType { path: PathBuf::from(what) };
        let t = Timestamp { sec: 0, nsec: 0 };
        let meta = Meta { mode: 0o755, uid: 0, gid: 0, atime: t, mtime: t, ctime: t };
        let dir = |listing| Stat {
            link: None,
            node: Ok(Node { meta, kind: NodeKind::Directory { entries: Vec::new() }, xattrs: Vec::new() }),
            stamp: Fingerprint::NONE,
            listing: Some(listing),
        };
        let listed = |name: &str, stat| Listed { name: name.into(), stat };
        let root = Node { meta, kind: NodeKind::Directory { entries: Vec::new() }, xattrs: Vec::new() };
        let reported = |listings| match number_nodes(root.clone(), listings) {
            Err(BuildError::UnsupportedType { path }) => path,
            other => panic!("{other:?}"),
        };
        // root: a/ (whose entry x fails), b (fails): root's entries are read before a's, as on
        // one thread, so b's failure is the one reported.
        let listings = vec![
            Listing {
                path: "/r".into(),
                entries: Ok(vec![listed("a", Ok(dir(1))), listed("b", Err(failed("b")))]),
            },
            Listing { path: "/r/a".into(), entries: Ok(vec![listed("x", Err(failed("a/x")))]) },
        ];
        assert_eq!(reported(listings), Path::new("b"));
        // root: a/ (x fails), c/ (y fails, and c/d/ cannot be read): a comes first.
        let listings = vec![
            Listing {
                path: "/r".into(),
                entries: Ok(vec![listed("a", Ok(dir(1))), listed("c", Ok(dir(2)))]),
            },
            Listing { path: "/r/a".into(), entries: Ok(vec![listed("x", Err(failed("a/x")))]) },
            Listing {
                path: "/r/c".into(),
                entries: Ok(vec![listed("d", Ok(dir(3))), listed("y", Err(failed("c/y")))]),
            },
            Listing { path: "/r/c/d".into(), entries: Err(failed("c/d")) },
        ];
        assert_eq!(reported(listings), Path::new("a/x"));
    }

    #[test]
    fn rejects_non_directory_source() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        fs::write(&f, b"x").unwrap();
        assert!(matches!(walk_dir(&f), Err(BuildError::NotADirectory { .. })));
        assert!(matches!(walk_dir(&dir.path().join("missing")), Err(BuildError::Io { .. })));
    }
}
