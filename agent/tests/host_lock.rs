//! One writer of host files at a time (`/run/gpu-agent/host-files.lock`):
//!
//! - two `gpu-agent driver install` of one bundle at once on a sandbox host
//!   root do not collide: one unpacks, the other waits (saying for whom)
//!   and then finds it unpacked; the tree is whole (no `.partial` left,
//!   every file the bundle's bytes);
//! - while another process holds the lock (as a driver upgrade would,
//!   saying `driver upgrade 560.35.03`), `driver install --no-wait` exits
//!   naming that pid and changes nothing, and `driver install` waits,
//!   naming it, and installs once it is let go;
//! - a SIGHUP to a running agent during that upgrade does not start a
//!   reconcile that writes host files: the pass waits for the lock (the log
//!   names the holder's pid) and repairs the drift only after.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::*;
use hostlib::HostRoot;
use hostlib::managed::HostFilesLock;
use kmod::bundle::Flavour;

const KERNEL: &str = "6.1.0-27-amd64";
const VERSION: &str = "560.35.03";
const UPGRADE: &str = "driver upgrade 560.35.03";

/// A host root with the running kernel's release, and a bundle for it
/// (big enough that unpacking takes a while) in the test's own directory.
struct Sandbox {
    _dir: tempfile::TempDir,
    host: PathBuf,
    bundle: PathBuf,
    files: Vec<(String, Vec<u8>, u32)>,
}

fn sandbox() -> Sandbox {
    let dir = tempfile::tempdir().unwrap();
    let host = dir.path().join("host");
    fs::create_dir_all(host.join("proc/sys/kernel")).unwrap();
    // No module loaded: an install becomes current.
    fs::write(host.join("proc/modules"), "").unwrap();
    fs::write(
        host.join("proc/devices"),
        "Character devices:\n  1 mem\n\nBlock devices:\n",
    )
    .unwrap();
    fs::write(
        host.join("proc/sys/kernel/osrelease"),
        format!("{KERNEL}\n"),
    )
    .unwrap();
    // Bytes that do not compress: unpacking is real work.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut noise = |n: usize| -> Vec<u8> {
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    };
    let files: Vec<(String, Vec<u8>, u32)> =
        ["nvidia", "nvidia-uvm", "nvidia-modeset", "nvidia-drm"]
            .iter()
            .map(|m| {
                (
                    format!("modules/{KERNEL}/open/{m}.ko"),
                    noise(6 << 20),
                    0o644,
                )
            })
            .collect();
    let mut tgz = Vec::new();
    kmod::bundle::build(&mut tgz, VERSION, &[KERNEL], &[Flavour::Open], &files).unwrap();
    let bundle = dir.path().join("560.tar.gz");
    write_bundle(&bundle, &tgz);
    Sandbox {
        _dir: dir,
        host,
        bundle,
        files,
    }
}

impl Sandbox {
    fn drivers(&self) -> PathBuf {
        self.host
            .join(kmod::bundle::DRIVERS_DIR.trim_start_matches('/'))
    }

    fn install(&self, extra: &[&str], stderr: &Path) -> Child {
        at(&self.host)
            .args(["driver", "install"])
            .arg(&self.bundle)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(fs::File::create(stderr).unwrap())
            .spawn()
            .unwrap()
    }

    /// The installed tree is this bundle, whole, and current.
    fn assert_installed(&self) {
        let name = format!("{VERSION}-{KERNEL}");
        let drivers = self.drivers();
        let mut names: Vec<String> = fs::read_dir(&drivers)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, [name.clone(), "current".to_string()], "{drivers:?}");
        assert_eq!(
            fs::read_link(drivers.join("current")).unwrap(),
            Path::new(&name)
        );
        for (path, bytes, _) in &self.files {
            let got = fs::read(drivers.join(&name).join(path)).unwrap();
            assert!(got == *bytes, "{path} differs from the bundle's");
        }
    }
}

fn wait_output(child: Child) -> (i32, String) {
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
    )
}

#[test]
fn two_installs_of_one_bundle_at_once_do_not_collide() {
    let s = sandbox();
    let logs = tempfile::tempdir().unwrap();
    let (e1, e2) = (logs.path().join("1.err"), logs.path().join("2.err"));
    let a = s.install(&[], &e1);
    let b = s.install(&[], &e2);
    let (pa, pb) = (a.id(), b.id());
    let (ca, oa) = wait_output(a);
    let (cb, ob) = wait_output(b);
    let (ea, eb) = (
        fs::read_to_string(&e1).unwrap(),
        fs::read_to_string(&e2).unwrap(),
    );
    assert_eq!((ca, cb), (0, 0), "\n{oa}{ea}\n{ob}{eb}");
    // One unpacked it; the other found it unpacked.
    let unpacked = [&oa, &ob]
        .iter()
        .filter(|o| o.contains("unpacked 4 file(s)"))
        .count();
    let found = [&oa, &ob]
        .iter()
        .filter(|o| o.contains("already unpacked"))
        .count();
    assert_eq!((unpacked, found), (1, 1), "\n{oa}{ea}\n{ob}{eb}");
    // One that waited said for whom: the other.
    for (err, other) in [(&ea, pb), (&eb, pa)] {
        if err.contains("waiting for") {
            assert!(
                err.contains(&format!(
                    "host-files.lock: held by pid {other}: driver install 560.tar.gz"
                )),
                "{err}"
            );
        }
    }
    s.assert_installed();
}

#[test]
fn a_held_lock_is_named_by_no_wait_and_waited_for_otherwise() {
    let s = sandbox();
    let logs = tempfile::tempdir().unwrap();
    let root = HostRoot::new(&s.host).unwrap();
    let me = std::process::id();
    let held = HostFilesLock::take(&root, UPGRADE, false).unwrap();
    // --no-wait: refused, naming the holder; nothing changed.
    let err_file = logs.path().join("nowait.err");
    let (code, out) = wait_output(s.install(&["--no-wait"], &err_file));
    let err = fs::read_to_string(&err_file).unwrap();
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains(&format!(
            "host-files.lock: another gpu-agent is changing host files (pid {me}: {UPGRADE}, holds this lock)"
        )),
        "{err}"
    );
    assert!(!s.drivers().exists(), "installed while the lock was held");
    // Waiting: it says for whom, and does nothing until the lock is let go.
    let err_file = logs.path().join("wait.err");
    let mut child = s.install(&[], &err_file);
    let deadline = Instant::now() + Duration::from_secs(30);
    let said = loop {
        let err = fs::read_to_string(&err_file).unwrap();
        if err.contains("waiting for") {
            break err;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "it did not wait: {err}"
        );
        assert!(Instant::now() < deadline, "never said it waits: {err}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        said.contains(&format!("host-files.lock: held by pid {me}: {UPGRADE}")),
        "{said}"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(child.try_wait().unwrap().is_none(), "it stopped waiting");
    assert!(!s.drivers().exists(), "installed while the lock was held");
    let released = Instant::now();
    drop(held);
    let (code, out) = wait_output(child);
    assert_eq!(code, 0, "{out}{}", fs::read_to_string(&err_file).unwrap());
    assert!(out.contains("unpacked 4 file(s)"), "{out}");
    assert!(released.elapsed() < Duration::from_secs(60));
    s.assert_installed();
    // The lock is free again, and names nobody.
    assert_eq!(HostFilesLock::holder(&root), None);
}

/// A running agent on a simulated node (it writes the labels file and the
/// CDI spec through the managed files), reconciling only when told.
struct Agent {
    _dir: tempfile::TempDir,
    host: PathBuf,
    log: PathBuf,
    child: Child,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Agent {
    fn start() -> Agent {
        let dir = tempfile::tempdir().unwrap();
        let host = dir.path().join("host");
        fs::create_dir_all(&host).unwrap();
        let policy = dir.path().join("policy.yaml");
        fs::write(
            &policy,
            "spec:\n  reconcileIntervalSeconds: 0\n  devicePlugin:\n    enabled: false\n  dcgmExporter:\n    enabled: false\n",
        )
        .unwrap();
        let log = dir.path().join("agent.log");
        let child = at(&host)
            .args(["--simulate", "h100-sxm-8", "--policy"])
            .arg(&policy)
            .args(["--log-format", "text", "run"])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let agent = Agent {
            _dir: dir,
            host,
            log,
            child,
        };
        // Signals are handled once the state says a running agent; the
        // first pass is over when no stage still waits to run after the
        // device plugin's first registration.
        agent.until(60, "the agent serves, its first pass over", |a| {
            let (code, out, _) = run(at(&a.host).args(["status", "-o", "json"]));
            let st = if code == 0 { json(&out) } else { return false };
            st["source"] == "running-agent"
                && st["stages"].as_array().is_some_and(|stages| {
                    stages
                        .iter()
                        .all(|s| s["detail"] != gpu_agent::stages::DEFERRED_DETAIL)
                })
        });
        agent
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn until(&self, secs: u64, what: &str, f: impl Fn(&Agent) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        while !f(self) {
            assert!(
                Instant::now() < deadline,
                "{what}: not within {secs} s\nlog:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn hup(&self) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGHUP,
        )
        .unwrap();
    }
}

#[test]
fn a_sighup_during_an_upgrade_waits_for_it() {
    let mut agent = Agent::start();
    let labels = agent
        .host
        .join("etc/kubernetes/node-feature-discovery/features.d/gfd");
    assert!(labels.exists(), "the first pass wrote no labels");
    let root = HostRoot::new(&agent.host).unwrap();
    let me = std::process::id();
    // An upgrade holds the lock (as `gpu-agent driver upgrade` does), once
    // the agent's own pass lets it go.
    let deadline = Instant::now() + Duration::from_secs(20);
    let held = loop {
        match HostFilesLock::take(&root, UPGRADE, false) {
            Ok(l) => break l,
            Err(e) => assert!(Instant::now() < deadline, "{e}\nlog:\n{}", agent.log()),
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // Drift the next pass would repair.
    fs::remove_file(&labels).unwrap();
    agent.hup();
    agent.until(20, "the reconcile says it waits", |a| {
        a.log().contains("waiting for the host-files lock")
    });
    let log = agent.log();
    let line = log
        .lines()
        .find(|l| l.contains("waiting for the host-files lock"))
        .unwrap();
    assert!(
        line.contains(&format!("holder_pid={me}"))
            && line.contains(UPGRADE)
            && line.contains("reconcile (SIGHUP)"),
        "{line}"
    );
    // Held: no host file is written.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        !labels.exists(),
        "a pass wrote host files during the upgrade"
    );
    drop(held);
    agent.until(20, "the pass repairs the labels after the upgrade", |_| {
        labels.exists()
    });
    assert_eq!(sigterm(&mut agent.child), Some(0), "{}", agent.log());
}
