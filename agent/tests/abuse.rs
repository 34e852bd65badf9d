//! Bounded under abuse: `gpu-agent run` (the fake libnvidia-ml on a 4x T4
//! node, events injected through its events file) while clients we did not
//! write misuse its interfaces:
//! - Python grpcio on the device-plugin socket: Allocate with 100,000 IDs
//!   (over the message limit, and under it), an ID of 512 KiB, an ID twice,
//!   100,000 container requests, a preferred allocation over 100,000 IDs:
//!   each refused with a status naming the count or size and its limit,
//!   then a normal Allocate served;
//! - Python grpcio opening 2,000 ListAndWatch streams over 20 connections:
//!   64 per socket served, the rest refused with ResourceExhausted, while
//!   the kubelet's stream (opened first) still gets a health change; once
//!   the abuser leaves, a new stream is served again;
//! - raw sockets on /metrics: slowloris clients and clients that never read
//!   are closed by the header and write timeouts, a flood of 500 idle
//!   connections leaves 32 open, and curl's scrapes are answered throughout.
//!
//! The agent's peak RSS is reset before each abuse (clear_refs) and must
//! stay within a coarse bound; the figures are in `cargo bench -p gpu-agent
//! --bench abuse` (agent/benches/abuse.rs).

mod common;

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use gpu_agent::plugin::kubelet::{self, MockKubelet};
use gpu_agent_proto::deviceplugin::v1beta1::Empty;
use gpu_agent_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use serde_json::Value;
use tokio_stream::StreamExt;

/// How much the agent's peak RSS may grow during one abuse. Generous: the
/// bench measures the real growth; this catches memory that grows with the
/// abuse (100,000 IDs decoded, 2,000 streams with a buffer each).
const RSS_GROWTH_BOUND_KIB: u64 = 48 * 1024;

struct Agent {
    child: Child,
    host: tempfile::TempDir,
    events: PathBuf,
    metrics_port: u16,
    _lib_dir: tempfile::TempDir,
}

impl Agent {
    fn start() -> Agent {
        let (host, events) = plugin_host("t4-4");
        let metrics_port = free_port();
        let policy = host.path().join("policy.yaml");
        fs::write(
            &policy,
            format!(
                "spec:\n  health:\n    recoverAfterSeconds: 3\n  dcgmExporter:\n    listen: 127.0.0.1:{metrics_port}\n"
            ),
        )
        .unwrap();
        let (lib_dir, lib) = fake_nvml();
        let child = at(host.path())
            .arg("--nvml-lib")
            .arg(&lib)
            .arg("--policy")
            .arg(&policy)
            .args(["run", "--heartbeat", "1"])
            .env("FAKE_NVML_NODE", "t4-4")
            .env("FAKE_NVML_EVENTS", &events)
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Agent {
            child,
            host,
            events,
            metrics_port,
            _lib_dir: lib_dir,
        }
    }

    /// Waits for the CDI stage: it copies the agent's own binary as the
    /// hook program (hundreds of MiB in a debug build), the startup's peak.
    fn wait_settled(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (_, out, _) = run(at(self.host.path()).args(["status", "-o", "json"]));
            if serde_json::from_str::<Value>(&out)
                .is_ok_and(|st| stage(&st, "cdi")["state"] == "done")
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the CDI stage never finished: {out}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn plugin_dir(&self) -> PathBuf {
        self.host.path().join("var/lib/kubelet/device-plugins")
    }

    fn socket(&self) -> PathBuf {
        self.plugin_dir().join("nvidia-gpu.sock")
    }

    fn xid(&self, line: &str) {
        let mut f = fs::OpenOptions::new()
            .append(true)
            .open(&self.events)
            .unwrap();
        writeln!(f, "{line}").unwrap();
    }

    /// Resets the peak RSS to the current one (clear_refs 5).
    fn reset_peak(&self) {
        fs::write(format!("/proc/{}/clear_refs", self.child.id()), "5").unwrap();
    }

    /// (VmRSS, VmHWM) in KiB.
    fn rss(&self) -> (u64, u64) {
        let status = fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let field = |name: &str| -> u64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or_else(|| panic!("no {name} in /proc/<agent>/status"))
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    fn assert_peak_bounded(&self, what: &str, before: u64) {
        let (_, peak) = self.rss();
        assert!(
            peak.saturating_sub(before) < RSS_GROWTH_BOUND_KIB,
            "{what}: the agent's peak RSS grew from {before} KiB to {peak} KiB"
        );
    }

    fn assert_alive(&mut self) {
        assert!(
            self.child.try_wait().unwrap().is_none(),
            "the agent exited under abuse"
        );
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = sigterm(&mut self.child);
    }
}

/// A Python peer (tests/interop/<script>) with stdin and stdout piped.
fn peer(script: &str, args: &[&str]) -> Child {
    Command::new(python())
        .arg(repo().join("tests/interop").join(script))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

fn line(out: &mut impl BufRead, what: &str) -> Value {
    let mut l = String::new();
    out.read_line(&mut l).unwrap();
    assert!(!l.is_empty(), "{what}: the peer printed nothing");
    json(&l)
}

fn proto() -> String {
    repo()
        .join("proto/proto/deviceplugin_v1beta1.proto")
        .display()
        .to_string()
}

type Stream = tonic::Streaming<gpu_agent_proto::deviceplugin::v1beta1::ListAndWatchResponse>;

async fn next_health(s: &mut Stream) -> Vec<String> {
    tokio::time::timeout(Duration::from_secs(10), s.next())
        .await
        .expect("no ListAndWatch update")
        .unwrap()
        .unwrap()
        .devices
        .iter()
        .map(|d| d.health.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_socket_refuses_oversized_calls_and_extra_streams_and_keeps_serving_the_kubelet() {
    let mut agent = Agent::start();
    let kubelet = MockKubelet::start(&agent.plugin_dir().join("kubelet.sock")).unwrap();
    assert!(
        kubelet.wait_for(1, Duration::from_secs(20)).await,
        "the agent did not register"
    );
    // The kubelet's stream, opened first as the kubelet does.
    let mut c = DevicePluginClient::new(kubelet::connect(&agent.socket()).await.unwrap());
    let mut stream = c.list_and_watch(Empty {}).await.unwrap().into_inner();
    assert_eq!(next_health(&mut stream).await, ["Healthy"; 4]);
    tokio::task::block_in_place(|| agent.wait_settled());

    // Allocate abuse.
    let (_, before) = {
        agent.reset_peak();
        agent.rss()
    };
    let sock = agent.socket().display().to_string();
    let out = tokio::task::spawn_blocking(move || {
        peer(
            "abuse_plugin.py",
            &["--proto", &proto(), "--socket", &sock, "allocate"],
        )
        .wait_with_output()
        .unwrap()
    })
    .await
    .unwrap();
    assert!(out.status.success(), "abuse_plugin.py allocate failed");
    let r = json(&String::from_utf8_lossy(&out.stdout));
    let code = |k: &str| r[k]["code"].as_str().unwrap_or_default().to_string();
    let details = |k: &str| r[k]["details"].as_str().unwrap_or_default().to_string();
    // Over the message limit: refused by its length prefix.
    assert_eq!(code("hundred_thousand_ids"), "OUT_OF_RANGE", "{r:#}");
    let big = r["hundred_thousand_ids"]["request_bytes"].as_u64().unwrap();
    assert_eq!(
        details("hundred_thousand_ids"),
        format!(
            "Error, decoded message length too large: found {big} bytes, the limit is: {} bytes",
            gpu_agent::plugin::server::MAX_REQUEST_BYTES
        )
    );
    // Under it: refused naming the count and the limit (the 4 GPUs).
    assert_eq!(code("hundred_thousand_short_ids"), "INVALID_ARGUMENT");
    assert_eq!(
        details("hundred_thousand_short_ids"),
        "nvidia.com/gpu: 100000 device IDs in one Allocate; this resource advertises 4, the most a request can name"
    );
    assert_eq!(code("long_id"), "INVALID_ARGUMENT");
    assert!(
        details("long_id").contains("a device ID of 524288 bytes")
            && details("long_id").contains("at most 256 bytes"),
        "{r:#}"
    );
    assert_eq!(code("duplicate_id"), "INVALID_ARGUMENT");
    assert!(
        details("duplicate_id").ends_with("requested twice"),
        "{r:#}"
    );
    assert_eq!(code("hundred_thousand_containers"), "INVALID_ARGUMENT");
    assert!(
        details("hundred_thousand_containers")
            .starts_with("nvidia.com/gpu: 100000 container requests in one Allocate; at most 4"),
        "{r:#}"
    );
    assert_eq!(code("preferred_hundred_thousand_ids"), "INVALID_ARGUMENT");
    assert!(
        details("preferred_hundred_thousand_ids").contains("100000 device IDs"),
        "{r:#}"
    );
    // And then a normal Allocate is served.
    assert_eq!(code("normal"), "OK", "{r:#}");
    assert_eq!(r["normal"]["response"], r["normal_id"]);
    agent.assert_alive();
    agent.assert_peak_bounded("Allocate abuse", before);

    // 2,000 ListAndWatch streams.
    agent.reset_peak();
    let (_, before) = agent.rss();
    let mut abuser = peer(
        "abuse_plugin.py",
        &[
            "--proto",
            &proto(),
            "--socket",
            &agent.socket().display().to_string(),
            "streams",
            "--streams",
            "2000",
            "--channels",
            "20",
        ],
    );
    let mut out = BufReader::new(abuser.stdout.take().unwrap());
    let first = tokio::task::block_in_place(|| line(&mut out, "streams"));
    let limit = gpu_agent::plugin::server::MAX_LIST_STREAMS as u64;
    // The kubelet holds one of the socket's streams.
    assert_eq!(first["served"], limit - 1, "{first}");
    assert_eq!(
        first["refused"]["RESOURCE_EXHAUSTED"],
        2000 - (limit - 1),
        "{first}"
    );
    assert_eq!(first["undecided"], 0, "{first}");
    assert_eq!(first["devices"], 4);
    assert_eq!(
        first["details"][0],
        format!(
            "nvidia.com/gpu: {limit} ListAndWatch streams are open on this socket, the most served at once"
        )
    );
    // The kubelet's stream still gets the news while the abuser holds its streams.
    agent.xid("GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a41 xid 79");
    assert_eq!(
        next_health(&mut stream).await,
        ["Healthy", "Unhealthy", "Healthy", "Healthy"]
    );
    // The socket is full: one more stream is refused, whoever asks...
    let more = c.list_and_watch(Empty {}).await.map(|_| ()).unwrap_err();
    assert_eq!(more.code(), tonic::Code::ResourceExhausted, "{more}");
    // ...and an Allocate is served.
    let list_ids = vec!["GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a40".to_string()];
    let alloc = c
        .allocate(gpu_agent_proto::deviceplugin::v1beta1::AllocateRequest {
            container_requests: vec![
                gpu_agent_proto::deviceplugin::v1beta1::ContainerAllocateRequest {
                    devices_ids: list_ids.clone(),
                },
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        alloc.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"],
        list_ids[0]
    );
    agent.assert_alive();
    agent.assert_peak_bounded("2,000 ListAndWatch streams", before);
    // The abuser leaves: its slots come back.
    drop(abuser.stdin.take());
    let closed = tokio::task::block_in_place(|| line(&mut out, "streams closed"));
    assert_eq!(closed["closed"], limit - 1);
    assert!(abuser.wait().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut again = loop {
        match c.list_and_watch(Empty {}).await {
            Ok(s) => break s.into_inner(),
            Err(e) => {
                assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e}");
                assert!(
                    Instant::now() < deadline,
                    "no stream served after the abuser left"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert_eq!(next_health(&mut again).await.len(), 4);
    kubelet.stop().await;
}

/// curl's scrape, or the reason it failed.
fn scrape(port: u16) -> Result<usize, String> {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "5", "-o", "-", "-w", "\n%{http_code}"])
        .arg(format!("http://127.0.0.1:{port}/metrics"))
        .output()
        .map_err(|e| format!("curl: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", ""));
    if code == "200" && body.contains("DCGM_FI_DEV_GPU_TEMP{") {
        Ok(body.len())
    } else {
        Err(format!(
            "curl: HTTP {code:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn wait_for_metrics(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(e) = scrape(port) {
        assert!(Instant::now() < deadline, "/metrics never answered: {e}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn metrics_endpoint_closes_slow_deaf_and_surplus_clients_and_keeps_answering_scrapes() {
    use gpu_agent::metrics::server::{MAX_CONNECTIONS, READ_TIMEOUT, WRITE_TIMEOUT};
    let mut agent = Agent::start();
    let port = agent.metrics_port;
    wait_for_metrics(port);
    agent.wait_settled();
    let port_arg = port.to_string();

    // Slowloris (a byte a second) and clients that pipeline 2,000 requests
    // and never read, for as long as both timeouts and a margin.
    agent.reset_peak();
    let (_, before) = agent.rss();
    let seconds = (READ_TIMEOUT.max(WRITE_TIMEOUT) + Duration::from_secs(4)).as_secs();
    let mut slow = peer(
        "abuse_metrics.py",
        &[
            "--port",
            &port_arg,
            "slow",
            "--slow",
            "8",
            "--deaf",
            "8",
            "--pipeline",
            "2000",
            "--seconds",
            &seconds.to_string(),
        ],
    );
    let mut out = BufReader::new(slow.stdout.take().unwrap());
    assert_eq!(line(&mut out, "slow")["opened"], 16);
    for _ in 0..3 {
        scrape(port).expect("a scrape while slow and deaf clients hold connections");
        std::thread::sleep(Duration::from_secs(1));
    }
    let r = line(&mut out, "slow report");
    assert!(slow.wait().unwrap().success());
    // Every slowloris closed by the header timeout (polled once a second).
    assert_eq!(r["slow"]["open"], 0, "{r}");
    for t in r["slow"]["closed"].as_array().unwrap() {
        let t = t.as_f64().unwrap();
        assert!(
            t >= READ_TIMEOUT.as_secs_f64() - 0.5 && t <= READ_TIMEOUT.as_secs_f64() + 2.5,
            "a slow client closed after {t} s, not at the header timeout: {r}"
        );
    }
    // Every deaf client was either closed by the write timeout after some
    // answers, or served in full (the kernel took every answer into its
    // receive buffer, which the agent does not hold).
    let deaf = &r["deaf"];
    for i in 0..8 {
        let (eof, answers) = (&deaf["eof"][i], deaf["answers"][i].as_u64().unwrap());
        assert!(
            (eof == true && answers > 0 && answers < 2000) || answers == 2000,
            "deaf client {i} neither closed nor served in full: {r}"
        );
    }
    scrape(port).expect("a scrape after the slow clients");
    agent.assert_alive();
    agent.assert_peak_bounded("slow and deaf /metrics clients", before);

    // A flood of idle connections: the newest take the place of the oldest,
    // at most MAX_CONNECTIONS stay open, and scrapes are answered.
    agent.reset_peak();
    let (_, before) = agent.rss();
    let mut flood = peer(
        "abuse_metrics.py",
        &[
            "--port",
            &port_arg,
            "flood",
            "--flood",
            "500",
            "--seconds",
            "2",
        ],
    );
    let mut out = BufReader::new(flood.stdout.take().unwrap());
    let r = line(&mut out, "flood");
    assert_eq!(r["opened"], 500, "{r}");
    assert_eq!(r["open"], MAX_CONNECTIONS as u64, "{r}");
    for _ in 0..3 {
        scrape(port).expect("a scrape while 32 idle connections are held");
    }
    drop(flood.stdin.take());
    assert!(flood.wait().unwrap().success());
    agent.assert_alive();
    agent.assert_peak_bounded("500 idle /metrics connections", before);
    // Nothing of it is left in the agent's descriptors.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let fds = fs::read_dir(format!("/proc/{}/fd", agent.child.id()))
            .unwrap()
            .count();
        if fds < 64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{fds} descriptors still open in the agent"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
