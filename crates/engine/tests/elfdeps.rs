//! `MemTier::with_elf_deps` on a built image: when the dynamic loader is at work (a program's
//! header and dynamic section missed, then one of its libraries), the program's other libraries,
//! and theirs once they arrive, are fetched in the background; a reader of an ELF file's bytes
//! that moves on to something else fetches none of its libraries.
#![allow(clippy::unwrap_used)]

#[path = "../../store/tests/common/mod.rs"]
mod common;
mod engine_common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine_common::{first_offset_of, read_first_byte_of};
use tessera_builder::{build_dir, BuildConfig, NoProgress};
use tessera_engine::elfdeps::sample_elf;
use tessera_engine::{FetchLimits, MemTier};
use tessera_ext4::SizePolicy;
use tessera_store::{ImageReader, LocalStore, OpenImage};

/// `len` bytes no other file shares (so that no chunk is deduplicated between files).
fn noise(seed: u64, len: usize) -> Vec<u8> {
    common::Rng::new(seed).bytes(len)
}

/// An ELF file needing `names`, padded with noise to `len` bytes.
fn elf(seed: u64, interp: Option<&str>, names: &[&str], len: usize) -> Vec<u8> {
    let mut f = sample_elf(interp, names);
    let pad = len - f.len();
    f.extend(noise(seed, pad));
    f
}

fn write(root: &Path, rel: &str, bytes: &[u8]) {
    let path = root.join(rel);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

/// The image of `src` (64 KiB chunks, a 64 MiB device) built into a store under `dir`, opened.
fn built(dir: &Path, src: &Path) -> (LocalStore, Arc<OpenImage>) {
    let store = LocalStore::create_or_open(dir.join("store")).unwrap();
    let config =
        BuildConfig { chunk_size: 64 << 10, size: SizePolicy::Exact(64 << 20), ..BuildConfig::default() };
    let id = build_dir(src, &store, &config, &NoProgress).unwrap().id;
    let image = Arc::new(OpenImage::open(&store, &id).unwrap());
    (store, image)
}

/// A memory tier of 16 MiB over `image` with the ELF rule on or off (libraries up to 64 MiB).
fn tier(image: &Arc<OpenImage>, store: &LocalStore, elf_deps: bool) -> MemTier<LocalStore> {
    MemTier::new(ImageReader::new(Arc::clone(image), store.clone()), 16 << 20, FetchLimits::new(4))
        .unwrap()
        .with_elf_deps(elf_deps, 64 << 20)
}

/// The chunk holding the file whose bytes are `bytes` (each file here is one chunk), found by
/// content, independently of the ext4 lookup under test.
fn chunk_of(image: &OpenImage, store: &LocalStore, bytes: &[u8]) -> u32 {
    let reader = ImageReader::new(OpenImage::open(store, image.id()).unwrap(), store.clone());
    let chunks = image.record().block_map.chunks().len() as u32;
    let mut found: Vec<u32> = (0..chunks).filter(|&c| reader.fetch_chunk(c).unwrap() == bytes).collect();
    assert_eq!(found.len(), 1, "one chunk holds the file");
    found.pop().unwrap()
}

/// A one-byte read of chunk `chunk`'s first block through the tier's miss path; waits for it.
fn read(tier: &impl tessera_engine::BlockDevice, image: &OpenImage, chunk: u32) {
    assert!(read_first_byte_of(tier, image, chunk), "read of chunk {chunk}");
}

fn wait_for(what: &str, ok: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ok() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(5)); // polling interval
    }
}

#[test]
fn the_libraries_of_a_program_being_loaded_are_fetched_and_those_of_a_file_read_as_data_are_not() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let lib = "usr/lib/x86_64-linux-gnu";
    let files = [
        (
            "usr/bin/prog",
            elf(1, Some("/lib64/ld-linux-x86-64.so.2"), &["libfoo.so.1", "libbar.so.2"], 20_000),
        ),
        (&format!("{lib}/libfoo.so.1") as &str, elf(2, None, &["libbaz.so.3"], 30_000)),
        (&format!("{lib}/libbar.so.2"), elf(3, None, &[], 40_000)),
        (&format!("{lib}/libbaz.so.3"), elf(4, None, &[], 50_000)),
        ("usr/bin/other", elf(5, None, &["libqux.so.9"], 20_000)),
        (&format!("{lib}/libqux.so.9"), elf(6, None, &[], 60_000)),
        ("usr/share/data.bin", noise(7, 50_000)),
    ]
    .map(|(path, bytes)| (path.to_owned(), bytes));
    for (path, bytes) in &files {
        write(&src, path, bytes);
    }
    // Merged /usr, as Debian's: the loader's /lib paths are links.
    std::os::unix::fs::symlink("usr/lib", src.join("lib")).unwrap();
    let (store, image) = built(dir.path(), &src);
    let chunk: Vec<u32> = files.iter().map(|(_, bytes)| chunk_of(&image, &store, bytes)).collect();
    let [prog, foo, bar, baz, other, qux, data] = chunk[..] else { unreachable!() };

    let tier = tier(&image, &store, true);
    // The loader: the program's header (and dynamic section: one chunk here), then its first
    // library. Its second library is fetched without a read of it …
    read(&tier, &image, prog);
    read(&tier, &image, foo);
    wait_for("the program's other library fetched", || tier.contains(bar));
    // … and, once the first has arrived, that library's own (examined at the next read).
    read(&tier, &image, bar);
    wait_for("the library's library fetched", || tier.contains(baz));
    let queued = tier.stats().elf_dep_chunks.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(queued, 2, "libbar and libbaz, one chunk each");

    // A reader of a program's bytes that goes on to another file: its library stays out.
    read(&tier, &image, other);
    read(&tier, &image, data);
    read(&tier, &image, data);
    std::thread::sleep(Duration::from_millis(200)); // time a wrong background fetch would have had
    assert!(!tier.contains(qux), "the library of a file read as data was fetched");
    assert_eq!(tier.stats().elf_dep_chunks.load(std::sync::atomic::Ordering::Relaxed), queued);
}

/// A program examined at a read that was not the loader's (its bytes were in memory by the time
/// its miss was looked at, as from a host's disk, or another file's miss came between) is known
/// to be loading once a later miss is one of its libraries: its other libraries are fetched
/// then. (Examined once and forgotten, it never was: a race the first test lost when the local
/// store's fetch beat the look at the program's own miss.)
#[test]
fn a_program_examined_before_its_loader_read_a_library_has_the_rest_fetched_when_it_does() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let prog = elf(1, None, &["liba.so.1", "libb.so.1"], 20_000);
    let (a, b, data) = (elf(2, None, &[], 30_000), elf(3, None, &[], 30_000), noise(4, 30_000));
    write(&src, "usr/bin/prog", &prog);
    write(&src, "usr/lib/x86_64-linux-gnu/liba.so.1", &a);
    write(&src, "usr/lib/x86_64-linux-gnu/libb.so.1", &b);
    write(&src, "usr/share/data.bin", &data);
    let (store, image) = built(dir.path(), &src);
    let [p, ca, cb, d] = [&prog, &a, &b, &data].map(|f| chunk_of(&image, &store, f));
    let tier = tier(&image, &store, true);
    read(&tier, &image, p);
    // The program's bytes are in memory: the next miss examines it, and it is no library of
    // that read's file.
    read(&tier, &image, d);
    assert!(!tier.contains(ca) && !tier.contains(cb), "no library fetched for a read of data");
    read(&tier, &image, ca);
    wait_for("the program's other library fetched", || tier.contains(cb));
}

/// Off, nothing is fetched for the loader.
#[test]
fn off_fetches_no_library() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let prog = elf(1, None, &["liba.so.1", "libb.so.1"], 20_000);
    let (a, b) = (elf(2, None, &[], 30_000), elf(3, None, &[], 30_000));
    write(&src, "usr/bin/prog", &prog);
    write(&src, "usr/lib/x86_64-linux-gnu/liba.so.1", &a);
    write(&src, "usr/lib/x86_64-linux-gnu/libb.so.1", &b);
    let (store, image) = built(dir.path(), &src);
    let [p, ca, cb] = [&prog, &a, &b].map(|f| chunk_of(&image, &store, f));
    let tier = tier(&image, &store, false);
    read(&tier, &image, p);
    read(&tier, &image, ca);
    std::thread::sleep(Duration::from_millis(200)); // time a wrong background fetch would have had
    assert!(!tier.contains(cb));
}

/// Libraries of a block each lie side by side in the image, so that a read of one brings the
/// next ones into `ext4-view`'s block cache: every one is still found, at its own first block.
#[test]
fn small_libraries_side_by_side_are_all_located() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let names: Vec<String> = (0..12).map(|i| format!("libs{i:02}.so.1")).collect();
    let libs: Vec<Vec<u8>> = (0..12).map(|i| elf(10 + i, None, &[], 3_000)).collect();
    for (name, bytes) in names.iter().zip(&libs) {
        write(&src, &format!("usr/lib/x86_64-linux-gnu/{name}"), bytes);
    }
    let (store, image) = built(dir.path(), &src);
    let expected: Vec<u64> =
        libs.iter().map(|bytes| first_offset_of(&image, chunk_of(&image, &store, bytes))).collect();
    let found = tessera_engine::elfdeps::locate(&image, 62, &names, None);
    assert_eq!(found.libraries, expected);
    // And one at a time, after others were read.
    for (name, want) in names.iter().zip(&expected).rev() {
        let one = tessera_engine::elfdeps::locate(&image, 62, std::slice::from_ref(name), None);
        assert_eq!(one.libraries, vec![*want], "{name}");
    }
}
