//! The cluster's ClusterPolicy reaches the agents: gpu-controller follows
//! the ClusterPolicy objects (a watch) and sends the policy to gpu-agent,
//! which runs it instead of its policy file, leaving out and naming the
//! operator's keys it does not use; a change to the ClusterPolicy is
//! applied by the running agent.

mod common;

use std::time::Duration;

use common::{MockApi, kubelet_node, start_controller, wait_for};
use serde_json::json;

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
    // The operator's keys gpu-agent knows (upgradePolicy is the
    // controller's own: not sent, not named), and two it does not.
    api.set_cluster_policy(
        "cluster-policy",
        json!({
            "driver": {"enabled": false, "repository": "nvcr.io/nvidia",
                       "upgradePolicy": {"autoUpgrade": true, "maxParallelUpgrades": 1}},
            "toolkit": {"enabled": false},
            "dcgmExporter": {"enabled": false},
            "sandboxWorkloads": {"enabled": false},
        }),
    );
    let dir = tempfile::tempdir().unwrap();
    let (mut controller, port, ca) = start_controller(&api, dir.path(), None);
    let host = dir.path().join("host");
    common::h100_host(&host);
    // Its own file turns the metrics exporter on; the cluster's turns it off.
    let policy = common::eks_policy();
    let global = [
        "--simulate".as_ref(),
        "h100-sxm-8".as_ref(),
        "--policy".as_ref(),
        policy.as_os_str(),
    ];
    let mut agent = common::reporting_agent(
        dir.path(),
        &host,
        &global,
        &[],
        port,
        &ca,
        "t1",
        "gpu-node-1",
    );
    let status = || common::agent_status(&host);
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
