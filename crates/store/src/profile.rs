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
/// image. Writes the profile blob, then replaces the image entry (blobs before the entry), then
/// rewrites the tags pointing to the image, which name where the profile's chunks are stored
/// (`docs/formats/store.md`, "Refs"). Returns the new entry.
pub fn attach_profile(store: &LocalStore, id: &ImageId, profile: &Profile) -> Result<ImageEntry, StoreError> {
    let image = OpenImage::open(store, id)?;
    profile
        .check_against(*id, &image.record().block_map)
        .map_err(|source| StoreError::Profile { image: *id, source })?;
    let digest = store.put_blob(&profile.encode())?;
    let mut entry = image.entry().clone();
    entry.profile = Some(digest);
    store.put_entry(id, &entry)?;
    // The image's tags name the profile's chunks now: worked out once, from the image open here.
    let tags: Vec<String> =
        store.list_refs()?.into_iter().filter(|(_, to)| to == id).map(|(t, _)| t).collect();
    if !tags.is_empty() {
        let tags: Vec<&str> = tags.iter().map(String::as_str).collect();
        store.set_refs(&tags, id, Some(crate::profile_ranges(&image, profile)))?;
    }
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

/// Stored ranges of packs: per pack, its ranges (`(offset, len)`).
pub type PackRanges = Vec<(Sha256Digest, Vec<(u64, u32)>)>;

/// Stored bytes of a profile's chunks a ref names at most ([`profile_ranges`]): the first 2 MiB in
/// the profile's order, what a start needs first. A remote start fetches them while it fetches
/// the image's metadata, and holds them until the profile's prefetch takes them; the rest of a
/// larger profile is prefetched as before, once the image is open. About what the 16
/// connections of that fetch carry in a start's first round trips (slow start: 102 KB each in
/// three); with 4 or 16 MiB the fetch delayed the start's own requests and profiled python,
/// shell and gcc starts came out 10–40 ms later than with none (docs/benchmarks.md, "The
/// profile's chunks with the start").
pub const MAX_STAGED_BYTES: u64 = 2 << 20;

/// Ranges a ref names at most ([`profile_ranges`]).
pub const MAX_STAGED_RANGES: usize = 4096;

/// Where the chunks of `profile` are stored for `image`: one `(pack, ranges)` per pack, packs in
/// the order the profile first needs them, each pack's ranges ascending, chunks stored back to
/// back merged into one range. The profile's chunks in its order, up to [`MAX_STAGED_BYTES`]
/// and [`MAX_STAGED_RANGES`]; none for a `--reference-layers` image (its chunks are decoded from
/// spans of layer blobs, not read as stored ranges).
pub fn profile_ranges(image: &OpenImage, profile: &Profile) -> PackRanges {
    if image.reference().is_some() {
        return Vec::new();
    }
    let mut packs: PackRanges = Vec::new();
    let (mut bytes, mut seen) = (0u64, std::collections::HashSet::new());
    for e in profile.entries() {
        let Some((_, pack, loc)) = image.chunk_index(&e.chunk).and_then(|i| image.chunk_location(i)) else {
            continue;
        };
        if !seen.insert((pack, loc.offset)) {
            continue;
        }
        if bytes + u64::from(loc.stored_len) > MAX_STAGED_BYTES || seen.len() > MAX_STAGED_RANGES {
            break;
        }
        bytes += u64::from(loc.stored_len);
        match packs.iter_mut().find(|p| p.0 == pack) {
            Some(p) => p.1.push((loc.offset, loc.stored_len)),
            None => packs.push((pack, vec![(loc.offset, loc.stored_len)])),
        }
    }
    for (_, ranges) in &mut packs {
        ranges.sort_unstable();
        let mut merged: Vec<(u64, u32)> = Vec::with_capacity(ranges.len());
        for &(offset, len) in ranges.iter() {
            match merged.last_mut() {
                Some(last)
                    if last.0 + u64::from(last.1) == offset
                        && u64::from(last.1) + u64::from(len) <= u64::from(u32::MAX) =>
                {
                    last.1 += len;
                }
                _ => merged.push((offset, len)),
            }
        }
        *ranges = merged;
    }
    packs
}
