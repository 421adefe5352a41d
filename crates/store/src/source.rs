//! Where stored chunks come from.

use std::sync::Arc;

use tessera_image::{ChunkRef, PackLocation, Sha256Digest};

use crate::error::StoreError;

/// Where [`ChunkSource::read_stored_streamed`] hands a range's bytes as they arrive. An error
/// stops the read and is its result.
pub type RangeSink<'a> = dyn FnMut(&[u8]) -> Result<(), StoreError> + 'a;

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

    /// Read several ranges `(offset, len)` of pack `pack`, returned in the order asked. A remote
    /// source overrides it to fetch near ranges in one request; the default reads them one by
    /// one.
    fn read_stored_many(
        &self,
        pack: &Sha256Digest,
        ranges: &[(u64, u32)],
    ) -> Result<Vec<Vec<u8>>, StoreError> {
        ranges.iter().map(|&(offset, len)| self.read_stored(pack, offset, len)).collect()
    }

    /// Chunk `chunk`, stored at `loc` in `pack`, already decompressed and verified, when this
    /// source holds a copy it checks by decoding anyway (the disk cache checks every entry it
    /// reads): the reader then decodes it once, not twice. `None` (the default): read the
    /// stored bytes. Never returns bytes that did not verify.
    fn read_verified(&self, _chunk: &ChunkRef, _pack: &Sha256Digest, _loc: &PackLocation) -> Option<Vec<u8>> {
        None
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
            ) -> Result<Vec<Vec<u8>>, StoreError> {
                (**self).read_stored_many(pack, ranges)
            }

            fn read_verified(&self, chunk: &ChunkRef, pack: &Sha256Digest, loc: &PackLocation) -> Option<Vec<u8>> {
                (**self).read_verified(chunk, pack, loc)
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
