//! Golden fixtures of every on-disk and wire format Tessera decodes (`tests/fixtures/formats/`,
//! described in its README). Each format gets two checks:
//!
//! - **today's decoder reads the checked-in bytes to the values spelled here**, and today's
//!   encoder writes exactly those bytes: a format change that does not bump the version fails
//!   here, before an old store, cache or overlay in the field stops opening (or an image ID
//!   silently changes);
//! - **corrupted copies give typed errors, never a panic**: every truncation and every single-bit
//!   flip of the small binary fixtures, and a version one above today's is refused as
//!   unsupported. A flipped byte string the decoder accepts must re-encode to itself (the
//!   encodings are canonical: no two byte strings mean the same thing).
//!
//! The fixtures were written once by this file (`TESSERA_BLESS_FORMATS=1 cargo test -p
//! tessera-fuzz --test formats` writes the *missing* ones and never overwrites one). When a
//! format gets a new version, keep the old fixture (the new decoder reads it or refuses it with
//! a clear error — say which here) and add one for the new version.
#![allow(clippy::unwrap_used)]

use std::fs;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tessera_builder::manifest::ContentManifest;
use tessera_builder::{build_dir, BuildConfig, NoProgress, DEFAULT_FS_TIME};
use tessera_engine::BlockDevice as _;
use tessera_fuzz::overlay_replay::MemIo;
use tessera_fuzz::vhost_request::SectorPattern;
use tessera_image::{
    ChunkId, DecodeError, ImageEntry, ImageId, ImageRecord, PackIndex, PackIndexBlob, Profile, RefIndex,
    RequestOp, RequestStatus, RequestTrace, RequestTraceHeader, Sha256Digest, Trace, TraceEntry,
};
use tessera_overlay::format::{Header, HEADER_LEN};
use tessera_overlay::{Mode as OverlayMode, Overlay, OverlayError, OverlayParams};
use tessera_store::{CacheConfig, DiskCache, ImageReader, LocalStore, OpenImage};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/formats")
}

fn blessing() -> bool {
    std::env::var_os("TESSERA_BLESS_FORMATS").is_some_and(|v| v == "1")
}

/// The checked-in fixture `name`; in bless mode, `make` writes it first when it is missing.
fn fixture(name: &str, make: impl FnOnce() -> Vec<u8>) -> Vec<u8> {
    let path = dir().join(name);
    if !path.exists() && blessing() {
        fs::create_dir_all(dir()).unwrap();
        fs::write(&path, make()).unwrap();
        eprintln!("wrote {}", path.display());
    }
    fs::read(&path).unwrap_or_else(|e| {
        panic!("{}: {e} (a missing fixture is written by TESSERA_BLESS_FORMATS=1)", path.display())
    })
}

/// A decoder under test: the decoded value, or its typed error rendered.
type Decode<'a, T> = &'a dyn Fn(&[u8]) -> Result<T, String>;

/// Every truncation (an error unless `prefixes_valid`, then canonical) and every single-bit flip
/// (an error, or a value that re-encodes to the flipped bytes) of `bytes`; none may panic.
fn corruptions<T>(
    name: &str,
    bytes: &[u8],
    decode: Decode<'_, T>,
    encode: &dyn Fn(&T) -> Vec<u8>,
    prefixes_valid: bool,
) {
    let run = |what: &str, b: &[u8]| -> Option<T> {
        match catch_unwind(AssertUnwindSafe(|| decode(b))) {
            Ok(Ok(v)) => Some(v),
            Ok(Err(e)) => {
                assert!(!e.is_empty(), "{name}: {what}: an empty error");
                None
            }
            Err(_) => panic!("{name}: {what}: the decoder panicked"),
        }
    };
    for cut in 0..bytes.len() {
        if let Some(v) = run(&format!("truncated to {cut} bytes"), &bytes[..cut]) {
            assert!(prefixes_valid, "{name}: truncated to {cut} bytes still decodes");
            assert_eq!(encode(&v), &bytes[..cut], "{name}: truncated to {cut}: not canonical");
        }
    }
    let mut flipped = bytes.to_vec();
    for bit in 0..bytes.len() * 8 {
        flipped[bit / 8] ^= 1 << (bit % 8);
        if let Some(v) = run(&format!("bit {bit} flipped"), &flipped) {
            assert_eq!(
                encode(&v),
                flipped,
                "{name}: bit {bit} flipped decodes to a value that encodes otherwise"
            );
        }
        flipped[bit / 8] ^= 1 << (bit % 8);
    }
}

/// The binary formats (magic, then a little-endian u32 version at byte 8): one version up is
/// refused as unsupported.
fn refuses_next_version<T: std::fmt::Debug>(
    name: &str,
    bytes: &[u8],
    decode: impl Fn(&[u8]) -> Result<T, DecodeError>,
) {
    let mut next = bytes.to_vec();
    let v = u32::from_le_bytes(next[8..12].try_into().unwrap());
    next[8..12].copy_from_slice(&(v + 1).to_le_bytes());
    match decode(&next) {
        Err(DecodeError::UnsupportedVersion { version, .. }) => assert_eq!(version, v + 1, "{name}"),
        other => panic!("{name}: version {} gave {other:?}", v + 1),
    }
}

fn pack_index() -> PackIndex {
    tessera_fuzz::pack_index::example()
}

fn image() -> ImageId {
    ImageRecord::example().id()
}

fn trace() -> Trace {
    let e = |c: &[u8], at_us| TraceEntry { chunk: ChunkId::of(c), at_us };
    Trace::new(image(), vec![e(b"data", 0), e(b"more", 1500)]).unwrap()
}

fn profile() -> Profile {
    let e = |c: &[u8], at_us| TraceEntry { chunk: ChunkId::of(c), at_us };
    let second = Trace::new(image(), vec![e(b"more", 10), e(b"data", 900)]).unwrap();
    Profile::merge(image(), &[trace(), second], 1).unwrap()
}

fn requests() -> RequestTrace {
    let r = tessera_fuzz::request_trace::record;
    RequestTrace {
        header: RequestTraceHeader {
            image: image(),
            device_bytes: 32768 * 4096,
            queues: 2,
            read_only: false,
        },
        records: vec![
            r(0, RequestOp::Read, RequestStatus::Ok, 0, 65536, 1_000, 51_000),
            r(1, RequestOp::Write, RequestStatus::Ok, 808, 4096, 2_000, 9_000),
            r(1, RequestOp::Flush, RequestStatus::Ok, 0, 0, 9_500, 120_000),
            r(0, RequestOp::Read, RequestStatus::IoErr, 4096, 512, 130_000, 130_050),
            r(0, RequestOp::GetId, RequestStatus::Ok, 0, 20, 140_000, 140_001),
            r(1, RequestOp::Discard, RequestStatus::Unsupp, 16, 0, 150_000, 150_002),
        ],
    }
}

#[test]
fn image_record() {
    let bytes = fixture("record.v1.bin", || ImageRecord::example().encode());
    let want = ImageRecord::example();
    assert_eq!(ImageRecord::decode(&bytes).unwrap(), want);
    assert_eq!(want.encode(), bytes, "today's encoder writes other bytes: the image ID would change");
    eprintln!("example record: {}", want.id());
    // The ID of the example record, frozen: the same tree must keep its ID across releases.
    assert_eq!(want.id().to_string(), RECORD_ID);
    corruptions(
        "record",
        &bytes,
        &|b| ImageRecord::decode(b).map_err(|e| e.to_string()),
        &|v| v.encode(),
        false,
    );
    refuses_next_version("record", &bytes, ImageRecord::decode);
}

const RECORD_ID: &str = "sha256:f89be38466cdab15c917b9e5996846031238c2d0a8bb0bdc57d3f0cd2e7b7534";

#[test]
fn pack_index_tesspix() {
    let bytes = fixture("pack-index.v1.bin", || pack_index().encode());
    assert_eq!(PackIndex::decode(&bytes).unwrap(), pack_index());
    assert_eq!(pack_index().encode(), bytes);
    corruptions(
        "pack index",
        &bytes,
        &|b| PackIndex::decode(b).map_err(|e| e.to_string()),
        &|v| v.encode(),
        false,
    );
    refuses_next_version("pack index", &bytes, PackIndex::decode);
}

/// Version 2, which builds write: aligned with its image's chunk list. Version 1 stays readable
/// (the fixture above; `PackIndexBlob::decode` reads both).
#[test]
fn pack_index_tesspix_v2() {
    let (made, list) = tessera_fuzz::pack_index::aligned_example();
    let bytes = fixture("pack-index.v2.bin", || made.clone());
    assert_eq!(made, bytes);
    let blob = PackIndexBlob::decode(&bytes).unwrap();
    assert_eq!(blob.keyed(&list).unwrap(), pack_index());
    assert_eq!(PackIndexBlob::decode(&pack_index().encode()).unwrap(), PackIndexBlob::Keyed(pack_index()));
    corruptions(
        "pack index v2",
        &bytes,
        &|b| PackIndexBlob::decode(b).map_err(|e| e.to_string()),
        &|v| v.encode(),
        false,
    );
    refuses_next_version("pack index v2", &bytes, PackIndexBlob::decode);
}

#[test]
fn reference_index_tessrix() {
    let bytes = fixture("ref-index.v1.bin", || RefIndex::example().encode());
    assert_eq!(RefIndex::decode(&bytes).unwrap(), RefIndex::example());
    assert_eq!(RefIndex::example().encode(), bytes);
    corruptions(
        "ref index",
        &bytes,
        &|b| RefIndex::decode(b).map_err(|e| e.to_string()),
        &|v| v.encode(),
        false,
    );
    // Version 1 stays readable (stores built before version 2); version 2's windows blob moves
    // the windows out of the index.
    let v2 = RefIndex::example().split_windows().0;
    let bytes = fixture("ref-index.v2.bin", || v2.encode());
    assert_eq!(RefIndex::decode(&bytes).unwrap(), v2);
    assert_eq!(v2.encode(), bytes);
    corruptions(
        "ref index v2",
        &bytes,
        &|b| RefIndex::decode(b).map_err(|e| e.to_string()),
        &|v| v.encode(),
        false,
    );
    // Version 3 follows the record's chunk list: versions 1 and 2 stay readable.
    let (v3, list) = RefIndex::example_aligned();
    let bytes = fixture("ref-index.v3.bin", || v3.encode());
    let back = RefIndex::decode(&bytes).unwrap();
    assert_eq!(back, v3);
    assert_eq!(v3.encode(), bytes);
    assert_eq!(back.locate(&list).unwrap(), v2.locate(&list).unwrap());
    corruptions(
        "ref index v3",
        &bytes,
        &|b| RefIndex::decode(b).map_err(|e| e.to_string()),
        &|v| v.encode(),
        false,
    );
    refuses_next_version("ref index v3", &bytes, RefIndex::decode);
}

#[test]
fn profile_tessprf() {
    let bytes = fixture("profile.v1.bin", || profile().encode());
    assert_eq!(Profile::decode(&bytes).unwrap(), profile());
    assert_eq!(profile().encode(), bytes);
    corruptions(
        "profile",
        &bytes,
        &|b| Profile::decode(b).map_err(|e| e.to_string()),
        &|v| v.encode(),
        false,
    );
    refuses_next_version("profile", &bytes, Profile::decode);
}

#[test]
fn boot_trace_text() {
    let bytes = fixture("trace.v1.txt", || trace().encode().into_bytes());
    assert_eq!(Trace::decode(&bytes).unwrap(), trace());
    assert_eq!(trace().encode().as_bytes(), bytes);
    // A text journal: a prefix ending at a line end is a shorter valid trace.
    corruptions(
        "trace",
        &bytes,
        &|b| Trace::decode(b).map_err(|e| e.to_string()),
        &|v| v.encode().into_bytes(),
        true,
    );
    let next = String::from_utf8(bytes).unwrap().replacen("tessera-trace 1 ", "tessera-trace 2 ", 1);
    assert!(Trace::decode(next.as_bytes()).is_err(), "a version-2 trace is refused");
}

#[test]
fn request_trace_tessreq() {
    let bytes = fixture("requests.v1.bin", || requests().encode());
    assert_eq!(RequestTrace::decode(&bytes).unwrap(), requests());
    assert_eq!(requests().encode(), bytes);
    corruptions(
        "request trace",
        &bytes,
        &|b| RequestTrace::decode(b).map_err(|e| e.to_string()),
        &|v| v.encode(),
        false,
    );
    refuses_next_version("request trace", &bytes, RequestTrace::decode);
}

#[test]
fn content_manifest() {
    let bytes = fixture("content-manifest.v1.bin", || ContentManifest::example().encode());
    assert_eq!(ContentManifest::decode(&bytes).unwrap(), ContentManifest::example());
    assert_eq!(ContentManifest::example().encode(), bytes);
    corruptions(
        "content manifest",
        &bytes,
        &|b| ContentManifest::decode(b).map_err(|e| e.to_string()),
        &|v| v.encode(),
        false,
    );
    refuses_next_version("content manifest", &bytes, ContentManifest::decode);
}

#[test]
fn source_index() {
    use tessera_builder::source_index::{SourceIndex, SourceIndexError};
    let bytes = fixture("source-index.v1.bin", SourceIndex::example);
    assert_eq!(SourceIndex::example(), bytes, "the example encodes as it did");
    let index = SourceIndex::decode(bytes.clone()).unwrap();
    assert_eq!(index.files(), 3);
    let entries = |i: &SourceIndex| i.entries().collect::<Vec<_>>();
    corruptions(
        "source index",
        &bytes,
        &|b| SourceIndex::decode(b.to_vec()).map_err(|e| e.to_string()),
        &|i| SourceIndex::encode(i.chunk_size(), &entries(i)),
        false,
    );
    let mut next = bytes.clone();
    next[8..12].copy_from_slice(&2u32.to_le_bytes());
    assert_eq!(SourceIndex::decode(next).unwrap_err(), SourceIndexError::UnsupportedVersion(2));
}

#[test]
fn image_entry_json() {
    let bytes = fixture("entry.v1.json", || ImageEntry::example().to_json());
    assert_eq!(ImageEntry::from_json(&bytes).unwrap(), ImageEntry::example());
    assert_eq!(ImageEntry::example().to_json(), bytes);
    // JSON allows trailing whitespace: the damage is done to the document without its newline.
    let doc = bytes.strip_suffix(b"\n").expect("the entry ends with a newline");
    let without_newline = |v: &ImageEntry| {
        let mut j = v.to_json();
        j.pop();
        j
    };
    corruptions(
        "image entry",
        doc,
        &|b| ImageEntry::from_json(b).map_err(|e| e.to_string()),
        &without_newline,
        false,
    );
}

// ---------------------------------------------------------------------------------------------
// The overlay file.

const OVERLAY_DEVICE: u64 = 1 << 20;
const BS: u64 = 4096;

fn overlay_params() -> OverlayParams {
    OverlayParams {
        image_id: ImageId(Sha256Digest::of(b"tessera-format-fixture")),
        block_size: BS as u32,
        device_bytes: OVERLAY_DEVICE,
    }
}

fn open_overlay(bytes: Vec<u8>, mode: OverlayMode) -> Result<Overlay, OverlayError> {
    Overlay::open(Box::new(MemIo::new(bytes)), overlay_params(), Arc::new(SectorPattern), mode)
}

/// Two FLUSHed groups, then a write that never saw a FLUSH, as a killed daemon leaves the file
/// (nothing replayed or checkpointed yet).
fn make_overlay() -> Vec<u8> {
    let io = MemIo::default();
    let o = Overlay::create(
        Box::new(io.clone()),
        overlay_params(),
        Arc::new(SectorPattern),
        OverlayMode::Durable,
    )
    .unwrap();
    o.write_at(0, &[1u8; 4096]).unwrap();
    o.write_at(5 * BS, &[2u8; 8192]).unwrap();
    o.flush().unwrap();
    o.write_zeroes(20 * BS, 3 * BS).unwrap();
    o.write_at(6 * BS + 100, &[3u8; 1000]).unwrap();
    o.write_zeroes(BS + 512, 1024).unwrap();
    o.flush().unwrap();
    o.write_at(40 * BS, &[4u8; 4096]).unwrap();
    drop(o);
    io.snapshot()
}

/// What the fixture's device reads, spelled out: the base pattern (each 512-byte sector filled
/// with its number mod 251) under the two flushed groups; the unflushed write is not there.
fn overlay_expected() -> Vec<u8> {
    let mut dev = vec![0u8; OVERLAY_DEVICE as usize];
    SectorPattern.read_at(0, &mut dev).unwrap();
    let mut set = |at: u64, len: u64, v: u8| dev[at as usize..(at + len) as usize].fill(v);
    set(0, BS, 1);
    set(5 * BS, 2 * BS, 2);
    set(20 * BS, 3 * BS, 0);
    set(6 * BS + 100, 1000, 3);
    set(BS + 512, 1024, 0);
    dev
}

#[test]
fn overlay_file() {
    let bytes = fixture("overlay.v1.bin", make_overlay);
    let want = overlay_expected();
    for mode in [OverlayMode::ReadOnly, OverlayMode::Durable] {
        let o = open_overlay(bytes.clone(), mode).unwrap();
        let mut dev = vec![0u8; OVERLAY_DEVICE as usize];
        o.read_at(0, &mut dev).unwrap();
        assert!(dev == want, "{mode:?}: the fixture's device reads other bytes");
    }
    // Another image, block size or device size: refused.
    let other = OverlayParams { device_bytes: 2 * OVERLAY_DEVICE, ..overlay_params() };
    let err = Overlay::open(
        Box::new(MemIo::new(bytes.clone())),
        other,
        Arc::new(SectorPattern),
        OverlayMode::ReadOnly,
    );
    assert!(err.is_err(), "an overlay for another device size opens");
    // One version above today's in both header copies (resealed): refused, naming the version.
    // (The fixture is version 1, which today's overlay still reads and upgrades on open.)
    let next_version = tessera_overlay::format::VERSION + 1;
    let mut next = bytes.clone();
    for at in [0usize, 2048] {
        next[at + 8..at + 12].copy_from_slice(&next_version.to_le_bytes());
        let crc = crc32c::crc32c(&next[at..at + 124]);
        next[at + 124..at + 128].copy_from_slice(&crc.to_le_bytes());
    }
    let Err(err) = open_overlay(next, OverlayMode::ReadOnly) else {
        panic!("a version-{next_version} overlay opens")
    };
    assert!(err.to_string().contains(&next_version.to_string()), "{err}");
    // Truncations and flips: a typed error, or an overlay that reads without error (a torn log
    // tail is legal: replay stops at the first record that does not check out). Each byte of
    // header copy A with its lowest bit flipped, of copy B with its highest, of the log's first
    // two records with its lowest; a sample of the other bytes (data slots, the rest of the
    // log); cuts every 509 bytes. (An open costs ~10 ms in a debug build: a few hundred cases.)
    for cut in (0..bytes.len()).step_by(509) {
        overlay_corruption(&format!("truncated to {cut}"), bytes[..cut].to_vec());
    }
    let log = Header::decode(&bytes).unwrap().log_head as usize * BS as usize;
    let mut flipped = bytes.clone();
    for at in 0..bytes.len() {
        let bit = if (2048..2048 + HEADER_LEN).contains(&at) { 0x80 } else { 0x01 };
        let thorough = at < HEADER_LEN || bit == 0x80 || (log..log + 128).contains(&at);
        if !thorough && at % 811 != 0 {
            continue;
        }
        flipped[at] ^= bit;
        overlay_corruption(&format!("byte {at} ^ {bit:#x}"), flipped.clone());
        flipped[at] ^= bit;
    }
}

fn overlay_corruption(what: &str, bytes: Vec<u8>) {
    let outcome = catch_unwind(AssertUnwindSafe(|| match open_overlay(bytes, OverlayMode::ReadOnly) {
        Ok(o) => {
            let mut touched = vec![0u8; 48 * BS as usize];
            if let Err(e) = o.read_at(0, &mut touched) {
                assert!(!e.to_string().is_empty());
            }
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }));
    assert!(outcome.is_ok(), "overlay: {what}: panicked");
}

// ---------------------------------------------------------------------------------------------
// A whole store (layout, entry, record, metadata prefix, packs, pack index, provenance, profile,
// tag) and a host disk cache holding its blobs and chunks.

const STORE_TAG: &str = "fixture";

/// A small tree built with today's builder into `store-v1/`, tagged, with a profile.
fn make_store(dest: &Path) {
    let src = tempfile::tempdir().unwrap();
    let text: String = (0..400).map(|i| format!("line {i} of the format fixture\n")).collect();
    fs::write(src.path().join("hello.txt"), &text).unwrap();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let noise: Vec<u8> = (0..70_000)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    fs::write(src.path().join("noise.bin"), &noise).unwrap();
    fs::create_dir(src.path().join("etc")).unwrap();
    fs::write(src.path().join("etc/empty"), b"").unwrap();
    let when = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
    // Every time fixed (directories last), so that regenerating gives the same image ID.
    for f in ["hello.txt", "noise.bin", "etc/empty", "etc", ""] {
        fs::File::open(src.path().join(f)).unwrap().set_modified(when).unwrap();
    }
    let store = LocalStore::create_or_open(dest).unwrap();
    let config = BuildConfig {
        size: tessera_ext4::SizePolicy::Exact(8 << 20),
        chunk_size: 64 << 10,
        fs_time: DEFAULT_FS_TIME,
        source_ref: "format fixture".into(),
        ..BuildConfig::default()
    };
    let out = build_dir(src.path(), &store, &config, &NoProgress).unwrap();
    store.set_ref(STORE_TAG, &out.id).unwrap();
    let chunks: Vec<ChunkId> = out.record.block_map.chunks().iter().map(|c| c.id).collect();
    let t = Trace::new(
        out.id,
        chunks.iter().enumerate().map(|(i, &chunk)| TraceEntry { chunk, at_us: i as u64 * 100 }).collect(),
    )
    .unwrap();
    tessera_store::attach_profile(&store, &out.id, &Profile::merge(out.id, &[t], 1).unwrap()).unwrap();
}

fn store_dir() -> PathBuf {
    static MADE: std::sync::Once = std::sync::Once::new();
    let path = dir().join("store-v1");
    MADE.call_once(|| {
        if !path.exists() && blessing() {
            make_store(&path);
            // Nothing of the process that wrote it: only the layout the format defines.
            let _ = fs::remove_dir_all(path.join("tmp"));
            eprintln!("wrote {}", path.display());
        }
    });
    assert!(
        path.join("refs").join(STORE_TAG).exists(),
        "{}: missing (TESSERA_BLESS_FORMATS=1 writes it)",
        path.display()
    );
    path
}

/// Copy a fixture directory (tests never touch the checked-in one).
fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            fs::copy(e.path(), dest).unwrap();
        }
    }
}

/// The whole device of image `id`, read through today's reader.
fn read_device(store: &LocalStore, id: &ImageId) -> Result<Vec<u8>, tessera_store::StoreError> {
    let image = OpenImage::open(store, id)?;
    let reader = ImageReader::new(image, store.clone());
    let mut dev = vec![0u8; reader.device_bytes() as usize];
    reader.read_at(0, &mut dev)?;
    Ok(dev)
}

#[test]
fn store_layout() {
    let path = store_dir();
    let store = LocalStore::open(&path).unwrap();
    let id = store.resolve(STORE_TAG).unwrap();
    let image = OpenImage::open(&store, &id).unwrap();
    let dev = read_device(&store, &id).unwrap();
    eprintln!(
        "store fixture: image {id}, {} chunks, device {}",
        image.record().block_map.chunks().len(),
        Sha256Digest::of(&dev)
    );
    assert_eq!(id.to_string(), STORE_IMAGE_ID);
    assert_eq!(store.list_images().unwrap(), vec![id]);
    let record = image.record();
    assert_eq!(record.geometry.blocks * 4096, 8 << 20);
    assert_eq!(record.block_map.chunks().len(), STORE_CHUNKS);
    assert!(image.entry().profile.is_some(), "the fixture's entry names its profile");
    let (_, profile) =
        tessera_store::read_profile(&store, &id, image.entry(), &record.block_map).unwrap().unwrap();
    assert_eq!(profile.entries().len(), STORE_CHUNKS);
    assert_eq!(Sha256Digest::of(&dev).to_string(), STORE_DEVICE_DIGEST, "the device reads other bytes");
    let text: String = (0..400).map(|i| format!("line {i} of the format fixture\n")).collect();
    assert!(
        dev.windows(text.len()).step_by(4096).any(|w| w == text.as_bytes()),
        "hello.txt's bytes are on the device"
    );
}

const STORE_IMAGE_ID: &str = "sha256:2be206d3e16ba64364eb32a6dd201f6da0587d3d11fb4ee5b3bf1482a26dd2e5";
const STORE_DEVICE_DIGEST: &str = "sha256:9ce1122128a80af59093c40fd9242c8bdedd69e7840d990abb2e00fcf25b3afc";
const STORE_CHUNKS: usize = 3;

/// Every blob and document of the store, damaged one at a time (emptied, halved, one byte short,
/// one byte flipped at a few places): opening or reading gives a typed error or the same device,
/// never a panic and never other bytes.
#[test]
fn store_corruptions() {
    let path = store_dir();
    let files: Vec<PathBuf> = ["blobs/sha256", "images", "refs"]
        .iter()
        .flat_map(|d| fs::read_dir(path.join(d)).unwrap().map(|e| e.unwrap().path()))
        .collect();
    assert!(files.len() >= 7, "{files:?}");
    let pristine = LocalStore::open(&path).unwrap();
    let want = read_device(&pristine, &pristine.resolve(STORE_TAG).unwrap()).unwrap();
    for file in &files {
        let rel = file.strip_prefix(&path).unwrap();
        let orig = fs::read(file).unwrap();
        let mut damaged: Vec<(String, Vec<u8>)> = vec![
            ("emptied".into(), Vec::new()),
            ("halved".into(), orig[..orig.len() / 2].to_vec()),
            ("one byte short".into(), orig[..orig.len().saturating_sub(1)].to_vec()),
        ];
        for at in [0, 9, orig.len() / 3, orig.len() / 2, orig.len().saturating_sub(2)] {
            let mut b = orig.clone();
            if let Some(x) = b.get_mut(at) {
                *x ^= 0x10;
                damaged.push((format!("byte {at} flipped"), b));
            }
        }
        for (how, bytes) in damaged {
            let tmp = tempfile::tempdir().unwrap();
            copy_dir(&path, tmp.path());
            fs::write(tmp.path().join(rel), &bytes).unwrap();
            let what = format!("{} {how}", rel.display());
            let got = catch_unwind(AssertUnwindSafe(|| {
                let store = LocalStore::open(tmp.path()).map_err(|e| e.to_string())?;
                let id = store.resolve(STORE_TAG).map_err(|e| e.to_string())?;
                read_device(&store, &id).map_err(|e| e.to_string())
            }));
            match got {
                Err(_) => panic!("{what}: panicked"),
                Ok(Err(e)) => assert!(!e.is_empty(), "{what}"),
                Ok(Ok(dev)) => assert!(dev == want, "{what}: other device bytes"),
            }
        }
    }
}

/// A host disk cache (`cache-v1/`: `v1/index` and its entries) holding the fixture store's
/// record, prefix, pack index and every chunk, as a `serve --cache-dir` of it leaves one.
fn cache_dir() -> PathBuf {
    static MADE: std::sync::Once = std::sync::Once::new();
    let path = dir().join("cache-v1");
    MADE.call_once(|| {
        if path.exists() || !blessing() {
            return;
        }
        let store = LocalStore::open(store_dir()).unwrap();
        let id = store.resolve(STORE_TAG).unwrap();
        let image = OpenImage::open(&store, &id).unwrap();
        let cache = DiskCache::open(&CacheConfig::new(&path)).unwrap();
        let e = image.entry();
        for d in [e.record, e.prefix, e.pack_index] {
            cache.put_blob(&d, &store.read_blob(&d).unwrap());
        }
        for i in 0..image.record().block_map.chunks().len() as u32 {
            let (chunk, pack, loc) = image.chunk_location(i).unwrap();
            let stored = store.read_blob_range(&pack, loc.offset, u64::from(loc.stored_len)).unwrap();
            cache.put_chunk(&chunk, &pack, &loc, &stored);
        }
        drop(cache);
        // Nothing of the process that wrote it: only the layout the format defines.
        let _ = fs::remove_dir_all(path.join("v1/tmp"));
        eprintln!("wrote {}", path.display());
    });
    assert!(
        path.join("v1/index").exists(),
        "{}: missing (TESSERA_BLESS_FORMATS=1 writes it)",
        path.display()
    );
    path
}

/// Every entry of the fixture cache is served (checked) by today's cache, from a copy of `dir`.
fn cache_serves_everything(dir: &Path, what: &str) {
    let store = LocalStore::open(store_dir()).unwrap();
    let id = store.resolve(STORE_TAG).unwrap();
    let image = OpenImage::open(&store, &id).unwrap();
    let cache = DiskCache::open(&CacheConfig::new(dir)).unwrap_or_else(|e| panic!("{what}: {e}"));
    let e = image.entry();
    for d in [e.record, e.prefix, e.pack_index] {
        assert_eq!(cache.get_blob(&d), Some(store.read_blob(&d).unwrap()), "{what}: blob {d}");
    }
    for i in 0..image.record().block_map.chunks().len() as u32 {
        let (chunk, pack, loc) = image.chunk_location(i).unwrap();
        let stored = store.read_blob_range(&pack, loc.offset, u64::from(loc.stored_len)).unwrap();
        assert_eq!(cache.get_chunk(&chunk, &pack, &loc), Some(stored), "{what}: chunk #{i}");
    }
}

#[test]
fn disk_cache_and_its_index() {
    let path = cache_dir();
    let index = fs::read(path.join("v1/index")).unwrap();
    assert!(index.starts_with(b"tessera-cache-index 1\n"), "{}", String::from_utf8_lossy(&index));
    let entries = index.split(|&b| b == b'\n').filter(|l| l.starts_with(b"+ ")).count();
    assert_eq!(entries, 3 + STORE_CHUNKS, "one `+` line per entry");
    let copy = |index: Option<&[u8]>| {
        let tmp = tempfile::tempdir().unwrap();
        copy_dir(&path, tmp.path());
        if let Some(b) = index {
            fs::write(tmp.path().join("v1/index"), b).unwrap();
        }
        tmp
    };
    let tmp = copy(None);
    cache_serves_everything(tmp.path(), "the fixture");
    // A torn or damaged index (a power loss, a foreign file, a newer version's header) is
    // rebuilt from the entries on disk: every entry still served, never a panic.
    // Cut at every line end and in the middle of every line; a bit flipped in every line.
    let mut damaged: Vec<(String, Vec<u8>)> = Vec::new();
    let mut start = 0;
    for (i, _) in index.iter().enumerate().filter(|(_, &b)| b == b'\n') {
        for n in [(start + i) / 2, i, i + 1] {
            damaged.push((format!("index cut to {n}"), index[..n].to_vec()));
        }
        start = i + 1;
    }
    for at in (5..index.len()).step_by(47) {
        let mut b = index.clone();
        b[at] ^= 0x04;
        damaged.push((format!("index byte {at} flipped"), b));
    }
    damaged.push((
        "version 2 header".into(),
        String::from_utf8(index.clone()).unwrap().replacen(" 1\n", " 2\n", 1).into_bytes(),
    ));
    for (what, b) in &damaged {
        let tmp = copy(Some(b));
        let outcome = catch_unwind(AssertUnwindSafe(|| cache_serves_everything(tmp.path(), what)));
        assert!(outcome.is_ok(), "{what}: failed or panicked");
    }
    // A damaged entry is never served (removed, read as a miss); the others still are.
    let tmp = copy(None);
    let store = LocalStore::open(store_dir()).unwrap();
    let image = OpenImage::open(&store, &store.resolve(STORE_TAG).unwrap()).unwrap();
    let cache = DiskCache::open(&CacheConfig::new(tmp.path())).unwrap();
    let (chunk, pack, loc) = image.chunk_location(0).unwrap();
    let file = cache.chunk_path(&chunk, &loc);
    let mut b = fs::read(&file).unwrap();
    let mid = b.len() / 2;
    b[mid] ^= 1;
    fs::write(&file, b).unwrap();
    assert_eq!(cache.get_chunk(&chunk, &pack, &loc), None, "a corrupt cached chunk is served");
    assert!(!file.exists(), "the corrupt entry is removed");
    let record = image.entry().record;
    assert_eq!(cache.get_blob(&record), Some(store.read_blob(&record).unwrap()));
}
