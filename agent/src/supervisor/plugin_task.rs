//! How the supervisor starts, replaces and withdraws the device plugin
//! ([`RunningPlugin`]).

use super::core::Supervisor;
use super::plugin::RunningPlugin;
use crate::plugin::manager::{self};
use std::time::Duration;
use tokio::time::Instant;

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
