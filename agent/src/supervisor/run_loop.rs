//! `gpu-agent run`: what it was asked for ([`Options`]), the start
//! (capabilities, the agent lock, the first pass) and the loop that serves
//! until SIGTERM/SIGINT, then stops every task.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::controller::remembered_cluster_policy;
use super::core::Supervisor;
use super::options::{Options, SupervisorError};
use super::readiness::{PLUGIN_READY, validation_file};
use super::reload::log_unacted;
use super::tasks::{METRICS, REPORT};
use super::{mps, policy_watch};
use crate::policy::Policy;
use crate::stages::{self, Stage, StageState};
use crate::state;

/// Policy file events within this time are one change (an editor writes a
/// file in several steps; a ConfigMap update is several renames).
const POLICY_SETTLE: Duration = Duration::from_millis(150);

/// Runs the agent until SIGTERM/SIGINT (or one pass with `once`). Returns
/// whether no stage failed (the last pass).
pub fn run(mut opts: Options) -> Result<bool, SupervisorError> {
    // Least privilege (caps.rs): only what the enabled stages use is kept,
    // before any other thread starts (capabilities belong to a thread) and
    // before any stage runs. A reload cannot have a dropped one back, so
    // with a controller the cluster's policy counts too: the last one it
    // sent, or (none remembered) what any policy may ask for.
    let remembered = opts
        .report
        .is_some()
        .then(|| remembered_cluster_policy(&opts.host))
        .flatten();
    let cluster = match (&opts.report, &remembered) {
        (None, _) => crate::caps::ClusterPolicy::NoController,
        (Some(_), Some(p)) => crate::caps::ClusterPolicy::Remembered(p),
        (Some(_), None) => crate::caps::ClusterPolicy::Unknown,
    };
    let (held, privileges) = crate::caps::restrict(&crate::caps::Setting {
        policy: &opts.policy,
        host_is_system: opts.host.is_system(),
        cluster,
    });
    opts.caps = held;
    // nvmlInit (10.7 ms on a real H100) runs beside what follows, on a
    // thread started now: it holds only the capabilities kept.
    opts.view.start_opening();
    // One agent per host; `status` knows it lives by this lock.
    let _lock = state::AgentLock::take(&opts.host)?;
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        host_root = %opts.host.path().display(),
        simulated = opts.view.simulated.as_deref().unwrap_or("no"),
        caps = %opts.caps.names().join(","),
        "gpu-agent starting"
    );
    log_unacted(&opts.policy);
    let mut sup = Supervisor::new(opts);
    sup.st.privileges = Some(privileges);
    if sup.opts.once {
        let pass = sup.first_pass();
        let ok = pass.ok();
        sup.st.stopped_at = Some(state::now());
        sup.sync_state();
        return Ok(ok);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("gpu-agent-worker")
        .enable_all()
        .build()
        .map_err(SupervisorError::Runtime)?;
    // The policy is watched before the first pass reads the host: a change
    // made meanwhile is not missed.
    let policy_watch = {
        let _guard = rt.enter();
        sup.opts
            .policy_path
            .as_deref()
            .and_then(|p| match policy_watch::PolicyWatch::new(p) {
                Ok(w) => Some(w),
                Err(e) => {
                    tracing::warn!(error = %e, "policy changes will be seen on SIGHUP only");
                    None
                }
            })
    };
    let pass = sup.first_pass();
    let ok = rt.block_on(sup.serve(pass, policy_watch))?;
    Ok(ok)
}

impl Supervisor {
    async fn serve(
        mut self,
        pass: stages::Pass,
        mut policy_watch: Option<policy_watch::PolicyWatch>,
    ) -> Result<bool, SupervisorError> {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).map_err(SupervisorError::Signals)?;
        let mut int = signal(SignalKind::interrupt()).map_err(SupervisorError::Signals)?;
        let mut hup = signal(SignalKind::hangup()).map_err(SupervisorError::Signals)?;
        if let Some(inv) = &pass.inventory {
            self.inventory = Some(watch::Sender::new(Arc::new(inv.clone())));
        }
        self.plugin_plan = pass.plugin.clone();
        // Allocations wait for what the first pass has yet to make.
        let before_allocation: Vec<Stage> = stages::BEFORE_ALLOCATION
            .into_iter()
            .filter(|s| pass.deferred.contains(s))
            .collect();
        if !before_allocation.is_empty() {
            let names: Vec<&str> = before_allocation.iter().map(|s| s.name()).collect();
            self.preparing.send_replace(Some(names.join(", ")));
        }
        // The device plugin follows the health monitor's view: it starts first.
        self.start_health();
        // MPS replicas are advertised once their daemons serve.
        self.reconcile_mps().await;
        self.start_plugin();
        self.start_dra();
        // What the pass found, for `status`, before anything waits.
        self.refresh();
        self.sync_state();
        // The kubelet hears from us first; then the rest of the first pass.
        if let Some(p) = &self.plugin {
            p.first_attempts(
                &self.changed,
                Duration::from_secs(1),
                Duration::from_millis(250),
            )
            .await;
            self.refresh();
            self.sync_state();
        }
        self.start_metrics();
        self.start_report();
        if let Some(inv) = pass.inventory.clone()
            && !pass.deferred.is_empty()
        {
            self.after_registration(&inv, &pass.deferred, &before_allocation);
        }
        self.workload_check(true).await;
        self.refresh();
        self.sync_state();
        // Changed between `main` reading it and the watch starting?
        let mut policy_due: Option<Instant> = match &self.opts.policy_path {
            Some(p) if Policy::from_file(p).ok().as_ref() != Some(&self.opts.policy) => {
                Some(Instant::now())
            }
            _ => None,
        };
        let mut next_reconcile = self.next_reconcile();
        let heartbeat = self.opts.heartbeat;
        let mut tick = tokio::time::interval(Duration::from_secs(heartbeat.max(1)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        // systemd's watchdog (WatchdogSec=): pinged from this loop only, so
        // a loop that hangs is restarted. No watchdog, no timer.
        let mut watchdog = self.systemd.ping_every().map(|every| {
            let mut i = tokio::time::interval(every);
            i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            i
        });
        loop {
            let beat = async {
                if heartbeat > 0 {
                    tick.tick().await;
                } else {
                    std::future::pending::<()>().await;
                }
            };
            let ping = async {
                match watchdog.as_mut() {
                    Some(i) => {
                        i.tick().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            let restart_due = self.tasks.values().filter_map(|t| t.restart_at).min();
            let at = |t: Option<Instant>| async move {
                match t {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            let policy_event = async {
                match policy_watch.as_mut() {
                    Some(w) => w.next().await,
                    None => std::future::pending().await,
                }
            };
            let plugin_ended = async {
                match self.plugin.as_mut() {
                    Some(p) => p.ended().await,
                    None => std::future::pending().await,
                }
            };
            let kmsg_ended = async {
                match self.kmsg.as_mut() {
                    Some(h) => h.await,
                    None => std::future::pending().await,
                }
            };
            let metrics_ended = async {
                match self.metrics.as_mut() {
                    Some(h) => h.await,
                    None => std::future::pending().await,
                }
            };
            let mps_ended = self.mps.ended();
            let dra_ended = async {
                match self.dra.as_mut() {
                    Some(d) => d.ended().await,
                    None => std::future::pending().await,
                }
            };
            let desired = async {
                match self.desired.as_mut() {
                    Some(rx) => rx.recv().await,
                    None => std::future::pending().await,
                }
            };
            let report_ended = async {
                match self.report_task.as_mut() {
                    Some(h) => h.await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = ping => {
                    self.systemd.ping();
                    continue;
                }
                _ = beat => {
                    if let Err(e) = self.file.stamp(&self.opts.host) {
                        tracing::warn!(error = %e, "cannot stamp the state file; `gpu-agent status` will think this agent hangs");
                    }
                    continue;
                }
                _ = self.changed.notified() => {}
                outcome = plugin_ended => self.task_ended("plugin", outcome),
                outcome = dra_ended => self.task_ended(super::dra::TASK, outcome),
                r = kmsg_ended => self.kernel_log_ended(r),
                (resource, why) = mps_ended => {
                    tracing::error!(task = mps::TASK, resource = %resource, "MPS control daemon stopped");
                    self.task_ended(mps::TASK, Err(why));
                }
                r = metrics_ended => {
                    self.metrics = None;
                    let outcome = match r {
                        Ok(o) => o,
                        Err(e) => Err(format!("the task panicked or was cancelled: {e}")),
                    };
                    self.task_ended(METRICS, outcome);
                }
                Some(d) = desired => {
                    self.controller_desired(d).await;
                    next_reconcile = self.next_reconcile();
                }
                r = report_ended => {
                    // It only ends by panicking: it reconnects on its own.
                    self.report_task = None;
                    self.report = None;
                    let why = match r {
                        Ok(()) => "stopped on its own".to_string(),
                        Err(e) => format!("the task panicked or was cancelled: {e}"),
                    };
                    self.task_ended(REPORT, Err(why));
                }
                _ = at(restart_due) => self.restart_due_tasks(),
                relevant = policy_event => {
                    if relevant {
                        policy_due = Some(Instant::now() + POLICY_SETTLE);
                    }
                    continue;
                }
                _ = at(policy_due) => {
                    policy_due = None;
                    self.reconcile("the policy file changed", true).await;
                    next_reconcile = self.next_reconcile();
                }
                _ = at(next_reconcile) => {
                    self.reconcile("interval", false).await;
                    next_reconcile = self.next_reconcile();
                }
                _ = hup.recv() => {
                    self.systemd.reloading();
                    self.reconcile("SIGHUP", true).await;
                    next_reconcile = self.next_reconcile();
                }
                _ = term.recv() => break,
                _ = int.recv() => break,
            }
            self.refresh();
            self.sync_state();
        }
        tracing::info!("gpu-agent stopping");
        self.systemd.stopping();
        if let Some(k) = self.kmsg.take() {
            k.abort();
        }
        if let Some(m) = self.metrics.take() {
            m.abort();
        }
        if let Some(r) = self.report_task.take() {
            r.abort();
        }
        if let Some(h) = self.health.take() {
            h.stop();
        }
        if let Some(p) = self.take_plugin() {
            p.stop().await;
        }
        if let Some(d) = self.dra.take() {
            d.stop().await;
        }
        // Claims' MPS daemons kept from a DRA run that could not start
        // again are told to quit too (not killed with the agent).
        if let Some(m) = self.dra_mps.daemons.take() {
            m.stop().await;
        }
        // No more replicas are handed out: the MPS daemons may quit.
        self.mps.stop_all(self.opts.view.backend.as_ref()).await;
        // The device plugin is gone with us: scripts waiting on it must not
        // think it serves.
        validation_file(&self.opts.host, PLUGIN_READY, None);
        self.st.stopped_at = Some(state::now());
        self.st.ready = false;
        self.sync_state();
        Ok(!self.st.stages.iter().any(|s| s.state == StageState::Failed))
    }
}
