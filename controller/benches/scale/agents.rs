//! The scale benchmark's agents: the real report client
//! (`gpu_report::client::run`), one task per node, each with its own token
//! file, its own watch of a node report the size of an 8x H100 node's,
//! its own broadcast of health events and its own receiver of the
//! controller's wishes.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpu_agent_proto::report::v1 as pb;
use gpu_model::health::EventRecord;
use gpu_report::client::{EVENT_BUFFER, Inputs};
use gpu_report::{ControllerLink, ReportConfig};
use tokio::sync::{Notify, broadcast, mpsc, watch};

pub const ACCOUNT: &str = "system:serviceaccount:gpu-agent:gpu-agent";
/// Health events per agent in a burst.
pub const BURST: usize = 5;

/// One simulated node's agent.
pub struct Agent {
    pub node: String,
    events: broadcast::Sender<EventRecord>,
    /// Kept: the client stops when its report's sender goes.
    _report: watch::Sender<Arc<pb::NodeReport>>,
    pub link: Arc<Mutex<ControllerLink>>,
    desired: mpsc::UnboundedReceiver<pb::Desired>,
    _claims: watch::Receiver<Option<Arc<pb::DraClaims>>>,
    task: tokio::task::JoinHandle<()>,
}

pub fn node_name(i: usize) -> String {
    format!("node-{i:05}")
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Writes agent `i`'s token file (`tok-I`) under `dir`.
pub fn token_file(dir: &Path, i: usize) -> std::path::PathBuf {
    let path = dir.join(format!("tok-{i}"));
    std::fs::write(&path, format!("tok-{i}\n")).unwrap();
    path
}

impl Agent {
    /// Starts agent `i` reporting to `endpoint`.
    pub fn start(
        i: usize,
        endpoint: &str,
        ca: &Path,
        token: std::path::PathBuf,
        report: Arc<pb::NodeReport>,
    ) -> Agent {
        let node = node_name(i);
        let cfg = ReportConfig {
            endpoint: endpoint.to_string(),
            ca_file: ca.to_path_buf(),
            server_name: None,
            token_file: token,
            node_name: node.clone(),
            boot_id: format!("boot-{i}"),
            started_at: now_ms() / 1000,
        };
        let (report_tx, report_rx) = watch::channel(report);
        let (events, events_rx) = broadcast::channel(EVENT_BUFFER);
        let (desired_tx, desired) = mpsc::unbounded_channel();
        let (claims_tx, claims) = watch::channel(None);
        let link = Arc::new(Mutex::new(ControllerLink {
            endpoint: endpoint.to_string(),
            node_name: node.clone(),
            ..Default::default()
        }));
        let inputs = Inputs {
            report: report_rx,
            events: events_rx,
            link: link.clone(),
            changed: Arc::new(Notify::new()),
            desired: desired_tx,
            dra_claims: claims_tx,
            check_now: Arc::new(Notify::new()),
        };
        let task = tokio::spawn(gpu_report::client::run(cfg, inputs));
        Agent {
            node,
            events,
            _report: report_tx,
            link,
            desired,
            _claims: claims,
            task,
        }
    }

    /// Whether the controller answered this agent at least once.
    pub fn answered(&self) -> bool {
        let l = self.link.lock().unwrap();
        l.connected || l.connects > 0
    }

    /// Answers the agent had so far (its link's count).
    pub fn answers(&self) -> u64 {
        self.link.lock().unwrap().connects
    }

    /// Sends a burst of [`BURST`] health events, each reason carrying
    /// `sent-ms=MS;TAG;NODE;N` (one word: the scripted API server takes
    /// the latency from it); returns the words.
    pub fn burst(&self, tag: &str) -> Vec<String> {
        (0..BURST)
            .map(|n| {
                let mark = format!("sent-ms={};{tag};{};{n}", now_ms(), self.node);
                let _ = self.events.send(EventRecord {
                    uuid: "GPU-00000003-0000-0000-0000-000000000000".into(),
                    xid: Some(94),
                    reason: format!("XID 94, from NVML (#{n}) {mark}"),
                    advice: Some("contained ECC error: restart the application".into()),
                    unhealthy: false,
                    at_unix_ms: now_ms(),
                });
                mark
            })
            .collect()
    }

    /// Whether a Desired with a policy came since the last call (the
    /// others are read and dropped).
    pub fn got_policy(&mut self) -> bool {
        let mut got = false;
        while let Ok(d) = self.desired.try_recv() {
            got |= !d.policy_yaml.is_empty();
        }
        got
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The agents whose last check-in failed, counted by error (its first
/// words), as a line; empty when none.
pub fn failing(fleet: &[Agent]) -> String {
    let mut by: std::collections::BTreeMap<String, usize> = Default::default();
    for a in fleet {
        let l = a.link.lock().unwrap();
        if !l.connected && l.last_error.is_some() {
            let e = l.last_error.clone().unwrap_or_default();
            *by.entry(e.chars().take(120).collect()).or_default() += 1;
        }
    }
    by.iter()
        .map(|(e, k)| format!("{k} agents' last check-in failed: {e}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Starts agents `range` (250 every 50 ms, as nodes come up).
pub async fn start_all(
    range: std::ops::Range<usize>,
    endpoint: &str,
    ca: &Path,
    tokens: &Path,
    report: &Arc<pb::NodeReport>,
) -> Vec<Agent> {
    let mut agents = Vec::with_capacity(range.len());
    for (k, i) in range.enumerate() {
        agents.push(Agent::start(
            i,
            endpoint,
            ca,
            tokens.join(format!("tok-{i}")),
            report.clone(),
        ));
        if k % 250 == 249 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    agents
}

/// Waits until `done` holds for every agent (or `limit` passes); returns
/// how many it held for and when the last came.
pub async fn wait_all(
    agents: &mut [Agent],
    since: Instant,
    limit: Duration,
    mut done: impl FnMut(&mut Agent) -> bool,
) -> (usize, Duration) {
    let mut flags = vec![false; agents.len()];
    let mut count = 0;
    let mut last = Duration::ZERO;
    while count < agents.len() && since.elapsed() < limit {
        for (a, f) in agents.iter_mut().zip(flags.iter_mut()) {
            if !*f && done(a) {
                *f = true;
                count += 1;
                last = since.elapsed();
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (count, last)
}

/// A node report the size of an 8x H100 node's.
pub fn snapshot() -> pb::NodeReport {
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
    let uuid = |g: u32| format!("GPU-{g:08x}-0000-0000-0000-000000000000");
    pb::NodeReport {
        inventory: Some(pb::Inventory {
            driver_version: "550.127.08".into(),
            cuda_version: "12.4".into(),
            gpus: (0..8)
                .map(|g| pb::Gpu {
                    index: g,
                    uuid: uuid(g),
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
                    uuid: uuid(g),
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
