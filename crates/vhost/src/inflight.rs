//! vhost-user in-flight I/O tracking (`VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`), split rings.
//!
//! The front-end (QEMU's vhost-user-blk) asks for a shared memory area with `GET_INFLIGHT_FD`,
//! keeps its file, and hands it back with `SET_INFLIGHT_FD` to every back-end it connects to —
//! also to a daemon restarted after a crash. The back-end marks each descriptor chain head in
//! flight when it takes the chain off the avail ring and clears the mark when the used element
//! is published, so a restarted daemon knows exactly which requests the dead one took but never
//! completed, and resubmits them (oldest first) instead of losing them: without this, QEMU
//! restarts the ring at the used index and the guest waits forever for those requests, or
//! re-pops chains that already completed.
//!
//! The layout is the one of QEMU's `docs/interop/vhost-user.rst` ("Inflight I/O tracking") and
//! libvhost-user, one region per queue, each `queue_region_size(queue_size)` bytes:
//!
//! ```text
//! QueueRegionSplit { features: u64, version: u16, desc_num: u16, last_batch_head: u16,
//!                    used_idx: u16, desc: [DescStateSplit; desc_num] }
//! DescStateSplit   { inflight: u8, padding: [u8; 5], next: u16, counter: u64 }
//! ```
//!
//! Completing one request (what [`QueueInflight::add_used`] does): `last_batch_head = head`;
//! write the used element and bump the ring's used index; `desc[head].inflight = 0`;
//! `used_idx = ` the ring's used index. A crash between the bump and the clear leaves
//! `used_idx` behind the ring's: recovery then clears `last_batch_head`, which was published.
//! Recovery ([`QueueInflight::recover`]) counts the heads still in flight, puts the ring's next
//! avail index at `used + in_flight` and returns the heads ordered by their counter.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Mutex;

use vhost::vhost_user::message::VhostUserInflight;
use vhost_user_backend::VringState;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueT};

use crate::backend::GuestMem;
use crate::used::{Published, UsedRing};
use vm_memory::bitmap::BS;
use vm_memory::{
    Address, Bytes, FileOffset, GuestAddress, GuestMemory, MmapRegion, Permissions, VolatileMemory,
    VolatileSlice,
};

/// Each queue's region is aligned to this many bytes (as QEMU's libvhost-user does).
pub const INFLIGHT_ALIGNMENT: usize = 64;
/// The region version this back-end writes and understands.
pub const INFLIGHT_VERSION: u16 = 1;
/// `features`, `version`, `desc_num`, `last_batch_head`, `used_idx`.
const HEADER_LEN: usize = 16;
/// One `DescStateSplit`.
const DESC_LEN: usize = 16;
const OFF_VERSION: usize = 8;
const OFF_DESC_NUM: usize = 10;
const OFF_LAST_BATCH_HEAD: usize = 12;
const OFF_USED_IDX: usize = 14;
const DESC_OFF_INFLIGHT: usize = 0;
const DESC_OFF_COUNTER: usize = 8;
/// virtio's limit on a split ring's size.
const MAX_QUEUE_SIZE: u16 = 32768;

/// The bytes one queue of `queue_size` descriptors takes in the area.
pub fn queue_region_size(queue_size: u16) -> usize {
    let len = HEADER_LEN + DESC_LEN * usize::from(queue_size);
    len.div_ceil(INFLIGHT_ALIGNMENT) * INFLIGHT_ALIGNMENT
}

/// The shared in-flight area of one connection: one region per queue.
#[derive(Debug)]
pub struct InflightArea {
    map: MmapRegion<()>,
    queue_size: u16,
    queues: Vec<QueueTrack>,
}

/// What the back-end keeps per queue besides the shared region.
#[derive(Debug, Default)]
struct QueueTrack {
    /// The counter the next popped head gets.
    counter: AtomicU64,
    /// Heads recovered by [`QueueInflight::recover`], oldest first, not resubmitted yet.
    resubmit: Mutex<Vec<u16>>,
}

/// What recovering a queue found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// Where the ring's next avail index goes: the used index plus the heads in flight.
    pub next_avail: u16,
    /// The heads in flight, oldest first.
    pub resubmit: Vec<u16>,
}

impl InflightArea {
    /// `GET_INFLIGHT_FD`: a fresh, zeroed area (a memfd) for `num_queues` queues of
    /// `queue_size` descriptors; the reply to send and the file.
    pub fn create(num_queues: u16, queue_size: u16) -> io::Result<(Self, VhostUserInflight, File)> {
        check_geometry(num_queues, queue_size)?;
        let size = usize::from(num_queues) * queue_region_size(queue_size);
        let fd = rustix::fs::memfd_create("tessera-inflight", rustix::fs::MemfdFlags::CLOEXEC)?;
        let file = File::from(fd);
        file.set_len(size as u64)?;
        let reply = VhostUserInflight { mmap_size: size as u64, mmap_offset: 0, num_queues, queue_size };
        let area = Self::open(file.try_clone()?, &reply)?;
        Ok((area, reply, file))
    }

    /// `SET_INFLIGHT_FD`: map the area `inflight` describes in `file` (after a reconnect, the
    /// one a previous daemon filled).
    pub fn open(file: File, inflight: &VhostUserInflight) -> io::Result<Self> {
        check_geometry(inflight.num_queues, inflight.queue_size)?;
        let need = usize::from(inflight.num_queues) * queue_region_size(inflight.queue_size);
        let size = usize::try_from(inflight.mmap_size).map_err(|_| invalid("mmap_size too large"))?;
        if size < need {
            return Err(invalid("the inflight area is smaller than its queues need"));
        }
        let map = MmapRegion::from_file(FileOffset::new(file, inflight.mmap_offset), size)
            .map_err(|e| io::Error::other(format!("mapping the inflight area: {e}")))?;
        let queues = (0..inflight.num_queues).map(|_| QueueTrack::default()).collect();
        Ok(Self { map, queue_size: inflight.queue_size, queues })
    }

    /// The tracking of queue `queue`, if the area has it.
    pub fn queue(&self, queue: usize) -> Option<QueueInflight<'_>> {
        let track = self.queues.get(queue)?;
        let len = queue_region_size(self.queue_size);
        let region = self.map.get_slice(queue * len, len).ok()?;
        Some(QueueInflight { region, track, size: self.queue_size })
    }
}

fn check_geometry(num_queues: u16, queue_size: u16) -> io::Result<()> {
    if num_queues == 0 || queue_size == 0 || queue_size > MAX_QUEUE_SIZE {
        return Err(invalid("the inflight area needs 1 or more queues of 1 to 32768 descriptors"));
    }
    Ok(())
}

fn invalid(what: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what)
}

/// The in-flight tracking of one queue (a view of its region).
#[derive(Debug)]
pub struct QueueInflight<'a> {
    region: VolatileSlice<'a>,
    track: &'a QueueTrack,
    /// Descriptors the region has room for.
    size: u16,
}

impl QueueInflight<'_> {
    fn desc(&self, head: u16) -> Option<usize> {
        (head < self.size).then(|| HEADER_LEN + DESC_LEN * usize::from(head))
    }

    // The region is a fixed-size mapping checked against `size` on creation: the accesses below
    // are in bounds, so their errors are ignored (there is nothing a caller could do).
    fn store<T: vm_memory::AtomicAccess>(&self, val: T, at: usize) {
        let _ = self.region.store(val, at, Ordering::Release);
    }

    fn load<T: vm_memory::AtomicAccess + Default>(&self, at: usize) -> T {
        self.region.load(at, Ordering::Acquire).unwrap_or_default()
    }

    /// Whether `head` is marked in flight.
    pub fn is_inflight(&self, head: u16) -> bool {
        self.desc(head).is_some_and(|d| self.load::<u8>(d + DESC_OFF_INFLIGHT) == 1)
    }

    /// `head` was taken off the avail ring: mark it in flight, with the next counter.
    pub fn popped(&self, head: u16) {
        let Some(d) = self.desc(head) else { return };
        let counter = self.track.counter.fetch_add(1, Ordering::Relaxed);
        self.store(counter, d + DESC_OFF_COUNTER);
        self.store(1u8, d + DESC_OFF_INFLIGHT);
    }

    /// Publish the used element of `head` on `queue` through `used` ([`UsedRing::add`]),
    /// recording the completion in the region around it.
    pub fn add_used<Q: QueueT, M: GuestMemory + ?Sized>(
        &self,
        queue: &mut Q,
        used: &UsedRing<'_, M>,
        published: &Published,
        head: u16,
        len: u32,
    ) -> Result<(), virtio_queue::Error> {
        let Some(d) = self.desc(head) else { return used.add(queue, published, head, len) };
        self.store(head, OFF_LAST_BATCH_HEAD);
        fence(Ordering::SeqCst);
        used.add(queue, published, head, len)?;
        fence(Ordering::SeqCst);
        self.store(0u8, d + DESC_OFF_INFLIGHT);
        fence(Ordering::SeqCst);
        self.store(queue.next_used(), OFF_USED_IDX);
        Ok(())
    }

    /// The ring was (re)started with `used_idx` in its used ring: a fresh region is initialised
    /// (nothing to resubmit); one a previous back-end filled yields the heads it left in flight,
    /// oldest first, which [`Self::take_resubmit`] then hands out once.
    pub fn recover(&self, used_idx: u16) -> Recovery {
        if self.load::<u16>(OFF_VERSION) != INFLIGHT_VERSION {
            self.store(INFLIGHT_VERSION, OFF_VERSION);
            self.store(self.size, OFF_DESC_NUM);
            self.store(used_idx, OFF_USED_IDX);
            self.track.counter.store(0, Ordering::Relaxed);
            return Recovery { next_avail: used_idx, resubmit: Vec::new() };
        }
        if self.load::<u16>(OFF_USED_IDX) != used_idx {
            // The last completion reached the used ring but not the region.
            let last = self.load::<u16>(OFF_LAST_BATCH_HEAD);
            if let Some(d) = self.desc(last) {
                self.store(0u8, d + DESC_OFF_INFLIGHT);
            }
            fence(Ordering::SeqCst);
            self.store(used_idx, OFF_USED_IDX);
        }
        let mut heads: Vec<(u64, u16)> = (0..self.size)
            .filter(|&h| self.is_inflight(h))
            .map(|h| (self.desc(h).map_or(0, |d| self.load::<u64>(d + DESC_OFF_COUNTER)), h))
            .collect();
        heads.sort_unstable();
        let next = heads.last().map_or(0, |&(c, _)| c.wrapping_add(1));
        self.track.counter.store(next, Ordering::Relaxed);
        let resubmit: Vec<u16> = heads.into_iter().map(|(_, h)| h).collect();
        // At most `size` (≤ 32768) heads: fits a u16.
        let in_flight = u16::try_from(resubmit.len()).unwrap_or(u16::MAX);
        *lock(&self.track.resubmit) = resubmit.clone();
        Recovery { next_avail: used_idx.wrapping_add(in_flight), resubmit }
    }

    /// The heads recovered and not resubmitted yet (oldest first); empty from then on.
    pub fn take_resubmit(&self) -> Vec<u16> {
        std::mem::take(&mut *lock(&self.track.resubmit))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The descriptors of the chain at `head` in the descriptor table at `desc_table` of a ring of
/// `queue_size`, indirect tables followed, read as they are asked for: every chain a worker
/// serves, taken off the avail ring or resubmitted from the in-flight area. The walk is bounded
/// the way virtio-queue's `DescriptorChain` bounds it (at most the table's size, one level of
/// indirection, at most 2^32 bytes; checked against it on random tables in the tests); a
/// descriptor outside guest memory ends it.
///
/// It reads a table through one translation of the whole table when one memory region holds
/// it: `DescriptorChain` reads each descriptor through vm-memory's general `read_obj` (~230
/// instructions apiece, three per usual request: the largest part of a request's own cost after
/// the 2026-12-06 changes).
pub struct Walk<'m, M: GuestMemory + ?Sized> {
    mem: &'m M,
    table: GuestAddress,
    /// `table` translated, when one region holds it whole.
    slice: Option<VolatileSlice<'m, BS<'m, M::Bitmap>>>,
    size: u16,
    index: u16,
    ttl: u16,
    indirect: bool,
    bytes: u32,
}

impl<'m, M: GuestMemory + ?Sized> Walk<'m, M> {
    /// The walk of the chain at `head`.
    pub fn new(mem: &'m M, desc_table: GuestAddress, queue_size: u16, head: u16) -> Self {
        let mut w = Walk {
            mem,
            table: desc_table,
            slice: None,
            size: queue_size,
            index: head,
            ttl: queue_size,
            indirect: false,
            bytes: 0,
        };
        w.translate();
        w
    }

    fn translate(&mut self) {
        let len = usize::from(self.size) * DESC_LEN;
        self.slice = self
            .mem
            .get_slices(self.table, len, Permissions::Read)
            .ok()
            .and_then(|mut slices| slices.next())
            .and_then(Result::ok)
            .filter(|s| s.len() == len);
    }

    fn read(&self, index: u16) -> Option<Descriptor> {
        let offset = usize::from(index) * DESC_LEN;
        match &self.slice {
            Some(s) => s.read_obj::<Descriptor>(offset).ok(),
            None => self.mem.read_obj::<Descriptor>(self.table.checked_add(offset as u64)?).ok(),
        }
    }
}

impl<M: GuestMemory + ?Sized> std::fmt::Debug for Walk<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Walk")
            .field("table", &self.table)
            .field("translated", &self.slice.is_some())
            .field("size", &self.size)
            .field("index", &self.index)
            .field("ttl", &self.ttl)
            .field("indirect", &self.indirect)
            .finish()
    }
}

impl<M: GuestMemory + ?Sized> Iterator for Walk<'_, M> {
    type Item = Descriptor;

    fn next(&mut self) -> Option<Descriptor> {
        loop {
            if self.ttl == 0 || self.index >= self.size {
                return None;
            }
            let Some(desc) = self.read(self.index) else {
                self.ttl = 0;
                return None;
            };
            if desc.refers_to_indirect_table() {
                let len = desc.len();
                if self.indirect || len % DESC_LEN as u32 != 0 || len / DESC_LEN as u32 > u32::from(u16::MAX)
                {
                    self.ttl = 0;
                    return None;
                }
                self.table = desc.addr();
                self.indirect = true;
                self.index = 0;
                self.size = u16::try_from(len / DESC_LEN as u32).unwrap_or(0);
                self.ttl = self.size;
                self.translate();
                continue;
            }
            let Some(total) = self.bytes.checked_add(desc.len()) else {
                self.ttl = 0;
                return None;
            };
            self.bytes = total;
            if desc.has_next() {
                self.index = desc.next();
                self.ttl -= 1;
            } else {
                self.ttl = 0;
            }
            return Some(desc);
        }
    }
}

/// The next chain for a queue's worker: a head left in flight by an earlier daemon first
/// (`resubmit`, oldest first), then the next one on the avail ring, marked in flight in `track`.
pub fn next_chain<'m, M: GuestMemory>(
    queue: &mut Queue,
    mem: &'m M,
    track: Option<&QueueInflight<'_>>,
    resubmit: &mut impl Iterator<Item = u16>,
) -> Option<(u16, Walk<'m, M>)> {
    let table = GuestAddress(queue.desc_table());
    if let Some(head) = resubmit.next() {
        return Some((head, Walk::new(mem, table, queue.size(), head)));
    }
    // The avail ring's entry only: the chain's descriptors are read by the walk.
    let head = queue.pop_descriptor_chain(mem)?.head_index();
    if let Some(t) = track {
        t.popped(head);
    }
    Some((head, Walk::new(mem, table, queue.size(), head)))
}

/// Publish the used element of `head` through `used`, through `track` when the front-end
/// shares an area.
pub fn add_used<Q: QueueT, M: GuestMemory + ?Sized>(
    track: Option<&QueueInflight<'_>>,
    queue: &mut Q,
    used: &UsedRing<'_, M>,
    published: &Published,
    head: u16,
    len: u32,
) -> Result<(), virtio_queue::Error> {
    match track {
        Some(t) => t.add_used(queue, used, published, head, len),
        None => used.add(queue, published, head, len),
    }
}

/// A ring just started (`vring_ready`): recover `track` against its used index and point the
/// ring's avail and used indexes past what completed and what is to be resubmitted. How many
/// heads are to be resubmitted.
pub fn recover<M: GuestMemory>(
    state: &mut VringState<GuestMem>,
    mem: &M,
    track: &QueueInflight<'_>,
) -> io::Result<usize> {
    let queue = state.get_queue_mut();
    let used = queue.used_idx(mem, Ordering::Acquire).map_err(io::Error::other)?.0;
    let r = track.recover(used);
    queue.set_next_avail(r.next_avail);
    queue.set_next_used(used);
    Ok(r.resubmit.len())
}

/// Kick a ring that just started, as if the driver had: its worker serves it as soon as it
/// watches the kick (after `SET_VRING_ENABLE`). After a reconnect the driver may be waiting for
/// requests it made while no daemon ran — or that a killed one took — and kicks no more.
pub fn kick(state: &VringState<GuestMem>) -> io::Result<()> {
    if let Some(kick) = state.get_kick() {
        // SAFETY: the kick eventfd is owned by `state`, borrowed for the length of this call.
        let fd = unsafe { BorrowedFd::borrow_raw(kick.as_raw_fd()) };
        rustix::io::write(fd, &1u64.to_ne_bytes())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::desc::split::Descriptor as SplitDesc;
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::Queue;
    use vm_memory::GuestMemoryMmap;

    fn area(queues: u16, size: u16) -> (InflightArea, VhostUserInflight, File) {
        InflightArea::create(queues, size).expect("inflight area")
    }

    #[test]
    fn region_size_is_aligned_and_holds_the_descriptors() {
        assert_eq!(queue_region_size(128), 2112); // 16 + 16 * 128 = 2064, up to 64
        assert_eq!(queue_region_size(1) % INFLIGHT_ALIGNMENT, 0);
        assert!(queue_region_size(256) >= HEADER_LEN + DESC_LEN * 256);
        let (_, reply, file) = area(2, 128);
        assert_eq!(reply.mmap_size, 2 * 2112);
        assert_eq!(file.metadata().expect("stat").len(), 2 * 2112);
        assert!(InflightArea::create(0, 128).is_err());
        assert!(InflightArea::create(1, 0).is_err());
    }

    #[test]
    fn a_fresh_region_is_initialised_and_has_nothing_to_resubmit() {
        let (a, _, _) = area(1, 8);
        let q = a.queue(0).expect("queue 0");
        assert_eq!(q.recover(5), Recovery { next_avail: 5, resubmit: vec![] });
        assert_eq!(q.load::<u16>(OFF_VERSION), INFLIGHT_VERSION);
        assert_eq!(q.load::<u16>(OFF_DESC_NUM), 8);
        assert_eq!(q.load::<u16>(OFF_USED_IDX), 5);
        assert!(a.queue(1).is_none());
    }

    /// Pop heads, complete some through a real queue, then reopen the area from its file as a
    /// restarted daemon would: the rest come back oldest first, the next avail index skips them.
    #[test]
    fn a_restarted_backend_resubmits_what_was_in_flight_in_pop_order() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10000)]).expect("memory");
        let mock = MockSplitQueue::new(&mem, 8);
        let mut queue: Queue = mock.create_queue().expect("queue");
        let (a, reply, file) = area(1, 8);
        let q = a.queue(0).expect("queue 0");
        q.recover(0);
        for head in [3, 0, 6, 1] {
            q.popped(head);
        }
        assert!(q.is_inflight(3) && q.is_inflight(6));
        let published = Published::default();
        let used = UsedRing::new(&mem, &queue);
        q.add_used(&mut queue, &used, &published, 0, 512).expect("add_used");
        q.add_used(&mut queue, &used, &published, 1, 512).expect("add_used");
        assert!(!q.is_inflight(0) && !q.is_inflight(1));
        assert_eq!(q.load::<u16>(OFF_USED_IDX), 2);
        drop(a);

        let again = InflightArea::open(file, &reply).expect("reopen");
        let q = again.queue(0).expect("queue 0");
        let r = q.recover(queue.next_used());
        assert_eq!(r, Recovery { next_avail: 4, resubmit: vec![3, 6] });
        assert_eq!(q.take_resubmit(), vec![3, 6]);
        assert!(q.take_resubmit().is_empty());
        // New pops count on from the newest resubmitted head (6, counter 2).
        q.popped(5);
        assert_eq!(q.load::<u64>(HEADER_LEN + DESC_LEN * 5 + DESC_OFF_COUNTER), 3);
    }

    /// A crash after the used element was published but before the region caught up: the
    /// region's used index lags the ring's, and `last_batch_head` is cleared on recovery.
    #[test]
    fn a_completion_published_but_not_cleared_is_not_resubmitted() {
        let (a, _, _) = area(1, 8);
        let q = a.queue(0).expect("queue 0");
        q.recover(10);
        q.popped(2);
        q.popped(4);
        // What add_used does before the ring's bump, then the crash.
        q.store(4u16, OFF_LAST_BATCH_HEAD);
        let r = q.recover(11);
        assert_eq!(r, Recovery { next_avail: 12, resubmit: vec![2] });
        // The other way round: the crash came before the bump: the head is resubmitted.
        let (b, _, _) = area(1, 8);
        let q = b.queue(0).expect("queue 0");
        q.recover(10);
        q.popped(4);
        q.store(4u16, OFF_LAST_BATCH_HEAD);
        assert_eq!(q.recover(10), Recovery { next_avail: 11, resubmit: vec![4] });
    }

    #[test]
    fn heads_outside_the_region_are_not_tracked() {
        let (a, _, _) = area(1, 4);
        let q = a.queue(0).expect("queue 0");
        q.recover(0);
        q.popped(4);
        q.popped(u16::MAX);
        assert_eq!(q.recover(0).resubmit, Vec::<u16>::new());
    }

    #[test]
    fn a_short_area_is_refused() {
        let (_, mut reply, file) = area(2, 128);
        reply.num_queues = 4;
        assert!(InflightArea::open(file, &reply).is_err());
    }

    #[test]
    fn chains_are_walked_from_the_table_with_indirect_tables() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10000)]).expect("memory");
        let table = GuestAddress(0x1000);
        let put = |at: GuestAddress, i: u16, d: SplitDesc| {
            mem.write_obj(d, at.unchecked_add(u64::from(i) * 16)).expect("write desc");
        };
        use virtio_bindings::bindings::virtio_ring::{
            VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
        };
        let next = VRING_DESC_F_NEXT as u16;
        let write = VRING_DESC_F_WRITE as u16;
        put(table, 2, SplitDesc::new(0x8000, 16, next, 5));
        put(table, 5, SplitDesc::new(0x9000, 512, next | write, 7));
        put(table, 7, SplitDesc::new(0xa000, 1, write, 0));
        let chain: Vec<_> = Walk::new(&mem, table, 8, 2).collect();
        assert_eq!(chain.iter().map(|d| d.addr().0).collect::<Vec<_>>(), vec![0x8000, 0x9000, 0xa000]);
        // Indirect: head 3 points at a table of two.
        let ind = GuestAddress(0x2000);
        put(table, 3, SplitDesc::new(ind.0, 32, VRING_DESC_F_INDIRECT as u16, 0));
        put(ind, 0, SplitDesc::new(0xb000, 16, next, 1));
        put(ind, 1, SplitDesc::new(0xc000, 1, write, 0));
        let chain: Vec<_> = Walk::new(&mem, table, 8, 3).collect();
        assert_eq!(chain.iter().map(|d| d.addr().0).collect::<Vec<_>>(), vec![0xb000, 0xc000]);
        // A loop ends at the table's size; a head past it yields nothing.
        put(table, 0, SplitDesc::new(0xd000, 1, next, 0));
        assert_eq!(Walk::new(&mem, table, 8, 0).count(), 8);
        assert_eq!(Walk::new(&mem, table, 8, 9).count(), 0);
    }

    /// The walk yields what virtio-queue's own `DescriptorChain` yields, on random descriptor
    /// tables: links anywhere (loops included), heads past the table, indirect tables (nested,
    /// misaligned, empty, in the second region, across the hole, outside memory), lengths that
    /// add past 2^32.
    #[test]
    fn walks_match_virtio_queue_chains() {
        use rand::{Rng, SeedableRng};
        use virtio_bindings::bindings::virtio_ring::{
            VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
        };
        const SIZE: u16 = 16;
        let mem = GuestMemoryMmap::<()>::from_ranges(&[
            (GuestAddress(0), 0x10000),
            (GuestAddress(0x10000), 0x1000),
            (GuestAddress(0x20000), 0x10000),
        ])
        .expect("memory");
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (mut yielded, mut indirect_walks) = (0usize, 0usize);
        for case in 0..3000 {
            let mock = MockSplitQueue::new(&mem, SIZE);
            let table = mock.desc_table_addr();
            // Indirect tables: in the first region, straddling the first two regions, in the
            // third, or reaching past the end of memory.
            let tables = [0x8000u64, 0x10ff0 - 16 * 4, 0x2f000, 0x2fff0];
            let random_desc = |rng: &mut rand::rngs::StdRng, within: u16| {
                let mut flags = 0u16;
                if rng.gen_bool(0.6) {
                    flags |= VRING_DESC_F_NEXT as u16;
                }
                if rng.gen_bool(0.4) {
                    flags |= VRING_DESC_F_WRITE as u16;
                }
                let (addr, len) = if rng.gen_ratio(1, 6) {
                    flags |= VRING_DESC_F_INDIRECT as u16;
                    let len =
                        if rng.gen_ratio(1, 8) { rng.gen_range(0..200) } else { 16 * rng.gen_range(0..6) };
                    (tables[rng.gen_range(0..tables.len())], len)
                } else if rng.gen_ratio(1, 10) {
                    (0x1000, u32::MAX - rng.gen_range(0..0x1000))
                } else {
                    (rng.gen_range(0..0x30000u64), rng.gen_range(0..0x2000))
                };
                let next = if rng.gen_ratio(1, 10) {
                    rng.gen_range(0..u16::MAX)
                } else {
                    rng.gen_range(0..within + 2)
                };
                SplitDesc::new(addr, len, flags, next)
            };
            for i in 0..SIZE {
                let d = random_desc(&mut rng, SIZE);
                mem.write_obj(d, table.unchecked_add(u64::from(i) * 16)).expect("desc");
            }
            for &t in &tables {
                for i in 0..6u64 {
                    let d = random_desc(&mut rng, 6);
                    // Some of these fall outside memory: then they are simply not there.
                    let _ = mem.write_obj(d, GuestAddress(t + i * 16));
                }
            }
            // Four heads on the avail ring, one of them past the table now and then.
            let heads: Vec<u16> = (0..4)
                .map(|_| if case % 7 == 0 { rng.gen_range(0..SIZE + 3) } else { rng.gen_range(0..SIZE) })
                .collect();
            for (i, &h) in heads.iter().enumerate() {
                mock.avail().ring().ref_at(i).expect("avail slot").store(u16::to_le(h));
            }
            mock.avail().idx().store(u16::to_le(heads.len() as u16));
            let mut queue: Queue = mock.create_queue().expect("queue");
            for &h in &heads {
                let theirs: Vec<(u64, u32, u16, u16)> = match queue.pop_descriptor_chain(&mem) {
                    Some(c) => {
                        assert_eq!(c.head_index(), h);
                        c.map(|d| (d.addr().0, d.len(), d.flags(), d.next())).collect()
                    }
                    None => Vec::new(),
                };
                let walk = Walk::new(&mem, table, SIZE, h);
                let ours: Vec<(u64, u32, u16, u16)> =
                    walk.map(|d| (d.addr().0, d.len(), d.flags(), d.next())).collect();
                assert_eq!(ours, theirs, "case {case}, head {h}");
                yielded += ours.len();
                let mut w = Walk::new(&mem, table, SIZE, h);
                while w.next().is_some() {}
                indirect_walks += usize::from(w.indirect);
            }
        }
        // The cases reach long chains and indirect tables, not only refusals.
        assert!(
            yielded > 10_000 && indirect_walks > 500,
            "{yielded} descriptors, {indirect_walks} indirect walks"
        );
    }
}
