//! The module paths a file writes: `crate::…`, `super::…`, `self::…` and
//! paths from a name (`child::…`, `std::…`), in `use` items and in code,
//! each with the module it is written in.

use crate::lex::{Tok, is_ident};

/// The module paths a path starting at `toks[i]` (after its base) names:
/// its segments, or each branch of a `{…}` group, recursively. Returns the
/// paths and the index after the path.
pub fn path_tail(toks: &[(Tok, usize)], i: usize, base: Vec<String>) -> (Vec<Vec<String>>, usize) {
    let (leaves, next) = tail(toks, i, base);
    (leaves.into_iter().map(|l| l.path).collect(), next)
}

/// One path of a `use` tree or of code.
#[derive(Clone, Debug)]
struct Leaf {
    path: Vec<String>,
    /// Ends in `::*`.
    glob: bool,
    /// `as name`.
    alias: Option<String>,
}

impl Leaf {
    fn new(path: Vec<String>) -> Leaf {
        Leaf {
            path,
            glob: false,
            alias: None,
        }
    }
}

fn tail(toks: &[(Tok, usize)], mut i: usize, base: Vec<String>) -> (Vec<Leaf>, usize) {
    let mut path = base;
    loop {
        if toks.get(i).map(|t| &t.0) != Some(&Tok::Path) {
            return (vec![Leaf::new(path)], i);
        }
        match toks.get(i + 1).map(|t| &t.0) {
            Some(Tok::Ident(w)) if w == "super" => {
                path.pop();
                i += 2;
            }
            Some(Tok::Ident(w)) if w == "self" => i += 2,
            Some(Tok::Ident(w)) => {
                path.push(w.clone());
                i += 2;
            }
            Some(Tok::Punct('{')) => {
                let mut all = Vec::new();
                i += 2;
                loop {
                    match toks.get(i).map(|t| &t.0) {
                        None => return (all, i),
                        Some(Tok::Punct('}')) => return (all, i + 1),
                        Some(Tok::Punct(',')) => i += 1,
                        Some(Tok::Ident(w)) if w == "self" => {
                            let mut leaf = Leaf::new(path.clone());
                            i += 1;
                            // `self as name`
                            if is_ident(toks.get(i), "as") {
                                leaf.alias = name_at(toks, i + 1);
                                i += 2;
                            }
                            all.push(leaf);
                        }
                        Some(Tok::Ident(w)) => {
                            let mut p = path.clone();
                            p.push(w.clone());
                            let (mut sub, next) = tail(toks, i + 1, p);
                            i = next;
                            // `as name`
                            if is_ident(toks.get(i), "as") {
                                if let Some(last) = sub.last_mut() {
                                    last.alias = name_at(toks, i + 1);
                                }
                                i += 2;
                            }
                            all.extend(sub);
                        }
                        Some(Tok::Punct('*')) => {
                            let mut leaf = Leaf::new(path.clone());
                            leaf.glob = true;
                            all.push(leaf);
                            i += 1;
                        }
                        Some(_) => i += 1,
                    }
                }
            }
            next => {
                let mut leaf = Leaf::new(path);
                leaf.glob = next == Some(&Tok::Punct('*'));
                // Past the `::`, and past the `*` of a glob.
                let past = i + 1 + usize::from(leaf.glob);
                return (vec![leaf], past);
            }
        }
    }
}

fn name_at(toks: &[(Tok, usize)], i: usize) -> Option<String> {
    match toks.get(i) {
        Some((Tok::Ident(w), _)) => Some(w.clone()),
        _ => None,
    }
}

/// A module path a file writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathUse {
    /// The word it starts with: `crate`, `super`, `self`, or a name.
    pub head: String,
    /// The line of that word.
    pub line: usize,
    /// The index of that word in the tokens.
    pub index: usize,
    /// The module it is written in: the file's module and the inline
    /// modules (`mod tests { … }`) around it.
    pub scope: Vec<String>,
    /// For `crate`, `super` and `self`, the path from the crate root
    /// (`super` and `self` resolved); for a name, the path as written.
    pub path: Vec<String>,
    /// Ends in `::*`.
    pub glob: bool,
    /// Written in a `use` item.
    pub in_use: bool,
    /// Written in a `pub use` (or `pub(…) use`) item: a re-export.
    pub reexport: bool,
    /// In a `use` item, the name it brings in (its last segment or its
    /// `as` name); `None` for a glob and in code.
    pub binds: Option<String>,
}

impl PathUse {
    /// Starts at `crate`, `super` or `self`.
    pub fn from_crate(&self) -> bool {
        matches!(self.head.as_str(), "crate" | "super" | "self")
    }
}

/// Every module path in the tokens of a file whose module is `file_mod`
/// (a path's `{…}` group gives one path for each branch).
pub fn paths(toks: &[(Tok, usize)], file_mod: &[String]) -> Vec<PathUse> {
    let mut out = Vec::new();
    // Inline modules (`mod tests { … }`) open at a brace.
    let mut braces: Vec<Option<String>> = Vec::new();
    let (mut in_use, mut reexport) = (false, false);
    let mut i = 0;
    while i < toks.len() {
        let here = |braces: &Vec<Option<String>>| {
            let mut m = file_mod.to_vec();
            m.extend(braces.iter().flatten().cloned());
            m
        };
        match &toks[i].0 {
            Tok::Punct('{') => {
                let inline = (i >= 2 && is_ident(toks.get(i - 2), "mod"))
                    .then(|| match &toks[i - 1].0 {
                        Tok::Ident(n) => Some(n.clone()),
                        _ => None,
                    })
                    .flatten();
                braces.push(inline);
                in_use = false;
                i += 1;
            }
            Tok::Punct('}') => {
                braces.pop();
                in_use = false;
                i += 1;
            }
            Tok::Punct(';') => {
                in_use = false;
                i += 1;
            }
            // Not `impl Trait + use<'a>`.
            Tok::Ident(w)
                if w == "use" && toks.get(i + 1).map(|t| &t.0) != Some(&Tok::Punct('<')) =>
            {
                in_use = true;
                reexport = is_pub(toks, i);
                i += 1;
            }
            Tok::Ident(w)
                if toks.get(i + 1).map(|t| &t.0) == Some(&Tok::Path)
                    && (i == 0 || toks[i - 1].0 != Tok::Path) =>
            {
                let scope = here(&braces);
                let base = match w.as_str() {
                    "crate" => Vec::new(),
                    "self" => scope.clone(),
                    "super" => {
                        let mut m = scope.clone();
                        m.pop();
                        m
                    }
                    name => vec![name.to_string()],
                };
                let line = toks[i].1;
                let (mut leaves, mut next) = tail(toks, i + 1, base);
                // `use a::b as c;`
                if in_use && is_ident(toks.get(next), "as") {
                    if let Some(last) = leaves.last_mut() {
                        last.alias = name_at(toks, next + 1);
                    }
                    next += 2;
                }
                for leaf in leaves {
                    let binds = (in_use && !leaf.glob)
                        .then(|| leaf.alias.clone().or_else(|| leaf.path.last().cloned()))
                        .flatten();
                    out.push(PathUse {
                        head: w.clone(),
                        line,
                        index: i,
                        scope: scope.clone(),
                        path: leaf.path,
                        glob: leaf.glob,
                        in_use,
                        reexport: in_use && reexport,
                        binds,
                    });
                }
                i = next.max(i + 1);
            }
            _ => i += 1,
        }
    }
    out
}

/// Whether the item whose keyword is at `i` is `pub` or `pub(…)`.
fn is_pub(toks: &[(Tok, usize)], i: usize) -> bool {
    let Some(mut k) = i.checked_sub(1) else {
        return false;
    };
    if toks[k].0 == Tok::Punct(')') {
        while k > 0 && toks[k].0 != Tok::Punct('(') {
            k -= 1;
        }
        let Some(before) = k.checked_sub(1) else {
            return false;
        };
        k = before;
    }
    is_ident(toks.get(k), "pub")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lex::{strip, tokens};

    fn seen(src: &str, file_mod: &[&str]) -> Vec<String> {
        let m: Vec<String> = file_mod.iter().map(|s| s.to_string()).collect();
        paths(&tokens(&strip(src)), &m)
            .into_iter()
            .map(|p| {
                let mut s = format!("{}@{} {}", p.head, p.line, p.path.join("::"));
                if p.glob {
                    s += "::*";
                }
                if let Some(b) = p.binds {
                    s += &format!(" as {b}");
                }
                s
            })
            .collect()
    }

    #[test]
    fn a_use_group_gives_each_branch() {
        assert_eq!(
            seen("use a::{b, c::{d}};", &[]),
            ["a@1 a::b as b", "a@1 a::c::d as d"]
        );
        assert_eq!(
            seen("use crate::m::{self as n, o::P as Q, r::*};", &["x"]),
            ["crate@1 m as n", "crate@1 m::o::P as Q", "crate@1 m::r::*"]
        );
    }

    #[test]
    fn super_and_self_are_resolved_from_the_file_module() {
        assert_eq!(
            seen(
                "use super::super::x;\nfn f() { self::y::z(); }",
                &["a", "b", "c"]
            ),
            ["super@1 a::x as x", "self@2 a::b::c::y::z"]
        );
        assert_eq!(seen("use super::*;", &["a", "b"]), ["super@1 a::*"]);
    }

    #[test]
    fn inline_modules_are_scopes() {
        let src =
            "mod tests {\n use super::Thing;\n mod deeper { use super::*; }\n}\nuse self::k as j;";
        assert_eq!(
            seen(src, &["m"]),
            [
                "super@2 m::Thing as Thing",
                "super@3 m::tests::*",
                "self@5 m::k as j"
            ]
        );
        let toks = tokens(&strip(src));
        let scopes: Vec<Vec<String>> = paths(&toks, &["m".into()])
            .into_iter()
            .map(|p| p.scope)
            .collect();
        assert_eq!(
            scopes,
            [
                vec!["m".to_string(), "tests".into()],
                vec!["m".into(), "tests".into(), "deeper".into()],
                vec!["m".into()],
            ]
        );
    }

    #[test]
    fn pub_use_is_a_reexport() {
        let src = "pub use a::b;\npub(crate) use c::d;\nuse e::f;\nfn g() { h::i(); }";
        let toks = tokens(&strip(src));
        let r: Vec<(String, bool)> = paths(&toks, &[])
            .into_iter()
            .map(|p| (p.head, p.reexport))
            .collect();
        assert_eq!(
            r,
            [
                ("a".to_string(), true),
                ("c".into(), true),
                ("e".into(), false),
                ("h".into(), false),
            ]
        );
    }

    #[test]
    fn code_paths_bind_nothing_and_comments_are_not_paths() {
        let src = "// crate::a\nfn f() -> impl Sized + use<> { crate::b::C::new(); Vec::<u8>::new(); \"crate::d\" }";
        assert_eq!(seen(src, &[]), ["crate@2 b::C::new", "Vec@2 Vec"]);
        let toks = tokens(&strip(src));
        assert!(paths(&toks, &[]).iter().all(|p| !p.in_use));
    }

    #[test]
    fn path_tail_keeps_the_segments() {
        let toks = tokens("::x::{y, z::w}");
        assert_eq!(
            path_tail(&toks, 0, vec!["crate".into()]),
            (
                vec![
                    vec!["crate".to_string(), "x".into(), "y".into()],
                    vec!["crate".into(), "x".into(), "z".into(), "w".into()],
                ],
                toks.len()
            )
        );
    }
}
