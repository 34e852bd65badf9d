//! The device plugin's configuration, in NVIDIA's device-plugin config
//! schema (`version: v1`, `flags`, `sharing.timeSlicing` / `sharing.mps`),
//! accepted as-is so existing configs carry over. Unlike NVIDIA's plugin we
//! honour each sharing entry's `devices` selection and `rename`, so that GPUs
//! can have different replica counts.

use hostlib::strict::{self, YamlError};
use serde::{Deserialize, Serialize};

/// A whole config file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PluginConfig {
    /// Must be `v1`.
    pub version: String,
    #[serde(default)]
    pub flags: Flags,
    /// NVIDIA ignores this section too (resource renaming through patterns);
    /// accepted so that existing files parse, refused if non-empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<serde_yaml_ng::Value>,
    #[serde(default)]
    pub sharing: Sharing,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub imex: Option<serde_yaml_ng::Value>,
}

/// `flags`: the plugin's command-line flags as config.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Flags {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_strategy: Option<MigStrategy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fail_on_init_error: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps_root: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvidia_driver_root: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvidia_dev_root: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gdrcopy_enabled: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gds_enabled: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mofed_enabled: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_node_feature_api: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_discovery_strategy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin: Option<PluginFlags>,
    /// GPU feature discovery's flags; read by the labels stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gfd: Option<serde_yaml_ng::Value>,
}

/// `flags.plugin`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PluginFlags {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pass_device_specs: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_list_strategy: Option<OneOrMany<DeviceListStrategy>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_id_strategy: Option<DeviceIdStrategy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cdi_annotation_prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvidia_ctk_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_driver_root: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_devices_allocation_policy: Option<AllocationPolicy>,
}

/// A value or a list of values (`deviceListStrategy: envvar` or `[envvar, cdi-cri]`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<'de, T: serde::de::DeserializeOwned> Deserialize<'de> for OneOrMany<T> {
    /// Says which value is wrong (an untagged enum would only say "no variant matched").
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match serde_yaml_ng::Value::deserialize(d)? {
            serde_yaml_ng::Value::Sequence(items) => items
                .into_iter()
                .enumerate()
                .map(|(i, v)| {
                    T::deserialize(v).map_err(|e| D::Error::custom(format!("{e} (list item {i})")))
                })
                .collect::<Result<Vec<T>, _>>()
                .map(OneOrMany::Many),
            v => T::deserialize(v)
                .map(OneOrMany::One)
                .map_err(D::Error::custom),
        }
    }
}

impl<T: Clone> OneOrMany<T> {
    pub fn to_vec(&self) -> Vec<T> {
        match self {
            OneOrMany::One(t) => vec![t.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

/// How allocated devices are passed to the container runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceListStrategy {
    /// `NVIDIA_VISIBLE_DEVICES=<ids>`.
    Envvar,
    /// `/dev/null` mounts under `/var/run/nvidia-container-devices/<id>`.
    VolumeMounts,
    /// CDI device names in a `cdi.k8s.io/...` annotation.
    CdiAnnotations,
    /// CDI device names in the CRI field (Kubernetes ≥ 1.28).
    CdiCri,
}

/// How devices are named to the runtime.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceIdStrategy {
    #[default]
    Uuid,
    Index,
}

/// Which GPU a shared (replicated) request prefers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AllocationPolicy {
    /// The GPU with the fewest replicas in use.
    #[default]
    Distributed,
    /// The GPU with the most replicas in use.
    Packed,
}

/// `sharing`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Sharing {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_slicing: Option<SharingSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps: Option<SharingSpec>,
}

/// `sharing.timeSlicing` / `sharing.mps`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SharingSpec {
    /// Name shared resources `<name>.shared` unless an entry renames them.
    #[serde(default)]
    pub rename_by_default: bool,
    /// Refuse requests for more than one replica (default false for
    /// time-slicing and true for MPS, as NVIDIA's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fail_requests_greater_than_one: Option<bool>,
    #[serde(default)]
    pub resources: Vec<ReplicatedResource>,
}

/// One sharing entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ReplicatedResource {
    /// The resource shared, `nvidia.com/gpu` (or a MIG resource).
    pub name: String,
    /// Advertise the replicas under this name instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rename: Option<String>,
    /// Which GPUs: `all` (default), a count of the first N, or a list of
    /// indices and UUIDs.
    #[serde(default)]
    pub devices: DeviceSelection,
    /// Replicas of each selected GPU, at least 2.
    pub replicas: u32,
}

/// `devices: all | N | [0, 1, "GPU-..."]`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DeviceSelection {
    #[default]
    #[serde(skip)]
    All,
    Named(AllKeyword),
    Count(u32),
    List(Vec<DeviceRef>),
}

/// The literal `all`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AllKeyword {
    All,
}

/// One entry of a `devices` list.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DeviceRef {
    Index(u32),
    Id(String),
}

impl DeviceSelection {
    /// True when the device is selected: a GPU (index `3`, its UUID) or a
    /// MIG device (index name `3:1`, its MIG UUID) on GPU `index`.
    pub fn selects(&self, index: u32, uuid: &str, index_name: &str) -> bool {
        match self {
            DeviceSelection::All | DeviceSelection::Named(AllKeyword::All) => true,
            DeviceSelection::Count(n) => index < *n,
            DeviceSelection::List(refs) => refs.iter().any(|r| match r {
                DeviceRef::Index(i) => i.to_string() == index_name,
                DeviceRef::Id(s) => s == uuid || s == index_name,
            }),
        }
    }
}

/// Which sharing is in force.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SharingStrategy {
    None,
    TimeSlicing,
    Mps,
}

impl SharingStrategy {
    pub fn as_str(self) -> &'static str {
        match self {
            SharingStrategy::None => "none",
            SharingStrategy::TimeSlicing => "time-slicing",
            SharingStrategy::Mps => "mps",
        }
    }

    /// Where the strategy is configured: `sharing.timeSlicing`, `sharing.mps`.
    pub fn config_key(self) -> &'static str {
        match self {
            SharingStrategy::None => "sharing",
            SharingStrategy::TimeSlicing => "sharing.timeSlicing",
            SharingStrategy::Mps => "sharing.mps",
        }
    }

    /// Whether requests for more than one replica are refused when the
    /// config does not say: yes for MPS, no for time-slicing (as NVIDIA's).
    pub fn fail_requests_greater_than_one_default(self) -> bool {
        self == SharingStrategy::Mps
    }
}

impl PluginConfig {
    /// Parses and checks a config; `origin` names it in errors.
    pub fn from_yaml(text: &str, origin: &str) -> Result<Self, YamlError> {
        let config: PluginConfig = strict::from_yaml(text, origin)?;
        config.check(origin, "")?;
        Ok(config)
    }

    /// Checks the rules the schema cannot express; error paths get `prefix`
    /// (for a config inline in a policy).
    pub fn check(&self, origin: &str, prefix: &str) -> Result<(), YamlError> {
        let invalid =
            |path: String, msg: String| YamlError::invalid(origin, format!("{prefix}{path}"), msg);
        if self.version != "v1" {
            return Err(invalid(
                "version".into(),
                format!(
                    "{:?} is not a supported config version (expected v1)",
                    self.version
                ),
            ));
        }
        if let Some(r) = &self.resources
            && !r.is_null()
            && r.as_mapping().is_none_or(|m| !m.is_empty())
        {
            return Err(invalid(
                "resources".into(),
                "resource renaming by pattern is not supported (NVIDIA's plugin ignores it too); use sharing.timeSlicing.resources[].rename".into(),
            ));
        }
        let f = &self.flags;
        for (key, on) in [
            ("flags.gdrcopyEnabled", f.gdrcopy_enabled),
            ("flags.gdsEnabled", f.gds_enabled),
            ("flags.mofedEnabled", f.mofed_enabled),
        ] {
            if on == Some(true) {
                return Err(invalid(key.into(), "not supported by gpu-agent yet".into()));
            }
        }
        if let Some(root) = &f.mps_root
            && !root.starts_with('/')
        {
            return Err(invalid(
                "flags.mpsRoot".into(),
                format!("{root:?} is not an absolute host path"),
            ));
        }
        for (key, spec) in [
            (SharingStrategy::TimeSlicing, &self.sharing.time_slicing),
            (SharingStrategy::Mps, &self.sharing.mps),
        ] {
            let Some(spec) = spec else { continue };
            for (i, r) in spec.resources.iter().enumerate() {
                let at = |k: &str| format!("{}.resources[{i}].{k}", key.config_key());
                if r.replicas < 2 {
                    return Err(invalid(
                        at("replicas"),
                        format!("{} replicas; sharing needs at least 2", r.replicas),
                    ));
                }
                if !valid_resource_name(&r.name) {
                    return Err(invalid(
                        at("name"),
                        format!("{:?} is not an nvidia.com/ resource name", r.name),
                    ));
                }
                if let Some(rename) = &r.rename
                    && !valid_resource_name(rename)
                    && !valid_resource_name(&format!("nvidia.com/{rename}"))
                {
                    return Err(invalid(
                        at("rename"),
                        format!("{rename:?} is not a valid resource name"),
                    ));
                }
            }
        }
        let has_entries =
            |s: &Option<SharingSpec>| s.as_ref().is_some_and(|s| !s.resources.is_empty());
        if has_entries(&self.sharing.mps) && has_entries(&self.sharing.time_slicing) {
            return Err(invalid(
                "sharing.timeSlicing".into(),
                "cannot be combined with sharing.mps: a node shares its GPUs one way (NVIDIA's plugin would silently drop the time-slicing entries); remove one of the two".into(),
            ));
        }
        Ok(())
    }

    /// The sharing in force, as NVIDIA's plugin decides it: MPS when
    /// `sharing.mps` has entries, else time-slicing when it has entries,
    /// else none (the check refuses both at once).
    pub fn sharing_strategy(&self) -> SharingStrategy {
        let has = |s: &Option<SharingSpec>| s.as_ref().is_some_and(|s| !s.resources.is_empty());
        if has(&self.sharing.mps) {
            SharingStrategy::Mps
        } else if has(&self.sharing.time_slicing) {
            SharingStrategy::TimeSlicing
        } else {
            SharingStrategy::None
        }
    }
}

/// `nvidia.com/<name>` with a name of letters, digits, `-`, `_`, `.`,
/// starting and ending with a letter or digit (a Kubernetes qualified
/// name's rule; it also keeps `..` out of the MPS directories named after it).
pub fn valid_resource_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("nvidia.com/") else {
        return false;
    };
    let edge_ok = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    rest.len() <= 63
        && edge_ok(rest.chars().next())
        && edge_ok(rest.chars().last())
        && rest
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NVIDIA_EXAMPLE: &str = r#"
version: v1
flags:
  migStrategy: none
sharing:
  timeSlicing:
    renameByDefault: false
    failRequestsGreaterThanOne: false
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"#;

    #[test]
    fn nvidia_time_slicing_example_parses_as_is() {
        let c = PluginConfig::from_yaml(NVIDIA_EXAMPLE, "c").unwrap();
        assert_eq!(c.sharing_strategy(), SharingStrategy::TimeSlicing);
        let r = &c.sharing.time_slicing.as_ref().unwrap().resources[0];
        assert_eq!(r.replicas, 4);
        assert!(r.devices.selects(7, "GPU-x", "7"));
    }

    #[test]
    fn device_selections() {
        let text = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, devices: [0, \"GPU-b\", \"3\"], replicas: 2}\n    - {name: nvidia.com/gpu, devices: 2, replicas: 8}\n    - {name: nvidia.com/gpu, devices: all, replicas: 3}\n";
        let c = PluginConfig::from_yaml(text, "c").unwrap();
        let rs = &c.sharing.time_slicing.unwrap().resources;
        assert!(rs[0].devices.selects(0, "GPU-a", "0"));
        assert!(rs[0].devices.selects(1, "GPU-b", "1"));
        assert!(rs[0].devices.selects(3, "GPU-d", "3"));
        assert!(!rs[0].devices.selects(2, "GPU-c", "2"));
        // A MIG device on GPU 0 is not GPU 0.
        assert!(!rs[0].devices.selects(0, "MIG-x", "0:1"));
        assert!(rs[1].devices.selects(1, "x", "1") && !rs[1].devices.selects(2, "x", "2"));
        assert!(rs[2].devices.selects(99, "x", "99"));
    }

    #[test]
    fn refusals_name_the_key() {
        let cases = [
            ("version: v2\n", "version"),
            (
                "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 1}\n",
                "sharing.mps.resources[0].replicas",
            ),
            (
                "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2, rename: \"a b\"}\n",
                "sharing.mps.resources[0].rename",
            ),
            (
                "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, devices: [0], replicas: 2}\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, devices: [1], replicas: 2}\n",
                "sharing.timeSlicing",
            ),
            ("version: v1\nflags:\n  mpsRoot: run/mps\n", "flags.mpsRoot"),
            (
                "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 1}\n",
                "sharing.timeSlicing.resources[0].replicas",
            ),
            (
                "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 2}\n",
                "sharing.timeSlicing.resources[0].name",
            ),
            (
                "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2, devcies: all}\n",
                "sharing.timeSlicing.resources[0].devcies",
            ),
            (
                "version: v1\nflags:\n  gdsEnabled: true\n",
                "flags.gdsEnabled",
            ),
            (
                "version: v1\nflags:\n  plugin:\n    deviceListStrategy: [envvar, magic]\n",
                "flags.plugin.deviceListStrategy",
            ),
        ];
        for (text, path) in cases {
            let err = PluginConfig::from_yaml(text, "c.yaml").unwrap_err();
            assert_eq!(err.path, path, "{err}");
        }
    }

    /// NVIDIA's MPS example, as its docs give it, read the way its plugin
    /// reads it: MPS wins, and more than one replica per request is
    /// refused unless the config says otherwise.
    #[test]
    fn nvidia_mps_example_parses_as_is() {
        let text = "version: v1\nsharing:\n  mps:\n    renameByDefault: true\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 10\n";
        let c = PluginConfig::from_yaml(text, "c").unwrap();
        assert_eq!(c.sharing_strategy(), SharingStrategy::Mps);
        let mps = c.sharing.mps.as_ref().unwrap();
        assert!(mps.rename_by_default);
        assert_eq!(mps.fail_requests_greater_than_one, None);
        assert!(SharingStrategy::Mps.fail_requests_greater_than_one_default());
        assert!(!SharingStrategy::TimeSlicing.fail_requests_greater_than_one_default());
        assert_eq!(mps.resources[0].replicas, 10);
        assert_eq!(mps.resources[0].devices, DeviceSelection::All);
        // Per-GPU replica counts and renames, as for time-slicing.
        let c = PluginConfig::from_yaml(
            "version: v1\nflags:\n  mpsRoot: /var/run/mps\nsharing:\n  mps:\n    failRequestsGreaterThanOne: false\n    resources:\n    - {name: nvidia.com/gpu, devices: [0, 1], replicas: 4}\n    - {name: nvidia.com/gpu, devices: [\"GPU-c\"], replicas: 2, rename: gpu.small}\n",
            "c",
        )
        .unwrap();
        let mps = c.sharing.mps.unwrap();
        assert_eq!(mps.fail_requests_greater_than_one, Some(false));
        assert!(mps.resources[1].devices.selects(2, "GPU-c", "2"));
        assert_eq!(c.flags.mps_root.as_deref(), Some("/var/run/mps"));
    }

    /// An empty `mps` section shares nothing: time-slicing beside it stands
    /// (only both with entries is refused).
    #[test]
    fn empty_mps_section_leaves_time_slicing() {
        let c = PluginConfig::from_yaml(
            "version: v1\nsharing:\n  mps: {}\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n",
            "c",
        )
        .unwrap();
        assert_eq!(c.sharing_strategy(), SharingStrategy::TimeSlicing);
        let none = PluginConfig::from_yaml("version: v1\nsharing:\n  mps: {}\n", "c").unwrap();
        assert_eq!(none.sharing_strategy(), SharingStrategy::None);
    }

    #[test]
    fn both_strategies_at_once_are_refused_in_words() {
        let err = PluginConfig::from_yaml(
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n",
            "c.yaml",
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("sharing.timeSlicing: cannot be combined with sharing.mps"),
            "{err}"
        );
    }

    #[test]
    fn resource_names_are_qualified_names() {
        for ok in [
            "nvidia.com/gpu",
            "nvidia.com/gpu.shared",
            "nvidia.com/mig-1g.10gb",
            "nvidia.com/a",
        ] {
            assert!(valid_resource_name(ok), "{ok}");
        }
        for bad in [
            "gpu",
            "nvidia.com/",
            "nvidia.com/..",
            "nvidia.com/.gpu",
            "nvidia.com/gpu-",
            "nvidia.com/a b",
            "nvidia.com/a/b",
        ] {
            assert!(!valid_resource_name(bad), "{bad}");
        }
        assert!(!valid_resource_name(&format!(
            "nvidia.com/{}",
            "g".repeat(64)
        )));
    }

    #[test]
    fn device_list_strategy_one_or_many() {
        let c = PluginConfig::from_yaml(
            "version: v1\nflags:\n  plugin:\n    deviceListStrategy: [cdi-annotations, cdi-cri]\n",
            "c",
        )
        .unwrap();
        let s = c
            .flags
            .plugin
            .unwrap()
            .device_list_strategy
            .unwrap()
            .to_vec();
        assert_eq!(
            s,
            [
                DeviceListStrategy::CdiAnnotations,
                DeviceListStrategy::CdiCri
            ]
        );
    }
}

/// `spec.devicePlugin`. Keys set here win over the config file's `flags`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DevicePluginSpec {
    #[serde(default = "enabled")]
    pub enabled: bool,
    /// Sharing and plugin configuration (NVIDIA's config schema).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<DevicePluginConfig>,
    /// `envvar` (default), `volume-mounts`, `cdi-annotations`, `cdi-cri`, or a list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_list_strategy: Option<OneOrMany<DeviceListStrategy>>,
    /// `uuid` (default) or `index`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_id_strategy: Option<DeviceIdStrategy>,
    /// Also pass device nodes (`/dev/nvidiaN` and control nodes) to the runtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pass_device_specs: Option<bool>,
    /// `distributed` (default) or `packed`, for shared GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_devices_allocation_policy: Option<AllocationPolicy>,
    /// Prefix of the CDI annotation key (default `cdi.k8s.io/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cdi_annotation_prefix: Option<String>,
}

impl Default for DevicePluginSpec {
    fn default() -> Self {
        DevicePluginSpec {
            enabled: true,
            config: None,
            device_list_strategy: None,
            device_id_strategy: None,
            pass_device_specs: None,
            shared_devices_allocation_policy: None,
            cdi_annotation_prefix: None,
        }
    }
}

/// `spec.devicePlugin.config`: NVIDIA's device-plugin config.
pub type DevicePluginConfig = ConfigSource<PluginConfig>;

/// A config section as ClusterPolicy has it (`spec.devicePlugin.config`,
/// `spec.migManager.config`): the ConfigMap's name and the entry used by
/// default, plus the config itself, from a `file` or `inline`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    deny_unknown_fields,
    rename_all = "camelCase",
    bound(deserialize = "T: Deserialize<'de>")
)]
pub struct ConfigSource<T> {
    /// The ConfigMap name (in Kubernetes) holding the configs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The entry used when the node's label does not name one (the
    /// device-plugin config; the MIG layout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
    /// A config file in NVIDIA's schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<std::path::PathBuf>,
    /// The same config, inline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inline: Option<T>,
}

impl<T> Default for ConfigSource<T> {
    fn default() -> Self {
        ConfigSource {
            name: None,
            default: None,
            file: None,
            inline: None,
        }
    }
}

/// `spec.mig`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MigSpec {
    #[serde(default)]
    pub strategy: MigStrategy,
}

/// How MIG devices are advertised (as NVIDIA's device plugin does).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MigStrategy {
    /// MIG devices are not advertised; whole GPUs are.
    None,
    /// All MIG devices are of one profile and advertised as `nvidia.com/gpu`
    /// (ClusterPolicy's default).
    #[default]
    Single,
    /// Each profile gets its own resource, `nvidia.com/mig-1g.10gb`.
    Mixed,
}

fn enabled() -> bool {
    true
}
