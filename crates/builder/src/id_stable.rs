//! The image ID of a fixed generated tree, pinned: a change to how the builder holds a tree in
//! memory (issue 16 point 5) must not change a single byte of the image. The expected ID was
//! produced by the builder before that change.

use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, UNIX_EPOCH};

use tessera_store::LocalStore;

use crate::chunk::chunk_tree;
use crate::pipeline::{finish_image, BuildConfig};
use crate::walk::walk_dir;
use crate::NoProgress;

/// The ID of [`generate`]'s tree, owned by 0:0, built with the default options — by `tessera
/// build` of main at 7ea797e, before the memory work.
const EXPECTED_ID: &str = "sha256:07c5267646cb2f0cf1367febde80d1b00f5c8551256276cbb1228eafde2f5664";

/// A small linear congruential generator: the tree must not depend on any crate's algorithm.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }
}

fn set_time(path: &Path, n: u64) {
    let t = UNIX_EPOCH
        + Duration::new(1_650_000_000 + n * 11, (n as u32).wrapping_mul(7_654_321) % 1_000_000_000);
    rustix::fs::utimensat(
        rustix::fs::CWD,
        path,
        &rustix::fs::Timestamps { last_access: to_ts(t), last_modification: to_ts(t) },
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .unwrap();
}

fn to_ts(t: std::time::SystemTime) -> rustix::fs::Timespec {
    let d = t.duration_since(UNIX_EPOCH).unwrap();
    rustix::fs::Timespec { tv_sec: d.as_secs() as i64, tv_nsec: i64::from(d.subsec_nanos()) as _ }
}

/// ~700 entries: nested directories, one of 400 entries (hash-indexed), files from empty to a
/// multi-chunk 1.3 MiB one, duplicates, symlinks (fast and slow), a hard link, fixed modes/times.
fn generate(root: &Path) {
    let mut rng = Lcg(42);
    let mut n = 0u64;
    let mut dirs = vec![root.to_path_buf()];
    let mut last_file: Option<std::path::PathBuf> = None;
    for d in 0..12 {
        let parent = dirs[(rng.next() as usize) % dirs.len()].clone();
        let p = parent.join(format!("dir{d}"));
        fs::create_dir(&p).unwrap();
        dirs.push(p);
    }
    let big = root.join("dir0").join("many");
    fs::create_dir(&big).unwrap();
    dirs.push(big.clone());
    for i in 0..700u64 {
        n += 1;
        let dir = if i < 400 { big.clone() } else { dirs[(rng.next() as usize) % dirs.len()].clone() };
        let p = dir.join(format!("entry-{i:04}-{}", rng.next() % 1000));
        match rng.next() % 20 {
            0 => {
                let target = if i % 2 == 0 { "short".to_owned() } else { "t".repeat(80 + i as usize % 50) };
                std::os::unix::fs::symlink(target, &p).unwrap();
            }
            1 if last_file.is_some() => {
                if let Some(s) = &last_file {
                    fs::hard_link(s, &p).unwrap();
                }
            }
            _ => {
                let len = match i {
                    7 => 1_300_000,
                    _ => (rng.next() % 6000) as usize,
                };
                let mut f = File::create(&p).unwrap();
                let body: Vec<u8> = if i % 9 == 0 {
                    b"duplicate content\n".to_vec()
                } else {
                    (0..len).map(|k| b"abcdefgh ij\n"[(k + (rng.next() as usize % 3)) % 12]).collect()
                };
                f.write_all(&body).unwrap();
                let mode = if i % 5 == 0 { 0o755 } else { 0o640 };
                f.set_permissions(fs::Permissions::from_mode(mode)).unwrap();
                last_file = Some(p.clone());
            }
        }
        set_time(&p, n);
    }
    for (k, d) in dirs.iter().enumerate().rev() {
        fs::set_permissions(d, fs::Permissions::from_mode(0o755)).unwrap();
        set_time(d, 10_000 + k as u64);
    }
}

#[test]
fn image_id_of_a_fixed_tree_is_unchanged() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("tree");
    fs::create_dir(&root).unwrap();
    generate(&root);
    let store = LocalStore::create_or_open(t.path().join("store")).unwrap();
    let mut source = walk_dir(&root).unwrap();
    assert!(source.tree.nodes.len() > 600, "{} nodes", source.tree.nodes.len());
    // Whoever runs the test owns the files: pin the owner.
    for node in &mut source.tree.nodes {
        node.meta.uid = 0;
        node.meta.gid = 0;
    }
    let config = BuildConfig::default();
    let mut chunks =
        chunk_tree(&source, &store, Default::default(), u64::from(config.chunk_size), None, &NoProgress)
            .unwrap();
    let out =
        finish_image(&source.tree, &mut chunks, &store, &config, Default::default(), serde_json::Value::Null)
            .unwrap();
    assert_eq!(out.id.to_string(), EXPECTED_ID);
}
