//! The uncompressed metadata prefix an open image holds, and its decompression.
//!
//! A start spends most of its CPU here (perf of a start against a local origin, 14 MiB prefix:
//! decompression ~32 % with its page faults ~20 %, the sha256 of the result ~27 %). So the
//! bytes are decompressed straight into their final buffer — no zeroing pass, no copy — and a
//! prefix of 2 MiB or more lives in an anonymous mapping advised `MADV_HUGEPAGE`, 2 MiB-aligned:
//! its first touch costs one fault per 2 MiB instead of one per 4 KiB (on this project's nested
//! VM a fault costs several µs), and later reads of inode tables miss the TLB less. Where the
//! kernel gives no huge pages the mapping is one of small pages, as a heap buffer would be.

use memmap2::{Advice, MmapMut, MmapOptions};
use tessera_image::Sha256Digest;
use zstd::zstd_safe::{DCtx, InBuffer, OutBuffer};

/// Why a prefix could not be made: its bytes are not what the record says (a corrupt blob), or
/// this host has no memory for it (its address space refused: a resource, not the data).
#[derive(Debug)]
pub(crate) enum InflateError {
    Corrupt(String),
    Memory { bytes: usize, source: std::io::Error },
}

impl From<String> for InflateError {
    fn from(reason: String) -> Self {
        Self::Corrupt(reason)
    }
}

impl std::fmt::Display for InflateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Corrupt(reason) => f.write_str(reason),
            Self::Memory { bytes, source } => write!(f, "no memory for its {bytes} bytes: {source}"),
        }
    }
}

/// A huge page (x86-64 and aarch64 with 4 KiB pages).
const HUGE_PAGE: usize = 2 << 20;

/// The prefix's bytes.
pub(crate) struct PrefixBuf(Repr);

enum Repr {
    Heap(Vec<u8>),
    /// `len` bytes at `start` of `map`.
    Mapped {
        map: MmapMut,
        start: usize,
        len: usize,
    },
}

impl std::fmt::Debug for PrefixBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.0 {
            Repr::Heap(_) => "heap",
            Repr::Mapped { .. } => "mapped",
        };
        write!(f, "PrefixBuf({kind}, {} bytes)", self.len())
    }
}

impl std::ops::Deref for PrefixBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.0 {
            Repr::Heap(v) => v,
            Repr::Mapped { map, start, len } => &map[*start..*start + *len],
        }
    }
}

impl PrefixBuf {
    /// An empty prefix.
    pub(crate) fn empty() -> Self {
        Self(Repr::Heap(Vec::new()))
    }

    /// Zeroed room for `room` bytes: a 2 MiB-aligned huge-page mapping from 2 MiB on (the one
    /// byte beyond a prefix's length shows a stream that is longer than the record says).
    fn zeroed(room: usize) -> Result<Self, InflateError> {
        if room < HUGE_PAGE {
            return Ok(Self(Repr::Heap(vec![0; room])));
        }
        let cannot = |source: std::io::Error| InflateError::Memory { bytes: room, source };
        let whole =
            room.checked_add(HUGE_PAGE).ok_or_else(|| cannot(std::io::ErrorKind::OutOfMemory.into()))?;
        let map = MmapOptions::new().len(whole).map_anon().map_err(cannot)?;
        let start = (HUGE_PAGE - map.as_ptr() as usize % HUGE_PAGE) % HUGE_PAGE;
        // Advice only: without huge pages the mapping works the same.
        let _ = map.advise_range(Advice::HugePage, start, room);
        Ok(Self(Repr::Mapped { map, start, len: room }))
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.0 {
            Repr::Heap(v) => v,
            Repr::Mapped { map, start, len } => &mut map[*start..*start + *len],
        }
    }

    fn truncate(&mut self, n: usize) {
        match &mut self.0 {
            Repr::Heap(v) => v.truncate(n),
            Repr::Mapped { len, .. } => *len = (*len).min(n),
        }
    }
}

/// A prefix decompressed as its compressed bytes come in ([`Self::feed`]), into its final
/// buffer, hashed (sha256) as it is made while the bytes are still in cache; [`Self::finish`]
/// checks the length. The one decompressor of prefixes, whole ([`decompress`]) or streamed as a
/// blob arrives.
pub(crate) struct Inflater {
    buf: PrefixBuf,
    /// Bytes allowed: the expected length and one more, which shows a longer stream; before
    /// [`Self::settle`], [`EARLY_ROOM`].
    room: usize,
    /// Whether the expected length is known.
    settled: bool,
    made: usize,
    hashed: usize,
    hasher: sha2::Sha256,
    dctx: DCtx<'static>,
    /// Whether the input so far ends where a frame ends.
    at_frame_end: bool,
}

/// Output an [`Inflater`] may make before the record says the prefix's length: a prefix that
/// arrives before its record is inflated as it comes, up to this bound (a mapping's address
/// space; only what is made is memory), then waits. An entry naming a bigger blob than the
/// record's prefix costs at most this before the record refuses it.
pub(crate) const EARLY_ROOM: usize = 64 << 20;

/// A length in bytes, and the room for it (one more byte shows a longer stream).
fn room_for(expected: u64) -> Result<usize, String> {
    let expected =
        usize::try_from(expected).map_err(|_| format!("its {expected} bytes do not fit in memory"))?;
    expected.checked_add(1).ok_or_else(|| "its length does not fit in memory".to_owned())
}

impl Inflater {
    /// For a prefix of `expected` bytes.
    pub(crate) fn new(expected: u64) -> Result<Self, InflateError> {
        let room = room_for(expected)?;
        Self::with_room(room, true)
    }

    /// For a prefix whose length is not known yet ([`Self::settle`] says it).
    pub(crate) fn early() -> Result<Self, InflateError> {
        Self::with_room(EARLY_ROOM, false)
    }

    fn with_room(room: usize, settled: bool) -> Result<Self, InflateError> {
        use sha2::Digest;
        Ok(Self {
            buf: PrefixBuf::zeroed(room)?,
            room,
            settled,
            made: 0,
            hashed: 0,
            hasher: sha2::Sha256::new(),
            dctx: DCtx::create(),
            at_frame_end: true,
        })
    }

    /// Decompress the next compressed bytes (a zstd stream: one frame or more); how many of
    /// them it took: all, unless an unsettled inflater filled [`EARLY_ROOM`] (the rest waits
    /// for [`Self::settle`]).
    pub(crate) fn feed(&mut self, compressed: &[u8]) -> Result<usize, InflateError> {
        use sha2::Digest;
        let zstd = |code| format!("it does not decompress: {}", zstd::zstd_safe::get_error_name(code));
        let mut input = InBuffer::around(compressed);
        while input.pos() < compressed.len() {
            if self.made == self.room {
                if self.settled {
                    return Err("it decompresses to more than expected".to_owned().into());
                }
                break;
            }
            let (hint, made) = {
                let mut output = OutBuffer::around_pos(&mut self.buf.as_mut_slice()[..self.room], self.made);
                let hint = self.dctx.decompress_stream(&mut output, &mut input).map_err(zstd)?;
                (hint, output.pos())
            };
            self.made = made;
            self.at_frame_end = hint == 0;
        }
        if self.settled && self.made == self.room {
            return Err("it decompresses to more than expected".to_owned().into());
        }
        self.hasher.update(&self.buf[self.hashed..self.made]);
        self.hashed = self.made;
        Ok(input.pos())
    }

    /// Whether the expected length is known.
    pub(crate) fn settled(&self) -> bool {
        self.settled
    }

    /// The prefix is `expected` bytes long (the record says so).
    pub(crate) fn settle(&mut self, expected: u64) -> Result<(), InflateError> {
        let room = room_for(expected)?;
        if self.made >= room {
            return Err("it decompresses to more than expected".to_owned().into());
        }
        // Into a buffer of the size it needs: bigger than the early room; or, for a prefix under
        // a huge page, the heap (the early room's mapping would hold a 2 MiB page for it).
        if room > self.buf.len() || (room < HUGE_PAGE && matches!(self.buf.0, Repr::Mapped { .. })) {
            let mut fitted = PrefixBuf::zeroed(room)?;
            fitted.as_mut_slice()[..self.made].copy_from_slice(&self.buf[..self.made]);
            self.buf = fitted;
        }
        (self.room, self.settled) = (room, true);
        Ok(())
    }

    /// The prefix and its sha256, if the stream ended where a frame ends, at the expected length.
    pub(crate) fn finish(mut self) -> Result<(PrefixBuf, Sha256Digest), InflateError> {
        use sha2::Digest;
        if !self.settled {
            return Err("its length is not known".to_owned().into());
        }
        let expected = self.room - 1;
        if !self.at_frame_end || (self.made == 0 && expected > 0) {
            return Err("it does not decompress: its zstd frame is truncated".to_owned().into());
        }
        if self.made != expected {
            return Err(format!("it decompresses to {} bytes, expected {expected}", self.made).into());
        }
        self.buf.truncate(expected);
        Ok((self.buf, Sha256Digest(self.hasher.finalize().into())))
    }
}

/// Decompress `compressed` (a zstd stream: one frame or more) into exactly `expected` bytes, with
/// its sha256, or say why not.
pub(crate) fn decompress(
    compressed: &[u8],
    expected: u64,
) -> Result<(PrefixBuf, Sha256Digest), InflateError> {
    let mut inflater = Inflater::new(expected)?;
    inflater.feed(compressed)?;
    inflater.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_decompresses_to_exactly_the_recorded_length_or_is_refused() {
        // Small (on the heap) and large (mapped) prefixes alike.
        for len in [300_000u32, 1_200_000] {
            let data: Vec<u8> = (0..len).flat_map(|i| (i % 251).to_le_bytes()).collect();
            let z = zstd::encode_all(&data[..], 3).unwrap();
            let n = data.len() as u64;
            let (prefix, digest) = decompress(&z, n).unwrap();
            assert_eq!((&*prefix, digest), (&data[..], Sha256Digest::of(&data)));
            // Fed in pieces of any size, as a blob arrives: the same bytes and digest.
            for piece in [1, 7, 4096, 65_536] {
                let mut inflater = Inflater::new(n).unwrap();
                for p in z.chunks(piece) {
                    inflater.feed(p).unwrap();
                }
                let (prefix, d) = inflater.finish().unwrap();
                assert_eq!((&*prefix, d), (&data[..], digest), "pieces of {piece}");
            }
            // Longer or shorter than the record says.
            assert!(decompress(&z, n - 1).unwrap_err().to_string().contains("more than"), "longer");
            assert!(
                decompress(&z, n + 4096).unwrap_err().to_string().contains(&format!("to {n} bytes")),
                "shorter"
            );
            // A truncated frame, garbage, nothing.
            assert!(decompress(&z[..z.len() / 2], n).unwrap_err().to_string().contains("truncated"));
            assert!(decompress(b"not zstd at all", n)
                .unwrap_err()
                .to_string()
                .contains("does not decompress"));
            assert!(decompress(&[], n).is_err());
            // Two frames one after the other are one stream, as for any zstd reader.
            let (a, b) = data.split_at(100_000);
            let mut two = zstd::encode_all(a, 1).unwrap();
            two.extend(zstd::encode_all(b, 1).unwrap());
            assert_eq!(&*decompress(&two, n).unwrap().0, &data[..]);
        }
        // An empty prefix.
        assert!(decompress(&zstd::encode_all(&[][..], 3).unwrap(), 0).unwrap().0.is_empty());
        // A record claiming more than memory holds fails cleanly, allocating nothing.
        for huge in [1u64 << 50, u64::MAX / 2, u64::MAX] {
            assert!(decompress(&zstd::encode_all(&[1u8; 10][..], 3).unwrap(), huge).is_err());
        }
        // One whose address space this host refuses says so: no memory, not corrupt data.
        assert!(matches!(
            decompress(&zstd::encode_all(&[1u8; 10][..], 3).unwrap(), 1u64 << 50),
            Err(InflateError::Memory { .. })
        ));
    }

    #[test]
    fn an_early_inflater_waits_at_its_room_and_goes_on_once_told_the_length() {
        // Larger than the early room: it takes what fits, then the rest once settled.
        let data: Vec<u8> = (0..EARLY_ROOM + 3 * 4096).map(|i| (i / 4096 % 7) as u8).collect();
        let z = zstd::encode_all(&data[..], 1).unwrap();
        let mut early = Inflater::early().unwrap();
        let took = early.feed(&z).unwrap();
        assert!(took < z.len(), "it took all {took} bytes past its room");
        assert!(early.finish().is_err(), "no length yet");
        let mut early = Inflater::early().unwrap();
        let took = early.feed(&z).unwrap();
        early.settle(data.len() as u64).unwrap();
        assert_eq!(early.feed(&z[took..]).unwrap(), z.len() - took);
        let (prefix, digest) = early.finish().unwrap();
        assert_eq!((prefix.len(), digest), (data.len(), Sha256Digest::of(&data)));
        assert!(*prefix == data[..]);
        // A small prefix settles on the heap, not in the early room's mapping.
        let small: Vec<u8> = (0..100_000u32).map(|i| (i % 13) as u8).collect();
        let mut early = Inflater::early().unwrap();
        early.feed(&zstd::encode_all(&small[..], 1).unwrap()).unwrap();
        early.settle(small.len() as u64).unwrap();
        let (prefix, _) = early.finish().unwrap();
        assert!(matches!(prefix.0, Repr::Heap(_)) && *prefix == small[..]);
        // Told a length shorter than what it made already, or than the stream: refused.
        let small: Vec<u8> = (0..100_000u32).map(|i| (i % 13) as u8).collect();
        let z = zstd::encode_all(&small[..], 1).unwrap();
        let mut early = Inflater::early().unwrap();
        early.feed(&z).unwrap();
        assert!(early.settle(99_999).unwrap_err().to_string().contains("more than"));
        let mut early = Inflater::early().unwrap();
        let half = early.feed(&z[..z.len() / 2]).unwrap();
        early.settle(1000).unwrap();
        assert!(early.feed(&z[half..]).unwrap_err().to_string().contains("more than"));
    }

    #[test]
    fn an_early_room_full_in_the_last_block_still_gives_the_whole_prefix() {
        // The room fills inside the stream's last block: what the decoder holds comes out with
        // the bytes still pending once settled — zstd takes the last input byte only once its
        // output is out, so the pending bytes are never empty here (were they, the rest of the
        // prefix would be lost and this test fail).
        const ROOM: usize = 1 << 20;
        for extra in [1usize, 1000, 4096, 50_000, 127_000, 200_000] {
            let data: Vec<u8> =
                (0..ROOM + extra).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
            for level in [1, 3, 19] {
                let z = zstd::encode_all(&data[..], level).unwrap();
                let mut early = Inflater::with_room(ROOM, false).unwrap();
                let took = early.feed(&z).unwrap();
                early.settle(data.len() as u64).unwrap();
                assert_eq!(early.feed(&z[took..]).unwrap(), z.len() - took);
                let (prefix, digest) = early.finish().unwrap();
                assert_eq!(digest, Sha256Digest::of(&data), "{extra} bytes past the room, level {level}");
                assert!(*prefix == data[..]);
            }
        }
    }

    #[test]
    fn a_large_prefix_sits_on_a_huge_page_boundary() {
        let buf = PrefixBuf::zeroed(5 << 20).unwrap();
        assert!(matches!(buf.0, Repr::Mapped { .. }));
        assert_eq!(buf.as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(buf.len(), 5 << 20);
        assert!(buf.iter().all(|&b| b == 0));
    }
}
