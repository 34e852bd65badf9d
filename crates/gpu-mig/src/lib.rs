//! MIG layouts: mig-parted's config applied through NVML.
//!
//! [`plan`] compares what the selected layout wants of each GPU with what
//! NVML says the GPU has, and checks that the wanted instances fit (profile
//! known to the GPU, instance counts, placements) before anything changes.
//! [`apply`] carries a plan out: MIG mode (with a GPU reset through the PCI
//! function's sysfs `reset` when the mode stays pending), then the GPU
//! instances and compute instances, then a check; any failure puts back the
//! layout every changed GPU had. A GPU whose layout already matches is not
//! touched.

pub mod config;
pub mod derive;
pub mod spec;
#[cfg(test)]
mod tests;
#[cfg(test)]
use gpu_backend::test_support;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use hostlib::HostRoot;
use hostlib::command::CommandRunner;
use serde::{Deserialize, Serialize};

use config::{DeviceFilter, Devices, Entry, MigPartedConfig, ProfileKey};
use gpu_model::inventory::{Gpu, Inventory};
/// What MIG is to NVML (the [`MigControl`] trait the backends implement, its
/// types) and the placement search are the model's.
pub use gpu_model::mig::{
    CiProfile, ComputeInstance, ErrorKind, GiProfile, GpuInstance, MigControl, MigError, Mode,
    Placement, place,
};

/// The operator's `nvidia.com/mig.config.state` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MigConfigState {
    Pending,
    Rebooting,
    Success,
    Failed,
}

impl MigConfigState {
    pub fn as_str(self) -> &'static str {
        match self {
            MigConfigState::Pending => "pending",
            MigConfigState::Rebooting => "rebooting",
            MigConfigState::Success => "success",
            MigConfigState::Failed => "failed",
        }
    }
}

/// Where the node's MIG layout stands (state file, `status`, the report).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigStatus {
    /// The selected layout.
    pub layout: String,
    pub state: MigConfigState,
    pub detail: String,
    /// Unix seconds of the last change of `state`.
    pub since: u64,
}

/// One wanted GPU instance: its profile and the slices of each compute
/// instance in it (one full-size compute instance for a plain profile).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WantedGi {
    pub profile: String,
    pub cis: Vec<u32>,
}

/// What one GPU should have, or has.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuLayout {
    pub enabled: bool,
    /// Sorted.
    pub gis: Vec<WantedGi>,
}

impl GpuLayout {
    /// `MIG off`, `MIG on, no devices`, `3g.40gb, 2g.20gb, 1g.10gb x2`.
    pub fn describe(&self) -> String {
        if !self.enabled {
            return "MIG off".into();
        }
        if self.gis.is_empty() {
            return "MIG on, no devices".into();
        }
        let mut counts: BTreeMap<String, u32> = BTreeMap::new();
        for gi in &self.gis {
            let slices = gi
                .profile
                .split('g')
                .next()
                .and_then(|s| s.parse::<u32>().ok());
            for &c in &gi.cis {
                let name = if Some(c) == slices {
                    gi.profile.clone()
                } else {
                    format!("{c}c.{}", gi.profile)
                };
                *counts.entry(name).or_default() += 1;
            }
        }
        counts
            .iter()
            .rev()
            .map(|(n, c)| {
                if *c == 1 {
                    n.clone()
                } else {
                    format!("{n} x{c}")
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// What one GPU is and should be.
#[derive(Clone, Debug)]
pub struct GpuPlan {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    /// `/dev/nvidiaN`'s N.
    pub minor: Option<u32>,
    pub bus_id: hostlib::PciAddress,
    pub mode: Mode,
    /// Its instances now, with placements (to put them back).
    pub instances: Vec<GpuInstance>,
    pub current: GpuLayout,
    pub wanted: GpuLayout,
    /// `/dev/nvidia-caps` minors of its MIG devices now (for holders).
    pub cap_nodes: Vec<String>,
}

impl GpuPlan {
    pub fn changes(&self) -> bool {
        self.current != self.wanted || self.mode.current != self.mode.pending
    }
}

/// The selected layout against the node.
#[derive(Clone, Debug)]
pub struct Plan {
    pub layout: String,
    pub gpus: Vec<GpuPlan>,
    /// GPU indices the layout names that this node does not have: skipped,
    /// as mig-parted skips them (one layout serves nodes of several sizes).
    pub absent: Vec<u32>,
    /// GPUs whose built-in layout was derived from their own MIG profiles
    /// (the built-in file does not cover them: [`derive`]).
    pub derived: Vec<u32>,
}

impl Plan {
    /// The GPUs whose layout changes.
    pub fn changing(&self) -> impl Iterator<Item = &GpuPlan> {
        self.gpus.iter().filter(|g| g.changes())
    }

    pub fn is_noop(&self) -> bool {
        self.changing().next().is_none()
    }

    /// `GPUs 0-7: MIG off → 3g.40gb, …` (GPUs with the same change together).
    pub fn summary(&self) -> String {
        let parts: Vec<(u32, String)> = self
            .changing()
            .map(|g| {
                (
                    g.index,
                    format!("{} → {}", g.current.describe(), g.wanted.describe()),
                )
            })
            .collect();
        let done = if parts.is_empty() {
            format!(
                "layout {:?} applied ({} GPU(s) as wanted)",
                self.layout,
                self.gpus.len()
            )
        } else {
            grouped(&parts)
        };
        let list = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
        let mut out = done;
        if !self.derived.is_empty() {
            out.push_str(&format!(
                "; GPU(s) {}: layout derived from their MIG profiles as NVML lists them (not in the built-in layouts)",
                list(&self.derived)
            ));
        }
        if !self.absent.is_empty() {
            out.push_str(&format!(
                "; GPU(s) {} named by the layout are not on this node (skipped)",
                list(&self.absent)
            ));
        }
        out
    }
}

/// `GPUs 0-3, 6: what; GPU 5: other`: GPUs that say the same, together,
/// in the order each saying first comes.
pub fn grouped(items: &[(u32, String)]) -> String {
    let mut groups: Vec<(&str, Vec<u32>)> = Vec::new();
    for (gpu, what) in items {
        match groups.iter_mut().find(|(w, _)| w == what) {
            Some((_, g)) => g.push(*gpu),
            None => groups.push((what, vec![*gpu])),
        }
    }
    groups
        .iter()
        .map(|(what, gpus)| format!("{}: {what}", gpu_list(gpus)))
        .collect::<Vec<_>>()
        .join("; ")
}

/// `GPU 3`, `GPUs 0-7`, `GPUs 0, 2-4`.
fn gpu_list(gpus: &[u32]) -> String {
    let mut sorted = gpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut runs: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        runs.push(if j == i {
            sorted[i].to_string()
        } else {
            format!("{}-{}", sorted[i], sorted[j])
        });
        i = j + 1;
    }
    if sorted.len() == 1 {
        format!("GPU {}", runs[0])
    } else {
        format!("GPUs {}", runs.join(", "))
    }
}

/// A layout that cannot be planned: bad config, or one that does not fit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Config(#[from] hostlib::strict::YamlError),
    #[error("{origin}: {path}: {message}")]
    Node {
        origin: String,
        path: String,
        message: String,
    },
    #[error(transparent)]
    Nvml(#[from] MigError),
}

/// The config and the layout the policy selects; `None` when no layout is
/// selected (MIG is then left as it is).
pub fn selected(
    m: &crate::spec::MigManagerSpec,
) -> Result<Option<(MigPartedConfig, String, String)>, PlanError> {
    let Some(layout) = m.selected_layout() else {
        return Ok(None);
    };
    let (config, origin) = load_config(m)?;
    Ok(Some((config, origin, layout.to_string())))
}

/// The layouts: `spec.migManager.config.file`, `.inline`, else the built-in ones.
pub fn load_config(
    m: &crate::spec::MigManagerSpec,
) -> Result<(MigPartedConfig, String), PlanError> {
    let c = m.config.as_ref();
    if let Some(path) = c.and_then(|c| c.file.as_ref()) {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| PlanError::Node {
            origin: origin.clone(),
            path: "(file)".into(),
            message: format!("cannot read the MIG config (spec.migManager.config.file): {e}"),
        })?;
        return Ok((MigPartedConfig::from_yaml(&text, &origin)?, origin));
    }
    if let Some(inline) = c.and_then(|c| c.inline.as_ref()) {
        return Ok((inline.clone(), "spec.migManager.config.inline".into()));
    }
    Ok((MigPartedConfig::builtin(), config::BUILTIN_ORIGIN.into()))
}

/// Plans `layout` of `config` for the node's GPUs.
///
/// With the built-in layouts ([`MigPartedConfig::builtin`]), each
/// MIG-capable GPU gets the entry of `layout` that selects it (by PCI
/// device ID) when the GPU has every profile it names, as NVML lists them
/// (or, with MIG off and NVML listing none, as NVIDIA's table for the model
/// does); otherwise — a model the built-in file does not name, or a driver
/// that names its profiles differently — the layout is derived from the
/// GPU's own profiles ([`derive`]). A user's config (file, inline) is
/// planned as written.
pub fn plan(
    control: &dyn MigControl,
    inv: &Inventory,
    config: &MigPartedConfig,
    origin: &str,
    layout: &str,
) -> Result<Plan, PlanError> {
    let generic = if config.builtin {
        derive::Generic::parse(layout)
    } else {
        None
    };
    let entries: &[Entry] = match config.layout(layout, origin, "spec.migManager.default") {
        Ok(e) => e,
        Err(_) if generic.is_some() => &[],
        Err(e) => return Err(e.into()),
    };
    let node_err = |path: String, message: String| PlanError::Node {
        origin: origin.to_string(),
        path,
        message,
    };
    // GPU index → where its entry is, the entry.
    let mut chosen: BTreeMap<u32, (String, Cow<'_, Entry>)> = BTreeMap::new();
    let mut absent: Vec<u32> = Vec::new();
    let mut derived: Vec<u32> = Vec::new();
    // What NVML said of a GPU while choosing: its mode and profiles.
    let mut seen: BTreeMap<u32, (Mode, Option<Vec<GiProfile>>)> = BTreeMap::new();
    if config.builtin {
        for g in &inv.gpus {
            let Some(index) = g.index else { continue };
            if g.mig.is_none() {
                // Every built-in entry says `devices: all`: GPUs that cannot
                // do MIG are skipped, as mig-parted skips them.
                continue;
            }
            let mode = match &g.uuid {
                Some(uuid) => control.mode(uuid)?,
                None => Mode {
                    current: false,
                    pending: false,
                },
            };
            let profiles = match &g.uuid {
                Some(uuid) => profiles_of(control, g, uuid, mode.current)?,
                None => facts(g),
            };
            let selecting = entries
                .iter()
                .enumerate()
                .find(|(_, e)| entry_selects(e, g));
            let has_all = |e: &Entry| {
                profiles.as_ref().is_none_or(|p| {
                    e.mig_devices.iter().flatten().all(|(key, _)| {
                        ProfileKey::parse(key)
                            .is_some_and(|k| p.iter().any(|p| p.name == k.gi_profile))
                    })
                })
            };
            match (selecting, &generic) {
                (Some((i, e)), _) if has_all(e) => {
                    chosen.insert(
                        index,
                        (format!("mig-configs.{layout}[{i}]"), Cow::Borrowed(e)),
                    );
                }
                (Some((i, e)), None) => {
                    // Not a name the derived layouts know: the entry as is
                    // (planning it says which profile the GPU lacks).
                    chosen.insert(
                        index,
                        (format!("mig-configs.{layout}[{i}]"), Cow::Borrowed(e)),
                    );
                }
                (None, None) => {}
                (_, Some(kind)) => {
                    let at =
                        format!("mig-configs.{layout} (derived from GPU {index}'s MIG profiles)");
                    let listed = match (&profiles, kind) {
                        (Some(p), _) => p.as_slice(),
                        (None, derive::Generic::Disabled | derive::Generic::Enabled) => &[],
                        (None, _) => {
                            return Err(node_err(
                                at,
                                format!(
                                    "GPU {index} ({}, PCI device {}) is not in gpu-agent's MIG table and NVML lists no MIG profiles while MIG is off; select all-enabled first, then {layout}",
                                    model(g),
                                    g.pci
                                        .as_ref()
                                        .map_or("unknown".into(), |p| format!("{:#06x}", p.device)),
                                ),
                            ));
                        }
                    };
                    let e = derive::entry(kind, listed).map_err(|m| {
                        node_err(at.clone(), format!("GPU {index} ({}) {m}", model(g)))
                    })?;
                    derived.push(index);
                    chosen.insert(index, (at, Cow::Owned(e)));
                }
            }
            seen.insert(index, (mode, profiles));
        }
    } else {
        for (i, e) in entries.iter().enumerate() {
            let at = format!("mig-configs.{layout}[{i}]");
            // An index the node does not have is skipped, as mig-parted walks
            // the node's GPUs and skips what no entry selects.
            if let Devices::Indices(v) = &e.devices {
                for idx in v {
                    if !inv.gpus.iter().any(|g| g.index == Some(*idx)) && !absent.contains(idx) {
                        absent.push(*idx);
                    }
                }
            }
            for g in &inv.gpus {
                let Some(index) = g.index else { continue };
                if !entry_selects(e, g) {
                    continue;
                }
                if g.mig.is_none() {
                    // mig-parted skips GPUs that cannot do MIG where the entry
                    // says `all` or turns MIG off; naming one is an error.
                    if e.mig_enabled && matches!(e.devices, Devices::Indices(_)) {
                        return Err(node_err(
                            format!("{at}.devices"),
                            format!("GPU {index} ({}) cannot do MIG", model(g)),
                        ));
                    }
                    continue;
                }
                if let Some((j, _)) = chosen.get(&index) {
                    return Err(node_err(
                        at.to_string(),
                        format!(
                            "GPU {index} is also selected by {j}; each GPU may be selected once"
                        ),
                    ));
                }
                chosen.insert(index, (at.clone(), Cow::Borrowed(e)));
            }
        }
    }
    let mut gpus = Vec::new();
    for (index, (at, e)) in chosen {
        let g = inv
            .gpus
            .iter()
            .find(|g| g.index == Some(index))
            .expect("chosen from the inventory");
        let uuid = g
            .uuid
            .clone()
            .ok_or_else(|| node_err(at.clone(), format!("GPU {index} has no UUID from NVML")))?;
        let (mode, profiles) = match seen.remove(&index) {
            Some(s) => s,
            None => {
                let mode = control.mode(&uuid)?;
                let profiles = profiles_of(control, g, &uuid, mode.current)?;
                (mode, profiles)
            }
        };
        let instances = if mode.current {
            control.instances(&uuid)?
        } else {
            Vec::new()
        };
        let listed = profiles.as_deref().unwrap_or(&[]);
        let current = layout_of(control, &uuid, mode.current, &instances, listed)?;
        // A model NVML lists no profiles for (MIG off) and NVIDIA's table
        // lacks is checked against NVML once MIG is on.
        let wanted = wanted_of(&e, &at, index, g, listed, profiles.is_some(), origin)?;
        let cap_nodes = g
            .mig_devices
            .iter()
            .filter_map(|m| Some((g.minor?, m.gpu_instance_id?, m.compute_instance_id?)))
            .flat_map(|(minor, gi, ci)| {
                [None, Some(ci)]
                    .map(|c| format!("/dev/nvidia-caps/nvidia-cap{}", cap_minor(minor, gi, c)))
            })
            .collect();
        gpus.push(GpuPlan {
            index,
            uuid,
            model: model(g),
            minor: g.minor,
            bus_id: g.bus_id,
            mode,
            instances,
            current,
            wanted,
            cap_nodes,
        });
    }
    absent.sort_unstable();
    Ok(Plan {
        absent,
        derived,
        layout: layout.to_string(),
        gpus,
    })
}

/// A GPU's MIG profiles: NVML's list, else (MIG off, where NVML may list
/// none or refuse) NVIDIA's published table for the model; `None` when
/// neither has them.
fn profiles_of(
    control: &dyn MigControl,
    g: &Gpu,
    uuid: &str,
    mig_on: bool,
) -> Result<Option<Vec<GiProfile>>, MigError> {
    let listed = match control.gi_profiles(uuid) {
        Ok(p) => p,
        Err(e) if mig_on => return Err(e),
        Err(e) => {
            tracing::debug!(gpu_uuid = uuid, error = %e, "NVML lists no MIG profiles while MIG is off");
            Vec::new()
        }
    };
    if !listed.is_empty() {
        return Ok(Some(listed));
    }
    Ok(facts(g))
}

/// The `/dev/nvidia-caps` minor of a GPU instance's (or, with `ci`, a
/// compute instance's) access capability, numbered as NVIDIA's driver does
/// (`/proc/driver/nvidia-caps/mig-minors`).
fn cap_minor(gpu_minor: u32, gi: u32, ci: Option<u32>) -> u32 {
    simnode::mig_cap_minor(gpu_minor, gi, ci)
}

/// The model's GPU-instance profiles from NVIDIA's published table.
fn facts(g: &Gpu) -> Option<Vec<GiProfile>> {
    let f = simnode::mig::facts_for(g.pci.as_ref()?.device, g.memory_mib.unwrap_or(0))?;
    Some(f.profiles.iter().map(GiProfile::from_table).collect())
}

fn model(g: &Gpu) -> String {
    g.model.clone().unwrap_or_else(|| "unknown model".into())
}

fn entry_selects(e: &Entry, g: &Gpu) -> bool {
    if let Devices::Indices(v) = &e.devices
        && !g.index.is_some_and(|i| v.contains(&i))
    {
        return false;
    }
    let Some(filter) = &e.device_filter else {
        return true;
    };
    let Some(pci) = &g.pci else {
        return false;
    };
    let sub = pci.subsystem_device.zip(pci.subsystem_vendor);
    filter
        .items()
        .iter()
        .any(|f| DeviceFilter::parse(f).is_some_and(|f| f.matches(pci.vendor, pci.device, sub)))
}

/// What a GPU has now, as a layout.
fn layout_of(
    control: &dyn MigControl,
    uuid: &str,
    enabled: bool,
    instances: &[GpuInstance],
    profiles: &[GiProfile],
) -> Result<GpuLayout, MigError> {
    let mut gis = Vec::new();
    for gi in instances {
        let name = profiles
            .iter()
            .find(|p| p.id == gi.profile_id)
            .map(|p| p.name.clone())
            .unwrap_or_else(|| format!("profile-{}", gi.profile_id));
        let cps = if gi.cis.is_empty() {
            Vec::new()
        } else {
            control.ci_profiles(uuid, gi.id)?
        };
        let mut cis: Vec<u32> = gi
            .cis
            .iter()
            .map(|c| {
                cps.iter()
                    .find(|p| p.id == c.profile_id)
                    .map_or(0, |p| p.slices)
            })
            .collect();
        cis.sort_unstable_by(|a, b| b.cmp(a));
        gis.push(WantedGi { profile: name, cis });
    }
    gis.sort();
    Ok(GpuLayout { enabled, gis })
}

/// What an entry wants of one GPU; checks the profiles against the GPU's
/// (when MIG is on, NVML says which it has) and that they fit.
fn wanted_of(
    e: &Entry,
    at: &str,
    index: u32,
    g: &Gpu,
    profiles: &[GiProfile],
    known: bool,
    origin: &str,
) -> Result<GpuLayout, PlanError> {
    let err = |path: String, message: String| PlanError::Node {
        origin: origin.to_string(),
        path,
        message,
    };
    if !e.mig_enabled {
        return Ok(GpuLayout {
            enabled: false,
            gis: Vec::new(),
        });
    }
    let mut gis = Vec::new();
    let mut partial: BTreeMap<String, (u32, Vec<u32>)> = BTreeMap::new();
    for (key, &count) in e.mig_devices.iter().flatten() {
        let k = ProfileKey::parse(key).expect("checked when the config was read");
        if known && !profiles.iter().any(|p| p.name == k.gi_profile) {
            let names: Vec<&str> = profiles.iter().map(|p| p.name.as_str()).collect();
            return Err(err(
                format!("{at}.mig-devices.{key}"),
                format!(
                    "GPU {index} ({}) has no MIG profile {} (it has: {})",
                    model(g),
                    k.gi_profile,
                    names.join(", ")
                ),
            ));
        }
        match k.ci_slices {
            None => gis.extend((0..count).map(|_| WantedGi {
                profile: k.gi_profile.clone(),
                cis: vec![k.gi_slices],
            })),
            Some(c) => partial
                .entry(k.gi_profile.clone())
                .or_insert_with(|| (k.gi_slices, Vec::new()))
                .1
                .extend(std::iter::repeat_n(c, count as usize)),
        }
    }
    // Smaller compute instances share GPU instances: first fit, biggest first.
    for (profile, (cap, mut cis)) in partial {
        cis.sort_unstable_by(|a, b| b.cmp(a));
        let mut bins: Vec<Vec<u32>> = Vec::new();
        for c in cis {
            match bins.iter_mut().find(|b| b.iter().sum::<u32>() + c <= cap) {
                Some(b) => b.push(c),
                None => bins.push(vec![c]),
            }
        }
        gis.extend(bins.into_iter().map(|cis| WantedGi {
            profile: profile.clone(),
            cis,
        }));
    }
    gis.sort();
    if known {
        fits(&gis, profiles).map_err(|m| {
            err(
                format!("{at}.mig-devices"),
                format!("GPU {index} ({}): {m}", model(g)),
            )
        })?;
    }
    Ok(GpuLayout { enabled: true, gis })
}

/// Whether `gis` fit a GPU with `profiles`: instance counts, then a
/// placement for each.
fn fits(gis: &[WantedGi], profiles: &[GiProfile]) -> Result<Vec<Placement>, String> {
    let mut counts: BTreeMap<&str, u32> = BTreeMap::new();
    for gi in gis {
        *counts.entry(gi.profile.as_str()).or_default() += 1;
    }
    for (name, n) in &counts {
        let p = profiles.iter().find(|p| p.name == *name).expect("checked");
        if *n > p.instances {
            return Err(format!(
                "{n} instances of {name} do not fit (at most {})",
                p.instances
            ));
        }
    }
    let options: Vec<&[Placement]> = gis
        .iter()
        .map(|gi| {
            profiles
                .iter()
                .find(|p| p.name == gi.profile)
                .map_or(&[][..], |p| p.placements.as_slice())
        })
        .collect();
    place::solutions(&options, &[], 1)
        .into_iter()
        .next()
        .ok_or_else(|| {
            format!(
                "{} do not fit together (no placement leaves them apart)",
                GpuLayout {
                    enabled: true,
                    gis: gis.to_vec()
                }
                .describe()
            )
        })
}

/// A process that holds a GPU that is about to change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    pub pid: u32,
    pub command: String,
    pub device: String,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} ({}) on {}", self.pid, self.command, self.device)
    }
}

/// Processes other than this agent (and the driver's persistence daemon,
/// which holds every GPU and does not stand in MIG's way) holding the
/// changing GPUs: open `/dev/nvidiaN` or MIG capability nodes (from the
/// host's /proc), and what NVML lists as running on them.
pub fn holders(control: &dyn MigControl, host: &HostRoot, plan: &Plan) -> Vec<Holder> {
    let mut wanted: BTreeMap<String, u32> = BTreeMap::new();
    for g in plan.changing() {
        if let Some(m) = g.minor {
            wanted.insert(format!("/dev/nvidia{m}"), g.index);
        }
        for c in &g.cap_nodes {
            wanted.insert(c.clone(), g.index);
        }
    }
    let me = host
        .read_link("/proc/self")
        .ok()
        .and_then(|p| p.to_str().and_then(|s| s.parse::<u32>().ok()))
        .unwrap_or_else(std::process::id);
    let command = |pid: u32| {
        host.read_to_string(format!("/proc/{pid}/comm"))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "?".into())
    };
    let mut found: Vec<Holder> = Vec::new();
    for name in host.read_dir_names("/proc").unwrap_or_default() {
        let Ok(pid) = name.parse::<u32>() else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(fds) = host.read_dir_names(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds {
            let Ok(target) = host.read_link(format!("/proc/{pid}/fd/{fd}")) else {
                continue;
            };
            let target = target.display().to_string();
            if wanted.contains_key(&target)
                && !found.iter().any(|h| h.pid == pid && h.device == target)
            {
                found.push(Holder {
                    pid,
                    command: command(pid),
                    device: target,
                });
            }
        }
    }
    for g in plan.changing() {
        for pid in control.processes(&g.uuid).unwrap_or_default() {
            if pid != me && !found.iter().any(|h| h.pid == pid) {
                found.push(Holder {
                    pid,
                    command: command(pid),
                    device: format!("GPU {} ({})", g.index, g.uuid),
                });
            }
        }
    }
    found.retain(|h| h.command != "nvidia-persiste");
    found.sort_by(|a, b| (a.pid, &a.device).cmp(&(b.pid, &b.device)));
    found
}

/// Waits until no process holds the changing GPUs, up to `timeout`;
/// `Err` names those that still do.
pub fn wait_for_holders(
    control: &dyn MigControl,
    host: &HostRoot,
    plan: &Plan,
    timeout: Duration,
) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    loop {
        let h = holders(control, host, plan);
        if h.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(holders_message(&h, timeout));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

pub fn holders_message(h: &[Holder], timeout: Duration) -> String {
    format!(
        "GPUs still in use after {} s (spec.migManager.gpuClientsTimeoutSeconds): {}",
        timeout.as_secs(),
        h.iter()
            .map(Holder::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// How an apply ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// Every GPU has its wanted layout; what changed, by GPU index.
    Done(Vec<(u32, String)>),
    /// A GPU's mode change waits for a reboot, which was asked for.
    Rebooting(String),
}

/// Whether a failed state's detail says the apply itself failed (and was
/// rolled back), as opposed to waiting on processes.
pub fn apply_failed(detail: &str) -> bool {
    detail.contains(APPLY_FAILED)
}

/// Marks an apply failure in the stage's detail.
pub const APPLY_FAILED: &str = " failed and was rolled back: ";

/// An apply that failed; the previous layout was put back (or the message
/// says what could not be).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApplyError {
    pub message: String,
}

/// What the applier may do beyond NVML.
#[derive(Debug)]
pub struct ApplyEnv<'a> {
    pub host: &'a HostRoot,
    /// Runs the host's `systemctl reboot` when a reboot is allowed.
    pub runner: &'a dyn CommandRunner,
    /// `spec.migManager.reboot`.
    pub reboot: bool,
}

/// Applies `plan`'s changes; on failure every changed GPU gets its
/// previous layout back.
pub fn apply(
    control: &dyn MigControl,
    env: &ApplyEnv<'_>,
    plan: &Plan,
) -> Result<Applied, ApplyError> {
    let changing: Vec<&GpuPlan> = plan.changing().collect();
    let mut touched: Vec<&GpuPlan> = Vec::new();
    let mut done = Vec::new();
    let result = (|| -> Result<Option<String>, String> {
        // 1. Modes (a GPU turning MIG off loses its instances first).
        let mut need_reset = Vec::new();
        for g in &changing {
            touched.push(*g);
            let mode = control.mode(&g.uuid).map_err(|e| e.to_string())?;
            if !g.wanted.enabled && mode.current {
                clear(control, &g.uuid).map_err(|e| e.to_string())?;
            }
            if mode.pending != g.wanted.enabled {
                control
                    .set_mode(&g.uuid, g.wanted.enabled)
                    .map_err(|e| e.to_string())?;
            }
            let now = control.mode(&g.uuid).map_err(|e| e.to_string())?;
            if now.current != g.wanted.enabled {
                need_reset.push(*g);
            }
        }
        // 2. Resets for modes that wait for one.
        for g in &need_reset {
            reset(env.host, g)?;
            let now = control.mode(&g.uuid).map_err(|e| e.to_string())?;
            if now.current != g.wanted.enabled {
                let why = format!(
                    "GPU {} ({}): MIG mode {} is pending and a GPU reset did not apply it; only a reboot can",
                    g.index,
                    g.uuid,
                    if g.wanted.enabled { "on" } else { "off" }
                );
                if env.reboot {
                    let mut argv: Vec<String> = Vec::new();
                    if !env.host.is_system() {
                        argv.push("chroot".into());
                        argv.push(env.host.path().display().to_string());
                    }
                    argv.extend(["systemctl", "reboot"].map(String::from));
                    env.runner.run(&argv).map_err(|e| format!("{why}; {e}"))?;
                    return Ok(Some(format!(
                        "{why}: rebooting the node (spec.migManager.reboot)"
                    )));
                }
                return Err(format!(
                    "{why}; reboot the node, or let gpu-agent do it with spec.migManager.reboot: true"
                ));
            }
            done.push((g.index, "reset to apply MIG mode".to_string()));
        }
        // 3. Instances.
        for g in &changing {
            if !g.wanted.enabled {
                done.push((g.index, "MIG off".to_string()));
                continue;
            }
            clear(control, &g.uuid).map_err(|e| e.to_string())?;
            create(control, g).map_err(|e| format!("GPU {} ({}): {e}", g.index, g.uuid))?;
            // 4. Check.
            let instances = control.instances(&g.uuid).map_err(|e| e.to_string())?;
            let profiles = control.gi_profiles(&g.uuid).map_err(|e| e.to_string())?;
            let now = layout_of(control, &g.uuid, true, &instances, &profiles)
                .map_err(|e| e.to_string())?;
            if now != g.wanted {
                return Err(format!(
                    "GPU {} ({}): after applying, NVML shows {} instead of {}",
                    g.index,
                    g.uuid,
                    now.describe(),
                    g.wanted.describe()
                ));
            }
            done.push((g.index, g.wanted.describe()));
        }
        Ok(None)
    })();
    match result {
        Ok(None) => Ok(Applied::Done(done)),
        Ok(Some(why)) => Ok(Applied::Rebooting(why)),
        Err(why) => {
            let mut message = format!("{why}; ");
            let mut failures = Vec::new();
            for g in touched.iter().rev() {
                if let Err(e) = restore(control, env.host, g) {
                    failures.push(format!("GPU {}: {e}", g.index));
                }
            }
            if failures.is_empty() {
                message.push_str("the previous layout is back");
            } else {
                message.push_str(&format!(
                    "putting the previous layout back failed too: {}",
                    failures.join("; ")
                ));
            }
            Err(ApplyError { message })
        }
    }
}

/// Destroys every compute instance, then every GPU instance.
fn clear(control: &dyn MigControl, uuid: &str) -> Result<(), MigError> {
    let mode = control.mode(uuid)?;
    if !mode.current {
        return Ok(());
    }
    for gi in control.instances(uuid)? {
        for ci in &gi.cis {
            control.destroy_ci(uuid, gi.id, ci.id)?;
        }
        control.destroy_gi(uuid, gi.id)?;
    }
    Ok(())
}

/// How many placement solutions are tried before giving up.
const MAX_TRIES: usize = 16;

/// Creates the wanted instances, trying placements until NVML takes one.
fn create(control: &dyn MigControl, g: &GpuPlan) -> Result<(), String> {
    let profiles = control.gi_profiles(&g.uuid).map_err(|e| e.to_string())?;
    let mut by_gi: Vec<(&WantedGi, &GiProfile)> = Vec::new();
    for gi in &g.wanted.gis {
        let p = profiles
            .iter()
            .find(|p| p.name == gi.profile)
            .ok_or_else(|| {
                format!(
                    "no MIG profile {} on this GPU (it has: {})",
                    gi.profile,
                    profiles
                        .iter()
                        .map(|p| p.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })?;
        by_gi.push((gi, p));
    }
    let options: Vec<&[Placement]> = by_gi.iter().map(|(_, p)| p.placements.as_slice()).collect();
    let solutions = place::solutions(&options, &[], MAX_TRIES);
    if solutions.is_empty() {
        return Err(format!(
            "{} do not fit together (no placement leaves them apart)",
            g.wanted.describe()
        ));
    }
    let mut last = String::new();
    for (attempt, solution) in solutions.iter().enumerate() {
        match create_at(control, &g.uuid, &by_gi, solution) {
            Ok(()) => return Ok(()),
            Err(e) => {
                tracing::debug!(gpu_uuid = %g.uuid, attempt, error = %e, "placement refused; trying another");
                last = e.to_string();
                clear(control, &g.uuid).map_err(|e| e.to_string())?;
            }
        }
    }
    Err(format!(
        "NVML refused every placement tried ({}): {last}",
        solutions.len()
    ))
}

fn create_at(
    control: &dyn MigControl,
    uuid: &str,
    gis: &[(&WantedGi, &GiProfile)],
    at: &[Placement],
) -> Result<(), MigError> {
    for ((want, profile), &placement) in gis.iter().zip(at) {
        let gi = control.create_gi(uuid, profile.id, placement)?;
        let cps = control.ci_profiles(uuid, gi)?;
        for &slices in &want.cis {
            let cp = cps.iter().find(|c| c.slices == slices).ok_or_else(|| MigError {
                gpu: uuid.to_string(),
                call: "nvmlGpuInstanceGetComputeInstanceProfileInfo",
                message: format!(
                    "GPU instance {gi} ({}) has no compute-instance profile of {slices} slice(s)",
                    profile.name
                ),
                kind: ErrorKind::NotSupported,
            })?;
            control.create_ci(uuid, gi, cp.id)?;
        }
    }
    Ok(())
}

/// Puts a GPU's previous instances (same profiles, same placements) and
/// mode back.
fn restore(control: &dyn MigControl, host: &HostRoot, g: &GpuPlan) -> Result<(), String> {
    let mode = control.mode(&g.uuid).map_err(|e| e.to_string())?;
    if mode.current {
        clear(control, &g.uuid).map_err(|e| e.to_string())?;
    }
    if mode.pending != g.mode.pending {
        control
            .set_mode(&g.uuid, g.mode.pending)
            .map_err(|e| e.to_string())?;
        let now = control.mode(&g.uuid).map_err(|e| e.to_string())?;
        if now.current != g.mode.current {
            reset(host, g)?;
        }
    }
    let now = control.mode(&g.uuid).map_err(|e| e.to_string())?;
    if now.current {
        for gi in &g.instances {
            let id = control
                .create_gi(
                    &g.uuid,
                    gi.profile_id,
                    Placement {
                        start: gi.placement.0,
                        size: gi.placement.1,
                    },
                )
                .map_err(|e| e.to_string())?;
            for ci in &gi.cis {
                control
                    .create_ci(&g.uuid, id, ci.profile_id)
                    .map_err(|e| e.to_string())?;
            }
        }
    }
    Ok(())
}

/// Resets a GPU through its PCI function (`/sys/bus/pci/devices/<bdf>/reset`
/// under the host root).
fn reset(host: &HostRoot, g: &GpuPlan) -> Result<(), String> {
    use std::io::Write;
    let file = format!("/sys/bus/pci/devices/{}/reset", g.bus_id);
    let path = host.resolve(&file).map_err(|e| e.to_string())?;
    tracing::info!(gpu_uuid = %g.uuid, path = %file, "resetting the GPU to apply its MIG mode");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|mut f| f.write_all(b"1"))
        .map_err(|e| {
            format!(
                "GPU {} ({}): cannot reset it through {file}: {e}",
                g.index, g.uuid
            )
        })
}
