//! The image's files as its block map shows them, for whole-file readahead
//! ([`crate::MemTier::with_whole_files`]): a file is a run of chunks laid back to back on the
//! device, every one full-size but the last — what the builder writes, and what readahead within
//! a file already assumes. Pure: built from the block map alone.
//!
//! It is a guess at file boundaries, never a correctness matter (it only decides what is fetched
//! ahead): a file whose size is a whole number of chunks runs on into the next one; a file split
//! by metadata (an ext4 block group's bitmaps and inode table) counts as two; a chunk several
//! files share (deduplicated) belongs to the first that uses it.

use std::collections::HashMap;

use tessera_image::{BlockMap, ChunkRef, RunSource};

/// Chunk → file, and each file's chunks in device order.
#[derive(Debug, Clone, Default)]
pub struct FileMap {
    /// The file of each chunk index (`NONE`: in no file, e.g. never mapped).
    of: Vec<u32>,
    /// File `f`'s chunks are `chunks[starts[f]..starts[f + 1]]`.
    starts: Vec<u32>,
    chunks: Vec<u32>,
    /// Each file's bytes (its chunks' lengths).
    bytes: Vec<u64>,
}

const NONE: u32 = u32::MAX;

impl FileMap {
    /// The files of `map`, whose chunks are `chunk_size` bytes but a file's last.
    pub fn new(map: &BlockMap, chunk_size: u32) -> Self {
        let chunks = map.chunks();
        let mut files = FileMap { of: vec![NONE; chunks.len()], starts: vec![0], ..Default::default() };
        let mut file: Vec<u32> = Vec::new();
        // The end (device block) of the last run taken, its chunk, and whether that chunk is full.
        let mut last: Option<(u64, u32, bool)> = None;
        for run in map.runs() {
            let RunSource::Chunk { chunk, .. } = run.source else {
                files.close(&mut file, chunks);
                last = None;
                continue;
            };
            let full = chunks.get(chunk as usize).is_some_and(|c| c.len >= chunk_size);
            match last {
                Some((end, prev, _)) if end == run.start && prev == chunk => {}
                Some((end, _, prev_full)) if end == run.start && prev_full => file.push(chunk),
                _ => {
                    files.close(&mut file, chunks);
                    file.push(chunk);
                }
            }
            last = Some((run.start + run.blocks, chunk, full));
        }
        files.close(&mut file, chunks);
        files
    }

    fn close(&mut self, file: &mut Vec<u32>, chunks: &[ChunkRef]) {
        if file.is_empty() {
            return;
        }
        let Ok(number) = u32::try_from(self.bytes.len()) else { return };
        let mut bytes = 0u64;
        for &c in file.iter() {
            if let Some(slot) = self.of.get_mut(c as usize) {
                if *slot == NONE {
                    *slot = number;
                }
            }
            bytes += chunks.get(c as usize).map_or(0, |c| u64::from(c.len));
        }
        self.chunks.append(file);
        self.starts.push(u32::try_from(self.chunks.len()).unwrap_or(u32::MAX));
        self.bytes.push(bytes);
    }

    /// The file chunk `chunk` belongs to.
    pub fn file_of(&self, chunk: u32) -> Option<u32> {
        self.of.get(chunk as usize).copied().filter(|&f| f != NONE)
    }

    /// File `file`'s chunks, in device order.
    pub fn chunks(&self, file: u32) -> &[u32] {
        let f = file as usize;
        match (self.starts.get(f), self.starts.get(f + 1)) {
            (Some(&a), Some(&b)) => self.chunks.get(a as usize..b as usize).unwrap_or(&[]),
            _ => &[],
        }
    }

    /// File `file`'s bytes.
    pub fn bytes(&self, file: u32) -> u64 {
        self.bytes.get(file as usize).copied().unwrap_or(0)
    }

    /// How many files.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// Readahead by where misses fall: counts the origin misses nothing foresaw, per file
/// ([`crate::MemTier::with_whole_files`]) and per pack stretch
/// ([`crate::MemTier::with_dense_stretches`]: misses of several distinct files, or of two close
/// together in time, as a program's start reads a directory's modules one after another), and
/// says when a file or a stretch is due to be fetched whole. Each is due once.
#[derive(Debug, Default)]
pub struct MissCounts {
    /// Misses of one file that make it due (0: never).
    file_after: u32,
    /// Files missed in one stretch that make it due (0: never).
    stretch_after: u32,
    /// Two files of a stretch missed within this many stretch misses of each other (this one
    /// included) also make it due (0: never).
    stretch_within: u32,
    /// Stretch misses counted so far: the clock of `stretch_within`.
    clock: u64,
    files: HashMap<u32, u32>,
    stretches: HashMap<(u32, u64), Stretch>,
}

#[derive(Debug)]
enum Stretch {
    /// The distinct files missed there so far (`None`: a chunk in no file, each counted), each
    /// with the clock of its last miss.
    Missed(Vec<(Option<u32>, u64)>),
    Due,
}

const DUE: u32 = u32::MAX;

impl MissCounts {
    /// Counts for files due after `file_after` misses and stretches due once misses fell in
    /// `stretch_after` distinct files there (0 turns either off).
    pub fn new(file_after: u32, stretch_after: u32) -> Self {
        Self { file_after, stretch_after, ..Self::default() }
    }

    /// Files due after `after` misses (0: never).
    pub fn set_file_after(&mut self, after: u32) {
        self.file_after = after;
    }

    /// Stretches due after misses in `after` distinct files (0: never), or in two within
    /// `within` stretch misses of each other (0: not that way).
    pub fn set_stretch_after(&mut self, after: u32, within: u32) {
        self.stretch_after = after;
        self.stretch_within = within;
    }

    /// A miss of a chunk of `file` (if it is in one) stored in `stretch` (if counted): the file
    /// and the stretch it made due, each at most once in the counter's life. `at_once`: the file
    /// is due at this miss, whatever the count (a file small enough to fetch at its first).
    pub fn miss(
        &mut self,
        file: Option<u32>,
        at_once: bool,
        stretch: Option<(u32, u64)>,
    ) -> (Option<u32>, Option<(u32, u64)>) {
        let mut due = (None, None);
        if let (Some(f), true) = (file, self.file_after > 0 || at_once) {
            let n = self.files.entry(f).or_insert(0);
            if *n != DUE {
                *n += 1;
                if at_once || *n >= self.file_after {
                    *n = DUE;
                    due.0 = Some(f);
                }
            }
        }
        if let (Some(s), true) = (stretch, self.stretch_after > 0) {
            self.clock += 1;
            let (now, within) = (self.clock, u64::from(self.stretch_within));
            let entry = self.stretches.entry(s).or_insert_with(|| Stretch::Missed(Vec::new()));
            if let Stretch::Missed(seen) = entry {
                match seen.iter_mut().find(|(f, _)| f.is_some() && *f == file) {
                    Some(again) => again.1 = now,
                    None => seen.push((file, now)),
                }
                let close = within > 0 && seen.iter().filter(|&&(_, at)| now - at < within).count() >= 2;
                if seen.len() >= self.stretch_after as usize || close {
                    *entry = Stretch::Due;
                    due.1 = Some(s);
                }
            }
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_image::ChunkId;

    const CHUNK: u32 = 16 * 4096;

    /// Files of `sizes` bytes laid back to back from device block 10 (after 10 prefix blocks),
    /// a gap of `gap` blocks between files; chunk ids from their position.
    fn map(sizes: &[u64], gap: u64) -> BlockMap {
        let mut b = BlockMap::builder(1 << 20);
        b.push_prefix(0, 10, 0).unwrap();
        let mut at = 10;
        let mut n = 0u8;
        for &size in sizes {
            let mut left = size;
            while left > 0 {
                let len = left.min(u64::from(CHUNK)) as u32;
                n += 1;
                let c = b.add_chunk(ChunkId::of(&[n]), len);
                let blocks = u64::from(len).div_ceil(4096);
                b.push_chunk(at, blocks, c, 0).unwrap();
                at += blocks;
                left -= u64::from(len);
            }
            at += gap;
        }
        b.finish().unwrap()
    }

    #[test]
    fn files_end_at_a_short_chunk_or_a_gap() {
        let one = u64::from(CHUNK);
        // 3.5 chunks, then 1 chunk exactly (runs on into the next), then 2.25 chunks.
        let m = FileMap::new(&map(&[3 * one + one / 2, one, 2 * one + one / 4], 0), CHUNK);
        assert_eq!(m.len(), 2);
        assert_eq!(m.chunks(0), &[0, 1, 2, 3]);
        assert_eq!(m.bytes(0), 3 * one + one / 2);
        assert_eq!(m.chunks(1), &[4, 5, 6, 7], "a whole-chunk file runs on into the next");
        assert_eq!(
            (m.file_of(0), m.file_of(3), m.file_of(4), m.file_of(7)),
            (Some(0), Some(0), Some(1), Some(1))
        );
        assert_eq!(m.file_of(8), None);
        assert!(m.chunks(2).is_empty());

        // A gap on the device ends a file even after a full chunk.
        let m = FileMap::new(&map(&[one, one, one / 2], 3), CHUNK);
        assert_eq!((m.len(), m.chunks(0), m.chunks(1), m.chunks(2)), (3, &[0][..], &[1][..], &[2][..]));
    }

    #[test]
    fn a_shared_chunk_belongs_to_its_first_file() {
        let one = u64::from(CHUNK);
        let mut b = BlockMap::builder(1 << 20);
        let a = b.add_chunk(ChunkId::of(b"a"), CHUNK);
        let tail = b.add_chunk(ChunkId::of(b"t"), 100);
        let c = b.add_chunk(ChunkId::of(b"c"), CHUNK);
        // File 1: a, tail. File 2 (after a gap): c, a (shared), tail.
        b.push_chunk(0, 16, a, 0).unwrap();
        b.push_chunk(16, 1, tail, 0).unwrap();
        b.push_chunk(20, 16, c, 0).unwrap();
        b.push_chunk(36, 16, a, 0).unwrap();
        b.push_chunk(52, 1, tail, 0).unwrap();
        let m = FileMap::new(&b.finish().unwrap(), CHUNK);
        assert_eq!(m.len(), 2);
        let (a, c) = (m.chunks(0)[0], m.chunks(1)[0]);
        assert_eq!(m.chunks(1).len(), 3);
        assert_eq!((m.file_of(a), m.file_of(c)), (Some(0), Some(1)));
        assert_eq!(m.bytes(1), 2 * one + 100);
    }

    #[test]
    fn two_files_missed_close_together_make_a_stretch_due() {
        let mut m = MissCounts::new(0, 3);
        m.set_stretch_after(3, 4);
        let s = Some((0, 1));
        // Files 1 and 2 missed five stretch misses apart (misses of other stretches between):
        // too far apart to make it due by themselves.
        assert_eq!(m.miss(Some(1), false, s), (None, None));
        for other in 10..14 {
            assert_eq!(m.miss(None, false, Some((0, other))), (None, None));
        }
        assert_eq!(m.miss(Some(2), false, s), (None, None), "file 1's miss is not within four");
        // A third file makes it due whenever it comes (the rule of three).
        for other in 20..30 {
            assert_eq!(m.miss(None, false, Some((0, other))), (None, None));
        }
        assert_eq!(m.miss(Some(3), false, s), (None, Some((0, 1))));
        // Two files three misses apart: due at the second. A file missed again counts from its
        // last miss: 4, then 4 again, then 5 four misses after 4's first and two after its second.
        let t = Some((2, 0));
        assert_eq!(m.miss(Some(4), false, t), (None, None));
        assert_eq!(m.miss(None, false, Some((2, 5))), (None, None));
        assert_eq!(m.miss(Some(4), false, t), (None, None));
        assert_eq!(m.miss(None, false, Some((2, 6))), (None, None));
        assert_eq!(m.miss(Some(5), false, t), (None, Some((2, 0))));
        // Off (0), two files close together are not enough.
        let mut three = MissCounts::new(0, 3);
        assert_eq!(three.miss(Some(1), false, s), (None, None));
        assert_eq!(three.miss(Some(2), false, s), (None, None));
    }

    #[test]
    fn a_file_is_due_at_its_nth_miss_and_a_stretch_at_its_nth_file_each_once() {
        let mut m = MissCounts::new(3, 3);
        let s = Some((0, 7));
        // Three misses of file 1 in one stretch: the file is due, the stretch (one file) not.
        assert_eq!(m.miss(Some(1), false, s), (None, None));
        assert_eq!(m.miss(Some(1), false, s), (None, None));
        assert_eq!(m.miss(Some(1), false, s), (Some(1), None));
        assert_eq!(m.miss(Some(1), false, s), (None, None), "a file is due once");
        // Misses of two more files there make the stretch due, once.
        assert_eq!(m.miss(Some(2), false, s), (None, None));
        assert_eq!(m.miss(Some(3), false, s), (None, Some((0, 7))));
        assert_eq!(m.miss(Some(4), false, s), (None, None), "a stretch is due once");
        // Another stretch counts apart; chunks in no file count one each.
        let t = Some((1, 0));
        assert_eq!(m.miss(None, false, t), (None, None));
        assert_eq!(m.miss(None, false, t), (None, None));
        assert_eq!(m.miss(None, false, t), (None, Some((1, 0))));
        // Off: nothing is ever due.
        let mut off = MissCounts::new(0, 0);
        for f in 0..10 {
            assert_eq!(off.miss(Some(f % 2), false, s), (None, None));
        }
    }

    #[test]
    fn a_file_small_enough_is_due_at_its_first_miss_once() {
        for after in [0, 3] {
            let mut m = MissCounts::new(after, 0);
            assert_eq!(m.miss(Some(1), true, None), (Some(1), None), "after {after}");
            assert_eq!(m.miss(Some(1), true, None), (None, None), "after {after}: due once");
            // A larger file keeps its count, and the off switch holds for it.
            let larger =
                [m.miss(Some(2), false, None), m.miss(Some(2), false, None), m.miss(Some(2), false, None)];
            let due = if after == 3 { Some(2) } else { None };
            assert_eq!(larger, [(None, None), (None, None), (due, None)], "after {after}");
        }
    }
}
