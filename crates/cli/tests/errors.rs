//! How failures read on stderr: each cause once, the environment checked by the binary.
#![allow(clippy::unwrap_used)]

mod common;

use std::fs;
use std::net::TcpListener;
use std::process::Command;

use common::{fails, tessera, TESSERA};

/// A loopback port nothing listens on (bound, then released): connecting to it is refused.
fn refused_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A refused connection is reported once, not once per error layer that wraps it.
#[test]
fn a_refused_connection_is_named_once() {
    let port = refused_port();
    for store in [format!("http://127.0.0.1:{port}/"), format!("docker://127.0.0.1:{port}/images")] {
        let stderr = fails(&["inspect", "x", "--store", &store], 1);
        let line =
            stderr.lines().find(|l| l.starts_with("tessera: error: ")).unwrap_or_else(|| panic!("{stderr}"));
        assert_eq!(line.matches("Connection refused").count(), 1, "{store}: {line}");
        assert_eq!(line.matches("os error 111").count(), 1, "{store}: {line}");
        assert!(line.contains(&format!("127.0.0.1:{port}")), "{store}: the message names the origin: {line}");
    }
}

/// `SOURCE_DATE_EPOCH` is read by the binary: a valid one sets the filesystem time (so it is part
/// of the image ID), a malformed one is a usage error before anything is written.
#[test]
fn source_date_epoch_is_checked_and_used() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    fs::create_dir_all(&src).unwrap();
    fs::write(src.join("f"), b"hello").unwrap();
    let store = dir.path().join("store");
    let build = |sde: Option<&str>| {
        let mut cmd = Command::new(TESSERA);
        cmd.args(["build", src.to_str().unwrap(), "--store", store.to_str().unwrap(), "--size", "32M"]);
        match sde {
            Some(v) => cmd.env("SOURCE_DATE_EPOCH", v),
            None => cmd.env_remove("SOURCE_DATE_EPOCH"),
        };
        cmd.output().unwrap()
    };
    for bad in ["yesterday", "-5", "1.5", "0x10"] {
        let out = build(Some(bad));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {stderr}");
        assert!(stderr.contains(&format!("SOURCE_DATE_EPOCH=\"{bad}\"")), "{bad}: {stderr}");
        assert!(stderr.contains("expected a Unix time in seconds"), "{bad}: {stderr}");
        assert!(out.stdout.is_empty() && !store.exists(), "{bad}: nothing built");
    }
    let id = |sde| {
        let out = build(sde);
        assert!(out.status.success(), "{sde:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let a = id(Some("1000000000"));
    assert_eq!(a, id(Some("1000000000")), "same time, same image");
    assert_ne!(a, id(Some("1000000001")), "the time is part of the image");
    assert_eq!(id(None), id(Some("")), "empty is unset");
    assert!(tessera(&["inspect", a.trim(), "--store", store.to_str().unwrap()]).contains(a.trim()));
}
