//! The planner: the layout the policy selects, chosen for each GPU and
//! checked against what NVML says the GPU has, before anything changes.

use std::borrow::Cow;
use std::collections::BTreeMap;

use gpu_model::inventory::{Gpu, Inventory};

use crate::config::{self, DeviceFilter, Devices, Entry, MigPartedConfig, ProfileKey};
use crate::derive;
use crate::layout::{GpuLayout, WantedGi, fits, layout_of};
use gpu_model::mig::{GiProfile, GpuInstance, MigControl, MigError, Mode};

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
