//! Sparse windows: which bytes of a checkpoint's 32 KiB window its span actually reads.
//!
//! Only the first 32 KiB of a span's output can reach back before the span's start (a deflate
//! distance is at most 32 KiB), and most of those back-references land inside the span itself.
//! The window bytes no back-reference reaches are never read by the inflater, so they can be
//! stored as zeros, which zstd all but removes: the stored windows shrink, and with them what a
//! finer checkpoint spacing costs. Which bytes are reached is a property of the deflate stream
//! that zlib does not report, so [`window_use`] parses the span's first blocks itself (RFC 1951:
//! stored, fixed and dynamic Huffman blocks), counting output positions without producing any
//! output. The [`crate::Indexer`] then checks its result with zlib: the span's first bytes are
//! inflated from the sparse window and compared with the real ones; a window that does not
//! reproduce them is kept whole.

/// Why a span's first blocks could not be parsed: the caller keeps the whole window.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// The compressed bytes end before the output limit or the final block.
    #[error("the compressed bytes end inside a block")]
    Truncated,
    /// The bytes are not valid deflate (bad block type, code, length or distance).
    #[error("invalid deflate data: {0}")]
    Invalid(&'static str),
}

/// Bits read least significant first, starting `skip` bits into the first byte.
struct Bits<'a> {
    data: &'a [u8],
    pos: usize,
    acc: u64,
    have: u32,
}

impl<'a> Bits<'a> {
    fn new(data: &'a [u8], skip: u32) -> Result<Self, ParseError> {
        let mut b = Self { data, pos: 0, acc: 0, have: 0 };
        if skip > 0 {
            b.need(skip)?;
            b.drop(skip);
        }
        Ok(b)
    }

    fn need(&mut self, n: u32) -> Result<(), ParseError> {
        while self.have < n {
            let &byte = self.data.get(self.pos).ok_or(ParseError::Truncated)?;
            self.pos += 1;
            self.acc |= u64::from(byte) << self.have;
            self.have += 8;
        }
        Ok(())
    }

    fn drop(&mut self, n: u32) {
        self.acc >>= n;
        self.have -= n;
    }

    /// `n` ≤ 16 bits as an integer, first bit lowest.
    fn take(&mut self, n: u32) -> Result<u32, ParseError> {
        if n == 0 {
            return Ok(0);
        }
        self.need(n)?;
        let v = (self.acc & ((1u64 << n) - 1)) as u32;
        self.drop(n);
        Ok(v)
    }

    /// Skip to the next byte boundary.
    fn align(&mut self) {
        let r = self.have % 8;
        self.drop(r);
    }
}

/// Codes up to this many bits are decoded by one table lookup.
const FAST_BITS: u32 = 9;

/// A canonical Huffman code: how many codes of each length, the symbols in code order, and a
/// table of the short codes by their next [`FAST_BITS`] bits as they arrive (least significant
/// first): `symbol << 4 | length`, 0 where a longer code starts.
struct Huffman {
    count: [u16; 16],
    symbols: Vec<u16>,
    fast: Vec<u16>,
}

impl Huffman {
    fn new(lengths: &[u8]) -> Result<Self, ParseError> {
        let mut count = [0u16; 16];
        for &l in lengths {
            count[usize::from(l)] += 1;
        }
        count[0] = 0;
        // Over-subscribed lengths are invalid; incomplete codes are allowed (a lone distance
        // code is one) and fail only if an unused code turns up.
        let mut left: i32 = 1;
        for &c in &count[1..] {
            left = (left << 1) - i32::from(c);
            if left < 0 {
                return Err(ParseError::Invalid("over-subscribed code lengths"));
            }
        }
        let mut offs = [0u16; 16];
        for len in 1..15 {
            offs[len + 1] = offs[len] + count[len];
        }
        let mut symbols = vec![0u16; lengths.len()];
        for (sym, &l) in lengths.iter().enumerate() {
            if l != 0 {
                symbols[usize::from(offs[usize::from(l)])] = sym as u16;
                offs[usize::from(l)] += 1;
            }
        }
        // Canonical codes (RFC 1951 3.2.2), stored bit-reversed: the stream sends a code's
        // most significant bit first.
        let mut fast = vec![0u16; 1 << FAST_BITS];
        let mut next = [0u32; 16];
        let mut code = 0u32;
        for len in 1..16 {
            code = (code + u32::from(count[len - 1])) << 1;
            next[len] = code;
        }
        next[1] = 0;
        for (sym, &l) in lengths.iter().enumerate() {
            let l = u32::from(l);
            if l == 0 {
                continue;
            }
            let c = next[l as usize];
            next[l as usize] += 1;
            if l <= FAST_BITS {
                let rev = c.reverse_bits() >> (32 - l);
                let entry = (sym as u16) << 4 | l as u16;
                for high in 0..1u32 << (FAST_BITS - l) {
                    fast[(rev | high << l) as usize] = entry;
                }
            }
        }
        Ok(Self { count, symbols, fast })
    }

    /// The next symbol: code bits arrive most significant first, one at a time.
    fn decode(&self, bits: &mut Bits<'_>) -> Result<u16, ParseError> {
        if bits.need(FAST_BITS).is_ok() {
            let entry = self.fast[(bits.acc & ((1 << FAST_BITS) - 1)) as usize];
            if entry != 0 {
                bits.drop(u32::from(entry & 15));
                return Ok(entry >> 4);
            }
        }
        let (mut code, mut first, mut index) = (0i32, 0i32, 0i32);
        for len in 1..16 {
            code |= bits.take(1)? as i32;
            let count = i32::from(self.count[len]);
            if code - first < count {
                return self
                    .symbols
                    .get((index + code - first) as usize)
                    .copied()
                    .ok_or(ParseError::Invalid("code out of range"));
            }
            index += count;
            first = (first + count) << 1;
            code <<= 1;
        }
        Err(ParseError::Invalid("unused code"))
    }
}

const LENGTH_BASE: [u16; 29] = [
    3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195,
    227, 258,
];
const LENGTH_EXTRA: [u8; 29] =
    [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0];
const DIST_BASE: [u16; 30] = [
    1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769, 1025, 1537, 2049, 3073,
    4097, 6145, 8193, 12289, 16385, 24577,
];
const DIST_EXTRA: [u8; 30] =
    [0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13];
/// The order in which a dynamic block gives its code-length code's lengths.
const CLEN_ORDER: [usize; 19] = [16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15];

fn fixed_codes() -> Result<(Huffman, Huffman), ParseError> {
    let mut lit = [0u8; 288];
    lit[..144].fill(8);
    lit[144..256].fill(9);
    lit[256..280].fill(7);
    lit[280..].fill(8);
    Ok((Huffman::new(&lit)?, Huffman::new(&[5u8; 30])?))
}

fn dynamic_codes(bits: &mut Bits<'_>) -> Result<(Huffman, Huffman), ParseError> {
    let nlen = bits.take(5)? as usize + 257;
    let ndist = bits.take(5)? as usize + 1;
    let ncode = bits.take(4)? as usize + 4;
    if nlen > 286 || ndist > 30 {
        return Err(ParseError::Invalid("too many length or distance codes"));
    }
    let mut clens = [0u8; 19];
    for &at in &CLEN_ORDER[..ncode] {
        clens[at] = bits.take(3)? as u8;
    }
    let clen = Huffman::new(&clens)?;
    let mut lengths = [0u8; 286 + 30];
    let mut n = 0;
    while n < nlen + ndist {
        let sym = clen.decode(bits)?;
        let (value, times) = match sym {
            0..=15 => (sym as u8, 1),
            16 => {
                let prev = *n
                    .checked_sub(1)
                    .and_then(|p| lengths.get(p))
                    .ok_or(ParseError::Invalid("repeat with no length"))?;
                (prev, 3 + bits.take(2)? as usize)
            }
            17 => (0, 3 + bits.take(3)? as usize),
            _ => (0, 11 + bits.take(7)? as usize),
        };
        if n + times > nlen + ndist {
            return Err(ParseError::Invalid("code lengths overrun"));
        }
        lengths[n..n + times].fill(value);
        n += times;
    }
    if lengths[256] == 0 {
        return Err(ParseError::Invalid("no end-of-block code"));
    }
    Ok((Huffman::new(&lengths[..nlen])?, Huffman::new(&lengths[nlen..nlen + ndist])?))
}

/// Which bytes of a `window_len`-byte window (the output just before the span, oldest first) the
/// first `out_limit` bytes of the span's output reach back into. `compressed` starts at the
/// checkpoint's [`crate::Checkpoint::start`]; with `bits` > 0 its first byte is shared with the
/// span before, whose low `8 - bits` bits are not the span's. Stops at `out_limit` or at the end
/// of the final block, whichever comes first.
pub fn window_use(
    compressed: &[u8],
    bits: u8,
    window_len: usize,
    out_limit: usize,
) -> Result<Vec<bool>, ParseError> {
    if bits > 7 {
        return Err(ParseError::Invalid("checkpoint bit count over 7"));
    }
    let mut used = vec![false; window_len];
    let mut b = Bits::new(compressed, if bits > 0 { 8 - u32::from(bits) } else { 0 })?;
    let mut out = 0usize;
    while out < out_limit {
        let last = b.take(1)? == 1;
        match b.take(2)? {
            0 => {
                b.align();
                let len = b.take(16)?;
                if b.take(16)? != !len & 0xffff {
                    return Err(ParseError::Invalid("stored block length check"));
                }
                // Stored bytes: whole bytes after the alignment, so the reader holds none.
                debug_assert_eq!(b.have % 8, 0);
                let start = b.pos - (b.have / 8) as usize;
                if compressed.len() < start + len as usize {
                    // The inflater hands stored bytes on as they come: a limit inside the block
                    // needs only the bytes up to it (and stored bytes reach no window).
                    if out + (compressed.len() - start) >= out_limit {
                        return Ok(used);
                    }
                    return Err(ParseError::Truncated);
                }
                b = Bits { data: compressed, pos: start + len as usize, acc: 0, have: 0 };
                out += len as usize;
            }
            kind @ (1 | 2) => {
                let (lit, dist) = if kind == 1 { fixed_codes()? } else { dynamic_codes(&mut b)? };
                loop {
                    let sym = lit.decode(&mut b)?;
                    match sym {
                        0..=255 => out += 1,
                        256 => break,
                        _ => {
                            let i = usize::from(sym - 257);
                            let (&base, &extra) = LENGTH_BASE
                                .get(i)
                                .zip(LENGTH_EXTRA.get(i))
                                .ok_or(ParseError::Invalid("length code"))?;
                            let len = usize::from(base) + b.take(u32::from(extra))? as usize;
                            let d = usize::from(dist.decode(&mut b)?);
                            let (&base, &extra) = DIST_BASE
                                .get(d)
                                .zip(DIST_EXTRA.get(d))
                                .ok_or(ParseError::Invalid("distance code"))?;
                            let distance = usize::from(base) + b.take(u32::from(extra))? as usize;
                            if distance > out {
                                // Reaches `distance - out` bytes back into the window.
                                let back = distance - out;
                                if back > window_len {
                                    return Err(ParseError::Invalid("distance beyond the window"));
                                }
                                let from = window_len - back;
                                let n = len.min(back);
                                used[from..from + n].fill(true);
                            }
                            out += len;
                        }
                    }
                    if out >= out_limit {
                        return Ok(used);
                    }
                }
            }
            _ => return Err(ParseError::Invalid("block type 3")),
        }
        if last {
            break;
        }
    }
    Ok(used)
}

/// `window` with every byte `used` does not mark set to zero.
pub fn sparse_window(window: &[u8], used: &[bool]) -> Vec<u8> {
    window.iter().zip(used).map(|(&w, &u)| if u { w } else { 0 }).collect()
}

/// The window to store for a checkpoint whose span's first bytes `out` (its first [`WINDOW`]
/// bytes, or all of a shorter span) came from `compressed`: `window` with the bytes no
/// back-reference reaches zeroed, if zlib inflates exactly `out` from it; else `window` whole.
///
/// [`WINDOW`]: crate::WINDOW
pub(crate) fn settle(bits: u8, window: Vec<u8>, compressed: &[u8], out: &[u8]) -> Vec<u8> {
    let Ok(used) = window_use(compressed, bits, window.len(), out.len()) else { return window };
    let sparse = sparse_window(&window, &used);
    let same = crate::SpanInflater::new(bits, &sparse, out.len() as u64)
        .is_ok_and(|mut s| s.push(compressed).is_ok() && s.output() == out);
    if same {
        sparse
    } else {
        window
    }
}
