//! `byteranges`: the `multipart/byteranges` answer to a multi-range GET
//! ([`tessera_store::byteranges`]), read from an origin for every scattered batch of chunks a
//! daemon prefetches: the origin is untrusted.
//!
//! Input: a `Content-Type` line, a newline, then the body. Properties: never a panic; every part
//! parsed is a slice of the body as long as its `Content-Range` says and starts where it says;
//! [`place`] of each part's own span gives back its bytes, and of a span one byte past any part
//! fails; the header of the parts' spans lists them all.

use tessera_store::byteranges::{boundary, multi_range_header, parse, place};

/// The fuzz target body.
pub fn run(data: &[u8]) {
    let split = data.iter().position(|&b| b == b'\n').unwrap_or(data.len());
    let Ok(content_type) = std::str::from_utf8(&data[..split]) else { return };
    let body = data.get(split + 1..).unwrap_or_default();
    let Some(b) = boundary(content_type) else { return };
    let Ok(parts) = parse(body, b) else { return };
    assert!(!parts.is_empty(), "a body without parts parsed");
    let spans: Vec<(u64, u64)> = parts.iter().map(|p| (p.offset, p.body.len() as u64)).collect();
    for p in &parts {
        assert!(!p.body.is_empty(), "an empty part");
        let start = p.body.as_ptr() as usize - body.as_ptr() as usize;
        assert!(start + p.body.len() <= body.len(), "a part outside the body");
    }
    let placed = place(&spans, &parts).expect("a part's own span is not found");
    for (got, p) in placed.iter().zip(&parts) {
        // The first part holding the span answers it; another part may hold the same bytes.
        assert_eq!(got.len(), p.body.len());
    }
    for &(offset, len) in &spans {
        let past = (offset, len + 1);
        if !spans.iter().any(|&(o, l)| o <= offset && offset.saturating_add(len) < o.saturating_add(l)) {
            assert!(place(&[past], &parts).is_err(), "a span past every part was placed");
        }
    }
    let header = multi_range_header(&spans).expect("the parts' spans make no header");
    assert_eq!(header.matches(',').count() + 1, spans.len());
}

/// Seeds: two parts in reverse order, one part, a quoted boundary, the end delimiter missing.
pub fn seeds() -> crate::seeds::Seeds {
    let part = |b: &str, first: u64, bytes: &[u8]| {
        let last = first + bytes.len() as u64 - 1;
        let mut out = format!("\r\n--{b}\r\nContent-Type: application/octet-stream\r\nContent-Range: bytes {first}-{last}/100000\r\n\r\n").into_bytes();
        out.extend_from_slice(bytes);
        out
    };
    let body = |b: &str, parts: &[(u64, &[u8])], end: bool| {
        let mut out = format!("multipart/byteranges; boundary={b}\n").into_bytes();
        for &(first, bytes) in parts {
            out.extend(part(b, first, bytes));
        }
        if end {
            out.extend_from_slice(format!("\r\n--{b}--\r\n").as_bytes());
        }
        out
    };
    vec![
        ("two parts".into(), body("00000000000000000042", &[(5000, b"later bytes"), (10, b"first")], true)),
        ("one part".into(), body("x", &[(0, &[0u8; 64])], true)),
        ("quoted".into(), {
            let mut v = body("q b", &[(7, b"seven")], true);
            let nl = v.iter().position(|&c| c == b'\n').unwrap_or(0);
            v.splice(..nl, b"multipart/byteranges; boundary=\"q b\"".iter().copied());
            v
        }),
        ("no end".into(), body("e", &[(1, b"one")], false)),
    ]
}
