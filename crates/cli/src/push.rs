//! `tessera push`: publish an image to a registry as a Tessera artifact.

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::HumanBytes;
use serde::Serialize;
use tessera_builder::Progress;
use tessera_registry::{Client, Reference};
use tessera_store::{push_image, PushOptions, PushTarget, ReadStore, StoreLocation};

use crate::progress::Bar;
use crate::UsageError;

/// Publish an image to an OCI registry; prints what was done.
#[derive(Debug, Args)]
#[command(after_help = "The image is pushed as an OCI artifact (artifactType \
application/vnd.tessera.image.v1): its config is the image entry, its layers the record, metadata \
prefix, pack index, profile, provenance and packs (docs/formats/registry.md). It is tagged TAG and \
sha256-<id hex>, so `--store docker://HOST/REPO` finds it by tag and by ID.\n\
\n\
Blobs the repository already has are skipped; blobs in another repository of the same registry \
(the source store's, when it is one, and each --mount-from) are mounted, not uploaded; the rest are \
uploaded, big packs in 16 MiB pieces. A second push of the same image uploads nothing. Blobs go \
first, then the manifest, so a tag never names an incomplete image.\n\
\n\
stdout: one line saying what was done (or one JSON object with --json: id, repository, tags, \
manifest, blobs, total_bytes, uploaded, uploaded_bytes, mounted, present, tags_written).\n\
Registries: bearer tokens or basic auth; credentials from --creds, REGISTRY_AUTH_FILE or \
~/.docker/config.json; HTTPS unless --insecure or the registry is on loopback.\n\
\n\
Examples:\n  tessera push web --store ./store docker://registry.example.com/team/web:v1 --creds bot:s3cret\n  \
tessera push sha256:3f1c... --store ./store docker://127.0.0.1:5000/images:latest --json\n  \
tessera push web --store docker://127.0.0.1:5000/staging docker://127.0.0.1:5000/prod:web   # mounts\n  \
tessera export web --store docker://127.0.0.1:5000/prod -o web.img")]
pub struct PushArgs {
    /// The image: sha256:<64 hex> or a tag.
    image: String,
    /// The store holding it: PATH, file://PATH, http(s)://… or docker://HOST[:PORT]/REPO.
    #[arg(long, value_parser = crate::parse_store)]
    store: StoreLocation,
    /// Where to push: docker://HOST[:PORT]/REPO:TAG.
    #[arg(value_name = "docker://HOST[:PORT]/REPO:TAG")]
    destination: String,
    /// For the destination and a remote --store alike.
    #[command(flatten)]
    origin: crate::origin_args::OriginArgs,
    /// Another repository of the destination registry that may hold the blobs (repeatable):
    /// blobs found there are mounted instead of uploaded.
    #[arg(long, value_name = "REPO")]
    mount_from: Vec<String>,
    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    json: bool,
}

/// The `push --json` document.
#[derive(Debug, Serialize)]
struct PushJson {
    id: String,
    repository: String,
    tags: Vec<String>,
    manifest: String,
    blobs: usize,
    total_bytes: u64,
    uploaded: usize,
    uploaded_bytes: u64,
    mounted: usize,
    present: usize,
    tags_written: usize,
    /// The source image manifest a `--reference-layers` image refers to, when pushed to its
    /// source repository (then found by `@sha256:<that digest>`).
    subject: Option<String>,
    /// Whether the registry indexed the subject itself (referrers API) rather than through
    /// the `sha256-<hex>` tag fallback.
    subject_indexed: bool,
}

/// `docker://HOST[:PORT]/REPO:TAG` → the reference (tag required, no digest).
fn parse_destination(text: &str) -> Result<Reference> {
    let rest = text.strip_prefix("docker://").ok_or_else(|| {
        UsageError(format!("{text:?}: the destination must be docker://HOST[:PORT]/REPO:TAG"))
    })?;
    let r = Reference::parse(rest).map_err(|e| UsageError(crate::error_text(e)))?;
    if r.digest.is_some() || r.tag.is_none() {
        bail!(UsageError(format!(
            "{text:?}: the destination must name a tag (docker://HOST[:PORT]/REPO:TAG)"
        )));
    }
    Ok(r)
}

pub fn push(args: PushArgs) -> Result<()> {
    let dest = parse_destination(&args.destination)?;
    let tag = dest.tag.clone().unwrap_or_default();
    let origins = args.origin.options()?;
    let options = origins.registry.clone();
    let client = Client::for_reference(&dest, options.clone());
    let location = &args.store;
    let mut mount_from = args.mount_from.clone();
    let source: std::sync::Arc<dyn ReadStore> = match &location {
        StoreLocation::Registry(_) => {
            let store = location.open_registry(options)?;
            if store.registry() == client.registry() {
                // Same registry: the shared client reuses the connection and tokens, and the
                // source repository is the first place to mount from.
                mount_from.insert(0, store.repository().to_owned());
                std::sync::Arc::new(tessera_store::RegistryStore::with_client(
                    client.clone(),
                    store.repository(),
                ))
            } else {
                let source = args.origin.for_source(location, client.registry()).registry();
                std::sync::Arc::new(location.open_registry(source)?)
            }
        }
        _ => location.open_read_store(&origins, None)?.store,
    };
    let id = source.resolve(&args.image)?;
    let target = PushTarget { client, repo: dest.repository.clone(), tag };
    let bar = Bar::new("pushing");
    let mut started = false;
    let report = push_image(
        source.as_ref(),
        &id,
        &target,
        &PushOptions { mount_from, ..PushOptions::default() },
        &mut |p| {
            if !started {
                bar.start(p.total_bytes);
                started = true;
            }
            bar.set_position(p.done_bytes);
        },
    )
    .with_context(|| format!("pushing {id} from {} to {}", source.describe(), args.destination))?;
    bar.finish();
    let repository = format!("{}/{}", dest.registry, dest.repository);
    if args.json {
        let doc = PushJson {
            id: report.id.to_string(),
            repository,
            tags: report.tags.clone(),
            manifest: report.manifest.to_string(),
            blobs: report.blobs,
            total_bytes: report.total_bytes,
            uploaded: report.uploaded,
            uploaded_bytes: report.uploaded_bytes,
            mounted: report.mounted,
            present: report.present,
            tags_written: report.tags_written,
            subject: report.subject.map(|(d, _)| d.to_string()),
            subject_indexed: report.subject.is_some_and(|(_, indexed)| indexed),
        };
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        println!(
            "pushed {} to {repository}:{} (manifest {}; {} blobs, {}: {} uploaded ({}), {} mounted, {} already there)",
            report.id,
            target.tag,
            report.manifest,
            report.blobs,
            HumanBytes(report.total_bytes),
            report.uploaded,
            HumanBytes(report.uploaded_bytes),
            report.mounted,
            report.present
        );
        if let Some((subject, indexed)) = report.subject {
            let how = if indexed { "the referrers API" } else { "the tag fallback" };
            println!("refers to source manifest {subject} (found as @{subject}, through {how})");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations() {
        let r = parse_destination("docker://127.0.0.1:5000/team/app:v1").unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str(), r.tag.as_deref()),
            ("127.0.0.1:5000", "team/app", Some("v1"))
        );
        for bad in [
            "127.0.0.1:5000/app:v1",
            "docker://127.0.0.1:5000/app",
            "docker://h/app@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "docker://h/App:v1",
        ] {
            let e = parse_destination(bad).unwrap_err();
            assert!(e.chain().any(|c| c.is::<UsageError>()), "{bad}: {e}");
        }
    }
}
