//! A policy reload: the policy read again (file, defaults or the
//! cluster's), the device-plugin keys it does not act on named, and the GPUs
//! withdrawn first when it asks for another driver.

use super::core::Supervisor;
use crate::policy::Policy;

impl Supervisor {
    /// With `reload`, the policy is read again: the cluster's ClusterPolicy
    /// the controller sent, the policy file, or the defaults. `Some(whether
    /// it changed)`; `None` when no pass is to run (the policy is invalid, or
    /// only its file changed, not its meaning).
    pub(super) async fn reload_policy(&mut self, trigger: &str, reload: bool) -> Option<bool> {
        let mut policy_changed = false;
        // The policy from the file (or the defaults), with what the
        // controller asks for on top.
        let source = match (&self.controller_policy, &self.opts.policy_path, reload) {
            (_, _, false) => None,
            (Some(yaml), _, true) => {
                let origin = "the cluster's ClusterPolicy";
                let read = Policy::from_cluster_yaml(yaml, origin).map(|(p, ignored)| {
                    if !ignored.is_empty() && ignored != self.st.policy_ignored {
                        tracing::info!(keys = %ignored.join(", "), "ClusterPolicy keys gpu-agent does not use: left out");
                    }
                    self.st.policy_ignored = ignored;
                    p
                });
                Some((origin.to_string(), read))
            }
            (None, Some(path), true) => {
                self.st.policy_ignored.clear();
                Some((path.display().to_string(), Policy::from_file(path)))
            }
            (None, None, true) => {
                self.st.policy_ignored.clear();
                Some(("the defaults".to_string(), Ok(Policy::default())))
            }
        };
        self.st.policy_from_cluster = self.controller_policy.is_some();
        if let Some((path, read)) = source {
            match read.map(|p| self.with_controller(p)) {
                Ok(p) => {
                    self.st.policy_error = None;
                    policy_changed = p != self.opts.policy;
                    if !policy_changed && trigger != "SIGHUP" {
                        tracing::debug!("the policy file changed on disk, its meaning did not");
                        return None;
                    }
                    if policy_changed {
                        tracing::info!(policy = %path, "policy changed");
                        if crate::plugin::settings(&p.device_plugin, p.mig.strategy)
                            .map(|s| s.unacted)
                            .ok()
                            != crate::plugin::settings(
                                &self.opts.policy.device_plugin,
                                self.opts.policy.mig.strategy,
                            )
                            .map(|s| s.unacted)
                            .ok()
                        {
                            log_unacted(&p);
                        }
                        self.drain_for_driver_change(&p).await;
                        self.opts.policy = p;
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "the policy is invalid; keeping the running one");
                    self.st.policy_error = Some(e.to_string());
                    return None;
                }
            }
        }
        Some(policy_changed)
    }

    /// A new driver in the policy may mean an upgrade: stop advertising GPUs
    /// first (resources unregistered) and let the device plugin act on it
    /// before the pass blocks this thread.
    async fn drain_for_driver_change(&mut self, new: &Policy) {
        let old = &self.opts.policy;
        if !(new.driver.enabled && new.driver.bundle.is_some() && driver_source_changed(old, new)) {
            return;
        }
        // Under the cluster's rollout the GPUs stay advertised until the
        // controller's go-ahead.
        if self.controller_policy.is_some() {
            return;
        }
        self.stop_advertising().await;
    }
}

/// Names, once per policy, the device-plugin config's keys that gpu-agent
/// takes but does not act on: WARN where containers will miss what the key
/// asks for, INFO otherwise.
pub(super) fn log_unacted(policy: &Policy) {
    let Ok(settings) = crate::plugin::settings(&policy.device_plugin, policy.mig.strategy) else {
        return;
    };
    for u in &settings.unacted {
        if u.warn {
            tracing::warn!(key = %u.key, what_instead = %u.why, "device-plugin config key not acted on");
        } else {
            tracing::info!(key = %u.key, what_instead = %u.why, "device-plugin config key not acted on");
        }
    }
}

/// The driver the policy asks for is not the one it asked for before.
fn driver_source_changed(old: &Policy, new: &Policy) -> bool {
    let (a, b) = (&old.driver, &new.driver);
    (
        &a.bundle,
        &a.bundle_sha256,
        &a.version,
        &a.module_dir,
        a.use_open_kernel_modules,
    ) != (
        &b.bundle,
        &b.bundle_sha256,
        &b.version,
        &b.module_dir,
        b.use_open_kernel_modules,
    )
}
