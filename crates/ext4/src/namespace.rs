//! Validation of the input tree and canonical inode numbering.
//!
//! Inode numbers follow a breadth-first walk from the root with entries sorted by name bytes, so the
//! numbering (and everything derived from it) depends only on the tree, never on input order. Hard
//! links get the number of their first entry in that walk.

use std::collections::VecDeque;

use crate::error::Ext4Error;
use crate::tree::{NodeKind, Tree};

pub const ROOT_INO: u32 = 2;
pub const JOURNAL_INO: u32 = 8;
pub const LOST_FOUND_INO: u32 = 11;
/// ext4's `EXT4_LINK_MAX`.
pub const LINK_MAX: u64 = 65000;

/// What occupies an inode number from 11 on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// A node of the input tree.
    Node(usize),
    /// The lost+found directory we create because the tree has none.
    CreatedLostFound,
}

/// The numbered namespace.
#[derive(Debug, Clone)]
pub struct Namespace<'a> {
    /// Inode number per node index.
    pub ino: Vec<u32>,
    /// Slots for inodes 11.. in order: `slots[i]` is inode `11 + i`.
    pub slots: Vec<Slot>,
    /// Number of directory entries referencing each node.
    pub refs: Vec<u64>,
    /// Parent directory node and entry name of each node's first reference (for error paths and `..`).
    pub parent: Vec<Option<(usize, usize)>>,
    /// Node index of the tree's own lost+found, if it has one.
    pub tree_lost_found: Option<usize>,
    /// Each directory's entries sorted by name: (name, node index). The names are the tree's own,
    /// borrowed: a copy of every name would cost ~60 bytes an entry.
    pub sorted_entries: Vec<Vec<(&'a [u8], usize)>>,
}

impl Namespace<'_> {
    /// The highest inode number in use.
    pub fn last_ino(&self) -> u32 {
        LOST_FOUND_INO - 1 + self.slots.len() as u32
    }

    /// Slash-separated path of a node, non-UTF-8 bytes escaped as `\xNN`.
    pub fn path(&self, node: usize) -> String {
        let mut parts: Vec<&[u8]> = Vec::new();
        let mut cur = node;
        while let Some((parent, entry)) = self.parent[cur] {
            parts.push(self.sorted_entries[parent][entry].0);
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
    // Reference counts first, so a directory linked twice cannot make the walk loop.
    let mut refs = vec![0u64; n];
    let mut sorted_entries: Vec<Vec<(&[u8], usize)>> = vec![Vec::new(); n];
    for (i, node) in tree.nodes.iter().enumerate() {
        if let NodeKind::Directory { entries } = &node.kind {
            let mut list = Vec::with_capacity(entries.len());
            for e in entries {
                let target = e.node.0 as usize;
                if target >= n {
                    return Err(Ext4Error::BadNode { node: e.node.0 });
                }
                refs[target] += 1;
                list.push((e.name.as_slice(), target));
            }
            list.sort();
            sorted_entries[i] = list;
        }
    }
    for (i, node) in tree.nodes.iter().enumerate() {
        if matches!(node.kind, NodeKind::Directory { .. }) {
            let want = if i == 0 { 0 } else { 1 };
            if refs[i] != want {
                return Err(Ext4Error::BadDirectoryReferences { node: i as u32, refs: refs[i] as usize });
            }
        }
    }

    let mut ns = Namespace {
        ino: vec![0; n],
        slots: Vec::new(),
        refs,
        parent: vec![None; n],
        tree_lost_found: None,
        sorted_entries,
    };
    ns.ino[0] = ROOT_INO;
    // lost+found is inode 11 whether the tree brings one or we create it.
    if let Some(pos) = ns.sorted_entries[0].iter().position(|(name, _)| *name == b"lost+found") {
        let lf = ns.sorted_entries[0][pos].1;
        if !matches!(tree.nodes[lf].kind, NodeKind::Directory { .. }) {
            return Err(Ext4Error::LostFoundNotDirectory { path: "/lost+found".to_string() });
        }
        ns.tree_lost_found = Some(lf);
        ns.ino[lf] = LOST_FOUND_INO;
        ns.parent[lf] = Some((0, pos));
        ns.slots.push(Slot::Node(lf));
    } else {
        ns.slots.push(Slot::CreatedLostFound);
    }

    let mut queue = VecDeque::from([0usize]);
    while let Some(dir) = queue.pop_front() {
        let entries = &ns.sorted_entries[dir];
        for (idx, (name, target)) in entries.iter().enumerate() {
            check_name(name, || ns.child_path(dir, name))?;
            if idx > 0 && entries[idx - 1].0 == *name {
                return Err(Ext4Error::DuplicateName { path: ns.child_path(dir, name) });
            }
            let t = *target;
            if ns.ino[t] == 0 {
                ns.ino[t] = LOST_FOUND_INO + ns.slots.len() as u32;
                ns.slots.push(Slot::Node(t));
                ns.parent[t] = Some((dir, idx));
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
        if !matches!(node.kind, NodeKind::Directory { .. }) && ns.refs[i] > LINK_MAX {
            return Err(Ext4Error::TooManyLinks { path: ns.path(i), links: ns.refs[i] });
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
                    .map(|(n, i)| DirEntry { name: n.to_vec(), node: NodeId(i) })
                    .collect(),
            },
            xattrs: vec![],
        }
    }
    fn file() -> Node {
        Node { meta: meta(), kind: NodeKind::Regular { size: 0, data: vec![] }, xattrs: vec![] }
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
