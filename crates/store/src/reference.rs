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
/// 512 KiB: the builder's checkpoint spacing).
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
        let locs = index.locate(chunks)?;
        if let Some((i, c)) = chunks.iter().enumerate().find(|(_, c)| c.len > MAX_CHUNK_LEN) {
            return Err(format!("chunk #{i} {} is larger than {MAX_CHUNK_LEN} bytes", c.id));
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

/// One span checked and decoded as its compressed bytes arrive: inflated as they come (so the
/// chunks at its start are readable before its end is in), hashed as they come, and judged
/// against the checkpoint index at the end. The bytes decoded before that judgement are
/// unchecked: a reader takes a chunk from them only if it hashes to its ChunkId.
struct SpanDecoder<'a> {
    layer: &'a RefLayer,
    k: usize,
    stored_len: u64,
    out_len: u64,
    received: u64,
    hasher: blake3::Hasher,
    codec: Codec,
    /// What came, kept as the span's stored form.
    stored: Stored,
}

/// A span's compressed bytes and its checkpoint's stored (zstd) window: what a span fetched
/// once is kept as (about a third of its decoded size) and decoded again from — checked again
/// against its blake3 — when its decoded bytes are gone.
#[derive(Debug, Default)]
pub(crate) struct Stored {
    bytes: Vec<u8>,
    window: Vec<u8>,
}

impl Stored {
    fn footprint(&self) -> usize {
        self.bytes.len() + self.window.len()
    }
}

enum Codec {
    /// The window is not in yet.
    Waiting,
    Gzip(tessera_gzip::SpanInflater),
    /// A zstd span is decoded whole at the end (frames are its unit).
    Zstd(Vec<u8>),
}

impl<'a> SpanDecoder<'a> {
    fn new(layer: &'a RefLayer, k: usize) -> Result<Self, StoreError> {
        let bad = |reason: String| StoreError::CorruptSpan { layer: layer.digest, offset: 0, reason };
        let cp = layer.checkpoints.get(k).ok_or_else(|| bad(format!("no checkpoint {k}")))?;
        let (s, e) = layer.span_range(k).ok_or_else(|| bad(format!("no span {k}")))?;
        let codec = if layer.codec == RefCodec::Zstd { Codec::Zstd(Vec::new()) } else { Codec::Waiting };
        Ok(Self {
            layer,
            k,
            stored_len: cp.span_end - cp.start(),
            out_len: e - s,
            received: 0,
            hasher: blake3::Hasher::new(),
            codec,
            stored: Stored::default(),
        })
    }

    fn corrupt(&self, reason: String) -> StoreError {
        let offset = self.layer.checkpoints.get(self.k).map_or(0, |c| c.start());
        warn!(
            layer = %self.layer.digest,
            offset,
            %reason,
            "a referenced layer blob does not match its checkpoint index (changed since the build?); failing the read"
        );
        StoreError::CorruptSpan { layer: self.layer.digest, offset, reason }
    }

    /// The span's next compressed bytes; `window` gives the checkpoint's stored window when the
    /// first bytes need it.
    fn push(
        &mut self,
        bytes: &[u8],
        window: impl FnOnce() -> Result<Vec<u8>, StoreError>,
    ) -> Result<(), StoreError> {
        self.received += bytes.len() as u64;
        if self.received > self.stored_len {
            return Err(
                self.corrupt(format!("the source returned more than the span's {} bytes", self.stored_len))
            );
        }
        self.hasher.update(bytes);
        self.stored.bytes.extend_from_slice(bytes);
        if let Codec::Waiting = self.codec {
            let window = window()?;
            self.stored.window.clone_from(&window);
            let window = if window.is_empty() {
                Vec::new()
            } else {
                zstd::bulk::decompress(&window, tessera_gzip::WINDOW)
                    .map_err(|e| self.corrupt(format!("its checkpoint window does not decode: {e}")))?
            };
            let bits = self.layer.checkpoints.get(self.k).map_or(0, |c| c.bits);
            let inflater = tessera_gzip::SpanInflater::new(bits, &window, self.out_len)
                .map_err(|e| self.corrupt(e.to_string()))?;
            self.codec = Codec::Gzip(inflater);
        }
        match &mut self.codec {
            Codec::Gzip(inflater) => {
                let pushed = inflater.push(bytes);
                pushed.map_err(|e| self.corrupt(e.to_string()))
            }
            Codec::Zstd(all) => {
                all.extend_from_slice(bytes);
                Ok(())
            }
            Codec::Waiting => Ok(()),
        }
    }

    /// The span's bytes decoded so far (unchecked until [`Self::finish`]).
    fn output(&self) -> &[u8] {
        match &self.codec {
            Codec::Gzip(inflater) => inflater.output(),
            Codec::Waiting | Codec::Zstd(_) => &[],
        }
    }

    /// The whole span, once its compressed bytes matched the checkpoint index, and its stored
    /// form.
    fn finish(mut self) -> Result<(Vec<u8>, Stored), StoreError> {
        if self.received != self.stored_len {
            return Err(self.corrupt(format!(
                "the source returned {} bytes, the span has {}",
                self.received, self.stored_len
            )));
        }
        let digest = self.layer.checkpoints.get(self.k).map(|c| c.span_digest);
        if digest.as_ref() != Some(self.hasher.finalize().as_bytes()) {
            return Err(self.corrupt("its blake3 does not match the checkpoint index".into()));
        }
        let codec = std::mem::replace(&mut self.codec, Codec::Waiting);
        let decoded = match codec {
            Codec::Gzip(inflater) => inflater.finish(),
            Codec::Zstd(ref all) => tessera_gzip::decode_zstd_span(all, self.out_len),
            Codec::Waiting if self.out_len == 0 => Ok(Vec::new()),
            // Only a span of no compressed bytes ends here, and its index says otherwise.
            Codec::Waiting => Err(tessera_gzip::GzipError::ShortSpan { got: 0, expected: self.out_len }),
        };
        let decoded = decoded.map_err(|e| self.corrupt(e.to_string()))?;
        Ok((decoded, std::mem::take(&mut self.stored)))
    }
}

/// Span `k` of `layer` fetched from `source` and decoded as it arrives, its decoded bytes handed
/// to `publish` as they come (a prefix that grows, each byte once); the whole span checked at the
/// end. A version-2 index's window (in the blob `windows`) is read at the same time as the span,
/// on a second thread, so it costs no round trip of its own; it is checked against its blake3.
/// With `stored` (the span's stored form, from an earlier fetch) nothing is read: the span is
/// decoded from it and checked again. Returns the span and its stored form.
pub(crate) fn stream_span(
    source: &dyn ChunkSource,
    layer: &RefLayer,
    k: usize,
    windows: Option<&Sha256Digest>,
    stored: Option<Arc<Stored>>,
    publish: &mut dyn FnMut(&[u8]),
) -> Result<(Vec<u8>, Arc<Stored>), StoreError> {
    let bad = |offset: u64, reason: String| StoreError::CorruptSpan { layer: layer.digest, offset, reason };
    let cp = layer.checkpoints.get(k).ok_or_else(|| bad(0, format!("no checkpoint {k}")))?;
    let len = u32::try_from(cp.span_end - cp.start()).unwrap_or(u32::MAX);
    let mut span = SpanDecoder::new(layer, k)?;
    if let Some(stored) = stored {
        span.push(&stored.bytes, || Ok(stored.window.clone()))?;
        publish(span.output());
        let (decoded, _) = span.finish()?;
        return Ok((decoded, stored));
    }
    let mut published = 0;
    // The span's next bytes, given its window once known.
    let mut feed = |span: &mut SpanDecoder<'_>, bytes: &[u8], window: &[u8]| {
        span.push(bytes, || Ok(window.to_vec()))?;
        let out = span.output();
        if out.len() > published {
            publish(&out[published..]);
            published = out.len();
        }
        Ok::<_, StoreError>(())
    };
    let (offset, wlen, digest) = match &cp.window {
        Window::Inline(w) => {
            source.read_stored_streamed(&layer.digest, cp.start(), len, &mut |bytes| {
                feed(&mut span, bytes, w)
            })?;
            let (decoded, stored) = span.finish()?;
            return Ok((decoded, Arc::new(stored)));
        }
        Window::Stored { offset, len, digest } => (*offset, *len, digest),
    };
    let read_window = || -> Result<Vec<u8>, StoreError> {
        if wlen == 0 {
            return Ok(Vec::new());
        }
        let blob = windows.ok_or_else(|| bad(cp.start(), "a stored window but no windows blob".into()))?;
        let window = source.read_stored(blob, offset, wlen)?;
        if blake3::hash(&window).as_bytes() != digest {
            warn!(windows = %blob, offset, "a checkpoint window does not match its blake3; failing the read");
            return Err(bad(
                cp.start(),
                format!("its window at {offset} of windows blob {blob} does not match its blake3"),
            ));
        }
        Ok(window)
    };
    let joined = |h: std::thread::ScopedJoinHandle<'_, Result<Vec<u8>, StoreError>>| {
        h.join().unwrap_or_else(|_| Err(bad(cp.start(), "the window reader panicked".into())))
    };
    std::thread::scope(|scope| {
        let mut pending = Some(scope.spawn(read_window));
        let mut window: Option<Vec<u8>> = None;
        // Bytes that came before the window: held, never waited for inside the read (it holds a
        // connection, and perhaps the origin's Range probe, that the window's read may need).
        let mut held = Vec::new();
        let streamed = source.read_stored_streamed(&layer.digest, cp.start(), len, &mut |bytes| {
            if window.is_none() && pending.as_ref().is_some_and(|h| h.is_finished()) {
                if let Some(h) = pending.take() {
                    window = Some(joined(h)?);
                }
            }
            match &window {
                Some(w) => {
                    if !held.is_empty() {
                        feed(&mut span, &std::mem::take(&mut held), w)?;
                    }
                    feed(&mut span, bytes, w)
                }
                None => {
                    held.extend_from_slice(bytes);
                    Ok(())
                }
            }
        });
        let waited = pending.take().map(joined);
        streamed?;
        if let Some(w) = waited {
            let w = w?;
            feed(&mut span, &std::mem::take(&mut held), &w)?;
        }
        Ok::<_, StoreError>(())
    })?;
    let (decoded, stored) = span.finish()?;
    Ok((decoded, Arc::new(stored)))
}

/// (layer number, span number).
type SpanKey = (u32, usize);

/// Span loads that run on threads of their own at most; beyond that, a reader that starts a
/// load runs it itself.
const MAX_DETACHED_LOADS: usize = 64;

/// A span load ([`stream_span`]): given the span's stored form if it has one, hands the span's
/// decoded bytes to its last argument as they come (a growing prefix, each byte once) and
/// returns the whole span, checked, and its stored form.
pub(crate) type SpanLoad = Box<
    dyn FnOnce(Option<Arc<Stored>>, &mut dyn FnMut(&[u8])) -> Result<(Vec<u8>, Arc<Stored>), StoreError>
        + Send,
>;

/// Decoded spans, most recently used last, and the spans being fetched.
#[derive(Debug, Default)]
struct Spans {
    lru: Vec<(SpanKey, Arc<[u8]>)>,
    bytes: usize,
    /// The stored forms of the spans fetched, most recently used last.
    stored: Vec<(SpanKey, Arc<Stored>)>,
    stored_bytes: usize,
    inflight: HashMap<SpanKey, Arc<Flight>>,
    /// Loads running on threads of their own.
    detached: usize,
}

/// One span being fetched and decoded: readers wait until the bytes they want are decoded.
#[derive(Debug, Default)]
struct Flight {
    progress: Mutex<Progress>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct Progress {
    /// The span's first bytes, decoded (unchecked until the load ends well).
    decoded: Vec<u8>,
    /// How the load ended: well (the whole span, checked; `decoded` is then dropped), or with an
    /// error for the reader that started it.
    end: Option<Result<Arc<[u8]>, Option<StoreError>>>,
}

/// Decoded spans kept by bytes (least recently used out first), fetched **once** however many
/// readers want one at the same time, and readable **as they arrive**: the first reader of a
/// span starts its load (on a thread of its own, [`MAX_DETACHED_LOADS`] at most), and every
/// reader — that one included — takes its bytes as soon as they are decoded, not when the whole
/// span is in. A span is about 512 KiB of a layer (150 KB compressed); a reader of a chunk at its
/// start waited for the whole span's transfer and inflation before.
#[derive(Debug)]
pub(crate) struct SpanCache {
    capacity_bytes: usize,
    stored_capacity: usize,
    state: Mutex<Spans>,
}

impl SpanCache {
    /// At most `capacity_bytes` of decoded spans and `stored_capacity` of stored forms.
    pub(crate) fn new(capacity_bytes: usize, stored_capacity: usize) -> Self {
        Self { capacity_bytes, stored_capacity, state: Mutex::new(Spans::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Spans> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes `[from, to)` of span `key`: from the cache, else from its load in flight as soon as
    /// they are decoded (`checked`: once the whole span is in and checked), else from a new load
    /// `load` (built only then). A failed load is not shared: the reader that started it gets the
    /// error, and a reader that was waiting for it loads again.
    pub(crate) fn bytes(
        self: &Arc<Self>,
        (key, layer): (SpanKey, Sha256Digest),
        (from, to): (usize, usize),
        checked: bool,
        load: impl Fn() -> SpanLoad,
    ) -> Result<Vec<u8>, StoreError> {
        let short = || StoreError::CorruptSpan {
            layer,
            offset: 0,
            reason: format!("span {key:?} decoded to fewer than {to} bytes"),
        };
        loop {
            let (flight, started) = {
                let mut s = self.lock();
                if let Some(i) = s.lru.iter().position(|x| x.0 == key) {
                    let hit = s.lru.remove(i);
                    let data = hit.1.get(from..to).map(<[u8]>::to_vec).ok_or_else(short);
                    s.lru.push(hit);
                    return data;
                }
                match s.inflight.get(&key) {
                    Some(f) => (Arc::clone(f), None),
                    None => {
                        let f = Arc::new(Flight::default());
                        s.inflight.insert(key, Arc::clone(&f));
                        let detach = s.detached < MAX_DETACHED_LOADS;
                        s.detached += usize::from(detach);
                        let stored = s.stored.iter().find(|x| x.0 == key).map(|x| Arc::clone(&x.1));
                        (f, Some((detach, stored)))
                    }
                }
            };
            let first = started.is_some();
            if let Some((detach, stored)) = started {
                if detach {
                    self.detach((key, layer), &flight, &load, stored);
                } else {
                    self.run((key, layer), &flight, load(), stored, false);
                }
            }
            let mut p = flight.progress.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if !checked && p.decoded.len() >= to {
                    return p.decoded.get(from..to).map(<[u8]>::to_vec).ok_or_else(short);
                }
                match &mut p.end {
                    None => p = flight.cv.wait(p).unwrap_or_else(|p| p.into_inner()),
                    Some(Ok(whole)) => return whole.get(from..to).map(<[u8]>::to_vec).ok_or_else(short),
                    Some(Err(e)) if first => {
                        return Err(e.take().unwrap_or_else(short));
                    }
                    // Another reader's load failed: load again (or wait for whoever does).
                    Some(Err(_)) => break,
                }
            }
        }
    }

    /// Start the load of span `key` on a thread of its own, unless the span is cached, in flight,
    /// or every detached load is taken: a reader that needs several spans starts them all
    /// before it waits for its first ([`Self::bytes`] then finds them in flight). The load's
    /// error, if any, is for no one: a reader finding it loads the span again.
    pub(crate) fn start(
        self: &Arc<Self>,
        (key, layer): (SpanKey, Sha256Digest),
        load: impl Fn() -> SpanLoad,
    ) {
        let (flight, stored) = {
            let mut s = self.lock();
            if s.detached >= MAX_DETACHED_LOADS
                || s.inflight.contains_key(&key)
                || s.lru.iter().any(|x| x.0 == key)
            {
                return;
            }
            let f = Arc::new(Flight::default());
            s.inflight.insert(key, Arc::clone(&f));
            s.detached += 1;
            (f, s.stored.iter().find(|x| x.0 == key).map(|x| Arc::clone(&x.1)))
        };
        self.detach((key, layer), &flight, &load, stored);
    }

    /// Run span `key`'s load on a thread of its own (counted in `detached` already); without a
    /// thread, here.
    fn detach(
        self: &Arc<Self>,
        (key, layer): (SpanKey, Sha256Digest),
        flight: &Arc<Flight>,
        load: &dyn Fn() -> SpanLoad,
        stored: Option<Arc<Stored>>,
    ) {
        let (cache, job, f, kept) = (Arc::clone(self), load(), Arc::clone(flight), stored.clone());
        let spawned = std::thread::Builder::new()
            .name("tessera-span".into())
            .spawn(move || cache.run((key, layer), &f, job, kept, true));
        if spawned.is_err() {
            // The system has no thread for it: the caller loads the span itself.
            self.lock().detached -= 1;
            self.run((key, layer), flight, load(), stored, false);
        }
    }

    /// Run `job`, the load of span `key` (from its stored form `stored` if there is one),
    /// publishing its bytes on `flight`; the span and its stored form go into the cache if it
    /// loaded well, and the flight ends either way (a panic included).
    fn run(
        &self,
        (key, layer): (SpanKey, Sha256Digest),
        flight: &Flight,
        job: SpanLoad,
        stored: Option<Arc<Stored>>,
        detached: bool,
    ) {
        let mut publish = |bytes: &[u8]| {
            flight.progress.lock().unwrap_or_else(|p| p.into_inner()).decoded.extend_from_slice(bytes);
            flight.cv.notify_all();
        };
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(stored, &mut publish)))
            .unwrap_or_else(|_| {
                Err(StoreError::CorruptSpan {
                    layer,
                    offset: 0,
                    reason: format!("the load of span {key:?} panicked"),
                })
            });
        let end = {
            let mut s = self.lock();
            s.detached -= usize::from(detached);
            s.inflight.remove(&key);
            match result {
                Ok((data, stored)) => {
                    self.keep_stored(&mut s, key, stored);
                    let data: Arc<[u8]> = data.into();
                    if data.len() <= self.capacity_bytes {
                        while s.bytes + data.len() > self.capacity_bytes && !s.lru.is_empty() {
                            let (_, old) = s.lru.remove(0);
                            s.bytes -= old.len();
                        }
                        s.bytes += data.len();
                        s.lru.push((key, Arc::clone(&data)));
                    }
                    Ok(data)
                }
                Err(e) => {
                    // A stored form that does not decode to its span (it is checked again) goes:
                    // the next load fetches the span afresh.
                    if let Some(i) = s.stored.iter().position(|x| x.0 == key) {
                        let (_, bad) = s.stored.remove(i);
                        s.stored_bytes -= bad.footprint();
                    }
                    Err(Some(e))
                }
            }
        };
        {
            let mut p = flight.progress.lock().unwrap_or_else(|p| p.into_inner());
            p.end = Some(end);
            p.decoded = Vec::new();
        }
        flight.cv.notify_all();
    }

    /// Bytes held: of decoded spans, and of stored forms.
    pub(crate) fn held(&self) -> (usize, usize) {
        let s = self.lock();
        (s.bytes, s.stored_bytes)
    }

    /// Keep `stored` as span `key`'s stored form, most recently used, evicting the least
    /// recently used ones beyond the bound.
    fn keep_stored(&self, s: &mut Spans, key: SpanKey, stored: Arc<Stored>) {
        if let Some(i) = s.stored.iter().position(|x| x.0 == key) {
            let (_, old) = s.stored.remove(i);
            s.stored_bytes -= old.footprint();
        }
        let size = stored.footprint();
        if size == 0 || size > self.stored_capacity {
            return;
        }
        while s.stored_bytes + size > self.stored_capacity && !s.stored.is_empty() {
            let (_, old) = s.stored.remove(0);
            s.stored_bytes -= old.footprint();
        }
        s.stored_bytes += size;
        s.stored.push((key, stored));
    }

    /// Wait until no load of span `key` is in flight.
    #[cfg(test)]
    fn settle(&self, key: SpanKey) {
        let flight = self.lock().inflight.get(&key).cloned();
        if let Some(f) = flight {
            let mut p = f.progress.lock().unwrap_or_else(|p| p.into_inner());
            while p.end.is_none() {
                p = f.cv.wait(p).unwrap_or_else(|p| p.into_inner());
            }
        }
    }
}

/// The verified bytes of BlockMap chunk `index` of a reference image (`image`, whose reference
/// index is `r`), read from the spans covering it as soon as they are decoded. Bytes that do not
/// match the ChunkId (a span decoded from bytes its end will show corrupt) are an error once the
/// spans' loads have ended, so that the read path's refetch loads them again.
pub(crate) fn fetch_reference_chunk<S: ChunkSource + 'static>(
    image: &Arc<crate::OpenImage>,
    r: &RefImage,
    chunk: &ChunkRef,
    index: u32,
    spans: &Arc<SpanCache>,
    source: &Arc<S>,
) -> Result<Vec<u8>, StoreError> {
    let (layer, loc) = r.locate(index).ok_or_else(|| StoreError::CorruptChunk {
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
    let load = |k: usize| -> SpanLoad {
        let (image, source) = (Arc::clone(image), Arc::clone(source));
        let (layer_no, digest) = (loc.layer, layer.digest);
        Box::new(move |stored, publish| {
            let no = |reason: String| StoreError::CorruptSpan { layer: digest, offset: 0, reason };
            let r = image.reference().ok_or_else(|| no("the image has no reference index".into()))?;
            let layer = r
                .index
                .layers
                .get(layer_no as usize)
                .ok_or_else(|| no(format!("no layer {layer_no} in the reference index")))?;
            let windows = r.index.windows.as_ref().map(|w| w.digest);
            stream_span(&*source, layer, k, windows.as_ref(), stored, publish)
        })
    };
    // A chunk over several spans: all of them fetched at once, not one after another.
    if last > first {
        for k in first..=last {
            spans.start(((loc.layer, k), layer.digest), || load(k));
        }
    }
    let read = |checked: bool| -> Result<Vec<u8>, StoreError> {
        let mut out = Vec::with_capacity(loc.len as usize);
        for k in first..=last {
            let (s, e) = layer.span_range(k).ok_or_else(|| corrupt("a span is missing"))?;
            let from = loc.offset.max(s) - s;
            let to = (loc.offset + u64::from(loc.len)).min(e) - s;
            let range = usize::try_from(from).ok().zip(usize::try_from(to).ok());
            let range = range.ok_or_else(|| corrupt("a span is larger than memory"))?;
            out.extend_from_slice(&spans.bytes(((loc.layer, k), layer.digest), range, checked, || load(k))?);
        }
        Ok(out)
    };
    let matches = |out: &[u8]| out.len() == loc.len as usize && chunk.id.matches(out);
    let out = read(false)?;
    if matches(&out) {
        return Ok(out);
    }
    // Bytes decoded before their span was checked: read them again from checked spans, which
    // gives the span's own error if its compressed bytes are what is wrong.
    let out = read(true)?;
    if !matches(&out) {
        return Err(corrupt("its blake3 does not match the chunk id"));
    }
    Ok(out)
}

/// Test data: `len` bytes of compressible text (words in a pseudo-random order: many deflate
/// blocks), gzipped and indexed with checkpoints every `spacing` bytes, and the layer as a
/// reference index holds it, its windows back to back in a windows blob (the layer's digest is
/// the gzip's): (the text, the gzip, the windows, the layer).
#[cfg(test)]
pub(crate) fn test_layer(len: usize, spacing: u64) -> (Vec<u8>, Vec<u8>, Vec<u8>, RefLayer) {
    use std::io::Write;
    let words: [&[u8]; 8] =
        [b"lazy ", b"loading ", b"of ", b"spans ", b"from ", b"gzip ", b"layers\n", b"42 "];
    let (mut data, mut x) = (Vec::new(), 1u64);
    while data.len() < len {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        data.extend_from_slice(words[(x >> 61) as usize]);
        data.push((x >> 40) as u8);
    }
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(6));
    e.write_all(&data).expect("gzip in memory");
    let gz = e.finish().expect("gzip in memory");
    let (_, index) = tessera_gzip::index_all(&gz, spacing).expect("index of a good gzip");
    let (mut windows, mut checkpoints) = (Vec::new(), Vec::new());
    for (k, cp) in index.checkpoints.iter().enumerate() {
        let span = index.span(k).expect("a span per checkpoint");
        let (s, e) = (span.compressed.0 as usize, span.compressed.1 as usize);
        // The indexer's windows are zstd already, as the builder stores them.
        let window = Window::Stored {
            offset: windows.len() as u64,
            len: cp.window.len() as u32,
            digest: if cp.window.is_empty() { [0; 32] } else { *blake3::hash(&cp.window).as_bytes() },
        };
        windows.extend_from_slice(&cp.window);
        checkpoints.push(tessera_image::RefCheckpoint {
            in_offset: cp.in_offset,
            bits: cp.bits,
            out_offset: cp.out_offset,
            span_end: span.compressed.1,
            span_digest: *blake3::hash(&gz[s..e]).as_bytes(),
            window,
        });
    }
    let layer = RefLayer {
        digest: Sha256Digest::of(&gz),
        codec: RefCodec::Gzip,
        compressed_len: gz.len() as u64,
        uncompressed_len: data.len() as u64,
        checkpoints,
    };
    (data, gz, windows, layer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    const D: Sha256Digest = Sha256Digest([0; 32]);

    fn injected() -> StoreError {
        StoreError::CorruptSpan {
            layer: tessera_image::Sha256Digest([0; 32]),
            offset: 0,
            reason: "injected".into(),
        }
    }

    /// A load of `len` bytes of `byte`, published in one piece after `delay`, counted in `loads`.
    fn slow_load(loads: &Arc<AtomicUsize>, delay: Duration, byte: u8, len: usize) -> SpanLoad {
        let loads = Arc::clone(loads);
        Box::new(move |_, publish| {
            loads.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(delay);
            publish(&vec![byte; len]);
            Ok((vec![byte; len], Arc::default()))
        })
    }

    #[test]
    fn one_load_per_span_however_many_readers_wait() {
        let cache = Arc::new(SpanCache::new(1 << 20, 0));
        let loads = Arc::new(AtomicUsize::new(0));
        let got: Vec<Vec<u8>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|i| {
                    let (cache, loads) = (&cache, &loads);
                    s.spawn(move || {
                        cache
                            .bytes(((0, 7), D), (i * 100, i * 100 + 100), false, || {
                                slow_load(loads, Duration::from_millis(100), 7, 1000)
                            })
                            .unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(loads.load(Ordering::SeqCst), 1, "concurrent readers of one span load it once");
        assert!(got.iter().all(|d| d[..] == [7u8; 100][..]));
        // Another span loads; the first stays cached.
        cache.bytes(((0, 8), D), (0, 1000), false, || slow_load(&loads, Duration::ZERO, 8, 1000)).unwrap();
        assert_eq!(
            cache.bytes(((0, 7), D), (900, 1000), false, || panic!("cached")).unwrap(),
            vec![7u8; 100]
        );
        assert!(
            cache.bytes(((0, 7), D), (900, 1001), false, || panic!("cached")).is_err(),
            "past the span's end"
        );
        assert_eq!(loads.load(Ordering::SeqCst), 2);
    }

    /// Spans started together load together: a reader of four spans that starts them all
    /// waits about one load, not four; a started span that is cached or in flight is not
    /// loaded again, and a started load that fails is loaded again by its reader.
    #[test]
    fn spans_started_together_load_together() {
        let cache = Arc::new(SpanCache::new(1 << 20, 0));
        let loads = Arc::new(AtomicUsize::new(0));
        let delay = Duration::from_millis(200);
        let t = std::time::Instant::now();
        for k in 0..4 {
            cache.start(((0, k), D), || slow_load(&loads, delay, k as u8, 100));
        }
        for k in 0..4 {
            cache.start(((0, k), D), || panic!("in flight: not loaded again"));
        }
        for k in 0..4 {
            let got = cache.bytes(((0, k), D), (0, 100), true, || panic!("started")).unwrap();
            assert_eq!(got, vec![k as u8; 100]);
        }
        let took = t.elapsed();
        assert!(took < delay * 2, "four spans took {took:?}, about one load each in turn");
        assert_eq!(loads.load(Ordering::SeqCst), 4);
        cache.start(((0, 2), D), || panic!("cached: not loaded again"));
        // A started load that fails: its reader loads the span itself.
        cache.start(((0, 9), D), || Box::new(|_, _| Err(injected())));
        cache.settle((0, 9));
        let got =
            cache.bytes(((0, 9), D), (0, 10), true, || slow_load(&loads, Duration::ZERO, 9, 10)).unwrap();
        assert_eq!(got, vec![9u8; 10]);
    }

    /// The reason for the flights: a reader of a span's first bytes — the one that started the
    /// load included — has them while the rest is still on its way.
    #[test]
    fn a_reader_has_its_bytes_before_the_rest_of_the_span_is_in() {
        let cache = Arc::new(SpanCache::new(1 << 20, 0));
        let (open, gate) = std::sync::mpsc::channel::<()>();
        let gate = Mutex::new(Some(gate));
        let load = || -> SpanLoad {
            let gate = gate.lock().unwrap().take().expect("one load");
            Box::new(move |_, publish| {
                publish(&[1u8; 100]);
                gate.recv().map_err(|_| injected())?;
                publish(&[2u8; 900]);
                let mut all = vec![1u8; 100];
                all.extend_from_slice(&[2u8; 900]);
                Ok((all, Arc::default()))
            })
        };
        // The reader that starts the load gets its bytes with the gate closed.
        assert_eq!(cache.bytes(((3, 0), D), (10, 60), false, load).unwrap(), vec![1u8; 50]);
        std::thread::scope(|s| {
            let later =
                s.spawn(|| cache.bytes(((3, 0), D), (90, 200), false, || panic!("in flight")).unwrap());
            let checked =
                s.spawn(|| cache.bytes(((3, 0), D), (10, 60), true, || panic!("in flight")).unwrap());
            std::thread::sleep(Duration::from_millis(50));
            assert!(!later.is_finished(), "a reader of bytes not yet decoded waits for them");
            assert!(!checked.is_finished(), "a reader of checked bytes waits for the whole span");
            open.send(()).unwrap();
            assert_eq!(checked.join().unwrap(), vec![1u8; 50]);
            let got = later.join().unwrap();
            assert_eq!(&got[..10], &[1u8; 10]);
            assert_eq!(&got[10..], &[2u8; 100]);
        });
        assert_eq!(cache.bytes(((3, 0), D), (0, 1000), false, || panic!("cached")).unwrap().len(), 1000);
    }

    #[test]
    fn a_failed_load_is_retried_by_a_waiter_and_the_cache_keeps_to_its_bytes() {
        let cache = Arc::new(SpanCache::new(2500, 0));
        let loads = Arc::new(AtomicUsize::new(0));
        let load = || -> SpanLoad {
            let loads = Arc::clone(&loads);
            Box::new(move |_, publish| {
                let n = loads.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(50));
                if n == 0 {
                    // Bytes published before the failure are not served to anyone after it.
                    publish(&[9u8; 10]);
                    return Err(injected());
                }
                publish(&[1u8; 1000]);
                Ok((vec![1u8; 1000], Arc::default()))
            })
        };
        let results: Vec<bool> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|i| {
                    let (cache, load) = (&cache, &load);
                    s.spawn(move || {
                        // One reader starts the load; the others (most likely) join it.
                        std::thread::sleep(Duration::from_millis(if i == 0 { 0 } else { 20 }));
                        cache
                            .bytes(((1, 1), D), (0, 1000), false, load)
                            .map(|b| b == [1u8; 1000])
                            .unwrap_or(false)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(
            results.iter().filter(|ok| !**ok).count(),
            1,
            "only the failed load's reader fails: {results:?}"
        );
        assert_eq!(loads.load(Ordering::SeqCst), 2, "one waiter loads again, the rest share it");
        cache.settle((1, 1));
        for k in 2..5 {
            cache.bytes(((1, k), D), (0, 1), false, || slow_load(&loads, Duration::ZERO, 0, 1000)).unwrap();
            // Its reader had its byte as soon as it was published; the load may still be ending.
            cache.settle((1, k));
        }
        let s = cache.lock();
        assert!(s.bytes <= 2500 && s.lru.len() == 2, "{} bytes in {} spans", s.bytes, s.lru.len());
        assert!(s.inflight.is_empty());
        assert_eq!(s.detached, 0, "every detached load is counted out");
    }

    #[test]
    fn a_load_that_panics_fails_its_reader_and_leaves_no_flight() {
        let cache = Arc::new(SpanCache::new(1 << 20, 0));
        let err = cache
            .bytes(((0, 0), D), (0, 1), false, || Box::new(|_, _: &mut dyn FnMut(&[u8])| panic!("injected")));
        assert!(err.is_err());
        assert!(cache.lock().inflight.is_empty());
        assert_eq!(
            cache
                .bytes(((0, 0), D), (0, 1), false, || slow_load(&Arc::default(), Duration::ZERO, 3, 5))
                .unwrap(),
            [3]
        );
    }

    /// Blobs in memory, every range read logged.
    struct Blobs {
        blobs: HashMap<Sha256Digest, Vec<u8>>,
        reads: Mutex<Vec<(Sha256Digest, u64, u32)>>,
    }

    impl ChunkSource for Blobs {
        fn read_stored(&self, pack: &Sha256Digest, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
            self.reads.lock().unwrap().push((*pack, offset, len));
            let blob = self.blobs.get(pack).ok_or_else(injected)?;
            Ok(blob[offset as usize..offset as usize + len as usize].to_vec())
        }
    }

    /// A gzip layer of ~3 MiB of text with ~1 MiB spans (the builder's spacing before 512 KiB)
    /// and its windows in a blob of their own: (the uncompressed bytes, the layer, the windows
    /// blob's digest, a source holding both blobs).
    fn layer() -> (Vec<u8>, RefLayer, Sha256Digest, Blobs) {
        let (data, gz, windows, layer) = test_layer(3 << 20, 1 << 20);
        let wd = Sha256Digest::of(&windows);
        let blobs = HashMap::from([(layer.digest, gz), (wd, windows)]);
        (data, layer, wd, Blobs { blobs, reads: Mutex::default() })
    }

    /// How many reads `source` made since the last call.
    fn reads(source: &Blobs) -> usize {
        std::mem::take(&mut *source.reads.lock().unwrap()).len()
    }

    /// Bytes `[from, to)` of span `k` through `cache`, loaded from `source`.
    fn span_bytes(
        cache: &Arc<SpanCache>,
        (source, layer, windows): (&Arc<Blobs>, &Arc<RefLayer>, Sha256Digest),
        k: usize,
        (from, to): (usize, usize),
        checked: bool,
    ) -> Result<Vec<u8>, StoreError> {
        let load = || -> SpanLoad {
            let (source, layer) = (Arc::clone(source), Arc::clone(layer));
            Box::new(move |stored, publish| stream_span(&*source, &layer, k, Some(&windows), stored, publish))
        };
        cache.bytes(((0, k), layer.digest), (from, to), checked, load)
    }

    /// A span whose decoded bytes were evicted is decoded again from its stored form, checked
    /// again, not fetched again — fetch once; the stored forms keep to their own bound.
    #[test]
    fn an_evicted_span_is_decoded_again_from_what_was_fetched() {
        let (data, layer, windows, source) = layer();
        let (source, layer) = (Arc::new(source), Arc::new(layer));
        assert!(layer.checkpoints.len() >= 3, "{} spans", layer.checkpoints.len());
        let range = |k: usize| {
            let (s, e) = layer.span_range(k).unwrap();
            (s as usize, e as usize)
        };
        let ctx = (&source, &layer, windows);
        // Room for one decoded span.
        let one = range(0).1 + (range(0).1 >> 1);
        let cache = Arc::new(SpanCache::new(one, 8 << 20));
        for k in 0..3 {
            let (s, e) = range(k);
            assert_eq!(span_bytes(&cache, ctx, k, (0, e - s), false).unwrap(), data[s..e]);
            cache.settle((0, k));
        }
        assert_eq!(reads(&source), 3 + 2, "three spans, and the windows of the two not at the start");
        {
            let s = cache.lock();
            assert_eq!(s.lru.len(), 1, "one span decoded");
            assert_eq!(s.stored.len(), 3, "all three stored");
            assert_eq!(s.stored_bytes, s.stored.iter().map(|x| x.1.footprint()).sum::<usize>());
        }
        // The evicted spans again, checked and not: the same bytes, nothing read.
        for k in [0, 1] {
            let (s, e) = range(k);
            assert_eq!(span_bytes(&cache, ctx, k, (100, e - s), true).unwrap(), data[s + 100..e]);
            assert_eq!(span_bytes(&cache, ctx, k, (5, 4096), false).unwrap(), data[s + 5..s + 4096]);
        }
        assert_eq!(reads(&source), 0, "decoded again from their stored forms");
        assert_eq!(cache.lock().stored.len(), 3, "a stored form is kept once");

        // A stored form whose bytes changed fails its check (never other bytes) and goes: the
        // read after it fetches the span afresh.
        span_bytes(&cache, ctx, 2, (0, 10), false).unwrap();
        {
            let mut s = cache.lock();
            assert!(!s.lru.iter().any(|x| x.0 == (0, 0)), "span 0 is not held decoded");
            let entry = s.stored.iter_mut().find(|x| x.0 == (0, 0)).unwrap();
            let mut bytes = entry.1.bytes.clone();
            bytes[100] ^= 0x08;
            entry.1 = Arc::new(Stored { bytes, window: entry.1.window.clone() });
        }
        let (s0, e0) = range(0);
        assert!(matches!(
            span_bytes(&cache, ctx, 0, (0, e0 - s0), true),
            Err(StoreError::CorruptSpan { .. })
        ));
        assert!(!cache.lock().stored.iter().any(|x| x.0 == (0, 0)), "the bad stored form is dropped");
        assert_eq!(span_bytes(&cache, ctx, 0, (0, e0 - s0), true).unwrap(), data[s0..e0]);
        assert_eq!(reads(&source), 1, "fetched afresh");

        // Stored forms keep to their bound: room for one, the least recently used goes.
        let largest = cache.lock().stored.iter().map(|x| x.1.footprint()).max().unwrap_or(0);
        let small = Arc::new(SpanCache::new(one, largest));
        for k in [0, 1] {
            span_bytes(&small, ctx, k, (0, 10), true).unwrap();
        }
        assert_eq!(reads(&source), 2 + 1);
        span_bytes(&small, ctx, 0, (0, 10), true).unwrap();
        assert_eq!(
            reads(&source),
            1,
            "span 0 was evicted from both: fetched again (its window is at the start)"
        );
        let s = small.lock();
        assert!(s.stored_bytes <= small.stored_capacity && s.stored.len() == 1, "{} stored", s.stored.len());
    }
}
