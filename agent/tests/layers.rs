//! Every crate of the workspace in layers (issue 30), file by file: the
//! crate graph keeps the layers between crates, and this test keeps them
//! inside each one. For every member of the workspace (`Cargo.toml`'s
//! `members`) it reads `src/` (the library from `lib.rs`, the binary from
//! `main.rs`; see `tests/layering`) and fails
//!
//! - on a circle among files: files that use each other, round and round,
//!   by the paths of the code the crate builds (`#[cfg(test)]` code left
//!   out). A file uses the file of the module a path names, and through
//!   a `pub use` of the crate's own item the file that defines it (an item
//!   of another crate re-exported by `lib.rs` is a use of `lib.rs`);
//!   `super::*` is a use of the parent, and `mod x;` no use at all;
//! - on a file with more than [`MAX_LINES`] lines of code (not blank, not
//!   comments, not in a `#[cfg(test)] mod … { … }` block; a test module's
//!   own file, `#[cfg(test)] mod tests;`, does not count).
//!
//! What may stay is in [`BIG`] and [`CIRCLES`], each with its reason; an
//! entry that is no longer needed fails too, so the lists stay true.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use layering::Graph;

/// Lines of code a source file may have, its tests not counted.
const MAX_LINES: usize = 800;

/// Files allowed over [`MAX_LINES`], and why.
const BIG: &[(&str, &str)] = &[(
    "tests/fake-nvml/src/mig.rs",
    "a test fake: libnvidia-ml's MIG calls as the C library has them, one \
     `extern \"C\"` function each over simnode's MIG state; never shipped",
)];

/// Circles allowed (all their files), and why.
const CIRCLES: &[(&[&str], &str)] = &[(
    &["tests/fake-nvml/src/lib.rs", "tests/fake-nvml/src/mig.rs"],
    "a test fake: the MIG calls use lib.rs's handle table and error helpers, \
     and lib.rs's device calls answer for MIG handles from mig.rs; never shipped",
)];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("agent/ is in the workspace")
        .to_path_buf()
}

/// The members of the workspace (`crates/*` expanded), sorted.
fn members() -> Vec<String> {
    let root = workspace();
    let toml = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let at = toml
        .lines()
        .position(|l| l.trim_start().starts_with("members"))
        .expect("Cargo.toml has members");
    let list: String = toml
        .lines()
        .skip(at)
        .scan(false, |done, l| {
            let line = (!*done).then(|| l.to_string());
            *done = l.contains(']');
            line
        })
        .collect();
    let mut out = Vec::new();
    for m in list.split('"').skip(1).step_by(2) {
        match m.strip_suffix("/*") {
            Some(dir) => {
                for e in std::fs::read_dir(root.join(dir)).unwrap() {
                    let p = e.unwrap().path();
                    if p.join("Cargo.toml").is_file() {
                        out.push(p.strip_prefix(&root).unwrap().display().to_string());
                    }
                }
            }
            None => out.push(m.to_string()),
        }
    }
    out.sort();
    out
}

/// Each member's graph, with its path from the workspace.
fn graphs() -> Vec<(String, Graph)> {
    let members = members();
    for m in ["agent", "controller", "hostlib", "tests/layering"] {
        assert!(
            members.iter().any(|x| x == m),
            "members read from Cargo.toml: {members:?}; {m} is not among them"
        );
    }
    members
        .into_iter()
        .map(|m| {
            let g = Graph::of_crate(&workspace().join(&m)).unwrap();
            assert!(!g.files.is_empty(), "{m}/src has no .rs file");
            (m, g)
        })
        .collect()
}

#[test]
fn no_crate_has_a_circle_among_its_files() {
    let mut bad = Vec::new();
    let mut allowed = BTreeSet::new();
    for (member, g) in graphs() {
        for c in g.circles(false) {
            let files: Vec<String> = c.files.iter().map(|f| format!("{member}/{f}")).collect();
            match CIRCLES
                .iter()
                .position(|(ok, _)| files.iter().all(|f| ok.contains(&f.as_str())))
            {
                Some(n) => {
                    allowed.insert(n);
                }
                None => bad.push(format!("{member}: {c}")),
            }
        }
    }
    let stale: Vec<String> = (0..CIRCLES.len())
        .filter(|n| !allowed.contains(n))
        .map(|n| CIRCLES[n].0.join(", "))
        .collect();
    assert!(
        bad.is_empty(),
        "files that use each other, round and round (each line: a file, the lines where it \
         uses the next, and the paths):\n{}\n\nBreak each circle: move what the lower file takes \
         from the upper one into a leaf module below both (a file that uses neither) and import \
         it from there. A circle that must stay goes into CIRCLES in agent/tests/layers.rs, with \
         its reason.",
        bad.join("\n\n")
    );
    assert!(
        stale.is_empty(),
        "CIRCLES in agent/tests/layers.rs allows circles that are gone; remove these entries:\n{}",
        stale.join("\n")
    );
}

#[test]
fn no_source_file_is_over_the_size_of_one_concern() {
    let mut bad = Vec::new();
    let mut allowed = BTreeSet::new();
    for (member, g) in graphs() {
        for f in g
            .files
            .iter()
            .filter(|f| !f.test && f.code_lines > MAX_LINES)
        {
            let path = format!("{member}/{}", f.rel);
            match BIG.iter().position(|(ok, _)| *ok == path) {
                Some(n) => {
                    allowed.insert(n);
                }
                None => bad.push(format!(
                    "{path}: {} lines of code besides its tests",
                    f.code_lines
                )),
            }
        }
    }
    let stale: Vec<&str> = (0..BIG.len())
        .filter(|n| !allowed.contains(n))
        .map(|n| BIG[n].0)
        .collect();
    assert!(
        bad.is_empty(),
        "source files over {MAX_LINES} lines of code:\n{}\n\nSplit each by concern: one idea per \
         file, each new file under the module it came from (child modules see their parent's \
         private items), re-exported where other crates use its paths; tests may go into a \
         sibling tests.rs. A file that must stay this big goes into BIG in \
         agent/tests/layers.rs, with its reason.",
        bad.join("\n")
    );
    assert!(
        stale.is_empty(),
        "BIG in agent/tests/layers.rs allows files that are no longer over {MAX_LINES} lines \
         of code; remove these entries:\n{}",
        stale.join("\n")
    );
}

/// The reader finds the agent's two crates, the library and the binary
/// with its `cli/`, and the test modules' own files.
#[test]
fn the_agent_is_read_as_a_library_and_a_binary() {
    let g = Graph::of_crate(Path::new(env!("CARGO_MANIFEST_DIR"))).unwrap();
    let file = |rel: &str| {
        g.file(rel)
            .unwrap_or_else(|| panic!("agent/{rel} not read"))
    };
    assert_eq!(file("src/lib.rs").target, layering::Target::Lib);
    assert_eq!(file("src/main.rs").target, layering::Target::Bin);
    let cli: Vec<&layering::File> = g
        .files
        .iter()
        .filter(|f| f.rel.starts_with("src/cli/"))
        .collect();
    assert!(!cli.is_empty());
    assert!(
        cli.iter()
            .all(|f| f.target == layering::Target::Bin && f.reached)
    );
    assert!(
        g.files.iter().all(|f| f.reached),
        "every file is reached from lib.rs or main.rs"
    );
}
