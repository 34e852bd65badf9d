//! The project's default mig-parted config (packaging/mig/config-default.yaml)
//! is made from the MIG facts table, and every layout in it fits every GPU
//! it selects.
//!
//! The file is generated: after a change to the table, regenerate it with
//! `UPDATE_GOLDEN=1 cargo test -p simnode --test mig_parted_config`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use serde::Deserialize;
use simnode::mig::state::fit_layout;
use simnode::mig::{GiProfile, GpuMigFacts, MODELS, gi_index, gi_profiles};

fn config_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../packaging/mig/config-default.yaml")
}

// --- Writing it from the table ------------------------------------------------

/// `0x20B010DE`, as mig-parted writes a device filter.
fn filter_id(device: u16) -> String {
    format!("0x{device:04X}10DE")
}

/// A config name that is also a valid node-label value (`+` is not).
fn config_name(profile: &str) -> String {
    format!("all-{}", profile.replace('+', "."))
}

/// One entry: the models and PCI device IDs it is for, and its mig-devices.
type Entry = (Vec<&'static str>, Vec<u16>, Vec<(&'static str, u32)>);

/// One layout's entries from what each model asks (`None`: the model has
/// no such layout). A PCI device ID is the first model's that asks for it
/// (table order): one GPU under two drivers (HGX GB200) gets the current
/// driver's entry where both have one. Models asking the same are grouped,
/// in table order.
fn entries(ask: impl Fn(&'static GpuMigFacts) -> Option<Vec<(&'static str, u32)>>) -> Vec<Entry> {
    let mut claimed: Vec<u16> = Vec::new();
    let mut out: Vec<Entry> = Vec::new();
    for m in MODELS {
        let Some(devices) = ask(m) else { continue };
        let ids: Vec<u16> = m
            .device_ids
            .iter()
            .copied()
            .filter(|id| !claimed.contains(id))
            .collect();
        if ids.is_empty() {
            continue;
        }
        claimed.extend(&ids);
        match out.iter_mut().find(|(_, _, d)| *d == devices) {
            Some((models, have, _)) => {
                models.push(m.model);
                have.extend(ids);
            }
            None => out.push((vec![m.model], ids, devices)),
        }
    }
    out
}

/// Two of the smallest `1g`, one `2g`, one `3g` where the model has a `3g`
/// (an A30 or an RTX PRO 6000 has none: two `1g`, one `2g`).
fn balanced(m: &'static GpuMigFacts) -> Vec<(&'static str, u32)> {
    let mut d = Vec::new();
    for (index, count) in [
        (gi_index::SLICE_1, 2),
        (gi_index::SLICE_2, 1),
        (gi_index::SLICE_3, 1),
    ] {
        if let Some(p) = m.by_index(index) {
            d.push((p.name, count));
        }
    }
    d
}

fn write_entries(out: &mut String, entries: &[Entry]) {
    for (models, ids, devices) in entries {
        let ids: Vec<String> = ids
            .iter()
            .map(|d| format!("\"{}\"", filter_id(*d)))
            .collect();
        writeln!(out, "    # {}", models.join("; ")).unwrap();
        writeln!(out, "    - device-filter: [{}]", ids.join(", ")).unwrap();
        writeln!(out, "      devices: all").unwrap();
        writeln!(out, "      mig-enabled: true").unwrap();
        writeln!(out, "      mig-devices:").unwrap();
        for (name, count) in devices {
            writeln!(out, "        \"{name}\": {count}").unwrap();
        }
    }
}

fn generate() -> String {
    let mut out = String::from(
        "# gpu-agent's default MIG layouts, in mig-parted's format (version v1).\n\
         # Select one with spec.migManager.default (README, MIG layouts).\n\
         #\n\
         # Generated from simnode's MIG facts table (simnode/src/mig.rs); do not\n\
         # edit by hand: `UPDATE_GOLDEN=1 cargo test -p simnode --test mig_parted_config`.\n\
         #\n\
         # all-disabled: MIG off. all-enabled: MIG on, no MIG devices.\n\
         # all-balanced: per model, two of the smallest 1g, one 2g and one 3g.\n\
         # all-<profile>: as many of that one profile as fit (\"+me\" is written\n\
         # \".me\" in names: a label value cannot hold \"+\").\n\
         #\n\
         # A GPU that no entry of the selected layout names, or whose own MIG\n\
         # profiles (as NVML lists them) lack one the entry asks for, gets the\n\
         # layout of the same name derived from those profiles by the same rules\n\
         # (README, MIG layouts).\n\
         version: v1\n\
         mig-configs:\n\
         \x20 all-disabled:\n\
         \x20   - devices: all\n\
         \x20     mig-enabled: false\n\
         \n\
         \x20 all-enabled:\n\
         \x20   - devices: all\n\
         \x20     mig-enabled: true\n\
         \x20     mig-devices: {}\n",
    );
    out.push_str("\n  all-balanced:\n");
    write_entries(&mut out, &entries(|m| Some(balanced(m))));
    // Every profile name, in the order the table first lists it.
    let mut names: Vec<&str> = Vec::new();
    for m in MODELS {
        for p in m.profiles {
            if !names.contains(&p.name) {
                names.push(p.name);
            }
        }
    }
    for name in names {
        writeln!(out, "\n  {}:", config_name(name)).unwrap();
        write_entries(
            &mut out,
            &entries(|m| m.by_name(name).map(|p| vec![(p.name, p.instances)])),
        );
    }
    out
}

#[test]
fn committed_config_is_the_tables() {
    let want = generate();
    let path = config_path();
    if std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &want).unwrap();
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        have == want,
        "{} is not what the table makes: run UPDATE_GOLDEN=1 cargo test -p simnode --test mig_parted_config",
        path.display()
    );
}

// --- Reading it back as mig-parted would, and checking every layout -----------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Spec {
    version: String,
    #[serde(rename = "mig-configs")]
    mig_configs: BTreeMap<String, Vec<ConfigEntry>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigEntry {
    #[serde(rename = "device-filter", default)]
    device_filter: Option<Filter>,
    devices: Devices,
    #[serde(rename = "mig-enabled")]
    mig_enabled: bool,
    #[serde(rename = "mig-devices", default)]
    mig_devices: Option<BTreeMap<String, u32>>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Filter {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Devices {
    All(String),
    Indices(Vec<u32>),
}

/// `0xDDDDVVVV` → the device ID, which must be NVIDIA's.
fn parse_filter(f: &str) -> u16 {
    let hex = f.strip_prefix("0x").unwrap_or_else(|| panic!("{f}: no 0x"));
    assert_eq!(hex.len(), 8, "{f}");
    assert_eq!(hex, hex.to_uppercase(), "{f}: mig-parted writes upper case");
    assert_eq!(&hex[4..], "10DE", "{f}: not NVIDIA's vendor ID");
    u16::from_str_radix(&hex[..4], 16).unwrap()
}

/// A valid Kubernetes label value (the config is selected by one).
fn is_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    s.len() <= 63
        && b.first().is_some_and(u8::is_ascii_alphanumeric)
        && b.last().is_some_and(u8::is_ascii_alphanumeric)
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(c))
}

/// Checks `devices` fits a GPU with `facts`; the error says why not.
fn check_fits(facts: &GpuMigFacts, devices: &BTreeMap<String, u32>) -> Result<(), String> {
    let mut profiles: Vec<&GiProfile> = Vec::new();
    for (name, count) in devices {
        let p = facts
            .by_name(name)
            .ok_or_else(|| format!("the {} has no {name}", facts.model))?;
        if *count > p.instances {
            return Err(format!(
                "{count}x {name}: the {} holds {}",
                facts.model, p.instances
            ));
        }
        profiles.extend(std::iter::repeat_n(p, *count as usize));
    }
    fit_layout(facts, &profiles)
        .map(|_| ())
        .ok_or_else(|| format!("{devices:?} has no placement on the {}", facts.model))
}

#[test]
fn every_layout_fits_every_gpu_it_selects() {
    let text = std::fs::read_to_string(config_path()).unwrap();
    let spec: Spec = serde_yaml_ng::from_str(&text).unwrap();
    assert_eq!(spec.version, "v1");
    for name in ["all-disabled", "all-enabled", "all-balanced"] {
        assert!(spec.mig_configs.contains_key(name), "{name} missing");
    }
    let mut covered: BTreeMap<String, Vec<u16>> = BTreeMap::new();
    for (name, entries) in &spec.mig_configs {
        assert!(is_label_value(name), "{name} is not a label value");
        assert!(!entries.is_empty(), "{name}: no entry");
        for e in entries {
            match &e.devices {
                Devices::All(all) => assert_eq!(all, "all", "{name}"),
                Devices::Indices(ix) => {
                    panic!("{name}: the defaults select all devices, not {ix:?}")
                }
            }
            let devices = e.mig_devices.clone().unwrap_or_default();
            if !e.mig_enabled {
                assert!(devices.is_empty(), "{name}: MIG devices with MIG off");
                continue;
            }
            assert!(
                e.mig_devices.is_some(),
                "{name}: mig-devices is required with MIG on"
            );
            let targets: Vec<u16> = match &e.device_filter {
                None => MODELS
                    .iter()
                    .flat_map(|m| m.device_ids.iter().copied())
                    .collect(),
                Some(Filter::One(f)) => vec![parse_filter(f)],
                Some(Filter::Many(fs)) => fs.iter().map(|f| parse_filter(f)).collect(),
            };
            for id in targets {
                // The model the entry is for: of those listing the ID (one
                // GPU's tables under two drivers), the first with every
                // profile the entry names.
                let models: Vec<&GpuMigFacts> = MODELS
                    .iter()
                    .filter(|m| m.device_ids.contains(&id))
                    .collect();
                assert!(!models.is_empty(), "{name}: {id:#06x} unknown");
                let facts = models
                    .iter()
                    .find(|m| devices.keys().all(|d| m.by_name(d).is_some()))
                    .unwrap_or(&models[0]);
                check_fits(facts, &devices).unwrap_or_else(|e| panic!("{name} on {id:#06x}: {e}"));
                covered.entry(name.clone()).or_default().push(id);
            }
        }
    }
    // Every profile of every model has its all-<profile>, and every model
    // its all-balanced.
    for m in MODELS {
        for id in m.device_ids {
            assert!(
                covered["all-balanced"].contains(id),
                "all-balanced misses {id:#06x}"
            );
            for p in m.profiles {
                let name = config_name(p.name);
                assert!(
                    covered.get(&name).is_some_and(|ids| ids.contains(id)),
                    "{name} misses {id:#06x}"
                );
            }
        }
    }
}

#[test]
fn the_checker_refuses_what_does_not_fit() {
    let h100 = gi_profiles(0x2330).unwrap();
    let layout = |pairs: &[(&str, u32)]| -> BTreeMap<String, u32> {
        pairs.iter().map(|(n, c)| (n.to_string(), *c)).collect()
    };
    assert!(
        check_fits(
            h100,
            &layout(&[("3g.40gb", 1), ("2g.20gb", 1), ("1g.10gb", 2)])
        )
        .is_ok()
    );
    assert!(check_fits(h100, &layout(&[("4g.40gb", 1), ("3g.40gb", 1)])).is_ok());
    let err = check_fits(h100, &layout(&[("1g.5gb", 1)])).unwrap_err();
    assert!(err.contains("has no 1g.5gb"), "{err}");
    let err = check_fits(h100, &layout(&[("2g.20gb", 4)])).unwrap_err();
    assert!(err.contains("holds 3"), "{err}");
    // Each count allowed, but together they overlap.
    let err = check_fits(h100, &layout(&[("3g.40gb", 2), ("1g.10gb", 1)])).unwrap_err();
    assert!(err.contains("no placement"), "{err}");
    let err = check_fits(h100, &layout(&[("1g.20gb", 4), ("1g.10gb", 1)])).unwrap_err();
    assert!(err.contains("no placement"), "{err}");
    assert_eq!(parse_filter("0x233010DE"), 0x2330);
    assert!(is_label_value("all-1g.10gb.me") && !is_label_value("all-1g.10gb+me"));
}
