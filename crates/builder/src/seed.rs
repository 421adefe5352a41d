//! A digest of everything the tree decides (metadata and chunk ids), used to seed the ext4 UUID and
//! directory hash seed, so that different content gets a different UUID and identical input the same.

use sha2::{Digest, Sha256};
use tessera_ext4::{NodeKind, Timestamp, Tree};
use tessera_image::ChunkId;

/// Chunks of one regular file: (byte offset in the file, id, length). Most files are one chunk,
/// kept inline: 56 bytes a node instead of a 24-byte `Vec` and a 64-byte allocation per file.
pub type FileChunks = tessera_ext4::smallvec::SmallVec<[(u64, ChunkId, u32); 1]>;

fn ts(h: &mut Sha256, t: &Timestamp) {
    h.update(t.sec.to_le_bytes());
    h.update(t.nsec.to_le_bytes());
}

fn bytes(h: &mut Sha256, b: &[u8]) {
    h.update((b.len() as u64).to_le_bytes());
    h.update(b);
}

/// Digest of the tree and its content.
pub fn tree_seed(tree: &Tree, chunks: &[FileChunks]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"tessera-tree-seed-v1\0");
    h.update((tree.nodes.len() as u64).to_le_bytes());
    for (i, node) in tree.nodes.iter().enumerate() {
        let m = &node.meta;
        h.update(m.mode.to_le_bytes());
        h.update(m.uid.to_le_bytes());
        h.update(m.gid.to_le_bytes());
        ts(&mut h, &m.atime);
        ts(&mut h, &m.mtime);
        ts(&mut h, &m.ctime);
        h.update((node.xattrs.len() as u64).to_le_bytes());
        for x in &node.xattrs {
            bytes(&mut h, &x.name);
            bytes(&mut h, &x.value);
        }
        match &node.kind {
            NodeKind::Directory { entries } => {
                h.update([1]);
                h.update((entries.len() as u64).to_le_bytes());
                for e in entries {
                    bytes(&mut h, &e.name);
                    h.update(e.node.0.to_le_bytes());
                }
            }
            NodeKind::Regular { size, data } => {
                h.update([2]);
                h.update(size.to_le_bytes());
                h.update((data.len() as u64).to_le_bytes());
                for r in data {
                    h.update(r.start_block.to_le_bytes());
                    h.update(r.blocks.to_le_bytes());
                }
                let list = chunks.get(i).map(|l| l.as_slice()).unwrap_or(&[]);
                h.update((list.len() as u64).to_le_bytes());
                for (off, id, len) in list {
                    h.update(off.to_le_bytes());
                    h.update(id.0);
                    h.update(len.to_le_bytes());
                }
            }
            NodeKind::Symlink { target } => {
                h.update([3]);
                bytes(&mut h, target);
            }
            NodeKind::CharDevice { major, minor } => {
                h.update([4]);
                h.update(major.to_le_bytes());
                h.update(minor.to_le_bytes());
            }
            NodeKind::BlockDevice { major, minor } => {
                h.update([5]);
                h.update(major.to_le_bytes());
                h.update(minor.to_le_bytes());
            }
            NodeKind::Fifo => h.update([6]),
            NodeKind::Socket => h.update([7]),
        }
    }
    h.finalize().into()
}
