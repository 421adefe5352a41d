//! The engine's errors: a read that could not be served, and a destination that refused bytes.

use std::sync::Arc;

use tessera_store::{ReadAt, StoreError};
use thiserror::Error;

/// A destination buffer that could not take the bytes of a read (a guest buffer outside guest
/// memory, or a buffer shorter than the read).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("buffer {addr:#x}+{len} could not be written")]
pub struct SinkError {
    pub addr: u64,
    pub len: u32,
}

/// A read the engine could not serve.
#[derive(Debug, Clone, Error)]
#[non_exhaustive]
pub enum ReadError {
    /// The image bytes at `offset` could not be read (shared by every read that waited for the
    /// same chunk fetch).
    #[error("reading the image at byte {offset}")]
    Store {
        offset: u64,
        #[source]
        source: Arc<StoreError>,
    },
    /// The destination refused the bytes.
    #[error(transparent)]
    Sink(#[from] SinkError),
}

impl ReadError {
    /// A store error at device byte `offset`.
    pub fn store(offset: u64, source: impl Into<Arc<StoreError>>) -> Self {
        ReadError::Store { offset, source: source.into() }
    }
}

impl From<ReadAt> for ReadError {
    fn from(e: ReadAt) -> Self {
        ReadError::store(e.offset, e.source)
    }
}

/// The engine could not start (its fetch threads).
#[derive(Debug, Error)]
#[error("starting the chunk fetch threads")]
pub struct StartError(#[source] pub std::io::Error);

/// Displays an error with its causes, `outer: inner: innermost` (for logs and messages that do
/// not go through `anyhow`'s `{:#}`). Each error type shows only its own context and leaves the
/// cause to its `source()`, so no cause is printed twice.
#[derive(Debug, Clone, Copy)]
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(c) = cause {
            write!(f, ": {c}")?;
            cause = c.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Error)]
    #[error("opening the overlay")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn a_chain_shows_every_cause_once() {
        let e = Outer(std::io::Error::other("disk on fire"));
        assert_eq!(Chain(&e).to_string(), "opening the overlay: disk on fire");
        let e = ReadError::from(SinkError { addr: 0x1000, len: 8 });
        assert_eq!(Chain(&e).to_string(), "buffer 0x1000+8 could not be written");
    }
}
