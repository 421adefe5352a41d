//! Recording a prefetch profile in a real guest (`cargo xtask record-profile`, and the CI-path
//! e2e test): for each run, `tessera serve --read-only --record-trace` attaches the image to a
//! QEMU microVM whose initramfs mounts it as the root and runs a command in it (`chroot`); then
//! `tessera profile` merges the traces into the image's profile.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};

use crate::daemon::Daemon;
use crate::guest::{self, GuestKit};
use crate::tessera;

/// A guest init fragment: mount the image read-only at /newroot and run the shell script at
/// `/tmp/cmd.sh` (fed on stdin) in it — `chroot` when the image has `/bin/sh`, else busybox sh
/// from the initramfs with /newroot as the working directory. Prints the command's output between
/// markers and `TESSERA-RECORD-STATUS <code>`.
fn guest_script(command: &str) -> String {
    format!(
        "cat > /tmp/cmd.sh <<'TESSERA_CMD_EOF'\n{command}\nTESSERA_CMD_EOF\n\
mount -t ext4 -o ro /dev/vda /newroot || {{ echo TESSERA-MOUNT-FAILED; poweroff -f; }}
for d in proc sys dev; do [ -d /newroot/$d ] && mount --bind /$d /newroot/$d; done
echo TESSERA-RECORD-BEGIN
if [ -x /newroot/bin/sh ]; then chroot /newroot /bin/sh < /tmp/cmd.sh; else (cd /newroot && sh /tmp/cmd.sh); fi
echo \"TESSERA-RECORD-STATUS $?\"
for d in proc sys dev; do umount /newroot/$d 2>/dev/null; done
umount /newroot"
    )
}

/// What one guest run printed, and its exit status.
#[derive(Debug, Clone)]
pub struct GuestRun {
    pub output: String,
    pub status: i32,
}

/// Boot `image` from `store` (any store `tessera serve` reads; `serve_extra` adds flags such as
/// `--cache-dir`) and run `command` in it; with `trace`, record the run's first touches there.
pub fn run_in_guest(
    kit: &GuestKit,
    image: &str,
    store: &str,
    command: &str,
    work: &Path,
    trace: Option<&Path>,
    serve_extra: &[&str],
) -> Result<GuestRun> {
    let socket = work.join("record.sock");
    let mut args: Vec<&str> = vec!["--read-only"];
    let trace_s;
    if let Some(t) = trace {
        trace_s = t.to_str().context("trace path is not UTF-8")?.to_owned();
        args.extend(["--record-trace", trace_s.as_str()]);
    }
    args.extend_from_slice(serve_extra);
    let daemon = Daemon::start(image, store, &socket, &args)?;
    let initrd = work.join("record-initramfs.cpio");
    guest::initramfs(kit, &guest_script(command), &initrd)?;
    // TCG is slow: `find /usr -exec stat` over the 1 GiB package set takes minutes.
    let log = guest::boot(kit, &initrd, &socket, work, Duration::from_secs(900));
    // Stop the daemon whatever the guest did: SIGTERM flushes the trace.
    daemon.stop()?;
    let log = log?;
    ensure!(!log.contains("TESSERA-MOUNT-FAILED"), "the guest could not mount the image:\n{log}");
    let begin = log.find("TESSERA-RECORD-BEGIN").context("the guest did not start the command")?;
    let status_at = log.find("TESSERA-RECORD-STATUS ").context("the command did not finish")?;
    let output = log[begin..status_at].lines().skip(1).collect::<Vec<_>>().join("\n");
    let status = log[status_at + "TESSERA-RECORD-STATUS ".len()..]
        .split_whitespace()
        .next()
        .and_then(|s| s.parse().ok())
        .context("unreadable command status")?;
    Ok(GuestRun { output, status })
}

/// Record `runs` boots of `image` in the local `store` running `command` (each must exit 0),
/// then `tessera profile` them. Returns the trace files and the profile digest; the command's
/// output of each run is logged to stderr.
pub fn record_profile(
    image: &str,
    store: &Path,
    command: &str,
    runs: usize,
    work: &Path,
) -> Result<(Vec<PathBuf>, String)> {
    ensure!(runs >= 1, "at least one run");
    let kit = guest::kit()?;
    let store_s = store.to_str().context("store path is not UTF-8")?;
    let mut traces = Vec::with_capacity(runs);
    for i in 1..=runs {
        let trace = work.join(format!("run{i}.trace"));
        let run = run_in_guest(&kit, image, store_s, command, work, Some(&trace), &[])?;
        if run.status != 0 {
            bail!("run {i}: the command exited with {} in the guest; output:\n{}", run.status, run.output);
        }
        eprintln!("---- run {i}: guest output ----\n{}\n---- end of run {i} ----", run.output);
        traces.push(trace);
    }
    let mut args: Vec<&str> = vec!["profile", image, "--store", store_s, "--trace"];
    for t in &traces {
        args.push(t.to_str().context("trace path is not UTF-8")?);
    }
    let out = tessera::run(&args)?;
    ensure!(out.status.success(), "tessera profile failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok((traces, String::from_utf8_lossy(&out.stdout).trim().to_owned()))
}

/// Boot `image` from the local `store` once, run `command` in it (it must exit 0) and record
/// every virtio request the guest made to `out` (`tessera serve --record-requests`): a request
/// trace to replay on the host (`cargo xtask replay`, `cargo xtask bench cold`); with `trace`,
/// the same run's chunk trace too (`--record-trace`, for `tessera profile`). Returns the guest's
/// run.
pub fn record_requests(
    image: &str,
    store: &Path,
    command: &str,
    work: &Path,
    out: &Path,
    trace: Option<&Path>,
) -> Result<GuestRun> {
    let kit = guest::kit()?;
    let store_s = store.to_str().context("store path is not UTF-8")?;
    let out_s = out.to_str().context("trace path is not UTF-8")?;
    let run = run_in_guest(&kit, image, store_s, command, work, trace, &["--record-requests", out_s])?;
    if run.status != 0 {
        bail!("the command exited with {} in the guest; output:\n{}", run.status, run.output);
    }
    Ok(run)
}
