//! Reconcile at the library level, on a copy of the 8x H100 host fixture
//! (sysfs, /proc, /dev, driver files) with a containerd config: a second
//! pass over an unchanged node makes no system call and changes no file
//! (checksums, modes, device numbers and modification times); drift —
//! a device node deleted, another with the wrong mode, gpu-agent's keys
//! taken out of containerd's config by an admin, the CDI spec deleted —
//! is seen by validation and repaired by the next pass, the admin's own
//! lines kept. Device nodes are made for real (mknod), so this runs as root.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use gpu_agent::backend::sim::SimulatedBackend;
use gpu_agent::caps::HeldCaps;
use gpu_agent::policy::Policy;
use gpu_agent::stages::{self, Context, Pass, Stage, StageState};
use hostlib::{HostRoot, LinuxSyscalls, RecordingSyscalls, Syscalls};
use sha2::{Digest, Sha256};

const CONFIG: &str = "etc/containerd/config.toml";
const HOOK: &str = "usr/local/bin/gpu-agent-hook";

fn policy() -> Policy {
    Policy::from_yaml(
        "spec:\n  toolkit:\n    reload: none\n  cdi:\n    hookPath: /usr/local/bin/gpu-agent-hook\n",
        "test policy",
    )
    .unwrap()
}

/// Every entry under `root`: type, mode, device number, size, mtime, content hash.
fn snapshot(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            if rel == hostlib::managed::LOCK_FILE.trim_start_matches('/') {
                // The host-files lock (/run, tmpfs) is taken for each pass
                // and emptied when let go: its times move, and it must be
                // empty (no holder named) whenever no pass runs.
                out.insert(rel, format!("lock, {} bytes", m.size()));
                continue;
            }
            let mut line = format!(
                "mode {:o} rdev {} size {} mtime {}.{}",
                m.mode(),
                m.rdev(),
                m.size(),
                m.mtime(),
                m.mtime_nsec()
            );
            if m.is_dir() {
                stack.push(p);
            } else if m.is_file() {
                let hash = Sha256::digest(std::fs::read(&p).unwrap());
                let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
                line.push_str(&format!(" sha256 {hex}"));
            } else if m.file_type().is_symlink() {
                line.push_str(&format!(
                    " -> {}",
                    std::fs::read_link(&p).unwrap().display()
                ));
            }
            out.insert(rel, line);
        }
    }
    out
}

struct Node {
    _dir: tempfile::TempDir,
    host: HostRoot,
    backend: SimulatedBackend,
    caps: HeldCaps,
    policy: Policy,
}

impl Node {
    fn new() -> Node {
        let dir = common::copy_host_fixture("h100-sxm-8");
        std::fs::create_dir_all(dir.path().join("etc/containerd")).unwrap();
        std::fs::copy(
            common::fixture("containerd/valid/v2-custom.toml"),
            dir.path().join(CONFIG),
        )
        .unwrap();
        // The real containerd 2.x: asked for its version and, by
        // validation, for its effective configuration.
        common::install_containerd_2(dir.path());
        std::fs::create_dir_all(dir.path().join("usr/local/bin")).unwrap();
        std::fs::write(dir.path().join(HOOK), "#!/bin/sh\n").unwrap();
        let host = HostRoot::new(dir.path()).unwrap();
        let backend = SimulatedBackend::new(simnode::NodeDescription::load("h100-sxm-8").unwrap());
        Node {
            _dir: dir,
            host,
            backend,
            caps: HeldCaps::read(),
            policy: policy(),
        }
    }

    fn pass(&self, syscalls: &dyn Syscalls, apply: bool) -> Pass {
        stages::run_pass(&Context {
            policy: &self.policy,
            caps: &self.caps,
            sys: &self.host,
            backend: &self.backend,
            host: &self.host,
            apply: apply.then_some(&hostlib::command::SystemRunner as _),
            syscalls,
            simulated: false,
            drain: None,
            serve_first: false,
            changes: Default::default(),
            mig_hold: None,
            upgrade: Default::default(),
            logged: None,
        })
    }

    fn path(&self, rel: &str) -> std::path::PathBuf {
        self.host.path().join(rel)
    }
}

fn stage(p: &Pass, s: Stage) -> &stages::StageStatus {
    p.stages.iter().find(|x| x.stage == s).unwrap()
}

fn root() -> bool {
    nix::unistd::geteuid().is_root()
}

#[test]
fn an_unchanged_node_is_left_alone_and_drift_is_repaired() {
    if !root() {
        eprintln!("skipped: making device nodes (mknod) needs root");
        return;
    }
    let node = Node::new();
    // Setup: the device nodes, containerd's config, the CDI spec and NFD's
    // feature file with the GPU labels.
    let first = node.pass(&LinuxSyscalls, true);
    for s in [Stage::Devnodes, Stage::Runtime, Stage::Cdi, Stage::Labels] {
        let st = stage(&first, s);
        assert_eq!(st.state, StageState::Done, "{st:?}");
        assert!(!st.changed.is_empty(), "setup changes nothing in {s:?}?");
    }
    let validate = stage(&first, Stage::Validate);
    assert_eq!(validate.state, StageState::Done, "{validate:?}");
    for s in [
        Stage::Driver,
        Stage::Devnodes,
        Stage::Runtime,
        Stage::Cdi,
        Stage::Labels,
    ] {
        let v = stage(&first, s).validation.as_ref().unwrap();
        assert!(v.ok, "{s:?}: {}", v.detail);
    }
    // The runtime's validation ran the real containerd on the config.
    let v = stage(&first, Stage::Runtime).validation.as_ref().unwrap();
    assert!(
        v.detail.starts_with("the host's containerd 2.")
            && v.detail
                .ends_with("accepts the configuration and shows the \"nvidia\" runtime and CDI"),
        "{v:?}"
    );

    // A reconcile of the unchanged node: no system call, no file touched.
    let before = snapshot(node.host.path());
    let rec = RecordingSyscalls::new();
    let second = node.pass(&rec, true);
    assert!(rec.calls().is_empty(), "{:?}", rec.calls());
    assert_eq!(snapshot(node.host.path()), before, "a file changed");
    for s in &second.stages {
        assert!(
            s.changed.is_empty(),
            "{:?} changed {:?}",
            s.stage,
            s.changed
        );
        assert_ne!(s.state, StageState::Failed, "{s:?}");
    }

    // Drift.
    std::fs::remove_file(node.path("dev/nvidia3")).unwrap();
    std::fs::set_permissions(
        node.path("dev/nvidiactl"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let mut admin =
        std::fs::read_to_string(common::fixture("containerd/valid/v2-custom.toml")).unwrap();
    admin.push_str("\n# admin: rolled the runtime config back by hand\n");
    std::fs::write(node.path(CONFIG), &admin).unwrap();
    let spec = node.path("var/run/cdi");
    std::fs::remove_dir_all(&spec).unwrap();
    let gfd = node.path(gpu_agent::labels::FEATURES_FILE.trim_start_matches('/'));
    let labels = std::fs::read_to_string(&gfd).unwrap();
    std::fs::write(&gfd, "nvidia.com/gpu.count=1\n").unwrap();

    // Looking only, each stage sees its drift.
    let look = node.pass(&RecordingSyscalls::new(), false);
    let devnodes = stage(&look, Stage::Devnodes);
    assert_eq!(devnodes.state, StageState::Ready, "{devnodes:?}");
    assert!(
        devnodes.detail.contains("/dev/nvidiactl") && devnodes.detail.contains("/dev/nvidia3"),
        "{devnodes:?}"
    );
    assert_eq!(stage(&look, Stage::Runtime).state, StageState::Ready);
    assert_eq!(stage(&look, Stage::Cdi).state, StageState::Ready);
    assert_eq!(stage(&look, Stage::Labels).state, StageState::Ready);

    // The next pass repairs exactly that.
    let third = node.pass(&LinuxSyscalls, true);
    let devnodes = stage(&third, Stage::Devnodes);
    assert!(
        devnodes.changed.iter().any(|c| c.contains("/dev/nvidia3")),
        "{devnodes:?}"
    );
    assert!(
        devnodes
            .changed
            .iter()
            .any(|c| c.contains("/dev/nvidiactl")),
        "{devnodes:?}"
    );
    assert_eq!(
        devnodes.changed.len(),
        2,
        "only the two: {:?}",
        devnodes.changed
    );
    let runtime = stage(&third, Stage::Runtime);
    assert!(
        runtime
            .changed
            .iter()
            .any(|c| c.contains("/etc/containerd/config.toml")),
        "{runtime:?}"
    );
    let text = std::fs::read_to_string(node.path(CONFIG)).unwrap();
    assert!(
        text.contains("# admin: rolled the runtime config back by hand"),
        "{text}"
    );
    assert!(
        text.contains("# Production containerd config — keep this comment"),
        "{text}"
    );
    // containerd 2.1: the main config imports gpu-agent's drop-in.
    assert!(text.contains("\"/etc/containerd/conf.d/*.toml\""), "{text}");
    let drop_in =
        std::fs::read_to_string(node.path("etc/containerd/conf.d/99-gpu-agent.toml")).unwrap();
    assert!(drop_in.contains("runtimes.nvidia"), "{drop_in}");
    assert!(!stage(&third, Stage::Cdi).changed.is_empty());
    assert_eq!(
        stage(&third, Stage::Labels).changed,
        [format!("wrote {}", gpu_agent::labels::FEATURES_FILE)]
    );
    assert_eq!(std::fs::read_to_string(&gfd).unwrap(), labels);
    for s in [
        Stage::Driver,
        Stage::Devnodes,
        Stage::Runtime,
        Stage::Cdi,
        Stage::Labels,
    ] {
        let v = stage(&third, s).validation.as_ref().unwrap();
        assert!(v.ok, "{s:?} after repair: {}", v.detail);
    }
    let m = std::fs::metadata(node.path("dev/nvidiactl")).unwrap();
    assert_eq!(m.mode() & 0o777, 0o666);

    // And then it is quiet again.
    let rec = RecordingSyscalls::new();
    let before = snapshot(node.host.path());
    let fourth = node.pass(&rec, true);
    assert!(rec.calls().is_empty(), "{:?}", rec.calls());
    assert_eq!(snapshot(node.host.path()), before);
    assert!(fourth.stages.iter().all(|s| s.changed.is_empty()));
}

#[test]
fn validation_names_what_drifted_without_changing_it() {
    if !root() {
        eprintln!("skipped: making device nodes (mknod) needs root");
        return;
    }
    let node = Node::new();
    node.pass(&LinuxSyscalls, true);
    // The hook program the spec names is gone (the spec itself is as
    // generated): only validation can tell.
    std::fs::remove_file(node.path(HOOK)).unwrap();
    let before = snapshot(node.host.path());
    let rec = RecordingSyscalls::new();
    let look = node.pass(&rec, false);
    assert!(rec.calls().is_empty());
    assert_eq!(
        snapshot(node.host.path()),
        before,
        "looking changed something"
    );
    let cdi = stage(&look, Stage::Cdi);
    assert_eq!(cdi.state, StageState::Done, "{cdi:?}");
    let v = cdi.validation.as_ref().unwrap();
    assert!(!v.ok);
    assert!(
        v.detail
            .ends_with("names what is not there: /usr/local/bin/gpu-agent-hook"),
        "{v:?}"
    );
    let validate = stage(&look, Stage::Validate);
    assert_eq!(validate.state, StageState::Failed);
    assert!(validate.detail.starts_with("cdi: "), "{validate:?}");
    assert!(!stages::ready(&look.stages));

    // A driver library gone: the spec no longer matches the host, the CDI
    // stage itself sees it (and would write a new one).
    std::fs::write(node.path(HOOK), "#!/bin/sh\n").unwrap();
    let lib = node.path("usr/lib/x86_64-linux-gnu/libcuda.so.550.127.08");
    std::fs::remove_file(&lib).unwrap();
    let look = node.pass(&RecordingSyscalls::new(), false);
    let cdi = stage(&look, Stage::Cdi);
    assert_eq!(cdi.state, StageState::Ready, "{cdi:?}");
    assert!(cdi.detail.starts_with("would write"), "{cdi:?}");
}
