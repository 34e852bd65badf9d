//! Kubernetes Events from agents' health events and repairs, against the
//! scripted API server: the exact objects (checked against the real
//! schemas), rate-limited per node.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::{MockApi, schema};
use gpu_agent_proto::report::v1 as pb;
use gpu_controller::fleet::Fleet;
use gpu_controller::node::TaintPolicy;

#[tokio::test]
async fn health_events_and_repairs_become_events_about_the_node_within_the_limit() {
    let api = MockApi::start().await;
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let (fleet, _queue) = Fleet::new(TaintPolicy::NoneHealthy, Duration::from_secs(60));
    let fleet = Arc::new(fleet.with_events(tx));
    let written = Arc::new(AtomicU64::new(0));
    let task = tokio::spawn(gpu_controller::events::run(
        api.client(),
        rx,
        written.clone(),
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
    // A flood from one node: only the burst is written.
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
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while written.load(Ordering::Relaxed) < 5 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            api.requests()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let posts: Vec<_> = api
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST")
        .collect();
    assert_eq!(posts.len(), 5, "a burst of 5 per node");
    assert_eq!(
        fleet.events_dropped.load(Ordering::Relaxed),
        0,
        "the queue of 16 took all 12"
    );
    let schemas = schema::load();
    for p in &posts {
        assert_eq!(p.uri, "/api/v1/namespaces/default/events?");
        let errs = schema::check(&schemas, "io.k8s.api.core.v1.Event", &p.body, false);
        assert!(errs.is_empty(), "{errs:?}: {}", p.body);
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
    task.abort();
}
