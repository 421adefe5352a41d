//! `tessera completions SHELL` and `tessera man`: generated from the clap definitions, they name
//! every subcommand, and the manual pages render.

use std::path::Path;
use std::process::{Command, Output};

fn tessera(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("run tessera");
    assert!(
        out.status.success(),
        "tessera {} failed: {}\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Every subcommand path (`build`, `cache gc`, …) as `tessera --help` lists it.
fn subcommands(path: &[&str]) -> Vec<Vec<String>> {
    let mut args = path.to_vec();
    args.push("--help");
    let help = String::from_utf8(tessera(&args).stdout).expect("UTF-8 help");
    let mut out = Vec::new();
    for line in help.lines().skip_while(|l| *l != "Commands:").skip(1).take_while(|l| l.starts_with("  ")) {
        // A command's line is indented by two spaces; its wrapped description, further.
        if line.as_bytes().get(2).is_none_or(|b| *b == b' ') {
            continue;
        }
        let Some(name) = line.split_whitespace().next() else { continue };
        if name == "help" {
            continue;
        }
        let mut p: Vec<&str> = path.to_vec();
        p.push(name);
        out.push(p.iter().map(|s| s.to_string()).collect());
        out.extend(subcommands(&p));
    }
    out
}

#[test]
fn bash_completions_name_every_subcommand() {
    let subs = subcommands(&[]);
    assert!(subs.len() >= 11, "{subs:?}");
    let script = String::from_utf8(tessera(&["completions", "bash"]).stdout).expect("UTF-8 script");
    assert!(script.contains("complete -F _tessera"), "not a bash completion script:\n{script}");
    for sub in &subs {
        // clap_complete's bash script has one case per command path: tessera__subcmd__cache__subcmd__gc.
        let case = format!("tessera__subcmd__{}", sub.join("__subcmd__"));
        assert!(script.contains(&case), "bash completions lack `tessera {}` ({case})", sub.join(" "));
        let name = sub.last().expect("non-empty path");
        assert!(script.contains(name.as_str()), "bash completions do not offer {name}");
    }
    // And the flags of a subcommand.
    assert!(script.contains("--cache-dir") && script.contains("--record-trace"));
}

#[test]
fn every_shell_gets_a_script() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let script = tessera(&["completions", shell]).stdout;
        let text = String::from_utf8(script).expect("UTF-8 script");
        assert!(text.contains("serve") && text.contains("socket"), "{shell}: no serve --socket");
    }
    let bad =
        Command::new(env!("CARGO_BIN_EXE_tessera")).args(["completions", "tcsh"]).output().expect("run");
    assert_eq!(bad.status.code(), Some(2), "an unknown shell is a usage error");
}

#[test]
fn man_pages_cover_every_subcommand_and_render() {
    let dir = tempfile::tempdir().expect("tempdir");
    tessera(&["man", "--out", dir.path().to_str().expect("UTF-8 temp path")]);
    let top = std::fs::read_to_string(dir.path().join("tessera.1")).expect("tessera.1 written");
    assert!(top.starts_with(".ie") || top.contains(".TH tessera"), "not roff:\n{top}");
    for sub in subcommands(&[]) {
        let page = dir.path().join(format!("tessera-{}.1", sub.join("-")));
        let roff = std::fs::read_to_string(&page).unwrap_or_else(|e| panic!("{}: {e}", page.display()));
        assert!(roff.contains(".TH"), "{} has no title header", page.display());
        // The top page lists every first-level subcommand.
        if sub.len() == 1 {
            assert!(top.contains(&sub[0]), "tessera.1 does not name {}", sub[0]);
        }
    }
    let serve = std::fs::read_to_string(dir.path().join("tessera-serve.1")).expect("tessera-serve.1");
    assert!(serve.contains("record\\-trace") || serve.contains("record-trace"), "serve page lacks its flags");
    // Without --out the main page goes to stdout.
    let stdout = String::from_utf8(tessera(&["man"]).stdout).expect("UTF-8 roff");
    assert!(stdout.contains(".TH tessera 1") && stdout.contains("tessera\\-serve(1)"), "{stdout}");
    render(&dir.path().join("tessera-serve.1"));
}

/// `man -l` renders the page when man-db is installed (it is on the CI machine's Debian image
/// only if something pulled it in); otherwise groff's own check, else nothing more to ask.
fn render(page: &Path) {
    for (tool, args) in [("man", vec!["-l", "-Tutf8"]), ("groff", vec!["-man", "-Tutf8", "-ww", "-z"])] {
        let Ok(out) =
            Command::new(tool).args(&args).arg(page).env("MANPAGER", "cat").env("PAGER", "cat").output()
        else {
            continue;
        };
        assert!(
            out.status.success(),
            "{tool} failed on {}: {}",
            page.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("warning"), "{tool} warns on {}: {stderr}", page.display());
        if tool == "man" {
            // Bold and underline are overstrikes (`s\x08s`): drop each character before a backspace.
            let raw = String::from_utf8_lossy(&out.stdout);
            let mut text = String::new();
            for c in raw.chars() {
                if c == '\x08' {
                    text.pop();
                } else {
                    text.push(c);
                }
            }
            assert!(text.contains("--socket"), "rendered tessera-serve(1) lacks --socket:\n{text}");
        }
        return;
    }
}
