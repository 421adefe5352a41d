//! Directory rebuilds (issue 12, point 6): a build into a store that holds the previous build of
//! the same directory reads only the files whose inode, size, blocks, mtime or ctime changed, and
//! gives the image a build from scratch gives.

use std::fs;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tessera_builder::{build_dir, BuildConfig, BuildOutput, Progress, Reuse};
use tessera_store::LocalStore;

/// Counts the bytes the build says it reads.
#[derive(Default)]
struct Counted {
    total: AtomicU64,
    advanced: AtomicU64,
}

impl Progress for Counted {
    fn start(&self, total: u64) {
        self.total.store(total, Ordering::Relaxed);
    }
    fn advance(&self, bytes: u64) {
        self.advanced.fetch_add(bytes, Ordering::Relaxed);
    }
    fn finish(&self) {}
}

fn content(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn build(tree: &Path, store: &LocalStore, reread: bool) -> (BuildOutput, u64) {
    let config = BuildConfig { fs_time: 1000, chunk_size: 64 << 10, reread, ..BuildConfig::default() };
    let progress = Counted::default();
    let out = build_dir(tree, store, &config, &progress).expect("build");
    let read = progress.advanced.load(Ordering::Relaxed);
    assert_eq!(read, progress.total.load(Ordering::Relaxed), "progress covers what is read");
    (out, read)
}

/// A timestamp's tick must pass before a file counts as unchanged (the racy window).
fn settle() {
    std::thread::sleep(Duration::from_millis(1100));
}

#[test]
fn a_rebuild_reads_only_changed_files_and_gives_the_same_image() {
    let dir = tempfile::tempdir().unwrap();
    let tree = dir.path().join("tree");
    fs::create_dir_all(tree.join("a")).unwrap();
    fs::create_dir_all(tree.join("b")).unwrap();
    fs::write(tree.join("a/one"), content(1, 200_000)).unwrap();
    fs::write(tree.join("a/two"), content(2, 5000)).unwrap();
    fs::write(tree.join("b/three"), content(3, 150_000)).unwrap();
    fs::write(tree.join("b/four"), content(4, 70_000)).unwrap();
    fs::write(tree.join("b/empty"), b"").unwrap();
    fs::hard_link(tree.join("a/two"), tree.join("b/two-again")).unwrap();
    let sparse = fs::File::create(tree.join("b/sparse")).unwrap();
    sparse.set_len(1 << 20).unwrap();
    std::os::unix::fs::FileExt::write_at(&sparse, b"island", 300_000).unwrap();
    drop(sparse);
    settle();

    let store = LocalStore::create_or_open(dir.path().join("store")).unwrap();
    let (first, read) = build(&tree, &store, false);
    assert_eq!(first.reused, Reuse::default(), "nothing to reuse in a fresh store");
    assert!(read >= 425_000, "the first build reads everything: {read}");

    // Unchanged: no file is read, the same image.
    let (second, read) = build(&tree, &store, false);
    assert_eq!(second.id, first.id);
    assert_eq!(read, 0, "an unchanged tree reads nothing");
    assert_eq!(second.reused.files, 5, "one, two (and its link), three, four, sparse");
    // --reread reads everything again, and still gives the same image.
    let (again, read) = build(&tree, &store, true);
    assert_eq!((again.id, again.reused), (first.id, Reuse::default()));
    assert!(read >= 425_000);

    // Changes: content rewritten at the same size with its mtime put back (only ctime tells), an
    // append, a removal, a new file, a file replaced by another inode with the same bytes.
    let two = tree.join("a/two");
    let mtime = fs::metadata(&two).unwrap().modified().unwrap();
    fs::write(&two, content(22, 5000)).unwrap();
    fs::File::options().write(true).open(&two).unwrap().set_modified(mtime).unwrap();
    let mut one = fs::read(tree.join("a/one")).unwrap();
    one.extend_from_slice(b"appended");
    fs::write(tree.join("a/one"), &one).unwrap();
    fs::remove_file(tree.join("b/three")).unwrap();
    fs::write(tree.join("b/five"), content(5, 9000)).unwrap();
    let four = fs::read(tree.join("b/four")).unwrap();
    fs::remove_file(tree.join("b/four")).unwrap();
    fs::write(tree.join("b/four"), &four).unwrap();

    let (third, read) = build(&tree, &store, false);
    assert_eq!(third.reused.files, 1, "only the sparse file is unchanged");
    assert_eq!(read, 200_008 + 5000 + 9000 + 70_000, "exactly the changed files' bytes are read");
    let fresh = LocalStore::create_or_open(dir.path().join("fresh")).unwrap();
    let (scratch, _) = build(&tree, &fresh, false);
    assert_eq!(third.id, scratch.id, "a rebuild gives the image a build from scratch gives");
    assert_ne!(third.id, first.id);
}

#[test]
fn a_damaged_or_stale_index_only_costs_a_full_read() {
    let dir = tempfile::tempdir().unwrap();
    let tree = dir.path().join("tree");
    fs::create_dir_all(&tree).unwrap();
    fs::write(tree.join("f"), content(7, 100_000)).unwrap();
    fs::write(tree.join("g"), content(8, 3000)).unwrap();
    settle();
    let store = LocalStore::create_or_open(dir.path().join("store")).unwrap();
    let (first, _) = build(&tree, &store, false);

    // Another chunk size: another index (keyed by it), so nothing is reused.
    let other = BuildConfig { fs_time: 1000, chunk_size: 128 << 10, ..BuildConfig::default() };
    let out = build_dir(&tree, &store, &other, &tessera_builder::NoProgress).unwrap();
    assert_eq!(out.reused, Reuse::default());

    // The index damaged (cut short): the build reads everything and still succeeds.
    let sources = dir.path().join("store/sources");
    let record = fs::read_dir(&sources)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.extension().is_some_and(|x| x == "json")
                && fs::read_to_string(p).unwrap().contains(&first.id.0.hex())
        })
        .expect("a source record for the first image");
    let index = record.with_extension("idx");
    let bytes = fs::read(&index).unwrap();
    fs::write(&index, &bytes[..bytes.len() - 1]).unwrap();
    let (out, read) = build(&tree, &store, false);
    assert_eq!((out.id, out.reused), (first.id, Reuse::default()));
    assert_eq!(read, 103_000);
    // That build wrote a good index again.
    let (out, read) = build(&tree, &store, false);
    assert_eq!((out.id, out.reused.files, read), (first.id, 2, 0));

    // A file changed within the racy window is read again by every build until it settles.
    fs::write(tree.join("g"), content(9, 3000)).unwrap();
    let (a, read_a) = build(&tree, &store, false);
    let (b, read_b) = build(&tree, &store, false);
    assert_eq!((read_a, read_b), (3000, 3000), "a racily clean file is never trusted");
    assert_eq!(a.id, b.id);
    settle();
    let (_, read) = build(&tree, &store, false);
    assert_eq!(read, 3000, "trusted only by the index of a build after it settled");
    let (_, read) = build(&tree, &store, false);
    assert_eq!(read, 0);
}
