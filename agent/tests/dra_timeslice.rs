//! Time-slicing of a DRA claim at a non-`Default` interval end to end on
//! the node: gpu-dra's claims prepared with the agent's own time-slice port
//! (`supervisor::dra_timeslice`), which runs the host's `nvidia-smi`
//! through the agent binary's `host-exec`, chrooted into a copy of the 8x
//! H100 host fixture. `nvidia-smi` is a stand-in
//! (tests/interop/nvidia_smi_standin.rs, compiled statically) that records
//! its arguments in the root it runs in. The GPUs are the simulated
//! backend's (it keeps compute modes). Checked: the exact commands of a
//! prepare (per GPU of the claim, `--set-timeslice 3` for `Long`) and of
//! its unprepare (`0`); the compute mode DEFAULT first; a refusal of
//! `nvidia-smi` failing the claim with the GPU and its words, leaving no
//! spec and setting the GPU back.
//!
//! `host-exec` chroots into the host root: root only.

mod common;

use std::fs;
use std::path::Path;
use std::sync::Arc;

use common::dra::claim;
use gpu_agent::backend::ComputeMode;
use gpu_agent::supervisor::dra_timeslice::{DraTimeSlice, NVIDIA_SMI};
use gpu_dra::claim::Claims;
use gpu_dra::claims::{
    AllocatedDevice, ClaimAllocation, ConfigSource, MemoryAllocations, NodeClaims, OpaqueConfig,
    TimeSlicePort,
};

const U1: &str = "5f1d8a3c-7b2e-4c9d-8e6f-0a1b2c3d4e5f";
const U2: &str = "6e2c9b4d-8a3f-4d0e-9f70-1b2c3d4e5f60";
const NODE: &str = "node-a";

/// The stand-in's record (in the chroot), one line per run.
fn runs(host: &Path) -> Vec<String> {
    fs::read_to_string(host.join("var/log/nvidia-smi.argv"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

fn allocation(name: &str, devices: &[&str], interval: &str) -> ClaimAllocation {
    ClaimAllocation {
        namespace: "ns".into(),
        name: name.into(),
        devices: devices
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
                "sharing": {"strategy": "TimeSlicing",
                    "timeSlicingConfig": {"interval": interval}},
            }),
        }],
    }
}

#[test]
#[ignore = "needs root (nvidia-smi runs chrooted into the host root); scripts/test runs it as root"]
fn a_claims_time_slice_is_set_with_the_hosts_nvidia_smi_and_set_back() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "run as root (scripts/test does)"
    );
    let host_dir = common::copy_host_fixture("h100-sxm-8");
    let host = host_dir.path().to_path_buf();
    fs::create_dir_all(host.join("usr/bin")).unwrap();
    fs::create_dir_all(host.join("var/log")).unwrap();
    fs::create_dir_all(host.join("etc")).unwrap();
    common::build_static_standin("nvidia_smi_standin.rs", &host.join("usr/bin/nvidia-smi"));
    // The simulated H100s: their inventory and compute modes.
    let node = common::dra::sim_node(
        &host,
        "h100-sxm-8",
        NODE,
        "6a0f3c1e-0000-4000-8000-000000000011",
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
    // A GPU left in EXCLUSIVE_PROCESS: put in DEFAULT before its slice.
    backend
        .set_compute_mode(&gpu0, ComputeMode::ExclusiveProcess)
        .unwrap();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let port: Arc<dyn TimeSlicePort> = {
        let _in = rt.enter();
        Arc::new(DraTimeSlice::new(
            Arc::new(hostlib::process::HostSpawner::new(
                env!("CARGO_BIN_EXE_gpu-agent"),
                root.clone(),
            )),
            backend.clone(),
            NVIDIA_SMI,
            Vec::new(),
        ))
    };
    let allocs = Arc::new(MemoryAllocations::new());
    let claims = NodeClaims::open(root.clone(), opts.clone(), allocs.clone(), &inv)
        .unwrap()
        .with_time_slice(Ok(port));

    // Prepare: each GPU of the claim at Long (3), through the chroot.
    allocs.insert(U1, allocation("long", &["gpu-0", "gpu-1"], "Long"));
    let c1 = claim(U1, "long");
    let prepared = claims.prepare(std::slice::from_ref(&c1));
    assert_eq!(prepared[U1].as_ref().expect("prepared").len(), 2);
    assert_eq!(
        runs(&host),
        [
            format!("compute-policy -i {gpu0} --set-timeslice 3"),
            format!("compute-policy -i {gpu1} --set-timeslice 3"),
        ]
    );
    assert!(
        !Path::new("/var/log/nvidia-smi.argv").exists()
            || !fs::read_to_string("/var/log/nvidia-smi.argv")
                .unwrap_or_default()
                .contains(&gpu0),
        "ran outside the chroot"
    );
    assert_eq!(backend.compute_mode(&gpu0).unwrap(), ComputeMode::Default);
    let spec_path = gpu_dra::claims::cdi::spec_path(&opts.cdi_dir, U1);
    assert!(root.exists(&spec_path));

    // Unprepare: back to Default (0), the spec gone; a repeat runs nothing.
    assert_eq!(claims.unprepare(std::slice::from_ref(&c1))[U1], Ok(()));
    assert_eq!(
        runs(&host)[2..],
        [
            format!("compute-policy -i {gpu0} --set-timeslice 0"),
            format!("compute-policy -i {gpu1} --set-timeslice 0"),
        ]
    );
    assert!(!root.exists(&spec_path));
    assert_eq!(claims.unprepare(std::slice::from_ref(&c1))[U1], Ok(()));
    assert_eq!(runs(&host).len(), 4);

    // nvidia-smi refuses GPU 2: the claim fails naming the GPU and the
    // words, no spec is left, and the GPU is set back (tried: refused too).
    fs::write(
        host.join("etc/nvidia-smi.fail"),
        format!("{gpu2}\nUnable to set the timeslice: Insufficient Permissions\n"),
    )
    .unwrap();
    allocs.insert(U2, allocation("short", &["gpu-2"], "Short"));
    let c2 = claim(U2, "short");
    let err = claims.prepare(std::slice::from_ref(&c2))[U2]
        .clone()
        .unwrap_err();
    assert!(
        err.contains(&format!(
            "ResourceClaim ns/short ({U2}): the time slice of its GPUs: GPU {gpu2}: `/usr/bin/nvidia-smi compute-policy -i {gpu2} --set-timeslice 1` failed: Unable to set the timeslice: Insufficient Permissions (exit code 4)"
        )),
        "{err}"
    );
    assert_eq!(
        runs(&host)[4..],
        [
            format!("compute-policy -i {gpu2} --set-timeslice 1"),
            format!("compute-policy -i {gpu2} --set-timeslice 0"),
        ]
    );
    assert!(!root.exists(gpu_dra::claims::cdi::spec_path(&opts.cdi_dir, U2)));
    let ckpt: serde_json::Value = serde_json::from_str(
        &root
            .read_to_string(gpu_dra::claims::checkpoint::checkpoint_path(
                &opts.state_dir,
            ))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(ckpt["claims"], serde_json::json!({}), "{ckpt:#}");
    assert!(ckpt.get("timeSlices").is_none(), "{ckpt:#}");
    drop(claims);
    drop(rt);
}
