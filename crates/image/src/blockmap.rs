//! The BlockMap: which device blocks come from the metadata prefix and which from chunks.
//!
//! Every block not covered by a run reads as zeros (free space, holes, unused inode tables, the
//! journal body). Lookups go through a bucket index over the sorted runs (about one bucket per
//! run, so a lookup touches one bucket and a run or two instead of a binary search's ~17 cache
//! lines on a 100 000-run map); [`BlockMap::plan`] turns a byte range into [`Segment`]s without
//! doing any I/O.

use crate::codec::{Reader, Writer};
use crate::digest::ChunkId;
use crate::error::{DecodeError, Error};
use crate::units::BlockSize;

/// The largest device (or prefix) whose byte size fits in u64.
const MAX_BLOCKS: u64 = u64::MAX / BlockSize::U64;

/// A chunk as the BlockMap knows it: its id and uncompressed length in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChunkRef {
    pub id: ChunkId,
    pub len: u32,
}

impl ChunkRef {
    /// Blocks the chunk covers (its last block is zero-padded).
    pub fn blocks(&self) -> u64 {
        u64::from(self.len).div_ceil(BlockSize::U64)
    }
}

/// Where a run's blocks come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RunSource {
    /// Blocks of the (uncompressed) metadata prefix, starting at prefix block `block`.
    Prefix { block: u64 },
    /// Blocks of chunk `chunk` (index into [`BlockMap::chunks`]), starting at chunk block `block`.
    Chunk { chunk: u32, block: u32 },
}

/// A run of consecutive device blocks with one source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Run {
    pub start: u64,
    pub blocks: u64,
    pub source: RunSource,
}

impl Run {
    fn end(&self) -> u64 {
        self.start + self.blocks
    }

    /// Whether `next` continues this run seamlessly (so canonical form merges them).
    fn continues_into(&self, next: &Run) -> bool {
        if self.end() != next.start {
            return false;
        }
        match (self.source, next.source) {
            (RunSource::Prefix { block: a }, RunSource::Prefix { block: b }) => a + self.blocks == b,
            (RunSource::Chunk { chunk: ca, block: a }, RunSource::Chunk { chunk: cb, block: b }) => {
                ca == cb && u64::from(a) + self.blocks == u64::from(b)
            }
            _ => false,
        }
    }
}

/// Where the bytes of one [`Segment`] come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentSource {
    /// Zeros.
    Zero,
    /// Bytes of the uncompressed metadata prefix at this byte offset.
    Prefix { offset: u64 },
    /// Bytes of chunk `chunk` at this byte offset; bytes past the chunk's length are zeros.
    Chunk { chunk: u32, offset: u64 },
}

/// A piece of a planned read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub len: u64,
    pub source: SegmentSource,
}

/// Device blocks → prefix blocks or chunks. Canonical: runs sorted and merged, chunks numbered in
/// order of first use, every chunk used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockMap {
    device_blocks: u64,
    prefix_blocks: u64,
    runs: Vec<Run>,
    chunks: Vec<ChunkRef>,
    /// Derived from `runs` (so equality is unaffected): where a lookup starts.
    index: RunIndex,
}

/// Buckets of `1 << shift` device blocks: `first[i]` is the index of the first run that ends
/// after block `i << shift`, so the run holding (or following) block `b` is within
/// `first[b >> shift]..=first[(b >> shift) + 1]`. The shift is the smallest that keeps the
/// buckets no more numerous than the runs (4 bytes per run at most, beside a run's 32). Empty
/// when there are no runs or more than `u32::MAX` of them (lookups then search all runs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct RunIndex {
    shift: u32,
    first: Vec<u32>,
}

impl RunIndex {
    fn build(runs: &[Run], device_blocks: u64) -> Self {
        if runs.is_empty() || u32::try_from(runs.len()).is_err() {
            return RunIndex::default();
        }
        let target = runs.len() as u64;
        let mut shift = 0u32;
        while shift < 63 && (device_blocks >> shift) >= target {
            shift += 1;
        }
        let buckets = (device_blocks >> shift) + 1;
        let mut first = Vec::with_capacity(usize::try_from(buckets).unwrap_or(0));
        let mut r = 0usize;
        for i in 0..buckets {
            let block = i << shift;
            while r < runs.len() && runs[r].end() <= block {
                r += 1;
            }
            // r ≤ runs.len() ≤ u32::MAX, checked above.
            first.push(r as u32);
        }
        RunIndex { shift, first }
    }
}

/// Builds a [`BlockMap`]; runs may be pushed in any order, [`BlockMapBuilder::finish`] sorts,
/// merges, renumbers chunks and validates.
#[derive(Debug, Clone)]
pub struct BlockMapBuilder {
    device_blocks: u64,
    runs: Vec<Run>,
    chunks: Vec<ChunkRef>,
    chunk_index: std::collections::HashMap<ChunkId, u32>,
}

impl BlockMap {
    /// Start a map for a device of `device_blocks` blocks.
    pub fn builder(device_blocks: u64) -> BlockMapBuilder {
        BlockMapBuilder {
            device_blocks,
            runs: Vec::new(),
            chunks: Vec::new(),
            chunk_index: Default::default(),
        }
    }

    /// Device size in blocks.
    pub fn device_blocks(&self) -> u64 {
        self.device_blocks
    }

    /// Device size in bytes.
    pub fn device_bytes(&self) -> u64 {
        self.device_blocks * BlockSize::U64
    }

    /// Size of the uncompressed metadata prefix in blocks.
    pub fn prefix_blocks(&self) -> u64 {
        self.prefix_blocks
    }

    /// The runs, sorted by device block.
    pub fn runs(&self) -> &[Run] {
        &self.runs
    }

    /// The chunk table, in order of first use.
    pub fn chunks(&self) -> &[ChunkRef] {
        &self.chunks
    }

    /// Index of the first run that ends after `block`.
    fn first_run_after(&self, block: u64) -> usize {
        let bucket = usize::try_from(block >> self.index.shift).unwrap_or(usize::MAX);
        let (lo, hi) = match self.index.first.get(bucket) {
            Some(&lo) => {
                let hi = self.index.first.get(bucket + 1).map_or(self.runs.len(), |&h| h as usize);
                (lo as usize, hi)
            }
            None => (0, self.runs.len()),
        };
        lo + self.runs[lo..hi].partition_point(|r| r.end() <= block)
    }

    /// The map with its lookup index built (after validation: the index trusts the runs).
    fn indexed(mut self) -> Self {
        self.index = RunIndex::build(&self.runs, self.device_blocks);
        self
    }

    /// Plan a read of `len` bytes at byte `offset`: an iterator of segments whose lengths add up to
    /// `len`. Fails if the range is outside the device.
    pub fn plan(&self, offset: u64, len: u64) -> Result<Plan<'_>, Error> {
        let device_bytes = self.device_bytes();
        let end = offset.checked_add(len).filter(|&e| e <= device_bytes).ok_or(Error::OutOfRange {
            offset,
            len,
            device_bytes,
        })?;
        Ok(Plan { map: self, pos: offset, end, run: self.first_run_after(offset / BlockSize::U64) })
    }

    pub(crate) fn encode(&self, w: &mut Writer) {
        w.u64(self.device_blocks);
        w.u64(self.prefix_blocks);
        w.len(self.chunks.len());
        for c in &self.chunks {
            w.bytes(&c.id.0);
            w.u32(c.len);
        }
        w.len(self.runs.len());
        for r in &self.runs {
            w.u64(r.start);
            w.u64(r.blocks);
            match r.source {
                RunSource::Prefix { block } => {
                    w.u8(0);
                    w.u64(block);
                }
                RunSource::Chunk { chunk, block } => {
                    w.u8(1);
                    w.u32(chunk);
                    w.u32(block);
                }
            }
        }
    }

    pub(crate) fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let device_blocks = r.u64()?;
        let prefix_blocks = r.u64()?;
        let n_chunks = r.count(36)?;
        let mut chunks = Vec::with_capacity(n_chunks);
        for _ in 0..n_chunks {
            let id = ChunkId(r.array()?);
            let len = r.u32()?;
            if len == 0 {
                return Err(r.not_canonical("chunks", "empty chunk"));
            }
            chunks.push(ChunkRef { id, len });
        }
        let n_runs = r.count(25)?;
        let mut runs = Vec::with_capacity(n_runs);
        for _ in 0..n_runs {
            let start = r.u64()?;
            let blocks = r.u64()?;
            let source = match r.u8()? {
                0 => RunSource::Prefix { block: r.u64()? },
                1 => RunSource::Chunk { chunk: r.u32()?, block: r.u32()? },
                _ => return Err(r.not_canonical("runs", "unknown run source")),
            };
            runs.push(Run { start, blocks, source });
        }
        let map = BlockMap { device_blocks, prefix_blocks, runs, chunks, index: RunIndex::default() };
        map.validate()?;
        if !map.is_canonical() {
            return Err(r.not_canonical("block map", "runs not merged or chunks not in first-use order"));
        }
        Ok(map.indexed())
    }

    fn validate(&self) -> Result<(), Error> {
        // Byte offsets must fit in u64 everywhere (plans multiply blocks by the block size).
        for (what, blocks) in [("device", self.device_blocks), ("prefix", self.prefix_blocks)] {
            if blocks > MAX_BLOCKS {
                return Err(Error::TooLarge { what, blocks, max: MAX_BLOCKS });
            }
        }
        let mut prev_end = 0u64;
        for (i, run) in self.runs.iter().enumerate() {
            if run.blocks == 0 {
                return Err(Error::EmptyRun { start: run.start });
            }
            if i > 0 && run.start < prev_end {
                return Err(Error::RunOrder { start: run.start, prev_end });
            }
            let end = run.start.checked_add(run.blocks).filter(|&e| e <= self.device_blocks).ok_or(
                Error::RunPastEnd { start: run.start, blocks: run.blocks, device_blocks: self.device_blocks },
            )?;
            prev_end = end;
            match run.source {
                RunSource::Prefix { block } => {
                    let ok = block.checked_add(run.blocks).is_some_and(|e| e <= self.prefix_blocks);
                    if !ok || run.blocks > u64::from(u32::MAX) {
                        return Err(Error::RunPastPrefix {
                            offset: block,
                            blocks: u32::try_from(run.blocks).unwrap_or(u32::MAX),
                            prefix_blocks: self.prefix_blocks,
                        });
                    }
                }
                RunSource::Chunk { chunk, block } => {
                    let c = self
                        .chunks
                        .get(chunk as usize)
                        .ok_or(Error::BadChunkIndex { index: chunk, count: self.chunks.len() })?;
                    if u64::from(block) + run.blocks > c.blocks() {
                        return Err(Error::RunPastChunk {
                            index: chunk,
                            offset: block,
                            blocks: u32::try_from(run.blocks).unwrap_or(u32::MAX),
                            chunk_blocks: u32::try_from(c.blocks()).unwrap_or(u32::MAX),
                        });
                    }
                }
            }
        }
        Ok(())
    }

    fn is_canonical(&self) -> bool {
        let merged = self.runs.windows(2).all(|w| !w[0].continues_into(&w[1]));
        let mut next_new = 0u32;
        for run in &self.runs {
            if let RunSource::Chunk { chunk, .. } = run.source {
                if chunk == next_new {
                    next_new += 1;
                } else if chunk > next_new {
                    return false;
                }
            }
        }
        merged && next_new as usize == self.chunks.len()
    }
}

impl BlockMapBuilder {
    /// Map device blocks `start..start+blocks` to prefix blocks starting at `prefix_block`.
    pub fn push_prefix(&mut self, start: u64, blocks: u64, prefix_block: u64) -> Result<(), Error> {
        if blocks == 0 {
            return Err(Error::EmptyRun { start });
        }
        self.runs.push(Run { start, blocks, source: RunSource::Prefix { block: prefix_block } });
        Ok(())
    }

    /// Register a chunk (deduplicated by id) and return its index for [`Self::push_chunk`].
    pub fn add_chunk(&mut self, id: ChunkId, len: u32) -> u32 {
        if let Some(&i) = self.chunk_index.get(&id) {
            return i;
        }
        let i = u32::try_from(self.chunks.len()).unwrap_or(u32::MAX);
        self.chunks.push(ChunkRef { id, len });
        self.chunk_index.insert(id, i);
        i
    }

    /// Map device blocks `start..start+blocks` to blocks of chunk `chunk` starting at `chunk_block`.
    pub fn push_chunk(&mut self, start: u64, blocks: u64, chunk: u32, chunk_block: u32) -> Result<(), Error> {
        if blocks == 0 {
            return Err(Error::EmptyRun { start });
        }
        self.runs.push(Run { start, blocks, source: RunSource::Chunk { chunk, block: chunk_block } });
        Ok(())
    }

    /// Sort, merge, renumber chunks by first use, validate.
    pub fn finish(mut self) -> Result<BlockMap, Error> {
        // Only `add_chunk` needs the index: free it before the map is renumbered.
        self.chunk_index = std::collections::HashMap::new();
        self.runs.sort_by_key(|r| r.start);
        let prefix_blocks = self
            .runs
            .iter()
            .filter_map(|r| match r.source {
                // Saturates: an overflowing run is then rejected by `validate` as too large.
                RunSource::Prefix { block } => Some(block.saturating_add(r.blocks)),
                RunSource::Chunk { .. } => None,
            })
            .max()
            .unwrap_or(0);
        // Validate against the builder's numbering first, so errors name what the caller pushed.
        // (Moved in and out again, not cloned: a million-file map is tens of MiB.)
        let unsorted = BlockMap {
            device_blocks: self.device_blocks,
            prefix_blocks,
            runs: self.runs,
            chunks: self.chunks,
            index: RunIndex::default(),
        };
        unsorted.validate()?;
        let BlockMap { runs: unsorted_runs, chunks: unsorted_chunks, .. } = unsorted;

        let mut renumber = vec![u32::MAX; unsorted_chunks.len()];
        let mut chunks = Vec::with_capacity(unsorted_chunks.len());
        let mut runs: Vec<Run> = Vec::with_capacity(unsorted_runs.len());
        for mut run in unsorted_runs {
            if let RunSource::Chunk { chunk, block } = run.source {
                let slot = &mut renumber[chunk as usize];
                if *slot == u32::MAX {
                    *slot = u32::try_from(chunks.len()).unwrap_or(u32::MAX);
                    chunks.push(unsorted_chunks[chunk as usize]);
                }
                run.source = RunSource::Chunk { chunk: *slot, block };
            }
            match runs.last_mut() {
                Some(last) if last.continues_into(&run) => last.blocks += run.blocks,
                _ => runs.push(run),
            }
        }
        let map = BlockMap {
            device_blocks: self.device_blocks,
            prefix_blocks,
            runs,
            chunks,
            index: RunIndex::default(),
        };
        map.validate()?;
        Ok(map.indexed())
    }
}

/// Iterator over the segments of a planned read; see [`BlockMap::plan`].
#[derive(Debug, Clone)]
pub struct Plan<'a> {
    map: &'a BlockMap,
    pos: u64,
    end: u64,
    run: usize,
}

impl Iterator for Plan<'_> {
    type Item = Segment;

    fn next(&mut self) -> Option<Segment> {
        if self.pos >= self.end {
            return None;
        }
        let run = self.map.runs.get(self.run);
        let seg = match run {
            Some(run) if run.start * BlockSize::U64 <= self.pos => {
                let run_end = run.end() * BlockSize::U64;
                let len = run_end.min(self.end) - self.pos;
                let into = self.pos - run.start * BlockSize::U64;
                let source = match run.source {
                    RunSource::Prefix { block } => {
                        SegmentSource::Prefix { offset: block * BlockSize::U64 + into }
                    }
                    RunSource::Chunk { chunk, block } => {
                        SegmentSource::Chunk { chunk, offset: u64::from(block) * BlockSize::U64 + into }
                    }
                };
                if self.pos + len == run_end {
                    self.run += 1;
                }
                Segment { len, source }
            }
            Some(run) => Segment {
                len: (run.start * BlockSize::U64).min(self.end) - self.pos,
                source: SegmentSource::Zero,
            },
            None => Segment { len: self.end - self.pos, source: SegmentSource::Zero },
        };
        self.pos += seg.len;
        Some(seg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> BlockMap {
        let mut b = BlockMap::builder(100);
        b.push_prefix(0, 3, 0).unwrap();
        b.push_prefix(3, 2, 3).unwrap(); // merges with the previous run
        let a = b.add_chunk(ChunkId::of(b"a"), 3 * 4096 + 5); // 4 blocks
        let z = b.add_chunk(ChunkId::of(b"z"), 10);
        // pushed out of order; z used first on the device
        b.push_chunk(20, 4, a, 0).unwrap();
        b.push_chunk(10, 1, z, 0).unwrap();
        b.push_chunk(30, 2, a, 0).unwrap(); // dedup: same chunk again
        b.finish().unwrap()
    }

    #[test]
    fn canonical_form() {
        let m = sample();
        assert_eq!(m.runs().len(), 4);
        assert_eq!(m.prefix_blocks(), 5);
        assert_eq!(m.chunks()[0].id, ChunkId::of(b"z"));
        assert_eq!(m.runs()[1].source, RunSource::Chunk { chunk: 0, block: 0 });
        assert!(m.is_canonical());
        let mut w = Writer::default();
        m.encode(&mut w);
        let mut r = Reader::new(&w.buf, "test");
        assert_eq!(BlockMap::decode(&mut r).unwrap(), m);
        r.finish().unwrap();
    }

    #[test]
    fn plan_covers_exactly() {
        let m = sample();
        let segs: Vec<_> = m.plan(4 * 4096 + 100, 20 * 4096).unwrap().collect();
        let total: u64 = segs.iter().map(|s| s.len).sum();
        assert_eq!(total, 20 * 4096);
        assert_eq!(
            segs[0],
            Segment { len: 4096 - 100, source: SegmentSource::Prefix { offset: 4 * 4096 + 100 } }
        );
        assert_eq!(segs[1], Segment { len: 5 * 4096, source: SegmentSource::Zero });
        assert_eq!(segs[2], Segment { len: 4096, source: SegmentSource::Chunk { chunk: 0, offset: 0 } });
        assert_eq!(segs[3], Segment { len: 9 * 4096, source: SegmentSource::Zero });
        assert_eq!(segs[4], Segment { len: 4 * 4096, source: SegmentSource::Chunk { chunk: 1, offset: 0 } });
        assert_eq!(segs[5], Segment { len: 100, source: SegmentSource::Zero });
        // the tail of the device is zeros
        let tail: Vec<_> = m.plan(99 * 4096, 4096).unwrap().collect();
        assert_eq!(tail, vec![Segment { len: 4096, source: SegmentSource::Zero }]);
        assert!(m.plan(99 * 4096, 4097).is_err());
        assert!(m.plan(u64::MAX, 2).is_err());
        assert_eq!(m.plan(0, 0).unwrap().count(), 0);
    }

    #[test]
    fn index_finds_what_a_full_search_finds() {
        // Maps with few and many runs, dense and sparse, on small and huge devices: for every
        // probed block the bucket index must agree with a binary search over all runs.
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |bound: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % bound.max(1)
        };
        for (device_blocks, runs, max_gap) in [
            (1, 1, 0),
            (100, 3, 20),
            (4096, 300, 4),
            (4096, 30, 200),
            (1 << 40, 50, 1 << 34),
            (70_000, 9_000, 3),
        ] {
            let mut b = BlockMap::builder(device_blocks);
            let mut at = 0u64;
            for i in 0..runs {
                at += next(max_gap + 1);
                let blocks = 1 + next(4);
                if at + blocks > device_blocks {
                    break;
                }
                // Alternate chunks so neighbouring runs never merge.
                let c = b.add_chunk(ChunkId::of(&(i % 2u64).to_le_bytes()), 4 * 4096);
                b.push_chunk(at, blocks, c, 0).unwrap();
                at += blocks;
            }
            let m = b.finish().unwrap();
            let full = |block: u64| m.runs.partition_point(|r| r.end() <= block);
            let mut probes: Vec<u64> = (0..2_000).map(|_| next(device_blocks)).collect();
            probes.extend(m.runs.iter().flat_map(|r| [r.start, r.end() - 1, r.end()]));
            probes.extend([0, device_blocks - 1, device_blocks, u64::MAX / BlockSize::U64]);
            for block in probes {
                assert_eq!(m.first_run_after(block), full(block), "device {device_blocks} block {block}");
            }
            assert!(m.index.first.len() <= m.runs.len().max(1), "at most one bucket per run");
        }
    }

    #[test]
    fn rejects_bad_maps() {
        let mut b = BlockMap::builder(10);
        b.push_prefix(0, 5, 0).unwrap();
        b.push_prefix(4, 2, 5).unwrap();
        assert!(matches!(b.finish(), Err(Error::RunOrder { .. })));

        let mut b = BlockMap::builder(10);
        b.push_prefix(8, 5, 0).unwrap();
        assert!(matches!(b.finish(), Err(Error::RunPastEnd { .. })));

        let mut b = BlockMap::builder(10);
        let c = b.add_chunk(ChunkId::of(b"x"), 4096);
        b.push_chunk(0, 2, c, 0).unwrap();
        assert!(matches!(b.finish(), Err(Error::RunPastChunk { .. })));

        let mut b = BlockMap::builder(10);
        b.push_chunk(0, 1, 7, 0).unwrap();
        assert!(matches!(b.finish(), Err(Error::BadChunkIndex { .. })));
    }

    #[test]
    fn rejects_sizes_whose_bytes_overflow() {
        // Found by fuzzing (fuzz/: image_record, F1): a device of 2^52 + 256 blocks made
        // `device_bytes()` and `plan()` overflow.
        let b = BlockMap::builder((1u64 << 52) + 256);
        assert!(matches!(b.finish(), Err(Error::TooLarge { what: "device", .. })));
        let mut b = BlockMap::builder(10);
        b.push_prefix(0, 1, u64::MAX).unwrap();
        assert!(b.finish().is_err(), "an overflowing prefix run is an error, not a panic (F6)");
        let m = BlockMap {
            device_blocks: 1 << 53,
            prefix_blocks: 0,
            runs: vec![],
            chunks: vec![],
            index: RunIndex::default(),
        };
        let mut w = Writer::default();
        m.encode(&mut w);
        assert!(BlockMap::decode(&mut Reader::new(&w.buf, "t")).is_err());
    }

    #[test]
    fn decode_rejects_non_canonical() {
        // Two prefix runs that should have been merged.
        let m = BlockMap {
            device_blocks: 10,
            prefix_blocks: 4,
            runs: vec![
                Run { start: 0, blocks: 2, source: RunSource::Prefix { block: 0 } },
                Run { start: 2, blocks: 2, source: RunSource::Prefix { block: 2 } },
            ],
            chunks: vec![],
            index: RunIndex::default(),
        };
        let mut w = Writer::default();
        m.encode(&mut w);
        assert!(BlockMap::decode(&mut Reader::new(&w.buf, "t")).is_err());
    }
}
