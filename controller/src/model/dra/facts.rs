//! What the slice builder needs to know of a node's GPUs and MIG devices
//! ([`NodeDevices`]), read from the agent's report
//! ([`NodeDevices::from_report`]): a field the report leaves unset stays `None`.

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

impl DeviceHealth {
    /// From the report's health of one GPU: the XID from its `xid` field,
    /// a lost GPU from its `lost` field, anything else unhealthy as such.
    pub fn from_report(h: &pb::GpuHealth) -> Self {
        if h.healthy {
            return DeviceHealth::Healthy;
        }
        if let Some(xid) = h.xid {
            return DeviceHealth::Xid(xid);
        }
        if h.lost {
            return DeviceHealth::Lost;
        }
        DeviceHealth::Unhealthy
    }
}

impl NodeDevices {
    /// What the report says of the node's devices. A field the report
    /// leaves unset stays `None`: a GPU without its minor (and a MIG device
    /// without its GPU-instance profile ID and placement) cannot be named
    /// and is left out by the builder (the NVML index is not the minor:
    /// `gpu-<index>` could name another GPU than the node's kubelet plugin
    /// means).
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
                    minor: g.minor,
                    uuid: g.uuid.clone(),
                    product_name: non_empty(&g.model),
                    brand: g.brand.as_deref().and_then(non_empty),
                    architecture: g.architecture.as_deref().and_then(non_empty),
                    compute_capability: g.compute_capability.as_deref().and_then(non_empty),
                    pci_bus_id: non_empty(&g.pci_bus_id),
                    pcie_root: g.pcie_root.as_deref().and_then(non_empty),
                    numa_node: g.numa_node.map(i64::from),
                    memory_bytes: (g.memory_mib > 0).then_some(g.memory_mib << 20),
                    mig_enabled: g.mig_enabled,
                    mig_devices: g.mig_devices.iter().map(MigFacts::from_report).collect(),
                    health: health(&g.uuid),
                })
                .collect(),
        }
    }
}

impl MigFacts {
    /// What the report says of one MIG device: memory in bytes from its
    /// MiB, engine counts as the report gives them.
    pub fn from_report(m: &pb::MigDevice) -> Self {
        let engines = m.engines.as_ref();
        MigFacts {
            uuid: m.uuid.clone(),
            profile: m.profile.clone(),
            gi_profile_id: m.gi_profile_id,
            placement_start: m.placement_start,
            memory_bytes: m.memory_mib.map(|mib| mib << 20),
            multiprocessors: m.multiprocessors,
            copy_engines: engines.map(|e| e.copy),
            decoders: engines.map(|e| e.decoder),
            encoders: engines.map(|e| e.encoder),
            jpeg_engines: engines.map(|e| e.jpeg),
            ofa_engines: engines.map(|e| e.ofa),
        }
    }
}

fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_string())
}
