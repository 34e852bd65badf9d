//! containerd: add the `nvidia` runtime and enable CDI, keeping the user's
//! comments, key order and imports (format-preserving edits with toml_edit).
//!
//! Config versions: 1 (plugin `cri`), 2 (`io.containerd.grpc.v1.cri`),
//! 3 (`io.containerd.cri.v1.runtime`, containerd 2.x).
//!
//! Where the change goes:
//! - containerd ≥ 2.1 merges imported files into the main config key by key,
//!   so we write a drop-in (`/etc/containerd/conf.d/99-gpu-agent.toml`) with
//!   only our tables and add one import to the main config.
//! - Older containerd replaces a whole plugin table with the imported one
//!   (containerd#5837; measured here with Debian's 1.6.20: a drop-in that
//!   defines the CRI plugin's `runtimes.nvidia` makes the main config's
//!   `runtimes.runc` and its `SystemdCgroup = true` vanish from `config
//!   dump`). A drop-in would have to carry a copy of the whole CRI table,
//!   which silently overrides every later edit of the main file; so there we
//!   edit the main config in place instead. `restore` puts it back byte for
//!   byte either way.
//!
//! CDI: containerd 1.6 has no CDI support (`enable_cdi` arrived in 1.7 and
//! 1.6 ignores it), so we never write it there; 2.x enables CDI by default.

use std::fmt;

use hostlib::HostRoot;
use toml_edit::{DocumentMut, Item, Table, value};

use crate::change::FileChange;
use crate::error::RuntimeError;

mod parse;

use parse::{cri_plugin, parse};
pub(crate) use parse::{line_col, parse_toml};

/// containerd's version, `1.6.20`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

impl Version {
    /// From `containerd --version` output or a bare `1.7.2` / `v2.1.0`.
    pub fn parse(text: &str) -> Option<Self> {
        text.split_whitespace().find_map(|w| {
            let w = w.strip_prefix('v').unwrap_or(w);
            let mut nums = w.split(|c: char| !c.is_ascii_digit());
            let major = nums.next()?.parse().ok()?;
            let minor = nums.next()?.parse().ok()?;
            let patch = nums.next().and_then(|p| p.parse().ok()).unwrap_or(0);
            w.chars().next()?.is_ascii_digit().then_some(Version {
                major,
                minor,
                patch,
            })
        })
    }

    fn at_least(&self, major: u32, minor: u32) -> bool {
        (self.major, self.minor) >= (major, minor)
    }
}

/// Asks the host's containerd binary (through the host root) for its version.
pub fn host_version(host: &HostRoot, binary: &str) -> Option<Version> {
    let path = host.resolve(binary).ok()?;
    let out = std::process::Command::new(&path)
        .arg("--version")
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    // "containerd github.com/containerd/containerd 1.6.20~ds1 <rev>": the
    // first word that is a version.
    text.split_whitespace().skip(1).find_map(Version::parse)
}

/// Where the version of the host's containerd is remembered, with the
/// identity of the binary it was asked from.
pub const VERSION_CACHE: &str = "/var/lib/gpu-agent/containerd-version.json";

/// A remembered `containerd --version`, valid while the binary is the same
/// file (device, inode, size, modification time).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct CachedVersion {
    binary: String,
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i64,
    version: String,
}

/// [`host_version`], remembered in [`VERSION_CACHE`]: running the binary
/// costs ~20 ms (a Go program starting), which would sit between the agent's
/// start and its registration with the kubelet at every start. An upgraded
/// containerd is a new file, so it is asked again.
pub fn cached_host_version(host: &HostRoot, binary: &str) -> Option<Version> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(host.resolve(binary).ok()?).ok()?;
    let key = CachedVersion {
        binary: binary.to_string(),
        dev: meta.dev(),
        ino: meta.ino(),
        size: meta.len(),
        mtime_ns: meta.mtime().saturating_mul(1_000_000_000) + meta.mtime_nsec(),
        version: String::new(),
    };
    if let Ok(Some(text)) = host.read_optional(VERSION_CACHE)
        && let Ok(cached) = serde_json::from_str::<CachedVersion>(&text)
        && (
            &cached.binary,
            cached.dev,
            cached.ino,
            cached.size,
            cached.mtime_ns,
        ) == (&key.binary, key.dev, key.ino, key.size, key.mtime_ns)
        && let Some(v) = Version::parse(&cached.version)
    {
        return Some(v);
    }
    let v = host_version(host, binary)?;
    let cached = CachedVersion {
        version: v.to_string(),
        ..key
    };
    let json = serde_json::to_vec(&cached).expect("serialises");
    if let Err(e) = host.write_atomic(VERSION_CACHE, &json, 0o644) {
        tracing::debug!(stage = "runtime", error = %e, "cannot remember containerd's version");
    }
    Some(v)
}

/// What to configure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// The main config, a host path.
    pub config: String,
    /// Where drop-ins go (containerd ≥ 2.1), a host path.
    pub drop_in_dir: String,
    /// The runtime to add (`nvidia`).
    pub runtime_name: String,
    /// Make it the default runtime.
    pub set_as_default: bool,
    /// Turn CDI on where containerd supports it.
    pub enable_cdi: bool,
    /// `BinaryName` for the runtime: the host's `nvidia-container-runtime`,
    /// or `None` for plain runc with CDI doing the injection.
    pub binary_name: Option<String>,
}

/// The plan for containerd.
#[derive(Clone, Debug)]
pub struct Plan {
    pub changes: Vec<FileChange>,
    /// Things the operator should know (e.g. why CDI was not enabled).
    pub notes: Vec<String>,
    /// The systemd unit whose restart makes containerd read the change
    /// (`containerd`; k3s's or RKE2's own unit for their templates).
    pub unit: String,
    /// Why containerd will not inject CDI devices, when that is known.
    pub no_cdi: Option<String>,
}

const DROP_IN_NAME: &str = "99-gpu-agent.toml";

/// The table at `path` under `root`, created (implicit, so no empty headers
/// are printed) where missing.
fn table_at<'a>(root: &'a mut Table, path: &[&str]) -> &'a mut Table {
    let mut t = root;
    for key in path {
        let entry = t.entry(key).or_insert_with(|| {
            let mut nt = Table::new();
            nt.set_implicit(true);
            Item::Table(nt)
        });
        t = entry.as_table_mut().expect("validated to be a table");
    }
    t
}

/// Inserts `key = item`, indented like the keys already in `table` (so the
/// user's layout stays even).
fn insert_indented(table: &mut Table, key: &str, item: Item) {
    let indent = table
        .iter()
        .find(|(k, _)| *k != key)
        .and_then(|(k, _)| table.key(k))
        .and_then(|k| k.leaf_decor().prefix())
        .and_then(|p| p.as_str())
        .map(str::to_string);
    table.insert(key, item);
    if let (Some(indent), Some(mut k)) = (indent, table.key_mut(key)) {
        k.leaf_decor_mut().set_prefix(indent);
    }
}

/// The `nvidia` runtime's table: the default (or runc) runtime's options
/// copied from `doc`, with the toolkit's runtime as `BinaryName` when the
/// host has one.
fn nvidia_runtime(doc: &DocumentMut, cri: &str, opts: &Options) -> Table {
    // The runtime's options start from the default (or runc) runtime's.
    let base_runtime = {
        let ctr = doc
            .get("plugins")
            .and_then(|p| p.get(cri))
            .and_then(|c| c.get("containerd"));
        let pick = |name: &str| {
            ctr.and_then(|c| c.get("runtimes"))
                .and_then(|r| r.get(name))
                .and_then(Item::as_table)
                .cloned()
        };
        match ctr
            .and_then(|c| c.get("default_runtime_name"))
            .and_then(Item::as_str)
        {
            // Ours is the default already: our table is the runtime it
            // wrapped (a crun or kata default is not forgotten the next time).
            Some(d) if d.starts_with(&opts.runtime_name) => {
                pick(&opts.runtime_name).or_else(|| pick("runc"))
            }
            Some(d) => pick(d).or_else(|| pick("runc")),
            None => pick("runc"),
        }
    };
    let mut runtime = base_runtime.unwrap_or_default();
    runtime.set_implicit(false);
    runtime.set_position(None);
    if !runtime.contains_key("runtime_type") {
        runtime.insert("runtime_type", value("io.containerd.runc.v2"));
    }
    match &opts.binary_name {
        Some(bin) => {
            let options = runtime
                .entry("options")
                .or_insert_with(|| Item::Table(Table::new()));
            if let Some(t) = options.as_table_mut() {
                t.set_position(None);
                insert_indented(t, "BinaryName", value(bin.as_str()));
            }
        }
        None => {
            // Plain runc: a BinaryName copied from the default runtime stays.
        }
    }
    runtime
}

/// Whether two tables hold the same keys and values, subtables included,
/// whatever their layout. (`Table`'s `Display` leaves subtables out: an
/// `options` table with another `BinaryName` compared equal.)
fn same_table(a: &dyn toml_edit::TableLike, b: &dyn toml_edit::TableLike) -> bool {
    a.iter().count() == b.iter().count()
        && a.iter()
            .all(|(k, x)| b.get(k).is_some_and(|y| same_item(x, y)))
}

fn same_item(a: &Item, b: &Item) -> bool {
    match (a, b) {
        (Item::ArrayOfTables(x), Item::ArrayOfTables(y)) => {
            x.len() == y.len() && x.iter().zip(y.iter()).all(|(p, q)| same_table(p, q))
        }
        _ => match (
            a.as_table_like(),
            b.as_table_like(),
            a.as_value(),
            b.as_value(),
        ) {
            (Some(x), Some(y), _, _) => same_table(x, y),
            (None, None, Some(x), Some(y)) => same_value(x, y),
            _ => false,
        },
    }
}

fn same_value(a: &toml_edit::Value, b: &toml_edit::Value) -> bool {
    use toml_edit::Value;
    match (a, b) {
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y.iter()).all(|(p, q)| same_value(p, q))
        }
        (Value::InlineTable(x), Value::InlineTable(y)) => same_table(x, y),
        _ => {
            let bare = |v: &Value| {
                let mut v = v.clone();
                v.decor_mut().clear();
                v.to_string()
            };
            bare(a) == bare(b)
        }
    }
}

/// Plans the changes for containerd `version` (`None` when it cannot be
/// asked; the config's shape then decides).
pub fn plan(
    host: &HostRoot,
    opts: &Options,
    version: Option<Version>,
) -> Result<Plan, RuntimeError> {
    let before = host
        .read_optional(&opts.config)
        .map_err(RuntimeError::Host)?;
    let text = before.clone().unwrap_or_default();
    let mut doc = parse(&opts.config, &text)?;
    let mut notes = Vec::new();
    let config_version = match doc.get("version").and_then(Item::as_integer) {
        Some(v) => v,
        None if text.trim().is_empty() => match version {
            Some(v) if v.major >= 2 => 3,
            _ => 2,
        },
        None => 1,
    };
    if let Some(v) = version
        && config_version == 3
        && v.major < 2
    {
        return Err(RuntimeError::Invalid {
            path: opts.config.clone(),
            line: 1,
            column: 1,
            key: "version".into(),
            message: format!("config version 3 needs containerd 2.x; the host has {v}"),
        });
    }
    let cdi_supported = match version {
        Some(v) => v.at_least(1, 7),
        None => config_version >= 3,
    };
    let no_cdi = match version {
        Some(v) if !cdi_supported => Some(format!(
            "containerd {v} has no CDI support (it arrived in 1.7)"
        )),
        _ => None,
    };
    if opts.enable_cdi && !cdi_supported {
        let why = match version {
            Some(v) => format!("containerd {v} has no CDI support (it arrived in 1.7)"),
            None => "the containerd version is unknown and the config is not version 3".to_string(),
        };
        if opts.binary_name.is_none() {
            return Err(RuntimeError::NoInjection(format!(
                "{why}, and the host has no nvidia-container-runtime: containers could not get GPUs. Upgrade containerd to 1.7 or later, or install the NVIDIA container toolkit"
            )));
        }
        notes.push(format!(
            "{why}: CDI not enabled; the {} runtime injects GPUs through nvidia-container-runtime",
            opts.runtime_name
        ));
    }
    let enable_cdi = opts.enable_cdi && cdi_supported;
    let cri = cri_plugin(config_version);
    let drop_in = version.is_some_and(|v| v.at_least(2, 1));

    let runtime = nvidia_runtime(&doc, cri, opts);

    let mut changes = Vec::new();
    let target_doc: &mut DocumentMut;
    let mut drop_doc = DocumentMut::new();
    if drop_in {
        drop_doc.insert("version", value(config_version));
        target_doc = &mut drop_doc;
    } else {
        target_doc = &mut doc;
        if target_doc.get("version").is_none() && config_version > 1 {
            target_doc.insert("version", value(config_version));
        }
    }
    {
        let root = target_doc.as_table_mut();
        let ctr = table_at(root, &["plugins", cri, "containerd"]);
        let runtimes = ctr.entry("runtimes").or_insert_with(|| {
            let mut t = Table::new();
            t.set_implicit(true);
            Item::Table(t)
        });
        let runtimes = runtimes.as_table_mut().expect("validated to be a table");
        let unchanged = runtimes
            .get(&opts.runtime_name)
            .and_then(Item::as_table)
            .is_some_and(|t| same_table(t, &runtime));
        if !unchanged {
            runtimes.insert(&opts.runtime_name, Item::Table(runtime));
        }
        if opts.set_as_default {
            let current = ctr.get("default_runtime_name").and_then(Item::as_str);
            if current != Some(opts.runtime_name.as_str()) {
                insert_indented(
                    ctr,
                    "default_runtime_name",
                    value(opts.runtime_name.as_str()),
                );
            }
        }
        if enable_cdi {
            let plugin = table_at(root, &["plugins", cri]);
            let on = plugin.get("enable_cdi").and_then(Item::as_bool);
            // 2.x has CDI on by default: only an explicit `false` needs changing.
            if on != Some(true) && !(config_version >= 3 && on.is_none()) {
                insert_indented(plugin, "enable_cdi", value(true));
            }
        }
    }
    if drop_in {
        let drop_path = format!("{}/{DROP_IN_NAME}", opts.drop_in_dir.trim_end_matches('/'));
        let glob = format!("{}/*.toml", opts.drop_in_dir.trim_end_matches('/'));
        let mut imports: Vec<String> = doc
            .get("imports")
            .and_then(Item::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        if !imports.iter().any(|i| i == &glob || i == &drop_path) {
            imports.push(glob.clone());
            match doc.get_mut("imports").and_then(Item::as_array_mut) {
                Some(a) => a.push(glob.as_str()),
                None => {
                    doc.insert(
                        "imports",
                        value(toml_edit::Array::from_iter([glob.as_str()])),
                    );
                }
            }
            if doc.get("version").is_none() {
                doc.insert("version", value(config_version));
            }
        }
        changes.push(FileChange::new(
            &drop_path,
            host.read_optional(&drop_path).map_err(RuntimeError::Host)?,
            drop_doc.to_string(),
        ));
    }
    changes.insert(0, FileChange::new(&opts.config, before, doc.to_string()));
    changes.retain(FileChange::changes_anything);
    Ok(Plan {
        changes,
        notes,
        unit: "containerd".into(),
        no_cdi,
    })
}

/// RKE2 and k3s write containerd's `config.toml` anew from a Go template
/// at every start, so an edit there would be lost. Their documented way in
/// is a template beside it: `config.toml.tmpl` (`config-v3.toml.tmpl` for
/// the containerd 2 they ship since v1.31), starting with their own
/// `{{ template "base" . }}`. The template for `config`, when it is one of
/// theirs: `config` itself when it ends in `.tmpl`, an existing template
/// beside it, or a new one for a config under `/var/lib/rancher/`.
pub fn template_for(host: &HostRoot, config: &str) -> Option<String> {
    if config.ends_with(".tmpl") {
        return Some(config.to_string());
    }
    let (dir, _) = config.rsplit_once('/')?;
    for name in ["config-v3.toml.tmpl", "config.toml.tmpl"] {
        let t = format!("{dir}/{name}");
        if host.exists(&t) {
            return Some(t);
        }
    }
    if config.starts_with("/var/lib/rancher/") {
        let v3 = host
            .read_optional(config)
            .ok()
            .flatten()
            .and_then(|t| toml_edit::Document::parse(t).ok())
            .and_then(|d| d.get("version").and_then(Item::as_integer))
            == Some(3);
        let name = if v3 {
            "config-v3.toml.tmpl"
        } else {
            "config.toml.tmpl"
        };
        return Some(format!("{dir}/{name}"));
    }
    None
}

const BLOCK_BEGIN: &str =
    "# --- gpu-agent begin: added by gpu-agent (`gpu-agent runtime restore` takes it out) ---";
const BLOCK_END: &str = "# --- gpu-agent end ---";

/// The template without gpu-agent's block.
fn without_block(text: &str) -> String {
    match (text.find(BLOCK_BEGIN), text.find(BLOCK_END)) {
        (Some(b), Some(e)) if e > b => {
            let rest = &text[e + BLOCK_END.len()..];
            // The blank line we put before the block goes with it.
            let head = &text[..b];
            let head = if head.ends_with("\n\n") {
                &head[..head.len() - 1]
            } else {
                head
            };
            format!("{head}{}", rest.strip_prefix('\n').unwrap_or(rest))
        }
        _ => text.to_string(),
    }
}

/// The k3s/RKE2 systemd unit that restarts their containerd.
fn rancher_unit(host: &HostRoot, template: &str) -> (String, Option<String>) {
    let candidates: &[&str] = if template.contains("/rke2/") {
        &["rke2-server", "rke2-agent"]
    } else {
        &["k3s", "k3s-agent"]
    };
    let dirs = [
        "/etc/systemd/system",
        "/usr/local/lib/systemd/system",
        "/usr/lib/systemd/system",
        "/lib/systemd/system",
    ];
    for unit in candidates {
        if dirs
            .iter()
            .any(|d| host.exists(format!("{d}/{unit}.service")))
        {
            return (unit.to_string(), None);
        }
    }
    (
        candidates[0].to_string(),
        Some(format!(
            "no {} unit file found; a reload restarts {}",
            candidates.join(" or "),
            candidates[0]
        )),
    )
}

/// Plans the change to a k3s/RKE2 template: our tables appended in a
/// marked block after the user's text (which is Go template, not TOML, so
/// it is never parsed or changed). The rendered `config` is read to copy the
/// runc options and to learn the config version and whether CDI is on.
///
/// What a template cannot do: reopen a table k3s's base already defines
/// (TOML forbids it), so `enable_cdi` and `default_runtime_name` are not
/// written there. k3s adds the `nvidia` runtime itself when it finds
/// nvidia-container-runtime; then there is nothing to add.
pub fn plan_template(
    host: &HostRoot,
    opts: &Options,
    version: Option<Version>,
    template: &str,
) -> Result<Plan, RuntimeError> {
    let rendered_path = match template.rsplit_once('/') {
        Some((dir, _)) => format!("{dir}/config.toml"),
        None => opts.config.clone(),
    };
    let rendered_text = host
        .read_optional(&rendered_path)
        .map_err(RuntimeError::Host)?;
    let rendered = parse(&rendered_path, rendered_text.as_deref().unwrap_or(""))?;
    let config_version = rendered
        .get("version")
        .and_then(Item::as_integer)
        .unwrap_or(
            if template.ends_with("config-v3.toml.tmpl") || version.is_some_and(|v| v.major >= 2) {
                3
            } else {
                2
            },
        );
    let cri = cri_plugin(config_version);
    let (unit, unit_note) = rancher_unit(host, template);
    let mut notes: Vec<String> = unit_note.into_iter().collect();
    let before = host.read_optional(template).map_err(RuntimeError::Host)?;
    let body = before.as_deref().map(without_block);
    if opts.set_as_default {
        notes.push(
            "a k3s/RKE2 template cannot set containerd's default runtime; start k3s/RKE2 with --default-runtime instead"
                .into(),
        );
    }
    let cdi_on = {
        let flag = rendered
            .get("plugins")
            .and_then(|p| p.get(cri))
            .and_then(|c| c.get("enable_cdi"))
            .and_then(Item::as_bool);
        flag.unwrap_or(config_version >= 3)
    };
    let block = if opts.binary_name.is_some() {
        notes.push(format!(
            "k3s/RKE2 add the {} runtime themselves when they find nvidia-container-runtime: nothing to add to {template}",
            opts.runtime_name
        ));
        None
    } else {
        if opts.enable_cdi && !cdi_on {
            let why = match &rendered_text {
                None => format!("{rendered_path} does not exist yet (start k3s/RKE2 once)"),
                Some(_) => format!("{rendered_path} has CDI off"),
            };
            return Err(RuntimeError::NoInjection(format!(
                "{why}, and the host has no nvidia-container-runtime: containers could not get GPUs. A template cannot turn CDI on after k3s's base; use a k3s/RKE2 with containerd 2 (CDI on by default) or install the NVIDIA container toolkit"
            )));
        }
        let user_has_it = body.as_deref().is_some_and(|b| {
            b.contains(&format!("runtimes.{}]", opts.runtime_name))
                || b.contains(&format!("runtimes.\"{}\"]", opts.runtime_name))
        });
        if user_has_it {
            notes.push(format!(
                "{template} already defines the {} runtime: left as it is",
                opts.runtime_name
            ));
            None
        } else {
            let mut doc = DocumentMut::new();
            let runtimes = table_at(
                doc.as_table_mut(),
                &["plugins", cri, "containerd", "runtimes"],
            );
            runtimes.insert(
                &opts.runtime_name,
                Item::Table(nvidia_runtime(&rendered, cri, opts)),
            );
            Some(doc.to_string())
        }
    };
    let after = match (body, block) {
        (None, None) => None,
        (body, block) => {
            let mut text = body.unwrap_or_else(|| "{{ template \"base\" . }}\n".to_string());
            if let Some(block) = block {
                if !text.ends_with('\n') {
                    text.push('\n');
                }
                text.push_str(&format!(
                    "\n{BLOCK_BEGIN}\n{}{BLOCK_END}\n",
                    block.trim_start()
                ));
            }
            Some(text)
        }
    };
    let changes = after
        .map(|a| FileChange::new(template, before, a))
        .into_iter()
        .filter(FileChange::changes_anything)
        .collect();
    Ok(Plan {
        changes,
        notes,
        unit,
        no_cdi: (!cdi_on).then(|| format!("{rendered_path} has CDI off")),
    })
}

/// What the host's containerd said of the configuration (`config dump`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DumpCheck {
    /// It ran, accepted the configuration and shows what it should.
    Accepted(String),
    /// It cannot run from here (no binary, or one this process cannot
    /// execute, e.g. dynamically linked against a host library the agent's
    /// image lacks): the files were checked only.
    CannotRun(String),
}

/// Runs the host's containerd (`--config <main> config dump`) and checks
/// that its effective configuration has the runtime `runtime` and, with
/// `want_cdi`, CDI enabled. When the host root is not `/`, the main config
/// is copied with its absolute `imports` resolved under the host root (the
/// binary reads this process's filesystem). `Err`: containerd refuses the
/// configuration, or its dump lacks what gpu-agent wrote.
pub fn dump_check(
    host: &HostRoot,
    binary: &str,
    config: &str,
    runtime: &str,
    want_cdi: bool,
) -> Result<DumpCheck, String> {
    let Ok(bin) = host.resolve(binary) else {
        return Ok(DumpCheck::CannotRun(format!("{binary} is not on the host")));
    };
    if !bin.exists() {
        return Ok(DumpCheck::CannotRun(format!("{binary} is not on the host")));
    }
    let main = match host.read_optional(config) {
        Ok(Some(t)) => t,
        Ok(None) => return Ok(DumpCheck::CannotRun(format!("{config} does not exist"))),
        Err(e) => return Err(e.to_string()),
    };
    let text = if host.is_system() {
        main
    } else {
        let mut doc: toml_edit::DocumentMut = main
            .parse()
            .map_err(|e| format!("{config} does not parse: {e}"))?;
        if let Some(imports) = doc.get_mut("imports").and_then(|i| i.as_array_mut()) {
            for v in imports.iter_mut() {
                if let Some(s) = v.as_str().filter(|s| s.starts_with('/')) {
                    let inside = host.path().join(s.trim_start_matches('/'));
                    *v = toml_edit::Value::from(inside.display().to_string());
                }
            }
        }
        doc.to_string()
    };
    let dir = tempfile::tempdir().map_err(|e| format!("a temporary directory: {e}"))?;
    let copy = dir.path().join("config.toml");
    std::fs::write(&copy, text).map_err(|e| format!("{}: {e}", copy.display()))?;
    let out = match std::process::Command::new(&bin)
        .arg("--config")
        .arg(&copy)
        .args(["config", "dump"])
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            return Ok(DumpCheck::CannotRun(format!(
                "cannot run {binary} from here: {e}"
            )));
        }
    };
    // 126/127: a shell or loader could not execute it.
    if matches!(out.status.code(), Some(126 | 127)) {
        return Ok(DumpCheck::CannotRun(format!(
            "cannot run {binary} from here (exit {})",
            out.status
        )));
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        let last = stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        return Err(format!("{binary} refuses the configuration: {last}"));
    }
    let dump: toml_edit::DocumentMut = String::from_utf8_lossy(&out.stdout)
        .parse()
        .map_err(|e| format!("{binary} config dump does not parse: {e}"))?;
    let mut has_runtime = false;
    let mut cdi = false;
    fn walk(t: &dyn toml_edit::TableLike, runtime: &str, has: &mut bool, cdi: &mut bool) {
        for (k, v) in t.iter() {
            if k == "enable_cdi" && v.as_bool() == Some(true) {
                *cdi = true;
            }
            if let Some(sub) = v.as_table_like() {
                if k == "runtimes" && sub.contains_key(runtime) {
                    *has = true;
                }
                walk(sub, runtime, has, cdi);
            }
        }
    }
    walk(dump.as_table(), runtime, &mut has_runtime, &mut cdi);
    let version = cached_host_version(host, binary)
        .map(|v| format!(" {}.{}", v.major, v.minor))
        .unwrap_or_default();
    match (has_runtime, cdi || !want_cdi) {
        (true, true) => Ok(DumpCheck::Accepted(format!(
            "the host's containerd{version} accepts the configuration and shows the {runtime:?} runtime{}",
            if want_cdi { " and CDI" } else { "" }
        ))),
        (false, _) => Err(format!(
            "the host's containerd{version} does not show the {runtime:?} runtime in its effective configuration"
        )),
        (true, false) => Err(format!(
            "the host's containerd{version} does not have CDI enabled in its effective configuration"
        )),
    }
}

#[cfg(test)]
mod tests;
