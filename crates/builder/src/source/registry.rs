//! Registry sources (`docker://HOST[:PORT]/REPO[:TAG|@DIGEST]`) through `tessera-registry`: the
//! tag or digest is resolved to a manifest (a multi-platform index picks `--platform`, exactly as
//! for OCI layouts), the config is fetched and verified, and each layer becomes a [`LayerBlob`]
//! whose opener GETs the blob again: pass 1 and pass 2 each stream the layer straight from the
//! registry into the decompressor — nothing is spooled to disk or held in memory. Every blob is
//! verified against its descriptor's digest and size (by the layer reader, see `layer.rs`); the
//! client resumes a broken body with a Range request and retries 5xx/429/resets.

use std::io::Read;
use std::path::PathBuf;

use tessera_registry::{Client, ClientOptions, Reference, Target};

use super::error::SourceError;
use super::layer::{Digest, Opener};
use super::oci::{assemble, resolve_document, Descriptor, Documents, ImageSource, Platform, MAX_DOCUMENT};

/// A registry image and how to reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistrySpec {
    pub reference: Reference,
    /// Credentials, `--insecure` and TLS roots (the binary builds them from its flags and
    /// environment; default: anonymous, HTTPS verified, loopback registries insecure).
    pub options: ClientOptions,
}

impl RegistrySpec {
    /// Parse `HOST[:PORT]/REPO[:TAG|@DIGEST]` (the text after `docker://`).
    pub fn parse(s: &str) -> Result<Self, SourceError> {
        let reference = Reference::parse(s)
            .map_err(|error| SourceError::Registry { what: format!("docker://{s}"), error })?;
        Ok(Self { reference, options: ClientOptions::default() })
    }
}

struct Remote {
    client: Client,
    reference: Reference,
}

fn registry_err(what: &str) -> impl FnOnce(tessera_registry::RegistryError) -> SourceError + '_ {
    move |error| SourceError::Registry { what: what.to_owned(), error }
}

fn to_registry_digest(d: &Digest) -> Result<tessera_registry::Digest, SourceError> {
    let text = d.to_string();
    tessera_registry::Digest::parse(&text)
        .ok_or(SourceError::BadDigest { what: "descriptor".into(), digest: text })
}

impl Remote {
    fn check_size(what: &str, desc: &Descriptor, len: usize) -> Result<(), SourceError> {
        match desc.size {
            Some(expected) if expected != len as u64 => {
                Err(SourceError::SizeMismatch { what: what.to_owned(), expected, actual: len as u64 })
            }
            _ => Ok(()),
        }
    }
}

impl Documents for Remote {
    fn manifest(&self, what: &str, desc: &Descriptor) -> Result<(Digest, Vec<u8>), SourceError> {
        let d = Digest::parse(what, &desc.digest)?;
        if desc.size.is_some_and(|s| s > MAX_DOCUMENT) {
            return Err(SourceError::DocumentTooLarge { what: what.to_owned(), limit: MAX_DOCUMENT });
        }
        let target = Target::Digest(to_registry_digest(&d)?);
        let m = self.client.get_manifest(&self.reference.repository, &target).map_err(registry_err(what))?;
        Self::check_size(what, desc, m.bytes.len())?;
        Ok((d, m.bytes))
    }

    fn config(&self, what: &str, desc: &Descriptor) -> Result<(Digest, Vec<u8>), SourceError> {
        let d = Digest::parse(what, &desc.digest)?;
        if desc.size.is_some_and(|s| s > MAX_DOCUMENT) {
            return Err(SourceError::DocumentTooLarge { what: what.to_owned(), limit: MAX_DOCUMENT });
        }
        let bytes = self
            .client
            .get_blob_bytes(&self.reference.repository, &to_registry_digest(&d)?, desc.size, MAX_DOCUMENT)
            .map_err(registry_err(what))?;
        Self::check_size(what, desc, bytes.len())?;
        Ok((d, bytes))
    }

    fn location(&self, d: &Digest) -> PathBuf {
        PathBuf::from(format!("docker://{}/{}@{d}", self.reference.registry, self.reference.repository))
    }
}

/// Resolve `spec` (and `platform`, for an index) to an image whose layers stream from the
/// registry.
pub fn open_registry(spec: &RegistrySpec, platform: &Platform) -> Result<ImageSource, SourceError> {
    let reference = spec.reference.clone();
    let remote = Remote { client: Client::for_reference(&reference, spec.options.clone()), reference };
    let shown = format!("docker://{}", remote.reference);
    let top = remote
        .client
        .get_manifest(&remote.reference.repository, &remote.reference.target())
        .map_err(registry_err(&shown))?;
    let top_digest = Digest::parse(&shown, &top.digest.to_string())?;
    let what = format!("manifest {top_digest}");
    let (manifest_digest, manifest) =
        resolve_document(&remote, &what, top_digest.clone(), &top.bytes, &top.media_type, platform, 0)?;
    let repo = remote.reference.repository.clone();
    let image = assemble(&remote, &manifest_digest, &manifest, |name, digest, size| {
        let client = remote.client.clone();
        let repo = repo.clone();
        let digest = to_registry_digest(digest)?;
        let name = name.to_owned();
        // The layer reader (layer.rs) hashes the same bytes against the same digest and size, with
        // its own typed errors: the client's check would be a second sha256 pass.
        let open: Opener = Box::new(move || {
            let reader = client
                .get_blob(&repo, &digest, size)
                .map_err(|e| std::io::Error::other(SourceError::Registry { what: name.clone(), error: e }))?;
            Ok(Box::new(reader.without_digest_check()) as Box<dyn Read + Send>)
        });
        Ok(open)
    })?;
    let provenance = serde_json::json!({
        "registry": remote.reference.registry,
        "repository": remote.reference.repository,
        "reference": remote.reference.to_string(),
        "index": (top_digest != manifest_digest).then(|| top_digest.to_string()),
        "manifest": manifest_digest.to_string(),
        "config": image.config_digest.to_string(),
        "layers": image.layer_digests,
    });
    Ok(ImageSource { layers: image.layers, config: image.config, provenance })
}
