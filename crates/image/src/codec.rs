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
