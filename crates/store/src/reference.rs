//! Reading `--reference-layers` images: chunks whose bytes stay in the source image's gzip layer
//! blobs, decoded from checkpoint spans (`docs/formats/reference-index.md`).
//!
//! The unit fetched is a span: the compressed bytes `[start, span_end)` of one checkpoint, read as
//! a range of the layer blob through the image's [`crate::ChunkSource`], checked against the
//! span's blake3, then inflated from the checkpoint ([`tessera_gzip::inflate_span`]). A chunk is
//! cut from the decoded spans covering it and checked against its ChunkId like any chunk.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};

use tessera_image::{ChunkRef, ImageId, RefCodec, RefIndex, RefLayer, RefLocation, Sha256Digest, Window};
use tracing::warn;

use crate::error::StoreError;
use crate::reader::MAX_CHUNK_LEN;
use crate::source::ChunkSource;

/// Bytes of decoded spans kept by an [`crate::ImageReader`] of a reference image (a span is about
/// 1 MiB: the builder's checkpoint spacing).
pub const DEFAULT_SPAN_CACHE: usize = 32 << 20;

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

/// Check and inflate span `k` of `layer` from its compressed bytes `stored` and its checkpoint's
/// stored window `window` (the inline one, or the bytes read from the windows blob).
pub fn decode_span(layer: &RefLayer, k: usize, stored: &[u8], window: &[u8]) -> Result<Vec<u8>, StoreError> {
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
    if layer.codec == RefCodec::Zstd {
        return tessera_gzip::decode_zstd_span(stored, e - s).map_err(|e| corrupt(e.to_string()));
    }
    let window = if window.is_empty() {
        Vec::new()
    } else {
        zstd::bulk::decompress(window, tessera_gzip::WINDOW)
            .map_err(|e| corrupt(format!("its checkpoint window does not decode: {e}")))?
    };
    tessera_gzip::inflate_span(stored, cp.bits, &window, e - s).map_err(|e| corrupt(e.to_string()))
}

/// The compressed bytes of span `k` of `layer` and its stored window, read from `source`: a
/// version-2 index's window (in the blob `windows`) is read at the same time as the span, on a
/// second thread, so it costs no round trip of its own; it is checked against its blake3.
pub fn read_span(
    source: &dyn ChunkSource,
    layer: &RefLayer,
    k: usize,
    windows: Option<&Sha256Digest>,
) -> Result<(Vec<u8>, Vec<u8>), StoreError> {
    let bad = |offset: u64, reason: String| StoreError::CorruptSpan { layer: layer.digest, offset, reason };
    let cp = layer.checkpoints.get(k).ok_or_else(|| bad(0, format!("no checkpoint {k}")))?;
    let len = u32::try_from(cp.span_end - cp.start()).unwrap_or(u32::MAX);
    let (offset, wlen, digest) = match &cp.window {
        Window::Inline(w) => return Ok((source.read_stored(&layer.digest, cp.start(), len)?, w.clone())),
        Window::Stored { len: 0, .. } => {
            return Ok((source.read_stored(&layer.digest, cp.start(), len)?, Vec::new()))
        }
        Window::Stored { offset, len, digest } => (*offset, *len, digest),
    };
    let blob = windows.ok_or_else(|| bad(cp.start(), "a stored window but no windows blob".into()))?;
    let (stored, window) = std::thread::scope(|scope| {
        let window = scope.spawn(|| source.read_stored(blob, offset, wlen));
        let stored = source.read_stored(&layer.digest, cp.start(), len);
        (stored, window.join())
    });
    let window = window.map_err(|_| bad(cp.start(), "the window reader panicked".into()))??;
    if blake3::hash(&window).as_bytes() != digest {
        warn!(windows = %blob, offset, "a checkpoint window does not match its blake3; failing the read");
        return Err(bad(
            cp.start(),
            format!("its window at {offset} of windows blob {blob} does not match its blake3"),
        ));
    }
    Ok((stored?, window))
}

/// (layer number, span number).
type SpanKey = (u32, usize);

/// Decoded spans, most recently used last, and the spans being fetched.
#[derive(Debug, Default)]
struct Spans {
    lru: Vec<(SpanKey, Arc<[u8]>)>,
    bytes: usize,
    inflight: HashMap<SpanKey, Arc<Flight>>,
}

/// One span being fetched and decoded: waiters sleep until it is done.
#[derive(Debug, Default)]
struct Flight {
    done: Mutex<bool>,
    cv: Condvar,
}

/// Decoded spans kept by bytes (least recently used out first), fetched **once** however many
/// readers want one at the same time: the first reader of a span fetches and decodes it, later
/// ones wait for it and take it from the cache. A span holds the bytes of several chunks, which
/// readahead asks for in parallel; each fetched and inflated the whole span before.
#[derive(Debug)]
pub(crate) struct SpanCache {
    capacity_bytes: usize,
    state: Mutex<Spans>,
}

/// Removes a flight and wakes its waiters however its leader leaves (a panic included).
struct Landing<'a> {
    cache: &'a SpanCache,
    key: SpanKey,
}

impl Drop for Landing<'_> {
    fn drop(&mut self) {
        let flight = self.cache.lock().inflight.remove(&self.key);
        if let Some(f) = flight {
            *f.done.lock().unwrap_or_else(|p| p.into_inner()) = true;
            f.cv.notify_all();
        }
    }
}

impl SpanCache {
    pub(crate) fn new(capacity_bytes: usize) -> Self {
        Self { capacity_bytes, state: Mutex::new(Spans::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Spans> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Span `key` from the cache, else from `load` — called by one reader at a time per span;
    /// the others wait for it. A failed load is not shared: its reader gets the error, and one of
    /// the waiters loads again (the others wait for that).
    pub(crate) fn get_or_load(
        &self,
        key: SpanKey,
        load: impl FnOnce() -> Result<Vec<u8>, StoreError>,
    ) -> Result<Arc<[u8]>, StoreError> {
        loop {
            let flight = {
                let mut s = self.lock();
                if let Some(i) = s.lru.iter().position(|x| x.0 == key) {
                    let hit = s.lru.remove(i);
                    let data = Arc::clone(&hit.1);
                    s.lru.push(hit);
                    return Ok(data);
                }
                match s.inflight.get(&key) {
                    Some(f) => Some(Arc::clone(f)),
                    None => {
                        s.inflight.insert(key, Arc::default());
                        None
                    }
                }
            };
            let Some(flight) = flight else { break };
            let mut done = flight.done.lock().unwrap_or_else(|p| p.into_inner());
            while !*done {
                done = flight.cv.wait(done).unwrap_or_else(|p| p.into_inner());
            }
        }
        let landing = Landing { cache: self, key };
        let data: Arc<[u8]> = load()?.into();
        {
            let mut s = self.lock();
            if data.len() <= self.capacity_bytes {
                while s.bytes + data.len() > self.capacity_bytes && !s.lru.is_empty() {
                    let (_, old) = s.lru.remove(0);
                    s.bytes -= old.len();
                }
                s.bytes += data.len();
                s.lru.push((key, Arc::clone(&data)));
            }
        }
        drop(landing);
        Ok(data)
    }

    /// Span `k` of layer number `layer`, decoded (from the cache, else fetched from `source`).
    pub(crate) fn span(
        &self,
        source: &dyn ChunkSource,
        layer_no: u32,
        layer: &RefLayer,
        k: usize,
        windows: Option<&Sha256Digest>,
    ) -> Result<Arc<[u8]>, StoreError> {
        self.get_or_load((layer_no, k), || {
            let (stored, window) = read_span(source, layer, k, windows)?;
            decode_span(layer, k, &stored, &window)
        })
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
        let data =
            spans.span(source, loc.layer, layer, k, image.index.windows.as_ref().map(|w| &w.digest))?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[test]
    fn one_load_per_span_however_many_readers_wait() {
        let cache = SpanCache::new(1 << 20);
        let loads = AtomicUsize::new(0);
        let got: Vec<Arc<[u8]>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        cache
                            .get_or_load((0, 7), || {
                                loads.fetch_add(1, Ordering::SeqCst);
                                std::thread::sleep(Duration::from_millis(100));
                                Ok(vec![7u8; 1000])
                            })
                            .unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(loads.load(Ordering::SeqCst), 1, "concurrent readers of one span load it once");
        assert!(got.iter().all(|d| d[..] == [7u8; 1000][..]));
        // Another span loads; the first stays cached.
        cache.get_or_load((0, 8), || Ok(vec![8u8; 1000])).unwrap();
        cache.get_or_load((0, 7), || panic!("cached")).unwrap();
    }

    #[test]
    fn a_failed_load_is_retried_by_a_waiter_and_the_cache_keeps_to_its_bytes() {
        let cache = SpanCache::new(2500);
        let loads = AtomicUsize::new(0);
        let results: Vec<bool> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        cache
                            .get_or_load((1, 1), || {
                                let n = loads.fetch_add(1, Ordering::SeqCst);
                                std::thread::sleep(Duration::from_millis(50));
                                if n == 0 {
                                    Err(StoreError::CorruptSpan {
                                        layer: tessera_image::Sha256Digest([0; 32]),
                                        offset: 0,
                                        reason: "injected".into(),
                                    })
                                } else {
                                    Ok(vec![1u8; 1000])
                                }
                            })
                            .is_ok()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(results.iter().filter(|ok| !**ok).count(), 1, "only the failed load's reader fails");
        assert_eq!(loads.load(Ordering::SeqCst), 2, "one waiter loads again, the rest share it");
        for k in 2..5 {
            cache.get_or_load((1, k), || Ok(vec![0u8; 1000])).unwrap();
        }
        let s = cache.lock();
        assert!(s.bytes <= 2500 && s.lru.len() == 2, "{} bytes in {} spans", s.bytes, s.lru.len());
        assert!(s.inflight.is_empty());
    }
}
