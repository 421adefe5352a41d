//! Prefetch profiles in a store: attach one to an image (a new blob and an atomically replaced
//! image entry; the image ID does not change) and read one back, checked against the image.
//! Formats: `docs/formats/profile.md`.

use tessera_image::{BlockMap, ImageEntry, ImageId, Profile, Sha256Digest};
use tracing::debug;

use crate::error::StoreError;
use crate::local::LocalStore;
use crate::read_store::ReadStore;
use crate::reader::OpenImage;

/// Attach `profile` to image `id`: it must have been made for `id` and name only chunks of the
/// image. Writes the profile blob, then replaces the image entry (blobs before the entry); refs
/// are untouched. Returns the new entry.
pub fn attach_profile(store: &LocalStore, id: &ImageId, profile: &Profile) -> Result<ImageEntry, StoreError> {
    let image = OpenImage::open(store, id)?;
    profile
        .check_against(*id, &image.record().block_map)
        .map_err(|source| StoreError::Profile { image: *id, source })?;
    let digest = store.put_blob(&profile.encode())?;
    let mut entry = image.entry().clone();
    entry.profile = Some(digest);
    store.put_entry(id, &entry)?;
    debug!(image = %id, profile = %digest, chunks = profile.entries().len(), "attached a profile");
    Ok(entry)
}

/// The profile named by image `id`'s `entry`, if any: read (sha256 verified), decoded and checked
/// against the image's block map `map` (made for it, only its chunks).
pub fn read_profile(
    store: &dyn ReadStore,
    id: &ImageId,
    entry: &ImageEntry,
    map: &BlockMap,
) -> Result<Option<(Sha256Digest, Profile)>, StoreError> {
    let Some(digest) = entry.profile else {
        return Ok(None);
    };
    let bytes = store.read_blob(&digest)?;
    let profile =
        Profile::decode(&bytes).map_err(|source| StoreError::Decode { what: "profile", digest, source })?;
    profile.check_against(*id, map).map_err(|source| StoreError::Profile { image: *id, source })?;
    Ok(Some((digest, profile)))
}
