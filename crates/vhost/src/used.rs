//! Completions published into a split ring's used ring, and the decision whether the driver wants
//! to be told.
//!
//! virtio-queue's `add_used` writes the element and the used index through vm-memory's general
//! accessors, a region lookup each (~410 instructions per completion, 11 % of a warm 4 KiB read's,
//! callgrind 2026-12-06), and its `needs_notification` counts on a tally only that `add_used`
//! keeps. [`UsedRing`] translates the ring once for a batch of completions and publishes each one
//! exactly as virtio-queue does — the element, then the index with `Release`, one completion at a
//! time (the in-flight area's crash protocol needs the index to move one completion at a time) —
//! and [`Published`] keeps the tally for [`needs_signal`], which decides as virtio-queue's
//! `needs_notification` does. A ring that no single memory region holds whole is written through
//! vm-memory's general path, with the same outcome.

use std::num::Wrapping;
use std::sync::atomic::{fence, AtomicU16, Ordering};

use virtio_queue::{Error, QueueT};
use vm_memory::bitmap::BS;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, Permissions, VolatileSlice};

/// Bytes before the used ring's elements: `flags: u16, idx: u16`.
const USED_HEADER: u64 = 4;
/// One used element: `id: u32, len: u32`.
const USED_ELEMENT: u64 = 8;
/// Bytes before the avail ring's entries: `flags: u16, idx: u16`.
const AVAIL_HEADER: u64 = 4;
/// One avail entry: `u16`.
const AVAIL_ELEMENT: u64 = 2;

/// How many completions a queue published since its driver was last considered for a signal
/// (virtio-queue's private `num_added`). Kept beside the ring, changed only under the ring's
/// lock. It never counts fewer than were published: a tally left from before a ring restarted
/// only makes the next decision signal when it need not have, which a driver tolerates (it looks
/// at its used ring and finds nothing new); a missed signal would leave it waiting.
#[derive(Debug, Default)]
pub struct Published(AtomicU16);

impl Published {
    /// Forget the tally (the ring starts afresh).
    pub fn reset(&self) {
        self.0.store(0, Ordering::Relaxed);
    }
}

/// A queue's used ring, translated once for a batch of completions.
pub struct UsedRing<'m, M: GuestMemory + ?Sized> {
    mem: &'m M,
    ring: GuestAddress,
    /// The header and the elements, when one region holds them whole.
    slice: Option<VolatileSlice<'m, BS<'m, M::Bitmap>>>,
}

impl<'m, M: GuestMemory + ?Sized> UsedRing<'m, M> {
    /// The used ring of `queue` in `mem`.
    pub fn new<Q: QueueT>(mem: &'m M, queue: &Q) -> Self {
        let ring = GuestAddress(queue.used_ring());
        let len = (USED_HEADER + USED_ELEMENT * u64::from(queue.size())) as usize;
        let slice = mem
            .get_slices(ring, len, Permissions::Write)
            .ok()
            .and_then(|mut slices| slices.next())
            .and_then(Result::ok)
            .filter(|s| s.len() == len);
        UsedRing { mem, ring, slice }
    }

    /// Publish the completion of the chain at `head` (`len` bytes written into its buffers):
    /// what `QueueT::add_used` does, counted in `published`.
    pub fn add<Q: QueueT>(
        &self,
        queue: &mut Q,
        published: &Published,
        head: u16,
        len: u32,
    ) -> Result<(), Error> {
        let size = queue.size();
        if head >= size {
            return Err(Error::InvalidDescriptorIndex);
        }
        let next = Wrapping(queue.next_used());
        let slot = USED_HEADER + u64::from(next.0 % size) * USED_ELEMENT;
        let mut element = [0u8; USED_ELEMENT as usize];
        element[..4].copy_from_slice(&u32::from(head).to_le_bytes());
        element[4..].copy_from_slice(&len.to_le_bytes());
        let index = (next + Wrapping(1)).0.to_le();
        match &self.slice {
            Some(s) => {
                // In bounds: `slot` + 8 ≤ the slice's length, which covers every element.
                s.write_obj(element, slot as usize).map_err(|e| Error::GuestMemory(e.into()))?;
                s.store(index, 2, Ordering::Release).map_err(|e| Error::GuestMemory(e.into()))?;
            }
            None => {
                let at = self.ring.checked_add(slot).ok_or(Error::AddressOverflow)?;
                self.mem.write_obj(element, at).map_err(Error::GuestMemory)?;
                let at = self.ring.checked_add(2).ok_or(Error::AddressOverflow)?;
                self.mem.store(index, at, Ordering::Release).map_err(Error::GuestMemory)?;
            }
        }
        queue.set_next_used((next + Wrapping(1)).0);
        published.0.store(published.0.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
        Ok(())
    }
}

impl<M: GuestMemory + ?Sized> std::fmt::Debug for UsedRing<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UsedRing")
            .field("ring", &self.ring)
            .field("translated", &self.slice.is_some())
            .finish()
    }
}

/// Whether the driver of `queue` wants a signal for the completions `published` since the last
/// decision — `QueueT::needs_notification`: with `VIRTIO_F_EVENT_IDX`, when the driver's
/// `used_event` lies among them; without it, always. Resets the tally.
pub fn needs_signal<Q: QueueT, M: GuestMemory + ?Sized>(
    queue: &Q,
    mem: &M,
    published: &Published,
) -> Result<bool, Error> {
    // The elements and index written before the driver's `used_event` is read.
    fence(Ordering::SeqCst);
    if !queue.event_idx_enabled() {
        return Ok(true);
    }
    let at = GuestAddress(queue.avail_ring())
        .checked_add(AVAIL_HEADER + AVAIL_ELEMENT * u64::from(queue.size()))
        .ok_or(Error::AddressOverflow)?;
    let used_event =
        Wrapping(u16::from_le(mem.load::<u16>(at, Ordering::Relaxed).map_err(Error::GuestMemory)?));
    let added = Wrapping(published.0.swap(0, Ordering::Relaxed));
    let used = Wrapping(queue.next_used());
    // `used_event` among the `added` indexes before `used` (wrapping): the kernel's
    // `vring_need_event`.
    Ok(used - used_event - Wrapping(1) < added)
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::Queue;
    use vm_memory::GuestMemoryMmap;

    use super::*;

    /// The same bytes in the used ring, the same index, the same errors and the same signal
    /// decisions as virtio-queue's own `add_used` / `needs_notification`, on random sequences of
    /// completions and driver `used_event`s, with EVENT_IDX and without, for a ring that one
    /// region holds and one that straddles two regions.
    #[test]
    fn matches_virtio_queue() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for case in 0..400 {
            // With the second layout the used ring straddles the boundary of two adjacent
            // regions.
            let split = case % 2 == 1;
            let ranges: &[(GuestAddress, usize)] = if split {
                &[(GuestAddress(0), 0x1000), (GuestAddress(0x1000), 0x10000)]
            } else {
                &[(GuestAddress(0), 0x11000)]
            };
            let mem_a = GuestMemoryMmap::<()>::from_ranges(ranges).expect("memory");
            let mem_b = GuestMemoryMmap::<()>::from_ranges(ranges).expect("memory");
            const SIZE: u16 = 16;
            // The mock lays out the descriptor table (0xe90..0xf90), the avail ring (0xf90..0xfb6)
            // and the used ring (0xfb8..0x103e) back to back: the used ring crosses 0x1000.
            let start = GuestAddress(0xe90);
            let mock_a = MockSplitQueue::create(&mem_a, start, SIZE);
            let mock_b = MockSplitQueue::create(&mem_b, start, SIZE);
            let mut qa: Queue = mock_a.create_queue().expect("queue");
            let mut qb: Queue = mock_b.create_queue().expect("queue");
            let event_idx = rng.gen_bool(0.7);
            qa.set_event_idx(event_idx);
            qb.set_event_idx(event_idx);
            let start_used = rng.gen::<u16>();
            qa.set_next_used(start_used);
            qb.set_next_used(start_used);
            let used_ring = GuestAddress(qa.used_ring());
            let ring_len = (USED_HEADER + USED_ELEMENT * u64::from(SIZE)) as usize;
            let published = Published::default();
            let mut translated = false;
            for _ in 0..64 {
                let ring = UsedRing::new(&mem_b, &qb);
                translated |= ring.slice.is_some();
                for _ in 0..rng.gen_range(0..5) {
                    let head = if rng.gen_ratio(1, 12) {
                        rng.gen_range(SIZE..u16::MAX)
                    } else {
                        rng.gen_range(0..SIZE)
                    };
                    let len = rng.gen::<u32>();
                    let theirs = qa.add_used(&mem_a, head, len);
                    let ours = ring.add(&mut qb, &published, head, len);
                    assert_eq!(format!("{theirs:?}"), format!("{ours:?}"), "add_used({head}, {len})");
                }
                assert_eq!(qa.next_used(), qb.next_used());
                let (mut a, mut b) = (vec![0u8; ring_len], vec![0u8; ring_len]);
                mem_a.read_slice(&mut a, used_ring).expect("ring");
                mem_b.read_slice(&mut b, used_ring).expect("ring");
                assert_eq!(a, b, "used ring bytes");
                // The driver moves its used_event now and then, near the index or anywhere.
                if rng.gen_bool(0.5) {
                    let event = if rng.gen_bool(0.7) {
                        qa.next_used().wrapping_add(rng.gen_range(0..8)).wrapping_sub(4)
                    } else {
                        rng.gen()
                    };
                    let at = GuestAddress(qa.avail_ring() + AVAIL_HEADER + AVAIL_ELEMENT * u64::from(SIZE));
                    mem_a.write_obj(event.to_le(), at).expect("used_event");
                    mem_b.write_obj(event.to_le(), at).expect("used_event");
                }
                if rng.gen_bool(0.6) {
                    let theirs = qa.needs_notification(&mem_a).expect("needs_notification");
                    let ours = needs_signal(&qb, &mem_b, &published).expect("needs_signal");
                    assert_eq!(theirs, ours, "signal decision");
                }
            }
            assert_eq!(translated, !split, "the ring is translated exactly when one region holds it");
        }
    }

    /// Rings a guest placed partly or wholly outside its memory, or at the top of the address
    /// space: the same errors, the same bytes and the same index as virtio-queue's own calls.
    #[test]
    fn rings_outside_memory_fail_as_virtio_queue_fails() {
        const SIZE: u16 = 16;
        let ring_len = USED_HEADER + USED_ELEMENT * u64::from(SIZE);
        for (used, avail) in [
            (0x1000 - 40, 0x100),  // the last elements past the end of memory
            (0x1000 - 4, 0x100),   // every element past the end
            (0x3000, 0x100),       // wholly outside
            (0x100, 0x1000 - 6),   // used_event past the end
            (u64::MAX - 3, 0x100), // the addresses wrap
            (0x100, u64::MAX - 1),
        ] {
            let mem_a = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x1000)]).expect("memory");
            let mem_b = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x1000)]).expect("memory");
            let queue = || {
                let mut q = Queue::new(SIZE).expect("queue");
                q.set_size(SIZE);
                q.try_set_used_ring_address(GuestAddress(used)).expect("aligned");
                q.try_set_avail_ring_address(GuestAddress(avail)).expect("aligned");
                q.set_event_idx(true);
                q
            };
            let (mut qa, mut qb) = (queue(), queue());
            let published = Published::default();
            for head in 0..SIZE + 2 {
                let ring = UsedRing::new(&mem_b, &qb);
                let theirs = qa.add_used(&mem_a, head, 512);
                let ours = ring.add(&mut qb, &published, head, 512);
                assert_eq!(format!("{theirs:?}"), format!("{ours:?}"), "used {used:#x}: add_used({head})");
                assert_eq!(qa.next_used(), qb.next_used(), "used {used:#x}");
                let theirs = qa.needs_notification(&mem_a);
                let ours = needs_signal(&qb, &mem_b, &published);
                assert_eq!(format!("{theirs:?}"), format!("{ours:?}"), "used {used:#x}: signal after {head}");
            }
            let (mut a, mut b) = (vec![0u8; 0x1000], vec![0u8; 0x1000]);
            mem_a.read_slice(&mut a, GuestAddress(0)).expect("memory");
            mem_b.read_slice(&mut b, GuestAddress(0)).expect("memory");
            assert!(a == b, "used {used:#x}: memory differs (ring of {ring_len} bytes)");
        }
    }

    /// A tally left from before the ring restarted can only add signals, never lose one.
    #[test]
    fn a_stale_tally_never_loses_a_signal() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10000)]).expect("memory");
        let mock = MockSplitQueue::new(&mem, 16);
        let mut q: Queue = mock.create_queue().expect("queue");
        q.set_event_idx(true);
        let published = Published::default();
        let ring = UsedRing::new(&mem, &q);
        for head in 0..3 {
            ring.add(&mut q, &published, head, 0).expect("add");
        }
        // The ring restarts elsewhere without a decision in between; the driver wants a signal
        // for the first completion after the restart.
        q.set_next_used(1000);
        let at = GuestAddress(q.avail_ring() + AVAIL_HEADER + AVAIL_ELEMENT * 16);
        mem.write_obj(1000u16.to_le(), at).expect("used_event");
        ring.add(&mut q, &published, 0, 0).expect("add");
        assert!(needs_signal(&q, &mem, &published).expect("decision"));
        // Nothing new since: no signal.
        assert!(!needs_signal(&q, &mem, &published).expect("decision"));
    }
}
