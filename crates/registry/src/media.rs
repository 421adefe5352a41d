//! Manifest media types and `Accept` negotiation. Pure.

/// OCI image manifest.
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// OCI image index.
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// Docker image manifest, schema 2.
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// Docker manifest list (schema 2 index).
pub const DOCKER_MANIFEST_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

/// What a manifest document is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ManifestKind {
    /// An image manifest (config + layers), OCI or Docker schema 2.
    Image,
    /// An index / manifest list (one manifest per platform), OCI or Docker.
    Index,
}

/// Every media type the client accepts, indexes included, most preferred first.
pub const ACCEPT_ALL: &[&str] = &[OCI_INDEX, OCI_MANIFEST, DOCKER_MANIFEST_LIST, DOCKER_MANIFEST];

/// The `Accept` header value for `types`.
pub fn accept_header(types: &[&str]) -> String {
    types.join(", ")
}

/// Classify a media type (parameters such as `; charset=utf-8` ignored).
pub fn classify(media_type: &str) -> Option<ManifestKind> {
    let base = media_type.split(';').next().unwrap_or("").trim();
    match base {
        OCI_MANIFEST | DOCKER_MANIFEST => Some(ManifestKind::Image),
        OCI_INDEX | DOCKER_MANIFEST_LIST => Some(ManifestKind::Index),
        _ => None,
    }
}

/// The media type of a fetched manifest: the document's own `mediaType` when it has one, else the
/// response's `Content-Type`, else (neither known) guessed from the fields (`manifests` → index,
/// `layers` → image manifest; an OCI index or manifest may omit `mediaType`).
pub fn effective_media_type(document: &[u8], content_type: Option<&str>) -> Option<String> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Peek {
        #[serde(default)]
        media_type: Option<String>,
        #[serde(default)]
        manifests: Option<serde_json::Value>,
        #[serde(default)]
        layers: Option<serde_json::Value>,
    }
    let peek: Option<Peek> = serde_json::from_slice(document).ok();
    if let Some(t) = peek.as_ref().and_then(|p| p.media_type.clone()).filter(|t| !t.is_empty()) {
        return Some(t);
    }
    if let Some(ct) = content_type.filter(|c| classify(c).is_some()) {
        return Some(ct.split(';').next().unwrap_or(ct).trim().to_owned());
    }
    match peek {
        Some(Peek { manifests: Some(_), .. }) => Some(OCI_INDEX.to_owned()),
        Some(Peek { layers: Some(_), .. }) => Some(OCI_MANIFEST.to_owned()),
        _ => content_type.map(str::to_owned),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiation() {
        let a = accept_header(ACCEPT_ALL);
        for t in [OCI_INDEX, OCI_MANIFEST, DOCKER_MANIFEST_LIST, DOCKER_MANIFEST] {
            assert!(a.contains(t));
            assert!(classify(t).is_some());
        }
        assert_eq!(
            classify("application/vnd.oci.image.manifest.v1+json; charset=utf-8"),
            Some(ManifestKind::Image)
        );
        assert_eq!(classify(DOCKER_MANIFEST_LIST), Some(ManifestKind::Index));
        assert_eq!(classify("application/vnd.docker.distribution.manifest.v1+prettyjws"), None);
        assert_eq!(classify("application/json"), None);
    }

    #[test]
    fn effective_types() {
        let m = br#"{"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.v2+json","layers":[]}"#;
        assert_eq!(effective_media_type(m, Some("application/json")).as_deref(), Some(DOCKER_MANIFEST));
        let bare_index = br#"{"schemaVersion":2,"manifests":[]}"#;
        assert_eq!(effective_media_type(bare_index, Some(OCI_INDEX)).as_deref(), Some(OCI_INDEX));
        assert_eq!(effective_media_type(bare_index, Some("application/json")).as_deref(), Some(OCI_INDEX));
        assert_eq!(effective_media_type(br#"{"layers":[]}"#, None).as_deref(), Some(OCI_MANIFEST));
        assert_eq!(effective_media_type(b"not json", Some("text/html")).as_deref(), Some("text/html"));
    }
}
