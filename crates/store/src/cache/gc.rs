//! `tessera cache gc`: check every entry, remove what killed processes and corruption left, rebuild
//! the index from the directory and trim to a bound.

use std::fs;
use std::io::ErrorKind;

use tessera_image::{ChunkId, ImageEntry, Sha256Digest};
use tracing::warn;

use super::index::{disk_bytes, ChunkForm, EntryKey};
use super::journal::walk_entries;
use super::DiskCache;
use crate::origin::http::parse_ref;
use crate::reader::MAX_CHUNK_LEN;

/// What [`DiskCache::gc`] found and did. Byte counts are on-disk sizes (whole 4 KiB blocks).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Entries and bytes the cache held before (per a scan of the directory).
    pub entries_before: u64,
    /// Bytes before (entries, temp files and unknown files).
    pub bytes_before: u64,
    /// Temp files of writers that died before publishing.
    pub temp_files: u64,
    /// Their bytes.
    pub temp_bytes: u64,
    /// Lock files nobody held.
    pub lock_files: u64,
    /// Entries that failed their check (digest, chunk id, entry or tag format).
    pub corrupt_entries: u64,
    /// Their bytes.
    pub corrupt_bytes: u64,
    /// Files in the entry directories that are not entries (foreign or mis-named).
    pub unknown_files: u64,
    /// Their bytes.
    pub unknown_bytes: u64,
    /// Entries evicted to fit the bound.
    pub evicted_entries: u64,
    /// Their bytes.
    pub evicted_bytes: u64,
    /// Entries left.
    pub entries_after: u64,
    /// Bytes left (entries).
    pub bytes_after: u64,
}

impl GcReport {
    /// Bytes removed in all.
    pub fn freed_bytes(&self) -> u64 {
        self.temp_bytes + self.corrupt_bytes + self.unknown_bytes + self.evicted_bytes
    }
}

/// Whether `bytes` are a valid cache file for `key`.
pub fn entry_is_valid(key: &EntryKey, bytes: &[u8]) -> bool {
    match key {
        EntryKey::Blob(d) => Sha256Digest::of(bytes) == Sha256Digest(*d),
        EntryKey::Span(d) => blake3::hash(bytes).as_bytes() == d,
        EntryKey::Chunk(id, form) => {
            let id = ChunkId(*id);
            match form {
                ChunkForm::Raw => !bytes.is_empty() && id.matches(bytes),
                ChunkForm::Zstd(n) => {
                    bytes.len() as u64 == u64::from(*n)
                        && zstd::bulk::decompress(bytes, MAX_CHUNK_LEN as usize).is_ok_and(|d| id.matches(&d))
                }
            }
        }
        EntryKey::Doc(rel) => {
            let name = rel.rsplit('/').next().unwrap_or_default();
            if rel.contains("/refs/") {
                parse_ref(bytes).is_some()
            } else {
                let record = name.strip_suffix(".json").and_then(|h| Sha256Digest::from_hex(h).ok());
                matches!((ImageEntry::from_json(bytes), record), (Ok(e), Some(r)) if e.record == r)
            }
        }
    }
}

impl DiskCache {
    /// Garbage-collect the cache: remove abandoned temp and lock files, check every entry
    /// (removing the corrupt ones and files that are not entries), rebuild the index from the
    /// directory (keeping the known recency order), and evict down to `bound` if given. Safe
    /// while other processes use the cache.
    pub fn gc(&self, bound: Option<u64>) -> std::io::Result<GcReport> {
        let mut r = GcReport::default();
        let files = walk_entries(self.root())?;
        r.entries_before = files.len() as u64;
        r.bytes_before = files.iter().map(|(_, m)| disk_bytes(m.len())).sum();
        let left = self.remove_leftovers();
        r.temp_files = left.temp_files;
        r.temp_bytes = disk_bytes(left.temp_bytes);
        r.lock_files = left.lock_files;
        for (rel, meta) in files {
            let path = self.root().join(&rel);
            let Some(key) = EntryKey::parse(&rel) else {
                warn!(path = %path.display(), "removing a file that is not a cache entry");
                if fs::remove_file(&path).is_ok() {
                    r.unknown_files += 1;
                    r.unknown_bytes += disk_bytes(meta.len());
                }
                continue;
            };
            let bytes = match fs::read(&path) {
                Ok(b) => b,
                Err(e) if e.kind() == ErrorKind::NotFound => continue, // evicted meanwhile
                Err(e) => return Err(e),
            };
            if !entry_is_valid(&key, &bytes) {
                self.drop_corrupt(&key);
                r.corrupt_entries += 1;
                r.corrupt_bytes += disk_bytes(meta.len());
            }
        }
        self.inner.journal.rescan()?;
        if let Some(bound) = bound {
            let e = self.trim(bound)?;
            r.evicted_entries = e.entries;
            r.evicted_bytes = e.bytes;
        }
        let (bytes, entries) = self.size()?;
        r.bytes_after = bytes;
        r.entries_after = entries as u64;
        Ok(r)
    }
}
