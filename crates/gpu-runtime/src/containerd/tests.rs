/// Made the default over crun, the `nvidia` runtime keeps crun's
/// settings the next time too (it fell back to runc's, or none, and
/// rewrote the config at every reconcile).
#[test]
fn planning_again_after_replacing_a_crun_default_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let host = HostRoot::new(dir.path()).unwrap();
    let config = dir.path().join("etc/containerd/config.toml");
    std::fs::create_dir_all(config.parent().unwrap()).unwrap();
    let cri = "[plugins.\"io.containerd.grpc.v1.cri\".containerd";
    std::fs::write(
            &config,
            format!(
                "version = 2\n{cri}]\ndefault_runtime_name = \"crun\"\n{cri}.runtimes.crun]\nruntime_type = \"io.containerd.runc.v2\"\n{cri}.runtimes.crun.options]\nBinaryName = \"/usr/bin/crun\"\nSystemdCgroup = true\n"
            ),
        )
        .unwrap();
    let opts = Options {
        config: "/etc/containerd/config.toml".into(),
        drop_in_dir: "/etc/containerd/conf.d".into(),
        runtime_name: "nvidia".into(),
        set_as_default: true,
        enable_cdi: false,
        binary_name: None,
    };
    let v = Version::parse("1.7.2");
    let first = plan(&host, &opts, v).unwrap();
    let after = &first.changes[0].after;
    assert!(
        after.contains("default_runtime_name = \"nvidia\""),
        "{after}"
    );
    std::fs::write(&config, after).unwrap();
    let again = plan(&host, &opts, v).unwrap();
    assert!(
        again.changes.is_empty(),
        "{}",
        again.changes.iter().map(|c| c.diff()).collect::<String>()
    );
}

/// Found while writing the containerd fuzz target: an `nvidia` runtime
/// already there whose `options` table names another `BinaryName` (the
/// GPU Operator's toolkit path, say) was judged unchanged and kept,
/// because a table's text leaves its subtables out.
#[test]
fn a_stale_binary_name_in_the_runtimes_options_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let host = HostRoot::new(dir.path()).unwrap();
    let config = dir.path().join("etc/containerd/config.toml");
    std::fs::create_dir_all(config.parent().unwrap()).unwrap();
    let cri = "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes";
    std::fs::write(
            &config,
            format!(
                "version = 2\n{cri}.nvidia]\nruntime_type = \"io.containerd.runc.v2\"\n{cri}.nvidia.options]\nBinaryName = \"/usr/local/nvidia/toolkit/nvidia-container-runtime\"\n"
            ),
        )
        .unwrap();
    let opts = Options {
        config: "/etc/containerd/config.toml".into(),
        drop_in_dir: "/etc/containerd/conf.d".into(),
        runtime_name: "nvidia".into(),
        set_as_default: false,
        enable_cdi: false,
        binary_name: Some("/usr/bin/nvidia-container-runtime".into()),
    };
    let v = Version::parse("1.7.2");
    let plan = plan(&host, &opts, v).unwrap();
    assert_eq!(plan.changes.len(), 1, "{:?}", plan.changes);
    let after = &plan.changes[0].after;
    assert!(
        after.contains("BinaryName = \"/usr/bin/nvidia-container-runtime\"")
            && !after.contains("/usr/local/nvidia/toolkit"),
        "{after}"
    );
    // Written, it is left alone: same keys and values, whatever the layout.
    std::fs::write(&config, after).unwrap();
    assert!(super::plan(&host, &opts, v).unwrap().changes.is_empty());
    let a: DocumentMut = "[t]\na = 1\n[t.o]\nb = [1, 2]\n".parse().unwrap();
    let b: DocumentMut = "[t]\n  a=1 # one\n  o = { b = [ 1,2 ] }\n".parse().unwrap();
    let c: DocumentMut = "[t]\na = 1\n[t.o]\nb = [1, 3]\n".parse().unwrap();
    let t = |d: &DocumentMut| d["t"].as_table().unwrap().clone();
    assert!(same_table(&t(&a), &t(&b)));
    assert!(!same_table(&t(&a), &t(&c)));
}

#[test]
fn the_version_is_asked_once_per_binary() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let host = HostRoot::new(dir.path()).unwrap();
    let bin = dir.path().join("usr/bin/containerd");
    std::fs::create_dir_all(bin.parent().unwrap()).unwrap();
    let calls = dir.path().join("calls");
    let script = |v: &str| {
        format!(
            "#!/bin/sh\necho x >> {}\necho 'containerd github.com/containerd/containerd {v} abc'\n",
            calls.display()
        )
    };
    std::fs::write(&bin, script("1.7.2")).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let runs = || std::fs::read_to_string(&calls).map_or(0, |s| s.lines().count());
    let v = cached_host_version(&host, "/usr/bin/containerd").unwrap();
    assert_eq!(v.to_string(), "1.7.2");
    assert_eq!(runs(), 1);
    assert_eq!(
        cached_host_version(&host, "/usr/bin/containerd").unwrap(),
        v
    );
    assert_eq!(runs(), 1, "asked again although the binary is the same");
    // An upgrade replaces the binary: asked again.
    let new = dir.path().join("usr/bin/containerd.new");
    std::fs::write(&new, script("2.1.0")).unwrap();
    std::fs::set_permissions(&new, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&new, &bin).unwrap();
    assert_eq!(
        cached_host_version(&host, "/usr/bin/containerd")
            .unwrap()
            .to_string(),
        "2.1.0"
    );
    assert_eq!(runs(), 2);
    assert!(cached_host_version(&host, "/usr/bin/missing").is_none());
}
use super::*;

#[test]
fn versions_parse_from_containerd_output() {
    assert_eq!(
        Version::parse("1.6.20~ds1"),
        Some(Version {
            major: 1,
            minor: 6,
            patch: 20
        })
    );
    assert_eq!(
        Version::parse("v2.1.3"),
        Some(Version {
            major: 2,
            minor: 1,
            patch: 3
        })
    );
    assert_eq!(Version::parse("github.com/containerd/containerd"), None);
}

#[test]
fn k3s_and_rke2_units_are_found_from_their_unit_files() {
    let dir = tempfile::tempdir().unwrap();
    let host = HostRoot::new(dir.path()).unwrap();
    let k3s = "/var/lib/rancher/k3s/agent/etc/containerd/config.toml.tmpl";
    let rke2 = "/var/lib/rancher/rke2/agent/etc/containerd/config.toml.tmpl";
    let (unit, note) = rancher_unit(&host, k3s);
    assert_eq!(unit, "k3s");
    assert!(
        note.unwrap()
            .contains("no k3s or k3s-agent unit file found")
    );
    std::fs::create_dir_all(dir.path().join("etc/systemd/system")).unwrap();
    std::fs::write(dir.path().join("etc/systemd/system/k3s-agent.service"), "").unwrap();
    assert_eq!(rancher_unit(&host, k3s), ("k3s-agent".to_string(), None));
    std::fs::create_dir_all(dir.path().join("usr/lib/systemd/system")).unwrap();
    std::fs::write(
        dir.path().join("usr/lib/systemd/system/rke2-agent.service"),
        "",
    )
    .unwrap();
    assert_eq!(rancher_unit(&host, rke2), ("rke2-agent".to_string(), None));
}

#[test]
fn templates_are_found_by_name_place_or_suffix() {
    let dir = tempfile::tempdir().unwrap();
    let host = HostRoot::new(dir.path()).unwrap();
    assert_eq!(template_for(&host, "/etc/containerd/config.toml"), None);
    assert_eq!(
        template_for(&host, "/opt/k3s/config.toml.tmpl").as_deref(),
        Some("/opt/k3s/config.toml.tmpl")
    );
    assert_eq!(
        template_for(
            &host,
            "/var/lib/rancher/rke2/agent/etc/containerd/config.toml"
        )
        .as_deref(),
        Some("/var/lib/rancher/rke2/agent/etc/containerd/config.toml.tmpl")
    );
    std::fs::create_dir_all(dir.path().join("etc/containerd")).unwrap();
    std::fs::write(dir.path().join("etc/containerd/config-v3.toml.tmpl"), "").unwrap();
    assert_eq!(
        template_for(&host, "/etc/containerd/config.toml").as_deref(),
        Some("/etc/containerd/config-v3.toml.tmpl")
    );
}

#[test]
fn line_and_column() {
    assert_eq!(line_col("ab\ncd\nef", 4), (2, 2));
    assert_eq!(line_col("x", 0), (1, 1));
}

/// Found by the fuzz smoke: containerd 2.1's drop-in is imported by adding
/// to `imports`; an `imports` that is not a list of paths (a table, a
/// string) was replaced whole, and the user's keys under it lost. It is
/// refused, naming the key and its line, and a list gains the drop-in.
#[test]
fn an_imports_that_is_not_a_list_of_paths_is_refused_not_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let host = HostRoot::new(dir.path()).unwrap();
    let config = dir.path().join("etc/containerd/config.toml");
    std::fs::create_dir_all(config.parent().unwrap()).unwrap();
    let opts = Options {
        config: "/etc/containerd/config.toml".into(),
        drop_in_dir: "/etc/containerd/conf.d".into(),
        runtime_name: "nvidia".into(),
        set_as_default: false,
        enable_cdi: true,
        binary_name: None,
    };
    let v = Version::parse("2.1.0");
    for (text, line) in [
        (
            "version = 3\n\n[imports.\"io.containerd.cri.v1.runtime\".containerd]\nsnapshotter = \"overlayfs\"\n",
            3,
        ),
        ("version = 3\nimports = \"/etc/containerd/other.toml\"\n", 2),
        ("version = 3\nimports = [\"/a.toml\", 7]\n", 2),
    ] {
        std::fs::write(&config, text).unwrap();
        match plan(&host, &opts, v) {
            Err(RuntimeError::Invalid {
                key,
                line: at,
                path,
                ..
            }) => {
                assert_eq!(key, "imports", "{text}");
                assert_eq!(at, line, "{text}");
                assert_eq!(path, "/etc/containerd/config.toml");
            }
            other => panic!("{text}: {:?}", other.map(|p| p.changes)),
        }
        assert_eq!(std::fs::read_to_string(&config).unwrap(), text);
    }
    std::fs::write(
        &config,
        "version = 3\nimports = [\"/etc/containerd/other.toml\"]\n",
    )
    .unwrap();
    let p = plan(&host, &opts, v).unwrap();
    let after = &p.changes[0].after;
    assert!(
        after.contains(
            "imports = [\"/etc/containerd/other.toml\", \"/etc/containerd/conf.d/*.toml\"]"
        ),
        "{after}"
    );
}
