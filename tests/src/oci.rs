//! OCI images for the end-to-end tests, made with the reference tools: `umoci` (layouts, layers
//! computed from changed root filesystems, the reference unpacker) and `skopeo` (docker archives,
//! zstd recompression). Also adds hand-written layers to a layout, for what umoci does not write
//! (opaque directories, PAX atime/ctime).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::judge::run;

/// Fail with a clear message when a tool is missing (`cargo xtask test` installs them).
pub fn require_tools() -> Result<()> {
    for (tool, package) in [("umoci", "umoci"), ("skopeo", "skopeo"), ("bsdtar", "libarchive-tools")] {
        let ok = Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success());
        ensure!(ok, "{tool} not found: install the Debian package {package} (cargo xtask test does)");
    }
    Ok(())
}

/// An OCI layout under construction: `layout:tag` with a bundle to change the root filesystem.
#[derive(Debug)]
pub struct UmociImage {
    pub layout: PathBuf,
    pub tag: String,
    work: PathBuf,
}

impl UmociImage {
    /// `umoci init` + `umoci new`: an image with no layers.
    pub fn new(work: &Path, tag: &str) -> Result<Self> {
        let layout = work.join("layout");
        run(Command::new("umoci").arg("init").arg("--layout").arg(&layout))?;
        let me = Self { layout, tag: tag.to_owned(), work: work.to_owned() };
        run(Command::new("umoci").arg("new").arg("--image").arg(me.image_ref()))?;
        Ok(me)
    }

    /// A copy of this layout under `work` (same blobs, so layers made once stay byte-identical).
    pub fn copy_to(&self, work: &Path) -> Result<Self> {
        fs::create_dir_all(work)?;
        let layout = work.join("layout");
        run(Command::new("cp").arg("-a").arg(&self.layout).arg(&layout))?;
        Ok(Self { layout, tag: self.tag.clone(), work: work.to_owned() })
    }

    /// `layout:tag`.
    pub fn image_ref(&self) -> String {
        format!("{}:{}", self.layout.display(), self.tag)
    }

    /// `oci:layout:tag`, for `tessera build`.
    pub fn source(&self) -> String {
        format!("oci:{}", self.image_ref())
    }

    /// Unpack the current image into a fresh bundle, let `change` edit its rootfs, and add the
    /// difference as a layer (`umoci repack --refresh-bundle` computes whiteouts).
    pub fn layer(&self, change: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
        let bundle = self.work.join("bundle");
        if bundle.exists() {
            fs::remove_dir_all(&bundle)?;
        }
        run(Command::new("umoci").arg("unpack").arg("--image").arg(self.image_ref()).arg(&bundle))?;
        change(&bundle.join("rootfs"))?;
        run(Command::new("umoci")
            .args(["repack", "--refresh-bundle", "--image"])
            .arg(self.image_ref())
            .arg(&bundle))?;
        fs::remove_dir_all(&bundle)?;
        Ok(())
    }

    /// `umoci unpack` into `dir`; returns the rootfs path (the reference tree).
    pub fn unpack(&self, dir: &Path) -> Result<PathBuf> {
        run(Command::new("umoci").arg("unpack").arg("--image").arg(self.image_ref()).arg(dir))?;
        Ok(dir.join("rootfs"))
    }

    /// `umoci config` with extra arguments (e.g. `--config.entrypoint /bin/sh`).
    pub fn config(&self, args: &[&str]) -> Result<()> {
        run(Command::new("umoci").arg("config").arg("--image").arg(self.image_ref()).args(args))?;
        Ok(())
    }

    fn blob_path(&self, digest: &str) -> Result<PathBuf> {
        let hex = digest.strip_prefix("sha256:").with_context(|| format!("digest {digest}"))?;
        Ok(self.layout.join("blobs/sha256").join(hex))
    }

    fn put_blob(&self, bytes: &[u8]) -> Result<(String, u64)> {
        let digest = format!("sha256:{}", hex::encode(Sha256::digest(bytes)));
        fs::write(self.blob_path(&digest)?, bytes)?;
        Ok((digest, bytes.len() as u64))
    }

    /// The manifest descriptor of the tag in index.json, and the index.
    fn tagged(&self) -> Result<(Value, usize)> {
        let index: Value = serde_json::from_slice(&fs::read(self.layout.join("index.json"))?)?;
        let list = index["manifests"].as_array().context("index.json without manifests")?;
        let i = list
            .iter()
            .position(|m| m["annotations"]["org.opencontainers.image.ref.name"].as_str() == Some(&self.tag))
            .with_context(|| format!("tag {} not in index.json", self.tag))?;
        Ok((index, i))
    }

    /// The manifest of the tag.
    pub fn manifest(&self) -> Result<Value> {
        let (index, i) = self.tagged()?;
        let d = index["manifests"][i]["digest"].as_str().context("descriptor without digest")?;
        Ok(serde_json::from_slice(&fs::read(self.blob_path(d)?)?)?)
    }

    /// Digest of the blob of layer `i` (0 = lowest).
    pub fn layer_digest(&self, i: usize) -> Result<String> {
        let m = self.manifest()?;
        Ok(m["layers"][i]["digest"].as_str().context("no such layer")?.to_owned())
    }

    /// Path of the blob with this digest.
    pub fn blob(&self, digest: &str) -> Result<PathBuf> {
        self.blob_path(digest)
    }

    /// Append a hand-written layer (an uncompressed tar, stored gzip-compressed) to the tagged
    /// image: new blob, config (diff_ids, history), manifest and index entry.
    pub fn append_tar_layer(&self, tar: &[u8]) -> Result<()> {
        let diff_id = format!("sha256:{}", hex::encode(Sha256::digest(tar)));
        let (layer_digest, layer_size) = self.put_blob(&gzip(tar)?)?;
        self.append_layer(&layer_digest, layer_size, &diff_id)
    }

    /// Append the tar that `tar --format=posix -C DIR -cf - .` writes (PAX: times with
    /// nanoseconds), gzip-compressed with stored deflate
    /// blocks (fast for large incompressible trees: nothing to search, only CRCs and hashes),
    /// streamed — the layer is never held in memory.
    pub fn append_dir_layer_stored_gzip(&self, dir: &Path) -> Result<()> {
        let tmp_blob = self.layout.join("blobs/sha256/.incoming");
        let mut child = Command::new("tar")
            .args(["--format=posix", "--numeric-owner", "--sort=name", "-C"])
            .arg(dir)
            .args(["-cf", "-", "."])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .context("spawn tar")?;
        let mut tar_out = child.stdout.take().context("tar stdout")?;
        let mut compressed =
            HashingWriter { inner: fs::File::create(&tmp_blob)?, hasher: Sha256::new(), count: 0 };
        let mut diff = Sha256::new();
        {
            let mut gz = flate2::write::GzEncoder::new(&mut compressed, flate2::Compression::none());
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = std::io::Read::read(&mut tar_out, &mut buf)?;
                if n == 0 {
                    break;
                }
                diff.update(&buf[..n]);
                std::io::Write::write_all(&mut gz, &buf[..n])?;
            }
            gz.finish()?;
        }
        ensure!(child.wait()?.success(), "tar -C {} failed", dir.display());
        let digest = format!("sha256:{}", hex::encode(compressed.hasher.finalize()));
        fs::rename(&tmp_blob, self.blob_path(&digest)?)?;
        self.append_layer(&digest, compressed.count, &format!("sha256:{}", hex::encode(diff.finalize())))
    }

    /// Add a layer blob already in `blobs/` to the config (diff_ids, history), manifest and index.
    fn append_layer(&self, layer_digest: &str, layer_size: u64, diff_id: &str) -> Result<()> {
        let (mut index, i) = self.tagged()?;
        let mut manifest = self.manifest()?;
        let config_digest =
            manifest["config"]["digest"].as_str().context("manifest without config")?.to_owned();
        let mut config: Value = serde_json::from_slice(&fs::read(self.blob_path(&config_digest)?)?)?;
        config["rootfs"]["diff_ids"].as_array_mut().context("config without diff_ids")?.push(diff_id.into());
        if let Some(h) = config["history"].as_array_mut() {
            h.push(serde_json::json!({"created_by": "tessera e2e: hand-written layer"}));
        }
        let (cd, cs) = self.put_blob(&serde_json::to_vec(&config)?)?;
        manifest["config"]["digest"] = cd.into();
        manifest["config"]["size"] = cs.into();
        manifest["layers"].as_array_mut().context("manifest without layers")?.push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
            "digest": layer_digest,
            "size": layer_size,
        }));
        let (md, ms) = self.put_blob(&serde_json::to_vec(&manifest)?)?;
        index["manifests"][i]["digest"] = md.into();
        index["manifests"][i]["size"] = ms.into();
        fs::write(self.layout.join("index.json"), serde_json::to_vec(&index)?)?;
        Ok(())
    }

    /// Tag `tag` an image of the tagged image's lowest `keep` layers (same blobs and config but
    /// for the layer list and diff_ids): an older version of the image, as a base it grew from.
    pub fn tag_lower_layers(&self, tag: &str, keep: usize) -> Result<()> {
        let (mut index, i) = self.tagged()?;
        let mut manifest = self.manifest()?;
        let config_digest =
            manifest["config"]["digest"].as_str().context("manifest without config")?.to_owned();
        let mut config: Value = serde_json::from_slice(&fs::read(self.blob_path(&config_digest)?)?)?;
        config["rootfs"]["diff_ids"].as_array_mut().context("config without diff_ids")?.truncate(keep);
        if let Some(h) = config["history"].as_array_mut() {
            h.truncate(keep);
        }
        let (cd, cs) = self.put_blob(&serde_json::to_vec(&config)?)?;
        manifest["config"]["digest"] = cd.into();
        manifest["config"]["size"] = cs.into();
        manifest["layers"].as_array_mut().context("manifest without layers")?.truncate(keep);
        let (md, ms) = self.put_blob(&serde_json::to_vec(&manifest)?)?;
        let mut desc = index["manifests"][i].clone();
        desc["digest"] = md.into();
        desc["size"] = ms.into();
        desc["annotations"]["org.opencontainers.image.ref.name"] = tag.into();
        index["manifests"].as_array_mut().context("index without manifests")?.push(desc);
        fs::write(self.layout.join("index.json"), serde_json::to_vec(&index)?)?;
        Ok(())
    }

    /// Append a layer written by `bsdtar --format pax --xattrs -C DIR -cf - .` (libarchive: PAX
    /// `LIBARCHIVE.xattr.*` records next to `SCHILY.xattr.*` ones).
    pub fn append_bsdtar_layer(&self, dir: &Path) -> Result<()> {
        let out = Command::new("bsdtar")
            .args(["--format", "pax", "--xattrs", "--numeric-owner", "-C"])
            .arg(dir)
            .args(["-cf", "-", "."])
            .output()
            .context("bsdtar (Debian package libarchive-tools)")?;
        ensure!(out.status.success(), "bsdtar failed: {}", String::from_utf8_lossy(&out.stderr));
        self.append_tar_layer(&out.stdout)
    }
}

/// Counts and hashes what passes through to a file.
struct HashingWriter {
    inner: fs::File,
    hasher: Sha256,
    count: u64,
}

impl std::io::Write for HashingWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn gzip(bytes: &[u8]) -> Result<Vec<u8>> {
    let dir = tempfile::tempdir()?;
    let p = dir.path().join("layer");
    fs::write(&p, bytes)?;
    run(Command::new("gzip").arg("-n").arg(&p))?;
    Ok(fs::read(dir.path().join("layer.gz"))?)
}

/// A tar stream written by hand (ustar headers + PAX records), for layers umoci would not write.
#[derive(Debug, Default)]
pub struct TarWriter {
    out: Vec<u8>,
}

fn octal(field: &mut [u8], v: u64) {
    let n = field.len() - 1;
    let s = format!("{:0width$o}", v, width = n);
    field[..n].copy_from_slice(&s.as_bytes()[..n]);
    field[n] = 0;
}

impl TarWriter {
    fn header(&mut self, name: &[u8], kind: u8, size: u64, mode: u32, link: &[u8], dev: (u32, u32)) {
        let mut h = [0u8; 512];
        h[..name.len()].copy_from_slice(name);
        octal(&mut h[100..108], u64::from(mode));
        octal(&mut h[108..116], 0);
        octal(&mut h[116..124], 0);
        octal(&mut h[124..136], size);
        octal(&mut h[136..148], 1_600_000_000);
        h[156] = kind;
        h[157..157 + link.len()].copy_from_slice(link);
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        octal(&mut h[329..337], u64::from(dev.0));
        octal(&mut h[337..345], u64::from(dev.1));
        h[148..156].fill(b' ');
        let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
        octal(&mut h[148..155], u64::from(sum));
        h[155] = b' ';
        self.out.extend_from_slice(&h);
    }

    fn data(&mut self, bytes: &[u8]) {
        self.out.extend_from_slice(bytes);
        let pad = (512 - bytes.len() % 512) % 512;
        self.out.extend(std::iter::repeat_n(0u8, pad));
    }

    /// PAX records for the next entry.
    pub fn pax(&mut self, records: &[(&str, &[u8])]) -> &mut Self {
        let mut body = Vec::new();
        for (k, v) in records {
            let rest = k.len() + v.len() + 3; // ' ', '=', '\n'
            let mut len = rest + 1;
            while format!("{len}").len() + rest != len {
                len = format!("{len}").len() + rest;
            }
            body.extend_from_slice(format!("{len} {k}=").as_bytes());
            body.extend_from_slice(v);
            body.push(b'\n');
        }
        self.header(b"PaxHeaders/x", b'x', body.len() as u64, 0o644, b"", (0, 0));
        self.data(&body);
        self
    }

    pub fn file(&mut self, name: &str, mode: u32, content: &[u8]) -> &mut Self {
        self.header(name.as_bytes(), b'0', content.len() as u64, mode, b"", (0, 0));
        self.data(content);
        self
    }

    pub fn dir(&mut self, name: &str, mode: u32) -> &mut Self {
        self.header(name.as_bytes(), b'5', 0, mode, b"", (0, 0));
        self
    }

    pub fn symlink(&mut self, name: &str, target: &str) -> &mut Self {
        self.header(name.as_bytes(), b'2', 0, 0o777, target.as_bytes(), (0, 0));
        self
    }

    pub fn hardlink(&mut self, name: &str, target: &str) -> &mut Self {
        self.header(name.as_bytes(), b'1', 0, 0o644, target.as_bytes(), (0, 0));
        self
    }

    pub fn device(&mut self, name: &str, kind: u8, mode: u32, major: u32, minor: u32) -> &mut Self {
        self.header(name.as_bytes(), kind, 0, mode, b"", (major, minor));
        self
    }

    /// The stream with its end-of-archive blocks.
    pub fn finish(&mut self) -> Vec<u8> {
        let mut out = std::mem::take(&mut self.out);
        out.extend(std::iter::repeat_n(0u8, 1024));
        out
    }
}

/// `skopeo copy SRC DST EXTRA...`.
pub fn skopeo_copy(src: &str, dst: &str, extra: &[&str]) -> Result<()> {
    let out = Command::new("skopeo").arg("copy").args(extra).arg(src).arg(dst).output()?;
    if !out.status.success() {
        bail!("skopeo copy {src} {dst} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// `tessera build SOURCE --store STORE ARGS` → (success, stdout, stderr), for sources that are
/// not directories.
pub fn build_source(source: &str, store: &Path, args: &[&str]) -> Result<std::process::Output> {
    let mut c = crate::tessera::command(["build", source, "--store"]);
    c.arg(store).args(args);
    c.output().with_context(|| format!("spawn {c:?}"))
}

/// `tessera build SOURCE` that must succeed → image ID.
pub fn build_ok(source: &str, store: &Path, args: &[&str]) -> Result<crate::tessera::ImageId> {
    let out = build_source(source, store, args)?;
    if !out.status.success() {
        bail!("tessera build {source} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    crate::tessera::parse_build_stdout(&out.stdout)
}
