//! What the slice builder needs to know of a node's GPUs and MIG devices
//! ([`NodeDevices`]), and how much of it the agent's report carries today
//! ([`NodeDevices::from_report`]): a field the report lacks stays `None`.

use gpu_agent_proto::report::v1 as pb;

/// A node's devices, as the slice builder takes them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeDevices {
    /// NVML's driver version (`580.95.05`).
    pub driver_version: Option<String>,
    /// The CUDA version the driver supports, as the report spells it
    /// (`13.0`; NVML's integer 13000 through [`super::names::cuda_version`]).
    pub cuda_driver_version: Option<String>,
    pub gpus: Vec<GpuFacts>,
}

/// One GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuFacts {
    /// `/dev/nvidia<minor>`: the device's name is `gpu-<minor>`. Without it
    /// the GPU (and its MIG devices) cannot be named and is left out.
    pub minor: Option<u32>,
    pub uuid: String,
    /// NVML's name (`NVIDIA H100 80GB HBM3`).
    pub product_name: Option<String>,
    /// go-nvlib's brand string (`Nvidia`, `Tesla`, ...).
    pub brand: Option<String>,
    /// `Hopper`, `Ampere`, ...
    pub architecture: Option<String>,
    /// `<major>.<minor>` (`9.0`).
    pub compute_capability: Option<String>,
    /// The PCI address in any spelling NVML or sysfs uses
    /// (`00000000:3B:00.0`, `0000:3b:00.0`).
    pub pci_bus_id: Option<String>,
    /// `pci<domain>:<bus>` of the root complex (`pci0000:00`).
    pub pcie_root: Option<String>,
    pub numa_node: Option<i64>,
    pub memory_bytes: Option<u64>,
    /// A GPU with MIG enabled is published only as its MIG devices.
    pub mig_enabled: bool,
    pub mig_devices: Vec<MigFacts>,
    pub health: DeviceHealth,
}

/// One MIG device (a GPU instance with its compute instance).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MigFacts {
    pub uuid: String,
    /// NVML's spelling (`1g.10gb`, `1g.10gb+me`).
    pub profile: String,
    /// The GPU-instance profile ID and the placement's start slice: both
    /// are in the device's name, so without them it is left out.
    pub gi_profile_id: Option<u32>,
    pub placement_start: Option<u32>,
    pub memory_bytes: Option<u64>,
    pub multiprocessors: Option<u32>,
    pub copy_engines: Option<u32>,
    pub decoders: Option<u32>,
    pub encoders: Option<u32>,
    pub jpeg_engines: Option<u32>,
    pub ofa_engines: Option<u32>,
}

/// Why a GPU (and its MIG devices) must not be allocated, as device taints
/// say it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DeviceHealth {
    #[default]
    Healthy,
    /// An XID made it unhealthy: `gpu.nvidia.com/xid=<code>`.
    Xid(u64),
    /// NVML lost it (fallen off the bus): `gpu.nvidia.com/gpu-lost`.
    Lost,
    /// Unhealthy for another reason (ECC, retired pages, no health
    /// monitoring): `gpu.nvidia.com/unhealthy`.
    Unhealthy,
}

/// How gpu-health words a lost GPU's reason (`Condition::Lost`).
const LOST_REASON: &str = "NVML has lost the GPU";

impl DeviceHealth {
    /// From the report's health of one GPU. The report carries the reason
    /// in words only, so the XID is read from its start (`XID 79, from
    /// NVML`, gpu-health's wording) and a lost GPU from
    /// gpu-health's sentence for it.
    pub fn from_report(h: &pb::GpuHealth) -> Self {
        if h.healthy {
            return DeviceHealth::Healthy;
        }
        if let Some(rest) = h.reason.strip_prefix("XID ") {
            let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
            if let Ok(xid) = digits.parse() {
                return DeviceHealth::Xid(xid);
            }
        }
        if h.reason.starts_with(LOST_REASON) {
            return DeviceHealth::Lost;
        }
        DeviceHealth::Unhealthy
    }
}

impl NodeDevices {
    /// What the report says of the node's devices. The report's `Gpu`
    /// carries no device minor, brand, architecture, compute capability,
    /// PCIe root or NUMA node, and its `MigDevice` only UUID and profile
    /// (no GPU-instance profile ID, placement, memory or engine counts):
    /// those stay `None`, so until the report carries the minor no GPU can
    /// be named (the NVML index is not the minor: `gpu-<index>` could name
    /// another GPU than the node's kubelet plugin means).
    pub fn from_report(r: &pb::NodeReport) -> Self {
        let Some(inv) = &r.inventory else {
            return NodeDevices::default();
        };
        let health = |uuid: &str| {
            r.health
                .iter()
                .flat_map(|h| &h.gpus)
                .find(|h| h.uuid == uuid)
                .map(DeviceHealth::from_report)
                .unwrap_or_default()
        };
        NodeDevices {
            driver_version: non_empty(&inv.driver_version),
            cuda_driver_version: non_empty(&inv.cuda_version),
            gpus: inv
                .gpus
                .iter()
                .map(|g| GpuFacts {
                    minor: None,
                    uuid: g.uuid.clone(),
                    product_name: non_empty(&g.model),
                    pci_bus_id: non_empty(&g.pci_bus_id),
                    memory_bytes: (g.memory_mib > 0).then(|| g.memory_mib * 1024 * 1024),
                    mig_enabled: g.mig_enabled,
                    mig_devices: g
                        .mig_devices
                        .iter()
                        .map(|m| MigFacts {
                            uuid: m.uuid.clone(),
                            profile: m.profile.clone(),
                            ..Default::default()
                        })
                        .collect(),
                    health: health(&g.uuid),
                    ..Default::default()
                })
                .collect(),
        }
    }
}

fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_string())
}
