//! Two gpu-controller replicas sharing the fleet (`--shards`): real
//! gpu-agent processes all check in with the first replica; the agents of
//! nodes whose shard the second holds are sent there (the answer's
//! redirect) and report through it. Each node is written by one replica
//! only. The second replica is killed: its shards are taken over once
//! their Leases expire, and its nodes' agents go back to the first.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{MockApi, Proc, kubelet_node, wait_for};
use gpu_controller::shards::shard_of;
use k8s_openapi::api::coordination::v1::Lease;

const ACCOUNT: &str = "system:serviceaccount:gpu-agent:gpu-agent";
const SHARDS: u32 = 4;

/// One replica, with a kubeconfig token of its own (the API server records
/// which token wrote each node).
fn replica(api: &MockApi, dir: &Path, name: &str, port: u16) -> Proc {
    common::sharded_replica(api, dir, name, port, SHARDS)
}

/// Each shard's holder, as the Leases say (empty: none).
fn holders(rt: &tokio::runtime::Runtime, api: &MockApi) -> Vec<String> {
    let leases: kube::Api<Lease> = {
        let _in = rt.enter();
        kube::Api::namespaced(api.client(), "gpu-agent")
    };
    (0..SHARDS)
        .map(|k| {
            rt.block_on(leases.get_opt(&format!("gpu-controller-shard-{k}")))
                .ok()
                .flatten()
                .and_then(|l| l.spec?.holder_identity)
                .unwrap_or_default()
        })
        .collect()
}

#[test]
fn replicas_share_the_fleet_and_take_over_a_dead_ones_nodes() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    let dir = tempfile::tempdir().unwrap();
    let (ca, _, _) = common::certs(dir.path());
    let nodes: Vec<String> = (0..4).map(|i| format!("gpu-node-{i}")).collect();
    for (i, n) in nodes.iter().enumerate() {
        api.add_node(n, kubelet_node());
        api.add_token(&format!("t{i}"), ACCOUNT, n);
    }
    let (p1, p2) = (common::free_port(), common::free_port());
    let mut r1 = replica(&api, dir.path(), "r1", p1);
    let mut r2 = replica(&api, dir.path(), "r2", p2);
    wait_for(
        "both replicas to hold shards",
        Duration::from_secs(30),
        &[&r1, &r2],
        || {
            let h = holders(&rt, &api);
            h.iter().all(|h| !h.is_empty()) && h.iter().collect::<BTreeSet<_>>().len() == 2
        },
    );
    let policy = common::eks_policy();
    let global = [
        "--simulate".as_ref(),
        "h100-sxm-8".as_ref(),
        "--policy".as_ref(),
        policy.as_os_str(),
    ];
    // Every agent is given the first replica (as the Service would).
    let mut agents: Vec<(Proc, std::path::PathBuf)> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let host = dir.path().join(format!("host-{i}"));
            common::h100_host(&host);
            let a = common::reporting_agent(
                dir.path(),
                &host,
                &global,
                &[],
                p1,
                &ca,
                &format!("t{i}"),
                n,
            );
            (a, host)
        })
        .collect();
    let logs = |extra: &[&Proc]| -> Vec<String> { extra.iter().map(|p| p.log()).collect() };
    wait_for(
        "every node's labels",
        Duration::from_secs(60),
        &[&r1, &r2],
        || {
            nodes
                .iter()
                .all(|n| api.node(n)["metadata"]["labels"]["nvidia.com/gpu.count"] == "8")
        },
    );
    let h = holders(&rt, &api);
    let owner = |n: &str| h[shard_of(n, SHARDS) as usize].clone();
    // Each node written by its shard's holder, and by it only.
    let writers = api.node_writers();
    for n in &nodes {
        let want = BTreeSet::from([format!("Bearer token-{}", owner(n))]);
        assert_eq!(
            writers.get(n.as_str()),
            Some(&want),
            "{n} (shard {}, held by {}): {writers:?}\n{:?}",
            shard_of(n, SHARDS),
            owner(n),
            logs(&[&r1, &r2])
        );
    }
    // The agents of r2's nodes report through r2 (as their state file
    // says, once the agent has written it).
    for (i, n) in nodes.iter().enumerate() {
        let connected = format!("connected as node {n}");
        wait_for(
            "the agent's status to say it reports",
            Duration::from_secs(30),
            &[&agents[i].0],
            || common::agent_status(&agents[i].1).contains(&connected),
        );
        let status = common::agent_status(&agents[i].1);
        let through_r2 = status.contains(&format!("through the replica https://localhost:{p2}"));
        assert_eq!(
            through_r2,
            owner(n) == "r2",
            "{n}, held by {}: {status}",
            owner(n)
        );
    }
    // r2 dies: its shards are taken over once their Leases expire (10 s),
    // and its nodes' agents come back to r1.
    let r2_nodes: Vec<&String> = nodes.iter().filter(|n| owner(n) == "r2").collect();
    let _ = r2.child.kill();
    let _ = r2.child.wait();
    let killed = Instant::now();
    wait_for(
        "r1 to hold every shard",
        Duration::from_secs(30),
        &[&r1],
        || holders(&rt, &api).iter().all(|h| h == "r1"),
    );
    let took_over = killed.elapsed();
    assert!(
        took_over >= Duration::from_secs(5),
        "taken over after {took_over:?}: before the Leases could expire"
    );
    wait_for(
        "r2's agents to report through r1",
        Duration::from_secs(30),
        &[&r1],
        || {
            r2_nodes.iter().all(|n| {
                let i = nodes.iter().position(|x| x == *n).unwrap();
                let s = common::agent_status(&agents[i].1);
                s.contains(&format!("https://localhost:{p1}: connected as node {n}"))
                    && !s.contains("through the replica")
            })
        },
    );
    eprintln!(
        "shards {h:?}; r2's nodes {r2_nodes:?}; r1 held every shard {:.1} s after r2 was killed",
        took_over.as_secs_f64()
    );
    for (a, _) in &mut agents {
        a.term();
    }
    r1.term();
}

/// The ClusterPolicy's status, written by the elected leader, counts every
/// shard's nodes: each replica carries a summary of its shards' nodes in
/// their Leases (`gpu-agent.io/policy-summary`), and the leader merges
/// them with its own. Two nodes on each replica's shards, real agents
/// running the ClusterPolicy (no kubelet here: their device plugin never
/// validates).
#[test]
fn the_cluster_policy_status_counts_every_shards_nodes() {
    use gpu_controller::model::policy_summary::{PolicySummary, SUMMARY};
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    api.set_cluster_policy(
        "cluster-policy",
        serde_json::json!({
            "driver": {"enabled": false},
            "toolkit": {"enabled": false},
            "dcgmExporter": {"enabled": false},
            "sandboxWorkloads": {"enabled": false},
        }),
    );
    let dir = tempfile::tempdir().unwrap();
    let (ca, _, _) = common::certs(dir.path());
    let (p1, p2) = (common::free_port(), common::free_port());
    let mut r1 = replica(&api, dir.path(), "r1", p1);
    let mut r2 = replica(&api, dir.path(), "r2", p2);
    wait_for(
        "both replicas to hold shards",
        Duration::from_secs(30),
        &[&r1, &r2],
        || {
            let h = holders(&rt, &api);
            h.iter().all(|h| !h.is_empty()) && h.iter().collect::<BTreeSet<_>>().len() == 2
        },
    );
    let h = holders(&rt, &api);
    let owner = |n: &str| h[shard_of(n, SHARDS) as usize].clone();
    let mut nodes: Vec<String> = Vec::new();
    for want in ["r1", "r2"] {
        nodes.extend(
            (0..)
                .map(|i| format!("gpu-node-{i}"))
                .filter(|n| owner(n) == want)
                .take(2),
        );
    }
    nodes.sort();
    for (i, n) in nodes.iter().enumerate() {
        api.add_node(n, kubelet_node());
        api.add_token(&format!("t{i}"), ACCOUNT, n);
    }
    let policy = common::eks_policy();
    let global = [
        "--simulate".as_ref(),
        "h100-sxm-8".as_ref(),
        "--policy".as_ref(),
        policy.as_os_str(),
    ];
    let started = Instant::now();
    let mut agents: Vec<Proc> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let host = dir.path().join(format!("host-{i}"));
            common::h100_host(&host);
            common::reporting_agent(
                dir.path(),
                &host,
                &global,
                &[],
                p1,
                &ca,
                &format!("t{i}"),
                n,
            )
        })
        .collect();
    let problems: Vec<String> = nodes
        .iter()
        .map(|n| format!("{n}: not every stage is validated"))
        .collect();
    let want = format!(
        "0 of 4 reporting nodes run it ({}); keys gpu-agent does not use: spec.sandboxWorkloads",
        problems.join("; ")
    );
    let message = || {
        api.cluster_policy("cluster-policy")["status"]["conditions"][0]["message"]
            .as_str()
            .unwrap_or("")
            .to_string()
    };
    wait_for(
        "the ClusterPolicy's status to count every shard's nodes",
        Duration::from_secs(60),
        &[&r1, &r2],
        || message() == want,
    );
    let counted = started.elapsed();
    let st = api.cluster_policy("cluster-policy")["status"].clone();
    assert_eq!(st["state"], "notReady", "{st}");
    assert_eq!(st["conditions"][0]["reason"], "AgentsNotReady", "{st}");
    // Each shard's Lease carries its holder's summary of its nodes.
    let leases: kube::Api<Lease> = {
        let _in = rt.enter();
        kube::Api::namespaced(api.client(), "gpu-agent")
    };
    let mut reporting = 0;
    for k in 0..SHARDS {
        let l = rt
            .block_on(leases.get(&format!("gpu-controller-shard-{k}")))
            .unwrap();
        let text = l.metadata.annotations.unwrap_or_default()[SUMMARY].clone();
        let s = PolicySummary::decode(k, &text).unwrap();
        assert_eq!(s.policy, "cluster-policy");
        let mine = nodes.iter().filter(|n| shard_of(n, SHARDS) == k).count();
        assert_eq!(s.reporting, mine as u64, "shard {k}: {text}");
        reporting += s.reporting;
    }
    assert_eq!(reporting, 4);
    // A quiet fleet: no more status writes.
    let writes = || {
        api.requests()
            .iter()
            .filter(|r| r.uri.contains("/clusterpolicies/cluster-policy/status"))
            .count()
    };
    let before = writes();
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(writes(), before, "{:?}", message());
    eprintln!(
        "shards {h:?}; nodes {nodes:?}; the status counted all 4 nodes {:.1} s after the agents started, in {before} status writes",
        counted.as_secs_f64()
    );
    for a in &mut agents {
        a.term();
    }
    r2.term();
    r1.term();
}
