//! An 8-GPU node in a directory, shared by the `prepare` bench and the
//! crash suite (tests/crash.rs): its host tree (boot ID, device nodes, the
//! node's CDI spec as gpu-agent's cdi stage writes it for the h100-sxm-8
//! fixture host), its inventory, the claims' allocations and the DRA
//! plugin served on Unix sockets in the directory.
//!
//! There is no real capture of a node CDI spec (tests/fixtures/real-hosts
//! has none), so [`node_spec`] is the cdi stage's output for the fixture:
//! 8 GPUs by index and UUID, `all`, 4 control nodes, the driver's 16 files
//! and its 2 hooks.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_agent_proto::dra::v1 as pb;
use gpu_agent_proto::dra::v1::dra_plugin_client::DraPluginClient;
use gpu_dra::claims::{AllocatedDevice, ClaimAllocation, NodeClaims, Options};
use gpu_dra::kubelet::{Dirs, HealthSource, Registration, ServeError, serve};
use gpu_model::backend::Telemetry;
use gpu_model::cdi::{
    CDI_KIND, ContainerEdits, Device, DeviceNode, Hook, Mount, SPEC_VERSION, Spec,
};
use gpu_model::health::HealthView;
use gpu_model::inventory::{BackendInfo, Gpu, Inventory};
use hostlib::HostRoot;
use tokio::sync::watch;
use tonic::transport::Channel;

/// The node's name: the pool of its devices.
pub const NODE: &str = "node-a";
/// Its GPUs: `gpu-0` … `gpu-7`.
pub const GPUS: u32 = 8;
/// The driver of the h100-sxm-8 fixture.
pub const DRIVER: &str = "550.127.08";
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// GPU `minor`'s UUID.
pub fn uuid(minor: u32) -> String {
    format!("GPU-9d3b5a0e-1c7f-4e2a-8b61-0f2c3d4e5a{minor:02x}")
}

/// The device name of GPU `minor`: `gpu-<minor>`.
pub fn device(minor: u32) -> String {
    format!("gpu-{minor}")
}

/// GPU `minor`, from the fields every inventory has (read as the agent's
/// report would carry it, so a field added since reads as its default).
fn gpu(minor: u32) -> Gpu {
    serde_json::from_value(serde_json::json!({
        "index": minor,
        "minor": minor,
        "uuid": uuid(minor),
        "model": "NVIDIA H100 80GB HBM3",
        "bus_id": format!("0000:{:02x}:00.0", 0x18 + minor * 0x10),
        "numa_node": null,
        "pci": null,
        "memory_mib": 81559,
        "compute_capability": null,
        "mig": null,
        "nvlinks": 18,
        "telemetry": Telemetry::default(),
    }))
    .expect("a GPU")
}

/// The node's inventory: 8 H100s, MIG off.
pub fn inventory() -> Inventory {
    Inventory {
        machine: None,
        driver: Default::default(),
        backend: BackendInfo {
            name: "sim".into(),
            driver_version: Some(DRIVER.into()),
            error: None,
            lost: Vec::new(),
        },
        cuda_version: None,
        gpus: (0..GPUS).map(gpu).collect(),
        pairs: Vec::new(),
        warnings: Vec::new(),
        unreadable: Vec::new(),
    }
}

fn nodes(paths: &[String]) -> Vec<DeviceNode> {
    paths
        .iter()
        .map(|p| DeviceNode {
            path: p.clone(),
            host_path: None,
        })
        .collect()
}

const CONTROL_NODES: [&str; 4] = [
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
];

/// The node spec gpu-agent's cdi stage writes for the h100-sxm-8 fixture.
pub fn node_spec() -> Spec {
    let mut devices = Vec::new();
    for minor in 0..GPUS {
        let edits = ContainerEdits {
            device_nodes: nodes(&[format!("/dev/nvidia{minor}")]),
            ..ContainerEdits::default()
        };
        for name in [minor.to_string(), uuid(minor)] {
            devices.push(Device {
                name,
                container_edits: edits.clone(),
            });
        }
    }
    devices.push(Device {
        name: "all".into(),
        container_edits: ContainerEdits {
            device_nodes: nodes(
                &(0..GPUS)
                    .map(|m| format!("/dev/nvidia{m}"))
                    .collect::<Vec<_>>(),
            ),
            ..ContainerEdits::default()
        },
    });
    let lib = "/usr/lib/x86_64-linux-gnu";
    let mut files: Vec<String> = [
        "libcuda",
        "libcudadebugger",
        "libnvcuvid",
        "libnvidia-cfg",
        "libnvidia-encode",
        "libnvidia-ml",
        "libnvidia-nvvm",
        "libnvidia-opencl",
        "libnvidia-ptxjitcompiler",
        "vdpau/libvdpau_nvidia",
    ]
    .iter()
    .map(|l| format!("{lib}/{l}.so.{DRIVER}"))
    .collect();
    files.extend([
        format!("/usr/lib/firmware/nvidia/{DRIVER}/gsp_ga10x.bin"),
        format!("/usr/lib/firmware/nvidia/{DRIVER}/gsp_tu10x.bin"),
        "/usr/bin/nvidia-smi".into(),
        "/usr/bin/nvidia-debugdump".into(),
        "/usr/bin/nvidia-persistenced".into(),
        "/run/nvidia-persistenced/socket".into(),
    ]);
    let mounts = files
        .into_iter()
        .map(|f| Mount {
            host_path: f.clone(),
            container_path: f,
            options: ["ro", "nosuid", "nodev", "rbind", "rprivate"]
                .map(String::from)
                .to_vec(),
        })
        .collect();
    let hook = |args: &[&str]| Hook {
        hook_name: "createContainer".into(),
        path: "/var/lib/gpu-agent/bin/gpu-agent".into(),
        args: args.iter().map(|a| a.to_string()).collect(),
    };
    Spec {
        cdi_version: SPEC_VERSION.into(),
        kind: CDI_KIND.into(),
        devices,
        container_edits: ContainerEdits {
            env: vec!["NVIDIA_VISIBLE_DEVICES=void".into()],
            device_nodes: nodes(&CONTROL_NODES.map(String::from)),
            mounts,
            hooks: vec![
                hook(&[
                    "gpu-agent",
                    "cdi-hook",
                    "create-symlinks",
                    "--link",
                    "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so",
                ]),
                hook(&[
                    "gpu-agent",
                    "cdi-hook",
                    "update-ldcache",
                    "--folder",
                    lib,
                    "--folder",
                    "/usr/lib/x86_64-linux-gnu/vdpau",
                ]),
            ],
        },
    }
}

/// Where the node's claims live: the defaults, with a short wait for an
/// allocation (every claim's is there before it is prepared).
pub fn options() -> Options {
    let mut opts = Options::new(NODE);
    opts.allocation_wait = Duration::from_secs(2);
    opts
}

/// Makes the node's host tree in `root`: boot ID `boot_id`, the device
/// nodes (plain files: only their presence is checked) and the node spec.
pub fn make_host(root: &Path, boot_id: &str) -> HostRoot {
    let host = HostRoot::new(root).expect("the node's root");
    host.write_atomic(BOOT_ID_PATH, format!("{boot_id}\n").as_bytes(), 0o444)
        .expect("the boot ID");
    let gpus = (0..GPUS).map(|m| format!("/dev/nvidia{m}"));
    for n in gpus.chain(CONTROL_NODES.map(String::from)) {
        host.write_atomic(&n, b"", 0o666).expect("a device node");
    }
    let spec = serde_json::to_string_pretty(&node_spec()).expect("a spec serialises");
    host.write_atomic(&options().node_spec, spec.as_bytes(), 0o644)
        .expect("the node spec");
    host
}

/// A UID in the form Kubernetes gives them (RFC 4122), unique per
/// (`run`, `n`).
pub fn claim_uid(run: u32, n: u32) -> String {
    format!("{run:08x}-0000-4000-8000-{n:012x}")
}

/// Claim `uid`'s allocation: GPU `minor`, whole.
pub fn allocation(uid: &str, minor: u32) -> ClaimAllocation {
    ClaimAllocation {
        namespace: "bench".into(),
        name: format!("claim-{uid}"),
        devices: vec![AllocatedDevice {
            request: "gpu".into(),
            pool: NODE.into(),
            device: device(minor),
            share_id: None,
        }],
        configs: Vec::new(),
    }
}

/// Claim `uid` as the kubelet names it.
pub fn claim(uid: &str) -> pb::Claim {
    pb::Claim {
        namespace: "bench".into(),
        uid: uid.into(),
        name: format!("claim-{uid}"),
    }
}

/// The CDI IDs a claim of GPU `minor` gets.
pub fn cdi_ids(uid: &str, minor: u32) -> Vec<String> {
    vec![gpu_dra::claims::cdi::cdi_device_id(uid, &device(minor))]
}

/// The kubelet's directories in `root`.
pub fn dirs(root: &Path) -> Dirs {
    Dirs {
        registry: root.join("kubelet/plugins_registry"),
        plugins: root.join("kubelet/plugins"),
        kubelet_plugins: None,
    }
}

/// Serves `claims` with [`serve`] on `dirs` until `stop` resolves; no
/// health monitor (every device's health is Unknown).
pub async fn serve_claims(
    dirs: &Dirs,
    claims: Arc<NodeClaims>,
    stop: impl std::future::Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let (_monitor, view) = watch::channel(HealthView::default());
    let health = HealthSource::from_claims(&claims, view);
    let (registration, _) = watch::channel(Registration::Unknown);
    serve(dirs, claims, health, registration, stop).await
}

/// A client of the DRA socket of `dirs`, once it answers (up to `within`).
pub async fn client(dirs: &Dirs, within: Duration) -> DraPluginClient<Channel> {
    let deadline = Instant::now() + within;
    let socket: PathBuf = dirs.dra_socket();
    loop {
        match gpu_grpc::connect(&socket).await {
            Ok(ch) => return DraPluginClient::new(ch),
            Err(e) if Instant::now() >= deadline => {
                panic!("{} did not answer within {within:?}: {e}", socket.display())
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(2)).await,
        }
    }
}

/// Prepares claim `uid` (one claim, as the kubelet sends a pod's): its CDI
/// IDs, or the claim's error, or the call's.
pub async fn prepare(
    client: &mut DraPluginClient<Channel>,
    uid: &str,
) -> Result<Result<Vec<String>, String>, tonic::Status> {
    let resp = client
        .node_prepare_resources(pb::NodePrepareResourcesRequest {
            claims: vec![claim(uid)],
        })
        .await?
        .into_inner();
    let Some(answer) = resp.claims.get(uid) else {
        return Ok(Err(format!("no answer for claim {uid}: {resp:?}")));
    };
    if !answer.error.is_empty() {
        return Ok(Err(answer.error.clone()));
    }
    Ok(Ok(answer
        .devices
        .iter()
        .flat_map(|d| d.cdi_device_ids.clone())
        .collect()))
}

/// Unprepares claim `uid`: `Ok(())`, or the claim's error, or the call's.
pub async fn unprepare(
    client: &mut DraPluginClient<Channel>,
    uid: &str,
) -> Result<Result<(), String>, tonic::Status> {
    let resp = client
        .node_unprepare_resources(pb::NodeUnprepareResourcesRequest {
            claims: vec![claim(uid)],
        })
        .await?
        .into_inner();
    Ok(match resp.claims.get(uid) {
        None => Err(format!("no answer for claim {uid}: {resp:?}")),
        Some(a) if !a.error.is_empty() => Err(a.error.clone()),
        Some(_) => Ok(()),
    })
}

/// Every claim's allocation, by UID, as a map for `MemoryAllocations::replace_all`.
pub fn allocations(
    claims: impl IntoIterator<Item = (String, u32)>,
) -> BTreeMap<String, ClaimAllocation> {
    claims
        .into_iter()
        .map(|(uid, minor)| {
            let a = allocation(&uid, minor);
            (uid, a)
        })
        .collect()
}
