//! MPS sharing of a DRA claim end to end on the node: gpu-dra's claims
//! prepared with the agent's own MPS port (`supervisor::dra_mps`), which
//! runs the host's `nvidia-cuda-mps-control` through the agent binary's
//! `host-exec`, chrooted into a copy of the 8x H100 host fixture, in a
//! mount namespace whose `/dev/shm` is the claim's shm directory. The
//! control program is the stand-in agent/tests/mps.rs uses
//! (tests/interop/mps_control_standin.rs, compiled statically): it serves
//! the pipe directory and records what it gets. The GPUs are the simulated
//! backend's (it keeps compute modes). Checked: the claim's daemon started
//! with its own pipe, log and shm directories and only the claim's GPUs
//! visible; the exact commands its mpsConfig makes; EXCLUSIVE_PROCESS on
//! the claim's GPUs only; the claim's CDI spec with NVIDIA's env and
//! mounts; a killed daemon started again; unprepare sends `quit`, puts the
//! GPUs back to DEFAULT and removes the claim's directories and spec.
//! A claim of MIG devices (the simulated `h100-mig-2`) with `multiUser`:
//! the daemon started with `-M`, its visible devices the MIG devices'
//! UUIDs, and no compute mode changed.
//!
//! The daemon runs in a mount namespace of its own, chrooted: root only.
//! Beside it, `gpu-agent run` with DRA on says in `status` whether claims
//! can have MPS here (on the real NVML path and on a simulated node).

mod common;

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_agent::backend::ComputeMode;
use gpu_agent::supervisor::dra_mps::{DraMps, DraMpsSetup};
use gpu_dra::claim::{ClaimRef, Claims};
use gpu_dra::claims::{
    AllocatedDevice, ClaimAllocation, ConfigSource, MemoryAllocations, NodeClaims, OpaqueConfig,
};
use gpu_model::cdi::Spec;

const UID: &str = "5f1d8a3c-7b2e-4c9d-8e6f-0a1b2c3d4e5f";
const NODE: &str = "node-a";

fn claim_dir(host: &Path) -> PathBuf {
    host.join(format!("run/nvidia/mps/dra-claim-{UID}"))
}

/// The stand-in's record, line by line.
fn control_log(host: &Path) -> Vec<String> {
    fs::read_to_string(claim_dir(host).join("log/control.log"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

fn starts(log: &[String]) -> Vec<String> {
    log.iter()
        .filter_map(|l| l.strip_prefix("start "))
        .map(str::to_string)
        .collect()
}

fn field(start: &str, key: &str) -> String {
    start
        .split(' ')
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .unwrap_or_default()
        .to_string()
}

fn until<T>(secs: u64, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within {secs} s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
#[ignore = "needs root (the daemon runs in its own mount namespace, chrooted into the host root); scripts/test runs it as root"]
fn a_claims_mps_daemon_is_run_configured_restarted_and_quit() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "run as root (scripts/test does)"
    );
    let host_dir = common::copy_host_fixture("h100-sxm-8");
    let host = host_dir.path().to_path_buf();
    fs::create_dir_all(host.join("usr/bin")).unwrap();
    fs::create_dir_all(host.join("dev/shm")).unwrap();
    common::build_static_standin(
        "mps_control_standin.rs",
        &host.join("usr/bin/nvidia-cuda-mps-control"),
    );
    // The simulated H100s: their inventory and compute modes.
    let node = common::dra::sim_node(
        &host,
        "h100-sxm-8",
        NODE,
        "6a0f3c1e-0000-4000-8000-000000000001",
    );
    let gpus = node.gpus();
    node.write_node_spec(&gpus);
    let common::dra::SimNode {
        root,
        inv,
        backend,
        opts,
    } = node;
    let (gpu0, gpu1, gpu2) = (gpus[0].1.clone(), gpus[1].1.clone(), gpus[2].1.clone());

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mps = rt.block_on(async {
        DraMps::start(
            DraMpsSetup {
                host: root.clone(),
                spawner: Arc::new(hostlib::process::HostSpawner::new(
                    env!("CARGO_BIN_EXE_gpu-agent"),
                    root.clone(),
                )),
                backend: backend.clone(),
                root: "/run/nvidia/mps".into(),
                missing_caps: Vec::new(),
            },
            None,
        )
    });
    let allocs = Arc::new(MemoryAllocations::new());
    let claims = NodeClaims::open_with_mps(
        root.clone(),
        opts.clone(),
        allocs.clone(),
        &inv,
        Some(mps.port()),
    )
    .unwrap();
    allocs.insert(
        UID,
        ClaimAllocation {
            namespace: "ns".into(),
            name: "shared".into(),
            devices: ["gpu-0", "gpu-1"]
                .iter()
                .map(|d| AllocatedDevice {
                    request: "gpu".into(),
                    pool: NODE.into(),
                    device: d.to_string(),
                    share_id: None,
                })
                .collect(),
            configs: vec![OpaqueConfig {
                source: ConfigSource::FromClaim,
                requests: Vec::new(),
                parameters: serde_json::json!({
                    "apiVersion": "resource.nvidia.com/v1beta1",
                    "kind": "GpuConfig",
                    "sharing": {"strategy": "MPS", "mpsConfig": {
                        "defaultActiveThreadPercentage": 40,
                        "defaultPinnedDeviceMemoryLimit": "8Gi",
                        "defaultPerDevicePinnedMemoryLimit": {"1": "2Gi"},
                    }},
                }),
            }],
        },
    );
    let claim = ClaimRef {
        namespace: "ns".into(),
        uid: UID.into(),
        name: "shared".into(),
    };

    // Prepare (the kubelet's calls run off the async threads).
    let prepared = claims.prepare(std::slice::from_ref(&claim));
    let devices = prepared[UID].as_ref().expect("prepared");
    assert_eq!(devices.len(), 2);

    // The daemon: only the claim's GPUs, chrooted (its pipe directory, a
    // host path, is under the root), the claim's shm as its /dev/shm.
    let log = control_log(&host);
    let started = starts(&log);
    assert_eq!(started.len(), 1, "{log:?}");
    assert_eq!(field(&started[0], "visible"), format!("{gpu0},{gpu1}"));
    assert!(claim_dir(&host).join("pipe/control").exists());
    let marker = field(&started[0], "shm");
    let marker = marker
        .strip_prefix("/dev/shm/")
        .expect("the daemon wrote to /dev/shm");
    assert!(claim_dir(&host).join("shm").join(marker).exists());
    assert!(!host.join("run/nvidia/mps/shm").join(marker).exists());
    assert!(!host.join("dev/shm").join(marker).exists());
    // Exactly what the claim's mpsConfig says, limits by the daemon's
    // device numbers (GPU 1 is its device 1).
    let commands: Vec<&str> = log
        .iter()
        .filter(|l| l.starts_with("command "))
        .map(String::as_str)
        .collect();
    assert_eq!(
        commands,
        [
            "command get_default_active_thread_percentage",
            "command set_default_active_thread_percentage 40",
            "command set_default_device_pinned_mem_limit 0 8192M",
            "command set_default_device_pinned_mem_limit 1 2048M",
        ]
    );
    // EXCLUSIVE_PROCESS on the claim's GPUs only.
    let mode = |u: &str| backend.compute_mode(u).unwrap();
    assert_eq!(mode(&gpu0), ComputeMode::ExclusiveProcess);
    assert_eq!(mode(&gpu1), ComputeMode::ExclusiveProcess);
    assert_eq!(mode(&gpu2), ComputeMode::Default);
    // The claim's spec: NVIDIA's env and mounts on each device, host paths
    // the host's own.
    let spec_path = gpu_dra::claims::cdi::spec_path(&opts.cdi_dir, UID);
    let spec: Spec = serde_yaml_ng::from_str(&root.read_to_string(&spec_path).unwrap()).unwrap();
    assert_eq!(spec.devices.len(), 2);
    for d in &spec.devices {
        let e = &d.container_edits;
        assert_eq!(e.env, ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]);
        let mounts: Vec<(String, String, String)> = e
            .mounts
            .iter()
            .map(|m| {
                (
                    m.host_path.clone(),
                    m.container_path.clone(),
                    m.options.join(","),
                )
            })
            .collect();
        assert_eq!(
            mounts,
            [
                (
                    format!("/run/nvidia/mps/dra-claim-{UID}/shm"),
                    "/dev/shm".to_string(),
                    "rw,nosuid,nodev,bind".to_string()
                ),
                (
                    format!("/run/nvidia/mps/dra-claim-{UID}/pipe"),
                    "/tmp/nvidia-mps".to_string(),
                    "rw,nosuid,nodev,bind".to_string()
                ),
            ]
        );
    }
    assert_eq!(mps.phases()[UID], "serving");

    // The daemon dies: started again (after a second), configured again.
    let pid: i32 = field(&started[0], "pid").parse().unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    until(15, "the killed daemon started again", || {
        let log = control_log(&host);
        (starts(&log).len() == 2
            && log.iter().filter(|l| l.starts_with("command ")).count() == 8
            && mps.phases()[UID] == "serving")
            .then_some(())
    });

    // Unprepare: `quit`, DEFAULT again, the claim's directories and spec
    // gone. The log is read through a handle opened before it goes.
    let mut kept = fs::File::open(claim_dir(&host).join("log/control.log")).unwrap();
    assert_eq!(claims.unprepare(std::slice::from_ref(&claim))[UID], Ok(()));
    let mut text = String::new();
    kept.read_to_string(&mut text).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[lines.len() - 2..], ["command quit", "quit"], "{text}");
    assert_eq!(mode(&gpu0), ComputeMode::Default);
    assert_eq!(mode(&gpu1), ComputeMode::Default);
    assert!(!claim_dir(&host).exists());
    assert!(!root.exists(&spec_path));
    assert!(mps.phases().is_empty());
    rt.block_on(mps.stop());
}

#[test]
#[ignore = "needs root (the daemon runs in its own mount namespace, chrooted into the host root); scripts/test runs it as root"]
fn a_mig_claims_multi_user_daemon_sees_the_mig_devices_and_leaves_compute_modes() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "run as root (scripts/test does)"
    );
    // The H100 host's files (device nodes 0 and 1 are there), the MIG GPUs.
    let host_dir = common::copy_host_fixture("h100-sxm-8");
    let host = host_dir.path().to_path_buf();
    fs::create_dir_all(host.join("usr/bin")).unwrap();
    fs::create_dir_all(host.join("dev/shm")).unwrap();
    common::build_static_standin(
        "mps_control_standin.rs",
        &host.join("usr/bin/nvidia-cuda-mps-control"),
    );
    let node = common::dra::sim_node(
        &host,
        "h100-mig-2",
        NODE,
        "6a0f3c1e-0000-4000-8000-000000000002",
    );
    let table = gpu_dra::claims::devices::device_table(&node.inv);
    // The first MIG device of each GPU, by the name the claim has them.
    let mut picked: Vec<(String, u32, String, String)> = Vec::new();
    for g in &node.inv.gpus {
        let m = &g.mig_devices[0].uuid;
        let (name, d) = table.iter().find(|(_, d)| &d.uuid == m).unwrap();
        picked.push((name.clone(), d.minor, d.uuid.clone(), d.gpu_uuid.clone()));
    }
    let spec_devices: Vec<(u32, String)> = picked.iter().map(|p| (p.1, p.2.clone())).collect();
    node.write_node_spec(&spec_devices);
    let common::dra::SimNode {
        root,
        inv,
        backend,
        opts,
    } = node;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mps = rt.block_on(async {
        DraMps::start(
            DraMpsSetup {
                host: root.clone(),
                spawner: Arc::new(hostlib::process::HostSpawner::new(
                    env!("CARGO_BIN_EXE_gpu-agent"),
                    root.clone(),
                )),
                backend: backend.clone(),
                root: "/run/nvidia/mps".into(),
                missing_caps: Vec::new(),
            },
            None,
        )
    });
    let allocs = Arc::new(MemoryAllocations::new());
    let claims = NodeClaims::open_with_mps(
        root.clone(),
        opts.clone(),
        allocs.clone(),
        &inv,
        Some(mps.port()),
    )
    .unwrap();
    allocs.insert(
        UID,
        ClaimAllocation {
            namespace: "ns".into(),
            name: "shared".into(),
            devices: picked
                .iter()
                .map(|p| AllocatedDevice {
                    request: "mig".into(),
                    pool: NODE.into(),
                    device: p.0.clone(),
                    share_id: None,
                })
                .collect(),
            configs: vec![OpaqueConfig {
                source: ConfigSource::FromClaim,
                requests: Vec::new(),
                parameters: serde_json::json!({
                    "apiVersion": "resource.nvidia.com/v1beta1",
                    "kind": "MigDeviceConfig",
                    "sharing": {"strategy": "MPS", "mpsConfig": {
                        "multiUser": true,
                        "defaultPerDevicePinnedMemoryLimit": {"1": "2Gi"},
                    }},
                }),
            }],
        },
    );
    // GPU 1's mode set by someone else: neither changed nor reset here.
    backend
        .set_compute_mode(&picked[1].3, ComputeMode::ExclusiveProcess)
        .unwrap();
    let claim = common::dra::claim(UID, "shared");
    let prepared = claims.prepare(std::slice::from_ref(&claim));
    assert_eq!(prepared[UID].as_ref().expect("prepared").len(), 2);
    let log = control_log(&host);
    let started = starts(&log);
    assert_eq!(started.len(), 1, "{log:?}");
    assert_eq!(
        field(&started[0], "visible"),
        format!("{},{}", picked[0].2, picked[1].2)
    );
    assert_eq!(field(&started[0], "multi_user"), "yes");
    let commands: Vec<&str> = log
        .iter()
        .filter(|l| l.starts_with("command "))
        .map(String::as_str)
        .collect();
    assert_eq!(
        commands,
        [
            "command get_default_active_thread_percentage",
            "command set_default_device_pinned_mem_limit 1 2048M",
        ]
    );
    // The parents' modes are untouched (a MIG device has none of its own).
    let mode = |u: &str| backend.compute_mode(u).unwrap();
    assert_eq!(mode(&picked[0].3), ComputeMode::Default);
    assert_eq!(mode(&picked[1].3), ComputeMode::ExclusiveProcess);
    assert_eq!(mps.phases()[UID], "serving");
    let mut kept = fs::File::open(claim_dir(&host).join("log/control.log")).unwrap();
    assert_eq!(claims.unprepare(std::slice::from_ref(&claim))[UID], Ok(()));
    let mut text = String::new();
    kept.read_to_string(&mut text).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[lines.len() - 2..], ["command quit", "quit"], "{text}");
    assert!(!claim_dir(&host).exists());
    assert!(mps.phases().is_empty());
    assert_eq!(mode(&picked[0].3), ComputeMode::Default);
    assert_eq!(mode(&picked[1].3), ComputeMode::ExclusiveProcess);
    rt.block_on(mps.stop());
}

/// `gpu-agent run` with DRA on: `status` after the DRA plugin serves.
fn serving_dra(host: &Path, args: &[&str], env: &[(&str, &Path)]) -> serde_json::Value {
    let policy = host.join("policy.yaml");
    fs::write(
        &policy,
        "spec:\n  reconcileIntervalSeconds: 0\n  driver: {enabled: false}\n  toolkit: {enabled: false}\n  devicePlugin: {enabled: false}\n  dra: {enabled: true}\n",
    )
    .unwrap();
    let mut cmd = common::at(host);
    cmd.args(args)
        .arg("--policy")
        .arg(&policy)
        .args(["--log-format", "text", "run"])
        .stdout(std::process::Stdio::null())
        .stderr(fs::File::create(host.join("agent.log")).unwrap());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut agent = cmd.spawn().unwrap();
    let dra = until(30, "the DRA plugin serving", || {
        let (_, out, _) = common::run(common::at(host).args(["status", "-o", "json"]));
        let st = common::json(&out);
        (st["dra"]["registration"] == "waiting for the kubelet"
            && st["inventory"]["gpus"]
                .as_array()
                .is_some_and(|g| g.len() == 8))
        .then(|| st["dra"].clone())
    });
    assert_eq!(
        common::sigterm(&mut agent),
        Some(0),
        "{}",
        fs::read_to_string(host.join("agent.log")).unwrap_or_default()
    );
    dra
}

/// On the real NVML path the agent shares its backend with the claims'
/// daemons (and goes on reconciling with it); without the capabilities a
/// daemon needs, `status` says claims with MPS fail and why. A simulated
/// node runs none.
#[test]
fn status_says_whether_claims_can_have_mps_here() {
    let dir = common::copy_host_fixture("h100-sxm-8");
    let host = dir.path();
    let root = hostlib::HostRoot::new(host).unwrap();
    root.write_atomic(
        "/proc/sys/kernel/random/boot_id",
        b"6a0f3c1e-0000-4000-8000-000000000002\n",
        0o444,
    )
    .unwrap();
    let (_nvml_dir, nvml) = common::fake_nvml();
    let dra = serving_dra(
        host,
        &["--nvml-lib", nvml.to_str().unwrap()],
        &[("FAKE_NVML_NODE", Path::new("h100-sxm-8"))],
    );
    assert_eq!(dra["gpus"].as_array().unwrap().len(), 8, "{dra:#}");
    if nix::unistd::geteuid().is_root() {
        assert!(dra.get("mpsUnavailable").is_none(), "{dra:#}");
    } else {
        let why = dra["mpsUnavailable"].as_str().unwrap_or_default();
        assert!(
            why.starts_with(
                "claims with MPS sharing fail: the MPS control daemon needs CAP_SYS_ADMIN"
            ),
            "{dra:#}"
        );
    }

    let dir = common::copy_host_fixture("h100-sxm-8");
    let host = dir.path();
    hostlib::HostRoot::new(host)
        .unwrap()
        .write_atomic(
            "/proc/sys/kernel/random/boot_id",
            b"6a0f3c1e-0000-4000-8000-000000000003\n",
            0o444,
        )
        .unwrap();
    let dra = serving_dra(host, &["--simulate", "h100-sxm-8"], &[]);
    assert_eq!(
        dra["mpsUnavailable"],
        "a simulated node runs no MPS control daemon: claims with MPS sharing are refused"
    );
}
