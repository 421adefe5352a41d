//! The documentation cannot drift from the code: the README's command synopsis names exactly the
//! flags each subcommand's `--help` lists (and every subcommand), and every repository path that
//! README.md and docs/ mention exists.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn help(path: &[String]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(path)
        .arg("--help")
        .env_remove("COLUMNS")
        .output()
        .expect("run tessera --help");
    assert!(out.status.success(), "tessera {} --help failed: {}", path.join(" "), out.status);
    String::from_utf8(out.stdout).expect("--help is UTF-8")
}

/// The lines of a `--help` section (`Commands:`, `Options:`): the indented (or blank) lines up
/// to the next unindented one.
fn section<'a>(help: &'a str, title: &'a str) -> impl Iterator<Item = &'a str> {
    help.lines().skip_while(move |l| *l != title).skip(1).take_while(|l| l.is_empty() || l.starts_with(' '))
}

/// One option as `--help` lists it: its short and long spellings (either may be missing).
#[derive(Debug)]
struct HelpFlag {
    short: Option<String>,
    long: Option<String>,
}

impl HelpFlag {
    fn spellings(&self) -> impl Iterator<Item = &String> {
        self.short.iter().chain(&self.long)
    }
}

/// The options of one `--help` page, without `--help` and `--version`. An option line is
/// `  -o, --output <FILE>` or `      --store <STORE>`; wrapped descriptions are indented further.
fn help_flags(help: &str) -> Vec<HelpFlag> {
    let mut flags = Vec::new();
    for line in section(help, "Options:") {
        let (short, rest) = if let Some(rest) = line.strip_prefix("  -").filter(|r| !r.starts_with('-')) {
            let (s, rest) = rest.split_once([',', ' ']).unwrap_or((rest, ""));
            (Some(format!("-{s}")), rest.trim_start())
        } else if line.starts_with("      --") {
            (None, &line[6..])
        } else {
            continue;
        };
        let long =
            rest.strip_prefix("--").map(|r| format!("--{}", r.split([' ', '=', '<']).next().unwrap_or("")));
        let flag = HelpFlag { short, long };
        if flag.spellings().any(|s| matches!(s.as_str(), "-h" | "--help" | "-V" | "--version")) {
            continue;
        }
        flags.push(flag);
    }
    flags
}

/// Every leaf subcommand (`["build"]`, `["cache", "gc"]`, …) with its options, from `--help`.
fn leaf_commands(path: Vec<String>, out: &mut BTreeMap<Vec<String>, Vec<HelpFlag>>) {
    let page = help(&path);
    let subs: Vec<String> = section(&page, "Commands:")
        // A command's line is indented by two spaces; its wrapped description, further.
        .filter(|l| l.as_bytes().get(2).is_some_and(|b| *b != b' '))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect();
    if subs.is_empty() {
        out.insert(path, help_flags(&page));
        return;
    }
    for sub in subs {
        let mut p = path.clone();
        p.push(sub);
        leaf_commands(p, out);
    }
}

/// The README's synopsis (the first code block after `## Command line`): each `tessera SUB…`
/// line and its indented continuation lines, as subcommand path → flags named.
fn readme_synopsis() -> BTreeMap<Vec<String>, BTreeSet<String>> {
    let readme = read(&repo_root().join("README.md"));
    let block: Vec<&str> = readme
        .lines()
        .skip_while(|l| l.trim() != "## Command line")
        .skip_while(|l| !l.starts_with("```"))
        .skip(1)
        .take_while(|l| !l.starts_with("```"))
        .collect();
    assert!(!block.is_empty(), "README.md has no code block under `## Command line`");
    let mut out: BTreeMap<Vec<String>, BTreeSet<String>> = BTreeMap::new();
    let mut current: Option<Vec<String>> = None;
    for line in block {
        let line = line.split(" # ").next().unwrap_or(line);
        let rest = if let Some(rest) = line.strip_prefix("tessera ") {
            let path: Vec<String> = rest
                .split_whitespace()
                .take_while(|w| w.chars().all(|c| c.is_ascii_lowercase()))
                .map(str::to_owned)
                .collect();
            assert!(!path.is_empty(), "README synopsis line without a subcommand: {line:?}");
            assert!(!out.contains_key(&path), "README synopsis names `tessera {}` twice", path.join(" "));
            out.insert(path.clone(), BTreeSet::new());
            current = Some(path);
            rest
        } else if line.starts_with(' ') {
            line
        } else {
            panic!("README synopsis line neither a command nor indented: {line:?}");
        };
        let Some(path) = &current else { panic!("README synopsis starts with a continuation line") };
        let flags = out.get_mut(path).expect("inserted above");
        for word in rest.split(|c: char| c.is_whitespace() || "[]|(),".contains(c)) {
            if word.starts_with('-') && word.len() > 1 {
                let flag: String =
                    word.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '-').collect();
                flags.insert(flag);
            }
        }
    }
    out
}

#[test]
fn readme_synopsis_matches_every_subcommands_help() {
    let mut commands = BTreeMap::new();
    leaf_commands(Vec::new(), &mut commands);
    assert!(commands.len() >= 9, "found only {} subcommands in --help", commands.len());
    let readme = readme_synopsis();
    let mut problems = Vec::new();
    for path in commands.keys() {
        if !readme.contains_key(path) {
            problems.push(format!("`tessera {}` is missing from the README synopsis", path.join(" ")));
        }
    }
    for (path, named) in &readme {
        let name = path.join(" ");
        let Some(flags) = commands.get(path) else {
            problems.push(format!("the README synopsis names `tessera {name}`, which does not exist"));
            continue;
        };
        for flag in flags {
            if !flag.spellings().any(|s| named.contains(s)) {
                let spelled = flag.spellings().cloned().collect::<Vec<_>>().join("/");
                problems.push(format!("`tessera {name} {spelled}` is missing from the README synopsis"));
            }
        }
        for n in named {
            if !flags.iter().any(|f| f.spellings().any(|s| s == n)) {
                problems.push(format!(
                    "the README synopsis gives `tessera {name}` {n}, which --help does not list"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "README.md `## Command line` is out of date:\n  {}", problems.join("\n  "));
}

#[test]
fn help_parsing_finds_short_and_long_flags() {
    let flags = help_flags(&help(&["export".to_owned()]));
    assert!(
        flags.iter().any(|f| f.short.as_deref() == Some("-o") && f.long.as_deref() == Some("--output")),
        "{flags:?}"
    );
    assert!(flags.iter().any(|f| f.short.is_none() && f.long.as_deref() == Some("--store")), "{flags:?}");
}

/// Paths that are generated, not committed: fuzzing state, build output, and what `cargo xtask
/// bench` writes beside `docs/benchmarks.md` (its raw samples and plots, before its first run).
const GENERATED: [&str; 6] =
    ["fuzz/target", "fuzz/corpus", "fuzz/artifacts", "target", "docs/benchmarks.json", "docs/plots"];

/// Top-level directories whose paths the docs mention (`crates/store/src/http.rs`, `docs/cache.md`).
const ROOTS: [&str; 7] = ["crates/", "docs/", "fuzz/", "tests/", "xtask/", "fixtures/", ".ci/"];

fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display())) {
        let path = e.expect("read_dir entry").path();
        if path.is_dir() {
            markdown_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "md") {
            out.push(path);
        }
    }
}

/// Every committed file's path, for bare file names (`blockmap.rs`).
fn file_names(dir: &Path, out: &mut BTreeSet<String>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display())) {
        let e = e.expect("read_dir entry");
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') && name != ".ci" || name == "target" {
            continue;
        }
        if e.path().is_dir() {
            file_names(&e.path(), out);
        } else {
            out.insert(name);
        }
    }
}

/// The repository paths a markdown line mentions: words starting with one of [`ROOTS`]
/// (placeholders such as `<target>` or `…` skipped), relative links (`](formats/cache.md)`)
/// and bare Rust file names.
fn mentions(line: &str) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    for word in line.split(|c: char| c.is_whitespace() || "`'\"(),;[]*".contains(c)) {
        let word = word.trim_end_matches(['.', ':']);
        let word = word.split("::").next().unwrap_or(word);
        let word = word.split(':').next().unwrap_or(word).trim_end_matches('/');
        if word.contains(['<', '>', '{', '}', '…', '$']) || word.contains("...") {
            continue;
        }
        if ROOTS.iter().any(|r| word.starts_with(r)) {
            out.push((word.to_owned(), true));
        } else if word.ends_with(".rs") && !word.contains('/') && word.len() > 3 {
            out.push((word.to_owned(), false));
        }
    }
    out
}

#[test]
fn every_path_the_docs_mention_exists() {
    let root = repo_root();
    let mut docs = vec![root.join("README.md")];
    markdown_files(&root.join("docs"), &mut docs);
    let mut names = BTreeSet::new();
    file_names(&root, &mut names);
    let mut missing = Vec::new();
    for doc in &docs {
        let text = read(doc);
        let shown = doc.strip_prefix(&root).unwrap_or(doc).display().to_string();
        for (n, line) in text.lines().enumerate() {
            for (path, rooted) in mentions(line) {
                let found = if rooted {
                    GENERATED.iter().any(|g| path.starts_with(g)) || root.join(&path).exists()
                } else {
                    names.contains(&path)
                };
                if !found {
                    missing.push(format!("{shown}:{}: {path}", n + 1));
                }
            }
            // Relative markdown links: `[text](formats/cache.md#anchor)`.
            for link in line.split("](").skip(1) {
                let target = link.split([')', '#']).next().unwrap_or("");
                if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let base = doc.parent().unwrap_or(&root);
                if !base.join(target).exists() {
                    missing.push(format!("{shown}:{}: link {target}", n + 1));
                }
            }
        }
    }
    assert!(missing.is_empty(), "the docs mention paths that do not exist:\n  {}", missing.join("\n  "));
}

#[test]
fn mentions_finds_paths_and_skips_placeholders() {
    let m = mentions(
        "see `crates/store/src/http.rs:94`, docs/formats/ and fuzz/artifacts/<target>/ or blockmap.rs.",
    );
    assert_eq!(
        m,
        vec![
            ("crates/store/src/http.rs".to_owned(), true),
            ("docs/formats".to_owned(), true),
            ("blockmap.rs".to_owned(), false)
        ]
    );
}
