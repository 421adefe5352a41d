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
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    annotations: BTreeMap<String, String>,
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
/// once. Deterministic — no times — so pushing an image twice gives the same manifest digest.
pub fn build_manifest(id: &ImageId, entry_digest: Sha256Digest, entry_size: u64, blobs: &[Layer]) -> Vec<u8> {
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
    Ok(Artifact { entry_digest: m.config.digest, entry_size: m.config.size, layers })
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
        let m = build_manifest(&id, d, json.len() as u64, &layers(&e));
        assert_eq!(m, build_manifest(&id, d, json.len() as u64, &layers(&e)), "deterministic");
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
        let m = build_manifest(&id, Sha256Digest::of(&json), 1, &layers(&e));
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
}
