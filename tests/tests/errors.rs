//! Errors: one clear message naming the path or reference, exit 1; usage errors exit 2.
//! (A name over 255 bytes cannot exist on Linux — the kernel refuses to create it — so that
//! case is for OCI sources and is not tested here.)

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Output;

use anyhow::{ensure, Result};
use tessera_e2e::judge::TmpfsMount;
use tessera_e2e::testutil::tmp;
use tessera_e2e::{fixtures, tessera};

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn expect(o: &Output, code: i32, mentions: &[&str], what: &str) -> Result<()> {
    let e = stderr(o);
    ensure!(o.status.code() == Some(code), "{what}: expected exit {code}, got {} (stderr: {e})", o.status);
    if code != 0 {
        ensure!(
            o.stdout.is_empty(),
            "{what}: stdout must be empty on failure: {:?}",
            String::from_utf8_lossy(&o.stdout)
        );
    }
    for m in mentions {
        ensure!(e.contains(m), "{what}: stderr does not mention {m:?}: {e}");
    }
    Ok(())
}

fn small_tree(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("hello"), b"hello\n")?;
    Ok(())
}

fn build_args<'a>(src: &'a Path, store: &'a Path) -> Vec<&'a std::ffi::OsStr> {
    vec!["build".as_ref(), src.as_os_str(), "--store".as_ref(), store.as_os_str()]
}

#[test]
fn unknown_tag_and_image() -> Result<()> {
    let t = tmp("err-ref")?;
    let (src, store) = (t.path().join("src"), t.path().join("store"));
    small_tree(&src)?;
    tessera::build(&src, &store, &["--tag", "known"])?;
    let s = store.as_os_str();
    for cmd in ["inspect", "export"] {
        let out = t.path().join("x.raw");
        let mut args: Vec<&std::ffi::OsStr> =
            vec![cmd.as_ref(), "no-such-tag".as_ref(), "--store".as_ref(), s];
        if cmd == "export" {
            args.extend(["-o".as_ref(), out.as_os_str()]);
        }
        expect(&tessera::run(&args)?, 1, &["no-such-tag"], &format!("{cmd} unknown tag"))?;
        let zero = format!("sha256:{}", "0".repeat(64));
        args[1] = zero.as_ref();
        expect(&tessera::run(&args)?, 1, &["0000000000"], &format!("{cmd} unknown image"))?;
    }
    Ok(())
}

#[test]
fn usage_errors_exit_2() -> Result<()> {
    let t = tmp("err-usage")?;
    let (src, store) = (t.path().join("src"), t.path().join("store"));
    small_tree(&src)?;
    let cases: &[(&str, &[&str])] = &[
        ("unknown flag", &["--no-such-flag"]),
        ("chunk size not a power of two", &["--chunk-size", "96K"]),
        ("chunk size too small", &["--chunk-size", "4K"]),
        ("chunk size too large", &["--chunk-size", "32M"]),
        ("size not a size", &["--size", "banana"]),
        ("--size with --free", &["--size", "1G", "--free", "1G"]),
        ("inodes not a number", &["--inodes", "many"]),
        ("bad tag", &["--tag", "bad/tag"]),
    ];
    for (what, extra) in cases {
        let mut a = build_args(&src, &store);
        a.extend(extra.iter().map(|s| std::ffi::OsStr::new(*s)));
        expect(&tessera::run(&a)?, 2, &[], what)?;
    }
    expect(&tessera::run(["build".as_ref(), src.as_os_str()])?, 2, &[], "build without --store")?;
    expect(&tessera::run(["no-such-command"])?, 2, &[], "unknown subcommand")?;
    expect(&tessera::run(["export", "x", "--store", "/nonexistent"])?, 2, &[], "export without -o")?;
    Ok(())
}

#[test]
fn missing_source_names_the_path() -> Result<()> {
    let t = tmp("err-missing")?;
    let src = t.path().join("does-not-exist");
    let store = t.path().join("store");
    expect(&tessera::run(build_args(&src, &store))?, 1, &["does-not-exist"], "missing source")
}

/// Root reads everything, so the unreadable cases run the build as `nobody` (65534), from a
/// copy of the binary in a world-readable temporary directory (the checkout may live under a
/// directory `nobody` cannot enter, e.g. /root).
fn build_as_nobody(bin: &Path, src: &Path, store: &Path) -> Result<Output> {
    use std::os::unix::process::CommandExt;
    let mut c = std::process::Command::new(bin);
    c.args(build_args(src, store)).stdin(std::process::Stdio::null()).uid(65534).gid(65534);
    Ok(c.output()?)
}

fn chown_tree(p: &Path, uid: u32) -> Result<()> {
    for e in tessera_e2e::compare::walk(p)?.keys() {
        std::os::unix::fs::lchown(tessera_e2e::compare::join(p, e), Some(uid), Some(uid))?;
    }
    Ok(())
}

#[test]
fn unreadable_file_and_dir_name_the_path() -> Result<()> {
    fixtures::require_root()?;
    let t = tempfile::Builder::new().prefix("tessera-err-unreadable-").tempdir()?;
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755))?;
    let bin = t.path().join("tessera");
    std::fs::copy(tessera::tessera_bin(), &bin)?;
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755))?;
    let store = t.path().join("store");
    std::fs::create_dir(&store)?;
    chown_tree(&store, 65534)?;
    // A file nobody can read.
    let src = t.path().join("src");
    small_tree(&src)?;
    std::fs::write(src.join("secret-file"), b"secret")?;
    chown_tree(&src, 65534)?;
    std::os::unix::fs::lchown(src.join("secret-file"), Some(0), Some(0))?;
    std::fs::set_permissions(src.join("secret-file"), std::fs::Permissions::from_mode(0o600))?;
    expect(&build_as_nobody(&bin, &src, &store)?, 1, &["secret-file"], "unreadable file")?;
    // A directory nobody can list.
    let src2 = t.path().join("src2");
    small_tree(&src2)?;
    std::fs::create_dir(src2.join("locked-dir"))?;
    std::fs::write(src2.join("locked-dir/inside"), b"x")?;
    chown_tree(&src2, 65534)?;
    std::os::unix::fs::lchown(src2.join("locked-dir"), Some(0), Some(0))?;
    std::fs::set_permissions(src2.join("locked-dir"), std::fs::Permissions::from_mode(0o700))?;
    expect(&build_as_nobody(&bin, &src2, &store)?, 1, &["locked-dir"], "unreadable directory")?;
    // And nothing that looks like an image was left behind.
    let images = store.join("images");
    let n = std::fs::read_dir(&images).map(|d| d.count()).unwrap_or(0);
    ensure!(n == 0, "failed builds left {n} image entries");
    Ok(())
}

#[test]
fn lost_found_not_a_directory() -> Result<()> {
    let t = tmp("err-lf")?;
    let (src, store) = (t.path().join("src"), t.path().join("store"));
    small_tree(&src)?;
    std::fs::write(src.join("lost+found"), b"not a dir")?;
    expect(&tessera::run(build_args(&src, &store))?, 1, &["lost+found"], "lost+found file")
}

#[test]
fn file_beyond_ext4_limits() -> Result<()> {
    fixtures::require_root()?;
    // The host's ext4 cannot hold a file over 16 TiB; tmpfs can (sparse).
    let fs = TmpfsMount::new("16M")?;
    let src = fs.path().join("src");
    small_tree(&src)?;
    let f = std::fs::File::create(src.join("too-big"))?;
    f.set_len(16 << 40)?; // 16 TiB: over ext4's 16 TiB - 4 KiB with 4 KiB blocks
    drop(f);
    let t = tmp("err-big")?;
    let store = t.path().join("store");
    expect(&tessera::run(build_args(&src, &store))?, 1, &["too-big"], "file over 16 TiB")
}

#[test]
fn full_store() -> Result<()> {
    fixtures::require_root()?;
    let fs = TmpfsMount::new("2M")?;
    let t = tmp("err-full")?;
    let src = t.path().join("src");
    small_tree(&src)?;
    // Several 32 MiB chunking batches, so the pack writer fails while batches are still fed:
    // the error must still be the writer's (no space), not that it stopped.
    let mut rng = tessera_e2e::prng::Prng::from_label("full-store");
    for i in 0..5 {
        std::fs::write(src.join(format!("random{i}")), rng.bytes(16 << 20))?;
    }
    let store = fs.path().join("store");
    let o = tessera::run(build_args(&src, &store))?;
    expect(&o, 1, &[], "full store")?;
    let e = stderr(&o);
    ensure!(
        e.contains(&*fs.path().to_string_lossy()) || e.to_lowercase().contains("space"),
        "full store: the message names neither the store nor the lack of space: {e}"
    );
    let n = std::fs::read_dir(store.join("images")).map(|d| d.count()).unwrap_or(0);
    ensure!(n == 0, "a failed build left {n} image entries in the full store");
    Ok(())
}

/// The store fills up while the metadata prefix is written (on the compressor's own thread, as
/// ext4 is synthesized): no file data, so the prefix — each inode carrying an incompressible
/// in-inode xattr — is the build's first large write.
#[test]
fn full_store_while_the_prefix_is_written() -> Result<()> {
    fixtures::require_root()?;
    let fs = TmpfsMount::new("256K")?;
    let t = tmp("err-full-prefix")?;
    let src = t.path().join("src");
    std::fs::create_dir_all(&src)?;
    let mut rng = tessera_e2e::prng::Prng::from_label("full-prefix");
    // ~500 KB of random xattr values against 256 KiB of space.
    for i in 0..8000 {
        let file = src.join(format!("empty{i:04}"));
        std::fs::write(&file, b"")?;
        rustix::fs::lsetxattr(&file, "user.noise", &rng.bytes(64), rustix::fs::XattrFlags::empty())?;
    }
    let store = fs.path().join("store");
    let o = tessera::run(build_args(&src, &store))?;
    // (Where the prefix's last bytes fail — in the compressor's writes, or in the flush of its
    // blob's buffer at the commit — decides whether it says "write prefix" or "write blob".)
    expect(&o, 1, &[], "full store while the prefix is written")?;
    let e = stderr(&o);
    ensure!(
        e.contains(&*fs.path().to_string_lossy()) && e.to_lowercase().contains("full"),
        "the message names neither the store nor that it is full: {e}"
    );
    // The prefix, not a later write, must be what found the store full: no blob of its size
    // (hundreds of KB; the pack index of files without data is a few bytes) was committed. With
    // less noise the prefix fits and the record or the entry fails instead.
    let blobs: Vec<u64> = std::fs::read_dir(store.join("blobs/sha256"))?
        .map(|b| Ok(b?.metadata()?.len()))
        .collect::<Result<_>>()?;
    ensure!(blobs.iter().all(|&len| len < 64 << 10), "the prefix was committed ({blobs:?}): {e}");
    let n = std::fs::read_dir(store.join("images")).map(|d| d.count()).unwrap_or(0);
    ensure!(n == 0, "a failed build left {n} image entries in the full store");
    let left: Vec<_> = std::fs::read_dir(store.join("tmp"))?.collect::<Result<_, _>>()?;
    ensure!(left.is_empty(), "a failed build left temp files: {left:?}");
    Ok(())
}

#[test]
fn read_only_store() -> Result<()> {
    fixtures::require_root()?;
    let fs = TmpfsMount::new("16M")?;
    let t = tmp("err-ro")?;
    let src = t.path().join("src");
    small_tree(&src)?;
    let store = fs.path().join("store");
    // A valid store with one image, then the filesystem goes read-only.
    let id = tessera::build(&src, &store, &["--tag", "before"])?;
    fs.remount_ro()?;
    std::fs::write(src.join("more"), b"more")?;
    expect(&tessera::run(build_args(&src, &store))?, 1, &[&*fs.path().to_string_lossy()], "read-only store")?;
    // Reading still works.
    let v = tessera::inspect_json("before", &store)?;
    tessera::check_inspect(&v, &id)?;
    Ok(())
}
