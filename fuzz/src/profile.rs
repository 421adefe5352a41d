//! `profile`: the prefetch profile decoder ([`Profile::decode`], `TESSPRF`,
//! `docs/formats/profile.md`), a per-store blob read by `serve` and `warm --profile-only`, and
//! [`Profile::merge`], which makes one from boot traces.
//!
//! Input: `u8 mode`, then
//!
//! | mode % 2 | rest |
//! |---|---|
//! | 0 | raw profile bytes |
//! | 1 | traces to merge (see [`structured`]) |
//!
//! Properties: never a panic, no allocation beyond the input's size; a profile that decodes
//! re-encodes to the identical bytes, its entries are sorted by (first touch, chunk id), each
//! chunk once, with `min_runs ≤ runs ≤ traces`; the encoding cut short by a byte does not decode.
//! A merged profile encodes, decodes to itself, keeps exactly the chunks touched by at least
//! `min_runs` traces, and is refused for another image.

use std::collections::HashMap;

use tessera_image::{ChunkId, ImageId, Profile, Sha256Digest, Trace, TraceEntry};

use crate::{Input, Output};

pub const MODE_RAW: u8 = 0;
pub const MODE_MERGE: u8 = 1;

/// The fuzz target body.
pub fn run(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else { return };
    if mode % 2 == MODE_RAW {
        raw(rest);
    } else {
        structured(rest);
    }
}

fn raw(data: &[u8]) {
    let Ok(p) = Profile::decode(data) else { return };
    check(&p);
    let bytes = p.encode();
    assert!(bytes == data, "profile decode/encode is not the identity");
    assert!(Profile::decode(&bytes[..bytes.len() - 1]).is_err(), "a cut-short profile decodes");
}

fn check(p: &Profile) {
    assert!(p.traces() >= 1 && (1..=p.traces()).contains(&p.min_runs()));
    let mut seen = std::collections::HashSet::new();
    for w in p.entries().windows(2) {
        assert!((w[0].first_touch_us, w[0].chunk) < (w[1].first_touch_us, w[1].chunk), "not sorted");
    }
    for e in p.entries() {
        assert!((p.min_runs()..=p.traces()).contains(&e.runs), "runs outside min_runs..=traces");
        assert!(seen.insert(e.chunk), "a chunk listed twice");
    }
}

/// `u8 traces` (1–8), `u8 min_runs`, then per trace `u8 entries` × (`u8 chunk`, `u16 µs step`): chunk
/// ids from a small alphabet (so traces overlap), times non-decreasing. A trace that
/// [`Trace::new`] refuses (a chunk twice) is dropped.
pub fn structured(data: &[u8]) {
    let mut i = Input::new(data);
    let image = ImageId(Sha256Digest::of(b"image"));
    let count = usize::from(i.u8() % 8) + 1;
    let min_runs = u32::from(i.u8());
    let mut traces = Vec::new();
    for _ in 0..count {
        let mut at = 0u64;
        let entries = (0..i.u8() % 64)
            .map(|_| {
                let chunk = ChunkId::of(&[i.u8() % 32]);
                at += u64::from(i.u16());
                TraceEntry { chunk, at_us: at }
            })
            .collect();
        if let Ok(t) = Trace::new(image, entries) {
            let text = t.encode();
            assert_eq!(Trace::decode(text.as_bytes()).expect("an encoded trace does not decode"), t);
            traces.push(t);
        }
    }
    let Ok(p) = Profile::merge(image, &traces, min_runs) else {
        assert!(traces.is_empty() || min_runs == 0 || min_runs as usize > traces.len());
        return;
    };
    check(&p);
    assert_eq!(p.traces() as usize, traces.len());
    let mut runs: HashMap<ChunkId, u32> = HashMap::new();
    for t in &traces {
        for e in t.entries() {
            *runs.entry(e.chunk).or_default() += 1;
        }
    }
    let kept = runs.values().filter(|&&r| r >= min_runs).count();
    assert_eq!(p.entries().len(), kept, "merge kept the wrong chunks");
    for e in p.entries() {
        assert_eq!(runs.get(&e.chunk), Some(&e.runs));
    }
    let bytes = p.encode();
    assert_eq!(Profile::decode(&bytes).expect("a merged profile does not decode"), p);
    let other = ImageId(Sha256Digest::of(b"other"));
    assert!(Profile::merge(other, &traces, min_runs).is_err(), "merged traces of another image");
}

/// Seeds: a merged profile (raw), a one-entry profile (raw), three overlapping traces to merge.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let image = ImageId(Sha256Digest::of(b"image"));
    let entry = |c: u8, at_us| TraceEntry { chunk: ChunkId::of(&[c]), at_us };
    let traces = [
        Trace::new(image, vec![entry(1, 0), entry(2, 10), entry(3, 10), entry(4, 500)]),
        Trace::new(image, vec![entry(2, 0), entry(1, 7), entry(5, 9)]),
        Trace::new(image, vec![entry(1, 0), entry(3, 3)]),
    ]
    .into_iter()
    .collect::<Result<Vec<_>, _>>()
    .expect("seed traces");
    let raw = |p: Profile| {
        let mut v = vec![MODE_RAW];
        v.extend_from_slice(&p.encode());
        v
    };
    let mut merge = Output::default();
    merge.u8(MODE_MERGE).u8(3).u8(2);
    for t in [&[(1u8, 0u16), (2, 10), (3, 0), (4, 490)][..], &[(2, 0), (1, 7), (5, 2)], &[(1, 0), (3, 3)]] {
        merge.u8(t.len() as u8);
        for &(c, step) in t {
            merge.u8(c).u16(step);
        }
    }
    vec![
        ("merged".into(), raw(Profile::merge(image, &traces, 2).expect("seed profile"))),
        ("one-trace".into(), raw(Profile::merge(image, &traces[2..], 1).expect("seed profile"))),
        ("merge-three".into(), merge.buf),
    ]
}
