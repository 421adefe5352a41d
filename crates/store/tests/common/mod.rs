//! Shared helpers: a deterministic RNG, a hand-built image with a reference device, mounts.
#![allow(dead_code, clippy::unwrap_used)] // test helpers: panics are the failure report

use std::path::{Path, PathBuf};
use std::process::Command;

use tessera_image::{
    BlockMap, BuildOptions, ChunkId, ChunkRef, Compression, Geometry, ImageEntry, ImageId, ImageRecord,
    ImageStats, PackIndexEncoder, PackLocation, PrefixInfo, RuntimeConfig, Sha256Digest, BLOCK_SIZE,
};
use tessera_store::{ChunkSource, LocalStore, StoreError};

pub const BS: usize = BLOCK_SIZE as usize;

/// xorshift64*: deterministic, dependency-free.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// A chunk of the test image and how it is stored.
#[derive(Debug, Clone)]
pub struct TestChunk {
    pub data: Vec<u8>,
    pub id: ChunkId,
    pub compress: bool,
    pub pack: Sha256Digest,
    pub loc: PackLocation,
}

#[derive(Debug)]
pub struct TestImage {
    pub id: ImageId,
    pub entry: ImageEntry,
    pub record: ImageRecord,
    /// The device as the guest must see it.
    pub device: Vec<u8>,
    /// a (zstd, 4 blocks, partial last block, used twice), b (raw, 2 blocks), c (zstd, 8 blocks),
    /// d (raw, 100 bytes, at the very end of the device).
    pub chunks: Vec<TestChunk>,
}

/// Build a small image by hand into `store`: prefix runs (with an all-zero block inside), chunk
/// runs incl. a chunk used twice, adjacent runs from different chunks, a run starting inside a
/// chunk, partial last blocks, two packs (zstd and raw chunks), a pack index, an entry and the
/// tag `test`.
pub fn build_image(store: &LocalStore, device_blocks: u64) -> TestImage {
    assert!(device_blocks >= 64);
    let mut rng = Rng::new(0x7e55e7a);
    let mut prefix = rng.bytes(5 * BS);
    prefix[2 * BS..3 * BS].fill(0); // an all-zero metadata block: export must leave it a hole

    let mut a = rng.bytes(3 * BS + 100);
    a[BS..BS + 200].fill(0);
    let b = rng.bytes(2 * BS);
    let c: Vec<u8> = (0..8 * BS).map(|i| (i / 97) as u8).collect(); // compressible
    let d = rng.bytes(100);
    let mut chunks: Vec<TestChunk> = [(a, true), (b, false), (c, true), (d, false)]
        .into_iter()
        .map(|(data, compress)| TestChunk {
            id: ChunkId::of(&data),
            data,
            compress,
            pack: Sha256Digest([0; 32]),
            loc: PackLocation {
                pack: 0,
                offset: 0,
                stored_len: 0,
                raw_len: 0,
                compression: Compression::None,
            },
        })
        .collect();

    // Packs: a+b in pack 0, c+d in pack 1, each a concatenation of stored chunks.
    let mut packs = Vec::new();
    for (p, members) in [[0usize, 1], [2, 3]].iter().enumerate() {
        let mut w = store.blob_writer().unwrap();
        for &i in members {
            let ch = &mut chunks[i];
            let stored =
                if ch.compress { zstd::bulk::compress(&ch.data, 3).unwrap() } else { ch.data.clone() };
            let offset = w.append(&stored).unwrap();
            ch.loc = PackLocation {
                pack: p as u32,
                offset,
                stored_len: stored.len() as u32,
                raw_len: ch.data.len() as u32,
                compression: if ch.compress { Compression::Zstd } else { Compression::None },
            };
        }
        let digest = w.commit().unwrap();
        for &i in members {
            chunks[i].pack = digest;
        }
        packs.push(digest);
    }
    // A version-2 index (what builds write): the chunks in the BlockMap's order, added below.
    let mut index = PackIndexEncoder::new(&packs, chunks.len());
    for c in &chunks {
        index.entry(ChunkRef { id: c.id, len: c.data.len() as u32 }, c.loc).unwrap();
    }
    let pack_index = store.put_blob(&index.finish().unwrap()).unwrap();

    let mut m = BlockMap::builder(device_blocks);
    m.push_prefix(0, 2, 0).unwrap();
    m.push_prefix(2, 3, 2).unwrap(); // merges with the first
    let ia = m.add_chunk(chunks[0].id, chunks[0].data.len() as u32);
    let ib = m.add_chunk(chunks[1].id, chunks[1].data.len() as u32);
    let ic = m.add_chunk(chunks[2].id, chunks[2].data.len() as u32);
    let id_ = m.add_chunk(chunks[3].id, chunks[3].data.len() as u32);
    // (device block, blocks, chunk, chunk block); the prefix run is blocks 0..5.
    let runs: [(u64, u64, u32, u32); 6] = [
        (10, 4, ia, 0),
        (14, 2, ib, 0), // adjacent to a's run
        (30, 4, ia, 0), // a used twice
        (40, 2, ia, 2), // starts inside a, ends on its partial block
        (50, 8, ic, 0),
        (device_blocks - 1, 1, id_, 0),
    ];
    for &(start, blocks, chunk, block) in &runs {
        m.push_chunk(start, blocks, chunk, block).unwrap();
    }
    let block_map = m.finish().unwrap();

    let mut device = vec![0u8; device_blocks as usize * BS];
    device[..5 * BS].copy_from_slice(&prefix);
    let data_of = |i: u32| &chunks[[ia, ib, ic, id_].iter().position(|&x| x == i).unwrap()].data;
    for &(start, blocks, chunk, block) in &runs {
        let data = data_of(chunk);
        let from = block as usize * BS;
        let to = (from + blocks as usize * BS).min(data.len());
        let dst = start as usize * BS;
        device[dst..dst + (to - from)].copy_from_slice(&data[from..to]);
    }

    let record = ImageRecord {
        options: BuildOptions { chunk_size: 64 * 1024 },
        geometry: Geometry {
            block_size: BLOCK_SIZE,
            blocks: device_blocks,
            inodes: 16,
            inodes_per_group: 16,
            groups: 1,
            journal_blocks: 0,
            free_blocks: 0,
            free_inodes: 0,
            data_start_block: 5,
            data_end_block: device_blocks,
            uuid: [9; 16],
        },
        stats: ImageStats::default(),
        prefix: PrefixInfo { digest: Sha256Digest::of(&prefix), blocks: 5 },
        block_map,
        config: RuntimeConfig::default(),
    };
    let record_digest = store.put_blob(&record.encode()).unwrap();
    let id = ImageId(record_digest);
    assert_eq!(id, record.id());
    let prefix_digest = store.put_blob(&zstd::bulk::compress(&prefix, 3).unwrap()).unwrap();
    let entry = ImageEntry {
        record: record_digest,
        prefix: prefix_digest,
        pack_index,
        profile: None,
        provenance: None,
    };
    store.put_entry(&id, &entry).unwrap();
    store.set_ref("test", &id).unwrap();
    TestImage { id, entry, record, device, chunks }
}

/// Files directly inside `dir`.
pub fn files_in(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default()
}

/// A mounted tmpfs, unmounted on drop.
pub struct Mount {
    pub path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Mount {
    /// Mount a tmpfs with `options` (e.g. `size=1M`); `None` (with a printed reason) if not permitted.
    pub fn tmpfs(options: &str) -> Option<Self> {
        let dir = tempfile::tempdir().unwrap();
        let out =
            Command::new("mount").args(["-t", "tmpfs", "-o", options, "tmpfs"]).arg(dir.path()).output();
        match out {
            Ok(o) if o.status.success() => Some(Self { path: dir.path().to_owned(), _dir: dir }),
            Ok(o) => {
                eprintln!("SKIP: cannot mount tmpfs: {}", String::from_utf8_lossy(&o.stderr).trim());
                None
            }
            Err(e) => {
                eprintln!("SKIP: cannot run mount: {e}");
                None
            }
        }
    }

    pub fn remount(&self, options: &str) {
        let st = Command::new("mount")
            .args(["-o", &format!("remount,{options}")])
            .arg(&self.path)
            .status()
            .unwrap();
        assert!(st.success(), "remount {options}");
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.path).status();
    }
}

/// A chunk source that counts the pack reads it passes on.
pub struct Counting<S> {
    pub inner: S,
    pub reads: std::sync::atomic::AtomicUsize,
}

impl<S> Counting<S> {
    pub fn new(inner: S) -> Self {
        Self { inner, reads: std::sync::atomic::AtomicUsize::new(0) }
    }

    /// Pack reads so far.
    pub fn reads(&self) -> usize {
        self.reads.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl<S: ChunkSource> ChunkSource for Counting<S> {
    fn read_stored(&self, pack: &Sha256Digest, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
        self.reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.read_stored(pack, offset, len)
    }
}
