//! MPS sharing end to end: `gpu-agent run` on a copy of the 8x H100 host
//! fixture with the fake libnvidia-ml (the real NVML path) and a policy
//! sharing GPUs 0-1 in 4 MPS replicas (`nvidia.com/gpu.mps`) and GPU 2 in
//! 2 (`nvidia.com/gpu.mps2`). The host's `nvidia-cuda-mps-control` is a
//! stand-in (tests/interop/mps_control_standin.rs, compiled statically
//! here) that serves the pipe directory and records every command it
//! gets. Checked: one daemon per resource, chrooted into the host root
//! with its resource's env, directories and shm; the exact commands each
//! got (thread share, pinned-memory limit per device); EXCLUSIVE_PROCESS
//! on exactly the shared GPUs; Allocate's MPS answer through the plugin
//! socket (and `failRequestsGreaterThanOne`); a killed daemon started
//! again with a restart in `status`; SIGTERM sends `quit` and puts the
//! GPUs back to DEFAULT.
//!
//! The daemon runs in a mount namespace of its own, chrooted: root only.
//! A real MPS run needs a GPU; this proves what the agent does around it.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::*;
use gpu_agent::plugin::kubelet::{self, MockKubelet};
use gpu_agent_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use gpu_agent_proto::deviceplugin::v1beta1::{AllocateRequest, ContainerAllocateRequest, Mount};

const POLICY: &str = "spec:
  toolkit:
    reload: none
  devicePlugin:
    config:
      inline:
        version: v1
        sharing:
          mps:
            resources:
            - {name: nvidia.com/gpu, devices: [0, 1], replicas: 4, rename: gpu.mps}
            - {name: nvidia.com/gpu, devices: [2], replicas: 2, rename: gpu.mps2}
";

const GPU0: &str = "GPU-9d3b5a0e-1c7f-4e2a-8b61-0f2c3d4e5a01";
const GPU1: &str = "GPU-2b7e4c19-8d3a-4f6b-9c20-1a2b3c4d5e02";
const GPU2: &str = "GPU-7c1f9e2d-3b4a-4d8e-a1f3-2b3c4d5e6f03";

struct Agent {
    kubelet: Option<MockKubelet>,
    rt: tokio::runtime::Runtime,
    _dirs: Vec<tempfile::TempDir>,
    host: PathBuf,
    modes: PathBuf,
    child: Child,
    log: PathBuf,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // Daemons outlive a killed agent: end them by their pid files.
        for pid in daemon_pids(&self.host) {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
        if let Some(k) = self.kubelet.take() {
            self.rt.block_on(k.stop());
        }
    }
}

fn daemon_pids(host: &Path) -> Vec<nix::unistd::Pid> {
    ["gpu.mps", "gpu.mps2"]
        .iter()
        .filter_map(|r| {
            fs::read_to_string(pipe_dir(host, r).join("nvidia-cuda-mps-control.pid")).ok()
        })
        .filter_map(|t| t.trim().parse().ok())
        .map(nix::unistd::Pid::from_raw)
        .collect()
}

fn mps_dir(host: &Path, resource: &str) -> PathBuf {
    host.join("run/nvidia/mps/nvidia.com").join(resource)
}

fn pipe_dir(host: &Path, resource: &str) -> PathBuf {
    mps_dir(host, resource).join("pipe")
}

/// The stand-in's record for `resource`, line by line.
fn control_log(host: &Path, resource: &str) -> Vec<String> {
    fs::read_to_string(mps_dir(host, resource).join("log/control.log"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

impl Agent {
    fn start() -> Agent {
        let host_dir = common::copy_host_fixture("h100-sxm-8");
        let host = host_dir.path().to_path_buf();
        fs::create_dir_all(host.join("usr/bin")).unwrap();
        fs::create_dir_all(host.join("dev/shm")).unwrap();
        build_static_standin(
            "mps_control_standin.rs",
            &host.join("usr/bin/nvidia-cuda-mps-control"),
        );
        let work = tempfile::tempdir().unwrap();
        let policy = work.path().join("policy.yaml");
        fs::write(&policy, POLICY).unwrap();
        let modes = work.path().join("compute-modes");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let plugins = host.join("var/lib/kubelet/device-plugins");
        fs::create_dir_all(&plugins).unwrap();
        let kubelet = rt.block_on(async {
            MockKubelet::start(&plugins.join("kubelet.sock"))
                .unwrap()
                .list_devices()
        });
        let (nvml_dir, nvml) = fake_nvml();
        let log = work.path().join("agent.log");
        let child = at(&host)
            .arg("--policy")
            .arg(&policy)
            .arg("--nvml-lib")
            .arg(&nvml)
            .args(["--log-format", "text", "run"])
            .env("FAKE_NVML_NODE", "h100-sxm-8")
            .env("FAKE_NVML_COMPUTE_MODES", &modes)
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Agent {
            kubelet: Some(kubelet),
            rt,
            _dirs: vec![host_dir, work, nvml_dir],
            host,
            modes,
            child,
            log,
        }
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `status -o json`: the running agent's (exit 0), or, while it has
    /// not written its state yet, an inspection of the host (exit 3); the
    /// callers look at `source`.
    fn status(&self) -> serde_json::Value {
        let (code, out, err) = run(at(&self.host).args(["status", "-o", "json"]));
        assert!(code == 0 || code == 3, "exit {code}: {err}");
        json(&out)
    }

    /// Waits (up to `secs`) until `f` holds.
    fn until<T>(&self, secs: u64, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(v) = f() {
                return v;
            }
            if Instant::now() > deadline {
                panic!(
                    "{what}: not within {secs} s\nstatus: {:#}\nlog:\n{}",
                    self.status(),
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn mps_task(&self) -> Option<serde_json::Value> {
        let st = self.status();
        (st["source"] == "running-agent")
            .then(|| {
                st["tasks"]
                    .as_array()?
                    .iter()
                    .find(|t| t["name"] == "mps")
                    .cloned()
            })
            .flatten()
    }

    /// The compute modes the fake NVML was left with, by UUID.
    fn modes(&self) -> Vec<(String, String)> {
        fs::read_to_string(&self.modes)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split_once(' '))
            .map(|(u, m)| (u.to_string(), m.to_string()))
            .collect()
    }
}

/// The record of one daemon run: its start line's pid and visible GPUs,
/// its shm marker, and the commands after it.
fn runs(log: &[String]) -> Vec<(String, String, String, Vec<String>)> {
    let mut out: Vec<(String, String, String, Vec<String>)> = Vec::new();
    for line in log {
        if let Some(rest) = line.strip_prefix("start ") {
            let field = |k: &str| {
                rest.split(' ')
                    .find_map(|w| w.strip_prefix(&format!("{k}=")))
                    .unwrap_or_default()
                    .to_string()
            };
            out.push((field("pid"), field("visible"), field("shm"), Vec::new()));
        } else if let Some(last) = out.last_mut() {
            last.3.push(line.clone());
        }
    }
    out
}

fn root() -> bool {
    nix::unistd::geteuid().is_root()
}

#[test]
#[ignore = "needs root (the daemon runs in its own mount namespace, chrooted into the host root); scripts/test runs it as root"]
fn mps_daemons_are_run_configured_restarted_and_quit() {
    assert!(root(), "run as root (scripts/test does)");
    let mut a = Agent::start();
    let expected_mps = [
        "command get_default_active_thread_percentage",
        "command set_default_active_thread_percentage 25",
        "command set_default_device_pinned_mem_limit 0 20389M",
        "command set_default_device_pinned_mem_limit 1 20389M",
    ];
    let expected_mps2 = [
        "command get_default_active_thread_percentage",
        "command set_default_active_thread_percentage 50",
        "command set_default_device_pinned_mem_limit 0 40779M",
    ];
    // Registered with the kubelet, and both daemons configured.
    a.until(30, "both MPS resources registered", || {
        let st = a.status();
        let registered = |name: &str| {
            st["plugin"].as_array().is_some_and(|p| {
                p.iter()
                    .any(|r| r["resource"] == name && r["registered"] == true)
            })
        };
        (st["source"] == "running-agent"
            && registered("nvidia.com/gpu.mps")
            && registered("nvidia.com/gpu.mps2"))
        .then_some(())
    });
    a.until(10, "both daemons told their limits", || {
        let one = runs(&control_log(&a.host, "gpu.mps"));
        let two = runs(&control_log(&a.host, "gpu.mps2"));
        (one.len() == 1 && one[0].3.len() == 4 && two.len() == 1 && two[0].3.len() == 3)
            .then_some(())
    });
    let one = runs(&control_log(&a.host, "gpu.mps"));
    let two = runs(&control_log(&a.host, "gpu.mps2"));
    // Each daemon saw only its resource's GPUs, by UUID; exactly these
    // commands, limits by the daemon's own device numbers.
    assert_eq!(one[0].1, format!("{GPU0},{GPU1}"));
    assert_eq!(one[0].3, expected_mps);
    assert_eq!(two[0].1, GPU2);
    assert_eq!(two[0].3, expected_mps2);
    // Chrooted into the host root (its pipe directory, a host path, is
    // under the root), with the MPS shm directory as its /dev/shm.
    for (resource, run) in [("gpu.mps", &one[0]), ("gpu.mps2", &two[0])] {
        assert!(pipe_dir(&a.host, resource).join("control").exists());
        let marker = run
            .2
            .strip_prefix("/dev/shm/")
            .expect("the daemon wrote to /dev/shm");
        assert!(
            a.host.join("run/nvidia/mps/shm").join(marker).exists(),
            "{resource}"
        );
        assert!(
            !a.host.join("dev/shm").join(marker).exists(),
            "{resource}: the host's /dev/shm"
        );
    }
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode(&pipe_dir(&a.host, "gpu.mps")), 0o755);
    assert_eq!(mode(&mps_dir(&a.host, "gpu.mps").join("log")), 0o700);
    assert_eq!(mode(&a.host.join("run/nvidia/mps/shm")), 0o1777);
    // EXCLUSIVE_PROCESS on the shared GPUs, DEFAULT on the rest.
    let modes = a.modes();
    assert_eq!(modes.len(), 8, "{modes:?}");
    for (uuid, m) in &modes {
        let shared = [GPU0, GPU1, GPU2].contains(&uuid.as_str());
        assert_eq!(
            m,
            if shared {
                "EXCLUSIVE_PROCESS"
            } else {
                "DEFAULT"
            },
            "{uuid}"
        );
    }
    let task = a.mps_task().expect("task mps in status");
    assert_eq!(task["running"], true, "{task}");
    assert_eq!(task["restarts"], 0, "{task}");

    // Allocate, as the kubelet calls it on the plugin's socket.
    let sock = a
        .host
        .join("var/lib/kubelet/device-plugins/nvidia-gpu.mps.sock");
    let (resp, too_many) = a.rt.block_on(async {
        let mut c = DevicePluginClient::new(kubelet::connect(&sock).await.unwrap());
        let one = c
            .allocate(AllocateRequest {
                container_requests: vec![ContainerAllocateRequest {
                    devices_ids: vec![format!("{GPU1}::3")],
                }],
            })
            .await
            .unwrap()
            .into_inner();
        let two = c
            .allocate(AllocateRequest {
                container_requests: vec![ContainerAllocateRequest {
                    devices_ids: vec![format!("{GPU0}::0"), format!("{GPU0}::1")],
                }],
            })
            .await
            .unwrap_err();
        (one, two)
    });
    let c = &resp.container_responses[0];
    assert_eq!(
        c.envs["CUDA_MPS_PIPE_DIRECTORY"],
        "/mps/nvidia.com/gpu.mps/pipe"
    );
    assert_eq!(c.envs["NVIDIA_VISIBLE_DEVICES"], GPU1);
    assert_eq!(
        c.mounts,
        [
            Mount {
                container_path: "/mps/nvidia.com/gpu.mps/pipe".into(),
                host_path: "/run/nvidia/mps/nvidia.com/gpu.mps/pipe".into(),
                read_only: false
            },
            Mount {
                container_path: "/dev/shm".into(),
                host_path: "/run/nvidia/mps/shm".into(),
                read_only: false
            },
        ]
    );
    assert_eq!(too_many.code(), tonic::Code::InvalidArgument);
    assert!(
        too_many
            .message()
            .contains("maximum request size for shared resources is 1"),
        "{}",
        too_many.message()
    );

    // The gpu.mps daemon dies: started again, configured again; the
    // other one is left alone.
    let pid: i32 = one[0].0.parse().unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let task = a.until(15, "the killed daemon started again", || {
        let t = a.mps_task()?;
        let again = runs(&control_log(&a.host, "gpu.mps"));
        (t["restarts"] == 1 && t["running"] == true && again.len() == 2 && again[1].3.len() == 4)
            .then_some(t)
    });
    assert!(
        task["last_error"]
            .as_str()
            .unwrap()
            .contains("the MPS control daemon for nvidia.com/gpu.mps exited (killed by SIGKILL)"),
        "{task}"
    );
    let again = runs(&control_log(&a.host, "gpu.mps"));
    assert_ne!(again[1].0, one[0].0);
    assert_eq!(again[1].3, expected_mps);
    assert_eq!(runs(&control_log(&a.host, "gpu.mps2")).len(), 1);

    // SIGTERM: each daemon told to quit; the GPUs back to DEFAULT.
    assert_eq!(sigterm(&mut a.child), Some(0), "{}", a.log());
    for resource in ["gpu.mps", "gpu.mps2"] {
        let log = control_log(&a.host, resource);
        assert_eq!(
            log[log.len() - 2..],
            ["command quit", "quit"],
            "{resource}: {log:?}"
        );
        assert!(
            !pipe_dir(&a.host, resource)
                .join("nvidia-cuda-mps-control.pid")
                .exists()
        );
    }
    assert!(
        a.modes().iter().all(|(_, m)| m == "DEFAULT"),
        "{:?}",
        a.modes()
    );
}

/// What cannot be honoured is refused in `status`, naming the key and the
/// GPU, and labelled as not MPS-capable; what can is labelled as GFD
/// labels it. On simulated nodes (no MPS to run), no daemon is started.
#[test]
fn refusals_and_labels_through_the_cli() {
    let work = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = work.path().join(name);
        fs::write(&p, text).unwrap();
        p
    };
    let plugin_stage = |node: &str, policy: &Path| {
        let (code, out, err) = run(bin()
            .args(["--simulate", node, "--policy"])
            .arg(policy)
            .args(["status", "-o", "json"]));
        // No running agent: an inspection of the host (exit 3).
        assert_eq!(code, 3, "{err}");
        let st = json(&out);
        st["stages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["stage"] == "plugin")
            .unwrap()
            .clone()
    };
    let labels = |node: &str, policy: &Path| {
        let (code, out, err) = run(bin()
            .args(["--simulate", node, "--policy"])
            .arg(policy)
            .arg("labels"));
        assert_eq!(code, 0, "{err}");
        out
    };
    // MPS on MIG-enabled GPUs (mig.strategy none advertises them whole).
    let on_mig = write(
        "on-mig.yaml",
        "spec:\n  mig:\n    strategy: none\n  devicePlugin:\n    config:\n      inline:\n        version: v1\n        sharing:\n          mps:\n            resources:\n            - {name: nvidia.com/gpu, replicas: 2}\n",
    );
    let st = plugin_stage("h100-mig-2", &on_mig);
    assert_eq!(st["state"], "failed", "{st}");
    assert_eq!(
        st["detail"],
        "sharing.mps.resources[0] selects GPU 0 (GPU-6a1f0c2e-5b3d-4e7f-8a9b-1c2d3e4f5a00), which is in MIG mode: MPS cannot share a MIG-enabled GPU or its MIG devices (MIG and MPS on one GPU); leave it out with `devices`, or disable MIG on it"
    );
    let l = labels("h100-mig-2", &on_mig);
    assert!(l.contains("nvidia.com/mps.capable=false\n"), "{l}");
    // MPS on the H100s: four replicas each, labelled as GFD would.
    let ok = write(
        "ok.yaml",
        "spec:\n  devicePlugin:\n    config:\n      inline:\n        version: v1\n        sharing:\n          mps:\n            resources:\n            - {name: nvidia.com/gpu, replicas: 4}\n",
    );
    let st = plugin_stage("h100-sxm-8", &ok);
    assert_eq!(st["state"], "ready", "{st}");
    assert_eq!(st["detail"], "nvidia.com/gpu: 32 device(s)");
    let l = labels("h100-sxm-8", &ok);
    for want in [
        "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3-SHARED\n",
        "nvidia.com/gpu.replicas=4\n",
        "nvidia.com/gpu.sharing-strategy=mps\n",
        "nvidia.com/mps.capable=true\n",
    ] {
        assert!(l.contains(want), "{want} not in\n{l}");
    }
}
