//! Judge tests: every synthesized image must satisfy e2fsck, the kernel and ext4-view.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use tessera_ext4::NodeKind;

#[test]
fn small_tree_is_clean() {
    let mut b = Builder::new();
    let r = Builder::root();
    let d = b.dir(r, b"etc");
    b.file(d, b"hostname", 10);
    b.file(r, b"empty", 0);
    b.file(d, b"big", 5 * 4096 + 7);
    b.add(r, b"link", node(meta(0o777), NodeKind::Symlink { target: b"etc/hostname".to_vec() }));
    let t0 = std::time::Instant::now();
    let (_img, _dir, path) = build(&b.tree, &options());
    eprintln!("build {:?}", t0.elapsed());
    if is_root() {
        let m = Mount::new(&path, false);
        eprintln!("mounted {:?}", t0.elapsed());
        verify_kernel(m.path(), &b.tree);
        eprintln!("verified {:?}", t0.elapsed());
    }
    verify_ext4_view(&path, &b.tree);
}
