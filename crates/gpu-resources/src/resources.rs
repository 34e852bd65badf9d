//! From the inventory to the resources the device plugin advertises:
//! `nvidia.com/gpu` (whole GPUs, time-sliced replicas or MPS clients),
//! renamed shared resources, MIG strategies.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::config::MigStrategy;
use super::config::{
    AllocationPolicy, DeviceIdStrategy, DeviceListStrategy, ReplicatedResource, SharingSpec,
    SharingStrategy,
};
use gpu_model::backend::ComputeCapability;
use gpu_model::inventory::Inventory;

/// The plain whole-GPU resource.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// Where MPS pipe, log and shm directories live on the host, per resource
/// (`<root>/<resource>/pipe`), unless `flags.mpsRoot` says otherwise: the
/// GPU Operator's `MPS_ROOT`.
pub const DEFAULT_MPS_ROOT: &str = "/run/nvidia/mps";
/// The oldest GPUs MPS can share as gpu-agent shares them: the per-client
/// thread percentage and pinned-memory limit are Volta MPS features.
pub const MPS_MIN_COMPUTE_CAPABILITY: ComputeCapability = ComputeCapability { major: 7, minor: 0 };
/// Clients one MPS server serves per GPU from Volta on (NVIDIA's MPS
/// documentation; its device plugin refuses more replicas than this too).
pub const MPS_MAX_CLIENTS: u32 = 48;

/// Effective device-plugin settings (policy, then the config file's flags).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginSettings {
    pub mig_strategy: MigStrategy,
    pub list_strategies: Vec<DeviceListStrategy>,
    pub id_strategy: DeviceIdStrategy,
    pub pass_device_specs: bool,
    pub cdi_annotation_prefix: String,
    pub allocation_policy: AllocationPolicy,
    /// `sharing.timeSlicing`.
    pub time_slicing: Option<SharingSpec>,
    /// `sharing.mps`: replicas served by one MPS control daemon per resource.
    #[serde(default)]
    pub mps: Option<SharingSpec>,
    /// `flags.mpsRoot`: the host directory of the MPS daemons' pipe, log
    /// and shm directories.
    #[serde(default = "default_mps_root")]
    pub mps_root: String,
    /// The config's keys gpu-agent takes but does not act on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unacted: Vec<super::config::Unacted>,
}

fn default_mps_root() -> String {
    DEFAULT_MPS_ROOT.to_string()
}

impl PluginSettings {
    /// True when `Allocate` answers with CDI device names (cdi-annotations
    /// or cdi-cri), which a runtime resolves through the CDI spec.
    pub fn hands_out_cdi_names(&self) -> bool {
        self.list_strategies.iter().any(|l| {
            matches!(
                l,
                DeviceListStrategy::CdiAnnotations | DeviceListStrategy::CdiCri
            )
        })
    }

    /// The sharing in force and its entries: MPS when `sharing.mps` has
    /// entries, else time-slicing when it has (the config check refuses
    /// both at once), else none.
    pub fn sharing(&self) -> Option<(SharingStrategy, &SharingSpec)> {
        match (&self.mps, &self.time_slicing) {
            (Some(m), _) if !m.resources.is_empty() => Some((SharingStrategy::Mps, m)),
            (_, Some(t)) if !t.resources.is_empty() => Some((SharingStrategy::TimeSlicing, t)),
            _ => None,
        }
    }
}

impl Default for PluginSettings {
    fn default() -> Self {
        PluginSettings {
            mig_strategy: MigStrategy::Single,
            list_strategies: vec![DeviceListStrategy::Envvar],
            id_strategy: DeviceIdStrategy::Uuid,
            pass_device_specs: false,
            cdi_annotation_prefix: "cdi.k8s.io/".into(),
            allocation_policy: AllocationPolicy::Distributed,
            time_slicing: None,
            mps: None,
            mps_root: default_mps_root(),
            unacted: Vec::new(),
        }
    }
}

/// One advertised device: a whole GPU or one replica of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginDevice {
    /// What the kubelet sees: the UUID, or `<UUID>::<n>` for a replica.
    pub id: String,
    /// The device's own UUID: the GPU's, or the MIG device's.
    pub uuid: String,
    /// The physical GPU's UUID (health events name it).
    pub gpu_uuid: String,
    /// NVML index of the physical GPU.
    pub index: u32,
    /// The name in index naming: `3`, or `3:1` for a MIG device.
    pub index_name: String,
    /// `/dev/nvidiaN`'s N.
    pub minor: Option<u32>,
    pub replica: Option<u32>,
    pub numa_node: Option<u32>,
    pub healthy: bool,
}

/// One resource and its devices.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resource {
    /// `nvidia.com/gpu`, `nvidia.com/gpu.shared`, ...
    pub name: String,
    pub devices: Vec<PluginDevice>,
    /// Devices are replicas (time-sliced, or MPS clients).
    pub shared: bool,
    /// The replicas are clients of this resource's MPS control daemon.
    #[serde(default)]
    pub mps: bool,
    /// Requests for more than one replica are refused.
    pub fail_requests_greater_than_one: bool,
}

impl Resource {
    /// The socket file name: `nvidia-<name after nvidia.com/>.sock`.
    pub fn socket_name(&self) -> String {
        socket_name(&self.name)
    }
}

/// `nvidia.com/mig-1g.10gb` → `nvidia-mig-1g.10gb.sock`.
pub fn socket_name(resource: &str) -> String {
    let short = resource.strip_prefix("nvidia.com/").unwrap_or(resource);
    format!("nvidia-{short}.sock")
}

/// The inventory cannot be advertised as configured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResourceError {
    #[error(
        "{device} is selected by sharing entries {first} and {second}; each device may be shared by one entry"
    )]
    SelectedTwice {
        device: String,
        first: usize,
        second: usize,
    },
    #[error(
        "resource {name} would mix whole devices and shared replicas ({device} is not shared); give the shared devices a `rename` or select them all"
    )]
    MixedSharing { name: String, device: String },
    #[error("mig.strategy single: {0}")]
    MigSingle(String),
    #[error(
        "passDeviceSpecs is not supported for MIG devices yet (they also need /dev/nvidia-caps nodes gpu-agent cannot name yet); use the envvar or CDI device-list strategies, or mig.strategy none"
    )]
    PassDeviceSpecsMig,
    #[error(
        "sharing.mps.resources[{entry}] selects {device}, which is in MIG mode: MPS cannot share a MIG-enabled GPU or its MIG devices (MIG and MPS on one GPU); leave it out with `devices`, or disable MIG on it"
    )]
    MpsOnMig { entry: usize, device: String },
    #[error(
        "sharing.mps.resources[{entry}] selects {device}, which cannot be shared with MPS: {why}"
    )]
    MpsIncapable {
        entry: usize,
        device: String,
        why: String,
    },
    #[error(
        "sharing.mps.resources[{entry}].replicas: {replicas} replicas of {device}, but an MPS server serves at most {max} clients per GPU"
    )]
    MpsTooManyReplicas {
        entry: usize,
        device: String,
        replicas: u32,
        max: u32,
    },
    #[error(
        "MPS resource {name} would divide GPU {first} into {first_replicas} replicas and GPU {second} into {second_replicas}: one MPS control daemon serves a resource with one thread share per client; give the entries different names (`rename`) so that each replica count has its own resource"
    )]
    MpsMixedReplicas {
        name: String,
        first: String,
        first_replicas: u32,
        second: String,
        second_replicas: u32,
    },
}

/// A device before sharing: which resource it belongs to.
struct Base {
    resource: String,
    uuid: String,
    gpu_uuid: String,
    index: u32,
    index_name: String,
    minor: Option<u32>,
    numa_node: Option<u32>,
    /// The physical GPU has MIG enabled.
    mig_on: bool,
    model: Option<String>,
    compute_capability: Option<ComputeCapability>,
}

impl Base {
    /// `GPU 0 (GPU-…)`, or `MIG device 0:1 (MIG-…) on GPU 0 (GPU-…)`, for refusals.
    fn describe(&self) -> String {
        if self.uuid == self.gpu_uuid {
            format!("GPU {} ({})", self.index_name, self.uuid)
        } else {
            format!(
                "MIG device {} ({}) on GPU {} ({})",
                self.index_name, self.uuid, self.index, self.gpu_uuid
            )
        }
    }

    /// Why MPS cannot share this device with `replicas` clients, if it cannot.
    fn mps_refusal(&self, entry: usize, replicas: u32) -> Option<ResourceError> {
        if self.mig_on {
            return Some(ResourceError::MpsOnMig {
                entry,
                device: self.describe(),
            });
        }
        let model = self.model.as_deref().unwrap_or("model unknown");
        match self.compute_capability {
            None => {
                return Some(ResourceError::MpsIncapable {
                    entry,
                    device: self.describe(),
                    why: format!(
                        "NVML did not report the compute capability of this {model}; MPS as gpu-agent runs it needs {MPS_MIN_COMPUTE_CAPABILITY} (Volta) or newer"
                    ),
                });
            }
            Some(cc) if cc < MPS_MIN_COMPUTE_CAPABILITY => {
                return Some(ResourceError::MpsIncapable {
                    entry,
                    device: self.describe(),
                    why: format!(
                        "a {model} has compute capability {cc}; the per-client thread and memory limits that divide it into replicas need {MPS_MIN_COMPUTE_CAPABILITY} (Volta) or newer"
                    ),
                });
            }
            Some(_) => {}
        }
        (replicas > MPS_MAX_CLIENTS).then(|| ResourceError::MpsTooManyReplicas {
            entry,
            device: self.describe(),
            replicas,
            max: MPS_MAX_CLIENTS,
        })
    }
}

/// `nvidia.com/mig-<profile>`, with `+` (e.g. `+me`) written as `.`.
pub fn mig_resource_name(profile: &str) -> String {
    format!("nvidia.com/mig-{}", profile.replace('+', "."))
}

/// MIG devices the mixed strategy leaves out because their compute
/// instance is part of their GPU instance only: (GPU UUID, MIG UUID,
/// profile), for the plugin stage to say.
pub fn partial_compute(inv: &Inventory, strategy: MigStrategy) -> Vec<(String, String, String)> {
    if strategy != MigStrategy::Mixed {
        return Vec::new();
    }
    inv.gpus
        .iter()
        .filter(|g| g.index.is_some() && g.mig.is_some_and(|m| m.current))
        .filter_map(|g| g.uuid.as_ref().map(|u| (u, g)))
        .flat_map(|(uuid, g)| {
            g.mig_devices
                .iter()
                .filter(|m| m.ci_slices != m.gi_slices)
                .map(|m| (uuid.clone(), m.uuid.clone(), m.profile.clone()))
        })
        .collect()
}

/// Every device the MIG strategy advertises, by resource.
fn base_devices(inv: &Inventory, strategy: MigStrategy) -> Result<Vec<Base>, ResourceError> {
    let gpus: Vec<&gpu_model::inventory::Gpu> = inv
        .gpus
        .iter()
        .filter(|g| g.uuid.is_some() && g.index.is_some())
        .collect();
    let mig_on = |g: &gpu_model::inventory::Gpu| g.mig.is_some_and(|m| m.current);
    if strategy == MigStrategy::Single && gpus.iter().any(|g| mig_on(g)) {
        if let Some(g) = gpus.iter().find(|g| !mig_on(g)) {
            return Err(ResourceError::MigSingle(format!(
                "GPU {} has MIG disabled while others have it enabled; every GPU must be in the same mode (or use mixed)",
                g.index.unwrap_or_default()
            )));
        }
        if let Some(g) = gpus.iter().find(|g| g.mig_devices.is_empty()) {
            return Err(ResourceError::MigSingle(format!(
                "GPU {} has MIG enabled but no MIG devices; apply a MIG layout first",
                g.index.unwrap_or_default()
            )));
        }
        let profiles: std::collections::BTreeSet<&str> = gpus
            .iter()
            .flat_map(|g| g.mig_devices.iter().map(|m| m.profile.as_str()))
            .collect();
        if profiles.len() > 1 {
            return Err(ResourceError::MigSingle(format!(
                "the node has several MIG profiles ({}); single needs one (or use mixed)",
                profiles.into_iter().collect::<Vec<_>>().join(", ")
            )));
        }
    }
    let mut out = Vec::new();
    for g in gpus {
        let (uuid, index) = (
            g.uuid.clone().expect("filtered"),
            g.index.expect("filtered"),
        );
        if strategy == MigStrategy::None || !mig_on(g) {
            out.push(Base {
                resource: GPU_RESOURCE.to_string(),
                uuid: uuid.clone(),
                gpu_uuid: uuid,
                index,
                index_name: index.to_string(),
                minor: g.minor,
                numa_node: g.numa_node,
                mig_on: mig_on(g),
                model: g.model.clone(),
                compute_capability: g.compute_capability,
            });
            continue;
        }
        for m in &g.mig_devices {
            let resource = match strategy {
                MigStrategy::Single => GPU_RESOURCE.to_string(),
                // Left out, said by the plugin stage ([`partial_compute`]).
                _ if m.ci_slices != m.gi_slices => continue,
                _ => mig_resource_name(&m.profile),
            };
            out.push(Base {
                resource,
                uuid: m.uuid.clone(),
                gpu_uuid: uuid.clone(),
                index,
                index_name: format!("{index}:{}", m.index),
                minor: g.minor,
                numa_node: g.numa_node,
                mig_on: true,
                model: g.model.clone(),
                compute_capability: g.compute_capability,
            });
        }
    }
    Ok(out)
}

/// The name a sharing entry's replicas are advertised under: its `rename`
/// (`nvidia.com/` added when left out), `<name>.shared` with
/// `renameByDefault`, else the resource's own name.
fn shared_name(spec: &SharingSpec, r: &ReplicatedResource) -> String {
    match &r.rename {
        Some(n) if n.starts_with("nvidia.com/") => n.clone(),
        Some(n) => format!("nvidia.com/{n}"),
        None if spec.rename_by_default => format!("{}.shared", r.name),
        None => r.name.clone(),
    }
}

/// How the device plugin shares one resource.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replication {
    /// Time-slicing or MPS.
    pub strategy: SharingStrategy,
    /// Replicas of each device.
    pub replicas: u32,
    /// The resource the replicas are advertised as (`nvidia.com/gpu`, or
    /// `nvidia.com/gpu.shared` when renamed).
    pub advertised_as: String,
}

impl Replication {
    /// The replicas go by another name than the resource shared.
    pub fn renamed(&self, resource: &str) -> bool {
        self.advertised_as != resource
    }
}

/// The sharing of `resource` (`nvidia.com/gpu`, `nvidia.com/mig-1g.10gb`):
/// the first entry of the sharing in force naming it, as [`build`] applies
/// it; `None` when the resource is not shared.
pub fn replication(settings: &PluginSettings, resource: &str) -> Option<Replication> {
    let (strategy, spec) = settings.sharing()?;
    let r = spec.resources.iter().find(|r| r.name == resource)?;
    Some(Replication {
        strategy,
        replicas: r.replicas,
        advertised_as: shared_name(spec, r),
    })
}

/// Builds every resource with at least one device, sorted by name. GPUs that
/// NVML did not describe (no UUID) cannot be allocated and are left out.
pub fn build(inv: &Inventory, settings: &PluginSettings) -> Result<Vec<Resource>, ResourceError> {
    let mut by_name: BTreeMap<String, Resource> = BTreeMap::new();
    let sharing = settings.sharing();
    let bases = base_devices(inv, settings.mig_strategy)?;
    if settings.pass_device_specs && bases.iter().any(|b| b.uuid != b.gpu_uuid) {
        return Err(ResourceError::PassDeviceSpecsMig);
    }
    for b in bases {
        let mut entry = None;
        if let Some((_, spec)) = sharing {
            for (i, r) in spec.resources.iter().enumerate() {
                if r.name != b.resource || !r.devices.selects(b.index, &b.uuid, &b.index_name) {
                    continue;
                }
                if let Some((first, _)) = entry {
                    return Err(ResourceError::SelectedTwice {
                        device: format!("{} ({})", b.index_name, b.uuid),
                        first,
                        second: i,
                    });
                }
                entry = Some((i, r));
            }
        }
        let device = |id: String, replica| PluginDevice {
            id,
            uuid: b.uuid.clone(),
            gpu_uuid: b.gpu_uuid.clone(),
            index: b.index,
            index_name: b.index_name.clone(),
            minor: b.minor,
            replica,
            numa_node: b.numa_node,
            healthy: true,
        };
        let empty = |name: String, shared: bool, mps: bool, fail: bool| Resource {
            name,
            devices: Vec::new(),
            shared,
            mps,
            fail_requests_greater_than_one: fail,
        };
        match (entry, sharing) {
            (Some((i, r)), Some((strategy, spec))) => {
                let mps = strategy == SharingStrategy::Mps;
                if mps && let Some(refusal) = b.mps_refusal(i, r.replicas) {
                    return Err(refusal);
                }
                let name = shared_name(spec, r);
                let fail = spec
                    .fail_requests_greater_than_one
                    .unwrap_or(strategy.fail_requests_greater_than_one_default());
                let res = by_name
                    .entry(name.clone())
                    .or_insert_with(|| empty(name, true, mps, fail));
                for n in 0..r.replicas {
                    res.devices
                        .push(device(format!("{}::{n}", b.uuid), Some(n)));
                }
            }
            _ => {
                let res = by_name
                    .entry(b.resource.clone())
                    .or_insert_with(|| empty(b.resource.clone(), false, false, false));
                res.devices.push(device(b.uuid.clone(), None));
            }
        }
    }
    for res in by_name.values() {
        let whole = res.devices.iter().find(|d| d.replica.is_none());
        let has_replica = res.devices.iter().any(|d| d.replica.is_some());
        if let (Some(whole), true) = (whole, has_replica) {
            return Err(ResourceError::MixedSharing {
                name: res.name.clone(),
                device: whole.index_name.clone(),
            });
        }
    }
    for res in by_name.values().filter(|r| r.mps) {
        // MPS shares whole GPUs only: the NVML index names each one.
        let mut per_gpu: BTreeMap<u32, (u32, &str)> = BTreeMap::new();
        for d in &res.devices {
            per_gpu.entry(d.index).or_insert((0, &d.index_name)).0 += 1;
        }
        let mut counts = per_gpu.values();
        if let Some(&(n, first)) = counts.next()
            && let Some(&(m, second)) = counts.find(|(m, _)| *m != n)
        {
            return Err(ResourceError::MpsMixedReplicas {
                name: res.name.clone(),
                first: first.to_string(),
                first_replicas: n,
                second: second.to_string(),
                second_replicas: m,
            });
        }
    }
    for res in by_name.values_mut() {
        res.shared = res.devices.iter().any(|d| d.replica.is_some());
    }
    Ok(by_name
        .into_values()
        .filter(|r| !r.devices.is_empty())
        .collect())
}

#[cfg(test)]
mod tests;
