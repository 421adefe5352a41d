//! A realistic image (issue 3, point 6): a Debian minbase root filesystem from `debootstrap`
//! (cached outside the clone, see `tessera_e2e::debian`), split into three layers by `umoci repack
//! --refresh-bundle` (whiteouts, replacements, hard links across layers, metadata-only changes),
//! `tessera build oci:…` → export → e2fsck → loop mount → zero differences with `umoci unpack`'s
//! root filesystem (directory mtimes aside), ext4-view and the rw workload.
//!
//! Needs root, debootstrap, umoci and the Debian mirror the first time (about 2 minutes more);
//! `cargo xtask test` provides the tools. Run with `--test-threads=1`.

use std::fs;
use std::time::Instant;

use anyhow::{ensure, Result};
use tessera_e2e::debian::{make_image, only_dir_mtimes};
use tessera_e2e::judge::LoopMount;
use tessera_e2e::oci::{build_ok, require_tools};
use tessera_e2e::pipeline::judge_image;
use tessera_e2e::testutil::tmp;
use tessera_e2e::{compare, fixtures, tessera};

#[test]
fn debian_minbase_layers_match_umoci_unpack() -> Result<()> {
    fixtures::require_root()?;
    require_tools()?;
    let started = Instant::now();
    let t = tmp("oci-debian")?;
    let img = make_image(t.path(), "bookworm")?;
    let layers = img.manifest()?["layers"].as_array().map_or(0, Vec::len);
    ensure!(layers == 3, "expected 3 layers, the manifest has {layers}");
    eprintln!("image ready after {:.1}s", started.elapsed().as_secs_f64());

    let t0 = Instant::now();
    let reference = img.unpack(&t.path().join("unpacked"))?;
    eprintln!("umoci unpack: {:.1}s", t0.elapsed().as_secs_f64());
    // umoci applied what the layers say.
    ensure!(reference.join("usr/bin/perl").is_file(), "umoci unpack lacks layer 1");
    ensure!(reference.join("usr/share/doc/dpkg").is_dir(), "umoci unpack lacks layer 2");
    ensure!(reference.join("etc/motd/00-tessera").is_file(), "umoci unpack lacks layer 3");
    ensure!(!reference.join("usr/bin/uncompress").exists(), "umoci did not apply a whiteout");

    let store = t.path().join("store");
    let t0 = Instant::now();
    let id = build_ok(&img.source(), &store, &["--tag", "debian"])?;
    eprintln!("tessera build oci: {:.1}s → {id}", t0.elapsed().as_secs_f64());
    tessera::check_store(&store)?;
    let raw = t.path().join("image.raw");
    tessera::export(id.as_str(), &store, &raw)?;

    // Direct checks of what layer 3 did, before the workload changes the image.
    let mnt = LoopMount::ro(&raw)?;
    let m = mnt.path();
    let debs = fs::read_dir(m.join("var/cache/apt/archives"))?
        .filter(|e| e.as_ref().is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".deb")))
        .count();
    ensure!(debs == 0, "{debs} .deb files survived their whiteouts");
    ensure!(!m.join("usr/share/doc/libc6").exists(), "a whited-out directory survived");
    let link = fs::read_link(m.join("usr/share/doc/bash"))?;
    ensure!(link == std::path::Path::new("../bash-completion"), "dir → symlink: {link:?}");
    let perl = compare::entry(&m.join("usr/bin/perl"))?;
    let again = compare::entry(&m.join("usr/local/bin/perl-again"))?;
    let reference_perl = compare::entry(&reference.join("usr/bin/perl"))?;
    eprintln!("usr/bin/perl: nlink {} (umoci: {})", perl.nlink, reference_perl.nlink);
    ensure!(again.size == perl.size, "perl-again is not perl");
    let gunzip = compare::entry(&m.join("usr/bin/gunzip"))?;
    ensure!(gunzip.kind == compare::Kind::File, "gunzip lost with its removed hard link");
    let sleep = compare::entry(&m.join("usr/bin/sleep"))?;
    ensure!(sleep.xattrs.contains_key(b"security.capability".as_slice()), "capability lost: {sleep:?}");
    mnt.unmount()?;

    let t0 = Instant::now();
    let verdict = judge_image(&reference, &raw, |d| only_dir_mtimes(d, &reference))?;
    eprintln!(
        "judged in {:.1}s: zero differences besides {} directory mtimes; total {:.1}s",
        t0.elapsed().as_secs_f64(),
        verdict.allowed.len(),
        started.elapsed().as_secs_f64()
    );
    let v = tessera::inspect_json(id.as_str(), &store)?;
    tessera::check_inspect(&v, &id)?;
    tessera_e2e::testutil::check_counts(&v, &reference)?;
    Ok(())
}
