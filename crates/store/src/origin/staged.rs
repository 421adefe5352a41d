//! Stored ranges fetched ahead of their readers: the chunks of an image's prefetch profile, whose
//! places a ref names (`docs/formats/store.md`, "Refs"), fetched while a remote start fetches
//! the image's metadata — before the image is open and its profile's prefetch can ask for them.
//!
//! A range is registered before its fetch starts; a read of bytes inside one takes them from it,
//! waiting while its fetch is under way, and goes to the origin as usual if the fetch failed. A
//! range leaves once its bytes were all read (the profile's prefetch reads each chunk once), so
//! what is held is at most what the ref named and the reads have not taken yet. The bytes are
//! stored bytes like any the origin returns: the reader checks each chunk against its id, so a
//! stale ref costs its fetch, never wrong bytes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use tessera_image::Sha256Digest;

/// One range's fetch: queued, under way, done, or failed (or given up to a reader).
#[derive(Debug, Default)]
pub(crate) struct Slot {
    state: Mutex<SlotState>,
    cv: Condvar,
}

#[derive(Debug, Default)]
enum SlotState {
    /// Its fetch has not started.
    #[default]
    Queued,
    Fetching,
    /// The range's bytes, or `None`: its fetch failed, or a reader came before it started.
    Done(Option<Arc<[u8]>>),
}

impl Slot {
    /// The staged fetch is about to fetch the range: `false` if a reader came first (it fetches
    /// the range itself).
    pub(crate) fn start(&self) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(*s, SlotState::Queued) {
            *s = SlotState::Fetching;
            return true;
        }
        false
    }

    /// The fetch ended: with the range's bytes, or `None` when it failed.
    pub(crate) fn fill(&self, bytes: Option<Vec<u8>>) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if !matches!(*s, SlotState::Done(_)) {
            *s = SlotState::Done(bytes.map(Arc::from));
        }
        drop(s);
        self.cv.notify_all();
    }

    /// The range's bytes: waiting while its fetch is under way; `None` if it failed or had not
    /// started (the caller fetches the range itself; the staged fetch skips it).
    fn wait(&self) -> Option<Arc<[u8]>> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            match &*s {
                SlotState::Queued => {
                    *s = SlotState::Done(None);
                    return None;
                }
                SlotState::Fetching => s = self.cv.wait(s).unwrap_or_else(|p| p.into_inner()),
                SlotState::Done(bytes) => return bytes.clone(),
            }
        }
    }
}

#[derive(Debug)]
struct Staged {
    pack: Sha256Digest,
    offset: u64,
    len: u32,
    /// Bytes read from it so far.
    taken: u64,
    slot: Arc<Slot>,
}

/// The ranges fetched ahead, until read.
#[derive(Debug, Default)]
pub(crate) struct Staging {
    ranges: Mutex<Vec<Staged>>,
    /// How many ranges are held: reads check the list only when there are some.
    count: AtomicUsize,
}

impl Staging {
    /// Register `ranges` of `pack` (each `(offset, len)`), their fetches about to start: one slot
    /// each, in order. A range already registered is not registered again (no slot for it).
    pub(crate) fn add(&self, pack: &Sha256Digest, ranges: &[(u64, u32)]) -> Vec<Option<Arc<Slot>>> {
        let mut held = self.ranges.lock().unwrap_or_else(|p| p.into_inner());
        let slots = ranges
            .iter()
            .map(|&(offset, len)| {
                if len == 0 || held.iter().any(|s| s.pack == *pack && s.offset == offset) {
                    return None;
                }
                let slot = Arc::new(Slot::default());
                held.push(Staged { pack: *pack, offset, len, taken: 0, slot: Arc::clone(&slot) });
                Some(slot)
            })
            .collect();
        self.count.store(held.len(), Ordering::Release);
        slots
    }

    /// Bytes `[offset, offset + len)` of `pack` if registered ranges hold them (one, or several
    /// back to back: a long range is fetched in pieces): waiting for their fetches while under
    /// way; `None` if no ranges hold them all or a fetch failed (its range goes then). A range
    /// whose bytes were all taken goes.
    pub(crate) fn take(&self, pack: &Sha256Digest, offset: u64, len: u32) -> Option<Vec<u8>> {
        if self.count.load(Ordering::Acquire) == 0 || len == 0 {
            return None;
        }
        let end = offset.checked_add(u64::from(len))?;
        // The ranges tiling [offset, end), in order.
        let tiles: Vec<(u64, u32, Arc<Slot>)> = {
            let held = self.ranges.lock().unwrap_or_else(|p| p.into_inner());
            let mut tiles = Vec::new();
            let mut at = offset;
            while at < end {
                let s = held
                    .iter()
                    .find(|s| s.pack == *pack && s.offset <= at && at < s.offset + u64::from(s.len))?;
                tiles.push((s.offset, s.len, Arc::clone(&s.slot)));
                at = s.offset + u64::from(s.len);
            }
            tiles
        };
        let mut out = Vec::with_capacity(len as usize);
        // Per tile: its part was there (a failed fetch, or an answer short of the range, is not).
        let mut good = Vec::with_capacity(tiles.len());
        for (start, tile_len, slot) in &tiles {
            let (from, to) = (offset.max(*start), end.min(start + u64::from(*tile_len)));
            let bytes = slot.wait();
            let piece = bytes.as_ref().and_then(|b| {
                let a = usize::try_from(from - start).ok()?;
                b.get(a..a + usize::try_from(to - from).ok()?)
            });
            if let Some(p) = piece {
                out.extend_from_slice(p);
            }
            good.push(piece.is_some());
        }
        let mut held = self.ranges.lock().unwrap_or_else(|p| p.into_inner());
        for ((start, tile_len, slot), good) in tiles.iter().zip(&good) {
            let taken = end.min(start + u64::from(*tile_len)) - offset.max(*start);
            if let Some(i) = held.iter().position(|s| Arc::ptr_eq(&s.slot, slot)) {
                held[i].taken += taken;
                if !good || held[i].taken >= u64::from(held[i].len) {
                    held.remove(i);
                }
            }
        }
        let failed = good.contains(&false);
        self.count.store(held.len(), Ordering::Release);
        (!failed).then_some(out)
    }

    /// Ranges held, and their bytes.
    pub(crate) fn held(&self) -> (usize, u64) {
        let held = self.ranges.lock().unwrap_or_else(|p| p.into_inner());
        (held.len(), held.iter().map(|s| u64::from(s.len)).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const P: Sha256Digest = Sha256Digest([1; 32]);
    const Q: Sha256Digest = Sha256Digest([2; 32]);

    #[test]
    fn reads_inside_a_range_take_its_bytes_once_it_is_in() {
        let staging = Arc::new(Staging::default());
        let slots = staging.add(&P, &[(100, 10), (200, 4)]);
        assert_eq!(slots.len(), 2);
        assert!(staging.add(&P, &[(100, 10)])[0].is_none(), "registered once");
        assert_eq!(staging.take(&Q, 100, 10), None, "another pack");
        assert_eq!(staging.take(&P, 95, 10), None, "not inside a range");
        assert_eq!(staging.take(&P, 105, 10), None, "past its end");
        assert!(slots[0].as_ref().unwrap().start());
        assert!(slots[1].as_ref().unwrap().start());
        let reader = {
            let staging = Arc::clone(&staging);
            std::thread::spawn(move || staging.take(&P, 102, 3))
        };
        std::thread::sleep(Duration::from_millis(30));
        assert!(!reader.is_finished(), "a read waits for the range's fetch");
        slots[0].as_ref().unwrap().fill(Some((0u8..10).collect()));
        assert_eq!(reader.join().unwrap(), Some(vec![2, 3, 4]));
        assert_eq!(staging.held(), (2, 14));
        // The rest of the range, in two reads: then it goes.
        assert_eq!(staging.take(&P, 100, 2), Some(vec![0, 1]));
        assert_eq!(staging.take(&P, 105, 5), Some(vec![5, 6, 7, 8, 9]));
        assert_eq!(staging.held(), (1, 4));
        assert_eq!(staging.take(&P, 100, 2), None, "taken whole: gone");
        // A failed fetch: the read goes to the origin (None), and the range goes.
        slots[1].as_ref().unwrap().fill(None);
        assert_eq!(staging.take(&P, 200, 4), None);
        assert_eq!(staging.held(), (0, 0));
        // Bytes shorter than the range (a bad answer) are not served.
        let short = staging.add(&Q, &[(0, 8)]);
        assert!(short[0].as_ref().unwrap().start());
        short[0].as_ref().unwrap().fill(Some(vec![1, 2, 3]));
        assert_eq!(staging.take(&Q, 4, 4), None);
        assert_eq!(staging.held(), (0, 0));
        // A range whose fetch has not started is the reader's to fetch: the staged fetch then
        // skips it.
        let queued = staging.add(&Q, &[(100, 8)]);
        assert_eq!(staging.take(&Q, 100, 8), None);
        assert!(!queued[0].as_ref().unwrap().start(), "the reader took it over");
        assert_eq!(staging.held(), (0, 0));
    }

    /// A long range fetched in pieces: a read across pieces takes each piece's part; a read
    /// not wholly inside registered ranges goes to the origin.
    #[test]
    fn a_read_across_pieces_of_a_range_takes_them_in_order() {
        let staging = Staging::default();
        let slots = staging.add(&P, &[(0, 4), (4, 4), (8, 4), (20, 4)]);
        for (k, slot) in slots.iter().enumerate() {
            assert!(slot.as_ref().unwrap().start());
            slot.as_ref().unwrap().fill(Some(((k as u8 * 10)..(k as u8 * 10 + 4)).collect()));
        }
        assert_eq!(staging.take(&P, 2, 8), Some(vec![2, 3, 10, 11, 12, 13, 20, 21]));
        assert_eq!(staging.take(&P, 10, 12), None, "a hole between 12 and 20");
        // [0, 4) and [8, 12) are in part taken and stay; [4, 8) is taken whole and goes.
        assert_eq!(staging.held(), (3, 12));
    }
}
