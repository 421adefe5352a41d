//! The pack index: where each chunk of an image sits in the store's packs.
//! Byte layout: `docs/formats/pack-index.md`. Not part of the image ID.
//!
//! Two versions: 1 keyed by chunk id ([`PackIndex`], still read), 2 aligned with its owner's
//! chunk list ([`AlignedIndex`], what builds write: [`PackIndexEncoder`]). [`PackIndexBlob`]
//! decodes either and [`PackIndexBlob::locate`] matches it with the list.

use sha2::{Digest, Sha256};

use crate::blockmap::ChunkRef;
use crate::codec::{Reader, Writer};
use crate::digest::{ChunkId, Sha256Digest};
use crate::error::{DecodeError, Error};

const MAGIC: &[u8; 8] = b"TESSPIX\0";
const VERSION: u32 = 1;
const VERSION_ALIGNED: u32 = 2;

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

/// ChunkId → location, sorted by ChunkId: a version-1 index as decoded, or any index keyed for
/// lookups by id ([`PackIndexBlob::keyed`]).
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

    /// The version-1 encoding (read for stores written before version 2; builds write version
    /// 2 with [`PackIndexEncoder`]).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = header(VERSION, &self.packs, self.entries.len());
        // `new` sorted and deduplicated the entries; a location naming a pack out of range is
        // encoded as given (the decoder rejects it).
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

    /// Decode a version-1 index ([`PackIndexBlob::decode`] reads either version).
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

/// The version-2 encoder: a pack index aligned with a chunk list (`docs/formats/pack-index.md`),
/// encoded a piece at a time for an index too large to be held twice; the caller hands over the
/// bytes made so far with [`Self::take`] whenever it likes. Builds write this version: it names
/// no chunk id (the list's owner, an image record or a layer manifest, holds them), so it is about
/// a fifteenth of version 1's size, and an image's start fetches that much less.
#[derive(Debug)]
pub struct PackIndexEncoder {
    w: Writer,
    packs: usize,
    /// Entries announced and not yet given.
    left: usize,
    /// Where the previous entry ended: its pack and the offset after its bytes.
    end: (u32, u64),
    list: ChunkListHasher,
}

impl PackIndexEncoder {
    /// Start an index of `packs` holding exactly `entries` entries.
    pub fn new(packs: &[Sha256Digest], entries: usize) -> Self {
        let w = header(VERSION_ALIGNED, packs, entries);
        Self { w, packs: packs.len(), left: entries, end: (0, 0), list: ChunkListHasher::default() }
    }

    /// Append the location of the next chunk of the list, `chunk`: no more than announced, its
    /// pack in range, its lengths consistent (`raw_len` the chunk's; a chunk stored as is is as
    /// long as it is stored), its bytes inside 64 bits.
    pub fn entry(&mut self, chunk: ChunkRef, loc: PackLocation) -> Result<(), Error> {
        let end = loc.offset.checked_add(u64::from(loc.stored_len));
        let reason = if self.left == 0 {
            "more entries than announced"
        } else if loc.pack as usize >= self.packs {
            "pack number out of range"
        } else if loc.raw_len != chunk.len {
            "raw_len differs from the chunk's length"
        } else if loc.compression == Compression::None && loc.stored_len != loc.raw_len {
            "uncompressed chunk with stored_len != raw_len"
        } else if end.is_some() {
            self.left -= 1;
            let place = Place {
                pack: loc.pack,
                offset: loc.offset,
                stored_len: loc.stored_len,
                zstd: loc.compression == Compression::Zstd,
            };
            place.put(&mut self.w, &mut self.end);
            self.list.push(&chunk);
            return Ok(());
        } else {
            "chunk ends past 2^64"
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

    /// The last bytes (the chunk list's digest), once every announced entry was given.
    pub fn finish(mut self) -> Result<Vec<u8>, Error> {
        if self.left != 0 {
            return Err(Error::PackIndexEntries { reason: "fewer entries than announced" });
        }
        self.w.bytes(&self.list.finish().0);
        Ok(self.w.buf)
    }
}

/// sha256 of a chunk list as version-2 pack indexes record it: each chunk's id and its length
/// (u32 little-endian), in order.
#[derive(Debug, Default, Clone)]
pub struct ChunkListHasher(Sha256);

impl ChunkListHasher {
    pub fn push(&mut self, chunk: &ChunkRef) {
        self.0.update(chunk.id.0);
        self.0.update(chunk.len.to_le_bytes());
    }

    pub fn finish(self) -> Sha256Digest {
        Sha256Digest(self.0.finalize().into())
    }

    /// The digest of `chunks`.
    pub fn of<'a>(chunks: impl IntoIterator<Item = &'a ChunkRef>) -> Sha256Digest {
        let mut h = Self::default();
        for c in chunks {
            h.push(c);
        }
        h.finish()
    }
}

/// The magic, `version`, the pack table and the entry count every pack index starts with.
fn header(version: u32, packs: &[Sha256Digest], entries: usize) -> Writer {
    let mut w = Writer::default();
    w.bytes(MAGIC);
    w.u32(version);
    w.len(packs.len());
    for p in packs {
        w.bytes(&p.0);
    }
    w.len(entries);
    w
}

/// Where a chunk of a version-2 index's list is stored (its raw length is the list's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Place {
    pack: u32,
    offset: u64,
    stored_len: u32,
    zstd: bool,
}

impl Place {
    /// Write this entry after one that ended at `end` (pack, offset after its bytes), and make
    /// `end` this one's end (the caller checked that it fits 64 bits).
    fn put(&self, w: &mut Writer, end: &mut (u32, u64)) {
        if (self.pack, self.offset) == *end {
            w.varint(0);
        } else {
            w.varint(u64::from(self.pack) + 1);
            w.varint(self.offset);
        }
        w.varint(u64::from(self.stored_len) << 1 | u64::from(self.zstd));
        *end = (self.pack, self.offset.saturating_add(u64::from(self.stored_len)));
    }
}

/// A decoded version-2 pack index: one location per chunk of the list it was made for, in the
/// list's order, and that list's digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AlignedIndex {
    packs: Vec<Sha256Digest>,
    places: Vec<Place>,
    chunks: Sha256Digest,
}

impl AlignedIndex {
    fn decode_body(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let n = r.count(32)?;
        let packs = (0..n).map(|_| r.array().map(Sha256Digest)).collect::<Result<Vec<_>, _>>()?;
        // Each entry is at least two bytes (a place and a length), and the digest follows.
        let n = r.count(2)?;
        let mut places = Vec::with_capacity(n);
        let mut end = (0u32, 0u64);
        for _ in 0..n {
            let place = match r.varint("place")? {
                0 => Place { pack: end.0, offset: end.1, stored_len: 0, zstd: false },
                p => {
                    let pack = u32::try_from(p - 1)
                        .ok()
                        .filter(|&p| (p as usize) < packs.len())
                        .ok_or_else(|| r.not_canonical("place", "pack number out of range"))?;
                    let offset = r.varint("offset")?;
                    if (pack, offset) == end {
                        return Err(r.not_canonical("place", "a continuing entry not encoded as 0"));
                    }
                    Place { pack, offset, stored_len: 0, zstd: false }
                }
            };
            if packs.is_empty() {
                return Err(r.not_canonical("place", "pack number out of range"));
            }
            let len = r.varint("length")?;
            let stored_len =
                u32::try_from(len >> 1).map_err(|_| r.not_canonical("length", "stored_len over 32 bits"))?;
            let place = Place { stored_len, zstd: len & 1 == 1, ..place };
            let after = place
                .offset
                .checked_add(u64::from(stored_len))
                .ok_or_else(|| r.not_canonical("offset", "chunk ends past 2^64"))?;
            end = (place.pack, after);
            places.push(place);
        }
        let chunks = Sha256Digest(r.array()?);
        Ok(Self { packs, places, chunks })
    }

    fn encode(&self) -> Vec<u8> {
        let mut w = header(VERSION_ALIGNED, &self.packs, self.places.len());
        let mut end = (0u32, 0u64);
        for p in &self.places {
            p.put(&mut w, &mut end);
        }
        w.bytes(&self.chunks.0);
        w.buf
    }
}

/// A pack index blob, decoded and not yet matched with the chunks it locates: version 1 (keyed
/// by chunk id, still read) or version 2 (aligned with its owner's chunk list, what builds write).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PackIndexBlob {
    Keyed(PackIndex),
    Aligned(AlignedIndex),
}

impl PackIndexBlob {
    /// Decode either version, strictly.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        match bytes.get(8..12).map(|v| u32::from_le_bytes([v[0], v[1], v[2], v[3]])) {
            Some(VERSION_ALIGNED) if bytes.starts_with(MAGIC) => {
                let mut r = Reader::new(bytes, "pack index");
                r.header(MAGIC, VERSION_ALIGNED)?;
                let index = AlignedIndex::decode_body(&mut r)?;
                r.finish()?;
                Ok(Self::Aligned(index))
            }
            _ => PackIndex::decode(bytes).map(Self::Keyed),
        }
    }

    /// The canonical encoding (the decoded bytes, for what [`Self::decode`] accepted).
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Self::Keyed(k) => k.encode(),
            Self::Aligned(a) => a.encode(),
        }
    }

    /// The packs, in index order.
    pub fn packs(&self) -> &[Sha256Digest] {
        match self {
            Self::Keyed(k) => k.packs(),
            Self::Aligned(a) => &a.packs,
        }
    }

    /// How many chunks it locates.
    pub fn len(&self) -> usize {
        match self {
            Self::Keyed(k) => k.entries().len(),
            Self::Aligned(a) => a.places.len(),
        }
    }

    /// Whether it locates no chunk.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Total stored bytes of the indexed chunks.
    pub fn stored_bytes(&self) -> u64 {
        match self {
            Self::Keyed(k) => k.stored_bytes(),
            Self::Aligned(a) => a.places.iter().map(|p| u64::from(p.stored_len)).sum(),
        }
    }

    /// Where each chunk of `chunks` is stored, in its order: the chunk list of the image record
    /// (or layer manifest, each chunk once, in order of first use) the index was written for.
    /// A version-1 index is searched by id; a version-2 one must have been made for exactly this
    /// list (its digest says so). Either way every length must agree.
    pub fn locate(&self, chunks: &[ChunkRef]) -> Result<Vec<(Sha256Digest, PackLocation)>, IndexMismatch> {
        let mut out = Vec::with_capacity(chunks.len());
        match self {
            Self::Keyed(k) => {
                for (index, c) in chunks.iter().enumerate() {
                    let (pack, loc) = k.get(&c.id).ok_or(IndexMismatch::Missing { index, id: c.id })?;
                    if loc.raw_len != c.len {
                        return Err(IndexMismatch::Length {
                            index,
                            id: c.id,
                            len: c.len,
                            indexed: loc.raw_len,
                        });
                    }
                    out.push((pack, loc));
                }
            }
            Self::Aligned(a) => {
                if a.places.len() != chunks.len() || ChunkListHasher::of(chunks) != a.chunks {
                    return Err(IndexMismatch::OtherList { indexed: a.places.len(), chunks: chunks.len() });
                }
                for (index, (c, p)) in chunks.iter().zip(&a.places).enumerate() {
                    if !p.zstd && p.stored_len != c.len {
                        return Err(IndexMismatch::Length {
                            index,
                            id: c.id,
                            len: c.len,
                            indexed: p.stored_len,
                        });
                    }
                    // `decode` checked the pack number.
                    let pack =
                        *a.packs.get(p.pack as usize).ok_or(IndexMismatch::Missing { index, id: c.id })?;
                    let compression = if p.zstd { Compression::Zstd } else { Compression::None };
                    let loc = PackLocation {
                        pack: p.pack,
                        offset: p.offset,
                        stored_len: p.stored_len,
                        raw_len: c.len,
                        compression,
                    };
                    out.push((pack, loc));
                }
            }
        }
        Ok(out)
    }
}

impl PackIndexBlob {
    /// The index keyed by chunk id, for lookups by id: [`Self::locate`] of `chunks`.
    pub fn keyed(&self, chunks: &[ChunkRef]) -> Result<PackIndex, IndexMismatch> {
        let located = self.locate(chunks)?;
        let entries = chunks.iter().zip(located).map(|(c, (_, loc))| (c.id, loc)).collect();
        Ok(PackIndex::new(self.packs().to_vec(), entries))
    }
}

/// A pack index that does not locate the chunks it was asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexMismatch {
    #[error("chunk #{index} {id} is not in the pack index")]
    Missing { index: usize, id: ChunkId },
    #[error("chunk #{index} {id} is {len} bytes, the pack index says {indexed}")]
    Length { index: usize, id: ChunkId, len: u32, indexed: u32 },
    #[error("the pack index was made for another chunk list ({indexed} chunks; this one has {chunks})")]
    OtherList { indexed: usize, chunks: usize },
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

    /// `n` chunks of a list, located in two packs: runs back to back, a jump, a return to an
    /// earlier pack, raw and zstd chunks.
    fn aligned(n: u32) -> (Vec<Sha256Digest>, Vec<ChunkRef>, Vec<PackLocation>) {
        let packs = vec![Sha256Digest::of(b"p0"), Sha256Digest::of(b"p1")];
        let mut chunks = Vec::new();
        let mut locs = Vec::new();
        let mut end = [0u64; 2];
        for i in 0..n {
            let pack = u32::from(i % 7 >= 5);
            let raw_len = 4096 + i;
            let compression = if i % 3 == 0 { Compression::None } else { Compression::Zstd };
            let stored_len = if compression == Compression::None { raw_len } else { 100 + i };
            let gap = if i % 11 == 4 { 1 << 33 } else { 0 };
            let offset = end[pack as usize] + gap;
            end[pack as usize] = offset + u64::from(stored_len);
            chunks.push(ChunkRef { id: ChunkId::of(&i.to_le_bytes()), len: raw_len });
            locs.push(PackLocation { pack, offset, stored_len, raw_len, compression });
        }
        (packs, chunks, locs)
    }

    fn encode_aligned(
        packs: &[Sha256Digest],
        chunks: &[ChunkRef],
        locs: &[PackLocation],
        every: usize,
    ) -> Vec<u8> {
        let mut e = PackIndexEncoder::new(packs, chunks.len());
        let mut out = Vec::new();
        for (i, (c, l)) in chunks.iter().zip(locs).enumerate() {
            e.entry(*c, *l).unwrap();
            if i % every == 0 {
                out.extend(e.take());
            }
        }
        out.extend(e.finish().unwrap());
        out
    }

    #[test]
    fn an_aligned_index_locates_its_list_and_is_a_fraction_of_a_keyed_one() {
        let (packs, chunks, locs) = aligned(1000);
        let bytes = encode_aligned(&packs, &chunks, &locs, 97);
        assert_eq!(bytes, encode_aligned(&packs, &chunks, &locs, 1), "pieces do not change the bytes");
        let blob = PackIndexBlob::decode(&bytes).unwrap();
        assert!(matches!(blob, PackIndexBlob::Aligned(_)));
        assert_eq!(blob.encode(), bytes);
        assert_eq!(blob.packs(), &packs[..]);
        assert_eq!(blob.len(), 1000);
        assert_eq!(blob.stored_bytes(), locs.iter().map(|l| u64::from(l.stored_len)).sum::<u64>());
        let want: Vec<_> = locs.iter().map(|l| (packs[l.pack as usize], *l)).collect();
        assert_eq!(blob.locate(&chunks).unwrap(), want);
        // The same locations keyed by id: version 1 locates the same, and is ~15x larger.
        let keyed =
            PackIndex::new(packs.clone(), chunks.iter().map(|c| c.id).zip(locs.iter().copied()).collect());
        let v1 = keyed.encode();
        let blob1 = PackIndexBlob::decode(&v1).unwrap();
        assert_eq!(blob1, PackIndexBlob::Keyed(keyed));
        assert_eq!(blob1.locate(&chunks).unwrap(), want);
        assert_eq!(blob.keyed(&chunks).unwrap(), blob1.keyed(&chunks).unwrap());
        assert!(bytes.len() * 8 < v1.len(), "{} against {}", bytes.len(), v1.len());
    }

    #[test]
    fn an_aligned_index_refuses_another_list_and_lengths_that_disagree() {
        let (packs, chunks, locs) = aligned(50);
        let blob = PackIndexBlob::decode(&encode_aligned(&packs, &chunks, &locs, 1)).unwrap();
        let mut other = chunks.clone();
        other.swap(3, 4);
        assert!(matches!(blob.locate(&other), Err(IndexMismatch::OtherList { .. })));
        other = chunks.clone();
        other[7].len += 1;
        assert!(matches!(blob.locate(&other), Err(IndexMismatch::OtherList { .. })));
        assert!(matches!(blob.locate(&chunks[1..]), Err(IndexMismatch::OtherList { .. })));
        // A keyed index misses a chunk it lacks and sees a length that differs.
        let keyed = PackIndexBlob::Keyed(PackIndex::new(
            packs.clone(),
            chunks.iter().map(|c| c.id).zip(locs.iter().copied()).skip(1).collect(),
        ));
        assert!(matches!(keyed.locate(&chunks), Err(IndexMismatch::Missing { index: 0, .. })));
        other = chunks[1..].to_vec();
        other[2].len += 1;
        assert!(matches!(keyed.locate(&other), Err(IndexMismatch::Length { index: 2, .. })));
    }

    #[test]
    fn the_aligned_encoder_refuses_what_the_format_cannot_hold() {
        let (packs, chunks, locs) = aligned(3);
        let (c, l) = (chunks[1], locs[1]);
        let refused =
            |loc: PackLocation, chunk: ChunkRef| PackIndexEncoder::new(&packs, 1).entry(chunk, loc).is_err();
        assert!(!refused(l, c));
        assert!(refused(PackLocation { pack: 2, ..l }, c), "pack out of range");
        assert!(refused(l, ChunkRef { len: c.len + 1, ..c }), "raw length not the chunk's");
        assert!(refused(PackLocation { compression: Compression::None, ..l }, c), "raw with stored != raw");
        assert!(refused(PackLocation { offset: u64::MAX - 50, ..l }, c), "past 2^64");
        let mut e = PackIndexEncoder::new(&packs, 2);
        e.entry(c, l).unwrap();
        assert!(e.finish().is_err(), "one entry of two");
        let mut e = PackIndexEncoder::new(&packs, 1);
        e.entry(c, l).unwrap();
        assert!(e.entry(c, l).is_err(), "more than announced");
    }

    #[test]
    fn an_aligned_index_decodes_only_its_canonical_form() {
        let (packs, chunks, locs) = aligned(30);
        let bytes = encode_aligned(&packs, &chunks, &locs, 1);
        for cut in [1, 33, bytes.len() - 20] {
            assert!(PackIndexBlob::decode(&bytes[..bytes.len() - cut]).is_err(), "cut {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(PackIndexBlob::decode(&longer).is_err(), "trailing byte");
        // The header: magic, version 2, two packs, 30 entries; then the first entry (place 0:
        // pack 0 at offset 0). Written out as pack 1 at offset 0 instead, it is not canonical.
        let first = 8 + 4 + 4 + 64 + 4;
        assert_eq!(bytes[first], 0);
        let mut spelled = bytes[..first].to_vec();
        spelled.extend([1, 0]);
        spelled.extend(&bytes[first + 1..]);
        assert!(PackIndexBlob::decode(&spelled).unwrap_err().to_string().contains("continuing"));
        // A pack number past the table.
        let mut far = bytes[..first].to_vec();
        far.extend([3, 0]);
        far.extend(&bytes[first + 1..]);
        assert!(PackIndexBlob::decode(&far).unwrap_err().to_string().contains("out of range"));
        // No packs at all: even a continuing first entry names a pack that is not there.
        let empty = PackIndexEncoder::new(&[], 0).finish().unwrap();
        assert_eq!(PackIndexBlob::decode(&empty).unwrap().len(), 0);
        let mut one = empty[..16].to_vec();
        one.extend(1u32.to_le_bytes());
        one.extend([0, 2]);
        one.extend(&empty[20..]);
        assert!(PackIndexBlob::decode(&one).unwrap_err().to_string().contains("out of range"));
    }
}
