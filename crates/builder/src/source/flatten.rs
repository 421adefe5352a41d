//! Applying OCI layers in order by the image-spec changeset rules, without touching the disk.
//!
//! Input: each layer's entries as parsed from its tar headers ([`LayerEntry`], content stays in the
//! stream and is referenced by offset). Output: a [`Tree`] numbered like the directory walk
//! (depth-first, names sorted bytewise) plus, per regular-file node, where its bytes are
//! ([`ContentRef`]).
//!
//! Rules (OCI image-spec "Representing Changes", and what `umoci unpack` does):
//! - Whiteouts (`.wh.NAME`) and opaque markers (`.wh..wh..opq`) hide content of *lower* layers only:
//!   they are applied first, before the layer's other entries, so their order inside the layer does
//!   not matter. Other `.wh..wh.*` names (aufs metadata) are ignored.
//! - Entries are applied in order; a later entry replaces an earlier one at the same path (file ↔
//!   directory ↔ symlink), except a directory over a directory, which only changes metadata and
//!   keeps the children.
//! - Leading `/` and `./`, empty and `.` components are dropped; `..` is an error; so is any entry
//!   (or whiteout, or hard-link target) whose path goes through a symlink.
//! - Missing parents are created with fixed defaults (0755, 0:0, time T); the `./` entry gives the
//!   root its attributes.
//! - A hard link names the node at its target path in the flattened state so far (this layer's
//!   earlier entries and lower layers); the target must exist and must not be a directory. Since
//!   the order of whiteouts inside a layer does not matter, a hard link may name a lower-layer file
//!   that the same layer whites out, before or after the link in the tar: the link keeps that file
//!   alive under its new name (what `umoci unpack` does when the link comes first).

use std::collections::{BTreeMap, HashMap};

use tessera_ext4::{
    DataRange, DataRanges, DirEntry, Meta, Name, Node, NodeId, NodeKind, Timestamp, Tree, Xattr,
};
use tessera_image::BlockSize;

use super::error::{show, SourceError};

/// What a tar entry is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryKind {
    /// A regular file: its data is `size` bytes at `offset` in the layer's uncompressed tar stream.
    File {
        size: u64,
        offset: u64,
    },
    Dir,
    Symlink(Vec<u8>),
    /// A hard link to the path given (as written in the tar).
    HardLink(Vec<u8>),
    Char {
        major: u32,
        minor: u32,
    },
    Block {
        major: u32,
        minor: u32,
    },
    Fifo,
}

/// One tar entry, as read from a layer's headers (PAX and GNU extensions applied).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerEntry {
    /// The path as written (raw bytes).
    pub path: Vec<u8>,
    pub kind: EntryKind,
    pub meta: Meta,
    /// Sorted by name.
    pub xattrs: Vec<Xattr>,
}

/// Where a regular file's bytes are: `size` bytes at `offset` in layer `layer`'s uncompressed stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContentRef {
    pub layer: usize,
    pub offset: u64,
    pub size: u64,
}

/// The flattened image: the tree and, per node, where a regular file's content is.
#[derive(Debug, Default)]
pub struct FlatTree {
    pub tree: Tree,
    pub content: Vec<Option<ContentRef>>,
}

#[derive(Debug)]
enum FKind {
    Dir(BTreeMap<Vec<u8>, usize>),
    File(ContentRef),
    Symlink(Vec<u8>),
    Char(u32, u32),
    Block(u32, u32),
    Fifo,
}

#[derive(Debug)]
struct FNode {
    meta: Meta,
    xattrs: Vec<Xattr>,
    kind: FKind,
}

/// The layer applier. Nodes live in an arena; replaced nodes simply become unreachable.
#[derive(Debug)]
pub struct Flattener {
    nodes: Vec<FNode>,
    default_meta: Meta,
    /// What the current layer's whiteouts removed: (directory, name) → node. Hard links of the
    /// same layer may still name these (see [`Self::link_target`]); cleared per layer.
    hidden: HashMap<(usize, Vec<u8>), usize>,
}

const WHITEOUT: &[u8] = b".wh.";
const OPAQUE: &[u8] = b".wh..wh..opq";
const META_PREFIX: &[u8] = b".wh..wh.";

/// Split a tar path into components: leading `/`, empty and `.` components dropped, `..` refused.
fn components<'a>(layer: &str, path: &'a [u8]) -> Result<Vec<&'a [u8]>, SourceError> {
    let mut out = Vec::new();
    for c in path.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err(SourceError::DotDot { layer: layer.to_owned(), path: show(path) }),
            c if c.len() > 255 => {
                return Err(SourceError::NameTooLong { layer: layer.to_owned(), path: show(path) })
            }
            c => out.push(c),
        }
    }
    Ok(out)
}

fn join(parts: &[&[u8]]) -> String {
    show(&parts.join(&b'/'))
}

impl Flattener {
    /// An empty image whose root (until a `./` entry says otherwise) and implicit parents get mode
    /// 0755, owner 0:0 and all times `fs_time`.
    pub fn new(fs_time: i64) -> Self {
        let t = Timestamp { sec: fs_time, nsec: 0 };
        let default_meta = Meta { mode: 0o755, uid: 0, gid: 0, atime: t, mtime: t, ctime: t };
        let root = FNode { meta: default_meta, xattrs: Vec::new(), kind: FKind::Dir(BTreeMap::new()) };
        Self { nodes: vec![root], default_meta, hidden: HashMap::new() }
    }

    fn children(&mut self, dir: usize) -> Option<&mut BTreeMap<Vec<u8>, usize>> {
        match self.nodes.get_mut(dir).map(|n| &mut n.kind) {
            Some(FKind::Dir(children)) => Some(children),
            _ => None,
        }
    }

    fn child(&self, dir: usize, name: &[u8]) -> Option<usize> {
        match self.nodes.get(dir).map(|n| &n.kind) {
            Some(FKind::Dir(children)) => children.get(name).copied(),
            _ => None,
        }
    }

    fn push(&mut self, node: FNode) -> usize {
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    /// Walk `parts` from the root without creating anything: `Ok(None)` when a component is
    /// missing or not a directory (except the last, which may be anything); an error when the
    /// walk would go through a symlink.
    fn lookup(&self, layer: &str, path: &[u8], parts: &[&[u8]]) -> Result<Option<usize>, SourceError> {
        let mut cur = 0usize;
        for (i, name) in parts.iter().enumerate() {
            let next = match &self.nodes[cur].kind {
                FKind::Dir(children) => children.get(*name).copied(),
                FKind::Symlink(_) => {
                    return Err(SourceError::UnderSymlink {
                        layer: layer.to_owned(),
                        path: show(path),
                        symlink: join(&parts[..i]),
                    })
                }
                _ => None,
            };
            match next {
                Some(n) => cur = n,
                None => return Ok(None),
            }
        }
        Ok(Some(cur))
    }

    /// The directory that will hold `parts.last()`, creating missing parents with the defaults.
    fn parent_dir(&mut self, layer: &str, path: &[u8], parts: &[&[u8]]) -> Result<usize, SourceError> {
        let mut cur = 0usize;
        let parents = parts.len().saturating_sub(1);
        for i in 0..parents {
            let name = parts[i];
            cur = match self.child(cur, name) {
                Some(n) => match &self.nodes[n].kind {
                    FKind::Dir(_) => n,
                    FKind::Symlink(_) => {
                        return Err(SourceError::UnderSymlink {
                            layer: layer.to_owned(),
                            path: show(path),
                            symlink: join(&parts[..=i]),
                        })
                    }
                    _ => {
                        return Err(SourceError::ParentNotDirectory {
                            layer: layer.to_owned(),
                            path: show(path),
                            parent: join(&parts[..=i]),
                        })
                    }
                },
                None => {
                    let dir = FNode {
                        meta: self.default_meta,
                        xattrs: Vec::new(),
                        kind: FKind::Dir(BTreeMap::new()),
                    };
                    let id = self.push(dir);
                    if let Some(children) = self.children(cur) {
                        children.insert(name.to_vec(), id);
                    }
                    id
                }
            };
        }
        Ok(cur)
    }

    /// Apply one layer's entries (`layer` names it in errors; `index` goes into content refs).
    pub fn apply_layer(
        &mut self,
        index: usize,
        layer: &str,
        entries: &[LayerEntry],
    ) -> Result<(), SourceError> {
        // Whiteouts first: they only hide what lower layers put there.
        let mut regular = Vec::with_capacity(entries.len());
        for e in entries {
            let parts = components(layer, &e.path)?;
            let Some((&base, dir_parts)) = parts.split_last() else {
                regular.push((e, parts));
                continue;
            };
            let is_whiteout = base.starts_with(WHITEOUT);
            if is_whiteout {
                // The directory itself must not be a symlink either.
                if let Some(d) = self.lookup(layer, &e.path, dir_parts)? {
                    if matches!(self.nodes[d].kind, FKind::Symlink(_)) {
                        return Err(SourceError::UnderSymlink {
                            layer: layer.to_owned(),
                            path: show(&e.path),
                            symlink: join(dir_parts),
                        });
                    }
                }
            }
            if base == OPAQUE {
                if let Some(dir) = self.lookup(layer, &e.path, dir_parts)? {
                    if let Some(children) = self.children(dir) {
                        let removed = std::mem::take(children);
                        for (name, child) in removed {
                            self.hidden.entry((dir, name)).or_insert(child);
                        }
                    }
                }
            } else if base.starts_with(META_PREFIX) {
                // aufs metadata (.wh..wh.plnk, .wh..wh.aufs): not part of the filesystem.
            } else if let Some(name) = base.strip_prefix(WHITEOUT) {
                if let Some(dir) = self.lookup(layer, &e.path, dir_parts)? {
                    if let Some(child) = self.children(dir).and_then(|c| c.remove(name)) {
                        self.hidden.entry((dir, name.to_vec())).or_insert(child);
                    }
                }
            } else {
                regular.push((e, parts));
            }
        }
        let applied =
            regular.into_iter().try_for_each(|(e, parts)| self.apply_entry(index, layer, e, &parts));
        self.hidden.clear();
        applied
    }

    /// The node a hard link of the current layer names: the node at `parts` in the state "lower
    /// layers, then this layer's earlier entries" — the state before this layer's whiteouts when
    /// they removed the path (or a parent of it) and no earlier entry of the layer replaced it.
    ///
    /// The walk follows two views at once: `cur`, the state after the whiteouts, and `low`, the
    /// lower state as the whiteouts found it (a whited-out name resolves through `hidden`). A
    /// name present in `cur` wins, except that a directory the layer recreated over a whited-out
    /// one is merged with it (as a directory entry over a directory would be).
    fn link_target(&self, layer: &str, target: &[u8], parts: &[&[u8]]) -> Result<Option<usize>, SourceError> {
        let mut cur = Some(0usize);
        let mut low = Some(0usize);
        for (i, name) in parts.iter().enumerate() {
            for view in [cur, low].into_iter().flatten() {
                if matches!(self.nodes[view].kind, FKind::Symlink(_)) {
                    return Err(SourceError::UnderSymlink {
                        layer: layer.to_owned(),
                        path: show(target),
                        symlink: join(&parts[..i]),
                    });
                }
            }
            let next_cur = cur.and_then(|c| self.child(c, name));
            let next_low = low
                .and_then(|l| self.hidden.get(&(l, name.to_vec())).copied().or_else(|| self.child(l, name)));
            if i + 1 == parts.len() {
                return Ok(next_cur.or(next_low));
            }
            let is_dir = |n: usize| matches!(self.nodes[n].kind, FKind::Dir(_));
            let is_symlink = |n: usize| matches!(self.nodes[n].kind, FKind::Symlink(_));
            // Views that cannot hold children end; a symlink stays, to be refused at the next step.
            let walkable = |n: &usize| is_dir(*n) || is_symlink(*n);
            match next_cur {
                // Replaced by a file, device, … in this layer: nothing exists below it.
                Some(n) if !walkable(&n) => return Ok(None),
                // The lower view continues only where a directory of this layer merges with a
                // lower directory.
                Some(n) => {
                    cur = Some(n);
                    low = next_low.filter(|&l| is_dir(n) && is_dir(l));
                }
                None => {
                    cur = None;
                    low = next_low.filter(walkable);
                }
            }
            if cur.is_none() && low.is_none() {
                return Ok(None);
            }
        }
        Ok(None)
    }

    fn apply_entry(
        &mut self,
        index: usize,
        layer: &str,
        e: &LayerEntry,
        parts: &[&[u8]],
    ) -> Result<(), SourceError> {
        let Some(&name) = parts.last() else {
            // The root itself (`./` or `/`).
            return match e.kind {
                EntryKind::Dir => {
                    self.nodes[0].meta = e.meta;
                    self.nodes[0].xattrs = e.xattrs.clone();
                    Ok(())
                }
                _ => Err(SourceError::RootNotDirectory { layer: layer.to_owned(), path: show(&e.path) }),
            };
        };
        let dir = self.parent_dir(layer, &e.path, parts)?;
        let existing = self.child(dir, name);
        let kind = match &e.kind {
            EntryKind::Dir => {
                if let Some(n) = existing.filter(|&n| matches!(self.nodes[n].kind, FKind::Dir(_))) {
                    // Directory over directory: metadata only.
                    self.nodes[n].meta = e.meta;
                    self.nodes[n].xattrs = e.xattrs.clone();
                    return Ok(());
                }
                FKind::Dir(BTreeMap::new())
            }
            EntryKind::File { size, offset } => {
                FKind::File(ContentRef { layer: index, offset: *offset, size: *size })
            }
            EntryKind::Symlink(target) => FKind::Symlink(target.clone()),
            EntryKind::Char { major, minor } => FKind::Char(*major, *minor),
            EntryKind::Block { major, minor } => FKind::Block(*major, *minor),
            EntryKind::Fifo => FKind::Fifo,
            EntryKind::HardLink(target) => {
                let tparts = components(layer, target)?;
                let found = self.link_target(layer, target, &tparts)?;
                let Some(t) = found else {
                    return Err(SourceError::HardLinkMissing {
                        layer: layer.to_owned(),
                        path: show(&e.path),
                        target: show(target),
                    });
                };
                if matches!(self.nodes[t].kind, FKind::Dir(_)) {
                    return Err(SourceError::HardLinkToDirectory {
                        layer: layer.to_owned(),
                        path: show(&e.path),
                        target: show(target),
                    });
                }
                if let Some(children) = self.children(dir) {
                    children.insert(name.to_vec(), t);
                }
                return Ok(());
            }
        };
        let id = self.push(FNode { meta: e.meta, xattrs: e.xattrs.clone(), kind });
        if let Some(children) = self.children(dir) {
            children.insert(name.to_vec(), id);
        }
        Ok(())
    }

    /// Number the reachable nodes like the directory walk (depth-first, a directory's entries
    /// numbered together, names sorted bytewise; hard links share their first number).
    pub fn finish(self) -> Result<FlatTree, SourceError> {
        let mut out = FlatTree::default();
        let mut new_id: Vec<Option<u32>> = vec![None; self.nodes.len()];
        let convert = |n: &FNode| -> (Node, Option<ContentRef>) {
            let (kind, content) = match &n.kind {
                FKind::Dir(_) => (NodeKind::Directory { entries: Vec::new() }, None),
                FKind::File(c) => {
                    let data = if c.size > 0 {
                        DataRanges::from_slice(&[DataRange {
                            start_block: 0,
                            blocks: c.size.div_ceil(BlockSize::U64),
                        }])
                    } else {
                        DataRanges::new()
                    };
                    (NodeKind::Regular { size: c.size, data }, Some(*c))
                }
                FKind::Symlink(t) => (NodeKind::Symlink { target: t.clone() }, None),
                FKind::Char(major, minor) => (NodeKind::CharDevice { major: *major, minor: *minor }, None),
                FKind::Block(major, minor) => (NodeKind::BlockDevice { major: *major, minor: *minor }, None),
                FKind::Fifo => (NodeKind::Fifo, None),
            };
            (Node { meta: n.meta, kind, xattrs: n.xattrs.clone() }, content)
        };
        let (root, _) = convert(&self.nodes[0]);
        out.tree.nodes.push(root);
        out.content.push(None);
        new_id[0] = Some(0);
        let mut stack: Vec<usize> = vec![0];
        while let Some(old) = stack.pop() {
            let FKind::Dir(children) = &self.nodes[old].kind else { continue };
            let mut entries = Vec::with_capacity(children.len());
            let mut subdirs = Vec::new();
            for (name, &child) in children {
                let id = match new_id[child] {
                    Some(id) => id,
                    None => {
                        let id = u32::try_from(out.tree.nodes.len()).map_err(|_| SourceError::Layout {
                            path: std::path::PathBuf::from(show(name)),
                            reason: "too many files for one image".into(),
                        })?;
                        let (node, content) = convert(&self.nodes[child]);
                        out.tree.nodes.push(node);
                        out.content.push(content);
                        new_id[child] = Some(id);
                        if matches!(self.nodes[child].kind, FKind::Dir(_)) {
                            subdirs.push(child);
                        }
                        id
                    }
                };
                entries.push(DirEntry { name: Name::from_slice(name), node: NodeId(id) });
            }
            let slot = new_id[old].map(|i| i as usize);
            if let Some(NodeKind::Directory { entries: e }) =
                slot.and_then(|i| out.tree.nodes.get_mut(i)).map(|n| &mut n.kind)
            {
                *e = entries;
            }
            stack.extend(subdirs.into_iter().rev());
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(mode: u16, sec: i64) -> Meta {
        let t = Timestamp { sec, nsec: 0 };
        Meta { mode, uid: 0, gid: 0, atime: t, mtime: t, ctime: t }
    }

    fn file(path: &str, offset: u64) -> LayerEntry {
        LayerEntry {
            path: path.as_bytes().to_vec(),
            kind: EntryKind::File { size: 5, offset },
            meta: meta(0o644, 1),
            xattrs: Vec::new(),
        }
    }

    fn entry(path: &str, kind: EntryKind) -> LayerEntry {
        LayerEntry { path: path.as_bytes().to_vec(), kind, meta: meta(0o755, 2), xattrs: Vec::new() }
    }

    fn dir(path: &str) -> LayerEntry {
        entry(path, EntryKind::Dir)
    }

    /// path → (kind letter, content offset) of the flattened tree, for easy assertions.
    fn listing(f: Flattener) -> Vec<(String, String)> {
        let flat = f.finish().unwrap();
        let mut out = Vec::new();
        let mut stack = vec![(0usize, String::new())];
        while let Some((n, prefix)) = stack.pop() {
            if let NodeKind::Directory { entries } = &flat.tree.nodes[n].kind {
                for e in entries {
                    let p = format!("{prefix}/{}", String::from_utf8_lossy(&e.name));
                    let i = e.node.0 as usize;
                    let desc = match &flat.tree.nodes[i].kind {
                        NodeKind::Directory { .. } => "d".to_string(),
                        NodeKind::Regular { .. } => format!("f@{}#{}", flat.content[i].unwrap().offset, i),
                        NodeKind::Symlink { target } => format!("l->{}", String::from_utf8_lossy(target)),
                        NodeKind::Fifo => "p".into(),
                        _ => "other".into(),
                    };
                    out.push((p.clone(), desc));
                    stack.push((i, p));
                }
            }
        }
        out.sort();
        out
    }

    fn paths(l: &[(String, String)]) -> Vec<&str> {
        l.iter().map(|(p, _)| p.as_str()).collect()
    }

    #[test]
    fn whiteouts_opaque_and_replacement() {
        let mut f = Flattener::new(0);
        f.apply_layer(
            0,
            "l0",
            &[
                dir("./"),
                dir("./a/"),
                file("./a/x", 10),
                file("./a/y", 20),
                dir("b"),
                file("b/z", 30),
                file("c", 40),
            ],
        )
        .unwrap();
        f.apply_layer(
            1,
            "l1",
            &[
                file("a/new", 50),
                entry("a/.wh..wh..opq", EntryKind::File { size: 0, offset: 0 }),
                entry("b/.wh.z", EntryKind::File { size: 0, offset: 0 }),
                entry("c", EntryKind::Symlink(b"b".to_vec())),
                entry(".wh..wh.plnk", EntryKind::Dir),
                entry("d/.wh.nothing", EntryKind::File { size: 0, offset: 0 }),
            ],
        )
        .unwrap();
        let l = listing(f);
        assert_eq!(paths(&l), vec!["/a", "/a/new", "/b", "/c"]);
        assert_eq!(l[3].1, "l->b");
    }

    #[test]
    fn whiteout_only_hides_lower_layers() {
        let mut f = Flattener::new(0);
        f.apply_layer(0, "l0", &[file("x", 1)]).unwrap();
        // The layer's own `x` survives its `.wh.x`, whatever the order.
        f.apply_layer(1, "l1", &[file("x", 2), entry(".wh.x", EntryKind::File { size: 0, offset: 0 })])
            .unwrap();
        let l = listing(f);
        assert_eq!(paths(&l), vec!["/x"]);
        assert!(l[0].1.starts_with("f@2"));
    }

    #[test]
    fn dir_over_dir_keeps_children_and_file_replaces_dir() {
        let mut f = Flattener::new(0);
        f.apply_layer(0, "l0", &[dir("d"), file("d/x", 1), dir("e"), file("e/y", 2)]).unwrap();
        let mut d = dir("d");
        d.meta.mode = 0o700;
        f.apply_layer(1, "l1", &[d, file("e", 3)]).unwrap();
        let flat = f.finish().unwrap();
        let NodeKind::Directory { entries } = &flat.tree.nodes[0].kind else { panic!() };
        let d = entries.iter().find(|e| e.name[..] == b"d"[..]).unwrap().node.0 as usize;
        assert_eq!(flat.tree.nodes[d].meta.mode, 0o700);
        assert!(matches!(&flat.tree.nodes[d].kind, NodeKind::Directory { entries } if entries.len() == 1));
        let e = entries.iter().find(|e| e.name[..] == b"e"[..]).unwrap().node.0 as usize;
        assert!(matches!(flat.tree.nodes[e].kind, NodeKind::Regular { .. }));
    }

    #[test]
    fn hard_links_within_and_across_layers() {
        let mut f = Flattener::new(0);
        f.apply_layer(0, "l0", &[file("a", 1), entry("b", EntryKind::HardLink(b"./a".to_vec()))]).unwrap();
        f.apply_layer(1, "l1", &[entry("c", EntryKind::HardLink(b"/a".to_vec())), file("a", 9)]).unwrap();
        let flat = f.finish().unwrap();
        let NodeKind::Directory { entries } = &flat.tree.nodes[0].kind else { panic!() };
        let id = |n: &[u8]| entries.iter().find(|e| e.name[..] == *n).unwrap().node;
        assert_eq!(id(b"b"), id(b"c"), "b and c stay linked to the old a");
        assert_ne!(id(b"a"), id(b"b"));
        assert_eq!(flat.content[id(b"a").0 as usize].unwrap().offset, 9);
        assert_eq!(flat.content[id(b"b").0 as usize].unwrap().offset, 1);
    }

    /// A hard link may name a lower file that its own layer whites out, whatever the order of
    /// the two in the tar (umoci unpack agrees when the link comes first, and fails otherwise).
    #[test]
    fn hard_link_to_a_lower_file_the_same_layer_whites_out() {
        let wh = |p: &str| entry(p, EntryKind::File { size: 0, offset: 0 });
        let link = |p: &str, t: &str| entry(p, EntryKind::HardLink(t.as_bytes().to_vec()));
        let lower = [file("a", 1), dir("d"), file("d/f", 2), file("d/g", 3), dir("e"), file("e/h", 4)];
        let d_fg = [("/d", "d"), ("/d/f", "f@2"), ("/d/g", "f@3")];
        let with = |extra: &[(&'static str, &'static str)], rest: &[(&'static str, &'static str)]| {
            let mut v: Vec<(&str, &str)> = extra.iter().chain(rest).copied().collect();
            v.sort();
            v
        };
        type Listing<'a> = Vec<(&'a str, &'a str)>;
        let cases: Vec<(Vec<LayerEntry>, Listing)> = vec![
            // link first, whiteout after (umoci's order) and the other way round.
            (vec![link("b", "a"), wh(".wh.a")], with(&[("/b", "f@1")], &d_fg)),
            (vec![wh(".wh.a"), link("b", "a")], with(&[("/b", "f@1")], &d_fg)),
            // A whited-out parent directory, an opaque directory, a whited-out file.
            (vec![wh(".wh.d"), link("x", "d/f")], with(&[("/a", "f@1"), ("/x", "f@2")], &[])),
            (
                vec![wh("d/.wh..wh..opq"), link("x", "d/f")],
                with(&[("/a", "f@1"), ("/d", "d"), ("/x", "f@2")], &[]),
            ),
            (
                vec![wh("d/.wh.f"), link("x", "d/f")],
                with(&[("/a", "f@1"), ("/d", "d"), ("/d/g", "f@3"), ("/x", "f@2")], &[]),
            ),
            // The directory recreated by the layer merges with the whited-out one for the link.
            (
                vec![wh(".wh.d"), dir("d"), file("d/new", 9), link("x", "d/f")],
                with(&[("/a", "f@1"), ("/d", "d"), ("/d/new", "f@9"), ("/x", "f@2")], &[]),
            ),
            // The layer's own replacement wins over the whited-out lower file.
            (vec![wh(".wh.a"), file("a", 7), link("b", "a")], with(&[("/a", "f@7"), ("/b", "f@7")], &d_fg)),
        ];
        for (i, (top, want)) in cases.into_iter().enumerate() {
            let mut f = Flattener::new(0);
            f.apply_layer(0, "l0", &lower).unwrap();
            f.apply_layer(1, "l1", &top).unwrap_or_else(|e| panic!("case {i}: {e}"));
            let got = listing(f);
            let got: Vec<(String, String)> = got
                .into_iter()
                .filter(|(p, _)| !p.starts_with("/e"))
                .map(|(p, d)| (p, d.split('#').next().unwrap_or("").to_owned()))
                .collect();
            let want: Vec<(String, String)> =
                want.iter().map(|(p, d)| (p.to_string(), d.to_string())).collect();
            assert_eq!(got, want, "case {i}");
        }
        // Still refused: a file replaced by a file (nothing below it), a link through a symlink
        // that replaced a whited-out directory, a target that never existed.
        let refused: Vec<Vec<LayerEntry>> = vec![
            vec![wh(".wh.d"), file("d", 5), link("x", "d/f")],
            vec![wh(".wh.zz"), link("x", "zz")],
            vec![file("e", 5), link("x", "e/h")],
        ];
        for (i, top) in refused.into_iter().enumerate() {
            let mut f = Flattener::new(0);
            f.apply_layer(0, "l0", &lower).unwrap();
            assert!(
                matches!(f.apply_layer(1, "l1", &top), Err(SourceError::HardLinkMissing { .. })),
                "refused case {i}"
            );
        }
        let mut f = Flattener::new(0);
        f.apply_layer(0, "l0", &lower).unwrap();
        let top = [wh(".wh.d"), entry("d", EntryKind::Symlink(b"e".to_vec())), link("x", "d/h")];
        assert!(matches!(f.apply_layer(1, "l1", &top), Err(SourceError::UnderSymlink { .. })));
        // The whited-out names of one layer are forgotten by the next.
        let mut f = Flattener::new(0);
        f.apply_layer(0, "l0", &lower).unwrap();
        f.apply_layer(1, "l1", &[wh(".wh.a")]).unwrap();
        assert!(matches!(
            f.apply_layer(2, "l2", &[link("b", "a")]),
            Err(SourceError::HardLinkMissing { .. })
        ));
    }

    #[test]
    fn implicit_parents_get_defaults_and_root_entry_sets_root() {
        let mut f = Flattener::new(77);
        let mut root = dir("./");
        root.meta.mode = 0o711;
        root.meta.uid = 5;
        f.apply_layer(0, "l0", &[file("/p/q/r", 1), root]).unwrap();
        let flat = f.finish().unwrap();
        assert_eq!(flat.tree.nodes[0].meta.mode, 0o711);
        assert_eq!(flat.tree.nodes[0].meta.uid, 5);
        let p = &flat.tree.nodes[1];
        assert_eq!(p.meta, meta(0o755, 77));
    }

    #[test]
    fn ids_follow_the_directory_walk_order() {
        let mut f = Flattener::new(0);
        f.apply_layer(0, "l0", &[file("z", 1), dir("b"), file("b/2", 2), file("a", 3), file("b/1", 4)])
            .unwrap();
        let flat = f.finish().unwrap();
        let NodeKind::Directory { entries } = &flat.tree.nodes[0].kind else { panic!() };
        let names: Vec<(&[u8], u32)> = entries.iter().map(|e| (e.name.as_slice(), e.node.0)).collect();
        assert_eq!(names, vec![(&b"a"[..], 1), (b"b", 2), (b"z", 3)]);
        let NodeKind::Directory { entries } = &flat.tree.nodes[2].kind else { panic!() };
        assert_eq!(entries.iter().map(|e| e.node.0).collect::<Vec<_>>(), vec![4, 5]);
    }

    #[test]
    fn hostile_paths_are_typed_errors() {
        let err = |layers: Vec<Vec<LayerEntry>>| {
            let mut f = Flattener::new(0);
            for (i, l) in layers.iter().enumerate() {
                f.apply_layer(i, "l", l)?;
            }
            Ok::<(), SourceError>(())
        };
        assert!(matches!(err(vec![vec![file("a/../../etc/passwd", 1)]]), Err(SourceError::DotDot { .. })));
        let link = entry("s", EntryKind::Symlink(b"/etc".to_vec()));
        assert!(matches!(
            err(vec![vec![link.clone(), file("s/passwd", 1)]]),
            Err(SourceError::UnderSymlink { .. })
        ));
        assert!(matches!(
            err(vec![vec![link.clone()], vec![file("s/x", 1)]]),
            Err(SourceError::UnderSymlink { .. })
        ));
        assert!(matches!(
            err(vec![vec![link.clone()], vec![entry("s/.wh.x", EntryKind::Fifo)]]),
            Err(SourceError::UnderSymlink { .. })
        ));
        assert!(matches!(
            err(vec![vec![entry("h", EntryKind::HardLink(b"missing".to_vec()))]]),
            Err(SourceError::HardLinkMissing { .. })
        ));
        assert!(matches!(
            err(vec![vec![entry("h", EntryKind::HardLink(b"../../etc/shadow".to_vec()))]]),
            Err(SourceError::DotDot { .. })
        ));
        assert!(matches!(
            err(vec![vec![dir("d"), entry("h", EntryKind::HardLink(b"d".to_vec()))]]),
            Err(SourceError::HardLinkToDirectory { .. })
        ));
        assert!(matches!(
            err(vec![vec![link, entry("h", EntryKind::HardLink(b"s/x".to_vec()))]]),
            Err(SourceError::UnderSymlink { .. })
        ));
        assert!(matches!(err(vec![vec![file("./", 1)]]), Err(SourceError::RootNotDirectory { .. })));
        assert!(matches!(
            err(vec![vec![file("f", 1), file("f/x", 2)]]),
            Err(SourceError::ParentNotDirectory { .. })
        ));
        let long = format!("d/{}", "n".repeat(256));
        assert!(matches!(err(vec![vec![file(&long, 1)]]), Err(SourceError::NameTooLong { .. })));
    }
}
