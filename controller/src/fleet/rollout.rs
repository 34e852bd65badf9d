//! Each node's place in the driver rollout, as the fleet keeps it: the
//! ClusterPolicy's upgrade policy, the view the rollout plans from, and
//! the moves it makes (written to the node, told to its agent, said as an
//! Event).

use std::sync::atomic::Ordering;

use super::Fleet;
use crate::model::node_event::NodeEvent;
use crate::model::upgrade_plan::Seen;
use crate::model::upgrade_policy::UpgradePolicy;
use crate::model::upgrade_state::{NodeUpgrade, Step};

impl Fleet {
    /// The ClusterPolicy's upgrade policy (`None`: no ClusterPolicy).
    pub fn upgrade_policy(&self) -> Option<Result<UpgradePolicy, String>> {
        self.upgrade_policy.lock().unwrap().clone()
    }

    pub fn set_upgrade_policy(&self, p: Option<Result<UpgradePolicy, String>>) {
        let mut cur = self.upgrade_policy.lock().unwrap();
        if *cur != p {
            if let Some(Err(e)) = &p {
                tracing::warn!(error = %e, "the ClusterPolicy's upgrade policy cannot be used: no driver rollout");
            }
            *cur = p;
            self.upgrade_changed.notify_one();
        }
    }

    /// Every node with an agent's report or an upgrade state, by name, as
    /// the rollout sees it; sharded, the nodes of the other replicas too,
    /// from what the API has of them (shared_rollout.rs).
    pub fn upgrade_view(&self) -> Vec<Seen> {
        let nodes = self.nodes.lock().unwrap();
        let sharded = self.sharded();
        let mut v: Vec<Seen> = nodes
            .iter()
            .filter(|(name, _)| !sharded || self.owns(name))
            .filter(|(_, e)| e.hello.is_some() || e.upgrade.is_some())
            .map(|(name, e)| {
                let agent = e.report.upgrade.clone().unwrap_or_default();
                Seen {
                    node: name.clone(),
                    step: e.upgrade.clone(),
                    agent_state: agent.state,
                    agent_version: agent.driver_version,
                    agent_detail: agent.detail,
                    driver_version: e.driver_version(),
                    ready: e.ready(),
                    connected: e.live(),
                    reported: e.report.stages.is_some(),
                    unavailable: None,
                }
            })
            .collect();
        if sharded {
            self.marked_view(&nodes, &mut v);
        }
        v.sort_by(|a, b| a.node.cmp(&b.node));
        v
    }

    /// Moves a node's upgrade on: written to the node (label, condition),
    /// told to its agent, and said as an Event when the step changed.
    /// Sharded, the move is kept with the node's marks, and a node this
    /// replica does not hold is left to its holder (which takes the step
    /// once the rollout has written it to the node).
    pub fn set_upgrade(&self, node: &str, next: Option<NodeUpgrade>) {
        if self.sharded() {
            let changed = self.mark_upgrade(node, &next);
            if !self.owns(node) {
                let Some(step_changed) = changed else { return };
                self.upgrade_moves.fetch_add(1, Ordering::Relaxed);
                if step_changed {
                    match &next {
                        Some(u) => {
                            tracing::info!(node, state = u.step.label(), to = %u.target, detail = %u.detail, "driver upgrade state (for the node's replica)")
                        }
                        None => {
                            tracing::info!(
                                node,
                                "no driver upgrade wanted any more (for the node's replica)"
                            )
                        }
                    }
                }
                self.upgrade_changed.notify_one();
                return;
            }
        }
        self.set_upgrade_here(node, next);
    }

    /// [`Fleet::set_upgrade`] of a node this replica writes.
    pub(super) fn set_upgrade_here(&self, node: &str, next: Option<NodeUpgrade>) {
        self.bare_entry(node);
        let step_changed = self.with(node, |e| {
            let same = match (&e.upgrade, &next) {
                (Some(a), Some(b)) => {
                    a.step == b.step && a.target == b.target && a.detail == b.detail
                }
                (None, None) => true,
                _ => false,
            };
            if same {
                return None;
            }
            let changed = super::marks::move_step(&mut e.upgrade, &next);
            Self::fill_target(e);
            Some(changed)
        });
        let Some(step_changed) = step_changed else {
            return;
        };
        self.upgrade_moves.fetch_add(1, Ordering::Relaxed);
        if step_changed {
            match &next {
                Some(u) => {
                    tracing::info!(node, state = u.step.label(), to = %u.target, detail = %u.detail, "driver upgrade state");
                    let c = u.condition();
                    self.tell(NodeEvent {
                        node: node.into(),
                        kind: if u.step == Step::UpgradeFailed {
                            "Warning"
                        } else {
                            "Normal"
                        },
                        reason: match u.step {
                            Step::UpgradeFailed => "DriverUpgradeFailed",
                            Step::UpgradeDone => "DriverUpgradeDone",
                            _ => "DriverUpgrade",
                        },
                        message: c.message,
                    });
                }
                None => tracing::info!(node, "no driver upgrade wanted any more"),
            }
        }
        self.mark_dirty(node);
        self.send_desired(node);
        self.upgrade_changed.notify_one();
    }

    /// A state read back from the API by a new leader; one this replica
    /// already holds wins. Returns whether it was taken.
    pub fn recover_upgrade(&self, node: &str, up: NodeUpgrade) -> bool {
        let taken = self.with(node, |e| {
            if e.upgrade.is_some() {
                return false;
            }
            e.upgrade = Some(up);
            Self::fill_target(e);
            true
        });
        // The label is in the API already: nothing to write. The node is
        // written (and its agent told) once its agent reports.
        taken
    }
}
