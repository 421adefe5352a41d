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

/// Attaching a profile rewrites the image's tags to name where the profile's chunks are stored,
/// per pack in the profile's order, chunks stored back to back merged into one range: what a
/// remote start fetches while it fetches the image's metadata.
#[test]
fn a_tag_names_where_its_profile_s_chunks_are_stored() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path()).unwrap();
    let img = build_image(&store, 64);
    let id = img.id;
    let image = OpenImage::open(&store, &id).unwrap();
    let ref_text = || {
        let bytes = std::fs::read(dir.path().join("refs/test")).unwrap();
        tessera_store::RefText::parse(&bytes).expect("a ref")
    };
    assert!(ref_text().profile.is_empty(), "no profile, no ranges");
    let n = image.record().block_map.chunks().len() as u32;
    assert!(n >= 4, "{n} chunks");
    let place = |i: u32| image.chunk_location(i).map(|(c, p, l)| (c.id, p, l.offset, l.stored_len)).unwrap();
    // Chunks 3, then 0 and 1 (stored back to back in the builder's order), then 3 again.
    let (c3, c0, c1) = (place(3), place(0), place(1));
    assert_eq!((c0.1, c0.2 + u64::from(c0.3)), (c1.1, c1.2), "chunks 0 and 1 adjacent in one pack");
    store.set_ref("second", &id).unwrap();
    attach_profile(&store, &id, &profile_of(id, &[c3.0, c0.0, c1.0])).unwrap();
    // Every tag of the image rewritten alike, as a ref written afresh names them.
    let bytes = |tag: &str| std::fs::read(dir.path().join("refs").join(tag)).unwrap();
    store.set_ref("third", &id).unwrap();
    assert_eq!(bytes("second"), bytes("test"));
    assert_eq!(bytes("third"), bytes("test"));
    let text = ref_text();
    assert_eq!(text.id, id);
    let mut want: Vec<(Sha256Digest, Vec<(u64, u32)>)> = Vec::new();
    for (pack, offset, len) in [(c3.1, c3.2, c3.3), (c0.1, c0.2, c0.3 + c1.3)] {
        match want.iter_mut().find(|w| w.0 == pack) {
            Some(w) => w.1.push((offset, len)),
            None => want.push((pack, vec![(offset, len)])),
        }
    }
    for w in &mut want {
        w.1.sort_unstable();
    }
    assert_eq!(text.profile, want);
    // The bytes it names are the chunks' stored bytes.
    for (pack, ranges) in &text.profile {
        let blob = std::fs::read(dir.path().join("blobs/sha256").join(pack.hex())).unwrap();
        for &(offset, len) in ranges {
            assert!(offset + u64::from(len) <= blob.len() as u64);
        }
    }
}
