//! Kubernetes Events from agents' health events and repairs and from
//! driver upgrades, against the scripted API server (which keeps them, as
//! created and merge-patched): the exact objects (checked against the real
//! schemas), aggregated with `count` and `lastTimestamp` as client-go's
//! correlator does, rate-limited per node without ever dropping a Warning,
//! an upgrade's steps or its outcome.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::{MockApi, kubelet_node, schema};
use gpu_agent_proto::report::v1 as pb;
use gpu_controller::events::{self, Limits};
use gpu_controller::fleet::Fleet;
use gpu_controller::node::TaintPolicy;
use gpu_controller::upgrade::{Step, UpgradePolicy, Upgrader};
use serde_json::json;
use tokio::sync::mpsc;

/// Waits (without holding the runtime) until `f` holds.
async fn until(what: &str, within: Duration, api: &MockApi, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}: {:#?}",
            api.events()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn check_bodies(api: &MockApi) {
    let schemas = schema::load();
    for r in api
        .requests()
        .iter()
        .filter(|r| r.uri.starts_with("/api/v1/namespaces/default/events"))
    {
        let errs = schema::check(
            &schemas,
            "io.k8s.api.core.v1.Event",
            &r.body,
            r.method == "PATCH",
        );
        assert!(
            errs.is_empty(),
            "{} {}: {errs:?}: {}",
            r.method,
            r.uri,
            r.body
        );
        if r.method == "PATCH" {
            assert_eq!(r.content_type, "application/merge-patch+json");
        }
    }
    for e in api.events() {
        let errs = schema::check(&schemas, "io.k8s.api.core.v1.Event", &e, false);
        assert!(errs.is_empty(), "{errs:?}: {e}");
    }
}

/// The Events about `node`, as `type reason (xcount): message`, oldest first.
fn said(api: &MockApi, node: &str) -> Vec<String> {
    // By name: the node's, then the time it was made.
    api.events()
        .iter()
        .filter(|e| e["involvedObject"]["name"] == node)
        .map(|e| {
            format!(
                "{} {} (x{}): {}",
                e["type"].as_str().unwrap(),
                e["reason"].as_str().unwrap(),
                e["count"],
                e["message"].as_str().unwrap()
            )
        })
        .collect()
}

#[tokio::test]
async fn health_events_and_repairs_become_events_about_the_node_within_the_limit() {
    let api = MockApi::start().await;
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let (fleet, _queue) = Fleet::new(TaintPolicy::NoneHealthy, Duration::from_secs(60));
    let fleet = Arc::new(fleet.with_events(tx));
    let written = Arc::new(AtomicU64::new(0));
    let task = tokio::spawn(events::run_with(
        api.client(),
        rx,
        written.clone(),
        Limits {
            update_every: Duration::from_millis(300),
            ..Limits::default()
        },
    ));
    fleet.apply(
        "gpu-node-1",
        pb::agent_message::Body::HealthEvent(pb::HealthEvent {
            gpu_uuid: "GPU-3".into(),
            xid: 79,
            reason: "XID 79, from the kernel log: GPU has fallen off the bus".into(),
            advice: "drain and reboot the node".into(),
            unhealthy: true,
            at_unix_ms: 1,
        }),
    );
    fleet.apply(
        "gpu-node-1",
        pb::agent_message::Body::Repair(pb::Repair {
            stage: "devnodes".into(),
            what: "created /dev/nvidia5".into(),
            at_unix: 1,
        }),
    );
    // A flood from one node: the burst is written, the rest counted on
    // the last Event of their reason.
    for n in 0..10 {
        fleet.apply(
            "gpu-node-1",
            pb::agent_message::Body::HealthEvent(pb::HealthEvent {
                gpu_uuid: "GPU-1".into(),
                xid: 63,
                reason: format!("XID 63 #{n}"),
                unhealthy: false,
                ..Default::default()
            }),
        );
    }
    let expected = [
        "Warning GPUUnhealthy (x1): XID 79, from the kernel log: GPU has fallen off the bus on GPU-3: drain and reboot the node",
        "Normal DriftRepaired (x1): devnodes: created /dev/nvidia5",
        "Normal GPUHealthEvent (x1): XID 63 #0 on GPU-1",
        "Normal GPUHealthEvent (x1): XID 63 #1 on GPU-1",
        "Normal GPUHealthEvent (x8): (combined from similar events): XID 63 #9 on GPU-1",
    ];
    until("the Events", Duration::from_secs(10), &api, || {
        said(&api, "gpu-node-1") == expected
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(written.load(Ordering::Relaxed) >= 5);
    let reqs = api.requests();
    let posts: Vec<_> = reqs.iter().filter(|r| r.method == "POST").collect();
    assert_eq!(posts.len(), 5, "a burst of 5 per node");
    assert_eq!(
        fleet.events_dropped.load(Ordering::Relaxed),
        0,
        "the queue of 16 took all 12"
    );
    check_bodies(&api);
    for p in &posts {
        assert_eq!(p.uri, "/api/v1/namespaces/default/events?");
        assert_eq!(p.body["involvedObject"]["kind"], "Node");
        assert_eq!(p.body["involvedObject"]["name"], "gpu-node-1");
        assert_eq!(p.body["involvedObject"]["uid"], "gpu-node-1");
        assert_eq!(p.body["reportingComponent"], "gpu-controller");
    }
    let first = &posts[0].body;
    assert_eq!(first["type"], "Warning");
    assert_eq!(first["reason"], "GPUUnhealthy");
    assert_eq!(
        first["message"],
        "XID 79, from the kernel log: GPU has fallen off the bus on GPU-3: drain and reboot the node"
    );
    assert_eq!(posts[1].body["reason"], "DriftRepaired");
    assert_eq!(posts[1].body["message"], "devnodes: created /dev/nvidia5");
    assert_eq!(posts[2].body["type"], "Normal");
    // The other 7 are counted on the last one written: in its POST if
    // they came before it went, else in one patch.
    let patches: Vec<_> = reqs.iter().filter(|r| r.method == "PATCH").collect();
    assert!(patches.len() <= 1, "{patches:#?}");
    for p in patches {
        assert_eq!(
            p.uri,
            format!(
                "/api/v1/namespaces/default/events/{}?",
                posts[4].body["metadata"]["name"].as_str().unwrap()
            )
        );
    }
    task.abort();
}

// ---- three driver upgrades ----

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

fn step_of(fleet: &Fleet, node: &str) -> Option<Step> {
    fleet
        .upgrade_view()
        .into_iter()
        .find(|s| s.node == node)
        .and_then(|s| s.step.map(|u| u.step))
}

/// Steps the rollout and the agents (those in `fail` fail their upgrade)
/// until nothing moves.
async fn settle(up: &Upgrader, fleet: &Fleet, agents: &mut BTreeMap<&str, Down>, fail: &[&str]) {
    for _ in 0..100 {
        let again = up.step(fleet).await;
        let mut moved = false;
        for (node, rx) in agents.iter_mut() {
            let mut go = false;
            while let Ok(Ok(m)) = rx.try_recv() {
                if let Some(pb::controller_message::Body::Desired(d)) = m.body {
                    go |= d.upgrade_go_ahead;
                }
            }
            if go {
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
        if !moved && again.is_none_or(|d| d >= gpu_controller::upgrade::RETRY_LOOK) {
            return;
        }
    }
    panic!("the rollout did not settle: {:?}", fleet.upgrade_view());
}

/// Three nodes upgraded one after the other, the third failing, at the
/// default limits: each node's steps are one `DriverUpgrade` Event counting
/// them, and every outcome is there, `DriverUpgradeDone` or `Warning
/// DriverUpgradeFailed`, even on a node whose burst repairs had spent,
/// and with a Warning flood on the failing node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_upgrade_outcome_is_an_event_however_many_steps_came_before() {
    let api = MockApi::start().await;
    for n in ["a", "b", "c"] {
        api.add_node(n, kubelet_node());
    }
    let (tx, rx) = mpsc::channel(events::QUEUE);
    let (fleet, _queue) = Fleet::new(TaintPolicy::Never, Duration::from_secs(60));
    let fleet = Arc::new(fleet.with_events(tx));
    let written = Arc::new(AtomicU64::new(0));
    let task = tokio::spawn(events::run(api.client(), rx, written.clone()));
    let spec = json!({"driver": {"version": NEW}});
    fleet.set_upgrade_policy(Some(Ok(UpgradePolicy::from_spec(&spec).unwrap())));
    let mut agents: BTreeMap<&str, Down> = BTreeMap::new();
    for n in ["a", "b", "c"] {
        let (tx, rx) = mpsc::channel(64);
        fleet.connect(
            pb::Hello {
                node_name: n.into(),
                agent_version: "0.1.0".into(),
                ..Default::default()
            },
            tx,
        );
        fleet.apply(
            n,
            pb::agent_message::Body::Snapshot(report(OLD, "upgrade-required", "")),
        );
        agents.insert(n, rx);
    }
    // b's agent repaired five things first: its burst is spent.
    for k in 0..5 {
        fleet.apply(
            "b",
            pb::agent_message::Body::Repair(pb::Repair {
                stage: "devnodes".into(),
                what: format!("created /dev/nvidia{k}"),
                at_unix: 1,
            }),
        );
    }
    // c's GPUs fall off the bus, many times over.
    for k in 0..20 {
        fleet.apply(
            "c",
            pb::agent_message::Body::HealthEvent(pb::HealthEvent {
                gpu_uuid: format!("GPU-{}", k % 4),
                xid: 79,
                reason: "XID 79: GPU has fallen off the bus".into(),
                advice: "drain and reboot the node".into(),
                unhealthy: true,
                at_unix_ms: k,
            }),
        );
    }
    let up = Upgrader::new(api.client());
    settle(&up, &fleet, &mut agents, &["c"]).await;
    assert_eq!(step_of(&fleet, "a"), Some(Step::UpgradeDone));
    assert_eq!(step_of(&fleet, "b"), Some(Step::UpgradeDone));
    assert_eq!(step_of(&fleet, "c"), Some(Step::UpgradeFailed));

    let has = |node: &str, what: &str| said(&api, node).iter().any(|s| s.starts_with(what));
    until(
        "the outcomes' Events",
        Duration::from_secs(10),
        &api,
        || {
            has("a", "Normal DriverUpgradeDone")
                && has("b", "Normal DriverUpgradeDone")
                && has("c", "Warning DriverUpgradeFailed")
        },
    )
    .await;
    // The steps' counts are patched within UPDATE_EVERY (10 s).
    let steps = |node: &str| {
        said(&api, node)
            .into_iter()
            .find(|s| s.starts_with("Normal DriverUpgrade (x"))
    };
    until(
        "the steps counted",
        events::UPDATE_EVERY + Duration::from_secs(5),
        &api,
        || {
            // a started at once (cordon-required first); b and c waited
            // in upgrade-required; c failed in validation-required.
            steps("a").is_some_and(|s| s.contains("(x5): "))
                && steps("b").is_some_and(|s| s.contains("(x6): "))
                && steps("c").is_some_and(|s| s.contains("(x5): "))
        },
    )
    .await;
    assert_eq!(
        said(&api, "a"),
        [
            "Normal DriverUpgrade (x5): upgrading to driver 560.35.03: uncordon-required: upgraded to 560.35.03",
            "Normal DriverUpgradeDone (x1): driver 560.35.03 validated: upgraded to 560.35.03",
        ]
    );
    let b = said(&api, "b");
    assert_eq!(b.len(), 7, "{b:#?}");
    assert!(
        b[..5]
            .iter()
            .all(|s| s.starts_with("Normal DriftRepaired (x1)"))
    );
    assert_eq!(
        b[5..],
        [
            "Normal DriverUpgrade (x6): upgrading to driver 560.35.03: uncordon-required: upgraded to 560.35.03",
            "Normal DriverUpgradeDone (x1): driver 560.35.03 validated: upgraded to 560.35.03",
        ]
    );
    let c = said(&api, "c");
    assert_eq!(
        c,
        [
            "Warning GPUUnhealthy (x5): XID 79: GPU has fallen off the bus on GPU-0: drain and reboot the node",
            "Warning GPUUnhealthy (x5): XID 79: GPU has fallen off the bus on GPU-1: drain and reboot the node",
            "Warning GPUUnhealthy (x5): XID 79: GPU has fallen off the bus on GPU-2: drain and reboot the node",
            "Warning GPUUnhealthy (x5): XID 79: GPU has fallen off the bus on GPU-3: drain and reboot the node",
            "Normal DriverUpgrade (x5): upgrading to driver 560.35.03: validation-required",
            "Warning DriverUpgradeFailed (x1): upgrade to driver 560.35.03 failed: nvidia.ko of 560.35.03 did not load (Invalid module format); rolled back to 550.127.08",
        ]
    );
    check_bodies(&api);
    task.abort();
}
