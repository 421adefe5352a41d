#![no_main]
//! libFuzzer entry point; the body is `tessera_fuzz::source_index::run` (see docs/fuzzing.md).

libfuzzer_sys::fuzz_target!(|data: &[u8]| tessera_fuzz::source_index::run(data));
