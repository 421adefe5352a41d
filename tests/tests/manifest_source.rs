//! `tessera build manifest:FILE` (issue 12): an image synthesized from a hand-written content
//! manifest whose big file is given by chunk ids already in the store (its bytes are gone from
//! disk when the manifest is built, so they cannot have been read) and whose other files come from
//! disk; e2fsck-clean, mounted, every attribute and byte as written. A chunk the store lacks is a
//! clear error naming the entry, and no image is written.
//!
//! Needs root and the CLI (`cargo xtask test` provides both); run with `--test-threads=1`.

use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};

use anyhow::{ensure, Result};
use tessera_e2e::judge::{e2fsck, LoopMount};
use tessera_e2e::testutil::tmp;
use tessera_e2e::{fixtures, tessera};
use tessera_image::ChunkId;

#[test]
fn manifest_source_from_stored_chunks() -> Result<()> {
    fixtures::require_root()?;
    let t = tmp("manifest-src")?;
    let src = t.path().join("src");
    fs::create_dir_all(&src)?;
    // 600 KiB of varied bytes: two chunks at the default 512 KiB chunk size.
    let big: Vec<u8> = (0..600 * 1024u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    fs::write(src.join("big.bin"), &big)?;
    let store = t.path().join("store");
    tessera::build(&src, &store, &[])?;
    // The content is in the store now; the file itself is not needed any more.
    fs::remove_file(src.join("big.bin"))?;

    let files = t.path().join("files");
    fs::create_dir_all(&files)?;
    fs::write(files.join("motd"), b"hello from disk\n")?;
    let (a, b) = big.split_at(512 * 1024);
    let manifest = t.path().join("image.json");
    let write = |chunk_b: &str| -> Result<()> {
        let doc = serde_json::json!({
            "tessera_manifest": 1,
            "entries": [
                {"path": "/", "type": "dir", "mode": "0750", "uid": 7, "gid": 8, "mtime": 1_700_000_000},
                {"path": "opt/app/big.bin", "type": "file", "mode": "0755", "uid": 1000, "gid": 1000,
                 "mtime": "1700000001.25", "xattrs": {"user.origin": "manifest", "user.bin": {"base64": "AAEC"}},
                 "chunks": [{"id": ChunkId::of(a).to_string(), "len": a.len()}, {"id": chunk_b, "len": b.len()}]},
                {"path": "opt/app/big-link", "type": "hardlink", "target": "opt/app/big.bin"},
                {"path": "etc/motd", "type": "file", "source": "files/motd", "mode": "0644"},
                {"path": "bin/sh", "type": "symlink", "target": "/opt/app/big.bin"},
                {"path": "run/fifo", "type": "fifo", "mode": "0600"},
                {"path": "dev/null", "type": "char", "major": 1, "minor": 3, "mode": "0666"},
                {"path": "empty", "type": "file"}
            ]
        });
        fs::write(&manifest, serde_json::to_vec_pretty(&doc)?)?;
        Ok(())
    };
    let source = format!("manifest:{}", manifest.display());

    // A chunk the store does not hold: refused, naming the entry; nothing written.
    write(&ChunkId::of(b"never stored").to_string())?;
    let images_before = fs::read_dir(store.join("images"))?.count();
    let out = tessera_e2e::oci::build_source(&source, &store, &[])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.code() == Some(1), "missing content: exit {:?}: {stderr}", out.status.code());
    ensure!(stderr.contains("opt/app/big.bin") && stderr.contains("missing"), "unclear error: {stderr}");
    ensure!(fs::read_dir(store.join("images"))?.count() == images_before, "a failed build wrote an image");

    write(&ChunkId::of(b).to_string())?;
    let started = std::time::Instant::now();
    let id = tessera_e2e::oci::build_ok(&source, &store, &[])?;
    eprintln!("manifest build: {:.2}s → {id}", started.elapsed().as_secs_f64());
    tessera::check_store(&store)?;
    let again = tessera_e2e::oci::build_ok(&source, &store, &[])?;
    ensure!(again == id, "the same manifest gave {again}, then {id}");

    let raw = t.path().join("image.raw");
    tessera::export(id.as_str(), &store, &raw)?;
    e2fsck(&raw)?;
    let mnt = LoopMount::ro(&raw)?;
    let root = mnt.path();
    let md = fs::symlink_metadata(root)?;
    ensure!((md.mode() & 0o7777, md.uid(), md.gid()) == (0o750, 7, 8), "root attributes: {md:?}");
    let p = root.join("opt/app/big.bin");
    ensure!(fs::read(&p)? == big, "big.bin content differs");
    let md = fs::symlink_metadata(&p)?;
    ensure!((md.mode() & 0o7777, md.uid(), md.gid()) == (0o755, 1000, 1000), "big.bin attributes: {md:?}");
    ensure!((md.mtime(), md.mtime_nsec()) == (1_700_000_001, 250_000_000), "big.bin mtime");
    ensure!(md.nlink() == 2, "big.bin has {} links", md.nlink());
    ensure!(fs::symlink_metadata(root.join("opt/app/big-link"))?.ino() == md.ino(), "hard link lost");
    let x = tessera_e2e::compare::entry(&p)?;
    ensure!(
        x.xattrs.get(b"user.origin".as_slice()).map(Vec::as_slice) == Some(b"manifest".as_slice()),
        "{x:?}"
    );
    ensure!(
        x.xattrs.get(b"user.bin".as_slice()).map(Vec::as_slice) == Some(b"\x00\x01\x02".as_slice()),
        "{x:?}"
    );
    ensure!(fs::read(root.join("etc/motd"))? == b"hello from disk\n", "motd content differs");
    ensure!(fs::read_link(root.join("bin/sh"))? == std::path::Path::new("/opt/app/big.bin"), "symlink");
    ensure!(fs::symlink_metadata(root.join("run/fifo"))?.file_type().is_fifo(), "fifo");
    let dev = fs::symlink_metadata(root.join("dev/null"))?;
    ensure!(dev.file_type().is_char_device() && dev.rdev() == libc::makedev(1, 3), "device: {dev:?}");
    ensure!(fs::metadata(root.join("empty"))?.len() == 0, "empty file");
    let opt = fs::symlink_metadata(root.join("opt"))?;
    ensure!(opt.mode() & 0o7777 == 0o755 && opt.uid() == 0, "implicit parent: {opt:?}");
    mnt.unmount()?;
    Ok(())
}
