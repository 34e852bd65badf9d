//! How the supervisor starts the health monitor ([`RunningHealth`]) and,
//! beside it, the kernel-log reader.

use super::core::Supervisor;
use super::health::RunningHealth;
use super::tasks::KERNEL_LOG;
use crate::health::kernel_log;
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
