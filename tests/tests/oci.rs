//! OCI sources against the reference tools: images made with `umoci` (and hand-written layers),
//! `tessera build oci:…` → export → e2fsck → loop mount → zero differences with `umoci unpack`'s
//! root filesystem (directory mtimes aside: umoci sets them as it unpacks); the same image through
//! `docker-archive:` and recompressed to zstd gives the same ID; another Entrypoint another ID;
//! hostile layouts fail cleanly and write no image.
//!
//! Needs root, umoci and skopeo (`cargo xtask test` provides them); run with `--test-threads=1`.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use tessera_e2e::compare::{Field, Kind};
use tessera_e2e::judge::run;
use tessera_e2e::oci::{build_ok, build_source, require_tools, skopeo_copy, TarWriter, UmociImage};
use tessera_e2e::pipeline::judge_image;
use tessera_e2e::testutil::tmp;
use tessera_e2e::{compare, fixtures, tessera};

/// A three-layer image: the `kinds` fixture; changes computed by umoci (deletions → whiteouts,
/// file → dir, dir → symlink, metadata-only changes, a non-UTF-8 name); a hand-written layer
/// (opaque directory, PAX xattrs incl. security.capability, PAX ns times, a device node, a symlink,
/// hard links within the layer and to a file of a lower layer).
fn make_image(work: &Path) -> Result<UmociImage> {
    let img = UmociImage::new(work, "t")?;
    img.layer(|root| {
        fixtures::by_name("kinds")?.generate(root)?;
        // tar has no sockets.
        fs::remove_file(root.join("dev/socket"))?;
        Ok(())
    })?;
    img.layer(|root| {
        fs::remove_file(root.join("modes/f0644"))?;
        fs::remove_dir_all(root.join("times/filled-2100"))?;
        fs::remove_file(root.join("modes/f0600"))?;
        fs::create_dir(root.join("modes/f0600"))?;
        fs::write(root.join("modes/f0600/now-a-dir"), b"was a file\n")?;
        fs::remove_dir_all(root.join("links/b/c"))?;
        std::os::unix::fs::symlink("../a", root.join("links/b/c"))?;
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(root.join("modes/f0755"), fs::Permissions::from_mode(0o700))?;
        std::os::unix::fs::chown(root.join("owners/u1000-g1000"), Some(2000), Some(3000))?;
        let odd = std::ffi::OsStr::new(std::str::from_utf8(b"caf\xc3\xa9").unwrap_or("cafe"));
        fs::write(root.join(odd), b"utf-8 name\n")?;
        use std::os::unix::ffi::OsStrExt;
        fs::write(root.join(std::ffi::OsStr::from_bytes(b"raw-\xff\xfe")), b"non-utf-8 name\n")?;
        fs::create_dir_all(root.join("opaque/keep-not"))?;
        fs::write(root.join("opaque/lower"), b"hidden by the opaque marker above\n")?;
        fs::write(root.join("opaque/keep-not/deep"), b"also hidden\n")?;
        Ok(())
    })?;
    let cap = b"\x01\x00\x00\x02\x00\x20\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00";
    let tar = TarWriter::default()
        .dir("opaque/", 0o750)
        .file("opaque/.wh..wh..opq", 0o644, b"")
        .file("opaque/upper", 0o644, b"from the top layer\n")
        .pax(&[
            ("mtime", b"1700000000.123456789"),
            ("atime", b"1700000001.5"),
            ("ctime", b"1700000002.25"),
            ("uid", b"4000000000"),
            ("gid", b"4000000001"),
            ("SCHILY.xattr.security.capability", cap),
            ("SCHILY.xattr.user.note", b"binary\x00value"),
        ])
        .file("bin/ping", 0o4755, b"#!/bin/sh\necho pong\n")
        .hardlink("bin/ping-again", "bin/ping")
        .hardlink("links/to-lower", "links/a/pair")
        .device("dev/zero", b'3', 0o666, 1, 5)
        .device("dev/loop0", b'4', 0o660, 7, 0)
        .symlink("bin/sh", "/bin/ping")
        .file("./dev/.wh.tty0", 0o644, b"")
        .finish();
    img.append_tar_layer(&tar)?;
    Ok(img)
}

fn only_dir_mtimes(d: &compare::Difference, reference: &Path) -> bool {
    if !matches!(d.field, Field::MtimeSec | Field::MtimeNsec) {
        return false;
    }
    compare::entry(&compare::join(reference, &d.path)).is_ok_and(|e| e.kind == Kind::Dir)
}

#[test]
fn oci_layers_match_umoci_unpack() -> Result<()> {
    fixtures::require_root()?;
    require_tools()?;
    let t = tmp("oci-umoci")?;
    let img = make_image(t.path())?;
    let reference = img.unpack(&t.path().join("unpacked"))?;
    ensure!(reference.join("links/a/three").is_file(), "umoci unpack lacks the first layer");
    ensure!(reference.join("bin/ping").is_file(), "umoci unpack lacks the hand-written layer");
    ensure!(!reference.join("modes/f0644").exists(), "umoci did not apply the whiteout");
    ensure!(!reference.join("opaque/lower").exists(), "umoci did not apply the opaque marker");

    let store = t.path().join("store");
    let started = std::time::Instant::now();
    let id = build_ok(&img.source(), &store, &["--tag", "t"])?;
    eprintln!("build oci: {:.2}s → {id}", started.elapsed().as_secs_f64());
    tessera::check_store(&store)?;
    let raw = t.path().join("image.raw");
    tessera::export(id.as_str(), &store, &raw)?;
    // The hand-written layer's PAX attributes made it (umoci agrees, so check them directly too).
    let mnt = tessera_e2e::judge::LoopMount::ro(&raw)?;
    let ping = compare::entry(&mnt.path().join("bin/ping"))?;
    ensure!(ping.uid == 4_000_000_000 && ping.gid == 4_000_000_001, "PAX owner lost: {ping:?}");
    ensure!(ping.mtime == 1_700_000_000 && ping.mtime_nsec == 123_456_789, "PAX mtime lost: {ping:?}");
    ensure!(ping.xattrs.contains_key(b"security.capability".as_slice()), "capability lost: {ping:?}");
    use std::os::unix::fs::MetadataExt;
    let md = fs::symlink_metadata(mnt.path().join("bin/ping"))?;
    ensure!((md.atime(), md.atime_nsec()) == (1_700_000_001, 500_000_000), "PAX atime lost");
    ensure!((md.ctime(), md.ctime_nsec()) == (1_700_000_002, 250_000_000), "PAX ctime lost");
    ensure!(!mnt.path().join("dev/tty0").exists(), "whiteout in the top layer not applied");
    mnt.unmount()?;
    // (judge_image runs an rw workload on the image: direct checks come first.)
    let verdict = judge_image(&reference, &raw, |d| only_dir_mtimes(d, &reference))?;
    eprintln!("allowed differences (directory mtimes): {}", verdict.allowed.len());

    // inspect shows the config.
    let v = tessera::inspect_json(id.as_str(), &store)?;
    tessera::check_inspect(&v, &id)?;
    ensure!(v["config"].is_object(), "inspect --json has no config: {v}");
    Ok(())
}

#[test]
fn same_image_same_id_across_transports_and_compression() -> Result<()> {
    fixtures::require_root()?;
    require_tools()?;
    let t = tmp("oci-ids")?;
    let img = make_image(t.path())?;
    img.config(&["--config.entrypoint", "/bin/ping", "--config.env", "B=2", "--config.env", "A=1"])?;
    let store = t.path().join("store");
    let id = build_ok(&img.source(), &store, &[])?;

    let archive = t.path().join("image.tar");
    skopeo_copy(&format!("oci:{}", img.image_ref()), &format!("docker-archive:{}", archive.display()), &[])?;
    let from_archive = build_ok(&format!("docker-archive:{}", archive.display()), &store, &[])?;
    ensure!(from_archive == id, "docker-archive gave {from_archive}, oci layout {id}");

    let zstd_layout = t.path().join("zstd");
    skopeo_copy(
        &format!("oci:{}", img.image_ref()),
        &format!("oci:{}:t", zstd_layout.display()),
        &["--dest-compress-format", "zstd"],
    )?;
    let zblob = {
        let index: serde_json::Value = serde_json::from_slice(&fs::read(zstd_layout.join("index.json"))?)?;
        let m = index["manifests"][0]["digest"].as_str().context("no manifest")?.to_owned();
        let manifest: serde_json::Value =
            serde_json::from_slice(&fs::read(zstd_layout.join("blobs/sha256").join(&m["sha256:".len()..]))?)?;
        manifest["layers"][0]["mediaType"].as_str().unwrap_or("").to_owned()
    };
    ensure!(zblob.ends_with("zstd"), "skopeo did not write zstd layers: {zblob}");
    let from_zstd = build_ok(&format!("oci:{}:t", zstd_layout.display()), &t.path().join("store2"), &[])?;
    ensure!(from_zstd == id, "zstd layers gave {from_zstd}, gzip {id}");

    // Runtime config: normalized into the record and the ID.
    let v = tessera::inspect_json(id.as_str(), &store)?;
    ensure!(v["config"]["entrypoint"] == serde_json::json!(["/bin/ping"]), "{v}");
    let env: Vec<&str> =
        v["config"]["env"].as_array().context("env")?.iter().filter_map(|e| e.as_str()).collect();
    ensure!(
        env.iter().position(|e| *e == "A=1") < env.iter().position(|e| *e == "B=2"),
        "env not sorted: {env:?}"
    );
    img.config(&["--config.entrypoint", "/bin/sh"])?;
    let other = build_ok(&img.source(), &store, &[])?;
    ensure!(other != id, "another Entrypoint must give another image ID");
    Ok(())
}

/// Layer manifests (issue 12): a store that already holds some of an image's layers (as the
/// manifests an earlier build of a base image stored) builds it reading only the new layer, one
/// that holds them all reads none, and both give the cold store's image ID and byte-identical
/// exports. The image has whiteouts, an opaque directory and hard links within and across layers.
#[test]
fn cold_and_warm_stores_give_the_same_image() -> Result<()> {
    fixtures::require_root()?;
    require_tools()?;
    let t = tmp("oci-warm")?;
    let img = make_image(t.path())?;
    img.tag_lower_layers("base", 2)?;
    let base = format!("oci:{}:base", img.layout.display());
    let layers = |store: &Path, id: &tessera::ImageId| -> Result<Vec<bool>> {
        let entry: serde_json::Value =
            serde_json::from_slice(&fs::read(store.join("images").join(format!("{}.json", id.hex())))?)?;
        let p = entry["provenance"].as_str().context("no provenance")?;
        let prov: serde_json::Value =
            serde_json::from_slice(&fs::read(store.join("blobs/sha256").join(&p["sha256:".len()..]))?)?;
        let list = prov["image"]["layer_manifests"].as_array().context("no layer_manifests")?;
        Ok(list.iter().map(|l| l["reused"] == serde_json::json!(true)).collect())
    };

    let cold = t.path().join("cold");
    let started = std::time::Instant::now();
    let id = build_ok(&img.source(), &cold, &[])?;
    eprintln!("cold build (3 new layers): {:.2}s", started.elapsed().as_secs_f64());
    ensure!(layers(&cold, &id)? == [false, false, false], "a cold store reused a manifest");

    let warm = t.path().join("warm");
    let base_id = build_ok(&base, &warm, &[])?;
    ensure!(layers(&warm, &base_id)? == [false, false], "the base build reused a manifest");
    let started = std::time::Instant::now();
    let warm_id = build_ok(&img.source(), &warm, &[])?;
    eprintln!("warm build (2 layers reused, 1 read): {:.2}s", started.elapsed().as_secs_f64());
    ensure!(warm_id == id, "warm store gave {warm_id}, cold store {id}");
    ensure!(layers(&warm, &warm_id)? == [true, true, false], "the warm build did not reuse the base layers");
    tessera::check_store(&warm)?;

    // Every layer known: no layer is read.
    let all = t.path().join("all");
    build_ok(&img.source(), &all, &[])?;
    fs::remove_file(all.join("images").join(format!("{}.json", id.hex())))?;
    let started = std::time::Instant::now();
    let all_id = build_ok(&img.source(), &all, &[])?;
    eprintln!("hot build (3 layers reused): {:.2}s", started.elapsed().as_secs_f64());
    ensure!(all_id == id, "fully warm store gave {all_id}, cold store {id}");
    ensure!(layers(&all, &all_id)? == [true, true, true], "the hot build read a layer");

    let raw = |store: &Path, name: &str| -> Result<std::path::PathBuf> {
        let out = t.path().join(name);
        tessera::export(id.as_str(), store, &out)?;
        Ok(out)
    };
    let a = raw(&cold, "cold.raw")?;
    for (store, name) in [(&warm, "warm.raw"), (&all, "all.raw")] {
        let b = raw(store, name)?;
        let cmp = std::process::Command::new("cmp").arg(&a).arg(&b).output()?;
        ensure!(
            cmp.status.success(),
            "{name} differs from the cold export: {}",
            String::from_utf8_lossy(&cmp.stdout)
        );
    }
    Ok(())
}

/// Hostile layouts: a corrupted layer blob, a missing blob, a decompression bomb against
/// --max-size, an unknown reference, a bad platform. Each fails with exit status 1 (2 for usage)
/// and a clear message, and no image is written.
#[test]
fn hostile_layouts_fail_cleanly() -> Result<()> {
    fixtures::require_root()?;
    require_tools()?;
    let t = tmp("oci-hostile")?;
    let img = UmociImage::new(t.path(), "t")?;
    img.layer(|root| {
        fs::write(root.join("zeros"), vec![0u8; 8 << 20])?;
        Ok(())
    })?;
    let store = t.path().join("store");
    let expect_fail = |source: &str, args: &[&str], code: i32, needle: &str| -> Result<()> {
        let out = build_source(source, &store, args)?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(out.status.code() == Some(code), "{source} {args:?}: status {:?}: {stderr}", out.status);
        ensure!(stderr.contains(needle), "{source} {args:?}: expected {needle:?} in: {stderr}");
        ensure!(out.stdout.is_empty(), "stdout must be empty on failure");
        let images = store.join("images");
        ensure!(
            !images.exists() || fs::read_dir(&images)?.next().is_none(),
            "a failed build left an image entry"
        );
        Ok(())
    };
    expect_fail(&img.source(), &["--max-size", "1M"], 1, "--max-size")?;
    expect_fail(&format!("oci:{}:nope", img.layout.display()), &[], 1, "no image named \"nope\"")?;
    expect_fail(&img.source(), &["--platform", "linux"], 2, "platform")?;

    let blob = img.blob(&img.layer_digest(0)?)?;
    let good = fs::read(&blob)?;
    // The gzip header's OS byte: the stream stays valid, only the digest changes.
    let mut bad = good.clone();
    ensure!(bad.starts_with(&[0x1f, 0x8b]), "layer is not gzip");
    bad[9] ^= 0xff;
    fs::write(&blob, &bad)?;
    expect_fail(&img.source(), &[], 1, "digest mismatch")?;
    // Corrupt deflate data: whichever check fires first, it is a clear failure.
    let mut bad = good.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 0xff;
    fs::write(&blob, &bad)?;
    expect_fail(&img.source(), &[], 1, "layer 0 (sha256:")?;
    fs::remove_file(&blob)?;
    expect_fail(&img.source(), &[], 1, "is missing")?;
    fs::write(&blob, &good)?;
    build_ok(&img.source(), &store, &["--max-size", "16M"])?;
    Ok(())
}

/// A lower image for the small tests below: files, a directory and xattrs, made by umoci.
fn small_image(work: &Path) -> Result<UmociImage> {
    let img = UmociImage::new(work, "t")?;
    img.layer(|root| {
        fs::write(root.join("a"), b"lower a\n")?;
        fs::create_dir(root.join("d"))?;
        fs::write(root.join("d/f"), b"lower d/f\n")?;
        fs::write(root.join("d/g"), b"lower d/g\n")?;
        fs::write(root.join("keep"), b"keep\n")?;
        Ok(())
    })?;
    Ok(img)
}

/// A hard link whose target is a lower-layer file that the same layer whites out: the link
/// keeps the file under its new name. In tar order link-then-whiteout `umoci unpack` agrees
/// (zero differences); in the order whiteout-then-link umoci fails ("link: no such file"), but
/// the spec makes the order of whiteouts irrelevant, so tessera gives the same image ID.
#[test]
fn hard_link_to_a_whited_out_lower_file() -> Result<()> {
    fixtures::require_root()?;
    require_tools()?;
    let t = tmp("oci-hl-wh")?;
    let link_first = small_image(&t.path().join("link-first"))?;
    // One lower layer for both (its file times are those of its making).
    let whiteout_first = link_first.copy_to(&t.path().join("whiteout-first"))?;
    link_first.append_tar_layer(
        &TarWriter::default()
            .hardlink("renamed-a", "a")
            .file(".wh.a", 0o644, b"")
            .hardlink("f-from-d", "d/f")
            .file(".wh.d", 0o644, b"")
            .finish(),
    )?;
    whiteout_first.append_tar_layer(
        &TarWriter::default()
            .file(".wh.a", 0o644, b"")
            .file(".wh.d", 0o644, b"")
            .hardlink("renamed-a", "a")
            .hardlink("f-from-d", "d/f")
            .finish(),
    )?;
    let reference = link_first.unpack(&t.path().join("unpacked"))?;
    ensure!(fs::read(reference.join("renamed-a"))? == b"lower a\n", "umoci: link lost its file");
    ensure!(!reference.join("a").exists() && !reference.join("d").exists(), "umoci: whiteouts not applied");
    let umoci_other_order = std::process::Command::new("umoci")
        .args(["unpack", "--image"])
        .arg(whiteout_first.image_ref())
        .arg(t.path().join("unpacked2"))
        .output()?;
    eprintln!(
        "umoci unpack, whiteouts before the links: {} {}",
        umoci_other_order.status,
        String::from_utf8_lossy(&umoci_other_order.stderr).trim()
    );

    let store = t.path().join("store");
    let id = build_ok(&link_first.source(), &store, &[])?;
    let raw = t.path().join("image.raw");
    tessera::export(id.as_str(), &store, &raw)?;
    judge_image(&reference, &raw, |d| only_dir_mtimes(d, &reference))?;
    let other = build_ok(&whiteout_first.source(), &store, &[])?;
    ensure!(other == id, "whiteouts before the links gave {other}, after {id}");
    Ok(())
}

/// xattrs in libarchive's form: a layer written by `bsdtar --xattrs` (PAX `LIBARCHIVE.xattr.*`
/// next to `SCHILY.xattr.*`) matches `umoci unpack` with zero differences; a hand-written layer
/// with only `LIBARCHIVE.xattr.*` records (which umoci ignores) and a name that needs libarchive's
/// %-encoding keeps its xattrs exactly.
#[test]
fn libarchive_xattrs() -> Result<()> {
    fixtures::require_root()?;
    require_tools()?;
    let t = tmp("oci-libarchive")?;
    let img = small_image(t.path())?;
    let dir = t.path().join("bsdtar-src");
    fs::create_dir_all(dir.join("bin"))?;
    fs::write(dir.join("bin/tool"), b"#!/bin/sh\n")?;
    fs::write(dir.join("notes"), b"notes\n")?;
    let cap = "0x0100000200200000000000000000000000000000";
    for (file, name, value) in [
        ("bin/tool", "security.capability", cap),
        ("bin/tool", "user.binary", "0x00ff7f0a"),
        ("notes", "user.text", "hello"),
        ("notes", "trusted.t", "trusted value"),
    ] {
        run(std::process::Command::new("setfattr").args(["-n", name, "-v", value]).arg(dir.join(file)))?;
    }
    img.append_bsdtar_layer(&dir)?;
    let reference = img.unpack(&t.path().join("unpacked"))?;
    let tool = compare::entry(&reference.join("bin/tool"))?;
    ensure!(tool.xattrs.len() == 2, "umoci did not apply the SCHILY records: {tool:?}");

    let store = t.path().join("store");
    let id = build_ok(&img.source(), &store, &[])?;
    let raw = t.path().join("image.raw");
    tessera::export(id.as_str(), &store, &raw)?;
    judge_image(&reference, &raw, |d| only_dir_mtimes(d, &reference))?;

    // LIBARCHIVE records only (libarchive's unpadded base64), one name %-encoded.
    let img2 = small_image(&t.path().join("only-libarchive"))?;
    img2.append_tar_layer(
        &TarWriter::default()
            .pax(&[
                ("LIBARCHIVE.xattr.user.sp%20ace%3D%25", b"AAEC/w"),
                ("LIBARCHIVE.xattr.user.plain", b"aGVsbG8"),
            ])
            .file("x", 0o644, b"x\n")
            .finish(),
    )?;
    let id2 = build_ok(&img2.source(), &store, &[])?;
    let raw2 = t.path().join("image2.raw");
    tessera::export(id2.as_str(), &store, &raw2)?;
    tessera_e2e::judge::e2fsck(&raw2)?;
    let mnt = tessera_e2e::judge::LoopMount::ro(&raw2)?;
    let x = compare::entry(&mnt.path().join("x"))?;
    mnt.unmount()?;
    let got: Vec<(&[u8], &[u8])> = x.xattrs.iter().map(|(k, v)| (k.as_slice(), v.as_slice())).collect();
    ensure!(
        got == vec![(&b"user.plain"[..], &b"hello"[..]), (b"user.sp ace=%", b"\x00\x01\x02\xff")],
        "xattrs of x: {got:?}"
    );
    Ok(())
}

/// A docker archive holding two images (two skopeo-written archives merged into one
/// manifest.json, as `docker save IMG1 IMG2` writes): without a reference the build fails and
/// lists the choices; `docker-archive:PATH:REPO:TAG` (short or fully qualified) and `:@INDEX`
/// pick one, with the image ID of the same image from the OCI layout.
#[test]
fn docker_archive_with_several_images() -> Result<()> {
    fixtures::require_root()?;
    require_tools()?;
    let t = tmp("oci-multi-archive")?;
    let img = small_image(t.path())?;
    let store = t.path().join("store");
    img.config(&["--config.entrypoint", "/one"])?;
    let one = build_ok(&img.source(), &store, &[])?;
    let a1 = t.path().join("one.tar");
    skopeo_copy(
        &format!("oci:{}", img.image_ref()),
        &format!("docker-archive:{}:example.com/app:v1", a1.display()),
        &[],
    )?;
    img.config(&["--config.entrypoint", "/two"])?;
    let two = build_ok(&img.source(), &store, &[])?;
    ensure!(one != two, "the two images must differ");
    let a2 = t.path().join("two.tar");
    skopeo_copy(
        &format!("oci:{}", img.image_ref()),
        &format!("docker-archive:{}:app:v2", a2.display()),
        &[],
    )?;

    // Merge: both archives' members in one directory (shared layers have the same names and
    // bytes), manifest.json = both lists.
    let merged_dir = t.path().join("merged");
    fs::create_dir_all(&merged_dir)?;
    let mut manifests = Vec::new();
    for a in [&a1, &a2] {
        run(std::process::Command::new("tar").arg("-xf").arg(a).arg("-C").arg(&merged_dir))?;
        let m: serde_json::Value = serde_json::from_slice(&fs::read(merged_dir.join("manifest.json"))?)?;
        manifests.extend(m.as_array().context("manifest.json is not a list")?.iter().cloned());
    }
    fs::write(merged_dir.join("manifest.json"), serde_json::to_vec(&manifests)?)?;
    let merged = t.path().join("merged.tar");
    run(std::process::Command::new("tar").arg("-cf").arg(&merged).arg("-C").arg(&merged_dir).arg("."))?;
    let src = format!("docker-archive:{}", merged.display());

    let out = build_source(&src, &store, &[])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.code() == Some(1) && out.stdout.is_empty(), "no reference must fail: {stderr}");
    ensure!(
        stderr.contains("2 images")
            && stderr.contains("example.com/app:v1")
            && stderr.contains("docker.io/library/app:v2"),
        "the error must list the choices: {stderr}"
    );
    for (reference, want) in [
        ("example.com/app:v1", &one),
        ("app:v2", &two),
        ("docker.io/library/app:v2", &two),
        ("@0", &one),
        ("@1", &two),
    ] {
        let got = build_ok(&format!("{src}:{reference}"), &store, &[])?;
        ensure!(got == *want, "{reference}: got {got}, want {want}");
    }
    let out = build_source(&format!("{src}:app:v3"), &store, &[])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.code() == Some(1), "unknown tag must fail: {stderr}");
    ensure!(stderr.contains("\"app:v3\"") && stderr.contains("example.com/app:v1"), "{stderr}");
    Ok(())
}

/// Symlink modes: symlink(2) takes no mode, so every Linux extractor makes symlinks 0777 whatever
/// the tar header says. Layers written by Python's `tarfile` (0644 by default, and 04755 when
/// asked), GNU tar (`--mode=0644`) and bsdtar (an mtree spec with `mode=0640`) give 0777 symlinks
/// in the image, and the image matches `umoci unpack` with zero differences.
#[test]
fn symlink_modes_match_umoci_unpack() -> Result<()> {
    fixtures::require_root()?;
    require_tools()?;
    let t = tmp("oci-symlink-modes")?;
    let img = small_image(t.path())?;
    // Python's tarfile: TarInfo's default mode is 0644.
    let py = t.path().join("py.tar");
    run(std::process::Command::new("python3")
        .arg("-c")
        .arg(
            "import sys, tarfile\n\
         t = tarfile.open(sys.argv[1], 'w', format=tarfile.PAX_FORMAT)\n\
         for name, mode in (('py-default', None), ('py-setuid', 0o4755)):\n\
         \x20   i = tarfile.TarInfo(name); i.type = tarfile.SYMTYPE; i.linkname = 'a'\n\
         \x20   if mode is not None: i.mode = mode\n\
         \x20   t.addfile(i)\n\
         t.close()\n",
        )
        .arg(&py))?;
    img.append_tar_layer(&fs::read(&py)?)?;
    // GNU tar, every member's mode overridden.
    let gdir = t.path().join("gnu-src");
    fs::create_dir_all(&gdir)?;
    std::os::unix::fs::symlink("a", gdir.join("gnu-link"))?;
    fs::write(gdir.join("gnu-file"), b"gnu\n")?;
    let gnu = std::process::Command::new("tar")
        .args(["--format=posix", "--numeric-owner", "--mode=0644", "-C"])
        .arg(&gdir)
        .args(["-cf", "-", "gnu-link", "gnu-file"])
        .output()?;
    ensure!(gnu.status.success(), "tar: {}", String::from_utf8_lossy(&gnu.stderr));
    img.append_tar_layer(&gnu.stdout)?;
    // bsdtar from an mtree spec (no file on disk needed for a link).
    let spec = t.path().join("spec.mtree");
    fs::write(&spec, "#mtree\n./bsd-link type=link link=keep mode=0640 uid=0 gid=0 time=1700000000.0\n")?;
    let bsd = std::process::Command::new("bsdtar")
        .args(["--format", "pax", "-cf", "-"])
        .arg(format!("@{}", spec.display()))
        .output()
        .context("bsdtar (Debian package libarchive-tools)")?;
    ensure!(bsd.status.success(), "bsdtar: {}", String::from_utf8_lossy(&bsd.stderr));
    img.append_tar_layer(&bsd.stdout)?;

    let names = ["py-default", "py-setuid", "gnu-link", "bsd-link"];
    let reference = img.unpack(&t.path().join("unpacked"))?;
    for n in names {
        let e = compare::entry(&reference.join(n))?;
        ensure!(e.kind == Kind::Symlink && e.perm == 0o777, "umoci unpack's {n}: {e:?}");
    }
    ensure!(compare::entry(&reference.join("gnu-file"))?.perm == 0o644, "GNU tar --mode not applied");

    let store = t.path().join("store");
    let id = build_ok(&img.source(), &store, &[])?;
    let raw = t.path().join("image.raw");
    tessera::export(id.as_str(), &store, &raw)?;
    let mnt = tessera_e2e::judge::LoopMount::ro(&raw)?;
    for n in names {
        let e = compare::entry(&mnt.path().join(n))?;
        ensure!(e.kind == Kind::Symlink && e.perm == 0o777, "the image's {n}: {e:?}");
    }
    mnt.unmount()?;
    judge_image(&reference, &raw, |d| only_dir_mtimes(d, &reference))?;
    Ok(())
}

/// A tar with one regular file `name` whose header declares `size` bytes (GNU base-256 when it
/// does not fit in octal) and carries none of them.
fn tar_declaring(name: &str, size: u64) -> Vec<u8> {
    let mut tar = TarWriter::default().file(name, 0o644, b"").finish();
    let field = &mut tar[124..136];
    field.fill(0);
    field[0] = 0x80;
    field[4..].copy_from_slice(&size.to_be_bytes());
    tar[148..156].fill(b' ');
    let sum: u32 = tar[..512].iter().map(|&b| u32::from(b)).sum();
    tar[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
    tar
}

/// `tessera build SOURCE --store STORE ARGS` under GNU time: (exit code, stderr, peak RSS
/// bytes, wall time). Unlike `tessera::run_peak_rss`, the build may fail.
fn build_measured(source: &str, store: &Path, args: &[&str]) -> Result<(Option<i32>, String, u64, Duration)> {
    let dir = tempfile::tempdir()?;
    let (rss, err) = (dir.path().join("rss"), dir.path().join("stderr"));
    let t = Instant::now();
    let status = std::process::Command::new("/usr/bin/time")
        .args(["-f", "%M", "-o"])
        .arg(&rss)
        .arg(tessera::tessera_bin())
        .args(["build", source, "--store"])
        .arg(store)
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(fs::File::create(&err)?)
        .status()
        .context("running tessera build under /usr/bin/time (Debian package time)")?;
    let took = t.elapsed();
    let kib: u64 =
        fs::read_to_string(&rss)?.lines().last().unwrap_or("").trim().parse().context("GNU time's %M")?;
    Ok((status.code(), fs::read_to_string(&err)?, kib * 1024, took))
}

/// Every file name under `dir`, recursively (what a build must not add to outside its store).
fn names_under(dir: &Path, skip: &Path) -> Result<Vec<std::path::PathBuf>> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir)? {
        let p = e?.path();
        if p == skip {
            continue;
        }
        if p.is_dir() && !p.is_symlink() {
            out.extend(names_under(&p, skip)?);
        }
        out.push(p);
    }
    out.sort();
    Ok(out)
}

/// Hostile OCI layers through the whole command (issue 13's matrix row): path traversal, a
/// symlink escape, a hard link outside, an absurd size header, an absurd PAX record, a name
/// component ext4 cannot hold, and zstd and gzip bombs against `--max-size`. Each build fails
/// with exit status 1 and a message saying what is wrong, leaves no image and writes nothing
/// outside its store, within 30 s and 256 MiB of peak RSS (the build bound).
#[test]
fn hostile_layers_fail_cleanly_within_bounds() -> Result<()> {
    fixtures::require_root()?;
    require_tools()?;
    let t = tmp("oci-hostile-layers")?;
    const RSS_BOUND: u64 = 256 << 20;
    const TIME_BOUND: Duration = Duration::from_secs(30);
    let long = "n".repeat(300);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("path traversal", TarWriter::default().file("../escape", 0o644, b"x").finish(), ".."),
        (
            "symlink escape",
            TarWriter::default()
                .symlink("s", "/etc")
                .file("s/passwd", 0o644, b"root::0:0::/:/bin/sh\n")
                .finish(),
            "symlink",
        ),
        ("hard link outside", TarWriter::default().hardlink("h", "../../etc/shadow").finish(), ".."),
        ("size header of 2^62 bytes", tar_declaring("huge", 1 << 62), "layer 1 (sha256:"),
        (
            "PAX record claiming 99 GB",
            {
                // A PAX header whose one record says it is 99 999 999 999 bytes long.
                let mut tar = TarWriter::default().pax(&[("path", b"p")]).file("p", 0o644, b"").finish();
                let record = b"99999999999 path=p\n";
                tar[512..1024].fill(0);
                tar[512..512 + record.len()].copy_from_slice(record);
                tar[124..136].copy_from_slice(format!("{:011o}\0", record.len()).as_bytes());
                tar[148..156].fill(b' ');
                let sum: u32 = tar[..512].iter().map(|&b| u32::from(b)).sum();
                tar[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
                tar
            },
            "layer 1 (sha256:",
        ),
        (
            "a 300-byte name",
            TarWriter::default().pax(&[("path", long.as_bytes())]).file("x", 0o644, b"").finish(),
            "255",
        ),
    ];
    let mut figures = Vec::new();
    for (i, (what, tar, needle)) in cases.into_iter().enumerate() {
        let img = UmociImage::new(&t.path().join(format!("case{i}")), "t")?;
        img.layer(|root| Ok(fs::write(root.join("keep"), b"keep\n")?))?;
        img.append_tar_layer(&tar)?;
        let store = t.path().join(format!("store{i}"));
        let before = names_under(t.path(), &store)?;
        let (code, stderr, rss, took) = build_measured(&img.source(), &store, &[])?;
        ensure!(code == Some(1), "{what}: exit {code:?}, expected 1: {stderr}");
        ensure!(stderr.contains(needle), "{what}: expected {needle:?} in: {stderr}");
        ensure!(rss <= RSS_BOUND && took <= TIME_BOUND, "{what}: {} MiB, {took:?}", rss >> 20);
        let images = store.join("images");
        ensure!(
            !images.exists() || fs::read_dir(&images)?.next().is_none(),
            "{what}: an image entry was left"
        );
        ensure!(names_under(t.path(), &store)? == before, "{what}: the build wrote outside its store");
        figures.push(format!("{what}: {} ms, {} MiB, {:?}", took.as_millis(), rss >> 20, stderr.trim()));
    }
    // Bombs: 128 MiB of zeros in a layer of a few hundred KiB, gzip (umoci) and zstd (skopeo),
    // against --max-size 16M.
    let img = UmociImage::new(&t.path().join("bomb"), "t")?;
    img.layer(|root| {
        let f = fs::File::create(root.join("zeros"))?;
        // Written, not sparse: umoci reads every byte into the layer.
        let block = vec![0u8; 1 << 20];
        let mut w = std::io::BufWriter::new(f);
        for _ in 0..128 {
            std::io::Write::write_all(&mut w, &block)?;
        }
        Ok(())
    })?;
    let zstd = t.path().join("bomb-zstd");
    skopeo_copy(
        &format!("oci:{}:t", img.layout.display()),
        &format!("oci:{}:t", zstd.display()),
        &["--dest-compress-format", "zstd"],
    )?;
    for (what, source) in [("gzip bomb", img.source()), ("zstd bomb", format!("oci:{}:t", zstd.display()))] {
        let blob_bytes: u64 = fs::read_dir(
            Path::new(source.trim_start_matches("oci:").trim_end_matches(":t")).join("blobs/sha256"),
        )?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .max()
        .unwrap_or(0);
        ensure!(blob_bytes < 4 << 20, "{what}: the largest blob is {blob_bytes} bytes, not a bomb");
        let store = t.path().join(format!("store-{}", what.replace(' ', "-")));
        let (code, stderr, rss, took) = build_measured(&source, &store, &["--max-size", "16M"])?;
        ensure!(code == Some(1), "{what}: exit {code:?}, expected 1: {stderr}");
        ensure!(stderr.contains("--max-size"), "{what}: expected --max-size in: {stderr}");
        ensure!(rss <= RSS_BOUND && took <= TIME_BOUND, "{what}: {} MiB, {took:?}", rss >> 20);
        figures.push(format!("{what}: {} ms, {} MiB, {:?}", took.as_millis(), rss >> 20, stderr.trim()));
    }
    eprintln!(
        "hostile layers: each exit 1 with a clear message, no image, nothing outside the store —\n{}",
        figures.join("\n")
    );
    Ok(())
}
