//! The pack index: where each chunk of an image sits in the store's packs.
//! Byte layout: `docs/formats/pack-index.md`. Not part of the image ID.

use crate::codec::{Reader, Writer};
use crate::digest::{ChunkId, Sha256Digest};
use crate::error::{DecodeError, Error};

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

/// ChunkId → location, sorted by ChunkId.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PackIndex {
    packs: Vec<Sha256Digest>,
    entries: Vec<(ChunkId, PackLocation)>,
    /// Where each bucket of ids starts in `entries` ([`Buckets`]): a lookup searches one bucket
    /// instead of the whole index (an image opens with one lookup per chunk; by binary search
    /// they took ~4 ms of an 18 000-chunk image's start, mostly cache misses).
    buckets: Buckets,
}

/// A sorted id list's bucket starts: `starts[b]` is the index of the first id whose top `bits`
/// bits are at least `b`. Chunk ids are blake3 hashes, so with about one bucket per id a bucket
/// holds one or two.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Buckets {
    bits: u32,
    starts: Vec<u32>,
}

impl Buckets {
    /// Largest table: 2^20 buckets (4 MiB) for indexes of a million chunks or more.
    const MAX_BITS: u32 = 20;

    fn bucket(bits: u32, id: &ChunkId) -> usize {
        let top =
            u64::from_be_bytes([id.0[0], id.0[1], id.0[2], id.0[3], id.0[4], id.0[5], id.0[6], id.0[7]]);
        // `bits` ≤ 20: the shift is in range, and the result fits a usize.
        if bits == 0 {
            0
        } else {
            (top >> (64 - bits)) as usize
        }
    }

    fn of(entries: &[(ChunkId, PackLocation)]) -> Self {
        let bits = (entries.len().max(1).next_power_of_two().trailing_zeros()).min(Self::MAX_BITS);
        let n = 1usize << bits;
        let mut starts = Vec::with_capacity(n + 1);
        let mut at = 0usize;
        for b in 0..n {
            while at < entries.len() && Self::bucket(bits, &entries[at].0) < b {
                at += 1;
            }
            starts.push(u32::try_from(at).unwrap_or(u32::MAX));
        }
        starts.push(u32::try_from(entries.len()).unwrap_or(u32::MAX));
        Self { bits, starts }
    }

    /// The range of `entries` that may hold `id` (all of it without a table).
    fn range(&self, id: &ChunkId, len: usize) -> std::ops::Range<usize> {
        let b = Self::bucket(self.bits, id);
        match (self.starts.get(b), self.starts.get(b + 1)) {
            (Some(&lo), Some(&hi)) => (lo as usize).min(len)..(hi as usize).min(len),
            _ => 0..len,
        }
    }
}

impl PackIndex {
    /// Build from packs and entries (sorted here; duplicate chunk ids keep the first location).
    pub fn new(packs: Vec<Sha256Digest>, mut entries: Vec<(ChunkId, PackLocation)>) -> Self {
        entries.sort_by_key(|e| e.0);
        entries.dedup_by(|b, a| a.0 == b.0);
        let buckets = Buckets::of(&entries);
        Self { packs, entries, buckets }
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
        let range = self.buckets.range(id, self.entries.len());
        let lo = range.start;
        let i = lo + self.entries.get(range)?.binary_search_by(|e| e.0.cmp(id)).ok()?;
        let loc = self.entries.get(i)?.1;
        Some((*self.packs.get(loc.pack as usize)?, loc))
    }

    /// Total stored bytes of the indexed chunks.
    pub fn stored_bytes(&self) -> u64 {
        self.entries.iter().map(|e| u64::from(e.1.stored_len)).sum()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut e = PackIndexEncoder::new(&self.packs, self.entries.len());
        for &(id, loc) in &self.entries {
            // `new` sorted and deduplicated the entries; a location naming a pack out of range
            // is encoded as given (the decoder rejects it).
            e.put(id, loc);
        }
        e.w.buf
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
        let buckets = Buckets::of(&entries);
        Ok(Self { packs, entries, buckets })
    }
}

/// A pack index encoded a piece at a time, for an index too large to be held twice (a
/// million-chunk image's is ~50 MB): the caller hands over the bytes made so far with
/// [`Self::take`] whenever it likes. The same bytes as [`PackIndex::encode`] of the same entries.
#[derive(Debug)]
pub struct PackIndexEncoder {
    w: Writer,
    packs: usize,
    /// Entries announced and not yet given.
    left: usize,
    last: Option<ChunkId>,
}

impl PackIndexEncoder {
    /// Start an index of `packs` holding exactly `entries` entries.
    pub fn new(packs: &[Sha256Digest], entries: usize) -> Self {
        let mut w = Writer::default();
        w.bytes(MAGIC);
        w.u32(VERSION);
        w.len(packs.len());
        for p in packs {
            w.bytes(&p.0);
        }
        w.len(entries);
        Self { w, packs: packs.len(), left: entries, last: None }
    }

    fn put(&mut self, id: ChunkId, loc: PackLocation) {
        self.left = self.left.saturating_sub(1);
        self.last = Some(id);
        self.w.bytes(&id.0);
        self.w.u32(loc.pack);
        self.w.u64(loc.offset);
        self.w.u32(loc.stored_len);
        self.w.u32(loc.raw_len);
        self.w.u8(match loc.compression {
            Compression::None => 0,
            Compression::Zstd => 1,
        });
    }

    /// Append one entry: ids strictly ascending, packs in range, no more than announced.
    pub fn entry(&mut self, id: ChunkId, loc: PackLocation) -> Result<(), Error> {
        let reason = if self.left == 0 {
            "more entries than announced"
        } else if self.last.is_some_and(|last| last >= id) {
            "chunk ids not strictly ascending"
        } else if loc.pack as usize >= self.packs {
            "pack number out of range"
        } else {
            self.put(id, loc);
            return Ok(());
        };
        Err(Error::PackIndexEntries { reason })
    }

    /// How many bytes [`Self::take`] would hand over.
    pub fn buffered(&self) -> usize {
        self.w.buf.len()
    }

    /// The bytes encoded since the last call.
    pub fn take(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.w.buf)
    }

    /// The last bytes, once every announced entry was given.
    pub fn finish(self) -> Result<Vec<u8>, Error> {
        if self.left != 0 {
            return Err(Error::PackIndexEntries { reason: "fewer entries than announced" });
        }
        Ok(self.w.buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A location in pack 0.
    fn at(offset: u64, stored_len: u32, raw_len: u32, compression: Compression) -> PackLocation {
        PackLocation { pack: 0, offset, stored_len, raw_len, compression }
    }

    #[test]
    fn roundtrip_and_lookup() {
        let p = Sha256Digest::of(b"pack");
        let a = ChunkId::of(b"a");
        let b = ChunkId::of(b"b");
        let loc = |offset| at(offset, 3, 9, Compression::Zstd);
        let idx = PackIndex::new(vec![p], vec![(b, loc(3)), (a, loc(0)), (a, loc(6))]);
        assert_eq!(idx.entries().len(), 2);
        let bytes = idx.encode();
        let back = PackIndex::decode(&bytes).unwrap();
        assert_eq!(back, idx);
        assert_eq!(back.get(&b), Some((p, loc(3))));
        assert_eq!(back.get(&ChunkId::of(b"c")), None);
        assert!(PackIndex::decode(&bytes[..bytes.len() - 1]).is_err());
    }

    #[test]
    fn every_id_is_found_through_its_bucket_and_no_other_is() {
        let p = Sha256Digest::of(b"pack");
        let loc = |offset| at(offset, 1, 1, Compression::None);
        // Ids at the edges of the id space and of buckets, beside hashed ones.
        let edge = |b: u8| ChunkId([b; 32]);
        for n in [0usize, 1, 2, 3, 7, 1000, 5000] {
            let mut entries: Vec<(ChunkId, PackLocation)> =
                (0..n).map(|i| (ChunkId::of(&(i as u64).to_le_bytes()), loc(i as u64))).collect();
            if n >= 3 {
                entries.extend([
                    (edge(0), loc(1 << 40)),
                    (edge(0xff), loc(2 << 40)),
                    (edge(0x80), loc(3 << 40)),
                ]);
            }
            let idx = PackIndex::new(vec![p], entries.clone());
            let back = PackIndex::decode(&idx.encode()).unwrap();
            assert_eq!(back, idx);
            for (id, l) in &entries {
                assert_eq!(idx.get(id), Some((p, *l)), "n {n}");
                assert_eq!(back.get(id), Some((p, *l)), "n {n}");
            }
            for i in n..n + 200 {
                assert_eq!(idx.get(&ChunkId::of(&(i as u64).to_le_bytes())), None);
            }
            if n < 3 {
                for b in [0, 0x7f, 0x80, 0xff] {
                    assert_eq!(idx.get(&edge(b)), None);
                }
            }
        }
        // An index without a table (the default) finds nothing and does not fail.
        assert_eq!(PackIndex::default().get(&edge(0)), None);
    }

    #[test]
    fn piecewise_encoding_is_the_whole_encoding_and_refuses_what_the_format_cannot_hold() {
        let packs = [Sha256Digest::of(b"p0"), Sha256Digest::of(b"p1")];
        let mut entries: Vec<(ChunkId, PackLocation)> = (0..1000u32)
            .map(|i| {
                let loc = PackLocation {
                    pack: i % 2,
                    offset: u64::from(i) * 7,
                    stored_len: i,
                    raw_len: i + 1,
                    compression: Compression::Zstd,
                };
                (ChunkId::of(&i.to_le_bytes()), loc)
            })
            .collect();
        entries.sort_by_key(|e| e.0);
        let whole = PackIndex::new(packs.to_vec(), entries.clone()).encode();
        let mut e = PackIndexEncoder::new(&packs, entries.len());
        let mut pieces = Vec::new();
        for (i, &(id, loc)) in entries.iter().enumerate() {
            e.entry(id, loc).unwrap();
            if i % 97 == 0 {
                pieces.extend(e.take());
            }
        }
        pieces.extend(e.finish().unwrap());
        assert_eq!(pieces, whole);

        let (a, b) = (entries[0], entries[1]);
        let mut e = PackIndexEncoder::new(&packs, 2);
        e.entry(b.0, b.1).unwrap();
        assert!(e.entry(a.0, a.1).is_err(), "descending ids");
        assert!(e.entry(b.0, b.1).is_err(), "a repeated id");
        assert!(e.finish().is_err(), "one entry of two");
        let mut e = PackIndexEncoder::new(&packs, 1);
        assert!(e.entry(a.0, PackLocation { pack: 2, ..a.1 }).is_err(), "pack out of range");
        e.entry(a.0, a.1).unwrap();
        assert!(e.entry(b.0, b.1).is_err(), "more than announced");
        assert_eq!(PackIndex::decode(&e.finish().unwrap()).unwrap().entries(), &[a]);
    }
}
