//! The host fixture trees under tests/fixtures/hosts are what
//! `NodeDescription::materialize` writes for the built-in descriptions.
//! If this fails after a change to materialize or a description, regenerate
//! them (the command is in tests/fixtures/hosts/README.md).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

#[derive(Debug, PartialEq)]
enum Entry {
    Dir,
    File(Vec<u8>),
    Link(PathBuf),
}

fn walk(root: &Path) -> BTreeMap<PathBuf, Entry> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let path = e.path();
            let rel = path.strip_prefix(root).unwrap().to_path_buf();
            let ft = e.file_type().unwrap();
            if ft.is_symlink() {
                out.insert(rel, Entry::Link(fs::read_link(&path).unwrap()));
            } else if ft.is_dir() {
                out.insert(rel, Entry::Dir);
                stack.push(path);
            } else {
                out.insert(rel, Entry::File(fs::read(&path).unwrap()));
            }
        }
    }
    out
}

#[test]
fn committed_host_fixtures_match_the_descriptions() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hosts");
    for name in ["h100-sxm-8", "a10g-1", "no-gpu"] {
        let fresh = tempfile::tempdir().unwrap();
        simnode::NodeDescription::load(name)
            .unwrap()
            .materialize(fresh.path())
            .unwrap();
        let committed = walk(&fixtures.join(name));
        let expected = walk(fresh.path());
        assert!(!committed.is_empty(), "{name}: fixture tree missing");
        assert_eq!(
            committed, expected,
            "{name}: fixture tree differs from a fresh materialize"
        );
    }
}
