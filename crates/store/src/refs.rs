//! The content of a tag's ref, `refs/<tag>` (docs/formats/store.md, "Refs"): the image ID and,
//! since refs carry them, the digests of the image's metadata prefix and pack index and the
//! lengths of those and the record.
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

/// The byte lengths of an image's record, metadata prefix and pack index, as its ref names them:
/// a reader that knows a blob's length asks for all of its pieces at once (one round trip fewer
/// than learning it from the first piece's answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefLengths {
    pub record: u64,
    pub prefix: u64,
    pub pack_index: u64,
}

/// A ref's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefText {
    pub id: ImageId,
    /// `None` in a ref written before refs named them (the ID line alone).
    pub parts: Option<RefParts>,
    /// `None` in a ref written before refs named them (or one without parts).
    pub lengths: Option<RefLengths>,
}

impl RefText {
    /// The ref of image `id` whose entry is `entry`, and whose blobs are `lengths` long if known.
    pub fn of(id: ImageId, entry: &ImageEntry, lengths: Option<RefLengths>) -> Self {
        Self { id, parts: Some(RefParts::of(entry)), lengths }
    }

    /// Its bytes: `sha256:<id hex>\n`, then `prefix sha256:<hex>\n` and `pack-index
    /// sha256:<hex>\n` when it names them, then `lengths <record> <prefix> <pack index>\n` when
    /// it names those.
    pub fn encode(&self) -> String {
        match (&self.parts, &self.lengths) {
            (None, _) => format!("{}\n", self.id),
            (Some(p), None) => format!("{}\nprefix {}\npack-index {}\n", self.id, p.prefix, p.pack_index),
            (Some(p), Some(l)) => format!(
                "{}\nprefix {}\npack-index {}\nlengths {} {} {}\n",
                self.id, p.prefix, p.pack_index, l.record, l.prefix, l.pack_index
            ),
        }
    }

    /// Parse a ref strictly: one of the three forms [`Self::encode`] writes, nothing else.
    pub fn parse(bytes: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(bytes).ok()?.strip_suffix('\n')?;
        let mut lines = text.split('\n');
        let id: ImageId = lines.next()?.parse().ok()?;
        let Some(prefix) = lines.next() else { return Some(Self { id, parts: None, lengths: None }) };
        let digest = |line: Option<&str>, key: &str| -> Option<Sha256Digest> {
            line?.strip_prefix(key)?.strip_prefix(' ')?.parse().ok()
        };
        let parts = RefParts {
            prefix: digest(Some(prefix), "prefix")?,
            pack_index: digest(lines.next(), "pack-index")?,
        };
        let lengths = match lines.next() {
            None => None,
            Some(line) => {
                let mut n = line.strip_prefix("lengths ")?.split(' ').map(canonical_u64);
                let l = RefLengths { record: n.next()??, prefix: n.next()??, pack_index: n.next()?? };
                n.next().is_none().then_some(())?;
                Some(l)
            }
        };
        lines.next().is_none().then_some(Self { id, parts: Some(parts), lengths })
    }
}

/// A decimal without sign or leading zeros (`0` itself allowed).
fn canonical_u64(s: &str) -> Option<u64> {
    let digits = !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (digits && (s == "0" || !s.starts_with('0'))).then(|| s.parse().ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_forms_round_trip_and_nothing_else_parses() {
        let id = ImageId(Sha256Digest::of(b"record"));
        let parts = RefParts { prefix: Sha256Digest::of(b"prefix"), pack_index: Sha256Digest::of(b"index") };
        let old = RefText { id, parts: None, lengths: None };
        let new = RefText { id, parts: Some(parts), lengths: None };
        let lengths = RefLengths { record: 1_120_000, prefix: 0, pack_index: 950_123 };
        let newest = RefText { id, parts: Some(parts), lengths: Some(lengths) };
        assert_eq!(old.encode(), format!("{id}\n"));
        assert_eq!(new.encode(), format!("{id}\nprefix {}\npack-index {}\n", parts.prefix, parts.pack_index));
        assert_eq!(
            newest.encode(),
            format!(
                "{id}\nprefix {}\npack-index {}\nlengths 1120000 0 950123\n",
                parts.prefix, parts.pack_index
            )
        );
        for r in [old, new, newest] {
            assert_eq!(RefText::parse(r.encode().as_bytes()), Some(r));
        }
        let two = format!("{id}\nprefix {}\npack-index {}\n", parts.prefix, parts.pack_index);
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
            format!("{two}lengths 1 2\n"),                      // two lengths
            format!("{two}lengths 1 2 3 4\n"),                  // four
            format!("{two}lengths 1 02 3\n"),                   // a leading zero
            format!("{two}lengths 1 +2 3\n"),                   // a sign
            format!("{two}lengths 1  2 3\n"),                   // spacing
            format!("{two}lengths 1 2 3\nx\n"),                 // more
            format!("{two}lengths 1 2 99999999999999999999\n"), // past u64
            format!("{id}\nlengths 1 2 3\n"),                   // lengths without parts
        ];
        for b in bad {
            assert_eq!(RefText::parse(b.as_bytes()), None, "{b:?}");
        }
    }
}
