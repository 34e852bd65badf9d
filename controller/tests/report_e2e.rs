//! The agent and the controller as real processes, over TLS: gpu-agent on
//! a simulated 8x H100 node reports to gpu-controller, which checks the
//! agent's token with the (scripted) API server's TokenReview and writes
//! the node's labels and conditions there. A token bound to another node is
//! refused in words the agent's `status` shows; an agent that stops makes
//! the conditions Unknown after the grace.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{MockApi, Proc, kubelet_node, report_client, start_controller, wait_for};
use serde_json::Value;

/// gpu-agent on a copy of the 8x H100 fixture (simulated GPUs, driver and
/// toolkit off as on EKS), reporting with `token` as `node`.
fn agent(dir: &Path, port: u16, ca: &Path, token: &str, node: &str) -> (Proc, PathBuf) {
    let host = dir.join(format!("host-{token}"));
    common::h100_host(&host);
    let policy = common::eks_policy();
    let global = [
        "--simulate".as_ref(),
        "h100-sxm-8".as_ref(),
        "--policy".as_ref(),
        policy.as_os_str(),
    ];
    let agent = common::reporting_agent(dir, &host, &global, &[], port, ca, token, node);
    (agent, host)
}

fn condition(node: &Value, kind: &str) -> Option<Value> {
    node["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
        .cloned()
}

/// A client we did not write (Python grpcio over TLS) is refused without a
/// token and for another node, gets the controller's Desired after Hello and
/// a snapshot, is cut off for a message out of sequence; its labels land.
#[test]
fn a_grpcio_client_is_served_and_refused_by_the_same_rules() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    api.add_node("py-node", kubelet_node());
    let account = "system:serviceaccount:gpu-agent:gpu-agent";
    api.add_token("py-token", account, "py-node");
    api.add_token("elsewhere-token", account, "gpu-node-9");
    let dir = tempfile::tempdir().unwrap();
    let (mut controller, port, ca) = start_controller(&api, dir.path(), None);
    let out = report_client(
        port,
        &ca,
        "py-node",
        &["--token", "py-token", "--other-token", "elsewhere-token"],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "grpcio client: {stdout}\n{}\ncontroller:\n{}",
        String::from_utf8_lossy(&out.stderr),
        controller.log()
    );
    let seen: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(
        seen["no_token"],
        serde_json::json!([
            "UNAUTHENTICATED",
            "no bearer token (the agent sends its projected service-account token)"
        ])
    );
    assert_eq!(seen["other_node"][0], "PERMISSION_DENIED");
    assert_eq!(
        seen["out_of_sequence"],
        serde_json::json!(["INVALID_ARGUMENT", "message seq 7 where 3 was due"])
    );
    wait_for(
        "the grpcio client's labels",
        Duration::from_secs(20),
        &[&controller],
        || {
            api.node("py-node")["metadata"]["labels"]["nvidia.com/gpu.product"]
                == "Python-Standin-GPU"
        },
    );
    controller.term();
}

/// The same client, checking in (the unary CheckIn): refused without a
/// token and for another node; a change before any snapshot is answered
/// with "send a snapshot"; health events sent twice (an answer lost) are
/// told once each; its labels land.
#[test]
fn a_grpcio_client_checks_in_by_the_same_rules() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    api.add_node("py-node", kubelet_node());
    let account = "system:serviceaccount:gpu-agent:gpu-agent";
    api.add_token("py-token", account, "py-node");
    api.add_token("elsewhere-token", account, "gpu-node-9");
    let dir = tempfile::tempdir().unwrap();
    let (mut controller, port, ca) = start_controller(&api, dir.path(), None);
    let out = report_client(
        port,
        &ca,
        "py-node",
        &[
            "--token",
            "py-token",
            "--other-token",
            "elsewhere-token",
            "--check-in",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "grpcio client: {stdout}\n{}\ncontroller:\n{}",
        String::from_utf8_lossy(&out.stderr),
        controller.log()
    );
    let seen: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(seen["other_node"][0], "PERMISSION_DENIED");
    assert_eq!(
        seen["both"],
        serde_json::json!([
            "INVALID_ARGUMENT",
            "a check-in with both a snapshot and a change"
        ])
    );
    wait_for(
        "the check-in's changed label, and three Events",
        Duration::from_secs(20),
        &[&controller],
        || {
            api.node("py-node")["metadata"]["labels"]["nvidia.com/gpu.product"]
                == "Python-Standin-GPU-2"
                && api
                    .events()
                    .iter()
                    .filter(|e| {
                        e["message"]
                            .as_str()
                            .unwrap_or("")
                            .contains("Python stand-in")
                    })
                    .count()
                    == 3
        },
    );
    // None told twice.
    std::thread::sleep(Duration::from_secs(1));
    let told = api
        .events()
        .iter()
        .filter(|e| {
            e["message"]
                .as_str()
                .unwrap_or("")
                .contains("Python stand-in")
        })
        .count();
    assert_eq!(told, 3, "{:#?}", api.events());
    controller.term();
}

#[test]
fn an_agent_reports_its_node_over_tls_and_the_controller_writes_it() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    api.add_node("gpu-node-1", kubelet_node());
    let account = "system:serviceaccount:gpu-agent:gpu-agent";
    api.add_token("agent-token", account, "gpu-node-1");
    api.add_token("neighbour-token", account, "gpu-node-2");
    let dir = tempfile::tempdir().unwrap();
    let (mut controller, port, ca) = start_controller(&api, dir.path(), None);
    let (mut agent1, host1) = agent(dir.path(), port, &ca, "agent-token", "gpu-node-1");

    // The node gets GFD's labels and the conditions.
    wait_for(
        "the node's labels and GPUHealthy",
        Duration::from_secs(60),
        &[&controller, &agent1],
        || {
            let n = api.node("gpu-node-1");
            n["metadata"]["labels"]["nvidia.com/gpu.count"] == "8"
                && condition(&n, "GPUHealthy").is_some()
        },
    );
    let n = api.node("gpu-node-1");
    let labels = &n["metadata"]["labels"];
    assert_eq!(labels["nvidia.com/gpu.product"], "NVIDIA-H100-80GB-HBM3");
    assert_eq!(labels["nvidia.com/gpu.present"], "true");
    assert_eq!(
        labels["kubernetes.io/hostname"], "gpu-node-1",
        "others' labels stay"
    );
    let health = condition(&n, "GPUHealthy").unwrap();
    assert_eq!(health["status"], "True");
    assert_eq!(health["message"], "8 of 8 GPUs healthy");
    // The CDI spec is written once the device plugin first serves: the
    // change follows the snapshot.
    wait_for(
        "GPUContainerRuntimeReady True",
        Duration::from_secs(30),
        &[&controller, &agent1],
        || {
            condition(&api.node("gpu-node-1"), "GPUContainerRuntimeReady")
                .is_some_and(|c| c["status"] == "True")
        },
    );
    let runtime = condition(&api.node("gpu-node-1"), "GPUContainerRuntimeReady").unwrap();
    assert_eq!(runtime["reason"], "Validated", "{runtime}");
    assert!(
        runtime["message"].as_str().unwrap().starts_with("cdi: "),
        "the runtime stage is off on EKS; CDI is what was checked: {runtime}"
    );
    // The token was reviewed for the controller's audience.
    let reviews: Vec<_> = api
        .requests()
        .into_iter()
        .filter(|r| {
            r.method == "POST"
                && r.uri
                    .starts_with("/apis/authentication.k8s.io/v1/tokenreviews")
        })
        .collect();
    assert!(!reviews.is_empty());
    assert_eq!(
        reviews[0].body["spec"]["audiences"],
        serde_json::json!(["gpu-controller"])
    );
    assert_eq!(reviews[0].body["spec"]["token"], "agent-token");
    let schemas = common::schema::load();
    let errs = common::schema::check(
        &schemas,
        "io.k8s.api.authentication.v1.TokenReview",
        &reviews[0].body,
        false,
    );
    assert!(errs.is_empty(), "{errs:?}");
    // The agent says it is connected.
    wait_for(
        "status: connected",
        Duration::from_secs(10),
        &[&agent1],
        || {
            common::agent_status(&host1).contains(&format!(
                "controller: https://localhost:{port}: connected as node gpu-node-1"
            ))
        },
    );

    // A token bound to another node cannot report for this one.
    let (agent2, host2) = agent(dir.path(), port, &ca, "neighbour-token", "gpu-node-1");
    wait_for(
        "the neighbour refused",
        Duration::from_secs(30),
        &[&controller, &agent2],
        || {
            common::agent_status(&host2).contains(
            "the controller refused the check-in: PermissionDenied: this token's pod runs on node gpu-node-2, not on gpu-node-1: an agent reports only for its own node",
        )
        },
    );
    drop(agent2);

    // The agent stops: after the grace, every condition is Unknown.
    agent1.term();
    wait_for(
        "conditions Unknown",
        Duration::from_secs(30),
        &[&controller],
        || {
            condition(&api.node("gpu-node-1"), "GPUHealthy")
                .is_some_and(|c| c["status"] == "Unknown" && c["reason"] == "AgentNotReporting")
        },
    );
    controller.term();
    assert!(
        controller.log().contains("agent checking in"),
        "{}",
        controller.log()
    );
}
