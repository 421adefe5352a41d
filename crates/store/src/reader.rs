//! The image read path: open an image (verify its parts), then read device bytes.
//!
//! `tessera export` uses it today; the daemon reuses it. Every byte handed out is either zeros
//! (unmapped blocks), bytes of the verified metadata prefix, or bytes of a chunk whose blake3 has
//! just been checked against its [`ChunkId`]. A chunk that fails verification is an error, never
//! wrong bytes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tessera_image::{
    ChunkId, ChunkRef, Compression, ImageEntry, ImageId, ImageRecord, PackIndexBlob, PackLocation, RefIndex,
    Segment, SegmentSource, Sha256Digest, BLOCK_SIZE,
};
use tracing::{debug, trace, warn};

use crate::error::StoreError;
use crate::local::LocalStore;
use crate::prefix::PrefixBuf;
use crate::reference::{fetch_reference_chunk, RefImage, SpanCache, DEFAULT_SPAN_CACHE};
use crate::source::{ChunkSource, SourcedChunk};

/// Largest chunk the reader accepts (chunk sizes go up to 16 MiB; this leaves room and stops a
/// hostile pack index from making us allocate gigabytes).
pub const MAX_CHUNK_LEN: u32 = 64 << 20;

/// Decompressed chunks kept by an [`ImageReader`] unless told otherwise.
pub const DEFAULT_CHUNK_CACHE: usize = 16;

/// An image whose entry, record, prefix and pack index have been loaded and checked against each
/// other. Holds the uncompressed metadata prefix in memory.
#[derive(Debug)]
pub struct OpenImage {
    id: ImageId,
    entry: ImageEntry,
    record: ImageRecord,
    prefix: PrefixBuf,
    /// The packs the pack index names, in its order (empty for a `--reference-layers` image).
    packs: Vec<Sha256Digest>,
    /// Pack and location of each BlockMap chunk, by chunk index.
    locations: Vec<(Sha256Digest, PackLocation)>,
    /// BlockMap chunk index of each chunk id (its first use), built on first need.
    index_of: OnceLock<HashMap<ChunkId, u32>>,
    /// For a `--reference-layers` image: its reference pack index (then `packs` is empty
    /// and `locations` give each chunk's first span range in its layer blob).
    reference: Option<RefImage>,
}

/// A decoded pack index: of packs, or (a `--reference-layers` image) of spans of the source
/// image's layer blobs.
pub(crate) enum Index {
    Packs(PackIndexBlob),
    Reference(RefIndex),
}

/// One piece of a read, in device order ([`OpenImage::walk`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece<'a> {
    /// These bytes (of the metadata prefix or of a verified chunk).
    Bytes(&'a [u8]),
    /// This many zero bytes (unmapped blocks, or past a chunk's end).
    Zeros(u64),
}

impl Piece<'_> {
    /// Bytes this piece covers.
    pub fn len(&self) -> u64 {
        match self {
            Piece::Bytes(b) => b.len() as u64,
            Piece::Zeros(n) => *n,
        }
    }

    /// Whether it covers no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The outcome of a walk over device bytes ([`OpenImage::walk`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Visit {
    /// Every byte went out.
    Done,
    /// A chunk was not at hand (the chunk function said so): a prefix of the range went out;
    /// walk again once it is.
    Missing,
}

/// The image itself could not serve a read at `offset`: the range is outside the device, or
/// the record's plan disagrees with the prefix it holds.
#[derive(Debug, thiserror::Error)]
#[error("reading the image at byte {offset}")]
pub struct ReadAt {
    pub offset: u64,
    #[source]
    pub source: StoreError,
}

impl From<ReadAt> for StoreError {
    fn from(e: ReadAt) -> Self {
        e.source
    }
}

impl OpenImage {
    /// Load image `id` from a local store and check it: the record hashes to the ID, the prefix
    /// decompresses to `prefix.blocks × 4096` bytes with the recorded sha256, every chunk of the
    /// BlockMap is in the pack index with the same length, and every pack exists and is long
    /// enough for the chunks it holds.
    pub fn open(store: &LocalStore, id: &ImageId) -> Result<Self, StoreError> {
        let entry = store.get_entry(id)?;
        if entry.record != id.digest() {
            return Err(Self::wrong_record(id, &entry));
        }
        let record = store.read_blob_as(&entry.record, "image record")?;
        let prefix = store.read_blob_as(&entry.prefix, "metadata prefix")?;
        let pack_index = store.read_blob_as(&entry.pack_index, "pack index")?;
        let image = Self::assemble(*id, entry, &record, &prefix, &pack_index)?;
        if let Some(r) = &image.reference {
            let layers = r.index.layers.iter().map(|l| ("layer", l.digest, l.compressed_len));
            let windows = r.index.windows.filter(|w| w.len > 0).map(|w| ("windows", w.digest, w.len));
            for (what, digest, expected) in layers.chain(windows) {
                let len = store.blob_len(&digest)?;
                if len != expected {
                    return Err(inconsistent(
                        id,
                        format!("{what} blob {digest} has {len} bytes, its reference index says {expected}"),
                    ));
                }
            }
            debug!(image = %id, chunks = image.locations.len(), "opened reference image");
            return Ok(image);
        }
        let mut needed: std::collections::HashMap<Sha256Digest, u64> = Default::default();
        for (pack, loc) in &image.locations {
            let end = loc.offset.saturating_add(u64::from(loc.stored_len));
            let e = needed.entry(*pack).or_default();
            *e = (*e).max(end);
        }
        for (pack, end) in needed {
            let len = store.blob_len(&pack)?;
            if len < end {
                return Err(inconsistent(id, format!("pack {pack} has {len} bytes, chunks need {end}")));
            }
        }
        debug!(image = %id, chunks = image.locations.len(), "opened image");
        Ok(image)
    }

    /// Check and assemble an image from the raw bytes of its blobs, however they were fetched:
    /// each blob is verified against the digest the entry names, then as in [`Self::open`]
    /// (except the pack existence check, which needs the store).
    pub fn from_parts(
        id: ImageId,
        entry: ImageEntry,
        record: &[u8],
        prefix_compressed: &[u8],
        pack_index: &[u8],
    ) -> Result<Self, StoreError> {
        for (what, digest, bytes) in [
            ("image record", entry.record, record),
            ("metadata prefix", entry.prefix, prefix_compressed),
            ("pack index", entry.pack_index, pack_index),
        ] {
            let actual = Sha256Digest::of(bytes);
            if actual != digest {
                return Err(StoreError::Corrupt {
                    what,
                    digest,
                    path: Default::default(),
                    reason: format!("its content hashes to {actual}"),
                });
            }
        }
        Self::assemble(id, entry, record, prefix_compressed, pack_index)
    }

    /// Decode and cross-check parts whose blob digests are already verified.
    fn assemble(
        id: ImageId,
        entry: ImageEntry,
        record_bytes: &[u8],
        prefix_compressed: &[u8],
        pack_index_bytes: &[u8],
    ) -> Result<Self, StoreError> {
        let record = Self::decode_record(&id, record_bytes)?;
        let prefix = Self::decode_prefix(
            &entry.prefix,
            prefix_compressed,
            record.prefix.blocks,
            &record.prefix.digest,
        )?;
        let index = Self::decode_index(&entry.pack_index, pack_index_bytes)?;
        Self::join(id, entry, record, prefix, index)
    }

    /// The image record of image `id`, from its verified blob (whose digest is the ID).
    pub(crate) fn decode_record(id: &ImageId, bytes: &[u8]) -> Result<ImageRecord, StoreError> {
        ImageRecord::decode(bytes).map_err(|source| StoreError::Decode {
            what: "image record",
            digest: id.digest(),
            source,
        })
    }

    /// The metadata prefix from its verified compressed blob `stored`: `blocks` blocks whose
    /// sha256 is `digest` (the record's), or [`StoreError::Corrupt`].
    pub(crate) fn decode_prefix(
        stored: &Sha256Digest,
        compressed: &[u8],
        blocks: u64,
        digest: &Sha256Digest,
    ) -> Result<PrefixBuf, StoreError> {
        let made = crate::prefix::decompress(compressed, Self::prefix_len(stored, blocks)?);
        Self::check_prefix(stored, made, digest)
    }

    /// The length of a prefix of `blocks` blocks (the record's word) stored as blob `stored`.
    pub(crate) fn prefix_len(stored: &Sha256Digest, blocks: u64) -> Result<u64, StoreError> {
        blocks.checked_mul(u64::from(BLOCK_SIZE)).ok_or_else(|| {
            prefix_corrupt(stored, format!("the record's prefix of {blocks} blocks is too large"))
        })
    }

    /// The prefix decompressed from blob `stored`, if it hashes to `digest` (the record's).
    pub(crate) fn check_prefix(
        stored: &Sha256Digest,
        made: Result<(PrefixBuf, Sha256Digest), crate::prefix::InflateError>,
        digest: &Sha256Digest,
    ) -> Result<PrefixBuf, StoreError> {
        let (prefix, actual) = made.map_err(|e| prefix_error(stored, e))?;
        if actual != *digest {
            let reason = format!("uncompressed it hashes to {actual}, the record says {digest}");
            return Err(prefix_corrupt(stored, reason));
        }
        Ok(prefix)
    }

    /// The pack index (or a `--reference-layers` image's reference pack index) from its
    /// verified blob.
    pub(crate) fn decode_index(digest: &Sha256Digest, bytes: &[u8]) -> Result<Index, StoreError> {
        if RefIndex::sniff(bytes) {
            return RefIndex::decode(bytes).map(Index::Reference).map_err(|source| StoreError::Decode {
                what: "reference pack index",
                digest: *digest,
                source,
            });
        }
        PackIndexBlob::decode(bytes).map(Index::Packs).map_err(|source| StoreError::Decode {
            what: "pack index",
            digest: *digest,
            source,
        })
    }

    /// Cross-check the decoded parts: the entry names the record, and every chunk of the
    /// BlockMap is in the index with the record's length.
    /// The error of an entry that names another record than image `id`'s.
    pub(crate) fn wrong_record(id: &ImageId, entry: &ImageEntry) -> StoreError {
        inconsistent(id, format!("the entry names record {}", entry.record))
    }

    pub(crate) fn join(
        id: ImageId,
        entry: ImageEntry,
        record: ImageRecord,
        prefix: PrefixBuf,
        index: Index,
    ) -> Result<Self, StoreError> {
        if entry.record != id.digest() {
            return Err(Self::wrong_record(&id, &entry));
        }
        let pack_index = match index {
            Index::Packs(p) => p,
            Index::Reference(r) => return Self::assemble_reference(id, entry, record, prefix, r),
        };
        let locations =
            pack_index.locate(record.block_map.chunks()).map_err(|e| inconsistent(&id, e.to_string()))?;
        for (i, (c, (_, loc))) in record.block_map.chunks().iter().zip(&locations).enumerate() {
            if c.len > MAX_CHUNK_LEN || loc.stored_len > MAX_CHUNK_LEN {
                return Err(inconsistent(
                    &id,
                    format!("chunk #{i} {} is larger than {MAX_CHUNK_LEN} bytes", c.id),
                ));
            }
        }
        Ok(Self {
            id,
            entry,
            record,
            prefix,
            packs: pack_index.packs().to_vec(),
            locations,
            index_of: OnceLock::new(),
            reference: None,
        })
    }

    /// [`Self::assemble`] for a `--reference-layers` image: its reference pack index must name
    /// this image and hold every chunk with its length.
    fn assemble_reference(
        id: ImageId,
        entry: ImageEntry,
        record: ImageRecord,
        prefix: PrefixBuf,
        index: RefIndex,
    ) -> Result<Self, StoreError> {
        let reference =
            RefImage::new(&id, index, record.block_map.chunks()).map_err(|r| inconsistent(&id, r))?;
        let mut locations = Vec::with_capacity(reference.chunks.len());
        for (i, c) in record.block_map.chunks().iter().enumerate() {
            let place = u32::try_from(i).ok().and_then(|i| reference.locate(i)).and_then(|(layer, loc)| {
                let (first, last) = layer.spans_covering(loc.offset, u64::from(loc.len))?;
                let start = layer.checkpoints.get(first)?.start();
                let end = layer.checkpoints.get(last)?.span_end;
                let stored_len = u32::try_from(end - start).unwrap_or(u32::MAX);
                Some((
                    layer.digest,
                    PackLocation {
                        pack: loc.layer,
                        offset: start,
                        stored_len,
                        raw_len: c.len,
                        compression: Compression::None,
                    },
                ))
            });
            locations
                .push(place.ok_or_else(|| inconsistent(&id, format!("chunk #{i} {} has no span", c.id)))?);
        }
        Ok(Self {
            id,
            entry,
            record,
            prefix,
            packs: Vec::new(),
            locations,
            index_of: OnceLock::new(),
            reference: Some(reference),
        })
    }

    /// The reference pack index, for a `--reference-layers` image.
    pub fn reference(&self) -> Option<&RefImage> {
        self.reference.as_ref()
    }

    /// The image ID.
    pub fn id(&self) -> &ImageId {
        &self.id
    }

    /// The image entry.
    pub fn entry(&self) -> &ImageEntry {
        &self.entry
    }

    /// The decoded image record.
    pub fn record(&self) -> &ImageRecord {
        &self.record
    }

    /// The uncompressed metadata prefix.
    pub fn prefix(&self) -> &[u8] {
        &self.prefix
    }

    /// The packs its pack index names, in the index's order.
    pub fn packs(&self) -> &[Sha256Digest] {
        &self.packs
    }

    /// Device size in bytes.
    pub fn device_bytes(&self) -> u64 {
        self.record.block_map.device_bytes()
    }

    /// Where BlockMap chunk `index` is stored.
    pub fn chunk_location(&self, index: u32) -> Option<(ChunkRef, Sha256Digest, PackLocation)> {
        let c = *self.record.block_map.chunks().get(index as usize)?;
        let (pack, loc) = *self.locations.get(index as usize)?;
        Some((c, pack, loc))
    }
}

impl OpenImage {
    /// The BlockMap index of chunk `id` (its first use, when the image holds it several times).
    pub fn chunk_index(&self, id: &ChunkId) -> Option<u32> {
        self.index_of
            .get_or_init(|| {
                let mut map = HashMap::with_capacity(self.record.block_map.chunks().len());
                for (i, c) in self.record.block_map.chunks().iter().enumerate() {
                    if let Ok(i) = u32::try_from(i) {
                        map.entry(c.id).or_insert(i);
                    }
                }
                map
            })
            .get(id)
            .copied()
    }

    /// The read path's one segment walk: hand the device bytes `[offset, offset + len)` to
    /// `out` in order — zeros for unmapped blocks, bytes of the metadata prefix, and bytes of
    /// the chunks `chunk(index, device_offset)` supplies (verified, uncompressed; bytes a
    /// segment wants past a chunk's end read as zeros). When `chunk` returns `None` the walk
    /// stops with [`Visit::Missing`] (`out` has then had a prefix of the range, possibly empty).
    ///
    /// A read of several segments asks `chunk` for all its chunks first, then looks at them
    /// all, then copies: a chunk's bytes sit behind a pointer to a buffer header, and the
    /// copies stream through the caches, so a header looked up right before its own copy is a
    /// cache miss each time, one after the other (perf: 6.5% of a warm 1 MiB read's CPU on that
    /// one load); looked up back to back, the misses overlap. The same holds for the bytes: the
    /// copy of each chunk piece goes with a prefetch of the pieces a few ahead ([`PREFETCH_AHEAD`]).
    pub fn walk<E: From<ReadAt>, C: std::ops::Deref<Target = [u8]>>(
        &self,
        offset: u64,
        len: u64,
        mut chunk: impl FnMut(u32, u64) -> Result<Option<C>, E>,
        mut out: impl FnMut(Piece<'_>) -> Result<(), E>,
    ) -> Result<Visit, E> {
        let mut plan = self
            .record
            .block_map
            .plan(offset, len)
            .map_err(|e| ReadAt { offset, source: StoreError::OutOfRange(e) })?;
        let Some(first) = plan.next() else { return Ok(Visit::Done) };
        let Some(second) = plan.next() else {
            // One segment (most small reads): nothing to overlap.
            let data = match first.source {
                SegmentSource::Chunk { chunk: index, .. } => match chunk(index, offset)? {
                    Some(d) => Some(d),
                    None => return Ok(Visit::Missing),
                },
                _ => None,
            };
            self.emit(offset, &first, data.as_deref(), &mut out)?;
            return Ok(Visit::Done);
        };
        let segments: Vec<Segment> = [first, second].into_iter().chain(plan).collect();
        // Every chunk held first (each lookup may take a lock, which orders memory accesses),
        // then every header read back to back, then the copies.
        let mut held = Vec::with_capacity(segments.len());
        let mut at = offset;
        for seg in &segments {
            if let SegmentSource::Chunk { chunk: index, .. } = seg.source {
                match chunk(index, at)? {
                    Some(d) => held.push(d),
                    None => return Ok(Visit::Missing),
                }
            }
            at += seg.len;
        }
        let bytes: Vec<&[u8]> = held.iter().map(|d| &d[..]).collect();
        // The bytes each chunk segment copies, prefetched a few segments ahead of their copy
        // (the first one's copy starts at once: nothing to win there).
        let mut ahead = segments
            .iter()
            .filter_map(|s| match s.source {
                SegmentSource::Chunk { offset: within, .. } => Some((within, s.len)),
                _ => None,
            })
            .zip(bytes.iter())
            .map(|((within, len), data)| chunk_piece(data, within, len));
        ahead.next();
        for piece in ahead.by_ref().take(PREFETCH_AHEAD) {
            prefetch(piece);
        }
        let mut bytes = bytes.iter();
        let mut at = offset;
        for seg in &segments {
            let data = match seg.source {
                SegmentSource::Chunk { .. } => {
                    if let Some(piece) = ahead.next() {
                        prefetch(piece);
                    }
                    bytes.next().copied()
                }
                _ => None,
            };
            self.emit(at, seg, data, &mut out)?;
            at += seg.len;
        }
        Ok(Visit::Done)
    }

    /// Hand segment `seg` (at device offset `at`) to `out`; `data`: its chunk's bytes, for a
    /// chunk segment.
    fn emit<E: From<ReadAt>>(
        &self,
        at: u64,
        seg: &Segment,
        data: Option<&[u8]>,
        out: &mut impl FnMut(Piece<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        match (seg.source, data) {
            (SegmentSource::Zero, _) => out(Piece::Zeros(seg.len)),
            (SegmentSource::Prefix { offset: p }, _) => {
                let bytes = usize::try_from(p)
                    .ok()
                    .zip(usize::try_from(seg.len).ok())
                    .and_then(|(p, n)| self.prefix.get(p..p.checked_add(n)?));
                let Some(bytes) = bytes else {
                    let reason = format!("prefix read {p}+{} out of bounds", seg.len);
                    return Err(ReadAt { offset: at, source: inconsistent(&self.id, reason) }.into());
                };
                out(Piece::Bytes(bytes))
            }
            (SegmentSource::Chunk { offset: within, .. }, Some(data)) => {
                let piece = chunk_piece(data, within, seg.len);
                if !piece.is_empty() {
                    out(Piece::Bytes(piece))?;
                }
                if (piece.len() as u64) < seg.len {
                    out(Piece::Zeros(seg.len - piece.len() as u64))?;
                }
                Ok(())
            }
            (SegmentSource::Chunk { .. }, None) => {
                let reason = "a chunk segment without its chunk".to_owned();
                Err(ReadAt { offset: at, source: inconsistent(&self.id, reason) }.into())
            }
        }
    }
}

/// The bytes of chunk `data` a segment reading `len` bytes from `within` copies (what lies past
/// the chunk's end reads as zeros).
fn chunk_piece(data: &[u8], within: u64, len: u64) -> &[u8] {
    let start = usize::try_from(within).unwrap_or(usize::MAX).min(data.len());
    let avail = (data.len() - start).min(usize::try_from(len).unwrap_or(usize::MAX));
    &data[start..start + avail]
}

/// How many chunk segments ahead of the one being copied [`OpenImage::walk`] prefetches.
///
/// A warm read of many small files is a copy per file (a 1 MiB read of the bench's data region
/// copies from ~60 chunk buffers, most of them a few KiB), each from its own buffer, so each
/// starts with a cache miss the hardware prefetcher cannot foresee, and a copy of 2 KiB from
/// memory costs about as much as its latency. Asked for a few pieces ahead, those misses overlap
/// the copies before them: a warm 1 MiB QD8 read +10–16 % (docs/benchmarks.md, "Small copies
/// prefetched"); 2 to 8 pieces ahead and 1 to 4 KiB per piece measured alike.
const PREFETCH_AHEAD: usize = 4;
/// At most this many leading bytes of a piece are prefetched (beyond them the hardware
/// prefetcher has caught on).
const PREFETCH_MAX: usize = 4096;

/// Ask the CPU to bring the first [`PREFETCH_MAX`] bytes of `piece` into the cache.
#[inline]
#[allow(unsafe_code)]
fn prefetch(piece: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        for line in piece[..piece.len().min(PREFETCH_MAX)].chunks(64) {
            // SAFETY: a prefetch reads nothing the program sees and cannot fault; `sse` is part of
            // every x86-64 target.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = piece;
}

/// The prefix stored as blob `stored` is not what the record says.
pub(crate) fn prefix_corrupt(stored: &Sha256Digest, reason: String) -> StoreError {
    StoreError::Corrupt { what: "metadata prefix", digest: *stored, path: Default::default(), reason }
}

/// Why the prefix stored as blob `stored` could not be made: corrupt, or no memory for it.
pub(crate) fn prefix_error(stored: &Sha256Digest, e: crate::prefix::InflateError) -> StoreError {
    match e {
        crate::prefix::InflateError::Corrupt(reason) => prefix_corrupt(stored, reason),
        crate::prefix::InflateError::Memory { source, .. } => {
            StoreError::Io { op: "mapping memory for the metadata prefix", path: Default::default(), source }
        }
    }
}

fn inconsistent(id: &ImageId, reason: String) -> StoreError {
    StoreError::Inconsistent { image: *id, reason }
}

/// Decompress a zstd prefix, insisting on exactly `expected` bytes without trusting `expected`
/// for allocation (a lying record cannot make us allocate more than the data holds).
/// Copies of a chunk or span fetched at most when each fails verification: as many as the
/// transport's default attempts ([`tessera_transport::RetryPolicy`]), so a copy that arrives
/// corrupt costs what any other failed attempt costs. One refetch was not enough: with 5 % of the
/// answers corrupted in transit (the fault storm of `tests/tests/fault_storm.rs`) a chunk fails
/// two copies in a row once in 400, and `warm`, which did not refetch a chunk warmed alone at
/// all, failed under that storm ("3 of 96 chunks could not be warmed", docs/reliability.md).
pub const VERIFY_ATTEMPTS: u32 = 5;

/// The one refetch policy for chunks and checkpoint spans, wherever they are fetched (`serve`'s
/// read path, `warm`, `export`): bytes that fail verification (`first` is
/// [`StoreError::CorruptChunk`] or [`StoreError::CorruptSpan`]) are fetched again with `again`,
/// up to [`VERIFY_ATTEMPTS`] copies in all — a bit flipped in transit; a tier below drops a copy
/// that fails, so each new copy comes from the origin. If the last copy fails too, so does the
/// fetch: never wrong bytes. Any other outcome is returned as it is (a transport failure has
/// had its retries already).
pub fn refetch_if_corrupt<T>(
    first: Result<T, StoreError>,
    mut again: impl FnMut() -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let mut result = first;
    for copy in 2..=VERIFY_ATTEMPTS {
        match result {
            Err(e @ (StoreError::CorruptChunk { .. } | StoreError::CorruptSpan { .. })) => {
                if copy == 2 {
                    warn!(
                        error = &e as &dyn std::error::Error,
                        "chunk failed verification; fetching it again"
                    );
                } else {
                    debug!(copy, error = &e as &dyn std::error::Error, "chunk failed verification again");
                }
                result = again();
            }
            other => return other,
        }
    }
    result
}

thread_local! {
    /// This thread's zstd decompression context, reused: creating one per chunk (what
    /// `zstd::bulk::decompress` does) allocates and clears its tables each time, a few percent of
    /// the daemon's CPU on a warm read path.
    static DECOMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

/// `stored` (one zstd frame) decompressed, at most `capacity` bytes, with this thread's context.
fn zstd_decompress(stored: &[u8], capacity: usize) -> std::io::Result<Vec<u8>> {
    DECOMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        let d = match slot.as_mut() {
            Some(d) => d,
            None => slot.insert(zstd::bulk::Decompressor::new()?),
        };
        d.decompress(stored, capacity)
    })
}

/// Turn stored chunk bytes into verified uncompressed bytes: decompress per `loc.compression`,
/// check the length, check blake3 against the chunk id. Anything off is
/// [`StoreError::CorruptChunk`].
pub fn decode_stored_chunk(
    chunk: &ChunkRef,
    pack: &Sha256Digest,
    loc: &PackLocation,
    stored: &[u8],
) -> Result<Vec<u8>, StoreError> {
    let corrupt =
        |reason| StoreError::CorruptChunk { chunk: chunk.id, pack: *pack, offset: loc.offset, reason };
    if stored.len() as u64 != u64::from(loc.stored_len) {
        return Err(corrupt("the source returned the wrong number of bytes"));
    }
    let raw_len = loc.raw_len as usize;
    let data = match loc.compression {
        Compression::None => stored.to_vec(),
        Compression::Zstd => {
            zstd_decompress(stored, raw_len).map_err(|_| corrupt("the zstd frame does not decode"))?
        }
    };
    if data.len() != raw_len || loc.raw_len != chunk.len {
        return Err(corrupt("it decompresses to the wrong length"));
    }
    if !chunk.id.matches(&data) {
        return Err(corrupt("its blake3 does not match the chunk id"));
    }
    Ok(data)
}

/// Reads device bytes of an [`OpenImage`], fetching chunks from a [`ChunkSource`].
///
/// Keeps the last few decompressed chunks (a tiny LRU, [`DEFAULT_CHUNK_CACHE`] by default) so a
/// sequential read decompresses each chunk once. Safe to share between threads.
#[derive(Debug)]
pub struct ImageReader<S> {
    image: Arc<OpenImage>,
    source: Arc<S>,
    cache: Mutex<ChunkCache>,
    refetches: AtomicU64,
    /// Decoded spans of a reference image's layers.
    spans: Arc<SpanCache>,
}

impl<S> ImageReader<S> {
    /// A reader of `image` fetching chunks from `source`.
    pub fn new(image: impl Into<Arc<OpenImage>>, source: S) -> Self {
        Self {
            image: image.into(),
            source: Arc::new(source),
            cache: Mutex::new(ChunkCache::new(DEFAULT_CHUNK_CACHE)),
            refetches: AtomicU64::new(0),
            spans: Arc::new(SpanCache::new(DEFAULT_SPAN_CACHE, 0)),
        }
    }

    /// Keep up to `chunks` decompressed chunks (0 disables the cache).
    pub fn with_cache_capacity(self, chunks: usize) -> Self {
        Self { cache: Mutex::new(ChunkCache::new(chunks)), ..self }
    }

    /// Keep up to `bytes` of a reference image's fetched spans in their stored form (compressed
    /// bytes and window, about a third of a decoded span), so that a span whose decoded bytes
    /// were evicted is decoded again from memory, not fetched again — for a source whose reads
    /// cross a network: a reader of random files comes back to the same spans again and again
    /// (the lazy benchmark's whole-file workload fetched 219 of its 395 MiB two or more times
    /// without them). Default 0: none kept (a local store or a disk cache reads a span again
    /// cheaply).
    pub fn with_stored_spans(self, bytes: usize) -> Self {
        Self { spans: Arc::new(SpanCache::new(DEFAULT_SPAN_CACHE, bytes)), ..self }
    }

    /// Bytes of a reference image's checkpoint spans held in memory: decoded, and in their
    /// stored form (0 and 0 for any other image).
    pub fn span_bytes(&self) -> (u64, u64) {
        let (decoded, stored) = self.spans.held();
        (decoded as u64, stored as u64)
    }

    /// The image.
    pub fn image(&self) -> &OpenImage {
        &self.image
    }

    /// The open image, shared.
    pub fn shared_image(&self) -> &Arc<OpenImage> {
        &self.image
    }

    /// The chunk source.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// Device size in bytes.
    pub fn device_bytes(&self) -> u64 {
        self.image.device_bytes()
    }
}

impl<S: ChunkSource + 'static> ImageReader<S> {
    /// Fill `buf` with the device bytes at `offset`. Fails without partial results' meaning: on
    /// error the content of `buf` is unspecified.
    ///
    /// When the range needs several chunks that are not in the reader's cache, they are
    /// fetched together first ([`Self::fetch_chunks`]): a remote source reads near chunks of
    /// one pack in one request.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        let map = &self.image.record.block_map;
        let plan = map.plan(offset, buf.len() as u64).map_err(StoreError::OutOfRange)?;
        let mut wanted: Vec<u32> = plan
            .filter_map(|seg| match seg.source {
                SegmentSource::Chunk { chunk, .. } => Some(chunk),
                _ => None,
            })
            .collect();
        wanted.dedup();
        let prefetched: Vec<(u32, Arc<[u8]>)> = if wanted.len() > 1 {
            let missing: Vec<u32> = {
                let cache = self.lock_cache();
                wanted.into_iter().filter(|&i| !cache.contains(i)).collect()
            };
            if missing.len() > 1 {
                let (mut fetched, mut failed) = (Vec::with_capacity(missing.len()), None);
                self.fetch_chunks(&missing, &mut |k, data| match data {
                    Ok(data) => fetched.push((missing[k], data)),
                    Err(e) => drop(failed.get_or_insert(e)),
                });
                if let Some(e) = failed {
                    // The other holders of a shared error are gone: it is ours again.
                    return Err(unshare(e));
                }
                let mut cache = self.lock_cache();
                fetched
                    .into_iter()
                    .map(|(i, data)| {
                        let data: Arc<[u8]> = data.into();
                        cache.insert(i, Arc::clone(&data));
                        (i, data)
                    })
                    .collect()
            } else {
                Vec::new()
            }
        } else {
            Vec::new()
        };
        let mut pos = 0usize;
        let chunk = |index: u32, _at: u64| match prefetched.iter().find(|(i, _)| *i == index) {
            Some((_, d)) => Ok(Some(Arc::clone(d))),
            None => self.chunk(index).map(Some),
        };
        let image = self.image.id;
        self.image.walk(offset, buf.len() as u64, chunk, |piece| {
            let n = usize::try_from(piece.len()).ok().filter(|n| pos + n <= buf.len());
            let Some(n) = n else {
                return Err(inconsistent(&image, "the read plan overran the buffer".into()));
            };
            let out = &mut buf[pos..pos + n];
            match piece {
                Piece::Bytes(b) => out.copy_from_slice(b),
                Piece::Zeros(_) => out.fill(0),
            }
            pos += n;
            Ok(())
        })?;
        Ok(())
    }

    /// The verified, uncompressed bytes of BlockMap chunk `index` (through the reader's small
    /// cache; fetched with [`Self::fetch_chunk`] on a miss).
    pub fn chunk(&self, index: u32) -> Result<Arc<[u8]>, StoreError> {
        if let Some(hit) = self.lock_cache().get(index) {
            return Ok(hit);
        }
        let data: Arc<[u8]> = self.fetch_chunk(index)?.into();
        self.lock_cache().insert(index, Arc::clone(&data));
        Ok(data)
    }

    /// Fetch, decompress and verify chunk `index`, bypassing the cache. Bytes that fail
    /// verification are fetched once more (a bit flipped in transit; a tier below drops a copy
    /// that fails, so the second fetch reaches the origin); if they fail again the read fails —
    /// never wrong bytes. This is the read path's one refetch policy.
    pub fn fetch_chunk(&self, index: u32) -> Result<Vec<u8>, StoreError> {
        let first = self.fetch_once(index);
        self.refetch_if_corrupt(index, first)
    }

    /// One fetch and check of chunk `index`.
    fn fetch_once(&self, index: u32) -> Result<Vec<u8>, StoreError> {
        let (chunk, pack, loc) = self.locate(index)?;
        if let Some(r) = self.image.reference() {
            trace!(index, chunk = %chunk.id, layer = %pack, "fetch referenced chunk");
            return fetch_reference_chunk(&self.image, r, &chunk, index, &self.spans, &self.source);
        }
        trace!(index, chunk = %chunk.id, %pack, offset = loc.offset, len = loc.stored_len, "fetch chunk");
        match self.source.read_chunk(&chunk, &pack, &loc)? {
            SourcedChunk::Verified(data) => Ok(data),
            SourcedChunk::Stored(stored) => decode_stored_chunk(&chunk, &pack, &loc, &stored),
        }
    }

    /// [`refetch_if_corrupt`] for chunk `index`, counted in [`Self::refetches`].
    fn refetch_if_corrupt(
        &self,
        index: u32,
        first: Result<Vec<u8>, StoreError>,
    ) -> Result<Vec<u8>, StoreError> {
        refetch_if_corrupt(first, || {
            trace!(index, "refetching a chunk that failed verification");
            self.refetches.fetch_add(1, Ordering::Relaxed);
            self.fetch_once(index)
        })
    }

    /// Extra copies of chunks fetched because a copy failed verification.
    pub fn refetches(&self) -> u64 {
        self.refetches.load(Ordering::Relaxed)
    }

    /// Fetch, decompress and verify the chunks `indexes` (bypassing the cache), asking the
    /// source for the chunks of each pack in one call ([`ChunkSource::read_chunks`]: a disk cache
    /// hands over the data its checks decoded, nothing is decoded twice). Each chunk's outcome
    /// goes to `got` (with its position in `indexes`) as soon as it is known, each once, in any
    /// order: a chunk at the head of a long request is verified and handed over while the rest
    /// is on the wire. A request that fails fails the chunks of its pack not handed over by then
    /// (they share the error); a chunk failing verification is fetched once more, as in
    /// [`Self::fetch_chunk`], and fails alone.
    pub fn fetch_chunks(
        &self,
        indexes: &[u32],
        got: &mut dyn FnMut(usize, Result<Vec<u8>, Arc<StoreError>>),
    ) {
        if self.image.reference().is_some() {
            // Chunks of one span share its fetch through the span cache.
            for (k, &i) in indexes.iter().enumerate() {
                got(k, self.fetch_chunk(i).map_err(Arc::new));
            }
            return;
        }
        let mut located = Vec::with_capacity(indexes.len());
        for (k, &i) in indexes.iter().enumerate() {
            match self.locate(i) {
                Ok(place) => located.push((k, place)),
                Err(e) => got(k, Err(Arc::new(e))),
            }
        }
        let mut packs: Vec<Sha256Digest> = located.iter().map(|(_, (_, p, _))| *p).collect();
        packs.sort_unstable();
        packs.dedup();
        for pack in packs {
            let members: Vec<&(usize, (ChunkRef, Sha256Digest, PackLocation))> =
                located.iter().filter(|(_, (_, p, _))| *p == pack).collect();
            let chunks: Vec<(ChunkRef, PackLocation)> =
                members.iter().map(|(_, (chunk, _, loc))| (*chunk, *loc)).collect();
            trace!(%pack, chunks = chunks.len(), "fetch chunks");
            let mut handed = vec![false; members.len()];
            // Chunks whose copy failed verification: fetched again once the request is over (a
            // request inside another's answer could wait for a connection that answer holds).
            let mut corrupt = Vec::new();
            let read = self.source.read_chunks(&pack, &chunks, &mut |m, sourced| {
                let Some(&&(k, (ref chunk, ref pack, ref loc))) = members.get(m) else { return };
                if std::mem::replace(&mut handed[m], true) {
                    return;
                }
                let first = match sourced {
                    SourcedChunk::Verified(data) => Ok(data),
                    SourcedChunk::Stored(bytes) => decode_stored_chunk(chunk, pack, loc, &bytes),
                };
                match first {
                    Ok(data) => got(k, Ok(data)),
                    Err(e) => corrupt.push((k, e)),
                }
            });
            for (k, first) in corrupt {
                got(k, self.refetch_if_corrupt(indexes[k], Err(first)).map_err(Arc::new));
            }
            if handed.iter().all(|&h| h) {
                continue;
            }
            let e = Arc::new(match read {
                Err(e) => e,
                Ok(()) => {
                    inconsistent(&self.image.id, "the source handed over fewer chunks than asked".into())
                }
            });
            for (&&(k, _), handed) in members.iter().zip(&handed) {
                if !handed {
                    got(k, Err(Arc::clone(&e)));
                }
            }
        }
    }

    fn locate(&self, index: u32) -> Result<(ChunkRef, Sha256Digest, PackLocation), StoreError> {
        self.image
            .chunk_location(index)
            .ok_or_else(|| inconsistent(&self.image.id, format!("chunk #{index} is not in the block map")))
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, ChunkCache> {
        // The cache holds only verified data; a panic elsewhere cannot leave it inconsistent.
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// An error shared by the chunks of one request, as the caller's own (the last holder takes it;
/// one still shared elsewhere is described, its causes included).
fn unshare(e: Arc<StoreError>) -> StoreError {
    Arc::try_unwrap(e).unwrap_or_else(StoreError::Shared)
}

/// A tiny LRU of decompressed chunks: most recently used last.
#[derive(Debug)]
struct ChunkCache {
    capacity: usize,
    entries: Vec<(u32, Arc<[u8]>)>,
}

impl ChunkCache {
    fn new(capacity: usize) -> Self {
        Self { capacity, entries: Vec::with_capacity(capacity) }
    }

    fn contains(&self, index: u32) -> bool {
        self.entries.iter().any(|e| e.0 == index)
    }

    fn get(&mut self, index: u32) -> Option<Arc<[u8]>> {
        let i = self.entries.iter().rposition(|e| e.0 == index)?;
        let e = self.entries.remove(i);
        let data = Arc::clone(&e.1);
        self.entries.push(e);
        Some(data)
    }

    fn insert(&mut self, index: u32, data: Arc<[u8]>) {
        if self.capacity == 0 {
            return;
        }
        if let Some(i) = self.entries.iter().position(|e| e.0 == index) {
            self.entries.remove(i);
        } else if self.entries.len() >= self.capacity {
            self.entries.remove(0);
        }
        self.entries.push((index, data));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_least_recent() {
        let mut c = ChunkCache::new(2);
        c.insert(1, Arc::from(vec![1u8]));
        c.insert(2, Arc::from(vec![2u8]));
        assert!(c.get(1).is_some()); // 1 is now most recent
        c.insert(3, Arc::from(vec![3u8]));
        assert!(c.get(2).is_none());
        assert!(c.get(1).is_some());
        assert!(c.get(3).is_some());
        let mut off = ChunkCache::new(0);
        off.insert(1, Arc::from(vec![1u8]));
        assert!(off.get(1).is_none());
    }

    #[test]
    fn decode_stored_chunk_checks_everything() {
        let data = vec![7u8; 10_000];
        let chunk = ChunkRef { id: tessera_image::ChunkId::of(&data), len: 10_000 };
        let pack = Sha256Digest::of(b"pack");
        let z = zstd::bulk::compress(&data, 3).unwrap();
        let loc = PackLocation {
            pack: 0,
            offset: 0,
            stored_len: z.len() as u32,
            raw_len: 10_000,
            compression: Compression::Zstd,
        };
        assert_eq!(decode_stored_chunk(&chunk, &pack, &loc, &z).unwrap(), data);
        let raw = PackLocation { stored_len: 10_000, compression: Compression::None, ..loc };
        assert_eq!(decode_stored_chunk(&chunk, &pack, &raw, &data).unwrap(), data);
        let mut bad = data.clone();
        bad[5] = 8;
        assert!(matches!(
            decode_stored_chunk(&chunk, &pack, &raw, &bad),
            Err(StoreError::CorruptChunk { reason, .. }) if reason.contains("blake3")
        ));
        assert!(decode_stored_chunk(&chunk, &pack, &loc, &z[..z.len() - 1]).is_err());
        let mut zbad = z.clone();
        let n = zbad.len();
        zbad[n / 2] ^= 0xff;
        assert!(matches!(
            decode_stored_chunk(&chunk, &pack, &loc, &zbad),
            Err(StoreError::CorruptChunk { .. })
        ));
        // A frame that decodes to more than raw_len is refused, not truncated.
        let big = zstd::bulk::compress(&vec![7u8; 10_001], 3).unwrap();
        let loc_big = PackLocation { stored_len: big.len() as u32, ..loc };
        assert!(decode_stored_chunk(&chunk, &pack, &loc_big, &big).is_err());
    }
}
