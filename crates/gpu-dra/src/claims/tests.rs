//! NodeClaims over a temp-dir host: prepare and its spec, the failures that
//! name the claim, repeats and races, and start-up recovery.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::checkpoint::{Checkpoint, EntryState};
use super::recovery::Found;
use super::tests_support::{BOOT, Node, claim};
use crate::claim::Claims;

const U1: &str = "dab5ab50-d59a-42a6-af16-cfd4628c0f7a";
const U2: &str = "0c7e1d7a-2f4b-4b83-9d0b-5b1f2a3c4d5e";

#[test]
fn prepare_writes_the_claims_spec_before_answering() {
    let n = Node::new();
    let claims = n.open();
    n.allocate(U1, &[("gpu-1", None)]);
    let out = claims.prepare(&[claim(U1)]);
    let devices = out[U1].as_ref().unwrap();
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0].device_name, "gpu-1");
    assert_eq!(devices[0].pool_name, "node-a");
    assert_eq!(devices[0].request_names, ["gpu"]);
    assert_eq!(
        devices[0].cdi_device_ids,
        [format!("k8s.gpu.nvidia.com/claim={U1}-gpu-1")]
    );
    let yaml = n.read(&n.spec_path(U1)).expect("spec written");
    let spec: gpu_model::cdi::Spec = serde_yaml_ng::from_str(&yaml).unwrap();
    assert_eq!(spec.kind, "k8s.gpu.nvidia.com/claim");
    assert_eq!(spec.devices.len(), 1);
    assert_eq!(spec.devices[0].name, format!("{U1}-gpu-1"));
    assert_eq!(
        spec.devices[0].container_edits.device_nodes[0].path,
        "/dev/nvidia1"
    );
    let node = super::tests_support::node_spec();
    assert_eq!(
        spec.container_edits, node.container_edits,
        "common edits at the top"
    );
    assert!(
        n.spec_path(U1)
            .ends_with(&format!("/k8s.gpu.nvidia.com-claim_{U1}.yaml"))
    );
    let ckpt = n.checkpoint();
    assert_eq!(ckpt.boot_id, BOOT);
    assert_eq!(ckpt.claims[U1].state, EntryState::Prepared);
    assert_eq!(ckpt.claims[U1].name, format!("claim-{U1}"));
}

#[test]
fn no_allocation_fails_the_claim_by_name_after_the_wait() {
    let n = Node::new();
    let claims = n.open();
    let started = Instant::now();
    let out = claims.prepare(&[claim(U1)]);
    let err = out[U1].as_ref().unwrap_err();
    assert!(started.elapsed() >= Duration::from_millis(100));
    assert!(
        err.starts_with(&format!(
            "ResourceClaim ns/claim-{U1} ({U1}): no allocation from gpu-controller yet"
        )),
        "{err}"
    );
    assert!(!n.exists(&n.spec_path(U1)));
    assert!(n.checkpoint().claims.is_empty());
}

#[test]
fn an_allocation_arriving_during_the_wait_is_prepared() {
    let mut n = Node::new();
    n.opts.allocation_wait = Duration::from_secs(20);
    let claims = n.open();
    let allocs = Arc::clone(&n.allocs);
    let feed = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        allocs.insert(
            U1,
            super::ClaimAllocation {
                namespace: "ns".into(),
                name: "late".into(),
                devices: vec![super::AllocatedDevice {
                    request: "gpu".into(),
                    pool: "node-a".into(),
                    device: "gpu-0".into(),
                    share_id: None,
                }],
                configs: Vec::new(),
            },
        );
    });
    let started = Instant::now();
    let out = claims.prepare(&[claim(U1)]);
    feed.join().unwrap();
    assert!(out[U1].is_ok(), "{:?}", out[U1]);
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_missing_device_node_fails_the_claim_naming_it_and_writes_nothing() {
    let n = Node::new();
    let claims = n.open();
    n.remove("/dev/nvidia1");
    n.remove("/dev/nvidia-uvm");
    n.allocate(U1, &[("gpu-1", None)]);
    let out = claims.prepare(&[claim(U1)]);
    let err = out[U1].as_ref().unwrap_err();
    assert!(
        err.contains("device nodes missing on the host: /dev/nvidia1, /dev/nvidia-uvm"),
        "{err}"
    );
    assert!(!n.exists(&n.spec_path(U1)));
    assert!(n.checkpoint().claims.is_empty());
    // Once the nodes are there, the kubelet's retry succeeds.
    n.write("/dev/nvidia1", "");
    n.write("/dev/nvidia-uvm", "");
    assert!(claims.prepare(&[claim(U1)])[U1].is_ok());
}

#[test]
fn a_node_spec_without_control_nodes_or_at_all_fails_the_claim() {
    let n = Node::new();
    let claims = n.open();
    n.allocate(U1, &[("gpu-0", None)]);
    let mut spec = super::tests_support::node_spec();
    spec.container_edits.device_nodes.clear();
    n.write(&n.opts.node_spec, &serde_json::to_string(&spec).unwrap());
    let err = claims.prepare(&[claim(U1)])[U1].clone().unwrap_err();
    assert!(
        err.contains("names no /dev/nvidiactl, /dev/nvidia-uvm"),
        "{err}"
    );
    n.remove(&n.opts.node_spec);
    let err = claims.prepare(&[claim(U1)])[U1].clone().unwrap_err();
    assert!(
        err.contains("gpu-agent-nvidia.com-gpu.json: missing"),
        "{err}"
    );
    assert!(!n.exists(&n.spec_path(U1)));
}

#[test]
fn foreign_pools_unknown_devices_and_sharing_not_built_fail_by_name() {
    let n = Node::new();
    let claims = n.open();
    n.allocate(U1, &[("gpu-7", None)]);
    let err = claims.prepare(&[claim(U1)])[U1].clone().unwrap_err();
    assert!(
        err.contains("device gpu-7 is not on this node (devices here: gpu-0, gpu-1)"),
        "{err}"
    );
    let mut a = n.allocs.get(U1).unwrap();
    a.devices[0].device = "gpu-0".into();
    a.devices[0].pool = "node-b".into();
    n.allocs.insert(U1, a.clone());
    let err = claims.prepare(&[claim(U1)])[U1].clone().unwrap_err();
    assert!(
        err.contains("in pool node-b, not this node's (node-a)"),
        "{err}"
    );
    a.devices[0].pool = "node-a".into();
    a.configs.push(super::OpaqueConfig {
        source: super::ConfigSource::FromClaim,
        requests: Vec::new(),
        parameters: serde_json::json!({"apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}),
    });
    n.allocs.insert(U1, a.clone());
    let err = claims.prepare(&[claim(U1)])[U1].clone().unwrap_err();
    assert!(err.contains("strategy MPS"), "{err}");
    assert!(n.checkpoint().claims.is_empty());
    // Time-slicing at the GPU's default interval changes nothing: taken.
    a.configs[0].parameters = serde_json::json!({"apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing",
        "timeSlicingConfig": {"interval": "Default"}}});
    n.allocs.insert(U1, a);
    let ok = claims.prepare(&[claim(U1)])[U1].clone().unwrap();
    assert_eq!(ok[0].device_name, "gpu-0");
}

#[test]
fn a_repeated_prepare_answers_as_the_first_from_the_checkpoint() {
    let n = Node::new();
    let claims = n.open();
    n.allocate(U1, &[("gpu-0", None), ("gpu-1", None)]);
    let first = claims.prepare(&[claim(U1)]);
    // The controller no longer lists it: the repeat needs no allocation.
    n.allocs.remove(U1);
    let again = claims.prepare(&[claim(U1), claim(U1)]);
    assert_eq!(first, again);
    // A spec removed behind our back is written again.
    let yaml = n.read(&n.spec_path(U1)).unwrap();
    n.remove(&n.spec_path(U1));
    assert_eq!(claims.prepare(&[claim(U1)]), first);
    assert_eq!(n.read(&n.spec_path(U1)).unwrap(), yaml);
}

#[test]
fn a_device_of_another_claim_fails_naming_both_unless_shared() {
    let n = Node::new();
    let claims = n.open();
    n.allocate(U1, &[("gpu-0", None)]);
    n.allocate(U2, &[("gpu-0", None)]);
    assert!(claims.prepare(&[claim(U1)])[U1].is_ok());
    let err = claims.prepare(&[claim(U2)])[U2].clone().unwrap_err();
    assert_eq!(
        err,
        format!(
            "ResourceClaim ns/claim-{U2} ({U2}): device gpu-0 is already prepared for ResourceClaim ns/claim-{U1} ({U1})"
        )
    );
    assert!(!n.exists(&n.spec_path(U2)));
    // In one batch, the first claim wins and the second is refused.
    claims.unprepare(&[claim(U1)]);
    let out = claims.prepare(&[claim(U1), claim(U2)]);
    assert!(out[U1].is_ok());
    assert!(
        out[U2]
            .as_ref()
            .unwrap_err()
            .contains("already prepared for")
    );
    // Shared by share IDs on both sides: allowed.
    claims.unprepare(&[claim(U1)]);
    n.allocate(U1, &[("gpu-0", Some("s1"))]);
    n.allocate(U2, &[("gpu-0", Some("s2"))]);
    let out = claims.prepare(&[claim(U1), claim(U2)]);
    assert!(out[U1].is_ok() && out[U2].is_ok(), "{out:?}");
    assert_eq!(out[U2].as_ref().unwrap()[0].share_id.as_deref(), Some("s2"));
}

#[test]
fn unprepare_cleans_and_is_idempotent_in_any_order() {
    let n = Node::new();
    let claims = n.open();
    // Unknown claim, before any prepare: done already.
    assert_eq!(claims.unprepare(&[claim(U1)])[U1], Ok(()));
    n.allocate(U1, &[("gpu-0", None)]);
    assert!(claims.prepare(&[claim(U1)])[U1].is_ok());
    assert_eq!(claims.unprepare(&[claim(U1)])[U1], Ok(()));
    assert!(!n.exists(&n.spec_path(U1)));
    assert!(n.checkpoint().claims.is_empty());
    assert_eq!(claims.unprepare(&[claim(U1)])[U1], Ok(()));
    // A spec file with no entry (half-prepared): removed.
    n.write(&n.spec_path(U2), "half");
    assert_eq!(claims.unprepare(&[claim(U2)])[U2], Ok(()));
    assert!(!n.exists(&n.spec_path(U2)));
    // Prepared again after its unprepare: a fresh prepare.
    assert!(claims.prepare(&[claim(U1)])[U1].is_ok());
    assert!(n.exists(&n.spec_path(U1)));
}

#[test]
fn racing_prepares_and_unprepares_leave_spec_and_checkpoint_agreeing() {
    let n = Node::new();
    let claims = Arc::new(n.open());
    n.allocate(U1, &[("gpu-0", None)]);
    n.allocate(U2, &[("gpu-0", None)]);
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let c = Arc::clone(&claims);
            std::thread::spawn(move || {
                let uid = if i % 2 == 0 { U1 } else { U2 };
                for _ in 0..20 {
                    if i % 4 < 2 {
                        let _ = c.prepare(&[claim(uid)]);
                    } else {
                        c.unprepare(&[claim(uid)]);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let ckpt = n.checkpoint();
    assert!(ckpt.claims.len() <= 1, "gpu-0 is never prepared twice");
    for uid in [U1, U2] {
        assert_eq!(
            ckpt.claims.contains_key(uid),
            n.exists(&n.spec_path(uid)),
            "{uid}"
        );
    }
    for e in ckpt.claims.values() {
        assert_eq!(e.state, EntryState::Prepared);
    }
}

#[test]
fn a_checkpoint_that_cannot_be_written_fails_the_claim_and_leaves_no_spec() {
    let n = Node::new();
    let claims = n.open();
    n.allocate(U1, &[("gpu-0", None)]);
    // The state directory replaced by a file: every write fails.
    let state = n.host.resolve(&n.opts.state_dir).unwrap();
    std::fs::remove_dir_all(&state).unwrap();
    std::fs::write(&state, "").unwrap();
    let err = claims.prepare(&[claim(U1)])[U1].clone().unwrap_err();
    assert!(
        err.contains("the checkpoint /var/lib/gpu-agent/dra/checkpoint.json could not be written"),
        "{err}"
    );
    assert!(!n.exists(&n.spec_path(U1)));
    assert!(claims.status().claims.is_empty());
}

// Start-up.

#[test]
fn restart_keeps_prepared_claims_and_rewrites_their_specs() {
    let n = Node::new();
    let claims = n.open();
    n.allocate(U1, &[("gpu-0", None)]);
    let first = claims.prepare(&[claim(U1)]);
    let yaml = n.read(&n.spec_path(U1)).unwrap();
    drop(claims);
    n.remove(&n.spec_path(U1));
    n.allocs.remove(U1);
    let claims = n.open();
    assert_eq!(n.read(&n.spec_path(U1)).unwrap(), yaml);
    let status = claims.status();
    assert_eq!(status.recovery.checkpoint, Found::Loaded { claims: 1 });
    assert_eq!(status.recovery.rewritten, [U1]);
    assert_eq!(claims.prepare(&[claim(U1)]), first);
    // Nothing to rewrite the next time.
    drop(claims);
    assert!(n.open().status().recovery.rewritten.is_empty());
}

#[test]
fn restart_rolls_back_unfinished_prepares_and_removes_stray_specs() {
    let n = Node::new();
    let claims = n.open();
    n.allocate(U1, &[("gpu-0", None)]);
    claims.prepare(&[claim(U1)]);
    drop(claims);
    // A crash between the `preparing` checkpoint and the answer.
    let mut ckpt = n.checkpoint();
    ckpt.claims.get_mut(U1).unwrap().state = EntryState::Preparing;
    n.write(&n.checkpoint_path(), &serde_json::to_string(&ckpt).unwrap());
    // A spec whose claim the checkpoint never recorded.
    n.write(&n.spec_path(U2), "stray");
    let claims = n.open();
    let rec = claims.status().recovery;
    assert_eq!(rec.rolled_back, [U1]);
    assert_eq!(rec.removed, [n.spec_path(U2)]);
    assert!(!n.exists(&n.spec_path(U1)));
    assert!(!n.exists(&n.spec_path(U2)));
    assert!(n.checkpoint().claims.is_empty());
    assert!(
        rec.summary().contains(&format!("rolled back: {U1}")),
        "{}",
        rec.summary()
    );
}

#[test]
fn a_checkpoint_of_another_boot_is_dropped() {
    let n = Node::new();
    let claims = n.open();
    n.allocate(U1, &[("gpu-0", None)]);
    claims.prepare(&[claim(U1)]);
    drop(claims);
    n.write("/proc/sys/kernel/random/boot_id", "another-boot\n");
    let claims = n.open();
    let rec = claims.status().recovery;
    assert_eq!(
        rec.checkpoint,
        Found::OtherBoot {
            boot_id: BOOT.into(),
            dropped: vec![U1.into()]
        }
    );
    // A spec kept in a persistent directory goes with it.
    assert_eq!(rec.removed, [n.spec_path(U1)]);
    let ckpt = n.checkpoint();
    assert_eq!(ckpt.boot_id, "another-boot");
    assert!(ckpt.claims.is_empty());
    assert!(rec.summary().contains("the kubelet prepares them again"));
    // The kubelet prepares it again: a fresh prepare.
    assert!(claims.prepare(&[claim(U1)])[U1].is_ok());
}

#[test]
fn a_corrupt_checkpoint_is_set_aside_and_rebuilt_from_the_specs() {
    let n = Node::new();
    let claims = n.open();
    n.allocate(U1, &[("gpu-1", None)]);
    let first = claims.prepare(&[claim(U1)]);
    drop(claims);
    n.write(&n.checkpoint_path(), "{\"version\": 1, \"bootId\": tru");
    n.write(&n.spec_path(U2), "not: [a spec");
    let claims = n.open();
    let rec = claims.status().recovery;
    let Found::Corrupt {
        set_aside, rebuilt, ..
    } = &rec.checkpoint
    else {
        panic!("{rec:?}")
    };
    assert_eq!(rebuilt, &[U1.to_string()]);
    assert!(set_aside.starts_with(&format!("{}.corrupt-", n.checkpoint_path())));
    assert_eq!(
        n.read(set_aside).unwrap(),
        "{\"version\": 1, \"bootId\": tru"
    );
    assert_eq!(rec.problems.len(), 1, "{rec:?}");
    assert!(rec.problems[0].contains(&n.spec_path(U2)));
    assert!(!n.exists(&n.spec_path(U2)));
    let ckpt: Checkpoint = n.checkpoint();
    assert!(ckpt.claims[U1].recovered);
    assert_eq!(claims.status().claims[0].devices, ["gpu-1"]);
    // Another claim still cannot take its device.
    n.allocate(U2, &[("gpu-1", None)]);
    assert!(claims.prepare(&[claim(U2)])[U2].is_err());
    // A repeat prepare completes it from the allocation, as first answered.
    assert_eq!(claims.prepare(&[claim(U1)]), first);
    assert!(!n.checkpoint().claims[U1].recovered);
    assert_eq!(claims.unprepare(&[claim(U1)])[U1], Ok(()));
    assert!(!n.exists(&n.spec_path(U1)));
}

#[test]
fn an_unprepare_while_prepare_waits_wins() {
    let mut n = Node::new();
    n.opts.allocation_wait = Duration::from_secs(20);
    let claims = Arc::new(n.open());
    let c = Arc::clone(&claims);
    let waiting = std::thread::spawn(move || c.prepare(&[claim(U1)]));
    // Until the prepare is registered as waiting.
    while claims.lock().waiting.is_empty() {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(claims.unprepare(&[claim(U1)])[U1], Ok(()));
    n.allocate(U1, &[("gpu-0", None)]);
    let out = waiting.join().unwrap();
    let err = out[U1].as_ref().unwrap_err();
    assert!(
        err.contains("unprepared while this prepare waited"),
        "{err}"
    );
    assert!(!n.exists(&n.spec_path(U1)));
    assert!(n.checkpoint().claims.is_empty());
    assert!(claims.lock().waiting.is_empty());
    // The kubelet's next prepare of it is a fresh one.
    assert!(claims.prepare(&[claim(U1)])[U1].is_ok());
}

#[test]
fn a_spec_that_cannot_be_written_fails_the_claim_naming_it() {
    let mut n = Node::new();
    n.opts.cdi_dir = "/run/claims".into();
    let claims = n.open();
    n.write("/run/claims", "a file, not a directory");
    n.allocate(U1, &[("gpu-0", None)]);
    let err = claims.prepare(&[claim(U1)])[U1].clone().unwrap_err();
    assert!(
        err.contains(&format!(
            "writing /run/claims/k8s.gpu.nvidia.com-claim_{U1}.yaml"
        )),
        "{err}"
    );
    assert!(n.checkpoint().claims.is_empty());
    assert!(claims.status().claims.is_empty());
}

#[test]
fn a_new_inventory_renames_the_devices_prepared_claims_keep_theirs() {
    use super::tests_support::{gpu, inventory};
    let n = Node::new();
    let claims = n.open();
    n.allocate(U1, &[("gpu-1", None)]);
    assert!(claims.prepare(&[claim(U1)])[U1].is_ok());
    claims.set_inventory(&inventory(vec![gpu(0, "GPU-a")]));
    assert_eq!(claims.device_names(), ["gpu-0"]);
    n.allocate(U2, &[("gpu-1", None)]);
    let err = claims.prepare(&[claim(U2)])[U2].clone().unwrap_err();
    assert!(
        err.contains("device gpu-1 is not on this node (devices here: gpu-0)"),
        "{err}"
    );
    assert!(
        claims.prepare(&[claim(U1)])[U1].is_ok(),
        "answered from the checkpoint"
    );
    let status = serde_json::to_value(claims.status()).unwrap();
    assert_eq!(status["recovery"]["checkpoint"]["found"], "none");
    assert_eq!(status["claims"][0]["state"], "prepared");
    assert_eq!(status["claims"][0]["devices"][0], "gpu-1");
}
