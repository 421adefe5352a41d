//! The image record: canonical, versioned binary encoding; its sha256 is the image ID.
//! Byte layout: `docs/formats/record.md`.

use std::collections::BTreeMap;

use crate::blockmap::BlockMap;
use crate::codec::{Reader, Writer};
use crate::digest::{ImageId, Sha256Digest};
use crate::error::DecodeError;

const MAGIC: &[u8; 8] = b"TESSREC\0";
/// The record format version this crate writes and reads.
pub const RECORD_VERSION: u32 = 1;

/// Build options that decide the bytes the guest sees (sizes are captured by [`Geometry`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuildOptions {
    /// Chunk size in bytes (power of two, 64 KiB..16 MiB).
    pub chunk_size: u32,
}

/// Filesystem geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub block_size: u32,
    pub blocks: u64,
    pub inodes: u64,
    pub inodes_per_group: u32,
    pub groups: u32,
    pub journal_blocks: u64,
    pub free_blocks: u64,
    pub free_inodes: u64,
    /// First block of file data (everything before is metadata or zeros).
    pub data_start_block: u64,
    /// First block after file data.
    pub data_end_block: u64,
    pub uuid: [u8; 16],
}

/// Counts derived from the tree (a pure function of it, so they do not disturb the ID rule).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ImageStats {
    /// Regular files (inodes, so a hard-link group counts once).
    pub files: u64,
    pub directories: u64,
    pub symlinks: u64,
    /// Devices, FIFOs, sockets.
    pub other_nodes: u64,
    pub inodes_used: u64,
    /// Sum of regular file sizes (apparent, holes included).
    pub logical_bytes: u64,
    /// Bytes of file data actually mapped (holes excluded).
    pub data_bytes: u64,
}

/// The metadata prefix: its uncompressed digest and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixInfo {
    /// sha256 of the uncompressed prefix bytes.
    pub digest: Sha256Digest,
    /// Length in blocks.
    pub blocks: u64,
}

/// The normalized runtime configuration (empty for a directory source).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RuntimeConfig {
    pub env: Vec<String>,
    pub entrypoint: Option<Vec<String>>,
    pub cmd: Option<Vec<String>>,
    pub working_dir: String,
    pub user: String,
    pub labels: BTreeMap<String, String>,
}

/// Everything that decides the bytes the guest sees and how the image runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRecord {
    pub options: BuildOptions,
    pub geometry: Geometry,
    pub stats: ImageStats,
    pub prefix: PrefixInfo,
    pub block_map: BlockMap,
    pub config: RuntimeConfig,
}

impl ImageRecord {
    /// The canonical encoding.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.bytes(MAGIC);
        w.u32(RECORD_VERSION);
        w.u32(self.options.chunk_size);
        let g = &self.geometry;
        w.u32(g.block_size);
        w.u64(g.blocks);
        w.u64(g.inodes);
        w.u32(g.inodes_per_group);
        w.u32(g.groups);
        w.u64(g.journal_blocks);
        w.u64(g.free_blocks);
        w.u64(g.free_inodes);
        w.u64(g.data_start_block);
        w.u64(g.data_end_block);
        w.bytes(&g.uuid);
        let s = &self.stats;
        for v in
            [s.files, s.directories, s.symlinks, s.other_nodes, s.inodes_used, s.logical_bytes, s.data_bytes]
        {
            w.u64(v);
        }
        w.bytes(&self.prefix.digest.0);
        w.u64(self.prefix.blocks);
        self.block_map.encode(&mut w);
        encode_config(&mut w, &self.config);
        w.buf
    }

    /// The image ID: sha256 of [`Self::encode`].
    pub fn id(&self) -> ImageId {
        ImageId(Sha256Digest::of(&self.encode()))
    }

    /// Decode and validate a record; rejects anything [`Self::encode`] would not produce.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(bytes, "image record");
        r.header(MAGIC, RECORD_VERSION)?;
        let options = BuildOptions { chunk_size: r.u32()? };
        let geometry = Geometry {
            block_size: r.u32()?,
            blocks: r.u64()?,
            inodes: r.u64()?,
            inodes_per_group: r.u32()?,
            groups: r.u32()?,
            journal_blocks: r.u64()?,
            free_blocks: r.u64()?,
            free_inodes: r.u64()?,
            data_start_block: r.u64()?,
            data_end_block: r.u64()?,
            uuid: r.array()?,
        };
        if geometry.block_size != crate::BLOCK_SIZE {
            return Err(r.not_canonical("geometry.block_size", "only 4096 is supported"));
        }
        let stats = ImageStats {
            files: r.u64()?,
            directories: r.u64()?,
            symlinks: r.u64()?,
            other_nodes: r.u64()?,
            inodes_used: r.u64()?,
            logical_bytes: r.u64()?,
            data_bytes: r.u64()?,
        };
        let prefix = PrefixInfo { digest: Sha256Digest(r.array()?), blocks: r.u64()? };
        let block_map = BlockMap::decode(&mut r)?;
        if block_map.device_blocks() != geometry.blocks {
            return Err(r.not_canonical("block_map", "device size differs from the geometry"));
        }
        if block_map.prefix_blocks() != prefix.blocks {
            return Err(r.not_canonical("prefix.blocks", "differs from the block map's prefix runs"));
        }
        let config = decode_config(&mut r)?;
        r.finish()?;
        Ok(Self { options, geometry, stats, prefix, block_map, config })
    }
}

#[cfg(any(test, feature = "test-support"))]
impl ImageRecord {
    /// A record like the builder makes (prefix runs, two chunks, a runtime config), for tests and
    /// fuzz seeds (feature `test-support`).
    pub fn example() -> Self {
        use crate::digest::ChunkId;
        const BUILT: &str = "the example block map is well formed";
        let mut b = BlockMap::builder(32768);
        b.push_prefix(0, 10, 0).expect(BUILT);
        let c = b.add_chunk(ChunkId::of(b"data"), 4);
        let d = b.add_chunk(ChunkId::of(b"more"), 3 * 4096 + 1);
        b.push_chunk(100, 1, c, 0).expect(BUILT);
        b.push_chunk(101, 4, d, 0).expect(BUILT);
        b.push_prefix(20, 2, 10).expect(BUILT);
        ImageRecord {
            options: BuildOptions { chunk_size: 512 * 1024 },
            geometry: Geometry {
                block_size: crate::BLOCK_SIZE,
                blocks: 32768,
                inodes: 8192,
                inodes_per_group: 8192,
                groups: 1,
                journal_blocks: 1024,
                free_blocks: 30000,
                free_inodes: 8000,
                data_start_block: 100,
                data_end_block: 105,
                uuid: [7; 16],
            },
            stats: ImageStats {
                files: 2,
                directories: 2,
                inodes_used: 14,
                logical_bytes: 12293,
                data_bytes: 12293,
                ..Default::default()
            },
            prefix: PrefixInfo { digest: Sha256Digest::of(b"prefix"), blocks: 12 },
            block_map: b.finish().expect(BUILT),
            config: RuntimeConfig {
                env: vec!["PATH=/bin".into()],
                entrypoint: Some(vec!["/bin/sh".into()]),
                cmd: None,
                working_dir: "/".into(),
                user: "0:0".into(),
                labels: [("a".to_string(), "b".to_string())].into_iter().collect(),
            },
        }
    }
}

fn encode_strings(w: &mut Writer, list: &[String]) {
    w.len(list.len());
    for s in list {
        w.blob(s.as_bytes());
    }
}

fn decode_strings(r: &mut Reader<'_>, field: &'static str) -> Result<Vec<String>, DecodeError> {
    let n = r.count(4)?;
    (0..n).map(|_| r.string(field)).collect()
}

fn encode_config(w: &mut Writer, c: &RuntimeConfig) {
    encode_strings(w, &c.env);
    for opt in [&c.entrypoint, &c.cmd] {
        match opt {
            None => w.u8(0),
            Some(list) => {
                w.u8(1);
                encode_strings(w, list);
            }
        }
    }
    w.blob(c.working_dir.as_bytes());
    w.blob(c.user.as_bytes());
    w.len(c.labels.len());
    for (k, v) in &c.labels {
        w.blob(k.as_bytes());
        w.blob(v.as_bytes());
    }
}

fn decode_config(r: &mut Reader<'_>) -> Result<RuntimeConfig, DecodeError> {
    let env = decode_strings(r, "config.env")?;
    let mut opts = [None, None];
    for (slot, field) in opts.iter_mut().zip(["config.entrypoint", "config.cmd"]) {
        *slot = match r.u8()? {
            0 => None,
            1 => Some(decode_strings(r, field)?),
            _ => return Err(r.not_canonical(field, "option tag is not 0 or 1")),
        };
    }
    let [entrypoint, cmd] = opts;
    let working_dir = r.string("config.working_dir")?;
    let user = r.string("config.user")?;
    let n = r.count(8)?;
    let mut labels = BTreeMap::new();
    let mut prev: Option<String> = None;
    for _ in 0..n {
        let k = r.string("config.labels")?;
        let v = r.string("config.labels")?;
        if prev.as_ref().is_some_and(|p| p >= &k) {
            return Err(r.not_canonical("config.labels", "keys not strictly ascending"));
        }
        prev = Some(k.clone());
        labels.insert(k, v);
    }
    Ok(RuntimeConfig { env, entrypoint, cmd, working_dir, user, labels })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_stable_id() {
        let r = ImageRecord::example();
        let bytes = r.encode();
        assert_eq!(ImageRecord::decode(&bytes).unwrap(), r);
        assert_eq!(r.id(), ImageRecord::decode(&bytes).unwrap().id());
        let mut other = r.clone();
        other.config.entrypoint = Some(vec!["/bin/bash".into()]);
        assert_ne!(other.id(), r.id());
    }

    #[test]
    fn rejects_corruption() {
        let bytes = ImageRecord::example().encode();
        for cut in [0, 7, 8, 12, bytes.len() / 2, bytes.len() - 1] {
            assert!(ImageRecord::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut extra = bytes.clone();
        extra.push(0);
        assert!(matches!(ImageRecord::decode(&extra), Err(DecodeError::TrailingBytes { .. })));
        let mut v2 = bytes.clone();
        v2[8] = 2;
        assert!(matches!(ImageRecord::decode(&v2), Err(DecodeError::UnsupportedVersion { .. })));
        let mut magic = bytes;
        magic[0] = b'X';
        assert!(matches!(ImageRecord::decode(&magic), Err(DecodeError::BadMagic { .. })));
    }

    #[test]
    fn hostile_counts_do_not_allocate() {
        let mut bytes = ImageRecord::example().encode();
        // Overwrite the chunk count (after magic, version, options, geometry, stats, prefix and two u64s).
        let off = 8 + 4 + 4 + (4 + 8 + 8 + 4 + 4 + 8 * 5 + 16) + 8 * 7 + 32 + 8 + 16;
        bytes[off..off + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(ImageRecord::decode(&bytes).is_err());
    }
}
