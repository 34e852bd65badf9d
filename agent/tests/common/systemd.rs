//! A real systemd as PID 1, for the tests of what ships with the agent (the
//! unit, the .deb): a Debian bookworm root (scripts/systemd-root, cached in
//! target/systemd-root) booted by tests/systemd/boot in its own PID, mount,
//! UTS, IPC, network and cgroup namespaces, on an overlay of its own so that
//! every boot starts from the same clean tree.
//!
//! Commands run inside through nsenter into systemd's namespaces (from a
//! cgroup of the harness's own, so that they are killed with the rest).
//! What systemd prints while it boots (its console, a pty) is kept in
//! `console.log` and printed when a test fails.
//!
//! Needs root, a cgroup v2 hierarchy on the host (a hybrid host's
//! /sys/fs/cgroup/unified will do) and overlayfs.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The cached root: `GPU_AGENT_SYSTEMD_ROOT`, or target/systemd-root.
pub fn root() -> PathBuf {
    let root = std::env::var_os("GPU_AGENT_SYSTEMD_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| super::repo().join("target/systemd-root"));
    assert!(
        root.join("lib/systemd/systemd").exists(),
        "{} has no systemd: run scripts/systemd-root first (scripts/test does)",
        root.display()
    );
    root
}

/// Polls `f` until it gives a value, or panics after `timeout` saying what
/// was awaited.
pub fn poll<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A booted systemd. Dropping it powers it off; what is left (processes,
/// cgroups, the overlay's directory) is removed.
pub struct Booted {
    dir: Option<tempfile::TempDir>,
    boot: Child,
    /// systemd's PID on the host.
    pub pid: i32,
    /// The host's cgroup directory that holds the container (`payload`) and
    /// the harness's commands inside it (`exec`).
    pub cgroup: PathBuf,
    /// How long from the start of the boot script to a settled
    /// `systemctl is-system-running`.
    pub boot_time: Duration,
    /// What `systemctl is-system-running` said once settled: `running`, or
    /// `degraded` with failed units (see [`Booted::failed_units`]).
    pub state: String,
}

const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

impl Booted {
    /// Boots a fresh overlay of [`root`] and waits until systemd has
    /// finished starting up (`running` or `degraded`).
    pub fn start() -> Booted {
        let lower = root();
        let dir = tempfile::Builder::new()
            .prefix("systemd-pid1.")
            .tempdir()
            .unwrap();
        let console = std::fs::File::create(dir.path().join("console.log")).unwrap();
        let started = Instant::now();
        let boot = Command::new(super::repo().join("tests/systemd/boot"))
            .arg(&lower)
            .arg(dir.path())
            .stdin(Stdio::null())
            .stdout(console.try_clone().unwrap())
            .stderr(console)
            .spawn()
            .expect("tests/systemd/boot");
        let mut booted = Booted {
            dir: Some(dir),
            boot,
            pid: 0,
            cgroup: PathBuf::new(),
            boot_time: Duration::ZERO,
            state: String::new(),
        };
        let pid_file = booted.dir().join("pid");
        let pid = poll(
            "systemd's PID (tests/systemd/boot)",
            Duration::from_secs(20),
            || {
                if let Ok(Some(status)) = booted.boot.try_wait() {
                    panic!(
                        "tests/systemd/boot exited ({status}) before systemd started:\n{}",
                        booted.console()
                    );
                }
                std::fs::read_to_string(&pid_file)
                    .ok()
                    .and_then(|s| s.trim().parse::<i32>().ok())
            },
        );
        booted.pid = pid;
        booted.cgroup = PathBuf::from(
            std::fs::read_to_string(booted.dir().join("cgroup"))
                .unwrap()
                .trim(),
        );
        let state = poll(
            "systemctl is-system-running to settle",
            Duration::from_secs(60),
            || {
                if let Ok(Some(status)) = booted.boot.try_wait() {
                    panic!(
                        "systemd exited ({status}) while booting:\n{}",
                        booted.console()
                    );
                }
                let (_, out, _) = booted.sh("systemctl is-system-running");
                let out = out.trim().to_string();
                matches!(out.as_str(), "running" | "degraded").then_some(out)
            },
        );
        booted.boot_time = started.elapsed();
        booted.state = state;
        booted
    }

    /// The directory of this boot: console.log, the overlay's upper layer.
    pub fn dir(&self) -> &Path {
        self.dir.as_ref().unwrap().path()
    }

    /// What systemd wrote to its console so far.
    pub fn console(&self) -> String {
        std::fs::read_to_string(self.dir().join("console.log")).unwrap_or_default()
    }

    /// The console and the end of the journal, for a failing test's message.
    pub fn diagnostics(&self) -> String {
        let (_, journal, _) = self.sh("journalctl -b --no-pager -n 200");
        format!(
            "--- systemd's console ---\n{}\n--- journal (last 200) ---\n{journal}",
            self.console()
        )
    }

    /// `systemctl --failed`, one unit a line with its state.
    pub fn failed_units(&self) -> String {
        self.sh("systemctl --failed --no-legend --plain").1
    }

    fn command(&self, cmd: &str) -> Command {
        // The shell moves itself into the exec cgroup, then enters every
        // namespace of systemd's (and its root) with a clean environment.
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg(r#"echo 0 >"$1/exec/cgroup.procs" && exec nsenter -t "$2" -a env -i PATH="$3" LANG=C.UTF-8 TERM=dumb SYSTEMD_COLORS=0 SYSTEMD_PAGER= /bin/sh -c "$4""#)
            .arg("sh")
            .arg(&self.cgroup)
            .arg(self.pid.to_string())
            .arg(PATH)
            .arg(cmd);
        c
    }

    /// Runs `cmd` with /bin/sh inside: (exit code, stdout, stderr).
    pub fn sh(&self, cmd: &str) -> (i32, String, String) {
        super::run(&mut self.command(cmd))
    }

    /// Runs `cmd` inside and returns its stdout; panics (with the
    /// diagnostics) when it fails.
    pub fn ok(&self, cmd: &str) -> String {
        let (code, out, err) = self.sh(cmd);
        assert!(
            code == 0,
            "`{cmd}` inside exited {code}:\n{out}{err}\n{}",
            self.diagnostics()
        );
        out
    }

    /// Writes `contents` to `path` inside (parents made), with `mode`.
    pub fn write(&self, path: &str, contents: &[u8], mode: u32) {
        let mut c = self.command(&format!(
            "mkdir -p \"$(dirname '{path}')\" && cat >'{path}' && chmod {mode:o} '{path}'"
        ));
        let mut child = c
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(contents).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "writing {path} inside: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Copies a host file to `path` inside, keeping its permission bits.
    pub fn copy_in(&self, host: impl AsRef<Path>, path: &str) {
        use std::os::unix::fs::PermissionsExt;
        let host = host.as_ref();
        let bytes = std::fs::read(host).unwrap_or_else(|e| panic!("{}: {e}", host.display()));
        let mode = std::fs::metadata(host).unwrap().permissions().mode() & 0o7777;
        self.write(path, &bytes, mode);
    }

    /// `dpkg -i` of a host .deb inside; returns dpkg's output.
    pub fn install_deb(&self, deb: impl AsRef<Path>) -> String {
        let deb = deb.as_ref();
        let inside = format!("/tmp/{}", deb.file_name().unwrap().to_str().unwrap());
        self.copy_in(deb, &inside);
        self.ok(&format!("dpkg -i '{inside}' 2>&1"))
    }

    /// `journalctl -o json --no-pager <args>`, one JSON object an entry.
    pub fn journal_json(&self, args: &str) -> Vec<serde_json::Value> {
        self.ok(&format!("journalctl -o json --no-pager {args}"))
            .lines()
            .map(super::json)
            .collect()
    }

    /// `systemctl show -p <prop> --value <unit>`.
    pub fn show(&self, unit: &str, prop: &str) -> String {
        self.ok(&format!("systemctl show -p {prop} --value {unit}"))
            .trim()
            .to_string()
    }

    /// Powers systemd off (SIGRTMIN+4, its poweroff signal in a container)
    /// and waits for it to exit by itself; returns how long that took.
    /// Panics if it had to be killed. Everything is cleaned up either way.
    pub fn poweroff(mut self) -> Duration {
        let t = Instant::now();
        let clean = self.shutdown();
        let took = t.elapsed();
        assert!(
            clean,
            "systemd did not power off within 30s:\n{}",
            self.console()
        );
        took
    }

    /// Asks systemd to power off and waits up to 30s, then kills whatever is
    /// left in the cgroups, removes them and the directory. True when
    /// systemd exited by itself in time.
    fn shutdown(&mut self) -> bool {
        let Some(dir) = self.dir.take() else {
            return true;
        };
        let mut clean = true;
        if self.pid > 0 {
            // nix has no real-time signals; kill(1) names them.
            let _ = Command::new("kill")
                .args(["-s", "RTMIN+4", &self.pid.to_string()])
                .status();
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.boot.try_wait().ok().flatten().is_none() {
            if Instant::now() > deadline {
                clean = false;
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if !self.cgroup.as_os_str().is_empty() {
            for part in ["payload", "exec"] {
                let cg = self.cgroup.join(part);
                let _ = std::fs::write(cg.join("cgroup.kill"), "1");
            }
        }
        let _ = self.boot.kill();
        let _ = self.boot.wait();
        if !self.cgroup.as_os_str().is_empty() {
            remove_cgroup(&self.cgroup);
        }
        if std::thread::panicking() {
            eprintln!(
                "--- systemd's console ({}) ---\n{}",
                dir.path().join("console.log").display(),
                std::fs::read_to_string(dir.path().join("console.log")).unwrap_or_default()
            );
        }
        drop(dir);
        clean
    }
}

/// Removes a cgroup tree, deepest first, once its processes are gone.
fn remove_cgroup(cg: &Path) {
    let mut dirs = Vec::new();
    let mut todo = vec![cg.to_path_buf()];
    while let Some(d) = todo.pop() {
        if let Ok(entries) = std::fs::read_dir(&d) {
            for e in entries.flatten() {
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    todo.push(e.path());
                }
            }
        }
        dirs.push(d);
    }
    // No panics here: this runs in Drop, maybe while a test panics.
    let deadline = Instant::now() + Duration::from_secs(10);
    for d in dirs.iter().rev() {
        while std::fs::read_to_string(d.join("cgroup.procs"))
            .map(|p| !p.trim().is_empty())
            .unwrap_or(false)
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Err(e) = std::fs::remove_dir(d) {
            eprintln!("systemd harness: cannot remove {}: {e}", d.display());
        }
    }
}

impl Drop for Booted {
    fn drop(&mut self) {
        self.shutdown();
    }
}
