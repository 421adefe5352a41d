use std::io::Write;

use rand::{Rng, SeedableRng};

use super::*;

fn gzip(data: &[u8], level: u32) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(level));
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

/// Text-like data with long-range repeats (so windows matter) and random stretches.
fn sample(rng: &mut impl Rng, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        match rng.gen_range(0..3) {
            0 if out.len() > 100 => {
                let back = rng.gen_range(1..out.len().min(WINDOW));
                let n = rng.gen_range(3..300);
                for _ in 0..n {
                    out.push(out[out.len() - back]);
                }
            }
            1 => out.extend((0..rng.gen_range(1..200)).map(|_| rng.gen::<u8>())),
            _ => out.extend_from_slice(b"the quick brown fox jumps over the lazy dog\n"),
        }
    }
    out.truncate(len);
    out
}

fn check_ranges(blob: &[u8], data: &[u8], index: &GzipIndex, rng: &mut impl Rng, n: usize) {
    assert_eq!(index.uncompressed_len, data.len() as u64);
    assert_eq!(index.compressed_len, blob.len() as u64);
    for k in 0..index.checkpoints.len() {
        let span = index.span(k).unwrap();
        let got = index.decode_span(blob, k).unwrap();
        assert_eq!(got, &data[span.uncompressed.0 as usize..span.uncompressed.1 as usize], "span {k}");
    }
    for _ in 0..n {
        let a = rng.gen_range(0..data.len());
        let b = rng.gen_range(a..=data.len().min(a + 3 * (1 << 16)));
        assert_eq!(index.read(blob, a as u64, b as u64).unwrap(), &data[a..b], "range {a}..{b}");
    }
}

#[test]
fn every_range_equals_a_straight_inflate() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for (len, level, spacing) in
        [(1usize << 20, 6, 64 << 10), (300_000, 1, 1 << 14), (200_000, 9, 1), (10, 6, 1)]
    {
        let data = sample(&mut rng, len);
        let blob = gzip(&data, level);
        let (out, index) = index_all(&blob, spacing).unwrap();
        assert_eq!(out, data);
        assert!(!index.checkpoints.is_empty());
        assert_eq!(index.checkpoints[0].out_offset, 0);
        check_ranges(&blob, &data, &index, &mut rng, 50);
    }
}

#[test]
fn checkpoints_follow_the_spacing_and_carry_bits_and_windows() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let data = sample(&mut rng, 4 << 20);
    let blob = gzip(&data, 6);
    let (_, index) = index_all(&blob, 256 << 10).unwrap();
    let n = index.checkpoints.len();
    assert!((8..=17).contains(&n), "{n} checkpoints for 4 MiB at 256 KiB");
    assert!(index.checkpoints.iter().any(|c| c.bits != 0), "some boundary falls inside a byte");
    for w in index.checkpoints.windows(2) {
        assert!(w[1].out_offset - w[0].out_offset >= 256 << 10);
        assert!(w[1].in_offset > w[0].in_offset);
    }
    assert!(index.checkpoints[0].window.is_empty());
    assert_eq!(index.checkpoints[1].window().unwrap().len(), WINDOW);
}

#[test]
fn multi_member_streams_and_empty_members() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(2);
    let a = sample(&mut rng, 100_000);
    let b = sample(&mut rng, 150_000);
    let mut blob = gzip(&a, 6);
    blob.extend(gzip(b"", 6));
    blob.extend(gzip(&b, 1));
    let data = [a.clone(), b].concat();
    let (out, index) = index_all(&blob, 1 << 15).unwrap();
    assert_eq!(out, data);
    // Every member starts a span with an empty window; no span crosses members.
    assert!(index.checkpoints.iter().any(|c| c.out_offset == a.len() as u64 && c.window.is_empty()));
    check_ranges(&blob, &data, &index, &mut rng, 50);
}

#[test]
fn bad_streams_are_errors() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let data = sample(&mut rng, 200_000);
    let blob = gzip(&data, 6);
    assert!(matches!(index_all(&blob[..blob.len() / 2], 1 << 16), Err(GzipError::Truncated { .. })));
    assert!(matches!(index_all(&blob[..blob.len() - 4], 1 << 16), Err(GzipError::Truncated { .. })));
    assert!(matches!(index_all(b"", 1 << 16), Err(GzipError::Empty)));
    assert!(matches!(index_all(b"not gzip at all", 1 << 16), Err(GzipError::Corrupt { .. })));
    let mut bad = blob.clone();
    let n = bad.len();
    bad[n - 6] ^= 0xff; // the CRC
    assert!(matches!(index_all(&bad, 1 << 16), Err(GzipError::Corrupt { .. })));
    // A span fed the wrong bytes: an error or other bytes, never a panic; short input is an error.
    let (_, index) = index_all(&blob, 1 << 16).unwrap();
    let span = index.span(1).unwrap();
    let cp = &index.checkpoints[1];
    let bytes = &blob[span.compressed.0 as usize..span.compressed.1 as usize];
    let len = span.uncompressed.1 - span.uncompressed.0;
    assert!(inflate_span(&bytes[..bytes.len() / 2], cp.bits, &cp.window().unwrap(), len).is_err());
    assert!(index.read(&blob, 0, data.len() as u64 + 1).is_err());
}

/// The spacing measurement behind `DEFAULT_SPACING` (run with `--ignored --nocapture`).
#[test]
#[ignore]
fn measure_spacing() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    // TESSERA_GZIP_MEASURE=FILE measures on a real tar (the e2e suite's Debian root is one), gzip
    // -6 here, or on a gzip file as it is (an OCI layer blob).
    let (data, blob) = match std::env::var_os("TESSERA_GZIP_MEASURE") {
        Some(path) => {
            let file = std::fs::read(path).unwrap();
            if file.starts_with(&[0x1f, 0x8b]) {
                (index_all(&file, u64::MAX).unwrap().0, file)
            } else {
                let blob = gzip(&file, 6);
                (file, blob)
            }
        }
        None => {
            let data = sample(&mut rng, 64 << 20);
            let blob = gzip(&data, 6);
            (data, blob)
        }
    };
    for spacing in [256u64 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20] {
        let t = std::time::Instant::now();
        let (_, index) = index_all(&blob, spacing).unwrap();
        let indexing = t.elapsed();
        let windows: usize = index.checkpoints.iter().map(|c| c.window.len()).sum();
        // The same windows whole (single-member streams), as they were stored before.
        let whole: usize = index
            .checkpoints
            .iter()
            .filter(|c| !c.window.is_empty())
            .map(|c| {
                let at = c.out_offset as usize;
                zstd::bulk::compress(&data[at.saturating_sub(WINDOW)..at], WINDOW_ZSTD_LEVEL).unwrap().len()
            })
            .sum();
        let t = std::time::Instant::now();
        let reads = 200;
        for _ in 0..reads {
            let a = rng.gen_range(0..data.len() - 4096) as u64;
            index.read(&blob, a, a + 4096).unwrap();
        }
        let per = t.elapsed() / reads;
        println!(
            "spacing {} KiB: {} checkpoints, windows {} KiB compressed ({:.2}% of {} MiB gzip; whole {} KiB, {:.2}%), indexing {:?}, random 4 KiB read {:?}",
            spacing >> 10,
            index.checkpoints.len(),
            windows >> 10,
            100.0 * windows as f64 / blob.len() as f64,
            blob.len() >> 20,
            whole >> 10,
            100.0 * whole as f64 / blob.len() as f64,
            indexing,
            per
        );
    }
}

/// A span pushed in pieces of any size (one byte, and a first piece that is only the shared
/// byte of a checkpoint with bits) decodes as a prefix that only grows, to the span itself.
#[test]
fn a_span_inflated_as_it_arrives_shows_a_growing_prefix_of_itself() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let data = sample(&mut rng, 600_000);
    let blob = gzip(&data, 6);
    let (_, index) = index_all(&blob, 1 << 16).unwrap();
    assert!(index.checkpoints.iter().any(|c| c.bits > 0), "no checkpoint inside a byte: pick another sample");
    for k in 0..index.checkpoints.len() {
        let span = index.span(k).unwrap();
        let cp = &index.checkpoints[k];
        let bytes = &blob[span.compressed.0 as usize..span.compressed.1 as usize];
        let want = &data[span.uncompressed.0 as usize..span.uncompressed.1 as usize];
        for max_piece in [1usize, 7, 4096, bytes.len()] {
            let mut s = SpanInflater::new(cp.bits, &cp.window().unwrap(), want.len() as u64).unwrap();
            let (mut at, mut seen) = (0, 0);
            while at < bytes.len() {
                let n = if at == 0 { 1 } else { rng.gen_range(1..=max_piece).min(bytes.len() - at) };
                s.push(&bytes[at..at + n]).unwrap();
                at += n;
                let out = s.output();
                assert!(out.len() >= seen, "span {k}: the output shrank");
                assert_eq!(out, &want[..out.len()], "span {k}: a wrong prefix");
                seen = out.len();
            }
            assert_eq!(s.finish().unwrap(), want, "span {k}, pieces of at most {max_piece}");
        }
    }
    // Short input: the prefix so far, and an error at the end, not a short span.
    let span = index.span(1).unwrap();
    let cp = &index.checkpoints[1];
    let bytes = &blob[span.compressed.0 as usize..span.compressed.1 as usize];
    let len = span.uncompressed.1 - span.uncompressed.0;
    let mut s = SpanInflater::new(cp.bits, &cp.window().unwrap(), len).unwrap();
    s.push(&bytes[..bytes.len() / 2]).unwrap();
    assert!(!s.output().is_empty() && (s.output().len() as u64) < len);
    assert!(matches!(s.finish(), Err(GzipError::ShortSpan { .. })));
}

/// Bytes whose gzip has a block boundary right after `a` (a sync flush), then `b`.
fn gzip_flushed(a: &[u8], b: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(9));
    e.write_all(a).unwrap();
    e.flush().unwrap();
    e.write_all(b).unwrap();
    e.finish().unwrap()
}

/// A span that copies one stretch of the bytes before it keeps exactly that stretch of its
/// window (and what chance matches reach); the rest is stored as zeros, and the span decodes.
#[test]
fn a_window_keeps_only_the_bytes_its_span_reaches() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(21);
    let before: Vec<u8> = (0..WINDOW).map(|_| rng.gen()).collect();
    // (zlib matches reach at most 32 KiB - 262 bytes back.)
    let (from, to) = (WINDOW - 1000, WINDOW - 700);
    let mut after = before[from..to].to_vec();
    after.extend((0..50_000).map(|_| rng.gen::<u8>()));
    let blob = gzip_flushed(&before, &after);
    let (out, index) = index_all(&blob, WINDOW as u64).unwrap();
    assert_eq!(out, [before.clone(), after.clone()].concat());
    let cp =
        index.checkpoints.iter().find(|c| c.out_offset == WINDOW as u64).expect("a checkpoint at the flush");
    let window = cp.window().unwrap();
    assert_eq!(window.len(), WINDOW);
    assert_eq!(&window[from..to], &before[from..to], "the copied stretch is kept");
    let kept = window.iter().zip(&before).filter(|(w, b)| w == b && **b != 0).count();
    assert!(kept < 300 + 200, "{kept} bytes kept: only the copy and a few chance matches");
    // Whole, the window compresses to ~32 KiB of random bytes; sparse, to little more than the copy.
    assert!(cp.window.len() < 2_000, "stored window {} bytes", cp.window.len());
    check_ranges(&blob, &out, &index, &mut rng, 20);
}

/// On text-like data most window bytes go unused and every span still decodes from its sparse
/// window; a window whose span reaches all of it stays whole.
#[test]
fn sparse_windows_shrink_the_index_and_decode_the_same() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(22);
    let data = sample(&mut rng, 2 << 20);
    let blob = gzip(&data, 6);
    let (_, index) = index_all(&blob, 128 << 10).unwrap();
    let mut zeros = 0usize;
    let mut total = 0usize;
    for (k, cp) in index.checkpoints.iter().enumerate().skip(1) {
        let w = cp.window().unwrap();
        let at = cp.out_offset as usize;
        let real = &data[at - WINDOW..at];
        assert_eq!(w.len(), WINDOW, "checkpoint {k}");
        // Every byte kept is the real one.
        assert!(w.iter().zip(real).all(|(a, b)| *a == 0 || a == b), "checkpoint {k} keeps other bytes");
        zeros += w.iter().zip(real).filter(|(a, b)| **a == 0 && **b != 0).count();
        total += WINDOW;
    }
    assert!(zeros * 4 > total, "only {zeros} of {total} window bytes dropped");
    check_ranges(&blob, &data, &index, &mut rng, 50);
}

/// The parser reads a stream zlib wrote exactly as zlib does: every distance it reports into the
/// window is one the zlib-checked result keeps. When what it is given does not reproduce the
/// span's bytes, the whole window is kept; bad input is an error, never a panic.
#[test]
fn a_window_that_does_not_reproduce_its_span_is_kept_whole() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(23);
    let before = sample(&mut rng, WINDOW);
    // Shorter than the spacing: the span after the flush is all of it.
    let after = sample(&mut rng, 30_000);
    let blob = gzip_flushed(&before, &after);
    let (_, index) = index_all(&blob, WINDOW as u64).unwrap();
    let k = index.checkpoints.iter().position(|c| c.out_offset == WINDOW as u64).unwrap();
    let cp = &index.checkpoints[k];
    let span = index.span(k).unwrap();
    assert_eq!(span.uncompressed, (WINDOW as u64, (WINDOW + after.len()) as u64));
    let compressed = &blob[span.compressed.0 as usize..span.compressed.1 as usize];
    let sparse = sparse::settle(cp.bits, before.clone(), compressed, &after);
    assert_ne!(sparse, before, "text-like data leaves some window bytes unused");
    assert_eq!(cp.window().unwrap(), sparse, "the indexer stores the same window");
    assert_eq!(inflate_span(compressed, cp.bits, &sparse, after.len() as u64).unwrap(), after);
    // Wrong span bytes: the whole window.
    let mut wrong = after.clone();
    wrong[7] ^= 1;
    assert_eq!(sparse::settle(cp.bits, before.clone(), compressed, &wrong), before);
    // Garbage and truncations: errors, no panic.
    for n in 0..200 {
        let junk: Vec<u8> = (0..rng.gen_range(0..4000)).map(|_| rng.gen()).collect();
        let _ = sparse::window_use(&junk, (n % 8) as u8, WINDOW, WINDOW);
    }
    for cut in [0, 1, 10, compressed.len() / 3] {
        assert!(
            sparse::window_use(&compressed[..cut], cp.bits, WINDOW, after.len()).is_err(),
            "cut at {cut}"
        );
    }
    assert!(sparse::window_use(compressed, 8, WINDOW, after.len()).is_err());
}

/// Input pushed in pieces of any size gives the index one push gives, sparse windows included.
#[test]
fn pieces_give_the_same_index() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(24);
    // Random stretches longer than a window make stored blocks, which the inflater hands on
    // before their end.
    let random =
        |rng: &mut rand::rngs::StdRng, n: usize| (0..n).map(|_| rng.gen::<u8>()).collect::<Vec<u8>>();
    let data = [
        sample(&mut rng, 300_000),
        random(&mut rng, 150_000),
        sample(&mut rng, 300_000),
        random(&mut rng, 90_000),
    ]
    .concat();
    let blob = gzip(&data, 6);
    let (_, whole) = index_all(&blob, 64 << 10).unwrap();
    for piece in [1usize, 777, 4096, 16 << 10, 100_000] {
        let mut ix = Indexer::new(64 << 10).unwrap();
        for p in blob.chunks(piece) {
            ix.push(p, &mut |_: &[u8]| Ok::<(), ()>(())).unwrap();
        }
        assert_eq!(ix.finish().unwrap(), whole, "pieces of {piece}");
    }
    check_ranges(&blob, &data, &whole, &mut rng, 20);
}
