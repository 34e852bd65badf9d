//! The passes over the stages: the first one (and the stages it leaves
//! until the device plugin registered), and the reconcile that follows,
//! which hands what it found to the running front ends.

use std::sync::Arc;
use std::time::Duration;

use hostlib::HostRoot;
use tokio::sync::watch;
use tokio::time::Instant;

use super::core::Supervisor;
use super::readiness::keep_since;
use super::tasks::KERNEL_LOG;
use crate::inventory::Inventory;
use crate::stages::{self, Context, Repair, Stage, StageState};
use crate::state;

/// The host-files lock for a pass, waited for while another process holds
/// it (its pid and what it does are logged). `None` when it cannot be
/// taken at all: the writers then take it (or fail) each on their own.
fn host_files_lock(host: &HostRoot, what: &str) -> Option<hostlib::managed::HostFilesLock> {
    hostlib::managed::HostFilesLock::take(host, what, true)
        .inspect_err(|e| tracing::warn!(error = %e, "cannot take the host-files lock for the pass"))
        .ok()
}

/// [`stages::LogMemory::news`]'s name for a reconcile without a device list.
const NO_DEVICE_LIST: &str = "no device list";

impl Supervisor {
    fn context(&self, policy_serve_first: bool) -> Context<'_> {
        let o = &self.opts;
        Context {
            policy: &o.policy,
            caps: &o.caps,
            sys: &o.view.sys,
            backend: o.view.backend.as_ref(),
            host: &o.host,
            apply: Some(&hostlib::command::SystemRunner),
            syscalls: &hostlib::LinuxSyscalls,
            simulated: o.view.simulated.is_some(),
            drain: None,
            serve_first: policy_serve_first,
            changes: Default::default(),
            mig_hold: None,
            upgrade: self.rollout.gate(self.controller_policy.is_some()),
            logged: Some(&self.logged),
        }
    }

    /// Where the pass found the node in the cluster's driver rollout: kept
    /// for the report; a go-ahead is spent once tried, a failure remembered.
    fn took_upgrade(&mut self, out: Option<crate::driver::UpgradeStatus>) {
        self.rollout.took(out.as_ref());
        self.st.upgrade = out;
    }

    pub(super) fn first_pass(&mut self) -> stages::Pass {
        let started = std::time::Instant::now();
        let host_files = host_files_lock(&self.opts.host, "the first pass");
        let ctx = self.context(!self.opts.once);
        let pass = stages::run_pass(&ctx);
        let upgrade = ctx.upgrade.out.take();
        drop(ctx);
        drop(host_files);
        self.took_upgrade(upgrade);
        self.st.mig = keep_mig_since(self.st.mig.take(), pass.mig.clone());
        self.st.stages = pass.stages.clone();
        self.st.inventory = pass.inventory.clone();
        crate::metrics::agent::pass_took(started.elapsed());
        tracing::debug!(ms = started.elapsed().as_secs_f64() * 1e3, "first pass");
        // With stages left for after the registration, the operator's files
        // wait for them (after_registration): judged now, the deferred
        // stages' "not run yet" would remove the files a restarted agent's
        // pods and the operator's tools rely on, only to write them again
        // milliseconds later.
        if pass.deferred.is_empty() {
            self.validation_files();
        }
        pass
    }

    /// The stages the first pass left until the device plugin registered:
    /// first what containers need (then allocations go ahead), then the
    /// rest (validation, labels). Under the host-files lock, as a pass.
    pub(super) fn after_registration(
        &mut self,
        inv: &Inventory,
        deferred: &[Stage],
        first: &[Stage],
    ) {
        let started = std::time::Instant::now();
        let host_files = host_files_lock(&self.opts.host, "the first pass (after registration)");
        let ctx = self.context(false);
        let mut stages_now = self.st.stages.clone();
        stages::run_deferred(&ctx, first, inv, &mut stages_now);
        if self.preparing.send_replace(None).is_some() {
            tracing::info!(
                stages = %first.iter().map(|s| s.name()).collect::<Vec<_>>().join(", "),
                "the node is ready for containers; allocations go ahead"
            );
        }
        let rest: Vec<Stage> = deferred
            .iter()
            .copied()
            .filter(|s| !first.contains(s))
            .collect();
        stages::run_deferred(&ctx, &rest, inv, &mut stages_now);
        drop(ctx);
        drop(host_files);
        self.st.stages = stages_now;
        tracing::debug!(
            ms = started.elapsed().as_secs_f64() * 1e3,
            "first pass, after registration"
        );
        self.validation_files();
    }

    pub(super) fn next_reconcile(&self) -> Option<Instant> {
        let secs = self.opts.policy.reconcile_interval_seconds;
        (secs > 0).then(|| Instant::now() + Duration::from_secs(secs))
    }

    /// Runs the stages again: each compares and repairs only what differs.
    /// With `reload`, the policy file is read first (an invalid one is
    /// logged and the running policy kept).
    pub(super) async fn reconcile(&mut self, trigger: &str, reload: bool) {
        let Some(policy_changed) = self.reload_policy(trigger, reload).await else {
            return;
        };
        let _span = tracing::info_span!("reconcile", trigger).entered();
        let started = std::time::Instant::now();
        let mig_hold = self
            .prepare_mig_change(trigger == "SIGHUP" || policy_changed)
            .await;
        // Not while another process changes host files (a driver upgrade):
        // the pass waits for it, and holds the lock to its end.
        let host_files = host_files_lock(&self.opts.host, &format!("reconcile ({trigger})"));
        let (mut pass, upgrade) = {
            let mut ctx = self.context(false);
            ctx.mig_hold = mig_hold;
            let pass = stages::run_pass(&ctx);
            (pass, ctx.upgrade.out.take())
        };
        drop(host_files);
        self.took_upgrade(upgrade);
        self.st.mig = keep_mig_since(self.st.mig.take(), pass.mig.take());
        let now = state::now();
        let plugin_state = pass
            .stages
            .iter()
            .find(|s| s.stage == Stage::Plugin)
            .map(|s| s.state);
        for s in std::mem::take(&mut pass.stages) {
            let Some(old) = self.st.stages.iter_mut().find(|o| o.stage == s.stage) else {
                continue;
            };
            // The plugin's and health's live states come from their tasks.
            let live = matches!(s.stage, Stage::Plugin | Stage::Health | Stage::Metrics)
                && s.state == StageState::Ready
                && matches!(old.state, StageState::Done | StageState::Waiting);
            let mut new = s;
            new.repairs = old.repairs;
            new.last_repair = old.last_repair.take();
            if !new.changed.is_empty() {
                let what = new.changed.join("; ");
                if policy_changed {
                    tracing::info!(stage = new.stage.name(), changed = %what, "applied the new policy");
                } else {
                    new.repairs += 1;
                    tracing::warn!(stage = new.stage.name(), repaired = %what, "drift repaired");
                    new.last_repair = Some(Repair { at: now, what });
                }
            }
            if live {
                old.repairs = new.repairs;
                old.last_repair = new.last_repair;
                old.changed = new.changed;
                old.needs = new.needs;
                old.missing = new.missing;
            } else {
                new.validation = keep_since(old.validation.take(), new.validation);
                *old = new;
            }
        }
        let conditions = pass
            .inventory
            .as_ref()
            .map(|i| crate::health::conditions(i, self.st.inventory.as_ref()));
        // A GPU NVML has lost stays what the front ends know (advertised,
        // and unhealthy by its condition) until NVML sees it again: no new
        // inventory, no new device list.
        let lost = pass
            .inventory
            .as_ref()
            .is_some_and(|i| !i.backend.lost.is_empty());
        if lost {
            pass.plugin = None;
        }
        // The front ends hear of a new inventory only when the node's GPUs
        // changed (not their temperatures).
        if let Some(inv) = pass.inventory.filter(|_| !lost) {
            let same = self
                .st
                .inventory
                .as_ref()
                .is_some_and(|old| same_node(old, &inv));
            if !same {
                tracing::info!("the node's GPUs changed");
                match &self.inventory {
                    Some(tx) => {
                        tx.send_replace(Arc::new(inv.clone()));
                    }
                    None => self.inventory = Some(watch::Sender::new(Arc::new(inv.clone()))),
                }
                self.st.inventory = Some(inv);
            }
        }
        self.health_policy.send_if_modified(|p| {
            let new = self.opts.policy.health.to_policy();
            if *p == new {
                false
            } else {
                *p = new;
                true
            }
        });
        // Said once while it lasts, not at every reconcile.
        let no_list = pass.plugin.is_none() && plugin_state != Some(StageState::Disabled);
        let no_list_news = self.logged.news(NO_DEVICE_LIST, no_list.then_some(""));
        match pass.plugin {
            Some(plan) => {
                let settings_changed = self
                    .plugin_plan
                    .as_ref()
                    .is_none_or(|old| old.settings != plan.settings)
                    || self.plugin_dir.as_deref()
                        != Some(self.opts.policy.host_paths.device_plugin_dir().as_str());
                let resources_changed = self
                    .plugin_plan
                    .as_ref()
                    .is_none_or(|old| old.resources != plan.resources);
                self.plugin_plan = Some(plan);
                // New MPS resources have their daemons before they are served.
                self.reconcile_mps().await;
                match &self.plugin {
                    Some(_) if settings_changed => {
                        // New allocation settings: served by a new plugin.
                        tracing::info!(
                            stage = "plugin",
                            "device-plugin settings changed; restarting the device plugin"
                        );
                        if let Some(p) = self.take_plugin() {
                            p.stop().await;
                        }
                        self.start_plugin();
                    }
                    Some(p) if resources_changed => {
                        let resources = self
                            .plugin_plan
                            .as_ref()
                            .map(|p| p.resources.clone())
                            .unwrap_or_default();
                        let _ = p.updater.send(resources);
                    }
                    Some(_) => {}
                    None => self.start_plugin(),
                }
            }
            None if plugin_state == Some(StageState::Disabled) => {
                if let Some(p) = self.take_plugin() {
                    tracing::info!(
                        stage = "plugin",
                        "the device plugin is turned off by the policy"
                    );
                    p.stop().await;
                }
                self.plugin_plan = None;
            }
            None => {
                // No plan this time (e.g. NVML did not answer): keep
                // advertising what was (health marks the devices), never
                // drop the node's capacity to zero for a passing failure.
                if self.plugin.is_some() && no_list_news {
                    tracing::warn!(
                        stage = "plugin",
                        "no device list this reconcile; the device plugin keeps the last one"
                    );
                }
            }
        }
        self.reconcile_mps().await;
        self.reconcile_dra().await;
        if self.health.is_none() {
            self.start_health();
        } else if let (Some(h), Some(c)) = (&self.health, conditions) {
            h.set_conditions(c);
        }
        // `spec.health.kernelLog` turned on or off by the new policy.
        if policy_changed {
            if self.opts.policy.health.kernel_log {
                self.start_kernel_log();
            } else if let Some(k) = self.kmsg.take() {
                k.abort();
                let t = self.tasks.entry(KERNEL_LOG).or_default();
                t.started = None;
                t.restart_at = None;
                t.last_error = Some("off: spec.health.kernelLog is false".into());
            }
        }
        self.reconcile_metrics();
        self.validation_files();
        crate::metrics::agent::pass_took(started.elapsed());
        tracing::debug!(ms = started.elapsed().as_secs_f64() * 1e3, "reconciled");
        // A container is started only when the runtime, CDI or driver
        // changed (or the policy did), not at every reconcile.
        let touched = self.st.stages.iter().any(|s| {
            matches!(
                s.stage,
                Stage::Driver | Stage::Devnodes | Stage::Runtime | Stage::Cdi
            ) && !s.changed.is_empty()
        });
        self.workload_check(touched || policy_changed).await;
    }
}

/// The new MIG status, keeping when it began if the layout and state did not change.
pub(super) fn keep_mig_since(
    old: Option<crate::mig::MigStatus>,
    new: Option<crate::mig::MigStatus>,
) -> Option<crate::mig::MigStatus> {
    match (old, new) {
        (Some(o), Some(mut n)) if o.layout == n.layout && o.state == n.state => {
            n.since = o.since;
            Some(n)
        }
        (_, n) => n,
    }
}

/// The same GPUs, MIG devices and driver (telemetry aside).
pub fn same_node(a: &Inventory, b: &Inventory) -> bool {
    let strip = |i: &Inventory| {
        let mut i = i.clone();
        for g in &mut i.gpus {
            g.telemetry = Default::default();
        }
        i
    };
    strip(a) == strip(b)
}
