//! GPU feature discovery's node labels, computed from the inventory: the
//! same keys and values NVIDIA's gpu-feature-discovery (GFD) writes
//! (k8s-device-plugin `internal/lm`), so that node selectors, affinities
//! and dashboards written for GFD keep working.
//!
//! Pure: nothing here reads the host. The `labels` stage writes them to
//! NFD's local feature file ([`FEATURES_FILE`]); the report to the
//! controller can send the same map.
//!
//! Where gpu-agent differs from GFD, on purpose:
//! - No `nvidia.com/gfd.timestamp`. GFD stamps the time of every relabel
//!   (unless `--no-timestamp`); a timestamp would rewrite an unchanged file
//!   on every pass, and the agent never writes unchanged data.
//! - `nvidia.com/gpu.present=true` is written too: the GPU Operator's
//!   controller sets it from NFD's PCI labels; here the node's agent knows.
//! - Several GPU models on one node: GFD labels the one its Go map happens
//!   to visit last (it warns "Multiple device types detected"); here it is
//!   the model of the last GPU by NVML index (whole GPUs over MIG-enabled
//!   ones, as GFD's order of labellers has it), so labels do not flap.
//! - `mixed` MIG strategy: MIG devices whose compute instance is smaller
//!   than their GPU instance (`1c.2g.20gb`) are not labelled, as the device
//!   plugin does not advertise them.
//! - `gpu.machine`: GFD only turns spaces into `-`; characters a label
//!   value may not hold are dropped too, so the label is always valid.
//! - Version labels are left out when NVML did not give the version (GFD
//!   fails the whole relabel).
//! - `mps.capable`: GFD says `true` for MPS sharing unless a GPU is in MIG
//!   mode (and then fails the relabel); here it is `true` when MPS is the
//!   sharing and the device plugin serves it, which it does on the GPUs out
//!   of MIG mode.

use std::collections::BTreeMap;

use crate::backend::{ComputeCapability, MigDevice};
use crate::inventory::{Gpu, Inventory};
use crate::plugin::config::{MigStrategy, SharingStrategy};
use crate::plugin::resources::{self, GPU_RESOURCE, PluginSettings};
use crate::policy::Policy;

/// NFD's local feature file GFD writes (GFD's `--output-file` default), a
/// host path.
pub const FEATURES_FILE: &str = "/etc/kubernetes/node-feature-discovery/features.d/gfd";

/// Label key → value, sorted by key.
pub type Labels = BTreeMap<String, String>;

/// The node's labels cannot be worked out.
#[derive(Debug, thiserror::Error)]
pub enum LabelsError {
    /// The device-plugin config (sharing) named by the policy is unusable.
    #[error(transparent)]
    Settings(#[from] crate::plugin::SettingsError),
    /// GPUs are on the bus but the backend did not describe them.
    #[error(
        "{gpus} GPU(s) on the node, none can be labelled until {backend} describes them: {reason}"
    )]
    Undescribed {
        gpus: usize,
        backend: String,
        reason: String,
    },
}

/// The labels for this node under this policy (its MIG strategy and the
/// device plugin's sharing config).
pub fn node_labels(inv: &Inventory, policy: &Policy) -> Result<Labels, LabelsError> {
    let settings = crate::plugin::settings(&policy.device_plugin, policy.mig.strategy)?;
    if !inv.gpus.is_empty() && described(inv).next().is_none() {
        return Err(LabelsError::Undescribed {
            gpus: inv.gpus.len(),
            backend: inv.backend.name.clone(),
            reason: inv
                .backend
                .error
                .clone()
                .unwrap_or_else(|| "no UUIDs reported".into()),
        });
    }
    Ok(labels(inv, &settings))
}

/// GPUs NVML described (the ones the device plugin can advertise).
fn described(inv: &Inventory) -> impl Iterator<Item = &Gpu> {
    inv.gpus
        .iter()
        .filter(|g| g.index.is_some() && g.uuid.is_some())
}

fn mig_enabled(g: &Gpu) -> bool {
    g.mig.is_some_and(|m| m.current)
}

/// The labels GFD would write for this inventory, with the device plugin's
/// MIG strategy and time-slicing. No GPU: no labels (as GFD).
pub fn labels(inv: &Inventory, settings: &PluginSettings) -> Labels {
    let gpus: Vec<&Gpu> = described(inv).collect();
    let mut out = Labels::new();
    if gpus.is_empty() {
        return out;
    }
    let mut put = |k: &str, v: String| {
        out.insert(format!("nvidia.com/{k}"), v);
    };
    put("gpu.present", "true".into());
    put("gpu.machine", machine_label(inv.machine.as_deref()));
    match inv.backend.driver_version.as_deref().map(split_driver) {
        Some(Some((major, minor, rev))) => {
            // Deprecated keys, still written by GFD.
            put("cuda.driver.major", major.into());
            put("cuda.driver.minor", minor.into());
            put("cuda.driver.rev", rev.into());
            put("cuda.driver-version.major", major.into());
            put("cuda.driver-version.minor", minor.into());
            put("cuda.driver-version.revision", rev.into());
            put(
                "cuda.driver-version.full",
                inv.backend.driver_version.clone().unwrap_or_default(),
            );
        }
        Some(None) => {
            tracing::warn!(stage = "labels", version = ?inv.backend.driver_version, "driver version is not X.Y[.Z]; no driver-version labels")
        }
        None => {}
    }
    if let Some(c) = inv.cuda_version {
        put("cuda.runtime.major", c.major.to_string());
        put("cuda.runtime.minor", c.minor.to_string());
        put("cuda.runtime-version.major", c.major.to_string());
        put("cuda.runtime-version.minor", c.minor.to_string());
        put(
            "cuda.runtime-version.full",
            format!("{}.{}", c.major, c.minor),
        );
    }
    put(
        "mig.capable",
        gpus.iter().any(|g| g.mig.is_some()).to_string(),
    );
    put("mps.capable", mps_capable(inv, settings).to_string());
    put("gpu.mode", gpu_mode(&gpus).into());
    full_gpu_labels(&gpus, settings, &mut out);
    match settings.mig_strategy {
        MigStrategy::None => {}
        MigStrategy::Single => {
            out.insert("nvidia.com/mig.strategy".into(), "single".into());
            mig_single_labels(&gpus, settings, &mut out);
        }
        MigStrategy::Mixed => {
            out.insert("nvidia.com/mig.strategy".into(), "mixed".into());
            mig_mixed_labels(&gpus, settings, &mut out);
        }
    }
    out
}

/// `nvidia.com/mps.capable`: GFD writes `false` unless the sharing in force
/// is MPS, and then whether no GPU is in MIG mode. Here: MPS is in force
/// and the device plugin can serve it — every GPU it shares with MPS is
/// out of MIG mode and new enough (on a node where other GPUs are in MIG
/// mode GFD fails to label; gpu-agent serves MPS on the rest and says so).
fn mps_capable(inv: &Inventory, settings: &PluginSettings) -> bool {
    matches!(settings.sharing(), Some((SharingStrategy::Mps, _)))
        && resources::build(inv, settings).is_ok_and(|rs| rs.iter().any(|r| r.mps))
}

/// `X.Y[.Z]` → (X, Y, Z or ""), as GFD splits NVML's driver version.
fn split_driver(v: &str) -> Option<(&str, &str, &str)> {
    let parts: Vec<&str> = v.split('.').collect();
    match parts.as_slice() {
        [a, b] => Some((a, b, "")),
        [a, b, c] => Some((a, b, c)),
        _ => None,
    }
}

/// The DMI product name with spaces as `-` (as GFD), without characters a
/// label value cannot hold, at most 63 characters, starting and ending
/// with a letter or digit; `unknown` when there is none.
pub fn machine_label(machine: Option<&str>) -> String {
    let raw = machine.map(str::trim).unwrap_or_default();
    let kept: String = raw
        .chars()
        .map(|c| if c == ' ' { '-' } else { c })
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .take(63)
        .collect();
    let v = kept.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    if v.is_empty() {
        "unknown".into()
    } else {
        v.to_string()
    }
}

/// GFD's `sanitise`: drop characters other than letters, digits, `-`, `_`,
/// `.` and space, then join the words with `-`.
pub fn sanitise(part: &str) -> String {
    let kept: String = part
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ' '))
        .collect();
    kept.split_whitespace().collect::<Vec<_>>().join("-")
}

/// `graphics` (PCI class 0x030000), `compute` (0x030200) or `unknown`, from
/// the first GPU (GFD stops at the first that differs).
fn gpu_mode(gpus: &[&Gpu]) -> &'static str {
    match gpus.first().and_then(|g| g.pci.as_ref()).map(|p| p.class) {
        Some(0x03_00_00) => "graphics",
        Some(0x03_02_00) => "compute",
        _ => "unknown",
    }
}

/// GFD's family of a compute capability (`getArchFamily`).
pub fn arch_family(cc: ComputeCapability) -> &'static str {
    match (cc.major, cc.minor) {
        (1, _) => "tesla",
        (2, _) => "fermi",
        (3, _) => "kepler",
        (5, _) => "maxwell",
        (6, _) => "pascal",
        (7, m) if m < 5 => "volta",
        (7, _) => "turing",
        (8, m) if m < 9 => "ampere",
        (8, _) => "ada-lovelace",
        (9, _) => "hopper",
        (10 | 12, _) => "blackwell",
        (13, _) => "rubin",
        _ => "undefined",
    }
}

/// One resource's labels: `<resource>.<suffix>`.
struct ResourceLabels<'a> {
    resource: String,
    /// `None`: labelled without sharing (a MIG-enabled GPU's whole-GPU
    /// labels): replicas 0.
    settings: Option<&'a PluginSettings>,
}

impl ResourceLabels<'_> {
    fn put(&self, out: &mut Labels, suffix: &str, value: impl ToString) {
        out.insert(format!("{}.{suffix}", self.resource), value.to_string());
    }

    /// `product`, `count`, `replicas`, `sharing-strategy`.
    fn base(&self, out: &mut Labels, count: usize, parts: &[&str]) {
        let replication = self
            .settings
            .and_then(|s| resources::replication(s, &self.resource));
        let replicas = match (&self.settings, &replication) {
            (None, _) => 0,
            (Some(_), Some(r)) if r.replicas > 0 => r.replicas,
            (Some(_), _) => 1,
        };
        let shared = replication.as_ref().is_some_and(|r| r.replicas > 1);
        let renamed = replication
            .as_ref()
            .is_some_and(|r| r.renamed(&self.resource));
        let mut product: Vec<String> = parts
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| sanitise(p))
            .collect();
        if shared && !renamed {
            product.push("SHARED".into());
        }
        self.put(out, "product", product.join("-"));
        self.put(out, "count", count);
        self.put(out, "replicas", replicas);
        let strategy = match &replication {
            Some(r) if self.settings.is_some() && replicas > 1 => r.strategy,
            _ => SharingStrategy::None,
        };
        self.put(out, "sharing-strategy", strategy.as_str());
    }

    /// `memory`, `multiprocessors`, `slices.gi/ci`, `engines.*` of a MIG device.
    fn mig_attributes(&self, out: &mut Labels, m: &MigDevice) {
        self.put(out, "memory", m.memory_mib);
        self.put(out, "multiprocessors", m.multiprocessors);
        self.put(out, "slices.gi", m.gi_slices);
        self.put(out, "slices.ci", m.ci_slices);
        self.put(out, "engines.copy", m.engines.copy);
        self.put(out, "engines.decoder", m.engines.decoder);
        self.put(out, "engines.encoder", m.engines.encoder);
        self.put(out, "engines.jpeg", m.engines.jpeg);
        self.put(out, "engines.ofa", m.engines.ofa);
    }
}

/// `nvidia.com/gpu.*` for whole GPUs: one model's (see the module notes),
/// counting every GPU of that model; without sharing (replicas 0) when all
/// of them have MIG enabled.
fn full_gpu_labels(gpus: &[&Gpu], settings: &PluginSettings, out: &mut Labels) {
    let models: std::collections::BTreeSet<&str> =
        gpus.iter().filter_map(|g| g.model.as_deref()).collect();
    if models.len() > 1 {
        tracing::warn!(stage = "labels", models = ?models, "multiple GPU models on the node; labelling the last one's");
    }
    let Some(g) = gpus
        .iter()
        .rev()
        .find(|g| !mig_enabled(g))
        .or_else(|| gpus.last())
    else {
        return;
    };
    let model = g.model.as_deref().unwrap_or_default();
    let count = gpus
        .iter()
        .filter(|o| o.model.as_deref().unwrap_or_default() == model)
        .count();
    let rl = ResourceLabels {
        resource: GPU_RESOURCE.into(),
        settings: (!mig_enabled(g)).then_some(settings),
    };
    rl.base(out, count, &[model]);
    if let Some(mem) = g.memory_mib.filter(|m| *m != 0) {
        rl.put(out, "memory", mem);
    }
    if let Some(cc) = g.compute_capability.filter(|c| c.major != 0) {
        rl.put(out, "family", arch_family(cc));
        rl.put(out, "compute.major", cc.major);
        rl.put(out, "compute.minor", cc.minor);
    }
}

/// `single`: every MIG device is an `nvidia.com/gpu`. A node the strategy
/// cannot serve (MIG on some GPUs only, a MIG-enabled GPU without devices,
/// several profiles) is labelled `<model>-MIG-INVALID` with count,
/// replicas and memory 0, as GFD.
fn mig_single_labels(gpus: &[&Gpu], settings: &PluginSettings, out: &mut Labels) {
    let enabled: Vec<&Gpu> = gpus.iter().copied().filter(|g| mig_enabled(g)).collect();
    let Some(first) = enabled.first() else {
        return;
    };
    let migs: Vec<(&Gpu, &MigDevice)> = enabled
        .iter()
        .flat_map(|g| g.mig_devices.iter().map(move |m| (*g, m)))
        .collect();
    let profiles: std::collections::BTreeSet<&str> =
        migs.iter().map(|(_, m)| m.profile.as_str()).collect();
    let invalid = if enabled.iter().any(|g| g.mig_devices.is_empty()) {
        Some("a MIG-enabled GPU has no MIG devices")
    } else if enabled.len() != gpus.len() {
        Some("some GPUs have MIG enabled, others not")
    } else if profiles.len() != 1 {
        Some("more than one MIG profile on the node")
    } else {
        None
    };
    let rl = ResourceLabels {
        resource: GPU_RESOURCE.into(),
        settings: Some(settings),
    };
    if let Some(reason) = invalid {
        tracing::warn!(
            stage = "labels",
            reason,
            "the node's MIG layout is invalid for mig.strategy single"
        );
        let model = first.model.as_deref().unwrap_or_default();
        let product: Vec<String> = [model, "MIG", "INVALID"]
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| sanitise(p))
            .collect();
        rl.put(out, "product", product.join("-"));
        rl.put(out, "count", 0);
        rl.put(out, "replicas", 0);
        rl.put(out, "memory", 0);
        return;
    }
    let (parent, m) = migs[0];
    rl.base(
        out,
        migs.len(),
        &[
            parent.model.as_deref().unwrap_or_default(),
            "MIG",
            &m.profile,
        ],
    );
    rl.mig_attributes(out, m);
}

/// `mixed`: `nvidia.com/mig-<profile>.*` for each profile the device plugin
/// advertises, from the first device of that profile.
fn mig_mixed_labels(gpus: &[&Gpu], settings: &PluginSettings, out: &mut Labels) {
    let mut by_profile: BTreeMap<&str, (&Gpu, &MigDevice, usize)> = BTreeMap::new();
    for g in gpus.iter().filter(|g| mig_enabled(g)) {
        for m in g.mig_devices.iter().filter(|m| m.ci_slices == m.gi_slices) {
            by_profile.entry(m.profile.as_str()).or_insert((*g, m, 0)).2 += 1;
        }
    }
    for (profile, (parent, m, count)) in by_profile {
        let rl = ResourceLabels {
            resource: resources::mig_resource_name(profile),
            settings: Some(settings),
        };
        rl.base(
            out,
            count,
            &[parent.model.as_deref().unwrap_or_default(), "MIG", profile],
        );
        rl.mig_attributes(out, m);
    }
}

/// The feature file's text: `key=value` lines, sorted by key.
pub fn render(labels: &Labels) -> String {
    labels.iter().map(|(k, v)| format!("{k}={v}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::inventory_of;

    const GOLDEN_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/labels");

    fn policy(yaml: &str) -> Policy {
        Policy::from_yaml(yaml, "test policy").unwrap()
    }

    const TIME_SLICING_4: &str = "spec:\n  devicePlugin:\n    config:\n      inline:\n        version: v1\n        sharing:\n          timeSlicing:\n            resources:\n            - {name: nvidia.com/gpu, replicas: 4}\n";
    const TIME_SLICING_RENAMED: &str = "spec:\n  devicePlugin:\n    config:\n      inline:\n        version: v1\n        sharing:\n          timeSlicing:\n            resources:\n            - {name: nvidia.com/gpu, rename: nvidia.com/gpu.shared, replicas: 4}\n";
    const MPS_4: &str = "spec:\n  devicePlugin:\n    config:\n      inline:\n        version: v1\n        sharing:\n          mps:\n            resources:\n            - {name: nvidia.com/gpu, replicas: 4}\n";

    /// (golden file, node, policy).
    fn cases() -> Vec<(&'static str, String, Policy)> {
        let single_node = format!("{GOLDEN_DIR}/h100-mig-single-2.yaml");
        vec![
            ("h100-sxm-8", "h100-sxm-8".into(), Policy::default()),
            ("a10g-1", "a10g-1".into(), Policy::default()),
            ("t4-4", "t4-4".into(), Policy::default()),
            ("mig-single", single_node, Policy::default()),
            (
                "mig-mixed",
                "h100-mig-2".into(),
                policy("spec:\n  mig:\n    strategy: mixed\n"),
            ),
            ("mig-single-invalid", "h100-mig-2".into(), Policy::default()),
            ("time-slicing-shared", "t4-4".into(), policy(TIME_SLICING_4)),
            (
                "time-slicing-renamed",
                "a10g-1".into(),
                policy(TIME_SLICING_RENAMED),
            ),
            ("mps-shared", "h100-sxm-8".into(), policy(MPS_4)),
        ]
    }

    fn labels_of(node: &str, p: &Policy) -> Labels {
        node_labels(&inventory_of(node), p).unwrap()
    }

    /// Each case against its golden file (checked by hand against GFD's
    /// `internal/lm` and `tests/expected-output*.txt`); `UPDATE_GOLDEN=1`
    /// rewrites them.
    #[test]
    fn golden_files() {
        let update = std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| v == "1");
        let mut wrong = Vec::new();
        for (name, node, p) in cases() {
            let got = render(&labels_of(&node, &p));
            let path = format!("{GOLDEN_DIR}/{name}.txt");
            if update {
                std::fs::write(&path, &got).unwrap();
                continue;
            }
            let want = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{path}: {e} (UPDATE_GOLDEN=1 writes it)"));
            if got != want {
                wrong.push(format!("--- {path}\n{want}+++ computed\n{got}"));
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }

    #[test]
    fn whole_gpus_as_gfd_labels_them() {
        let l = labels_of("h100-sxm-8", &Policy::default());
        let get = |k: &str| l.get(&format!("nvidia.com/{k}")).map(String::as_str);
        assert_eq!(get("gpu.product"), Some("NVIDIA-H100-80GB-HBM3"));
        assert_eq!(get("gpu.count"), Some("8"));
        assert_eq!(get("gpu.replicas"), Some("1"));
        assert_eq!(get("gpu.sharing-strategy"), Some("none"));
        assert_eq!(get("gpu.memory"), Some("81559"));
        assert_eq!(get("gpu.family"), Some("hopper"));
        assert_eq!(get("gpu.machine"), Some("DGX-H100"));
        assert_eq!(get("gpu.mode"), Some("compute"));
        assert_eq!(get("cuda.driver-version.full"), Some("550.127.08"));
        assert_eq!(get("cuda.driver.rev"), Some("08"));
        assert_eq!(get("cuda.runtime-version.full"), Some("12.4"));
        assert_eq!(get("mig.capable"), Some("true"));
        assert_eq!(get("mig.strategy"), Some("single"));
        assert_eq!(get("mps.capable"), Some("false"));
        assert_eq!(get("gpu.present"), Some("true"));
        assert!(!l.contains_key("nvidia.com/gfd.timestamp"));
        // Strategy none: no mig.strategy label, and nothing else changes.
        let none = labels_of("h100-sxm-8", &policy("spec:\n  mig:\n    strategy: none\n"));
        let mut without = l.clone();
        without.remove("nvidia.com/mig.strategy");
        assert_eq!(none, without);
    }

    #[test]
    fn sharing_agrees_with_the_device_plugin() {
        for (yaml, product, advertised) in [
            (TIME_SLICING_4, "Tesla-T4-SHARED", "nvidia.com/gpu"),
            (TIME_SLICING_RENAMED, "Tesla-T4", "nvidia.com/gpu.shared"),
            (
                "spec:\n  devicePlugin:\n    config:\n      inline:\n        version: v1\n        sharing:\n          timeSlicing:\n            renameByDefault: true\n            resources:\n            - {name: nvidia.com/gpu, replicas: 4}\n",
                "Tesla-T4",
                "nvidia.com/gpu.shared",
            ),
        ] {
            let p = policy(yaml);
            let inv = inventory_of("t4-4");
            let l = node_labels(&inv, &p).unwrap();
            assert_eq!(l["nvidia.com/gpu.product"], product);
            assert_eq!(l["nvidia.com/gpu.replicas"], "4");
            assert_eq!(l["nvidia.com/gpu.count"], "4");
            assert_eq!(l["nvidia.com/gpu.sharing-strategy"], "time-slicing");
            // The plugin advertises 4 replicas of each GPU under that name.
            let settings = crate::plugin::settings(&p.device_plugin, p.mig.strategy).unwrap();
            let rs = resources::build(&inv, &settings).unwrap();
            assert_eq!(rs.len(), 1);
            assert_eq!(rs[0].name, advertised);
            assert_eq!(rs[0].devices.len(), 16);
        }
    }

    #[test]
    fn mps_labels_as_gfd_writes_them() {
        let p = policy(MPS_4);
        let inv = inventory_of("t4-4");
        let l = node_labels(&inv, &p).unwrap();
        assert_eq!(l["nvidia.com/gpu.sharing-strategy"], "mps");
        assert_eq!(l["nvidia.com/gpu.replicas"], "4");
        assert_eq!(l["nvidia.com/gpu.product"], "Tesla-T4-SHARED");
        assert_eq!(l["nvidia.com/mps.capable"], "true");
        // The plugin agrees: 4 MPS replicas of each GPU as nvidia.com/gpu.
        let settings = crate::plugin::settings(&p.device_plugin, p.mig.strategy).unwrap();
        let rs = resources::build(&inv, &settings).unwrap();
        assert_eq!((rs.len(), rs[0].devices.len(), rs[0].mps), (1, 16, true));
        // Renamed by default: no -SHARED, as GFD.
        let renamed = policy(&MPS_4.replace("mps:\n", "mps:\n            renameByDefault: true\n"));
        let l = node_labels(&inv, &renamed).unwrap();
        assert_eq!(l["nvidia.com/gpu.product"], "Tesla-T4");
        assert_eq!(l["nvidia.com/gpu.sharing-strategy"], "mps");
        // Time-slicing: not MPS-capable.
        let l = node_labels(&inv, &policy(TIME_SLICING_4)).unwrap();
        assert_eq!(l["nvidia.com/mps.capable"], "false");
        // MPS asked for on MIG-enabled GPUs (strategy none advertises them
        // whole): refused by the plugin, so not MPS-capable.
        let on_mig = policy(&format!("{MPS_4}  mig:\n    strategy: none\n"));
        let l = node_labels(&inventory_of("h100-mig-2"), &on_mig).unwrap();
        assert_eq!(l["nvidia.com/mps.capable"], "false");
    }

    #[test]
    fn mig_single_mixed_and_invalid() {
        let single = labels_of(
            &format!("{GOLDEN_DIR}/h100-mig-single-2.yaml"),
            &Policy::default(),
        );
        assert_eq!(
            single["nvidia.com/gpu.product"],
            "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"
        );
        assert_eq!(single["nvidia.com/gpu.count"], "14");
        assert_eq!(single["nvidia.com/gpu.memory"], "9856");
        assert_eq!(single["nvidia.com/gpu.engines.decoder"], "1");
        assert_eq!(single["nvidia.com/gpu.family"], "hopper");
        let invalid = labels_of("h100-mig-2", &Policy::default());
        assert_eq!(
            invalid["nvidia.com/gpu.product"],
            "NVIDIA-H100-80GB-HBM3-MIG-INVALID"
        );
        for k in ["count", "replicas", "memory"] {
            assert_eq!(invalid[&format!("nvidia.com/gpu.{k}")], "0", "{k}");
        }
        assert!(!invalid.contains_key("nvidia.com/gpu.multiprocessors"));
        let mixed = labels_of(
            "h100-mig-2",
            &policy("spec:\n  mig:\n    strategy: mixed\n"),
        );
        assert_eq!(mixed["nvidia.com/mig-1g.10gb.count"], "9");
        assert_eq!(mixed["nvidia.com/mig-2g.20gb.count"], "1");
        assert_eq!(
            mixed["nvidia.com/mig-3g.40gb.product"],
            "NVIDIA-H100-80GB-HBM3-MIG-3g.40gb"
        );
        assert_eq!(mixed["nvidia.com/mig-3g.40gb.slices.gi"], "3");
        // Whole-GPU labels of MIG-enabled GPUs carry no sharing.
        assert_eq!(mixed["nvidia.com/gpu.count"], "2");
        assert_eq!(mixed["nvidia.com/gpu.replicas"], "0");
    }

    #[test]
    fn no_gpu_no_labels() {
        assert!(labels_of("no-gpu", &Policy::default()).is_empty());
        assert_eq!(render(&Labels::new()), "");
    }

    #[test]
    fn families_by_compute_capability() {
        let f = |major, minor| arch_family(ComputeCapability { major, minor });
        assert_eq!(f(7, 0), "volta");
        assert_eq!(f(7, 5), "turing");
        assert_eq!(f(8, 6), "ampere");
        assert_eq!(f(8, 9), "ada-lovelace");
        assert_eq!(f(9, 0), "hopper");
        assert_eq!(f(10, 0), "blackwell");
        assert_eq!(f(12, 0), "blackwell");
        assert_eq!(f(13, 0), "rubin");
        assert_eq!(f(4, 0), "undefined");
    }

    #[test]
    fn sanitising() {
        assert_eq!(
            sanitise("NVIDIA  A100-SXM4-40GB (rev 1)"),
            "NVIDIA-A100-SXM4-40GB-rev-1"
        );
        assert_eq!(machine_label(Some("PowerEdge XE9680")), "PowerEdge-XE9680");
        assert_eq!(machine_label(Some(" g5.xlarge\n")), "g5.xlarge");
        assert_eq!(
            machine_label(Some("ProLiant DL380 Gen10 (P1234-B21)")),
            "ProLiant-DL380-Gen10-P1234-B21"
        );
        assert_eq!(machine_label(None), "unknown");
        assert_eq!(machine_label(Some("()")), "unknown");
        assert_eq!(machine_label(Some(&"x".repeat(80))).len(), 63);
    }
}
