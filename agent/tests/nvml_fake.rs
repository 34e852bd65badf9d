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
    // nvmlDeviceGetBrand / nvmlDeviceGetArchitecture in NVIDIA's DRA
    // driver's spellings; the root from the fixture's sysfs link.
    assert_eq!(gpus[3]["brand"], "Nvidia");
    assert_eq!(gpus[3]["architecture"], "Hopper");
    assert_eq!(gpus[3]["pcie_root"], "pci0000:00");
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
    assert_eq!(
        (&g["brand"], &g["architecture"]),
        (&"Nvidia".into(), &"Ampere".into())
    );
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
    // NVML says NVML_BRAND_TESLA for a T4, NVIDIA's DRA driver "Tesla".
    let g = &inv["gpus"][0];
    assert_eq!(
        (&g["brand"], &g["architecture"]),
        (&"Tesla".into(), &"Turing".into())
    );
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
        "/../crates/gpu-labels/tests/golden/labels/mig-mixed.txt"
    ))
    .unwrap();
    assert_eq!(out, golden);
}

// --- MIG through nvml-wrapper and the raw NVML API ------------------------------
//
// These drive the fake directly, as the agent's MIG stage will. The library
// keeps one state per process and reads its environment there, so each
// scenario runs in a process of its own: the test re-runs this test binary
// for just itself with `GPU_AGENT_NVML_CHILD=<test>:<phase>` set, and the
// child does the work.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;
use simnode::mig::gi_index;
use simnode::mig::state::{NodeMig, mig_uuid};

const CHILD: &str = "GPU_AGENT_NVML_CHILD";

/// In a child process: the phase it runs for `test`.
fn phase(test: &str) -> Option<String> {
    std::env::var(CHILD)
        .ok()?
        .strip_prefix(&format!("{test}:"))
        .map(String::from)
}

/// Runs `phase` of `test` in a fresh process of this binary with `envs`
/// (and the environment of this process); it must pass.
fn run_phase(test: &str, phase: &str, envs: &[(&str, &OsStr)]) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, format!("{test}:{phase}"))
        .envs(envs.iter().copied())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("test result: ok. 1 passed"),
        "{test} ({phase}) in its own process:\n{stdout}\n{stderr}"
    );
}

fn open(lib: &Path) -> Nvml {
    Nvml::builder().lib_path(lib.as_os_str()).init().unwrap()
}

/// NVML calls nvml-wrapper 0.13 does not wrap (or wraps wrongly: its
/// `possible_placements` never sets the vector's length), through
/// nvml-wrapper-sys. Errors are the raw `nvmlReturn_t`.
#[allow(unsafe_code)]
mod raw {
    use nvml_wrapper::{Device, Nvml};
    use nvml_wrapper_sys::bindings::{
        nvmlComputeInstance_t, nvmlComputeInstanceProfileInfo_t, nvmlGpuInstance_t,
        nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_v2_t,
        nvmlReturn_t,
    };

    pub const SUCCESS: nvmlReturn_t = 0;
    pub const INVALID_ARGUMENT: nvmlReturn_t = 2;
    pub const NOT_SUPPORTED: nvmlReturn_t = 3;
    pub const IN_USE: nvmlReturn_t = 19;
    pub const RESET_REQUIRED: u32 = 16;
    pub const INSUFFICIENT_RESOURCES: nvmlReturn_t = 23;

    fn ok(r: nvmlReturn_t) -> Result<(), nvmlReturn_t> {
        if r == SUCCESS { Ok(()) } else { Err(r) }
    }

    /// `nvmlDeviceGetGpuInstancePossiblePlacements_v2`: asks the count, then the list.
    pub fn placements(
        nvml: &Nvml,
        dev: &Device<'_>,
        profile_id: u32,
    ) -> Result<Vec<(u32, u32)>, nvmlReturn_t> {
        let mut count = 0;
        // SAFETY: a live device handle; a null array asks for the count.
        ok(unsafe {
            nvml.lib().nvmlDeviceGetGpuInstancePossiblePlacements_v2(
                dev.handle(),
                profile_id,
                std::ptr::null_mut(),
                &mut count,
            )
        })?;
        let mut list = vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
        // SAFETY: `list` holds `count` placements.
        ok(unsafe {
            nvml.lib().nvmlDeviceGetGpuInstancePossiblePlacements_v2(
                dev.handle(),
                profile_id,
                list.as_mut_ptr(),
                &mut count,
            )
        })?;
        list.truncate(count as usize);
        Ok(list.iter().map(|p| (p.start, p.size)).collect())
    }

    pub fn remaining(nvml: &Nvml, dev: &Device<'_>, profile_id: u32) -> Result<u32, nvmlReturn_t> {
        let mut n = 0;
        // SAFETY: a live device handle and an out-pointer.
        ok(unsafe {
            nvml.lib()
                .nvmlDeviceGetGpuInstanceRemainingCapacity(dev.handle(), profile_id, &mut n)
        })?;
        Ok(n)
    }

    /// `nvmlDeviceGetGpuInstanceProfileInfoV` with a v2 struct.
    pub fn gi_profile_v(
        nvml: &Nvml,
        dev: &Device<'_>,
        index: u32,
    ) -> Result<nvmlGpuInstanceProfileInfo_v2_t, nvmlReturn_t> {
        // SAFETY: plain C data; all-zero is a valid value.
        let mut info: nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
        info.version = std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as u32 | (2 << 24);
        // SAFETY: a live device handle and a versioned out-struct.
        ok(unsafe {
            nvml.lib()
                .nvmlDeviceGetGpuInstanceProfileInfoV(dev.handle(), index, &mut info)
        })?;
        Ok(info)
    }

    pub fn create_gi(
        nvml: &Nvml,
        dev: &Device<'_>,
        profile_id: u32,
        placement: Option<(u32, u32)>,
    ) -> Result<nvmlGpuInstance_t, nvmlReturn_t> {
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: a live device handle and out-pointers.
        ok(unsafe {
            match placement {
                None => nvml
                    .lib()
                    .nvmlDeviceCreateGpuInstance(dev.handle(), profile_id, &mut gi),
                Some((start, size)) => nvml.lib().nvmlDeviceCreateGpuInstanceWithPlacement(
                    dev.handle(),
                    profile_id,
                    &nvmlGpuInstancePlacement_t { start, size },
                    &mut gi,
                ),
            }
        })?;
        Ok(gi)
    }

    pub fn gi_info(nvml: &Nvml, gi: nvmlGpuInstance_t) -> nvmlGpuInstanceInfo_t {
        // SAFETY: plain C data; all-zero is a valid value.
        let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: a GPU-instance handle from the library and an out-pointer.
        ok(unsafe { nvml.lib().nvmlGpuInstanceGetInfo(gi, &mut info) }).unwrap();
        info
    }

    /// The compute instance that takes all of a GPU instance of `slices`
    /// slices (profile `NVML_COMPUTE_INSTANCE_PROFILE_<slices>_SLICE`).
    pub fn create_full_ci(
        nvml: &Nvml,
        gi: nvmlGpuInstance_t,
        slices: u32,
    ) -> Result<nvmlComputeInstance_t, nvmlReturn_t> {
        let index = simnode::mig::ci_index::for_slices(slices).unwrap();
        // SAFETY: plain C data; all-zero is a valid value.
        let mut info: nvmlComputeInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: a GPU-instance handle from the library and an out-pointer.
        ok(unsafe {
            nvml.lib()
                .nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, index, 0, &mut info)
        })?;
        assert_eq!(info.sliceCount, slices);
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        // SAFETY: as above.
        ok(unsafe {
            nvml.lib()
                .nvmlGpuInstanceCreateComputeInstance(gi, info.id, &mut ci)
        })?;
        Ok(ci)
    }

    pub fn ci_by_id(
        nvml: &Nvml,
        gi: nvmlGpuInstance_t,
        id: u32,
    ) -> Result<nvmlComputeInstance_t, nvmlReturn_t> {
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        // SAFETY: a GPU-instance handle from the library and an out-pointer.
        ok(unsafe {
            nvml.lib()
                .nvmlGpuInstanceGetComputeInstanceById(gi, id, &mut ci)
        })?;
        Ok(ci)
    }

    pub fn destroy_ci(nvml: &Nvml, ci: nvmlComputeInstance_t) -> nvmlReturn_t {
        // SAFETY: a compute-instance handle from the library.
        unsafe { nvml.lib().nvmlComputeInstanceDestroy(ci) }
    }

    pub fn destroy_gi(nvml: &Nvml, gi: nvmlGpuInstance_t) -> nvmlReturn_t {
        // SAFETY: a GPU-instance handle from the library.
        unsafe { nvml.lib().nvmlGpuInstanceDestroy(gi) }
    }

    /// `nvmlDeviceGetGpuInstanceId` of a MIG device.
    pub fn gi_id(nvml: &Nvml, mig: &Device<'_>) -> u32 {
        let mut id = u32::MAX;
        // SAFETY: a live MIG device handle and an out-pointer.
        ok(unsafe { nvml.lib().nvmlDeviceGetGpuInstanceId(mig.handle(), &mut id) }).unwrap();
        id
    }
}

/// The C name field as a string.
fn c_name(name: &[std::ffi::c_char]) -> String {
    name.iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8 as char)
        .collect()
}

fn mode(dev: &nvml_wrapper::Device<'_>) -> (u32, u32) {
    let m = dev.mig_mode().unwrap();
    (m.current, m.pending)
}

#[test]
fn mig_layout_made_through_nvml_on_an_h100() {
    const TEST: &str = "mig_layout_made_through_nvml_on_an_h100";
    if phase(TEST).is_some() {
        return h100_layout_in_this_process();
    }
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("conditions");
    std::fs::write(&state, "").unwrap();
    run_phase(
        TEST,
        "main",
        &[
            ("FAKE_NVML_NODE", OsStr::new("h100-sxm-8")),
            ("FAKE_NVML_STATE", state.as_os_str()),
        ],
    );
}

fn h100_layout_in_this_process() {
    let state = PathBuf::from(std::env::var_os("FAKE_NVML_STATE").unwrap());
    let (_dir, lib) = fake_nvml();
    let nvml = open(&lib);
    let dev = nvml.device_by_index(0).unwrap();
    assert_eq!(mode(&dev), (0, 0));
    assert!(matches!(
        dev.mig_device_by_index(0),
        Err(NvmlError::NotFound)
    ));
    // Hopper: the mode changes at once (activation status SUCCESS).
    assert_eq!(dev.set_mig_mode(true).unwrap(), raw::SUCCESS);
    assert_eq!(mode(&dev), (1, 1));

    // The H100's profiles as NVIDIA lists them.
    let one = dev.profile_info(gi_index::SLICE_1).unwrap();
    assert_eq!(
        (
            one.id,
            one.slice_count,
            one.instance_count,
            one.memory_size_mb,
            one.multiprocessor_count
        ),
        (19, 1, 7, 9984, 16)
    );
    let three = dev.profile_info(gi_index::SLICE_3).unwrap();
    assert_eq!(
        (three.id, three.instance_count, three.memory_size_mb),
        (9, 2, 40448)
    );
    let seven = dev.profile_info(gi_index::SLICE_7).unwrap();
    assert_eq!(
        (seven.id, seven.copy_engine_count, seven.ofa_count),
        (0, 8, 1)
    );
    // The A30's 2g+me is not an H100 profile.
    assert!(matches!(
        dev.profile_info(gi_index::SLICE_2_REV1),
        Err(NvmlError::NotSupported)
    ));
    let rev2 = raw::gi_profile_v(&nvml, &dev, gi_index::SLICE_1_REV2).unwrap();
    assert_eq!(c_name(&rev2.name), "MIG 1g.20gb");
    assert_eq!(
        (rev2.id, rev2.memorySizeMB, rev2.instanceCount),
        (15, 20096, 4)
    );
    assert_eq!(raw::placements(&nvml, &dev, 9), Ok(vec![(0, 4), (4, 4)]));
    assert_eq!(
        raw::placements(&nvml, &dev, 15),
        Ok(vec![(0, 2), (2, 2), (4, 2), (6, 2)])
    );
    assert_eq!(raw::placements(&nvml, &dev, 19).unwrap().len(), 7);
    assert_eq!(raw::remaining(&nvml, &dev, 9), Ok(2));

    // 3g + 2g + 1g + 1g, NVML choosing the placements as the driver does.
    let mut gis = Vec::new();
    for (profile, slices) in [(9, 3), (14, 2), (19, 1), (19, 1)] {
        let gi = raw::create_gi(&nvml, &dev, profile, None).unwrap();
        raw::create_full_ci(&nvml, gi, slices).unwrap();
        gis.push(gi);
    }
    let placed: Vec<(u32, u32, u32, u32)> = gis
        .iter()
        .map(|gi| {
            let i = raw::gi_info(&nvml, *gi);
            (i.id, i.profileId, i.placement.start, i.placement.size)
        })
        .collect();
    assert_eq!(
        placed,
        [(2, 9, 4, 4), (3, 14, 0, 2), (9, 19, 2, 1), (10, 19, 3, 1)]
    );
    // Taken memory slices are refused; a start the profile lacks is invalid.
    assert_eq!(
        raw::create_gi(&nvml, &dev, 5, Some((0, 4))).err(),
        Some(raw::INSUFFICIENT_RESOURCES)
    );
    assert_eq!(
        raw::create_gi(&nvml, &dev, 19, Some((1, 1))).err(),
        Some(raw::INSUFFICIENT_RESOURCES)
    );
    assert_eq!(
        raw::create_gi(&nvml, &dev, 9, Some((2, 4))).err(),
        Some(raw::INVALID_ARGUMENT)
    );
    assert_eq!(raw::remaining(&nvml, &dev, 19), Ok(0));

    // The MIG devices, by GPU-instance ID, as the agent's discovery reads them.
    assert_eq!(dev.mig_device_count().unwrap(), 7);
    let gpu_uuid = dev.uuid().unwrap();
    let devices: Vec<(u32, String, u32, u64, u32)> = (0..4)
        .map(|k| {
            let m = dev.mig_device_by_index(k).unwrap();
            assert!(m.mig_is_mig_device_handle().unwrap());
            let a = m.attributes().unwrap();
            (
                raw::gi_id(&nvml, &m),
                m.uuid().unwrap(),
                a.gpu_instance_slice_count,
                a.memory_size_mb,
                a.multiprocessor_count,
            )
        })
        .collect();
    assert_eq!(
        devices,
        [
            (2, mig_uuid(&gpu_uuid, 2, 0), 3, 40448, 60),
            (3, mig_uuid(&gpu_uuid, 3, 0), 2, 20096, 32),
            (9, mig_uuid(&gpu_uuid, 9, 0), 1, 9984, 16),
            (10, mig_uuid(&gpu_uuid, 10, 0), 1, 9984, 16),
        ]
    );
    assert!(matches!(
        dev.mig_device_by_index(4),
        Err(NvmlError::NotFound)
    ));
    let first = dev.mig_device_by_index(0).unwrap();
    assert_eq!(first.memory_info().unwrap().total, 40448 * 1024 * 1024);
    assert_eq!(first.attributes().unwrap().shared_decoder_count, 3);

    // Processes: one on the whole GPU, one on the third MIG device.
    std::fs::write(
        &state,
        format!("0 process 4242\n{} process 4343\n", devices[2].1),
    )
    .unwrap();
    let procs: Vec<(u32, Option<u32>, Option<u32>)> = dev
        .running_compute_processes()
        .unwrap()
        .iter()
        .map(|p| (p.pid, p.gpu_instance_id, p.compute_instance_id))
        .collect();
    assert_eq!(procs, [(4242, None, None), (4343, Some(9), Some(0))]);
    // A GPU instance with a compute instance, and a compute instance with
    // a process, cannot go; MIG cannot be turned off under instances.
    assert_eq!(raw::destroy_gi(&nvml, gis[2]), raw::IN_USE);
    let ci = raw::ci_by_id(&nvml, gis[2], 0).unwrap();
    assert_eq!(raw::destroy_ci(&nvml, ci), raw::IN_USE);
    std::fs::write(&state, "").unwrap();
    assert_eq!(raw::destroy_ci(&nvml, ci), raw::SUCCESS);
    assert_eq!(raw::destroy_gi(&nvml, gis[2]), raw::SUCCESS);
    assert_eq!(raw::remaining(&nvml, &dev, 19), Ok(1));
    assert!(matches!(dev.set_mig_mode(false), Err(NvmlError::InUse)));
    assert_eq!(mode(&dev), (1, 1));
}

#[test]
fn a100_mig_mode_waits_for_the_sysfs_reset() {
    const TEST: &str = "a100_mig_mode_waits_for_the_sysfs_reset";
    if phase(TEST).is_some() {
        return a100_reset_in_this_process();
    }
    let dir = tempfile::tempdir().unwrap();
    simnode::NodeDescription::load("a100-h100-mixed")
        .unwrap()
        .materialize(dir.path())
        .unwrap();
    let state = dir.path().join("conditions");
    std::fs::write(&state, "").unwrap();
    let sys = dir.path().join("sys");
    run_phase(
        TEST,
        "main",
        &[
            ("FAKE_NVML_NODE", OsStr::new("a100-h100-mixed")),
            ("FAKE_NVML_SYSFS", sys.as_os_str()),
            ("FAKE_NVML_STATE", state.as_os_str()),
        ],
    );
}

fn a100_reset_in_this_process() {
    let sys = PathBuf::from(std::env::var_os("FAKE_NVML_SYSFS").unwrap());
    let state = PathBuf::from(std::env::var_os("FAKE_NVML_STATE").unwrap());
    let reset = |bus: &str| {
        std::fs::write(sys.join("bus/pci/devices").join(bus).join("reset"), "1").unwrap();
    };
    let (_dir, lib) = fake_nvml();
    let nvml = open(&lib);
    let a100 = nvml.device_by_index(0).unwrap();
    let other_a100 = nvml.device_by_index(1).unwrap();
    let h100 = nvml.device_by_index(2).unwrap();
    // Ampere: pending until the GPU is reset.
    assert_eq!(a100.set_mig_mode(true).unwrap(), raw::RESET_REQUIRED);
    assert_eq!(mode(&a100), (0, 1));
    assert_eq!(
        raw::create_gi(&nvml, &a100, 19, None).err(),
        Some(raw::NOT_SUPPORTED)
    );
    // Hopper beside it: at once.
    assert_eq!(h100.set_mig_mode(true).unwrap(), raw::SUCCESS);
    assert_eq!(mode(&h100), (1, 1));
    // The agent resets the A100 through its PCI function.
    reset("0000:07:00.0");
    assert_eq!(mode(&a100), (1, 1));
    assert_eq!(mode(&other_a100), (0, 0));
    // The A100 40GB's profiles; the driver puts a lone 1g at slice 6 (GI 13).
    let one = a100.profile_info(gi_index::SLICE_1).unwrap();
    assert_eq!(
        (one.id, one.memory_size_mb, one.multiprocessor_count),
        (19, 4864, 14)
    );
    let gi = raw::create_gi(&nvml, &a100, 19, None).unwrap();
    let info = raw::gi_info(&nvml, gi);
    assert_eq!(
        (info.id, info.placement.start, info.placement.size),
        (13, 6, 1)
    );
    assert_eq!(raw::remaining(&nvml, &a100, 19), Ok(6));
    // A reset takes every instance with it.
    reset("0000:07:00.0");
    assert_eq!(raw::remaining(&nvml, &a100, 19), Ok(7));
    assert_eq!(mode(&a100), (1, 1));

    // A GPU whose reset does not apply the mode (only a reboot would), and
    // one whose mode cannot be set while it is busy.
    let uuid1 = other_a100.uuid().unwrap();
    let uuid3 = nvml.device_by_index(3).unwrap().uuid().unwrap();
    std::fs::write(&state, format!("{uuid1} reset-ignored\n{uuid3} busy\n")).unwrap();
    assert_eq!(other_a100.set_mig_mode(true).unwrap(), raw::RESET_REQUIRED);
    reset("0000:0f:00.0");
    assert_eq!(mode(&other_a100), (0, 1));
    assert!(matches!(
        nvml.device_by_index(3).unwrap().set_mig_mode(true),
        Err(NvmlError::InUse)
    ));
}

#[test]
fn mig_layout_is_shared_through_fake_nvml_mig() {
    const TEST: &str = "mig_layout_is_shared_through_fake_nvml_mig";
    match phase(TEST).as_deref() {
        Some("make") => return shared_make(),
        Some("see") => return shared_see(TEST),
        Some("change") => return shared_change(),
        _ => {}
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("mig.json");
    let envs = [
        ("FAKE_NVML_NODE", OsStr::new("h100-sxm-8")),
        ("FAKE_NVML_MIG", file.as_os_str()),
    ];
    run_phase(TEST, "make", &envs);
    let state: NodeMig = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert!(state.gpus[1].current);
    assert_eq!(state.gpus[1].gpu_instances.len(), 1);
    // The agent's discovery, another process, sees the layout.
    let (_lib_dir, lib) = fake_nvml();
    let (code, out, err) = run(at(host_fixture("h100-sxm-8"))
        .arg("--nvml-lib")
        .arg(&lib)
        .args(["inventory", "--output", "json"])
        .envs(envs));
    assert_eq!(code, 0, "{err}");
    let inv = json(&out);
    let migs = inv["gpus"][1]["mig_devices"].as_array().unwrap();
    assert_eq!(migs.len(), 1);
    assert_eq!(migs[0]["profile"], "7g.80gb");
    assert_eq!(
        migs[0]["uuid"].as_str().unwrap(),
        mig_uuid(inv["gpus"][1]["uuid"].as_str().unwrap(), 0, 0)
    );
    assert_eq!(
        inv["gpus"][0]["mig"],
        serde_json::json!({"current": false, "pending": false})
    );
    run_phase(TEST, "see", &envs);
}

/// Makes a whole-GPU MIG device on GPU 1.
fn shared_make() {
    let (_dir, lib) = fake_nvml();
    let nvml = open(&lib);
    let dev = nvml.device_by_index(1).unwrap();
    dev.set_mig_mode(true).unwrap();
    let gi = raw::create_gi(&nvml, &dev, 0, None).unwrap();
    raw::create_full_ci(&nvml, gi, 7).unwrap();
}

/// Sees GPU 1's layout, then, still open, the one another process makes.
fn shared_see(test: &str) {
    let (_dir, lib) = fake_nvml();
    let nvml = open(&lib);
    let dev = nvml.device_by_index(1).unwrap();
    assert_eq!(mode(&dev), (1, 1));
    let uuid = dev.uuid().unwrap();
    assert_eq!(
        dev.mig_device_by_index(0).unwrap().uuid().unwrap(),
        mig_uuid(&uuid, 0, 0)
    );
    assert_eq!(raw::remaining(&nvml, &dev, 9), Ok(0));
    run_phase(test, "change", &[]);
    // This library reads the changed file on its next call.
    let names: Vec<(u32, u32)> = (0..2)
        .map(|k| {
            let m = dev.mig_device_by_index(k).unwrap();
            (
                raw::gi_id(&nvml, &m),
                m.attributes().unwrap().gpu_instance_slice_count,
            )
        })
        .collect();
    assert_eq!(names, [(1, 3), (2, 3)]);
}

/// Replaces GPU 1's 7g with two 3g.
fn shared_change() {
    let (_dir, lib) = fake_nvml();
    let nvml = open(&lib);
    let dev = nvml.device_by_index(1).unwrap();
    let mut gi = std::ptr::null_mut();
    #[allow(unsafe_code)]
    // SAFETY: a live device handle and an out-pointer.
    let found = unsafe {
        nvml.lib()
            .nvmlDeviceGetGpuInstanceById(dev.handle(), 0, &mut gi)
    };
    assert_eq!(found, raw::SUCCESS);
    let ci = raw::ci_by_id(&nvml, gi, 0).unwrap();
    assert_eq!(raw::destroy_ci(&nvml, ci), raw::SUCCESS);
    assert_eq!(raw::destroy_gi(&nvml, gi), raw::SUCCESS);
    for _ in 0..2 {
        let gi = raw::create_gi(&nvml, &dev, 9, None).unwrap();
        raw::create_full_ci(&nvml, gi, 3).unwrap();
    }
}

// --- What NVML calls cost -------------------------------------------------

/// The fake charges the per-call costs measured on a real H100
/// (tests/fake-nvml/costs/h100-pcie-vm.txt), or another table's. Lower
/// bounds only: a loaded machine makes calls slower, never faster.
#[test]
fn nvml_calls_take_as_long_as_on_a_real_h100() {
    const TEST: &str = "nvml_calls_take_as_long_as_on_a_real_h100";
    match phase(TEST).as_deref() {
        Some("built-in") => return costs_built_in(),
        Some("table") => return costs_from_a_table(),
        Some("bad-table") => return costs_from_a_bad_table(),
        _ => {}
    }
    let node = ("FAKE_NVML_NODE", OsStr::new("h100-sxm-8"));
    run_phase(
        TEST,
        "built-in",
        &[node, ("FAKE_NVML_COSTS", OsStr::new("on"))],
    );
    let dir = tempfile::tempdir().unwrap();
    let table = dir.path().join("costs.txt");
    std::fs::write(
        &table,
        "nvmlInit (first)  40 ms\nnvmlInit (again)  20 ms\nnvmlDeviceGetName  p50  30 ms  max 31 ms\nnvmlDeviceGetUUID  p50  1 us\n",
    )
    .unwrap();
    run_phase(
        TEST,
        "table",
        &[node, ("FAKE_NVML_COSTS", table.as_os_str())],
    );
    let bad = dir.path().join("bad.txt");
    std::fs::write(&bad, "nvmlDeviceGetName p50 soon\n").unwrap();
    run_phase(
        TEST,
        "bad-table",
        &[node, ("FAKE_NVML_COSTS", bad.as_os_str())],
    );
}

fn ms(n: f64) -> std::time::Duration {
    std::time::Duration::from_secs_f64(n / 1e3)
}

/// Times `f`.
fn timed<T>(f: impl FnOnce() -> T) -> (T, std::time::Duration) {
    let t = std::time::Instant::now();
    let out = f();
    (out, t.elapsed())
}

/// The built-in table: nvmlInit cold 10.7 ms, again 2.1 ms; the slow calls.
fn costs_built_in() {
    let (_dir, lib) = fake_nvml();
    let (nvml, cold) = timed(|| open(&lib));
    assert!(cold >= ms(10.7), "the first nvmlInit took {cold:?}");
    let (again, warm) = timed(|| open(&lib));
    assert!(warm >= ms(2.1), "nvmlInit again took {warm:?}");
    drop(again);
    let dev = nvml.device_by_index(0).unwrap();
    for (call, took, cost) in [
        (
            "nvmlDeviceGetMigMode",
            timed(|| dev.mig_mode().map(|_| ())).1,
            ms(0.1638),
        ),
        (
            "nvmlDeviceGetTotalEnergyConsumption",
            timed(|| dev.total_energy_consumption().map(|_| ())).1,
            ms(3.1812),
        ),
        (
            "nvmlDeviceGetPcieReplayCounter",
            timed(|| dev.pcie_replay_counter().map(|_| ())).1,
            ms(0.1734),
        ),
    ] {
        assert!(
            took >= cost,
            "{call} took {took:?}, the table says {cost:?}"
        );
    }
    // A field-values call costs its fields: clock-throttle time as the
    // violation-status call that gives it (741.2 µs), twice.
    let ids = [
        nvml_wrapper::structs::device::FieldId(
            nvml_wrapper_sys::bindings::field_id::NVML_FI_DEV_PERF_POLICY_POWER,
        ),
        nvml_wrapper::structs::device::FieldId(
            nvml_wrapper_sys::bindings::field_id::NVML_FI_DEV_PERF_POLICY_THERMAL,
        ),
    ];
    let (values, took) = timed(|| dev.field_values_for(&ids).unwrap());
    assert!(values.iter().all(|v| v.is_ok()), "{values:?}");
    assert!(
        took >= ms(2.0 * 0.7412),
        "two violation fields took {took:?}"
    );
    // Many cheap calls add up too (2-10 µs each on the H100).
    let (_, names) = timed(|| {
        for _ in 0..100 {
            dev.name().unwrap();
        }
    });
    assert!(names >= ms(0.32), "100 nvmlDeviceGetName took {names:?}");
}

/// A table named by FAKE_NVML_COSTS replaces the built-in one.
fn costs_from_a_table() {
    let (_dir, lib) = fake_nvml();
    let (nvml, cold) = timed(|| open(&lib));
    assert!(cold >= ms(40.0), "the first nvmlInit took {cold:?}");
    let dev = nvml.device_by_index(0).unwrap();
    let (name, took) = timed(|| dev.name().unwrap());
    assert_eq!(name, "NVIDIA H100 80GB HBM3");
    assert!(took >= ms(30.0), "nvmlDeviceGetName took {took:?}");
}

/// A table that cannot be read fails nvmlInit, never charges nothing quietly.
fn costs_from_a_bad_table() {
    let (_dir, lib) = fake_nvml();
    let Err(e) = Nvml::builder().lib_path(lib.as_os_str()).init() else {
        panic!("nvmlInit succeeded with an unreadable cost table");
    };
    assert!(matches!(e, NvmlError::Unknown), "{e:?}");
}

// --- Every field of dcgm-exporter's counters files ----------------------------

/// The node where each field has a GPU that gives it and one that does not.
fn every_field_node() -> PathBuf {
    repo().join("tests/fixtures/nodes/every-field.yaml")
}

/// dcgm-exporter's default-counters.csv with every `# DCGM_FI_` line
/// uncommented, read as the agent reads a counters file.
fn every_field() -> gpu_agent::metrics::fields::FieldSet {
    let path = repo().join("../shared/upstream/dcgm-exporter/default-counters.csv");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (CI has ../shared beside the checkout)",
            path.display()
        )
    });
    let uncommented: String = text
        .lines()
        .map(|l| match l.trim_start().strip_prefix('#') {
            Some(rest) if rest.trim_start().starts_with("DCGM_FI_") => rest.trim_start(),
            _ => l,
        })
        .map(|l| format!("{l}\n"))
        .collect();
    gpu_agent::metrics::fields::FieldSet::parse(&uncommented, "default-counters.csv").unwrap()
}

/// Every field of dcgm-exporter's default counters file, every line
/// uncommented, sampled through nvml-wrapper from the fake libnvidia-ml,
/// reads what the simulated backend reads for the same node (both tell
/// `simnode::readings`' story): the same fields present on each GPU and
/// GPU instance (NVLink counters only with NVLinks, GPM only on Hopper,
/// retired pages only before Ampere), the same values (growing counters:
/// present and growing), the same labels.
#[test]
fn every_dcgm_exporter_field_reads_the_same_through_nvml_as_simulated() {
    const TEST: &str = "every_dcgm_exporter_field_reads_the_same_through_nvml_as_simulated";
    if phase(TEST).as_deref() == Some("sample") {
        return every_field_through_nvml();
    }
    let node = every_field_node();
    run_phase(
        TEST,
        "sample",
        &[
            ("FAKE_NVML_NODE", node.as_os_str()),
            ("FAKE_NVML_COSTS", OsStr::new("off")),
        ],
    );
}

fn every_field_through_nvml() {
    use gpu_agent::backend::GpuBackend;
    use gpu_agent::metrics::fields::{Field as F, Kind};
    use std::collections::BTreeSet;
    let growing = [
        F::TotalEnergyConsumption,
        F::PcieReplayCounter,
        F::NvlinkBandwidthTotal,
        F::NvlinkBandwidthL0,
        F::PowerViolation,
        F::ThermalViolation,
        F::SyncBoostViolation,
        F::BoardLimitViolation,
        F::LowUtilViolation,
        F::ReliabilityViolation,
    ];
    let fields = every_field();
    let (_dir, lib) = fake_nvml();
    let backend = gpu_agent::backend::nvml::NvmlBackend::open(Some(&lib)).unwrap();
    let mut sampler = backend.sampler().unwrap();
    // GPM figures come from two samples a pass apart.
    let first = sampler.sample(&fields).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let got = sampler.sample(&fields).unwrap();
    let node = simnode::NodeDescription::load(every_field_node().to_str().unwrap()).unwrap();
    let sim = gpu_agent::backend::sim::SimulatedBackend::new(node)
        .sampler()
        .unwrap()
        .sample(&fields)
        .unwrap();
    assert_eq!(got.gpus.len(), sim.gpus.len());
    let keys = |v: &[(F, f64)]| v.iter().map(|(f, _)| *f).collect::<BTreeSet<_>>();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0);
    let mut given: BTreeSet<F> = BTreeSet::new();
    for (i, (g, s)) in got.gpus.iter().zip(&sim.gpus).enumerate() {
        assert_eq!(g.uuid, s.uuid);
        assert_eq!(keys(&g.values), keys(&s.values), "GPU {i}'s fields");
        for (f, x) in &g.values {
            let y = s.values.iter().find(|(h, _)| h == f).unwrap().1;
            if growing.contains(f) {
                let before = first.gpus[i].values.iter().find(|(h, _)| h == f).unwrap().1;
                assert!(
                    *x >= before && *x >= 0.0,
                    "GPU {i} {f:?}: {before} then {x}"
                );
            } else {
                assert!(close(*x, y), "GPU {i} {f:?}: NVML {x}, simulated {y}");
            }
            given.insert(*f);
        }
        assert_eq!(g.labels, s.labels, "GPU {i}'s labels");
        given.extend(g.labels.iter().map(|(f, _)| *f));
        assert_eq!(g.mig.len(), s.mig.len(), "GPU {i}'s MIG devices");
        for (m, n) in g.mig.iter().zip(&s.mig) {
            assert_eq!(
                (&m.uuid, m.gpu_instance_id, &m.profile),
                (&n.uuid, n.gpu_instance_id, &n.profile)
            );
            assert_eq!(keys(&m.values), keys(&n.values), "{}'s fields", m.uuid);
            for (f, x) in &m.values {
                let y = n.values.iter().find(|(h, _)| h == f).unwrap().1;
                assert!(close(*x, y), "{} {f:?}: NVML {x}, simulated {y}", m.uuid);
            }
            assert!(
                keys(&m.values).contains(&F::ProfSmActive),
                "{}: a GPU instance's own GPM",
                m.uuid
            );
        }
    }
    // The per-GPU NVLink, GPM and retired-page fields: on the GPUs that have them only.
    let has = |i: usize, f: F| got.gpus[i].values.iter().any(|(h, _)| *h == f);
    assert!(has(0, F::NvlinkCrcFlitErrorCountTotal) && !has(2, F::NvlinkCrcFlitErrorCountTotal));
    assert!(has(0, F::ProfPipeFp64Active) && !has(2, F::ProfPipeFp64Active));
    assert!(has(2, F::RetiredSbe) && !has(0, F::RetiredSbe));
    // Every field the file asks for is given by some GPU, but the two the
    // sampler does not read: XID errors (from health events) and the driver
    // version (from the inventory).
    let missing: Vec<&F> = fields
        .fields
        .iter()
        .filter(|f| !given.contains(f) && !matches!(f, F::XidErrors | F::DriverVersion))
        .collect();
    assert!(missing.is_empty(), "never given: {missing:?}");
    assert!(
        fields
            .fields
            .iter()
            .any(|f| f.info().kind == Kind::Label && *f != F::DriverVersion)
    );
}

// --- GPU fabric (nvidia.com/gpu.clique) and vGPU (nvidia.com/vgpu.*) ----------

fn gb200_node() -> PathBuf {
    repo().join("tests/fixtures/nodes/gb200-nvl-4.yaml")
}

/// `labels --output json` on `host_root` with the fake NVML serving `node`.
fn nvml_labels(node: &OsStr, host_root: &Path) -> serde_json::Map<String, Value> {
    let (_dir, lib) = fake_nvml();
    let (code, out, err) = run(at(host_root)
        .arg("--nvml-lib")
        .arg(&lib)
        .args(["labels", "--output", "json"])
        .env("FAKE_NVML_NODE", node));
    assert_eq!(code, 0, "{err}");
    json(&out).as_object().unwrap().clone()
}

/// A GB200-like tray: every GPU's fabric info comes through
/// nvmlDeviceGetGpuFabricInfoV as the simulated backend reads the
/// description, and the node is labelled with its clique, as GFD labels it.
/// PCIe and HGX GPUs answer "not supported": no fabric, no clique.
#[test]
fn fabric_clique_through_nvml_and_simulation() {
    let dir = tempfile::tempdir().unwrap();
    let node = gb200_node();
    simnode::NodeDescription::load(node.to_str().unwrap())
        .unwrap()
        .materialize(dir.path())
        .unwrap();
    assert_same_inventory(node.to_str().unwrap(), dir.path());
    let (_, inv, _) = nvml_inventory(node.to_str().unwrap(), dir.path());
    assert_eq!(
        inv["gpus"][2]["fabric"],
        serde_json::json!({"clusterUuid": "5f8c2d1e-7a3b-4c9d-8e6f-0a1b2c3d4e5f", "cliqueId": 32766, "state": "completed", "status": 0})
    );
    let labels = nvml_labels(node.as_os_str(), dir.path());
    assert_eq!(
        labels["nvidia.com/gpu.clique"],
        "5f8c2d1e-7a3b-4c9d-8e6f-0a1b2c3d4e5f.32766"
    );
    assert_eq!(labels["nvidia.com/gpu.family"], "blackwell");
    assert_eq!(labels["nvidia.com/vgpu.present"], "false");
    for (name, host) in [
        ("h100-sxm-8", host_fixture("h100-sxm-8")),
        ("a10g-1", host_fixture("a10g-1")),
    ] {
        let (_, inv, _) = nvml_inventory(name, &host);
        assert!(
            inv["gpus"]
                .as_array()
                .unwrap()
                .iter()
                .all(|g| g.get("fabric").is_none()),
            "{name}: {inv:#}"
        );
        let labels = nvml_labels(OsStr::new(name), &host);
        assert!(!labels.contains_key("nvidia.com/gpu.clique"), "{name}");
    }
}

/// The fake's fabric calls as NVML's header defines them: both struct
/// versions of `…InfoV`, the unversioned call, a version it does not know,
/// "not supported" for a GPU without a fabric; each in its own process.
#[test]
fn fabric_info_calls_answer_as_nvml_defines_them() {
    if phase("fabric_info_calls_answer_as_nvml_defines_them").is_some() {
        return fabric_calls_in_this_process();
    }
    let node = gb200_node();
    run_phase(
        "fabric_info_calls_answer_as_nvml_defines_them",
        "run",
        &[
            ("FAKE_NVML_NODE", node.as_os_str()),
            ("FAKE_NVML_COSTS", OsStr::new("off")),
        ],
    );
}

#[allow(unsafe_code)]
fn fabric_calls_in_this_process() {
    use nvml_wrapper_sys::bindings::{
        nvmlGpuFabricInfo_t, nvmlGpuFabricInfo_v2_t, nvmlGpuFabricInfo_v3_t,
    };
    let (_dir, lib) = fake_nvml();
    let nvml = open(&lib);
    let v = |size: usize, n: u32| size as u32 | (n << 24);
    let v2 = v(size_of::<nvmlGpuFabricInfo_v2_t>(), 2);
    let v3 = v(size_of::<nvmlGpuFabricInfo_v3_t>(), 3);
    let uuid = [
        0x5f, 0x8c, 0x2d, 0x1e, 0x7a, 0x3b, 0x4c, 0x9d, 0x8e, 0x6f, 0x0a, 0x1b, 0x2c, 0x3d, 0x4e,
        0x5f,
    ];
    let dev = nvml.device_by_index(1).unwrap();
    // Version 3: health mask and summary of a healthy fabric.
    // SAFETY: plain data; all-zero is valid.
    let mut info: nvmlGpuFabricInfo_v3_t = unsafe { std::mem::zeroed() };
    info.version = v3;
    // SAFETY: a live handle; `info` is the struct the version names.
    let rc = unsafe {
        nvml.lib()
            .nvmlDeviceGetGpuFabricInfoV(dev.handle(), &mut info)
    };
    assert_eq!(rc, 0);
    assert_eq!(
        (info.clusterUuid, info.status, info.cliqueId, info.state),
        (uuid, 0, 32766, 3)
    );
    assert_eq!((info.healthMask, info.healthSummary), (426, 1));
    // Version 2 fills only a v2 struct's fields.
    // SAFETY: as above.
    let mut info: nvmlGpuFabricInfo_v3_t = unsafe { std::mem::zeroed() };
    info.version = v2;
    info.healthSummary = 0xee;
    // SAFETY: as above; a v3 struct is larger than the v2 the call fills.
    let rc = unsafe {
        nvml.lib()
            .nvmlDeviceGetGpuFabricInfoV(dev.handle(), &mut info)
    };
    assert_eq!(rc, 0);
    assert_eq!(
        (info.cliqueId, info.state, info.healthMask),
        (32766, 3, 426)
    );
    assert_eq!(info.healthSummary, 0xee, "v2 has no healthSummary");
    // A version NVML does not define.
    info.version = v(size_of::<nvmlGpuFabricInfo_v3_t>(), 9);
    // SAFETY: as above.
    let rc = unsafe {
        nvml.lib()
            .nvmlDeviceGetGpuFabricInfoV(dev.handle(), &mut info)
    };
    assert_eq!(rc, 25, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH");
    // The unversioned call of older libraries.
    // SAFETY: as above.
    let mut old: nvmlGpuFabricInfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: a live handle; `old` is the struct the call takes.
    let rc = unsafe {
        nvml.lib()
            .nvmlDeviceGetGpuFabricInfo(dev.handle(), &mut old)
    };
    assert_eq!(rc, 0);
    assert_eq!((old.clusterUuid, old.cliqueId, old.state), (uuid, 32766, 3));
}

/// A vGPU guest: the GPU's configuration space (written from the
/// description's `vgpu`) carries NVIDIA's vGPU capability, read through the
/// host root while NVML describes the GPU: `vgpu.present=true` and the
/// host's driver, as GFD labels a vGPU guest.
#[test]
fn a_vgpu_guest_is_labelled_from_its_pci_config_space() {
    let dir = tempfile::tempdir().unwrap();
    let text = include_str!("../../simnode/nodes/a10g-1.yaml").replace(
        "    computeCapability:",
        "    vgpu: { hostDriverVersion: 550.144.02, hostDriverBranch: r550_00 }\n    computeCapability:",
    );
    let node = dir.path().join("vgpu-node.yaml");
    std::fs::write(&node, &text).unwrap();
    let host = dir.path().join("host");
    simnode::NodeDescription::load(node.to_str().unwrap())
        .unwrap()
        .materialize(&host)
        .unwrap();
    let labels = nvml_labels(node.as_os_str(), &host);
    assert_eq!(labels["nvidia.com/vgpu.present"], "true");
    assert_eq!(labels["nvidia.com/vgpu.host-driver-version"], "550.144.02");
    assert_eq!(labels["nvidia.com/vgpu.host-driver-branch"], "r550_00");
    // The physical A10G of the committed fixture tree.
    let labels = nvml_labels(OsStr::new("a10g-1"), &host_fixture("a10g-1"));
    assert_eq!(labels["nvidia.com/vgpu.present"], "false");
    assert!(!labels.contains_key("nvidia.com/vgpu.host-driver-version"));
}
