//! Claims with time-slicing at a non-`Default` interval through a fake
//! [`TimeSlicePort`]: the GPUs changed before the spec is written, a
//! failure leaving nothing, unprepare setting them back unless another
//! claim holds them, different intervals on one GPU refused, MIG devices
//! refused, a prepare cut short undone at start.

use std::sync::{Arc, Mutex};

use hostlib::HostRoot;

use super::devices::mig_device_name;
use super::interval::{TimeSliceInterval, TimeSlicePort, TimeSliceRecord};
use super::tests_support::{Node, claim, gpu, inventory};
use super::{NodeClaims, OpaqueConfig};
use crate::claim::Claims;

const U1: &str = "dab5ab50-d59a-42a6-af16-cfd4628c0f7a";
const U2: &str = "0c6a9b8e-5b1d-4d0e-a1d2-3e4f5a6b7c8d";

/// One call: the GPUs, the interval, whether U1's and U2's specs were there.
type Call = (Vec<String>, u32, bool, bool);

struct FakePort {
    host: HostRoot,
    cdi_dir: String,
    calls: Mutex<Vec<Call>>,
    fail: Mutex<Option<String>>,
}

impl FakePort {
    fn new(n: &Node) -> Arc<Self> {
        Arc::new(FakePort {
            host: n.host.clone(),
            cdi_dir: n.opts.cdi_dir.clone(),
            calls: Mutex::new(Vec::new()),
            fail: Mutex::new(None),
        })
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    fn fail(&self, why: Option<&str>) {
        *self.fail.lock().unwrap() = why.map(str::to_string);
    }
}

impl TimeSlicePort for FakePort {
    fn set_time_slice(&self, gpus: &[String], interval: TimeSliceInterval) -> Result<(), String> {
        let there = |u| self.host.exists(super::cdi::spec_path(&self.cdi_dir, u));
        self.calls
            .lock()
            .unwrap()
            .push((gpus.to_vec(), interval.int(), there(U1), there(U2)));
        match self.fail.lock().unwrap().clone() {
            Some(why) => Err(why),
            None => Ok(()),
        }
    }
}

fn open(n: &Node, port: Option<&Arc<FakePort>>) -> NodeClaims {
    let mut mig_on = gpu(2, "GPU-c");
    mig_on.mig = Some(gpu_model::backend::MigMode {
        current: true,
        pending: true,
    });
    mig_on.mig_devices = vec![gpu_model::backend::MigDevice {
        index: 0,
        uuid: "MIG-c1".into(),
        profile: "1g.10gb".into(),
        gi_slices: 1,
        ci_slices: 1,
        memory_mib: 9856,
        multiprocessors: 16,
        gpu_instance_id: Some(13),
        compute_instance_id: Some(0),
        engines: Default::default(),
        gi_profile_id: Some(19),
        placement_start: Some(6),
    }];
    let inv = inventory(vec![gpu(0, "GPU-a"), gpu(1, "GPU-b"), mig_on]);
    let claims = NodeClaims::open(n.host.clone(), n.opts.clone(), n.allocs.clone(), &inv).unwrap();
    match port {
        Some(p) => {
            let p: Arc<dyn TimeSlicePort> = p.clone();
            claims.with_time_slice(Ok(p))
        }
        None => claims,
    }
}

/// Allocates `devices` to `uid` with a `kind` configuration at `interval`.
fn allocate(n: &Node, uid: &str, devices: &[(&str, Option<&str>)], kind: &str, interval: &str) {
    n.allocate(uid, devices);
    let mut a = n.allocs.get(uid).unwrap();
    a.configs.push(OpaqueConfig {
        source: super::ConfigSource::FromClaim,
        requests: Vec::new(),
        parameters: serde_json::json!({"apiVersion": "resource.nvidia.com/v1beta1",
            "kind": kind, "sharing": {"strategy": "TimeSlicing",
            "timeSlicingConfig": {"interval": interval}}}),
    });
    n.allocs.insert(uid, a);
}

fn call(gpus: &[&str], n: u32, u1: bool, u2: bool) -> Call {
    (gpus.iter().map(|g| g.to_string()).collect(), n, u1, u2)
}

#[test]
fn the_time_slice_is_set_before_the_spec_and_set_back_on_unprepare() {
    let n = Node::new();
    let port = FakePort::new(&n);
    let claims = open(&n, Some(&port));
    allocate(
        &n,
        U1,
        &[("gpu-0", None), ("gpu-1", None)],
        "GpuConfig",
        "Long",
    );
    let out = claims.prepare(&[claim(U1)]);
    assert_eq!(out[U1].as_ref().unwrap().len(), 2);
    assert_eq!(port.calls(), [call(&["GPU-a", "GPU-b"], 3, false, false)]);
    assert_eq!(
        n.checkpoint().time_slices[U1],
        TimeSliceRecord {
            interval: TimeSliceInterval::Long,
            gpus: vec!["GPU-a".into(), "GPU-b".into()],
        }
    );
    // A repeat changes nothing.
    assert!(claims.prepare(&[claim(U1)])[U1].is_ok());
    assert_eq!(port.calls().len(), 1);

    assert!(claims.unprepare(&[claim(U1)])[U1].is_ok());
    assert_eq!(port.calls()[1], call(&["GPU-a", "GPU-b"], 0, true, false));
    assert!(!n.exists(&n.spec_path(U1)));
    assert!(n.checkpoint().time_slices.is_empty());
    // Idempotent: nothing more is run.
    assert!(claims.unprepare(&[claim(U1)])[U1].is_ok());
    assert_eq!(port.calls().len(), 2);
}

#[test]
fn a_failure_fails_the_claim_in_words_and_leaves_nothing() {
    let n = Node::new();
    let port = FakePort::new(&n);
    let claims = open(&n, Some(&port));
    allocate(&n, U1, &[("gpu-0", None)], "GpuConfig", "Short");
    port.fail(Some(
        "nvidia-smi compute-policy -i GPU-a --set-timeslice 1: Insufficient Permissions (exit code 4)",
    ));
    let err = claims.prepare(&[claim(U1)])[U1].clone().unwrap_err();
    assert!(
        err.contains("ResourceClaim ns/claim-")
            && err.contains("the time slice of its GPUs: nvidia-smi compute-policy -i GPU-a --set-timeslice 1: Insufficient Permissions"),
        "{err}"
    );
    assert!(!n.exists(&n.spec_path(U1)));
    let ck = n.checkpoint();
    assert!(ck.claims.is_empty() && ck.time_slices.is_empty(), "{ck:?}");
    // The GPU is set back (a GPU before the failing one may have changed).
    assert_eq!(
        port.calls(),
        [
            call(&["GPU-a"], 1, false, false),
            call(&["GPU-a"], 0, false, false)
        ]
    );
    // The kubelet's retry works once the GPU takes it.
    port.fail(None);
    assert!(claims.prepare(&[claim(U1)])[U1].is_ok());
}

#[test]
fn a_gpu_another_claim_holds_keeps_its_slice_and_other_intervals_are_refused() {
    let n = Node::new();
    let port = FakePort::new(&n);
    let claims = open(&n, Some(&port));
    allocate(&n, U1, &[("gpu-0", Some("s1"))], "GpuConfig", "Medium");
    allocate(
        &n,
        U2,
        &[("gpu-0", Some("s2")), ("gpu-1", None)],
        "GpuConfig",
        "Medium",
    );
    let out = claims.prepare(&[claim(U1), claim(U2)]);
    assert!(out[U1].is_ok() && out[U2].is_ok(), "{out:?}");
    assert!(claims.unprepare(&[claim(U1)])[U1].is_ok());
    // GPU-a is U2's still: only U1's own were set back, and it had none other.
    assert_eq!(port.calls().len(), 2, "{:?}", port.calls());
    assert!(claims.unprepare(&[claim(U2)])[U2].is_ok());
    assert_eq!(port.calls()[2], call(&["GPU-a", "GPU-b"], 0, false, true));

    // Different intervals: the second is refused naming the first.
    assert!(claims.prepare(&[claim(U1)])[U1].is_ok());
    allocate(&n, U2, &[("gpu-0", Some("s2"))], "GpuConfig", "Long");
    let err = claims.prepare(&[claim(U2)])[U2].clone().unwrap_err();
    assert!(
        err.contains(&format!(
            "its time-slicing interval Long differs from ResourceClaim ns/claim-{U1} ({U1})'s (Medium) on GPU GPU-a"
        )),
        "{err}"
    );
    // Default asked explicitly while the GPU runs Medium: refused as well.
    allocate(&n, U2, &[("gpu-0", Some("s2"))], "GpuConfig", "Default");
    let err = claims.prepare(&[claim(U2)])[U2].clone().unwrap_err();
    assert!(err.contains("interval Default differs from"), "{err}");
    assert_eq!(port.calls().len(), 4, "nothing run for the refused");
}

#[test]
fn mig_devices_take_no_time_slice_and_a_node_without_the_port_refuses() {
    let n = Node::new();
    let port = FakePort::new(&n);
    let claims = open(&n, Some(&port));
    let mig = mig_device_name(2, "1g.10gb", 19, 6);
    allocate(&n, U1, &[(&mig, None)], "GpuConfig", "Long");
    let err = claims.prepare(&[claim(U1)])[U1].clone().unwrap_err();
    assert!(
        err.contains(&format!(
            "interval Long on {mig}, a MIG device, which takes no time slice"
        )),
        "{err}"
    );
    allocate(&n, U1, &[(&mig, None)], "MigDeviceConfig", "Short");
    let err = claims.prepare(&[claim(U1)])[U1].clone().unwrap_err();
    assert!(err.contains("MIG devices take no time slice"), "{err}");
    assert!(port.calls().is_empty());

    let plain = Node::new();
    let claims = open(&plain, None);
    allocate(&plain, U1, &[("gpu-0", None)], "GpuConfig", "Long");
    let err = claims.prepare(&[claim(U1)])[U1].clone().unwrap_err();
    assert!(
        err.contains("interval Long, which changes the GPU's time slice; this node's DRA plugin runs without a way to change GPU time slices"),
        "{err}"
    );
    // Default needs no port and changes nothing.
    allocate(&plain, U1, &[("gpu-0", None)], "GpuConfig", "Default");
    assert!(claims.prepare(&[claim(U1)])[U1].is_ok());
}

#[test]
fn unprepare_that_cannot_set_back_keeps_the_claim_and_start_undoes_a_cut_prepare() {
    let n = Node::new();
    let port = FakePort::new(&n);
    let claims = open(&n, Some(&port));
    allocate(&n, U1, &[("gpu-1", None)], "GpuConfig", "Long");
    assert!(claims.prepare(&[claim(U1)])[U1].is_ok());
    port.fail(Some("GPU-b: nvidia-smi said no (exit code 3)"));
    let err = claims.unprepare(&[claim(U1)])[U1].clone().unwrap_err();
    assert!(err.contains("GPU-b: nvidia-smi said no"), "{err}");
    assert!(n.exists(&n.spec_path(U1)), "kept for the kubelet's retry");
    assert!(n.checkpoint().time_slices.contains_key(U1));
    port.fail(None);
    assert!(claims.unprepare(&[claim(U1)])[U1].is_ok());
    drop(claims);

    // A prepare cut short: its entry `preparing`, its GPUs changed.
    let claims = open(&n, Some(&port));
    allocate(&n, U2, &[("gpu-0", None)], "GpuConfig", "Short");
    assert!(claims.prepare(&[claim(U2)])[U2].is_ok());
    drop(claims);
    let mut ck = n.checkpoint();
    ck.claims.get_mut(U2).unwrap().state = super::EntryState::Preparing;
    n.write(&n.checkpoint_path(), &serde_json::to_string(&ck).unwrap());
    let before = port.calls().len();
    let claims = open(&n, Some(&port));
    assert_eq!(claims.restore_time_slices(), [U2.to_string()]);
    assert_eq!(port.calls()[before], call(&["GPU-a"], 0, false, false));
    assert!(n.checkpoint().time_slices.is_empty());
    assert!(claims.restore_time_slices().is_empty());
}
