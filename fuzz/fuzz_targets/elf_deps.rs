#![no_main]
//! libFuzzer entry point; the body is `tessera_fuzz::elf_deps::run` (see docs/fuzzing.md).

libfuzzer_sys::fuzz_target!(|data: &[u8]| tessera_fuzz::elf_deps::run(data));
