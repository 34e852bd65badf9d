//! The kubelet's root directory comes from the policy
//! (`spec.hostPaths.kubeletRootDir`, the kubelet's `--root-dir`), and
//! `status` says whether the metrics carry pod labels and why not.
//!
//! A kubelet under `/var/lib/k0s/kubelet` (k0s's root dir) that is not our
//! code (tests/interop/podresources_standin.py, Python grpcio) serves the
//! Registration and pod-resources APIs there: the device plugin registers
//! with it, the metrics name its pod, and the metrics stage's validation
//! says where the pod labels come from. With a kubelet whose pod-resources
//! API cannot be reached (another root dir, or a kubelet before 1.28
//! without the `KubeletPodResources` gate) the validation fails in words
//! that say what to set; on a node without a kubelet it is no failure.

mod common;

use common::*;
use serde_json::Value;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BOUND: Duration = Duration::from_secs(20);
const K0S_ROOT: &str = "/var/lib/k0s/kubelet";

struct Killed(Vec<Child>);

impl Drop for Killed {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn policy(dir: &Path, port: u16, root: Option<&str>) -> PathBuf {
    let p = dir.join("policy.yaml");
    let root = root
        .map(|r| format!("  hostPaths:\n    kubeletRootDir: {r}\n"))
        .unwrap_or_default();
    fs::write(
        &p,
        format!("spec:\n  dcgmExporter:\n    listen: 127.0.0.1:{port}\n{root}"),
    )
    .unwrap();
    p
}

fn start_agent(host: &Path, policy: &Path) -> Child {
    at(host)
        .args(["--simulate", "t4-4", "--policy"])
        .arg(policy)
        .args(["run"])
        .stderr(fs::File::create(host.join("agent.log")).unwrap())
        .spawn()
        .unwrap()
}

/// Polls `status -o json` until the metrics stage has a validation.
fn metrics_validation(host: &Path) -> (Value, Value) {
    let deadline = Instant::now() + BOUND;
    loop {
        let (_, out, _) = run(at(host).args(["--simulate", "t4-4", "status", "-o", "json"]));
        if let Ok(st) = serde_json::from_str::<Value>(&out) {
            let m = stage(&st, "metrics");
            if m["validation"].is_object() && st["source"] == "running-agent" {
                return (m, st);
            }
        }
        assert!(
            Instant::now() < deadline,
            "the metrics stage has no validation within {BOUND:?}: {out}\n{}",
            fs::read_to_string(host.join("agent.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn scrape(port: u16) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body
}

fn first_gpu_uuid() -> String {
    let (code, out, err) = run(bin().args(["--simulate", "t4-4", "inventory", "-o", "json"]));
    assert_eq!(code, 0, "{err}");
    json(&out)["gpus"][0]["uuid"].as_str().unwrap().to_string()
}

#[test]
fn a_kubelet_under_another_root_dir_gets_the_plugin_and_names_the_pods() {
    let host = tempfile::tempdir().unwrap();
    let port = free_port();
    let uuid = first_gpu_uuid();
    let pods = host.path().join("pods.json");
    fs::write(
        &pods,
        serde_json::json!([{"name": "trainer-0", "namespace": "ml", "container": "main",
            "resource": "nvidia.com/gpu", "ids": [uuid]}])
        .to_string(),
    )
    .unwrap();
    let mut standin = Command::new(python())
        .arg(repo().join("tests/interop/podresources_standin.py"))
        .arg("--proto-dir")
        .arg(repo().join("proto/proto"))
        .arg("--host")
        .arg(host.path())
        .arg("--pods")
        .arg(&pods)
        .args(["--root-dir", K0S_ROOT])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut standin_err = BufReader::new(standin.stderr.take().unwrap());
    let mut children = Killed(vec![standin]);
    let mut line = String::new();
    standin_err.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "listening", "the stand-in said {line:?}");
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for l in standin_err.lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });

    let p = policy(host.path(), port, Some(K0S_ROOT));
    children.0.push(start_agent(host.path(), &p));
    // The plugin registers with the kubelet under its root dir.
    let registered = rx
        .recv_timeout(BOUND)
        .unwrap_or_else(|e| panic!("no registration: {e}"));
    assert!(
        registered.starts_with("registered nvidia.com/gpu at "),
        "{registered}"
    );
    assert!(
        host.path()
            .join("var/lib/k0s/kubelet/device-plugins/nvidia-gpu.sock")
            .exists()
    );
    assert!(!host.path().join("var/lib/kubelet").exists());

    let (m, _) = metrics_validation(host.path());
    assert_eq!(m["validation"]["ok"], true, "{m}");
    assert_eq!(
        m["validation"]["detail"],
        format!(
            "pod labels from the kubelet's pod-resources API ({K0S_ROOT}/pod-resources/kubelet.sock)"
        ),
        "{m}"
    );
    // And the series name the pod.
    let body = scrape(port);
    assert!(
        body.lines().any(|l| l.starts_with("DCGM_FI_DEV_GPU_UTIL{")
            && l.contains(&uuid)
            && l.contains("pod=\"trainer-0\"")
            && l.contains("namespace=\"ml\"")),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_says_why_the_metrics_have_no_pod_labels() {
    // A kubelet (its registration socket) without a pod-resources socket
    // where the policy says: the validation fails, saying what to set.
    let host = tempfile::tempdir().unwrap();
    let port = free_port();
    let dir = host.path().join("var/lib/kubelet/device-plugins");
    fs::create_dir_all(&dir).unwrap();
    let kubelet = gpu_agent::plugin::kubelet::MockKubelet::start(&dir.join("kubelet.sock"))
        .unwrap()
        .list_devices();
    let p = policy(host.path(), port, None);
    let _agent = Killed(vec![start_agent(host.path(), &p)]);
    assert!(kubelet.wait_for(1, BOUND).await);
    let (m, _) = metrics_validation(host.path());
    assert_eq!(m["validation"]["ok"], false, "{m}");
    let words = m["validation"]["detail"].as_str().unwrap();
    for part in [
        "no pod labels: ",
        "pod-resources/kubelet.sock does not exist",
        "set spec.hostPaths.kubeletRootDir if that is not /var/lib/kubelet",
        "KubeletPodResources",
    ] {
        assert!(words.contains(part), "{part:?} not in {words}");
    }
    assert!(
        m["detail"].as_str().unwrap().contains("no pod labels"),
        "{m}"
    );
    kubelet.stop().await;

    // No kubelet at all (bare metal): nothing to name, no failure.
    let host = tempfile::tempdir().unwrap();
    let port = free_port();
    let p = policy(host.path(), port, None);
    let _agent = Killed(vec![start_agent(host.path(), &p)]);
    let (m, _) = metrics_validation(host.path());
    assert_eq!(m["validation"]["ok"], true, "{m}");
    assert!(
        m["validation"]["detail"]
            .as_str()
            .unwrap()
            .starts_with("no pod labels: no kubelet on this node"),
        "{m}"
    );
}

#[test]
fn a_relative_kubelet_root_dir_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("p.yaml");
    fs::write(
        &p,
        "spec:\n  hostPaths:\n    kubeletRootDir: var/lib/kubelet\n",
    )
    .unwrap();
    let (code, _, err) = run(bin().args(["policy", "check"]).arg(&p));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("spec.hostPaths.kubeletRootDir"), "{err}");
}
