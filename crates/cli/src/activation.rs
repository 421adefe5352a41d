//! systemd integration of `tessera serve`: socket activation (`LISTEN_PID`/`LISTEN_FDS`, the
//! listening socket as fd 3) and readiness (`sd_notify` `READY=1` on `$NOTIFY_SOCKET`). Both
//! protocols are a few lines (sd_listen_fds(3), sd_notify(3)); written here rather than pulling
//! a crate for them.

use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::{UnixDatagram, UnixListener};

use anyhow::{bail, Context, Result};

/// The first descriptor systemd passes (`SD_LISTEN_FDS_START`).
const LISTEN_FDS_START: RawFd = 3;

/// How many descriptors `LISTEN_PID`/`LISTEN_FDS` pass to process `pid` (0: none, or meant for
/// another process). Pure.
pub fn passed_fds(listen_pid: Option<&str>, listen_fds: Option<&str>, pid: u32) -> Result<u32> {
    let (Some(for_pid), Some(n)) = (listen_pid, listen_fds) else { return Ok(0) };
    let for_pid: u32 = for_pid.trim().parse().with_context(|| format!("LISTEN_PID={for_pid:?}"))?;
    if for_pid != pid {
        return Ok(0);
    }
    n.trim().parse().with_context(|| format!("LISTEN_FDS={n:?}"))
}

/// The listening socket systemd passed, if any (then the variables are removed so that child
/// processes do not take it too). More than one socket, or fd 3 not a listening Unix stream
/// socket, is an error.
pub fn take_listener() -> Result<Option<UnixListener>> {
    let var = |k| std::env::var(k).ok();
    let n = passed_fds(var("LISTEN_PID").as_deref(), var("LISTEN_FDS").as_deref(), std::process::id())?;
    for k in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
        std::env::remove_var(k);
    }
    match n {
        0 => return Ok(None),
        1 => {}
        n => bail!("LISTEN_FDS={n}: tessera serve takes one listening socket (one ListenStream=)"),
    }
    let fd = LISTEN_FDS_START;
    // SAFETY: fcntl/fstat/getsockopt only inspect descriptor 3, which systemd passed to this
    // process for it to own; nothing else in the process has opened or used it.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd, &mut st) != 0 || st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
            bail!("LISTEN_FDS: descriptor {fd} is not a socket");
        }
        if int_sockopt(fd, libc::SO_ACCEPTCONN) != Some(1) {
            bail!(
                "LISTEN_FDS: descriptor {fd} is not a listening socket (ListenStream= in the .socket unit)"
            );
        }
        if int_sockopt(fd, libc::SO_DOMAIN) != Some(libc::AF_UNIX) {
            bail!("LISTEN_FDS: descriptor {fd} is not a Unix socket (ListenStream= takes a path)");
        }
        libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        Ok(Some(UnixListener::from_raw_fd(fd)))
    }
}

/// An integer `SOL_SOCKET` option of socket `fd` (`None` if it cannot be read).
fn int_sockopt(fd: RawFd, opt: libc::c_int) -> Option<libc::c_int> {
    let (mut value, mut len): (libc::c_int, libc::socklen_t) = (0, 4);
    // SAFETY: getsockopt writes at most `len` (4) bytes into `value`, a c_int on our stack;
    // it only reads the descriptor's state.
    let rc = unsafe {
        libc::getsockopt(fd, libc::SOL_SOCKET, opt, (&mut value as *mut libc::c_int).cast(), &mut len)
    };
    (rc == 0).then_some(value)
}

/// Tell the supervisor the daemon is ready (`READY=1`), if it asked (`$NOTIFY_SOCKET`: a path,
/// or `@name` in the abstract namespace). Without the variable, nothing.
pub fn notify_ready() -> Result<()> {
    let Some(target) = std::env::var_os("NOTIFY_SOCKET") else { return Ok(()) };
    let sock = UnixDatagram::unbound().context("sd_notify socket")?;
    let bytes = target.as_encoded_bytes();
    let sent = if let Some(name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name).context("NOTIFY_SOCKET")?;
        sock.send_to_addr(b"READY=1\n", &addr)
    } else {
        sock.send_to(b"READY=1\n", &target)
    };
    sent.with_context(|| format!("sd_notify READY=1 to NOTIFY_SOCKET={}", target.to_string_lossy()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_fds_are_for_this_process_only() {
        assert_eq!(passed_fds(None, None, 42).unwrap(), 0);
        assert_eq!(passed_fds(Some("42"), None, 42).unwrap(), 0);
        assert_eq!(passed_fds(Some("42"), Some("1"), 42).unwrap(), 1);
        assert_eq!(passed_fds(Some("41"), Some("1"), 42).unwrap(), 0, "meant for another process");
        assert_eq!(passed_fds(Some("42"), Some("2"), 42).unwrap(), 2);
        assert!(passed_fds(Some("x"), Some("1"), 42).is_err());
        assert!(passed_fds(Some("42"), Some("one"), 42).is_err());
    }

    #[test]
    fn ready_goes_to_the_notify_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let rx = UnixDatagram::bind(&path).unwrap();
        std::env::set_var("NOTIFY_SOCKET", &path);
        notify_ready().unwrap();
        std::env::remove_var("NOTIFY_SOCKET");
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\n");
        notify_ready().unwrap(); // no variable: nothing
    }
}
