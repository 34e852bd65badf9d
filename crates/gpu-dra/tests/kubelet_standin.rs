//! The kubelet side of DRA against a peer we did not write: a Python grpcio
//! kubelet stand-in (tests/interop/dra_kubelet_standin.py) registers the
//! plugin through the registration socket, reads GetInfo, calls
//! NodePrepareResources / NodeUnprepareResources with v1 and v1beta1 on the
//! endpoint it was given, and watches NodeWatchResources there while this
//! test makes a GPU unhealthy and healthy again, against `serve` on a temp
//! dir with a fake [`Claims`].

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpu_dra::claim::{ClaimRef, Claims, PrepareOutcome, PreparedDevice};
use gpu_dra::claims::NodeDevice;
use gpu_dra::kubelet::{Dirs, HealthSource, Registration, serve};
use gpu_model::health::HealthView;
use serde_json::Value;
use tokio::sync::{mpsc, watch};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Python interpreter with grpcio and grpcio-tools, for the peers we did
/// not write (scripts/test makes the venv; GPU_AGENT_PYTHON names another).
fn python() -> PathBuf {
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

/// The node's claims as a script: every claim gets `gpu-0` of pool `node-a`
/// (a `shared-*` claim with a share ID), `broken-claim` fails naming what is
/// missing; prepared claims are kept, so a repeat answers as the first did,
/// and an unprepare of an unknown claim is done already.
#[derive(Default)]
struct FakeClaims {
    prepared: Mutex<BTreeMap<String, Vec<PreparedDevice>>>,
    calls: Mutex<Vec<(&'static str, Vec<String>)>>,
}

impl Claims for FakeClaims {
    fn prepare(&self, claims: &[ClaimRef]) -> BTreeMap<String, PrepareOutcome> {
        self.calls
            .lock()
            .unwrap()
            .push(("prepare", claims.iter().map(|c| c.uid.clone()).collect()));
        let mut prepared = self.prepared.lock().unwrap();
        claims
            .iter()
            .map(|c| {
                let outcome = if c.name == "broken-claim" {
                    Err(format!(
                        "claim {}/{} ({}): device gpu-9: /dev/nvidia9 is missing",
                        c.namespace, c.name, c.uid
                    ))
                } else {
                    Ok(prepared
                        .entry(c.uid.clone())
                        .or_insert_with(|| {
                            vec![PreparedDevice {
                                request_names: vec!["gpu".to_string()],
                                pool_name: "node-a".to_string(),
                                device_name: "gpu-0".to_string(),
                                cdi_device_ids: vec![format!(
                                    "k8s.gpu.nvidia.com/claim={}-gpu-0",
                                    c.uid
                                )],
                                share_id: c
                                    .name
                                    .starts_with("shared-")
                                    .then(|| "share-1".to_string()),
                            }]
                        })
                        .clone())
                };
                (c.uid.clone(), outcome)
            })
            .collect()
    }

    fn unprepare(&self, claims: &[ClaimRef]) -> BTreeMap<String, Result<(), String>> {
        self.calls
            .lock()
            .unwrap()
            .push(("unprepare", claims.iter().map(|c| c.uid.clone()).collect()));
        let mut prepared = self.prepared.lock().unwrap();
        claims
            .iter()
            .map(|c| {
                prepared.remove(&c.uid);
                (c.uid.clone(), Ok(()))
            })
            .collect()
    }
}

/// The stand-in's line for `api`'s `step`.
fn step<'a>(lines: &'a [Value], api: &str, step: &str) -> &'a Value {
    lines
        .iter()
        .find(|l| l["event"] == "call" && l["api"] == api && l["step"] == step)
        .unwrap_or_else(|| panic!("no {api} {step} line in {lines:#?}"))
}

fn event<'a>(lines: &'a [Value], name: &str) -> &'a Value {
    lines
        .iter()
        .find(|l| l["event"] == name)
        .unwrap_or_else(|| panic!("no {name} line in {lines:#?}"))
}

/// The stand-in's health line for `step`.
fn health<'a>(lines: &'a [Value], step: &str) -> &'a Value {
    lines
        .iter()
        .find(|l| l["event"] == "health" && l["step"] == step)
        .unwrap_or_else(|| panic!("no health {step} line in {lines:#?}"))
}

/// The node's DRA devices: GPU-a whole, and a MIG device of GPU-b.
fn device_table() -> BTreeMap<String, NodeDevice> {
    let d = |minor, uuid: &str, gpu_uuid: &str| NodeDevice {
        minor,
        uuid: uuid.to_string(),
        gpu_uuid: gpu_uuid.to_string(),
    };
    BTreeMap::from([
        ("gpu-0".to_string(), d(0, "GPU-a", "GPU-a")),
        ("gpu-1-mig-1g10gb-19-6".to_string(), d(1, "MIG-b0", "GPU-b")),
    ])
}

/// (device, health, message) of a health line's devices, checking the pool
/// and the timeout.
fn health_of(line: &Value) -> Vec<(String, String, String)> {
    line["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            assert_eq!(d["pool"], "node-a", "{d}");
            assert_eq!(d["timeout"], 60, "{d}");
            assert!(d["last_updated_time"].as_i64().unwrap() > 1_700_000_000);
            (
                d["device"].as_str().unwrap().to_string(),
                d["health"].as_str().unwrap().to_string(),
                d["message"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn all_healthy() -> Vec<(String, String, String)> {
    ["gpu-0", "gpu-1-mig-1g10gb-19-6"]
        .map(|n| (n.to_string(), "HEALTHY".to_string(), String::new()))
        .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_grpcio_kubelet_registers_and_prepares_through_v1_and_v1beta1() {
    let py = python();
    let dir = tempfile::tempdir().unwrap();
    let dirs = Dirs {
        registry: dir.path().join("plugins_registry"),
        plugins: dir.path().join("plugins"),
        kubelet_plugins: None,
    };
    let claims = Arc::new(FakeClaims::default());
    let (status, mut status_rx) = watch::channel(Registration::Unknown);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (_devices, devices_rx) = watch::channel(device_table());
    let (monitor, health_rx) = watch::channel(HealthView::default());
    let server = tokio::spawn({
        let dirs = dirs.clone();
        let claims: Arc<dyn Claims> = claims.clone();
        let health = HealthSource::new("node-a", devices_rx, health_rx);
        async move {
            serve(&dirs, claims, health, status, async {
                let _ = stopped.await;
            })
            .await
        }
    });

    // The stand-in's lines as they come: the test acts on the health steps.
    let mut child = Command::new(&py)
        .arg(repo().join("tests/interop/dra_kubelet_standin.py"))
        .arg("--proto-dir")
        .arg(repo().join("proto/proto"))
        .arg("--registry-dir")
        .arg(&dirs.registry)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (line_tx, mut line_rx) = mpsc::unbounded_channel::<String>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line_tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut stderr = child.stderr.take().unwrap();
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let mut lines: Vec<Value> = Vec::new();
    let read_all = async {
        while let Some(l) = line_rx.recv().await {
            let v: Value = serde_json::from_str(&l).unwrap_or_else(|e| panic!("{e}: {l}"));
            if v["event"] == "health" && v["step"] == "first" {
                // The kubelet has the first list: a GPU goes bad.
                monitor.send_replace(HealthView {
                    unhealthy: BTreeMap::from([(
                        "GPU-b".to_string(),
                        "XID 79, from NVML".to_string(),
                    )]),
                });
            } else if v["event"] == "health" && v["step"] == "unhealthy" {
                // The kubelet saw it: the GPU recovers.
                monitor.send_replace(HealthView::default());
            }
            lines.push(v);
        }
    };
    tokio::time::timeout(Duration::from_secs(120), read_all)
        .await
        .expect("the stand-in finished within 120 s");
    let exit = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    let stderr = stderr.join().unwrap();
    assert!(
        exit.success(),
        "the Python kubelet failed ({exit}):\n{lines:#?}\n{stderr}"
    );

    // Registration: what GetInfo said, the version chosen, the refusal
    // answered with the kubelet's text, the acceptance on the channel.
    let info = event(&lines, "info");
    assert_eq!(info["type"], "DRAPlugin");
    assert_eq!(info["name"], "gpu.nvidia.com");
    let endpoint = dir.path().join("plugins/gpu.nvidia.com/dra.sock");
    assert_eq!(info["endpoint"], endpoint.display().to_string());
    assert_eq!(
        info["supported_versions"],
        serde_json::json!([
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1alpha1.DRAResourceHealth"
        ])
    );
    assert_eq!(
        event(&lines, "found")["socket"],
        dirs.registration_socket().display().to_string()
    );
    assert!(
        dirs.registration_socket()
            .ends_with("plugins_registry/gpu.nvidia.com-reg.sock")
    );
    assert_eq!(event(&lines, "chosen")["version"], "v1.DRAPlugin");
    let refused = event(&lines, "refused");
    assert_eq!(refused["code"], "UNKNOWN");
    assert!(
        refused["details"]
            .as_str()
            .unwrap()
            .contains("stand-in kubelet: checking that a refusal is answered"),
        "{refused}"
    );
    event(&lines, "registered");
    tokio::time::timeout(
        Duration::from_secs(5),
        status_rx.wait_for(Registration::is_registered),
    )
    .await
    .expect("the registration reached the watch channel")
    .unwrap();

    for api in ["v1", "v1beta1"] {
        let uid = |name: &str| format!("{api}-{name}-uid");
        // A prepare: one entry per claim, keyed by UID, the devices as given.
        let first = step(&lines, api, "prepare");
        let entries = first["claims"].as_object().unwrap();
        assert_eq!(entries.len(), 2, "{first}");
        let gpu = &entries[&uid("gpu-claim")];
        assert_eq!(gpu["error"], "");
        let device = &gpu["devices"][0];
        assert_eq!(device["pool_name"], "node-a");
        assert_eq!(device["device_name"], "gpu-0");
        assert_eq!(device["request_names"], serde_json::json!(["gpu"]));
        assert_eq!(
            device["cdi_device_ids"],
            serde_json::json!([format!(
                "k8s.gpu.nvidia.com/claim={}-gpu-0",
                uid("gpu-claim")
            )])
        );
        let shared = &entries[&uid("shared-claim")]["devices"][0];
        if api == "v1" {
            assert_eq!(device["share_id"], Value::Null);
            assert_eq!(shared["share_id"], "share-1");
        } else {
            // v1beta1 has no share_id at all.
            assert!(device.get("share_id").is_none(), "{device}");
            assert!(shared.get("share_id").is_none(), "{shared}");
        }
        // The same prepare again: the same answer.
        let again = step(&lines, api, "prepare_again");
        assert_eq!(again["claims"][&uid("gpu-claim")], *gpu);
        // A batch where one claim fails: the other is prepared, the failure
        // is in its own entry, naming the claim and what is missing.
        let batch = step(&lines, api, "batch_with_failure");
        assert_eq!(batch["claims"][&uid("other-claim")]["error"], "");
        assert_eq!(
            batch["claims"][&uid("other-claim")]["devices"]
                .as_array()
                .unwrap()
                .len(),
            1
        );
        let broken = &batch["claims"][&uid("broken-claim")];
        assert_eq!(broken["devices"], serde_json::json!([]));
        let error = broken["error"].as_str().unwrap();
        assert!(
            error.contains(&format!("team-a/broken-claim ({})", uid("broken-claim")))
                && error.contains("/dev/nvidia9 is missing"),
            "{error}"
        );
        // Unprepares: every claim an empty entry, an unknown one too, and
        // a repeat.
        for (s, n) in [
            ("unprepare", 4),
            ("unprepare_unknown", 1),
            ("unprepare_again", 1),
        ] {
            let u = step(&lines, api, s);
            let entries = u["claims"].as_object().unwrap();
            assert_eq!(entries.len(), n, "{u}");
            assert!(entries.values().all(|e| e["error"] == ""), "{u}");
        }
        let fields = &lines
            .iter()
            .find(|l| l["event"] == "api_done" && l["api"] == api)
            .unwrap()["device_fields"];
        assert_eq!(
            fields.as_array().unwrap().iter().any(|f| f == "share_id"),
            api == "v1",
            "{fields}"
        );
    }
    assert_eq!(event(&lines, "done")["chosen"], "v1.DRAPlugin");

    // Health on the same endpoint: the complete list at once, to a second
    // watcher too; the GPU's XID on its MIG device, with the reason; healthy
    // again after it recovers.
    assert_eq!(event(&lines, "health_listed")["listed"], true);
    assert_eq!(health_of(health(&lines, "first")), all_healthy());
    assert_eq!(health_of(health(&lines, "second_watcher")), all_healthy());
    assert_eq!(
        health_of(health(&lines, "unhealthy")),
        [
            ("gpu-0".to_string(), "HEALTHY".to_string(), String::new()),
            (
                "gpu-1-mig-1g10gb-19-6".to_string(),
                "UNHEALTHY".to_string(),
                "its GPU GPU-b: XID 79, from NVML".to_string()
            )
        ]
    );
    assert_eq!(health_of(health(&lines, "healthy")), all_healthy());

    // Every call reached the node's claims, in the stand-in's order.
    let calls = claims.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 12, "{calls:?}");
    assert_eq!(calls[1], ("prepare", vec!["v1-gpu-claim-uid".to_string()]));
    assert_eq!(
        calls[10],
        ("unprepare", vec!["v1beta1-never-prepared-uid".to_string()])
    );
    assert!(claims.prepared.lock().unwrap().is_empty());

    // Shutdown: both sockets gone, the registration forgotten.
    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
    assert!(!dirs.registration_socket().exists());
    assert!(!endpoint.exists());
    assert_eq!(*status_rx.borrow(), Registration::Unknown);
}
