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
mod tests {
    use super::*;
    use crate::config::PluginConfig;
    use crate::test_support::inventory_of;

    /// Replicas per GPU, by NVML index.
    fn replicas_per_gpu(r: &Resource) -> BTreeMap<u32, u32> {
        let mut m = BTreeMap::new();
        for d in &r.devices {
            *m.entry(d.index).or_insert(0) += 1;
        }
        m
    }

    fn with_sharing(yaml: &str) -> PluginSettings {
        let c = PluginConfig::from_yaml(yaml, "c").unwrap();
        PluginSettings {
            time_slicing: c.sharing.time_slicing,
            ..PluginSettings::default()
        }
    }

    /// A MIG device whose compute instance is part of its GPU instance
    /// only is left out by the mixed strategy, and named by
    /// [`partial_compute`] (which the plugin stage logs once) — not logged
    /// by every [`build`].
    #[test]
    fn a_partial_compute_instance_is_left_out_and_named() {
        let mut inv = inventory_of("h100-mig-2");
        let g = inv
            .gpus
            .iter_mut()
            .find(|g| !g.mig_devices.is_empty())
            .unwrap();
        let gpu_uuid = g.uuid.clone().unwrap();
        let m = &mut g.mig_devices[0];
        m.ci_slices = m.gi_slices.saturating_sub(1).max(1);
        assert_ne!(m.ci_slices, m.gi_slices, "a GPU instance of one slice");
        let (mig, profile) = (m.uuid.clone(), m.profile.clone());
        assert_eq!(
            partial_compute(&inv, MigStrategy::Mixed),
            [(gpu_uuid, mig.clone(), profile)]
        );
        assert!(partial_compute(&inv, MigStrategy::None).is_empty());
        let settings = PluginSettings {
            mig_strategy: MigStrategy::Mixed,
            ..PluginSettings::default()
        };
        let rs = build(&inv, &settings).unwrap();
        assert!(
            rs.iter().all(|r| r.devices.iter().all(|d| d.id != mig)),
            "{rs:#?}"
        );
        assert!(rs.iter().map(|r| r.devices.len()).sum::<usize>() > 0);
    }

    #[test]
    fn whole_gpus_by_default() {
        let inv = inventory_of("h100-sxm-8");
        let rs = build(&inv, &PluginSettings::default()).unwrap();
        assert_eq!(rs.len(), 1);
        assert_eq!(rs[0].name, "nvidia.com/gpu");
        assert_eq!(rs[0].socket_name(), "nvidia-gpu.sock");
        assert_eq!(rs[0].devices.len(), 8);
        assert_eq!(
            rs[0].devices[0].id,
            "GPU-9d3b5a0e-1c7f-4e2a-8b61-0f2c3d4e5a01"
        );
        assert_eq!(rs[0].devices[7].numa_node, Some(1));
        assert!(!rs[0].shared);
    }

    #[test]
    fn time_slicing_four_replicas() {
        let s = with_sharing(
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n",
        );
        let rs = build(&inventory_of("t4-4"), &s).unwrap();
        assert_eq!(rs.len(), 1);
        assert_eq!(rs[0].name, "nvidia.com/gpu");
        assert_eq!(rs[0].devices.len(), 16);
        assert_eq!(
            rs[0].devices[5].id,
            "GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a41::1"
        );
        assert!(rs[0].shared);
    }

    #[test]
    fn rename_by_default_and_per_gpu_replica_counts() {
        let s = with_sharing(
            "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n    - {name: nvidia.com/gpu, devices: [0, 1], replicas: 4}\n    - {name: nvidia.com/gpu, devices: [2], replicas: 2, rename: gpu.small}\n",
        );
        let rs = build(&inventory_of("t4-4"), &s).unwrap();
        let names: Vec<&str> = rs.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "nvidia.com/gpu",
                "nvidia.com/gpu.shared",
                "nvidia.com/gpu.small"
            ]
        );
        assert_eq!(rs[0].devices.len(), 1); // GPU 3 stays whole
        assert_eq!(replicas_per_gpu(&rs[1]), BTreeMap::from([(0, 4), (1, 4)]));
        assert_eq!(replicas_per_gpu(&rs[2]), BTreeMap::from([(2, 2)]));
        assert_eq!(rs[2].socket_name(), "nvidia-gpu.small.sock");
    }

    #[test]
    fn conflicts_are_refused_with_the_gpu_named() {
        let twice = with_sharing(
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, devices: [0], replicas: 2}\n    - {name: nvidia.com/gpu, devices: all, replicas: 3, rename: other}\n",
        );
        let err = build(&inventory_of("t4-4"), &twice).unwrap_err();
        assert!(
            matches!(
                err,
                ResourceError::SelectedTwice {
                    first: 0,
                    second: 1,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().starts_with("0 (GPU-5f0cf4a3"), "{err}");
        let mixed = with_sharing(
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, devices: [0], replicas: 2}\n",
        );
        let err = build(&inventory_of("t4-4"), &mixed).unwrap_err();
        assert_eq!(
            err,
            ResourceError::MixedSharing {
                name: "nvidia.com/gpu".into(),
                device: "1".into()
            }
        );
    }

    fn mig(strategy: MigStrategy) -> Result<Vec<Resource>, ResourceError> {
        let settings = PluginSettings {
            mig_strategy: strategy,
            ..PluginSettings::default()
        };
        build(&inventory_of("h100-mig-2"), &settings)
    }

    #[test]
    fn mig_mixed_one_resource_per_profile() {
        let rs = mig(MigStrategy::Mixed).unwrap();
        let summary: Vec<(&str, usize, String)> = rs
            .iter()
            .map(|r| (r.name.as_str(), r.devices.len(), r.socket_name()))
            .collect();
        assert_eq!(
            summary,
            [
                (
                    "nvidia.com/mig-1g.10gb",
                    9,
                    "nvidia-mig-1g.10gb.sock".to_string()
                ),
                (
                    "nvidia.com/mig-2g.20gb",
                    1,
                    "nvidia-mig-2g.20gb.sock".to_string()
                ),
                (
                    "nvidia.com/mig-3g.40gb",
                    1,
                    "nvidia-mig-3g.40gb.sock".to_string()
                ),
            ]
        );
        let d = &rs[2].devices[0];
        assert!(d.id.starts_with("MIG-") && d.id == d.uuid);
        assert_eq!(d.index_name, "0:0");
        assert_eq!(d.gpu_uuid, "GPU-6a1f0c2e-5b3d-4e7f-8a9b-1c2d3e4f5a00");
        assert_eq!(rs[0].devices[8].index_name, "1:6");
    }

    #[test]
    fn pass_device_specs_is_refused_for_mig_devices() {
        let settings = PluginSettings {
            mig_strategy: MigStrategy::Mixed,
            pass_device_specs: true,
            ..PluginSettings::default()
        };
        let err = build(&inventory_of("h100-mig-2"), &settings).unwrap_err();
        assert_eq!(err, ResourceError::PassDeviceSpecsMig);
        // Whole GPUs are fine.
        let whole = PluginSettings {
            mig_strategy: MigStrategy::None,
            pass_device_specs: true,
            ..PluginSettings::default()
        };
        assert!(build(&inventory_of("h100-mig-2"), &whole).is_ok());
    }

    #[test]
    fn mig_none_advertises_whole_gpus() {
        let rs = mig(MigStrategy::None).unwrap();
        assert_eq!(rs.len(), 1);
        assert_eq!(rs[0].name, "nvidia.com/gpu");
        assert!(rs[0].devices.iter().all(|d| d.id.starts_with("GPU-")));
    }

    #[test]
    fn mig_single_refuses_several_profiles_and_mixed_modes() {
        let err = mig(MigStrategy::Single).unwrap_err().to_string();
        assert_eq!(
            err,
            "mig.strategy single: the node has several MIG profiles (1g.10gb, 2g.20gb, 3g.40gb); single needs one (or use mixed)"
        );
        // One profile everywhere: MIG devices become nvidia.com/gpu.
        let mut inv = inventory_of("h100-mig-2");
        inv.gpus[0].mig_devices = inv.gpus[1].mig_devices[..3].to_vec();
        let settings = PluginSettings::default();
        assert_eq!(settings.mig_strategy, MigStrategy::Single);
        let rs = build(&inv, &settings).unwrap();
        assert_eq!(rs.len(), 1);
        assert_eq!(rs[0].name, "nvidia.com/gpu");
        assert_eq!(rs[0].devices.len(), 10);
        // A MIG-enabled GPU without devices, or one GPU without MIG, is refused.
        inv.gpus[0].mig_devices.clear();
        assert!(
            build(&inv, &settings)
                .unwrap_err()
                .to_string()
                .contains("GPU 0 has MIG enabled but no MIG devices")
        );
        inv.gpus[0].mig = Some(gpu_model::backend::MigMode {
            current: false,
            pending: false,
        });
        assert!(
            build(&inv, &settings)
                .unwrap_err()
                .to_string()
                .contains("GPU 0 has MIG disabled")
        );
    }

    #[test]
    fn mig_devices_can_be_time_sliced_by_index_name() {
        let c = PluginConfig::from_yaml(
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/mig-3g.40gb, devices: [\"0:0\"], replicas: 2}\n",
            "c",
        )
        .unwrap();
        let settings = PluginSettings {
            mig_strategy: MigStrategy::Mixed,
            time_slicing: c.sharing.time_slicing,
            ..PluginSettings::default()
        };
        let rs = build(&inventory_of("h100-mig-2"), &settings).unwrap();
        let r = rs
            .iter()
            .find(|r| r.name == "nvidia.com/mig-3g.40gb")
            .unwrap();
        assert!(r.shared);
        assert_eq!(r.devices.len(), 2);
        assert!(r.devices[1].id.ends_with("::1"));
    }

    fn with_mps(yaml: &str, mig_strategy: MigStrategy) -> PluginSettings {
        let c = PluginConfig::from_yaml(yaml, "c").unwrap();
        PluginSettings {
            mig_strategy,
            mps: c.sharing.mps,
            ..PluginSettings::default()
        }
    }

    #[test]
    fn mps_replicas_per_gpu_refuse_more_than_one_by_default() {
        let s = with_mps(
            "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, devices: [0, 1], replicas: 4, rename: gpu.mps4}\n    - {name: nvidia.com/gpu, devices: [2, 3], replicas: 2, rename: gpu.mps2}\n",
            MigStrategy::Single,
        );
        let rs = build(&inventory_of("t4-4"), &s).unwrap();
        let names: Vec<&str> = rs.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["nvidia.com/gpu.mps2", "nvidia.com/gpu.mps4"]);
        assert!(
            rs.iter()
                .all(|r| r.mps && r.shared && r.fail_requests_greater_than_one)
        );
        assert_eq!(replicas_per_gpu(&rs[0]), BTreeMap::from([(2, 2), (3, 2)]));
        assert_eq!(replicas_per_gpu(&rs[1]), BTreeMap::from([(0, 4), (1, 4)]));
        assert_eq!(
            rs[1].devices[1].id,
            "GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a40::1"
        );
        // The labels read the same entry: MPS, 4 replicas, renamed.
        let r = replication(&s, "nvidia.com/gpu").unwrap();
        assert_eq!(r.strategy, SharingStrategy::Mps);
        assert_eq!(
            (r.replicas, r.advertised_as.as_str()),
            (4, "nvidia.com/gpu.mps4")
        );
        // `failRequestsGreaterThanOne: false` lifts the limit.
        let relaxed = with_mps(
            "version: v1\nsharing:\n  mps:\n    failRequestsGreaterThanOne: false\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n",
            MigStrategy::Single,
        );
        let rs = build(&inventory_of("t4-4"), &relaxed).unwrap();
        assert_eq!(rs[0].name, "nvidia.com/gpu");
        assert!(rs[0].mps && !rs[0].fail_requests_greater_than_one);
        // Time-slicing still defaults to no limit, and is not MPS.
        let ts = with_sharing(
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n",
        );
        let rs = build(&inventory_of("t4-4"), &ts).unwrap();
        assert!(!rs[0].mps && !rs[0].fail_requests_greater_than_one);
    }

    #[test]
    fn mps_on_mig_is_refused_naming_the_gpu() {
        let all = "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n";
        // Strategy none: the MIG-enabled GPUs are advertised whole.
        let err = build(
            &inventory_of("h100-mig-2"),
            &with_mps(all, MigStrategy::None),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "sharing.mps.resources[0] selects GPU 0 (GPU-6a1f0c2e-5b3d-4e7f-8a9b-1c2d3e4f5a00), which is in MIG mode: MPS cannot share a MIG-enabled GPU or its MIG devices (MIG and MPS on one GPU); leave it out with `devices`, or disable MIG on it"
        );
        // Mixed: a MIG resource named for MPS.
        let mig = with_mps(
            "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/mig-3g.40gb, replicas: 2}\n",
            MigStrategy::Mixed,
        );
        let err = build(&inventory_of("h100-mig-2"), &mig).unwrap_err();
        assert!(
            matches!(&err, ResourceError::MpsOnMig { entry: 0, device } if device.starts_with("MIG device 0:0 (MIG-")),
            "{err}"
        );
        // Mixed, one GPU out of MIG mode: MPS shares that one; the MIG
        // GPU's devices are their own resources, not shared.
        let mut inv = inventory_of("h100-mig-2");
        inv.gpus[1].mig = Some(gpu_model::backend::MigMode {
            current: false,
            pending: false,
        });
        inv.gpus[1].mig_devices.clear();
        let rs = build(&inv, &with_mps(all, MigStrategy::Mixed)).unwrap();
        let gpu = rs.iter().find(|r| r.name == GPU_RESOURCE).unwrap();
        assert!(gpu.mps);
        assert_eq!(replicas_per_gpu(gpu), BTreeMap::from([(1, 2)]));
        assert!(
            rs.iter()
                .filter(|r| r.name != GPU_RESOURCE)
                .all(|r| !r.shared && !r.mps)
        );
    }

    #[test]
    fn mps_on_gpus_that_cannot_do_it_is_refused() {
        let two = with_mps(
            "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, devices: [1], replicas: 2, rename: gpu.mps}\n",
            MigStrategy::Single,
        );
        let mut inv = inventory_of("t4-4");
        inv.gpus[1].model = Some("Tesla P100-PCIE-16GB".into());
        inv.gpus[1].compute_capability = Some(ComputeCapability { major: 6, minor: 0 });
        let err = build(&inv, &two).unwrap_err();
        assert_eq!(
            err.to_string(),
            "sharing.mps.resources[0] selects GPU 1 (GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a41), which cannot be shared with MPS: a Tesla P100-PCIE-16GB has compute capability 6.0; the per-client thread and memory limits that divide it into replicas need 7.0 (Volta) or newer"
        );
        // The same GPU left out of the entry is fine.
        let other = with_mps(
            "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, devices: [0], replicas: 2, rename: gpu.mps}\n",
            MigStrategy::Single,
        );
        assert!(build(&inv, &other).is_ok());
        inv.gpus[1].compute_capability = None;
        assert!(
            build(&inv, &two)
                .unwrap_err()
                .to_string()
                .contains("NVML did not report the compute capability")
        );
        let many = with_mps(
            "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 49}\n",
            MigStrategy::Single,
        );
        let err = build(&inventory_of("t4-4"), &many).unwrap_err();
        assert_eq!(
            err.to_string(),
            "sharing.mps.resources[0].replicas: 49 replicas of GPU 0 (GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a40), but an MPS server serves at most 48 clients per GPU"
        );
    }

    /// Time-slicing may give one resource's GPUs different replica counts;
    /// MPS may not (one daemon, one thread share): it says to rename.
    #[test]
    fn one_mps_resource_has_one_replica_count() {
        let mixed = "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, devices: [0, 1], replicas: 4}\n    - {name: nvidia.com/gpu, devices: [2, 3], replicas: 2}\n";
        let err = build(&inventory_of("t4-4"), &with_mps(mixed, MigStrategy::Single)).unwrap_err();
        assert!(
            err.to_string().starts_with(
                "MPS resource nvidia.com/gpu would divide GPU 0 into 4 replicas and GPU 2 into 2"
            ),
            "{err}"
        );
        let ts = with_sharing(&mixed.replace("mps:", "timeSlicing:"));
        assert!(build(&inventory_of("t4-4"), &ts).is_ok());
    }

    #[test]
    fn no_gpu_no_resources() {
        assert!(
            build(&inventory_of("no-gpu"), &PluginSettings::default())
                .unwrap()
                .is_empty()
        );
    }
}
