//! Garbage collection of a registry store (`tessera store gc --store docker://HOST/REPO`).
//!
//! A registry owns its storage: Tessera can delete manifests (and with them their tags), and the
//! registry's own garbage collection later frees the blobs no manifest names any more. So gc here
//! decides which Tessera images are dead, deletes their manifests, and takes them out of the
//! referrers fallback indexes; blobs are left to the registry.
//!
//! **Live** Tessera images (`docs/formats/registry.md`, "Garbage collection"):
//! - one a tag other than its ID tag (`sha256-<id hex>`) names;
//! - one `@sha256:<source manifest>` finds while that source manifest exists: listed in the
//!   source's fallback index (`sha256-<source hex>`), or, on a registry with the referrers API,
//!   the source's only Tessera referrer;
//! - with `--keep-untagged`, every image.
//!
//! Everything else among the Tessera images (an image whose tag was moved to a rebuild, or whose
//! source image is gone) is dead; manifests that are not Tessera images are never touched.
//!
//! **Grace without timestamps.** A registry keeps no times for manifests, and a push writes the ID
//! tag before the user's tag, so an image being pushed looks dead for a moment. gc therefore
//! keeps its own record in the repository: the tag [`GC_MARKS_TAG`] names a small artifact whose
//! config lists, for each dead image, when a gc run first found it dead. An image is deleted
//! only by a run at least the grace after that first finding; an image found live again loses
//! its mark. The record lives in the registry, not on the host, so gc runs from throwaway CI
//! machines share it. With a grace of 0 a dead image goes at once.
//!
//! The listing and the plan are separate: [`plan`] is pure and unit tested; [`collect_registry`]
//! lists, plans and carries the plan out.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::UNIX_EPOCH;

use serde::{Deserialize, Serialize};
use tessera_image::{ImageId, Sha256Digest};
use tessera_registry::{Client, Digest, ManifestKind, PushOptions, RegistryError, Target};
use tracing::{debug, info, warn};

use crate::artifact::{
    build_marks_manifest, id_tag, manifest_blobs, marks_config, parse_manifest, pruned_referrers,
    tessera_referrers, Role, ARTIFACT_TYPE, GC_MARKS_TAG, INDEX_MEDIA_TYPE, MANIFEST_MEDIA_TYPE,
};
use crate::error::StoreError;
use crate::gc::{GcOptions, Removed, StoreGcReport, Tally};
use crate::origin::registry::RegistryStore;

/// Largest marks record read (a mark is ~90 bytes: some 90 000 dead images).
const MAX_MARKS: u64 = 8 << 20;

/// What one manifest of the repository is, as gc sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// A Tessera image, and the source manifest it refers to (`--reference-layers` images).
    Image { id: ImageId, subject: Option<Sha256Digest> },
    /// An image index under the fallback tag of `subject`: the manifests it lists.
    Referrers { subject: Sha256Digest, listed: Vec<Sha256Digest> },
    /// Anything else: source images, other tools' artifacts, gc's own record.
    Other,
}

/// A manifest: what it is, its size, and the blobs it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeenManifest {
    pub seen: Seen,
    pub size: u64,
    pub blobs: Vec<(Sha256Digest, u64)>,
}

/// The repository as listed.
#[derive(Debug, Clone, Default)]
pub struct Listing {
    /// Every tag and the manifest it names.
    pub tags: BTreeMap<String, Sha256Digest>,
    /// Every manifest a tag names.
    pub manifests: HashMap<Sha256Digest, SeenManifest>,
    /// The subjects (source manifests) of Tessera images and fallback indexes that exist.
    pub subjects: HashSet<Sha256Digest>,
    /// Whether the registry has the referrers API.
    pub referrers_api: bool,
}

/// When a gc run first found each dead image dead: manifest digest → seconds since the epoch.
pub type Marks = BTreeMap<Sha256Digest, u64>;

/// The marks record, as stored (the config of the [`GC_MARKS_TAG`] artifact).
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct MarksRecord {
    version: u32,
    dead_since: Marks,
}

/// A dead image to delete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Doomed {
    pub manifest: Sha256Digest,
    pub id: ImageId,
    /// The tags that name it (its ID tag, and any tag of a kind gc does not count as live).
    pub tags: Vec<String>,
    pub size: u64,
}

/// What a collection will do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Live images' manifests.
    pub live: Vec<Sha256Digest>,
    /// Dead images kept until the grace since their first finding has passed.
    pub young: Vec<Sha256Digest>,
    /// Dead images to delete now.
    pub doomed: Vec<Doomed>,
    /// Fallback index tags that list a doomed image.
    pub prune: Vec<String>,
    /// The marks to keep: the young images' first findings.
    pub marks: Marks,
    /// Tags left.
    pub tags_kept: u64,
}

impl Listing {
    fn image(&self, d: &Sha256Digest) -> Option<(&ImageId, Option<&Sha256Digest>)> {
        match &self.manifests.get(d)?.seen {
            Seen::Image { id, subject } => Some((id, subject.as_ref())),
            _ => None,
        }
    }

    /// Blobs the manifests in `of` name and no manifest outside `of` does.
    fn exclusive_blobs(&self, of: &HashSet<Sha256Digest>) -> Tally {
        let mut outside = HashSet::new();
        for (d, m) in &self.manifests {
            if !of.contains(d) {
                outside.extend(m.blobs.iter().map(|(b, _)| *b));
            }
        }
        let mut seen = HashSet::new();
        let mut tally = Tally::default();
        for d in of {
            for (b, size) in self.manifests.get(d).map(|m| &m.blobs[..]).unwrap_or_default() {
                if !outside.contains(b) && seen.insert(*b) {
                    tally.add(*size);
                }
            }
        }
        tally
    }
}

/// Decide what to keep and delete: pure.
pub fn plan(listing: &Listing, marks: &Marks, options: &GcOptions) -> Plan {
    let mut live: HashSet<Sha256Digest> = HashSet::new();
    for (tag, d) in &listing.tags {
        if let Some((id, _)) = listing.image(d) {
            if *tag != id_tag(id) || options.keep_untagged {
                live.insert(*d);
            }
        }
    }
    let mut by_subject: HashMap<Sha256Digest, Vec<Sha256Digest>> = HashMap::new();
    for (d, m) in &listing.manifests {
        match &m.seen {
            Seen::Referrers { subject, listed } if listing.subjects.contains(subject) => {
                live.extend(listed.iter().filter(|l| listing.image(l).is_some()));
            }
            Seen::Image { subject: Some(s), .. } if listing.subjects.contains(s) => {
                by_subject.entry(*s).or_default().push(*d);
            }
            _ => {}
        }
    }
    if listing.referrers_api {
        live.extend(by_subject.values().filter(|v| v.len() == 1).map(|v| v[0]));
    }
    let now = options.now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let grace = options.grace.as_secs();
    let mut out = Plan::default();
    let mut images: Vec<(&Sha256Digest, &SeenManifest)> =
        listing.manifests.iter().filter(|(_, m)| matches!(m.seen, Seen::Image { .. })).collect();
    images.sort_by_key(|(d, _)| **d);
    for (d, m) in images {
        let Seen::Image { id, .. } = &m.seen else { continue };
        if live.contains(d) {
            out.live.push(*d);
            continue;
        }
        let first = marks.get(d).copied().unwrap_or(now);
        if now.saturating_sub(first) >= grace {
            let tags = listing.tags.iter().filter(|(_, t)| *t == d).map(|(tag, _)| tag.clone()).collect();
            out.doomed.push(Doomed { manifest: *d, id: *id, tags, size: m.size });
        } else {
            out.young.push(*d);
            out.marks.insert(*d, first);
        }
    }
    let doomed: HashSet<Sha256Digest> = out.doomed.iter().map(|d| d.manifest).collect();
    for (tag, d) in &listing.tags {
        if doomed.contains(d) {
            continue;
        }
        out.tags_kept += 1;
        if let Some(SeenManifest { seen: Seen::Referrers { listed, .. }, .. }) = listing.manifests.get(d) {
            if listed.iter().any(|l| doomed.contains(l)) {
                out.prune.push(tag.clone());
            }
        }
    }
    out
}

/// What a manifest named by `tag` is.
fn classify(tag: &str, kind: ManifestKind, bytes: &[u8]) -> Seen {
    if kind == ManifestKind::Index {
        let subject = tag.strip_prefix("sha256-").and_then(|hex| Sha256Digest::from_hex(hex).ok());
        if let Some(subject) = subject {
            if let Ok(listed) = tessera_referrers(bytes) {
                return Seen::Referrers { subject, listed: listed.into_iter().map(|r| r.manifest).collect() };
            }
        }
        return Seen::Other;
    }
    match parse_manifest(bytes) {
        Ok(a) => match a.layers.iter().find(|l| l.role == Role::Record) {
            Some(record) => Seen::Image { id: ImageId(record.digest), subject: a.subject.map(|s| s.digest) },
            None => Seen::Other,
        },
        Err(_) => Seen::Other,
    }
}

fn reg(d: &Sha256Digest) -> Digest {
    Digest::from_raw(&d.0)
}

fn sha(d: &Digest) -> Option<Sha256Digest> {
    Sha256Digest::from_hex(d.hex()).ok()
}

/// List the repository: every tag, what it names, which subjects exist.
fn list(client: &Client, repo: &str) -> Result<Listing, StoreError> {
    let mut listing = Listing::default();
    for tag in client.list_tags(repo)? {
        let m = match client.get_manifest(repo, &Target::Tag(tag.clone())) {
            Ok(m) => m,
            // Deleted since the list was made.
            Err(RegistryError::NotFound { .. }) => continue,
            // A kind of manifest the client does not read (a Docker schema 1 manifest, some
            // other artifact): not a Tessera image, so nothing gc may delete; left alone.
            Err(e @ RegistryError::UnsupportedMediaType { .. }) => {
                debug!(tag, error = %e, "gc: a manifest of another kind, left alone");
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let Some(digest) = sha(&m.digest) else { continue };
        listing.tags.insert(tag.clone(), digest);
        if listing.manifests.contains_key(&digest) {
            continue;
        }
        let seen = if tag == GC_MARKS_TAG { Seen::Other } else { classify(&tag, m.kind, &m.bytes) };
        let blobs = if m.kind == ManifestKind::Image { manifest_blobs(&m.bytes) } else { Vec::new() };
        listing.manifests.insert(digest, SeenManifest { seen, size: m.bytes.len() as u64, blobs });
    }
    let mut subjects: Vec<Sha256Digest> = listing
        .manifests
        .values()
        .filter_map(|m| match &m.seen {
            Seen::Image { subject, .. } => *subject,
            Seen::Referrers { subject, .. } => Some(*subject),
            Seen::Other => None,
        })
        .collect();
    subjects.sort();
    subjects.dedup();
    for s in subjects {
        let exists = listing.manifests.contains_key(&s)
            || client.manifest_digest(repo, &reg(&s).to_string())?.is_some();
        if exists {
            listing.subjects.insert(s);
        }
    }
    if listing.manifests.values().any(|m| matches!(m.seen, Seen::Image { subject: Some(_), .. })) {
        // A registry with the API answers any subject, an unknown one with an empty list.
        let probe = Sha256Digest::of(b"tessera gc: referrers API probe");
        listing.referrers_api = client.referrers(repo, &reg(&probe), ARTIFACT_TYPE)?.is_some();
    }
    Ok(listing)
}

/// The marks record and the manifest holding it (`None`s when there is none). A record that
/// cannot be read is ignored with a warning: every dead image's grace starts again.
fn read_marks(client: &Client, repo: &str) -> Result<(Marks, Option<Sha256Digest>), StoreError> {
    let m = match client.get_manifest(repo, &Target::Tag(GC_MARKS_TAG.to_owned())) {
        Ok(m) => m,
        Err(RegistryError::NotFound { .. }) => return Ok((Marks::new(), None)),
        Err(e) => return Err(e.into()),
    };
    let manifest = sha(&m.digest);
    let Some((config, size)) = marks_config(&m.bytes) else {
        warn!(
            tag = GC_MARKS_TAG,
            "gc: the marks tag names something else; dead images start their grace again"
        );
        return Ok((Marks::new(), manifest));
    };
    let bytes = client.get_blob_bytes(repo, &reg(&config), Some(size), MAX_MARKS)?;
    match serde_json::from_slice::<MarksRecord>(&bytes) {
        Ok(r) if r.version == 1 => Ok((r.dead_since, manifest)),
        Ok(r) => {
            warn!(
                version = r.version,
                "gc: a marks record of an unknown version; dead images start their grace again"
            );
            Ok((Marks::new(), manifest))
        }
        Err(e) => {
            warn!(error = %e, "gc: an unreadable marks record; dead images start their grace again");
            Ok((Marks::new(), manifest))
        }
    }
}

/// Write `marks` as the record under [`GC_MARKS_TAG`], and delete the record it replaces.
fn write_marks(
    client: &Client,
    repo: &str,
    marks: &Marks,
    old: Option<Sha256Digest>,
) -> Result<(), StoreError> {
    // Digests as map keys serialize as strings; this cannot fail.
    let record =
        serde_json::to_vec(&MarksRecord { version: 1, dead_since: marks.clone() }).unwrap_or_default();
    let config = Sha256Digest::of(&record);
    client.push_blob(
        repo,
        &reg(&config),
        record.len() as u64,
        &PushOptions::default(),
        || Ok(std::io::Cursor::new(&record)),
        &mut |_| {},
    )?;
    let manifest = build_marks_manifest(config, record.len() as u64);
    let digest = client.put_manifest(repo, GC_MARKS_TAG, MANIFEST_MEDIA_TYPE, &manifest)?;
    if let Some(old) = old.filter(|o| Some(*o) != sha(&digest)) {
        match client.delete_manifest(repo, &reg(&old).to_string()) {
            Ok(_) => {}
            Err(e @ RegistryError::DeleteRefused { .. }) => {
                warn!("gc: {e}: dead images are marked, but cannot be deleted")
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Delete manifest `d` and every tag in `tags` that still names it (a registry that keeps a
/// deleted manifest's tags, as go-containerregistry's does, gets a delete per tag).
fn delete_image(client: &Client, repo: &str, d: &Sha256Digest, tags: &[String]) -> Result<(), StoreError> {
    client.delete_manifest(repo, &reg(d).to_string())?;
    for tag in tags {
        if client.manifest_digest(repo, tag)?.as_ref() == Some(&reg(d)) {
            client.delete_manifest(repo, tag)?;
        }
    }
    Ok(())
}

/// Collect the garbage of the registry store `store` (see the module documentation).
pub fn collect_registry(store: &RegistryStore, options: &GcOptions) -> Result<StoreGcReport, StoreError> {
    let client = store.client();
    let repo = store.repository();
    let listing = list(client, repo)?;
    let (marks, marks_manifest) = read_marks(client, repo)?;
    let plan = plan(&listing, &marks, options);
    debug!(?plan, "gc: registry plan");
    let doomed: HashSet<Sha256Digest> = plan.doomed.iter().map(|d| d.manifest).collect();
    let young: HashSet<Sha256Digest> = plan.young.iter().copied().collect();
    let live: HashSet<Sha256Digest> = plan.live.iter().copied().collect();
    let mut report = StoreGcReport {
        store: store.location(),
        grace_seconds: options.grace.as_secs(),
        dry_run: options.dry_run,
        images_kept: (plan.live.len() + plan.young.len()) as u64,
        images_removed: plan.doomed.len() as u64,
        tags_kept: plan.tags_kept,
        tags_removed: plan.doomed.iter().map(|d| d.tags.len() as u64).sum(),
        live: listing.exclusive_blobs(&live.union(&young).copied().collect()),
        young: Tally { count: plan.young.len() as u64, bytes: listing.exclusive_blobs(&young).bytes },
        released: Some(listing.exclusive_blobs(&doomed)),
        ..Default::default()
    };
    for d in &plan.doomed {
        if !options.dry_run {
            delete_image(client, repo, &d.manifest, &d.tags)?;
            info!(image = %d.id, manifest = %d.manifest, tags = ?d.tags, "gc: deleted");
        }
        report.note(Removed { key: format!("manifests/{}", d.manifest), kind: "image", bytes: d.size });
        for tag in &d.tags {
            report.note(Removed { key: format!("tags/{tag}"), kind: "tag", bytes: 0 });
        }
    }
    for tag in &plan.prune {
        // Read again: a push may have added an entry since the listing.
        let m = match client.get_manifest(repo, &Target::Tag(tag.clone())) {
            Ok(m) if m.kind == ManifestKind::Index => m,
            Ok(_) | Err(RegistryError::NotFound { .. }) => continue,
            Err(e) => return Err(e.into()),
        };
        let pruned = pruned_referrers(&m.bytes, &doomed).map_err(|source| StoreError::Artifact {
            location: format!("{}:{tag}", store.location()),
            source,
        })?;
        let Some((bytes, left)) = pruned else { continue };
        let entries = tessera_referrers(&m.bytes)
            .map_or(0, |r| r.iter().filter(|r| doomed.contains(&r.manifest)).count());
        if !options.dry_run {
            let old = sha(&m.digest);
            if left == 0 {
                if let Some(old) = old {
                    delete_image(client, repo, &old, std::slice::from_ref(tag))?;
                }
            } else {
                client.put_manifest(repo, tag, INDEX_MEDIA_TYPE, &bytes)?;
            }
            info!(tag, removed = entries, left, "gc: pruned a referrers fallback index");
        }
        for _ in 0..entries {
            report.note(Removed { key: format!("tags/{tag}"), kind: "referrers-entry", bytes: 0 });
        }
    }
    if !options.dry_run && plan.marks != marks {
        write_marks(client, repo, &plan.marks, marks_manifest)?;
    }
    info!(
        store = %report.store, removed = report.images_removed, kept = report.images_kept,
        marked = plan.young.len(), "gc: registry store collected"
    );
    Ok(report)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use super::*;
    use crate::artifact::referrers_tag;

    fn d(s: &str) -> Sha256Digest {
        Sha256Digest::of(s.as_bytes())
    }

    fn image(listing: &mut Listing, name: &str, subject: Option<&str>, tags: &[&str]) -> Sha256Digest {
        let manifest = d(&format!("manifest {name}"));
        let id = ImageId(d(&format!("record {name}")));
        listing.manifests.insert(
            manifest,
            SeenManifest {
                seen: Seen::Image { id, subject: subject.map(d) },
                size: 100,
                blobs: vec![(id.0, 10), (d(&format!("pack {name}")), 1000), (d("shared pack"), 5000)],
            },
        );
        listing.tags.insert(id_tag(&id), manifest);
        for t in tags {
            listing.tags.insert((*t).to_owned(), manifest);
        }
        manifest
    }

    fn options(grace: u64, now: u64) -> GcOptions {
        GcOptions {
            grace: Duration::from_secs(grace),
            dry_run: false,
            keep_untagged: false,
            now: SystemTime::UNIX_EPOCH + Duration::from_secs(now),
        }
    }

    #[test]
    fn a_moved_tag_leaves_the_old_image_dead_and_the_grace_counts_from_the_first_finding() {
        let mut l = Listing::default();
        let old = image(&mut l, "old", None, &[]);
        let new = image(&mut l, "new", None, &["latest"]);
        let p = plan(&l, &Marks::new(), &options(3600, 10_000));
        assert_eq!(p.live, vec![new]);
        assert_eq!(p.young, vec![old]);
        assert!(p.doomed.is_empty());
        assert_eq!(p.marks, Marks::from([(old, 10_000)]));
        // A second run before the grace has passed keeps the first finding.
        let p2 = plan(&l, &p.marks, &options(3600, 13_599));
        assert!(p2.doomed.is_empty());
        assert_eq!(p2.marks, p.marks);
        // Once it has, the image goes, with its ID tag, and its mark with it.
        let p3 = plan(&l, &p.marks, &options(3600, 13_600));
        assert_eq!(p3.doomed.len(), 1);
        assert_eq!(p3.doomed[0].manifest, old);
        let ImageId(record) = p3.doomed[0].id;
        assert_eq!(p3.doomed[0].tags, vec![format!("sha256-{}", record.hex())]);
        assert!(p3.marks.is_empty());
        assert_eq!(p3.tags_kept, 2, "the new image's two tags");
        // Blobs only the old image names are released; the shared pack is not.
        let doomed = HashSet::from([old]);
        assert_eq!(l.exclusive_blobs(&doomed), Tally { count: 2, bytes: 1010 });
    }

    #[test]
    fn grace_zero_deletes_at_once_and_keep_untagged_keeps_everything() {
        let mut l = Listing::default();
        let old = image(&mut l, "old", None, &[]);
        image(&mut l, "new", None, &["v2"]);
        let p = plan(&l, &Marks::new(), &options(0, 5));
        assert_eq!(p.doomed.iter().map(|d| d.manifest).collect::<Vec<_>>(), vec![old]);
        let mut keep = options(0, 5);
        keep.keep_untagged = true;
        let p = plan(&l, &Marks::new(), &keep);
        assert!(p.doomed.is_empty() && p.young.is_empty());
        assert_eq!(p.live.len(), 2);
    }

    #[test]
    fn an_image_found_live_again_loses_its_mark() {
        let mut l = Listing::default();
        let a = image(&mut l, "a", None, &["back"]);
        let stale = d("manifest of an image deleted by someone else");
        let p = plan(&l, &Marks::from([(a, 1), (stale, 1)]), &options(10, 1_000));
        assert_eq!(p.live, vec![a]);
        assert!(p.doomed.is_empty());
        assert!(p.marks.is_empty(), "neither mark is kept");
    }

    #[test]
    fn referrers_live_while_their_subject_exists() {
        let mut l = Listing::default();
        // Fallback (no referrers API): the index lists the newest push; an older referrer of the
        // same subject is dead, as is the referrer of a source that is gone.
        let newest = image(&mut l, "newest", Some("src"), &[]);
        let older = image(&mut l, "older", Some("src"), &[]);
        let orphan = image(&mut l, "orphan", Some("gone"), &[]);
        let src_index = d("index src");
        l.manifests.insert(
            src_index,
            SeenManifest {
                seen: Seen::Referrers { subject: d("src"), listed: vec![newest, d("someone's signature")] },
                size: 300,
                blobs: vec![],
            },
        );
        l.tags.insert(referrers_tag(&d("src")), src_index);
        let gone_index = d("index gone");
        l.manifests.insert(
            gone_index,
            SeenManifest {
                seen: Seen::Referrers { subject: d("gone"), listed: vec![orphan] },
                size: 300,
                blobs: vec![],
            },
        );
        l.tags.insert(referrers_tag(&d("gone")), gone_index);
        l.subjects.insert(d("src"));
        let p = plan(&l, &Marks::new(), &options(0, 1));
        assert_eq!(p.live, vec![newest]);
        let mut doomed: Vec<_> = p.doomed.iter().map(|d| d.manifest).collect();
        doomed.sort();
        let mut expected = vec![older, orphan];
        expected.sort();
        assert_eq!(doomed, expected);
        assert_eq!(p.prune, vec![referrers_tag(&d("gone"))], "only the index that lists a doomed image");

        // With the referrers API: the only Tessera referrer of an existing source is what
        // `@sha256:` finds, so it lives; two make it ambiguous, and only a tagged one lives.
        let mut api = Listing { referrers_api: true, ..Default::default() };
        let only = image(&mut api, "only", Some("s1"), &[]);
        let tagged = image(&mut api, "tagged", Some("s2"), &["app"]);
        let untagged = image(&mut api, "untagged", Some("s2"), &[]);
        api.subjects.extend([d("s1"), d("s2")]);
        let p = plan(&api, &Marks::new(), &options(0, 1));
        let mut live = p.live.clone();
        live.sort();
        let mut expected = vec![only, tagged];
        expected.sort();
        assert_eq!(live, expected);
        assert_eq!(p.doomed.iter().map(|d| d.manifest).collect::<Vec<_>>(), vec![untagged]);
    }

    #[test]
    fn other_manifests_are_never_touched() {
        let mut l = Listing::default();
        let other = d("a source image");
        l.manifests
            .insert(other, SeenManifest { seen: Seen::Other, size: 500, blobs: vec![(d("layer"), 9)] });
        l.tags.insert("sha256-0000".into(), other);
        l.tags.insert(GC_MARKS_TAG.into(), other);
        let p = plan(&l, &Marks::new(), &options(0, 1));
        assert!(p.doomed.is_empty() && p.live.is_empty() && p.young.is_empty());
        assert_eq!(p.tags_kept, 2);
    }

    #[test]
    fn classifies_manifests() {
        assert_eq!(classify("x", ManifestKind::Image, b"{}"), Seen::Other);
        assert_eq!(
            classify("sha256-nothex", ManifestKind::Index, br#"{"schemaVersion":2,"manifests":[]}"#),
            Seen::Other
        );
        let subject = d("s");
        let index = format!(
            r#"{{"schemaVersion":2,"manifests":[{{"mediaType":"{MANIFEST_MEDIA_TYPE}","digest":"{}","size":5,"artifactType":"{ARTIFACT_TYPE}"}}]}}"#,
            d("m")
        );
        assert_eq!(
            classify(&referrers_tag(&subject), ManifestKind::Index, index.as_bytes()),
            Seen::Referrers { subject, listed: vec![d("m")] }
        );
    }

    #[test]
    fn marks_records_decode_strictly() {
        let r = MarksRecord { version: 1, dead_since: Marks::from([(d("m"), 42)]) };
        let bytes = serde_json::to_vec(&r).unwrap();
        let back: MarksRecord = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(back.dead_since, r.dead_since);
        assert!(serde_json::from_slice::<MarksRecord>(br#"{"version":1,"dead_since":{},"x":1}"#).is_err());
        assert!(
            serde_json::from_slice::<MarksRecord>(br#"{"version":1,"dead_since":{"sha256:zz":1}}"#).is_err()
        );
    }
}
