//! The whole path in a real guest: `tessera build` → `tessera serve` (vhost-user-blk) → QEMU microvm
//! with Debian's cloud kernel → the guest kernel mounts our ext4 from /dev/vda and checksums every
//! file; the sums must equal the source's.
//!
//! Needs root, qemu-system-x86 (bookworm-backports), busybox-static and apt access for the kernel
//! package (`cargo xtask test` installs the packages); run with `--test-threads=1`.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use tessera_e2e::testutil::tmp;
use tessera_e2e::{fixtures, guest, tessera};

/// A `tessera serve` child, stopped with SIGTERM on drop.
struct Served(Child);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = Command::new("kill").arg("-TERM").arg(self.0.id().to_string()).status();
        let _ = self.0.wait();
    }
}

fn serve(id: &str, store: &std::path::Path, socket: &std::path::Path) -> Result<Served> {
    let child = tessera::command(["serve", id, "--store"])
        .arg(store)
        .arg("--socket")
        .arg(socket)
        .arg("--read-only")
        .stdin(Stdio::null())
        .spawn()
        .context("starting tessera serve")?;
    let served = Served(child);
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
    let mut served = serve(id.as_str(), &store, &socket)?;

    let initrd = t.path().join("initramfs.cpio");
    guest::initramfs(&kit, guest::CHECKSUM_SCRIPT, &initrd)?;
    let log = guest::boot(&kit, &initrd, &socket, t.path(), Duration::from_secs(180))?;
    let seen = guest::parse_sums(&log)?;
    let want = guest::host_sums(&src)?;
    ensure!(!want.is_empty(), "fixture {fixture} has no files to compare");
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
    ensure!(diffs.is_empty(), "{} differences:\n{}", diffs.len(), diffs.join("\n"));
    eprintln!("guest {fixture}: {} files and symlinks identical", want.len());

    // The daemon stops cleanly on SIGTERM and removes its socket.
    Command::new("kill").arg("-TERM").arg(served.0.id().to_string()).status()?;
    let status = served.0.wait()?;
    ensure!(status.success(), "tessera serve exited with {status} after SIGTERM");
    ensure!(!socket.exists(), "socket left behind");
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
