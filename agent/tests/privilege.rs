//! Least privilege, end to end, on the real binary:
//!
//! - every file, directory and socket the agent makes on a sandbox host
//!   root keeps other users out: no group or other write bit anywhere, and
//!   its own state (directory 0700, state file and lock 0600) and the
//!   device plugin's socket (0600) closed to them altogether;
//! - (root) with a policy that turns the driver off, the running agent's
//!   threads hold no CAP_SYS_MODULE in any set (bounding included) while
//!   the enabled stages' capabilities stay, CAP_SETPCAP is gone too,
//!   `status` lists what is held with the stages that use it and why, and
//!   a reload that turns the driver on shows the driver stage blocked,
//!   saying the capability was dropped at start and a restart enables it.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Kill the child when the test ends, however it ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Every entry under `root` with its kind and mode, by relative path.
fn entries(root: &Path) -> BTreeMap<String, (char, u32)> {
    let mut out = BTreeMap::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let Ok(m) = fs::symlink_metadata(&p) else {
                continue; // gone meanwhile (a temp file renamed)
            };
            let ft = m.file_type();
            let kind = if ft.is_symlink() {
                'l'
            } else if ft.is_dir() {
                todo.push(p.clone());
                'd'
            } else if ft.is_socket() {
                's'
            } else if ft.is_file() {
                'f'
            } else {
                '?'
            };
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            out.insert(rel, (kind, m.mode() & 0o7777));
        }
    }
    out
}

/// Polls `status -o json` of the agent at `host` until `f` holds.
fn until(
    host: &Path,
    extra: &[&str],
    log: &Path,
    what: &str,
    f: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, out, _) = run(at(host).args(extra).args(["status", "-o", "json"]));
        if let Ok(st) = serde_json::from_str::<serde_json::Value>(&out)
            && st["source"] == "running-agent"
            && f(&st)
        {
            return st;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within 60 s\nstatus: {out}\nlog:\n{}",
            fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn what_the_agent_makes_keeps_other_users_out() {
    let dir = tempfile::tempdir().unwrap();
    let h = dir.path();
    fs::create_dir_all(h.join("etc/containerd")).unwrap();
    fs::copy(
        fixture("containerd/valid/v2-custom.toml"),
        h.join("etc/containerd/config.toml"),
    )
    .unwrap();
    install_containerd_2(h);
    fs::create_dir_all(h.join("var/lib")).unwrap();
    fs::write(
        h.join("policy.yaml"),
        "spec:\n  toolkit:\n    reload: none\n",
    )
    .unwrap();
    let before = entries(h);
    let log = h.join("agent.log");
    let sim = ["--simulate", "a10g-1"];
    let _agent = Running(
        at(h)
            .args(sim)
            .arg("--policy")
            .arg(h.join("policy.yaml"))
            .arg("run")
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let socket = "var/lib/kubelet/device-plugins/nvidia-gpu.sock";
    until(
        h,
        &sim,
        &log,
        "the stages validated and the plugin serves",
        |st| {
            ["runtime", "cdi", "labels"]
                .iter()
                .all(|s| stage(st, s)["validation"]["ok"] == true)
                && h.join(socket).exists()
        },
    );
    let after = entries(h);
    let made: BTreeMap<&String, &(char, u32)> = after
        .iter()
        .filter(|(p, _)| !before.contains_key(*p) && p.as_str() != "agent.log")
        .collect();
    let listing = made
        .iter()
        .map(|(p, (k, m))| format!("{k} {m:04o} {p}"))
        .collect::<Vec<_>>()
        .join("\n");
    // Not vacuous: the agent's own files, the host files its stages write
    // and the socket are all there.
    for want in [
        "run/gpu-agent",
        "run/gpu-agent/state.json",
        "run/gpu-agent/agent.lock",
        "var/lib/gpu-agent/backup/manifest.json",
        "var/run/cdi/gpu-agent-nvidia.com-gpu.json",
        "etc/kubernetes/node-feature-discovery/features.d/gfd",
        socket,
    ] {
        assert!(
            made.contains_key(&want.to_string()),
            "{want} was not made:\n{listing}"
        );
    }
    // Nothing anyone else may write.
    let writable: Vec<String> = made
        .iter()
        .filter(|(_, (k, m))| *k != 'l' && m & 0o022 != 0)
        .map(|(p, (k, m))| format!("{k} {m:04o} {p}"))
        .collect();
    assert!(
        writable.is_empty(),
        "group/other may write: {writable:#?}\nall made:\n{listing}"
    );
    // The agent's own state and the socket: nobody else at all.
    for (path, mode) in [
        ("run/gpu-agent", 0o700),
        ("run/gpu-agent/state.json", 0o600),
        ("run/gpu-agent/agent.lock", 0o600),
        ("var/lib/gpu-agent/backup/manifest.json", 0o600),
        (socket, 0o600),
    ] {
        assert_eq!(
            made[&path.to_string()].1,
            mode,
            "{path}: mode {:04o}, want {mode:04o}\nall made:\n{listing}",
            made[&path.to_string()].1
        );
    }
    // Whatever else lies in the agent's directory, its 0700 keeps others
    // from reaching it.
    assert!(
        made.keys()
            .filter(|p| p.starts_with("run/gpu-agent/"))
            .count()
            >= 2
    );
}

#[test]
fn an_older_agents_wider_directory_is_narrowed() {
    let dir = tempfile::tempdir().unwrap();
    let h = dir.path();
    fs::create_dir_all(h.join("run/gpu-agent")).unwrap();
    fs::set_permissions(
        h.join("run/gpu-agent"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    fs::write(h.join("run/gpu-agent/agent.lock"), "1\n").unwrap();
    fs::set_permissions(
        h.join("run/gpu-agent/agent.lock"),
        std::os::unix::fs::PermissionsExt::from_mode(0o644),
    )
    .unwrap();
    // `run --once`: one pass, then the agent exits.
    let (code, out, err) = run(at(h)
        .args(["--simulate", "a10g-1", "run", "--once"])
        .env_remove("GPU_AGENT_POLICY"));
    let mode = |p: &str| fs::metadata(h.join(p)).unwrap().mode() & 0o7777;
    assert_eq!(mode("run/gpu-agent"), 0o700, "{code} {out}{err}");
    assert_eq!(mode("run/gpu-agent/agent.lock"), 0o600);
    assert_eq!(mode("run/gpu-agent/state.json"), 0o600);
}

/// The bit of a capability in /proc's `Cap*:` masks.
const CAP_CHOWN: u32 = 0;
const CAP_DAC_OVERRIDE: u32 = 1;
const CAP_SETPCAP: u32 = 8;
const CAP_SYS_MODULE: u32 = 16;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_MKNOD: u32 = 27;

/// `CapEff:` etc. of one /proc status file.
fn cap_masks(status: &str) -> BTreeMap<String, u64> {
    status
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.starts_with("Cap")
                .then(|| (k.to_string(), u64::from_str_radix(v.trim(), 16).unwrap()))
        })
        .collect()
}

/// Why the caps test cannot run here, if it cannot.
fn cannot_trim_here() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("not root".into());
    }
    let me = cap_masks(&fs::read_to_string("/proc/self/status").unwrap());
    for (bit, name) in [
        (CAP_SETPCAP, "CAP_SETPCAP"),
        (CAP_SYS_MODULE, "CAP_SYS_MODULE"),
        (CAP_MKNOD, "CAP_MKNOD"),
    ] {
        if me["CapEff"] & (1 << bit) == 0 {
            return Some(format!("this test process does not hold {name}"));
        }
    }
    None
}

const NO_DRIVER: &str = "spec:\n  driver:\n    enabled: false\n  toolkit:\n    reload: none\n";
const DRIVER: &str = "spec:\n  driver:\n    enabled: true\n  toolkit:\n    reload: none\n";

#[test]
fn a_policy_without_the_driver_leaves_the_agent_no_sys_module() {
    if let Some(why) = cannot_trim_here() {
        eprintln!(
            "SKIPPED a_policy_without_the_driver_leaves_the_agent_no_sys_module: {why} (run it as root with a full capability set)"
        );
        return;
    }
    // A real (not simulated) node: the fixture's 8x H100 and the fake
    // libnvidia-ml, so that the driver stage would load modules.
    let host_dir = copy_host_fixture("h100-sxm-8");
    let host: PathBuf = host_dir.path().to_path_buf();
    fs::create_dir_all(host.join("etc/containerd")).unwrap();
    fs::copy(
        fixture("containerd/valid/v2-custom.toml"),
        host.join("etc/containerd/config.toml"),
    )
    .unwrap();
    install_containerd_2(&host);
    let policy = host.join("policy.yaml");
    fs::write(&policy, NO_DRIVER).unwrap();
    let (_nvml_dir, nvml) = fake_nvml();
    let log = host.join("agent.log");
    let agent = Running(
        at(&host)
            .arg("--policy")
            .arg(&policy)
            .arg("--nvml-lib")
            .arg(&nvml)
            .args(["--log-format", "text", "run"])
            .env("FAKE_NVML_NODE", "h100-sxm-8")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let pid = agent.0.id();
    let st = until(&host, &[], &log, "the agent runs its stages", |st| {
        stage(st, "devnodes")["state"] == "done" && st["privileges"].is_object()
    });

    // Every thread: no CAP_SYS_MODULE, no CAP_SETPCAP, in any set; the
    // enabled stages' capabilities effective and bounded; nothing beyond
    // the effective set anywhere.
    let mut threads = 0;
    for t in fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let status = fs::read_to_string(t.unwrap().path().join("status")).unwrap();
        let m = cap_masks(&status);
        threads += 1;
        for set in ["CapBnd", "CapEff", "CapPrm", "CapInh", "CapAmb"] {
            assert_eq!(
                m[set] & (1 << CAP_SYS_MODULE),
                0,
                "{set} has CAP_SYS_MODULE:\n{status}"
            );
            assert_eq!(
                m[set] & (1 << CAP_SETPCAP),
                0,
                "{set} has CAP_SETPCAP:\n{status}"
            );
        }
        for bit in [CAP_MKNOD, CAP_DAC_OVERRIDE, CAP_CHOWN, CAP_SYS_ADMIN] {
            assert_ne!(
                m["CapEff"] & (1 << bit),
                0,
                "CapEff lacks bit {bit}:\n{status}"
            );
            assert_ne!(
                m["CapBnd"] & (1 << bit),
                0,
                "CapBnd lacks bit {bit}:\n{status}"
            );
        }
        assert_eq!(
            m["CapBnd"], m["CapEff"],
            "the bounding set is the effective set"
        );
        assert_eq!(m["CapPrm"], m["CapEff"]);
        assert_eq!(m["CapAmb"], 0);
    }
    assert!(threads >= 2, "the worker thread was looked at too");

    // `status -o json`: what is held, by whom and why; what was dropped.
    let held: Vec<&str> = st["held_caps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert!(!held.contains(&"CAP_SYS_MODULE"), "{held:?}");
    assert!(held.contains(&"CAP_MKNOD"), "{held:?}");
    let p = &st["privileges"];
    let mknod = p["held"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["name"] == "CAP_MKNOD")
        .unwrap_or_else(|| panic!("{p:#}"));
    assert_eq!(mknod["stages"], serde_json::json!(["devnodes"]));
    assert!(mknod["why"].as_str().unwrap().contains("mknod"), "{mknod}");
    assert!(
        p["held"]
            .as_array()
            .unwrap()
            .iter()
            .all(|h| h["stages"].as_array().is_some_and(|s| !s.is_empty())),
        "every held capability is used by a stage: {p:#}"
    );
    let dropped = p["dropped"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "CAP_SYS_MODULE")
        .unwrap_or_else(|| panic!("{p:#}"));
    assert!(
        dropped["because"]
            .as_str()
            .unwrap()
            .contains("driver was disabled (spec.driver.enabled is false"),
        "{dropped}"
    );
    // The same in words.
    let (code, text, err) = run(at(&host).arg("status"));
    assert_eq!(code, 0, "{err}");
    let mknod_row = text
        .lines()
        .find(|l| l.starts_with("CAP_MKNOD "))
        .unwrap_or_else(|| panic!("no CAP_MKNOD row:\n{text}"));
    assert!(
        mknod_row.contains("devnodes") && mknod_row.contains("mknod"),
        "{mknod_row}"
    );
    assert!(
        text.contains("dropped at start: CAP_SYS_MODULE, because driver was disabled"),
        "{text}"
    );

    // A reload that turns the driver on: blocked, saying why and what to do.
    fs::write(&policy, DRIVER).unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGHUP,
    )
    .unwrap();
    let st = until(&host, &[], &log, "the driver stage is blocked", |st| {
        stage(st, "driver")["state"] == "blocked"
    });
    let detail = stage(&st, "driver")["detail"].as_str().unwrap().to_string();
    assert_eq!(
        detail,
        "capability CAP_SYS_MODULE was dropped at start because driver was disabled (spec.driver.enabled is false: the host's driver is used); restart gpu-agent to enable it"
    );
    let m = cap_masks(&fs::read_to_string(format!("/proc/{pid}/status")).unwrap());
    assert_eq!(m["CapBnd"] & (1 << CAP_SYS_MODULE), 0, "not had back");
}
