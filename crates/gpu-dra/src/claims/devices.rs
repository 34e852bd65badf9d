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
}

/// The name of a full GPU: `gpu-<minor>`.
pub fn gpu_device_name(minor: u32) -> String {
    format!("gpu-{minor}")
}

/// A MIG profile name as NVIDIA's driver puts it in device names:
/// lowercased, dots removed, any other character outside `[a-z0-9-]` made
/// `-`, leading and trailing `-` trimmed (`1g.10gb+me` → `1g10gb-me`).
pub fn normalize_profile(profile: &str) -> String {
    let s: String = profile
        .to_lowercase()
        .chars()
        .filter(|c| *c != '.')
        .map(|c| {
            if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    s.trim_matches('-').to_string()
}

/// The name of a MIG device:
/// `gpu-<parentMinor>-mig-<profile>-<giProfileID>-<placementStart>`.
pub fn mig_device_name(
    parent_minor: u32,
    profile: &str,
    gi_profile_id: u32,
    placement_start: u32,
) -> String {
    format!(
        "gpu-{parent_minor}-mig-{}-{gi_profile_id}-{placement_start}",
        normalize_profile(profile)
    )
}

/// The DRA devices of `inv`, by name. A GPU with MIG enabled is published
/// only as its MIG devices (NVIDIA #719), and a MIG device only when every
/// part of its name is known: the inventory does not carry a MIG device's
/// GPU-instance profile ID and placement start yet, so none is named. A GPU
/// without a device minor or UUID has no name and no CDI device.
pub fn device_table(inv: &Inventory) -> BTreeMap<String, NodeDevice> {
    let mut out = BTreeMap::new();
    for g in &inv.gpus {
        let (Some(minor), Some(uuid)) = (g.minor, g.uuid.as_ref()) else {
            continue;
        };
        if g.mig.is_some_and(|m| m.current) {
            continue;
        }
        out.insert(
            gpu_device_name(minor),
            NodeDevice {
                minor,
                uuid: uuid.clone(),
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
    fn profiles_normalised_as_nvidia_does() {
        assert_eq!(normalize_profile("1g.10gb"), "1g10gb");
        assert_eq!(normalize_profile("1g.10gb+me"), "1g10gb-me");
        assert_eq!(normalize_profile("1c.2g.20gb"), "1c2g20gb");
        assert_eq!(normalize_profile("+7G.80GB+"), "7g80gb");
        assert_eq!(
            mig_device_name(0, "1g.10gb", 19, 6),
            "gpu-0-mig-1g10gb-19-6"
        );
        assert_eq!(
            mig_device_name(3, "1g.10gb+me", 20, 0),
            "gpu-3-mig-1g10gb-me-20-0"
        );
    }

    #[test]
    fn full_gpus_by_minor_mig_enabled_and_unnamed_gpus_left_out() {
        let mut mig_on = gpu(2, "GPU-c");
        mig_on.mig = Some(gpu_model::backend::MigMode {
            current: true,
            pending: true,
        });
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
        assert_eq!(t.keys().collect::<Vec<_>>(), ["gpu-0", "gpu-1", "gpu-5"]);
        assert_eq!(
            t["gpu-1"],
            NodeDevice {
                minor: 1,
                uuid: "GPU-b".into(),
            }
        );
    }
}
