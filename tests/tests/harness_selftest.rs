//! Validates the harness itself against the reference builder, `mkfs.ext4 -d`, without the
//! Tessera CLI: every fixture → mkfs image → e2fsck → mount → compare (only the documented mkfs
//! losses may appear) → ext4-view → rw workload → e2fsck. Plus mutation tests: the comparator
//! must report each kind of planted difference.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{ensure, Result};
use tessera_e2e::compare::{compare_trees, render, Field};
use tessera_e2e::fixtures::{self, FIXTURES};
use tessera_e2e::pipeline::judge_image;
use tessera_e2e::reference::{mkfs_image, mkfs_known_loss};

fn tmp() -> Result<tempfile::TempDir> {
    Ok(tempfile::Builder::new().prefix("selftest-").tempdir_in(env!("CARGO_TARGET_TMPDIR"))?)
}

fn reference(name: &str) -> Result<()> {
    fixtures::require_root()?;
    let t = tmp()?;
    let src = t.path().join("src");
    fixtures::by_name(name)?.generate(&src)?;
    let img = t.path().join("ref.img");
    mkfs_image(&src, &img)?;
    let v = judge_image(&src, &img, mkfs_known_loss(&src))?;
    let fields: BTreeSet<Field> = v.allowed.iter().map(|d| d.field).collect();
    if name == "kinds" {
        // The comparator must see every known mkfs loss on real images.
        for f in [Field::MtimeNsec, Field::MtimeSec, Field::Links] {
            ensure!(fields.contains(&f), "kinds: expected mkfs loss {f:?} not reported");
        }
        ensure!(
            v.allowed.iter().any(|d| d.path.is_empty() && d.field == Field::Mode),
            "kinds: the root's mode (0751, not copied by mkfs) was not reported"
        );
        ensure!(
            !v.ext4view.skipped.is_empty(),
            "kinds: ext4-view should reject the pre-1970 / post-2038 timestamps"
        );
    }
    eprintln!(
        "{name}: mkfs.ext4 -d lost {} attribute(s) in {:?}; ext4-view checked {} entries, {} bytes, skipped {}; workload {:?}",
        v.allowed.len(),
        fields,
        v.ext4view.checked,
        v.ext4view.bytes,
        v.ext4view.skipped.len(),
        v.workload
    );
    if !v.allowed.is_empty() {
        eprintln!("{}", render(&v.allowed));
    }
    if !v.ext4view.skipped.is_empty() {
        eprintln!("ext4-view skipped (documented limits): {:?}", v.ext4view.skipped);
    }
    Ok(())
}

#[test]
fn mkfs_reference_kinds() -> Result<()> {
    reference("kinds")
}
#[test]
fn mkfs_reference_sizes() -> Result<()> {
    reference("sizes")
}
#[test]
fn mkfs_reference_names() -> Result<()> {
    reference("names")
}
#[test]
fn mkfs_reference_bigdir() -> Result<()> {
    reference("bigdir")
}
#[test]
fn mkfs_reference_sparse() -> Result<()> {
    reference("sparse")
}
#[test]
fn mkfs_reference_xattrs() -> Result<()> {
    reference("xattrs")
}
#[test]
fn mkfs_reference_dedup() -> Result<()> {
    reference("dedup")
}

#[test]
fn fixtures_cover_the_list() {
    let names: Vec<_> = FIXTURES.iter().map(|f| f.name).collect();
    for n in ["kinds", "sizes", "names", "bigdir", "sparse", "xattrs", "dedup"] {
        assert!(names.contains(&n), "fixture {n} missing");
    }
}

/// A copy of a tree compares equal to itself, and every planted change is reported.
#[test]
fn comparator_detects_planted_differences() -> Result<()> {
    fixtures::require_root()?;
    let t = tmp()?;
    let a = t.path().join("a");
    let b = t.path().join("b");
    fixtures::by_name("kinds")?.generate(&a)?;
    fixtures::by_name("kinds")?.generate(&b)?;
    let d = compare_trees(&a, &b)?;
    ensure!(d.is_empty(), "two generations differ:\n{}", render(&d));
    plant_and_check(&b)?;
    let d = compare_trees(&a, &b)?;
    let got: BTreeSet<Field> = d.iter().map(|d| d.field).collect();
    let want: BTreeSet<Field> = [
        Field::Content,
        Field::Mode,
        Field::Uid,
        Field::Gid,
        Field::MtimeNsec,
        Field::MtimeSec,
        Field::Xattr,
        Field::Target,
        Field::Rdev,
        Field::Links,
        Field::Missing,
        Field::Extra,
        Field::Kind,
        Field::Size,
    ]
    .into();
    ensure!(got == want, "planted {want:?}, reported {got:?}:\n{}", render(&d));
    Ok(())
}

fn plant_and_check(b: &Path) -> Result<()> {
    use std::os::unix::fs::{FileExt, PermissionsExt};
    // Content: same size, one byte changed.
    let f = std::fs::OpenOptions::new().write(true).open(b.join("modes/f0644"))?;
    f.write_all_at(b"M", 0)?;
    drop(f);
    std::fs::set_permissions(b.join("modes/f0755"), std::fs::Permissions::from_mode(0o4755))?;
    std::os::unix::fs::lchown(b.join("owners/u1000-g1000"), Some(1001), None)?;
    std::os::unix::fs::lchown(b.join("owners/u70000-g70001"), None, Some(7))?;
    let ts = |s, ns| rustix::fs::Timestamps {
        last_access: rustix::fs::Timespec { tv_sec: s, tv_nsec: ns },
        last_modification: rustix::fs::Timespec { tv_sec: s, tv_nsec: ns },
    };
    // ns only (a builder dropping nanoseconds), and seconds (a clamped 2100 date).
    rustix::fs::utimensat(
        rustix::fs::CWD,
        b.join("times/max-ns"),
        &ts(1_700_000_000, 0),
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )?;
    rustix::fs::utimensat(
        rustix::fs::CWD,
        b.join("times/y2100.lnk"),
        &ts(2_147_483_647, 500_000_000),
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )?;
    rustix::fs::lsetxattr(b, "user.root-note", b"changed", rustix::fs::XattrFlags::empty())?;
    std::fs::remove_file(b.join("owners/link-4294967294"))?;
    std::os::unix::fs::symlink("../modes/f0645", b.join("owners/link-4294967294"))?;
    std::os::unix::fs::lchown(b.join("owners/link-4294967294"), Some(4_294_967_294), Some(12345))?;
    rustix::fs::utimensat(
        rustix::fs::CWD,
        b.join("owners/link-4294967294"),
        &ts(1_600_000_000, 0),
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )?;
    std::fs::remove_file(b.join("dev/nvme-259-100000"))?;
    rustix::fs::mknodat(
        rustix::fs::CWD,
        b.join("dev/nvme-259-100000"),
        rustix::fs::FileType::BlockDevice,
        rustix::fs::Mode::from_raw_mode(0o600),
        rustix::fs::makedev(259, 100_001),
    )?;
    // Break a hard link: copy instead of link (same content, same attributes).
    std::fs::remove_file(b.join("links/b/c/three-3"))?;
    std::fs::copy(b.join("links/a/three"), b.join("links/b/c/three-3"))?;
    std::fs::remove_file(b.join("modes/f0444"))?;
    std::fs::write(b.join("modes/new"), b"extra")?;
    std::fs::remove_file(b.join("dev/fifo"))?;
    std::fs::write(b.join("dev/fifo"), b"")?;
    std::fs::write(b.join("modes/f0600"), b"a different length\n")?;
    Ok(())
}
