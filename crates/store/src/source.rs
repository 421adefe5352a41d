//! Where stored chunks come from.

use std::sync::Arc;

use tessera_image::{ChunkRef, PackLocation, Sha256Digest};

use crate::error::StoreError;

/// Where [`ChunkSource::read_stored_streamed`] hands a range's bytes as they arrive. An error
/// stops the read and is its result.
pub type RangeSink<'a> = dyn FnMut(&[u8]) -> Result<(), StoreError> + 'a;

/// Where [`ChunkSource::read_stored_many`] hands each range (its index among those asked, its
/// bytes) once it is all here.
pub type RangeGot<'a> = dyn FnMut(usize, Vec<u8>) + 'a;

/// Where [`ChunkSource::read_chunks`] hands each chunk (its index among those asked) once it is
/// here.
pub type ChunkGot<'a> = dyn FnMut(usize, SourcedChunk) + 'a;

/// Ranges `ranges` of pack `pack` read with [`ChunkSource::read_stored_many`], in the order
/// asked.
pub fn read_all<S: ChunkSource + ?Sized>(
    source: &S,
    pack: &Sha256Digest,
    ranges: &[(u64, u32)],
) -> Result<Vec<Vec<u8>>, StoreError> {
    let mut out: Vec<Option<Vec<u8>>> = vec![None; ranges.len()];
    source.read_stored_many(pack, ranges, &mut |i, bytes| {
        if let Some(slot) = out.get_mut(i) {
            *slot = Some(bytes);
        }
    })?;
    out.into_iter().map(|bytes| bytes.ok_or_else(not_handed_over)).collect()
}

/// A range or chunk a source's read ended without handing over, and without an error: an error
/// of the source, never a silent gap.
pub fn not_handed_over() -> StoreError {
    StoreError::Io {
        op: "ranged read",
        path: Default::default(),
        source: std::io::Error::other("the source handed over no bytes for this range"),
    }
}

/// A chunk as [`ChunkSource::read_chunks`] hands it over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourcedChunk {
    /// Its stored bytes, for the reader to decode and verify.
    Stored(Vec<u8>),
    /// Its data, decoded and verified against its id by the source on the way (the disk cache
    /// checks every entry it reads or keeps by decoding it): nothing left to decode.
    Verified(Vec<u8>),
}

/// A source of stored (possibly compressed) chunk bytes: a byte range of a pack.
///
/// The local store implements it with `pread`; HTTP, registry and cache tiers implement it later
/// and compose as wrappers. Implementations return exactly `len` bytes or an error; verification
/// (decompression, blake3 against the chunk id) is the caller's job, see
/// [`crate::ImageReader`].
pub trait ChunkSource: Send + Sync {
    /// Read `len` bytes at `offset` of pack `pack`.
    fn read_stored(&self, pack: &Sha256Digest, offset: u64, len: u32) -> Result<Vec<u8>, StoreError>;

    /// Read `len` bytes at `offset` of pack `pack` into `sink` as they arrive: in order, each byte
    /// once, `len` in all when it succeeds (a consumer may decode the first bytes while the last
    /// are on the wire). The default reads the range whole and hands it over at once; a remote
    /// source streams the answer's body.
    fn read_stored_streamed(
        &self,
        pack: &Sha256Digest,
        offset: u64,
        len: u32,
        sink: &mut RangeSink<'_>,
    ) -> Result<(), StoreError> {
        sink(&self.read_stored(pack, offset, len)?)
    }

    /// Read several ranges `(offset, len)` of pack `pack`, handing each to `got` (with its index
    /// in `ranges`) as soon as all its bytes are here: each once, in any order (a remote source
    /// hands over the ranges at the head of a request's answer while the rest is on the wire, so
    /// a read waiting for one of them need not wait for the whole answer). An error ends the
    /// read: the ranges not handed over by then failed with it. A remote source overrides it to
    /// fetch near ranges in one request; the default reads them one by one. [`read_all`] collects
    /// them in the order asked.
    fn read_stored_many(
        &self,
        pack: &Sha256Digest,
        ranges: &[(u64, u32)],
        got: &mut RangeGot<'_>,
    ) -> Result<(), StoreError> {
        for (i, &(offset, len)) in ranges.iter().enumerate() {
            got(i, self.read_stored(pack, offset, len)?);
        }
        Ok(())
    }

    /// Chunks `members` of pack `pack` (each stored at its location), each handed to `got` (with
    /// its index in `members`) as soon as it is here, as [`Self::read_stored_many`] hands over
    /// ranges: each once, in any order; an error ends the read and fails the chunks not handed
    /// over. The default reads their ranges with [`Self::read_stored_many`]; a source that
    /// decodes what it hands over anyway (the disk cache) gives the decoded data, so the reader
    /// does not decode it a second time.
    fn read_chunks(
        &self,
        pack: &Sha256Digest,
        members: &[(ChunkRef, PackLocation)],
        got: &mut ChunkGot<'_>,
    ) -> Result<(), StoreError> {
        let ranges: Vec<(u64, u32)> = members.iter().map(|(_, loc)| (loc.offset, loc.stored_len)).collect();
        self.read_stored_many(pack, &ranges, &mut |i, bytes| got(i, SourcedChunk::Stored(bytes)))
    }

    /// Chunk `chunk`, stored at `loc` in `pack`: its stored bytes (the default reads them with
    /// [`Self::read_stored`]), or — from a source that decodes what it hands over anyway (the
    /// disk cache checks every entry it reads or keeps by decoding it) — its data, decoded and
    /// verified, so that the reader decodes it once, not twice.
    fn read_chunk(
        &self,
        _chunk: &ChunkRef,
        pack: &Sha256Digest,
        loc: &PackLocation,
    ) -> Result<SourcedChunk, StoreError> {
        Ok(SourcedChunk::Stored(self.read_stored(pack, loc.offset, loc.stored_len)?))
    }

    /// How many separate ranges of one pack [`Self::read_stored_many`] fetches in one request
    /// (an HTTP origin answering multi-range GETs); 1 (the default): ranges apart cost a request
    /// each, so callers should group only ranges stored back to back.
    fn ranges_per_request(&self) -> usize {
        1
    }

    /// Whether chunk `chunk` (stored at `loc` in `pack`) is on this host already — in the host
    /// disk cache — so that reading it costs a local read, not an origin round trip: nothing to
    /// fetch ahead of the guest. A hint (a cheap check, no read); `false` (the default) when not
    /// known.
    fn holds(&self, _chunk: &ChunkRef, _pack: &Sha256Digest, _loc: &PackLocation) -> bool {
        false
    }
}

/// A reference or smart pointer to a source is that source.
macro_rules! forward_chunk_source {
    ($($ptr:ty),*) => {$(
        impl<T: ChunkSource + ?Sized> ChunkSource for $ptr {
            fn read_stored(&self, pack: &Sha256Digest, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
                (**self).read_stored(pack, offset, len)
            }

            fn read_stored_streamed(
                &self,
                pack: &Sha256Digest,
                offset: u64,
                len: u32,
                sink: &mut RangeSink<'_>,
            ) -> Result<(), StoreError> {
                (**self).read_stored_streamed(pack, offset, len, sink)
            }

            fn read_stored_many(
                &self,
                pack: &Sha256Digest,
                ranges: &[(u64, u32)],
                got: &mut RangeGot<'_>,
            ) -> Result<(), StoreError> {
                (**self).read_stored_many(pack, ranges, got)
            }

            fn read_chunks(
                &self,
                pack: &Sha256Digest,
                members: &[(ChunkRef, PackLocation)],
                got: &mut ChunkGot<'_>,
            ) -> Result<(), StoreError> {
                (**self).read_chunks(pack, members, got)
            }

            fn read_chunk(&self, chunk: &ChunkRef, pack: &Sha256Digest, loc: &PackLocation) -> Result<SourcedChunk, StoreError> {
                (**self).read_chunk(chunk, pack, loc)
            }

            fn ranges_per_request(&self) -> usize {
                (**self).ranges_per_request()
            }

            fn holds(&self, chunk: &ChunkRef, pack: &Sha256Digest, loc: &PackLocation) -> bool {
                (**self).holds(chunk, pack, loc)
            }
        }
    )*};
}

forward_chunk_source!(&T, Arc<T>, Box<T>);
