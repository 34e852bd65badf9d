//! `gpu-agent run` tells the kubelet first (issue 26): the device plugin
//! registers before the first pass makes device nodes, configures the
//! runtime, writes the CDI spec, validates and writes labels; allocations
//! wait until the node is ready for containers. Shown by the order of the
//! agent's own log records (JSON), not by timing: the registration is logged
//! before the plugin's status records it, and the deferred stages run only
//! once the status says the first registration was answered.
//!
//! The fake libnvidia-ml over the simulated 8x H100 node's sysfs, a mock
//! kubelet that accepts and lists.

mod common;

use std::fs;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use gpu_agent::stages::{AFTER_REGISTRATION, BEFORE_ALLOCATION, DEFERRED_DETAIL, Stage};
use serde_json::Value;

/// The index of the first record `f` picks.
fn position(records: &[Value], f: impl Fn(&Value) -> bool) -> Option<usize> {
    records.iter().position(f)
}

/// Where `stage`'s own record (the one `log_stage` writes when it ran, or
/// when it says it will run later) is, by detail.
fn stage_record(records: &[Value], stage: Stage, deferred: bool) -> Option<usize> {
    position(records, |r| {
        let f = &r["fields"];
        f["stage"] == stage.name()
            && f["state"].is_string()
            && (f["message"] == DEFERRED_DETAIL) == deferred
    })
}

#[test]
fn the_plugin_registers_before_the_rest_of_the_first_pass() {
    let (host, _events) = plugin_host("h100-sxm-8");
    let plugins = host.path().join("var/lib/kubelet/device-plugins");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let kubelet = rt.block_on(async {
        gpu_agent::plugin::kubelet::MockKubelet::start(&plugins.join("kubelet.sock"))
            .unwrap()
            .list_devices()
    });
    let (_lib_dir, lib) = fake_nvml();
    let log = host.path().join("agent.log");
    let mut child = at(host.path())
        .arg("--nvml-lib")
        .arg(&lib)
        .args(["--log-format", "json", "run"])
        .env("FAKE_NVML_NODE", "h100-sxm-8")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    // The first pass is over when labels (the last deferred stage) ran.
    let records = |text: &str| -> Vec<Value> {
        text.lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let text = loop {
        let text = fs::read_to_string(&log).unwrap_or_default();
        if stage_record(&records(&text), Stage::Labels, false).is_some() {
            break text;
        }
        assert!(
            Instant::now() < deadline && child.try_wait().unwrap().is_none(),
            "the first pass did not finish:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    // The state file is written when the pass is over, a moment after its
    // last stage logged: `status` is read until it shows the pass (or 10 s).
    let status = || json(&run(at(host.path()).args(["status", "-o", "json"])).1);
    let settled = Instant::now() + Duration::from_secs(10);
    let st = loop {
        let st = status();
        let pending = AFTER_REGISTRATION
            .iter()
            .any(|s| stage(&st, s.name())["detail"] == DEFERRED_DETAIL);
        if !pending || Instant::now() > settled {
            break st;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(sigterm(&mut child), Some(0), "{text}");
    let all = records(&text);
    let registered = position(&all, |r| {
        r["fields"]["message"] == "registered with the kubelet"
    })
    .unwrap_or_else(|| panic!("no registration logged:\n{text}"));
    let ready = position(&all, |r| {
        r["fields"]["message"] == "the node is ready for containers; allocations go ahead"
    })
    .unwrap_or_else(|| panic!("allocations never went ahead:\n{text}"));
    assert!(registered < ready, "{text}");
    // Validation and labels always come after (device nodes, and the CDI
    // spec that waits on them, only where this process may make nodes:
    // without CAP_MKNOD devnodes is blocked at once, not deferred).
    let mut deferred = Vec::new();
    for stage in AFTER_REGISTRATION {
        let Some(said) = stage_record(&all, stage, true) else {
            continue;
        };
        deferred.push(stage);
        let ran = stage_record(&all, stage, false)
            .unwrap_or_else(|| panic!("{stage:?} never ran:\n{text}"));
        // `status` said it would run later, before the kubelet heard from us.
        assert!(said < registered, "{stage:?}\n{text}");
        assert!(
            registered < ran,
            "{stage:?} ran before the registration:\n{text}"
        );
        if BEFORE_ALLOCATION.contains(&stage) {
            assert!(ran < ready, "{stage:?}\n{text}");
        } else {
            assert!(ready < ran, "{stage:?}\n{text}");
        }
    }
    assert!(
        deferred.contains(&Stage::Validate) && deferred.contains(&Stage::Labels),
        "{deferred:?}\n{text}"
    );
    // One registration; `status` shows every deferred stage as it came out.
    assert_eq!(kubelet.registrations().len(), 1);
    assert_eq!(st["source"], "running-agent", "{st:#}");
    for d in deferred {
        let s = stage(&st, d.name());
        assert_ne!(s["detail"], DEFERRED_DETAIL, "{s:#}");
    }
    rt.block_on(kubelet.stop());
}
