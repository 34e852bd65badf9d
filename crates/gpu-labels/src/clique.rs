//! `nvidia.com/gpu.clique`: the NVLink fabric clique the node's GPUs are
//! in, `<cluster UUID>.<clique ID>`, as GPU feature discovery's IMEX
//! labeller writes it (k8s-device-plugin `internal/lm/imex.go`, go-nvlib's
//! `IsFabricAttached`): from NVML's fabric info of each GPU
//! (`nvmlDeviceGetGpuFabricInfoV`), counting only GPUs whose registration
//! with the fabric manager completed, with success, naming a cluster. No
//! such GPU (every PCIe or HGX node): no label. GPUs that name different
//! clusters or cliques: no label (GFD logs a warning; gpu-agent's is in
//! discovery's warnings, said once).
//!
//! Where gpu-agent differs: an NVML error from the fabric query (other
//! than "not supported") fails GFD's whole relabel; gpu-agent logs it and
//! counts that GPU as not attached.

use std::collections::{BTreeMap, BTreeSet};

use gpu_model::backend::GpuFabric;
use gpu_model::inventory::Gpu;

/// Puts `nvidia.com/gpu.clique` into `out` when the attached GPUs agree.
pub(super) fn labels(gpus: &[&Gpu], out: &mut BTreeMap<String, String>) {
    let cliques: BTreeSet<String> = gpus
        .iter()
        .filter_map(|g| g.fabric.as_ref().and_then(GpuFabric::clique))
        .collect();
    if let [clique] = Vec::from_iter(cliques).as_slice() {
        out.insert("nvidia.com/gpu.clique".into(), clique.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node_labels;
    use gpu_model::backend::FabricState;
    use gpu_resources::config::DevicePluginSpec;

    const CLUSTER: &str = "5f8c2d1e-7a3b-4c9d-8e6f-0a1b2c3d4e5f";

    fn fabric(cluster: &str, clique: u32, state: FabricState, status: u32) -> Option<GpuFabric> {
        Some(GpuFabric {
            cluster_uuid: cluster.into(),
            clique_id: clique,
            state,
            status,
        })
    }

    /// The GB200-like fixture node: four fabric-attached GPUs of one clique.
    fn gb200() -> gpu_model::inventory::Inventory {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/nodes/gb200-nvl-4.yaml"
        );
        crate::test_support::inventory_of(path)
    }

    #[test]
    fn fabric_attached_gpus_name_their_clique() {
        let inv = gb200();
        assert!(inv.gpus.iter().all(|g| g.fabric.is_some()));
        let l = node_labels(&inv, &DevicePluginSpec::default(), None).unwrap();
        assert_eq!(l["nvidia.com/gpu.clique"], format!("{CLUSTER}.32766"));
        assert!(inv.warnings.is_empty(), "{:?}", inv.warnings);
    }

    #[test]
    fn gpus_without_a_fabric_have_no_clique() {
        for node in ["h100-sxm-8", "t4-4", "a10g-1"] {
            let inv = crate::test_support::inventory_of(node);
            assert!(inv.gpus.iter().all(|g| g.fabric.is_none()), "{node}");
            let l = node_labels(&inv, &DevicePluginSpec::default(), None).unwrap();
            assert!(!l.contains_key("nvidia.com/gpu.clique"), "{node}");
        }
    }

    /// GFD's rules: only GPUs whose registration completed with success and
    /// named a cluster count; GPUs that disagree give no label.
    #[test]
    fn only_completed_registrations_count_and_disagreement_gives_none() {
        let mut inv = gb200();
        let zero = "00000000-0000-0000-0000-000000000000";
        let set = |inv: &mut gpu_model::inventory::Inventory, f: [Option<GpuFabric>; 4]| {
            for (g, f) in inv.gpus.iter_mut().zip(f) {
                g.fabric = f;
            }
        };
        let clique = |inv: &gpu_model::inventory::Inventory| {
            let gpus: Vec<&Gpu> = inv.gpus.iter().collect();
            let mut l = BTreeMap::new();
            labels(&gpus, &mut l);
            l.get("nvidia.com/gpu.clique").cloned()
        };
        use FabricState::*;
        // Registration still running, failed, or nameless: not attached;
        // the one GPU that is names the clique.
        set(
            &mut inv,
            [
                fabric(CLUSTER, 7, InProgress, 0),
                fabric(CLUSTER, 7, Completed, 999),
                fabric(zero, 7, Completed, 0),
                fabric(CLUSTER, 7, Completed, 0),
            ],
        );
        assert_eq!(clique(&inv), Some(format!("{CLUSTER}.7")));
        // None attached: no label.
        set(
            &mut inv,
            [
                fabric(CLUSTER, 7, NotStarted, 0),
                None,
                fabric(zero, 7, Completed, 0),
                None,
            ],
        );
        assert_eq!(clique(&inv), None);
        // Two cliques, or two clusters: no label, and discovery says why.
        let other = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d";
        for (second_cluster, second_clique) in [(CLUSTER, 8), (other, 7)] {
            set(
                &mut inv,
                [
                    fabric(CLUSTER, 7, Completed, 0),
                    fabric(CLUSTER, 7, Completed, 0),
                    fabric(second_cluster, second_clique, Completed, 0),
                    None,
                ],
            );
            assert_eq!(clique(&inv), None);
            let w = gpu_model::inventory::clique_disagreement(&inv.gpus).unwrap();
            assert!(
                w.contains(&format!("{CLUSTER}.7")) && w.contains("no nvidia.com/gpu.clique"),
                "{w}"
            );
        }
    }
}
