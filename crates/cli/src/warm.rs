//! `tessera warm`: fill the host disk cache with an image before VMs need it.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::Args;
use indicatif::HumanBytes;
use serde::Serialize;
use tessera_builder::Progress;
use tessera_engine::{warm, WarmOptions, WarmReport, DEFAULT_WARM_JOBS};
use tessera_store::{CachedStore, DiskCache, HttpStore, Origin, RegistryStore, S3Store, StoreLocation};

use crate::cache_args::CacheArgs;
use crate::progress::Bar;
use crate::UsageError;

/// Fill a host disk cache with an image (all of it, or the chunks of its prefetch profile).
#[derive(Debug, Args)]
#[command(after_help = "Fetches the image's metadata (tag lookup, entry, record, metadata prefix, pack \
index, profile) and its chunks into --cache-dir, so that `tessera serve --cache-dir DIR` and \
`export` serve the image with the origin unreachable. With --profile-only, only the chunks of the \
image's prefetch profile (`tessera profile`), in profile order; the image must have one.\n\
\n\
Idempotent and resumable: a chunk already in the cache (verified) is not fetched again, each \
fetched chunk is published atomically, and concurrent warms and daemons sharing the cache fetch \
each chunk once. A second run asks the origin only for the tag and the image entry (they may \
change), never for data. A progress bar is drawn on a terminal.\n\
\n\
stdout: one summary line, or with --json one object: image, profile_only, chunks, bytes (stored, \
i.e. compressed), present_chunks, present_bytes (already cached), fetched_chunks, fetched_bytes, \
failed_chunks, failed (chunk ids), seconds, fetched_bytes_per_second. Exit status 1 if any chunk \
failed (the others are cached).\n\
\n\
Examples:\n  tessera warm web --store https://cdn.example/tessera --cache-dir /var/cache/tessera\n  \
tessera warm web --store http://10.0.0.5:8080/store --cache-dir /var/cache/tessera --profile-only --json\n  \
tessera warm sha256:3f1c... --store docker://registry.example/team/web --cache-dir /var/cache/tessera --jobs 16")]
pub struct WarmArgs {
    /// The image: sha256:<64 hex> or a tag.
    image: String,
    /// The remote store holding it: http(s)://HOST[:PORT][/PREFIX], docker://HOST[:PORT]/REPO
    /// or s3://BUCKET[/PREFIX].
    /// (A local store is read directly and needs no cache.)
    #[arg(long, value_parser = crate::parse_store)]
    store: StoreLocation,
    #[command(flatten)]
    cache: CacheArgs,
    #[command(flatten)]
    origin: crate::origin_args::OriginArgs,
    /// Only the chunks of the image's prefetch profile.
    #[arg(long)]
    profile_only: bool,
    /// Chunk fetches in flight at once (1 to 256).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_WARM_JOBS, value_parser = parse_jobs)]
    jobs: usize,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
}

fn parse_jobs(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=256).contains(&n) => Ok(n),
        _ => Err(format!("{s}: expected a number of jobs from 1 to 256")),
    }
}

/// The `--json` summary.
#[derive(Debug, Serialize)]
struct Summary {
    image: String,
    profile_only: bool,
    chunks: u64,
    bytes: u64,
    present_chunks: u64,
    present_bytes: u64,
    fetched_chunks: u64,
    fetched_bytes: u64,
    failed_chunks: u64,
    failed: Vec<String>,
    seconds: f64,
    fetched_bytes_per_second: f64,
}

pub fn run(args: WarmArgs) -> Result<()> {
    let Some(config) = args.cache.config() else {
        bail!(UsageError("tessera warm needs --cache-dir DIR: the cache to fill".into()));
    };
    let options = WarmOptions { profile_only: args.profile_only, jobs: args.jobs };
    let report = match &args.store {
        StoreLocation::Local(path) => bail!(UsageError(format!(
            "store {}: a local store is read directly and needs no cache; warm an http(s)://, docker:// or s3:// store",
            path.display()
        ))),
        StoreLocation::Http(url) => {
            let origin = HttpStore::new(url, args.origin.options()?.http);
            warm_with(CachedStore::new(origin, DiskCache::open(&config)?), &args.image, options)?
        }
        StoreLocation::Registry(repo) => {
            let origin = RegistryStore::new(repo, args.origin.registry())?;
            warm_with(CachedStore::new(origin, DiskCache::open(&config)?), &args.image, options)?
        }
        StoreLocation::S3(location) => {
            let o = args.origin.options()?;
            let cache = DiskCache::open(&config)?;
            let origin = S3Store::new(location, &o.s3, o.http, Some(cache.clone()));
            warm_with(CachedStore::new(origin, cache), &args.image, options)?
        }
    };
    if let Some(max) = config.max_bytes.filter(|&max| report.bytes > max) {
        // The cache keeps the most recently used entries within its bound: part of what was just
        // warmed has been evicted again.
        tracing::warn!(
            "the image's chunks ({}) exceed --cache-size ({}): only the most recently warmed fit",
            HumanBytes(report.bytes),
            HumanBytes(max)
        );
    }
    let seconds = report.elapsed.as_secs_f64();
    let summary = Summary {
        image: report.image.to_string(),
        profile_only: args.profile_only,
        chunks: report.chunks,
        bytes: report.bytes,
        present_chunks: report.present_chunks,
        present_bytes: report.present_bytes,
        fetched_chunks: report.fetched_chunks,
        fetched_bytes: report.fetched_bytes,
        failed_chunks: report.failed.len() as u64,
        failed: report.failed.iter().map(|f| f.chunk.to_hex()).collect(),
        seconds,
        fetched_bytes_per_second: if seconds > 0.0 { report.fetched_bytes as f64 / seconds } else { 0.0 },
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        println!(
            "{}: {} chunks, {} ({} present, {} fetched: {} in {:.1?}, {}/s), {} failed",
            summary.image,
            summary.chunks,
            HumanBytes(summary.bytes),
            summary.present_chunks,
            summary.fetched_chunks,
            HumanBytes(summary.fetched_bytes),
            Duration::from_secs_f64(seconds),
            HumanBytes(summary.fetched_bytes_per_second as u64),
            summary.failed_chunks
        );
    }
    if let Some(first) = report.failed.first() {
        bail!(
            "{} of {} chunks could not be warmed; first: {}",
            report.failed.len(),
            report.chunks,
            first.error
        );
    }
    Ok(())
}

fn warm_with<O: Origin + 'static>(
    store: CachedStore<O>,
    image: &str,
    options: WarmOptions,
) -> Result<WarmReport> {
    let bar = Bar::new("warming");
    let report =
        warm(&Arc::new(store), image, options, &|total| bar.start(total), &|bytes| bar.advance(bytes))?;
    bar.finish();
    Ok(report)
}
