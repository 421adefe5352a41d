//! Validation of the input tree and canonical inode numbering.
//!
//! Inode numbers follow a breadth-first walk from the root with entries sorted by name bytes, so the
//! numbering (and everything derived from it) depends only on the tree, never on input order. Hard
//! links get the number of their first entry in that walk.

use std::collections::VecDeque;

use crate::error::Ext4Error;
use crate::tree::{DirEntry, NodeKind, Tree};

pub const ROOT_INO: u32 = 2;
pub const JOURNAL_INO: u32 = 8;
pub const LOST_FOUND_INO: u32 = 11;
/// ext4's `EXT4_LINK_MAX`.
pub const LINK_MAX: u64 = 65000;

/// What occupies an inode number from 11 on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// A node of the input tree (its index; the node count fits u32, `number` checks).
    Node(u32),
    /// The lost+found directory we create because the tree has none.
    CreatedLostFound,
}

/// No parent: the root, or a node not reached yet.
const NO_PARENT: (u32, u32) = (u32::MAX, u32::MAX);

/// The numbered namespace. Per node it keeps 20 bytes and per directory entry 4 (a million-entry
/// tree is numbered in ~24 MB): the names stay the tree's own.
#[derive(Debug, Clone)]
pub struct Namespace<'a> {
    tree: &'a Tree,
    /// Inode number per node index.
    pub ino: Vec<u32>,
    /// Slots for inodes 11.. in order: `slots[i]` is inode `11 + i`.
    pub slots: Vec<Slot>,
    /// Number of directory entries referencing each node (saturating).
    refs: Vec<u32>,
    /// Parent directory node and sorted entry index of each node's first reference, or
    /// [`NO_PARENT`] (for error paths and `..`).
    parent: Vec<(u32, u32)>,
    /// Node index of the tree's own lost+found, if it has one.
    pub tree_lost_found: Option<usize>,
    /// Each directory's entries in name order, as indices into its `entries`: directory `d`'s
    /// are `order[start[d]..start[d + 1]]` (other nodes have none).
    order: Vec<u32>,
    start: Vec<u32>,
}

impl<'a> Namespace<'a> {
    /// The highest inode number in use.
    pub fn last_ino(&self) -> u32 {
        LOST_FOUND_INO - 1 + self.slots.len() as u32
    }

    /// Directory `dir`'s entries sorted by name: (name, node index). Empty for other nodes.
    pub fn entries(&self, dir: usize) -> impl ExactSizeIterator<Item = (&'a [u8], usize)> + '_ {
        let tree: &'a Tree = self.tree;
        let list: &'a [DirEntry] = match &tree.nodes[dir].kind {
            NodeKind::Directory { entries } => entries,
            _ => &[],
        };
        let range = self.start[dir] as usize..self.start[dir + 1] as usize;
        self.order[range].iter().map(move |&i| {
            let e = &list[i as usize];
            (e.name.as_slice(), e.node.0 as usize)
        })
    }

    /// Entry `idx` (in name order) of directory `dir`.
    fn entry(&self, dir: usize, idx: usize) -> (&'a [u8], usize) {
        let tree: &'a Tree = self.tree;
        let NodeKind::Directory { entries } = &tree.nodes[dir].kind else {
            unreachable!("only directories have entries");
        };
        let e = &entries[self.order[self.start[dir] as usize + idx] as usize];
        (e.name.as_slice(), e.node.0 as usize)
    }

    /// The parent directory and sorted entry index of `node`'s first reference; `None` for the
    /// root.
    pub fn parent(&self, node: usize) -> Option<(usize, usize)> {
        let (p, i) = self.parent[node];
        ((p, i) != NO_PARENT).then_some((p as usize, i as usize))
    }

    /// How many directory entries reference `node`.
    pub fn refs(&self, node: usize) -> u64 {
        u64::from(self.refs[node])
    }

    /// Slash-separated path of a node, non-UTF-8 bytes escaped as `\xNN`.
    pub fn path(&self, node: usize) -> String {
        let mut parts: Vec<&[u8]> = Vec::new();
        let mut cur = node;
        while let Some((parent, entry)) = self.parent(cur) {
            parts.push(self.entry(parent, entry).0);
            cur = parent;
        }
        if parts.is_empty() {
            return "/".to_string();
        }
        let mut s = String::new();
        for p in parts.iter().rev() {
            s.push('/');
            s.push_str(&escape(p));
        }
        s
    }

    /// Path of a (possibly invalid) entry `name` inside directory `dir`.
    pub fn child_path(&self, dir: usize, name: &[u8]) -> String {
        let base = self.path(dir);
        let sep = if base == "/" { "" } else { "/" };
        format!("{base}{sep}{}", escape(name))
    }
}

/// Escape a raw name for messages: valid UTF-8 as is, other bytes as `\xNN`.
pub fn escape(name: &[u8]) -> String {
    let mut s = String::new();
    for chunk in name.utf8_chunks() {
        s.push_str(chunk.valid());
        for b in chunk.invalid() {
            s.push_str(&format!("\\x{b:02x}"));
        }
    }
    s
}

fn check_name(name: &[u8], path: impl Fn() -> String) -> Result<(), Ext4Error> {
    if name.len() > 255 {
        return Err(Ext4Error::NameTooLong { path: path(), len: name.len() });
    }
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0) {
        return Err(Ext4Error::InvalidName { path: path() });
    }
    Ok(())
}

/// Validate the tree's shape and names and assign inode numbers.
pub fn number(tree: &Tree) -> Result<Namespace<'_>, Ext4Error> {
    let n = tree.nodes.len();
    match tree.nodes.first() {
        Some(root) if matches!(root.kind, NodeKind::Directory { .. }) => {}
        _ => return Err(Ext4Error::RootNotDirectory),
    }
    let too_many = || Ext4Error::TooManyInodes { needed: n as u64, max: u32::MAX as u64 };
    if u32::try_from(n).is_err() {
        return Err(too_many());
    }
    // Reference counts first, so a directory linked twice cannot make the walk loop.
    let mut refs = vec![0u32; n];
    let mut order: Vec<u32> = Vec::new();
    let mut start: Vec<u32> = Vec::with_capacity(n + 1);
    for node in &tree.nodes {
        start.push(u32::try_from(order.len()).map_err(|_| too_many())?);
        if let NodeKind::Directory { entries } = &node.kind {
            for e in entries {
                let target = e.node.0 as usize;
                if target >= n {
                    return Err(Ext4Error::BadNode { node: e.node.0 });
                }
                refs[target] = refs[target].saturating_add(1);
            }
            let first = order.len();
            order.extend(0..u32::try_from(entries.len()).map_err(|_| too_many())?);
            // A walked directory comes sorted already; sort only what is not.
            if !entries.windows(2).all(|w| w[0].name <= w[1].name) {
                order[first..].sort_by(|&a, &b| {
                    let (a, b) = (&entries[a as usize], &entries[b as usize]);
                    a.name.cmp(&b.name).then(a.node.cmp(&b.node))
                });
            }
        }
    }
    start.push(u32::try_from(order.len()).map_err(|_| too_many())?);
    order.shrink_to_fit();
    for (i, node) in tree.nodes.iter().enumerate() {
        if matches!(node.kind, NodeKind::Directory { .. }) {
            let want = if i == 0 { 0 } else { 1 };
            if refs[i] != want {
                return Err(Ext4Error::BadDirectoryReferences { node: i as u32, refs: refs[i] as usize });
            }
        }
    }

    let mut ns = Namespace {
        tree,
        ino: vec![0; n],
        slots: Vec::with_capacity(n + 1),
        refs,
        parent: vec![NO_PARENT; n],
        tree_lost_found: None,
        order,
        start,
    };
    ns.ino[0] = ROOT_INO;
    // lost+found is inode 11 whether the tree brings one or we create it.
    let lost_found = ns.entries(0).position(|(name, _)| name == b"lost+found");
    if let Some(pos) = lost_found {
        let lf = ns.entry(0, pos).1;
        if !matches!(tree.nodes[lf].kind, NodeKind::Directory { .. }) {
            return Err(Ext4Error::LostFoundNotDirectory { path: "/lost+found".to_string() });
        }
        ns.tree_lost_found = Some(lf);
        ns.ino[lf] = LOST_FOUND_INO;
        ns.parent[lf] = (0, pos as u32);
        ns.slots.push(Slot::Node(lf as u32));
    } else {
        ns.slots.push(Slot::CreatedLostFound);
    }

    let mut queue = VecDeque::from([0usize]);
    while let Some(dir) = queue.pop_front() {
        let mut prev: Option<&[u8]> = None;
        for idx in 0..ns.start[dir + 1] as usize - ns.start[dir] as usize {
            let (name, t) = ns.entry(dir, idx);
            check_name(name, || ns.child_path(dir, name))?;
            if prev == Some(name) {
                return Err(Ext4Error::DuplicateName { path: ns.child_path(dir, name) });
            }
            prev = Some(name);
            if ns.ino[t] == 0 {
                ns.ino[t] = LOST_FOUND_INO + ns.slots.len() as u32;
                ns.slots.push(Slot::Node(t as u32));
                // idx < the entry count, which fits u32 (checked above).
                ns.parent[t] = (dir as u32, idx as u32);
            }
            if matches!(tree.nodes[t].kind, NodeKind::Directory { .. }) && Some(t) != ns.tree_lost_found {
                queue.push_back(t);
            }
        }
        if dir == 0 {
            if let Some(lf) = ns.tree_lost_found {
                // Walk lost+found's contents right after the root's, like any other top-level directory.
                queue.push_back(lf);
            }
        }
    }
    if let Some(unreachable) = ns.ino.iter().position(|&i| i == 0) {
        return Err(Ext4Error::BadNode { node: unreachable as u32 });
    }
    for (i, node) in tree.nodes.iter().enumerate() {
        if !matches!(node.kind, NodeKind::Directory { .. }) && ns.refs(i) > LINK_MAX {
            return Err(Ext4Error::TooManyLinks { path: ns.path(i), links: ns.refs(i) });
        }
    }
    let max_ino = LOST_FOUND_INO as u64 - 1 + ns.slots.len() as u64;
    if max_ino > u32::MAX as u64 {
        return Err(Ext4Error::TooManyInodes { needed: max_ino, max: u32::MAX as u64 });
    }
    Ok(ns)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::{DirEntry, Meta, Node, NodeId};

    fn meta() -> Meta {
        Meta {
            mode: 0o755,
            uid: 0,
            gid: 0,
            atime: Default::default(),
            mtime: Default::default(),
            ctime: Default::default(),
        }
    }
    fn dir(entries: Vec<(&[u8], u32)>) -> Node {
        Node {
            meta: meta(),
            kind: NodeKind::Directory {
                entries: entries
                    .into_iter()
                    .map(|(n, i)| DirEntry { name: n.into(), node: NodeId(i) })
                    .collect(),
            },
            xattrs: vec![],
        }
    }
    fn file() -> Node {
        Node {
            meta: meta(),
            kind: NodeKind::Regular { size: 0, data: smallvec::smallvec![] },
            xattrs: vec![],
        }
    }

    #[test]
    fn bfs_numbering_with_hard_links() {
        let tree = Tree {
            nodes: vec![dir(vec![(b"b", 1), (b"a", 2), (b"z", 3)]), dir(vec![(b"x", 3)]), file(), file()],
        };
        let ns = number(&tree).expect("valid");
        assert_eq!(ns.slots[0], Slot::CreatedLostFound);
        assert_eq!(ns.ino, vec![2, 13, 12, 14]);
        assert_eq!(ns.refs[3], 2);
        assert_eq!(ns.path(3), "/z");
        assert_eq!(ns.last_ino(), 14);
    }

    #[test]
    fn errors() {
        let bad = |t: Tree| number(&t).expect_err("invalid");
        assert!(matches!(bad(Tree { nodes: vec![file()] }), Ext4Error::RootNotDirectory));
        assert!(matches!(
            bad(Tree { nodes: vec![dir(vec![(b"a", 1), (b"a", 2)]), file(), file()] }),
            Ext4Error::DuplicateName { .. }
        ));
        assert!(matches!(
            bad(Tree { nodes: vec![dir(vec![(b"a/b", 1)]), file()] }),
            Ext4Error::InvalidName { .. }
        ));
        assert!(matches!(
            bad(Tree { nodes: vec![dir(vec![(b"..", 1)]), file()] }),
            Ext4Error::InvalidName { .. }
        ));
        let long = vec![b'x'; 256];
        assert!(matches!(
            bad(Tree { nodes: vec![dir(vec![(&long, 1)]), file()] }),
            Ext4Error::NameTooLong { len: 256, .. }
        ));
        assert!(matches!(bad(Tree { nodes: vec![dir(vec![(b"a", 5)])] }), Ext4Error::BadNode { node: 5 }));
        assert!(matches!(bad(Tree { nodes: vec![dir(vec![]), file()] }), Ext4Error::BadNode { node: 1 }));
        assert!(matches!(
            bad(Tree { nodes: vec![dir(vec![(b"a", 1), (b"b", 1)]), dir(vec![])] }),
            Ext4Error::BadDirectoryReferences { node: 1, refs: 2 }
        ));
        assert!(matches!(
            bad(Tree { nodes: vec![dir(vec![(b"lost+found", 1)]), file()] }),
            Ext4Error::LostFoundNotDirectory { .. }
        ));
        let e = bad(Tree { nodes: vec![dir(vec![(b"d\xff", 1)]), dir(vec![(b"", 2)]), file()] });
        match e {
            Ext4Error::InvalidName { path } => assert_eq!(path, "/d\\xff/"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn tree_lost_found_is_11() {
        let tree = Tree {
            nodes: vec![dir(vec![(b"a", 2), (b"lost+found", 1)]), dir(vec![(b"f", 3)]), file(), file()],
        };
        let ns = number(&tree).expect("valid");
        assert_eq!(ns.ino, vec![2, 11, 12, 13]);
    }
}
