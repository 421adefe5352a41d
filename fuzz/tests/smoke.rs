//! Runs every fuzz target's body on its seeds, on stable Rust, in the gate (`cargo xtask test`
//! runs it with the workspace's unit tests; alone: `cargo test -p tessera-fuzz`). Also replays anything found in
//! `corpus/` and `artifacts/` (e.g. after a fuzzing run) when `TESSERA_FUZZ_CORPUS=1`.
#![allow(clippy::unwrap_used)]

use std::path::Path;

fn run(target: &str, data: &[u8]) {
    match target {
        "vhost_request" => tessera_fuzz::vhost_request::run(data),
        "image_record" => tessera_fuzz::image_record::run(data),
        "overlay_replay" => tessera_fuzz::overlay_replay::run(data),
        "oci_layers" => tessera_fuzz::oci_layers::run(data),
        "content_manifest" => tessera_fuzz::content_manifest::run(data),
        "source_index" => tessera_fuzz::source_index::run(data),
        "gzip_index" => tessera_fuzz::gzip_index::run(data),
        "pack_index" => tessera_fuzz::pack_index::run(data),
        "cache_index" => tessera_fuzz::cache_index::run(data),
        "profile" => tessera_fuzz::profile::run(data),
        "boot_trace" => tessera_fuzz::boot_trace::run(data),
        "request_trace" => tessera_fuzz::request_trace::run(data),
        "ext4_roundtrip" => tessera_fuzz::ext4_roundtrip::run(data),
        "byteranges" => tessera_fuzz::byteranges::run(data),
        "elf_deps" => tessera_fuzz::elf_deps::run(data),
        "ext4_scan" => tessera_fuzz::ext4_scan::run(data),
        _ => unreachable!(),
    }
}

fn seeds(target: &str) {
    let seeds = tessera_fuzz::seeds::for_target(target);
    assert!(!seeds.is_empty());
    for (name, bytes) in &seeds {
        eprintln!("{target}: seed {name} ({} bytes)", bytes.len());
        run(target, bytes);
        // Every prefix of a seed is an input too (the tolerant format reads zeros past the end).
        for cut in [0, 1, bytes.len() / 3, bytes.len() / 2, bytes.len().saturating_sub(1)] {
            run(target, &bytes[..cut]);
        }
    }
    if std::env::var_os("TESSERA_FUZZ_CORPUS").is_some() {
        let base = Path::new(env!("CARGO_MANIFEST_DIR"));
        for dir in [base.join("corpus").join(target), base.join("artifacts").join(target)] {
            let Ok(entries) = std::fs::read_dir(&dir) else { continue };
            for e in entries {
                let path = e.unwrap().path();
                eprintln!("{target}: {}", path.display());
                run(target, &std::fs::read(&path).unwrap());
            }
        }
    }
}

#[test]
fn vhost_request_seeds() {
    seeds("vhost_request");
}

#[test]
fn image_record_seeds() {
    seeds("image_record");
}

#[test]
fn overlay_replay_seeds() {
    seeds("overlay_replay");
}

#[test]
fn oci_layers_seeds() {
    seeds("oci_layers");
}

/// Cheap pseudo-random inputs (xorshift), mutated from the seeds: a stand-in for the fuzzer
/// where libFuzzer cannot run (it hit the findings of docs/fuzzing.md before they were fixed).
#[test]
fn mutated_seeds() {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for target in tessera_fuzz::seeds::TARGETS {
        for (_, seed) in tessera_fuzz::seeds::for_target(target) {
            for _ in 0..20 {
                let mut b = seed.clone();
                for _ in 0..1 + next() % 4 {
                    if b.is_empty() {
                        break;
                    }
                    let i = (next() % b.len() as u64) as usize;
                    b[i] ^= 1 << (next() % 8);
                }
                run(target, &b);
            }
        }
    }
}

#[test]
fn source_index_seeds() {
    seeds("source_index");
}

#[test]
fn content_manifest_seeds() {
    seeds("content_manifest");
}

#[test]
fn gzip_index_seeds() {
    seeds("gzip_index");
}

#[test]
fn pack_index_seeds() {
    seeds("pack_index");
}

#[test]
fn cache_index_seeds() {
    seeds("cache_index");
}

#[test]
fn profile_seeds() {
    seeds("profile");
}

#[test]
fn boot_trace_seeds() {
    seeds("boot_trace");
}

#[test]
fn request_trace_seeds() {
    seeds("request_trace");
}

#[test]
fn ext4_roundtrip_seeds() {
    seeds("ext4_roundtrip");
}

#[test]
fn byteranges_seeds() {
    seeds("byteranges");
}

#[test]
fn elf_deps_seeds() {
    seeds("elf_deps");
}

#[test]
fn ext4_scan_seeds() {
    seeds("ext4_scan");
}

#[test]
fn byteranges_seeds_are_what_they_say() {
    use tessera_store::byteranges::{boundary, parse};
    for (name, bytes) in tessera_fuzz::seeds::for_target("byteranges") {
        let nl = bytes.iter().position(|&b| b == b'\n').unwrap();
        let b = boundary(std::str::from_utf8(&bytes[..nl]).unwrap()).unwrap();
        assert_eq!(parse(&bytes[nl + 1..], b).is_ok(), name != "no end", "seed {name}");
    }
}
