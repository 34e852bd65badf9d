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

mod models;
mod profiles;
pub mod state;

pub use models::MODELS;
pub use profiles::{CiProfile, GiProfile, GpuMigFacts, ci_index, gi_index};

use profiles::gi_index::*;

use crate::desc::{MigDeviceDesc, MigEngines};

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

impl MigEngines {
    /// What an H100 80GB's GPU instance of `gi_slices` slices has: the
    /// engines of the profile without `+me` in [`MODELS`] (a decoder,
    /// a JPEG decoder and a copy engine per slice, no encoder; the
    /// whole-GPU instance has 8 copy engines and the one optical-flow
    /// accelerator). Slice counts no profile has get one of each per slice.
    pub fn h100(gi_slices: u32) -> Self {
        fallback()
            .standard(gi_slices)
            .map(|p| p.engines)
            .unwrap_or(MigEngines {
                copy: gi_slices,
                decoder: gi_slices,
                encoder: 0,
                jpeg: gi_slices,
                ofa: 0,
            })
    }
}

impl MigDeviceDesc {
    /// The engines NVML reports: the description's, else an H100's.
    pub fn engines(&self) -> MigEngines {
        let d = MigEngines::h100(self.gi_slices);
        let e = &self.engines;
        MigEngines {
            copy: e.copy.unwrap_or(d.copy),
            decoder: e.decoder.unwrap_or(d.decoder),
            encoder: e.encoder.unwrap_or(d.encoder),
            jpeg: e.jpeg.unwrap_or(d.jpeg),
            ofa: e.ofa.unwrap_or(d.ofa),
        }
    }
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
