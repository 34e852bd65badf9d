//! What a node description says (the YAML's types: node, driver, GPUs, MIG
//! devices, links, telemetry) and why one cannot be used: plain data, below
//! the MIG tables, the readings and the tree a description becomes.

use std::io;
use std::path::PathBuf;

use hostlib::strict::YamlError;
use hostlib::{DriverFlavour, PciAddress};
use serde::{Deserialize, Serialize};

/// Most NVLinks one GPU has (`NVML_NVLINK_MAX_LINKS`).
pub const MAX_NVLINKS: u32 = 18;

/// NVML's `nvmlGpuTopologyLevel_t` values, as the fake library returns them.
pub mod topology_level {
    pub const INTERNAL: u32 = 0;
    pub const SINGLE: u32 = 10;
    pub const MULTIPLE: u32 = 20;
    pub const HOSTBRIDGE: u32 = 30;
    pub const NODE: u32 = 40;
    pub const SYSTEM: u32 = 50;
}

/// Built-in descriptions, by name.
pub const BUILTIN: &[(&str, &str)] = &[
    ("h100-sxm-8", include_str!("../nodes/h100-sxm-8.yaml")),
    ("a10g-1", include_str!("../nodes/a10g-1.yaml")),
    ("t4-4", include_str!("../nodes/t4-4.yaml")),
    ("no-gpu", include_str!("../nodes/no-gpu.yaml")),
    ("h100-mig-2", include_str!("../nodes/h100-mig-2.yaml")),
    (
        "a100-h100-mixed",
        include_str!("../nodes/a100-h100-mixed.yaml"),
    ),
];

/// The slowdown temperature every simulated GPU reports (the simulated
/// backend and the fake libnvidia-ml alike), in °C.
pub const SLOWDOWN_TEMPERATURE_C: u32 = 90;

/// A whole node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NodeDescription {
    /// A short name shown to people (`8x H100 SXM`).
    pub name: String,
    /// DMI product name (`/sys/class/dmi/id/product_name`).
    #[serde(default)]
    pub machine: Option<String>,
    /// The loaded driver; absent means no NVIDIA driver is loaded.
    #[serde(default)]
    pub driver: Option<DriverDesc>,
    /// NVSwitch PCI functions that GPUs' NVLinks may lead to.
    #[serde(default)]
    pub nvswitches: Vec<PciAddress>,
    /// The GPUs, in NVML index order.
    #[serde(default)]
    pub gpus: Vec<GpuDesc>,
}

/// The loaded driver.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DriverDesc {
    /// `550.54.15`
    pub version: String,
    /// CUDA version the driver supports, `12.4`.
    pub cuda_version: String,
    #[serde(default = "default_flavour")]
    pub flavour: DriverFlavour,
    /// Loaded modules (default: nvidia, nvidia_uvm, nvidia_modeset).
    #[serde(default = "default_modules")]
    pub modules: Vec<String>,
}

fn default_flavour() -> DriverFlavour {
    DriverFlavour::Open
}

fn default_modules() -> Vec<String> {
    ["nvidia", "nvidia_uvm", "nvidia_modeset"]
        .into_iter()
        .map(String::from)
        .collect()
}

/// One GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GpuDesc {
    pub bus_id: PciAddress,
    /// The NVML name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    pub uuid: String,
    /// PCI device id, e.g. `0x2330`.
    pub device_id: HexU16,
    #[serde(default)]
    pub subsystem_id: Option<HexU16>,
    /// PCI class: `0x0302` (3D controller, the default) or `0x0300` (VGA).
    #[serde(default = "default_class")]
    pub pci_class: HexU16,
    pub memory_mib: u64,
    /// Framebuffer memory in use (default 0).
    #[serde(default)]
    pub memory_used_mib: u64,
    /// `9.0`
    pub compute_capability: String,
    #[serde(default)]
    pub mig: MigDesc,
    #[serde(default)]
    pub numa_node: Option<u32>,
    #[serde(default)]
    pub iommu_group: Option<u32>,
    #[serde(default)]
    pub pcie: PcieDesc,
    #[serde(default)]
    pub nvlinks: Vec<NvLinkDesc>,
    /// Readings NVML gives; a reading left out is "not supported".
    #[serde(default)]
    pub telemetry: TelemetryDesc,
    /// An NVIDIA vGPU in a guest VM: its PCI configuration space carries
    /// NVIDIA's vGPU capability naming the host's vGPU manager. Absent: a
    /// physical GPU (bare metal or passed through).
    #[serde(default)]
    pub vgpu: Option<VgpuDesc>,
    /// The GPU's place in an NVLink fabric spanning nodes (GB200 NVL72 and
    /// the like), as `nvmlDeviceGetGpuFabricInfoV` reports it. Absent: the
    /// GPU has no fabric (PCIe and HGX GPUs; NVML: not supported).
    #[serde(default)]
    pub fabric: Option<FabricDesc>,
}

/// The host side of a vGPU, as its capability names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct VgpuDesc {
    /// The host's vGPU manager driver version, at most 10 bytes
    /// (`550.54.16`).
    pub host_driver_version: String,
    /// Its branch, at most 10 bytes (`r550_00`).
    pub host_driver_branch: String,
}

/// A GPU's fabric registration (`nvmlGpuFabricInfo_v3_t`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct FabricDesc {
    /// The NVLink domain's cluster UUID (`xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`).
    pub cluster_uuid: String,
    /// The clique (the GPUs that reach each other over the fabric) ID.
    pub clique_id: u32,
    /// Where the GPU's registration with the fabric manager stands
    /// (default: completed).
    #[serde(default)]
    pub state: FabricState,
    /// The registration's outcome, an `nvmlReturn_t` (default 0, success;
    /// e.g. 999 unknown error).
    #[serde(default)]
    pub status: u32,
}

/// `nvmlGpuFabricState_t`, without `NOT_SUPPORTED` (no `fabric` says that).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum FabricState {
    NotStarted,
    InProgress,
    #[default]
    Completed,
}

impl FabricState {
    /// NVML's value (`NVML_GPU_FABRIC_STATE_*`).
    pub fn nvml(self) -> u8 {
        match self {
            FabricState::NotStarted => 1,
            FabricState::InProgress => 2,
            FabricState::Completed => 3,
        }
    }
}

impl FabricDesc {
    /// The cluster UUID's 16 bytes, in the order it is written.
    pub fn cluster_uuid_bytes(&self) -> Option<[u8; 16]> {
        let groups: Vec<&str> = self.cluster_uuid.split('-').collect();
        let lens: Vec<usize> = groups.iter().map(|g| g.len()).collect();
        if lens != [8, 4, 4, 4, 12] {
            return None;
        }
        let hex: String = groups.concat();
        let mut out = [0u8; 16];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(out)
    }
}

fn default_class() -> HexU16 {
    HexU16(0x0302)
}

/// A 16-bit number written in hex (`0x2330`) or decimal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HexU16(pub u16);

impl Serialize for HexU16 {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&format_args!("{:#06x}", self.0))
    }
}

impl<'de> Deserialize<'de> for HexU16 {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Num(u16),
            Str(String),
        }
        match Raw::deserialize(d)? {
            Raw::Num(n) => Ok(HexU16(n)),
            Raw::Str(s) => {
                let t = s.trim();
                let parsed = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
                    Some(h) => u16::from_str_radix(h, 16),
                    None => t.parse(),
                };
                parsed
                    .map(HexU16)
                    .map_err(|_| serde::de::Error::custom(format!("{s:?} is not a 16-bit number")))
            }
        }
    }
}

/// MIG support.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MigDesc {
    #[serde(default)]
    pub capable: bool,
    #[serde(default)]
    pub enabled: bool,
    /// The MIG devices (GPU instance + compute instance) while enabled.
    #[serde(default)]
    pub devices: Vec<MigDeviceDesc>,
}

/// One MIG device, as NVML describes it (`nvmlDeviceGetAttributes`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MigDeviceDesc {
    /// `MIG-<uuid>`.
    pub uuid: String,
    /// The profile name NVIDIA derives from the numbers below (`1g.10gb`);
    /// informational, checked by tests against gpu-agent's own derivation.
    #[serde(default)]
    pub profile: Option<String>,
    pub gi_slices: u32,
    /// Compute-instance slices (default: the GPU instance's).
    #[serde(default)]
    pub ci_slices: Option<u32>,
    pub memory_mib: u64,
    #[serde(default)]
    pub multiprocessors: u32,
    /// The GPU instance's ID (`nvmlDeviceGetGpuInstanceId`; default: the
    /// device's position in the list).
    #[serde(default)]
    pub gi_id: Option<u32>,
    /// The compute instance's ID within its GPU instance (default 0).
    #[serde(default)]
    pub ci_id: Option<u32>,
    /// Media and copy engines the device shares (`nvmlDeviceGetAttributes`'
    /// `shared*Count`); each left out defaults to an H100's for the GPU
    /// instance's size ([`MigEngines::h100`]).
    #[serde(default)]
    pub engines: MigEnginesDesc,
}

/// A MIG device's engines as a description gives them; `None`: the default.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MigEnginesDesc {
    #[serde(default)]
    pub copy: Option<u32>,
    #[serde(default)]
    pub decoder: Option<u32>,
    #[serde(default)]
    pub encoder: Option<u32>,
    #[serde(default)]
    pub jpeg: Option<u32>,
    #[serde(default)]
    pub ofa: Option<u32>,
}

/// A MIG device's shared engines, as NVML counts them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigEngines {
    pub copy: u32,
    pub decoder: u32,
    pub encoder: u32,
    pub jpeg: u32,
    pub ofa: u32,
}

impl MigDeviceDesc {
    pub fn ci_slices(&self) -> u32 {
        self.ci_slices.unwrap_or(self.gi_slices)
    }

    /// The GPU instance ID of the device at `position` in its GPU's list.
    pub fn gi_id(&self, position: usize) -> u32 {
        self.gi_id.unwrap_or(position as u32)
    }

    pub fn ci_id(&self) -> u32 {
        self.ci_id.unwrap_or(0)
    }
}

/// The `/dev/nvidia-caps` minor NVIDIA's driver gives a GPU instance's
/// access capability (`gpu<G>/gi<I>/access` in
/// `/proc/driver/nvidia-caps/mig-minors`), with `ci`: the compute
/// instance's. The driver numbers them densely: `config` 1, `monitor` 2,
/// then per GPU minor 15 GPU instances of 1 + 8 entries each.
pub fn mig_cap_minor(gpu_minor: u32, gi: u32, ci: Option<u32>) -> u32 {
    3 + gpu_minor * 15 * 9 + gi * 9 + ci.map_or(0, |c| 1 + c)
}

/// Where the GPU sits on PCIe, from the GPU upward.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PcieDesc {
    /// Two GPUs on one board (e.g. a dual-GPU card) share this name.
    #[serde(default)]
    pub board: Option<String>,
    /// PCIe switches on the way to the host bridge, nearest first.
    #[serde(default)]
    pub switches: Vec<String>,
    #[serde(default)]
    pub host_bridge: Option<String>,
}

/// `links` NVLinks from this GPU to the GPU or NVSwitch at `remote`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NvLinkDesc {
    pub remote: PciAddress,
    pub links: u32,
}

/// Readings.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TelemetryDesc {
    #[serde(default)]
    pub temperature_c: Option<u32>,
    #[serde(default)]
    pub power_mw: Option<u32>,
    #[serde(default)]
    pub utilization_gpu: Option<u32>,
    #[serde(default)]
    pub utilization_memory: Option<u32>,
    /// Encoder and decoder utilisation, % (default 0).
    #[serde(default)]
    pub utilization_encoder: Option<u32>,
    #[serde(default)]
    pub utilization_decoder: Option<u32>,
    /// Clocks, MHz (defaults: [`readings::DEFAULT_SM_CLOCK_MHZ`],
    /// [`readings::DEFAULT_MEM_CLOCK_MHZ`]).
    #[serde(default)]
    pub sm_clock_mhz: Option<u32>,
    #[serde(default)]
    pub mem_clock_mhz: Option<u32>,
}

/// A description that cannot be used, naming the file and the field.
#[derive(Debug, thiserror::Error)]
pub enum DescError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Invalid(#[from] YamlError),
    #[error(
        "{0:?} is neither a file nor a built-in node description (built-in: h100-sxm-8, a10g-1, t4-4, no-gpu, h100-mig-2, a100-h100-mixed)"
    )]
    Unknown(String),
}

impl GpuDesc {
    /// `(major, minor)` of the compute capability.
    pub fn compute_capability(&self) -> Option<(u32, u32)> {
        let (a, b) = self.compute_capability.split_once('.')?;
        Some((a.parse().ok()?, b.parse().ok()?))
    }
}

impl DriverDesc {
    /// NVML's integer CUDA version: `12.4` is 12040.
    pub fn cuda_version_int(&self) -> Option<i32> {
        let (a, b) = self.cuda_version.split_once('.')?;
        Some(a.parse::<i32>().ok()? * 1000 + b.parse::<i32>().ok()? * 10)
    }
}
