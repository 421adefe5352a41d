//! The subcommands: typed arguments in, results on stdout, errors with context out.

use std::collections::BTreeSet;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use indicatif::HumanBytes;
use serde::Serialize;
use tessera_builder::source::SourceSpec;
use tessera_builder::Progress;
use tessera_builder::{BuildConfig, BuildError};
use tessera_engine::{export_raw, ExportError, ExportOptions, FetchLimits, MemTier};
use tessera_ext4::SizePolicy;
use tessera_image::{AnyPackIndex, ImageId, ImageRecord, RuntimeConfig};
use tessera_store::{read_profile, ImageReader, ReadStore, StoreError, StoreLocation};

use crate::cache_args::CacheArgs;
use crate::origin_args::OriginArgs;
use crate::progress::Bar;
use crate::{BuildArgs, ExportArgs, InspectArgs, UsageError};

/// Errors that are the caller's fault in a way the brief counts as usage (exit 2).
pub fn is_usage_error(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<StoreError>().is_some_and(StoreError::is_usage_error)
            || matches!(c.downcast_ref::<BuildError>(), Some(BuildError::Store(s)) if s.is_usage_error())
            || matches!(c.downcast_ref::<BuildError>(), Some(BuildError::Source(s)) if s.is_usage_error())
            || matches!(c.downcast_ref::<ExportError>(), Some(ExportError::Output(s)) if s.is_usage_error())
    })
}

/// Open a store for reading: a local directory or a remote origin (behind `--cache-dir` if
/// given).
fn open_store(
    store: &StoreLocation,
    origin: &OriginArgs,
    cache: &CacheArgs,
) -> Result<tessera_store::OpenedStore> {
    Ok(store.open_read_store(&origin.options()?, cache.config().as_ref())?)
}

/// `SOURCE_DATE_EPOCH` (<https://reproducible-builds.org/specs/source-date-epoch/>): a Unix time
/// in whole seconds, the build's filesystem time. Unset or empty: none. Anything else that is not
/// a non-negative integer is a usage error, never silently ignored.
pub fn source_date_epoch(value: Option<&std::ffi::OsStr>) -> Result<Option<i64>, UsageError> {
    let Some(value) = value else { return Ok(None) };
    let malformed = || {
        UsageError(format!(
            "SOURCE_DATE_EPOCH={value:?}: expected a Unix time in seconds (a non-negative integer)"
        ))
    };
    let text = value.to_str().ok_or_else(malformed)?.trim();
    if text.is_empty() {
        return Ok(None);
    }
    if !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(malformed());
    }
    text.parse::<i64>().map(Some).map_err(|_| malformed())
}

pub fn build(args: BuildArgs) -> Result<()> {
    crate::malloc::map_large_allocations();
    // The environment is read here, in the binary, and handed to the library as configuration.
    let source_date_epoch = source_date_epoch(std::env::var_os("SOURCE_DATE_EPOCH").as_deref())?;
    let mut spec = SourceSpec::parse(&args.source).map_err(|e| UsageError(crate::error_text(e)))?;
    match &mut spec {
        SourceSpec::Registry(r) => r.options = args.origin.registry(),
        _ if args.origin.any() => {
            bail!(UsageError("--ca-file, --insecure and --creds apply to docker:// sources only".into()))
        }
        _ => {}
    }
    if matches!(args.store, StoreLocation::S3(_) | StoreLocation::Registry(_)) {
        bail!(
            "store {}: build writes a local store (PATH or file://PATH); build locally, then copy the \
             image: `tessera build {} --store ./store --tag TAG && tessera copy TAG --store ./store --to {}`",
            args.store,
            args.source,
            args.store
        );
    }
    let store = args.store.open_for_write()?;
    let size = match (args.size, args.free) {
        (Some(bytes), _) => SizePolicy::Exact(bytes),
        (None, free) => SizePolicy::Free(free),
    };
    let source_ref = match &spec {
        SourceSpec::Dir(path) => format!("dir:{}", path.display()),
        _ => args.source.clone(),
    };
    let config = BuildConfig {
        chunk_size: args.chunk_size,
        size,
        inodes: args.inodes,
        source_ref,
        max_size: args.max_size,
        reference_layers: args.reference_layers,
        reread: args.reread,
        fs_time: tessera_builder::fs_time(source_date_epoch),
        release_memory: Some(crate::malloc::release_free_memory),
    };
    let bar = Bar::new("building");
    let out = tessera_builder::build_source(&spec, &args.platform, &store, &config, &bar)?;
    if let Some(tag) = &args.tag {
        store.set_ref(tag, &out.id)?;
    }
    tracing::info!(
        new_chunks = out.new_chunks,
        new_bytes = out.new_stored_bytes,
        unchanged_files = out.reused.files,
        unchanged_bytes = out.reused.bytes,
        blocks = out.record.geometry.blocks,
        "built {}",
        out.id
    );
    println!("{}", out.id);
    Ok(())
}

pub fn export(args: ExportArgs) -> Result<()> {
    let tessera_store::OpenedStore { store, local, .. } = open_store(&args.store, &args.origin, &args.cache)?;
    let id = store.resolve(&args.image)?;
    let local = match (&args.overlay, local) {
        (Some(_), None) => {
            bail!("--overlay is only supported with a local store so far (store {})", store.describe())
        }
        (_, local) => local,
    };
    let image = Arc::new(store.open_image(&id)?);
    let reader = ImageReader::new(Arc::clone(&image), store.chunk_source(&image));
    // Through the read engine: the chunks ahead of the writer are fetched in parallel, each
    // once, chunks stored back to back in one request (up to 4 MiB), so a remote store keeps
    // several large requests in flight.
    let limits = FetchLimits::for_store(local.is_none(), args.fetch_jobs.map(usize::from));
    let options = ExportOptions::default();
    let tier = MemTier::streaming(reader, 2 * options.ahead_bytes, limits)?;
    let bar = Bar::new("exporting");
    let mut started = false;
    let stats = export_raw(&image, &tier, options, &args.output, |p| {
        if !started {
            bar.start(p.total_bytes);
            started = true;
        }
        bar.set_position(p.done_bytes);
    })
    .with_context(|| format!("exporting {} to {}", id, args.output.display()))?;
    if let (Some(overlay), Some(local)) = (&args.overlay, &local) {
        crate::serve::apply_overlay(local, &id, overlay, &args.output)?;
    }
    bar.finish();
    tracing::info!(written = stats.written_bytes, device = stats.device_bytes, "exported {id}");
    Ok(())
}

/// The `inspect --json` document; keys documented in docs/inspect.md.
#[derive(Debug, Serialize)]
struct Inspect {
    id: String,
    tags: Vec<String>,
    geometry: InspectGeometry,
    files: u64,
    directories: u64,
    symlinks: u64,
    other_nodes: u64,
    inodes_used: u64,
    logical_bytes: u64,
    data_bytes: u64,
    unique_chunk_bytes: u64,
    stored_bytes: u64,
    stored_chunk_bytes: u64,
    chunks: u64,
    packs: u64,
    dedup_ratio: f64,
    compression_ratio: f64,
    prefix_bytes: u64,
    prefix_stored_bytes: u64,
    chunk_size: u32,
    has_profile: bool,
    profile: Option<InspectProfile>,
    config: InspectConfig,
}

/// The prefetch profile and how much of the image it covers.
#[derive(Debug, Serialize)]
struct InspectProfile {
    digest: String,
    traces: u32,
    min_runs: u32,
    chunks: u64,
    bytes: u64,
    percent_of_data: f64,
}

/// The normalized runtime config (empty for a directory source).
#[derive(Debug, Serialize)]
struct InspectConfig {
    env: Vec<String>,
    entrypoint: Option<Vec<String>>,
    cmd: Option<Vec<String>>,
    working_dir: String,
    user: String,
    labels: std::collections::BTreeMap<String, String>,
}

impl From<&RuntimeConfig> for InspectConfig {
    fn from(c: &RuntimeConfig) -> Self {
        Self {
            env: c.env.clone(),
            entrypoint: c.entrypoint.clone(),
            cmd: c.cmd.clone(),
            working_dir: c.working_dir.clone(),
            user: c.user.clone(),
            labels: c.labels.clone(),
        }
    }
}

#[derive(Debug, Serialize)]
struct InspectGeometry {
    block_size: u32,
    blocks: u64,
    size_bytes: u64,
    inodes: u64,
    inodes_per_group: u32,
    groups: u32,
    journal_blocks: u64,
    free_blocks: u64,
    free_inodes: u64,
    data_start_block: u64,
    data_end_block: u64,
}

impl From<&tessera_image::Geometry> for InspectGeometry {
    fn from(g: &tessera_image::Geometry) -> Self {
        Self {
            block_size: g.block_size,
            blocks: g.blocks,
            size_bytes: g.blocks * u64::from(g.block_size),
            inodes: g.inodes,
            inodes_per_group: g.inodes_per_group,
            groups: g.groups,
            journal_blocks: g.journal_blocks,
            free_blocks: g.free_blocks,
            free_inodes: g.free_inodes,
            data_start_block: g.data_start_block,
            data_end_block: g.data_end_block,
        }
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        1.0
    } else {
        a as f64 / b as f64
    }
}

pub fn inspect(args: InspectArgs) -> Result<()> {
    let store = open_store(&args.store, &args.origin, &args.cache)?.store;
    let doc = Inspect::gather(store.as_ref(), &args.image)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print!("{doc}");
    }
    Ok(())
}

impl Inspect {
    /// Everything `inspect` shows about `reference` in `store`: read and decoded, nothing printed.
    fn gather(store: &dyn ReadStore, reference: &str) -> Result<Self> {
        let id: ImageId = store.resolve(reference)?;
        let entry = store.get_entry(&id)?;
        let record = ImageRecord::decode(&store.read_blob(&entry.record)?)
            .with_context(|| format!("image {id}: decoding the record"))?;
        let index = AnyPackIndex::decode(&store.read_blob(&entry.pack_index)?)
            .with_context(|| format!("image {id}: decoding the pack index"))?;
        let tags: Vec<String> = store
            .list_refs()?
            .into_iter()
            .filter(|(_, target)| *target == id)
            .map(|(tag, _)| tag)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let g = &record.geometry;
        let s = &record.stats;
        let unique_chunk_bytes: u64 = record.block_map.chunks().iter().map(|c| u64::from(c.len)).sum();
        let stored_chunk_bytes = index.stored_bytes();
        let prefix_stored_bytes = store.blob_len(&entry.prefix)?;
        let profile = read_profile(store, &id, &entry, &record.block_map)?.map(|(digest, p)| {
            let c = p.coverage(&record.block_map);
            InspectProfile {
                digest: digest.to_string(),
                traces: p.traces(),
                min_runs: p.min_runs(),
                chunks: c.chunks,
                bytes: c.bytes,
                percent_of_data: c.percent_of_data(),
            }
        });
        Ok(Inspect {
            id: id.to_string(),
            tags,
            geometry: InspectGeometry::from(g),
            files: s.files,
            directories: s.directories,
            symlinks: s.symlinks,
            other_nodes: s.other_nodes,
            inodes_used: s.inodes_used,
            logical_bytes: s.logical_bytes,
            data_bytes: s.data_bytes,
            unique_chunk_bytes,
            stored_bytes: stored_chunk_bytes + prefix_stored_bytes,
            stored_chunk_bytes,
            chunks: record.block_map.chunks().len() as u64,
            packs: index.chunk_blobs() as u64,
            dedup_ratio: ratio(s.data_bytes, unique_chunk_bytes),
            compression_ratio: ratio(unique_chunk_bytes, stored_chunk_bytes),
            prefix_bytes: record.prefix.blocks * tessera_image::BlockSize::U64,
            prefix_stored_bytes,
            chunk_size: record.options.chunk_size,
            has_profile: entry.profile.is_some(),
            profile,
            config: InspectConfig::from(&record.config),
        })
    }
}

/// The text form of `inspect`: one labelled line per aspect.
impl std::fmt::Display for Inspect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let doc = self;
        let tags = if doc.tags.is_empty() { "-".to_owned() } else { doc.tags.join(", ") };
        writeln!(f, "Image      {}", doc.id)?;
        writeln!(f, "Tags       {tags}")?;
        writeln!(
            f,
            "Device     {} ({} blocks of 4 KiB, {} groups, journal {})",
            HumanBytes(doc.geometry.size_bytes),
            doc.geometry.blocks,
            doc.geometry.groups,
            HumanBytes(doc.geometry.journal_blocks * tessera_image::BlockSize::U64)
        )?;
        writeln!(
            f,
            "Free       {} and {} inodes",
            HumanBytes(doc.geometry.free_blocks * tessera_image::BlockSize::U64),
            doc.geometry.free_inodes
        )?;
        writeln!(
            f,
            "Contents   {} files, {} directories, {} symlinks, {} other; {} of {} inodes used",
            doc.files, doc.directories, doc.symlinks, doc.other_nodes, doc.inodes_used, doc.geometry.inodes
        )?;
        writeln!(
            f,
            "Data       {} logical, {} mapped, {} in {} unique chunks (dedup {:.2}x)",
            HumanBytes(doc.logical_bytes),
            HumanBytes(doc.data_bytes),
            HumanBytes(doc.unique_chunk_bytes),
            doc.chunks,
            doc.dedup_ratio
        )?;
        writeln!(
            f,
            "Stored     {} in {} packs (compression {:.2}x) + metadata prefix {} ({} uncompressed)",
            HumanBytes(doc.stored_chunk_bytes),
            doc.packs,
            doc.compression_ratio,
            HumanBytes(doc.prefix_stored_bytes),
            HumanBytes(doc.prefix_bytes)
        )?;
        match &doc.profile {
            Some(p) => writeln!(
                f,
                "Profile    {} chunks, {} ({:.1}% of the data) from {} traces (kept if in >= {})",
                p.chunks,
                HumanBytes(p.bytes),
                p.percent_of_data,
                p.traces,
                p.min_runs
            )?,
            None => writeln!(f, "Profile    none")?,
        }
        let c = &doc.config;
        let list = |v: &Option<Vec<String>>| match v {
            Some(v) => serde_json::to_string(v).unwrap_or_default(),
            None => "-".to_owned(),
        };
        let or_dash = |s: &str| if s.is_empty() { "-".to_owned() } else { s.to_owned() };
        writeln!(f, "Entrypoint {}", list(&c.entrypoint))?;
        writeln!(f, "Cmd        {}", list(&c.cmd))?;
        writeln!(f, "WorkingDir {}", or_dash(&c.working_dir))?;
        writeln!(f, "User       {}", or_dash(&c.user))?;
        for (i, e) in c.env.iter().enumerate() {
            writeln!(f, "{} {e}", if i == 0 { "Env       " } else { "          " })?;
        }
        for (i, (k, v)) in c.labels.iter().enumerate() {
            writeln!(f, "{} {k}={v}", if i == 0 { "Labels    " } else { "          " })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;

    use super::*;

    #[test]
    fn source_date_epoch_is_an_integer_or_a_usage_error() {
        let sde = |v: &str| source_date_epoch(Some(OsStr::new(v)));
        assert_eq!(source_date_epoch(None).unwrap(), None);
        assert_eq!(sde("").unwrap(), None);
        assert_eq!(sde("0").unwrap(), Some(0));
        assert_eq!(sde("1700000000").unwrap(), Some(1_700_000_000));
        assert_eq!(sde(" 1700000000\n").unwrap(), Some(1_700_000_000));
        for bad in ["-1", "+5", "1.5", "1e9", "yesterday", "0x10", "99999999999999999999"] {
            let e = sde(bad).unwrap_err();
            assert!(e.0.contains("SOURCE_DATE_EPOCH") && e.0.contains(bad), "{bad}: {e}");
        }
    }
}
