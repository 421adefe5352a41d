#![no_main]
//! libFuzzer entry point; the body is `tessera_fuzz::content_manifest::run` (see docs/fuzzing.md).

libfuzzer_sys::fuzz_target!(|data: &[u8]| tessera_fuzz::content_manifest::run(data));
