//! `tessera copy`: replicate an image between stores.

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::HumanBytes;
use serde::Serialize;
use tessera_builder::Progress;
use tessera_image::validate_tag;
use tessera_registry::{Client, Reference};
use tessera_store::{copy_image, push_image, PushOptions, PushTarget, StoreError, StoreLocation};

use crate::cache_args::CacheArgs;
use crate::progress::Bar;
use crate::UsageError;

/// Replicate an image (with its pack index, packs, profile and provenance) to another store.
#[derive(Debug, Args)]
#[command(after_help = "Copies the image's blobs (packs, pack index, metadata prefix, record, \
provenance, profile), then its image entry, then — when IMAGE is a tag — the tag, in the store's \
write order: an interrupted copy leaves only unreferenced blobs, and a rerun skips the blobs the \
destination already has. Every blob is checked against its digest on the way.\n\
\n\
SRC is any readable store (PATH, file://, http(s)://, docker://, s3://). DST is a local store \
(created if missing), s3://BUCKET[/PREFIX] (objects already there are skipped after a HEAD; packs \
larger than one part go up as multipart uploads, and a rerun resumes an upload an interrupted copy left unfinished, keeping the parts whose MD5 matches; credentials and endpoint as for every s3:// store: \
AWS_* variables or ~/.aws/credentials, --s3-endpoint or AWS_ENDPOINT_URL) or \
docker://HOST[:PORT]/REPO, where the image is pushed as `tessera push` does, tagged \
with IMAGE's tag (or sha256-<id hex> when IMAGE is an ID). An http(s):// store is read-only: publish \
a local copy with any static file server.\n\
\n\
stdout: one summary line, or with --json one object: id, destination, tag, blobs, total_bytes, \
copied, copied_bytes (bytes sent), resumed_bytes (bytes an interrupted copy had sent, kept), present.\n\
\n\
Examples:\n  tessera copy web --store ./build-store --to /srv/origin/store\n  \
tessera copy web --store https://cdn.example/tessera --to ./mirror --cache-dir /var/cache/tessera\n  \
tessera copy web --store ./build-store --to docker://127.0.0.1:5000/images\n  \
tessera copy web --store ./build-store --to s3://images/tessera --s3-endpoint http://127.0.0.1:9000")]
pub struct CopyArgs {
    /// The image: sha256:<64 hex> or a tag.
    image: String,
    /// The store holding it: PATH, file://PATH, http(s)://…, docker://HOST[:PORT]/REPO or
    /// s3://BUCKET[/PREFIX].
    #[arg(long, value_parser = crate::parse_store)]
    store: StoreLocation,
    /// The destination: PATH, file://PATH, docker://HOST[:PORT]/REPO or s3://BUCKET[/PREFIX].
    #[arg(long, value_name = "STORE", value_parser = crate::parse_store)]
    to: StoreLocation,
    #[command(flatten)]
    cache: CacheArgs,
    /// For a remote --store and a docker:// destination alike.
    #[command(flatten)]
    origin: crate::origin_args::OriginArgs,
    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    json: bool,
}

/// The `copy --json` document.
#[derive(Debug, Serialize)]
struct CopyJson {
    id: String,
    destination: String,
    tag: Option<String>,
    blobs: usize,
    total_bytes: u64,
    copied: usize,
    copied_bytes: u64,
    resumed_bytes: u64,
    present: usize,
}

pub fn run(args: CopyArgs) -> Result<()> {
    let dest = &args.to;
    if let StoreLocation::Http(url) = dest {
        bail!(StoreError::ReadOnlyStore { location: url.clone() });
    }
    let origins = args.origin.options()?;
    let source_args = match dest {
        StoreLocation::Registry(repo) => match Reference::parse(repo) {
            Ok(r) => args.origin.for_source(&args.store, &r.registry),
            Err(e) => bail!(UsageError(crate::error_text(e))),
        },
        _ => args.origin.clone(),
    };
    let source = args.store.open_read_store(&source_args.options()?, args.cache.config().as_ref())?.store;
    let id = source.resolve(&args.image).with_context(|| format!("store {}", source.describe()))?;
    let tag = (!args.image.starts_with("sha256:") && validate_tag(&args.image)).then(|| args.image.clone());
    let bar = Bar::new("copying");
    let mut started = false;
    let mut progress = |done: u64, total: u64| {
        if !started {
            bar.start(total);
            started = true;
        }
        bar.set_position(done);
    };
    let doc = match dest {
        StoreLocation::Registry(repo) => {
            let tag = tag.unwrap_or_else(|| format!("sha256-{}", id.digest().hex()));
            let reference =
                Reference::parse(&format!("{repo}:{tag}")).map_err(|e| UsageError(crate::error_text(e)))?;
            let target = PushTarget {
                client: Client::for_reference(&reference, origins.registry.clone()),
                repo: reference.repository,
                tag,
            };
            let report = push_image(source.as_ref(), &id, &target, &PushOptions::default(), &mut |p| {
                progress(p.done_bytes, p.total_bytes)
            })
            .with_context(|| format!("copying {id} to {}", args.to))?;
            CopyJson {
                id: id.to_string(),
                destination: args.to.to_string(),
                tag: Some(target.tag),
                blobs: report.blobs,
                total_bytes: report.total_bytes,
                copied: report.uploaded,
                copied_bytes: report.uploaded_bytes,
                resumed_bytes: 0,
                present: report.present + report.mounted,
            }
        }
        _ => {
            let report = match dest {
                StoreLocation::S3(_) => {
                    let store = dest.open_s3(&origins)?;
                    copy_image(source.as_ref(), &id, &store, tag.as_deref(), &mut progress)
                }
                _ => {
                    let store = dest.open_for_write()?;
                    copy_image(source.as_ref(), &id, &store, tag.as_deref(), &mut progress)
                }
            }
            .with_context(|| format!("copying {id} to {}", args.to))?;
            CopyJson {
                id: id.to_string(),
                destination: args.to.to_string(),
                tag: report.tag,
                blobs: report.blobs,
                total_bytes: report.total_bytes,
                copied: report.copied,
                copied_bytes: report.copied_bytes,
                resumed_bytes: report.resumed_bytes,
                present: report.present,
            }
        }
    };
    bar.finish();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        println!(
            "copied {} to {}{}: {} blobs, {}: {} copied ({}{}), {} already there",
            doc.id,
            doc.destination,
            doc.tag.as_deref().map(|t| format!(" as {t}")).unwrap_or_default(),
            doc.blobs,
            HumanBytes(doc.total_bytes),
            doc.copied,
            HumanBytes(doc.copied_bytes),
            if doc.resumed_bytes > 0 {
                format!(", {} resumed", HumanBytes(doc.resumed_bytes))
            } else {
                String::new()
            },
            doc.present
        );
    }
    Ok(())
}
