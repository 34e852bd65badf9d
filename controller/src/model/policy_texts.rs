//! The ClusterPolicy as each agent is sent it: the contents of the
//! ConfigMaps it names inlined in the policy text (an agent on a node holds
//! no API credentials and cannot read a ConfigMap), by [`resolve`]:
//!
//! | ClusterPolicy key | ConfigMap key | sent as |
//! |---|---|---|
//! | `devicePlugin.config.name` | the entry the node's `nvidia.com/device-plugin.config` label names, else `devicePlugin.config.default`, else the only entry | `devicePlugin.config.inline` (the entry parsed) |
//! | `migManager.config.name` | `config.yaml` | `migManager.config.inline` (parsed) |
//! | `dcgmExporter.config.name` | `dcgm-metrics.csv` | `dcgmExporter.config.inline` (the counters file's text) |
//! | `driver.kernelModuleConfig.name` | `nvidia.conf`, `nvidia-uvm.conf`, `nvidia-modeset.conf`, `nvidia-peermem.conf` | `driver.kernelModuleConfig.<module>: {param: value}` |
//!
//! One text serves most nodes; a node whose `nvidia.com/device-plugin.config`
//! label selects another entry gets its own ([`PolicyTexts`]). A ConfigMap
//! that is missing, cannot be read or does not parse is left out (the agents
//! run the ClusterPolicy without it) and said, with why, among the texts'
//! problems. Pure: what the API has of each ConfigMap comes in as a
//! [`Seen`]; the watches that read them are `config_maps`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::ConfigMap;
use serde_json::{Value, json};

/// The node label naming a node's entry of the device-plugin ConfigMap
/// (the GPU Operator's config-manager follows the same label).
pub const DEVICE_PLUGIN_LABEL: &str = "nvidia.com/device-plugin.config";
/// The mig-parted ConfigMap's key (the operator's mig-manager requires it).
pub const MIG_PARTED_KEY: &str = "config.yaml";
/// The counters ConfigMap's key (the operator mounts it for dcgm-exporter).
pub const COUNTERS_KEY: &str = "dcgm-metrics.csv";
/// The kernel module ConfigMap's keys the operator's driver container
/// reads (`<module>.conf`, one `param=value` a line), and their modules.
pub const MODULE_FILES: [(&str, &str); 4] = [
    ("nvidia.conf", "nvidia"),
    ("nvidia-uvm.conf", "nvidia-uvm"),
    ("nvidia-modeset.conf", "nvidia-modeset"),
    ("nvidia-peermem.conf", "nvidia-peermem"),
];
/// What the API says of one ConfigMap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seen {
    /// It exists: its `data`, and the keys of its `binaryData` (not used).
    Found {
        data: BTreeMap<String, String>,
        binary: Vec<String>,
    },
    NotFound,
    /// It could not be read (never was): why, in words.
    Unreadable(String),
}

impl Seen {
    /// A ConfigMap object as the API has it.
    pub fn of(cm: &ConfigMap) -> Seen {
        Seen::Found {
            data: cm.data.clone().unwrap_or_default().into_iter().collect(),
            binary: cm
                .binary_data
                .as_ref()
                .map(|b| b.keys().cloned().collect())
                .unwrap_or_default(),
        }
    }
}

/// Where the ClusterPolicy names ConfigMaps (a name given, non-empty, and
/// no config of gpu-agent's own shape beside it: `file` or `inline`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Named {
    /// `spec.devicePlugin.config.name`, and its `default`.
    pub device_plugin: Option<(String, Option<String>)>,
    /// `spec.migManager.config.name`.
    pub mig_manager: Option<String>,
    /// `spec.dcgmExporter.config.name`.
    pub dcgm_exporter: Option<String>,
    /// `spec.driver.kernelModuleConfig.name`.
    pub kernel_modules: Option<String>,
}

fn name_at(spec: &Value, path: &[&str]) -> Option<String> {
    let mut at = spec;
    for p in path {
        at = at.get(p)?;
    }
    at.as_str().filter(|s| !s.is_empty()).map(str::to_string)
}

/// `config` gives the content itself (gpu-agent's `file` or `inline`).
fn has_own(config: Option<&Value>) -> bool {
    config.is_some_and(|c| {
        c.get("file").is_some_and(|v| !v.is_null()) || c.get("inline").is_some_and(|v| !v.is_null())
    })
}

impl Named {
    pub fn from_spec(spec: &Value) -> Named {
        let dp = spec.get("devicePlugin").and_then(|d| d.get("config"));
        let mig = spec.get("migManager").and_then(|d| d.get("config"));
        let dcgm = spec.get("dcgmExporter").and_then(|d| d.get("config"));
        Named {
            device_plugin: name_at(spec, &["devicePlugin", "config", "name"])
                .filter(|_| !has_own(dp))
                .map(|n| (n, name_at(spec, &["devicePlugin", "config", "default"]))),
            mig_manager: name_at(spec, &["migManager", "config", "name"]).filter(|_| !has_own(mig)),
            dcgm_exporter: name_at(spec, &["dcgmExporter", "config", "name"])
                .filter(|_| !has_own(dcgm)),
            kernel_modules: name_at(spec, &["driver", "kernelModuleConfig", "name"]),
        }
    }

    /// Every ConfigMap named.
    pub fn names(&self) -> BTreeSet<String> {
        [
            self.device_plugin.as_ref().map(|(n, _)| n),
            self.mig_manager.as_ref(),
            self.dcgm_exporter.as_ref(),
            self.kernel_modules.as_ref(),
        ]
        .into_iter()
        .flatten()
        .cloned()
        .collect()
    }
}

/// The policy the agents are sent: one text for most nodes, others for
/// nodes whose `nvidia.com/device-plugin.config` label selects another
/// entry, and what could not be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyTexts {
    /// The ClusterPolicy's name.
    pub name: String,
    /// The text for nodes without the label.
    default: Arc<str>,
    /// The text by label value.
    by_label: BTreeMap<String, Arc<str>>,
    /// Each labelled node's label.
    labels: BTreeMap<String, String>,
    /// ConfigMaps (or entries) left out, and why, in words.
    problems: Vec<String>,
    /// Why nodes without the label get no device-plugin entry, if they get none.
    unlabelled: Option<String>,
}

impl PolicyTexts {
    /// One text for every node.
    pub fn plain(name: &str, text: String) -> Self {
        PolicyTexts {
            name: name.into(),
            default: text.into(),
            by_label: BTreeMap::new(),
            labels: BTreeMap::new(),
            problems: Vec::new(),
            unlabelled: None,
        }
    }

    /// The text `node` is sent.
    pub fn for_node(&self, node: &str) -> Arc<str> {
        self.labels
            .get(node)
            .and_then(|l| self.by_label.get(l))
            .unwrap_or(&self.default)
            .clone()
    }

    /// What could not be used, for a fleet of `nodes` (the one about nodes
    /// without the label only if one of them has none).
    pub fn problems_for(&self, nodes: &[&String]) -> Vec<String> {
        let mut v = self.problems.clone();
        if let Some(p) = &self.unlabelled
            && nodes.iter().any(|n| !self.labels.contains_key(n.as_str()))
        {
            v.push(p.clone());
        }
        v
    }

    /// Every problem, whichever nodes there are.
    pub fn problems(&self) -> Vec<String> {
        let mut v = self.problems.clone();
        v.extend(self.unlabelled.clone());
        v
    }
}

/// The policy document an agent is sent, for a ClusterPolicy's `spec`.
pub fn document(name: &str, spec: &Value) -> String {
    json!({
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "metadata": { "name": name },
        "spec": spec,
    })
    .to_string()
}

/// A YAML text as JSON, a mapping.
fn yaml_mapping(text: &str, what: &str) -> Result<serde_json::Map<String, Value>, String> {
    match serde_yaml_ng::from_str::<Value>(text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(Value::Null) => Err("is empty".into()),
        Ok(_) => Err(format!("is not {what} (a YAML mapping)")),
        Err(e) => Err(format!("does not parse as YAML: {e}")),
    }
}

/// A device-plugin config entry (NVIDIA's schema, `version: v1`), parsed.
/// The agent checks every key; here only what makes it no such config.
pub fn parse_plugin_config(text: &str) -> Result<Value, String> {
    let m = yaml_mapping(text, "a device-plugin config")?;
    if let Some(v) = m.get("version")
        && v != "v1"
    {
        return Err(format!("version {v}: gpu-agent reads version v1"));
    }
    Ok(Value::Object(m))
}

/// mig-parted's config (`version: v1`, `mig-configs`), parsed.
pub fn parse_mig_parted(text: &str) -> Result<Value, String> {
    let m = yaml_mapping(text, "a mig-parted config")?;
    match m.get("version") {
        Some(v) if v == "v1" => {}
        Some(v) => return Err(format!("version {v}: mig-parted's config is version v1")),
        None => return Err("has no version (mig-parted's config is version v1)".into()),
    }
    if !m.get("mig-configs").is_some_and(Value::is_object) {
        return Err("has no mig-configs (a mapping of layouts)".into());
    }
    Ok(Value::Object(m))
}

/// A `<module>.conf` of the operator's kernel module ConfigMap: one
/// `param=value` a line (several on a line, and modprobe's `options
/// <module>` before them, are taken too); `#` comments and blank lines.
pub fn parse_module_params(text: &str, file: &str) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        let mut words = line.split_whitespace().peekable();
        if words.peek() == Some(&"options") {
            words.next();
            words.next();
        }
        for w in words {
            let bad = |why: &str| format!("{file} line {}: {w:?}: {why}", n + 1);
            let Some((p, v)) = w.split_once('=') else {
                return Err(bad("not param=value"));
            };
            let ident = !p.is_empty()
                && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !p.starts_with(|c: char| c.is_ascii_digit());
            if !ident {
                return Err(bad("not a module parameter name (letters, digits and _)"));
            }
            if v.is_empty() || v.contains(['"', '\'']) {
                return Err(bad("a value must be non-empty, without quotes"));
            }
            out.insert(p.to_string(), v.to_string());
        }
    }
    Ok(out)
}

/// `map` (named at `key`) as far as it can be used, or why not.
fn found<'a>(
    map: &str,
    maps: &'a BTreeMap<String, Seen>,
) -> Result<&'a BTreeMap<String, String>, String> {
    match maps.get(map) {
        Some(Seen::Found { data, .. }) => Ok(data),
        Some(Seen::NotFound) => Err("not found".into()),
        Some(Seen::Unreadable(why)) => Err(format!("cannot be read: {why}")),
        None => Err("not read yet".into()),
    }
}

fn keys(data: &BTreeMap<String, String>) -> String {
    if data.is_empty() {
        "it has none".into()
    } else {
        format!(
            "it has {}",
            data.keys().cloned().collect::<Vec<_>>().join(", ")
        )
    }
}

/// The ClusterPolicy `name` with `spec`, as each node is to be sent it:
/// the ConfigMaps it names (in `namespace`, as `maps` has them) inlined,
/// the device-plugin entry by each node's label (`labels`, node → value).
pub fn resolve(
    name: &str,
    spec: &Value,
    namespace: &str,
    maps: &BTreeMap<String, Seen>,
    labels: &BTreeMap<String, String>,
) -> PolicyTexts {
    let named = Named::from_spec(spec);
    let mut base = spec.clone();
    // The rollout is the controller's to run: agents are not sent it (and
    // so do not name it among the keys they leave out).
    if let Some(d) = base.get_mut("driver").and_then(|d| d.as_object_mut()) {
        d.remove("upgradePolicy");
    }
    let mut problems = Vec::new();
    let cm = |map: &str| format!("ConfigMap {namespace}/{map}");

    if let Some(map) = &named.mig_manager {
        let got = found(map, maps).and_then(|data| {
            let text = data
                .get(MIG_PARTED_KEY)
                .ok_or_else(|| format!("has no {MIG_PARTED_KEY} ({})", keys(data)))?;
            parse_mig_parted(text).map_err(|e| format!("{MIG_PARTED_KEY} {e}"))
        });
        match got {
            Ok(v) => base["migManager"]["config"]["inline"] = v,
            Err(why) => problems.push(format!(
                "{} (spec.migManager.config.name): {why}; the agents use their built-in MIG layouts",
                cm(map)
            )),
        }
    }
    if let Some(map) = &named.dcgm_exporter {
        let got = found(map, maps).and_then(|data| {
            data.get(COUNTERS_KEY)
                .cloned()
                .ok_or_else(|| format!("has no {COUNTERS_KEY} ({})", keys(data)))
        });
        match got {
            Ok(text) => base["dcgmExporter"]["config"]["inline"] = json!(text),
            Err(why) => problems.push(format!(
                "{} (spec.dcgmExporter.config.name): {why}; the agents export dcgm-exporter's default counters",
                cm(map)
            )),
        }
    }
    if let Some(map) = &named.kernel_modules {
        let got = found(map, maps).and_then(|data| {
            let mut modules = BTreeMap::new();
            for (key, text) in data {
                let Some((_, module)) = MODULE_FILES.iter().find(|(f, _)| f == key) else {
                    return Err(format!(
                        "{key} is no module's parameters file (the operator reads {})",
                        MODULE_FILES.map(|(f, _)| f).join(", ")
                    ));
                };
                modules.insert(*module, parse_module_params(text, key)?);
            }
            Ok(modules)
        });
        match got {
            Ok(modules) => {
                let kmc = &mut base["driver"]["kernelModuleConfig"];
                if let Some(o) = kmc.as_object_mut() {
                    o.remove("name");
                }
                for (module, params) in modules {
                    // Parameters the ClusterPolicy gives itself (gpu-agent's
                    // shape) win over the ConfigMap's.
                    let own = kmc.get(module).cloned().unwrap_or(json!({}));
                    let mut merged: serde_json::Map<String, Value> =
                        params.into_iter().map(|(k, v)| (k, json!(v))).collect();
                    if let Some(o) = own.as_object() {
                        merged.extend(o.clone());
                    }
                    kmc[module] = Value::Object(merged);
                }
            }
            Err(why) => problems.push(format!(
                "{} (spec.driver.kernelModuleConfig.name): {why}; the agents load the modules without its parameters",
                cm(map)
            )),
        }
    }

    let mut texts = PolicyTexts {
        name: name.into(),
        default: document(name, &base).into(),
        by_label: BTreeMap::new(),
        labels: BTreeMap::new(),
        problems: Vec::new(),
        unlabelled: None,
    };
    if let Some((map, default)) = &named.device_plugin {
        let what = format!("{} (spec.devicePlugin.config.name)", cm(map));
        match found(map, maps) {
            Err(why) => problems.push(format!(
                "{what}: {why}; the agents run without a device-plugin config"
            )),
            Ok(data) => {
                // Each entry's text, made once however many nodes select it.
                let mut made: BTreeMap<&str, Result<Arc<str>, String>> = BTreeMap::new();
                let mut text_of = |key: &str| -> Option<Result<Arc<str>, String>> {
                    let (k, entry) = data.get_key_value(key)?;
                    Some(
                        made.entry(k.as_str())
                            .or_insert_with(|| {
                                parse_plugin_config(entry).map(|v| {
                                    let mut spec = base.clone();
                                    spec["devicePlugin"]["config"]["inline"] = v;
                                    document(name, &spec).into()
                                })
                            })
                            .clone(),
                    )
                };
                // Nodes without the label: `default`, else the only entry.
                let unlabelled = match default {
                    Some(d) => Some(d.clone()),
                    None if data.len() == 1 => data.keys().next().cloned(),
                    None => None,
                };
                match &unlabelled {
                    Some(key) => match text_of(key) {
                        Some(Ok(t)) => texts.default = t,
                        Some(Err(why)) => problems.push(format!(
                            "{what}, entry {key}: {why}; nodes without the {DEVICE_PLUGIN_LABEL} label run without a device-plugin config"
                        )),
                        None => problems.push(format!(
                            "{what}: spec.devicePlugin.config.default names entry {key}, which it does not have ({}); nodes without the {DEVICE_PLUGIN_LABEL} label run without a device-plugin config",
                            keys(data)
                        )),
                    },
                    None => {
                        texts.unlabelled = Some(format!(
                            "{what}: {} entries ({}) and no spec.devicePlugin.config.default: nodes without the {DEVICE_PLUGIN_LABEL} label run without a device-plugin config",
                            data.len(),
                            data.keys().cloned().collect::<Vec<_>>().join(", ")
                        ))
                    }
                }
                // Labelled nodes, by value.
                let mut by_value: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
                for (node, value) in labels {
                    if !value.is_empty() {
                        by_value.entry(value).or_default().push(node);
                    }
                }
                for (value, nodes) in by_value {
                    let text = match text_of(value) {
                        Some(Ok(t)) => t,
                        Some(Err(why)) => {
                            problems.push(format!(
                                "{what}, entry {value} ({DEVICE_PLUGIN_LABEL} of {}): {why}; they run without a device-plugin config",
                                nodes.join(", ")
                            ));
                            document(name, &base).into()
                        }
                        None => {
                            problems.push(format!(
                                "{what}: no entry {value} ({}), which {DEVICE_PLUGIN_LABEL} of {} names; they run without a device-plugin config",
                                keys(data),
                                nodes.join(", ")
                            ));
                            document(name, &base).into()
                        }
                    };
                    for n in nodes {
                        texts.labels.insert(n.to_string(), value.to_string());
                    }
                    texts.by_label.insert(value.to_string(), text);
                }
            }
        }
    }
    texts.problems = problems;
    texts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(pairs: &[(&str, &str)]) -> Seen {
        Seen::Found {
            data: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            binary: vec![],
        }
    }

    fn spec_of(text: &str) -> Value {
        serde_json::from_str::<Value>(text).unwrap()
    }

    fn parsed(t: &Arc<str>) -> Value {
        serde_json::from_str(t).unwrap()
    }

    const TS: &str = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 10\n";
    const TS4: &str = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n";

    #[test]
    fn without_config_maps_the_text_is_the_cluster_policy_less_its_rollout() {
        let spec = spec_of(
            r#"{"driver": {"enabled": false, "upgradePolicy": {"autoUpgrade": true}}, "devicePlugin": {"config": {"name": "", "default": ""}}}"#,
        );
        let t = resolve("cp", &spec, "ns", &BTreeMap::new(), &BTreeMap::new());
        assert!(t.problems().is_empty());
        assert_eq!(
            parsed(&t.for_node("any")),
            json!({"apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy", "metadata": {"name": "cp"},
                   "spec": {"driver": {"enabled": false}, "devicePlugin": {"config": {"name": "", "default": ""}}}})
        );
        assert_eq!(Named::from_spec(&spec), Named::default());
    }

    #[test]
    fn the_device_plugin_entry_follows_the_node_label_then_the_default_then_the_only_one() {
        let spec = spec_of(r#"{"devicePlugin": {"config": {"name": "plugin-config"}}}"#);
        let mut maps = BTreeMap::new();
        // One entry: every node gets it.
        maps.insert("plugin-config".to_string(), found(&[("ts", TS)]));
        let t = resolve("cp", &spec, "gpu-operator", &maps, &BTreeMap::new());
        assert!(t.problems().is_empty(), "{:?}", t.problems());
        let doc = parsed(&t.for_node("n1"));
        assert_eq!(
            doc["spec"]["devicePlugin"]["config"]["inline"]["sharing"]["timeSlicing"]["resources"]
                [0]["replicas"],
            10
        );
        assert_eq!(
            doc["spec"]["devicePlugin"]["config"]["name"],
            "plugin-config"
        );

        // Two entries, no default: unlabelled nodes get none (said), a
        // labelled node its own.
        maps.insert(
            "plugin-config".to_string(),
            found(&[("ts", TS), ("four", TS4)]),
        );
        let labels: BTreeMap<String, String> = [("n2".to_string(), "four".to_string())].into();
        let t = resolve("cp", &spec, "gpu-operator", &maps, &labels);
        assert!(
            parsed(&t.for_node("n1"))["spec"]["devicePlugin"]["config"]
                .get("inline")
                .is_none()
        );
        assert_eq!(
            parsed(&t.for_node("n2"))["spec"]["devicePlugin"]["config"]["inline"]["sharing"]["timeSlicing"]
                ["resources"][0]["replicas"],
            4
        );
        let n1 = "n1".to_string();
        let n2 = "n2".to_string();
        assert!(t.problems_for(&[&n2]).is_empty(), "every node labelled");
        assert_eq!(
            t.problems_for(&[&n1, &n2]),
            [
                "ConfigMap gpu-operator/plugin-config (spec.devicePlugin.config.name): 2 entries (four, ts) and no spec.devicePlugin.config.default: nodes without the nvidia.com/device-plugin.config label run without a device-plugin config"
            ]
        );

        // The default picks for unlabelled nodes; nodes selecting the same
        // entry share one text.
        let spec =
            spec_of(r#"{"devicePlugin": {"config": {"name": "plugin-config", "default": "ts"}}}"#);
        let labels: BTreeMap<String, String> = [
            ("n2".to_string(), "four".to_string()),
            ("n3".to_string(), "four".to_string()),
            ("n4".to_string(), "ts".to_string()),
        ]
        .into();
        let t = resolve("cp", &spec, "gpu-operator", &maps, &labels);
        assert!(t.problems_for(&[&n1, &n2]).is_empty());
        assert_eq!(t.for_node("n1"), t.for_node("n4"));
        assert!(Arc::ptr_eq(&t.for_node("n2"), &t.for_node("n3")));
        assert_ne!(t.for_node("n1"), t.for_node("n2"));
    }

    #[test]
    fn a_label_naming_no_entry_and_an_entry_that_does_not_parse_are_said() {
        let spec = spec_of(r#"{"devicePlugin": {"config": {"name": "pc", "default": "bad"}}}"#);
        let mut maps = BTreeMap::new();
        maps.insert(
            "pc".to_string(),
            found(&[
                ("bad", "sharing: [oops"),
                ("ts", TS),
                ("v2", "version: v2\n"),
            ]),
        );
        let labels: BTreeMap<String, String> = [
            ("n2".to_string(), "missing".to_string()),
            ("n3".to_string(), "v2".to_string()),
            ("n4".to_string(), "ts".to_string()),
        ]
        .into();
        let t = resolve("cp", &spec, "ns", &maps, &labels);
        let p = t.problems();
        assert_eq!(p.len(), 3, "{p:#?}");
        assert!(
            p[0].starts_with("ConfigMap ns/pc (spec.devicePlugin.config.name), entry bad: does not parse as YAML: "),
            "{}",
            p[0]
        );
        assert!(p[0].ends_with("; nodes without the nvidia.com/device-plugin.config label run without a device-plugin config"), "{}", p[0]);
        assert_eq!(
            p[1],
            "ConfigMap ns/pc (spec.devicePlugin.config.name): no entry missing (it has bad, ts, v2), which nvidia.com/device-plugin.config of n2 names; they run without a device-plugin config"
        );
        assert_eq!(
            p[2],
            "ConfigMap ns/pc (spec.devicePlugin.config.name), entry v2 (nvidia.com/device-plugin.config of n3): version \"v2\": gpu-agent reads version v1; they run without a device-plugin config"
        );
        for n in ["n1", "n2", "n3"] {
            assert!(
                parsed(&t.for_node(n))["spec"]["devicePlugin"]["config"]
                    .get("inline")
                    .is_none(),
                "{n}"
            );
        }
        assert!(
            parsed(&t.for_node("n4"))["spec"]["devicePlugin"]["config"]
                .get("inline")
                .is_some()
        );
    }

    #[test]
    fn a_missing_or_unreadable_config_map_is_left_out_and_said() {
        let spec = spec_of(
            r#"{"devicePlugin": {"config": {"name": "pc"}}, "migManager": {"config": {"name": "mig"}}, "dcgmExporter": {"config": {"name": "counters"}}, "driver": {"kernelModuleConfig": {"name": "kmod"}}}"#,
        );
        let mut maps = BTreeMap::new();
        maps.insert("pc".to_string(), Seen::NotFound);
        maps.insert(
            "mig".to_string(),
            Seen::Unreadable("configmaps \"mig\" is forbidden".into()),
        );
        maps.insert("counters".to_string(), found(&[("other.csv", "")]));
        let t = resolve("cp", &spec, "ns", &maps, &BTreeMap::new());
        assert_eq!(
            t.problems(),
            [
                "ConfigMap ns/mig (spec.migManager.config.name): cannot be read: configmaps \"mig\" is forbidden; the agents use their built-in MIG layouts",
                "ConfigMap ns/counters (spec.dcgmExporter.config.name): has no dcgm-metrics.csv (it has other.csv); the agents export dcgm-exporter's default counters",
                "ConfigMap ns/kmod (spec.driver.kernelModuleConfig.name): not read yet; the agents load the modules without its parameters",
                "ConfigMap ns/pc (spec.devicePlugin.config.name): not found; the agents run without a device-plugin config",
            ]
        );
        // The policy is sent without them, the names as they were.
        let doc = parsed(&t.for_node("n1"));
        assert_eq!(doc["spec"], spec);
    }

    #[test]
    fn mig_parted_counters_and_module_parameters_are_inlined() {
        let spec = spec_of(
            r#"{"migManager": {"config": {"name": "mig", "default": "all-disabled"}}, "dcgmExporter": {"config": {"name": "counters"}}, "driver": {"kernelModuleConfig": {"name": "kmod", "nvidia": {"NVreg_EnableGpuFirmware": "1"}}}}"#,
        );
        let mut maps = BTreeMap::new();
        maps.insert(
            "mig".to_string(),
            found(&[(
                "config.yaml",
                "version: v1\nmig-configs:\n  all-disabled:\n  - devices: all\n    mig-enabled: false\n",
            )]),
        );
        let csv = "# field, type, help\nDCGM_FI_DEV_GPU_TEMP, gauge, GPU temperature (in C).\n";
        maps.insert("counters".to_string(), found(&[("dcgm-metrics.csv", csv)]));
        maps.insert(
            "kmod".to_string(),
            found(&[
                (
                    "nvidia.conf",
                    "NVreg_EnableGpuFirmware=0\n# a comment\n\nNVreg_RegistryDwords=RMUseSwI2c=0x01;RMI2cSpeed=100\n",
                ),
                ("nvidia-uvm.conf", "options nvidia-uvm uvm_perf_prefetch_enable=0\n"),
            ]),
        );
        let t = resolve("cp", &spec, "ns", &maps, &BTreeMap::new());
        assert!(t.problems().is_empty(), "{:?}", t.problems());
        let s = parsed(&t.for_node("n"))["spec"].clone();
        assert_eq!(
            s["migManager"]["config"]["inline"]["mig-configs"]["all-disabled"][0]["mig-enabled"],
            false
        );
        assert_eq!(s["migManager"]["config"]["default"], "all-disabled");
        assert_eq!(
            s["dcgmExporter"]["config"],
            json!({"name": "counters", "inline": csv})
        );
        // The ConfigMap's name goes (its content is here); the
        // ClusterPolicy's own parameter wins over the ConfigMap's.
        assert_eq!(
            s["driver"]["kernelModuleConfig"],
            json!({
                "nvidia": {"NVreg_EnableGpuFirmware": "1", "NVreg_RegistryDwords": "RMUseSwI2c=0x01;RMI2cSpeed=100"},
                "nvidia-uvm": {"uvm_perf_prefetch_enable": "0"},
            })
        );
    }

    #[test]
    fn config_maps_that_do_not_parse_are_refused_whole_naming_the_line() {
        let spec = spec_of(
            r#"{"migManager": {"config": {"name": "mig"}}, "driver": {"kernelModuleConfig": {"name": "kmod"}}}"#,
        );
        let cases: [(&str, (&str, &str), &str); 6] = [
            (
                "mig",
                ("config.yaml", "mig-configs: {}\n"),
                "config.yaml has no version (mig-parted's config is version v1)",
            ),
            (
                "mig",
                ("config.yaml", "version: v1\n"),
                "config.yaml has no mig-configs (a mapping of layouts)",
            ),
            (
                "mig",
                ("config.yml", "version: v1\n"),
                "has no config.yaml (it has config.yml)",
            ),
            (
                "kmod",
                ("nvidia.conf", "NVreg_A=1\nNVreg_B\n"),
                "nvidia.conf line 2: \"NVreg_B\": not param=value",
            ),
            (
                "kmod",
                ("nvidia.conf", "NVreg_A=\"x y\"\n"),
                "nvidia.conf line 1: \"NVreg_A=\\\"x\": a value must be non-empty, without quotes",
            ),
            (
                "kmod",
                ("nvidia-fs.conf", "a=1\n"),
                "nvidia-fs.conf is no module's parameters file (the operator reads nvidia.conf, nvidia-uvm.conf, nvidia-modeset.conf, nvidia-peermem.conf)",
            ),
        ];
        for (map, kv, why) in cases {
            let mut maps = BTreeMap::new();
            maps.insert("mig".to_string(), found(&[]));
            maps.insert("kmod".to_string(), found(&[]));
            maps.insert(map.to_string(), found(&[kv]));
            let t = resolve("cp", &spec, "ns", &maps, &BTreeMap::new());
            let p = t.problems();
            assert!(
                p.iter()
                    .any(|p| p.contains(&format!("ConfigMap ns/{map} ("))
                        && p.contains(&format!("): {why}; "))),
                "{why}: {p:#?}"
            );
            let s = parsed(&t.for_node("n"))["spec"].clone();
            if map == "mig" {
                assert!(s["migManager"]["config"].get("inline").is_none());
            } else {
                assert_eq!(s["driver"]["kernelModuleConfig"], json!({"name": "kmod"}));
            }
        }
    }

    /// The operator's own files, unchanged (../shared beside the checkout):
    /// its test's time-slicing config and its default layouts ConfigMap.
    #[test]
    fn the_operators_own_config_maps_resolve() {
        let up = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/upstream/gpu-operator");
        let plugin = std::fs::read_to_string(up.join("tests_plugin-config.yaml")).unwrap();
        let cm: ConfigMap = serde_yaml_ng::from_str(
            &std::fs::read_to_string(up.join("state-mig-manager_0400_configmap.yaml")).unwrap(),
        )
        .unwrap();
        let mig_name = cm.metadata.name.clone().unwrap();
        let mut maps = BTreeMap::new();
        maps.insert(
            "time-slicing-config".to_string(),
            found(&[("plugin-config.yaml", &plugin)]),
        );
        maps.insert(mig_name.clone(), Seen::of(&cm));
        let spec = json!({
            "devicePlugin": {"config": {"name": "time-slicing-config", "default": ""}},
            "migManager": {"config": {"name": mig_name, "default": "all-disabled"}},
        });
        let t = resolve(
            "cluster-policy",
            &spec,
            "gpu-operator",
            &maps,
            &BTreeMap::new(),
        );
        assert!(t.problems().is_empty(), "{:?}", t.problems());
        let s = parsed(&t.for_node("n"))["spec"].clone();
        assert_eq!(
            s["devicePlugin"]["config"]["inline"],
            json!({"version": "v1", "sharing": {"timeSlicing": {"renameByDefault": false,
                   "resources": [{"name": "nvidia.com/gpu", "replicas": 10}]}}})
        );
        let layouts = s["migManager"]["config"]["inline"]["mig-configs"]
            .as_object()
            .unwrap();
        assert!(layouts.contains_key("all-balanced") && layouts.contains_key("all-7g.141gb"));
    }
}
