//! A driver rollout with the nodes sharded over two gpu-controller
//! processes (`--shards 4`): the elected leader plans it for every node,
//! each node's holder applies it (its label, its condition, its agent's
//! go-ahead). Four agents (the Python grpcio stand-in, checking in, every
//! one given the first replica and following the answer's redirect), two on
//! each replica's shards, all report `upgrade-required` for a ClusterPolicy
//! that asks for a newer driver (`autoUpgrade`, `maxParallelUpgrades: 1`).
//!
//! Asserted from the API server's record of every request: the leader's
//! steps (its `gpu-agent.io/upgrade-step` annotations) and its cordons move
//! one node at a time across both replicas' shards; each node's labels and
//! conditions (and its upgrade Events) are written by its holder only, the
//! steps by the leader only; each agent got its go-ahead from its holder;
//! every node ends `upgrade-done`, uncordoned, its GPU pod evicted. The
//! leader stopped in mid-rollout: the other replica takes its Lease and
//! shards and carries the rollout on, one node at a time still; a holder
//! stopped: the leader takes its shards and carries on. And a new
//! leader, in process, carries on from what the nodes carry.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use common::{MockApi, Proc, kubelet_node, wait_for};
use gpu_agent_proto::report::v1 as pb;
use gpu_controller::fleet::Fleet;
use gpu_controller::model::node::{Observed, TaintPolicy};
use gpu_controller::model::upgrade_notes::{
    AGENT_UPGRADE, AgentFacts, UPGRADE_STEP, decode_step, encode_step,
};
use gpu_controller::shards::shard_of;
use gpu_controller::upgrade::{INITIAL_UNSCHEDULABLE, NodeUpgrade, Step, UpgradePolicy, Upgrader};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use serde_json::{Value, json};

const ACCOUNT: &str = "system:serviceaccount:gpu-agent:gpu-agent";
const SHARDS: u32 = 4;
const NEW: &str = "560.35.03";
const STATE: &str = "nvidia.com/gpu-driver-upgrade-state";

/// One replica, with a kubeconfig token of its own (`token-<name>`: the
/// API server records which token sent each request).
fn replica(api: &MockApi, dir: &Path, name: &str, port: u16) -> Proc {
    common::sharded_replica(api, dir, name, port, SHARDS)
}

/// A Lease's holder (empty: none, or no such Lease).
fn holder(rt: &tokio::runtime::Runtime, api: &MockApi, name: &str) -> String {
    let leases: kube::Api<Lease> = {
        let _in = rt.enter();
        kube::Api::namespaced(api.client(), "gpu-agent")
    };
    rt.block_on(leases.get_opt(name))
        .ok()
        .flatten()
        .and_then(|l| l.spec?.holder_identity)
        .unwrap_or_default()
}

/// A GPU pod (a ReplicaSet's) on `node`.
fn gpu_pod(node: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"labels": {"app": "train"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "train", "uid": "u-1", "controller": true}]},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "cuda:12",
            "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
        "status": {"phase": "Running"},
    })
}

/// The node a request is about (`/api/v1/nodes/<node>[/status]`), if one.
fn node_of(r: &common::Recorded) -> Option<&str> {
    let path = r.uri.split('?').next()?;
    path.strip_prefix("/api/v1/nodes/")?.split('/').next()
}

/// Two replicas holding the shards (r1 started first: it leads), and four
/// nodes, two on each one's shards, each with a GPU pod and its agent's
/// token, under a ClusterPolicy that asks for a newer driver.
struct Cluster {
    rt: tokio::runtime::Runtime,
    api: MockApi,
    _dir: tempfile::TempDir,
    ca: std::path::PathBuf,
    r1: Proc,
    r2: Proc,
    p1: u16,
    p2: u16,
    /// Each shard's holder when the nodes were made.
    holders: Vec<String>,
    nodes: Vec<String>,
}

impl Cluster {
    fn start() -> Cluster {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let api = rt.block_on(MockApi::start());
        api.set_cluster_policy(
            "cluster-policy",
            json!({"driver": {"enabled": true, "version": NEW,
                "upgradePolicy": {"autoUpgrade": true, "maxParallelUpgrades": 1}}}),
        );
        let dir = tempfile::tempdir().unwrap();
        let (ca, _, _) = common::certs(dir.path());
        let (p1, p2) = (common::free_port(), common::free_port());
        let r1 = replica(&api, dir.path(), "r1", p1);
        let r2 = replica(&api, dir.path(), "r2", p2);
        let shard_holders = || -> Vec<String> {
            (0..SHARDS)
                .map(|k| holder(&rt, &api, &format!("gpu-controller-shard-{k}")))
                .collect()
        };
        wait_for(
            "both replicas to hold shards",
            Duration::from_secs(30),
            &[&r1, &r2],
            || {
                let h = shard_holders();
                h.iter().all(|h| !h.is_empty()) && h.iter().collect::<BTreeSet<_>>().len() == 2
            },
        );
        let holders = shard_holders();
        let mut c = Cluster {
            rt,
            api,
            _dir: dir,
            ca,
            r1,
            r2,
            p1,
            p2,
            holders,
            nodes: Vec::new(),
        };
        // Two nodes on each replica's shards.
        let mut nodes: Vec<String> = Vec::new();
        for want in ["r1", "r2"] {
            nodes.extend(
                (0..)
                    .map(|i| format!("gpu-node-{i}"))
                    .filter(|n| c.owner(n) == want)
                    .take(2),
            );
        }
        nodes.sort();
        for (i, n) in nodes.iter().enumerate() {
            c.api.add_node(n, kubelet_node());
            c.api.add_token(&format!("t{i}"), ACCOUNT, n);
            c.api.add_pod("ml", &format!("train-{n}"), gpu_pod(n));
        }
        c.nodes = nodes;
        c
    }

    /// The node's shard's holder when the nodes were made.
    fn owner(&self, n: &str) -> String {
        self.holders[shard_of(n, SHARDS) as usize].clone()
    }

    fn port_of(&self, r: &str) -> u16 {
        if r == "r1" { self.p1 } else { self.p2 }
    }

    /// Every node's agent, each given the first replica (as the Service
    /// would), and the second when the first does not answer: what each
    /// printed, once it is done.
    fn agents(&self) -> Vec<std::thread::JoinHandle<std::process::Output>> {
        self.nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let (n, ca, port) = (n.clone(), self.ca.clone(), self.p1);
                let also = format!("localhost:{}", self.p2);
                std::thread::spawn(move || {
                    let token = format!("t{i}");
                    let args = [
                        "--token",
                        token.as_str(),
                        "--upgrade",
                        NEW,
                        "--check-in",
                        "--hold",
                        "3",
                        "--also",
                        also.as_str(),
                    ];
                    common::report_client(port, &ca, &n, &args)
                })
            })
            .collect()
    }

    /// Each node's upgrade state, cordon and published step, as the API
    /// holds them.
    fn states(&self) -> String {
        self.nodes
            .iter()
            .map(|n| {
                let node = self.api.node(n);
                format!(
                    "{n}: state {} unschedulable {} step {}",
                    node["metadata"]["labels"][STATE],
                    node["spec"]["unschedulable"],
                    node["metadata"]["annotations"][UPGRADE_STEP]
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn logs(&self) -> String {
        format!("r1:\n{}\nr2:\n{}", self.r1.log(), self.r2.log())
    }

    /// What the agent printed, once it exited having had its go-ahead.
    fn went(&self, n: &str, out: std::process::Output) -> Value {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{n}'s agent: {stdout}\n{}\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.logs()
        );
        let seen: Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(seen["go_ahead"], NEW, "{n}: {seen}");
        seen
    }

    /// Waits for every node to end `upgrade-done`, uncordoned, with its
    /// DriverUpgradeDone Event.
    fn wait_done(&self, alive: &[&Proc]) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.nodes.iter().all(|n| {
            let node = self.api.node(n);
            node["metadata"]["labels"][STATE] == "upgrade-done"
                && node["spec"]["unschedulable"] == json!(false)
        }) {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for every node upgrade-done and uncordoned:\n{}\nboth replicas' logs:\n{}",
                self.states(),
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        wait_for(
            "each node's DriverUpgradeDone Event",
            Duration::from_secs(10),
            alive,
            || {
                let reqs = self.api.requests();
                self.nodes.iter().all(|n| {
                    reqs.iter().any(|r| {
                        r.uri.contains("/events")
                            && r.body["involvedObject"]["name"] == n.as_str()
                            && r.body["reason"] == "DriverUpgradeDone"
                    })
                })
            },
        );
    }
}

/// Each node's steps, in order.
type Steps<'a> = BTreeMap<&'a str, Vec<&'static str>>;
/// Who wrote steps (a bearer), and of which nodes.
type Steppers<'a> = BTreeMap<&'a str, BTreeSet<&'a str>>;

/// The leaders' steps (their `gpu-agent.io/upgrade-step` annotations) and
/// cordons, in the order the API server took them: one node at a time
/// between upgrade-required and done. Returns each node's steps, and who
/// wrote steps (bearer → the nodes).
fn one_at_a_time(reqs: &[common::Recorded]) -> (Steps<'_>, Steppers<'_>) {
    let mut step: BTreeMap<&str, Step> = BTreeMap::new();
    let mut history: BTreeMap<&str, Vec<&'static str>> = BTreeMap::new();
    let mut steppers: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    let mut most = 0;
    for r in reqs {
        let (Some(n), Some(text)) = (
            node_of(r),
            r.body["metadata"]["annotations"][UPGRADE_STEP].as_str(),
        ) else {
            continue;
        };
        steppers.entry(r.bearer.as_str()).or_default().insert(n);
        match decode_step(n, text).unwrap() {
            Some(up) => {
                history.entry(n).or_default().push(up.step.label());
                step.insert(n, up.step);
            }
            None => {
                step.remove(n);
            }
        }
        let busy: Vec<&&str> = step
            .iter()
            .filter(|(_, s)| s.in_progress())
            .map(|(n, _)| n)
            .collect();
        assert!(
            busy.len() <= 1,
            "two nodes upgrading at once: {busy:?}\n{history:?}"
        );
        most = most.max(busy.len());
    }
    assert_eq!(most, 1);
    for (n, h) in &history {
        assert!(h.contains(&"validation-required"), "{n}: {h:?}");
        assert_eq!(h.last(), Some(&"upgrade-done"), "{n}: {h:?}");
    }
    let mut cordoned = BTreeSet::new();
    for r in reqs {
        let Some(n) = node_of(r) else { continue };
        match r.body["spec"]["unschedulable"].as_bool() {
            Some(true) => {
                cordoned.insert(n);
            }
            Some(false) => {
                cordoned.remove(n);
            }
            None => {}
        }
        assert!(
            cordoned.len() <= 1,
            "two nodes cordoned at once: {cordoned:?}"
        );
    }
    (history, steppers)
}

/// The node's label and GPUDriverUpgraded condition say it is done.
fn done_in_the_api(api: &MockApi, n: &str) {
    let node = api.node(n);
    assert_eq!(node["metadata"]["labels"][STATE], "upgrade-done", "{n}");
    let cond = node["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "GPUDriverUpgraded")
        .cloned()
        .unwrap_or_default();
    assert_eq!(cond["status"], "True", "{n}: {cond}");
    assert!(
        cond["message"]
            .as_str()
            .unwrap_or_default()
            .starts_with(&format!("driver {NEW} validated")),
        "{n}: {cond}"
    );
}

#[test]
fn a_sharded_rollout_goes_one_node_at_a_time_across_both_replicas() {
    let started = Instant::now();
    let mut c = Cluster::start();
    let agents = c.agents();
    for (n, a) in c.nodes.iter().zip(agents) {
        let seen = c.went(n, a.join().unwrap());
        // The go-ahead came from the node's holder.
        let via = format!("localhost:{}", c.port_of(&c.owner(n)));
        assert_eq!(
            seen["via"],
            via.as_str(),
            "{n}, held by {}: {seen}",
            c.owner(n)
        );
    }
    c.wait_done(&[&c.r1, &c.r2]);
    let took = started.elapsed();
    let leader = holder(&c.rt, &c.api, "gpu-controller");
    assert!(leader == "r1" || leader == "r2", "{leader:?}");
    let reqs = c.api.requests();
    let (_, steppers) = one_at_a_time(&reqs);
    let leader_token = format!("Bearer token-{leader}");
    assert_eq!(
        steppers.keys().collect::<Vec<_>>(),
        [&leader_token.as_str()],
        "the steps are the leader's"
    );
    // The cordons are the leader's too.
    for r in &reqs {
        if node_of(r).is_some() && r.body["spec"]["unschedulable"].is_boolean() {
            assert_eq!(r.bearer, leader_token, "{} {}", r.uri, r.body);
        }
    }
    // Each node's labels and conditions (server-side applies) and its
    // upgrade Events written by its holder only; its label went through the
    // rollout's states to done.
    for n in &c.nodes {
        let holder_token = format!("Bearer token-{}", c.owner(n));
        let applies: Vec<&common::Recorded> = reqs
            .iter()
            .filter(|r| node_of(r) == Some(n.as_str()))
            .filter(|r| r.content_type.starts_with("application/apply-patch"))
            .collect();
        let by: BTreeSet<&str> = applies.iter().map(|r| r.bearer.as_str()).collect();
        assert_eq!(
            by,
            BTreeSet::from([holder_token.as_str()]),
            "{n}, held by {}",
            c.owner(n)
        );
        let labels: Vec<&str> = applies
            .iter()
            .filter_map(|r| r.body["metadata"]["labels"][STATE].as_str())
            .collect();
        // In the rollout's order (changes within a second are merged into
        // one write), ending done.
        let steps: Vec<Step> = labels.iter().filter_map(|l| Step::from_label(l)).collect();
        assert_eq!(steps.len(), labels.len(), "{n}: {labels:?}");
        assert!(steps.is_sorted(), "{n}: {labels:?}");
        assert_eq!(labels.last(), Some(&"upgrade-done"), "{n}: {labels:?}");
        done_in_the_api(&c.api, n);
        let events: Vec<&common::Recorded> = reqs
            .iter()
            .filter(|r| r.method == "POST" && r.uri.contains("/events"))
            .filter(|r| r.body["involvedObject"]["name"] == n.as_str())
            .filter(|r| {
                r.body["reason"]
                    .as_str()
                    .is_some_and(|w| w.starts_with("DriverUpgrade"))
            })
            .collect();
        let by: BTreeSet<&str> = events.iter().map(|r| r.bearer.as_str()).collect();
        assert_eq!(by, BTreeSet::from([holder_token.as_str()]), "{n}'s Events");
        assert_eq!(
            events.last().map(|r| &r.body["reason"]),
            Some(&json!("DriverUpgradeDone")),
            "{n}"
        );
    }
    // Every write to a node is one the API server takes (the real 1.36
    // schema: annotations are a map of strings).
    let schemas = common::schema::load();
    for r in reqs
        .iter()
        .filter(|r| r.method == "PATCH" && node_of(r).is_some())
    {
        let errs = common::schema::check(&schemas, "io.k8s.api.core.v1.Node", &r.body, true);
        assert!(errs.is_empty(), "{} {}: {errs:?}", r.uri, r.body);
    }
    // The leader planned for the other replica's nodes: both replicas hold
    // two of them, and every GPU pod was evicted.
    assert!(c.nodes.iter().any(|n| c.owner(n) != leader));
    assert!(c.api.pods().is_empty(), "{:?}", c.api.pods());
    // What carried the rollout between them: the leader's log says the
    // moves it left to the nodes' replica.
    let leader_log = if leader == "r1" {
        c.r1.log()
    } else {
        c.r2.log()
    };
    assert!(
        leader_log.contains("driver upgrade state (for the node's replica)"),
        "{leader_log}"
    );
    eprintln!(
        "{} nodes rolled one at a time over 2 replicas (leader {leader}; holders {:?}) in {:.1} s",
        c.nodes.len(),
        c.holders,
        took.as_secs_f64()
    );
    // The rollout over, the fleet is quiet: no replica writes a node again
    // (no step published again, no label or annotation applied again).
    c.api.take();
    std::thread::sleep(Duration::from_secs(3));
    let late: Vec<String> = c
        .api
        .take()
        .into_iter()
        .filter(|r| r.method == "PATCH" && node_of(r).is_some())
        .map(|r| format!("{} {} {}", r.bearer, r.uri, r.body))
        .collect();
    assert!(late.is_empty(), "node writes once done: {late:#?}");
    c.r1.term();
    c.r2.term();
}

/// The leader (which holds half the nodes) stops in mid-rollout, while a
/// node of its own is upgrading: the other replica takes its Lease and its
/// shards and carries the rollout on from what the nodes carry, one node
/// at a time still, to every node done.
#[test]
fn the_rollout_goes_on_when_the_leader_stops_in_mid_rollout() {
    let mut c = Cluster::start();
    assert_eq!(holder(&c.rt, &c.api, "gpu-controller"), "r1");
    // The leader's second node (by name, its nodes go first).
    let second = c
        .nodes
        .iter()
        .filter(|n| c.owner(n) == "r1")
        .nth(1)
        .unwrap()
        .clone();
    let agents = c.agents();
    wait_for(
        "the leader's second node to start",
        Duration::from_secs(30),
        &[&c.r1, &c.r2],
        || {
            c.api.node(&second)["metadata"]["annotations"][UPGRADE_STEP]
                .as_str()
                .and_then(|t| decode_step(&second, t).ok().flatten())
                .is_some_and(|u| u.step.in_progress())
        },
    );
    c.r1.term();
    let stopped = c.api.requests().len();
    for (n, a) in c.nodes.iter().zip(agents) {
        c.went(n, a.join().unwrap());
    }
    c.wait_done(&[&c.r2]);
    assert_eq!(holder(&c.rt, &c.api, "gpu-controller"), "r2");
    let reqs = c.api.requests();
    let (_, steppers) = one_at_a_time(&reqs);
    // The new leader wrote the steps of the nodes left, the old one's
    // included; every node is done in the API.
    let r2_steps = &steppers["Bearer token-r2"];
    assert!(r2_steps.contains(second.as_str()), "{steppers:?}");
    for n in c.nodes.iter().filter(|n| c.owner(n) == "r2") {
        assert!(r2_steps.contains(n.as_str()), "{n}: {steppers:?}");
    }
    for n in &c.nodes {
        done_in_the_api(&c.api, n);
    }
    // After the stop, every write is the new leader's.
    assert!(
        reqs[stopped..]
            .iter()
            .filter(|r| r.method != "GET")
            .all(|r| r.bearer == "Bearer token-r2"),
        "{:?}",
        reqs[stopped..]
            .iter()
            .filter(|r| r.bearer != "Bearer token-r2")
            .map(|r| format!("{} {} {}", r.bearer, r.method, r.uri))
            .collect::<Vec<_>>()
    );
    c.r2.term();
}

/// A holder that does not lead stops in mid-rollout, one of its nodes
/// done and its other upgrading: the leader takes its shards and carries
/// the rollout on, one node at a time still. The node done before the
/// stop keeps its `upgrade-done` label though its agent checks in with
/// the leader now (the leader saw the node done while another replica
/// held it).
#[test]
fn the_rollout_goes_on_when_a_holder_stops_in_mid_rollout() {
    let mut c = Cluster::start();
    assert_eq!(holder(&c.rt, &c.api, "gpu-controller"), "r1");
    // The holder's nodes go after the leader's, by name.
    let theirs: Vec<String> = c
        .nodes
        .iter()
        .filter(|n| c.owner(n) == "r2")
        .cloned()
        .collect();
    let agents = c.agents();
    let (first, second) = (&theirs[0], &theirs[1]);
    wait_for(
        "the holder's first node done and its second started",
        Duration::from_secs(30),
        &[&c.r1, &c.r2],
        || {
            let step = |n: &str| {
                c.api.node(n)["metadata"]["annotations"][UPGRADE_STEP]
                    .as_str()
                    .and_then(|t| decode_step(n, t).ok().flatten())
            };
            c.api.node(first)["metadata"]["labels"][STATE] == "upgrade-done"
                && step(second).is_some_and(|u| u.step.in_progress())
        },
    );
    c.r2.term();
    let stopped = c.api.requests().len();
    for (n, a) in c.nodes.iter().zip(agents) {
        c.went(n, a.join().unwrap());
    }
    c.wait_done(&[&c.r1]);
    assert_eq!(holder(&c.rt, &c.api, "gpu-controller"), "r1");
    let reqs = c.api.requests();
    // One leader wrote every step, one node at a time.
    let (_, steppers) = one_at_a_time(&reqs);
    assert_eq!(
        steppers.keys().copied().collect::<Vec<_>>(),
        ["Bearer token-r1"],
        "{steppers:?}"
    );
    for n in &c.nodes {
        done_in_the_api(&c.api, n);
    }
    // After the stop, every write is the leader's; the node done before
    // it never lost its label.
    let after = &reqs[stopped..];
    assert!(
        after
            .iter()
            .filter(|r| r.method != "GET")
            .all(|r| r.bearer == "Bearer token-r1"),
        "{:?}",
        after
            .iter()
            .filter(|r| r.bearer != "Bearer token-r1")
            .map(|r| format!("{} {} {}", r.bearer, r.method, r.uri))
            .collect::<Vec<_>>()
    );
    let dropped: Vec<String> = after
        .iter()
        .filter(|r| node_of(r) == Some(first.as_str()))
        .filter(|r| {
            r.body["metadata"]["labels"].is_object()
                && r.body["metadata"]["labels"][STATE] != "upgrade-done"
        })
        .map(|r| format!("{} {} {}", r.method, r.uri, r.body))
        .collect();
    assert!(dropped.is_empty(), "{first}'s label: {dropped:#?}");
    c.r1.term();
}

fn report(driver: &str, state: &str) -> pb::NodeReport {
    pb::NodeReport {
        inventory: Some(pb::Inventory {
            driver_version: driver.into(),
            ..Default::default()
        }),
        stages: Some(pb::Stages {
            stages: vec![],
            ready: true,
        }),
        upgrade: Some(pb::UpgradeState {
            state: state.into(),
            driver_version: NEW.into(),
            detail: String::new(),
        }),
        ..Default::default()
    }
}

/// A holder's annotation: its agent's word.
fn facts(state: &str, driver: &str) -> String {
    AgentFacts {
        state: state.into(),
        version: NEW.into(),
        driver: driver.into(),
        ready: true,
        ..Default::default()
    }
    .encode()
}

fn step_of(fleet: &Fleet, node: &str) -> Option<Step> {
    fleet
        .upgrade_view()
        .into_iter()
        .find(|s| s.node == node)
        .and_then(|s| s.step.map(|u| u.step))
}

/// A new leader, sharded, carries on from what the nodes carry: `y`, held
/// by another replica, was in validation under the last leader; `x`, held
/// by this one, wants the driver too and waits for `y` (one at a time
/// across the replicas). Once `y`'s holder says its agent validated the
/// driver, the leader uncordons `y` and writes its step, and only then
/// starts `x`. Of `y` it writes the cordon and its step only, never its
/// labels or conditions (`y`'s holder's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_sharded_leader_carries_on_from_the_nodes_annotations() {
    let api = MockApi::start().await;
    api.add_node("x", kubelet_node());
    api.add_node("y", kubelet_node());
    api.touch_node("y", |n| {
        n["metadata"]["labels"][STATE] = json!("validation-required");
        n["metadata"]["annotations"] = json!({
            UPGRADE_STEP: encode_step(Some(&NodeUpgrade::new(Step::ValidationRequired, NEW, ""))),
            AGENT_UPGRADE: facts("upgrade-required", "550.127.08"),
            INITIAL_UNSCHEDULABLE: "false",
        });
        n["spec"]["unschedulable"] = json!(true);
    });
    let (_leading, leader) = tokio::sync::watch::channel(true);
    let fleet = Fleet::new(TaintPolicy::Never, Duration::from_secs(60))
        .0
        .with_owner(|n| n == "x")
        .with_rollout_leader(leader);
    fleet.set_upgrade_policy(Some(Ok(UpgradePolicy::default())));
    let up = Upgrader::new(api.client());
    assert_eq!(up.recover(&fleet).await.unwrap(), 1);
    assert_eq!(step_of(&fleet, "y"), Some(Step::ValidationRequired));
    let (tx, mut down) = tokio::sync::mpsc::channel(16);
    fleet.connect(
        pb::Hello {
            node_name: "x".into(),
            ..Default::default()
        },
        tx,
    );
    fleet.apply(
        "x",
        pb::agent_message::Body::Snapshot(report("550.127.08", "upgrade-required")),
    );
    api.take();
    let _ = up.step(&fleet).await;
    // y still validating: x waits; its step written for its holder (this
    // replica), nothing about y.
    assert_eq!(step_of(&fleet, "x"), Some(Step::UpgradeRequired));
    assert_eq!(step_of(&fleet, "y"), Some(Step::ValidationRequired));
    let reqs = api.take();
    let about = |reqs: &[common::Recorded], n: &str| -> Vec<String> {
        reqs.iter()
            .filter(|r| r.method == "PATCH" && node_of(r) == Some(n))
            .map(|r| r.body.to_string())
            .collect()
    };
    assert!(about(&reqs, "y").is_empty(), "{:?}", about(&reqs, "y"));
    let x = about(&reqs, "x");
    assert_eq!(x.len(), 1, "{x:?}");
    assert!(x[0].contains("upgrade-required") && !x[0].contains("unschedulable"));
    // y's holder says its agent validated the new driver.
    api.touch_node("y", |n| {
        n["metadata"]["annotations"][AGENT_UPGRADE] = json!(facts("upgrade-done", NEW))
    });
    let y: Node = serde_json::from_value(api.node("y")).unwrap();
    fleet.note_rollout("y", &Observed::of_node(&y));
    for _ in 0..10 {
        let _ = up.step(&fleet).await;
    }
    assert_eq!(step_of(&fleet, "y"), Some(Step::UpgradeDone));
    assert_eq!(step_of(&fleet, "x"), Some(Step::ValidationRequired));
    let reqs = api.take();
    let y_reqs = about(&reqs, "y");
    assert!(
        y_reqs
            .iter()
            .all(|b| !b.contains("labels") && !b.contains("conditions")),
        "{y_reqs:?}"
    );
    let at = |n: &str, f: &dyn Fn(&Value) -> bool| {
        reqs.iter()
            .position(|r| r.method == "PATCH" && node_of(r) == Some(n) && f(&r.body))
    };
    let uncordoned = at("y", &|b| b["spec"]["unschedulable"] == json!(false)).unwrap();
    let done = at("y", &|b| {
        b["metadata"]["annotations"][UPGRADE_STEP]
            .as_str()
            .and_then(|t| decode_step("y", t).ok().flatten())
            .is_some_and(|u| u.step == Step::UpgradeDone)
    })
    .unwrap();
    let cordoned = at("x", &|b| b["spec"]["unschedulable"] == json!(true)).unwrap();
    assert!(uncordoned < cordoned && done < cordoned, "{reqs:#?}");
    assert_eq!(api.node("y")["spec"]["unschedulable"], json!(false));
    // x is this replica's: its agent has the go-ahead.
    let mut go = false;
    while let Ok(Ok(m)) = down.try_recv() {
        if let Some(pb::controller_message::Body::Desired(d)) = m.body {
            go = d.upgrade_go_ahead && d.driver_version == NEW;
        }
    }
    assert!(go);
    // Nothing of y is kept as an entry (its holder serves it).
    assert_eq!(fleet.names(), ["x"]);
}

/// Not sharded (any more), a new leader takes the steps a sharded one left
/// on the nodes off (the label holds the step), so that they cannot
/// mislead a sharded leader later; a node without one costs no request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsharded_leader_takes_the_sharded_steps_off() {
    let api = MockApi::start().await;
    api.add_node("x", kubelet_node());
    api.add_node("y", kubelet_node());
    api.touch_node("x", |n| {
        n["metadata"]["labels"][STATE] = json!("upgrade-done");
        n["metadata"]["annotations"] = json!({
            UPGRADE_STEP: encode_step(Some(&NodeUpgrade::new(Step::UpgradeDone, NEW, ""))),
        });
    });
    api.touch_node("y", |n| {
        n["metadata"]["labels"][STATE] = json!("upgrade-done");
    });
    let fleet = Fleet::new(TaintPolicy::Never, Duration::from_secs(60)).0;
    let up = Upgrader::new(api.client());
    api.take();
    assert_eq!(up.recover(&fleet).await.unwrap(), 2);
    let patches: Vec<(String, Value)> = api
        .take()
        .into_iter()
        .filter(|r| r.method == "PATCH")
        .map(|r| (r.uri.split('?').next().unwrap().to_string(), r.body))
        .collect();
    assert_eq!(
        patches,
        [(
            "/api/v1/nodes/x".to_string(),
            json!({"metadata": {"annotations": {UPGRADE_STEP: null}}})
        )]
    );
    assert_eq!(api.node("x")["metadata"]["annotations"], json!({}));
    assert_eq!(step_of(&fleet, "x"), Some(Step::UpgradeDone));
}

/// A rollout's first look over many nodes of another replica's, with an
/// API server that takes 20 ms a node PATCH: the node on its way (`z`,
/// last by name) has its step written first, and the 64 steps go several
/// at a time (in turn they would take 1.3 s, and `z`'s holder would wait
/// for all of them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_look_writes_the_moving_nodes_step_first_and_many_at_once() {
    let api = MockApi::start().await;
    let mut names: Vec<String> = (0..63).map(|i| format!("n{i:02}")).collect();
    names.push("z".into());
    for n in &names {
        api.add_node(n, kubelet_node());
        api.touch_node(n, |v| {
            v["metadata"]["annotations"] =
                json!({ AGENT_UPGRADE: facts("upgrade-required", "550.127.08") });
        });
    }
    // z was started by the last leader: its cordon is next.
    api.touch_node("z", |v| {
        v["metadata"]["labels"][STATE] = json!("cordon-required");
        v["metadata"]["annotations"][UPGRADE_STEP] = json!(encode_step(Some(&NodeUpgrade::new(
            Step::CordonRequired,
            NEW,
            ""
        ))));
    });
    let (_leading, leader) = tokio::sync::watch::channel(true);
    let fleet = Fleet::new(TaintPolicy::Never, Duration::from_secs(60))
        .0
        .with_owner(|_| false)
        .with_rollout_leader(leader);
    fleet.set_upgrade_policy(Some(Ok(UpgradePolicy::default())));
    for n in &names {
        let node: Node = serde_json::from_value(api.node(n)).unwrap();
        fleet.note_rollout(n, &Observed::of_node(&node));
    }
    let up = Upgrader::new(api.client());
    up.recover(&fleet).await.unwrap();
    api.delay_node_patches(Duration::from_millis(20));
    api.take();
    let started = Instant::now();
    let _ = up.step(&fleet).await;
    let took = started.elapsed();
    let steps: Vec<(String, Step)> = api
        .take()
        .into_iter()
        .filter(|r| r.method == "PATCH")
        .filter_map(|r| {
            let n = node_of(&r)?.to_string();
            let t = r.body["metadata"]["annotations"][UPGRADE_STEP].as_str()?;
            Some((n.clone(), decode_step(&n, t).ok()??.step))
        })
        .collect();
    assert_eq!(steps.len(), names.len(), "{steps:?}");
    let z = steps.iter().position(|(n, _)| n == "z").unwrap();
    assert!(z < 16, "z's step written {z}th: {steps:?}");
    assert!(steps[z].1.in_progress(), "{steps:?}");
    assert!(
        took < Duration::from_millis(640),
        "64 steps took {took:?} (20 ms each)"
    );
}

/// A GPU node of another replica's that is in no rollout (it runs the
/// wanted driver already) but is NotReady counts against maxUnavailable,
/// as it does unsharded; and a percentage is of every GPU node, those of
/// other replicas in no rollout included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_replicas_idle_gpu_nodes_count_against_max_unavailable() {
    let api = MockApi::start().await;
    for n in ["x", "y", "w1", "w2"] {
        api.add_node(n, kubelet_node());
        // GPU nodes: their holders write the controller's conditions.
        api.touch_node(n, |v| {
            v["status"]["conditions"]
                .as_array_mut()
                .unwrap()
                .push(json!({"type": "GPUDriverReady", "status": "True", "reason": "Validated", "message": ""}));
        });
    }
    // y (another replica's, on the new driver already) is NotReady.
    api.touch_node("y", |v| {
        v["status"]["conditions"][0]["status"] = json!("False")
    });
    let look = |max_unavailable| {
        let api = api.clone();
        async move {
            let (_leading, leader) = tokio::sync::watch::channel(true);
            let fleet = Fleet::new(TaintPolicy::Never, Duration::from_secs(60))
                .0
                .with_owner(|n| n == "x")
                .with_rollout_leader(leader);
            fleet.set_upgrade_policy(Some(Ok(UpgradePolicy {
                max_unavailable,
                ..UpgradePolicy::default()
            })));
            for n in ["x", "y", "w1", "w2"] {
                let node: Node = serde_json::from_value(api.node(n)).unwrap();
                fleet.note_rollout(n, &Observed::of_node(&node));
            }
            let (tx, _down) = tokio::sync::mpsc::channel(16);
            fleet.connect(
                pb::Hello {
                    node_name: "x".into(),
                    ..Default::default()
                },
                tx,
            );
            fleet.apply(
                "x",
                pb::agent_message::Body::Snapshot(report("550.127.08", "upgrade-required")),
            );
            let up = Upgrader::new(api.client());
            up.recover(&fleet).await.unwrap();
            let _ = up.step(&fleet).await;
            step_of(&fleet, "x")
        }
    };
    use gpu_controller::model::upgrade_policy::Amount;
    // One node out of service allowed: y is it; x does not start.
    assert_eq!(look(Amount::Count(1)).await, Some(Step::UpgradeRequired));
    // Half of the 4 GPU nodes (not of the 1 or 2 the leader knows of): x
    // starts beside y.
    let half = look(Amount::Percent(50)).await;
    assert!(half.is_some_and(Step::in_progress), "{half:?}");
}
