//! Throwaway TLS material for the tests, made with the `openssl` CLI (Debian `openssl`, which
//! `cargo xtask test` installs): a CA and a server certificate it signs for `127.0.0.1`,
//! `localhost` and the addresses asked for (ECDSA P-256, valid two days); and this host's
//! address that is not loopback.

use std::fs;
use std::net::{IpAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{ensure, Context, Result};

/// A CA (`ca.pem`) and a server certificate it signed (`server.pem`, key `server.key`), in one
/// directory.
#[derive(Debug, Clone)]
pub struct TestPki {
    /// The CA certificate: what `--ca-file` trusts.
    pub ca: PathBuf,
    /// The server certificate (SAN `IP:127.0.0.1`, `DNS:localhost` and the extra addresses).
    pub cert: PathBuf,
    /// The server's private key.
    pub key: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) -> Result<()> {
    let o = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .context("run openssl (apt-get install openssl)")?;
    ensure!(o.status.success(), "openssl {args:?}: {} — {}", o.status, String::from_utf8_lossy(&o.stderr));
    Ok(())
}

impl TestPki {
    /// Generate a CA named `name` and a server certificate, also valid for `ips`, into `dir`
    /// (created if missing).
    pub fn generate(dir: &Path, name: &str, ips: &[IpAddr]) -> Result<Self> {
        fs::create_dir_all(dir)?;
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
        let subj = format!("/CN={name}");
        let mut ca = vec!["req", "-x509"];
        ca.extend(ec);
        ca.extend(["-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", &subj]);
        ca.extend(["-addext", "basicConstraints=critical,CA:TRUE"]);
        ca.extend(["-addext", "keyUsage=critical,keyCertSign,cRLSign"]);
        openssl(dir, &ca)?;
        let mut csr = vec!["req"];
        csr.extend(ec);
        csr.extend(["-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost"]);
        openssl(dir, &csr)?;
        let extra: String = ips.iter().map(|ip| format!(",IP:{ip}")).collect();
        fs::write(
            dir.join("server.ext"),
            format!(
                "subjectAltName=IP:127.0.0.1,DNS:localhost{extra}\nbasicConstraints=CA:FALSE\n\
                 keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
            ),
        )?;
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                "server.pem",
                "-days",
                "2",
                "-extfile",
                "server.ext",
            ],
        )?;
        Ok(Self { ca: dir.join("ca.pem"), cert: dir.join("server.pem"), key: dir.join("server.key") })
    }
}

/// This host's IPv4 address on its default route (not loopback): connecting a UDP socket sends
/// nothing, it only picks the source address.
pub fn host_address() -> Result<IpAddr> {
    let s = UdpSocket::bind("0.0.0.0:0")?;
    s.connect("192.0.2.1:9").context("no IPv4 route off the host: a test needs a non-loopback address")?;
    let ip = s.local_addr()?.ip();
    ensure!(!ip.is_loopback() && !ip.is_unspecified(), "no non-loopback IPv4 address (got {ip})");
    Ok(ip)
}
