//! NVIDIA's own device-plugin config files, unchanged (`../shared/upstream/`,
//! whose README names project and version), through the path a user takes:
//! `gpu-agent policy check`, then `status` and `labels` (what `run`
//! advertises and writes) on a simulated node of each GPU family, then one
//! `run --once`. A user switching from the GPU Operator keeps these files.

mod common;

use common::{bin, json, run};
use std::path::{Path, PathBuf};

/// Every simulated node: each GPU family, a MIG node, a mixed node, none.
const NODES: &[&str] = &[
    "t4-4",
    "a10g-1",
    "h100-sxm-8",
    "h100-mig-2",
    "a100-h100-mixed",
    "no-gpu",
];

fn upstream() -> PathBuf {
    let dir = common::repo().join("../shared/upstream");
    assert!(
        dir.join("README.md").is_file(),
        "{}: upstream's files are not there (CI has ../shared beside the checkout)",
        dir.display()
    );
    dir
}

/// Every device-plugin config upstream ships in `../shared/upstream`: the
/// device plugin's README configs and the operator's test config.
fn device_plugin_configs() -> Vec<PathBuf> {
    let up = upstream();
    let mut files: Vec<PathBuf> = std::fs::read_dir(up.join("k8s-device-plugin"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files.push(up.join("gpu-operator/tests_plugin-config.yaml"));
    assert!(files.len() >= 6, "{files:?}");
    files
}

fn policy_naming(dir: &Path, config: &Path) -> PathBuf {
    let p = dir.join("policy.yaml");
    std::fs::write(
        &p,
        format!(
            "spec:\n  devicePlugin:\n    config:\n      file: {}\n",
            config.display()
        ),
    )
    .unwrap();
    p
}

fn plugin_stage(node: &str, policy: &Path) -> (String, String) {
    let (code, out, err) = run(bin()
        .args(["--simulate", node, "--policy"])
        .arg(policy)
        .args(["status", "-o", "json"]));
    // No agent runs here: `status` inspects and exits 3 (LSB's "program
    // is not running").
    assert_eq!(code, 3, "{node}: {err}");
    let st = common::stage(&json(&out), "plugin");
    (
        st["state"].as_str().unwrap().to_string(),
        st["detail"].as_str().unwrap().to_string(),
    )
}

/// GPUs of a node not in MIG mode.
fn whole_gpus(node: &str) -> usize {
    let (code, out, err) = run(bin().args(["--simulate", node, "inventory", "-o", "json"]));
    assert_eq!(code, 0, "{err}");
    json(&out)["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|g| g["mig"]["current"] != true)
        .count()
}

/// The replicas a config asks of `nvidia.com/gpu`, and the MIG strategy
/// its flags name, read from the file itself (not from gpu-agent's parser).
fn asks(config: &Path) -> (Option<u64>, Option<String>) {
    let v: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(config).unwrap()).unwrap();
    let replicas = ["timeSlicing", "mps"]
        .iter()
        .find_map(|k| v["sharing"][*k]["resources"][0]["replicas"].as_u64());
    let mig = v["flags"]["migStrategy"].as_str().map(str::to_string);
    (replicas, mig)
}

#[test]
fn every_device_plugin_config_upstream_ships_passes_policy_check() {
    let dir = tempfile::tempdir().unwrap();
    for config in device_plugin_configs() {
        let policy = policy_naming(dir.path(), &config);
        let (code, out, err) = run(bin().args(["policy", "check"]).arg(&policy));
        assert_eq!(code, 0, "{}: {out}{err}", config.display());
        assert!(out.contains("valid policy"), "{out}");
        // What the file asks that gpu-agent does not do is named, never fatal.
        let text = std::fs::read_to_string(&config).unwrap();
        if text.contains("failOnInitError: true") {
            assert!(
                out.contains("note: device-plugin config key not acted on: flags.failOnInitError"),
                "{}: {out}",
                config.display()
            );
        }
    }
}

#[test]
fn every_device_plugin_config_upstream_ships_is_honoured_on_every_node_family() {
    let dir = tempfile::tempdir().unwrap();
    let mut rows = Vec::new();
    for config in device_plugin_configs() {
        let policy = policy_naming(dir.path(), &config);
        let (replicas, mig) = asks(&config);
        for node in NODES {
            let (state, detail) = plugin_stage(node, &policy);
            let name = config.file_name().unwrap().to_string_lossy().into_owned();
            rows.push(format!("{name} {node}: {state}: {detail}"));
            let gpus = whole_gpus(node);
            if *node == "no-gpu" {
                assert_eq!(state, "ready", "{name}: {detail}");
                assert!(detail.starts_with("no devices to advertise"), "{detail}");
                continue;
            }
            if *node == "h100-mig-2" {
                // Two MIG GPUs of several profiles: `single` (the default
                // when neither the policy nor the file names one) cannot
                // advertise them, in words; `none` and `mixed` can.
                match mig.as_deref() {
                    Some("none") => {
                        assert_eq!(state, "ready", "{name}: {detail}");
                        assert!(
                            detail.starts_with("nvidia.com/gpu: 2 device(s)"),
                            "{detail}"
                        );
                    }
                    Some("mixed") => {
                        assert_eq!(state, "ready", "{name}: {detail}");
                        assert!(detail.contains("nvidia.com/mig-1g.10gb: "), "{detail}");
                    }
                    _ => {
                        assert_eq!(state, "failed", "{name}: {detail}");
                        assert!(
                            detail.contains("single needs one (or use mixed)"),
                            "{detail}"
                        );
                    }
                }
                continue;
            }
            assert_eq!(state, "ready", "{name} on {node}: {detail}");
            let expected = gpus as u64 * replicas.unwrap_or(1);
            assert!(
                detail.starts_with(&format!("nvidia.com/gpu: {expected} device(s)")),
                "{name} on {node}: {detail}"
            );
        }
    }
    // The table, for whoever reads the test's output.
    println!("{}", rows.join("\n"));
}

/// The sharing a config asks for shows in the node's labels as GFD writes
/// them: `gpu.replicas` and `sharing-strategy`.
#[test]
fn sharing_configs_upstream_ships_label_the_node_as_gfd_does() {
    let dir = tempfile::tempdir().unwrap();
    for config in device_plugin_configs() {
        let policy = policy_naming(dir.path(), &config);
        let (replicas, _) = asks(&config);
        let (code, out, err) = run(bin()
            .args(["--simulate", "t4-4", "--policy"])
            .arg(&policy)
            .args(["labels", "-o", "json"]));
        assert_eq!(code, 0, "{err}");
        let l = json(&out);
        let text = std::fs::read_to_string(&config).unwrap();
        let strategy = if text.contains("mps:") {
            "mps"
        } else if text.contains("timeSlicing:") {
            "time-slicing"
        } else {
            "none"
        };
        assert_eq!(
            l["nvidia.com/gpu.replicas"],
            replicas.unwrap_or(1).to_string(),
            "{}",
            config.display()
        );
        assert_eq!(
            l["nvidia.com/gpu.sharing-strategy"],
            strategy,
            "{}",
            config.display()
        );
    }
}

/// `run --once` with each config: the pass ends, and the agent did not
/// refuse its configuration (exit 2 is bad input, a DaemonSet's crash loop).
#[test]
fn run_takes_every_device_plugin_config_upstream_ships() {
    let dir = tempfile::tempdir().unwrap();
    for config in device_plugin_configs() {
        let host = tempfile::tempdir().unwrap();
        let policy = policy_naming(dir.path(), &config);
        let (code, _, err) = run(common::at(host.path())
            .args(["--simulate", "t4-4", "--policy"])
            .arg(&policy)
            .args(["run", "--once"]));
        assert_ne!(code, 2, "{}: refused: {err}", config.display());
        assert!(!err.contains("unknown key"), "{}: {err}", config.display());
    }
}

/// dcgm-exporter's own counters files, unchanged and with every commented
/// field line uncommented (what a user does to enable more): each reads
/// whole, no line costs another its series, and a field the file lists
/// twice (`DCGM_FI_PROF_PCIE_TX_BYTES`, as counter and as gauge) is
/// exported once, as its first line says, the other line named.
#[test]
fn dcgm_exporters_counters_files_read_whole_even_with_every_line_uncommented() {
    use gpu_agent::metrics::fields::{Field, FieldSet, Kind};
    for name in ["default-counters.csv", "dcp-metrics-included.csv"] {
        let path = upstream().join("dcgm-exporter").join(name);
        let text = std::fs::read_to_string(&path).unwrap();
        let set = FieldSet::parse(&text, name).unwrap();
        assert!(set.notes.is_empty(), "{name}: {:?}", set.notes);
        // Every field the file leaves uncommented is exported.
        assert!(set.skipped.is_empty(), "{name}: {:?}", set.skipped);
        assert!(set.fields.len() >= 20, "{name}: {}", set.fields.len());

        let uncommented: String = text
            .lines()
            .map(|l| match l.trim_start().strip_prefix('#') {
                Some(rest) if rest.trim_start().starts_with("DCGM_FI_") => rest.trim_start(),
                _ => l,
            })
            .map(|l| format!("{l}\n"))
            .collect();
        let all = FieldSet::parse(&uncommented, name).unwrap();
        assert!(
            all.fields.len() >= set.fields.len(),
            "{name}: {} fields uncommented, {} before",
            all.fields.len(),
            set.fields.len()
        );
        for f in &set.fields {
            assert!(all.wants(*f), "{name}: {f:?} lost by uncommenting others");
        }
        let pcie_tx = Field::by_name("DCGM_FI_PROF_PCIE_TX_BYTES");
        if let Some(f) = pcie_tx {
            assert!(all.wants(f));
            assert_eq!(all.kind_of(f), Kind::Counter, "the first line, as counter");
        }
        assert!(
            all.skipped
                .iter()
                .any(|s| s.contains("DCGM_FI_PROF_PCIE_TX_BYTES is listed already at line 18")),
            "{name}: {:?}",
            all.skipped
        );
        // Every DCGM field of the file is exported: the lines left out are
        // the second lines of the two PCIe fields, nothing else.
        assert_eq!(all.skipped.len(), 2, "{name}: {:?}", all.skipped);
        assert!(
            all.skipped.iter().all(|s| s.contains("is listed already")),
            "{name}: {:?}",
            all.skipped
        );
    }
}

/// `policy check` reads the files the policy names as the running agent
/// will: a mig-parted file that does not parse, a layout it lacks, a
/// counters file that is missing fail the check (they passed before); a
/// counters line the agent leaves out is a warning.
#[test]
fn policy_check_reads_the_files_the_policy_names() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let bad_mig = write(
        "mig.yaml",
        "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enable: true\n",
    );
    let good_mig = write(
        "mig-ok.yaml",
        "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: false\n",
    );
    let counters = write(
        "c.csv",
        "DCGM_FI_DEV_GPU_TEMP, gauge, t\nDCGM_FI_DEV_SM_CLOCK gauge\n",
    );
    let check = |spec: String| {
        let p = write("p.yaml", &format!("spec:\n{spec}"));
        run(bin().args(["policy", "check"]).arg(&p))
    };
    let (code, _, err) = check(format!(
        "  migManager:\n    config:\n      file: {}\n",
        bad_mig.display()
    ));
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("mig-configs.a[0].mig-enable: unknown key"),
        "{err}"
    );
    let (code, _, err) = check(format!(
        "  migManager:\n    default: b\n    config:\n      file: {}\n",
        good_mig.display()
    ));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no layout named \"b\""), "{err}");
    let (code, _, err) = check(format!(
        "  dcgmExporter:\n    config: {}\n",
        dir.path().join("missing.csv").display()
    ));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("missing.csv"), "{err}");
    let (code, out, err) = check(format!(
        "  dcgmExporter:\n    config: {}\n",
        counters.display()
    ));
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("warning: counters file: not exported: ") && out.contains("c.csv:2:"),
        "{out}"
    );
}

/// mig-parted's own configs and the operator's default layouts ConfigMap
/// (its `config.yaml`), unchanged, as `spec.migManager.config.file`:
/// `policy check` takes each with every layout it names selected in turn,
/// and plans on a MIG node where the GPU model has the profiles.
#[test]
fn mig_parted_configs_upstream_ships_are_taken() {
    let up = upstream();
    let dir = tempfile::tempdir().unwrap();
    let mut files: Vec<PathBuf> = std::fs::read_dir(up.join("mig-parted"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    // The operator's ConfigMap: its `config.yaml` is a mig-parted file.
    let cm: serde_yaml_ng::Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(up.join("gpu-operator/state-mig-manager_0400_configmap.yaml"))
            .unwrap(),
    )
    .unwrap();
    let from_cm = dir.path().join("default-mig-parted-config.yaml");
    std::fs::write(&from_cm, cm["data"]["config.yaml"].as_str().unwrap()).unwrap();
    files.push(from_cm);
    assert!(files.len() >= 4, "{files:?}");
    for file in files {
        let doc: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        let layouts: Vec<String> = doc["mig-configs"]
            .as_mapping()
            .unwrap()
            .keys()
            .map(|k| k.as_str().unwrap().to_string())
            .collect();
        assert!(!layouts.is_empty(), "{}", file.display());
        for layout in &layouts {
            let p = dir.path().join("policy.yaml");
            std::fs::write(
                &p,
                format!(
                    "spec:\n  migManager:\n    default: {layout}\n    config:\n      file: {}\n",
                    file.display()
                ),
            )
            .unwrap();
            let (code, out, err) = run(bin().args(["policy", "check"]).arg(&p));
            assert_eq!(code, 0, "{} {layout}: {out}{err}", file.display());
            assert!(
                !out.contains("warning"),
                "{} {layout}: {out}",
                file.display()
            );
        }
    }
}

/// Every layout name of the operator's default layouts ConfigMap selects a
/// layout of gpu-agent's built-in ones, with no file mounted: `policy
/// check` takes each without a warning or a note (a name missing from the
/// built-in file is named). That they plan the same MIG devices as the
/// operator's file on every GPU each is for is
/// `mig::tests::every_operator_layout_plans_as_the_operators_file_does_on_every_gpu_it_is_for`.
#[test]
fn every_operator_layout_name_is_built_in() {
    let cm: serde_yaml_ng::Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(
            upstream().join("gpu-operator/state-mig-manager_0400_configmap.yaml"),
        )
        .unwrap(),
    )
    .unwrap();
    let doc: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(cm["data"]["config.yaml"].as_str().unwrap()).unwrap();
    let names: Vec<&str> = doc["mig-configs"]
        .as_mapping()
        .unwrap()
        .keys()
        .map(|k| k.as_str().unwrap())
        .collect();
    assert_eq!(names.len(), 81);
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("policy.yaml");
    for name in names {
        std::fs::write(&p, format!("spec:\n  migManager:\n    default: {name}\n")).unwrap();
        let (code, out, err) = run(bin().args(["policy", "check"]).arg(&p));
        assert_eq!(code, 0, "{name}: {out}{err}");
        assert!(
            !out.contains("warning") && !out.contains("note: layout"),
            "{name}: {out}"
        );
    }
    // A name the built-in file lacks is named: derived at run time when it
    // is one of the generic names, else a warning.
    std::fs::write(&p, "spec:\n  migManager:\n    default: all-1g.12gb.gfx\n").unwrap();
    let (code, out, _) = run(bin().args(["policy", "check"]).arg(&p));
    assert_eq!(code, 0);
    assert!(out.contains("note: layout \"all-1g.12gb.gfx\" is not in gpu-agent's built-in MIG config: each GPU gets it derived from the MIG profiles NVML lists for it"), "{out}");
    std::fs::write(&p, "spec:\n  migManager:\n    default: my-layout\n").unwrap();
    let (code, out, _) = run(bin().args(["policy", "check"]).arg(&p));
    assert_eq!(code, 0);
    assert!(out.contains("warning: gpu-agent's built-in MIG config: spec.migManager.default: no layout named \"my-layout\""), "{out}");
}

/// The operator's CRD sample ClusterPolicy, unchanged, as the cluster's
/// policy: taken, every key gpu-agent does not use named, none fatal.
#[test]
fn the_operators_sample_cluster_policy_is_taken() {
    let path = upstream().join("gpu-operator/v1_clusterpolicy.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let (p, ignored) = gpu_agent::policy::Policy::from_cluster_yaml(&text, "v1_clusterpolicy.yaml")
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(p.device_plugin.enabled);
    assert!(!ignored.is_empty());
    assert!(
        ignored.iter().all(|k| k.starts_with("spec.")),
        "{ignored:?}"
    );
}

/// docs/migrating-from-gpu-operator.md's table names every upstream file
/// the conformance suite has (a file added to ../shared/upstream that the
/// table does not name fails here).
#[test]
fn every_upstream_file_is_in_the_migration_table() {
    let doc = std::fs::read_to_string(common::repo().join("docs/migrating-from-gpu-operator.md"))
        .unwrap();
    let up = upstream();
    for dir in std::fs::read_dir(&up).unwrap() {
        let dir = dir.unwrap().path();
        if !dir.is_dir() {
            continue;
        }
        for f in std::fs::read_dir(&dir).unwrap() {
            let f = f.unwrap().path();
            let rel = f.strip_prefix(&up).unwrap().display().to_string();
            assert!(
                doc.contains(&format!("| `{rel}` |")),
                "{rel} is not in docs/migrating-from-gpu-operator.md's table"
            );
        }
    }
}
