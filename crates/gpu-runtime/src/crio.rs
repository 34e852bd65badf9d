//! CRI-O: a drop-in `/etc/crio/crio.conf.d/99-nvidia.conf` with only our
//! tables (CRI-O merges drop-ins key by key, later files winning), so the
//! user's `crio.conf` is never touched. It is read, though: to refuse one
//! CRI-O could not parse (naming file and line) before writing anything, and
//! to copy the default runtime's settings (`monitor_path`, `runtime_root`,
//! …) into ours, so the `nvidia` runtime behaves like the one it wraps.

use hostlib::HostRoot;
use toml_edit::{DocumentMut, Item, Table, value};

use crate::change::FileChange;
use crate::error::RuntimeError;

/// What to configure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// The drop-in to write, `/etc/crio/crio.conf.d/99-nvidia.conf`.
    pub drop_in: String,
    /// CRI-O's main config, `/etc/crio/crio.conf` (may be missing).
    pub config: String,
    pub runtime_name: String,
    /// The runtime binary: the host's `nvidia-container-runtime`.
    pub runtime_path: Option<String>,
    pub set_as_default: bool,
}

/// Plans the drop-in.
pub fn plan(host: &HostRoot, opts: &Options) -> Result<Vec<FileChange>, RuntimeError> {
    let text = host
        .read_optional(&opts.config)
        .map_err(RuntimeError::Host)?
        .unwrap_or_default();
    let conf = super::containerd::parse_toml(&opts.config, &text)?;
    let base = base_runtime(&opts.config, &text, &conf, &opts.runtime_name)?;
    let Some(path) = &opts.runtime_path else {
        // CRI-O injects CDI devices natively (since 1.23); with no NVIDIA
        // runtime there is nothing to add.
        return Ok(Vec::new());
    };
    let mut doc = DocumentMut::new();
    doc.as_table_mut()
        .decor_mut()
        .set_prefix("# Written by gpu-agent; `gpu-agent runtime restore` removes it.\n");
    let mut crio = Table::new();
    crio.set_implicit(true);
    let mut rt = Table::new();
    rt.set_implicit(!opts.set_as_default);
    if opts.set_as_default {
        rt.insert("default_runtime", value(opts.runtime_name.as_str()));
    }
    let mut runtimes = Table::new();
    runtimes.set_implicit(true);
    let mut nvidia = base.unwrap_or_default();
    nvidia.set_implicit(false);
    nvidia.set_position(None);
    nvidia.insert("runtime_path", value(path.as_str()));
    nvidia.insert("runtime_type", value("oci"));
    runtimes.insert(&opts.runtime_name, Item::Table(nvidia));
    rt.insert("runtimes", Item::Table(runtimes));
    crio.insert("runtime", Item::Table(rt));
    doc.insert("crio", Item::Table(crio));
    let before = host
        .read_optional(&opts.drop_in)
        .map_err(RuntimeError::Host)?;
    let change = FileChange::new(&opts.drop_in, before, doc.to_string());
    Ok(if change.changes_anything() {
        vec![change]
    } else {
        Vec::new()
    })
}

/// The default runtime's table in crio.conf (`crio.runtime.default_runtime`,
/// else `runc`, else `crun`), checking the tables on the way are tables.
fn base_runtime(
    path: &str,
    text: &str,
    conf: &toml_edit::Document<String>,
    ours: &str,
) -> Result<Option<Table>, RuntimeError> {
    let invalid = |item: &Item, key: &str| {
        let (line, column) = item
            .span()
            .map_or((0, 0), |s| super::containerd::line_col(text, s.start));
        RuntimeError::Invalid {
            path: path.to_string(),
            line,
            column,
            key: key.to_string(),
            message: "must be a table".into(),
        }
    };
    let mut at = conf.as_item();
    for key in ["crio", "runtime"] {
        match at.get(key) {
            None => return Ok(None),
            Some(t) if t.is_table_like() => at = t,
            Some(t) => return Err(invalid(t, key)),
        }
    }
    let default = at
        .get("default_runtime")
        .and_then(Item::as_str)
        .filter(|d| *d != ours)
        .map(str::to_string);
    let Some(runtimes) = at.get("runtimes") else {
        return Ok(None);
    };
    if !runtimes.is_table_like() {
        return Err(invalid(runtimes, "crio.runtime.runtimes"));
    }
    for (name, rt) in runtimes.as_table_like().into_iter().flat_map(|t| t.iter()) {
        if !rt.is_table_like() {
            return Err(invalid(rt, &format!("crio.runtime.runtimes.{name}")));
        }
    }
    let pick = default
        .iter()
        .map(String::as_str)
        .chain(["runc", "crun"])
        .find_map(|n| runtimes.get(n).and_then(Item::as_table).cloned());
    Ok(pick)
}
