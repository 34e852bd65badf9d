//! The import graph and its circles, on a small crate written to a
//! temporary directory.

use std::path::{Path, PathBuf};

use crate::graph::Graph;
use crate::resolve::Reexports;
use crate::source::Target;

/// A crate in a directory of its own, removed when dropped.
struct Crate(PathBuf);

impl Crate {
    fn new(name: &str, files: &[(&str, &str)]) -> Crate {
        let dir = std::env::temp_dir().join(format!("layering-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (path, text) in files {
            let p = dir.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        Crate(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Crate {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const FILES: &[(&str, &str)] = &[
    (
        "src/lib.rs",
        "mod a;\nmod b;\nmod c;\npub use a::X;\n#[cfg(test)]\nmod tests;\n",
    ),
    (
        "src/a.rs",
        "use crate::b::Y;\npub struct X;\n#[cfg(test)]\nmod tests {\n    use crate::c::Q;\n}\n",
    ),
    (
        "src/b.rs",
        "use crate::c;\npub struct Y;\npub fn f() -> crate::X {\n    c::d::z();\n    crate::X\n}\n",
    ),
    (
        "src/c/mod.rs",
        "mod d;\n#[cfg(test)]\nuse crate::a::X as Ax;\npub struct Q;\nfn k() {\n    d::z();\n}\n",
    ),
    ("src/c/d.rs", "pub fn z() {}\n"),
    ("src/tests.rs", "use super::*;\nuse crate::c::d;\n"),
    (
        "src/main.rs",
        "mod cli;\nfn main() {\n    other::x();\n    cli::run();\n}\n",
    ),
    ("src/cli.rs", "pub fn run() {\n    crate::main();\n}\n"),
    ("src/orphan.rs", "// no mod names me\nfn o() {}\n"),
];

fn edge_list(g: &Graph) -> Vec<String> {
    g.edges
        .iter()
        .map(|e| {
            format!(
                "{}:{} -> {} {}{}",
                e.from,
                e.line,
                e.to,
                e.path,
                if e.test { " (test)" } else { "" }
            )
        })
        .collect()
}

#[test]
fn the_graph_goes_to_the_deepest_module_file() {
    let c = Crate::new("graph", FILES);
    let g = Graph::read(c.path(), Reexports::Stop).unwrap();
    assert_eq!(
        edge_list(&g),
        [
            "src/a.rs:1 -> src/b.rs crate::b::Y",
            "src/a.rs:5 -> src/c/mod.rs crate::c::Q (test)",
            "src/b.rs:1 -> src/c/mod.rs crate::c",
            // Re-exported by lib.rs: a use of lib.rs, re-exports not followed.
            "src/b.rs:3 -> src/lib.rs crate::X",
            // Through the module `use crate::c` brought in.
            "src/b.rs:4 -> src/c/d.rs crate::c::d::z",
            "src/b.rs:5 -> src/lib.rs crate::X",
            "src/c/mod.rs:3 -> src/a.rs crate::a::X (test)",
            // A child module by its name.
            "src/c/mod.rs:6 -> src/c/d.rs crate::c::d::z",
            // The binary's modules: its own crate.
            "src/cli.rs:2 -> src/main.rs crate::main",
            "src/lib.rs:4 -> src/a.rs crate::a::X",
            "src/main.rs:4 -> src/cli.rs crate::cli::run",
            // `super::*` uses the parent.
            "src/tests.rs:1 -> src/lib.rs crate::* (test)",
            "src/tests.rs:2 -> src/c/d.rs crate::c::d (test)",
        ]
    );
    // Followed, the re-export is a use of the file that defines X.
    let g = Graph::of_crate(c.path()).unwrap();
    let b: Vec<String> = edge_list(&g)
        .into_iter()
        .filter(|e| e.starts_with("src/b.rs"))
        .collect();
    assert_eq!(
        b,
        [
            "src/b.rs:1 -> src/c/mod.rs crate::c",
            "src/b.rs:3 -> src/a.rs crate::X",
            "src/b.rs:4 -> src/c/d.rs crate::c::d::z",
            "src/b.rs:5 -> src/a.rs crate::X",
        ]
    );
    let cli = g.file("src/cli.rs").unwrap();
    assert_eq!(
        (cli.target, cli.module.as_slice()),
        (Target::Bin, &["cli".to_string()][..])
    );
    assert!(g.file("src/tests.rs").unwrap().test);
    assert!(!g.file("src/a.rs").unwrap().test);
    let orphan = g.file("src/orphan.rs").unwrap();
    assert!(!orphan.reached && orphan.code_lines == 1);
    assert!(g.file("src/c/d.rs").unwrap().reached);
}

#[test]
fn circles_are_the_strongly_connected_files() {
    let c = Crate::new("circles", FILES);
    let g = Graph::of_crate(c.path()).unwrap();
    let files = |g: &Graph, tests| -> Vec<Vec<String>> {
        g.circles(tests).into_iter().map(|c| c.files).collect()
    };
    // b uses X, which a defines (lib.rs only re-exports it), and a uses b.
    assert_eq!(
        files(&g, false),
        [
            vec!["src/a.rs", "src/b.rs"],
            vec!["src/cli.rs", "src/main.rs"]
        ]
    );
    // c's test code uses a, and a uses c by b.
    assert_eq!(files(&g, true)[0], ["src/a.rs", "src/b.rs", "src/c/mod.rs"]);
    assert_eq!(
        g.circles(false)[0].to_string(),
        "a circle of 2 files: src/a.rs, src/b.rs\n  \
         src/a.rs:1 -> src/b.rs (crate::b::Y)\n  \
         src/b.rs:3,5 -> src/a.rs (crate::X)"
    );
    // Re-exports not followed: b uses lib.rs, which uses a.
    let stop = Graph::read(c.path(), Reexports::Stop).unwrap();
    assert_eq!(
        files(&stop, false)[0],
        ["src/a.rs", "src/b.rs", "src/lib.rs"]
    );
}

#[test]
fn reexports_are_followed_to_the_crates_own_items_only() {
    let c = Crate::new(
        "reexports",
        &[
            (
                "src/lib.rs",
                "mod m;\nmod user;\npub use m::Y;\npub use std::fmt::Debug as D;\npub(crate) use m::inner as i;\n",
            ),
            ("src/m/mod.rs", "mod inner;\npub use self::inner::Y;\n"),
            ("src/m/inner.rs", "pub struct Y;\n"),
            (
                "src/user.rs",
                "use crate::Y;\nfn f(_: &dyn crate::D) {}\nfn g() -> crate::i::Y { crate::i::Y }\n",
            ),
        ],
    );
    let g = Graph::of_crate(c.path()).unwrap();
    let from_user: Vec<String> = edge_list(&g)
        .into_iter()
        .filter(|e| e.starts_with("src/user.rs"))
        .collect();
    assert_eq!(
        from_user,
        [
            // lib.rs, then m/mod.rs re-export it: inner.rs defines it.
            "src/user.rs:1 -> src/m/inner.rs crate::Y",
            // Another crate's item: lib.rs is what the path uses.
            "src/user.rs:2 -> src/lib.rs crate::D",
            // A module re-exported under another name.
            "src/user.rs:3 -> src/m/inner.rs crate::i::Y",
        ]
    );
}

#[test]
fn a_crate_without_circles_has_none() {
    let c = Crate::new(
        "none",
        &[
            ("src/lib.rs", "mod a;\nmod b;\nuse a::f;\n"),
            ("src/a.rs", "use super::b::g;\npub fn f() { g() }\n"),
            ("src/b.rs", "pub fn g() {}\n"),
        ],
    );
    let g = Graph::of_crate(c.path()).unwrap();
    assert_eq!(g.edges.len(), 2);
    assert!(g.circles(true).is_empty());
}
