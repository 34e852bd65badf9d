//! A crate's source files: which crate of the package each belongs to, its
//! module, whether it is a test module's file, its lines, and the table of
//! module paths to files (inline modules included).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::lex::{Tok, is_ident, strip, tokens};
use crate::lines::{cfg_test_items, code_lines};

/// Which crate of the package a file belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    /// `src/lib.rs` and its modules.
    Lib,
    /// `src/main.rs` and its modules.
    Bin,
}

/// A source file of the crate.
#[derive(Debug)]
pub struct File {
    /// Its path from the crate's directory (`src/a/b.rs`).
    pub rel: String,
    pub path: PathBuf,
    pub target: Target,
    /// Its module path (`["a", "b"]`; the root is empty).
    pub module: Vec<String>,
    /// A test module's file (`#[cfg(test)] mod tests;`), or one below it.
    pub test: bool,
    /// Reached by `mod` declarations from `lib.rs` or `main.rs` (a file
    /// that is not is placed by where it is, in the library).
    pub reached: bool,
    /// All its lines.
    pub lines: usize,
    /// Its lines of code ([`code_lines`]).
    pub code_lines: usize,
    /// The names of the items it defines (`fn`, `struct`, `enum`, `trait`,
    /// `const`, `static`, `type`, `union`, `macro_rules!`), at any depth.
    pub items: BTreeSet<String>,
    pub toks: Vec<(Tok, usize)>,
}

/// Module paths, per crate of the package, to the index of their file.
pub type Modules = BTreeMap<(Target, Vec<String>), usize>;

/// Reads a file.
pub fn load(
    dir: &Path,
    path: PathBuf,
    target: Target,
    module: Vec<String>,
    test: bool,
    reached: bool,
) -> std::io::Result<File> {
    let text = std::fs::read_to_string(&path)?;
    let rel = path
        .strip_prefix(dir)
        .unwrap_or(&path)
        .to_string_lossy()
        .into_owned();
    let toks = tokens(&strip(&text));
    let items = toks
        .windows(2)
        .filter_map(|w| match (&w[0].0, &w[1].0) {
            (Tok::Ident(k), Tok::Ident(name))
                if matches!(
                    k.as_str(),
                    "fn" | "struct" | "enum" | "trait" | "const" | "static" | "type" | "union"
                ) =>
            {
                Some(name.clone())
            }
            _ => None,
        })
        .chain(
            toks.windows(3)
                .filter_map(|w| match (&w[0].0, &w[1].0, &w[2].0) {
                    (Tok::Ident(k), Tok::Punct('!'), Tok::Ident(name)) if k == "macro_rules" => {
                        Some(name.clone())
                    }
                    _ => None,
                }),
        )
        .collect();
    Ok(File {
        rel,
        target,
        module,
        test,
        reached,
        lines: text.lines().count(),
        code_lines: code_lines(&text),
        items,
        toks,
        path,
    })
}

/// The files a file's `mod x;` declarations name, with their modules and
/// whether they are tests; its inline modules go into `modules` as `at`.
pub fn declared(
    file: &File,
    modules: &mut Modules,
    at: usize,
) -> Vec<(PathBuf, Vec<String>, bool)> {
    let toks = &file.toks;
    let name = file.path.file_name().unwrap_or_default().to_string_lossy();
    let parent = file.path.parent().unwrap_or(Path::new(""));
    // Where its children's files are.
    let dir = match name.as_ref() {
        "lib.rs" | "main.rs" | "mod.rs" => parent.to_path_buf(),
        other => parent.join(other.trim_end_matches(".rs")),
    };
    let tests = cfg_test_items(toks);
    let mut out = Vec::new();
    let mut braces: Vec<Option<String>> = Vec::new();
    for i in 0..toks.len() {
        let inline: Vec<String> = braces.iter().flatten().cloned().collect();
        match &toks[i].0 {
            Tok::Punct('{') => {
                let name = (i >= 2 && is_ident(toks.get(i - 2), "mod"))
                    .then(|| match &toks[i - 1].0 {
                        Tok::Ident(n) => Some(n.clone()),
                        _ => None,
                    })
                    .flatten();
                if let Some(n) = &name {
                    let mut m = file.module.clone();
                    m.extend(inline.iter().cloned());
                    m.push(n.clone());
                    modules.insert((file.target, m), at);
                }
                braces.push(name);
            }
            Tok::Punct('}') => {
                braces.pop();
            }
            Tok::Ident(w)
                if w == "mod" && toks.get(i + 2).map(|t| &t.0) == Some(&Tok::Punct(';')) =>
            {
                let Some((Tok::Ident(n), _)) = toks.get(i + 1) else {
                    continue;
                };
                let mut here = dir.clone();
                here.extend(inline.iter());
                let path = [here.join(format!("{n}.rs")), here.join(n).join("mod.rs")]
                    .into_iter()
                    .find(|p| p.is_file());
                let Some(path) = path else { continue };
                let mut m = file.module.clone();
                m.extend(inline.iter().cloned());
                m.push(n.clone());
                let test = file.test || tests.iter().any(|(a, b)| (*a..=*b).contains(&i));
                out.push((path, m, test));
            }
            _ => {}
        }
    }
    out
}
