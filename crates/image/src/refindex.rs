//! The reference pack index: where each chunk of a `--reference-layers` image sits in the source
//! image's gzip layer blobs, and the checkpoints that let a reader decode any span of a layer
//! alone. Byte layout: `docs/formats/reference-index.md`. Not part of the image ID.

use crate::blockmap::ChunkRef;
use crate::codec::{Reader, Writer};
use crate::digest::{ChunkId, ImageId, Sha256Digest};
use crate::error::DecodeError;

/// The first 8 bytes of a reference pack index (a plain pack index starts `TESSPIX\0`).
pub const REF_INDEX_MAGIC: &[u8; 8] = b"TESSRIX\0";
/// The newest version, which this code writes (it reads 1, 2 and 3): version 2 keeps the windows
/// in a blob of their own, read a window at a time, so opening an image reads no window; version
/// 3 names no chunk id, its entries following the image record's chunk list.
pub const REF_INDEX_VERSION: u32 = 3;
/// Largest stored (zstd) window accepted: a 32 KiB window that did not compress, plus zstd's
/// frame overhead.
pub const MAX_STORED_WINDOW: u32 = (32 << 10) + 1024;

/// A place in a layer's gzip stream where inflation can resume (a deflate block boundary).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefCheckpoint {
    /// Compressed bytes consumed at the boundary (offset in the layer blob).
    pub in_offset: u64,
    /// Bits of the byte at `in_offset - 1` not yet read (0..=7).
    pub bits: u8,
    /// Uncompressed offset of the boundary (in the layer's tar stream).
    pub out_offset: u64,
    /// End (exclusive) of the compressed bytes that hold this checkpoint's span.
    pub span_end: u64,
    /// blake3 of the compressed span bytes `[start, span_end)`.
    pub span_digest: [u8; 32],
    /// The preceding up to 32 KiB of uncompressed bytes of its member, zstd-compressed (empty at
    /// a member start).
    pub window: Window,
}

/// Where a checkpoint's stored (zstd) window is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Window {
    /// In the index itself (version 1; what the builder makes before [`RefIndex::split_windows`]).
    Inline(Vec<u8>),
    /// `len` bytes at `offset` of the index's windows blob ([`RefIndex::windows`]), whose blake3 is
    /// `digest` (version 2; all zeros when `len` is 0).
    Stored { offset: u64, len: u32, digest: [u8; 32] },
}

impl Window {
    /// Stored bytes of the window.
    pub fn len(&self) -> u64 {
        match self {
            Window::Inline(w) => w.len() as u64,
            Window::Stored { len, .. } => u64::from(*len),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The blob holding a version-2 index's windows, back to back in checkpoint order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowsBlob {
    pub digest: Sha256Digest,
    pub len: u64,
}

impl RefCheckpoint {
    /// First compressed byte of the span (one before `in_offset` when the boundary is inside a byte).
    pub fn start(&self) -> u64 {
        self.in_offset - u64::from(self.bits > 0)
    }
}

/// How a referenced layer is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RefCodec {
    /// gzip: spans resume inflation at a deflate block boundary, with a window.
    #[default]
    Gzip,
    /// zstd made of many frames: a span is whole frames (no window, no bits; version 2 only).
    Zstd,
}

/// One source layer blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefLayer {
    /// sha256 of the blob as stored (the OCI layer digest).
    pub digest: Sha256Digest,
    /// How the blob is compressed (version 1: always gzip).
    pub codec: RefCodec,
    /// Size of the blob.
    pub compressed_len: u64,
    /// Size of the uncompressed tar stream.
    pub uncompressed_len: u64,
    /// Ascending; the first at uncompressed offset 0.
    pub checkpoints: Vec<RefCheckpoint>,
}

impl RefLayer {
    /// The uncompressed range `[start, end)` of span `k`.
    pub fn span_range(&self, k: usize) -> Option<(u64, u64)> {
        let cp = self.checkpoints.get(k)?;
        let end = self.checkpoints.get(k + 1).map_or(self.uncompressed_len, |n| n.out_offset);
        Some((cp.out_offset, end))
    }

    /// The spans `first..=last` covering the uncompressed range `[a, a + len)` (`len > 0`).
    pub fn spans_covering(&self, a: u64, len: u64) -> Option<(usize, usize)> {
        let b = a.checked_add(len)?;
        if len == 0 || b > self.uncompressed_len {
            return None;
        }
        let find = |u: u64| self.checkpoints.partition_point(|c| c.out_offset <= u).checked_sub(1);
        Some((find(a)?, find(b - 1)?))
    }
}

/// Where one chunk's bytes are: `len` bytes at uncompressed `offset` of layer `layer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RefLocation {
    /// Index into [`RefIndex::layers`].
    pub layer: u32,
    pub offset: u64,
    pub len: u32,
}

/// Each chunk's place in a layer, plus the layers' checkpoints; tied to one image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefIndex {
    /// The image this index belongs to (its record's sha256).
    pub image: ImageId,
    /// Versions 2 and 3: the blob every [`Window::Stored`] is in. `None`: version 1, windows inline.
    pub windows: Option<WindowsBlob>,
    pub layers: Vec<RefLayer>,
    entries: RefEntries,
}

/// Where the chunks are: keyed by chunk id (versions 1 and 2, and as built), or one per chunk of
/// the image record's chunk list, in its order (version 3), each its layer and where it starts
/// relative to where the layer's previous chunk in the list ended (the lengths are the list's).
#[derive(Debug, Clone, PartialEq, Eq)]
enum RefEntries {
    Keyed(Vec<(ChunkId, RefLocation)>),
    Aligned(Vec<(u32, i64)>),
}

impl RefIndex {
    /// Build from parts (entries sorted here; duplicate chunk ids keep the first location).
    pub fn new(image: ImageId, layers: Vec<RefLayer>, mut entries: Vec<(ChunkId, RefLocation)>) -> Self {
        entries.sort_by_key(|e| e.0);
        entries.dedup_by(|b, a| a.0 == b.0);
        Self { image, windows: None, layers, entries: RefEntries::Keyed(entries) }
    }

    /// Version 3: the entries following `chunks`, the chunk list of the image record (each
    /// chunk's place looked up by id here, so every chunk must be indexed with its length), and
    /// the windows in a blob of their own ([`Self::split_windows`] first; an index without
    /// window bytes gets an empty windows blob). An aligned index is returned as it is.
    pub fn align(mut self, chunks: &[ChunkRef]) -> Result<Self, String> {
        if matches!(self.entries, RefEntries::Aligned(_)) {
            return Ok(self);
        }
        let mut ends = vec![0u64; self.layers.len()];
        let mut aligned = Vec::with_capacity(chunks.len());
        for loc in self.locate(chunks)? {
            let end = ends.get_mut(loc.layer as usize).ok_or("layer number out of range")?;
            let delta = i64::try_from(i128::from(loc.offset) - i128::from(*end))
                .map_err(|_| "a chunk's offset is too far from the one before it")?;
            aligned.push((loc.layer, delta));
            *end = loc.offset + u64::from(loc.len);
        }
        if self.windows.is_none() {
            for c in self.layers.iter_mut().flat_map(|l| l.checkpoints.iter_mut()) {
                match &c.window {
                    Window::Inline(w) if w.is_empty() => {
                        c.window = Window::Stored { offset: 0, len: 0, digest: [0; 32] }
                    }
                    Window::Inline(_) => return Err("inline windows: split them first".into()),
                    Window::Stored { .. } => {}
                }
            }
            self.windows = Some(WindowsBlob { digest: Sha256Digest::of(b""), len: 0 });
        }
        self.entries = RefEntries::Aligned(aligned);
        Ok(self)
    }

    /// Where each chunk of `chunks` (the image record's chunk list) is: looked up by id in a
    /// keyed index; in an aligned one, entry `i` is chunk `i`. Every chunk must be there with its
    /// length, inside its layer.
    pub fn locate(&self, chunks: &[ChunkRef]) -> Result<Vec<RefLocation>, String> {
        let mut out = Vec::with_capacity(chunks.len());
        match &self.entries {
            RefEntries::Keyed(keyed) => {
                for (i, c) in chunks.iter().enumerate() {
                    let loc = keyed
                        .binary_search_by(|e| e.0.cmp(&c.id))
                        .ok()
                        .map(|k| keyed[k].1)
                        .ok_or_else(|| format!("chunk #{i} {} is not in the reference index", c.id))?;
                    if loc.len != c.len {
                        return Err(format!(
                            "chunk #{i} {} is {} bytes, the reference index says {}",
                            c.id, c.len, loc.len
                        ));
                    }
                    out.push(loc);
                }
            }
            RefEntries::Aligned(aligned) => {
                if aligned.len() != chunks.len() {
                    return Err(format!(
                        "the reference index has {} entries, the image {} chunks",
                        aligned.len(),
                        chunks.len()
                    ));
                }
                let mut ends = vec![0u64; self.layers.len()];
                for (i, (c, &(layer, delta))) in chunks.iter().zip(aligned).enumerate() {
                    let (Some(end), Some(l)) =
                        (ends.get_mut(layer as usize), self.layers.get(layer as usize))
                    else {
                        return Err(format!("chunk #{i} {}: layer number out of range", c.id));
                    };
                    let offset = end
                        .checked_add_signed(delta)
                        .filter(|o| o.checked_add(u64::from(c.len)).is_some_and(|e| e <= l.uncompressed_len))
                        .ok_or_else(|| format!("chunk #{i} {} lies outside its layer", c.id))?;
                    *end = offset + u64::from(c.len);
                    out.push(RefLocation { layer, offset, len: c.len });
                }
            }
        }
        Ok(out)
    }

    /// How many chunks it indexes.
    pub fn len(&self) -> usize {
        match &self.entries {
            RefEntries::Keyed(k) => k.len(),
            RefEntries::Aligned(a) => a.len(),
        }
    }

    /// Whether it indexes no chunk.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Move inline windows into a blob of their own (version 2): the index, and the blob's bytes
    /// (`None`, and the index unchanged, when it has no window bytes or is version 2 already).
    ///
    /// An index with a zstd layer is always made version 2 (version 1 has no codec field); with
    /// no window bytes its windows blob is empty, and then not a data blob nor written anywhere.
    pub fn split_windows(mut self) -> (Self, Option<Vec<u8>>) {
        let zstd = self.layers.iter().any(|l| l.codec == RefCodec::Zstd);
        if self.windows.is_some() || (self.window_bytes() == 0 && !zstd) {
            return (self, None);
        }
        let mut blob = Vec::with_capacity(self.window_bytes() as usize);
        for c in self.layers.iter_mut().flat_map(|l| l.checkpoints.iter_mut()) {
            let Window::Inline(w) = &c.window else { continue };
            let digest = if w.is_empty() { [0; 32] } else { *blake3::hash(w).as_bytes() };
            let stored = Window::Stored { offset: blob.len() as u64, len: w.len() as u32, digest };
            blob.extend_from_slice(w);
            c.window = stored;
        }
        self.windows = Some(WindowsBlob { digest: Sha256Digest::of(&blob), len: blob.len() as u64 });
        (self, (!blob.is_empty()).then_some(blob))
    }

    /// Whether `bytes` start like a reference pack index (of any version).
    pub fn sniff(bytes: &[u8]) -> bool {
        bytes.starts_with(REF_INDEX_MAGIC)
    }

    /// The entries of a keyed index (versions 1 and 2), sorted by chunk id; none for an aligned
    /// one (version 3: [`Self::locate`] with the record's chunk list).
    pub fn keyed_entries(&self) -> &[(ChunkId, RefLocation)] {
        match &self.entries {
            RefEntries::Keyed(k) => k,
            RefEntries::Aligned(_) => &[],
        }
    }

    /// Bytes of stored windows (what the index adds to the layers).
    pub fn window_bytes(&self) -> u64 {
        self.layers.iter().flat_map(|l| &l.checkpoints).map(|c| c.window.len()).sum()
    }

    /// Version 3 if aligned ([`Self::align`]), else 1 if the windows are inline, else 2 (a
    /// [`Window::Inline`] in a version-2 or 3 index is written as an empty stored window, which
    /// decoding refuses unless the window is empty).
    pub fn encode(&self) -> Vec<u8> {
        let aligned = matches!(self.entries, RefEntries::Aligned(_));
        let stored = self.windows.is_some() || aligned;
        let mut w = Writer::default();
        w.bytes(REF_INDEX_MAGIC);
        w.u32(if aligned {
            3
        } else if stored {
            2
        } else {
            1
        });
        w.bytes(&self.image.digest().0);
        if stored {
            let b = self.windows.unwrap_or(WindowsBlob { digest: Sha256Digest::of(b""), len: 0 });
            w.bytes(&b.digest.0);
            w.u64(b.len);
        }
        w.len(self.layers.len());
        for l in &self.layers {
            w.bytes(&l.digest.0);
            w.u64(l.compressed_len);
            w.u64(l.uncompressed_len);
            if stored {
                w.u8(match l.codec {
                    RefCodec::Gzip => 0,
                    RefCodec::Zstd => 1,
                });
            }
            w.len(l.checkpoints.len());
            for c in &l.checkpoints {
                w.u64(c.in_offset);
                w.u8(c.bits);
                w.u64(c.out_offset);
                w.u64(c.span_end);
                w.bytes(&c.span_digest);
                match (&c.window, stored) {
                    (Window::Inline(win), false) => w.blob(win),
                    (Window::Stored { offset, len, digest }, true) => {
                        w.u64(*offset);
                        w.u32(*len);
                        w.bytes(digest);
                    }
                    (Window::Inline(_), true) => {
                        w.u64(0);
                        w.u32(0);
                        w.bytes(&[0; 32]);
                    }
                    (Window::Stored { .. }, false) => w.blob(&[]),
                }
            }
        }
        w.len(self.len());
        match &self.entries {
            RefEntries::Keyed(keyed) => {
                for (id, loc) in keyed {
                    w.bytes(&id.0);
                    w.u32(loc.layer);
                    w.u64(loc.offset);
                    w.u32(loc.len);
                }
            }
            RefEntries::Aligned(aligned) => {
                let mut previous = 0u32;
                for &(layer, delta) in aligned {
                    w.varint(if layer == previous { 0 } else { u64::from(layer) + 1 });
                    w.varint(zigzag(delta));
                    previous = layer;
                }
            }
        }
        w.buf
    }

    /// Decode strictly: anything a reader would have to guess about is an error.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(bytes, "reference pack index");
        let version = match r.header(REF_INDEX_MAGIC, 1) {
            Ok(()) => 1,
            Err(DecodeError::UnsupportedVersion { version: v @ (2 | 3), .. }) => v,
            Err(e) => return Err(e),
        };
        let image = ImageId(Sha256Digest(r.array()?));
        let windows = if version >= 2 {
            Some(WindowsBlob { digest: Sha256Digest(r.array()?), len: r.u64()? })
        } else {
            None
        };
        // Version 2: windows back to back in checkpoint order, from offset 0.
        let mut window_end = 0u64;
        let n = r.count(56)?;
        let mut layers = Vec::with_capacity(n);
        for _ in 0..n {
            let digest = Sha256Digest(r.array()?);
            let compressed_len = r.u64()?;
            let uncompressed_len = r.u64()?;
            let codec = match (version, if version >= 2 { r.u8()? } else { 0 }) {
                (_, 0) => RefCodec::Gzip,
                (2 | 3, 1) => RefCodec::Zstd,
                _ => return Err(r.not_canonical("codec", "not 0 (gzip) or 1 (zstd)")),
            };
            let n = r.count(if version >= 2 { 101 } else { 61 })?;
            let mut checkpoints: Vec<RefCheckpoint> = Vec::with_capacity(n);
            for _ in 0..n {
                let in_offset = r.u64()?;
                let bits = r.u8()?;
                let out_offset = r.u64()?;
                let span_end = r.u64()?;
                let span_digest = r.array()?;
                let window = if version >= 2 {
                    let (offset, len, digest) = (r.u64()?, r.u32()?, r.array::<32>()?);
                    if offset != window_end || (len == 0 && digest != [0; 32]) {
                        return Err(r.not_canonical(
                            "window",
                            "windows not back to back, or an empty one with a digest",
                        ));
                    }
                    window_end += u64::from(len);
                    Window::Stored { offset, len, digest }
                } else {
                    Window::Inline(r.blob()?.to_vec())
                };
                if codec == RefCodec::Zstd && (bits != 0 || !window.is_empty()) {
                    return Err(r.not_canonical("window", "a zstd checkpoint with bits or a window"));
                }
                if bits > 7 || (bits > 0 && in_offset == 0) {
                    return Err(r.not_canonical("bits", "bit count not 0..=7 or before the stream"));
                }
                let start = in_offset - u64::from(bits > 0);
                if start >= span_end || span_end > compressed_len {
                    return Err(r.not_canonical("span_end", "span outside the layer blob"));
                }
                if out_offset >= uncompressed_len {
                    return Err(r.not_canonical("out_offset", "checkpoint past the layer's end"));
                }
                if window.len() > u64::from(MAX_STORED_WINDOW) {
                    return Err(r.not_canonical("window", "stored window too large"));
                }
                match checkpoints.last() {
                    None if out_offset != 0 => {
                        return Err(r.not_canonical("checkpoints", "the first checkpoint is not at offset 0"))
                    }
                    Some(p) if p.out_offset >= out_offset || p.in_offset >= in_offset => {
                        return Err(r.not_canonical("checkpoints", "checkpoints not strictly ascending"))
                    }
                    _ => {}
                }
                checkpoints.push(RefCheckpoint {
                    in_offset,
                    bits,
                    out_offset,
                    span_end,
                    span_digest,
                    window,
                });
            }
            if checkpoints.is_empty() && uncompressed_len != 0 {
                return Err(r.not_canonical("checkpoints", "a non-empty layer without checkpoints"));
            }
            layers.push(RefLayer { digest, codec, compressed_len, uncompressed_len, checkpoints });
        }
        let entries = if version == 3 {
            Self::decode_aligned(&mut r, &layers)?
        } else {
            Self::decode_keyed(&mut r, &layers)?
        };
        if windows.is_some_and(|w| w.len != window_end) {
            return Err(r.not_canonical("windows", "the windows blob's length is not the sum of the windows"));
        }
        r.finish()?;
        Ok(Self { image, windows, layers, entries })
    }

    /// Versions 1 and 2: entries of 48 bytes, strictly ascending by chunk id.
    fn decode_keyed(r: &mut Reader<'_>, layers: &[RefLayer]) -> Result<RefEntries, DecodeError> {
        let n = r.count(48)?;
        let mut entries: Vec<(ChunkId, RefLocation)> = Vec::with_capacity(n);
        for _ in 0..n {
            let id = ChunkId(r.array()?);
            let layer = r.u32()?;
            let offset = r.u64()?;
            let len = r.u32()?;
            let Some(l) = layers.get(layer as usize) else {
                return Err(r.not_canonical("layer", "layer number out of range"));
            };
            if len == 0 || offset.checked_add(u64::from(len)).is_none_or(|end| end > l.uncompressed_len) {
                return Err(r.not_canonical("offset", "chunk empty or past its layer's end"));
            }
            if entries.last().is_some_and(|(prev, _)| *prev >= id) {
                return Err(r.not_canonical("entries", "chunk ids not strictly ascending"));
            }
            entries.push((id, RefLocation { layer, offset, len }));
        }
        Ok(RefEntries::Keyed(entries))
    }

    /// Version 3: per chunk of the record's list, a layer code (0: the previous entry's layer,
    /// layer 0 for the first; else the layer + 1, never the previous entry's) and the zigzag
    /// offset from where the layer's previous chunk ended. Offsets are checked against the
    /// layers once the list gives the lengths ([`Self::locate`]).
    fn decode_aligned(r: &mut Reader<'_>, layers: &[RefLayer]) -> Result<RefEntries, DecodeError> {
        let n = r.count(2)?;
        let mut entries = Vec::with_capacity(n);
        let mut previous = 0u32;
        for _ in 0..n {
            let layer = match r.varint("layer")? {
                0 => previous,
                k => match u32::try_from(k - 1) {
                    Ok(l) if l != previous => l,
                    _ => return Err(r.not_canonical("layer", "the previous entry's layer not written as 0")),
                },
            };
            if layer as usize >= layers.len() {
                return Err(r.not_canonical("layer", "layer number out of range"));
            }
            entries.push((layer, unzigzag(r.varint("offset")?)));
            previous = layer;
        }
        Ok(RefEntries::Aligned(entries))
    }

    /// An index with two layers and three chunks, for tests and fuzz seeds (feature
    /// `test-support`).
    #[cfg(any(test, feature = "test-support"))]
    pub fn example() -> Self {
        let cp = |in_offset, bits, out_offset, span_end, window: &[u8]| RefCheckpoint {
            in_offset,
            bits,
            out_offset,
            span_end,
            span_digest: *blake3::hash(&in_offset.to_le_bytes()).as_bytes(),
            window: Window::Inline(window.to_vec()),
        };
        let layers = vec![
            RefLayer {
                digest: Sha256Digest::of(b"layer 0"),
                codec: RefCodec::Gzip,
                compressed_len: 5000,
                uncompressed_len: 20_000,
                checkpoints: vec![cp(10, 0, 0, 3000, b""), cp(3000, 5, 9000, 4990, b"window")],
            },
            RefLayer {
                digest: Sha256Digest::of(b"layer 1"),
                codec: RefCodec::Gzip,
                compressed_len: 300,
                uncompressed_len: 2048,
                checkpoints: vec![cp(20, 3, 0, 300, b"")],
            },
        ];
        let loc = |layer, offset, len| RefLocation { layer, offset, len };
        RefIndex::new(
            ImageId(Sha256Digest::of(b"record")),
            layers,
            vec![
                (ChunkId::of(b"a"), loc(0, 512, 9000)),
                (ChunkId::of(b"b"), loc(0, 10_000, 10_000)),
                (ChunkId::of(b"c"), loc(1, 0, 2048)),
            ],
        )
    }
}

impl RefIndex {
    /// [`Self::example`] as version 3 (windows split, entries aligned), with the chunk list it
    /// follows (c, a, b, as an image record might list them), for tests and fuzz seeds (feature
    /// `test-support`).
    #[cfg(any(test, feature = "test-support"))]
    pub fn example_aligned() -> (Self, Vec<ChunkRef>) {
        let list: Vec<ChunkRef> = [(b"c", 2048), (b"a", 9000), (b"b", 10_000)]
            .into_iter()
            .map(|(n, len)| ChunkRef { id: ChunkId::of(n), len })
            .collect();
        let index = Self::example().split_windows().0.align(&list).expect("the example holds its chunks");
        (index, list)
    }
}

/// A signed value as an unsigned one, small magnitudes small: 0, −1, 1, −2, … → 0, 1, 2, 3, ….
fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

/// Either kind of pack index an image entry may name, told apart by the magic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AnyPackIndex {
    /// Chunks in the store's packs (`docs/formats/pack-index.md`).
    Packs(crate::PackIndexBlob),
    /// Chunks in the source image's layers (`docs/formats/reference-index.md`).
    Reference(RefIndex),
}

impl AnyPackIndex {
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        if RefIndex::sniff(bytes) {
            RefIndex::decode(bytes).map(Self::Reference)
        } else {
            crate::PackIndexBlob::decode(bytes).map(Self::Packs)
        }
    }

    /// The blobs holding the chunks: the packs, or the referenced layer blobs (and the windows
    /// blob of a version-2 reference index).
    pub fn data_blobs(&self) -> Vec<Sha256Digest> {
        match self {
            Self::Packs(p) => p.packs().to_vec(),
            Self::Reference(r) => r
                .layers
                .iter()
                .map(|l| l.digest)
                .chain(r.windows.filter(|w| w.len > 0).map(|w| w.digest))
                .collect(),
        }
    }

    /// The blobs chunks are cut from: the packs, or the referenced layer blobs (not the windows).
    pub fn chunk_blobs(&self) -> usize {
        match self {
            Self::Packs(p) => p.packs().len(),
            Self::Reference(r) => r.layers.len(),
        }
    }

    /// Stored bytes of the indexed chunks (for a reference index, of the layer blobs).
    pub fn stored_bytes(&self) -> u64 {
        match self {
            Self::Packs(p) => p.stored_bytes(),
            Self::Reference(r) => r.layers.iter().map(|l| l.compressed_len).sum(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_lookup_and_spans() {
        let idx = RefIndex::example();
        let bytes = idx.encode();
        assert!(RefIndex::sniff(&bytes));
        let back = RefIndex::decode(&bytes).unwrap();
        assert_eq!(back, idx);
        let chunk = |name: &[u8], len| ChunkRef { id: ChunkId::of(name), len };
        assert_eq!(
            back.locate(&[chunk(b"b", 10_000)]),
            Ok(vec![RefLocation { layer: 0, offset: 10_000, len: 10_000 }])
        );
        assert!(back.locate(&[chunk(b"z", 1)]).is_err());
        assert!(back.locate(&[chunk(b"b", 9999)]).is_err(), "another length");
        let l = &back.layers[0];
        assert_eq!(l.spans_covering(0, 9000), Some((0, 0)));
        assert_eq!(l.spans_covering(8999, 2), Some((0, 1)));
        assert_eq!(l.spans_covering(19_999, 1), Some((1, 1)));
        assert_eq!(l.spans_covering(19_999, 2), None);
        assert_eq!(l.span_range(1), Some((9000, 20_000)));
        assert_eq!(l.checkpoints[1].start(), 2999);
        for cut in [0, 8, 12, 44, bytes.len() - 1] {
            assert!(RefIndex::decode(&bytes[..cut]).is_err(), "cut {cut}");
        }
    }

    #[test]
    fn version_2_keeps_windows_in_their_own_blob() {
        let v1 = RefIndex::example();
        let (v2, blob) = v1.clone().split_windows();
        let blob = blob.expect("the example has window bytes");
        assert_eq!(blob, b"window");
        assert_eq!(v2.windows, Some(WindowsBlob { digest: Sha256Digest::of(b"window"), len: 6 }));
        assert_eq!(
            v2.layers[0].checkpoints[1].window,
            Window::Stored { offset: 0, len: 6, digest: *blake3::hash(b"window").as_bytes() }
        );
        assert_eq!(v2.layers[0].checkpoints[0].window, Window::Stored { offset: 0, len: 0, digest: [0; 32] });
        let bytes = v2.encode();
        assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 2);
        assert_eq!(RefIndex::decode(&bytes).unwrap(), v2);
        assert_eq!(v2.window_bytes(), v1.window_bytes());
        assert!(AnyPackIndex::Reference(v2.clone()).data_blobs().contains(&Sha256Digest::of(b"window")));
        assert_eq!(v2.clone().split_windows().1, None, "already split");
        // Windows must be back to back and the blob's length their sum.
        let refuse = |f: &dyn Fn(&mut RefIndex)| {
            let mut i = v2.clone();
            f(&mut i);
            RefIndex::decode(&i.encode()).unwrap_err().to_string()
        };
        assert!(refuse(&|i| i.windows = Some(WindowsBlob { digest: Sha256Digest::of(b"x"), len: 7 }))
            .contains("windows"));
        assert!(refuse(
            &|i| i.layers[0].checkpoints[1].window = Window::Stored { offset: 1, len: 6, digest: [1; 32] }
        )
        .contains("back to back"));
        assert!(refuse(
            &|i| i.layers[1].checkpoints[0].window = Window::Stored { offset: 6, len: 0, digest: [1; 32] }
        )
        .contains("empty"));
        // A zstd layer: version 2 even without windows; its checkpoints have neither.
        let mut z = RefIndex::example();
        z.layers[1].codec = RefCodec::Zstd;
        z.layers[1].checkpoints[0].bits = 0;
        z.layers[0].checkpoints[1].window = Window::Inline(Vec::new());
        let (z2, blob) = z.clone().split_windows();
        assert_eq!(blob, None, "no window bytes: no windows blob");
        assert_eq!(z2.windows.map(|w| w.len), Some(0));
        assert_eq!(RefIndex::decode(&z2.encode()).unwrap(), z2);
        assert!(!AnyPackIndex::Reference(z2.clone()).data_blobs().contains(&z2.windows.unwrap().digest));
        let mut bad = z2.clone();
        bad.layers[1].checkpoints[0].bits = 3;
        assert!(RefIndex::decode(&bad.encode()).unwrap_err().to_string().contains("zstd checkpoint"));
        let mut next = bytes.clone();
        next[8] = 4;
        assert!(matches!(RefIndex::decode(&next), Err(DecodeError::UnsupportedVersion { version: 4, .. })));
    }

    #[test]
    fn strict_decoding() {
        let good = RefIndex::example();
        let refuse = |f: &dyn Fn(&mut RefIndex)| {
            let mut i = good.clone();
            f(&mut i);
            RefIndex::decode(&i.encode()).unwrap_err().to_string()
        };
        assert!(refuse(&|i| i.layers[0].checkpoints[1].bits = 8).contains("bits"));
        assert!(refuse(&|i| i.layers[0].checkpoints[1].out_offset = 0).contains("ascending"));
        assert!(refuse(&|i| i.layers[0].checkpoints[0].out_offset = 1).contains("offset 0"));
        assert!(refuse(&|i| i.layers[0].checkpoints[1].span_end = 6000).contains("span"));
        assert!(refuse(&|i| i.layers[1].checkpoints.clear()).contains("without checkpoints"));
        assert!(refuse(&|i| keyed(i)[0].1.layer = 2).contains("layer"));
        assert!(refuse(&|i| keyed(i)[0].1.offset = 19_000).contains("past"));
        assert!(refuse(&|i| keyed(i).swap(0, 1)).contains("ascending"));
        let mut bytes = good.encode();
        bytes[8] = 4;
        let e = RefIndex::decode(&bytes).unwrap_err();
        assert!(matches!(e, DecodeError::UnsupportedVersion { version: 4, .. }), "{e}");
        assert!(e.to_string().contains("unsupported reference pack index version 4"), "{e}");
        bytes[8] = 1;
        bytes.push(0);
        assert!(matches!(RefIndex::decode(&bytes), Err(DecodeError::TrailingBytes { .. })));
    }

    /// A keyed index's entries, to spoil.
    fn keyed(i: &mut RefIndex) -> &mut Vec<(ChunkId, RefLocation)> {
        match &mut i.entries {
            RefEntries::Keyed(k) => k,
            RefEntries::Aligned(_) => panic!("not a keyed index"),
        }
    }

    /// The example's chunks as an image record would list them: c, a, b.
    fn list() -> Vec<ChunkRef> {
        RefIndex::example_aligned().1
    }

    #[test]
    fn an_aligned_index_locates_the_record_s_list_as_the_keyed_one_does() {
        let keyed = RefIndex::example().split_windows().0;
        let want = keyed.locate(&list()).unwrap();
        let aligned = keyed.clone().align(&list()).unwrap();
        assert_eq!(aligned, RefIndex::example_aligned().0);
        assert_eq!(aligned.len(), 3);
        assert!(aligned.keyed_entries().is_empty());
        let bytes = aligned.encode();
        assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 3);
        let back = RefIndex::decode(&bytes).unwrap();
        assert_eq!(back, aligned);
        assert_eq!(back.encode(), bytes);
        assert_eq!(back.locate(&list()).unwrap(), want);
        // Entries: c starts layer 1 (code 2, offset 0), a goes back to layer 0 (code 1, 512 after
        // its start), b follows in layer 0 (code 0, 10 000 − 9 512 = 488 after a's end).
        assert_eq!(bytes[bytes.len() - 8..], [2, 0, 1, 0x80, 0x08, 0, 0xd0, 0x07]);
        assert!(bytes.len() + 3 * 48 - 8 == keyed.encode().len(), "8 bytes of entries instead of 144");
        // Another list, or lengths that do not fit the layers, are refused.
        assert!(back.locate(&list()[..2]).unwrap_err().contains("entries"), "a shorter list");
        let mut longer = list();
        longer[1].len = 15_000;
        assert!(back.locate(&longer).unwrap_err().contains("outside its layer"));
        // Aligning needs every chunk of the list, with its length.
        let mut other = list();
        other[0].len += 1;
        assert!(keyed.clone().align(&other).is_err());
        // Without window bytes, aligning gives an empty windows blob, and version 3 still.
        let bare = RefIndex::new(
            keyed.image,
            vec![RefIndex::example().layers[1].clone()],
            vec![(ChunkId::of(b"c"), RefLocation { layer: 0, offset: 0, len: 2048 })],
        );
        let bare = bare.align(&list()[..1]).unwrap();
        assert_eq!(bare.windows.map(|w| w.len), Some(0));
        assert_eq!(RefIndex::decode(&bare.encode()).unwrap(), bare);
        // Inline window bytes must be split first.
        assert!(RefIndex::example().align(&list()).is_err());
    }

    #[test]
    fn an_aligned_index_decodes_only_its_canonical_form() {
        let bytes = RefIndex::example().split_windows().0.align(&list()).unwrap().encode();
        let entries = bytes.len() - 8;
        let with = |tail: &[u8]| {
            let mut b = bytes[..entries].to_vec();
            b.extend_from_slice(tail);
            RefIndex::decode(&b)
        };
        assert!(with(&[2, 0, 1, 0x80, 0x08, 0, 0xd0, 0x07]).is_ok());
        // The second entry's layer 0 written as code 0 would be layer 1, the previous one's: so
        // "layer 1" spelled as code 2 after layer 1 is not canonical.
        assert!(with(&[2, 0, 2, 0x80, 0x08, 0, 0xd0, 0x07]).unwrap_err().to_string().contains("previous"));
        assert!(with(&[3, 0, 1, 0x80, 0x08, 0, 0xd0, 0x07])
            .unwrap_err()
            .to_string()
            .contains("out of range"));
        assert!(with(&[2, 0, 1, 0x80, 0x88, 0, 0, 0xd0, 0x07]).is_err(), "a varint not in its shortest form");
        assert!(with(&[2, 0, 1, 0x80, 0x08, 0, 0xd0]).is_err(), "cut short");
        assert!(with(&[2, 0, 1, 0x80, 0x08, 0, 0xd0, 0x07, 0]).is_err(), "a trailing byte");
        for v in [0, 1, -1, 2, -2, i64::MAX, i64::MIN] {
            assert_eq!(unzigzag(zigzag(v)), v);
        }
        assert_eq!((zigzag(0), zigzag(-1), zigzag(1), zigzag(-2)), (0, 1, 2, 3));
    }
}
