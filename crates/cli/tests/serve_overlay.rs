//! `tessera serve --overlay` as a black box: a libblkio client writes and flushes, the daemon is
//! killed with SIGKILL, a new daemon on the same overlay serves what was flushed, a SIGTERM
//! stop flushes, and `tessera export --overlay` equals what the client wrote.
#![allow(clippy::unwrap_used)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod blk;
mod common;

use blk::Client;
use common::{tessera, TESSERA};

struct Daemon {
    child: Child,
    socket: PathBuf,
}

impl Daemon {
    /// Start `tessera serve` and wait (polling) until its socket exists: it appears only once
    /// it accepts. An existing socket file (of a killed daemon) is removed first so that the
    /// poll cannot see it.
    fn start(dir: &Path, overlay: &Path) -> Daemon {
        let socket = dir.join("vm.sock");
        let _ = fs::remove_file(&socket);
        let store = dir.join("store");
        let child = Command::new(TESSERA)
            .args(["serve", "img", "--store", store.to_str().unwrap(), "--socket", socket.to_str().unwrap()])
            .arg("--overlay")
            .arg(overlay)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut d = Daemon { child, socket };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !d.socket.exists() {
            if let Some(status) = d.child.try_wait().unwrap() {
                panic!("tessera serve exited early: {status}");
            }
            assert!(Instant::now() < deadline, "no socket within 30 s");
            std::thread::sleep(Duration::from_millis(5)); // polling interval, not a fixed wait
        }
        d
    }

    fn kill9(mut self) {
        self.child.kill().unwrap(); // SIGKILL
        self.child.wait().unwrap();
    }

    fn terminate(mut self) {
        // SAFETY: kill(2) on our own child's pid; it has not been reaped yet.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) }, 0);
        let status = self.child.wait().unwrap();
        assert!(status.success(), "{status}");
        assert!(!self.socket.exists(), "socket removed on SIGTERM");
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn overlay_survives_kill_9_and_exports() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    fs::create_dir_all(src.join("d")).unwrap();
    fs::write(src.join("d/file"), pattern(1, 300_000)).unwrap();
    let store = dir.path().join("store");
    let store = store.to_str().unwrap();
    tessera(&["build", src.to_str().unwrap(), "--store", store, "--tag", "img", "--size", "32M"]);
    let base = dir.path().join("base.img");
    tessera(&["export", "img", "--store", store, "-o", base.to_str().unwrap()]);
    let mut model = fs::read(&base).unwrap();
    let overlay = dir.path().join("vm.overlay");

    let apply = |model: &mut Vec<u8>, off: u64, data: &[u8]| {
        model[off as usize..off as usize + data.len()].copy_from_slice(data);
    };
    // Life 1: writes (whole blocks, 512-byte pieces, 1 MiB), flush, then SIGKILL.
    let d = Daemon::start(dir.path(), &overlay);
    let mut c = Client::connect(&d.socket);
    let writes: Vec<(u64, Vec<u8>)> = vec![
        (0, pattern(2, 4096)),
        (40960 + 512, pattern(3, 512)),
        (1 << 20, pattern(4, 1 << 20)),
        ((32 << 20) - 512, pattern(5, 512)),
    ];
    for (off, data) in &writes {
        assert_eq!(c.write(*off, data), 0, "write at {off}");
        apply(&mut model, *off, data);
    }
    assert_eq!(c.flush(), 0, "flush");
    drop(c);
    d.kill9();
    assert!(overlay.exists());

    // Life 2: everything flushed is there; more writes; SIGTERM flushes on the way out.
    let d = Daemon::start(dir.path(), &overlay);
    let mut c = Client::connect(&d.socket);
    for (off, data) in &writes {
        let at = *off & !511;
        assert_eq!(c.read(at, data.len()), 0, "read at {at}");
        assert!(c.buf(data.len()) == &model[at as usize..][..data.len()], "after kill -9 at {off}");
    }
    assert_eq!(c.write(8 << 20, &pattern(6, 65536)), 0, "write at 8 MiB");
    apply(&mut model, 8 << 20, &pattern(6, 65536));
    drop(c);
    d.terminate();

    // Export base plus overlay: byte for byte what the client wrote.
    let out = dir.path().join("out.img");
    tessera(&[
        "export",
        "img",
        "--store",
        store,
        "--overlay",
        overlay.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(fs::read(&out).unwrap() == model, "export --overlay differs from the client's writes");

    // An overlay made for another image is refused with a clear error.
    fs::write(src.join("other"), b"x").unwrap();
    tessera(&["build", src.to_str().unwrap(), "--store", store, "--tag", "other", "--size", "32M"]);
    let out = Command::new(TESSERA)
        .args(["export", "other", "--store", store, "--overlay", overlay.to_str().unwrap(), "-o"])
        .arg(dir.path().join("x.img"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("was made for image"), "{err}");
}
