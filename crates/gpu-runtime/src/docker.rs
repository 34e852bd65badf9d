//! Docker: `daemon.json` gets the `nvidia` runtime (`runtimes.<name>.path`),
//! optionally `default-runtime`, and `features.cdi = true` (Docker 25+
//! reads CDI specs when it is set). Every other key stays, in its order;
//! the file is rewritten as pretty JSON (Docker does not keep comments).

use hostlib::HostRoot;
use serde_json::{Map, Value, json};

use crate::change::FileChange;
use crate::error::RuntimeError;

/// What to configure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// `/etc/docker/daemon.json`.
    pub config: String,
    pub runtime_name: String,
    /// The runtime binary: the host's `nvidia-container-runtime`.
    pub runtime_path: Option<String>,
    pub set_as_default: bool,
    pub enable_cdi: bool,
}

/// Plans the change of `daemon.json`.
pub fn plan(host: &HostRoot, opts: &Options) -> Result<Vec<FileChange>, RuntimeError> {
    let before = host
        .read_optional(&opts.config)
        .map_err(RuntimeError::Host)?;
    let mut doc: Map<String, Value> = match before.as_deref().map(str::trim) {
        None | Some("") => Map::new(),
        Some(text) => match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(m)) => m,
            Ok(_) => {
                return Err(RuntimeError::Invalid {
                    path: opts.config.clone(),
                    line: 1,
                    column: 1,
                    key: "(document)".into(),
                    message: "daemon.json must be a JSON object".into(),
                });
            }
            Err(e) => {
                return Err(RuntimeError::Parse {
                    path: opts.config.clone(),
                    line: e.line(),
                    column: e.column(),
                    message: e.to_string(),
                });
            }
        },
    };
    let invalid = |key: &str, message: &str| RuntimeError::Invalid {
        path: opts.config.clone(),
        // serde_json's Value keeps no positions; point at the file's start.
        line: 1,
        column: 1,
        key: key.to_string(),
        message: message.to_string(),
    };
    match &opts.runtime_path {
        Some(path) => {
            let runtimes = doc.entry("runtimes").or_insert_with(|| json!({}));
            let runtimes = runtimes
                .as_object_mut()
                .ok_or_else(|| invalid("runtimes", "must be an object"))?;
            let wanted = json!({ "path": path, "args": [] });
            if runtimes.get(&opts.runtime_name) != Some(&wanted) {
                runtimes.insert(opts.runtime_name.clone(), wanted);
            }
            if opts.set_as_default {
                doc.insert("default-runtime".into(), json!(opts.runtime_name));
            }
        }
        None if !opts.enable_cdi => {
            return Err(RuntimeError::NoInjection(
                "Docker needs either the host's nvidia-container-runtime or CDI (spec.cdi.enabled) to give containers GPUs".into(),
            ));
        }
        None => {}
    }
    if opts.enable_cdi {
        let features = doc.entry("features").or_insert_with(|| json!({}));
        let features = features
            .as_object_mut()
            .ok_or_else(|| invalid("features", "must be an object"))?;
        if features.get("cdi") != Some(&json!(true)) {
            features.insert("cdi".into(), json!(true));
        }
    }
    let mut after = serde_json::to_string_pretty(&Value::Object(doc)).expect("JSON serialises");
    after.push('\n');
    // Unchanged content keeps the user's own formatting.
    let unchanged = before
        .as_deref()
        .and_then(|b| serde_json::from_str::<Value>(b).ok())
        .is_some_and(|v| serde_json::from_str::<Value>(&after).ok() == Some(v));
    if unchanged {
        return Ok(Vec::new());
    }
    Ok(vec![FileChange::new(&opts.config, before, after)])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Numbers that JSON's text holds more precisely than a float (found
    /// by the `docker` fuzz target): planned once, the next plan changes
    /// nothing (serde_json's default float parsing did not read its own
    /// output back exactly, so daemon.json was rewritten, and Docker
    /// restarted, at every reconcile).
    #[test]
    fn planning_again_over_long_numbers_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let host = HostRoot::new(dir.path()).unwrap();
        let daemon = dir.path().join("etc/docker/daemon.json");
        std::fs::create_dir_all(daemon.parent().unwrap()).unwrap();
        let opts = Options {
            config: "/etc/docker/daemon.json".into(),
            runtime_name: "nvidia".into(),
            runtime_path: Some("/usr/bin/nvidia-container-runtime".into()),
            set_as_default: false,
            enable_cdi: true,
        };
        for text in [
            "{\"ls\": [66666666666666666666666666666666666666666]}",
            "{\"x\": 0.30000000000000004, \"y\": 1.7976931348623157e308, \"z\": 5e-324}",
            "{\"shm-size\": 123456789012345678901234567890.5}",
        ] {
            std::fs::write(&daemon, text).unwrap();
            let first = plan(&host, &opts).unwrap();
            assert_eq!(first.len(), 1, "{text}");
            std::fs::write(&daemon, &first[0].after).unwrap();
            let again = plan(&host, &opts).unwrap();
            assert!(
                again.is_empty(),
                "{text}: planned again:\n{}",
                again[0].after
            );
        }
    }
}
