//! The `ext4_roundtrip` target's trees, checked by the e2fsprogs tools (too slow per fuzz input,
//! cheap for a handful): its seeds and a few pseudo-random inputs are synthesized, written to a
//! sparse image file, checked by `e2fsck -fn`, and every xattr whose path `debugfs` can take
//! (printable ASCII, no space or quote) is read back with `debugfs -R ea_get`. Skipped (with a
//! message) where e2fsprogs is not installed.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

use tessera_ext4::{synthesize, Ext4Error, NodeKind, Tree};
use tessera_fuzz::ext4_roundtrip::{pattern, tree};

fn tool(name: &str) -> Option<String> {
    ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
        .iter()
        .map(|d| format!("{d}/{name}"))
        .find(|p| Path::new(p).exists())
}

fn inputs() -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = tessera_fuzz::ext4_roundtrip::seeds().into_iter().map(|s| s.1).collect();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for len in [200, 400, 800, 1600, 3200, 6400] {
        out.push(
            (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // Mostly small bytes, so names, sizes and counts stay modest.
                    (x % 61) as u8
                })
                .collect(),
        );
    }
    out
}

/// `(path, node)` of every node reachable from the root.
fn paths(tree: &Tree) -> Vec<(Vec<u8>, usize)> {
    let mut out = vec![(b"/".to_vec(), 0)];
    let mut i = 0;
    while i < out.len() {
        let (path, id) = out[i].clone();
        if let NodeKind::Directory { entries } = &tree.nodes[id].kind {
            for e in entries {
                let mut p = path.clone();
                if p.len() > 1 {
                    p.push(b'/');
                }
                p.extend_from_slice(&e.name);
                out.push((p, e.node.0 as usize));
            }
        }
        i += 1;
    }
    out
}

#[test]
fn synthesized_trees_pass_e2fsck_and_keep_their_xattrs() {
    let (Some(e2fsck), Some(debugfs)) = (tool("e2fsck"), tool("debugfs")) else {
        eprintln!("e2fsprogs not installed: skipped");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (mut images, mut xattrs) = (0, 0);
    for (n, input) in inputs().iter().enumerate() {
        let (tree, opts) = tree(input);
        let img = match synthesize(&tree, &opts) {
            Ok(img) => img,
            Err(Ext4Error::XattrTooLarge { .. }) => continue,
            Err(e) => panic!("input {n}: {e}"),
        };
        tessera_fuzz::ext4_roundtrip::run(input);
        let path = dir.path().join(format!("fs{n}.img"));
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(img.geometry.blocks * 4096).unwrap();
        for run in &img.metadata {
            f.write_all_at(&run.data, run.start_block * 4096).unwrap();
        }
        let mut block = [0u8; 4096];
        for (node, extents) in img.placements.iter().enumerate() {
            for e in extents {
                for k in 0..e.blocks {
                    pattern(node, e.file_block + k, &mut block);
                    f.write_all_at(&block, (e.device_block + k) * 4096).unwrap();
                }
            }
        }
        drop(f);
        let out = Command::new(&e2fsck).arg("-fn").arg(&path).output().unwrap();
        assert!(
            out.status.success(),
            "input {n}: e2fsck: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        images += 1;
        for (p, id) in paths(&tree) {
            let plain =
                |b: &[u8]| b.iter().all(|&c| c.is_ascii_graphic() && c != b'"' && c != b'\'' && c != b'\\');
            for (k, x) in tree.nodes[id].xattrs.iter().enumerate() {
                if !plain(&p) || !plain(&x.name) {
                    continue;
                }
                let value = dir.path().join(format!("v{n}-{id}-{k}"));
                let cmd = format!(
                    "ea_get -f {} {} {}",
                    value.display(),
                    String::from_utf8_lossy(&p),
                    String::from_utf8_lossy(&x.name)
                );
                let out = Command::new(&debugfs).arg("-R").arg(&cmd).arg(&path).output().unwrap();
                let got = std::fs::read(&value).unwrap_or_else(|e| {
                    panic!("input {n}: {cmd}: {e}: {}", String::from_utf8_lossy(&out.stderr))
                });
                assert!(got == x.value, "input {n}: {cmd}: the value differs");
                xattrs += 1;
            }
        }
    }
    eprintln!("{images} images passed e2fsck, {xattrs} xattrs read back");
    assert!(images >= 4 && xattrs >= 3, "too few trees or xattrs checked ({images}, {xattrs})");
}
