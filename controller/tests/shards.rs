//! The fleet's nodes sharded over the controller's replicas through
//! coordination.k8s.io/v1 Leases, against the scripted API server:
//! `shards::run` tasks in this process with short timings (Leases of 2 s,
//! renew deadline 1.4 s, a look every 200 ms), their maps watched.
//!
//! Proven: a node's shard is the same in every process (SHA-256) and the
//! shards are even; two replicas split 8 shards 4/4 and each knows the
//! other's address; a stopping one gives its shards up and the other takes
//! them at its next look; a killed one's shards are taken once its Leases
//! expired, never before; a third one gets its share (3/3/2); a replica
//! that cannot reach the API server drops its shards by its renew
//! deadline, says so once, and takes them again once it can; Leases of
//! replicas long gone are deleted; what a replica says of its shards
//! rides their renewals, the other reads it, and a replica that takes a
//! shard takes the last holder's off. At no instant do two replicas hold the
//! same shard (every change of every map is checked). Every Lease written
//! is checked against the Kubernetes 1.36 schema.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{MockApi, Recorded, schema};
use gpu_controller::shards::{self, ShardConfig, ShardMap, shard_of};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use serde_json::json;
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

const NS: &str = "gpu-agent";
const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/gpu-agent/leases";
const RETRY: Duration = Duration::from_millis(200);
const DURATION: Duration = Duration::from_secs(2);
const DEADLINE: Duration = Duration::from_millis(1400);

fn address(id: &str) -> String {
    format!("https://{id}.test:8443")
}

fn config(id: &str) -> ShardConfig {
    ShardConfig {
        duration: DURATION,
        renew_deadline: DEADLINE,
        retry: RETRY,
        ..ShardConfig::new(NS, id, &address(id), 8)
    }
}

/// `shards::run` in a task: its map, and what stops it.
struct Running {
    id: String,
    map: watch::Receiver<ShardMap>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    fn mine(&self) -> BTreeSet<u32> {
        self.map.borrow().mine.clone()
    }
}

fn running(api: &MockApi, cfg: ShardConfig) -> Running {
    let (tx, map) = watch::channel(ShardMap::default());
    let (stop, stopped) = oneshot::channel();
    // As the controller makes it: no retries inside the client.
    let client =
        gpu_controller::lease::client(kube::Config::new(api.url().parse().unwrap())).unwrap();
    let id = cfg.identity.clone();
    let task = tokio::spawn(shards::run(client, cfg, tx, stopped));
    Running {
        id,
        map,
        stop: Some(stop),
        task,
    }
}

/// Waits until `f` holds of the replicas' maps; returns how long it took.
async fn settle(
    what: &str,
    within: Duration,
    rs: &[&Running],
    f: impl Fn(&[ShardMap]) -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        let maps: Vec<ShardMap> = rs.iter().map(|r| r.map.borrow().clone()).collect();
        if f(&maps) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "not {what} within {within:?}: {maps:#?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The shards each holds, in order: `[4, 4]`.
fn sizes(maps: &[ShardMap]) -> Vec<usize> {
    let mut s: Vec<usize> = maps.iter().map(|m| m.mine.len()).collect();
    s.sort_unstable();
    s
}

/// Every shard held by exactly one of them.
fn split(maps: &[ShardMap]) -> bool {
    let all: usize = maps.iter().map(|m| m.mine.len()).sum();
    let union: BTreeSet<u32> = maps.iter().flat_map(|m| m.mine.iter().copied()).collect();
    all == 8 && union == (0..8).collect()
}

/// Every change of every replica's map, checked: no shard in two
/// replicas' `mine` at once. The tests run on one thread (tokio's test
/// runtime), so each check sees every map as it is at that instant.
struct NoOverlap {
    task: tokio::task::JoinHandle<()>,
    found: Arc<Mutex<Vec<String>>>,
    checks: Arc<Mutex<usize>>,
}

impl NoOverlap {
    fn watch(rs: &[&Running]) -> NoOverlap {
        let mut rxs: Vec<(String, watch::Receiver<ShardMap>)> =
            rs.iter().map(|r| (r.id.clone(), r.map.clone())).collect();
        let found = Arc::new(Mutex::new(Vec::new()));
        let checks = Arc::new(Mutex::new(0));
        let (f, c) = (found.clone(), checks.clone());
        let task = tokio::spawn(async move {
            while !rxs.is_empty() {
                let (done, i, _) = futures::future::select_all(
                    rxs.iter_mut().map(|(_, rx)| Box::pin(rx.changed())),
                )
                .await;
                if done.is_err() {
                    // Its task ended (stopped or killed): no longer acting.
                    rxs.remove(i);
                }
                *c.lock().unwrap() += 1;
                for (a, (ida, ra)) in rxs.iter().enumerate() {
                    for (idb, rb) in &rxs[a + 1..] {
                        let both: Vec<u32> = ra
                            .borrow()
                            .mine
                            .intersection(&rb.borrow().mine)
                            .copied()
                            .collect();
                        if !both.is_empty() {
                            f.lock()
                                .unwrap()
                                .push(format!("{both:?} held by {ida} and {idb}"));
                        }
                    }
                }
            }
        });
        NoOverlap {
            task,
            found,
            checks,
        }
    }

    fn check(self) {
        self.task.abort();
        let found = self.found.lock().unwrap();
        assert!(found.is_empty(), "shards held twice: {found:?}");
        assert!(*self.checks.lock().unwrap() > 0, "no change watched");
    }
}

/// The log lines written on this thread (the test's runtime: every task
/// of it) while the guard lives.
fn capture() -> (tracing::subscriber::DefaultGuard, Arc<Mutex<Vec<u8>>>) {
    #[derive(Clone)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Arc::new(Mutex::new(Vec::new()));
    let b = Buf(buf.clone());
    let sub = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || b.clone())
        .finish();
    (tracing::subscriber::set_default(sub), buf)
}

fn text(buf: &Arc<Mutex<Vec<u8>>>) -> String {
    String::from_utf8_lossy(&buf.lock().unwrap()).into_owned()
}

/// Every Lease request is in the namespace; every Lease written passes
/// the 1.36 schema, carries the label and, while held, the address.
fn check_lease_requests(reqs: &[Recorded]) {
    let schemas = schema::load();
    for r in reqs {
        assert!(r.uri.starts_with(LEASES), "{} {}", r.method, r.uri);
        match r.method.as_str() {
            "GET" => assert!(
                r.uri.ends_with(
                    "/leases?&labelSelector=gpu-agent.io%2Fshards%3Dgpu-controller-shard"
                ) || r.uri.ends_with(
                    "/leases?labelSelector=gpu-agent.io%2Fshards%3Dgpu-controller-shard"
                ),
                "one list call finds them all: {}",
                r.uri
            ),
            "POST" | "PUT" => {
                let errs =
                    schema::check(&schemas, "io.k8s.api.coordination.v1.Lease", &r.body, false);
                assert!(errs.is_empty(), "{errs:?}: {}", r.body);
                assert_eq!(
                    r.body["metadata"]["labels"]["gpu-agent.io/shards"], "gpu-controller-shard",
                    "{}",
                    r.body
                );
                let holder = r.body["spec"]["holderIdentity"].as_str().unwrap();
                if holder.is_empty() {
                    assert_eq!(r.body["spec"]["leaseDurationSeconds"], 1, "{}", r.body);
                    assert!(r.body["metadata"]["annotations"]["gpu-agent.io/address"].is_null());
                } else {
                    assert_eq!(r.body["spec"]["leaseDurationSeconds"], 2, "{}", r.body);
                    assert_eq!(
                        r.body["metadata"]["annotations"]["gpu-agent.io/address"],
                        address(holder).as_str()
                    );
                }
                if r.method == "PUT" {
                    assert!(
                        r.body["metadata"]["resourceVersion"].is_string(),
                        "every replace is guarded by the version read: {}",
                        r.body
                    );
                }
            }
            "DELETE" => {
                let errs = schema::check(
                    &schemas,
                    "io.k8s.apimachinery.pkg.apis.meta.v1.DeleteOptions",
                    &r.body,
                    false,
                );
                assert!(errs.is_empty(), "{errs:?}: {}", r.body);
                assert!(
                    r.body["preconditions"]["resourceVersion"].is_string(),
                    "{}",
                    r.body
                );
            }
            m => panic!("{m} {}", r.uri),
        }
    }
}

#[test]
fn a_nodes_shard_is_stable_and_the_shards_are_even() {
    // SHA-256("gpu-node-1") begins 4e 7f 7f 2d: 0x4e7f7f2d % 8 = 5.
    assert_eq!(shard_of("gpu-node-1", 8), 5);
    assert_eq!(shard_of("gpu-node-1", 3), 2);
    assert_eq!(shard_of("ip-10-0-12-34.ec2.internal", 8), 6);
    assert_eq!(shard_of("gpu-node-1", 1), 0);
    let mut per = [0u32; 8];
    for n in 0..10_000 {
        per[shard_of(&format!("gpu-node-{n}"), 8) as usize] += 1;
    }
    let even = 10_000.0 / 8.0;
    for (k, n) in per.iter().enumerate() {
        let off = (*n as f64 - even).abs() / even;
        assert!(off <= 0.15, "shard {k}: {n} of 10,000 ({per:?})");
    }
    let map = ShardMap {
        count: 8,
        mine: [5].into(),
        holders: [(
            6,
            shards::Holder {
                identity: "b".into(),
                address: address("b"),
            },
        )]
        .into(),
        replicas: 2,
        summaries: Default::default(),
    };
    assert!(map.owns("gpu-node-1"));
    assert!(!map.owns("ip-10-0-12-34.ec2.internal"));
    assert_eq!(
        map.holder_of("ip-10-0-12-34.ec2.internal").unwrap().address,
        address("b")
    );
    assert_eq!(map.holder_of("gpu-node-1"), None);
}

#[tokio::test]
async fn two_replicas_split_the_shards_and_know_each_others_address() {
    let (_log, log) = capture();
    let api = MockApi::start().await;
    let a = running(&api, config("a"));
    let b = running(&api, config("b"));
    let watched = NoOverlap::watch(&[&a, &b]);
    let took = settle("4 and 4", Duration::from_secs(3), &[&a, &b], |m| {
        sizes(m) == [4, 4] && split(m) && m.iter().all(|m| m.replicas == 2)
    })
    .await;
    eprintln!("measured: two replicas split 8 shards in {took:?}");
    // Settled: more looks change nothing, and each is one list and a
    // renewal of each Lease held (its member's and 4 shards'), nothing else.
    check_lease_requests(&api.take());
    tokio::time::sleep(RETRY * 5).await;
    let reqs = api.take();
    check_lease_requests(&reqs);
    let lists = reqs.iter().filter(|r| r.method == "GET").count();
    let puts = reqs.iter().filter(|r| r.method == "PUT").count();
    eprintln!(
        "measured: settled, {} requests in 5 looks of 2 replicas ({lists} lists, {puts} renewals)",
        reqs.len()
    );
    assert_eq!(reqs.len(), lists + puts);
    assert!((8..=12).contains(&lists), "{lists}");
    assert!(
        puts.abs_diff(5 * lists) <= 10,
        "{lists} lists, {puts} renewals"
    );
    for r in [&a, &b] {
        let m = r.map.borrow().clone();
        assert_eq!(m.mine.len(), 4, "{m:?}");
        assert_eq!(m.count, 8);
        // Every shard's holder, with its address, as each sees it.
        assert_eq!(m.holders.len(), 8, "{m:?}");
        for (k, h) in &m.holders {
            let owner = if a.mine().contains(k) { "a" } else { "b" };
            assert_eq!(h.identity, owner);
            assert_eq!(h.address, address(owner));
        }
        assert!(m.words().starts_with("holds shards "), "{}", m.words());
        assert!(m.words().ends_with(" of 8 (2 replicas)"), "{}", m.words());
    }
    // Each node is owned by one of them, and the other knows where.
    for n in 0..100 {
        let node = format!("gpu-node-{n}");
        let (ma, mb) = (a.map.borrow().clone(), b.map.borrow().clone());
        assert!(ma.owns(&node) != mb.owns(&node), "{node}");
        let owner = if ma.owns(&node) { "a" } else { "b" };
        assert_eq!(mb.holder_of(&node).unwrap().address, address(owner));
    }
    watched.check();
    // The Leases as they are: 8 shards, 2 members, each held.
    let leases: Api<Lease> = Api::namespaced(api.client(), NS);
    let all = leases.list(&Default::default()).await.unwrap().items;
    let names: BTreeSet<String> = all
        .iter()
        .map(|l| l.metadata.name.clone().unwrap())
        .collect();
    let mut want: BTreeSet<String> = (0..8)
        .map(|k| format!("gpu-controller-shard-{k}"))
        .collect();
    want.insert("gpu-controller-shard-member-a".into());
    want.insert("gpu-controller-shard-member-b".into());
    assert_eq!(names, want);
    // Conflicts (both took the same free shard at first) are not WARN.
    let log = text(&log);
    assert!(!log.contains("WARN"), "{log}");
    assert!(log.contains("shards taken"), "{log}");
    a.task.abort();
    b.task.abort();
}

#[tokio::test]
async fn a_stopping_replica_gives_its_shards_up_and_the_other_takes_them_at_its_next_look() {
    let (_log, log) = capture();
    let api = MockApi::start().await;
    let mut a = running(&api, config("a"));
    let b = running(&api, config("b"));
    let watched = NoOverlap::watch(&[&a, &b]);
    settle("4 and 4", Duration::from_secs(3), &[&a, &b], |m| {
        sizes(m) == [4, 4] && split(m)
    })
    .await;
    let given: BTreeSet<u32> = a.mine();
    api.take();

    let stopping = Instant::now();
    a.stop.take().unwrap().send(()).unwrap();
    tokio::time::timeout(shards::STOP_WITHIN, &mut a.task)
        .await
        .expect("a stops within 2 s")
        .unwrap();
    let stopped = stopping.elapsed();
    assert!(a.map.borrow().mine.is_empty(), "{:?}", a.map.borrow());
    let took = settle("b holding all 8", Duration::from_secs(2), &[&b], |m| {
        m[0].mine.len() == 8 && m[0].replicas == 1
    })
    .await;
    let took = stopped + took;
    eprintln!("measured: a stopped in {stopped:?}; b held all 8 {took:?} after the stop");
    assert!(took <= RETRY * 2 + Duration::from_millis(300), "{took:?}");
    watched.check();

    // a gave each of its shards and its member Lease up (holder cleared,
    // leaseDurationSeconds 1), at the version it read.
    let reqs = api.take();
    check_lease_requests(&reqs);
    let released: BTreeSet<String> = reqs
        .iter()
        .filter(|r| r.method == "PUT" && r.body["spec"]["holderIdentity"] == "")
        .map(|r| r.body["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    let mut want: BTreeSet<String> = given
        .iter()
        .map(|k| format!("gpu-controller-shard-{k}"))
        .collect();
    want.insert("gpu-controller-shard-member-a".into());
    assert_eq!(released, want);
    let log = text(&log);
    assert!(
        log.contains("shards given up") && log.contains("why=\"stopping\""),
        "{log}"
    );
    assert!(!log.contains("WARN"), "{log}");
    b.task.abort();
}

#[tokio::test]
async fn a_killed_replicas_shards_are_taken_once_its_leases_expired_never_before() {
    let api = MockApi::start().await;
    let a = running(&api, config("a"));
    let mut b = running(&api, config("b"));
    let watched = NoOverlap::watch(&[&a, &b]);
    settle("4 and 4", Duration::from_secs(3), &[&a, &b], |m| {
        sizes(m) == [4, 4] && split(m)
    })
    .await;
    let dead = a.mine();
    // Killed: nothing given up.
    a.task.abort();
    let killed = Instant::now();
    tokio::time::sleep(Duration::from_millis(50)).await;
    // When each of its Leases expires: its last renewal and 2 s.
    let leases: Api<Lease> = Api::namespaced(api.client(), NS);
    let mut expires = BTreeMap::new();
    for k in &dead {
        let spec = leases
            .get(&format!("gpu-controller-shard-{k}"))
            .await
            .unwrap()
            .spec
            .unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some("a"));
        let renewed = spec.renew_time.unwrap().0;
        expires.insert(*k, renewed + jiff::SignedDuration::from_secs(2));
    }
    // When each entered b's map.
    let mut taken = BTreeMap::new();
    while taken.len() < dead.len() {
        tokio::time::timeout(Duration::from_secs(4), b.map.changed())
            .await
            .unwrap_or_else(|_| panic!("b did not take {dead:?}: {:?}", b.map.borrow()))
            .unwrap();
        let now = jiff::Timestamp::now();
        for k in b.map.borrow().mine.intersection(&dead) {
            taken.entry(*k).or_insert(now);
        }
    }
    let took = killed.elapsed();
    eprintln!("measured: b held a's shards {took:?} after a was killed (Leases of 2 s)");
    for (k, at) in &taken {
        assert!(
            *at >= expires[k],
            "b took shard {k} at {at}, before a's Lease expired at {}",
            expires[k]
        );
    }
    assert!(
        took <= DURATION + RETRY * 2 + Duration::from_millis(300),
        "{took:?}"
    );
    assert_eq!(b.mine().len(), 8);
    settle("b alone", Duration::from_secs(1), &[&b], |m| {
        m[0].replicas == 1
    })
    .await;
    watched.check();
    b.task.abort();
}

#[tokio::test]
async fn a_third_replica_joins_and_gets_its_share() {
    let api = MockApi::start().await;
    let a = running(&api, config("a"));
    let b = running(&api, config("b"));
    settle("4 and 4", Duration::from_secs(3), &[&a, &b], |m| {
        sizes(m) == [4, 4] && split(m)
    })
    .await;
    let c = running(&api, config("c"));
    let watched = NoOverlap::watch(&[&a, &b, &c]);
    let took = settle("3, 3 and 2", Duration::from_secs(3), &[&a, &b, &c], |m| {
        sizes(m) == [2, 3, 3] && split(m) && m.iter().all(|m| m.replicas == 3)
    })
    .await;
    eprintln!("measured: a third replica had its share in {took:?}");
    // Settled, and every one knows every holder.
    tokio::time::sleep(RETRY * 4).await;
    let maps: Vec<ShardMap> = [&a, &b, &c]
        .iter()
        .map(|r| r.map.borrow().clone())
        .collect();
    assert_eq!(sizes(&maps), [2, 3, 3]);
    assert!(split(&maps));
    for m in &maps {
        for k in 0..8 {
            let owner = [&a, &b, &c]
                .into_iter()
                .find(|r| r.mine().contains(&k))
                .unwrap();
            assert_eq!(m.holders[&k].identity, owner.id);
            assert_eq!(m.holders[&k].address, address(&owner.id));
        }
    }
    watched.check();
    check_lease_requests(&api.take());
    for r in [a, b, c] {
        r.task.abort();
    }
}

#[tokio::test]
async fn a_replica_that_cannot_reach_the_api_server_drops_its_shards_by_the_renew_deadline() {
    let (_log, log) = capture();
    let api = MockApi::start().await;
    let a = running(&api, config("a"));
    settle("a holding all 8", Duration::from_secs(3), &[&a], |m| {
        m[0].mine.len() == 8 && m[0].replicas == 1
    })
    .await;
    api.set_unavailable(true);
    let down = Instant::now();
    settle(
        "a dropping its shards",
        Duration::from_secs(3),
        &[&a],
        |m| m[0].mine.is_empty(),
    )
    .await;
    let after = down.elapsed();
    eprintln!("measured: shards dropped {after:?} into the outage (renew deadline 1.4 s)");
    // Counted from the last renewal that succeeded, sent within a look
    // before the outage; before the Leases expire (2 s).
    assert!(
        after >= DEADLINE - RETRY - Duration::from_millis(100),
        "{after:?}"
    );
    assert!(
        after <= DEADLINE + Duration::from_millis(300) && after < DURATION,
        "{after:?}"
    );
    // Said once, not at every look.
    tokio::time::sleep(RETRY * 3).await;
    let said = text(&log);
    assert_eq!(
        said.matches("cannot read or renew the shards' Leases")
            .count(),
        1,
        "{said}"
    );
    assert!(
        said.contains("the API server answered 503 ServiceUnavailable"),
        "{said}"
    );
    assert_eq!(
        said.matches("shards dropped: their Leases not renewed within the renew deadline")
            .count(),
        1,
        "{said}"
    );
    // Back: a holds its shards again.
    api.set_unavailable(false);
    settle(
        "a holding all 8 again",
        Duration::from_secs(2),
        &[&a],
        |m| m[0].mine.len() == 8,
    )
    .await;
    let said = text(&log);
    assert!(
        said.contains("the shards' Leases can be read and renewed again"),
        "{said}"
    );
    a.task.abort();
}

/// Member Leases of replicas long gone, and shard Leases past the count
/// that nobody holds, are deleted at the version read; a member expired
/// only lately is kept (and not counted), one held is kept.
#[tokio::test]
async fn leases_of_replicas_long_gone_are_deleted() {
    let api = MockApi::start().await;
    let lease = |name: &str, holder: &str, renewed: jiff::Timestamp| {
        json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": NS,
                         "labels": {"gpu-agent.io/shards": "gpu-controller-shard"}},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 2,
                     "renewTime": renewed.to_string(), "acquireTime": renewed.to_string(),
                     "leaseTransitions": 0}
        })
    };
    let now = jiff::Timestamp::now();
    let long_ago = now - jiff::SignedDuration::from_secs(60);
    let lately = now - jiff::SignedDuration::from_secs(5);
    api.add_lease(
        NS,
        "gpu-controller-shard-member-old",
        lease("gpu-controller-shard-member-old", "old", long_ago),
    );
    api.add_lease(
        NS,
        "gpu-controller-shard-member-late",
        lease("gpu-controller-shard-member-late", "late", lately),
    );
    api.add_lease(
        NS,
        "gpu-controller-shard-9",
        lease("gpu-controller-shard-9", "", long_ago),
    );
    // Another sharding's (another prefix): not ours to touch.
    let mut other = lease("other-member-x", "x", long_ago);
    other["metadata"]["labels"]["gpu-agent.io/shards"] = json!("other");
    api.add_lease(NS, "other-member-x", other);
    let a = running(&api, config("a"));
    settle("a holding all 8", Duration::from_secs(3), &[&a], |m| {
        m[0].mine.len() == 8 && m[0].replicas == 1
    })
    .await;
    tokio::time::sleep(RETRY * 2).await;
    let reqs = api.take();
    check_lease_requests(&reqs);
    let deleted: BTreeSet<&str> = reqs
        .iter()
        .filter(|r| r.method == "DELETE")
        .map(|r| r.uri.split('?').next().unwrap().rsplit('/').next().unwrap())
        .collect();
    assert_eq!(
        deleted,
        ["gpu-controller-shard-9", "gpu-controller-shard-member-old"].into()
    );
    let leases: Api<Lease> = Api::namespaced(api.client(), NS);
    for gone in &deleted {
        assert!(leases.get_opt(gone).await.unwrap().is_none(), "{gone}");
    }
    for kept in ["gpu-controller-shard-member-late", "other-member-x"] {
        assert!(leases.get_opt(kept).await.unwrap().is_some(), "{kept}");
    }
    a.task.abort();
}

/// What a replica says of each shard it holds (the ClusterPolicy's
/// summary) rides on the shard's renewals (`gpu-agent.io/policy-summary`),
/// never on its member Lease, and the other replica reads it in its map;
/// a change reaches the other at its next look, with no request more than
/// the renewals. A replica that takes a shard without a summary of its
/// own takes the last holder's off (here: of a killed one, which gave
/// nothing up).
#[tokio::test]
async fn what_a_replica_says_of_its_shards_rides_their_leases() {
    let api = MockApi::start().await;
    let says = |tag: &str| -> BTreeMap<u32, String> {
        (0..8).map(|k| (k, format!("{tag}-{k}"))).collect()
    };
    let (said, said_rx) = watch::channel(says("v1"));
    let a = running(
        &api,
        ShardConfig {
            summaries: Some(said_rx),
            ..config("a")
        },
    );
    let b = running(&api, config("b"));
    settle("4 and 4", Duration::from_secs(3), &[&a, &b], |m| {
        sizes(m) == [4, 4] && split(m)
    })
    .await;
    let of_a = |tag: &str| -> BTreeMap<u32, String> {
        a.mine()
            .iter()
            .map(|k| (*k, format!("{tag}-{k}")))
            .collect()
    };
    let want = of_a("v1");
    settle("b to read a's", Duration::from_secs(2), &[&b], |m| {
        m[0].summaries == want
    })
    .await;
    assert!(a.map.borrow().summaries.is_empty(), "b says nothing");
    api.take();
    said.send_replace(says("v2"));
    let want = of_a("v2");
    settle("b to read a's change", Duration::from_secs(2), &[&b], |m| {
        m[0].summaries == want
    })
    .await;
    let reqs = api.take();
    check_lease_requests(&reqs);
    assert!(reqs.iter().all(|r| r.method == "GET" || r.method == "PUT"));
    for r in reqs.iter().filter(|r| r.method == "PUT") {
        let name = r.body["metadata"]["name"].as_str().unwrap();
        let note = &r.body["metadata"]["annotations"][shards::SUMMARY];
        match name
            .strip_prefix("gpu-controller-shard-")
            .unwrap()
            .parse::<u32>()
        {
            Ok(k) if r.body["spec"]["holderIdentity"] == "a" => {
                assert!(
                    note.as_str().unwrap().ends_with(&format!("-{k}")),
                    "{}",
                    r.body
                )
            }
            _ => assert!(note.is_null(), "{}", r.body),
        }
    }
    // a is killed: b, which says nothing, takes its shards once their
    // Leases expired, and they carry no summary any more.
    a.task.abort();
    settle("b holding all 8", Duration::from_secs(6), &[&b], |m| {
        m[0].mine.len() == 8 && m[0].summaries.is_empty()
    })
    .await;
    check_lease_requests(&api.take());
    let leases: Api<Lease> = Api::namespaced(api.client(), NS);
    for l in leases.list(&Default::default()).await.unwrap().items {
        let notes = l.metadata.annotations.unwrap_or_default();
        assert!(!notes.contains_key(shards::SUMMARY), "{notes:?}");
    }
    b.task.abort();
}
