//! What NVML says of MIG profiles: the profile indices, a GPU-instance
//! profile, a compute-instance profile, one GPU model's facts. Plain types,
//! below the table of models and the simulated MIG state.

use crate::desc::MigEngines;

/// `NVML_GPU_INSTANCE_PROFILE_*`: the index `nvmlDeviceGetGpuInstanceProfileInfo` takes.
pub mod gi_index {
    pub const SLICE_1: u32 = 0;
    pub const SLICE_2: u32 = 1;
    pub const SLICE_3: u32 = 2;
    pub const SLICE_4: u32 = 3;
    pub const SLICE_7: u32 = 4;
    pub const SLICE_8: u32 = 5;
    pub const SLICE_6: u32 = 6;
    /// `1g` with media extensions (`+me`).
    pub const SLICE_1_REV1: u32 = 7;
    /// `2g` with media extensions (`+me`, A30).
    pub const SLICE_2_REV1: u32 = 8;
    /// `1g` with two memory slices (`1g.20gb` on an H100).
    pub const SLICE_1_REV2: u32 = 9;
    /// `1g` with graphics (`+gfx`, RTX PRO Blackwell).
    pub const SLICE_1_GFX: u32 = 10;
    /// `2g` with graphics (`+gfx`).
    pub const SLICE_2_GFX: u32 = 11;
    /// `4g` with graphics (`+gfx`).
    pub const SLICE_4_GFX: u32 = 12;
    /// `1g` without media engines (`-me`).
    pub const SLICE_1_NO_ME: u32 = 13;
    /// `2g` without media engines (`-me`).
    pub const SLICE_2_NO_ME: u32 = 14;
    /// `1g` with every media engine (`+me.all`).
    pub const SLICE_1_ALL_ME: u32 = 15;
    /// `2g` with every media engine (`+me.all`).
    pub const SLICE_2_ALL_ME: u32 = 16;
    /// `NVML_GPU_INSTANCE_PROFILE_COUNT`.
    pub const COUNT: u32 = 17;
}

/// `NVML_COMPUTE_INSTANCE_PROFILE_*`: a compute-instance profile's index,
/// which is also its ID.
pub mod ci_index {
    pub const SLICE_1: u32 = 0;
    pub const SLICE_2: u32 = 1;
    pub const SLICE_3: u32 = 2;
    pub const SLICE_4: u32 = 3;
    pub const SLICE_7: u32 = 4;
    pub const SLICE_8: u32 = 5;
    pub const SLICE_6: u32 = 6;
    /// The whole compute instance of a `1g` GPU instance with two memory
    /// slices (`1g.24gb`'s CI is "profile ID 7" in `nvidia-smi mig -cci`).
    pub const SLICE_1_REV1: u32 = 7;
    /// `NVML_COMPUTE_INSTANCE_PROFILE_COUNT`.
    pub const COUNT: u32 = 8;

    /// The index of the compute-instance profile with `slices` slices.
    pub fn for_slices(slices: u32) -> Option<u32> {
        Some(match slices {
            1 => SLICE_1,
            2 => SLICE_2,
            3 => SLICE_3,
            4 => SLICE_4,
            6 => SLICE_6,
            7 => SLICE_7,
            8 => SLICE_8,
            _ => return None,
        })
    }
}

/// One GPU-instance profile, as `nvmlDeviceGetGpuInstanceProfileInfo`
/// describes it, with its placements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GiProfile {
    /// NVIDIA's name without the `MIG ` prefix: `1g.10gb`, `1g.10gb+me`.
    pub name: &'static str,
    /// `NVML_GPU_INSTANCE_PROFILE_*` ([`gi_index`]).
    pub index: u32,
    /// `nvmlGpuInstanceProfileInfo_t.id`, the ID `nvidia-smi mig -lgip` shows.
    pub id: u32,
    /// Compute slices (`sliceCount`).
    pub slices: u32,
    pub memory_mib: u64,
    pub multiprocessors: u32,
    pub engines: MigEngines,
    /// How many instances of this profile fit at most (`instanceCount`).
    pub instances: u32,
    /// Where an instance may start, in memory slices.
    pub placements: &'static [u32],
    /// How many memory slices an instance takes.
    pub placement_size: u32,
}

impl GiProfile {
    /// A profile with media extensions (`+me`).
    pub fn media_extensions(&self) -> bool {
        self.name.ends_with("+me")
    }

    /// What follows the memory in the name: `""`, `+me`, `+gfx`, `-me`,
    /// `+me.all`.
    pub fn variant(&self) -> &'static str {
        let name = self.name;
        name.find("gb").map_or("", |i| &name[i + 2..])
    }

    /// A profile without a variant (`1g.10gb`, not `1g.10gb+me`).
    pub fn is_plain(&self) -> bool {
        self.variant().is_empty()
    }

    /// The name without `+me`: what its compute instances are called after.
    pub fn base_name(&self) -> &'static str {
        self.name.trim_end_matches("+me")
    }
}

/// A compute-instance profile inside a GPU instance of a given profile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CiProfile {
    /// `1c.3g.20gb`, or the GPU instance's name for the whole-GI profile.
    pub name: String,
    /// `NVML_COMPUTE_INSTANCE_PROFILE_*`, also its ID.
    pub index: u32,
    pub slices: u32,
    pub multiprocessors: u32,
    /// How many fit in an empty GPU instance.
    pub instances: u32,
    /// Starts within the GPU instance (in its memory-slice units).
    pub placements: Vec<u32>,
    pub placement_size: u32,
}

/// What one GPU model offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuMigFacts {
    /// The products, as NVIDIA's table names them.
    pub model: &'static str,
    /// PCI device IDs (vendor 0x10de) of the products.
    pub device_ids: &'static [u16],
    /// Memory slices a whole GPU has (8, or 4 on an A30).
    pub memory_slices: u32,
    /// Compute slices a whole GPU has (7, or 4 on an A30): also the most
    /// MIG devices it can hold.
    pub compute_slices: u32,
    /// Ampere: a MIG mode change waits for a GPU reset. Hopper and newer
    /// change it at once while no GPU instance exists.
    pub mode_change_needs_reset: bool,
    pub profiles: &'static [GiProfile],
    /// Where the numbers come from.
    pub source: &'static str,
}
