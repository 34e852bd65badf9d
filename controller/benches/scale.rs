//! Scale benchmark, run by hand:
//! `cargo bench -p gpu-controller --bench scale [-- AGENTS SECONDS]`
//! (default 10,000 agents, 60 s of steady load).
//!
//! One gpu-controller process, pinned to one core (`taskset -c 1`), serves
//! AGENTS simulated agents, each on its own TLS connection with its own
//! token (reviewed by the scripted API server's TokenReview). Each agent
//! sends a snapshot (8 GPUs, GFD's labels, 11 stages), then one changed
//! report every 10 s, whose label `nvidia.com/bench.sent-ms` is its send
//! time: the scripted API server, which counts every request, measures
//! from it to the label apply that carries it. Halfway, every agent sends a
//! burst of 5 health events. Then every agent sends reports that change
//! nothing for 20 s: the API server must see no request. The agents and the
//! API server share the other core.
//!
//! Printed: connect time, report-to-request latency p50/p99/max, API
//! requests, the shortest gap between two patches of one node, the
//! controller's peak RSS, the requests while nothing changed.

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use gpu_agent_proto::report::v1 as pb;
use gpu_agent_proto::report::v1::report_client::ReportClient;
use tokio::sync::watch;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

const PERIOD: Duration = Duration::from_secs(10);
const ACCOUNT: &str = "system:serviceaccount:gpu-agent:gpu-agent";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Changing,
    Same,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A node report the size of an 8x H100 node's.
fn snapshot() -> pb::NodeReport {
    let mut labels: Vec<(String, String)> = [
        ("nvidia.com/gpu.present", "true"),
        ("nvidia.com/gpu.count", "8"),
        ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
        ("nvidia.com/gpu.memory", "81559"),
        ("nvidia.com/gpu.family", "hopper"),
        ("nvidia.com/gpu.compute.major", "9"),
        ("nvidia.com/gpu.compute.minor", "0"),
        ("nvidia.com/gpu.replicas", "1"),
        ("nvidia.com/gpu.sharing-strategy", "none"),
        ("nvidia.com/gpu.mode", "compute"),
        ("nvidia.com/gpu.machine", "DGX-H100"),
        ("nvidia.com/cuda.driver-version.full", "550.127.08"),
        ("nvidia.com/cuda.runtime-version.full", "12.4"),
        ("nvidia.com/mig.capable", "true"),
        ("nvidia.com/mps.capable", "false"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    labels.push(("nvidia.com/bench.sent-ms".into(), "0".into()));
    let stages = [
        "discover", "driver", "mig", "devnodes", "runtime", "cdi", "validate", "plugin", "health",
        "labels", "metrics",
    ]
    .iter()
    .map(|n| pb::Stage {
        name: n.to_string(),
        state: "done".into(),
        detail: format!("{n}: what this stage did on the node, in one line of about this length"),
        validated: Some(true),
        validation_message: format!("{n}: checked"),
        ..Default::default()
    })
    .collect();
    pb::NodeReport {
        inventory: Some(pb::Inventory {
            driver_version: "550.127.08".into(),
            cuda_version: "12.4".into(),
            gpus: (0..8)
                .map(|g| pb::Gpu {
                    index: g,
                    uuid: format!("GPU-{g:08x}-0000-0000-0000-000000000000"),
                    model: "NVIDIA H100 80GB HBM3".into(),
                    pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + g * 0x10),
                    memory_mib: 81559,
                    ..Default::default()
                })
                .collect(),
            simulated: String::new(),
        }),
        stages: Some(pb::Stages {
            stages,
            ready: true,
        }),
        labels: Some(pb::Labels {
            labels: labels.into_iter().collect(),
        }),
        health: Some(pb::Health {
            gpus: (0..8)
                .map(|g| pb::GpuHealth {
                    uuid: format!("GPU-{g:08x}-0000-0000-0000-000000000000"),
                    healthy: true,
                    ..Default::default()
                })
                .collect(),
        }),
        mig: Some(Default::default()),
        upgrade: Some(Default::default()),
        policy: Some(pb::PolicyState {
            source: "file".into(),
            ..Default::default()
        }),
        dra: None,
    }
}

struct Shared {
    endpoint: String,
    ca: Vec<u8>,
    connected: AtomicUsize,
    failed: AtomicUsize,
    reports: AtomicU64,
    mode: watch::Receiver<Mode>,
    burst: watch::Receiver<u32>,
    base: pb::NodeReport,
}

async fn agent(i: usize, s: Arc<Shared>) {
    let fail = |what: String| {
        if s.failed.fetch_add(1, Ordering::Relaxed) < 5 {
            eprintln!("agent {i}: {what}");
        }
    };
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&s.ca))
        .domain_name("localhost");
    let channel = match Endpoint::from_shared(s.endpoint.clone())
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect_timeout(Duration::from_secs(60))
        .connect()
        .await
    {
        Ok(c) => c,
        Err(e) => return fail(format!("connect: {e:?}")),
    };
    let mut client = ReportClient::new(channel);
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::AgentMessage>(16);
    let node = format!("node-{i:05}");
    let mut seq = 0u64;
    let mut next = |body| {
        seq += 1;
        pb::AgentMessage {
            seq,
            body: Some(body),
        }
    };
    let _ = tx
        .send(next(pb::agent_message::Body::Hello(pb::Hello {
            node_name: node.clone(),
            agent_version: "bench".into(),
            ..Default::default()
        })))
        .await;
    let _ = tx
        .send(next(pb::agent_message::Body::Snapshot(s.base.clone())))
        .await;
    let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    req.metadata_mut()
        .insert("authorization", format!("Bearer tok-{i}").parse().unwrap());
    let mut down = match client.attach(req).await {
        Ok(r) => r.into_inner(),
        Err(e) => return fail(format!("attach: {e:?}")),
    };
    s.connected.fetch_add(1, Ordering::Relaxed);
    tokio::spawn(async move { while let Ok(Some(_)) = down.message().await {} });
    let mut mode = s.mode.clone();
    let mut burst = s.burst.clone();
    let phase = Duration::from_millis((i as u64 * 7919) % PERIOD.as_millis() as u64);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + phase, PERIOD);
    let mut labels = s.base.labels.clone().unwrap();
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if *mode.borrow_and_update() == Mode::Changing {
                    labels.labels.insert("nvidia.com/bench.sent-ms".into(), now_ms().to_string());
                }
                let change = pb::NodeReport { labels: Some(labels.clone()), ..Default::default() };
                if tx.send(next(pb::agent_message::Body::Change(change))).await.is_err() {
                    return fail("stream closed".into());
                }
                s.reports.fetch_add(1, Ordering::Relaxed);
            }
            r = burst.changed() => {
                if r.is_err() { return; }
                for n in 0..5 {
                    let ev = pb::HealthEvent {
                        gpu_uuid: "GPU-00000003-0000-0000-0000-000000000000".into(),
                        xid: 94,
                        reason: format!("XID 94, from NVML (#{n})"),
                        advice: "contained ECC error: restart the application".into(),
                        unhealthy: false,
                        at_unix_ms: now_ms(),
                    };
                    if tx.send(next(pb::agent_message::Body::HealthEvent(ev))).await.is_err() {
                        return fail("stream closed".into());
                    }
                }
            }
        }
    }
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn pct(v: &[u64], p: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let nums: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let agents = nums.first().copied().unwrap_or(10_000) as usize;
    let seconds = nums.get(1).copied().unwrap_or(60);
    // The agents and the API server on core 0; the controller on core 1.
    let _ = std::process::Command::new("taskset")
        .args(["-pc", "0", &std::process::id().to_string()])
        .stdout(std::process::Stdio::null())
        .status();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(agents, seconds));
}

async fn run(agents: usize, seconds: u64) {
    println!("gpu-controller scale benchmark: {agents} agents, {seconds} s of load");
    let api = common::MockApi::start().await;
    api.forget_bodies();
    for i in 0..agents {
        let node = format!("node-{i:05}");
        api.add_node(&node, common::kubelet_node());
        api.add_token(&format!("tok-{i}"), ACCOUNT, &node);
    }
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = common::certs(dir.path());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    // GPU_BENCH_WRAP: a command to run the controller under (a profiler).
    let wrap: Vec<String> = std::env::var("GPU_BENCH_WRAP")
        .map(|w| w.split_whitespace().map(String::from).collect())
        .unwrap_or_default();
    let mut controller = std::process::Command::new("taskset")
        .args(["-c", "1"])
        .args(&wrap)
        .arg(env!("CARGO_BIN_EXE_gpu-controller"))
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .arg("--tls-cert")
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key)
        .env("KUBECONFIG", api.kubeconfig(dir.path()))
        .env("RUST_LOG", "warn")
        .stderr(std::fs::File::create(dir.path().join("controller.log")).unwrap())
        .spawn()
        .expect("taskset and gpu-controller");
    let pid = controller.id();
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (mode_tx, mode) = watch::channel(Mode::Changing);
    let (burst_tx, burst) = watch::channel(0u32);
    let shared = Arc::new(Shared {
        endpoint: format!("https://localhost:{port}"),
        ca: std::fs::read(&ca).unwrap(),
        connected: AtomicUsize::new(0),
        failed: AtomicUsize::new(0),
        reports: AtomicU64::new(0),
        mode,
        burst,
        // GPU_BENCH_TINY=1: a near-empty report (the connections' own cost).
        base: if std::env::var_os("GPU_BENCH_TINY").is_some() {
            pb::NodeReport {
                labels: snapshot().labels,
                ..Default::default()
            }
        } else {
            snapshot()
        },
    });
    let peak = Arc::new(AtomicU64::new(0));
    {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                peak.fetch_max(rss_kib(pid), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        });
    }
    let started = Instant::now();
    for i in 0..agents {
        tokio::spawn(agent(i, shared.clone()));
        if i % 250 == 249 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    while shared.connected.load(Ordering::Relaxed) + shared.failed.load(Ordering::Relaxed) < agents
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "agents never connected"
        );
    }
    let connect = started.elapsed();
    println!(
        "connected: {} agents in {:.1} s ({} failed); controller RSS {} MiB",
        shared.connected.load(Ordering::Relaxed),
        connect.as_secs_f64(),
        shared.failed.load(Ordering::Relaxed),
        rss_kib(pid) / 1024
    );
    // The snapshots' writes, then steady load.
    tokio::time::sleep(PERIOD).await;
    api.take_latencies();
    let requests_before = api.count();
    let reports_before = shared.reports.load(Ordering::Relaxed);
    let load = Duration::from_secs(seconds);
    tokio::time::sleep(load / 2).await;
    burst_tx.send_modify(|b| *b += 1);
    tokio::time::sleep(load / 2).await;
    let mut lat = api.take_latencies();
    lat.sort();
    let requests = api.count() - requests_before;
    let reports = shared.reports.load(Ordering::Relaxed) - reports_before;
    println!(
        "steady load: {reports} reports ({:.0}/s) and a burst of {} health events -> {requests} API requests ({:.0}/s)",
        reports as f64 / load.as_secs_f64(),
        5 * agents,
        requests as f64 / load.as_secs_f64()
    );
    println!(
        "report -> API request carrying it: p50 {} ms, p99 {} ms, max {} ms (n={}; target p99 <= 2000 ms: {})",
        pct(&lat, 0.5),
        pct(&lat, 0.99),
        lat.last().copied().unwrap_or(0),
        lat.len(),
        if pct(&lat, 0.99) <= 2000 && !lat.is_empty() {
            "met"
        } else {
            "NOT met"
        }
    );
    // Nothing changes: no request.
    mode_tx.send_replace(Mode::Same);
    tokio::time::sleep(PERIOD + Duration::from_secs(3)).await;
    let quiet_from = api.count();
    let quiet_reports = shared.reports.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(20)).await;
    let quiet = api.count() - quiet_from;
    println!(
        "unchanged reports: {} in 20 s -> {quiet} API requests (target 0: {})",
        shared.reports.load(Ordering::Relaxed) - quiet_reports,
        if quiet == 0 { "met" } else { "NOT met" }
    );
    let gap = api.min_gap().unwrap_or_default();
    println!(
        "shortest time between two patches of one node's object: {} ms (target >= 1000 ms: {})",
        gap.as_millis(),
        if gap >= Duration::from_millis(1000) {
            "met"
        } else {
            "NOT met"
        }
    );
    let peak = peak.load(Ordering::Relaxed);
    println!(
        "controller peak RSS: {} MiB (target <= 256 MiB: {})",
        peak / 1024,
        if peak <= 256 * 1024 { "met" } else { "NOT met" }
    );
    // SIGTERM: a profiler wrapping it writes its report as it exits.
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let _ = controller.wait();
}
