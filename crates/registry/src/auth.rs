//! Authentication pieces that need no I/O to test: `WWW-Authenticate` challenges, credentials
//! (`USER:PASS`, auth files) and where credentials come from.
//!
//! Credential sources, first match wins: `--creds USER:PASS`; the file named by
//! `REGISTRY_AUTH_FILE`; `$DOCKER_CONFIG/config.json`, else `~/.docker/config.json` (the binary
//! reads those variables, [`auth_file_paths`], and passes a [`CredentialSource`]). In a file,
//! `auths.<key>.auth` is `base64(USER:PASS)` (or `username` + `password` fields); `<key>` is the
//! registry `HOST[:PORT]`, optionally with a scheme, a `/v1/`/`/v2/` suffix, or a repository
//! path prefix (the longest matching key wins, as podman does).

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde::Deserialize;

use crate::error::RegistryError;

/// A user name and password (or token). `Debug` never shows the password.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

impl Credentials {
    /// Parse `USER:PASS` (the password may contain `:`).
    pub fn parse(s: &str) -> Result<Self, RegistryError> {
        match s.split_once(':') {
            Some((u, p)) if !u.is_empty() => Ok(Self { username: u.to_owned(), password: p.to_owned() }),
            Some(_) => Err(RegistryError::BadCredentials("(empty user name)")),
            None => Err(RegistryError::BadCredentials("(no ':')")),
        }
    }

    /// The `Authorization` header value for HTTP basic auth.
    pub fn basic_header(&self) -> String {
        let raw = format!("{}:{}", self.username, self.password);
        format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(raw))
    }
}

/// An authentication scheme offered by a `WWW-Authenticate` header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Challenge {
    /// `Basic realm=…`: send the credentials with every request.
    Basic,
    /// `Bearer realm=…,service=…,scope=…`: get a token from `realm`.
    Bearer { realm: String, service: Option<String>, scope: Option<String> },
}

/// Split a header into (scheme, params) challenges. Handles quoted strings with commas and
/// backslash escapes, several challenges in one header and token68 values.
fn parse_challenges(header: &str) -> Option<Vec<(String, BTreeMap<String, String>)>> {
    let b = header.as_bytes();
    let mut i = 0;
    let mut out: Vec<(String, BTreeMap<String, String>)> = Vec::new();
    let skip_ws = |i: &mut usize| {
        while *i < b.len() && (b[*i] == b' ' || b[*i] == b'\t' || b[*i] == b',') {
            *i += 1;
        }
    };
    let token = |i: &mut usize| -> String {
        let start = *i;
        while *i < b.len() && !matches!(b[*i], b' ' | b'\t' | b',' | b'=' | b'"') {
            *i += 1;
        }
        header[start..*i].to_owned()
    };
    loop {
        skip_ws(&mut i);
        if i >= b.len() {
            break;
        }
        let word = token(&mut i);
        if word.is_empty() {
            return None;
        }
        if i < b.len() && b[i] == b'=' {
            // A parameter of the current challenge.
            i += 1;
            let value = if i < b.len() && b[i] == b'"' {
                i += 1;
                let mut v = String::new();
                let mut closed = false;
                while i < b.len() {
                    match b[i] {
                        b'\\' if i + 1 < b.len() => {
                            v.push(char::from(b[i + 1]));
                            i += 2;
                        }
                        b'"' => {
                            i += 1;
                            closed = true;
                            break;
                        }
                        _ => {
                            // Multi-byte UTF-8 is copied whole.
                            let ch = header[i..].chars().next()?;
                            v.push(ch);
                            i += ch.len_utf8();
                        }
                    }
                }
                if !closed {
                    return None;
                }
                v
            } else {
                let start = i;
                while i < b.len() && b[i] != b',' && b[i] != b' ' {
                    i += 1;
                }
                header[start..i].to_owned()
            };
            let (_, params) = out.last_mut()?;
            params.insert(word.to_ascii_lowercase(), value);
        } else {
            out.push((word, BTreeMap::new()));
        }
    }
    (!out.is_empty()).then_some(out)
}

impl Challenge {
    /// Parse a `WWW-Authenticate` value; Bearer is preferred when several schemes are offered.
    /// `None` when no Basic or Bearer challenge (with a realm, for Bearer) is found.
    pub fn parse(header: &str) -> Option<Self> {
        let all = parse_challenges(header)?;
        let bearer = all.iter().find(|(s, _)| s.eq_ignore_ascii_case("bearer"));
        if let Some((_, p)) = bearer {
            let realm = p.get("realm").filter(|r| !r.is_empty())?.clone();
            return Some(Self::Bearer {
                realm,
                service: p.get("service").cloned(),
                scope: p.get("scope").cloned(),
            });
        }
        all.iter().any(|(s, _)| s.eq_ignore_ascii_case("basic")).then_some(Self::Basic)
    }
}

/// A `repository:NAME:ACTIONS` token scope.
pub fn repository_scope(repository: &str, actions: &str) -> String {
    format!("repository:{repository}:{actions}")
}

#[derive(Debug, Deserialize, Default)]
struct AuthFile {
    #[serde(default)]
    auths: BTreeMap<String, AuthEntry>,
}

#[derive(Debug, Deserialize, Default)]
struct AuthEntry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

/// `https://host:5000/v1/` → `host:5000`; `host/ns/repo` stays.
fn normalize_key(key: &str) -> &str {
    let k = key.strip_prefix("https://").or_else(|| key.strip_prefix("http://")).unwrap_or(key);
    let k = k.trim_end_matches('/');
    k.strip_suffix("/v1").or_else(|| k.strip_suffix("/v2")).unwrap_or(k)
}

/// Credentials for `registry`/`repository` in an auth file's text (`config.json` / `auth.json`
/// format). `Ok(None)` when no entry matches or the entry holds no credentials (e.g. only a
/// credential helper).
pub fn lookup_auth_file(
    text: &[u8],
    path: &Path,
    registry: &str,
    repository: &str,
) -> Result<Option<Credentials>, RegistryError> {
    let err = |reason: String| RegistryError::AuthFile { path: path.to_owned(), reason };
    let file: AuthFile = serde_json::from_slice(text).map_err(|e| err(e.to_string()))?;
    let full = format!("{registry}/{repository}");
    let best = file
        .auths
        .iter()
        .filter(|(k, _)| {
            let k = normalize_key(k);
            k.eq_ignore_ascii_case(registry)
                || (k.contains('/')
                    && full.starts_with(k)
                    && matches!(full.as_bytes().get(k.len()), None | Some(&b'/')))
        })
        .max_by_key(|(k, _)| normalize_key(k).len());
    let Some((key, entry)) = best else { return Ok(None) };
    if let Some(auth) = entry.auth.as_deref().filter(|a| !a.is_empty()) {
        let raw = base64::engine::general_purpose::STANDARD
            .decode(auth.trim())
            .map_err(|e| err(format!("auths.{key:?}.auth is not base64: {e}")))?;
        let text = String::from_utf8(raw).map_err(|_| err(format!("auths.{key:?}.auth is not UTF-8")))?;
        return Credentials::parse(&text)
            .map(Some)
            .map_err(|_| err(format!("auths.{key:?}.auth does not decode to USER:PASS")));
    }
    match (&entry.username, &entry.password) {
        (Some(u), Some(p)) if !u.is_empty() => {
            Ok(Some(Credentials { username: u.clone(), password: p.clone() }))
        }
        _ => Ok(None),
    }
}

/// The auth files consulted, in order: `$REGISTRY_AUTH_FILE`, then `$DOCKER_CONFIG/config.json`
/// or `$HOME/.docker/config.json`.
pub fn auth_file_paths(env: impl Fn(&str) -> Option<String>) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = env("REGISTRY_AUTH_FILE").filter(|p| !p.is_empty()) {
        out.push(PathBuf::from(p));
    }
    if let Some(d) = env("DOCKER_CONFIG").filter(|p| !p.is_empty()) {
        out.push(Path::new(&d).join("config.json"));
    } else if let Some(h) = env("HOME").filter(|p| !p.is_empty()) {
        out.push(Path::new(&h).join(".docker/config.json"));
    }
    out
}

/// Where a client's credentials come from; see the module docs for the order. The binary builds
/// it from `--creds` and its environment ([`auth_file_paths`]); this crate reads no environment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum CredentialSource {
    /// `--creds USER:PASS`: these credentials only (the auth files are not read).
    Explicit(Credentials),
    /// The first of these auth files (in order) with an entry for the registry; none: anonymous.
    AuthFiles(Vec<PathBuf>),
    /// Anonymous access only (the default).
    #[default]
    Anonymous,
}

impl CredentialSource {
    /// `Explicit` when `creds` is given, else the auth files `auth_files`.
    pub fn new(creds: Option<Credentials>, auth_files: Vec<PathBuf>) -> Self {
        creds.map_or(Self::AuthFiles(auth_files), Self::Explicit)
    }

    /// Resolve to credentials for `registry`/`repository` (reads the auth files for `AuthFiles`;
    /// a missing file is skipped).
    pub fn resolve(&self, registry: &str, repository: &str) -> Result<Option<Credentials>, RegistryError> {
        match self {
            Self::Explicit(c) => Ok(Some(c.clone())),
            Self::Anonymous => Ok(None),
            Self::AuthFiles(paths) => {
                for path in paths {
                    let text = match std::fs::read(path) {
                        Ok(t) => t,
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                        Err(e) => {
                            return Err(RegistryError::AuthFile { path: path.clone(), reason: e.to_string() })
                        }
                    };
                    if let Some(c) = lookup_auth_file(&text, path, registry, repository)? {
                        tracing::debug!(path = %path.display(), registry, "credentials from auth file");
                        return Ok(Some(c));
                    }
                }
                Ok(None)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges() {
        let c = Challenge::parse(
            r#"Bearer realm="https://auth.example.com/token",service="registry.example.com",scope="repository:a/b:pull,push""#,
        );
        assert_eq!(
            c,
            Some(Challenge::Bearer {
                realm: "https://auth.example.com/token".into(),
                service: Some("registry.example.com".into()),
                scope: Some("repository:a/b:pull,push".into()),
            })
        );
        assert_eq!(Challenge::parse(r#"Basic realm="Registry Realm""#), Some(Challenge::Basic));
        assert_eq!(Challenge::parse("basic"), Some(Challenge::Basic));
        // Several challenges in one header: Bearer wins; escapes; unquoted values; odd spacing.
        let c = Challenge::parse(
            r#"Basic realm="x, y", Bearer  realm=http://t/tok ,error="invalid_token", service="s\"q""#,
        );
        assert_eq!(
            c,
            Some(Challenge::Bearer {
                realm: "http://t/tok".into(),
                service: Some("s\"q".into()),
                scope: None
            })
        );
        assert_eq!(Challenge::parse(r#"Bearer service="s""#), None, "bearer without realm");
        assert_eq!(Challenge::parse(r#"Bearer realm="unterminated"#), None);
        assert_eq!(Challenge::parse("Negotiate abc=="), None);
        assert_eq!(Challenge::parse(""), None);
        assert_eq!(Challenge::parse("=x"), None);
    }

    #[test]
    fn credentials() {
        let c = Credentials::parse("user:pa:ss").unwrap();
        assert_eq!((c.username.as_str(), c.password.as_str()), ("user", "pa:ss"));
        assert_eq!(Credentials::parse("u:").unwrap().password, "");
        assert!(Credentials::parse(":p").is_err());
        assert!(Credentials::parse("nocolon").is_err());
        assert_eq!(
            Credentials { username: "Aladdin".into(), password: "open sesame".into() }.basic_header(),
            "Basic QWxhZGRpbjpvcGVuIHNlc2FtZQ=="
        );
        assert!(!format!("{c:?}").contains("pa:ss"));
    }

    #[test]
    fn auth_files() {
        let p = Path::new("config.json");
        // user:pass = dXNlcjpwYXNz; other:secret = b3RoZXI6c2VjcmV0
        let text = br#"{"auths": {
            "https://reg.example.com:5000/v1/": {"auth": "dXNlcjpwYXNz"},
            "reg.example.com:5000/team/app": {"auth": "b3RoZXI6c2VjcmV0"},
            "127.0.0.1:5000": {"username": "u2", "password": "p2"},
            "helper-only.example": {}
        }, "credHelpers": {"x": "y"}}"#;
        let get = |r: &str, repo: &str| lookup_auth_file(text, p, r, repo).unwrap().map(|c| c.username);
        assert_eq!(get("reg.example.com:5000", "other"), Some("user".into()));
        assert_eq!(get("reg.example.com:5000", "team/app"), Some("other".into()));
        assert_eq!(get("reg.example.com:5000", "team/application"), Some("user".into()));
        assert_eq!(get("127.0.0.1:5000", "x"), Some("u2".into()));
        assert_eq!(get("reg.example.com", "x"), None, "the port is part of the key");
        assert_eq!(get("helper-only.example", "x"), None);
        assert_eq!(get("nowhere", "x"), None);
        assert!(matches!(
            lookup_auth_file(br#"{"auths": {"h": {"auth": "!!"}}}"#, p, "h", "r"),
            Err(RegistryError::AuthFile { .. })
        ));
        assert!(matches!(
            lookup_auth_file(br#"{"auths": {"h": {"auth": "bm9jb2xvbg=="}}}"#, p, "h", "r"),
            Err(RegistryError::AuthFile { .. })
        ));
        assert!(matches!(lookup_auth_file(b"{", p, "h", "r"), Err(RegistryError::AuthFile { .. })));
        assert_eq!(lookup_auth_file(b"{}", p, "h", "r").unwrap(), None);
    }

    #[test]
    fn auth_files_are_read_in_order_and_missing_ones_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.json"), dir.path().join("b.json"));
        std::fs::write(&a, br#"{"auths": {"other.example": {"username": "ua", "password": "pa"}}}"#).unwrap();
        std::fs::write(&b, br#"{"auths": {"reg.example": {"username": "ub", "password": "pb"}}}"#).unwrap();
        let files = CredentialSource::new(None, vec![dir.path().join("missing.json"), a.clone(), b]);
        let user = |src: &CredentialSource, reg: &str| src.resolve(reg, "r").unwrap().map(|c| c.username);
        assert_eq!(user(&files, "reg.example"), Some("ub".into()));
        assert_eq!(user(&files, "other.example"), Some("ua".into()));
        assert_eq!(user(&files, "nowhere.example"), None);
        let explicit = CredentialSource::new(Some(Credentials::parse("me:pw").unwrap()), vec![a]);
        assert_eq!(user(&explicit, "other.example"), Some("me".into()), "--creds wins over the files");
        assert_eq!(user(&CredentialSource::default(), "reg.example"), None, "the default is anonymous");
    }

    #[test]
    fn auth_file_order() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| (*v).to_owned())
        };
        assert_eq!(
            auth_file_paths(env(&[("REGISTRY_AUTH_FILE", "/a.json"), ("HOME", "/home/u")])),
            vec![PathBuf::from("/a.json"), PathBuf::from("/home/u/.docker/config.json")]
        );
        assert_eq!(
            auth_file_paths(env(&[("DOCKER_CONFIG", "/d"), ("HOME", "/home/u")])),
            vec![PathBuf::from("/d/config.json")]
        );
        assert!(auth_file_paths(env(&[])).is_empty());
    }
}
