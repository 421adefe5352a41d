use std::fmt;
use std::str::FromStr;

use sha2::{Digest as _, Sha256};

use crate::error::DecodeError;

/// Identity of a chunk: blake3 of its uncompressed bytes.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChunkId(pub [u8; 32]);

impl ChunkId {
    /// The id of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self(*blake3::hash(bytes).as_bytes())
    }

    /// Whether `bytes` hash to this id.
    pub fn matches(&self, bytes: &[u8]) -> bool {
        // blake3::Hash compares in constant time; not needed here, but free.
        blake3::Hash::from(self.0) == blake3::hash(bytes)
    }

    /// Lowercase hex.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Debug for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkId({})", &self.to_hex()[..16])
    }
}

impl fmt::Display for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// A sha256 digest, written `sha256:<64 lowercase hex>`.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Sha256Digest(pub [u8; 32]);

impl Sha256Digest {
    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self(Sha256::digest(bytes).into())
    }

    /// The 64 hex digits without the `sha256:` prefix (the blob file name).
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parse 64 lowercase hex digits without a prefix.
    pub fn from_hex(text: &str) -> Result<Self, DecodeError> {
        let bad = || DecodeError::BadDigest { text: text.to_owned() };
        if text.len() != 64 || !text.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(text, &mut out).map_err(|_| bad())?;
        Ok(Self(out))
    }
}

impl fmt::Debug for Sha256Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex())
    }
}

impl fmt::Display for Sha256Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex())
    }
}

impl FromStr for Sha256Digest {
    type Err = DecodeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.strip_prefix("sha256:") {
            Some(hex) => Self::from_hex(hex),
            None => Err(DecodeError::BadDigest { text: s.to_owned() }),
        }
    }
}

impl serde::Serialize for Sha256Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Sha256Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// An image ID: the sha256 of the canonical image record.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct ImageId(pub Sha256Digest);

impl ImageId {
    /// The digest this ID stands for.
    pub fn digest(&self) -> Sha256Digest {
        self.0
    }
}

impl fmt::Display for ImageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for ImageId {
    type Err = DecodeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.parse().map(ImageId)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_roundtrip() {
        let d = Sha256Digest::of(b"abc");
        let text = d.to_string();
        assert_eq!(text, "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert_eq!(text.parse::<Sha256Digest>().ok(), Some(d));
        assert!("sha256:BA7816BF8F01CFEA414140DE5DAE2223B00361A396177A9CB410FF61F20015AD"
            .parse::<Sha256Digest>()
            .is_err());
        assert!("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
            .parse::<Sha256Digest>()
            .is_err());
        assert!("sha256:abc".parse::<Sha256Digest>().is_err());
    }

    #[test]
    fn chunk_id_matches() {
        let id = ChunkId::of(b"hello");
        assert!(id.matches(b"hello"));
        assert!(!id.matches(b"hellO"));
    }
}
