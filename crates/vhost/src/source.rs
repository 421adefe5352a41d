//! The base device bytes a device serves (and the overlay writes over).

use std::sync::Arc;

use tessera_store::{ChunkSource, ImageReader, StoreError};

/// Device bytes to serve: the image read path (or a test double).
pub trait BlockSource: Send + Sync {
    /// Fill `buf` with the device bytes at `offset` (the range is within the device).
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError>;
}

impl<S: ChunkSource> BlockSource for ImageReader<S> {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        ImageReader::read_at(self, offset, buf)
    }
}

impl<T: BlockSource + ?Sized> BlockSource for Arc<T> {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        (**self).read_at(offset, buf)
    }
}

impl std::fmt::Debug for dyn BlockSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BlockSource")
    }
}
