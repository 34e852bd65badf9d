//! The health stream: the first list at once, a new complete list on every
//! change (health, the device list), a MIG device with its parent's health,
//! watchers independent of each other, nothing sent when nothing changed
//! but the refresh.

use std::collections::BTreeMap;

use tokio_stream::StreamExt;

use super::*;
use crate::claims::tests_support::{Node, gpu, inventory};

const NODE: &str = "node-a";

fn device(minor: u32, uuid: &str, gpu_uuid: &str) -> NodeDevice {
    NodeDevice {
        minor,
        uuid: uuid.to_string(),
        gpu_uuid: gpu_uuid.to_string(),
    }
}

/// `gpu-0` (GPU-a), `gpu-1` (GPU-b), and a MIG device of GPU-c.
fn table() -> BTreeMap<String, NodeDevice> {
    BTreeMap::from([
        ("gpu-0".to_string(), device(0, "GPU-a", "GPU-a")),
        ("gpu-1".to_string(), device(1, "GPU-b", "GPU-b")),
        (
            "gpu-2-mig-1g10gb-19-6".to_string(),
            device(2, "MIG-c1", "GPU-c"),
        ),
    ])
}

fn view(unhealthy: &[(&str, &str)]) -> HealthView {
    HealthView {
        unhealthy: unhealthy
            .iter()
            .map(|(u, w)| (u.to_string(), w.to_string()))
            .collect(),
    }
}

/// The sources' senders, and the service, with the stop flag's sender.
struct Fixture {
    devices: watch::Sender<BTreeMap<String, NodeDevice>>,
    health: watch::Sender<HealthView>,
    stop: watch::Sender<bool>,
    service: HealthService,
}

fn fixture() -> Fixture {
    let (devices, devices_rx) = watch::channel(table());
    let (health, health_rx) = watch::channel(HealthView::default());
    let (stop, stopping) = watch::channel(false);
    let service = HealthService::new(HealthSource::new(NODE, devices_rx, health_rx), stopping);
    Fixture {
        devices,
        health,
        stop,
        service,
    }
}

/// (device, health, message) of a message, checking the pool, the time
/// and the timeout of each device.
fn summary(r: &proto::NodeWatchResourcesResponse) -> Vec<(String, proto::HealthStatus, String)> {
    r.devices
        .iter()
        .map(|d| {
            let id = d.device.as_ref().unwrap();
            assert_eq!(id.pool_name, NODE);
            assert!(d.last_updated_time > 1_700_000_000, "{d:?}");
            assert_eq!(d.health_check_timeout_seconds, HEALTH_TIMEOUT_SECONDS);
            (id.device_name.clone(), d.health(), d.message.clone())
        })
        .collect()
}

fn healthy(name: &str) -> (String, proto::HealthStatus, String) {
    (
        name.to_string(),
        proto::HealthStatus::Healthy,
        String::new(),
    )
}

fn unhealthy(name: &str, why: &str) -> (String, proto::HealthStatus, String) {
    (
        name.to_string(),
        proto::HealthStatus::Unhealthy,
        why.to_string(),
    )
}

async fn next(s: &mut ReceiverStream<Item>) -> Vec<(String, proto::HealthStatus, String)> {
    let r = tokio::time::timeout(Duration::from_secs(5), s.next())
        .await
        .expect("a message within 5 s")
        .expect("the stream is open")
        .expect("a list, not an error");
    summary(&r)
}

/// Nothing arrives for `d` (with paused time: the runtime skips ahead).
async fn quiet_for(s: &mut ReceiverStream<Item>, d: Duration) {
    if let Ok(m) = tokio::time::timeout(d, s.next()).await {
        panic!("a message when nothing changed: {m:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn the_first_list_comes_at_once_complete_and_healthy() {
    let f = fixture();
    let mut s = f.service.watch();
    let first = tokio::time::timeout(Duration::from_millis(1), s.next())
        .await
        .expect("at once")
        .unwrap()
        .unwrap();
    assert_eq!(
        summary(&first),
        [
            healthy("gpu-0"),
            healthy("gpu-1"),
            healthy("gpu-2-mig-1g10gb-19-6")
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn an_unhealthy_gpu_sends_a_new_complete_list_with_the_reason_and_recovery_another() {
    let f = fixture();
    let mut s = f.service.watch();
    next(&mut s).await;
    f.health
        .send_replace(view(&[("GPU-b", "XID 79, from NVML")]));
    assert_eq!(
        next(&mut s).await,
        [
            healthy("gpu-0"),
            unhealthy("gpu-1", "XID 79, from NVML"),
            healthy("gpu-2-mig-1g10gb-19-6")
        ]
    );
    // A new reason is a change too.
    f.health
        .send_replace(view(&[("GPU-b", "double-bit ECC error")]));
    assert_eq!(
        next(&mut s).await[1],
        unhealthy("gpu-1", "double-bit ECC error")
    );
    f.health.send_replace(HealthView::default());
    assert_eq!(
        next(&mut s).await,
        [
            healthy("gpu-0"),
            healthy("gpu-1"),
            healthy("gpu-2-mig-1g10gb-19-6")
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_mig_device_has_its_parents_health() {
    let f = fixture();
    let mut s = f.service.watch();
    next(&mut s).await;
    f.health
        .send_replace(view(&[("GPU-c", "XID 48, from NVML")]));
    assert_eq!(
        next(&mut s).await,
        [
            healthy("gpu-0"),
            healthy("gpu-1"),
            unhealthy("gpu-2-mig-1g10gb-19-6", "its GPU GPU-c: XID 48, from NVML")
        ]
    );
    // A reason the monitor left empty still says which GPU.
    f.health.send_replace(view(&[("GPU-c", ""), ("GPU-a", "")]));
    let list = next(&mut s).await;
    assert_eq!(list[0], unhealthy("gpu-0", "GPU GPU-a is unhealthy"));
    assert_eq!(
        list[2],
        unhealthy("gpu-2-mig-1g10gb-19-6", "its GPU GPU-c is unhealthy")
    );
}

#[tokio::test(start_paused = true)]
async fn a_new_device_list_is_sent_whole() {
    let f = fixture();
    let mut s = f.service.watch();
    next(&mut s).await;
    f.health
        .send_replace(view(&[("GPU-a", "XID 79, from NVML")]));
    next(&mut s).await;
    let mut t = table();
    t.remove("gpu-1");
    t.insert("gpu-3".to_string(), device(3, "GPU-d", "GPU-d"));
    f.devices.send_replace(t);
    assert_eq!(
        next(&mut s).await,
        [
            unhealthy("gpu-0", "XID 79, from NVML"),
            healthy("gpu-2-mig-1g10gb-19-6"),
            healthy("gpu-3")
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn nothing_is_sent_when_nothing_changed_until_the_refresh() {
    let f = fixture();
    let mut s = f.service.watch();
    let first = next(&mut s).await;
    // A GPU that is no DRA device, and the same table again: no change.
    f.health
        .send_replace(view(&[("GPU-z", "XID 79, from NVML")]));
    f.devices.send_replace(table());
    quiet_for(&mut s, REFRESH - Duration::from_secs(1)).await;
    // The refresh: the same list, within the kubelet's timeout.
    assert_eq!(next(&mut s).await, first);
    assert!(REFRESH.as_secs() * 3 <= HEALTH_TIMEOUT_SECONDS.unsigned_abs());
    assert!(REFRESH.as_secs() * 2 < 30, "within a 1.34 kubelet's 30 s");
    // A change restarts the wait for the next refresh.
    tokio::time::sleep(REFRESH / 2).await;
    f.health
        .send_replace(view(&[("GPU-a", "XID 79, from NVML")]));
    assert_eq!(
        next(&mut s).await[0],
        unhealthy("gpu-0", "XID 79, from NVML")
    );
    quiet_for(&mut s, REFRESH - Duration::from_secs(1)).await;
    assert_eq!(
        next(&mut s).await[0],
        unhealthy("gpu-0", "XID 79, from NVML")
    );
}

#[tokio::test(start_paused = true)]
async fn two_watchers_each_get_the_stream_and_one_leaving_leaves_the_other() {
    let f = fixture();
    let mut a = f.service.watch();
    let mut b = f.service.watch();
    assert_eq!(next(&mut a).await, next(&mut b).await);
    f.health
        .send_replace(view(&[("GPU-a", "XID 79, from NVML")]));
    assert_eq!(
        next(&mut a).await[0],
        unhealthy("gpu-0", "XID 79, from NVML")
    );
    assert_eq!(
        next(&mut b).await[0],
        unhealthy("gpu-0", "XID 79, from NVML")
    );
    drop(a);
    f.health.send_replace(HealthView::default());
    assert_eq!(next(&mut b).await[0], healthy("gpu-0"));
    // A third comes and gets the list as it is now.
    let mut c = f.service.watch();
    assert_eq!(next(&mut c).await[0], healthy("gpu-0"));
    // a's task ended: b's, c's and the service's own receivers are left.
    tokio::time::timeout(Duration::from_secs(5), async {
        while f.health.receiver_count() != 3 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the task of the watcher that left ended");
}

#[tokio::test(start_paused = true)]
async fn a_watcher_that_reads_nothing_holds_up_no_one() {
    let f = fixture();
    let _idle = f.service.watch();
    let mut b = f.service.watch();
    next(&mut b).await;
    for i in 0..5 {
        f.health
            .send_replace(view(&[("GPU-a", &format!("XID {i}, from NVML"))]));
        assert_eq!(
            next(&mut b).await[0],
            unhealthy("gpu-0", &format!("XID {i}, from NVML"))
        );
    }
}

#[tokio::test(start_paused = true)]
async fn without_a_health_monitor_every_device_is_unknown() {
    let f = fixture();
    let mut s = f.service.watch();
    next(&mut s).await;
    drop(f.health);
    let unknown = |n: &str| {
        (
            n.to_string(),
            proto::HealthStatus::Unknown,
            NO_MONITOR.to_string(),
        )
    };
    let list = next(&mut s).await;
    assert_eq!(
        list,
        [
            unknown("gpu-0"),
            unknown("gpu-1"),
            unknown("gpu-2-mig-1g10gb-19-6")
        ]
    );
    // A new watcher: Unknown from the first list.
    assert_eq!(next(&mut f.service.watch()).await, list);
    // The device list still counts.
    f.devices.send_replace(BTreeMap::new());
    assert_eq!(next(&mut s).await, []);
}

#[tokio::test(start_paused = true)]
async fn stopping_ends_every_stream_saying_why() {
    let f = fixture();
    let mut a = f.service.watch();
    let mut b = f.service.watch();
    next(&mut a).await;
    f.stop.send_replace(true);
    for s in [&mut a, &mut b] {
        let mut statuses = Vec::new();
        while let Some(item) = s.next().await {
            if let Err(e) = item {
                statuses.push(e);
            }
        }
        assert_eq!(statuses.len(), 1, "{statuses:?}");
        assert_eq!(statuses[0].code(), tonic::Code::Unavailable);
        assert!(statuses[0].message().contains("gpu.nvidia.com"));
    }
    // A watcher after the stop gets the end at once.
    let mut late = f.service.watch();
    assert!(late.next().await.unwrap().is_err());
    assert!(late.next().await.is_none());
}

#[tokio::test(start_paused = true)]
async fn the_node_claims_device_table_drives_the_list() {
    let node = Node::new();
    let claims = node.open();
    let (health, health_rx) = watch::channel(HealthView::default());
    let (_stop, stopping) = watch::channel(false);
    let service = HealthService::new(HealthSource::from_claims(&claims, health_rx), stopping);
    let mut s = service.watch();
    assert_eq!(next(&mut s).await, [healthy("gpu-0"), healthy("gpu-1")]);
    // The same inventory again: nothing.
    claims.set_inventory(&inventory(vec![gpu(0, "GPU-a"), gpu(1, "GPU-b")]));
    quiet_for(&mut s, REFRESH - Duration::from_secs(1)).await;
    next(&mut s).await;
    // A GPU with MIG on: its MIG device replaces it and has its health.
    let mut mig_on = gpu(1, "GPU-b");
    mig_on.mig = Some(gpu_model::backend::MigMode {
        current: true,
        pending: true,
    });
    mig_on.mig_devices = vec![gpu_model::backend::MigDevice {
        index: 0,
        uuid: "MIG-b0".into(),
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
    health.send_replace(view(&[("GPU-b", "XID 79, from NVML")]));
    claims.set_inventory(&inventory(vec![gpu(0, "GPU-a"), mig_on]));
    // One list or two (health and table apart); the last is both.
    let mut list = next(&mut s).await;
    if list.len() == 2 && list[1].0 == "gpu-1" {
        list = next(&mut s).await;
    }
    assert_eq!(
        list,
        [
            healthy("gpu-0"),
            unhealthy("gpu-1-mig-1g10gb-19-6", "its GPU GPU-b: XID 79, from NVML")
        ]
    );
}

#[test]
fn device_states_name_every_device_in_order() {
    let states = device_states(&table(), Some(&view(&[("MIG-c1", "XID 94, from NVML")])));
    // An event on the MIG device itself (not only its GPU) counts too.
    assert_eq!(
        states
            .iter()
            .map(|s| (s.device.as_str(), s.health))
            .collect::<Vec<_>>(),
        [
            ("gpu-0", proto::HealthStatus::Healthy),
            ("gpu-1", proto::HealthStatus::Healthy),
            ("gpu-2-mig-1g10gb-19-6", proto::HealthStatus::Unhealthy)
        ]
    );
    assert_eq!(states[2].message, "XID 94, from NVML");
    let r = response(NODE, &states, 1_800_000_000);
    assert_eq!(r.devices.len(), 3);
    assert_eq!(r.devices[2].health, 2);
    assert_eq!(r.devices[2].last_updated_time, 1_800_000_000);
}
