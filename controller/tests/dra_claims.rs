//! Claim allocations for prepare (issue 31), with the running gpu-controller
//! and the scripted API server: the ResourceClaims allocated to a node's
//! `gpu.nvidia.com` devices come down that node's report stream as
//! `DraClaims`, the whole list each time it changes, to no other node;
//! again to a new stream; nothing when a claim changes but its allocation
//! does not; and a re-list (the watch expired) replaces every claim.
//!
//! The agents are stand-ins (our tonic client over the real TLS stream,
//! `common::fake_agent`). "Nothing came" is proven by order where it can
//! be: a node's next list after a change that must not reach it is the one
//! of a change that must.

mod common;

use std::time::Duration;

use common::claims::claim;
use common::{FakeAgent, MockApi, Proc, fake_agent, kubelet_node, start_controller};
use gpu_agent_proto::report::v1 as pb;
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(20);
const ACCOUNT: &str = "system:serviceaccount:gpu-agent:gpu-agent";
const CLAIMS: &str = "/apis/resource.k8s.io/v1/resourceclaims";

/// A result of ours on `node`.
fn gpu(node: &str, device: &str) -> Value {
    json!({"request": "gpu", "driver": "gpu.nvidia.com", "pool": node, "device": device})
}

/// Another driver's device, on `node`'s pool of NICs.
fn nic(node: &str) -> Value {
    json!({"request": "nic", "driver": "rdma.example.com", "pool": format!("{node}-nics"), "device": "nic-0"})
}

fn uids(l: &pb::DraClaims) -> Vec<&str> {
    l.claims.iter().map(|c| c.uid.as_str()).collect()
}

/// A report whose DRA plugin is registered (or no DRA at all).
fn report(dra: bool) -> pb::NodeReport {
    pb::NodeReport {
        dra: dra.then(|| pb::DraState {
            registered: true,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn api_with_nodes(rt: &tokio::runtime::Runtime, nodes: &[&str]) -> MockApi {
    let api = rt.block_on(MockApi::start());
    for n in nodes {
        api.add_node(n, kubelet_node());
        api.add_token(&format!("token-{n}"), ACCOUNT, n);
    }
    api
}

async fn agent(port: u16, ca: &std::path::Path, node: &str, dra: bool) -> FakeAgent {
    fake_agent(
        port,
        ca,
        &format!("token-{node}"),
        node,
        report(dra),
        vec![],
    )
    .await
    .unwrap()
}

/// The node's next list, or a failure with the controller's log.
async fn next(a: &mut FakeAgent, what: &str, controller: &Proc) -> pb::DraClaims {
    a.dra_claims(WITHIN)
        .await
        .unwrap_or_else(|| panic!("no DraClaims: {what}\ncontroller:\n{}", controller.log()))
}

#[test]
fn claims_reach_the_agent_of_their_node_only_and_each_change_once() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = api_with_nodes(&rt, &["node-a", "node-b", "node-c"]);
    // Before the controller starts: a GPU of node-a with another driver's
    // NIC in the same claim, a claim not allocated yet, and a claim of
    // another driver only.
    api.set_claim(claim(
        "c1",
        Some("node-a"),
        json!([nic("node-a"), gpu("node-a", "gpu-0")]),
    ));
    api.set_claim(claim("pending", None, json!([])));
    api.set_claim(claim("theirs", Some("node-a"), json!([nic("node-a")])));
    let dir = tempfile::tempdir().unwrap();
    let (mut controller, port, ca) = start_controller(&api, dir.path(), None);

    rt.block_on(async {
        let mut a = agent(port, &ca, "node-a", true).await;
        let mut b = agent(port, &ca, "node-b", true).await;
        let mut c = agent(port, &ca, "node-c", false).await;

        let la = next(&mut a, "node-a's first list", &controller).await;
        assert_eq!(uids(&la), ["uid-c1"]);
        assert_eq!(
            la.claims[0].devices,
            [pb::DraAllocatedDevice {
                request: "gpu".into(),
                pool: "node-a".into(),
                device: "gpu-0".into(),
                share_id: None,
            }],
            "the NIC is another driver's"
        );
        assert_eq!(
            (la.claims[0].namespace.as_str(), la.claims[0].name.as_str()),
            ("ml", "c1")
        );
        let lb = next(&mut b, "node-b's first list", &controller).await;
        assert!(
            lb.claims.is_empty(),
            "node-b serves DRA and has none: {lb:?}"
        );

        // A shared GPU allocated on node-b reaches node-b.
        let mut shared = gpu("node-b", "gpu-3");
        shared["shareID"] = json!("7d3c0e52-0000-4000-8000-000000000001");
        api.set_claim(claim("c2", Some("node-b"), json!([shared])));
        let lb = next(&mut b, "c2 on node-b", &controller).await;
        assert_eq!(uids(&lb), ["uid-c2"]);
        assert_eq!(
            lb.claims[0].devices[0].share_id.as_deref(),
            Some("7d3c0e52-0000-4000-8000-000000000001")
        );

        // c1 changes but not its allocation (a label): nothing is sent;
        // node-a's next list is that of c3, allocated after it.
        let mut labelled = claim(
            "c1",
            Some("node-a"),
            json!([nic("node-a"), gpu("node-a", "gpu-0")]),
        );
        labelled["metadata"]["labels"] = json!({"team": "vision"});
        api.set_claim(labelled);
        api.set_claim(claim("c3", Some("node-a"), json!([gpu("node-a", "gpu-1")])));
        let la = next(&mut a, "c3 on node-a", &controller).await;
        assert_eq!(uids(&la), ["uid-c1", "uid-c3"], "the whole list");

        // c1 deallocated: node-a's whole list again, without it.
        api.set_claim(claim("c1", None, json!([])));
        let la = next(&mut a, "c1 deallocated", &controller).await;
        assert_eq!(uids(&la), ["uid-c3"]);

        // node-b was sent none of node-a's lists: its next is its own.
        api.delete_claim("ml", "c2");
        let lb = next(&mut b, "c2 deleted", &controller).await;
        assert!(lb.claims.is_empty(), "{lb:?}");

        // c3 deleted: node-a is told it has none.
        api.delete_claim("ml", "c3");
        let la = next(&mut a, "c3 deleted", &controller).await;
        assert!(la.claims.is_empty(), "{la:?}");

        // node-c's agent does not serve DRA and had no claim: told nothing.
        assert!(c.dra_claims(Duration::from_millis(500)).await.is_none());

        // A new stream of node-a gets its list again.
        api.set_claim(claim("c4", Some("node-a"), json!([gpu("node-a", "gpu-2")])));
        let la = next(&mut a, "c4 on node-a", &controller).await;
        assert_eq!(uids(&la), ["uid-c4"]);
        drop(a);
        let mut again = agent(port, &ca, "node-a", true).await;
        let la = next(&mut again, "node-a's new stream", &controller).await;
        assert_eq!(uids(&la), ["uid-c4"]);
    });
    let log = controller.log();
    assert!(
        log.contains("sending the agent its node's ResourceClaims node=\"node-a\" claims=1"),
        "{log}"
    );
    assert!(
        !log.contains("cannot watch the ResourceClaims")
            && !log.contains("cannot be handed to its node's agent"),
        "{log}"
    );
    controller.term();
}

#[test]
fn a_relisting_replaces_every_claim() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = api_with_nodes(&rt, &["node-a"]);
    api.set_claim(claim("c1", Some("node-a"), json!([gpu("node-a", "gpu-0")])));
    api.set_claim(claim("c2", Some("node-a"), json!([gpu("node-a", "gpu-1")])));
    let dir = tempfile::tempdir().unwrap();
    let (mut controller, port, ca) = start_controller(&api, dir.path(), None);

    rt.block_on(async {
        let mut a = agent(port, &ca, "node-a", true).await;
        let la = next(&mut a, "node-a's first list", &controller).await;
        assert_eq!(uids(&la), ["uid-c1", "uid-c2"]);
        let deadline = std::time::Instant::now() + WITHIN;
        while api.claim_watches() == 0 {
            assert!(std::time::Instant::now() < deadline, "no claims watch");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        // The watch ends and its history is gone (compaction): c2 deleted
        // and c5 made meanwhile reach the agent through a new listing.
        api.expire_claim_watches();
        api.delete_claim("ml", "c2");
        api.set_claim(claim("c5", Some("node-a"), json!([gpu("node-a", "gpu-1")])));
        loop {
            let la = next(&mut a, "the claims listed again", &controller).await;
            assert!(!uids(&la).contains(&"uid-c2"), "{la:?}");
            if uids(&la) == ["uid-c1", "uid-c5"] {
                break;
            }
        }
    });
    let lists = api
        .requests()
        .iter()
        .filter(|r| r.method == "GET" && r.uri.starts_with(CLAIMS) && !r.uri.contains("watch=true"))
        .count();
    assert_eq!(lists, 2, "listed at start and after the 410");
    let log = controller.log();
    assert!(
        !log.contains("cannot watch the ResourceClaims"),
        "an expired watch is not a failure:\n{log}"
    );
    controller.term();
}
