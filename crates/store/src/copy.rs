//! `tessera copy`: replicate an image between stores — its packs, pack index, prefix, record,
//! provenance and profile, then its entry, then its tag — into a writable store ([`CopyDest`]:
//! a local store or an `s3://` bucket). (A registry destination goes through
//! [`crate::push_image`].)
//!
//! The store's write order holds: every blob is written (atomically) before the entry that names
//! it, and the entry before the tag, so an interrupted copy leaves only unreferenced blobs, and a
//! rerun skips the blobs already there.

use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tessera_image::{AnyPackIndex, ImageEntry, ImageId, Sha256Digest};
use tracing::debug;

use crate::error::StoreError;
use crate::local::LocalStore;
use crate::profile::PackRanges;
use crate::read_store::ReadStore;

/// Bytes read from the source per write while streaming a pack.
const PIECE: usize = 4 << 20;

/// What [`copy_image`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyReport {
    /// Blobs the image needs (packs, pack index, prefix, record, provenance, profile).
    pub blobs: usize,
    /// Their total bytes.
    pub total_bytes: u64,
    /// Blobs copied, and the bytes sent for them.
    pub copied: usize,
    pub copied_bytes: u64,
    /// Bytes of copied blobs that an interrupted earlier copy had already sent (the parts of an
    /// unfinished multipart upload, kept): not sent again, not in `copied_bytes`.
    pub resumed_bytes: u64,
    /// Blobs the destination already had.
    pub present: usize,
    /// The tag written, if any.
    pub tag: Option<String>,
}

/// A store [`copy_image`] writes to, in the store's write order (blobs, the entry, the tag).
pub trait CopyDest: Sync {
    /// The store, for messages.
    fn describe(&self) -> String;
    /// Whether blob `digest` is there, `len` bytes long (then it is not copied again).
    fn has_blob_of_len(&self, digest: &Sha256Digest, len: u64) -> Result<bool, StoreError>;
    /// Store a small blob; its bytes must hash to `digest`.
    fn put_blob(&self, digest: &Sha256Digest, bytes: &[u8]) -> Result<(), StoreError>;
    /// Store a (large) blob of `len` bytes streamed from `reader`; it must hash to `digest`,
    /// or nothing appears under that name. Returns how many of the bytes an interrupted earlier
    /// attempt had left at the destination and were kept rather than sent again.
    fn put_streamed(&self, digest: &Sha256Digest, len: u64, reader: &mut dyn Read)
        -> Result<u64, StoreError>;
    /// Write the image entry (after every blob it names).
    fn put_entry(&self, id: &ImageId, entry: &ImageEntry) -> Result<(), StoreError>;
    /// Point `tag` at `id`, whose entry is `entry` (after the entry). `profile` is where the
    /// chunks of the image's profile are stored ([`crate::profile_ranges`]; empty without one),
    /// for a ref that names them (a store that can read the image itself may work them out).
    fn set_ref(
        &self,
        tag: &str,
        id: &ImageId,
        entry: &ImageEntry,
        profile: &PackRanges,
    ) -> Result<(), StoreError>;
    /// Whether [`Self::set_ref`] uses its `profile` argument (a store that works the places
    /// out itself says no, and the copy saves reading the record and prefix for them).
    fn wants_profile_places(&self) -> bool {
        true
    }
}

impl CopyDest for LocalStore {
    fn describe(&self) -> String {
        self.root().display().to_string()
    }

    fn has_blob_of_len(&self, digest: &Sha256Digest, len: u64) -> Result<bool, StoreError> {
        Ok(self.has_blob(digest)? && self.blob_len(digest)? == len)
    }

    fn put_blob(&self, digest: &Sha256Digest, bytes: &[u8]) -> Result<(), StoreError> {
        let written = LocalStore::put_blob(self, bytes)?;
        check_digest(self, digest, &written)
    }

    fn put_streamed(
        &self,
        digest: &Sha256Digest,
        _len: u64,
        reader: &mut dyn Read,
    ) -> Result<u64, StoreError> {
        let mut writer = self.blob_writer()?;
        let mut buf = vec![0u8; PIECE];
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(StoreError::Io {
                        op: "read blob from the source",
                        path: digest.hex().into(),
                        source: e,
                    })
                }
            };
            writer.append(&buf[..n])?;
        }
        let written = writer.commit()?;
        check_digest(self, digest, &written)?;
        Ok(0)
    }

    fn put_entry(&self, id: &ImageId, entry: &ImageEntry) -> Result<(), StoreError> {
        LocalStore::put_entry(self, id, entry)
    }

    fn set_ref(
        &self,
        tag: &str,
        id: &ImageId,
        _entry: &ImageEntry,
        _profile: &PackRanges,
    ) -> Result<(), StoreError> {
        LocalStore::set_ref(self, tag, id)
    }

    fn wants_profile_places(&self) -> bool {
        false
    }
}

/// Copy image `id` from `source` into `dest`, then point `tag` (if any) at it. `progress` is
/// called with (bytes done, total bytes) as blobs are copied or found present.
pub fn copy_image(
    source: &dyn ReadStore,
    id: &ImageId,
    dest: &dyn CopyDest,
    tag: Option<&str>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<CopyReport, StoreError> {
    if let Some(t) = tag {
        if !tessera_image::validate_tag(t) {
            return Err(StoreError::InvalidTag { tag: t.to_owned() });
        }
    }
    let entry = source.get_entry(id)?;
    let index_bytes = source.read_blob(&entry.pack_index)?;
    let index = AnyPackIndex::decode(&index_bytes).map_err(|source| StoreError::Decode {
        what: "pack index",
        digest: entry.pack_index,
        source,
    })?;
    // Packs first (the bulk), then the small blobs; the entry after all of them.
    let mut blobs: Vec<(Sha256Digest, bool)> = index.data_blobs().into_iter().map(|p| (p, true)).collect();
    let small =
        [Some(entry.pack_index), Some(entry.prefix), Some(entry.record), entry.provenance, entry.profile];
    blobs.extend(small.into_iter().flatten().map(|d| (d, false)));
    blobs.dedup();
    let mut sizes = Vec::with_capacity(blobs.len());
    for (digest, _) in &blobs {
        sizes.push(source.blob_len(digest)?);
    }
    let mut report =
        CopyReport { blobs: blobs.len(), total_bytes: sizes.iter().sum(), ..CopyReport::default() };
    progress(0, report.total_bytes);
    // Blobs go over COPY_WORKERS at a time: one stream from an object store or a registry is far
    // below what the server gives several (rclone serve s3 on loopback: 125 MB/s for one, about
    // twice that for four). The entry waits for all of them.
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let (tx, rx) = std::sync::mpsc::channel::<Result<Copied, StoreError>>();
    let first_error = std::thread::scope(|scope| {
        for _ in 0..COPY_WORKERS.min(blobs.len()) {
            let tx = tx.clone();
            let (next, failed, blobs, sizes) = (&next, &failed, &blobs, &sizes);
            scope.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let (Some(&(digest, stream)), Some(&size)) = (blobs.get(i), sizes.get(i)) else { break };
                if failed.load(Ordering::Relaxed) {
                    break;
                }
                let result = copy_blob(source, dest, &digest, stream, size);
                if result.is_err() {
                    failed.store(true, Ordering::Relaxed);
                }
                if tx.send(result).is_err() {
                    break;
                }
            });
        }
        drop(tx);
        let mut done = 0;
        let mut first_error = None;
        for result in rx {
            match result {
                Ok(Copied::Present { size }) => {
                    report.present += 1;
                    done += size;
                }
                Ok(Copied::Sent { size, resumed }) => {
                    report.copied += 1;
                    report.copied_bytes += size - resumed;
                    report.resumed_bytes += resumed;
                    done += size;
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
            progress(done, report.total_bytes);
        }
        first_error
    });
    if let Some(e) = first_error {
        return Err(e);
    }
    dest.put_entry(id, &entry)?;
    if let Some(t) = tag {
        // The profile's places, for the tag's ref: a hint, so none if they cannot be worked out.
        let profile = if entry.profile.is_some() && dest.wants_profile_places() {
            profile_places(source, id, &entry, &index_bytes).unwrap_or_else(|e| {
                debug!(tag = t, image = %id, error = %e, "the ref names no profile ranges");
                PackRanges::new()
            })
        } else {
            PackRanges::new()
        };
        dest.set_ref(t, id, &entry, &profile)?;
        report.tag = Some(t.to_owned());
    }
    Ok(report)
}

/// Where the chunks of image `id`'s profile are stored in `source` ([`crate::profile_ranges`]),
/// from its record, prefix and pack index (`index_bytes`, read already) and its profile.
fn profile_places(
    source: &dyn ReadStore,
    id: &ImageId,
    entry: &ImageEntry,
    index_bytes: &[u8],
) -> Result<PackRanges, StoreError> {
    let record = source.read_blob(&entry.record)?;
    let prefix = source.read_blob(&entry.prefix)?;
    let image = crate::OpenImage::from_parts(*id, entry.clone(), &record, &prefix, index_bytes)?;
    let profile = crate::read_profile(source, id, entry, &image.record().block_map)?;
    Ok(profile.map(|(_, p)| crate::profile_ranges(&image, &p)).unwrap_or_default())
}

/// Blobs [`copy_image`] copies at once.
const COPY_WORKERS: usize = 4;

/// What became of one blob.
enum Copied {
    /// The destination had it.
    Present { size: u64 },
    /// Sent, but for `resumed` bytes an earlier attempt had left there.
    Sent { size: u64, resumed: u64 },
}

/// Copy one blob of `size` bytes unless the destination has it; packs (`stream`) are streamed.
fn copy_blob(
    source: &dyn ReadStore,
    dest: &dyn CopyDest,
    digest: &Sha256Digest,
    stream: bool,
    size: u64,
) -> Result<Copied, StoreError> {
    if dest.has_blob_of_len(digest, size)? {
        return Ok(Copied::Present { size });
    }
    let resumed = if stream {
        let mut reader = source.open_blob(digest)?;
        dest.put_streamed(digest, size, &mut reader)?.min(size)
    } else {
        dest.put_blob(digest, &source.read_blob(digest)?)?;
        0
    };
    debug!(%digest, size, resumed, "copied blob");
    Ok(Copied::Sent { size, resumed })
}

/// The bytes written must hash to the name the source gave them; otherwise the source is corrupt
/// (what was written sits under its own, unreferenced name).
fn check_digest(
    dest: &LocalStore,
    expected: &Sha256Digest,
    written: &Sha256Digest,
) -> Result<(), StoreError> {
    if written == expected {
        return Ok(());
    }
    Err(StoreError::Corrupt {
        what: "blob copied from the source",
        digest: *expected,
        path: dest.blob_path(written),
        reason: format!("its bytes hash to {written}"),
    })
}
