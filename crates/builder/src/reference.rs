//! `tessera build … --reference-layers`: an image whose file data stays in the source image's gzip
//! layer blobs (`docs/formats/reference-index.md`).
//!
//! Each layer is inflated once, by a [`tessera_gzip::Indexer`] that records checkpoints on the
//! way; each regular file's bytes are cut into chunks at the same offsets as a converted build and
//! hashed (blake3), and where they lie in the uncompressed tar stream is noted. The manifests are
//! flattened and synthesized exactly as in a converted build, so the record — hence the image ID —
//! is the one a converted build gives. Then each layer blob is copied into the store as it is
//! (checked against its digest) while the compressed bytes of every span are hashed, and the
//! reference pack index takes the place of the pack index. No pack is written.

use std::io::Read;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use rayon::prelude::*;
use sha2::{Digest as _, Sha256};
use tessera_image::{
    ChunkId, RefCheckpoint, RefCodec, RefIndex, RefLayer, RefLocation, Sha256Digest, Window,
};
use tessera_store::{BlobWriter, LocalStore};
use tracing::{debug, info};

use crate::error::BuildError;
use crate::image::{flatten, Layer};
use crate::manifest::ContentManifest;
use crate::pipeline::{check_chunk_size, finish_image_with, BuildConfig, BuildOutput};
use crate::seed::FileChunks;
use crate::source::{read_layer, EntryKind, ImageSource, LayerBlob, LayerStream, SourceError};
use crate::Progress;

/// The largest span of a zstd layer (its spans are whole frames; the spacing is 512 KiB): a layer
/// with a larger frame is refused, with the way to recompress it.
const MAX_ZSTD_SPAN: u64 = 8 << 20;

/// One layer read for reference: its manifest, where its chunks are, and its checkpoints.
struct ReadLayer {
    manifest: ContentManifest,
    tar_bytes: u64,
    chunks: Vec<(ChunkId, u64, u32)>,
    index: tessera_gzip::GzipIndex,
}

/// Build `source` as a reference image into `store`.
pub(crate) fn build_referenced(
    source: &ImageSource,
    store: &LocalStore,
    config: &BuildConfig,
    progress: &dyn Progress,
) -> Result<BuildOutput, BuildError> {
    check_chunk_size(config.chunk_size)?;
    let mut digests = Vec::with_capacity(source.layers.len());
    for blob in &source.layers {
        let digest = blob.digest.as_ref().and_then(|d| d.to_string().parse::<Sha256Digest>().ok());
        let Some(digest) = digest else {
            return Err(BuildError::Unsupported {
                what: format!(
                    "--reference-layers builds of sources without layer digests ({} has none: use an OCI layout or a registry)",
                    blob.name
                ),
            });
        };
        digests.push(digest);
    }
    let budget = config.max_size.map(|limit| (Arc::new(AtomicU64::new(0)), limit));
    progress.start(source.layers.iter().filter_map(|b| b.size).sum());
    let read: Vec<ReadLayer> = source
        .layers
        .par_iter()
        .zip(&digests)
        .map(|(blob, digest)| {
            let layer =
                read_for_reference(blob, digest, store, budget.clone(), u64::from(config.chunk_size))?;
            progress.advance(blob.size.unwrap_or(0));
            Ok(layer)
        })
        .collect::<Result<_, BuildError>>()?;
    progress.finish();

    let layers: Vec<Layer> = read
        .iter()
        .map(|r| Layer { manifest: r.manifest.clone(), reused: None, tar_bytes: r.tar_bytes })
        .collect();
    let flat = flatten(&source.layers, &layers, config.fs_time)?;
    info!(nodes = flat.tree.nodes.len(), layers = layers.len(), "flattened layers (reference)");

    // Every span's compressed bytes hashed, from the store's copy of its layer blob (the layers
    // at once: each is a read of its blob and a sha256 of it).
    let ref_layers = source
        .layers
        .par_iter()
        .zip(&digests)
        .zip(&read)
        .map(|((blob, digest), r)| hash_spans(store, blob, digest, r))
        .collect::<Result<Vec<_>, BuildError>>()?;
    let mut entries = Vec::new();
    for (layer, r) in read.iter().enumerate() {
        let layer =
            u32::try_from(layer).map_err(|_| BuildError::Unsupported { what: "2^32 layers".into() })?;
        entries.extend(r.chunks.iter().map(|&(id, offset, len)| (id, RefLocation { layer, offset, len })));
    }
    let mut provenance = source.provenance.clone();
    if let Some(obj) = provenance.as_object_mut() {
        obj.insert("reference_layers".into(), true.into());
    }
    let out = finish_image_with(
        &flat.tree,
        &flat.files,
        store,
        config,
        source.config.clone(),
        provenance,
        |record, id| {
            // The windows in a blob of their own (version 2): a reader opening the image fetches
            // the index without them, and each window with its span. The entries follow the
            // record's chunk list (version 3): no chunk id is repeated.
            let (index, windows) = RefIndex::new(id, ref_layers, entries).split_windows();
            let index = index.align(record.block_map.chunks()).map_err(|why| {
                tracing::error!(%why, "the reference index does not hold the image's chunks");
                BuildError::Internal { what: "a chunk of the image is in no layer", chunk: None }
            })?;
            if let Some(w) = &windows {
                store.put_blob(w)?;
            }
            info!(
                layers = index.layers.len(),
                chunks = index.len(),
                window_bytes = index.window_bytes(),
                "reference pack index"
            );
            Ok(store.put_blob(&index.encode())?)
        },
    )?;
    Ok(out)
}

/// A store blob writer shared with the layer stream's tee (taken back to commit it).
#[derive(Clone)]
struct SharedBlob(Arc<Mutex<Option<BlobWriter>>>);

impl std::io::Write for SharedBlob {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut w = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match w.as_mut() {
            Some(w) => w.write(buf),
            None => Err(std::io::Error::other("the layer copy was already committed")),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Inflate `blob` once through the checkpoint indexer, hashing each file's chunks; the same
/// read copies the blob as it is into `store` (unless it holds it already), checked against
/// `digest` — a registry's layer is downloaded once.
fn read_for_reference(
    blob: &LayerBlob,
    digest: &Sha256Digest,
    store: &LocalStore,
    budget: Option<(Arc<AtomicU64>, u64)>,
    chunk_size: u64,
) -> Result<ReadLayer, BuildError> {
    let copy = if store.has_blob(digest)? {
        None
    } else {
        Some(SharedBlob(Arc::new(Mutex::new(Some(store.blob_writer()?)))))
    };
    let tee = copy.clone().map(|c| Box::new(c) as Box<dyn std::io::Write + Send>);
    let (stream, handle) = LayerStream::open_indexed(blob, budget, tessera_gzip::DEFAULT_SPACING, tee)?;
    let mut files: Vec<FileChunks> = Vec::new();
    let mut chunks: Vec<(ChunkId, u64, u32)> = Vec::new();
    let mut buf = vec![0u8; chunk_size as usize];
    let mut sink = |_ordinal: u64, size: u64, position: u64, data: &mut dyn Read| -> std::io::Result<()> {
        let mut list = FileChunks::new();
        let mut done = 0u64;
        while done < size {
            let len = (size - done).min(chunk_size);
            let piece = &mut buf[..len as usize];
            data.read_exact(piece)?;
            let id = ChunkId::of(piece);
            // chunk_size ≤ 16 MiB, so the length fits.
            list.push((done, id, len as u32));
            chunks.push((id, position + done, len as u32));
            done += len;
        }
        files.push(list);
        Ok(())
    };
    let (entries, tar_bytes) = read_layer(stream, &mut sink)?;
    let index = handle.take().ok_or_else(|| SourceError::Corrupt {
        layer: blob.name.clone(),
        source: std::io::Error::other("the gzip stream was not read to its end"),
    })?;
    // zstd: spans are whole frames; a frame far larger than the spacing (a layer compressed as
    // one frame) would make every read fetch and decode all of it.
    if index.codec == tessera_gzip::Codec::Zstd {
        let largest = (0..index.checkpoints.len())
            .filter_map(|k| index.span(k))
            .map(|s| s.uncompressed.1 - s.uncompressed.0)
            .max()
            .unwrap_or(0);
        if largest > MAX_ZSTD_SPAN {
            return Err(SourceError::ZstdFrameTooLarge {
                layer: blob.name.clone(),
                frame_mib: largest.div_ceil(1 << 20),
                max_mib: MAX_ZSTD_SPAN >> 20,
            }
            .into());
        }
    }
    let count = entries.iter().filter(|e| matches!(e.kind, EntryKind::File { .. })).count();
    if count != files.len() || index.uncompressed_len != tar_bytes {
        return Err(BuildError::Internal { what: "a layer's files and chunks disagree", chunk: None });
    }
    // The stream was read to its end (its raw digest checked): the copy is the whole blob.
    if let Some(copy) = copy {
        let writer = copy.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        let writer =
            writer.ok_or(BuildError::Internal { what: "a layer copy was taken twice", chunk: None })?;
        let got = writer.commit()?;
        if got != *digest {
            return Err(SourceError::DigestMismatch {
                what: blob.name.clone(),
                expected: digest.to_string(),
                actual: got.to_string(),
            }
            .into());
        }
    }
    debug!(layer = %blob.name, checkpoints = index.checkpoints.len(), tar_bytes, "indexed layer");
    Ok(ReadLayer { manifest: ContentManifest { entries, files }, tar_bytes, chunks, index })
}

/// Hash each span's compressed bytes, reading the store's copy of layer `blob` (made by
/// [`read_for_reference`]'s read, or already there), whose sha256 is checked on the way: spans
/// are hashed from exactly the blob the image names.
fn hash_spans(
    store: &LocalStore,
    blob: &LayerBlob,
    digest: &Sha256Digest,
    r: &ReadLayer,
) -> Result<RefLayer, BuildError> {
    let corrupt = |e: std::io::Error| SourceError::Corrupt { layer: blob.name.clone(), source: e };
    let spans: Vec<(u64, u64)> =
        (0..r.index.checkpoints.len()).filter_map(|k| r.index.span(k)).map(|s| s.compressed).collect();
    let mut hashers: Vec<blake3::Hasher> = vec![blake3::Hasher::new(); spans.len()];
    let mut raw = std::fs::File::open(store.blob_path(digest)).map_err(corrupt)?;
    let mut whole = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    let mut first = 0usize;
    loop {
        let n = raw.read(&mut buf).map_err(corrupt)?;
        if n == 0 {
            break;
        }
        let (start, end) = (at, at + n as u64);
        whole.update(&buf[..n]);
        while first < spans.len() && spans[first].1 <= start {
            first += 1;
        }
        for (k, &(s, e)) in spans.iter().enumerate().skip(first) {
            if s >= end {
                break;
            }
            let from = s.max(start) - start;
            let to = e.min(end) - start;
            hashers[k].update(&buf[from as usize..to as usize]);
        }
        at = end;
    }
    if at != r.index.compressed_len {
        // Bytes after the gzip stream are allowed by the layer reader; spans never reach them.
        debug!(layer = %blob.name, blob = at, gzip = r.index.compressed_len, "bytes after the gzip stream");
    }
    let got = Sha256Digest(whole.finalize().into());
    if got != *digest {
        return Err(SourceError::DigestMismatch {
            what: format!("{} (the store's copy)", blob.name),
            expected: digest.to_string(),
            actual: got.to_string(),
        }
        .into());
    }
    let checkpoints = r
        .index
        .checkpoints
        .iter()
        .zip(&spans)
        .zip(hashers)
        .map(|((c, &(_, span_end)), h)| RefCheckpoint {
            in_offset: c.in_offset,
            bits: c.bits,
            out_offset: c.out_offset,
            span_end,
            span_digest: *h.finalize().as_bytes(),
            window: Window::Inline(c.window.clone()),
        })
        .collect();
    Ok(RefLayer {
        digest: *digest,
        codec: match r.index.codec {
            tessera_gzip::Codec::Gzip => RefCodec::Gzip,
            tessera_gzip::Codec::Zstd => RefCodec::Zstd,
        },
        compressed_len: at,
        uncompressed_len: r.index.uncompressed_len,
        checkpoints,
    })
}

#[cfg(test)]
mod tests {
    use std::io::{Cursor, Write};

    use sha2::{Digest as _, Sha256};
    use tessera_image::RuntimeConfig;
    use tessera_store::{ImageReader, OpenImage, StoreError};

    use super::*;
    use crate::source::Digest;
    use crate::test_support::tar_header as header;
    use crate::NoProgress;

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(6));
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn blob(name: &str, raw: Vec<u8>, tar: &[u8]) -> LayerBlob {
        let digest = Digest { hex: hex::encode(Sha256::digest(&raw)) };
        let diff_id = Digest { hex: hex::encode(Sha256::digest(tar)) };
        let size = raw.len() as u64;
        let raw = Arc::new(raw);
        LayerBlob {
            name: name.into(),
            open: Box::new(move || Ok(Box::new(Cursor::new(raw.as_ref().clone())) as Box<dyn Read + Send>)),
            digest: Some(digest),
            size: Some(size),
            diff_id: Some(diff_id),
        }
    }

    /// Text-like bytes that compress but not to nothing, with back-references.
    fn content(seed: u32, len: usize) -> Vec<u8> {
        let mut x = seed.wrapping_mul(2_654_435_761) | 1;
        let words: [&[u8]; 6] = [b"alpha ", b"beta ", b"gamma\n", b"delta ", b"epsilon ", b"zeta\n"];
        let mut out = Vec::with_capacity(len);
        while out.len() < len {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            out.extend_from_slice(words[(x % 6) as usize]);
            if x % 11 == 0 {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        out.truncate(len);
        out
    }

    /// Two layers: a base with a 3 MiB file (several spans, chunks crossing span boundaries) and
    /// small files; a top layer replacing one and whiting out another.
    fn tars() -> (Vec<u8>, Vec<u8>) {
        let mut b = tar::Builder::new(Vec::new());
        let big = content(1, 3 << 20);
        b.append(&header("opt/big", tar::EntryType::Regular, big.len() as u64, 0o644), &big[..]).unwrap();
        for i in 0..40u32 {
            let small = content(i + 10, 1000 + i as usize * 997);
            let name = format!("etc/f{i}");
            b.append(&header(&name, tar::EntryType::Regular, small.len() as u64, 0o644), &small[..]).unwrap();
        }
        let base = b.into_inner().unwrap();
        let mut b = tar::Builder::new(Vec::new());
        b.append(&header("etc/.wh.f3", tar::EntryType::Regular, 0, 0o644), &[][..]).unwrap();
        let new = content(99, 70_000);
        b.append(&header("etc/f4", tar::EntryType::Regular, new.len() as u64, 0o600), &new[..]).unwrap();
        (base, b.into_inner().unwrap())
    }

    fn source(layers: Vec<LayerBlob>) -> ImageSource {
        ImageSource { layers, config: RuntimeConfig::default(), provenance: serde_json::json!({}) }
    }

    fn device(store: &LocalStore, id: &tessera_image::ImageId) -> Result<Vec<u8>, StoreError> {
        let image = OpenImage::open(store, id)?;
        let reader = ImageReader::new(image, store.clone());
        let mut out = vec![0u8; reader.device_bytes() as usize];
        for (i, piece) in out.chunks_mut(1 << 20).enumerate() {
            reader.read_at(i as u64 * (1 << 20), piece)?;
        }
        Ok(out)
    }

    #[test]
    fn reference_build_gives_the_converted_image_and_its_bytes() {
        let (base, top) = tars();
        let (gz_base, gz_top) = (gzip(&base), gzip(&top));
        let layers = || vec![blob("layer 0", gz_base.clone(), &base), blob("layer 1", gz_top.clone(), &top)];
        let config = BuildConfig { fs_time: 1000, chunk_size: 64 << 10, ..BuildConfig::default() };
        let dir = tempfile::tempdir().unwrap();
        let converted = LocalStore::create_or_open(dir.path().join("converted")).unwrap();
        let a = crate::build_image(&source(layers()), &converted, &config, &NoProgress).unwrap();
        let referenced = LocalStore::create_or_open(dir.path().join("ref")).unwrap();
        let rconfig = BuildConfig { reference_layers: true, ..config.clone() };
        let b = crate::build_image(&source(layers()), &referenced, &rconfig, &NoProgress).unwrap();
        assert_eq!(b.id, a.id, "the reference image has the converted image's ID");
        assert_eq!(b.record, a.record);

        // The layers are in the store as they are; the index points into them.
        let index = RefIndex::decode(&referenced.read_blob(&b.entry.pack_index).unwrap()).unwrap();
        assert_eq!(index.image, b.id);
        assert_eq!(index.layers.len(), 2);
        assert!(index.layers[0].checkpoints.len() >= 3, "{} checkpoints", index.layers[0].checkpoints.len());
        for (l, gz) in index.layers.iter().zip([&gz_base, &gz_top]) {
            assert_eq!(referenced.read_blob(&l.digest).unwrap(), **gz);
        }
        // Version 2: the windows are in a blob of their own, read with their spans.
        let windows = index.windows.expect("a version-2 index");
        assert_eq!(windows.len, index.window_bytes());
        assert!(windows.len > 0);
        let windows_path = referenced.blob_path(&windows.digest);
        assert_eq!(std::fs::metadata(&windows_path).unwrap().len(), windows.len);
        let want = device(&converted, &a.id).unwrap();
        assert_eq!(device(&referenced, &b.id).unwrap(), want, "the devices differ");

        // A windows blob whose bytes changed: the reads that need a changed window fail.
        let good_windows = std::fs::read(&windows_path).unwrap();
        let mut bad = good_windows.clone();
        bad[good_windows.len() / 2] ^= 0x40;
        std::fs::write(&windows_path, &bad).unwrap();
        match device(&referenced, &b.id) {
            Err(StoreError::CorruptSpan { reason, .. }) => assert!(reason.contains("window"), "{reason}"),
            other => panic!("expected a corrupt window, got {:?}", other.map(|_| "bytes")),
        }
        std::fs::write(&windows_path, &good_windows).unwrap();

        // A layer blob whose bytes changed: reads of its data fail, never give other bytes.
        let path = referenced.blob_path(&index.layers[0].digest);
        let mut bytes = std::fs::read(&path).unwrap();
        let at = bytes.len() / 2;
        bytes[at] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        match device(&referenced, &b.id) {
            Err(StoreError::CorruptSpan { layer, .. }) => assert_eq!(layer, index.layers[0].digest),
            other => panic!("expected a corrupt span, got {:?}", other.map(|_| "bytes")),
        }
        bytes[at] ^= 0x40;
        bytes.push(0);
        std::fs::write(&path, &bytes).unwrap();
        let e = OpenImage::open(&referenced, &b.id).unwrap_err().to_string();
        assert!(e.contains("its reference index says"), "{e}");
        bytes.pop();
        std::fs::write(&path, &bytes).unwrap();

        // An index that belongs to another image is refused at open.
        let mut other = index.clone();
        other.image = a.id;
        other.image.0 .0[0] ^= 1;
        let parts = |idx: &[u8]| {
            OpenImage::from_parts(
                b.id,
                tessera_image::ImageEntry { pack_index: Sha256Digest::of(idx), ..b.entry.clone() },
                &referenced.read_blob(&b.entry.record).unwrap(),
                &referenced.read_blob(&b.entry.prefix).unwrap(),
                idx,
            )
        };
        let e = parts(&other.encode()).unwrap_err().to_string();
        assert!(e.contains("belongs to image"), "{e}");
        assert!(parts(&index.encode()).is_ok());
    }

    #[test]
    fn bad_layers_are_clear_errors() {
        let (base, _) = tars();
        let gz = gzip(&base);
        let config = BuildConfig { reference_layers: true, ..BuildConfig::default() };
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::create_or_open(dir.path()).unwrap();
        let build = |raw: Vec<u8>| {
            crate::build_image(
                &source(vec![blob("layer 0 (sha256:x)", raw, &base)]),
                &store,
                &config,
                &NoProgress,
            )
            .unwrap_err()
            .to_string()
        };
        let e = build(gz[..gz.len() / 2].to_vec());
        assert!(e.contains("layer 0 (sha256:x)"), "{e}");
        let mut bad = gz.clone();
        let n = bad.len();
        bad[n / 3] ^= 0xff;
        let e = build(bad);
        assert!(e.contains("layer 0 (sha256:x)"), "{e}");
        // One zstd frame of the whole layer, larger than a span may be: refused, with the way out.
        let mut big = tar::Builder::new(Vec::new());
        let text = content(5, 9 << 20);
        big.append(&header("opt/big", tar::EntryType::Regular, text.len() as u64, 0o644), &text[..]).unwrap();
        let big = big.into_inner().unwrap();
        let one_frame = zstd::bulk::compress(&big, 3).unwrap();
        let e = crate::build_image(
            &source(vec![blob("layer 0 (sha256:x)", one_frame, &big)]),
            &store,
            &config,
            &NoProgress,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("is zstd with a frame of 10 MiB") && e.contains("zstd:chunked"), "{e}");
        assert!(e.contains("without --reference-layers"), "{e}");
        let e = build(base.clone());
        assert!(e.contains("is uncompressed") && e.contains("without --reference-layers"), "{e}");
    }

    /// zstd in frames of 64 KiB (as zstd:chunked writes a layer: many frames).
    fn zstd_frames(data: &[u8]) -> Vec<u8> {
        data.chunks(64 << 10).flat_map(|p| zstd::bulk::compress(p, 3).unwrap()).collect()
    }

    #[test]
    fn zstd_layers_of_many_frames_are_referenced() {
        let (base, top) = tars();
        let layers = |z: bool| {
            let c = |t: &[u8]| if z { zstd_frames(t) } else { gzip(t) };
            vec![blob("layer 0", c(&base), &base), blob("layer 1", c(&top), &top)]
        };
        let config = BuildConfig { fs_time: 1000, chunk_size: 64 << 10, ..BuildConfig::default() };
        let dir = tempfile::tempdir().unwrap();
        let converted = LocalStore::create_or_open(dir.path().join("converted")).unwrap();
        let a = crate::build_image(&source(layers(false)), &converted, &config, &NoProgress).unwrap();
        let referenced = LocalStore::create_or_open(dir.path().join("ref")).unwrap();
        let rconfig = BuildConfig { reference_layers: true, ..config.clone() };
        let b = crate::build_image(&source(layers(true)), &referenced, &rconfig, &NoProgress).unwrap();
        assert_eq!(b.id, a.id, "the same image as the converted gzip build");
        let index = RefIndex::decode(&referenced.read_blob(&b.entry.pack_index).unwrap()).unwrap();
        assert!(index.layers.iter().all(|l| l.codec == RefCodec::Zstd));
        assert!(index.layers[0].checkpoints.len() >= 3, "{} checkpoints", index.layers[0].checkpoints.len());
        assert_eq!(index.window_bytes(), 0, "zstd frames need no windows");
        assert_eq!(device(&referenced, &b.id).unwrap(), device(&converted, &a.id).unwrap());
    }
}
