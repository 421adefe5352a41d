#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use super::*;

/// The value of the sample line `series` (name plus labels, exactly as rendered).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn every_family_is_rendered_with_help_and_type() {
    let m = Metrics::new();
    let text = m.render();
    for family in [
        "tessera_requests_total",
        "tessera_request_bytes_total",
        "tessera_request_duration_seconds",
        "tessera_requests_in_flight",
        "tessera_early_signals_total",
        "tessera_early_signal_pauses_total",
        "tessera_deferred_reads_total",
        "tessera_fetch_queue_depth",
        "tessera_fetch_threads",
        "tessera_device_bytes",
        "tessera_overlay_written_blocks",
        "tessera_tier_hits_total",
        "tessera_tier_read_duration_seconds",
        "tessera_memory_tier_bytes",
        "tessera_disk_cache_evictions_total",
        "tessera_origin_retries_total",
        "tessera_origin_late_resends_total",
        "tessera_prefetch_wasted_bytes_total",
    ] {
        assert!(text.contains(&format!("# HELP {family} ")), "{family} has no HELP");
        assert!(text.contains(&format!("# TYPE {family} ")), "{family} has no TYPE");
    }
    // Pre-resolved label sets are all present, at zero.
    assert_eq!(sample(&text, r#"tessera_requests_total{status="dropped",type="invalid"}"#), Some(0.0));
    assert_eq!(sample(&text, r#"tessera_tier_hits_total{tier="disk_cache"}"#), Some(0.0));
}

#[test]
fn request_records_count_bytes_and_latency() {
    let m = Metrics::new();
    let read = m.requests.of(RequestType::Read);
    read.record(RequestStatus::Ok, 4096, Duration::from_micros(7));
    read.record(RequestStatus::Ok, 8192, Duration::from_micros(30));
    read.record(RequestStatus::IoErr, 4096, Duration::from_micros(3));
    m.requests.of(RequestType::Unsupported).record(RequestStatus::Unsupp, 0, Duration::ZERO);
    assert_eq!(read.count(RequestStatus::Ok), 2);
    assert_eq!(read.bytes(), 12288, "failed requests move no bytes");
    let text = m.render();
    assert_eq!(sample(&text, r#"tessera_requests_total{status="ok",type="read"}"#), Some(2.0));
    assert_eq!(sample(&text, r#"tessera_requests_total{status="ioerr",type="read"}"#), Some(1.0));
    assert_eq!(sample(&text, r#"tessera_requests_total{status="unsupp",type="unsupported"}"#), Some(1.0));
    assert_eq!(sample(&text, r#"tessera_request_bytes_total{type="read"}"#), Some(12288.0));
    assert_eq!(sample(&text, r#"tessera_request_duration_seconds_count{type="read"}"#), Some(3.0));
    // 3 µs and 7 µs fall in the 10 µs bucket, 30 µs does not; +Inf holds all.
    assert_eq!(
        sample(&text, r#"tessera_request_duration_seconds_bucket{type="read",le="0.00001"}"#),
        Some(2.0)
    );
    assert_eq!(sample(&text, r#"tessera_request_duration_seconds_bucket{type="read",le="+Inf"}"#), Some(3.0));
}

#[test]
fn scrape_callbacks_mirror_outside_counters() {
    let m = Metrics::new();
    let outside = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(5));
    {
        let m2 = std::sync::Arc::clone(&m);
        let outside = std::sync::Arc::clone(&outside);
        m.on_scrape(move || {
            mirror(&m2.tiers.of(Tier::Memory).hits, outside.load(std::sync::atomic::Ordering::Relaxed));
        });
    }
    assert_eq!(sample(&m.render(), r#"tessera_tier_hits_total{tier="memory"}"#), Some(5.0));
    outside.store(9, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(sample(&m.render(), r#"tessera_tier_hits_total{tier="memory"}"#), Some(9.0));
    // A counter never goes down.
    outside.store(1, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(sample(&m.render(), r#"tessera_tier_hits_total{tier="memory"}"#), Some(9.0));
}

fn http(addr: std::net::SocketAddr, request: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn exporter_serves_metrics_over_http() {
    let m = Metrics::new();
    m.origin.requests.inc();
    m.origin.bytes.inc_by(1000);
    let latency = crate::origin_latency_histogram();
    latency.observe(0.02);
    m.adopt_origin_latency(latency);
    m.origin.retries.inc();
    let exporter = Exporter::start("127.0.0.1:0", std::sync::Arc::clone(&m)).unwrap();
    let addr = exporter.local_addr();
    assert_ne!(addr.port(), 0);
    assert_eq!(exporter.url(), format!("http://{addr}/metrics"));

    let resp = http(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    assert!(head.contains(&format!("Content-Type: {CONTENT_TYPE}")), "{head}");
    assert!(head.contains(&format!("Content-Length: {}", body.len())), "{head}");
    assert_eq!(sample(body, "tessera_origin_bytes_total"), Some(1000.0));
    assert_eq!(sample(body, "tessera_origin_retries_total"), Some(1.0));
    assert_eq!(sample(body, "tessera_origin_request_duration_seconds_count"), Some(1.0));

    // The head arriving in pieces, a query string, HEAD, other paths and methods, garbage.
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metrics?x=1 HT").unwrap();
    std::thread::sleep(Duration::from_millis(20));
    s.write_all(b"TP/1.0\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200 OK") && out.contains("tessera_origin_bytes_total 1000"), "{out}");
    let head = http(addr, "HEAD /metrics HTTP/1.1\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 200 OK") && head.ends_with("\r\n\r\n"), "{head}");
    assert!(http(addr, "GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404 "));
    assert!(http(addr, "POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405 "));
    assert!(http(addr, "\x01\x02 nonsense\r\n\r\n").starts_with("HTTP/1.1 400 "));
    // A client that connects and leaves does not stop the endpoint.
    drop(TcpStream::connect(addr).unwrap());
    assert!(http(addr, "GET /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 200 OK"));

    drop(exporter);
    assert!(TcpStream::connect(addr).is_err(), "the endpoint stops when dropped");
}

#[test]
fn bad_addresses_are_errors() {
    assert!(matches!(Exporter::start("nonsense", Metrics::new()), Err(ExporterError::Bind { .. })));
    let taken = Exporter::start("127.0.0.1:0", Metrics::new()).unwrap();
    let again = Exporter::start(&taken.local_addr().to_string(), Metrics::new());
    assert!(matches!(again, Err(ExporterError::Bind { .. })), "{again:?}");
}

#[test]
fn exporter_errors_keep_their_cause_once() {
    use std::error::Error as _;
    let e = ExporterError::Thread(std::io::Error::other("no threads left"));
    assert_eq!(e.to_string(), "starting the metrics thread", "the cause is not in the message");
    assert_eq!(e.source().map(|c| c.to_string()).as_deref(), Some("no threads left"));
    let e = Exporter::start("nonsense", Metrics::new()).unwrap_err();
    assert!(e.source().is_some() && !e.to_string().contains(&e.source().unwrap().to_string()), "{e}");
}
