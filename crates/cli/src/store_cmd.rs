//! `tessera store …`: maintenance of a store.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use indicatif::HumanBytes;
use tessera_store::{collect_garbage, GcOptions, LocalGc, StoreGcReport, StoreLocation};

use crate::UsageError;

/// Maintain a store (--store of the other commands).
#[derive(Debug, Args)]
pub struct StoreCmd {
    #[command(subcommand)]
    command: StoreCommand,
}

#[derive(Debug, Subcommand)]
enum StoreCommand {
    Gc(GcArgs),
}

/// Remove the images, tags and blobs that no tag or pinned image needs.
#[derive(Debug, Args)]
#[command(after_help = "Mark and sweep (docs/store.md, \"Garbage collection\"):\n  \
live: every tag's image, every image pinned by a running `tessera serve`, every image entry \
younger than the grace (a build writes its entry before its tag), with --keep-untagged every \
image; their record, prefix, pack index, profile, provenance and the packs (or, for \
--reference-layers images, the layer blobs) their pack index names; the layer records (build \
cache) of layers a live image was built from.\n  \
removed: everything else older than the grace — untagged images, tags of missing images, layer \
records, then blobs (packs, prefixes, pack indexes, profiles, …), in that order, so an \
interrupted gc leaves a valid store.\n\
\n\
Concurrent writers: on a local store, builds, copies and profiles wait while gc runs and gc waits \
for them, so any grace (even 0) is safe on one host; the grace protects writers that do not take \
the store's lock (another host on a shared filesystem). An s3:// store has no lock: the grace \
must be at least 10m there. http(s):// stores are read-only (exit 2).\n\
\n\
docker://HOST/REPO stores: gc deletes the manifests (and so the tags) of dead Tessera images — \
those only their ID tag names, that no live referrers list finds — and prunes the referrers \
fallback indexes; the registry's own garbage collection then frees the blobs. Registries keep no \
times, so gc records in the repository (tag tessera-gc-marks) when it first found each image \
dead, and deletes it on a later run at least the grace after that (--grace 0: at once). Other \
manifests are never touched. The registry must allow deletes (distribution: \
REGISTRY_STORAGE_DELETE_ENABLED=true).\n\
\n\
DURATION: 0, or numbers with units s, m, h, d (90s, 10m, 1h30m, 7d).\n\
stdout: what was removed and kept (human-readable sizes), or with --json one object (keys in \
docs/store.md). Exit status: 0 done (also when nothing was removed), 1 failure (nothing is \
removed when a live image's entry or pack index cannot be read), 2 usage error.\n\
\n\
Examples:\n  tessera store gc --store ./store --dry-run\n  tessera store gc --store ./store --grace 0\n  \
tessera store gc --store /var/lib/tessera --grace 7d --json | jq .removed_total.bytes\n  \
tessera store gc --store s3://images/tessera --s3-endpoint http://127.0.0.1:9000 --grace 1h\n  \
tessera store gc --store docker://registry.example:5000/app --grace 1d   # daily, from CI")]
pub struct GcArgs {
    /// The store: PATH, file://PATH, s3://BUCKET[/PREFIX] or docker://HOST[:PORT]/REPO.
    #[arg(long, value_parser = crate::parse_store)]
    store: StoreLocation,
    /// Never remove what is younger than this.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "1h")]
    grace: Duration,
    /// Say what would be removed; remove nothing.
    #[arg(long)]
    dry_run: bool,
    /// Keep every image that has an entry, tagged or not (remove only unreferenced objects).
    #[arg(long)]
    keep_untagged: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// For s3:// and docker:// stores.
    #[command(flatten)]
    origin: crate::origin_args::OriginArgs,
}

/// `0`, or `<n><unit>…` with units s, m, h, d.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?}: expected a duration such as 0, 90s, 10m, 1h30m or 7d");
    let text = s.trim();
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    let mut total: u64 = 0;
    let mut digits = String::new();
    for c in text.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let unit = match c {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' => 86_400,
            _ => return Err(bad()),
        };
        let n: u64 = digits.parse().map_err(|_| bad())?;
        total = n.checked_mul(unit).and_then(|v| total.checked_add(v)).ok_or_else(bad)?;
        digits.clear();
    }
    if !digits.is_empty() || text.is_empty() {
        return Err(bad());
    }
    Ok(Duration::from_secs(total))
}

fn human_duration(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0 => "0".into(),
        s if s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if s % 3600 == 0 => format!("{}h", s / 3600),
        s if s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

pub fn run(cmd: StoreCmd) -> Result<()> {
    match cmd.command {
        StoreCommand::Gc(a) => gc(a),
    }
}

fn gc(args: GcArgs) -> Result<()> {
    let options = GcOptions {
        grace: args.grace,
        dry_run: args.dry_run,
        keep_untagged: args.keep_untagged,
        now: std::time::SystemTime::now(),
    };
    let report = match &args.store {
        StoreLocation::Local(path) => {
            if args.origin.any() {
                bail!(UsageError("--ca-file, --insecure and --creds apply to remote stores only".into()));
            }
            let mut backend = LocalGc::open(path, args.dry_run)?;
            collect_garbage(&mut backend, &options)
        }
        StoreLocation::S3(_) => {
            let store = args.store.open_s3(&args.origin.options()?)?;
            let mut backend = tessera_store::S3Gc::new(store);
            collect_garbage(&mut backend, &options)
        }
        StoreLocation::Http(url) => {
            bail!(UsageError(format!("store {url} is read-only: http(s) stores cannot be collected")))
        }
        StoreLocation::Registry(repo) => {
            let store = tessera_store::RegistryStore::new(repo, args.origin.registry())?;
            tessera_store::collect_registry(&store, &options)
        }
    }
    .with_context(|| format!("collecting store {}", args.store))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    print_report(&report, args.grace);
    Ok(())
}

fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

fn print_report(r: &StoreGcReport, grace: Duration) {
    let verb = if r.dry_run { "Would remove" } else { "Removed" };
    let blobs: u64 = r
        .removed
        .iter()
        .filter(|(k, _)| !matches!(**k, "image" | "tag" | "layer-record"))
        .map(|(_, t)| t.count)
        .sum();
    println!(
        "{verb} {}, {}, {}: {}",
        plural(r.images_removed, "image", "images"),
        plural(r.tags_removed, "tag", "tags"),
        plural(blobs, "blob", "blobs"),
        HumanBytes(r.removed_total.bytes)
    );
    for (kind, t) in &r.removed {
        println!("  {kind:<15} {:>10} in {}", HumanBytes(t.bytes).to_string(), t.count);
    }
    println!(
        "Kept {} ({} pinned), {}, {} of live blobs in {}",
        plural(r.images_kept, "image", "images"),
        r.images_pinned,
        plural(r.tags_kept, "tag", "tags"),
        HumanBytes(r.live.bytes),
        r.live.count
    );
    if let Some(released) = r.released.filter(|t| t.count > 0) {
        println!(
            "  {} only the removed images named: {} (the registry's own garbage collection frees them)",
            plural(released.count, "blob", "blobs"),
            HumanBytes(released.bytes)
        );
    }
    if r.released.is_some() && r.young.count > 0 {
        println!(
            "  {} found dead and kept for the grace ({}): a run after that removes them",
            plural(r.young.count, "image", "images"),
            human_duration(grace)
        );
    } else if r.young.count > 0 {
        println!(
            "  and {} younger than the grace ({}): {}",
            plural(r.young.count, "unreferenced object", "unreferenced objects"),
            human_duration(grace),
            HumanBytes(r.young.bytes)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("7d").unwrap(), Duration::from_secs(7 * 86_400));
        for bad in ["", "10", "1x", "h", "1h30", "-1s", "99999999999999999999d"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert_eq!(human_duration(Duration::from_secs(600)), "10m");
        assert_eq!(human_duration(Duration::from_secs(3600)), "1h");
    }
}
