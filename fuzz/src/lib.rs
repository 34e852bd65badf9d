//! What the fuzz targets share: a throwaway host root, and the key paths
//! of TOML and JSON documents (for "the patched file keeps every key of
//! the input").

use std::collections::BTreeSet;
use std::path::Path;

use hostlib::HostRoot;

/// The fuzz input as text, or `None` when it is not UTF-8 (the parsers all
/// take `&str`; files are read as UTF-8 before they get there).
pub fn text(data: &[u8]) -> Option<&str> {
    std::str::from_utf8(data).ok()
}

/// A host root in a new temporary directory, removed when dropped.
pub struct Host {
    pub dir: tempfile::TempDir,
    pub root: HostRoot,
}

impl Host {
    pub fn new() -> Host {
        let dir = tempfile::Builder::new()
            .prefix("gpu-agent-fuzz")
            .tempdir()
            .expect("a temporary directory");
        let root = HostRoot::new(dir.path()).expect("a host root");
        Host { dir, root }
    }

    /// Writes `text` at the host path `path` (made with its parents).
    pub fn put(&self, path: &str, text: &str) {
        let real = self.dir.path().join(path.trim_start_matches('/'));
        std::fs::create_dir_all(real.parent().expect("a parent")).expect("mkdir");
        std::fs::write(real, text).expect("write");
    }
}

impl Default for Host {
    fn default() -> Self {
        Host::new()
    }
}

/// Every file under `dir` (relative paths), following no links.
pub fn files_under(dir: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(p.clone());
            }
            out.insert(
                p.strip_prefix(dir)
                    .expect("under dir")
                    .display()
                    .to_string(),
            );
        }
    }
    out
}

/// Total bytes of the regular files under `dir`.
pub fn bytes_under(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(e.path()),
                Ok(t) if t.is_file() => total += e.metadata().map_or(0, |m| m.len()),
                _ => {}
            }
        }
    }
    total
}

/// A key path: the keys from the document's root, array elements by index.
pub type KeyPath = Vec<String>;

/// Every key path of a TOML document (tables, inline tables, arrays of
/// tables, arrays).
pub fn toml_keys(doc: &toml_edit::Table) -> BTreeSet<KeyPath> {
    let mut out = BTreeSet::new();
    walk_toml_table(doc, &mut Vec::new(), &mut out);
    out
}

fn walk_toml_table(t: &dyn toml_edit::TableLike, at: &mut KeyPath, out: &mut BTreeSet<KeyPath>) {
    for (k, item) in t.iter() {
        at.push(k.to_string());
        out.insert(at.clone());
        walk_toml_item(item, at, out);
        at.pop();
    }
}

fn walk_toml_item(item: &toml_edit::Item, at: &mut KeyPath, out: &mut BTreeSet<KeyPath>) {
    match item {
        toml_edit::Item::Table(t) => walk_toml_table(t, at, out),
        toml_edit::Item::ArrayOfTables(a) => {
            for (i, t) in a.iter().enumerate() {
                at.push(format!("[{i}]"));
                out.insert(at.clone());
                walk_toml_table(t, at, out);
                at.pop();
            }
        }
        toml_edit::Item::Value(v) => walk_toml_value(v, at, out),
        toml_edit::Item::None => {}
    }
}

fn walk_toml_value(v: &toml_edit::Value, at: &mut KeyPath, out: &mut BTreeSet<KeyPath>) {
    match v {
        toml_edit::Value::InlineTable(t) => walk_toml_table(t, at, out),
        toml_edit::Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                at.push(format!("[{i}]"));
                out.insert(at.clone());
                walk_toml_value(v, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

/// Every key path of a JSON value.
pub fn json_keys(v: &serde_json::Value) -> BTreeSet<KeyPath> {
    let mut out = BTreeSet::new();
    walk_json(v, &mut Vec::new(), &mut out);
    out
}

fn walk_json(v: &serde_json::Value, at: &mut KeyPath, out: &mut BTreeSet<KeyPath>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                at.push(k.clone());
                out.insert(at.clone());
                walk_json(v, at, out);
                at.pop();
            }
        }
        serde_json::Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                at.push(format!("[{i}]"));
                out.insert(at.clone());
                walk_json(v, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

/// True when `path` starts with `prefix`.
pub fn under(path: &[String], prefix: &[&str]) -> bool {
    path.len() >= prefix.len() && path.iter().zip(prefix).all(|(a, b)| a == b)
}
