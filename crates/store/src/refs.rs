//! The content of a tag's ref, `refs/<tag>` (docs/formats/store.md, "Refs"): the image ID and,
//! since refs carry them, the digests of the image's metadata prefix and pack index.
//!
//! Those two are fixed for an image ID (the entry names them, and only its profile and
//! provenance may change), so a reader that resolves a tag can request them alongside the
//! entry instead of after it: one round trip fewer for a remote start. A hint is checked
//! against the entry before use: a stale or wrong one costs a fetch, never wrong bytes (blobs are
//! verified by digest, and the prefix by the record's).

use tessera_image::{ImageEntry, ImageId, Sha256Digest};

/// The digests of an image's metadata prefix and pack index, as its ref names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefParts {
    pub prefix: Sha256Digest,
    pub pack_index: Sha256Digest,
}

impl RefParts {
    /// Those `entry` names.
    pub fn of(entry: &ImageEntry) -> Self {
        Self { prefix: entry.prefix, pack_index: entry.pack_index }
    }

    /// Whether `entry` names these.
    pub fn match_entry(&self, entry: &ImageEntry) -> bool {
        *self == Self::of(entry)
    }
}

/// A ref's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefText {
    pub id: ImageId,
    /// `None` in a ref written before refs named them (the ID line alone).
    pub parts: Option<RefParts>,
}

impl RefText {
    /// The ref of image `id` whose entry is `entry`.
    pub fn of(id: ImageId, entry: &ImageEntry) -> Self {
        Self { id, parts: Some(RefParts::of(entry)) }
    }

    /// Its bytes: `sha256:<id hex>\n`, then `prefix sha256:<hex>\n` and `pack-index
    /// sha256:<hex>\n` when it names them.
    pub fn encode(&self) -> String {
        match &self.parts {
            None => format!("{}\n", self.id),
            Some(p) => format!("{}\nprefix {}\npack-index {}\n", self.id, p.prefix, p.pack_index),
        }
    }

    /// Parse a ref strictly: one of the two forms [`Self::encode`] writes, nothing else.
    pub fn parse(bytes: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(bytes).ok()?.strip_suffix('\n')?;
        let mut lines = text.split('\n');
        let id: ImageId = lines.next()?.parse().ok()?;
        let Some(prefix) = lines.next() else { return Some(Self { id, parts: None }) };
        let digest = |line: Option<&str>, key: &str| -> Option<Sha256Digest> {
            line?.strip_prefix(key)?.strip_prefix(' ')?.parse().ok()
        };
        let parts = RefParts {
            prefix: digest(Some(prefix), "prefix")?,
            pack_index: digest(lines.next(), "pack-index")?,
        };
        lines.next().is_none().then_some(Self { id, parts: Some(parts) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_forms_round_trip_and_nothing_else_parses() {
        let id = ImageId(Sha256Digest::of(b"record"));
        let parts = RefParts { prefix: Sha256Digest::of(b"prefix"), pack_index: Sha256Digest::of(b"index") };
        let old = RefText { id, parts: None };
        let new = RefText { id, parts: Some(parts) };
        assert_eq!(old.encode(), format!("{id}\n"));
        assert_eq!(new.encode(), format!("{id}\nprefix {}\npack-index {}\n", parts.prefix, parts.pack_index));
        for r in [old, new] {
            assert_eq!(RefText::parse(r.encode().as_bytes()), Some(r));
        }
        let bad = [
            id.to_string(),                                                                 // no newline
            format!("{id}\n\n"),                                                            // an empty line
            format!("{id}\nprefix {}\n", parts.prefix),                                     // one digest only
            format!("{id}\npack-index {}\nprefix {}\n", parts.pack_index, parts.prefix),    // order
            format!("{id}\nprefix {}\npack-index {}\nx\n", parts.prefix, parts.pack_index), // more
            format!("{id}\nprefix  {}\npack-index {}\n", parts.prefix, parts.pack_index),   // spacing
            format!("{id}\nprefix sha256:00\npack-index {}\n", parts.pack_index),           // digest
            "sha256:xyz\n".to_owned(),
            String::new(),
        ];
        for b in bad {
            assert_eq!(RefText::parse(b.as_bytes()), None, "{b:?}");
        }
    }
}
