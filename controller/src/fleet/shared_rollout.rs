//! The driver rollout when the nodes are sharded over the replicas
//! (`--shards`): the one leader plans it for every node, each node's
//! holder applies it to its node and agent, through two annotations
//! (`model::upgrade_notes`), nothing else between the replicas.
//!
//! - A holder publishes its agents' word on the rollout with each node's
//!   labels ([`Fleet::agent_facts`], in [`Fleet::wanted`]).
//! - Every replica keeps, from the watch of the nodes
//!   ([`Fleet::note_rollout`]), what the API has of the rollout on each
//!   node that carries any of it (`marks.rs`): bounded by the nodes in a
//!   rollout, as a node at `upgrade-done` whose agent has nothing more to
//!   say is not kept (nor its agent's word published) but by its name (a
//!   replica that takes its shard over keeps its label), so a quiet fleet
//!   costs a name a node, however many rollouts it went through. The leader
//!   counts the GPU nodes it keeps nothing of from its list of the nodes
//!   (`upgrade::Upgrader`). The leader plans from it for
//!   the nodes it does not hold ([`Fleet::upgrade_view`]), and a new
//!   leader has it at once.
//! - The leader's moves of a node it does not hold are kept here, not
//!   written to the node's labels nor told to an agent it does not serve
//!   ([`Fleet::set_upgrade`]); the rollout writes them to the node
//!   ([`Fleet::unpublished_steps`]), and the holder, seeing them in its
//!   watch, takes them as its own ([`Fleet::note_rollout`]): label,
//!   condition, go-ahead and Event stay the holder's.

use gpu_agent_proto::report::v1 as pb;

use super::marks::{agent_reports, keep_since, move_step};
use super::{Fleet, NodeEntry};
use crate::model::node::{Observed, UPGRADE_STATE_LABEL};
use crate::model::upgrade_notes::{
    AGENT_UPGRADE, AgentFacts, NoteError, UPGRADE_STEP, decode_step, same_step,
};
use crate::model::upgrade_plan::Seen;
use crate::model::upgrade_state::{NodeUpgrade, Step};

/// An agent's upgrade state that asks nothing of the rollout: none, or
/// done.
fn quiet_agent(state: &str) -> bool {
    state.is_empty() || state == "upgrade-done"
}

impl Fleet {
    /// Whether the nodes are spread over replicas.
    pub fn sharded(&self) -> bool {
        self.owner.is_some()
    }

    /// Sharded, the replica that plans the rollout is told by `leader`.
    pub fn with_rollout_leader(mut self, leader: tokio::sync::watch::Receiver<bool>) -> Self {
        self.rollout_leader = Some(leader);
        self
    }

    fn leads_rollout(&self) -> bool {
        self.rollout_leader.as_ref().is_some_and(|l| *l.borrow())
    }

    /// The step a new entry of `node` starts with: what the API has (or
    /// the leader decided) of it, for a node of this replica's; done for
    /// a quiet node labelled done.
    pub(super) fn marked_step(&self, node: &str) -> Option<NodeUpgrade> {
        if !self.sharded() || !self.owns(node) {
            return None;
        }
        if let Some(m) = self.marks.lock().unwrap().get(node) {
            return m.upgrade.clone();
        }
        self.quiet_done
            .lock()
            .unwrap()
            .contains(node)
            .then(|| NodeUpgrade::new(Step::UpgradeDone, "", ""))
    }

    /// Sharded: what the node's agent says of the rollout, for the node's
    /// annotation; `None` where nothing is to be said (no upgrade state
    /// reported, no step; or the node done and its agent saying so).
    pub(super) fn agent_facts(e: &NodeEntry) -> Option<AgentFacts> {
        let up = e.report.upgrade.clone().unwrap_or_default();
        let done = e
            .upgrade
            .as_ref()
            .is_none_or(|u| u.step == Step::UpgradeDone);
        if done && quiet_agent(&up.state) {
            return None;
        }
        let pb::UpgradeState {
            state,
            driver_version: version,
            detail,
        } = up;
        Some(AgentFacts {
            state,
            version,
            detail,
            driver: e.driver_version(),
            ready: e.ready(),
        })
    }

    /// Sharded: the node as the watch (or a list) has it. What it carries
    /// of the rollout is kept (nothing for a node that carries none); a
    /// node of this replica's takes the leader's step, unless this replica
    /// leads (its own moves are the step). An annotation that cannot be
    /// read is said once, with the node's name, and left aside.
    pub fn note_rollout(&self, node: &str, seen: &Observed) {
        if !self.sharded() {
            return;
        }
        let label = seen
            .labels
            .get(UPGRADE_STATE_LABEL)
            .and_then(|v| Step::from_label(v));
        let facts_text = seen.annotations.get(AGENT_UPGRADE);
        let step_text = seen.annotations.get(UPGRADE_STEP);
        let leads = self.leads_rollout();
        let mut bad: Vec<NoteError> = Vec::new();
        let facts =
            facts_text.and_then(|t| AgentFacts::decode(node, t).map_err(|e| bad.push(e)).ok());
        let noted = step_text.and_then(|t| decode_step(node, t).map_err(|e| bad.push(e)).ok());
        // Nothing of a rollout (any more): no marks, or only a rollout's
        // end (done, its agent saying nothing more).
        let done = |s: Option<Step>| s.is_none_or(|s| s == Step::UpgradeDone);
        let quiet = bad.is_empty()
            && done(label)
            && noted
                .as_ref()
                .is_none_or(|n| n.as_ref().is_some_and(|u| u.step == Step::UpgradeDone))
            && facts.as_ref().is_none_or(|f| quiet_agent(&f.state));
        let take = {
            let mut marks = self.marks.lock().unwrap();
            // An older event than the one known changes nothing, not even
            // takes the marks away.
            if let (Some(at), Some(known)) = (seen.rv, marks.get(node).and_then(|m| m.rv))
                && at < known
            {
                return;
            }
            if quiet {
                if marks.remove(node).is_some() {
                    self.upgrade_changed.notify_one();
                }
                let mut quiet_done = self.quiet_done.lock().unwrap();
                if label.is_some() {
                    if !quiet_done.contains(node) {
                        quiet_done.insert(node.into());
                    }
                } else {
                    quiet_done.remove(node);
                }
                drop(quiet_done);
                drop(marks);
                // Its holder keeps its label (done) as a new one reads it.
                if label.is_some() && self.owns(node) {
                    self.recover_upgrade(node, NodeUpgrade::new(Step::UpgradeDone, "", ""));
                }
                return;
            }
            self.quiet_done.lock().unwrap().remove(node);
            let new = !marks.contains_key(node);
            let m = marks.entry(node.to_string()).or_default();
            m.rv = seen.rv.or(m.rv);
            let said: String = bad.iter().map(|e| e.text.as_str()).collect();
            if said == m.bad {
                bad.clear();
            }
            m.bad = said;
            let connected = agent_reports(seen);
            let moved = new || m.facts != facts || m.connected != connected;
            m.facts = facts;
            m.connected = connected;
            let api_step = match &noted {
                Some(s) => s.clone(),
                None => label.map(|s| NodeUpgrade::new(s, "", "")),
            };
            if !leads || new {
                m.upgrade = keep_since(&m.upgrade, api_step.clone());
            }
            // Only a new word of the leader's is taken: the same annotation
            // seen again (a demoted leader's own node, whose label went
            // ahead of its annotation) does not put the node's step back.
            let noted_moved = new
                || match (&m.noted, &noted) {
                    (Some(a), Some(b)) => !same_step(a.as_ref(), b.as_ref()),
                    (None, None) => false,
                    _ => true,
                };
            m.noted = noted.clone();
            if moved {
                self.upgrade_changed.notify_one();
            }
            // The holder takes the leader's step; without one, the label
            // (as a new leader reads it back). The leader keeps its own,
            // and gives a node of its own without one what it last moved
            // it to (or what the API had when it first saw it).
            match (self.owns(node), leads, noted) {
                (true, false, Some(step)) if noted_moved => Some((step, true)),
                (true, false, Some(_)) => None,
                (true, false, None) => api_step.map(|s| (Some(s), false)),
                (true, true, _) => m.upgrade.clone().map(|s| (Some(s), false)),
                (false, _, _) => None,
            }
        };
        for e in bad {
            tracing::warn!(node, error = %e, "a node's driver rollout annotation cannot be read: left aside");
        }
        match take {
            Some((step, true)) => self.take_step(node, step),
            Some((Some(step), false)) => {
                self.recover_upgrade(node, step);
            }
            _ => {}
        }
    }

    /// The leader's step for a node of this replica's, taken as its own
    /// (written to the node, told to its agent, said as an Event), unless
    /// it says what the node has already (an empty target: the one the
    /// agent's report filled in).
    fn take_step(&self, node: &str, step: Option<NodeUpgrade>) {
        self.bare_entry(node);
        let next = self.with(node, |e| {
            let same = match (&e.upgrade, &step) {
                (Some(a), Some(b)) => {
                    a.step == b.step
                        && a.detail == b.detail
                        && (b.target.is_empty() || a.target == b.target)
                }
                (None, None) => true,
                _ => false,
            };
            (!same).then(|| keep_since(&e.upgrade, step))
        });
        if let Some(next) = next {
            self.set_upgrade_here(node, next);
        }
    }

    /// An entry for `node`, made without a step if it has none: a step
    /// applied to it is news (an entry made from the marks would take the
    /// step as known, and its Event, write and go-ahead would not come).
    pub(super) fn bare_entry(&self, node: &str) {
        self.nodes
            .lock()
            .unwrap()
            .entry(node.to_string())
            .or_default();
    }

    /// A new leader's list: a node's marks kept unless the watch has them
    /// already (its conditions come with the watch).
    pub fn recover_noted(&self, node: &str, seen: &Observed) {
        if self.marks.lock().unwrap().contains_key(node) {
            return;
        }
        self.note_rollout(node, seen);
    }

    /// The node left the API: its marks go.
    pub(super) fn forget_marks(&self, node: &str) {
        self.marks.lock().unwrap().remove(node);
        self.quiet_done.lock().unwrap().remove(node);
    }

    /// The leader's move of a node, kept with its marks (sharded): for a
    /// node it does not hold, that is all it does (its holder writes and
    /// tells it). Returns whether the step changed, `None` when nothing did.
    pub(super) fn mark_upgrade(&self, node: &str, next: &Option<NodeUpgrade>) -> Option<bool> {
        let mut marks = self.marks.lock().unwrap();
        let m = marks.entry(node.to_string()).or_default();
        if same_step(m.upgrade.as_ref(), next.as_ref()) {
            return None;
        }
        Some(move_step(&mut m.upgrade, next))
    }

    /// The nodes this replica does not hold (or knows no entry of) as the
    /// rollout sees them, from their marks, added to `v`.
    pub(super) fn marked_view(
        &self,
        nodes: &std::collections::HashMap<String, Box<NodeEntry>>,
        v: &mut Vec<Seen>,
    ) {
        let marks = self.marks.lock().unwrap();
        for (name, m) in marks.iter() {
            if self.owns(name) && nodes.contains_key(name) {
                continue;
            }
            if m.facts.is_none() && m.upgrade.is_none() {
                continue;
            }
            let f = m.facts.clone().unwrap_or_default();
            v.push(Seen {
                node: name.clone(),
                step: m.upgrade.clone(),
                agent_state: f.state,
                agent_version: f.version,
                agent_detail: f.detail,
                driver_version: f.driver,
                ready: f.ready,
                connected: m.connected && m.facts.is_some(),
                reported: m.facts.is_some(),
                unavailable: None,
            });
        }
    }

    /// The leader's steps the API does not carry yet (sharded): each
    /// node's, as `encode_step` writes it to its annotation.
    pub fn unpublished_steps(&self) -> Vec<(String, Option<NodeUpgrade>)> {
        if !self.sharded() {
            return Vec::new();
        }
        let nodes = self.nodes.lock().unwrap();
        let marks = self.marks.lock().unwrap();
        let differs =
            |decided: Option<&NodeUpgrade>, noted: Option<&Option<NodeUpgrade>>| match noted {
                None => decided.is_some(),
                Some(n) => !same_step(n.as_ref(), decided),
            };
        let mut out = Vec::new();
        for (name, e) in nodes.iter().filter(|(n, _)| self.owns(n)) {
            let Some(m) = marks.get(name.as_str()) else {
                // Not kept: in no rollout, or done in the API already.
                if e.upgrade
                    .as_ref()
                    .is_some_and(|u| u.step != Step::UpgradeDone)
                {
                    out.push((name.clone(), e.upgrade.clone()));
                }
                continue;
            };
            if differs(e.upgrade.as_ref(), m.noted.as_ref()) {
                out.push((name.clone(), e.upgrade.clone()));
            }
        }
        for (name, m) in marks.iter() {
            if self.owns(name) && nodes.contains_key(name) {
                continue;
            }
            if differs(m.upgrade.as_ref(), m.noted.as_ref()) {
                out.push((name.clone(), m.upgrade.clone()));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::model::node::{Condition, TaintPolicy};
    use crate::model::upgrade_notes::encode_step;

    /// A sharded fleet holding the nodes named `mine-*`, leading or not.
    fn fleet(leads: bool) -> (Fleet, tokio::sync::watch::Sender<bool>) {
        let (tx, rx) = tokio::sync::watch::channel(leads);
        let f = Fleet::new(TaintPolicy::Never, Duration::from_secs(60))
            .0
            .with_owner(|n| n.starts_with("mine-"))
            .with_rollout_leader(rx);
        (f, tx)
    }

    fn seen(rv: u64, step: Option<&str>, facts: Option<&str>, reporting: bool) -> Observed {
        let mut o = Observed {
            rv: Some(rv),
            ..Default::default()
        };
        if let Some(s) = step {
            o.annotations.insert(UPGRADE_STEP.into(), s.into());
        }
        if let Some(f) = facts {
            o.annotations.insert(AGENT_UPGRADE.into(), f.into());
        }
        o.conditions.push((
            Condition {
                kind: "GPUDriverReady",
                status: if reporting { "True" } else { "Unknown" },
                reason: if reporting {
                    "Validated"
                } else {
                    "AgentNotReporting"
                }
                .into(),
                message: String::new(),
            },
            String::new(),
        ));
        o
    }

    fn wants() -> String {
        AgentFacts {
            state: "upgrade-required".into(),
            version: "560.35.03".into(),
            driver: "550.127.08".into(),
            ready: true,
            ..Default::default()
        }
        .encode()
    }

    fn step_of(f: &Fleet, node: &str) -> Option<(Step, String)> {
        f.upgrade_view()
            .into_iter()
            .find(|s| s.node == node)
            .and_then(|s| s.step.map(|u| (u.step, u.target)))
    }

    #[test]
    fn the_leader_sees_other_replicas_nodes_from_their_annotations() {
        let (f, _tx) = fleet(true);
        // Another replica's node whose agent wants the new driver; one in
        // validation; one quiet (nothing of the rollout: not kept).
        f.note_rollout("theirs-a", &seen(5, None, Some(&wants()), true));
        let validating = NodeUpgrade::new(Step::ValidationRequired, "560.35.03", "");
        f.note_rollout(
            "theirs-b",
            &seen(
                6,
                Some(&encode_step(Some(&validating))),
                Some(&wants()),
                false,
            ),
        );
        f.note_rollout("theirs-quiet", &seen(7, None, None, true));
        let v = f.upgrade_view();
        let names: Vec<&str> = v.iter().map(|s| s.node.as_str()).collect();
        assert_eq!(names, ["theirs-a", "theirs-b"]);
        assert_eq!(v[0].agent_state, "upgrade-required");
        assert_eq!(v[0].agent_version, "560.35.03");
        assert_eq!(v[0].driver_version, "550.127.08");
        assert!(v[0].connected && v[0].reported && v[0].ready);
        assert_eq!(v[0].step, None);
        // b's conditions say its agent is not reporting.
        assert!(!v[1].connected);
        assert_eq!(
            step_of(&f, "theirs-b"),
            Some((Step::ValidationRequired, "560.35.03".into()))
        );
        // The leader's move of a node it does not hold: kept, not written
        // (no entry, no writer's queue), to be published.
        f.set_upgrade(
            "theirs-a",
            Some(NodeUpgrade::new(Step::CordonRequired, "560.35.03", "")),
        );
        assert_eq!(f.len(), 0, "no entry for a node it does not hold");
        assert_eq!(step_of(&f, "theirs-a").unwrap().0, Step::CordonRequired);
        let todo = f.unpublished_steps();
        assert_eq!(todo.len(), 1, "{todo:?}");
        assert_eq!(todo[0].0, "theirs-a");
        // Published: the API's annotation says it; nothing left to write.
        let cordon = NodeUpgrade::new(Step::CordonRequired, "560.35.03", "");
        f.note_rollout(
            "theirs-a",
            &seen(9, Some(&encode_step(Some(&cordon))), Some(&wants()), true),
        );
        assert!(f.unpublished_steps().is_empty());
        // The node leaves every mark behind: forgotten.
        f.note_rollout("theirs-b", &seen(10, None, None, true));
        assert!(step_of(&f, "theirs-b").is_none());
        assert_eq!(f.upgrade_view().len(), 1);
    }

    #[test]
    fn a_holder_takes_the_leaders_step_and_the_leader_keeps_its_own() {
        let (f, tx) = fleet(false);
        let (down_tx, mut down) = tokio::sync::mpsc::channel(8);
        f.connect(
            pb::Hello {
                node_name: "mine-a".into(),
                ..Default::default()
            },
            down_tx,
        );
        let go = NodeUpgrade::new(Step::ValidationRequired, "560.35.03", "");
        f.note_rollout(
            "mine-a",
            &seen(3, Some(&encode_step(Some(&go))), Some(&wants()), true),
        );
        // Taken: its agent is given the go-ahead by this replica.
        assert_eq!(
            f.with("mine-a", |e| e.upgrade.as_ref().map(|u| u.step)),
            Some(Step::ValidationRequired)
        );
        let mut told = None;
        while let Ok(Ok(m)) = down.try_recv() {
            if let Some(pb::controller_message::Body::Desired(d)) = m.body {
                told = Some(d);
            }
        }
        let told = told.unwrap();
        assert!(told.upgrade_go_ahead);
        assert_eq!(told.driver_version, "560.35.03");
        // Its label goes with the next write; its agent's word with it.
        f.with("mine-a", |e| {
            e.reported = true;
            e.report.upgrade = Some(pb::UpgradeState {
                state: "upgrade-required".into(),
                driver_version: "560.35.03".into(),
                detail: String::new(),
            });
        });
        let d = f.desired("mine-a");
        assert_eq!(d.labels[UPGRADE_STATE_LABEL], "validation-required");
        let facts = AgentFacts::decode("mine-a", &d.annotations[AGENT_UPGRADE]).unwrap();
        assert_eq!(facts.state, "upgrade-required");
        // "No upgrade any more" from the leader: taken too.
        f.note_rollout("mine-a", &seen(4, Some("null"), Some(&wants()), true));
        assert_eq!(f.with("mine-a", |e| e.upgrade.clone()), None);
        // Leading, this replica's own moves are the step: an annotation
        // behind them (not written yet) is not taken.
        tx.send_replace(true);
        f.set_upgrade(
            "mine-a",
            Some(NodeUpgrade::new(Step::CordonRequired, "560.35.03", "")),
        );
        f.note_rollout("mine-a", &seen(5, Some("null"), Some(&wants()), true));
        assert_eq!(step_of(&f, "mine-a").unwrap().0, Step::CordonRequired);
        assert_eq!(f.unpublished_steps()[0].0, "mine-a");
    }

    #[test]
    fn a_malformed_annotation_is_left_aside() {
        let (f, _tx) = fleet(false);
        f.note_rollout("theirs-x", &seen(1, Some("{broken"), Some("nope"), true));
        // Kept (it carries marks) but nothing is known of it: not planned.
        assert!(f.upgrade_view().is_empty());
        // The label still says its step.
        let mut o = seen(2, Some("{broken"), Some(&wants()), true);
        o.labels
            .insert(UPGRADE_STATE_LABEL.into(), "upgrade-required".into());
        f.note_rollout("theirs-x", &o);
        let v = f.upgrade_view();
        assert_eq!(v[0].step.as_ref().unwrap().step, Step::UpgradeRequired);
        assert_eq!(v[0].agent_state, "upgrade-required");
    }

    #[test]
    fn a_node_whose_shard_comes_here_starts_with_its_step() {
        // Another replica holds the node's shard, then this one takes it.
        let ours = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (_tx, rx) = tokio::sync::watch::channel(false);
        let f = {
            let ours = ours.clone();
            Fleet::new(TaintPolicy::Never, Duration::from_secs(60))
                .0
                .with_owner(move |_| ours.load(std::sync::atomic::Ordering::Relaxed))
                .with_rollout_leader(rx)
        };
        let up = NodeUpgrade::new(Step::ValidationRequired, "560.35.03", "");
        f.note_rollout(
            "n",
            &seen(1, Some(&encode_step(Some(&up))), Some(&wants()), true),
        );
        assert_eq!(f.len(), 0, "not this replica's: no entry");
        ours.store(true, std::sync::atomic::Ordering::Relaxed);
        // Its agent's first check-in here: the go-ahead comes at once.
        let a = f.check_in(
            "n",
            pb::CheckInRequest {
                hello: Some(pb::Hello {
                    node_name: "n".into(),
                    ..Default::default()
                }),
                snapshot: Some(pb::NodeReport::default()),
                ..Default::default()
            },
            Duration::from_secs(30),
        );
        let d = a.desired.unwrap();
        assert!(d.upgrade_go_ahead);
        assert_eq!(d.driver_version, "560.35.03");
    }

    #[test]
    fn an_older_event_changes_nothing_on_a_holder() {
        // Not leading: a node's step is what the API last said of it.
        let (f, _tx) = fleet(false);
        let cordon = NodeUpgrade::new(Step::CordonRequired, "560.35.03", "");
        f.note_rollout(
            "theirs-a",
            &seen(9, Some(&encode_step(Some(&cordon))), Some(&wants()), true),
        );
        assert_eq!(step_of(&f, "theirs-a").unwrap().0, Step::CordonRequired);
        // Older events, one with an older step, one from before the node
        // carried anything of the rollout: neither changes it.
        let before = NodeUpgrade::new(Step::UpgradeRequired, "560.35.03", "");
        f.note_rollout(
            "theirs-a",
            &seen(8, Some(&encode_step(Some(&before))), Some(&wants()), true),
        );
        assert_eq!(step_of(&f, "theirs-a").unwrap().0, Step::CordonRequired);
        f.note_rollout("theirs-a", &seen(4, None, None, true));
        assert_eq!(step_of(&f, "theirs-a").unwrap().0, Step::CordonRequired);
    }

    #[test]
    fn a_demoted_leader_does_not_put_its_own_nodes_step_back() {
        let (f, tx) = fleet(true);
        f.connect(
            pb::Hello {
                node_name: "mine-a".into(),
                ..Default::default()
            },
            tokio::sync::mpsc::channel(8).0,
        );
        let required = NodeUpgrade::new(Step::UpgradeRequired, "560.35.03", "");
        f.set_upgrade("mine-a", Some(required.clone()));
        f.note_rollout(
            "mine-a",
            &seen(3, Some(&encode_step(Some(&required))), Some(&wants()), true),
        );
        // Its next move is applied at once (label, go-ahead) and its
        // annotation left for the end of the look; the Lease goes first.
        f.set_upgrade(
            "mine-a",
            Some(NodeUpgrade::new(Step::CordonRequired, "560.35.03", "")),
        );
        tx.send_replace(false);
        // The label written, the annotation still the older step: kept.
        let mut o = seen(4, Some(&encode_step(Some(&required))), Some(&wants()), true);
        o.labels
            .insert(UPGRADE_STATE_LABEL.into(), "cordon-required".into());
        f.note_rollout("mine-a", &o);
        let now = || f.with("mine-a", |e| e.upgrade.as_ref().map(|u| u.step));
        assert_eq!(now(), Some(Step::CordonRequired));
        // The new leader's word, when it comes, is taken.
        let next = NodeUpgrade::new(Step::WaitForJobsRequired, "560.35.03", "");
        f.note_rollout(
            "mine-a",
            &seen(5, Some(&encode_step(Some(&next))), Some(&wants()), true),
        );
        assert_eq!(now(), Some(Step::WaitForJobsRequired));
    }

    #[test]
    fn a_long_detail_is_published_once() {
        let (f, _tx) = fleet(true);
        f.connect(
            pb::Hello {
                node_name: "mine-a".into(),
                ..Default::default()
            },
            tokio::sync::mpsc::channel(8).0,
        );
        // Pods waited for, more than an annotation's detail carries.
        let pods: Vec<String> = (0..200).map(|i| format!("train-job-{i:04}")).collect();
        let long = format!("waiting for {}", pods.join(", "));
        assert!(long.len() > 2048);
        for node in ["mine-a", "theirs-a"] {
            let up = NodeUpgrade::new(Step::WaitForJobsRequired, "560.35.03", long.clone());
            f.set_upgrade(node, Some(up.clone()));
            assert!(f.unpublished_steps().iter().any(|(n, _)| n == node));
            // Written; the watch (or the PATCH's answer) has it, cut.
            f.note_rollout(
                node,
                &seen(3, Some(&encode_step(Some(&up))), Some(&wants()), true),
            );
        }
        let todo = f.unpublished_steps();
        assert!(todo.is_empty(), "nothing to write again: {todo:?}");
    }

    #[test]
    fn a_step_taken_for_a_node_without_an_entry_is_said() {
        let (_tx, rx) = tokio::sync::watch::channel(false);
        let (events_tx, mut events) = tokio::sync::mpsc::channel(8);
        let f = Fleet::new(TaintPolicy::Never, Duration::from_secs(60))
            .0
            .with_owner(|n| n.starts_with("mine-"))
            .with_rollout_leader(rx)
            .with_events(events_tx);
        let go = NodeUpgrade::new(Step::ValidationRequired, "560.35.03", "");
        f.note_rollout(
            "mine-a",
            &seen(1, Some(&encode_step(Some(&go))), Some(&wants()), true),
        );
        assert_eq!(
            f.with("mine-a", |e| e.upgrade.as_ref().map(|u| u.step)),
            Some(Step::ValidationRequired)
        );
        let e = events.try_recv().expect("the step's Event");
        assert_eq!((e.node.as_str(), e.reason), ("mine-a", "DriverUpgrade"));
        assert!(
            f.with("mine-a", |e| e.write.queued),
            "its label to be written"
        );
    }

    #[test]
    fn a_node_done_whose_agent_says_nothing_more_is_not_kept() {
        let (f, tx) = fleet(false);
        let done = NodeUpgrade::new(Step::UpgradeDone, "560.35.03", "");
        let said = AgentFacts {
            state: "upgrade-done".into(),
            version: "560.35.03".into(),
            driver: "560.35.03".into(),
            ready: true,
            ..Default::default()
        }
        .encode();
        let at_done = |rv, facts: Option<&str>| {
            let mut o = seen(rv, Some(&encode_step(Some(&done))), facts, true);
            o.labels
                .insert(UPGRADE_STATE_LABEL.into(), "upgrade-done".into());
            o
        };
        // Done, its agent saying so (or nothing): nothing kept, on any
        // replica, whether it was kept before or not.
        f.note_rollout("theirs-a", &at_done(3, Some(&wants())));
        assert_eq!(f.upgrade_view().len(), 1, "a new rollout: kept");
        f.note_rollout("theirs-a", &at_done(4, Some(&said)));
        f.note_rollout("theirs-b", &at_done(5, None));
        let mut label_only = seen(6, None, None, true);
        label_only
            .labels
            .insert(UPGRADE_STATE_LABEL.into(), "upgrade-done".into());
        f.note_rollout("theirs-c", &label_only);
        assert!(f.upgrade_view().is_empty(), "{:?}", f.upgrade_view());
        assert!(f.marks.lock().unwrap().is_empty());
        // By name only (their labels say done).
        let names = |f: &Fleet| {
            let mut v: Vec<String> = f
                .quiet_done
                .lock()
                .unwrap()
                .iter()
                .map(|n| n.to_string())
                .collect();
            v.sort();
            v
        };
        assert_eq!(names(&f), ["theirs-a", "theirs-b", "theirs-c"]);
        // Its holder keeps the node's label, and publishes no agent's word
        // for it.
        f.note_rollout("mine-a", &at_done(7, None));
        f.with("mine-a", |e| {
            e.reported = true;
            e.report.upgrade = Some(pb::UpgradeState {
                state: "upgrade-done".into(),
                driver_version: "560.35.03".into(),
                detail: String::new(),
            });
        });
        let d = f.desired("mine-a");
        assert_eq!(d.labels[UPGRADE_STATE_LABEL], "upgrade-done");
        assert!(!d.annotations.contains_key(AGENT_UPGRADE), "{d:?}");
        // Leading, its done step is not written again and again.
        tx.send_replace(true);
        let todo = f.unpublished_steps();
        assert!(todo.is_empty(), "{todo:?}");
    }

    /// The watch saw a done node before this replica held it (its shard
    /// came later, from a replica that stopped): the entry it makes for
    /// the node's agent starts at done, so the label it writes keeps the
    /// node's state. A node whose label went, or that went from the API,
    /// starts with nothing.
    #[test]
    fn a_done_node_seen_before_its_shard_came_keeps_its_label() {
        let held = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let h = held.clone();
        let (tx, rx) = tokio::sync::watch::channel(false);
        let f = Fleet::new(TaintPolicy::Never, Duration::from_secs(60))
            .0
            .with_owner(move |_| h.load(std::sync::atomic::Ordering::SeqCst))
            .with_rollout_leader(rx);
        let done = NodeUpgrade::new(Step::UpgradeDone, "560.35.03", "");
        let mut at_done = seen(3, Some(&encode_step(Some(&done))), None, true);
        at_done
            .labels
            .insert(UPGRADE_STATE_LABEL.into(), "upgrade-done".into());
        for n in ["n-0", "n-1", "n-2"] {
            f.note_rollout(n, &at_done);
        }
        assert!(f.marks.lock().unwrap().is_empty());
        f.note_rollout("n-1", &seen(4, None, None, true));
        f.forget_marks("n-2");
        held.store(true, std::sync::atomic::Ordering::SeqCst);
        for n in ["n-0", "n-1", "n-2"] {
            f.with(n, |e| {
                e.reported = true;
                e.report.upgrade = Some(pb::UpgradeState {
                    state: "upgrade-done".into(),
                    driver_version: "560.35.03".into(),
                    detail: String::new(),
                });
            });
        }
        let d = f.desired("n-0");
        assert_eq!(d.labels[UPGRADE_STATE_LABEL], "upgrade-done", "{d:?}");
        assert!(!d.annotations.contains_key(AGENT_UPGRADE), "{d:?}");
        for n in ["n-1", "n-2"] {
            let d = f.desired(n);
            assert!(!d.labels.contains_key(UPGRADE_STATE_LABEL), "{n}: {d:?}");
        }
        drop(tx);
    }
}
