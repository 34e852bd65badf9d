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

/// A simulated node's GPUs over a host root: its inventory, its backend
/// (shared, for compute modes) and the options claims are opened with.
pub struct SimNode {
    pub root: hostlib::HostRoot,
    pub inv: gpu_model::inventory::Inventory,
    pub backend: std::sync::Arc<dyn gpu_model::backend::GpuBackend>,
    pub opts: gpu_dra::claims::Options,
}

/// The simulated node `sim` over the host tree `host`, with boot ID `boot`
/// (a real host has one; the fixtures do not) and a 100 ms allocation wait.
pub fn sim_node(host: &std::path::Path, sim: &str, node: &str, boot: &str) -> SimNode {
    let root = hostlib::HostRoot::new(host).unwrap();
    root.write_atomic(
        "/proc/sys/kernel/random/boot_id",
        format!("{boot}\n").as_bytes(),
        0o444,
    )
    .unwrap();
    let view = gpu_agent::source::NodeView::simulated(sim).unwrap();
    let inv = gpu_agent::inventory::discover(&view.sys, view.backend.as_ref());
    let backend = std::sync::Arc::from(view.backend);
    let mut opts = gpu_dra::claims::Options::new(node);
    opts.allocation_wait = std::time::Duration::from_millis(100);
    SimNode {
        root,
        inv,
        backend,
        opts,
    }
}

impl SimNode {
    /// The node's GPUs as (minor, UUID).
    pub fn gpus(&self) -> Vec<(u32, String)> {
        self.inv
            .gpus
            .iter()
            .map(|g| (g.minor.unwrap(), g.uuid.clone().unwrap()))
            .collect()
    }

    /// Writes the node spec the cdi stage would write for `devices`.
    pub fn write_node_spec(&self, devices: &[(u32, String)]) {
        self.root
            .write_atomic(
                &self.opts.node_spec,
                serde_json::to_string(&node_spec(devices))
                    .unwrap()
                    .as_bytes(),
                0o644,
            )
            .unwrap();
    }
}
