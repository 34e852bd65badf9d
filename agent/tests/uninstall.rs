//! `gpu-agent uninstall`: a host tree checksummed before the agent ran,
//! then the real agent run over it (runtime config and drop-in, CDI spec and
//! hook program, labels, validation files, state), then uninstall, then the
//! tree checksummed again: identical, to the byte, mode and symlink.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use sha2::{Digest, Sha256};

/// Every entry under `root`: its kind, mode, owner and bytes (sha256) or
/// link target.
fn tree(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let m = fs::symlink_metadata(&p).unwrap();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let mode = m.permissions().mode() & 0o7777;
            let what = if m.file_type().is_symlink() {
                format!("link {}", fs::read_link(&p).unwrap().display())
            } else if m.is_dir() {
                todo.push(p.clone());
                format!("dir {mode:o} {}:{}", m.uid(), m.gid())
            } else if m.is_file() {
                let sha = Sha256::digest(fs::read(&p).unwrap());
                let hex: String = sha.iter().map(|b| format!("{b:02x}")).collect();
                format!("file {mode:o} {}:{} {hex}", m.uid(), m.gid())
            } else {
                format!("other {:o}", m.mode())
            };
            out.insert(rel, what);
        }
    }
    out
}

fn differences(a: &BTreeMap<String, String>, b: &BTreeMap<String, String>) -> Vec<String> {
    let mut d = Vec::new();
    for (k, v) in a {
        match b.get(k) {
            None => d.push(format!("gone: {k} ({v})")),
            Some(w) if w != v => d.push(format!("changed: {k}: {v} -> {w}")),
            _ => {}
        }
    }
    for (k, v) in b {
        if !a.contains_key(k) {
            d.push(format!("new: {k} ({v})"));
        }
    }
    d
}

/// A node with containerd 2.x and its own config (a comment, a custom
/// setting), the kubelet's plugin directory, and a simulated GPU.
fn host() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let h = dir.path();
    fs::create_dir_all(h.join("etc/containerd")).unwrap();
    fs::copy(
        fixture("containerd/valid/v2-custom.toml"),
        h.join("etc/containerd/config.toml"),
    )
    .unwrap();
    fs::set_permissions(
        h.join("etc/containerd/config.toml"),
        fs::Permissions::from_mode(0o640),
    )
    .unwrap();
    install_containerd_2(h);
    // Every Linux host has /var/lib (gpu-agent's own caches go under it
    // before anything records what it made). No kubelet yet: the agent
    // makes its plugin directory, and uninstall must remove it again.
    fs::create_dir_all(h.join("var/lib")).unwrap();
    // No service manager in the sandbox: the runtime is not restarted.
    fs::write(
        h.join("policy.yaml"),
        "spec:\n  toolkit:\n    reload: none\n",
    )
    .unwrap();
    // A file of someone else's in a directory the agent writes to.
    fs::create_dir_all(h.join("run/nvidia/validations")).unwrap();
    fs::write(h.join("run/nvidia/validations/cuda-ready"), "").unwrap();
    dir
}

fn agent_at(h: &Path) -> std::process::Command {
    let mut c = at(h);
    c.args(["--simulate", "a10g-1", "--policy"])
        .arg(h.join("policy.yaml"));
    c
}

#[test]
fn uninstall_leaves_the_host_tree_as_it_was_before_the_agent() {
    let dir = host();
    let h = dir.path();
    let before = tree(h);

    // The real agent, until the runtime and CDI stages have validated.
    let mut child = agent_at(h)
        .arg("run")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, out, _) = run(agent_at(h).args(["status", "-o", "json"]));
        if let Ok(st) = serde_json::from_str::<serde_json::Value>(&out)
            && st["source"] == "running-agent"
            && ["runtime", "cdi", "labels"]
                .iter()
                .all(|s| stage(&st, s)["validation"]["ok"] == true)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the agent did not validate:\n{out}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // While it runs, uninstall refuses and changes nothing.
    let running = tree(h);
    let (code, out, err) = run(agent_at(h).args(["uninstall", "--no-wait"]));
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains(&format!("(pid {}) is running", child.id())) && err.contains("stop it first"),
        "{err}"
    );
    // (The running agent keeps its own state file up to date meanwhile.)
    let d: Vec<String> = differences(&running, &tree(h))
        .into_iter()
        .filter(|d| !d.contains("run/gpu-agent/state.json"))
        .collect();
    assert!(d.is_empty(), "{d:#?}");

    assert_eq!(sigterm(&mut child), Some(0));
    let after_run = tree(h);
    let changed = differences(&before, &after_run);
    // What the agent did, so the comparison below is not vacuous.
    for want in [
        "changed: etc/containerd/config.toml",
        "new: var/run/cdi/gpu-agent-nvidia.com-gpu.json",
        "new: var/lib/gpu-agent/bin/gpu-agent",
        "new: etc/kubernetes/node-feature-discovery/features.d/gfd",
        "new: run/nvidia/validations/toolkit-ready",
        "new: run/gpu-agent/state.json",
        "new: var/lib/gpu-agent/backup/manifest.json",
        "new: var/lib/kubelet/device-plugins",
    ] {
        assert!(
            changed.iter().any(|c| c.starts_with(want)),
            "the agent should have made `{want}…`:\n{}",
            changed.join("\n")
        );
    }

    let (code, out, err) = run(agent_at(h).arg("uninstall"));
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("restored /etc/containerd/config.toml"),
        "{out}"
    );
    assert!(out.contains("removed /var/lib/gpu-agent/"), "{out}");
    let left = differences(&before, &tree(h));
    assert!(
        left.is_empty(),
        "the host is not as it was:\n{}\n\nuninstall said:\n{out}",
        left.join("\n")
    );

    // Again: nothing to undo, and still nothing changed.
    let (code, out, err) = run(agent_at(h).arg("uninstall"));
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("nothing to undo"), "{out}");
    assert!(differences(&before, &tree(h)).is_empty());
}

#[test]
fn the_checksum_sees_what_uninstall_must_undo() {
    let dir = host();
    let h = dir.path();
    let before = tree(h);
    fs::write(h.join("etc/containerd/config.toml"), "version = 2\n").unwrap();
    fs::set_permissions(h.join("run/nvidia"), fs::Permissions::from_mode(0o700)).unwrap();
    fs::create_dir_all(h.join("etc/cdi")).unwrap();
    let d = differences(&before, &tree(h));
    assert_eq!(d.len(), 3, "{d:#?}");
    assert!(d[0].starts_with("changed: etc/containerd/config.toml: file 640"));
    assert!(d[1].starts_with("changed: run/nvidia: dir 755"), "{d:#?}");
    assert_eq!(
        d[2],
        "new: etc/cdi (dir 755 0:0)".replace("0:0", &{
            let m = fs::metadata(h.join("etc/cdi")).unwrap();
            format!("{}:{}", m.uid(), m.gid())
        })
    );
}
