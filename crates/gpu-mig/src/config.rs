//! mig-parted's config file, as is: `version: v1` and `mig-configs`, a
//! named layout being a list of entries (`device-filter`, `devices`,
//! `mig-enabled`, `mig-devices`). Parsing is strict: an unknown key, a
//! malformed filter or profile name, or `mig-devices` on a disabled entry
//! is refused with the file, the layout, the entry and the key.

use std::collections::BTreeMap;

use hostlib::strict::{self, YamlError};
use serde::{Deserialize, Serialize};

/// The layouts gpu-agent ships (`packaging/mig/config-default.yaml`): the
/// names GPU Operator users select (`all-disabled`, `all-enabled`,
/// `all-balanced`, `all-<profile>`) for the MIG-capable GPUs of simnode's
/// table; a GPU they do not cover gets them derived from its own profiles
/// ([`super::derive`]).
pub const BUILTIN: &str = include_str!("../../../packaging/mig/config-default.yaml");
/// How errors name the built-in config.
pub const BUILTIN_ORIGIN: &str = "gpu-agent's built-in MIG config";

/// A whole mig-parted config.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigPartedConfig {
    pub version: String,
    #[serde(rename = "mig-configs")]
    pub mig_configs: BTreeMap<String, Vec<Entry>>,
    /// gpu-agent's own layouts ([`MigPartedConfig::builtin`]), not a
    /// user's: a GPU they do not cover gets them derived ([`super::derive`]).
    #[serde(skip)]
    pub builtin: bool,
}

/// One entry of a layout: which GPUs, MIG on or off, and which devices.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// PCI ids the entry is for, `0x<device><vendor>` (`0x233010DE`),
    /// optionally `:0x<subsystem device><subsystem vendor>`; absent: any GPU.
    #[serde(
        rename = "device-filter",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub device_filter: Option<OneOrMany>,
    /// `all`, or a list of GPU indices.
    pub devices: Devices,
    #[serde(rename = "mig-enabled")]
    pub mig_enabled: bool,
    /// Profile name → how many; required (maybe `{}`) when MIG is on.
    #[serde(
        rename = "mig-devices",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub mig_devices: Option<BTreeMap<String, u32>>,
}

/// A string or a list of strings. An unquoted `0x233010DE` is a number to
/// YAML; it is read back as the hex it was written as.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum FilterItem {
    Text(String),
    Number(u64),
}

impl FilterItem {
    fn text(self) -> String {
        match self {
            FilterItem::Text(s) => s,
            FilterItem::Number(n) => format!("{n:#X}").replacen("0X", "0x", 1),
        }
    }
}

impl<'de> Deserialize<'de> for OneOrMany {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            One(FilterItem),
            Many(Vec<FilterItem>),
        }
        match Raw::deserialize(d).map_err(|_| {
            serde::de::Error::custom("expected a PCI id like \"0x233010DE\" or a list of them")
        })? {
            Raw::One(i) => Ok(OneOrMany::One(i.text())),
            Raw::Many(v) => Ok(OneOrMany::Many(
                v.into_iter().map(FilterItem::text).collect(),
            )),
        }
    }
}

impl OneOrMany {
    pub fn items(&self) -> Vec<&str> {
        match self {
            OneOrMany::One(s) => vec![s.as_str()],
            OneOrMany::Many(v) => v.iter().map(String::as_str).collect(),
        }
    }
}

/// `devices: all` or `devices: [0, 1]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Devices {
    All,
    Indices(Vec<u32>),
}

impl Serialize for Devices {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Devices::All => s.serialize_str("all"),
            Devices::Indices(v) => v.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Devices {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Word(String),
            List(Vec<u32>),
        }
        match Raw::deserialize(d).map_err(|_| {
            serde::de::Error::custom("expected `all` or a list of GPU indices like [0, 1]")
        })? {
            Raw::Word(w) if w == "all" => Ok(Devices::All),
            Raw::Word(w) => Err(serde::de::Error::custom(format!(
                "{w:?}: expected `all` or a list of GPU indices like [0, 1]"
            ))),
            Raw::List(v) => Ok(Devices::Indices(v)),
        }
    }
}

/// A PCI id filter: device and vendor, maybe subsystem device and vendor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceFilter {
    pub device: u16,
    pub vendor: u16,
    pub subsystem: Option<(u16, u16)>,
}

impl DeviceFilter {
    /// Parses `0x233010DE` or `0x233010DE:0x16C110DE`.
    pub fn parse(s: &str) -> Option<Self> {
        let word = |w: &str| -> Option<(u16, u16)> {
            let h = w.strip_prefix("0x").or_else(|| w.strip_prefix("0X"))?;
            if h.len() != 8 || !h.chars().all(|c| c.is_ascii_hexdigit()) {
                return None;
            }
            let v = u32::from_str_radix(h, 16).ok()?;
            Some(((v >> 16) as u16, v as u16))
        };
        let (main, sub) = match s.split_once(':') {
            Some((m, s)) => (m, Some(word(s)?)),
            None => (s, None),
        };
        let (device, vendor) = word(main)?;
        Some(DeviceFilter {
            device,
            vendor,
            subsystem: sub,
        })
    }

    /// Whether a PCI function with these ids passes.
    pub fn matches(&self, vendor: u16, device: u16, subsystem: Option<(u16, u16)>) -> bool {
        self.vendor == vendor
            && self.device == device
            && self.subsystem.is_none_or(|want| subsystem == Some(want))
    }
}

/// A `mig-devices` key: `[<C>c.]<G>g.<M>gb[+me|+gfx|-me|+me.all]`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ProfileKey {
    /// Compute-instance slices when smaller than the GPU instance's.
    pub ci_slices: Option<u32>,
    /// The GPU-instance profile's name, e.g. `3g.40gb` or `1g.10gb+me`.
    pub gi_profile: String,
    pub gi_slices: u32,
}

impl ProfileKey {
    pub fn parse(s: &str) -> Option<Self> {
        let (ci, rest) = match s.split_once("c.") {
            Some((c, rest)) if c.chars().all(|ch| ch.is_ascii_digit()) && !c.is_empty() => {
                (Some(c.parse::<u32>().ok()?), rest)
            }
            _ => (None, s),
        };
        let (g, tail) = rest.split_once("g.")?;
        if g.is_empty() || !g.chars().all(|c| c.is_ascii_digit()) {
            return None;
        }
        let gi_slices: u32 = g.parse().ok()?;
        let digits = tail.chars().take_while(|c| c.is_ascii_digit()).count();
        let after = &tail[digits..];
        let suffix = after.strip_prefix("gb")?;
        if digits == 0 || !matches!(suffix, "" | "+me" | "+gfx" | "-me" | "+me.all") {
            return None;
        }
        if gi_slices == 0 || ci.is_some_and(|c| c == 0 || c > gi_slices) {
            return None;
        }
        Some(ProfileKey {
            ci_slices: ci.filter(|&c| c < gi_slices),
            gi_profile: rest.to_string(),
            gi_slices,
        })
    }
}

impl MigPartedConfig {
    /// Parses and checks a config file's text; `origin` names it in errors.
    pub fn from_yaml(text: &str, origin: &str) -> Result<Self, YamlError> {
        let c: MigPartedConfig = strict::from_yaml(text, origin)?;
        c.check(origin, "")?;
        Ok(c)
    }

    /// gpu-agent's own layouts.
    pub fn builtin() -> Self {
        let mut c = Self::from_yaml(BUILTIN, BUILTIN_ORIGIN)
            .expect("the built-in MIG config is checked by tests");
        c.builtin = true;
        c
    }

    /// The rules the schema cannot say; error paths get `prefix` (for a
    /// config inline in a policy).
    pub fn check(&self, origin: &str, prefix: &str) -> Result<(), YamlError> {
        let invalid =
            |path: String, msg: String| YamlError::invalid(origin, format!("{prefix}{path}"), msg);
        if self.version != "v1" {
            return Err(invalid(
                "version".into(),
                format!(
                    "{:?} is not a supported config version (expected v1)",
                    self.version
                ),
            ));
        }
        for (name, entries) in &self.mig_configs {
            if entries.is_empty() {
                return Err(invalid(
                    format!("mig-configs.{name}"),
                    "a layout needs at least one entry".into(),
                ));
            }
            for (i, e) in entries.iter().enumerate() {
                let at = format!("mig-configs.{name}[{i}]");
                if let Some(f) = &e.device_filter {
                    for item in f.items() {
                        if DeviceFilter::parse(item).is_none() {
                            return Err(invalid(
                                format!("{at}.device-filter"),
                                format!(
                                    "{item:?} is not a PCI id like 0x233010DE (device, then vendor) or 0x233010DE:0x16C110DE"
                                ),
                            ));
                        }
                    }
                }
                if let Devices::Indices(v) = &e.devices {
                    if v.is_empty() {
                        return Err(invalid(
                            format!("{at}.devices"),
                            "an empty list selects no GPU; use `all` or list indices".into(),
                        ));
                    }
                    let mut seen = v.clone();
                    seen.sort_unstable();
                    if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
                        return Err(invalid(
                            format!("{at}.devices"),
                            format!("GPU {} is listed twice", w[0]),
                        ));
                    }
                }
                match (&e.mig_devices, e.mig_enabled) {
                    (Some(m), false) if !m.is_empty() => {
                        return Err(invalid(
                            format!("{at}.mig-devices"),
                            "MIG devices on an entry with mig-enabled: false; remove them or enable MIG".into(),
                        ));
                    }
                    (None, true) => {
                        return Err(invalid(
                            format!("{at}.mig-devices"),
                            "required when mig-enabled is true (`{}` for MIG on with no devices)"
                                .into(),
                        ));
                    }
                    _ => {}
                }
                for (key, &count) in e.mig_devices.iter().flatten() {
                    if ProfileKey::parse(key).is_none() {
                        return Err(invalid(
                            format!("{at}.mig-devices.{key}"),
                            "not a MIG profile name like 1g.10gb, 1g.10gb+me or 1c.3g.40gb".into(),
                        ));
                    }
                    if count == 0 {
                        return Err(invalid(
                            format!("{at}.mig-devices.{key}"),
                            "a count of 0; leave the profile out instead".into(),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// The layout called `name`, or an error listing the ones there are.
    pub fn layout(&self, name: &str, origin: &str, key: &str) -> Result<&[Entry], YamlError> {
        self.mig_configs
            .get(name)
            .map(Vec::as_slice)
            .ok_or_else(|| {
                let names: Vec<&str> = self.mig_configs.keys().map(String::as_str).collect();
                YamlError::invalid(
                    origin,
                    key,
                    format!(
                        "no layout named {name:?} (there are: {})",
                        if names.is_empty() {
                            "none".to_string()
                        } else {
                            names.join(", ")
                        }
                    ),
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        MigPartedConfig::from_yaml(text, "mig.yaml")
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn mig_parteds_own_shape_parses() {
        let c = MigPartedConfig::from_yaml(
            "version: v1\nmig-configs:\n  all-disabled:\n    - devices: all\n      mig-enabled: false\n  custom:\n    - device-filter: [\"0x233010DE\", \"0x20B010DE\"]\n      devices: [0, 1]\n      mig-enabled: true\n      mig-devices:\n        \"1g.10gb\": 2\n        \"1c.3g.40gb\": 3\n    - device-filter: 0x20B710DE\n      devices: all\n      mig-enabled: true\n      mig-devices: {}\n",
            "mig.yaml",
        )
        .unwrap();
        let custom = c.layout("custom", "mig.yaml", "k").unwrap();
        assert_eq!(custom[0].devices, Devices::Indices(vec![0, 1]));
        assert_eq!(
            custom[1].device_filter,
            Some(OneOrMany::One("0x20B710DE".into()))
        );
        assert_eq!(custom[1].mig_devices, Some(BTreeMap::new()));
        let e = c
            .layout("nope", "mig.yaml", "spec.migManager.default")
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "mig.yaml: spec.migManager.default: no layout named \"nope\" (there are: all-disabled, custom)"
        );
    }

    #[test]
    fn errors_name_the_layout_entry_and_key() {
        assert_eq!(
            err(
                "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: false\n      mig-devices: {\"1g.10gb\": 7}\n"
            ),
            "mig.yaml: mig-configs.a[0].mig-devices: MIG devices on an entry with mig-enabled: false; remove them or enable MIG"
        );
        assert_eq!(
            err("version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: true\n"),
            "mig.yaml: mig-configs.a[0].mig-devices: required when mig-enabled is true (`{}` for MIG on with no devices)"
        );
        assert_eq!(
            err(
                "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {\"1g.10gib\": 7}\n"
            ),
            "mig.yaml: mig-configs.a[0].mig-devices.1g.10gib: not a MIG profile name like 1g.10gb, 1g.10gb+me or 1c.3g.40gb"
        );
        assert_eq!(
            err(
                "version: v1\nmig-configs:\n  a:\n    - device-filter: 0x2330\n      devices: all\n      mig-enabled: false\n"
            ),
            "mig.yaml: mig-configs.a[0].device-filter: \"0x2330\" is not a PCI id like 0x233010DE (device, then vendor) or 0x233010DE:0x16C110DE"
        );
        assert_eq!(
            err(
                "version: v1\nmig-configs:\n  a:\n    - devices: [0, 0]\n      mig-enabled: false\n"
            ),
            "mig.yaml: mig-configs.a[0].devices: GPU 0 is listed twice"
        );
        assert_eq!(
            err("version: v2\nmig-configs: {}\n"),
            "mig.yaml: version: \"v2\" is not a supported config version (expected v1)"
        );
        let unknown = err(
            "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: false\n      mig-enable: true\n",
        );
        assert!(
            unknown.starts_with("mig.yaml: mig-configs.a[0].mig-enable: unknown key (expected one of: device-filter, devices, mig-enabled, mig-devices)"),
            "{unknown}"
        );
        let devices =
            err("version: v1\nmig-configs:\n  a:\n    - devices: some\n      mig-enabled: false\n");
        assert!(devices.contains("mig-configs.a[0].devices"), "{devices}");
    }

    #[test]
    fn profile_keys_parse_as_nvidia_writes_them() {
        let k = ProfileKey::parse("1c.3g.40gb").unwrap();
        assert_eq!(
            (k.ci_slices, k.gi_profile.as_str(), k.gi_slices),
            (Some(1), "3g.40gb", 3)
        );
        let full = ProfileKey::parse("3c.3g.40gb").unwrap();
        assert_eq!(
            (full.ci_slices, full.gi_profile.as_str()),
            (None, "3g.40gb")
        );
        for ok in [
            "1g.10gb+me",
            "1g.5gb",
            "7g.80gb",
            "2g.12gb+me",
            "1g.24gb+gfx",
            "1g.12gb-me",
            "1g.23gb+me.all",
        ] {
            assert!(ProfileKey::parse(ok).is_some(), "{ok}");
        }
        for bad in [
            "1g",
            "g.10gb",
            "1g.gb",
            "4c.3g.40gb",
            "0g.10gb",
            "1g.10gb+xx",
            "1g.10GB",
        ] {
            assert!(ProfileKey::parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn device_filters_match_pci_ids() {
        let f = DeviceFilter::parse("0x233010DE").unwrap();
        assert!(f.matches(0x10de, 0x2330, None));
        assert!(!f.matches(0x10de, 0x2331, None));
        let s = DeviceFilter::parse("0x233010de:0x16C110DE").unwrap();
        assert!(s.matches(0x10de, 0x2330, Some((0x16c1, 0x10de))));
        assert!(!s.matches(0x10de, 0x2330, None));
    }

    #[test]
    fn the_builtin_config_parses() {
        let c = MigPartedConfig::builtin();
        assert!(c.builtin);
        for name in ["all-disabled", "all-enabled", "all-balanced"] {
            assert!(c.mig_configs.contains_key(name), "{name}");
        }
        // Every name is one the derived layouts also know.
        for name in c.mig_configs.keys() {
            assert!(
                super::super::derive::Generic::parse(name).is_some(),
                "{name}"
            );
        }
        assert!(!MigPartedConfig::from_yaml(BUILTIN, "x").unwrap().builtin);
    }
}
