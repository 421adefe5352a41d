//! TLS with real parts: a throwaway CA and server certificate (openssl CLI), nginx serving a
//! store over https. `export --ca-file CA` reads it byte for byte; without the CA (or with
//! another CA) the export fails, naming certificate verification once; `--insecure` skips
//! verification (curl's `-k`). The same for a registry (docker-registry) serving HTTPS on this
//! host's non-loopback address (loopback registries are never verified, as docker does): push
//! and export with `--ca-file`, refused without it, `--insecure` reads.

use std::fs;
use std::path::Path;
use std::process::Output;

use anyhow::{ensure, Context, Result};
use tessera_e2e::nginx::{Nginx, ServerCert};
use tessera_e2e::prng::Prng;
use tessera_e2e::registry::{require_registry, Registry, RegistryTls};
use tessera_e2e::tessera;
use tessera_e2e::testutil::{built_store, BuiltStore};
use tessera_e2e::tls::{host_address, TestPki};

fn s(p: &Path) -> Result<&str> {
    p.to_str().context("utf-8 path")
}

/// A failure (exit 1) whose one error line names `url` and certificate verification once, and
/// repeats no cause.
fn verification_failed(o: &Output, url: &str) -> Result<()> {
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(o.status.code() == Some(1), "{} — {err}", o.status);
    let line = err.lines().find(|l| l.starts_with("tessera: error:")).context("no error line")?;
    ensure!(line.contains(url), "the error names the URL {url}: {line}");
    ensure!(
        line.matches("certificate verification failed").count() == 1,
        "names certificate verification once: {line}"
    );
    ensure!(
        err.contains("hint: to trust a private CA, give its certificate with --ca-file"),
        "no hint: {err}"
    );
    let causes: Vec<&str> = line.split(": ").collect();
    for (i, c) in causes.iter().enumerate() {
        ensure!(!causes[i + 1..].contains(c), "{c:?} repeats: {line}");
    }
    Ok(())
}

fn export(url: &str, out: &Path, extra: &[&str]) -> Result<Output> {
    let mut args = vec!["export", "demo", "--store", url, "-o", s(out)?];
    args.extend(extra);
    tessera::run(&args)
}

#[test]
fn https_store_is_verified_against_the_ca_file() -> Result<()> {
    let BuiltStore { t, store, local_raw: expected, .. } = built_store("tls-origin", "demo", "64K", |src| {
        fs::create_dir_all(src)?;
        let mut rng = Prng::from_label("tls-origin");
        fs::write(src.join("random.bin"), rng.bytes(600_000))?;
        Ok(fs::write(src.join("text.txt"), rng.text(200_000))?)
    })?;

    let pki = TestPki::generate(&t.path().join("pki"), "tessera test CA", &[])?;
    let other = TestPki::generate(&t.path().join("other"), "another CA", &[])?;
    let origin = Nginx::serve_tls(&store, "store", ServerCert { cert: &pki.cert, key: &pki.key })?;
    let url = origin.url();
    ensure!(url.starts_with("https://"), "{url}");
    let out = t.path().join("out.raw");

    // Trusting the CA: the export succeeds with the same bytes.
    let o = export(&url, &out, &["--ca-file", s(&pki.ca)?])?;
    ensure!(o.status.success(), "export --ca-file: {} — {}", o.status, String::from_utf8_lossy(&o.stderr));
    ensure!(fs::read(&out)? == expected, "export over https differs from the local export");

    // The public roots (no --ca-file) or another CA: a failure (exit 1) that names the URL and
    // certificate verification, each cause once, and fetched nothing.
    for extra in [vec![], vec!["--ca-file", s(&other.ca)?]] {
        let before = origin.requests()?.len();
        let o = export(&url, &out, &extra)?;
        verification_failed(&o, &url).with_context(|| format!("export {extra:?}"))?;
        ensure!(origin.requests()?.len() == before, "a request got through: {}", origin.access_log());
    }

    // --insecure skips verification (curl's -k), on HTTPS still.
    fs::remove_file(&out)?;
    let o = export(&url, &out, &["--insecure"])?;
    ensure!(o.status.success(), "export --insecure: {} — {}", o.status, String::from_utf8_lossy(&o.stderr));
    ensure!(fs::read(&out)? == expected, "export --insecure differs from the local export");
    Ok(())
}

#[test]
fn registry_over_tls_is_verified_against_the_ca_file() -> Result<()> {
    require_registry()?;
    let f = built_store("tls-registry", "demo", "64K", |src| {
        fs::create_dir_all(src)?;
        Ok(fs::write(src.join("random.bin"), Prng::from_label("tls-registry").bytes(400_000))?)
    })?;
    let ip = host_address()?;
    let pki = TestPki::generate(&f.t.path().join("pki"), "tessera registry CA", &[ip])?;
    let reg = Registry::start_tls(RegistryTls { ip, cert: pki.cert.clone(), key: pki.key.clone() })?;
    let addr = reg.addr();
    let ca = s(&pki.ca)?;
    let o = tessera::run([
        "push",
        "demo",
        "--store",
        s(&f.store)?,
        &format!("docker://{addr}/app:demo"),
        "--ca-file",
        ca,
    ])?;
    ensure!(o.status.success(), "push --ca-file: {} — {}", o.status, String::from_utf8_lossy(&o.stderr));

    let store = format!("docker://{addr}/app");
    let out = f.t.path().join("out.raw");
    let o = export(&store, &out, &["--ca-file", ca])?;
    ensure!(o.status.success(), "export --ca-file: {} — {}", o.status, String::from_utf8_lossy(&o.stderr));
    ensure!(fs::read(&out)? == f.local_raw, "export from the TLS registry differs from the local export");

    // The same with HTTP/2 offered through ALPN (the registry picks what it speaks).
    fs::remove_file(&out)?;
    let o = export(&store, &out, &["--ca-file", ca, "--http-version", "auto"])?;
    ensure!(
        o.status.success(),
        "export --http-version auto: {} — {}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    ensure!(
        fs::read(&out)? == f.local_raw,
        "export over HTTP/2 from the TLS registry differs from the local export"
    );

    let o = export(&store, &out, &[])?;
    verification_failed(&o, &format!("https://{addr}/v2/")).context("export without --ca-file")?;

    fs::remove_file(&out)?;
    let o = export(&store, &out, &["--insecure"])?;
    ensure!(o.status.success(), "export --insecure: {} — {}", o.status, String::from_utf8_lossy(&o.stderr));
    ensure!(fs::read(&out)? == f.local_raw, "export --insecure differs from the local export");
    Ok(())
}

/// `--http-version auto` against nginx offering h2 through ALPN: the export is byte for byte
/// the same over HTTP/2, a certificate is verified exactly as over HTTP/1.1 (the same one error
/// line and hint), `--insecure` works, and an HTTPS origin without h2 is read over HTTP/1.1.
#[test]
fn https_store_over_http2_when_offered() -> Result<()> {
    let BuiltStore { t, store, local_raw: expected, .. } = built_store("tls-h2", "demo", "64K", |src| {
        fs::create_dir_all(src)?;
        let mut rng = Prng::from_label("tls-h2");
        for i in 0..6 {
            fs::write(src.join(format!("random-{i}.bin")), rng.bytes(300_000))?;
        }
        Ok(fs::write(src.join("text.txt"), rng.text(200_000))?)
    })?;
    let pki = TestPki::generate(&t.path().join("pki"), "tessera h2 CA", &[])?;
    let cert = ServerCert { cert: &pki.cert, key: &pki.key };
    let h2 = Nginx::serve_tls_h2(&store, "store", cert)?;
    let h1 = Nginx::serve_tls(&store, "store", cert)?;
    let out = t.path().join("out.raw");
    let auto_export = |url: &str, extra: &[&str]| -> Result<Output> {
        let _ = fs::remove_file(&out);
        let mut args = vec!["export", "demo", "--store", url, "-o", s(&out)?, "--http-version", "auto"];
        args.extend(extra);
        let mut c = tessera::command(&args);
        c.env("RUST_LOG", "tessera_transport=debug");
        Ok(c.output()?)
    };
    let ca = s(&pki.ca)?;
    for (origin, version) in [(&h2, "version=Http2"), (&h1, "version=Http1")] {
        let url = origin.url();
        let o = auto_export(&url, &["--ca-file", ca])?;
        let err = String::from_utf8_lossy(&o.stderr);
        ensure!(o.status.success(), "export --http-version auto from {url}: {} — {err}", o.status);
        ensure!(fs::read(&out)? == expected, "the export from {url} differs from the local export");
        ensure!(err.contains(version), "{url} was not read with {version}: {err}");
    }

    let url = h2.url();
    let before = h2.requests()?.len();
    let o = auto_export(&url, &[])?;
    verification_failed(&o, &url).with_context(|| {
        format!("--http-version auto without --ca-file: {}", String::from_utf8_lossy(&o.stderr))
    })?;
    ensure!(h2.requests()?.len() == before, "a request got through: {}", h2.access_log());

    let o = auto_export(&url, &["--insecure"])?;
    ensure!(o.status.success(), "export --insecure: {} — {}", o.status, String::from_utf8_lossy(&o.stderr));
    ensure!(fs::read(&out)? == expected, "export --insecure over HTTP/2 differs from the local export");
    Ok(())
}

/// `serve --preconnect N` over https: the N connections it opens beside the tag's carry the
/// start's next requests. A TLS 1.3 server sends session tickets after the handshake, which no
/// request has read yet; a stashed connection with them waiting must not be taken for one the
/// server wrote garbage on (it was, and every preconnected https connection was thrown away).
#[test]
fn preconnected_https_connections_carry_the_start() -> Result<()> {
    use std::time::Duration;
    use tessera_e2e::daemon::Daemon;
    use tessera_e2e::proxy::{Proxy, ProxyConfig};

    let BuiltStore { t, store, .. } = built_store("tls-preconnect", "demo", "64K", |src| {
        fs::create_dir_all(src)?;
        Ok(fs::write(src.join("a.txt"), Prng::from_label("tls-preconnect").text(100_000))?)
    })?;
    let pki = TestPki::generate(&t.path().join("pki"), "tessera test CA", &[])?;
    let origin = Nginx::serve_tls(&store, "store", ServerCert { cert: &pki.cert, key: &pki.key })?;
    // A path with a round trip, so the tickets are in before the start's requests take the
    // connections, as on any real network.
    let proxy = Proxy::start_tcp(origin.addr(), ProxyConfig::rtt(Duration::from_millis(30)))?;
    let socket = t.path().join("vm.sock");
    let url = proxy.https_url("store");
    // The tag's connection, then the entry, record, prefix and pack index at once: four
    // connections, whether opened when needed or ahead. With 6 ahead, exactly 7: three of them
    // carried parts (one connection more and they were thrown away, three fewer and none was
    // opened ahead).
    for (preconnect, expected) in [("0", 4), ("3", 4), ("6", 7)] {
        let before = proxy.stats().connections;
        let d = Daemon::start(
            "demo",
            &url,
            &socket,
            &["--read-only", "--ca-file", s(&pki.ca)?, "--preconnect", preconnect],
        )?;
        let opened = proxy.stats().connections - before;
        d.stop()?;
        ensure!(
            opened == expected,
            "--preconnect {preconnect}: the start opened {opened} connections, not {expected}"
        );
    }
    Ok(())
}
