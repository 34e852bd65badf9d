//! The MIG facts of every MIG-capable GPU model we simulate (where each
//! number comes from: `super`'s module doc and each model's `source`).

use super::profiles::gi_index::*;
use super::profiles::{GiProfile, GpuMigFacts};
use crate::desc::MigEngines;

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
