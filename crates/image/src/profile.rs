//! Prefetch profiles and the boot traces they are made from.
//!
//! A [`Trace`] is what `tessera serve --record-trace FILE` writes: the chunks one run of a guest
//! touched, in first-touch order, with the time since the run's first chunk read. A [`Profile`] merges
//! one or more traces of the same image into the order a prefetcher (or `tessera warm --profile-only`)
//! should fetch chunks in. Byte layouts: `docs/formats/profile.md`. Not part of the image ID: a
//! profile is a per-store blob named by the image entry.

use std::collections::{HashMap, HashSet};

use thiserror::Error;

use crate::blockmap::BlockMap;
use crate::codec::{Reader, Writer};
use crate::digest::{ChunkId, ImageId, Sha256Digest};
use crate::error::DecodeError;

const MAGIC: &[u8; 8] = b"TESSPRF\0";
/// The profile format version this crate writes and reads.
pub const PROFILE_VERSION: u32 = 1;
/// Bytes of one encoded profile entry: chunk id, first-touch µs, runs.
const ENTRY_BYTES: usize = 32 + 8 + 4;

/// The first line of a trace file, before the image ID.
const TRACE_HEADER: &str = "tessera-trace 1 ";

/// One chunk of a trace: first touched `at_us` microseconds after the run's first chunk read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceEntry {
    pub chunk: ChunkId,
    pub at_us: u64,
}

/// The chunks one run of a guest touched, in first-touch order (see `docs/formats/profile.md`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    image: ImageId,
    entries: Vec<TraceEntry>,
}

impl Trace {
    /// A trace of `image`; `entries` must be in first-touch order (times non-decreasing) with each
    /// chunk once.
    pub fn new(image: ImageId, entries: Vec<TraceEntry>) -> Result<Self, ProfileError> {
        let mut seen = HashSet::with_capacity(entries.len());
        let mut prev = 0;
        for (i, e) in entries.iter().enumerate() {
            if e.at_us < prev {
                return Err(ProfileError::TraceOrder { index: i });
            }
            if !seen.insert(e.chunk) {
                return Err(ProfileError::TraceRepeat { chunk: e.chunk });
            }
            prev = e.at_us;
        }
        Ok(Self { image, entries })
    }

    /// The image the trace was recorded on.
    pub fn image(&self) -> ImageId {
        self.image
    }

    /// The touched chunks, first touch first.
    pub fn entries(&self) -> &[TraceEntry] {
        &self.entries
    }

    /// Check that the trace was recorded on `image` and names only chunks of `map` (its block map).
    pub fn check_against(&self, image: ImageId, map: &BlockMap) -> Result<(), ProfileError> {
        check_chunks(image, self.image, self.entries.iter().map(|e| e.chunk), map)
    }

    /// The header line (with its newline) a trace file for `image` starts with.
    pub fn header_line(image: ImageId) -> String {
        format!("{TRACE_HEADER}{image}\n")
    }

    /// One entry line (with its newline). A recorder writes the header, then these, appending.
    pub fn entry_line(entry: &TraceEntry) -> String {
        format!("{} {}\n", entry.at_us, entry.chunk.to_hex())
    }

    /// The whole trace file.
    pub fn encode(&self) -> String {
        let mut out = Self::header_line(self.image);
        for e in &self.entries {
            out.push_str(&Self::entry_line(e));
        }
        out
    }

    /// Parse a trace file; rejects anything [`Self::encode`] would not produce.
    pub fn decode(text: &[u8]) -> Result<Self, DecodeError> {
        const WHAT: &str = "trace";
        let bad = |line: usize, reason: &'static str| DecodeError::BadLine { what: WHAT, line, reason };
        let text =
            std::str::from_utf8(text).map_err(|_| DecodeError::BadUtf8 { what: WHAT, field: "file" })?;
        let Some(body) = text.strip_suffix('\n') else {
            // An empty file, or a last line cut short (a writer killed mid-line).
            return Err(bad(text.lines().count().max(1), "missing final newline (file cut short?)"));
        };
        let mut lines = body.split('\n');
        let header = lines.next().unwrap_or_default();
        let image = header
            .strip_prefix(TRACE_HEADER)
            .ok_or(DecodeError::BadMagic { what: "trace (first line must be `tessera-trace 1 sha256:…`)" })?
            .parse::<ImageId>()
            .map_err(|_| bad(1, "bad image ID"))?;
        let mut entries = Vec::new();
        let mut seen = HashSet::new();
        for (i, line) in lines.enumerate() {
            let n = i + 2;
            let (at, chunk) = line.split_once(' ').ok_or_else(|| bad(n, "expected `<µs> <chunk id>`"))?;
            let canonical_number = !at.is_empty()
                && at.bytes().all(|b| b.is_ascii_digit())
                && (at == "0" || !at.starts_with('0'));
            if !canonical_number {
                return Err(bad(n, "time is not a canonical decimal number"));
            }
            let at_us: u64 = at.parse().map_err(|_| bad(n, "time does not fit in 64 bits"))?;
            let chunk =
                parse_chunk_hex(chunk).ok_or_else(|| bad(n, "chunk id is not 64 lowercase hex digits"))?;
            if entries.last().is_some_and(|p: &TraceEntry| p.at_us > at_us) {
                return Err(bad(n, "times go backwards"));
            }
            if !seen.insert(chunk) {
                return Err(bad(n, "chunk listed twice"));
            }
            entries.push(TraceEntry { chunk, at_us });
        }
        Ok(Self { image, entries })
    }
}

/// `found` must be `image`, and every chunk one of `map`'s.
fn check_chunks(
    image: ImageId,
    found: ImageId,
    mut chunks: impl Iterator<Item = ChunkId>,
    map: &BlockMap,
) -> Result<(), ProfileError> {
    if found != image {
        return Err(ProfileError::WrongImage { expected: image, found });
    }
    let known: HashSet<ChunkId> = map.chunks().iter().map(|c| c.id).collect();
    match chunks.find(|c| !known.contains(c)) {
        Some(chunk) => Err(ProfileError::UnknownChunk { chunk, image }),
        None => Ok(()),
    }
}

fn parse_chunk_hex(text: &str) -> Option<ChunkId> {
    // Same rules as digests: exactly 64 lowercase hex digits.
    Sha256Digest::from_hex(text).ok().map(|d| ChunkId(d.0))
}

/// One chunk of a profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProfileEntry {
    pub chunk: ChunkId,
    /// Median first-touch time over the traces that touched the chunk, in µs since each run's
    /// first read.
    pub first_touch_us: u64,
    /// How many of the merged traces touched the chunk.
    pub runs: u32,
}

/// How much of an image a profile covers (see [`Profile::coverage`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Coverage {
    /// Chunks in the profile.
    pub chunks: u64,
    /// Uncompressed bytes of those chunks.
    pub bytes: u64,
    /// Chunks in the image.
    pub image_chunks: u64,
    /// Uncompressed bytes of all the image's chunks (its file data).
    pub image_bytes: u64,
}

impl Coverage {
    /// Percentage of the image's chunk bytes the profile covers (0 for an image without data).
    pub fn percent_of_data(&self) -> f64 {
        if self.image_bytes == 0 {
            0.0
        } else {
            self.bytes as f64 * 100.0 / self.image_bytes as f64
        }
    }
}

/// A prefetch profile: the chunks of one image in the order its runs first touched them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Profile {
    image: ImageId,
    traces: u32,
    min_runs: u32,
    entries: Vec<ProfileEntry>,
}

/// Errors merging traces into a profile or checking a profile against an image.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ProfileError {
    #[error("no traces to merge")]
    NoTraces,
    #[error("a trace or profile made for image {found} cannot be used for image {expected}")]
    WrongImage { expected: ImageId, found: ImageId },
    #[error("min runs {min_runs} must be between 1 and the number of traces ({traces})")]
    BadThreshold { min_runs: u32, traces: u32 },
    #[error("too many traces ({count}); at most {max}")]
    TooManyTraces { count: usize, max: u32 },
    #[error("trace entry #{index} is touched before the previous one")]
    TraceOrder { index: usize },
    #[error("chunk {chunk} appears twice in one trace")]
    TraceRepeat { chunk: ChunkId },
    #[error("chunk {chunk} is not part of image {image} (the trace or profile names data the image does not have)")]
    UnknownChunk { chunk: ChunkId, image: ImageId },
}

impl Profile {
    /// Merge traces of `image`: a chunk is kept when at least `min_runs` traces touched it, placed at
    /// the median of its first-touch times (lower middle for an even count); ties go by chunk id.
    pub fn merge(image: ImageId, traces: &[Trace], min_runs: u32) -> Result<Self, ProfileError> {
        if traces.is_empty() {
            return Err(ProfileError::NoTraces);
        }
        let count = u32::try_from(traces.len())
            .map_err(|_| ProfileError::TooManyTraces { count: traces.len(), max: u32::MAX })?;
        if min_runs == 0 || min_runs > count {
            return Err(ProfileError::BadThreshold { min_runs, traces: count });
        }
        let mut times: HashMap<ChunkId, Vec<u64>> = HashMap::new();
        for t in traces {
            if t.image != image {
                return Err(ProfileError::WrongImage { expected: image, found: t.image });
            }
            for e in &t.entries {
                times.entry(e.chunk).or_default().push(e.at_us);
            }
        }
        let mut entries: Vec<ProfileEntry> = times
            .into_iter()
            .filter_map(|(chunk, mut at)| {
                // At most one time per trace (Trace rejects repeats), so this fits in u32.
                let runs = u32::try_from(at.len()).ok()?;
                if runs < min_runs {
                    return None;
                }
                at.sort_unstable();
                let first_touch_us = at[(at.len() - 1) / 2];
                Some(ProfileEntry { chunk, first_touch_us, runs })
            })
            .collect();
        entries.sort_unstable_by_key(|e| (e.first_touch_us, e.chunk));
        Ok(Self { image, traces: count, min_runs, entries })
    }

    /// The image the profile was made for.
    pub fn image(&self) -> ImageId {
        self.image
    }

    /// How many traces were merged.
    pub fn traces(&self) -> u32 {
        self.traces
    }

    /// The threshold used: chunks touched by fewer traces were dropped.
    pub fn min_runs(&self) -> u32 {
        self.min_runs
    }

    /// The chunks, in fetch order.
    pub fn entries(&self) -> &[ProfileEntry] {
        &self.entries
    }

    /// Check that the profile belongs to `image` and names only chunks of `map` (its block map).
    pub fn check_against(&self, image: ImageId, map: &BlockMap) -> Result<(), ProfileError> {
        check_chunks(image, self.image, self.entries.iter().map(|e| e.chunk), map)
    }

    /// How much of the image described by `map` the profile covers. Chunks `map` does not have
    /// count in `chunks` but add no bytes ([`Self::check_against`] rejects them).
    pub fn coverage(&self, map: &BlockMap) -> Coverage {
        let len: HashMap<ChunkId, u32> = map.chunks().iter().map(|c| (c.id, c.len)).collect();
        let bytes = self.entries.iter().filter_map(|e| len.get(&e.chunk)).map(|&l| u64::from(l)).sum();
        Coverage {
            chunks: self.entries.len() as u64,
            bytes,
            image_chunks: len.len() as u64,
            image_bytes: len.values().map(|&l| u64::from(l)).sum(),
        }
    }

    /// The canonical encoding.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.bytes(MAGIC);
        w.u32(PROFILE_VERSION);
        w.bytes(&self.image.0 .0);
        w.u32(self.traces);
        w.u32(self.min_runs);
        w.len(self.entries.len());
        for e in &self.entries {
            w.bytes(&e.chunk.0);
            w.u64(e.first_touch_us);
            w.u32(e.runs);
        }
        w.buf
    }

    /// Decode and validate a profile; rejects anything [`Self::encode`] would not produce.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(bytes, "profile");
        r.header(MAGIC, PROFILE_VERSION)?;
        let image = ImageId(Sha256Digest(r.array()?));
        let traces = r.u32()?;
        let min_runs = r.u32()?;
        if traces == 0 {
            return Err(r.not_canonical("traces", "a profile merges at least one trace"));
        }
        if min_runs == 0 || min_runs > traces {
            return Err(r.not_canonical("min_runs", "must be between 1 and traces"));
        }
        let n = r.count(ENTRY_BYTES)?;
        let mut entries = Vec::with_capacity(n);
        let mut seen = HashSet::with_capacity(n);
        for _ in 0..n {
            let chunk = ChunkId(r.array()?);
            let first_touch_us = r.u64()?;
            let runs = r.u32()?;
            if runs < min_runs || runs > traces {
                return Err(r.not_canonical("runs", "outside min_runs..=traces"));
            }
            if let Some(prev) = entries.last().map(|p: &ProfileEntry| (p.first_touch_us, p.chunk)) {
                if prev >= (first_touch_us, chunk) {
                    return Err(r.not_canonical("entries", "not sorted by (first touch, chunk id)"));
                }
            }
            if !seen.insert(chunk) {
                return Err(r.not_canonical("entries", "chunk listed twice"));
            }
            entries.push(ProfileEntry { chunk, first_touch_us, runs });
        }
        r.finish()?;
        Ok(Self { image, traces, min_runs, entries })
    }
}

/// The default `--min-runs` for `traces` traces: a chunk must appear in at least half of them
/// (rounded up), so one odd run neither adds nor removes much.
pub fn default_min_runs(traces: usize) -> u32 {
    u32::try_from(traces.div_ceil(2)).unwrap_or(u32::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(n: u8) -> ImageId {
        ImageId(Sha256Digest::of(&[n]))
    }

    fn chunk(n: u8) -> ChunkId {
        ChunkId::of(&[n])
    }

    fn trace(img: ImageId, touches: &[(u8, u64)]) -> Trace {
        let entries = touches.iter().map(|&(c, at_us)| TraceEntry { chunk: chunk(c), at_us }).collect();
        Trace::new(img, entries).unwrap()
    }

    fn map_with(chunks: &[(u8, u32)]) -> BlockMap {
        let mut b = BlockMap::builder(64);
        for (i, &(c, len)) in chunks.iter().enumerate() {
            let idx = b.add_chunk(chunk(c), len);
            b.push_chunk(i as u64 * 4, 1, idx, 0).unwrap();
        }
        b.finish().unwrap()
    }

    #[test]
    fn trace_roundtrip_and_strictness() {
        let t = trace(image(1), &[(1, 0), (2, 0), (3, 1500)]);
        let text = t.encode();
        assert!(text.starts_with("tessera-trace 1 sha256:"));
        assert_eq!(Trace::decode(text.as_bytes()).unwrap(), t);

        let header = Trace::header_line(image(1));
        let empty = Trace::decode(header.as_bytes()).unwrap();
        assert!(empty.entries().is_empty());

        let c = chunk(1).to_hex();
        let c2 = chunk(2).to_hex();
        let bad = |body: &str| Trace::decode(format!("{header}{body}").as_bytes()).unwrap_err().to_string();
        assert!(bad(&format!("5 {c}")).contains("final newline"));
        assert!(bad(&format!("05 {c}\n")).contains("canonical"));
        assert!(bad(&format!("+5 {c}\n")).contains("canonical"));
        assert!(bad(&format!("5  {c}\n")).contains("64 lowercase hex"));
        assert!(bad(&format!("5 {}\n", c.to_uppercase())).contains("64 lowercase hex"));
        assert!(bad(&format!("99999999999999999999 {c}\n")).contains("64 bits"));
        assert!(bad(&format!("5 {c}\n4 {c2}\n")).contains("backwards"));
        assert!(bad(&format!("5 {c}\n6 {c}\n")).contains("twice"));
        assert!(bad(&format!("5 {c}\n\n")).contains("line 3"));
        assert!(Trace::decode(b"").is_err());
        assert!(Trace::decode(format!("tessera-trace 2 {}\n", image(1)).as_bytes()).is_err());
        assert!(Trace::decode(b"tessera-trace 1 sha256:00\n").is_err());

        assert!(matches!(
            Trace::new(
                image(1),
                vec![TraceEntry { chunk: chunk(1), at_us: 2 }, TraceEntry { chunk: chunk(2), at_us: 1 }]
            ),
            Err(ProfileError::TraceOrder { index: 1 })
        ));
    }

    #[test]
    fn merge_orders_by_median_and_drops_rare_chunks() {
        let img = image(1);
        let traces = [
            trace(img, &[(1, 0), (2, 10), (3, 20), (9, 25)]),
            trace(img, &[(1, 0), (3, 5), (2, 30)]),
            trace(img, &[(2, 0), (1, 1), (3, 50), (8, 60)]),
        ];
        let p = Profile::merge(img, &traces, 2).unwrap();
        let got: Vec<(ChunkId, u64, u32)> =
            p.entries().iter().map(|e| (e.chunk, e.first_touch_us, e.runs)).collect();
        // 1: [0,0,1] → 0; 2: [0,10,30] → 10; 3: [5,20,50] → 20; 8 and 9 seen once → dropped.
        assert_eq!(got, vec![(chunk(1), 0, 3), (chunk(2), 10, 3), (chunk(3), 20, 3)]);
        assert_eq!((p.traces(), p.min_runs()), (3, 2));

        // Lower median with an even count; ties by chunk id.
        let p = Profile::merge(img, &traces[..2], 1).unwrap();
        let t2 = p.entries().iter().find(|e| e.chunk == chunk(2)).unwrap();
        assert_eq!(t2.first_touch_us, 10);
        assert_eq!(p.entries().len(), 4);
        let p = Profile::merge(img, &[trace(img, &[(5, 7), (4, 7)])], 1).unwrap();
        let mut want = [chunk(4), chunk(5)];
        want.sort();
        assert_eq!(p.entries().iter().map(|e| e.chunk).collect::<Vec<_>>(), want);

        assert!(matches!(Profile::merge(img, &[], 1), Err(ProfileError::NoTraces)));
        assert!(matches!(Profile::merge(img, &traces, 0), Err(ProfileError::BadThreshold { .. })));
        assert!(matches!(Profile::merge(img, &traces, 4), Err(ProfileError::BadThreshold { .. })));
        let other = trace(image(2), &[(1, 0)]);
        assert!(matches!(
            Profile::merge(img, &[traces[0].clone(), other], 1),
            Err(ProfileError::WrongImage { .. })
        ));
        assert_eq!((default_min_runs(1), default_min_runs(2), default_min_runs(3)), (1, 1, 2));
    }

    #[test]
    fn profile_roundtrip_and_strict_decode() {
        let img = image(1);
        let p = Profile::merge(img, &[trace(img, &[(1, 5), (2, 10), (3, 20)])], 1).unwrap();
        let bytes = p.encode();
        assert_eq!(&bytes[..8], b"TESSPRF\0");
        assert_eq!(bytes.len(), 8 + 4 + 32 + 4 + 4 + 4 + 3 * ENTRY_BYTES);
        assert_eq!(Profile::decode(&bytes).unwrap(), p);

        let mutate = |at: usize, v: &[u8]| {
            let mut b = bytes.clone();
            b[at..at + v.len()].copy_from_slice(v);
            Profile::decode(&b).unwrap_err().to_string()
        };
        assert!(mutate(0, b"X").contains("bad magic"));
        assert!(mutate(8, &2u32.to_le_bytes()).contains("version 2"));
        assert!(mutate(44, &0u32.to_le_bytes()).contains("traces"));
        assert!(mutate(48, &2u32.to_le_bytes()).contains("min_runs"));
        assert!(mutate(52, &1000u32.to_le_bytes()).contains("truncated"));
        let first = 56;
        let second = first + ENTRY_BYTES;
        // Second entry earlier than the first.
        assert!(mutate(second + 32, &0u64.to_le_bytes()).contains("not sorted"));
        // Same chunk twice (with a later time, so only the repeat is wrong).
        let c1 = bytes[first..first + 32].to_vec();
        assert!(mutate(second, &c1).contains("twice"));
        assert!(mutate(first + 40, &0u32.to_le_bytes()).contains("runs"));
        assert!(mutate(first + 40, &2u32.to_le_bytes()).contains("runs"));
        let mut long = bytes.clone();
        long.push(0);
        assert!(Profile::decode(&long).unwrap_err().to_string().contains("trailing"));
        assert!(Profile::decode(&bytes[..bytes.len() - 1]).is_err());
    }

    #[test]
    fn check_against_and_coverage() {
        let img = image(1);
        let map = map_with(&[(1, 4096), (2, 8192), (3, 4096)]);
        let p = Profile::merge(img, &[trace(img, &[(2, 0), (1, 3)])], 1).unwrap();
        p.check_against(img, &map).unwrap();
        let c = p.coverage(&map);
        assert_eq!(c, Coverage { chunks: 2, bytes: 12288, image_chunks: 3, image_bytes: 16384 });
        assert!((c.percent_of_data() - 75.0).abs() < 1e-9);

        assert!(matches!(p.check_against(image(2), &map), Err(ProfileError::WrongImage { .. })));
        let stray_trace = trace(img, &[(1, 0), (7, 1)]);
        assert!(matches!(stray_trace.check_against(img, &map), Err(ProfileError::UnknownChunk { .. })));
        assert!(matches!(stray_trace.check_against(image(2), &map), Err(ProfileError::WrongImage { .. })));
        trace(img, &[(3, 0)]).check_against(img, &map).unwrap();
        let stray = Profile::merge(img, &[stray_trace], 1).unwrap();
        let err = stray.check_against(img, &map).unwrap_err();
        assert!(matches!(err, ProfileError::UnknownChunk { chunk: c, .. } if c == chunk(7)), "{err}");
        assert!(err.to_string().contains(&chunk(7).to_hex()));
    }
}
