//! The source index of a directory build: for each regular file read, a fingerprint of its inode
//! (device, inode number, size, allocated blocks, mtime and ctime) and its chunks. The next build
//! of the same directory into the same store reads only the files whose fingerprint is not in the
//! index — git's index and rsync's quick check use the same stat fields — and takes the others'
//! chunk ids from here (`docs/formats/source-index.md`).
//!
//! Format code only: no I/O. Records have fixed widths and are sorted by fingerprint, so a lookup
//! is a binary search over the encoded bytes, and decoding checks every field once, in one pass,
//! without allocating.

use tessera_image::{BlockSize, ChunkId};

/// The index blob's first bytes.
pub const MAGIC: &[u8; 8] = b"TESSDIX\0";
/// The only version this code reads and writes.
pub const VERSION: u32 = 1;
const HEADER: usize = 8 + 4 + 4 + 4 + 4;
const FILE_RECORD: usize = 16 + 4 + 4;
const CHUNK_RECORD: usize = 8 + 4 + 32;

/// 128 bits of blake3 over a file's stat fields. All zeros means "no fingerprint": the file changed
/// too recently to be trusted (see [`StatKey::fingerprint`]) and is read by every build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Fingerprint(pub [u8; 16]);

impl Fingerprint {
    pub const NONE: Fingerprint = Fingerprint([0; 16]);

    pub fn is_none(&self) -> bool {
        *self == Self::NONE
    }
}

/// The stat fields a fingerprint covers. A write to a file changes its ctime (and nothing can set
/// ctime back); replacing it changes the inode; holes punched or filled change the block count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatKey {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    /// 512-byte blocks allocated (`st_blocks`).
    pub blocks: u64,
    /// (seconds, nanoseconds).
    pub mtime: (i64, i64),
    pub ctime: (i64, i64),
}

impl StatKey {
    /// The fingerprint, or [`Fingerprint::NONE`] when the file's mtime or ctime is later than
    /// `trusted_before` (nanoseconds since the epoch): timestamps come from a clock that ticks every
    /// few milliseconds, so a file written again within the tick in which it was looked at keeps
    /// its stat ("racily clean", as git calls it). The caller passes a time safely before it began
    /// looking at the tree.
    pub fn fingerprint(&self, trusted_before: i128) -> Fingerprint {
        let ns = |(s, n): (i64, i64)| i128::from(s) * 1_000_000_000 + i128::from(n);
        if ns(self.mtime) >= trusted_before || ns(self.ctime) >= trusted_before {
            return Fingerprint::NONE;
        }
        let mut h = blake3::Hasher::new_derive_key("tessera source index v1 stat fingerprint");
        for v in [self.dev, self.ino, self.size, self.blocks] {
            h.update(&v.to_le_bytes());
        }
        for (s, n) in [self.mtime, self.ctime] {
            h.update(&s.to_le_bytes());
            h.update(&n.to_le_bytes());
        }
        let mut out = [0u8; 16];
        out.copy_from_slice(&h.finalize().as_bytes()[..16]);
        if out == [0; 16] {
            out[0] = 1; // never the "none" value
        }
        Fingerprint(out)
    }
}

/// Why an index blob was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceIndexError {
    #[error("not a source index (bad magic)")]
    BadMagic,
    #[error("source index version {0} (this build reads version {VERSION})")]
    UnsupportedVersion(u32),
    #[error("source index length {actual} does not match its counts ({expected} bytes)")]
    Length { expected: u64, actual: u64 },
    #[error("source index is not canonical: {0}")]
    NotCanonical(&'static str),
}

/// One chunk of a file: (offset in the file, chunk id, length).
pub type IndexedChunk = (u64, ChunkId, u32);

/// A decoded (checked) source index; lookups read the encoded bytes.
#[derive(Debug, Clone)]
pub struct SourceIndex {
    bytes: Vec<u8>,
    chunk_size: u32,
    files: usize,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

impl SourceIndex {
    /// Check `bytes` strictly: magic, version, lengths, fingerprints strictly ascending and never
    /// the "none" value, every file's chunks contiguous in the chunk list and in the order of the
    /// file, each 1 byte to `chunk_size` long, starting on a 4 KiB block after the previous one.
    pub fn decode(bytes: Vec<u8>) -> Result<Self, SourceIndexError> {
        use SourceIndexError::*;
        if bytes.len() < HEADER || &bytes[..8] != MAGIC {
            return Err(BadMagic);
        }
        let version = u32_at(&bytes, 8);
        if version != VERSION {
            return Err(UnsupportedVersion(version));
        }
        let chunk_size = u32_at(&bytes, 12);
        let files = u32_at(&bytes, 16) as usize;
        let chunks = u32_at(&bytes, 20) as usize;
        let expected =
            HEADER as u64 + files as u64 * FILE_RECORD as u64 + chunks as u64 * CHUNK_RECORD as u64;
        if expected != bytes.len() as u64 {
            return Err(Length { expected, actual: bytes.len() as u64 });
        }
        if !chunk_size.is_power_of_two() || !(64 * 1024..=16 * 1024 * 1024).contains(&chunk_size) {
            return Err(NotCanonical("chunk size"));
        }
        let index = Self { bytes, chunk_size, files };
        let mut next_first = 0usize;
        let mut previous: Option<Fingerprint> = None;
        for i in 0..files {
            let (fp, first, count) = index.file(i);
            if fp.is_none() || previous.is_some_and(|p| p >= fp) {
                return Err(NotCanonical("fingerprints not strictly ascending"));
            }
            previous = Some(fp);
            if first != next_first || count == 0 {
                return Err(NotCanonical("file chunk ranges"));
            }
            next_first =
                first.checked_add(count).filter(|&e| e <= chunks).ok_or(NotCanonical("file chunk ranges"))?;
            let mut end = 0u64;
            for c in first..next_first {
                let (offset, _, len) = index.chunk(c);
                if len == 0 || len > chunk_size || offset % BlockSize::U64 != 0 || offset < end {
                    return Err(NotCanonical("chunk offsets and lengths"));
                }
                end = (offset + u64::from(len)).div_ceil(BlockSize::U64) * BlockSize::U64;
            }
        }
        if next_first != chunks {
            return Err(NotCanonical("chunks no file names"));
        }
        Ok(index)
    }

    pub fn chunk_size(&self) -> u32 {
        self.chunk_size
    }

    pub fn files(&self) -> usize {
        self.files
    }

    /// The bytes, as decoded (for writing the blob).
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    fn file(&self, i: usize) -> (Fingerprint, usize, usize) {
        let at = HEADER + i * FILE_RECORD;
        let mut fp = [0u8; 16];
        fp.copy_from_slice(&self.bytes[at..at + 16]);
        (Fingerprint(fp), u32_at(&self.bytes, at + 16) as usize, u32_at(&self.bytes, at + 20) as usize)
    }

    fn chunk(&self, c: usize) -> IndexedChunk {
        let at = HEADER + self.files * FILE_RECORD + c * CHUNK_RECORD;
        let mut id = [0u8; 32];
        id.copy_from_slice(&self.bytes[at + 12..at + 44]);
        (u64_at(&self.bytes, at), ChunkId(id), u32_at(&self.bytes, at + 8))
    }

    /// Every file: its fingerprint and chunks, in fingerprint order.
    pub fn entries(&self) -> impl Iterator<Item = (Fingerprint, Vec<IndexedChunk>)> + '_ {
        (0..self.files).map(|i| {
            let (fp, first, count) = self.file(i);
            (fp, (first..first + count).map(|c| self.chunk(c)).collect())
        })
    }

    /// Encode `files` (fingerprint and chunks each) as an index with `chunk_size`.
    pub fn encode(chunk_size: u32, files: &[(Fingerprint, Vec<IndexedChunk>)]) -> Vec<u8> {
        let mut e = SourceIndexEncoder::new(chunk_size);
        for (i, (fp, _)) in files.iter().enumerate() {
            e.add(*fp, i as u32);
        }
        let mut out = Vec::new();
        let done: Result<(), std::convert::Infallible> = e.finish(
            |h| files.get(h as usize).map_or(&[][..], |f| &f.1[..]),
            |b| {
                out.extend_from_slice(b);
                Ok(())
            },
        );
        match done {
            Ok(()) => out,
            Err(never) => match never {},
        }
    }

    /// A small index for tests and fuzz seeds: three files, one of two chunks.
    pub fn example() -> Vec<u8> {
        let fp = |n: u64| {
            StatKey {
                dev: 2049,
                ino: n,
                size: 1000 * n,
                blocks: 8 * n,
                mtime: (1_700_000_000, 5),
                ctime: (1_700_000_000, 7),
            }
            .fingerprint(i128::MAX)
        };
        let files = vec![
            (fp(1), vec![(0, ChunkId::of(b"one"), 1000)]),
            (fp(2), vec![(0, ChunkId::of(b"two a"), 65536), (65536, ChunkId::of(b"two b"), 300)]),
            (fp(3), vec![(8192, ChunkId::of(b"three, after a hole"), 4096)]),
        ];
        Self::encode(64 * 1024, &files)
    }

    /// The chunks of the file with fingerprint `fp`, in file order.
    pub fn lookup(&self, fp: Fingerprint) -> Option<impl Iterator<Item = IndexedChunk> + '_> {
        if fp.is_none() {
            return None;
        }
        let (mut lo, mut hi) = (0usize, self.files);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let (at, first, count) = self.file(mid);
            match at.cmp(&fp) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Some((first..first + count).map(move |c| self.chunk(c))),
            }
        }
        None
    }
}

/// Writes an index in pieces, from files given in any order: [`Self::finish`] sorts them and
/// hands the encoded bytes to a sink a piece at a time (a million-file index is tens of MB).
#[derive(Debug)]
pub struct SourceIndexEncoder {
    chunk_size: u32,
    /// (fingerprint, the caller's handle for the file's chunks).
    files: Vec<(Fingerprint, u32)>,
}

impl SourceIndexEncoder {
    pub fn new(chunk_size: u32) -> Self {
        Self { chunk_size, files: Vec::new() }
    }

    /// Add a file by fingerprint and a handle the caller resolves to its chunks in
    /// [`Self::finish`]. Files without a fingerprint are not indexed.
    pub fn add(&mut self, fp: Fingerprint, handle: u32) {
        if !fp.is_none() {
            self.files.push((fp, handle));
        }
    }

    /// Encode, calling `chunks(handle)` for each file (twice: counts, then records) and `sink` with
    /// each piece of the output. Two files with one fingerprint (a hash collision, or an inode
    /// number reused within a build) are both left out; so are files without chunks.
    pub fn finish<'c, E>(
        mut self,
        chunks: impl Fn(u32) -> &'c [IndexedChunk],
        mut sink: impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        const PIECE: usize = 1 << 20;
        self.files.sort_unstable_by_key(|f| f.0);
        let mut keep: Vec<(Fingerprint, u32)> = Vec::with_capacity(self.files.len());
        let mut i = 0;
        while i < self.files.len() {
            let fp = self.files[i].0;
            let mut j = i + 1;
            while j < self.files.len() && self.files[j].0 == fp {
                j += 1;
            }
            let handle = self.files[i].1;
            let list = chunks(handle);
            let valid = list.iter().all(|c| c.2 >= 1 && c.2 <= self.chunk_size);
            if j == i + 1 && !list.is_empty() && valid {
                keep.push((fp, handle));
            }
            i = j;
        }
        drop(self.files);
        let total: usize = keep.iter().map(|f| chunks(f.1).len()).sum();
        let mut buf = Vec::with_capacity(PIECE + CHUNK_RECORD);
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&VERSION.to_le_bytes());
        buf.extend_from_slice(&self.chunk_size.to_le_bytes());
        buf.extend_from_slice(&(keep.len() as u32).to_le_bytes());
        buf.extend_from_slice(&(total as u32).to_le_bytes());
        let mut first = 0u32;
        for (fp, handle) in &keep {
            let count = chunks(*handle).len() as u32;
            buf.extend_from_slice(&fp.0);
            buf.extend_from_slice(&first.to_le_bytes());
            buf.extend_from_slice(&count.to_le_bytes());
            first += count;
            if buf.len() >= PIECE {
                sink(&buf)?;
                buf.clear();
            }
        }
        for (_, handle) in &keep {
            for &(offset, id, len) in chunks(*handle) {
                buf.extend_from_slice(&offset.to_le_bytes());
                buf.extend_from_slice(&len.to_le_bytes());
                buf.extend_from_slice(&id.0);
                if buf.len() >= PIECE {
                    sink(&buf)?;
                    buf.clear();
                }
            }
        }
        sink(&buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(n: u8) -> Fingerprint {
        let key = StatKey { dev: 1, ino: u64::from(n), size: 10, blocks: 8, mtime: (5, 0), ctime: (5, 0) };
        key.fingerprint(i128::MAX)
    }

    fn encode(files: &[(Fingerprint, Vec<IndexedChunk>)]) -> Vec<u8> {
        SourceIndex::encode(64 * 1024, files)
    }

    #[test]
    fn round_trip_and_lookup() {
        let a = vec![(0, ChunkId::of(b"a0"), 65536), (65536, ChunkId::of(b"a1"), 3)];
        let b = vec![(0, ChunkId::of(b"b"), 100)];
        let files =
            vec![(fp(2), a.clone()), (fp(1), b.clone()), (Fingerprint::NONE, b.clone()), (fp(3), vec![])];
        let bytes = encode(&files);
        let index = SourceIndex::decode(bytes.clone()).unwrap();
        assert_eq!(index.files(), 2, "no entry for a file without fingerprint or without chunks");
        assert_eq!(index.lookup(fp(2)).unwrap().collect::<Vec<_>>(), a);
        assert_eq!(index.lookup(fp(1)).unwrap().collect::<Vec<_>>(), b);
        assert!(index.lookup(fp(3)).is_none() && index.lookup(fp(9)).is_none());
        assert!(index.lookup(Fingerprint::NONE).is_none());
        assert_eq!(index.as_bytes(), &bytes[..]);
        let again: Vec<_> = index.entries().collect();
        assert_eq!(SourceIndex::encode(index.chunk_size(), &again), bytes, "entries re-encode to the bytes");
        assert_eq!(SourceIndex::decode(SourceIndex::example()).unwrap().files(), 3);
        // The same files in another order give the same bytes.
        let mut reversed = files.clone();
        reversed.reverse();
        assert_eq!(encode(&reversed), bytes);
    }

    #[test]
    fn colliding_fingerprints_are_left_out() {
        let c = vec![(0, ChunkId::of(b"c"), 1)];
        let bytes = encode(&[(fp(1), c.clone()), (fp(1), c.clone()), (fp(2), c)]);
        let index = SourceIndex::decode(bytes).unwrap();
        assert!(index.lookup(fp(1)).is_none());
        assert!(index.lookup(fp(2)).is_some());
    }

    #[test]
    fn recent_timestamps_give_no_fingerprint() {
        let key = StatKey { dev: 1, ino: 2, size: 3, blocks: 8, mtime: (100, 5), ctime: (100, 7) };
        assert!(!key.fingerprint(100_000_000_008).is_none());
        assert!(key.fingerprint(100_000_000_007).is_none(), "ctime at the bound");
        assert!(key.fingerprint(100_000_000_005).is_none(), "mtime at the bound");
        let moved = StatKey { ino: 3, ..key };
        assert_ne!(key.fingerprint(i128::MAX), moved.fingerprint(i128::MAX));
        let touched = StatKey { ctime: (100, 8), ..key };
        assert_ne!(key.fingerprint(i128::MAX), touched.fingerprint(i128::MAX));
    }

    #[test]
    fn strict_decoding() {
        let good = encode(&[(fp(1), vec![(0, ChunkId::of(b"x"), 4096), (4096, ChunkId::of(b"y"), 1)])]);
        SourceIndex::decode(good.clone()).unwrap();
        let refuse = |mutate: &dyn Fn(&mut Vec<u8>), what: &str| {
            let mut b = good.clone();
            mutate(&mut b);
            assert!(SourceIndex::decode(b).is_err(), "{what}");
        };
        refuse(&|b| b[0] = b'X', "magic");
        refuse(&|b| b[8] = 2, "version");
        refuse(&|b| b[12..16].copy_from_slice(&1000u32.to_le_bytes()), "chunk size");
        refuse(&|b| b.push(0), "trailing byte");
        refuse(&|b| b.truncate(b.len() - 1), "truncated");
        refuse(&|b| b[20..24].copy_from_slice(&u32::MAX.to_le_bytes()), "huge count");
        let file = HEADER;
        let chunk = HEADER + FILE_RECORD;
        refuse(&|b| b[file..file + 16].fill(0), "the none fingerprint");
        refuse(&|b| b[file + 20..file + 24].copy_from_slice(&1u32.to_le_bytes()), "a chunk no file names");
        refuse(&|b| b[file + 16..file + 20].copy_from_slice(&1u32.to_le_bytes()), "first not 0");
        refuse(
            &|b| b[chunk + CHUNK_RECORD..chunk + CHUNK_RECORD + 8].copy_from_slice(&0u64.to_le_bytes()),
            "overlap",
        );
        refuse(&|b| b[chunk..chunk + 8].copy_from_slice(&7u64.to_le_bytes()), "unaligned offset");
        refuse(&|b| b[chunk + 8..chunk + 12].copy_from_slice(&0u32.to_le_bytes()), "empty chunk");
        refuse(
            &|b| b[chunk + 8..chunk + 12].copy_from_slice(&(1u32 << 20).to_le_bytes()),
            "chunk over the size",
        );
        // Two files out of order.
        let two =
            encode(&[(fp(1), vec![(0, ChunkId::of(b"x"), 1)]), (fp(2), vec![(0, ChunkId::of(b"y"), 1)])]);
        let mut swapped = two.clone();
        let (f0, f1) = (HEADER, HEADER + FILE_RECORD);
        let a: Vec<u8> = swapped[f0..f0 + 16].to_vec();
        let b: Vec<u8> = swapped[f1..f1 + 16].to_vec();
        swapped[f0..f0 + 16].copy_from_slice(&b);
        swapped[f1..f1 + 16].copy_from_slice(&a);
        assert!(SourceIndex::decode(swapped).is_err(), "order");
    }
}
