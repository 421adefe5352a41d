//! Usage errors found while parsing the command line (exit status 2, nothing on stdout, a message
//! naming the flag and why), before any store is opened.
#![allow(clippy::unwrap_used)]

mod common;

use common::fails;

/// Every command's `--store` (and `copy --to`) is a typed location: a malformed one is refused by
/// the parser with the flag and the reason, whatever the command.
#[test]
fn a_malformed_store_is_a_usage_error_for_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let sock = format!("{d}/vm.sock");
    let out = format!("{d}/out.img");
    let trace = format!("{d}/t.trace");
    for (bad, reason) in [
        ("gs://bucket", "unknown scheme"),
        ("s3://No_Such", "expected s3://BUCKET[/PREFIX]"),
        ("docker://host-only", "expected docker://HOST[:PORT]/REPO"),
        ("http://", "needs a host"),
        ("file://", "file:// needs a path"),
    ] {
        let commands: Vec<Vec<&str>> = vec![
            vec!["build", d, "--store", bad],
            vec!["export", "img", "--store", bad, "-o", &out],
            vec!["inspect", "img", "--store", bad],
            vec!["serve", "img", "--store", bad, "--socket", &sock],
            vec!["push", "img", "--store", bad, "docker://127.0.0.1:9/r:t"],
            vec!["profile", "img", "--store", bad, "--trace", &trace],
            vec!["warm", "img", "--store", bad, "--cache-dir", d],
            vec!["copy", "img", "--store", bad, "--to", d],
            vec!["copy", "img", "--store", d, "--to", bad],
        ];
        for args in commands {
            let stderr = fails(&args, 2);
            let flag = if args.ends_with(&["--to", bad]) { "--to <STORE>" } else { "--store <STORE>" };
            assert!(stderr.contains(&format!("invalid value '{bad}' for '{flag}'")), "{args:?}: {stderr}");
            assert!(stderr.contains(reason), "{args:?}: {stderr}");
        }
    }
    assert!(std::fs::read_dir(d).unwrap().next().is_none(), "nothing was created");
}

/// Every command that talks to a remote origin takes `--ca-file`; a missing file, or one without
/// a certificate, is refused by the parser (exit 2) with the flag, the file and the reason,
/// before anything is opened.
#[test]
fn a_missing_or_malformed_ca_file_is_a_usage_error_for_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let bad_pem = dir.path().join("bad.pem");
    std::fs::write(&bad_pem, "-----BEGIN PRIVATE KEY-----\nMC4CAQA=\n-----END PRIVATE KEY-----\n").unwrap();
    let missing = format!("{d}/missing.pem");
    let bad = bad_pem.to_str().unwrap();
    let (sock, out) = (format!("{d}/vm.sock"), format!("{d}/out.img"));
    let store = "https://127.0.0.1:9/store";
    for (file, reason) in [(missing.as_str(), "No such file"), (bad, "no CA certificate")] {
        let commands: Vec<Vec<&str>> = vec![
            vec!["build", "docker://127.0.0.1:9/app:v1", "--store", d],
            vec!["export", "img", "--store", store, "-o", &out],
            vec!["inspect", "img", "--store", store],
            vec!["serve", "img", "--store", store, "--socket", &sock],
            vec!["push", "img", "--store", d, "docker://127.0.0.1:9/r:t"],
            vec!["warm", "img", "--store", store, "--cache-dir", d],
            vec!["copy", "img", "--store", store, "--to", d],
        ];
        for mut args in commands {
            args.extend(["--ca-file", file]);
            let stderr = fails(&args, 2);
            assert!(
                stderr.contains(&format!("invalid value '{file}' for '--ca-file <PEM>'")),
                "{args:?}: {stderr}"
            );
            assert!(stderr.contains(reason), "{args:?}: {stderr}");
        }
    }
    let left: Vec<_> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left, vec![std::ffi::OsString::from("bad.pem")], "nothing was created");
}
