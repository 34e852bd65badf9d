//! Health end to end: `gpu-agent run` with the real NVML backend against the
//! fake libnvidia-ml, events injected through its events file, seen by a
//! kubelet's ListAndWatch stream (unhealthy, then healthy again).

mod common;

use std::fs;
use std::io::Write;
use std::time::{Duration, Instant};

use common::*;
use gpu_agent::plugin::kubelet::{self, MockKubelet};
use gpu_agent_proto::deviceplugin::v1beta1::Empty;
use gpu_agent_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use tokio_stream::StreamExt;

fn health_of(list: &gpu_agent_proto::deviceplugin::v1beta1::ListAndWatchResponse) -> Vec<&str> {
    list.devices.iter().map(|d| d.health.as_str()).collect()
}

type Stream = tonic::Streaming<gpu_agent_proto::deviceplugin::v1beta1::ListAndWatchResponse>;

async fn next(s: &mut Stream) -> gpu_agent_proto::deviceplugin::v1beta1::ListAndWatchResponse {
    tokio::time::timeout(Duration::from_secs(10), s.next())
        .await
        .expect("no ListAndWatch update")
        .unwrap()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_makes_a_gpu_unhealthy_and_it_recovers() {
    let (host, events) = plugin_host("t4-4");
    let plugin_dir = host.path().join("var/lib/kubelet/device-plugins");
    let policy = host.path().join("policy.yaml");
    // Unhealthy for 3 s after an XID: long enough for `status` to be asked
    // on a loaded machine (1 s was missed once in CI).
    fs::write(&policy, "spec:\n  health:\n    recoverAfterSeconds: 3\n").unwrap();
    let (_lib_dir, lib) = fake_nvml();
    let kubelet = MockKubelet::start(&plugin_dir.join("kubelet.sock")).unwrap();
    let mut child = at(host.path())
        .arg("--nvml-lib")
        .arg(&lib)
        .arg("--policy")
        .arg(&policy)
        .args(["run", "--heartbeat", "1"])
        .env("FAKE_NVML_NODE", "t4-4")
        .env("FAKE_NVML_EVENTS", &events)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    assert!(
        kubelet.wait_for(1, Duration::from_secs(10)).await,
        "the agent did not register"
    );
    let mut c = DevicePluginClient::new(
        kubelet::connect(&plugin_dir.join("nvidia-gpu.sock"))
            .await
            .unwrap(),
    );
    let mut stream = c.list_and_watch(Empty {}).await.unwrap().into_inner();
    assert_eq!(health_of(&next(&mut stream).await), ["Healthy"; 4]);

    let append = |line: &str| {
        let mut f = fs::OpenOptions::new().append(true).open(&events).unwrap();
        writeln!(f, "{line}").unwrap();
    };
    // XID 13 is ignored by default; XID 79 (fallen off the bus) is critical.
    append("GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a41 xid 13");
    let t0 = Instant::now();
    append("GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a41 xid 79");
    let update = next(&mut stream).await;
    let latency = t0.elapsed();
    assert_eq!(
        health_of(&update),
        ["Healthy", "Unhealthy", "Healthy", "Healthy"]
    );
    eprintln!("XID written -> ListAndWatch update: {latency:?}");

    // status (next heartbeat) names the GPU and the reason.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, out, _) = run(at(host.path()).args(["status", "-o", "json"]));
        let st = json(&out);
        let health = st["stages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["stage"] == "health")
            .unwrap()["detail"]
            .clone();
        if health
            .as_str()
            .unwrap()
            .contains("GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a41 (XID 79, from NVML)")
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "status never showed the XID: {health}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Three seconds past the last critical event the GPU is healthy again.
    assert_eq!(health_of(&next(&mut stream).await), ["Healthy"; 4]);

    // A failed wait: nobody's health is known, every GPU is unhealthy until
    // NVML answers again (the next wait times out normally).
    append("fail");
    assert_eq!(health_of(&next(&mut stream).await), ["Unhealthy"; 4]);
    assert_eq!(health_of(&next(&mut stream).await), ["Healthy"; 4]);

    // Double-bit ECC on GPU 3, by index.
    append("3 dbe");
    assert_eq!(
        health_of(&next(&mut stream).await),
        ["Healthy", "Healthy", "Healthy", "Unhealthy"]
    );

    assert_eq!(sigterm(&mut child), Some(0));
    kubelet.stop().await;
}
