//! A QEMU guest boots from an image in an S3 bucket: `tessera copy --to s3://…` into `rclone serve
//! s3` (which checks every request's AWS Signature V4), then `tessera serve --store s3://…
//! --cache-dir` (vhost-user-blk) → QEMU microvm → the guest mounts the ext4 and checksums every
//! file; the sums must equal the source's. One boot (TCG is slow).
//!
//! Needs root, qemu-system-x86, busybox-static, rclone (`cargo xtask test` installs them).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use tessera_e2e::s3::{S3Server, ACCESS_KEY_ID, SECRET_ACCESS_KEY};
use tessera_e2e::testutil::tmp;
use tessera_e2e::{fixtures, guest, tessera};

fn s3_command(server: &S3Server, args: &[&str]) -> Command {
    let mut c = tessera::command(args);
    c.args(["--s3-endpoint", &server.endpoint()])
        .env("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
        .env("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY)
        .env_remove("AWS_SESSION_TOKEN")
        .env_remove("AWS_PROFILE");
    c
}

#[test]
fn guest_boots_from_an_s3_bucket() -> Result<()> {
    fixtures::require_root()?;
    let kit = guest::kit()?;
    let t = tmp("guest-s3")?;
    let src = t.path().join("src");
    fixtures::by_name("sizes")?.generate(&src)?;
    let store = t.path().join("store");
    tessera::build(&src, &store, &["--tag", "sizes"])?;
    let server = S3Server::start(&["guest"])?;
    let dest = "s3://guest/images";
    let store_s = store.to_str().context("utf-8 path")?;
    let o = s3_command(&server, &["copy", "sizes", "--store", store_s, "--to", dest]).output()?;
    ensure!(o.status.success(), "copy to s3: {}", String::from_utf8_lossy(&o.stderr));

    let socket = t.path().join("blk.sock");
    let cache = t.path().join("cache");
    let cache_s = cache.to_str().context("utf-8 path")?;
    let socket_s = socket.to_str().context("utf-8 path")?;
    let mut child = s3_command(
        &server,
        &["serve", "sizes", "--store", dest, "--socket", socket_s, "--read-only", "--cache-dir", cache_s],
    )
    .stdin(Stdio::null())
    .spawn()
    .context("starting tessera serve")?;
    let start = Instant::now();
    while !socket.exists() {
        ensure!(child.try_wait()?.is_none(), "tessera serve exited before listening");
        ensure!(start.elapsed() < Duration::from_secs(30), "tessera serve did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    let initrd = t.path().join("initramfs.cpio");
    guest::initramfs(&kit, guest::CHECKSUM_SCRIPT, &initrd)?;
    let booted = guest::boot(&kit, &initrd, &socket, t.path(), Duration::from_secs(180));
    let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
    let status = child.wait()?;
    let log = booted?;
    ensure!(status.success(), "tessera serve exited with {status} after SIGTERM");
    let seen = guest::parse_sums(&log)?;
    let want = guest::host_sums(&src)?;
    ensure!(!want.is_empty(), "no files to compare");
    let diffs: Vec<String> = want
        .iter()
        .filter(|(path, sum)| seen.get(*path) != Some(sum))
        .map(|(path, sum)| format!("{path}: source {sum}, guest {:?}", seen.get(path)))
        .collect();
    ensure!(diffs.is_empty(), "{} differences:\n{}", diffs.len(), diffs.join("\n"));
    ensure!(seen.len() == want.len(), "the guest saw {} files, the source has {}", seen.len(), want.len());
    eprintln!("guest from s3: {} files and symlinks identical", want.len());
    Ok(())
}
