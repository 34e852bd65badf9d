//! Bounded under abuse, the controller's side: report messages larger than
//! the controller takes (`server::MAX_MESSAGE`), sent by a client we did
//! not write (Python grpcio over TLS, tests/interop/abuse_report.py), cut
//! their stream off with a status naming the size and the limit, and the
//! controller goes on serving: an agent attached before keeps its node
//! written, a new stream afterwards gets its Desired and its labels land.
//!
//! This tests the limit as it is (controller/src/server.rs is not changed
//! here).

mod common;

use std::time::Duration;

use common::{
    MockApi, fake_agent, free_port, kubelet_node, python, repo, start_controller, wait_for,
};
use gpu_agent_proto::report::v1 as pb;
use serde_json::Value;

#[test]
fn oversized_report_messages_are_cut_off_and_the_controller_serves_the_others() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    let account = "system:serviceaccount:gpu-agent:gpu-agent";
    api.add_node("py-node", kubelet_node());
    api.add_node("steady-node", kubelet_node());
    api.add_token("py-token", account, "py-node");
    api.add_token("steady-token", account, "steady-node");
    let dir = tempfile::tempdir().unwrap();
    let http = free_port();
    let (mut controller, port, ca) = start_controller(&api, dir.path(), Some(http));

    // An agent attached before the abuse, holding its stream.
    let report = pb::NodeReport {
        labels: Some(pb::Labels {
            labels: [("nvidia.com/gpu.product".to_string(), "Steady-GPU".into())].into(),
        }),
        ..Default::default()
    };
    let _steady = rt
        .block_on(fake_agent(
            port,
            &ca,
            "steady-token",
            "steady-node",
            report,
            vec![],
        ))
        .expect("the steady agent is served");
    wait_for(
        "the steady agent's labels",
        Duration::from_secs(20),
        &[&controller],
        || api.node("steady-node")["metadata"]["labels"]["nvidia.com/gpu.product"] == "Steady-GPU",
    );

    let out = std::process::Command::new(python())
        .arg(repo().join("tests/interop/abuse_report.py"))
        .arg("--proto")
        .arg(repo().join("proto/proto/report_v1.proto"))
        .arg("--ca")
        .arg(&ca)
        .args(["--target", &format!("localhost:{port}")])
        .args(["--node", "py-node", "--token", "py-token", "--mib", "8"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "abuse_report.py: {stdout}\n{}\ncontroller:\n{}",
        String::from_utf8_lossy(&out.stderr),
        controller.log()
    );
    let seen: Value = serde_json::from_str(stdout.trim()).unwrap();
    let limit = gpu_controller::server::MAX_MESSAGE;
    for case in ["huge_hello", "huge_snapshot"] {
        let r = &seen[case];
        let sent = r["bytes"].as_u64().unwrap();
        assert!(sent > limit as u64, "{case}: {r}");
        assert_eq!(r["code"], "OUT_OF_RANGE", "{case}: {seen:#}");
        // tonic's words, with the message's size and the limit.
        let details = r["details"].as_str().unwrap();
        assert!(
            details.starts_with("Error, decoded message length too large: found ")
                && details.ends_with(&format!("the limit is: {limit} bytes")),
            "{case}: {details}"
        );
    }
    // The huge Hello gets nothing down; the huge snapshot only the Desired
    // answering its Hello.
    assert_eq!(seen["huge_hello"]["down"], serde_json::json!([]));
    assert!(
        seen["huge_snapshot"]["down"]
            .as_array()
            .unwrap()
            .iter()
            .all(|k| k == "desired"),
        "{seen:#}"
    );
    // And the controller goes on: a new stream is served...
    assert_eq!(seen["normal"]["code"], "OK", "{seen:#}");
    assert_eq!(seen["normal"]["down"], serde_json::json!(["desired"]));
    wait_for(
        "the normal stream's labels",
        Duration::from_secs(20),
        &[&controller],
        || {
            api.node("py-node")["metadata"]["labels"]["nvidia.com/gpu.product"]
                == "Python-Abuse-GPU"
        },
    );
    // ...and the steady agent is still attached (curl reads the fleet).
    let fleet = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "5"])
        .arg(format!("http://127.0.0.1:{http}/fleet.json"))
        .output()
        .unwrap();
    let fleet: Value = serde_json::from_slice(&fleet.stdout).unwrap_or_else(|e| {
        panic!(
            "fleet.json ({e}): {}",
            String::from_utf8_lossy(&fleet.stderr)
        )
    });
    let steady = fleet["nodes"]
        .as_array()
        .and_then(|n| n.iter().find(|n| n["name"] == "steady-node"))
        .unwrap_or_else(|| panic!("no steady-node in {fleet:#}"));
    assert_eq!(steady["connected"], true, "{steady:#}");
    assert_eq!(steady["notReporting"], Value::Null, "{steady:#}");
    controller.term();
}

/// Idle connections cannot pile up: one past `--max-connections` is closed
/// as it comes, one that never finishes its TLS handshake is closed after
/// `--tls-handshake-seconds`, and an agent is served once they are gone.
#[test]
fn idle_connections_are_capped_and_timed_out() {
    use std::io::Read;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    let account = "system:serviceaccount:gpu-agent:gpu-agent";
    api.add_node("late-node", kubelet_node());
    api.add_token("late-token", account, "late-node");
    let dir = tempfile::tempdir().unwrap();
    let (mut controller, port, ca) = common::start_controller_with(
        &api,
        dir.path(),
        None,
        &[
            ("GPU_CONTROLLER_MAX_CONNECTIONS", "20"),
            ("GPU_CONTROLLER_TLS_HANDSHAKE_SECONDS", "2"),
        ],
    );
    // start_controller_with's own probe took a slot for a moment; let it go.
    std::thread::sleep(Duration::from_millis(300));
    // 30 connections that send nothing, each watched by a thread for when
    // it is closed (EOF or reset): when tells which rule closed it.
    let t0 = std::time::Instant::now();
    let watchers: Vec<_> = (0..30)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(6))).unwrap();
            std::thread::spawn(move || {
                let mut b = [0u8; 1];
                let r = s.read(&mut b);
                assert!(
                    matches!(r, Ok(0))
                        || matches!(&r, Err(e) if e.kind() != std::io::ErrorKind::WouldBlock),
                    "an idle connection got data or was never closed: {r:?}"
                );
                t0.elapsed()
            })
        })
        .collect();
    let closed_at: Vec<Duration> = watchers.into_iter().map(|w| w.join().unwrap()).collect();
    let at_once = closed_at
        .iter()
        .filter(|t| **t < Duration::from_millis(1500))
        .count();
    let timed_out = closed_at
        .iter()
        .filter(|t| **t >= Duration::from_millis(1500) && **t < Duration::from_secs(5))
        .count();
    println!(
        "30 idle connections: {at_once} closed at once (over the cap of 20), {timed_out} after the 2 s handshake limit"
    );
    assert!(at_once >= 10, "{closed_at:?}\n{}", controller.log());
    assert!(timed_out >= 1 && at_once + timed_out == 30, "{closed_at:?}");
    assert!(
        controller
            .log()
            .contains("already holding the most connections allowed"),
        "{}",
        controller.log()
    );
    // The slots are back: an agent is served.
    let report = pb::NodeReport {
        labels: Some(pb::Labels {
            labels: [("nvidia.com/gpu.product".to_string(), "Late-GPU".into())].into(),
        }),
        ..Default::default()
    };
    let _late = rt
        .block_on(fake_agent(
            port,
            &ca,
            "late-token",
            "late-node",
            report,
            vec![],
        ))
        .expect("an agent is served after the idle connections went");
    wait_for(
        "the late agent's labels",
        Duration::from_secs(20),
        &[&controller],
        || api.node("late-node")["metadata"]["labels"]["nvidia.com/gpu.product"] == "Late-GPU",
    );
    controller.term();
}
