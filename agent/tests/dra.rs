//! The DRA kubelet plugin in the running agent (issue 31): `spec.dra.enabled`
//! starts it beside the other front ends, a kubelet stand-in we did not
//! write (Python grpcio) registers it through the real registration socket,
//! `status` says what is true (the kubelet's verdict, DRA's GPUs and
//! devices, the checkpoint found at start), and SIGTERM takes both sockets
//! away. The claims' own behaviour is tested in crates/gpu-dra; the
//! controller's allocations reach prepare in controller/tests/dra_e2e.rs.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{at, json, python, repo, run, sigterm};

/// The 8x H100 fixture in `dir`, with the boot ID a real host has.
fn host(dir: &Path) -> std::path::PathBuf {
    let host = dir.join("host");
    let ok = Command::new("cp")
        .arg("-a")
        .arg(format!(
            "{}/.",
            repo().join("tests/fixtures/hosts/h100-sxm-8").display()
        ))
        .arg(&host)
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let boot = host.join("proc/sys/kernel/random");
    std::fs::create_dir_all(&boot).unwrap();
    std::fs::write(
        boot.join("boot_id"),
        "5f0c2a1e-7b3d-4c8e-9a61-2d4e6f8a0b1c\n",
    )
    .unwrap();
    host
}

fn policy(dir: &Path, dra: &str, device_plugin: bool) -> std::path::PathBuf {
    let p = dir.join("policy.yaml");
    std::fs::write(
        &p,
        format!(
            "spec:\n  reconcileIntervalSeconds: 0\n  driver: {{enabled: false}}\n  toolkit: {{enabled: false}}\n  devicePlugin: {{enabled: {device_plugin}}}\n  dra: {dra}\n"
        ),
    )
    .unwrap();
    p
}

fn start(host: &Path, policy: &Path) -> Child {
    at(host)
        .args(["--simulate", "h100-sxm-8", "--policy"])
        .arg(policy)
        .args(["--log-format", "text", "run"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(host.join("agent.log")).unwrap())
        .spawn()
        .unwrap()
}

fn status(host: &Path) -> serde_json::Value {
    let (_, out, _) = run(at(host).args(["status", "-o", "json"]));
    json(&out)
}

fn wait_for<T>(what: &str, host: &Path, mut f: impl FnMut(&serde_json::Value) -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let st = status(host);
        if let Some(v) = f(&st) {
            return v;
        }
        if Instant::now() > deadline {
            panic!(
                "{what}: not within 30 s; status: {st:#}\nlog:\n{}",
                std::fs::read_to_string(host.join("agent.log")).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The Python kubelet stand-in for one claim, reading steps on stdin.
struct Kubelet {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
}

impl Kubelet {
    fn start(host: &Path, claim: &str) -> Kubelet {
        let mut child = Command::new(python())
            .arg(repo().join("tests/interop/dra_kubelet_claim.py"))
            .arg("--proto-dir")
            .arg(repo().join("proto/proto"))
            .arg("--registry-dir")
            .arg(host.join("var/lib/kubelet/plugins_registry"))
            .arg("--host-root")
            .arg(host)
            .args(["--claim", claim])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        Kubelet { child, out }
    }

    fn next(&mut self) -> serde_json::Value {
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        assert!(
            !line.is_empty(),
            "the stand-in ended: {:?}",
            self.child.try_wait()
        );
        json(&line)
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn the_agent_serves_dra_and_the_kubelet_registers_it() {
    let dir = tempfile::tempdir().unwrap();
    let host = host(dir.path());
    let policy = policy(dir.path(), "{enabled: true}", false);
    let mut agent = start(&host, &policy);
    // Before any kubelet: serving, waiting for its word.
    let dra = wait_for("the DRA plugin serving", &host, |st| {
        let d = &st["dra"];
        (d["registration"] == "waiting for the kubelet").then(|| d.clone())
    });
    assert_eq!(
        dra["socket"],
        "/var/lib/kubelet/plugins_registry/gpu.nvidia.com-reg.sock"
    );
    assert_eq!(dra["gpus"].as_array().unwrap().len(), 8, "{dra:#}");
    let devices: Vec<&str> = dra["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap())
        .collect();
    assert_eq!(
        devices,
        [
            "gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-6", "gpu-7"
        ]
    );
    assert_eq!(dra["recovery"], "no checkpoint (first start)");
    assert!(dra.get("allocations").is_none(), "{dra:#}");

    let mut kubelet = Kubelet::start(
        &host,
        "default/one-gpu/0e0b7f4c-aaaa-4bbb-8ccc-000000000001",
    );
    let reg = kubelet.next();
    assert_eq!(reg["event"], "registered", "{reg}");
    assert_eq!(reg["type"], "DRAPlugin");
    assert_eq!(reg["name"], "gpu.nvidia.com");
    assert_eq!(
        reg["endpoint"],
        "/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock"
    );
    wait_for("the kubelet's verdict in status", &host, |st| {
        (st["dra"]["registered"] == true && st["dra"]["registration"] == "registered").then_some(())
    });
    let (_, text, _) = run(at(&host).arg("status"));
    assert!(
        text.contains("dra: registered · socket /var/lib/kubelet/plugins_registry/gpu.nvidia.com-reg.sock · 8 GPU(s)"),
        "{text}"
    );
    assert_eq!(sigterm(&mut agent), Some(0));
    for sock in [
        "var/lib/kubelet/plugins_registry/gpu.nvidia.com-reg.sock",
        "var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock",
    ] {
        assert!(!host.join(sock).exists(), "{sock} left behind");
    }
}

#[test]
fn dra_takes_only_the_gpus_the_policy_gives_it_and_the_device_plugin_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let host = host(dir.path());
    std::fs::create_dir_all(host.join("var/lib/kubelet/device-plugins")).unwrap();
    let policy = policy(
        dir.path(),
        "{enabled: true, gpus: [\"0\", \"GPU-2b7e4c19-8d3a-4f6b-9c20-1a2b3c4d5e02\", \"GPU-nowhere\"]}",
        true,
    );
    let mut agent = start(&host, &policy);
    let dra = wait_for("the DRA plugin serving", &host, |st| {
        let d = &st["dra"];
        (d["registration"] == "waiting for the kubelet").then(|| d.clone())
    });
    assert_eq!(dra["devices"], serde_json::json!(["gpu-0", "gpu-1"]));
    assert_eq!(dra["unmatched"], serde_json::json!(["GPU-nowhere"]));
    // The device plugin advertises the other six.
    let devices = wait_for("the device plugin's resource", &host, |st| {
        st["plugin"][0]["devices"].as_u64()
    });
    assert_eq!(devices, 6, "{:#}", status(&host)["plugin"]);
    assert_eq!(sigterm(&mut agent), Some(0));
    // With no agent running, `status` inspects the host: the plugin stage
    // says why it has six.
    let (_, out, _) = run(at(&host)
        .args(["--simulate", "h100-sxm-8", "--policy"])
        .arg(&policy)
        .args(["status", "-o", "json"]));
    let st = json(&out);
    assert_eq!(st["source"], "host-inspection");
    let detail = common::stage(&st, "plugin")["detail"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        detail.contains("(2 GPU(s) left to DRA by spec.dra.gpus)"),
        "{detail}"
    );
}

#[test]
fn dra_and_the_device_plugin_on_every_gpu_is_refused_naming_both_keys() {
    let dir = tempfile::tempdir().unwrap();
    let host = host(dir.path());
    let policy = policy(dir.path(), "{enabled: true}", true);
    let (code, out, err) = run(at(&host)
        .args(["--simulate", "h100-sxm-8", "--policy"])
        .arg(&policy)
        .args(["run", "--once"]));
    assert_ne!(code, 0, "{out}");
    assert!(
        err.contains("spec.dra.enabled")
            && err.contains("spec.devicePlugin.enabled: false")
            && err.contains("spec.dra.gpus"),
        "{err}"
    );
    // Nothing was served.
    assert!(!host.join("var/lib/kubelet/plugins_registry").exists());
}
