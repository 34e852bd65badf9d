//! Both generations of a real containerd read what `runtime configure`
//! wrote: Debian's installed 1.6 (config version 2, no CDI) and Debian
//! sid's 2.x unpacked by `scripts/fetch-containerd2` (config version 3, CDI,
//! our drop-in). Each is asked twice: `config dump` (the effective config,
//! drop-ins merged), and a daemon started on the patched config with a
//! private socket, root and state, whose CRI service is asked for its
//! configuration (`Status` verbose) and then stopped by its PID.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use gpu_agent_proto::cri::v1::StatusRequest;
use gpu_agent_proto::cri::v1::runtime_service_client::RuntimeServiceClient;

const CONFIG: &str = "etc/containerd/config.toml";
const DROP_IN_DIR: &str = "etc/containerd/conf.d";

/// Debian's containerd 1.6 (scripts/test installs it).
fn containerd_1_6() -> PathBuf {
    let out = Command::new("containerd").arg("--version").output();
    let out = out.unwrap_or_else(|_| {
        panic!("containerd is not installed (scripts/test installs Debian's containerd)")
    });
    let v = String::from_utf8_lossy(&out.stdout);
    assert!(
        v.contains(" 1.6."),
        "expected Debian's containerd 1.6, got {v}"
    );
    PathBuf::from("containerd")
}

fn version_of(bin: &Path) -> String {
    let out = Command::new(bin).arg("--version").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    // "containerd github.com/containerd/containerd/v2 2.1.9+unknown"
    text.split_whitespace()
        .nth(2)
        .and_then(|v| v.split(['+', '~']).next())
        .unwrap_or_else(|| panic!("no version in {text:?}"))
        .to_string()
}

/// A host root with the valid containerd fixture `config` (or no config) and
/// no NVIDIA toolkit, configured for `version` by `gpu-agent runtime configure`.
fn configured(config: Option<&str>, version: &str) -> tempfile::TempDir {
    let host = tempfile::tempdir().unwrap();
    fs::create_dir_all(host.path().join("etc/containerd")).unwrap();
    if let Some(f) = config {
        fs::copy(
            fixture(&format!("containerd/valid/{f}")),
            host.path().join(CONFIG),
        )
        .unwrap();
    }
    let (code, out, err) =
        run(at(host.path()).args(["runtime", "configure", "--containerd-version", version]));
    assert_eq!(code, 0, "{out}{err}");
    host
}

/// The config containerd is pointed at. The main config imports the drop-in
/// by its host path (`/etc/containerd/conf.d/*.toml`); the host here is a
/// temp dir, so a copy whose import names the same directory inside it is
/// what containerd reads. Nothing else differs.
fn config_for_containerd(host: &Path) -> PathBuf {
    let main = fs::read_to_string(host.join(CONFIG)).unwrap();
    let inside = format!("{}/{DROP_IN_DIR}/*.toml", host.display());
    let text = main.replace("/etc/containerd/conf.d/*.toml", &inside);
    let path = host.join("containerd-test.toml");
    fs::write(&path, text).unwrap();
    path
}

/// The text of one table in a `config dump`, up to the next header.
fn table<'a>(dump: &'a str, header_suffix: &str) -> Option<&'a str> {
    let start = dump
        .lines()
        .position(|l| l.trim().starts_with('[') && l.trim().ends_with(header_suffix))?;
    let lines: Vec<&str> = dump.lines().collect();
    let end = lines[start + 1..]
        .iter()
        .position(|l| l.trim().starts_with('['))
        .map_or(lines.len(), |i| start + 1 + i);
    let first = dump.find(lines[start]).unwrap();
    let last = if end < lines.len() {
        dump.find(lines[end]).unwrap()
    } else {
        dump.len()
    };
    Some(&dump[first..last])
}

#[test]
fn containerd_2_merges_our_drop_in_with_cdi_on_and_the_users_runc_kept() {
    let bin = containerd_2();
    let version = version_of(&bin);
    assert!(version.starts_with("2."), "{version}");
    for fixture in [Some("v3.toml"), None] {
        let host = configured(fixture, &version);
        assert!(
            host.path()
                .join(DROP_IN_DIR)
                .join("99-gpu-agent.toml")
                .exists(),
            "{fixture:?}: no drop-in on containerd {version}"
        );
        let text = containerd_dump(&bin, &config_for_containerd(host.path()));
        let nvidia = table(&text, ".containerd.runtimes.nvidia]").unwrap_or_else(|| {
            panic!("{fixture:?}: no nvidia runtime in the effective config:\n{text}")
        });
        assert!(
            nvidia.contains("runtime_type = 'io.containerd.runc.v2'"),
            "{nvidia}"
        );
        let cri = table(&text, "[plugins.'io.containerd.cri.v1.runtime']").unwrap();
        assert!(cri.contains("enable_cdi = true"), "{cri}");
        assert!(
            cri.contains("cdi_spec_dirs = ['/etc/cdi', '/var/run/cdi']"),
            "{cri}"
        );
        if fixture.is_some() {
            let runc = table(&text, ".containerd.runtimes.runc.options]").unwrap();
            assert!(
                runc.contains("SystemdCgroup = true"),
                "the user's runc options were lost:\n{text}"
            );
            // No NVIDIA toolkit on this host: plain runc, with the user's options.
            let nvidia_opts = table(&text, ".containerd.runtimes.nvidia.options]").unwrap();
            assert!(
                nvidia_opts.contains("SystemdCgroup = true"),
                "{nvidia_opts}"
            );
            assert!(!nvidia_opts.contains("BinaryName"), "{nvidia_opts}");
        }
    }
}

/// A containerd daemon on a private socket, root and state; stopped (by
/// PID) when dropped.
struct Daemon {
    child: Child,
    _dir: tempfile::TempDir,
    socket: PathBuf,
}

impl Daemon {
    fn start(bin: &Path, config: &Path) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("containerd.sock");
        let log = fs::File::create(dir.path().join("containerd.log")).unwrap();
        let child = Command::new(bin)
            .arg("--config")
            .arg(config)
            .arg("--address")
            .arg(&socket)
            .arg("--root")
            .arg(dir.path().join("root"))
            .arg("--state")
            .arg(dir.path().join("state"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut d = Daemon {
            child,
            _dir: dir,
            socket,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !d.socket.exists() {
            if let Some(status) = d.child.try_wait().unwrap() {
                panic!("containerd exited ({status}):\n{}", d.log());
            }
            assert!(
                Instant::now() < deadline,
                "no socket after 30 s:\n{}",
                d.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }

    fn log(&self) -> String {
        fs::read_to_string(self._dir.path().join("containerd.log")).unwrap_or_default()
    }

    /// The CRI plugin's configuration as the running daemon reports it.
    fn cri_config(&self) -> serde_json::Value {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let info = rt.block_on(async {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let answer = async {
                    let channel = gpu_agent::plugin::kubelet::connect(&self.socket)
                        .await
                        .map_err(|e| e.to_string())?;
                    RuntimeServiceClient::new(channel)
                        .status(StatusRequest { verbose: true })
                        .await
                        .map_err(|e| e.to_string())
                }
                .await;
                match answer {
                    Ok(resp) => break resp.into_inner().info,
                    // The CRI service comes up a moment after the socket.
                    Err(_) if Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Err(e) => panic!("CRI Status: {e}\n{}", self.log()),
                }
            }
        });
        let config = info
            .get("config")
            .unwrap_or_else(|| panic!("no config in the CRI status: {info:?}"));
        json(config)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = sigterm(&mut self.child);
    }
}

/// Sequential on purpose: one daemon at a time (the CRI streaming server
/// of 1.6 takes a fixed port).
#[test]
fn running_containerd_1_6_and_2_serve_the_nvidia_runtime() {
    // 1.6: the config edited in place, the toolkit's runtime as BinaryName
    // (1.6 has no CDI, so gpu-agent needs nvidia-container-runtime there).
    let v16 = containerd_1_6();
    let host = tempfile::tempdir().unwrap();
    fs::create_dir_all(host.path().join("etc/containerd")).unwrap();
    fs::create_dir_all(host.path().join("usr/bin")).unwrap();
    fs::write(host.path().join("usr/bin/nvidia-container-runtime"), "").unwrap();
    fs::copy(
        fixture("containerd/valid/v2-default-1.6.toml"),
        host.path().join(CONFIG),
    )
    .unwrap();
    let (code, out, err) = run(at(host.path()).args([
        "runtime",
        "configure",
        "--containerd-version",
        &version_of(&v16),
    ]));
    assert_eq!(code, 0, "{out}{err}");
    let d = Daemon::start(&v16, &host.path().join(CONFIG));
    let cfg = d.cri_config();
    let nvidia = &cfg["containerd"]["runtimes"]["nvidia"];
    assert_eq!(nvidia["runtimeType"], "io.containerd.runc.v2", "{cfg:#}");
    assert_eq!(
        nvidia["options"]["BinaryName"], "/usr/bin/nvidia-container-runtime",
        "{cfg:#}"
    );
    assert_eq!(
        cfg["containerd"]["runtimes"]["runc"]["runtimeType"],
        "io.containerd.runc.v2"
    );
    drop(d);

    // 2.x: drop-in plus one import, CDI on.
    let v2 = containerd_2();
    let host = configured(Some("v3.toml"), &version_of(&v2));
    let d = Daemon::start(&v2, &config_for_containerd(host.path()));
    let cfg = d.cri_config();
    let nvidia = &cfg["containerd"]["runtimes"]["nvidia"];
    assert_eq!(nvidia["runtimeType"], "io.containerd.runc.v2", "{cfg:#}");
    assert_eq!(nvidia["options"]["SystemdCgroup"], true, "{cfg:#}");
    assert_eq!(cfg["enableCDI"], true, "{cfg:#}");
    assert_eq!(
        cfg["cdiSpecDirs"],
        serde_json::json!(["/etc/cdi", "/var/run/cdi"]),
        "{cfg:#}"
    );
    drop(d);
}
