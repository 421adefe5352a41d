//! `tessera`: build container images into lazily served ext4 block devices.
//!
//! Exit status: 0 success, 1 failure (including an unknown image or tag), 2 usage error (bad flags,
//! or a write to a read-only store).

mod activation;
mod cache_args;
mod cache_cmd;
mod cmd;
mod completions;
mod copy;
mod malloc;
mod origin_args;
mod profile;
mod progress;
mod push;
mod serve;
mod store_cmd;
mod trace;
mod warm;
mod watch;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use tessera_store::StoreLocation;
use tracing_subscriber::EnvFilter;

/// A usage error: reported like clap's own, exit status 2.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// An error and its causes on one line (`outer: cause: root cause`). Library errors do not repeat
/// their source in their own message, so `to_string()` alone would drop the causes.
pub fn error_text(e: impl std::error::Error + Send + Sync + 'static) -> String {
    format!("{:#}", anyhow::Error::new(e))
}

#[derive(Debug, Parser)]
#[command(
    name = "tessera",
    version,
    about = "Serve container images to microVMs as lazily loaded ext4 block devices",
    long_about = "Tessera builds a directory tree or an OCI image into an ext4 filesystem whose \
metadata is synthesized directly and whose file data is cut into deduplicated, compressed, \
content-addressed chunks in a store. The image can be exported as a raw device or served lazily.",
    after_help = "Exit status: 0 success, 1 failure (including an unknown image or tag), 2 usage error.\n\
Logs: set RUST_LOG (e.g. RUST_LOG=info or RUST_LOG=tessera_builder=debug); they go to stderr.\n\
\n\
Quick start:\n  tessera build ./rootfs --store ./store --tag demo\n  tessera inspect demo --store ./store\n  \
tessera export demo --store ./store -o demo.img\n  \
tessera serve demo --store ./store --socket /tmp/demo.sock --read-only"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    Build(BuildArgs),
    Export(ExportArgs),
    Inspect(InspectArgs),
    Serve(Box<serve::ServeArgs>),
    Cache(cache_cmd::CacheCmd),
    Push(push::PushArgs),
    Profile(profile::ProfileArgs),
    Warm(warm::WarmArgs),
    Copy(copy::CopyArgs),
    Store(store_cmd::StoreCmd),
    Completions(completions::CompletionsArgs),
    Man(completions::ManArgs),
}

/// Build an image from a directory into a store; prints the image ID.
#[derive(Debug, Args)]
#[command(after_help = "stdout carries exactly one line: the image ID `sha256:<64 hex>`.\n\
\n\
Sizing defaults: the device holds the tree plus at least max(256 MiB, 25% of the file data) of free \
space, rounded up to whole 128 MiB block groups; it has the used inodes plus at least max(4096, \
25% of the used inodes) free. --size fixes the device size, --free the minimum free space, \
--inodes the minimum total inode count.\n\
\n\
Times: the superblock and journal use SOURCE_DATE_EPOCH (Unix seconds, clamped to now; \
anything but a non-negative integer is a usage error) if set, else 2024-01-01T00:00:00Z; files keep their mtime with nanoseconds; atime and ctime are set to mtime.\n\
\n\
Rebuilds: a directory build leaves a source index in the store; the next build of the same \
directory into that store reads only files whose inode, size, mtime or ctime changed (files changed \
within a second before a build are always read again), unless --reread. `RUST_LOG=info` shows \
how many files were left unread.\n\
\n\
Examples:\n  tessera build ./rootfs --store ./store\n  tessera build ./rootfs --store ./store --tag web --free 1G\n  \
tessera build ./rootfs --store file:///var/lib/tessera --size 4G --inodes 200000 --chunk-size 1M\n  \
tessera build oci:./layout:v1 --store ./store --tag app\n  \
tessera build oci:./multiarch --platform linux/arm64/v8 --store ./store --max-size 8G\n  \
tessera build oci:./layout:v1 --store ./store --reference-layers\n  \
tessera build docker-archive:./app.tar --store ./store\n  \
tessera build docker-archive:./images.tar:example.com/app:v1 --store ./store\n  \
tessera build docker://registry.example.com/team/app:v1 --store ./store --creds bot:s3cret\n  \
tessera build docker://127.0.0.1:5000/app@sha256:4f2a... --store ./store\n  \
tessera build manifest:./rootfs.json --store ./store\n\
\n\
Image sources: each layer (tar, tar+gzip, tar+zstd) is streamed once and never unpacked to disk, and \
its layer manifest is kept in the store: a later build with the same layer (same diff_id and chunk \
size) reads the manifest, not the layer (docs/formats/content-manifest.md). Every blob read is \
checked against its digest. Registries: bearer tokens (from the WWW-Authenticate challenge) or \
basic auth; credentials from --creds, REGISTRY_AUTH_FILE or ~/.docker/config.json; HTTPS required unless \
--insecure or the registry is on loopback (then plain HTTP is used when TLS is not offered). Files keep uid, gid, mode, mtime (with nanoseconds), PAX atime and \
ctime when present (else mtime), xattrs; missing parent directories and the root (unless the image has a \
`./` entry) get 0755, 0:0 and the filesystem time. The runtime config (Env, Entrypoint, Cmd, \
WorkingDir, User, Labels) is normalized into the image record (see docs/formats/record.md).")]
pub struct BuildArgs {
    /// The source: DIR, oci:PATH[:REF] (an OCI image layout; REF is an
    /// org.opencontainers.image.ref.name or a manifest digest), docker-archive:PATH[:REF] (docker
    /// save / skopeo docker-archive; REF is REPO[:TAG] from the archive's RepoTags or @INDEX, needed
    /// when it holds several images), docker://HOST[:PORT]/REPO[:TAG|@DIGEST] (a registry; TAG defaults
    /// to latest) or manifest:FILE (a JSON content manifest: paths, attributes, and content by chunk
    /// ids already in the store or by files on disk; docs/formats/manifest-text.md).
    source: String,
    /// The store to write into: PATH or file://PATH (created if missing).
    #[arg(long, value_parser = crate::parse_store)]
    store: StoreLocation,
    /// Also point this tag at the image ([A-Za-z0-9_][A-Za-z0-9._-]{0,127}).
    #[arg(long, value_parser = parse_tag)]
    tag: Option<String>,
    /// Exact device size (e.g. 4G); a multiple of 4 KiB is used.
    #[arg(long, value_parser = parse_size_arg, conflicts_with = "free")]
    size: Option<u64>,
    /// Minimum free space on the device (default: max(256M, 25% of the data)).
    #[arg(long, value_parser = parse_size_arg)]
    free: Option<u64>,
    /// Minimum total number of inodes (default: used + max(4096, 25% of used)).
    #[arg(long)]
    inodes: Option<u64>,
    /// Chunk size for large files: a power of two from 64K to 16M.
    #[arg(long, value_parser = parse_chunk_size, default_value = "512K")]
    chunk_size: u32,
    /// The platform to pick from a multi-platform image index: OS/ARCH[/VARIANT].
    #[arg(long, value_parser = parse_platform, default_value = "linux/amd64")]
    platform: tessera_builder::source::Platform,
    /// Refuse images whose layers decompress to more than this many bytes in total (default: no
    /// limit).
    #[arg(long, value_parser = parse_size_arg)]
    max_size: Option<u64>,
    /// Keep file data in the source image's layers (gzip, or zstd of many frames as zstd:chunked
    /// writes them) instead of converting it (oci: and docker:// sources):
    /// the store gets the layer blobs as they are, the metadata prefix, the record and a reference
    /// pack index with checkpoints (docs/formats/reference-index.md). The image ID is the one a
    /// converted build gives.
    #[arg(long)]
    reference_layers: bool,
    /// Read every file of a directory source. Without it, a build into a store that holds the
    /// previous build of the same directory (same chunk size) reads only the files whose inode,
    /// size, mtime or ctime changed, and takes the others' chunks from that build's source index
    /// (docs/formats/source-index.md); the image is the same either way.
    #[arg(long)]
    reread: bool,
    /// For a docker:// source.
    #[command(flatten)]
    origin: origin_args::OriginArgs,
}

/// Write the whole device as a sparse raw file, assembled through the read path.
#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  tessera export web --store ./store -o web.img\n  \
tessera export sha256:3f1c... --store ./store -o /tmp/x.img && e2fsck -fn /tmp/x.img\n  \
tessera export web --store ./store --overlay vm1.overlay -o vm1.img   # base plus the guest's writes\n  \
tessera export web --store https://cdn.example/tessera --cache-dir /var/cache/tessera -o web.img\n  \
tessera export sha256:3f1c... --store docker://registry.example.com/team/images -o web.img")]
pub struct ExportArgs {
    /// The image: sha256:<64 hex>, a tag, or (registry stores) @sha256:<source image manifest
    /// digest> for the `--reference-layers` image pushed beside its source.
    image: String,
    /// The store holding it: PATH, file://PATH, http(s)://HOST[:PORT][/PREFIX] (read-only),
    /// docker://HOST[:PORT]/REPO (a registry; see `tessera push`) or s3://BUCKET[/PREFIX] (see
    /// `tessera copy`).
    #[arg(long, value_parser = crate::parse_store)]
    store: StoreLocation,
    #[command(flatten)]
    cache: cache_args::CacheArgs,
    #[command(flatten)]
    origin: origin_args::OriginArgs,
    /// Output file (created or truncated; written sparse).
    #[arg(short = 'o', long = "output")]
    output: PathBuf,
    /// Apply this copy-on-write overlay (`tessera serve --overlay FILE`) over the image.
    #[arg(long, value_name = "FILE")]
    overlay: Option<PathBuf>,
    /// Concurrent chunk fetches (threads) ahead of the writer, each one request for a run of
    /// chunks stored back to back (up to 4 MiB). Default: 4 for a local store, 64 for a remote
    /// one (`serve --fetch-jobs`).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024))]
    fetch_jobs: Option<u16>,
}

/// Show an image's geometry, counts, sizes, chunks and dedup.
#[derive(Debug, Args)]
#[command(after_help = "--json prints one object; its keys are documented in docs/inspect.md.\n\
\n\
Examples:\n  tessera inspect web --store ./store\n  tessera inspect web --store ./store --json | jq .dedup_ratio\n  \
tessera inspect web --store http://127.0.0.1:8080/store\n  \
tessera inspect web --store docker://127.0.0.1:5000/images")]
pub struct InspectArgs {
    /// The image: sha256:<64 hex>, a tag, or (registry stores) @sha256:<source image manifest
    /// digest> for the `--reference-layers` image pushed beside its source.
    image: String,
    /// The store holding it: PATH, file://PATH, http(s)://HOST[:PORT][/PREFIX] (read-only),
    /// docker://HOST[:PORT]/REPO (a registry; see `tessera push`) or s3://BUCKET[/PREFIX] (see
    /// `tessera copy`).
    #[arg(long, value_parser = crate::parse_store)]
    store: StoreLocation,
    #[command(flatten)]
    cache: cache_args::CacheArgs,
    #[command(flatten)]
    origin: origin_args::OriginArgs,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Every SIZE option: `tessera_image::parse_size` (binary suffixes K, M, G, T, KiB … TiB).
pub fn parse_size_arg(s: &str) -> Result<u64, String> {
    tessera_image::parse_size(s).map_err(crate::error_text)
}

fn parse_chunk_size(s: &str) -> Result<u32, String> {
    let n = parse_size_arg(s)?;
    if !n.is_power_of_two() || !(64 << 10..=16 << 20).contains(&n) {
        return Err(format!("{s}: chunk size must be a power of two from 64K to 16M"));
    }
    Ok(n as u32)
}

fn parse_platform(s: &str) -> Result<tessera_builder::source::Platform, String> {
    s.parse().map_err(|e: tessera_builder::source::SourceError| crate::error_text(e))
}

/// Every `--store` / `--to`: a typed location, so a malformed one is a usage error (exit 2) at
/// parse time, whatever the command.
pub(crate) fn parse_store(s: &str) -> Result<StoreLocation, String> {
    StoreLocation::parse(s).map_err(crate::error_text)
}

fn parse_tag(s: &str) -> Result<String, String> {
    if tessera_image::validate_tag(s) {
        Ok(s.to_owned())
    } else {
        Err(format!("{s:?} is not a valid tag: expected [A-Za-z0-9_][A-Za-z0-9._-]{{0,127}}"))
    }
}

/// Whether an event may print bytes of the wire: the HTTP and TLS crates' debug and trace
/// events dump headers and bodies (`Authorization`, token responses). They are dropped whatever
/// `RUST_LOG` says, so that no log level prints a credential (`tests/tests/registry_store.rs`
/// greps a `RUST_LOG=trace` run for the secrets).
fn leaks_wire_bytes(target: &str, level: tracing::Level) -> bool {
    const WIRE: [&str; 4] = ["ureq", "ureq_proto", "rustls", "http"];
    let krate = target.split("::").next().unwrap_or(target);
    level > tracing::Level::INFO && WIRE.contains(&krate)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    {
        use std::io::IsTerminal;
        use tracing_subscriber::prelude::*;
        tracing_subscriber::fmt()
            .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")))
            .with_writer(std::io::stderr)
            // Colours for a person at a terminal only: a log file, journald or a pipe gets
            // plain text (and NO_COLOR turns them off, https://no-color.org).
            .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
            .finish()
            .with(tracing_subscriber::filter::filter_fn(|m| !leaks_wire_bytes(m.target(), *m.level())))
            .init();
    }
    let result = match cli.command {
        Command::Build(a) => cmd::build(a),
        Command::Export(a) => cmd::export(a),
        Command::Inspect(a) => cmd::inspect(a),
        Command::Serve(a) => serve::serve(*a),
        Command::Cache(a) => cache_cmd::run(a),
        Command::Push(a) => push::push(a),
        Command::Profile(a) => profile::profile(a),
        Command::Warm(a) => warm::run(a),
        Command::Copy(a) => copy::run(a),
        Command::Store(a) => store_cmd::run(a),
        Command::Completions(a) => completions::completions(a),
        Command::Man(a) => completions::man(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let usage = e.chain().any(|c| c.is::<UsageError>()) || cmd::is_usage_error(&e);
            eprintln!("tessera: error: {e:#}");
            if origin_args::is_certificate_failure(&e) {
                eprintln!("{}", origin_args::CERTIFICATE_HINT);
            }
            ExitCode::from(if usage { 2 } else { 1 })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::leaks_wire_bytes;
    use tracing::Level;

    #[test]
    fn wire_level_events_of_http_and_tls_crates_are_dropped() {
        assert!(leaks_wire_bytes("ureq_proto::util", Level::TRACE));
        assert!(leaks_wire_bytes("ureq::unversioned::transport", Level::DEBUG));
        assert!(leaks_wire_bytes("rustls::client::hs", Level::TRACE));
        assert!(!leaks_wire_bytes("ureq", Level::WARN));
        assert!(!leaks_wire_bytes("ureq_protocol_like", Level::TRACE));
        assert!(!leaks_wire_bytes("tessera_registry::client", Level::TRACE));
    }
}
