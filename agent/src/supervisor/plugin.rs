//! The device plugin as a supervised task: [`RunningPlugin`], served in the
//! background, and how the supervisor starts, replaces and withdraws it.

use std::sync::Arc;
use std::time::Duration;

use hostlib::HostRoot;
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio::time::Instant;

use crate::health::HealthView;
use crate::inventory::Inventory;
use crate::plugin::manager::{self, PluginError, PluginManager, ResourceStatus, StatusBoard};
use crate::plugin::resources::Resource;
use crate::stages::{self, PluginPlan};
use crate::state::AgentState;

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
