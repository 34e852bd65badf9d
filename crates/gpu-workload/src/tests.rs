use super::*;
use gpu_model::cdi;
use hostlib::HostRoot;

fn facts(name: &str, version: &str, cdi: Option<bool>) -> RuntimeFacts {
    RuntimeFacts {
        name: name.into(),
        version: version.into(),
        not_ready: Vec::new(),
        cdi_enabled: cdi,
    }
}

#[test]
fn old_containerd_and_containerd_with_cdi_off_cannot_run_it() {
    let r = reason_from_facts(&facts("containerd", "1.6.20~ds1", None)).unwrap();
    assert!(r.contains("1.6.20~ds1") && r.contains("1.7"), "{r}");
    let r = reason_from_facts(&facts("containerd", "v1.7.2", Some(false))).unwrap();
    assert!(r.contains("enable_cdi = false"), "{r}");
    assert_eq!(
        reason_from_facts(&facts("containerd", "2.1.9+unknown", Some(true))),
        None
    );
    // CRI-O reports no enableCDI: CDI is always on there.
    assert_eq!(reason_from_facts(&facts("cri-o", "1.31.0", None)), None);
    let mut f = facts("cri-o", "1.31.0", None);
    f.not_ready = vec!["NetworkReady: NetworkPluginNotReady no CNI".into()];
    assert_eq!(reason_from_facts(&f), None, "host network needs no CNI");
    f.not_ready.push("RuntimeReady: Broken it is".into());
    let r = reason_from_facts(&f).unwrap();
    assert!(r.contains("RuntimeReady: Broken it is"), "{r}");
}

#[test]
fn cri_log_lines_are_joined_and_stripped() {
    let log = "2026-01-01T00:00:00.1Z stdout F gpu-agent-check: /dev/nvidia0 is missing\n\
                   2026-01-01T00:00:00.2Z stdout P part one, \n\
                   2026-01-01T00:00:00.3Z stdout F part two\n\
                   2026-01-01T00:00:00.4Z stderr F \n";
    assert_eq!(
        log_lines(log),
        vec![
            "gpu-agent-check: /dev/nvidia0 is missing".to_string(),
            "part one, part two".into(),
            String::new(),
        ]
    );
}

#[test]
fn expectations_come_from_our_spec_and_bad_ones_are_refused() {
    let host = HostRoot::system();
    let spec = cdi::Spec {
        cdi_version: cdi::SPEC_VERSION.into(),
        kind: "nvidia.com/gpu".into(),
        devices: vec![cdi::Device {
            name: "0".into(),
            container_edits: cdi::ContainerEdits {
                device_nodes: vec![cdi::DeviceNode {
                    path: "/dev/nvidia0".into(),
                    host_path: None,
                }],
                ..Default::default()
            },
        }],
        container_edits: cdi::ContainerEdits {
            env: vec!["NVIDIA_VISIBLE_DEVICES=void".into()],
            device_nodes: vec![cdi::DeviceNode {
                path: "/dev/nvidiactl".into(),
                host_path: None,
            }],
            mounts: vec![cdi::Mount {
                host_path: "/usr/lib/x86_64-linux-gnu/libcuda.so.550.127.08".into(),
                container_path: "/usr/lib/x86_64-linux-gnu/libcuda.so.550.127.08".into(),
                options: vec!["ro".into(), "nosuid".into(), "nodev".into(), "bind".into()],
            }],
            ..Default::default()
        },
    };
    let mut c = WorkloadCheck::new(&host, "/x".into(), "busybox", "nvidia.com/gpu=0");
    assert!(c.expect_from_spec(&spec));
    assert_eq!(c.expect_nodes, ["/dev/nvidia0", "/dev/nvidiactl"]);
    assert_eq!(
        c.expect_env,
        [("NVIDIA_VISIBLE_DEVICES".to_string(), "void".to_string())]
    );
    assert_eq!(
        c.checks().unwrap(),
        [
            "node:/dev/nvidia0",
            "node:/dev/nvidiactl",
            "path:/usr/lib/x86_64-linux-gnu/libcuda.so.550.127.08",
            "env:NVIDIA_VISIBLE_DEVICES=void"
        ]
    );
    let mut other = WorkloadCheck::new(&host, "/x".into(), "busybox", "nvidia.com/gpu=7");
    assert!(!other.expect_from_spec(&spec));
    assert!(other.expect_nodes.is_empty());

    for (nodes, env) in [
        (vec!["dev/nvidia0"], vec![]),
        (vec![], vec!["A-B"]),
        (vec![], vec!["1X"]),
        (vec![], vec!["_gpu_agent_failed"]),
        (vec![], vec!["X; rm -rf /"]),
    ] {
        let mut c = WorkloadCheck::new(&host, "/x".into(), "busybox", "nvidia.com/gpu=0");
        c.expect_nodes = nodes.iter().map(|s| s.to_string()).collect();
        c.expect_env = env.iter().map(|k| (k.to_string(), "1".into())).collect();
        let e = c.checks().unwrap_err();
        assert!(matches!(e, WorkloadError::Invalid { .. }), "{e}");
    }
    let mut relative = WorkloadCheck::new(&host, "/x".into(), "busybox", "nvidia.com/gpu=0");
    relative.expect_paths = vec!["usr/lib/libcuda.so.1".into()];
    assert!(matches!(
        relative.checks(),
        Err(WorkloadError::Invalid { .. })
    ));
    let c = WorkloadCheck::new(&host, "/x".into(), "busybox", "gpu0");
    assert!(c.checks().is_err());
}
