//! `tessera build manifest:FILE`: an image from a human-writable content manifest (JSON, format
//! in `docs/formats/manifest-text.md`). Files given by chunk id are synthesized from chunks already
//! in the store without reading any file data; files given by a path on disk are read and chunked.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde::Deserialize;
use tessera_ext4::{Meta, Timestamp, Xattr};
use tessera_image::{BlockSize, ChunkId, RuntimeConfig};
use tessera_store::LocalStore;
use tracing::info;

use crate::chunk::{chunk_with, Batcher, Job, JobData};
use crate::error::BuildError;
use crate::image::attach_chunks;
use crate::manifest::{check_chunk, ContentManifest};
use crate::pipeline::{check_chunk_size, finish_image, BuildConfig, BuildOutput};
use crate::seed::FileChunks;
use crate::source::{parse_pax_time, EntryKind, Flattener, LayerEntry};
use crate::walk::open_noatime;
use crate::Progress;

/// The text format's version (`"tessera_manifest": 1`).
pub const TEXT_VERSION: u32 = 1;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Document {
    tessera_manifest: u32,
    entries: Vec<TextEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "lowercase")]
enum Type {
    File,
    Dir,
    Symlink,
    Hardlink,
    Char,
    Block,
    Fifo,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Time {
    Seconds(i64),
    Text(String),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum XattrValue {
    Text(String),
    Base64 { base64: String },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TextChunk {
    id: String,
    len: u32,
    #[serde(default)]
    offset: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TextEntry {
    path: String,
    #[serde(rename = "type")]
    kind: Type,
    #[serde(default)]
    mode: Option<String>,
    #[serde(default)]
    uid: u32,
    #[serde(default)]
    gid: u32,
    #[serde(default)]
    mtime: Option<Time>,
    #[serde(default)]
    atime: Option<Time>,
    #[serde(default)]
    ctime: Option<Time>,
    #[serde(default)]
    xattrs: BTreeMap<String, XattrValue>,
    /// file: content from this file on disk (relative to the manifest's directory).
    #[serde(default)]
    source: Option<PathBuf>,
    /// file: content as chunks already in the store.
    #[serde(default)]
    chunks: Option<Vec<TextChunk>>,
    /// file: the size (default: the end of the last chunk, or the source file's size).
    #[serde(default)]
    size: Option<u64>,
    /// symlink / hardlink.
    #[serde(default)]
    target: Option<String>,
    #[serde(default)]
    major: Option<u32>,
    #[serde(default)]
    minor: Option<u32>,
}

/// A file of the manifest whose content is read from disk: (file ordinal, path, size).
type DiskFile = (usize, PathBuf, u64);

fn bad(file: &Path, path: &str, reason: impl Into<String>) -> BuildError {
    BuildError::Manifest { file: file.to_owned(), path: path.to_owned(), reason: reason.into() }
}

fn time(file: &Path, path: &str, t: &Option<Time>) -> Result<Option<Timestamp>, BuildError> {
    match t {
        None => Ok(None),
        Some(Time::Seconds(s)) => Ok(Some(Timestamp { sec: *s, nsec: 0 })),
        Some(Time::Text(s)) => parse_pax_time(s.as_bytes())
            .map(Some)
            .ok_or_else(|| bad(file, path, format!("time {s:?} is not SECONDS[.NANOSECONDS]"))),
    }
}

/// Parse the text manifest at `file` into a content manifest; files given by a source path are
/// left without chunks and returned for reading.
fn parse(file: &Path, text: &[u8], fs_time: i64) -> Result<(ContentManifest, Vec<DiskFile>), BuildError> {
    let doc: Document = serde_json::from_slice(text).map_err(|e| BuildError::Manifest {
        file: file.to_owned(),
        path: String::new(),
        reason: e.to_string(),
    })?;
    if doc.tessera_manifest != TEXT_VERSION {
        return Err(bad(file, "", format!("unsupported tessera_manifest version {}", doc.tessera_manifest)));
    }
    let base = file.parent().unwrap_or(Path::new("."));
    let mut out = ContentManifest::default();
    let mut disk = Vec::new();
    for e in doc.entries {
        let p = e.path.as_str();
        if p.is_empty() || p.contains('\0') {
            return Err(bad(file, p, "a path must be non-empty and hold no NUL"));
        }
        let default_mode = match e.kind {
            Type::Dir => 0o755,
            _ => 0o644,
        };
        let mode = match &e.mode {
            None => default_mode,
            Some(m) => u16::from_str_radix(m, 8).ok().filter(|m| *m <= 0o7777).ok_or_else(|| {
                bad(file, p, format!("mode {m:?} is not octal permission bits like \"0755\""))
            })?,
        };
        if e.uid == u32::MAX || e.gid == u32::MAX {
            return Err(bad(file, p, "4294967295 is not a valid owner"));
        }
        let mtime = time(file, p, &e.mtime)?.unwrap_or(Timestamp { sec: fs_time, nsec: 0 });
        let meta = Meta {
            mode,
            uid: e.uid,
            gid: e.gid,
            atime: time(file, p, &e.atime)?.unwrap_or(mtime),
            mtime,
            ctime: time(file, p, &e.ctime)?.unwrap_or(mtime),
        };
        let mut xattrs = Vec::with_capacity(e.xattrs.len());
        for (name, value) in &e.xattrs {
            let value = match value {
                XattrValue::Text(t) => t.as_bytes().to_vec(),
                XattrValue::Base64 { base64 } => base64::engine::general_purpose::STANDARD
                    .decode(base64)
                    .map_err(|err| bad(file, p, format!("xattr {name}: {err}")))?,
            };
            if name.is_empty() || name.contains('\0') {
                return Err(bad(file, p, "an xattr name must be non-empty and hold no NUL"));
            }
            xattrs.push(Xattr { name: name.as_bytes().to_vec(), value });
        }
        let target = || -> Result<Vec<u8>, BuildError> {
            let t = e.target.as_deref().filter(|t| !t.is_empty() && !t.contains('\0'));
            t.map(|t| t.as_bytes().to_vec()).ok_or_else(|| bad(file, p, "needs a non-empty \"target\""))
        };
        let device = || -> Result<(u32, u32), BuildError> {
            match (e.major, e.minor) {
                (Some(major), Some(minor)) => Ok((major, minor)),
                _ => Err(bad(file, p, "a device needs \"major\" and \"minor\"")),
            }
        };
        let is_file = matches!(e.kind, Type::File);
        if !is_file && (e.source.is_some() || e.chunks.is_some() || e.size.is_some()) {
            return Err(bad(file, p, "\"source\", \"chunks\" and \"size\" are for files only"));
        }
        let kind = match e.kind {
            Type::File => {
                let ordinal = out.files.len();
                let (size, chunks) = match (&e.source, &e.chunks) {
                    (Some(src), None) => {
                        let src = base.join(src);
                        let md = std::fs::metadata(&src).map_err(BuildError::io(&src, "stat"))?;
                        if !md.is_file() {
                            return Err(bad(
                                file,
                                p,
                                format!("source {} is not a regular file", src.display()),
                            ));
                        }
                        let size = e.size.unwrap_or(md.len());
                        if size != md.len() {
                            return Err(bad(
                                file,
                                p,
                                format!("size {size}, but {} has {} bytes", src.display(), md.len()),
                            ));
                        }
                        disk.push((ordinal, src, size));
                        (size, FileChunks::new())
                    }
                    (None, Some(list)) => {
                        let mut chunks = FileChunks::with_capacity(list.len());
                        let mut end = 0u64;
                        for c in list {
                            let id = hex::decode(&c.id)
                                .ok()
                                .and_then(|b| <[u8; 32]>::try_from(b).ok())
                                .map(ChunkId)
                                .ok_or_else(|| {
                                    bad(file, p, format!("chunk id {:?} is not 64 hex digits", c.id))
                                })?;
                            let off = c.offset.unwrap_or(end.div_ceil(BlockSize::U64) * BlockSize::U64);
                            chunks.push((off, id, c.len));
                            end = off.saturating_add(u64::from(c.len));
                        }
                        let size = e.size.unwrap_or(end);
                        let mut prev = 0u64;
                        for &(off, _, len) in &chunks {
                            check_chunk(off, len, prev, size).map_err(|why| bad(file, p, why))?;
                            prev = off + u64::from(len);
                        }
                        (size, chunks)
                    }
                    (None, None) if e.size.unwrap_or(0) == 0 => (0, FileChunks::new()),
                    _ => return Err(bad(file, p, "a file needs exactly one of \"source\" and \"chunks\"")),
                };
                out.files.push(chunks);
                EntryKind::File { size, offset: ordinal as u64 }
            }
            Type::Dir => EntryKind::Dir,
            Type::Symlink => EntryKind::Symlink(target()?),
            Type::Hardlink => EntryKind::HardLink(target()?),
            Type::Char => {
                let (major, minor) = device()?;
                EntryKind::Char { major, minor }
            }
            Type::Block => {
                let (major, minor) = device()?;
                EntryKind::Block { major, minor }
            }
            Type::Fifo => EntryKind::Fifo,
        };
        if !matches!(kind, EntryKind::Symlink(_) | EntryKind::HardLink(_)) && e.target.is_some() {
            return Err(bad(file, p, "\"target\" is for symlinks and hard links only"));
        }
        out.entries.push(LayerEntry { path: p.as_bytes().to_vec(), kind, meta, xattrs });
    }
    Ok((out, disk))
}

/// Build the content manifest at `file` into `store`.
pub fn build_manifest(
    file: &Path,
    store: &LocalStore,
    config: &BuildConfig,
    progress: &dyn Progress,
) -> Result<BuildOutput, BuildError> {
    check_chunk_size(config.chunk_size)?;
    let text = std::fs::read(file).map_err(BuildError::io(file, "read"))?;
    let (mut manifest, disk) = parse(file, &text, config.fs_time)?;
    let existing = store.known_chunks()?;
    // Content by chunk id must be in the store already, with the length the manifest says.
    let mut homes = Vec::new();
    for (e, ordinal) in manifest.entries.iter().filter_map(|e| match e.kind {
        EntryKind::File { offset, .. } => Some((e, offset as usize)),
        _ => None,
    }) {
        for &(_, id, len) in manifest.files.get(ordinal).map(|l| l.as_slice()).unwrap_or(&[]) {
            let path = String::from_utf8_lossy(&e.path).into_owned();
            match existing.get(&id) {
                Some((pack, loc)) if loc.raw_len == len => homes.push((id, *pack, *loc)),
                Some((_, loc)) => {
                    return Err(BuildError::MissingContent {
                        path,
                        chunk: id,
                        reason: format!(
                            "the store's chunk is {} bytes, the manifest says {len}",
                            loc.raw_len
                        ),
                    })
                }
                None => {
                    return Err(BuildError::MissingContent {
                        path,
                        chunk: id,
                        reason: "not in the store".into(),
                    })
                }
            }
        }
    }
    let chunk_size = u64::from(config.chunk_size);
    let total: u64 = disk.iter().map(|d| d.2).sum();
    let mut chunks = chunk_with(manifest.files.len(), total, store, existing, progress, |sink| {
        let mut batch = Batcher::default();
        for (ordinal, path, size) in &disk {
            // Fail now, with the path, if it cannot be opened.
            drop(open_noatime(path)?);
            let mut off = 0u64;
            while off < *size {
                let len = (size - off).min(chunk_size);
                let job =
                    Job { node: *ordinal, offset: off, len: len as u32, data: JobData::Path(path.clone()) };
                batch.push(job, sink)?;
                off += len;
            }
        }
        batch.flush(sink)
    })?;
    for (ordinal, _, _) in &disk {
        if let (Some(slot), Some(list)) = (manifest.files.get_mut(*ordinal), chunks.files.get_mut(*ordinal)) {
            *slot = std::mem::take(list);
        }
    }
    for (id, pack, loc) in homes {
        chunks.add_existing(id, pack, loc)?;
    }
    info!(entries = manifest.entries.len(), read_files = disk.len(), "content manifest");
    let mut flattener = Flattener::new(config.fs_time);
    flattener.apply_layer(0, &format!("manifest {}", file.display()), &manifest.entries)?;
    let flat = attach_chunks(flattener.finish()?, &[&manifest])?;
    chunks.files = flat.files;
    let provenance = serde_json::json!({ "manifest": tessera_image::Sha256Digest::of(&text).to_string() });
    finish_image(&flat.tree, &mut chunks, store, config, RuntimeConfig::default(), provenance)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(json: &str) -> Result<(ContentManifest, Vec<DiskFile>), BuildError> {
        parse(Path::new("/m/manifest.json"), json.as_bytes(), 77)
    }

    #[test]
    fn parses_every_kind_with_defaults() {
        let id = ChunkId::of(b"x");
        let json = format!(
            r#"{{"tessera_manifest": 1, "entries": [
                {{"path": "/", "type": "dir", "mode": "0711"}},
                {{"path": "bin/big", "type": "file", "mode": "4755", "uid": 5, "mtime": "1700000000.5",
                  "chunks": [{{"id": "{id}", "len": 65536}}, {{"id": "{id}", "len": 10}}],
                  "xattrs": {{"user.a": "text", "security.capability": {{"base64": "AQAAAg=="}}}}}},
                {{"path": "bin/sh", "type": "symlink", "target": "big"}},
                {{"path": "bin/also", "type": "hardlink", "target": "bin/big"}},
                {{"path": "dev/null", "type": "char", "major": 1, "minor": 3}},
                {{"path": "run/p", "type": "fifo"}},
                {{"path": "empty", "type": "file"}}
                EXTRA
            ]}}"#
        );
        let with_source =
            json.replace("EXTRA", r#", {"path": "etc/motd", "type": "file", "source": "motd.txt"}"#);
        let err = parsed(&with_source).unwrap_err().to_string();
        assert!(err.contains("/m/motd.txt"), "a missing source file names it: {err}");
        let json = json.replace("EXTRA", "");
        let (m, disk) = parsed(&json).unwrap_or_else(|e| panic!("{e}\n{json}"));
        assert!(disk.is_empty());
        assert_eq!(m.entries.len(), 7);
        assert_eq!(m.entries[0].meta.mode, 0o711);
        let big = &m.entries[1];
        assert_eq!((big.meta.mode, big.meta.uid, big.meta.mtime.nsec), (0o4755, 5, 500_000_000));
        assert_eq!(big.meta.atime, big.meta.mtime);
        assert_eq!(big.kind, EntryKind::File { size: 65546, offset: 0 });
        assert_eq!(m.files[0][..], [(0, id, 65536), (65536, id, 10)]);
        assert_eq!(big.xattrs[0].name, b"security.capability");
        assert_eq!(big.xattrs[0].value, b"\x01\x00\x00\x02");
        assert_eq!(m.entries[4].kind, EntryKind::Char { major: 1, minor: 3 });
        assert_eq!(m.entries[5].meta.mode, 0o644);
        assert_eq!({ m.entries[5].meta.mtime.sec }, 77, "default time is the filesystem time");
        // The binary form takes it as it is.
        assert_eq!(ContentManifest::decode(&m.encode()).unwrap(), m);
    }

    #[test]
    fn errors_name_the_path() {
        let cases = [
            (r#"{"path": "a", "type": "file", "mode": "999"}"#, "mode"),
            (r#"{"path": "a", "type": "file", "chunks": [{"id": "zz", "len": 1}]}"#, "chunk id"),
            (r#"{"path": "a", "type": "file", "size": 5}"#, "exactly one"),
            (r#"{"path": "a", "type": "symlink"}"#, "target"),
            (r#"{"path": "a", "type": "char", "major": 1}"#, "minor"),
            (r#"{"path": "a", "type": "dir", "size": 1}"#, "files only"),
            (r#"{"path": "a", "type": "file", "mtime": "yesterday"}"#, "time"),
        ];
        for (entry, what) in cases {
            let json = format!(r#"{{"tessera_manifest": 1, "entries": [{entry}]}}"#);
            let err = parsed(&json).unwrap_err().to_string();
            assert!(err.contains("\"a\"") && err.contains(what), "{entry}: {err}");
        }
        let err = parsed(r#"{"tessera_manifest": 2, "entries": []}"#).unwrap_err().to_string();
        assert!(err.contains("version 2"), "{err}");
        assert!(parsed(r#"{"tessera_manifest": 1, "entries": [], "extra": 1}"#).is_err());
    }
}
