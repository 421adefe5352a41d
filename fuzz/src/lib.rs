//! Fuzz target bodies for Tessera's hostile-input parsers (see `docs/fuzzing.md`).
//!
//! Each target is a plain function `run(&[u8])` so that the libFuzzer binaries in
//! `fuzz_targets/` and the stable-Rust smoke test (`tests/smoke.rs`) run the same code. Inputs
//! are structure-aware: a small, tolerant, little-endian format (missing bytes read as zero)
//! that the seed generator ([`seeds`]) can also *write*, so the corpus starts from real,
//! valid requests, records and overlay files and the fuzzer corrupts them a little at a time.
//! Every property violated is a panic (what libFuzzer reports).
#![allow(clippy::unwrap_used)]

pub mod boot_trace;
pub mod byteranges;
pub mod cache_index;
pub mod content_manifest;
pub mod elf_deps;
pub mod ext4_roundtrip;
pub mod ext4_scan;
pub mod gzip_index;
pub mod image_record;
pub mod oci_layers;
pub mod overlay_replay;
pub mod pack_index;
pub mod profile;
pub mod request_trace;
pub mod seeds;
pub mod source_index;
pub mod vhost_request;

/// A tolerant reader over fuzz input: reads past the end give zeros, never an error, so every
/// byte string is a valid input.
#[derive(Debug)]
pub struct Input<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self { data, pos: 0 }
    }

    pub fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }

    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let start = self.pos.min(self.data.len());
        let end = self.pos.saturating_add(n).min(self.data.len());
        self.pos = self.pos.saturating_add(n);
        &self.data[start..end]
    }

    pub fn rest(&mut self) -> &'a [u8] {
        let start = self.pos.min(self.data.len());
        self.pos = self.data.len();
        &self.data[start..]
    }

    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let b = self.bytes(N);
        out[..b.len()].copy_from_slice(b);
        out
    }

    pub fn u8(&mut self) -> u8 {
        self.array::<1>()[0]
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }

    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
}

/// The writer matching [`Input`], for seeds.
#[derive(Debug, Default)]
pub struct Output {
    pub buf: Vec<u8>,
}

impl Output {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(b);
        self
    }
}
