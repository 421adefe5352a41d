//! The content of a tag's ref, `refs/<tag>` (docs/formats/store.md, "Refs"): the image ID and,
//! since refs carry them, the digests of the image's metadata prefix and pack index, the
//! lengths of those and the record, and where the chunks of the image's prefetch profile are
//! stored.
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefText {
    pub id: ImageId,
    /// `None` in a ref written before refs named them (the ID line alone).
    pub parts: Option<RefParts>,
    /// `None` in a ref written before refs named them (or one without parts).
    pub lengths: Option<RefLengths>,
    /// Where the chunks of the image's prefetch profile are stored, when the image has one
    /// ([`crate::profile_ranges`]): per pack, in the order a start needs them, its ranges
    /// (`(offset, len)`, ascending, apart). A remote start fetches them while it fetches the
    /// image's metadata (a hint: the chunks are checked against their ids as any are). Only in a
    /// ref that gives the lengths.
    pub profile: crate::PackRanges,
}

impl RefText {
    /// The ref of image `id` whose entry is `entry`, and whose blobs are `lengths` long if known.
    pub fn of(id: ImageId, entry: &ImageEntry, lengths: Option<RefLengths>) -> Self {
        Self { id, parts: Some(RefParts::of(entry)), lengths, profile: Vec::new() }
    }

    /// Its bytes: `sha256:<id hex>\n`, then `prefix sha256:<hex>\n` and `pack-index
    /// sha256:<hex>\n` when it names them, then `lengths <record> <prefix> <pack index>\n` when
    /// it names those, then a `profile sha256:<pack hex> <offset>+<len> …\n` line per pack of
    /// the profile's ranges.
    pub fn encode(&self) -> String {
        match (&self.parts, &self.lengths) {
            (None, _) => format!("{}\n", self.id),
            (Some(p), None) => format!("{}\nprefix {}\npack-index {}\n", self.id, p.prefix, p.pack_index),
            (Some(p), Some(l)) => {
                let mut text = format!(
                    "{}\nprefix {}\npack-index {}\nlengths {} {} {}\n",
                    self.id, p.prefix, p.pack_index, l.record, l.prefix, l.pack_index
                );
                for (pack, ranges) in &self.profile {
                    text.push_str(&format!("profile {pack}"));
                    for (offset, len) in ranges {
                        text.push_str(&format!(" {offset}+{len}"));
                    }
                    text.push('\n');
                }
                text
            }
        }
    }

    /// Parse a ref strictly: one of the three forms [`Self::encode`] writes, nothing else.
    pub fn parse(bytes: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(bytes).ok()?.strip_suffix('\n')?;
        let mut lines = text.split('\n');
        let id: ImageId = lines.next()?.parse().ok()?;
        let Some(prefix) = lines.next() else {
            return Some(Self { id, parts: None, lengths: None, profile: Vec::new() });
        };
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
        let mut profile: crate::PackRanges = Vec::new();
        let (mut count, mut bytes) = (0usize, 0u64);
        for line in lines {
            lengths?;
            let mut words = line.strip_prefix("profile ")?.split(' ');
            let pack: Sha256Digest = words.next()?.parse().ok()?;
            if profile.iter().any(|p| p.0 == pack) {
                return None;
            }
            let mut ranges: Vec<(u64, u32)> = Vec::new();
            for word in words {
                let (offset, len) = word.split_once('+')?;
                let (offset, len) = (canonical_u64(offset)?, u32::try_from(canonical_u64(len)?).ok()?);
                let apart = ranges.last().is_none_or(|&(o, l)| o + u64::from(l) < offset);
                if len == 0 || !apart || offset.checked_add(u64::from(len)).is_none() {
                    return None;
                }
                (count, bytes) = (count + 1, bytes + u64::from(len));
                ranges.push((offset, len));
            }
            if ranges.is_empty() || count > crate::MAX_STAGED_RANGES || bytes > crate::MAX_STAGED_BYTES {
                return None;
            }
            profile.push((pack, ranges));
        }
        Some(Self { id, parts: Some(parts), lengths, profile })
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
        let old = RefText { id, parts: None, lengths: None, profile: Vec::new() };
        let new = RefText { id, parts: Some(parts), lengths: None, profile: Vec::new() };
        let lengths = RefLengths { record: 1_120_000, prefix: 0, pack_index: 950_123 };
        let newest = RefText { id, parts: Some(parts), lengths: Some(lengths), profile: Vec::new() };
        assert_eq!(old.encode(), format!("{id}\n"));
        assert_eq!(new.encode(), format!("{id}\nprefix {}\npack-index {}\n", parts.prefix, parts.pack_index));
        assert_eq!(
            newest.encode(),
            format!(
                "{id}\nprefix {}\npack-index {}\nlengths 1120000 0 950123\n",
                parts.prefix, parts.pack_index
            )
        );
        for r in [old, new, newest.clone()] {
            assert_eq!(RefText::parse(r.encode().as_bytes()), Some(r.clone()));
        }
        // With the profile's ranges, a line per pack.
        let (p1, p2) = (Sha256Digest::of(b"pack 1"), Sha256Digest::of(b"pack 2"));
        let profiled =
            RefText { profile: vec![(p2, vec![(0, 10), (11, 5)]), (p1, vec![(4096, 300)])], ..newest };
        let text = profiled.encode();
        assert!(
            text.ends_with(&format!("950123\nprofile {p2} 0+10 11+5\nprofile {p1} 4096+300\n")),
            "{text}"
        );
        assert_eq!(RefText::parse(text.as_bytes()), Some(profiled));
        let two = format!("{id}\nprefix {}\npack-index {}\n", parts.prefix, parts.pack_index);
        let four = format!("{two}lengths 1 2 3\n");
        for bad in [
            format!("{two}profile {p1} 0+10\n"),                      // without lengths
            format!("{four}profile {p1}\n"),                          // no range
            format!("{four}profile {p1} 0+10 10+5\n"),                // touching ranges
            format!("{four}profile {p1} 11+5 0+10\n"),                // not ascending
            format!("{four}profile {p1} 0+0\n"),                      // empty
            format!("{four}profile {p1} 00+10\n"),                    // not canonical
            format!("{four}profile {p1} 0+4294967296\n"),             // longer than u32
            format!("{four}profile {p1} 0+10\nprofile {p1} 20+10\n"), // a pack twice
            format!("{four}profile {p1}  0+10\n"),                    // spacing
            format!("{four}profile {p1} 0+2097153\n"),                // over MAX_STAGED_BYTES
        ] {
            assert_eq!(RefText::parse(bad.as_bytes()), None, "{bad:?}");
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
