//! A base device whose every read fails (a store error), shared by the hostile-request and
//! log-flood tests.

use tessera_engine::{BlockDevice, ReadError};
use tessera_store::StoreError;

/// Every read fails with a store error (the status map answers IOERR).
pub struct Failing;

impl BlockDevice for Failing {
    fn read_at(&self, _: u64, _: &mut [u8]) -> Result<(), ReadError> {
        let e =
            StoreError::OutOfRange(tessera_image::Error::OutOfRange { offset: 0, len: 0, device_bytes: 0 });
        Err(ReadError::store(0, e))
    }
}
