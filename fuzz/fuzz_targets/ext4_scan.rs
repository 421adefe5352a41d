#![no_main]
//! libFuzzer entry point; the body is `tessera_fuzz::ext4_scan::run` (see docs/fuzzing.md).

libfuzzer_sys::fuzz_target!(|data: &[u8]| tessera_fuzz::ext4_scan::run(data));
