//! `tessera store gc`: mark from the tags, sweep what nothing live references and is older than
//! the grace — on a local store (untagged images after a tag moved, an interrupted build's
//! blob, a dry run, `--json`, the grace; gc with grace 0 in a loop racing a build that reuses
//! the chunks of an image gc is collecting: the built image exports byte-identically to a build
//! into a fresh store and is e2fsck-clean) and on an `s3://` store (`rclone serve s3`: the
//! minimum grace, objects aged past it, the tagged image still exporting byte for byte).

use std::fs;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{ensure, Context, Result};
use tessera_e2e::judge::e2fsck;
use tessera_e2e::prng::Prng;
use tessera_e2e::registry::Registry;
use tessera_e2e::s3::{S3Server, ACCESS_KEY_ID, SECRET_ACCESS_KEY};
use tessera_e2e::tessera::{self, check_store};
use tessera_e2e::testutil::tmp;

fn s(p: &Path) -> Result<&str> {
    p.to_str().context("utf-8 path")
}

fn ok(o: Output, what: &str) -> Result<Output> {
    ensure!(o.status.success(), "{what}: {} — {}", o.status, String::from_utf8_lossy(&o.stderr));
    Ok(o)
}

fn json(o: &Output) -> Result<serde_json::Value> {
    serde_json::from_slice(&o.stdout).with_context(|| String::from_utf8_lossy(&o.stdout).into_owned())
}

/// A tree of `files` small text files and one incompressible file, from `label`.
fn tree(dir: &Path, label: &str, files: usize, big: usize) -> Result<()> {
    let mut rng = Prng::from_label(label);
    fs::create_dir_all(dir.join("etc"))?;
    for i in 0..files {
        fs::write(dir.join(format!("etc/f{i}")), rng.text(3000))?;
    }
    fs::write(dir.join("big.bin"), rng.bytes(big))?;
    Ok(())
}

fn gc(store: &str, args: &[&str]) -> Result<Output> {
    let mut all = vec!["store", "gc", "--store", store];
    all.extend_from_slice(args);
    tessera::run(all)
}

fn export(image: &str, store: &Path, out: &Path) -> Result<Vec<u8>> {
    tessera::export(image, store, out)?;
    Ok(fs::read(out)?)
}

#[test]
fn local_gc_keeps_tagged_images_removes_the_rest_and_survives_a_racing_build() -> Result<()> {
    let t = tmp("store-gc")?;
    let store = t.path().join("store");
    let st = s(&store)?;
    let (a, b, c) = (t.path().join("a"), t.path().join("b"), t.path().join("c"));
    tree(&a, "gc-a", 20, 300_000)?;
    tree(&b, "gc-b", 20, 300_000)?;
    tree(&c, "gc-c", 5, 100_000)?;
    let old = tessera::build(&a, &store, &["--tag", "web", "--chunk-size", "64K"])?;
    let web = tessera::build(&b, &store, &["--tag", "web", "--chunk-size", "64K"])?;
    let untagged = tessera::build(&c, &store, &["--chunk-size", "64K"])?;
    // What an interrupted build leaves: a blob nothing names.
    let orphan = b"an interrupted build's pack";
    let orphan_hex = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(orphan));
    fs::write(store.join("blobs/sha256").join(&orphan_hex), orphan)?;
    let web_raw = export("web", &store, &t.path().join("web.raw"))?;

    // Everything is younger than the default grace (1h): nothing goes.
    let r = json(&ok(gc(st, &["--json"])?, "gc")?)?;
    ensure!(r["removed_total"]["count"] == 0 && r["images_kept"] == 3, "{r}");
    ensure!(r["young"]["count"].as_u64() >= Some(3), "{r}");
    // A dry run with grace 0 says what would go and removes nothing.
    let before = fs::read_dir(store.join("blobs/sha256"))?.count();
    let dry = json(&ok(gc(st, &["--grace", "0", "--dry-run", "--json"])?, "gc --dry-run")?)?;
    ensure!(dry["dry_run"] == true && dry["images_removed"] == 2 && dry["images_kept"] == 1, "{dry}");
    let keys: Vec<&str> =
        dry["objects"].as_array().context("objects")?.iter().filter_map(|o| o["key"].as_str()).collect();
    for id in [&old, &untagged] {
        ensure!(keys.contains(&format!("images/{}.json", id.hex()).as_str()), "{id} not listed: {dry}");
    }
    ensure!(keys.contains(&format!("blobs/sha256/{orphan_hex}").as_str()), "orphan not listed: {dry}");
    ensure!(!keys.iter().any(|k| k.contains(web.hex())), "the tagged image listed: {dry}");
    ensure!(
        dry["removed"]["unreferenced"]["count"] == 1 && dry["removed"]["pack"]["count"].as_u64() >= Some(1),
        "{dry}"
    );
    ensure!(
        dry["removed"]["source-record"]["count"] == 2 && dry["removed"]["source-index"]["count"] == 2,
        "the untagged images' source records and indexes: {dry}"
    );
    ensure!(fs::read_dir(store.join("blobs/sha256"))?.count() == before, "a dry run removed something");

    // Grace 0: the untagged images and the orphan go; the tagged image stays whole.
    let o = ok(gc(st, &["--grace", "0"])?, "gc --grace 0")?;
    let text = String::from_utf8_lossy(&o.stdout);
    ensure!(text.starts_with("Removed 2 images, 0 tags, ") && text.contains("Kept 1 image"), "{text}");
    ensure!(text.contains("KiB") || text.contains("MiB"), "human-readable sizes: {text}");
    for id in [&old, &untagged] {
        let o = tessera::run(["inspect", id.as_str(), "--store", st])?;
        ensure!(o.status.code() == Some(1), "{id} is gone: {}", o.status);
    }
    ensure!(!store.join("blobs/sha256").join(&orphan_hex).exists(), "orphan kept");
    // The source records of directory builds (issue 12, point 6) and their indexes live as long
    // as their image: of the three trees' only web's are left.
    let mut sources: Vec<std::path::PathBuf> =
        fs::read_dir(store.join("sources"))?.map(|e| Ok(e?.path())).collect::<Result<_>>()?;
    sources.sort();
    ensure!(sources.len() == 2, "source records and indexes after gc: {sources:?}");
    ensure!(
        sources[0].with_extension("json") == sources[1]
            && fs::read_to_string(&sources[1])?.contains(web.hex()),
        "web's record and index: {sources:?}"
    );
    check_store(&store)?;
    ensure!(export("web", &store, &t.path().join("web2.raw"))? == web_raw, "web changed after gc");
    let again = json(&ok(gc(st, &["--grace", "0", "--json"])?, "gc again")?)?;
    ensure!(again["removed_total"]["count"] == 0, "a second gc found more: {again}");

    // The race: an image D, then a build of D plus more (reusing D's chunks, found before the
    // build writes anything) tagged `race`, while gc with grace 0 runs in a loop; D's tag is
    // removed as the build starts, so D is garbage for every gc run from then on. Without the
    // writer lock a gc between the build's scan and its pack index would delete packs the new
    // image names.
    let d = t.path().join("d");
    tree(&d, "gc-d", 500, 3_000_000)?;
    let dead = tessera::build(&d, &store, &["--tag", "d", "--chunk-size", "64K"])?;
    let mut rng = Prng::from_label("gc-race");
    for i in 0..200 {
        fs::write(d.join(format!("etc/new{i}")), rng.text(3000))?;
    }
    let mut build = tessera::command([
        "build".as_ref(),
        d.as_os_str(),
        "--store".as_ref(),
        store.as_os_str(),
        "--tag".as_ref(),
        "race".as_ref(),
        "--chunk-size".as_ref(),
        "64K".as_ref(),
    ]);
    // gc with grace 0 in a loop on its own thread from before the build starts until after it
    // ends: each run's (start, end) and report.
    let stop = Arc::new(AtomicBool::new(false));
    let runs: Arc<Mutex<Vec<(Instant, Instant, serde_json::Value)>>> = Arc::default();
    let looper = {
        let (stop, runs, st) = (Arc::clone(&stop), Arc::clone(&runs), st.to_owned());
        std::thread::spawn(move || -> Result<()> {
            while !stop.load(Ordering::Relaxed) {
                let start = Instant::now();
                let r = json(&ok(gc(&st, &["--grace", "0", "--json"])?, "gc during the build")?)?;
                runs.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.push((start, Instant::now(), r));
            }
            Ok(())
        })
    };
    while runs.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.is_empty() {
        std::thread::sleep(Duration::from_millis(5));
    }
    let (bout, berr) = (t.path().join("build.out"), t.path().join("build.err"));
    let started = Instant::now();
    let mut child = build.stdout(fs::File::create(&bout)?).stderr(fs::File::create(&berr)?).spawn()?;
    fs::remove_file(store.join("refs/d"))?;
    let status = child.wait()?;
    let ended = Instant::now();
    std::thread::sleep(Duration::from_millis(50));
    stop.store(true, Ordering::Relaxed);
    looper.join().map_err(|_| anyhow::anyhow!("the gc loop panicked"))??;
    ensure!(status.success(), "racing build: {status} — {}", fs::read_to_string(&berr)?);
    let built = tessera::parse_build_stdout(&fs::read(&bout)?)?;
    let runs = runs.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
    let overlapping = runs.iter().filter(|(a, b, _)| *a < ended && *b > started).count();
    eprintln!(
        "{} gc runs, {overlapping} overlapping a {:.2} s build",
        runs.len(),
        (ended - started).as_secs_f64()
    );
    ensure!(overlapping >= 1, "no gc run overlapped the build");
    let mut removed_dead = runs.iter().any(|(_, _, r)| {
        r["objects"]
            .as_array()
            .is_some_and(|l| l.iter().any(|o| o["key"] == format!("images/{}.json", dead.hex())))
    });
    let r = json(&ok(gc(st, &["--grace", "0", "--json"])?, "gc after the build")?)?;
    removed_dead |= r["objects"]
        .as_array()
        .is_some_and(|l| l.iter().any(|o| o["key"] == format!("images/{}.json", dead.hex())));
    ensure!(removed_dead, "the untagged image D was never collected");
    check_store(&store)?;
    // The same tree into a fresh store: the same image, byte for byte.
    let fresh = t.path().join("fresh");
    let expected = tessera::build(&d, &fresh, &["--chunk-size", "64K"])?;
    ensure!(built == expected, "racing build {built}, fresh build {expected}");
    let raced = t.path().join("race.raw");
    let got = export("race", &store, &raced)?;
    ensure!(got == export(expected.as_str(), &fresh, &t.path().join("fresh.raw"))?, "raced image differs");
    e2fsck(&raced)?;
    ensure!(export("web", &store, &t.path().join("web3.raw"))? == web_raw, "web changed");
    Ok(())
}

/// `tessera ARGS --s3-endpoint …` with the server's keys.
fn s3(server: &S3Server, args: &[&str]) -> Command {
    let mut c = tessera::command(args);
    c.args(["--s3-endpoint", &server.endpoint()]);
    for v in ["AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"] {
        c.env_remove(v);
    }
    c.env("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID).env("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY);
    c.env("HOME", "/nonexistent").env("TESSERA_HTTP_RETRIES", "2");
    c
}

fn age_all(dir: &Path, by: Duration) -> Result<()> {
    let when = SystemTime::now() - by;
    for e in fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_dir() {
            age_all(&p, by)?;
        } else {
            fs::File::options().write(true).open(&p)?.set_modified(when)?;
        }
    }
    Ok(())
}

#[test]
fn s3_gc_removes_an_untagged_image_once_older_than_the_grace() -> Result<()> {
    let t = tmp("store-gc-s3")?;
    let store = t.path().join("store");
    let (a, b) = (t.path().join("a"), t.path().join("b"));
    tree(&a, "gc-s3-a", 10, 200_000)?;
    tree(&b, "gc-s3-b", 10, 200_000)?;
    tessera::build(&a, &store, &["--tag", "demo", "--chunk-size", "64K"])?;
    let untagged = tessera::build(&b, &store, &["--chunk-size", "64K"])?;
    let local_raw = export("demo", &store, &t.path().join("local.raw"))?;
    let mut server = S3Server::start(&["gcbkt"])?;
    let dest = "s3://gcbkt/p";
    for image in ["demo", untagged.as_str()] {
        ok(s3(&server, &["copy", image, "--store", s(&store)?, "--to", dest]).output()?, "copy")?;
    }
    // No writer lock on S3: a grace below 10 minutes is refused (exit 2).
    let o = s3(&server, &["store", "gc", "--store", dest, "--grace", "0"]).output()?;
    ensure!(o.status.code() == Some(2), "grace 0 on s3: {} {}", o.status, String::from_utf8_lossy(&o.stderr));
    let r = json(&ok(
        s3(&server, &["store", "gc", "--store", dest, "--grace", "10m", "--json"]).output()?,
        "gc",
    )?)?;
    ensure!(r["removed_total"]["count"] == 0 && r["images_kept"] == 2, "all young: {r}");
    // Two hours later (rclone reports the files' mtimes; a restart forgets its cached listing).
    let root = server.root().join("gcbkt/p");
    age_all(&root, Duration::from_secs(7200))?;
    server.restart()?;
    let r = json(&ok(s3(&server, &["store", "gc", "--store", dest, "--json"]).output()?, "gc aged")?)?;
    ensure!(r["images_removed"] == 1 && r["images_kept"] == 1 && r["tags_kept"] == 1, "{r}");
    ensure!(r["removed"]["pack"]["count"].as_u64() >= Some(1), "the untagged image's pack: {r}");
    ensure!(!root.join(format!("images/{}.json", untagged.hex())).exists(), "entry kept");
    server.restart()?;
    let out = t.path().join("s3.raw");
    ok(s3(&server, &["export", "demo", "--store", dest, "-o", s(&out)?]).output()?, "export after gc")?;
    ensure!(fs::read(&out)? == local_raw, "demo differs after gc");
    let r = json(&ok(s3(&server, &["store", "gc", "--store", dest, "--json"]).output()?, "gc again")?)?;
    ensure!(r["removed_total"]["count"] == 0, "{r}");
    Ok(())
}

/// `tessera push IMAGE --store STORE DEST`.
fn push(image: &str, store: &Path, dest: &str) -> Result<()> {
    ok(tessera::run(["push", image, "--store", s(store)?, dest])?, &format!("push {image} to {dest}"))?;
    Ok(())
}

#[test]
fn registry_gc_deletes_an_image_whose_tag_moved_once_found_dead_a_grace_apart() -> Result<()> {
    tessera_e2e::registry::require_registry()?;
    let t = tmp("store-gc-registry")?;
    let store = t.path().join("store");
    let (a, b, c) = (t.path().join("a"), t.path().join("b"), t.path().join("c"));
    tree(&a, "rgc-a", 10, 200_000)?;
    tree(&b, "rgc-b", 10, 200_000)?;
    tree(&c, "rgc-c", 5, 100_000)?;
    let old = tessera::build(&a, &store, &["--chunk-size", "64K"])?;
    let app = tessera::build(&b, &store, &["--chunk-size", "64K"])?;
    let other = tessera::build(&c, &store, &["--chunk-size", "64K"])?;
    let registry = Registry::start()?;
    let repo = format!("docker://{}/gc/app", registry.addr());
    // `app` is pushed twice: the second push moves the tag, and the first image is left with
    // its ID tag only — dead.
    push(&old.to_string(), &store, &format!("{repo}:app"))?;
    push(&app.to_string(), &store, &format!("{repo}:app"))?;
    push(&other.to_string(), &store, &format!("{repo}:other"))?;
    let local_app = export(&app.to_string(), &store, &t.path().join("app.raw"))?;
    let local_other = export(&other.to_string(), &store, &t.path().join("other.raw"))?;
    let remote_export = |image: &str, out: &str| {
        tessera::run(["export", image, "--store", &repo, "-o", s(&t.path().join(out))?])
    };

    // The first run finds the old image dead and marks it; nothing goes before the grace.
    let r = json(&ok(gc(&repo, &["--grace", "2s", "--json"])?, "gc")?)?;
    ensure!(r["images_removed"] == 0 && r["images_kept"] == 3 && r["young"]["count"] == 1, "{r}");
    ensure!(r["released"]["count"] == 0, "nothing released yet: {r}");
    let r = json(&ok(gc(&repo, &["--grace", "2s", "--json"])?, "gc again")?)?;
    ensure!(r["images_removed"] == 0 && r["young"]["count"] == 1, "{r}");
    // The record lives in the repository, under its own tag.
    ensure!(tessera_e2e::registry::tags(registry.addr(), "gc/app")?.contains(&"tessera-gc-marks".to_owned()));
    std::thread::sleep(Duration::from_millis(2200));

    // A dry run says what would go and deletes nothing.
    let dry = json(&ok(gc(&repo, &["--grace", "2s", "--dry-run", "--json"])?, "gc --dry-run")?)?;
    ensure!(dry["dry_run"] == true && dry["images_removed"] == 1 && dry["tags_removed"] == 1, "{dry}");
    ensure!(
        dry["objects"].to_string().contains(&format!("sha256-{}", old.hex())),
        "the old image's ID tag is listed: {dry}"
    );
    ensure!(dry["released"]["count"].as_u64() >= Some(3), "its record, prefix, pack…: {dry}");
    ok(remote_export(&old.to_string(), "old-dry.raw")?, "the old image after a dry run")?;

    // Found dead by runs at least the grace apart: deleted, its ID tag with it.
    let r = json(&ok(gc(&repo, &["--grace", "2s", "--json"])?, "gc after the grace")?)?;
    ensure!(r["images_removed"] == 1 && r["images_kept"] == 2 && r["tags_removed"] == 1, "{r}");
    ensure!(r["young"]["count"] == 0, "{r}");
    let gone = remote_export(&old.to_string(), "old.raw")?;
    ensure!(!gone.status.success(), "the deleted image still exports");
    let tags = tessera_e2e::registry::tags(registry.addr(), "gc/app")?;
    ensure!(!tags.iter().any(|t| t.contains(old.hex())), "the ID tag is left: {tags:?}");
    // The live images are whole, by tag and by ID.
    for (image, local, out) in [
        ("app", &local_app, "app.raw"),
        ("other", &local_other, "other.raw"),
        (&*app.to_string(), &local_app, "id.raw"),
    ] {
        ok(remote_export(image, out)?, &format!("export {image}"))?;
        ensure!(fs::read(t.path().join(out))? == *local, "{image}: bytes differ after gc");
    }
    // Nothing is left to do.
    let r = json(&ok(gc(&repo, &["--grace", "0", "--json"])?, "gc once more")?)?;
    ensure!(r["images_removed"] == 0 && r["young"]["count"] == 0 && r["images_kept"] == 2, "{r}");
    let text = ok(gc(&repo, &["--grace", "0"])?, "gc, text")?;
    let text = String::from_utf8_lossy(&text.stdout);
    ensure!(text.contains("Removed 0 images") && text.contains("Kept 2 images"), "{text}");

    // A registry that does not allow deletes: a clear error, exit 1, nothing changed.
    let strict = Registry::start_without_delete()?;
    let repo = format!("docker://{}/gc/app", strict.addr());
    push(&old.to_string(), &store, &format!("{repo}:app"))?;
    push(&app.to_string(), &store, &format!("{repo}:app"))?;
    let o = gc(&repo, &["--grace", "0"])?;
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(o.status.code() == Some(1), "exit {:?}: {err}", o.status.code());
    ensure!(
        err.contains("does not allow deleting") && err.contains("REGISTRY_STORAGE_DELETE_ENABLED"),
        "{err}"
    );
    ok(
        tessera::run(["export", &old.to_string(), "--store", &repo, "-o", s(&t.path().join("kept.raw"))?])?,
        "kept",
    )?;
    Ok(())
}

#[test]
fn registry_gc_also_deletes_the_tags_a_registry_keeps_after_deleting_a_manifest() -> Result<()> {
    // go-containerregistry's registry (the one with the referrers API) deletes a manifest by
    // digest but keeps the tags that named it: gc deletes each of them too.
    let t = tmp("store-gc-ggcr")?;
    let store = t.path().join("store");
    let (a, b) = (t.path().join("a"), t.path().join("b"));
    tree(&a, "rgc-ggcr-a", 5, 100_000)?;
    tree(&b, "rgc-ggcr-b", 5, 100_000)?;
    let old = tessera::build(&a, &store, &["--chunk-size", "64K"])?;
    let app = tessera::build(&b, &store, &["--chunk-size", "64K"])?;
    let registry = Registry::start_with_referrers()?;
    let repo = format!("docker://{}/gc/app", registry.addr());
    push(&old.to_string(), &store, &format!("{repo}:app"))?;
    push(&app.to_string(), &store, &format!("{repo}:app"))?;
    let r = json(&ok(gc(&repo, &["--grace", "0", "--json"])?, "gc")?)?;
    ensure!(r["images_removed"] == 1 && r["tags_removed"] == 1 && r["images_kept"] == 1, "{r}");
    let tags = tessera_e2e::registry::tags(registry.addr(), "gc/app")?;
    ensure!(!tags.iter().any(|t| t.contains(old.hex())), "the ID tag is left: {tags:?}");
    ensure!(tags.contains(&"app".to_owned()) && tags.contains(&format!("sha256-{}", app.hex())), "{tags:?}");
    let out = t.path().join("old.raw");
    ensure!(!tessera::run(["export", &old.to_string(), "--store", &repo, "-o", s(&out)?])?.status.success());
    let local = export("app", &store, &t.path().join("local.raw"))
        .or_else(|_| export(&app.to_string(), &store, &out))?;
    let remote = t.path().join("remote.raw");
    ok(tessera::run(["export", "app", "--store", &repo, "-o", s(&remote)?])?, "export app")?;
    ensure!(fs::read(&remote)? == local, "app: bytes differ after gc");
    Ok(())
}
