//! `status` shows what is true now: after each transition an operator
//! makes or meets (the device plugin turned off and on by a live policy
//! change, a policy change that restarts the plugin, a kubelet restart, an
//! agent restart), what `status -o json`, the status table and
//! `gpu_agent_plugin_registrations_total` say matches what the kubelet
//! stand-in saw: registrations received, sockets present.

mod common;

use common::*;
use gpu_agent::plugin::kubelet::MockKubelet;
use serde_json::Value;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

const BOUND: Duration = Duration::from_secs(15);

struct Node {
    host: tempfile::TempDir,
    policy: PathBuf,
    metrics_port: u16,
}

impl Node {
    fn new() -> Node {
        let host = tempfile::tempdir().unwrap();
        fs::create_dir_all(host.path().join("var/lib/kubelet/device-plugins")).unwrap();
        let policy = host.path().join("policy.yaml");
        let node = Node {
            host,
            policy,
            metrics_port: free_port(),
        };
        node.write_policy("");
        node
    }

    fn plugin_dir(&self) -> PathBuf {
        self.host.path().join("var/lib/kubelet/device-plugins")
    }

    /// The policy: metrics on a port of this test's own, plus `device_plugin`
    /// (lines under `spec.devicePlugin`).
    fn write_policy(&self, device_plugin: &str) {
        let dp = if device_plugin.is_empty() {
            String::new()
        } else {
            format!("  devicePlugin:\n{device_plugin}")
        };
        let text = format!(
            "spec:\n  dcgmExporter:\n    listen: 127.0.0.1:{}\n{dp}",
            self.metrics_port
        );
        // Whole at once (a rename), as an editor or a ConfigMap update writes.
        let tmp = self.policy.with_extension("tmp");
        fs::write(&tmp, text).unwrap();
        fs::rename(&tmp, &self.policy).unwrap();
    }

    fn start_agent(&self) -> Child {
        at(self.host.path())
            .args(["--simulate", "t4-4", "--policy"])
            .arg(&self.policy)
            .args(["run", "--heartbeat", "1"])
            .stderr(fs::File::create(self.host.path().join("agent.log")).unwrap())
            .spawn()
            .unwrap()
    }

    fn status(&self) -> Value {
        let (_, out, err) =
            run(at(self.host.path()).args(["--simulate", "t4-4", "status", "-o", "json"]));
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}{err}"))
    }

    fn status_table(&self) -> String {
        run(at(self.host.path()).args(["--simulate", "t4-4", "status"])).1
    }

    /// The plugin sockets present (besides the kubelet's).
    fn sockets(&self) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(self.plugin_dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n != "kubelet.sock")
            .collect();
        v.sort();
        v
    }

    /// `gpu_agent_plugin_registrations_total` for `nvidia.com/gpu`.
    fn registrations_metric(&self) -> Option<u64> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.metrics_port)).ok()?;
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            .ok()?;
        let mut body = String::new();
        s.read_to_string(&mut body).ok()?;
        body.lines()
            .find(|l| {
                l.starts_with("gpu_agent_plugin_registrations_total{")
                    && l.contains("resource=\"nvidia.com/gpu\"")
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    }

    fn log(&self) -> String {
        fs::read_to_string(self.host.path().join("agent.log")).unwrap_or_default()
    }
}

/// Polls until `f` holds; panics with what was last seen.
fn until(node: &Node, what: &str, mut f: impl FnMut(&Value) -> bool) -> Value {
    let deadline = Instant::now() + BOUND;
    loop {
        let st = node.status();
        if f(&st) {
            return st;
        }
        if Instant::now() > deadline {
            panic!(
                "{what}: not within {BOUND:?}; status:\n{}\nlog:\n{}",
                serde_json::to_string_pretty(&st["plugin"]).unwrap(),
                node.log()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn gpu(st: &Value) -> Option<&Value> {
    st["plugin"]
        .as_array()?
        .iter()
        .find(|r| r["resource"] == "nvidia.com/gpu")
}

fn registered(st: &Value, n: u64) -> bool {
    gpu(st).is_some_and(|r| r["registered"] == true && r["registrations"] == n)
}

async fn kubelet_at(dir: &Path) -> MockKubelet {
    MockKubelet::start(&dir.join("kubelet.sock"))
        .unwrap()
        .list_devices()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_matches_the_kubelet_through_off_on_policy_change_kubelet_and_agent_restarts() {
    let node = Node::new();
    let kubelet = kubelet_at(&node.plugin_dir()).await;
    let mut agent = node.start_agent();
    assert!(kubelet.wait_for(1, BOUND).await, "{}", node.log());
    until(&node, "registered once", |st| registered(st, 1));
    assert_eq!(node.sockets(), ["nvidia-gpu.sock"]);

    // A policy change that restarts the plugin: the kubelet saw a second
    // registration, and so does `status` (it went back to 1 before).
    node.write_policy("    deviceIdStrategy: index\n");
    assert!(kubelet.wait_for(2, BOUND).await, "{}", node.log());
    until(
        &node,
        "two registrations after the plugin restarted",
        |st| registered(st, 2),
    );

    // Turned off: no socket, and `status` shows no resource registered
    // (it kept `registered: true, lists: 1` and `8/8 yes (1x)` before).
    node.write_policy("    enabled: false\n");
    let st = until(&node, "no resource once the plugin is off", |st| {
        gpu(st).is_none()
    });
    let plugin_stage = stage(&st, "plugin");
    assert_eq!(plugin_stage["state"], "disabled", "{plugin_stage}");
    assert!(node.sockets().is_empty(), "{:?}", node.sockets());
    let table = node.status_table();
    assert!(
        !table.lines().any(|l| l.starts_with("nvidia.com/gpu")),
        "the table still lists the resource:\n{table}"
    );
    assert_eq!(kubelet.registrations().len(), 2);

    // On again: the third registration, counted on from before.
    node.write_policy("    deviceIdStrategy: index\n");
    assert!(kubelet.wait_for(3, BOUND).await, "{}", node.log());
    until(&node, "three registrations after on again", |st| {
        registered(st, 3)
    });
    let deadline = Instant::now() + BOUND;
    while node.registrations_metric() != Some(3) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(node.registrations_metric(), Some(3));

    // A kubelet restart (its socket gone, a new one made): one registration
    // with the new kubelet, the fourth in all.
    kubelet.stop().await;
    let kubelet = kubelet_at(&node.plugin_dir()).await;
    assert!(kubelet.wait_for(1, BOUND).await, "{}", node.log());
    until(
        &node,
        "four registrations after the kubelet restarted",
        |st| registered(st, 4),
    );
    assert_eq!(kubelet.registrations().len(), 1);

    // An agent restart: a new process, which registered once.
    assert_eq!(sigterm(&mut agent), Some(0));
    let mut agent = node.start_agent();
    assert!(kubelet.wait_for(2, BOUND).await, "{}", node.log());
    until(&node, "the new agent registered once", |st| {
        registered(st, 1)
    });
    assert_eq!(node.sockets(), ["nvidia-gpu.sock"]);
    assert_eq!(sigterm(&mut agent), Some(0));
    kubelet.stop().await;
}

/// A validation file exists only for what was validated: with the toolkit
/// and CDI both off nothing checked the container runtime, so no
/// `toolkit-ready` (an empty one was written before), while `driver-ready`
/// (the driver was checked) has the operator's content.
#[test]
fn no_validation_file_for_stages_that_are_off() {
    let host = tempfile::tempdir().unwrap();
    let policy = host.path().join("policy.yaml");
    fs::write(
        &policy,
        "spec:\n  toolkit:\n    enabled: false\n  cdi:\n    enabled: false\n  dcgmExporter:\n    enabled: false\n",
    )
    .unwrap();
    let (code, out, err) = run(at(host.path())
        .args(["--simulate", "t4-4", "--policy"])
        .arg(&policy)
        .args(["run", "--once"]));
    assert_eq!(code, 0, "{out}{err}");
    let validations = host.path().join("run/nvidia/validations");
    let driver_ready = fs::read_to_string(validations.join("driver-ready")).unwrap();
    assert!(
        driver_ready.starts_with("IS_HOST_DRIVER="),
        "{driver_ready}"
    );
    assert!(
        !validations.join("toolkit-ready").exists(),
        "toolkit-ready written although neither the runtime nor CDI was checked"
    );
}
