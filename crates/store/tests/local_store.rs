//! LocalStore: layout, blobs, streaming writes, entries, refs, resolve.

mod common;

use std::io::Write;

use common::{build_image, files_in, Rng};
use tessera_image::{ImageEntry, ImageId, Sha256Digest};
use tessera_store::{LocalStore, StoreError, StoreLocation};

#[test]
fn create_open_and_layout() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("s");
    assert!(matches!(LocalStore::open(&root), Err(StoreError::NoSuchStore { .. })));
    let store = LocalStore::create_or_open(&root).unwrap();
    for d in ["blobs/sha256", "images", "refs", "tmp"] {
        assert!(root.join(d).is_dir(), "{d}");
    }
    assert!(files_in(&root.join("tmp")).is_empty(), "the writability probe is cleaned up");
    LocalStore::create_or_open(&root).unwrap();
    LocalStore::open(&root).unwrap();
    let via_url = StoreLocation::parse(&format!("file://{}", root.display())).unwrap();
    assert_eq!(via_url.open_for_read().unwrap().root(), store.root());

    // Not a store: a file, a non-empty foreign directory, an empty directory for readers.
    let file = dir.path().join("f");
    std::fs::write(&file, b"x").unwrap();
    assert!(matches!(LocalStore::create_or_open(&file), Err(StoreError::NotAStore { .. })));
    assert!(matches!(LocalStore::open(&file), Err(StoreError::NotAStore { .. })));
    let foreign = dir.path().join("home");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(foreign.join("notes.txt"), b"x").unwrap();
    assert!(matches!(LocalStore::create_or_open(&foreign), Err(StoreError::NotAStore { .. })));
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    assert!(matches!(LocalStore::open(&empty), Err(StoreError::NotAStore { .. })));
    LocalStore::create_or_open(&empty).unwrap();
}

#[test]
fn stale_temps_are_cleaned_fresh_ones_kept() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path()).unwrap();
    let old = dir.path().join("tmp/123-old.tmp");
    let fresh = dir.path().join("tmp/456-fresh.tmp");
    std::fs::write(&old, b"partial").unwrap();
    std::fs::write(&fresh, b"in progress elsewhere").unwrap();
    let two_hours_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(7200);
    std::fs::File::options().write(true).open(&old).unwrap().set_modified(two_hours_ago).unwrap();
    drop(store);
    LocalStore::create_or_open(dir.path()).unwrap();
    assert!(!old.exists());
    assert!(fresh.exists());
}

#[test]
fn blob_roundtrip_dedup_and_ranges() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path()).unwrap();
    let data = Rng::new(1).bytes(100_000);
    let d = store.put_blob(&data).unwrap();
    assert_eq!(d, Sha256Digest::of(&data));
    assert!(store.has_blob(&d).unwrap());
    assert_eq!(store.blob_len(&d).unwrap(), 100_000);
    assert_eq!(store.read_blob(&d).unwrap(), data);
    let mtime = std::fs::metadata(store.blob_path(&d)).unwrap().modified().unwrap();
    assert_eq!(store.put_blob(&data).unwrap(), d, "dedup");
    assert_eq!(std::fs::metadata(store.blob_path(&d)).unwrap().modified().unwrap(), mtime, "not rewritten");
    assert_eq!(files_in(&dir.path().join("blobs/sha256")).len(), 1);
    assert!(files_in(&dir.path().join("tmp")).is_empty());

    assert_eq!(store.read_blob_range(&d, 10, 20).unwrap(), &data[10..30]);
    assert_eq!(store.read_blob_range(&d, 99_990, 10).unwrap(), &data[99_990..]);
    assert!(store.read_blob_range(&d, 100_000, 0).unwrap().is_empty());
    for (off, len) in [(99_991, 10), (100_001, 0), (u64::MAX, 2)] {
        assert!(
            matches!(store.read_blob_range(&d, off, len), Err(StoreError::RangeOutOfBounds { .. })),
            "{off}+{len}"
        );
    }
    let missing = Sha256Digest::of(b"missing");
    assert!(!store.has_blob(&missing).unwrap());
    assert!(matches!(store.read_blob(&missing), Err(StoreError::BlobNotFound { .. })));
    assert!(matches!(store.read_blob_range(&missing, 0, 1), Err(StoreError::BlobNotFound { .. })));
    assert!(matches!(store.blob_len(&missing), Err(StoreError::BlobNotFound { .. })));

    // The empty blob is a blob too.
    let e = store.put_blob(b"").unwrap();
    assert_eq!(store.read_blob(&e).unwrap(), b"");
}

#[test]
fn corrupt_blob_is_detected() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path()).unwrap();
    let d = store.put_blob(b"the original content").unwrap();
    std::fs::write(store.blob_path(&d), b"the 0riginal content").unwrap();
    match store.read_blob(&d) {
        Err(e @ StoreError::Corrupt { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(&d.hex()), "names the blob: {msg}");
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    // A truncated blob under its name is healed by the next put.
    std::fs::write(store.blob_path(&d), b"the orig").unwrap();
    store.put_blob(b"the original content").unwrap();
    assert_eq!(store.read_blob(&d).unwrap(), b"the original content");
}

#[test]
fn streaming_writer_commit_and_abort() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path()).unwrap();
    let mut rng = Rng::new(7);
    let parts: Vec<Vec<u8>> = (0..50).map(|i| rng.bytes(1000 + i * 3000)).collect();
    let whole: Vec<u8> = parts.concat();

    let mut w = store.blob_writer().unwrap();
    let mut expect_off = 0u64;
    for (i, p) in parts.iter().enumerate() {
        if i % 2 == 0 {
            assert_eq!(w.append(p).unwrap(), expect_off);
        } else {
            w.write_all(p).unwrap();
        }
        expect_off += p.len() as u64;
        assert_eq!(w.len(), expect_off);
    }
    assert_eq!(files_in(&dir.path().join("tmp")).len(), 1, "in progress in tmp/");
    assert!(files_in(&dir.path().join("blobs/sha256")).is_empty(), "nothing under a final name yet");
    let d = w.commit().unwrap();
    assert_eq!(d, Sha256Digest::of(&whole));
    assert_eq!(store.read_blob(&d).unwrap(), whole);
    assert!(files_in(&dir.path().join("tmp")).is_empty());

    // The same content again: committed, deduplicated.
    let mut w = store.blob_writer().unwrap();
    w.write_all(&whole).unwrap();
    assert_eq!(w.commit().unwrap(), d);
    assert!(files_in(&dir.path().join("tmp")).is_empty());
    assert_eq!(files_in(&dir.path().join("blobs/sha256")).len(), 1);

    // Abort: dropped without commit.
    let mut w = store.blob_writer().unwrap();
    w.write_all(b"never committed").unwrap();
    assert!(!w.is_empty());
    drop(w);
    assert!(files_in(&dir.path().join("tmp")).is_empty(), "temp removed on drop");
    assert!(!store.has_blob(&Sha256Digest::of(b"never committed")).unwrap());
    assert_eq!(files_in(&dir.path().join("blobs/sha256")).len(), 1);
}

#[test]
fn entries_refs_and_resolve() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path()).unwrap();
    assert!(store.list_images().unwrap().is_empty());
    assert!(store.list_refs().unwrap().is_empty());
    let img = build_image(&store, 64);

    assert_eq!(store.get_entry(&img.id).unwrap(), img.entry);
    assert_eq!(store.resolve(&img.id.to_string()).unwrap(), img.id);
    assert_eq!(store.resolve("test").unwrap(), img.id);
    // The ref names the image's prefix and pack index too, and the lengths of those and the
    // record (docs/formats/store.md, "Refs").
    let len = |d: &tessera_image::Sha256Digest| std::fs::metadata(store.blob_path(d)).unwrap().len();
    assert_eq!(
        std::fs::read_to_string(dir.path().join("refs/test")).unwrap(),
        format!(
            "{}\nprefix {}\npack-index {}\nlengths {} {} {}\n",
            img.id,
            img.entry.prefix,
            img.entry.pack_index,
            len(&img.id.digest()),
            len(&img.entry.prefix),
            len(&img.entry.pack_index)
        )
    );
    // A ref of the ID line alone (written before refs named them) still resolves.
    std::fs::write(dir.path().join("refs/old"), format!("{}\n", img.id)).unwrap();
    assert_eq!(store.resolve("old").unwrap(), img.id);
    std::fs::remove_file(dir.path().join("refs/old")).unwrap();
    assert_eq!(store.list_images().unwrap(), vec![img.id]);
    store.set_ref("v1.0_rc-2", &img.id).unwrap();
    assert_eq!(
        store.list_refs().unwrap(),
        vec![("test".to_owned(), img.id), ("v1.0_rc-2".to_owned(), img.id)]
    );

    let unknown_id = ImageId(Sha256Digest::of(b"nope"));
    for r in ["nope", &unknown_id.to_string()] {
        match store.resolve(r) {
            Err(e @ StoreError::UnknownImage { .. }) => assert!(!e.is_usage_error()),
            other => panic!("{r}: expected UnknownImage, got {other:?}"),
        }
    }
    assert!(matches!(store.get_entry(&unknown_id), Err(StoreError::UnknownImage { .. })));
    for r in ["", ".hidden", "a/b", "../../etc/passwd", "sha256:abc", "sha256:", &"a".repeat(129)] {
        assert!(matches!(store.resolve(r), Err(StoreError::InvalidReference { .. })), "{r:?}");
    }
    // By subject (`@sha256:`, a source image manifest): registry stores only; a usage error.
    match store.resolve(&format!("@{unknown_id}")) {
        Err(e @ StoreError::SubjectNeedsRegistry { .. }) => {
            assert!(e.is_usage_error());
            assert!(e.to_string().contains("only a registry store"), "{e}");
        }
        other => panic!("@sha256: expected SubjectNeedsRegistry, got {other:?}"),
    }
    assert!(matches!(store.set_ref("bad/tag", &img.id), Err(StoreError::InvalidTag { .. })));
    assert!(matches!(store.set_ref("orphan", &unknown_id), Err(StoreError::UnknownImage { .. })));
    assert!(!dir.path().join("refs/orphan").exists());

    // Order is enforced: an entry needs its blobs and must name its own record.
    let bad = ImageEntry { prefix: Sha256Digest::of(b"not stored"), ..img.entry.clone() };
    assert!(matches!(store.put_entry(&img.id, &bad), Err(StoreError::BlobNotFound { .. })));
    assert!(matches!(store.put_entry(&unknown_id, &img.entry), Err(StoreError::Inconsistent { .. })));
    assert_eq!(store.get_entry(&img.id).unwrap(), img.entry, "failed puts change nothing");

    // Corrupt refs and entries, dangling refs.
    std::fs::write(dir.path().join("refs/broken"), b"sha256:1234\n").unwrap();
    assert!(matches!(store.resolve("broken"), Err(StoreError::BadRef { .. })));
    assert!(matches!(store.list_refs(), Err(StoreError::BadRef { .. })));
    std::fs::remove_file(dir.path().join("refs/broken")).unwrap();
    std::fs::write(dir.path().join("refs/.editor-swap"), b"junk").unwrap();
    assert_eq!(store.list_refs().unwrap().len(), 2, "names that are not tags are ignored");
    let dangling = ImageId(Sha256Digest::of(b"gone"));
    std::fs::write(dir.path().join("refs/dangling"), format!("{dangling}\n")).unwrap();
    assert!(matches!(store.resolve("dangling"), Err(StoreError::DanglingRef { .. })));
    std::fs::write(store.entry_path(&img.id), b"{not json").unwrap();
    assert!(matches!(store.get_entry(&img.id), Err(StoreError::BadEntry { .. })));
}
