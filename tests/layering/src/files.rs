//! The `.rs` files under a directory, and the module path a file has by
//! where it is.

use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, sorted.
pub fn rs_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    files.sort();
    Ok(files)
}

/// The module path of a file under `src`: `lib.rs` (and `main.rs`) is the
/// root, `a.rs` and `a/mod.rs` are `a`, `a/b.rs` is `a::b`.
pub fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap_or(file);
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let Some(last) = parts.pop() else {
        return parts;
    };
    match last.as_str() {
        "mod.rs" => {}
        "lib.rs" | "main.rs" if parts.is_empty() => {}
        other => parts.push(other.trim_end_matches(".rs").to_string()),
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(file: &str) -> Vec<String> {
        module_of(Path::new("/c/src"), &Path::new("/c/src").join(file))
    }

    #[test]
    fn where_a_file_is_gives_its_module() {
        assert!(m("lib.rs").is_empty());
        assert!(m("main.rs").is_empty());
        assert_eq!(m("a.rs"), ["a"]);
        assert_eq!(m("a/mod.rs"), ["a"]);
        assert_eq!(m("a/b.rs"), ["a", "b"]);
        assert_eq!(m("a/lib.rs"), ["a", "lib"]);
    }

    #[test]
    fn rs_files_walks_down() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let files = rs_files(&src).unwrap();
        assert!(files.contains(&src.join("lib.rs")));
        assert!(files.contains(&src.join("files.rs")));
        assert!(files.windows(2).all(|w| w[0] < w[1]));
    }
}
