//! Chunk buffers of the memory tier on transparent huge pages.
//!
//! A warm 1 MiB read is a copy out of two or three 512 KiB chunk buffers into guest memory, and
//! on 4 KiB pages every 4 KiB of source costs a TLB miss and a page walk. Measured on this
//! project's 2-vCPU VM (docs/benchmarks.md, issue 11): a 1 MiB copy from a huge-page source ran
//! 1.35× faster than from the heap. So buffers of 64 KiB to 2 MiB are slots of 2 MiB-aligned
//! anonymous mappings advised `MADV_HUGEPAGE` (the kernel backs them with huge pages when
//! `transparent_hugepage/enabled` is `always` or `madvise`, and falls back to small pages
//! otherwise), in power-of-two size classes; smaller buffers (small files' chunks) stay on the
//! heap. A slot freed goes back to its class's free list; a mapping is returned to the kernel
//! once all its slots are free and its class holds at least a mapping's worth of other free
//! slots (one spare per class avoids mapping churn at the boundary).
//!
//! Cost: a buffer occupies its class's slot (a 300 KiB chunk a 512 KiB slot), which
//! [`ChunkBuf::footprint`] reports so the memory tier can weigh chunks by what they hold. The
//! first touch of a mapping may make the kernel compact memory to find a huge page (with
//! `transparent_hugepage/defrag` at its default, `madvise`): that cost falls on the fetch that
//! fills the chunk, never on a read served from memory.

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use rustix::mm::{self, Advice, MapFlags, ProtFlags};

/// A huge page (x86-64 and aarch64 with 4 KiB base pages): the unit of mapping.
pub const HUGE_PAGE: usize = 2 << 20;
/// The smallest buffer put on huge pages.
pub const MIN_HUGE_BUF: usize = 64 << 10;
/// Size classes: 64 KiB, 128 KiB, … 2 MiB.
const CLASSES: usize = (HUGE_PAGE / MIN_HUGE_BUF).trailing_zeros() as usize + 1;

/// A chunk's bytes: immutable once made.
pub struct ChunkBuf(Repr);

enum Repr {
    Heap(Box<[u8]>),
    Huge { ptr: NonNull<u8>, len: usize, class: usize, pool: &'static HugePool },
}

// SAFETY: a huge buffer owns its slot alone (the pool hands a slot to one buffer until that
// buffer is dropped) and its bytes are never written after creation, so sharing or moving it
// across threads is as safe as for a `Box<[u8]>`.
unsafe impl Send for ChunkBuf {}
// SAFETY: as above; `&ChunkBuf` only reads.
unsafe impl Sync for ChunkBuf {}

impl ChunkBuf {
    /// `data` as a chunk buffer: copied into a huge-page slot when its size has a class (and
    /// the process's pool can map one), else kept as it is (no copy).
    pub fn from_vec(data: Vec<u8>) -> Self {
        Self::from_vec_in(HugePool::global(), data)
    }

    /// [`Self::from_vec`] with slots from `pool`.
    pub fn from_vec_in(pool: &'static HugePool, data: Vec<u8>) -> Self {
        if let Some(class) = class_of(data.len()) {
            if let Some(ptr) = pool.take(class) {
                // SAFETY: `ptr` is a slot of `class_size(class) >= data.len()` writable bytes
                // that no other buffer uses, in a mapping of its own, so it cannot overlap
                // `data` (a heap allocation).
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr.as_ptr(), data.len()) };
                return Self(Repr::Huge { ptr, len: data.len(), class, pool });
            }
        }
        Self::on_heap(data)
    }

    /// `data` as a chunk buffer on the heap, as it is.
    pub fn on_heap(data: Vec<u8>) -> Self {
        Self(Repr::Heap(data.into_boxed_slice()))
    }

    /// Bytes of memory the buffer occupies (its slot's size for one on huge pages).
    pub fn footprint(&self) -> usize {
        match &self.0 {
            Repr::Heap(b) => b.len(),
            Repr::Huge { class, .. } => class_size(*class),
        }
    }

    /// Whether the bytes are in a huge-page slot.
    pub fn in_huge_slot(&self) -> bool {
        matches!(self.0, Repr::Huge { .. })
    }
}

impl std::ops::Deref for ChunkBuf {
    type Target = [u8];

    #[inline]
    fn deref(&self) -> &[u8] {
        match &self.0 {
            Repr::Heap(b) => b,
            // SAFETY: the slot holds `len` bytes initialised at creation (copied in), never
            // written since, and stays mapped and ours until this buffer is dropped.
            Repr::Huge { ptr, len, .. } => unsafe { std::slice::from_raw_parts(ptr.as_ptr(), *len) },
        }
    }
}

/// A shared chunk buffer with where its bytes are, read once when it is made: a memory-tier slot
/// holds one, so a hit goes from the slot straight to the bytes. Reading them through the
/// [`ChunkBuf`] itself loads its header from the shared allocation first, one more cache miss per
/// hit when reads are random (the profile of 4 KiB reads at QD32: a tenth of the daemon's time).
/// 24 bytes, a word of them the holder's ([`Self::mark`]), so that a slot with its lock fits in
/// half a cache line.
pub struct Located {
    buf: std::sync::Arc<ChunkBuf>,
    ptr: NonNull<u8>,
    len: u32,
    /// A word for the holder's use (the memory tier: the insertion epoch its hits were last
    /// reported to the cache's policy in).
    pub mark: AtomicU32,
}

// SAFETY: `ptr` only reads the bytes `buf` owns, which are immutable and shared as freely as
// `buf` itself (`ChunkBuf` is `Send + Sync`).
unsafe impl Send for Located {}
// SAFETY: as above.
unsafe impl Sync for Located {}

impl Located {
    /// `buf` located, with `mark` its holder's word; `None` for a buffer of 4 GiB or more (no
    /// chunk is: [`tessera_store::MAX_CHUNK_LEN`]).
    pub fn new(buf: std::sync::Arc<ChunkBuf>, mark: u32) -> Option<Self> {
        let bytes: &[u8] = &buf;
        let (ptr, len) = (NonNull::from(bytes).cast::<u8>(), u32::try_from(bytes.len()).ok()?);
        Some(Self { buf, ptr, len, mark: AtomicU32::new(mark) })
    }

    /// The buffer.
    pub fn buf(&self) -> &std::sync::Arc<ChunkBuf> {
        &self.buf
    }
}

impl std::fmt::Debug for Located {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.buf.fmt(f)
    }
}

impl std::ops::Deref for Located {
    type Target = [u8];

    #[inline]
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` and `len` are `buf`'s bytes as its `deref` gave them; `buf` is alive
        // while `self` is, and its bytes neither move (a boxed slice or a huge-page slot, not
        // the `ChunkBuf` value the `Arc` holds) nor change after creation.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len as usize) }
    }
}

impl Drop for ChunkBuf {
    fn drop(&mut self) {
        if let Repr::Huge { ptr, class, pool, .. } = self.0 {
            pool.give(class, ptr);
        }
    }
}

impl std::fmt::Debug for ChunkBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkBuf").field("len", &self.len()).field("huge", &self.in_huge_slot()).finish()
    }
}

/// The size class of a `len`-byte buffer, if it goes on huge pages.
fn class_of(len: usize) -> Option<usize> {
    (MIN_HUGE_BUF..=HUGE_PAGE)
        .contains(&len)
        .then(|| (len.next_power_of_two() / MIN_HUGE_BUF).trailing_zeros() as usize)
}

fn class_size(class: usize) -> usize {
    MIN_HUGE_BUF << class
}

/// Huge-page mappings cut into slots, one free list per size class.
#[derive(Debug)]
pub struct HugePool {
    classes: [Mutex<Class>; CLASSES],
    mapped: AtomicU64,
    refused: AtomicU64,
}

#[derive(Debug, Default)]
struct Class {
    /// Free slots (addresses), most recently freed last.
    free: Vec<usize>,
    /// Slots in use per mapping (by its base address).
    used: HashMap<usize, u32>,
}

impl HugePool {
    /// An empty pool (tests make their own; the memory tier uses [`Self::global`]).
    pub fn new() -> Self {
        Self {
            classes: std::array::from_fn(|_| Mutex::new(Class::default())),
            mapped: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    /// The process's pool.
    pub fn global() -> &'static HugePool {
        static POOL: OnceLock<HugePool> = OnceLock::new();
        POOL.get_or_init(HugePool::new)
    }

    /// Mappings (of [`HUGE_PAGE`] bytes) held now.
    pub fn mappings(&self) -> u64 {
        self.mapped.load(Ordering::Relaxed)
    }

    /// Mappings the kernel refused (the buffers went to the heap instead).
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    fn class(&self, class: usize) -> MutexGuard<'_, Class> {
        self.classes[class].lock().unwrap_or_else(|p| p.into_inner())
    }

    fn take(&self, class: usize) -> Option<NonNull<u8>> {
        let mut c = self.class(class);
        let addr = match c.free.pop() {
            Some(a) => a,
            None => {
                let Some(base) = map_huge_page() else {
                    self.refused.fetch_add(1, Ordering::Relaxed);
                    return None;
                };
                self.mapped.fetch_add(1, Ordering::Relaxed);
                let size = class_size(class);
                // Lowest slot first out, so pushed last.
                c.free.extend((1..HUGE_PAGE / size).rev().map(|i| base + i * size));
                c.used.insert(base, 0);
                base
            }
        };
        *c.used.entry(addr & !(HUGE_PAGE - 1)).or_insert(0) += 1;
        NonNull::new(addr as *mut u8)
    }

    fn give(&self, class: usize, ptr: NonNull<u8>) {
        let addr = ptr.as_ptr() as usize;
        let base = addr & !(HUGE_PAGE - 1);
        let mut c = self.class(class);
        c.free.push(addr);
        let Some(used) = c.used.get_mut(&base) else { return };
        *used = used.saturating_sub(1);
        let per_page = HUGE_PAGE / class_size(class);
        if *used == 0 && c.free.len() >= 2 * per_page {
            c.used.remove(&base);
            c.free.retain(|&a| a & !(HUGE_PAGE - 1) != base);
            drop(c);
            // SAFETY: the mapping at `base` was made by `map_huge_page` and none of its slots
            // is in use (its count reached zero and its free slots were just withdrawn).
            if unsafe { mm::munmap(base as *mut c_void, HUGE_PAGE) }.is_ok() {
                self.mapped.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

impl Default for HugePool {
    fn default() -> Self {
        Self::new()
    }
}

/// A fresh [`HUGE_PAGE`]-aligned, read-write anonymous mapping of [`HUGE_PAGE`] bytes advised
/// `MADV_HUGEPAGE`; its base address.
fn map_huge_page() -> Option<usize> {
    // Twice the size, then the unaligned head and tail cut off: the kernel aligns only to 4 KiB.
    let len = 2 * HUGE_PAGE;
    // SAFETY: a new private anonymous mapping at an address the kernel picks; nothing refers to
    // it yet.
    let raw = unsafe {
        mm::mmap_anonymous(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::PRIVATE)
    }
    .ok()? as usize;
    let base = (raw + HUGE_PAGE - 1) & !(HUGE_PAGE - 1);
    let tail = raw + len - (base + HUGE_PAGE);
    // SAFETY: `[raw, base)` and `[base + HUGE_PAGE, raw + len)` are parts of the mapping just
    // made, which nothing uses.
    unsafe {
        if base > raw {
            let _ = mm::munmap(raw as *mut c_void, base - raw);
        }
        if tail > 0 {
            let _ = mm::munmap((base + HUGE_PAGE) as *mut c_void, tail);
        }
    }
    // Advice only: without THP the mapping works on small pages.
    // SAFETY: `[base, base + HUGE_PAGE)` is the mapping kept above.
    let _ = unsafe { mm::madvise(base as *mut c_void, HUGE_PAGE, Advice::LinuxHugepage) };
    Some(base)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn pool() -> &'static HugePool {
        Box::leak(Box::new(HugePool::new()))
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    #[test]
    fn classes_cover_64k_to_2m() {
        assert_eq!(CLASSES, 6);
        assert_eq!(class_of(MIN_HUGE_BUF - 1), None);
        assert_eq!(class_of(MIN_HUGE_BUF), Some(0));
        assert_eq!(class_of(MIN_HUGE_BUF + 1), Some(1));
        assert_eq!(class_of(512 << 10), Some(3));
        assert_eq!(class_of(HUGE_PAGE), Some(5));
        assert_eq!(class_of(HUGE_PAGE + 1), None);
        assert_eq!(class_size(5), HUGE_PAGE);
    }

    #[test]
    fn a_located_buffer_reads_its_bytes_wherever_it_moves() {
        let p = pool();
        for (len, seed) in [(0, 1), (4096, 2), (MIN_HUGE_BUF, 3), (300 << 10, 4), (HUGE_PAGE, 5)] {
            let data = pattern(len, seed);
            let buf = std::sync::Arc::new(ChunkBuf::from_vec_in(p, data.clone()));
            let located = Located::new(std::sync::Arc::clone(&buf), 7).unwrap();
            // Moved (into a box, then out of it) and with the other owner gone: the same bytes.
            drop(buf);
            let moved = *Box::new(located);
            assert_eq!(&moved[..], &data[..], "len {len}");
            assert_eq!(moved.buf().len(), len);
            assert_eq!(moved.mark.load(Ordering::Relaxed), 7);
        }
    }

    #[test]
    fn buffers_keep_their_bytes_and_report_their_slot() {
        let p = pool();
        for (len, huge, footprint) in [
            (0, false, 0),
            (4096, false, 4096),
            (MIN_HUGE_BUF, true, MIN_HUGE_BUF),
            (300 << 10, true, 512 << 10),
            (512 << 10, true, 512 << 10),
            (HUGE_PAGE, true, HUGE_PAGE),
            (HUGE_PAGE + 7, false, HUGE_PAGE + 7),
        ] {
            let data = pattern(len, len as u8);
            let b = ChunkBuf::from_vec_in(p, data.clone());
            assert_eq!(&b[..], &data[..], "{len}");
            assert_eq!((b.in_huge_slot(), b.footprint()), (huge, footprint), "{len}");
            if huge {
                assert_eq!(b.as_ptr() as usize % class_size(class_of(len).unwrap()), 0, "slot alignment");
            }
        }
    }

    /// Four 512 KiB buffers share one mapping; freed mappings go back to the kernel once their
    /// class has a spare; slots are reused before anything new is mapped.
    #[test]
    fn slots_are_shared_reused_and_mappings_returned() {
        let p = pool();
        let mut bufs: Vec<ChunkBuf> =
            (0..12).map(|i| ChunkBuf::from_vec_in(p, pattern(512 << 10, i as u8))).collect();
        assert_eq!(p.mappings(), 3);
        let bases: std::collections::HashSet<usize> =
            bufs.iter().map(|b| b.as_ptr() as usize & !(HUGE_PAGE - 1)).collect();
        assert_eq!(bases.len(), 3);
        for (i, b) in bufs.iter().enumerate() {
            assert_eq!(&b[..], &pattern(512 << 10, i as u8)[..], "buffer {i} overwritten");
        }
        // Free one slot, take one: reused, nothing mapped.
        let freed = bufs.remove(5).as_ptr() as usize;
        let again = ChunkBuf::from_vec_in(p, pattern(512 << 10, 99));
        assert_eq!(again.as_ptr() as usize, freed);
        assert_eq!(p.mappings(), 3);
        drop(again);
        // Everything freed: the last mapping emptied is kept as the class's spare.
        bufs.clear();
        assert_eq!(p.mappings(), 1);
        let b = ChunkBuf::from_vec_in(p, pattern(600 << 10, 1));
        assert_eq!((p.mappings(), b.footprint()), (2, 1 << 20), "another class maps its own");
    }

    /// The mapping is 2 MiB-aligned and advised for huge pages (the `hg` flag in smaps), so
    /// the kernel may back it with one; whether it does depends on the host's THP settings.
    #[test]
    fn mappings_are_aligned_and_advised_huge() {
        let p = pool();
        let b = ChunkBuf::from_vec_in(p, pattern(HUGE_PAGE, 3));
        let base = b.as_ptr() as usize;
        assert_eq!(base % HUGE_PAGE, 0);
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut lines = smaps.lines();
        // The area holding it (the kernel may have merged it with a neighbour of equal flags).
        let holds = |l: &str| {
            let Some((range, _)) = l.split_once(' ') else { return false };
            let Some((lo, hi)) = range.split_once('-') else { return false };
            match (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) {
                (Ok(lo), Ok(hi)) => lo <= base && base + HUGE_PAGE <= hi,
                _ => false,
            }
        };
        assert!(lines.any(holds), "no mapping holding {base:x} in smaps");
        let flags = lines.find(|l| l.starts_with("VmFlags:")).unwrap();
        assert!(flags.split_whitespace().any(|f| f == "hg"), "{flags}");
    }
}
