//! The node's DRA devices by name, NVIDIA's convention (docs/dra-facts.md
//! §6): `gpu-<minor>` for a full GPU, `gpu-<minor>-mig-<profile>-<gi>-<start>`
//! for a MIG device; and which device of the node's CDI spec each one is.

use std::collections::BTreeMap;

use gpu_model::inventory::Inventory;

/// What a DRA device is on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeDevice {
    /// `/dev/nvidia<minor>` of the GPU (the parent's, for a MIG device).
    pub minor: u32,
    /// The GPU's (or MIG device's) UUID: its name in the node's CDI spec.
    pub uuid: String,
    /// The GPU's UUID (the parent's, for a MIG device): whose health the
    /// device has.
    pub gpu_uuid: String,
}

/// Device names, spelt where gpu-controller's ResourceSlices take them too.
pub use gpu_agent_proto::dra_names::{gpu_device_name, mig_device_name, normalize_profile};

/// The DRA devices of `inv`, by name. A GPU with MIG enabled is published
/// only as its MIG devices (NVIDIA #719), and a MIG device only when every
/// part of its name is known (NVML gave its GPU instance's profile ID and
/// placement start), as the controller's slices do. A GPU without a device
/// minor or UUID has no name and no CDI device.
pub fn device_table(inv: &Inventory) -> BTreeMap<String, NodeDevice> {
    let mut out = BTreeMap::new();
    for g in &inv.gpus {
        let (Some(minor), Some(uuid)) = (g.minor, g.uuid.as_ref()) else {
            continue;
        };
        if g.mig.is_some_and(|m| m.current) {
            for m in &g.mig_devices {
                let (Some(gi), Some(start)) = (m.gi_profile_id, m.placement_start) else {
                    continue;
                };
                out.insert(
                    mig_device_name(minor, &m.profile, gi, start),
                    NodeDevice {
                        minor,
                        uuid: m.uuid.clone(),
                        gpu_uuid: uuid.clone(),
                    },
                );
            }
            continue;
        }
        out.insert(
            gpu_device_name(minor),
            NodeDevice {
                minor,
                uuid: uuid.clone(),
                gpu_uuid: uuid.clone(),
            },
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::claims::tests_support::{gpu, inventory};

    #[test]
    fn full_gpus_by_minor_mig_enabled_and_unnamed_gpus_left_out() {
        let mut mig_on = gpu(2, "GPU-c");
        mig_on.mig = Some(gpu_model::backend::MigMode {
            current: true,
            pending: true,
        });
        let mig = |uuid: &str, placed: Option<(u32, u32)>| gpu_model::backend::MigDevice {
            index: 0,
            uuid: uuid.into(),
            profile: "1g.10gb".into(),
            gi_slices: 1,
            ci_slices: 1,
            memory_mib: 9856,
            multiprocessors: 16,
            gpu_instance_id: Some(13),
            compute_instance_id: Some(0),
            engines: Default::default(),
            gi_profile_id: placed.map(|p| p.0),
            placement_start: placed.map(|p| p.1),
        };
        mig_on.mig_devices = vec![
            mig("MIG-placed", Some((19, 6))),
            // NVML did not say where it is: not named, as the slices leave it out.
            mig("MIG-unplaced", None),
        ];
        let mut mig_capable = gpu(5, "GPU-d");
        mig_capable.mig = Some(gpu_model::backend::MigMode {
            current: false,
            pending: false,
        });
        let mut no_minor = gpu(9, "GPU-e");
        no_minor.minor = None;
        let inv = inventory(vec![
            gpu(0, "GPU-a"),
            gpu(1, "GPU-b"),
            mig_on,
            mig_capable,
            no_minor,
        ]);
        let t = device_table(&inv);
        assert_eq!(
            t.keys().collect::<Vec<_>>(),
            ["gpu-0", "gpu-1", "gpu-2-mig-1g10gb-19-6", "gpu-5"]
        );
        assert_eq!(
            t["gpu-2-mig-1g10gb-19-6"],
            NodeDevice {
                minor: 2,
                uuid: "MIG-placed".into(),
                gpu_uuid: "GPU-c".into(),
            }
        );
        assert_eq!(
            t["gpu-1"],
            NodeDevice {
                minor: 1,
                uuid: "GPU-b".into(),
                gpu_uuid: "GPU-b".into(),
            }
        );
    }
}
