//! `tessera warm`: fill the host disk cache with an image before VMs need it.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::HumanBytes;
use serde::Serialize;
use tessera_builder::Progress;
use tessera_engine::{warm, WarmOptions, WarmReport, DEFAULT_WARM_JOBS};
use tessera_image::ImageId;
use tessera_metrics::IntGauge;
use tessera_store::{
    CachedStore, DiskCache, HttpStore, Origin, OriginOptions, RegistryStore, S3Store, StoreError,
    StoreLocation,
};

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
    /// At most this many stored bytes per second (e.g. 20M): a warm that leaves room on a link
    /// the host's VMs share (up to a second's worth at once, then paced). Default: no cap.
    #[arg(long, value_name = "SIZE", value_parser = parse_rate)]
    rate: Option<u64>,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
}

/// A bandwidth cap: a size per second, more than 0.
pub(crate) fn parse_rate(s: &str) -> Result<u64, String> {
    match crate::parse_size_arg(s)? {
        0 => Err(format!("{s}: a rate of 0 would never finish; give bytes per second, e.g. 20M")),
        n => Ok(n),
    }
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
    let options = WarmOptions { profile_only: args.profile_only, jobs: args.jobs, rate: args.rate };
    if let StoreLocation::Local(path) = &args.store {
        bail!(UsageError(format!(
            "store {}: a local store is read directly and needs no cache; warm an http(s)://, docker:// or s3:// store",
            path.display()
        )));
    }
    let bar = Bar::new("warming");
    let report = warm_location(
        &args.store,
        &args.origin.options()?,
        DiskCache::open(&config)?,
        &args.image,
        options,
        &|total| bar.start(total),
        &|bytes| bar.advance(bytes),
    )?;
    bar.finish();
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

/// Warm `image` from the remote store at `location` (reached with `origin`'s settings) into
/// `cache`. A local store has nothing to warm: [`StoreError::Unsupported`].
fn warm_location(
    location: &StoreLocation,
    origin: &OriginOptions,
    cache: DiskCache,
    image: &str,
    options: WarmOptions,
    start: &(dyn Fn(u64) + Sync),
    progress: &dyn Fn(u64),
) -> Result<WarmReport, StoreError> {
    fn with<O: Origin + 'static>(
        origin: O,
        cache: DiskCache,
        trust: tessera_store::CacheTrust,
        image: &str,
        options: WarmOptions,
        start: &(dyn Fn(u64) + Sync),
        progress: &dyn Fn(u64),
    ) -> Result<WarmReport, StoreError> {
        let store = Arc::new(CachedStore::new(origin, cache).with_trust(trust));
        warm(&store, image, options, start, progress)
    }
    let trust = origin.trust;
    match location {
        StoreLocation::Local(_) => {
            Err(StoreError::Unsupported { location: location.to_string(), kind: "local" })
        }
        StoreLocation::Http(url) => {
            let o = HttpStore::new(url, origin.http.clone());
            with(o, cache, trust, image, options, start, progress)
        }
        StoreLocation::Registry(repo) => {
            let o = RegistryStore::new(repo, origin.registry.clone())?;
            with(o, cache, trust, image, options, start, progress)
        }
        StoreLocation::S3(l) => {
            let o = S3Store::new(l, &origin.s3, origin.http.clone(), Some(cache.clone()));
            with(o, cache, trust, image, options, start, progress)
        }
    }
}

/// `serve --fill-cache`: warm image `id` into `cache` on a thread of its own with `options`
/// (requests at a time, bandwidth cap), once `start` returns; `target` and `done` gauges show
/// its progress (stored bytes). Logs what it did; a failure costs nothing but the fill (the
/// daemon fetches on demand as without it).
pub fn fill_in_background(
    location: StoreLocation,
    origin: OriginOptions,
    cache: DiskCache,
    id: ImageId,
    options: WarmOptions,
    start: impl FnOnce() + Send + 'static,
    (target, done): (IntGauge, IntGauge),
) -> Result<()> {
    let jobs = options.jobs;
    std::thread::Builder::new()
        .name("cache-fill".into())
        .spawn(move || {
            start();
            tracing::info!(image = %id, jobs, rate = ?options.rate, "filling the disk cache with the image in the background");
            let on_total = |bytes: u64| target.set(i64::try_from(bytes).unwrap_or(i64::MAX));
            let on_done = |bytes: u64| done.add(i64::try_from(bytes).unwrap_or(i64::MAX));
            match warm_location(&location, &origin, cache, &id.to_string(), options, &on_total, &on_done) {
                Ok(r) => tracing::info!(
                    chunks = r.chunks,
                    present = r.present_chunks,
                    fetched = r.fetched_chunks,
                    fetched_bytes = r.fetched_bytes,
                    failed = r.failed.len(),
                    seconds = r.elapsed.as_secs_f64(),
                    "disk cache filled ({} fetched in {:.1?})",
                    HumanBytes(r.fetched_bytes),
                    r.elapsed
                ),
                Err(e) => tracing::warn!(error = %crate::error_text(e), "the background fill stopped"),
            }
        })
        .context("starting the cache-fill thread")?;
    Ok(())
}
