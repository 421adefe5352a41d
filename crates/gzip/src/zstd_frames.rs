//! Random access into zstd streams made of many frames (`zstd:chunked` layers, or any stream
//! written frame by frame), I/O-free.
//!
//! A zstd frame decodes alone, so a checkpoint is just a frame boundary: no window, no bit
//! offset. [`ZstdIndexer`] decodes a stream once, hands the bytes on, and records a checkpoint at
//! the first frame start at least `spacing` uncompressed bytes after the previous checkpoint (and
//! at the start); a span is the whole frames between two checkpoints, and
//! [`decode_zstd_span`] decodes one from its compressed bytes alone. Skippable frames (a
//! `zstd:chunked` table of contents) pass through. A stream of one large frame gets one
//! checkpoint: the caller decides whether that is random access enough.

use crate::{Checkpoint, Codec, GzipError, GzipIndex, Indexer, PushError};

/// Indexes a zstd stream at frame boundaries; see the module documentation.
pub struct ZstdIndexer {
    decoder: zstd::stream::raw::Decoder<'static>,
    spacing: u64,
    out: Vec<u8>,
    total_in: u64,
    total_out: u64,
    /// The next byte starts a frame.
    at_frame_start: bool,
    frames: u64,
    last_checkpoint_out: u64,
    index: GzipIndex,
}

impl std::fmt::Debug for ZstdIndexer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZstdIndexer")
            .field("spacing", &self.spacing)
            .field("total_in", &self.total_in)
            .field("total_out", &self.total_out)
            .field("frames", &self.frames)
            .field("checkpoints", &self.index.checkpoints.len())
            .finish()
    }
}

fn corrupt(offset: u64, message: impl std::fmt::Display) -> GzipError {
    GzipError::Corrupt { offset, message: format!("zstd: {message}") }
}

impl ZstdIndexer {
    /// An indexer recording a checkpoint at the first frame start `spacing` or more bytes after
    /// the previous one (`spacing` ≥ 1).
    pub fn new(spacing: u64) -> Result<Self, GzipError> {
        Ok(Self {
            decoder: zstd::stream::raw::Decoder::new().map_err(|e| corrupt(0, e))?,
            spacing: spacing.max(1),
            out: vec![0u8; 256 << 10],
            total_in: 0,
            total_out: 0,
            at_frame_start: true,
            frames: 0,
            last_checkpoint_out: 0,
            index: GzipIndex { codec: Codec::Zstd, ..GzipIndex::default() },
        })
    }

    /// Compressed bytes consumed so far.
    pub fn total_in(&self) -> u64 {
        self.total_in
    }

    /// Decode `input`, handing every uncompressed byte to `sink` in order.
    pub fn push<E>(
        &mut self,
        mut input: &[u8],
        sink: &mut dyn FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<(), PushError<E>> {
        use zstd::stream::raw::{InBuffer, Operation, OutBuffer};
        let mut stalled = 0;
        while !input.is_empty() {
            if self.at_frame_start {
                if self.index.checkpoints.is_empty()
                    || self.total_out - self.last_checkpoint_out >= self.spacing
                {
                    self.index.checkpoints.push(Checkpoint {
                        in_offset: self.total_in,
                        bits: 0,
                        out_offset: self.total_out,
                        window: Vec::new(),
                    });
                    self.index.span_ends.push(self.total_in);
                    self.last_checkpoint_out = self.total_out;
                }
                self.at_frame_start = false;
            }
            let mut out = std::mem::take(&mut self.out);
            let mut inb = InBuffer::around(input);
            let mut outb = OutBuffer::around(&mut out[..]);
            let hint = self.decoder.run(&mut inb, &mut outb);
            let (used, made) = (inb.pos(), outb.pos());
            let result =
                hint.map_err(|e| PushError::Gzip(corrupt(self.total_in + used as u64, e))).and_then(|hint| {
                    input = &input[used..];
                    self.total_in += used as u64;
                    if made > 0 {
                        sink(&out[..made]).map_err(PushError::Sink)?;
                        self.total_out += made as u64;
                    }
                    if hint == 0 {
                        // A frame ended (and all its bytes are out): the current span reaches here.
                        self.frames += 1;
                        self.at_frame_start = true;
                        if let Some(end) = self.index.span_ends.last_mut() {
                            *end = self.total_in;
                        }
                    }
                    stalled = if used == 0 && made == 0 && hint != 0 { stalled + 1 } else { 0 };
                    if stalled > 2 {
                        return Err(PushError::Gzip(corrupt(self.total_in, "the decoder makes no progress")));
                    }
                    Ok(())
                });
            self.out = out;
            result?;
        }
        Ok(())
    }

    /// The end of the stream: the index, or an error if it ended inside a frame.
    pub fn finish(mut self) -> Result<GzipIndex, GzipError> {
        if !self.at_frame_start {
            return Err(GzipError::Truncated { offset: self.total_in });
        }
        if self.frames == 0 {
            return Err(GzipError::Empty);
        }
        self.index.compressed_len = self.total_in;
        self.index.uncompressed_len = self.total_out;
        // A checkpoint followed only by frames without output (a trailing skippable frame) holds
        // an empty span.
        self.index.drop_empty_spans();
        Ok(self.index)
    }
}

/// Decode a span of zstd frames (their compressed bytes, whole) to its `len` bytes.
pub fn decode_zstd_span(stored: &[u8], len: u64) -> Result<Vec<u8>, GzipError> {
    let cap = usize::try_from(len).map_err(|_| GzipError::Range(format!("a span of {len} bytes")))?;
    let out = zstd::bulk::decompress(stored, cap).map_err(|e| corrupt(0, e))?;
    if out.len() as u64 != len {
        return Err(GzipError::ShortSpan { got: out.len() as u64, expected: len });
    }
    Ok(out)
}

/// A gzip or zstd indexer, by the stream's magic.
#[derive(Debug)]
pub enum AnyIndexer {
    Gzip(Indexer),
    Zstd(ZstdIndexer),
}

impl AnyIndexer {
    /// Compressed bytes consumed so far.
    pub fn total_in(&self) -> u64 {
        match self {
            AnyIndexer::Gzip(i) => i.total_in(),
            AnyIndexer::Zstd(i) => i.total_in(),
        }
    }

    pub fn push<E>(
        &mut self,
        input: &[u8],
        sink: &mut dyn FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<(), PushError<E>> {
        match self {
            AnyIndexer::Gzip(i) => i.push(input, sink),
            AnyIndexer::Zstd(i) => i.push(input, sink),
        }
    }

    pub fn finish(self) -> Result<GzipIndex, GzipError> {
        match self {
            AnyIndexer::Gzip(i) => i.finish(),
            AnyIndexer::Zstd(i) => i.finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                b"abcdefgh \n"[(x % 10) as usize]
            })
            .collect()
    }

    fn index(stream: &[u8], spacing: u64, piece: usize) -> (GzipIndex, Vec<u8>) {
        let mut ix = ZstdIndexer::new(spacing).unwrap();
        let mut out = Vec::new();
        for p in stream.chunks(piece) {
            ix.push(p, &mut |b: &[u8]| {
                out.extend_from_slice(b);
                Ok::<(), std::convert::Infallible>(())
            })
            .unwrap();
        }
        (ix.finish().unwrap(), out)
    }

    #[test]
    fn frames_become_spans_of_at_least_the_spacing() {
        // 40 frames of 100 KB, a skippable frame in the middle and one at the end.
        let data = text(4_000_000, 7);
        let mut stream = Vec::new();
        for (i, part) in data.chunks(100_000).enumerate() {
            stream.extend(zstd::bulk::compress(part, 3).unwrap());
            if i == 17 {
                stream.extend_from_slice(&[0x50, 0x2a, 0x4d, 0x18, 3, 0, 0, 0, 1, 2, 3]);
            }
        }
        stream.extend_from_slice(&[0x5e, 0x2a, 0x4d, 0x18, 2, 0, 0, 0, 9, 9]);
        for piece in [1 << 20, 4096, 777] {
            let (idx, out) = index(&stream, 1 << 20, piece);
            assert_eq!(out, data, "piece {piece}");
            assert_eq!(idx.codec, Codec::Zstd);
            assert_eq!(idx.uncompressed_len, data.len() as u64);
            assert_eq!(idx.compressed_len, stream.len() as u64);
            assert_eq!(idx.checkpoints.len(), 4, "a checkpoint every 1.1 MB: {:?}", idx.checkpoints.len());
            for k in 0..idx.checkpoints.len() {
                let span = idx.span(k).unwrap();
                let got = idx.decode_span(&stream, k).unwrap();
                let (a, b) = span.uncompressed;
                assert_eq!(got, &data[a as usize..b as usize], "span {k}");
                assert!(idx.checkpoints[k].window.is_empty() && idx.checkpoints[k].bits == 0);
            }
            assert_eq!(idx.read(&stream, 1_099_990, 2_300_000).unwrap(), &data[1_099_990..2_300_000]);
        }
    }

    #[test]
    fn one_frame_is_one_span_and_bad_streams_are_errors() {
        let data = text(300_000, 3);
        let one = zstd::bulk::compress(&data, 3).unwrap();
        let (idx, out) = index(&one, 1 << 16, 5000);
        assert_eq!((idx.checkpoints.len(), out.len()), (1, data.len()));
        // Cut short: truncated.
        let mut ix = ZstdIndexer::new(1 << 16).unwrap();
        let mut sink = |_: &[u8]| Ok::<(), std::convert::Infallible>(());
        ix.push(&one[..one.len() - 3], &mut sink).unwrap();
        assert!(matches!(ix.finish(), Err(GzipError::Truncated { .. })));
        // Not zstd at all.
        let mut ix = ZstdIndexer::new(1 << 16).unwrap();
        assert!(ix.push(b"not a zstd frame at all", &mut sink).is_err());
        assert!(matches!(ZstdIndexer::new(1).unwrap().finish(), Err(GzipError::Empty)));
        // A span decoded to the wrong length.
        assert!(decode_zstd_span(&one, 10).is_err());
        assert!(matches!(decode_zstd_span(&one, data.len() as u64 + 1), Err(GzipError::ShortSpan { .. })));
    }
}
