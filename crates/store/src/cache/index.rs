//! The cache index, pure: entry keys, journal records and the LRU bookkeeping. No I/O here; the
//! journal file that persists it is `journal.rs`. Format: `docs/formats/cache.md`.

use std::collections::{BTreeMap, HashMap};

/// The first line of the journal.
pub const HEADER: &str = "tessera-cache-index 1";

/// Bytes an entry of `len` bytes takes on disk: whole 4 KiB blocks, as on ext4.
pub fn disk_bytes(len: u64) -> u64 {
    len.div_ceil(4096).saturating_mul(4096)
}

/// How a chunk is stored: raw, or a zstd frame of N bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ChunkForm {
    /// `.raw`
    Raw,
    /// `.zst.<N>`
    Zstd(u32),
}

/// One cache entry, named by its path under `DIR/v1`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EntryKey {
    /// `blobs/sha256/<64 hex>`
    Blob([u8; 32]),
    /// `chunks/<2 hex>/<64 hex>.raw` or `.zst.<N>`
    Chunk([u8; 32], ChunkForm),
    /// `origins/<64 hex>/images/<64 hex>.json` or `origins/<64 hex>/refs/<tag>`
    Doc(String),
    /// `spans/<2 hex>/<64 hex>.gz`: the compressed bytes of one checkpoint span of a layer blob
    /// (`--reference-layers` images), named by their blake3.
    Span([u8; 32]),
}

/// Eviction classes: chunks go first, metadata (blobs, entries, tags) last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Class {
    /// Chunks: evicted first.
    Chunk = 0,
    /// Records, prefixes, pack indexes, image entries, tag lookups: evicted only when no chunk
    /// is left to evict.
    Metadata = 1,
}

/// Each byte's value as a lowercase hex digit, or 0xff.
static HEX_DIGIT: [u8; 256] = {
    let mut t = [0xffu8; 256];
    let mut i = 0;
    while i < 10 {
        t[b'0' as usize + i] = i as u8;
        i += 1;
    }
    let mut i = 0;
    while i < 6 {
        t[b'a' as usize + i] = 10 + i as u8;
        i += 1;
    }
    t
};

/// 64 lowercase hex digits as 32 bytes (the journal's form; anything else is `None`). One pass
/// without branches, no allocation: a cache's whole journal (tens of thousands of lines) is
/// parsed when a process first reads it.
fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    let b = s.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    let mut bad = 0u8;
    for (o, pair) in out.iter_mut().zip(b.chunks_exact(2)) {
        let (hi, lo) = (HEX_DIGIT[usize::from(pair[0])], HEX_DIGIT[usize::from(pair[1])]);
        bad |= hi | lo;
        *o = (hi << 4) | (lo & 0x0f);
    }
    (bad & 0xf0 == 0).then_some(out)
}

impl EntryKey {
    /// Parse a path relative to `DIR/v1` (`/`-separated); `None` if it names no entry. No
    /// allocation but a document's path (a journal holds tens of thousands of these).
    pub fn parse(rel: &str) -> Option<Self> {
        // No part below holds a `/`: the hex digits, the chunk forms and tags exclude it.
        let (top, rest) = rel.split_once('/')?;
        match top {
            "blobs" => parse_hex32(rest.strip_prefix("sha256/")?).map(EntryKey::Blob),
            "chunks" => {
                let (fan, name) = rest.split_once('/')?;
                let (hex, form) = name.split_once('.')?;
                let id = parse_hex32(hex)?;
                if fan != &hex[..2] {
                    return None;
                }
                let form = match form {
                    "raw" => ChunkForm::Raw,
                    _ => {
                        let n = form.strip_prefix("zst.")?;
                        if n.starts_with('0') || !n.bytes().all(|b| b.is_ascii_digit()) {
                            return None;
                        }
                        ChunkForm::Zstd(n.parse().ok()?)
                    }
                };
                Some(EntryKey::Chunk(id, form))
            }
            "spans" => {
                let (fan, name) = rest.split_once('/')?;
                let hex = name.strip_suffix(".gz")?;
                let d = parse_hex32(hex)?;
                (fan == &hex[..2]).then_some(EntryKey::Span(d))
            }
            "origins" => {
                let (origin, rest) = rest.split_once('/')?;
                parse_hex32(origin)?;
                let ok = match rest.split_once('/')? {
                    ("images", name) => name.strip_suffix(".json").and_then(parse_hex32).is_some(),
                    ("refs", tag) => tessera_image::validate_tag(tag),
                    _ => false,
                };
                ok.then(|| EntryKey::Doc(rel.to_owned()))
            }
            _ => None,
        }
    }

    /// The path relative to `DIR/v1`.
    pub fn rel_path(&self) -> String {
        match self {
            EntryKey::Blob(d) => format!("blobs/sha256/{}", hex::encode(d)),
            EntryKey::Chunk(id, form) => {
                let hex = hex::encode(id);
                match form {
                    ChunkForm::Raw => format!("chunks/{}/{hex}.raw", &hex[..2]),
                    ChunkForm::Zstd(n) => format!("chunks/{}/{hex}.zst.{n}", &hex[..2]),
                }
            }
            EntryKey::Doc(rel) => rel.clone(),
            EntryKey::Span(d) => {
                let hex = hex::encode(d);
                format!("spans/{}/{hex}.gz", &hex[..2])
            }
        }
    }

    /// The eviction class.
    pub fn class(&self) -> Class {
        match self {
            EntryKey::Chunk(..) | EntryKey::Span(..) => Class::Chunk,
            _ => Class::Metadata,
        }
    }

    /// The name of its miss lock in `locks/` (one flat directory).
    pub fn lock_name(&self) -> String {
        match self {
            EntryKey::Blob(d) => format!("blob-{}", hex::encode(d)),
            EntryKey::Chunk(..) => {
                let p = self.rel_path();
                format!("chunk-{}", p.rsplit('/').next().unwrap_or_default())
            }
            EntryKey::Doc(rel) => format!("doc-{}", rel.replace('/', "-")),
            EntryKey::Span(d) => format!("span-{}", hex::encode(d)),
        }
    }
}

/// One journal line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// `+ <disk bytes> <path>`: the entry was published (or replaced) with this size.
    Add(EntryKey, u64),
    /// `= <path>`: the entry was read.
    Use(EntryKey),
    /// `- <path>`: the entry was removed (evicted, corrupt, or found missing).
    Remove(EntryKey),
}

impl Record {
    /// Parse one line (without its newline); `None` if malformed.
    pub fn parse(line: &str) -> Option<Self> {
        let (op, rest) = line.split_once(' ')?;
        match op {
            "+" => {
                let (bytes, path) = rest.split_once(' ')?;
                if bytes.is_empty() || !bytes.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                Some(Record::Add(EntryKey::parse(path)?, bytes.parse().ok()?))
            }
            "=" => Some(Record::Use(EntryKey::parse(rest)?)),
            "-" => Some(Record::Remove(EntryKey::parse(rest)?)),
            _ => None,
        }
    }

    /// The line, newline included.
    pub fn to_line(&self) -> String {
        match self {
            Record::Add(k, bytes) => format!("+ {bytes} {}\n", k.rel_path()),
            Record::Use(k) => format!("= {}\n", k.rel_path()),
            Record::Remove(k) => format!("- {}\n", k.rel_path()),
        }
    }
}

/// Why a journal was refused (it is then rebuilt by scanning the directory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplayError {
    /// The first line is not [`HEADER`].
    BadHeader,
    /// Line `n` (1-based) is malformed.
    BadLine(usize),
}

/// The entries of the cache with their sizes and recency. Recency is a tick that grows with
/// every add or use; eviction takes the lowest ticks, chunks before metadata.
#[derive(Debug, Default, Clone)]
pub struct LruIndex {
    entries: HashMap<EntryKey, (u64, u64)>,
    order: [BTreeMap<u64, EntryKey>; 2],
    total: u64,
    next_tick: u64,
}

impl LruIndex {
    /// Bytes of all entries.
    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is indexed.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The size of `key`, if indexed.
    pub fn get(&self, key: &EntryKey) -> Option<u64> {
        self.entries.get(key).map(|e| e.0)
    }

    /// Apply one record.
    pub fn apply(&mut self, record: &Record) {
        match record {
            Record::Add(key, bytes) => {
                self.remove(key);
                let tick = self.tick();
                self.total = self.total.saturating_add(*bytes);
                self.order[key.class() as usize].insert(tick, key.clone());
                self.entries.insert(key.clone(), (*bytes, tick));
            }
            Record::Use(key) => {
                let tick = self.tick();
                if let Some(entry) = self.entries.get_mut(key) {
                    let order = &mut self.order[key.class() as usize];
                    order.remove(&entry.1);
                    order.insert(tick, key.clone());
                    entry.1 = tick;
                }
            }
            Record::Remove(key) => self.remove(key),
        }
    }

    fn tick(&mut self) -> u64 {
        self.next_tick += 1;
        self.next_tick
    }

    fn remove(&mut self, key: &EntryKey) {
        if let Some((bytes, tick)) = self.entries.remove(key) {
            self.total = self.total.saturating_sub(bytes);
            self.order[key.class() as usize].remove(&tick);
        }
    }

    /// Replay journal text (header first). A trailing piece without a newline is not applied;
    /// its length is returned so the caller can read it again once complete.
    pub fn replay(&mut self, text: &str, first_line: usize) -> Result<usize, ReplayError> {
        let mut rest = text;
        let mut n = first_line;
        while let Some(end) = rest.find('\n') {
            let line = &rest[..end];
            n += 1;
            if n == 1 {
                if line != HEADER {
                    return Err(ReplayError::BadHeader);
                }
            } else {
                self.apply(&Record::parse(line).ok_or(ReplayError::BadLine(n))?);
            }
            rest = &rest[end + 1..];
        }
        Ok(rest.len())
    }

    /// The entries to evict, least recently used first (chunks before metadata), so that the
    /// rest fits in `bound` bytes.
    pub fn victims(&self, bound: u64) -> Vec<(EntryKey, u64)> {
        let mut excess = self.total.saturating_sub(bound);
        let mut out = Vec::new();
        for order in &self.order {
            for key in order.values() {
                if excess == 0 {
                    return out;
                }
                let bytes = self.entries.get(key).map_or(0, |e| e.0);
                excess = excess.saturating_sub(bytes);
                out.push((key.clone(), bytes));
            }
        }
        out
    }

    /// The journal text of this index: the header and one `+` line per entry, oldest use
    /// first (so replaying it gives the same recency order).
    pub fn snapshot(&self) -> String {
        let mut by_tick: Vec<(&u64, &EntryKey)> = self.order.iter().flat_map(|o| o.iter()).collect();
        by_tick.sort_unstable_by_key(|(t, _)| **t);
        let mut out = format!("{HEADER}\n");
        for (_, key) in by_tick {
            let bytes = self.entries.get(key).map_or(0, |e| e.0);
            out.push_str(&Record::Add(key.clone(), bytes).to_line());
        }
        out
    }

    /// All keys with their sizes, least recently used first within each class.
    pub fn keys(&self) -> impl Iterator<Item = (&EntryKey, u64)> {
        self.order.iter().flat_map(|o| o.values()).map(|k| (k, self.entries.get(k).map_or(0, |e| e.0)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(n: u8) -> EntryKey {
        EntryKey::Chunk([n; 32], ChunkForm::Zstd(1000 + u32::from(n)))
    }

    #[test]
    fn keys_round_trip_and_junk_is_refused() {
        let origin = "ab".repeat(32);
        let keys = [
            EntryKey::Blob([7; 32]),
            chunk(1),
            EntryKey::Chunk([0xcd; 32], ChunkForm::Raw),
            EntryKey::Doc(format!("origins/{origin}/images/{}.json", "01".repeat(32))),
            EntryKey::Doc(format!("origins/{origin}/refs/latest")),
            EntryKey::Span([0x5a; 32]),
        ];
        for k in keys {
            assert_eq!(EntryKey::parse(&k.rel_path()), Some(k.clone()), "{}", k.rel_path());
            assert!(!k.lock_name().contains('/'));
        }
        let hex = "cd".repeat(32);
        for junk in [
            "blobs/sha256/xyz".to_owned(),
            format!("blobs/sha256/{}", "AB".repeat(32)),
            format!("chunks/ab/{hex}.raw"), // wrong fan-out directory
            format!("chunks/cd/{hex}.zst."),
            format!("chunks/cd/{hex}.zst.012"),
            format!("chunks/cd/{hex}.lz4"),
            format!("origins/{origin}/refs/.hidden"),
            format!("origins/{origin}/images/x.json"),
            format!("tmp/{hex}"),
            "../etc/passwd".to_owned(),
            format!("blobs/sha256/{hex}/x"),
            format!("blobs/other/{hex}"),
            format!("chunks/cd/{hex}.raw/x"),
            format!("chunks/cd/x/{hex}.raw"),
            format!("spans/cd/{hex}.gz/x"),
            format!("spans/ab/{hex}.gz"),
            format!("origins/{origin}/images/{hex}.json/x"),
            format!("origins/{origin}/refs/a/b"),
            format!("origins/{origin}/tags/latest"),
            format!("origins/{}/refs/latest", "AB".repeat(32)),
            "blobs".to_owned(),
        ] {
            assert_eq!(EntryKey::parse(&junk), None, "{junk}");
        }
    }

    #[test]
    fn records_round_trip_and_malformed_lines_are_refused() {
        for r in [Record::Add(chunk(1), 8192), Record::Use(chunk(2)), Record::Remove(EntryKey::Blob([1; 32]))]
        {
            let line = r.to_line();
            assert_eq!(Record::parse(line.trim_end_matches('\n')), Some(r));
        }
        let p = chunk(1).rel_path();
        for bad in
            [format!("+ {p}"), format!("+ -1 {p}"), format!("* {p}"), format!("= {p} x"), String::new()]
        {
            assert_eq!(Record::parse(&bad), None, "{bad:?}");
        }
    }

    #[test]
    fn evicts_least_recently_used_chunks_first_then_metadata() {
        let mut ix = LruIndex::default();
        let blob = EntryKey::Blob([9; 32]);
        ix.apply(&Record::Add(blob.clone(), 4096));
        for n in 1..=4 {
            ix.apply(&Record::Add(chunk(n), 8192));
        }
        ix.apply(&Record::Use(chunk(1)));
        assert_eq!(ix.total_bytes(), 4096 + 4 * 8192);
        assert!(ix.victims(ix.total_bytes()).is_empty());
        // 10 KiB over: chunks 2 and 3 (least recently used; 1 was just used).
        let v: Vec<EntryKey> = ix.victims(ix.total_bytes() - 10 * 1024).into_iter().map(|v| v.0).collect();
        assert_eq!(v, vec![chunk(2), chunk(3)]);
        // Everything but 4 KiB: all chunks, then the blob is still kept (fits exactly).
        let v: Vec<EntryKey> = ix.victims(4096).into_iter().map(|v| v.0).collect();
        assert_eq!(v, vec![chunk(2), chunk(3), chunk(4), chunk(1)]);
        assert_eq!(ix.victims(0).last().map(|v| v.0.clone()), Some(blob.clone()), "metadata goes last");
        // Re-adding replaces the size; removing forgets.
        ix.apply(&Record::Add(chunk(2), 4096));
        ix.apply(&Record::Remove(chunk(3)));
        ix.apply(&Record::Remove(chunk(3)));
        ix.apply(&Record::Use(chunk(3)));
        assert_eq!(ix.total_bytes(), 4096 + 3 * 8192 - 4096);
        assert_eq!(ix.len(), 4);
    }

    #[test]
    fn snapshot_replays_to_the_same_order_and_sizes() {
        let mut ix = LruIndex::default();
        for n in 1..=5 {
            ix.apply(&Record::Add(chunk(n), u64::from(n) * 4096));
        }
        ix.apply(&Record::Use(chunk(2)));
        ix.apply(&Record::Add(EntryKey::Blob([1; 32]), 4096));
        ix.apply(&Record::Remove(chunk(4)));
        let mut again = LruIndex::default();
        assert_eq!(again.replay(&ix.snapshot(), 0), Ok(0));
        assert_eq!(again.total_bytes(), ix.total_bytes());
        assert_eq!(again.victims(0), ix.victims(0));
    }

    #[test]
    fn replay_stops_at_a_partial_line_and_refuses_garbage() {
        let p = chunk(1).rel_path();
        let text = format!("{HEADER}\n+ 4096 {p}\n= {p}\n+ 40");
        let mut ix = LruIndex::default();
        assert_eq!(ix.replay(&text, 0), Ok(4), "the partial line is left for later");
        assert_eq!(ix.len(), 1);
        assert_eq!(LruIndex::default().replay("garbage\n", 0), Err(ReplayError::BadHeader));
        let torn = format!("{HEADER}\n+ 4096 {p}\n\0\0\0\n");
        assert_eq!(LruIndex::default().replay(&torn, 0), Err(ReplayError::BadLine(3)));
        // Continuing after line 3 of an earlier read.
        let mut ix = LruIndex::default();
        assert_eq!(ix.replay(&format!("- {p}\n"), 3), Ok(0));
    }

    /// The parsers before they were made allocation-free, for comparison: every `/`-separated
    /// part, and hex checked then decoded by the `hex` crate.
    fn old_hex32(s: &str) -> Option<[u8; 32]> {
        if s.len() != 64 || !s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return None;
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).ok()?;
        Some(out)
    }

    fn parse_by_parts(rel: &str) -> Option<EntryKey> {
        let parts: Vec<&str> = rel.split('/').collect();
        match parts.as_slice() {
            ["blobs", "sha256", hex] => old_hex32(hex).map(EntryKey::Blob),
            ["chunks", fan, name] => {
                let (hex, form) = name.split_once('.')?;
                let id = old_hex32(hex)?;
                if *fan != &hex[..2] {
                    return None;
                }
                let form = match form {
                    "raw" => ChunkForm::Raw,
                    _ => {
                        let n = form.strip_prefix("zst.")?;
                        if n.starts_with('0') || !n.bytes().all(|b| b.is_ascii_digit()) {
                            return None;
                        }
                        ChunkForm::Zstd(n.parse().ok()?)
                    }
                };
                Some(EntryKey::Chunk(id, form))
            }
            ["spans", fan, name] => {
                let hex = name.strip_suffix(".gz")?;
                let d = old_hex32(hex)?;
                (*fan == &hex[..2]).then_some(EntryKey::Span(d))
            }
            ["origins", origin, "images", name] => {
                let hex = name.strip_suffix(".json")?;
                (old_hex32(origin).is_some() && old_hex32(hex).is_some())
                    .then(|| EntryKey::Doc(rel.to_owned()))
            }
            ["origins", origin, "refs", tag] => (old_hex32(origin).is_some()
                && tessera_image::validate_tag(tag))
            .then(|| EntryKey::Doc(rel.to_owned())),
            _ => None,
        }
    }

    /// The one-pass parsers agree with the old ones on valid paths and on every one-character
    /// change of them (an insertion or a replacement by a character that matters to a parser).
    #[test]
    fn parsing_agrees_with_a_split_on_every_slash() {
        let origin = "0f".repeat(32);
        let valid = [
            EntryKey::Blob([0x9a; 32]).rel_path(),
            chunk(3).rel_path(),
            EntryKey::Chunk([0xe1; 32], ChunkForm::Raw).rel_path(),
            EntryKey::Span([0x5a; 32]).rel_path(),
            format!("origins/{origin}/images/{}.json", "b2".repeat(32)),
            format!("origins/{origin}/refs/v1.2-rc_3"),
        ];
        let mut tried = 0;
        for path in &valid {
            assert!(EntryKey::parse(path).is_some(), "{path}");
            let mut variants = vec![path.clone()];
            for (i, _) in path.char_indices() {
                for c in ['/', '.', '0', 'a', 'f', 'g', 'A', '-', '_'] {
                    let mut ins = path.clone();
                    ins.insert(i, c);
                    let mut rep = path.clone();
                    rep.replace_range(i..=i, &c.to_string());
                    variants.push(ins);
                    variants.push(rep);
                }
                variants.push(format!("{}{}", &path[..i], &path[i + 1..]));
            }
            for v in variants {
                assert_eq!(EntryKey::parse(&v), parse_by_parts(&v), "{v}");
                tried += 1;
            }
        }
        assert!(tried > 10_000, "{tried} paths");
    }

    /// How long a process's first read of a journal takes (a measurement, not a check):
    /// `TESSERA_JOURNAL=DIR/v1/index cargo test --release -p tessera-store journal_replay_time --
    /// --ignored --nocapture`.
    #[test]
    #[ignore]
    fn journal_replay_time() {
        let Ok(path) = std::env::var("TESSERA_JOURNAL") else { return };
        let text = std::fs::read_to_string(path).unwrap();
        let mut times = Vec::new();
        for _ in 0..7 {
            let t = std::time::Instant::now();
            let mut ix = LruIndex::default();
            assert_eq!(ix.replay(&text, 0), Ok(0));
            times.push(t.elapsed());
            assert!(!ix.is_empty());
        }
        times.sort();
        println!(
            "{} bytes, {} lines: replay {:?} (median of 7; {:?}..{:?})",
            text.len(),
            text.lines().count(),
            times[3],
            times[0],
            times[6]
        );
    }

    #[test]
    fn disk_bytes_are_whole_blocks() {
        assert_eq!(disk_bytes(0), 0);
        assert_eq!(disk_bytes(1), 4096);
        assert_eq!(disk_bytes(4096), 4096);
        assert_eq!(disk_bytes(4097), 8192);
    }
}
