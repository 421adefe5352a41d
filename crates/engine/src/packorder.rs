//! Pack-order readahead (issue 15, point 4): the builder packs chunks in tree order, so what it
//! laid out together (the files of one directory, a program and the libraries beside it, a
//! file's chunks) is stored together. When a guest read misses chunk `c`, the chunks stored
//! right after `c` in its pack — whatever files they belong to — are likely wanted soon; fetched
//! in the same ranged request as `c`, a serial reader (a program start: open, read, open the
//! next; `cat` of a large file) stops paying one round trip per file or chunk. Fetch-once holds:
//! chunks in memory or already pending are skipped, and the window is counted in stored bytes.
//!
//! A window that grew while the reader went on through it (doubling, fetched ahead in the
//! background) was tried and measured: on the `bench lazy` workloads it cut no demand miss and
//! cost 4–11% more origin bytes (`docs/benchmarks.md`), so the window is fixed.

use crate::fetcher::ChunkPlace;

/// No following chunk.
const NONE: u32 = u32::MAX;

/// For every chunk of an image (BlockMap index), the chunk stored right after it in the same
/// pack, if any.
#[derive(Debug, Clone)]
pub struct PackOrder {
    next: Vec<u32>,
    prev: Vec<u32>,
}

impl PackOrder {
    /// The order of `chunks` chunks stored as `place` says (a chunk without a place has no
    /// neighbours; chunks stored at the same place, the same content under two indexes, follow
    /// each other).
    pub fn new(chunks: usize, place: impl Fn(u32) -> Option<ChunkPlace>) -> Self {
        let mut placed: Vec<(u32, u64, u32, u32)> = (0..chunks)
            .filter_map(|c| {
                let c = u32::try_from(c).ok()?;
                place(c).map(|p| (p.pack, p.offset, p.stored_len, c))
            })
            .collect();
        placed.sort_unstable();
        let mut next = vec![NONE; chunks];
        let mut prev = vec![NONE; chunks];
        for w in placed.windows(2) {
            let (pack, offset, len, c) = w[0];
            let (next_pack, next_offset, _, d) = w[1];
            // Back to back (or the same bytes): a request can carry both without a gap.
            if pack == next_pack
                && (next_offset == offset || offset.checked_add(u64::from(len)) == Some(next_offset))
            {
                next[c as usize] = d;
                prev[d as usize] = c;
            }
        }
        Self { next, prev }
    }

    /// The chunk stored right after `c`, if any.
    pub fn next(&self, c: u32) -> Option<u32> {
        self.next.get(c as usize).copied().filter(|&n| n != NONE)
    }

    /// The chunk stored right before `c`, if any.
    pub fn prev(&self, c: u32) -> Option<u32> {
        self.prev.get(c as usize).copied().filter(|&n| n != NONE)
    }

    /// The chunks stored after `c` in its pack, back to back, within `window` stored bytes
    /// (`stored(c)` says how many a chunk has), leaving out those `skip` says are at hand (in
    /// memory, pending, or asked for already); stops at a gap or after 4096 chunks.
    pub fn after(
        &self,
        c: u32,
        window: u64,
        stored: impl Fn(u32) -> u64,
        skip: impl Fn(u32) -> bool,
    ) -> Vec<u32> {
        let mut out = Vec::new();
        let mut used = 0u64;
        let mut at = c;
        for _ in 0..4096 {
            let Some(n) = self.next(at) else { break };
            used += stored(n);
            if used > window {
                break;
            }
            if !skip(n) {
                out.push(n);
            }
            at = n;
        }
        out
    }

    /// The stretch of its pack chunk `c` is stored in (`c`'s offset in `bytes`-sized, aligned
    /// stretches: `(pack, offset / bytes)`), and the chunks stored in it back to back with `c`,
    /// in pack order (a gap ends it; at most 4096 either side). `None` if `c` has no place.
    pub fn stretch(
        &self,
        c: u32,
        bytes: u64,
        place: impl Fn(u32) -> Option<ChunkPlace>,
    ) -> Option<((u32, u64), Vec<u32>)> {
        let bytes = bytes.max(1);
        let at = place(c)?;
        let key = (at.pack, at.offset / bytes);
        let inside = |n: u32| place(n).is_some_and(|p| p.pack == key.0 && p.offset / bytes == key.1);
        let mut first = c;
        for _ in 0..4096 {
            match self.prev(first) {
                Some(p) if inside(p) => first = p,
                _ => break,
            }
        }
        let mut out = vec![first];
        let mut at = first;
        for _ in 0..8192 {
            match self.next(at) {
                Some(n) if inside(n) => {
                    out.push(n);
                    at = n;
                }
                _ => break,
            }
        }
        Some((key, out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pack 0: chunks 3, 1, 0 back to back (100 bytes each), a gap, then 4; pack 1: 2.
    fn place(c: u32) -> Option<ChunkPlace> {
        let (pack, offset) = match c {
            3 => (0, 0),
            1 => (0, 100),
            0 => (0, 200),
            4 => (0, 1000),
            2 => (1, 300),
            _ => return None,
        };
        Some(ChunkPlace { pack, offset, stored_len: 100 })
    }

    #[test]
    fn chunks_follow_pack_order_not_index_order_and_stop_at_gaps() {
        let order = PackOrder::new(6, place);
        assert_eq!(order.next(3), Some(1));
        assert_eq!(order.next(1), Some(0));
        assert_eq!(order.next(0), None, "a gap before 4");
        assert_eq!(order.next(2), None, "last of pack 1");
        assert_eq!(order.next(5), None, "no place");
        let stored = |_| 100;
        assert_eq!(order.after(3, 1000, stored, |_| false), vec![1, 0]);
        // The window counts stored bytes; skipped chunks still use it.
        assert_eq!(order.after(3, 150, stored, |_| false), vec![1]);
        assert_eq!(order.after(3, 1000, stored, |c| c == 1), vec![0]);
        assert!(order.after(0, 1000, stored, |_| false).is_empty());
        assert_eq!(
            (order.prev(1), order.prev(0), order.prev(3), order.prev(4)),
            (Some(3), Some(1), None, None)
        );
    }

    #[test]
    fn a_stretch_is_the_aligned_part_of_a_pack_around_a_chunk() {
        let order = PackOrder::new(6, place);
        // 256-byte stretches: pack 0's chunks at 0 and 100 are in stretch 0, the one at 200 too
        // (it starts there); 4 at 1000 is in stretch 3, alone.
        assert_eq!(order.stretch(1, 256, place), Some(((0, 0), vec![3, 1, 0])));
        assert_eq!(order.stretch(0, 256, place), Some(((0, 0), vec![3, 1, 0])));
        assert_eq!(order.stretch(4, 256, place), Some(((0, 3), vec![4])));
        // 150-byte stretches: 3 (at 0) and 1 (at 100) share stretch 0; 0 (at 200) is in 1.
        assert_eq!(order.stretch(3, 150, place), Some(((0, 0), vec![3, 1])));
        assert_eq!(order.stretch(0, 150, place), Some(((0, 1), vec![0])));
        assert_eq!(order.stretch(2, 256, place), Some(((1, 1), vec![2])));
        assert_eq!(order.stretch(5, 256, place), None, "no place");
    }
}
