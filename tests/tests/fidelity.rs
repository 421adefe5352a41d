//! Fidelity: for each fixture, `tessera build` → `tessera export` → `e2fsck -fn` clean →
//! `mount -o loop,ro` → zero differences with the source → ext4-view agrees with the kernel →
//! rw workload → `e2fsck -fn` still clean. Plus the store layout and `inspect --json`.
//!
//! Needs root and the CLI (`cargo xtask test` provides both); run with `--test-threads=1`.

use std::os::unix::fs::MetadataExt;

use anyhow::{ensure, Result};
use tessera_e2e::pipeline::judge_image;
use tessera_e2e::testutil::{check_counts, tmp};
use tessera_e2e::{fixtures, tessera};

fn fidelity(name: &str) -> Result<()> {
    fixtures::require_root()?;
    let t = tmp(name)?;
    let src = t.path().join("src");
    let fixture = fixtures::by_name(name)?;
    eprintln!("fixture {name}: {}", fixture.targets);
    fixture.generate(&src)?;
    let store = t.path().join("store");
    let id = tessera::build(&src, &store, &["--tag", name])?;
    let v = tessera::inspect_json(id.as_str(), &store)?;
    eprintln!("inspect: {v}");
    tessera::check_inspect(&v, &id)?;
    check_counts(&v, &src)?;
    tessera::check_store(&store)?;
    let img = t.path().join("image.raw");
    tessera::export(name, &store, &img)?;
    let md = std::fs::metadata(&img)?;
    let size = v["geometry"]["size_bytes"].as_u64().unwrap_or(0);
    ensure!(md.len() == size, "export is {} bytes, geometry says {size}", md.len());
    ensure!(
        md.blocks() * 512 < md.len(),
        "export is not sparse ({} of {} bytes allocated)",
        md.blocks() * 512,
        md.len()
    );
    let verdict = judge_image(&src, &img, |_| false)?;
    eprintln!(
        "{name}: ext4-view checked {} entries / {} bytes, skipped {:?}; workload {:?}",
        verdict.ext4view.checked, verdict.ext4view.bytes, verdict.ext4view.skipped, verdict.workload
    );
    Ok(())
}

#[test]
fn fidelity_kinds() -> Result<()> {
    fidelity("kinds")
}

#[test]
fn fidelity_sizes() -> Result<()> {
    fidelity("sizes")
}

#[test]
fn fidelity_names() -> Result<()> {
    fidelity("names")
}

#[test]
fn fidelity_bigdir() -> Result<()> {
    fidelity("bigdir")
}

#[test]
fn fidelity_sparse() -> Result<()> {
    fidelity("sparse")
}

#[test]
fn fidelity_xattrs() -> Result<()> {
    fidelity("xattrs")
}

#[test]
fn fidelity_dedup() -> Result<()> {
    fidelity("dedup")?;
    // Dedup must show in the numbers.
    let t = tmp("dedup-ratio")?;
    let src = t.path().join("src");
    fixtures::by_name("dedup")?.generate(&src)?;
    let store = t.path().join("store");
    let id = tessera::build(&src, &store, &[])?;
    let v = tessera::inspect_json(id.as_str(), &store)?;
    let ratio = v["dedup_ratio"].as_f64().unwrap_or(0.0);
    ensure!(ratio > 2.0, "dedup fixture: dedup_ratio {ratio} <= 2: {v}");
    let files = v["files"].as_u64().unwrap_or(0);
    let chunks = v["chunks"].as_u64().unwrap_or(u64::MAX);
    ensure!(chunks < files, "dedup fixture: {chunks} chunks for {files} files: {v}");
    Ok(())
}

/// Every fixture in the library has a fidelity test above.
#[test]
fn every_fixture_has_a_fidelity_test() {
    let tested = ["kinds", "sizes", "names", "bigdir", "sparse", "xattrs", "dedup"];
    for f in fixtures::FIXTURES {
        assert!(tested.contains(&f.name), "fixture {} has no fidelity test", f.name);
    }
}
