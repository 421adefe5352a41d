//! One small trait over every store kind that can be read: image metadata plus a chunk source.
//! What only some kinds have (a local directory, a disk cache, an origin's transport) is not
//! probed through it: [`crate::StoreLocation::open_read_store`] returns it typed, in
//! [`crate::OpenedStore`].

use std::io::Read;
use std::sync::Arc;

use tessera_image::{ImageEntry, ImageId, Sha256Digest};

use crate::error::StoreError;
use crate::local::LocalStore;
use crate::origin::http::HttpStore;
use crate::reader::OpenImage;
use crate::source::ChunkSource;

/// A store opened for reading, whatever its kind: a [`LocalStore`], an [`HttpStore`] or a
/// [`crate::CachedStore`]. What `export`, `inspect` and `serve` need: resolve a reference, read
/// the image entry and verified blobs, open the image, and a [`ChunkSource`] for its chunks.
pub trait ReadStore: Send + Sync + std::fmt::Debug {
    /// The store, for messages.
    fn describe(&self) -> String;
    /// Resolve `sha256:<64 hex>` (the store must hold that image) or a tag.
    fn resolve(&self, reference: &str) -> Result<ImageId, StoreError>;
    /// A likely answer of [`Self::resolve`] known without asking anyone (a tag lookup a disk
    /// cache holds, with the image's entry), for opening the image while `resolve` confirms it;
    /// `None` (the default): none. Never an answer on its own: a tag may have moved.
    fn guess_resolve(&self, _reference: &str) -> Option<ImageId> {
        None
    }
    /// The entry of image `id` ([`StoreError::UnknownImage`] if the store lacks it).
    fn get_entry(&self, id: &ImageId) -> Result<ImageEntry, StoreError>;
    /// A whole blob, checked against its sha256.
    fn read_blob(&self, digest: &Sha256Digest) -> Result<Vec<u8>, StoreError>;
    /// The tags the store knows. A local store lists `refs/`; an HTTP store cannot list, so it
    /// returns the tags resolved through it so far.
    fn list_refs(&self) -> Result<Vec<(String, ImageId)>, StoreError>;
    /// The chunk source for `image`'s chunks.
    fn chunk_source(&self, image: &Arc<OpenImage>) -> Arc<dyn ChunkSource>;

    /// Load and check image `id` (entry, record, prefix, pack index; see
    /// [`OpenImage::from_parts`]). The record, prefix and pack index are read at the same time
    /// (for a remote store: three requests in flight at once, one round trip instead of three).
    fn open_image(&self, id: &ImageId) -> Result<OpenImage, StoreError> {
        let entry = self.get_entry(id)?;
        let (record, prefix, pack_index) = std::thread::scope(|s| {
            let read = |d: Sha256Digest| s.spawn(move || self.read_blob(&d));
            let (record, prefix) = (read(entry.record), read(entry.prefix));
            let pack_index = self.read_blob(&entry.pack_index);
            let join = |h: std::thread::ScopedJoinHandle<'_, Result<Vec<u8>, StoreError>>| {
                h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            };
            (join(record), join(prefix), pack_index)
        });
        OpenImage::from_parts(*id, entry, &record?, &prefix?, &pack_index?)
    }

    /// The size of blob `digest`. The default reads the whole blob; stores that know sizes
    /// cheaply (a file's length, a manifest's descriptors) say so instead.
    fn blob_len(&self, digest: &Sha256Digest) -> Result<u64, StoreError> {
        Ok(self.read_blob(digest)?.len() as u64)
    }

    /// Blob `digest` as a stream (for copying packs without holding them in memory). The default
    /// reads the whole blob (checked) into memory; local and registry stores stream. A streamed
    /// blob is not checked here: whoever consumes it must (a registry checks what it is sent).
    fn open_blob(&self, digest: &Sha256Digest) -> Result<Box<dyn Read + Send>, StoreError> {
        Ok(Box::new(std::io::Cursor::new(self.read_blob(digest)?)))
    }
}

impl ReadStore for LocalStore {
    fn describe(&self) -> String {
        self.root().display().to_string()
    }

    fn resolve(&self, reference: &str) -> Result<ImageId, StoreError> {
        LocalStore::resolve(self, reference)
    }

    fn get_entry(&self, id: &ImageId) -> Result<ImageEntry, StoreError> {
        LocalStore::get_entry(self, id)
    }

    fn read_blob(&self, digest: &Sha256Digest) -> Result<Vec<u8>, StoreError> {
        LocalStore::read_blob(self, digest)
    }

    fn list_refs(&self) -> Result<Vec<(String, ImageId)>, StoreError> {
        LocalStore::list_refs(self)
    }

    fn chunk_source(&self, _image: &Arc<OpenImage>) -> Arc<dyn ChunkSource> {
        Arc::new(self.clone())
    }

    /// [`OpenImage::open`], which also checks that every pack is long enough.
    fn open_image(&self, id: &ImageId) -> Result<OpenImage, StoreError> {
        OpenImage::open(self, id)
    }

    fn blob_len(&self, digest: &Sha256Digest) -> Result<u64, StoreError> {
        LocalStore::blob_len(self, digest)
    }

    fn open_blob(&self, digest: &Sha256Digest) -> Result<Box<dyn Read + Send>, StoreError> {
        let path = self.blob_path(digest);
        match std::fs::File::open(&path) {
            Ok(f) => Ok(Box::new(f)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(StoreError::BlobNotFound { digest: *digest, path })
            }
            Err(e) => Err(StoreError::Io { op: "open blob", path, source: e }),
        }
    }
}

impl ReadStore for HttpStore {
    fn describe(&self) -> String {
        self.base().to_owned()
    }

    fn resolve(&self, reference: &str) -> Result<ImageId, StoreError> {
        HttpStore::resolve(self, reference)
    }

    fn get_entry(&self, id: &ImageId) -> Result<ImageEntry, StoreError> {
        HttpStore::get_entry(self, id)
    }

    fn read_blob(&self, digest: &Sha256Digest) -> Result<Vec<u8>, StoreError> {
        HttpStore::read_blob(self, digest)
    }

    fn list_refs(&self) -> Result<Vec<(String, ImageId)>, StoreError> {
        Ok(self.seen_refs())
    }

    fn chunk_source(&self, _image: &Arc<OpenImage>) -> Arc<dyn ChunkSource> {
        Arc::new(self.clone())
    }
}
