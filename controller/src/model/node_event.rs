//! What an agent told, or the controller did, that becomes a Kubernetes
//! Event about a node: a GPU health event, a repair of drift, a driver
//! upgrade's step or outcome. The fleet makes them; the events writer
//! (`events`) counts and writes them.

use gpu_agent_proto::report::v1 as pb;

/// Reasons whose Events are one per node however the words change (a
/// driver upgrade's steps).
pub const STEPS: &[&str] = &["DriverUpgrade"];
/// Reasons that are outcomes: never held back.
pub const OUTCOMES: &[&str] = &["DriverUpgradeDone", "DriverUpgradeFailed"];

/// What an agent told, or the controller did, that becomes an Event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeEvent {
    pub node: String,
    /// `Normal` or `Warning`.
    pub kind: &'static str,
    pub reason: &'static str,
    pub message: String,
}

impl NodeEvent {
    pub fn health(node: &str, e: &pb::HealthEvent) -> Self {
        let mut message = format!("{} on {}", e.reason, e.gpu_uuid);
        if !e.advice.is_empty() {
            message.push_str(&format!(": {}", e.advice));
        }
        NodeEvent {
            node: node.into(),
            kind: if e.unhealthy { "Warning" } else { "Normal" },
            reason: if e.unhealthy {
                "GPUUnhealthy"
            } else {
                "GPUHealthEvent"
            },
            message,
        }
    }

    pub fn repair(node: &str, r: &pb::Repair) -> Self {
        NodeEvent {
            node: node.into(),
            kind: "Normal",
            reason: "DriftRepaired",
            message: format!("{}: {}", r.stage, r.what),
        }
    }

    /// Never held back: a `Warning`, an upgrade's step or outcome.
    pub fn kept(&self) -> bool {
        self.kind == "Warning" || STEPS.contains(&self.reason) || OUTCOMES.contains(&self.reason)
    }
}
