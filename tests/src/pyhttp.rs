//! Python's `http.server` as an HTTP origin that ignores `Range`: it answers every GET with 200
//! and the whole file, as a new user's first static server often does.
//!
//! One `python3 -m http.server` process serving a directory on a loopback port; its access log
//! (stderr) in a temp dir; readiness is polled (TCP connect); the process is killed on drop.

use std::fs;
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// A running `python3 -m http.server`; stopped on drop.
#[derive(Debug)]
pub struct PyHttp {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl PyHttp {
    /// Serve `root` at `http://127.0.0.1:PORT/`.
    pub fn serve(root: &Path) -> Result<Self> {
        let dir = crate::testutil::tmp("pyhttp")?;
        let log = dir.path().join("access.log");
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port();
        let mut child = Command::new("python3")
            .args(["-u", "-m", "http.server", &port.to_string(), "--bind", "127.0.0.1", "--directory"])
            .arg(root)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log)?)
            .spawn()
            .context("spawn python3 -m http.server")?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_err() {
            if let Some(status) = child.try_wait()? {
                bail!("python3 -m http.server exited: {status}: {}", fs::read_to_string(&log)?);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                bail!("python3 -m http.server not listening on {port} after 10 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Self { child, port, dir })
    }

    /// The base URL, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The access log so far (one line per request: `"GET /path HTTP/1.1" 200 -`).
    pub fn access_log(&self) -> String {
        fs::read_to_string(self.dir.path().join("access.log")).unwrap_or_default()
    }

    /// GET requests logged for `path` (e.g. `/blobs/sha256/<hex>`).
    pub fn gets(&self, path: &str) -> usize {
        let needle = format!("\"GET {path} ");
        self.access_log().lines().filter(|l| l.contains(&needle)).count()
    }
}

impl Drop for PyHttp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
