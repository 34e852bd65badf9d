//! The controller's modules are in layers (`docs/architecture.md`,
//! "Controller"): a module uses only the layers its own layer may use, the
//! workers never use each other, and nothing uses the crate root (the
//! wiring, `lib.rs`). This test reads `controller/src`, finds every path
//! that names a module of the crate (`crate::…`, `super::…`, `self::…`, in
//! `use` items and in code, test code included; comments and strings are
//! left out) and fails on an edge the table below does not allow, on a
//! circle among modules, on a module the table does not place, on an API
//! call or a task in the model, and on a source file with more than
//! [`MAX_LINES`] lines of code besides its tests.
//!
//! A new module goes into [`LAYERS`] (and into the drawing in
//! `docs/architecture.md`). A module inside another one (`fleet/view.rs`)
//! belongs to its parent's unit unless the table names it (`model::node`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use layering::{Tok, module_of, path_tail, paths, rs_files, strip, test_lines, tokens};

struct Layer {
    name: &'static str,
    /// The units in it: a top-level module (`fleet`), a module of the
    /// model (`model::node`), or `crate` (the root, `lib.rs`).
    units: &'static [&'static str],
    /// The layers its units may use.
    uses: &'static [&'static str],
    /// Whether its units may use each other (never in a circle).
    siblings: bool,
}

/// Bottom to top.
const LAYERS: &[Layer] = &[
    Layer {
        name: "error",
        units: &["error"],
        uses: &[],
        siblings: false,
    },
    Layer {
        name: "model",
        units: &[
            "model",
            "model::dra",
            "model::node",
            "model::node_event",
            "model::policy_summary",
            "model::policy_texts",
            "model::upgrade_notes",
            "model::upgrade_plan",
            "model::upgrade_policy",
            "model::upgrade_state",
        ],
        uses: &["error"],
        siblings: true,
    },
    Layer {
        name: "fleet",
        units: &["fleet"],
        uses: &["model", "error"],
        siblings: false,
    },
    // Beside the fleet: they know nothing of it.
    Layer {
        name: "access",
        units: &["auth", "lease", "shards", "tls"],
        uses: &["model", "error"],
        siblings: false,
    },
    Layer {
        name: "workers",
        units: &[
            "cluster_policy",
            "config_maps",
            "dra_claims",
            "dra_slices",
            "drift",
            "events",
            "mig_label",
            "page",
            "server",
            "uninstall",
            "upgrade",
            "writer",
        ],
        uses: &["fleet", "access", "model", "error"],
        siblings: false,
    },
    Layer {
        name: "wiring",
        units: &["crate"],
        uses: &["workers", "fleet", "access", "model", "error"],
        siblings: false,
    },
];

/// Lines of code a source file may have, its `#[cfg(test)]` modules not
/// counted.
const MAX_LINES: usize = 800;

/// Words that mean I/O or a task: not in the model.
const NOT_IN_MODEL: &[&str] = &["async", "await", "tokio", "kube", "hyper", "tonic"];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn layer_of(unit: &str) -> Option<&'static Layer> {
    LAYERS.iter().find(|l| l.units.contains(&unit))
}

// ---------------------------------------------------------------------------
// Reading Rust, as far as module paths go: the `layering` crate
// (tests/layering) strips, tokenizes and finds the paths; the units are
// this table's.

/// The unit a module path belongs to: `a::b` if the table names it, else
/// `a` if it is a module, else `crate` (an item of the root).
fn unit_of(path: &[String], modules: &BTreeSet<String>) -> String {
    if path.len() >= 2 {
        let two = format!("{}::{}", path[0], path[1]);
        if layer_of(&two).is_some() {
            return two;
        }
    }
    match path.first() {
        Some(first) if modules.contains(first) => first.clone(),
        _ => "crate".into(),
    }
}

struct Edge {
    from: String,
    to: String,
    file: String,
    line: usize,
    path: String,
}

struct Source {
    file: PathBuf,
    rel: String,
    unit: String,
    toks: Vec<(Tok, usize)>,
    lines: usize,
    test_lines: usize,
}

fn sources() -> (Vec<Source>, BTreeSet<String>) {
    let mut files = rs_files(&src()).unwrap();
    // The binary is a crate of its own, over the library's public API.
    files.retain(|f| f != &src().join("main.rs"));
    let modules: BTreeSet<String> = files
        .iter()
        .filter_map(|f| module_of(&src(), f).first().cloned())
        .collect();
    let out = files
        .into_iter()
        .map(|file| {
            let text = std::fs::read_to_string(&file).unwrap();
            let toks = tokens(&strip(&text));
            let test_lines = test_lines(&toks);
            Source {
                rel: file.strip_prefix(src()).unwrap().display().to_string(),
                unit: unit_of(&module_of(&src(), &file), &modules),
                lines: text.lines().count(),
                test_lines,
                toks,
                file,
            }
        })
        .collect();
    (out, modules)
}

fn edges(sources: &[Source], modules: &BTreeSet<String>) -> Vec<Edge> {
    let mut out = Vec::new();
    for s in sources {
        for p in paths(&s.toks, &module_of(&src(), &s.file)) {
            if !p.from_crate() {
                continue;
            }
            let to = unit_of(&p.path, modules);
            if to != s.unit {
                out.push(Edge {
                    from: s.unit.clone(),
                    to,
                    file: s.rel.clone(),
                    line: p.line,
                    path: format!("{}::… ({})", p.head, p.path.join("::")),
                });
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------

#[test]
fn every_module_is_in_a_layer_and_every_layer_is_there() {
    let (sources, _) = sources();
    let found: BTreeSet<&str> = sources.iter().map(|s| s.unit.as_str()).collect();
    let missing: Vec<&&str> = found.iter().filter(|u| layer_of(u).is_none()).collect();
    assert!(
        missing.is_empty(),
        "modules in no layer of controller/tests/layers.rs: {missing:?}; place each in LAYERS (and in docs/architecture.md)"
    );
    let gone: Vec<&str> = LAYERS
        .iter()
        .flat_map(|l| l.units.iter().copied())
        .filter(|u| !found.contains(u))
        .collect();
    assert!(
        gone.is_empty(),
        "LAYERS names modules that are not in controller/src: {gone:?}"
    );
    for l in LAYERS {
        for u in l.uses {
            assert!(
                LAYERS.iter().any(|o| o.name == *u),
                "layer {} uses an unknown layer {u}",
                l.name
            );
        }
    }
}

#[test]
fn no_module_uses_a_layer_it_may_not() {
    let (sources, modules) = sources();
    let mut bad = Vec::new();
    for e in edges(&sources, &modules) {
        let (Some(from), Some(to)) = (layer_of(&e.from), layer_of(&e.to)) else {
            continue;
        };
        let ok = if from.name == to.name {
            from.siblings
        } else {
            from.uses.contains(&to.name)
        };
        if !ok {
            bad.push(format!(
                "{}:{}: {} [{}] uses {} [{}] by {}",
                e.file, e.line, e.from, from.name, e.to, to.name, e.path
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "edges against the layers (docs/architecture.md, Controller): move what is shared down, or pass it in from lib.rs:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_modules_form_no_circle() {
    let (sources, modules) = sources();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for e in edges(&sources, &modules) {
        graph.entry(e.from).or_default().insert(e.to);
    }
    // Depth first; a node met again while on the stack closes a circle.
    fn visit(
        n: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        stack: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = stack.iter().position(|s| s == n) {
            let mut circle = stack[at..].to_vec();
            circle.push(n.to_string());
            return Some(circle);
        }
        if done.contains(n) {
            return None;
        }
        stack.push(n.to_string());
        for m in graph.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, graph, stack, done) {
                return Some(c);
            }
        }
        stack.pop();
        done.insert(n.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for n in graph.keys() {
        if let Some(c) = visit(n, &graph, &mut Vec::new(), &mut done) {
            panic!("the modules form a circle: {}", c.join(" -> "));
        }
    }
}

#[test]
fn the_model_makes_no_api_call_and_runs_no_task() {
    let (sources, _) = sources();
    let mut bad = Vec::new();
    for s in sources
        .iter()
        .filter(|s| layer_of(&s.unit).is_some_and(|l| l.name == "model"))
    {
        for (t, line) in &s.toks {
            if let Tok::Ident(w) = t
                && NOT_IN_MODEL.contains(&w.as_str())
            {
                bad.push(format!("{}:{line}: {w}", s.rel));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "the model is plain data and pure functions; API calls and tasks go in a worker:\n{}",
        bad.join("\n")
    );
}

#[test]
fn no_source_file_is_over_the_size_of_one_concern() {
    let (sources, _) = sources();
    let big: Vec<String> = sources
        .iter()
        .filter(|s| s.lines - s.test_lines > MAX_LINES)
        .map(|s| {
            format!(
                "{}: {} lines besides its tests",
                s.rel,
                s.lines - s.test_lines
            )
        })
        .collect();
    assert!(
        big.is_empty(),
        "source files over {MAX_LINES} lines of code: split them by concern:\n{}",
        big.join("\n")
    );
}

/// The reader itself: the forms of path the controller uses are seen.
#[test]
fn the_reader_sees_every_form_of_path() {
    let text = r#"
        use crate::model::{node::{self, Desired}, upgrade_state::Step as S};
        use super::Fleet;
        // crate::writer in a comment is not an edge
        const X: &str = "crate::drift in a string is not either";
        fn f() { crate::events::run(); let c = '{'; }
        #[cfg(test)]
        mod tests {
            use super::*;
            use crate::server;
        }
    "#;
    let toks = tokens(&strip(text));
    let mut seen = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        if let Tok::Ident(w) = &toks[i].0
            && (w == "crate" || w == "super")
            && toks.get(i + 1).map(|t| &t.0) == Some(&Tok::Path)
        {
            let (paths, next) = path_tail(&toks, i + 1, vec![w.clone()]);
            seen.extend(paths.into_iter().map(|p| p.join("::")));
            i = next;
        } else {
            i += 1;
        }
    }
    assert_eq!(
        seen,
        [
            "crate::model::node",
            "crate::model::node::Desired",
            "crate::model::upgrade_state::Step",
            "super::Fleet",
            "crate::events::run",
            "super",
            "crate::server",
        ]
        .map(String::from)
    );
    // `super::*`: the `*` is punctuation, the path ends before it.
    assert_eq!(test_lines(&toks), 5);
}
