//! Seed inputs made from real requests, records and overlay files (`cargo run --bin seeds`
//! writes them to `fuzz/corpus/<target>/`; the smoke test runs them directly).

use std::sync::Arc;

use tessera_builder::test_support::tar_header;
use tessera_image::{BlockMap, ImageEntry, ImageRecord, PackIndex, RuntimeConfig};
use tessera_overlay::{Mode as OverlayMode, Overlay, OverlayParams};
use virtio_bindings::bindings::virtio_blk::{
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};

use crate::image_record::{
    MODE_ENTRY, MODE_PACK_INDEX, MODE_RECORD, MODE_STRUCTURED_PACK_INDEX, MODE_STRUCTURED_RECORD,
};
use crate::overlay_replay::{self as ov, MemIo};
use crate::vhost_request::{
    self as vr, header, segment, Case, DATA, HDR, INDIRECT, NEXT, STATUS, WRITE as W,
};
use crate::Output;

/// `(name, bytes)` seeds of one target.
pub type Seeds = Vec<(String, Vec<u8>)>;

/// Seeds of the named target (`vhost_request`, `image_record`, `overlay_replay`, `oci_layers`,
/// `content_manifest`, `source_index`, `gzip_index`, `pack_index`, `cache_index`, `profile`, `boot_trace`,
/// `request_trace`, `ext4_roundtrip`, `byteranges`, `elf_deps`, `ext4_scan`).
pub fn for_target(target: &str) -> Seeds {
    match target {
        "vhost_request" => vhost_request(),
        "image_record" => image_record(),
        "overlay_replay" => overlay_replay(),
        "oci_layers" => oci_layers(),
        "content_manifest" => crate::content_manifest::seeds(),
        "source_index" => crate::source_index::seeds(),
        "gzip_index" => crate::gzip_index::seeds(),
        "pack_index" => crate::pack_index::seeds(),
        "cache_index" => crate::cache_index::seeds(),
        "profile" => crate::profile::seeds(),
        "boot_trace" => crate::boot_trace::seeds(),
        "request_trace" => crate::request_trace::seeds(),
        "ext4_roundtrip" => crate::ext4_roundtrip::seeds(),
        "byteranges" => crate::byteranges::seeds(),
        "elf_deps" => crate::elf_deps::seeds(),
        "ext4_scan" => crate::ext4_scan::seeds(),
        other => panic!("unknown fuzz target {other}"),
    }
}

pub const TARGETS: [&str; 16] = [
    "vhost_request",
    "image_record",
    "overlay_replay",
    "oci_layers",
    "content_manifest",
    "source_index",
    "gzip_index",
    "pack_index",
    "cache_index",
    "profile",
    "boot_trace",
    "request_trace",
    "ext4_roundtrip",
    "byteranges",
    "elf_deps",
    "ext4_scan",
];

const CAP: u64 = 4 << 20;

fn case(flags: u8, hdr: [u8; 16], payload: Vec<u8>, descs: Vec<(u64, u32, u16, u16)>) -> Case {
    Case { flags: flags | vr::F_SERVE, capacity: CAP, header: hdr, payload, descs, indirect: Vec::new() }
}

pub fn vhost_request() -> Seeds {
    let ro = vr::F_READ_ONLY;
    let simple = |kind, sector, data: Option<(u32, u16)>| {
        let mut d = vec![(HDR, 16, 0, 0)];
        if let Some((len, flags)) = data {
            d.push((DATA, len, flags, 0));
        }
        d.push((STATUS, 1, W, 0));
        (header(kind, sector), d)
    };
    let mut out: Vec<(&str, Case)> = Vec::new();
    let (h, d) = simple(VIRTIO_BLK_T_IN, 8, Some((4096, W)));
    out.push(("read-4k", case(ro, h, vec![], d)));
    // The layout-independent form Linux may send: header split 5 + 11, data in uneven pieces,
    // the status byte at the end of the last data buffer.
    out.push((
        "read-split",
        case(
            0,
            header(VIRTIO_BLK_T_IN, 3),
            vec![],
            vec![
                (HDR, 5, 0, 0),
                (HDR + 0x100, 11, 0, 0),
                (DATA, 100, W, 0),
                (DATA + 0x1000, 0, W, 0),
                (DATA + 0x2000, 312, W, 0),
                (STATUS - 100, 101, W, 0),
            ],
        ),
    ));
    let (h, d) = simple(VIRTIO_BLK_T_OUT, 16, Some((4096, 0)));
    out.push(("write-4k", case(0, h, vec![0x5a; 64], d.clone())));
    out.push(("write-read-only", case(ro, h, vec![], d)));
    let (h, d) = simple(VIRTIO_BLK_T_OUT, (CAP / 512) - 1, Some((512, 0)));
    out.push(("write-last-sector", case(0, h, vec![], d)));
    let (h, d) = simple(VIRTIO_BLK_T_FLUSH, 0, None);
    out.push(("flush", case(0, h, vec![], d)));
    let (h, d) = simple(VIRTIO_BLK_T_GET_ID, 0, Some((20, W)));
    out.push(("get-id", case(ro, h, vec![], d)));
    let (h, d) = simple(VIRTIO_BLK_T_DISCARD, 0, Some((16, 0)));
    out.push(("discard", case(0, h, segment(8, 8, 0), d)));
    let (h, d) = simple(VIRTIO_BLK_T_WRITE_ZEROES, 0, Some((16, 0)));
    out.push(("write-zeroes-unmap", case(0, h, segment(1, 7, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP), d)));
    let (h, d) = simple(VIRTIO_BLK_T_IN, CAP / 512 - 7, Some((4096, W)));
    out.push(("read-out-of-range", case(ro, h, vec![], d)));
    // Header and discard segment in one buffer.
    out.push((
        "discard-one-buffer",
        case(0, header(VIRTIO_BLK_T_DISCARD, 0), segment(0, 16, 0), vec![(HDR, 32, 0, 0), (STATUS, 1, W, 0)]),
    ));
    // Data in the second memory region, after the hole.
    out.push((
        "read-region2",
        case(
            vr::F_REGION2,
            header(VIRTIO_BLK_T_IN, 0),
            vec![],
            vec![(HDR, 16, 0, 0), (vr::REGION2, 8192, W, 0), (STATUS, 1, W, 0)],
        ),
    ));
    // A long read: 64 data buffers of 512 bytes.
    let mut long = vec![(HDR, 16, 0, 0)];
    long.extend((0..64).map(|i| (DATA + i * 1024, 512, W, 0)));
    long.push((STATUS, 1, W, 0));
    out.push(("read-64-segments", case(0, header(VIRTIO_BLK_T_IN, 64), vec![], long)));

    // Through the split virtqueue: NEXT links, then an indirect table.
    let q = |flags| vr::F_QUEUE | flags;
    out.push((
        "queue-read",
        case(
            q(0),
            header(VIRTIO_BLK_T_IN, 8),
            vec![],
            vec![(HDR, 16, NEXT, 1), (DATA, 4096, W | NEXT, 2), (STATUS, 1, W, 0)],
        ),
    ));
    out.push((
        "queue-write",
        case(
            q(0),
            header(VIRTIO_BLK_T_OUT, 0),
            vec![7; 512],
            vec![(HDR, 16, NEXT, 2), (STATUS, 1, W, 0), (DATA, 4096, NEXT, 1)],
        ),
    ));
    let mut c = case(q(0), header(VIRTIO_BLK_T_IN, 0), vec![], vec![(INDIRECT, 3 * 16, vr::INDIRECT_F, 0)]);
    c.indirect = vec![(HDR, 16, NEXT, 1), (DATA, 1024, W | NEXT, 2), (STATUS, 1, W, 0)];
    out.push(("queue-indirect-read", c));

    out.into_iter().map(|(n, c)| (n.to_string(), c.encode())).collect()
}

pub fn image_record() -> Seeds {
    let mut out = Seeds::new();
    let with_mode = |mode: u8, bytes: &[u8]| {
        let mut v = vec![mode];
        v.extend_from_slice(bytes);
        v
    };
    out.push((
        "ref-index".into(),
        with_mode(crate::image_record::MODE_REF_INDEX, &tessera_image::RefIndex::example().encode()),
    ));
    out.push((
        "ref-index-v2".into(),
        with_mode(
            crate::image_record::MODE_REF_INDEX,
            &tessera_image::RefIndex::example().split_windows().0.encode(),
        ),
    ));
    out.push((
        "ref-index-v3".into(),
        with_mode(
            crate::image_record::MODE_REF_INDEX,
            &tessera_image::RefIndex::example_aligned().0.encode(),
        ),
    ));
    let r = ImageRecord::example();
    out.push(("record".into(), with_mode(MODE_RECORD, &r.encode())));
    let mut empty = r.clone();
    let mut b = BlockMap::builder(16);
    b.push_prefix(0, 1, 0).unwrap();
    empty.block_map = b.finish().unwrap();
    empty.geometry.blocks = 16;
    empty.prefix.blocks = 1;
    empty.config = RuntimeConfig::default();
    out.push(("record-minimal".into(), with_mode(MODE_RECORD, &empty.encode())));

    let idx = crate::pack_index::example();
    out.push(("pack-index".into(), with_mode(MODE_PACK_INDEX, &idx.encode())));
    out.push(("pack-index-empty".into(), with_mode(MODE_PACK_INDEX, &PackIndex::default().encode())));

    out.push(("entry".into(), with_mode(MODE_ENTRY, &ImageEntry::example().to_json())));

    // Structured: a map with prefix and chunk runs, env and labels.
    let mut o = Output::default();
    o.u64(4096);
    o.u8(2).u8(1).u32(3 * 4096 + 5).u8(2).u32(10);
    o.u8(4);
    o.u8(0).u64(0).u64(10).u64(0);
    o.u8(1).u64(100).u64(4).u8(0).u32(0);
    o.u8(1).u64(200).u64(1).u8(1).u32(0);
    o.u8(0).u64(4000).u64(2).u64(10);
    o.u8(1).u8(9).bytes(b"PATH=/bin");
    o.u8(1).u8(1).bytes(b"a").u8(1).bytes(b"b");
    out.push(("structured-record".into(), with_mode(MODE_STRUCTURED_RECORD, &o.buf)));
    let mut o = Output::default();
    o.u8(2).u8(1).u8(2).u8(3);
    for (id, pack, comp) in [(1u8, 0u8, 1u8), (2, 1, 0), (3, 0, 1)] {
        o.u8(id).u8(pack).u64(u64::from(id) * 4096).u32(4096).u32(4096).u8(comp);
    }
    out.push(("structured-pack-index".into(), with_mode(MODE_STRUCTURED_PACK_INDEX, &o.buf)));
    out
}

/// Overlay files made by the overlay itself, in a few states.
pub fn overlay_replay() -> Seeds {
    let mut out = Seeds::new();
    let mut push = |name: &str, bs: u32, device: u64, file: Vec<u8>| {
        let bs_shift = (bs / 512).trailing_zeros() as u8;
        for (suffix, flags) in [
            ("", 0u8),
            ("-resealed", ov::F_RESEAL_HEADERS | ov::F_RESEAL_RECORDS | ov::F_DATA_CRC),
            ("-read-only", ov::F_READ_ONLY),
        ] {
            let c = ov::Case { flags, bs_shift, device_bytes: device, file: file.clone() };
            out.push((format!("{name}{suffix}"), c.encode()));
        }
    };
    let bs = 4096u32;
    let dev = 1u64 << 20;
    push("fresh", bs, dev, make_overlay(bs, dev, |_| {}));
    let groups = |o: &Overlay| {
        let b = 4096u64;
        o.write_at(0, &[1u8; 4096]).unwrap();
        o.write_at(5 * b, &[2u8; 8192]).unwrap();
        o.flush().unwrap();
        o.write_zeroes(20 * b, 3 * b).unwrap();
        o.write_at(6 * b + 100, &[3u8; 1000]).unwrap();
        o.write_zeroes(b + 512, 1024).unwrap();
        o.flush().unwrap();
        // Not flushed: the torn tail.
        o.write_at(40 * b, &[4u8; 4096]).unwrap();
    };
    let file = make_overlay(bs, dev, groups);
    push("two-groups-and-unflushed", bs, dev, file.clone());
    // The same after a reopen (replayed, checkpointed).
    let io = MemIo::new(file);
    drop(
        Overlay::open(
            Box::new(io.clone()),
            params(bs, dev),
            Arc::new(vr::SectorPattern),
            OverlayMode::Durable,
        )
        .unwrap(),
    );
    push("checkpointed", bs, dev, io.snapshot());
    // Enough records for log segments to link (63 records per 4 KiB segment).
    let many = make_overlay(bs, dev, |o| {
        for i in 0..90u64 {
            o.write_at((i % 12) * 4096 * 3, &[i as u8; 4096]).unwrap();
            if i % 6 == 5 {
                o.flush().unwrap();
            }
        }
    });
    push("linked-segments", bs, dev, many);
    // Large blocks (the overlay accepts 4096..65536; the daemon uses 4096; 512 was finding F2).
    push(
        "bs8192",
        8192,
        64 << 10,
        make_overlay(8192, 64 << 10, |o| {
            o.write_at(0, &[9u8; 2048]).unwrap();
            o.flush().unwrap();
        }),
    );
    out
}

fn params(bs: u32, device_bytes: u64) -> OverlayParams {
    OverlayParams { image_id: ov::image_id(), block_size: bs, device_bytes }
}

/// The bytes of a new overlay after `f`.
pub fn make_overlay(bs: u32, device_bytes: u64, f: impl FnOnce(&Overlay)) -> Vec<u8> {
    let io = MemIo::default();
    let o = Overlay::create(
        Box::new(io.clone()),
        params(bs, device_bytes),
        Arc::new(vr::SectorPattern),
        OverlayMode::Durable,
    )
    .unwrap();
    f(&o);
    drop(o);
    io.snapshot()
}

/// A lower layer with every entry kind and header extension the reader knows.
fn lower_layer() -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.append(&tar_header("./", tar::EntryType::Directory, 0, 0o755), &[][..]).unwrap();
    b.append(&tar_header("etc/", tar::EntryType::Directory, 0, 0o755), &[][..]).unwrap();
    b.append_pax_extensions([
        ("mtime", &b"1700000000.123456789"[..]),
        ("atime", b"1700000001.5"),
        ("uid", b"4000000000"),
        ("SCHILY.xattr.user.k", b"v\x00binary"),
        ("LIBARCHIVE.xattr.user.sp%20ace", b"AAEC/w"),
        ("SCHILY.xattr.user.sp%20ace", b"\x00\x01\x02\xff"),
    ])
    .unwrap();
    b.append(&tar_header("etc/passwd", tar::EntryType::Regular, 5, 0o644), &b"root\n"[..]).unwrap();
    b.append(&tar_header("etc/group", tar::EntryType::Regular, 6, 0o644), &b"wheel\n"[..]).unwrap();
    let long = format!("deep/{}/file", "x".repeat(120));
    let mut h = tar_header("placeholder", tar::EntryType::Regular, 3, 0o644);
    b.append_data(&mut h, &long, &b"abc"[..]).unwrap();
    let mut h = tar_header("dev/null", tar::EntryType::Char, 0, 0o666);
    h.set_device_major(1).unwrap();
    h.set_device_minor(3).unwrap();
    h.set_cksum();
    b.append(&h, &[][..]).unwrap();
    b.append(&tar_header("run/fifo", tar::EntryType::Fifo, 0, 0o600), &[][..]).unwrap();
    let mut h = tar_header("bin/sh", tar::EntryType::Symlink, 0, 0o777);
    b.append_link(&mut h, "bin/sh", "/bin/busybox").unwrap();
    b.append(&tar_header("bin/busybox", tar::EntryType::Regular, 4, 0o755), &b"\x7fELF"[..]).unwrap();
    let mut h = tar_header("bin/ls", tar::EntryType::Link, 0, 0o755);
    b.append_link(&mut h, "bin/ls", "./bin/busybox").unwrap();
    b.append(&tar_header("opt/d/", tar::EntryType::Directory, 0, 0o700), &[][..]).unwrap();
    b.append(&tar_header("opt/d/x", tar::EntryType::Regular, 2, 0o600), &b"x\n"[..]).unwrap();
    b.into_inner().unwrap()
}

/// An upper layer: whiteouts (before and after a hard link to the whited-out file), an opaque
/// directory, a file replacing a directory, a directory over a directory.
fn upper_layer() -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar_header("etc/group.old", tar::EntryType::Link, 0, 0o644);
    b.append_link(&mut h, "etc/group.old", "etc/group").unwrap();
    b.append(&tar_header("etc/.wh.group", tar::EntryType::Regular, 0, 0o644), &[][..]).unwrap();
    b.append(&tar_header("etc/.wh.passwd", tar::EntryType::Regular, 0, 0o644), &[][..]).unwrap();
    let mut h = tar_header("passwd.bak", tar::EntryType::Link, 0, 0o644);
    b.append_link(&mut h, "passwd.bak", "etc/passwd").unwrap();
    b.append(&tar_header("opt/d/", tar::EntryType::Directory, 0, 0o750), &[][..]).unwrap();
    b.append(&tar_header("opt/d/.wh..wh..opq", tar::EntryType::Regular, 0, 0o644), &[][..]).unwrap();
    b.append(&tar_header("opt/d/y", tar::EntryType::Regular, 2, 0o600), &b"y\n"[..]).unwrap();
    b.append(&tar_header("run", tar::EntryType::Regular, 4, 0o644), &b"file"[..]).unwrap();
    b.append(&tar_header(".wh..wh.plnk", tar::EntryType::Directory, 0, 0o700), &[][..]).unwrap();
    b.into_inner().unwrap()
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

pub fn oci_layers() -> Seeds {
    use crate::oci_layers::encode;
    let (lower, upper) = (lower_layer(), upper_layer());
    vec![
        ("lower".into(), encode(std::slice::from_ref(&lower))),
        ("two-layers".into(), encode(&[lower.clone(), upper.clone()])),
        ("gzip-zstd".into(), encode(&[gzip(&lower), zstd::bulk::compress(&upper, 3).unwrap()])),
        ("three-layers".into(), encode(&[lower, upper.clone(), upper])),
    ]
}
