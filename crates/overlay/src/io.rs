//! The overlay's file access, behind a small trait so that tests can model a power loss (an
//! implementation that forgets what was not `sync_data`'d).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// Positional I/O on the overlay file.
pub trait OverlayIo: Send + Sync {
    /// Fill `buf` from `offset`; bytes past the end of the file read as zeros.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Write all of `buf` at `offset` (the file grows as needed). Not durable before
    /// [`Self::sync_data`].
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Make every completed write durable (`fdatasync`).
    fn sync_data(&self) -> io::Result<()>;
    /// Current size of the file.
    fn size(&self) -> io::Result<u64>;
}

/// [`OverlayIo`] on a real file.
#[derive(Debug)]
pub struct FileIo {
    file: File,
}

impl FileIo {
    pub fn new(file: File) -> Self {
        Self { file }
    }

    pub fn file(&self) -> &File {
        &self.file
    }
}

impl OverlayIo for FileIo {
    fn read_at(&self, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
        while !buf.is_empty() {
            match self.file.read_at(buf, offset) {
                Ok(0) => {
                    buf.fill(0);
                    return Ok(());
                }
                Ok(n) => {
                    buf = &mut buf[n..];
                    offset += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(buf, offset)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
}
