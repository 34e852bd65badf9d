//! MIG as NVML sees it: the [`MigControl`] trait a backend implements (one
//! GPU, by UUID, at a time), the profiles and instances it reports, and
//! where instances can go ([`place`]). The planner and the applier (what to
//! change, and changing it) are gpu-agent's `mig`.

pub mod place;

use serde::{Deserialize, Serialize};

pub use place::Placement;

/// An NVML MIG call that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("GPU {gpu}: {call}: {message}")]
pub struct MigError {
    /// The GPU's UUID (or index).
    pub gpu: String,
    pub call: &'static str,
    pub message: String,
    pub kind: ErrorKind,
}

/// The NVML errors the applier acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// `NVML_ERROR_IN_USE`
    InUse,
    /// `NVML_ERROR_INSUFFICIENT_RESOURCES`
    Insufficient,
    /// `NVML_ERROR_NOT_SUPPORTED`
    NotSupported,
    Other,
}

/// NVML's MIG mode of one GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mode {
    pub current: bool,
    pub pending: bool,
}

/// A GPU-instance profile as NVML describes it on one GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GiProfile {
    /// NVML's profile id (`nvmlGpuInstanceProfileInfo_t.id`).
    pub id: u32,
    /// NVIDIA's name without `MIG `: `1g.10gb`, `1g.10gb+me`.
    pub name: String,
    pub slices: u32,
    /// How many such instances the GPU can hold.
    pub instances: u32,
    pub memory_mib: u64,
    pub placements: Vec<Placement>,
}

/// A compute-instance profile inside a GPU instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CiProfile {
    pub id: u32,
    pub slices: u32,
}

/// A GPU instance that exists.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInstance {
    pub id: u32,
    pub profile_id: u32,
    pub placement: (u32, u32),
    pub cis: Vec<ComputeInstance>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ComputeInstance {
    pub id: u32,
    pub profile_id: u32,
}

/// MIG through NVML, one GPU (by UUID) at a time.
pub trait MigControl: Send + Sync {
    fn mode(&self, gpu: &str) -> Result<Mode, MigError>;
    fn set_mode(&self, gpu: &str, on: bool) -> Result<(), MigError>;
    /// The GPU-instance profiles and their possible placements (MIG on).
    fn gi_profiles(&self, gpu: &str) -> Result<Vec<GiProfile>, MigError>;
    /// The compute-instance profiles GPU instance `gi` offers.
    fn ci_profiles(&self, gpu: &str, gi: u32) -> Result<Vec<CiProfile>, MigError>;
    fn instances(&self, gpu: &str) -> Result<Vec<GpuInstance>, MigError>;
    fn create_gi(&self, gpu: &str, profile_id: u32, at: Placement) -> Result<u32, MigError>;
    fn create_ci(&self, gpu: &str, gi: u32, profile_id: u32) -> Result<u32, MigError>;
    fn destroy_ci(&self, gpu: &str, gi: u32, ci: u32) -> Result<(), MigError>;
    fn destroy_gi(&self, gpu: &str, gi: u32) -> Result<(), MigError>;
    /// Processes NVML sees on the GPU (host pids).
    fn processes(&self, gpu: &str) -> Result<Vec<u32>, MigError>;
}

impl GiProfile {
    /// A profile as NVIDIA's published table (simnode's) gives it.
    pub fn from_table(p: &simnode::mig::GiProfile) -> Self {
        GiProfile {
            id: p.id,
            name: p.name.to_string(),
            slices: p.slices,
            instances: p.instances,
            memory_mib: p.memory_mib,
            placements: p
                .placements
                .iter()
                .map(|&start| Placement {
                    start,
                    size: p.placement_size,
                })
                .collect(),
        }
    }
}
