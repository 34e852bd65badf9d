//! Driver upgrades across the fleet, against the scripted API server: the
//! agents are the test's (they report `upgrade-required` and act on the
//! controller's go-ahead as gpu-agent does), the orchestrator and the
//! writer are the controller's. Asserted: one node at a time in name order,
//! the exact cordon, pod list, eviction and uncordon requests, GPU pods only
//! (not the node's other pods), a disruption budget's 429 retried, a node
//! cordoned before its upgrade left cordoned, a pod no controller runs
//! failing the node (which stays cordoned, with a condition saying why) and
//! stopping the rollout until the node is fixed, an agent's failed upgrade,
//! a new leader reading the states back from the labels; every body checked
//! against the real 1.36 schemas.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{MockApi, kubelet_node, schema};
use gpu_agent_proto::report::v1 as pb;
use gpu_controller::fleet::Fleet;
use gpu_controller::node::TaintPolicy;
use gpu_controller::upgrade::{Step, UpgradePolicy, Upgrader};
use gpu_controller::writer::Writer;
use serde_json::{Value, json};
use tokio::sync::mpsc;

const OLD: &str = "550.127.08";
const NEW: &str = "560.35.03";

type Down = mpsc::Receiver<Result<pb::ControllerMessage, tonic::Status>>;

fn report(driver: &str, state: &str, detail: &str) -> pb::NodeReport {
    pb::NodeReport {
        inventory: Some(pb::Inventory {
            driver_version: driver.into(),
            gpus: vec![pb::Gpu {
                uuid: "GPU-0".into(),
                model: "NVIDIA H100 80GB HBM3".into(),
                ..Default::default()
            }],
            ..Default::default()
        }),
        stages: Some(pb::Stages {
            stages: vec![pb::Stage {
                name: "driver".into(),
                state: "done".into(),
                validated: Some(true),
                validation_message: format!("driver {driver}"),
                ..Default::default()
            }],
            ready: true,
        }),
        upgrade: Some(pb::UpgradeState {
            state: state.into(),
            driver_version: NEW.into(),
            detail: detail.into(),
        }),
        ..Default::default()
    }
}

/// A pod on `node`; `owner` is its controller's kind (None: no controller).
fn pod(node: &str, owner: Option<&str>, gpus: bool, empty_dir: bool) -> Value {
    let mut p = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"labels": {"app": "train"}},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "main", "image": "cuda:12",
                "resources": if gpus { json!({"limits": {"nvidia.com/gpu": "1"}}) } else { json!({"limits": {"cpu": "1"}}) }}],
        },
        "status": {"phase": "Running"},
    });
    if let Some(kind) = owner {
        p["metadata"]["ownerReferences"] = json!([{"apiVersion": "apps/v1", "kind": kind, "name": "owner", "uid": "u-1", "controller": true}]);
    }
    if empty_dir {
        p["spec"]["volumes"] = json!([{"name": "scratch", "emptyDir": {}}]);
    }
    p
}

fn connect(fleet: &Fleet, node: &str, r: pb::NodeReport) -> Down {
    let (tx, rx) = mpsc::channel(16);
    fleet.connect(
        pb::Hello {
            node_name: node.into(),
            agent_version: "0.1.0".into(),
            ..Default::default()
        },
        tx,
    );
    fleet.apply(node, pb::agent_message::Body::Snapshot(r));
    rx
}

/// The last Desired the agent was sent, if any came since last asked.
fn last_desired(rx: &mut Down) -> Option<pb::Desired> {
    let mut last = None;
    while let Ok(Ok(m)) = rx.try_recv() {
        if let Some(pb::controller_message::Body::Desired(d)) = m.body {
            last = Some(d);
        }
    }
    last
}

fn step_of(fleet: &Fleet, node: &str) -> Option<Step> {
    fleet
        .upgrade_view()
        .into_iter()
        .find(|s| s.node == node)
        .and_then(|s| s.step.map(|u| u.step))
}

/// What a request did, for the rollout's requests (no writer's).
fn said(r: &common::Recorded) -> String {
    let uri = r.uri.replace("%3D", "=").replace("%2F", "/");
    if r.body.is_null() {
        format!("{} {uri}", r.method)
    } else {
        format!("{} {uri} {}", r.method, r.body)
    }
}

/// Steps the rollout and the agents until nothing moves. Agents in `fail`
/// report a failed upgrade on their go-ahead; the others upgrade.
async fn settle(
    up: &Upgrader,
    fleet: &Fleet,
    agents: &mut BTreeMap<&'static str, Down>,
    fail: &[&str],
) {
    for _ in 0..50 {
        let again = up.step(fleet).await;
        let mut moved = false;
        for (node, rx) in agents.iter_mut() {
            if let Some(d) = last_desired(rx)
                && d.upgrade_go_ahead
            {
                assert_eq!(d.driver_version, NEW, "{node}");
                let r = if fail.contains(node) {
                    report(
                        OLD,
                        "upgrade-failed",
                        "nvidia.ko of 560.35.03 did not load (Invalid module format); rolled back to 550.127.08",
                    )
                } else {
                    report(NEW, "upgrade-done", "upgraded to 560.35.03")
                };
                fleet.apply(node, pb::agent_message::Body::Change(r));
                moved = true;
            }
        }
        // Waiting for pods is looked at again without the test's sleeping;
        // a failed node's slow look for a retry request is not waited for.
        if !moved && again.is_none_or(|d| d >= gpu_controller::upgrade::RETRY_LOOK) {
            return;
        }
    }
    panic!("the rollout did not settle: {:?}", fleet.upgrade_view());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_one_node_at_a_time_with_a_failure_that_stops_it() {
    let api = MockApi::start().await;
    for n in ["a", "b", "c", "d"] {
        api.add_node(n, kubelet_node());
    }
    api.touch_node("b", |n| n["spec"]["unschedulable"] = json!(true));
    api.add_pod("ml", "train-a", pod("a", Some("ReplicaSet"), true, false));
    api.add_pod("web", "web-a", pod("a", Some("ReplicaSet"), false, false));
    api.add_pod("ml", "train-b", pod("b", Some("Job"), true, true));
    api.refuse_evictions("ml", "train-b", 2);
    api.add_pod("ml", "notebook-c", pod("c", None, true, false));
    api.add_pod("ml", "train-d", pod("d", Some("ReplicaSet"), true, false));
    let (fleet, _queue) = Fleet::new(TaintPolicy::Never, Duration::from_secs(60));
    let spec = json!({"driver": {"version": NEW, "upgradePolicy": {
        "maxUnavailable": 2, "gpuPodDeletion": {"deleteEmptyDir": true}}}});
    fleet.set_upgrade_policy(Some(Ok(UpgradePolicy::from_spec(&spec).unwrap())));
    let mut agents: BTreeMap<&'static str, Down> = BTreeMap::new();
    for n in ["a", "b", "c", "d"] {
        agents.insert(
            n,
            connect(
                &fleet,
                n,
                report(OLD, "upgrade-required", "driver 560.35.03 wanted"),
            ),
        );
    }
    let up = Upgrader::new(api.client());
    api.take();

    // The first step starts only `a` (maxParallelUpgrades 1, by name).
    settle(&up, &fleet, &mut agents, &["d"]).await;
    assert_eq!(step_of(&fleet, "a"), Some(Step::UpgradeDone));
    assert_eq!(step_of(&fleet, "b"), Some(Step::UpgradeDone));
    assert_eq!(step_of(&fleet, "c"), Some(Step::UpgradeFailed));
    assert_eq!(
        step_of(&fleet, "d"),
        Some(Step::UpgradeRequired),
        "a failed node stops the rollout"
    );

    let reqs = api.take();
    let of = |node: &str| -> Vec<String> {
        reqs.iter()
            .filter(|r| {
                r.uri.contains(&format!("/nodes/{node}"))
                    || r.uri.contains(&format!("spec.nodeName%3D{node}"))
                    || r.uri.contains(&format!("/pods/train-{node}/"))
                    || r.uri.contains(&format!("/pods/notebook-{node}/"))
            })
            .map(said)
            .collect()
    };
    let list = |n: &str| format!("GET /api/v1/pods?&fieldSelector=spec.nodeName={n}");
    let evict = |ns: &str, p: &str| {
        format!(
            "POST /api/v1/namespaces/{ns}/pods/{p}/eviction? {}",
            json!({"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": p, "namespace": ns}})
        )
    };
    let a = of("a");
    assert_eq!(
        a,
        [
            "GET /api/v1/nodes/a".to_string(),
            r#"PATCH /api/v1/nodes/a?&fieldManager=gpu-controller {"spec":{"unschedulable":true},"metadata":{"annotations":{"nvidia.com/gpu-driver-upgrade.node-initial-state.unschedulable":"false"}}}"#.into(),
            list("a"),
            evict("ml", "train-a"),
            list("a"),
            "GET /api/v1/nodes/a".into(),
            r#"PATCH /api/v1/nodes/a?&fieldManager=gpu-controller {"metadata":{"annotations":{"nvidia.com/gpu-driver-upgrade.node-initial-state.unschedulable":null}},"spec":{"unschedulable":false}}"#.into(),
        ],
        "web-a uses no GPU and stays"
    );
    assert!(api.pods().contains(&"web/web-a".to_string()));
    assert_eq!(api.node("a")["spec"]["unschedulable"], json!(false));
    // b was cordoned before: noted, refused twice by its budget, left cordoned.
    let b = of("b");
    assert_eq!(
        b[1],
        r#"PATCH /api/v1/nodes/b?&fieldManager=gpu-controller {"spec":{"unschedulable":true},"metadata":{"annotations":{"nvidia.com/gpu-driver-upgrade.node-initial-state.unschedulable":"true"}}}"#
    );
    assert_eq!(
        b.iter().filter(|r| **r == evict("ml", "train-b")).count(),
        3,
        "two 429s, then evicted: {b:#?}"
    );
    assert_eq!(
        b.last().unwrap(),
        r#"PATCH /api/v1/nodes/b?&fieldManager=gpu-controller {"metadata":{"annotations":{"nvidia.com/gpu-driver-upgrade.node-initial-state.unschedulable":null}}}"#
    );
    assert_eq!(api.node("b")["spec"]["unschedulable"], json!(true));
    // c: its notebook has no controller; nothing is evicted and it stays cordoned.
    let c = of("c");
    assert!(!c.iter().any(|r| r.contains("eviction")), "{c:#?}");
    assert_eq!(api.node("c")["spec"]["unschedulable"], json!(true));
    assert!(api.pods().contains(&"ml/notebook-c".to_string()));
    assert!(of("d").is_empty(), "d never started: {:#?}", of("d"));

    // Every body as the API server's strict validation sees it.
    let schemas = schema::load();
    for r in &reqs {
        let name = if r.uri.ends_with("/eviction") {
            "io.k8s.api.policy.v1.Eviction"
        } else if r.method == "PATCH" {
            "io.k8s.api.core.v1.Node"
        } else {
            continue;
        };
        let errs = schema::check(&schemas, name, &r.body, r.method == "PATCH");
        assert!(errs.is_empty(), "{} {}: {errs:?}", r.method, r.uri);
    }

    // The writer puts the states on the nodes: label and condition.
    let writer = Writer::new(api.client());
    for n in ["a", "c", "d"] {
        writer.write_node(&fleet, n).await;
    }
    let label =
        |n: &str| api.node(n)["metadata"]["labels"]["nvidia.com/gpu-driver-upgrade-state"].clone();
    assert_eq!(label("a"), json!("upgrade-done"));
    assert_eq!(label("c"), json!("upgrade-failed"));
    assert_eq!(label("d"), json!("upgrade-required"));
    let cond = |n: &str| {
        api.node(n)["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "GPUDriverUpgraded")
            .cloned()
            .unwrap()
    };
    assert_eq!(cond("a")["status"], "True");
    assert_eq!(
        cond("a")["message"],
        "driver 560.35.03 validated: upgraded to 560.35.03"
    );
    assert_eq!(cond("c")["status"], "False");
    assert_eq!(cond("c")["reason"], "UpgradeFailed");
    assert_eq!(
        cond("c")["message"],
        "upgrade to driver 560.35.03 failed: GPU pod deletion could not finish: ml/notebook-c: no controller runs it, so it would not come back (force: true evicts it anyway)"
    );

    // Left alone, c stays failed (looked at for a retry request only).
    settle(&up, &fleet, &mut agents, &["d"]).await;
    assert_eq!(step_of(&fleet, "c"), Some(Step::UpgradeFailed));
    // Its notebook stopped and an admin asks to try again (the GPU
    // Operator's annotation): c's upgrade goes on, c is uncordoned, and the
    // rollout goes on to d, whose agent fails its upgrade.
    api.take();
    api.remove_pod("ml", "notebook-c");
    api.touch_node("c", |n| {
        n["metadata"]["annotations"]["nvidia.com/gpu-driver-upgrade-requested"] = json!("true")
    });
    settle(&up, &fleet, &mut agents, &["d"]).await;
    assert_eq!(
        api.node("c")["metadata"]["annotations"].get("nvidia.com/gpu-driver-upgrade-requested"),
        None,
        "the request is taken"
    );
    assert_eq!(step_of(&fleet, "c"), Some(Step::UpgradeDone));
    assert_eq!(api.node("c")["spec"]["unschedulable"], json!(false));
    assert_eq!(step_of(&fleet, "d"), Some(Step::UpgradeFailed));
    assert_eq!(
        api.node("d")["spec"]["unschedulable"],
        json!(true),
        "a failed node stays cordoned"
    );
    assert!(!api.pods().contains(&"ml/train-d".to_string()));
    writer.write_node(&fleet, "d").await;
    assert_eq!(cond("d")["reason"], "UpgradeFailed");
    assert_eq!(
        cond("d")["message"],
        "upgrade to driver 560.35.03 failed: nvidia.ko of 560.35.03 did not load (Invalid module format); rolled back to 550.127.08"
    );
    // A failed node is not told to try again.
    let d = fleet.view();
    let d = d["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == "d")
        .unwrap()
        .clone();
    assert_eq!(d["upgrade"]["state"], "upgrade-failed");
    assert_eq!(
        fleet.view()["summary"]["rollout"],
        "driver rollout: 3 upgrade-done, 1 upgrade-failed; stopped by d"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_carries_on_from_the_labels() {
    let api = MockApi::start().await;
    api.add_node("x", kubelet_node());
    api.add_node("y", kubelet_node());
    api.set_node_label(
        "x",
        "nvidia.com/gpu-driver-upgrade-state",
        Some("validation-required"),
    );
    api.touch_node("x", |n| n["spec"]["unschedulable"] = json!(true));
    let (fleet, _queue) = Fleet::new(TaintPolicy::Never, Duration::from_secs(60));
    fleet.set_upgrade_policy(Some(Ok(UpgradePolicy::default())));
    let up = Upgrader::new(api.client());
    assert_eq!(up.recover(&fleet).await.unwrap(), 1);
    // Nothing is written for x before its agent reports: its labels, taint
    // and conditions stay as the last leader left them.
    api.take();
    Writer::new(api.client()).write_node(&fleet, "x").await;
    assert!(
        api.take().is_empty(),
        "a node its agent has not reported is written"
    );
    let mut x = connect(&fleet, "x", report(OLD, "upgrade-required", ""));
    let mut y = connect(&fleet, "y", report(OLD, "upgrade-required", ""));
    let _ = up.step(&fleet).await;
    // x goes on where the last leader was (its target from its agent); y waits.
    let d = last_desired(&mut x).unwrap();
    assert!(d.upgrade_go_ahead);
    assert_eq!(d.driver_version, NEW);
    assert_eq!(step_of(&fleet, "y"), Some(Step::UpgradeRequired));
    assert!(last_desired(&mut y).is_none_or(|d| !d.upgrade_go_ahead));
    // Without a ClusterPolicy nothing is rolled out.
    let (fleet2, _q) = Fleet::new(TaintPolicy::Never, Duration::from_secs(60));
    let _z = connect(&fleet2, "y", report(OLD, "upgrade-required", ""));
    assert_eq!(up.step(&fleet2).await, None);
    assert_eq!(step_of(&fleet2, "y"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_out_of_service_hold_the_rollout_back() {
    // Five GPU nodes (with agents); a and b want the new driver, e is NotReady and f
    // cordoned by an admin. maxUnavailable 2: nothing may start until one
    // of those is back.
    let api = MockApi::start().await;
    for n in ["a", "b", "e", "f", "g"] {
        api.add_node(n, kubelet_node());
    }
    let not_ready = |n: &mut Value| {
        n["status"]["conditions"][0]["status"] = json!("Unknown");
        n["status"]["conditions"][0]["reason"] = json!("NodeStatusUnknown");
    };
    api.touch_node("e", not_ready);
    api.touch_node("f", |n| n["spec"]["unschedulable"] = json!(true));
    // 1,000 nodes without GPUs (no agent), half of them NotReady: listed
    // (three pages of 500) and not counted.
    for i in 0..1000 {
        let name = format!("cpu-{i:04}");
        api.add_node(&name, kubelet_node());
        if i % 2 == 0 {
            api.touch_node(&name, not_ready);
        }
    }
    let (fleet, _queue) = Fleet::new(TaintPolicy::Never, Duration::from_secs(60));
    let spec = json!({"driver": {"version": NEW, "upgradePolicy": {"maxUnavailable": 2}}});
    fleet.set_upgrade_policy(Some(Ok(UpgradePolicy::from_spec(&spec).unwrap())));
    let mut agents: BTreeMap<&'static str, Down> = BTreeMap::new();
    for n in ["a", "b"] {
        agents.insert(n, connect(&fleet, n, report(OLD, "upgrade-required", "")));
    }
    for n in ["e", "f", "g"] {
        agents.insert(n, connect(&fleet, n, report(NEW, "", "")));
    }
    // Long enough that two looks in a row on a loaded machine share a list.
    let ttl = Duration::from_secs(2);
    let up = Upgrader::new(api.client()).with_availability_ttl(ttl);

    // The first look marks a and b upgrade-required (and looks again at
    // once, as after every move); the second finds them held back.
    assert_eq!(up.step(&fleet).await, Some(Duration::ZERO));
    let again = up.step(&fleet).await;
    assert_eq!(step_of(&fleet, "a"), Some(Step::UpgradeRequired));
    assert_eq!(step_of(&fleet, "b"), Some(Step::UpgradeRequired));
    assert_eq!(again, Some(ttl), "held back, it looks again");
    assert_eq!(api.node("a")["spec"].get("unschedulable"), None);
    // 1,005 nodes: three pages, and within the TTL not listed again.
    assert_eq!(api.node_pages(), 3);

    // e is Ready again: one node may start (f still counts).
    api.touch_node("e", |n| {
        n["status"]["conditions"][0]["status"] = json!("True")
    });
    tokio::time::sleep(ttl + Duration::from_millis(50)).await;
    let _ = up.step(&fleet).await;
    assert_eq!(step_of(&fleet, "a"), Some(Step::WaitForJobsRequired));
    assert_eq!(api.node("a")["spec"]["unschedulable"], json!(true));
    assert_eq!(step_of(&fleet, "b"), Some(Step::UpgradeRequired));

    // The rollout goes on, a node at a time, and ends with both done; f
    // is never touched.
    settle(&up, &fleet, &mut agents, &[]).await;
    for _ in 0..20 {
        if step_of(&fleet, "b") == Some(Step::UpgradeDone) {
            break;
        }
        tokio::time::sleep(ttl).await;
        settle(&up, &fleet, &mut agents, &[]).await;
    }
    assert_eq!(step_of(&fleet, "a"), Some(Step::UpgradeDone));
    assert_eq!(step_of(&fleet, "b"), Some(Step::UpgradeDone));
    assert_eq!(api.node("b")["spec"]["unschedulable"], json!(false));
    assert_eq!(api.node("f")["spec"]["unschedulable"], json!(true));
    assert!(
        !api.requests()
            .iter()
            .any(|r| r.uri.starts_with("/api/v1/nodes/f")),
        "f is only listed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_silent_after_its_go_ahead_fails_its_node_in_time() {
    let api = MockApi::start().await;
    api.add_node("a", kubelet_node());
    let (fleet, _queue) = Fleet::new(TaintPolicy::Never, Duration::from_secs(60));
    let spec = json!({"driver": {"version": NEW}});
    fleet.set_upgrade_policy(Some(Ok(UpgradePolicy::from_spec(&spec).unwrap())));
    let mut a = connect(&fleet, "a", report(OLD, "upgrade-required", ""));
    // Long enough that the steps up to the go-ahead never reach it on a
    // loaded machine.
    let limit = Duration::from_secs(2);
    let up = Upgrader::new(api.client()).with_validation_timeout(Some(limit));
    // Cordoned, its pods gone, the go-ahead sent; the agent says nothing.
    let mut again = Some(Duration::ZERO);
    while again == Some(Duration::ZERO) {
        again = up.step(&fleet).await;
    }
    assert_eq!(step_of(&fleet, "a"), Some(Step::ValidationRequired));
    assert!(last_desired(&mut a).unwrap().upgrade_go_ahead);
    let wait = again.expect("the rollout looks again when the limit passes");
    assert!(wait <= limit, "{wait:?}");
    tokio::time::sleep(wait + Duration::from_millis(20)).await;
    up.step(&fleet).await;
    assert_eq!(step_of(&fleet, "a"), Some(Step::UpgradeFailed));
    assert_eq!(api.node("a")["spec"]["unschedulable"], json!(true));
    let view = fleet.view();
    let node = &view["nodes"][0];
    assert_eq!(node["upgrade"]["state"], "upgrade-failed");
    let detail = node["upgrade"]["detail"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        detail.starts_with("the agent did not report driver 560.35.03 validated within 2 s"),
        "{view:#}"
    );
    // The agent reports it done after all: the node goes on, uncordoned.
    fleet.apply(
        "a",
        pb::agent_message::Body::Change(report(NEW, "upgrade-done", "upgraded to 560.35.03")),
    );
    for _ in 0..5 {
        up.step(&fleet).await;
    }
    assert_eq!(step_of(&fleet, "a"), Some(Step::UpgradeDone));
    assert_eq!(api.node("a")["spec"]["unschedulable"], json!(false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_loses_its_lease_stops_at_its_next_call() {
    let api = MockApi::start().await;
    for n in ["a", "b"] {
        api.add_node(n, kubelet_node());
    }
    api.add_pod("ml", "train-a", pod("a", Some("ReplicaSet"), true, false));
    let (fleet, _queue) = Fleet::new(TaintPolicy::Never, Duration::from_secs(60));
    let spec = json!({"driver": {"version": NEW}});
    fleet.set_upgrade_policy(Some(Ok(UpgradePolicy::from_spec(&spec).unwrap())));
    let mut agents: BTreeMap<&'static str, Down> = BTreeMap::new();
    for n in ["a", "b"] {
        agents.insert(n, connect(&fleet, n, report(OLD, "upgrade-required", "")));
    }
    let (lead, leader) = tokio::sync::watch::channel(true);
    let up = Upgrader::new(api.client()).with_leader(leader);
    // Leading: a is cordoned.
    while step_of(&fleet, "a") != Some(Step::WaitForJobsRequired) {
        up.step(&fleet).await;
    }
    assert_eq!(api.node("a")["spec"]["unschedulable"], json!(true));
    // The lease is lost: no call at all, however often it is asked.
    lead.send(false).unwrap();
    api.take();
    for _ in 0..5 {
        assert_eq!(up.step(&fleet).await, None);
    }
    assert!(api.take().is_empty(), "a follower called the API");
    assert!(api.pods().contains(&"ml/train-a".to_string()));
    // A new leader (here the same replica, leading again) carries on.
    lead.send(true).unwrap();
    settle(&up, &fleet, &mut agents, &[]).await;
    assert_eq!(step_of(&fleet, "a"), Some(Step::UpgradeDone));
    assert_eq!(step_of(&fleet, "b"), Some(Step::UpgradeDone));
    assert!(!api.pods().contains(&"ml/train-a".to_string()));
}

/// The running gpu-controller (a real process, its rollout loop woken by
/// the agent's report) and an agent we did not write (Python grpcio over
/// TLS): the ClusterPolicy's driver rollout cordons the node, evicts its
/// GPU pod, gives the go-ahead on the wire, and once the agent reports the
/// new driver validated, uncordons it and labels it upgrade-done.
#[test]
fn a_grpcio_agent_is_given_the_go_ahead_by_the_running_controller() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    api.add_node("py-node", kubelet_node());
    api.add_token(
        "py-token",
        "system:serviceaccount:gpu-agent:gpu-agent",
        "py-node",
    );
    api.add_pod(
        "ml",
        "train-py",
        pod("py-node", Some("ReplicaSet"), true, false),
    );
    api.set_cluster_policy(
        "cluster-policy",
        json!({"driver": {"enabled": true, "version": NEW, "upgradePolicy": {"autoUpgrade": true}}}),
    );
    let dir = tempfile::tempdir().unwrap();
    let (mut controller, port, ca) = common::start_controller(&api, dir.path(), None);
    let out = common::report_client(
        port,
        &ca,
        "py-node",
        &["--token", "py-token", "--upgrade", NEW, "--hold", "6"],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "grpcio agent: {stdout}\n{}\ncontroller:\n{}",
        String::from_utf8_lossy(&out.stderr),
        controller.log()
    );
    let seen: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(seen["go_ahead"], NEW, "{seen}");
    // The go-ahead came only after the node was cordoned and its GPU pod gone.
    let reqs = api.requests();
    let at = |f: &dyn Fn(&common::Recorded) -> bool| reqs.iter().position(f);
    let cordoned = at(&|r| {
        r.method == "PATCH"
            && r.uri.starts_with("/api/v1/nodes/py-node?")
            && r.body["spec"]["unschedulable"] == json!(true)
    })
    .expect("never cordoned");
    let evicted = at(&|r| {
        r.uri
            .starts_with("/api/v1/namespaces/ml/pods/train-py/eviction")
    })
    .expect("the GPU pod was never evicted");
    assert!(cordoned < evicted);
    assert!(api.pods().is_empty());
    common::wait_for(
        "uncordoned and upgrade-done",
        Duration::from_secs(20),
        &[&controller],
        || {
            let n = api.node("py-node");
            n["spec"]["unschedulable"] == json!(false)
                && n["metadata"]["labels"]["nvidia.com/gpu-driver-upgrade-state"] == "upgrade-done"
        },
    );
    controller.term();
}

/// A pod whose deletion began (evicted, held by a finalizer or a long
/// grace period) is not evicted again and is said to be terminating, with
/// since when and its grace period, not "still running": in the step's
/// detail while it waits, and in the failure when the step's time is up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminating_pod_is_said_to_be_terminating_not_running() {
    let api = MockApi::start().await;
    api.add_node("a", kubelet_node());
    let mut stuck = pod("a", Some("ReplicaSet"), true, false);
    stuck["metadata"]["deletionTimestamp"] = json!("2026-11-24T06:00:00Z");
    stuck["metadata"]["deletionGracePeriodSeconds"] = json!(30);
    stuck["metadata"]["finalizers"] = json!(["example.com/checkpoint"]);
    api.add_pod("ml", "train-stuck", stuck);
    let (fleet, _queue) = Fleet::new(TaintPolicy::Never, Duration::from_secs(60));
    let spec = json!({"driver": {"version": NEW, "upgradePolicy": {
        "gpuPodDeletion": {"timeoutSeconds": 1}}}});
    fleet.set_upgrade_policy(Some(Ok(UpgradePolicy::from_spec(&spec).unwrap())));
    let _a = connect(&fleet, "a", report(OLD, "upgrade-required", ""));
    let up = Upgrader::new(api.client());
    let detail = |fleet: &Fleet| {
        fleet
            .upgrade_view()
            .into_iter()
            .find(|s| s.node == "a")
            .and_then(|s| s.step)
            .map(|u| u.detail)
            .unwrap_or_default()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while step_of(&fleet, "a") != Some(Step::PodDeletionRequired) || detail(&fleet).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            step_of(&fleet, "a")
        );
        up.step(&fleet).await;
    }
    assert_eq!(
        detail(&fleet),
        "waiting for ml/train-stuck (terminating since 2026-11-24T06:00:00Z, grace period 30 s) to go"
    );
    while step_of(&fleet, "a") != Some(Step::UpgradeFailed) {
        assert!(std::time::Instant::now() < deadline, "{}", detail(&fleet));
        tokio::time::sleep(Duration::from_millis(100)).await;
        up.step(&fleet).await;
    }
    assert!(
        !api.requests().iter().any(|r| r.uri.ends_with("/eviction?")),
        "a terminating pod is not evicted again"
    );
    let failed = "upgrade to driver 560.35.03 failed: GPU pod deletion could not finish: ml/train-stuck (terminating since 2026-11-24T06:00:00Z, grace period 30 s) still terminating after 1 s";
    Writer::new(api.client()).write_node(&fleet, "a").await;
    let cond = api.node("a")["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "GPUDriverUpgraded")
        .cloned()
        .unwrap();
    assert_eq!(cond["message"], failed);
}
