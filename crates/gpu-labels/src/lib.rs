//! GPU feature discovery's node labels, computed from the inventory: the
//! same keys and values NVIDIA's gpu-feature-discovery (GFD) writes
//! (k8s-device-plugin `internal/lm`), so that node selectors, affinities
//! and dashboards written for GFD keep working.
//!
//! Pure: nothing here reads the host. The `labels` stage writes them to
//! NFD's local feature file ([`FEATURES_FILE`]); the report to the
//! controller can send the same map.
//!
//! Where gpu-agent differs from GFD, on purpose:
//! - No `nvidia.com/gfd.timestamp`. GFD stamps the time of every relabel
//!   (unless `--no-timestamp`); a timestamp would rewrite an unchanged file
//!   on every pass, and the agent never writes unchanged data.
//! - `nvidia.com/gpu.present=true` is written too: the GPU Operator's
//!   controller sets it from NFD's PCI labels; here the node's agent knows.
//! - Several GPU models on one node: GFD labels the one its Go map happens
//!   to visit last (it warns "Multiple device types detected"); here it is
//!   the model of the last GPU by NVML index (whole GPUs over MIG-enabled
//!   ones, as GFD's order of labellers has it), so labels do not flap.
//! - `mixed` MIG strategy: MIG devices whose compute instance is smaller
//!   than their GPU instance (`1c.2g.20gb`) are not labelled, as the device
//!   plugin does not advertise them.
//! - `gpu.machine`: GFD only turns spaces into `-`; characters a label
//!   value may not hold are dropped too, so the label is always valid.
//! - Version labels are left out when NVML did not give the version (GFD
//!   fails the whole relabel).
//! - `mps.capable`: GFD says `true` for MPS sharing unless a GPU is in MIG
//!   mode (and then fails the relabel); here it is `true` when MPS is the
//!   sharing and the device plugin serves it, which it does on the GPUs out
//!   of MIG mode.
//! - Labels describe the resource they are keyed by. GFD keys a resource's
//!   labels by its name in the sharing config (`nvidia.com/gpu`,
//!   `nvidia.com/mig-1g.10gb`): NVIDIA's plugin ignores `devices` and
//!   `rename`, so every device of that resource is advertised under one
//!   name, the resource's own or, when renamed, the rename (then the
//!   product has no `-SHARED`). gpu-agent writes exactly that whenever one
//!   name holds all of a resource's devices. When `devices` splits them
//!   over several names (MPS on GPUs 0-1 as `nvidia.com/gpu.mps`, GPUs 2-7
//!   whole as `nvidia.com/gpu`), GFD has no rule; each advertised name gets
//!   its own labels, keyed by it and counting only its devices:
//!   `nvidia.com/gpu.count=6`, `.replicas=1`, `.sharing-strategy=none`
//!   beside `nvidia.com/gpu.mps.count=2`, `.replicas=4`,
//!   `.sharing-strategy=mps`, `.product=<model>` (renamed: no `-SHARED`, as
//!   GFD), with the memory, family and compute capability (MIG devices:
//!   their attributes) of its own devices. A name none of whose devices
//!   remain (every GPU renamed, to two names) gets no labels, as GFD writes
//!   none for a resource with no device.
//! - Different replica counts under one name (time-slicing GPUs 0-1 in 4,
//!   GPU 2 in 2, both as `nvidia.com/gpu.shared`), which GFD cannot be
//!   configured for: `replicas` is the largest, the most pods one of its
//!   GPUs may be shared among, so that the label never promises a bigger
//!   share of a GPU than a pod may get (`count` x `replicas` is then more
//!   than the node's capacity of the resource, which the node's status
//!   gives).

use std::collections::BTreeMap;

use gpu_model::backend::{ComputeCapability, MigDevice};
use gpu_model::inventory::{Gpu, Inventory};
use gpu_resources::config::{DevicePluginSpec, MigStrategy, SharingStrategy};
use gpu_resources::resources::{self, GPU_RESOURCE, PluginSettings, Resource};

mod clique;
mod vgpu;

#[cfg(test)]
use gpu_backend::test_support;

/// NFD's local feature file GFD writes (GFD's `--output-file` default), a
/// host path.
pub const FEATURES_FILE: &str = "/etc/kubernetes/node-feature-discovery/features.d/gfd";

/// Label key → value, sorted by key.
pub type Labels = BTreeMap<String, String>;

/// The node's labels cannot be worked out.
#[derive(Debug, thiserror::Error)]
pub enum LabelsError {
    /// The device-plugin config (sharing) named by the policy is unusable.
    #[error(transparent)]
    Settings(#[from] gpu_resources::SettingsError),
    /// GPUs are on the bus but the backend did not describe them.
    #[error(
        "{gpus} GPU(s) on the node, none can be labelled until {backend} describes them: {reason}"
    )]
    Undescribed {
        gpus: usize,
        backend: String,
        reason: String,
    },
}

/// Something the labels could not say as the node asks, for the operator
/// to act on. Working out labels logs nothing: the labels stage logs each
/// warning once while it holds ([`LabelWarning::log`]), `gpu-agent labels`
/// prints them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LabelWarning {
    /// GPUs of several models; labelled as the last one.
    MixedModels { models: String },
    /// A driver version that is not X.Y[.Z].
    DriverVersion { version: String },
    /// A renamed resource too long for its labels' keys.
    LongResource { resource: String },
    /// `mig.strategy: single` on a node whose layout does not fit it.
    MigInvalid { reason: &'static str },
}

impl LabelWarning {
    /// Every [`LabelWarning::kind`] there is.
    pub const KINDS: &'static [&'static str] = &[
        "mixed-models",
        "driver-version",
        "long-resource",
        "mig-invalid",
    ];

    /// The condition's stable name.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::MixedModels { .. } => "mixed-models",
            Self::DriverVersion { .. } => "driver-version",
            Self::LongResource { .. } => "long-resource",
            Self::MigInvalid { .. } => "mig-invalid",
        }
    }

    /// Logs it (WARN, the values as fields).
    pub fn log(&self) {
        match self {
            Self::MixedModels { models } => {
                tracing::warn!(stage = "labels", models = %models, "multiple GPU models on the node; labelling the last one's")
            }
            Self::DriverVersion { version } => {
                tracing::warn!(stage = "labels", version = %version, "driver version is not X.Y[.Z]; no driver-version labels")
            }
            Self::LongResource { resource } => {
                tracing::warn!(stage = "labels", resource = %resource, "resource name too long for its labels' keys (63 characters after nvidia.com/, with {LONGEST_SUFFIX}); not labelled")
            }
            Self::MigInvalid { reason } => {
                tracing::warn!(stage = "labels", reason = %reason, "the node's MIG layout is invalid for mig.strategy single")
            }
        }
    }
}

impl std::fmt::Display for LabelWarning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::MixedModels { models } => write!(
                f,
                "multiple GPU models on the node ({models}); labelling the last one's"
            ),
            Self::DriverVersion { version } => write!(
                f,
                "driver version {version:?} is not X.Y[.Z]; no driver-version labels"
            ),
            Self::LongResource { resource } => write!(
                f,
                "resource name {resource} too long for its labels' keys (63 characters after nvidia.com/, with {LONGEST_SUFFIX}); not labelled"
            ),
            Self::MigInvalid { reason } => write!(
                f,
                "the node's MIG layout is invalid for mig.strategy single: {reason}"
            ),
        }
    }
}

/// The labels for this node under the policy's `spec.devicePlugin` (the
/// device plugin's sharing config) and `spec.mig.strategy`.
pub fn node_labels(
    inv: &Inventory,
    device_plugin: &DevicePluginSpec,
    mig_strategy: Option<MigStrategy>,
) -> Result<Labels, LabelsError> {
    node_labels_noted(inv, device_plugin, mig_strategy).map(|(labels, _)| labels)
}

/// [`node_labels`], with what the labels could not say ([`LabelWarning`]).
pub fn node_labels_noted(
    inv: &Inventory,
    device_plugin: &DevicePluginSpec,
    mig_strategy: Option<MigStrategy>,
) -> Result<(Labels, Vec<LabelWarning>), LabelsError> {
    let settings = gpu_resources::settings(device_plugin, mig_strategy)?;
    if !inv.gpus.is_empty() && described(inv).next().is_none() {
        return Err(LabelsError::Undescribed {
            gpus: inv.gpus.len(),
            backend: inv.backend.name.clone(),
            reason: inv
                .backend
                .error
                .clone()
                .unwrap_or_else(|| "no UUIDs reported".into()),
        });
    }
    Ok(labels_noted(inv, &settings))
}

/// GPUs NVML described (the ones the device plugin can advertise).
fn described(inv: &Inventory) -> impl Iterator<Item = &Gpu> {
    inv.gpus
        .iter()
        .filter(|g| g.index.is_some() && g.uuid.is_some())
}

fn mig_enabled(g: &Gpu) -> bool {
    g.mig.is_some_and(|m| m.current)
}

/// The labels GFD would write for this inventory, with the device plugin's
/// MIG strategy and time-slicing. No GPU: no labels (as GFD).
pub fn labels(inv: &Inventory, settings: &PluginSettings) -> Labels {
    labels_noted(inv, settings).0
}

/// [`labels`], with what they could not say.
fn labels_noted(inv: &Inventory, settings: &PluginSettings) -> (Labels, Vec<LabelWarning>) {
    let gpus: Vec<&Gpu> = described(inv).collect();
    let mut out = Labels::new();
    let warnings = std::cell::RefCell::new(Vec::new());
    if gpus.is_empty() {
        return (out, Vec::new());
    }
    let mut put = |k: &str, v: String| {
        out.insert(format!("nvidia.com/{k}"), v);
    };
    put("gpu.present", "true".into());
    put("gpu.machine", machine_label(inv.machine.as_deref()));
    match inv.backend.driver_version.as_deref().map(split_driver) {
        Some(Some((major, minor, rev))) => {
            // Deprecated keys, still written by GFD.
            put("cuda.driver.major", major.into());
            put("cuda.driver.minor", minor.into());
            put("cuda.driver.rev", rev.into());
            put("cuda.driver-version.major", major.into());
            put("cuda.driver-version.minor", minor.into());
            put("cuda.driver-version.revision", rev.into());
            put(
                "cuda.driver-version.full",
                inv.backend.driver_version.clone().unwrap_or_default(),
            );
        }
        Some(None) => warnings.borrow_mut().push(LabelWarning::DriverVersion {
            version: inv.backend.driver_version.clone().unwrap_or_default(),
        }),
        None => {}
    }
    if let Some(c) = inv.cuda_version {
        put("cuda.runtime.major", c.major.to_string());
        put("cuda.runtime.minor", c.minor.to_string());
        put("cuda.runtime-version.major", c.major.to_string());
        put("cuda.runtime-version.minor", c.minor.to_string());
        put(
            "cuda.runtime-version.full",
            format!("{}.{}", c.major, c.minor),
        );
    }
    put(
        "mig.capable",
        gpus.iter().any(|g| g.mig.is_some()).to_string(),
    );
    // What the device plugin advertises; `None` when it refuses the
    // config (it then serves nothing), and the sharing labels read the
    // config as GFD reads it.
    let advertised = resources::build(inv, settings).ok();
    let adv = Advertised {
        resources: advertised.as_deref(),
        settings,
        warnings: &warnings,
    };
    put("mps.capable", mps_capable(&adv).to_string());
    put("gpu.mode", gpu_mode(&gpus).into());
    vgpu::labels(&inv.gpus, &mut out);
    clique::labels(&gpus, &mut out);
    full_gpu_labels(&gpus, &adv, &mut out);
    match settings.mig_strategy {
        MigStrategy::None => {}
        MigStrategy::Single => {
            out.insert("nvidia.com/mig.strategy".into(), "single".into());
            mig_single_labels(&gpus, &adv, &mut out);
        }
        MigStrategy::Mixed => {
            out.insert("nvidia.com/mig.strategy".into(), "mixed".into());
            mig_mixed_labels(&gpus, &adv, &mut out);
        }
    }
    (out, warnings.into_inner())
}

/// `nvidia.com/mps.capable`: GFD writes `false` unless the sharing in force
/// is MPS, and then whether no GPU is in MIG mode. Here: MPS is in force
/// and the device plugin can serve it — every GPU it shares with MPS is
/// out of MIG mode and new enough (on a node where other GPUs are in MIG
/// mode GFD fails to label; gpu-agent serves MPS on the rest and says so).
fn mps_capable(adv: &Advertised<'_>) -> bool {
    matches!(adv.settings.sharing(), Some((SharingStrategy::Mps, _)))
        && adv.resources.is_some_and(|rs| rs.iter().any(|r| r.mps))
}

/// `X.Y[.Z]` → (X, Y, Z or ""), as GFD splits NVML's driver version.
fn split_driver(v: &str) -> Option<(&str, &str, &str)> {
    let parts: Vec<&str> = v.split('.').collect();
    match parts.as_slice() {
        [a, b] => Some((a, b, "")),
        [a, b, c] => Some((a, b, c)),
        _ => None,
    }
}

/// The DMI product name with spaces as `-` (as GFD), without characters a
/// label value cannot hold, at most 63 characters, starting and ending
/// with a letter or digit; `unknown` when there is none.
pub fn machine_label(machine: Option<&str>) -> String {
    let raw = machine.map(str::trim).unwrap_or_default();
    let kept: String = raw
        .chars()
        .map(|c| if c == ' ' { '-' } else { c })
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .take(63)
        .collect();
    let v = kept.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    if v.is_empty() {
        "unknown".into()
    } else {
        v.to_string()
    }
}

/// GFD's `sanitise`: drop characters other than letters, digits, `-`, `_`,
/// `.` and space, then join the words with `-`.
pub fn sanitise(part: &str) -> String {
    let kept: String = part
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ' '))
        .collect();
    kept.split_whitespace().collect::<Vec<_>>().join("-")
}

/// `graphics` (PCI class 0x030000), `compute` (0x030200) or `unknown`, from
/// the first GPU (GFD stops at the first that differs).
fn gpu_mode(gpus: &[&Gpu]) -> &'static str {
    match gpus.first().and_then(|g| g.pci.as_ref()).map(|p| p.class) {
        Some(0x03_00_00) => "graphics",
        Some(0x03_02_00) => "compute",
        _ => "unknown",
    }
}

/// GFD's family of a compute capability (`getArchFamily`).
pub fn arch_family(cc: ComputeCapability) -> &'static str {
    match (cc.major, cc.minor) {
        (1, _) => "tesla",
        (2, _) => "fermi",
        (3, _) => "kepler",
        (5, _) => "maxwell",
        (6, _) => "pascal",
        (7, m) if m < 5 => "volta",
        (7, _) => "turing",
        (8, m) if m < 9 => "ampere",
        (8, _) => "ada-lovelace",
        (9, _) => "hopper",
        (10 | 12, _) => "blackwell",
        (13, _) => "rubin",
        _ => "undefined",
    }
}

/// What the device plugin advertises, and the settings it comes from.
struct Advertised<'a> {
    /// `None`: the plugin refuses the config.
    resources: Option<&'a [Resource]>,
    settings: &'a PluginSettings,
    /// What the labels could not say, gathered as they are worked out.
    warnings: &'a std::cell::RefCell<Vec<LabelWarning>>,
}

impl Advertised<'_> {
    fn warn(&self, w: LabelWarning) {
        self.warnings.borrow_mut().push(w);
    }
}

/// The devices of one labelled resource that one advertised name holds.
struct Group<'a> {
    /// The name the device plugin advertises them under.
    name: &'a str,
    /// Device UUID (a GPU's or a MIG device's) → its replicas (1: whole).
    units: BTreeMap<&'a str, u32>,
    /// Time-slicing or MPS when the devices are replicas, else none.
    strategy: SharingStrategy,
}

impl<'a> Advertised<'a> {
    /// The names the devices `units` (the UUIDs of one labelled resource's
    /// devices) are advertised under, sorted by name; none when the plugin
    /// refuses the config.
    fn groups(&self, units: &[&str]) -> Vec<Group<'a>> {
        let Some(rs) = self.resources else {
            return Vec::new();
        };
        rs.iter()
            .filter_map(|r| {
                let mut per_unit: BTreeMap<&str, u32> = BTreeMap::new();
                for d in r
                    .devices
                    .iter()
                    .filter(|d| units.contains(&d.uuid.as_str()))
                {
                    *per_unit.entry(d.uuid.as_str()).or_default() += 1;
                }
                let strategy = match (r.shared, r.mps) {
                    (false, _) => SharingStrategy::None,
                    (true, true) => SharingStrategy::Mps,
                    (true, false) => SharingStrategy::TimeSlicing,
                };
                (!per_unit.is_empty()).then_some(Group {
                    name: &r.name,
                    units: per_unit,
                    strategy,
                })
            })
            .collect()
    }

    /// How `resource` is shared when one name holds all its devices (GFD's
    /// case): as `group` holds them, or, with no group (the plugin refuses
    /// the config), as the config's first entry for `resource` says, the
    /// way GFD reads it.
    fn share(&self, resource: &str, group: Option<&Group<'_>>) -> Share {
        if let Some(g) = group {
            return Share::of(g, resource);
        }
        match resources::replication(self.settings, resource) {
            Some(r) => Share::On {
                strategy: r.strategy,
                replicas: r.replicas,
                renamed: r.renamed(resource),
            },
            None => Share::UNSHARED,
        }
    }
}

/// How a labelled resource is shared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Share {
    /// Labelled without sharing (GFD's whole-GPU labels of MIG-enabled
    /// GPUs): replicas 0, strategy none.
    Off,
    /// `replicas` of each device (1: not shared); `renamed`: advertised
    /// under another name than the one the sharing config gives the
    /// devices (`rename`, `renameByDefault`), so no `-SHARED` (GFD).
    On {
        strategy: SharingStrategy,
        replicas: u32,
        renamed: bool,
    },
}

impl Share {
    const UNSHARED: Share = Share::On {
        strategy: SharingStrategy::None,
        replicas: 1,
        renamed: false,
    };

    /// The sharing of `group`'s devices, devices of `resource` (the name
    /// the sharing config gives them: renamed when advertised under
    /// another). Different replica counts (time-slicing, per-GPU entries
    /// under one name): the largest, the most pods one of its GPUs may be
    /// shared among (see the module notes; GFD has no such case).
    fn of(group: &Group<'_>, resource: &str) -> Share {
        Share::On {
            strategy: group.strategy,
            replicas: group.units.values().copied().max().unwrap_or(1),
            renamed: group.name != resource,
        }
    }
}

/// The longest suffix a resource's label has (`.sharing-strategy`).
const LONGEST_SUFFIX: &str = ".sharing-strategy";

/// True when every label of `resource` is a valid label key: the part
/// after `nvidia.com/` at most 63 characters. A renamed resource may have a
/// name too long for that (a resource name may be 63 characters itself).
fn keyable(resource: &str) -> bool {
    let name = resource.split_once('/').map_or(resource, |(_, n)| n);
    name.len() + LONGEST_SUFFIX.len() <= 63
}

/// One resource's labels: `<resource>.<suffix>`.
struct ResourceLabels<'a> {
    resource: &'a str,
    share: Share,
}

impl ResourceLabels<'_> {
    fn put(&self, out: &mut Labels, suffix: &str, value: impl ToString) {
        out.insert(format!("{}.{suffix}", self.resource), value.to_string());
    }

    /// `product`, `count`, `replicas`, `sharing-strategy`, as GFD's
    /// `baseLabeler`: `-SHARED` when shared and not renamed, the strategy
    /// only when there is more than one replica.
    fn base(&self, out: &mut Labels, count: usize, parts: &[&str]) {
        let (replicas, strategy, suffix) = match self.share {
            Share::Off => (0, SharingStrategy::None, false),
            Share::On {
                strategy,
                replicas,
                renamed,
            } if replicas > 1 => (replicas, strategy, !renamed),
            Share::On { replicas, .. } => (replicas, SharingStrategy::None, false),
        };
        let mut product: Vec<String> = parts
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| sanitise(p))
            .collect();
        if suffix {
            product.push("SHARED".into());
        }
        self.put(out, "product", product.join("-"));
        self.put(out, "count", count);
        self.put(out, "replicas", replicas);
        self.put(out, "sharing-strategy", strategy.as_str());
    }

    /// `memory`, `multiprocessors`, `slices.gi/ci`, `engines.*` of a MIG device.
    fn mig_attributes(&self, out: &mut Labels, m: &MigDevice) {
        self.put(out, "memory", m.memory_mib);
        self.put(out, "multiprocessors", m.multiprocessors);
        self.put(out, "slices.gi", m.gi_slices);
        self.put(out, "slices.ci", m.ci_slices);
        self.put(out, "engines.copy", m.engines.copy);
        self.put(out, "engines.decoder", m.engines.decoder);
        self.put(out, "engines.encoder", m.engines.encoder);
        self.put(out, "engines.jpeg", m.engines.jpeg);
        self.put(out, "engines.ofa", m.engines.ofa);
    }
}

/// How a resource's devices are advertised: all under one name (GFD's
/// case; the group, none when the plugin refuses the config), or split by
/// `devices` over several names, each to be labelled under its own name
/// (those whose labels' keys would be too long left out).
enum Layout<'a> {
    One(Option<Group<'a>>),
    Split(Vec<Group<'a>>),
}

fn layout<'a>(adv: &Advertised<'a>, resource: &str, devices: &[&str]) -> Layout<'a> {
    let mut groups = adv.groups(devices);
    if groups.len() < 2 {
        return Layout::One(groups.pop());
    }
    let names: Vec<&str> = groups.iter().map(|g| g.name).collect();
    tracing::debug!(stage = "labels", resource, advertised_as = ?names, "sharing splits the resource's devices; each name is labelled for its own");
    groups.retain(|g| {
        let ok = keyable(g.name);
        if !ok {
            adv.warn(LabelWarning::LongResource {
                resource: g.name.to_string(),
            });
        }
        ok
    });
    Layout::Split(groups)
}

/// `nvidia.com/gpu.*` for whole GPUs: one model's (see the module notes),
/// counting every GPU of that model; without sharing (replicas 0) when all
/// of them have MIG enabled. When sharing puts some of the GPUs under other
/// names, each name is labelled for its own GPUs.
fn full_gpu_labels(gpus: &[&Gpu], adv: &Advertised<'_>, out: &mut Labels) {
    let models: std::collections::BTreeSet<&str> =
        gpus.iter().filter_map(|g| g.model.as_deref()).collect();
    if models.len() > 1 {
        adv.warn(LabelWarning::MixedModels {
            models: models.iter().copied().collect::<Vec<_>>().join(", "),
        });
    }
    // The GPUs advertised whole (or in replicas), not as MIG devices.
    let whole: Vec<&Gpu> = gpus
        .iter()
        .copied()
        .filter(|g| adv.settings.mig_strategy == MigStrategy::None || !mig_enabled(g))
        .collect();
    let uuids: Vec<&str> = whole.iter().filter_map(|g| g.uuid.as_deref()).collect();
    let group = match layout(adv, GPU_RESOURCE, &uuids) {
        Layout::One(group) => group,
        Layout::Split(groups) => {
            for group in &groups {
                let members: Vec<&Gpu> = whole
                    .iter()
                    .copied()
                    .filter(|g| {
                        g.uuid
                            .as_deref()
                            .is_some_and(|u| group.units.contains_key(u))
                    })
                    .collect();
                whole_gpu_resource(group.name, &members, Share::of(group, GPU_RESOURCE), out);
            }
            return;
        }
    };
    whole_gpu_resource(
        GPU_RESOURCE,
        gpus,
        adv.share(GPU_RESOURCE, group.as_ref()),
        out,
    );
}

/// `<resource>.*` for whole GPUs: the model of the last of `members` by
/// NVML index (one out of MIG mode first, as GFD's order of labellers has
/// it), counting the members of that model; without sharing (replicas 0)
/// when that GPU has MIG enabled.
fn whole_gpu_resource(resource: &str, members: &[&Gpu], share: Share, out: &mut Labels) {
    let Some(g) = members
        .iter()
        .rev()
        .find(|g| !mig_enabled(g))
        .or_else(|| members.last())
    else {
        return;
    };
    let model = g.model.as_deref().unwrap_or_default();
    let count = members
        .iter()
        .filter(|o| o.model.as_deref().unwrap_or_default() == model)
        .count();
    let rl = ResourceLabels {
        resource,
        share: if mig_enabled(g) { Share::Off } else { share },
    };
    rl.base(out, count, &[model]);
    if let Some(mem) = g.memory_mib.filter(|m| *m != 0) {
        rl.put(out, "memory", mem);
    }
    if let Some(cc) = g.compute_capability.filter(|c| c.major != 0) {
        rl.put(out, "family", arch_family(cc));
        rl.put(out, "compute.major", cc.major);
        rl.put(out, "compute.minor", cc.minor);
    }
}

/// `<resource>.*` for MIG devices (one profile): from the first of them,
/// counting them all.
fn mig_resource(resource: &str, migs: &[(&Gpu, &MigDevice)], share: Share, out: &mut Labels) {
    let Some((parent, m)) = migs.first() else {
        return;
    };
    let rl = ResourceLabels { resource, share };
    rl.base(
        out,
        migs.len(),
        &[
            parent.model.as_deref().unwrap_or_default(),
            "MIG",
            &m.profile,
        ],
    );
    rl.mig_attributes(out, m);
}

/// MIG devices under `resource` (`nvidia.com/gpu` for `single`,
/// `nvidia.com/mig-<profile>` for `mixed`): labelled under it, or, when
/// sharing splits them over several names, under each name for its own.
fn mig_labels(resource: &str, migs: &[(&Gpu, &MigDevice)], adv: &Advertised<'_>, out: &mut Labels) {
    let uuids: Vec<&str> = migs.iter().map(|(_, m)| m.uuid.as_str()).collect();
    let group = match layout(adv, resource, &uuids) {
        Layout::One(group) => group,
        Layout::Split(groups) => {
            for group in &groups {
                let mine: Vec<(&Gpu, &MigDevice)> = migs
                    .iter()
                    .copied()
                    .filter(|(_, m)| group.units.contains_key(m.uuid.as_str()))
                    .collect();
                mig_resource(group.name, &mine, Share::of(group, resource), out);
            }
            return;
        }
    };
    mig_resource(resource, migs, adv.share(resource, group.as_ref()), out);
}

/// `single`: every MIG device is an `nvidia.com/gpu`. A node the strategy
/// cannot serve (MIG on some GPUs only, a MIG-enabled GPU without devices,
/// several profiles) is labelled `<model>-MIG-INVALID` with count,
/// replicas and memory 0, as GFD.
fn mig_single_labels(gpus: &[&Gpu], adv: &Advertised<'_>, out: &mut Labels) {
    let enabled: Vec<&Gpu> = gpus.iter().copied().filter(|g| mig_enabled(g)).collect();
    let Some(first) = enabled.first() else {
        return;
    };
    let migs: Vec<(&Gpu, &MigDevice)> = enabled
        .iter()
        .flat_map(|g| g.mig_devices.iter().map(move |m| (*g, m)))
        .collect();
    let profiles: std::collections::BTreeSet<&str> =
        migs.iter().map(|(_, m)| m.profile.as_str()).collect();
    let invalid = if enabled.iter().any(|g| g.mig_devices.is_empty()) {
        Some("a MIG-enabled GPU has no MIG devices")
    } else if enabled.len() != gpus.len() {
        Some("some GPUs have MIG enabled, others not")
    } else if profiles.len() != 1 {
        Some("more than one MIG profile on the node")
    } else {
        None
    };
    if let Some(reason) = invalid {
        adv.warn(LabelWarning::MigInvalid { reason });
        let rl = ResourceLabels {
            resource: GPU_RESOURCE,
            share: Share::UNSHARED,
        };
        let model = first.model.as_deref().unwrap_or_default();
        let product: Vec<String> = [model, "MIG", "INVALID"]
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| sanitise(p))
            .collect();
        rl.put(out, "product", product.join("-"));
        rl.put(out, "count", 0);
        rl.put(out, "replicas", 0);
        // GFD writes the strategy empty here (not `none`).
        rl.put(out, "sharing-strategy", "");
        rl.put(out, "memory", 0);
        return;
    }
    mig_labels(GPU_RESOURCE, &migs, adv, out);
}

/// `mixed`: `nvidia.com/mig-<profile>.*` for each profile the device plugin
/// advertises, from the first device of that profile.
fn mig_mixed_labels(gpus: &[&Gpu], adv: &Advertised<'_>, out: &mut Labels) {
    let mut by_profile: BTreeMap<&str, Vec<(&Gpu, &MigDevice)>> = BTreeMap::new();
    for g in gpus.iter().filter(|g| mig_enabled(g)) {
        for m in g.mig_devices.iter().filter(|m| m.ci_slices == m.gi_slices) {
            by_profile
                .entry(m.profile.as_str())
                .or_default()
                .push((*g, m));
        }
    }
    for (profile, migs) in by_profile {
        mig_labels(&resources::mig_resource_name(profile), &migs, adv, out);
    }
}

/// The feature file's text: `key=value` lines, sorted by key.
pub fn render(labels: &Labels) -> String {
    labels.iter().map(|(k, v)| format!("{k}={v}\n")).collect()
}

#[cfg(test)]
mod tests;
