//! Helpers shared by the end-to-end tests: the built binary, the fake NVML
//! library, the fixture trees.
#![allow(dead_code)]

pub mod crash;
pub mod dra;
pub mod systemd;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The built binary. Its metrics endpoint listens on a free loopback port
/// (tests run side by side; `:9400` would be taken by the first).
pub fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpu-agent"));
    c.env("DCGM_EXPORTER_LISTEN", "127.0.0.1:0");
    c
}

/// `gpu-agent --host-root <root>`.
pub fn at(root: impl AsRef<Path>) -> Command {
    let mut c = bin();
    c.arg("--host-root").arg(root.as_ref());
    c
}

/// Sends SIGTERM to a running agent and returns its exit code.
pub fn sigterm(child: &mut std::process::Child) -> Option<i32> {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    child.wait().unwrap().code()
}

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The Python interpreter with grpcio and grpcio-tools, for the peers we did
/// not write (scripts/test makes the venv; GPU_AGENT_PYTHON names another).
pub fn python() -> PathBuf {
    let py = std::env::var_os("GPU_AGENT_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("target/pyvenv/bin/python"));
    assert!(
        py.exists(),
        "{} is missing: scripts/test makes it (python3 -m venv target/pyvenv && target/pyvenv/bin/pip install grpcio grpcio-tools)",
        py.display()
    );
    py
}

pub fn host_fixture(name: &str) -> PathBuf {
    repo().join("tests/fixtures/hosts").join(name)
}

/// A private copy of a host fixture tree, in a temp dir the caller keeps.
pub fn copy_host_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let copy = Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", host_fixture(name).display()))
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(copy.success(), "copying the {name} host fixture");
    dir
}

pub fn fixture(rel: &str) -> PathBuf {
    repo().join("tests/fixtures").join(rel)
}

/// The fake libnvidia-ml (tests/fake-nvml), presented under the real
/// library's name in a temp dir. It is a dev-dependency of this crate, so
/// cargo builds the .so (into target/<profile>/deps) before the tests run.
pub fn fake_nvml() -> (tempfile::TempDir, PathBuf) {
    // The test binary is target/<profile>/deps/<name>.
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let built = [
        deps.join("libfake_nvml.so"),
        deps.parent().unwrap().join("libfake_nvml.so"),
    ]
    .into_iter()
    .find(|p| p.exists())
    .unwrap_or_else(|| {
        panic!(
            "libfake_nvml.so is not in {}: build it with `cargo build -p fake-nvml`",
            deps.display()
        )
    });
    let dir = tempfile::tempdir().unwrap();
    let lib = dir.path().join("libnvidia-ml.so.1");
    std::os::unix::fs::symlink(&built, &lib).unwrap();
    (dir, lib)
}

pub fn run(cmd: &mut Command) -> (i32, String, String) {
    let Output {
        status,
        stdout,
        stderr,
    } = cmd.output().unwrap();
    (
        status.code().unwrap_or(-1),
        String::from_utf8(stdout).unwrap(),
        String::from_utf8(stderr).unwrap(),
    )
}

pub fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}):\n{text}"))
}

/// `containerd --config <config> config dump`: the effective config (imports
/// merged), or a panic with containerd's own words.
pub fn containerd_dump(bin: &Path, config: &Path) -> String {
    let out = Command::new(bin)
        .arg("--config")
        .arg(config)
        .args(["config", "dump"])
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    assert!(
        out.status.success(),
        "{} config dump: {}",
        bin.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Debian sid's containerd 2.x, unpacked by scripts/fetch-containerd2
/// (`GPU_AGENT_CONTAINERD2` names another).
pub fn containerd_2() -> PathBuf {
    let bin = std::env::var_os("GPU_AGENT_CONTAINERD2")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("target/containerd-2/usr/bin/containerd"));
    assert!(
        bin.exists(),
        "{} is missing: run scripts/fetch-containerd2 (scripts/test does)",
        bin.display()
    );
    bin
}

/// Runs `gpu-agent <args>` with `stdin` fed in, as a container runtime runs a hook.
pub fn run_with_stdin(args: &[&str], stdin: &str) -> Output {
    use std::io::Write;
    let mut child = bin()
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

/// Puts the real containerd 2.x at `<host>/usr/bin/containerd` (a copy: a
/// link out of the host root is refused), so that the agent asks it for its
/// version and its effective configuration (`config dump`).
#[allow(dead_code)]
pub fn install_containerd_2(host: &Path) {
    let dest = host.join("usr/bin/containerd");
    std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
    let _ = std::fs::remove_file(&dest);
    std::fs::copy(containerd_2(), &dest).unwrap();
}

/// One stage's entry in `status -o json`.
pub fn stage(st: &serde_json::Value, name: &str) -> serde_json::Value {
    st["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == name)
        .unwrap_or_else(|| panic!("no stage {name} in {st:#}"))
        .clone()
}

/// The simulated node `name` in a new temp dir, with the kubelet's
/// device-plugin directory and an empty events file for the fake NVML
/// (its path is returned).
pub fn plugin_host(name: &str) -> (tempfile::TempDir, PathBuf) {
    let host = tempfile::tempdir().unwrap();
    simnode::NodeDescription::load(name)
        .unwrap()
        .materialize(host.path())
        .unwrap();
    std::fs::create_dir_all(host.path().join("var/lib/kubelet/device-plugins")).unwrap();
    let events = host.path().join("nvml-events");
    std::fs::write(&events, "").unwrap();
    (host, events)
}

/// A free loopback TCP port (bound, then let go), for a test's agent.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Writes a driver bundle at `path` and its sha256 sidecar beside it, as
/// `sha256sum` writes one.
pub fn write_bundle(path: &Path, tgz: &[u8]) {
    std::fs::write(path, tgz).unwrap();
    let sum = kmod::bundle::sha256_file(path, &mut |_| {}).unwrap();
    kmod::bundle::write_sidecar(path, &sum).unwrap();
}

/// Compiles a stand-in program (`tests/interop/<source>`) statically to
/// `dest`: it runs chrooted in a host root that has no C library.
pub fn build_static_standin(source: &str, dest: &Path) {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let out = Command::new(rustc)
        .args([
            "--edition",
            "2021",
            "-C",
            "target-feature=+crt-static",
            "-C",
            "opt-level=1",
        ])
        .arg(repo().join("tests/interop").join(source))
        .arg("-o")
        .arg(dest)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cannot build the stand-in {source}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
