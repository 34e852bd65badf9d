//! The health monitor as a supervised task: [`RunningHealth`] on the
//! backend's events, and beside it the kernel-log reader.

use std::sync::Arc;

use tokio::sync::{Notify, mpsc, oneshot, watch};

use super::Supervisor;
use super::tasks::KERNEL_LOG;
use crate::health::{HealthBoard, HealthMonitor, HealthPolicy, HealthView, kernel_log};
use crate::inventory::Inventory;
use crate::policy::Policy;
use crate::stages::{Stage, StageState};

impl Supervisor {
    pub(super) fn start_health(&mut self) {
        let planned = self
            .st
            .stages
            .iter()
            .any(|s| s.stage == Stage::Health && s.state == StageState::Ready);
        let Some(inv) = self.inventory.as_ref() else {
            return;
        };
        if !planned {
            return;
        }
        match RunningHealth::start(
            self.opts.view.backend.as_ref(),
            &self.opts.policy,
            inv.subscribe(),
            self.health_policy.subscribe(),
            self.changed.clone(),
            self.events.clone(),
        ) {
            Ok(h) => {
                self.st.health = h.board.lock().unwrap().clone();
                self.health = Some(h);
                self.task_started("health");
                self.start_kernel_log();
            }
            Err(e) => {
                if let Some(s) = self.st.stages.iter_mut().find(|s| s.stage == Stage::Health) {
                    s.state = StageState::Failed;
                    s.detail = e.clone();
                }
            }
        }
    }

    /// Follows the kernel log (`spec.health.kernelLog`) beside the health
    /// monitor; a run that fails is started again like any task.
    pub(super) fn start_kernel_log(&mut self) {
        let Some(h) = &self.health else { return };
        let Some(inv) = &self.inventory else { return };
        if !self.opts.policy.health.kernel_log || self.kmsg.is_some() {
            return;
        }
        let recover_after = self.opts.policy.health.to_policy().recover_after;
        let since = self
            .kmsg_since
            .get_or_insert_with(|| kernel_log::Since::new(recover_after))
            .clone();
        self.kmsg = Some(tokio::spawn(kernel_log::follow(
            self.opts.host.clone(),
            inv.subscribe(),
            h.events.clone(),
            since,
        )));
        self.task_started(KERNEL_LOG);
    }

    /// The kernel-log reader ended: off for good (nothing to read here), or
    /// failed (started again with backoff).
    pub(super) fn kernel_log_ended(
        &mut self,
        r: Result<Result<kernel_log::Ended, String>, tokio::task::JoinError>,
    ) {
        self.kmsg = None;
        match r {
            Ok(Ok(ended)) => {
                let t = self.tasks.entry(KERNEL_LOG).or_default();
                t.started = None;
                if let kernel_log::Ended::Off(why) = ended {
                    t.last_error = Some(why);
                }
            }
            Ok(Err(e)) => self.task_ended(KERNEL_LOG, Err(e)),
            Err(e) => self.task_ended(
                KERNEL_LOG,
                Err(format!("the task panicked or was cancelled: {e}")),
            ),
        }
    }
}

/// The health monitor and its sources.
#[derive(Debug)]
pub struct RunningHealth {
    pub(super) board: HealthBoard,
    pub(super) view: watch::Receiver<HealthView>,
    conditions: watch::Sender<crate::health::Conditions>,
    /// Where the monitor's events come from (the NVML watcher's, and the
    /// kernel log's).
    events: mpsc::UnboundedSender<crate::backend::HealthEvent>,
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
