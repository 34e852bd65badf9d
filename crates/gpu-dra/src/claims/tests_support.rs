//! Test fixtures: a node's host tree in a temp dir (boot ID, device nodes,
//! the cdi stage's node spec), its inventory and allocations.

use std::sync::Arc;
use std::time::Duration;

use gpu_model::backend::Telemetry;
use gpu_model::cdi::{CDI_KIND, ContainerEdits, Device, DeviceNode, Mount, SPEC_VERSION, Spec};
use gpu_model::inventory::{BackendInfo, Gpu, Inventory};
use hostlib::HostRoot;

use super::allocation::{AllocatedDevice, ClaimAllocation, MemoryAllocations};
use super::{NodeClaims, Options};
use crate::claim::ClaimRef;

pub(crate) const NODE: &str = "node-a";
pub(crate) const BOOT: &str = "0b5e6f1c-1111-4c1e-9d2a-000000000001";

pub(crate) fn gpu(minor: u32, uuid: &str) -> Gpu {
    Gpu {
        index: Some(minor),
        minor: Some(minor),
        uuid: Some(uuid.into()),
        model: Some("NVIDIA H100 80GB HBM3".into()),
        bus_id: format!("0000:{:02x}:00.0", minor + 1).parse().unwrap(),
        numa_node: None,
        pci: None,
        memory_mib: Some(81559),
        compute_capability: None,
        mig: None,
        nvlinks: 0,
        telemetry: Telemetry::default(),
        mig_devices: Vec::new(),
        vgpu: None,
        fabric: None,
        brand: None,
        architecture: None,
        pcie_root: None,
    }
}

pub(crate) fn inventory(gpus: Vec<Gpu>) -> Inventory {
    Inventory {
        machine: None,
        driver: Default::default(),
        backend: BackendInfo {
            name: "sim".into(),
            driver_version: Some("580.95.05".into()),
            error: None,
            lost: Vec::new(),
        },
        cuda_version: None,
        gpus,
        pairs: Vec::new(),
        warnings: Vec::new(),
        unreadable: Vec::new(),
    }
}

fn nodes(paths: &[&str]) -> Vec<DeviceNode> {
    paths
        .iter()
        .map(|p| DeviceNode {
            path: p.to_string(),
            host_path: None,
        })
        .collect()
}

/// The spec the cdi stage would write for GPUs 0 (`GPU-a`) and 1 (`GPU-b`).
pub(crate) fn node_spec() -> Spec {
    let mut devices = Vec::new();
    for (i, uuid) in [(0, "GPU-a"), (1, "GPU-b")] {
        let edits = ContainerEdits {
            device_nodes: nodes(&[&format!("/dev/nvidia{i}")]),
            ..ContainerEdits::default()
        };
        for name in [i.to_string(), uuid.to_string()] {
            devices.push(Device {
                name,
                container_edits: edits.clone(),
            });
        }
    }
    Spec {
        cdi_version: SPEC_VERSION.into(),
        kind: CDI_KIND.into(),
        devices,
        container_edits: ContainerEdits {
            env: vec!["NVIDIA_VISIBLE_DEVICES=void".into()],
            device_nodes: nodes(&["/dev/nvidiactl", "/dev/nvidia-uvm"]),
            mounts: vec![Mount {
                host_path: "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05".into(),
                container_path: "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05".into(),
                options: vec!["ro".into(), "nosuid".into()],
            }],
            hooks: Vec::new(),
        },
    }
}

/// A node in a temp dir.
pub(crate) struct Node {
    /// Kept for its lifetime: the host tree is removed with it.
    _dir: tempfile::TempDir,
    pub host: HostRoot,
    pub allocs: Arc<MemoryAllocations>,
    pub opts: Options,
}

impl Node {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let host = HostRoot::new(dir.path()).unwrap();
        let mut opts = Options::new(NODE);
        opts.allocation_wait = Duration::from_millis(100);
        let node = Node {
            _dir: dir,
            host,
            allocs: Arc::new(MemoryAllocations::new()),
            opts,
        };
        node.write("/proc/sys/kernel/random/boot_id", &format!("{BOOT}\n"));
        for n in [
            "/dev/nvidia0",
            "/dev/nvidia1",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
        ] {
            node.write(n, "");
        }
        node.write(
            &node.opts.node_spec.clone(),
            &serde_json::to_string_pretty(&node_spec()).unwrap(),
        );
        node
    }

    pub fn write(&self, host_path: &str, text: &str) {
        self.host
            .write_atomic(host_path, text.as_bytes(), 0o644)
            .unwrap();
    }

    pub fn read(&self, host_path: &str) -> Option<String> {
        self.host.read_optional(host_path).unwrap()
    }

    pub fn exists(&self, host_path: &str) -> bool {
        self.host.exists(host_path)
    }

    pub fn remove(&self, host_path: &str) {
        self.host.remove_file(host_path).unwrap();
    }

    pub fn open(&self) -> NodeClaims {
        let inv = inventory(vec![gpu(0, "GPU-a"), gpu(1, "GPU-b")]);
        NodeClaims::open(
            self.host.clone(),
            self.opts.clone(),
            self.allocs.clone(),
            &inv,
        )
        .unwrap()
    }

    pub fn spec_path(&self, uid: &str) -> String {
        super::cdi::spec_path(&self.opts.cdi_dir, uid)
    }

    pub fn checkpoint_path(&self) -> String {
        super::checkpoint::checkpoint_path(&self.opts.state_dir)
    }

    pub fn checkpoint(&self) -> super::Checkpoint {
        serde_json::from_str(&self.read(&self.checkpoint_path()).unwrap()).unwrap()
    }

    /// Allocates `devices` (with their share IDs) to claim `uid`.
    pub fn allocate(&self, uid: &str, devices: &[(&str, Option<&str>)]) {
        self.allocs.insert(
            uid,
            ClaimAllocation {
                namespace: "ns".into(),
                name: format!("claim-{uid}"),
                devices: devices
                    .iter()
                    .map(|(d, share)| AllocatedDevice {
                        request: "gpu".into(),
                        pool: NODE.into(),
                        device: d.to_string(),
                        share_id: share.map(str::to_string),
                    })
                    .collect(),
                configs: Vec::new(),
            },
        );
    }
}

pub(crate) fn claim(uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: "ns".into(),
        uid: uid.into(),
        name: format!("claim-{uid}"),
    }
}
