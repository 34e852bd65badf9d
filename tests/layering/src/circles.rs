//! Circles among a crate's files: strongly connected components of more
//! than one file, with the edges that make them.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::graph::{Graph, adjacency};
use crate::resolve::Edge;

/// Files that use each other, round and round.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Circle {
    /// Sorted.
    pub files: Vec<String>,
    /// The edges among them, sorted by file and line.
    pub edges: Vec<Edge>,
}

impl Graph {
    /// The circles among the files, largest first: by the edges of code
    /// the crate builds, and test code too if `tests`.
    pub fn circles(&self, tests: bool) -> Vec<Circle> {
        let adj = adjacency(self, tests);
        let mut out: Vec<Circle> = components(&adj)
            .into_iter()
            .filter(|c| c.len() > 1)
            .map(|files| {
                let edges = self
                    .edges
                    .iter()
                    .filter(|e| {
                        (tests || !e.test) && files.contains(&e.from) && files.contains(&e.to)
                    })
                    .cloned()
                    .collect();
                Circle {
                    files: files.into_iter().collect(),
                    edges,
                }
            })
            .collect();
        out.sort_by(|a, b| {
            b.files
                .len()
                .cmp(&a.files.len())
                .then(a.files.cmp(&b.files))
        });
        out
    }
}

/// Tarjan's strongly connected components.
fn components(adj: &BTreeMap<&str, BTreeSet<&str>>) -> Vec<BTreeSet<String>> {
    struct Walk<'a> {
        adj: &'a BTreeMap<&'a str, BTreeSet<&'a str>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<BTreeSet<String>>,
    }
    impl<'a> Walk<'a> {
        fn strong(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on.insert(v);
            for &w in self.adj.get(v).into_iter().flatten() {
                if !self.index.contains_key(w) {
                    self.strong(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if self.on.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut comp = BTreeSet::new();
                while let Some(w) = self.stack.pop() {
                    self.on.remove(w);
                    comp.insert(w.to_string());
                    if w == v {
                        break;
                    }
                }
                self.out.push(comp);
            }
        }
    }
    let mut walk = Walk {
        adj,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for &v in adj.keys() {
        if !walk.index.contains_key(v) {
            walk.strong(v);
        }
    }
    walk.out
}

/// `a circle of 2 files: src/a.rs, src/b.rs` and then each file's uses of
/// the others, one line per pair: `src/a.rs:3,9 -> src/b.rs (crate::b::X, crate::b::f)`.
impl fmt::Display for Circle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "a circle of {} files: {}",
            self.files.len(),
            self.files.join(", ")
        )?;
        // From and to: the lines and the paths.
        type Pairs<'a> = BTreeMap<(&'a str, &'a str), (BTreeSet<usize>, BTreeSet<&'a str>)>;
        let mut pairs = Pairs::new();
        for e in &self.edges {
            let (lines, paths) = pairs.entry((&e.from, &e.to)).or_default();
            lines.insert(e.line);
            paths.insert(&e.path);
        }
        for ((from, to), (lines, paths)) in pairs {
            let lines: Vec<String> = lines.iter().map(usize::to_string).collect();
            let paths: Vec<&str> = paths.into_iter().collect();
            write!(
                f,
                "\n  {from}:{} -> {to} ({})",
                lines.join(","),
                paths.join(", ")
            )?;
        }
        Ok(())
    }
}
