//! The overlay's in-memory block map (device blocks → slot runs or zeros) and its free-slot
//! allocator. Pure data structures.

use std::collections::BTreeMap;

/// Where a run of device blocks lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapping {
    /// The blocks read as zeros (DISCARD, WRITE_ZEROES).
    Zero,
    /// Block `start + i` of the extent lives in slot `slot + i`.
    Slot(u64),
}

impl Mapping {
    fn advance(self, by: u64) -> Mapping {
        match self {
            Mapping::Zero => Mapping::Zero,
            Mapping::Slot(s) => Mapping::Slot(s + by),
        }
    }
}

/// A piece of a lookup: `len` blocks from `block`, mapped or (`None`) served by the base image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub block: u64,
    pub len: u64,
    pub mapping: Option<Mapping>,
}

/// Non-overlapping extents keyed by their first block; neighbours that continue each other are
/// merged, so sequential writes into consecutive slots stay one extent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExtentMap {
    extents: BTreeMap<u64, (u64, Mapping)>,
}

impl ExtentMap {
    /// Map blocks `start..start + len` to `mapping`; returns the slot runs `(slot, count)` that
    /// are no longer referenced.
    pub fn set(&mut self, start: u64, len: u64, mapping: Mapping) -> Vec<(u64, u64)> {
        let mut freed = Vec::new();
        if len == 0 {
            return freed;
        }
        let end = start + len;
        // Every extent starting before `end` and ending after `start` overlaps.
        let overlapping: Vec<(u64, u64, Mapping)> = self
            .extents
            .range(..end)
            .rev()
            .take_while(|(&s, &(l, _))| s + l > start)
            .map(|(&s, &(l, m))| (s, l, m))
            .collect();
        for (s, l, m) in overlapping {
            self.extents.remove(&s);
            let e = s + l;
            if s < start {
                self.extents.insert(s, (start - s, m));
            }
            if e > end {
                self.extents.insert(end, (e - end, m.advance(end - s)));
            }
            if let Mapping::Slot(slot) = m {
                let (lo, hi) = (s.max(start), e.min(end));
                freed.push((slot + (lo - s), hi - lo));
            }
        }
        self.insert_merged(start, len, mapping);
        freed.sort_unstable();
        freed
    }

    fn insert_merged(&mut self, mut start: u64, mut len: u64, mut mapping: Mapping) {
        if let Some((&s, &(l, m))) = self.extents.range(..start).next_back() {
            if s + l == start && continues(m, l, mapping) {
                self.extents.remove(&s);
                start = s;
                len += l;
                mapping = m;
            }
        }
        let end = start + len;
        if let Some(&(l, m)) = self.extents.get(&end) {
            if continues(mapping, len, m) {
                self.extents.remove(&end);
                len += l;
            }
        }
        self.extents.insert(start, (len, mapping));
    }

    /// The pieces covering blocks `start..start + len`, in order.
    pub fn lookup(&self, start: u64, len: u64) -> Vec<Piece> {
        let mut out = Vec::new();
        let end = start + len;
        let mut pos = start;
        let first = self.extents.range(..=start).next_back().map(|(&s, _)| s).unwrap_or(start);
        for (&s, &(l, m)) in self.extents.range(first..end) {
            let e = s + l;
            if e <= pos {
                continue;
            }
            if s > pos {
                out.push(Piece { block: pos, len: s - pos, mapping: None });
                pos = s;
            }
            let hi = e.min(end);
            out.push(Piece { block: pos, len: hi - pos, mapping: Some(m.advance(pos - s)) });
            pos = hi;
        }
        if pos < end {
            out.push(Piece { block: pos, len: end - pos, mapping: None });
        }
        out
    }

    /// All extents `(start, len, mapping)` in block order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64, Mapping)> + '_ {
        self.extents.iter().map(|(&s, &(l, m))| (s, l, m))
    }

    /// Number of extents.
    pub fn len(&self) -> usize {
        self.extents.len()
    }

    pub fn is_empty(&self) -> bool {
        self.extents.is_empty()
    }

    /// Blocks held in slots.
    pub fn slot_blocks(&self) -> u64 {
        self.iter().filter(|e| matches!(e.2, Mapping::Slot(_))).map(|e| e.1).sum()
    }
}

/// Whether `b` (starting right after an extent of `len` blocks mapped by `a`) continues it.
fn continues(a: Mapping, len: u64, b: Mapping) -> bool {
    match (a, b) {
        (Mapping::Zero, Mapping::Zero) => true,
        (Mapping::Slot(x), Mapping::Slot(y)) => x + len == y,
        _ => false,
    }
}

/// Free slots: runs below `end` plus everything from `end` on (the file grows there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FreeSpace {
    runs: BTreeMap<u64, u64>,
    end: u64,
    /// Sum of `runs`.
    below: u64,
}

impl FreeSpace {
    /// Slots `first..end` free, none below.
    pub fn new(end: u64) -> Self {
        Self { runs: BTreeMap::new(), end, below: 0 }
    }

    /// The first slot never allocated: the file needs `end` slots.
    pub fn end(&self) -> u64 {
        self.end
    }

    /// Take `n` slots, lowest free runs first, then from the end; returns `(slot, count)` runs.
    pub fn alloc(&mut self, mut n: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        while n > 0 {
            let Some((&s, &l)) = self.runs.iter().next() else { break };
            self.runs.remove(&s);
            let take = l.min(n);
            if l > take {
                self.runs.insert(s + take, l - take);
            }
            push_run(&mut out, s, take);
            self.below -= take;
            n -= take;
        }
        if n > 0 {
            push_run(&mut out, self.end, n);
            self.end += n;
        }
        out
    }

    /// Take `n` slots from the end (none from the runs below it); returns the first.
    pub fn take_end(&mut self, n: u64) -> u64 {
        let first = self.end;
        self.end += n;
        first
    }

    /// Return `count` slots from `slot` (must be allocated).
    pub fn free(&mut self, slot: u64, count: u64) {
        if count == 0 {
            return;
        }
        self.below += count;
        let (mut s, mut l) = (slot, count);
        if let Some((&ps, &pl)) = self.runs.range(..s).next_back() {
            if ps + pl == s {
                self.runs.remove(&ps);
                s = ps;
                l += pl;
            }
        }
        if let Some(nl) = self.runs.remove(&(s + l)) {
            l += nl;
        }
        self.runs.insert(s, l);
    }

    /// Free slots below the end.
    pub fn free_below_end(&self) -> u64 {
        self.below
    }
}

fn push_run(out: &mut Vec<(u64, u64)>, s: u64, l: u64) {
    if let Some(last) = out.last_mut() {
        if last.0 + last.1 == s {
            last.1 += l;
            return;
        }
    }
    out.push((s, l));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(block: u64, len: u64, mapping: Option<Mapping>) -> Piece {
        Piece { block, len, mapping }
    }

    #[test]
    fn lookup_on_empty_and_simple_maps() {
        let mut m = ExtentMap::default();
        assert_eq!(m.lookup(10, 5), vec![p(10, 5, None)]);
        assert!(m.set(10, 4, Mapping::Slot(100)).is_empty());
        assert_eq!(m.lookup(8, 8), vec![p(8, 2, None), p(10, 4, Some(Mapping::Slot(100))), p(14, 2, None)]);
        assert_eq!(m.lookup(12, 1), vec![p(12, 1, Some(Mapping::Slot(102)))]);
        assert_eq!(m.lookup(0, 10), vec![p(0, 10, None)]);
        assert_eq!(m.lookup(14, 10), vec![p(14, 10, None)]);
    }

    #[test]
    fn overwrite_splits_and_frees() {
        let mut m = ExtentMap::default();
        m.set(0, 10, Mapping::Slot(50));
        // Middle overwrite with zeros: slots 53..56 freed, the rest split.
        assert_eq!(m.set(3, 3, Mapping::Zero), vec![(53, 3)]);
        assert_eq!(
            m.lookup(0, 10),
            vec![
                p(0, 3, Some(Mapping::Slot(50))),
                p(3, 3, Some(Mapping::Zero)),
                p(6, 4, Some(Mapping::Slot(56)))
            ]
        );
        // Overwrite spanning all three.
        assert_eq!(m.set(1, 8, Mapping::Slot(200)), vec![(51, 2), (56, 3)]);
        assert_eq!(m.len(), 3);
        assert_eq!(m.slot_blocks(), 10);
        // Exact overwrite of everything.
        let mut freed = m.set(0, 10, Mapping::Zero);
        freed.sort();
        assert_eq!(freed, vec![(50, 1), (59, 1), (200, 8)]);
        assert_eq!(m.iter().collect::<Vec<_>>(), vec![(0, 10, Mapping::Zero)]);
    }

    #[test]
    fn neighbours_merge() {
        let mut m = ExtentMap::default();
        m.set(0, 4, Mapping::Slot(10));
        m.set(4, 4, Mapping::Slot(14));
        m.set(8, 2, Mapping::Slot(30)); // not continuing the slots
        assert_eq!(m.len(), 2);
        m.set(20, 2, Mapping::Zero);
        m.set(22, 2, Mapping::Zero);
        m.set(18, 2, Mapping::Zero);
        assert_eq!(m.iter().filter(|e| e.2 == Mapping::Zero).count(), 1);
        assert_eq!(m.lookup(18, 6), vec![p(18, 6, Some(Mapping::Zero))]);
        // Filling the gap between two extents merges all three when they continue.
        let mut m = ExtentMap::default();
        m.set(0, 2, Mapping::Slot(10));
        m.set(4, 2, Mapping::Slot(14));
        m.set(2, 2, Mapping::Slot(12));
        assert_eq!(m.iter().collect::<Vec<_>>(), vec![(0, 6, Mapping::Slot(10))]);
    }

    #[test]
    fn matches_a_naive_model() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut m = ExtentMap::default();
        let mut model: Vec<Option<Mapping>> = vec![None; 300];
        let mut next_slot = 1000u64;
        for _ in 0..3000 {
            let start = rng.gen_range(0..290u64);
            let len = rng.gen_range(1..=(300 - start).min(20));
            let mapping = if rng.gen_bool(0.3) {
                Mapping::Zero
            } else {
                let s = if rng.gen_bool(0.5) { next_slot } else { rng.gen_range(0..5000) * 100 };
                next_slot = s + len;
                Mapping::Slot(s)
            };
            let freed = m.set(start, len, mapping);
            let mut expect_freed = 0;
            for i in 0..len {
                let old = model[(start + i) as usize];
                if let Some(Mapping::Slot(s)) = old {
                    expect_freed += 1;
                    assert!(freed.iter().any(|&(f, c)| (f..f + c).contains(&s)));
                }
                model[(start + i) as usize] = Some(mapping.advance(i));
            }
            assert_eq!(freed.iter().map(|f| f.1).sum::<u64>(), expect_freed);
            for piece in m.lookup(0, 300) {
                for i in 0..piece.len {
                    assert_eq!(model[(piece.block + i) as usize], piece.mapping.map(|x| x.advance(i)));
                }
            }
        }
    }

    #[test]
    fn free_space_allocates_low_runs_then_grows() {
        let mut f = FreeSpace::new(10);
        assert_eq!(f.alloc(3), vec![(10, 3)]);
        assert_eq!(f.end(), 13);
        f.free(4, 2);
        f.free(7, 1);
        f.free(6, 1); // merges 4..8
        assert_eq!(f.free_below_end(), 4);
        assert_eq!(f.alloc(6), vec![(4, 4), (13, 2)]);
        assert_eq!(f.end(), 15);
        f.free(1, 1);
        f.free(3, 1);
        assert_eq!(f.alloc(3), vec![(1, 1), (3, 1), (15, 1)]);
        assert_eq!(f.free_below_end(), 0);
        // Slots taken from the end and given back become a run below it.
        assert_eq!(f.take_end(4), 16);
        assert_eq!(f.end(), 20);
        assert_eq!(f.alloc(1), vec![(20, 1)], "taken slots are not free until given back");
        f.free(16, 4);
        assert_eq!(f.free_below_end(), 4);
        assert_eq!(f.alloc(5), vec![(16, 4), (21, 1)]);
        assert_eq!(f.free_below_end(), 0);
    }
}
