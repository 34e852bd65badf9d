//! DRA ResourceSlice benchmark (issue 31), run by hand:
//! `cargo bench -p gpu-controller --bench dra_slices [-- NODES]`
//! (default 100 nodes).
//!
//! One gpu-controller process (as built for benches) against the scripted
//! API server. For each node in turn, a stand-in agent connects over TLS
//! (its token reviewed by the API server's TokenReview) and sends its
//! first report: 8 H100 GPUs, all handed out by its DRA plugin, which is
//! registered. Measured: from just before the agent connects to the
//! moment the API server has the node's ResourceSlice (connect, token
//! review and the controller's write all counted). Then, a second later,
//! every node's slices are deleted as a starting 1.36 kubelet deletes them,
//! one node at a time: measured from the delete to the slice written again.
//!
//! Printed: p50/p99/max of both, against the target (a node's
//! ResourceSlices in the API within 2 s of the agent's first report), and
//! the API requests made while the agents sent the same report again (0
//! expected).

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use gpu_agent_proto::report::v1 as pb;

const ACCOUNT: &str = "system:serviceaccount:gpu-agent:gpu-agent";
/// A node that never gets its slice stops the benchmark.
const GIVE_UP: Duration = Duration::from_secs(30);

/// An 8x H100 node whose DRA plugin hands out every GPU.
fn report() -> pb::NodeReport {
    let gpus: Vec<pb::Gpu> = (0..8u32)
        .map(|i| pb::Gpu {
            index: i,
            minor: Some(i),
            uuid: format!("GPU-{i:08x}-bench"),
            model: "NVIDIA H100 80GB HBM3".into(),
            pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + i * 0x10),
            memory_mib: 81559,
            compute_capability: Some("9.0".into()),
            numa_node: Some(i / 4),
            ..Default::default()
        })
        .collect();
    pb::NodeReport {
        health: Some(pb::Health {
            gpus: gpus
                .iter()
                .map(|g| pb::GpuHealth {
                    uuid: g.uuid.clone(),
                    healthy: true,
                    ..Default::default()
                })
                .collect(),
        }),
        dra: Some(pb::DraState {
            registered: true,
            gpu_uuids: gpus.iter().map(|g| g.uuid.clone()).collect(),
            ..Default::default()
        }),
        inventory: Some(pb::Inventory {
            driver_version: "580.95.05".into(),
            cuda_version: "13.0".into(),
            gpus,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1000.0
}

fn show(what: &str, mut v: Vec<Duration>) {
    v.sort();
    let p99 = pct(&v, 0.99);
    println!(
        "{what}: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms (n={}; target p99 <= 2000 ms: {})",
        pct(&v, 0.50),
        p99,
        pct(&v, 1.0),
        v.len(),
        if p99 <= 2000.0 { "met" } else { "NOT met" }
    );
}

async fn until_slice(api: &common::MockApi, node: &str) {
    let began = Instant::now();
    while api.node_slice_count(node) == 0 {
        assert!(began.elapsed() < GIVE_UP, "{node}: no ResourceSlice");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn run(nodes: usize) {
    println!("gpu-controller DRA ResourceSlice benchmark: {nodes} nodes of 8 GPUs");
    let api = common::MockApi::start().await;
    for i in 0..nodes {
        let node = format!("node-{i:05}");
        api.add_node(&node, common::kubelet_node());
        api.add_token(&format!("tok-{i}"), ACCOUNT, &node);
    }
    let dir = tempfile::tempdir().unwrap();
    let (controller, port, ca) = common::start_controller(&api, dir.path(), None);
    // The controller's watch of the slices is open (it writes nothing
    // before it has listed them).
    let began = Instant::now();
    while !api.requests().iter().any(|r| {
        r.uri
            .starts_with("/apis/resource.k8s.io/v1/resourceslices?")
            && r.uri.contains("watch=true")
    }) {
        assert!(
            began.elapsed() < GIVE_UP,
            "no watch of the ResourceSlices:\n{}",
            controller.log()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let mut first = Vec::with_capacity(nodes);
    let mut agents = Vec::with_capacity(nodes);
    for i in 0..nodes {
        let node = format!("node-{i:05}");
        let t = Instant::now();
        let agent = common::fake_agent(port, &ca, &format!("tok-{i}"), &node, report(), vec![])
            .await
            .unwrap_or_else(|e| panic!("{node}: {e}\n{}", controller.log()));
        until_slice(&api, &node).await;
        first.push(t.elapsed());
        agents.push(agent);
    }

    // The same report again on a new stream of every agent (which
    // replaces the old one): no request but the token reviews.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = api.requests().len();
    let mut again = Vec::with_capacity(nodes);
    for i in 0..nodes {
        let node = format!("node-{i:05}");
        again.push(
            common::fake_agent(port, &ca, &format!("tok-{i}"), &node, report(), vec![])
                .await
                .unwrap(),
        );
    }
    drop(agents);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let unchanged: Vec<String> = api.requests()[before..]
        .iter()
        .filter(|r| !r.uri.starts_with("/apis/authentication.k8s.io/"))
        .map(|r| format!("{} {}", r.method, r.uri))
        .collect();

    let mut wiped = Vec::with_capacity(nodes);
    for i in 0..nodes {
        let node = format!("node-{i:05}");
        let t = Instant::now();
        assert_eq!(api.delete_node_slices(&node), 1);
        until_slice(&api, &node).await;
        wiped.push(t.elapsed());
    }
    drop(again);

    show("first report -> the node's ResourceSlice in the API", first);
    show("kubelet's wipe -> the ResourceSlice written again", wiped);
    println!(
        "API requests while {nodes} agents sent the same report again (token reviews aside): {} {:?}",
        unchanged.len(),
        unchanged.iter().take(5).collect::<Vec<_>>()
    );
}

fn main() {
    let nodes = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(100usize);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(nodes));
}
