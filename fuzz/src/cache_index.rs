//! `cache_index`: the host disk cache's index journal (`DIR/v1/index`, `docs/formats/cache.md`),
//! shared by every process using the cache and rebuilt by a scan when malformed. The file part
//! (`crates/store/src/cache/journal.rs`) reads new bytes, checks UTF-8 and hands the text to the
//! pure replay this target fuzzes: [`LruIndex::replay`] over [`Record::parse`] and
//! [`EntryKey::parse`] (`tessera_store::cache_index`).
//!
//! Input: `u8 split`, then the journal bytes. Properties: never a panic; a journal that replays
//! replays the same when read in two pieces cut at a line boundary (as a process catching up
//! does: whole lines first, the rest later with the line count so far); the partial last line
//! is what follows the last newline; every line re-encodes ([`Record::to_line`]) to a line that
//! parses to the same record; the index's total is the sum of its entries; its snapshot replays
//! to the same snapshot, total and eviction order; eviction frees enough.

use tessera_store::cache_index::{EntryKey, LruIndex, Record, HEADER};

/// The fuzz target body.
pub fn run(data: &[u8]) {
    let Some((&split, rest)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    let mut ix = LruIndex::default();
    let whole = ix.replay(text, 0);

    // Lines parse and re-encode to the same records (the header is not a record).
    for line in text.split_inclusive('\n').skip(1).filter_map(|l| l.strip_suffix('\n')) {
        if let Some(r) = Record::parse(line) {
            let again = r.to_line();
            assert_eq!(Record::parse(again.trim_end_matches('\n')), Some(r), "{line:?} -> {again:?}");
        }
    }

    // Read in two pieces, cut after line `split % (lines + 1)`.
    let lines = text.matches('\n').count();
    let k = usize::from(split) % (lines + 1);
    let cut = text.match_indices('\n').nth(k.wrapping_sub(1)).map_or(0, |(i, _)| i + 1);
    let mut two = LruIndex::default();
    let pieces = two.replay(&text[..cut], 0).and_then(|p| {
        assert_eq!(p, 0, "a piece of whole lines leaves a partial line");
        two.replay(&text[cut..], k)
    });
    assert_eq!(pieces, whole, "replaying in two pieces differs from replaying at once");
    let Ok(partial) = whole else { return };
    assert_eq!(partial, text.len() - text.rfind('\n').map_or(0, |i| i + 1));
    assert_eq!(two.snapshot(), ix.snapshot());

    let sum = ix.keys().fold(0u64, |s, (_, b)| s.saturating_add(b));
    assert_eq!(ix.total_bytes(), sum, "the total is not the sum of the entries");
    assert_eq!(ix.keys().count(), ix.len());
    for (key, bytes) in ix.keys() {
        assert_eq!(ix.get(key), Some(bytes));
        assert_eq!(EntryKey::parse(&key.rel_path()).as_ref(), Some(key), "{}", key.rel_path());
        assert!(!key.lock_name().contains('/'), "a lock name with a slash: {}", key.lock_name());
    }
    let snap = ix.snapshot();
    let mut again = LruIndex::default();
    assert_eq!(again.replay(&snap, 0), Ok(0), "a snapshot does not replay");
    assert_eq!(again.snapshot(), snap);
    assert_eq!(again.total_bytes(), ix.total_bytes());
    assert_eq!(again.victims(0), ix.victims(0));
    for bound in [0, ix.total_bytes() / 2, ix.total_bytes()] {
        let victims = ix.victims(bound);
        let freed = victims.iter().fold(0u64, |s, v| s.saturating_add(v.1));
        assert!(ix.total_bytes().saturating_sub(freed) <= bound || victims.len() == ix.len());
    }
}

/// Seeds: a journal with every entry kind, uses, a replacement, removals and a partial last line;
/// its snapshot; a header alone. The first byte picks the split line.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let hex = |b: u8| format!("{b:02x}").repeat(32);
    let origin = hex(0xab);
    let chunk = format!("chunks/cd/{}.zst.1234", hex(0xcd));
    let raw = format!("chunks/01/{}.raw", hex(0x01));
    let blob = format!("blobs/sha256/{}", hex(0x77));
    let span = format!("spans/5e/{}.gz", hex(0x5e));
    let image = format!("origins/{origin}/images/{}.json", hex(0x02));
    let tag = format!("origins/{origin}/refs/v1.2-rc_3");
    let journal = format!(
        "{HEADER}\n+ 8192 {chunk}\n+ 4096 {raw}\n+ 4096 {blob}\n+ 12288 {span}\n+ 4096 {image}\n\
         + 4096 {tag}\n= {chunk}\n= {blob}\n+ 16384 {raw}\n- {span}\n- {span}\n= {span}\n+ 40"
    );
    let mut ix = LruIndex::default();
    let _ = ix.replay(&journal, 0);
    let with = |split: u8, text: &str| {
        let mut v = vec![split];
        v.extend_from_slice(text.as_bytes());
        v
    };
    vec![
        ("journal".into(), with(5, &journal)),
        ("snapshot".into(), with(3, &ix.snapshot())),
        ("header".into(), with(1, &format!("{HEADER}\n"))),
    ]
}
