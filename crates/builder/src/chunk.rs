//! Cutting file content into chunks, hashing and compressing them in parallel, and appending new
//! ones to packs in tree order.
//!
//! Memory stays bounded: content is processed in batches of at most [`BATCH_BYTES`] raw bytes
//! (or one chunk, if larger); only the stored (compressed) bytes of a batch are held at once.

use std::collections::HashMap;
use std::hash::BuildHasher as _;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use rayon::prelude::*;
use tessera_image::{BlockSize, ChunkId, Compression, PackLocation, Sha256Digest};
use tessera_store::{BlobWriter, LocalStore};

use crate::error::BuildError;
use crate::seed::FileChunks;
use crate::source_index::SourceIndex;
use crate::walk::{open_noatime, SourceTree};
use crate::Progress;

/// Raw bytes per parallel batch.
pub const BATCH_BYTES: u64 = 32 << 20;
/// Jobs per parallel batch: small files cost a few allocations each beyond their bytes, so a batch
/// of 32 MiB of tiny files must not be hundreds of thousands of jobs (the results are the same for
/// any batching: chunks are placed in job order).
pub const BATCH_JOBS: usize = 4096;
/// A pack is closed once it holds this many bytes.
pub const PACK_TARGET_BYTES: u64 = 128 << 20;
const ZSTD_LEVEL: i32 = 3;

/// Where a chunk lives: in a pack that already existed (`loc.pack` indexes
/// [`ChunkOutput::existing_packs`]), or in a pack of this build (`loc.pack` is its ordinal, an
/// index of [`ChunkOutput::new_packs`]). 24 bytes, not a pack digest per chunk: there is one of
/// these per chunk of the image.
#[derive(Debug, Clone, Copy)]
pub enum ChunkHome {
    Existing(PackLocation),
    New(PackLocation),
}

impl ChunkHome {
    /// The location, its pack numbered as the variant says.
    pub fn location(&self) -> PackLocation {
        match self {
            ChunkHome::Existing(loc) | ChunkHome::New(loc) => *loc,
        }
    }
}

/// Every chunk a build uses and where it is stored: a list in first-use order with a hash index
/// of positions into it, while chunks are added; then, [`Self::seal`]ed, the list sorted by id
/// (the pack index's order, so it is written from here without a copy) and looked up by binary
/// search. 56 bytes a chunk and 4 more for the index, where a map keyed by id held ~70; and sealing
/// frees the index without a second copy of the list — at a million chunks, tens of MiB at the
/// build's peak.
#[derive(Debug, Default)]
pub struct ChunkHomes {
    list: Vec<(ChunkId, ChunkHome)>,
    /// Positions in `list`, hashed by id. Empty once sealed.
    index: hashbrown::HashTable<u32>,
    hasher: std::hash::RandomState,
    sealed: bool,
}

impl ChunkHomes {
    /// Where chunk `id` is in the list.
    pub(crate) fn position(&self, id: &ChunkId) -> Option<usize> {
        if self.sealed {
            return self.list.binary_search_by(|e| e.0.cmp(id)).ok();
        }
        let hash = self.hasher.hash_one(id);
        let at = *self.index.find(hash, |&i| self.list.get(i as usize).is_some_and(|e| e.0 == *id))?;
        Some(at as usize)
    }

    /// Where chunk `id` is stored, if it has a home.
    pub fn get(&self, id: &ChunkId) -> Option<&ChunkHome> {
        self.position(id).and_then(|i| self.list.get(i)).map(|e| &e.1)
    }

    pub fn contains(&self, id: &ChunkId) -> bool {
        self.position(id).is_some()
    }

    pub(crate) fn len(&self) -> usize {
        self.list.len()
    }

    /// The chunk at `position` and its home.
    pub(crate) fn at(&self, position: usize) -> Option<&(ChunkId, ChunkHome)> {
        self.list.get(position)
    }

    pub fn is_sealed(&self) -> bool {
        self.sealed
    }

    /// Give chunk `id` its home unless it has one. Fails once sealed, and beyond 2^32 chunks.
    pub(crate) fn insert(&mut self, id: ChunkId, home: ChunkHome) -> Result<(), BuildError> {
        if self.sealed {
            return Err(BuildError::Internal { what: "a chunk home added after sealing", chunk: Some(id) });
        }
        if self.contains(&id) {
            return Ok(());
        }
        let at = u32::try_from(self.list.len())
            .map_err(|_| BuildError::Internal { what: "more than 2^32 distinct chunks", chunk: Some(id) })?;
        self.list.push((id, home));
        let (list, hasher) = (&self.list, &self.hasher);
        let rehash = |&i: &u32| list.get(i as usize).map_or(0, |e| hasher.hash_one(e.0));
        self.index.insert_unique(hasher.hash_one(id), at, rehash);
        Ok(())
    }

    /// Sort by id and drop the index: lookups by binary search from now on, no more inserts.
    pub(crate) fn seal(&mut self) {
        if !self.sealed {
            self.index = hashbrown::HashTable::new();
            self.list.sort_unstable_by_key(|e| e.0);
            self.sealed = true;
        }
    }
}

/// What chunking produced.
#[derive(Debug, Default)]
pub struct ChunkOutput {
    /// Per node (by NodeId index): the file's chunks in file order.
    pub files: Vec<FileChunks>,
    /// Every chunk used, with where it is stored.
    pub homes: ChunkHomes,
    /// Digests of the packs this build wrote, by ordinal.
    pub new_packs: Vec<Sha256Digest>,
    /// Digests of the packs the store held that chunks of this build are in.
    pub existing_packs: Vec<Sha256Digest>,
    /// The index of each digest in `existing_packs`.
    existing_pack_no: HashMap<Sha256Digest, u32>,
    pub new_chunks: u64,
    pub new_stored_bytes: u64,
    /// Files taken from the previous build's source index instead of read.
    pub reused: Reuse,
}

/// What a directory build took from its previous build's source index.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reuse {
    /// Regular files not read.
    pub files: u64,
    /// Their content bytes.
    pub bytes: u64,
}

impl ChunkOutput {
    /// The home of a chunk at `loc` in the store's pack `pack`.
    pub(crate) fn existing_home(&mut self, pack: Sha256Digest, mut loc: PackLocation) -> ChunkHome {
        let packs = &mut self.existing_packs;
        loc.pack = *self.existing_pack_no.entry(pack).or_insert_with(|| {
            packs.push(pack);
            (packs.len() - 1) as u32
        });
        ChunkHome::Existing(loc)
    }

    /// Record chunk `id` at `loc` in the store's pack `pack`, unless its home is known.
    pub(crate) fn add_existing(
        &mut self,
        id: ChunkId,
        pack: Sha256Digest,
        loc: PackLocation,
    ) -> Result<(), BuildError> {
        if !self.homes.contains(&id) {
            let home = self.existing_home(pack, loc);
            self.homes.insert(id, home)?;
        }
        Ok(())
    }

    /// The pack digest of a home.
    pub(crate) fn pack_of(&self, home: &ChunkHome) -> Option<Sha256Digest> {
        match home {
            ChunkHome::Existing(loc) => self.existing_packs.get(loc.pack as usize).copied(),
            ChunkHome::New(loc) => self.new_packs.get(loc.pack as usize).copied(),
        }
    }
}

/// Where a chunk's raw bytes come from.
#[derive(Debug)]
pub(crate) enum JobData {
    /// Read `len` bytes at `offset` of this file (directory sources; read on the worker thread).
    Path(PathBuf),
    /// Already read from a stream (layer sources).
    Bytes(Vec<u8>),
    /// Not read: the previous build's source index says the file is unchanged and this chunk of
    /// it is in the store.
    Known(ChunkId),
}

/// One chunk to cut: `len` bytes at `offset` of node `node`'s content.
#[derive(Debug)]
pub(crate) struct Job {
    pub node: usize,
    pub offset: u64,
    pub len: u32,
    pub data: JobData,
}

struct Processed {
    node: usize,
    offset: u64,
    id: ChunkId,
    len: u32,
    /// `None` when the chunk is already stored.
    stored: Option<(Vec<u8>, Compression)>,
}

/// The chunks of node `node`'s content (none unless it is a regular file with a source path):
/// (offset, length), in file order.
fn node_pieces(src: &SourceTree, node: usize, chunk_size: u64) -> impl Iterator<Item = (u64, u32)> + '_ {
    let (size, data) = match src.tree.nodes.get(node).map(|n| &n.kind) {
        Some(tessera_ext4::NodeKind::Regular { size, data }) if src.has_path(node) => (*size, &data[..]),
        _ => (0, &[][..]),
    };
    data.iter().flat_map(move |range| {
        let start = range.start_block * BlockSize::U64;
        let end = ((range.start_block + range.blocks) * BlockSize::U64).min(size);
        // chunk_size ≤ 16 MiB, so a length always fits.
        (start..end).step_by(chunk_size as usize).map(move |off| (off, (end - off).min(chunk_size) as u32))
    })
}

/// Every chunk of `src`'s regular files, in tree order: (node, offset, length). Jobs are made from
/// this lazily, one batch at a time, so a tree of a million files never holds a million of them.
fn chunk_pieces(src: &SourceTree, chunk_size: u64) -> impl Iterator<Item = (usize, u64, u32)> + '_ {
    (0..src.tree.nodes.len())
        .flat_map(move |node| node_pieces(src, node, chunk_size).map(move |(off, len)| (node, off, len)))
}

/// The chunk ids of node `node` from the previous build's `index`, if its fingerprint is there,
/// the chunks it lists are the ones this walk cuts the file into, and every one is in the store.
fn indexed_chunks(
    src: &SourceTree,
    node: usize,
    chunk_size: u64,
    index: &SourceIndex,
    existing: &HashMap<ChunkId, (Sha256Digest, PackLocation)>,
) -> Option<Vec<ChunkId>> {
    let mut listed = index.lookup(src.stamp(node))?;
    let mut ids = Vec::new();
    for (off, len) in node_pieces(src, node, chunk_size) {
        let (o, id, l) = listed.next()?;
        if (o, l) != (off, len) || !existing.contains_key(&id) {
            return None;
        }
        ids.push(id);
    }
    listed.next().is_none().then_some(ids)
}

fn read_chunk(path: &Path, offset: u64, len: u32) -> Result<Vec<u8>, BuildError> {
    let file = open_noatime(path)?;
    let mut buf = vec![0u8; len as usize];
    let mut done = 0usize;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                return Err(BuildError::FileChanged {
                    path: path.to_owned(),
                    offset,
                    expected: u64::from(len),
                })
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(BuildError::io(path, "read")(e)),
        }
    }
    Ok(buf)
}

thread_local! {
    /// One zstd context per worker thread: creating a context per chunk cost ~10% of a build.
    static COMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

fn compress(raw: &[u8]) -> Result<Vec<u8>, BuildError> {
    let path = Path::new("<zstd>");
    COMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        let compressor = match slot.as_mut() {
            Some(c) => c,
            None => slot.insert(
                zstd::bulk::Compressor::new(ZSTD_LEVEL).map_err(BuildError::io(path, "create compressor"))?,
            ),
        };
        compressor.compress(raw).map_err(BuildError::io(path, "compress"))
    })
}

fn process(job: Job, known: impl Fn(&ChunkId) -> bool) -> Result<Processed, BuildError> {
    let raw = match job.data {
        JobData::Path(path) => read_chunk(&path, job.offset, job.len)?,
        JobData::Bytes(bytes) => bytes,
        JobData::Known(id) => {
            return Ok(Processed { node: job.node, offset: job.offset, id, len: job.len, stored: None })
        }
    };
    let id = ChunkId::of(&raw);
    let (node, offset, len) = (job.node, job.offset, job.len);
    if known(&id) {
        return Ok(Processed { node, offset, id, len, stored: None });
    }
    let compressed = compress(&raw)?;
    let stored =
        if compressed.len() < raw.len() { (compressed, Compression::Zstd) } else { (raw, Compression::None) };
    Ok(Processed { node, offset, id, len, stored: Some(stored) })
}

/// Decides where each new chunk goes (pack ordinal and offset) on the calling thread, so the
/// layout is deterministic, while a writer thread appends and hashes the bytes in parallel with
/// the next batch's compression.
#[derive(Debug, Default)]
struct PackPlan {
    pack: usize,
    len: u64,
}

impl PackPlan {
    /// Place `n` bytes: (pack ordinal, offset, whether the pack is full afterwards).
    fn place(&mut self, n: u64) -> (usize, u64, bool) {
        let at = (self.pack, self.len);
        self.len += n;
        let full = self.len >= PACK_TARGET_BYTES;
        if full {
            self.pack += 1;
            self.len = 0;
        }
        (at.0, at.1, full)
    }
}

enum PackOp {
    Append(Vec<u8>),
    Close,
}

/// The writer thread: appends to the current pack and commits it on `Close`. If the sender goes
/// away without a final `Close` (the build failed), the unfinished pack is dropped, temp file and all.
fn pack_writer(store: &LocalStore, rx: mpsc::Receiver<Vec<PackOp>>) -> Result<Vec<Sha256Digest>, BuildError> {
    let mut current: Option<BlobWriter> = None;
    let mut done = Vec::new();
    for op in rx.iter().flatten() {
        match op {
            PackOp::Append(bytes) => {
                let writer = match current.as_mut() {
                    Some(w) => w,
                    None => current.insert(store.blob_writer()?),
                };
                writer.append(&bytes)?;
            }
            PackOp::Close => {
                if let Some(writer) = current.take() {
                    done.push(writer.commit()?);
                }
            }
        }
    }
    Ok(done)
}

/// Chunk every regular file of `src`, deduplicating against `existing` (chunks the store holds)
/// and within the build, and write new chunks to packs in `store`. Files the previous build's
/// `index` lists unchanged (and whose chunks are all in `existing`) are not read.
pub fn chunk_tree(
    src: &SourceTree,
    store: &LocalStore,
    existing: HashMap<ChunkId, (Sha256Digest, PackLocation)>,
    chunk_size: u64,
    index: Option<&SourceIndex>,
    progress: &dyn Progress,
) -> Result<ChunkOutput, BuildError> {
    let mut known: Vec<Option<Vec<ChunkId>>> = Vec::new();
    let mut reused = Reuse::default();
    if let Some(index) = index.filter(|i| u64::from(i.chunk_size()) == chunk_size) {
        known.resize(src.tree.nodes.len(), None);
        for (node, slot) in known.iter_mut().enumerate() {
            if src.has_path(node) && !src.stamp(node).is_none() {
                *slot = indexed_chunks(src, node, chunk_size, index, &existing);
            }
        }
    }
    let mut total = 0u64;
    for (node, _, len) in chunk_pieces(src, chunk_size) {
        if known.get(node).is_some_and(Option::is_some) {
            reused.bytes += u64::from(len);
        } else {
            total += u64::from(len);
        }
    }
    reused.files = known.iter().filter(|k| k.is_some()).count() as u64;
    let mut out = chunk_with(src.tree.nodes.len(), total, store, existing, progress, |sink| {
        let mut batch = Batcher::default();
        let mut node_known: (usize, std::slice::Iter<'_, ChunkId>) = (usize::MAX, [].iter());
        for (node, offset, len) in chunk_pieces(src, chunk_size) {
            if node != node_known.0 {
                let list = known.get(node).and_then(Option::as_deref).unwrap_or(&[]);
                node_known = (node, list.iter());
            }
            let data = match node_known.1.next() {
                Some(id) => JobData::Known(*id),
                None => JobData::Path(src.file_path(node).ok_or(BuildError::Internal {
                    what: "a regular file without a source path",
                    chunk: None,
                })?),
            };
            batch.push(Job { node, offset, len, data }, sink)?;
        }
        batch.flush(sink)
    })?;
    out.reused = reused;
    Ok(out)
}

/// Groups jobs into batches of at most [`BATCH_BYTES`] (or one job, if larger) and at most
/// [`BATCH_JOBS`] jobs, in order.
#[derive(Default)]
pub(crate) struct Batcher {
    jobs: Vec<Job>,
    bytes: u64,
}

/// Receives one batch of jobs at a time.
pub(crate) type Sink<'a> = dyn FnMut(Vec<Job>, u64) -> Result<(), BuildError> + 'a;

impl Job {
    /// Bytes this job reads and hashes: what batches are sized by and progress counts.
    fn work_bytes(&self) -> u64 {
        match self.data {
            JobData::Known(_) => 0,
            _ => u64::from(self.len),
        }
    }
}

impl Batcher {
    pub(crate) fn push(&mut self, job: Job, sink: &mut Sink<'_>) -> Result<(), BuildError> {
        let bytes = job.work_bytes();
        if !self.jobs.is_empty() && (self.bytes + bytes > BATCH_BYTES || self.jobs.len() >= BATCH_JOBS) {
            self.flush(sink)?;
        }
        self.bytes += bytes;
        self.jobs.push(job);
        Ok(())
    }

    pub(crate) fn flush(&mut self, sink: &mut Sink<'_>) -> Result<(), BuildError> {
        if self.jobs.is_empty() {
            return Ok(());
        }
        let bytes = std::mem::take(&mut self.bytes);
        sink(std::mem::take(&mut self.jobs), bytes)
    }
}

/// The chunker core: `feed` hands batches of jobs to the sink in a deterministic order; each batch
/// is hashed and compressed on all cores, new chunks are placed in packs in that order and appended
/// by the writer thread.
pub(crate) fn chunk_with(
    nodes: usize,
    total: u64,
    store: &LocalStore,
    existing: HashMap<ChunkId, (Sha256Digest, PackLocation)>,
    progress: &dyn Progress,
    feed: impl FnOnce(&mut Sink<'_>) -> Result<(), BuildError>,
) -> Result<ChunkOutput, BuildError> {
    progress.start(total);
    // A rendezvous channel: the writer holds at most one batch while the next is compressed, so
    // memory stays bounded by about two batches.
    let (tx, rx) = mpsc::sync_channel::<Vec<PackOp>>(0);
    let (result, written) = std::thread::scope(|scope| {
        let writer = scope.spawn(|| pack_writer(store, rx));
        let mut state = ChunkState::new(nodes, existing);
        let mut sink = |batch: Vec<Job>, bytes: u64| {
            state.batch(batch, &tx)?;
            progress.advance(bytes);
            Ok(())
        };
        let result = feed(&mut sink).map(|()| state.out);
        if result.is_ok() {
            // Commit the last pack; a failed build leaves it uncommitted.
            let _ = tx.send(vec![PackOp::Close]);
        }
        drop(tx);
        let panicked = BuildError::Internal { what: "the pack writer thread panicked", chunk: None };
        (result, writer.join().unwrap_or(Err(panicked)))
    });
    // The writer's error first: when it fails (a full disk, say), feeding stops with "the pack
    // writer stopped", which says nothing of the cause.
    let new_packs = written?;
    let mut out = result?;
    out.new_packs = new_packs;
    for list in &mut out.files {
        list.sort_by_key(|c| c.0);
        // Most files have one chunk, and a Vec's first growth makes room for four (192 bytes).
        list.shrink_to_fit();
    }
    progress.finish();
    Ok(out)
}

struct ChunkState {
    /// Chunks the store held before this build (its pack index): looked up, never copied.
    existing: HashMap<ChunkId, (Sha256Digest, PackLocation)>,
    /// `out.homes` holds every chunk this build used so far, new or existing.
    out: ChunkOutput,
    plan: PackPlan,
}

impl ChunkState {
    fn new(nodes: usize, existing: HashMap<ChunkId, (Sha256Digest, PackLocation)>) -> Self {
        let out = ChunkOutput { files: vec![FileChunks::new(); nodes], ..Default::default() };
        Self { existing, out, plan: PackPlan::default() }
    }

    fn batch(&mut self, batch: Vec<Job>, tx: &mpsc::SyncSender<Vec<PackOp>>) -> Result<(), BuildError> {
        // The writer only stops early on an error, which `chunk_with` reports after joining it.
        let writer_gone = || BuildError::Internal { what: "the pack writer stopped", chunk: None };
        let (homes, existing) = (&self.out.homes, &self.existing);
        let known = |id: &ChunkId| homes.contains(id) || existing.contains_key(id);
        let results: Vec<Result<Processed, BuildError>> =
            batch.into_par_iter().map(|job| process(job, known)).collect();
        let mut ops = Vec::new();
        for result in results {
            let p = result?;
            // Layer sources number files as they meet them: the list grows.
            if p.node >= self.out.files.len() {
                self.out.files.resize(p.node + 1, FileChunks::new());
            }
            self.out.files[p.node].push((p.offset, p.id, p.len));
            let home = match self.out.homes.get(&p.id) {
                Some(home) => *home,
                None => match self.existing.get(&p.id) {
                    Some(&(pack, loc)) => self.out.existing_home(pack, loc),
                    None => {
                        // What is known only grows between batches, so a chunk judged known while
                        // the batch ran is still known here.
                        let Some((bytes, compression)) = p.stored else {
                            return Err(BuildError::Internal {
                                what: "a known chunk was forgotten",
                                chunk: Some(p.id),
                            });
                        };
                        let stored_len = bytes.len() as u32;
                        let (pack, offset, full) = self.plan.place(u64::from(stored_len));
                        ops.push(PackOp::Append(bytes));
                        if full {
                            ops.push(PackOp::Close);
                        }
                        self.out.new_chunks += 1;
                        self.out.new_stored_bytes += u64::from(stored_len);
                        let pack = pack as u32;
                        ChunkHome::New(PackLocation { pack, offset, stored_len, raw_len: p.len, compression })
                    }
                },
            };
            self.out.homes.insert(p.id, home)?;
        }
        tx.send(ops).map_err(|_| writer_gone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn home(offset: u64) -> ChunkHome {
        let loc = PackLocation { pack: 0, offset, stored_len: 1, raw_len: 1, compression: Compression::None };
        ChunkHome::New(loc)
    }

    #[test]
    fn homes_keep_the_first_home_and_are_found_by_hash_then_by_search_once_sealed() {
        let ids: Vec<ChunkId> = (0..5000u32).map(|i| ChunkId::of(&i.to_le_bytes())).collect();
        let mut homes = ChunkHomes::default();
        for (i, id) in ids.iter().enumerate() {
            homes.insert(*id, home(i as u64)).unwrap();
        }
        homes.insert(ids[7], home(99_999)).unwrap();
        assert_eq!(homes.len(), ids.len(), "a repeated id is not added again");
        let check = |homes: &ChunkHomes| {
            for (i, id) in ids.iter().enumerate() {
                assert_eq!(homes.get(id).map(|h| h.location().offset), Some(i as u64), "chunk {i}");
            }
            assert!(!homes.contains(&ChunkId::of(b"absent")));
        };
        check(&homes);
        homes.seal();
        check(&homes);
        assert!(
            homes.list.iter().zip(homes.list.iter().skip(1)).all(|(a, b)| a.0 < b.0),
            "sealed: sorted by id"
        );
        assert!(homes.insert(ChunkId::of(b"late"), home(0)).is_err(), "no insert once sealed");
    }
}
