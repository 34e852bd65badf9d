//! The report upward: what this node's agent tells the cluster controller
//! (`gpu-controller`) in check-ins (proto/report_v1.proto, `CheckIn`).
//!
//! The supervisor publishes the node as a [`NodeReport`] whenever what the
//! agent knows changes; the report task ([`client`]) checks in at once
//! with the sections that changed (the whole of it when the controller
//! does not have it), and the health events and repairs not acknowledged
//! yet, and otherwise on the controller's interval. The agent works fully without
//! a controller: the report is one more front end of the same state.

pub mod client;

use std::collections::BTreeMap;
use std::path::PathBuf;

use gpu_agent_proto::report::v1 as pb;
use serde::{Deserialize, Serialize};

/// Where the controller is and how the agent proves who it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReportConfig {
    /// `https://host:port`.
    pub endpoint: String,
    /// PEM file with the CA that signed the controller's certificate.
    pub ca_file: PathBuf,
    /// The name the controller's certificate must carry (default: the
    /// endpoint's host).
    pub server_name: Option<String>,
    /// The projected service-account token (audience `gpu-controller`),
    /// read again at every connect: the kubelet rotates it.
    pub token_file: PathBuf,
    /// The Kubernetes node this agent runs on.
    pub node_name: String,
    /// /proc/sys/kernel/random/boot_id, as read at start.
    pub boot_id: String,
    /// Unix seconds when the agent started.
    pub started_at: u64,
}

/// The report link, for `status` and the state file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControllerLink {
    pub endpoint: String,
    pub node_name: String,
    /// The last check-in was answered.
    pub connected: bool,
    /// Unix seconds since which `connected` holds.
    pub since: u64,
    /// Why the last check-in failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// Health events and repairs dropped (the buffer was full while the
    /// controller could not be reached), since the agent started.
    #[serde(default)]
    pub dropped_events: u64,
    /// Check-ins answered since the agent started.
    #[serde(default)]
    pub connects: u64,
    /// Health events and repairs waiting for the controller to take them.
    #[serde(default)]
    pub pending: u64,
    /// The interval the controller set, in seconds (0: not told yet).
    #[serde(default)]
    pub interval_s: u64,
    /// The replica the controller sent this node to (its shard's holder),
    /// when not the configured endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_by: Option<String>,
    /// What the controller last asked of this node (not acted on yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired: Option<String>,
}

impl ControllerLink {
    /// One line for `status`.
    pub fn summary(&self) -> String {
        let mut line = if self.connected {
            let mut l = format!(
                "{}: connected as node {} (since {}; checks in every {} s",
                self.endpoint, self.node_name, self.since, self.interval_s
            );
            if let Some(r) = &self.served_by {
                l.push_str(&format!(", through the replica {r}"));
            }
            l.push(')');
            l
        } else {
            format!("{}: not connected", self.endpoint)
        };
        if let Some(e) = &self.last_error
            && !self.connected
        {
            line.push_str(&format!(": {e}"));
        }
        if self.pending > 0 {
            line.push_str(&format!(
                "; {} health event(s) or repair(s) waiting",
                self.pending
            ));
        }
        if self.dropped_events > 0 {
            line.push_str(&format!(
                "; {} health events dropped while disconnected",
                self.dropped_events
            ));
        }
        line
    }
}

/// The sections of `new` that differ from `old` (`None`: nothing changed).
pub fn changes(old: &pb::NodeReport, new: &pb::NodeReport) -> Option<pb::NodeReport> {
    fn part<T: Clone + PartialEq>(old: &Option<T>, new: &Option<T>) -> Option<T> {
        (old != new).then(|| new.clone()).flatten()
    }
    let c = pb::NodeReport {
        inventory: part(&old.inventory, &new.inventory),
        stages: part(&old.stages, &new.stages),
        labels: part(&old.labels, &new.labels),
        health: part(&old.health, &new.health),
        mig: part(&old.mig, &new.mig),
        upgrade: part(&old.upgrade, &new.upgrade),
        policy: part(&old.policy, &new.policy),
        dra: part(&old.dra, &new.dra),
    };
    (c != pb::NodeReport::default()).then_some(c)
}

/// Repairs made between `old` and `new` (a stage whose repair count grew).
pub fn repairs(old: &pb::NodeReport, new: &pb::NodeReport) -> Vec<pb::Repair> {
    let before: BTreeMap<&str, u64> = old
        .stages
        .iter()
        .flat_map(|s| &s.stages)
        .map(|s| (s.name.as_str(), s.repairs))
        .collect();
    new.stages
        .iter()
        .flat_map(|s| &s.stages)
        .filter(|s| s.repairs > before.get(s.name.as_str()).copied().unwrap_or(0))
        .map(|s| pb::Repair {
            stage: s.name.clone(),
            what: s.last_repair.clone(),
            at_unix: s.last_repair_at,
        })
        .collect()
}

/// This node's name as Kubernetes knows it: `NODE_NAME` (the DaemonSet sets
/// it from `spec.nodeName`), else the kernel's hostname.
pub fn node_name() -> String {
    std::env::var("NODE_NAME")
        .ok()
        .filter(|n| !n.is_empty())
        .or_else(|| {
            nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(ready: bool, repairs: u64) -> pb::NodeReport {
        pb::NodeReport {
            stages: Some(pb::Stages {
                stages: vec![pb::Stage {
                    name: "devnodes".into(),
                    state: "done".into(),
                    repairs,
                    last_repair: "created /dev/nvidia5".into(),
                    last_repair_at: 7,
                    ..Default::default()
                }],
                ready,
            }),
            labels: Some(pb::Labels {
                labels: [("nvidia.com/gpu.count".to_string(), "8".to_string())].into(),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_change_carries_only_the_sections_that_differ() {
        let a = report(false, 0);
        assert_eq!(changes(&a, &a), None);
        let b = report(true, 0);
        let c = changes(&a, &b).expect("stages changed");
        assert_eq!(c.stages, b.stages);
        assert_eq!(c.labels, None, "labels did not change");
        assert_eq!(c.inventory, None);
    }

    #[test]
    fn a_grown_repair_count_is_a_repair() {
        let a = report(true, 0);
        let b = report(true, 1);
        assert_eq!(
            repairs(&a, &b),
            vec![pb::Repair {
                stage: "devnodes".into(),
                what: "created /dev/nvidia5".into(),
                at_unix: 7
            }]
        );
        assert!(repairs(&b, &b).is_empty());
    }
}
