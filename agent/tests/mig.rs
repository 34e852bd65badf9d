//! MIG layouts end to end, through the real NVML path (nvml-wrapper and
//! nvml-wrapper-sys) against the fake libnvidia-ml simulating MIG, with a
//! Python grpcio kubelet stand-in (tests/interop/capacity_standin.py, not
//! our code) keeping the node's capacity as the kubelet's device manager
//! does: a layout change leaves no stale resource behind.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// One node: its host tree, the fake NVML's MIG state and conditions.
struct Node {
    _dirs: Vec<tempfile::TempDir>,
    host: PathBuf,
    nvml: PathBuf,
    mig_state: PathBuf,
    conditions: PathBuf,
    node: String,
}

impl Node {
    /// A host tree for `node` (a built-in description or a file).
    fn new(node: &str) -> Node {
        let host_dir = tempfile::tempdir().unwrap();
        let host = host_dir.path().to_path_buf();
        simnode::NodeDescription::load(node)
            .unwrap()
            .materialize(&host)
            .unwrap();
        let (nvml_dir, nvml) = fake_nvml();
        let state = tempfile::tempdir().unwrap();
        let conditions = state.path().join("conditions");
        fs::write(&conditions, "").unwrap();
        Node {
            mig_state: state.path().join("mig.json"),
            conditions,
            _dirs: vec![host_dir, nvml_dir, state],
            host,
            nvml,
            node: node.to_string(),
        }
    }

    /// `gpu-agent` on this node with the fake NVML.
    fn agent(&self, policy: &Path) -> Command {
        let mut c = at(&self.host);
        c.arg("--policy")
            .arg(policy)
            .arg("--nvml-lib")
            .arg(&self.nvml)
            .args(["--log-format", "text"])
            .env("FAKE_NVML_NODE", &self.node)
            .env("FAKE_NVML_MIG", &self.mig_state)
            .env("FAKE_NVML_SYSFS", self.host.join("sys"))
            .env("FAKE_NVML_STATE", &self.conditions);
        c
    }

    /// `status -o json`: exit 0 with a running agent's report, 3 with an
    /// inspection of the host (no running agent).
    fn status(&self, policy: &Path) -> serde_json::Value {
        let (code, out, err) = run(self.agent(policy).args(["status", "-o", "json"]));
        let st = json(&out);
        let want = if st["source"] == "running-agent" {
            0
        } else {
            3
        };
        assert_eq!(code, want, "{}: {err}", st["source"]);
        st
    }
}

fn write_policy(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, text).unwrap();
    fs::rename(&tmp, path).unwrap();
}

fn policy(layout: &str, extra: &str) -> String {
    format!(
        "spec:\n  reconcileIntervalSeconds: 0\n  toolkit:\n    enabled: false\n  dcgmExporter:\n    enabled: false\n  mig:\n    strategy: mixed\n  migManager:\n    default: {layout}\n    gpuClientsTimeoutSeconds: 2\n{extra}"
    )
}

/// The kubelet stand-in's view: resource → (devices, stream open).
type Capacity = BTreeMap<String, (Vec<String>, bool)>;

struct Kubelet {
    child: Child,
    out: PathBuf,
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Kubelet {
    fn start(host: &Path) -> Kubelet {
        let dir = host.join("var/lib/kubelet/device-plugins");
        fs::create_dir_all(&dir).unwrap();
        let out = host.join("capacity.json");
        let child = Command::new(python())
            .arg(repo().join("tests/interop/capacity_standin.py"))
            .arg("--proto")
            .arg(repo().join("proto/proto/deviceplugin_v1beta1.proto"))
            .arg("--dir")
            .arg(&dir)
            .arg("--out")
            .arg(&out)
            .stdout(Stdio::null())
            .stderr(fs::File::create(host.join("kubelet.log")).unwrap())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !out.exists() {
            assert!(
                Instant::now() < deadline,
                "the kubelet stand-in did not start: {}",
                fs::read_to_string(host.join("kubelet.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Kubelet { child, out }
    }

    fn capacity(&self) -> Capacity {
        let v: serde_json::Value = json(&fs::read_to_string(&self.out).unwrap());
        v.as_object()
            .unwrap()
            .iter()
            .map(|(k, e)| {
                let devices = e["devices"].as_object().unwrap().keys().cloned().collect();
                (k.clone(), (devices, e["open"].as_bool().unwrap()))
            })
            .collect()
    }

    /// Waits until the advertised resources (those with devices) have these
    /// device counts, and no other resource has any.
    fn until(&self, want: &[(&str, usize)], log: &Path) -> Capacity {
        let deadline = Instant::now() + Duration::from_secs(40);
        loop {
            let c = self.capacity();
            let advertised: BTreeMap<&str, usize> = c
                .iter()
                .filter(|(_, (d, _))| !d.is_empty())
                .map(|(k, (d, _))| (k.as_str(), d.len()))
                .collect();
            let wanted: BTreeMap<&str, usize> = want.iter().copied().collect();
            if advertised == wanted {
                return c;
            }
            assert!(
                Instant::now() < deadline,
                "capacity {advertised:?}, wanted {wanted:?}\nagent log:\n{}",
                fs::read_to_string(log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn sighup(child: &Child) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGHUP,
    )
    .unwrap();
}

fn mig_uuids(st: &serde_json::Value) -> Vec<String> {
    st["inventory"]["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["mig_devices"].as_array().cloned().unwrap_or_default())
        .map(|m| m["uuid"].as_str().unwrap().to_string())
        .collect()
}

fn until_mig(
    node: &Node,
    policy: &Path,
    log: &Path,
    f: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let st = node.status(policy);
        if st["source"] == "running-agent" && f(&st) {
            return st;
        }
        assert!(
            Instant::now() < deadline,
            "status: {st:#}\nlog:\n{}",
            fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_layout_change_leaves_no_stale_resource_and_waits_for_processes() {
    let node = Node::new("h100-sxm-8");
    let kubelet = Kubelet::start(&node.host);
    let pdir = tempfile::tempdir().unwrap();
    let pfile = pdir.path().join("policy.yaml");
    write_policy(&pfile, &policy("all-disabled", ""));
    let log = node.host.join("agent.log");
    let mut agent = node
        .agent(&pfile)
        .arg("run")
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    struct Kill<'a>(&'a mut Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    // all-disabled on a node without MIG: nothing to do, 8 whole GPUs.
    kubelet.until(&[("nvidia.com/gpu", 8)], &log);
    let st = until_mig(&node, &pfile, &log, |st| st["mig"]["state"] == "success");
    assert_eq!(st["mig"]["layout"], "all-disabled");
    assert!(
        !node.mig_state.exists()
            || !fs::read_to_string(&node.mig_state)
                .unwrap()
                .contains("\"gis\":[{")
    );

    // all-balanced: the whole GPUs go, the MIG devices come.
    write_policy(&pfile, &policy("all-balanced", ""));
    sighup(&agent);
    let c = kubelet.until(
        &[
            ("nvidia.com/mig-1g.10gb", 16),
            ("nvidia.com/mig-2g.20gb", 8),
            ("nvidia.com/mig-3g.40gb", 8),
        ],
        &log,
    );
    assert_eq!(c["nvidia.com/gpu"], (vec![], false), "no stale whole GPUs");
    let st = until_mig(&node, &pfile, &log, |st| {
        st["mig"]["layout"] == "all-balanced" && st["mig"]["state"] == "success"
    });
    let uuids = mig_uuids(&st);
    assert_eq!(uuids.len(), 32, "{st:#}");
    for (r, (ids, _)) in &c {
        for id in ids {
            assert!(
                uuids.contains(id),
                "{r}: {id} is not a MIG device of the node"
            );
        }
    }
    let log_text = fs::read_to_string(&log).unwrap();
    assert!(log_text.contains("MIG layout change ahead"), "{log_text}");
    assert!(
        log_text.contains("no longer advertising the GPUs whose layout changes"),
        "{log_text}"
    );
    // The CDI spec names the new devices; their capability nodes exist.
    let spec = fs::read_to_string(node.host.join("var/run/cdi/gpu-agent-nvidia.com-gpu.json"))
        .unwrap_or_default();
    for u in &uuids {
        assert!(spec.contains(u.as_str()), "CDI spec lacks {u}");
    }
    assert!(
        fs::read_dir(node.host.join("dev/nvidia-caps"))
            .unwrap()
            .count()
            >= 64,
        "a GPU-instance and a compute-instance node per MIG device"
    );
    // Planned again with nothing to do: the stage says so, nothing moves.
    let before = fs::read(&node.mig_state).unwrap();
    sighup(&agent);
    std::thread::sleep(Duration::from_millis(500));
    // The reload's pass may still be running on a busy machine: `status`
    // is read until its MIG stage is done again (at most 15 s).
    let settled = Instant::now() + Duration::from_secs(15);
    let st = loop {
        let st = node.status(&pfile);
        if stage(&st, "mig")["state"] == "done" || Instant::now() > settled {
            break st;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(fs::read(&node.mig_state).unwrap(), before);
    assert_eq!(stage(&st, "mig")["state"], "done", "{st:#}");
    assert!(
        stage(&st, "mig")["detail"]
            .as_str()
            .unwrap()
            .contains("layout \"all-balanced\" applied (8 GPU(s) as wanted)"),
        "{st:#}"
    );

    // A process holds GPU 0: the change waits for it, gives up after the
    // timeout naming it, and the old layout is advertised again.
    let mut sleeper = Command::new("sleep").arg("60").spawn().unwrap();
    fs::write(&node.conditions, format!("0 process {}\n", sleeper.id())).unwrap();
    // The host tree's /proc stands for the host's: the process's name.
    let pdir = node.host.join(format!("proc/{}", sleeper.id()));
    fs::create_dir_all(&pdir).unwrap();
    fs::write(pdir.join("comm"), "sleep\n").unwrap();
    write_policy(&pfile, &policy("all-1g.10gb", ""));
    sighup(&agent);
    let st = until_mig(&node, &pfile, &log, |st| st["mig"]["state"] == "failed");
    let detail = st["mig"]["detail"].as_str().unwrap();
    assert!(
        detail.contains(&format!("pid {} (sleep) on GPU 0", sleeper.id())),
        "{detail}"
    );
    assert!(detail.contains("after 2 s"), "{detail}");
    kubelet.until(
        &[
            ("nvidia.com/mig-1g.10gb", 16),
            ("nvidia.com/mig-2g.20gb", 8),
            ("nvidia.com/mig-3g.40gb", 8),
        ],
        &log,
    );
    assert_eq!(
        fs::read(&node.mig_state).unwrap(),
        before,
        "nothing changed"
    );

    // The process is gone: on SIGHUP the layout applies.
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    fs::write(&node.conditions, "").unwrap();
    sighup(&agent);
    let c = kubelet.until(&[("nvidia.com/mig-1g.10gb", 56)], &log);
    for r in [
        "nvidia.com/mig-2g.20gb",
        "nvidia.com/mig-3g.40gb",
        "nvidia.com/gpu",
    ] {
        assert!(c[r].0.is_empty(), "{r} is stale: {c:?}");
    }
    let st = until_mig(&node, &pfile, &log, |st| {
        st["mig"]["layout"] == "all-1g.10gb" && st["mig"]["state"] == "success"
    });
    assert_eq!(mig_uuids(&st).len(), 56);
    let _guard = Kill(&mut agent);
}

#[test]
fn a_layout_that_does_not_fit_is_refused_naming_the_key_and_nothing_changes() {
    let node = Node::new("h100-sxm-8");
    let pdir = tempfile::tempdir().unwrap();
    let pfile = pdir.path().join("policy.yaml");
    let inline = "    config:\n      inline:\n        version: v1\n        mig-configs:\n          wrong-profile:\n            - devices: all\n              mig-enabled: true\n              mig-devices: {\"1g.5gb\": 7}\n          too-many:\n            - device-filter: \"0x233010DE\"\n              devices: [0, 1]\n              mig-enabled: true\n              mig-devices: {\"3g.40gb\": 2, \"2g.20gb\": 1}\n";
    // Bad keys never get as far as the node.
    write_policy(&pfile, &format!("{}{}", policy("nope", ""), inline));
    let (code, _, err) = run(bin().args(["policy", "check"]).arg(&pfile));
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(
            "spec.migManager.default: no layout named \"nope\" (there are: too-many, wrong-profile)"
        ),
        "{err}"
    );
    for (layout, message) in [
        (
            "wrong-profile",
            "spec.migManager.config.inline: mig-configs.wrong-profile[0].mig-devices.1g.5gb: GPU 0 (NVIDIA H100 80GB HBM3) has no MIG profile 1g.5gb",
        ),
        (
            "too-many",
            "spec.migManager.config.inline: mig-configs.too-many[0].mig-devices: GPU 0 (NVIDIA H100 80GB HBM3): 3g.40gb x2, 2g.20gb do not fit together",
        ),
    ] {
        write_policy(&pfile, &format!("{}{}", policy(layout, ""), inline));
        let (code, _, err) = run(node.agent(&pfile).args(["run", "--once"]));
        assert_eq!(code, 1, "{err}");
        assert!(err.contains(message), "{layout}: {err}");
        let st = node.status(&pfile);
        assert_eq!(stage(&st, "mig")["state"], "failed", "{st:#}");
        // MIG was turned on for the check (H100s apply it at once) or not
        // touched; no instance exists either way.
        let state = fs::read_to_string(&node.mig_state).unwrap_or_default();
        assert!(!state.contains("\"cis\""), "{state}");
    }
}

#[test]
fn an_a100_waits_for_a_reset_and_a_refused_reset_rolls_back() {
    let node = Node::new("a100-h100-mixed");
    let pdir = tempfile::tempdir().unwrap();
    let pfile = pdir.path().join("policy.yaml");
    write_policy(&pfile, &policy("all-balanced", ""));
    let (code, _, err) = run(node.agent(&pfile).args(["run", "--once"]));
    assert_eq!(code, 0, "{err}");
    let st = node.status(&pfile);
    assert_eq!(stage(&st, "mig")["state"], "done", "{st:#}");
    let gpus = st["inventory"]["gpus"].as_array().unwrap();
    for g in gpus {
        let profiles: Vec<&str> = g["mig_devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["profile"].as_str().unwrap())
            .collect();
        let a100 = g["model"].as_str().unwrap().contains("A100");
        let mut sorted = profiles.clone();
        sorted.sort();
        if a100 {
            assert_eq!(sorted, ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"], "{g:#}");
        } else {
            assert_eq!(
                sorted,
                ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"],
                "{g:#}"
            );
        }
    }
    let log = err;
    assert!(
        log.contains("resetting the GPU to apply its MIG mode"),
        "{log}"
    );

    // A reset that does not apply the mode: only a reboot could; the
    // agent may not reboot, so the layout fails and MIG is put back.
    let node = Node::new("a100-h100-mixed");
    fs::write(&node.conditions, "0 reset-ignored\n").unwrap();
    let (code, _, err) = run(node.agent(&pfile).args(["run", "--once"]));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("only a reboot can; reboot the node, or let gpu-agent do it with spec.migManager.reboot: true"),
        "{err}"
    );
    assert!(err.contains("the previous layout is back"), "{err}");
    // The agent's state says failed; inspecting the host shows MIG as it
    // was and what the layout would change.
    let saved = json(&fs::read_to_string(node.host.join("run/gpu-agent/state.json")).unwrap());
    assert_eq!(saved["mig"]["state"], "failed", "{saved:#}");
    assert_eq!(saved["mig"]["layout"], "all-balanced");
    let st = node.status(&pfile);
    let g0 = &st["inventory"]["gpus"][0];
    assert!(g0["mig_devices"].as_array().unwrap().is_empty(), "{g0:#}");
    let mig = stage(&st, "mig");
    assert_eq!(mig["state"], "ready", "{mig:#}");
    assert!(
        mig["detail"].as_str().unwrap().starts_with(
            "layout \"all-balanced\" would change GPUs 0-1: MIG off → 3g.20gb, 2g.10gb, 1g.5gb x2"
        ),
        "{mig:#}"
    );
}

/// The built-in layouts through the real NVML path with no file mounted:
/// a B200 (in the built-in file since the operator's names were built in)
/// gets its entry of `all-balanced`, and a MIG-capable GPU gpu-agent's
/// table does not know (the fake NVML lists an 80 GB Hopper's profiles for
/// it) gets `all-balanced` derived from the profiles NVML lists, asked
/// while MIG is still off; `status` says which GPU was derived.
#[test]
fn the_built_in_layouts_cover_a_b200_and_derive_for_a_gpu_they_do_not_name() {
    let dir = tempfile::tempdir().unwrap();
    let desc = dir.path().join("node.yaml");
    let gpu = |bus: &str, name: &str, uuid: &str, device: &str, mib: u64, cc: &str| {
        format!(
            "  - busId: \"{bus}\"\n    name: {name}\n    uuid: {uuid}\n    deviceId: \"{device}\"\n    memoryMib: {mib}\n    computeCapability: \"{cc}\"\n    mig: {{ capable: true, enabled: false }}\n"
        )
    };
    fs::write(
        &desc,
        format!(
            "name: B200 + a GPU gpu-agent does not know\ndriver:\n  version: 580.95.05\n  cudaVersion: \"13.0\"\ngpus:\n{}{}",
            gpu(
                "0000:18:00.0",
                "NVIDIA B200",
                "GPU-0b200000-0000-4000-8000-000000000001",
                "0x2901",
                183359,
                "10.0"
            ),
            gpu(
                "0000:2a:00.0",
                "NVIDIA Future GPU",
                "GPU-0f000000-0000-4000-8000-000000000002",
                "0x3fff",
                81559,
                "10.0"
            ),
        ),
    )
    .unwrap();
    let node = Node::new(desc.to_str().unwrap());
    let pdir = tempfile::tempdir().unwrap();
    let pfile = pdir.path().join("policy.yaml");
    write_policy(&pfile, &policy("all-balanced", ""));
    let (code, _, err) = run(node.agent(&pfile).args(["run", "--once"]));
    assert_eq!(code, 0, "{err}");
    let st = node.status(&pfile);
    let mig = stage(&st, "mig");
    assert_eq!(mig["state"], "done", "{mig:#}");
    assert!(
        mig["detail"].as_str().unwrap().ends_with(
            "layout \"all-balanced\" applied (2 GPU(s) as wanted); GPU(s) 1: layout derived from their MIG profiles as NVML lists them (not in the built-in layouts)"
        ),
        "{mig:#}"
    );
    let profiles = |g: &serde_json::Value| {
        let mut v: Vec<String> = g["mig_devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["profile"].as_str().unwrap().to_string())
            .collect();
        v.sort();
        v
    };
    let gpus = st["inventory"]["gpus"].as_array().unwrap();
    assert_eq!(
        profiles(&gpus[0]),
        ["1g.23gb", "1g.23gb", "2g.45gb", "3g.90gb"],
        "{:#}",
        gpus[0]
    );
    assert_eq!(
        profiles(&gpus[1]),
        ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"],
        "{:#}",
        gpus[1]
    );
}
