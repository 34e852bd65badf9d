//! Reading a containerd config: TOML with errors that name the line and
//! column, and the checks `containerd config dump` would make (the version,
//! `imports`, and typos in the tables gpu-agent reads).

use toml_edit::{DocumentMut, Item};

use crate::error::RuntimeError;

pub(super) fn cri_plugin(config_version: i64) -> &'static str {
    match config_version {
        1 => "cri",
        2 => "io.containerd.grpc.v1.cri",
        _ => "io.containerd.cri.v1.runtime",
    }
}

/// Keys containerd knows in a runtime table (`runtimes.<name>`), across 1.6–2.x;
/// `config dump` accepts anything, so a typo would silently do nothing.
const RUNTIME_KEYS: &[&str] = &[
    "runtime_type",
    "runtime_path",
    "runtime_engine",
    "runtime_root",
    "pod_annotations",
    "container_annotations",
    "privileged_without_host_devices",
    "privileged_without_host_devices_all_devices_allowed",
    "base_runtime_spec",
    "cni_conf_dir",
    "cni_max_conf_num",
    "snapshotter",
    "sandbox_mode",
    "sandboxer",
    "io_type",
    "options",
    "treat_ro_mounts_as_rro",
    "cgroup_writable",
];

/// Near-misses of the `containerd` table's `runtimes` and
/// `default_runtime_name` (not `default_runtime`: that is 1.x's legacy table).
const NEAR_MISSES: &[(&str, &str)] = &[
    ("runtime", "runtimes"),
    ("runtimess", "runtimes"),
    ("default_runtimes_name", "default_runtime_name"),
];

pub(crate) fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    (line, col)
}

pub(super) fn parse(path: &str, text: &str) -> Result<DocumentMut, RuntimeError> {
    let doc = parse_toml(path, text)?;
    validate(path, text, &doc)?;
    Ok(doc.into_mut())
}

/// TOML, or an error naming the file, line and column.
pub(crate) fn parse_toml(
    path: &str,
    text: &str,
) -> Result<toml_edit::Document<String>, RuntimeError> {
    toml_edit::Document::parse(text.to_string()).map_err(|e| {
        let (line, column) = e.span().map_or((0, 0), |s| line_col(text, s.start));
        RuntimeError::Parse {
            path: path.to_string(),
            line,
            column,
            message: e.message().trim().to_string(),
        }
    })
}

/// Checks what `config dump` would let through: the version, and typos in
/// the tables we read.
fn validate(path: &str, text: &str, doc: &toml_edit::Document<String>) -> Result<(), RuntimeError> {
    let invalid = |span: Option<std::ops::Range<usize>>, key: String, message: String| {
        let (line, column) = span.map_or((0, 0), |s| line_col(text, s.start));
        RuntimeError::Invalid {
            path: path.to_string(),
            line,
            column,
            key,
            message,
        }
    };
    if let Some(v) = doc.get("version") {
        match v.as_integer() {
            Some(1..=3) => {}
            _ => {
                return Err(invalid(
                    v.span(),
                    "version".into(),
                    format!(
                        "{} is not a containerd config version (1, 2 or 3)",
                        v.to_string().trim()
                    ),
                ));
            }
        }
    }
    // containerd reads `imports` as a list of file paths; anything else is
    // refused here, never replaced by the drop-in's import (found by the
    // fuzz smoke: a `[imports."…"]` table was overwritten whole).
    if let Some((key, item)) = doc.as_table().get_key_value("imports")
        && !item
            .as_array()
            .is_some_and(|a| a.iter().all(|v| v.as_str().is_some()))
    {
        // An implicit table (`[imports.x]`) has no span of its own: point at
        // the first place the text names it.
        let span = key.span().or_else(|| item.span()).or_else(|| {
            text.match_indices("imports")
                .next()
                .map(|(at, w)| at..at + w.len())
        });
        return Err(invalid(
            span,
            "imports".into(),
            "must be a list of file paths (containerd's `imports`)".into(),
        ));
    }
    if let Some(p) = doc.get("plugins")
        && !p.is_table_like()
    {
        return Err(invalid(
            p.span(),
            "plugins".into(),
            "must be a table".into(),
        ));
    }
    let version = doc.get("version").and_then(Item::as_integer).unwrap_or(1);
    let cri = cri_plugin(version);
    let Some(ctr) = doc
        .get("plugins")
        .and_then(|p| p.get(cri))
        .and_then(|c| c.get("containerd"))
        .and_then(Item::as_table_like)
    else {
        return Ok(());
    };
    // Errors point at the key (its span), not at its value.
    let key_span = |t: &dyn toml_edit::TableLike, k: &str| {
        t.get_key_value(k)
            .and_then(|(key, item)| key.span().or_else(|| item.span()))
    };
    for (k, _) in ctr.iter() {
        if let Some((_, want)) = NEAR_MISSES.iter().find(|(typo, _)| *typo == k) {
            return Err(invalid(
                key_span(ctr, k),
                format!("plugins.\"{cri}\".containerd.{k}"),
                format!("unknown key; did you mean `{want}`?"),
            ));
        }
    }
    if let Some(runtimes) = ctr.get("runtimes").and_then(Item::as_table_like) {
        for (name, rt) in runtimes.iter() {
            let Some(rt) = rt.as_table_like() else {
                return Err(invalid(
                    rt.span(),
                    format!("plugins.\"{cri}\".containerd.runtimes.{name}"),
                    "must be a table".into(),
                ));
            };
            for (k, _) in rt.iter() {
                if !RUNTIME_KEYS.contains(&k) {
                    return Err(invalid(
                        key_span(rt, k),
                        format!("plugins.\"{cri}\".containerd.runtimes.{name}.{k}"),
                        "unknown runtime key (containerd would ignore it)".into(),
                    ));
                }
            }
        }
    }
    Ok(())
}
