//! `tessera cache …`: maintenance of a host disk cache.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use indicatif::HumanBytes;
use serde::Serialize;
use tessera_store::{CacheConfig, DiskCache, GcReport};

/// Maintain a host disk cache (--cache-dir of serve, export, inspect, warm).
#[derive(Debug, Args)]
pub struct CacheCmd {
    #[command(subcommand)]
    command: CacheCommand,
}

#[derive(Debug, Subcommand)]
enum CacheCommand {
    Gc(GcArgs),
}

/// Check every cache entry, remove what crashes and corruption left, and trim to a size.
#[derive(Debug, Args)]
#[command(after_help = "What gc does, in order (safe while daemons use the cache):\n  \
1. removes temp files of writers that died before publishing, and lock files nobody holds;\n  \
2. reads every entry and checks it (blobs against their sha256, chunks against their blake3 id, \
image entries and tags against their format); corrupt entries and files that are not entries are \
removed (a later read refetches them from the origin);\n  \
3. rebuilds the index (DIR/v1/index) from the directory, keeping the known recency order;\n  \
4. with --cache-size, evicts least recently used entries until the cache fits: chunks first, \
image metadata (records, prefixes, pack indexes, entries, tags) only when no chunk is left.\n\
\n\
It prints what it freed (human-readable sizes); --json prints one object (keys in docs/cache.md).\n\
\n\
Examples:\n  tessera cache gc --cache-dir /var/cache/tessera\n  \
tessera cache gc --cache-dir /var/cache/tessera --cache-size 20G\n  \
tessera cache gc --cache-dir /var/cache/tessera --cache-size 512MiB --json | jq .freed_bytes")]
pub struct GcArgs {
    /// The cache directory (as given to --cache-dir of the other commands).
    #[arg(long, value_name = "DIR")]
    cache_dir: PathBuf,
    /// Trim the cache to at most SIZE bytes (e.g. 512M, 20G, 1TiB). Default: no trimming.
    #[arg(long, value_name = "SIZE", value_parser = crate::parse_size_arg)]
    cache_size: Option<u64>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// The `cache gc --json` document (docs/cache.md).
#[derive(Debug, Serialize)]
struct GcJson {
    cache_dir: String,
    cache_size: Option<u64>,
    entries_before: u64,
    bytes_before: u64,
    temp_files: u64,
    temp_bytes: u64,
    lock_files: u64,
    corrupt_entries: u64,
    corrupt_bytes: u64,
    unknown_files: u64,
    unknown_bytes: u64,
    evicted_entries: u64,
    evicted_bytes: u64,
    freed_bytes: u64,
    entries_after: u64,
    bytes_after: u64,
}

pub fn run(cmd: CacheCmd) -> Result<()> {
    match cmd.command {
        CacheCommand::Gc(a) => gc(a),
    }
}

fn gc(args: GcArgs) -> Result<()> {
    anyhow::ensure!(
        args.cache_dir.is_dir(),
        "{} is not a directory (no cache to collect)",
        args.cache_dir.display()
    );
    // Opened unbounded: trimming is gc's last step, after the corrupt entries are gone.
    let cache = DiskCache::open(&CacheConfig::new(&args.cache_dir))?;
    let r: GcReport = cache
        .gc(args.cache_size)
        .with_context(|| format!("collecting the cache {}", args.cache_dir.display()))?;
    if args.json {
        let doc = GcJson {
            cache_dir: args.cache_dir.display().to_string(),
            cache_size: args.cache_size,
            entries_before: r.entries_before,
            bytes_before: r.bytes_before,
            temp_files: r.temp_files,
            temp_bytes: r.temp_bytes,
            lock_files: r.lock_files,
            corrupt_entries: r.corrupt_entries,
            corrupt_bytes: r.corrupt_bytes,
            unknown_files: r.unknown_files,
            unknown_bytes: r.unknown_bytes,
            evicted_entries: r.evicted_entries,
            evicted_bytes: r.evicted_bytes,
            freed_bytes: r.freed_bytes(),
            entries_after: r.entries_after,
            bytes_after: r.bytes_after,
        };
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    println!("Freed      {}", HumanBytes(r.freed_bytes()));
    println!("  evicted  {} in {} entries", HumanBytes(r.evicted_bytes), r.evicted_entries);
    println!("  corrupt  {} in {} entries", HumanBytes(r.corrupt_bytes), r.corrupt_entries);
    println!("  foreign  {} in {} files", HumanBytes(r.unknown_bytes), r.unknown_files);
    println!(
        "  leftover {} in {} temp files; {} lock files",
        HumanBytes(r.temp_bytes),
        r.temp_files,
        r.lock_files
    );
    let bound =
        args.cache_size.map_or_else(|| "unbounded".to_owned(), |b| format!("bound {}", HumanBytes(b)));
    println!(
        "Cache      {} in {} entries ({bound}; was {})",
        HumanBytes(r.bytes_after),
        r.entries_after,
        HumanBytes(r.bytes_before)
    );
    Ok(())
}
