//! Several ranges of a blob in one GET (RFC 9110 §14.2, §14.6): the `Range` header listing
//! them and the `multipart/byteranges` answer. Pure (no I/O), so it is unit tested and fuzzed.
//!
//! A server may answer a multi-range request with fewer, larger parts (it may coalesce ranges
//! that are close) in any order, or with a single part covering them all: every range asked for
//! is found inside whichever part holds it, and a range no part holds is an error.

use super::http::HttpError;

/// The `Range` header for `spans` (`(offset, len)`, each len ≥ 1), in the order given;
/// `None` if a span is empty or overflows.
pub fn multi_range_header(spans: &[(u64, u64)]) -> Option<String> {
    let mut out = String::from("bytes=");
    for (i, &(offset, len)) in spans.iter().enumerate() {
        let last = offset.checked_add(len.checked_sub(1)?)?;
        if i > 0 {
            out.push(',');
        }
        out.push_str(&format!("{offset}-{last}"));
    }
    (!spans.is_empty()).then_some(out)
}

/// The boundary of a `multipart/byteranges` `Content-Type` (`None`: another type).
pub fn boundary(content_type: &str) -> Option<&str> {
    let mut params = content_type.split(';');
    let kind = params.next()?.trim();
    if !kind.eq_ignore_ascii_case("multipart/byteranges") {
        return None;
    }
    params.find_map(|p| {
        let (name, value) = p.split_once('=')?;
        name.trim().eq_ignore_ascii_case("boundary").then(|| value.trim().trim_matches('"'))
    })
}

/// One part of a `multipart/byteranges` body: blob bytes `[offset, offset + body.len())`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part<'a> {
    pub offset: u64,
    pub body: &'a [u8],
}

/// The parts of a `multipart/byteranges` `body` delimited by `boundary`. Each part needs a
/// `Content-Range: bytes FIRST-LAST/TOTAL` header; its body is exactly LAST − FIRST + 1 bytes,
/// followed by the next delimiter. Strict: anything else is an error.
pub fn parse<'a>(body: &'a [u8], boundary: &str) -> Result<Vec<Part<'a>>, HttpError> {
    let bad = HttpError::BadRange;
    if boundary.is_empty() || boundary.len() > 70 {
        return Err(bad("multipart boundary is empty or longer than 70 characters"));
    }
    let delimiter = format!("--{boundary}");
    let delimiter = delimiter.as_bytes();
    // The preamble (usually empty) ends at the first delimiter.
    let first = find(body, delimiter).ok_or(bad("multipart body without its boundary"))?;
    let mut at = first + delimiter.len();
    let mut parts = Vec::new();
    loop {
        let rest = &body[at..];
        if rest.starts_with(b"--") {
            return if parts.is_empty() { Err(bad("multipart body without parts")) } else { Ok(parts) };
        }
        let rest = rest.strip_prefix(b"\r\n").ok_or(bad("multipart delimiter not followed by CRLF"))?;
        at = body.len() - rest.len();
        let head_len = find(rest, b"\r\n\r\n").ok_or(bad("multipart part without the end of its headers"))?;
        let head = std::str::from_utf8(&rest[..head_len])
            .map_err(|_| bad("multipart part headers are not UTF-8"))?;
        let range = head
            .split("\r\n")
            .find_map(|line| {
                let (name, value) = line.split_once(':')?;
                name.trim().eq_ignore_ascii_case("content-range").then_some(value.trim())
            })
            .ok_or(bad("multipart part without Content-Range"))?;
        let (first, last) = content_range(range)?;
        let len = (last - first)
            .checked_add(1)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or(bad("multipart part too large"))?;
        let start = at + head_len + 4;
        let end = start
            .checked_add(len)
            .filter(|&e| e <= body.len())
            .ok_or(bad("multipart part shorter than its Content-Range"))?;
        parts.push(Part { offset: first, body: &body[start..end] });
        let after =
            body[end..].strip_prefix(b"\r\n").ok_or(bad("multipart part longer than its Content-Range"))?;
        let after =
            after.strip_prefix(delimiter).ok_or(bad("multipart part longer than its Content-Range"))?;
        at = body.len() - after.len();
    }
}

/// `FIRST-LAST/TOTAL` of a `bytes` `Content-Range`, checked.
pub fn content_range(value: &str) -> Result<(u64, u64), HttpError> {
    content_range_of(value).map(|(first, last, _)| (first, last))
}

/// [`content_range`] with the blob's length (`None` when the server wrote `*`).
pub fn content_range_of(value: &str) -> Result<(u64, u64, Option<u64>), HttpError> {
    let bad = HttpError::BadRange;
    let spec = value.strip_prefix("bytes ").ok_or(bad("Content-Range is not in bytes"))?;
    let (range, total) = spec.split_once('/').ok_or(bad("Content-Range lacks a total"))?;
    let (first, last) = range.split_once('-').ok_or(bad("Content-Range lacks a range"))?;
    let first: u64 = first.parse().map_err(|_| bad("Content-Range start is not a number"))?;
    let last: u64 = last.parse().map_err(|_| bad("Content-Range end is not a number"))?;
    if last < first {
        return Err(bad("Content-Range ends before it starts"));
    }
    let total = match total {
        "*" => None,
        t => {
            let total: u64 = t.parse().map_err(|_| bad("Content-Range total is not a number"))?;
            if total <= last {
                return Err(bad("Content-Range ends past the total"));
            }
            Some(total)
        }
    };
    Ok((first, last, total))
}

/// The bytes of each span of `spans` (`(offset, len)`) from `parts`, in the order of `spans`:
/// each span must lie inside one part.
pub fn place(spans: &[(u64, u64)], parts: &[Part<'_>]) -> Result<Vec<Vec<u8>>, HttpError> {
    spans
        .iter()
        .map(|&(offset, len)| {
            parts
                .iter()
                .find_map(|p| {
                    let start = offset.checked_sub(p.offset)?;
                    let end = start.checked_add(len)?;
                    p.body.get(usize::try_from(start).ok()?..usize::try_from(end).ok()?)
                })
                .map(<[u8]>::to_vec)
                .ok_or(HttpError::BadRange("a range asked for is in no part of the answer"))
        })
        .collect()
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(boundary: &str, parts: &[(u64, &[u8], u64)]) -> Vec<u8> {
        let mut out = Vec::new();
        for &(offset, bytes, total) in parts {
            let last = offset + bytes.len() as u64 - 1;
            out.extend_from_slice(
                format!(
                    "\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\nContent-Range: bytes {offset}-{last}/{total}\r\n\r\n"
                )
                .as_bytes(),
            );
            out.extend_from_slice(bytes);
        }
        out.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        out
    }

    #[test]
    fn header_lists_every_span() {
        assert_eq!(multi_range_header(&[(0, 10), (100, 1)]).unwrap(), "bytes=0-9,100-100");
        assert_eq!(multi_range_header(&[(0, 0)]), None);
        assert_eq!(multi_range_header(&[]), None);
        assert_eq!(multi_range_header(&[(u64::MAX, 2)]), None);
    }

    #[test]
    fn boundary_from_content_type() {
        assert_eq!(boundary("multipart/byteranges; boundary=00000000001"), Some("00000000001"));
        assert_eq!(boundary("Multipart/Byteranges;boundary=\"a b\""), Some("a b"));
        assert_eq!(boundary("application/octet-stream"), None);
        assert_eq!(boundary("multipart/byteranges"), None);
    }

    #[test]
    fn parts_in_any_order_and_coalesced_answer_every_span() {
        let blob: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
        let b = body("XYZ", &[(5000, &blob[5000..5100], 10_000), (10, &blob[10..30], 10_000)]);
        let parts = parse(&b, "XYZ").unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0], Part { offset: 5000, body: &blob[5000..5100] });
        // Spans inside a coalesced part are cut out of it.
        let got = place(&[(10, 5), (5050, 50), (20, 10)], &parts).unwrap();
        assert_eq!(got, vec![blob[10..15].to_vec(), blob[5050..5100].to_vec(), blob[20..30].to_vec()]);
        assert!(place(&[(5050, 51)], &parts).is_err(), "a span past its part");
        assert!(place(&[(40, 1)], &parts).is_err(), "a span in no part");
    }

    #[test]
    fn a_body_whose_part_is_cut_or_padded_is_refused() {
        let bytes = [7u8; 100];
        let good = body("b", &[(0, &bytes, 100)]);
        assert_eq!(parse(&good, "b").unwrap().len(), 1);
        // One byte fewer than the Content-Range says, then the delimiter.
        let short = String::from_utf8_lossy(&good).replacen(&"\u{7}".repeat(100), &"\u{7}".repeat(99), 1);
        assert!(parse(short.as_bytes(), "b").is_err());
        let long = String::from_utf8_lossy(&good).replacen(&"\u{7}".repeat(100), &"\u{7}".repeat(101), 1);
        assert!(parse(long.as_bytes(), "b").is_err());
        let truncated = &good[..good.len() - 10];
        assert!(parse(truncated, "b").is_err());
        assert!(parse(&good, "other").is_err());
        assert!(parse(b"--b--\r\n", "b").is_err(), "no parts");
        let no_range = b"--b\r\nContent-Type: x\r\n\r\nabc\r\n--b--";
        assert!(parse(no_range, "b").is_err());
        let backwards = b"--b\r\nContent-Range: bytes 5-2/10\r\n\r\nabc\r\n--b--";
        assert!(parse(backwards, "b").is_err());
        let past_total = b"--b\r\nContent-Range: bytes 0-2/2\r\n\r\nabc\r\n--b--";
        assert!(parse(past_total, "b").is_err());
        let whole_range = format!("--b\r\nContent-Range: bytes 0-{}/*\r\n\r\nabc\r\n--b--", u64::MAX);
        assert!(parse(whole_range.as_bytes(), "b").is_err(), "a part of 2^64 bytes");
    }
}
