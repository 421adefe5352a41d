//! The CI path in a real guest: boot a busybox image in QEMU from `tessera serve --record-trace`,
//! run a command in it, `tessera profile` the trace (`tessera_e2e::record`, what `cargo xtask
//! record-profile` runs), `tessera warm --profile-only` a cache from nginx, stop nginx, and boot
//! again from the cache alone: the command must give the same output, so the profile held every
//! chunk the command needed.
//!
//! Needs root, qemu-system-x86 (bookworm-backports), busybox-static and nginx.

use std::fs;

use anyhow::{ensure, Context, Result};
use sha2::{Digest, Sha256};
use tessera_e2e::nginx::Nginx;
use tessera_e2e::prng::Prng;
use tessera_e2e::testutil::tmp;
use tessera_e2e::{fixtures, guest, record, tessera};

#[test]
fn record_in_a_guest_profile_warm_and_boot_from_the_cache_alone() -> Result<()> {
    fixtures::require_root()?;
    let kit = guest::kit()?;
    let t = tmp("guest-profile")?;
    let root = t.path().join("rootfs");
    guest::bootable_rootfs(&kit, &root, "true")?;
    fs::create_dir_all(root.join("data"))?;
    let mut rng = Prng::from_label("guest-profile");
    let mut expected = Sha256::new();
    for name in ["a.bin", "b.bin", "c.bin"] {
        let bytes = rng.bytes(400_000);
        if name != "b.bin" {
            expected.update(&bytes);
        }
        fs::write(root.join("data").join(name), bytes)?;
    }
    let expected = hex::encode(expected.finalize());
    let store = t.path().join("store");
    tessera::build(&root, &store, &["--tag", "app", "--chunk-size", "64K"])?;
    let command = "cat /data/a.bin /data/c.bin | sha256sum";

    let work = t.path().join("record");
    fs::create_dir_all(&work)?;
    let (traces, digest) = record::record_profile("app", &store, command, 1, &work)?;
    ensure!(traces.len() == 1 && digest.starts_with("sha256:"), "{traces:?} {digest}");
    let v = tessera::inspect_json("app", &store)?;
    let p = &v["profile"];
    ensure!(p["digest"].as_str() == Some(digest.as_str()), "{v}");
    let (chunks, bytes) = (p["chunks"].as_u64().context("chunks")?, p["bytes"].as_u64().context("bytes")?);
    // a.bin and c.bin (7 chunks each) and the busybox binary; not b.bin.
    ensure!(chunks >= 14 && bytes >= 800_000, "{v}");
    ensure!(p["percent_of_data"].as_f64().context("percent")? < 90.0, "b.bin was not read: {v}");

    let mut origin = Nginx::serve(&store, "store")?;
    let url = origin.url();
    let cache = t.path().join("cache");
    let cache_s = cache.to_str().context("utf-8")?;
    let o =
        tessera::run(["warm", "app", "--store", &url, "--cache-dir", cache_s, "--profile-only", "--json"])?;
    ensure!(o.status.success(), "warm: {}", String::from_utf8_lossy(&o.stderr));
    let w: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    ensure!(w["fetched_chunks"].as_u64() == Some(chunks), "{w}");
    origin.stop();

    let again = t.path().join("from-cache");
    fs::create_dir_all(&again)?;
    let run = record::run_in_guest(&kit, "app", &url, command, &again, None, &["--cache-dir", cache_s])?;
    ensure!(run.status == 0, "the command failed when served from the cache: {}", run.output);
    ensure!(run.output.contains(&expected), "guest output {:?} lacks {expected}", run.output);
    Ok(())
}
