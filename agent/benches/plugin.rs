//! Device-plugin benchmark (run by hand: `cargo bench -p gpu-agent --bench plugin`).
//!
//! Over real Unix sockets with a mock kubelet, simulated 8x H100:
//! - Allocate latency, p50/p99, for 1 and for 8 devices;
//! - XID event (simulated backend) → health monitor → ListAndWatch update latency;
//! - re-registration time after a kubelet restart;
//! - RSS of `gpu-agent run` serving 8 GPUs x 4 replicas.
//!
//! Targets (issue 3): Allocate p99 ≤ 1 ms, health → update ≤ 50 ms,
//! re-registration ≤ 1 s, RSS ≤ 20 MiB.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_agent::backend::sim::SimulatedBackend;
use gpu_agent::backend::{GpuBackend, HealthEvent};
use gpu_agent::health::{HealthMonitor, HealthPolicy};
use gpu_agent::inventory;
use gpu_agent::plugin::kubelet::{self, MockKubelet};
use gpu_agent::plugin::manager::{KUBELET_SOCKET, PluginManager};
use gpu_agent::plugin::resources::{self, PluginSettings};
use gpu_agent_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use gpu_agent_proto::deviceplugin::v1beta1::{AllocateRequest, ContainerAllocateRequest, Empty};
use hostlib::HostRoot;
use tokio_stream::StreamExt;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn report(what: &str, mut samples: Vec<Duration>, target: Duration) {
    samples.sort();
    let p50 = percentile(&samples, 0.50);
    let p99 = percentile(&samples, 0.99);
    let max = *samples.last().unwrap();
    let verdict = if p99 <= target { "meets" } else { "MISSES" };
    println!(
        "{what:<44} n={:<5} p50 {:>9.3} ms  p99 {:>9.3} ms  max {:>9.3} ms  ({verdict} target p99 <= {} ms)",
        samples.len(),
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3,
        max.as_secs_f64() * 1e3,
        target.as_secs_f64() * 1e3
    );
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let dir = tempfile::tempdir().unwrap();
    let desc = simnode::NodeDescription::load("h100-sxm-8").unwrap();
    desc.materialize(dir.path()).unwrap();
    let host = HostRoot::new(dir.path()).unwrap();
    let backend = SimulatedBackend::new(desc);
    let inv = Arc::new(inventory::discover(&host, &backend).unwrap());
    let plugin_dir = dir.path().join("var/lib/kubelet/device-plugins");
    std::fs::create_dir_all(&plugin_dir).unwrap();
    let ksock = plugin_dir.join(KUBELET_SOCKET);
    let mut mock = MockKubelet::start(&ksock).unwrap();

    let settings = PluginSettings::default();
    let res = resources::build(&inv, &settings).unwrap();
    let mgr = PluginManager::new(
        plugin_dir.clone(),
        res,
        inv.clone(),
        Arc::new(settings),
        host.clone(),
    );
    let senders = mgr.resource_senders();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(mgr.run(async {
        let _ = stopped.await;
    }));
    assert!(mock.wait_for(1, Duration::from_secs(5)).await);
    let sock = plugin_dir.join("nvidia-gpu.sock");
    let mut client = DevicePluginClient::new(kubelet::connect(&sock).await.unwrap());
    let mut stream = client.list_and_watch(Empty {}).await.unwrap().into_inner();
    let ids: Vec<String> = stream
        .next()
        .await
        .unwrap()
        .unwrap()
        .devices
        .into_iter()
        .map(|d| d.id)
        .collect();

    println!(
        "gpu-agent device-plugin benchmark: simulated 8x H100, mock kubelet, Unix sockets, release build\n"
    );
    for n in [1usize, 8] {
        let req = AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: ids[..n].to_vec(),
            }],
        };
        for _ in 0..200 {
            client.allocate(req.clone()).await.unwrap();
        }
        let mut samples = Vec::with_capacity(5000);
        for _ in 0..5000 {
            let t = Instant::now();
            client.allocate(req.clone()).await.unwrap();
            samples.push(t.elapsed());
        }
        report(
            &format!("Allocate, {n} device(s)"),
            samples,
            Duration::from_millis(1),
        );
    }

    // Health: an event from the (simulated) backend goes through the health
    // monitor to the plugin's ListAndWatch stream. Recovery after 0 s, so
    // each event is followed by a recovery update on the monitor's next tick.
    let (htx, hrx) = tokio::sync::mpsc::unbounded_channel();
    backend.watch_health(htx).unwrap();
    let policy = HealthPolicy {
        recover_after: Some(Duration::ZERO),
        ..HealthPolicy::default()
    };
    let uuids: Vec<String> = inv.gpus.iter().filter_map(|g| g.uuid.clone()).collect();
    let monitor = HealthMonitor::new(policy, uuids.clone(), senders.values().cloned().collect());
    let (hstop, hstopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(monitor.run(hrx, async {
        let _ = hstopped.await;
    }));
    let mut samples = Vec::new();
    for i in 0..100 {
        let t = Instant::now();
        backend.inject(HealthEvent::Xid {
            uuid: uuids[i % 8].clone(),
            xid: 79,
        });
        let update = stream.next().await.unwrap().unwrap();
        samples.push(t.elapsed());
        assert!(update.devices.iter().any(|d| d.health == "Unhealthy"));
        // The recovery update, before the next event.
        stream.next().await.unwrap().unwrap();
    }
    let _ = hstop.send(());
    report(
        "XID event -> ListAndWatch update",
        samples,
        Duration::from_millis(50),
    );

    let mut samples = Vec::new();
    for _ in 0..100 {
        mock.stop().await;
        for e in std::fs::read_dir(&plugin_dir).unwrap() {
            let _ = std::fs::remove_file(e.unwrap().path());
        }
        let t = Instant::now();
        mock = MockKubelet::start(&ksock).unwrap();
        assert!(
            mock.wait_for(1, Duration::from_secs(5)).await,
            "no re-registration"
        );
        samples.push(t.elapsed());
    }
    report(
        "re-registration after kubelet restart",
        samples,
        Duration::from_secs(1),
    );
    let _ = stop.send(());
    let _ = task.await;
    mock.stop().await;

    rss_of_the_agent().await;
}

/// Starts the release `gpu-agent run` with 8 GPUs x 4 replicas against a
/// mock kubelet and reads its RSS once it has registered.
async fn rss_of_the_agent() {
    let bin = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("gpu-agent");
    if !bin.exists() {
        println!(
            "RSS: {} not built (cargo build --release -p gpu-agent), skipped",
            bin.display()
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let plugin_dir = dir.path().join("var/lib/kubelet/device-plugins");
    std::fs::create_dir_all(&plugin_dir).unwrap();
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        "spec:\n  devicePlugin:\n    config:\n      inline:\n        version: v1\n        sharing:\n          timeSlicing:\n            resources:\n            - {name: nvidia.com/gpu, replicas: 4}\n",
    )
    .unwrap();
    let mock = MockKubelet::start(&plugin_dir.join(KUBELET_SOCKET)).unwrap();
    let mut child = std::process::Command::new(&bin)
        .arg("--host-root")
        .arg(dir.path())
        .arg("--policy")
        .arg(&policy)
        .args(["--simulate", "h100-sxm-8", "run"])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    assert!(
        mock.wait_for(1, Duration::from_secs(10)).await,
        "the agent did not register"
    );
    let devices = {
        let mut c = DevicePluginClient::new(
            kubelet::connect(&plugin_dir.join("nvidia-gpu.sock"))
                .await
                .unwrap(),
        );
        c.list_and_watch(Empty {})
            .await
            .unwrap()
            .into_inner()
            .next()
            .await
            .unwrap()
            .unwrap()
            .devices
            .len()
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let rss = field("VmRSS:");
    println!(
        "{:<44} {} KiB ({:.1} MiB), peak {} KiB, serving {devices} devices ({} target <= 20 MiB)",
        "RSS of gpu-agent run, 8 GPUs x 4 replicas",
        rss,
        rss as f64 / 1024.0,
        field("VmHWM:"),
        if rss <= 20 * 1024 { "meets" } else { "MISSES" }
    );
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = child.wait();
    mock.stop().await;
}
