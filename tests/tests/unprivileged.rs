//! The daemon needs no root: `tessera serve` run as `nobody` (`setpriv --reuid=nobody
//! --regid=nogroup --clear-groups`, no capabilities) opens a local store it can only read,
//! listens on a socket in a directory it owns, serves a whole-device read equal to the local
//! export, and on SIGTERM exits 0 and removes its socket.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use tessera_e2e::daemon::BlkClient;
use tessera_e2e::prng::Prng;
use tessera_e2e::testutil::built_store;
use tessera_e2e::{fixtures, tessera};

const NOBODY: u32 = 65534;

#[test]
fn serve_runs_as_nobody() -> Result<()> {
    fixtures::require_root()?;
    let f = built_store("unprivileged", "demo", "64K", |dir| {
        fs::create_dir_all(dir)?;
        fs::write(dir.join("data.bin"), Prng::from_label("unprivileged").bytes(2_000_000))?;
        fs::write(dir.join("hello"), b"served by nobody\n")?;
        Ok(())
    })?;
    // The binary where nobody can run it (the checkout may be under a directory nobody cannot
    // enter); the socket in a directory nobody owns; the store stays root's (read-only to nobody).
    let bin = f.t.path().join("tessera");
    fs::copy(tessera::tessera_bin(), &bin)?;
    fs::set_permissions(&bin, fs::Permissions::from_mode(0o755))?;
    let run = f.t.path().join("run");
    fs::create_dir(&run)?;
    std::os::unix::fs::chown(&run, Some(NOBODY), Some(NOBODY))?;
    let socket = run.join("tessera.sock");
    let log = f.t.path().join("serve.log");
    let mut child = std::process::Command::new("setpriv")
        .args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "--inh-caps=-all", "--"])
        .arg(&bin)
        .args(["serve", "demo", "--read-only", "--store"])
        .arg(&f.store)
        .arg("--socket")
        .arg(&socket)
        .stdout(std::process::Stdio::null())
        .stderr(fs::File::create(&log)?)
        .spawn()
        .context("setpriv (util-linux)")?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        if let Some(status) = child.try_wait()? {
            anyhow::bail!("serve as nobody exited with {status}: {}", fs::read_to_string(&log)?);
        }
        ensure!(Instant::now() < deadline, "serve as nobody did not listen within 30 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    // setpriv execs: the child's pid is the daemon's.
    let status = fs::read_to_string(format!("/proc/{}/status", child.id()))?;
    let line = |key: &str| status.lines().find(|l| l.starts_with(key)).unwrap_or_default().to_owned();
    ensure!(line("Uid:").split_whitespace().skip(1).all(|u| u == "65534"), "{}", line("Uid:"));
    ensure!(line("Gid:").split_whitespace().skip(1).all(|g| g == "65534"), "{}", line("Gid:"));
    ensure!(line("Groups:").trim() == "Groups:", "{}", line("Groups:"));
    ensure!(line("CapEff:").ends_with("0000000000000000"), "{}", line("CapEff:"));
    let owner = std::os::unix::fs::MetadataExt::uid(&fs::symlink_metadata(&socket)?);
    ensure!(owner == NOBODY, "the socket belongs to uid {owner}");

    let mut client = BlkClient::connect(&socket, 1, true)?;
    let (device, failed) = client.read_device(1 << 20, 4)?;
    ensure!(failed.is_empty(), "reads failed through the unprivileged daemon: {failed:?}");
    ensure!(device == f.local_raw, "the device read as nobody differs from the local export");
    drop(client);

    // SAFETY: kill(2) on our own child (setpriv exec'd the daemon), not yet reaped.
    unsafe { libc::kill(i32::try_from(child.id())?, libc::SIGTERM) };
    let exit = child.wait()?;
    ensure!(
        exit.success(),
        "serve as nobody exited with {exit} after SIGTERM: {}",
        fs::read_to_string(&log)?
    );
    ensure!(!socket.exists(), "serve as nobody left its socket behind");
    eprintln!("served {} bytes as uid 65534 with no capabilities", f.local_raw.len());
    Ok(())
}
