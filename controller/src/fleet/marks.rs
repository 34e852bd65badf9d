//! What a replica keeps of the driver rollout on each node that carries
//! any of it, sharded (`shared_rollout.rs` fills and reads it): plain data,
//! below the fleet.

use crate::model::node::Observed;
use crate::model::upgrade_notes::AgentFacts;
use crate::model::upgrade_state::NodeUpgrade;

/// What the API has of the rollout on one node (sharded), and the
/// leader's own word on it.
#[derive(Debug, Default)]
pub struct Marks {
    /// The node's `resourceVersion` this is known at.
    pub(super) rv: Option<u64>,
    /// Its holder's annotation: what its agent says.
    pub(super) facts: Option<AgentFacts>,
    /// Its conditions say its agent reports.
    pub(super) connected: bool,
    /// The leader's annotation (`Some(None)`: "no upgrade").
    pub(super) noted: Option<Option<NodeUpgrade>>,
    /// The step as the replicas take it: the annotation (or, without one,
    /// the label); on the leader, its own latest move.
    pub(super) upgrade: Option<NodeUpgrade>,
    /// The unreadable annotations last said, not said again.
    pub(super) bad: String,
}

/// Whether a node's conditions say its agent reports (the holder writes
/// them `AgentNotReporting` when it stops).
pub(super) fn agent_reports(seen: &Observed) -> bool {
    seen.conditions.iter().any(|(c, _)| {
        crate::model::node::CONDITIONS.contains(&c.kind) && c.reason != "AgentNotReporting"
    })
}

/// `Some(next)`, its `since` kept from `cur` when the step is the same.
pub(super) fn keep_since(
    cur: &Option<NodeUpgrade>,
    next: Option<NodeUpgrade>,
) -> Option<NodeUpgrade> {
    match (cur, next) {
        (Some(c), Some(mut n)) if c.step == n.step => {
            n.since = c.since;
            Some(n)
        }
        (_, n) => n,
    }
}

/// Moves `cur` to `next`; a step decided on an older view keeps the target
/// known (the agent's report filled it in meanwhile) where `next` has
/// none. Returns whether the step changed.
pub(super) fn move_step(cur: &mut Option<NodeUpgrade>, next: &Option<NodeUpgrade>) -> bool {
    let changed = cur.as_ref().map(|u| u.step) != next.as_ref().map(|u| u.step);
    let kept = cur.as_ref().map(|u| u.target.clone());
    *cur = next.clone();
    if let (Some(u), Some(t)) = (cur.as_mut(), kept)
        && u.target.is_empty()
    {
        u.target = t;
    }
    changed
}
