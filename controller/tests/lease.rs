//! Leader election through a coordination.k8s.io/v1 Lease against the
//! scripted API server: one leader of two replicas, the stand-by takes
//! over once the leader stops renewing, a stopping leader gives the Lease
//! up (holder cleared, as client-go's release does) and the stand-by takes
//! it at its next look, a leader that cannot reach the API server steps
//! down by its renew deadline and says so; every write guarded by the
//! resourceVersion, every Lease checked against the real schema.
//!
//! The failover tests run two gpu-controller processes with the
//! production timing (Lease 10 s, renew deadline 7 s, retry 1 s) behind a
//! Service stand-in, with a real gpu-agent reporting through it, and
//! measure what the docs quote: SIGTERM to exit, a release's handover, a
//! crash's takeover, an agent's time without a stream. They print the
//! figures (`cargo test -p gpu-controller --test lease -- --nocapture`).

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{MockApi, Proc, schema, wait_for};
use gpu_controller::lease::{self, Election, Outcome, Standing};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use serde_json::Value;
use tokio::sync::{oneshot, watch};

const ACCOUNT: &str = "system:serviceaccount:gpu-agent:gpu-agent";
const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/gpu-agent/leases";

fn election(identity: &str) -> Election {
    Election {
        duration: Duration::from_secs(2),
        renew_deadline: Duration::from_millis(1400),
        retry: Duration::from_millis(200),
        ..Election::new("gpu-agent", identity)
    }
}

/// `lease::run` in a task: its leader flag, its standing, and what stops it.
struct Running {
    leader: watch::Receiver<bool>,
    standing: watch::Receiver<Standing>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

fn running(api: &MockApi, e: Election) -> Running {
    let (leader_tx, leader) = watch::channel(false);
    let (standing_tx, standing) = watch::channel(Standing::Starting);
    let (stop, stopped) = oneshot::channel();
    // As the controller makes it: no retries inside the client.
    let client = lease::client(kube::Config::new(api.url().parse().unwrap())).unwrap();
    let task = tokio::spawn(lease::run(client, e, leader_tx, standing_tx, stopped));
    Running {
        leader,
        standing,
        stop: Some(stop),
        task,
    }
}

fn check_lease_writes(reqs: &[common::Recorded]) {
    let schemas = schema::load();
    for r in reqs {
        assert!(r.uri.starts_with(LEASES), "{}", r.uri);
        if r.method != "GET" {
            let errs = schema::check(&schemas, "io.k8s.api.coordination.v1.Lease", &r.body, false);
            assert!(errs.is_empty(), "{errs:?}: {}", r.body);
        }
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
    check_lease_writes(&api.take());

    // Both running: a renews, b waits.
    let mut a = running(&api, election("a"));
    let mut b = running(&api, election("b"));
    a.leader.wait_for(|l| *l).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        *a.leader.borrow() && !*b.leader.borrow(),
        "a renews within the lease time: b stands by"
    );
    assert_eq!(*b.standing.borrow(), Standing::Follower("a".into()));
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

    // a crashes (no renewals, no release): b leads within the lease time
    // and one look.
    a.task.abort();
    let stopped = tokio::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(5), b.leader.wait_for(|l| *l))
        .await
        .expect("b took over")
        .unwrap();
    let took = stopped.elapsed();
    assert!(
        took <= Duration::from_millis(2500),
        "took over after {took:?}"
    );
    let l = leases.get("gpu-controller").await.unwrap();
    let spec = l.spec.unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("b"));
    assert_eq!(spec.lease_transitions, Some(1));
    assert_eq!(spec.lease_duration_seconds, Some(2));
    b.task.abort();
}

/// A stopping leader steps down first, then gives the Lease up as
/// client-go's release does: the object stays, its holder empty,
/// `leaseDurationSeconds` 1, at the resourceVersion read. A stand-by takes
/// an empty Lease at its next look, without waiting out the duration.
#[tokio::test]
async fn a_stopping_leader_gives_the_lease_up_and_the_stand_by_takes_it_at_its_next_look() {
    let api = MockApi::start().await;
    let long = |id: &str| Election {
        // Long enough that only a release lets b in within the test.
        duration: Duration::from_secs(60),
        renew_deadline: Duration::from_secs(40),
        retry: Duration::from_millis(500),
        ..Election::new("gpu-agent", id)
    };
    let mut a = running(&api, long("a"));
    a.leader.wait_for(|l| *l).await.unwrap();
    let mut b = running(&api, long("b"));
    b.standing
        .wait_for(|s| matches!(s, Standing::Follower(_)))
        .await
        .unwrap();
    api.take();

    let stopping = tokio::time::Instant::now();
    a.stop.take().unwrap().send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(2), &mut a.task)
        .await
        .expect("a stops at once")
        .unwrap();
    assert!(!*a.leader.borrow(), "a stepped down");
    assert_eq!(*a.standing.borrow(), Standing::Stopping);
    tokio::time::timeout(Duration::from_secs(2), b.leader.wait_for(|l| *l))
        .await
        .expect("b took the given-up Lease at its next look")
        .unwrap();
    let took = stopping.elapsed();
    assert!(took <= Duration::from_millis(1500), "{took:?}");

    let reqs = api.take();
    check_lease_writes(&reqs);
    let puts: Vec<&Value> = reqs
        .iter()
        .filter(|r| r.method == "PUT")
        .map(|r| &r.body)
        .collect();
    let given = puts
        .iter()
        .position(|p| p["spec"]["holderIdentity"] == "")
        .expect("a wrote the Lease with its holder cleared");
    let release = puts[given];
    assert_eq!(release["spec"]["leaseDurationSeconds"], 1);
    assert_eq!(release["spec"]["leaseTransitions"], 0);
    assert!(release["metadata"]["resourceVersion"].is_string());
    assert!(release["spec"]["renewTime"].is_string());
    let taken = puts[given + 1..]
        .iter()
        .find(|p| p["spec"]["holderIdentity"] == "b")
        .expect("b took it");
    assert_eq!(taken["spec"]["leaseTransitions"], 1);
    assert_eq!(taken["spec"]["leaseDurationSeconds"], 60);

    // A stand-by that stops gives nothing up (it holds nothing).
    b.stop.take().unwrap().send(()).unwrap();
    b.task.await.unwrap();
    let l: Api<Lease> = Api::namespaced(api.client(), "gpu-agent");
    let spec = l.get("gpu-controller").await.unwrap().spec.unwrap();
    assert_eq!(
        spec.holder_identity.as_deref(),
        Some(""),
        "b gave it up too"
    );
    let mut c = running(&api, long("c"));
    c.leader.wait_for(|l| *l).await.unwrap();
    c.task.abort();
}

/// The API server answers nothing but 503: the leader keeps leading until
/// its renew deadline (counted from its last renewal), then steps down
/// before a stand-by could take over, and says why; once the API server is
/// back it leads again.
#[tokio::test]
async fn a_leader_that_cannot_renew_steps_down_by_its_deadline_and_says_why() {
    let api = MockApi::start().await;
    let e = election("a");
    let mut a = running(&api, e.clone());
    a.leader.wait_for(|l| *l).await.unwrap();
    api.set_unavailable(true);
    let down = tokio::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(3), a.leader.wait_for(|l| !*l))
        .await
        .expect("a stepped down")
        .unwrap();
    let after = down.elapsed();
    assert!(
        after <= e.renew_deadline + Duration::from_millis(300) && after < e.duration,
        "stepped down after {after:?}"
    );
    let words = a.standing.borrow().words("gpu-agent/gpu-controller");
    assert!(
        words.starts_with("not leading: the Lease gpu-agent/gpu-controller cannot be read or renewed (no replica can lead while the API server cannot be reached): not renewed for 1.4 s: "),
        "{words}"
    );
    assert!(
        words.ends_with(": the API server answered 503 ServiceUnavailable: the server is currently unable to handle the request"),
        "{words}"
    );
    assert!(!words.contains("another replica"), "{words}");
    api.set_unavailable(false);
    tokio::time::timeout(Duration::from_secs(2), a.leader.wait_for(|l| *l))
        .await
        .expect("a leads again")
        .unwrap();
    a.task.abort();
}

// ---- two gpu-controller processes behind a Service ----

/// One replica: its agents' port and its HTTP port (`/readyz`).
struct Replica {
    proc: Proc,
    grpc: u16,
    http: u16,
}

impl Replica {
    fn start(api: &MockApi, dir: &Path, name: &str) -> Replica {
        let grpc = common::free_port();
        let http = common::free_port();
        let listen = format!("127.0.0.1:{http}");
        let proc = common::spawn_replica(api, dir, name, grpc, false, &["--http-listen", &listen]);
        Replica { proc, grpc, http }
    }

    /// `GET /readyz`: the status line's code and the body.
    fn readyz(&self) -> Option<(u16, String)> {
        let mut s = TcpStream::connect(("127.0.0.1", self.http)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        write!(
            s,
            "GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        let code = out.get(9..12)?.parse().ok()?;
        let body = out.split_once("\r\n\r\n")?.1.to_string();
        Some((code, body))
    }

    fn leads(&self) -> bool {
        self.readyz().is_some_and(|(code, _)| code == 200)
    }

    fn sigterm(&self) {
        let ok = Command::new("kill")
            .args(["-TERM", &self.proc.child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    }
}

/// The Service in front of the replicas, as the chart makes it: its
/// readiness probe is `/healthz`, so every running replica is an endpoint
/// (a stand-by turns an agent away with UNAVAILABLE and the agent connects
/// again); a replica whose deletion began is taken out ([`Service::remove`],
/// as the EndpointSlice controller does while the kubelet sends SIGTERM).
/// Each new connection goes to the next endpoint in turn (kube-proxy picks
/// at random; in turn keeps the test repeatable), the first in the list
/// first; one that does not listen is passed over. A connection to a
/// replica that dies breaks, as through kube-proxy.
struct Service {
    port: u16,
    endpoints: Arc<Mutex<Vec<u16>>>,
}

impl Service {
    fn start(endpoints: &[u16]) -> Service {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let endpoints = Arc::new(Mutex::new(endpoints.to_vec()));
        let next = Arc::new(AtomicUsize::new(0));
        let eps = endpoints.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(client) = conn else { continue };
                let list = eps.lock().unwrap().clone();
                let first = next.fetch_add(1, Ordering::Relaxed);
                let server = (0..list.len())
                    .map(|k| list[(first + k) % list.len()])
                    .find_map(|to| TcpStream::connect(("127.0.0.1", to)).ok());
                let Some(server) = server else { continue };
                for (mut from, mut into) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut into);
                        let _ = into.shutdown(std::net::Shutdown::Both);
                        let _ = from.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Service { port, endpoints }
    }

    fn remove(&self, port: u16) {
        self.endpoints.lock().unwrap().retain(|p| *p != port);
    }

    fn add(&self, port: u16) {
        self.endpoints.lock().unwrap().push(port);
    }
}

/// gpu-agent on a simulated 8x H100 node (driver and toolkit off, as on
/// EKS), reporting through the Service.
fn agent(dir: &Path, service: &Service) -> Proc {
    let host = dir.join("host");
    common::h100_host(&host);
    let policy = common::eks_policy();
    let global = [
        "--simulate".as_ref(),
        "h100-sxm-8".as_ref(),
        "--policy".as_ref(),
        policy.as_os_str(),
    ];
    common::reporting_agent(
        dir,
        &host,
        &global,
        &[],
        service.port,
        &dir.join("ca.crt"),
        "agent-token",
        "gpu-node-1",
    )
}

/// How many times an agent began reporting to a replica (a stream, or a
/// check-in after none).
fn connects(r: &Replica) -> usize {
    let log = r.proc.log();
    log.matches("agent connected").count() + log.matches("agent checking in").count()
}

/// Two replicas (a leading, b standing by) behind a Service, and an agent
/// reporting to a through it.
fn fleet_of_two(api: &MockApi, dir: &Path) -> (Replica, Replica, Service, Proc) {
    api.add_node("gpu-node-1", common::kubelet_node());
    api.add_token("agent-token", ACCOUNT, "gpu-node-1");
    common::certs(dir);
    let a = Replica::start(api, dir, "gpu-controller-a");
    wait_for("a to lead", Duration::from_secs(20), &[&a.proc], || {
        a.leads()
    });
    let b = Replica::start(api, dir, "gpu-controller-b");
    wait_for("b to stand by", Duration::from_secs(20), &[&b.proc], || {
        b.proc.log().contains("standing by")
    });
    let service = Service::start(&[a.grpc, b.grpc]);
    let agent = agent(dir, &service);
    wait_for(
        "the agent's stream to a and its labels",
        Duration::from_secs(60),
        &[&a.proc, &b.proc, &agent],
        || {
            connects(&a) > 0
                && api.node("gpu-node-1")["metadata"]["labels"]["nvidia.com/gpu.count"] == "8"
        },
    );
    (a, b, service, agent)
}

/// A rolling update replaces the leader: SIGTERM. It steps down, closes
/// its agents' streams, gives the Lease up and exits within the docs' 5 s;
/// the stand-by leads at its next look (about a second: one retry period
/// of 1 s at most, and a request), and the agent is back, on the new
/// leader, within a few seconds (its own backoff: 0.5-1 s, then 1-2 s).
/// Three times over, a new stand-by started behind the Service each time,
/// for more than one figure.
#[test]
fn a_rolling_update_hands_the_lease_over_in_about_a_second() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    let dir = tempfile::tempdir().unwrap();
    let (a, b, service, agent) = fleet_of_two(&api, dir.path());
    let (mut leader, mut standby) = (a, b);
    let mut figures = Vec::new();
    for (round, next) in ["c", "d", "e"].into_iter().enumerate() {
        api.take();
        let before = connects(&standby);
        // The Deployment deletes the leader's pod: its endpoint goes, the
        // kubelet sends SIGTERM.
        service.remove(leader.grpc);
        let sent = Instant::now();
        leader.sigterm();
        let (mut exited, mut led, mut back) = (None, None, None);
        while sent.elapsed() < Duration::from_secs(30)
            && (exited.is_none() || led.is_none() || back.is_none())
        {
            if exited.is_none() && leader.proc.child.try_wait().unwrap().is_some() {
                exited = Some(sent.elapsed());
            }
            if led.is_none() && standby.leads() {
                led = Some(sent.elapsed());
            }
            if back.is_none() && connects(&standby) > before {
                back = Some(sent.elapsed());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let logs = || {
            format!(
                "old leader:\n{}\nstand-by:\n{}\nagent:\n{}",
                leader.proc.log(),
                standby.proc.log(),
                agent.log()
            )
        };
        eprintln!(
            "measured (rolling update {}): SIGTERM to exit {exited:?}; to the stand-by leading {led:?}; the agent without a stream {back:?}",
            round + 1
        );
        let exited = exited.unwrap_or_else(|| panic!("the leader never exited\n{}", logs()));
        let led = led.unwrap_or_else(|| panic!("the stand-by never led\n{}", logs()));
        let back = back.unwrap_or_else(|| panic!("the agent never came back\n{}", logs()));
        assert!(
            exited <= Duration::from_secs(5),
            "SIGTERM took {exited:?}\n{}",
            logs()
        );
        assert!(
            led <= Duration::from_millis(1500),
            "the stand-by led after {led:?}\n{}",
            logs()
        );
        // The agent's backoff only starts afresh after a stream that lived
        // a minute: its first loss is the figure.
        if round == 0 {
            assert!(
                back <= Duration::from_secs(6),
                "the agent was without a stream for {back:?}\n{}",
                logs()
            );
        }
        assert!(leader.proc.log().contains("Lease given up"), "{}", logs());
        // The old leader gave the Lease up (holder cleared,
        // leaseDurationSeconds 1), then the stand-by took it: one
        // transition more.
        let reqs: Vec<_> = api
            .take()
            .into_iter()
            .filter(|r| r.uri.starts_with(LEASES))
            .collect();
        check_lease_writes(&reqs);
        let puts: Vec<&Value> = reqs
            .iter()
            .filter(|r| r.method == "PUT")
            .map(|r| &r.body)
            .collect();
        let given = puts
            .iter()
            .position(|p| p["spec"]["holderIdentity"] == "")
            .unwrap_or_else(|| panic!("no release among {puts:#?}"));
        assert_eq!(puts[given]["spec"]["leaseDurationSeconds"], 1);
        let taken = puts[given + 1..]
            .iter()
            .find(|p| p["spec"]["holderIdentity"] != "")
            .expect("the stand-by took it");
        assert_eq!(
            taken["spec"]["leaseTransitions"].as_i64(),
            puts[given]["spec"]["leaseTransitions"]
                .as_i64()
                .map(|t| t + 1)
        );
        assert_eq!(taken["spec"]["leaseDurationSeconds"], 10);
        figures.push((exited, led, back));
        // The Deployment's new pod comes up, stands by, and is an
        // endpoint of the Service.
        let new = Replica::start(&api, dir.path(), &format!("gpu-controller-{next}"));
        wait_for(
            "the new pod to stand by",
            Duration::from_secs(20),
            &[&new.proc],
            || new.proc.log().contains("standing by"),
        );
        service.add(new.grpc);
        leader = standby;
        standby = new;
    }
    // The agent checks in through the Service: it never reached a replica
    // that was not leading, or it was told why.
    let log = agent.log();
    assert!(
        !log.contains("refused the check-in")
            || log.contains("this gpu-controller replica does not lead"),
        "{log}"
    );
    let most =
        |f: fn(&(Duration, Duration, Duration)) -> Duration| figures.iter().map(f).max().unwrap();
    eprintln!(
        "measured (3 rolling updates): SIGTERM to exit at most {:?}, the stand-by leading at most {:?} (mean {:?})",
        most(|f| f.0),
        most(|f| f.1),
        figures.iter().map(|f| f.1).sum::<Duration>() / 3
    );
}

/// The leader is killed (no release) just after it renewed the Lease:
/// the worst case. The stand-by leads within the docs' 15 s (the Lease's
/// 10 s, then at most one retry period of 1 s), and the agent comes back
/// to it (after its own backoff).
#[test]
fn after_a_crash_the_stand_by_leads_within_15_s() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    let dir = tempfile::tempdir().unwrap();
    let (mut a, b, service, agent) = fleet_of_two(&api, dir.path());
    // Killed right after a renewal.
    api.take();
    let renewed = |r: &common::Recorded| {
        r.method == "PUT" && r.body["spec"]["holderIdentity"] == "gpu-controller-a"
    };
    wait_for("a renewal", Duration::from_secs(10), &[&a.proc], || {
        api.take().iter().any(renewed)
    });
    a.proc.child.kill().unwrap();
    let killed = Instant::now();
    service.remove(a.grpc);
    let (mut led, mut back) = (None, None);
    while killed.elapsed() < Duration::from_secs(60) && (led.is_none() || back.is_none()) {
        if led.is_none() && b.leads() {
            led = Some(killed.elapsed());
        }
        if back.is_none() && connects(&b) > 0 {
            back = Some(killed.elapsed());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!(
        "measured (crash just after a renewal): to the stand-by leading {led:?}; the agent without a stream {back:?}"
    );
    let logs = || format!("b:\n{}\nagent:\n{}", b.proc.log(), agent.log());
    let led = led.unwrap_or_else(|| panic!("b never led\n{}", logs()));
    assert!(
        led >= Duration::from_secs(9),
        "b took a Lease that had not expired after {led:?}"
    );
    assert!(
        led <= Duration::from_secs(15),
        "b led {led:?} after the crash\n{}",
        logs()
    );
    assert!(back.is_some(), "the agent never reached b\n{}", logs());
}

/// The only replica leads; then the API server answers nothing but 503.
/// By its renew deadline it stops leading, and `/readyz` and the agents it
/// turns away say why: the Lease cannot be renewed, not that another
/// replica holds it (none does). When the API server is back, it leads
/// again.
#[test]
fn while_the_api_server_is_down_readyz_says_so_not_that_another_replica_leads() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    api.add_node("gpu-node-1", common::kubelet_node());
    let dir = tempfile::tempdir().unwrap();
    let (ca, _, _) = common::certs(dir.path());
    let a = Replica::start(&api, dir.path(), "gpu-controller-a");
    wait_for("a to lead", Duration::from_secs(20), &[&a.proc], || {
        a.leads()
    });
    api.set_unavailable(true);
    let down = Instant::now();
    wait_for(
        "a to stop leading",
        Duration::from_secs(15),
        &[&a.proc],
        || !a.leads(),
    );
    let after = down.elapsed();
    assert!(
        after <= Duration::from_secs(9),
        "stepped down {after:?} into the outage"
    );
    let (code, body) = a.readyz().unwrap();
    assert_eq!(code, 503);
    assert_eq!(
        body,
        "not leading: the Lease gpu-agent/gpu-controller cannot be read or renewed (no replica can lead while the API server cannot be reached): the API server answered 503 ServiceUnavailable: the server is currently unable to handle the request\n",
    );
    assert!(
        a.proc
            .log()
            .contains("not renewed for 7 s: the API server answered 503 ServiceUnavailable"),
        "{}",
        a.proc.log()
    );
    assert!(!body.contains("another replica"), "{body}");
    let refused = rt
        .block_on(common::fake_agent(
            a.grpc,
            &ca,
            "t1",
            "gpu-node-1",
            Default::default(),
            vec![],
        ))
        .err()
        .expect("a replica that does not lead turns agents away");
    assert_eq!(refused.code(), tonic::Code::Unavailable);
    assert!(
        refused.message().starts_with(
            "this gpu-controller replica does not lead: not leading: the Lease gpu-agent/gpu-controller cannot be read or renewed"
        ),
        "{}",
        refused.message()
    );
    api.set_unavailable(false);
    wait_for(
        "a to lead again",
        Duration::from_secs(10),
        &[&a.proc],
        || a.leads(),
    );
}

/// Without an election (one replica), SIGTERM too closes every agent's
/// stream at once, saying why, and the controller exits within the docs'
/// 5 s.
#[test]
fn without_an_election_sigterm_closes_the_streams_in_words_and_exits_within_5_s() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    let dir = tempfile::tempdir().unwrap();
    let mut agents = Vec::new();
    for n in 1..=3 {
        let node = format!("gpu-node-{n}");
        api.add_node(&node, common::kubelet_node());
        api.add_token(&node, ACCOUNT, &node);
    }
    let (controller, port, ca) = common::start_controller(&api, dir.path(), None);
    for n in 1..=3 {
        let node = format!("gpu-node-{n}");
        agents.push(
            rt.block_on(common::fake_agent(
                port,
                &ca,
                &node,
                &node,
                Default::default(),
                vec![],
            ))
            .unwrap(),
        );
    }
    wait_for(
        "three agents",
        Duration::from_secs(10),
        &[&controller],
        || controller.log().matches("agent connected").count() == 3,
    );
    let sent = Instant::now();
    Command::new("kill")
        .args(["-TERM", &controller.child.id().to_string()])
        .status()
        .unwrap();
    for a in &mut agents {
        let status = rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(5), a.end_status()).await })
            .expect("the stream ends at once")
            .expect("with a status");
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert_eq!(
            status.message(),
            "this gpu-controller replica does not lead: stopping: connect again"
        );
    }
    let mut controller = controller;
    let exited = loop {
        if controller.child.try_wait().unwrap().is_some() {
            break sent.elapsed();
        }
        assert!(
            sent.elapsed() < Duration::from_secs(10),
            "{}",
            controller.log()
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    eprintln!("measured (no election, 3 agents): SIGTERM to exit {exited:?}");
    assert!(
        exited <= Duration::from_secs(5),
        "{exited:?}\n{}",
        controller.log()
    );
}

/// A replica that does not hold the Lease is not ready and turns agents
/// away in words; it writes nothing.
#[test]
fn a_stand_by_replica_is_not_ready_and_turns_agents_away() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    api.add_node("gpu-node-1", common::kubelet_node());
    api.add_token("t1", ACCOUNT, "gpu-node-1");
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
    wait_for(
        "a look at the Lease",
        Duration::from_secs(10),
        &[&controller],
        || controller.log().contains("standing by"),
    );
    let ready = get("/readyz");
    assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
    assert!(
        ready.contains(
            "standing by: another replica holds the Lease gpu-agent/gpu-controller (gpu-controller-other)"
        ),
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
        "this gpu-controller replica does not lead: standing by: another replica holds the Lease gpu-agent/gpu-controller (gpu-controller-other): connect again"
    );
    assert!(
        api.requests()
            .iter()
            .all(|r| r.method == "GET" || !r.uri.starts_with("/api/v1/nodes")),
        "a stand-by writes no node (it may watch their labels)"
    );
    controller.term();
}
