//! A ResourceClaim end to end (issue 31), every part a real process: the
//! scripted API server holds the claim as the scheduler allocated it,
//! gpu-controller hands it to the node's gpu-agent over the report stream,
//! and a kubelet stand-in we did not write (Python grpcio,
//! tests/interop/dra_kubelet_claim.py) registers the agent's DRA plugin and
//! calls NodePrepareResources / NodeUnprepareResources for it. The prepare
//! answers from the agent's memory (no API call from the node): the CDI ID
//! in NVIDIA's convention, and the claim's spec on the node naming the
//! GPU's device node. A device node that is not there fails the claim
//! naming it (NVIDIA #1380); the kubelet's retry succeeds once it is. (The
//! fixture's `/dev` holds empty files where the real host had its nodes:
//! the check is that they exist.)

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::claims::claim;
use common::{MockApi, Proc, kubelet_node, python, repo, start_controller};
use serde_json::{Value, json};

const NODE: &str = "gpu-node-1";
const ACCOUNT: &str = "system:serviceaccount:gpu-agent:gpu-agent";

/// The Python kubelet stand-in for one claim, steps on stdin.
struct Kubelet {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
}

impl Kubelet {
    fn start(host: &Path, claim: &str) -> Kubelet {
        let mut child = Command::new(python())
            .arg(repo().join("tests/interop/dra_kubelet_claim.py"))
            .arg("--proto-dir")
            .arg(repo().join("proto/proto"))
            .arg("--registry-dir")
            .arg(host.join("var/lib/kubelet/plugins_registry"))
            .arg("--host-root")
            .arg(host)
            .args(["--claim", claim])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        Kubelet { child, out }
    }

    fn next(&mut self, logs: &[&Proc]) -> Value {
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        assert!(
            !line.is_empty(),
            "the stand-in ended ({:?}); logs:\n{}",
            self.child.try_wait(),
            logs.iter().map(|p| p.log()).collect::<Vec<_>>().join("\n")
        );
        serde_json::from_str(&line).unwrap()
    }

    fn step(&mut self, word: &str, logs: &[&Proc]) -> Value {
        writeln!(self.child.stdin.as_mut().unwrap(), "{word}").unwrap();
        self.next(logs)
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The 8x H100 fixture with a boot ID, and a policy with DRA on (the
/// device plugin off: DRA has every GPU).
fn host(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let host = dir.join("host");
    common::h100_host(&host);
    let boot = host.join("proc/sys/kernel/random");
    std::fs::create_dir_all(&boot).unwrap();
    std::fs::write(
        boot.join("boot_id"),
        "0c1d2e3f-4a5b-4c6d-8e7f-8091a2b3c4d5\n",
    )
    .unwrap();
    let policy = dir.join("policy.yaml");
    std::fs::write(
        &policy,
        "spec:\n  driver: {enabled: false}\n  toolkit: {enabled: false}\n  devicePlugin: {enabled: false}\n  dra: {enabled: true}\n",
    )
    .unwrap();
    (host, policy)
}

fn status(host: &Path) -> Value {
    let out = Command::new(common::agent_bin())
        .arg("--host-root")
        .arg(host)
        .args(["status", "-o", "json"])
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

#[test]
fn a_claim_allocated_in_the_api_is_prepared_on_its_node_from_memory() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    api.add_node(NODE, kubelet_node());
    api.add_token("agent-token", ACCOUNT, NODE);
    let dir = tempfile::tempdir().unwrap();
    let (mut controller, port, ca) = start_controller(&api, dir.path(), None);
    let (host, policy) = host(dir.path());
    let global = [
        "--simulate".as_ref(),
        "h100-sxm-8".as_ref(),
        "--policy".as_ref(),
        policy.as_os_str(),
    ];
    let mut agent = common::reporting_agent(
        dir.path(),
        &host,
        &global,
        &[],
        port,
        &ca,
        "agent-token",
        NODE,
    );
    let logs = |a: &Proc, c: &Proc| format!("agent:\n{}\ncontroller:\n{}", a.log(), c.log());

    let mut kubelet = Kubelet::start(&host, "ml/c1/uid-c1");
    let reg = kubelet.next(&[&agent, &controller]);
    assert_eq!(reg["event"], "registered", "{reg}");
    assert_eq!(
        reg["versions"],
        json!([
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1alpha1.DRAResourceHealth"
        ])
    );

    // The controller publishes the node's devices once the agent says the
    // kubelet registered its plugin: one slice, eight GPUs, NVIDIA's
    // attributes, as the 1.36 API server takes it.
    let registered = Instant::now();
    let node_slices = || -> Vec<Value> {
        api.resource_slices()
            .into_iter()
            .filter(|s| s["spec"]["nodeName"] == NODE)
            .collect()
    };
    common::wait_for(
        "the node's ResourceSlices",
        Duration::from_secs(20),
        &[&agent, &controller],
        || !node_slices().is_empty(),
    );
    let slices = node_slices();
    eprintln!(
        "the node's ResourceSlices in the API {:.0} ms after the kubelet registered the plugin",
        registered.elapsed().as_secs_f64() * 1e3
    );
    let schemas = common::schema::load();
    for s in &slices {
        let mut body = s.clone();
        body["metadata"] = json!({"name": s["metadata"]["name"], "ownerReferences": s["metadata"]["ownerReferences"]});
        let errs = common::schema::check(
            &schemas,
            "io.k8s.api.resource.v1.ResourceSlice",
            &body,
            false,
        );
        assert!(errs.is_empty(), "{s}: {errs:?}");
    }
    let devices = slices[0]["spec"]["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 8, "{:#}", slices[0]);
    let gpu0 = devices.iter().find(|d| d["name"] == "gpu-0").unwrap();
    eprintln!("gpu-0 as published: {gpu0:#}");
    assert_eq!(gpu0["attributes"]["type"]["string"], "gpu", "{gpu0:#}");
    assert_eq!(
        gpu0["attributes"]["productName"]["string"],
        "NVIDIA H100 80GB HBM3"
    );
    assert_eq!(
        gpu0["attributes"]["cudaComputeCapability"]["version"],
        "9.0.0"
    );
    assert!(
        gpu0["attributes"]["uuid"]["string"]
            .as_str()
            .unwrap()
            .starts_with("GPU-")
    );
    assert!(gpu0["capacity"]["memory"]["value"].is_string(), "{gpu0:#}");
    // From NVML (as NVIDIA's driver spells them) and sysfs.
    assert_eq!(gpu0["attributes"]["brand"]["string"], "Nvidia");
    assert_eq!(gpu0["attributes"]["architecture"]["string"], "Hopper");
    assert_eq!(
        gpu0["attributes"]["resource.kubernetes.io/pcieRoot"]["string"],
        "pci0000:00"
    );

    // The scheduler's allocation: gpu-0 of this node's pool.
    api.set_claim(claim(
        "c1",
        Some(NODE),
        json!([{"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-0"}]),
    ));
    // The agent has it (status says how many the controller handed over).
    common::wait_for(
        "the claim in the agent's status",
        Duration::from_secs(20),
        &[&agent, &controller],
        || status(&host)["dra"]["allocations"] == json!(1),
    );

    // The device nodes are gone (the driver unloaded): the claim fails
    // naming them, and writes nothing.
    for n in ["nvidia0", "nvidiactl"] {
        std::fs::remove_file(host.join("dev").join(n)).unwrap();
    }
    let failed = kubelet.step("prepare", &[&agent, &controller]);
    assert_eq!(failed["event"], "prepared", "{failed}");
    let why = failed["error"].as_str().unwrap();
    assert!(
        why.contains("ml/c1") && why.contains("/dev/nvidia0") && why.contains("/dev/nvidiactl"),
        "{why}"
    );
    assert!(failed["devices"].as_array().unwrap().is_empty(), "{failed}");
    let spec = host.join("var/run/cdi/k8s.gpu.nvidia.com-claim_uid-c1.yaml");
    assert!(!spec.exists(), "a failed claim left its spec");

    // The device nodes appear (the driver loaded): the kubelet's retry works.
    for n in [
        "nvidia0",
        "nvidiactl",
        "nvidia-uvm",
        "nvidia-uvm-tools",
        "nvidia-modeset",
    ] {
        std::fs::write(host.join("dev").join(n), "").unwrap();
    }
    let ok = kubelet.step("prepare", &[&agent, &controller]);
    assert_eq!(ok["error"], "", "{ok}\n{}", logs(&agent, &controller));
    assert_eq!(
        ok["devices"],
        json!([{"requests": ["gpu"], "pool": NODE, "device": "gpu-0",
            "cdi": ["k8s.gpu.nvidia.com/claim=uid-c1-gpu-0"]}])
    );
    eprintln!(
        "prepare answered in {:.1} ms (from the agent's memory)",
        ok["seconds"].as_f64().unwrap() * 1e3
    );
    let text = std::fs::read_to_string(&spec).unwrap();
    assert!(text.contains("kind: k8s.gpu.nvidia.com/claim"), "{text}");
    assert!(text.contains("name: uid-c1-gpu-0"), "{text}");
    assert!(text.contains("/dev/nvidia0"), "{text}");
    // `status` says so (the state file follows each prepare).
    common::wait_for(
        "the prepared claim in status",
        Duration::from_secs(10),
        &[&agent, &controller],
        || status(&host)["dra"]["claims"][0]["state"] == "prepared",
    );
    let st = status(&host);
    assert_eq!(st["dra"]["claims"][0]["uid"], "uid-c1", "{:#}", st["dra"]);
    assert_eq!(st["dra"]["claims"][0]["state"], "prepared");
    assert_eq!(st["dra"]["claims"][0]["devices"], json!(["gpu-0"]));

    let text = Command::new(common::agent_bin())
        .arg("--host-root")
        .arg(&host)
        .arg("status")
        .output()
        .unwrap();
    eprintln!("{}", String::from_utf8_lossy(&text.stdout));
    let undone = kubelet.step("unprepare", &[&agent, &controller]);
    assert_eq!(undone["error"], "", "{undone}");
    assert!(!spec.exists(), "the spec outlived unprepare");
    let again = kubelet.step("unprepare", &[&agent, &controller]);
    assert_eq!(again["error"], "", "a repeated unprepare is done already");

    drop(kubelet);
    agent.term();
    controller.term();
}
