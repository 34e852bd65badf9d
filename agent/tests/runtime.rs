//! `gpu-agent runtime configure|restore` on containerd configs: golden
//! outputs, idempotence, byte-for-byte restore, bad input, the lock, and
//! Debian's real containerd 1.6 reading what we wrote (`config dump`).
//! Regenerate the golden files with `GPU_AGENT_UPDATE_GOLDEN=1`.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use common::*;

const CONFIG: &str = "etc/containerd/config.toml";
const DROP_IN: &str = "etc/containerd/conf.d/99-gpu-agent.toml";

/// A host root with `fixture` as containerd's config (or none) and, if
/// asked, the NVIDIA container runtime installed.
fn host_with(fixture: Option<&str>, nvidia_runtime: bool) -> tempfile::TempDir {
    let host = tempfile::tempdir().unwrap();
    fs::create_dir_all(host.path().join("etc/containerd")).unwrap();
    if let Some(f) = fixture {
        fs::copy(fixture_path(f), host.path().join(CONFIG)).unwrap();
    }
    if nvidia_runtime {
        fs::create_dir_all(host.path().join("usr/bin")).unwrap();
        fs::write(
            host.path().join("usr/bin/nvidia-container-runtime"),
            "#!/bin/sh\n",
        )
        .unwrap();
    }
    host
}

fn fixture_path(name: &str) -> PathBuf {
    fixture(&format!("containerd/{name}"))
}

fn files(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(
                    p.strip_prefix(root).unwrap().display().to_string(),
                    fs::read(&p).unwrap(),
                );
            }
        }
    }
    out
}

fn configure(host: &Path, version: &str, extra: &[&str]) -> (i32, String, String) {
    run(at(host)
        .args(extra)
        .args(["runtime", "configure", "--containerd-version", version]))
}

fn golden(name: &str, actual: &[u8]) {
    let path = match name.split_once('@').map(|(_, what)| what) {
        Some("docker.json") => fixture(&format!("docker/golden/{name}")),
        Some("crio.toml") => fixture(&format!("crio/golden/{name}")),
        _ => fixture_path(&format!("golden/{name}")),
    };
    if std::env::var_os("GPU_AGENT_UPDATE_GOLDEN").is_some() {
        fs::write(&path, actual).unwrap();
    }
    let want = fs::read(&path).unwrap_or_else(|_| {
        panic!(
            "{} missing (GPU_AGENT_UPDATE_GOLDEN=1 writes it)",
            path.display()
        )
    });
    assert_eq!(
        String::from_utf8_lossy(actual),
        String::from_utf8_lossy(&want),
        "differs from {}",
        path.display()
    );
}

/// Configure, compare with the golden files, configure again (no change),
/// restore (byte for byte, created files gone).
fn round_trip(fixture: Option<&str>, version: &str, nvidia_runtime: bool) -> tempfile::TempDir {
    let host = host_with(
        fixture.map(|f| format!("valid/{f}")).as_deref(),
        nvidia_runtime,
    );
    let before = files(host.path());
    let (code, out, err) = configure(host.path(), version, &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("+++ b/etc/containerd/"),
        "no diff printed: {out}"
    );
    let tag = format!("{}@{version}", fixture.unwrap_or("no-config"));
    golden(
        &format!("{tag}.toml"),
        &fs::read(host.path().join(CONFIG)).unwrap(),
    );
    // The user is told which files are new (restore removes them) and which
    // were changed (restore puts the original back).
    for (rel, had) in [(CONFIG, before.contains_key(CONFIG)), (DROP_IN, false)] {
        if !host.path().join(rel).exists() {
            continue;
        }
        let said = if had {
            format!("wrote /{rel} (the original is kept;")
        } else {
            format!("wrote /{rel} (a new file;")
        };
        assert!(err.contains(&said), "expected {said:?} in {err}");
    }
    if host.path().join(DROP_IN).exists() {
        golden(
            &format!("{tag}.drop-in.toml"),
            &fs::read(host.path().join(DROP_IN)).unwrap(),
        );
    }
    let after = files(host.path());
    let (code, out, err) = configure(host.path(), version, &[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("nothing to change"),
        "second run changed something: {out}"
    );
    let keep = tempfile::tempdir().unwrap();
    for (rel, bytes) in &after {
        let p = keep.path().join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, bytes).unwrap();
    }
    let (code, out, err) = run(at(host.path()).args(["runtime", "restore"]));
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("restored") || out.contains("removed"), "{out}");
    let restored: BTreeMap<String, Vec<u8>> = files(host.path())
        .into_iter()
        .filter(|(k, _)| !k.starts_with("var/lib/gpu-agent") && !k.starts_with("run/gpu-agent"))
        .collect();
    assert_eq!(
        restored, before,
        "restore did not give back the original files byte for byte"
    );
    keep
}

#[test]
fn containerd_1_6_default_config_in_place_without_cdi() {
    let patched = round_trip(Some("v2-default-1.6.toml"), "1.6.20", true);
    let text = fs::read_to_string(patched.path().join(CONFIG)).unwrap();
    assert!(
        text.starts_with("# containerd 1.6's own default config"),
        "comment lost"
    );
    assert!(
        !text.contains("enable_cdi"),
        "wrote a key containerd 1.6 ignores"
    );
}

#[test]
fn containerd_1_7_custom_config_keeps_comments_order_imports() {
    let patched = round_trip(Some("v2-custom.toml"), "1.7.2", true);
    let text = fs::read_to_string(patched.path().join(CONFIG)).unwrap();
    for keep in [
        "# Production containerd config",
        "# pinned",
        "# gVisor for untrusted pods",
        "imports = [\"/etc/containerd/site.d/*.toml\"]",
    ] {
        assert!(text.contains(keep), "lost {keep:?}:\n{text}");
    }
    assert!(text.contains("enable_cdi = true"));
    // The new runtime copies the default runtime's options (SystemdCgroup).
    let nvidia = text.split("runtimes.nvidia]").nth(1).unwrap();
    assert!(
        nvidia.contains("SystemdCgroup = true")
            && nvidia.contains("BinaryName = \"/usr/bin/nvidia-container-runtime\"")
    );
}

#[test]
fn version_1_config() {
    round_trip(Some("v1.toml"), "1.6.20", true);
}

#[test]
fn containerd_2_1_uses_a_drop_in_and_one_import() {
    let patched = round_trip(Some("v3.toml"), "2.1.0", false);
    let main = fs::read_to_string(patched.path().join(CONFIG)).unwrap();
    assert!(
        main.contains("imports = [\"/etc/containerd/conf.d/*.toml\"]"),
        "{main}"
    );
    let drop_in = fs::read_to_string(patched.path().join(DROP_IN)).unwrap();
    assert!(
        drop_in.contains("[plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.nvidia]"),
        "{drop_in}"
    );
    // 2.x enables CDI by default; without the NVIDIA toolkit the runtime is plain runc.
    assert!(
        !drop_in.contains("enable_cdi") && !drop_in.contains("BinaryName"),
        "{drop_in}"
    );
}

#[test]
fn containerd_2_1_without_a_config_file() {
    round_trip(None, "2.1.0", false);
}

#[test]
fn cdi_impossible_is_said_plainly_and_nothing_is_written() {
    let host = host_with(Some("valid/v2-default-1.6.toml"), false);
    let before = files(host.path());
    let (code, _, err) = configure(host.path(), "1.6.20", &[]);
    assert_eq!(code, 1);
    assert!(err.contains("containerd 1.6.20 has no CDI support (it arrived in 1.7), and the host has no nvidia-container-runtime"), "{err}");
    assert_eq!(files(host.path()), before);
}

#[test]
fn dry_run_changes_nothing() {
    let host = host_with(Some("valid/v2-custom.toml"), true);
    let before = files(host.path());
    let (code, out, err) = run(at(host.path()).args([
        "runtime",
        "configure",
        "--dry-run",
        "--containerd-version",
        "1.7.2",
    ]));
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("+++ b/etc/containerd/config.toml"), "{out}");
    assert!(out.contains("+    enable_cdi = true"), "{out}");
    assert!(
        out.contains("+      [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.nvidia]"),
        "{out}"
    );
    assert_eq!(files(host.path()), before, "--dry-run wrote something");
}

#[test]
fn every_invalid_config_fails_with_2_naming_file_and_line() {
    let mut n = 0;
    for e in fs::read_dir(fixture_path("invalid")).unwrap() {
        let p = e.unwrap().path();
        let text = fs::read_to_string(&p).unwrap();
        let expect = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("# expect: "))
            .unwrap();
        let host = host_with(None, true);
        fs::copy(&p, host.path().join(CONFIG)).unwrap();
        let before = files(host.path());
        let (code, out, err) = configure(host.path(), "1.6.20", &[]);
        assert_eq!(code, 2, "{}: {out}{err}", p.display());
        assert!(
            err.contains("/etc/containerd/config.toml:"),
            "{}: {err}",
            p.display()
        );
        assert!(
            err.contains(expect),
            "{}: expected {expect:?} in {err}",
            p.display()
        );
        assert_eq!(
            files(host.path()),
            before,
            "{}: something was written",
            p.display()
        );
        n += 1;
    }
    assert!(n >= 6);
}

#[test]
fn a_second_agent_is_told_about_the_lock() {
    let host = host_with(Some("valid/v2-custom.toml"), true);
    let root = hostlib::HostRoot::new(host.path()).unwrap();
    let _held =
        hostlib::managed::ManagedFiles::lock(&root, &hostlib::LinuxSyscalls, false).unwrap();
    let (code, _, err) = run(at(host.path()).args([
        "runtime",
        "configure",
        "--no-wait",
        "--containerd-version",
        "1.7.2",
    ]));
    assert_eq!(code, 1, "configured while another process held the lock");
    assert!(
        err.contains("another gpu-agent is changing host files"),
        "{err}"
    );
    assert_eq!(
        fs::read(host.path().join(CONFIG)).unwrap(),
        fs::read(fixture_path("valid/v2-custom.toml")).unwrap()
    );
}

/// Debian's containerd 1.6 (installed by scripts/test) reads what we wrote.
#[test]
fn real_containerd_1_6_sees_the_nvidia_runtime() {
    let which = std::process::Command::new("containerd")
        .arg("--version")
        .output();
    let Ok(v) = which else {
        panic!("containerd is not installed (scripts/test installs Debian's containerd)");
    };
    let version = String::from_utf8_lossy(&v.stdout).to_string();
    assert!(
        version.contains(" 1.6."),
        "expected Debian's containerd 1.6, got {version}"
    );
    for fixture in ["v2-default-1.6.toml", "v2-custom.toml", "v1.toml"] {
        let host = host_with(Some(&format!("valid/{fixture}")), true);
        let (code, _, err) = configure(host.path(), "1.6.20", &[]);
        assert_eq!(code, 0, "{fixture}: {err}");
        let text = containerd_dump(Path::new("containerd"), &host.path().join(CONFIG));
        let nvidia = text
            .split("containerd.runtimes.nvidia]")
            .nth(1)
            .unwrap_or_else(|| {
                panic!("{fixture}: no nvidia runtime in the effective config:\n{text}")
            });
        assert!(
            nvidia.contains("BinaryName = \"/usr/bin/nvidia-container-runtime\""),
            "{fixture}:\n{text}"
        );
        if fixture == "v2-custom.toml" {
            let runc = text
                .split("containerd.runtimes.runc.options]")
                .nth(1)
                .unwrap();
            assert!(
                runc.contains("SystemdCgroup = true"),
                "{fixture}: the user's runc options were lost"
            );
        }
    }
}

/// Crash safety: `runtime configure` killed with SIGKILL at 200 points in
/// its run (common::crash). Each time the config is either the original or
/// the complete new file, never a part, and `restore` still gives the
/// original byte for byte.
#[test]
fn sigkill_at_random_points_never_leaves_a_partial_file() {
    struct Configure {
        original: Vec<u8>,
        complete: Vec<u8>,
    }
    impl common::crash::Writer for Configure {
        type Host = tempfile::TempDir;
        fn prepare(&mut self, _: usize) -> Self::Host {
            host_with(Some("valid/v2-custom.toml"), true)
        }
        fn command(&mut self, host: &Self::Host) -> std::process::Command {
            let mut c = at(host.path());
            c.args(["runtime", "configure", "--containerd-version", "1.7.2"]);
            c
        }
        fn check(&mut self, host: &Self::Host) -> Result<String, String> {
            let now = fs::read(host.path().join(CONFIG)).unwrap();
            if now == self.original {
                Ok("the original".into())
            } else if now == self.complete {
                Ok("the complete new file".into())
            } else {
                Err("the config is neither the original nor the complete new file".into())
            }
        }
        fn repair(&mut self, host: &Self::Host) -> Result<(), String> {
            let (code, _, err) = run(at(host.path()).args(["runtime", "restore"]));
            if code != 0 {
                return Err(err);
            }
            if fs::read(host.path().join(CONFIG)).unwrap() != self.original {
                return Err("restore did not give the original back".into());
            }
            Ok(())
        }
    }
    let mut w = Configure {
        original: fs::read(fixture_path("valid/v2-custom.toml")).unwrap(),
        complete: fs::read(fixture_path("golden/v2-custom.toml@1.7.2.toml")).unwrap(),
    };
    let tally = common::crash::sigkill_trials(&mut w, 200, 1);
    eprintln!("runtime configure: {tally}");
    assert_eq!(tally.seen.values().sum::<usize>(), 200);
}

fn policy_for(host: &Path, runtime: &str) -> PathBuf {
    let p = host.join("policy.yaml");
    fs::write(
        &p,
        format!("spec:\n  operator:\n    defaultRuntime: {runtime}\n"),
    )
    .unwrap();
    p
}

#[test]
fn docker_daemon_json_keeps_every_other_key_and_restores() {
    let host = host_with(None, true);
    fs::create_dir_all(host.path().join("etc/docker")).unwrap();
    let daemon = host.path().join("etc/docker/daemon.json");
    let original = fs::read(fixture("docker/valid/daemon.json")).unwrap();
    fs::write(&daemon, &original).unwrap();
    let policy = policy_for(host.path(), "docker");
    let cmd = |args: &[&str]| run(at(host.path()).arg("--policy").arg(&policy).args(args));
    let (code, out, err) = cmd(&["runtime", "configure"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("+++ b/etc/docker/daemon.json"), "{out}");
    golden("daemon.json@docker.json", &fs::read(&daemon).unwrap());
    let v: serde_json::Value = serde_json::from_slice(&fs::read(&daemon).unwrap()).unwrap();
    let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "log-driver",
            "log-opts",
            "registry-mirrors",
            "runtimes",
            "exec-opts",
            "features"
        ]
    );
    assert_eq!(v["runtimes"]["runsc"]["path"], "/usr/local/bin/runsc");
    assert_eq!(
        v["runtimes"]["nvidia"]["path"],
        "/usr/bin/nvidia-container-runtime"
    );
    assert_eq!(v["features"]["cdi"], true);
    let (_, out, _) = cmd(&["runtime", "configure"]);
    assert!(out.contains("nothing to change"), "{out}");
    let (code, _, _) = cmd(&["runtime", "restore"]);
    assert_eq!(code, 0);
    assert_eq!(fs::read(&daemon).unwrap(), original);
    for bad in [
        "not-json.json",
        "not-an-object.json",
        "runtimes-not-object.json",
    ] {
        fs::write(
            &daemon,
            fs::read(fixture(&format!("docker/invalid/{bad}"))).unwrap(),
        )
        .unwrap();
        let before = fs::read(&daemon).unwrap();
        let (code, _, err) = cmd(&["runtime", "configure"]);
        assert_eq!(code, 2, "{bad}: {err}");
        assert!(err.contains("/etc/docker/daemon.json:"), "{bad}: {err}");
        assert_eq!(fs::read(&daemon).unwrap(), before, "{bad}: written");
    }
}

#[test]
fn crio_drop_in_is_created_and_removed_by_restore() {
    let host = host_with(None, true);
    let policy = policy_for(host.path(), "crio");
    let cmd = |args: &[&str]| run(at(host.path()).arg("--policy").arg(&policy).args(args));
    let (code, _, err) = cmd(&["runtime", "configure"]);
    assert_eq!(code, 0, "{err}");
    let drop_in = host.path().join("etc/crio/crio.conf.d/99-nvidia.conf");
    golden("99-nvidia.conf@crio.toml", &fs::read(&drop_in).unwrap());
    let (_, out, _) = cmd(&["runtime", "configure"]);
    assert!(out.contains("nothing to change"), "{out}");
    let (code, out, _) = cmd(&["runtime", "restore"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("removed /etc/crio/crio.conf.d/99-nvidia.conf"),
        "{out}"
    );
    assert!(!drop_in.exists());
}

#[test]
fn crio_copies_the_default_runtime_and_refuses_a_config_it_cannot_read() {
    let host = host_with(None, true);
    let conf = host.path().join("etc/crio/crio.conf");
    fs::create_dir_all(conf.parent().unwrap()).unwrap();
    fs::copy(fixture("crio/valid/crio.conf"), &conf).unwrap();
    let policy = policy_for(host.path(), "crio");
    let cmd = |args: &[&str]| run(at(host.path()).arg("--policy").arg(&policy).args(args));
    let (code, _, err) = cmd(&["runtime", "configure"]);
    assert_eq!(code, 0, "{err}");
    let drop_in = host.path().join("etc/crio/crio.conf.d/99-nvidia.conf");
    golden(
        "99-nvidia.conf-from-crun@crio.toml",
        &fs::read(&drop_in).unwrap(),
    );
    assert_eq!(
        fs::read(&conf).unwrap(),
        fs::read(fixture("crio/valid/crio.conf")).unwrap(),
        "crio.conf was changed"
    );
    let (code, _, _) = cmd(&["runtime", "restore"]);
    assert_eq!(code, 0);
    for bad in [
        "not-toml.conf",
        "runtimes-not-a-table.conf",
        "runtime-not-a-table.conf",
    ] {
        fs::copy(fixture(&format!("crio/invalid/{bad}")), &conf).unwrap();
        let (code, _, err) = cmd(&["runtime", "configure"]);
        assert_eq!(code, 2, "{bad}: {err}");
        assert!(err.contains("/etc/crio/crio.conf:"), "{bad}: {err}");
        assert!(!drop_in.exists(), "{bad}: written");
    }
}

const K3S_DIR: &str = "var/lib/rancher/k3s/agent/etc/containerd";

/// A k3s host: `rendered` (a fixture under containerd/k3s/) as the config
/// k3s rendered, optionally the user's template, and a policy naming k3s's
/// config path.
fn k3s_host(
    rendered: &str,
    template: Option<&str>,
    nvidia_runtime: bool,
) -> (tempfile::TempDir, PathBuf) {
    let host = host_with(None, nvidia_runtime);
    let dir = host.path().join(K3S_DIR);
    fs::create_dir_all(&dir).unwrap();
    fs::copy(
        fixture_path(&format!("k3s/{rendered}")),
        dir.join("config.toml"),
    )
    .unwrap();
    if let Some(t) = template {
        fs::copy(fixture_path(&format!("k3s/{t}")), dir.join(t)).unwrap();
    }
    let policy = host.path().join("policy.yaml");
    fs::write(
        &policy,
        format!("spec:\n  toolkit:\n    containerd:\n      config: /{K3S_DIR}/config.toml\n"),
    )
    .unwrap();
    (host, policy)
}

/// What k3s does at start: the template with `{{ template "base" . }}`
/// replaced by its own config; containerd reads the result.
fn render_like_k3s(template: &str, base: &str) -> String {
    template.replace("{{ template \"base\" . }}", base)
}

#[test]
fn k3s_gets_a_template_not_an_edit_of_its_rendered_config() {
    // containerd 2 (k3s >= 1.31): a new config-v3.toml.tmpl with k3s's base and our block.
    let (host, policy) = k3s_host("config-v3.toml", None, false);
    let before = files(host.path());
    let p = policy.to_str().unwrap();
    let (code, out, err) = configure(host.path(), "2.0.5", &["--policy", p]);
    assert_eq!(code, 0, "{out}{err}");
    let dir = host.path().join(K3S_DIR);
    let template = fs::read_to_string(dir.join("config-v3.toml.tmpl")).unwrap();
    golden("k3s-config-v3.toml.tmpl@new.toml", template.as_bytes());
    assert!(template.starts_with("{{ template \"base\" . }}\n"));
    assert_eq!(
        fs::read(dir.join("config.toml")).unwrap(),
        fs::read(fixture_path("k3s/config-v3.toml")).unwrap(),
        "the rendered config (k3s's own) was edited"
    );
    // Rendered as k3s would, real containerd 2 reads it: our runtime with
    // the user's runc options, no duplicate table.
    let rendered = render_like_k3s(
        &template,
        &fs::read_to_string(dir.join("config.toml")).unwrap(),
    );
    let check = host.path().join("rendered.toml");
    fs::write(&check, rendered).unwrap();
    let text = containerd_dump(&containerd_2(), &check);
    let nvidia = text
        .split("containerd.runtimes.nvidia.options]")
        .nth(1)
        .unwrap_or_else(|| panic!("no nvidia runtime:\n{text}"));
    assert!(nvidia.contains("SystemdCgroup = true"), "{text}");
    assert!(text.contains("enable_cdi = true"), "{text}");

    // Again: nothing to change. Restore: the template is gone, all as before.
    let (code, out, _) = configure(host.path(), "2.0.5", &["--policy", p]);
    assert_eq!(code, 0);
    assert!(out.contains("nothing to change"), "{out}");
    let (code, _, err) = run(at(host.path()).args(["runtime", "restore"]));
    assert_eq!(code, 0, "{err}");
    let after: BTreeMap<String, Vec<u8>> = files(host.path())
        .into_iter()
        .filter(|(k, _)| {
            !k.starts_with("var/lib/gpu-agent")
                && !k.starts_with("run/gpu-agent")
                && k != "rendered.toml"
        })
        .collect();
    assert_eq!(after, before);
}

#[test]
fn a_users_k3s_template_keeps_every_line_and_gets_our_block_once() {
    let (host, policy) = k3s_host("config.toml", Some("config.toml.tmpl"), false);
    let p = policy.to_str().unwrap();
    let (code, out, err) = configure(host.path(), "1.7.22", &["--policy", p]);
    assert_eq!(code, 0, "{out}{err}");
    let dir = host.path().join(K3S_DIR);
    let template = fs::read_to_string(dir.join("config.toml.tmpl")).unwrap();
    let original = fs::read_to_string(fixture_path("k3s/config.toml.tmpl")).unwrap();
    assert!(
        template.starts_with(&original),
        "the user's template changed:\n{template}"
    );
    golden("k3s-config.toml.tmpl@user.toml", template.as_bytes());
    let (_, out, _) = configure(host.path(), "1.7.22", &["--policy", p]);
    assert!(out.contains("nothing to change"), "{out}");
    // Real containerd 1.6 reads the rendered result (both runtimes, no clash).
    let rendered = render_like_k3s(
        &template,
        &fs::read_to_string(dir.join("config.toml")).unwrap(),
    );
    let check = host.path().join("rendered.toml");
    fs::write(&check, rendered).unwrap();
    let text = containerd_dump(Path::new("containerd"), &check);
    assert!(text.contains("containerd.runtimes.nvidia]"), "{text}");
    assert!(text.contains("containerd.runtimes.runsc]"), "{text}");
    let (code, _, _) = run(at(host.path()).args(["runtime", "restore"]));
    assert_eq!(code, 0);
    assert_eq!(
        fs::read_to_string(dir.join("config.toml.tmpl")).unwrap(),
        original
    );
}

#[test]
fn k3s_with_the_toolkit_configures_itself_and_without_cdi_is_refused() {
    // k3s adds the nvidia runtime itself when it finds nvidia-container-runtime.
    let (host, policy) = k3s_host("config.toml", None, true);
    let p = policy.to_str().unwrap();
    let (code, out, err) = configure(host.path(), "1.7.22", &["--policy", p]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("nothing to change"), "{out}");
    assert!(
        err.contains("k3s/RKE2 add the nvidia runtime themselves"),
        "{err}"
    );
    assert!(!host.path().join(K3S_DIR).join("config.toml.tmpl").exists());
    // CDI off in k3s's config and no toolkit: no way to inject GPUs; said, nothing written.
    let (host, policy) = k3s_host("config-cdi-off.toml", None, false);
    let p = policy.to_str().unwrap();
    let before = files(host.path());
    let (code, _, err) = configure(host.path(), "1.7.22", &["--policy", p]);
    assert_eq!(code, 1);
    assert!(
        err.contains("has CDI off, and the host has no nvidia-container-runtime"),
        "{err}"
    );
    assert_eq!(files(host.path()), before);
}
