//! The device plugin as a supervised task: [`RunningPlugin`], served in the
//! background, and how the supervisor starts, replaces and withdraws it.

use std::sync::Arc;
use std::time::Duration;

use hostlib::HostRoot;
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio::time::Instant;

use super::Supervisor;
use crate::health::HealthView;
use crate::inventory::Inventory;
use crate::plugin::manager::{self, PluginError, PluginManager, ResourceStatus, StatusBoard};
use crate::plugin::resources::Resource;
use crate::stages::{self, PluginPlan};
use crate::state::AgentState;

impl Supervisor {
    /// Takes the device plugin out, to stop or replace it: its
    /// registrations are carried over (the count never goes back), and
    /// `status` no longer shows its resources, whose sockets go with it.
    pub(super) fn take_plugin(&mut self) -> Option<RunningPlugin> {
        let p = self.plugin.take()?;
        for r in p.board.lock().unwrap().iter() {
            *self
                .registrations_before
                .entry(r.resource.clone())
                .or_default() += r.registrations;
        }
        self.st.plugin.clear();
        Some(p)
    }

    pub(super) fn start_plugin(&mut self) {
        // One that ended on its own is replaced.
        drop(self.take_plugin());
        let Some(plan) = self.plugin_plan.clone() else {
            return;
        };
        let Some(inv) = self.inventory.as_ref().map(|tx| tx.borrow().clone()) else {
            return;
        };
        let health = self.health.as_ref().map(|h| h.view.clone());
        let dir = self.opts.policy.host_paths.device_plugin_dir();
        // The kubelet makes its plugin directory; where it has not yet, we
        // make it, noted so that `gpu-agent uninstall` removes it again.
        if !manager::plugin_dir(&self.opts.host, &dir).is_ok_and(|d| d.is_dir())
            && let Err(e) =
                hostlib::managed::ManagedFiles::lock(&self.opts.host, &hostlib::LinuxSyscalls, true)
                    .and_then(|f| f.create_dir(&dir))
        {
            tracing::warn!(stage = "plugin", dir = %dir, error = %e, "cannot make the kubelet's plugin directory");
        }
        self.plugin_dir = Some(dir.clone());
        match RunningPlugin::start(
            &self.opts.host,
            &dir,
            plan,
            inv,
            self.changed.clone(),
            health,
            Some(self.preparing.subscribe()),
        ) {
            Ok(p) => {
                self.plugin = Some(p);
                self.task_started("plugin");
            }
            Err(e) => self.task_ended("plugin", Err(e.to_string())),
        }
    }

    /// Withdraws every resource from the kubelet (waiting up to 10 s for
    /// the unregistering); the next pass registers them again.
    pub(super) async fn stop_advertising(&mut self) {
        let Some(plugin) = &self.plugin else { return };
        let _ = plugin.updater.send(Vec::new());
        let deadline = Instant::now() + Duration::from_secs(10);
        while plugin.board.lock().unwrap().iter().any(|r| r.registered) && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The next pass registers the resources again.
        self.plugin_plan = None;
    }
}

/// The device plugin, served in the background.
#[derive(Debug)]
pub struct RunningPlugin {
    pub(super) board: StatusBoard,
    pub(super) updater: mpsc::UnboundedSender<Vec<Resource>>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), PluginError>>>,
}

impl RunningPlugin {
    /// Serves `plan` (devices' health from `health`, if given; allocations
    /// held while `preparing` says the node is not ready for containers).
    pub fn start(
        host: &HostRoot,
        dir: &str,
        plan: PluginPlan,
        inventory: Arc<Inventory>,
        changed: Arc<Notify>,
        health: Option<watch::Receiver<HealthView>>,
        preparing: Option<crate::plugin::server::Preparing>,
    ) -> Result<Self, PluginError> {
        let dir = manager::plugin_dir(host, dir).map_err(|e| PluginError::Dir {
            path: host.path().join(dir.trim_start_matches('/')),
            source: std::io::Error::other(e.to_string()),
        })?;
        let mut mgr = PluginManager::new(
            dir,
            plan.resources,
            inventory,
            Arc::new(plan.settings),
            host.clone(),
        )
        .with_change_signal(changed.clone());
        if let Some(h) = health {
            mgr = mgr.with_health(h);
        }
        if let Some(p) = preparing {
            mgr = mgr.with_preparing(p);
        }
        let board = mgr.board();
        let updater = mgr.updater();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let result = mgr
                .run(async {
                    let _ = stopped.await;
                })
                .await;
            changed.notify_one();
            result
        });
        Ok(RunningPlugin {
            board,
            updater,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// Resolves when the plugin task ends on its own.
    pub(super) async fn ended(&mut self) -> Result<(), String> {
        let Some(task) = self.task.as_mut() else {
            return std::future::pending().await;
        };
        let r = task.await;
        self.task = None;
        match r {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(e) => Err(format!("the task panicked or was cancelled: {e}")),
        }
    }

    /// Waits until every resource's first registration was answered
    /// (accepted or refused, within `limit`) and the kubelet listed the
    /// accepted ones' devices (within `list_grace` after that).
    pub(super) async fn first_attempts(
        &self,
        changed: &Notify,
        limit: Duration,
        list_grace: Duration,
    ) {
        let answered = |b: &[ResourceStatus]| {
            b.iter()
                .all(|r| r.registrations > 0 || r.last_error.is_some())
        };
        let listed = |b: &[ResourceStatus]| b.iter().all(|r| r.lists > 0 || r.last_error.is_some());
        for (done, wait) in [
            (&answered as &dyn Fn(&[ResourceStatus]) -> bool, limit),
            (&listed, list_grace),
        ] {
            let deadline = Instant::now() + wait;
            loop {
                let finished = self.task.as_ref().is_none_or(|t| t.is_finished());
                if done(&self.board.lock().unwrap()) || finished {
                    break;
                }
                tokio::select! {
                    _ = changed.notified() => {}
                    _ = tokio::time::sleep_until(deadline) => return,
                }
            }
        }
    }

    /// Copies the plugins' status into `st` (the demo's view).
    pub fn refresh(&self, st: &mut AgentState) {
        st.plugin = self.board.lock().unwrap().clone();
        stages::apply_plugin_status(&mut st.stages, &st.plugin);
    }

    /// Stops serving; the sockets are removed.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            match task.await {
                Ok(Err(e)) => tracing::error!(stage = "plugin", error = %e, "device plugin failed"),
                Err(e) => {
                    tracing::error!(stage = "plugin", error = %e, "device plugin task failed")
                }
                Ok(Ok(())) => {}
            }
        }
    }
}
