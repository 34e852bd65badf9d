//! The writer against the scripted API server: the exact requests for a
//! node's labels, conditions and taint, none when nothing changed, a
//! conflict read again, and every body checked against the real schemas.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{MockApi, Recorded, kubelet_node, schema};
use gpu_agent_proto::report::v1 as pb;
use gpu_controller::fleet::Fleet;
use gpu_controller::node::TaintPolicy;
use gpu_controller::writer::Writer;
use serde_json::{Value, json};

const NODE: &str = "gpu-node-1";

fn report(healthy: [bool; 2], extra_label: bool) -> pb::NodeReport {
    let mut labels: Vec<(&str, &str)> = vec![
        ("nvidia.com/gpu.present", "true"),
        ("nvidia.com/gpu.count", "2"),
        ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
    ];
    if extra_label {
        labels.push(("nvidia.com/gpu.family", "hopper"));
    }
    let stage = |name: &str, state: &str, ok: Option<bool>| pb::Stage {
        name: name.into(),
        state: state.into(),
        detail: format!("{name} detail"),
        validated: ok,
        validation_message: format!("{name} checked"),
        ..Default::default()
    };
    pb::NodeReport {
        stages: Some(pb::Stages {
            stages: vec![
                stage("driver", "done", Some(true)),
                stage("devnodes", "done", Some(true)),
                stage("runtime", "done", Some(true)),
                stage("cdi", "done", Some(true)),
                stage("plugin", "done", Some(true)),
            ],
            ready: true,
        }),
        labels: Some(pb::Labels {
            labels: labels
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }),
        health: Some(pb::Health {
            gpus: healthy
                .iter()
                .enumerate()
                .map(|(n, h)| pb::GpuHealth {
                    uuid: format!("GPU-{n}"),
                    healthy: *h,
                    reason: if *h { String::new() } else { "XID 79".into() },
                    advice: if *h {
                        String::new()
                    } else {
                        "fallen off the bus; drain and reboot".into()
                    },
                    ..Default::default()
                })
                .collect(),
        }),
        ..Default::default()
    }
}

fn setup(api: &MockApi) -> (Arc<Fleet>, Writer) {
    let (fleet, _queue) = Fleet::new(TaintPolicy::NoneHealthy, Duration::from_secs(60));
    let fleet = Arc::new(fleet);
    let (down, _) = tokio::sync::mpsc::channel(8);
    fleet.connect(
        pb::Hello {
            node_name: NODE.into(),
            ..Default::default()
        },
        down,
    );
    (fleet, Writer::new(api.client()))
}

fn summary(r: &[Recorded]) -> Vec<String> {
    r.iter()
        .map(|r| format!("{} {}", r.method, r.uri))
        .collect()
}

fn check_bodies(r: &[Recorded]) {
    let schemas = schema::load();
    for req in r.iter().filter(|r| r.method == "PATCH") {
        let errs = schema::check(&schemas, "io.k8s.api.core.v1.Node", &req.body, true);
        assert!(
            errs.is_empty(),
            "{} {}: {errs:?}\n{}",
            req.method,
            req.uri,
            req.body
        );
    }
}

const APPLY: &str = "PATCH /api/v1/nodes/gpu-node-1?&force=true&fieldManager=gpu-controller";
const APPLY_STATUS: &str =
    "PATCH /api/v1/nodes/gpu-node-1/status?&force=true&fieldManager=gpu-controller";
const GET: &str = "GET /api/v1/nodes/gpu-node-1";
const MERGE: &str = "PATCH /api/v1/nodes/gpu-node-1?&fieldManager=gpu-controller";

fn condition<'a>(node: &'a Value, kind: &str) -> &'a Value {
    node["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == kind)
        .unwrap_or_else(|| panic!("no condition {kind} in {node}"))
}

#[tokio::test]
async fn a_node_gets_labels_conditions_and_taint_and_nothing_when_nothing_changed() {
    let api = MockApi::start().await;
    api.add_node(NODE, kubelet_node());
    let (fleet, writer) = setup(&api);

    // First report: read once, labels and conditions applied; no taint.
    fleet.apply(
        NODE,
        pb::agent_message::Body::Snapshot(report([true, true], true)),
    );
    writer.write_node(&fleet, NODE).await;
    let r = api.take();
    assert_eq!(summary(&r), [GET, APPLY, APPLY_STATUS]);
    check_bodies(&r);
    assert_eq!(r[1].content_type, "application/apply-patch+yaml");
    assert_eq!(
        r[1].body,
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {
            "nvidia.com/gpu.count": "2", "nvidia.com/gpu.family": "hopper",
            "nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}})
    );
    let conds = r[2].body["status"]["conditions"].as_array().unwrap();
    let kinds: Vec<(&str, &str, &str)> = conds
        .iter()
        .map(|c| {
            (
                c["type"].as_str().unwrap(),
                c["status"].as_str().unwrap(),
                c["reason"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            ("GPUDriverReady", "True", "Validated"),
            ("GPUContainerRuntimeReady", "True", "Validated"),
            ("GPUDevicePluginReady", "True", "Validated"),
            ("GPUHealthy", "True", "AllHealthy"),
        ]
    );
    let node = api.node(NODE);
    assert_eq!(
        node["metadata"]["labels"]["kubernetes.io/hostname"],
        "gpu-node-1"
    );
    assert_eq!(
        condition(&node, "Ready")["reason"],
        "KubeletReady",
        "the kubelet's condition stays"
    );
    let driver_since = condition(&node, "GPUDriverReady")["lastTransitionTime"].clone();

    // The same again: not one request.
    fleet.apply(
        NODE,
        pb::agent_message::Body::Change(report([true, true], true)),
    );
    writer.write_node(&fleet, NODE).await;
    assert_eq!(summary(&api.take()), Vec::<String>::new());

    // Both GPUs unhealthy: the condition says why, the taint goes on beside
    // the other taint, guarded by the resourceVersion read; a racing write
    // is read again.
    api.conflict_next(1);
    fleet.apply(
        NODE,
        pb::agent_message::Body::Change(report([false, false], true)),
    );
    writer.write_node(&fleet, NODE).await;
    let r = api.take();
    assert_eq!(summary(&r), [APPLY_STATUS, GET, MERGE, GET, MERGE]);
    check_bodies(&r);
    assert_eq!(r[2].content_type, "application/merge-patch+json");
    let rv = r[4].body["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    let taints = &r[4].body["spec"]["taints"];
    assert_eq!(
        taints[0],
        json!({"key": "dedicated", "value": "ml", "effect": "NoSchedule"})
    );
    assert_eq!(taints[1]["key"], "nvidia.com/gpu.health");
    assert_eq!(taints[1]["value"], "unhealthy");
    assert_eq!(taints[1]["effect"], "NoSchedule");
    let node = api.node(NODE);
    assert_ne!(
        node["metadata"]["resourceVersion"],
        rv.as_str(),
        "the patch moved it on"
    );
    assert_eq!(node["spec"]["taints"].as_array().unwrap().len(), 2);
    let health = condition(&node, "GPUHealthy");
    assert_eq!(health["status"], "False");
    assert_eq!(
        health["message"],
        "2 of 2 GPUs unhealthy: XID 79 on GPU-0: fallen off the bus; drain and reboot; XID 79 on GPU-1: fallen off the bus; drain and reboot"
    );
    assert_eq!(
        condition(&node, "GPUDriverReady")["lastTransitionTime"],
        driver_since,
        "an unchanged condition keeps its transition time"
    );

    // Recovered, and a label no longer holds: the taint comes off (the
    // other stays), the label is removed, the kubelet's labels stay.
    fleet.apply(
        NODE,
        pb::agent_message::Body::Change(report([true, true], false)),
    );
    writer.write_node(&fleet, NODE).await;
    let r = api.take();
    assert_eq!(summary(&r), [APPLY, APPLY_STATUS, GET, MERGE]);
    check_bodies(&r);
    let node = api.node(NODE);
    assert_eq!(
        node["spec"]["taints"],
        json!([{"key": "dedicated", "value": "ml", "effect": "NoSchedule"}])
    );
    assert!(
        node["metadata"]["labels"]
            .get("nvidia.com/gpu.family")
            .is_none()
    );
    assert_eq!(
        node["metadata"]["labels"]["node.kubernetes.io/instance-type"],
        "p5.48xlarge"
    );
    assert_eq!(condition(&node, "GPUHealthy")["status"], "True");
}

#[tokio::test]
async fn a_node_the_cluster_does_not_have_is_said_and_not_written() {
    let api = MockApi::start().await;
    let (fleet, writer) = setup(&api);
    fleet.apply(
        NODE,
        pb::agent_message::Body::Snapshot(report([true, true], true)),
    );
    writer.write_node(&fleet, NODE).await;
    assert_eq!(summary(&api.take()), [GET]);
    let err = fleet.with(NODE, |e| e.write.last_error.clone());
    assert_eq!(
        err.as_deref(),
        Some("node gpu-node-1: no such node in the cluster")
    );
    assert_eq!(
        writer
            .stats
            .failures
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

#[tokio::test]
async fn an_agent_gone_past_its_grace_makes_every_condition_unknown() {
    let api = MockApi::start().await;
    api.add_node(NODE, kubelet_node());
    let (fleet, writer) = setup(&api);
    fleet.apply(
        NODE,
        pb::agent_message::Body::Snapshot(report([false, false], true)),
    );
    writer.write_node(&fleet, NODE).await;
    api.take();
    // The stream ends; the grace runs out.
    assert!(fleet.disconnect(NODE, 1, "the agent closed the stream"));
    fleet.expire(NODE, "the agent closed the stream");
    writer.write_node(&fleet, NODE).await;
    let r = api.take();
    assert_eq!(
        summary(&r),
        [APPLY_STATUS],
        "labels and taint stay as they were"
    );
    let node = api.node(NODE);
    for kind in [
        "GPUDriverReady",
        "GPUContainerRuntimeReady",
        "GPUDevicePluginReady",
        "GPUHealthy",
    ] {
        let c = condition(&node, kind);
        assert_eq!(c["status"], "Unknown", "{kind}");
        assert_eq!(c["reason"], "AgentNotReporting");
        assert_eq!(
            c["message"],
            "gpu-agent on this node is not reporting: the agent closed the stream"
        );
    }
    assert_eq!(
        node["spec"]["taints"].as_array().unwrap().len(),
        2,
        "the taint is kept"
    );
}

/// Every condition the writer applies carries `lastHeartbeatTime` (a
/// `Time`: RFC 3339, whole seconds), the time of the write, so `kubectl
/// describe node` shows when it was said (it printed year 1); a later write
/// moves it on for every condition, while `lastTransitionTime` stays where
/// the status did not change.
#[tokio::test]
async fn conditions_carry_the_time_of_their_last_write_as_heartbeat() {
    let api = MockApi::start().await;
    api.add_node(NODE, kubelet_node());
    let (fleet, writer) = setup(&api);
    let before = jiff::Timestamp::now().as_second();
    fleet.apply(
        NODE,
        pb::agent_message::Body::Snapshot(report([true, true], true)),
    );
    writer.write_node(&fleet, NODE).await;
    check_bodies(&api.take());
    let time = |c: &Value, field: &str| -> i64 {
        let t = c[field]
            .as_str()
            .unwrap_or_else(|| panic!("no {field} in {c}"));
        assert!(
            t.ends_with('Z') && !t.contains('.'),
            "{field} {t}: a Time is RFC 3339 in whole seconds"
        );
        t.parse::<jiff::Timestamp>().unwrap().as_second()
    };
    let ours = |n: &Value| -> Vec<Value> {
        n["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["type"].as_str().is_some_and(|t| t.starts_with("GPU")))
            .cloned()
            .collect()
    };
    let first = ours(&api.node(NODE));
    assert!(!first.is_empty());
    for c in &first {
        let beat = time(c, "lastHeartbeatTime");
        assert!(
            beat >= before && beat <= jiff::Timestamp::now().as_second(),
            "{c}"
        );
        assert_eq!(beat, time(c, "lastTransitionTime"), "{c}");
    }
    // A GPU goes unhealthy two seconds later: every condition is said
    // again; only the changed ones move their transition time.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    fleet.apply(
        NODE,
        pb::agent_message::Body::Change(report([true, false], true)),
    );
    writer.write_node(&fleet, NODE).await;
    check_bodies(&api.take());
    let second = ours(&api.node(NODE));
    for c in &second {
        let was = first.iter().find(|f| f["type"] == c["type"]).unwrap();
        assert!(
            time(c, "lastHeartbeatTime") >= time(was, "lastHeartbeatTime") + 2,
            "{was} then {c}"
        );
        if c["status"] == was["status"] {
            assert_eq!(c["lastTransitionTime"], was["lastTransitionTime"], "{c}");
        } else {
            assert!(time(c, "lastTransitionTime") > time(was, "lastTransitionTime"));
        }
    }
    assert!(
        second
            .iter()
            .zip(&first)
            .any(|(c, was)| c["status"] != was["status"]),
        "a condition changed: {second:#?}"
    );
}
