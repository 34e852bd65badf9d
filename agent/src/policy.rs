//! The policy: what the agent should do on this node, in YAML shaped like the
//! GPU Operator's ClusterPolicy (`spec.driver`, `spec.toolkit`,
//! `spec.devicePlugin`, ...), so that a team moving from the operator can
//! bring its values. Every key has a documented default (docs/policy.md);
//! an empty file means all defaults. Unknown keys and wrong types are
//! refused with the key's path.

use std::collections::BTreeMap;
use std::path::Path;

use hostlib::strict::{self, YamlError};
use serde::{Deserialize, Serialize};

pub use gpu_cdi::spec::{CdiSpec, INSTALLED_HOOK_PATH};
pub use gpu_dra::spec::DraSpec;
pub use gpu_driver::spec::{DriverSpec, OnParamMismatch};
pub use gpu_health::HealthSpec;
pub use gpu_metrics::spec::{CountersConfig, DcgmExporterSpec};
pub use gpu_mig::spec::{MigManagerConfig, MigManagerSpec};
pub use gpu_resources::config::{DevicePluginConfig, DevicePluginSpec, MigSpec, MigStrategy};
pub use gpu_runtime::spec::{ContainerRuntime, ContainerdSpec, ReloadMode, ToolkitSpec};

/// A policy file: a ClusterPolicy-like object, or just its `spec`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PolicyFile {
    /// Free text (e.g. `gpu-agent/v1alpha1`); not interpreted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    /// `ClusterPolicy` or `GpuAgentPolicy`, if given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Kubernetes metadata, kept but not interpreted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<serde_yaml_ng::Value>,
    #[serde(default)]
    pub spec: Policy,
}

/// What the agent does. Field defaults are the documented ones.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Policy {
    /// Seconds between reconciles (the stages run again, repairing drift);
    /// 0: only when the policy file changes and on SIGHUP. Default 60.
    #[serde(default = "default_reconcile_interval")]
    pub reconcile_interval_seconds: u64,
    #[serde(default)]
    pub operator: OperatorSpec,
    #[serde(default)]
    pub driver: DriverSpec,
    #[serde(default)]
    pub toolkit: ToolkitSpec,
    #[serde(default)]
    pub cdi: CdiSpec,
    #[serde(default)]
    pub device_plugin: DevicePluginSpec,
    #[serde(default)]
    pub dcgm_exporter: DcgmExporterSpec,
    #[serde(default)]
    pub gfd: Toggle,
    #[serde(default)]
    pub mig_manager: MigManagerSpec,
    #[serde(default)]
    pub validator: ValidatorSpec,
    #[serde(default)]
    pub mig: MigSpec,
    #[serde(default)]
    pub health: HealthSpec,
    #[serde(default)]
    pub dra: DraSpec,
    #[serde(default)]
    pub host_paths: HostPaths,
}

/// `spec.hostPaths`: where the host keeps what gpu-agent talks to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HostPaths {
    /// The kubelet's `--root-dir` (k0s: `/var/lib/k0s/kubelet`): its
    /// `device-plugins` directory (the device plugin's sockets) and
    /// `pod-resources/kubelet.sock` (pod labels on the metrics) are under it.
    #[serde(default = "default_kubelet_root_dir")]
    pub kubelet_root_dir: String,
}

fn default_kubelet_root_dir() -> String {
    "/var/lib/kubelet".into()
}

impl Default for HostPaths {
    fn default() -> Self {
        HostPaths {
            kubelet_root_dir: default_kubelet_root_dir(),
        }
    }
}

impl HostPaths {
    /// The kubelet's device-plugin directory (a host path).
    pub fn device_plugin_dir(&self) -> String {
        format!(
            "{}/device-plugins",
            self.kubelet_root_dir.trim_end_matches('/')
        )
    }

    /// The kubelet's pod-resources socket (a host path).
    pub fn pod_resources_socket(&self) -> String {
        format!(
            "{}/pod-resources/kubelet.sock",
            self.kubelet_root_dir.trim_end_matches('/')
        )
    }
}

fn default_reconcile_interval() -> u64 {
    60
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            reconcile_interval_seconds: default_reconcile_interval(),
            operator: OperatorSpec::default(),
            driver: DriverSpec::default(),
            toolkit: ToolkitSpec::default(),
            cdi: CdiSpec::default(),
            device_plugin: DevicePluginSpec::default(),
            dcgm_exporter: DcgmExporterSpec::default(),
            gfd: Toggle::default(),
            mig_manager: MigManagerSpec::default(),
            validator: ValidatorSpec::default(),
            mig: MigSpec::default(),
            health: HealthSpec::default(),
            dra: DraSpec::default(),
            host_paths: HostPaths::default(),
        }
    }
}

/// `spec.validator`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ValidatorSpec {
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Also run a short-lived container with one GPU injected by CDI through
    /// the node's CRI runtime, and check inside it (default false).
    #[serde(default)]
    pub workload: bool,
    /// The image of that container (it needs `sh`); pulled if absent.
    #[serde(default = "default_workload_image")]
    pub workload_image: String,
    /// The CRI socket (a host path); default by runtime:
    /// `/run/containerd/containerd.sock`, `/var/run/crio/crio.sock`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cri_socket: Option<String>,
}

fn default_workload_image() -> String {
    "docker.io/library/busybox:1.36".into()
}

impl Default for ValidatorSpec {
    fn default() -> Self {
        ValidatorSpec {
            enabled: true,
            workload: false,
            workload_image: default_workload_image(),
            cri_socket: None,
        }
    }
}

pub(crate) fn yes() -> bool {
    true
}

/// `{enabled: bool}`, default enabled.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Toggle {
    #[serde(default = "yes")]
    pub enabled: bool,
}

impl Default for Toggle {
    fn default() -> Self {
        Toggle { enabled: true }
    }
}

/// `spec.operator`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct OperatorSpec {
    /// The container runtime to configure: containerd (default), crio, docker.
    #[serde(default)]
    pub default_runtime: ContainerRuntime,
    /// The runtime name (and RuntimeClass) to add, default `nvidia`.
    #[serde(default = "default_runtime_class")]
    pub runtime_class: String,
}

fn default_runtime_class() -> String {
    "nvidia".into()
}

impl Default for OperatorSpec {
    fn default() -> Self {
        OperatorSpec {
            default_runtime: ContainerRuntime::default(),
            runtime_class: default_runtime_class(),
        }
    }
}

/// Where the GPU Operator's ClusterPolicy names a ConfigMap (`{name: ...}`)
/// at a key that gpu-agent gives content instead: those ConfigMaps hold what
/// the operator's pods mount, which an agent on a node cannot read
/// (gpu-controller reads them and sends their content).
const OPERATOR_CONFIG_MAPS: [&str; 2] = [
    "spec.driver.kernelModuleConfig.name",
    "spec.dcgmExporter.config.name",
];

/// A policy that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("{path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Invalid(#[from] YamlError),
}

impl Policy {
    /// What the policy wants of the container runtime: `spec.operator`'s
    /// runtime and class, `spec.toolkit`, and whether CDI is on.
    pub fn runtime_wanted(&self) -> gpu_runtime::Wanted<'_> {
        gpu_runtime::Wanted {
            runtime: self.operator.default_runtime,
            runtime_class: &self.operator.runtime_class,
            toolkit: &self.toolkit,
            enable_cdi: self.cdi.enabled,
        }
    }
    /// Parses a policy document; `origin` names it in errors.
    pub fn from_yaml(text: &str, origin: &str) -> Result<Self, PolicyError> {
        let file: PolicyFile = strict::from_yaml(text, origin)?;
        if let Some(kind) = &file.kind
            && kind != "ClusterPolicy"
            && kind != "GpuAgentPolicy"
        {
            return Err(YamlError::invalid(
                origin,
                "kind",
                format!("{kind:?} is not a policy (expected ClusterPolicy or GpuAgentPolicy)"),
            )
            .into());
        }
        let policy = file.spec;
        policy.validate(origin)?;
        Ok(policy)
    }

    /// Parses a cluster's ClusterPolicy as the GPU Operator takes it: keys
    /// gpu-agent does not know (the operator's images, sandbox workloads,
    /// ...) are left out and named, not refused, and so are the ConfigMaps
    /// it names where gpu-agent takes the content itself
    /// (`spec.driver.kernelModuleConfig.name`, `spec.dcgmExporter.config.name`;
    /// an empty name names none); anything else wrong is an error as in
    /// [`Policy::from_yaml`].
    pub fn from_cluster_yaml(text: &str, origin: &str) -> Result<(Self, Vec<String>), PolicyError> {
        let mut doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(text)
            .map_err(|e| YamlError::invalid(origin, "(document)", e.to_string()))?;
        let mut ignored = Vec::new();
        // Each pass names one unknown key; a document has a bounded number.
        for _ in 0..500 {
            let text = serde_yaml_ng::to_string(&doc)
                .map_err(|e| YamlError::invalid(origin, "(document)", e.to_string()))?;
            match Self::from_yaml(&text, origin) {
                Ok(p) => {
                    // Taken in the operator's shape, but not used here
                    // (unless gpu-controller sent the content beside it).
                    for path in OPERATOR_CONFIG_MAPS {
                        let mut at = &doc;
                        let mut parent = &doc;
                        for part in path.split('.') {
                            parent = at;
                            at = at.get(part).unwrap_or(&serde_yaml_ng::Value::Null);
                        }
                        if at.as_str().is_some_and(|name| !name.is_empty())
                            && parent.get("inline").is_none()
                        {
                            ignored.push(path.to_string());
                        }
                    }
                    return Ok((p, ignored));
                }
                Err(PolicyError::Invalid(e)) if e.message.starts_with("unknown key") => {
                    if !remove_path(&mut doc, &e.path) {
                        return Err(PolicyError::Invalid(e));
                    }
                    ignored.push(e.path);
                }
                Err(e) => return Err(e),
            }
        }
        Err(YamlError::invalid(
            origin,
            "(document)",
            "too many keys gpu-agent does not know",
        )
        .into())
    }

    /// Reads a policy file.
    pub fn from_file(path: &Path) -> Result<Self, PolicyError> {
        let text = std::fs::read_to_string(path).map_err(|source| PolicyError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_yaml(&text, &path.display().to_string())
    }

    fn validate(&self, origin: &str) -> Result<(), YamlError> {
        let root = &self.host_paths.kubelet_root_dir;
        if !root.starts_with('/') || root.split('/').any(|c| c == "..") {
            return Err(YamlError::invalid(
                origin,
                "spec.hostPaths.kubeletRootDir",
                format!("{root:?} is not an absolute host path"),
            ));
        }
        let rc = &self.operator.runtime_class;
        let dns_label = !rc.is_empty()
            && rc.len() <= 63
            && rc
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !rc.starts_with('-')
            && !rc.ends_with('-');
        if !dns_label {
            return Err(YamlError::invalid(
                origin,
                "spec.operator.runtimeClass",
                format!(
                    "{rc:?} is not a valid runtime name (lower-case letters, digits and '-', at most 63)"
                ),
            ));
        }
        if let Some(v) = &self.driver.version {
            let ok = !v.is_empty()
                && v.split('.')
                    .all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()));
            if !ok {
                return Err(YamlError::invalid(
                    origin,
                    "spec.driver.version",
                    format!("{v:?} is not a driver version like 550.127.08"),
                ));
            }
        }
        self.check_driver(origin)?;
        if let Err((key, why)) = gpu_dra::spec::check(&self.dra, self.device_plugin.enabled) {
            return Err(YamlError::invalid(origin, key, why));
        }
        if let Some(c) = self.device_plugin.config.as_ref() {
            if c.file.is_some() && c.inline.is_some() {
                return Err(YamlError::invalid(
                    origin,
                    "spec.devicePlugin.config",
                    "give the config as `file` or `inline`, not both",
                ));
            }
            if let Some(inline) = &c.inline {
                inline.check(origin, "spec.devicePlugin.config.inline.")?;
            }
        }
        let m = &self.mig_manager;
        if let Some(c) = m.config.as_ref() {
            if c.file.is_some() && c.inline.is_some() {
                return Err(YamlError::invalid(
                    origin,
                    "spec.migManager.config",
                    "give the layouts as `file` or `inline`, not both",
                ));
            }
            if let Some(inline) = &c.inline {
                inline.check(origin, "spec.migManager.config.inline.")?;
            }
            if let (Some(a), Some(b)) = (&m.default, m.config_default())
                && a != b
            {
                return Err(YamlError::invalid(
                    origin,
                    "spec.migManager.default",
                    format!("{a:?} differs from spec.migManager.config.default {b:?}; give one"),
                ));
            }
        }
        if let (Some(layout), Some(inline)) = (
            m.selected_layout(),
            m.config.as_ref().and_then(|c| c.inline.as_ref()),
        ) {
            inline.layout(layout, origin, "spec.migManager.default")?;
        }
        if let Some(p) = &self.device_plugin.cdi_annotation_prefix
            && !p.ends_with('/')
        {
            return Err(YamlError::invalid(
                origin,
                "spec.devicePlugin.cdiAnnotationPrefix",
                format!("{p:?} must end with '/' (e.g. cdi.k8s.io/)"),
            ));
        }
        let c = &self.toolkit.containerd;
        for (key, path) in [
            ("spec.toolkit.containerd.config", &c.config),
            ("spec.toolkit.containerd.dropInDir", &c.drop_in_dir),
            ("spec.toolkit.containerd.binary", &c.binary),
            ("spec.cdi.specDir", &self.cdi.spec_dir),
            ("spec.cdi.hookPath", &self.cdi.hook_path),
        ] {
            if !path.starts_with('/') || path.split('/').any(|p| p == "..") {
                return Err(YamlError::invalid(
                    origin,
                    key,
                    format!("{path:?} must be an absolute host path without `..`"),
                ));
            }
        }
        if self.cdi.default && !self.cdi.enabled {
            return Err(YamlError::invalid(
                origin,
                "spec.cdi.default",
                "CDI cannot be the default while spec.cdi.enabled is false",
            ));
        }
        Ok(())
    }
}

impl Policy {
    /// `spec.driver`'s own rules: module names gpu-agent loads, parameter
    /// names and values the kernel's parser takes, host paths, a sha256.
    fn check_driver(&self, origin: &str) -> Result<(), YamlError> {
        let d = &self.driver;
        for (module, params) in &d.kernel_module_config {
            let key = format!("spec.driver.kernelModuleConfig.{module}");
            let name = module.replace('-', "_");
            if !kmod::modules::LOAD_ORDER.iter().any(|(m, _)| *m == name) {
                let known: Vec<&str> = kmod::modules::LOAD_ORDER.iter().map(|(m, _)| *m).collect();
                return Err(YamlError::invalid(
                    origin,
                    key,
                    format!(
                        "{module:?} is not a module gpu-agent loads ({})",
                        known.join(", ")
                    ),
                ));
            }
            for (p, v) in params {
                let ident = !p.is_empty()
                    && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    && !p.starts_with(|c: char| c.is_ascii_digit());
                if !ident {
                    return Err(YamlError::invalid(
                        origin,
                        format!("{key}.{p}"),
                        "not a module parameter name (letters, digits and _)",
                    ));
                }
                if v.is_empty() || v.chars().any(|c| c.is_whitespace() || c == '"') {
                    return Err(YamlError::invalid(
                        origin,
                        format!("{key}.{p}"),
                        format!("{v:?}: a value must be non-empty, without spaces or quotes"),
                    ));
                }
            }
        }
        for (field, value) in [("bundle", &d.bundle), ("moduleDir", &d.module_dir)] {
            if let Some(v) = value
                && !v.starts_with('/')
            {
                return Err(YamlError::invalid(
                    origin,
                    format!("spec.driver.{field}"),
                    format!("{v:?} is not an absolute host path"),
                ));
            }
        }
        if d.bundle.is_some() && d.module_dir.is_some() {
            return Err(YamlError::invalid(
                origin,
                "spec.driver",
                "give `bundle` or `moduleDir`, not both",
            ));
        }
        if let Some(h) = &d.bundle_sha256
            && (h.len() != 64 || !h.chars().all(|c| c.is_ascii_hexdigit()))
        {
            return Err(YamlError::invalid(
                origin,
                "spec.driver.bundleSha256",
                format!("{h:?} is not a sha256 (64 hex digits)"),
            ));
        }
        Ok(())
    }

    /// `spec.driver.kernelModuleConfig` with module names as the kernel
    /// knows them (`nvidia-uvm` → `nvidia_uvm`).
    pub fn module_params(&self) -> BTreeMap<String, BTreeMap<String, String>> {
        self.driver.module_params()
    }
}

/// Removes the key at `path` (`spec.a.b`, `spec.list[2].c`) from `doc`.
fn remove_path(doc: &mut serde_yaml_ng::Value, path: &str) -> bool {
    let mut parts: Vec<&str> = path.split('.').collect();
    let Some(last) = parts.pop() else {
        return false;
    };
    let mut at = doc;
    for part in parts {
        let (key, index) = match part.split_once('[') {
            Some((k, rest)) => (k, rest.trim_end_matches(']').parse::<usize>().ok()),
            None => (part, None),
        };
        let Some(next) = at.get_mut(key) else {
            return false;
        };
        at = match index {
            Some(i) => match next.get_mut(i) {
                Some(v) => v,
                None => return false,
            },
            None => next,
        };
    }
    at.as_mapping_mut().and_then(|m| m.remove(last)).is_some()
}

#[cfg(test)]
mod settings_tests;

#[cfg(test)]
mod tests;
