//! What can go wrong below HTTP, and how a failed attempt is classified for the stats.

use std::io;

/// Which timeout fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TimeoutKind {
    /// Name lookup, TCP connect and TLS handshake ([`crate::Timeouts::connect`]).
    Connect,
    /// From sending the request to the response head ([`crate::Timeouts::first_byte`]).
    FirstByte,
    /// Waiting for the next bytes of a body in progress ([`crate::Timeouts::stall`]).
    Stall,
    /// The whole request, body included ([`crate::Timeouts::whole`]).
    Whole,
}

impl TimeoutKind {
    fn describe(self) -> &'static str {
        match self {
            TimeoutKind::Connect => "connect timeout",
            TimeoutKind::FirstByte => "no response head in time",
            TimeoutKind::Stall => "the body stalled",
            TimeoutKind::Whole => "request timeout",
        }
    }
}

/// How a request failed below HTTP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportErrorKind {
    /// A timeout.
    Timeout(TimeoutKind),
    /// Connection refused or reset, name lookup failed, I/O error.
    Connection,
    /// The server broke the HTTP protocol.
    Protocol,
    /// The server's certificate failed verification (unknown issuer, wrong name, expired):
    /// `--ca-file` or `--insecure` may help, another attempt will not.
    Certificate,
    /// TLS failed otherwise (handshake, protocol).
    Tls,
    /// Anything else (a malformed URL, a bad header): not worth retrying.
    Other,
}

/// A request that did not complete (no HTTP answer, or a body that broke). The source is the
/// HTTP implementation's own error.
#[derive(Debug, thiserror::Error)]
#[error("{}", describe(*.kind))]
pub struct TransportError {
    kind: TransportErrorKind,
    /// No connection was made: refused, name lookup or connect failed or timed out.
    unreachable: bool,
    #[source]
    source: Box<dyn std::error::Error + Send + Sync>,
}

/// The failure's kind; the HTTP implementation's own message is the source (not repeated here).
fn describe(kind: TransportErrorKind) -> &'static str {
    match kind {
        TransportErrorKind::Timeout(t) => t.describe(),
        TransportErrorKind::Connection => "connection failed",
        TransportErrorKind::Protocol => "protocol error",
        TransportErrorKind::Certificate => "TLS certificate verification failed",
        TransportErrorKind::Tls => "TLS failed",
        TransportErrorKind::Other => "request failed",
    }
}

impl TransportError {
    /// How it failed.
    pub fn kind(&self) -> TransportErrorKind {
        self.kind
    }

    /// Whether no connection was made (refused, name lookup or connect failed or timed out):
    /// the server is not there now, and asking again at once will not change that.
    pub fn is_unreachable(&self) -> bool {
        self.unreachable
    }

    /// Whether another attempt may succeed (timeouts, connection and protocol failures).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.kind,
            TransportErrorKind::Timeout(_) | TransportErrorKind::Connection | TransportErrorKind::Protocol
        )
    }

    /// The stats kind of this failure: [`ErrorKind::Timeout`] or [`ErrorKind::Transport`].
    pub fn error_kind(&self) -> ErrorKind {
        match self.kind {
            TransportErrorKind::Timeout(_) => ErrorKind::Timeout,
            _ => ErrorKind::Transport,
        }
    }

    /// A body read that broke (the reader's `io::Error`).
    pub fn from_io(e: io::Error) -> Self {
        let kind = io_kind(&e);
        let unreachable = e.kind() == io::ErrorKind::ConnectionRefused;
        Self { kind, unreachable, source: Box::new(e) }
    }

    /// A failure of `kind` caused by `source`.
    pub(crate) fn new(
        kind: TransportErrorKind,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self { kind, unreachable: false, source: Box::new(source) }
    }

    /// A request that failed in reqwest (the HTTP/2-capable client). A TLS failure keeps
    /// rustls's own error as the source, as [`Self::from_ureq`] does; reqwest reports a failed
    /// handshake as a connect error, so TLS is looked for first.
    pub(crate) fn from_reqwest(e: reqwest::Error) -> Self {
        if let Some(tls) = find_cause::<rustls::Error>(&e) {
            return Self { kind: tls_kind(tls), unreachable: false, source: Box::new(tls.clone()) };
        }
        let refused =
            find_cause::<io::Error>(&e).is_some_and(|io| io.kind() == io::ErrorKind::ConnectionRefused);
        let (kind, unreachable) = if e.is_timeout() && e.is_connect() {
            (TransportErrorKind::Timeout(TimeoutKind::Connect), true)
        } else if e.is_timeout() {
            (TransportErrorKind::Timeout(TimeoutKind::Whole), false)
        } else if e.is_connect() {
            (TransportErrorKind::Connection, true)
        } else if e.is_builder() || e.is_redirect() || e.is_decode() {
            (TransportErrorKind::Other, false)
        } else {
            // A broken exchange: the connection closed or was reset, an HTTP/2 stream or
            // connection error.
            (TransportErrorKind::Connection, refused)
        };
        Self { kind, unreachable, source: Box::new(e) }
    }

    /// A request that failed in ureq. A TLS failure keeps rustls's own error as the source (what
    /// ureq wraps around it says nothing more).
    pub(crate) fn from_ureq(e: ureq::Error) -> Self {
        if let Some(tls) = rustls_error(&e) {
            return Self { kind: tls_kind(tls), unreachable: false, source: Box::new(tls.clone()) };
        }
        Self { kind: ureq_kind(&e), unreachable: unreachable(&e), source: Box::new(e) }
    }
}

/// The first error of type `T` among `e` and its causes. An `io::Error`'s `source()` skips
/// the error it wraps (its own source is that error's source), so wrapped errors are looked
/// into explicitly: reqwest reports a failed handshake as rustls's error inside two of them.
fn find_cause<'a, T: std::error::Error + 'static>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a T> {
    if let Some(t) = e.downcast_ref::<T>() {
        return Some(t);
    }
    if let Some(inner) = e.downcast_ref::<io::Error>().and_then(|io| io.get_ref()) {
        if let Some(t) = find_cause::<T>(inner) {
            return Some(t);
        }
    }
    e.source().and_then(find_cause::<T>)
}

/// Whether `e` means no connection was made (refused, name lookup or connect failed or timed
/// out), as opposed to one that broke.
fn unreachable(e: &ureq::Error) -> bool {
    match e {
        ureq::Error::ConnectionFailed | ureq::Error::HostNotFound => true,
        ureq::Error::Timeout(t) => matches!(t, ureq::Timeout::Resolve | ureq::Timeout::Connect),
        ureq::Error::Io(io) => match io.get_ref().and_then(|r| r.downcast_ref::<ureq::Error>()) {
            Some(inner) => unreachable(inner),
            None => io.kind() == io::ErrorKind::ConnectionRefused,
        },
        _ => false,
    }
}

/// The rustls error under a ureq error (ureq reports a failed handshake as an I/O error
/// wrapping it).
fn rustls_error(e: &ureq::Error) -> Option<&rustls::Error> {
    match e {
        ureq::Error::Rustls(r) => Some(r),
        ureq::Error::Io(io) => io.get_ref()?.downcast_ref::<rustls::Error>(),
        _ => None,
    }
}

fn tls_kind(e: &rustls::Error) -> TransportErrorKind {
    match e {
        rustls::Error::InvalidCertificate(_) => TransportErrorKind::Certificate,
        _ => TransportErrorKind::Tls,
    }
}

fn timeout_kind(t: ureq::Timeout) -> TimeoutKind {
    use ureq::Timeout as T;
    match t {
        T::Resolve | T::Connect => TimeoutKind::Connect,
        T::SendRequest | T::SendBody | T::RecvResponse | T::Await100 => TimeoutKind::FirstByte,
        T::PerRead | T::PerWrite | T::RecvBody => TimeoutKind::Stall,
        T::Global | T::PerCall => TimeoutKind::Whole,
        _ => TimeoutKind::Whole,
    }
}

fn ureq_kind(e: &ureq::Error) -> TransportErrorKind {
    match e {
        ureq::Error::Timeout(t) => TransportErrorKind::Timeout(timeout_kind(*t)),
        ureq::Error::Io(io) => io_kind(io),
        ureq::Error::ConnectionFailed | ureq::Error::HostNotFound => TransportErrorKind::Connection,
        ureq::Error::Protocol(_) => TransportErrorKind::Protocol,
        ureq::Error::BodyStalled => TransportErrorKind::Timeout(TimeoutKind::Stall),
        ureq::Error::Tls(_) | ureq::Error::Rustls(_) => TransportErrorKind::Tls,
        _ => TransportErrorKind::Other,
    }
}

/// The kind of a body read error: ureq reports a timeout while reading a body as an I/O error
/// (wrapping its own error when it knows which timeout fired).
fn io_kind(e: &io::Error) -> TransportErrorKind {
    if let Some(inner) = e.get_ref().and_then(|r| r.downcast_ref::<ureq::Error>()) {
        return ureq_kind(inner);
    }
    if let Some(tls) = e.get_ref().and_then(|r| r.downcast_ref::<rustls::Error>()) {
        return tls_kind(tls);
    }
    if let Some(inner) = e.get_ref().and_then(|r| r.downcast_ref::<TransportError>()) {
        return inner.kind;
    }
    match e.kind() {
        io::ErrorKind::TimedOut => TransportErrorKind::Timeout(TimeoutKind::Stall),
        _ => TransportErrorKind::Connection,
    }
}

/// How an origin attempt failed, as counted in [`crate::ErrorCounts`] (and labelled `kind` in
/// `tessera_origin_errors_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// An unexpected status (5xx, 429, 403, …; a 404 that means "absent" is an answer).
    Status,
    /// The connection failed: refused, reset, closed mid-body, TLS or protocol errors.
    Transport,
    /// A connect, first-byte, stall or whole-request timeout.
    Timeout,
    /// A body or `Content-Range` that does not describe the bytes asked for.
    Body,
    /// Bytes that do not hash to their digest.
    Digest,
}

impl ErrorKind {
    /// Every kind, in label order.
    pub const ALL: [ErrorKind; 5] =
        [ErrorKind::Status, ErrorKind::Transport, ErrorKind::Timeout, ErrorKind::Body, ErrorKind::Digest];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            ErrorKind::Status => "status",
            ErrorKind::Transport => "transport",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Body => "body",
            ErrorKind::Digest => "digest",
        }
    }

    /// The kind of a broken body read.
    pub fn of_io(e: &io::Error) -> Self {
        match io_kind(e) {
            TransportErrorKind::Timeout(_) => ErrorKind::Timeout,
            _ => ErrorKind::Transport,
        }
    }
}

/// Why [`crate::Transport::fetch`] gave up: the transport failed, or the caller rejected the
/// last answer.
#[derive(Debug)]
pub enum FetchError<E> {
    /// The last attempt did not complete.
    Transport(TransportError),
    /// The caller's `on_response` rejected the last answer.
    Rejected(E),
}

/// A caller's verdict on one answer (see [`crate::Transport::fetch`]).
#[derive(Debug)]
pub struct Failure<E> {
    /// The error to return if this was the last attempt.
    pub error: E,
    /// How it counts in the stats (`None`: not an origin failure, e.g. a refused request).
    pub kind: Option<ErrorKind>,
    /// Whether another attempt may succeed.
    pub retry: bool,
}

impl<E> Failure<E> {
    /// Retry (within the policy), counting the attempt as failed by `kind`.
    pub fn retry(kind: ErrorKind, error: E) -> Self {
        Self { error, kind: Some(kind), retry: true }
    }

    /// Give up, counting the attempt as failed by `kind`.
    pub fn fatal(kind: ErrorKind, error: E) -> Self {
        Self { error, kind: Some(kind), retry: false }
    }

    /// Give up without counting an origin failure.
    pub fn uncounted(error: E) -> Self {
        Self { error, kind: None, retry: false }
    }

    /// A broken body read: retried, counted as a timeout or transport failure.
    pub fn broken_body(e: &io::Error, error: E) -> Self {
        Self::retry(ErrorKind::of_io(e), error)
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_tls_error_is_found_inside_nested_io_errors() {
        // How reqwest reports a certificate that failed verification: rustls's error inside
        // two io::Errors, whose `source()` chain skips it.
        let tls = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        let inner = io::Error::new(io::ErrorKind::InvalidData, tls);
        let outer = io::Error::other(inner);
        let found = find_cause::<rustls::Error>(&outer).expect("found");
        assert!(matches!(found, rustls::Error::InvalidCertificate(_)));
        assert_eq!(tls_kind(found), TransportErrorKind::Certificate);
        assert!(find_cause::<rustls::Error>(&io::Error::other("plain")).is_none());
        // An io::Error is found as itself.
        let refused = io::Error::from(io::ErrorKind::ConnectionRefused);
        assert_eq!(
            find_cause::<io::Error>(&refused).map(io::Error::kind),
            Some(io::ErrorKind::ConnectionRefused)
        );
    }

    use super::*;

    #[test]
    fn classifies_timeouts_and_failures() {
        let t = |u| TransportError::from_ureq(ureq::Error::Timeout(u)).kind();
        assert_eq!(t(ureq::Timeout::Connect), TransportErrorKind::Timeout(TimeoutKind::Connect));
        assert_eq!(t(ureq::Timeout::RecvResponse), TransportErrorKind::Timeout(TimeoutKind::FirstByte));
        assert_eq!(t(ureq::Timeout::PerRead), TransportErrorKind::Timeout(TimeoutKind::Stall));
        assert_eq!(t(ureq::Timeout::Global), TransportErrorKind::Timeout(TimeoutKind::Whole));
        let refused = TransportError::from_ureq(ureq::Error::ConnectionFailed);
        assert!(refused.is_retryable());
        assert_eq!(refused.error_kind(), ErrorKind::Transport);
        let bad = TransportError::from_ureq(ureq::Error::BadUri("x".into()));
        assert!(!bad.is_retryable());
        let stalled = TransportError::from_io(io::Error::new(io::ErrorKind::TimedOut, "slow"));
        assert_eq!(stalled.kind(), TransportErrorKind::Timeout(TimeoutKind::Stall));
        assert_eq!(stalled.error_kind(), ErrorKind::Timeout);
        assert!(stalled.to_string().contains("stalled"), "{stalled}");
        let inner = io::Error::other(ureq::Error::Timeout(ureq::Timeout::Global));
        assert_eq!(ErrorKind::of_io(&inner), ErrorKind::Timeout);
        assert_eq!(
            ErrorKind::of_io(&io::Error::new(io::ErrorKind::ConnectionReset, "r")),
            ErrorKind::Transport
        );
        assert_eq!(
            ErrorKind::ALL.map(ErrorKind::label),
            ["status", "transport", "timeout", "body", "digest"]
        );
    }
}
