//! docs/architecture.md shows the workspace's crate graph as the `Cargo.toml` files declare it:
//! the block between `<!-- crate-graph: begin -->` and `<!-- crate-graph: end -->` names every
//! workspace member once, with exactly its workspace dependencies (normal and build ones after
//! `──►`, test-only ones in `[dev: …]`), as `cargo metadata` reads them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

/// A crate's workspace dependencies: (normal and build, dev only).
type Deps = (BTreeSet<String>, BTreeSet<String>);

/// The short name the document uses: without the `tessera-` prefix.
fn short(name: &str) -> String {
    name.strip_prefix("tessera-").unwrap_or(name).to_owned()
}

/// The graph as cargo reads the manifests.
fn from_metadata(root: &Path) -> BTreeMap<String, Deps> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .args(["metadata", "--no-deps", "--offline", "--format-version", "1", "--manifest-path"])
        .arg(root.join("Cargo.toml"))
        .output()
        .expect("run cargo metadata");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("cargo metadata is JSON");
    let packages = meta["packages"].as_array().expect("packages");
    let members: BTreeSet<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    let mut graph = BTreeMap::new();
    for p in packages {
        let name = p["name"].as_str().expect("package name");
        let (mut normal, mut dev) = (BTreeSet::new(), BTreeSet::new());
        for d in p["dependencies"].as_array().expect("dependencies") {
            let dep = d["name"].as_str().expect("dependency name");
            if !members.contains(dep) {
                continue;
            }
            match d["kind"].as_str() {
                Some("dev") => dev.insert(short(dep)),
                _ => normal.insert(short(dep)),
            };
        }
        let dev = dev.difference(&normal).cloned().collect();
        assert!(graph.insert(short(name), (normal, dev)).is_none(), "{name} twice");
    }
    graph
}

/// `a, b, c` (or `-` for none) as a set.
fn names(list: &str) -> BTreeSet<String> {
    let list = list.trim();
    if list == "-" {
        return BTreeSet::new();
    }
    list.split(',').map(|n| n.trim().to_owned()).inspect(|n| assert!(!n.is_empty(), "empty name")).collect()
}

/// The graph as docs/architecture.md draws it: `NAME ──► DEPS [dev: DEPS]` lines in the
/// marked block (the fence lines are skipped).
fn from_doc(text: &str) -> BTreeMap<String, Deps> {
    let begin = text.find("<!-- crate-graph: begin -->").expect("docs/architecture.md: no crate-graph block");
    let end = text[begin..].find("<!-- crate-graph: end -->").expect("crate-graph block not closed");
    let mut graph = BTreeMap::new();
    for line in text[begin..begin + end].lines().skip(1) {
        if line.starts_with("```") || line.trim().is_empty() {
            continue;
        }
        let (name, rest) = line.split_once("──►").unwrap_or_else(|| panic!("not `NAME ──► DEPS`: {line:?}"));
        let (normal, dev) = match rest.split_once("[dev:") {
            Some((normal, dev)) => (
                names(normal),
                names(dev.strip_suffix(']').unwrap_or_else(|| panic!("unclosed [dev: {line:?}"))),
            ),
            None => (names(rest), BTreeSet::new()),
        };
        let name = name.trim().to_owned();
        assert!(graph.insert(name.clone(), (normal, dev)).is_none(), "{name} drawn twice");
    }
    graph
}

#[test]
fn architecture_md_shows_the_crate_graph_cargo_reads() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).expect("read docs/architecture.md");
    let drawn = from_doc(&doc);
    let actual = from_metadata(&root);
    assert!(actual.len() >= 13, "the workspace has its crates: {:?}", actual.keys());
    for (name, deps) in &actual {
        let shown = drawn.get(name).unwrap_or_else(|| panic!("docs/architecture.md does not draw {name}"));
        assert_eq!(shown, deps, "docs/architecture.md: the dependencies of {name} (normal, dev-only)");
    }
    for name in drawn.keys() {
        assert!(actual.contains_key(name), "docs/architecture.md draws {name}, not a workspace member");
    }
}

#[test]
fn the_graph_parser_reads_what_it_should() {
    let doc = "x\n<!-- crate-graph: begin -->\n```text\na ──► b, c   [dev: d]\nb ──► -\n```\n<!-- crate-graph: end -->\n";
    let g = from_doc(doc);
    assert_eq!(g.len(), 2);
    assert_eq!(g["a"].0, names("b, c"));
    assert_eq!(g["a"].1, names("d"));
    assert!(g["b"].0.is_empty() && g["b"].1.is_empty());
}
