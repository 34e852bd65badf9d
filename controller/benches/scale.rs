//! Scale benchmark, run by hand:
//! `cargo bench -p gpu-controller --bench scale [-- AGENTS SECONDS [REPLICAS [INTERVAL]]]`
//! (default 10,000 agents, 60 s of steady load, 1 replica, check-ins every
//! 30 s).
//!
//! The agents are the real report client (`gpu_report::client::run`), one
//! task per node in this process, each with its own token file (reviewed
//! by the scripted API server's TokenReview), its own watch of a node
//! report the size of an 8x H100 node's and its own broadcast of health
//! events. They and the scripted API server share core 0; the controllers
//! (`taskset -c 1`) share core 1. With REPLICAS > 1 the controllers shard
//! the nodes over 8 Leases (`--shards 8`); the agents are given the first
//! replica's address and follow its redirects.
//!
//! Phases, each printed with its targets:
//! - start: every agent checked in once;
//! - steady (SECONDS): check-ins on the interval, and health events in
//!   bursts of 5, each carrying its send time (`sent-ms=`), which the API
//!   server measures to the Event write that carries it: rolling bursts on
//!   1 % of the fleet a second (the latency target's load), then a tenth of
//!   the fleet at once, then the rest at once (`scale/bursts.rs`); API
//!   requests, the controllers' CPU (/proc/PID/stat) and peak RSS;
//! - desired state: a ClusterPolicy is set; the time until every agent has
//!   it;
//! - quiet: nothing changes for two intervals: no API request;
//! - with replicas: which replica wrote each node; then one is killed
//!   (SIGKILL), its nodes' agents send a burst, and the time until every
//!   event of it reached the API, and how many were lost;
//! - the extrapolation to 100,000 agents from the measured per-agent costs.

#[path = "scale/agents.rs"]
mod agents;
#[path = "scale/bursts.rs"]
mod bursts;
#[path = "../tests/common/mod.rs"]
mod common;
#[path = "scale/procs.rs"]
mod procs;

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agents::Agent;
use bursts::Bursts;
use procs::Controller;
use serde_json::json;

/// The Lease time of a shard (a dead replica's shards are taken over
/// after it).
const LEASE: Duration = Duration::from_secs(10);
const MIB: u64 = 1024;

struct Args {
    agents: usize,
    seconds: u64,
    replicas: usize,
    interval: u64,
}

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "NOT met" }
}

fn main() {
    let nums: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let args = Args {
        agents: nums.first().copied().unwrap_or(10_000) as usize,
        seconds: nums.get(1).copied().unwrap_or(60),
        replicas: nums.get(2).copied().unwrap_or(1).max(1) as usize,
        interval: nums.get(3).copied().unwrap_or(30).max(1),
    };
    // The agents and the API server on core 0; the controllers on core 1.
    let _ = std::process::Command::new("taskset")
        .args(["-pc", "0", &std::process::id().to_string()])
        .stdout(std::process::Stdio::null())
        .status();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(args));
}

/// API requests other than Leases' (replicas renew theirs all the time).
fn requests(api: &common::MockApi) -> u64 {
    api.count() - api.lease_requests()
}

/// Waits until the API server saw no request but Leases' for 2 s (at most
/// `limit`).
async fn settle(api: &common::MockApi, limit: Duration) {
    let t = Instant::now();
    loop {
        let before = requests(api);
        tokio::time::sleep(Duration::from_secs(2)).await;
        if requests(api) == before || t.elapsed() > limit {
            return;
        }
    }
}

/// The latencies of the events `sent` that reached the API (marks taken
/// from the API server are added to `got`, the first of each kept).
fn gather(api: &common::MockApi, sent: &HashSet<String>, got: &mut Vec<(String, u64)>) {
    gather_all(api, &[sent], std::slice::from_mut(got));
}

/// [`gather`] for several sets of events at once (the API server's marks
/// are taken once).
fn gather_all(api: &common::MockApi, sent: &[&HashSet<String>], got: &mut [Vec<(String, u64)>]) {
    let mut seen: Vec<HashSet<String>> = got
        .iter()
        .map(|g| g.iter().map(|(w, _)| w.clone()).collect())
        .collect();
    for (word, ms) in api.take_marks() {
        for k in 0..sent.len() {
            if sent[k].contains(&word) && seen[k].insert(word.clone()) {
                got[k].push((word.clone(), ms));
            }
        }
    }
}

/// p50/p99/max over all `sent` events, those not arrived counted as
/// slower than any; with a target, whether it is met, else whether it
/// came within 2 s.
fn latency_line(sent: usize, got: &[(String, u64)], target_ms: Option<u64>) -> String {
    let mut v: Vec<u64> = got.iter().map(|(_, ms)| *ms).collect();
    v.sort();
    let at = |p: f64| -> Option<u64> {
        if sent == 0 {
            return None;
        }
        let k = ((sent - 1) as f64 * p).round() as usize;
        v.get(k).copied()
    };
    let show = |x: Option<u64>| x.map_or("(not arrived)".to_string(), |ms| format!("{ms} ms"));
    let max = if v.len() == sent {
        show(v.last().copied())
    } else {
        "(not arrived)".into()
    };
    let within = |ms: u64| sent > 0 && at(0.99).is_some_and(|p| p <= ms);
    let judged = match target_ms {
        Some(ms) => format!("target p99 <= {ms} ms: {}", verdict(within(ms))),
        None => format!(
            "beyond the target's load; p99 within 2 s: {}",
            if within(2000) { "yes" } else { "no" }
        ),
    };
    format!(
        "p50 {}, p99 {}, max {max} (arrived {}/{sent}; {judged})",
        show(at(0.5)),
        show(at(0.99)),
        v.len(),
    )
}

fn answers(fleet: &[Agent]) -> u64 {
    fleet.iter().map(Agent::answers).sum()
}

/// Says which agents' last check-in failed, if any.
fn say_failing(fleet: &[Agent]) {
    let f = agents::failing(fleet);
    if !f.is_empty() {
        println!("  {f}");
    }
}

async fn run(a: Args) {
    let n = a.agents;
    println!(
        "gpu-controller scale benchmark: {n} agents (the real report client), {} replica(s), {} s of steady load, check-in interval {} s",
        a.replicas, a.seconds, a.interval
    );
    if !procs::takes("--check-in-interval") {
        println!(
            "note: this gpu-controller has no --check-in-interval (held streams): run as it is"
        );
    }
    let api = common::MockApi::start().await;
    api.forget_bodies();
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::create_dir(&tokens).unwrap();
    for i in 0..n {
        let node = agents::node_name(i);
        api.add_node(&node, common::kubelet_node());
        api.add_token(&format!("tok-{i}"), agents::ACCOUNT, &node);
        agents::token_file(&tokens, i);
    }
    let (ca, cert, key) = common::certs(dir.path());
    let kubeconfig = api.kubeconfig(dir.path());
    let setup = procs::Setup {
        dir: dir.path(),
        kubeconfig: &kubeconfig,
        cert: &cert,
        key: &key,
        interval: a.interval,
        replicas: a.replicas,
    };
    let mut ctrls: Vec<Controller> = (1..=a.replicas)
        .map(|r| Controller::start(&setup, r))
        .collect();
    for c in &mut ctrls {
        c.ready().await;
    }
    settle(&api, Duration::from_secs(60)).await;
    let base: Vec<u64> = ctrls.iter().map(Controller::rss_kib).collect();
    let names = |f: &dyn Fn(usize, &Controller) -> String| {
        ctrls
            .iter()
            .enumerate()
            .map(|(k, c)| format!("{} {}", c.name, f(k, c)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "before the agents ({n} nodes listed): controller RSS {}",
        names(&|k, _| format!("{} MiB", base[k] / MIB))
    );

    // Start: every agent checks in once.
    let report = Arc::new(agents::snapshot());
    let t = Instant::now();
    let mut fleet = agents::start_all(0..n, &ctrls[0].endpoint(), &ca, &tokens, &report).await;
    let (ok, took) =
        agents::wait_all(&mut fleet, t, Duration::from_secs(600), |a| a.answered()).await;
    println!(
        "start: {ok}/{n} agents checked in once, the last {:.1} s after the first started; controller RSS {}",
        took.as_secs_f64(),
        names(&|_, c| format!(
            "{} MiB (peak {} MiB, at most {} files open at once)",
            c.rss_kib() / MIB,
            c.take_peak() / MIB,
            c.take_peak_fds()
        ))
    );
    say_failing(&fleet);
    settle(&api, Duration::from_secs(120)).await;

    // Steady: check-ins on the interval, with bursts of health events:
    // rolling, then two at once (see `Bursts`).
    for c in &ctrls {
        c.take_peak();
        c.take_peak_fds();
    }
    let cpu0: Vec<f64> = ctrls.iter().map(Controller::cpu_seconds).collect();
    let (req0, ans0) = (requests(&api), answers(&fleet));
    api.take_marks();
    api.take_latencies();
    let load = Duration::from_secs(a.seconds);
    let t = Instant::now();
    let plan = Bursts::plan(n, load);
    let (groups, trace) = plan.run(&fleet, &ctrls, t, load).await;
    let wall = t.elapsed().as_secs_f64();
    let cpu: Vec<f64> = ctrls
        .iter()
        .zip(&cpu0)
        .map(|(c, c0)| (c.cpu_seconds() - c0) / wall)
        .collect();
    let peak: Vec<u64> = ctrls.iter().map(Controller::take_peak).collect();
    let fds: Vec<u64> = ctrls.iter().map(Controller::take_peak_fds).collect();
    let req = requests(&api) - req0;
    let ans = answers(&fleet) - ans0;
    let events: usize = groups.iter().map(|g| g.sent.len()).sum();
    println!(
        "steady ({} s): {ans} check-ins answered ({:.0}/s); {events} health events in bursts of {} -> {req} API requests ({:.0}/s)",
        a.seconds,
        ans as f64 / wall,
        agents::BURST,
        req as f64 / wall
    );
    let mut got: Vec<Vec<(String, u64)>> = vec![Vec::new(); groups.len()];
    let limit = Duration::from_secs(2 * a.interval + 60);
    loop {
        let sets: Vec<&HashSet<String>> = groups.iter().map(|g| &g.sent).collect();
        gather_all(&api, &sets, &mut got);
        let all = groups
            .iter()
            .zip(&got)
            .all(|(g, got)| got.len() == g.sent.len());
        if all || t.elapsed() > load + limit {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for (k, (g, got)) in groups.iter().zip(&got).enumerate() {
        println!("  {}:", g.what);
        println!(
            "    health event -> API request carrying it: {}",
            latency_line(g.sent.len(), got, (k == 0).then_some(2000))
        );
        let mut taken: Vec<u64> = g
            .taken
            .iter()
            .flatten()
            .map(|d| d.as_millis() as u64)
            .collect();
        taken.sort();
        println!(
            "    health event -> its agent's check-in answered (the controller took it): p50 {} ms, p99 {} ms, max {} ms ({}/{} agents)",
            taken.get(taken.len() / 2).copied().unwrap_or(0),
            taken.get(taken.len() * 99 / 100).copied().unwrap_or(0),
            taken.last().copied().unwrap_or(0),
            taken.len(),
            g.taken.len()
        );
    }
    let last = groups.len() - 1;
    let slowest = got[last].iter().map(|(_, ms)| *ms).max().unwrap_or(0);
    if let Some((w, me, ctl)) = trace.busy(slowest as f64 / 1000.0) {
        println!(
            "  from the last burst to its last Event write ({w:.1} s): core 0 (the agents and the API server) {:.0}% busy, the controllers {:.0}% of core 1",
            me * 100.0,
            ctl * 100.0
        );
    }
    drop(trace);
    for (k, c) in ctrls.iter().enumerate() {
        println!(
            "  {}: CPU {:.3} core average (target <= 0.5: {}); peak RSS {} MiB (target <= 256 MiB: {}), {} MiB at the end; at most {} files open at once (its connections)",
            c.name,
            cpu[k],
            verdict(cpu[k] <= 0.5),
            peak[k] / MIB,
            verdict(peak[k] <= 256 * MIB),
            c.rss_kib() / MIB,
            fds[k]
        );
    }

    say_failing(&fleet);

    // Desired state: a ClusterPolicy reaches every agent.
    settle(&api, Duration::from_secs(60)).await;
    for a in &mut fleet {
        a.got_policy();
    }
    api.set_cluster_policy(
        "cluster-policy",
        json!({
            "driver": {"enabled": false, "upgradePolicy": {"autoUpgrade": true, "maxParallelUpgrades": 1}},
            "toolkit": {"enabled": false},
            "dcgmExporter": {"enabled": false},
        }),
    );
    let t = Instant::now();
    let (ok, took) = agents::wait_all(
        &mut fleet,
        t,
        Duration::from_secs(3 * a.interval + 30),
        Agent::got_policy,
    )
    .await;
    println!(
        "desired state: a ClusterPolicy set -> {ok}/{n} agents had it, the last after {:.1} s (target <= 2x the interval, {} s: {})",
        took.as_secs_f64(),
        2 * a.interval,
        verdict(ok == n && took <= Duration::from_secs(2 * a.interval))
    );

    // Quiet: nothing changes for two intervals.
    settle(&api, Duration::from_secs(60)).await;
    let (req0, ans0, leases0) = (requests(&api), answers(&fleet), api.lease_requests());
    let t = Instant::now();
    tokio::time::sleep(Duration::from_secs(2 * a.interval)).await;
    let wall = t.elapsed().as_secs_f64();
    let req = requests(&api) - req0;
    println!(
        "quiet ({} s, nothing changed): {req} API requests (target 0: {}){}; {:.0} check-ins answered per second (the agents' count)",
        2 * a.interval,
        verdict(req == 0),
        if a.replicas > 1 {
            format!(
                ", besides {} Lease requests",
                api.lease_requests() - leases0
            )
        } else {
            String::new()
        },
        (answers(&fleet) - ans0) as f64 / wall
    );
    println!(
        "  controller RSS at the end: {}",
        ctrls
            .iter()
            .map(|c| format!("{} {} MiB", c.name, c.rss_kib() / MIB))
            .collect::<Vec<_>>()
            .join(", ")
    );

    if a.replicas > 1 {
        failover(&api, &mut ctrls, &fleet, &a).await;
    }

    // The extrapolation, from the first replica's figures.
    let per = (n / a.replicas).max(1) as f64;
    let kib = peak[0].saturating_sub(base[0]) as f64 / per;
    let cpu_per = cpu[0] / per;
    let by_mem = ((256 * MIB).saturating_sub(base[0]) as f64 / kib.max(1e-9)) as u64;
    let by_cpu = (0.5 / cpu_per.max(1e-12)) as u64;
    let carry = by_mem.min(by_cpu).max(1);
    println!(
        "extrapolation: per agent {kib:.1} KiB RSS (above {} MiB with the nodes listed) and {:.1} us CPU per second; at the targets one replica carries {carry} agents (by memory {by_mem}, by CPU {by_cpu}): 100,000 agents need {} replicas",
        base[0] / MIB,
        cpu_per * 1e6,
        100_000u64.div_ceil(carry)
    );
    for c in &mut ctrls {
        c.stop();
        let tail = c.log_tail(5);
        if !tail.is_empty() {
            println!("{}'s log ends:\n{tail}", c.name);
        }
    }
}

/// Two replicas or more: each node written by one replica only; then the
/// last replica is killed and its nodes' agents send a burst of events.
async fn failover(api: &common::MockApi, ctrls: &mut [Controller], fleet: &[Agent], a: &Args) {
    let writers = api.node_writers();
    let bearers: BTreeSet<String> = ctrls
        .iter()
        .map(|c| format!("Bearer {}", c.bearer))
        .collect();
    let of = |node: &str| -> BTreeSet<String> {
        writers
            .get(node)
            .map(|w| w.intersection(&bearers).cloned().collect())
            .unwrap_or_default()
    };
    let (mut one, mut several, mut none) = (0, 0, 0);
    for ag in fleet {
        match of(&ag.node).len() {
            0 => none += 1,
            1 => one += 1,
            _ => several += 1,
        }
    }
    let per: Vec<String> = ctrls
        .iter()
        .map(|c| {
            let b = format!("Bearer {}", c.bearer);
            let k = fleet
                .iter()
                .filter(|ag| of(&ag.node) == BTreeSet::from([b.clone()]))
                .count();
            format!("{} {k}", c.name)
        })
        .collect();
    println!(
        "nodes written: by one replica only {one}, by several {several} (target 0: {}), by none {none}; per replica: {}",
        verdict(several == 0),
        per.join(", ")
    );
    let victim = ctrls.len() - 1;
    let vb = BTreeSet::from([format!("Bearer {}", ctrls[victim].bearer)]);
    let its: Vec<&Agent> = fleet.iter().filter(|ag| of(&ag.node) == vb).collect();
    api.take_marks();
    ctrls[victim].kill();
    let t = Instant::now();
    let sent: HashSet<String> = its.iter().flat_map(|ag| ag.burst("failover")).collect();
    let limit = LEASE + Duration::from_secs(2 * a.interval + 60);
    let mut got = Vec::new();
    let mut last = Duration::ZERO;
    while got.len() < sent.len() && t.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let before = got.len();
        gather(api, &sent, &mut got);
        if got.len() > before {
            last = t.elapsed();
        }
    }
    let target = LEASE + Duration::from_secs(a.interval);
    let lost = sent.len() - got.len();
    println!(
        "failover: {} killed (SIGKILL) with {} nodes; a burst of {} health events on them: all reached the API {} (target <= the Lease time + one check-in, {} s: {}); lost {lost} (target 0: {})",
        ctrls[victim].name,
        its.len(),
        sent.len(),
        if lost == 0 {
            format!("after {:.1} s", last.as_secs_f64())
        } else {
            format!(
                "NOT within {} s (the last came after {:.1} s)",
                limit.as_secs(),
                last.as_secs_f64()
            )
        },
        target.as_secs(),
        verdict(lost == 0 && last <= target),
        verdict(lost == 0)
    );
    println!(
        "  after the failover: {}",
        ctrls[..victim]
            .iter()
            .map(|c| format!("{} RSS {} MiB", c.name, c.rss_kib() / MIB))
            .collect::<Vec<_>>()
            .join(", ")
    );
    say_failing(fleet);
}
