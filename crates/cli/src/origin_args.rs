//! How remote origins (`http(s)://`, `docker://` and `s3://` stores, `docker://` build sources
//! and push destinations) are reached: one set of flags, [`OriginArgs`], flattened into every
//! command that talks to one, and the environment (`TESSERA_HTTP_*`, `REGISTRY_AUTH_FILE`,
//! `DOCKER_CONFIG`, `HOME`, the `AWS_*` variables), read here in the binary; both are passed
//! down typed ([`OriginOptions`]).

use anyhow::Result;
use clap::Args;
use tessera_registry::{
    auth_file_paths, ClientOptions, CredentialSource, Credentials, Reference, TlsOptions, TransportError,
    TransportErrorKind,
};
use tessera_store::{HttpConfig, HttpVersion, OriginOptions, S3Config, StoreLocation};

/// `[--ca-file PEM] [--insecure] [--creds USER:PASS]`.
#[derive(Debug, Clone, Default, Args)]
pub struct OriginArgs {
    /// Trust the CA certificates in this PEM file, instead of the built-in public roots, for
    /// https:// and docker:// origins (like curl's --cacert).
    #[arg(long, value_name = "PEM", value_parser = parse_ca_file)]
    pub ca_file: Option<CaFile>,
    /// Do not verify the TLS certificates of https:// and docker:// origins (like curl's -k),
    /// and let registries be reached over plain HTTP (like docker's insecure registries;
    /// loopback registries always may).
    #[arg(long)]
    pub insecure: bool,
    /// Registry credentials for docker:// origins (default: REGISTRY_AUTH_FILE, then
    /// $DOCKER_CONFIG/config.json or ~/.docker/config.json, else anonymous). push and copy send
    /// them to the destination's registry only.
    #[arg(long, value_name = "USER:PASS", value_parser = parse_creds)]
    pub creds: Option<Credentials>,
    /// The endpoint of an S3-compatible server for s3:// stores, addressed path-style
    /// (ENDPOINT/BUCKET/KEY); default AWS_ENDPOINT_URL_S3, then AWS_ENDPOINT_URL, else AWS S3.
    #[arg(long, value_name = "URL")]
    pub s3_endpoint: Option<String>,
    /// HTTP versions for https:// and docker:// origins: 1.1 (a pool of connections, one per
    /// request in flight) or auto (offer HTTP/2 through TLS ALPN and use what the server picks:
    /// every request in flight shares one connection). Cleartext http:// is always HTTP/1.1.
    #[arg(long, value_name = "VERSION", default_value = "1.1")]
    pub http_version: HttpVersionArg,
}

/// `--http-version`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum HttpVersionArg {
    /// HTTP/1.1 only.
    #[default]
    #[value(name = "1.1")]
    Http1,
    /// HTTP/2 where the server offers it, else HTTP/1.1.
    Auto,
}

impl HttpVersionArg {
    fn version(self) -> HttpVersion {
        match self {
            HttpVersionArg::Http1 => HttpVersion::Http1,
            HttpVersionArg::Auto => HttpVersion::Negotiate,
        }
    }
}

/// The certificates of a `--ca-file`, read and checked when the arguments are parsed, so a
/// missing or malformed file is a usage error.
#[derive(Debug, Clone)]
pub struct CaFile(TlsOptions);

fn parse_ca_file(s: &str) -> Result<CaFile, String> {
    let pem = std::fs::read(s).map_err(|e| format!("cannot read {s}: {e}"))?;
    TlsOptions::default().with_ca_pem(&pem).map(CaFile).map_err(|e| format!("{s}: {e}"))
}

/// `--creds USER:PASS`.
pub fn parse_creds(s: &str) -> Result<Credentials, String> {
    Credentials::parse(s).map_err(crate::error_text)
}

impl OriginArgs {
    /// Whether any of the flags was given (for commands where they cannot apply).
    pub fn any(&self) -> bool {
        self.ca_file.is_some()
            || self.insecure
            || self.creds.is_some()
            || self.s3_endpoint.is_some()
            || self.http_version != HttpVersionArg::default()
    }

    /// The flags for reading `source` while writing to the registry `dest_registry`: `--creds`
    /// are the destination's, so a `docker://` source on another registry gets the auth files
    /// only (the credentials of one registry are never sent to another).
    pub fn for_source(&self, source: &StoreLocation, dest_registry: &str) -> OriginArgs {
        let other = match source {
            StoreLocation::Registry(r) => Reference::parse(r).map_or(true, |r| r.registry != dest_registry),
            _ => false,
        };
        if other && self.creds.is_some() {
            tracing::debug!(%source, dest_registry, "--creds are the destination's; the source uses the auth files");
            return OriginArgs { creds: None, ..self.clone() };
        }
        self.clone()
    }

    /// The TLS roots and verification of every origin.
    fn tls(&self) -> TlsOptions {
        let tls = self.ca_file.as_ref().map(|c| c.0.clone()).unwrap_or_default();
        TlsOptions { skip_verify: self.insecure, ..tls }
    }

    /// The registry client options: `--insecure`, the TLS roots, and `--creds` or the auth files
    /// the environment names.
    pub fn registry(&self) -> ClientOptions {
        ClientOptions {
            insecure: self.insecure,
            credentials: CredentialSource::new(self.creds.clone(), auth_file_paths(env)),
            tls: self.tls(),
            http: self.http_version.version(),
            ..ClientOptions::default()
        }
    }

    /// Every origin setting: the flags and the environment (`TESSERA_HTTP_*`, `AWS_*`; a
    /// malformed value is a usage error).
    pub fn options(&self) -> Result<OriginOptions> {
        let http =
            HttpConfig { tls: self.tls(), http: self.http_version.version(), ..HttpConfig::from_vars(env)? };
        let s3 = S3Config::from_vars(env, self.s3_endpoint.as_deref())?;
        Ok(OriginOptions { http, registry: self.registry(), s3, trust: Default::default() })
    }
}

/// Printed after an error whose cause is a server certificate that failed verification.
pub const CERTIFICATE_HINT: &str = "tessera: hint: to trust a private CA, give its certificate with \
--ca-file PEM; --insecure skips verification";

/// Whether `e` failed because a server certificate did not verify.
pub fn is_certificate_failure(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<TransportError>().is_some_and(|t| t.kind() == TransportErrorKind::Certificate)
    })
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_or_malformed_ca_file_is_refused_when_parsed() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let e = parse_ca_file(missing.to_str().unwrap()).unwrap_err();
        assert!(e.contains("missing.pem") && e.contains("No such file"), "{e}");
        let bad = dir.path().join("bad.pem");
        std::fs::write(&bad, "not a certificate\n").unwrap();
        let e = parse_ca_file(bad.to_str().unwrap()).unwrap_err();
        assert!(e.contains("bad.pem") && e.contains("no CA certificate"), "{e}");
    }

    #[test]
    fn creds_go_to_the_destination_registry_only() {
        let args = OriginArgs { creds: Some(Credentials::parse("u:p").unwrap()), ..OriginArgs::default() };
        let src = |s: &str| StoreLocation::parse(s).unwrap();
        let same = args.for_source(&src("docker://reg.example:5000/a"), "reg.example:5000");
        assert!(same.creds.is_some(), "a source on the destination's registry");
        let other = args.for_source(&src("docker://other.example/a"), "reg.example:5000");
        assert!(other.creds.is_none(), "another registry gets the auth files");
        assert!(matches!(other.registry().credentials, CredentialSource::AuthFiles(_)));
        assert!(args.for_source(&src("https://cdn.example/s"), "reg.example:5000").creds.is_some());
    }

    #[test]
    fn insecure_and_creds_reach_both_origin_kinds() {
        let args = OriginArgs {
            insecure: true,
            creds: Some(Credentials::parse("u:p").unwrap()),
            ..OriginArgs::default()
        };
        let o = args.options().unwrap();
        assert!(o.http.tls.skip_verify && o.registry.tls.skip_verify && o.registry.insecure);
        assert!(matches!(o.registry.credentials, CredentialSource::Explicit(ref c) if c.username == "u"));
        let o = OriginArgs::default().options().unwrap();
        assert!(!o.http.tls.skip_verify && !o.registry.insecure);
        assert!(matches!(o.registry.credentials, CredentialSource::AuthFiles(_)));
    }
}
