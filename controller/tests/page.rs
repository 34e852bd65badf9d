//! The fleet page in a real browser: headless Chromium (Debian's) loads
//! gpu-controller's page, whose script renders `/fleet.json`; the test
//! reads the DOM Chromium made. Two stand-in agents report: one healthy
//! node with a MIG layout, one with an unhealthy GPU (XID 79 and its
//! advice) whose reason carries markup that must show as text.

mod common;

use std::time::Duration;

use common::{MockApi, fake_agent, free_port, kubelet_node, start_controller, wait_for};
use gpu_agent_proto::report::v1 as pb;

fn report(node: u32, bad: Option<&str>) -> pb::NodeReport {
    let uuid = |g: u32| format!("GPU-{node}{g:07}-0000-0000-0000-000000000000");
    pb::NodeReport {
        inventory: Some(pb::Inventory {
            driver_version: "550.127.08".into(),
            cuda_version: "12.4".into(),
            gpus: (0..8)
                .map(|g| pb::Gpu {
                    index: g,
                    uuid: uuid(g),
                    model: "NVIDIA H100 80GB HBM3".into(),
                    memory_mib: 81559,
                    mig_enabled: node == 1,
                    mig_devices: if node == 1 {
                        ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
                            .iter()
                            .map(|p| pb::MigDevice {
                                uuid: format!("MIG-{g}-{p}"),
                                profile: p.to_string(),
                                ..Default::default()
                            })
                            .collect()
                    } else {
                        vec![]
                    },
                    ..Default::default()
                })
                .collect(),
            simulated: String::new(),
        }),
        stages: Some(pb::Stages {
            stages: ["driver", "devnodes", "runtime", "cdi", "plugin"]
                .iter()
                .map(|n| pb::Stage {
                    name: n.to_string(),
                    state: "done".into(),
                    validated: Some(true),
                    validation_message: "ok".into(),
                    ..Default::default()
                })
                .collect(),
            ready: true,
        }),
        health: Some(pb::Health {
            gpus: (0..8)
                .map(|g| pb::GpuHealth {
                    uuid: uuid(g),
                    healthy: !(bad.is_some() && g == 3),
                    reason: if g == 3 {
                        bad.unwrap_or("").into()
                    } else {
                        String::new()
                    },
                    advice: if bad.is_some() && g == 3 {
                        "drain and reboot the node".into()
                    } else {
                        String::new()
                    },
                    ..Default::default()
                })
                .collect(),
        }),
        mig: Some(if node == 1 {
            pb::MigState {
                layout: "all-balanced".into(),
                state: "success".into(),
                detail: "GPUs 0-7: 3g.40gb, 2g.20gb, 1g.10gb x2".into(),
            }
        } else {
            Default::default()
        }),
        ..Default::default()
    }
}

#[test]
fn the_fleet_page_renders_in_chromium() {
    common::chromium_path();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    let account = "system:serviceaccount:gpu-agent:gpu-agent";
    for n in [1, 2] {
        api.add_node(&format!("gpu-node-{n}"), kubelet_node());
        api.add_token(&format!("t{n}"), account, &format!("gpu-node-{n}"));
    }
    let dir = tempfile::tempdir().unwrap();
    let http = free_port();
    let (mut controller, port, ca) = start_controller(&api, dir.path(), Some(http));
    let markup = "XID 79 <img src=x onerror=alert(1)>";
    let _agents = rt.block_on(async {
        let a = fake_agent(port, &ca, "t1", "gpu-node-1", report(1, None), vec![]).await;
        let b = fake_agent(
            port,
            &ca,
            "t2",
            "gpu-node-2",
            report(2, Some(markup)),
            vec![pb::HealthEvent {
                gpu_uuid: "GPU-20000003-0000-0000-0000-000000000000".into(),
                xid: 79,
                reason: "XID 79, from the kernel log: GPU has fallen off the bus".into(),
                advice: "drain and reboot the node".into(),
                unhealthy: true,
                at_unix_ms: 1_795_590_000_000,
            }],
        )
        .await;
        (a, b)
    });
    // Both reported (the JSON the page reads says so).
    let json = || {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", http)).unwrap();
        use std::io::{Read, Write};
        write!(
            s,
            "GET /fleet.json HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    wait_for(
        "two nodes in fleet.json",
        Duration::from_secs(20),
        &[&controller],
        || json().contains("\"connected\":2"),
    );
    let shot = dir.path().join("fleet.png");
    let url = format!("http://127.0.0.1:{http}/");
    let run = |extra: &[&str]| common::chromium(extra, &url, "1400,700");
    let out = run(&["--dump-dom"]);
    let dom = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        dom.contains("data-loaded=\"yes\""),
        "the page's script did not render the fleet:\n{dom}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in [
        "2 nodes · 2 reporting · 16 GPUs · 1 unhealthy",
        "gpu-node-1",
        "all-balanced: success",
        "GPUs 0-7: 3g.40gb, 2g.20gb, 1g.10gb x2",
        "550.127.08 · CUDA 12.4",
        "8 × NVIDIA H100 80GB HBM3",
        "7/8 healthy",
        "2026-11-25 07:00:00 XID 79, from the kernel log: GPU has fallen off the bus on GPU-20000003-0000-0000-0000-000000000000 — drain and reboot the node",
        "GPUHealthy False",
        "8/8 healthy",
    ] {
        assert!(
            dom.contains(want),
            "the page does not show {want:?}:\n{dom}"
        );
    }
    // What an agent says is text, never markup.
    assert!(
        dom.contains("XID 79 &lt;img src=x onerror=alert(1)&gt;"),
        "{dom}"
    );
    assert!(
        !dom.contains("<img"),
        "agent-supplied markup became an element:\n{dom}"
    );
    // A picture for people (not asserted): target/fleet-page.png.
    let shot_out = run(&[&format!("--screenshot={}", shot.display())]);
    if shot.exists() {
        let _ = std::fs::copy(&shot, common::repo().join("target/fleet-page.png"));
    } else {
        eprintln!(
            "no screenshot: {}",
            String::from_utf8_lossy(&shot_out.stderr)
        );
    }
    controller.term();
}
