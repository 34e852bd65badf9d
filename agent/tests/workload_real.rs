//! The validator's workload check against a real containerd 2.x (Debian
//! sid's, unpacked by `scripts/fetch-containerd2`) running containers with
//! Debian's runc: a daemon of our own on a private socket, root and state,
//! an image made here (busybox-static in one layer, imported with `ctr`, also
//! serving as the pod sandbox image, so nothing is pulled), and a CDI spec
//! whose GPU is a pair of character devices every machine has (`/dev/null`
//! shown as `/dev/nvidia0`, `/dev/zero` as `/dev/nvidiactl`).
//!
//! One daemon for all cases (a start costs ~1 s): the check passes; a CDI
//! device the spec does not have is refused with containerd's words; missing
//! and wrong things inside are named one per line; an image that cannot be
//! had is named; a check out of time leaves nothing behind either; and
//! `cannot_run_reason` has nothing against this runtime but names a socket
//! that is not there. After each case nothing of the check
//! is left in containerd, and after the test no mount is left under its
//! directory.

mod common;

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use gpu_agent::cdi;
use gpu_agent::workload::{self, WorkloadCheck, WorkloadError};
use gpu_agent_proto::cri::v1::image_service_client::ImageServiceClient;
use gpu_agent_proto::cri::v1::{ImageSpec, ImageStatusRequest};
use hostlib::HostRoot;
use serde_json::json;
use sha2::{Digest, Sha256};

const IMAGE: &str = "localhost/gpu-agent-test/busybox:1";
const RUNC: &str = "/usr/sbin/runc";

/// Why this machine cannot run the test, if it cannot.
fn cannot_run_here() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("containerd and runc need root".into());
    }
    if !Path::new(RUNC).exists() {
        return Some(format!("{RUNC} is missing (Debian's runc)"));
    }
    busybox().err()
}

/// A statically linked busybox (Debian's busybox-static).
fn busybox() -> Result<PathBuf, String> {
    use object::Object;
    for p in ["/usr/bin/busybox", "/bin/busybox"] {
        let Ok(bytes) = fs::read(p) else { continue };
        let file = object::File::parse(&*bytes).map_err(|e| format!("{p}: {e}"))?;
        if file.section_by_name(".interp").is_some() {
            return Err(format!("{p} is dynamically linked: install busybox-static"));
        }
        return Ok(PathBuf::from(p));
    }
    Err("no busybox: install busybox-static".into())
}

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn oci_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// An OCI image layout, as a tar `ctr images import` reads, of one layer:
/// busybox at `/bin/busybox` with `sh` and `sleep` linked to it. Its
/// entrypoint sleeps, so the same image serves as the pod sandbox image.
fn image_tar(name: &str) -> Vec<u8> {
    let busybox = fs::read(busybox().unwrap()).unwrap();
    let mut layer = tar::Builder::new(Vec::new());
    let header = |kind: tar::EntryType, mode: u32, size: u64| {
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(size);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h
    };
    for dir in ["bin", "dev", "etc", "proc", "sys", "tmp"] {
        let mut h = header(tar::EntryType::Directory, 0o755, 0);
        layer
            .append_data(&mut h, format!("{dir}/"), std::io::empty())
            .unwrap();
    }
    let mut h = header(tar::EntryType::Regular, 0o755, busybox.len() as u64);
    layer
        .append_data(&mut h, "bin/busybox", &busybox[..])
        .unwrap();
    for link in ["sh", "sleep"] {
        let mut h = header(tar::EntryType::Symlink, 0o777, 0);
        layer
            .append_link(&mut h, format!("bin/{link}"), "busybox")
            .unwrap();
    }
    let layer = layer.into_inner().unwrap();
    let layer_digest = sha256(&layer);
    let config = serde_json::to_vec(&json!({
        "architecture": oci_arch(),
        "os": "linux",
        "config": {
            "Env": ["PATH=/bin"],
            "Entrypoint": ["/bin/sleep", "2147483647"],
        },
        "rootfs": { "type": "layers", "diff_ids": [format!("sha256:{layer_digest}")] },
    }))
    .unwrap();
    let config_digest = sha256(&config);
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": format!("sha256:{config_digest}"),
            "size": config.len(),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": format!("sha256:{layer_digest}"),
            "size": layer.len(),
        }],
    }))
    .unwrap();
    let manifest_digest = sha256(&manifest);
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": format!("sha256:{manifest_digest}"),
            "size": manifest.len(),
            "platform": { "architecture": oci_arch(), "os": "linux" },
            "annotations": {
                "io.containerd.image.name": name,
                "org.opencontainers.image.ref.name": name.rsplit_once(':').unwrap().1,
            },
        }],
    }))
    .unwrap();

    let mut out = tar::Builder::new(Vec::new());
    let mut file = |path: String, bytes: &[u8]| {
        let mut h = header(tar::EntryType::Regular, 0o644, bytes.len() as u64);
        out.append_data(&mut h, path, bytes).unwrap();
    };
    file("oci-layout".into(), br#"{"imageLayoutVersion":"1.0.0"}"#);
    file("index.json".into(), &index);
    file(format!("blobs/sha256/{manifest_digest}"), &manifest);
    file(format!("blobs/sha256/{config_digest}"), &config);
    file(format!("blobs/sha256/{layer_digest}"), &layer);
    out.into_inner().unwrap()
}

/// The GPU's CDI spec, shaped as gpu-agent writes it (the device's node per
/// device, control nodes and `NVIDIA_VISIBLE_DEVICES=void` for all), with
/// each node taken from a device every machine has (`hostPath`, which our
/// own specs never need: there the nodes are the GPU's own).
fn gpu_spec() -> (cdi::Spec, String) {
    let node = |path: &str, host: &str| cdi::DeviceNode {
        path: path.into(),
        host_path: Some(host.into()),
    };
    let spec = cdi::Spec {
        cdi_version: cdi::SPEC_VERSION.into(),
        kind: "nvidia.com/gpu".into(),
        devices: vec![cdi::Device {
            name: "0".into(),
            container_edits: cdi::ContainerEdits {
                device_nodes: vec![node("/dev/nvidia0", "/dev/null")],
                ..Default::default()
            },
        }],
        container_edits: cdi::ContainerEdits {
            env: vec!["NVIDIA_VISIBLE_DEVICES=void".into()],
            device_nodes: vec![node("/dev/nvidiactl", "/dev/zero")],
            ..Default::default()
        },
    };
    let text = serde_json::to_string_pretty(&spec).unwrap();
    (spec, text)
}

/// True when this process may lower OOM score adjustments. containerd
/// gives a sandbox -998; without CAP_SYS_RESOURCE (some CI sandboxes drop
/// it, root or not) runc's `nsexec` cannot write that and the sandbox fails
/// with "failed to update /proc/self/oom_score_adj: Permission denied". There
/// containerd is told `restrict_oom_score_adj` (never below its own score).
fn has_cap_sys_resource() -> bool {
    const CAP_SYS_RESOURCE: u32 = 24;
    let status = fs::read_to_string("/proc/self/status").unwrap();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    eff & (1 << CAP_SYS_RESOURCE) != 0
}

/// A containerd 2.x with CDI on, runc from Debian, its sandbox image pinned
/// to ours, on a socket, root and state of its own in a temp dir, sharing
/// nothing with another containerd on the machine (NRI off, its own CNI and
/// runc state directories, a stream server on a free port). When dropped:
/// whatever tasks are left killed, the daemon stopped, leftover shims
/// killed, every mount under the dir lazily unmounted, and the directories
/// it made outside the dir (see [`outside_dirs`]) removed.
struct Containerd {
    dir: tempfile::TempDir,
    child: Child,
    socket: PathBuf,
    ctr: PathBuf,
    /// Host directories containerd makes outside its root and state, that
    /// were not there before it: removed afterwards when empty.
    made: Vec<PathBuf>,
}

/// Directories a containerd 2 running containers makes whatever its root
/// and state: the shims' socket directory, and the parent cgroup of its
/// `k8s.io` namespace in each cgroup hierarchy (cgroupfs driver).
fn outside_dirs() -> Vec<PathBuf> {
    let mut dirs = vec![PathBuf::from("/run/containerd/s"), "/run/containerd".into()];
    if let Ok(hierarchies) = fs::read_dir("/sys/fs/cgroup") {
        for h in hierarchies.flatten() {
            dirs.push(h.path().join("k8s.io"));
        }
    }
    dirs.push("/sys/fs/cgroup/k8s.io".into());
    dirs
}

impl Containerd {
    fn start() -> Containerd {
        let bin = containerd_2();
        let bindir = bin.parent().unwrap().to_path_buf();
        let dir = tempfile::Builder::new()
            .prefix("gpu-agent-workload-")
            .tempdir()
            .unwrap();
        let d = dir.path();
        for sub in ["cdi", "logs", "cni/conf", "cni/bin", "runc", "opt"] {
            fs::create_dir_all(d.join(sub)).unwrap();
        }
        let (_, spec) = gpu_spec();
        fs::write(d.join("cdi/gpu-agent-test.json"), spec).unwrap();
        let config = format!(
            r#"version = 3

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = '{IMAGE}'

[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  cdi_spec_dirs = ['{d}/cdi']
  restrict_oom_score_adj = {restrict_oom}

[plugins.'io.containerd.cri.v1.runtime'.containerd]
  default_runtime_name = 'runc'

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = 'io.containerd.runc.v2'
  runtime_path = '{shim}'

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = '{RUNC}'
  Root = '{d}/runc'
  SystemdCgroup = false

[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ['{d}/cni/bin']
  conf_dir = '{d}/cni/conf'

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'

[plugins.'io.containerd.nri.v1.nri']
  disable = true

[plugins.'io.containerd.internal.v1.opt']
  path = '{d}/opt'
"#,
            d = d.display(),
            shim = bindir.join("containerd-shim-runc-v2").display(),
            restrict_oom = !has_cap_sys_resource(),
        );
        let config_path = d.join("config.toml");
        fs::write(&config_path, config).unwrap();
        let socket = d.join("containerd.sock");
        let made = outside_dirs().into_iter().filter(|p| !p.exists()).collect();
        let log = fs::File::create(d.join("containerd.log")).unwrap();
        let child = Command::new(&bin)
            .arg("--config")
            .arg(&config_path)
            .arg("--address")
            .arg(&socket)
            .arg("--root")
            .arg(d.join("root"))
            .arg("--state")
            .arg(d.join("state"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut c = Containerd {
            dir,
            child,
            socket,
            ctr: bindir.join("ctr"),
            made,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !c.socket.exists() {
            if let Some(status) = c.child.try_wait().unwrap() {
                panic!("containerd exited ({status}):\n{}", c.log());
            }
            assert!(
                Instant::now() < deadline,
                "no socket after 30 s:\n{}",
                c.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        c
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn log(&self) -> String {
        fs::read_to_string(self.path().join("containerd.log")).unwrap_or_default()
    }

    /// `ctr -n k8s.io <args>`: stdout, or a panic with ctr's words.
    fn ctr(&self, args: &[&str], stdin: Option<&[u8]>) -> String {
        let mut child = Command::new(&self.ctr)
            .arg("--address")
            .arg(&self.socket)
            .args(["-n", "k8s.io"])
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        if let Some(bytes) = stdin {
            child.stdin.take().unwrap().write_all(bytes).unwrap();
        }
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "ctr {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// containerd's containers (CRI sandboxes and containers are ones).
    fn containers(&self) -> Vec<String> {
        self.ctr(&["containers", "ls", "-q"], None)
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Mount points under the test's dir, deepest first.
    fn mounts(&self) -> Vec<PathBuf> {
        let info = fs::read_to_string("/proc/self/mountinfo").unwrap();
        let mut found: Vec<PathBuf> = info
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .map(|p| PathBuf::from(p.replace("\\040", " ")))
            .filter(|p| p.starts_with(self.path()))
            .collect();
        found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        found
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // Left behind only by a failed case: kill and delete the tasks.
        if self.child.try_wait().ok().flatten().is_none() {
            let tasks = Command::new(&self.ctr)
                .arg("--address")
                .arg(&self.socket)
                .args(["-n", "k8s.io", "tasks", "ls", "-q"])
                .output();
            if let Ok(out) = tasks {
                for id in String::from_utf8_lossy(&out.stdout).lines() {
                    let _ = Command::new(&self.ctr)
                        .arg("--address")
                        .arg(&self.socket)
                        .args(["-n", "k8s.io", "tasks", "delete", "--force", id])
                        .output();
                }
            }
            let _ = sigterm(&mut self.child);
        }
        // Shims still serving this daemon's socket (started by it for us).
        let socket = self.socket.display().to_string();
        if let Ok(procs) = fs::read_dir("/proc") {
            for p in procs.flatten() {
                let Ok(pid) = p.file_name().to_string_lossy().parse::<i32>() else {
                    continue;
                };
                let cmdline = fs::read(p.path().join("cmdline")).unwrap_or_default();
                let mut args = cmdline.split(|b| *b == 0);
                let shim = args
                    .next()
                    .is_some_and(|a| String::from_utf8_lossy(a).contains("containerd-shim"));
                let is_ours = shim && args.any(|a| a == socket.as_bytes());
                if is_ours {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
        }
        for m in self.mounts() {
            let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
        }
        // rmdir: only when empty (a cgroup without tasks or children).
        for d in &self.made {
            let _ = fs::remove_dir(d);
        }
    }
}

/// Waits until the CRI service answers and says the runtime is ready.
async fn cri_ready(c: &Containerd) -> workload::RuntimeFacts {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match workload::runtime_facts(&c.socket).await {
            Ok(f) if f.not_ready.iter().all(|c| !c.starts_with("RuntimeReady")) => return f,
            _ if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("CRI not ready: {other:?}\n{}", c.log()),
        }
    }
}

/// Waits until the CRI plugin has the imported image. It learns of images
/// from containerd's events, a moment after `ctr images import` returns;
/// asked before, it says the image is absent (and the check would pull).
async fn cri_sees_image(c: &Containerd) {
    let channel = gpu_agent::plugin::kubelet::connect(&c.socket)
        .await
        .unwrap();
    let mut images = ImageServiceClient::new(channel);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = images
            .image_status(ImageStatusRequest {
                image: Some(ImageSpec {
                    image: IMAGE.into(),
                    ..Default::default()
                }),
                verbose: false,
            })
            .await
            .unwrap();
        if status.into_inner().image.is_some() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "CRI does not see {IMAGE} 10 s after its import:\n{}",
            c.log()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn check<'a>(host: &'a HostRoot, c: &Containerd, device: &str) -> WorkloadCheck<'a> {
    let mut check = WorkloadCheck::new(host, c.socket.clone(), IMAGE, device);
    check.log_root = c.path().join("logs").display().to_string();
    check.timeout = Duration::from_secs(30);
    check
}

/// Nothing of a check is left: no container or sandbox in containerd, no
/// log directory.
fn nothing_left(c: &Containerd, case: &str) {
    let left = c.containers();
    assert!(left.is_empty(), "{case}: left in containerd: {left:?}");
    let logs: Vec<_> = fs::read_dir(c.path().join("logs")).unwrap().collect();
    assert!(logs.is_empty(), "{case}: log directories left: {logs:?}");
}

/// Case 6 of the test below: a claim's transient spec, made from a node spec
/// shaped as gpu-agent's cdi stage writes it (devices by GPU UUID, control
/// nodes and the driver's files for all; nodes on stand-ins, as above).
fn dra_claim(rt: &tokio::runtime::Runtime, host: &HostRoot, c: &Containerd) {
    use gpu_dra::claim::{ClaimRef, Claims};
    use gpu_dra::claims::{AllocatedDevice, ClaimAllocation, MemoryAllocations, NodeClaims};
    const UUID: &str = "GPU-9d3b5a0e-1c7f-4e2a-8b61-0f2c3d4e5a01";
    const LIB: &str = "/usr/lib/x86_64-linux-gnu/libcuda.so.550.127.08";
    let d = c.path();
    let node = |path: &str, host: &str| cdi::DeviceNode {
        path: path.into(),
        host_path: Some(host.into()),
    };
    fs::create_dir_all(d.join("driver")).unwrap();
    fs::write(d.join("driver/libcuda.so"), b"not a library").unwrap();
    let node_spec = cdi::Spec {
        cdi_version: cdi::SPEC_VERSION.into(),
        kind: "nvidia.com/gpu".into(),
        devices: vec![cdi::Device {
            name: UUID.into(),
            container_edits: cdi::ContainerEdits {
                device_nodes: vec![node("/dev/nvidia0", "/dev/null")],
                ..Default::default()
            },
        }],
        container_edits: cdi::ContainerEdits {
            env: vec!["NVIDIA_VISIBLE_DEVICES=void".into()],
            device_nodes: vec![
                node("/dev/nvidiactl", "/dev/zero"),
                node("/dev/nvidia-uvm", "/dev/full"),
            ],
            mounts: vec![cdi::Mount {
                host_path: d.join("driver/libcuda.so").display().to_string(),
                container_path: LIB.into(),
                options: vec!["ro".into(), "nosuid".into(), "nodev".into(), "bind".into()],
            }],
            hooks: Vec::new(),
        },
    };
    let node_spec_path = d.join("node-spec.json");
    fs::write(&node_spec_path, serde_json::to_string(&node_spec).unwrap()).unwrap();
    let mut opts = gpu_dra::claims::Options::new("node-a");
    opts.cdi_dir = d.join("cdi").display().to_string();
    opts.node_spec = node_spec_path.display().to_string();
    opts.state_dir = d.join("dra-state").display().to_string();
    let allocations = std::sync::Arc::new(MemoryAllocations::new());
    let uid = "7b1c2d3e-4f50-4a6b-8c7d-9e0f1a2b3c4d";
    allocations.insert(
        uid,
        ClaimAllocation {
            namespace: "default".into(),
            name: "one-gpu".into(),
            devices: vec![AllocatedDevice {
                request: "gpu".into(),
                pool: "node-a".into(),
                device: "gpu-0".into(),
                share_id: None,
            }],
            configs: Vec::new(),
        },
    );
    let gpu = gpu_agent::inventory::Gpu {
        index: Some(0),
        minor: Some(0),
        uuid: Some(UUID.into()),
        model: Some("NVIDIA H100 80GB HBM3".into()),
        bus_id: "0000:18:00.0".parse().unwrap(),
        numa_node: None,
        pci: None,
        memory_mib: Some(81559),
        compute_capability: None,
        mig: None,
        nvlinks: 0,
        telemetry: Default::default(),
        mig_devices: Vec::new(),
        vgpu: None,
        fabric: None,
        brand: None,
        architecture: None,
        pcie_root: None,
    };
    let inv = gpu_agent::Inventory {
        machine: None,
        driver: Default::default(),
        backend: gpu_agent::inventory::BackendInfo {
            name: "test".into(),
            driver_version: Some("550.127.08".into()),
            error: None,
            lost: Vec::new(),
        },
        cuda_version: None,
        gpus: vec![gpu],
        pairs: Vec::new(),
        warnings: Vec::new(),
        unreadable: Vec::new(),
    };
    let claims = NodeClaims::open(HostRoot::system(), opts, allocations, &inv).unwrap();
    let claim = ClaimRef {
        namespace: "default".into(),
        name: "one-gpu".into(),
        uid: uid.into(),
    };
    let prepared = claims.prepare(std::slice::from_ref(&claim));
    let devices = prepared[uid]
        .clone()
        .unwrap_or_else(|e| panic!("prepare: {e}"));
    assert_eq!(devices.len(), 1, "{devices:?}");
    let id = devices[0].cdi_device_ids[0].clone();
    assert_eq!(id, format!("k8s.gpu.nvidia.com/claim={uid}-gpu-0"));

    let mut ok = check(host, c, &id);
    // What the claim's spec promises, read back as containerd reads it.
    let spec_file = d
        .join("cdi")
        .join(gpu_dra::claims::cdi::spec_file_name(uid));
    let claim_spec: cdi::Spec =
        serde_yaml_ng::from_str(&fs::read_to_string(&spec_file).unwrap()).unwrap();
    assert!(ok.expect_from_spec(&claim_spec), "{claim_spec:?}");
    assert_eq!(
        ok.expect_nodes,
        ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    );
    assert_eq!(ok.expect_paths, [LIB]);
    let report = rt
        .block_on(ok.run())
        .unwrap_or_else(|e| panic!("{e}\n{}", c.log()));
    assert_eq!(report.output, ["gpu-agent-check: ok"], "{report:?}");
    assert_eq!(report.paths, [LIB]);
    assert!(
        report
            .summary()
            .contains("3 device node(s), 1 driver file(s) and 1 environment variable(s)"),
        "{}",
        report.summary()
    );
    eprintln!("DRA claim {id}: {}", report.summary());

    let undone = claims.unprepare(std::slice::from_ref(&claim));
    assert_eq!(undone[uid], Ok(()));
    assert!(
        !spec_file.exists(),
        "{} left after unprepare",
        spec_file.display()
    );
    let mut gone = check(host, c, &id);
    gone.expect_nodes = vec!["/dev/nvidia0".into()];
    let e = rt.block_on(gone.run()).unwrap_err();
    assert!(
        e.to_string().contains("unresolvable CDI devices"),
        "{e}\n{}",
        c.log()
    );
}

#[test]
fn a_gpu_injected_by_cdi_is_checked_inside_a_container_of_a_real_containerd_2() {
    if let Some(why) = cannot_run_here() {
        eprintln!("SKIPPED: workload check against containerd 2.x: {why}");
        return;
    }
    let t0 = Instant::now();
    let c = Containerd::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let facts = rt.block_on(cri_ready(&c));
    let ready = t0.elapsed();
    assert_eq!(facts.name, "containerd", "{facts:?}");
    assert_eq!(facts.cdi_enabled, Some(true), "{facts:?}");
    c.ctr(&["images", "import", "-"], Some(&image_tar(IMAGE)));
    rt.block_on(cri_sees_image(&c));
    let imported = t0.elapsed();
    let host = HostRoot::system();
    let (spec, _) = gpu_spec();

    // 1. The GPU's nodes and environment are there.
    let mut ok = check(&host, &c, "nvidia.com/gpu=0");
    assert!(ok.expect_from_spec(&spec));
    assert_eq!(ok.expect_nodes, ["/dev/nvidia0", "/dev/nvidiactl"]);
    let report = rt
        .block_on(ok.run())
        .unwrap_or_else(|e| panic!("{e}\n{}", c.log()));
    assert_eq!(report.output, ["gpu-agent-check: ok"], "{report:?}");
    assert!(!report.pulled, "the imported image was pulled: {report:?}");
    assert_eq!(
        report.env,
        [("NVIDIA_VISIBLE_DEVICES".to_string(), "void".to_string())]
    );
    assert!(
        report
            .summary()
            .contains("2 device node(s) and 1 environment variable(s)"),
        "{}",
        report.summary()
    );
    assert!(report.cleanup_warnings.is_empty(), "{report:?}");
    eprintln!(
        "workload check passed in {:?} (image {:?}, sandbox {:?}, container {:?}, cleanup {:?}); containerd ready after {ready:?}, image imported after {imported:?}",
        report.elapsed,
        report.image_time,
        report.sandbox_time,
        report.container_time,
        report.cleanup_time
    );
    nothing_left(&c, "passing check");

    // 2. A CDI device the spec does not have: containerd's own words.
    let mut unknown = check(&host, &c, "nvidia.com/gpu=7");
    unknown.expect_nodes = vec!["/dev/nvidia7".into()];
    let e = rt.block_on(unknown.run()).unwrap_err();
    eprintln!("unknown: {e}");
    match &e {
        WorkloadError::ContainerRefused {
            action, message, ..
        } => {
            assert_eq!(*action, "create", "{e}");
            assert!(
                message.contains("unresolvable CDI devices nvidia.com/gpu=7"),
                "{e}"
            );
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(e.to_string().contains(IMAGE), "{e}");
    nothing_left(&c, "unknown CDI device");

    // 3. Missing and wrong things inside, one line each.
    let mut wrong = check(&host, &c, "nvidia.com/gpu=0");
    wrong.expect_nodes = vec![
        "/dev/nvidia0".into(),
        "/dev/nvidia1".into(),
        "/bin/busybox".into(),
    ];
    wrong.expect_env = vec![
        ("NVIDIA_VISIBLE_DEVICES".into(), "0".into()),
        ("GPU_AGENT_ABSENT".into(), "1".into()),
    ];
    let e = rt.block_on(wrong.run()).unwrap_err();
    eprintln!("wrong: {e}");
    match &e {
        WorkloadError::ChecksFailed {
            exit_code, lines, ..
        } => {
            assert_eq!(*exit_code, 1, "{e}");
            assert_eq!(
                lines,
                &[
                    "/dev/nvidia1 is missing",
                    "/bin/busybox is not a character device",
                    "NVIDIA_VISIBLE_DEVICES is void, want 0",
                    "GPU_AGENT_ABSENT is not set (want 1)",
                ],
                "{e}"
            );
        }
        other => panic!("expected failed checks, got {other:?}"),
    }
    nothing_left(&c, "failed checks");

    // 4. An image that cannot be had, named.
    let absent = "localhost:1/gpu-agent-test/absent:1";
    let mut no_image = check(&host, &c, "nvidia.com/gpu=0");
    no_image.image = absent.into();
    let e = rt.block_on(no_image.run()).unwrap_err();
    eprintln!("no_image: {e}");
    assert!(
        matches!(&e, WorkloadError::ImageUnavailable { image, .. } if image == absent),
        "{e:?}"
    );
    assert!(e.to_string().contains(absent), "{e}");
    nothing_left(&c, "absent image");

    // 5. Out of time while the runtime makes the sandbox: what it made once
    // it answers is removed all the same.
    let mut hurried = check(&host, &c, "nvidia.com/gpu=0");
    hurried.timeout = Duration::from_millis(20);
    let e = rt.block_on(hurried.run()).unwrap_err();
    eprintln!("hurried: {e}");
    assert!(matches!(e, WorkloadError::TimedOut { .. }), "{e:?}");
    nothing_left(&c, "timed out");

    // 6. A DRA claim: prepared by the node's claims (gpu-dra, as the
    // kubelet's NodePrepareResources does), its CDI ID handed to containerd
    // through the CRI puts the GPU's device nodes, the spec's control nodes
    // and the driver's files in the container; after unprepare the ID is
    // unknown to containerd.
    dra_claim(&rt, &host, &c);
    nothing_left(&c, "DRA claim");

    // 7. Can this node run it? This one can; a missing socket is named.
    assert_eq!(rt.block_on(workload::cannot_run_reason(&c.socket)), None);
    let nowhere = c.path().join("no-such.sock");
    let why = rt
        .block_on(workload::cannot_run_reason(&nowhere))
        .expect("a missing socket is a reason");
    assert!(why.contains(&nowhere.display().to_string()), "{why}");

    drop(rt);
    let dir = c.path().to_path_buf();
    drop(c);
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !info.contains(&dir.display().to_string()),
        "mounts left under {}:\n{info}",
        dir.display()
    );
    eprintln!("whole test: {:?}", t0.elapsed());
}
