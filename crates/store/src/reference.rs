//! Reading `--reference-layers` images: chunks whose bytes stay in the source image's gzip layer
//! blobs, decoded from checkpoint spans (`docs/formats/reference-index.md`).
//!
//! The unit fetched is a span: the compressed bytes `[start, span_end)` of one checkpoint, read as
//! a range of the layer blob through the image's [`crate::ChunkSource`], checked against the
//! span's blake3, then inflated from the checkpoint ([`tessera_gzip::inflate_span`]). A chunk is
//! cut from the decoded spans covering it and checked against its ChunkId like any chunk.

use std::sync::{Arc, Mutex};

use tessera_image::{ChunkRef, ImageId, RefIndex, RefLayer, RefLocation};
use tracing::warn;

use crate::error::StoreError;
use crate::reader::MAX_CHUNK_LEN;
use crate::source::ChunkSource;

/// Decoded spans kept by an [`crate::ImageReader`] of a reference image (about 1 MiB each).
pub const DEFAULT_SPAN_CACHE: usize = 6;

/// A reference image's index, with each BlockMap chunk's place resolved.
#[derive(Debug)]
pub struct RefImage {
    pub index: RefIndex,
    /// Per BlockMap chunk.
    pub chunks: Vec<RefLocation>,
}

impl RefImage {
    /// Check `index` against image `id` whose BlockMap chunks are `chunks`: the index names this
    /// image, holds every chunk with its length, and each chunk's spans are within the limits.
    pub fn new(id: &ImageId, index: RefIndex, chunks: &[ChunkRef]) -> Result<Self, String> {
        if index.image != *id {
            return Err(format!("its reference pack index belongs to image {}", index.image));
        }
        let mut locs = Vec::with_capacity(chunks.len());
        for (i, c) in chunks.iter().enumerate() {
            let loc = index
                .get(&c.id)
                .ok_or_else(|| format!("chunk #{i} {} is not in the reference index", c.id))?;
            if loc.len != c.len || c.len > MAX_CHUNK_LEN {
                return Err(format!(
                    "chunk #{i} {} is {} bytes, the reference index says {}",
                    c.id, c.len, loc.len
                ));
            }
            locs.push(loc);
        }
        for l in &index.layers {
            for k in 0..l.checkpoints.len() {
                let (s, e) = l.span_range(k).unwrap_or((0, 0));
                let cp = &l.checkpoints[k];
                if e - s > u64::from(MAX_CHUNK_LEN) || cp.span_end - cp.start() > u64::from(MAX_CHUNK_LEN) {
                    return Err(format!("layer {}: span {k} is larger than {MAX_CHUNK_LEN} bytes", l.digest));
                }
            }
        }
        Ok(Self { index, chunks: locs })
    }

    /// The layer of BlockMap chunk `index` and the chunk's place in it.
    pub fn locate(&self, index: u32) -> Option<(&RefLayer, RefLocation)> {
        let loc = *self.chunks.get(index as usize)?;
        Some((self.index.layers.get(loc.layer as usize)?, loc))
    }
}

/// Check and inflate span `k` of `layer` from its compressed bytes `stored`.
pub fn decode_span(layer: &RefLayer, k: usize, stored: &[u8]) -> Result<Vec<u8>, StoreError> {
    let cp = layer.checkpoints.get(k).ok_or_else(|| StoreError::CorruptSpan {
        layer: layer.digest,
        offset: 0,
        reason: format!("no checkpoint {k}"),
    })?;
    let corrupt = |reason: String| {
        warn!(
            layer = %layer.digest,
            offset = cp.start(),
            %reason,
            "a referenced layer blob does not match its checkpoint index (changed since the build?); failing the read"
        );
        StoreError::CorruptSpan { layer: layer.digest, offset: cp.start(), reason }
    };
    if stored.len() as u64 != cp.span_end - cp.start() {
        return Err(corrupt(format!(
            "the source returned {} bytes, the span has {}",
            stored.len(),
            cp.span_end - cp.start()
        )));
    }
    if blake3::hash(stored).as_bytes() != &cp.span_digest {
        return Err(corrupt("its blake3 does not match the checkpoint index".into()));
    }
    let (s, e) = layer.span_range(k).unwrap_or((0, 0));
    let window = if cp.window.is_empty() {
        Vec::new()
    } else {
        zstd::bulk::decompress(&cp.window, tessera_gzip::WINDOW)
            .map_err(|e| corrupt(format!("its checkpoint window does not decode: {e}")))?
    };
    tessera_gzip::inflate_span(stored, cp.bits, &window, e - s).map_err(|e| corrupt(e.to_string()))
}

/// Decoded spans, most recently used last, keyed by (layer, span).
type Spans = Vec<((u32, usize), Arc<[u8]>)>;

/// A tiny LRU of decoded spans, keyed by (layer, span).
#[derive(Debug)]
pub(crate) struct SpanCache {
    capacity: usize,
    entries: Mutex<Spans>,
}

impl SpanCache {
    pub(crate) fn new(capacity: usize) -> Self {
        Self { capacity, entries: Mutex::new(Vec::new()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Spans> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Span `k` of layer number `layer`, decoded (from the cache, else fetched from `source`).
    pub(crate) fn span(
        &self,
        source: &dyn ChunkSource,
        layer_no: u32,
        layer: &RefLayer,
        k: usize,
    ) -> Result<Arc<[u8]>, StoreError> {
        let key = (layer_no, k);
        {
            let mut e = self.lock();
            if let Some(i) = e.iter().position(|x| x.0 == key) {
                let hit = e.remove(i);
                let data = Arc::clone(&hit.1);
                e.push(hit);
                return Ok(data);
            }
        }
        let cp = layer.checkpoints.get(k).ok_or_else(|| StoreError::CorruptSpan {
            layer: layer.digest,
            offset: 0,
            reason: format!("no checkpoint {k}"),
        })?;
        let len = u32::try_from(cp.span_end - cp.start()).unwrap_or(u32::MAX);
        let stored = source.read_stored(&layer.digest, cp.start(), len)?;
        let data: Arc<[u8]> = decode_span(layer, k, &stored)?.into();
        if self.capacity > 0 {
            let mut e = self.lock();
            if e.len() >= self.capacity {
                e.remove(0);
            }
            e.push((key, Arc::clone(&data)));
        }
        Ok(data)
    }
}

/// The verified bytes of BlockMap chunk `index` of a reference image.
pub(crate) fn fetch_reference_chunk(
    image: &RefImage,
    chunk: &ChunkRef,
    index: u32,
    spans: &SpanCache,
    source: &dyn ChunkSource,
) -> Result<Vec<u8>, StoreError> {
    let (layer, loc) = image.locate(index).ok_or_else(|| StoreError::CorruptChunk {
        chunk: chunk.id,
        pack: tessera_image::Sha256Digest([0; 32]),
        offset: 0,
        reason: "the chunk has no place in the reference index",
    })?;
    let corrupt =
        |reason| StoreError::CorruptChunk { chunk: chunk.id, pack: layer.digest, offset: loc.offset, reason };
    let (first, last) = layer
        .spans_covering(loc.offset, u64::from(loc.len))
        .ok_or_else(|| corrupt("it lies outside its layer"))?;
    let mut out = Vec::with_capacity(loc.len as usize);
    for k in first..=last {
        let data = spans.span(source, loc.layer, layer, k)?;
        let (s, e) = layer.span_range(k).ok_or_else(|| corrupt("a span is missing"))?;
        let from = loc.offset.max(s) - s;
        let to = (loc.offset + u64::from(loc.len)).min(e) - s;
        let piece = usize::try_from(from)
            .ok()
            .zip(usize::try_from(to).ok())
            .and_then(|(a, b)| data.get(a..b))
            .ok_or_else(|| corrupt("a span decoded short"))?;
        out.extend_from_slice(piece);
    }
    if out.len() != loc.len as usize || !chunk.id.matches(&out) {
        return Err(corrupt("its blake3 does not match the chunk id"));
    }
    Ok(out)
}
