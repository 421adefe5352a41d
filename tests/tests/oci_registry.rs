//! Registry sources against the real CNCF registry (`docker-registry` on loopback, loaded with
//! `skopeo copy`): `tessera build docker://…` gives the same image ID as `tessera build oci:…` of
//! the same image — by tag, by digest, recompressed to zstd, through a multi-platform index,
//! behind htpasswd basic auth (with `--creds` and with `REGISTRY_AUTH_FILE`), and through a proxy
//! that answers 503 and cuts blob bodies mid-way (retries and Range resumption), and behind bearer
//! tokens from a real token flow (the registry's `auth: token`, the harness's token server; a
//! token expiring mid-pull is refreshed). Unknown tags and bad references fail cleanly. A
//! `--reference-layers` image pushed beside its source is found by the source's digest through the
//! tag fallback (distribution 2.8) and through the referrers API (go-containerregistry's registry).
//!
//! Needs root, umoci, skopeo, docker-registry, the referrers registry, htpasswd and openssl
//! (`cargo xtask test` provides them);
//! run with `--test-threads=1`.

use std::fs;
use std::path::Path;

use anyhow::{ensure, Context, Result};
use tessera_e2e::oci::{build_ok, build_source, require_tools, TarWriter, UmociImage};
use tessera_e2e::registry::{Fault, FaultProxy, Registry, PASSWORD, USER};
use tessera_e2e::testutil::tmp;
use tessera_e2e::token_server::TokenServer;
use tessera_e2e::{fixtures, tessera};

/// Two umoci layers (the `kinds` fixture, then deletions and replacements → whiteouts) and a
/// hand-written one (opaque directory, PAX xattrs and times, hard links), with an Entrypoint.
fn make_image(work: &Path) -> Result<UmociImage> {
    let img = UmociImage::new(work, "t")?;
    img.layer(|root| {
        fixtures::by_name("kinds")?.generate(root)?;
        fs::remove_file(root.join("dev/socket"))?;
        fs::create_dir_all(root.join("opaque/sub"))?;
        fs::write(root.join("opaque/lower"), b"hidden later\n")?;
        Ok(())
    })?;
    img.layer(|root| {
        fs::remove_file(root.join("modes/f0644"))?;
        fs::remove_file(root.join("modes/f0600"))?;
        fs::create_dir(root.join("modes/f0600"))?;
        fs::write(root.join("modes/f0600/now-a-dir"), b"was a file\n")?;
        Ok(())
    })?;
    let tar = TarWriter::default()
        .dir("opaque/", 0o750)
        .file("opaque/.wh..wh..opq", 0o644, b"")
        .file("opaque/upper", 0o644, b"from the top layer\n")
        .pax(&[("mtime", b"1700000000.123456789"), ("SCHILY.xattr.user.note", b"v")])
        .file("bin/tool", 0o755, b"#!/bin/sh\necho tool\n")
        .hardlink("bin/tool-again", "bin/tool")
        .finish();
    img.append_tar_layer(&tar)?;
    img.config(&["--config.entrypoint", "/bin/tool", "--config.env", "A=1"])?;
    Ok(img)
}

fn setup() -> Result<()> {
    fixtures::require_root()?;
    require_tools()?;
    tessera_e2e::registry::require_registry()
}

fn expect_fail(source: &str, store: &Path, args: &[&str], code: i32, needle: &str) -> Result<String> {
    let out = build_source(source, store, args)?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    ensure!(out.status.code() == Some(code), "{source} {args:?}: status {:?}: {stderr}", out.status);
    ensure!(stderr.contains(needle), "{source} {args:?}: expected {needle:?} in: {stderr}");
    ensure!(out.stdout.is_empty(), "stdout must be empty on failure");
    Ok(stderr)
}

#[test]
fn registry_gives_the_same_id_as_the_layout() -> Result<()> {
    setup()?;
    let t = tmp("reg-ids")?;
    let img = make_image(t.path())?;
    let store = t.path().join("store");
    let id = build_ok(&img.source(), &store, &[])?;

    let reg = Registry::start()?;
    let addr = reg.addr();
    reg.load(&format!("oci:{}", img.image_ref()), "team/app:v1", &[])?;
    // By tag, into an empty store (no chunk reuse) and into the full one.
    let by_tag = build_ok(&format!("docker://{addr}/team/app:v1"), &t.path().join("store2"), &[])?;
    ensure!(by_tag == id, "registry by tag gave {by_tag}, the layout {id}\n{}", reg.logs());
    let again = build_ok(&format!("docker://{addr}/team/app:v1"), &store, &["--tag", "from-registry"])?;
    ensure!(again == id, "registry into a full store gave {again}");
    tessera::check_store(&store)?;
    let v = tessera::inspect_json("from-registry", &store)?;
    ensure!(v["config"]["entrypoint"] == serde_json::json!(["/bin/tool"]), "{v}");

    // By digest (and tag@digest: the digest wins).
    let digest = reg.manifest_digest("team/app:v1", &[])?;
    let by_digest = build_ok(&format!("docker://{addr}/team/app@{digest}"), &t.path().join("store3"), &[])?;
    ensure!(by_digest == id, "registry by digest gave {by_digest}");
    let both =
        build_ok(&format!("docker://{addr}/team/app:nosuchtag@{digest}"), &t.path().join("store3"), &[])?;
    ensure!(both == id, "tag@digest gave {both}");

    // Recompressed to zstd on the way in.
    reg.load(&format!("oci:{}", img.image_ref()), "team/app:zstd", &["--dest-compress-format", "zstd"])?;
    let zstd = build_ok(&format!("docker://{addr}/team/app:zstd"), &t.path().join("store4"), &[])?;
    ensure!(zstd == id, "zstd layers from the registry gave {zstd}");

    // A Docker schema 2 manifest (skopeo converts when asked).
    reg.load(&format!("oci:{}", img.image_ref()), "team/app:docker", &["--format", "v2s2"])?;
    let v2s2 = build_ok(&format!("docker://{addr}/team/app:docker"), &t.path().join("store5"), &[])?;
    ensure!(v2s2 == id, "a Docker schema 2 manifest gave {v2s2}");

    // Failures: an unknown tag (1), a bad reference (2), flags that only apply to registries (2).
    expect_fail(&format!("docker://{addr}/team/app:nope"), &store, &[], 1, "not found")?;
    expect_fail(&format!("docker://{addr}/Team/App"), &store, &[], 2, "invalid image reference")?;
    expect_fail(&img.source(), &store, &["--insecure"], 2, "docker:// sources only")?;
    Ok(())
}

#[test]
fn registry_multi_platform_index() -> Result<()> {
    setup()?;
    let t = tmp("reg-multi")?;
    let img = make_image(t.path())?;
    // A second image: the same layers with another entrypoint, tagged "arm".
    run_umoci_config(&img, "arm", &["--config.entrypoint", "/bin/arm"])?;
    let amd_id = build_ok(&img.source(), &t.path().join("s1"), &[])?;
    let arm_id = build_ok(&format!("oci:{}:arm", img.layout.display()), &t.path().join("s1"), &[])?;
    ensure!(amd_id != arm_id);
    // index.json gets a multi-platform index "multi" over both manifests.
    let index_path = img.layout.join("index.json");
    let mut index: serde_json::Value = serde_json::from_slice(&fs::read(&index_path)?)?;
    let find = |tag: &str| -> Result<serde_json::Value> {
        index["manifests"]
            .as_array()
            .and_then(|l| l.iter().find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == tag))
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("tag {tag} missing"))
    };
    let mut amd = find("t")?;
    let mut arm = find("arm")?;
    amd["platform"] = serde_json::json!({"os": "linux", "architecture": "amd64"});
    arm["platform"] = serde_json::json!({"os": "linux", "architecture": "arm64", "variant": "v8"});
    for d in [&mut amd, &mut arm] {
        if let Some(o) = d.as_object_mut() {
            o.remove("annotations");
        }
    }
    let multi = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [arm, amd],
    }))?;
    use sha2::Digest;
    let hex = hex::encode(sha2::Sha256::digest(&multi));
    fs::write(img.layout.join("blobs/sha256").join(&hex), &multi)?;
    if let Some(list) = index["manifests"].as_array_mut() {
        list.push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "digest": format!("sha256:{hex}"),
            "size": multi.len(),
            "annotations": {"org.opencontainers.image.ref.name": "multi"},
        }));
    }
    fs::write(&index_path, serde_json::to_vec(&index)?)?;

    let reg = Registry::start()?;
    reg.load(&format!("oci:{}:multi", img.layout.display()), "app:multi", &["--all"])?;
    let src = format!("docker://{}/app:multi", reg.addr());
    let store = t.path().join("store");
    ensure!(build_ok(&src, &store, &[])? == amd_id, "default platform linux/amd64");
    ensure!(build_ok(&src, &store, &["--platform", "linux/arm64"])? == arm_id, "linux/arm64");
    ensure!(build_ok(&src, &store, &["--platform", "linux/arm64/v8"])? == arm_id, "linux/arm64/v8");
    expect_fail(&src, &store, &["--platform", "linux/s390x"], 1, "no image for platform linux/s390x")?;
    Ok(())
}

fn run_umoci_config(img: &UmociImage, tag: &str, args: &[&str]) -> Result<()> {
    tessera_e2e::judge::run(
        std::process::Command::new("umoci")
            .arg("config")
            .arg("--image")
            .arg(img.image_ref())
            .arg("--tag")
            .arg(tag)
            .args(args),
    )?;
    Ok(())
}

#[test]
fn registry_basic_auth() -> Result<()> {
    setup()?;
    let t = tmp("reg-auth")?;
    let img = make_image(t.path())?;
    let id = build_ok(&img.source(), &t.path().join("store0"), &[])?;
    let reg = Registry::start_with_htpasswd()?;
    let creds = format!("{USER}:{PASSWORD}");
    reg.load(&format!("oci:{}", img.image_ref()), "private/app:v1", &["--dest-creds", &creds])?;
    let src = format!("docker://{}/private/app:v1", reg.addr());
    let store = t.path().join("store");

    // No credentials anywhere (HOME pointed at an empty directory): 401 with a hint.
    let home = t.path().join("home");
    fs::create_dir_all(&home)?;
    let mut c = tessera::command(["build", &src, "--store"]);
    c.arg(&store).env("HOME", &home).env_remove("REGISTRY_AUTH_FILE").env_remove("DOCKER_CONFIG");
    let out = c.output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.code() == Some(1), "anonymous pull must fail: {stderr}");
    ensure!(stderr.contains("unauthorized") && stderr.contains("--creds"), "{stderr}");

    expect_fail(&src, &store, &["--creds", &format!("{USER}:wrong")], 1, "credentials were rejected")?;
    expect_fail(&src, &store, &["--creds", "nocolon"], 2, "USER:PASS")?;
    ensure!(build_ok(&src, &store, &["--creds", &creds])? == id, "with --creds");

    // From REGISTRY_AUTH_FILE (auths.<host:port>.auth = base64(user:pass)).
    let auth_file = t.path().join("auth.json");
    let b64 = {
        use std::io::Write;
        use std::process::Stdio;
        let mut child = std::process::Command::new("base64")
            .arg("-w0")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        child.stdin.take().map(|mut s| s.write_all(creds.as_bytes())).transpose()?;
        String::from_utf8(child.wait_with_output()?.stdout)?
    };
    ensure!(!b64.is_empty(), "base64 printed nothing");
    fs::write(&auth_file, serde_json::json!({"auths": {reg.addr().to_string(): {"auth": b64}}}).to_string())?;
    let mut c = tessera::command(["build", &src, "--store"]);
    c.arg(t.path().join("store2")).env("HOME", &home).env("REGISTRY_AUTH_FILE", &auth_file);
    let out = c.output()?;
    ensure!(out.status.success(), "auth file: {}", String::from_utf8_lossy(&out.stderr));
    ensure!(tessera::parse_build_stdout(&out.stdout)? == id, "with REGISTRY_AUTH_FILE");
    // And from ~/.docker/config.json.
    fs::create_dir_all(home.join(".docker"))?;
    fs::copy(&auth_file, home.join(".docker/config.json"))?;
    let mut c = tessera::command(["build", &src, "--store"]);
    c.arg(t.path().join("store3"))
        .env("HOME", &home)
        .env_remove("REGISTRY_AUTH_FILE")
        .env_remove("DOCKER_CONFIG");
    let out = c.output()?;
    ensure!(out.status.success(), "docker config: {}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

#[test]
fn registry_faults_are_retried_and_resumed() -> Result<()> {
    setup()?;
    let t = tmp("reg-faults")?;
    let img = make_image(t.path())?;
    // A layer big enough that a cut lands mid-body.
    img.layer(|root| {
        let mut data = vec![0u8; 3 << 20];
        let mut x: u32 = 1;
        for b in &mut data {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            *b = x as u8;
        }
        fs::write(root.join("random.bin"), data)?;
        Ok(())
    })?;
    let id = build_ok(&img.source(), &t.path().join("store0"), &[])?;
    let reg = Registry::start()?;
    reg.load(&format!("oci:{}", img.image_ref()), "app:v1", &[])?;

    // 503 on the first three blob requests.
    let proxy = FaultProxy::start(reg.addr(), Fault::Status503, 3)?;
    let got = build_ok(&format!("docker://{}/app:v1", proxy.addr()), &t.path().join("s1"), &[])?;
    ensure!(got == id, "through 503s: {got}");
    ensure!(proxy.faults_left() == 0, "the 503s were not all served");
    drop(proxy);

    // The first six blob responses cut after 64 KiB (the config, every layer of pass 1 and a
    // resumption): the client resumes with Range.
    let proxy = FaultProxy::start(reg.addr(), Fault::CutAfter(64 << 10), 6)?;
    let got = build_ok(&format!("docker://{}/app:v1", proxy.addr()), &t.path().join("s2"), &[])?;
    ensure!(got == id, "through cut bodies: {got}");
    ensure!(proxy.faults_left() == 0, "the cuts were not all served");

    // More faults than attempts: a clear failure naming the URL.
    let proxy = FaultProxy::start(reg.addr(), Fault::Status503, 1000)?;
    let stderr =
        expect_fail(&format!("docker://{}/app:v1", proxy.addr()), &t.path().join("s3"), &[], 1, "HTTP 503")?;
    ensure!(stderr.contains(&format!("http://{}/v2/app/", proxy.addr())), "{stderr}");
    Ok(())
}

/// Bearer tokens through the real token flow: the registry in `auth: token` mode trusting the
/// certificate of the test's token server, which signs ES256 JWTs for the scopes asked for.
/// A pull with `--creds` works (same ID as the layout); wrong and missing credentials fail with
/// a clear error; a token that the registry stops accepting mid-pull (its `exp` passes while
/// the first blob request is held by a proxy, though `expires_in` promised 300 s) is refreshed
/// after the registry's 401 and the pull completes with the same ID.
#[test]
fn registry_bearer_token_auth() -> Result<()> {
    setup()?;
    let t = tmp("reg-token")?;
    let img = make_image(t.path())?;
    let id = build_ok(&img.source(), &t.path().join("store0"), &[])?;
    let tokens = TokenServer::start()?;
    let reg = Registry::start_with_token_server(&tokens)?;
    let creds = format!("{USER}:{PASSWORD}");
    reg.load(&format!("oci:{}", img.image_ref()), "private/app:v1", &["--dest-creds", &creds])?;
    let src = format!("docker://{}/private/app:v1", reg.addr());

    let before = tokens.requests().len();
    let got = build_ok(&src, &t.path().join("s1"), &["--creds", &creds])?;
    ensure!(got == id, "through the token server: {got}, the layout {id}\n{}", reg.logs());
    let asked = tokens.requests()[before..].to_vec();
    ensure!(
        asked.iter().any(|r| r.granted && r.scopes.iter().any(|s| s == "repository:private/app:pull")),
        "no pull token was issued: {asked:?}"
    );

    // Wrong and missing credentials: the token server's 401, reported as such.
    let home = t.path().join("home");
    fs::create_dir_all(&home)?;
    let stderr =
        expect_fail(&src, &t.path().join("s2"), &["--creds", &format!("{USER}:wrong")], 1, "/token")?;
    ensure!(stderr.contains("credentials were rejected"), "{stderr}");
    let mut c = tessera::command(["build", &src, "--store"]);
    c.arg(t.path().join("s3"))
        .env("HOME", &home)
        .env_remove("REGISTRY_AUTH_FILE")
        .env_remove("DOCKER_CONFIG");
    let out = c.output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.code() == Some(1) && stderr.contains("--creds"), "anonymous: {stderr}");

    // Expiry mid-pull: the first token dies about a second after it is issued; the proxy holds
    // the first blob request (the config, right after the manifest) for 2.5 s.
    tokens.expire_next(1);
    let proxy = FaultProxy::start(reg.addr(), Fault::Delay(std::time::Duration::from_millis(2500)), 1)?;
    let before = tokens.requests().len();
    let got = build_ok(
        &format!("docker://{}/private/app:v1", proxy.addr()),
        &t.path().join("s4"),
        &["--creds", &creds],
    )?;
    ensure!(got == id, "after a refresh: {got}\n{}", reg.logs());
    ensure!(proxy.faults_left() == 0, "the delay was not applied");
    let asked = tokens.requests()[before..].to_vec();
    ensure!(
        asked.len() >= 2 && asked[0].short && asked[1..].iter().any(|r| r.granted && !r.short),
        "expected a short-lived token, then a refresh: {asked:?}"
    );
    let rejected = reg.logs().lines().filter(|l| l.contains("/blobs/") && l.contains("\" 401 ")).count();
    ensure!(rejected >= 1, "the registry never refused the expired token:\n{}", reg.logs());
    Ok(())
}

/// `build docker://… --reference-layers`, pushed back to its source repository: no layer byte
/// is uploaded (the layer blobs are there), the artifact's `subject` is the source manifest,
/// and `@sha256:<source manifest digest>` finds the Tessera image (this registry has no
/// referrers API: through the `sha256-<hex>` tag fallback), exporting the same bytes.
#[test]
fn reference_layers_pushed_to_their_source_are_found_by_its_digest() -> Result<()> {
    setup()?;
    let t = tmp("reg-subject")?;
    let Sourced { img, reg, digest, proxy, store, id } = reference_build(t.path(), Registry::start()?)?;
    let addr = proxy.addr();
    // Everything went through a logging proxy: the build reads each layer blob once (inflating,
    // indexing and copying it into the store in the same read; it used to download every layer
    // twice).
    let log = proxy.log();
    for i in 0..3 {
        let layer = img.layer_digest(i)?;
        let gets =
            log.iter().filter(|r| r.method == "GET" && r.path.ends_with(&format!("/blobs/{layer}"))).count();
        ensure!(gets == 1, "layer {i} ({layer}) was fetched {gets} times");
    }
    let converted = build_ok(&img.source(), &t.path().join("converted"), &[])?;
    ensure!(id == converted, "reference build {id}, converted {converted}");

    let push = |tag: &str| -> Result<serde_json::Value> {
        let dest = format!("docker://{addr}/team/app:{tag}");
        let o =
            tessera::run(["push", id.as_str(), "--store", store.to_str().unwrap_or(""), &dest, "--json"])?;
        ensure!(o.status.success(), "push: {}", String::from_utf8_lossy(&o.stderr));
        Ok(serde_json::from_slice(&o.stdout)?)
    };
    let report = push("tessera")?;
    ensure!(report["subject"] == serde_json::json!(digest), "subject: {report}");
    // Only Tessera's own blobs travel (record, prefix, pack index, provenance, entry; no windows
    // blob: these layers are too small to have windows): the three layer blobs are in the
    // repository already.
    ensure!(report["present"] == 3 && report["uploaded"] == 5, "{report}");
    // Pushing again (another tag) keeps one Tessera referrer.
    push("tessera2")?;

    let remote = format!("docker://{addr}/team/app");
    let found = tessera::inspect_json(&format!("@{digest}"), Path::new(&remote))?;
    ensure!(found["id"] == serde_json::json!(id.as_str()), "@{digest} found {}", found["id"]);
    let (a, b) = (t.path().join("local.img"), t.path().join("remote.img"));
    tessera::export(id.as_str(), &store, &a)?;
    tessera::export(&format!("@{digest}"), Path::new(&remote), &b)?;
    ensure!(fs::read(&a)? == fs::read(&b)?, "the export by source digest differs from the local one");
    // A digest no Tessera image refers to: unknown (exit 1).
    let other = reg.manifest_digest("team/app:tessera", &[])?;
    let o = tessera::run(["inspect", &format!("@{other}"), "--store", &remote])?;
    ensure!(
        o.status.code() == Some(1),
        "inspect @{other}: {:?} {}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    // Through a host disk cache (as `serve --cache-dir` opens it) the subject is looked up at
    // the registry too.
    let cache = t.path().join("cache");
    let o = tessera::run([
        "inspect",
        &format!("@{digest}"),
        "--store",
        &remote,
        "--cache-dir",
        cache.to_str().context("utf-8 path")?,
        "--json",
    ])?;
    ensure!(o.status.success(), "cached inspect @{digest}: {}", String::from_utf8_lossy(&o.stderr));
    let cached: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    ensure!(cached["id"] == serde_json::json!(id.as_str()), "cached @{digest} found {}", cached["id"]);
    // A local store has no subjects to look up: a usage error that says so (exit 2).
    let o =
        tessera::run(["inspect", &format!("@{digest}"), "--store", store.to_str().context("utf-8 path")?])?;
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(
        o.status.code() == Some(2) && err.contains("only a registry store"),
        "local inspect @{digest}: {:?} {err}",
        o.status
    );
    Ok(())
}

/// A source image in a registry and its `--reference-layers` build from it.
struct Sourced {
    img: UmociImage,
    reg: Registry,
    /// The source manifest's digest.
    digest: String,
    /// A logging proxy in front of `reg`, which the build went through.
    proxy: tessera_e2e::proxy::Proxy,
    store: std::path::PathBuf,
    id: tessera::ImageId,
}

/// [`make_image`] loaded into `reg` as `team/app:v1`, built with `--reference-layers` through a
/// logging proxy into `work/store`.
fn reference_build(work: &Path, reg: Registry) -> Result<Sourced> {
    let img = make_image(work)?;
    reg.load(&format!("oci:{}", img.image_ref()), "team/app:v1", &[])?;
    let digest = reg.manifest_digest("team/app:v1", &[])?;
    let proxy = tessera_e2e::proxy::Proxy::start(reg.addr(), tessera_e2e::proxy::ProxyConfig::default())?;
    let store = work.join("store");
    let id = build_ok(&format!("docker://{}/team/app:v1", proxy.addr()), &store, &["--reference-layers"])?;
    Ok(Sourced { img, reg, digest, proxy, store, id })
}

/// `METHOD /v2/<path>` over a raw socket → the status code.
fn status_of(addr: std::net::SocketAddr, method: &str, path: &str) -> Result<u16> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    write!(s, "{method} /v2/{path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head)?;
    Ok(std::str::from_utf8(&head[9..12])?.parse()?)
}

/// On a registry with the referrers API (go-containerregistry's, which names a referrer by its
/// config's media type, as the OCI 1.1 release candidates did): a `--reference-layers` image
/// pushed beside its source is found from the source's digest through `GET /referrers/`, and no
/// tag fallback is written (issue 12, point 4).
#[test]
fn reference_layers_are_found_through_the_referrers_api() -> Result<()> {
    setup()?;
    let t = tmp("reg-referrers")?;
    let Sourced { reg, digest, proxy, store, id, .. } =
        reference_build(t.path(), Registry::start_with_referrers()?)?;
    let addr = proxy.addr();
    let dest = format!("docker://{addr}/team/app:tessera");
    let o = tessera::run([
        "push",
        id.as_str(),
        "--store",
        store.to_str().context("utf-8 path")?,
        &dest,
        "--json",
    ])?;
    ensure!(o.status.success(), "push: {}", String::from_utf8_lossy(&o.stderr));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    ensure!(report["subject"] == serde_json::json!(digest), "subject: {report}");
    // This registry sends no OCI-Subject header; push saw its referrers API index the subject
    // and wrote no fallback tag.
    ensure!(report["subject_indexed"] == true, "{report}");
    let fallback = digest.replace(':', "-");
    let status = status_of(reg.addr(), "HEAD", &format!("team/app/manifests/{fallback}"))?;
    ensure!(status == 404, "HEAD the fallback tag {fallback}: {status}");
    let remote = format!("docker://{addr}/team/app");
    let before = proxy.log().len();
    let found = tessera::inspect_json(&format!("@{digest}"), Path::new(&remote))?;
    ensure!(found["id"] == serde_json::json!(id.as_str()), "@{digest} found {}", found["id"]);
    let asked: Vec<String> =
        proxy.log()[before..].iter().map(|r| format!("{} {}", r.method, r.path)).collect();
    ensure!(
        asked.iter().any(|r| r.starts_with(&format!("GET /v2/team/app/referrers/{digest}"))),
        "the lookup did not use the referrers API: {asked:?}"
    );
    ensure!(!asked.iter().any(|r| r.contains(&fallback)), "the lookup asked for the fallback tag: {asked:?}");
    let (a, b) = (t.path().join("local.img"), t.path().join("remote.img"));
    tessera::export(id.as_str(), &store, &a)?;
    tessera::export(&format!("@{digest}"), Path::new(&remote), &b)?;
    ensure!(fs::read(&a)? == fs::read(&b)?, "the export by source digest differs from the local one");
    Ok(())
}

/// `tessera store gc` on a registry store holding a `--reference-layers` image (issue 12, point
/// 7), on distribution 2.8 (no referrers API: the tag fallback). Once its tag has moved to
/// another image, the referrer is kept while `@sha256:<source>` finds it — its source exists;
/// when the source manifest is deleted, gc deletes the referrer and the fallback index that
/// listed it, and leaves the image its tag moved to whole.
#[test]
fn registry_gc_keeps_a_referrer_while_its_source_exists_then_prunes_it() -> Result<()> {
    setup()?;
    let t = tmp("reg-gc-referrer")?;
    let Sourced { reg, digest, store, id, proxy, .. } = reference_build(t.path(), Registry::start()?)?;
    // Through the proxy the build read from: the image refers to its source only when pushed to
    // the repository it was built from.
    let repo = format!("docker://{}/team/app", proxy.addr());
    let st = store.to_str().context("utf-8 path")?;
    let push = |image: &str| -> Result<()> {
        let o = tessera::run(["push", image, "--store", st, &format!("{repo}:tessera")])?;
        ensure!(o.status.success(), "push {image}: {}", String::from_utf8_lossy(&o.stderr));
        Ok(())
    };
    let gc = || -> Result<serde_json::Value> {
        let o = tessera::run(["store", "gc", "--store", &repo, "--grace", "0", "--json"])?;
        ensure!(o.status.success(), "gc: {}", String::from_utf8_lossy(&o.stderr));
        Ok(serde_json::from_slice(&o.stdout)?)
    };
    push(id.as_str())?;
    // The tag moves to a converted image of another tree.
    let tree = t.path().join("other");
    fs::create_dir_all(&tree)?;
    fs::write(tree.join("hello"), b"another image\n")?;
    let other = tessera::build(&tree, &store, &[])?;
    push(other.as_str())?;
    let fallback = digest.replace(':', "-");
    let id_tag = format!("sha256-{}", id.hex());

    // Only its ID tag names the referrer now, but its source exists: `@digest` finds it, so gc
    // keeps it.
    let r = gc()?;
    ensure!(r["images_removed"] == 0 && r["images_kept"] == 2, "{r}");
    let remote = Path::new(&repo);
    let found = tessera::inspect_json(&format!("@{digest}"), remote)?;
    ensure!(found["id"] == serde_json::json!(id.as_str()), "@{digest} found {}", found["id"]);

    // The source goes (distribution deletes its tag with it): the referrer is dead.
    let status = status_of(reg.addr(), "DELETE", &format!("team/app/manifests/{digest}"))?;
    ensure!(status == 202, "DELETE the source manifest: {status}");
    let r = gc()?;
    ensure!(r["images_removed"] == 1 && r["images_kept"] == 1 && r["tags_removed"] == 1, "{r}");
    ensure!(r["removed"]["referrers-entry"]["count"] == 1, "{r}");
    for tag in [&fallback, &id_tag] {
        let status = status_of(reg.addr(), "HEAD", &format!("team/app/manifests/{tag}"))?;
        ensure!(status == 404, "HEAD {tag} after gc: {status}");
    }
    // The image the tag moved to is whole.
    let (a, b) = (t.path().join("local.img"), t.path().join("remote.img"));
    tessera::export(other.as_str(), &store, &a)?;
    tessera::export("tessera", remote, &b)?;
    ensure!(fs::read(&a)? == fs::read(&b)?, "the tagged image differs after gc");
    ensure!(gc()?["images_removed"] == 0, "a second gc found more to remove");
    Ok(())
}
