//! Content manifests: a file tree's entries with every attribute the image keeps and each regular
//! file's chunk ids. A *layer manifest* is the content manifest of one OCI layer (it may hold
//! whiteouts, written as the OCI image-spec writes them); the builder makes one per new layer and
//! stores it, so that a later build with the same layer reads the manifest instead of the layer.
//! `tessera build manifest:FILE` reads the human-writable text form (`crate::manifest_text`).
//!
//! Byte layout (version 1): `docs/formats/content-manifest.md`. The decoder is strict: an
//! unknown version, trailing bytes, a length past the end or a field out of range is an error.

use tessera_ext4::{DataRange, DataRanges, Meta, Timestamp, Xattr};
use tessera_image::codec::{Reader, Writer};
use tessera_image::{BlockSize, ChunkId, ChunkRef, DecodeError};

use crate::seed::FileChunks;
use crate::source::{EntryKind, LayerEntry};

/// The binary format's version.
pub const MANIFEST_VERSION: u32 = 1;
const MAGIC: &[u8; 8] = b"TESSMAN\0";
const WHAT: &str = "content manifest";
/// Largest chunk a manifest may name (the pack index reader's limit).
pub const MAX_MANIFEST_CHUNK: u32 = 64 << 20;

/// Entries in the order they apply (a later entry at the same path replaces an earlier one, as in
/// a tar layer). A regular file's entry is [`EntryKind::File`] whose `offset` is the index of its
/// chunk list in `files`, not a stream offset.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ContentManifest {
    pub entries: Vec<LayerEntry>,
    pub files: Vec<FileChunks>,
}

fn kind_code(k: &EntryKind) -> u8 {
    match k {
        EntryKind::File { .. } => 0,
        EntryKind::Dir => 1,
        EntryKind::Symlink(_) => 2,
        EntryKind::HardLink(_) => 3,
        EntryKind::Char { .. } => 4,
        EntryKind::Block { .. } => 5,
        EntryKind::Fifo => 6,
    }
}

fn put_time(w: &mut Writer, t: Timestamp) {
    w.u64(t.sec as u64);
    w.u32(t.nsec);
}

impl ContentManifest {
    /// Every chunk the manifest names (with repeats).
    pub fn chunk_ids(&self) -> impl Iterator<Item = (ChunkId, u32)> + '_ {
        self.files.iter().flatten().map(|&(_, id, len)| (id, len))
    }

    /// Each chunk once, in order of first use: the list a layer's pack index is aligned with.
    /// A chunk given two lengths (the manifest is not what a build wrote) is an error.
    pub fn chunk_list(&self) -> Result<Vec<ChunkRef>, String> {
        let mut seen = std::collections::HashMap::new();
        let mut list = Vec::new();
        for (id, len) in self.chunk_ids() {
            match seen.insert(id, len) {
                None => list.push(ChunkRef { id, len }),
                Some(first) if first != len => {
                    return Err(format!("chunk {id} is {first} bytes in one place and {len} in another"))
                }
                Some(_) => {}
            }
        }
        Ok(list)
    }

    /// The canonical encoding (the same manifest always gives the same bytes).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.bytes(MAGIC);
        w.u32(MANIFEST_VERSION);
        w.len(self.entries.len());
        let empty = FileChunks::new();
        for e in &self.entries {
            w.u8(kind_code(&e.kind));
            w.blob(&e.path);
            w.u32(u32::from(e.meta.mode));
            w.u32(e.meta.uid);
            w.u32(e.meta.gid);
            put_time(&mut w, e.meta.atime);
            put_time(&mut w, e.meta.mtime);
            put_time(&mut w, e.meta.ctime);
            w.len(e.xattrs.len());
            for x in &e.xattrs {
                w.blob(&x.name);
                w.blob(&x.value);
            }
            match &e.kind {
                EntryKind::File { size, offset } => {
                    w.u64(*size);
                    let chunks =
                        usize::try_from(*offset).ok().and_then(|i| self.files.get(i)).unwrap_or(&empty);
                    w.len(chunks.len());
                    for (off, id, len) in chunks {
                        w.u64(*off);
                        w.bytes(&id.0);
                        w.u32(*len);
                    }
                }
                EntryKind::Symlink(t) | EntryKind::HardLink(t) => w.blob(t),
                EntryKind::Char { major, minor } | EntryKind::Block { major, minor } => {
                    w.u32(*major);
                    w.u32(*minor);
                }
                EntryKind::Dir | EntryKind::Fifo => {}
            }
        }
        w.buf
    }

    /// Decode and check a manifest (see the module docs for what is refused).
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(bytes, WHAT);
        r.header(MAGIC, MANIFEST_VERSION)?;
        // kind, path length, mode, uid, gid, three times, xattr count.
        let n = r.count(1 + 4 + 12 + 36 + 4)?;
        let mut out = ContentManifest { entries: Vec::with_capacity(n), files: Vec::new() };
        for _ in 0..n {
            let code = r.u8()?;
            let path = r.blob()?.to_vec();
            if path.is_empty() || path.contains(&0) {
                return Err(r.not_canonical("path", "empty or holds a NUL byte"));
            }
            let mode = r.u32()?;
            let mode = u16::try_from(mode)
                .ok()
                .filter(|m| *m <= 0o7777)
                .ok_or_else(|| r.not_canonical("mode", "more than permission bits"))?;
            let (uid, gid) = (r.u32()?, r.u32()?);
            if uid == u32::MAX || gid == u32::MAX {
                return Err(r.not_canonical("uid/gid", "4294967295 is not a valid owner"));
            }
            let mut time = || -> Result<Timestamp, DecodeError> {
                let sec = r.u64()? as i64;
                let nsec = r.u32()?;
                if nsec >= 1_000_000_000 {
                    return Err(r.not_canonical("time", "nanoseconds out of range"));
                }
                Ok(Timestamp { sec, nsec })
            };
            let (atime, mtime, ctime) = (time()?, time()?, time()?);
            let meta = Meta { mode, uid, gid, atime, mtime, ctime };
            let nx = r.count(8)?;
            let mut xattrs: Vec<Xattr> = Vec::with_capacity(nx);
            for _ in 0..nx {
                let name = r.blob()?.to_vec();
                let value = r.blob()?.to_vec();
                if name.is_empty() || name.contains(&0) {
                    return Err(r.not_canonical("xattr", "empty name or a NUL byte in it"));
                }
                if xattrs.last().is_some_and(|p| p.name > name) {
                    return Err(r.not_canonical("xattr", "names not sorted"));
                }
                xattrs.push(Xattr { name, value });
            }
            let kind = match code {
                0 => {
                    let size = r.u64()?;
                    let nc = r.count(44)?;
                    let mut chunks = FileChunks::with_capacity(nc);
                    let mut end = 0u64;
                    for _ in 0..nc {
                        let off = r.u64()?;
                        let id = ChunkId(r.array()?);
                        let len = r.u32()?;
                        check_chunk(off, len, end, size).map_err(|why| r.not_canonical("chunks", why))?;
                        end = off + u64::from(len);
                        chunks.push((off, id, len));
                    }
                    out.files.push(chunks);
                    EntryKind::File { size, offset: (out.files.len() - 1) as u64 }
                }
                1 => EntryKind::Dir,
                2 | 3 => {
                    let t = r.blob()?.to_vec();
                    if t.is_empty() || t.contains(&0) || (code == 2 && t.len() > 4095) {
                        return Err(r.not_canonical("target", "empty, too long or holds a NUL byte"));
                    }
                    if code == 2 {
                        EntryKind::Symlink(t)
                    } else {
                        EntryKind::HardLink(t)
                    }
                }
                4 | 5 => {
                    let (major, minor) = (r.u32()?, r.u32()?);
                    if code == 4 {
                        EntryKind::Char { major, minor }
                    } else {
                        EntryKind::Block { major, minor }
                    }
                }
                6 => EntryKind::Fifo,
                _ => return Err(r.not_canonical("kind", "unknown entry kind")),
            };
            out.entries.push(LayerEntry { path, kind, meta, xattrs });
        }
        r.finish()?;
        Ok(out)
    }
}

#[cfg(any(test, feature = "test-support"))]
fn example_entry(path: &str, kind: EntryKind) -> LayerEntry {
    let t = Timestamp { sec: -5, nsec: 7 };
    let meta = Meta {
        mode: 0o4755,
        uid: 1,
        gid: 4_000_000_000,
        atime: t,
        mtime: Timestamp { sec: 9, nsec: 0 },
        ctime: t,
    };
    LayerEntry { path: path.as_bytes().to_vec(), kind, meta, xattrs: Vec::new() }
}

#[cfg(any(test, feature = "test-support"))]
impl ContentManifest {
    /// One entry of every kind, a whiteout, an opaque marker and a file of two chunks.
    /// For tests and fuzz seeds (feature `test-support`).
    #[cfg(any(test, feature = "test-support"))]
    pub fn example() -> ContentManifest {
        let mut file = example_entry("bin/ping", EntryKind::File { size: 600_000, offset: 0 });
        file.xattrs = vec![
            Xattr { name: b"security.capability".to_vec(), value: b"\x01\x00\n\x02".to_vec() },
            Xattr { name: b"user.k".to_vec(), value: Vec::new() },
        ];
        ContentManifest {
            entries: vec![
                example_entry("./", EntryKind::Dir),
                file,
                example_entry("bin/ping2", EntryKind::HardLink(b"bin/ping".to_vec())),
                example_entry("bin/sh", EntryKind::Symlink(b"/bin/ping".to_vec())),
                example_entry("dev/null", EntryKind::Char { major: 1, minor: 3 }),
                example_entry("dev/sda", EntryKind::Block { major: 8, minor: 0 }),
                example_entry("run/fifo", EntryKind::Fifo),
                example_entry("etc/.wh.passwd", EntryKind::File { size: 0, offset: 1 }),
                example_entry("opt/.wh..wh..opq", EntryKind::File { size: 0, offset: 2 }),
            ],
            files: vec![
                tessera_ext4::smallvec::smallvec![
                    (0, ChunkId::of(b"a"), 524_288),
                    (524_288, ChunkId::of(b"b"), 75_712)
                ],
                Default::default(),
                Default::default(),
            ],
        }
    }
}

/// Whether a chunk of `len` bytes at `off` may follow chunks ending at `end` in a file of `size`
/// bytes: block-aligned, after the previous chunk's last block, non-empty, within the file.
pub(crate) fn check_chunk(off: u64, len: u32, end: u64, size: u64) -> Result<(), &'static str> {
    if off % BlockSize::U64 != 0 {
        return Err("a chunk offset is not a multiple of 4096");
    }
    if off < end.div_ceil(BlockSize::U64) * BlockSize::U64 {
        return Err("chunks overlap, share a block or are out of order");
    }
    if len == 0 || len > MAX_MANIFEST_CHUNK {
        return Err("a chunk length is 0 or over 64 MiB");
    }
    if off.checked_add(u64::from(len)).is_none_or(|e| e > size) {
        return Err("a chunk ends past the end of the file");
    }
    Ok(())
}

/// The blocks a file's chunks cover, merged: its data ranges (the rest is holes).
pub(crate) fn data_ranges(chunks: &[(u64, ChunkId, u32)]) -> DataRanges {
    let mut out = DataRanges::new();
    for &(off, _, len) in chunks {
        let start = off / BlockSize::U64;
        let end = (off + u64::from(len)).div_ceil(BlockSize::U64);
        match out.last_mut() {
            Some(last) if last.start_block + last.blocks >= start => {
                last.blocks = last.blocks.max(end - last.start_block)
            }
            _ => out.push(DataRange { start_block: start, blocks: end - start }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(path: &str, kind: EntryKind) -> LayerEntry {
        example_entry(path, kind)
    }

    #[test]
    fn the_chunk_list_holds_each_chunk_once_in_order_of_first_use() {
        let mut m = ContentManifest::example();
        let (a, b) = (ChunkId::of(b"a"), ChunkId::of(b"b"));
        m.files[2] = tessera_ext4::smallvec::smallvec![(0, b, 75_712), (75_776, a, 524_288)];
        let list = m.chunk_list().unwrap();
        assert_eq!(list, [ChunkRef { id: a, len: 524_288 }, ChunkRef { id: b, len: 75_712 }]);
        // The same chunk with another length: not a manifest a build wrote.
        m.files[2][0].2 = 4096;
        assert!(m.chunk_list().unwrap_err().contains("4096"));
    }

    #[test]
    fn roundtrip_every_kind() {
        let m = ContentManifest::example();
        let bytes = m.encode();
        assert_eq!(ContentManifest::decode(&bytes).unwrap(), m);
        assert_eq!(ContentManifest::decode(&bytes).unwrap().encode(), bytes, "canonical");
        assert_eq!(
            ContentManifest::decode(&ContentManifest::default().encode()).unwrap(),
            ContentManifest::default()
        );
        let ranges = data_ranges(&m.files[0]);
        assert_eq!(ranges[..], [DataRange { start_block: 0, blocks: 147 }]);
    }

    #[test]
    fn refuses_unknown_versions_magic_and_trailing_bytes() {
        let bytes = ContentManifest::example().encode();
        let mut v2 = bytes.clone();
        v2[8..12].copy_from_slice(&2u32.to_le_bytes());
        assert!(matches!(
            ContentManifest::decode(&v2),
            Err(DecodeError::UnsupportedVersion { version: 2, .. })
        ));
        let mut magic = bytes.clone();
        magic[0] = b'X';
        assert!(matches!(ContentManifest::decode(&magic), Err(DecodeError::BadMagic { .. })));
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(matches!(
            ContentManifest::decode(&trailing),
            Err(DecodeError::TrailingBytes { count: 1, .. })
        ));
    }

    #[test]
    fn refuses_bad_lengths() {
        let bytes = ContentManifest::example().encode();
        // Every truncation fails (none panics or allocates by a hostile count).
        for n in 0..bytes.len() {
            assert!(ContentManifest::decode(&bytes[..n]).is_err(), "truncated at {n}");
        }
        // An entry count far past what the bytes can hold.
        let mut count = bytes.clone();
        count[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(ContentManifest::decode(&count), Err(DecodeError::Truncated { .. })));
        // A path length past the end.
        let mut path = bytes.clone();
        path[17..21].copy_from_slice(&(1u32 << 30).to_le_bytes());
        assert!(matches!(ContentManifest::decode(&path), Err(DecodeError::Truncated { .. })));
    }

    #[test]
    fn refuses_fields_out_of_range() {
        let one =
            |e: LayerEntry, files: Vec<FileChunks>| ContentManifest { entries: vec![e], files }.encode();
        let bad =
            |bytes: Vec<u8>| matches!(ContentManifest::decode(&bytes), Err(DecodeError::NotCanonical { .. }));
        let file = |size| entry("f", EntryKind::File { size, offset: 0 });
        let id = ChunkId::of(b"x");
        // Chunks: unaligned, overlapping, sharing a block, empty, past the end, too long.
        assert!(bad(one(file(10_000), vec![tessera_ext4::smallvec::smallvec![(1, id, 10)]])));
        assert!(bad(one(
            file(10_000),
            vec![tessera_ext4::smallvec::smallvec![(0, id, 8192), (4096, id, 10)]]
        )));
        assert!(bad(one(file(10_000), vec![tessera_ext4::smallvec::smallvec![(0, id, 100), (0, id, 10)]])));
        assert!(bad(one(file(10_000), vec![tessera_ext4::smallvec::smallvec![(0, id, 0)]])));
        assert!(bad(one(file(10_000), vec![tessera_ext4::smallvec::smallvec![(8192, id, 4096)]])));
        assert!(bad(one(
            file(u64::MAX),
            vec![tessera_ext4::smallvec::smallvec![(0, id, MAX_MANIFEST_CHUNK + 1)]]
        )));
        // A sparse file (a hole between two chunks) is fine.
        assert!(ContentManifest::decode(&one(
            file(3 << 20),
            vec![tessera_ext4::smallvec::smallvec![(0, id, 4096), (2 << 20, id, 1)]]
        ))
        .is_ok());
        let mut e = file(0);
        e.meta.mode = 0o10000;
        assert!(bad(one(e, vec![tessera_ext4::smallvec::smallvec![]])));
        let mut e = file(0);
        e.meta.uid = u32::MAX;
        assert!(bad(one(e, vec![tessera_ext4::smallvec::smallvec![]])));
        let mut e = file(0);
        e.meta.mtime.nsec = 1_000_000_000;
        assert!(bad(one(e, vec![tessera_ext4::smallvec::smallvec![]])));
        let mut e = file(0);
        e.xattrs = vec![
            Xattr { name: b"user.b".to_vec(), value: vec![] },
            Xattr { name: b"user.a".to_vec(), value: vec![] },
        ];
        assert!(bad(one(e, vec![tessera_ext4::smallvec::smallvec![]])));
        assert!(bad(one(entry("", EntryKind::Dir), vec![])));
        assert!(bad(one(entry("a\0b", EntryKind::Dir), vec![])));
        assert!(bad(one(entry("s", EntryKind::Symlink(Vec::new())), vec![])));
        assert!(bad(one(entry("s", EntryKind::Symlink(vec![b'x'; 4096])), vec![])));
        let mut kind = one(entry("d", EntryKind::Dir), vec![]);
        kind[16] = 9;
        assert!(bad(kind));
    }
}
