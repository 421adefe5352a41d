//! The settings of a [`crate::Transport`]: timeouts, retries, concurrency and TLS.

use std::sync::Arc;
use std::time::Duration;

use crate::retry::RetryPolicy;

/// Network timeouts (see [`crate::TimeoutKind`] for how a fired one is reported).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// Name lookup, TCP connect and TLS handshake.
    pub connect: Duration,
    /// From the request sent to the response head received.
    pub first_byte: Duration,
    /// Longest wait for the next bytes of a body in progress.
    pub stall: Duration,
    /// One whole request, body included; `None`: no limit (a multi-GiB blob may take long, but
    /// must keep moving).
    pub whole: Option<Duration>,
}

/// TLS settings, the same for every `https://` and `docker://` origin.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsOptions {
    /// Trust these certificates (DER) instead of the built-in public roots (`--ca-file`, like
    /// curl's `--cacert`); empty: the built-in roots.
    pub ca_certs: Arc<Vec<Vec<u8>>>,
    /// Accept any server certificate (`--insecure` on an `https://` store; a registry client
    /// also skips verification for `--insecure` and loopback registries).
    pub skip_verify: bool,
}

/// A PEM file that holds no usable certificate.
#[derive(Debug, thiserror::Error)]
#[error("no CA certificate in the PEM data{}", .0.as_ref().map(|e| format!(": {e}")).unwrap_or_default())]
pub struct BadPem(Option<String>);

impl TlsOptions {
    /// Trust the certificates of `pem` (one or more `BEGIN CERTIFICATE` blocks).
    pub fn with_ca_pem(mut self, pem: &[u8]) -> Result<Self, BadPem> {
        let mut certs = Vec::new();
        for item in ureq::tls::parse_pem(pem) {
            match item {
                Ok(ureq::tls::PemItem::Certificate(c)) => certs.push(c.der().to_vec()),
                Ok(_) => {}
                Err(e) => return Err(BadPem(Some(e.to_string()))),
            }
        }
        if certs.is_empty() {
            return Err(BadPem(None));
        }
        self.ca_certs = Arc::new(certs);
        Ok(self)
    }
}

/// Which HTTP versions a [`crate::Transport`] speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HttpVersion {
    /// HTTP/1.1 only, a pool of connections (one per request in flight).
    #[default]
    Http1,
    /// On `https://` origins, offer HTTP/2 and HTTP/1.1 through ALPN and use what the server
    /// picks: over HTTP/2 every request in flight shares one connection. Cleartext `http://`
    /// origins get HTTP/1.1 (nothing negotiates HTTP/2 there).
    Negotiate,
}

/// Every setting of a [`crate::Transport`]. Defaults are chosen per origin kind by the stores
/// and the registry client; [`Default`] is the HTTP store's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportConfig {
    /// Timeouts (default: connect 5 s, first byte 10 s, stall 30 s, whole 120 s).
    pub timeouts: Timeouts,
    /// Retries (default: 5 attempts, 100 ms doubling to at most 4 s, with jitter).
    pub retry: RetryPolicy,
    /// Requests in flight at most, across every thread sharing the transport (default 48); more
    /// wait. Also the idle connections kept per host.
    pub max_concurrency: usize,
    /// TLS roots and verification.
    pub tls: TlsOptions,
    /// The HTTP versions spoken (default: HTTP/1.1 only).
    pub http: HttpVersion,
}

impl Default for TransportConfig {
    fn default() -> Self {
        Self {
            timeouts: Timeouts {
                connect: Duration::from_secs(5),
                first_byte: Duration::from_secs(10),
                stall: Duration::from_secs(30),
                whole: Some(Duration::from_secs(120)),
            },
            retry: RetryPolicy::default(),
            max_concurrency: 48,
            tls: TlsOptions::default(),
            http: HttpVersion::default(),
        }
    }
}

/// The ureq agent of `config`; `verify`: check server certificates.
/// An agent with `config` (verifying servers' certificates or not), whose connections come
/// from `stash` when one is waiting there ([`crate::preconnect`]); and the connector chain it
/// makes new ones with, for [`crate::preconnect::open`].
pub(crate) fn agent(
    config: &TransportConfig,
    verify: bool,
    stash: &Arc<crate::preconnect::Stash>,
) -> (ureq::Agent, Arc<crate::preconnect::Chain>) {
    use crate::preconnect::{Boxing, Chain, Stashing};
    use ureq::unversioned::resolver::DefaultResolver;
    use ureq::unversioned::transport::{ConnectProxyConnector, Connector, RustlsConnector, TcpConnector};
    let mut tls = ureq::tls::TlsConfig::builder().disable_verification(!verify);
    if !config.tls.ca_certs.is_empty() {
        let certs: Vec<ureq::tls::Certificate<'static>> =
            config.tls.ca_certs.iter().map(|der| ureq::tls::Certificate::from_der(der).to_owned()).collect();
        tls = tls.root_certs(ureq::tls::RootCerts::new_with_certs(&certs));
    }
    let t = &config.timeouts;
    // Through a proxy (ureq takes it from the environment), ureq's pool keeps the connections;
    // else the stash does (crate::preconnect), and ureq's is kept empty.
    let proxied = ureq::Proxy::try_from_env().is_some();
    let idle = if proxied { config.max_concurrency.max(1) } else { 0 };
    let agent_config = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .tls_config(tls.build())
        .timeout_connect(Some(t.connect))
        .timeout_recv_response(Some(t.first_byte))
        .timeout_per_read(Some(t.stall))
        .timeout_global(t.whole)
        .max_idle_connections_per_host(idle)
        .max_idle_connections(idle.saturating_mul(2))
        .user_agent(concat!("tessera/", env!("CARGO_PKG_VERSION")))
        .build();
    // ureq's default chain (a CONNECT proxy from the environment, TCP, rustls) behind the
    // preconnect stash.
    let chain: Arc<Chain> = Arc::new(Boxing(
        ().chain(ConnectProxyConnector::default())
            .chain(TcpConnector::default())
            .chain(RustlsConnector::default()),
    ));
    let connector = Stashing { stash: Arc::clone(stash), chain: Arc::clone(&chain), pool: !proxied };
    (ureq::Agent::with_parts(agent_config, connector, DefaultResolver::default()), chain)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate (`openssl req -x509 -newkey ec … -subj /CN=localhost`).
    const PEM: &str = "-----BEGIN CERTIFICATE-----
MIIBfTCCASOgAwIBAgIUXOYk7i4xuxaZrscgj9EZHvVcNg8wCgYIKoZIzj0EAwIw
FDESMBAGA1UEAwwJbG9jYWxob3N0MB4XDTI2MTIwMTExMDk1MVoXDTM2MTEyODEx
MDk1MVowFDESMBAGA1UEAwwJbG9jYWxob3N0MFkwEwYHKoZIzj0CAQYIKoZIzj0D
AQcDQgAE4T+6zQDZ+J3dtW4ymGGyBzV8yKBlIHe30/B3i3jNUP4nLxIm8e+W0LQ8
Noiu+iHq6MVCaLjA6tHkath/4yM5zqNTMFEwHQYDVR0OBBYEFNFFtVpoytLtUQWa
L78pDuaTr8seMB8GA1UdIwQYMBaAFNFFtVpoytLtUQWaL78pDuaTr8seMA8GA1Ud
EwEB/wQFMAMBAf8wCgYIKoZIzj0EAwIDSAAwRQIgKcLVZ7JzwdXY9mnYpXFvoIgZ
MrUWm7XvxxUHQhv4FNsCIQCzn2LOHDxobHNfU0Y7kdYavyMefeco4LkQnqeGLCWF
2g==
-----END CERTIFICATE-----
";

    #[test]
    fn ca_files_are_parsed_and_checked() {
        let tls = TlsOptions::default().with_ca_pem(PEM.as_bytes()).unwrap();
        assert_eq!(tls.ca_certs.len(), 1);
        assert!(!tls.skip_verify);
        // An agent with these roots builds.
        let config = TransportConfig { tls, ..TransportConfig::default() };
        let _ = agent(&config, true, &Arc::new(crate::preconnect::Stash::new(1)));
        assert!(TlsOptions::default().with_ca_pem(b"not pem").is_err());
        assert!(TlsOptions::default().with_ca_pem(b"").is_err());
    }
}
