//! Pushing to a registry: blob existence checks (`HEAD`), cross-repository mounts
//! (`POST …/blobs/uploads/?mount=&from=`), uploads — monolithic (`POST` then one `PUT` with the
//! digest) for blobs up to one piece, chunked (`PATCH` pieces with `Content-Range`, then an empty
//! `PUT` with the digest) for bigger ones — manifests (`PUT` with their media type, by tag), and
//! manifest deletion (`DELETE`, for `tessera store gc`).
//!
//! Every request carries `repository:REPO:pull,push` access (plus `repository:FROM:pull` for a
//! mount) and goes through the client's retries. Memory is bounded by one piece: the source is
//! read piece by piece, and a piece is kept only until the registry has taken it (so a retried
//! request can send it again).
//!
//! A piece the registry may have half-received before a connection broke is settled by asking the
//! upload's status (`GET` on the upload URL → `Range: 0-N`): the upload goes on from where the
//! registry is. A final `PUT` that fails after the registry already committed the blob (the retry
//! then finds no upload) is settled by a `HEAD` of the blob.

use std::io::{self, Read};

use tracing::debug;

use tessera_transport::{Method, Response};

use crate::client::{error_detail, read_limited, status_error, Access, Client, MAX_MANIFEST};
use crate::error::RegistryError;
use crate::media::{accept_header, ACCEPT_ALL};
use crate::reference::Digest;

/// Default upload piece: blobs up to this size go in one `PUT`, bigger ones in `PATCH` pieces of
/// this size (16 MiB).
pub const DEFAULT_UPLOAD_PIECE: u64 = 16 << 20;

/// How [`Client::push_blob`] goes about it. Every field documents its default.
#[derive(Debug, Clone)]
pub struct PushOptions {
    /// Other repositories of the same registry that may hold the blobs, tried in order for a
    /// cross-repository mount before uploading (default none).
    pub mount_from: Vec<String>,
    /// Blobs up to this size are uploaded in one `PUT`, bigger ones in `PATCH` pieces of this size;
    /// also the memory an upload holds (default [`DEFAULT_UPLOAD_PIECE`], clamped to 1 MiB..1 GiB).
    pub piece: u64,
}

impl Default for PushOptions {
    fn default() -> Self {
        Self { mount_from: Vec::new(), piece: DEFAULT_UPLOAD_PIECE }
    }
}

/// How a blob came to be in the repository.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlobPush {
    /// It was there already (`HEAD` answered 200).
    Present,
    /// Mounted from another repository of the same registry (no bytes sent).
    Mounted,
    /// Uploaded.
    Uploaded,
}

/// An open blob upload (the registry's upload URL, which changes with every answer).
#[derive(Debug, Clone)]
pub struct UploadSession {
    repo: String,
    url: String,
}

impl UploadSession {
    /// The current upload URL.
    pub fn url(&self) -> &str {
        &self.url
    }
}

/// `url` with `key=value` appended to its query (`value` must need no escaping).
fn with_query(url: &str, key: &str, value: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{key}={value}")
}

fn header<'a>(resp: &'a Response, name: &str) -> Option<&'a str> {
    resp.header(name)
}

/// `Range: 0-N` of an upload status → the bytes received (N + 1); `0-0`... is ambiguous in the
/// spec for an empty upload, and distribution sends `0-0` for one byte and for none, so a missing
/// header means none.
fn parse_upload_range(v: Option<&str>) -> Option<u64> {
    let v = v?.trim();
    let v = v.strip_prefix("bytes=").unwrap_or(v);
    let (a, b) = v.split_once('-')?;
    let (a, b): (u64, u64) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
    (a == 0).then_some(b.checked_add(1)?)
}

/// Read until `buf` is full or the source ends; the number of bytes read.
fn fill(source: &mut dyn Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match source.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

impl Client {
    fn push_access(&self) -> Access<'static> {
        Access::Push { mount_from: None }
    }

    /// Whether `repo` holds blob `digest` (`HEAD`).
    pub fn blob_exists(&self, repo: &str, digest: &Digest) -> Result<bool, RegistryError> {
        let url = format!("{}/v2/{repo}/blobs/{digest}", self.base_url()?);
        let (url, resp) = self.send_then(Method::Head, repo, &url, &[], &[], self.push_access(), Ok)?;
        match resp.status() {
            200 => Ok(true),
            404 => Ok(false),
            _ => Err(status_error(&url, resp, self.has_credentials(repo))),
        }
    }

    fn session_from(&self, repo: &str, url: &str, resp: &Response) -> Result<UploadSession, RegistryError> {
        let location = header(resp, "location").ok_or_else(|| RegistryError::Status {
            url: url.to_owned(),
            status: resp.status(),
            detail: " (no Location header for the upload)".into(),
        })?;
        Ok(UploadSession { repo: repo.to_owned(), url: self.resolve_location(location)? })
    }

    /// Open an upload in `repo`.
    pub fn start_upload(&self, repo: &str) -> Result<UploadSession, RegistryError> {
        let url = format!("{}/v2/{repo}/blobs/uploads/", self.base_url()?);
        let (url, resp) = self.send_then(Method::Post, repo, &url, &[], &[], self.push_access(), Ok)?;
        if resp.status() != 202 {
            return Err(status_error(&url, resp, self.has_credentials(repo)));
        }
        self.session_from(repo, &url, &resp)
    }

    /// Mount blob `digest` into `repo` from `from` on the same registry. `Ok(None)`: mounted.
    /// `Ok(Some(session))`: the registry could not mount it (it does not have it there, or the
    /// credentials cannot read `from`) and opened an upload instead, to be used for the bytes.
    pub fn mount_blob(
        &self,
        repo: &str,
        digest: &Digest,
        from: &str,
    ) -> Result<Option<UploadSession>, RegistryError> {
        let url = format!("{}/v2/{repo}/blobs/uploads/?mount={digest}&from={from}", self.base_url()?);
        let access = Access::Push { mount_from: Some(from) };
        let (url, resp) = self.send_then(Method::Post, repo, &url, &[], &[], access, Ok)?;
        match resp.status() {
            201 => {
                debug!(repo, from, %digest, "registry: mounted");
                Ok(None)
            }
            202 => Ok(Some(self.session_from(repo, &url, &resp)?)),
            _ => Err(status_error(&url, resp, self.has_credentials(repo))),
        }
    }

    /// How many bytes the registry holds of an upload (`GET` on its URL), and its new URL.
    fn upload_status(&self, session: &UploadSession) -> Result<(u64, UploadSession), RegistryError> {
        let (url, resp) =
            self.send_then(Method::Get, &session.repo, &session.url, &[], &[], self.push_access(), Ok)?;
        if resp.status() != 204 {
            return Err(status_error(&url, resp, self.has_credentials(&session.repo)));
        }
        let received = parse_upload_range(header(&resp, "range")).unwrap_or(0);
        let next = match header(&resp, "location") {
            Some(_) => self.session_from(&session.repo, &url, &resp)?,
            None => session.clone(),
        };
        Ok((received, next))
    }

    /// Upload `size` bytes from `source` as blob `digest` through `session`: one `PUT` when the
    /// blob fits in `piece` bytes, else `PATCH` pieces of `piece` bytes and an empty `PUT`.
    /// `progress` is told the bytes the registry has taken after each request. The registry
    /// checks the digest; a source that ends early or runs long is an error.
    pub fn upload_blob(
        &self,
        session: UploadSession,
        digest: &Digest,
        size: u64,
        source: &mut dyn Read,
        piece: u64,
        progress: &mut dyn FnMut(u64),
    ) -> Result<(), RegistryError> {
        let piece = piece.clamp(1 << 20, 1 << 30);
        let repo = session.repo.clone();
        let source_err = |url: &str, e: io::Error| RegistryError::Read {
            url: format!("{url} (reading the blob to upload)"),
            source: e,
        };
        let mut buf = vec![0u8; usize::try_from(size.min(piece)).unwrap_or(usize::MAX)];
        let mut session = session;
        let mut sent = 0u64;
        let octets = ("Content-Type", "application/octet-stream".to_owned());
        if size > piece {
            while sent < size {
                let want = usize::try_from((size - sent).min(piece)).unwrap_or(usize::MAX);
                let n = fill(source, &mut buf[..want]).map_err(|e| source_err(&session.url, e))?;
                if n != want {
                    return Err(RegistryError::SizeMismatch {
                        url: session.url.clone(),
                        what: "blob source",
                        expected: size,
                        actual: sent + n as u64,
                    });
                }
                let end = sent + n as u64;
                let headers = [octets.clone(), ("Content-Range", format!("{sent}-{}", end - 1))];
                let (url, resp) = self.send_then(
                    Method::Patch,
                    &repo,
                    &session.url,
                    &headers,
                    &buf[..n],
                    self.push_access(),
                    Ok,
                )?;
                match resp.status() {
                    202 => session = self.session_from(&repo, &url, &resp)?,
                    416 => {
                        // A retried PATCH whose first try the registry had (partly) taken.
                        drop(resp);
                        let (received, next) = self.upload_status(&session)?;
                        debug!(url, sent, end, received, "registry: upload range settled by status");
                        if received != end {
                            return Err(RegistryError::Status {
                                url,
                                status: 416,
                                detail: format!(
                                    " (the registry holds {received} bytes of the upload; expected {end})"
                                ),
                            });
                        }
                        session = next;
                    }
                    _ => return Err(status_error(&url, resp, self.has_credentials(&repo))),
                }
                sent = end;
                progress(n as u64);
            }
            self.finish_upload(&session, digest, &[], &[octets])?;
        } else {
            let n = fill(source, &mut buf).map_err(|e| source_err(&session.url, e))?;
            if n as u64 != size {
                return Err(RegistryError::SizeMismatch {
                    url: session.url.clone(),
                    what: "blob source",
                    expected: size,
                    actual: n as u64,
                });
            }
            self.finish_upload(&session, digest, &buf[..n], &[octets])?;
            progress(n as u64);
        }
        let mut extra = [0u8; 1];
        if fill(source, &mut extra).map_err(|e| source_err(&session.url, e))? != 0 {
            return Err(RegistryError::SizeMismatch {
                url: session.url.clone(),
                what: "blob source",
                expected: size,
                actual: size + 1,
            });
        }
        Ok(())
    }

    /// The closing `PUT …&digest=` (with the last bytes, or none).
    fn finish_upload(
        &self,
        session: &UploadSession,
        digest: &Digest,
        body: &[u8],
        headers: &[(&str, String)],
    ) -> Result<(), RegistryError> {
        let url = with_query(&session.url, "digest", &digest.to_string());
        let (url, resp) =
            self.send_then(Method::Put, &session.repo, &url, headers, body, self.push_access(), Ok)?;
        match resp.status() {
            201 => {
                if let Some(claimed) = header(&resp, "docker-content-digest").and_then(Digest::parse) {
                    if claimed != *digest {
                        return Err(RegistryError::DigestMismatch {
                            url,
                            what: "uploaded blob",
                            expected: digest.to_string(),
                            actual: claimed.to_string(),
                        });
                    }
                }
                Ok(())
            }
            // A retried PUT after the registry had committed the blob finds no upload.
            404 if self.blob_exists(&session.repo, digest)? => Ok(()),
            _ => Err(status_error(&url, resp, self.has_credentials(&session.repo))),
        }
    }

    /// Put blob `digest` of `size` bytes into `repo`, doing as little as possible: nothing when
    /// `repo` has it; a mount when one of `options.mount_from` has it; else an upload of the
    /// bytes `open` gives (called only then).
    pub fn push_blob<R: Read>(
        &self,
        repo: &str,
        digest: &Digest,
        size: u64,
        options: &PushOptions,
        open: impl FnOnce() -> io::Result<R>,
        progress: &mut dyn FnMut(u64),
    ) -> Result<BlobPush, RegistryError> {
        if self.blob_exists(repo, digest)? {
            return Ok(BlobPush::Present);
        }
        let mut session = None;
        for from in options.mount_from.iter().filter(|f| *f != repo) {
            match self.mount_blob(repo, digest, from)? {
                None => return Ok(BlobPush::Mounted),
                Some(s) => {
                    // Keep the first upload the registry opened; later ones are left to expire.
                    session.get_or_insert(s);
                }
            }
        }
        let session = match session {
            Some(s) => s,
            None => self.start_upload(repo)?,
        };
        let mut source = open().map_err(|e| RegistryError::Read {
            url: format!("{} (opening the blob {digest} to upload)", session.url),
            source: e,
        })?;
        self.upload_blob(session, digest, size, &mut source, options.piece, progress)?;
        Ok(BlobPush::Uploaded)
    }

    /// The digest of the manifest `reference` (a tag) names in `repo` (`HEAD`), `None` if
    /// the tag does not exist.
    pub fn manifest_digest(&self, repo: &str, reference: &str) -> Result<Option<Digest>, RegistryError> {
        let url = format!("{}/v2/{repo}/manifests/{reference}", self.base_url()?);
        let accept = [("Accept", accept_header(ACCEPT_ALL))];
        let (url, resp) = self.send_then(Method::Head, repo, &url, &accept, &[], self.push_access(), Ok)?;
        match resp.status() {
            200 => Ok(header(&resp, "docker-content-digest").and_then(Digest::parse)),
            404 => Ok(None),
            _ => Err(status_error(&url, resp, self.has_credentials(repo))),
        }
    }

    /// `PUT` a manifest as `reference` (a tag or its digest) with `media_type`; returns its
    /// digest (checked against `Docker-Content-Digest` when the registry sends one).
    pub fn put_manifest(
        &self,
        repo: &str,
        reference: &str,
        media_type: &str,
        bytes: &[u8],
    ) -> Result<Digest, RegistryError> {
        self.put_manifest_with_subject(repo, reference, media_type, bytes).map(|(d, _)| d)
    }

    /// [`Self::put_manifest`], also telling whether the registry indexed the manifest's
    /// `subject` for the referrers API (it answers with an `OCI-Subject` header; one that does
    /// not needs the tag fallback of distribution 1.1).
    pub fn put_manifest_with_subject(
        &self,
        repo: &str,
        reference: &str,
        media_type: &str,
        bytes: &[u8],
    ) -> Result<(Digest, bool), RegistryError> {
        let url = format!("{}/v2/{repo}/manifests/{reference}", self.base_url()?);
        let headers = [("Content-Type", media_type.to_owned())];
        let (url, resp) = self.send_then(Method::Put, repo, &url, &headers, bytes, self.push_access(), Ok)?;
        if resp.status() != 201 {
            return Err(status_error(&url, resp, self.has_credentials(repo)));
        }
        let digest = Digest::of(bytes);
        if let Some(claimed) = header(&resp, "docker-content-digest").and_then(Digest::parse) {
            if claimed != digest {
                return Err(RegistryError::DigestMismatch {
                    url,
                    what: "manifest",
                    expected: digest.to_string(),
                    actual: claimed.to_string(),
                });
            }
        }
        Ok((digest, header(&resp, "oci-subject").is_some()))
    }

    /// Delete manifest `reference` (a digest, or a tag where the registry allows deleting tags)
    /// from `repo` (`DELETE /v2/REPO/manifests/REFERENCE`): `true` when deleted, `false` when it
    /// was not there. A registry that does not allow deletes answers 405 (distribution without
    /// `storage.delete.enabled`), or 400/`UNSUPPORTED` for tags: [`RegistryError::DeleteRefused`].
    pub fn delete_manifest(&self, repo: &str, reference: &str) -> Result<bool, RegistryError> {
        let url = format!("{}/v2/{repo}/manifests/{reference}", self.base_url()?);
        let (url, resp) = self.send_then(Method::Delete, repo, &url, &[], &[], Access::Delete, Ok)?;
        match resp.status() {
            200 | 202 | 204 => Ok(true),
            404 => Ok(false),
            405 => Err(RegistryError::DeleteRefused { url, status: 405, detail: error_detail(resp) }),
            400 => {
                let detail = error_detail(resp);
                if detail.contains("UNSUPPORTED") {
                    Err(RegistryError::DeleteRefused { url, status: 400, detail })
                } else {
                    Err(RegistryError::Status { url, status: 400, detail })
                }
            }
            _ => Err(status_error(&url, resp, self.has_credentials(repo))),
        }
    }

    /// The referrers of manifest `subject` in `repo` whose `artifactType` is `artifact_type`
    /// (`GET /v2/<repo>/referrers/<digest>`): the image index's bytes, or `None` when the
    /// registry has no referrers API (404; a registry that has it answers an unknown subject
    /// with an empty index).
    pub fn referrers(
        &self,
        repo: &str,
        subject: &Digest,
        artifact_type: &str,
    ) -> Result<Option<Vec<u8>>, RegistryError> {
        let path = with_query(&format!("/v2/{repo}/referrers/{subject}"), "artifactType", artifact_type);
        let (url, resp) = self.send(Method::Get, repo, &path, &[])?;
        match resp.status() {
            200 => Ok(Some(read_limited(&url, resp, "referrers index", MAX_MANIFEST)?)),
            404 => Ok(None),
            _ => Err(status_error(&url, resp, self.has_credentials(repo))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries() {
        assert_eq!(
            with_query("http://r/v2/a/blobs/uploads/u", "digest", "sha256:x"),
            "http://r/v2/a/blobs/uploads/u?digest=sha256:x"
        );
        assert_eq!(with_query("http://r/u?_state=abc", "digest", "d"), "http://r/u?_state=abc&digest=d");
    }

    #[test]
    fn upload_ranges() {
        assert_eq!(parse_upload_range(Some("0-1023")), Some(1024));
        assert_eq!(parse_upload_range(Some("bytes=0-9")), Some(10));
        assert_eq!(parse_upload_range(Some("5-9")), None);
        assert_eq!(parse_upload_range(Some("junk")), None);
        assert_eq!(parse_upload_range(None), None);
    }

    #[test]
    fn fills_across_short_reads() {
        struct Dribble(Vec<u8>);
        impl Read for Dribble {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                if self.0.is_empty() || buf.is_empty() {
                    return Ok(0);
                }
                buf[0] = self.0.remove(0);
                Ok(1)
            }
        }
        let mut src = Dribble(b"abcdef".to_vec());
        let mut buf = [0u8; 4];
        assert_eq!(fill(&mut src, &mut buf).unwrap(), 4);
        assert_eq!(&buf, b"abcd");
        assert_eq!(fill(&mut src, &mut buf).unwrap(), 2);
    }
}
