//! `export_raw` through the read engine on a hand-built image (the store's test image): exact
//! and sparse whether read serially (an `ImageReader`) or fetched in parallel ahead of the
//! writer (a `MemTier`); a corrupt chunk fails the export and leaves no output behind.
#![allow(clippy::unwrap_used)]

#[path = "../../store/tests/common/mod.rs"]
mod common;

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use common::{build_image, Counting, BS};
use tessera_engine::{export_raw, BlockDevice, ExportError, ExportOptions, FetchLimits, MemTier, ReadError};
use tessera_store::{ImageReader, LocalStore, OpenImage, StoreError};

#[test]
fn export_is_exact_and_sparse_serial_and_parallel() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path().join("store")).unwrap();
    let blocks = 64 * 256; // 64 MiB device, ~100 KiB of data
    let img = build_image(&store, blocks);
    let image = Arc::new(OpenImage::open(&store, &img.id).unwrap());
    let chunks = image.record().block_map.chunks().len();
    let source = Arc::new(Counting::new(store.clone()));
    let serial = ImageReader::new(Arc::clone(&image), Arc::clone(&source));
    let tier = MemTier::streaming(
        ImageReader::new(Arc::clone(&image), Arc::clone(&source)),
        64 << 20,
        FetchLimits::new(8),
    )
    .unwrap();
    let sources: [(&str, &dyn BlockDevice); 2] = [("serial", &serial), ("parallel", &tier)];
    for (name, source_under_test) in sources {
        let out = dir.path().join(format!("{name}.raw"));
        std::fs::write(&out, vec![0xffu8; 3 * BS]).unwrap(); // old content must not survive
        let before = source.reads.load(Ordering::Relaxed);
        let mut last = None;
        let options = ExportOptions { ahead_bytes: 8 * BS as u64 };
        let stats = export_raw(&image, source_under_test, options, &out, |p| {
            assert!(p.done_bytes <= p.total_bytes);
            last = Some(p);
        })
        .unwrap();
        let last = last.unwrap();
        assert_eq!(last.done_bytes, last.total_bytes);
        assert_eq!(stats.device_bytes, blocks * BS as u64);
        assert_eq!(stats.mapped_bytes, (5 + 4 + 2 + 4 + 2 + 8 + 1) * BS as u64);
        assert!(stats.written_bytes < stats.mapped_bytes, "the zero prefix block is skipped");
        let meta = std::fs::metadata(&out).unwrap();
        assert_eq!(meta.len(), blocks * BS as u64);
        let allocated = meta.blocks() * 512;
        assert!(allocated <= 256 * 1024, "{name}: export is not sparse: {allocated} bytes allocated");
        let bytes = std::fs::read(&out).unwrap();
        assert!(bytes == img.device, "{name}: exported bytes differ from the reference device");
        // Each chunk is read from the store once (the tier: single flight and memory).
        let reads = source.reads.load(Ordering::Relaxed) - before;
        assert_eq!(reads, chunks, "{name}: {reads} pack reads for {chunks} chunks");
    }
}

#[test]
fn a_corrupt_chunk_fails_the_export_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create_or_open(dir.path()).unwrap();
    let img = build_image(&store, 64);
    let victim = &img.chunks[0];
    let f = OpenOptions::new().read(true).write(true).open(store.blob_path(&victim.pack)).unwrap();
    let at = victim.loc.offset + u64::from(victim.loc.stored_len) / 2;
    let mut byte = [0u8; 1];
    f.read_exact_at(&mut byte, at).unwrap();
    f.write_all_at(&[byte[0] ^ 0x40], at).unwrap();

    let image = Arc::new(OpenImage::open(&store, &img.id).unwrap());
    let serial = ImageReader::new(Arc::clone(&image), store.clone());
    let tier =
        MemTier::new(ImageReader::new(Arc::clone(&image), store.clone()), 64 << 20, FetchLimits::new(4))
            .unwrap();
    let sources: [(&str, &dyn BlockDevice); 2] = [("serial", &serial), ("parallel", &tier)];
    for (name, source) in sources {
        let out = dir.path().join(format!("{name}.raw"));
        // One piece in flight at a time: the export stops at the first failure, so the chunk is
        // fetched (and refetched) exactly once.
        match export_raw(&image, source, ExportOptions { ahead_bytes: 0 }, &out, |_| {}) {
            Err(ExportError::Read(ReadError::Store { source, .. })) => {
                assert!(
                    matches!(*source, StoreError::CorruptChunk { chunk, .. } if chunk == victim.id),
                    "{name}: {source:?}"
                );
            }
            other => panic!("{name}: expected a corrupt chunk, got {other:?}"),
        }
        assert!(!out.exists(), "{name}: a failed export leaves no output");
    }
    // The tier fetched the chunk VERIFY_ATTEMPTS times (the one refetch policy), then failed.
    assert_eq!(tier.refetches(), u64::from(tessera_store::VERIFY_ATTEMPTS) - 1);
}
