//! Tar extension headers read by us: PAX records (`x`), GNU long names (`L`) and long links
//! (`K`) of each entry, parsed from the bytes between the previous entry's data and the entry's
//! own header.
//!
//! Why not the `tar` crate's own view of them: tar 0.4.46 splits a PAX header's body on newlines
//! before it looks at each record's length (composefs/tar-rs#452, #428), so any value holding a
//! `0x0a` byte — binary xattrs such as `security.capability`, which bsdtar and GNU tar write
//! as they are — makes every record of the header "malformed", and its `path()`/`link_name()`
//! would even take a fragment of such a value as a record of its own (a crafted value holding
//! `\n22 linkpath=/etc/evil\n`), where every length-walking reader (Go's archive/tar, so docker
//! and umoci; libarchive) sees none. The crate still frames the stream (headers, sizes, data
//! offsets); [`Capture`] keeps a copy of the bytes it reads between entries, and
//! [`Extensions::parse`] walks them by the records' lengths. The entry's size as the crate framed
//! it must then agree with ours, or the layer is refused.

use std::cell::RefCell;
use std::io::{self, Read};

/// Extension headers bigger than this (all of one entry's together) are refused.
pub const MAX_EXTENSIONS: usize = 16 << 20;

/// The stream bytes read from `mark` on; positions count from the start of the tar stream.
#[derive(Debug, Default)]
pub struct Capture {
    pos: u64,
    mark: u64,
    bytes: Vec<u8>,
}

impl Capture {
    /// Forget what was kept and keep what is read from `mark` (the end of the current entry's
    /// data, rounded to the block) on.
    pub fn restart_at(&mut self, mark: u64) {
        self.mark = mark;
        self.bytes.clear();
    }

    /// The kept bytes between the mark and `to` (the next entry's header position), and the 512
    /// bytes of that header.
    pub fn region(&self, to: u64) -> Option<(&[u8], &[u8])> {
        let start = usize::try_from(to.checked_sub(self.mark)?).ok()?;
        let end = start.checked_add(512)?;
        Some((self.bytes.get(..start)?, self.bytes.get(start..end)?))
    }
}

/// A reader that copies into a [`Capture`] what passes at or after its mark.
#[derive(Debug)]
pub struct Tap<'c, R> {
    pub inner: R,
    pub capture: &'c RefCell<Capture>,
}

impl<R: Read> Read for Tap<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        let mut c = self.capture.borrow_mut();
        let start = c.pos;
        c.pos += n as u64;
        if c.pos > c.mark {
            let skip = usize::try_from(c.mark.saturating_sub(start)).unwrap_or(n).min(n);
            if c.bytes.len() + (n - skip) > MAX_EXTENSIONS + 1024 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("extension headers of one entry exceed {MAX_EXTENSIONS} bytes"),
                ));
            }
            c.bytes.extend_from_slice(&buf[skip..n]);
        }
        Ok(n)
    }
}

/// PAX records `(key, value)` in order.
pub type PaxRecords = Vec<(Vec<u8>, Vec<u8>)>;

/// One entry's extension headers.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Extensions {
    /// PAX records `(key, value)` in order (a later record of the same key wins).
    pub pax: PaxRecords,
    pub long_name: Option<Vec<u8>>,
    pub long_link: Option<Vec<u8>>,
}

/// A tar numeric field: octal ASCII (spaces and NULs around it), or base-256 (high bit set).
pub fn numeric(field: &[u8]) -> Option<u64> {
    if field.first().is_some_and(|b| b & 0x80 != 0) {
        let mut v: u64 = u64::from(field[0] & 0x7f);
        for &b in &field[1..] {
            v = v.checked_mul(256)?.checked_add(u64::from(b))?;
        }
        return Some(v);
    }
    let s: Vec<u8> = field.iter().copied().filter(|&b| b != 0 && b != b' ').collect();
    if s.is_empty() {
        return Some(0);
    }
    let s = std::str::from_utf8(&s).ok()?;
    u64::from_str_radix(s, 8).ok()
}

fn strip_nuls(b: &[u8]) -> Vec<u8> {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    b[..end].to_vec()
}

/// PAX records `LEN KEY=VALUE\n`, walked by `LEN` (the value may hold any byte, newlines too).
/// NUL padding after the last record is allowed.
pub fn pax_records(data: &[u8]) -> Result<PaxRecords, String> {
    let mut out = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        if rest.iter().all(|&b| b == 0) {
            break;
        }
        let space = rest.iter().position(|&b| b == b' ').ok_or("a record without a length")?;
        let digits = &rest[..space];
        if digits.is_empty() || digits.len() > 20 || !digits.iter().all(u8::is_ascii_digit) {
            return Err(format!("bad record length {:?}", String::from_utf8_lossy(digits)));
        }
        let len: usize = std::str::from_utf8(digits)
            .ok()
            .and_then(|d| d.parse().ok())
            .ok_or("record length out of range")?;
        if len <= space + 1 || len > rest.len() {
            return Err(format!("record length {len} does not fit the header ({} bytes left)", rest.len()));
        }
        let record = &rest[space + 1..len];
        let Some((&b'\n', body)) = record.split_last() else {
            return Err("a record that does not end in a newline".into());
        };
        let eq = body.iter().position(|&b| b == b'=').ok_or("a record without `=`")?;
        out.push((body[..eq].to_vec(), body[eq + 1..].to_vec()));
        rest = &rest[len..];
    }
    Ok(out)
}

impl Extensions {
    /// Parse the extension headers (and their data) in `region`, the bytes just before an
    /// entry's header.
    pub fn parse(region: &[u8]) -> Result<Self, String> {
        let mut ext = Self::default();
        let mut at = 0usize;
        while at < region.len() {
            let header = region.get(at..at + 512).ok_or("a partial extension header")?;
            let size = numeric(&header[124..136]).ok_or("a bad size field in an extension header")?;
            let size = usize::try_from(size).map_err(|_| "extension header too large")?;
            let start = at + 512;
            let data = start
                .checked_add(size)
                .and_then(|end| region.get(start..end))
                .ok_or("extension data runs past the next header")?;
            match header[156] {
                b'x' => ext.pax = pax_records(data)?,
                b'L' => ext.long_name = Some(strip_nuls(data)),
                b'K' => ext.long_link = Some(strip_nuls(data)),
                // Global PAX headers carry nothing the image keeps.
                b'g' => {}
                other => {
                    return Err(format!("unexpected entry type {:?} before an entry", char::from(other)))
                }
            }
            at = start + size.div_ceil(512) * 512;
        }
        Ok(ext)
    }

    /// The last value of a PAX key.
    pub fn get(&self, key: &[u8]) -> Option<&[u8]> {
        self.pax.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(k: &str, v: &[u8]) -> Vec<u8> {
        let rest = k.len() + v.len() + 3;
        let mut len = rest + 1;
        while format!("{len}").len() + rest != len {
            len = format!("{len}").len() + rest;
        }
        let mut r = format!("{len} {k}=").into_bytes();
        r.extend_from_slice(v);
        r.push(b'\n');
        r
    }

    #[test]
    fn records_with_newlines_in_values() {
        let cap = b"\x01\x00\x00\x02\x02\x00\x0a\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00";
        let mut data = record("SCHILY.xattr.security.capability", cap);
        data.extend(record("path", b"a\nb"));
        // A value that looks like a record of its own stays a value.
        data.extend(record("SCHILY.xattr.user.x", b"\n22 linkpath=/etc/evil\n"));
        data.extend([0u8; 7]);
        let r = pax_records(&data).unwrap();
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].1, cap);
        assert_eq!(r[1], (b"path".to_vec(), b"a\nb".to_vec()));
        assert_eq!(r[2].1, b"\n22 linkpath=/etc/evil\n");
        for bad in [&b"5 a=b\n"[..], b"x a=b\n", b"7 ab\n\n\n", b"99 a=b\n", b"6 a=bc", b" 3 \n"] {
            assert!(pax_records(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn numbers() {
        assert_eq!(numeric(b"0000644\0"), Some(0o644));
        assert_eq!(numeric(b"  17 \0"), Some(0o17));
        assert_eq!(numeric(b"\0\0\0"), Some(0));
        assert_eq!(numeric(&[0x80, 0, 0, 0, 0, 0, 0, 2, 0x40, 0, 0, 0]), Some(0x2_4000_0000));
        assert_eq!(numeric(b"89"), None);
    }
}
