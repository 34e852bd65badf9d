//! A rolling update of the agent does not disturb running GPU pods.
//!
//! As a DaemonSet rolling update does: the running `gpu-agent run` gets
//! SIGTERM and a new one starts on the same node (the same host files),
//! while a kubelet stand-in we did not write (Python grpcio,
//! tests/interop/kubelet_rolling_standin.py) keeps running and holds an
//! allocation made by the first agent. The node is a copy of the 8x H100
//! host fixture with the fake libnvidia-ml (the real NVML path), Debian
//! sid's containerd 2.x and a `systemctl` inside the host root that only
//! notes how it was called (the agent restarts containerd through
//! `chroot <host> systemctl restart containerd`, `spec.toolkit.reload:
//! restart`, the default).
//!
//! Proven: the stand-in sees the same resource re-registered at the same
//! endpoint, with the same device IDs, every list from either agent all
//! Healthy; Allocate of the held IDs answers exactly as before; every host
//! file a running pod relies on (containerd's config, the CDI spec, the
//! installed CDI hook program, the device nodes, the labels file, the
//! driver and toolkit validation files) keeps its bytes, inode, mode,
//! mtime and ctime, through the shutdown and through the new start; the
//! host changes nowhere but in the agent's own state, its plugin socket
//! and plugin-ready; containerd is restarted once (by the first agent,
//! which configured it) and never again. The gap during which the kubelet
//! has no plugin is measured and printed.
//!
//! Device nodes are made for real (mknod) and `systemctl` runs chrooted,
//! so this runs as root.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// Files up to this size are compared byte for byte; bigger ones (the
/// installed copy of the agent, hundreds of MB in a debug build) by inode,
/// size, mtime and ctime: any write to a file moves its ctime, and user
/// space cannot set it back.
const COMPARE_BYTES_UP_TO: u64 = 8 << 20;

/// What one entry under the host root is: type and mode, inode, device
/// number, size, mtime, ctime, and (for small files) the bytes, or the
/// target of a link.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    mode: u32,
    ino: u64,
    rdev: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
    content: Option<Vec<u8>>,
    link: Option<PathBuf>,
}

type Snapshot = BTreeMap<String, Entry>;

fn snapshot(root: &Path) -> Snapshot {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            // Gone between the listing and the look (a temp file being
            // renamed into place): it is not part of the picture.
            let Ok(m) = fs::symlink_metadata(&p) else {
                continue;
            };
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let content = (m.is_file() && m.size() <= COMPARE_BYTES_UP_TO)
                .then(|| fs::read(&p).ok())
                .flatten();
            let link = m
                .file_type()
                .is_symlink()
                .then(|| fs::read_link(&p).unwrap());
            if m.is_dir() {
                stack.push(p);
            }
            out.insert(
                rel,
                Entry {
                    mode: m.mode(),
                    ino: m.ino(),
                    rdev: m.rdev(),
                    size: m.size(),
                    mtime: (m.mtime(), m.mtime_nsec()),
                    ctime: (m.ctime(), m.ctime_nsec()),
                    content,
                    link,
                },
            );
        }
    }
    out
}

/// The paths that differ between two snapshots (added, removed, changed),
/// each with what changed.
fn differences(a: &Snapshot, b: &Snapshot) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for (path, x) in a {
        match b.get(path) {
            None => {
                out.insert(path.clone(), "removed".into());
            }
            Some(y) if x != y => {
                let mut what = Vec::new();
                if x.content != y.content || x.size != y.size {
                    what.push("content");
                }
                if x.ino != y.ino {
                    what.push("inode");
                }
                if x.mode != y.mode {
                    what.push("mode");
                }
                if x.rdev != y.rdev {
                    what.push("device number");
                }
                if x.mtime != y.mtime {
                    what.push("mtime");
                }
                if x.ctime != y.ctime {
                    what.push("ctime");
                }
                if x.link != y.link {
                    what.push("link target");
                }
                out.insert(path.clone(), what.join(", "));
            }
            Some(_) => {}
        }
    }
    for path in b.keys() {
        if !a.contains_key(path) {
            out.insert(path.clone(), "added".into());
        }
    }
    out
}

/// What the running pods rely on, under the host root: the runtime's
/// config, the CDI spec and the program its hooks run, the device nodes,
/// the labels file (node labels through NFD), the operator's driver and
/// toolkit validation files.
const PODS_RELY_ON: &[&str] = &[
    "etc/containerd",
    "var/run/cdi",
    "var/lib/gpu-agent/bin/gpu-agent",
    "dev/nvidia",
    "etc/kubernetes/node-feature-discovery/features.d/gfd",
    "run/nvidia/validations/driver-ready",
    "run/nvidia/validations/toolkit-ready",
];

fn relied_on(path: &str) -> bool {
    PODS_RELY_ON.iter().any(|p| path.starts_with(p))
}

/// What a restart of the agent may change, and why: its own state and
/// lock, its plugin socket (removed at SIGTERM, served anew), plugin-ready
/// (no plugin serves in between), the directories that hold them.
const AGENT_OWN: &[&str] = &[
    "run/gpu-agent",
    "var/lib/kubelet/device-plugins/nvidia-gpu.sock",
    "var/lib/kubelet/device-plugins",
    "run/nvidia/validations/plugin-ready",
    "run/nvidia/validations",
];

/// The kubelet stand-in, running for the whole test.
struct Kubelet {
    child: Child,
    stdin: Option<ChildStdin>,
    events: mpsc::Receiver<Value>,
    seen: Vec<Value>,
}

impl Kubelet {
    fn start(dir: &Path) -> Kubelet {
        let mut child = Command::new(python())
            .arg(repo().join("tests/interop/kubelet_rolling_standin.py"))
            .arg("--proto")
            .arg(repo().join("proto/proto/deviceplugin_v1beta1.proto"))
            .arg("--dir")
            .arg(dir)
            .args(["--size", "2"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, events) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(json(&line));
            }
        });
        let ksock = dir.join("kubelet.sock");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !ksock.exists() {
            assert!(
                Instant::now() < deadline,
                "the Python kubelet did not listen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Kubelet {
            stdin: child.stdin.take(),
            child,
            events,
            seen: Vec::new(),
        }
    }

    /// The first event (seen or coming within `secs`) with `event` and
    /// registration number `n`.
    fn wait(&mut self, secs: u64, event: &str, n: u64, log: &dyn Fn() -> String) -> Value {
        let matches = |e: &Value| e["event"] == event && e["n"] == n;
        if let Some(e) = self.seen.iter().find(|e| matches(e)) {
            return e.clone();
        }
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(e) => {
                    self.seen.push(e.clone());
                    assert_ne!(e["event"], "error", "the kubelet stand-in: {e}");
                    if matches(&e) {
                        return e;
                    }
                }
                Err(_) => panic!(
                    "no {event} #{n} from the kubelet stand-in within {secs} s\nseen: {:#?}\nagent log:\n{}",
                    self.seen,
                    log()
                ),
            }
        }
    }

    /// Takes in what came meanwhile.
    fn drain(&mut self) {
        while let Ok(e) = self.events.try_recv() {
            self.seen.push(e);
        }
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The node: a copy of the 8x H100 fixture, containerd 2.x, a recording
/// `systemctl`, a FIFO for /dev/kmsg.
struct Node {
    dir: tempfile::TempDir,
    logs: tempfile::TempDir,
    _nvml_dir: tempfile::TempDir,
    nvml: PathBuf,
    policy: PathBuf,
}

/// How many agents run one after another (the first, then one per
/// rolling update).
const AGENTS: u32 = 6;

/// Where the recording `systemctl` notes its calls (a host path).
const SYSTEMCTL_CALLS: &str = "var/log/systemctl.calls";

impl Node {
    fn new() -> Node {
        let dir = copy_host_fixture("h100-sxm-8");
        let host = dir.path();
        fs::create_dir_all(host.join("etc/containerd")).unwrap();
        fs::copy(
            fixture("containerd/valid/v2-custom.toml"),
            host.join("etc/containerd/config.toml"),
        )
        .unwrap();
        install_containerd_2(host);
        // A shell and a systemctl inside the host root: `chroot <host>
        // systemctl restart containerd` runs them and leaves a line.
        fs::create_dir_all(host.join("bin")).unwrap();
        fs::copy("/bin/busybox", host.join("bin/busybox")).unwrap();
        std::os::unix::fs::symlink("busybox", host.join("bin/sh")).unwrap();
        fs::create_dir_all(host.join("var/log")).unwrap();
        fs::write(
            host.join("usr/bin/systemctl"),
            format!("#!/bin/sh\necho \"$*\" >> /{SYSTEMCTL_CALLS}\n"),
        )
        .unwrap();
        fs::set_permissions(
            host.join("usr/bin/systemctl"),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        nix::unistd::mkfifo(
            &host.join("dev/kmsg"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        fs::create_dir_all(host.join("var/lib/kubelet/device-plugins")).unwrap();
        let logs = tempfile::tempdir().unwrap();
        // The policy: the defaults of the runtime and CDI (restart
        // containerd when its config changed; the agent installs the hook
        // program); every device-list strategy that fills a field of the
        // Allocate answer (annotations, CDI devices, mounts, environment)
        // and device specs, so that comparing answers compares them all;
        // no interval reconcile in the way of the timing.
        let policy = logs.path().join("policy.yaml");
        fs::write(
            &policy,
            "spec:\n  reconcileIntervalSeconds: 0\n  devicePlugin:\n    deviceListStrategy: [cdi-annotations, cdi-cri, volume-mounts]\n    passDeviceSpecs: true\n",
        )
        .unwrap();
        let (nvml_dir, nvml) = fake_nvml();
        Node {
            dir,
            logs,
            _nvml_dir: nvml_dir,
            nvml,
            policy,
        }
    }

    fn host(&self) -> &Path {
        self.dir.path()
    }

    fn plugin_dir(&self) -> PathBuf {
        self.host().join("var/lib/kubelet/device-plugins")
    }

    fn log_path(&self, n: u32) -> PathBuf {
        self.logs.path().join(format!("agent-{n}.log"))
    }

    fn logs(&self) -> String {
        (1..=AGENTS)
            .map(|n| {
                format!(
                    "--- agent {n} ---\n{}",
                    fs::read_to_string(self.log_path(n)).unwrap_or_default()
                )
            })
            .collect()
    }

    /// Starts agent number `n` (its log in agent-n.log).
    fn agent(&self, n: u32) -> Agent {
        Agent(
            at(self.host())
                .arg("--policy")
                .arg(&self.policy)
                .arg("--nvml-lib")
                .arg(&self.nvml)
                .args(["--log-format", "text", "run"])
                .env("FAKE_NVML_NODE", "h100-sxm-8")
                .env("FAKE_NVML_STATE", "/nonexistent")
                .env("RUST_LOG", "info")
                .stdout(Stdio::null())
                .stderr(fs::File::create(self.log_path(n)).unwrap())
                .spawn()
                .unwrap(),
        )
    }

    /// Waits until the running agent (pid `pid`) says it is ready.
    fn until_ready(&self, pid: u32) -> Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (code, out, err) = run(at(self.host()).args(["status", "-o", "json"]));
            assert_eq!(code, 0, "{err}");
            let st = json(&out);
            // The state file says whose status it is.
            let state = fs::read_to_string(self.host().join("run/gpu-agent/state.json"))
                .map(|s| json(&s))
                .unwrap_or_default();
            if st["source"] == "running-agent" && state["pid"] == pid && st["ready"] == true {
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "agent {pid} not ready within 60 s\nstatus: {st:#}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn systemctl_calls(&self) -> String {
        fs::read_to_string(self.host().join(SYSTEMCTL_CALLS)).unwrap_or_default()
    }
}

/// A running agent, killed if the test ends before its SIGTERM.
struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Opens the FIFO's write end once the agent has the read end (the agent
/// follows the kernel log; the test holds the writer for the whole run).
fn kmsg_writer(host: &Path, logs: &dyn Fn() -> String) -> fs::File {
    use std::os::unix::fs::OpenOptionsExt;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(host.join("dev/kmsg"))
        {
            Ok(f) => return f,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("the agent never opened /dev/kmsg: {e}\n{}", logs()),
        }
    }
}

fn monotonic() -> f64 {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).unwrap();
    t.tv_sec() as f64 + t.tv_nsec() as f64 / 1e9
}

fn ids_and_health(list: &Value) -> Vec<(String, String)> {
    list["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["id"].as_str().unwrap().to_string(),
                d["health"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn root() -> bool {
    nix::unistd::geteuid().is_root()
}

#[test]
fn a_restarted_agent_leaves_running_gpu_pods_undisturbed() {
    if !root() {
        eprintln!(
            "skipped: the agent makes device nodes (mknod) and systemctl runs chrooted: needs root"
        );
        return;
    }
    let node = Node::new();
    let logs = || node.logs();
    let mut kubelet = Kubelet::start(&node.plugin_dir());

    // The old agent: it configures the node, registers, the stand-in
    // allocates two GPUs (the pod's).
    let old = node.agent(1);
    let mut kmsg = kmsg_writer(node.host(), &logs);
    let reg1 = kubelet.wait(60, "registered", 1, &logs);
    let list1 = kubelet.wait(20, "list", 1, &logs);
    let alloc1 = kubelet.wait(20, "allocated", 1, &logs);
    let st1 = node.until_ready(old.0.id());
    for s in ["driver", "devnodes", "runtime", "cdi", "plugin", "labels"] {
        assert_eq!(stage(&st1, s)["state"], "done", "{s}: {st1:#}");
    }
    // The first agent changed containerd's config and restarted it: the
    // recording systemctl sees a restart when there is one.
    let calls_before = node.systemctl_calls();
    assert_eq!(calls_before, "restart containerd\n", "{}", logs());
    let held: Vec<String> = alloc1["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    assert_eq!(held.len(), 2, "{alloc1}");
    let answer1 = alloc1["response"]["container_responses"][0].clone();
    // The pod's answer names its GPUs in every field: comparing it later
    // compares something.
    let names = |field: &str, key: &str| -> Vec<String> {
        answer1[field]
            .as_array()
            .unwrap_or_else(|| panic!("no {field} in {answer1:#}"))
            .iter()
            .map(|v| v[key].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(
        names("cdi_devices", "name"),
        held.iter()
            .map(|id| format!("nvidia.com/gpu={id}"))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        names("mounts", "container_path"),
        held.iter()
            .map(|id| format!("/var/run/nvidia-container-devices/{id}"))
            .collect::<Vec<_>>()
    );
    assert!(
        names("devices", "container_path").contains(&"/dev/nvidiactl".to_string()),
        "{answer1:#}"
    );
    assert_eq!(
        answer1["annotations"]["cdi.k8s.io/gpu-agent_gpu"],
        names("cdi_devices", "name").join(",")
    );
    assert_eq!(
        answer1["envs"]["NVIDIA_VISIBLE_DEVICES"],
        "/var/run/nvidia-container-devices"
    );
    let before = snapshot(node.host());
    for f in PODS_RELY_ON {
        assert!(
            before.keys().any(|p| p.starts_with(f)),
            "{f} is not on the host: nothing would be compared\n{}",
            logs()
        );
    }

    let log1 = fs::read_to_string(node.log_path(1)).unwrap();
    for said in ["wrote host file", "host changed"] {
        assert!(log1.contains(said), "agent 1 never says {said:?}:\n{log1}");
    }

    // Rolling updates, one after another: SIGTERM (as the DaemonSet
    // controller's pod deletion sends it), then a new agent on the same node.
    let t = |e: &Value| e["t"].as_f64().unwrap();
    let mut running = old;
    let mut gaps = Vec::new();
    for n in 2..=AGENTS {
        let prev = u64::from(n - 1);
        let t_term = monotonic();
        assert_eq!(sigterm(&mut running.0), Some(0), "{}", logs());
        let t_exit = monotonic();
        let end = kubelet.wait(10, "stream_end", prev, &logs);
        let during = snapshot(node.host());

        let t_start = monotonic();
        running = node.agent(n);
        let reg = kubelet.wait(60, "registered", n.into(), &logs);
        let list = kubelet.wait(20, "list", n.into(), &logs);
        let alloc = kubelet.wait(20, "allocated", n.into(), &logs);
        node.until_ready(running.0.id());
        let after = snapshot(node.host());
        kubelet.drain();

        // The gap the kubelet had no plugin for the resource: from the old
        // plugin's stream ending to the new one registering, and to its
        // first list (the devices advertised again).
        let gap_registered = t(&reg) - t(&end);
        let gap_listed = t(&list) - t(&end);
        eprintln!(
            "rolling update {}: SIGTERM to exit {:.0} ms; old stream ended ({}) {:.0} ms after \
             SIGTERM; new agent registered {:.0} ms after its start; no plugin registered for \
             {:.0} ms, devices advertised again after {:.0} ms",
            n - 1,
            (t_exit - t_term) * 1e3,
            end["code"],
            (t(&end) - t_term) * 1e3,
            (t(&reg) - t_start) * 1e3,
            gap_registered * 1e3,
            gap_listed * 1e3,
        );
        assert!(gap_registered > 0.0 && gap_listed >= gap_registered);
        gaps.push(gap_listed);

        // Re-registered: the same resource, at the same endpoint, the same
        // devices, all healthy, in every list any plugin sent.
        assert_eq!(reg1["request"], reg["request"]);
        assert_eq!(reg["request"]["resource_name"], "nvidia.com/gpu");
        assert_eq!(ids_and_health(&list1), ids_and_health(&list));
        assert_eq!(ids_and_health(&list1).len(), 8);
        for e in kubelet.seen.iter().filter(|e| e["event"] == "list") {
            for (id, health) in ids_and_health(e) {
                assert_eq!(health, "Healthy", "{id} in list #{}: {e}", e["n"]);
            }
        }
        for h in &held {
            assert!(ids_and_health(&list).iter().any(|(id, _)| id == h));
        }
        // The held devices, allocated again: the same answer, to the byte.
        assert_eq!(alloc["ids"], alloc1["ids"]);
        assert_eq!(
            alloc["response"],
            alloc1["response"],
            "Allocate of {held:?} answers differently after restart {}",
            n - 1
        );

        // The host: what the pods rely on is untouched, through the
        // shutdown and through the new start; nothing else changed but the
        // agent's own.
        for (when, snap) in [("after SIGTERM", &during), ("after the new start", &after)] {
            let diff = differences(&before, snap);
            let touched: Vec<_> = diff.iter().filter(|(p, _)| relied_on(p)).collect();
            assert!(
                touched.is_empty(),
                "restart {}, {when}: host files the pods rely on changed: {touched:#?}\n{}",
                n - 1,
                logs()
            );
            let other: Vec<_> = diff
                .iter()
                .filter(|(p, _)| !AGENT_OWN.iter().any(|own| p.starts_with(own)))
                .collect();
            assert!(
                other.is_empty(),
                "restart {}, {when}: the host changed: {other:#?}\n{}",
                n - 1,
                logs()
            );
            if n == 2 {
                eprintln!("{when}, changed on the host: {diff:?}");
            }
        }
        // The old plugin's socket was removed and the new one served in
        // its place.
        assert!(!during.contains_key("var/lib/kubelet/device-plugins/nvidia-gpu.sock"));
        assert!(after.contains_key("var/lib/kubelet/device-plugins/nvidia-gpu.sock"));
        // containerd was not restarted again.
        assert_eq!(node.systemctl_calls(), calls_before, "{}", logs());
        // The new agent's own account agrees: it wrote no host file,
        // changed nothing, restarted nothing (the first agent's log says
        // so when it does).
        let log = fs::read_to_string(node.log_path(n)).unwrap();
        for said in ["wrote host file", "host changed", "restarted containerd"] {
            let lines: Vec<_> = log.lines().filter(|l| l.contains(said)).collect();
            assert!(lines.is_empty(), "agent {n}: {lines:#?}");
        }
    }
    gaps.sort_by(f64::total_cmp);
    eprintln!(
        "{} rolling updates: devices not advertised for {:.0} ms at least, {:.0} ms median, {:.0} ms at most",
        gaps.len(),
        gaps[0] * 1e3,
        gaps[gaps.len() / 2] * 1e3,
        gaps[gaps.len() - 1] * 1e3
    );
    let mut new = running;

    // Control: the stand-in's watch is live on the new agent. An XID for
    // GPU 3 (bus 0000:5d:00) turns a device Unhealthy in its stream.
    let line = "3,9001,0,-;NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n";
    kmsg.write_all(line.as_bytes()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let unhealthy = loop {
        kubelet.drain();
        let found = kubelet.seen.iter().find(|e| {
            e["event"] == "list"
                && e["n"] == u64::from(AGENTS)
                && ids_and_health(e).iter().any(|(_, h)| h == "Unhealthy")
        });
        if let Some(e) = found {
            break e.clone();
        }
        assert!(
            Instant::now() < deadline,
            "the XID never reached the stand-in's stream\n{}",
            logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let bad: Vec<_> = ids_and_health(&unhealthy)
        .into_iter()
        .filter(|(_, h)| h == "Unhealthy")
        .collect();
    assert_eq!(bad.len(), 1, "{unhealthy}");
    assert_eq!(sigterm(&mut new.0), Some(0), "{}", logs());
}

/// The comparison is not blind: it flags a file rewritten with the same
/// bytes (atomically: a new inode; in place: a new ctime), a big file
/// written in place, a changed mode and a removed file, and nothing
/// when nothing happened.
#[test]
fn the_snapshot_comparison_sees_a_rewritten_file() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    fs::create_dir_all(root.join("etc/containerd")).unwrap();
    fs::create_dir_all(root.join("var/run/cdi")).unwrap();
    fs::create_dir_all(root.join("var/lib/gpu-agent/bin")).unwrap();
    let config = root.join("etc/containerd/config.toml");
    let spec = root.join("var/run/cdi/spec.json");
    let big = root.join("var/lib/gpu-agent/bin/gpu-agent");
    fs::write(&config, "version = 2\n").unwrap();
    fs::write(&spec, "{}\n").unwrap();
    fs::write(&big, vec![7u8; COMPARE_BYTES_UP_TO as usize + 1]).unwrap();
    let s0 = snapshot(root);
    assert!(differences(&s0, &snapshot(root)).is_empty());

    // The same bytes, renamed into place: a new inode.
    std::thread::sleep(Duration::from_millis(20));
    let tmp = root.join("etc/containerd/.config.toml.tmp");
    fs::write(&tmp, "version = 2\n").unwrap();
    fs::rename(&tmp, &config).unwrap();
    let d = differences(&s0, &snapshot(root));
    // (The directory changed too: an entry was added and renamed over.)
    assert_eq!(
        d.keys().collect::<Vec<_>>(),
        ["etc/containerd", "etc/containerd/config.toml"]
    );
    assert!(d["etc/containerd/config.toml"].contains("inode"), "{d:?}");
    assert!(relied_on("etc/containerd/config.toml"));

    // The same bytes, written in place: the same inode, a new ctime.
    let s1 = snapshot(root);
    std::thread::sleep(Duration::from_millis(20));
    fs::write(&spec, "{}\n").unwrap();
    let d = differences(&s1, &snapshot(root));
    assert_eq!(d.keys().collect::<Vec<_>>(), ["var/run/cdi/spec.json"]);
    assert!(d["var/run/cdi/spec.json"].contains("ctime"), "{d:?}");
    assert!(!d["var/run/cdi/spec.json"].contains("inode"), "{d:?}");

    // A big file (compared without its bytes) written in place, same size.
    let s2 = snapshot(root);
    std::thread::sleep(Duration::from_millis(20));
    {
        use std::os::unix::fs::FileExt;
        let f = fs::OpenOptions::new().write(true).open(&big).unwrap();
        f.write_all_at(&[8], 1000).unwrap();
    }
    let d = differences(&s2, &snapshot(root));
    assert_eq!(
        d.keys().collect::<Vec<_>>(),
        ["var/lib/gpu-agent/bin/gpu-agent"]
    );
    assert!(
        d["var/lib/gpu-agent/bin/gpu-agent"].contains("ctime"),
        "{d:?}"
    );

    // A mode changed; a file removed.
    let s3 = snapshot(root);
    fs::set_permissions(&config, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    fs::remove_file(&spec).unwrap();
    let d = differences(&s3, &snapshot(root));
    assert!(d["etc/containerd/config.toml"].contains("mode"), "{d:?}");
    assert_eq!(d["var/run/cdi/spec.json"], "removed");
}
