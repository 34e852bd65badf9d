//! A GPU's MIG layout: the instances it should have or has (read from NVML),
//! how it reads, and whether wanted instances fit the GPU's profiles.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use gpu_model::mig::{GiProfile, GpuInstance, MigControl, MigError, Placement, place};

/// One wanted GPU instance: its profile and the slices of each compute
/// instance in it (one full-size compute instance for a plain profile).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WantedGi {
    pub profile: String,
    pub cis: Vec<u32>,
}

/// What one GPU should have, or has.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuLayout {
    pub enabled: bool,
    /// Sorted.
    pub gis: Vec<WantedGi>,
}

impl GpuLayout {
    /// `MIG off`, `MIG on, no devices`, `3g.40gb, 2g.20gb, 1g.10gb x2`.
    pub fn describe(&self) -> String {
        if !self.enabled {
            return "MIG off".into();
        }
        if self.gis.is_empty() {
            return "MIG on, no devices".into();
        }
        let mut counts: BTreeMap<String, u32> = BTreeMap::new();
        for gi in &self.gis {
            let slices = gi
                .profile
                .split('g')
                .next()
                .and_then(|s| s.parse::<u32>().ok());
            for &c in &gi.cis {
                let name = if Some(c) == slices {
                    gi.profile.clone()
                } else {
                    format!("{c}c.{}", gi.profile)
                };
                *counts.entry(name).or_default() += 1;
            }
        }
        counts
            .iter()
            .rev()
            .map(|(n, c)| {
                if *c == 1 {
                    n.clone()
                } else {
                    format!("{n} x{c}")
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// What a GPU has now, as a layout.
pub(crate) fn layout_of(
    control: &dyn MigControl,
    uuid: &str,
    enabled: bool,
    instances: &[GpuInstance],
    profiles: &[GiProfile],
) -> Result<GpuLayout, MigError> {
    let mut gis = Vec::new();
    for gi in instances {
        let name = profiles
            .iter()
            .find(|p| p.id == gi.profile_id)
            .map(|p| p.name.clone())
            .unwrap_or_else(|| format!("profile-{}", gi.profile_id));
        let cps = if gi.cis.is_empty() {
            Vec::new()
        } else {
            control.ci_profiles(uuid, gi.id)?
        };
        let mut cis: Vec<u32> = gi
            .cis
            .iter()
            .map(|c| {
                cps.iter()
                    .find(|p| p.id == c.profile_id)
                    .map_or(0, |p| p.slices)
            })
            .collect();
        cis.sort_unstable_by(|a, b| b.cmp(a));
        gis.push(WantedGi { profile: name, cis });
    }
    gis.sort();
    Ok(GpuLayout { enabled, gis })
}

/// Whether `gis` fit a GPU with `profiles`: instance counts, then a
/// placement for each.
pub(crate) fn fits(gis: &[WantedGi], profiles: &[GiProfile]) -> Result<Vec<Placement>, String> {
    let mut counts: BTreeMap<&str, u32> = BTreeMap::new();
    for gi in gis {
        *counts.entry(gi.profile.as_str()).or_default() += 1;
    }
    for (name, n) in &counts {
        let p = profiles.iter().find(|p| p.name == *name).expect("checked");
        if *n > p.instances {
            return Err(format!(
                "{n} instances of {name} do not fit (at most {})",
                p.instances
            ));
        }
    }
    let options: Vec<&[Placement]> = gis
        .iter()
        .map(|gi| {
            profiles
                .iter()
                .find(|p| p.name == gi.profile)
                .map_or(&[][..], |p| p.placements.as_slice())
        })
        .collect();
    place::solutions(&options, &[], 1)
        .into_iter()
        .next()
        .ok_or_else(|| {
            format!(
                "{} do not fit together (no placement leaves them apart)",
                GpuLayout {
                    enabled: true,
                    gis: gis.to_vec()
                }
                .describe()
            )
        })
}
