//! `cargo xtask bench s3`: `tessera copy` to and from an S3 server against `rclone copy` of the
//! same store to and from the same server, in the same run. The server is `rclone serve s3` on
//! loopback (`tessera_e2e::s3`, SigV4 checked on every request), so the figures compare the two
//! clients, not a network. Rounds are interleaved; medians and min–max are reported in MB/s of
//! store bytes moved.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{ensure, Context, Result};
use clap::Args;
use tessera_e2e::s3::{rclone_bin, S3Server, ACCESS_KEY_ID, SECRET_ACCESS_KEY};

use super::bench_lazy::{build_served, release_bench, write_incompressible};

/// Options of `cargo xtask bench s3`.
#[derive(Debug, Args)]
pub struct S3Bench {
    /// Incompressible files in the image.
    #[arg(long, default_value_t = 4)]
    files: u64,
    /// Size of each, in MiB.
    #[arg(long, default_value_t = 64)]
    file_mib: u64,
    /// Interleaved rounds (each: tessera up, rclone up, tessera down, rclone down).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Use this tessera binary instead of building the release one (a smoke run).
    #[arg(long)]
    tessera: Option<PathBuf>,
}

fn tessera(bin: &Path, server: &S3Server, args: &[&str]) -> Command {
    let mut c = Command::new(bin);
    c.args(args)
        .args(["--s3-endpoint", &server.endpoint()])
        .env("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
        .env("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY)
        .env_remove("AWS_SESSION_TOKEN");
    c
}

/// `rclone copy SRC DST` with the server as the remote `bench:`.
fn rclone(server: &S3Server, src: &str, dst: &str) -> Command {
    let mut c = Command::new(rclone_bin());
    c.args(["copy", src, dst, "--config", "/dev/null"])
        .env("RCLONE_CONFIG_BENCH_TYPE", "s3")
        .env("RCLONE_CONFIG_BENCH_PROVIDER", "Other")
        .env("RCLONE_CONFIG_BENCH_ACCESS_KEY_ID", ACCESS_KEY_ID)
        .env("RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY)
        .env("RCLONE_CONFIG_BENCH_ENDPOINT", server.endpoint())
        .env("RCLONE_CONFIG_BENCH_FORCE_PATH_STYLE", "true");
    c
}

fn timed(mut c: Command, what: &str) -> Result<f64> {
    let t = Instant::now();
    let o = c.output().with_context(|| format!("spawn {what}"))?;
    ensure!(o.status.success(), "{what}: {} — {}", o.status, String::from_utf8_lossy(&o.stderr));
    Ok(t.elapsed().as_secs_f64())
}

fn dir_bytes(dir: &Path) -> Result<u64> {
    let mut n = 0;
    for e in fs::read_dir(dir)? {
        let e = e?;
        let m = e.metadata()?;
        n += if m.is_dir() { dir_bytes(&e.path())? } else { m.len() };
    }
    Ok(n)
}

fn summary(name: &str, mb: f64, secs: &mut [f64]) -> String {
    secs.sort_by(f64::total_cmp);
    let rate = |s: f64| mb / s;
    format!(
        "{name:<22} {:>8.1} MB/s (min {:.1}, max {:.1}; {} runs)",
        rate(secs[secs.len() / 2]),
        rate(secs[secs.len() - 1]),
        rate(secs[0]),
        secs.len()
    )
}

pub fn run(opts: &S3Bench) -> Result<()> {
    let (bin, dir) = match &opts.tessera {
        Some(b) => {
            let dir = std::env::temp_dir().join("tessera-bench-s3");
            fs::create_dir_all(&dir)?;
            (b.clone(), dir)
        }
        None => release_bench("bench-s3")?,
    };
    let tree = dir.join("tree");
    let _ = fs::remove_dir_all(&tree);
    write_incompressible(&tree, opts.files, opts.file_mib, "bench-s3")?;
    let (_served, store) = build_served(&bin, &dir, &tree)?;
    let store_s = store.to_str().context("utf-8 path")?;
    let bytes = dir_bytes(&store)?;
    let mb = bytes as f64 / 1e6;
    let mut server = S3Server::start(&["bench"])?;
    let (mut up_t, mut up_r, mut down_t, mut down_r) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..opts.rounds.max(1) {
        println!("==> round {}", round + 1);
        // Fresh bucket contents each round: every object is uploaded.
        server.stop();
        let bucket = server.root().join("bench");
        let _ = fs::remove_dir_all(&bucket);
        fs::create_dir_all(&bucket)?;
        server.restart()?;
        let up = format!("s3://bench/t{round}");
        up_t.push(timed(
            tessera(&bin, &server, &["copy", "bench", "--store", store_s, "--to", &up]),
            "tessera copy up",
        )?);
        up_r.push(timed(rclone(&server, store_s, &format!("bench:bench/r{round}")), "rclone copy up")?);
        let down = dir.join(format!("down-t{round}"));
        let _ = fs::remove_dir_all(&down);
        let down_s = down.to_str().context("utf-8 path")?;
        down_t.push(timed(
            tessera(&bin, &server, &["copy", "bench", "--store", &up, "--to", down_s]),
            "tessera copy down",
        )?);
        let rdown = dir.join(format!("down-r{round}"));
        let _ = fs::remove_dir_all(&rdown);
        down_r.push(timed(
            rclone(&server, &format!("bench:bench/r{round}"), rdown.to_str().context("utf-8")?),
            "rclone copy down",
        )?);
        ensure!(
            dir_bytes(&down)? == bytes,
            "tessera copy down: {} bytes, the store has {bytes}",
            dir_bytes(&down)?
        );
        let _ = fs::remove_dir_all(&down);
        let _ = fs::remove_dir_all(&rdown);
    }
    println!(
        "store: {:.1} MB ({} files of {} MiB, incompressible); server: rclone serve s3 on loopback",
        mb, opts.files, opts.file_mib
    );
    println!("{}", summary("tessera copy --to s3", mb, &mut up_t));
    println!("{}", summary("rclone copy (upload)", mb, &mut up_r));
    println!("{}", summary("tessera copy from s3", mb, &mut down_t));
    println!("{}", summary("rclone copy (download)", mb, &mut down_r));
    Ok(())
}
