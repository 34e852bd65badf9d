//! Claims with MPS sharing through a fake [`MpsPort`]: the daemon started
//! before the spec is written and the spec pointing at it, a failed start
//! leaving nothing, unprepare stopping it before the spec goes, and
//! start-up starting the daemons of prepared claims again.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use hostlib::HostRoot;

use super::sharing::{MpsDirs, MpsGpu, MpsPort, MpsSettings};
use super::tests_support::{Node, claim, gpu, inventory};
use super::{NodeClaims, OpaqueConfig};
use crate::claim::Claims;

const U1: &str = "dab5ab50-d59a-42a6-af16-cfd4628c0f7a";

/// What the fake was asked, with whether the claim's spec was on disk then.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Call {
    Start {
        uid: String,
        gpus: Vec<MpsGpu>,
        settings: MpsSettings,
        spec_there: bool,
    },
    Stop {
        uid: String,
        spec_there: bool,
    },
}

struct FakePort {
    host: HostRoot,
    cdi_dir: String,
    calls: Mutex<Vec<Call>>,
    fail_start: Mutex<Option<String>>,
    fail_stop: Mutex<Option<String>>,
    /// When set, start waits for a word on it (after recording the call).
    gate: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
}

impl FakePort {
    fn new(n: &Node) -> Arc<Self> {
        Arc::new(FakePort {
            host: n.host.clone(),
            cdi_dir: n.opts.cdi_dir.clone(),
            calls: Mutex::new(Vec::new()),
            fail_start: Mutex::new(None),
            fail_stop: Mutex::new(None),
            gate: Mutex::new(None),
        })
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    fn spec_there(&self, uid: &str) -> bool {
        self.host.exists(super::cdi::spec_path(&self.cdi_dir, uid))
    }
}

fn dirs(uid: &str) -> MpsDirs {
    MpsDirs {
        pipe_dir: format!("/run/nvidia/mps/dra-claim-{uid}/pipe"),
        shm_dir: format!("/run/nvidia/mps/dra-claim-{uid}/shm"),
    }
}

impl MpsPort for FakePort {
    fn start(
        &self,
        claim_uid: &str,
        gpus: &[MpsGpu],
        settings: &MpsSettings,
    ) -> Result<MpsDirs, String> {
        self.calls.lock().unwrap().push(Call::Start {
            uid: claim_uid.into(),
            gpus: gpus.to_vec(),
            settings: settings.clone(),
            spec_there: self.spec_there(claim_uid),
        });
        if let Some(gate) = self.gate.lock().unwrap().take() {
            gate.recv().unwrap();
        }
        match self.fail_start.lock().unwrap().clone() {
            Some(why) => Err(why),
            None => Ok(dirs(claim_uid)),
        }
    }

    fn stop(&self, claim_uid: &str) -> Result<(), String> {
        self.calls.lock().unwrap().push(Call::Stop {
            uid: claim_uid.into(),
            spec_there: self.spec_there(claim_uid),
        });
        match self.fail_stop.lock().unwrap().clone() {
            Some(why) => Err(why),
            None => Ok(()),
        }
    }
}

fn open(n: &Node, port: &Arc<FakePort>) -> NodeClaims {
    let inv = inventory(vec![gpu(0, "GPU-a"), gpu(1, "GPU-b")]);
    let port: Arc<dyn MpsPort> = port.clone();
    NodeClaims::open_with_mps(
        n.host.clone(),
        n.opts.clone(),
        n.allocs.clone(),
        &inv,
        Some(port),
    )
    .unwrap()
}

/// Claim U1 on both GPUs with MPS and `mps_config`.
fn allocate_mps(n: &Node, mps_config: serde_json::Value) {
    n.allocate(U1, &[("gpu-0", None), ("gpu-1", None)]);
    let mut a = n.allocs.get(U1).unwrap();
    a.configs.push(OpaqueConfig {
        source: super::ConfigSource::FromClaim,
        requests: Vec::new(),
        parameters: serde_json::json!({"apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mpsConfig": mps_config}}),
    });
    n.allocs.insert(U1, a);
}

fn settings() -> MpsSettings {
    MpsSettings {
        default_active_thread_percentage: Some(50),
        default_pinned_device_memory_limit_mib: Some(4096),
        per_device_pinned_memory_limit_mib: BTreeMap::from([("GPU-b".into(), 1024)]),
        multi_user: false,
    }
}

fn config() -> serde_json::Value {
    serde_json::json!({"defaultActiveThreadPercentage": 50,
        "defaultPinnedDeviceMemoryLimit": "4Gi",
        "defaultPerDevicePinnedMemoryLimit": {"GPU-b": "1Gi"}})
}

fn both_gpus() -> Vec<MpsGpu> {
    vec![
        MpsGpu {
            uuid: "GPU-a".into(),
            minor: 0,
            gpu_uuid: "GPU-a".into(),
        },
        MpsGpu {
            uuid: "GPU-b".into(),
            minor: 1,
            gpu_uuid: "GPU-b".into(),
        },
    ]
}

#[test]
fn the_daemon_starts_before_the_spec_which_points_every_device_at_it() {
    let n = Node::new();
    let port = FakePort::new(&n);
    let claims = open(&n, &port);
    allocate_mps(&n, config());
    let out = claims.prepare(&[claim(U1)]);
    assert_eq!(out[U1].as_ref().unwrap().len(), 2);
    assert_eq!(
        port.calls(),
        [Call::Start {
            uid: U1.into(),
            gpus: both_gpus(),
            settings: settings(),
            spec_there: false,
        }]
    );
    let spec: gpu_model::cdi::Spec =
        serde_yaml_ng::from_str(&n.read(&n.spec_path(U1)).unwrap()).unwrap();
    let d = dirs(U1);
    for dev in &spec.devices {
        let e = &dev.container_edits;
        assert_eq!(e.env, ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]);
        let mounts: Vec<(&str, &str, Vec<&str>)> = e
            .mounts
            .iter()
            .map(|m| {
                (
                    m.host_path.as_str(),
                    m.container_path.as_str(),
                    m.options.iter().map(String::as_str).collect(),
                )
            })
            .collect();
        let opts = vec!["rw", "nosuid", "nodev", "bind"];
        assert_eq!(
            mounts,
            [
                (d.shm_dir.as_str(), "/dev/shm", opts.clone()),
                (d.pipe_dir.as_str(), "/tmp/nvidia-mps", opts),
            ]
        );
        assert!(!e.device_nodes.is_empty(), "the GPU's own edits kept");
    }
    let ckpt = n.checkpoint();
    assert_eq!(ckpt.claims[U1].mps, Some(settings()));
    assert_eq!(ckpt.claims[U1].spec, spec);
    assert!(claims.status().claims[0].mps);
    // A repeat answers from the checkpoint: no second daemon.
    assert_eq!(claims.prepare(&[claim(U1)]), out);
    assert_eq!(port.calls().len(), 1);
}

#[test]
fn mig_devices_go_to_the_daemon_by_their_own_uuids_with_multi_user() {
    let n = Node::new();
    let port = FakePort::new(&n);
    let mut mig_on = gpu(2, "GPU-c");
    mig_on.mig = Some(gpu_model::backend::MigMode {
        current: true,
        pending: true,
    });
    let mig = |uuid: &str, start: u32| gpu_model::backend::MigDevice {
        index: 0,
        uuid: uuid.into(),
        profile: "1g.10gb".into(),
        gi_slices: 1,
        ci_slices: 1,
        memory_mib: 9856,
        multiprocessors: 16,
        gpu_instance_id: Some(13),
        compute_instance_id: Some(0),
        engines: Default::default(),
        gi_profile_id: Some(19),
        placement_start: Some(start),
    };
    mig_on.mig_devices = vec![mig("MIG-c1", 5), mig("MIG-c2", 6)];
    let inv = inventory(vec![gpu(0, "GPU-a"), gpu(1, "GPU-b"), mig_on]);
    // The node's spec and device node of the MIG devices' GPU.
    let mut spec = super::tests_support::node_spec();
    for uuid in ["MIG-c1", "MIG-c2"] {
        let mut d = spec.devices[0].clone();
        d.name = uuid.into();
        d.container_edits.device_nodes[0].path = "/dev/nvidia2".into();
        spec.devices.push(d);
    }
    n.write(
        &n.opts.node_spec.clone(),
        &serde_json::to_string_pretty(&spec).unwrap(),
    );
    n.write("/dev/nvidia2", "");
    let p: Arc<dyn MpsPort> = port.clone();
    let claims = NodeClaims::open_with_mps(
        n.host.clone(),
        n.opts.clone(),
        n.allocs.clone(),
        &inv,
        Some(p),
    )
    .unwrap();
    let (m1, m2) = (
        super::devices::mig_device_name(2, "1g.10gb", 19, 5),
        super::devices::mig_device_name(2, "1g.10gb", 19, 6),
    );
    // Two MIG devices of one GPU and a full GPU: one daemon over all three.
    n.allocate(U1, &[(&m2, None), ("gpu-0", None), (&m1, None)]);
    let mut a = n.allocs.get(U1).unwrap();
    for kind in ["MigDeviceConfig", "GpuConfig"] {
        a.configs.push(OpaqueConfig {
            source: super::ConfigSource::FromClaim,
            requests: Vec::new(),
            parameters: serde_json::json!({"apiVersion": "resource.nvidia.com/v1beta1",
                "kind": kind, "sharing": {"strategy": "MPS",
                "mpsConfig": {"multiUser": true, "defaultPerDevicePinnedMemoryLimit": {"MIG-c1": "2Gi"}}}}),
        });
    }
    n.allocs.insert(U1, a);
    let out = claims.prepare(&[claim(U1)]);
    assert_eq!(out[U1].as_ref().unwrap().len(), 3, "{out:?}");
    let mps_gpu = |uuid: &str, minor: u32, gpu_uuid: &str| MpsGpu {
        uuid: uuid.into(),
        minor,
        gpu_uuid: gpu_uuid.into(),
    };
    let want = MpsSettings {
        multi_user: true,
        per_device_pinned_memory_limit_mib: BTreeMap::from([("MIG-c1".into(), 2048)]),
        ..Default::default()
    };
    assert_eq!(
        port.calls(),
        [Call::Start {
            uid: U1.into(),
            gpus: vec![
                mps_gpu("MIG-c2", 2, "GPU-c"),
                mps_gpu("GPU-a", 0, "GPU-a"),
                mps_gpu("MIG-c1", 2, "GPU-c"),
            ],
            settings: want.clone(),
            spec_there: false,
        }]
    );
    let got = &port.calls()[0];
    let Call::Start { gpus, .. } = got else {
        unreachable!()
    };
    assert_eq!(
        gpus.iter().map(MpsGpu::is_mig).collect::<Vec<_>>(),
        [true, false, true]
    );
    // The checkpoint keeps multiUser: a restart starts the same daemon.
    assert_eq!(n.checkpoint().claims[U1].mps, Some(want));
}

#[test]
fn a_failed_start_or_a_bad_device_key_leaves_no_spec_and_no_daemon() {
    let n = Node::new();
    let port = FakePort::new(&n);
    let claims = open(&n, &port);
    allocate_mps(&n, config());
    *port.fail_start.lock().unwrap() = Some("the MPS control daemon did not answer".into());
    let err = claims.prepare(&[claim(U1)])[U1].clone().unwrap_err();
    assert!(
        err.contains(&format!("ResourceClaim ns/claim-{U1} ({U1})"))
            && err.ends_with("its MPS control daemon: the MPS control daemon did not answer"),
        "{err}"
    );
    assert!(!n.exists(&n.spec_path(U1)));
    assert!(n.checkpoint().claims.is_empty());
    assert!(port.calls().iter().all(|c| matches!(c, Call::Start { .. })));
    // A per-device limit for a GPU the claim does not have: refused before
    // anything starts.
    *port.fail_start.lock().unwrap() = None;
    allocate_mps(
        &n,
        serde_json::json!({"defaultPerDevicePinnedMemoryLimit": {"GPU-z": "1Gi"}}),
    );
    let before = port.calls().len();
    let err = claims.prepare(&[claim(U1)])[U1].clone().unwrap_err();
    assert!(err.contains("names \"GPU-z\""), "{err}");
    assert_eq!(port.calls().len(), before);
    // The kubelet's retry with a good config prepares it.
    allocate_mps(&n, config());
    assert!(claims.prepare(&[claim(U1)])[U1].is_ok());
}

#[test]
fn a_spec_that_cannot_be_written_stops_the_daemon_it_started() {
    let mut n = Node::new();
    n.opts.cdi_dir = "/var/run/blocked".into();
    let port = FakePort::new(&n);
    let claims = open(&n, &port);
    n.write("/var/run/blocked", "a file, not a directory");
    allocate_mps(&n, config());
    let err = claims.prepare(&[claim(U1)])[U1].clone().unwrap_err();
    assert!(err.contains("writing /var/run/blocked/"), "{err}");
    let calls = port.calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(matches!(&calls[1], Call::Stop { uid, .. } if uid == U1));
    assert!(n.checkpoint().claims.is_empty());
}

#[test]
fn unprepare_stops_the_daemon_then_removes_the_spec() {
    let n = Node::new();
    let port = FakePort::new(&n);
    let claims = open(&n, &port);
    allocate_mps(&n, config());
    claims.prepare(&[claim(U1)])[U1].as_ref().unwrap();
    // A daemon that will not stop keeps the claim prepared for the retry.
    *port.fail_stop.lock().unwrap() = Some("quit was not answered".into());
    let err = claims.unprepare(&[claim(U1)])[U1].clone().unwrap_err();
    assert!(
        err.ends_with("its MPS control daemon: quit was not answered"),
        "{err}"
    );
    assert!(n.exists(&n.spec_path(U1)));
    assert!(n.checkpoint().claims.contains_key(U1));
    *port.fail_stop.lock().unwrap() = None;
    assert_eq!(claims.unprepare(&[claim(U1)])[U1], Ok(()));
    assert!(!n.exists(&n.spec_path(U1)));
    assert!(n.checkpoint().claims.is_empty());
    let stops: Vec<Call> = port
        .calls()
        .into_iter()
        .filter(|c| matches!(c, Call::Stop { .. }))
        .collect();
    assert_eq!(
        stops,
        [
            Call::Stop {
                uid: U1.into(),
                spec_there: true
            },
            Call::Stop {
                uid: U1.into(),
                spec_there: true
            }
        ]
    );
    // Again: nothing there, nothing stopped.
    assert_eq!(claims.unprepare(&[claim(U1)])[U1], Ok(()));
    assert_eq!(port.calls().len(), 3);
}

#[test]
fn start_up_starts_the_daemons_of_prepared_claims_again() {
    let n = Node::new();
    let port = FakePort::new(&n);
    {
        let claims = open(&n, &port);
        allocate_mps(&n, config());
        claims.prepare(&[claim(U1)])[U1].as_ref().unwrap();
    }
    // The agent restarts: the kubelet does not prepare U1 again.
    let again = FakePort::new(&n);
    let claims = open(&n, &again);
    assert!(again.calls().is_empty(), "not before restore_mps");
    assert_eq!(claims.restore_mps(), [U1]);
    assert_eq!(
        again.calls(),
        [Call::Start {
            uid: U1.into(),
            gpus: both_gpus(),
            settings: settings(),
            spec_there: true,
        }]
    );
    let rec = claims.status().recovery;
    assert_eq!(rec.mps_restarted, [U1]);
    assert!(
        rec.summary()
            .contains(&format!("MPS daemons started again: {U1}")),
        "{}",
        rec.summary()
    );
    // One that fails is a problem in the recovery, naming the claim.
    let third = FakePort::new(&n);
    *third.fail_start.lock().unwrap() = Some("no nvidia-cuda-mps-control".into());
    let claims = open(&n, &third);
    assert!(claims.restore_mps().is_empty());
    let rec = claims.status().recovery;
    assert!(
        rec.problems
            .iter()
            .any(|p| p.contains(U1)
                && p.ends_with("was not started again: no nvidia-cuda-mps-control")),
        "{:?}",
        rec.problems
    );
    // A corrupt checkpoint: the claim is rebuilt from its spec, which says
    // it had a daemon; started again without the lost settings.
    n.write(&n.checkpoint_path(), "{not json");
    let fourth = FakePort::new(&n);
    let claims = open(&n, &fourth);
    assert_eq!(claims.restore_mps(), [U1]);
    assert!(matches!(
        &fourth.calls()[0],
        Call::Start { settings, .. } if *settings == MpsSettings::default()
    ));
}

#[test]
fn without_a_port_mps_claims_are_refused_in_words() {
    let n = Node::new();
    let claims = n.open();
    allocate_mps(&n, config());
    let err = claims.prepare(&[claim(U1)])[U1].clone().unwrap_err();
    assert!(
        err.contains("strategy MPS") && err.contains("without MPS control daemons"),
        "{err}"
    );
    assert!(claims.restore_mps().is_empty());
}

#[test]
fn a_starting_daemon_holds_up_no_one_and_an_unprepare_meanwhile_wins() {
    let n = Node::new();
    let port = FakePort::new(&n);
    let (open_gate, gate) = std::sync::mpsc::channel();
    *port.gate.lock().unwrap() = Some(gate);
    let claims = Arc::new(open(&n, &port));
    allocate_mps(&n, config());
    let preparing = {
        let claims = claims.clone();
        std::thread::spawn(move || claims.prepare(&[claim(U1)]))
    };
    while port.calls().is_empty() {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // The daemon is starting: status answers, the claim is `preparing`.
    let st = claims.status();
    assert_eq!(st.claims[0].state, super::EntryState::Preparing);
    // The kubelet gives up and unprepares: the daemon is told to stop.
    assert_eq!(claims.unprepare(&[claim(U1)])[U1], Ok(()));
    open_gate.send(()).unwrap();
    let err = preparing.join().unwrap()[U1].clone().unwrap_err();
    assert!(
        err.ends_with("its MPS control daemon: the claim was unprepared while its daemon started"),
        "{err}"
    );
    assert!(!n.exists(&n.spec_path(U1)));
    assert!(n.checkpoint().claims.is_empty());
    let stops = port
        .calls()
        .iter()
        .filter(|c| matches!(c, Call::Stop { .. }))
        .count();
    assert!(stops >= 1, "{:?}", port.calls());
}

#[test]
fn a_daemon_left_by_a_prepare_cut_short_is_stopped_at_start_up() {
    let n = Node::new();
    let port = FakePort::new(&n);
    {
        let claims = open(&n, &port);
        allocate_mps(&n, config());
        claims.prepare(&[claim(U1)])[U1].as_ref().unwrap();
    }
    // As if the agent was killed between its daemon's start and the
    // `prepared` checkpoint.
    let mut ckpt = n.checkpoint();
    ckpt.claims.get_mut(U1).unwrap().state = super::EntryState::Preparing;
    n.write(&n.checkpoint_path(), &serde_json::to_string(&ckpt).unwrap());
    let again = FakePort::new(&n);
    let claims = open(&n, &again);
    assert_eq!(claims.status().recovery.rolled_back, [U1]);
    assert!(claims.restore_mps().is_empty());
    // Whatever serves on its pipe directory is told to quit (the start),
    // then ours stops and the GPUs go back to DEFAULT (the stop).
    let calls = again.calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(
        matches!(&calls[0], Call::Start { uid, gpus, .. } if uid == U1 && *gpus == both_gpus())
    );
    assert_eq!(
        calls[1],
        Call::Stop {
            uid: U1.into(),
            spec_there: false
        }
    );
    // Only once.
    assert!(claims.restore_mps().is_empty());
    assert_eq!(again.calls().len(), 2);
}
