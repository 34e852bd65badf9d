//! CRI-O: a drop-in `/etc/crio/crio.conf.d/99-nvidia.conf` with only our
//! tables (CRI-O merges drop-ins key by key, later files winning), so the
//! user's `crio.conf` is never touched.

use hostlib::HostRoot;
use toml_edit::{DocumentMut, Item, Table, value};

use super::{FileChange, RuntimeError};

/// What to configure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// The drop-in to write, `/etc/crio/crio.conf.d/99-nvidia.conf`.
    pub drop_in: String,
    pub runtime_name: String,
    /// The runtime binary: the host's `nvidia-container-runtime`.
    pub runtime_path: Option<String>,
    pub set_as_default: bool,
}

/// Plans the drop-in.
pub fn plan(host: &HostRoot, opts: &Options) -> Result<Vec<FileChange>, RuntimeError> {
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
    let mut nvidia = Table::new();
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
