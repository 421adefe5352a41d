//! The pack index: where each chunk of an image sits in the store's packs.
//! Byte layout: `docs/formats/pack-index.md`. Not part of the image ID.

use crate::codec::{Reader, Writer};
use crate::digest::{ChunkId, Sha256Digest};
use crate::error::DecodeError;

const MAGIC: &[u8; 8] = b"TESSPIX\0";
const VERSION: u32 = 1;

/// How a chunk is stored inside its pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Compression {
    /// Stored as is.
    None,
    /// One zstd frame.
    Zstd,
}

/// Where one chunk lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PackLocation {
    /// Index into [`PackIndex::packs`].
    pub pack: u32,
    /// Byte offset of the stored chunk inside the pack.
    pub offset: u64,
    /// Stored (possibly compressed) length.
    pub stored_len: u32,
    /// Uncompressed length.
    pub raw_len: u32,
    pub compression: Compression,
}

/// ChunkId → location, sorted by ChunkId for binary search.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PackIndex {
    packs: Vec<Sha256Digest>,
    entries: Vec<(ChunkId, PackLocation)>,
}

impl PackIndex {
    /// Build from packs and entries (sorted here; duplicate chunk ids keep the first location).
    pub fn new(packs: Vec<Sha256Digest>, mut entries: Vec<(ChunkId, PackLocation)>) -> Self {
        entries.sort_by_key(|e| e.0);
        entries.dedup_by(|b, a| a.0 == b.0);
        Self { packs, entries }
    }

    /// The packs, in index order.
    pub fn packs(&self) -> &[Sha256Digest] {
        &self.packs
    }

    /// All entries, sorted by chunk id.
    pub fn entries(&self) -> &[(ChunkId, PackLocation)] {
        &self.entries
    }

    /// Look a chunk up.
    pub fn get(&self, id: &ChunkId) -> Option<(Sha256Digest, PackLocation)> {
        let i = self.entries.binary_search_by(|e| e.0.cmp(id)).ok()?;
        let loc = self.entries[i].1;
        Some((*self.packs.get(loc.pack as usize)?, loc))
    }

    /// Total stored bytes of the indexed chunks.
    pub fn stored_bytes(&self) -> u64 {
        self.entries.iter().map(|e| u64::from(e.1.stored_len)).sum()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.bytes(MAGIC);
        w.u32(VERSION);
        w.len(self.packs.len());
        for p in &self.packs {
            w.bytes(&p.0);
        }
        w.len(self.entries.len());
        for (id, loc) in &self.entries {
            w.bytes(&id.0);
            w.u32(loc.pack);
            w.u64(loc.offset);
            w.u32(loc.stored_len);
            w.u32(loc.raw_len);
            w.u8(match loc.compression {
                Compression::None => 0,
                Compression::Zstd => 1,
            });
        }
        w.buf
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(bytes, "pack index");
        r.header(MAGIC, VERSION)?;
        let n = r.count(32)?;
        let packs = (0..n).map(|_| r.array().map(Sha256Digest)).collect::<Result<Vec<_>, _>>()?;
        let n = r.count(53)?;
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let id = ChunkId(r.array()?);
            let pack = r.u32()?;
            let offset = r.u64()?;
            let stored_len = r.u32()?;
            let raw_len = r.u32()?;
            let compression = match r.u8()? {
                0 => Compression::None,
                1 => Compression::Zstd,
                _ => return Err(r.not_canonical("compression", "unknown compression")),
            };
            if pack as usize >= packs.len() {
                return Err(r.not_canonical("pack", "pack number out of range"));
            }
            if compression == Compression::None && stored_len != raw_len {
                return Err(r.not_canonical("stored_len", "uncompressed chunk with stored_len != raw_len"));
            }
            if let Some((prev, _)) = entries.last() {
                if *prev >= id {
                    return Err(r.not_canonical("entries", "chunk ids not strictly ascending"));
                }
            }
            entries.push((id, PackLocation { pack, offset, stored_len, raw_len, compression }));
        }
        r.finish()?;
        Ok(Self { packs, entries })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_lookup() {
        let p = Sha256Digest::of(b"pack");
        let a = ChunkId::of(b"a");
        let b = ChunkId::of(b"b");
        let loc = |offset| PackLocation {
            pack: 0,
            offset,
            stored_len: 3,
            raw_len: 9,
            compression: Compression::Zstd,
        };
        let idx = PackIndex::new(vec![p], vec![(b, loc(3)), (a, loc(0)), (a, loc(6))]);
        assert_eq!(idx.entries().len(), 2);
        let bytes = idx.encode();
        let back = PackIndex::decode(&bytes).unwrap();
        assert_eq!(back, idx);
        assert_eq!(back.get(&b), Some((p, loc(3))));
        assert_eq!(back.get(&ChunkId::of(b"c")), None);
        assert!(PackIndex::decode(&bytes[..bytes.len() - 1]).is_err());
    }
}
