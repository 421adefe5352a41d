//! Attaching a prefetch profile: a new entry with the same image ID; a profile naming a chunk the
//! image lacks, or made for another image, is refused and the entry stays as it was.

mod common;

use common::build_image;
use tessera_image::{ChunkId, ImageEntry, ImageId, Profile, Sha256Digest, Trace, TraceEntry};
use tessera_store::{attach_profile, read_profile, LocalStore, OpenImage};

fn profile_of(image: ImageId, chunks: &[ChunkId]) -> Profile {
    let entries = chunks.iter().enumerate().map(|(i, &chunk)| TraceEntry { chunk, at_us: i as u64 * 10 });
    let trace = Trace::new(image, entries.collect()).expect("a well-formed trace");
    Profile::merge(image, &[trace], 1).expect("one trace, threshold 1")
}

#[test]
fn attach_then_read_keeps_the_id_and_refuses_strays() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path()).unwrap();
    let img = build_image(&store, 64);
    let id = img.id;
    let chunks: Vec<ChunkId> = img.record.block_map.chunks().iter().map(|c| c.id).collect();
    assert_eq!(img.entry.profile, None);
    let profile = profile_of(id, &[chunks[2], chunks[0]]);

    let entry = attach_profile(&store, &id, &profile).unwrap();
    assert_eq!(entry.record, id.digest(), "the image ID is unchanged");
    assert_eq!(ImageEntry { profile: None, ..entry.clone() }, img.entry, "only the profile changed");
    assert_eq!(store.get_entry(&id).unwrap(), entry);
    assert_eq!(store.resolve("test").unwrap(), id, "the tag still resolves");
    let reopened = OpenImage::open(&store, &id).unwrap();
    let read = read_profile(&store, &id, reopened.entry(), &reopened.record().block_map).unwrap();
    assert_eq!(read, Some((entry.profile.unwrap(), profile.clone())));

    let stray = ChunkId::of(b"not in the image");
    let err = attach_profile(&store, &id, &profile_of(id, &[chunks[0], stray])).unwrap_err();
    assert!(chain(&err).contains(&stray.to_hex()), "{}", chain(&err));
    let other = ImageId(Sha256Digest::of(b"another image"));
    let err = attach_profile(&store, &id, &profile_of(other, &[chunks[0]])).unwrap_err();
    assert!(chain(&err).contains(&other.to_string()), "{}", chain(&err));
    assert_eq!(store.get_entry(&id).unwrap(), entry, "a refused profile leaves the entry alone");
}

/// An error and its sources, as the CLI prints them (a message does not repeat its source).
fn chain(e: &dyn std::error::Error) -> String {
    std::iter::successors(Some(e), |e| e.source()).map(|e| e.to_string()).collect::<Vec<_>>().join(": ")
}
