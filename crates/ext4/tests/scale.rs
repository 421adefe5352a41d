//! Scale check (ignored by default; run with `cargo test --release -p tessera-ext4 --test scale -- --ignored`):
//! one million files in 1000 directories must synthesize quickly and pass e2fsck.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;

#[test]
#[ignore = "slow: a million inodes; run in release"]
fn million_files() {
    let mut b = Builder::new();
    let r = Builder::root();
    for d in 0..1000 {
        let dir = b.dir(r, format!("dir{d:04}").as_bytes());
        for f in 0..1000 {
            b.file(dir, format!("file-{f:04}.txt").as_bytes(), (f % 3) * 100);
        }
    }
    let t0 = std::time::Instant::now();
    let img = tessera_ext4::synthesize(&b.tree, &options()).unwrap();
    let took = t0.elapsed();
    let meta_bytes: usize = img.metadata.iter().map(|r| r.data.len()).sum();
    eprintln!("synthesized 1M files in {took:?}; {} MiB of metadata; {:?}", meta_bytes >> 20, img.geometry);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fs.img");
    write_image(&path, &b.tree, &img);
    e2fsck_clean(&path);
}
