//! A node's place in a driver rollout: NVIDIA's upgrade states ([`Step`],
//! kept in the node's `nvidia.com/gpu-driver-upgrade-state` label), the
//! state with its target and detail ([`NodeUpgrade`], which makes the
//! `GPUDriverUpgraded` condition), and why a node is out of service apart
//! from its upgrade ([`Unavailable`]). Pure: no API calls.

use std::time::Instant;

use k8s_openapi::api::core::v1::Node;

use crate::model::node::{Condition, UPGRADE_CONDITION, cut};

/// Whether a node was unschedulable before its upgrade began ("true": it
/// is left cordoned afterwards); set with the cordon, removed at the end.
pub const INITIAL_UNSCHEDULABLE: &str =
    "nvidia.com/gpu-driver-upgrade.node-initial-state.unschedulable";
/// Why a node is out of service apart from its upgrade.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unavailable {
    /// Its `Ready` condition is not `True`.
    NotReady,
    /// `spec.unschedulable`, set by someone else (not by a rollout).
    Cordoned,
}

impl Unavailable {
    pub fn as_str(self) -> &'static str {
        match self {
            Unavailable::NotReady => "NotReady",
            Unavailable::Cordoned => "cordoned",
        }
    }

    /// Of a Node object: `None` when it is in service (or nothing is
    /// known of its status).
    pub fn of(n: &Node) -> Option<Unavailable> {
        let not_ready = n
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
            .is_some_and(|c| c.status != "True");
        if not_ready {
            return Some(Unavailable::NotReady);
        }
        let unschedulable = n
            .spec
            .as_ref()
            .and_then(|s| s.unschedulable)
            .unwrap_or(false);
        // Our own cordon notes the node was schedulable before.
        let ours = annotation(n, INITIAL_UNSCHEDULABLE) == Some("false");
        (unschedulable && !ours).then_some(Unavailable::Cordoned)
    }
}

/// NVIDIA's per-node upgrade states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Step {
    UpgradeRequired,
    CordonRequired,
    WaitForJobsRequired,
    PodDeletionRequired,
    DrainRequired,
    ValidationRequired,
    UncordonRequired,
    UpgradeDone,
    UpgradeFailed,
}

impl Step {
    pub const ALL: [Step; 9] = [
        Step::UpgradeRequired,
        Step::CordonRequired,
        Step::WaitForJobsRequired,
        Step::PodDeletionRequired,
        Step::DrainRequired,
        Step::ValidationRequired,
        Step::UncordonRequired,
        Step::UpgradeDone,
        Step::UpgradeFailed,
    ];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            Step::UpgradeRequired => "upgrade-required",
            Step::CordonRequired => "cordon-required",
            Step::WaitForJobsRequired => "wait-for-jobs-required",
            Step::PodDeletionRequired => "pod-deletion-required",
            Step::DrainRequired => "drain-required",
            Step::ValidationRequired => "validation-required",
            Step::UncordonRequired => "uncordon-required",
            Step::UpgradeDone => "upgrade-done",
            Step::UpgradeFailed => "upgrade-failed",
        }
    }

    pub fn from_label(s: &str) -> Option<Step> {
        Step::ALL.into_iter().find(|st| st.label() == s)
    }

    /// Between the start of a node's upgrade and its end: the node is
    /// unavailable and counts against `maxParallelUpgrades`.
    pub fn in_progress(self) -> bool {
        matches!(
            self,
            Step::CordonRequired
                | Step::WaitForJobsRequired
                | Step::PodDeletionRequired
                | Step::DrainRequired
                | Step::ValidationRequired
                | Step::UncordonRequired
        )
    }

    /// The condition's reason (CamelCase).
    fn reason(self) -> &'static str {
        match self {
            Step::UpgradeRequired => "UpgradeRequired",
            Step::CordonRequired => "CordonRequired",
            Step::WaitForJobsRequired => "WaitForJobsRequired",
            Step::PodDeletionRequired => "PodDeletionRequired",
            Step::DrainRequired => "DrainRequired",
            Step::ValidationRequired => "ValidationRequired",
            Step::UncordonRequired => "UncordonRequired",
            Step::UpgradeDone => "UpgradeDone",
            Step::UpgradeFailed => "UpgradeFailed",
        }
    }
}

/// One node's place in a rollout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeUpgrade {
    pub step: Step,
    /// The driver version the node is being moved to.
    pub target: String,
    /// When this step began (its timeout counts from here; after a
    /// controller restart, from when the new leader read it back).
    pub since: Instant,
    /// What happened, in words (why it failed, what it waits for).
    pub detail: String,
}

impl NodeUpgrade {
    pub fn new(step: Step, target: &str, detail: impl Into<String>) -> Self {
        NodeUpgrade {
            step,
            target: target.to_string(),
            since: Instant::now(),
            detail: detail.into(),
        }
    }

    /// The `GPUDriverUpgraded` condition: `True` once done, else `False`
    /// with the step as reason and the detail as message.
    pub fn condition(&self) -> Condition {
        let status = if self.step == Step::UpgradeDone {
            "True"
        } else {
            "False"
        };
        let mut message = match self.step {
            Step::UpgradeDone => format!("driver {} validated", self.target),
            Step::UpgradeFailed => format!("upgrade to driver {} failed", self.target),
            s => format!("upgrading to driver {}: {}", self.target, s.label()),
        };
        if !self.detail.is_empty() {
            message.push_str(": ");
            message.push_str(&self.detail);
        }
        Condition {
            kind: UPGRADE_CONDITION,
            status,
            reason: self.step.reason().into(),
            message: cut(message),
        }
    }
}

/// A node's annotation, if it has it.
pub(crate) fn annotation<'a>(n: &'a Node, key: &str) -> Option<&'a str> {
    n.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn out_of_service_is_not_ready_or_cordoned_by_another() {
        let node = |ready: &str, unschedulable: bool, initial: Option<&str>| -> Node {
            let mut n = json!({
                "metadata": {"name": "n"},
                "spec": {"unschedulable": unschedulable},
                "status": {"conditions": [{"type": "Ready", "status": ready}]}
            });
            if let Some(v) = initial {
                n["metadata"]["annotations"] = json!({ INITIAL_UNSCHEDULABLE: v });
            }
            serde_json::from_value(n).unwrap()
        };
        assert_eq!(Unavailable::of(&node("True", false, None)), None);
        assert_eq!(
            Unavailable::of(&node("False", false, None)),
            Some(Unavailable::NotReady)
        );
        assert_eq!(
            Unavailable::of(&node("Unknown", true, None)),
            Some(Unavailable::NotReady)
        );
        assert_eq!(
            Unavailable::of(&node("True", true, None)),
            Some(Unavailable::Cordoned)
        );
        // Our own cordon (the node was schedulable before) is the upgrade's.
        assert_eq!(Unavailable::of(&node("True", true, Some("false"))), None);
        assert_eq!(
            Unavailable::of(&node("True", true, Some("true"))),
            Some(Unavailable::Cordoned)
        );
        // Nothing known of its status: not counted.
        let bare: Node = serde_json::from_value(json!({"metadata": {"name": "n"}})).unwrap();
        assert_eq!(Unavailable::of(&bare), None);
    }
}
