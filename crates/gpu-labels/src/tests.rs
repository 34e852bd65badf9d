use super::*;
use crate::test_support::inventory_of;

const GOLDEN_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/labels");

/// The policy's sections the labels read (`spec.devicePlugin`,
/// `spec.mig`), from a policy's YAML.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct Sections {
    #[serde(default)]
    pub(crate) device_plugin: DevicePluginSpec,
    #[serde(default)]
    pub(crate) mig: gpu_resources::config::MigSpec,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Doc {
    spec: Sections,
}

/// [`super::node_labels`] under a policy's sections.
fn node_labels(inv: &Inventory, p: &Sections) -> Result<Labels, LabelsError> {
    super::node_labels(inv, &p.device_plugin, p.mig.strategy)
}

fn policy(yaml: &str) -> Sections {
    hostlib::strict::from_yaml::<Doc>(yaml, "test policy")
        .unwrap()
        .spec
}

const TIME_SLICING_4: &str = "spec:\n  devicePlugin:\n    config:\n      inline:\n        version: v1\n        sharing:\n          timeSlicing:\n            resources:\n            - {name: nvidia.com/gpu, replicas: 4}\n";
const TIME_SLICING_RENAMED: &str = "spec:\n  devicePlugin:\n    config:\n      inline:\n        version: v1\n        sharing:\n          timeSlicing:\n            resources:\n            - {name: nvidia.com/gpu, rename: nvidia.com/gpu.shared, replicas: 4}\n";
const MPS_4: &str = "spec:\n  devicePlugin:\n    config:\n      inline:\n        version: v1\n        sharing:\n          mps:\n            resources:\n            - {name: nvidia.com/gpu, replicas: 4}\n";

/// MPS on GPUs 0-1 as `nvidia.com/gpu.mps`; the other GPUs stay whole
/// `nvidia.com/gpu` (issue 27 point 5).
const MPS_GPUS_0_1: &str = "spec:\n  devicePlugin:\n    config:\n      inline:\n        version: v1\n        sharing:\n          mps:\n            resources:\n            - {name: nvidia.com/gpu, devices: [0, 1], replicas: 4, rename: gpu.mps}\n";

/// A policy with `sharing.<kind>` holding `entries` (YAML flow maps).
fn sharing(kind: &str, entries: &[&str]) -> Sections {
    let mut y = format!(
        "spec:\n  devicePlugin:\n    config:\n      inline:\n        version: v1\n        sharing:\n          {kind}:\n            resources:\n"
    );
    for e in entries {
        y.push_str(&format!("            - {e}\n"));
    }
    policy(&y)
}

/// (golden file, node, policy).
fn cases() -> Vec<(&'static str, String, Sections)> {
    let single_node = format!("{GOLDEN_DIR}/h100-mig-single-2.yaml");
    vec![
        ("h100-sxm-8", "h100-sxm-8".into(), Sections::default()),
        ("a10g-1", "a10g-1".into(), Sections::default()),
        ("t4-4", "t4-4".into(), Sections::default()),
        ("mig-single", single_node, Sections::default()),
        (
            "mig-mixed",
            "h100-mig-2".into(),
            policy("spec:\n  mig:\n    strategy: mixed\n"),
        ),
        (
            "mig-single-invalid",
            "h100-mig-2".into(),
            Sections::default(),
        ),
        ("time-slicing-shared", "t4-4".into(), policy(TIME_SLICING_4)),
        (
            "time-slicing-renamed",
            "a10g-1".into(),
            policy(TIME_SLICING_RENAMED),
        ),
        ("mps-shared", "h100-sxm-8".into(), policy(MPS_4)),
        ("mps-gpus-0-1", "h100-sxm-8".into(), policy(MPS_GPUS_0_1)),
    ]
}

/// Every resource the device plugin advertises has labels under its
/// name that agree with it: `count` GPUs (or MIG devices) of `replicas`
/// devices each.
fn assert_labels_describe_the_plugins_resources(node: &str, p: &Sections) -> Labels {
    let inv = inventory_of(node);
    let l = node_labels(&inv, p).unwrap();
    let settings = gpu_resources::settings(&p.device_plugin, p.mig.strategy).unwrap();
    for r in resources::build(&inv, &settings).unwrap() {
        let get = |k: &str| -> u32 {
            let key = format!("{}.{k}", r.name);
            l.get(&key)
                .unwrap_or_else(|| panic!("{key} missing: {l:#?}"))
                .parse()
                .unwrap()
        };
        let (count, replicas) = (get("count"), get("replicas"));
        assert_eq!(
            (count * replicas) as usize,
            r.devices.len(),
            "{}: {count} x {replicas}",
            r.name
        );
        let strategy = &l[&format!("{}.sharing-strategy", r.name)];
        assert_eq!(strategy != "none", r.shared, "{}: {strategy}", r.name);
    }
    l
}

fn labels_of(node: &str, p: &Sections) -> Labels {
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
    let l = labels_of("h100-sxm-8", &Sections::default());
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
        let settings = gpu_resources::settings(&p.device_plugin, p.mig.strategy).unwrap();
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
    let settings = gpu_resources::settings(&p.device_plugin, p.mig.strategy).unwrap();
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

/// Issue 27 point 5: MPS on GPUs 0-1 only, renamed. `nvidia.com/gpu`
/// (the 6 other GPUs) is not shared and its labels say so; the renamed
/// resource has its own labels (GFD's names, keyed by it).
#[test]
fn labels_claim_no_sharing_the_resource_does_not_have() {
    let l = assert_labels_describe_the_plugins_resources("h100-sxm-8", &policy(MPS_GPUS_0_1));
    let get = |k: &str| l.get(&format!("nvidia.com/{k}")).map(String::as_str);
    assert_eq!(get("gpu.count"), Some("6"));
    assert_eq!(get("gpu.replicas"), Some("1"));
    assert_eq!(get("gpu.sharing-strategy"), Some("none"));
    assert_eq!(get("gpu.product"), Some("NVIDIA-H100-80GB-HBM3"));
    assert_eq!(get("gpu.mps.count"), Some("2"));
    assert_eq!(get("gpu.mps.replicas"), Some("4"));
    assert_eq!(get("gpu.mps.sharing-strategy"), Some("mps"));
    // Renamed: no -SHARED, as GFD names a renamed resource's product.
    assert_eq!(get("gpu.mps.product"), Some("NVIDIA-H100-80GB-HBM3"));
    assert_eq!(get("gpu.mps.memory"), Some("81559"));
    assert_eq!(get("gpu.mps.family"), Some("hopper"));
    assert_eq!(get("mps.capable"), Some("true"));
    // The same entry over every GPU is GFD's case: keyed nvidia.com/gpu.
    let all = policy(&MPS_GPUS_0_1.replace("devices: [0, 1], ", ""));
    let l = node_labels(&inventory_of("h100-sxm-8"), &all).unwrap();
    assert_eq!(l["nvidia.com/gpu.count"], "8");
    assert_eq!(l["nvidia.com/gpu.replicas"], "4");
    assert_eq!(l["nvidia.com/gpu.sharing-strategy"], "mps");
    assert_eq!(l["nvidia.com/gpu.product"], "NVIDIA-H100-80GB-HBM3");
    assert!(!l.keys().any(|k| k.starts_with("nvidia.com/gpu.mps.")));
}

/// Time-slicing with per-GPU `devices` and replica counts (README's
/// example): each name its own GPUs, replicas and strategy.
#[test]
fn time_slicing_per_gpu_entries_label_each_name() {
    let mut p = sharing(
        "timeSlicing",
        &[
            "{name: nvidia.com/gpu, devices: [0, 1, 3], replicas: 4}",
            "{name: nvidia.com/gpu, devices: [2], replicas: 2, rename: gpu.small}",
        ],
    );
    let l = assert_labels_describe_the_plugins_resources("t4-4", &p);
    let triple = |r: &str| {
        ["count", "replicas", "sharing-strategy", "product"]
            .map(|k| l[&format!("nvidia.com/{r}.{k}")].as_str())
    };
    // GPUs 0, 1 and 3 shared under nvidia.com/gpu itself: -SHARED, as
    // GFD.
    assert_eq!(triple("gpu"), ["3", "4", "time-slicing", "Tesla-T4-SHARED"]);
    assert_eq!(triple("gpu.small"), ["1", "2", "time-slicing", "Tesla-T4"]);
    // GPU 3, whole, is left out of every shared name: with renames for
    // both entries it is nvidia.com/gpu's only GPU.
    let yaml = "spec:\n  devicePlugin:\n    config:\n      inline:\n        version: v1\n        sharing:\n          timeSlicing:\n            renameByDefault: true\n            resources:\n            - {name: nvidia.com/gpu, devices: [0, 1], replicas: 4}\n            - {name: nvidia.com/gpu, devices: [2], replicas: 2, rename: gpu.small}\n";
    p = policy(yaml);
    let l = assert_labels_describe_the_plugins_resources("t4-4", &p);
    let get = |k: &str| l[&format!("nvidia.com/{k}")].as_str();
    assert_eq!(
        [
            get("gpu.count"),
            get("gpu.replicas"),
            get("gpu.sharing-strategy"),
            get("gpu.product")
        ],
        ["1", "1", "none", "Tesla-T4"]
    );
    assert_eq!(
        [
            get("gpu.shared.count"),
            get("gpu.shared.replicas"),
            get("gpu.shared.sharing-strategy")
        ],
        ["2", "4", "time-slicing"]
    );
    assert_eq!(get("gpu.shared.product"), "Tesla-T4");
    assert_eq!(get("gpu.small.replicas"), "2");
}

/// Different replica counts under one name (GFD has no such config):
/// `replicas` is the largest, whichever entry comes first.
#[test]
fn different_replica_counts_under_one_name_label_the_largest() {
    for entries in [
        [
            "{name: nvidia.com/gpu, devices: [2, 3], replicas: 2}",
            "{name: nvidia.com/gpu, devices: [0, 1], replicas: 4}",
        ],
        [
            "{name: nvidia.com/gpu, devices: [0, 1], replicas: 4}",
            "{name: nvidia.com/gpu, devices: [2, 3], replicas: 2}",
        ],
    ] {
        let l = node_labels(&inventory_of("t4-4"), &sharing("timeSlicing", &entries)).unwrap();
        assert_eq!(l["nvidia.com/gpu.count"], "4", "{entries:?}");
        assert_eq!(l["nvidia.com/gpu.replicas"], "4", "{entries:?}");
        assert_eq!(l["nvidia.com/gpu.sharing-strategy"], "time-slicing");
        assert_eq!(l["nvidia.com/gpu.product"], "Tesla-T4-SHARED");
    }
}

/// A sharing entry that selects no GPU of the node shares nothing, and
/// the labels do not say it does.
#[test]
fn an_entry_selecting_no_gpu_shares_nothing() {
    let p = sharing(
        "timeSlicing",
        &["{name: nvidia.com/gpu, devices: [7], replicas: 4}"],
    );
    let l = assert_labels_describe_the_plugins_resources("t4-4", &p);
    assert_eq!(l["nvidia.com/gpu.count"], "4");
    assert_eq!(l["nvidia.com/gpu.replicas"], "1");
    assert_eq!(l["nvidia.com/gpu.sharing-strategy"], "none");
    assert_eq!(l["nvidia.com/gpu.product"], "Tesla-T4");
}

/// Every GPU renamed, to two names: nothing is advertised as
/// `nvidia.com/gpu`, so nothing is labelled as it either.
#[test]
fn a_name_with_no_device_left_has_no_labels() {
    let p = sharing(
        "mps",
        &[
            "{name: nvidia.com/gpu, devices: [0, 1], replicas: 4, rename: gpu.mps4}",
            "{name: nvidia.com/gpu, devices: [2, 3], replicas: 2, rename: gpu.mps2}",
        ],
    );
    let l = assert_labels_describe_the_plugins_resources("t4-4", &p);
    assert_eq!(l["nvidia.com/gpu.mps4.count"], "2");
    assert_eq!(l["nvidia.com/gpu.mps2.replicas"], "2");
    for k in ["count", "replicas", "sharing-strategy", "product", "memory"] {
        assert!(
            !l.contains_key(&format!("nvidia.com/gpu.{k}")),
            "{k}: {l:#?}"
        );
    }
    assert_eq!(l["nvidia.com/gpu.present"], "true");
}

/// MIG devices split by `devices`: mixed (one profile's devices over
/// two names) and single (nvidia.com/gpu's MIG devices).
#[test]
fn mig_devices_split_by_sharing_are_labelled_per_name() {
    let mixed = policy(&format!(
        "{}  mig:\n    strategy: mixed\n",
        "spec:\n  devicePlugin:\n    config:\n      inline:\n        version: v1\n        sharing:\n          timeSlicing:\n            resources:\n            - {name: nvidia.com/mig-1g.10gb, devices: [\"1:0\", \"1:1\", \"1:2\"], replicas: 2, rename: mig-1g.10gb.shared}\n"
    ));
    let l = assert_labels_describe_the_plugins_resources("h100-mig-2", &mixed);
    let get = |k: &str| l[&format!("nvidia.com/{k}")].as_str();
    assert_eq!(get("mig-1g.10gb.count"), "6");
    assert_eq!(get("mig-1g.10gb.replicas"), "1");
    assert_eq!(get("mig-1g.10gb.sharing-strategy"), "none");
    assert_eq!(get("mig-1g.10gb.shared.count"), "3");
    assert_eq!(get("mig-1g.10gb.shared.replicas"), "2");
    assert_eq!(get("mig-1g.10gb.shared.sharing-strategy"), "time-slicing");
    assert_eq!(
        get("mig-1g.10gb.shared.product"),
        "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"
    );
    assert_eq!(get("mig-1g.10gb.shared.memory"), "9856");
    assert_eq!(get("mig-1g.10gb.shared.slices.gi"), "1");
    // Other profiles, and the MIG-enabled GPUs' whole-GPU labels, as
    // GFD writes them.
    assert_eq!(get("mig-3g.40gb.replicas"), "1");
    assert_eq!((get("gpu.count"), get("gpu.replicas")), ("2", "0"));
    // Every 1g.10gb device shared under one name: GFD's case, keyed by
    // the profile's resource.
    let all = policy(&mixed_all_1g());
    let l = node_labels(&inventory_of("h100-mig-2"), &all).unwrap();
    assert_eq!(l["nvidia.com/mig-1g.10gb.replicas"], "2");
    assert_eq!(l["nvidia.com/mig-1g.10gb.count"], "9");
    assert!(!l.contains_key("nvidia.com/mig-1g.10gb.shared.count"));

    let single = sharing(
        "timeSlicing",
        &["{name: nvidia.com/gpu, devices: [\"0:0\", \"0:1\"], replicas: 2, rename: gpu.shared}"],
    );
    let l = assert_labels_describe_the_plugins_resources(
        &format!("{GOLDEN_DIR}/h100-mig-single-2.yaml"),
        &single,
    );
    let get = |k: &str| l[&format!("nvidia.com/{k}")].as_str();
    assert_eq!(get("gpu.count"), "12");
    assert_eq!(get("gpu.replicas"), "1");
    assert_eq!(get("gpu.product"), "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb");
    assert_eq!(get("gpu.shared.count"), "2");
    assert_eq!(get("gpu.shared.replicas"), "2");
    assert_eq!(get("gpu.shared.sharing-strategy"), "time-slicing");
    assert_eq!(get("gpu.shared.multiprocessors"), "16");
}

fn mixed_all_1g() -> String {
    "spec:\n  mig:\n    strategy: mixed\n  devicePlugin:\n    config:\n      inline:\n        version: v1\n        sharing:\n          timeSlicing:\n            resources:\n            - {name: nvidia.com/mig-1g.10gb, replicas: 2, rename: mig-1g.10gb.shared}\n".into()
}

/// A renamed resource whose name leaves no room for its labels' keys
/// (63 characters after `nvidia.com/`) is not labelled; the others are.
#[test]
fn a_name_too_long_for_label_keys_is_not_labelled() {
    let long = format!("gpu.{}", "x".repeat(50));
    let p = sharing(
        "timeSlicing",
        &[&format!(
            "{{name: nvidia.com/gpu, devices: [0], replicas: 2, rename: {long}}}"
        )],
    );
    let l = node_labels(&inventory_of("t4-4"), &p).unwrap();
    assert!(!l.keys().any(|k| k.contains(&long)), "{l:#?}");
    assert_eq!(l["nvidia.com/gpu.count"], "3");
    assert_eq!(l["nvidia.com/gpu.sharing-strategy"], "none");
    assert!(keyable("nvidia.com/mig-1g.10gb.shared"));
    assert!(!keyable(&format!("nvidia.com/{long}")));
}

#[test]
fn mig_single_mixed_and_invalid() {
    let single = labels_of(
        &format!("{GOLDEN_DIR}/h100-mig-single-2.yaml"),
        &Sections::default(),
    );
    assert_eq!(
        single["nvidia.com/gpu.product"],
        "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"
    );
    assert_eq!(single["nvidia.com/gpu.count"], "14");
    assert_eq!(single["nvidia.com/gpu.memory"], "9856");
    assert_eq!(single["nvidia.com/gpu.engines.decoder"], "1");
    assert_eq!(single["nvidia.com/gpu.family"], "hopper");
    let invalid = labels_of("h100-mig-2", &Sections::default());
    assert_eq!(
        invalid["nvidia.com/gpu.product"],
        "NVIDIA-H100-80GB-HBM3-MIG-INVALID"
    );
    for k in ["count", "replicas", "memory"] {
        assert_eq!(invalid[&format!("nvidia.com/gpu.{k}")], "0", "{k}");
    }
    assert_eq!(invalid["nvidia.com/gpu.sharing-strategy"], "");
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
    assert!(labels_of("no-gpu", &Sections::default()).is_empty());
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
