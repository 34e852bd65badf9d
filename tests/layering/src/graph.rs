//! A crate's import graph at file granularity: which file uses which, by
//! the modules its paths name.
//!
//! A path goes to the file that defines the deepest module along it
//! (`crate::a::b::Item` to `a/b.rs`, or to `a.rs` if `a` has no file
//! `b`), and through a `pub use` of the crate's own item on to the file
//! that defines it ([`Reexports`]); an item re-exported from another crate
//! (`lib.rs`'s `pub use other::Item`) is a use of the re-exporting file;
//! `super::*` is a use of the parent; a `mod x;` declaration is no edge.
//! Paths are `crate::…`, `super::…`, `self::…`, a child module's name
//! (`child::…`), and a module brought in by `use` (`use crate::a; a::f()`).
//! Names a glob brings in (`use super::*; sibling::f()`) are not followed.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};

use crate::files::{module_of, rs_files};
use crate::resolve::{Edge, Reexports, edges};
use crate::source::{File, Modules, Target, declared, load};

/// A crate's files and the uses among them.
#[derive(Debug)]
pub struct Graph {
    /// The crate's directory (where `src/` is).
    pub dir: PathBuf,
    /// Sorted by path.
    pub files: Vec<File>,
    /// Sorted by file and line.
    pub edges: Vec<Edge>,
}

impl Graph {
    /// Reads `dir/src`, following re-exports ([`Reexports::Follow`]).
    pub fn of_crate(dir: &Path) -> std::io::Result<Graph> {
        Graph::read(dir, Reexports::Follow)
    }

    /// Reads `dir/src`: the files `lib.rs` and `main.rs` reach, any other
    /// `.rs` file there, and the uses among them.
    pub fn read(dir: &Path, reexports: Reexports) -> std::io::Result<Graph> {
        let src = dir.join("src");
        let mut files: Vec<File> = Vec::new();
        let mut modules = Modules::new();
        let mut queue = VecDeque::new();
        for (root, target) in [("lib.rs", Target::Lib), ("main.rs", Target::Bin)] {
            if src.join(root).is_file() {
                queue.push_back((src.join(root), target, Vec::new(), false));
            }
        }
        while let Some((path, target, module, test)) = queue.pop_front() {
            if let Some(at) = files.iter().position(|f| f.path == path) {
                modules.insert((target, module), at);
                continue;
            }
            let at = files.len();
            let file = load(dir, path, target, module, test, true)?;
            for (child, module, test) in declared(&file, &mut modules, at) {
                queue.push_back((child, target, module, test));
            }
            modules.insert((target, file.module.clone()), at);
            files.push(file);
        }
        for path in rs_files(&src)? {
            if !files.iter().any(|f| f.path == path) {
                let module = module_of(&src, &path);
                modules
                    .entry((Target::Lib, module.clone()))
                    .or_insert(files.len());
                files.push(load(dir, path, Target::Lib, module, false, false)?);
            }
        }
        let mut edges = edges(&files, &modules, reexports);
        edges.sort();
        edges.dedup();
        files.sort_by(|a, b| a.rel.cmp(&b.rel));
        Ok(Graph {
            dir: dir.to_path_buf(),
            files,
            edges,
        })
    }

    /// The file at a path from the crate's directory.
    pub fn file(&self, rel: &str) -> Option<&File> {
        self.files.iter().find(|f| f.rel == rel)
    }
}

/// The files each file uses, by non-test edges only unless `tests`.
pub fn adjacency(graph: &Graph, tests: bool) -> BTreeMap<&str, BTreeSet<&str>> {
    let mut out: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for f in &graph.files {
        out.entry(f.rel.as_str()).or_default();
    }
    for e in graph.edges.iter().filter(|e| tests || !e.test) {
        out.entry(e.from.as_str())
            .or_default()
            .insert(e.to.as_str());
    }
    out
}
