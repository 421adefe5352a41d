//! Image references `HOST[:PORT]/REPO[:TAG|@DIGEST]` and content digests. Pure parsing, no I/O.
//!
//! The host is always explicit (no `docker.io` shorthand): the first path component is the
//! registry. Repository components follow the distribution grammar
//! (`[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`), tags `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`, digests
//! `sha256:<64 lowercase hex>` (the only algorithm the client can verify).

use std::fmt;
use std::net::IpAddr;

use sha2::{Digest as _, Sha256};

use crate::error::RegistryError;

/// A sha256 content digest.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest {
    hex: String,
}

impl Digest {
    /// Parse `sha256:<64 lowercase hex>`; `None` for anything else.
    pub fn parse(s: &str) -> Option<Self> {
        let hex = s.strip_prefix("sha256:")?;
        let ok = hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        ok.then(|| Self { hex: hex.to_owned() })
    }

    /// The digest whose 32 raw bytes are `raw`.
    pub fn from_raw(raw: &[u8; 32]) -> Self {
        Self { hex: hex::encode(raw) }
    }

    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self { hex: hex::encode(Sha256::digest(bytes)) }
    }

    pub(crate) fn from_hasher(h: Sha256) -> Self {
        Self { hex: hex::encode(h.finalize()) }
    }

    /// The 64 hex digits.
    pub fn hex(&self) -> &str {
        &self.hex
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex)
    }
}

/// What a reference names inside its repository.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Target {
    Tag(String),
    Digest(Digest),
}

impl Target {
    /// The text used in `/v2/<repo>/manifests/<reference>`.
    pub fn as_path(&self) -> String {
        match self {
            Self::Tag(t) => t.clone(),
            Self::Digest(d) => d.to_string(),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tag(t) => write!(f, ":{t}"),
            Self::Digest(d) => write!(f, "@{d}"),
        }
    }
}

/// `HOST[:PORT]/REPO[:TAG|@DIGEST]`, parsed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Reference {
    /// `host`, `host:port`, `[v6]` or `[v6]:port`, as written (lowercased).
    pub registry: String,
    pub repository: String,
    /// The tag, when one was given (also with a digest: `repo:tag@sha256:…`, the digest wins).
    pub tag: Option<String>,
    pub digest: Option<Digest>,
}

fn bad(reference: &str, reason: &'static str) -> RegistryError {
    RegistryError::BadReference { reference: reference.to_owned(), reason }
}

/// A repository path component: `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`.
fn valid_component(c: &str) -> bool {
    let b = c.as_bytes();
    let alnum = |x: u8| x.is_ascii_lowercase() || x.is_ascii_digit();
    if b.is_empty() || !alnum(b[0]) || !alnum(b[b.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if alnum(b[i]) {
            i += 1;
            continue;
        }
        // A separator run: ".", "_", "__" or "-"+, between alphanumerics.
        let start = i;
        while i < b.len() && !alnum(b[i]) {
            i += 1;
        }
        let sep = &c[start..i];
        let ok = sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|x| x == b'-');
        if !ok {
            return false;
        }
    }
    true
}

/// A tag: `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`.
pub fn valid_tag(t: &str) -> bool {
    let b = t.as_bytes();
    !b.is_empty()
        && b.len() <= 128
        && (b[0].is_ascii_alphanumeric() || b[0] == b'_')
        && b.iter().all(|&x| x.is_ascii_alphanumeric() || matches!(x, b'_' | b'.' | b'-'))
}

fn valid_host(h: &str) -> bool {
    let (name, port) = if let Some(rest) = h.strip_prefix('[') {
        let Some((v6, after)) = rest.split_once(']') else { return false };
        if v6.parse::<std::net::Ipv6Addr>().is_err() {
            return false;
        }
        match after {
            "" => return true,
            p => match p.strip_prefix(':') {
                Some(p) => ("v6", Some(p)),
                None => return false,
            },
        }
    } else {
        match h.rsplit_once(':') {
            Some((n, p)) => (n, Some(p)),
            None => (h, None),
        }
    };
    if let Some(p) = port {
        if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()) || p.parse::<u16>().is_err()
        {
            return false;
        }
    }
    !name.is_empty()
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}

impl Reference {
    /// Parse `HOST[:PORT]/REPO[:TAG][@DIGEST]` (no scheme).
    pub fn parse(s: &str) -> Result<Self, RegistryError> {
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => (
                r,
                Some(Digest::parse(d).ok_or_else(|| bad(s, "the digest must be sha256:<64 lowercase hex>"))?),
            ),
            None => (s, None),
        };
        let (host, path) = rest.split_once('/').ok_or_else(|| bad(s, "expected HOST[:PORT]/REPO"))?;
        if !valid_host(host) {
            return Err(bad(s, "the registry must be HOST[:PORT] (a DNS name, an IPv4 address or [IPv6])"));
        }
        let (repo, tag) = match path.rsplit_once(':') {
            Some((r, t)) if !t.contains('/') => (r, Some(t)),
            _ => (path, None),
        };
        if repo.is_empty() || repo.len() > 255 || !repo.split('/').all(valid_component) {
            return Err(bad(
                s,
                "the repository must be lowercase path components [a-z0-9] joined by . _ __ or -",
            ));
        }
        if let Some(t) = tag {
            if !valid_tag(t) {
                return Err(bad(s, "the tag must match [A-Za-z0-9_][A-Za-z0-9._-]{0,127}"));
            }
        }
        Ok(Self {
            registry: host.to_ascii_lowercase(),
            repository: repo.to_owned(),
            tag: tag.map(str::to_owned),
            digest,
        })
    }

    /// What to fetch: the digest if given, else the tag, else `latest`.
    pub fn target(&self) -> Target {
        match (&self.digest, &self.tag) {
            (Some(d), _) => Target::Digest(d.clone()),
            (None, Some(t)) => Target::Tag(t.clone()),
            (None, None) => Target::Tag("latest".to_owned()),
        }
    }

    /// Whether the registry host is a loopback address (`localhost`, 127.0.0.0/8, `::1`): such
    /// registries default to plain HTTP and unverified TLS, as docker does.
    pub fn is_loopback(&self) -> bool {
        is_loopback_host(&self.registry)
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

/// The host part of `host[:port]` / `[v6]:port`, without the port and brackets.
pub(crate) fn host_name(registry: &str) -> &str {
    if let Some(rest) = registry.strip_prefix('[') {
        return rest.split_once(']').map_or(rest, |(h, _)| h);
    }
    registry.rsplit_once(':').map_or(registry, |(h, _)| h)
}

/// `localhost`, 127.0.0.0/8 or `::1` (with or without a port).
pub fn is_loopback_host(registry: &str) -> bool {
    let h = host_name(registry);
    h.eq_ignore_ascii_case("localhost") || h.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn parses_references() {
        let r = Reference::parse("127.0.0.1:5000/team/app:v1").unwrap();
        assert_eq!(r.registry, "127.0.0.1:5000");
        assert_eq!(r.repository, "team/app");
        assert_eq!(r.tag.as_deref(), Some("v1"));
        assert_eq!(r.target(), Target::Tag("v1".into()));
        assert!(r.is_loopback());
        assert_eq!(r.to_string(), "127.0.0.1:5000/team/app:v1");

        let r = Reference::parse(&format!("registry.example.com/app@{D}")).unwrap();
        assert_eq!(r.tag, None);
        assert_eq!(r.target().as_path(), D);
        assert!(!r.is_loopback());

        let r = Reference::parse(&format!("localhost:5000/a/b/c:t@{D}")).unwrap();
        assert_eq!((r.tag.as_deref(), r.target()), (Some("t"), Target::Digest(Digest::parse(D).unwrap())));
        assert!(r.is_loopback());

        let r = Reference::parse("[::1]:5000/app").unwrap();
        assert_eq!(r.registry, "[::1]:5000");
        assert_eq!(r.target(), Target::Tag("latest".into()));
        assert!(r.is_loopback());
        assert!(Reference::parse("[::1]/app").unwrap().is_loopback());
        assert!(Reference::parse("127.8.9.10/app").unwrap().is_loopback());
        assert!(!Reference::parse("128.0.0.1/app").unwrap().is_loopback());
        assert_eq!(Reference::parse("Host.Example:443/x.y__z-w--v").unwrap().registry, "host.example:443");
    }

    #[test]
    fn rejects_bad_references() {
        for s in [
            "",
            "app",
            "host/",
            "host/App",
            "host/app:",
            "host/app:-x",
            "host/a//b",
            "host/a_-b",
            "host/.a",
            "host:99999/app",
            "host:/app",
            "ho st/app",
            "[::1/app",
            "[zz]:5/app",
            "host/app@sha256:abc",
            "host/app@md5:0123",
            "/app",
            "-host/app",
            &format!("host/app:{}", "t".repeat(129)),
        ] {
            let e = Reference::parse(s);
            assert!(matches!(e, Err(RegistryError::BadReference { .. })), "{s:?} → {e:?}");
        }
    }

    #[test]
    fn digests() {
        assert!(Digest::parse(D).is_some());
        assert!(Digest::parse(&D.to_uppercase()).is_none());
        assert!(Digest::parse("sha256:../../etc/passwd").is_none());
        assert_eq!(
            Digest::of(b"").to_string(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert!(valid_tag("_x.Y-1") && !valid_tag(".x") && !valid_tag(""));
    }
}
