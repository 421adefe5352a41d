//! A store in an OCI registry: `docker://HOST[:PORT]/REPO` (`docs/formats/registry.md`).
//!
//! - [`RegistryStore`] reads it: a tag resolves through its manifest (a Tessera artifact, see
//!   [`crate::artifact`]) to the image entry in the manifest's config blob; an image ID resolves
//!   through the tag `sha256-<id hex>`. Whole blobs are fetched and checked against their digest;
//!   chunks are `Range` GETs on pack blobs (redirects to blob storage are followed without the
//!   registry's credentials). Auth, token refresh and retries are the registry client's.
//! - [`push_image`] writes one: every blob of an image from any [`ReadStore`] (skipped when the
//!   repository has it, mounted from another repository when possible, else uploaded with
//!   bounded memory), the entry as config, then the manifest under each tag. Used by
//!   `tessera push` (and `tessera copy` to a registry).
//!
//! Writing images into a registry store by `tessera build` is not supported: build into a local
//! store and push.

use std::collections::HashMap;
use std::io::Read;
use std::sync::{Arc, Mutex};

use tessera_image::{validate_tag, AnyPackIndex, ImageEntry, ImageId, Sha256Digest};
use tessera_registry::{
    BlobPush, Client, ClientOptions, Digest, ManifestKind, PushOptions, Reference, RegistryError, Target,
};
use tracing::{debug, info};

use crate::artifact::{
    build_manifest, id_tag, merged_referrers, parse_manifest, referrers_tag, tessera_referrers, Artifact,
    ArtifactError, Layer, Role, Subject, ARTIFACT_TYPE, INDEX_MEDIA_TYPE,
};
use crate::error::StoreError;
use crate::read_store::ReadStore;
use crate::reader::OpenImage;
use crate::source::ChunkSource;

/// Largest whole blob (record, prefix, pack index) read into memory: 1 GiB.
pub const MAX_REGISTRY_BLOB: u64 = 1 << 30;
/// Largest image entry (the config blob): 64 KiB.
const MAX_ENTRY: u64 = 64 << 10;

fn reg_digest(d: &Sha256Digest) -> Digest {
    Digest::from_raw(&d.0)
}

/// An image found in the registry: its manifest and entry.
#[derive(Debug)]
struct Found {
    artifact: Artifact,
    entry: ImageEntry,
}

struct Inner {
    client: Client,
    registry: String,
    repo: String,
    /// Images read so far, by ID.
    images: Mutex<HashMap<ImageId, Arc<Found>>>,
    /// Tags resolved through this store (a registry's tag list would also list `sha256-…`).
    seen_refs: Mutex<Vec<(String, ImageId)>>,
}

/// A registry repository holding Tessera images. Cheap to clone.
#[derive(Clone)]
pub struct RegistryStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RegistryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryStore").field("location", &self.location()).finish()
    }
}

impl RegistryStore {
    /// The store `HOST[:PORT]/REPO` (no tag or digest). Nothing is fetched yet.
    pub fn new(repository: &str, options: ClientOptions) -> Result<Self, StoreError> {
        let r = Reference::parse(repository)?;
        if r.tag.is_some() || r.digest.is_some() {
            return Err(StoreError::InvalidLocation {
                location: format!("docker://{repository}"),
                reason: "a registry store is docker://HOST[:PORT]/REPO, without a tag or digest",
            });
        }
        let client = Client::for_reference(&r, options);
        Ok(Self::with_client(client, &r.repository))
    }

    /// The store `repo` on `client`'s registry.
    pub fn with_client(client: Client, repo: &str) -> Self {
        Self {
            inner: Arc::new(Inner {
                registry: client.registry().to_owned(),
                client,
                repo: repo.to_owned(),
                images: Mutex::new(HashMap::new()),
                seen_refs: Mutex::new(Vec::new()),
            }),
        }
    }

    /// `docker://HOST[:PORT]/REPO`.
    pub fn location(&self) -> String {
        format!("docker://{}/{}", self.inner.registry, self.inner.repo)
    }

    /// The registry client.
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    /// `HOST[:PORT]`.
    pub fn registry(&self) -> &str {
        &self.inner.registry
    }

    /// The repository.
    pub fn repository(&self) -> &str {
        &self.inner.repo
    }

    fn artifact_err(&self, tag: &str, source: ArtifactError) -> StoreError {
        StoreError::Artifact { location: format!("{}:{tag}", self.location()), source }
    }

    /// The image tagged `tag` (`None` when the tag does not exist).
    fn fetch(&self, tag: &str) -> Result<Option<(ImageId, Arc<Found>)>, StoreError> {
        self.fetch_target(&Target::Tag(tag.to_owned()), tag)
    }

    /// The image whose manifest `target` names (`tag`: how to show it in messages).
    fn fetch_target(&self, target: &Target, tag: &str) -> Result<Option<(ImageId, Arc<Found>)>, StoreError> {
        let client = &self.inner.client;
        let repo = &self.inner.repo;
        let manifest = match client.get_manifest(repo, target) {
            Ok(m) => m,
            Err(RegistryError::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        if manifest.kind != ManifestKind::Image {
            return Err(self
                .artifact_err(tag, ArtifactError::WrongType(format!("an index ({})", manifest.media_type))));
        }
        let artifact = parse_manifest(&manifest.bytes).map_err(|e| self.artifact_err(tag, e))?;
        let entry_bytes = client.get_blob_bytes(
            repo,
            &reg_digest(&artifact.entry_digest),
            Some(artifact.entry_size),
            MAX_ENTRY,
        )?;
        let entry = artifact.check_entry(&entry_bytes).map_err(|e| self.artifact_err(tag, e))?;
        let id = ImageId(entry.record);
        debug!(store = self.location(), tag, %id, manifest = %manifest.digest, "registry store: image");
        let found = Arc::new(Found { artifact, entry });
        self.inner.images.lock().unwrap_or_else(|p| p.into_inner()).insert(id, Arc::clone(&found));
        Ok(Some((id, found)))
    }

    /// `@sha256:<digest>`: the Tessera image whose `subject` is the source image manifest
    /// `digest` (a `--reference-layers` image pushed to its source repository), found through
    /// the referrers API or, on a registry without it, its tag fallback. Several Tessera
    /// referrers are refused by name (the tag fallback keeps only the newest push).
    fn resolve_subject(&self, text: &str) -> Result<ImageId, StoreError> {
        let reference = format!("@{text}");
        let digest: Sha256Digest =
            text.parse().map_err(|_| StoreError::InvalidReference { reference: reference.clone() })?;
        let client = &self.inner.client;
        let repo = &self.inner.repo;
        let index = match client.referrers(repo, &reg_digest(&digest), ARTIFACT_TYPE)? {
            Some(index) => Some(index),
            None => fallback_referrers(client, repo, &digest)?,
        };
        let found = match index {
            Some(bytes) => {
                tessera_referrers(&bytes).map_err(|e| self.artifact_err(&referrers_tag(&digest), e))?
            }
            None => Vec::new(),
        };
        let manifest = match found.as_slice() {
            [one] => one.manifest,
            [] => return Err(StoreError::UnknownImage { reference }),
            many => {
                return Err(StoreError::AmbiguousReference {
                    reference,
                    candidates: many
                        .iter()
                        .map(|r| r.id.clone().unwrap_or_else(|| r.manifest.to_string()))
                        .collect(),
                })
            }
        };
        let (id, found) = self
            .fetch_target(&Target::Digest(reg_digest(&manifest)), &reference)?
            .ok_or_else(|| StoreError::UnknownImage { reference: reference.clone() })?;
        if found.artifact.subject.as_ref().map(|s| s.digest) != Some(digest) {
            return Err(self.artifact_err(
                &reference,
                ArtifactError::WrongType(format!("a referrer of {digest} without that subject")),
            ));
        }
        Ok(id)
    }

    /// The image tagged `tag`, `None` if the tag does not exist.
    pub fn read_ref(&self, tag: &str) -> Result<Option<ImageId>, StoreError> {
        if !validate_tag(tag) {
            return Err(StoreError::InvalidReference { reference: tag.to_owned() });
        }
        let id = self.fetch(tag)?.map(|(id, _)| id);
        if let Some(id) = &id {
            self.note_ref(tag, id);
        }
        Ok(id)
    }

    fn found(&self, id: &ImageId) -> Result<Arc<Found>, StoreError> {
        if let Some(f) = self.inner.images.lock().unwrap_or_else(|p| p.into_inner()).get(id) {
            return Ok(Arc::clone(f));
        }
        let tag = id_tag(id);
        match self.fetch(&tag)? {
            Some((actual, f)) if actual == *id => Ok(f),
            Some((actual, _)) => {
                Err(self.artifact_err(&tag, ArtifactError::WrongImage { expected: *id, actual }))
            }
            None => Err(StoreError::UnknownImage { reference: id.to_string() }),
        }
    }

    /// The size of `digest` as a manifest read so far lists it.
    fn known_size(&self, digest: &Sha256Digest) -> Option<u64> {
        let images = self.inner.images.lock().unwrap_or_else(|p| p.into_inner());
        images.values().find_map(|f| f.artifact.blob_size(digest))
    }

    fn note_ref(&self, tag: &str, id: &ImageId) {
        let mut seen = self.inner.seen_refs.lock().unwrap_or_else(|p| p.into_inner());
        if !seen.iter().any(|(t, _)| t == tag) {
            seen.push((tag.to_owned(), *id));
        }
    }
}

impl ReadStore for RegistryStore {
    fn describe(&self) -> String {
        self.location()
    }

    fn resolve(&self, reference: &str) -> Result<ImageId, StoreError> {
        if let Some(subject) = reference.strip_prefix('@') {
            return self.resolve_subject(subject);
        }
        if reference.starts_with("sha256:") {
            let id: ImageId = reference
                .parse()
                .map_err(|_| StoreError::InvalidReference { reference: reference.to_owned() })?;
            self.found(&id)?;
            return Ok(id);
        }
        self.read_ref(reference)?.ok_or_else(|| StoreError::UnknownImage { reference: reference.to_owned() })
    }

    fn get_entry(&self, id: &ImageId) -> Result<ImageEntry, StoreError> {
        Ok(self.found(id)?.entry.clone())
    }

    fn read_blob(&self, digest: &Sha256Digest) -> Result<Vec<u8>, StoreError> {
        let size = self.known_size(digest);
        Ok(self.inner.client.get_blob_bytes(
            &self.inner.repo,
            &reg_digest(digest),
            size,
            MAX_REGISTRY_BLOB,
        )?)
    }

    fn list_refs(&self) -> Result<Vec<(String, ImageId)>, StoreError> {
        Ok(self.inner.seen_refs.lock().unwrap_or_else(|p| p.into_inner()).clone())
    }

    fn chunk_source(&self, _image: &Arc<OpenImage>) -> Arc<dyn ChunkSource> {
        Arc::new(self.clone())
    }

    fn blob_len(&self, digest: &Sha256Digest) -> Result<u64, StoreError> {
        if let Some(size) = self.known_size(digest) {
            return Ok(size);
        }
        let d = reg_digest(digest);
        self.inner.client.blob_size(&self.inner.repo, &d)?.ok_or_else(|| {
            RegistryError::NotFound { url: format!("{}@{d}", self.location()), detail: " (blob)".into() }
                .into()
        })
    }

    fn open_blob(&self, digest: &Sha256Digest) -> Result<Box<dyn Read + Send>, StoreError> {
        let size = self.known_size(digest);
        let reader = self.inner.client.get_blob(&self.inner.repo, &reg_digest(digest), size)?;
        Ok(Box::new(reader))
    }
}

/// Ranges of one pack closer than this share one Range GET (as for HTTP origins).
const COALESCE_GAP: u64 = 64 << 10;
/// Largest span fetched by one coalesced Range GET.
const COALESCE_MAX: u64 = 16 << 20;

impl ChunkSource for RegistryStore {
    fn read_stored(&self, pack: &Sha256Digest, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
        Ok(self.inner.client.get_blob_range(&self.inner.repo, &reg_digest(pack), offset, u64::from(len))?)
    }

    fn read_stored_streamed(
        &self,
        pack: &Sha256Digest,
        offset: u64,
        len: u32,
        sink: &mut crate::source::RangeSink<'_>,
    ) -> Result<(), StoreError> {
        let mut stopped = None;
        let read = self.inner.client.get_blob_range_streamed(
            &self.inner.repo,
            &reg_digest(pack),
            offset,
            u64::from(len),
            &mut |bytes| match sink(bytes) {
                Ok(()) => true,
                Err(e) => {
                    stopped = Some(e);
                    false
                }
            },
        );
        match stopped {
            Some(e) => Err(e),
            None => Ok(read?),
        }
    }

    /// Near ranges share one Range GET ([`crate::coalesce`]); separate spans are fetched in
    /// parallel, and a span's ranges are handed over when it is in.
    fn read_stored_many(
        &self,
        pack: &Sha256Digest,
        ranges: &[(u64, u32)],
        got: &mut crate::source::RangeGot<'_>,
    ) -> Result<(), StoreError> {
        let spans = crate::coalesce(ranges, COALESCE_GAP, COALESCE_MAX);
        let (client, repo, digest) = (&self.inner.client, self.inner.repo.as_str(), reg_digest(pack));
        let fetch = |offset: u64, len: u64| client.get_blob_range(repo, &digest, offset, len);
        let fetched: Vec<Result<Vec<u8>, RegistryError>> = std::thread::scope(|scope| {
            let handles: Vec<_> =
                spans.iter().map(|sp| scope.spawn(move || fetch(sp.offset, sp.len))).collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        });
        for (span, bytes) in spans.iter().zip(fetched) {
            let bytes = bytes?;
            for &i in &span.members {
                // get_blob_range returned exactly span.len bytes, and members lie inside the span.
                let (offset, len) = ranges[i];
                let start = usize::try_from(offset - span.offset).unwrap_or(usize::MAX);
                let piece = bytes.get(start..start.saturating_add(len as usize));
                got(
                    i,
                    piece
                        .ok_or(StoreError::RangeOutOfBounds {
                            digest: *pack,
                            offset,
                            len: u64::from(len),
                            blob_len: span.offset + bytes.len() as u64,
                        })?
                        .to_vec(),
                );
            }
        }
        debug!(%pack, ranges = ranges.len(), requests = spans.len(), "registry: coalesced ranged reads");
        Ok(())
    }
}

/// The referrers index the tag fallback keeps for `subject` in `repo` (`None`: no such tag);
/// anything but an image index under that tag is refused.
fn fallback_referrers(
    client: &Client,
    repo: &str,
    subject: &Sha256Digest,
) -> Result<Option<Vec<u8>>, StoreError> {
    let tag = referrers_tag(subject);
    match client.get_manifest(repo, &Target::Tag(tag.clone())) {
        Ok(m) if m.kind == ManifestKind::Index => Ok(Some(m.bytes)),
        Ok(m) => Err(StoreError::Artifact {
            location: format!("docker://{}/{repo}:{tag}", client.registry()),
            source: ArtifactError::WrongType(format!(
                "{} where the referrers of {subject} belong",
                m.media_type
            )),
        }),
        Err(RegistryError::NotFound { .. }) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The `subject` of image `entry` pushed to `target`: for a `--reference-layers` image built
/// from a registry, pushed to the repository it was built from (referrers live in the subject's
/// repository, and its layer blobs are there already), the source image manifest, read for
/// its media type and size. `None` otherwise.
fn reference_subject(
    source: &dyn ReadStore,
    entry: &ImageEntry,
    target: &PushTarget,
) -> Result<Option<Subject>, StoreError> {
    let Some(provenance) = entry.provenance else { return Ok(None) };
    let p: serde_json::Value = match serde_json::from_slice(&source.read_blob(&provenance)?) {
        Ok(v) => v,
        Err(_) => return Ok(None), // provenance is informative; an odd one names no subject
    };
    // The builder's provenance: `{source, built_at, builder, image: <the source's>}`.
    let p = &p["image"];
    let text = |k: &str| p.get(k).and_then(|v| v.as_str());
    let same_repo =
        text("registry") == Some(target.client.registry()) && text("repository") == Some(&target.repo);
    let referenced = p.get("reference_layers").and_then(|v| v.as_bool()) == Some(true);
    let Some(digest) = text("manifest").and_then(|d| d.parse::<Sha256Digest>().ok()) else {
        return Ok(None);
    };
    if !(same_repo && referenced) {
        return Ok(None);
    }
    let m = target.client.get_manifest(&target.repo, &Target::Digest(reg_digest(&digest)))?;
    Ok(Some(Subject { media_type: m.media_type, digest, size: m.bytes.len() as u64 }))
}

/// Where a push goes: a repository on a registry, and the tag to give the image (it is also
/// tagged `sha256-<id hex>`).
#[derive(Debug, Clone)]
pub struct PushTarget {
    pub client: Client,
    pub repo: String,
    pub tag: String,
}

/// Progress of a push, in bytes of blobs (present and mounted blobs count as done).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushProgress {
    pub done_bytes: u64,
    pub total_bytes: u64,
}

/// What a push did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushReport {
    pub id: ImageId,
    /// The manifest digest (the same for every tag).
    pub manifest: Sha256Digest,
    /// `TAG` and `sha256-<id hex>`.
    pub tags: Vec<String>,
    /// Blobs of the artifact, the config included.
    pub blobs: usize,
    pub total_bytes: u64,
    pub uploaded: usize,
    pub uploaded_bytes: u64,
    pub mounted: usize,
    pub present: usize,
    /// Tags written (a tag already naming this manifest is left alone).
    pub tags_written: usize,
    /// The source image manifest the pushed artifact refers to (`--reference-layers` images
    /// pushed to their source repository), and whether the registry indexed it for the
    /// referrers API itself (else the tag fallback `sha256-<subject hex>` was written).
    pub subject: Option<(Sha256Digest, bool)>,
}

impl PushReport {
    fn count(&mut self, how: BlobPush, size: u64) {
        match how {
            BlobPush::Present => self.present += 1,
            BlobPush::Mounted => self.mounted += 1,
            BlobPush::Uploaded => {
                self.uploaded += 1;
                self.uploaded_bytes += size;
            }
        }
    }
}

/// Push image `id` from `source` to `target` as the artifact of `docs/formats/registry.md`.
/// Blobs first (skipped, mounted from `options.mount_from`, or uploaded), then the config, then
/// the manifest under `sha256-<id hex>` and `target.tag` — so a tag never names an incomplete
/// image. Pushing again does nothing but existence checks.
pub fn push_image(
    source: &dyn ReadStore,
    id: &ImageId,
    target: &PushTarget,
    options: &PushOptions,
    progress: &mut dyn FnMut(PushProgress),
) -> Result<PushReport, StoreError> {
    let client = &target.client;
    let repo = target.repo.as_str();
    if !validate_tag(&target.tag) {
        return Err(StoreError::InvalidTag { tag: target.tag.clone() });
    }
    let entry = source.get_entry(id)?;
    let index = AnyPackIndex::decode(&source.read_blob(&entry.pack_index)?)
        .map_err(|e| StoreError::Decode { what: "pack index", digest: entry.pack_index, source: e })?;
    let mut layers = Vec::new();
    let named = [
        (Role::Record, Some(entry.record)),
        (Role::Prefix, Some(entry.prefix)),
        (Role::PackIndex, Some(entry.pack_index)),
        (Role::Profile, entry.profile),
        (Role::Provenance, entry.provenance),
    ];
    for (role, digest) in named {
        if let Some(d) = digest {
            layers.push(Layer { role, digest: d, size: source.blob_len(&d)? });
        }
    }
    for pack in index.data_blobs() {
        if !layers.iter().any(|l| l.digest == pack) {
            layers.push(Layer { role: Role::Pack, digest: pack, size: source.blob_len(&pack)? });
        }
    }
    let subject = reference_subject(source, &entry, target)?;
    let entry_json = entry.to_json();
    let entry_digest = Sha256Digest::of(&entry_json);
    let manifest = build_manifest(id, entry_digest, entry_json.len() as u64, &layers, subject.as_ref());
    let total_bytes = layers.iter().map(|l| l.size).sum::<u64>() + entry_json.len() as u64;
    let mut report = PushReport {
        id: *id,
        manifest: Sha256Digest::of(&manifest),
        tags: vec![target.tag.clone(), id_tag(id)],
        blobs: layers.len() + 1,
        total_bytes,
        uploaded: 0,
        uploaded_bytes: 0,
        mounted: 0,
        present: 0,
        tags_written: 0,
        subject: None,
    };
    let mut done = 0u64;
    progress(PushProgress { done_bytes: 0, total_bytes });
    for layer in &layers {
        let before = done;
        let how = client.push_blob(
            repo,
            &reg_digest(&layer.digest),
            layer.size,
            options,
            || source.open_blob(&layer.digest).map_err(std::io::Error::other),
            &mut |n| {
                done += n;
                progress(PushProgress { done_bytes: done, total_bytes });
            },
        )?;
        done = before + layer.size;
        progress(PushProgress { done_bytes: done, total_bytes });
        debug!(role = layer.role.name(), digest = %layer.digest, ?how, "push: blob");
        report.count(how, layer.size);
    }
    let how = client.push_blob(
        repo,
        &reg_digest(&entry_digest),
        entry_json.len() as u64,
        options,
        || Ok(std::io::Cursor::new(&entry_json)),
        &mut |_| {},
    )?;
    report.count(how, entry_json.len() as u64);
    progress(PushProgress { done_bytes: total_bytes, total_bytes });

    let digest = Digest::of(&manifest);
    // The ID tag first: a TAG never names an image that cannot be found by ID.
    let mut indexed = false;
    for tag in [id_tag(id), target.tag.clone()] {
        if client.manifest_digest(repo, &tag)?.as_ref() == Some(&digest) {
            continue;
        }
        let (_, acked) =
            client.put_manifest_with_subject(repo, &tag, crate::artifact::MANIFEST_MEDIA_TYPE, &manifest)?;
        indexed |= acked;
        report.tags_written += 1;
    }
    if let Some(subject) = &subject {
        // No OCI-Subject header: a registry with the referrers API indexes the subject all the
        // same (go-containerregistry's does, without the header).
        if !indexed {
            indexed = client.referrers(repo, &reg_digest(&subject.digest), ARTIFACT_TYPE)?.is_some();
        }
        if !indexed {
            // No referrers API: the tag fallback, read, merged and written back.
            let tag = referrers_tag(&subject.digest);
            let existing = fallback_referrers(client, repo, &subject.digest)?;
            let index = merged_referrers(
                existing.as_deref(),
                id,
                &Sha256Digest::of(&manifest),
                manifest.len() as u64,
            )
            .map_err(|source| StoreError::Artifact {
                location: format!("docker://{}/{repo}:{tag}", client.registry()),
                source,
            })?;
            if existing.as_deref() != Some(&index[..]) {
                client.put_manifest(repo, &tag, INDEX_MEDIA_TYPE, &index)?;
            }
        }
        report.subject = Some((subject.digest, indexed));
    }
    info!(
        %id, repo, manifest = %digest, uploaded = report.uploaded, mounted = report.mounted,
        present = report.present, "pushed"
    );
    Ok(report)
}
