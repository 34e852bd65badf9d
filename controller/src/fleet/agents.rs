//! What each node's agent is told down its stream (`Desired`: the MIG
//! layout its label names, the ClusterPolicy's text for it, the driver
//! version and the upgrade go-ahead), sent only when it changed.

use gpu_agent_proto::report::v1 as pb;

use super::{Fleet, NodeEntry};
use crate::model::policy_texts::PolicyTexts;
use crate::model::upgrade_state::Step;

impl Fleet {
    /// What the controller wants of the node, for its agent.
    pub(super) fn desired_of(e: &NodeEntry, policy: Option<&str>) -> pb::Desired {
        let up = e
            .upgrade
            .as_ref()
            .filter(|u| u.step != Step::UpgradeDone && !u.target.is_empty());
        pb::Desired {
            mig_layout: e.mig_label.clone().unwrap_or_default(),
            policy_yaml: policy.unwrap_or_default().to_string(),
            driver_version: up.map(|u| u.target.clone()).unwrap_or_default(),
            // Only while the controller waits for the agent to upgrade: a
            // failed node is not told to try again.
            upgrade_go_ahead: up.is_some_and(|u| u.step == Step::ValidationRequired),
            drain: false,
        }
    }

    /// The cluster's ClusterPolicy changed (or went): every agent is told.
    pub fn set_policy(&self, policy: Option<PolicyTexts>) {
        {
            let mut p = self.policy.lock().unwrap();
            if p.as_deref() == policy.as_ref() {
                return;
            }
            match &policy {
                Some(t) => {
                    tracing::info!(cluster_policy = %t.name, "sending the ClusterPolicy to the agents")
                }
                None => tracing::info!("no ClusterPolicy: agents keep their own policy"),
            }
            *p = policy.map(std::sync::Arc::new);
        }
        self.policy_changed.notify_one();
        for node in self.names() {
            self.send_desired(&node);
        }
    }

    /// Sends the node's agent what is wanted of it, if that changed.
    pub fn send_desired(&self, node: &str) {
        let policy = self
            .policy
            .lock()
            .unwrap()
            .as_ref()
            .map(|p| p.for_node(node));
        let msg = self.with(node, |e| {
            let want = Self::desired_of(e, policy.as_deref());
            if e.sent.as_ref() == Some(&want) {
                return None;
            }
            let down = e.down.clone()?;
            e.sent = Some(want.clone());
            Some((down, want))
        });
        if let Some((down, want)) = msg {
            tracing::info!(node, mig_layout = %want.mig_layout, driver = %want.driver_version, upgrade_go_ahead = want.upgrade_go_ahead, "telling the agent what is wanted");
            let msg = pb::ControllerMessage {
                seq: 0,
                body: Some(pb::controller_message::Body::Desired(want)),
            };
            // A full queue: the agent is not reading; its stream ends soon.
            if down.try_send(Ok(msg)).is_err() {
                tracing::warn!(node, "the agent does not read its stream");
            }
        }
    }

    /// The node's `nvidia.com/mig.config` label as the API has it now.
    pub fn set_mig_label(&self, node: &str, value: Option<String>) {
        let changed = self.with(node, |e| {
            let changed = e.mig_label != value;
            e.mig_label = value;
            changed
        });
        if changed {
            self.send_desired(node);
        }
    }

    /// Nodes whose `nvidia.com/mig.config` label is set.
    pub fn mig_labelled(&self) -> Vec<String> {
        let nodes = self.nodes.lock().unwrap();
        nodes
            .iter()
            .filter(|(_, e)| e.mig_label.is_some())
            .map(|(n, _)| n.clone())
            .collect()
    }
}
