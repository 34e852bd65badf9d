//! The cluster's ClusterPolicy reaches the agents: gpu-controller follows
//! the ClusterPolicy objects (a watch) and sends the policy to gpu-agent,
//! which runs it instead of its policy file, leaving out and naming the
//! operator's keys it does not use; a change to the ClusterPolicy is
//! applied by the running agent.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{MockApi, Proc, kubelet_node, repo, start_controller, wait_for};
use serde_json::json;

fn agent_bin() -> std::path::PathBuf {
    Path::new(env!("CARGO_BIN_EXE_gpu-controller")).with_file_name("gpu-agent")
}

#[test]
fn the_cluster_policy_runs_on_the_agents() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    api.add_node("gpu-node-1", kubelet_node());
    api.add_token(
        "t1",
        "system:serviceaccount:gpu-agent:gpu-agent",
        "gpu-node-1",
    );
    // The operator's keys gpu-agent knows, and two it does not.
    api.set_cluster_policy(
        "cluster-policy",
        json!({
            "driver": {"enabled": false, "repository": "nvcr.io/nvidia"},
            "toolkit": {"enabled": false},
            "dcgmExporter": {"enabled": false},
            "sandboxWorkloads": {"enabled": false},
        }),
    );
    let dir = tempfile::tempdir().unwrap();
    let (mut controller, port, ca) = start_controller(&api, dir.path(), None);
    let host = dir.path().join("host");
    common::h100_host(&host);
    let token = dir.path().join("token");
    std::fs::write(&token, "t1").unwrap();
    let log = dir.path().join("agent.log");
    // Its own file turns the metrics exporter on; the cluster's turns it off.
    let mut agent = Proc {
        child: Command::new(agent_bin())
            .arg("--host-root")
            .arg(&host)
            .args(["--simulate", "h100-sxm-8", "--policy"])
            .arg(repo().join("tests/fixtures/policies/valid/eks-al2023.yaml"))
            .args(["--log-format", "text", "run", "--controller"])
            .arg(format!("https://localhost:{port}"))
            .arg("--controller-ca")
            .arg(&ca)
            .arg("--token-file")
            .arg(&token)
            .args(["--node-name", "gpu-node-1"])
            .env("DCGM_EXPORTER_LISTEN", "127.0.0.1:0")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
        log,
    };
    let status = || {
        let out = Command::new(agent_bin())
            .arg("--host-root")
            .arg(&host)
            .arg("status")
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let s = status();
        if s.contains("policy: the cluster's ClusterPolicy, from gpu-controller (the policy file is not used)") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the cluster's policy never showed:\n{s}\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let s = status();
    assert!(
        s.contains("policy: ClusterPolicy keys gpu-agent does not use (left out): spec.driver.repository, spec.sandboxWorkloads"),
        "{s}"
    );
    let metrics = s
        .lines()
        .find(|l| l.trim_start().starts_with("metrics"))
        .unwrap_or("")
        .to_string();
    assert!(
        metrics.contains("disabled"),
        "the cluster's policy turns the exporter off: {metrics}\n{s}"
    );

    // Its status says whether the agents run it, and what they leave out
    // (no kubelet here: the device plugin never validates).
    let want = "0 of 1 reporting nodes run it (gpu-node-1: not every stage is validated); keys gpu-agent does not use: spec.driver.repository, spec.sandboxWorkloads";
    wait_for(
        "the ClusterPolicy's status",
        Duration::from_secs(30),
        &[&controller, &agent],
        || api.cluster_policy("cluster-policy")["status"]["conditions"][0]["message"] == want,
    );
    let st = api.cluster_policy("cluster-policy")["status"].clone();
    assert_eq!(st["state"], "notReady");
    assert_eq!(st["conditions"][0]["type"], "Ready");
    assert_eq!(st["conditions"][0]["status"], "False");
    assert_eq!(st["conditions"][0]["reason"], "AgentsNotReady");
    let status_patch = api
        .requests()
        .into_iter()
        .find(|r| {
            r.uri
                .starts_with("/apis/nvidia.com/v1/clusterpolicies/cluster-policy/status")
        })
        .unwrap();
    assert_eq!(status_patch.method, "PATCH");
    assert_eq!(status_patch.content_type, "application/merge-patch+json");

    // The ClusterPolicy changes: the running agent follows.
    api.set_cluster_policy(
        "cluster-policy",
        json!({
            "driver": {"enabled": false},
            "toolkit": {"enabled": false},
            "dcgmExporter": {"enabled": true},
        }),
    );
    wait_for(
        "the changed policy on the agent",
        Duration::from_secs(30),
        &[&controller, &agent],
        || {
            let s = status();
            !s.contains("keys gpu-agent does not use")
                && s.lines()
                    .any(|l| l.trim_start().starts_with("metrics") && !l.contains("disabled"))
        },
    );
    agent.term();
    controller.term();
}
