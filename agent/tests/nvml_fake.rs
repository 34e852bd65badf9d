//! The real NVML backend (nvml-wrapper) against the project's fake
//! libnvidia-ml, through the real CLI: the same inventory as the simulated
//! backend for the same node description, and "not supported" answered
//! honestly.

mod common;

use common::*;
use serde_json::Value;

/// `inventory --output json` with NVML from the fake library serving `node`,
/// reading sysfs from `host_root`.
fn nvml_inventory(node: &str, host_root: &std::path::Path) -> (i32, Value, String) {
    let (_dir, lib) = fake_nvml();
    let (code, out, err) = run(at(host_root)
        .arg("--nvml-lib")
        .arg(&lib)
        .args(["inventory", "--output", "json"])
        .env("FAKE_NVML_NODE", node));
    (code, if code == 0 { json(&out) } else { Value::Null }, err)
}

fn simulated_inventory(node: &str) -> Value {
    let (code, out, err) = run(bin().args(["--simulate", node, "inventory", "--output", "json"]));
    assert_eq!(code, 0, "{err}");
    json(&out)
}

/// Everything but the backend's own name must match.
fn assert_same_inventory(node: &str, host_root: &std::path::Path) {
    let (code, mut nvml, err) = nvml_inventory(node, host_root);
    assert_eq!(code, 0, "{err}");
    let mut sim = simulated_inventory(node);
    assert_eq!(nvml["backend"]["name"], "nvml");
    assert_eq!(sim["backend"]["name"], "simulated");
    nvml["backend"]["name"] = Value::Null;
    sim["backend"]["name"] = Value::Null;
    assert_eq!(nvml, sim, "{node}: NVML and simulated inventories differ");
}

#[test]
fn h100_same_inventory_through_nvml_and_simulation() {
    assert_same_inventory("h100-sxm-8", &host_fixture("h100-sxm-8"));
    let (_, inv, _) = nvml_inventory("h100-sxm-8", &host_fixture("h100-sxm-8"));
    let gpus = inv["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 8);
    assert_eq!(gpus[3]["index"], 3);
    assert_eq!(gpus[3]["numa_node"], 0);
    assert_eq!(gpus[5]["numa_node"], 1);
    assert_eq!(gpus[3]["uuid"], "GPU-4e8a2b3c-9d1e-4f7a-b2c4-3c4d5e6f7a04");
    assert_eq!(gpus[3]["model"], "NVIDIA H100 80GB HBM3");
    assert_eq!(gpus[3]["memory_mib"], 81559);
    assert_eq!(
        gpus[3]["compute_capability"],
        serde_json::json!({"major": 9, "minor": 0})
    );
    assert_eq!(
        gpus[3]["mig"],
        serde_json::json!({"current": false, "pending": false})
    );
    assert_eq!(gpus[3]["nvlinks"], 18);
    assert_eq!(gpus[3]["telemetry"]["temperature_c"], 34);
    // 28 pairs, each with 18 NVLinks through the NVSwitches.
    let pairs = inv["pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), 28);
    assert!(pairs.iter().all(|p| p["nvlinks"] == 18));
    assert_eq!(inv["backend"]["driver_version"], "550.127.08");
    assert_eq!(
        inv["cuda_version"],
        serde_json::json!({"major": 12, "minor": 4})
    );
    assert_eq!(inv["warnings"], serde_json::json!([]));
}

#[test]
fn a10g_same_inventory_and_unsupported_is_absent_not_invented() {
    assert_same_inventory("a10g-1", &host_fixture("a10g-1"));
    let (_, inv, _) = nvml_inventory("a10g-1", &host_fixture("a10g-1"));
    let g = &inv["gpus"][0];
    // The fake answers NOT_SUPPORTED for MIG and NVLink on an A10G.
    assert_eq!(g["mig"], Value::Null);
    assert_eq!(g["nvlinks"], 0);
    // g5.xlarge reports no NUMA affinity (sysfs says -1).
    assert!(g.as_object().unwrap().contains_key("numa_node"));
    assert_eq!(g["numa_node"], Value::Null);
    assert_eq!(g["pci"]["iommu_group"], 6);
}

#[test]
fn t4_same_inventory_with_pcie_topology() {
    let dir = tempfile::tempdir().unwrap();
    simnode::NodeDescription::load("t4-4")
        .unwrap()
        .materialize(dir.path())
        .unwrap();
    assert_same_inventory("t4-4", dir.path());
    let (_, inv, _) = nvml_inventory("t4-4", dir.path());
    let level = |a: u64, b: u64| {
        inv["pairs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["a"] == a && p["b"] == b)
            .map(|p| p["pcie"].clone())
            .unwrap()
    };
    assert_eq!(level(0, 1), "single-switch");
    assert_eq!(level(2, 3), "single-switch");
    assert_eq!(level(0, 2), "cross-numa");
}

#[test]
fn readings_the_description_leaves_out_are_not_supported() {
    // A node whose GPU has no telemetry: the fake answers NOT_SUPPORTED and
    // the inventory leaves the readings out.
    let dir = tempfile::tempdir().unwrap();
    let desc_path = dir.path().join("bare.yaml");
    std::fs::write(
        &desc_path,
        "name: bare\ndriver: {version: 535.1.2, cudaVersion: \"12.2\"}\ngpus:\n  - busId: \"0000:05:00.0\"\n    name: Tesla T4\n    uuid: GPU-00000000-0000-0000-0000-000000000001\n    deviceId: 0x1eb8\n    memoryMib: 15360\n    computeCapability: \"7.5\"\n",
    )
    .unwrap();
    let root = dir.path().join("root");
    simnode::NodeDescription::from_file(&desc_path)
        .unwrap()
        .materialize(&root)
        .unwrap();
    let (code, inv, err) = nvml_inventory(desc_path.to_str().unwrap(), &root);
    assert_eq!(code, 0, "{err}");
    let t = &inv["gpus"][0]["telemetry"];
    assert_eq!(t["temperature_c"], Value::Null);
    assert_eq!(t["power_mw"], Value::Null);
    assert_eq!(t["utilization_gpu_pct"], Value::Null);
    assert_eq!(t["memory_used_mib"], 0);
}

#[test]
fn without_a_driver_nvml_says_so_and_sysfs_gpus_are_still_listed() {
    // FAKE_NVML_NODE unset: the fake behaves like a node without the driver.
    let (_dir, lib) = fake_nvml();
    let (code, out, err) = run(at(host_fixture("a10g-1"))
        .arg("--nvml-lib")
        .arg(&lib)
        .args(["inventory", "--output", "json"])
        .env_remove("FAKE_NVML_NODE"));
    assert_eq!(code, 0, "{err}");
    let inv = json(&out);
    assert!(
        inv["backend"]["error"]
            .as_str()
            .unwrap()
            .contains("driver is not loaded"),
        "{}",
        inv["backend"]
    );
    assert_eq!(
        inv["gpus"][0]["uuid"],
        "GPU-3f6e1b2a-8c4d-4b7e-9a15-6d2c8e0f4a11"
    );
    assert_eq!(inv["gpus"][0]["index"], Value::Null);
}

#[test]
fn mig_devices_same_through_nvml_and_simulation() {
    let dir = tempfile::tempdir().unwrap();
    let desc = simnode::NodeDescription::load("h100-mig-2").unwrap();
    desc.materialize(dir.path()).unwrap();
    assert_same_inventory("h100-mig-2", dir.path());
    let (_, inv, _) = nvml_inventory("h100-mig-2", dir.path());
    let migs = inv["gpus"][0]["mig_devices"].as_array().unwrap();
    let profiles: Vec<&str> = migs
        .iter()
        .map(|m| m["profile"].as_str().unwrap())
        .collect();
    // gpu-agent's names from NVML's attributes match the description's.
    let described: Vec<&str> = desc.gpus[0]
        .mig
        .devices
        .iter()
        .map(|m| m.profile.as_deref().unwrap())
        .collect();
    assert_eq!(profiles, described);
    assert_eq!(profiles, ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]);
    assert_eq!(inv["gpus"][1]["mig_devices"].as_array().unwrap().len(), 7);
    assert_eq!(migs[0]["uuid"], desc.gpus[0].mig.devices[0].uuid);
    // Engine counts come through nvmlDeviceGetAttributes (an H100's 3g).
    assert_eq!(
        migs[0]["engines"],
        serde_json::json!({"copy": 3, "decoder": 3, "encoder": 0, "jpeg": 3, "ofa": 0})
    );
    // The labels of the mixed strategy, through the real NVML path, are the
    // golden file's.
    let policy = dir.path().join("mixed.yaml");
    std::fs::write(&policy, "spec:\n  mig:\n    strategy: mixed\n").unwrap();
    let (_lib_dir, lib) = fake_nvml();
    let (code, out, err) = run(at(dir.path())
        .arg("--nvml-lib")
        .arg(&lib)
        .arg("--policy")
        .arg(&policy)
        .arg("labels")
        .env("FAKE_NVML_NODE", "h100-mig-2"));
    assert_eq!(code, 0, "{err}");
    let golden = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/golden/labels/mig-mixed.txt"
    ))
    .unwrap();
    assert_eq!(out, golden);
}
