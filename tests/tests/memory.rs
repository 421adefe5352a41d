//! Peak memory: a tree with a 1 GiB incompressible file builds with VmHWM under 256 MiB, and
//! the image is still right (e2fsck, mount, content).

use anyhow::{ensure, Result};
use tessera_e2e::compare::{compare_trees, render};
use tessera_e2e::fixtures::{self, GIB};
use tessera_e2e::judge::{e2fsck, LoopMount};
use tessera_e2e::tessera;
use tessera_e2e::testutil::tmp;

const LIMIT: u64 = 256 << 20;

#[test]
fn one_gib_incompressible_under_256_mib() -> Result<()> {
    fixtures::require_root()?;
    let t = tmp("mem")?;
    let src = t.path().join("src");
    fixtures::generate_incompressible(&src, GIB)?;
    let store = t.path().join("store");
    let started = std::time::Instant::now();
    let (id, peak) = tessera::build_peak_rss(&src, &store, &[])?;
    eprintln!(
        "1 GiB incompressible: build {:.1}s, peak RSS (VmHWM) {:.1} MiB, image {id}",
        started.elapsed().as_secs_f64(),
        peak as f64 / (1 << 20) as f64
    );
    ensure!(peak < LIMIT, "tessera build peaked at {} MiB (limit 256 MiB)", peak >> 20);
    let img = t.path().join("image.raw");
    tessera::export(id.as_str(), &store, &img)?;
    e2fsck(&img)?;
    let mnt = LoopMount::ro(&img)?;
    let d = compare_trees(&src, mnt.path())?;
    ensure!(d.is_empty(), "{}", render(&d));
    Ok(())
}
