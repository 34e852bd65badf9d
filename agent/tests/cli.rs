//! The `gpu-agent` binary end to end, over fixture host roots and temp dirs.

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// `status`'s exit code when no running agent answered and it inspected
/// the host instead (LSB's "program is not running", as `systemctl status`).
const NOT_RUNNING: i32 = 3;

/// Every path under `root` (to check that nothing was written).
fn tree(root: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            out.insert(p.strip_prefix(root).unwrap().display().to_string());
            if p.is_dir() && !p.is_symlink() {
                stack.push(p);
            }
        }
    }
    out
}

/// A stage table row: the stage, its state, and a detail that contains `detail`.
fn row(out: &str, stage: &str, state: &str, detail: &str) -> bool {
    out.lines().map(str::trim_start).any(|l| {
        l.starts_with(&format!("{stage} "))
            && l[stage.len()..]
                .trim_start()
                .starts_with(&format!("{state}  "))
            && l.contains(detail)
    })
}

#[test]
fn demo_runs_in_a_sandbox_and_cleans_up() {
    let (code, out, err) = run(bin().arg("demo"));
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("8 GPU(s): 8x NVIDIA H100 80GB HBM3; driver 550.127.08"),
        "{out}"
    );
    assert!(out.contains("GPU0      X     NV18"), "{out}");
    assert!(out.contains("from the running agent"), "{out}");
    assert!(
        row(
            &out,
            "driver",
            "done",
            "driver 550.127.08 (open) loaded (simulated node: no module touched)"
        ),
        "{out}"
    );
    assert!(
        row(
            &out,
            "devnodes",
            "done",
            "simulated node: 14 device node(s) not made (no real GPU behind them)"
        ),
        "{out}"
    );
    // Labels and mig (no layout selected) are done; metrics is ready (it takes a running agent).
    assert!(out.contains("10 stage(s) done."), "{out}");
    assert!(
        row(
            &out,
            "mig",
            "done",
            "no layout selected (spec.migManager.default); MIG is left as it is"
        ),
        "{out}"
    );
    assert!(
        row(
            &out,
            "labels",
            "done",
            "wrote 27 label(s) to /etc/kubernetes/node-feature-discovery/features.d/gfd"
        ),
        "{out}"
    );
    assert!(
        row(
            &out,
            "cdi",
            "done",
            "wrote /var/lib/gpu-agent/bin/gpu-agent, /var/run/cdi/gpu-agent-nvidia.com-gpu.json: 8 GPU(s), 0 MIG device(s)"
        ),
        "{out}"
    );
    assert!(
        row(
            &out,
            "runtime",
            "done",
            "wrote /etc/containerd/config.toml; not reloaded (spec.toolkit.reload is none)"
        ),
        "{out}"
    );
    assert!(
        out.contains("GPU-4e8a2b3c-9d1e-4f7a-b2c4-3c4d5e6f7a04 (XID 79, from NVML)"),
        "{out}"
    );
    assert!(
        row(
            &out,
            "plugin",
            "done",
            "nvidia.com/gpu: 8 device(s), registered"
        ),
        "{out}"
    );
    assert!(
        out.contains("env NVIDIA_VISIBLE_DEVICES=GPU-9d3b5a0e-1c7f-4e2a-8b61-0f2c3d4e5a01"),
        "{out}"
    );
    let sandbox = out
        .lines()
        .find_map(|l| l.strip_prefix("1. Sandbox host root: "))
        .expect("the demo names its sandbox");
    assert!(
        !Path::new(sandbox).exists(),
        "sandbox {sandbox} was left behind"
    );
}

#[test]
fn demo_keep_leaves_a_host_root_that_status_reads() {
    let (code, out, err) = run(bin().args(["demo", "--keep", "--node", "t4-4"]));
    assert_eq!(code, 0, "{err}");
    let sandbox = out
        .lines()
        .find_map(|l| l.strip_prefix("1. Sandbox host root: "))
        .unwrap()
        .to_string();
    let (code, out, err) = run(bin().args(["--host-root", &sandbox, "status", "--output", "json"]));
    fs::remove_dir_all(&sandbox).unwrap();
    assert_eq!(code, NOT_RUNNING, "{err}");
    let st = json(&out);
    // No agent runs in the sandbox (none holds its lock): status says so and
    // inspects the sandbox, whose simulated tree still has the 4 GPUs.
    assert_eq!(st["source"], "host-inspection");
    assert!(
        st["note"].as_str().unwrap().contains("is not running"),
        "{}",
        st["note"]
    );
    assert_eq!(st["inventory"]["gpus"].as_array().unwrap().len(), 4);
}

#[test]
fn inventory_of_the_8_gpu_fixture() {
    let (code, out, err) =
        run(at(host_fixture("h100-sxm-8")).args(["inventory", "--output", "json"]));
    assert_eq!(code, 0, "{err}");
    let inv = json(&out);
    let gpus = inv["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 8);
    let buses: Vec<&str> = gpus.iter().map(|g| g["bus_id"].as_str().unwrap()).collect();
    assert_eq!(
        buses,
        [
            "0000:18:00.0",
            "0000:2a:00.0",
            "0000:3a:00.0",
            "0000:5d:00.0",
            "0000:9a:00.0",
            "0000:ab:00.0",
            "0000:ba:00.0",
            "0000:db:00.0"
        ]
    );
    let numa: Vec<u64> = gpus
        .iter()
        .map(|g| g["numa_node"].as_u64().unwrap())
        .collect();
    assert_eq!(numa, [0, 0, 0, 0, 1, 1, 1, 1]);
    for g in gpus {
        assert_eq!(g["model"], "NVIDIA H100 80GB HBM3");
        assert!(g["uuid"].as_str().unwrap().starts_with("GPU-"));
    }
    let uuids: BTreeSet<&str> = gpus.iter().map(|g| g["uuid"].as_str().unwrap()).collect();
    assert_eq!(uuids.len(), 8);
}

#[test]
fn inventory_table_of_the_a10g_fixture() {
    let (code, out, err) = run(at(host_fixture("a10g-1")).arg("inventory"));
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("node: g5.xlarge · driver 550.127.05 (proprietary)"),
        "{out}"
    );
    assert!(
        out.contains("0000:00:1e.0  NVIDIA A10G  GPU-3f6e1b2a-8c4d-4b7e-9a15-6d2c8e0f4a11"),
        "{out}"
    );
}

#[test]
fn no_gpu_node_says_so_and_exits_0() {
    let (code, out, err) = run(at(host_fixture("no-gpu")).arg("inventory"));
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("no NVIDIA GPU found on this node"), "{out}");
    let (code, out, _) = run(at(host_fixture("no-gpu")).args(["inventory", "-o", "json"]));
    assert_eq!(code, 0);
    assert_eq!(json(&out)["gpus"], serde_json::json!([]));
}

#[test]
fn every_valid_policy_fixture_passes() {
    let dir = fixture("policies/valid");
    let mut n = 0;
    for e in fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let (code, out, err) = run(bin().arg("policy").arg("check").arg(&p));
        assert_eq!(code, 0, "{}: {err}", p.display());
        assert!(out.contains("valid policy"), "{out}");
        n += 1;
    }
    assert!(n >= 4, "only {n} valid fixtures");
}

#[test]
fn every_invalid_policy_fixture_fails_with_2_naming_the_key() {
    let dir = fixture("policies/invalid");
    let mut n = 0;
    for e in fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let text = fs::read_to_string(&p).unwrap();
        let expect = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("# expect: "))
            .unwrap_or_else(|| panic!("{}: first line must be `# expect: <text>`", p.display()));
        let (code, out, err) = run(bin().arg("policy").arg("check").arg(&p));
        assert_eq!(code, 2, "{}: {out}{err}", p.display());
        assert!(err.contains(&p.display().to_string()), "{err}");
        assert!(
            err.contains(expect),
            "{}: expected {expect:?} in {err}",
            p.display()
        );
        n += 1;
    }
    assert!(n >= 8, "only {n} invalid fixtures");
}

#[test]
fn invalid_policy_stops_run_before_anything_is_written() {
    let host = tempfile::tempdir().unwrap();
    simnode::NodeDescription::load("a10g-1")
        .unwrap()
        .materialize(host.path())
        .unwrap();
    let before = tree(host.path());
    let (code, _, err) = run(at(host.path())
        .arg("--policy")
        .arg(fixture("policies/invalid/unknown-key.yaml"))
        .args(["run", "--once"]));
    assert_eq!(code, 2);
    assert!(
        err.contains("spec.devicePlugin.enabeld: unknown key"),
        "{err}"
    );
    assert_eq!(
        tree(host.path()),
        before,
        "an invalid policy changed the host root"
    );
}

#[test]
fn bad_simulation_and_host_root_are_bad_input() {
    let (code, _, err) = run(bin().args(["--simulate", "h200-9", "inventory"]));
    assert_eq!(code, 2);
    assert!(
        err.contains("\"h200-9\" is neither a file nor a built-in"),
        "{err}"
    );
    let (code, _, err) = run(bin().args(["--host-root", "/nonexistent/root", "status"]));
    assert_eq!(code, 2);
    assert!(err.contains("/nonexistent/root"), "{err}");
}

#[test]
fn status_without_an_agent_inspects_the_host() {
    let (code, out, err) = run(at(host_fixture("h100-sxm-8")).args(["status", "-o", "json"]));
    assert_eq!(code, NOT_RUNNING, "{err}");
    let st = json(&out);
    assert_eq!(st["source"], "host-inspection");
    assert!(
        st["note"].as_str().unwrap().contains("no running agent"),
        "{}",
        st["note"]
    );
    let stages = st["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 11);
    assert_eq!(stages[0]["stage"], "discover");
    assert_eq!(stages[0]["state"], "done");
    for s in &stages[1..] {
        if s["stage"] == "runtime" {
            // The fixture has no container runtime.
            assert_eq!(s["state"], "waiting", "{s}");
            assert!(
                s["detail"]
                    .as_str()
                    .unwrap()
                    .starts_with("no containerd on this host"),
                "{s}"
            );
        } else if s["stage"] == "health" {
            assert_eq!(s["state"], "waiting", "{s}");
            assert!(
                s["detail"]
                    .as_str()
                    .unwrap()
                    .starts_with("8 GPU(s) on the node, none can be watched until nvml"),
                "{s}"
            );
        } else if s["stage"] == "cdi" {
            // Named by UUID (from /proc) until NVML gives indices.
            assert_eq!(s["state"], "waiting", "{s}");
            let d = s["detail"].as_str().unwrap();
            assert!(d.contains("none can be named by index until nvml"), "{s}");
            assert!(
                d.contains("would write /var/run/cdi/gpu-agent-nvidia.com-gpu.json: 8 GPU(s)"),
                "{s}"
            );
        } else if s["stage"] == "plugin" {
            // The fixture has no NVML: GPUs without UUIDs cannot be advertised.
            assert_eq!(s["state"], "waiting", "{s}");
            assert!(
                s["detail"].as_str().unwrap().starts_with(
                    "8 GPU(s) on the node, none can be advertised until nvml describes them"
                ),
                "{s}"
            );
        } else if s["stage"] == "driver" {
            // Loaded, and the policy names no bundle: the host's driver is kept.
            assert_eq!(s["state"], "done", "{s}");
            assert_eq!(
                s["detail"],
                "driver 550.127.08 loaded (not by gpu-agent: no bundle or moduleDir in the policy)"
            );
        } else if s["stage"] == "devnodes" {
            // The fixture's /dev holds plain files: every node would be made
            // (inspecting changes nothing). Without CAP_MKNOD: blocked.
            let d = s["detail"].as_str().unwrap();
            match s["state"].as_str().unwrap() {
                "ready" => assert!(
                    d.starts_with("would make 14 of 14 device node(s): /dev/nvidiactl,"),
                    "{s}"
                ),
                "blocked" => assert_eq!(d, "missing CAP_MKNOD", "{s}"),
                other => panic!("devnodes {other}: {s}"),
            }
        } else if s["stage"] == "metrics" {
            // Without NVML there is nothing to sample.
            assert_eq!(s["state"], "waiting", "{s}");
            assert!(
                s["detail"]
                    .as_str()
                    .unwrap()
                    .starts_with("8 GPU(s) on the node, none can be sampled until nvml"),
                "{s}"
            );
        } else if s["stage"] == "labels" {
            // No NVML: nothing to label the GPUs with; the file is left as is.
            assert_eq!(s["state"], "waiting", "{s}");
            assert!(
                s["detail"].as_str().unwrap().starts_with(
                    "8 GPU(s) on the node, none can be labelled until nvml describes them"
                ),
                "{s}"
            );
        } else if s["stage"] == "mig" {
            assert_eq!(s["state"], "done", "{s}");
        } else if s["stage"] == "validate" {
            // Checks what is done (the host's driver), says nothing of the rest.
            assert_eq!(s["state"], "done", "{s}");
            assert_eq!(s["detail"], "driver checked", "{s}");
        } else {
            assert_eq!(s["state"], "not-implemented", "{s}");
        }
    }
    assert_eq!(stages[1]["needs"], serde_json::json!(["CAP_SYS_MODULE"]));
    assert_eq!(stages[2]["stage"], "mig");
    assert_eq!(stages[3]["needs"], serde_json::json!(["CAP_MKNOD"]));
}

#[test]
fn status_with_a_simulated_node_plans_the_plugin() {
    let (code, out, err) = run(bin().args(["--simulate", "t4-4", "status", "-o", "json"]));
    assert_eq!(code, NOT_RUNNING, "{err}");
    let st = json(&out);
    let plugin = st["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == "plugin")
        .unwrap()
        .clone();
    // Worked out, but nothing serves it without a running agent.
    assert_eq!(plugin["state"], "ready");
    assert_eq!(plugin["detail"], "nvidia.com/gpu: 4 device(s)");
    // Inspecting writes no labels: it says what it would write.
    let labels = st["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == "labels")
        .unwrap()
        .clone();
    assert_eq!(labels["state"], "ready");
    assert_eq!(
        labels["detail"],
        "would write 27 label(s) to /etc/kubernetes/node-feature-discovery/features.d/gfd"
    );
}

#[test]
fn labels_of_a_simulated_node_are_its_golden_file() {
    let (code, out, err) = run(bin().args(["--simulate", "h100-sxm-8", "labels"]));
    assert_eq!(code, 0, "{err}");
    let golden = fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../crates/gpu-labels/tests/golden/labels/h100-sxm-8.txt"
    ))
    .unwrap();
    assert_eq!(out, golden);
    let (code, out, err) = run(bin().args(["--simulate", "a10g-1", "labels", "-o", "json"]));
    assert_eq!(code, 0, "{err}");
    let l = json(&out);
    assert_eq!(l["nvidia.com/gpu.product"], "NVIDIA-A10G");
    assert_eq!(l["nvidia.com/gpu.machine"], "g5.xlarge");
    // No GPU: no labels, and that is not an error.
    let (code, out, err) = run(bin().args(["--simulate", "no-gpu", "labels"]));
    assert_eq!((code, out.as_str()), (0, ""), "{err}");
}

/// Issue 27 point 5: MPS on GPUs 0-1 only, renamed `gpu.mps`. The labels
/// `--policy` gives say that `nvidia.com/gpu` (the other 6 GPUs) is not
/// shared, and describe `nvidia.com/gpu.mps` under its own name.
#[test]
fn labels_of_a_partly_shared_node_describe_each_resource() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    fs::write(
        &policy,
        "spec:\n  devicePlugin:\n    config:\n      inline:\n        version: v1\n        sharing:\n          mps:\n            resources:\n            - {name: nvidia.com/gpu, devices: [0, 1], replicas: 4, rename: gpu.mps}\n",
    )
    .unwrap();
    let (code, out, err) = run(bin()
        .args(["--simulate", "h100-sxm-8", "--policy"])
        .arg(&policy)
        .arg("labels"));
    assert_eq!(code, 0, "{err}");
    let golden = fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../crates/gpu-labels/tests/golden/labels/mps-gpus-0-1.txt"
    ))
    .unwrap();
    assert_eq!(out, golden);
    for line in [
        "nvidia.com/gpu.count=6",
        "nvidia.com/gpu.replicas=1",
        "nvidia.com/gpu.sharing-strategy=none",
        "nvidia.com/gpu.mps.count=2",
        "nvidia.com/gpu.mps.replicas=4",
        "nvidia.com/gpu.mps.sharing-strategy=mps",
    ] {
        assert!(out.lines().any(|l| l == line), "{line}: {out}");
    }
}

#[test]
fn status_table_shows_policy_disabled_stages() {
    let (code, out, err) = run(at(host_fixture("a10g-1"))
        .arg("--policy")
        .arg(fixture("policies/valid/eks-al2023.yaml"))
        .arg("status"));
    assert_eq!(code, NOT_RUNNING, "{err}");
    assert!(
        row(
            &out,
            "driver",
            "done",
            "host driver 550.127.05 (proprietary) loaded; modules not managed (spec.driver.enabled is false)"
        ),
        "{out}"
    );
    assert!(
        row(&out, "runtime", "disabled", "spec.toolkit.enabled is false"),
        "{out}"
    );
}

#[test]
fn run_once_writes_state_that_status_reports_as_stopped() {
    let host = tempfile::tempdir().unwrap();
    let (code, _, err) = run(at(host.path()).args([
        "--simulate",
        "h100-sxm-8",
        "--log-format",
        "json",
        "run",
        "--once",
    ]));
    assert_eq!(code, 0, "{err}");
    // Logs are JSON events with the stage as a field.
    let events: Vec<Value> = err.lines().map(json).collect();
    assert!(
        events.iter().any(|e| e["fields"]["stage"] == "discover"
            && e["fields"]["gpu_uuid"]
                .as_str()
                .is_some_and(|g| g.starts_with("GPU-"))),
        "{err}"
    );
    let state = json(&fs::read_to_string(host.path().join("run/gpu-agent/state.json")).unwrap());
    assert_eq!(state["format"], 1);
    assert!(state["stopped_at"].is_u64());
    assert_eq!(state["simulated"], "8x H100 SXM");
    let (code, out, _) = run(at(host.path()).args(["status", "-o", "json"]));
    assert_eq!(code, NOT_RUNNING);
    let st = json(&out);
    assert_eq!(st["source"], "host-inspection");
    assert!(
        st["note"].as_str().unwrap().contains("stopped"),
        "{}",
        st["note"]
    );
}

/// `gpu-agent --host-root <host> <args>` in the background, once it has
/// written its state file.
fn start_agent(host: &Path, args: &[&str]) -> (std::process::Child, std::path::PathBuf) {
    // No inherited pipes: an agent left behind by a failing test must not
    // keep the test run waiting on its output.
    let child = at(host)
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let state_file = host.join("run/gpu-agent/state.json");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !state_file.exists() {
        assert!(Instant::now() < deadline, "the agent wrote no state file");
        std::thread::sleep(Duration::from_millis(20));
    }
    (child, state_file)
}

#[test]
fn running_agent_is_seen_by_status_and_stops_on_sigterm() {
    let host = tempfile::tempdir().unwrap();
    let (mut child, state_file) = start_agent(
        host.path(),
        &["--simulate", "t4-4", "run", "--heartbeat", "1"],
    );
    let (code, out, err) = run(at(host.path()).arg("status"));
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!("from the running agent (pid {}", child.id())),
        "{out}"
    );
    assert!(out.contains("simulating 4x T4"), "{out}");
    assert_eq!(sigterm(&mut child), Some(0));
    let state = json(&fs::read_to_string(&state_file).unwrap());
    assert!(state["stopped_at"].is_u64(), "{state}");
}

/// `status` exits 0 only when the running agent answered; a `status` that
/// cannot see it (none ran, it stopped, or the host root is not the one it
/// manages) says so and exits 3, in either output form. The host root may
/// come from the environment (`GPU_AGENT_HOST_ROOT`, as the DaemonSet's
/// container sets it for `kubectl exec`) instead of `--host-root`.
#[test]
fn status_exits_non_zero_when_it_cannot_see_the_running_agent() {
    let host = tempfile::tempdir().unwrap();
    let nobody = tempfile::tempdir().unwrap();
    let (mut child, _) = start_agent(host.path(), &["--simulate", "a10g-1", "run"]);
    for args in [&["status"][..], &["status", "-o", "json"]] {
        // The agent's host root, by argument and by environment.
        let (code, out, err) = run(at(host.path()).args(args));
        assert_eq!(code, 0, "{args:?}: {out}{err}");
        assert!(out.contains("from the running agent"), "{out}");
        let (code, out, err) = run(bin().env("GPU_AGENT_HOST_ROOT", host.path()).args(args));
        assert_eq!(code, 0, "GPU_AGENT_HOST_ROOT, {args:?}: {out}{err}");
        assert!(out.contains("from the running agent"), "{out}");
        // Another host root: no agent there, an inspection, exit 3.
        let (code, out, err) = run(bin()
            .env("GPU_AGENT_HOST_ROOT", nobody.path())
            .args(["--simulate", "a10g-1"])
            .args(args));
        assert_eq!(code, NOT_RUNNING, "{args:?}: {out}{err}");
        assert!(out.contains("no running agent"), "{out}");
        assert!(out.contains("inspecting the host"), "{out}");
    }
    assert_eq!(sigterm(&mut child), Some(0));
    // Stopped: what it last said is not shown as the running agent's.
    let (code, out, err) = run(at(host.path()).args(["--simulate", "a10g-1", "status"]));
    assert_eq!(code, NOT_RUNNING, "{out}{err}");
    assert!(
        out.contains("stopped") && out.contains("inspecting the host"),
        "{out}"
    );
    // `status --ready` keeps its own codes: 1, not ready.
    let (code, out, _) = run(at(host.path()).args(["status", "--ready"]));
    assert_eq!(code, 1, "{out}");
}

/// Under systemd, stderr is the journal stream named by JOURNAL_STREAM
/// (`<dev>:<inode>`). `--log-format auto` then logs to the journal (or, where
/// no journald listens, says so and falls back to text); a JOURNAL_STREAM
/// that names another file is ignored.
#[test]
fn auto_log_format_follows_journal_stream() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let host = tempfile::tempdir().unwrap();
    let run_with = |stream_of: &Path| {
        let log = dir.path().join("stderr.log");
        let file = fs::File::create(&log).unwrap();
        let meta = fs::metadata(stream_of).unwrap_or_else(|_| fs::metadata(&log).unwrap());
        let status = at(host.path())
            .args(["--simulate", "a10g-1", "run", "--once"])
            .env("JOURNAL_STREAM", format!("{}:{}", meta.dev(), meta.ino()))
            .stderr(file)
            .status()
            .unwrap();
        assert!(status.success());
        fs::read_to_string(&log).unwrap()
    };
    // JOURNAL_STREAM names our stderr: journal (or the fallback note).
    let err = run_with(&dir.path().join("stderr.log"));
    let journal_reached = !err.contains("gpu-agent starting");
    let fell_back = err.contains("cannot log to the journal");
    assert!(journal_reached || fell_back, "{err}");
    // JOURNAL_STREAM names some other file: plain text on stderr.
    let other = dir.path().join("other");
    fs::write(&other, "").unwrap();
    let err = run_with(&other);
    assert!(err.contains("gpu-agent starting"), "{err}");
    assert!(!err.contains("cannot log to the journal"), "{err}");
}

/// `gpu-agent run` serves the device plugin: it registers with a kubelet
/// listening in the host root, and `status` shows the resource registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_registers_the_device_plugin_with_the_kubelet() {
    use gpu_agent::plugin::kubelet::MockKubelet;
    let host = tempfile::tempdir().unwrap();
    let dir = host.path().join("var/lib/kubelet/device-plugins");
    fs::create_dir_all(&dir).unwrap();
    let kubelet = MockKubelet::start(&dir.join("kubelet.sock")).unwrap();
    // No heartbeat: the state is written because the registration changed it.
    let mut child = at(host.path())
        .args(["--simulate", "h100-sxm-8", "run"])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    assert!(
        kubelet.wait_for(1, Duration::from_secs(10)).await,
        "the agent did not register"
    );
    assert_eq!(kubelet.registrations()[0].resource_name, "nvidia.com/gpu");
    // The agent writes its state when the registration changes it.
    let deadline = Instant::now() + Duration::from_secs(10);
    let st = loop {
        let (_, out, _) = run(at(host.path()).args(["status", "-o", "json"]));
        let st = json(&out);
        if st["plugin"][0]["registered"] == true {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "status never showed the registration: {st}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(st["source"], "running-agent");
    assert_eq!(st["plugin"][0]["devices"], 8);
    let plugin = st["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == "plugin")
        .unwrap()
        .clone();
    assert_eq!(plugin["state"], "done");
    assert_eq!(sigterm(&mut child), Some(0));
    assert!(
        !dir.join("nvidia-gpu.sock").exists(),
        "the agent left its socket behind"
    );
    kubelet.stop().await;
}

/// SIGHUP re-reads the policy: switching the MIG strategy from mixed to none
/// unregisters the MIG resources (their sockets go) and registers
/// `nvidia.com/gpu` — no stale capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_applies_a_new_mig_strategy_without_stale_resources() {
    use gpu_agent::plugin::kubelet::MockKubelet;
    let host = tempfile::tempdir().unwrap();
    let dir = host.path().join("var/lib/kubelet/device-plugins");
    fs::create_dir_all(&dir).unwrap();
    let policy = host.path().join("policy.yaml");
    fs::write(&policy, "spec:\n  mig:\n    strategy: mixed\n").unwrap();
    let kubelet = MockKubelet::start(&dir.join("kubelet.sock")).unwrap();
    let mut child = at(host.path())
        .arg("--policy")
        .arg(&policy)
        .args(["--simulate", "h100-mig-2", "run", "--heartbeat", "1"])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    assert!(
        kubelet.wait_for(3, Duration::from_secs(10)).await,
        "the MIG resources did not register"
    );
    assert!(dir.join("nvidia-mig-3g.40gb.sock").exists());
    fs::write(&policy, "spec:\n  mig:\n    strategy: none\n").unwrap();
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
    assert!(
        kubelet.wait_for(4, Duration::from_secs(5)).await,
        "nvidia.com/gpu did not register after SIGHUP"
    );
    assert_eq!(kubelet.registrations()[3].resource_name, "nvidia.com/gpu");
    let deadline = Instant::now() + Duration::from_secs(5);
    while dir.join("nvidia-mig-3g.40gb.sock").exists()
        || dir.join("nvidia-mig-1g.10gb.sock").exists()
    {
        assert!(
            Instant::now() < deadline,
            "MIG sockets still there after the strategy change"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(sigterm(&mut child), Some(0));
    kubelet.stop().await;
}

/// The runtime stage of `run`: configures containerd once; the next run
/// finds nothing to change and does not reload. A reload that fails says so.
#[test]
fn run_configures_the_runtime_once_and_reloads_only_on_change() {
    let host = tempfile::tempdir().unwrap();
    fs::create_dir_all(host.path().join("etc/containerd")).unwrap();
    fs::copy(
        fixture("containerd/valid/v3.toml"),
        host.path().join("etc/containerd/config.toml"),
    )
    .unwrap();
    let policy = host.path().join("policy.yaml");
    let runtime_stage = |policy_text: &str| {
        fs::write(&policy, policy_text).unwrap();
        let (code, _, err) = run(at(host.path()).arg("--policy").arg(&policy).args([
            "--simulate",
            "a10g-1",
            "run",
            "--once",
        ]));
        let state =
            json(&fs::read_to_string(host.path().join("run/gpu-agent/state.json")).unwrap());
        let st = state["stages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["stage"] == "runtime")
            .unwrap()
            .clone();
        (code, st, err)
    };
    // A restart through the host's systemd cannot work in a temp dir: it says so.
    let (code, st, _) = runtime_stage("spec:\n  toolkit:\n    reload: restart\n");
    assert_eq!(code, 1);
    assert_eq!(st["state"], "failed");
    let detail = st["detail"].as_str().unwrap();
    assert!(
        detail.starts_with("wrote /etc/containerd/config.toml, but reloading containerd: `chroot "),
        "{detail}"
    );
    // The file is written; the next run changes nothing and reloads nothing.
    let (code, st, err) = runtime_stage("spec:\n  toolkit:\n    reload: restart\n");
    assert_eq!(code, 0, "{err}");
    assert_eq!(st["state"], "done");
    assert!(
        st["detail"]
            .as_str()
            .unwrap()
            .starts_with("containerd already configured; not reloaded"),
        "{st}"
    );
}

/// Logs written to a file or pipe carry no colour codes (what `kubectl
/// logs` shows), in the default `auto` format and in `text`.
#[test]
fn text_logs_into_a_pipe_have_no_colour_codes() {
    let host = tempfile::tempdir().unwrap();
    for format in ["auto", "text"] {
        let (code, _, err) = run(at(host.path()).args([
            "--simulate",
            "t4-4",
            "--log-format",
            format,
            "run",
            "--once",
        ]));
        assert_eq!(code, 0, "{err}");
        assert!(err.contains("found GPU"), "{err}");
        assert!(
            !err.contains('\u{1b}'),
            "colour codes in {format} logs: {err:?}"
        );
    }
}

#[test]
fn a_missing_policy_file_is_named_once() {
    let (code, _, err) = run(bin().args(["--policy", "/nonexistent.yaml", "status"]));
    assert_eq!(code, 2);
    assert_eq!(
        err.trim(),
        "error: /nonexistent.yaml: No such file or directory (os error 2)"
    );
}

/// A containerd 1.6 host (version from its own binary, run through the host
/// root) with a CDI device-list strategy: `status` and the log say that the
/// CDI names the plugin hands out lead nowhere.
#[test]
fn cdi_names_on_a_runtime_without_cdi_are_warned_about() {
    use std::os::unix::fs::PermissionsExt;
    let host = tempfile::tempdir().unwrap();
    let bin_dir = host.path().join("usr/bin");
    fs::create_dir_all(&bin_dir).unwrap();
    fs::create_dir_all(host.path().join("etc/containerd")).unwrap();
    fs::copy(
        fixture("containerd/valid/v2-default-1.6.toml"),
        host.path().join("etc/containerd/config.toml"),
    )
    .unwrap();
    for (name, body) in [
        (
            "containerd",
            "#!/bin/sh\necho 'containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1'\n",
        ),
        ("nvidia-container-runtime", "#!/bin/sh\nexit 0\n"),
    ] {
        let p = bin_dir.join(name);
        fs::write(&p, body).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
    }
    let policy = host.path().join("policy.yaml");
    fs::write(
        &policy,
        "spec:\n  devicePlugin:\n    deviceListStrategy: [cdi-annotations]\n",
    )
    .unwrap();
    let (code, out, err) = run(at(host.path())
        .args(["--simulate", "h100-sxm-8", "--policy"])
        .arg(&policy)
        .args(["status", "-o", "json"]));
    assert_eq!(code, NOT_RUNNING, "{err}");
    let st = json(&out);
    let plugin = st["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == "plugin")
        .unwrap();
    let detail = plugin["detail"].as_str().unwrap();
    assert!(
        detail.contains("hands out CDI names, but containerd 1.6.20 has no CDI support"),
        "{detail}"
    );
    assert!(err.contains("containers get no GPU through them"), "{err}");
    // With envvar there is nothing to warn about.
    fs::write(&policy, "spec: {}\n").unwrap();
    let (_, out, _) = run(at(host.path())
        .args(["--simulate", "h100-sxm-8", "--policy"])
        .arg(&policy)
        .args(["status", "-o", "json"]));
    assert!(!out.contains("hands out CDI names"), "{out}");
}

/// An idle agent does not rewrite its state file: same inode and bytes over
/// several heartbeats; only the modification time moves (the sign of life
/// `status` reads).
#[test]
fn idle_agent_stamps_but_does_not_rewrite_its_state() {
    use std::os::unix::fs::MetadataExt;
    let host = tempfile::tempdir().unwrap();
    let (mut child, state_file) = start_agent(
        host.path(),
        &["--simulate", "t4-4", "run", "--heartbeat", "1"],
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    // Settled: the plugin stage has said what it could (no kubelet here)
    // and the deferred CDI stage has run (it copies the agent's binary).
    loop {
        assert!(
            Instant::now() < deadline,
            "the agent wrote no settled state"
        );
        if let Ok(text) = fs::read_to_string(&state_file)
            && text.contains("not registered")
            && text.contains("hook program(s) exist")
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let before = fs::metadata(&state_file).unwrap();
    let bytes = fs::read(&state_file).unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    let after = fs::metadata(&state_file).unwrap();
    assert_eq!(after.ino(), before.ino(), "the state file was rewritten");
    assert_eq!(fs::read(&state_file).unwrap(), bytes);
    assert!(after.mtime() > before.mtime(), "no heartbeat stamp");
    let (code, out, _) = run(at(host.path()).arg("status"));
    assert_eq!(code, 0);
    assert!(out.contains("from the running agent"), "{out}");
    assert_eq!(sigterm(&mut child), Some(0));
}

/// A live agent is known by its lock, with no heartbeat at all; a second
/// agent on the same host is refused; an agent killed with SIGKILL (no
/// chance to say it stopped) is seen as gone at once.
#[test]
fn liveness_is_the_agents_lock() {
    let host = tempfile::tempdir().unwrap();
    let (mut child, _) = start_agent(host.path(), &["--simulate", "t4-4", "run"]);
    let (_, out, _) = run(at(host.path()).arg("status"));
    assert!(
        out.contains(&format!("from the running agent (pid {}", child.id())),
        "{out}"
    );
    let (code, _, err) = run(at(host.path()).args(["--simulate", "t4-4", "run", "--once"]));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!(
            "another gpu-agent is running on this host (pid {} holds ",
            child.id()
        )) && err.contains(&format!(", or kill {})", child.id())),
        "{err}"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    child.wait().unwrap();
    let (_, out, _) = run(at(host.path()).arg("status"));
    assert!(
        out.contains(&format!(
            "the agent (pid {}) is not running and did not say it stopped",
            child.id()
        )),
        "{out}"
    );
}

#[test]
fn policy_check_takes_the_operators_config_map_shapes_and_uses_only_gpu_agents_keys() {
    let (code, out, err) = run(bin()
        .args(["policy", "check", "--effective"])
        .arg(fixture("policies/valid/operator-config-maps.yaml")));
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("valid policy"), "{out}");
    // The parameters are used; the ConfigMap names are not (a node's agent
    // cannot read them), so the effective policy has neither name.
    assert!(out.contains("NVreg_EnableGpuFirmware: '0'"), "{out}");
    assert!(!out.contains("kernel-module-params"), "{out}");
    assert!(!out.contains("custom-dcgm-metrics"), "{out}");
    // A wrong type at a key gpu-agent uses is still refused, naming it.
    let (code, _, err) = run(bin().args(["policy", "check"]).arg(fixture(
        "policies/invalid/driver-kernel-module-config-name.yaml",
    )));
    assert_eq!(code, 2);
    assert!(
        err.contains("spec.driver.kernelModuleConfig.name: invalid type"),
        "{err}"
    );
}
