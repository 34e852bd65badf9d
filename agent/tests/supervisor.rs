//! The running agent as a reconciler, end to end: `gpu-agent run` on a copy
//! of the 8x H100 host fixture with the fake libnvidia-ml (the real NVML
//! path), a containerd config, a FIFO standing in for /dev/kmsg and the
//! policy in a ConfigMap-shaped directory (`policy.yaml -> ..data/…`).
//! Drift is repaired by the interval reconcile and shows in `status`; a
//! ConfigMap update (the `..data` symlink swapped) is applied without a
//! signal; an invalid policy is refused and the running one kept; an XID
//! in the kernel log turns the GPU unhealthy; the operator's validation
//! files are written; SIGTERM removes the plugin socket and plugin-ready.
//! Device nodes are made for real, so this runs as root.

mod common;

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::*;

struct Agent {
    // Dropped last: the mock kubelet runs on it.
    kubelet: Option<gpu_agent::plugin::kubelet::MockKubelet>,
    rt: tokio::runtime::Runtime,
    _dirs: Vec<tempfile::TempDir>,
    host: PathBuf,
    cm: PathBuf,
    child: Child,
    log: PathBuf,
    kmsg: Option<fs::File>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(k) = self.kubelet.take() {
            self.rt.block_on(k.stop());
        }
    }
}

const POLICY_1: &str = "spec:\n  reconcileIntervalSeconds: 1\n  toolkit:\n    reload: none\n  cdi:\n    hookPath: /usr/local/bin/gpu-agent-hook\n";

/// Writes `text` as the ConfigMap's next version and swaps `..data` to it,
/// as the kubelet does (new dir, new symlink, rename over `..data`).
fn configmap_update(cm: &Path, version: &str, text: &str) {
    let dir = cm.join(format!("..{version}"));
    fs::create_dir(&dir).unwrap();
    fs::write(dir.join("policy.yaml"), text).unwrap();
    let tmp = cm.join("..data_tmp");
    std::os::unix::fs::symlink(format!("..{version}"), &tmp).unwrap();
    fs::rename(&tmp, cm.join("..data")).unwrap();
}

impl Agent {
    fn start(policy: &str) -> Agent {
        Agent::start_with(policy, None)
    }

    /// With `nvml_state`: the fake NVML's condition file (`FAKE_NVML_STATE`).
    fn start_with(policy: &str, nvml_state: Option<&Path>) -> Agent {
        let host_dir = common::copy_host_fixture("h100-sxm-8");
        let host = host_dir.path().to_path_buf();
        fs::create_dir_all(host.join("etc/containerd")).unwrap();
        fs::copy(
            fixture("containerd/valid/v2-custom.toml"),
            host.join("etc/containerd/config.toml"),
        )
        .unwrap();
        // The real containerd 2.x: asked for its version and, by
        // validation, for its effective configuration.
        common::install_containerd_2(&host);
        fs::create_dir_all(host.join("usr/local/bin")).unwrap();
        fs::write(host.join("usr/local/bin/gpu-agent-hook"), "#!/bin/sh\n").unwrap();
        // The kernel log: a FIFO the test writes to.
        let kmsg = host.join("dev/kmsg");
        nix::unistd::mkfifo(&kmsg, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        // The policy, as a ConfigMap volume shows it.
        let cm_dir = tempfile::tempdir().unwrap();
        let cm = cm_dir.path().to_path_buf();
        configmap_update(&cm, "2026_11_22_1", policy);
        std::os::unix::fs::symlink("..data/policy.yaml", cm.join("policy.yaml")).unwrap();
        // A kubelet that registers and lists (the plugin validates then).
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let plugins = host.join("var/lib/kubelet/device-plugins");
        fs::create_dir_all(&plugins).unwrap();
        let kubelet = rt.block_on(async {
            gpu_agent::plugin::kubelet::MockKubelet::start(&plugins.join("kubelet.sock"))
                .unwrap()
                .list_devices()
        });
        let (nvml_dir, nvml) = fake_nvml();
        let log = host.join("agent.log");
        let child = at(&host)
            .arg("--policy")
            .arg(cm.join("policy.yaml"))
            .arg("--nvml-lib")
            .arg(&nvml)
            .args(["--log-format", "text", "run"])
            .env("FAKE_NVML_NODE", "h100-sxm-8")
            .env(
                "FAKE_NVML_STATE",
                nvml_state.unwrap_or(Path::new("/nonexistent")),
            )
            // What the default level writes, and the supervisor's DEBUG
            // line at the end of each reconcile (an unchanged node's passes
            // write nothing above it).
            .env("GPU_AGENT_LOG", "info,gpu_agent::supervisor=debug")
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        // Open the FIFO's write end (the agent opens the read end).
        let writer = {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                match fs::OpenOptions::new()
                    .write(true)
                    .custom_flags_nonblock()
                    .open(&kmsg)
                {
                    Ok(f) => break Some(f),
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    Err(e) => panic!(
                        "the agent never opened /dev/kmsg: {e}\nlog:\n{}",
                        fs::read_to_string(&log).unwrap_or_default()
                    ),
                }
            }
        };
        Agent {
            kubelet: Some(kubelet),
            rt,
            _dirs: vec![host_dir, cm_dir, nvml_dir],
            host,
            cm,
            child,
            log,
            kmsg: writer,
        }
    }

    fn status(&self) -> serde_json::Value {
        let (code, out, err) = run(at(&self.host).args(["status", "-o", "json"]));
        // 3: no running agent answered yet (it is starting); the callers
        // wait for what they need in the status.
        assert!(code == 0 || code == 3, "{code}: {err}");
        json(&out)
    }

    fn stage(&self, st: &serde_json::Value, name: &str) -> serde_json::Value {
        common::stage(st, name)
    }

    /// Waits (up to `secs`) until `f` holds for the status.
    fn until(
        &self,
        secs: u64,
        what: &str,
        f: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let st = self.status();
            if st["source"] == "running-agent" && f(&st) {
                return st;
            }
            if Instant::now() > deadline {
                panic!(
                    "{what}: not within {secs} s\nstatus: {st:#}\nlog:\n{}",
                    fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

trait NonBlock {
    fn custom_flags_nonblock(&mut self) -> &mut Self;
}

impl NonBlock for fs::OpenOptions {
    fn custom_flags_nonblock(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        // Opening a FIFO for writing fails (ENXIO) until a reader has it open.
        self.custom_flags(libc::O_NONBLOCK)
    }
}

fn root() -> bool {
    nix::unistd::geteuid().is_root()
}

#[test]
fn drift_is_repaired_health_comes_from_the_kernel_log_and_sigterm_cleans_up() {
    if !root() {
        eprintln!("skipped: the agent makes device nodes (mknod), which needs root");
        return;
    }
    let mut a = Agent::start(POLICY_1);
    let st = a.until(20, "ready", |st| st["ready"] == true);
    for s in ["driver", "devnodes", "runtime", "cdi", "plugin"] {
        let v = &a.stage(&st, s)["validation"];
        assert_eq!(v["ok"], true, "{s}: {st:#}");
    }
    // The operator's validation files.
    let validations = a.host.join("run/nvidia/validations");
    let driver_ready = fs::read_to_string(validations.join("driver-ready")).unwrap();
    assert!(
        driver_ready.starts_with("IS_HOST_DRIVER=false\nNVIDIA_DRIVER_ROOT=/\n"),
        "{driver_ready}"
    );
    assert!(validations.join("toolkit-ready").exists());
    assert!(validations.join("plugin-ready").exists());
    assert_eq!(a.stage(&st, "cdi")["repairs"], 0);

    // Reconciles of the unchanged node (every second here) write nothing:
    // not the state file, not a validation file.
    let state_file = a.host.join("run/gpu-agent/state.json");
    std::thread::sleep(Duration::from_millis(1500));
    let stamp = |p: &Path| {
        let m = fs::metadata(p).unwrap();
        (m.modified().unwrap(), fs::read(p).unwrap())
    };
    let watched = [
        state_file.clone(),
        validations.join("driver-ready"),
        validations.join("toolkit-ready"),
        a.host.join("etc/containerd/config.toml"),
        a.host.join("var/run/cdi/gpu-agent-nvidia.com-gpu.json"),
    ];
    let before: Vec<_> = watched.iter().map(|p| stamp(p)).collect();
    let reconciles = |log: &str| {
        log.matches("reconcile{trigger=\"interval\"}: reconciled")
            .count()
    };
    let n0 = reconciles(&a.log());
    std::thread::sleep(Duration::from_millis(2500));
    assert!(
        reconciles(&a.log()) >= n0 + 2,
        "no reconcile ran:\n{}",
        a.log()
    );
    let after: Vec<_> = watched.iter().map(|p| stamp(p)).collect();
    for ((p, b), a) in watched.iter().zip(&before).zip(&after) {
        assert!(
            b == a,
            "{} was written by a reconcile of an unchanged node:\nbefore: {}\nafter: {}",
            p.display(),
            String::from_utf8_lossy(&b.1),
            String::from_utf8_lossy(&a.1)
        );
    }

    // Drift: the CDI spec deleted, a device node deleted.
    let spec = a.host.join("var/run/cdi/gpu-agent-nvidia.com-gpu.json");
    fs::remove_file(&spec).unwrap();
    fs::remove_file(a.host.join("dev/nvidia5")).unwrap();
    let st = a.until(5, "drift repaired by the interval reconcile", |st| {
        a.stage(st, "cdi")["repairs"] == 1 && a.stage(st, "devnodes")["repairs"] == 1
    });
    assert!(spec.exists());
    assert!(a.host.join("dev/nvidia5").exists());
    let last = &a.stage(&st, "devnodes")["last_repair"]["what"];
    assert_eq!(last, "created /dev/nvidia5", "{st:#}");
    let log = a.log();
    assert!(
        log.lines()
            .any(|l| l.contains("drift repaired") && l.contains("stage=\"cdi\"")),
        "{log}"
    );

    // An XID in the kernel log, for GPU 3 (bus 0000:5d:00.0).
    let uuid = "GPU-4e8a2b3c-9d1e-4f7a-b2c4-3c4d5e6f7a04";
    let line = "3,9001,0,-;NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n";
    a.kmsg.as_mut().unwrap().write_all(line.as_bytes()).unwrap();
    let st = a.until(5, "the kernel log's XID", |st| {
        st["health"]
            .as_array()
            .unwrap()
            .iter()
            .any(|g| g["uuid"] == uuid && g["healthy"] == false)
    });
    let g = st["health"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["uuid"] == uuid)
        .unwrap()
        .clone();
    assert!(
        g["reason"]
            .as_str()
            .unwrap()
            .starts_with("XID 79, from the kernel log"),
        "{g}"
    );
    assert!(
        g["advice"].as_str().unwrap().contains("drain and reboot"),
        "{g}"
    );
    let (_, table, _) = run(at(&a.host).arg("status"));
    assert!(table.contains("UNHEALTHY"), "{table}");
    assert!(table.contains("kernel-log"), "{table}");

    // SIGTERM: clean stop.
    assert_eq!(sigterm(&mut a.child), Some(0));
    let plugins = a.host.join("var/lib/kubelet/device-plugins");
    let left: Vec<_> = fs::read_dir(&plugins)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name())
                .filter(|n| n != "kubelet.sock")
                .collect()
        })
        .unwrap_or_default();
    assert!(left.is_empty(), "sockets left: {left:?}");
    assert!(!validations.join("plugin-ready").exists());
    let state = json(&fs::read_to_string(a.host.join("run/gpu-agent/state.json")).unwrap());
    assert!(state["stopped_at"].is_u64(), "{state:#}");
    assert_eq!(state["ready"], false);
}

#[test]
fn a_configmap_update_is_applied_and_an_invalid_policy_is_refused() {
    if !root() {
        eprintln!("skipped: the agent makes device nodes (mknod), which needs root");
        return;
    }
    // No interval: only the policy watch can apply the change.
    let a = Agent::start(
        &POLICY_1.replace("reconcileIntervalSeconds: 1", "reconcileIntervalSeconds: 0"),
    );
    a.until(20, "runtime done", |st| {
        a.stage(st, "runtime")["state"] == "done"
    });
    configmap_update(
        &a.cm,
        "2026_11_22_2",
        &POLICY_1
            .replace("reconcileIntervalSeconds: 1", "reconcileIntervalSeconds: 0")
            .replace(
                "  toolkit:\n    reload: none\n",
                "  toolkit:\n    enabled: false\n  health:\n    kernelLog: false\n",
            ),
    );
    let started = Instant::now();
    let st = a.until(5, "the new policy applied", |st| {
        a.stage(st, "runtime")["state"] == "disabled"
    });
    eprintln!("ConfigMap update applied in {:?}", started.elapsed());
    // The kernel-log reader is stopped by the new policy, and says why.
    let kmsg = st["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "kernel-log")
        .cloned()
        .unwrap();
    assert_eq!(kmsg["running"], false, "{st:#}");
    assert_eq!(kmsg["last_error"], "off: spec.health.kernelLog is false");

    // An invalid policy: refused, named, the running one kept.
    configmap_update(
        &a.cm,
        "2026_11_22_3",
        "spec:\n  toolkit:\n    enabled: maybe\n",
    );
    let st = a.until(5, "the invalid policy refused", |st| {
        st["policy_error"].is_string()
    });
    assert!(
        st["policy_error"]
            .as_str()
            .unwrap()
            .contains("spec.toolkit.enabled"),
        "{st:#}"
    );
    assert_eq!(a.stage(&st, "runtime")["state"], "disabled");
}

#[test]
fn a_failing_task_is_shown_and_started_again_while_the_others_go_on() {
    if !root() {
        eprintln!("skipped: the agent makes device nodes (mknod), which needs root");
        return;
    }
    let mut a = Agent::start(
        &POLICY_1.replace("reconcileIntervalSeconds: 1", "reconcileIntervalSeconds: 0"),
    );
    a.until(20, "ready", |st| st["ready"] == true);
    // The kubelet restarts; meanwhile something takes the plugin's socket
    // path (a directory): serving on it fails, so the plugin task fails.
    let plugins = a.host.join("var/lib/kubelet/device-plugins");
    let sock = plugins.join("nvidia-gpu.sock");
    let kubelet = a.kubelet.take().unwrap();
    a.rt.block_on(kubelet.stop());
    fs::remove_file(&sock).unwrap();
    fs::create_dir(&sock).unwrap();
    let restarted = a.rt.block_on(async {
        gpu_agent::plugin::kubelet::MockKubelet::start(&plugins.join("kubelet.sock"))
            .unwrap()
            .list_devices()
    });
    a.kubelet = Some(restarted);
    let task = |st: &serde_json::Value| {
        st["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == "plugin")
            .cloned()
            .unwrap()
    };
    let st = a.until(5, "the plugin task failed and waits to start again", |st| {
        let t = task(st);
        t["running"] == false && t["last_error"].is_string()
    });
    let t = task(&st);
    assert!(
        t["last_error"]
            .as_str()
            .unwrap()
            .contains("nvidia-gpu.sock"),
        "the error names the socket: {t}"
    );
    assert_eq!(a.stage(&st, "plugin")["state"], "failed", "{st:#}");
    assert_eq!(st["ready"], false);
    // The others go on: the kernel log still makes a GPU unhealthy.
    let line = "3,9002,0,-;NVRM: Xid (PCI:0000:18:00): 48, pid=1, name=x, An uncorrectable double bit error\n";
    a.kmsg.as_mut().unwrap().write_all(line.as_bytes()).unwrap();
    a.until(5, "health goes on", |st| {
        st["health"]
            .as_array()
            .unwrap()
            .iter()
            .any(|g| g["healthy"] == false)
    });
    // Whatever took the path goes away: the next start (backoff) serves again.
    fs::remove_dir(&sock).unwrap();
    let st = a.until(10, "the plugin started again and registered", |st| {
        let t = task(st);
        t["running"] == true
            && t["restarts"].as_u64().unwrap() >= 1
            && a.stage(st, "plugin")["state"] == "done"
    });
    let log = a.log();
    assert!(log.contains("task failed; starting it again"), "{log}");
    assert!(st["plugin"][0]["registered"] == true, "{st:#}");
}

#[test]
fn nvml_conditions_hold_a_gpu_until_they_clear() {
    if !root() {
        eprintln!("skipped: the agent makes device nodes (mknod), which needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("nvml-state");
    fs::write(&state, "").unwrap();
    let policy = POLICY_1.replace("spec:\n", "spec:\n  health:\n    recoverAfterSeconds: 1\n");
    let a = Agent::start_with(&policy, Some(&state));
    a.until(20, "ready", |st| st["ready"] == true);
    let gpu = |st: &serde_json::Value, uuid: &str| {
        st["health"]
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["uuid"] == uuid)
            .cloned()
            .unwrap()
    };
    let (gpu2, gpu3) = (
        "GPU-7c1f9e2d-3b4a-4d8e-a1f3-2b3c4d5e6f03",
        "GPU-4e8a2b3c-9d1e-4f7a-b2c4-3c4d5e6f7a04",
    );
    // NVML now says: GPU 3's remapped rows wait for a reset; GPU 2 runs hot.
    fs::write(&state, "3 remapped-pending\n2 hot\n").unwrap();
    let st = a.until(5, "the reconcile sees NVML's conditions", |st| {
        gpu(st, gpu3)["healthy"] == false && gpu(st, gpu2)["events"] == 1
    });
    assert_eq!(
        gpu(&st, gpu3)["reason"],
        "remapped rows pending: reset the GPU (drain it first)"
    );
    assert_eq!(
        gpu(&st, gpu2)["healthy"],
        true,
        "thermal only logs by default"
    );
    // Held while NVML reports it (recovery is 1 s; several reconciles pass).
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(gpu(&a.status(), gpu3)["healthy"], false);
    // Reset done: the condition clears, the quiet period runs, healthy.
    fs::write(&state, "").unwrap();
    a.until(6, "healthy again", |st| gpu(st, gpu3)["healthy"] == true);

    // NVML loses GPU 3 (every call about it: GPU_IS_LOST): it stays
    // advertised, unhealthy, until NVML sees it again.
    fs::write(&state, "3 lost\n").unwrap();
    let st = a.until(5, "the lost GPU", |st| gpu(st, gpu3)["healthy"] == false);
    assert_eq!(
        gpu(&st, gpu3)["reason"],
        "NVML has lost the GPU (fallen off the bus): drain and reboot the node"
    );
    let nvidia = &st["plugin"][0];
    assert_eq!(nvidia["devices"], 8, "{st:#}");
    assert_eq!(nvidia["unhealthy"], 1, "{st:#}");
    fs::write(&state, "").unwrap();
    a.until(6, "found again and healthy", |st| {
        gpu(st, gpu3)["healthy"] == true
    });
}
