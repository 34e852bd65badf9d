//! The cluster controller's side: its wishes (a MIG layout, the cluster's
//! policy, the driver go-ahead), that policy remembered on the host for the
//! next start, and the node report stream.

use std::sync::Arc;

use hostlib::HostRoot;
use tokio::sync::{mpsc, watch};

use super::core::Supervisor;
use super::report;
use super::tasks::REPORT;
use crate::policy::Policy;
use crate::state;

/// The last policy the controller sent, as remembered on the host; `None`
/// when there is none or it no longer parses (said in the log).
pub(super) fn remembered_cluster_policy(host: &HostRoot) -> Option<Policy> {
    let path = crate::caps::CLUSTER_POLICY_MEMORY;
    let text = host.read_to_string(path).ok()?;
    match Policy::from_cluster_yaml(&text, path) {
        Ok((p, _)) => Some(p),
        Err(e) => {
            tracing::warn!(file = path, error = %e, "the remembered cluster policy does not parse; capabilities any policy may need are kept");
            None
        }
    }
}

/// Remembers the controller's policy for the next start (its capabilities
/// are chosen before the controller can be asked); written only when it
/// changed.
fn remember_cluster_policy(host: &HostRoot, yaml: &str) {
    let path = crate::caps::CLUSTER_POLICY_MEMORY;
    if host.read_to_string(path).is_ok_and(|old| old == yaml) {
        return;
    }
    if let Err(e) = host.write_atomic(path, yaml.as_bytes(), 0o600) {
        tracing::warn!(file = path, error = %e, "cannot remember the cluster's policy; the next start keeps what any policy may need");
    }
}

impl Supervisor {
    /// `p` with what the controller asks of this node: its MIG layout
    /// (the node's `nvidia.com/mig.config` label) as `spec.migManager.default`.
    pub(super) fn with_controller(&self, mut p: Policy) -> Policy {
        if let Some(layout) = &self.controller_mig {
            p.mig_manager.default = Some(layout.clone());
        }
        p
    }

    /// The controller's wishes changed: the policy is worked out again and,
    /// if that changes it, reconciled.
    pub(super) async fn controller_desired(&mut self, d: gpu_agent_proto::report::v1::Desired) {
        let layout = (!d.mig_layout.is_empty()).then_some(d.mig_layout);
        let policy = (!d.policy_yaml.is_empty()).then_some(d.policy_yaml);
        if let Some(yaml) = &policy
            && Policy::from_cluster_yaml(yaml, "the cluster's ClusterPolicy").is_ok()
        {
            remember_cluster_policy(&self.opts.host, yaml);
        }
        let go_ahead =
            (d.upgrade_go_ahead && !d.driver_version.is_empty()).then_some(d.driver_version);
        let heard = self.rollout.hear(go_ahead.clone());
        if heard.go_ahead {
            // The GPUs are withdrawn before the modules go (whatever else
            // this message changes).
            tracing::info!(
                driver = go_ahead.as_deref().unwrap_or(""),
                "gpu-controller gives the go-ahead to upgrade the driver"
            );
            self.stop_advertising().await;
        }
        if layout == self.controller_mig && policy == self.controller_policy {
            if heard.go_ahead || heard.first {
                // A go-ahead, or the first word (driver changes were held
                // until the controller spoke): a pass.
                self.reconcile("the controller's word on the driver", false)
                    .await;
            }
            return;
        }
        if layout != self.controller_mig {
            tracing::info!(
                layout = layout.as_deref().unwrap_or("(none)"),
                "the controller selects a MIG layout"
            );
        }
        if policy != self.controller_policy {
            tracing::info!(
                "the controller {} the cluster's ClusterPolicy",
                if policy.is_some() {
                    "sends"
                } else {
                    "withdraws"
                }
            );
        }
        self.controller_mig = layout;
        self.controller_policy = policy;
        self.reconcile("the controller's settings", true).await;
    }

    /// Starts the report's check-ins with the controller, when one is
    /// configured. It runs for the agent's life: it retries on its own.
    pub(super) fn start_report(&mut self) {
        let Some(cfg) = self.opts.report.clone() else {
            return;
        };
        *self.link.lock().unwrap() = crate::report::ControllerLink {
            endpoint: cfg.endpoint.clone(),
            node_name: cfg.node_name.clone(),
            since: state::now(),
            ..Default::default()
        };
        let tx = watch::Sender::new(Arc::new(self.node_report()));
        let (desired_tx, desired_rx) = mpsc::unbounded_channel();
        self.desired = Some(desired_rx);
        let inputs = crate::report::client::Inputs {
            report: tx.subscribe(),
            events: self.events.subscribe(),
            link: self.link.clone(),
            changed: self.changed.clone(),
            desired: desired_tx,
            dra_claims: self.dra_feed_tx.clone(),
            check_now: self.report_now.clone(),
        };
        self.report = Some(tx);
        self.report_task = Some(tokio::spawn(crate::report::client::run(cfg, inputs)));
        self.task_started(REPORT);
    }

    /// The node as the report tells it now.
    fn node_report(&mut self) -> gpu_agent_proto::report::v1::NodeReport {
        let labels = match &self.st.inventory {
            Some(inv) if self.opts.policy.gfd.enabled => crate::labels::node_labels(
                inv,
                &self.opts.policy.device_plugin,
                self.opts.policy.mig.strategy,
            )
            .ok(),
            _ => Some(Default::default()),
        };
        if let Some(l) = labels {
            self.report_labels = l;
        }
        report::node_report(&self.st, &self.report_labels)
    }

    /// Hands the report task the node as it is now, if that changed; and
    /// the link's state to `status`.
    pub(super) fn publish_report(&mut self) {
        if self.opts.report.is_none() {
            return;
        }
        self.st.controller = Some(self.link.lock().unwrap().clone());
        if self.report.is_none() {
            return;
        }
        let now = self.node_report();
        if let Some(tx) = &self.report {
            tx.send_if_modified(|r| {
                if **r == now {
                    false
                } else {
                    *r = Arc::new(now);
                    true
                }
            });
        }
    }
}
