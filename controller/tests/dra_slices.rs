//! The ResourceSlice publisher (issue 31) against the scripted API server:
//! a node's slices while its agent says its DRA plugin is registered, only
//! the GPUs DRA hands out, every body checked against the 1.36 schema, no
//! request when nothing changed, slices the kubelet wipes written again,
//! slices deleted (and left deleted) when the plugin is no longer
//! registered, a health change that moves only the device taints, nothing
//! written by a stand-by, and the DeviceClasses made once.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{MockApi, Recorded, kubelet_node, schema};
use gpu_agent_proto::report::v1 as pb;
use gpu_controller::dra_slices::Publisher;
use gpu_controller::fleet::Fleet;
use gpu_controller::model::dra;
use gpu_controller::node::TaintPolicy;
use serde_json::{Value, json};

const NODE: &str = "gpu-node-1";
const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";

fn gpu(minor: u32, uuid: &str, mig: Vec<pb::MigDevice>) -> pb::Gpu {
    pb::Gpu {
        index: minor,
        minor: Some(minor),
        uuid: uuid.into(),
        model: "NVIDIA H100 80GB HBM3".into(),
        pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + minor),
        memory_mib: 81559,
        mig_enabled: !mig.is_empty(),
        mig_devices: mig,
        compute_capability: Some("9.0".into()),
        numa_node: Some(0),
        ..Default::default()
    }
}

fn mig(uuid: &str, profile: &str, gi: u32, start: u32) -> pb::MigDevice {
    pb::MigDevice {
        uuid: uuid.into(),
        profile: profile.into(),
        gi_profile_id: Some(gi),
        placement_start: Some(start),
        memory_mib: Some(40192),
        multiprocessors: Some(60),
        engines: Some(pb::MigEngines {
            copy: 3,
            decoder: 3,
            encoder: 0,
            jpeg: 3,
            ofa: 0,
        }),
    }
}

/// Three GPUs: GPU-0 whole, GPU-1 in two MIG devices (both DRA's), GPU-2
/// the device plugin's; `xid`: GPU-0 unhealthy by that XID.
fn report(registered: bool, xid: Option<u64>) -> pb::NodeReport {
    let gpus = vec![
        gpu(0, "GPU-0", vec![]),
        gpu(
            1,
            "GPU-1",
            vec![
                mig("MIG-1a", "3g.40gb", 9, 0),
                mig("MIG-1b", "3g.40gb", 9, 4),
            ],
        ),
        gpu(2, "GPU-2", vec![]),
    ];
    pb::NodeReport {
        health: Some(pb::Health {
            gpus: gpus
                .iter()
                .map(|g| pb::GpuHealth {
                    uuid: g.uuid.clone(),
                    healthy: !(g.uuid == "GPU-0" && xid.is_some()),
                    xid: xid.filter(|_| g.uuid == "GPU-0"),
                    reason: if g.uuid == "GPU-0" && xid.is_some() {
                        "XID 48".into()
                    } else {
                        String::new()
                    },
                    ..Default::default()
                })
                .collect(),
        }),
        inventory: Some(pb::Inventory {
            driver_version: "580.95.05".into(),
            cuda_version: "13.0".into(),
            gpus,
            ..Default::default()
        }),
        dra: Some(pb::DraState {
            registered,
            gpu_uuids: vec!["GPU-0".into(), "GPU-1".into()],
            ..Default::default()
        }),
        ..Default::default()
    }
}

struct Scene {
    api: MockApi,
    fleet: Arc<Fleet>,
    publisher: Arc<Publisher>,
    _down: tokio::sync::mpsc::Receiver<Result<pb::ControllerMessage, tonic::Status>>,
}

/// Waits (polling) for `f`; the limit only keeps a broken test from
/// hanging.
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..3000 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never: {what}");
}

/// The publisher running against the scripted server (leading, or by
/// `leader`), its watch listed, the node's agent connected.
async fn scene_with(leader: Option<tokio::sync::watch::Receiver<bool>>) -> Scene {
    let api = MockApi::start().await;
    api.add_node(NODE, kubelet_node());
    let (fleet, _queue) = Fleet::new(TaintPolicy::NoneHealthy, Duration::from_secs(60));
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let fleet = Arc::new(fleet.with_dra_slices(tx));
    let (down, down_rx) = tokio::sync::mpsc::channel(8);
    fleet.connect(
        pb::Hello {
            node_name: NODE.into(),
            ..Default::default()
        },
        down,
    );
    let mut publisher = Publisher::new(api.client());
    if let Some(l) = leader {
        publisher = publisher.with_leader(l);
    }
    let publisher = Arc::new(publisher);
    tokio::spawn(publisher.clone().run(fleet.clone(), rx));
    until("the ResourceSlices listed", || publisher.settled()).await;
    Scene {
        api,
        fleet,
        publisher,
        _down: down_rx,
    }
}

async fn scene() -> Scene {
    scene_with(None).await
}

impl Scene {
    /// Applies a message of the agent and waits until the publisher has
    /// looked at the node and is done.
    async fn agent_says(&self, body: pb::agent_message::Body) {
        let before = self.publisher.stats.looked.load(Ordering::Relaxed);
        self.fleet.apply(NODE, body);
        until("the publisher looked", || {
            self.publisher.stats.looked.load(Ordering::Relaxed) > before && self.publisher.settled()
        })
        .await;
    }

    /// Writes to slices since the last take (watches and lists left out).
    fn writes(&self) -> Vec<Recorded> {
        self.api
            .take()
            .into_iter()
            .filter(|r| r.method != "GET" || !r.uri.starts_with(SLICES))
            .collect()
    }
}

fn summary(r: &[Recorded]) -> Vec<String> {
    r.iter()
        .map(|r| format!("{} {}", r.method, r.uri))
        .collect()
}

/// Every slice validates as the API server takes it, and the pool is
/// consistent: one generation, as many slices as each says.
fn check_pool(slices: &[Value]) {
    let schemas = schema::load();
    for s in slices {
        let mut body = s.clone();
        // Server-filled metadata is the server's, not ours to check.
        body["metadata"] = json!({"name": s["metadata"]["name"], "ownerReferences": s["metadata"]["ownerReferences"]});
        let errs = schema::check(
            &schemas,
            "io.k8s.api.resource.v1.ResourceSlice",
            &body,
            false,
        );
        assert!(errs.is_empty(), "{s}: {errs:?}");
        assert_eq!(s["spec"]["driver"], "gpu.nvidia.com");
        assert_eq!(s["spec"]["nodeName"], NODE);
        assert_eq!(s["spec"]["pool"]["name"], NODE);
        let owner = &s["metadata"]["ownerReferences"][0];
        assert_eq!(owner["kind"], "Node");
        assert_eq!(owner["name"], NODE);
        assert!(
            owner["uid"]
                .as_str()
                .unwrap()
                .starts_with("node-gpu-node-1-")
        );
        assert_eq!(owner["controller"], true);
    }
    let gens: BTreeSet<i64> = slices
        .iter()
        .map(|s| s["spec"]["pool"]["generation"].as_i64().unwrap())
        .collect();
    assert_eq!(gens.len(), 1, "one generation: {gens:?}");
    for s in slices {
        assert_eq!(
            s["spec"]["pool"]["resourceSliceCount"].as_u64().unwrap() as usize,
            slices.len()
        );
    }
}

fn uuids(slices: &[Value]) -> BTreeSet<String> {
    slices
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .map(|d| {
            d["attributes"]["uuid"]["string"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect()
}

fn ours(api: &MockApi) -> Vec<Value> {
    api.resource_slices()
        .into_iter()
        .filter(|s| s["spec"]["nodeName"] == NODE && s["spec"]["driver"] == "gpu.nvidia.com")
        .collect()
}

#[tokio::test]
async fn a_registered_nodes_slices_are_made_and_nothing_is_sent_when_nothing_changed() {
    let s = scene().await;
    s.api.take();
    s.agent_says(pb::agent_message::Body::Snapshot(report(true, None)))
        .await;
    let r = s.writes();
    let name = dra::names::slice_name(NODE, 0);
    // The node's uid read once (the fleet's writer did not read it here),
    // then the one slice.
    assert_eq!(
        summary(&r),
        [
            format!("GET /api/v1/nodes/{NODE}"),
            format!("POST {SLICES}?&fieldManager=gpu-controller"),
        ]
    );
    assert_eq!(r[1].body["metadata"]["name"], name.as_str());
    let slices = ours(&s.api);
    assert_eq!(slices.len(), 1);
    check_pool(&slices);
    assert_eq!(slices[0]["spec"]["pool"]["generation"], 1);
    // Only the GPUs DRA hands out: GPU-0 whole, GPU-1 as its MIG devices
    // (not itself), GPU-2 (the device plugin's) not at all.
    assert_eq!(
        uuids(&slices),
        ["GPU-0", "MIG-1a", "MIG-1b"]
            .map(String::from)
            .into_iter()
            .collect()
    );
    let names: Vec<&str> = slices[0]["spec"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["gpu-0", "gpu-1-mig-3g40gb-9-0", "gpu-1-mig-3g40gb-9-4"]
    );

    // The same report again, whole or as a change: no request at all.
    s.agent_says(pb::agent_message::Body::Snapshot(report(true, None)))
        .await;
    s.agent_says(pb::agent_message::Body::Change(pb::NodeReport {
        dra: report(true, None).dra,
        ..Default::default()
    }))
    .await;
    assert_eq!(summary(&s.api.take()), Vec::<String>::new());
    assert_eq!(s.publisher.stats.writes.load(Ordering::Relaxed), 1);
    assert_eq!(s.publisher.stats.failures.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn slices_the_kubelet_deletes_on_start_are_written_again() {
    let s = scene().await;
    s.agent_says(pb::agent_message::Body::Snapshot(report(true, None)))
        .await;
    let before = ours(&s.api);
    assert_eq!(before.len(), 1);
    s.api.take();
    // A starting 1.36 kubelet deletes every slice of its node.
    assert_eq!(s.api.delete_node_slices(NODE), 1);
    until("the slices written again", || ours(&s.api).len() == 1).await;
    until("settled", || s.publisher.settled()).await;
    let after = ours(&s.api);
    check_pool(&after);
    assert_eq!(after[0]["spec"]["devices"], before[0]["spec"]["devices"]);
    let r = s.writes();
    // The uid read again (the node may have been made again), one create.
    assert_eq!(
        summary(&r),
        [
            format!("GET /api/v1/nodes/{NODE}"),
            format!("POST {SLICES}?&fieldManager=gpu-controller"),
        ]
    );
}

#[tokio::test]
async fn a_plugin_no_longer_registered_has_its_slices_deleted_and_not_made_again() {
    let s = scene().await;
    s.agent_says(pb::agent_message::Body::Snapshot(report(true, None)))
        .await;
    assert_eq!(ours(&s.api).len(), 1);
    // NVIDIA's plugin's slice of another pool of this driver on the node,
    // and another driver's: neither is ours.
    let mut foreign = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": "0-gpu.nvidia.com-gpu-node-1-x7k2p"},
        "spec": {"driver": "gpu.nvidia.com", "nodeName": NODE,
                 "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1}},
    });
    s.api.add_resource_slice(foreign.clone());
    foreign["metadata"]["name"] = json!("gpu-node-1-other");
    foreign["spec"]["driver"] = json!("example.com");
    s.api.add_resource_slice(foreign);
    until("settled", || s.publisher.settled()).await;
    s.api.take();

    s.agent_says(pb::agent_message::Body::Change(pb::NodeReport {
        dra: report(false, None).dra,
        ..Default::default()
    }))
    .await;
    let r = s.writes();
    assert_eq!(
        summary(&r),
        [format!(
            "DELETE {SLICES}/{}?",
            dra::names::slice_name(NODE, 0)
        )]
    );
    let left: Vec<String> = s
        .api
        .resource_slices()
        .iter()
        .map(|s| s["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        left,
        ["0-gpu.nvidia.com-gpu-node-1-x7k2p", "gpu-node-1-other"]
    );

    // Health and inventory keep coming: nothing is made again.
    s.agent_says(pb::agent_message::Body::Snapshot(report(false, Some(48))))
        .await;
    s.agent_says(pb::agent_message::Body::Snapshot(report(false, None)))
        .await;
    assert_eq!(summary(&s.writes()), Vec::<String>::new());

    // The kubelet's own cleanup, after ours (the others' slices of the
    // node): nothing to fight over.
    assert_eq!(s.api.delete_node_slices(NODE), 2);
    until("settled", || s.publisher.settled()).await;
    assert_eq!(summary(&s.writes()), Vec::<String>::new());
    assert_eq!(s.publisher.stats.failures.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn an_agent_that_stops_reporting_has_its_slices_deleted() {
    let s = scene().await;
    s.agent_says(pb::agent_message::Body::Snapshot(report(true, None)))
        .await;
    assert_eq!(ours(&s.api).len(), 1);
    let before = s.publisher.stats.looked.load(Ordering::Relaxed);
    // Its stream ends: nothing yet (the kubelet's plugin may well be
    // there; the agent is reconnecting).
    let id = s.fleet.with(NODE, |e| e.stream).unwrap();
    assert!(s.fleet.disconnect(NODE, id, "connection reset"));
    assert_eq!(ours(&s.api).len(), 1);
    // The grace after it ran out.
    s.fleet.expire(NODE, "the agent's stream ended");
    until("the slices deleted", || {
        s.publisher.stats.looked.load(Ordering::Relaxed) > before
            && s.publisher.settled()
            && ours(&s.api).is_empty()
    })
    .await;
}

#[tokio::test]
async fn an_unhealthy_gpu_changes_only_its_devices_taints() {
    let s = scene().await;
    s.agent_says(pb::agent_message::Body::Snapshot(report(true, None)))
        .await;
    let before = ours(&s.api);
    s.api.take();
    s.agent_says(pb::agent_message::Body::Change(pb::NodeReport {
        health: report(true, Some(48)).health,
        ..Default::default()
    }))
    .await;
    let r = s.writes();
    let name = dra::names::slice_name(NODE, 0);
    assert_eq!(
        summary(&r),
        [format!("PUT {SLICES}/{name}?&fieldManager=gpu-controller")]
    );
    // Written at the resourceVersion the watch had.
    assert_eq!(
        r[0].body["metadata"]["resourceVersion"],
        before[0]["metadata"]["resourceVersion"]
    );
    let after = ours(&s.api);
    check_pool(&after);
    assert_eq!(after[0]["spec"]["pool"]["generation"], 2);
    let devices = |s: &Value| s["spec"]["devices"].as_array().unwrap().clone();
    let (old, new) = (devices(&before[0]), devices(&after[0]));
    assert_eq!(old.len(), new.len());
    for (o, n) in old.iter().zip(&new) {
        let mut stripped = n.clone();
        let taints = stripped.as_object_mut().unwrap().remove("taints");
        assert_eq!(&stripped, o, "only the taints differ");
        if n["name"] == "gpu-0" {
            let t = taints.unwrap();
            assert_eq!(t[0]["key"], "gpu.nvidia.com/xid");
            assert_eq!(t[0]["value"], "48");
            assert_eq!(t[0]["effect"], "NoSchedule");
        } else {
            assert_eq!(taints, None, "{} is healthy", n["name"]);
        }
    }
    // The API's timeAdded is the server's: the same report again sends
    // nothing.
    s.agent_says(pb::agent_message::Body::Snapshot(report(true, Some(48))))
        .await;
    assert_eq!(summary(&s.writes()), Vec::<String>::new());
    // Healthy again: the taint goes.
    s.agent_says(pb::agent_message::Body::Snapshot(report(true, None)))
        .await;
    assert_eq!(summary(&s.writes()).len(), 1);
    let healed = ours(&s.api);
    assert_eq!(healed[0]["spec"]["pool"]["generation"], 3);
    assert_eq!(devices(&healed[0]), old);
}

#[tokio::test]
async fn a_stand_by_writes_nothing() {
    let (tx, rx) = tokio::sync::watch::channel(false);
    let s = scene_with(Some(rx)).await;
    s.api.take();
    s.agent_says(pb::agent_message::Body::Snapshot(report(true, None)))
        .await;
    assert_eq!(summary(&s.writes()), Vec::<String>::new());
    assert!(s.api.device_classes().is_empty());
    // Leading: the DeviceClasses are made; the node's next report is
    // published.
    tx.send_replace(true);
    until("the DeviceClasses made", || {
        s.api.device_classes().len() == 2
    })
    .await;
    s.agent_says(pb::agent_message::Body::Snapshot(report(true, None)))
        .await;
    assert_eq!(ours(&s.api).len(), 1);
}

#[tokio::test]
async fn device_classes_are_made_once_and_put_back_when_changed() {
    let api = MockApi::start().await;
    let publisher = Publisher::new(api.client());
    publisher.ensure_classes().await.unwrap();
    let r = api.take();
    assert_eq!(
        summary(&r),
        [
            "GET /apis/resource.k8s.io/v1/deviceclasses/gpu.nvidia.com",
            "POST /apis/resource.k8s.io/v1/deviceclasses?&fieldManager=gpu-controller",
            "GET /apis/resource.k8s.io/v1/deviceclasses/mig.nvidia.com",
            "POST /apis/resource.k8s.io/v1/deviceclasses?&fieldManager=gpu-controller",
        ]
    );
    let schemas = schema::load();
    for req in r.iter().filter(|r| r.method == "POST") {
        let errs = schema::check(
            &schemas,
            "io.k8s.api.resource.v1.DeviceClass",
            &req.body,
            false,
        );
        assert!(errs.is_empty(), "{}: {errs:?}", req.body);
    }
    let classes = api.device_classes();
    assert_eq!(classes[0]["spec"]["extendedResourceName"], "nvidia.com/gpu");
    assert_eq!(classes[1]["metadata"]["name"], "mig.nvidia.com");

    // Another start (another leader): read, nothing written.
    let publisher = Publisher::new(api.client());
    publisher.ensure_classes().await.unwrap();
    assert!(api.take().iter().all(|r| r.method == "GET"));
    assert_eq!(publisher.stats.class_writes.load(Ordering::Relaxed), 0);

    // Changed by hand: put back, its labels kept.
    let mut edited = classes[0].clone();
    edited["spec"]["extendedResourceName"] = json!("example.com/gpu");
    edited["metadata"]["labels"] = json!({"team": "ml"});
    api.add_device_class(edited);
    publisher.ensure_classes().await.unwrap();
    let r = api.take();
    assert_eq!(
        summary(&r)[1],
        "PUT /apis/resource.k8s.io/v1/deviceclasses/gpu.nvidia.com?&fieldManager=gpu-controller"
    );
    let now = &api.device_classes()[0];
    assert_eq!(now["spec"]["extendedResourceName"], "nvidia.com/gpu");
    assert_eq!(now["metadata"]["labels"]["team"], "ml");
    assert_eq!(publisher.stats.class_writes.load(Ordering::Relaxed), 1);
}

/// Sharded, every replica makes the DeviceClasses when it starts: two at
/// the same moment both find none and both create; the one refused with
/// 409 (made by the other meanwhile) has nothing to say about it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_making_the_device_classes_at_once_both_succeed() {
    for _ in 0..5 {
        let api = MockApi::start().await;
        let (a, b) = (Publisher::new(api.client()), Publisher::new(api.client()));
        let (ra, rb) = tokio::join!(a.ensure_classes(), b.ensure_classes());
        ra.unwrap();
        rb.unwrap();
        let classes = api.device_classes();
        assert_eq!(classes.len(), 2, "{classes:?}");
        let posts = api.take().iter().filter(|r| r.method == "POST").count();
        if posts > 2 {
            // The race happened (a create refused as made already) and
            // was taken as done.
            return;
        }
    }
    panic!("five rounds and never both creating at once: the race is not tested");
}
