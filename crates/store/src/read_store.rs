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
use crate::refs::RefParts;
use crate::source::ChunkSource;

/// A store opened for reading, whatever its kind: a [`LocalStore`], an [`HttpStore`] or a
/// [`crate::CachedStore`]. What `export`, `inspect` and `serve` need: resolve a reference, read
/// the image entry and verified blobs, open the image, and a [`ChunkSource`] for its chunks.
pub trait ReadStore: Send + Sync + std::fmt::Debug {
    /// The store, for messages.
    fn describe(&self) -> String;
    /// Resolve `sha256:<64 hex>` (the store must hold that image) or a tag.
    fn resolve(&self, reference: &str) -> Result<ImageId, StoreError>;
    /// [`Self::resolve`] for a caller that opens the image next ([`Self::open_image_with`], which
    /// fails with [`StoreError::UnknownImage`] if the store lacks it): a remote store skips the
    /// check that the image's entry exists, so the entry is fetched once, alongside the record,
    /// instead of before it — one round trip fewer. The default is [`Self::resolve`].
    fn resolve_to_open(&self, reference: &str) -> Result<ImageId, StoreError> {
        self.resolve(reference)
    }
    /// A likely answer of [`Self::resolve`] known without asking anyone (a tag lookup a disk
    /// cache holds, with the image's entry), for opening the image while `resolve` confirms it;
    /// `None` (the default): none. Never an answer on its own: a tag may have moved.
    fn guess_resolve(&self, _reference: &str) -> Option<ImageId> {
        None
    }
    /// The prefix and pack index of image `id` as a tag's ref named them when it was resolved
    /// ([`crate::RefText`]), unchecked: [`Self::open_image_with`] requests them alongside the
    /// entry and uses them only if the entry names the same. `None` (the default): not known.
    fn ref_parts(&self, _id: &ImageId) -> Option<RefParts> {
        None
    }
    /// The entry of image `id` ([`StoreError::UnknownImage`] if the store lacks it).
    fn get_entry(&self, id: &ImageId) -> Result<ImageEntry, StoreError>;
    /// A whole blob, checked against its sha256.
    fn read_blob(&self, digest: &Sha256Digest) -> Result<Vec<u8>, StoreError>;
    /// [`Self::read_blob`] handing the bytes to `sink` as they arrive: a store that streams
    /// (an HTTP origin) feeds each piece as it comes off the connection and checks the sha256 at
    /// the end — a failed attempt is retried from [`BlobSink::restart`] —, so the sink's work
    /// (decompressing a prefix) overlaps the transfer; `Ok` once the whole blob was fed and
    /// verified. The default feeds the whole blob [`Self::read_blob`] returns.
    fn read_blob_streamed(&self, digest: &Sha256Digest, sink: &mut dyn BlobSink) -> Result<(), StoreError> {
        let bytes = self.read_blob(digest)?;
        sink.restart();
        sink.feed(&bytes);
        Ok(())
    }
    /// The tags the store knows. A local store lists `refs/`; an HTTP store cannot list, so it
    /// returns the tags resolved through it so far.
    fn list_refs(&self) -> Result<Vec<(String, ImageId)>, StoreError>;
    /// The chunk source for `image`'s chunks.
    fn chunk_source(&self, image: &Arc<OpenImage>) -> Arc<dyn ChunkSource>;

    /// Load and check image `id` (entry, record, prefix, pack index; see
    /// [`OpenImage::from_parts`]); [`Self::open_image_with`] without the profile.
    fn open_image(&self, id: &ImageId) -> Result<OpenImage, StoreError> {
        self.open_image_with(id, false).0
    }

    /// [`Self::open_image`], and with `profile` the image's prefetch profile when its entry names
    /// one (its digest and bytes), read while the image opens.
    ///
    /// Each part is requested as soon as its digest is known and decoded on the thread that
    /// read it as soon as it is in, while the others may still be arriving: the record (its
    /// digest is the image ID) alongside the entry, and so are the prefix and pack index when
    /// the tag's ref named them ([`Self::ref_parts`]; else once the entry names them); the
    /// profile once the entry names it. The prefix is decompressed and checked once the record
    /// says how long it is and what it hashes to. [`Self::read_blob`] has verified each blob's
    /// digest. For a remote store with a connection at hand for each request, an image is open
    /// one round trip after its tag (two for an old ref), where each part after the one naming
    /// it took four.
    fn open_image_with(
        &self,
        id: &ImageId,
        profile: bool,
    ) -> (Result<OpenImage, StoreError>, Option<ProfileRead>) {
        std::thread::scope(|s| {
            // The record's word on the prefix (`None`: the record failed, and says why itself),
            // for the prefix fetched as the ref named it and for the one the entry names, when
            // they differ.
            let (tell, told) = std::sync::mpsc::sync_channel::<Word>(1);
            let (tell_again, told_again) = std::sync::mpsc::sync_channel::<Word>(1);
            let record = s.spawn(move || {
                let record = self.read_blob(&id.digest()).and_then(|b| OpenImage::decode_record(id, &b));
                let word = record.as_ref().ok().map(|r| (r.prefix.blocks, r.prefix.digest));
                let _ = (tell.send(word), tell_again.send(word));
                record
            });
            let prefix = |digest: Sha256Digest, told: std::sync::mpsc::Receiver<Word>| {
                s.spawn(move || {
                    let mut sink = PrefixSink::new(digest, told);
                    self.read_blob_streamed(&digest, &mut sink)?;
                    sink.finish()
                })
            };
            let index = |digest: Sha256Digest| {
                s.spawn(move || self.read_blob(&digest).and_then(|b| OpenImage::decode_index(&digest, &b)))
            };
            // A tag's ref named the prefix and pack index: they go with the entry and the record.
            let early =
                self.ref_parts(id).map(|parts| (parts, prefix(parts.prefix, told), index(parts.pack_index)));
            let entry = match self.get_entry(id) {
                // An entry naming another image's record (entries are not content-addressed)
                // says so at once, before its parts fail their checks for that reason.
                Ok(entry) if entry.record != id.digest() => {
                    return (Err(OpenImage::wrong_record(id, &entry)), None);
                }
                Ok(entry) => entry,
                Err(e) => return (Err(e), None),
            };
            let profile = entry.profile.filter(|_| profile).map(|d| s.spawn(move || (d, self.read_blob(&d))));
            let (prefix, index) = match early {
                Some((parts, prefix, index)) if parts.match_entry(&entry) => (joined(prefix), joined(index)),
                // No ref named them, or not those the entry names (a stale or wrong ref: what was
                // fetched for it is dropped).
                _ => {
                    let (prefix, index) = (prefix(entry.prefix, told_again), index(entry.pack_index));
                    (joined(prefix), joined(index))
                }
            };
            let (record, profile) = (joined(record), profile.map(joined));
            let image = (|| OpenImage::join(*id, entry, record?, prefix?, index?))();
            (image, profile)
        })
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

/// Where [`ReadStore::read_blob_streamed`] puts a blob's bytes as they arrive. Unverified until
/// the read returns `Ok`.
pub trait BlobSink {
    /// Forget what was fed: the blob is fed again from its first byte (a new attempt).
    fn restart(&mut self);
    /// The next bytes of the blob.
    fn feed(&mut self, bytes: &[u8]);
}

/// The blob in memory.
impl BlobSink for Vec<u8> {
    fn restart(&mut self) {
        self.clear();
    }

    fn feed(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// The metadata prefix decompressed as its blob arrives — before the record's word on it
/// (length and digest) is in, up to [`crate::prefix::EARLY_ROOM`] — and checked against that
/// word at the end.
struct PrefixSink {
    stored: Sha256Digest,
    told: std::sync::mpsc::Receiver<Word>,
    /// The record's word, once received (`Some(None)`: the record failed).
    word: Option<Word>,
    /// Bytes fed and not yet inflated (an early inflater that filled its room waits for the
    /// word).
    pending: Vec<u8>,
    inflater: Option<Result<crate::prefix::Inflater, StoreError>>,
    /// The early room could not be mapped: what arrives before the word waits for it.
    no_early_room: bool,
}

/// The record's word on the prefix: its length in blocks and its sha256 (`None`: the record
/// failed, and reports why itself).
type Word = Option<(u64, Sha256Digest)>;

impl PrefixSink {
    fn new(stored: Sha256Digest, told: std::sync::mpsc::Receiver<Word>) -> Self {
        Self { stored, told, word: None, pending: Vec::new(), inflater: None, no_early_room: false }
    }

    /// Take the record's word if it is in (with `wait`, wait for it), and start inflating what
    /// is pending once it is.
    fn listen(&mut self, wait: bool) {
        use std::sync::mpsc::TryRecvError;
        if self.word.is_none() {
            let got = if wait {
                self.told.recv().map_err(|_| TryRecvError::Disconnected)
            } else {
                self.told.try_recv()
            };
            self.word = match got {
                Ok(word) => Some(word),
                // The record's thread ended without a word: it failed.
                Err(TryRecvError::Disconnected) => Some(None),
                Err(TryRecvError::Empty) => None,
            };
        }
        let Some(Some((blocks, _))) = self.word else { return };
        if matches!(&self.inflater, Some(Ok(i)) if i.settled()) || matches!(self.inflater, Some(Err(_))) {
            return;
        }
        let stored = self.stored;
        let corrupt = |e| crate::reader::prefix_error(&stored, e);
        let pending = std::mem::take(&mut self.pending);
        let early = self.inflater.take();
        let settled = OpenImage::prefix_len(&stored, blocks).and_then(|len| {
            let mut inflater = match early {
                // What came before the word was inflated already: tell it the length.
                Some(Ok(mut early)) => early.settle(len).map(|()| early),
                _ => crate::prefix::Inflater::new(len),
            }
            .map_err(corrupt)?;
            inflater.feed(&pending).map_err(corrupt)?;
            Ok(inflater)
        });
        self.inflater = Some(settled);
    }

    /// The prefix, once the whole verified blob was fed (`Ok(empty)` if the record failed).
    fn finish(mut self) -> Result<crate::prefix::PrefixBuf, StoreError> {
        self.listen(true);
        let (Some(Some((_, digest))), Some(inflater)) = (self.word, self.inflater) else {
            return Ok(crate::prefix::PrefixBuf::empty());
        };
        OpenImage::check_prefix(&self.stored, inflater?.finish(), &digest)
    }
}

impl BlobSink for PrefixSink {
    fn restart(&mut self) {
        self.pending.clear();
        self.inflater = None;
    }

    fn feed(&mut self, bytes: &[u8]) {
        self.listen(false);
        if self.inflater.is_none() && !self.no_early_room {
            // Before the record's word: inflate as the bytes come, within the early room (if the
            // address space for it is refused — a strict overcommit policy, an address-space
            // limit — the bytes wait for the word instead).
            match crate::prefix::Inflater::early() {
                Ok(early) => self.inflater = Some(Ok(early)),
                Err(_) => self.no_early_room = true,
            }
        }
        match &mut self.inflater {
            Some(Ok(_)) if !self.pending.is_empty() => self.pending.extend_from_slice(bytes),
            Some(Ok(inflater)) => match inflater.feed(bytes) {
                Ok(took) => self.pending.extend_from_slice(&bytes[took..]),
                Err(e) => self.inflater = Some(Err(crate::reader::prefix_error(&self.stored, e))),
            },
            None => self.pending.extend_from_slice(bytes),
            Some(Err(_)) => {}
        }
    }
}

/// A prefetch profile read with its image ([`ReadStore::open_image_with`]): its digest and bytes.
pub type ProfileRead = (Sha256Digest, Result<Vec<u8>, StoreError>);

/// A scoped thread's result; its panic goes on in the caller.
fn joined<T>(handle: std::thread::ScopedJoinHandle<'_, T>) -> T {
    handle.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
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

    /// [`OpenImage::open`], which also checks that every pack is long enough; then the profile
    /// (local reads: nothing to overlap).
    fn open_image_with(
        &self,
        id: &ImageId,
        profile: bool,
    ) -> (Result<OpenImage, StoreError>, Option<ProfileRead>) {
        let image = OpenImage::open(self, id);
        let digest = image.as_ref().ok().and_then(|i| i.entry().profile).filter(|_| profile);
        let profile = digest.map(|d| (d, self.read_blob(&d)));
        (image, profile)
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

    fn resolve_to_open(&self, reference: &str) -> Result<ImageId, StoreError> {
        HttpStore::resolve_unchecked(self, reference)
    }

    fn ref_parts(&self, id: &ImageId) -> Option<RefParts> {
        HttpStore::ref_parts(self, id)
    }

    fn read_blob_streamed(&self, digest: &Sha256Digest, sink: &mut dyn BlobSink) -> Result<(), StoreError> {
        HttpStore::read_blob_streamed(self, digest, sink)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A prefix of `blocks` blocks, its zstd stream and its digest.
    fn prefix(blocks: u64) -> (Vec<u8>, Vec<u8>, Sha256Digest) {
        let data: Vec<u8> = (0..blocks * 4096).map(|i| (i % 253) as u8).collect();
        let z = zstd::encode_all(&data[..], 3).unwrap();
        let digest = Sha256Digest::of(&data);
        (data, z, digest)
    }

    #[test]
    fn a_prefix_sink_inflates_whenever_the_record_speaks_and_starts_over_on_restart() {
        let (data, z, digest) = prefix(300);
        let stored = Sha256Digest::of(&z);
        // The record's word before the first byte, after the third piece, after the last; with
        // the early room, and without (its address space refused).
        for (word_after, early) in [0usize, 3, usize::MAX].into_iter().flat_map(|w| [(w, true), (w, false)]) {
            let (tell, told) = std::sync::mpsc::sync_channel(1);
            let mut sink = PrefixSink::new(stored, told);
            sink.no_early_room = !early;
            let mut tell = Some(tell);
            // A first attempt broken after two pieces, then the whole blob.
            for piece in z.chunks(1000).take(2) {
                sink.feed(piece);
            }
            sink.restart();
            for (i, piece) in z.chunks(1000).enumerate() {
                if i == word_after {
                    tell.take().unwrap().send(Some((300, digest))).unwrap();
                }
                sink.feed(piece);
            }
            if let Some(t) = tell.take() {
                t.send(Some((300, digest))).unwrap();
            }
            assert_eq!(
                &*sink.finish().unwrap(),
                &data[..],
                "word after piece {word_after}, early room {early}"
            );
        }
        // A record that disagrees (length, digest): the prefix is corrupt.
        for word in [(299, digest), (300, Sha256Digest::of(b"other"))] {
            let (tell, told) = std::sync::mpsc::sync_channel(1);
            let mut sink = PrefixSink::new(stored, told);
            tell.send(Some(word)).unwrap();
            sink.feed(&z);
            assert!(matches!(sink.finish(), Err(StoreError::Corrupt { what: "metadata prefix", .. })));
        }
        // A record that failed (it says so itself), or whose thread ended without a word.
        let (tell, told) = std::sync::mpsc::sync_channel(1);
        let mut sink = PrefixSink::new(stored, told);
        sink.feed(&z);
        tell.send(None).unwrap();
        assert!(sink.finish().unwrap().is_empty());
        let (tell, told) = std::sync::mpsc::sync_channel::<Word>(1);
        drop(tell);
        let mut sink = PrefixSink::new(stored, told);
        sink.feed(&z);
        assert!(sink.finish().unwrap().is_empty());
    }
}
