//! Entry paths as a bundle gives them (the manifest first): plain relative paths only, `.`
//! components dropped, symbolic links that stay inside the tree.

use std::path::{Component, Path};

/// The manifest's name inside a bundle; it must be the first entry.
pub const MANIFEST: &str = "gpu-agent-bundle.json";

/// `Ok(())` when `p` is a plain relative path with no `..`, else why not.
pub(super) fn relative(p: &Path) -> Result<(), String> {
    if p.as_os_str().is_empty() {
        return Err("empty path".into());
    }
    for c in p.components() {
        match c {
            Component::Normal(_) | Component::CurDir => {}
            Component::ParentDir => return Err("path climbs out with `..`".into()),
            Component::RootDir | Component::Prefix(_) => {
                return Err("absolute path".into());
            }
        }
    }
    Ok(())
}

/// `p` without `.` components, as a string (`./a/./b` → `a/b`).
pub(super) fn clean(p: &Path) -> String {
    p.components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n.to_string_lossy().into_owned()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("/")
}

/// True when a link at `link` (a clean relative path) with `target` stays
/// inside the tree.
pub(super) fn link_stays_inside(link: &str, target: &Path) -> bool {
    if target.is_absolute() {
        return false;
    }
    let mut depth: i64 = link.split('/').count() as i64 - 1;
    for c in target.components() {
        match c {
            Component::ParentDir => depth -= 1,
            Component::Normal(_) => depth += 1,
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => return false,
        }
        if depth < 0 {
            return false;
        }
    }
    true
}
