use super::*;
use crate::test_support::inventory_of;

fn setup(policy: HealthPolicy) -> (HealthMonitor, Rx, Vec<String>) {
    let inv = inventory_of("t4-4");
    let uuids = watched_uuids(&inv);
    let m = HealthMonitor::new(policy, uuids.clone());
    let rx = Rx(m.subscribe(), uuids.clone());
    (m, rx, uuids)
}

/// The view, and the GPUs in order.
struct Rx(watch::Receiver<HealthView>, Vec<String>);

impl Rx {
    fn has_changed(&self) -> Result<bool, watch::error::RecvError> {
        self.0.has_changed()
    }
    fn mark_unchanged(&mut self) {
        self.0.mark_unchanged();
    }
}

fn health(rx: &Rx) -> Vec<bool> {
    let v = rx.0.borrow();
    rx.1.iter().map(|u| v.healthy(u)).collect()
}

#[test]
fn critical_xid_marks_one_gpu_and_it_recovers() {
    let (mut m, rx, uuids) = setup(HealthPolicy {
        recover_after: Some(Duration::from_secs(60)),
        ..HealthPolicy::default()
    });
    let t0 = Instant::now();
    m.apply(
        HealthEvent::Xid {
            uuid: uuids[1].clone(),
            xid: 79,
        },
        t0,
    );
    assert_eq!(health(&rx), [true, false, true, true]);
    let board = m.board().lock().unwrap().clone();
    assert_eq!(
        board
            .iter()
            .find(|g| g.uuid == uuids[1])
            .unwrap()
            .reason
            .as_deref(),
        Some("XID 79, from NVML")
    );
    let xid_of = |m: &HealthMonitor| {
        m.board()
            .lock()
            .unwrap()
            .iter()
            .find(|g| g.uuid == uuids[1])
            .unwrap()
            .xid
    };
    // The XID rides with its reason (DRA's gpu.nvidia.com/xid taint).
    assert_eq!(xid_of(&m), Some(79));
    assert_eq!(m.next_recovery(), Some(t0 + Duration::from_secs(60)));
    m.recover(t0 + Duration::from_secs(59));
    assert_eq!(health(&rx), [true, false, true, true]);
    // Another event restarts the quiet period.
    m.apply(
        HealthEvent::DoubleBitEcc {
            uuid: uuids[1].clone(),
        },
        t0 + Duration::from_secs(30),
    );
    m.recover(t0 + Duration::from_secs(61));
    assert_eq!(health(&rx), [true, false, true, true]);
    // The latest cause is the ECC error: no XID behind it.
    assert_eq!(xid_of(&m), None);
    assert_eq!(m.next_recovery(), Some(t0 + Duration::from_secs(90)));
    m.recover(t0 + Duration::from_secs(90));
    assert_eq!(health(&rx), [true; 4]);
    assert_eq!(m.next_recovery(), None, "nothing to wait for once healthy");
}

#[tokio::test(start_paused = true)]
async fn the_monitor_sleeps_until_the_recovery_is_due_and_not_before() {
    let (m, rx, uuids) = setup(HealthPolicy {
        recover_after: Some(Duration::from_secs(60)),
        ..HealthPolicy::default()
    });
    let (tx, events) = mpsc::unbounded_channel();
    let task = tokio::spawn(m.run(events, Inputs::default(), std::future::pending()));
    tx.send(HealthEvent::Xid {
        uuid: uuids[2].clone(),
        xid: 48,
    })
    .unwrap();
    tokio::task::yield_now().await;
    assert_eq!(health(&rx), [true, true, false, true]);
    tokio::time::sleep(Duration::from_secs(59)).await;
    assert_eq!(health(&rx), [true, true, false, true]);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(health(&rx), [true; 4]);
    drop(tx);
    task.await.unwrap();
}

#[test]
fn ignored_xids_change_nothing() {
    let (mut m, mut rx, uuids) = setup(HealthPolicy::default());
    rx.mark_unchanged();
    for xid in DEFAULT_IGNORED_XIDS {
        m.apply(
            HealthEvent::Xid {
                uuid: uuids[0].clone(),
                xid: *xid,
            },
            Instant::now(),
        );
    }
    assert!(!rx.has_changed().unwrap());
    assert_eq!(health(&rx), [true; 4]);
}

#[test]
fn policy_can_unignore_and_disable_recovery() {
    let (mut m, rx, uuids) = setup(HealthPolicy {
        ignored_xids: BTreeSet::new(),
        recover_after: None,
        ..HealthPolicy::default()
    });
    let t0 = Instant::now();
    m.apply(
        HealthEvent::Xid {
            uuid: uuids[0].clone(),
            xid: 13,
        },
        t0,
    );
    m.recover(t0 + Duration::from_secs(86_400));
    assert_eq!(health(&rx), [false, true, true, true]);
}

#[test]
fn failed_wait_blinds_every_gpu_until_nvml_answers() {
    let (mut m, rx, _) = setup(HealthPolicy::default());
    m.apply(
        HealthEvent::WaitFailed("NVML event wait: Unknown Error".into()),
        Instant::now(),
    );
    assert_eq!(health(&rx), [false; 4]);
    assert!(
        m.board()
            .lock()
            .unwrap()
            .iter()
            .all(|g| g.reason.as_deref() == Some("NVML event wait: Unknown Error"))
    );
    m.apply(HealthEvent::Answering, Instant::now());
    assert_eq!(health(&rx), [true; 4]);
}

#[test]
fn the_same_xid_from_nvml_and_the_kernel_log_is_one_event() {
    let (mut m, rx, uuids) = setup(HealthPolicy::default());
    let t0 = Instant::now();
    m.apply(
        HealthEvent::KernelXid {
            uuid: uuids[0].clone(),
            xid: 79,
            message: "GPU has fallen off the bus.".into(),
        },
        t0,
    );
    m.apply(
        HealthEvent::Xid {
            uuid: uuids[0].clone(),
            xid: 79,
        },
        t0 + Duration::from_millis(20),
    );
    assert_eq!(health(&rx), [false, true, true, true]);
    let board = m.board().lock().unwrap().clone();
    assert_eq!(board[0].events, 1, "{board:?}");
    assert!(board[0].reason.as_deref().unwrap().contains("kernel log"));
    // Later, the same XID again is a new event.
    m.apply(
        HealthEvent::Xid {
            uuid: uuids[0].clone(),
            xid: 79,
        },
        t0 + SAME_EVENT_WINDOW + Duration::from_secs(1),
    );
    assert_eq!(m.board().lock().unwrap()[0].events, 2);
}

#[test]
fn severities_by_policy_per_xid_and_per_kind() {
    let mut p = HealthPolicy::default();
    p.xids.insert(94, Severity::Log);
    p.xids.insert(13, Severity::Unhealthy);
    p.on.double_bit_ecc = Severity::Log;
    let (mut m, rx, uuids) = setup(p);
    let now = Instant::now();
    m.apply(
        HealthEvent::Xid {
            uuid: uuids[0].clone(),
            xid: 94,
        },
        now,
    );
    m.apply(
        HealthEvent::DoubleBitEcc {
            uuid: uuids[1].clone(),
        },
        now,
    );
    assert_eq!(health(&rx), [true; 4], "logged only");
    assert_eq!(m.board().lock().unwrap()[0].events, 1, "but counted");
    m.apply(
        HealthEvent::Xid {
            uuid: uuids[2].clone(),
            xid: 13,
        },
        now,
    );
    assert_eq!(
        health(&rx),
        [true, true, false, true],
        "13 made critical by xids"
    );
}

#[test]
fn a_pending_reset_holds_the_gpu_until_nvml_no_longer_reports_it() {
    let (mut m, rx, uuids) = setup(HealthPolicy {
        recover_after: Some(Duration::from_secs(60)),
        ..HealthPolicy::default()
    });
    let t0 = Instant::now();
    let mut seen = BTreeMap::new();
    seen.insert(
        uuids[3].clone(),
        BTreeSet::from([Condition::RetiredPagesPending, Condition::Thermal]),
    );
    m.conditions(&seen, t0);
    assert_eq!(health(&rx), [true, true, true, false]);
    assert_eq!(
        m.next_recovery(),
        None,
        "no recovery while the reset is pending"
    );
    m.recover(t0 + Duration::from_secs(3600));
    assert_eq!(health(&rx), [true, true, true, false]);
    // The same conditions again: nothing new.
    m.conditions(&seen, t0 + Duration::from_secs(10));
    assert_eq!(
        m.board().lock().unwrap()[3].events,
        2,
        "retired pages + thermal (logged)"
    );
    // Reset done: the quiet period starts now.
    let t1 = t0 + Duration::from_secs(4000);
    m.conditions(&BTreeMap::new(), t1);
    assert_eq!(m.next_recovery(), Some(t1 + Duration::from_secs(60)));
    m.recover(t1 + Duration::from_secs(60));
    assert_eq!(health(&rx), [true; 4]);
}

#[test]
fn gpus_that_appear_after_a_reload_are_watched() {
    let (mut m, rx, uuids) = setup(HealthPolicy::default());
    let new_gpu = "GPU-new-after-reload".to_string();
    m.apply(
        HealthEvent::Xid {
            uuid: new_gpu.clone(),
            xid: 79,
        },
        Instant::now(),
    );
    assert!(rx.0.borrow().healthy(&new_gpu), "not watched yet");
    let mut all = uuids.clone();
    all.push(new_gpu.clone());
    m.set_gpus(all);
    m.apply(
        HealthEvent::Xid {
            uuid: new_gpu.clone(),
            xid: 79,
        },
        Instant::now(),
    );
    assert!(!rx.0.borrow().healthy(&new_gpu));
    // A GPU gone from the inventory is dropped with its state.
    m.set_gpus(uuids[1..].to_vec());
    assert_eq!(m.board().lock().unwrap().len(), 3);
}

/// The board says a GPU is lost while NVML reports it so and it is
/// unhealthy (DRA's `gpu.nvidia.com/gpu-lost` taint comes from this, not
/// from the reason's words), and no longer once it recovered.
#[test]
fn a_lost_gpu_is_marked_lost_on_the_board_while_it_is() {
    let (mut m, rx, uuids) = setup(HealthPolicy {
        recover_after: Some(Duration::from_secs(60)),
        ..HealthPolicy::default()
    });
    let lost = |m: &HealthMonitor| -> Vec<bool> {
        let board = m.board().lock().unwrap().clone();
        uuids
            .iter()
            .map(|u| board.iter().find(|g| &g.uuid == u).unwrap().lost)
            .collect()
    };
    let t0 = Instant::now();
    let mut seen = BTreeMap::new();
    seen.insert(uuids[2].clone(), BTreeSet::from([Condition::Lost]));
    seen.insert(uuids[1].clone(), BTreeSet::from([Condition::Thermal]));
    m.conditions(&seen, t0);
    assert_eq!(health(&rx), [true, true, false, true]);
    assert_eq!(lost(&m), [false, false, true, false]);
    // Back on the bus: still unhealthy for the quiet period, not lost.
    m.conditions(&BTreeMap::new(), t0 + Duration::from_secs(10));
    assert_eq!(lost(&m), [false; 4]);
    m.recover(t0 + Duration::from_secs(70));
    assert_eq!(health(&rx), [true; 4]);
    assert_eq!(lost(&m), [false; 4]);
}
