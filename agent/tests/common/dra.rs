//! What the DRA tests that drive a node's claims directly share: the node
//! spec the cdi stage would write for a node's GPUs, and a claim by name.

use gpu_dra::claim::ClaimRef;
use gpu_model::cdi::{CDI_KIND, ContainerEdits, Device, DeviceNode, SPEC_VERSION, Spec};

/// The node spec the cdi stage would write for GPUs `(minor, uuid)`: each
/// GPU's node by UUID, and the control nodes for all.
pub fn node_spec(gpus: &[(u32, String)]) -> Spec {
    let node = |p: &str| DeviceNode {
        path: p.into(),
        host_path: None,
    };
    Spec {
        cdi_version: SPEC_VERSION.into(),
        kind: CDI_KIND.into(),
        devices: gpus
            .iter()
            .map(|(minor, uuid)| Device {
                name: uuid.clone(),
                container_edits: ContainerEdits {
                    device_nodes: vec![node(&format!("/dev/nvidia{minor}"))],
                    ..Default::default()
                },
            })
            .collect(),
        container_edits: ContainerEdits {
            device_nodes: vec![node("/dev/nvidiactl"), node("/dev/nvidia-uvm")],
            ..Default::default()
        },
    }
}

/// Claim `uid` of namespace `ns`.
pub fn claim(uid: &str, name: &str) -> ClaimRef {
    ClaimRef {
        namespace: "ns".into(),
        uid: uid.into(),
        name: name.into(),
    }
}
