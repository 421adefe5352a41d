//! Layer reading on crafted tar bytes: every header feature the flattener needs, and one test per
//! hostile stream (truncation, corruption, digest and size mismatches, decompression bombs).

use std::io::{Cursor, Write};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use sha2::{Digest as _, Sha256};
use tessera_ext4::NodeKind;

use super::*;
use crate::test_support::{device_header, tar_header as header};

/// A layer with PAX xattrs, ns times and numeric owners, a GNU long name, a long link, devices, a
/// FIFO, a symlink and a hard link.
pub(crate) fn rich_layer() -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.append(&header("./", tar::EntryType::Directory, 0, 0o750), &[][..]).unwrap();
    b.append_pax_extensions([
        ("mtime", &b"1700000000.123456789"[..]),
        ("atime", b"1700000001.5"),
        ("ctime", b"1700000002.25"),
        ("uid", b"4000000000"),
        ("gid", b"7"),
        (
            "SCHILY.xattr.security.capability",
            b"\x00\x00\x00\x02\x00\x30\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00",
        ),
        ("SCHILY.xattr.user.k", b"v\x00binary"),
    ])
    .unwrap();
    b.append(&header("bin/ping", tar::EntryType::Regular, 5, 0o4755), &b"pong\n"[..]).unwrap();
    let long = format!("deep/{}/file", "x".repeat(150));
    let mut h = header("placeholder", tar::EntryType::Regular, 3, 0o644);
    b.append_data(&mut h, &long, &b"abc"[..]).unwrap();
    b.append(&device_header("dev/null", tar::EntryType::Char, 0o666, 1, 3), &[][..]).unwrap();
    b.append(&device_header("dev/sda", tar::EntryType::Block, 0o660, 8, 0), &[][..]).unwrap();
    b.append(&header("run/fifo", tar::EntryType::Fifo, 0, 0o600), &[][..]).unwrap();
    let mut h = header("lnk", tar::EntryType::Symlink, 0, 0o777);
    b.append_link(&mut h, "lnk", format!("/{long}")).unwrap();
    let mut h = header("bin/ping2", tar::EntryType::Link, 0, 0o644);
    b.append_link(&mut h, "bin/ping2", "./bin/ping").unwrap();
    b.into_inner().unwrap()
}

fn sha(bytes: &[u8]) -> Digest {
    Digest { hex: hex::encode(Sha256::digest(bytes)) }
}

fn blob(raw: Vec<u8>, digest: Option<Digest>, diff_id: Option<Digest>) -> LayerBlob {
    let size = Some(raw.len() as u64);
    let raw = Arc::new(raw);
    LayerBlob {
        name: "layer 0".into(),
        open: Box::new(move || {
            Ok(Box::new(Cursor::new(raw.as_ref().clone())) as Box<dyn std::io::Read + Send>)
        }),
        digest,
        size,
        diff_id,
    }
}

fn gzip(b: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(b).unwrap();
    e.finish().unwrap()
}

fn zstd(b: &[u8]) -> Vec<u8> {
    zstd::bulk::compress(b, 3).unwrap()
}

fn verified(raw: Vec<u8>, tar: &[u8]) -> LayerBlob {
    let d = sha(&raw);
    blob(raw, Some(d), Some(sha(tar)))
}

fn scan(b: &LayerBlob, budget: Option<u64>) -> Result<Vec<LayerEntry>, SourceError> {
    LayerStream::open(b, budget.map(|l| (Arc::new(AtomicU64::new(0)), l))).and_then(scan_layer)
}

#[test]
fn headers_of_every_kind_in_every_compression() {
    let tar = rich_layer();
    let plain = scan(&verified(tar.clone(), &tar), None).unwrap();
    assert_eq!(scan(&verified(gzip(&tar), &tar), None).unwrap(), plain);
    assert_eq!(scan(&verified(zstd(&tar), &tar), None).unwrap(), plain);

    let mut f = Flattener::new(0);
    f.apply_layer(0, "layer 0", &plain).unwrap();
    let flat = f.finish().unwrap();
    let nodes = &flat.tree.nodes;
    assert_eq!(nodes[0].meta.mode, 0o750, "./ gives the root its attributes");
    let find = |path: &str| -> usize {
        let mut cur = 0usize;
        for c in path.split('/') {
            let NodeKind::Directory { entries } = &nodes[cur].kind else { panic!("{path}") };
            cur = entries
                .iter()
                .find(|e| e.name[..] == *c.as_bytes())
                .unwrap_or_else(|| panic!("{path}"))
                .node
                .0 as usize;
        }
        cur
    };
    let ping = find("bin/ping");
    let m = nodes[ping].meta;
    assert_eq!((m.mode, m.uid, m.gid), (0o4755, 4_000_000_000, 7));
    assert_eq!((m.mtime.sec, m.mtime.nsec), (1_700_000_000, 123_456_789));
    assert_eq!((m.atime.sec, m.atime.nsec), (1_700_000_001, 500_000_000));
    assert_eq!((m.ctime.sec, m.ctime.nsec), (1_700_000_002, 250_000_000));
    let names: Vec<&[u8]> = nodes[ping].xattrs.iter().map(|x| x.name.as_slice()).collect();
    assert_eq!(names, vec![&b"security.capability"[..], b"user.k"]);
    assert_eq!(nodes[ping].xattrs[1].value, b"v\x00binary");
    assert_eq!(find("bin/ping2"), ping, "hard link shares the node");
    let c = flat.content[ping].unwrap();
    assert_eq!(&tar[c.offset as usize..(c.offset + c.size) as usize], b"pong\n");
    let long = find(&format!("deep/{}/file", "x".repeat(150)));
    let c = flat.content[long].unwrap();
    assert_eq!(&tar[c.offset as usize..(c.offset + c.size) as usize], b"abc");
    assert_eq!(nodes[find("deep")].meta.mode, 0o755, "implicit parent");
    assert!(matches!(nodes[find("dev/null")].kind, NodeKind::CharDevice { major: 1, minor: 3 }));
    assert!(matches!(nodes[find("dev/sda")].kind, NodeKind::BlockDevice { major: 8, minor: 0 }));
    assert!(matches!(nodes[find("run/fifo")].kind, NodeKind::Fifo));
    let NodeKind::Symlink { target } = &nodes[find("lnk")].kind else { panic!("lnk") };
    assert_eq!(target.len(), 1 + 5 + 150 + 5);
    // Without PAX times, atime and ctime follow mtime.
    let dev = nodes[find("dev/null")].meta;
    assert_eq!((dev.atime, dev.ctime), (dev.mtime, dev.mtime));
}

#[test]
fn pass_two_reads_file_bytes_at_their_offsets() {
    let tar = rich_layer();
    let entries = scan(&verified(zstd(&tar), &tar), None).unwrap();
    let mut files: Vec<(u64, u64)> = entries
        .iter()
        .filter_map(|e| match e.kind {
            EntryKind::File { size, offset } => Some((offset, size)),
            _ => None,
        })
        .collect();
    files.sort();
    let mut s = LayerStream::open(&verified(zstd(&tar), &tar), None).unwrap();
    for (offset, size) in files {
        s.skip_to(offset).unwrap();
        let mut buf = vec![0u8; size as usize];
        s.read_exact_checked(&mut buf).unwrap();
        assert_eq!(buf, &tar[offset as usize..(offset + size) as usize]);
    }
    s.finish().unwrap();
}

#[test]
fn truncated_and_corrupt_compressed_streams() {
    let tar = rich_layer();
    for raw in [gzip(&tar), zstd(&tar)] {
        let cut = raw[..raw.len() / 2].to_vec();
        let e = scan(&blob(cut, None, None), None).unwrap_err();
        assert!(matches!(e, SourceError::Corrupt { .. }), "truncated: {e}");
        let mut bad = raw.clone();
        let mid = bad.len() / 2;
        for b in &mut bad[mid..mid + 16] {
            *b ^= 0x5a;
        }
        let e = scan(&blob(bad, None, None), None).unwrap_err();
        assert!(matches!(e, SourceError::Corrupt { .. }), "corrupt: {e}");
        // Only the trailer cut: the tar is complete but the stream is not.
        let trailer = raw[..raw.len() - 4].to_vec();
        let e = scan(&blob(trailer, None, None), None).unwrap_err();
        assert!(matches!(e, SourceError::Corrupt { .. }), "trailer: {e}");
    }
}

#[test]
fn header_size_past_the_end_of_the_stream() {
    let mut b = tar::Builder::new(Vec::new());
    b.append(&header("big", tar::EntryType::Regular, 5, 0o644), &b"12345"[..]).unwrap();
    let mut tar = b.into_inner().unwrap();
    // Claim 1 MiB of content: the stream ends long before.
    let mut h = header("big", tar::EntryType::Regular, 1 << 20, 0o644);
    h.set_cksum();
    tar[..512].copy_from_slice(h.as_bytes());
    tar.truncate(1024);
    for raw in [tar.clone(), gzip(&tar)] {
        let e = scan(&blob(raw, None, None), None).unwrap_err();
        assert!(matches!(e, SourceError::Corrupt { .. }), "{e}");
    }
}

#[test]
fn digest_size_diff_id_and_budget() {
    let tar = rich_layer();
    let gz = gzip(&tar);
    let wrong = sha(b"something else");
    let e = scan(&blob(gz.clone(), Some(wrong.clone()), None), None).unwrap_err();
    assert!(matches!(e, SourceError::DigestMismatch { .. }), "{e}");
    let e = scan(&blob(gz.clone(), None, Some(wrong)), None).unwrap_err();
    assert!(matches!(e, SourceError::DigestMismatch { .. }), "{e}");
    let mut short = blob(gz.clone(), Some(sha(&gz)), None);
    short.size = Some(gz.len() as u64 - 1);
    let e = scan(&short, None).unwrap_err();
    assert!(matches!(e, SourceError::SizeMismatch { .. }), "{e}");
    // Trailing garbage after the compressed stream changes the digest.
    let mut tail = gz.clone();
    tail.extend_from_slice(&[0u8; 10]);
    assert!(scan(&blob(tail, Some(sha(&gz)), None), None).is_err());
    // A bomb: 64 MiB of zeros in a few KiB of gzip, against a 1 MiB budget.
    let mut bomb = tar::Builder::new(Vec::new());
    let zeros = vec![0u8; 64 << 20];
    bomb.append(&header("zeros", tar::EntryType::Regular, zeros.len() as u64, 0o644), &zeros[..]).unwrap();
    let bomb = gzip(&bomb.into_inner().unwrap());
    assert!(bomb.len() < 1 << 20);
    let e = scan(&blob(bomb.clone(), None, None), Some(1 << 20)).unwrap_err();
    assert!(matches!(e, SourceError::TooLarge { limit, .. } if limit == 1 << 20), "{e}");
    assert!(scan(&blob(bomb, None, None), Some(128 << 20)).is_ok());
}

#[test]
fn hostile_entries_in_real_tar_streams() {
    fn raw_tar(entries: &[(&[u8], tar::EntryType, &str)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, link) in entries {
            let mut h = header("x", *kind, 0, 0o644);
            // Write names raw: the tar crate refuses `..` itself.
            let name = &mut h.as_old_mut().name;
            name.fill(0);
            name[..path.len()].copy_from_slice(path);
            if !link.is_empty() {
                let l = &mut h.as_old_mut().linkname;
                l[..link.len()].copy_from_slice(link.as_bytes());
            }
            h.set_cksum();
            b.append(&h, &[][..]).unwrap();
        }
        b.into_inner().unwrap()
    }
    let flatten = |tar: Vec<u8>| -> Result<(), SourceError> {
        let entries = scan(&blob(tar, None, None), None)?;
        let mut f = Flattener::new(0);
        f.apply_layer(0, "layer 0", &entries)?;
        f.finish().map(drop)
    };
    use tar::EntryType::{Link, Regular, Symlink};
    let e = flatten(raw_tar(&[(b"../escape", Regular, "")])).unwrap_err();
    assert!(matches!(e, SourceError::DotDot { .. }), "{e}");
    let e = flatten(raw_tar(&[(b"s", Symlink, "/etc"), (b"s/passwd", Regular, "")])).unwrap_err();
    assert!(matches!(e, SourceError::UnderSymlink { .. }), "{e}");
    let e = flatten(raw_tar(&[(b"h", Link, "nothere")])).unwrap_err();
    assert!(matches!(e, SourceError::HardLinkMissing { .. }), "{e}");
    let e = flatten(raw_tar(&[(b"h", Link, "../../etc/shadow")])).unwrap_err();
    assert!(matches!(e, SourceError::DotDot { .. }), "{e}");
    let e = flatten(raw_tar(&[(b"g", tar::EntryType::GNUSparse, "")])).unwrap_err();
    assert!(matches!(e, SourceError::UnsupportedEntry { .. } | SourceError::Corrupt { .. }), "{e}");
    // Duplicates: the last one wins; non-UTF-8 names are kept as bytes.
    flatten(raw_tar(&[(b"a", Regular, ""), (b"a", Symlink, "b"), (b"caf\xe9\xff", Regular, "")])).unwrap();
}

/// `LIBARCHIVE.xattr.*` records as bsdtar writes them (next to SCHILY duplicates under the
/// encoded name), and alone; a value that is not base64 is a clear header error.
#[test]
fn libarchive_xattr_records() {
    let mut b = tar::Builder::new(Vec::new());
    b.append_pax_extensions([
        ("LIBARCHIVE.xattr.user.sp%20ace%3D%25x", &b"AAEC/w"[..]),
        ("SCHILY.xattr.user.sp%20ace%3D%25x", b"\x00\x01\x02\xff"),
        ("LIBARCHIVE.xattr.security.capability", b"AQAAAgAgAAAAAAAAAAAAAAAAAAA="),
        (
            "SCHILY.xattr.security.capability",
            b"\x01\x00\x00\x02\x00\x20\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00",
        ),
        ("LIBARCHIVE.xattr.user.only-libarchive", b"aGVsbG8"),
    ])
    .unwrap();
    b.append(&header("f", tar::EntryType::Regular, 2, 0o644), &b"hi"[..]).unwrap();
    let tar = b.into_inner().unwrap();
    let entries = scan(&verified(tar.clone(), &tar), None).unwrap();
    let xattrs: Vec<(&[u8], &[u8])> =
        entries[0].xattrs.iter().map(|x| (x.name.as_slice(), x.value.as_slice())).collect();
    assert_eq!(
        xattrs,
        vec![
            (
                &b"security.capability"[..],
                &b"\x01\x00\x00\x02\x00\x20\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"[..]
            ),
            (b"user.only-libarchive", b"hello"),
            (b"user.sp ace=%x", b"\x00\x01\x02\xff"),
        ]
    );

    let mut b = tar::Builder::new(Vec::new());
    b.append_pax_extensions([("LIBARCHIVE.xattr.user.bad", &b"not base64!"[..])]).unwrap();
    b.append(&header("f", tar::EntryType::Regular, 0, 0o644), &[][..]).unwrap();
    let tar = b.into_inner().unwrap();
    let err = scan(&verified(tar.clone(), &tar), None).unwrap_err();
    assert!(matches!(err, SourceError::BadHeader { field: "LIBARCHIVE.xattr", .. }), "{err}");
}

/// PAX values holding newline bytes (binary xattrs such as this `security.capability`, which
/// tar 0.4's own record parser cannot read), a value that looks like a `linkpath` record, and a
/// PAX `size` the `tar` crate would not apply (so its framing and every other reader's differ).
#[test]
fn pax_values_with_newlines() {
    let cap = b"\x01\x00\x00\x02\x02\x00\x0a\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00";
    let mut b = tar::Builder::new(Vec::new());
    b.append_pax_extensions([
        ("SCHILY.xattr.security.capability", &cap[..]),
        ("SCHILY.xattr.user.trick", b"\n22 linkpath=/etc/evil\n"),
        ("mtime", b"1700000000.5"),
    ])
    .unwrap();
    b.append(&header("bin/tool", tar::EntryType::Regular, 3, 0o755), &b"abc"[..]).unwrap();
    b.append_pax_extensions([("SCHILY.xattr.user.trick", &b"\n22 linkpath=/etc/evil\n"[..])]).unwrap();
    let mut h = header("lnk", tar::EntryType::Symlink, 0, 0o777);
    b.append_link(&mut h, "lnk", "harmless").unwrap();
    let tar = b.into_inner().unwrap();
    let entries = scan(&verified(tar.clone(), &tar), None).unwrap();
    assert_eq!(entries.len(), 2);
    assert_eq!(entries[0].path, b"bin/tool");
    assert_eq!(entries[0].xattrs[0].name, b"security.capability");
    assert_eq!(entries[0].xattrs[0].value, cap);
    assert_eq!(entries[0].xattrs[1].value, b"\n22 linkpath=/etc/evil\n");
    assert_eq!(entries[0].meta.mtime.nsec, 500_000_000);
    assert_eq!(entries[1].kind, EntryKind::Symlink(b"harmless".to_vec()));

    // A PAX size after a value with a newline: tar 0.4 frames the data by the header's size.
    let mut b = tar::Builder::new(Vec::new());
    b.append_pax_extensions([("SCHILY.xattr.user.x", &b"a\nb"[..]), ("size", b"1024")]).unwrap();
    b.append(&header("f", tar::EntryType::Regular, 3, 0o644), &b"abc"[..]).unwrap();
    let tar = b.into_inner().unwrap();
    let err = scan(&verified(tar.clone(), &tar), None).unwrap_err();
    assert!(matches!(err, SourceError::BadHeader { field: "size", .. }), "{err}");
}

/// Pass 2 (`reopen`) still checks the raw digest; the diff_id only when there is no raw digest.
#[test]
fn reopen_checks_the_raw_digest_or_else_the_diff_id() {
    let drain = |s: LayerStream| s.finish();
    let tar = rich_layer();
    let gz = gzip(&tar);
    let wrong = sha(b"something else");
    // Raw digest right, diff_id wrong: pass 1 refuses, pass 2 trusts the raw digest.
    let b = blob(gz.clone(), Some(sha(&gz)), Some(wrong.clone()));
    assert!(matches!(drain(LayerStream::open(&b, None).unwrap()), Err(SourceError::DigestMismatch { .. })));
    assert!(drain(LayerStream::reopen(&b).unwrap()).is_ok());
    // A raw digest that no longer matches (the blob changed between the passes).
    let b = blob(gz.clone(), Some(wrong.clone()), Some(sha(&tar)));
    assert!(matches!(drain(LayerStream::reopen(&b).unwrap()), Err(SourceError::DigestMismatch { .. })));
    // No raw digest (docker archives): the diff_id is checked again.
    let b = blob(gz, None, Some(wrong));
    assert!(matches!(drain(LayerStream::reopen(&b).unwrap()), Err(SourceError::DigestMismatch { .. })));
}

/// NUL bytes in a PAX path, linkpath or xattr key (what only PAX can carry) are header errors.
#[test]
fn nul_bytes_in_pax_names() {
    for (key, value, field) in [
        ("path", &b"a\0b"[..], "path"),
        ("linkpath", b"t\0x", "linkpath"),
        ("SCHILY.xattr.user.a\0b", b"v", "xattr"),
    ] {
        let mut b = tar::Builder::new(Vec::new());
        b.append_pax_extensions([(key, value)]).unwrap();
        let mut h = header("f", tar::EntryType::Symlink, 0, 0o777);
        b.append_link(&mut h, "f", "target").unwrap();
        let tar = b.into_inner().unwrap();
        let err = scan(&verified(tar.clone(), &tar), None).unwrap_err();
        assert!(matches!(&err, SourceError::BadHeader { field: f, .. } if *f == field), "{key}: {err}");
    }
}

/// A symlink whose header says 0644 (Python's `tarfile` default) or carries setuid bits comes out
/// 0777, as every Linux extractor makes it; other entries keep their header's mode.
#[test]
fn symlink_modes_are_0777_whatever_the_header_says() {
    let mut b = tar::Builder::new(Vec::new());
    for (name, mode) in [("a", 0o644), ("b", 0o4755), ("c", 0o000), ("d", 0o777)] {
        let mut h = header(name, tar::EntryType::Symlink, 0, mode);
        b.append_link(&mut h, name, "target").unwrap();
    }
    b.append(&header("f", tar::EntryType::Regular, 0, 0o640), &[][..]).unwrap();
    let tar = b.into_inner().unwrap();
    let entries = scan(&verified(tar.clone(), &tar), None).unwrap();
    let modes: Vec<u16> = entries.iter().map(|e| e.meta.mode).collect();
    assert_eq!(modes, [0o777, 0o777, 0o777, 0o777, 0o640]);
}
