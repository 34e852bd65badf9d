//! Metrics benchmark (run by hand: `cargo bench -p gpu-agent --bench metrics`).
//!
//! - render: one scrape's text for 8 GPUs (the 8x H100 simulated node,
//!   every default field) with 32 containers holding time-sliced replicas
//!   (4 per GPU), p50/p99 over 2000 renders (target ≤ 5 ms);
//! - one NVML sampling pass over 8 GPUs through nvml-wrapper against the
//!   fake libnvidia-ml, thread CPU and wall clock p50/p99 over 300 passes of
//!   the default fields and 100 of every field gpu-agent exports;
//! - the whole agent: `gpu-agent run` (this profile's binary) on a copy of
//!   the 8x H100 host fixture with the fake libnvidia-ml, scraped every 15 s
//!   (so sampling runs every second) for 60 s: its CPU time over that minute
//!   as a share of one core (target ≤ 1%) and its RSS growth from the first
//!   scrape to the last (target ≤ 2 MiB).

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use gpu_agent::backend::nvml::NvmlBackend;
use gpu_agent::backend::{GpuBackend, Sample};
use gpu_agent::metrics::agent::AgentSeries;
use gpu_agent::metrics::fields::FieldSet;
use gpu_agent::metrics::pods::{PodMap, PodRef};
use gpu_agent::metrics::render::{Scrape, render};

#[path = "../tests/common/mod.rs"]
mod common;
mod support;
use support::{ms, pct, thread_cpu};

fn report(what: &str, mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort();
    let (p50, p99) = (pct(&v, 0.5), pct(&v, 0.99));
    println!("{what:<52} p50 {:7.3} ms  p99 {:7.3} ms", ms(p50), ms(p99));
    (p50, p99)
}

fn render_cost() {
    let (_d, sys, backend) = {
        let dir = tempfile::tempdir().unwrap();
        let node = simnode::NodeDescription::load("h100-sxm-8").unwrap();
        node.materialize(dir.path()).unwrap();
        let sys = hostlib::HostRoot::new(dir.path()).unwrap();
        (
            dir,
            sys,
            gpu_agent::backend::sim::SimulatedBackend::new(node),
        )
    };
    let inv = gpu_agent::inventory::discover(&sys, &backend);
    let fields = FieldSet::default();
    let sample: Sample = backend.sampler().unwrap().sample(&fields).unwrap();
    let mut pods = PodMap::default();
    for (i, g) in inv.gpus.iter().enumerate() {
        let v = (0..4)
            .map(|k| PodRef {
                pod: format!("trainer-{i}-{k}"),
                namespace: "ml".into(),
                container: "main".into(),
            })
            .collect();
        pods.by_uuid.insert(g.uuid.clone().unwrap(), v);
    }
    let agent = AgentSeries {
        stages: (0..10)
            .map(|i| (format!("stage{i}"), "done".to_string()))
            .collect(),
        ..Default::default()
    };
    let scrape = Scrape {
        sample: &sample,
        inventory: &inv,
        pods: &pods,
        fields: &fields,
        hostname: "gpu-node-17",
        agent: &agent,
    };
    let bytes = render(&scrape).len();
    let mut v = Vec::new();
    for _ in 0..2000 {
        let t = Instant::now();
        std::hint::black_box(render(&scrape));
        v.push(t.elapsed());
    }
    let (_, p99) = report(
        &format!("render: 8 GPUs, 32 pods ({} KiB)", bytes / 1024),
        v,
    );
    println!(
        "  target ≤ 5 ms: {}",
        if p99 <= Duration::from_millis(5) {
            "met"
        } else {
            "NOT met"
        }
    );
}

fn sample_cost(lib: &std::path::Path) {
    // SAFETY: set before NVML is loaded, while this is the only thread.
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("FAKE_NVML_NODE", "h100-sxm-8")
    };
    let backend = NvmlBackend::open(Some(lib)).unwrap();
    let mut sampler = backend.sampler().unwrap();
    let fields = FieldSet::default();
    let mut v = Vec::new();
    let mut wall = Vec::new();
    for _ in 0..300 {
        let (t, w) = (thread_cpu(), Instant::now());
        let s = sampler.sample(&fields).unwrap();
        v.push(thread_cpu() - t);
        wall.push(w.elapsed());
        assert_eq!(s.gpus.len(), 8);
    }
    report("one NVML sampling pass, 8 GPUs (thread CPU)", v);
    report("  the same pass, wall clock", wall);
    // Every field dcgm-exporter's files name, commented lines too: the
    // clock-throttle counters cost what nvmlDeviceGetViolationStatus cost on
    // the real H100 (0.74 ms each, 6 a GPU), waited mostly asleep.
    let every = FieldSet::every();
    let mut v = Vec::new();
    let mut wall = Vec::new();
    for _ in 0..100 {
        let (t, w) = (thread_cpu(), Instant::now());
        let s = sampler.sample(&every).unwrap();
        v.push(thread_cpu() - t);
        wall.push(w.elapsed());
        assert_eq!(s.gpus.len(), 8);
    }
    report(
        &format!(
            "one NVML sampling pass, 8 GPUs, all {} fields (thread CPU)",
            every.fields.len()
        ),
        v,
    );
    report("  the same pass, wall clock", wall);
}

/// utime + stime of `pid`, and its RSS in KiB.
fn proc_usage(pid: u32) -> (Duration, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .unwrap()
        .unwrap() as u64;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
        .unwrap();
    (Duration::from_millis(ticks * 1000 / hz), rss)
}

fn scrape(port: u16) -> usize {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: bench\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.0 200") || out.starts_with("HTTP/1.1 200"));
    out.len()
}

fn whole_agent(lib: &std::path::Path) {
    let host = tempfile::tempdir().unwrap();
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    assert!(
        std::process::Command::new("cp")
            .arg("-a")
            .arg(repo.join("tests/fixtures/hosts/h100-sxm-8/."))
            .arg(host.path())
            .status()
            .unwrap()
            .success()
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let policy = host.path().join("bench-policy.yaml");
    std::fs::write(
        &policy,
        format!(
            "spec:\n  toolkit: {{enabled: false}}\n  devicePlugin: {{enabled: false}}\n  dcgmExporter: {{listen: \"127.0.0.1:{port}\"}}\n"
        ),
    )
    .unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-agent"))
        .arg("--host-root")
        .arg(host.path())
        .arg("--policy")
        .arg(&policy)
        .arg("--nvml-lib")
        .arg(lib)
        .args(["run", "--heartbeat", "0"])
        .env("FAKE_NVML_NODE", "h100-sxm-8")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "the agent did not serve /metrics"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let bytes = scrape(port);
    std::thread::sleep(Duration::from_secs(2));
    let (cpu0, rss0) = proc_usage(child.id());
    let t0 = Instant::now();
    for _ in 0..4 {
        std::thread::sleep(Duration::from_secs(15));
        scrape(port);
    }
    let (cpu1, rss1) = proc_usage(child.id());
    let wall = t0.elapsed();
    let _ = child.kill();
    let _ = child.wait();
    let share = (cpu1 - cpu0).as_secs_f64() / wall.as_secs_f64() * 100.0;
    println!(
        "gpu-agent run, sampling every 1 s, scraped every 15 s ({} KiB a scrape), {:.0} s:",
        bytes / 1024,
        wall.as_secs_f64()
    );
    println!(
        "  CPU {:.0} ms = {share:.2}% of one core (target ≤ 1%: {})",
        ms(cpu1 - cpu0),
        if share <= 1.0 { "met" } else { "NOT met" }
    );
    let growth = rss1 as i64 - rss0 as i64;
    println!(
        "  RSS {rss0} KiB → {rss1} KiB, growth {growth} KiB (target ≤ 2048 KiB: {})",
        if growth <= 2048 { "met" } else { "NOT met" }
    );
}

fn main() {
    println!("gpu-agent metrics benchmark");
    println!("NVML: the fake libnvidia-ml, {}", support::nvml_costs());
    let (_dir, lib) = common::fake_nvml();
    sample_cost(&lib);
    render_cost();
    whole_agent(&lib);
}
