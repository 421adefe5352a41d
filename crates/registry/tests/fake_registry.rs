//! The client against a minimal in-test HTTP responder: what the real registry cannot do alone
//! (a bearer token server whose tokens expire mid-pull, 503s, bodies cut mid-way, servers that
//! ignore Range, wrong bytes). The real CNCF registry is exercised end to end in
//! `tests/tests/oci_registry.rs`.

#![allow(clippy::unwrap_used)] // a test double: any failure in it is a test failure

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest as _, Sha256};
use tessera_registry::{
    unwrap_io, BlobPush, Client, ClientOptions, CredentialSource, Credentials, Digest, ManifestKind,
    PushOptions, RegistryError, RetryPolicy, Target,
};

#[derive(Debug, Clone)]
struct Req {
    method: String,
    path: String,
    headers: HashMap<String, String>,
    body: Vec<u8>,
}

#[derive(Debug, Default)]
struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Send only this many body bytes (Content-Length still says all), then close.
    cut: Option<usize>,
}

fn resp(status: u16, body: &[u8]) -> Resp {
    Resp { status, body: body.to_vec(), ..Resp::default() }
}

type Handler = Arc<dyn Fn(&Req) -> Resp + Send + Sync>;

/// One request per connection; the log records every request.
struct Fake {
    addr: SocketAddr,
    log: Arc<Mutex<Vec<Req>>>,
}

fn serve_one(mut s: TcpStream, handler: &Handler, log: &Mutex<Vec<Req>>) -> std::io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut r = BufReader::new(s.try_clone()?);
    let mut line = String::new();
    if r.read_line(&mut line).is_err() || !line.ends_with("\r\n") {
        return Ok(()); // e.g. a TLS ClientHello: not HTTP
    }
    let mut parts = line.split_whitespace();
    let (Some(method), Some(path)) = (parts.next(), parts.next()) else { return Ok(()) };
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h)?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
        }
    }
    let len: usize = headers.get("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    let req = Req { method: method.to_owned(), path: path.to_owned(), headers, body };
    log.lock().unwrap().push(req.clone());
    let out = handler(&req);
    let mut head =
        format!("HTTP/1.1 {} X\r\nContent-Length: {}\r\nConnection: close\r\n", out.status, out.body.len());
    for (k, v) in &out.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())?;
    if req.method != "HEAD" {
        let n = out.cut.unwrap_or(out.body.len()).min(out.body.len());
        s.write_all(&out.body[..n])?;
    }
    s.flush()
}

impl Fake {
    fn start(handler: impl Fn(&Req) -> Resp + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let handler: Handler = Arc::new(handler);
        let log2 = log.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let (h, l) = (handler.clone(), log2.clone());
                std::thread::spawn(move || {
                    let _ = serve_one(conn, &h, &l);
                });
            }
        });
        Self { addr, log }
    }

    fn requests(&self, path_part: &str) -> Vec<Req> {
        self.log.lock().unwrap().iter().filter(|r| r.path.contains(path_part)).cloned().collect()
    }

    fn client(&self, creds: Option<(&str, &str)>) -> Client {
        let credentials = match creds {
            Some((u, p)) => {
                CredentialSource::Explicit(Credentials { username: u.into(), password: p.into() })
            }
            None => CredentialSource::Anonymous,
        };
        let retry = RetryPolicy {
            attempts: 4,
            base: Duration::from_millis(1),
            max: Duration::from_millis(5),
            ..RetryPolicy::default()
        };
        Client::new(&self.addr.to_string(), ClientOptions { credentials, retry, ..ClientOptions::default() })
            .unwrap()
    }
}

fn digest_of(b: &[u8]) -> Digest {
    Digest::parse(&format!("sha256:{}", hex::encode(Sha256::digest(b)))).unwrap()
}

const MANIFEST: &[u8] = br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"digest":"x"},"layers":[]}"#;

fn blob_bytes() -> Vec<u8> {
    (0..200_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect()
}

fn read_all(c: &Client, d: &Digest, size: Option<u64>) -> Result<Vec<u8>, RegistryError> {
    let mut r = c.get_blob("app", d, size)?;
    let mut out = Vec::new();
    r.read_to_end(&mut out).map_err(|e| unwrap_io("blob", e))?;
    Ok(out)
}

/// Bearer auth from the challenge: basic credentials go to the realm with service and scope;
/// a token that stops working mid-pull (401) is replaced and the request retried.
#[test]
fn bearer_tokens_are_fetched_and_refreshed() {
    let blob = blob_bytes();
    let d = digest_of(&blob);
    let state = Arc::new(Mutex::new((0u32, String::new()))); // (tokens issued, valid token)
    let addr_cell: Arc<Mutex<Option<SocketAddr>>> = Arc::new(Mutex::new(None));
    let (st, ac, blob2) = (state.clone(), addr_cell.clone(), blob.clone());
    let fake = Fake::start(move |r| {
        let addr = ac.lock().unwrap().unwrap();
        let challenge = format!(
            r#"Bearer realm="http://{addr}/token",service="fake registry",scope="repository:app:pull""#
        );
        let unauthorized = || Resp {
            status: 401,
            headers: vec![("WWW-Authenticate".into(), challenge.clone())],
            body: br#"{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}"#.to_vec(),
            cut: None,
        };
        if r.path.starts_with("/token") {
            // user:pw
            if r.headers.get("authorization").map(String::as_str) != Some("Basic dXNlcjpwdw==") {
                return resp(401, b"bad basic");
            }
            assert!(r.path.contains("service=fake%20registry"), "{}", r.path);
            assert!(r.path.contains("scope=repository%3Aapp%3Apull"), "{}", r.path);
            let mut s = st.lock().unwrap();
            s.0 += 1;
            s.1 = format!("tok{}", s.0);
            return resp(200, format!(r#"{{"token":"{}","expires_in":300}}"#, s.1).as_bytes());
        }
        let valid = format!("Bearer {}", st.lock().unwrap().1);
        if r.headers.get("authorization") != Some(&valid) {
            return unauthorized();
        }
        if r.path == "/v2/app/manifests/v1" {
            let mut m = resp(200, MANIFEST);
            m.headers.push(("Content-Type".into(), "application/vnd.oci.image.manifest.v1+json".into()));
            // The token expires right after this request.
            st.lock().unwrap().1 = "expired".into();
            return m;
        }
        if r.path.starts_with("/v2/app/blobs/") {
            return resp(200, &blob2);
        }
        resp(404, b"")
    });
    *addr_cell.lock().unwrap() = Some(fake.addr);

    let anonymous = fake.client(None);
    let e = anonymous.get_manifest("app", &Target::Tag("v1".into())).unwrap_err();
    // The token server's 401 is reported as such, with the hint for missing credentials.
    assert!(matches!(e, RegistryError::Unauthorized { .. }) && e.to_string().contains("--creds"), "{e}");

    let c = fake.client(Some(("user", "pw")));
    let m = c.get_manifest("app", &Target::Tag("v1".into())).unwrap();
    assert_eq!(m.kind, ManifestKind::Image);
    assert_eq!(m.digest, digest_of(MANIFEST));
    assert_eq!(read_all(&c, &d, Some(blob.len() as u64)).unwrap(), blob);
    let tokens = fake.requests("/token").len();
    assert_eq!(state.lock().unwrap().0, 2, "one token, then one refresh after the mid-pull 401");
    assert!(tokens >= 2);
    // The refreshed token is reused, not fetched again.
    assert_eq!(read_all(&c, &d, None).unwrap(), blob);
    assert_eq!(state.lock().unwrap().0, 2);
}

/// 503 and 429 are retried; a body cut mid-way is resumed with a Range request (206) or, from a
/// server that ignores Range, re-read and skipped; the joined stream is verified.
#[test]
fn retries_and_resumes() {
    let blob = blob_bytes();
    let d = digest_of(&blob);
    let calls = Arc::new(Mutex::new(0u32));
    let (c2, b2) = (calls.clone(), blob.clone());
    let fake = Fake::start(move |r| {
        if r.path == "/v2/" {
            return resp(200, b"{}");
        }
        let mut n = c2.lock().unwrap();
        *n += 1;
        match (r.path.as_str(), *n) {
            (p, 1) if p.contains("/blobs/") => resp(503, b""),
            (p, 2) if p.contains("/blobs/") => {
                Resp { status: 429, headers: vec![("Retry-After".into(), "0".into())], ..Resp::default() }
            }
            (p, 3) if p.contains("/blobs/") => Resp { cut: Some(70_000), ..resp(200, &b2) },
            (p, _) if p.contains("/blobs/") => {
                let range = r.headers.get("range").cloned().unwrap_or_default();
                let start: usize = range.trim_start_matches("bytes=").trim_end_matches('-').parse().unwrap();
                Resp {
                    status: 206,
                    headers: vec![(
                        "Content-Range".into(),
                        format!("bytes {start}-{}/{}", b2.len() - 1, b2.len()),
                    )],
                    body: b2[start..].to_vec(),
                    cut: None,
                }
            }
            _ => resp(404, b""),
        }
    });
    let c = fake.client(None);
    assert_eq!(read_all(&c, &d, Some(blob.len() as u64)).unwrap(), blob);
    let blobs = fake.requests("/blobs/");
    assert_eq!(blobs.len(), 4);
    assert_eq!(blobs[3].headers.get("range").map(String::as_str), Some("bytes=70000-"));

    // A server that ignores Range: the resumed request is re-read from 0 and skipped.
    let b3 = blob.clone();
    let first = Arc::new(Mutex::new(true));
    let fake = Fake::start(move |r| {
        if r.path == "/v2/" {
            return resp(200, b"{}");
        }
        let mut f = first.lock().unwrap();
        let cut = if *f { Some(50_000) } else { None };
        *f = false;
        Resp { cut, ..resp(200, &b3) }
    });
    let c = fake.client(None);
    assert_eq!(read_all(&c, &d, Some(blob.len() as u64)).unwrap(), blob);
    // Ranges: exact bytes whether the server honours Range or not.
    assert_eq!(c.get_blob_range("app", &d, 1000, 5000).unwrap(), blob[1000..6000].to_vec());
}

/// Too many failures end in a typed error naming the URL; wrong bytes never pass.
#[test]
fn failures_are_typed() {
    let blob = blob_bytes();
    let d = digest_of(&blob);
    let mut wrong = blob.clone();
    wrong[100] ^= 1;
    let fake = Fake::start(move |r| match r.path.as_str() {
        "/v2/" => resp(200, b"{}"),
        "/v2/app/manifests/tagged" => Resp {
            headers: vec![("Docker-Content-Digest".into(), format!("sha256:{}", "0".repeat(64)))],
            ..resp(200, MANIFEST)
        },
        "/v2/app/manifests/v1schema" => Resp {
            headers: vec![(
                "Content-Type".into(),
                "application/vnd.docker.distribution.manifest.v1+prettyjws".into(),
            )],
            ..resp(200, br#"{"schemaVersion":1}"#)
        },
        p if p.starts_with("/v2/app/manifests/sha256:") => resp(200, MANIFEST),
        p if p.starts_with("/v2/down/") => resp(503, b""),
        p if p.starts_with("/v2/app/blobs/") => resp(200, &wrong),
        _ => resp(404, br#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}"#),
    });
    let c = fake.client(None);
    let e = read_all(&c, &d, None).unwrap_err();
    assert!(matches!(e, RegistryError::DigestMismatch { .. }), "{e}");
    let e = read_all(&c, &d, Some(5)).unwrap_err();
    assert!(matches!(e, RegistryError::SizeMismatch { .. }), "{e}");
    let e = c.get_manifest("app", &Target::Tag("tagged".into())).unwrap_err();
    assert!(matches!(e, RegistryError::DigestMismatch { what: "manifest", .. }), "{e}");
    let e = c.get_manifest("app", &Target::Digest(d.clone())).unwrap_err();
    assert!(matches!(e, RegistryError::DigestMismatch { .. }), "by digest: {e}");
    assert!(c.get_manifest("app", &Target::Digest(digest_of(MANIFEST))).is_ok());
    let e = c.get_manifest("app", &Target::Tag("v1schema".into())).unwrap_err();
    assert!(matches!(e, RegistryError::UnsupportedMediaType { .. }), "{e}");
    let e = c.get_manifest("app", &Target::Tag("nope".into())).unwrap_err();
    assert!(
        matches!(&e, RegistryError::NotFound { detail, .. } if detail.contains("MANIFEST_UNKNOWN")),
        "{e}"
    );
    let e = c.get_manifest("down", &Target::Tag("x".into())).unwrap_err();
    assert!(matches!(e, RegistryError::Status { status: 503, .. }), "{e}");
    assert!(e.to_string().contains(&format!("http://{}/v2/down/manifests/x", fake.addr)), "{e}");
    assert_eq!(fake.requests("/v2/down/").len(), 4, "attempts in all");
    assert_eq!(c.blob_size("app", &d).unwrap(), Some(blob.len() as u64));
    assert_eq!(c.blob_size("none", &d).unwrap(), None);

    // Nothing listening: a transport error after the retries.
    let dead = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let c = Client::new(
        &dead.to_string(),
        ClientOptions {
            retry: RetryPolicy {
                attempts: 2,
                base: Duration::from_millis(1),
                max: Duration::from_millis(2),
                ..RetryPolicy::default()
            },
            ..ClientOptions::default()
        },
    )
    .unwrap();
    assert!(matches!(c.ping(), Err(RegistryError::Transport { .. })));
}

/// Basic auth: credentials sent after the challenge; refused ones end in Unauthorized.
#[test]
fn basic_auth() {
    let fake = Fake::start(|r| {
        if r.headers.get("authorization").map(String::as_str) == Some("Basic dXNlcjpwdw==") {
            return if r.path == "/v2/" { resp(200, b"{}") } else { resp(200, MANIFEST) };
        }
        Resp {
            status: 401,
            headers: vec![("WWW-Authenticate".into(), r#"Basic realm="x""#.into())],
            ..Resp::default()
        }
    });
    let m = fake.client(Some(("user", "pw"))).get_manifest("app", &Target::Tag("v1".into())).unwrap();
    assert_eq!(m.bytes, MANIFEST);
    let e = fake.client(Some(("user", "bad"))).get_manifest("app", &Target::Tag("v1".into())).unwrap_err();
    assert!(matches!(e, RegistryError::Unauthorized { status: 401, .. }), "{e}");
    let e = fake.client(None).get_manifest("app", &Target::Tag("v1".into())).unwrap_err();
    assert!(matches!(e, RegistryError::Unauthorized { .. }) && e.to_string().contains("--creds"), "{e}");
}

/// Credentials from an auth file are read again on a 401: a password rotated under a running
/// client (the file rewritten) is picked up without a restart.
#[test]
fn a_rewritten_auth_file_is_read_again_on_a_401() {
    let fake = Fake::start(|r| {
        if r.headers.get("authorization").map(String::as_str) == Some("Basic dXNlcjpwdw==") {
            return if r.path == "/v2/" { resp(200, b"{}") } else { resp(200, MANIFEST) };
        }
        Resp {
            status: 401,
            headers: vec![("WWW-Authenticate".into(), r#"Basic realm="x""#.into())],
            ..Resp::default()
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.json");
    let write = |pass: &str| {
        use base64::Engine as _;
        let auth = base64::engine::general_purpose::STANDARD.encode(format!("user:{pass}"));
        let text = format!(r#"{{"auths": {{"{}": {{"auth": "{auth}"}}}}}}"#, fake.addr);
        std::fs::write(&file, text).unwrap();
    };
    write("old");
    let retry = RetryPolicy {
        attempts: 2,
        base: Duration::from_millis(1),
        max: Duration::from_millis(2),
        ..RetryPolicy::default()
    };
    let options = ClientOptions {
        credentials: CredentialSource::AuthFiles(vec![file.clone()]),
        retry,
        ..ClientOptions::default()
    };
    let client = Client::new(&fake.addr.to_string(), options).unwrap();
    let e = client.get_manifest("app", &Target::Tag("v1".into())).unwrap_err();
    assert!(matches!(e, RegistryError::Unauthorized { status: 401, .. }), "{e}");
    write("pw");
    let m = client.get_manifest("app", &Target::Tag("v1".into())).unwrap();
    assert_eq!(m.bytes, MANIFEST);
}

/// A blob GET redirected to another host (as registries backed by object storage do): the
/// redirect is followed with the Range header and without the registry's credentials.
#[test]
fn redirected_blob_reads_do_not_leak_credentials() {
    let blob = blob_bytes();
    let d = digest_of(&blob);
    let b2 = blob.clone();
    let storage = Fake::start(move |r| match r.headers.get("range") {
        Some(range) => {
            let (a, b) = range.trim_start_matches("bytes=").split_once('-').unwrap();
            let (a, b): (usize, usize) = (a.parse().unwrap(), b.parse().unwrap());
            Resp {
                status: 206,
                headers: vec![("Content-Range".into(), format!("bytes {a}-{b}/{}", b2.len()))],
                body: b2[a..=b].to_vec(),
                cut: None,
            }
        }
        None => resp(200, &b2),
    });
    let target = format!("http://{}/bucket/blob?sig=abc", storage.addr);
    let registry = Fake::start(move |r| {
        if r.headers.get("authorization").map(String::as_str) != Some("Basic dXNlcjpwdw==") {
            return Resp {
                status: 401,
                headers: vec![("WWW-Authenticate".into(), r#"Basic realm="x""#.into())],
                ..Resp::default()
            };
        }
        if r.path.starts_with("/v2/app/blobs/") {
            return Resp {
                status: 307,
                headers: vec![("Location".into(), target.clone())],
                ..Resp::default()
            };
        }
        resp(200, b"{}")
    });
    let c = registry.client(Some(("user", "pw")));
    assert_eq!(c.get_blob_range("app", &d, 1000, 5000).unwrap(), blob[1000..6000].to_vec());
    assert_eq!(read_all(&c, &d, Some(blob.len() as u64)).unwrap(), blob);
    let seen = storage.requests("/bucket/");
    assert_eq!(seen.len(), 2);
    for r in &seen {
        assert!(!r.headers.contains_key("authorization"), "credentials sent to the storage host: {r:?}");
    }
    assert_eq!(seen[0].headers.get("range").map(String::as_str), Some("bytes=1000-5999"));
}

/// The upload state a fake registry keeps for the push test.
#[derive(Default)]
struct Uploads {
    received: Vec<u8>,
    committed: Vec<(String, Vec<u8>)>,
    patches: u32,
    puts: u32,
    manifests: Vec<(String, String, Vec<u8>)>,
    scopes: Vec<String>,
}

/// Push against a bearer-token registry: scopes `pull,push` (plus the mount source's `pull`),
/// a mount, a blob in PATCH pieces of 1 MiB with a piece the registry took but answered 500 to
/// (the retry gets 416; the upload's status settles it), a final PUT committed but answered 503
/// (the retry gets 404; a HEAD settles it), and a manifest PUT with its media type.
#[test]
fn push_mounts_uploads_in_pieces_and_settles_ambiguous_answers() {
    let blob: Vec<u8> = (0..2_500_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let d = digest_of(&blob);
    let mounted = digest_of(b"in the base repository");
    let state = Arc::new(Mutex::new(Uploads::default()));
    let addr_cell: Arc<Mutex<Option<SocketAddr>>> = Arc::new(Mutex::new(None));
    let (st, ac) = (state.clone(), addr_cell.clone());
    let (dh, mh) = (d.to_string(), mounted.to_string());
    let fake = Fake::start(move |r| {
        let addr = ac.lock().unwrap().unwrap();
        let mut s = st.lock().unwrap();
        if r.path.starts_with("/token") {
            s.scopes.push(r.path.clone());
            return resp(200, br#"{"token":"t","expires_in":300}"#);
        }
        if r.headers.get("authorization").map(String::as_str) != Some("Bearer t") {
            return Resp {
                status: 401,
                headers: vec![("WWW-Authenticate".into(), format!(r#"Bearer realm="http://{addr}/token""#))],
                ..Resp::default()
            };
        }
        let loc = |n: usize| vec![("Location".to_string(), format!("/v2/app/blobs/uploads/u1?_state={n}"))];
        let path = r.path.as_str();
        match r.method.as_str() {
            "HEAD" if path.starts_with("/v2/app/blobs/") => {
                let want = path.trim_start_matches("/v2/app/blobs/");
                if s.committed.iter().any(|(c, _)| c == want) {
                    resp(200, b"")
                } else {
                    resp(404, b"")
                }
            }
            "HEAD" => resp(404, b""),
            "POST" if path.contains(&format!("mount={mh}&from=base")) => resp(201, b""),
            "POST" if path == "/v2/app/blobs/uploads/" => {
                s.received.clear();
                Resp { status: 202, headers: loc(0), ..Resp::default() }
            }
            "PATCH" => {
                s.patches += 1;
                let range = r.headers.get("content-range").cloned().unwrap_or_default();
                let start: usize = range.split('-').next().unwrap().parse().unwrap();
                if start != s.received.len() {
                    return resp(416, b"");
                }
                s.received.extend_from_slice(&r.body);
                let n = s.received.len();
                if s.patches == 2 {
                    return resp(500, b"took it, then failed");
                }
                let mut h = loc(n);
                h.push(("Range".into(), format!("0-{}", n - 1)));
                Resp { status: 202, headers: h, ..Resp::default() }
            }
            "GET" if path.starts_with("/v2/app/blobs/uploads/u1") => {
                let n = s.received.len();
                let mut h = loc(n);
                h.push(("Range".into(), format!("0-{}", n - 1)));
                Resp { status: 204, headers: h, ..Resp::default() }
            }
            "PUT" if path.starts_with("/v2/app/blobs/uploads/u1") => {
                s.puts += 1;
                if s.puts > 1 {
                    return resp(404, br#"{"errors":[{"code":"BLOB_UPLOAD_UNKNOWN","message":"x"}]}"#);
                }
                assert!(path.contains(&format!("&digest={dh}")), "{path}");
                let mut all = std::mem::take(&mut s.received);
                all.extend_from_slice(&r.body);
                let got = format!("sha256:{}", hex::encode(Sha256::digest(&all)));
                s.committed.push((got, all));
                resp(503, b"committed, then failed")
            }
            "PUT" if path.starts_with("/v2/app/manifests/") => {
                let ct = r.headers.get("content-type").cloned().unwrap_or_default();
                s.manifests.push((path.to_owned(), ct, r.body.clone()));
                Resp {
                    status: 201,
                    headers: vec![("Docker-Content-Digest".into(), digest_of(&r.body).to_string())],
                    ..Resp::default()
                }
            }
            _ => resp(if path == "/v2/" { 200 } else { 404 }, b""),
        }
    });
    *addr_cell.lock().unwrap() = Some(fake.addr);
    let c = fake.client(Some(("user", "pw")));
    let options = PushOptions { mount_from: vec!["base".into()], piece: 1 << 20 };
    let mut opened = false;
    let how = c
        .push_blob(
            "app",
            &mounted,
            23,
            &options,
            || {
                opened = true;
                Ok(std::io::Cursor::new(Vec::new()))
            },
            &mut |_| {},
        )
        .unwrap();
    assert_eq!(how, BlobPush::Mounted);
    assert!(!opened, "a mounted blob is never read");

    let mut progress = 0u64;
    let options = PushOptions { mount_from: Vec::new(), piece: 1 << 20 };
    let how = push_bytes(&c, &d, blob.len() as u64, &options, &blob, &mut |n| progress += n).unwrap();
    assert_eq!(how, BlobPush::Uploaded);
    assert_eq!(progress, blob.len() as u64);
    let s = state.lock().unwrap();
    assert_eq!(s.committed.len(), 1);
    assert_eq!(s.committed[0].0, d.to_string());
    assert_eq!(s.committed[0].1, blob, "the registry got exactly the blob");
    assert_eq!(s.patches, 4, "3 pieces, one of them sent twice");
    assert!(s.scopes.iter().any(|p| p.contains("scope=repository%3Aapp%3Apull%2Cpush")), "{:?}", s.scopes);
    assert!(s.scopes.iter().any(|p| p.contains("scope=repository%3Abase%3Apull")), "{:?}", s.scopes);
    drop(s);
    // Pushing it again: HEAD says it is there.
    let how = push_bytes(&c, &d, blob.len() as u64, &options, b"", &mut |_| {}).unwrap();
    assert_eq!(how, BlobPush::Present);
    // A source shorter than announced is an error, not a short blob.
    let e = push_bytes(&c, &digest_of(b"other"), 10, &options, b"short", &mut |_| {}).unwrap_err();
    assert!(matches!(e, RegistryError::SizeMismatch { .. }), "{e}");

    let media = "application/vnd.oci.image.manifest.v1+json";
    assert_eq!(c.put_manifest("app", "v1", media, MANIFEST).unwrap(), digest_of(MANIFEST));
    assert_eq!(c.manifest_digest("app", "v1").unwrap(), None, "this fake never answers HEAD 200");
    let s = state.lock().unwrap();
    assert_eq!(s.manifests, vec![("/v2/app/manifests/v1".to_owned(), media.to_owned(), MANIFEST.to_vec())]);
}

/// `push_blob` into `app` of `bytes`, announced as `size` bytes.
fn push_bytes(
    c: &Client,
    d: &Digest,
    size: u64,
    options: &PushOptions,
    bytes: &[u8],
    progress: &mut dyn FnMut(u64),
) -> Result<BlobPush, RegistryError> {
    let bytes = bytes.to_vec();
    c.push_blob("app", d, size, options, move || Ok(std::io::Cursor::new(bytes)), progress)
}

/// Range reads from many threads sharing one client: at most `max_ranges` are in flight at once,
/// and every one gets its bytes.
#[test]
fn range_reads_are_limited_per_client() {
    let blob = blob_bytes();
    let d = digest_of(&blob);
    let in_flight = Arc::new(Mutex::new((0usize, 0usize))); // (now, most)
    let (f2, b2) = (in_flight.clone(), blob.clone());
    let fake = Fake::start(move |r| {
        if r.path == "/v2/" {
            return resp(200, b"{}");
        }
        {
            let mut f = f2.lock().unwrap();
            f.0 += 1;
            f.1 = f.1.max(f.0);
        }
        std::thread::sleep(Duration::from_millis(60));
        let range = r.headers.get("range").cloned().unwrap_or_default();
        let (a, b) = range.trim_start_matches("bytes=").split_once('-').unwrap();
        let (a, b): (usize, usize) = (a.parse().unwrap(), b.parse().unwrap());
        f2.lock().unwrap().0 -= 1;
        Resp {
            status: 206,
            headers: vec![("Content-Range".into(), format!("bytes {a}-{b}/{}", b2.len()))],
            body: b2[a..=b].to_vec(),
            cut: None,
        }
    });
    // The server takes 60 ms per range and 1 ms for the ping: no late-head resends, whose
    // abandoned requests would still be in the server's count.
    let retry = RetryPolicy {
        attempts: 1,
        base: Duration::from_millis(1),
        max: Duration::from_millis(1),
        resend_late: None,
        ..RetryPolicy::default()
    };
    let c = Client::new(
        &fake.addr.to_string(),
        ClientOptions {
            credentials: CredentialSource::Anonymous,
            retry,
            max_ranges: 3,
            ..ClientOptions::default()
        },
    )
    .unwrap();
    c.ping().unwrap();
    std::thread::scope(|s| {
        for i in 0..12u64 {
            let (c, d, blob) = (&c, &d, &blob);
            s.spawn(move || {
                let got = c.get_blob_range("app", d, i * 1000, 500).unwrap();
                assert_eq!(got, blob[(i * 1000) as usize..(i * 1000 + 500) as usize]);
            });
        }
    });
    let most = in_flight.lock().unwrap().1;
    assert!((1..=3).contains(&most), "{most} range reads were in flight at once (limit 3)");
}
