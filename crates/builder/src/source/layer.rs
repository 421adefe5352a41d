//! Reading one layer blob: verify its digest and size, sniff and undo its compression (gzip,
//! zstd or none), verify the uncompressed digest (diff_id), enforce `--max-size`, and parse its tar
//! headers into [`LayerEntry`]s. Content is never buffered here: a build reads each new layer once
//! ([`read_layer`], which hands each file's bytes to the chunker as the stream passes them);
//! [`scan_layer`] reads headers only.
//!
//! A change to what a layer yields (how a header field, PAX record or entry type is read) must
//! bump `crate::LAYER_READER_VERSION`: stored layer manifests made by the old rules are then not
//! reused, so a warm build never gives another image than a cold one.

use std::cell::RefCell;
use std::io::{self, BufRead, BufReader, Read};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use base64::Engine as _;
use sha2::{Digest as _, Sha256};
use tessera_ext4::{Meta, Timestamp, Xattr};

use super::error::{from_stream_error, show, SourceError, StreamFault};
use super::flatten::{EntryKind, LayerEntry};
use super::tar_ext::{Capture, Extensions, Tap};

/// A content digest (only sha256 is accepted).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Digest {
    pub hex: String,
}

impl Digest {
    /// Parse `sha256:<64 lowercase hex>`.
    pub fn parse(what: &str, s: &str) -> Result<Self, SourceError> {
        let bad = || SourceError::BadDigest { what: what.to_owned(), digest: s.to_owned() };
        let hex = s.strip_prefix("sha256:").ok_or_else(bad)?;
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err(bad());
        }
        Ok(Self { hex: hex.to_owned() })
    }
}

impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sha256:{}", self.hex)
    }
}

/// Opens a fresh reader over a blob's raw (possibly compressed) bytes.
pub type Opener = Box<dyn Fn() -> io::Result<Box<dyn Read + Send>> + Send + Sync>;

/// One layer of an image: how to read it and what it must hash to.
pub struct LayerBlob {
    /// Names the layer in errors, e.g. `layer 2 (sha256:…)`.
    pub name: String,
    pub open: Opener,
    /// Digest and size of the raw blob, when the source gives them (OCI descriptors).
    pub digest: Option<Digest>,
    pub size: Option<u64>,
    /// Digest of the uncompressed tar (the config's `rootfs.diff_ids`).
    pub diff_id: Option<Digest>,
}

impl std::fmt::Debug for LayerBlob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerBlob")
            .field("name", &self.name)
            .field("digest", &self.digest)
            .field("size", &self.size)
            .field("diff_id", &self.diff_id)
            .finish()
    }
}

/// A reader that writes every byte it reads to `sink` as well.
struct TeeRead {
    inner: Box<dyn Read + Send>,
    sink: Box<dyn io::Write + Send>,
}

impl Read for TeeRead {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.sink.write_all(&buf[..n])?;
        Ok(n)
    }
}

/// Hashes and counts a reader's bytes; at EOF checks them against the expected digest and size.
struct Verify<R> {
    inner: R,
    hasher: Sha256,
    count: u64,
    digest: Option<Digest>,
    size: Option<u64>,
    /// Uncompressed-side budget shared by every layer of a build (`--max-size`).
    budget: Option<(Arc<AtomicU64>, u64)>,
    checked: bool,
}

impl<R: Read> Verify<R> {
    fn new(
        inner: R,
        digest: Option<Digest>,
        size: Option<u64>,
        budget: Option<(Arc<AtomicU64>, u64)>,
    ) -> Self {
        Self { inner, hasher: Sha256::new(), count: 0, digest, size, budget, checked: false }
    }

    fn check(&mut self) -> io::Result<()> {
        if self.checked {
            return Ok(());
        }
        self.checked = true;
        if let Some(expected) = self.size {
            if expected != self.count {
                return Err(StreamFault::Size { expected, actual: self.count }.into_io());
            }
        }
        if let Some(d) = &self.digest {
            let actual = hex::encode(std::mem::take(&mut self.hasher).finalize());
            if actual != d.hex {
                return Err(StreamFault::Digest {
                    expected: d.to_string(),
                    actual: format!("sha256:{actual}"),
                }
                .into_io());
            }
        }
        Ok(())
    }
}

impl<R: Read> Read for Verify<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && !buf.is_empty() {
            self.check()?;
            return Ok(0);
        }
        self.count += n as u64;
        if let Some(expected) = self.size {
            if self.count > expected {
                return Err(StreamFault::Size { expected, actual: self.count }.into_io());
            }
        }
        if let Some((used, limit)) = &self.budget {
            let total = used.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
            if total > *limit {
                return Err(StreamFault::TooLarge { limit: *limit }.into_io());
            }
        }
        if self.digest.is_some() {
            self.hasher.update(&buf[..n]);
        }
        Ok(n)
    }
}

type Raw = BufReader<Verify<Box<dyn Read + Send>>>;

enum Decoded {
    Plain(Box<Raw>),
    Gzip(Box<flate2::bufread::MultiGzDecoder<Raw>>),
    Zstd(Box<zstd::stream::read::Decoder<'static, Raw>>),
    /// Gzip, inflated by a checkpoint indexer (`--reference-layers`).
    Indexed(Box<IndexingReader<Raw>>),
}

impl Read for Decoded {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Plain(r) => r.read(buf),
            Self::Gzip(r) => r.read(buf),
            Self::Zstd(r) => r.read(buf),
            Self::Indexed(r) => r.read(buf),
        }
    }
}

impl Decoded {
    fn into_raw(self) -> Raw {
        match self {
            Self::Plain(r) => *r,
            Self::Gzip(r) => r.into_inner(),
            Self::Zstd(r) => r.finish(),
            Self::Indexed(r) => r.inner,
        }
    }
}

/// Compressed bytes handed to the indexer at once: bounds the output one step can make (deflate
/// expands at most about 1032:1).
const INDEX_INPUT: usize = 16 << 10;

/// Where [`LayerStream::open_indexed`] leaves the gzip index once the stream has ended.
#[derive(Debug, Clone, Default)]
pub struct GzipIndexHandle(Arc<std::sync::Mutex<Option<tessera_gzip::GzipIndex>>>);

impl GzipIndexHandle {
    /// The index, once the stream was read to its end (taken: a second call gives `None`).
    pub fn take(&self) -> Option<tessera_gzip::GzipIndex> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// Decodes a gzip or zstd stream through a [`tessera_gzip::AnyIndexer`].
pub(crate) struct IndexingReader<R> {
    inner: R,
    indexer: Option<tessera_gzip::AnyIndexer>,
    /// Inflated bytes not yet read, from `pos`.
    pending: Vec<u8>,
    pos: usize,
    input: Vec<u8>,
    handle: GzipIndexHandle,
}

impl<R: Read> Read for IndexingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if self.pos < self.pending.len() {
                let n = buf.len().min(self.pending.len() - self.pos);
                buf[..n].copy_from_slice(&self.pending[self.pos..self.pos + n]);
                self.pos += n;
                return Ok(n);
            }
            let Some(indexer) = self.indexer.as_mut() else { return Ok(0) };
            self.pending.clear();
            self.pos = 0;
            let n = self.inner.read(&mut self.input)?;
            let bad = |e: tessera_gzip::GzipError| io::Error::new(io::ErrorKind::InvalidData, e);
            if n == 0 {
                let index =
                    self.indexer.take().map(tessera_gzip::AnyIndexer::finish).transpose().map_err(bad)?;
                *self.handle.0.lock().unwrap_or_else(|p| p.into_inner()) = index;
                return Ok(0);
            }
            let pending = &mut self.pending;
            indexer
                .push(&self.input[..n], &mut |b: &[u8]| {
                    pending.extend_from_slice(b);
                    Ok::<(), std::convert::Infallible>(())
                })
                .map_err(|e| match e {
                    tessera_gzip::PushError::Gzip(g) => bad(g),
                    tessera_gzip::PushError::Sink(never) => match never {},
                })?;
        }
    }
}

/// A layer's uncompressed tar stream with every check attached; [`Self::finish`] drains it and
/// reports any digest, size or trailer problem.
pub struct LayerStream {
    name: String,
    inner: Verify<Decoded>,
    pos: u64,
}

impl std::fmt::Debug for LayerStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerStream").field("name", &self.name).field("pos", &self.pos).finish()
    }
}

impl LayerStream {
    /// Open `blob`, checking its raw digest and size and its diff_id; uncompressed bytes count
    /// against `budget` (`(used, limit)`).
    pub fn open(blob: &LayerBlob, budget: Option<(Arc<AtomicU64>, u64)>) -> Result<Self, SourceError> {
        Self::open_checked(blob, budget, true)
    }

    /// Open `blob` again (pass 2), after [`Self::open`] and [`scan_layer`] read and verified it
    /// whole: when the source gives the raw blob's digest, that digest fixes every uncompressed
    /// byte, so the diff_id is not hashed a second time (it still is when the raw digest is
    /// unknown, as in docker archives). A blob that changed between the passes fails its raw
    /// digest at the end, like any other corruption.
    pub fn reopen(blob: &LayerBlob) -> Result<Self, SourceError> {
        Self::open_checked(blob, None, blob.digest.is_none())
    }

    /// Open a gzip or zstd `blob` for `--reference-layers`: as [`Self::open`], decoded by a
    /// [`tessera_gzip::AnyIndexer`] recording a checkpoint every `spacing` bytes (zstd: at frame
    /// boundaries). Once the stream has been read to its end, the index is in the returned handle.
    /// An uncompressed layer is [`SourceError::NotGzip`]. With `tee`, every raw (compressed) byte read from the blob is
    /// also written there, in order — a copy of the blob made by the same read (one download).
    pub fn open_indexed(
        blob: &LayerBlob,
        budget: Option<(Arc<AtomicU64>, u64)>,
        spacing: u64,
        tee: Option<Box<dyn io::Write + Send>>,
    ) -> Result<(Self, GzipIndexHandle), SourceError> {
        let handle = GzipIndexHandle::default();
        let stream = Self::open_with(blob, budget, true, Some((spacing, handle.clone())), tee)?;
        Ok((stream, handle))
    }

    fn open_checked(
        blob: &LayerBlob,
        budget: Option<(Arc<AtomicU64>, u64)>,
        check_diff_id: bool,
    ) -> Result<Self, SourceError> {
        Self::open_with(blob, budget, check_diff_id, None, None)
    }

    fn open_with(
        blob: &LayerBlob,
        budget: Option<(Arc<AtomicU64>, u64)>,
        check_diff_id: bool,
        index: Option<(u64, GzipIndexHandle)>,
        tee: Option<Box<dyn io::Write + Send>>,
    ) -> Result<Self, SourceError> {
        let err = |e| from_stream_error(&blob.name, e);
        let mut raw = (blob.open)().map_err(err)?;
        if let Some(sink) = tee {
            raw = Box::new(TeeRead { inner: raw, sink });
        }
        let mut raw =
            BufReader::with_capacity(256 << 10, Verify::new(raw, blob.digest.clone(), blob.size, None));
        let head = raw.fill_buf().map_err(err)?;
        let gzip = head.starts_with(&[0x1f, 0x8b]);
        let zstd = head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]);
        let decoded = if let Some((spacing, handle)) = index {
            let bad = |e| err(io::Error::new(io::ErrorKind::InvalidData, e));
            let indexer = if gzip {
                tessera_gzip::AnyIndexer::Gzip(tessera_gzip::Indexer::new(spacing).map_err(bad)?)
            } else if zstd {
                tessera_gzip::AnyIndexer::Zstd(tessera_gzip::ZstdIndexer::new(spacing).map_err(bad)?)
            } else {
                return Err(SourceError::NotGzip { layer: blob.name.clone(), format: "uncompressed" });
            };
            Decoded::Indexed(Box::new(IndexingReader {
                inner: raw,
                indexer: Some(indexer),
                pending: Vec::new(),
                pos: 0,
                input: vec![0u8; INDEX_INPUT],
                handle,
            }))
        } else if gzip {
            Decoded::Gzip(Box::new(flate2::bufread::MultiGzDecoder::new(raw)))
        } else if zstd {
            Decoded::Zstd(Box::new(zstd::stream::read::Decoder::with_buffer(raw).map_err(err)?))
        } else {
            Decoded::Plain(Box::new(raw))
        };
        Ok(Self {
            name: blob.name.clone(),
            inner: Verify::new(decoded, blob.diff_id.clone().filter(|_| check_diff_id), None, budget),
            pos: 0,
        })
    }

    /// Offset in the uncompressed stream.
    pub fn position(&self) -> u64 {
        self.pos
    }

    /// Discard bytes up to uncompressed offset `to`.
    pub fn skip_to(&mut self, to: u64) -> Result<(), SourceError> {
        if to < self.pos {
            return Err(SourceError::Corrupt {
                layer: self.name.clone(),
                source: io::Error::other(format!("cannot seek back from {} to {to}", self.pos)),
            });
        }
        let want = to - self.pos;
        let got = io::copy(&mut (&mut *self).take(want), &mut io::sink())
            .map_err(|e| from_stream_error(&self.name, e))?;
        if got != want {
            return Err(self.truncated());
        }
        Ok(())
    }

    /// Fill `buf` completely from the stream.
    pub fn read_exact_checked(&mut self, buf: &mut [u8]) -> Result<(), SourceError> {
        self.read_exact(buf).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                self.truncated()
            } else {
                from_stream_error(&self.name, e)
            }
        })
    }

    fn truncated(&self) -> SourceError {
        SourceError::Corrupt {
            layer: self.name.clone(),
            source: io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("stream ends at offset {}", self.pos),
            ),
        }
    }

    /// Read to the end, so that the decompressor checks its trailer, and verify every digest.
    pub fn finish(self) -> Result<(), SourceError> {
        self.finish_counted().map(drop)
    }

    /// [`Self::finish`], returning the length of the uncompressed stream.
    pub fn finish_counted(mut self) -> Result<u64, SourceError> {
        let name = self.name.clone();
        let err = |e| from_stream_error(&name, e);
        io::copy(&mut self, &mut io::sink()).map_err(err)?;
        let len = self.pos;
        let mut raw = self.inner.inner.into_raw();
        // Bytes after the end of the compressed stream are part of the blob too.
        io::copy(&mut raw, &mut io::sink()).map_err(err)?;
        raw.into_inner().check().map_err(err)?;
        Ok(len)
    }
}

impl Read for LayerStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.pos += n as u64;
        Ok(n)
    }
}

pub(crate) fn parse_pax_time(v: &[u8]) -> Option<Timestamp> {
    let s = std::str::from_utf8(v).ok()?;
    let (neg, body) = match s.strip_prefix('-') {
        Some(b) => (true, b),
        None => (false, s),
    };
    let (sec, frac) = body.split_once('.').unwrap_or((body, ""));
    if sec.is_empty() || !sec.bytes().all(|b| b.is_ascii_digit()) || !frac.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let sec: i64 = sec.parse().ok()?;
    let mut nsec: u32 = 0;
    for (i, d) in frac.bytes().take(9).enumerate() {
        nsec += u32::from(d - b'0') * 10u32.pow(8 - i as u32);
    }
    if !neg {
        return Some(Timestamp { sec, nsec });
    }
    // -1.25 is 1.25 s before the epoch: sec -2, nsec 750_000_000.
    if nsec == 0 {
        Some(Timestamp { sec: -sec, nsec: 0 })
    } else {
        Some(Timestamp { sec: -sec - 1, nsec: 1_000_000_000 - nsec })
    }
}

/// libarchive writes xattr values in base64 without padding (and reads them either way).
const LIBARCHIVE_BASE64: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    base64::engine::GeneralPurposeConfig::new()
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
);

/// Undo libarchive's name encoding: `%XX` (two hex digits) is that byte; anything else,
/// including a `%` not followed by two hex digits, stands for itself.
fn percent_decode(s: &[u8]) -> Vec<u8> {
    let hex = |b: u8| char::from(b).to_digit(16).and_then(|d| u8::try_from(d).ok());
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'%' {
            if let (Some(hi), Some(lo)) =
                (s.get(i + 1).and_then(|&b| hex(b)), s.get(i + 2).and_then(|&b| hex(b)))
            {
                out.push(hi << 4 | lo);
                i += 3;
                continue;
            }
        }
        out.push(s[i]);
        i += 1;
    }
    out
}

/// Combine `SCHILY.xattr.*` and `LIBARCHIVE.xattr.*` records of one entry. bsdtar writes both
/// for every xattr, the SCHILY one under the *encoded* name (a PAX key cannot hold `=` or a
/// newline, and libarchive uses the same encoded name for both). The LIBARCHIVE record is the
/// exact one: it wins over a SCHILY record of the same decoded name, and a SCHILY record whose
/// name is a LIBARCHIVE record's encoded name is that record's duplicate and is dropped. (umoci
/// and Go's archive/tar read only SCHILY records, so for names that need encoding they create
/// the encoded name; bsdtar creates both.)
fn merge_libarchive_xattrs(xattrs: &mut Vec<Xattr>, libarchive: Vec<(Vec<u8>, Xattr)>) {
    xattrs.retain(|x| !libarchive.iter().any(|(encoded, l)| x.name == *encoded || x.name == l.name));
    xattrs.extend(libarchive.into_iter().map(|(_, x)| x));
}

/// Parse every header of a layer (pass 1). Data is skipped, not kept; the stream is then drained
/// and verified. The `tar` crate frames the stream; extension headers are read from a copy of
/// the bytes between entries (see `tar_ext`).
pub fn scan_layer(stream: LayerStream) -> Result<Vec<LayerEntry>, SourceError> {
    walk_layer(stream, None).map(|(entries, _)| entries)
}

/// Receives each regular file's data during [`read_layer`]: `(ordinal, size, position, data)`,
/// where the ordinal counts the layer's regular files from 0 in stream order and `position` is
/// the offset of the file's first byte in the uncompressed tar stream (its data is contiguous
/// there: sparse entries are refused). It must read all `size` bytes or fail.
pub type FileSink<'a> = dyn FnMut(u64, u64, u64, &mut dyn Read) -> io::Result<()> + 'a;

/// The one pass over a layer: every header parsed as [`scan_layer`] does, and each regular
/// file's data handed to `on_file` as the stream passes it (so every byte is inflated and
/// hashed once). A file entry's `offset` is then its ordinal, not a stream offset. Returns the
/// entries and the length of the uncompressed stream; the stream is drained and verified.
pub fn read_layer(
    stream: LayerStream,
    on_file: &mut FileSink<'_>,
) -> Result<(Vec<LayerEntry>, u64), SourceError> {
    walk_layer(stream, Some(on_file))
}

fn walk_layer(
    mut stream: LayerStream,
    mut on_file: Option<&mut FileSink<'_>>,
) -> Result<(Vec<LayerEntry>, u64), SourceError> {
    let name = stream.name.clone();
    let mut files = 0u64;
    let mut out = Vec::new();
    {
        let capture = RefCell::new(Capture::default());
        let mut archive = tar::Archive::new(Tap { inner: &mut stream, capture: &capture });
        let entries = archive.entries().map_err(|e| from_stream_error(&name, e))?;
        for entry in entries {
            let mut entry = entry.map_err(|e| from_stream_error(&name, e))?;
            let header_at = entry.raw_header_position();
            let data_end = (entry.size().div_ceil(512))
                .checked_mul(512)
                .and_then(|padded| entry.raw_file_position().checked_add(padded))
                .ok_or_else(|| from_stream_error(&name, io::Error::other("entry size overflows")))?;
            let parsed = {
                let c = capture.borrow();
                let (region, raw_header) = c.region(header_at).ok_or_else(|| {
                    from_stream_error(&name, io::Error::other("lost track of the tar headers"))
                })?;
                let ext = Extensions::parse(region).map_err(|reason| SourceError::BadHeader {
                    layer: name.clone(),
                    path: show(&entry.header().path_bytes()),
                    field: "extension header",
                    reason,
                })?;
                let raw_header = tar::Header::from_byte_slice(raw_header);
                parse_entry(&name, &mut entry, &ext, raw_header)?
            };
            capture.borrow_mut().restart_at(data_end);
            if let Some(mut e) = parsed {
                if let (Some(sink), EntryKind::File { size, offset }) = (on_file.as_mut(), &mut e.kind) {
                    let position = entry.raw_file_position();
                    sink(files, *size, position, &mut entry).map_err(|e| from_stream_error(&name, e))?;
                    *offset = files;
                    files += 1;
                }
                out.push(e);
            }
        }
    }
    let len = stream.finish_counted()?;
    Ok((out, len))
}

/// Builds the error for a malformed header field of the entry being parsed.
type BadField<'a> = dyn Fn(&'static str, String) -> SourceError + 'a;

/// One entry from its raw header (as written, before the `tar` crate applied PAX values to it)
/// and its extension headers: names, size, PAX fields, then metadata and kind.
fn parse_entry<R: Read>(
    layer: &str,
    entry: &mut tar::Entry<'_, R>,
    ext: &Extensions,
    h: &tar::Header,
) -> Result<Option<LayerEntry>, SourceError> {
    let (path, link) = entry_names(ext, h);
    let bad = |field: &'static str, reason: String| SourceError::BadHeader {
        layer: layer.to_owned(),
        path: show(&path),
        field,
        reason,
    };
    // A PAX path or link may hold any byte but NUL (Go's archive/tar refuses those too); a
    // NUL cannot be in a file name or a symlink target.
    if path.contains(&0) {
        return Err(bad("path", "a NUL byte in the name".into()));
    }
    if link.as_ref().is_some_and(|l| l.contains(&0)) {
        return Err(bad("linkpath", "a NUL byte in the link target".into()));
    }
    // The data the `tar` crate framed must be the data every other reader frames.
    let size = match ext.get(b"size") {
        Some(v) => std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or_else(|| bad("size", show(v)))?,
        None => h.entry_size().map_err(|e| bad("size", e.to_string()))?,
    };
    if size != entry.size() {
        return Err(bad("size", format!("{size} bytes, but the tar reader framed {}", entry.size())));
    }
    let pax = PaxFields::parse(ext, &bad)?;
    let mut meta = entry_meta(h, &pax, &bad)?;
    let file = (entry.size(), entry.raw_file_position());
    let Some(kind) = entry_kind(layer, h, &path, link, file, &bad)? else { return Ok(None) };
    if matches!(kind, EntryKind::Symlink(_)) {
        // symlink(2) takes no mode: every Linux extractor (tar, umoci, containerd) makes 0777
        // whatever the header says (Python's `tarfile` writes 0644).
        meta.mode = SYMLINK_MODE;
    }
    Ok(Some(LayerEntry { path, kind, meta, xattrs: pax.xattrs }))
}

/// The permission bits of every symlink, as Linux creates them.
const SYMLINK_MODE: u16 = 0o777;

/// The entry's path and link target: PAX records first, then GNU long names, then the header.
fn entry_names(ext: &Extensions, h: &tar::Header) -> (Vec<u8>, Option<Vec<u8>>) {
    let path = match (ext.get(b"path"), &ext.long_name) {
        (Some(p), _) => p.to_vec(),
        (None, Some(long)) => long.clone(),
        (None, None) => h.path_bytes().into_owned(),
    };
    let link = match (ext.get(b"linkpath"), &ext.long_link) {
        (Some(l), _) => Some(l.to_vec()),
        (None, Some(long)) => Some(long.clone()),
        (None, None) => h.link_name_bytes().map(|l| l.into_owned()),
    }
    .filter(|l| !l.is_empty());
    (path, link)
}

/// What an entry's PAX records say about its owner, times and xattrs.
#[derive(Debug, Default)]
struct PaxFields {
    uid: Option<u32>,
    gid: Option<u32>,
    /// atime, mtime, ctime.
    times: [Option<Timestamp>; 3],
    /// SCHILY and LIBARCHIVE xattrs merged, sorted by name.
    xattrs: Vec<Xattr>,
}

impl PaxFields {
    fn parse(ext: &Extensions, bad: &BadField<'_>) -> Result<Self, SourceError> {
        let mut f = PaxFields::default();
        // libarchive's records (`LIBARCHIVE.xattr.<%-encoded name>=<base64 value>`): (encoded name, xattr).
        let mut libarchive: Vec<(Vec<u8>, Xattr)> = Vec::new();
        for (key, value) in &ext.pax {
            let (key, value) = (key.as_slice(), value.as_slice());
            let num = |v: &[u8]| std::str::from_utf8(v).ok().and_then(|s| s.parse::<u32>().ok());
            match key {
                b"uid" => f.uid = Some(num(value).ok_or_else(|| bad("uid", show(value)))?),
                b"gid" => f.gid = Some(num(value).ok_or_else(|| bad("gid", show(value)))?),
                b"atime" | b"mtime" | b"ctime" => {
                    let t = parse_pax_time(value).ok_or_else(|| bad("time", show(value)))?;
                    let slot = match key {
                        b"atime" => 0,
                        b"mtime" => 1,
                        _ => 2,
                    };
                    f.times[slot] = Some(t);
                }
                _ => {
                    if key.contains(&0) {
                        return Err(bad("xattr", format!("a NUL byte in the PAX key {}", show(key))));
                    }
                    if let Some(name) = key.strip_prefix(b"SCHILY.xattr.") {
                        if !name.is_empty() {
                            f.xattrs.retain(|x| x.name != name);
                            f.xattrs.push(Xattr { name: name.to_vec(), value: value.to_vec() });
                        }
                    } else if let Some(encoded) = key.strip_prefix(b"LIBARCHIVE.xattr.") {
                        let name = percent_decode(encoded);
                        if !name.is_empty() {
                            let value = LIBARCHIVE_BASE64
                                .decode(value)
                                .map_err(|e| bad("LIBARCHIVE.xattr", format!("{}: {e}", show(key))))?;
                            libarchive.retain(|(e, _)| e != encoded);
                            libarchive.push((encoded.to_vec(), Xattr { name, value }));
                        }
                    }
                }
            }
        }
        merge_libarchive_xattrs(&mut f.xattrs, libarchive);
        f.xattrs.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(f)
    }
}

/// Mode, owner and times: PAX values where the archive carries them, else the header's.
fn entry_meta(h: &tar::Header, pax: &PaxFields, bad: &BadField<'_>) -> Result<Meta, SourceError> {
    let mode = h.mode().map_err(|e| bad("mode", e.to_string()))?;
    let uid = match pax.uid {
        Some(u) => u,
        None => {
            let u = h.uid().map_err(|e| bad("uid", e.to_string()))?;
            u32::try_from(u).map_err(|_| bad("uid", u.to_string()))?
        }
    };
    let gid = match pax.gid {
        Some(g) => g,
        None => {
            let g = h.gid().map_err(|e| bad("gid", e.to_string()))?;
            u32::try_from(g).map_err(|_| bad("gid", g.to_string()))?
        }
    };
    if uid == u32::MAX || gid == u32::MAX {
        return Err(bad("uid/gid", "4294967295 is not a valid owner".into()));
    }
    let mtime = match pax.times[1] {
        Some(t) => t,
        None => {
            let m = h.mtime().map_err(|e| bad("mtime", e.to_string()))?;
            Timestamp { sec: i64::try_from(m).map_err(|_| bad("mtime", m.to_string()))?, nsec: 0 }
        }
    };
    // atime and ctime only when the archive carries them (PAX); otherwise they follow mtime.
    Ok(Meta {
        mode: (mode & 0o7777) as u16,
        uid,
        gid,
        atime: pax.times[0].unwrap_or(mtime),
        mtime,
        ctime: pax.times[2].unwrap_or(mtime),
    })
}

/// What the entry is; `None` for a PAX global header (it carries nothing the image keeps).
/// `file` is the framed data's `(size, position in the stream)`.
fn entry_kind(
    layer: &str,
    h: &tar::Header,
    path: &[u8],
    link: Option<Vec<u8>>,
    file: (u64, u64),
    bad: &BadField<'_>,
) -> Result<Option<EntryKind>, SourceError> {
    let device = |h: &tar::Header| -> Result<(u32, u32), SourceError> {
        let major = h.device_major().map_err(|e| bad("devmajor", e.to_string()))?.unwrap_or(0);
        let minor = h.device_minor().map_err(|e| bad("devminor", e.to_string()))?.unwrap_or(0);
        Ok((major, minor))
    };
    let link = || link.clone().ok_or_else(|| bad("linkname", "empty".into()));
    Ok(Some(match h.entry_type() {
        tar::EntryType::Regular | tar::EntryType::Continuous if path.ends_with(b"/") => EntryKind::Dir,
        tar::EntryType::Regular | tar::EntryType::Continuous => {
            EntryKind::File { size: file.0, offset: file.1 }
        }
        tar::EntryType::Directory => EntryKind::Dir,
        tar::EntryType::Symlink => EntryKind::Symlink(link()?),
        tar::EntryType::Link => EntryKind::HardLink(link()?),
        tar::EntryType::Char => {
            let (major, minor) = device(h)?;
            EntryKind::Char { major, minor }
        }
        tar::EntryType::Block => {
            let (major, minor) = device(h)?;
            EntryKind::Block { major, minor }
        }
        tar::EntryType::Fifo => EntryKind::Fifo,
        tar::EntryType::XGlobalHeader => return Ok(None),
        other => {
            return Err(SourceError::UnsupportedEntry {
                layer: layer.to_owned(),
                path: show(path),
                kind: char::from(other.as_byte()),
            })
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libarchive_xattr_names_and_values() {
        assert_eq!(percent_decode(b"user.sp%20ace%3D%25x"), b"user.sp ace=%x");
        assert_eq!(percent_decode(b"a%2"), b"a%2");
        assert_eq!(percent_decode(b"a%zz%41"), b"a%zzA");
        assert_eq!(percent_decode(b"%ff"), b"\xff");
        assert_eq!(LIBARCHIVE_BASE64.decode("AAEC/w").unwrap(), b"\x00\x01\x02\xff");
        assert_eq!(LIBARCHIVE_BASE64.decode("AAEC/w==").unwrap(), b"\x00\x01\x02\xff");
        let x = |n: &[u8], v: &[u8]| Xattr { name: n.to_vec(), value: v.to_vec() };
        // bsdtar's pair for a name that needs encoding, one that does not, and a SCHILY-only one.
        let mut xattrs = vec![x(b"user.sp%20ace", b"lossy"), x(b"user.plain", b"old"), x(b"user.only", b"1")];
        merge_libarchive_xattrs(
            &mut xattrs,
            vec![
                (b"user.sp%20ace".to_vec(), x(b"user.sp ace", b"\0")),
                (b"user.plain".to_vec(), x(b"user.plain", b"new")),
            ],
        );
        xattrs.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!(xattrs, vec![x(b"user.only", b"1"), x(b"user.plain", b"new"), x(b"user.sp ace", b"\0")]);
    }

    #[test]
    fn pax_times() {
        assert_eq!(
            parse_pax_time(b"1700000000.123456789"),
            Some(Timestamp { sec: 1_700_000_000, nsec: 123_456_789 })
        );
        assert_eq!(parse_pax_time(b"5.5"), Some(Timestamp { sec: 5, nsec: 500_000_000 }));
        assert_eq!(parse_pax_time(b"7"), Some(Timestamp { sec: 7, nsec: 0 }));
        assert_eq!(parse_pax_time(b"-1.25"), Some(Timestamp { sec: -2, nsec: 750_000_000 }));
        assert_eq!(parse_pax_time(b"1.0000000019"), Some(Timestamp { sec: 1, nsec: 1 }));
        assert_eq!(parse_pax_time(b"x"), None);
        assert_eq!(parse_pax_time(b""), None);
    }
}
