//! Before a pass that changes the MIG layout of some GPUs: the state says
//! `pending`, those GPUs are no longer advertised, and the processes that
//! hold them are waited for.

use std::time::Duration;

use tokio::time::Instant;

use super::core::Supervisor;
use super::reconcile::keep_mig_since;
use crate::plugin::resources::Resource;
use crate::state;

impl Supervisor {
    /// Before a pass that changes the MIG layout of some GPUs: the state
    /// says `pending`, the device plugin stops advertising those GPUs (the
    /// kubelet sees their devices go, no stale capacity), and the processes
    /// holding them are waited for (`spec.migManager.gpuClientsTimeoutSeconds`).
    /// `Some(why)` when they are still held: the pass then does not apply.
    /// A layout whose apply failed (and was rolled back) is tried again only
    /// when `retry` (a new policy, SIGHUP), not at every interval.
    pub(super) async fn prepare_mig_change(&mut self, retry: bool) -> Option<String> {
        let plan = {
            let inv = self.st.inventory.as_ref()?;
            let control = self.opts.view.backend.mig_control()?;
            let (config, origin, layout) =
                crate::mig::selected(&self.opts.policy.mig_manager).ok()??;
            crate::mig::plan(control, inv, &config, &origin, &layout).ok()?
        };
        if plan.is_noop() {
            return None;
        }
        if !retry
            && let Some(m) = &self.st.mig
            && m.layout == plan.layout
            && m.state == crate::mig::MigConfigState::Failed
            && crate::mig::apply_failed(&m.detail)
        {
            return Some(format!(
                "it failed before and is tried again on a policy change or SIGHUP ({})",
                m.detail
            ));
        }
        tracing::info!(layout = %plan.layout, plan = %plan.summary(), "MIG layout change ahead");
        self.st.mig = keep_mig_since(
            self.st.mig.take(),
            Some(crate::mig::MigStatus {
                layout: plan.layout.clone(),
                state: crate::mig::MigConfigState::Pending,
                detail: plan.summary(),
                since: state::now(),
            }),
        );
        self.sync_state();
        let gone: std::collections::BTreeSet<&str> =
            plan.changing().map(|g| g.uuid.as_str()).collect();
        if let (Some(p), Some(plan_now)) = (&self.plugin, self.plugin_plan.as_mut()) {
            let keep: Vec<Resource> = plan_now
                .resources
                .iter()
                .map(|r| Resource {
                    devices: r
                        .devices
                        .iter()
                        .filter(|d| !gone.contains(d.gpu_uuid.as_str()))
                        .cloned()
                        .collect(),
                    ..r.clone()
                })
                .collect();
            let want: Vec<(String, usize)> = keep
                .iter()
                .filter(|r| !r.devices.is_empty())
                .map(|r| (r.name.clone(), r.devices.len()))
                .collect();
            tracing::info!(
                stage = "mig",
                gpus = gone.len(),
                "no longer advertising the GPUs whose layout changes"
            );
            plan_now.resources = keep.clone();
            let _ = p.updater.send(keep);
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let now: Vec<(String, usize)> = p
                    .board
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|r| (r.resource.clone(), r.devices))
                    .collect();
                if now == want || Instant::now() >= deadline {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            // The streams send the shorter lists on their own tasks.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let timeout = Duration::from_secs(self.opts.policy.mig_manager.gpu_clients_timeout_seconds);
        let deadline = Instant::now() + timeout;
        loop {
            let control = self.opts.view.backend.mig_control()?;
            let held = crate::mig::holders(control, &self.opts.host, &plan);
            if held.is_empty() {
                return None;
            }
            if Instant::now() >= deadline {
                return Some(crate::mig::holders_message(&held, timeout));
            }
            tracing::info!(stage = "mig", holders = %held.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "), "waiting for processes to leave the GPUs");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}
