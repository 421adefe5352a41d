//! `tessera serve --metrics 127.0.0.1:0` as a black box: a libblkio client does a known set of
//! reads, writes, flushes, discards and write-zeroes; /metrics, scraped over real HTTP, reports
//! exactly those counts and byte totals, and its text passes a strict exposition-format check
//! and the Prometheus project's own parser (python3-prometheus-client).
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

mod blk;
mod common;

use blk::Client;
use common::TESSERA;

/// Debian's interpreter, where python3-prometheus-client installs (not a pyenv shim on PATH).
const PYTHON: &str = "/usr/bin/python3";

/// A running `tessera serve` and the metrics URL it announced on `--ready-fd`.
struct Daemon {
    child: Child,
    metrics_addr: String,
}

impl Daemon {
    fn start(store: &Path, socket: &Path) -> Daemon {
        let mut fds = [0i32; 2];
        // SAFETY: pipe(2) fills two descriptors; without O_CLOEXEC the child inherits the
        // write end as fd `fds[1]`.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors were just created and are owned by nothing else.
        let (rx, tx) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let child = Command::new(TESSERA)
            .args(["serve", "img", "--store", store.to_str().unwrap(), "--socket", socket.to_str().unwrap()])
            .arg("--overlay")
            .arg(store.with_file_name("vm.overlay"))
            .args(["--metrics", "127.0.0.1:0", "--ready-fd", &fds[1].to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        drop(tx);
        // Blocks until the daemon writes its two lines (or exits: EOF).
        let lines: Vec<String> =
            BufReader::new(fs::File::from(rx)).lines().take(2).map(|l| l.unwrap()).collect();
        assert_eq!(lines.len(), 2, "ready lines: {lines:?}");
        assert_eq!(lines[0], format!("ready {}", socket.display()));
        let url = lines[1].strip_prefix("metrics http://").unwrap();
        let metrics_addr = url.strip_suffix("/metrics").unwrap().to_owned();
        assert!(!metrics_addr.ends_with(":0"), "the bound port is announced: {metrics_addr}");
        Daemon { child, metrics_addr }
    }

    /// GET /metrics over HTTP/1.1: the status line and the body.
    fn scrape(&self) -> String {
        let mut s = TcpStream::connect(&self.metrics_addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        write!(s, "GET /metrics HTTP/1.1\r\nHost: {}\r\n\r\n", self.metrics_addr).unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        let (head, body) = resp.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert!(head.contains("Content-Type: text/plain; version=0.0.4"), "{head}");
        body.to_owned()
    }

    fn terminate(&mut self) {
        // SAFETY: kill(2) on our own child's pid; it has not been reaped yet.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) }, 0);
        let status = self.child.wait().unwrap();
        assert!(status.success(), "{status}");
    }
}

impl Drop for Daemon {
    /// A failed test leaves no daemon behind.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A sample's labels but `le`, in order: one histogram series.
type Labels = Vec<(String, String)>;

/// One sample line: its metric name, its labels, its value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// A strict reading of the text exposition format (0.0.4) as Tessera writes it: `# HELP` and
/// `# TYPE` lines before each family's samples, one `# TYPE` per family, names and label names
/// in `[a-zA-Z_:][a-zA-Z0-9_:]*`, quoted label values with only `\\`, `\"` and `\n` escapes,
/// a float value, no timestamps; histogram buckets cumulative and ending in `+Inf` equal to
/// `_count`. Panics on the first violation.
fn parse_exposition(text: &str) -> (BTreeMap<String, String>, Vec<Sample>) {
    fn is_name(s: &str) -> bool {
        let mut c = s.chars();
        c.next().is_some_and(|f| f.is_ascii_alphabetic() || f == '_' || f == ':')
            && c.all(|ch| ch.is_ascii_alphanumeric() || ch == '_' || ch == ':')
    }
    assert!(text.ends_with('\n'), "the exposition ends with a newline");
    let mut types: BTreeMap<String, String> = BTreeMap::new();
    let mut helped = std::collections::BTreeSet::new();
    let mut samples = Vec::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        assert!(!line.is_empty(), "empty line");
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, _) = rest.split_once(' ').unwrap_or((rest, ""));
            assert!(is_name(name) && helped.insert(name.to_owned()), "HELP line: {line}");
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, ty) = rest.split_once(' ').unwrap();
            assert!(is_name(name), "{line}");
            assert!(["counter", "gauge", "histogram", "summary", "untyped"].contains(&ty), "{line}");
            assert!(types.insert(name.to_owned(), ty.to_owned()).is_none(), "TYPE twice: {line}");
            current = Some(name.to_owned());
            continue;
        }
        assert!(!line.starts_with('#'), "unknown comment: {line}");
        let (series, value) = line.rsplit_once(' ').unwrap();
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("value in {line}")),
        };
        let (name, labels) = match series.split_once('{') {
            None => (series, BTreeMap::new()),
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').unwrap_or_else(|| panic!("labels in {line}"));
                let mut labels = BTreeMap::new();
                let mut chars = body.chars().peekable();
                while chars.peek().is_some() {
                    let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
                    assert!(is_name(&key), "label name in {line}");
                    assert_eq!(chars.next(), Some('"'), "quoted label value in {line}");
                    let mut val = String::new();
                    loop {
                        match chars.next().unwrap_or_else(|| panic!("unterminated value in {line}")) {
                            '"' => break,
                            '\\' => match chars.next() {
                                Some('\\') => val.push('\\'),
                                Some('"') => val.push('"'),
                                Some('n') => val.push('\n'),
                                other => panic!("escape {other:?} in {line}"),
                            },
                            c => val.push(c),
                        }
                    }
                    assert!(labels.insert(key, val).is_none(), "label twice in {line}");
                    match chars.next() {
                        None => break,
                        Some(',') => {}
                        other => panic!("{other:?} after a label in {line}"),
                    }
                }
                (name, labels)
            }
        };
        assert!(is_name(name), "{line}");
        let family = current.as_deref().unwrap_or_else(|| panic!("sample before any TYPE: {line}"));
        let ok_name = match types[family].as_str() {
            "histogram" => {
                [family.to_owned() + "_bucket", family.to_owned() + "_sum", family.to_owned() + "_count"]
                    .contains(&name.to_owned())
            }
            _ => name == family,
        };
        assert!(ok_name, "sample {name} under family {family}");
        samples.push(Sample { name: name.to_owned(), labels, value });
    }
    assert_eq!(types.keys().collect::<Vec<_>>(), helped.iter().collect::<Vec<_>>(), "HELP for every family");
    // Histograms: cumulative buckets ending in +Inf == _count.
    for (family, ty) in &types {
        if ty != "histogram" {
            continue;
        }
        let mut series: BTreeMap<Labels, Vec<(f64, f64)>> = BTreeMap::new();
        for s in samples.iter().filter(|s| s.name == format!("{family}_bucket")) {
            let le = s.labels.get("le").unwrap_or_else(|| panic!("bucket without le: {s:?}"));
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap() };
            let key =
                s.labels.iter().filter(|(k, _)| *k != "le").map(|(k, v)| (k.clone(), v.clone())).collect();
            series.entry(key).or_default().push((le, s.value));
        }
        assert!(!series.is_empty(), "{family} has no buckets");
        for (key, buckets) in series {
            assert!(buckets.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1), "{family} {key:?}");
            let (last_le, last) = *buckets.last().unwrap();
            assert_eq!(last_le, f64::INFINITY, "{family} {key:?} ends in +Inf");
            let count = samples
                .iter()
                .find(|s| {
                    s.name == format!("{family}_count")
                        && s.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect::<Vec<_>>() == key
                })
                .unwrap_or_else(|| panic!("{family} {key:?} has no _count"));
            assert_eq!(count.value, last, "{family} {key:?}: +Inf bucket == _count");
        }
    }
    (types, samples)
}

/// The value of the one sample `name` whose labels include `labels`.
fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    let found: Vec<&Sample> = samples
        .iter()
        .filter(|s| {
            s.name == name && labels.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .collect();
    assert_eq!(found.len(), 1, "{name} {labels:?}: {found:?}");
    found[0].value
}

/// The Prometheus project's own parser must read the text too.
fn prometheus_client_parses(text: &str) -> usize {
    let script = "import sys\n\
from prometheus_client.parser import text_string_to_metric_families as parse\n\
families = list(parse(sys.stdin.read()))\n\
print(len(families))\n";
    let mut child = Command::new(PYTHON)
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{PYTHON}: {e} (cargo xtask test installs python3-prometheus-client)"));
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "prometheus_client rejected the exposition (is python3-prometheus-client installed?): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

#[test]
fn metrics_count_exactly_what_the_client_did() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    fs::create_dir_all(&src).unwrap();
    // 3 MiB of incompressible-ish data: several 512 KiB chunks to miss the memory tier.
    let data = common::noise(1, 3 << 20);
    fs::write(src.join("big"), &data).unwrap();
    fs::write(src.join("small"), b"hello").unwrap();
    let store = dir.path().join("store");
    common::build_img(&src, &store);
    let socket = dir.path().join("vm.sock");
    let mut d = Daemon::start(&store, &socket);

    // Before any client: every family is there, the device is described, nothing counted.
    let (_, before) = parse_exposition(&d.scrape());
    assert_eq!(value(&before, "tessera_device_bytes", &[]), (32u64 << 20) as f64);
    assert!(value(&before, "tessera_image_chunk_bytes", &[]) >= data.len() as f64);
    assert_eq!(value(&before, "tessera_requests_total", &[("type", "read"), ("status", "ok")]), 0.0);

    let mut c = Client::connect(&socket);
    // Reads: the whole device in 1 MiB pieces (every chunk of the image: memory-tier misses
    // fetched from the local store), then 4 KiB and 64 KiB reads again (memory-tier hits), one
    // read past the end (refused: I/O error).
    let mut reads = 0u64;
    let mut read_bytes = 0u64;
    for i in 0..32u64 {
        assert_eq!(c.read(i << 20, 1 << 20), 0);
        reads += 1;
        read_bytes += 1 << 20;
    }
    for (off, len) in [(0u64, 4096usize), (8192, 4096), (1 << 20, 65536), (5 << 20, 65536), (31 << 20, 4096)]
    {
        assert_eq!(c.read(off, len), 0);
        reads += 1;
        read_bytes += len as u64;
    }
    assert_ne!(c.read(32 << 20, 4096), 0, "a read past the end fails");
    // Writes in distinct blocks: four of 4 KiB, one of 64 KiB, two of 512 bytes (each merged
    // into its own block).
    let writes: [(u64, usize); 7] = [
        (16 << 20, 4096),
        (16 << 20 | 8192, 4096),
        (17 << 20, 4096),
        (18 << 20, 4096),
        (19 << 20, 65536),
        (20 << 20, 512),
        (21 << 20 | 1024, 512),
    ];
    for (off, len) in writes {
        assert_eq!(c.write(off, &vec![0x5a; len]), 0);
    }
    let write_bytes: u64 = writes.iter().map(|w| w.1 as u64).sum();
    let written_blocks = 4 + 16 + 2;
    assert_eq!(c.flush(), 0);
    // DISCARD 8 KiB and WRITE_ZEROES 12 KiB elsewhere, then a second flush.
    assert_eq!(c.discard(24 << 20, 8192), 0);
    assert_eq!(c.write_zeroes(25 << 20, 12288), 0);
    assert_eq!(c.flush(), 0);

    let text = d.scrape();
    let (types, s) = parse_exposition(&text);
    let req =
        |ty: &str, status: &str| value(&s, "tessera_requests_total", &[("type", ty), ("status", status)]);
    let bytes = |ty: &str| value(&s, "tessera_request_bytes_total", &[("type", ty)]);
    let timed = |ty: &str| value(&s, "tessera_request_duration_seconds_count", &[("type", ty)]);
    assert_eq!(req("read", "ok"), reads as f64);
    assert_eq!(req("read", "ioerr"), 1.0);
    assert_eq!(bytes("read"), read_bytes as f64, "failed reads move no bytes");
    assert_eq!(timed("read"), reads as f64 + 1.0);
    assert_eq!(req("write", "ok"), writes.len() as f64);
    assert_eq!(bytes("write"), write_bytes as f64);
    assert_eq!(timed("write"), writes.len() as f64);
    assert_eq!(req("flush", "ok"), 2.0);
    assert_eq!(req("discard", "ok"), 1.0);
    assert_eq!(bytes("discard"), 8192.0);
    assert_eq!(req("write_zeroes", "ok"), 1.0);
    assert_eq!(bytes("write_zeroes"), 12288.0);
    for ty in ["get_id", "unsupported", "invalid"] {
        for status in ["ok", "ioerr", "unsupp", "dropped"] {
            assert_eq!(req(ty, status), 0.0, "{ty} {status}");
        }
    }
    assert_eq!(value(&s, "tessera_requests_in_flight", &[]), 0.0);
    assert_eq!(value(&s, "tessera_connections_total", &[]), 1.0);

    // Tiers: every chunk was fetched once from the local store into memory (the budget holds
    // them all); every fetch came through a memory-tier miss; the repeated reads hit memory.
    let chunks = value(&s, "tessera_image_chunks", &[]);
    let local_hits = value(&s, "tessera_tier_hits_total", &[("tier", "local")]);
    assert!(chunks >= 6.0, "3 MiB in 512 KiB chunks: {chunks}");
    assert_eq!(local_hits, chunks, "each chunk read from the store once");
    assert_eq!(value(&s, "tessera_memory_tier_fills_total", &[]), chunks);
    assert_eq!(value(&s, "tessera_tier_read_duration_seconds_count", &[("tier", "local")]), chunks);
    assert_eq!(value(&s, "tessera_tier_errors_total", &[("tier", "local")]), 0.0);
    assert!(value(&s, "tessera_tier_misses_total", &[("tier", "memory")]) >= chunks);
    assert!(value(&s, "tessera_tier_hits_total", &[("tier", "memory")]) >= 2.0);
    assert_eq!(value(&s, "tessera_memory_tier_chunks", &[]), chunks);
    assert_eq!(value(&s, "tessera_memory_tier_bytes", &[]), value(&s, "tessera_image_chunk_bytes", &[]));
    assert_eq!(value(&s, "tessera_memory_tier_capacity_bytes", &[]), (256u64 << 20) as f64);
    // Reads that missed memory went through the fetch pool, and nothing is left queued.
    assert!(value(&s, "tessera_deferred_reads_total", &[]) >= 1.0);
    assert_eq!(value(&s, "tessera_fetch_queue_depth", &[]), 0.0);
    assert_eq!(
        value(&s, "tessera_chunk_fetches_total", &[("priority", "demand")])
            + value(&s, "tessera_chunk_fetches_total", &[("priority", "background")]),
        chunks,
        "one fetch per chunk"
    );

    // The overlay: the written blocks, the zeroed ones, one sync per flush that had work.
    assert_eq!(value(&s, "tessera_overlay_written_blocks", &[]), written_blocks as f64);
    assert_eq!(value(&s, "tessera_overlay_zero_blocks", &[]), 5.0);
    assert_eq!(value(&s, "tessera_overlay_syncs_total", &[]), 2.0);
    assert!(value(&s, "tessera_overlay_file_bytes", &[]) >= (written_blocks * 4096) as f64);

    // The Prometheus project's parser reads every family.
    assert_eq!(prometheus_client_parses(&text), types.len());
    drop(c);
    d.terminate();
}

#[test]
fn bad_metrics_addresses() {
    let stderr = common::fails(
        &["serve", "img", "--store", "/nonexistent", "--socket", "/tmp/x.sock", "--metrics", "9100"],
        2,
    );
    assert!(stderr.contains("expected HOST:PORT"), "{stderr}");
}
