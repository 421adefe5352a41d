//! `tessera profile`: merge boot traces into a prefetch profile and attach it to the image.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::HumanBytes;
use tessera_image::{default_min_runs, Profile, Trace};
use tessera_store::{attach_profile, LocalStore, OpenImage, StoreLocation};

use crate::UsageError;

/// Merge boot traces (`tessera serve --record-trace`) into the image's prefetch profile.
#[derive(Debug, Args)]
#[command(after_help = "A chunk is kept when at least --min-runs of the traces touched it (default: \
half of them, rounded up: 1 of 1 or 2, 2 of 3 or 4, 3 of 5); chunks are ordered by the median of \
their first-touch times. Every trace must have been recorded on this image, and every chunk it \
names must belong to it, or nothing is written.\n\
\n\
The profile is stored as a blob and the image entry is replaced atomically to name it: the image \
ID and its tags do not change, and an older profile is replaced. The store must be writable (a \
local directory): to profile an image served over http(s), profile the store behind it, then \
`tessera copy` or push. stdout carries one line, the profile blob's digest.\n\
\n\
Examples:\n  tessera serve web --store ./store --socket /tmp/vm.sock --read-only --record-trace boot1.trace\n  \
tessera profile web --store ./store --trace boot1.trace\n  \
tessera profile web --store ./store --trace boot1.trace boot2.trace boot3.trace --min-runs 3\n\
\n\
Formats: docs/formats/profile.md.")]
pub struct ProfileArgs {
    /// The image: sha256:<64 hex> or a tag.
    image: String,
    /// The store holding it: PATH or file://PATH (written to).
    #[arg(long, value_parser = crate::parse_store)]
    store: StoreLocation,
    /// Trace files to merge (one per recorded run).
    #[arg(long, value_name = "FILE", num_args = 1.., required = true)]
    trace: Vec<PathBuf>,
    /// Keep chunks touched in at least N of the traces (1 to the number of traces).
    #[arg(long, value_name = "N")]
    min_runs: Option<u32>,
}

pub fn profile(args: ProfileArgs) -> Result<()> {
    let location = &args.store;
    let Some(path) = location.local_path() else {
        bail!(UsageError(format!(
            "store {}: profiles are written to a local store (PATH or file://PATH); profile the store \
             behind the origin, then copy or push it",
            args.store
        )));
    };
    let traces = args.trace.len();
    let min_runs = args.min_runs.unwrap_or_else(|| default_min_runs(traces));
    if min_runs == 0 || min_runs as usize > traces {
        bail!(UsageError(format!(
            "--min-runs {min_runs}: must be between 1 and the number of traces ({traces})"
        )));
    }
    let store = LocalStore::open(path)?;
    let id = store.resolve(&args.image)?;
    let image = OpenImage::open(&store, &id)?;
    let mut decoded = Vec::with_capacity(traces);
    for path in &args.trace {
        let bytes = std::fs::read(path).with_context(|| format!("reading trace {}", path.display()))?;
        let trace = Trace::decode(&bytes).with_context(|| format!("trace {}", path.display()))?;
        trace
            .check_against(id, &image.record().block_map)
            .with_context(|| format!("trace {}", path.display()))?;
        decoded.push(trace);
    }
    let profile = Profile::merge(id, &decoded, min_runs)?;
    let entry = attach_profile(&store, &id, &profile)?;
    let coverage = profile.coverage(&image.record().block_map);
    tracing::info!(
        chunks = coverage.chunks,
        bytes = coverage.bytes,
        traces,
        min_runs,
        "profile covers {} ({:.1}% of the data)",
        HumanBytes(coverage.bytes),
        coverage.percent_of_data()
    );
    if let Some(digest) = entry.profile {
        println!("{digest}");
    }
    Ok(())
}
