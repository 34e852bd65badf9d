//! How the supervisor keeps one MPS control daemon per MPS-shared resource
//! ([`MpsDaemons`]) as the task `mps`.

use super::core::Supervisor;
use super::mps::TASK;

impl Supervisor {
    /// The MPS daemons follow the device plugin's plan: one per MPS-shared
    /// resource (none on a simulated node, which has no MPS to run).
    pub(super) async fn reconcile_mps(&mut self) {
        let mut plans = match (&self.plugin_plan, &self.inventory) {
            (Some(plan), Some(inv)) => {
                crate::plugin::mps::plans(&plan.settings, &plan.resources, &inv.borrow())
            }
            _ => Vec::new(),
        };
        if self.opts.view.simulated.is_some() && !plans.is_empty() {
            tracing::debug!(
                task = TASK,
                "a simulated node runs no MPS control daemon; MPS replicas are advertised only"
            );
            plans.clear();
        }
        if plans.is_empty() && self.mps.is_empty() {
            return;
        }
        let backend = self.opts.view.backend.as_ref();
        if self.mps.update(plans, backend).await {
            self.task_started(TASK);
            self.mps.wait_started().await;
        }
        if self.mps.is_empty() {
            self.tasks.remove(TASK);
        }
    }

    /// After the backoff: the daemons that stopped start again.
    pub(super) fn restart_mps(&mut self) {
        if self.mps.start_missing(self.opts.view.backend.as_ref()) {
            self.task_started(TASK);
        }
    }
}
