//! `tessera serve`: serve an image to a VMM over vhost-user-blk until SIGTERM / SIGINT.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::FromRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use tessera_engine::metrics::watch_mem_tier;
use tessera_engine::{
    FetchLimits, MemTier, WarmOptions, DEFAULT_LOCAL_FETCH_JOBS, DEFAULT_REMOTE_FETCH_JOBS,
};
use tessera_image::Profile;
use tessera_image::{ImageId, RequestTraceHeader, Sha256Digest, BLOCK_SIZE};
use tessera_metrics::{Exporter, Metrics, Tier};
use tessera_overlay::{FileAccess as OverlayFileAccess, Mode as OverlayMode, Overlay, OverlayParams};
use tessera_store::{
    CacheConfig, CacheTrust, ChunkSource, ImageReader, LocalStore, Metered, OpenImage, OriginOptions,
    StoreError, StoreLocation,
};
use tessera_vhost::{DeviceConfig, Disk, RequestRecorder, Server, DEFAULT_SOCKET_MODE, MAX_QUEUES};

use crate::watch::{describe_image, watch_overlay, watch_store};

use crate::trace::TraceSession;
use crate::UsageError;

/// Serve an image to a VMM as a vhost-user-blk device.
#[derive(Debug, Args)]
#[command(after_help = "The socket appears at PATH only once it accepts connections (mode 0600 unless \
--socket-mode says otherwise). One VMM at a time; when it disconnects (guest reboot, VMM restart) the \
daemon keeps listening and serves the next one. SIGTERM or SIGINT: finish in-flight requests, remove the \
socket, exit 0.\n\
\n\
Writes go to a copy-on-write overlay (the image itself is never modified): with --overlay FILE \
they persist across restarts (FILE is created if missing; an overlay made for another image is \
refused) and every write completed before a FLUSH survives a crash or power loss; without it the \
overlay is an unlinked temporary file in --cache-dir (else $TMPDIR), gone with the process. DISCARD and WRITE_ZEROES \
make the range read as zeros. `tessera export IMAGE --overlay FILE` writes base plus overlay. \
--read-only refuses writes (VIRTIO_BLK_F_RO); with --overlay it serves base plus overlay.\n\
\n\
Stores: a local directory is read directly. An http(s):// store (any static server or CDN holding \
the store layout) is read with Range GETs, and so is a docker://HOST[:PORT]/REPO store (a registry \
repository an image was pushed to with `tessera push`; credentials from REGISTRY_AUTH_FILE or \
~/.docker/config.json), and so is an s3://BUCKET[/PREFIX] store (every request signed with AWS \
Signature V4; credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_SESSION_TOKEN or the \
shared credentials file, re-read when it changes; --s3-endpoint URL for S3-compatible servers); \
with --cache-dir DIR the chunks, blobs and image entries \
go through the host disk cache (shared by every image and daemon on the host), so a warmed cache \
serves with the origin down; without it chunks are kept in memory only.\n\
\n\
Reads are served from the memory tier (decoded, verified chunks; --mem-cache bytes, default 256M); \
a read needing chunks not in memory completes out of order once they are fetched, so it never \
stalls the other requests of its queue. Up to --fetch-jobs chunks are fetched at once, each once \
however many reads want it; guest reads go first, then readahead of the next chunks of a file \
being read sequentially (--readahead), then the image's prefetch profile if it has one (capped \
by --prefetch-rate; --no-prefetch turns it off). Every chunk is checked against its blake3 id \
whatever tier it comes from; one that fails is dropped and fetched again from the origin (up to 5 \
copies), and if the last fails too the read fails with an I/O error (VIRTIO_BLK_S_IOERR) — never wrong bytes.\n\
\n\
--metrics ADDR serves Prometheus text at http://ADDR/metrics from its own thread: requests, bytes \
and latency by type, chunk reads per tier, fetches, memory tier and overlay sizes (every metric is \
described in docs/metrics.md). Port 0 picks a free port; the URL is printed on stderr (and on \
--ready-fd). RUST_LOG=tessera_vhost=debug logs a span per request (type, sector, length, queue).\n\
\n\
Under systemd: with LISTEN_PID/LISTEN_FDS (a .socket unit with one ListenStream=PATH), serve \
listens on the socket passed as fd 3 instead of binding --socket (which names it) and leaves it \
in place on stop, so a restarted daemon comes back on the same socket; with NOTIFY_SOCKET \
(Type=notify) it sends READY=1 once it accepts. Unit templates: docs/systemd/.\n\
\n\
Examples:\n  tessera serve web --store ./store --socket /run/web.sock --read-only\n  \
tessera serve web --store ./store --socket /run/web.sock --overlay /var/lib/vm1/web.overlay\n  \
tessera serve sha256:3f1c... --store ./store --socket /tmp/vm.sock --queues 2 --socket-mode 0660\n  \
tessera serve web --store ./store --socket /tmp/vm.sock --ready-fd 3 3>ready.txt\n  \
tessera serve web --store https://cdn.example/tessera --cache-dir /var/cache/tessera --socket /run/web.sock\n  \
tessera serve web --store docker://registry.example.com/team/images --cache-dir /var/cache/tessera --socket /run/web.sock\n  \
tessera serve web --store ./store --socket /tmp/vm.sock --read-only --record-trace boot1.trace\n  \
tessera serve web --store ./store --socket /tmp/vm.sock --read-only --record-requests boot1.requests\n  \
tessera serve web --store ./store --socket /tmp/vm.sock --metrics 127.0.0.1:9100 &\n  \
curl -s http://127.0.0.1:9100/metrics | grep tessera_requests_total")]
pub struct ServeArgs {
    /// The image: sha256:<64 hex>, a tag, or (registry stores) @sha256:<source image manifest
    /// digest> for the `--reference-layers` image pushed beside its source.
    image: String,
    /// The store holding it: PATH, file://PATH, http(s)://HOST[:PORT][/PREFIX] (read-only),
    /// docker://HOST[:PORT]/REPO (a registry) or s3://BUCKET[/PREFIX].
    #[arg(long, value_parser = crate::parse_store)]
    store: StoreLocation,
    // --cache-dir DIR, --cache-size SIZE (the temporary overlay also goes into DIR).
    #[command(flatten)]
    cache: crate::cache_args::CacheArgs,
    #[command(flatten)]
    origin: crate::origin_args::OriginArgs,
    /// With --cache-dir and IMAGE a tag: trust the cache's lookup of the tag if it was made at
    /// most DURATION ago (each lookup from the origin, by `serve` or `tessera warm`, renews it)
    /// and start without asking the origin: a warmed host then starts as fast as from a local
    /// store. A tag moved within the window is noticed only after it, as with a cached HTTP
    /// answer's max-age. 0 (the default) asks the origin at every start. DURATION: 0, or numbers
    /// with units s, m, h, d (90s, 10m, 1h30m).
    #[arg(long, value_name = "DURATION", value_parser = crate::store_cmd::parse_duration, default_value = "0")]
    tag_max_age: std::time::Duration,
    /// The vhost-user socket to create.
    #[arg(long)]
    socket: PathBuf,
    /// Refuse writes (VIRTIO_BLK_F_RO).
    #[arg(long)]
    read_only: bool,
    /// Keep the guest's writes in this overlay file (created if missing) across restarts.
    /// Default: a temporary overlay in --cache-dir (else $TMPDIR), gone with the process.
    #[arg(long, value_name = "FILE")]
    overlay: Option<PathBuf>,
    /// Memory tier: bytes of decoded chunks kept in memory (e.g. 512M, 2G; 0 keeps none). An
    /// image built with --reference-layers, served from a remote store without --cache-dir,
    /// gives half of it to the layer spans it fetched, kept compressed so that no span crosses
    /// the link twice.
    #[arg(long, value_name = "SIZE", default_value = "256M", value_parser = crate::parse_size_arg)]
    mem_cache: u64,
    /// Put the memory tier's chunks of 64 KiB to 2 MiB in 2 MiB mappings advised for
    /// transparent huge pages (a warm 1 MiB read then copies with few TLB misses; measured in
    /// docs/benchmarks.md). `false` keeps them on the heap's ordinary pages. Effective when
    /// /sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`.
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    mem_huge_pages: bool,
    /// With --overlay: keep this many bytes of the overlay file past its last used block
    /// written with zeros and synced, ahead of the writes, so a FLUSH's writes overwrite
    /// allocated blocks instead of growing the file (which costs a file-system journal commit
    /// per FLUSH). The file is up to SIZE larger than its content. 0 turns it off.
    #[arg(long, value_name = "SIZE", default_value = "16M", value_parser = crate::parse_size_arg)]
    overlay_prepare: u64,
    /// Test and operations knob, hidden: with --overlay, compact the log while serving once it
    /// holds N records since the last checkpoint (and four times what a checkpoint of the map
    /// would write). Default 65536 (4 MiB of log). The reliability tests set it low to kill the
    /// daemon in the middle of online compactions (docs/reliability.md).
    #[arg(long, value_name = "N", default_value_t = tessera_overlay::COMPACT_MIN_RECORDS, hide = true)]
    overlay_compact_after: u64,
    /// Test knob, hidden: with --overlay, hold the overlay's writes in memory until a FLUSH's
    /// sync covers them (some reach the file early, some torn), so that a kill -9 loses what a
    /// power loss could: the reliability matrix kills the daemon through it (docs/reliability.md).
    #[arg(long, hide = true)]
    overlay_lose_unsynced: bool,
    /// Concurrent chunk fetches (threads): the chunks of reads missing memory are fetched in
    /// parallel, each once however many reads wait for it. Default: 4 for a local store, 64 for
    /// a remote one (enough to hide the origin's round trip for a queue full of cold reads).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024))]
    fetch_jobs: Option<u16>,
    /// Connections to open to an http(s):// or s3:// origin at its first request, alongside it
    /// (TCP connects and TLS handshakes, no request), so the start's parallel fetches and the
    /// first misses find them open instead of paying a connect round trip (and TLS handshake)
    /// each. Those no request took within 10 s are closed. 0 opens none. Default 40: a start
    /// fetches the image's record and pack index in parallel pieces of 96 KiB
    /// (`TESSERA_HTTP_BLOB_PIECE`) and its metadata prefix in pieces of 40 KiB (decompressed
    /// as they arrive), about 37 requests at once for an image of 18 000 chunks, each best on a
    /// connection of its own (docs/benchmarks.md, "Parallel pieces").
    #[arg(long, value_name = "N", default_value_t = 40, value_parser = clap::value_parser!(u16).range(0..=64))]
    preconnect: u16,
    /// Sequential reads within a file fetch up to this many bytes of the file's next chunks
    /// ahead, in the background (0 turns readahead off).
    #[arg(long, value_name = "SIZE", default_value = "2M", value_parser = crate::parse_size_arg)]
    readahead: u64,
    /// A read missing memory also fetches, in the background, up to this many stored bytes of
    /// the chunks stored after the missed ones in their pack, whatever files they belong to, for
    /// a miss no readahead or profile had queued already (the builder packs in tree order: what it laid out together is read together). Remote
    /// stores only; 0 turns it off. The default, 128K, took a cold `find /usr -type f -exec
    /// stat {} +` from 17 serial round trips to 14 for 1.34x the bytes it needs (256K: 10, 1.7x).
    #[arg(long, value_name = "SIZE", default_value = "128K", value_parser = crate::parse_size_arg)]
    pack_readahead: u64,
    /// Fetch a file of at most 64 MiB whole, in the background, once N of its reads missed
    /// memory and went to the origin (nothing had foreseen them; a file of at most
    /// --whole-file-first goes at its first): programs read their binary and libraries page
    /// fault by page fault, at random and most of the way, a round trip each. Remote stores
    /// only; 0 turns it off. The default, 3, took a cold gcc compile from 74
    /// serial round trips to 33 (2.9 to 2.0 s at 20 ms and 200 Mbit/s) for 1 % more bytes.
    #[arg(long, value_name = "N", default_value_t = 3)]
    whole_file_after: u32,
    /// Fetch a file of at most SIZE whole, in the background, at its first read that misses
    /// memory and goes to the origin, without waiting for --whole-file-after misses: a program's
    /// first read is its exec, a reader's the first of a file it reads through, and the rest of
    /// either would be a round trip per page fault or readahead step. Larger files keep the
    /// --whole-file-after rule (a read of one page of a big file does not fetch it all).
    /// Remote stores only; 0 turns it off. The default, 16M, took cold starts at 20 ms and 200
    /// Mbit/s 3–5 % shorter (python 1 374 to 1 302 ms, gcc 1 604 to 1 559, a shell script 879
    /// to 835) for at most 0.5 % more bytes (docs/benchmarks.md).
    #[arg(long, value_name = "SIZE", default_value = "16M", value_parser = crate::parse_size_arg)]
    whole_file_first: u64,
    /// Fetch a program (an executable regular file) larger than --whole-file-first whole, in the
    /// background, when a read of its first chunk misses memory and goes to the origin: an exec
    /// reads a program's header first, then most of it page fault by page fault, a round trip
    /// each, which --whole-file-after would pay twice before fetching it all. Up to 64 MiB and a
    /// quarter of --mem-cache; a large file that is not executable keeps the other rules. Remote
    /// stores only. On, it took a cold gcc compile (cc1, 32 MiB) at 20 ms and 200 Mbit/s from
    /// 1 565 to 1 525 ms for the same bytes (docs/benchmarks.md).
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    programs_whole: bool,
    /// Fetch the shared libraries a program or library needs (its ELF DT_NEEDED entries, looked
    /// up in the image's library directories) whole, in the background, as soon as its dynamic
    /// section is in memory after a miss: the dynamic loader opens them one after another, each
    /// first read a round trip of its own, which this turns into one. Remote stores only.
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    elf_deps: bool,
    /// Fetch a stretch of a pack (--stretch-size stored bytes, aligned) whole, in the
    /// background, once reads of N distinct files stored in it missed memory and went to the
    /// origin: the builder packs in tree order, so a stretch holds neighbouring files of one
    /// directory, and a program start reading many of them one after another (an interpreter's
    /// modules) pays a round trip for each that no pack window foresaw. Remote stores only; 0
    /// turns it off.
    /// The default, 3 of 512K, took a cold python start (imports of json, sqlite3, decimal,
    /// email.parser, asyncio) at 20 ms and 200 Mbit/s from 34 serial round trips to 30 (1.92 to
    /// 1.83 s) for 6 % more bytes.
    #[arg(long, value_name = "N", default_value_t = 3)]
    stretch_after: u32,
    /// The size of the stretches --stretch-after fetches, in stored bytes.
    #[arg(long, value_name = "SIZE", default_value = "512K", value_parser = crate::parse_size_arg)]
    stretch_size: u64,
    /// Also fetch a stretch whole once reads of two of its files missed within N stretch misses
    /// of each other (0: only --stretch-after): a program's start reads a directory's modules one
    /// after another, where a reader of random files comes back to a stretch now and then. The
    /// default, 10, took a cold python start at 20 ms and 200 Mbit/s from 1.50 to 1.41 s (3.14
    /// to 2.96x its floor) for 1.48x the bytes it needs instead of 1.43x; a reader of random
    /// whole files is unchanged.
    #[arg(long, value_name = "N", default_value_t = 10)]
    stretch_within: u32,
    /// Bandwidth cap for background fetches (readahead and profile prefetch), in stored bytes
    /// per second (e.g. 20M). Default: no cap. Demand fetches are never capped and always go
    /// first; background fetches use at most half of --fetch-jobs.
    #[arg(long, value_name = "SIZE", value_parser = crate::parse_size_arg)]
    prefetch_rate: Option<u64>,
    /// Do not prefetch the chunks of the image's prefetch profile. With it (the default), a
    /// remote start (without --cache-dir, or with one that holds no chunk yet) also fetches the
    /// profile's first 2 MiB of chunks, which the tag's ref names, while it fetches the image's
    /// metadata, instead of once the image is open (profiled starts at 20 ms: 22–28 ms shorter
    /// at 200 Mbit/s, stat 211 to 169 ms at 1 Gbit/s; docs/store.md).
    #[arg(long)]
    no_prefetch: bool,
    /// With --cache-dir: fetch the whole image into the disk cache in the background, as
    /// `tessera warm` would (runs of up to 1 MiB stored, --fill-jobs at a time), starting
    /// --fill-after the first VM connects. A guest that keeps reading what nothing foresaw (a
    /// reader of many whole files pays a round trip for each) then finds more and more of it on
    /// this host. The fill shares the link with the guest's own misses, hence the delay: a boot
    /// is not slowed by it. At 20 ms and 1 Gbit/s, with the default delay, a whole-file reader
    /// went from 15.7 to 12.2 s and a python start was untouched (docs/warming.md). Progress:
    /// the tessera_disk_cache_fill_* metrics. Skipped, with a warning, when the image's stored
    /// bytes exceed --cache-size.
    #[arg(long)]
    fill_cache: bool,
    /// Requests of --fill-cache in flight at once.
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=64))]
    fill_jobs: u16,
    /// How long after the first VM connects --fill-cache starts: 0, or numbers with units s, m,
    /// h (e.g. 3s, 1m).
    #[arg(long, value_name = "DURATION", value_parser = crate::store_cmd::parse_duration, default_value = "3s")]
    fill_after: std::time::Duration,
    /// At most this many stored bytes per second for --fill-cache (e.g. 20M), so that a fill
    /// leaves room on a link other VMs or hosts share (up to a second's worth at once, then
    /// paced). Default: no cap (--fill-jobs bounds it).
    #[arg(long, value_name = "SIZE", value_parser = crate::warm::parse_rate)]
    fill_rate: Option<u64>,
    /// Number of virtqueues offered, each served by its own thread (1 to 64).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=i64::from(MAX_QUEUES)))]
    queues: u16,
    /// Where the daemon's threads run: `queues=LIST` pins the queue workers (and the vhost-user
    /// protocol thread), `fetch=LIST` the chunk fetcher's threads (with the origin requests they
    /// make), the trace writer and the metrics exporter; LIST is CPU numbers and ranges, e.g.
    /// `--cpus queues=2-3,fetch=0-1`. Either part may be left out (its threads keep the CPUs the
    /// daemon was started with).
    #[arg(long, value_name = "queues=LIST[,fetch=LIST]", value_parser = parse_cpus)]
    cpus: Option<CpuPlacement>,
    /// After draining its ring, a queue worker keeps polling the ring and its finished fetches
    /// for up to N microseconds before it sleeps: a request arriving meanwhile costs no kick and
    /// no wake-up. The window adapts, as QEMU's iothreads do (it opens while requests arrive
    /// within it and closes when the queue goes idle), so an idle daemon burns no CPU beyond
    /// one window. Pays most with the queues on CPUs of their own (--cpus); 0 never polls.
    #[arg(long, value_name = "N", default_value_t = tessera_vhost::poll::DEFAULT_POLL_US)]
    poll_us: u64,
    /// Permissions of the socket, in octal (default 0600).
    #[arg(long, value_parser = parse_mode)]
    socket_mode: Option<u32>,
    /// Once the socket accepts, write "ready <socket>\n" to this inherited file descriptor and
    /// close it (with --metrics, then also "metrics <url>\n").
    #[arg(long)]
    ready_fd: Option<i32>,
    /// Serve Prometheus metrics at http://ADDR/metrics, ADDR being HOST:PORT (e.g.
    /// 127.0.0.1:9100; port 0 picks a free one).
    #[arg(long, value_name = "ADDR", value_parser = parse_metrics_addr)]
    metrics: Option<String>,
    /// Write the chunks the guest touches, in first-touch order with the time since its first
    /// read, to FILE (created or truncated; flushed every second and on exit). Feed it to
    /// `tessera profile`.
    #[arg(long, value_name = "FILE")]
    record_trace: Option<PathBuf>,
    /// Record every virtio request (queue, type, sector, length, issue and completion times,
    /// status) to FILE (created or truncated; docs/formats/requests.md), for `cargo xtask
    /// replay`. The record count is written on exit: a daemon killed with SIGKILL leaves a
    /// trace the decoder refuses.
    #[arg(long, value_name = "FILE")]
    record_requests: Option<PathBuf>,
}

/// HOST:PORT (a name, an IPv4 address or a bracketed IPv6 address, and a port number).
fn parse_metrics_addr(s: &str) -> Result<String, String> {
    match s.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(s.to_owned()),
        _ => Err(format!("{s}: expected HOST:PORT, e.g. 127.0.0.1:9100")),
    }
}

/// `--cpus queues=LIST[,fetch=LIST]`: the CPUs each group of the daemon's threads may run on
/// (`None`: the CPUs it was started with).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CpuPlacement {
    /// The queue workers and the vhost-user protocol thread.
    pub queues: Option<Vec<usize>>,
    /// The chunk fetcher's threads (and the origin span threads they spawn), the trace writer,
    /// the metrics exporter.
    pub fetch: Option<Vec<usize>>,
}

/// `queues=2-3,fetch=0,1`: a key starts a list; items without `=` continue the current one.
fn parse_cpus(s: &str) -> Result<CpuPlacement, String> {
    let mut p = CpuPlacement::default();
    let mut current: Option<&str> = None;
    let err =
        |m: String| format!("--cpus {s}: {m} (expected queues=LIST[,fetch=LIST], e.g. queues=2-3,fetch=0-1)");
    for tok in s.split(',') {
        let item = match tok.split_once('=') {
            Some((key @ ("queues" | "fetch"), v)) => {
                let slot = if key == "queues" { &mut p.queues } else { &mut p.fetch };
                if slot.replace(Vec::new()).is_some() {
                    return Err(err(format!("{key}= given twice")));
                }
                current = Some(key);
                v
            }
            Some((key, _)) => return Err(err(format!("unknown key {key}"))),
            None => tok,
        };
        let list = match current {
            Some("queues") => p.queues.as_mut(),
            _ => p.fetch.as_mut(),
        }
        .ok_or_else(|| err("a CPU list must follow queues= or fetch=".into()))?;
        let cpu = |t: &str| t.trim().parse::<usize>().map_err(|_| err(format!("{t:?} is not a CPU number")));
        let (a, b) = match item.split_once('-') {
            Some((a, b)) => (cpu(a)?, cpu(b)?),
            None => (cpu(item)?, cpu(item)?),
        };
        if a > b || b >= rustix::thread::CpuSet::MAX_CPU {
            return Err(err(format!("{item}: not a CPU range below {}", rustix::thread::CpuSet::MAX_CPU)));
        }
        list.extend(a..=b);
    }
    Ok(p)
}

/// Restrict the calling thread to `cpus`; the threads it spawns from now on inherit the set.
fn pin_this_thread(cpus: &[usize], what: &str) -> Result<()> {
    let mut set = rustix::thread::CpuSet::new();
    cpus.iter().for_each(|&c| set.set(c));
    rustix::thread::sched_setaffinity(None, &set).with_context(|| format!("--cpus {what}={cpus:?}"))
}

fn parse_mode(s: &str) -> Result<u32, String> {
    let digits = s.strip_prefix("0o").unwrap_or(s);
    match u32::from_str_radix(digits, 8) {
        Ok(m) if m <= 0o777 => Ok(m),
        _ => Err(format!("{s}: expected an octal mode from 0 to 0777, e.g. 0600")),
    }
}

/// Where the guest's writes go: `--read-only` and `--overlay FILE` combined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Writes {
    /// `--read-only`: writes refused, the base image served as is.
    Refused,
    /// `--read-only --overlay FILE`: writes refused, base plus the overlay's blocks served.
    RefusedOverOverlay(PathBuf),
    /// `--overlay FILE`: writes kept in FILE (created if missing) across restarts.
    Persistent(PathBuf),
    /// Neither: writes kept in an unlinked temporary overlay in this directory (--cache-dir,
    /// else $TMPDIR), gone with the process.
    Temporary(PathBuf),
}

impl Writes {
    /// Whether the device refuses writes (VIRTIO_BLK_F_RO).
    pub fn read_only(&self) -> bool {
        matches!(self, Writes::Refused | Writes::RefusedOverOverlay(_))
    }
}

/// `tessera serve`, validated once from [`ServeArgs`]: every choice the flags make, with the
/// defaults that depend on other flags (fetch jobs by store kind, the temporary overlay's
/// directory) resolved. [`run`] only wires it up.
#[derive(Debug)]
pub struct ServeConfig {
    /// The image: sha256:<64 hex> or a tag.
    pub image: String,
    pub store: StoreLocation,
    /// The origin settings (HTTP client, from the environment) for a remote store.
    pub origin: OriginOptions,
    /// The host disk cache, for a remote store.
    pub cache: Option<CacheConfig>,
    pub socket: PathBuf,
    /// Permissions of the socket.
    pub socket_mode: u32,
    /// `--ready-fd`, already owned (checked open and not stdin, stdout or stderr).
    pub ready: Option<File>,
    pub writes: Writes,
    pub queues: u16,
    /// `--cpus`: where the queue workers and the fetcher threads run.
    pub cpus: CpuPlacement,
    /// `--poll-us`: the longest a queue worker polls after draining its ring.
    pub poll: Duration,
    /// Bytes of decoded chunks kept in memory.
    pub mem_cache: u64,
    /// `--mem-huge-pages`.
    pub mem_huge_pages: bool,
    /// `--overlay-prepare`: bytes of zero-filled overlay slots kept ahead of the writes.
    pub overlay_prepare: u64,
    /// `--overlay-compact-after`: log records that make the group commit compact the log.
    pub overlay_compact_after: u64,
    /// `--overlay-lose-unsynced`: the overlay file through the power-loss double.
    pub overlay_lose_unsynced: bool,
    /// Concurrent chunk fetches.
    pub fetch_jobs: usize,
    /// `--preconnect`.
    pub preconnect: usize,
    /// Bandwidth cap of background fetches, stored bytes per second (`None`: no cap).
    pub prefetch_rate: Option<u64>,
    /// Readahead within a file, bytes (0: off).
    pub readahead: u64,
    /// Pack-order readahead window (stored bytes; 0: off; remote stores only).
    pub pack_readahead: u64,
    /// `--whole-file-after`: origin misses of a file that make it fetched whole (0: off).
    pub whole_file_after: u32,
    /// `--whole-file-first`: files up to this size are fetched whole at their first miss (0: off).
    pub whole_file_first: u64,
    /// `--programs-whole`.
    pub programs_whole: bool,
    /// `--elf-deps`.
    pub elf_deps: bool,
    /// Dense-stretch readahead: files missed, and the stretch size (remote stores only).
    pub stretch_after: u32,
    pub stretch_size: u64,
    pub stretch_within: u32,
    /// Prefetch the image's profile, if it has one.
    pub prefetch: bool,
    /// `--fill-cache`: requests in flight of the background fill (`None`: no fill).
    pub fill_jobs: Option<usize>,
    /// `--fill-after`: from the first connection to the fill's start.
    pub fill_after: Duration,
    /// `--fill-rate`: the fill's cap in stored bytes per second.
    pub fill_rate: Option<u64>,
    /// `--metrics HOST:PORT`.
    pub metrics: Option<String>,
    pub record_trace: Option<PathBuf>,
    /// `--record-requests FILE`.
    pub record_requests: Option<PathBuf>,
}

impl ServeConfig {
    /// Validate the arguments. The ready fd is taken first, so a bad one fails before anything
    /// else happens; nothing is opened or created otherwise.
    pub fn from_args(args: ServeArgs) -> Result<Self> {
        if let Some(fd) = args.ready_fd {
            if fd < 3 {
                bail!(UsageError(format!(
                    "--ready-fd {fd}: use a descriptor other than stdin, stdout or stderr"
                )));
            }
        }
        let ready = args.ready_fd.map(take_fd).transpose()?;
        let writes = match (args.overlay, args.read_only) {
            (None, true) => Writes::Refused,
            (Some(path), true) => Writes::RefusedOverOverlay(path),
            (Some(path), false) => Writes::Persistent(path),
            (None, false) => {
                Writes::Temporary(args.cache.cache_dir.clone().unwrap_or_else(std::env::temp_dir))
            }
        };
        if args.fill_cache {
            if args.store.local_path().is_some() {
                bail!(UsageError(
                    "--fill-cache: a local store is read directly and needs no cache; it fills the --cache-dir of an http(s)://, docker:// or s3:// store".into()
                ));
            }
            if args.cache.cache_dir.is_none() {
                bail!(UsageError("--fill-cache needs --cache-dir DIR: the cache to fill".into()));
            }
        } else if args.fill_rate.is_some() {
            bail!(UsageError("--fill-rate paces --fill-cache, which is not given".into()));
        }
        let default_jobs = if args.store.local_path().is_some() {
            DEFAULT_LOCAL_FETCH_JOBS
        } else {
            DEFAULT_REMOTE_FETCH_JOBS
        };
        Ok(Self {
            image: args.image,
            // A warmed cache starts an image named by ID without the origin (the tag lookup is
            // the only thing that needs it).
            origin: OriginOptions {
                trust: CacheTrust { entries: true, tag_max_age: args.tag_max_age },
                ..args.origin.options()?
            },
            cache: args.cache.config(),
            store: args.store,
            socket: args.socket,
            socket_mode: args.socket_mode.unwrap_or(DEFAULT_SOCKET_MODE),
            ready,
            writes,
            queues: args.queues,
            cpus: args.cpus.unwrap_or_default(),
            poll: Duration::from_micros(args.poll_us),
            mem_cache: args.mem_cache,
            mem_huge_pages: args.mem_huge_pages,
            overlay_prepare: args.overlay_prepare,
            overlay_compact_after: args.overlay_compact_after,
            overlay_lose_unsynced: args.overlay_lose_unsynced,
            fetch_jobs: args.fetch_jobs.map_or(default_jobs, usize::from),
            preconnect: usize::from(args.preconnect),
            prefetch_rate: args.prefetch_rate.filter(|&r| r > 0),
            readahead: args.readahead,
            pack_readahead: args.pack_readahead,
            whole_file_after: args.whole_file_after,
            whole_file_first: args.whole_file_first,
            programs_whole: args.programs_whole,
            elf_deps: args.elf_deps,
            stretch_after: args.stretch_after,
            stretch_size: args.stretch_size,
            stretch_within: args.stretch_within,
            prefetch: !args.no_prefetch,
            fill_jobs: args.fill_cache.then_some(usize::from(args.fill_jobs)),
            fill_after: args.fill_after,
            fill_rate: args.fill_rate,
            metrics: args.metrics,
            record_trace: args.record_trace,
            record_requests: args.record_requests,
        })
    }
}

pub fn serve(args: ServeArgs) -> Result<()> {
    // Socket activation: the supervisor's listening socket (fd 3), taken before anything else
    // can open a descriptor.
    let listener = crate::activation::take_listener()?;
    crate::malloc::limit_arenas();
    if listener.is_some() && args.ready_fd == Some(3) {
        bail!(UsageError(
            "--ready-fd 3 is the socket systemd passed (LISTEN_FDS); use another descriptor".into()
        ));
    }
    run_on(ServeConfig::from_args(args)?, listener)
}

/// Serve `config` until SIGTERM / SIGINT, on `listener` (socket activation: the socket at `--socket` is the supervisor's,
/// already listening, and stays when the daemon stops) or, without one, on a socket it binds.
pub fn run_on(config: ServeConfig, listener: Option<std::os::unix::net::UnixListener>) -> Result<()> {
    // --cpus: a thread inherits its creator's CPU set, so this thread takes the fetch CPUs while
    // the store, the engine (its fetcher threads, which spawn the origin's span threads), the
    // trace writer and the exporter start, then the queue CPUs before the server spawns the
    // protocol thread and the queue workers (per connection, from this thread).
    let started_on = rustix::thread::sched_getaffinity(None).context("sched_getaffinity")?;
    if let Some(cpus) = &config.cpus.fetch {
        pin_this_thread(cpus, "fetch")?;
    }
    let location = &config.store;
    // `--preconnect`: an HTTP origin's connections are opened at its first request (the tag),
    // alongside it (docs/daemon.md, "Lifecycle").
    let mut origin = config.origin.clone();
    origin.http.preconnect = config.preconnect;
    // The profile's chunks a tag's ref names come during the start, not after it (docs/store.md,
    // "Requests"): without a disk cache, or into one that holds no chunk yet (a fresh host; one
    // that holds some may hold these already, and the fetch would be waste).
    origin.http.stage_profile = config.prefetch && config.cache.as_ref().is_none_or(|c| !c.holds_chunks());
    let opened = location.open_read_store(&origin, config.cache.as_ref())?;
    let store = Arc::clone(&opened.store);
    let describe = || format!("store {}", store.describe());
    // A tag a warmed disk cache has looked up before is opened from the cache while the origin
    // confirms it (its answer is the only request a warmed start makes): the lookup's round trip
    // overlaps the image's opening instead of preceding it. A tag that moved is opened again.
    // (Only cached stores guess; a local store's image is pinned before it is opened.)
    let (id, early) = match store.guess_resolve(&config.image) {
        Some(guess) => std::thread::scope(|s| {
            let resolved = s.spawn(|| store.resolve(&config.image));
            let early = store.open_image_with(&guess, config.prefetch);
            let id = resolved.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            let id = id.with_context(describe)?;
            if id == guess {
                return anyhow::Ok((id, Some(early)));
            }
            tracing::info!(tag = %config.image, cached = %guess, now = %id, "the tag moved: opening the image it names now");
            Ok((id, None))
        })?,
        None => (store.resolve_to_open(&config.image).with_context(describe)?, None),
    };
    // `tessera store gc` keeps a served image of a local store (docs/store.md, "Pins"); the image
    // is opened after pinning, so a gc that removed it first fails the start clearly.
    let _pin = opened.local.as_ref().and_then(|local| {
        local.pin(&id).map_err(|e| tracing::info!(error = %crate::error_text(e), "image not pinned")).ok()
    });
    let (image, profile) = early.unwrap_or_else(|| store.open_image_with(&id, config.prefetch));
    let image = Arc::new(image.with_context(describe)?);
    let metrics = Metrics::new();
    describe_image(&metrics, &image);
    let mut source: Arc<dyn ChunkSource> = store.chunk_source(&image);
    // Count the chunk reads of the tier below memory. A remote store's chunk source is its
    // disk cache and origin together: those count themselves (docs/metrics.md).
    if location.local_path().is_some() {
        source = Arc::new(Metered::new(source, Tier::Local, &metrics));
    } else if config.cache.is_none() {
        source = Arc::new(Metered::new(source, Tier::Origin, &metrics));
    }
    let trace = config.record_trace.as_deref().map(|p| TraceSession::start(p, id, &image.record().block_map));
    let trace = trace.transpose()?;
    let limits = FetchLimits {
        background_bytes_per_sec: config.prefetch_rate,
        ..FetchLimits::for_store(location.local_path().is_none(), Some(config.fetch_jobs))
    };
    // A reference image read from a remote origin with no disk cache keeps the spans it fetched
    // in memory, compressed, so that none crosses the link twice, in half the memory budget (a
    // stored span is about a third of its decoded bytes and holds its neighbours too; the
    // whole-file workload of `bench lazy`: 0.89x the converted image's time with the spans kept
    // besides the whole budget, 1.01x with half of it, 1.21x with a quarter, 1.79x with none);
    // a local store or a disk cache reads a span again cheaply.
    let stored_spans = match image.reference() {
        Some(_) if location.local_path().is_none() && config.cache.is_none() => config.mem_cache / 2,
        _ => 0,
    };
    let reader = ImageReader::new(Arc::clone(&image), source)
        .with_stored_spans(usize::try_from(stored_spans).unwrap_or(usize::MAX));
    let mut tier = MemTier::new(reader, config.mem_cache - stored_spans, limits)?
        .with_readahead(config.readahead)
        .with_huge_pages(config.mem_huge_pages);
    if location.local_path().is_none() {
        tier = tier
            .with_pack_readahead(config.pack_readahead)
            .with_whole_files(config.whole_file_after, tessera_engine::WHOLE_FILE_MAX_BYTES)
            .with_whole_files_at_first(config.whole_file_first.min(tessera_engine::WHOLE_FILE_MAX_BYTES))
            .with_programs_whole(if config.programs_whole { tessera_engine::WHOLE_FILE_MAX_BYTES } else { 0 })
            .with_elf_deps(config.elf_deps, tessera_engine::WHOLE_FILE_MAX_BYTES)
            .with_dense_stretches(config.stretch_after, config.stretch_size, config.stretch_within);
    }
    if let Some(t) = &trace {
        tier = tier.with_trace(t.recorder());
    }
    if let Some((digest, bytes)) = profile {
        start_prefetch(digest, bytes, &image, &tier);
    }
    let reader = Arc::new(tier);
    let fill = config.fill_jobs.zip(opened.cache.clone()).map(|(jobs, cache)| {
        let gauges =
            (metrics.disk_cache.fill_target_bytes.clone(), metrics.disk_cache.fill_done_bytes.clone());
        (jobs, cache, gauges)
    });
    watch_mem_tier(&metrics, &reader);
    watch_store(&metrics, &opened);
    let device = DeviceConfig::new(&id, reader.device_bytes(), config.queues, config.writes.read_only());
    let params = OverlayParams { image_id: id, block_size: BLOCK_SIZE, device_bytes: reader.device_bytes() };
    let disk = match &config.writes {
        Writes::Refused => Disk::Base(reader),
        Writes::RefusedOverOverlay(path) => {
            Disk::Overlay(Arc::new(Overlay::open_file(path, params, reader, OverlayMode::ReadOnly)?))
        }
        Writes::Persistent(path) => {
            let access = if config.overlay_lose_unsynced {
                let seed = std::time::UNIX_EPOCH.elapsed().map_or(1, |d| d.as_nanos() as u64);
                tracing::warn!(seed, "the overlay runs through the power-loss double: for tests only");
                OverlayFileAccess::LoseUnsynced { seed }
            } else {
                OverlayFileAccess::Direct
            };
            let overlay = Overlay::open_or_create_file_through(path, params, reader, access)?;
            let overlay =
                overlay.prepare_ahead(config.overlay_prepare).compact_after(config.overlay_compact_after);
            Disk::Overlay(Arc::new(overlay))
        }
        Writes::Temporary(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            let overlay = Overlay::temporary(dir, params, reader)?;
            tracing::info!(dir = %dir.display(), "writes go to a temporary overlay");
            Disk::Overlay(Arc::new(overlay))
        }
    };
    if let Disk::Overlay(o) = &disk {
        watch_overlay(&metrics, o);
    }
    let requests = match &config.record_requests {
        Some(path) => {
            let header = RequestTraceHeader {
                image: id,
                device_bytes: device.capacity_bytes,
                queues: device.queues,
                read_only: device.read_only,
            };
            tracing::info!(path = %path.display(), "recording requests");
            Some(RequestRecorder::create(path, header)?)
        }
        None => None,
    };
    let exporter = config.metrics.as_deref().map(|a| Exporter::start(a, Arc::clone(&metrics))).transpose()?;
    if let Some(e) = &exporter {
        eprintln!("metrics: {}", e.url());
    }

    // Signals are handled on their own thread from before the socket exists on, so a SIGTERM
    // right after readiness still removes the socket.
    let mut signals = Signals::new([SIGTERM, SIGINT]).context("installing signal handlers")?;
    match &config.cpus.queues {
        Some(cpus) => pin_this_thread(cpus, "queues")?,
        None if config.cpus.fetch.is_some() => {
            rustix::thread::sched_setaffinity(None, &started_on).context("restoring the CPU set")?
        }
        None => {}
    }
    let server = match listener {
        Some(l) => Server::from_listener(l, &config.socket, device, disk),
        None => Server::bind(&config.socket, config.socket_mode, device, disk),
    }
    .with_context(|| format!("serving {id}"))?
    .with_metrics(metrics)
    .with_poll(config.poll);
    let server = match &requests {
        Some(r) => server.with_recorder(Arc::clone(r)),
        None => server,
    };
    let stop = server.stop_handle();
    let handle = signals.handle();
    let signal_thread = std::thread::spawn(move || {
        if let Some(sig) = signals.forever().next() {
            tracing::info!(signal = sig, "stopping");
            stop.stop();
        }
    });
    if let Some((jobs, cache, gauges)) = fill {
        start_fill(&config, &image, cache, jobs, server.connection_counter(), gauges)?;
    }
    if let Some(mut f) = config.ready {
        writeln!(f, "ready {}", config.socket.display()).context("writing to --ready-fd")?;
        if let Some(e) = &exporter {
            writeln!(f, "metrics {}", e.url()).context("writing to --ready-fd")?;
        }
    }
    crate::activation::notify_ready()?;
    let result = server.run();
    handle.close();
    let _ = signal_thread.join();
    drop(exporter);
    let traced = trace.map(TraceSession::finish).transpose();
    let recorded = requests.map(|r| r.finish()).transpose();
    if let Ok(Some(n)) = &recorded {
        tracing::info!(requests = n, "request trace written");
    }
    result.with_context(|| format!("serving {id}"))?;
    traced?;
    recorded?;
    Ok(())
}

/// `--fill-cache`: the whole image into the disk cache `cache` in the background, `--fill-after`
/// the first of the server's `connections` — unless it does not fit the cache's bound.
fn start_fill(
    config: &ServeConfig,
    image: &OpenImage,
    cache: tessera_store::DiskCache,
    jobs: usize,
    connections: Arc<std::sync::atomic::AtomicU64>,
    gauges: (tessera_metrics::IntGauge, tessera_metrics::IntGauge),
) -> Result<()> {
    let chunks = u32::try_from(image.record().block_map.chunks().len()).unwrap_or(u32::MAX);
    let stored: u64 = (0..chunks)
        .filter_map(|i| image.chunk_location(i))
        .map(|(_, _, loc)| u64::from(loc.stored_len))
        .sum();
    if let Some(max) = config.cache.as_ref().and_then(|c| c.max_bytes).filter(|&max| stored > max) {
        tracing::warn!(
            "--fill-cache skipped: the image's chunks ({}) exceed --cache-size ({}); filling would evict what the guest reads",
            indicatif::HumanBytes(stored),
            indicatif::HumanBytes(max)
        );
        return Ok(());
    }
    let after = config.fill_after;
    let start = move || {
        while connections.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(after);
    };
    crate::warm::fill_in_background(
        config.store.clone(),
        config.origin.clone(),
        cache,
        *image.id(),
        WarmOptions { profile_only: false, jobs, rate: config.fill_rate },
        start,
        gauges,
    )
}

/// Queue the chunks of the image's prefetch profile, if the entry names one, for background
/// fetching. A profile that cannot be read or does not fit the image is logged and ignored: it
/// only ever makes things faster.
fn start_prefetch<S: ChunkSource + 'static>(
    digest: Sha256Digest,
    bytes: Result<Vec<u8>, StoreError>,
    image: &OpenImage,
    tier: &MemTier<S>,
) {
    if image.entry().profile != Some(digest) {
        return;
    }
    let profile = bytes
        .map_err(crate::error_text)
        .and_then(|bytes| Profile::decode(&bytes).map_err(crate::error_text))
        .and_then(|p| {
            p.check_against(*image.id(), &image.record().block_map).map_err(crate::error_text)?;
            Ok(p)
        });
    match profile {
        Ok(p) => {
            let queued = tier.prefetch(p.entries().iter().map(|e| e.chunk));
            tracing::info!(profile = %digest, chunks = p.entries().len(), queued, "prefetching the profile");
        }
        Err(e) => tracing::warn!(profile = %digest, error = %e, "ignoring the prefetch profile"),
    }
}

/// `tessera export --overlay FILE`: write the overlay's blocks over an exported base image at
/// `output` (written blocks copied, zeroed ranges punched) and sync it. The overlay is opened
/// read-only (shared lock: refused while a daemon writes to it).
pub fn apply_overlay(store: &LocalStore, id: &ImageId, overlay: &Path, output: &Path) -> Result<()> {
    let reader = Arc::new(ImageReader::new(OpenImage::open(store, id)?, store.clone()));
    let params = OverlayParams { image_id: *id, block_size: BLOCK_SIZE, device_bytes: reader.device_bytes() };
    let overlay = Overlay::open_file(overlay, params, reader, OverlayMode::ReadOnly)?;
    let file = OpenOptions::new()
        .write(true)
        .open(output)
        .with_context(|| format!("opening {}", output.display()))?;
    let copied =
        overlay.apply_to(&file).with_context(|| format!("applying the overlay to {}", output.display()))?;
    file.sync_all().with_context(|| format!("syncing {}", output.display()))?;
    tracing::info!(copied, stats = ?overlay.stats(), "applied the overlay");
    Ok(())
}

/// Own an inherited descriptor named on the command line.
fn take_fd(fd: i32) -> Result<File> {
    // SAFETY: F_GETFD only inspects the descriptor table; it fails with EBADF for a closed fd.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        bail!(UsageError(format!("--ready-fd {fd}: {}", std::io::Error::last_os_error())));
    }
    // SAFETY: the descriptor is open (checked above) and was handed to us by the caller for this
    // purpose; nothing else in the process uses or closes it, so the File may own it.
    Ok(unsafe { File::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn config(extra: &[&str]) -> Result<ServeConfig> {
        let args = ["tessera", "img", "--socket", "/tmp/vm.sock"].iter().chain(extra);
        ServeConfig::from_args(Cli::try_parse_from(args)?.serve)
    }

    #[test]
    fn writes_follow_read_only_and_overlay() {
        let c = config(&["--store", "./s", "--read-only"]).unwrap();
        assert_eq!(c.writes, Writes::Refused);
        assert!(c.writes.read_only());
        let c = config(&["--store", "./s", "--read-only", "--overlay", "/o"]).unwrap();
        assert_eq!(c.writes, Writes::RefusedOverOverlay("/o".into()));
        assert!(c.writes.read_only());
        let c = config(&["--store", "./s", "--overlay", "/o"]).unwrap();
        assert_eq!(c.writes, Writes::Persistent("/o".into()));
        assert!(!c.writes.read_only());
        let c = config(&["--store", "./s", "--cache-dir", "/c"]).unwrap();
        assert_eq!(c.writes, Writes::Temporary("/c".into()));
        let c = config(&["--store", "./s"]).unwrap();
        assert_eq!(c.writes, Writes::Temporary(std::env::temp_dir()));
    }

    #[test]
    fn defaults_resolved_once() {
        let local = config(&["--store", "./s"]).unwrap();
        assert_eq!(local.fetch_jobs, DEFAULT_LOCAL_FETCH_JOBS);
        assert_eq!(local.socket_mode, DEFAULT_SOCKET_MODE);
        assert_eq!((local.mem_cache, local.readahead, local.queues), (256 << 20, 2 << 20, 1));
        assert!(local.prefetch && local.prefetch_rate.is_none() && local.cache.is_none());
        let remote = config(&["--store", "http://h/s", "--prefetch-rate", "0", "--no-prefetch"]).unwrap();
        assert_eq!(remote.fetch_jobs, DEFAULT_REMOTE_FETCH_JOBS);
        assert!(!remote.prefetch && remote.prefetch_rate.is_none(), "a rate of 0 is no cap");
        let c = config(&["--store", "docker://h/r", "--fetch-jobs", "7", "--prefetch-rate", "1M"]).unwrap();
        assert_eq!((c.fetch_jobs, c.prefetch_rate), (7, Some(1 << 20)));
        let c = config(&["--store", "./s", "--socket-mode", "0660", "--metrics", "127.0.0.1:0"]).unwrap();
        assert_eq!((c.socket_mode, c.metrics.as_deref()), (0o660, Some("127.0.0.1:0")));
    }

    #[test]
    fn cpus_lists_and_ranges() {
        let c = config(&["--store", "./s", "--cpus", "queues=2-3,5,fetch=0,1"]).unwrap();
        assert_eq!(c.cpus.queues, Some(vec![2, 3, 5]));
        assert_eq!(c.cpus.fetch, Some(vec![0, 1]));
        let c = config(&["--store", "./s", "--cpus", "fetch=7"]).unwrap();
        assert_eq!(c.cpus, CpuPlacement { queues: None, fetch: Some(vec![7]) });
        assert_eq!(config(&["--store", "./s"]).unwrap().cpus, CpuPlacement::default());
        for bad in ["0,1", "queues=", "queues=3-1", "queues=1,queues=2", "cpu=1", "queues=x", "fetch=99999"] {
            let e = config(&["--store", "./s", "--cpus", bad]).unwrap_err();
            assert!(e.to_string().contains("--cpus"), "{bad}: {e:#}");
        }
    }

    #[test]
    fn a_standard_stream_as_ready_fd_is_a_usage_error() {
        for fd in ["0", "1", "2"] {
            let e = config(&["--store", "./s", "--ready-fd", fd]).unwrap_err();
            assert!(e.chain().any(|c| c.is::<UsageError>()), "{e:#}");
            assert!(e.to_string().contains("other than stdin, stdout or stderr"), "{e:#}");
        }
    }
}
