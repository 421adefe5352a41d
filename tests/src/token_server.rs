//! A token server for the registry's `auth: token` mode (the distribution "token
//! authentication" protocol), for end-to-end tests of bearer auth against the real registry.
//! No Debian package provides one, so this is a small one: `GET /token?service=S&scope=…` with
//! basic credentials ([`crate::registry::USER`]:[`crate::registry::PASSWORD`]) answers
//! `{"token", "access_token", "expires_in", "issued_at"}` with a JWT signed ES256 by a P-256 key
//! made for the test (`openssl`), whose self-signed certificate is the registry's
//! `rootcertbundle`. The JWT names the key by its libtrust key ID (`kid`), which is how the
//! registry finds it in the bundle. Every scope asked for is granted.
//!
//! Tokens can be made to expire early: the next `n` tokens ([`TokenServer::expire_next`]) are
//! valid for the registry only for about a second (the registry allows 60 s of clock skew
//! past `exp`, so `exp` is set 59 s in the past), while `expires_in` still says 300 s — so the
//! client cannot refresh ahead of time and must handle the registry's 401 mid-pull.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{ensure, Context, Result};
use base64::Engine as _;
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
use sha2::{Digest, Sha256};

use crate::judge::run;
use crate::registry::{PASSWORD, USER};

/// The `service` and `issuer` the registry is configured with.
pub const SERVICE: &str = "tessera-test-registry";
pub const ISSUER: &str = "tessera-test-token-issuer";
/// What `expires_in` says.
const EXPIRES_IN: u64 = 300;
/// The registry's clock-skew allowance past `exp` (distribution's `Leeway`).
const REGISTRY_LEEWAY: u64 = 60;

/// One token request as the server saw it.
#[derive(Debug, Clone)]
pub struct TokenRequest {
    pub scopes: Vec<String>,
    pub user: Option<String>,
    /// Whether a token was issued (the credentials were right).
    pub granted: bool,
    /// Whether it was one of the early-expiring tokens.
    pub short: bool,
}

#[derive(Debug)]
struct State {
    key: EcdsaKeyPair,
    kid: String,
    expire_next: AtomicUsize,
    requests: Mutex<Vec<TokenRequest>>,
    stop: AtomicBool,
}

/// A running token server (stops when dropped).
#[derive(Debug)]
pub struct TokenServer {
    addr: SocketAddr,
    cert: PathBuf,
    state: Arc<State>,
    thread: Option<std::thread::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

/// libtrust's key ID, which distribution uses to find a `kid` in its `rootcertbundle`: the
/// first 240 bits of the sha256 of the DER SubjectPublicKeyInfo, base32 (RFC 4648, unpadded),
/// in twelve groups of four separated by `:`.
pub fn libtrust_key_id(spki_der: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let digest = Sha256::digest(spki_der);
    let mut bits: u64 = 0;
    let mut nbits = 0;
    let mut out = String::new();
    for &b in &digest[..30] {
        bits = bits << 8 | u64::from(b);
        nbits += 8;
        while nbits >= 5 {
            nbits -= 5;
            out.push(char::from(ALPHABET[((bits >> nbits) & 31) as usize]));
        }
    }
    let groups: Vec<&str> = (0..out.len()).step_by(4).map(|i| &out[i..i + 4]).collect();
    groups.join(":")
}

fn b64url(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Percent-decoding of a query value (`+` is a space).
fn query_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                match std::str::from_utf8(&b[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    Some(v) => {
                        out.push(v);
                        i += 3;
                        continue;
                    }
                    None => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl State {
    fn sign(&self, user: &str, scopes: &[String], short: bool) -> Result<String> {
        let issued = now();
        let exp = if short { issued + 1 - REGISTRY_LEEWAY } else { issued + EXPIRES_IN };
        let access: Vec<serde_json::Value> = scopes
            .iter()
            .filter_map(|s| {
                let mut parts = s.splitn(3, ':');
                let (kind, name, actions) = (parts.next()?, parts.next()?, parts.next()?);
                Some(serde_json::json!({"type": kind, "name": name, "actions": actions.split(',').collect::<Vec<_>>()}))
            })
            .collect();
        let header = serde_json::json!({"typ": "JWT", "alg": "ES256", "kid": self.kid});
        let jti = format!("{issued}-{}", self.requests.lock().map(|r| r.len()).unwrap_or(0));
        let claims = serde_json::json!({
            "iss": ISSUER, "sub": user, "aud": SERVICE, "exp": exp,
            "nbf": issued - 10, "iat": issued, "jti": jti, "access": access,
        });
        let signing_input =
            format!("{}.{}", b64url(&serde_json::to_vec(&header)?), b64url(&serde_json::to_vec(&claims)?));
        let sig = self
            .key
            .sign(&SystemRandom::new(), signing_input.as_bytes())
            .map_err(|_| anyhow::anyhow!("ES256 signing failed"))?;
        Ok(format!("{signing_input}.{}", b64url(sig.as_ref())))
    }

    fn serve(&self, mut s: TcpStream) -> Result<()> {
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            ensure!(head.len() < 64 << 10 && s.read(&mut byte)? == 1, "bad request head");
            head.push(byte[0]);
        }
        let text = String::from_utf8_lossy(&head).into_owned();
        let target = text.split(' ').nth(1).unwrap_or("");
        let query = target.split_once('?').map(|(_, q)| q).unwrap_or("");
        let mut scopes = Vec::new();
        let mut service = String::new();
        for pair in query.split('&') {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            match k {
                // A scope parameter may hold several space-separated scopes.
                "scope" => {
                    scopes.extend(query_decode(v).split(' ').filter(|x| !x.is_empty()).map(str::to_owned))
                }
                "service" => service = query_decode(v),
                _ => {}
            }
        }
        let user_pass = text.lines().find_map(|l| {
            let (name, value) = l.split_once(':')?;
            if !name.eq_ignore_ascii_case("authorization") {
                return None;
            }
            let b64 = value.trim().strip_prefix("Basic ")?;
            let raw = base64::engine::general_purpose::STANDARD.decode(b64.trim()).ok()?;
            let raw = String::from_utf8(raw).ok()?;
            raw.split_once(':').map(|(u, p)| (u.to_owned(), p.to_owned()))
        });
        let granted =
            service == SERVICE && user_pass.as_ref().is_some_and(|(u, p)| u == USER && p == PASSWORD);
        let short = granted
            && self
                .expire_next
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
        let user = user_pass.map(|(u, _)| u);
        let response = if granted {
            let token = self.sign(user.as_deref().unwrap_or(""), &scopes, short)?;
            let body = serde_json::json!({
                "token": token, "access_token": token, "expires_in": EXPIRES_IN,
                "issued_at": "2026-01-01T00:00:00Z",
            })
            .to_string();
            format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len())
        } else {
            let body = r#"{"errors":[{"code":"UNAUTHORIZED","message":"invalid username or password"}]}"#;
            format!(
                "HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nWWW-Authenticate: Basic realm=\"tessera-test\"\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
        };
        if let Ok(mut r) = self.requests.lock() {
            r.push(TokenRequest { scopes, user, granted, short });
        }
        s.write_all(response.as_bytes())?;
        Ok(())
    }
}

impl TokenServer {
    /// Make the key and certificate with `openssl`, listen on a loopback port.
    pub fn start() -> Result<Self> {
        let dir = crate::testutil::tmp("token-server")?;
        let key = dir.path().join("key.pem");
        let cert = dir.path().join("cert.pem");
        run(Command::new("openssl")
            .args(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"])
            .args(["-days", "2", "-subj", "/CN=tessera-test-token-issuer", "-keyout"])
            .arg(&key)
            .arg("-out")
            .arg(&cert))
        .context("openssl (Debian package openssl)")?;
        let der = |args: &[&str], out: &Path| -> Result<Vec<u8>> {
            run(Command::new("openssl").args(args).arg("-in").arg(&key).arg("-out").arg(out))?;
            Ok(std::fs::read(out)?)
        };
        let pkcs8 = der(&["pkcs8", "-topk8", "-nocrypt", "-outform", "DER"], &dir.path().join("key.p8"))?;
        let spki = der(&["pkey", "-pubout", "-outform", "DER"], &dir.path().join("pub.der"))?;
        let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &pkcs8, &SystemRandom::new())
            .map_err(|e| anyhow::anyhow!("ring rejects openssl's PKCS#8 key: {e}"))?;
        let state = Arc::new(State {
            key,
            kid: libtrust_key_id(&spki),
            expire_next: AtomicUsize::new(0),
            requests: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
        });
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let st = state.clone();
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if st.stop.load(Ordering::SeqCst) {
                    break;
                }
                if let Ok(conn) = conn {
                    let st = st.clone();
                    std::thread::spawn(move || {
                        let _ = st.serve(conn);
                    });
                }
            }
        });
        Ok(Self { addr, cert, state, thread: Some(thread), _dir: dir })
    }

    /// The realm URL for the registry's challenge.
    pub fn realm(&self) -> String {
        format!("http://{}/token", self.addr)
    }

    /// The certificate whose key signs the tokens (the registry's `rootcertbundle`).
    pub fn cert(&self) -> &Path {
        &self.cert
    }

    /// Make the next `n` tokens expire (for the registry) about a second after they are issued.
    pub fn expire_next(&self, n: usize) {
        self.state.expire_next.store(n, Ordering::SeqCst);
    }

    /// Every token request so far.
    pub fn requests(&self) -> Vec<TokenRequest> {
        self.state.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_decode() {
        assert_eq!(query_decode("repository%3Aapp%3Apull"), "repository:app:pull");
        assert_eq!(query_decode("a+b%2"), "a b%2");
    }
}
