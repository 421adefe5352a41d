//! `cargo xtask reliability`: the fault and hardening matrix of docs/reliability.md, one row
//! per scenario, each an existing automated test; prints the matrix with each outcome and time.
//! Scenarios still missing from the matrix are listed in docs/reliability.md.

use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Result};

/// (scenario, package, test binary (`None`: the library's unit tests), name filter).
type Row = (&'static str, &'static str, Option<&'static str>, &'static str);

/// The environment of the full (not the gate's shortened) form of a row's test.
const FULL: &[(&str, &str)] = &[
    ("TESSERA_RESTART_KILLS", "20"),
    ("TESSERA_COMPACTION_KILLS", "20"),
    ("TESSERA_POWER_LOSS_KILLS", "20"),
    ("TESSERA_SOAK_DAEMONS", "64"),
    ("TESSERA_SOAK_SECS", "600"),
    ("TESSERA_RESTART_GRACEFUL", "10"),
    // The bound on a fault storm's cost, asserted here; the gate's loaded machine only
    // prints it.
    ("TESSERA_STORM_MAX_RATIO", "2"),
];

const MATRIX: &[Row] = &[
    (
        "symlink modes from Python tarfile / GNU tar / bsdtar",
        "tessera-e2e",
        Some("oci"),
        "symlink_modes_match_umoci_unpack",
    ),
    (
        "hostile OCI layers: traversal, escapes, absurd headers, gzip/zstd bombs",
        "tessera-e2e",
        Some("oci"),
        "hostile_layers_fail_cleanly",
    ),
    ("hostile virtio chains (in-process)", "tessera-vhost", Some("hostile"), ""),
    ("hostile guest against a whole daemon (raw frontend)", "tessera-e2e", Some("hostile_frontend"), ""),
    ("origin ignoring Range (python http.server)", "tessera-e2e", Some("range_ignoring_origin"), ""),
    ("origin ignoring Range: concurrency, byte counts", "tessera-store", None, "range_ignoring_server"),
    ("guest log flood (20 000 bad requests)", "tessera-vhost", Some("log_flood"), ""),
    ("credentials at RUST_LOG=trace", "tessera-e2e", Some("registry_store"), "credentials_are_never_logged"),
    ("serve as nobody, no capabilities", "tessera-e2e", Some("unprivileged"), ""),
    ("socket activation, restart on one socket", "tessera-e2e", Some("socket_activation"), ""),
    (
        "corrupt chunks in the disk cache and at the origin",
        "tessera-e2e",
        Some("serve_origin"),
        "corrupt_chunks_are_refetched",
    ),
    ("cache disk full (1 MiB tmpfs)", "tessera-store", Some("faults"), "a_full_cache_filesystem"),
    (
        "overlay disk full (3 MiB tmpfs): EIO on writes, reads go on, restart while full",
        "tessera-e2e",
        Some("restart_under_load"),
        "a_full_overlay_file_system",
    ),
    (
        "power loss in FLUSH, compaction or open (40 × 6 lives)",
        "tessera-overlay",
        None,
        "durability_under_power_loss",
    ),
    (
        "group commit: 16 concurrent FLUSHes, power loss after",
        "tessera-overlay",
        None,
        "concurrent_flushes_share",
    ),
    (
        "compaction while serving: 3000 write + FLUSH rounds",
        "tessera-overlay",
        None,
        "the_group_commit_compacts",
    ),
    (
        "kill -9 ×20 under writes + FLUSH (libblkio), 4 more while opening",
        "tessera-e2e",
        Some("restart_under_load"),
        "kill_9_under_writes",
    ),
    (
        "kill -9 ×20 through the power-loss double (unsynced writes lost or torn)",
        "tessera-e2e",
        Some("restart_under_load"),
        "kill_9_through_the_power_loss_double",
    ),
    (
        "kill -9 ×20 during online overlay compactions (libblkio)",
        "tessera-e2e",
        Some("restart_under_load"),
        "kill_9_during_online_compaction",
    ),
    (
        "100 reconnects under load (libblkio)",
        "tessera-e2e",
        Some("restart_under_load"),
        "a_hundred_reconnects",
    ),
    ("origin gone: cached reads served, EIO within 30 s, recovery", "tessera-e2e", Some("origin_gone"), ""),
    ("fault storm: 30% of origin requests fail (guest reads, warm)", "tessera-e2e", Some("fault_storm"), ""),
    (
        "registry tokens expiring during serve and warm",
        "tessera-e2e",
        Some("registry_store"),
        "bearer_token_push_asks",
    ),
    ("format fixtures: golden bytes, truncations, bit flips", "tessera-fuzz", Some("formats"), ""),
    (
        "soak: 64 daemons, one cache dir, --mem-cache 64M, 20 ms origin, 10 min",
        "tessera-e2e",
        Some("soak"),
        "",
    ),
    ("in-flight area: bookkeeping, recovery, chain walk", "tessera-vhost", None, "inflight::"),
    (
        "kill -9 ×20 + 10 SIGTERM restarts under a QEMU guest's reads (reconnect)",
        "tessera-e2e",
        Some("daemon_restart"),
        "kill_9_under_guest_reads",
    ),
];

/// Run every row (e2e rows against the freshly built binary, one test at a time).
pub fn run(cargo: impl Fn() -> Command, bin: &std::path::Path) -> Result<()> {
    let mut rows = Vec::new();
    let built = cargo().args(["build", "-p", "tessera-cli"]).status()?.success();
    for &(scenario, package, test, filter) in MATRIX {
        let mut c = cargo();
        c.args(["test", "-p", package]);
        match test {
            Some(t) => c.args(["--test", t]),
            None => c.arg("--lib"),
        };
        c.args(["--", "--test-threads=1", "--nocapture"]);
        if !filter.is_empty() {
            c.arg(filter);
        }
        c.env("TESSERA_BIN", bin);
        c.envs(FULL.iter().copied());
        eprintln!("\n==> reliability: {scenario}");
        let t = Instant::now();
        let ok = (built || package != "tessera-e2e") && c.status()?.success();
        rows.push((scenario, ok, t.elapsed()));
    }
    eprintln!("\n==> reliability matrix (details: docs/reliability.md):");
    for (scenario, ok, d) in &rows {
        eprintln!("  {} {:>5.0}s  {scenario}", if *ok { "ok    " } else { "FAILED" }, d.as_secs_f64());
    }
    let failed = rows.iter().filter(|r| !r.1).count();
    if failed > 0 {
        bail!("{failed} scenario(s) failed");
    }
    Ok(())
}
