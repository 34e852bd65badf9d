//! A running agent's metrics exporter follows its policy: a counters file
//! given (or changed) while it serves starts it again with that file's
//! fields. (It stopped for good instead: the reconcile kept the stage's
//! `done`, and an exporter is started only for a planned stage; the
//! cluster's counters ConfigMap, sent by gpu-controller, met the same.)

mod common;

use std::fs;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;

fn metrics_detail(host: &std::path::Path) -> String {
    let (_, out, _) = run(at(host).args(["status", "-o", "json"]));
    let st = json(&out);
    if st["source"] != "running-agent" {
        return String::new();
    }
    stage(&st, "metrics")["detail"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

#[test]
fn a_new_counters_file_starts_the_exporter_again_with_its_fields() {
    let host_dir = copy_host_fixture("h100-sxm-8");
    let host = host_dir.path().to_path_buf();
    let policy = host.join("policy.yaml");
    let base = "spec:\n  driver: {enabled: false}\n  toolkit: {enabled: false}\n  dcgmExporter:\n    listen: 127.0.0.1:0\n";
    fs::write(&policy, base).unwrap();
    let log = host.join("agent.log");
    let mut child = at(&host)
        .args(["--simulate", "h100-sxm-8", "--policy"])
        .arg(&policy)
        .args(["--log-format", "text", "run"])
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let until = |what: &str, f: &dyn Fn(&str) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let d = metrics_detail(&host);
            if f(&d) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: metrics stage says {d:?}\nlog:\n{}",
                fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    // dcgm-exporter's default fields (however many that list holds).
    until("dcgm-exporter's default fields", &|d| {
        d.starts_with("serving ")
            && d.contains(" field(s) on http://127.0.0.1:")
            && !d.starts_with("serving 2 field(s)")
    });
    let counters = host.join("counters.csv");
    fs::write(
        &counters,
        "DCGM_FI_DEV_GPU_TEMP, gauge, t\nDCGM_FI_DEV_POWER_USAGE, gauge, p\n",
    )
    .unwrap();
    fs::write(
        &policy,
        format!("{base}    config: {}\n", counters.display()),
    )
    .unwrap();
    until("the counters file's fields", &|d| {
        d.starts_with("serving 2 field(s) on http://127.0.0.1:")
    });
    let _ = sigterm(&mut child);
}
