//! From the paths a file writes to the files they use: a path goes to the
//! file of the deepest module along it, and on through the `pub use`
//! re-exports of the crate's own items to the file that defines the item.

use std::collections::{BTreeMap, BTreeSet};

use crate::paths::{PathUse, paths};
use crate::source::{File, Modules, Target};

/// One use of a file by another.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Edge {
    /// The using file (`src/a.rs`).
    pub from: String,
    /// The line of the path in it.
    pub line: usize,
    /// The used file.
    pub to: String,
    /// The path as written, from the crate root (`crate::b::Item`,
    /// `crate::*`).
    pub path: String,
    /// In test code: a `#[cfg(test)]` item, or a test module's file.
    pub test: bool,
}

/// What a path through a `pub use` of the crate's own item uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reexports {
    /// The file that defines the item, as `imports.py` has it: a file that
    /// re-exports its children's items is no use of theirs.
    Follow,
    /// The file of the module the path names (`crate::Item` is `lib.rs`).
    Stop,
}

/// Names in a module: module path to name to path from the crate root.
type Names = BTreeMap<Vec<String>, BTreeMap<String, Vec<String>>>;

/// The uses among the files.
pub fn edges(files: &[File], modules: &Modules, reexports: Reexports) -> Vec<Edge> {
    let all: Vec<Vec<PathUse>> = files.iter().map(|f| paths(&f.toks, &f.module)).collect();
    // Modules brought in by `use`, per file; re-exports, per crate.
    let mut aliases: Vec<Names> = Vec::new();
    let mut reexported: BTreeMap<Target, Names> = BTreeMap::new();
    for (file, uses) in files.iter().zip(&all) {
        let mut names = Names::new();
        for p in uses.iter().filter(|p| p.in_use) {
            let (Some(name), Some(abs)) = (&p.binds, absolute(modules, file.target, p, &names))
            else {
                continue;
            };
            if p.reexport {
                reexported
                    .entry(file.target)
                    .or_default()
                    .entry(p.scope.clone())
                    .or_default()
                    .insert(name.clone(), abs.clone());
            }
            if modules.contains_key(&(file.target, abs.clone())) {
                names
                    .entry(p.scope.clone())
                    .or_default()
                    .insert(name.clone(), abs);
            }
        }
        aliases.push(names);
    }
    let none = Names::new();
    let mut out = Vec::new();
    for (at, file) in files.iter().enumerate() {
        let tests = crate::lines::cfg_test_items(&file.toks);
        let reexported = match reexports {
            Reexports::Follow => reexported.get(&file.target).unwrap_or(&none),
            Reexports::Stop => &none,
        };
        for p in &all[at] {
            let Some(abs) = absolute(modules, file.target, p, &aliases[at]) else {
                continue;
            };
            let Some(to) = land(files, modules, reexported, file.target, abs.clone()) else {
                continue;
            };
            if to == at {
                continue;
            }
            let mut path = String::from("crate");
            for s in &abs {
                path += "::";
                path += s;
            }
            if p.glob {
                path += "::*";
            }
            out.push(Edge {
                from: file.rel.clone(),
                line: p.line,
                to: files[to].rel.clone(),
                path,
                test: file.test || tests.iter().any(|(a, b)| (*a..=*b).contains(&p.index)),
            });
        }
    }
    out
}

/// A path from the crate root, if it is one of the crate's: from `crate`,
/// `super` or `self`, from a child module's name, or from a module that a
/// `use` brought in.
fn absolute(
    modules: &Modules,
    target: Target,
    p: &PathUse,
    aliases: &Names,
) -> Option<Vec<String>> {
    if p.from_crate() {
        return Some(p.path.clone());
    }
    let head = p.path.first()?;
    let mut child = p.scope.clone();
    child.push(head.clone());
    if modules.contains_key(&(target, child)) {
        let mut abs = p.scope.clone();
        abs.extend(p.path.iter().cloned());
        return Some(abs);
    }
    let mut abs = aliases.get(&p.scope)?.get(head)?.clone();
    abs.extend(p.path.iter().skip(1).cloned());
    Some(abs)
}

/// The file a path from the crate root uses.
fn land(
    files: &[File],
    modules: &Modules,
    reexported: &Names,
    target: Target,
    mut abs: Vec<String>,
) -> Option<usize> {
    let mut seen = BTreeSet::new();
    loop {
        let (k, &at) = (0..=abs.len())
            .rev()
            .find_map(|k| modules.get(&(target, abs[..k].to_vec())).map(|at| (k, at)))?;
        let Some(item) = abs.get(k) else {
            return Some(at);
        };
        if files[at].items.contains(item) {
            return Some(at);
        }
        let Some(to) = reexported.get(&abs[..k]).and_then(|names| names.get(item)) else {
            return Some(at);
        };
        if !seen.insert(abs[..=k].to_vec()) {
            return Some(at);
        }
        let mut next = to.clone();
        next.extend(abs[k + 1..].iter().cloned());
        abs = next;
    }
}
