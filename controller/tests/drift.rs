//! What is changed in the API behind the controller's back comes back: a
//! GPU feature discovery label removed or changed by hand, the health taint
//! taken off, a condition overwritten, a Node deleted and registered again.
//! The controller watches the nodes and writes only what differs from what
//! the agent says, through the same requests as ever (server-side apply of
//! the labels and conditions under its field manager, the taint list at the
//! resourceVersion read); the user's own labels and taints stay, and while
//! nothing of its own differs it sends nothing, whatever else changes.
//!
//! A gpu-controller process against the scripted API server (a watch from
//! the list's resourceVersion, events after it, a bookmark); every body it
//! sends is checked against the real 1.36 schemas.

mod common;

use std::time::{Duration, Instant};

use common::{
    MockApi, Proc, Recorded, fake_agent, kubelet_node, schema, start_controller, wait_for,
};
use gpu_agent_proto::report::v1 as pb;
use serde_json::{Value, json};

const NODE: &str = "gpu-node-1";
const ACCOUNT: &str = "system:serviceaccount:gpu-agent:gpu-agent";
const APPLY: &str = "PATCH /api/v1/nodes/gpu-node-1?&force=true&fieldManager=gpu-controller";
const APPLY_STATUS: &str =
    "PATCH /api/v1/nodes/gpu-node-1/status?&force=true&fieldManager=gpu-controller";
const GET: &str = "GET /api/v1/nodes/gpu-node-1";
const MERGE: &str = "PATCH /api/v1/nodes/gpu-node-1?&fieldManager=gpu-controller";

/// Two H100s, both fallen off the bus: GFD's labels, four conditions (one
/// False) and the health taint wanted.
fn report() -> pb::NodeReport {
    let stage = |name: &str| pb::Stage {
        name: name.into(),
        state: "done".into(),
        detail: format!("{name} detail"),
        validated: Some(true),
        validation_message: format!("{name} checked"),
        ..Default::default()
    };
    pb::NodeReport {
        stages: Some(pb::Stages {
            stages: ["driver", "devnodes", "runtime", "cdi", "plugin"]
                .into_iter()
                .map(stage)
                .collect(),
            ready: true,
        }),
        labels: Some(pb::Labels {
            labels: [
                ("nvidia.com/gpu.present", "true"),
                ("nvidia.com/gpu.count", "2"),
                ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        }),
        health: Some(pb::Health {
            gpus: (0..2)
                .map(|n| pb::GpuHealth {
                    uuid: format!("GPU-{n}"),
                    healthy: false,
                    reason: "XID 79".into(),
                    advice: "fallen off the bus; drain and reboot".into(),
                    ..Default::default()
                })
                .collect(),
        }),
        ..Default::default()
    }
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
        assert!(errs.is_empty(), "{}: {errs:?}\n{}", req.uri, req.body);
    }
}

fn condition(node: &Value, kind: &str) -> Value {
    node["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == kind)
        .cloned()
        .unwrap_or(Value::Null)
}

fn label(node: &Value, key: &str) -> Value {
    node["metadata"]["labels"][key].clone()
}

fn tainted(node: &Value) -> bool {
    node["spec"]["taints"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|t| t["key"] == "nvidia.com/gpu.health" && t["effect"] == "NoSchedule")
}

/// All the agent says is on the node.
fn carries_it_all(node: &Value) -> bool {
    label(node, "nvidia.com/gpu.product") == "NVIDIA-H100-80GB-HBM3"
        && label(node, "nvidia.com/gpu.count") == "2"
        && label(node, "nvidia.com/gpu.present") == "true"
        && condition(node, "GPUHealthy")["reason"] == "Unhealthy"
        && condition(node, "GPUDriverReady")["status"] == "True"
        && tainted(node)
}

/// The node (with a label and a taint of the user's), a controller and an
/// agent reporting it; returns once the node carries the report and the
/// controller has been quiet a while (the requests so far forgotten).
fn setup(
    rt: &tokio::runtime::Runtime,
    api: &MockApi,
    dir: &std::path::Path,
) -> (Proc, common::FakeAgent) {
    let mut node = kubelet_node();
    node["metadata"]["labels"]["team"] = json!("ml");
    api.add_node(NODE, node);
    api.add_token("t1", ACCOUNT, NODE);
    let (controller, port, ca) = start_controller(api, dir, None);
    let agent = rt
        .block_on(fake_agent(port, &ca, "t1", NODE, report(), vec![]))
        .unwrap();
    wait_for(
        "the report on the node",
        Duration::from_secs(20),
        &[&controller],
        || carries_it_all(&api.node(NODE)),
    );
    std::thread::sleep(Duration::from_millis(1500));
    check_bodies(&api.take());
    (controller, agent)
}

/// Waits for `f` (looking every 5 ms), returns how long it took; fails
/// past `within`.
fn back_within(what: &str, within: Duration, c: &Proc, mut f: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(
            t.elapsed() < within,
            "not within {within:?}: {what}\n{}",
            c.log()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let took = t.elapsed();
    // Whatever the controller sends about it has gone by then.
    std::thread::sleep(Duration::from_millis(500));
    took
}

#[test]
fn what_is_changed_by_hand_comes_back_and_what_is_the_users_stays() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    let dir = tempfile::tempdir().unwrap();
    let (mut controller, _agent) = setup(&rt, &api, dir.path());
    let within = Duration::from_secs(3);

    // A GFD label removed by hand (`kubectl label node gpu-node-1
    // nvidia.com/gpu.product-`): applied again, with the others of ours,
    // under our field manager; nothing else is sent.
    api.set_node_label(NODE, "nvidia.com/gpu.product", None);
    let label_back = back_within("the removed label back", within, &controller, || {
        label(&api.node(NODE), "nvidia.com/gpu.product") == "NVIDIA-H100-80GB-HBM3"
    });
    let r = api.take();
    assert_eq!(summary(&r), [APPLY], "only the labels are applied");
    check_bodies(&r);
    assert_eq!(r[0].content_type, "application/apply-patch+yaml");
    assert_eq!(
        r[0].body["metadata"]["labels"],
        json!({"nvidia.com/gpu.count": "2", "nvidia.com/gpu.present": "true",
               "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"})
    );
    let n = api.node(NODE);
    assert_eq!(label(&n, "team"), "ml", "the user's label stays");
    assert_eq!(label(&n, "kubernetes.io/hostname"), "gpu-node-1");

    // A label's value changed by hand: ours again.
    api.set_node_label(NODE, "nvidia.com/gpu.count", Some("1"));
    let value_back = back_within("the label's value back", within, &controller, || {
        label(&api.node(NODE), "nvidia.com/gpu.count") == "2"
    });
    let r = api.take();
    assert_eq!(summary(&r), [APPLY]);
    check_bodies(&r);

    // The health taint taken off by hand (the user's taint kept): on again,
    // beside the user's, at the resourceVersion read.
    let dedicated = json!({"key": "dedicated", "value": "ml", "effect": "NoSchedule"});
    api.touch_node(NODE, |n| n["spec"]["taints"] = json!([dedicated]));
    let taint_back = back_within("the taint back", within, &controller, || {
        tainted(&api.node(NODE))
    });
    let r = api.take();
    assert_eq!(summary(&r), [GET, MERGE]);
    check_bodies(&r);
    assert_eq!(r[1].body["spec"]["taints"][0], dedicated);
    assert!(r[1].body["metadata"]["resourceVersion"].is_string());

    // GPUHealthy overwritten by another writer: what the agent says again.
    api.touch_node(NODE, |n| {
        for c in n["status"]["conditions"].as_array_mut().unwrap() {
            if c["type"] == "GPUHealthy" {
                c["status"] = json!("True");
                c["reason"] = json!("AllHealthy");
                c["message"] = json!("2 of 2 GPUs healthy");
            }
        }
    });
    let condition_back = back_within("the condition back", within, &controller, || {
        condition(&api.node(NODE), "GPUHealthy")["status"] == "False"
    });
    let r = api.take();
    assert_eq!(summary(&r), [APPLY_STATUS]);
    check_bodies(&r);
    let c = condition(&api.node(NODE), "GPUHealthy");
    assert_eq!(c["reason"], "Unhealthy");
    assert_eq!(
        c["message"],
        "2 of 2 GPUs unhealthy: XID 79 on GPU-0: fallen off the bus; drain and reboot; XID 79 on GPU-1: fallen off the bus; drain and reboot"
    );

    // The user's own label under nvidia.com/ and a taint of theirs: kept,
    // and not a request.
    api.set_node_label(NODE, "nvidia.com/team.note", Some("keep"));
    api.touch_node(NODE, |n| {
        n["spec"]["taints"]
            .as_array_mut()
            .unwrap()
            .push(json!({"key": "maintenance", "value": "soon", "effect": "PreferNoSchedule"}))
    });
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(summary(&api.take()), Vec::<String>::new());
    let n = api.node(NODE);
    assert_eq!(label(&n, "nvidia.com/team.note"), "keep");
    assert_eq!(n["spec"]["taints"].as_array().unwrap().len(), 3);
    assert!(carries_it_all(&n));
    println!(
        "restored after: label removed {} ms, label changed {} ms, taint removed {} ms, condition overwritten {} ms",
        label_back.as_millis(),
        value_back.as_millis(),
        taint_back.as_millis(),
        condition_back.as_millis()
    );
    controller.term();
}

#[test]
fn a_node_deleted_and_registered_again_gets_it_all_back_at_once() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    let dir = tempfile::tempdir().unwrap();
    let (mut controller, _agent) = setup(&rt, &api, dir.path());
    let uid = api.node(NODE)["metadata"]["uid"].clone();

    // `kubectl delete node`: nothing is written to a node that is not there.
    api.delete_node(NODE);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(summary(&api.take()), Vec::<String>::new());

    // Its kubelet registers it again: a new object (its own labels and
    // taint, the Ready condition, nothing of ours) under the same name.
    api.add_node(NODE, kubelet_node());
    assert_ne!(api.node(NODE)["metadata"]["uid"], uid);
    let back = back_within(
        "labels, taint and conditions on the new node",
        Duration::from_secs(3),
        &controller,
        || carries_it_all(&api.node(NODE)),
    );
    let r = api.take();
    assert_eq!(summary(&r), [APPLY, APPLY_STATUS, GET, MERGE]);
    check_bodies(&r);
    let n = api.node(NODE);
    for kind in [
        "GPUDriverReady",
        "GPUContainerRuntimeReady",
        "GPUDevicePluginReady",
        "GPUHealthy",
    ] {
        assert!(condition(&n, kind).is_object(), "{kind} missing: {n}");
    }
    assert_eq!(condition(&n, "Ready")["reason"], "KubeletReady");
    assert_eq!(
        n["spec"]["taints"][0],
        json!({"key": "dedicated", "value": "ml", "effect": "NoSchedule"}),
        "the kubelet's taint stays"
    );
    assert_eq!(label(&n, "node.kubernetes.io/instance-type"), "p5.48xlarge");
    println!(
        "re-registered node carried labels, taint and conditions again after {} ms",
        back.as_millis()
    );
    controller.term();
}

/// A minute of a busy node that changes nothing of the controller's: its
/// kubelet posts its status every second, a user labels and taints it.
/// Not one request.
#[test]
fn an_idle_minute_costs_no_request_whatever_else_changes() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    let dir = tempfile::tempdir().unwrap();
    let (mut controller, _agent) = setup(&rt, &api, dir.path());
    for s in 0..60 {
        let now = jiff::Timestamp::now().to_string();
        api.touch_node(NODE, |n| {
            for c in n["status"]["conditions"].as_array_mut().unwrap() {
                if c["type"] == "Ready" {
                    c["lastHeartbeatTime"] = json!(now);
                }
            }
        });
        match s {
            20 => api.set_node_label(NODE, "team", Some("infra")),
            40 => api.touch_node(NODE, |n| {
                n["spec"]["taints"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({"key": "maintenance", "effect": "NoSchedule"}))
            }),
            _ => {}
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    assert_eq!(
        summary(&api.take()),
        Vec::<String>::new(),
        "60 kubelet status updates and two changes of the user's: no request"
    );
    assert!(carries_it_all(&api.node(NODE)));
    controller.term();
}
