//! The registry form of an image (`docs/formats/registry.md`): an OCI image manifest with
//! `artifactType` `application/vnd.tessera.image.v1` whose config is the image entry and whose
//! layers are the entry's blobs and the packs. Pure: building and checking manifests, no I/O.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tessera_image::{ImageEntry, ImageId, Sha256Digest};

/// The manifest's own media type (an OCI image manifest; distribution 2.8 knows no other).
pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
/// `artifactType` of a Tessera image.
pub const ARTIFACT_TYPE: &str = "application/vnd.tessera.image.v1";
/// The config: the image entry JSON, byte for byte as a store's `images/<id>.json`.
pub const ENTRY_MEDIA_TYPE: &str = "application/vnd.tessera.image.entry.v1+json";
/// The annotation naming a layer's role (the media types say it too; this is for people and
/// tools that only show annotations).
pub const ROLE_ANNOTATION: &str = "dev.tessera.role";
/// The manifest annotation carrying the image ID.
pub const ID_ANNOTATION: &str = "dev.tessera.image.id";
/// An OCI image index (the referrers API's answer, and its tag fallback's content).
pub const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";

/// The source image manifest a `--reference-layers` image refers to (the manifest's `subject`):
/// its media type, digest and size, as OCI descriptors carry them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subject {
    pub media_type: String,
    pub digest: Sha256Digest,
    pub size: u64,
}

/// The tag under which a registry without the referrers API lists the referrers of `subject`
/// (OCI distribution 1.1's tag schema): `sha256-<subject digest hex>`.
pub fn referrers_tag(subject: &Sha256Digest) -> String {
    format!("sha256-{}", subject.hex())
}

/// What a layer of the artifact is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    Record,
    Prefix,
    PackIndex,
    Profile,
    Provenance,
    Pack,
}

impl Role {
    /// Every role, in manifest order.
    pub const ALL: [Role; 6] =
        [Role::Record, Role::Prefix, Role::PackIndex, Role::Profile, Role::Provenance, Role::Pack];

    /// The layer media type.
    pub fn media_type(self) -> &'static str {
        match self {
            Role::Record => "application/vnd.tessera.image.record.v1",
            Role::Prefix => "application/vnd.tessera.image.prefix.v1+zstd",
            Role::PackIndex => "application/vnd.tessera.image.pack-index.v1",
            Role::Profile => "application/vnd.tessera.image.profile.v1",
            Role::Provenance => "application/vnd.tessera.image.provenance.v1+json",
            Role::Pack => "application/vnd.tessera.image.pack.v1",
        }
    }

    /// The value of [`ROLE_ANNOTATION`].
    pub fn name(self) -> &'static str {
        match self {
            Role::Record => "record",
            Role::Prefix => "prefix",
            Role::PackIndex => "pack-index",
            Role::Profile => "profile",
            Role::Provenance => "provenance",
            Role::Pack => "pack",
        }
    }

    fn from_media_type(t: &str) -> Option<Self> {
        Role::ALL.into_iter().find(|r| r.media_type() == t)
    }
}

/// The tag under which an image is found by ID: `sha256-<id hex>` (tags cannot hold `:`).
pub fn id_tag(id: &ImageId) -> String {
    format!("sha256-{}", id.digest().hex())
}

/// One blob of the artifact: its role, digest and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layer {
    pub role: Role,
    pub digest: Sha256Digest,
    pub size: u64,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Descriptor {
    media_type: String,
    digest: Sha256Digest,
    size: u64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    annotations: BTreeMap<String, String>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Manifest {
    schema_version: u32,
    media_type: String,
    artifact_type: String,
    config: Descriptor,
    layers: Vec<Descriptor>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    subject: Option<Descriptor>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    annotations: BTreeMap<String, String>,
}

/// An entry of an image index (referrers list). Unknown fields are ignored; `digest` stays a
/// string so that an entry of another algorithm is skipped rather than failing the list.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
struct IndexEntry {
    media_type: String,
    digest: String,
    size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    artifact_type: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    annotations: BTreeMap<String, String>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Index {
    schema_version: u32,
    #[serde(default)]
    media_type: Option<String>,
    #[serde(default)]
    manifests: Vec<IndexEntry>,
}

/// A Tessera image listed as a referrer: its manifest's digest and size, and the image ID the
/// list's annotation claims (checked when the manifest is read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Referrer {
    pub manifest: Sha256Digest,
    pub size: u64,
    pub id: Option<String>,
}

/// The Tessera images among the referrers in `index` (an image index: the referrers API's
/// answer or its fallback tag's content); other artifacts are skipped.
pub fn tessera_referrers(index: &[u8]) -> Result<Vec<Referrer>, ArtifactError> {
    let index: Index = serde_json::from_slice(index).map_err(|e| ArtifactError::Json(e.to_string()))?;
    Ok(index
        .manifests
        .into_iter()
        // Registries built to the OCI 1.1 release candidates (go-containerregistry 0.14, for
        // one) report a referrer's config media type as its artifactType: ours is Tessera's own.
        .filter(|m| matches!(m.artifact_type.as_deref(), Some(ARTIFACT_TYPE | ENTRY_MEDIA_TYPE)))
        .filter_map(|m| {
            let manifest = m.digest.parse().ok()?;
            Some(Referrer { manifest, size: m.size, id: m.annotations.get(ID_ANNOTATION).cloned() })
        })
        .collect())
}

/// The fallback referrers index of a subject after pushing Tessera image `id` (manifest
/// `manifest`, `size` bytes) to it: `existing` (the tag's current index, if any) with its
/// other Tessera images dropped — the newest push is the one `@sha256:` finds — and other
/// artifacts kept, then the new entry.
pub fn merged_referrers(
    existing: Option<&[u8]>,
    id: &ImageId,
    manifest: &Sha256Digest,
    size: u64,
) -> Result<Vec<u8>, ArtifactError> {
    let mut manifests = match existing {
        Some(bytes) => {
            let index: Index =
                serde_json::from_slice(bytes).map_err(|e| ArtifactError::Json(e.to_string()))?;
            index.manifests
        }
        None => Vec::new(),
    };
    manifests.retain(|m| m.artifact_type.as_deref() != Some(ARTIFACT_TYPE));
    manifests.push(IndexEntry {
        media_type: MANIFEST_MEDIA_TYPE.to_owned(),
        digest: format!("sha256:{}", manifest.hex()),
        size,
        artifact_type: Some(ARTIFACT_TYPE.to_owned()),
        annotations: BTreeMap::from([(ID_ANNOTATION.to_owned(), id.to_string())]),
    });
    let index = Index { schema_version: 2, media_type: Some(INDEX_MEDIA_TYPE.to_owned()), manifests };
    serde_json::to_vec_pretty(&index).map_err(|e| ArtifactError::Json(e.to_string()))
}

/// `index` (a fallback referrers index) without the entries whose manifest is in `drop`:
/// `None` when none of them is there, else the new index and how many entries it keeps. Other
/// entries, and fields Tessera does not know, are kept as they were.
pub fn pruned_referrers(
    index: &[u8],
    drop: &std::collections::HashSet<Sha256Digest>,
) -> Result<Option<(Vec<u8>, usize)>, ArtifactError> {
    let mut value: serde_json::Value =
        serde_json::from_slice(index).map_err(|e| ArtifactError::Json(e.to_string()))?;
    let Some(list) = value.get_mut("manifests").and_then(|m| m.as_array_mut()) else {
        return Ok(None);
    };
    let before = list.len();
    list.retain(|m| {
        let digest = m.get("digest").and_then(|d| d.as_str()).and_then(|d| d.parse::<Sha256Digest>().ok());
        !digest.is_some_and(|d| drop.contains(&d))
    });
    let after = list.len();
    if after == before {
        return Ok(None);
    }
    let bytes = serde_json::to_vec_pretty(&value).map_err(|e| ArtifactError::Json(e.to_string()))?;
    Ok(Some((bytes, after)))
}

/// The blobs an image manifest of any kind names (its config and layers) with their sizes;
/// descriptors of other digest algorithms, and anything that is not a manifest, give none.
pub fn manifest_blobs(bytes: &[u8]) -> Vec<(Sha256Digest, u64)> {
    #[derive(Deserialize)]
    struct Any {
        digest: String,
        #[serde(default)]
        size: u64,
    }
    #[derive(Deserialize)]
    struct AnyManifest {
        #[serde(default)]
        config: Option<Any>,
        #[serde(default)]
        layers: Vec<Any>,
    }
    let Ok(m) = serde_json::from_slice::<AnyManifest>(bytes) else { return Vec::new() };
    m.config.into_iter().chain(m.layers).filter_map(|d| Some((d.digest.parse().ok()?, d.size))).collect()
}

/// The tag under which `tessera store gc` keeps, in a registry store, when it first found each
/// image dead (`docs/formats/registry.md`, "Garbage collection").
pub const GC_MARKS_TAG: &str = "tessera-gc-marks";
/// `artifactType` of the marks manifest.
pub const GC_MARKS_ARTIFACT_TYPE: &str = "application/vnd.tessera.gc-marks.v1";
/// Media type of its config, the marks JSON.
pub const GC_MARKS_MEDIA_TYPE: &str = "application/vnd.tessera.gc-marks.v1+json";

/// The marks manifest whose config is the marks JSON (`digest`, `size` bytes); no layers.
pub fn build_marks_manifest(digest: Sha256Digest, size: u64) -> Vec<u8> {
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "artifactType": GC_MARKS_ARTIFACT_TYPE,
        "config": { "mediaType": GC_MARKS_MEDIA_TYPE, "digest": digest.to_string(), "size": size },
        "layers": [],
    });
    serde_json::to_vec_pretty(&manifest).unwrap_or_default()
}

/// The config digest of a marks manifest; `None` for any other manifest.
pub fn marks_config(bytes: &[u8]) -> Option<(Sha256Digest, u64)> {
    let v: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    if v.get("artifactType")?.as_str()? != GC_MARKS_ARTIFACT_TYPE {
        return None;
    }
    let config = v.get("config")?;
    if config.get("mediaType")?.as_str()? != GC_MARKS_MEDIA_TYPE {
        return None;
    }
    Some((config.get("digest")?.as_str()?.parse().ok()?, config.get("size")?.as_u64()?))
}

/// Why a manifest is not a Tessera image.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ArtifactError {
    #[error("not a Tessera image manifest: {0}")]
    Json(String),
    #[error("not a Tessera image (artifactType {0:?}, expected {ARTIFACT_TYPE})")]
    WrongType(String),
    #[error("the config is {0:?}, expected {ENTRY_MEDIA_TYPE}")]
    WrongConfig(String),
    #[error("the image entry is invalid: {0}")]
    BadEntry(String),
    #[error("the image entry names {what} {digest}, which is not a layer of the manifest")]
    MissingLayer { what: &'static str, digest: Sha256Digest },
    #[error("the image entry belongs to image {actual}, not {expected}")]
    WrongImage { expected: ImageId, actual: ImageId },
}

/// A parsed Tessera image manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Artifact {
    /// The image entry blob (the config).
    pub entry_digest: Sha256Digest,
    pub entry_size: u64,
    /// The layers, in manifest order (unknown layer media types are skipped).
    pub layers: Vec<Layer>,
    /// The source image manifest a `--reference-layers` image refers to.
    pub subject: Option<Subject>,
}

impl Artifact {
    /// The size of blob `digest` if the manifest lists it (the config included).
    pub fn blob_size(&self, digest: &Sha256Digest) -> Option<u64> {
        if *digest == self.entry_digest {
            return Some(self.entry_size);
        }
        self.layers.iter().find(|l| l.digest == *digest).map(|l| l.size)
    }

    /// Parse and check the entry (the config blob's bytes, already verified against
    /// `entry_digest`): it must be an image entry whose blobs are all layers here.
    pub fn check_entry(&self, entry_bytes: &[u8]) -> Result<ImageEntry, ArtifactError> {
        let entry = ImageEntry::from_json(entry_bytes).map_err(|e| ArtifactError::BadEntry(e.to_string()))?;
        let has = |d: &Sha256Digest| self.layers.iter().any(|l| l.digest == *d);
        let named = [
            ("record", Some(entry.record)),
            ("prefix", Some(entry.prefix)),
            ("pack index", Some(entry.pack_index)),
            ("profile", entry.profile),
            ("provenance", entry.provenance),
        ];
        for (what, digest) in named {
            if let Some(d) = digest.filter(|d| !has(d)) {
                return Err(ArtifactError::MissingLayer { what, digest: d });
            }
        }
        Ok(entry)
    }
}

/// The manifest for image `entry` (whose JSON has digest `entry_digest` and `entry_size` bytes),
/// with `blobs` as layers: every blob the entry names and every pack of its pack index, each
/// once; with `subject`, the source image manifest it refers to (`--reference-layers` images).
/// Deterministic — no times — so pushing an image twice gives the same manifest digest.
pub fn build_manifest(
    id: &ImageId,
    entry_digest: Sha256Digest,
    entry_size: u64,
    blobs: &[Layer],
    subject: Option<&Subject>,
) -> Vec<u8> {
    let mut layers: Vec<Descriptor> = Vec::with_capacity(blobs.len());
    let mut seen = std::collections::HashSet::new();
    let mut ordered: Vec<&Layer> = blobs.iter().collect();
    ordered.sort_by_key(|l| l.role); // stable: packs keep their pack index order
    for l in ordered {
        if !seen.insert(l.digest) {
            continue;
        }
        layers.push(Descriptor {
            media_type: l.role.media_type().to_owned(),
            digest: l.digest,
            size: l.size,
            annotations: BTreeMap::from([(ROLE_ANNOTATION.to_owned(), l.role.name().to_owned())]),
        });
    }
    let manifest = Manifest {
        schema_version: 2,
        media_type: MANIFEST_MEDIA_TYPE.to_owned(),
        artifact_type: ARTIFACT_TYPE.to_owned(),
        config: Descriptor {
            media_type: ENTRY_MEDIA_TYPE.to_owned(),
            digest: entry_digest,
            size: entry_size,
            annotations: BTreeMap::new(),
        },
        layers,
        subject: subject.map(|s| Descriptor {
            media_type: s.media_type.clone(),
            digest: s.digest,
            size: s.size,
            annotations: BTreeMap::new(),
        }),
        annotations: BTreeMap::from([(ID_ANNOTATION.to_owned(), id.to_string())]),
    };
    serde_json::to_vec_pretty(&manifest).unwrap_or_default()
}

/// Parse a manifest as a Tessera image.
pub fn parse_manifest(bytes: &[u8]) -> Result<Artifact, ArtifactError> {
    let m: Manifest = serde_json::from_slice(bytes).map_err(|e| ArtifactError::Json(e.to_string()))?;
    if m.artifact_type != ARTIFACT_TYPE {
        return Err(ArtifactError::WrongType(m.artifact_type));
    }
    if m.config.media_type != ENTRY_MEDIA_TYPE {
        return Err(ArtifactError::WrongConfig(m.config.media_type));
    }
    let layers = m
        .layers
        .iter()
        .filter_map(|d| {
            Role::from_media_type(&d.media_type).map(|role| Layer { role, digest: d.digest, size: d.size })
        })
        .collect();
    Ok(Artifact {
        entry_digest: m.config.digest,
        entry_size: m.config.size,
        layers,
        subject: m.subject.map(|d| Subject { media_type: d.media_type, digest: d.digest, size: d.size }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> ImageEntry {
        ImageEntry {
            record: Sha256Digest::of(b"record"),
            prefix: Sha256Digest::of(b"prefix"),
            pack_index: Sha256Digest::of(b"index"),
            profile: None,
            provenance: Some(Sha256Digest::of(b"prov")),
        }
    }

    fn layers(e: &ImageEntry) -> Vec<Layer> {
        vec![
            Layer { role: Role::Pack, digest: Sha256Digest::of(b"pack2"), size: 20 },
            Layer { role: Role::Record, digest: e.record, size: 6 },
            Layer { role: Role::Pack, digest: Sha256Digest::of(b"pack1"), size: 10 },
            Layer { role: Role::Prefix, digest: e.prefix, size: 6 },
            Layer { role: Role::PackIndex, digest: e.pack_index, size: 5 },
            Layer { role: Role::Provenance, digest: e.provenance.unwrap(), size: 4 },
            Layer { role: Role::Pack, digest: Sha256Digest::of(b"pack2"), size: 20 },
        ]
    }

    #[test]
    fn round_trip_and_determinism() {
        let e = entry();
        let id = ImageId(e.record);
        let json = e.to_json();
        let d = Sha256Digest::of(&json);
        let m = build_manifest(&id, d, json.len() as u64, &layers(&e), None);
        assert_eq!(m, build_manifest(&id, d, json.len() as u64, &layers(&e), None), "deterministic");
        let text = String::from_utf8(m.clone()).unwrap();
        assert!(text.contains(ARTIFACT_TYPE) && text.contains(&id.to_string()));
        let a = parse_manifest(&m).unwrap();
        assert_eq!(a.entry_digest, d);
        let roles: Vec<Role> = a.layers.iter().map(|l| l.role).collect();
        assert_eq!(
            roles,
            [Role::Record, Role::Prefix, Role::PackIndex, Role::Provenance, Role::Pack, Role::Pack],
            "ordered by role, packs in their given order, duplicates dropped"
        );
        assert_eq!(a.layers[4].digest, Sha256Digest::of(b"pack2"));
        assert_eq!(a.blob_size(&Sha256Digest::of(b"pack1")), Some(10));
        assert_eq!(a.blob_size(&d), Some(json.len() as u64));
        assert_eq!(a.check_entry(&json).unwrap(), e);
    }

    #[test]
    fn rejects_what_is_not_ours() {
        let e = entry();
        let id = ImageId(e.record);
        let json = e.to_json();
        let m = build_manifest(&id, Sha256Digest::of(&json), 1, &layers(&e), None);
        let text = String::from_utf8(m).unwrap();
        let other = text.replace(ARTIFACT_TYPE, "application/vnd.example");
        assert!(matches!(parse_manifest(other.as_bytes()), Err(ArtifactError::WrongType(_))));
        let other = text.replace(ENTRY_MEDIA_TYPE, "application/vnd.oci.image.config.v1+json");
        assert!(matches!(parse_manifest(other.as_bytes()), Err(ArtifactError::WrongConfig(_))));
        assert!(matches!(parse_manifest(b"{}"), Err(ArtifactError::Json(_))));
        // An entry naming a blob the manifest does not carry.
        let a = parse_manifest(text.as_bytes()).unwrap();
        let mut e2 = e.clone();
        e2.profile = Some(Sha256Digest::of(b"missing"));
        assert!(matches!(
            a.check_entry(&e2.to_json()),
            Err(ArtifactError::MissingLayer { what: "profile", .. })
        ));
        assert!(matches!(a.check_entry(b"not json"), Err(ArtifactError::BadEntry(_))));
        assert_eq!(id_tag(&id), format!("sha256-{}", e.record.hex()));
        assert!(tessera_image::validate_tag(&id_tag(&id)));
    }

    #[test]
    fn subject_and_referrers() {
        let id = ImageId(Sha256Digest::of(b"record"));
        let subject = Subject {
            media_type: "application/vnd.oci.image.manifest.v1+json".into(),
            digest: Sha256Digest::of(b"src"),
            size: 7,
        };
        let m = build_manifest(&id, Sha256Digest::of(b"entry"), 3, &[], Some(&subject));
        assert_eq!(parse_manifest(&m).unwrap().subject, Some(subject.clone()));
        assert_eq!(
            parse_manifest(&build_manifest(&id, Sha256Digest::of(b"entry"), 3, &[], None)).unwrap().subject,
            None
        );
        // The fallback index: other artifacts kept, an older Tessera referrer replaced.
        let other = r#"{"schemaVersion":2,"manifests":[
            {"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:0000000000000000000000000000000000000000000000000000000000000000","size":1,"artifactType":"application/example.sbom"},
            {"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:1111111111111111111111111111111111111111111111111111111111111111","size":2,"artifactType":"application/vnd.tessera.image.v1"},
            {"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha512:22","size":2,"artifactType":"application/vnd.tessera.image.v1"}]}"#;
        let manifest = Sha256Digest::of(&m);
        let merged = merged_referrers(Some(other.as_bytes()), &id, &manifest, m.len() as u64).unwrap();
        assert_eq!(
            tessera_referrers(&merged).unwrap(),
            vec![Referrer { manifest, size: m.len() as u64, id: Some(id.to_string()) }]
        );
        assert!(
            String::from_utf8_lossy(&merged).contains("application/example.sbom"),
            "other artifacts stay"
        );
        assert_eq!(tessera_referrers(other.as_bytes()).unwrap().len(), 1, "a sha512 entry is skipped");
        let fresh = merged_referrers(None, &id, &manifest, 9).unwrap();
        assert_eq!(merged_referrers(Some(&fresh), &id, &manifest, 9).unwrap(), fresh, "idempotent");
        assert!(tessera_referrers(b"not json").is_err());
        // An OCI 1.1 release-candidate registry names a referrer by its config's media type.
        let rc = format!(
            r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[
            {{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{manifest}","size":9,"artifactType":"{ENTRY_MEDIA_TYPE}"}},
            {{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{manifest}","size":9,"artifactType":"application/example.sbom"}}]}}"#
        );
        assert_eq!(tessera_referrers(rc.as_bytes()).unwrap(), vec![Referrer { manifest, size: 9, id: None }]);
    }
}
