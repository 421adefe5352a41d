//! Helpers shared by the CLI's black-box tests: run the `tessera` binary cargo built for them.
#![allow(dead_code, clippy::unwrap_used)]

use std::process::{Command, Output};

pub const TESSERA: &str = env!("CARGO_BIN_EXE_tessera");

/// Run `tessera ARGS`, assert it succeeds and return its stdout.
pub fn tessera(args: &[&str]) -> String {
    let out = run(args);
    assert!(out.status.success(), "tessera {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// `tessera build SRC --store STORE --tag img --size 32M`: the serve tests' image.
pub fn build_img(src: &std::path::Path, store: &std::path::Path) {
    tessera(&[
        "build",
        src.to_str().unwrap(),
        "--store",
        store.to_str().unwrap(),
        "--tag",
        "img",
        "--size",
        "32M",
    ]);
}

/// Run `tessera ARGS` and return what it did, whatever its exit status.
pub fn run(args: &[&str]) -> Output {
    Command::new(TESSERA).args(args).output().unwrap()
}

/// Run `tessera ARGS` expecting exit status `code`; return its stderr.
pub fn fails(args: &[&str], code: i32) -> String {
    let out = run(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(code), "tessera {args:?}: {stderr}");
    assert!(
        out.stdout.is_empty(),
        "tessera {args:?} printed on stdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    stderr
}

/// `n` pseudo-random (xorshift64) bytes, the same for the same `seed`: data that does not
/// compress or dedup.
pub fn noise(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
