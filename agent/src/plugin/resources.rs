//! From the inventory to the resources the device plugin advertises:
//! `nvidia.com/gpu` (whole GPUs or time-sliced replicas), renamed shared
//! resources, MIG strategies.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::config::{AllocationPolicy, DeviceIdStrategy, DeviceListStrategy, SharingSpec};
use crate::inventory::Inventory;
use crate::policy::MigStrategy;

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
    pub uuid: String,
    /// NVML index.
    pub index: u32,
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

    /// Replicas per GPU, by NVML index.
    pub fn replicas_per_gpu(&self) -> BTreeMap<u32, u32> {
        let mut m = BTreeMap::new();
        for d in &self.devices {
            *m.entry(d.index).or_insert(0) += 1;
        }
        m
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
        "GPU {index} ({uuid}) is selected by sharing entries {first} and {second}; each GPU may be shared by one entry"
    )]
    SelectedTwice {
        index: u32,
        uuid: String,
        first: usize,
        second: usize,
    },
    #[error(
        "resource {name} would mix whole GPUs and time-sliced replicas (GPU {whole} is not shared); give the shared GPUs a `rename` or select every GPU"
    )]
    MixedSharing { name: String, whole: u32 },
    #[error(
        "GPU {index} ({uuid}) has MIG enabled, but MIG devices are not discovered yet; use mig.strategy none to advertise the whole GPU"
    )]
    MigNotSupported { index: u32, uuid: String },
}

/// Builds every resource with at least one device, sorted by name. GPUs that
/// NVML did not describe (no UUID) cannot be allocated and are left out.
pub fn build(inv: &Inventory, settings: &PluginSettings) -> Result<Vec<Resource>, ResourceError> {
    let mut by_name: BTreeMap<String, Resource> = BTreeMap::new();
    let sharing = settings
        .time_slicing
        .as_ref()
        .filter(|s| !s.resources.is_empty());
    for g in &inv.gpus {
        let (Some(uuid), Some(index)) = (&g.uuid, g.index) else {
            continue;
        };
        if g.mig.is_some_and(|m| m.current) && settings.mig_strategy != MigStrategy::None {
            return Err(ResourceError::MigNotSupported {
                index,
                uuid: uuid.clone(),
            });
        }
        let mut entry = None;
        if let Some(spec) = sharing {
            for (i, r) in spec.resources.iter().enumerate() {
                if r.name != GPU_RESOURCE || !r.devices.selects(index, uuid) {
                    continue;
                }
                if let Some((first, _)) = entry {
                    return Err(ResourceError::SelectedTwice {
                        index,
                        uuid: uuid.clone(),
                        first,
                        second: i,
                    });
                }
                entry = Some((i, r));
            }
        }
        let device = |id: String, replica| PluginDevice {
            id,
            uuid: uuid.clone(),
            index,
            minor: g.minor,
            replica,
            numa_node: g.numa_node,
            healthy: true,
        };
        match (entry, sharing) {
            (Some((_, r)), Some(spec)) => {
                let name = match &r.rename {
                    Some(n) if n.starts_with("nvidia.com/") => n.clone(),
                    Some(n) => format!("nvidia.com/{n}"),
                    None if spec.rename_by_default => format!("{}.shared", r.name),
                    None => r.name.clone(),
                };
                let res = by_name.entry(name.clone()).or_insert_with(|| Resource {
                    name,
                    devices: Vec::new(),
                    shared: true,
                    fail_requests_greater_than_one: spec
                        .fail_requests_greater_than_one
                        .unwrap_or(false),
                });
                for n in 0..r.replicas {
                    res.devices.push(device(format!("{uuid}::{n}"), Some(n)));
                }
            }
            _ => {
                let res = by_name
                    .entry(GPU_RESOURCE.to_string())
                    .or_insert_with(|| Resource {
                        name: GPU_RESOURCE.to_string(),
                        devices: Vec::new(),
                        shared: false,
                        fail_requests_greater_than_one: false,
                    });
                res.devices.push(device(uuid.clone(), None));
            }
        }
    }
    for res in by_name.values() {
        let has_whole = res.devices.iter().find(|d| d.replica.is_none());
        let has_replica = res.devices.iter().any(|d| d.replica.is_some());
        if let (Some(whole), true) = (has_whole, has_replica) {
            return Err(ResourceError::MixedSharing {
                name: res.name.clone(),
                whole: whole.index,
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
    use crate::plugin::test_support::inventory_of;

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
        assert_eq!(rs[1].replicas_per_gpu(), BTreeMap::from([(0, 4), (1, 4)]));
        assert_eq!(rs[2].replicas_per_gpu(), BTreeMap::from([(2, 2)]));
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
                    index: 0,
                    first: 0,
                    second: 1,
                    ..
                }
            ),
            "{err}"
        );
        let mixed = with_sharing(
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, devices: [0], replicas: 2}\n",
        );
        let err = build(&inventory_of("t4-4"), &mixed).unwrap_err();
        assert_eq!(
            err,
            ResourceError::MixedSharing {
                name: "nvidia.com/gpu".into(),
                whole: 1
            }
        );
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
