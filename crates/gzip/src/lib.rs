//! Random access into gzip streams, I/O-free.
//!
//! A gzip layer is inflated once by an [`Indexer`], which hands the uncompressed bytes on and
//! records a [`Checkpoint`] at a deflate block boundary every `spacing` uncompressed bytes (and
//! at the start of every gzip member): the compressed position (byte and bit), the uncompressed
//! position, and the 32 KiB of output before it (the window back-references may reach into),
//! with the bytes the span never reads zeroed ([`sparse`]), kept zstd-compressed. The bytes
//! between two checkpoints are a *span*; [`inflate_span`] decodes one span from its compressed
//! bytes alone, resuming inflation where the checkpoint says (zlib's `inflatePrime` for the bits
//! of a shared byte, `inflateSetDictionary` for the window). [`GzipIndex::read`] serves any
//! uncompressed range `[a, b)` from the spans covering it.
//!
//! The technique is zlib's `examples/zran.c` (also behind SOCI's zTOC, Nydus' zran and
//! overlaybd's gzip index). The engine is zlib-rs through `libz-rs-sys`, its zlib C API: the
//! same inflater the workspace uses through flate2, which exposes neither `inflatePrime` nor the
//! `data_type` bits that say where a block ends. The C API needs `unsafe` calls; they are all in
//! [`Stream`].

use std::ffi::c_int;

use libz_rs_sys as z;

/// The deflate window: how far back a match may reach.
pub const WINDOW: usize = 32 << 10;

/// The default checkpoint spacing (uncompressed bytes between checkpoints); see
/// `docs/formats/reference-index.md` for the measurement behind it.
pub const DEFAULT_SPACING: u64 = 512 << 10;

/// zstd level for stored windows.
const WINDOW_ZSTD_LEVEL: i32 = 3;

/// Errors inflating or resuming a gzip stream.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GzipError {
    /// The compressed bytes are not a valid gzip stream (zlib's message).
    #[error("corrupt gzip stream at compressed byte {offset}: {message}")]
    Corrupt { offset: u64, message: String },
    /// The stream ended in the middle of a member.
    #[error("truncated gzip stream: it ends inside a member after {offset} compressed bytes")]
    Truncated { offset: u64 },
    /// No gzip member at all.
    #[error("empty gzip stream")]
    Empty,
    /// A span decoded to fewer bytes than its checkpoints say.
    #[error("the span decodes to {got} bytes, the index says {expected}")]
    ShortSpan { got: u64, expected: u64 },
    /// A stored window does not decompress to a window.
    #[error("a checkpoint window does not decode: {0}")]
    BadWindow(String),
    /// A checkpoint or range the index does not have.
    #[error("{0}")]
    Range(String),
    /// zlib refused an operation (an internal error).
    #[error("zlib {op} failed with code {code}")]
    Zlib { op: &'static str, code: i32 },
}

/// A place to resume inflation: a deflate block boundary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// Compressed bytes consumed when the block boundary was reached (an offset in the gzip blob).
    pub in_offset: u64,
    /// Bits of the byte at `in_offset - 1` still to be read (0..=7); when non-zero, the span's
    /// compressed bytes start one byte early.
    pub bits: u8,
    /// Uncompressed offset of the boundary.
    pub out_offset: u64,
    /// The up to 32 KiB of uncompressed bytes before the boundary within its member (empty at the
    /// start of a member), those no back-reference of the span reaches set to zero
    /// ([`sparse`]), zstd-compressed.
    pub window: Vec<u8>,
}

impl Checkpoint {
    /// Where the span's compressed bytes start in the blob.
    pub fn start(&self) -> u64 {
        self.in_offset - u64::from(self.bits > 0)
    }

    /// The window, uncompressed.
    pub fn window(&self) -> Result<Vec<u8>, GzipError> {
        if self.window.is_empty() {
            return Ok(Vec::new());
        }
        let w =
            zstd::bulk::decompress(&self.window, WINDOW).map_err(|e| GzipError::BadWindow(e.to_string()))?;
        Ok(w)
    }
}

/// One span: the uncompressed bytes from checkpoint `k` to the next, and where their compressed
/// bytes lie in the blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Compressed byte range `[start, end)` that holds the span (the end may include a gzip
    /// trailer; decoding stops once the span's bytes are out).
    pub compressed: (u64, u64),
    /// Uncompressed byte range `[start, end)`.
    pub uncompressed: (u64, u64),
}

/// How a layer's spans are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Codec {
    /// gzip: a span resumes inflation at a deflate block boundary with its window.
    #[default]
    Gzip,
    /// zstd frames: a span is whole frames, each decoded alone ([`ZstdIndexer`]).
    Zstd,
}

/// The checkpoints of one gzip stream (or zstd frames, by `codec`), and the spans between them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GzipIndex {
    /// How the spans are compressed.
    pub codec: Codec,
    /// Ascending by both offsets; the first at uncompressed offset 0.
    pub checkpoints: Vec<Checkpoint>,
    /// Where span `k` ends in the compressed stream (`span_ends[k]`), one per checkpoint.
    pub span_ends: Vec<u64>,
    /// Size of the compressed stream.
    pub compressed_len: u64,
    /// Size of the uncompressed stream.
    pub uncompressed_len: u64,
}

impl GzipIndex {
    /// Span `k`.
    pub fn span(&self, k: usize) -> Option<Span> {
        let cp = self.checkpoints.get(k)?;
        let uend = self.checkpoints.get(k + 1).map_or(self.uncompressed_len, |n| n.out_offset);
        Some(Span { compressed: (cp.start(), *self.span_ends.get(k)?), uncompressed: (cp.out_offset, uend) })
    }

    /// Remove the checkpoints whose span holds no uncompressed byte (the last one's ends at
    /// `uncompressed_len`, which must be set).
    pub(crate) fn drop_empty_spans(&mut self) {
        let mut k = 0;
        while k < self.checkpoints.len() {
            let end = self.checkpoints.get(k + 1).map_or(self.uncompressed_len, |c| c.out_offset);
            if end == self.checkpoints[k].out_offset {
                self.checkpoints.remove(k);
                self.span_ends.remove(k);
            } else {
                k += 1;
            }
        }
    }

    /// The spans covering the uncompressed range `[a, b)` (`a < b`), as indexes `first..=last`.
    pub fn spans_covering(&self, a: u64, b: u64) -> Option<(usize, usize)> {
        if a >= b || b > self.uncompressed_len || self.checkpoints.is_empty() {
            return None;
        }
        let find = |u: u64| self.checkpoints.partition_point(|c| c.out_offset <= u).checked_sub(1);
        Some((find(a)?, find(b - 1)?))
    }

    /// Decode span `k` from `blob`, the whole compressed stream (for tests and tools; readers
    /// fetch the span's range and call [`inflate_span`]).
    pub fn decode_span(&self, blob: &[u8], k: usize) -> Result<Vec<u8>, GzipError> {
        let span = self.span(k).ok_or_else(|| GzipError::Range(format!("no span {k}")))?;
        let cp = &self.checkpoints[k];
        let bytes = usize::try_from(span.compressed.0)
            .ok()
            .zip(usize::try_from(span.compressed.1).ok())
            .and_then(|(s, e)| blob.get(s..e))
            .ok_or_else(|| GzipError::Range(format!("span {k} lies outside the blob")))?;
        let len = span.uncompressed.1 - span.uncompressed.0;
        match self.codec {
            Codec::Gzip => inflate_span(bytes, cp.bits, &cp.window()?, len),
            Codec::Zstd => decode_zstd_span(bytes, len),
        }
    }

    /// The uncompressed bytes `[a, b)` of `blob`, decoded from the covering spans only.
    pub fn read(&self, blob: &[u8], a: u64, b: u64) -> Result<Vec<u8>, GzipError> {
        if a == b {
            return Ok(Vec::new());
        }
        let (first, last) = self
            .spans_covering(a, b)
            .ok_or_else(|| GzipError::Range(format!("range {a}..{b} is outside the stream")))?;
        let mut out = Vec::with_capacity(usize::try_from(b - a).unwrap_or(0));
        for k in first..=last {
            let span = self.span(k).ok_or_else(|| GzipError::Range(format!("no span {k}")))?;
            let data = self.decode_span(blob, k)?;
            let from = a.max(span.uncompressed.0) - span.uncompressed.0;
            let to = b.min(span.uncompressed.1) - span.uncompressed.0;
            out.extend_from_slice(&data[from as usize..to as usize]);
        }
        Ok(out)
    }
}

/// A zlib inflate stream (boxed: zlib's state points back at it).
struct Stream {
    strm: Box<z::z_stream>,
}

impl Stream {
    /// `window_bits`: 15 + 32 for a gzip (or zlib) header, -15 for raw deflate.
    fn new(window_bits: c_int) -> Result<Self, GzipError> {
        let mut strm = Box::new(z::z_stream::default());
        let size = c_int::try_from(std::mem::size_of::<z::z_stream>()).unwrap_or(c_int::MAX);
        // SAFETY: `strm` is a valid, default-initialized z_stream (allocator functions set by
        // the `rust-allocator` feature); the version string is zlib-rs' own, NUL-terminated.
        let rc = unsafe { z::inflateInit2_(&mut *strm, window_bits, z::zlibVersion(), size) };
        if rc != z::Z_OK {
            return Err(GzipError::Zlib { op: "inflateInit2", code: rc });
        }
        Ok(Self { strm })
    }

    fn reset(&mut self) -> Result<(), GzipError> {
        // SAFETY: the stream was initialized by `new` and not ended.
        let rc = unsafe { z::inflateReset(&mut *self.strm) };
        ok(rc, "inflateReset")
    }

    fn prime(&mut self, bits: u8, value: u8) -> Result<(), GzipError> {
        // SAFETY: as in `reset`.
        let rc = unsafe { z::inflatePrime(&mut *self.strm, c_int::from(bits), c_int::from(value)) };
        ok(rc, "inflatePrime")
    }

    fn set_dictionary(&mut self, window: &[u8]) -> Result<(), GzipError> {
        if window.is_empty() {
            return Ok(());
        }
        let len = u32::try_from(window.len()).map_err(|_| GzipError::BadWindow("too long".into()))?;
        // SAFETY: as in `reset`; `window` is a live slice of `len` bytes.
        let rc = unsafe { z::inflateSetDictionary(&mut *self.strm, window.as_ptr(), len) };
        ok(rc, "inflateSetDictionary")
    }

    /// One `inflate` call over `input` into `output`: (return code, bytes consumed, bytes
    /// produced). zlib takes at most 4 GiB per call; callers pass less.
    fn inflate(&mut self, input: &[u8], output: &mut [u8], flush: c_int) -> (c_int, usize, usize) {
        let avail_in = u32::try_from(input.len()).unwrap_or(u32::MAX);
        let avail_out = u32::try_from(output.len()).unwrap_or(u32::MAX);
        self.strm.next_in = input.as_ptr();
        self.strm.avail_in = avail_in;
        self.strm.next_out = output.as_mut_ptr();
        self.strm.avail_out = avail_out;
        // SAFETY: as in `reset`; next_in/next_out point at live slices at least as long as
        // avail_in/avail_out, and are not used after this call returns.
        let rc = unsafe { z::inflate(&mut *self.strm, flush) };
        let used = (avail_in - self.strm.avail_in) as usize;
        let made = (avail_out - self.strm.avail_out) as usize;
        self.strm.next_in = std::ptr::null();
        self.strm.next_out = std::ptr::null_mut();
        (rc, used, made)
    }

    fn data_type(&self) -> c_int {
        self.strm.data_type
    }

    fn message(&self) -> String {
        if self.strm.msg.is_null() {
            return "invalid data".into();
        }
        // SAFETY: zlib sets `msg` to a static NUL-terminated string or leaves it null.
        unsafe { std::ffi::CStr::from_ptr(self.strm.msg) }.to_string_lossy().into_owned()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: the stream was initialized by `new`; it is ended exactly once, here.
        unsafe { z::inflateEnd(&mut *self.strm) };
    }
}

fn ok(rc: c_int, op: &'static str) -> Result<(), GzipError> {
    if rc == z::Z_OK {
        Ok(())
    } else {
        Err(GzipError::Zlib { op, code: rc })
    }
}

/// Decode `out_len` uncompressed bytes of one span: `compressed` starts at the checkpoint's
/// [`Checkpoint::start`], `bits` and `window` (uncompressed) are the checkpoint's.
pub fn inflate_span(compressed: &[u8], bits: u8, window: &[u8], out_len: u64) -> Result<Vec<u8>, GzipError> {
    let mut span = SpanInflater::new(bits, window, out_len)?;
    span.push(compressed)?;
    span.finish()
}

/// One span inflated as its compressed bytes arrive: what [`inflate_span`] does at once, in
/// pieces, so that a reader of the span's first bytes need not wait for its last
/// ([`Self::output`] grows with every [`Self::push`]).
pub struct SpanInflater {
    stream: Stream,
    /// The checkpoint's bits of a shared first byte, until that byte is pushed.
    prime: Option<(u8, Vec<u8>)>,
    out: Vec<u8>,
    made: usize,
    /// Compressed bytes consumed.
    used: u64,
    /// The deflate stream ended (a member's last block).
    ended: bool,
}

impl std::fmt::Debug for SpanInflater {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpanInflater")
            .field("out_len", &self.out.len())
            .field("made", &self.made)
            .field("used", &self.used)
            .field("ended", &self.ended)
            .finish()
    }
}

impl SpanInflater {
    /// A span of `out_len` uncompressed bytes resumed at a checkpoint with `bits` and (the
    /// uncompressed) `window`.
    pub fn new(bits: u8, window: &[u8], out_len: u64) -> Result<Self, GzipError> {
        let out_len = usize::try_from(out_len).map_err(|_| GzipError::Range("span too large".into()))?;
        if bits > 7 {
            return Err(GzipError::Range(format!("checkpoint bit count {bits} is not 0..=7")));
        }
        let mut stream = Stream::new(-15)?;
        let prime = if bits > 0 {
            // zlib takes the bits before the dictionary: both wait for the first byte.
            Some((bits, window.to_vec()))
        } else {
            stream.set_dictionary(window)?;
            None
        };
        Ok(Self { stream, prime, out: vec![0u8; out_len], made: 0, used: 0, ended: false })
    }

    /// Inflate the span's next compressed bytes (bytes past its end are ignored).
    pub fn push(&mut self, mut input: &[u8]) -> Result<(), GzipError> {
        if let Some((bits, window)) = &self.prime {
            let Some((&first, rest)) = input.split_first() else { return Ok(()) };
            self.stream.prime(*bits, first >> (8 - *bits))?;
            self.stream.set_dictionary(window)?;
            self.prime = None;
            self.used += 1;
            input = rest;
        }
        while !input.is_empty() && !self.ended && self.made < self.out.len() {
            let (rc, u, m) = self.stream.inflate(input, &mut self.out[self.made..], z::Z_NO_FLUSH);
            input = &input[u..];
            self.used += u as u64;
            self.made += m;
            match rc {
                z::Z_OK => {}
                z::Z_STREAM_END => self.ended = true,
                // No progress possible with this input: more is needed.
                z::Z_BUF_ERROR => break,
                _ => return Err(GzipError::Corrupt { offset: self.used, message: self.stream.message() }),
            }
        }
        Ok(())
    }

    /// The span's bytes decoded so far.
    pub fn output(&self) -> &[u8] {
        &self.out[..self.made]
    }

    /// The whole span, once every byte of it is decoded.
    pub fn finish(mut self) -> Result<Vec<u8>, GzipError> {
        if self.made < self.out.len() {
            return Err(GzipError::ShortSpan { got: self.made as u64, expected: self.out.len() as u64 });
        }
        Ok(std::mem::take(&mut self.out))
    }
}

/// Inflates a gzip stream pushed to it in pieces, handing the uncompressed bytes on and
/// recording checkpoints.
pub struct Indexer {
    stream: Stream,
    spacing: u64,
    out: Vec<u8>,
    /// The last up to 32 KiB of output of the current member.
    history: Vec<u8>,
    total_in: u64,
    total_out: u64,
    /// In a member (its header seen, its end not yet).
    in_member: bool,
    /// A checkpoint is due at the next block boundary (the start of a member).
    member_start: bool,
    members: u64,
    last_checkpoint_out: u64,
    index: GzipIndex,
    /// Checkpoints whose window waits for the first bytes of their span ([`sparse`]).
    pending: Vec<PendingWindow>,
    /// The last compressed byte consumed (a checkpoint's shared first byte).
    last_in: u8,
}

/// A checkpoint's window until its span's first [`WINDOW`] bytes are out: then the bytes its
/// back-references reach are known, and the others are stored as zeros.
struct PendingWindow {
    checkpoint: usize,
    bits: u8,
    window: Vec<u8>,
    /// The span's compressed bytes so far, from [`Checkpoint::start`].
    compressed: Vec<u8>,
    /// The span's first uncompressed bytes, up to [`WINDOW`].
    out: Vec<u8>,
}

/// A pending window whose span has produced this many compressed bytes without its first
/// [`WINDOW`] bytes of output is stored whole (no valid stream gets near it).
const PENDING_INPUT_LIMIT: usize = 1 << 20;

impl std::fmt::Debug for Indexer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Indexer")
            .field("spacing", &self.spacing)
            .field("total_in", &self.total_in)
            .field("total_out", &self.total_out)
            .field("checkpoints", &self.index.checkpoints.len())
            .finish()
    }
}

impl Indexer {
    /// An indexer recording a checkpoint at the first block boundary `spacing` or more bytes
    /// after the previous one (`spacing` ≥ 1).
    pub fn new(spacing: u64) -> Result<Self, GzipError> {
        Ok(Self {
            stream: Stream::new(15 + 16)?,
            spacing: spacing.max(1),
            out: vec![0u8; 256 << 10],
            history: Vec::with_capacity(2 * WINDOW),
            total_in: 0,
            total_out: 0,
            in_member: false,
            member_start: true,
            members: 0,
            last_checkpoint_out: 0,
            index: GzipIndex::default(),
            pending: Vec::new(),
            last_in: 0,
        })
    }

    /// Compressed bytes consumed so far.
    pub fn total_in(&self) -> u64 {
        self.total_in
    }

    /// Inflate `input`, handing every uncompressed byte to `sink` in order.
    pub fn push<E>(
        &mut self,
        mut input: &[u8],
        sink: &mut dyn FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<(), PushError<E>> {
        let mut stalled = 0;
        while !input.is_empty() {
            if !self.in_member {
                self.stream.reset().map_err(PushError::Gzip)?;
                self.in_member = true;
                self.member_start = true;
                self.history.clear();
            }
            let mut out = std::mem::take(&mut self.out);
            let (rc, used, made) = self.stream.inflate(input, &mut out, z::Z_BLOCK);
            for p in &mut self.pending {
                p.compressed.extend_from_slice(&input[..used]);
            }
            if let Some(&b) = input[..used].last() {
                self.last_in = b;
            }
            input = &input[used..];
            self.total_in += used as u64;
            // zlib may stop at a block boundary without progress once; twice is a stuck stream.
            stalled = if used == 0 && made == 0 && rc != z::Z_STREAM_END { stalled + 1 } else { 0 };
            if stalled > 2 {
                self.out = out;
                return Err(PushError::Gzip(GzipError::Corrupt {
                    offset: self.total_in,
                    message: "inflate makes no progress".into(),
                }));
            }
            let result = self.consume(rc, &out[..made], sink);
            self.out = out;
            result?;
        }
        Ok(())
    }

    fn consume<E>(
        &mut self,
        rc: c_int,
        made: &[u8],
        sink: &mut dyn FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<(), PushError<E>> {
        if !made.is_empty() {
            sink(made).map_err(PushError::Sink)?;
            for p in &mut self.pending {
                let room = WINDOW - p.out.len();
                p.out.extend_from_slice(&made[..made.len().min(room)]);
            }
            self.settle_windows(false).map_err(PushError::Gzip)?;
            self.total_out += made.len() as u64;
            if made.len() >= WINDOW {
                self.history.clear();
                self.history.extend_from_slice(&made[made.len() - WINDOW..]);
            } else {
                self.history.extend_from_slice(made);
                if self.history.len() > 2 * WINDOW {
                    self.history.drain(..self.history.len() - WINDOW);
                }
            }
        }
        match rc {
            z::Z_OK | z::Z_BUF_ERROR => {}
            z::Z_STREAM_END => {
                if let Some(end) = self.index.span_ends.last_mut() {
                    *end = self.total_in;
                }
                self.settle_windows(true).map_err(PushError::Gzip)?;
                self.in_member = false;
                self.members += 1;
                return Ok(());
            }
            _ => {
                return Err(PushError::Gzip(GzipError::Corrupt {
                    offset: self.total_in,
                    message: self.stream.message(),
                }))
            }
        }
        let dt = self.stream.data_type();
        // At a block boundary (bit 7) that is not after the last block (bit 6).
        if dt & 128 != 0 && dt & 64 == 0 {
            let due = self.member_start || self.total_out - self.last_checkpoint_out >= self.spacing;
            if due {
                // The span before ends here: its window's uses are all known.
                self.settle_windows(true).map_err(PushError::Gzip)?;
                let window = if self.member_start { Vec::new() } else { self.window().to_vec() };
                let bits = (dt & 7) as u8;
                if !window.is_empty() {
                    self.pending.push(PendingWindow {
                        checkpoint: self.index.checkpoints.len(),
                        bits,
                        window,
                        compressed: if bits > 0 { vec![self.last_in] } else { Vec::new() },
                        out: Vec::new(),
                    });
                }
                if let Some(end) = self.index.span_ends.last_mut() {
                    if !self.member_start {
                        *end = self.total_in;
                    }
                }
                // The window is set when it settles ([`Self::settle_windows`]).
                self.index.checkpoints.push(Checkpoint {
                    in_offset: self.total_in,
                    bits,
                    out_offset: self.total_out,
                    window: Vec::new(),
                });
                self.index.span_ends.push(self.total_in);
                self.last_checkpoint_out = self.total_out;
                self.member_start = false;
            }
        }
        Ok(())
    }

    fn window(&self) -> &[u8] {
        &self.history[self.history.len().saturating_sub(WINDOW)..]
    }

    /// Store the windows whose span has shown its first [`WINDOW`] bytes (all of them once
    /// `ended`: their spans or member ended), each as sparse as its span allows.
    fn settle_windows(&mut self, ended: bool) -> Result<(), GzipError> {
        let mut k = 0;
        while k < self.pending.len() {
            let p = &self.pending[k];
            let full = p.out.len() >= WINDOW;
            if !(ended || full || p.compressed.len() > PENDING_INPUT_LIMIT) {
                k += 1;
                continue;
            }
            let p = self.pending.swap_remove(k);
            // Only a span seen to its first WINDOW bytes (or its end) says every use.
            let whole = !(ended || full);
            let window =
                if whole { p.window } else { sparse::settle(p.bits, p.window, &p.compressed, &p.out) };
            let mut stored = zstd::bulk::compress(&window, WINDOW_ZSTD_LEVEL)
                .map_err(|e| GzipError::BadWindow(e.to_string()))?;
            // The compressor's buffer is sized for the worst case: a layer's index holds thousands.
            stored.shrink_to_fit();
            self.index.checkpoints[p.checkpoint].window = stored;
        }
        Ok(())
    }

    /// The end of the stream: the index, or an error if it ended inside a member.
    pub fn finish(mut self) -> Result<GzipIndex, GzipError> {
        if self.in_member {
            return Err(GzipError::Truncated { offset: self.total_in });
        }
        if self.members == 0 {
            return Err(GzipError::Empty);
        }
        self.settle_windows(true)?;
        self.index.compressed_len = self.total_in;
        self.index.uncompressed_len = self.total_out;
        // A member with no output has a checkpoint at its end too.
        self.index.drop_empty_spans();
        Ok(self.index)
    }
}

/// A [`Indexer::push`] failure: the stream's or the sink's.
#[derive(Debug)]
pub enum PushError<E> {
    Gzip(GzipError),
    Sink(E),
}

/// Index a whole in-memory gzip stream: (uncompressed bytes, index).
pub fn index_all(blob: &[u8], spacing: u64) -> Result<(Vec<u8>, GzipIndex), GzipError> {
    let mut ix = Indexer::new(spacing)?;
    let mut data = Vec::new();
    ix.push(blob, &mut |b: &[u8]| {
        data.extend_from_slice(b);
        Ok::<(), std::convert::Infallible>(())
    })
    .map_err(|e| match e {
        PushError::Gzip(g) => g,
        PushError::Sink(never) => match never {},
    })?;
    Ok((data, ix.finish()?))
}

#[cfg(test)]
mod tests;

pub mod sparse;
mod zstd_frames;
pub use zstd_frames::{decode_zstd_span, AnyIndexer, ZstdIndexer};
