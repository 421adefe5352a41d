//! The image ID rule (brief §3): the same tree gives the same ID — twice, from another path,
//! into a store that already holds other images — and any change to the tree gives another ID.

use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;

use anyhow::{ensure, Context, Result};
use tessera_e2e::compare::first_content_difference;
use tessera_e2e::testutil::tmp;
use tessera_e2e::{fixtures, tessera};

fn gen(name: &str, dest: &Path) -> Result<()> {
    fixtures::by_name(name)?.generate(dest)
}

#[test]
fn same_tree_same_id_and_bytes() -> Result<()> {
    fixtures::require_root()?;
    let t = tmp("det-same")?;
    let (a, b) = (t.path().join("a"), t.path().join("elsewhere/b"));
    gen("kinds", &a)?;
    std::fs::create_dir_all(t.path().join("elsewhere"))?;
    gen("kinds", &b)?;
    let (s1, s2) = (t.path().join("s1"), t.path().join("s2"));
    let id1 = tessera::build(&a, &s1, &[])?;
    let id2 = tessera::build(&b, &s2, &[])?;
    ensure!(id1 == id2, "same tree, two empty stores: {id1} != {id2}");
    // Again into the store that already holds it.
    let id3 = tessera::build(&a, &s1, &[])?;
    ensure!(id1 == id3, "rebuild into the same store: {id1} != {id3}");
    tessera::check_store(&s1)?;
    // The exported devices are byte-identical.
    let (i1, i2) = (t.path().join("1.raw"), t.path().join("2.raw"));
    tessera::export(id1.as_str(), &s1, &i1)?;
    tessera::export(id2.as_str(), &s2, &i2)?;
    let len = std::fs::metadata(&i1)?.len();
    ensure!(len == std::fs::metadata(&i2)?.len(), "export sizes differ");
    let d = first_content_difference(&i1, &i2, len)?;
    ensure!(d.is_none(), "exports of one image differ at byte {d:?}");
    Ok(())
}

#[test]
fn same_id_into_a_store_holding_other_images() -> Result<()> {
    fixtures::require_root()?;
    let t = tmp("det-full")?;
    let (a, other, other2) = (t.path().join("a"), t.path().join("o"), t.path().join("o2"));
    gen("xattrs", &a)?;
    gen("dedup", &other)?;
    gen("names", &other2)?;
    let (empty, full) = (t.path().join("empty"), t.path().join("full"));
    let id_other = tessera::build(&other, &full, &["--tag", "other"])?;
    tessera::build(&other2, &full, &[])?;
    let id_full = tessera::build(&a, &full, &["--tag", "mine"])?;
    let id_empty = tessera::build(&a, &empty, &[])?;
    ensure!(id_other != id_full, "two different trees share an ID");
    ensure!(
        id_full == id_empty,
        "same tree: {id_full} into a store with other images, {id_empty} into an empty one"
    );
    tessera::check_store(&full)?;
    // Tags resolve, and export by tag equals export by ID.
    let r = std::fs::read_to_string(full.join("refs/mine")).context("refs/mine")?;
    ensure!(r == tessera::ref_text(&full, &id_full)?, "refs/mine holds {r:?}");
    let v = tessera::inspect_json("mine", &full)?;
    tessera::check_inspect(&v, &id_full)?;
    let (x, y) = (t.path().join("tag.raw"), t.path().join("id.raw"));
    tessera::export("mine", &full, &x)?;
    tessera::export(id_full.as_str(), &full, &y)?;
    let len = std::fs::metadata(&x)?.len();
    ensure!(first_content_difference(&x, &y, len)?.is_none(), "export by tag != by ID");
    Ok(())
}

#[test]
fn any_change_gives_another_id() -> Result<()> {
    fixtures::require_root()?;
    let t = tmp("det-change")?;
    let base = t.path().join("base");
    gen("sizes", &base)?;
    let store = t.path().join("store");
    let id0 = tessera::build(&base, &store, &[])?;

    // One byte of content, size and mtime unchanged.
    let c = t.path().join("content");
    gen("sizes", &c)?;
    let f = c.join("files/random-4097");
    let md = std::fs::metadata(&f)?;
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&f)?;
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, 2048)?;
    file.write_all_at(&[byte[0] ^ 1], 2048)?;
    drop(file);
    fixtures::set_mtime(&f, md.mtime(), md.mtime_nsec())?;
    let id1 = tessera::build(&c, &store, &[])?;
    ensure!(id1 != id0, "a one-byte content change kept the ID {id0}");

    // One permission bit.
    let m = t.path().join("mode");
    gen("sizes", &m)?;
    let dir = m.join("files");
    let p = m.join("files/random-0");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o645))?;
    restore_dir_mtime(&base.join("files"), &dir)?;
    let id2 = tessera::build(&m, &store, &[])?;
    ensure!(id2 != id0 && id2 != id1, "a mode change kept an earlier ID");

    // One nanosecond of one mtime.
    let n = t.path().join("ns");
    gen("sizes", &n)?;
    let p = n.join("files/random-1");
    let md = std::fs::metadata(&p)?;
    let ns = (md.mtime_nsec() + 1) % 1_000_000_000;
    fixtures::set_mtime(&p, md.mtime(), ns)?;
    let id3 = tessera::build(&n, &store, &[])?;
    ensure!(![id0.clone(), id1, id2].contains(&id3), "a 1 ns mtime change kept an earlier ID");
    Ok(())
}

fn restore_dir_mtime(reference: &Path, dir: &Path) -> Result<()> {
    let md = std::fs::metadata(reference)?;
    fixtures::set_mtime(dir, md.mtime(), md.mtime_nsec())
}
