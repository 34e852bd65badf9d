//! The health monitor as a supervised task: [`RunningHealth`] on the
//! backend's events, and beside it the kernel-log reader.

use std::sync::Arc;

use tokio::sync::{Notify, mpsc, oneshot, watch};

use crate::health::{HealthBoard, HealthMonitor, HealthPolicy, HealthView};
use crate::inventory::Inventory;
use crate::policy::Policy;

/// The health monitor and its sources.
#[derive(Debug)]
pub struct RunningHealth {
    pub(super) board: HealthBoard,
    pub(super) view: watch::Receiver<HealthView>,
    conditions: watch::Sender<crate::health::Conditions>,
    /// Where the monitor's events come from (the NVML watcher's, and the
    /// kernel log's).
    pub(super) events: mpsc::UnboundedSender<crate::backend::HealthEvent>,
    stop: Option<oneshot::Sender<()>>,
}

impl RunningHealth {
    /// Starts the monitor on `backend`'s events.
    pub fn start(
        backend: &dyn crate::backend::GpuBackend,
        policy: &Policy,
        inventory: watch::Receiver<Arc<Inventory>>,
        health_policy: watch::Receiver<HealthPolicy>,
        changed: Arc<Notify>,
        events: tokio::sync::broadcast::Sender<crate::health::EventRecord>,
    ) -> Result<Self, String> {
        let (tx, rx) = mpsc::unbounded_channel();
        backend
            .watch_health(tx.clone())
            .map_err(|e| e.to_string())?;
        let uuids = crate::health::watched_uuids(&inventory.borrow());
        let monitor = HealthMonitor::new(policy.health.to_policy(), uuids)
            .with_change_signal(changed)
            .with_events(events);
        let board = monitor.board();
        let view = monitor.subscribe();
        let conditions = watch::Sender::new(crate::health::conditions(&inventory.borrow(), None));
        let (stop, stopped) = oneshot::channel::<()>();
        let inputs = crate::health::Inputs {
            inventory: Some(inventory.clone()),
            policy: Some(health_policy),
            conditions: Some(conditions.subscribe()),
        };
        tokio::spawn(monitor.run(rx, inputs, async {
            let _ = stopped.await;
        }));
        Ok(RunningHealth {
            board,
            view,
            conditions,
            events: tx,
            stop: Some(stop),
        })
    }

    /// NVML's conditions (lost GPU, pending reset, thermal) at a reconcile.
    pub(super) fn set_conditions(&self, seen: crate::health::Conditions) {
        self.conditions.send_if_modified(|c| {
            if *c == seen {
                false
            } else {
                *c = seen;
                true
            }
        });
    }

    /// The live health of every GPU.
    pub fn board(&self) -> HealthBoard {
        self.board.clone()
    }

    /// The health the device plugin follows.
    pub fn view(&self) -> watch::Receiver<HealthView> {
        self.view.clone()
    }

    pub fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}
