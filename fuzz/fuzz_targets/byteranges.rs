#![no_main]
//! libFuzzer entry point; the body is `tessera_fuzz::byteranges::run` (see docs/fuzzing.md).

libfuzzer_sys::fuzz_target!(|data: &[u8]| tessera_fuzz::byteranges::run(data));
