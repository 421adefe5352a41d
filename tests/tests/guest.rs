//! The whole path in a real guest: `tessera build` → `tessera serve` (vhost-user-blk) → QEMU microvm
//! with Debian's cloud kernel → the guest kernel mounts our ext4 from /dev/vda and checksums every
//! file; the sums must equal the source's.
//!
//! Needs root, qemu-system-x86 (bookworm-backports), busybox-static and apt access for the kernel
//! package (`cargo xtask test` installs the packages); run with `--test-threads=1`.

use std::fs;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use tessera_e2e::nginx::Nginx;
use tessera_e2e::registry::Registry;
use tessera_e2e::testutil::tmp;
use tessera_e2e::{fixtures, guest, judge, tessera};

/// A `tessera serve` child, stopped with SIGTERM on drop unless [`stop`] already did.
struct Served(Child, bool);

impl Drop for Served {
    fn drop(&mut self) {
        if !self.1 {
            let _ = Command::new("kill").arg("-TERM").arg(self.0.id().to_string()).status();
            let _ = self.0.wait();
        }
    }
}

fn serve(id: &str, store: &std::ffi::OsStr, socket: &Path, mode: &[&std::ffi::OsStr]) -> Result<Served> {
    let child = tessera::command(["serve", id, "--store"])
        .arg(store)
        .arg("--socket")
        .arg(socket)
        .args(mode)
        .stdin(Stdio::null())
        .spawn()
        .context("starting tessera serve")?;
    let served = Served(child, false);
    let start = Instant::now();
    // The socket appears only once it accepts.
    while !socket.exists() {
        ensure!(
            start.elapsed() < Duration::from_secs(30),
            "tessera serve did not create {}",
            socket.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(served)
}

fn guest_checksums(fixture: &str) -> Result<()> {
    fixtures::require_root()?;
    let kit = guest::kit()?;
    let t = tmp(&format!("guest-{fixture}"))?;
    let src = t.path().join("src");
    fixtures::by_name(fixture)?.generate(&src)?;
    let store = t.path().join("store");
    let id = tessera::build(&src, &store, &[])?;
    let socket = t.path().join("blk.sock");
    let mut served = serve(id.as_str(), store.as_os_str(), &socket, &["--read-only".as_ref()])?;
    boot_and_compare_sums(&kit, &src, &socket, t.path(), fixture)?;
    stop(&mut served, &socket)
}

/// Boot a guest on `socket` that checksums every file of the device; the sums must equal those
/// of the source tree `src`.
fn boot_and_compare_sums(
    kit: &guest::GuestKit,
    src: &Path,
    socket: &Path,
    work: &Path,
    what: &str,
) -> Result<()> {
    let initrd = work.join("initramfs.cpio");
    guest::initramfs(kit, guest::CHECKSUM_SCRIPT, &initrd)?;
    let log = guest::boot(kit, &initrd, socket, work, Duration::from_secs(180))?;
    let seen = guest::parse_sums(&log)?;
    let want = guest::host_sums(src)?;
    ensure!(!want.is_empty(), "{what}: no files to compare");
    let mut diffs = Vec::new();
    for (path, sum) in &want {
        match seen.get(path) {
            Some(s) if s == sum => {}
            other => diffs.push(format!("{path}: source {sum}, guest {other:?}")),
        }
    }
    for path in seen.keys().filter(|p| !want.contains_key(*p)) {
        diffs.push(format!("{path}: only in the guest"));
    }
    ensure!(diffs.is_empty(), "{what}: {} differences:\n{}", diffs.len(), diffs.join("\n"));
    eprintln!("guest {what}: {} files and symlinks identical", want.len());
    Ok(())
}

/// The guest boots from an nginx origin through `--cache-dir`; then, with nginx stopped, a
/// second boot is served from the cache alone.
#[test]
fn guest_boots_from_an_http_origin_then_from_the_cache_alone() -> Result<()> {
    fixtures::require_root()?;
    let kit = guest::kit()?;
    let t = tmp("guest-http")?;
    let src = t.path().join("src");
    fixtures::by_name("sizes")?.generate(&src)?;
    let store = t.path().join("store");
    let id = tessera::build(&src, &store, &[])?;
    let mut origin = Nginx::serve(&store, "store")?;
    let url = origin.url();
    let socket = t.path().join("blk.sock");
    let cache = t.path().join("cache");
    let args = ["--read-only".as_ref(), "--cache-dir".as_ref(), cache.as_os_str()];

    let mut served = serve(id.as_str(), url.as_ref(), &socket, &args)?;
    boot_and_compare_sums(&kit, &src, &socket, t.path(), "sizes from nginx")?;
    stop(&mut served, &socket)?;
    let ranged = origin.access_log().lines().filter(|l| l.contains(" 206 ")).count();
    ensure!(ranged > 0, "the first boot made no ranged GETs of the origin");

    origin.stop();
    let mut served = serve(id.as_str(), url.as_ref(), &socket, &args)?;
    boot_and_compare_sums(&kit, &src, &socket, t.path(), "sizes from the cache, nginx stopped")?;
    stop(&mut served, &socket)
}

/// The guest boots from a registry, from the original image's layer blobs: an OCI image of
/// the tree is in the registry (as a CI pipeline pushed it); `tessera build docker://… --reference-layers`
/// indexes its gzip layers, `tessera push` to the same repository uploads only Tessera's own
/// blobs (the image refers to its source manifest as its `subject`), and `tessera serve
/// @sha256:<source manifest digest> --store docker://…` finds the image by that digest and
/// serves every file byte by Range GETs on the original gzip layer blob (issue 12's "Done
/// when"). The converted form (packs pushed to the registry) is read through the registry by
/// the `oci_registry` tests.
#[test]
fn guest_boots_from_a_registry() -> Result<()> {
    fixtures::require_root()?;
    tessera_e2e::oci::require_tools()?;
    tessera_e2e::registry::require_registry()?;
    let kit = guest::kit()?;
    let t = tmp("guest-registry")?;
    let src = t.path().join("src");
    fixtures::by_name("sizes")?.generate(&src)?;
    let img = tessera_e2e::oci::UmociImage::new(&t.path().join("oci"), "v1")?;
    img.layer(|root| {
        for entry in fs::read_dir(&src)? {
            let entry = entry?;
            let ok = Command::new("cp").arg("-a").arg(entry.path()).arg(root).status()?.success();
            ensure!(ok, "cp -a {}", entry.path().display());
        }
        Ok(())
    })?;
    let reg = Registry::start()?;
    let repo = format!("{}/guest/sizes", reg.addr());
    reg.load(&format!("oci:{}", img.image_ref()), "guest/sizes:v1", &[])?;
    let digest = reg.manifest_digest("guest/sizes:v1", &[])?;
    let store = t.path().join("store");
    let built = tessera::run([
        "build".as_ref(),
        format!("docker://{repo}:v1").as_ref(),
        "--reference-layers".as_ref(),
        "--store".as_ref(),
        store.as_os_str(),
    ])?;
    ensure!(built.status.success(), "build: {}", String::from_utf8_lossy(&built.stderr));
    let id = String::from_utf8(built.stdout)?.trim().to_owned();
    let pushed = tessera::run([
        "push".as_ref(),
        id.as_ref(),
        "--store".as_ref(),
        store.as_os_str(),
        format!("docker://{repo}:tessera").as_ref(),
        "--json".as_ref(),
    ])?;
    ensure!(pushed.status.success(), "push: {}", String::from_utf8_lossy(&pushed.stderr));
    let report: serde_json::Value = serde_json::from_slice(&pushed.stdout)?;
    ensure!(report["subject"] == serde_json::json!(digest), "push: {report}");
    let layer = img.layer_digest(0)?;
    let origin = format!("docker://{repo}");
    let socket = t.path().join("blk.sock");
    let before = reg.requests().len();
    let by_source = format!("@{digest}");
    let mut served = serve(&by_source, origin.as_ref(), &socket, &["--read-only".as_ref()])?;
    boot_and_compare_sums(&kit, &src, &socket, t.path(), "sizes from its source image in a registry")?;
    stop(&mut served, &socket)?;
    let layer_gets = reg
        .requests()
        .split_off(before)
        .into_iter()
        .filter(|(m, p)| m == "GET" && p.ends_with(&format!("/blobs/{layer}")))
        .count();
    ensure!(layer_gets > 3, "the guest's reads made only {layer_gets} GETs of the source layer blob {layer}");
    Ok(())
}

/// SIGTERM: the daemon finishes, flushes, removes its socket and exits 0.
fn stop(served: &mut Served, socket: &Path) -> Result<()> {
    Command::new("kill").arg("-TERM").arg(served.0.id().to_string()).status()?;
    let status = served.0.wait()?;
    served.1 = true;
    ensure!(status.success(), "tessera serve exited with {status} after SIGTERM");
    ensure!(!socket.exists(), "socket left behind");
    Ok(())
}

const BIG_FILES: usize = 5;
const BIG_BYTES: usize = 10 << 20;

/// First boot: mount read-write, create 1000 files and write 50 MB, unmount.
const WRITE_SCRIPT: &str = r#"
if mount -t ext4 /dev/vda /mnt; then
  mkdir /mnt/guest-writes
  i=0; while [ $i -lt 1000 ]; do echo "file $i" > /mnt/guest-writes/f$i; i=$((i+1)); done
  for j in 0 1 2 3 4; do yes "tessera block $j" | head -c 10485760 > /mnt/guest-writes/big$j; done
  sync
  if umount /mnt; then echo TESSERA-RW-OK; fi
else
  echo TESSERA-MOUNT-FAILED
fi"#;

/// Second boot: read-only, count and checksum what the first boot wrote.
const VERIFY_SCRIPT: &str = r#"
if mount -t ext4 -o ro /dev/vda /mnt; then
  echo "TESSERA-COUNT $(ls /mnt/guest-writes | wc -l)"
  cd /mnt/guest-writes
  echo TESSERA-SUMS-BEGIN
  for f in big0 big1 big2 big3 big4 f0 f999; do sha256sum ./$f; done
  echo TESSERA-SUMS-END
  cd /
  umount /mnt
else
  echo TESSERA-MOUNT-FAILED
fi"#;

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}

/// A guest writes through the overlay; a second boot (a new daemon on the same overlay) sees the
/// writes; the exported base+overlay is e2fsck-clean.
#[test]
fn guest_writes_survive_a_second_boot() -> Result<()> {
    fixtures::require_root()?;
    let kit = guest::kit()?;
    let t = tmp("guest-rw")?;
    let src = t.path().join("src");
    fixtures::by_name("kinds")?.generate(&src)?;
    let store = t.path().join("store");
    let id = tessera::build(&src, &store, &[])?;
    let socket = t.path().join("blk.sock");
    let overlay = t.path().join("vm.overlay");
    let rw = ["--overlay".as_ref(), overlay.as_os_str()];

    let mut served = serve(id.as_str(), store.as_os_str(), &socket, &rw)?;
    let initrd = t.path().join("write.cpio");
    guest::initramfs(&kit, WRITE_SCRIPT, &initrd)?;
    let log = guest::boot(&kit, &initrd, &socket, t.path(), Duration::from_secs(300))?;
    ensure!(log.contains("TESSERA-RW-OK"), "the guest could not write and unmount; serial log:\n{log}");
    stop(&mut served, &socket)?;

    let mut served = serve(id.as_str(), store.as_os_str(), &socket, &rw)?;
    let initrd = t.path().join("verify.cpio");
    guest::initramfs(&kit, VERIFY_SCRIPT, &initrd)?;
    let log = guest::boot(&kit, &initrd, &socket, t.path(), Duration::from_secs(300))?;
    stop(&mut served, &socket)?;
    ensure!(
        log.contains("TESSERA-COUNT 1005"),
        "the second boot does not see 1005 files; serial log:\n{log}"
    );
    let sums = guest::parse_sums(&log)?;
    let mut want = std::collections::BTreeMap::new();
    for j in 0..BIG_FILES {
        let line = format!("tessera block {j}\n");
        let content: Vec<u8> = line.as_bytes().iter().copied().cycle().take(BIG_BYTES).collect();
        want.insert(format!("big{j}"), sha256_hex(&content));
    }
    want.insert("f0".to_owned(), sha256_hex(b"file 0\n"));
    want.insert("f999".to_owned(), sha256_hex(b"file 999\n"));
    ensure!(sums == want, "guest-written files differ:\n guest {sums:?}\n want  {want:?}");

    let img = t.path().join("with-overlay.raw");
    let out = tessera::command(["export", id.as_str(), "--store"])
        .arg(&store)
        .arg("--overlay")
        .arg(&overlay)
        .arg("-o")
        .arg(&img)
        .output()?;
    ensure!(out.status.success(), "export --overlay failed: {}", String::from_utf8_lossy(&out.stderr));
    judge::e2fsck(&img)?;
    // The base image is untouched by the guest: the source tree still matches it exactly.
    let base = t.path().join("base.raw");
    tessera::export(id.as_str(), &store, &base)?;
    judge::e2fsck(&base)?;
    Ok(())
}

#[test]
fn guest_reads_sizes_fixture() -> Result<()> {
    guest_checksums("sizes")
}

#[test]
fn guest_reads_dedup_fixture() -> Result<()> {
    guest_checksums("dedup")
}
