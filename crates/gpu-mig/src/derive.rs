//! The built-in layouts for a GPU they do not cover, derived from the GPU's
//! own MIG profile table (what NVML lists for it) by the rules the built-in
//! file is written with (packaging/mig/config-default.yaml):
//!
//! - `all-disabled`: MIG off; `all-enabled`: MIG on, no MIG devices;
//! - `all-<profile>` (`+` written `.`: `all-1g.10gb.me` is `1g.10gb+me`):
//!   as many of that profile as the GPU holds (its instance count);
//! - `all-balanced`: two of the smallest plain `1g` profile, one plain `2g`
//!   and one plain `3g`, those of them the GPU has ("plain": no `+me`,
//!   `+gfx`, `-me`, `+me.all` after the memory).
//!
//! For every model of simnode's table the derived layout is the built-in
//! one (a test holds them to it), so a GPU gets the same MIG devices by
//! either way; deriving is for the GPUs the table lacks, and for a driver
//! that names a known GPU's profiles differently.

use std::collections::BTreeMap;

use super::config::{Devices, Entry, ProfileKey};
use gpu_model::mig::GiProfile;

/// A layout name the built-in layouts give every MIG-capable GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Generic {
    Disabled,
    Enabled,
    Balanced,
    /// `all-<profile>`, with NVIDIA's profile name (`1g.10gb+me`).
    Profile(String),
}

impl Generic {
    /// `all-disabled`, `all-enabled`, `all-balanced`, or `all-` and a GPU
    /// instance profile written as a label value can hold it.
    pub fn parse(layout: &str) -> Option<Self> {
        match layout {
            "all-disabled" => return Some(Generic::Disabled),
            "all-enabled" => return Some(Generic::Enabled),
            "all-balanced" => return Some(Generic::Balanced),
            _ => {}
        }
        let label = layout.strip_prefix("all-")?;
        let at = label.find("gb")? + 2;
        let (head, tail) = label.split_at(at);
        let profile = match tail.strip_prefix('.') {
            Some(rest) => format!("{head}+{rest}"),
            None => label.to_string(),
        };
        let key = ProfileKey::parse(&profile)?;
        (key.ci_slices.is_none() && !profile.contains("c.") && layout_name(&profile) == layout)
            .then_some(Generic::Profile(profile))
    }
}

/// The layout name of `all-<profile>`: `1g.10gb+me` → `all-1g.10gb.me`
/// (a label value cannot hold `+`).
pub fn layout_name(profile: &str) -> String {
    format!("all-{}", profile.replace('+', "."))
}

/// What follows the memory in a profile name: `""`, `+me`, `+gfx`, `-me`,
/// `+me.all`.
fn variant(name: &str) -> &str {
    name.find("gb").map_or("", |i| &name[i + 2..])
}

/// What `layout` asks of a GPU with `profiles`, as a mig-parted entry for
/// every GPU; `Err` says what the GPU lacks ("has no MIG profile …").
pub fn entry(layout: &Generic, profiles: &[GiProfile]) -> Result<Entry, String> {
    let on = |devices: BTreeMap<String, u32>| Entry {
        device_filter: None,
        devices: Devices::All,
        mig_enabled: true,
        mig_devices: Some(devices),
    };
    let names = || {
        profiles
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match layout {
        Generic::Disabled => Ok(Entry {
            device_filter: None,
            devices: Devices::All,
            mig_enabled: false,
            mig_devices: None,
        }),
        Generic::Enabled => Ok(on(BTreeMap::new())),
        Generic::Profile(name) => {
            let p = profiles
                .iter()
                .find(|p| p.name == *name)
                .ok_or_else(|| format!("has no MIG profile {name} (it has: {})", names()))?;
            Ok(on(BTreeMap::from([(name.clone(), p.instances)])))
        }
        Generic::Balanced => {
            let mut devices = BTreeMap::new();
            for (slices, count) in [(1, 2), (2, 1), (3, 1)] {
                let smallest = profiles
                    .iter()
                    .filter(|p| p.slices == slices && variant(&p.name).is_empty())
                    .min_by(|a, b| (a.memory_mib, &a.name).cmp(&(b.memory_mib, &b.name)));
                if let Some(p) = smallest {
                    devices.insert(p.name.clone(), count);
                }
            }
            if devices.len() < 2 {
                return Err(format!(
                    "has no plain 1g and 2g MIG profiles to balance (it has: {})",
                    names()
                ));
            }
            Ok(on(devices))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_model::mig::Placement;

    fn profile(name: &str, slices: u32, memory_mib: u64, instances: u32) -> GiProfile {
        GiProfile {
            id: 0,
            name: name.into(),
            slices,
            instances,
            memory_mib,
            placements: vec![Placement { start: 0, size: 1 }],
        }
    }

    #[test]
    fn generic_names_are_read_as_the_built_in_file_writes_them() {
        for (name, want) in [
            ("all-disabled", Some(Generic::Disabled)),
            ("all-enabled", Some(Generic::Enabled)),
            ("all-balanced", Some(Generic::Balanced)),
            ("all-1g.10gb", Some(Generic::Profile("1g.10gb".into()))),
            (
                "all-1g.10gb.me",
                Some(Generic::Profile("1g.10gb+me".into())),
            ),
            (
                "all-1g.24gb.me.all",
                Some(Generic::Profile("1g.24gb+me.all".into())),
            ),
            (
                "all-2g.48gb.gfx",
                Some(Generic::Profile("2g.48gb+gfx".into())),
            ),
            (
                "all-1g.24gb-me",
                Some(Generic::Profile("1g.24gb-me".into())),
            ),
            ("all-7g.180gb", Some(Generic::Profile("7g.180gb".into()))),
            ("all-1c.3g.40gb", None),
            ("all-1g.10gb+me", None),
            ("all-1g.10gb.xx", None),
            ("all-1g", None),
            ("custom", None),
            ("1g.10gb", None),
        ] {
            assert_eq!(Generic::parse(name), want, "{name}");
            if let Some(Generic::Profile(p)) = &want {
                assert_eq!(layout_name(p), name);
            }
        }
    }

    #[test]
    fn derived_entries_follow_the_built_in_rules() {
        let gpu = [
            profile("1g.10gb", 1, 9984, 7),
            profile("1g.10gb+me", 1, 9984, 1),
            profile("1g.20gb", 1, 20096, 4),
            profile("2g.20gb", 2, 20096, 3),
            profile("3g.40gb", 3, 40448, 2),
            profile("4g.40gb", 4, 40448, 1),
            profile("7g.80gb", 7, 81152, 1),
        ];
        let devices = |g: &Generic| entry(g, &gpu).unwrap().mig_devices.unwrap();
        assert_eq!(
            devices(&Generic::Balanced),
            BTreeMap::from([
                ("1g.10gb".to_string(), 2),
                ("2g.20gb".to_string(), 1),
                ("3g.40gb".to_string(), 1)
            ])
        );
        assert_eq!(
            devices(&Generic::Profile("1g.20gb".into())),
            BTreeMap::from([("1g.20gb".to_string(), 4)])
        );
        assert!(devices(&Generic::Enabled).is_empty());
        let off = entry(&Generic::Disabled, &gpu).unwrap();
        assert!(!off.mig_enabled && off.mig_devices.is_none());
        assert_eq!(
            entry(&Generic::Profile("1g.5gb".into()), &gpu).unwrap_err(),
            "has no MIG profile 1g.5gb (it has: 1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb)"
        );
        // Four slices (A30, RTX PRO): no 3g; variants are not balanced.
        let quarters = [
            profile("1g.24gb+gfx", 1, 24187, 4),
            profile("1g.24gb", 1, 24187, 4),
            profile("2g.48gb-me", 2, 48517, 2),
            profile("2g.48gb", 2, 48517, 2),
            profile("4g.96gb", 4, 97280, 1),
        ];
        assert_eq!(
            entry(&Generic::Balanced, &quarters)
                .unwrap()
                .mig_devices
                .unwrap(),
            BTreeMap::from([("1g.24gb".to_string(), 2), ("2g.48gb".to_string(), 1)])
        );
        let err = entry(&Generic::Balanced, &[profile("7g.80gb", 7, 81152, 1)]).unwrap_err();
        assert!(
            err.starts_with("has no plain 1g and 2g MIG profiles"),
            "{err}"
        );
    }
}
