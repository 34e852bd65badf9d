//! The cluster half, from the demo: `scripts/demo-fleet` runs this test
//! with `--nocapture` and prints what it shows.
//!
//! Two real `gpu-agent run --simulate` processes (an 8x H100 node and a
//! one-A10G node, driver and toolkit off as on EKS) report over TLS to a
//! real `gpu-controller`, which writes to the scripted API server of the
//! controller's tests (a stand-in that keeps nodes in memory: no
//! Kubernetes runs on these machines). The A10G's kernel log (a FIFO the
//! test writes to) then says XID 79: its only GPU goes unhealthy, the node
//! gets `GPUHealthy=False` with the XID catalogue's advice and the health
//! taint, and the fleet page, rendered by headless Chromium, shows it.
//!
//! With `GPU_DEMO_OUT=DIR` the transcript, the fleet JSON, the page's text
//! and a screenshot are written there; with `GPU_DEMO_KEEP=SECONDS` the
//! controller's page stays up that long after the checks, for a browser.

mod common;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{MockApi, Proc, free_port, kubelet_node, start_controller, wait_for};
use serde_json::Value;

const ACCOUNT: &str = "system:serviceaccount:gpu-agent:gpu-agent";

/// The node's kubelet: the Python grpcio stand-in (not our code) that
/// takes the plugin's registration, keeps its ListAndWatch open and
/// allocates one GPU, as a pod would. Ends with the test.
struct Kubelet(std::process::Child);

impl Drop for Kubelet {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn kubelet(host: &Path) -> Kubelet {
    let dir = host.join("var/lib/kubelet/device-plugins");
    std::fs::create_dir_all(&dir).unwrap();
    Kubelet(
        Command::new(common::python())
            .arg(common::repo().join("tests/interop/kubelet_rolling_standin.py"))
            .arg("--proto")
            .arg(common::repo().join("proto/proto/deviceplugin_v1beta1.proto"))
            .arg("--dir")
            .arg(&dir)
            .args(["--size", "1", "--timeout", "120"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// A simulated node on a copy of fixture `fixture`, reporting as `node`,
/// with its kubelet.
fn agent(dir: &Path, port: u16, ca: &Path, fixture: &str, node: &str) -> (Proc, PathBuf, Kubelet) {
    let host = dir.join(format!("host-{node}"));
    common::fixture_host(fixture, &host);
    let kubelet = kubelet(&host);
    // The kernel log: a FIFO this test writes XIDs to.
    std::fs::create_dir_all(host.join("dev")).unwrap();
    let kmsg = host.join("dev/kmsg");
    let _ = std::fs::remove_file(&kmsg);
    let made = Command::new("mkfifo")
        .arg("-m")
        .arg("600")
        .arg(&kmsg)
        .status()
        .unwrap();
    assert!(made.success(), "mkfifo {}", kmsg.display());
    let policy = common::eks_policy();
    let global = [
        "--simulate".as_ref(),
        fixture.as_ref(),
        "--policy".as_ref(),
        policy.as_os_str(),
    ];
    let token = format!("token-{node}");
    let agent = common::reporting_agent(dir, &host, &global, &[], port, ca, &token, node);
    (agent, host, kubelet)
}

fn condition(node: &Value, kind: &str) -> Option<Value> {
    node["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
        .cloned()
}

fn http_get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

/// `kubectl describe node`'s parts the controller writes: GPU labels,
/// taints, the GPU conditions.
fn describe(node: &Value) -> String {
    let mut s = String::new();
    writeln!(
        s,
        "Name: {}",
        node["metadata"]["name"].as_str().unwrap_or("?")
    )
    .unwrap();
    writeln!(s, "Labels (nvidia.com/*):").unwrap();
    if let Some(labels) = node["metadata"]["labels"].as_object() {
        for (k, v) in labels.iter().filter(|(k, _)| k.starts_with("nvidia.com/")) {
            writeln!(s, "  {k}={}", v.as_str().unwrap_or("")).unwrap();
        }
    }
    let taints: Vec<String> = node["spec"]["taints"]
        .as_array()
        .map(|ts| {
            ts.iter()
                .map(|t| {
                    format!(
                        "{}={}:{}",
                        t["key"].as_str().unwrap_or(""),
                        t["value"].as_str().unwrap_or(""),
                        t["effect"].as_str().unwrap_or("")
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    writeln!(
        s,
        "Taints: {}",
        if taints.is_empty() {
            "<none>".to_string()
        } else {
            taints.join(", ")
        }
    )
    .unwrap();
    writeln!(s, "Conditions:").unwrap();
    writeln!(
        s,
        "  {:<26} {:<8} {:<22} MESSAGE",
        "TYPE", "STATUS", "REASON"
    )
    .unwrap();
    for c in node["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if !c["type"].as_str().unwrap_or("").starts_with("GPU") {
            continue;
        }
        writeln!(
            s,
            "  {:<26} {:<8} {:<22} {}",
            c["type"].as_str().unwrap_or(""),
            c["status"].as_str().unwrap_or(""),
            c["reason"].as_str().unwrap_or(""),
            c["message"].as_str().unwrap_or("")
        )
        .unwrap();
    }
    s
}

/// The page's visible text, roughly: the DOM without its tags.
fn text_of(dom: &str) -> String {
    let body = dom.split_once("<body").map(|(_, b)| b).unwrap_or(dom);
    let body = body.split_once("<script").map(|(b, _)| b).unwrap_or(body);
    let mut out = String::new();
    // Inside `<body ...>` still.
    let mut in_tag = true;
    for ch in body.chars() {
        match ch {
            '<' => {
                in_tag = true;
                out.push(' ');
            }
            '>' => in_tag = false,
            c if !in_tag => out.push(c),
            _ => {}
        }
    }
    out.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace("&amp;", "&")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
}

#[test]
fn two_simulated_nodes_report_and_an_xid_taints_one() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    let nodes = [("gpu-node-h100", "h100-sxm-8"), ("gpu-node-a10g", "a10g-1")];
    for (node, _) in nodes {
        let mut n = kubelet_node();
        n["metadata"]["name"] = node.into();
        n["metadata"]["labels"]["kubernetes.io/hostname"] = node.into();
        api.add_node(node, n);
        api.add_token(&format!("token-{node}"), ACCOUNT, node);
    }
    let dir = tempfile::tempdir().unwrap();
    let http = free_port();
    let (mut controller, port, ca) = start_controller(&api, dir.path(), Some(http));
    let (mut h100, _, _h100_kubelet) = agent(dir.path(), port, &ca, "h100-sxm-8", "gpu-node-h100");
    let (mut a10g, a10g_host, _a10g_kubelet) =
        agent(dir.path(), port, &ca, "a10g-1", "gpu-node-a10g");

    // Both nodes get their labels and every condition says True.
    let all_true = |name: &str| {
        let n = api.node(name);
        [
            "GPUDriverReady",
            "GPUContainerRuntimeReady",
            "GPUDevicePluginReady",
            "GPUHealthy",
        ]
        .iter()
        .all(|c| condition(&n, c).is_some_and(|c| c["status"] == "True"))
    };
    wait_for(
        "both nodes labelled, every GPU condition True",
        Duration::from_secs(90),
        &[&controller, &h100, &a10g],
        || all_true("gpu-node-h100") && all_true("gpu-node-a10g"),
    );
    let healthy_a10g = describe(&api.node("gpu-node-a10g"));
    let plugin = condition(&api.node("gpu-node-a10g"), "GPUDevicePluginReady").unwrap();
    assert_eq!(
        plugin["message"],
        "plugin: 1 resource(s) registered and listed by the kubelet"
    );
    let h100_node = api.node("gpu-node-h100");
    assert_eq!(
        h100_node["metadata"]["labels"]["nvidia.com/gpu.product"],
        "NVIDIA-H100-80GB-HBM3"
    );
    assert_eq!(h100_node["metadata"]["labels"]["nvidia.com/gpu.count"], "8");
    assert_eq!(
        api.node("gpu-node-a10g")["metadata"]["labels"]["nvidia.com/gpu.product"],
        "NVIDIA-A10G"
    );

    // The A10G falls off the bus.
    {
        use std::io::Write;
        let mut kmsg = std::fs::OpenOptions::new()
            .write(true)
            .open(a10g_host.join("dev/kmsg"))
            .unwrap();
        kmsg.write_all(
            b"3,5001,0,-;NVRM: Xid (PCI:0000:00:1e): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n",
        )
        .unwrap();
        // Held open: a FIFO's reader sees end-of-file when the last writer
        // goes, which is not what a kernel log does.
        std::mem::forget(kmsg);
    }
    wait_for(
        "GPUHealthy False and the health taint on gpu-node-a10g",
        Duration::from_secs(30),
        &[&controller, &a10g],
        || {
            let n = api.node("gpu-node-a10g");
            condition(&n, "GPUHealthy").is_some_and(|c| c["status"] == "False")
                && n["spec"]["taints"]
                    .as_array()
                    .is_some_and(|t| t.iter().any(|t| t["key"] == "nvidia.com/gpu.health"))
        },
    );
    let sick = api.node("gpu-node-a10g");
    let health = condition(&sick, "GPUHealthy").unwrap();
    let message = health["message"].as_str().unwrap();
    assert!(message.contains("XID 79"), "{health}");
    let taint = sick["spec"]["taints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["key"] == "nvidia.com/gpu.health")
        .unwrap()
        .clone();
    assert_eq!(taint["value"], "unhealthy");
    assert_eq!(taint["effect"], "NoSchedule");
    assert!(
        condition(&api.node("gpu-node-h100"), "GPUHealthy").is_some_and(|c| c["status"] == "True"),
        "the other node stays healthy"
    );

    // The fleet page, as a browser shows it.
    let json: Value = serde_json::from_str(&http_get(http, "/fleet.json")).unwrap();
    // Both agents' first check-ins were full handshakes, their later ones
    // (the health event's, the interval's) resumed their sessions.
    let tls = &json["summary"]["tlsHandshakes"];
    assert!(tls["full"].as_u64().unwrap() >= 2, "{tls}");
    assert!(tls["resumed"].as_u64().unwrap() >= 1, "{tls}");
    // The one failed: the test's own wait for the port (a bare TCP
    // connect, closed without a handshake).
    assert_eq!(tls["failed"], 1, "{tls}");
    let dom_out = common::chromium(
        &["--dump-dom"],
        &format!("http://127.0.0.1:{http}/"),
        "1400,900",
    );
    let dom = String::from_utf8_lossy(&dom_out.stdout).into_owned();
    assert!(
        dom.contains("data-loaded=\"yes\""),
        "the page's script did not render the fleet:\n{dom}\n{}",
        String::from_utf8_lossy(&dom_out.stderr)
    );
    let text = text_of(&dom);
    for want in [
        "2 nodes · 2 reporting · 9 GPUs · 1 unhealthy",
        "gpu-node-h100",
        "gpu-node-a10g",
        "8 × NVIDIA H100 80GB HBM3",
        "1 × NVIDIA A10G",
        "0/1 healthy",
        "GPU has fallen off the bus",
    ] {
        assert!(
            text.contains(want),
            "the page does not show {want:?}:\n{text}"
        );
    }

    // The transcript.
    let mut out = String::new();
    writeln!(
        out,
        "== gpu-node-h100 (simulated 8x H100 SXM) ==\n{}",
        describe(&api.node("gpu-node-h100"))
    )
    .unwrap();
    writeln!(
        out,
        "== gpu-node-a10g (simulated 1x A10G), before the XID ==\n{healthy_a10g}"
    )
    .unwrap();
    writeln!(
        out,
        "== gpu-node-a10g, after `NVRM: Xid (PCI:0000:00:1e): 79` in its kernel log ==\n{}",
        describe(&sick)
    )
    .unwrap();
    let events: Vec<String> = api
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST" && r.uri.contains("/events"))
        .map(|r| {
            format!(
                "  {} {} {}: {}",
                r.body["type"].as_str().unwrap_or(""),
                r.body["reason"].as_str().unwrap_or(""),
                r.body["involvedObject"]["name"]
                    .as_str()
                    .or(r.body["regarding"]["name"].as_str())
                    .unwrap_or(""),
                r.body["message"]
                    .as_str()
                    .or(r.body["note"].as_str())
                    .unwrap_or("")
            )
        })
        .collect();
    writeln!(out, "== Kubernetes Events the controller posted ==").unwrap();
    for e in &events {
        writeln!(out, "{e}").unwrap();
    }
    writeln!(
        out,
        "\n== the fleet page (http://127.0.0.1:{http}/), its text in headless Chromium ==\n{text}"
    )
    .unwrap();
    println!("{out}");

    if let Some(dest) = std::env::var_os("GPU_DEMO_OUT") {
        let dest = PathBuf::from(dest);
        std::fs::create_dir_all(&dest).unwrap();
        std::fs::write(dest.join("transcript.txt"), &out).unwrap();
        std::fs::write(
            dest.join("fleet.json"),
            serde_json::to_string_pretty(&json).unwrap(),
        )
        .unwrap();
        let shot = dest.join("fleet-page.png");
        let shot_out = common::chromium(
            &[format!("--screenshot={}", shot.display()).as_str()],
            &format!("http://127.0.0.1:{http}/"),
            "1400,900",
        );
        if !shot.exists() {
            eprintln!(
                "no screenshot: {}",
                String::from_utf8_lossy(&shot_out.stderr)
            );
        }
        println!("written to {}", dest.display());
    }
    if let Some(secs) = std::env::var("GPU_DEMO_KEEP")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
    {
        println!("the fleet page stays at http://127.0.0.1:{http}/ for {secs} s (Ctrl-C ends it)");
        std::thread::sleep(Duration::from_secs(secs));
    }
    h100.term();
    a10g.term();
    controller.term();
}
