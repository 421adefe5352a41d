//! `gzip_index`: the gzip checkpoint index and span decoder (`tessera_gzip`), which serve a
//! `--reference-layers` image's bytes out of the source image's gzip layers.
//!
//! Input (tolerant, see [`crate::Input`]): a compression level byte, a spacing (u16, in 64-byte
//! units), a count of ranges and their (start, length) pairs as u32s, then the data itself
//! (repeated to make back-references). Properties: indexing the gzip of the data gives the data
//! back; every span decodes to its slice of the data; every range read through the index equals
//! the same range of a straight inflate. Then the same gzip bytes with one byte flipped (at an
//! input-chosen place): indexing fails or gives some stream, never a panic. The data itself, read
//! as deflate by the sparse-window parser (`tessera_gzip::sparse::window_use`), is an error or a
//! marking of the window, never a panic. (Every window the indexer stores is sparse where it can
//! be, so the span property above is also the sparse windows' property.)

use std::io::Write;

use crate::Input;

/// The fuzz target body.
pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let level = u32::from(input.u8() % 10);
    let spacing = u64::from(input.u16()).max(1) * 64;
    let ranges: Vec<(u32, u32)> = (0..input.u8() % 16).map(|_| (input.u32(), input.u32())).collect();
    let flip = input.u32();
    let body = input.rest();
    // Repeat the body with small changes so the stream has matches across checkpoints.
    let mut plain = Vec::with_capacity(body.len() * 4);
    for round in 0..4u8 {
        plain.extend(body.iter().map(|b| b.wrapping_add(round & 1)));
    }
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(level));
    e.write_all(&plain).unwrap();
    let blob = e.finish().unwrap();

    let (out, index) = tessera_gzip::index_all(&blob, spacing).unwrap();
    assert_eq!(out, plain, "indexing changed the bytes");
    assert_eq!(index.uncompressed_len, plain.len() as u64);
    for k in 0..index.checkpoints.len() {
        let span = index.span(k).unwrap();
        let got = index.decode_span(&blob, k).unwrap();
        assert_eq!(got, &plain[span.uncompressed.0 as usize..span.uncompressed.1 as usize], "span {k}");
    }
    if !plain.is_empty() {
        for (a, len) in ranges {
            let a = a as usize % plain.len();
            let b = (a + len as usize % (plain.len() - a + 1)).min(plain.len());
            let got = index.read(&blob, a as u64, b as u64).unwrap();
            assert_eq!(got, &plain[a..b], "range {a}..{b}");
        }
    }
    let mut bad = blob;
    let at = flip as usize % bad.len();
    bad[at] ^= 0x5a;
    let _ = tessera_gzip::index_all(&bad, spacing);
    let _ = tessera_gzip::sparse::window_use(body, (level % 8) as u8, tessera_gzip::WINDOW, 1 << 16);
}

/// Seeds: text, random-looking bytes, and an empty body.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let header = |level: u8, spacing: u16| {
        let mut h = vec![level];
        h.extend(spacing.to_le_bytes());
        h.push(3);
        for (a, l) in [(0u32, 100u32), (5000, 70_000), (123_456, 1)] {
            h.extend(a.to_le_bytes());
            h.extend(l.to_le_bytes());
        }
        h.extend(77u32.to_le_bytes());
        h
    };
    let text: Vec<u8> =
        b"the quick brown fox jumps over the lazy dog\n".iter().copied().cycle().take(60_000).collect();
    let mut x = 0x9e37_79b9u32;
    let noise: Vec<u8> = (0..40_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 7) as u8 + b'a'
        })
        .collect();
    vec![
        ("text".into(), [header(6, 64), text].concat()),
        ("noise".into(), [header(1, 16), noise].concat()),
        ("empty".into(), header(9, 1)),
    ]
}
