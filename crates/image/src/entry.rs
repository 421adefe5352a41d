//! The image entry (`images/<id hex>.json`): ties an image ID to its blobs in one store.

use serde::{Deserialize, Serialize};

use crate::digest::Sha256Digest;
use crate::error::DecodeError;

/// `{"record", "prefix", "pack_index", "profile", "provenance"}` — digests of blobs in the same store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageEntry {
    /// The image record blob (its digest is the image ID).
    pub record: Sha256Digest,
    /// The zstd-compressed metadata prefix blob.
    pub prefix: Sha256Digest,
    /// The pack index blob.
    pub pack_index: Sha256Digest,
    /// The prefetch profile blob, if any.
    pub profile: Option<Sha256Digest>,
    /// The provenance blob (source, build time), if any.
    pub provenance: Option<Sha256Digest>,
}

impl ImageEntry {
    /// Pretty JSON with a trailing newline.
    pub fn to_json(&self) -> Vec<u8> {
        let mut out = serde_json::to_vec_pretty(self).unwrap_or_default();
        out.push(b'\n');
        out
    }

    pub fn from_json(bytes: &[u8]) -> Result<Self, DecodeError> {
        Ok(serde_json::from_slice(bytes)?)
    }

    /// An entry with every field but the profile set, for tests and fuzz seeds (feature
    /// `test-support`).
    #[cfg(any(test, feature = "test-support"))]
    pub fn example() -> Self {
        ImageEntry {
            record: Sha256Digest::of(b"r"),
            prefix: Sha256Digest::of(b"p"),
            pack_index: Sha256Digest::of(b"i"),
            profile: None,
            provenance: Some(Sha256Digest::of(b"v")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_roundtrip() {
        let e = ImageEntry::example();
        let j = e.to_json();
        assert_eq!(ImageEntry::from_json(&j).unwrap(), e);
        assert!(String::from_utf8(j).unwrap().contains("\"profile\": null"));
        assert!(ImageEntry::from_json(br#"{"record":"sha256:00"}"#).is_err());
    }
}
