//! The device plugin's configuration, in NVIDIA's device-plugin config
//! schema (`version: v1`, `flags`, `sharing.timeSlicing` / `sharing.mps`),
//! accepted as-is so existing configs carry over. Unlike NVIDIA's plugin we
//! honour each sharing entry's `devices` selection and `rename`, so that GPUs
//! can have different replica counts.

use hostlib::strict::{self, YamlError};
use serde::{Deserialize, Serialize};

/// A config section as ClusterPolicy has it: the model's.
pub use gpu_model::config::ConfigSource;

/// A key of NVIDIA's config that gpu-agent accepts but does not act on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unacted {
    /// Its path in the config, e.g. `flags.failOnInitError`.
    pub key: String,
    /// What gpu-agent does instead, in plain words.
    pub why: String,
    /// The value asks for something containers will not get (logged at
    /// WARN; the others at INFO).
    pub warn: bool,
}

impl std::fmt::Display for Unacted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.key, self.why)
    }
}

/// A whole config file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PluginConfig {
    /// Must be `v1`; a file without it is `v1` (as NVIDIA's plugin reads it).
    #[serde(default = "version_v1")]
    pub version: String,
    #[serde(default)]
    pub flags: Flags,
    /// Resource renaming by pattern. NVIDIA's plugin ignores this section
    /// (with a warning), and so does gpu-agent: named in `status`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Resources>,
    #[serde(default)]
    pub sharing: Sharing,
    /// IMEX channels for fabric-attached GPUs (not injected by gpu-agent
    /// yet: named in `status` when set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub imex: Option<Imex>,
}

fn version_v1() -> String {
    "v1".into()
}

/// `resources`: `gpus` and `mig`, each a list of `{pattern, name}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<ResourcePattern>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig: Vec<ResourcePattern>,
}

/// One `resources.gpus[]` / `resources.mig[]` entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourcePattern {
    pub pattern: String,
    pub name: String,
}

/// `imex`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Imex {
    /// The spelling is upstream's struct tag; `channelIds` is taken too
    /// (NVIDIA's reader matches keys in any case).
    #[serde(
        default,
        rename = "channelIDs",
        alias = "channelIds",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub channel_ids: Vec<u32>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub required: bool,
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
    /// Upstream's spelling (`useNodeFeatureAPI`); `useNodeFeatureApi` is
    /// taken too.
    #[serde(
        default,
        rename = "useNodeFeatureAPI",
        alias = "useNodeFeatureApi",
        skip_serializing_if = "Option::is_none"
    )]
    pub use_node_feature_api: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_discovery_strategy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin: Option<PluginFlags>,
    /// GPU feature discovery's flags (gpu-agent's labels stage has its own
    /// settings: named in `status` when set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gfd: Option<GfdFlags>,
}

/// `flags.gfd`: GPU feature discovery's command-line flags.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GfdFlags {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oneshot: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_timestamp: Option<bool>,
    /// A Go duration (`60s`, `1m30s`), kept as written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sleep_interval: Option<GoDuration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine_type_file: Option<String>,
}

/// A duration as NVIDIA's config takes it: Go's `60s` form, or a number
/// (nanoseconds, as Go's JSON reads one).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum GoDuration {
    Text(String),
    Nanos(i64),
}

/// `flags.plugin`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PluginFlags {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pass_device_specs: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_list_strategy: Option<OneOrMany<DeviceListStrategy>>,
    /// Upstream's spelling (`deviceIDStrategy`); `deviceIdStrategy` is
    /// taken too (NVIDIA's reader matches keys in any case).
    #[serde(
        default,
        rename = "deviceIDStrategy",
        alias = "deviceIdStrategy",
        skip_serializing_if = "Option::is_none"
    )]
    pub device_id_strategy: Option<DeviceIdStrategy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cdi_annotation_prefix: Option<String>,
    /// Upstream's spelling (`nvidiaCTKPath`); `nvidiaCtkPath` is taken too.
    #[serde(
        default,
        rename = "nvidiaCTKPath",
        alias = "nvidiaCtkPath",
        skip_serializing_if = "Option::is_none"
    )]
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
    /// The resource shared, `nvidia.com/gpu` (or a MIG resource); a name
    /// without the `nvidia.com/` prefix gets it, as NVIDIA's plugin reads it
    /// (`name: gpu` is `nvidia.com/gpu`).
    #[serde(deserialize_with = "qualified_resource_name")]
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

fn qualified_resource_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let name = String::deserialize(d)?;
    Ok(if name.starts_with("nvidia.com/") {
        name
    } else {
        format!("nvidia.com/{name}")
    })
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
        let f = &self.flags;
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

    /// The keys of NVIDIA's schema set here that gpu-agent takes but does
    /// not act on (a key whose value asks for what gpu-agent does anyway is
    /// not named). Never an error: NVIDIA's configs carry over unchanged.
    pub fn not_acted_on(&self) -> Vec<Unacted> {
        let mut out = Vec::new();
        let mut note = |key: &str, warn: bool, why: &str| {
            out.push(Unacted {
                key: key.to_string(),
                warn,
                why: why.to_string(),
            })
        };
        let f = &self.flags;
        if f.fail_on_init_error == Some(true) {
            note(
                "flags.failOnInitError",
                false,
                "gpu-agent never exits on a failed start: the stage that failed says why in `status` and the others go on",
            );
        }
        for (key, root) in [
            ("flags.nvidiaDriverRoot", &f.nvidia_driver_root),
            ("flags.nvidiaDevRoot", &f.nvidia_dev_root),
        ] {
            if root.as_deref().is_some_and(|r| r != "/") {
                note(
                    key,
                    false,
                    "gpu-agent finds the driver and its device nodes on the host itself (the driver and devnodes stages)",
                );
            }
        }
        for (key, on, what) in [
            ("flags.gdrcopyEnabled", f.gdrcopy_enabled, "gdrcopy"),
            ("flags.gdsEnabled", f.gds_enabled, "GPUDirect Storage"),
            ("flags.mofedEnabled", f.mofed_enabled, "MOFED"),
        ] {
            if on == Some(true) {
                note(
                    key,
                    true,
                    &format!("containers get no {what} devices from gpu-agent yet"),
                );
            }
        }
        if f.use_node_feature_api == Some(true) {
            note(
                "flags.useNodeFeatureAPI",
                false,
                "labels go to node-feature-discovery's features.d file (spec.gfd), which NFD turns into the same node labels",
            );
        }
        match f.device_discovery_strategy.as_deref() {
            None | Some("auto") | Some("nvml") => {}
            Some(other) => note(
                "flags.deviceDiscoveryStrategy",
                true,
                &format!("{other:?}: gpu-agent discovers PCI GPUs through sysfs and NVML only"),
            ),
        }
        if let Some(p) = &f.plugin {
            if p.nvidia_ctk_path.is_some() {
                note(
                    "flags.plugin.nvidiaCTKPath",
                    false,
                    "gpu-agent's CDI specs name its own hook (spec.cdi.hookPath)",
                );
            }
            if p.container_driver_root.is_some() {
                note(
                    "flags.plugin.containerDriverRoot",
                    false,
                    "gpu-agent reads the driver's files on the host, not through a mount",
                );
            }
        }
        if let Some(g) = &f.gfd {
            let labels = "gpu-agent's labels stage (spec.gfd) writes node-feature-discovery's features.d file when the GPUs change";
            for (key, set) in [
                ("flags.gfd.oneshot", g.oneshot.is_some()),
                ("flags.gfd.sleepInterval", g.sleep_interval.is_some()),
                ("flags.gfd.outputFile", g.output_file.is_some()),
                ("flags.gfd.machineTypeFile", g.machine_type_file.is_some()),
            ] {
                if set {
                    note(key, false, labels);
                }
            }
            if g.no_timestamp == Some(false) {
                note(
                    "flags.gfd.noTimestamp",
                    false,
                    "gpu-agent never writes nvidia.com/gfd.timestamp (it would relabel the node at every refresh)",
                );
            }
        }
        if self
            .resources
            .as_ref()
            .is_some_and(|r| !r.gpus.is_empty() || !r.mig.is_empty())
        {
            note(
                "resources",
                true,
                "renaming by pattern is ignored, as NVIDIA's plugin ignores it; use sharing.timeSlicing.resources[].rename",
            );
        }
        if let Some(imex) = &self.imex
            && (!imex.channel_ids.is_empty() || imex.required)
        {
            note(
                "imex",
                true,
                "gpu-agent does not inject IMEX channels into containers yet",
            );
        }
        out
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
    /// `uuid` (default) or `index`; `deviceIDStrategy`, the config file's
    /// spelling, is taken too.
    #[serde(
        default,
        alias = "deviceIDStrategy",
        skip_serializing_if = "Option::is_none"
    )]
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

/// `spec.mig`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MigSpec {
    /// Unset: the device-plugin config's `flags.migStrategy`, else `single`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<MigStrategy>,
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

impl MigStrategy {
    pub fn as_str(self) -> &'static str {
        match self {
            MigStrategy::None => "none",
            MigStrategy::Single => "single",
            MigStrategy::Mixed => "mixed",
        }
    }
}

fn enabled() -> bool {
    true
}

#[cfg(test)]
mod tests;
