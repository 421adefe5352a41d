//! A tiny canonical little-endian encoder/decoder shared by the binary formats (the record, the
//! pack index, the builder's content manifests).

use crate::error::DecodeError;

#[derive(Debug, Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn bytes(&mut self, b: &[u8]) {
        self.buf.extend_from_slice(b);
    }
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    /// Length-prefixed (u32) byte string.
    pub fn blob(&mut self, b: &[u8]) {
        // Lengths come from in-memory values; anything over 4 GiB is a bug, caught by the decoder's
        // truncation check rather than a silent wrap.
        self.u32(u32::try_from(b.len()).unwrap_or(u32::MAX));
        self.bytes(b);
    }
    pub fn len(&mut self, n: usize) {
        self.u32(u32::try_from(n).unwrap_or(u32::MAX));
    }
    /// LEB128: seven bits a byte, low bits first, the top bit set on every byte but the last.
    pub fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.buf.push((v as u8 & 0x7f) | 0x80);
            v >>= 7;
        }
        self.buf.push(v as u8);
    }
}

#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Self { buf, pos: 0, what }
    }
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or(DecodeError::Truncated {
            what: self.what,
            offset: self.pos,
            needed: n,
        })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
    /// The 8-byte magic and the u32 version every binary format starts with.
    pub fn header(&mut self, magic: &[u8; 8], version: u32) -> Result<(), DecodeError> {
        if self.take(8)? != magic {
            return Err(DecodeError::BadMagic { what: self.what });
        }
        let found = self.u32()?;
        if found != version {
            return Err(DecodeError::UnsupportedVersion { what: self.what, version: found });
        }
        Ok(())
    }
    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }
    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    /// A LEB128 value as [`Writer::varint`] writes it: the shortest form only (no final zero
    /// byte after the first), at most 64 bits.
    pub fn varint(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        let mut v = 0u64;
        for i in 0..10 {
            let b = self.u8()?;
            let bits = u64::from(b & 0x7f);
            if i == 9 && bits > 1 {
                return Err(self.not_canonical(field, "varint longer than 64 bits"));
            }
            v |= bits << (7 * i);
            if b & 0x80 == 0 {
                if b == 0 && i > 0 {
                    return Err(self.not_canonical(field, "varint not in its shortest form"));
                }
                return Ok(v);
            }
        }
        Err(self.not_canonical(field, "varint longer than 64 bits"))
    }
    pub fn blob(&mut self) -> Result<&'a [u8], DecodeError> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub fn string(&mut self, field: &'static str) -> Result<String, DecodeError> {
        let b = self.blob()?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError::BadUtf8 { what: self.what, field })
    }
    /// A count of items each at least `min_item` bytes long; rejects counts the remaining input
    /// cannot hold, so hostile counts cannot make us allocate.
    pub fn count(&mut self, min_item: usize) -> Result<usize, DecodeError> {
        let n = self.u32()? as usize;
        let remaining = self.buf.len() - self.pos;
        if n.saturating_mul(min_item.max(1)) > remaining {
            return Err(DecodeError::Truncated {
                what: self.what,
                offset: self.pos,
                needed: n.saturating_mul(min_item.max(1)),
            });
        }
        Ok(n)
    }
    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    pub fn finish(self) -> Result<(), DecodeError> {
        let rest = self.buf.len() - self.pos;
        if rest != 0 {
            return Err(DecodeError::TrailingBytes { what: self.what, count: rest });
        }
        Ok(())
    }
    pub fn not_canonical(&self, field: &'static str, reason: &'static str) -> DecodeError {
        DecodeError::NotCanonical { what: self.what, field, reason }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_and_only_their_shortest_form_decodes() {
        for v in [0, 1, 0x7f, 0x80, 0x3fff, 0x4000, u64::from(u32::MAX), u64::MAX - 1, u64::MAX] {
            let mut w = Writer::default();
            w.varint(v);
            let mut r = Reader::new(&w.buf, "test");
            assert_eq!(r.varint("v").unwrap(), v);
            r.finish().unwrap();
            let mut cut = Reader::new(&w.buf[..w.buf.len() - 1], "test");
            assert!(cut.varint("v").is_err(), "{v} cut short");
        }
        let decode = |b: &[u8]| Reader::new(b, "test").varint("v");
        // Zero and one padded with a continuation byte, and an eleven-byte form.
        assert!(decode(&[0x80, 0x00]).is_err());
        assert!(decode(&[0x81, 0x00]).is_err());
        assert!(decode(&[0xff; 10]).is_err());
        // u64::MAX is nine 0xff bytes and a 1; a 2 in the tenth byte overflows.
        let mut max = vec![0xff; 9];
        max.push(0x01);
        assert_eq!(decode(&max).unwrap(), u64::MAX);
        *max.last_mut().unwrap() = 0x02;
        assert!(decode(&max).is_err());
    }
}
