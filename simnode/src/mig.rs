//! MIG facts: the GPU-instance profiles of every MIG-capable GPU model we
//! simulate, and the compute-instance profiles inside them.
//!
//! Where the numbers come from (all public; each model's `source` says
//! which it took, and what is estimated):
//! - NVIDIA's MIG user guide (v580), "Supported GPUs" and "Supported MIG
//!   Profiles": products, memory sizes and instance limits; per profile the
//!   fractions of memory and SMs (which give the placement sizes), media
//!   engines, copy engines and instance counts (A30, A100 40/80GB, H100
//!   80GB, H100 94GB, H100 96GB on GH200, H200 141GB, B200, RTX PRO 6000
//!   Blackwell). Its "Getting Started" section: the `-lgipp` placements of
//!   an A100 and the GPU-instance IDs and placements the driver chose in
//!   its `nvidia-smi mig -cgi` examples.
//! - `nvidia-smi mig -lgip` listings published with NVIDIA's mig-parted and
//!   gpu-operator changes and issues (H200: mig-parted#120; GH200 144GB:
//!   mig-parted#139; B200: gpu-operator#1242; HGX GB200: gpu-operator#1303,
//!   mig-parted#227) and by users (RTX PRO 6000 Blackwell): the profile
//!   IDs, memory in MiB (the listing's GiB × 1024) and SM counts. These
//!   depend a little on the driver; each model's numbers come from one
//!   listing where one exists.
//! - The GPU Operator's default layouts ConfigMap (v26.7.0,
//!   `state-mig-manager_0400_configmap.yaml`): PCI device IDs per product,
//!   and the profile names and counts of the models no published table
//!   lists (H800, A800, H20, PG506, B300, GB300).
//! - `nvml.h` (as nvml-wrapper-sys 0.10 binds it): the
//!   `NVML_GPU_INSTANCE_PROFILE_*` and `NVML_COMPUTE_INSTANCE_PROFILE_*`
//!   indices.
//!
//! Estimated where nothing public says (each model's `source` names which):
//! SM counts and memory of the rows a listing does not show (SMs as the
//! slices times the `1g`'s, memory just under the name's GB), the
//! engines of models without a table (as their sibling's), and profile IDs
//! of models without a listing (their family's).
//!
//! Placements are in memory slices: 8 on the A100/H100/B200 family, 4 on
//! the A30 and the RTX PRO 6000 (whose profiles are quarters and halves of
//! the GPU). Every 8-slice model is placed as the user guide's A100 `-lgipp`
//! listing shows: the same profile shapes and instance counts.
//!
//! One GPU can show two tables: NVIDIA renamed HGX GB200's profiles
//! between drivers (`1g.24gb` … `7g.189gb` in early ones, `1g.23gb` …
//! `7g.186gb` since). Both are here under its one PCI device ID; which a
//! simulated GPU has follows from its memory ([`facts_for`]).
//!
//! Not simulated: `+me.all` taking every media engine of the GPU is only
//! kept to the GPU's one OFA (as `+me` is), not its decoders.

pub mod state;

use crate::MigEngines;

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

const fn engines(copy: u32, decoder: u32, jpeg: u32, ofa: u32) -> MigEngines {
    MigEngines {
        copy,
        decoder,
        encoder: 0,
        jpeg,
        ofa,
    }
}

/// Engines of a GPU with encoders in its MIG instances (RTX PRO Blackwell).
const fn engines_enc(copy: u32, media: u32, ofa: u32) -> MigEngines {
    MigEngines {
        copy,
        decoder: media,
        encoder: media,
        jpeg: media,
        ofa,
    }
}

/// Placements of the 8-memory-slice family.
const P1: &[u32] = &[0, 1, 2, 3, 4, 5, 6];
const P1_REV2: &[u32] = &[0, 2, 4, 6];
const P2: &[u32] = &[0, 2, 4];
const P4_HALVES: &[u32] = &[0, 4];
const P0: &[u32] = &[0];
/// The 4-memory-slice GPUs' (A30, RTX PRO 6000).
const Q1: &[u32] = &[0, 1, 2, 3];
const Q2: &[u32] = &[0, 2];

#[allow(clippy::too_many_arguments)]
const fn p(
    name: &'static str,
    index: u32,
    id: u32,
    slices: u32,
    memory_mib: u64,
    multiprocessors: u32,
    engines: MigEngines,
    instances: u32,
    placements: &'static [u32],
    placement_size: u32,
) -> GiProfile {
    GiProfile {
        name,
        index,
        id,
        slices,
        memory_mib,
        multiprocessors,
        engines,
        instances,
        placements,
        placement_size,
    }
}

use gi_index::*;

/// The seven profiles of the 8-slice family, given each model's names,
/// memory sizes (`[1g, 1g two-slice, 4 slices, whole]`; the two-slice `1g`
/// has the `2g`'s memory, `3g` and `4g` share theirs), SM counts
/// (`[1g, 1g two-slice, 2g, 3g, 4g, 7g]`) and engines. Every listing of
/// the family shows the same profile IDs: 19, 20, 15, 14, 9, 5, 0.
macro_rules! family8 {
    ($names:expr, $mem:expr, $sm:expr, $eng:expr) => {
        &[
            p(
                $names[0], SLICE_1, 19, 1, $mem[0], $sm[0], $eng[0], 7, P1, 1,
            ),
            p(
                $names[1],
                SLICE_1_REV1,
                20,
                1,
                $mem[0],
                $sm[0],
                $eng[1],
                1,
                P1,
                1,
            ),
            p(
                $names[2],
                SLICE_1_REV2,
                15,
                1,
                $mem[1],
                $sm[1],
                $eng[2],
                4,
                P1_REV2,
                2,
            ),
            p(
                $names[3], SLICE_2, 14, 2, $mem[1], $sm[2], $eng[3], 3, P2, 2,
            ),
            p(
                $names[4], SLICE_3, 9, 3, $mem[2], $sm[3], $eng[4], 2, P4_HALVES, 4,
            ),
            p($names[5], SLICE_4, 5, 4, $mem[2], $sm[4], $eng[5], 1, P0, 4),
            p($names[6], SLICE_7, 0, 7, $mem[3], $sm[5], $eng[6], 1, P0, 8),
        ]
    };
}

/// Engines of the Ampere A100's profiles (user guide table; `-lgip`).
const A100_ENGINES: [MigEngines; 7] = [
    engines(1, 0, 0, 0),
    engines(1, 1, 1, 1),
    engines(1, 1, 0, 0),
    engines(2, 1, 0, 0),
    engines(3, 2, 0, 0),
    engines(4, 2, 0, 0),
    engines(7, 5, 1, 1),
];
/// Engines of every Hopper profile (a decoder and a JPEG decoder per
/// slice; the whole GPU has 8 copy engines and the one OFA).
const HOPPER_ENGINES: [MigEngines; 7] = [
    engines(1, 1, 1, 0),
    engines(1, 1, 1, 1),
    engines(1, 1, 1, 0),
    engines(2, 2, 2, 0),
    engines(3, 3, 3, 0),
    engines(4, 4, 4, 0),
    engines(8, 7, 7, 1),
];
/// Engines of the B200's profiles as the user guide's table gives them
/// (one NVDEC and one JPEG each, the OFA with `+me` and the whole GPU;
/// copy engines 2, 2, 2, 3, 6, 8, 16).
const BLACKWELL_ENGINES: [MigEngines; 7] = [
    engines(2, 1, 1, 0),
    engines(2, 1, 1, 1),
    engines(2, 1, 1, 0),
    engines(3, 1, 1, 0),
    engines(6, 1, 1, 0),
    engines(8, 1, 1, 0),
    engines(16, 1, 1, 1),
];
const A100_SM: [u32; 6] = [14, 14, 28, 42, 56, 98];
const HOPPER_SM: [u32; 6] = [16, 26, 32, 60, 64, 132];
/// B200: `1g`, `1g.45gb` and `2g` from its `-lgip`; the rest estimated
/// (slices × the `1g`'s).
const B200_SM: [u32; 6] = [18, 30, 36, 54, 72, 126];
/// GB200: `1g`, `1g.47gb` and `2g` from its `-lgip`; the rest estimated.
const GB200_SM: [u32; 6] = [18, 32, 38, 54, 72, 126];

/// The RTX PRO 6000 Blackwell's eleven profiles (4 memory slices: the
/// user guide's quarters, halves and whole), IDs and SMs from a `-lgip`.
const RTX_PRO_6000: &[GiProfile] = &[
    p(
        "1g.24gb",
        SLICE_1,
        14,
        1,
        24187,
        46,
        engines_enc(1, 1, 0),
        4,
        Q1,
        1,
    ),
    p(
        "1g.24gb+me",
        SLICE_1_REV1,
        21,
        1,
        24187,
        46,
        engines_enc(1, 1, 1),
        1,
        Q1,
        1,
    ),
    p(
        "1g.24gb+gfx",
        SLICE_1_GFX,
        47,
        1,
        24187,
        46,
        engines_enc(1, 1, 0),
        4,
        Q1,
        1,
    ),
    p(
        "1g.24gb+me.all",
        SLICE_1_ALL_ME,
        65,
        1,
        24187,
        46,
        engines_enc(1, 4, 1),
        1,
        Q1,
        1,
    ),
    p(
        "1g.24gb-me",
        SLICE_1_NO_ME,
        67,
        1,
        24187,
        46,
        engines_enc(1, 0, 0),
        4,
        Q1,
        1,
    ),
    p(
        "2g.48gb",
        SLICE_2,
        5,
        2,
        48517,
        94,
        engines_enc(2, 2, 0),
        2,
        Q2,
        2,
    ),
    p(
        "2g.48gb+gfx",
        SLICE_2_GFX,
        35,
        2,
        48517,
        94,
        engines_enc(2, 2, 0),
        2,
        Q2,
        2,
    ),
    p(
        "2g.48gb+me.all",
        SLICE_2_ALL_ME,
        64,
        2,
        48517,
        94,
        engines_enc(2, 4, 1),
        1,
        Q2,
        2,
    ),
    p(
        "2g.48gb-me",
        SLICE_2_NO_ME,
        66,
        2,
        48517,
        94,
        engines_enc(2, 0, 0),
        2,
        Q2,
        2,
    ),
    p(
        "4g.96gb",
        SLICE_4,
        0,
        4,
        97280,
        188,
        engines_enc(4, 4, 1),
        1,
        P0,
        4,
    ),
    p(
        "4g.96gb+gfx",
        SLICE_4_GFX,
        32,
        4,
        97280,
        188,
        engines_enc(4, 4, 1),
        1,
        P0,
        4,
    ),
];

/// Every model we simulate. Where two models list one PCI device ID, the
/// first is the one the built-in layouts are written for.
pub const MODELS: &[GpuMigFacts] = &[
    GpuMigFacts {
        model: "A30 24GB",
        device_ids: &[0x20b7],
        memory_slices: 4,
        compute_slices: 4,
        mode_change_needs_reset: true,
        profiles: &[
            p(
                "1g.6gb",
                SLICE_1,
                14,
                1,
                5952,
                14,
                engines(1, 1, 0, 0),
                4,
                Q1,
                1,
            ),
            p(
                "1g.6gb+me",
                SLICE_1_REV1,
                21,
                1,
                5952,
                14,
                engines(1, 1, 1, 1),
                1,
                Q1,
                1,
            ),
            p(
                "2g.12gb",
                SLICE_2,
                5,
                2,
                11968,
                28,
                engines(2, 2, 0, 0),
                2,
                Q2,
                2,
            ),
            p(
                "2g.12gb+me",
                SLICE_2_REV1,
                6,
                2,
                11968,
                28,
                engines(2, 2, 1, 1),
                1,
                Q2,
                2,
            ),
            p(
                "4g.24gb",
                SLICE_4,
                0,
                4,
                24000,
                56,
                engines(4, 4, 1, 1),
                1,
                P0,
                4,
            ),
        ],
        source: "user guide A30 table; -lgip/-lgipp of an A30 (decoders as -lgip reports them: one per slice)",
    },
    GpuMigFacts {
        model: "A100 40GB (SXM4, PCIe), A800 40GB",
        device_ids: &[0x20b0, 0x20b1, 0x20f1, 0x20f6],
        memory_slices: 8,
        compute_slices: 7,
        mode_change_needs_reset: true,
        profiles: family8!(
            [
                "1g.5gb",
                "1g.5gb+me",
                "1g.10gb",
                "2g.10gb",
                "3g.20gb",
                "4g.20gb",
                "7g.40gb"
            ],
            [4864, 9984, 20096, 40448],
            A100_SM,
            A100_ENGINES
        ),
        source: "user guide A100 table and -lgipp; -lgip of an A100-PCIE-40GB; the A800s' device IDs from the operator's ConfigMap",
    },
    GpuMigFacts {
        model: "A100 80GB (SXM4, PCIe), A800 80GB",
        device_ids: &[0x20b2, 0x20b5, 0x20f3, 0x20f5],
        memory_slices: 8,
        compute_slices: 7,
        mode_change_needs_reset: true,
        profiles: family8!(
            [
                "1g.10gb",
                "1g.10gb+me",
                "1g.20gb",
                "2g.20gb",
                "3g.40gb",
                "4g.40gb",
                "7g.80gb"
            ],
            [9728, 19968, 40192, 80896],
            A100_SM,
            A100_ENGINES
        ),
        source: "user guide A100 table (80GB names); -lgip/-lgipp of an A100 80GB PCIe; the A800s' device IDs from the operator's ConfigMap",
    },
    GpuMigFacts {
        model: "H100 80GB (SXM5, PCIe), H800 80GB",
        device_ids: &[0x2330, 0x2331, 0x2322, 0x2324],
        memory_slices: 8,
        compute_slices: 7,
        mode_change_needs_reset: false,
        profiles: family8!(
            [
                "1g.10gb",
                "1g.10gb+me",
                "1g.20gb",
                "2g.20gb",
                "3g.40gb",
                "4g.40gb",
                "7g.80gb"
            ],
            [9984, 20096, 40448, 81152],
            HOPPER_SM,
            HOPPER_ENGINES
        ),
        source: "user guide H100 80GB table; -lgip/-lgipp of an H100 80GB; the H800s' device IDs from the operator's ConfigMap",
    },
    GpuMigFacts {
        model: "H100 NVL 94GB, H800 NVL",
        device_ids: &[0x2321, 0x233a],
        memory_slices: 8,
        compute_slices: 7,
        mode_change_needs_reset: false,
        profiles: family8!(
            [
                "1g.12gb",
                "1g.12gb+me",
                "1g.24gb",
                "2g.24gb",
                "3g.47gb",
                "4g.47gb",
                "7g.94gb"
            ],
            [10880, 22016, 47232, 94848],
            HOPPER_SM,
            HOPPER_ENGINES
        ),
        source: "user guide H100 94GB table; -lgip of an H100 NVL (driver 550.127); the H800 NVL's device ID from the operator's ConfigMap",
    },
    GpuMigFacts {
        model: "H100 96GB (GH200, H100 96GB), H20 96GB",
        device_ids: &[0x2342, 0x233d, 0x2329],
        memory_slices: 8,
        compute_slices: 7,
        mode_change_needs_reset: false,
        profiles: family8!(
            [
                "1g.12gb",
                "1g.12gb+me",
                "1g.24gb",
                "2g.24gb",
                "3g.48gb",
                "4g.48gb",
                "7g.96gb"
            ],
            [11264, 23552, 47616, 95232],
            HOPPER_SM,
            HOPPER_ENGINES
        ),
        source: "user guide H100 96GB (GH200) table; -lgip of a GH200; the H100 96GB's and H20's device IDs, profile names and counts from the operator's ConfigMap (the H20's SM counts are not published: simulated as the GH200's)",
    },
    GpuMigFacts {
        model: "PG506 96GB",
        device_ids: &[0x20b6],
        memory_slices: 8,
        compute_slices: 7,
        mode_change_needs_reset: true,
        profiles: family8!(
            [
                "1g.12gb",
                "1g.12gb+me",
                "1g.24gb",
                "2g.24gb",
                "3g.48gb",
                "4g.48gb",
                "7g.96gb"
            ],
            [11264, 23552, 47616, 95232],
            A100_SM,
            A100_ENGINES
        ),
        source: "device ID, profile names and counts from the operator's ConfigMap (grouped with the H100 96GB); an Ampere GA100: SMs and engines as the A100's, memory as the H100 96GB's (estimates)",
    },
    GpuMigFacts {
        model: "H200 141GB (SXM5, NVL)",
        device_ids: &[0x2335, 0x233b],
        memory_slices: 8,
        compute_slices: 7,
        mode_change_needs_reset: false,
        profiles: family8!(
            [
                "1g.18gb",
                "1g.18gb+me",
                "1g.35gb",
                "2g.35gb",
                "3g.71gb",
                "4g.71gb",
                "7g.141gb"
            ],
            [16384, 33024, 71168, 143104],
            HOPPER_SM,
            HOPPER_ENGINES
        ),
        source: "user guide H200 table and supported GPUs (H200-SXM5, H200 NVL); -lgip of an H200 (mig-parted issue #120); the H200 NVL's device ID from the operator's ConfigMap",
    },
    GpuMigFacts {
        model: "GH200 144GB HBM3e",
        device_ids: &[0x2348],
        memory_slices: 8,
        compute_slices: 7,
        mode_change_needs_reset: false,
        profiles: family8!(
            [
                "1g.18gb",
                "1g.18gb+me",
                "1g.36gb",
                "2g.36gb",
                "3g.72gb",
                "4g.72gb",
                "7g.144gb"
            ],
            [17920, 36096, 72448, 145408],
            HOPPER_SM,
            HOPPER_ENGINES
        ),
        source: "-lgip of a GH200 144GB (mig-parted PR #139: IDs, 1g/2g memory and SMs); 3g/4g/7g memory estimated; Hopper engines",
    },
    GpuMigFacts {
        model: "B200 180GB",
        device_ids: &[0x2901],
        memory_slices: 8,
        compute_slices: 7,
        mode_change_needs_reset: false,
        profiles: family8!(
            [
                "1g.23gb",
                "1g.23gb+me",
                "1g.45gb",
                "2g.45gb",
                "3g.90gb",
                "4g.90gb",
                "7g.180gb"
            ],
            [22528, 45312, 90624, 182272],
            B200_SM,
            BLACKWELL_ENGINES
        ),
        source: "user guide B200 table (fractions, engines, instance counts); -lgip of a B200 (gpu-operator PR #1242: IDs, 1g/2g memory and SMs); 3g/4g/7g memory and SMs estimated",
    },
    GpuMigFacts {
        model: "GB200 186GB",
        device_ids: &[0x2941],
        memory_slices: 8,
        compute_slices: 7,
        mode_change_needs_reset: false,
        profiles: family8!(
            [
                "1g.23gb",
                "1g.23gb+me",
                "1g.47gb",
                "2g.47gb",
                "3g.93gb",
                "4g.93gb",
                "7g.186gb"
            ],
            [22528, 46592, 93184, 188416],
            GB200_SM,
            BLACKWELL_ENGINES
        ),
        source: "user guide supported GPUs (GB200 186GB, 7 instances); -lgip of an HGX GB200 (mig-parted issue #227: IDs, 1g/2g memory and SMs); names of the rest from the operator's ConfigMap; 3g/4g/7g memory and SMs estimated; engines as the B200's",
    },
    GpuMigFacts {
        model: "GB200 189GB (early HGX driver)",
        device_ids: &[0x2941],
        memory_slices: 8,
        compute_slices: 7,
        mode_change_needs_reset: false,
        profiles: family8!(
            [
                "1g.24gb",
                "1g.24gb+me",
                "1g.47gb",
                "2g.47gb",
                "3g.95gb",
                "4g.95gb",
                "7g.189gb"
            ],
            [20480, 46592, 95232, 191488],
            GB200_SM,
            BLACKWELL_ENGINES
        ),
        source: "-lgip of an HGX GB200 on an early driver (gpu-operator PR #1303: 1g.24gb, 1g.24gb+me, 1g.47gb, 2g.47gb with IDs, memory and SMs); 3g.95gb, 4g.95gb, 7g.189gb from the operator's ConfigMap; their memory and SMs estimated; engines as the B200's",
    },
    GpuMigFacts {
        model: "B300 288GB",
        device_ids: &[0x3182],
        memory_slices: 8,
        compute_slices: 7,
        mode_change_needs_reset: false,
        profiles: family8!(
            [
                "1g.34gb",
                "1g.34gb+me",
                "1g.67gb",
                "2g.67gb",
                "3g.135gb",
                "4g.135gb",
                "7g.269gb"
            ],
            [33792, 67584, 136192, 273408],
            B200_SM,
            BLACKWELL_ENGINES
        ),
        source: "device ID, profile names and counts from the operator's ConfigMap; no public table: IDs, SMs and engines as the B200's, memory estimated from the names",
    },
    GpuMigFacts {
        model: "GB300 288GB",
        device_ids: &[0x31c2],
        memory_slices: 8,
        compute_slices: 7,
        mode_change_needs_reset: false,
        profiles: family8!(
            [
                "1g.35gb",
                "1g.35gb+me",
                "1g.70gb",
                "2g.70gb",
                "3g.139gb",
                "4g.139gb",
                "7g.278gb"
            ],
            [34816, 70656, 140288, 282624],
            B200_SM,
            BLACKWELL_ENGINES
        ),
        source: "device ID, profile names and counts from the operator's ConfigMap; no public table: IDs, SMs and engines as the B200's, memory estimated from the names",
    },
    GpuMigFacts {
        model: "RTX PRO 6000 Blackwell Server Edition 96GB",
        device_ids: &[0x2bb5],
        memory_slices: 4,
        compute_slices: 4,
        mode_change_needs_reset: false,
        profiles: RTX_PRO_6000,
        source: "user guide RTX PRO 6000 Blackwell table (fractions, engines, instance counts); -lgip of an RTX PRO 6000 Blackwell (IDs, memory, SMs); device ID from the operator's ConfigMap",
    },
];

/// The MIG facts of the GPU with PCI device ID `device_id`, if we have
/// them: the first model listing it (the one the built-in layouts are
/// written for).
pub fn gi_profiles(device_id: u16) -> Option<&'static GpuMigFacts> {
    MODELS.iter().find(|m| m.device_ids.contains(&device_id))
}

/// The MIG facts of a GPU with PCI device ID `device_id` and `memory_mib`
/// of memory: where several models list the ID (one GPU's tables under
/// two drivers), the one whose whole-GPU profile is nearest the memory;
/// `memory_mib` 0: the first.
pub fn facts_for(device_id: u16, memory_mib: u64) -> Option<&'static GpuMigFacts> {
    let first = gi_profiles(device_id)?;
    if memory_mib == 0 {
        return Some(first);
    }
    MODELS
        .iter()
        .filter(|m| m.device_ids.contains(&device_id))
        .min_by_key(|m| m.full().memory_mib.abs_diff(memory_mib))
}

/// The H100 80GB's facts: the stand-in for a MIG-capable GPU whose model
/// the table does not know (a hand-written description).
pub fn fallback() -> &'static GpuMigFacts {
    gi_profiles(0x2330).expect("the H100 80GB is in the table")
}

/// Compute-instance slice counts a GPU instance of `gi_slices` slices offers
/// (`nvidia-smi mig -lcip`: a 4g has 1c, 2c and 4c but no 3c).
fn ci_slices_offered(gi_slices: u32) -> &'static [u32] {
    match gi_slices {
        1 => &[1],
        2 => &[1, 2],
        3 => &[1, 2, 3],
        4 => &[1, 2, 4],
        7 => &[1, 2, 3, 4, 7],
        _ => &[],
    }
}

/// The GPU's preferred starts when NVML picks a placement itself, for an
/// instance `size` memory slices big: the order the driver chose in the
/// user guide's examples and in published `-cgi` runs (on an empty A100 or
/// H100, seven `1g` land at 6, 4, 5, 0, 1, 2, 3; `2g` at 4, 0, 2; `3g` at
/// 4, then 0). An A30 fills from 0.
fn preferred_starts(memory_slices: u32, size: u32) -> &'static [u32] {
    match (memory_slices, size) {
        (8, 1) => &[6, 4, 5, 0, 1, 2, 3],
        (8, 2) => &[4, 0, 2, 6],
        (8, 4) => &[4, 0],
        _ => &[],
    }
}

impl GpuMigFacts {
    /// The profile with `nvmlGpuInstanceProfileInfo_t.id` `id`.
    pub fn by_id(&self, id: u32) -> Option<&'static GiProfile> {
        self.profiles.iter().find(|p| p.id == id)
    }

    /// The profile with NVML index `index` (`NVML_GPU_INSTANCE_PROFILE_*`).
    pub fn by_index(&self, index: u32) -> Option<&'static GiProfile> {
        self.profiles.iter().find(|p| p.index == index)
    }

    /// The profile called `name` (`3g.40gb`, `1g.10gb+me`).
    pub fn by_name(&self, name: &str) -> Option<&'static GiProfile> {
        self.profiles.iter().find(|p| p.name == name)
    }

    /// The profile without media extensions whose GPU instance has `slices`
    /// compute slices and one memory slice per compute slice (rounded up to
    /// a power of two): `1g.10gb`, `2g.20gb`, `3g.40gb`, `4g.40gb`, `7g.80gb`.
    pub fn standard(&self, slices: u32) -> Option<&'static GiProfile> {
        self.profiles.iter().find(|p| {
            p.slices == slices
                && !p.media_extensions()
                && matches!(
                    p.index,
                    SLICE_1 | SLICE_2 | SLICE_3 | SLICE_4 | SLICE_6 | SLICE_7 | SLICE_8
                )
        })
    }

    /// The whole-GPU profile (the plain one where a variant is as big:
    /// `4g.96gb`, not `4g.96gb+gfx`).
    pub fn full(&self) -> &'static GiProfile {
        self.profiles
            .iter()
            .rev()
            .max_by_key(|p| (p.placement_size, p.is_plain()))
            .expect("every model has profiles")
    }

    /// `profile`'s placements in the order NVML tries them when the caller
    /// names none.
    pub fn default_order(&self, profile: &GiProfile) -> Vec<u32> {
        let preferred = preferred_starts(self.memory_slices, profile.placement_size);
        let mut starts = profile.placements.to_vec();
        starts.sort_by_key(|s| {
            (
                preferred
                    .iter()
                    .position(|p| p == s)
                    .unwrap_or(preferred.len()),
                *s,
            )
        });
        starts
    }

    /// The GPU-instance ID NVML gives an instance at (`start`, `size`): the
    /// memory slices form a binary tree, numbered from the whole GPU (0)
    /// down to single slices (7..=14 on an 8-slice GPU; 3..=6 on an A30).
    pub fn gi_id_for(&self, start: u32, size: u32) -> u32 {
        self.memory_slices / size - 1 + start / size
    }

    /// The compute-instance profiles a GPU instance of `gi` offers.
    pub fn ci_profiles(&self, gi: &GiProfile) -> Vec<CiProfile> {
        let mut out = Vec::new();
        for &k in ci_slices_offered(gi.slices) {
            if k == gi.slices {
                out.push(CiProfile {
                    name: gi.base_name().to_string(),
                    index: if gi.index == SLICE_1_REV2 {
                        ci_index::SLICE_1_REV1
                    } else {
                        ci_index::for_slices(k).expect("offered slices have an index")
                    },
                    slices: k,
                    multiprocessors: gi.multiprocessors,
                    instances: 1,
                    placements: vec![0],
                    placement_size: gi.placement_size,
                });
                continue;
            }
            // A part of the GPU instance is laid out as the GPU lays out
            // the GPU instance of that many slices, within the instance.
            let Some(shape) = self.standard(k) else {
                continue;
            };
            let placements: Vec<u32> = shape
                .placements
                .iter()
                .copied()
                .filter(|s| s + k <= gi.slices && s + shape.placement_size <= gi.placement_size)
                .collect();
            if placements.is_empty() {
                continue;
            }
            out.push(CiProfile {
                name: format!("{k}c.{}", gi.base_name()),
                index: ci_index::for_slices(k).expect("offered slices have an index"),
                slices: k,
                multiprocessors: shape.multiprocessors,
                instances: placements.len() as u32,
                placements,
                placement_size: shape.placement_size,
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_model_is_consistent() {
        let mut seen: std::collections::BTreeMap<u16, Vec<&str>> = Default::default();
        for m in MODELS {
            for id in m.device_ids {
                seen.entry(*id).or_default().push(m.model);
            }
            let full = m.full();
            assert!(full.is_plain(), "{}", m.model);
            assert_eq!(full.placement_size, m.memory_slices, "{}", m.model);
            assert_eq!(full.slices, m.compute_slices, "{}", m.model);
            // Every model tells apart its balanced layout's profiles.
            assert!(m.by_index(SLICE_1).is_some() && m.by_index(SLICE_2).is_some());
            for p in m.profiles {
                // The name says the slices; the memory is the name's GB,
                // rounded as NVIDIA rounds it (within a few GB: drivers
                // differ in what they keep back).
                let (g, rest) = p.name.split_once("g.").unwrap();
                assert_eq!(g.parse::<u32>().unwrap(), p.slices, "{}", p.name);
                let gb: u64 = rest[..rest.find("gb").unwrap()].parse().unwrap();
                assert!(
                    ["", "+me", "+gfx", "-me", "+me.all"].contains(&p.variant()),
                    "{}",
                    p.name
                );
                assert!(
                    p.memory_mib <= gb * 1024 && p.memory_mib + 5 * 1024 > gb * 1024,
                    "{} {}: {} MiB",
                    m.model,
                    p.name,
                    p.memory_mib
                );
                assert!(p.instances as usize <= p.placements.len(), "{}", p.name);
                for s in p.placements {
                    assert_eq!(s % p.placement_size.min(4), 0, "{} at {s}", p.name);
                    assert!(s + p.placement_size <= m.memory_slices, "{} at {s}", p.name);
                }
                assert_eq!(m.by_id(p.id), Some(p));
                assert_eq!(m.by_index(p.index), Some(p));
                assert_eq!(m.by_name(p.name), Some(p));
                // No profile has more of an engine than the whole GPU.
                let (e, f) = (p.engines, full.engines);
                assert!(e.copy <= f.copy && e.decoder <= f.decoder && e.jpeg <= f.jpeg);
                assert!(e.encoder <= f.encoder && e.ofa <= f.ofa);
            }
        }
        // One PCI ID, two tables: only one GPU's two drivers (HGX GB200),
        // told apart by memory.
        for (id, models) in &seen {
            if models.len() > 1 {
                assert_eq!(*id, 0x2941, "{id:#06x}: {models:?}");
                assert_eq!(models.len(), 2);
            }
        }
        let prod = facts_for(0x2941, 189_471).unwrap();
        let early = facts_for(0x2941, 193_000).unwrap();
        assert_eq!(prod.full().name, "7g.186gb");
        assert_eq!(early.full().name, "7g.189gb");
        assert_eq!(gi_profiles(0x2941), Some(prod));
        assert_eq!(facts_for(0x2941, 0), Some(prod));
        assert_eq!(facts_for(0x2330, 1), gi_profiles(0x2330));
    }

    #[test]
    fn h100_numbers_are_nvidias() {
        let h = gi_profiles(0x2330).unwrap();
        let ids: Vec<(&str, u32)> = h.profiles.iter().map(|p| (p.name, p.id)).collect();
        assert_eq!(
            ids,
            [
                ("1g.10gb", 19),
                ("1g.10gb+me", 20),
                ("1g.20gb", 15),
                ("2g.20gb", 14),
                ("3g.40gb", 9),
                ("4g.40gb", 5),
                ("7g.80gb", 0)
            ]
        );
        assert_eq!(h.by_name("1g.20gb").unwrap().index, SLICE_1_REV2);
        assert_eq!(h.by_name("1g.20gb").unwrap().placements, &[0, 2, 4, 6]);
        assert_eq!(h.by_name("3g.40gb").unwrap().placement_size, 4);
        assert!(!h.mode_change_needs_reset);
        assert!(gi_profiles(0x20b0).unwrap().mode_change_needs_reset);
        assert_eq!(gi_profiles(0x20b7).unwrap().memory_slices, 4);
        let b200 = gi_profiles(0x2901).unwrap();
        assert_eq!(b200.by_name("1g.45gb").unwrap().index, SLICE_1_REV2);
        assert_eq!(b200.by_name("7g.180gb").unwrap().id, 0);
        let rtx = gi_profiles(0x2bb5).unwrap();
        assert_eq!(rtx.full().name, "4g.96gb");
        let gfx = rtx.by_name("2g.48gb+gfx").unwrap();
        assert_eq!(
            (gfx.id, gfx.index, gfx.placements),
            (35, SLICE_2_GFX, &[0, 2][..])
        );
        assert_eq!(gfx.variant(), "+gfx");
        assert_eq!(rtx.by_name("1g.24gb+me.all").unwrap().variant(), "+me.all");
        assert!(gi_profiles(0x2bb1).is_none(), "a model the table lacks");
    }

    #[test]
    fn default_placements_follow_the_drivers_choices() {
        let a100 = gi_profiles(0x20b0).unwrap();
        let one = a100.by_name("1g.5gb").unwrap();
        assert_eq!(a100.default_order(one), [6, 4, 5, 0, 1, 2, 3]);
        assert_eq!(
            a100.default_order(a100.by_name("2g.10gb").unwrap()),
            [4, 0, 2]
        );
        assert_eq!(a100.default_order(a100.by_name("3g.20gb").unwrap()), [4, 0]);
        // IDs as the user guide's `-lgi` shows them.
        assert_eq!(a100.gi_id_for(6, 1), 13);
        assert_eq!(a100.gi_id_for(4, 2), 5);
        assert_eq!(a100.gi_id_for(0, 4), 1);
        assert_eq!(a100.gi_id_for(4, 4), 2);
        assert_eq!(a100.gi_id_for(0, 8), 0);
        let a30 = gi_profiles(0x20b7).unwrap();
        assert_eq!(a30.gi_id_for(0, 1), 3);
        assert_eq!(
            a30.default_order(a30.by_name("1g.6gb").unwrap()),
            [0, 1, 2, 3]
        );
    }

    #[test]
    fn compute_instance_profiles() {
        let a100 = gi_profiles(0x20b0).unwrap();
        let names = |gi: &str| -> Vec<(String, u32, u32)> {
            a100.ci_profiles(a100.by_name(gi).unwrap())
                .into_iter()
                .map(|c| (c.name, c.index, c.instances))
                .collect()
        };
        // nvidia-smi mig -lcip on a 4g.20gb: 1c (4), 2c (2), the whole (1).
        assert_eq!(
            names("4g.20gb"),
            [
                ("1c.4g.20gb".to_string(), 0, 4),
                ("2c.4g.20gb".to_string(), 1, 2),
                ("4g.20gb".to_string(), 3, 1)
            ]
        );
        assert_eq!(names("3g.20gb").len(), 3);
        assert_eq!(names("3g.20gb")[0], ("1c.3g.20gb".to_string(), 0, 3));
        let seven = a100.ci_profiles(a100.by_name("7g.40gb").unwrap());
        let counts: Vec<(u32, u32)> = seven.iter().map(|c| (c.slices, c.instances)).collect();
        assert_eq!(counts, [(1, 7), (2, 3), (3, 2), (4, 1), (7, 1)]);
        assert_eq!(seven[2].multiprocessors, 42);
        let h100 = gi_profiles(0x2330).unwrap();
        let rev2 = h100.ci_profiles(h100.by_name("1g.20gb").unwrap());
        assert_eq!(rev2.len(), 1);
        assert_eq!(
            (rev2[0].index, rev2[0].multiprocessors),
            (ci_index::SLICE_1_REV1, 26)
        );
        let me = h100.ci_profiles(h100.by_name("1g.10gb+me").unwrap());
        assert_eq!((me[0].name.as_str(), me[0].index), ("1g.10gb", 0));
    }
}
