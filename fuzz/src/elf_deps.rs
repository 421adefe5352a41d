//! `elf_deps`: the ELF reader behind `serve --elf-deps` ([`tessera_engine::elfdeps::parse`]):
//! the bytes of any file of an image a daemon serves, which whoever built the image chose.
//!
//! Input: one byte saying which part of the file memory holds (0: all of it; else a window of
//! `byte × 256` bytes from the start, as when only the first chunk has arrived), then the file.
//! Properties: never a panic, and never a read outside the file; libraries are plain names (no
//! slash, at most 255 bytes, at most 64 of them); with more of the file in memory, an answer
//! given with less does not change (`Later` aside); an interpreter is an absolute path.

use tessera_engine::elfdeps::{parse, Needs};

/// The fuzz target body.
pub fn run(data: &[u8]) {
    let Some((&held, file)) = data.split_first() else { return };
    let len = file.len() as u64;
    let window = if held == 0 { file.len() } else { (usize::from(held) * 256).min(file.len()) };
    let read = |limit: usize| {
        move |offset: u64, n: usize| -> Option<Vec<u8>> {
            let end = offset.checked_add(n as u64).expect("a range past 2^64 asked");
            assert!(end <= len, "a read past the file's end: {offset}+{n} of {len}");
            (end <= limit as u64).then(|| file[offset as usize..end as usize].to_vec())
        }
    };
    let partial = parse(len, read(window));
    let whole = parse(len, read(file.len()));
    if let Needs::Libraries { names, interp, .. } = &whole {
        assert!(names.len() <= 64, "{} libraries", names.len());
        for n in names {
            assert!(!n.is_empty() && n.len() <= 255 && !n.contains('/'), "library name {n:?}");
        }
        if let Some(p) = interp {
            assert!(p.starts_with('/'), "interpreter {p:?}");
        }
    }
    assert_ne!(whole, Needs::Later, "the whole file in memory and still later");
    if partial != Needs::Later {
        assert_eq!(partial, whole, "more of the file changed the answer");
    }
}

/// Seeds: a program needing three libraries with an interpreter, one needing none, and a shared
/// object needing one, each held whole and as their first 256 bytes.
pub fn seeds() -> crate::seeds::Seeds {
    use tessera_engine::elfdeps::sample_elf;
    let files = [
        (
            "program",
            sample_elf(Some("/lib64/ld-linux-x86-64.so.2"), &["libm.so.6", "libz.so.1", "libc.so.6"]),
        ),
        ("no-libraries", sample_elf(None, &[])),
        ("library", sample_elf(None, &["libpcre2-8.so.0"])),
    ];
    let mut out = Vec::new();
    for (name, f) in files {
        for held in [0u8, 1] {
            let mut bytes = vec![held];
            bytes.extend_from_slice(&f);
            out.push((format!("{name}-held-{held}"), bytes));
        }
    }
    out
}
