//! A real Prometheus scrapes `gpu-agent run`, and every answer is checked
//! through PromQL: Debian's `prometheus` (scripts/test installs it) on a
//! private port with its own storage, the agent on the fake libnvidia-ml
//! with a node of two whole H100s and one MIG-enabled H100, and a kubelet
//! that is not our code (tests/interop/podresources_standin.py, Python
//! grpcio) serving the pod-resources API with three pods — one holding a
//! whole GPU, one a time-sliced replica (`nvidia.com/gpu.shared`,
//! `<UUID>::1`), one a MIG device — and the Registration service (it
//! allocates one device per registered resource, as a starting pod would).
//!
//! Checked: every field of dcgm-exporter's default set has the value the
//! fake documents (`simnode::readings`: gauges exactly, counters growing and
//! bounded by their rate), with dcgm-exporter's labels and the pod labels;
//! the MIG device's framebuffer series carry GPU_I_PROFILE/GPU_I_ID and
//! their pod; `up` is 1; and every query of every panel of
//! packaging/grafana/gpu-agent.json returns data (its template variables'
//! queries too).
//!
//! NVIDIA's own dashboard 12239 (`../shared/upstream`, unchanged) runs
//! over two agents on simulated nodes, one exporting dcgm-exporter's
//! default fields, one what upstream's `dcp-metrics-included.csv` names:
//! its every template variable has values, its every panel's query returns
//! data with "All" selected and with each single value, and every DCGM
//! series' help is dcgm-exporter's text.
//!
//! A second run loads dcgm-exporter's own counters file with every
//! `# DCGM_FI_` line uncommented on tests/fixtures/nodes/every-field.yaml
//! (an NVLink H100, a MIG H100, a T4): every one of its fields reaches
//! Prometheus with the file's type and help, dcgm-exporter's labels and
//! every label field, on the GPUs (and GPU instances) that give it and no
//! other, at the value the fake documents.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use gpu_agent::metrics::fields::{FIELDS, Kind};
use serde_json::Value;
use simnode::{GpuDesc, NodeDescription};

/// Two whole H100 SXM (NVLink to four NVSwitches, as in h100-sxm-8) with
/// work on them, and one H100 in MIG mode (as GPU 0 of h100-mig-2).
const NODE: &str = r#"
name: 2x H100 SXM + 1x H100 MIG
machine: prometheus test node
driver: { version: 550.127.08, cudaVersion: "12.4", flavour: open }
nvswitches: ["0000:05:00.0", "0000:06:00.0", "0000:07:00.0", "0000:08:00.0"]
gpus:
  - busId: "0000:18:00.0"
    name: NVIDIA H100 80GB HBM3
    uuid: GPU-9d3b5a0e-1c7f-4e2a-8b61-0f2c3d4e5a01
    deviceId: "0x2330"
    subsystemId: "0x16c1"
    memoryMib: 81559
    memoryUsedMib: 61440
    computeCapability: "9.0"
    mig: { capable: true, enabled: false }
    numaNode: 0
    iommuGroup: 20
    pcie: { switches: [plx0, plx-root0], hostBridge: socket0 }
    nvlinks:
      - { remote: "0000:05:00.0", links: 5 }
      - { remote: "0000:06:00.0", links: 4 }
      - { remote: "0000:07:00.0", links: 4 }
      - { remote: "0000:08:00.0", links: 5 }
    telemetry: { temperatureC: 61, powerMw: 512500, utilizationGpu: 87, utilizationMemory: 43, utilizationEncoder: 3, utilizationDecoder: 7 }
  - busId: "0000:2a:00.0"
    name: NVIDIA H100 80GB HBM3
    uuid: GPU-2b7e4c19-8d3a-4f6b-9c20-1a2b3c4d5e02
    deviceId: "0x2330"
    subsystemId: "0x16c1"
    memoryMib: 81559
    memoryUsedMib: 20480
    computeCapability: "9.0"
    mig: { capable: true, enabled: false }
    numaNode: 0
    iommuGroup: 21
    pcie: { switches: [plx0, plx-root0], hostBridge: socket0 }
    nvlinks:
      - { remote: "0000:05:00.0", links: 5 }
      - { remote: "0000:06:00.0", links: 4 }
      - { remote: "0000:07:00.0", links: 4 }
      - { remote: "0000:08:00.0", links: 5 }
    telemetry: { temperatureC: 48, powerMw: 254250, utilizationGpu: 64, utilizationMemory: 30, smClockMhz: 1755, memClockMhz: 2619 }
  - busId: "0000:3a:00.0"
    name: NVIDIA H100 80GB HBM3
    uuid: GPU-6a1f0c2e-5b3d-4e7f-8a9b-1c2d3e4f5a00
    deviceId: "0x2330"
    subsystemId: "0x16c1"
    memoryMib: 81559
    computeCapability: "9.0"
    numaNode: 0
    iommuGroup: 22
    pcie: { switches: [plx1, plx-root0], hostBridge: socket0 }
    mig:
      capable: true
      enabled: true
      devices:
        - { uuid: MIG-0c1d2e3f-4a5b-5c6d-8e7f-90a1b2c3d400, profile: 3g.40gb, giSlices: 3, memoryMib: 40192, multiprocessors: 60 }
        - { uuid: MIG-0c1d2e3f-4a5b-5c6d-8e7f-90a1b2c3d401, profile: 2g.20gb, giSlices: 2, memoryMib: 19968, multiprocessors: 32 }
        - { uuid: MIG-0c1d2e3f-4a5b-5c6d-8e7f-90a1b2c3d402, profile: 1g.10gb, giSlices: 1, memoryMib: 9856, multiprocessors: 16 }
        - { uuid: MIG-0c1d2e3f-4a5b-5c6d-8e7f-90a1b2c3d403, profile: 1g.10gb, giSlices: 1, memoryMib: 9856, multiprocessors: 16 }
    telemetry: { temperatureC: 35, powerMw: 150000, utilizationGpu: 20, utilizationMemory: 10 }
"#;

const HOSTNAME: &str = "prom-node-1";
const JOB: &str = "gpu-agent";
/// XID raised on GPU 0 through the fake NVML's events file.
const XID: u64 = 79;

/// The Prometheus binary (`GPU_AGENT_PROMETHEUS` names another).
fn prometheus() -> PathBuf {
    let p = std::env::var_os("GPU_AGENT_PROMETHEUS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/prometheus"));
    assert!(
        p.exists(),
        "{} is missing: this test needs a real Prometheus (apt-get install --no-install-recommends prometheus; scripts/test installs it)",
        p.display()
    );
    p
}

/// The child processes, killed (and reaped) however the test ends.
#[derive(Default)]
struct Children(Vec<(&'static str, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Children {
    /// Panics if one has exited, naming it and its log.
    fn check_alive(&mut self, logs: &Path) {
        for (name, c) in &mut self.0 {
            if let Ok(Some(st)) = c.try_wait() {
                panic!(
                    "{name} exited ({st}):\n{}",
                    fs::read_to_string(logs.join(format!("{name}.log"))).unwrap_or_default()
                );
            }
        }
    }
}

/// A plain HTTP/1.0 GET (no chunking): the status and the body.
fn http_get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((status, body.to_string()))
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

struct Prom {
    addr: String,
}

/// One series of an instant query: its labels and value.
#[derive(Debug, Clone)]
struct Series {
    labels: BTreeMap<String, String>,
    value: f64,
}

impl Series {
    fn label(&self, name: &str) -> Option<&str> {
        self.labels.get(name).map(String::as_str)
    }
}

impl Prom {
    fn api(&self, path: &str) -> Value {
        let (status, body) =
            http_get(&self.addr, path).unwrap_or_else(|e| panic!("GET {path}: {e}"));
        let v: Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("GET {path}: {status}, not JSON ({e}): {body}"));
        assert_eq!(v["status"], "success", "GET {path}: {status} {body}");
        v["data"].clone()
    }

    /// An instant query's vector.
    fn query(&self, q: &str) -> Vec<Series> {
        let data = self.api(&format!("/api/v1/query?query={}", urlencode(q)));
        assert_eq!(data["resultType"], "vector", "{q}: {data}");
        data["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| Series {
                labels: serde_json::from_value(r["metric"].clone()).unwrap(),
                value: r["value"][1].as_str().unwrap().parse().unwrap(),
            })
            .collect()
    }

    /// `label_values(<selector>, <label>)`, as Grafana asks it.
    fn label_values(&self, selector: &str, label: &str) -> Vec<String> {
        let data = self.api(&format!(
            "/api/v1/label/{label}/values?match[]={}",
            urlencode(selector)
        ));
        serde_json::from_value(data).unwrap()
    }
}

/// dcgm-exporter's bus-id form (NVML's): `00000000:18:00.0`.
fn bus_id(g: &GpuDesc) -> String {
    let b = g.bus_id;
    format!(
        "{:08X}:{:02X}:{:02X}.{:X}",
        b.domain, b.bus, b.device, b.function
    )
}

/// A pod holding devices, as the pod-resources stand-in reports it.
struct Pod {
    name: &'static str,
    namespace: &'static str,
    container: &'static str,
    resource: &'static str,
    ids: Vec<String>,
}

/// What a gauge of GPU `g` reads by the fake's documentation
/// (`simnode::readings`; `None`: no series), `xid` the last XID raised on
/// it, `remap_pending` whether its condition file says remapped-pending.
fn expected_gauge(name: &str, g: &GpuDesc, xid: u64, remap_pending: bool) -> Option<f64> {
    const MIB: f64 = 1024.0 * 1024.0;
    let r = g.readings(0.0);
    let gpm = r.gpm;
    Some(match name {
        "DCGM_FI_DEV_SM_CLOCK" => r.sm_clock_mhz.into(),
        "DCGM_FI_DEV_MEM_CLOCK" => r.mem_clock_mhz.into(),
        "DCGM_FI_DEV_MEMORY_TEMP" => r.mem_temp_c?.into(),
        "DCGM_FI_DEV_GPU_TEMP" => r.gpu_temp_c?.into(),
        "DCGM_FI_DEV_POWER_USAGE" => f64::from(r.power_mw?) / 1000.0,
        "DCGM_FI_DEV_GPU_UTIL" => r.gpu_util?.into(),
        "DCGM_FI_DEV_MEM_COPY_UTIL" => r.mem_util?.into(),
        "DCGM_FI_DEV_ENC_UTIL" => r.enc_util.into(),
        "DCGM_FI_DEV_DEC_UTIL" => r.dec_util.into(),
        "DCGM_FI_DEV_XID_ERRORS" => xid as f64,
        // NVML's v2 memory info: free is what is neither used nor reserved.
        "DCGM_FI_DEV_FB_FREE" => (r.fb_total_mib - r.fb_used_mib - r.fb_reserved_mib) as f64,
        "DCGM_FI_DEV_FB_USED" => r.fb_used_mib as f64,
        "DCGM_FI_DEV_FB_RESERVED" => r.fb_reserved_mib as f64,
        "DCGM_FI_DEV_FB_TOTAL" => r.fb_total_mib as f64,
        // The fake: remapped-pending is one uncorrectable remapped row.
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS" => f64::from(u8::from(remap_pending)),
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS" => 0.0,
        "DCGM_FI_DEV_ROW_REMAP_FAILURE" => 0.0,
        // Bare metal: no GRID licence.
        "DCGM_FI_DEV_VGPU_LICENSE_STATUS" => r.vgpu_license.into(),
        // GPM: percentages as ratios, MiB/s as bytes/s.
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE" => gpm?.graphics_util_pct / 100.0,
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE" => gpm?.tensor_util_pct / 100.0,
        "DCGM_FI_PROF_DRAM_ACTIVE" => gpm?.dram_bw_util_pct / 100.0,
        "DCGM_FI_PROF_PCIE_TX_BYTES" => gpm?.pcie_tx_mib_s * MIB,
        "DCGM_FI_PROF_PCIE_RX_BYTES" => gpm?.pcie_rx_mib_s * MIB,
        other => panic!("this test does not know what {other} should read: add it"),
    })
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

/// Substitutes the dashboard's variables as Grafana would with "All"
/// selected (each variable's allValue) and a 1-minute rate interval.
fn substitute(expr: &str, vars: &[(String, String)]) -> String {
    let mut e = expr.to_string();
    for v in ["$__rate_interval", "$__interval", "$__range"] {
        e = e.replace(v, "1m");
    }
    for (name, value) in vars {
        e = e
            .replace(&format!("${{{name}}}"), value)
            .replace(&format!("${name}"), value);
    }
    assert!(!e.contains('$'), "a variable left in {e:?} (from {expr:?})");
    e
}

/// Every panel with its targets, rows' nested panels included.
fn panels(dash: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        if p["type"] == "row" {
            out.extend(p["panels"].as_array().into_iter().flatten());
        } else {
            out.push(p);
        }
    }
    out
}

/// Prometheus, its own port and storage under `dir`, scraping the agent on
/// `agent_port` every second; its log in `logs`.
fn start_prometheus(bin: &Path, dir: &Path, logs: &Path, agent_port: u16) -> (Child, Prom) {
    start_prometheus_on(bin, dir, logs, &[agent_port])
}

/// [`start_prometheus`] scraping the agents on `agent_ports`.
fn start_prometheus_on(bin: &Path, dir: &Path, logs: &Path, agent_ports: &[u16]) -> (Child, Prom) {
    let prom_port = free_port();
    let prom_cfg = dir.join("prometheus.yml");
    let targets: Vec<String> = agent_ports
        .iter()
        .map(|p| format!("'127.0.0.1:{p}'"))
        .collect();
    fs::write(
        &prom_cfg,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: {JOB}\n    static_configs:\n      - targets: [{}]\n",
            targets.join(", ")
        ),
    )
    .unwrap();
    let child = Command::new(bin)
        .arg(format!("--config.file={}", prom_cfg.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("tsdb").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
        .stdout(Stdio::null())
        .stderr(fs::File::create(logs.join("prometheus.log")).unwrap())
        .spawn()
        .unwrap();
    (
        child,
        Prom {
            addr: format!("127.0.0.1:{prom_port}"),
        },
    )
}

#[test]
fn a_real_prometheus_scrapes_every_field_with_pod_labels_and_the_dashboard_has_data() {
    let started = Instant::now();
    let prom_bin = prometheus();
    let py = common::python();
    let tmp = tempfile::tempdir().unwrap();
    let host = tmp.path().join("host");
    let logs = tmp.path().join("logs");
    fs::create_dir_all(&logs).unwrap();
    let node_file = tmp.path().join("node.yaml");
    fs::write(&node_file, NODE).unwrap();
    let node = NodeDescription::load(node_file.to_str().unwrap()).unwrap();
    node.materialize(&host).unwrap();
    let driver = node.driver.as_ref().unwrap().version.clone();
    let gpus = &node.gpus;
    let mig_gpu = gpus.iter().position(|g| g.mig.enabled).unwrap();
    let (mig_pos, mig_dev) = gpus[mig_gpu]
        .mig
        .devices
        .iter()
        .enumerate()
        .find(|(_, m)| m.profile.as_deref() == Some("1g.10gb"))
        .unwrap();

    let pods = [
        Pod {
            name: "train-0",
            namespace: "ml",
            container: "trainer",
            resource: "nvidia.com/gpu",
            ids: vec![gpus[0].uuid.clone()],
        },
        Pod {
            name: "notebook-7",
            namespace: "research",
            container: "jupyter",
            resource: "nvidia.com/gpu.shared",
            ids: vec![format!("{}::1", gpus[1].uuid)],
        },
        // A second container on the same time-sliced GPU: its own series.
        Pod {
            name: "notebook-8",
            namespace: "research",
            container: "jupyter",
            resource: "nvidia.com/gpu.shared",
            ids: vec![format!("{}::0", gpus[1].uuid)],
        },
        Pod {
            name: "infer-2",
            namespace: "serving",
            container: "server",
            resource: "nvidia.com/mig-1g.10gb",
            ids: vec![mig_dev.uuid.clone()],
        },
    ];
    let pods_file = tmp.path().join("pods.json");
    let pods_json: Vec<Value> = pods
        .iter()
        .map(|p| {
            serde_json::json!({"name": p.name, "namespace": p.namespace,
                "container": p.container, "resource": p.resource, "ids": p.ids})
        })
        .collect();
    fs::write(&pods_file, serde_json::to_string(&pods_json).unwrap()).unwrap();
    // Who holds which UUID (GPU or MIG device).
    let holders = |uuid: &str| -> Vec<&Pod> {
        pods.iter()
            .filter(|p| {
                p.ids
                    .iter()
                    .any(|id| id.split_once("::").map_or(id.as_str(), |(b, _)| b) == uuid)
            })
            .collect()
    };

    let mut children = Children::default();

    // The kubelet stand-in: both sockets up before the agent starts.
    let mut standin = Command::new(&py)
        .arg(repo().join("tests/interop/podresources_standin.py"))
        .arg("--proto-dir")
        .arg(repo().join("proto/proto"))
        .arg("--host")
        .arg(&host)
        .arg("--pods")
        .arg(&pods_file)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut standin_err = BufReader::new(standin.stderr.take().unwrap());
    children.0.push(("kubelet-standin", standin));
    let mut line = String::new();
    standin_err.read_line(&mut line).unwrap();
    assert_eq!(
        line.trim(),
        "listening",
        "the Python kubelet stand-in said {line:?}"
    );
    let standin_log = logs.join("kubelet-standin.log");
    {
        let mut out = fs::File::create(&standin_log).unwrap();
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut standin_err, &mut out);
        });
    }

    // The agent: the fake NVML with this node, an XID events file, GPU 1
    // with remapped rows pending, MIG devices as mixed resources.
    let agent_port = free_port();
    let events = tmp.path().join("nvml-events");
    fs::write(&events, "").unwrap();
    let state = tmp.path().join("nvml-state");
    let remap_gpu = 1;
    fs::write(
        &state,
        format!("{} remapped-pending\n", gpus[remap_gpu].uuid),
    )
    .unwrap();
    let policy = tmp.path().join("policy.yaml");
    fs::write(
        &policy,
        format!(
            "spec:\n  dcgmExporter:\n    listen: 127.0.0.1:{agent_port}\n  mig:\n    strategy: mixed\n  health:\n    kernelLog: false\n"
        ),
    )
    .unwrap();
    let (_lib_dir, lib) = fake_nvml();
    let agent_started = Instant::now();
    let agent = at(&host)
        .arg("--nvml-lib")
        .arg(&lib)
        .arg("--policy")
        .arg(&policy)
        .args(["--log-format", "text", "run"])
        .env("FAKE_NVML_NODE", &node_file)
        .env("FAKE_NVML_EVENTS", &events)
        .env("FAKE_NVML_STATE", &state)
        .env("NODE_NAME", HOSTNAME)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(fs::File::create(logs.join("gpu-agent.log")).unwrap())
        .spawn()
        .unwrap();
    children.0.push(("gpu-agent", agent));

    let (prom_proc, prom) = start_prometheus(&prom_bin, tmp.path(), &logs, agent_port);
    children.0.push(("prometheus", prom_proc));

    // The XID, once the agent's health watch listens (status says so).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        children.check_alive(&logs);
        let (_, out, _) = run(at(&host).args(["status", "-o", "json"]));
        let health_running = serde_json::from_str::<Value>(&out).ok().is_some_and(|st| {
            st["stages"].as_array().is_some_and(|s| {
                s.iter().any(|s| {
                    s["stage"] == "health"
                        && s["detail"]
                            .as_str()
                            .is_some_and(|d| d.starts_with("watching"))
                })
            })
        });
        if health_running {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the agent's health stage never ran: {out}\n{}",
            fs::read_to_string(logs.join("gpu-agent.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    fs::OpenOptions::new()
        .append(true)
        .open(&events)
        .unwrap()
        .write_all(format!("{} xid {XID}\n", gpus[0].uuid).as_bytes())
        .unwrap();

    // Wait until Prometheus has everything: GPM (two samples), the XID,
    // the allocations, the pods.
    let ready = [
        format!("up{{job=\"{JOB}\"}}"),
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE".to_string(),
        format!("DCGM_FI_DEV_XID_ERRORS == {XID}"),
        "gpu_agent_health_events_total".to_string(),
        "gpu_agent_allocations_total".to_string(),
        "DCGM_FI_DEV_FB_USED{pod!=\"\", GPU_I_PROFILE!=\"\"}".to_string(),
        // Two scrapes of a counter: rate() has data.
        "rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION[1m])".to_string(),
        "rate(gpu_agent_reconciles_total[1m])".to_string(),
    ];
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        children.check_alive(&logs);
        let prom_ready = matches!(http_get(&prom.addr, "/-/ready"), Ok((200, _)));
        let missing: Vec<&String> = ready
            .iter()
            .filter(|q| !prom_ready || prom.query(q).is_empty())
            .collect();
        if missing.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            let (_, scrape) =
                http_get(&format!("127.0.0.1:{agent_port}"), "/metrics").unwrap_or_default();
            panic!(
                "Prometheus never had {missing:?}\nscrape:\n{scrape}\nagent log:\n{}\nkubelet stand-in:\n{}\nprometheus:\n{}",
                fs::read_to_string(logs.join("gpu-agent.log")).unwrap_or_default(),
                fs::read_to_string(&standin_log).unwrap_or_default(),
                fs::read_to_string(logs.join("prometheus.log")).unwrap_or_default(),
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    eprintln!("everything scraped after {:?}", started.elapsed());

    // up == 1
    let up = prom.query(&format!("up{{job=\"{JOB}\"}} == 1"));
    assert_eq!(up.len(), 1, "up{{job={JOB:?}}}: {up:?}");

    // Every field of the default set, on every GPU, with its labels.
    let base_labels = |i: usize, g: &GpuDesc| -> BTreeMap<String, String> {
        [
            ("gpu", i.to_string()),
            ("UUID", g.uuid.clone()),
            ("pci_bus_id", bus_id(g)),
            ("device", format!("nvidia{i}")),
            ("modelName", g.name.clone()),
            ("Hostname", HOSTNAME.to_string()),
            ("DCGM_FI_DRIVER_VERSION", driver.clone()),
            ("job", JOB.to_string()),
            ("instance", format!("127.0.0.1:{agent_port}")),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    };
    // A device's label sets: one per container holding it (`uuid`), or
    // one without pod labels.
    let label_sets = |base: BTreeMap<String, String>, uuid: &str| {
        let hs = holders(uuid);
        if hs.is_empty() {
            return vec![base];
        }
        let mut sets: Vec<BTreeMap<String, String>> = hs
            .iter()
            .map(|p| {
                let mut l = base.clone();
                l.insert("pod".into(), p.name.into());
                l.insert("namespace".into(), p.namespace.into());
                l.insert("container".into(), p.container.into());
                l
            })
            .collect();
        sets.sort();
        sets
    };
    let default_fields: Vec<_> = FIELDS
        .iter()
        .filter(|f| f.default && f.kind != Kind::Label)
        .collect();
    let mut checked = 0;
    let mut counters = Vec::new();
    for f in &default_fields {
        if f.kind == Kind::Counter {
            counters.push(f.name);
        }
        let got = prom.query(&format!("{}{{GPU_I_PROFILE=\"\"}}", f.name));
        for (i, g) in gpus.iter().enumerate() {
            let mine: Vec<&Series> = got
                .iter()
                .filter(|s| s.label("UUID") == Some(&g.uuid))
                .collect();
            let want_labels = label_sets(base_labels(i, g), &g.uuid);
            let expected = match f.kind {
                Kind::Gauge => {
                    let xid = if i == 0 { XID } else { 0 };
                    expected_gauge(f.name, g, xid, i == remap_gpu)
                }
                Kind::Counter => {
                    match f.name {
                        // Counters that are constants in the fake: exact.
                        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"
                        | "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS" => {
                            expected_gauge(f.name, g, 0, i == remap_gpu)
                        }
                        // Growing counters: present where the reading is.
                        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL" => {
                            g.readings(1.0).nvlink_tx_kib.map(|_| f64::NAN)
                        }
                        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION" => {
                            g.telemetry.power_mw.map(|_| f64::NAN)
                        }
                        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER" => Some(f64::NAN),
                        other => panic!(
                            "this test does not know what counter {other} should read: add it"
                        ),
                    }
                }
                Kind::Label => unreachable!(),
            };
            let Some(want) = expected else {
                assert!(
                    mine.is_empty(),
                    "{} on GPU {i}: the fake gives no reading, yet {mine:?}",
                    f.name
                );
                continue;
            };
            let mut labels: Vec<BTreeMap<String, String>> = mine
                .iter()
                .map(|s| {
                    let mut l = s.labels.clone();
                    assert_eq!(l.remove("__name__").as_deref(), Some(f.name));
                    l
                })
                .collect();
            labels.sort();
            assert_eq!(labels, want_labels, "{} on GPU {i}", f.name);
            for s in &mine {
                if !want.is_nan() {
                    assert!(
                        close(s.value, want),
                        "{} on GPU {i}: {} (the fake reads {want})",
                        f.name,
                        s.value
                    );
                }
                // A shared GPU's series (one per container) read the same.
                assert_eq!(s.value, mine[0].value, "{} on GPU {i}: {mine:?}", f.name);
                checked += 1;
            }
        }
    }
    eprintln!(
        "{} fields of the default set, {checked} series checked",
        default_fields.len()
    );

    // Counters: bounded by their rate over the agent's life, and energy and
    // NVLink traffic grow between two queries two seconds apart.
    let counter_values = |name: &str| -> BTreeMap<String, f64> {
        prom.query(&format!("{name}{{GPU_I_PROFILE=\"\"}}"))
            .into_iter()
            .map(|s| (s.label("UUID").unwrap().to_string(), s.value))
            .collect()
    };
    let first: BTreeMap<&str, BTreeMap<String, f64>> =
        counters.iter().map(|n| (*n, counter_values(n))).collect();
    std::thread::sleep(Duration::from_millis(2500));
    let second: BTreeMap<&str, BTreeMap<String, f64>> =
        counters.iter().map(|n| (*n, counter_values(n))).collect();
    // Measured after the values were scraped: an upper bound on the time
    // since the fake NVML was loaded.
    let life = agent_started.elapsed().as_secs_f64();
    for g in gpus {
        let v = |m: &BTreeMap<&str, BTreeMap<String, f64>>, n: &str| m[n].get(&g.uuid).copied();
        if let Some(mw) = g.telemetry.power_mw {
            let (a, b) = (
                v(&first, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION").unwrap(),
                v(&second, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION").unwrap(),
            );
            assert!(b > a, "energy of {} did not grow: {a} then {b}", g.uuid);
            assert!(
                b <= f64::from(mw) * life,
                "energy of {}: {b} mJ is more than {mw} mW for {life} s",
                g.uuid
            );
        }
        let links: u32 = g.nvlinks.iter().map(|l| l.links).sum();
        if links > 0 {
            let (a, b) = (
                v(&first, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL").unwrap(),
                v(&second, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL").unwrap(),
            );
            assert!(
                b > a,
                "NVLink traffic of {} did not grow: {a} then {b}",
                g.uuid
            );
            // tx + rx, each 1024 KiB/s per link.
            let most = 2.0 * simnode::readings::NVLINK_KIB_PER_S_PER_LINK * f64::from(links) * life;
            assert!(b <= most, "NVLink traffic of {}: {b} KiB > {most}", g.uuid);
        }
        let replays = v(&second, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER").unwrap();
        let most = (life / 60.0 * simnode::readings::PCIE_REPLAYS_PER_MIN).floor();
        assert!(
            replays >= 0.0 && replays <= most && replays.fract() == 0.0,
            "PCIe replays of {}: {replays} (at most {most} after {life} s)",
            g.uuid
        );
    }

    // MIG devices: their framebuffer series, GPU_I_PROFILE / GPU_I_ID, the
    // parent's labels, and the pod holding one.
    let parent = &gpus[mig_gpu];
    for name in ["DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED"] {
        let got = prom.query(&format!("{name}{{GPU_I_PROFILE!=\"\"}}"));
        let series: usize = parent
            .mig
            .devices
            .iter()
            .map(|m| holders(&m.uuid).len().max(1))
            .sum();
        assert_eq!(got.len(), series, "{name}: {got:?}");
        for (pos, m) in parent.mig.devices.iter().enumerate() {
            let gi = m.gi_id(pos).to_string();
            let mine: Vec<&Series> = got
                .iter()
                .filter(|s| s.label("GPU_I_ID") == Some(gi.as_str()))
                .collect();
            let mut base = base_labels(mig_gpu, parent);
            base.insert("__name__".into(), name.into());
            base.insert("GPU_I_PROFILE".into(), m.profile.clone().unwrap());
            base.insert("GPU_I_ID".into(), gi.clone());
            let mut labels: Vec<_> = mine.iter().map(|s| s.labels.clone()).collect();
            labels.sort();
            assert_eq!(
                labels,
                label_sets(base, &m.uuid),
                "{name} of MIG device {}",
                m.uuid
            );
            let s = mine[0];
            // The fake: a MIG device's memory is all free.
            let value = if name == "DCGM_FI_DEV_FB_FREE" {
                m.memory_mib as f64
            } else {
                0.0
            };
            assert_eq!(s.value, value, "{name} of MIG device {}", m.uuid);
        }
    }
    // The pods, as a dashboard asks: the MIG pod's framebuffer series has
    // its profile; each pod has its GPU.
    let mig_pod = prom.query("DCGM_FI_DEV_FB_FREE{pod=\"infer-2\", namespace=\"serving\"}");
    assert_eq!(mig_pod.len(), 1, "{mig_pod:?}");
    assert_eq!(
        mig_pod[0].label("GPU_I_PROFILE"),
        mig_dev.profile.as_deref()
    );
    assert_eq!(
        mig_pod[0].label("GPU_I_ID"),
        Some(mig_dev.gi_id(mig_pos).to_string().as_str())
    );
    let by_pod =
        prom.query("count by (namespace, pod, container, UUID) (DCGM_FI_DEV_GPU_TEMP{pod!=\"\"})");
    let mut seen: Vec<(String, String)> = by_pod
        .iter()
        .map(|s| {
            (
                s.label("pod").unwrap().to_string(),
                s.label("UUID").unwrap().to_string(),
            )
        })
        .collect();
    seen.sort();
    let mut want: Vec<(String, String)> = vec![
        ("notebook-7".into(), gpus[1].uuid.clone()),
        ("notebook-8".into(), gpus[1].uuid.clone()),
        ("train-0".into(), gpus[0].uuid.clone()),
    ];
    want.sort();
    assert_eq!(seen, want, "pods on whole GPUs: {by_pod:?}");

    // The agent's own series: the XID by number, the stand-in's allocations.
    let xids = prom.query("gpu_agent_health_events_total");
    assert!(
        xids.iter()
            .any(|s| s.label("xid") == Some(&XID.to_string()) && s.value >= 1.0),
        "{xids:?}"
    );
    let allocs = prom.query("gpu_agent_allocations_total{resource=\"nvidia.com/gpu\"} >= 1");
    assert_eq!(allocs.len(), 1, "the stand-in's allocation: {allocs:?}");

    // The dashboard: every variable's query has values, every target of
    // every panel returns data.
    let dash: Value = serde_json::from_str(
        &fs::read_to_string(repo().join("packaging/grafana/gpu-agent.json")).unwrap(),
    )
    .unwrap();
    let mut vars: Vec<(String, String)> = Vec::new();
    for v in dash["templating"]["list"].as_array().unwrap() {
        let name = v["name"].as_str().unwrap().to_string();
        if v["type"] != "query" {
            continue;
        }
        let q = v["query"]["query"]
            .as_str()
            .or(v["query"].as_str())
            .unwrap_or_else(|| panic!("variable {name}: no query"));
        let inner = q
            .strip_prefix("label_values(")
            .and_then(|r| r.strip_suffix(')'))
            .unwrap_or_else(|| panic!("variable {name}: {q:?} is not label_values(…)"));
        let (selector, label) = inner.rsplit_once(',').unwrap();
        let selector = substitute(selector.trim(), &vars);
        let values = prom.label_values(&selector, label.trim());
        assert!(
            !values.is_empty(),
            "dashboard variable {name} ({q}) has no values"
        );
        let all = v["allValue"]
            .as_str()
            .unwrap_or_else(|| panic!("variable {name}: no allValue"));
        vars.push((name, all.to_string()));
    }
    let mut empty = Vec::new();
    let mut targets = 0;
    for p in panels(&dash) {
        let title = p["title"].as_str().unwrap();
        for t in p["targets"].as_array().unwrap() {
            let expr = substitute(t["expr"].as_str().unwrap(), &vars);
            targets += 1;
            if prom.query(&expr).is_empty() {
                empty.push(format!("panel {title:?}: {expr}"));
            }
        }
    }
    assert!(
        empty.is_empty(),
        "dashboard queries that return nothing:\n{}",
        empty.join("\n")
    );
    eprintln!(
        "dashboard: {} panels, {targets} queries with data; test took {:?}",
        panels(&dash).len(),
        started.elapsed()
    );
}

/// A counters file's field lines: name → (type, help), the first line of a
/// name counting (`# DCGM_FI_` lines uncommented, as a user enables them).
fn counters_lines(text: &str) -> Vec<(String, String, String)> {
    let mut out: Vec<(String, String, String)> = Vec::new();
    for l in text.lines() {
        let l = l.trim();
        let l = match l.strip_prefix('#') {
            Some(rest) if rest.trim_start().starts_with("DCGM_FI_") => rest.trim_start(),
            _ => l,
        };
        if !l.starts_with("DCGM_") {
            continue;
        }
        let mut parts = l.splitn(3, ',').map(str::trim);
        let (name, kind, help) = (
            parts.next().unwrap().to_string(),
            parts.next().unwrap().to_string(),
            parts.next().unwrap_or_default().to_string(),
        );
        if !out.iter().any(|(n, _, _)| *n == name) {
            out.push((name, kind, help));
        }
    }
    out
}

/// `text` with every `# DCGM_FI_` line uncommented.
fn uncomment(text: &str) -> String {
    text.lines()
        .map(|l| match l.trim_start().strip_prefix('#') {
            Some(rest) if rest.trim_start().starts_with("DCGM_FI_") => rest.trim_start(),
            _ => l,
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

/// What a field of GPU `g` reads by the fake's documentation
/// (`simnode::readings`).
enum Expect {
    /// No series for this GPU.
    Absent,
    /// Exactly this.
    Exact(f64),
    /// A counter growing from 0 by at most this much a second (and by
    /// something: the rate is above 0).
    Growing(f64),
}

fn expected(name: &str, g: &GpuDesc, retired_pending: bool) -> Expect {
    use Expect::*;
    use simnode::readings::{NVLINK_KIB_PER_S_PER_LINK, PCIE_REPLAYS_PER_MIN, THROTTLE_NS_PER_S};
    let r = g.readings(0.0);
    let opt = |v: Option<f64>| v.map_or(Absent, Exact);
    let rate = |per_s: u64| {
        if per_s == 0 {
            Exact(0.0)
        } else {
            Growing(per_s as f64)
        }
    };
    let gpm = |f: fn(&simnode::readings::Gpm) -> f64| opt(r.gpm.as_ref().map(|x| f(x) / 100.0));
    let links = f64::from(r.nvlink_links);
    let v = THROTTLE_NS_PER_S;
    match name {
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION" => {
            r.power_mw.map_or(Absent, |mw| Growing(mw.into()))
        }
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER" => Growing(PCIE_REPLAYS_PER_MIN / 60.0),
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL" => r
            .nvlink_link_kib
            .map_or(Absent, |_| Growing(2.0 * NVLINK_KIB_PER_S_PER_LINK * links)),
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_L0" => r
            .nvlink_link_kib
            .map_or(Absent, |_| Growing(2.0 * NVLINK_KIB_PER_S_PER_LINK)),
        "DCGM_FI_DEV_POWER_VIOLATION" => rate(v.power),
        "DCGM_FI_DEV_THERMAL_VIOLATION" => rate(v.thermal),
        "DCGM_FI_DEV_SYNC_BOOST_VIOLATION" => rate(v.sync_boost),
        "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION" => rate(v.board_limit),
        "DCGM_FI_DEV_LOW_UTIL_VIOLATION" => rate(v.low_util),
        "DCGM_FI_DEV_RELIABILITY_VIOLATION" => rate(v.reliability),
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL" => Exact(r.ecc.sbe_volatile as f64),
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL" => Exact(r.ecc.dbe_volatile as f64),
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL" => Exact(r.ecc.sbe_aggregate as f64),
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL" => Exact(r.ecc.dbe_aggregate as f64),
        "DCGM_FI_DEV_RETIRED_SBE" => opt(r.retired.map(|p| p.sbe as f64)),
        "DCGM_FI_DEV_RETIRED_DBE" => opt(r.retired.map(|p| p.dbe as f64)),
        "DCGM_FI_DEV_RETIRED_PENDING" => {
            opt(r.retired.map(|_| f64::from(u8::from(retired_pending))))
        }
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL" => {
            opt(r.nvlink_errors.map(|e| e.crc_flit as f64))
        }
        "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL" => {
            opt(r.nvlink_errors.map(|e| e.crc_data as f64))
        }
        "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL" => {
            opt(r.nvlink_errors.map(|e| e.replay as f64))
        }
        "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL" => {
            opt(r.nvlink_errors.map(|e| e.recovery as f64))
        }
        "DCGM_FI_PROF_SM_ACTIVE" => gpm(|x| x.sm_util_pct),
        "DCGM_FI_PROF_SM_OCCUPANCY" => gpm(|x| x.sm_occupancy_pct),
        "DCGM_FI_PROF_PIPE_FP64_ACTIVE" => gpm(|x| x.fp64_util_pct),
        "DCGM_FI_PROF_PIPE_FP32_ACTIVE" => gpm(|x| x.fp32_util_pct),
        "DCGM_FI_PROF_PIPE_FP16_ACTIVE" => gpm(|x| x.fp16_util_pct),
        // No XID raised in this test; the remapped rows as the fake keeps them.
        other => opt(expected_gauge(other, g, 0, false)),
    }
}

/// What a field of GPU instance `gi_id` of `g` reads (`None`: the field is
/// not given per GPU instance).
fn expected_instance(name: &str, g: &GpuDesc, gi_id: u32, memory_mib: u64) -> Option<f64> {
    let x = g.instance_gpm(gi_id)?;
    Some(match name {
        // The fake: a MIG device's memory is all free.
        "DCGM_FI_DEV_FB_FREE" => memory_mib as f64,
        "DCGM_FI_DEV_FB_USED" => 0.0,
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE" => x.graphics_util_pct / 100.0,
        "DCGM_FI_PROF_SM_ACTIVE" => x.sm_util_pct / 100.0,
        "DCGM_FI_PROF_SM_OCCUPANCY" => x.sm_occupancy_pct / 100.0,
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE" => x.tensor_util_pct / 100.0,
        "DCGM_FI_PROF_DRAM_ACTIVE" => x.dram_bw_util_pct / 100.0,
        "DCGM_FI_PROF_PIPE_FP64_ACTIVE" => x.fp64_util_pct / 100.0,
        "DCGM_FI_PROF_PIPE_FP32_ACTIVE" => x.fp32_util_pct / 100.0,
        "DCGM_FI_PROF_PIPE_FP16_ACTIVE" => x.fp16_util_pct / 100.0,
        _ => return None,
    })
}

/// The label fields of GPU `g` of `node` as DCGM names them: the board's
/// facts and NVML's version (a fact the board lacks: no label).
fn label_fields(node: &NodeDescription, g: &GpuDesc) -> Vec<(&'static str, String)> {
    let b = g.board();
    let brand = match b.brand {
        simnode::readings::BRAND_NVIDIA => "NVIDIA",
        simnode::readings::BRAND_TESLA => "Tesla",
        other => panic!("this test does not know brand {other}"),
    };
    let mut l = vec![
        (
            "DCGM_FI_DRIVER_VERSION",
            node.driver.as_ref().unwrap().version.clone(),
        ),
        ("DCGM_FI_NVML_VERSION", node.nvml_version().unwrap()),
        ("DCGM_FI_DEV_BRAND", brand.to_string()),
        ("DCGM_FI_DEV_SERIAL", b.serial),
        ("DCGM_FI_DEV_OEM_INFOROM_VER", b.inforom_oem),
        ("DCGM_FI_DEV_ECC_INFOROM_VER", b.inforom_ecc),
        ("DCGM_FI_DEV_INFOROM_IMAGE_VER", b.inforom_image),
        ("DCGM_FI_DEV_VBIOS_VERSION", b.vbios),
    ];
    if let Some(p) = b.inforom_power {
        l.push(("DCGM_FI_DEV_POWER_INFOROM_VER", p));
    }
    l
}

/// dcgm-exporter's own counters files with every `# DCGM_FI_` line
/// uncommented (both list the same fields; default-counters.csv is the one
/// loaded), on a node where each field has a GPU that gives it and one that
/// does not (tests/fixtures/nodes/every-field.yaml): every field reaches a
/// real Prometheus under its name, with the file's type and help, on the
/// GPUs that give it and no other, with dcgm-exporter's labels and every
/// label field, at the value `simnode::readings` documents (counters:
/// growing, bounded by their rate); the GPU instances of the MIG GPU carry
/// their framebuffer and GPM figures with GPU_I_PROFILE/GPU_I_ID.
#[test]
fn a_real_prometheus_scrapes_every_field_of_dcgm_exporters_files_uncommented() {
    let started = Instant::now();
    let prom_bin = prometheus();
    let tmp = tempfile::tempdir().unwrap();
    let host = tmp.path().join("host");
    let logs = tmp.path().join("logs");
    fs::create_dir_all(&logs).unwrap();
    let node_file = repo().join("tests/fixtures/nodes/every-field.yaml");
    let node = NodeDescription::load(node_file.to_str().unwrap()).unwrap();
    node.materialize(&host).unwrap();
    let gpus = &node.gpus;

    let upstream = repo().join("../shared/upstream/dcgm-exporter");
    let read = |name: &str| {
        fs::read_to_string(upstream.join(name)).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (CI has ../shared beside the checkout)",
                upstream.join(name).display()
            )
        })
    };
    let default_text = read("default-counters.csv");
    let lines = counters_lines(&default_text);
    assert_eq!(
        lines,
        counters_lines(&read("dcp-metrics-included.csv")),
        "dcp-metrics-included.csv lists other fields than default-counters.csv: test it too"
    );
    let counters = tmp.path().join("counters.csv");
    fs::write(&counters, uncomment(&default_text)).unwrap();
    let values: Vec<&(String, String, String)> =
        lines.iter().filter(|(_, k, _)| k != "label").collect();
    assert!(values.len() >= 45, "{values:?}");

    // The agent: the fake NVML with this node, the T4's pages waiting for
    // retirement; no kubelet (no pod labels).
    let agent_port = free_port();
    let state = tmp.path().join("nvml-state");
    let t4 = gpus.iter().position(|g| g.name == "Tesla T4").unwrap();
    fs::write(&state, format!("{} retired-pending\n", gpus[t4].uuid)).unwrap();
    let policy = tmp.path().join("policy.yaml");
    fs::write(
        &policy,
        format!(
            "spec:\n  dcgmExporter:\n    listen: 127.0.0.1:{agent_port}\n    config: {}\n  health:\n    kernelLog: false\n",
            counters.display()
        ),
    )
    .unwrap();
    let (_lib_dir, lib) = fake_nvml();
    let mut children = Children::default();
    let agent_started = Instant::now();
    let agent = at(&host)
        .arg("--nvml-lib")
        .arg(&lib)
        .arg("--policy")
        .arg(&policy)
        .args(["--log-format", "text", "run"])
        .env("FAKE_NVML_NODE", &node_file)
        .env("FAKE_NVML_STATE", &state)
        .env("NODE_NAME", HOSTNAME)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(fs::File::create(logs.join("gpu-agent.log")).unwrap())
        .spawn()
        .unwrap();
    children.0.push(("gpu-agent", agent));
    let (prom_proc, prom) = start_prometheus(&prom_bin, tmp.path(), &logs, agent_port);
    children.0.push(("prometheus", prom_proc));

    // Until Prometheus has GPM (two samples, per GPU and per GPU instance)
    // and two scrapes of the counters.
    let ready = [
        format!("up{{job=\"{JOB}\"}}"),
        "DCGM_FI_PROF_SM_ACTIVE{GPU_I_PROFILE=\"\"}".to_string(),
        "DCGM_FI_PROF_PIPE_FP16_ACTIVE{GPU_I_PROFILE!=\"\"}".to_string(),
        "rate(DCGM_FI_DEV_POWER_VIOLATION[1m])".to_string(),
        "rate(DCGM_FI_DEV_NVLINK_BANDWIDTH_L0[1m])".to_string(),
    ];
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        children.check_alive(&logs);
        let prom_ready = matches!(http_get(&prom.addr, "/-/ready"), Ok((200, _)));
        let missing: Vec<&String> = ready
            .iter()
            .filter(|q| !prom_ready || prom.query(q).is_empty())
            .collect();
        if missing.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            let (_, scrape) =
                http_get(&format!("127.0.0.1:{agent_port}"), "/metrics").unwrap_or_default();
            panic!(
                "Prometheus never had {missing:?}\nscrape:\n{scrape}\nagent log:\n{}\nprometheus:\n{}",
                fs::read_to_string(logs.join("gpu-agent.log")).unwrap_or_default(),
                fs::read_to_string(logs.join("prometheus.log")).unwrap_or_default(),
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }

    // The type and help Prometheus keeps are the file's (the first line of
    // a field listed twice).
    let meta = prom.api("/api/v1/metadata");
    for (name, kind, help) in &values {
        let m = &meta[name.as_str()][0];
        assert_eq!(m["type"], kind.as_str(), "{name}'s type: {m}");
        assert_eq!(m["help"], help.as_str(), "{name}'s help: {m}");
    }

    let base_labels = |i: usize, g: &GpuDesc| -> BTreeMap<String, String> {
        let mut l: BTreeMap<String, String> = [
            ("gpu", i.to_string()),
            ("UUID", g.uuid.clone()),
            ("pci_bus_id", bus_id(g)),
            ("device", format!("nvidia{i}")),
            ("modelName", g.name.clone()),
            ("Hostname", HOSTNAME.to_string()),
            ("job", JOB.to_string()),
            ("instance", format!("127.0.0.1:{agent_port}")),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        for (k, v) in label_fields(&node, g) {
            l.insert(k.to_string(), v);
        }
        l
    };
    let without_name = |s: &Series, name: &str| {
        let mut l = s.labels.clone();
        assert_eq!(l.remove("__name__").as_deref(), Some(name));
        l
    };

    // Every value field on every whole GPU; counters read twice.
    let mut growing: Vec<(String, String, f64, f64)> = Vec::new();
    let mut series = 0;
    for (name, _, _) in &values {
        let got = prom.query(&format!("{name}{{GPU_I_PROFILE=\"\"}}"));
        for (i, g) in gpus.iter().enumerate() {
            let mine: Vec<&Series> = got
                .iter()
                .filter(|s| s.label("UUID") == Some(&g.uuid))
                .collect();
            match expected(name, g, i == t4) {
                Expect::Absent => {
                    assert!(mine.is_empty(), "{name} on GPU {i} ({}): {mine:?}", g.name);
                    continue;
                }
                Expect::Exact(want) => {
                    assert_eq!(mine.len(), 1, "{name} on GPU {i} ({}): {got:?}", g.name);
                    assert!(
                        close(mine[0].value, want),
                        "{name} on GPU {i}: {} (the fake reads {want})",
                        mine[0].value
                    );
                }
                Expect::Growing(per_s) => {
                    assert_eq!(mine.len(), 1, "{name} on GPU {i} ({}): {got:?}", g.name);
                    growing.push((name.clone(), g.uuid.clone(), per_s, mine[0].value));
                }
            }
            assert_eq!(
                without_name(mine[0], name),
                base_labels(i, g),
                "{name} on GPU {i}"
            );
            series += 1;
        }
    }
    std::thread::sleep(Duration::from_millis(2500));
    let life = agent_started.elapsed().as_secs_f64();
    for (name, uuid, per_s, first) in &growing {
        let now = prom.query(&format!("{name}{{UUID=\"{uuid}\", GPU_I_PROFILE=\"\"}}"));
        let v = now[0].value;
        // A slow counter (PCIe replays, 6 a minute) may not move in 2.5 s.
        if *per_s >= 1.0 {
            assert!(
                v > *first,
                "{name} of {uuid} did not grow: {first} then {v}"
            );
        }
        assert!(v >= *first, "{name} of {uuid} went back: {first} then {v}");
        assert!(
            v <= per_s * life,
            "{name} of {uuid}: {v} is more than {per_s}/s for {life} s"
        );
    }

    // The GPU instances of the MIG GPU: framebuffer and GPM, each its own,
    // with the parent's labels and GPU_I_PROFILE / GPU_I_ID; fields not
    // given per GPU instance have no such series.
    let mig_gpu = gpus.iter().position(|g| g.mig.enabled).unwrap();
    let parent = &gpus[mig_gpu];
    let mut instance_series = 0;
    for (name, _, _) in &values {
        let got = prom.query(&format!("{name}{{GPU_I_PROFILE!=\"\"}}"));
        let per_gi: Vec<_> = parent
            .mig
            .devices
            .iter()
            .enumerate()
            .filter_map(|(pos, m)| {
                expected_instance(name, parent, m.gi_id(pos), m.memory_mib).map(|v| (pos, m, v))
            })
            .collect();
        assert_eq!(got.len(), per_gi.len(), "{name} per GPU instance: {got:?}");
        for (pos, m, want) in per_gi {
            let gi = m.gi_id(pos).to_string();
            let s = got
                .iter()
                .find(|s| s.label("GPU_I_ID") == Some(gi.as_str()))
                .unwrap_or_else(|| panic!("{name} of GPU instance {gi}: {got:?}"));
            let mut labels = base_labels(mig_gpu, parent);
            labels.insert("GPU_I_PROFILE".into(), m.profile.clone().unwrap());
            labels.insert("GPU_I_ID".into(), gi.clone());
            assert_eq!(without_name(s, name), labels, "{name} of GPU instance {gi}");
            assert!(
                close(s.value, want),
                "{name} of GPU instance {gi}: {} (the fake reads {want})",
                s.value
            );
            instance_series += 1;
        }
    }
    eprintln!(
        "{} value fields and {} label fields of dcgm-exporter's files: {series} GPU series and {instance_series} GPU-instance series checked, {} counters grew; test took {:?}",
        values.len(),
        lines.len() - values.len(),
        growing.len(),
        started.elapsed()
    );
}

/// A counters file's field lines as dcgm-exporter reads it (comments left
/// out): name → help.
fn counters_help(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for l in text.lines().map(str::trim) {
        if !l.starts_with("DCGM_") {
            continue;
        }
        let mut parts = l.splitn(3, ',').map(str::trim);
        let name = parts.next().unwrap().to_string();
        let help = parts.nth(1).unwrap_or_default().to_string();
        out.entry(name).or_insert(help);
    }
    out
}

/// What Grafana puts for a multi-value variable with "All" selected and no
/// `allValue`: every value, regex-escaped, as `(a|b|…)` (one value: itself).
fn grafana_all(values: &[String]) -> String {
    let escaped: Vec<String> = values
        .iter()
        .map(|v| {
            v.chars()
                .map(|c| {
                    if "\\^$.|?*+()[]{}".contains(c) {
                        format!("\\\\{c}")
                    } else {
                        c.to_string()
                    }
                })
                .collect()
        })
        .collect();
    match escaped.as_slice() {
        [one] => one.clone(),
        many => format!("({})", many.join("|")),
    }
}

/// NVIDIA's dashboard 12239 (dcgm-exporter's `grafana/dcgm-exporter-dashboard.json`,
/// the copy in `../shared/upstream` unchanged) over two gpu-agents scraped
/// by one real Prometheus: an 8x H100 node exporting dcgm-exporter's
/// default fields (no counters file) and a node of two H100s (one in MIG
/// mode) and a T4 exporting what upstream's `dcp-metrics-included.csv`
/// (the GPU Operator's counters file), unchanged, names. Every template
/// variable (`label_values(…)`) has values; every target of every panel
/// returns data with each variable on "All" (Grafana's regex of every
/// value), and with each single value of each variable. And every DCGM
/// series' `# HELP` is the counters file's text (dcgm-exporter's), the
/// same from both agents.
#[test]
fn upstream_dashboard_12239_has_data_on_every_panel_and_variable() {
    let started = Instant::now();
    let prom_bin = prometheus();
    let upstream = repo().join("../shared/upstream/dcgm-exporter");
    let read = |name: &str| {
        fs::read_to_string(upstream.join(name)).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (CI has ../shared beside the checkout)",
                upstream.join(name).display()
            )
        })
    };
    let dash: Value = serde_json::from_str(&read("dcgm-exporter-dashboard.json")).unwrap();
    let dcp = upstream.join("dcp-metrics-included.csv");
    let mut help = counters_help(&read("default-counters.csv"));
    for (name, text) in counters_help(&read("dcp-metrics-included.csv")) {
        assert_eq!(
            help.entry(name.clone()).or_insert(text.clone()),
            &text,
            "{name}: the two files' help differs; check each agent against its own"
        );
    }

    let tmp = tempfile::tempdir().unwrap();
    let logs = tmp.path().join("logs");
    fs::create_dir_all(&logs).unwrap();
    let (_lib_dir, lib) = fake_nvml();
    let mut children = Children::default();
    // (process name, node, counters file, node name).
    let agents: [(&'static str, PathBuf, Option<&Path>, &str); 2] = [
        (
            "gpu-agent-h100",
            PathBuf::from("h100-sxm-8"),
            None,
            "dash-node-1",
        ),
        (
            "gpu-agent-every-field",
            repo().join("tests/fixtures/nodes/every-field.yaml"),
            Some(&dcp),
            "dash-node-2",
        ),
    ];
    let mut ports = Vec::new();
    for (name, node, counters, node_name) in &agents {
        let host = tmp.path().join(name);
        NodeDescription::load(node.to_str().unwrap())
            .unwrap()
            .materialize(&host)
            .unwrap();
        let port = free_port();
        let mut policy = format!("spec:\n  dcgmExporter:\n    listen: 127.0.0.1:{port}\n");
        if let Some(c) = counters {
            policy.push_str(&format!("    config: {}\n", c.display()));
        }
        policy.push_str("  health:\n    kernelLog: false\n");
        let policy_file = tmp.path().join(format!("{name}.yaml"));
        fs::write(&policy_file, policy).unwrap();
        let agent = at(&host)
            .arg("--nvml-lib")
            .arg(&lib)
            .arg("--policy")
            .arg(&policy_file)
            .args(["--log-format", "text", "run"])
            .env("FAKE_NVML_NODE", node)
            .env("NODE_NAME", node_name)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(fs::File::create(logs.join(format!("{name}.log"))).unwrap())
            .spawn()
            .unwrap();
        children.0.push((*name, agent));
        ports.push(port);
    }
    let (prom_proc, prom) = start_prometheus_on(&prom_bin, tmp.path(), &logs, &ports);
    children.0.push(("prometheus", prom_proc));

    // Until both agents are up and have GPM (two samples each).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        children.check_alive(&logs);
        let prom_ready = matches!(http_get(&prom.addr, "/-/ready"), Ok((200, _)));
        let ready = prom_ready
            && prom.query(&format!("up{{job=\"{JOB}\"}} == 1")).len() == 2
            && prom
                .query("count by (instance) (DCGM_FI_PROF_PIPE_TENSOR_ACTIVE)")
                .len()
                == 2;
        if ready {
            break;
        }
        if Instant::now() > deadline {
            let scrapes: Vec<String> = ports
                .iter()
                .map(|p| {
                    http_get(&format!("127.0.0.1:{p}"), "/metrics")
                        .unwrap_or_default()
                        .1
                })
                .collect();
            panic!(
                "Prometheus never had both agents' GPM\nscrapes:\n{}\nlogs:\n{}\nprometheus:\n{}",
                scrapes.join("\n----\n"),
                agents
                    .iter()
                    .map(|(n, ..)| fs::read_to_string(logs.join(format!("{n}.log")))
                        .unwrap_or_default())
                    .collect::<Vec<_>>()
                    .join("\n----\n"),
                fs::read_to_string(logs.join("prometheus.log")).unwrap_or_default(),
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }

    // The variables, in order (a later one may use an earlier one).
    let mut values: Vec<(String, Vec<String>)> = Vec::new();
    let mut all: Vec<(String, String)> = Vec::new();
    for v in dash["templating"]["list"].as_array().unwrap() {
        let name = v["name"].as_str().unwrap().to_string();
        match v["type"].as_str() {
            Some("datasource") => continue,
            Some("query") => {}
            other => panic!("variable {name}: type {other:?}, which this test does not know"),
        }
        let q = v["query"]["query"]
            .as_str()
            .or(v["query"].as_str())
            .unwrap_or_else(|| panic!("variable {name}: no query"));
        let inner = q
            .strip_prefix("label_values(")
            .and_then(|r| r.strip_suffix(')'))
            .unwrap_or_else(|| panic!("variable {name}: {q:?} is not label_values(…)"));
        let (selector, label) = inner.rsplit_once(',').unwrap();
        let selector = substitute(selector.trim(), &all);
        let found = prom.label_values(&selector, label.trim());
        assert!(
            !found.is_empty(),
            "dashboard variable {name} ({q}) has no values"
        );
        let all_value = match v["allValue"].as_str() {
            Some(a) => a.to_string(),
            None => grafana_all(&found),
        };
        all.push((name.clone(), all_value));
        values.push((name, found));
    }
    assert_eq!(
        values
            .iter()
            .map(|(n, v)| (n.as_str(), v.len()))
            .collect::<Vec<_>>(),
        [("instance", 2), ("gpu", 8)],
        "the variables' values over both nodes"
    );

    // Every target of every panel: with every variable on "All", then with
    // each value of each variable alone (the others on "All").
    let mut selections: Vec<(String, Vec<(String, String)>)> = vec![("All".into(), all.clone())];
    for (name, vals) in &values {
        for one in vals {
            let vars = all
                .iter()
                .map(|(n, a)| {
                    let v = if n == name {
                        grafana_all(std::slice::from_ref(one))
                    } else {
                        a.clone()
                    };
                    (n.clone(), v)
                })
                .collect();
            selections.push((format!("{name}={one}"), vars));
        }
    }
    let mut empty = Vec::new();
    let mut queries = 0;
    let panels = panels(&dash);
    for p in &panels {
        let title = p["title"].as_str().unwrap();
        let targets = p["targets"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default();
        assert!(!targets.is_empty(), "panel {title:?} has no query");
        for t in targets {
            let expr = t["expr"].as_str().unwrap();
            for (label, vars) in &selections {
                let q = substitute(expr, vars);
                queries += 1;
                if prom.query(&q).is_empty() {
                    empty.push(format!("panel {title:?} ({label}): {q}"));
                }
            }
        }
    }
    assert!(
        empty.is_empty(),
        "dashboard 12239 queries that return nothing:\n{}",
        empty.join("\n")
    );

    // `# HELP` of every DCGM series: the counters files' text, one per
    // metric over both agents.
    let meta = prom.api("/api/v1/metadata");
    let mut checked = 0;
    for (name, entries) in meta.as_object().unwrap() {
        if !name.starts_with("DCGM_") {
            continue;
        }
        let entries = entries.as_array().unwrap();
        let want = help
            .get(name)
            .unwrap_or_else(|| panic!("{name} is in neither counters file"));
        assert!(
            entries.len() == 1 && entries[0]["help"] == want.as_str(),
            "{name}: help {entries:?}, dcgm-exporter's is {want:?}"
        );
        checked += 1;
    }
    assert!(checked >= 20, "{checked} DCGM metrics' help checked");
    eprintln!(
        "dashboard 12239: {} panels, {queries} queries over {} selections with data; {checked} metrics' help as dcgm-exporter's; test took {:?}",
        panels.len(),
        selections.len(),
        started.elapsed()
    );
}
