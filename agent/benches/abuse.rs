//! Abuse figures (run by hand: `cargo bench -p gpu-agent --bench abuse`).
//!
//! `gpu-agent run` (this profile's binary) on a simulated 8x H100 node; the
//! abusers are the Python peers of agent/tests/abuse.rs (grpcio, raw
//! sockets) and curl. For each abuse: what was served and refused, how long
//! it took, the agent's RSS before and its peak during (VmHWM, reset by
//! clear_refs before each abuse), and curl's scrape times meanwhile.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[path = "../tests/common/mod.rs"]
mod common;
mod support;
use support::{ms, pct};

struct Agent {
    child: Child,
    host: tempfile::TempDir,
    port: u16,
}

impl Agent {
    fn start() -> Agent {
        let host = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(host.path().join("var/lib/kubelet/device-plugins")).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(env!("CARGO_BIN_EXE_gpu-agent"))
            .arg("--host-root")
            .arg(host.path())
            .args(["--simulate", "h100-sxm-8", "run"])
            .env("DCGM_EXPORTER_LISTEN", format!("127.0.0.1:{port}"))
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let agent = Agent { child, host, port };
        // Settled: the CDI stage (the copy of our own binary) is the startup's peak.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let out = Command::new(env!("CARGO_BIN_EXE_gpu-agent"))
                .arg("--host-root")
                .arg(agent.host.path())
                .args(["status", "-o", "json"])
                .output()
                .unwrap();
            let st: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            let settled = st["stages"].as_array().is_some_and(|s| {
                s.iter()
                    .any(|s| s["stage"] == "cdi" && s["state"] == "done")
            }) && agent.socket().exists();
            if settled {
                break;
            }
            assert!(Instant::now() < deadline, "the agent never settled");
            std::thread::sleep(Duration::from_millis(100));
        }
        agent
    }

    fn socket(&self) -> PathBuf {
        self.host
            .path()
            .join("var/lib/kubelet/device-plugins/nvidia-gpu.sock")
    }

    /// (VmRSS, VmHWM) in KiB.
    fn rss(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let field = |name: &str| -> u64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap()
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    /// Resets the peak and returns the RSS now.
    fn begin(&self) -> u64 {
        std::fs::write(format!("/proc/{}/clear_refs", self.child.id()), "5").unwrap();
        self.rss().0
    }

    fn report(&self, what: &str, before: u64, took: Duration, outcome: &str) {
        let (now, peak) = self.rss();
        println!(
            "{what:<44} {:>8.0} ms  RSS before {:>6.1} MiB, peak {:>6.1} MiB (+{:.1}), after {:>6.1} MiB  {outcome}",
            ms(took),
            before as f64 / 1024.0,
            peak as f64 / 1024.0,
            peak.saturating_sub(before) as f64 / 1024.0,
            now as f64 / 1024.0
        );
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = common::sigterm(&mut self.child);
    }
}

fn peer(script: &str, args: &[&str]) -> Child {
    Command::new(common::python())
        .arg(common::repo().join("tests/interop").join(script))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

fn line(out: &mut impl BufRead) -> serde_json::Value {
    let mut l = String::new();
    out.read_line(&mut l).unwrap();
    serde_json::from_str(&l).unwrap_or_else(|e| panic!("{e}: {l:?}"))
}

fn proto() -> String {
    common::repo()
        .join("proto/proto/deviceplugin_v1beta1.proto")
        .display()
        .to_string()
}

/// curl's time for one scrape, or None when it failed.
fn scrape(port: u16) -> Option<Duration> {
    let t = Instant::now();
    let out = Command::new("curl")
        .args(["-sf", "--max-time", "5", "-o", "/dev/null"])
        .arg(format!("http://127.0.0.1:{port}/metrics"))
        .status()
        .ok()?;
    out.success().then(|| t.elapsed())
}

/// Scrapes every 200 ms while `busy` runs; (answered, failed, p50, max).
fn scrapes_during<T>(port: u16, busy: impl FnOnce() -> T) -> (T, String) {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = stop.clone();
    let scraper = std::thread::spawn(move || {
        let mut times = Vec::new();
        let mut failed = 0;
        while !s.load(std::sync::atomic::Ordering::Relaxed) {
            match scrape(port) {
                Some(t) => times.push(t),
                None => failed += 1,
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        times.sort();
        if times.is_empty() {
            return format!("scrapes: 0 answered, {failed} failed");
        }
        format!(
            "scrapes: {} answered, {failed} failed, p50 {:.1} ms, max {:.1} ms",
            times.len(),
            ms(pct(&times, 0.5)),
            ms(*times.last().unwrap())
        )
    });
    let r = busy();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    (r, scraper.join().unwrap())
}

fn allocate(agent: &Agent) {
    let before = agent.begin();
    let t = Instant::now();
    let out = peer(
        "abuse_plugin.py",
        &[
            "--proto",
            &proto(),
            "--socket",
            &agent.socket().display().to_string(),
            "allocate",
        ],
    )
    .wait_with_output()
    .unwrap();
    let took = t.elapsed();
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let codes: Vec<String> = [
        "hundred_thousand_ids",
        "hundred_thousand_short_ids",
        "long_id",
        "duplicate_id",
        "hundred_thousand_containers",
        "preferred_hundred_thousand_ids",
        "normal",
    ]
    .iter()
    .map(|k| {
        format!(
            "{k}={}({})",
            r[k]["code"].as_str().unwrap_or("?"),
            r[k]["request_bytes"]
        )
    })
    .collect();
    agent.report("Allocate abuse (7 calls, python grpcio)", before, took, "");
    println!("    {}", codes.join(" "));
}

fn streams(agent: &Agent, n: usize, channels: usize) {
    let before = agent.begin();
    let t = Instant::now();
    let mut p = peer(
        "abuse_plugin.py",
        &[
            "--proto",
            &proto(),
            "--socket",
            &agent.socket().display().to_string(),
            "streams",
            "--streams",
            &n.to_string(),
            "--channels",
            &channels.to_string(),
        ],
    );
    let mut out = BufReader::new(p.stdout.take().unwrap());
    let r = line(&mut out);
    let took = t.elapsed();
    // Held for a second, then released.
    std::thread::sleep(Duration::from_secs(1));
    agent.report(
        &format!("{n} ListAndWatch streams over {channels} conns"),
        before,
        took,
        &format!(
            "served {} refused {} (decided in the time shown; held 1 s)",
            r["served"], r["refused"]
        ),
    );
    drop(p.stdin.take());
    let _ = line(&mut out);
    p.wait().unwrap();
}

fn metrics_slow(agent: &Agent) {
    let before = agent.begin();
    let port = agent.port.to_string();
    let t = Instant::now();
    let (r, scrapes) = scrapes_during(agent.port, || {
        let mut p = peer(
            "abuse_metrics.py",
            &[
                "--port",
                &port,
                "slow",
                "--slow",
                "16",
                "--deaf",
                "8",
                "--seconds",
                "13",
            ],
        );
        let mut out = BufReader::new(p.stdout.take().unwrap());
        let _ = line(&mut out);
        let r = line(&mut out);
        p.wait().unwrap();
        r
    });
    let deaf = &r["deaf"];
    agent.report(
        "/metrics: 16 slowloris + 8 deaf (2000 pipelined)",
        before,
        t.elapsed(),
        &format!(
            "slow closed at {} s; deaf closed {} (answers {}); {scrapes}",
            r["slow"]["closed"], deaf["closed"], deaf["answers"]
        ),
    );
}

fn metrics_flood(agent: &Agent, n: usize) {
    let before = agent.begin();
    let port = agent.port.to_string();
    let t = Instant::now();
    let (r, scrapes) = scrapes_during(agent.port, || {
        let mut p = peer(
            "abuse_metrics.py",
            &[
                "--port",
                &port,
                "flood",
                "--flood",
                &n.to_string(),
                "--seconds",
                "2",
            ],
        );
        let mut out = BufReader::new(p.stdout.take().unwrap());
        let r = line(&mut out);
        std::thread::sleep(Duration::from_secs(2));
        drop(p.stdin.take());
        p.wait().unwrap();
        r
    });
    agent.report(
        &format!("/metrics: {n} idle connections at once"),
        before,
        t.elapsed(),
        &format!(
            "open {} closed by the agent {}; {scrapes}",
            r["open"], r["closed_by_server"]
        ),
    );
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let agent = Agent::start();
    let (rss, _) = agent.rss();
    println!(
        "gpu-agent --simulate h100-sxm-8 run, settled: RSS {:.1} MiB",
        rss as f64 / 1024.0
    );
    allocate(&agent);
    streams(&agent, 2000, 20);
    streams(&agent, 10_000, 100);
    metrics_slow(&agent);
    metrics_flood(&agent, 2000);
    let (rss, _) = agent.rss();
    println!("after every abuse: RSS {:.1} MiB", rss as f64 / 1024.0);
}
