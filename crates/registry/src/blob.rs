//! Streaming blob reads: verified, and resumed with `Range` when a connection breaks mid-body.

use std::io::{self, Read};

use sha2::{Digest as _, Sha256};
use tessera_transport::{BodyReader, ErrorKind, Failure, Method, Response};
use tracing::{debug, warn};

use crate::client::{status_error, Access, Client};
use crate::error::RegistryError;
use crate::reference::Digest;

/// A blob's bytes as they arrive. At the end of the stream the size (when known) and the digest
/// are checked; a failure is returned as an `io::Error` wrapping a [`RegistryError`] (see
/// [`unwrap_io`]). A read error mid-body is retried by asking for the rest with
/// `Range: bytes=N-` (or, when the server ignores ranges, re-reading and skipping), up to the
/// retry policy's attempts; the digest check covers the joined stream.
pub struct BlobReader {
    client: Client,
    repo: String,
    digest: Digest,
    url: String,
    body: Option<BodyReader>,
    pos: u64,
    size: Option<u64>,
    hasher: Option<Sha256>,
    resumes: u32,
    finished: bool,
}

impl std::fmt::Debug for BlobReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlobReader")
            .field("url", &self.url)
            .field("pos", &self.pos)
            .field("size", &self.size)
            .finish()
    }
}

/// The [`RegistryError`] inside an `io::Error` from a [`BlobReader`], or a `Read` error naming
/// `url`.
pub fn unwrap_io(url: &str, e: io::Error) -> RegistryError {
    if e.get_ref().is_some_and(|r| r.is::<RegistryError>()) {
        if let Some(inner) = e.into_inner() {
            return match inner.downcast::<RegistryError>() {
                Ok(r) => *r,
                Err(other) => RegistryError::Read { url: url.to_owned(), source: io::Error::other(other) },
            };
        }
        return RegistryError::Read { url: url.to_owned(), source: io::Error::other("unknown") };
    }
    RegistryError::Read { url: url.to_owned(), source: e }
}

/// `bytes START-END/TOTAL` → (START, END).
fn parse_content_range(v: &str) -> Option<(u64, u64)> {
    let rest = v.trim().strip_prefix("bytes ")?;
    let (range, _total) = rest.split_once('/')?;
    let (a, b) = range.split_once('-')?;
    Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
}

/// The `Range` header asking for bytes `from..end` (`end` open when `None`).
fn range_headers(from: u64, end: Option<u64>) -> Vec<(&'static str, String)> {
    match (from, end) {
        (0, None) => Vec::new(),
        (f, None) => vec![("Range", format!("bytes={f}-"))],
        (f, Some(e)) => vec![("Range", format!("bytes={f}-{}", e.saturating_sub(1)))],
    }
}

/// The body of an answer to a GET of the blob from byte `from` on, positioned at `from`: a
/// 206 must start there; a 200 (the server ignored Range) is skipped to it.
fn body_from(
    client: &Client,
    repo: &str,
    url: &str,
    resp: Response,
    from: u64,
    end: Option<u64>,
) -> Result<BodyReader, Failure<RegistryError>> {
    match resp.status() {
        200 => {
            let mut body = resp.into_reader();
            if from > 0 {
                // The server ignored Range: skip what we already have.
                let skipped = io::copy(&mut (&mut body).take(from), &mut io::sink()).map_err(|e| {
                    let kind = ErrorKind::of_io(&e);
                    Failure::retry(kind, RegistryError::Read { url: url.to_owned(), source: e })
                })?;
                if skipped != from {
                    let source = io::Error::new(io::ErrorKind::UnexpectedEof, "blob shorter than before");
                    return Err(Failure::fatal(
                        ErrorKind::Body,
                        RegistryError::Read { url: url.to_owned(), source },
                    ));
                }
            }
            Ok(body)
        }
        206 => {
            let cr = resp.header("content-range").unwrap_or("").to_owned();
            match parse_content_range(&cr) {
                Some((start, _)) if start == from => Ok(resp.into_reader()),
                _ => Err(Failure::fatal(
                    ErrorKind::Body,
                    RegistryError::BadRange {
                        url: url.to_owned(),
                        header: cr,
                        start: from,
                        end: end.unwrap_or(u64::MAX),
                    },
                )),
            }
        }
        _ => {
            let has = client.has_credentials(repo);
            Err(Failure::uncounted(status_error(url, resp, has)))
        }
    }
}

/// GET the blob from byte `from` on. Returns the response body positioned at `from`.
fn request_from(
    client: &Client,
    repo: &str,
    digest: &Digest,
    from: u64,
    end: Option<u64>,
) -> Result<(String, BodyReader), RegistryError> {
    let url = blob_url(client, repo, digest)?;
    let headers = range_headers(from, end);
    client.send_then(Method::Get, repo, &url, &headers, &[], Access::Pull, |resp| {
        body_from(client, repo, &url, resp, from, end)
    })
}

fn blob_url(client: &Client, repo: &str, digest: &Digest) -> Result<String, RegistryError> {
    Ok(format!("{}/v2/{repo}/blobs/{digest}", client.base_url()?))
}

impl BlobReader {
    pub(crate) fn open(
        client: Client,
        repo: &str,
        digest: &Digest,
        size: Option<u64>,
    ) -> Result<Self, RegistryError> {
        let (url, body) = request_from(&client, repo, digest, 0, None)?;
        Ok(Self {
            client,
            repo: repo.to_owned(),
            digest: digest.clone(),
            url,
            body: Some(body),
            pos: 0,
            size,
            hasher: Some(Sha256::new()),
            resumes: 0,
            finished: false,
        })
    }

    /// Skip the digest check, for a caller that hashes the same bytes against the same digest
    /// itself (the size check and resumption stay).
    pub fn without_digest_check(mut self) -> Self {
        self.hasher = None;
        self
    }

    /// The blob's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Bytes delivered so far.
    pub fn position(&self) -> u64 {
        self.pos
    }

    fn fail(&self, e: RegistryError) -> io::Error {
        io::Error::other(e)
    }

    fn finish(&mut self) -> io::Result<()> {
        self.finished = true;
        if let Some(expected) = self.size.filter(|s| *s != self.pos) {
            self.client.transport().record_error(ErrorKind::Body);
            return Err(self.fail(RegistryError::SizeMismatch {
                url: self.url.clone(),
                what: "blob",
                expected,
                actual: self.pos,
            }));
        }
        if let Some(h) = self.hasher.take() {
            let actual = Digest::from_hasher(h);
            if actual != self.digest {
                self.client.transport().record_error(ErrorKind::Digest);
                return Err(self.fail(RegistryError::DigestMismatch {
                    url: self.url.clone(),
                    what: "blob",
                    expected: self.digest.to_string(),
                    actual: actual.to_string(),
                }));
            }
        }
        Ok(())
    }

    /// After a broken read: wait, then continue from `pos`; `Err` when out of attempts.
    fn resume(&mut self, cause: io::Error) -> io::Result<()> {
        self.body = None;
        self.client.transport().record_error(ErrorKind::of_io(&cause));
        let policy = self.client.retry();
        if self.resumes + 1 >= policy.attempts.max(1) {
            return Err(self.fail(RegistryError::Read { url: self.url.clone(), source: cause }));
        }
        let wait = policy.backoff(self.resumes);
        warn!(url = self.url, pos = self.pos, error = %cause, ?wait, "registry: blob read broke, resuming");
        self.resumes += 1;
        self.client.transport().record_retry();
        std::thread::sleep(wait);
        let (_, body) =
            request_from(&self.client, &self.repo, &self.digest, self.pos, None).map_err(|e| self.fail(e))?;
        self.body = Some(body);
        Ok(())
    }
}

impl Read for BlobReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.finished || buf.is_empty() {
            return Ok(0);
        }
        loop {
            let Some(body) = self.body.as_mut() else {
                return Err(self.fail(RegistryError::Read {
                    url: self.url.clone(),
                    source: io::Error::other("no connection"),
                }));
            };
            match body.read(buf) {
                Ok(0) => {
                    if self.size.is_some_and(|s| self.pos < s) {
                        // The connection ended early without an error: ask for the rest.
                        self.resume(io::Error::new(io::ErrorKind::UnexpectedEof, "body ended early"))?;
                        continue;
                    }
                    self.finish()?;
                    return Ok(0);
                }
                Ok(n) => {
                    self.pos += n as u64;
                    if let Some(expected) = self.size.filter(|s| self.pos > *s) {
                        return Err(self.fail(RegistryError::SizeMismatch {
                            url: self.url.clone(),
                            what: "blob",
                            expected,
                            actual: self.pos,
                        }));
                    }
                    if let Some(h) = self.hasher.as_mut() {
                        h.update(&buf[..n]);
                    }
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => self.resume(e)?,
            }
        }
    }
}

/// Bytes `start..start + len` of a blob, retried whole (in the transport's retry loop) when
/// the body breaks.
pub(crate) fn get_range(
    client: &Client,
    repo: &str,
    digest: &Digest,
    start: u64,
    len: u64,
) -> Result<Vec<u8>, RegistryError> {
    let mut out = Vec::with_capacity(usize::try_from(len).unwrap_or(usize::MAX).min(64 << 20));
    get_range_streamed(client, repo, digest, start, len, &mut |bytes| {
        out.extend_from_slice(bytes);
        true
    })?;
    Ok(out)
}

/// [`get_range`], handing the bytes to `sink` as they arrive: in order, each byte once (a retry
/// after a broken body skips what the sink had). `sink` returning `false` stops the read:
/// [`RegistryError::Stopped`].
pub(crate) fn get_range_streamed(
    client: &Client,
    repo: &str,
    digest: &Digest,
    start: u64,
    len: u64,
    sink: &mut dyn FnMut(&[u8]) -> bool,
) -> Result<(), RegistryError> {
    let end = start.checked_add(len).ok_or_else(|| RegistryError::BadRange {
        url: format!("/v2/{repo}/blobs/{digest}"),
        header: String::new(),
        start,
        end: u64::MAX,
    })?;
    let url = blob_url(client, repo, digest)?;
    let headers = range_headers(start, Some(end));
    // What `sink` had, over every attempt (a retry's body starts again at the first byte).
    let mut fed = tessera_transport::Resume::default();
    client.send_then(Method::Get, repo, &url, &headers, &[], Access::Pull, |resp| {
        let mut body = body_from(client, repo, &url, resp, start, Some(end))?;
        let mut piece = vec![0u8; usize::try_from(len).unwrap_or(usize::MAX).clamp(1, 64 << 10)];
        let mut got = 0u64;
        while got < len {
            let want = usize::try_from(len - got).unwrap_or(usize::MAX).min(piece.len());
            let n = match body.read(&mut piece[..want]) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    warn!(url, error = &e as &dyn std::error::Error, "registry: range read broke");
                    let kind = ErrorKind::of_io(&e);
                    return Err(Failure::retry(kind, RegistryError::Read { url: url.clone(), source: e }));
                }
            };
            let unseen = fed.unseen(got, &piece[..n]);
            got += n as u64;
            if !unseen.is_empty() && !sink(unseen) {
                return Err(Failure::uncounted(RegistryError::Stopped { url: url.clone() }));
            }
        }
        if got != len {
            let source =
                io::Error::new(io::ErrorKind::UnexpectedEof, format!("range ended after {got} bytes"));
            return Err(Failure::fatal(ErrorKind::Body, RegistryError::Read { url: url.clone(), source }));
        }
        // Reach the end of a 206 body so that its connection goes back to the pool (a body
        // never read to its end closes the connection). A server that ignored Range sent more:
        // that connection is dropped.
        let mut probe = [0u8; 1];
        if !matches!(body.read(&mut probe), Ok(0)) {
            debug!(url, "range answer longer than asked; not reusing the connection");
        }
        Ok(())
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_ranges() {
        assert_eq!(parse_content_range("bytes 10-19/100"), Some((10, 19)));
        assert_eq!(parse_content_range("bytes 10-19/*"), Some((10, 19)));
        assert_eq!(parse_content_range("bytes */100"), None);
        assert_eq!(parse_content_range("items 1-2/3"), None);
    }

    #[test]
    fn unwraps_registry_errors() {
        let e = io::Error::other(RegistryError::NotFound { url: "u".into(), detail: String::new() });
        assert!(matches!(unwrap_io("x", e), RegistryError::NotFound { .. }));
        let e = io::Error::new(io::ErrorKind::ConnectionReset, "reset");
        assert!(matches!(unwrap_io("x", e), RegistryError::Read { .. }));
    }
}
