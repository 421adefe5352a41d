//! TLS and HTTP/2 through the TCP-mode proxy, with real parts: nginx offering h2 by ALPN
//! (`Nginx::serve_tls_h2`), a throwaway CA (openssl CLI) and curl as the client. Directly and
//! through `Proxy::start_tcp`, curl verifies the certificate against the CA, negotiates h2 and
//! gets the files' bytes. Through the proxy, the TCP handshake, the TLS 1.3 handshake and the
//! request cost one round trip each, and two transfers at once share one connection.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use tessera_e2e::nginx::{Nginx, ServerCert};
use tessera_e2e::prng::Prng;
use tessera_e2e::proxy::{Proxy, ProxyConfig};
use tessera_e2e::tls::TestPki;

const RTT: Duration = Duration::from_millis(100);
/// Scheduling slack above an exact charge: less than one round trip, so a charge too many is
/// caught.
const SLACK: Duration = Duration::from_millis(75);

/// One transfer as curl's `--write-out` reports it.
#[derive(Debug)]
struct Transfer {
    http_version: String,
    /// From the start to the end of the TLS handshake.
    appconnect: Duration,
    /// From the start to the first response byte.
    starttransfer: Duration,
}

/// curl trusting only `ca`, asking for h2, fetching each URL into the file paired with it, all
/// at once (multiplexed when the server allows: curl waits for the first connection to know).
fn curl(ca: &Path, fetches: &[(&str, &Path)]) -> Result<Vec<Transfer>> {
    let mut cmd = Command::new("curl");
    cmd.args(["--http2", "--parallel", "--silent", "--show-error", "--fail", "--cacert"])
        .arg(ca)
        .args(["--write-out", "%{http_version} %{time_appconnect} %{time_starttransfer}\\n"]);
    for (url, out) in fetches {
        cmd.arg("--output").arg(out).arg(url);
    }
    let o = cmd.output().context("run curl (apt-get install curl)")?;
    ensure!(o.status.success(), "curl: {} — {}", o.status, String::from_utf8_lossy(&o.stderr));
    let report = String::from_utf8(o.stdout)?;
    let transfers = report
        .lines()
        .map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let secs = |i: usize| -> Result<Duration> {
                let s: &str = f.get(i).with_context(|| format!("curl --write-out: {line:?}"))?;
                Ok(Duration::from_secs_f64(s.parse()?))
            };
            Ok(Transfer {
                http_version: f.first().copied().unwrap_or_default().to_owned(),
                appconnect: secs(1)?,
                starttransfer: secs(2)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    ensure!(transfers.len() == fetches.len(), "curl reported {report:?}");
    Ok(transfers)
}

fn within(d: Duration, lo: Duration, what: &str) -> Result<()> {
    eprintln!("{what}: {d:?} (expected {lo:?} + up to {SLACK:?})");
    ensure!(d >= lo && d <= lo + SLACK, "{what}: {d:?}, expected {lo:?} (+ up to {SLACK:?})");
    Ok(())
}

#[test]
fn tls_and_http2_pass_the_tcp_proxy() -> Result<()> {
    let t = tessera_e2e::testutil::tmp("tcp-proxy")?;
    let root = t.path().join("root");
    fs::create_dir_all(&root)?;
    let mut rng = Prng::from_label("tcp-proxy");
    let (a, b) = (rng.bytes(300_000), rng.bytes(200_000));
    fs::write(root.join("a"), &a)?;
    fs::write(root.join("b"), &b)?;
    let pki = TestPki::generate(&t.path().join("pki"), "tessera h2 CA", &[])?;
    let cert = ServerCert { cert: &pki.cert, key: &pki.key };
    let origin = Nginx::serve_tls_h2(&root, "s", cert)?;
    let out = |name: &str| t.path().join(name);

    // Directly: h2 by ALPN. The HTTP/1.1 server refuses it, and curl falls back.
    let got = curl(&pki.ca, &[(&format!("{}/a", origin.url()), &out("direct"))])?;
    ensure!(got[0].http_version == "2", "serve_tls_h2 negotiated {got:?}");
    ensure!(fs::read(out("direct"))? == a, "the file over h2 differs");
    let h1 = Nginx::serve_tls(&root, "s", cert)?;
    let got = curl(&pki.ca, &[(&format!("{}/a", h1.url()), &out("h1"))])?;
    ensure!(got[0].http_version == "1.1", "serve_tls negotiated {got:?}");

    // Through the proxy, on a new connection: the TCP handshake, then the TLS 1.3 handshake
    // (one round trip), then the request (one more).
    let proxy = Proxy::start_tcp(origin.addr(), ProxyConfig::rtt(RTT))?;
    let url = proxy.https_url("/s/");
    let got = curl(&pki.ca, &[(&format!("{url}/a"), &out("a"))])?;
    ensure!(got[0].http_version == "2", "through the proxy: {got:?}");
    ensure!(fs::read(out("a"))? == a, "the file through the proxy differs");
    within(got[0].appconnect, 2 * RTT, "TCP and TLS handshakes")?;
    within(got[0].starttransfer, 3 * RTT, "first response byte")?;
    ensure!(proxy.stats().connections == 1);

    // Two transfers at once: multiplexed on one new connection, both intact.
    let got = curl(&pki.ca, &[(&format!("{url}/a"), &out("a2")), (&format!("{url}/b"), &out("b2"))])?;
    ensure!(got.iter().all(|t| t.http_version == "2"), "{got:?}");
    ensure!(fs::read(out("a2"))? == a && fs::read(out("b2"))? == b, "a multiplexed file differs");
    let st = proxy.stats();
    ensure!(st.connections == 2, "two streams, one connection: {st:?}");
    let files = 2 * a.len() as u64 + b.len() as u64;
    ensure!(st.wire_bytes > files, "every byte crossed the proxy: {st:?}");
    ensure!((st.requests, st.body_bytes, st.faults) == (0, 0, 0), "TCP mode parses nothing: {st:?}");
    Ok(())
}
