//! Failover between two gpu-controller replicas, with an agent that goes
//! away while the leader changes. Two controller processes elect a leader
//! through the Lease in the scripted API server; the agents reach them
//! through a Service stand-in (a TCP proxy that sends each new connection
//! to the replica whose `/readyz` answers 200, as a Service's endpoints
//! follow readiness; a connection to a replica that dies breaks, as it
//! does through kube-proxy). The new leader has nothing of the old one but
//! what the API holds: it must mark the node whose agent never came back,
//! once the grace has passed since it took over, keep the marks the old
//! leader made, and leave the nodes whose agents came back as they were.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{MockApi, Proc, Recorded, fake_agent, kubelet_node, schema, wait_for};
use gpu_agent_proto::report::v1 as pb;
use serde_json::Value;

const ACCOUNT: &str = "system:serviceaccount:gpu-agent:gpu-agent";
/// The agents' grace in this test (60 s by default).
const GRACE: Duration = Duration::from_secs(5);

/// One replica: its agents' port and its HTTP port (`/readyz`, `/fleet.json`).
struct Replica {
    proc: Proc,
    grpc: u16,
    http: u16,
}

fn replica(api: &MockApi, dir: &Path, name: &str) -> Replica {
    let grpc = common::free_port();
    let http = common::free_port();
    let (grace, listen) = (GRACE.as_secs().to_string(), format!("127.0.0.1:{http}"));
    let proc = common::spawn_replica(
        api,
        dir,
        name,
        grpc,
        false,
        &["--agent-grace-seconds", &grace, "--http-listen", &listen],
    );
    Replica { proc, grpc, http }
}

fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

fn ready(http: u16) -> bool {
    http_get(http, "/readyz").is_some_and(|r| r.starts_with("HTTP/1.1 200"))
}

/// The Service: new connections go to the first ready replica (looked at
/// every 100 ms); none ready, a connection is closed as it comes.
struct Service {
    port: u16,
    stop: Arc<AtomicBool>,
}

impl Service {
    fn start(replicas: Vec<(u16, u16)>) -> Service {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let endpoint: Arc<Mutex<Option<u16>>> = Arc::default();
        {
            let (stop, endpoint) = (stop.clone(), endpoint.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let up = replicas.iter().find(|(_, http)| ready(*http)).map(|r| r.0);
                    *endpoint.lock().unwrap() = up;
                    std::thread::sleep(Duration::from_millis(100));
                }
            });
        }
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(client) = conn else { continue };
                let Some(to) = *endpoint.lock().unwrap() else {
                    continue;
                };
                let Ok(server) = TcpStream::connect(("127.0.0.1", to)) else {
                    continue;
                };
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
        Service { port, stop }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn report() -> pb::NodeReport {
    let stage = |name: &str| pb::Stage {
        name: name.into(),
        state: "done".into(),
        detail: format!("{name} detail"),
        validated: Some(true),
        validation_message: format!("{name} checked"),
        ..Default::default()
    };
    pb::NodeReport {
        stages: Some(pb::Stages {
            stages: ["driver", "devnodes", "runtime", "cdi", "plugin"]
                .into_iter()
                .map(stage)
                .collect(),
            ready: true,
        }),
        labels: Some(pb::Labels {
            labels: [
                ("nvidia.com/gpu.present", "true"),
                ("nvidia.com/gpu.count", "8"),
                ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        }),
        health: Some(pb::Health {
            gpus: (0..8)
                .map(|n| pb::GpuHealth {
                    uuid: format!("GPU-{n}"),
                    healthy: true,
                    ..Default::default()
                })
                .collect(),
        }),
        ..Default::default()
    }
}

/// An agent that reports through the Service and, as gpu-agent does,
/// connects again whenever its stream ends, until aborted.
fn agent(
    rt: &tokio::runtime::Runtime,
    port: u16,
    ca: PathBuf,
    node: &str,
) -> tokio::task::JoinHandle<()> {
    let node = node.to_string();
    rt.spawn(async move {
        loop {
            if let Ok(mut a) = fake_agent(port, &ca, &node, &node, report(), vec![]).await {
                a.ended().await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

fn condition(node: &Value, kind: &str) -> Value {
    node["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == kind)
        .cloned()
        .unwrap_or(Value::Null)
}

fn ours(node: &Value) -> Vec<Value> {
    [
        "GPUDriverReady",
        "GPUContainerRuntimeReady",
        "GPUDevicePluginReady",
        "GPUHealthy",
    ]
    .iter()
    .map(|k| condition(node, k))
    .collect()
}

fn healthy(node: &Value) -> bool {
    condition(node, "GPUHealthy")["reason"] == "AllHealthy"
}

fn not_reporting(node: &Value) -> bool {
    ours(node)
        .iter()
        .all(|c| c["status"] == "Unknown" && c["reason"] == "AgentNotReporting")
}

fn node_writes<'a>(r: &'a [Recorded], node: &str) -> Vec<&'a Recorded> {
    r.iter()
        .filter(|r| r.method == "PATCH" && r.uri.starts_with(&format!("/api/v1/nodes/{node}")))
        .collect()
}

#[test]
fn a_new_leader_marks_the_node_whose_agent_went_during_the_failover() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    for n in 1..=3 {
        let name = format!("gpu-node-{n}");
        api.add_node(&name, kubelet_node());
        api.add_token(&name, ACCOUNT, &name);
    }
    let dir = tempfile::tempdir().unwrap();
    let (ca, _, _) = common::certs(dir.path());
    let mut a = replica(&api, dir.path(), "gpu-controller-a");
    wait_for("a leads", Duration::from_secs(20), &[&a.proc], || {
        ready(a.http)
    });
    let mut b = replica(&api, dir.path(), "gpu-controller-b");
    wait_for("b stands by", Duration::from_secs(20), &[&b.proc], || {
        b.proc.log().contains("standing by")
    });
    let service = Service::start(vec![(a.grpc, a.http), (b.grpc, b.http)]);
    let agents: Vec<_> = (1..=3)
        .map(|n| agent(&rt, service.port, ca.clone(), &format!("gpu-node-{n}")))
        .collect();
    wait_for(
        "three nodes written by a",
        Duration::from_secs(20),
        &[&a.proc],
        || (1..=3).all(|n| healthy(&api.node(&format!("gpu-node-{n}")))),
    );

    // gpu-node-3's agent goes well before: a marks it once its grace ran out.
    agents[2].abort();
    wait_for(
        "gpu-node-3 marked by a",
        GRACE + Duration::from_secs(10),
        &[&a.proc],
        || not_reporting(&api.node("gpu-node-3")),
    );
    let node3 = api.node("gpu-node-3");
    let node1 = api.node("gpu-node-1");
    let node2 = api.node("gpu-node-2");

    // gpu-node-2's agent goes, and a dies inside its grace: nobody marked it.
    agents[1].abort();
    a.proc.child.kill().unwrap();
    a.proc.child.wait().unwrap();
    let killed = Instant::now();
    // From here on only b asks anything of the API.
    let from = api.requests().len();
    assert!(
        healthy(&api.node("gpu-node-2")),
        "a never marked gpu-node-2"
    );

    // b takes the Lease once a's expires (15 s), and gpu-node-1's agent
    // comes back through the Service.
    wait_for("b leads", Duration::from_secs(30), &[&b.proc], || {
        ready(b.http)
    });
    let took_over = Instant::now();
    let lease_after = killed.elapsed();

    // Once the grace has passed since b took over: gpu-node-2 is not
    // reporting; its labels and taints stay as they were.
    while !not_reporting(&api.node("gpu-node-2")) {
        assert!(
            took_over.elapsed() < GRACE + Duration::from_secs(10),
            "gpu-node-2 never marked by b:\n{}",
            b.proc.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let marked_after = took_over.elapsed();
    assert!(
        marked_after >= GRACE - Duration::from_millis(500),
        "marked {marked_after:?} after b took over: before the grace ({GRACE:?})"
    );
    assert!(
        marked_after <= GRACE + Duration::from_secs(2),
        "marked {marked_after:?} after b took over (grace {GRACE:?})"
    );
    let n2 = api.node("gpu-node-2");
    let health = condition(&n2, "GPUHealthy");
    let message = health["message"].as_str().unwrap();
    assert!(
        message.starts_with(
            "gpu-agent on this node is not reporting: no stream to the leading gpu-controller since it took over at "
        ),
        "{message}"
    );
    assert_eq!(n2["metadata"]["labels"], node2["metadata"]["labels"]);
    assert_eq!(n2["spec"]["taints"], node2["spec"]["taints"]);
    assert_ne!(
        health["lastTransitionTime"],
        condition(&node2, "GPUHealthy")["lastTransitionTime"]
    );

    // b's page lists it as not reporting, beside the two others.
    let fleet = http_get(b.http, "/fleet.json").unwrap();
    let fleet: Value = serde_json::from_str(fleet.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    let entry = |name: &str| {
        fleet["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("{name} is not in /fleet.json: {fleet}"))
    };
    assert_eq!(entry("gpu-node-2")["connected"], false);
    assert!(entry("gpu-node-2")["notReporting"].is_string(), "{fleet}");
    assert_eq!(entry("gpu-node-2")["conditions"][3]["status"], "Unknown");
    assert!(entry("gpu-node-3")["notReporting"].is_string(), "{fleet}");
    assert_eq!(entry("gpu-node-1")["connected"], true);
    assert_eq!(fleet["summary"]["nodes"], 3);
    assert_eq!(fleet["summary"]["connected"], 1);

    // gpu-node-1's agent came back: its conditions are as they were (their
    // transition times too); a's marks on gpu-node-3 are kept as they are.
    let n1 = api.node("gpu-node-1");
    assert_eq!(ours(&n1), ours(&node1));
    assert_eq!(ours(&api.node("gpu-node-3")), ours(&node3));
    // b wrote gpu-node-2's conditions once and nothing else of it, the
    // labels of gpu-node-1 (applied once after a start), nothing of
    // gpu-node-3.
    std::thread::sleep(Duration::from_millis(500));
    let r = api.requests().split_off(from);
    let schemas = schema::load();
    for w in r.iter().filter(|r| r.method == "PATCH") {
        let errs = schema::check(&schemas, "io.k8s.api.core.v1.Node", &w.body, true);
        assert!(errs.is_empty(), "{}: {errs:?}\n{}", w.uri, w.body);
    }
    let uris = |node: &str| -> Vec<String> {
        node_writes(&r, node)
            .iter()
            .map(|w| w.uri.clone())
            .collect()
    };
    assert_eq!(
        uris("gpu-node-2"),
        ["/api/v1/nodes/gpu-node-2/status?&force=true&fieldManager=gpu-controller"]
    );
    assert_eq!(
        uris("gpu-node-1"),
        ["/api/v1/nodes/gpu-node-1?&force=true&fieldManager=gpu-controller"]
    );
    assert_eq!(uris("gpu-node-3"), Vec::<String>::new());
    println!(
        "a killed; b led {:.1} s later; gpu-node-2 marked not reporting {} ms after b took over (grace {} s)",
        lease_after.as_secs_f64(),
        marked_after.as_millis(),
        GRACE.as_secs()
    );
    drop(agents);
    drop(service);
    b.proc.term();
}
