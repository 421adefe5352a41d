//! `tessera serve` under a supervisor, as systemd runs it: the listening socket passed as fd 3
//! (`LISTEN_PID`/`LISTEN_FDS`), readiness on `--ready-fd` and as `READY=1` on `$NOTIFY_SOCKET`
//! only once it accepts; a client reads the whole device through it; on SIGTERM the socket file
//! stays (it is the supervisor's) and a second daemon started on the same socket serves the
//! next client — a restart without a new socket path.

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixDatagram, UnixListener};
use std::os::unix::process::CommandExt;
use std::process::{Child, Stdio};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use tessera_e2e::daemon::BlkClient;
use tessera_e2e::prng::Prng;
use tessera_e2e::tessera;
use tessera_e2e::testutil::built_store;

/// `tessera serve` with `listener` as fd 3 and `ready` as fd 4, LISTEN_PID set to its own pid
/// (by the `sh` that execs it, as systemd sets it after fork).
fn start(
    store: &std::path::Path,
    socket: &std::path::Path,
    listener: &UnixListener,
    ready: &fs::File,
    notify: &std::path::Path,
    log: &std::path::Path,
) -> Result<Child> {
    let (lfd, rfd) = (listener.as_raw_fd(), ready.as_raw_fd());
    let mut c = std::process::Command::new("sh");
    c.arg("-c")
        .arg("LISTEN_PID=$$ LISTEN_FDS=1 exec \"$0\" \"$@\"")
        .arg(tessera::tessera_bin())
        .args(["serve", "demo", "--read-only", "--ready-fd", "4", "--store"])
        .arg(store)
        .arg("--socket")
        .arg(socket)
        .env("NOTIFY_SOCKET", notify)
        .stdout(Stdio::null())
        .stderr(fs::File::create(log)?);
    // SAFETY: between fork and exec only async-signal-safe calls (fcntl, dup2, close) on
    // descriptors this process owns: copies above 10 first, so that moving them to 3 and 4
    // cannot clobber one with the other; dup2 leaves the targets without FD_CLOEXEC.
    unsafe {
        c.pre_exec(move || {
            let l = libc::fcntl(lfd, libc::F_DUPFD, 10);
            let r = libc::fcntl(rfd, libc::F_DUPFD, 10);
            if l < 0 || r < 0 || libc::dup2(l, 3) < 0 || libc::dup2(r, 4) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::close(l);
            libc::close(r);
            Ok(())
        });
    }
    c.spawn().context("spawn sh -c exec tessera serve")
}

#[test]
fn serve_on_a_socket_passed_by_the_supervisor() -> Result<()> {
    let f = built_store("socket-activation", "demo", "64K", |dir| {
        fs::create_dir_all(dir)?;
        fs::write(dir.join("data.bin"), Prng::from_label("activation").bytes(1_500_000))?;
        Ok(())
    })?;
    let socket = f.t.path().join("vm.sock");
    let listener = UnixListener::bind(&socket)?;
    let notify_path = f.t.path().join("notify");
    let notify = UnixDatagram::bind(&notify_path)?;
    notify.set_read_timeout(Some(Duration::from_secs(60)))?;

    for round in 1..=2 {
        let ready_path = f.t.path().join(format!("ready{round}"));
        let log = f.t.path().join(format!("serve{round}.log"));
        let mut child =
            start(&f.store, &socket, &listener, &fs::File::create(&ready_path)?, &notify_path, &log)?;
        let mut buf = [0u8; 64];
        let n = notify.recv(&mut buf).with_context(|| {
            format!("no READY=1 within 60 s: {}", fs::read_to_string(&log).unwrap_or_default())
        })?;
        ensure!(&buf[..n] == b"READY=1\n", "sd_notify sent {:?}", String::from_utf8_lossy(&buf[..n]));
        // --ready-fd was written before READY=1, and both after the server took the socket.
        let ready = fs::read_to_string(&ready_path)?;
        ensure!(ready == format!("ready {}\n", socket.display()), "--ready-fd: {ready:?}");
        let log_text = fs::read_to_string(&log)?;
        ensure!(!log_text.contains("ERROR"), "round {round}: {log_text}");

        let mut client = BlkClient::connect(&socket, 1, true)?;
        let (device, failed) = client.read_device(1 << 20, 4)?;
        ensure!(failed.is_empty(), "round {round}: failed reads {failed:?}");
        ensure!(device == f.local_raw, "round {round}: the device differs from the local export");
        drop(client);

        // SAFETY: kill(2) on our own child (sh exec'd the daemon), not yet reaped.
        unsafe { libc::kill(i32::try_from(child.id())?, libc::SIGTERM) };
        let status = child.wait()?;
        ensure!(status.success(), "round {round}: serve exited {status}: {}", fs::read_to_string(&log)?);
        ensure!(socket.exists(), "round {round}: the supervisor's socket was removed");
    }
    Ok(())
}
