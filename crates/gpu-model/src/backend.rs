//! What a GPU backend is and what it reports: per-GPU facts (name, UUID,
//! memory, MIG, NVLinks), readings and health events, and the
//! [`GpuBackend`] trait every backend implements.
//!
//! The backends themselves (NVML through `nvml-wrapper`, and the simulated
//! one that reads a node description file) live in gpu-backend. Every
//! backend fills the same [`BackendSnapshot`]; the inventory joins it with
//! what sysfs shows.

use crate::fields::{Field, FieldSet};

use hostlib::PciAddress;
use serde::{Deserialize, Serialize};

/// A CUDA compute capability, `9.0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ComputeCapability {
    pub major: u32,
    pub minor: u32,
}

impl std::fmt::Display for ComputeCapability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The CUDA version the driver supports, `12.4`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaVersion {
    pub major: u32,
    pub minor: u32,
}

impl CudaVersion {
    /// From NVML's integer form (12040 is 12.4).
    pub fn from_nvml(v: i32) -> Option<Self> {
        (v > 0).then_some(CudaVersion {
            major: (v / 1000) as u32,
            minor: ((v % 1000) / 10) as u32,
        })
    }
}

impl std::fmt::Display for CudaVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// A GPU's compute mode (NVML's `nvmlComputeMode_t`): how many CUDA
/// contexts it takes. MPS wants `ExclusiveProcess` (one process, the MPS
/// server, holds the GPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ComputeMode {
    Default,
    ExclusiveThread,
    Prohibited,
    ExclusiveProcess,
}

impl ComputeMode {
    /// NVML's and nvidia-smi's name: `DEFAULT`, `EXCLUSIVE_PROCESS`, ...
    pub fn as_str(self) -> &'static str {
        match self {
            ComputeMode::Default => "DEFAULT",
            ComputeMode::ExclusiveThread => "EXCLUSIVE_THREAD",
            ComputeMode::Prohibited => "PROHIBITED",
            ComputeMode::ExclusiveProcess => "EXCLUSIVE_PROCESS",
        }
    }
}

impl std::fmt::Display for ComputeMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// MIG mode of a MIG-capable GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigMode {
    pub current: bool,
    pub pending: bool,
}

/// One MIG device (a GPU instance with one compute instance).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigDevice {
    /// The slot NVML lists it in on its parent (`<gpu>:<index>` in index naming).
    pub index: u32,
    /// `MIG-<uuid>`.
    pub uuid: String,
    /// NVIDIA's profile name, e.g. `1g.10gb` (or `1c.2g.20gb` when the
    /// compute instance is smaller than its GPU instance).
    pub profile: String,
    pub gi_slices: u32,
    pub ci_slices: u32,
    pub memory_mib: u64,
    pub multiprocessors: u32,
    /// The GPU instance and compute instance IDs: they name the
    /// `/dev/nvidia-caps` nodes a container needs (`None`: NVML did not say).
    pub gpu_instance_id: Option<u32>,
    pub compute_instance_id: Option<u32>,
    /// Its GPU instance's profile ID, as `nvmlGpuInstanceGetInfo`'s
    /// `profileId` reports it: `nvmlGpuInstanceProfileInfo_t.id`, the ID
    /// `nvidia-smi mig -lgip` lists (19 for an H100's `1g.10gb`), not the
    /// `NVML_GPU_INSTANCE_PROFILE_*` index the profile is asked for by.
    /// With the placement start it names the device in DRA
    /// (`gpu-<minor>-mig-<profile>-<giProfileID>-<placementStart>`).
    /// `None`: the backend could not say.
    #[serde(default)]
    pub gi_profile_id: Option<u32>,
    /// The first memory slice its GPU instance is placed at
    /// (`nvmlGpuInstanceGetInfo`'s `placement.start`); `None`: the backend
    /// could not say.
    #[serde(default)]
    pub placement_start: Option<u32>,
    /// Engines the device shares (NVML's MIG device attributes).
    #[serde(default)]
    pub engines: MigEngines,
}

/// A MIG device's copy and media engines (`nvmlDeviceGetAttributes`'
/// `shared*Count`), as GPU feature discovery labels them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigEngines {
    pub copy: u32,
    pub decoder: u32,
    pub encoder: u32,
    pub jpeg: u32,
    /// Optical-flow accelerators.
    pub ofa: u32,
}

/// NVIDIA's MIG profile name from NVML's attributes: `<G>g.<M>gb`, or
/// `<C>c.<G>g.<M>gb` when the compute instance has fewer slices. `M` is the
/// device's share of the GPU's memory rounded up to eighths, times the GPU's
/// memory in whole GB (rounded up), then rounded: 9856 of 81559 MiB → 10gb.
pub fn mig_profile_name(
    gi_slices: u32,
    ci_slices: u32,
    memory_mib: u64,
    gpu_memory_mib: u64,
) -> String {
    let share = if gpu_memory_mib == 0 {
        0.0
    } else {
        (memory_mib as f64 / gpu_memory_mib as f64 * 8.0).ceil() / 8.0
    };
    let gpu_gb = gpu_memory_mib.div_ceil(1024) as f64;
    let gb = (share * gpu_gb).round() as u64;
    if ci_slices < gi_slices {
        format!("{ci_slices}c.{gi_slices}g.{gb}gb")
    } else {
        format!("{gi_slices}g.{gb}gb")
    }
}

/// DCGM's name for NVML's brand (`nvmlBrandType_t`), as DCGM's
/// `DCGM_FI_DEV_BRAND` gives it (its cache manager's table, taken from
/// nvidia-smi).
pub fn dcgm_brand(code: u32) -> &'static str {
    match code {
        1 => "Quadro",
        2 => "Tesla",
        3 => "NVS",
        4 => "Grid",
        5 => "GeForce",
        6 => "Titan",
        7 => "NVIDIA Virtual Applications",
        8 => "NVIDIA Virtual PC",
        9 => "NVIDIA Virtual Compute Server",
        10 => "NVIDIA RTX Virtual Workstation",
        11 => "NVIDIA vGaming",
        12 => "Quadro RTX",
        13 => "NVIDIA RTX",
        14 => "NVIDIA",
        15 => "GeForce RTX",
        16 => "Titan RTX",
        _ => "Unknown",
    }
}

/// How two GPUs reach each other over PCIe (NVML's common-ancestor levels),
/// nearest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PcieLevel {
    /// Same board (e.g. a dual-GPU card).
    SameBoard,
    /// Behind one PCIe switch.
    SingleSwitch,
    /// Behind several PCIe switches, without the host bridge.
    MultiSwitch,
    /// Through one host bridge.
    HostBridge,
    /// Through the CPU, same NUMA node.
    SameNuma,
    /// Across CPU sockets.
    CrossNuma,
}

impl PcieLevel {
    /// From `nvmlGpuTopologyLevel_t`.
    pub fn from_nvml(level: u32) -> Option<Self> {
        Some(match level {
            0 => PcieLevel::SameBoard,
            10 => PcieLevel::SingleSwitch,
            20 => PcieLevel::MultiSwitch,
            30 => PcieLevel::HostBridge,
            40 => PcieLevel::SameNuma,
            50 => PcieLevel::CrossNuma,
            _ => return None,
        })
    }

    /// nvidia-smi's short name (`topo -m`): PIX, PXB, PHB, NODE, SYS.
    pub fn short(&self) -> &'static str {
        match self {
            PcieLevel::SameBoard => "BRD",
            PcieLevel::SingleSwitch => "PIX",
            PcieLevel::MultiSwitch => "PXB",
            PcieLevel::HostBridge => "PHB",
            PcieLevel::SameNuma => "NODE",
            PcieLevel::CrossNuma => "SYS",
        }
    }
}

/// Readings; `None` where the GPU does not support one.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Telemetry {
    pub temperature_c: Option<u32>,
    pub power_mw: Option<u32>,
    pub utilization_gpu_pct: Option<u32>,
    pub utilization_memory_pct: Option<u32>,
    pub memory_used_mib: Option<u64>,
    /// NVML's slowdown threshold (the GPU throttles at it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slowdown_temperature_c: Option<u32>,
    /// Retired pages wait for a GPU reset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retired_pages_pending: Option<bool>,
    /// Remapped rows wait for a GPU reset (Ampere and newer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remapped_rows_pending: Option<bool>,
}

/// One GPU as the backend sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendGpu {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub bus_id: PciAddress,
    pub memory_total_mib: Option<u64>,
    pub compute_capability: Option<ComputeCapability>,
    /// `None`: not MIG-capable.
    pub mig: Option<MigMode>,
    /// The far end of each active NVLink, by link number.
    pub nvlink_remotes: Vec<PciAddress>,
    pub telemetry: Telemetry,
    /// MIG devices, while MIG is enabled.
    pub mig_devices: Vec<MigDevice>,
    /// Its registration with an NVLink fabric spanning nodes; `None`: the
    /// GPU has none (NVML: not supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fabric: Option<GpuFabric>,
    /// NVML's brand as NVIDIA's DRA driver spells it (`Nvidia`, `Tesla`:
    /// [`crate::nvlib::brand_name`]); `None`: NVML could not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub brand: Option<String>,
    /// NVML's architecture as NVIDIA's DRA driver spells it (`Hopper`,
    /// `Ada Lovelace`: [`crate::nvlib::architecture_name`]); `None`: NVML
    /// could not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<String>,
    /// Facts the backend could not read about this GPU, in words (a call
    /// that failed, a reply it could not parse): discovery's warnings, said
    /// once while they hold, never a log line per reconcile.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

/// A GPU's registration with an NVLink fabric that spans nodes (GB200
/// NVL72 and the like), as `nvmlDeviceGetGpuFabricInfoV` reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuFabric {
    /// The NVLink domain's cluster UUID, `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`
    /// (lower case).
    pub cluster_uuid: String,
    /// The clique: the GPUs of the domain that reach each other.
    pub clique_id: u32,
    pub state: FabricState,
    /// The registration's outcome, an NVML return code (0: success).
    pub status: u32,
}

/// Where a GPU's fabric registration stands (`nvmlGpuFabricState_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FabricState {
    NotStarted,
    InProgress,
    Completed,
}

impl GpuFabric {
    /// From NVML's fields; `None` for `NVML_GPU_FABRIC_STATE_NOT_SUPPORTED`
    /// (or a state NVML does not define).
    pub fn from_nvml(
        cluster_uuid: [u8; 16],
        status: u32,
        clique_id: u32,
        state: u8,
    ) -> Option<Self> {
        let state = match state {
            1 => FabricState::NotStarted,
            2 => FabricState::InProgress,
            3 => FabricState::Completed,
            _ => return None,
        };
        let hex: String = cluster_uuid.iter().map(|b| format!("{b:02x}")).collect();
        Some(GpuFabric {
            cluster_uuid: format!(
                "{}-{}-{}-{}-{}",
                &hex[0..8],
                &hex[8..12],
                &hex[12..16],
                &hex[16..20],
                &hex[20..32]
            ),
            clique_id,
            state,
            status,
        })
    }

    /// `<cluster UUID>.<clique ID>` when the GPU is attached to the fabric:
    /// its registration completed with success and named a cluster (GPU
    /// feature discovery's rule, `IsFabricAttached`).
    pub fn clique(&self) -> Option<String> {
        let attached = self.state == FabricState::Completed
            && self.status == 0
            && self.cluster_uuid.chars().any(|c| c != '0' && c != '-');
        attached.then(|| format!("{}.{}", self.cluster_uuid, self.clique_id))
    }
}

/// Everything a backend reports at once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendSnapshot {
    pub driver_version: Option<String>,
    pub cuda_version: Option<CudaVersion>,
    pub gpus: Vec<BackendGpu>,
    /// PCIe level between GPU indices `a < b`.
    pub pcie: Vec<(u32, u32, PcieLevel)>,
    /// NVML indices of GPUs NVML has lost (`NVML_ERROR_GPU_IS_LOST`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lost: Vec<u32>,
}

/// The NVML error under a [`BackendError`] (an `nvml_wrapper` `NvmlError`,
/// boxed so that the model does not depend on NVML; `downcast_ref` gets it
/// back).
pub type NvmlSource = Box<dyn std::error::Error + Send + Sync>;

/// A backend that could not answer.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("cannot load the NVML library ({message})")]
    Library { lib: String, message: String },
    #[error("the NVIDIA driver is not loaded (NVML: {0})")]
    DriverNotLoaded(String),
    #[error("NVML: {call}: {source}")]
    Nvml {
        call: &'static str,
        #[source]
        source: NvmlSource,
    },
    /// The backend could not be opened; the reason is kept as text.
    #[error("{0}")]
    Unavailable(String),
    #[error("GPU {index}: NVML {call}: {source}")]
    Device {
        index: u32,
        call: &'static str,
        #[source]
        source: NvmlSource,
    },
    #[error("GPU {uuid}: NVML {call}: {source}")]
    Gpu {
        uuid: String,
        call: &'static str,
        #[source]
        source: NvmlSource,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mig_profile_names_as_nvidia_writes_them() {
        // H100 80GB (81559 MiB) and A100 40GB (40536 MiB) profiles.
        assert_eq!(mig_profile_name(1, 1, 9856, 81559), "1g.10gb");
        assert_eq!(mig_profile_name(2, 2, 19968, 81559), "2g.20gb");
        assert_eq!(mig_profile_name(3, 3, 40192, 81559), "3g.40gb");
        assert_eq!(mig_profile_name(7, 7, 80768, 81559), "7g.80gb");
        assert_eq!(mig_profile_name(1, 1, 4864, 40536), "1g.5gb");
        assert_eq!(mig_profile_name(3, 3, 20096, 40536), "3g.20gb");
        assert_eq!(mig_profile_name(2, 1, 19968, 81559), "1c.2g.20gb");
    }
}

/// A GPU health event, as a backend reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HealthEvent {
    /// An XID error (999: NVML could not tell which).
    Xid { uuid: String, xid: u64 },
    /// A double-bit (uncorrectable) ECC error.
    DoubleBitEcc { uuid: String },
    /// An `NVRM: Xid` line in the kernel log, for the GPU at that bus id.
    KernelXid {
        uuid: String,
        xid: u64,
        message: String,
    },
    /// Waiting for events failed: no GPU's health is known until the backend
    /// answers again.
    WaitFailed(String),
    /// The backend answers again after [`HealthEvent::WaitFailed`].
    Answering,
}

/// Where health events go; the watcher stops when the receiver is dropped.
pub type HealthSender = tokio::sync::mpsc::UnboundedSender<HealthEvent>;

/// One sampling pass: every GPU's readings of the fields asked for.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sample {
    pub gpus: Vec<GpuSample>,
}

/// One GPU's readings, in the units its DCGM field is exported in.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuSample {
    pub index: u32,
    pub uuid: String,
    pub values: Vec<(Field, f64)>,
    /// Label fields (VBIOS, serial, brand, InfoROM and NVML versions) with
    /// their values: labels on every series of the GPU and its MIG devices.
    pub labels: Vec<(Field, String)>,
    /// MIG devices' own readings (framebuffer, GPM per GPU instance).
    pub mig: Vec<MigSample>,
}

/// One MIG device's readings.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MigSample {
    pub uuid: String,
    pub gpu_instance_id: Option<u32>,
    pub profile: String,
    pub values: Vec<(Field, f64)>,
}

/// Takes samples; keeps what a reading needs between passes (GPM samples).
pub trait Sampler: Send {
    fn sample(&mut self, fields: &FieldSet) -> Result<Sample, BackendError>;
}

/// The sampler of a node without a GPU: every sample is empty, so the
/// exporter serves gpu-agent's own series only.
#[derive(Debug, Default)]
pub struct NoGpuSampler;

impl Sampler for NoGpuSampler {
    fn sample(&mut self, _fields: &FieldSet) -> Result<Sample, BackendError> {
        Ok(Sample::default())
    }
}

/// A source of per-GPU facts.
pub trait GpuBackend: std::fmt::Debug + Send + Sync {
    /// A sampler of the readings the metrics exporter serves.
    fn sampler(&self) -> Result<Box<dyn Sampler>, BackendError> {
        Err(BackendError::Unavailable(format!(
            "the {} backend takes no samples",
            self.name()
        )))
    }
    /// MIG reconfiguration (NVML only).
    fn mig_control(&self) -> Option<&dyn crate::mig::MigControl> {
        None
    }
    /// `nvml` or `simulated`.
    fn name(&self) -> &'static str;
    /// Reads every GPU now.
    fn snapshot(&self) -> Result<BackendSnapshot, BackendError>;
    /// Starts sending health events (XID, double-bit ECC) to `events` from a
    /// background thread, until `events` is closed.
    fn watch_health(&self, events: HealthSender) -> Result<(), BackendError> {
        drop(events);
        Err(BackendError::Unavailable(format!(
            "the {} backend reports no health events",
            self.name()
        )))
    }
    /// Sets the compute mode of the GPU with this UUID (MPS sharing).
    fn set_compute_mode(&self, uuid: &str, mode: ComputeMode) -> Result<(), BackendError> {
        let _ = (uuid, mode);
        Err(BackendError::Unavailable(format!(
            "the {} backend cannot set compute modes",
            self.name()
        )))
    }
    /// The compute mode of the GPU with this UUID.
    fn compute_mode(&self, uuid: &str) -> Result<ComputeMode, BackendError> {
        let _ = uuid;
        Err(BackendError::Unavailable(format!(
            "the {} backend does not report compute modes",
            self.name()
        )))
    }
}
