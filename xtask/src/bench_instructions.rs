//! `cargo xtask bench instructions`: the instructions `tessera serve` executes per request, counted
//! by callgrind — the figure that compares two builds on a machine whose timings swing by ±20 %
//! from one minute to the next (counts, not times: they do not see cache misses or the kernel).
//!
//! For each binary: the serve bench's image (the same generated tree, built by that binary into
//! its own store), a daemon on CPU 1 under `valgrind --tool=callgrind --instr-atstart=no` with
//! one queue and a memory tier holding the whole file-data region, one warm pass of the client
//! (`blkbench --cpu 0 warm`) uncounted, then `callgrind_control -i on`, the timed test, `-i off`.
//! The daemon's whole count (every thread) divided by the requests the client completed is the
//! figure; the callgrind file stays for `callgrind_annotate`.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::bench_serve::{self, BuiltImage, Daemon};
use crate::{status, target_dir};

/// Options of `cargo xtask bench instructions`.
#[derive(Debug, Args)]
pub struct InstructionsBench {
    /// `tessera` binaries to count, in order (default: the release CLI, built now); e.g. the
    /// build of an older commit and this one.
    #[arg(long = "bin", value_name = "BIN")]
    bins: Vec<PathBuf>,
    /// The client's test (a `blkbench` test: `randread:32`, `randread:1`, `seqread:8`, …).
    #[arg(long, default_value = "randread:32")]
    test: String,
    /// Seconds of the counted test (under valgrind a request is ~50× slower).
    #[arg(long, default_value_t = 10.0)]
    secs: f64,
    /// Files in the generated tree (default: the serve bench's).
    #[arg(long)]
    files: Option<u64>,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

/// The instruction count of a callgrind output file: its `totals:` line (at the end), else its
/// `summary:` line (in the header: 0 when instrumentation started switched off).
fn totals(text: &str) -> Option<u64> {
    let line = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
    };
    line("totals:").or_else(|| line("summary:"))
}

pub fn run(o: &InstructionsBench) -> Result<()> {
    crate::fixtures::require_root()?;
    crate::ensure_tools(&[
        ("valgrind", "valgrind"),
        ("callgrind_control", "valgrind"),
        ("taskset", "util-linux"),
    ])?;
    let target = target_dir()?;
    let mut bins: Vec<PathBuf> = Vec::new();
    let mut client = PathBuf::new();
    for b in o.bins.iter().map(Some).chain(o.bins.is_empty().then_some(None)) {
        let (bin, c) = bench_serve::build_release(b.map(PathBuf::as_path))?;
        bins.push(bin.canonicalize().with_context(|| bin.display().to_string())?);
        client = c;
    }
    let (tree, _) = bench_serve::bench_tree(o.files)?;
    let dir = target.join("bench-instructions");
    std::fs::create_dir_all(&dir)?;
    let mut rows = Vec::new();
    for (i, bin) in bins.iter().enumerate() {
        let store = dir.join(format!("store-{i}"));
        let _ = std::fs::remove_dir_all(&store);
        let BuiltImage { id, lo, hi, .. } = bench_serve::build_image(bin, &tree, &store)?;
        let out = dir.join(format!("callgrind.{i}.out"));
        let _ = std::fs::remove_file(&out);
        let (sock, overlay) = (dir.join("cg.sock"), dir.join("cg.overlay"));
        let _ = std::fs::remove_file(&overlay);
        let mut cmd = Command::new("taskset");
        cmd.args(["-c", "1", "valgrind", "--tool=callgrind", "--instr-atstart=no"])
            .arg(format!("--callgrind-out-file={}", out.display()));
        bench_serve::serve_args(&mut cmd, bin, &id, &store, &sock, &overlay).args([
            "--queues",
            "1",
            "--mem-cache",
            &bench_serve::mem_cache_for(lo, hi),
        ]);
        let daemon = Daemon::spawn(cmd, &sock, &dir.join(format!("daemon.{i}.log")))?;
        let pid = daemon.pid().to_string();
        let blkbench = |secs: f64, test: &str| {
            let mut c = Command::new(&client);
            c.args(["--socket"]).arg(&sock).args(["--cpu", "0", "--secs", &secs.to_string()]);
            c.args(["--lo", &lo.to_string(), "--hi", &hi.to_string(), test]);
            c
        };
        bench_serve::run_client(blkbench(1.0, "warm"))?;
        status(Command::new("callgrind_control").args(["-i", "on", &pid]))?;
        let r = bench_serve::run_client(blkbench(o.secs, &o.test))?;
        status(Command::new("callgrind_control").args(["-i", "off", &pid]))?;
        daemon.stop()?;
        let ops = r
            .iter()
            .find(|(k, _)| k.ends_with(".ops"))
            .map(|(_, v)| *v)
            .context("the client reported no ops")?;
        let text = std::fs::read_to_string(&out).with_context(|| out.display().to_string())?;
        let ir = totals(&text).with_context(|| format!("{}: no totals line", out.display()))?;
        if ops < 1.0 {
            bail!("{}: no request completed", bin.display());
        }
        println!(
            "{}: {ir} instructions over {ops:.0} requests: {:.0} per request",
            bin.display(),
            ir as f64 / ops
        );
        rows.push(serde_json::json!({
            "bin": bin.display().to_string(),
            "test": o.test,
            "requests": ops,
            "instructions": ir,
            "per_request": ir as f64 / ops,
            "callgrind_out": out.display().to_string(),
        }));
    }
    if o.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("\n| binary | requests | instructions per request |\n|---|---|---|");
        for r in &rows {
            println!(
                "| {} | {} | {:.0} |",
                r["bin"].as_str().unwrap_or(""),
                r["requests"],
                r["per_request"].as_f64().unwrap_or(0.0)
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_totals_of_a_callgrind_file() {
        let text =
            "# callgrind format\nversion: 1\nevents: Ir\nsummary: 0\nfl=(1) a.rs\nfn=(1) f\n3 10\n\ntotals: 1499742389\n";
        assert_eq!(totals(text), Some(1_499_742_389));
        assert_eq!(totals("summary: 42\n"), Some(42));
        assert_eq!(totals("events: Ir\n"), None);
    }
}
