//! OCI image layouts (`oci:PATH[:REF]`) and docker archives (`docker-archive:PATH`): resolve the
//! reference and platform to one manifest, read the config into a normalized [`RuntimeConfig`],
//! and describe the layers as [`LayerBlob`]s (read lazily, verified on every read).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest as _, Sha256};
use tessera_image::RuntimeConfig;

use super::error::SourceError;
use super::layer::{Digest, LayerBlob};

/// Largest JSON document (index, manifest, config) read into memory.
pub const MAX_DOCUMENT: u64 = 8 << 20;
const MAX_NESTING: usize = 8;

/// What `tessera build` reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceSpec {
    Dir(PathBuf),
    Oci {
        path: PathBuf,
        reference: Option<String>,
    },
    /// `reference`: `REPO[:TAG]` matched against `RepoTags`, or `@INDEX` in `manifest.json`.
    DockerArchive {
        path: PathBuf,
        reference: Option<String>,
    },
    Registry(Box<super::registry::RegistrySpec>),
    /// `manifest:FILE`: a content manifest (`docs/formats/manifest-text.md`).
    Manifest(PathBuf),
}

impl SourceSpec {
    /// Parse `DIR | oci:PATH[:REF] | docker-archive:PATH[:REF] | docker://HOST[:PORT]/REPO[:TAG|@DIGEST]
    /// | manifest:FILE`
    /// (a registry source gets no credentials and secure transport; set them on the
    /// [`RegistrySpec`](super::RegistrySpec) after parsing). For `oci:`, a path that
    /// exists as a directory with the whole text is taken as is; otherwise the text after the last
    /// `:` is the reference. For `docker-archive:`, the reference (`REPO[:TAG]` or `@INDEX`, which
    /// may hold `:` itself) follows the first `:` after which the text names an existing file, or
    /// else the first `:`, as skopeo parses it.
    pub fn parse(s: &str) -> Result<Self, SourceError> {
        if let Some(rest) = s.strip_prefix("oci:") {
            if rest.is_empty() {
                return Err(SourceError::BadSource(s.to_owned()));
            }
            if Path::new(rest).is_dir() {
                return Ok(Self::Oci { path: rest.into(), reference: None });
            }
            return Ok(match rest.rsplit_once(':') {
                Some((path, reference))
                    if !path.is_empty() && !reference.is_empty() && !reference.contains('/') =>
                {
                    Self::Oci { path: path.into(), reference: Some(reference.to_owned()) }
                }
                _ => Self::Oci { path: rest.into(), reference: None },
            });
        }
        if let Some(rest) = s.strip_prefix("docker-archive:") {
            if rest.is_empty() {
                return Err(SourceError::BadSource(s.to_owned()));
            }
            return Ok(parse_docker_archive(rest));
        }
        if let Some(rest) = s.strip_prefix("manifest:") {
            if rest.is_empty() {
                return Err(SourceError::BadSource(s.to_owned()));
            }
            return Ok(Self::Manifest(rest.into()));
        }
        if let Some(rest) = s.strip_prefix("docker://") {
            return Ok(Self::Registry(Box::new(super::registry::RegistrySpec::parse(rest)?)));
        }
        Ok(Self::Dir(s.into()))
    }
}

fn parse_docker_archive(rest: &str) -> SourceSpec {
    let split = |i: usize| SourceSpec::DockerArchive {
        path: rest[..i].into(),
        reference: Some(rest[i + 1..].to_owned()).filter(|r| !r.is_empty()),
    };
    if Path::new(rest).is_file() {
        return SourceSpec::DockerArchive { path: rest.into(), reference: None };
    }
    let colons: Vec<usize> = rest.match_indices(':').map(|(i, _)| i).filter(|&i| i > 0).collect();
    match colons.iter().find(|&&i| Path::new(&rest[..i]).is_file()).or(colons.first()) {
        Some(&i) => split(i),
        None => SourceSpec::DockerArchive { path: rest.into(), reference: None },
    }
}

/// A docker reference in the form `RepoTags` compare on: `docker.io/library/` added to
/// one-component names and `docker.io/` to names without a registry host (as docker does), and
/// `:latest` when there is no tag. docker writes the short form, skopeo the long one.
fn normalize_docker_reference(r: &str) -> String {
    let (name, tag) = match r.rsplit_once(':') {
        Some((n, t)) if !t.contains('/') => (n, t),
        _ => (r, "latest"),
    };
    let name = match name.split_once('/') {
        None => format!("docker.io/library/{name}"),
        Some((first, _)) if first.contains('.') || first.contains(':') || first == "localhost" => {
            name.to_owned()
        }
        Some(_) => format!("docker.io/{name}"),
    };
    format!("{name}:{tag}")
}

/// A platform: `OS/ARCH[/VARIANT]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Platform {
    pub os: String,
    pub architecture: String,
    pub variant: Option<String>,
}

impl Default for Platform {
    fn default() -> Self {
        Self { os: "linux".into(), architecture: "amd64".into(), variant: None }
    }
}

impl std::str::FromStr for Platform {
    type Err = SourceError;
    fn from_str(s: &str) -> Result<Self, SourceError> {
        let parts: Vec<&str> = s.split('/').collect();
        let ok = |p: &&str| {
            !p.is_empty() && p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        };
        match parts.as_slice() {
            [os, arch] if ok(os) && ok(arch) => {
                Ok(Self { os: (*os).into(), architecture: (*arch).into(), variant: None })
            }
            [os, arch, v] if ok(os) && ok(arch) && ok(v) => {
                Ok(Self { os: (*os).into(), architecture: (*arch).into(), variant: Some((*v).into()) })
            }
            _ => Err(SourceError::BadPlatform(s.to_owned())),
        }
    }
}

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

/// An image ready to flatten: its layers (lowest first) and normalized runtime config.
#[derive(Debug)]
pub struct ImageSource {
    pub layers: Vec<LayerBlob>,
    pub config: RuntimeConfig,
    /// Digests of the manifest and layers, for the provenance record (not part of the ID).
    pub provenance: serde_json::Value,
}

#[derive(Debug, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub(super) struct Descriptor {
    #[serde(default)]
    pub(super) media_type: String,
    pub(super) digest: String,
    #[serde(default)]
    pub(super) size: Option<u64>,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
    #[serde(default)]
    platform: Option<DescPlatform>,
}

#[derive(Debug, Deserialize, Default)]
struct DescPlatform {
    #[serde(default)]
    os: String,
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    variant: Option<String>,
}

/// An index or a manifest (both are read as this, told apart by media type and fields).
#[derive(Debug, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub(super) struct Document {
    #[serde(default)]
    media_type: String,
    #[serde(default)]
    manifests: Option<Vec<Descriptor>>,
    #[serde(default)]
    pub(super) config: Option<Descriptor>,
    #[serde(default)]
    pub(super) layers: Option<Vec<Descriptor>>,
}

#[derive(Debug, Deserialize, Default)]
struct ImageConfigFile {
    #[serde(default)]
    config: Option<ContainerConfig>,
    #[serde(default)]
    rootfs: Option<RootFs>,
}

#[derive(Debug, Deserialize, Default)]
struct RootFs {
    #[serde(default)]
    diff_ids: Vec<String>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(rename_all = "PascalCase")]
struct ContainerConfig {
    #[serde(default)]
    env: Option<Vec<String>>,
    #[serde(default)]
    entrypoint: Option<Vec<String>>,
    #[serde(default)]
    cmd: Option<Vec<String>>,
    #[serde(default)]
    working_dir: Option<String>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
}

pub(super) fn json<T: for<'de> Deserialize<'de>>(what: &str, bytes: &[u8]) -> Result<T, SourceError> {
    serde_json::from_slice(bytes).map_err(|source| SourceError::Json { what: what.to_owned(), source })
}

/// Normalize a config's runtime fields (docs/formats/record.md, "Runtime config"): Env keeps the
/// last value of each variable and is sorted by name; an empty Entrypoint or Cmd is the same as
/// none; labels are sorted by key; missing strings are empty.
pub fn normalize_config(config_json: &[u8]) -> Result<(RuntimeConfig, Vec<String>), SourceError> {
    let file: ImageConfigFile = json("image config", config_json)?;
    let c = file.config.unwrap_or_default();
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    for e in c.env.unwrap_or_default() {
        let key = e.split_once('=').map(|(k, _)| k).unwrap_or(&e).to_owned();
        env.insert(key, e);
    }
    let nonempty = |v: Option<Vec<String>>| v.filter(|v| !v.is_empty());
    let config = RuntimeConfig {
        env: env.into_values().collect(),
        entrypoint: nonempty(c.entrypoint),
        cmd: nonempty(c.cmd),
        working_dir: c.working_dir.unwrap_or_default(),
        user: c.user.unwrap_or_default(),
        labels: c.labels.unwrap_or_default(),
    };
    Ok((config, file.rootfs.unwrap_or_default().diff_ids))
}

pub(super) fn read_limited(mut r: impl Read, what: &str) -> Result<Vec<u8>, SourceError> {
    let mut buf = Vec::new();
    (&mut r).take(MAX_DOCUMENT + 1).read_to_end(&mut buf).map_err(|e| SourceError::Io {
        path: what.into(),
        op: "read",
        source: e,
    })?;
    if buf.len() as u64 > MAX_DOCUMENT {
        return Err(SourceError::DocumentTooLarge { what: what.to_owned(), limit: MAX_DOCUMENT });
    }
    Ok(buf)
}

fn check_digest(what: &str, bytes: &[u8], digest: &Digest) -> Result<(), SourceError> {
    let actual = hex::encode(Sha256::digest(bytes));
    if actual != digest.hex {
        return Err(SourceError::DigestMismatch {
            what: what.to_owned(),
            expected: digest.to_string(),
            actual: format!("sha256:{actual}"),
        });
    }
    Ok(())
}

const INDEX_TYPES: &[&str] =
    &["application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json"];
const MANIFEST_TYPES: &[&str] =
    &["application/vnd.oci.image.manifest.v1+json", "application/vnd.docker.distribution.manifest.v2+json"];

/// Where manifests, indexes and configs come from: an OCI layout or a registry. Both verify
/// digest and size against the descriptor.
pub(super) trait Documents {
    /// A manifest or index named by `desc`.
    fn manifest(&self, what: &str, desc: &Descriptor) -> Result<(Digest, Vec<u8>), SourceError>;
    /// A config named by `desc`.
    fn config(&self, what: &str, desc: &Descriptor) -> Result<(Digest, Vec<u8>), SourceError>;
    /// Where the blob `d` lives, for messages.
    fn location(&self, d: &Digest) -> PathBuf;
}

struct Layout {
    root: PathBuf,
}

impl Documents for Layout {
    fn manifest(&self, what: &str, desc: &Descriptor) -> Result<(Digest, Vec<u8>), SourceError> {
        self.document(what, desc)
    }
    fn config(&self, what: &str, desc: &Descriptor) -> Result<(Digest, Vec<u8>), SourceError> {
        self.document(what, desc)
    }
    fn location(&self, d: &Digest) -> PathBuf {
        self.blob_path(d)
    }
}

impl Layout {
    fn blob_path(&self, d: &Digest) -> PathBuf {
        self.root.join("blobs/sha256").join(&d.hex)
    }

    fn open_blob(&self, d: &Digest) -> Result<File, SourceError> {
        let path = self.blob_path(d);
        File::open(&path).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => SourceError::MissingBlob { digest: d.to_string(), path: path.clone() },
            _ => SourceError::Io { path: path.clone(), op: "open", source: e },
        })
    }

    /// A small JSON blob, verified against its descriptor.
    fn document(&self, what: &str, desc: &Descriptor) -> Result<(Digest, Vec<u8>), SourceError> {
        let d = Digest::parse(what, &desc.digest)?;
        if desc.size.is_some_and(|s| s > MAX_DOCUMENT) {
            return Err(SourceError::DocumentTooLarge { what: what.to_owned(), limit: MAX_DOCUMENT });
        }
        let bytes = read_limited(self.open_blob(&d)?, what)?;
        if let Some(expected) = desc.size {
            if expected != bytes.len() as u64 {
                return Err(SourceError::SizeMismatch {
                    what: what.to_owned(),
                    expected,
                    actual: bytes.len() as u64,
                });
            }
        }
        check_digest(what, &bytes, &d)?;
        Ok((d, bytes))
    }
}

fn platform_matches(p: &DescPlatform, want: &Platform) -> bool {
    p.os == want.os
        && p.architecture == want.architecture
        && (want.variant.is_none() || p.variant.as_deref() == want.variant.as_deref())
}

/// Open the image `reference` (or the only one) of the OCI layout at `path`.
pub fn open_oci_layout(
    path: &Path,
    reference: Option<&str>,
    platform: &Platform,
) -> Result<ImageSource, SourceError> {
    let layout = Layout { root: path.to_owned() };
    let index_path = path.join("index.json");
    let index_bytes = read_limited(
        File::open(&index_path).map_err(SourceError::io(&index_path, "open"))?,
        &index_path.display().to_string(),
    )?;
    let index: Document = json("index.json", &index_bytes)?;
    let manifests = index.manifests.unwrap_or_default();
    let refs: Vec<String> = manifests
        .iter()
        .filter_map(|m| m.annotations.get("org.opencontainers.image.ref.name").cloned())
        .collect();
    let chosen = match reference {
        Some(r) => manifests
            .iter()
            .rev()
            .find(|m| {
                m.annotations.get("org.opencontainers.image.ref.name").map(String::as_str) == Some(r)
                    || m.digest == r
            })
            .ok_or_else(|| SourceError::NoSuchRef {
                path: path.to_owned(),
                reference: r.to_owned(),
                available: refs.join(", "),
            })?,
        None => match manifests.as_slice() {
            [one] => one,
            _ => {
                return Err(SourceError::AmbiguousRef {
                    path: path.to_owned(),
                    count: manifests.len(),
                    hint: format!("oci:{}:REF with REF one of [{}]", path.display(), refs.join(", ")),
                })
            }
        },
    };
    let (manifest_digest, manifest) = resolve(&layout, chosen, platform, 0)?;
    let image = assemble(&layout, &manifest_digest, &manifest, |_name, digest, _size| {
        let path = layout.blob_path(digest);
        // A missing blob is reported now, before any work.
        drop(layout.open_blob(digest)?);
        let open: super::layer::Opener =
            Box::new(move || Ok(Box::new(File::open(&path)?) as Box<dyn Read + Send>));
        Ok(open)
    })?;
    let provenance = serde_json::json!({
        "manifest": manifest_digest.to_string(),
        "config": image.config_digest.to_string(),
        "layers": image.layer_digests,
    });
    Ok(ImageSource { layers: image.layers, config: image.config, provenance })
}

/// A resolved image manifest's parts.
pub(super) struct Assembled {
    pub(super) layers: Vec<LayerBlob>,
    pub(super) config: RuntimeConfig,
    pub(super) config_digest: Digest,
    pub(super) layer_digests: Vec<String>,
}

/// Read the config of `manifest`, normalize it and describe the layers; `opener` makes each
/// layer's reader from (name, digest, size).
pub(super) fn assemble(
    docs: &dyn Documents,
    manifest_digest: &Digest,
    manifest: &Document,
    mut opener: impl FnMut(&str, &Digest, Option<u64>) -> Result<super::layer::Opener, SourceError>,
) -> Result<Assembled, SourceError> {
    let config_desc = manifest.config.as_ref().ok_or_else(|| SourceError::Layout {
        path: docs.location(manifest_digest),
        reason: "the manifest has no config".into(),
    })?;
    let (config_digest, config_bytes) = docs.config("image config", config_desc)?;
    let (config, diff_ids) = normalize_config(&config_bytes)?;
    let descs = manifest.layers.as_deref().unwrap_or_default();
    if diff_ids.len() != descs.len() {
        return Err(SourceError::LayerCountMismatch {
            what: format!("manifest {manifest_digest}"),
            count: descs.len(),
            diff_ids: diff_ids.len(),
        });
    }
    let mut layers = Vec::with_capacity(descs.len());
    for (i, (desc, diff_id)) in descs.iter().zip(&diff_ids).enumerate() {
        let name = format!("layer {i} ({})", desc.digest);
        let digest = Digest::parse(&name, &desc.digest)?;
        let diff_id = Digest::parse(&format!("{name} diff_id"), diff_id)?;
        let open = opener(&name, &digest, desc.size)?;
        layers.push(LayerBlob { name, open, digest: Some(digest), size: desc.size, diff_id: Some(diff_id) });
    }
    Ok(Assembled {
        layers,
        config,
        config_digest,
        layer_digests: descs.iter().map(|d| d.digest.clone()).collect(),
    })
}

/// Follow indexes down to one image manifest, picking `platform` in multi-platform indexes.
fn resolve(
    docs: &dyn Documents,
    desc: &Descriptor,
    platform: &Platform,
    depth: usize,
) -> Result<(Digest, Document), SourceError> {
    if depth > MAX_NESTING {
        return Err(SourceError::NestingTooDeep { what: desc.digest.clone(), limit: MAX_NESTING });
    }
    let what = format!("manifest {}", desc.digest);
    let (digest, bytes) = docs.manifest(&what, desc)?;
    resolve_document(docs, &what, digest, &bytes, &desc.media_type, platform, depth)
}

/// [`resolve`] from a fetched document (`media_type`: the descriptor's or the transport's,
/// used when the document names none).
pub(super) fn resolve_document(
    docs: &dyn Documents,
    what: &str,
    digest: Digest,
    bytes: &[u8],
    media_type: &str,
    platform: &Platform,
    depth: usize,
) -> Result<(Digest, Document), SourceError> {
    let what = what.to_owned();
    let doc: Document = json(&what, bytes)?;
    let media_type = if doc.media_type.is_empty() { media_type } else { doc.media_type.as_str() };
    let is_index = INDEX_TYPES.contains(&media_type) || (media_type.is_empty() && doc.manifests.is_some());
    if is_index {
        let children = doc.manifests.unwrap_or_default();
        let with_platform: Vec<&Descriptor> = children.iter().filter(|c| c.platform.is_some()).collect();
        let pick = if with_platform.is_empty() {
            // A nested index without platforms (e.g. one image wrapped in an index): its only entry.
            match children.as_slice() {
                [one] => Some(one),
                _ => None,
            }
        } else {
            children.iter().find(|c| c.platform.as_ref().is_some_and(|p| platform_matches(p, platform)))
        };
        let Some(pick) = pick else {
            let available: Vec<String> = children
                .iter()
                .filter_map(|c| c.platform.as_ref())
                .map(|p| match &p.variant {
                    Some(v) => format!("{}/{}/{v}", p.os, p.architecture),
                    None => format!("{}/{}", p.os, p.architecture),
                })
                .collect();
            return Err(SourceError::NoMatchingPlatform {
                what,
                platform: platform.to_string(),
                available: available.join(", "),
            });
        };
        return resolve(docs, pick, platform, depth + 1);
    }
    if !(MANIFEST_TYPES.contains(&media_type) || (media_type.is_empty() && doc.layers.is_some())) {
        return Err(SourceError::UnsupportedMediaType { what, media_type: media_type.to_owned() });
    }
    Ok((digest, doc))
}

/// A member of a tar archive on disk: where its bytes are.
#[derive(Debug, Clone)]
enum Member {
    File { offset: u64, size: u64 },
    Link(String),
}

fn clean_member_name(name: &[u8]) -> String {
    let s = String::from_utf8_lossy(name);
    s.split('/').filter(|c| !c.is_empty() && *c != ".").collect::<Vec<_>>().join("/")
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ArchiveManifest {
    config: String,
    #[serde(default)]
    layers: Vec<String>,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
}

/// Pick the image of a docker archive: by `@INDEX` into `manifest.json`, by `REPO[:TAG]` among
/// the `RepoTags` (compared normalized: `app` is `docker.io/library/app:latest`), or the only one.
fn select_archive_image<'a>(
    path: &Path,
    manifests: &'a [ArchiveManifest],
    reference: Option<&str>,
) -> Result<&'a ArchiveManifest, SourceError> {
    let choices = || {
        let mut list = Vec::new();
        for (i, m) in manifests.iter().enumerate() {
            let tags = m.repo_tags.as_deref().unwrap_or_default();
            if tags.is_empty() {
                list.push(format!("@{i}"));
            } else {
                list.push(format!("@{i} ({})", tags.join(", ")));
            }
        }
        list.join("; ")
    };
    let Some(reference) = reference else {
        return match manifests {
            [one] => Ok(one),
            _ => Err(SourceError::AmbiguousRef {
                path: path.to_owned(),
                count: manifests.len(),
                hint: format!(
                    "docker-archive:{p}:REPO[:TAG] or docker-archive:{p}:@INDEX with one of: {}",
                    choices(),
                    p = path.display()
                ),
            }),
        };
    };
    let no_such = || SourceError::NoSuchRef {
        path: path.to_owned(),
        reference: reference.to_owned(),
        available: if manifests.is_empty() { "none".to_owned() } else { choices() },
    };
    if let Some(index) = reference.strip_prefix('@') {
        let i: usize = index.parse().map_err(|_| no_such())?;
        return manifests.get(i).ok_or_else(no_such);
    }
    let want = normalize_docker_reference(reference);
    let matching: Vec<&ArchiveManifest> = manifests
        .iter()
        .filter(|m| {
            m.repo_tags.as_deref().unwrap_or_default().iter().any(|t| normalize_docker_reference(t) == want)
        })
        .collect();
    match matching.as_slice() {
        [one] => Ok(one),
        [] => Err(no_such()),
        more => Err(SourceError::AmbiguousRef {
            path: path.to_owned(),
            count: more.len(),
            hint: format!("docker-archive:{}:@INDEX with one of: {}", path.display(), choices()),
        }),
    }
}

/// Open an image of a `docker save` / `skopeo copy … docker-archive:` tarball (`reference`: see
/// [`SourceSpec::DockerArchive`]).
pub fn open_docker_archive(path: &Path, reference: Option<&str>) -> Result<ImageSource, SourceError> {
    let file = File::open(path).map_err(SourceError::io(path, "open"))?;
    let mut members: HashMap<String, Member> = HashMap::new();
    {
        let mut archive = tar::Archive::new(io::BufReader::new(&file));
        let entries = archive
            .entries()
            .map_err(|e| SourceError::Corrupt { layer: path.display().to_string(), source: e })?;
        for entry in entries {
            let entry =
                entry.map_err(|e| SourceError::Corrupt { layer: path.display().to_string(), source: e })?;
            let name = clean_member_name(&entry.path_bytes());
            match entry.header().entry_type() {
                tar::EntryType::Regular | tar::EntryType::Continuous => {
                    members
                        .insert(name, Member::File { offset: entry.raw_file_position(), size: entry.size() });
                }
                tar::EntryType::Symlink | tar::EntryType::Link => {
                    if let Some(target) = entry.link_name_bytes() {
                        let target = clean_member_name(&target);
                        // Symlinks are relative to the member's directory; hard links to the root.
                        let resolved = match (entry.header().entry_type(), name.rsplit_once('/')) {
                            (tar::EntryType::Symlink, Some((dir, _))) => {
                                clean_relative(&format!("{dir}/{target}"))
                            }
                            _ => clean_relative(&target),
                        };
                        members.insert(name, Member::Link(resolved));
                    }
                }
                _ => {}
            }
        }
    }
    let find = |name: &str| -> Result<(u64, u64), SourceError> {
        let mut cur = clean_relative(name);
        for _ in 0..8 {
            match members.get(&cur) {
                Some(Member::File { offset, size }) => return Ok((*offset, *size)),
                Some(Member::Link(t)) => cur = t.clone(),
                None => break,
            }
        }
        Err(SourceError::Layout {
            path: path.to_owned(),
            reason: format!("the archive has no member {name:?}"),
        })
    };
    let read_member = |name: &str| -> Result<Vec<u8>, SourceError> {
        let (offset, size) = find(name)?;
        if size > MAX_DOCUMENT {
            return Err(SourceError::DocumentTooLarge { what: name.to_owned(), limit: MAX_DOCUMENT });
        }
        let mut f = File::open(path).map_err(SourceError::io(path, "open"))?;
        f.seek(SeekFrom::Start(offset)).map_err(SourceError::io(path, "seek"))?;
        let mut buf = vec![0u8; size as usize];
        f.read_exact(&mut buf).map_err(SourceError::io(path, "read"))?;
        Ok(buf)
    };
    let manifests: Vec<ArchiveManifest> = json("manifest.json", &read_member("manifest.json")?)?;
    let manifest = select_archive_image(path, &manifests, reference)?;
    let config_bytes = read_member(&manifest.config)?;
    // skopeo and docker name the config by its digest: check it when the name says so.
    let stem = manifest.config.rsplit('/').next().unwrap_or("").trim_end_matches(".json");
    if let Ok(d) = Digest::parse("config", &format!("sha256:{stem}")) {
        check_digest(&format!("config {}", manifest.config), &config_bytes, &d)?;
    }
    let (config, diff_ids) = normalize_config(&config_bytes)?;
    if diff_ids.len() != manifest.layers.len() {
        return Err(SourceError::LayerCountMismatch {
            what: format!("{} manifest.json", path.display()),
            count: manifest.layers.len(),
            diff_ids: diff_ids.len(),
        });
    }
    let mut layers = Vec::with_capacity(manifest.layers.len());
    for (i, (member, diff_id)) in manifest.layers.iter().zip(&diff_ids).enumerate() {
        let name = format!("layer {i} ({member})");
        let (offset, size) = find(member)?;
        let diff_id = Digest::parse(&format!("{name} diff_id"), diff_id)?;
        let archive = path.to_owned();
        let open: super::layer::Opener = Box::new(move || {
            let mut f = File::open(&archive)?;
            f.seek(SeekFrom::Start(offset))?;
            Ok(Box::new(f.take(size)) as Box<dyn Read + Send>)
        });
        layers.push(LayerBlob { name, open, digest: None, size: Some(size), diff_id: Some(diff_id) });
    }
    let provenance = serde_json::json!({
        "config": manifest.config,
        "repo_tags": manifest.repo_tags,
        "diff_ids": diff_ids,
    });
    Ok(ImageSource { layers, config, provenance })
}

fn clean_relative(p: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            c => out.push(c),
        }
    }
    out.join("/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_spec_and_platform() {
        assert_eq!(SourceSpec::parse("rootfs").unwrap(), SourceSpec::Dir("rootfs".into()));
        assert_eq!(
            SourceSpec::parse("oci:/no/such/dir:v1").unwrap(),
            SourceSpec::Oci { path: "/no/such/dir".into(), reference: Some("v1".into()) }
        );
        assert_eq!(
            SourceSpec::parse("oci:/no/such/dir").unwrap(),
            SourceSpec::Oci { path: "/no/such/dir".into(), reference: None }
        );
        assert_eq!(
            SourceSpec::parse("docker-archive:x.tar").unwrap(),
            SourceSpec::DockerArchive { path: "x.tar".into(), reference: None }
        );
        assert_eq!(
            SourceSpec::parse("docker-archive:/no/such.tar:example.com:5000/app:v1").unwrap(),
            SourceSpec::DockerArchive {
                path: "/no/such.tar".into(),
                reference: Some("example.com:5000/app:v1".into())
            }
        );
        let dir = tempfile::tempdir().unwrap();
        let odd = dir.path().join("a:b.tar");
        std::fs::write(&odd, b"").unwrap();
        assert_eq!(
            SourceSpec::parse(&format!("docker-archive:{}:app:v1", odd.display())).unwrap(),
            SourceSpec::DockerArchive { path: odd.clone(), reference: Some("app:v1".into()) }
        );
        assert_eq!(
            SourceSpec::parse(&format!("docker-archive:{}", odd.display())).unwrap(),
            SourceSpec::DockerArchive { path: odd, reference: None }
        );
        assert!(SourceSpec::parse("oci:").is_err());
        let p: Platform = "linux/arm64/v8".parse().unwrap();
        assert_eq!(p.variant.as_deref(), Some("v8"));
        assert!("linux".parse::<Platform>().is_err());
        assert!("linux/amd64/v1/x".parse::<Platform>().is_err());
    }

    #[test]
    fn docker_archive_image_selection() {
        assert_eq!(normalize_docker_reference("app"), "docker.io/library/app:latest");
        assert_eq!(normalize_docker_reference("app:v1"), "docker.io/library/app:v1");
        assert_eq!(normalize_docker_reference("me/app:v1"), "docker.io/me/app:v1");
        assert_eq!(normalize_docker_reference("localhost:5000/app"), "localhost:5000/app:latest");
        assert_eq!(normalize_docker_reference("example.com/a/b:2"), "example.com/a/b:2");
        let m = |config: &str, tags: &[&str]| ArchiveManifest {
            config: config.into(),
            layers: Vec::new(),
            repo_tags: Some(tags.iter().map(|t| t.to_string()).collect()),
        };
        let list = vec![
            m("one", &["docker.io/library/app:latest", "example.com/app:v1"]),
            m("two", &["app:v2"]),
            m("three", &[]),
        ];
        let p = Path::new("x.tar");
        let pick = |r: Option<&str>| select_archive_image(p, &list, r).map(|m| m.config.clone());
        assert_eq!(pick(Some("app")).unwrap(), "one");
        assert_eq!(pick(Some("docker.io/library/app:latest")).unwrap(), "one");
        assert_eq!(pick(Some("example.com/app:v1")).unwrap(), "one");
        assert_eq!(pick(Some("docker.io/library/app:v2")).unwrap(), "two");
        assert_eq!(pick(Some("@2")).unwrap(), "three");
        let err = pick(None).unwrap_err().to_string();
        assert!(err.contains("3 images") && err.contains("@1 (app:v2)") && err.contains("@2"), "{err}");
        let err = pick(Some("app:v3")).unwrap_err().to_string();
        assert!(err.contains("\"app:v3\"") && err.contains("example.com/app:v1"), "{err}");
        assert!(matches!(pick(Some("@3")), Err(SourceError::NoSuchRef { .. })));
        assert!(matches!(pick(Some("@x")), Err(SourceError::NoSuchRef { .. })));
        let dup = vec![m("a", &["app:v1"]), m("b", &["app:v1"])];
        assert!(matches!(
            select_archive_image(p, &dup, Some("app:v1")),
            Err(SourceError::AmbiguousRef { .. })
        ));
        assert_eq!(select_archive_image(p, &dup[..1], None).unwrap().config, "a");
    }

    #[test]
    fn config_normalization() {
        let (c, diff) = normalize_config(
            br#"{"config":{"Env":["B=2","A=1","B=3","PLAIN"],"Entrypoint":[],"Cmd":["sh"],
                "Labels":{"z":"1","a":"2"},"WorkingDir":"/w"},"rootfs":{"type":"layers","diff_ids":["x"]}}"#,
        )
        .unwrap();
        assert_eq!(c.env, vec!["A=1", "B=3", "PLAIN"]);
        assert_eq!(c.entrypoint, None);
        assert_eq!(c.cmd, Some(vec!["sh".to_string()]));
        assert_eq!(c.working_dir, "/w");
        assert_eq!(c.user, "");
        assert_eq!(c.labels.keys().collect::<Vec<_>>(), vec!["a", "z"]);
        assert_eq!(diff, vec!["x"]);
        let (empty, _) = normalize_config(b"{}").unwrap();
        assert_eq!(empty, RuntimeConfig::default());
        assert!(matches!(normalize_config(b"{"), Err(SourceError::Json { .. })));
    }
}

#[cfg(test)]
mod layout_tests {
    use std::fs;

    use serde_json::json;

    use super::*;

    struct TestLayout {
        dir: tempfile::TempDir,
    }

    impl TestLayout {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            fs::create_dir_all(dir.path().join("blobs/sha256")).unwrap();
            fs::write(dir.path().join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
            Self { dir }
        }

        fn put(&self, bytes: &[u8]) -> serde_json::Value {
            let hex = hex::encode(Sha256::digest(bytes));
            fs::write(self.dir.path().join("blobs/sha256").join(&hex), bytes).unwrap();
            json!({"digest": format!("sha256:{hex}"), "size": bytes.len()})
        }

        /// An image with one (empty-tar) layer and this entrypoint → its manifest descriptor.
        fn image(&self, entrypoint: &str) -> serde_json::Value {
            let tar = vec![0u8; 1024];
            let layer = self.put(&tar);
            let diff_id = layer["digest"].clone();
            let config = self.put(
                json!({"config": {"Entrypoint": [entrypoint]}, "rootfs": {"type": "layers", "diff_ids": [diff_id]}})
                    .to_string()
                    .as_bytes(),
            );
            let manifest = json!({
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config["digest"], "size": config["size"]},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer["digest"], "size": layer["size"]}],
            });
            let mut d = self.put(manifest.to_string().as_bytes());
            d["mediaType"] = "application/vnd.oci.image.manifest.v1+json".into();
            d
        }

        fn index(&self, manifests: Vec<serde_json::Value>) -> serde_json::Value {
            let index = json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": manifests});
            let mut d = self.put(index.to_string().as_bytes());
            d["mediaType"] = "application/vnd.oci.image.index.v1+json".into();
            d
        }

        fn top(&self, manifests: Vec<serde_json::Value>) {
            fs::write(
                self.dir.path().join("index.json"),
                json!({"schemaVersion": 2, "manifests": manifests}).to_string(),
            )
            .unwrap();
        }

        fn open(&self, r: Option<&str>, p: &str) -> Result<ImageSource, SourceError> {
            open_oci_layout(self.dir.path(), r, &p.parse().unwrap())
        }
    }

    fn with(mut d: serde_json::Value, key: &str, v: serde_json::Value) -> serde_json::Value {
        d[key] = v;
        d
    }

    fn entrypoint(s: &ImageSource) -> String {
        s.config.entrypoint.clone().unwrap_or_default().join(" ")
    }

    #[test]
    fn refs_nested_indexes_and_platforms() {
        let l = TestLayout::new();
        let amd = with(l.image("amd"), "platform", json!({"os": "linux", "architecture": "amd64"}));
        let arm = with(
            l.image("arm"),
            "platform",
            json!({"os": "linux", "architecture": "arm64", "variant": "v8"}),
        );
        let multi = l.index(vec![arm, amd]);
        // A multi-platform index wrapped in a platform-less index, as skopeo and docker write.
        let wrapped = l.index(vec![multi]);
        let name = |v: &str| json!({"org.opencontainers.image.ref.name": v});
        let single = with(l.image("single"), "annotations", name("single"));
        l.top(vec![with(wrapped, "annotations", name("multi")), single]);

        assert_eq!(entrypoint(&l.open(Some("multi"), "linux/amd64").unwrap()), "amd");
        assert_eq!(entrypoint(&l.open(Some("multi"), "linux/arm64").unwrap()), "arm");
        assert_eq!(entrypoint(&l.open(Some("multi"), "linux/arm64/v8").unwrap()), "arm");
        assert!(matches!(
            l.open(Some("multi"), "linux/arm64/v7"),
            Err(SourceError::NoMatchingPlatform { .. })
        ));
        assert!(matches!(l.open(Some("multi"), "linux/s390x"), Err(SourceError::NoMatchingPlatform { .. })));
        assert_eq!(entrypoint(&l.open(Some("single"), "linux/amd64").unwrap()), "single");
        assert!(matches!(l.open(Some("nope"), "linux/amd64"), Err(SourceError::NoSuchRef { .. })));
        assert!(matches!(l.open(None, "linux/amd64"), Err(SourceError::AmbiguousRef { count: 2, .. })));
        let src = l.open(Some("single"), "linux/amd64").unwrap();
        assert_eq!(src.layers.len(), 1);
        assert!(src.layers[0].diff_id.is_some() && src.layers[0].digest.is_some());
    }

    #[test]
    fn missing_and_tampered_blobs() {
        let l = TestLayout::new();
        let img = l.image("x");
        l.top(vec![img.clone()]);
        let manifest_path = |d: &serde_json::Value| {
            let hex = d["digest"].as_str().unwrap().trim_start_matches("sha256:").to_owned();
            l.dir.path().join("blobs/sha256").join(hex)
        };
        assert!(l.open(None, "linux/amd64").is_ok());
        let manifest: serde_json::Value =
            serde_json::from_slice(&fs::read(manifest_path(&img)).unwrap()).unwrap();
        // A layer blob missing: reported before any work.
        let layer = manifest_path(&manifest["layers"][0]);
        let saved = fs::read(&layer).unwrap();
        fs::remove_file(&layer).unwrap();
        assert!(matches!(l.open(None, "linux/amd64"), Err(SourceError::MissingBlob { .. })));
        fs::write(&layer, saved).unwrap();
        // A tampered config.
        let config = manifest_path(&manifest["config"]);
        let mut bytes = fs::read(&config).unwrap();
        bytes[2] ^= 1;
        fs::write(&config, bytes).unwrap();
        assert!(matches!(l.open(None, "linux/amd64"), Err(SourceError::DigestMismatch { .. })));
        // A digest that is not one (path traversal attempt).
        l.top(vec![json!({"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": "sha256:../../etc/passwd", "size": 1})]);
        assert!(matches!(l.open(None, "linux/amd64"), Err(SourceError::BadDigest { .. })));
    }
}
