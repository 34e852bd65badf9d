//! Leader election through a coordination.k8s.io/v1 Lease against the
//! scripted API server: one leader of two replicas, the stand-by takes
//! over within the lease time once the leader stops renewing, every write
//! guarded by the resourceVersion, every Lease checked against the real
//! schema.

mod common;

use std::time::Duration;

use common::{MockApi, schema};
use gpu_controller::lease::{self, Election, Outcome};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use tokio::sync::watch;

fn election(identity: &str) -> Election {
    Election {
        duration: Duration::from_secs(2),
        renew: Duration::from_millis(200),
        ..Election::new("gpu-agent", identity)
    }
}

#[tokio::test]
async fn one_leader_and_a_stand_by_that_takes_over() {
    let api = MockApi::start().await;
    let leases: Api<Lease> = Api::namespaced(api.client(), "gpu-agent");
    // First look: a made, b stands by.
    assert_eq!(
        lease::try_lead(&leases, &election("a")).await.unwrap(),
        Outcome::Leader
    );
    assert_eq!(
        lease::try_lead(&leases, &election("b")).await.unwrap(),
        Outcome::Follower("a".into())
    );
    let schemas = schema::load();
    for r in api.take() {
        assert!(
            r.uri
                .starts_with("/apis/coordination.k8s.io/v1/namespaces/gpu-agent/leases"),
            "{}",
            r.uri
        );
        if r.method != "GET" {
            let errs = schema::check(&schemas, "io.k8s.api.coordination.v1.Lease", &r.body, false);
            assert!(errs.is_empty(), "{errs:?}: {}", r.body);
        }
    }

    // Both running: a renews, b waits.
    let (a_tx, mut a) = watch::channel(false);
    let (b_tx, mut b) = watch::channel(false);
    let ta = tokio::spawn(lease::run(api.client(), election("a"), a_tx));
    let tb = tokio::spawn(lease::run(api.client(), election("b"), b_tx));
    a.wait_for(|l| *l).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        *a.borrow() && !*b.borrow(),
        "a renews within the lease time: b stands by"
    );
    // a renews by replacing at the version it read.
    let puts: Vec<_> = api
        .take()
        .into_iter()
        .filter(|r| r.method == "PUT")
        .collect();
    assert!(!puts.is_empty());
    for p in &puts {
        assert!(p.body["metadata"]["resourceVersion"].is_string());
        assert_eq!(p.body["spec"]["holderIdentity"], "a");
    }

    // a stops (no renewals): b leads within the lease time (+ one look).
    ta.abort();
    let stopped = tokio::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(5), b.wait_for(|l| *l))
        .await
        .expect("b took over")
        .unwrap();
    let took = stopped.elapsed();
    assert!(
        took <= Duration::from_millis(3500),
        "took over after {took:?}"
    );
    let l = leases.get("gpu-controller").await.unwrap();
    let spec = l.spec.unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("b"));
    assert_eq!(spec.lease_transitions, Some(1));
    assert_eq!(spec.lease_duration_seconds, Some(2));
    tb.abort();
}

/// A replica that does not hold the Lease is not ready and turns agents
/// away in words; it writes nothing.
#[test]
fn a_stand_by_replica_is_not_ready_and_turns_agents_away() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    api.add_node("gpu-node-1", common::kubelet_node());
    api.add_token(
        "t1",
        "system:serviceaccount:gpu-agent:gpu-agent",
        "gpu-node-1",
    );
    let now = jiff::Timestamp::now().to_string();
    api.add_lease(
        "gpu-agent",
        "gpu-controller",
        serde_json::json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "gpu-controller", "namespace": "gpu-agent"},
            "spec": {"holderIdentity": "gpu-controller-other", "leaseDurationSeconds": 3600,
                     "renewTime": now, "acquireTime": now, "leaseTransitions": 0}
        }),
    );
    let dir = tempfile::tempdir().unwrap();
    let http = common::free_port();
    let (mut controller, port, ca) = common::start_controller_with(
        &api,
        dir.path(),
        Some(http),
        &[
            ("POD_NAMESPACE", "gpu-agent"),
            ("POD_NAME", "gpu-controller-me"),
        ],
    );
    let get = |path: &str| {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", http)).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    common::wait_for(
        "a look at the Lease",
        Duration::from_secs(10),
        &[&controller],
        || controller.log().contains("standing by"),
    );
    let ready = get("/readyz");
    assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
    assert!(
        ready.contains("standing by: another replica holds the Lease"),
        "{ready}"
    );
    let refused = rt
        .block_on(common::fake_agent(
            port,
            &ca,
            "t1",
            "gpu-node-1",
            Default::default(),
            vec![],
        ))
        .err()
        .expect("a stand-by turns agents away");
    assert_eq!(refused.code(), tonic::Code::Unavailable);
    assert_eq!(
        refused.message(),
        "this gpu-controller replica is standing by (another holds the Lease): connect again"
    );
    assert!(
        api.requests()
            .iter()
            .all(|r| r.method == "GET" || !r.uri.starts_with("/api/v1/nodes")),
        "a stand-by writes no node (it may watch their labels)"
    );
    controller.term();
}
