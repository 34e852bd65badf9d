//! From the inventory to the resources the device plugin advertises:
//! `nvidia.com/gpu` (whole GPUs or time-sliced replicas), renamed shared
//! resources, MIG strategies.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::config::MigStrategy;
use super::config::{
    AllocationPolicy, DeviceIdStrategy, DeviceListStrategy, ReplicatedResource, SharingSpec,
};
use crate::inventory::Inventory;

/// The plain whole-GPU resource.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

/// Effective device-plugin settings (policy, then the config file's flags).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginSettings {
    pub mig_strategy: MigStrategy,
    pub list_strategies: Vec<DeviceListStrategy>,
    pub id_strategy: DeviceIdStrategy,
    pub pass_device_specs: bool,
    pub cdi_annotation_prefix: String,
    pub allocation_policy: AllocationPolicy,
    pub time_slicing: Option<SharingSpec>,
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
    /// Devices are time-sliced replicas.
    pub shared: bool,
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
        "resource {name} would mix whole devices and time-sliced replicas ({device} is not shared); give the shared devices a `rename` or select them all"
    )]
    MixedSharing { name: String, device: String },
    #[error("mig.strategy single: {0}")]
    MigSingle(String),
    #[error(
        "passDeviceSpecs is not supported for MIG devices yet (they also need /dev/nvidia-caps nodes gpu-agent cannot name yet); use the envvar or CDI device-list strategies, or mig.strategy none"
    )]
    PassDeviceSpecsMig,
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
}

/// `nvidia.com/mig-<profile>`, with `+` (e.g. `+me`) written as `.`.
pub fn mig_resource_name(profile: &str) -> String {
    format!("nvidia.com/mig-{}", profile.replace('+', "."))
}

/// Every device the MIG strategy advertises, by resource.
fn base_devices(inv: &Inventory, strategy: MigStrategy) -> Result<Vec<Base>, ResourceError> {
    let gpus: Vec<&crate::inventory::Gpu> = inv
        .gpus
        .iter()
        .filter(|g| g.uuid.is_some() && g.index.is_some())
        .collect();
    let mig_on = |g: &crate::inventory::Gpu| g.mig.is_some_and(|m| m.current);
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
            });
            continue;
        }
        for m in &g.mig_devices {
            let resource = match strategy {
                MigStrategy::Single => GPU_RESOURCE.to_string(),
                _ if m.ci_slices != m.gi_slices => {
                    tracing::warn!(stage = "plugin", gpu = %uuid, mig = %m.uuid, profile = %m.profile, "MIG device with a partial compute instance is not advertised (mixed strategy)");
                    continue;
                }
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

/// How the device plugin time-slices one resource.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replication {
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

/// The time-slicing of `resource` (`nvidia.com/gpu`, `nvidia.com/mig-1g.10gb`):
/// the first sharing entry naming it, as [`build`] applies it; `None` when
/// the resource is not shared.
pub fn replication(settings: &PluginSettings, resource: &str) -> Option<Replication> {
    let spec = settings.time_slicing.as_ref()?;
    let r = spec.resources.iter().find(|r| r.name == resource)?;
    Some(Replication {
        replicas: r.replicas,
        advertised_as: shared_name(spec, r),
    })
}

/// Builds every resource with at least one device, sorted by name. GPUs that
/// NVML did not describe (no UUID) cannot be allocated and are left out.
pub fn build(inv: &Inventory, settings: &PluginSettings) -> Result<Vec<Resource>, ResourceError> {
    let mut by_name: BTreeMap<String, Resource> = BTreeMap::new();
    let sharing = settings
        .time_slicing
        .as_ref()
        .filter(|s| !s.resources.is_empty());
    let bases = base_devices(inv, settings.mig_strategy)?;
    if settings.pass_device_specs && bases.iter().any(|b| b.uuid != b.gpu_uuid) {
        return Err(ResourceError::PassDeviceSpecsMig);
    }
    for b in bases {
        let mut entry = None;
        if let Some(spec) = sharing {
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
        let empty = |name: String, shared: bool, fail: bool| Resource {
            name,
            devices: Vec::new(),
            shared,
            fail_requests_greater_than_one: fail,
        };
        match (entry, sharing) {
            (Some((_, r)), Some(spec)) => {
                let name = shared_name(spec, r);
                let fail = spec.fail_requests_greater_than_one.unwrap_or(false);
                let res = by_name
                    .entry(name.clone())
                    .or_insert_with(|| empty(name, true, fail));
                for n in 0..r.replicas {
                    res.devices
                        .push(device(format!("{}::{n}", b.uuid), Some(n)));
                }
            }
            _ => {
                let res = by_name
                    .entry(b.resource.clone())
                    .or_insert_with(|| empty(b.resource.clone(), false, false));
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
    use crate::plugin::config::PluginConfig;
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
        inv.gpus[0].mig = Some(crate::backend::MigMode {
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

    #[test]
    fn no_gpu_no_resources() {
        assert!(
            build(&inventory_of("no-gpu"), &PluginSettings::default())
                .unwrap()
                .is_empty()
        );
    }
}
