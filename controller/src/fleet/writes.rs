//! The node as the API should have it and as it has it: what each node
//! should carry now ([`Fleet::desired`]), the writer's queue
//! ([`Fleet::mark_dirty`]), and what the watch of the nodes says
//! ([`Fleet::observe`]), held against what the node should carry.

use super::{Fleet, NodeEntry};
use crate::model::node::{self, Applied, Desired, Observed};
use crate::model::upgrade_notes::AGENT_UPGRADE;

impl Fleet {
    /// The node needs writing: queued for the writer unless it is already.
    pub fn mark_dirty(&self, node: &str) {
        self.tell_dra_slices(node);
        let send = self.with(node, |e| {
            e.write.queued = true;
            if e.write.writing || e.write.in_queue {
                false
            } else {
                e.write.in_queue = true;
                true
            }
        });
        if send {
            let _ = self.queue.send(node.to_string());
        }
    }

    /// What the node should carry now: from its report while its agent
    /// reports (or within the grace after), else every condition Unknown.
    pub fn desired(&self, node: &str) -> Desired {
        self.with(node, |e| self.wanted(e))
    }

    pub(super) fn wanted(&self, e: &NodeEntry) -> Desired {
        let (mut d, _) = node::desired(&e.report, self.taint);
        // No agent has reported since this controller started: what it
        // said before is not known, and the labels stay as they are.
        d.keep_labels = !e.reported;
        if let Some(why) = &e.gone {
            // Already said so (by this replica before, or by the one that
            // led before it): kept as it is, not said again.
            let api = e.write.applied.as_ref().and_then(|a| a.conditions.as_ref());
            d.conditions = node::unreported(why)
                .into_iter()
                .map(|c| {
                    api.into_iter()
                        .flatten()
                        .find(|(o, _)| {
                            o.kind == c.kind && o.status == c.status && o.reason == c.reason
                        })
                        .map(|(o, _)| o.clone())
                        .unwrap_or(c)
                })
                .collect();
            // Nothing is known: the health taint stays as it was.
            d.keep_taint = true;
            d.taint = e
                .write
                .applied
                .as_ref()
                .and_then(|a| a.taint)
                .unwrap_or(false);
        }
        // The rollout's state is the controller's own: it holds whether
        // or not the agent reports.
        if let Some(u) = &e.upgrade {
            d.labels
                .insert(node::UPGRADE_STATE_LABEL.into(), u.step.label().into());
            d.conditions.push(u.condition());
        }
        // Sharded, the leader plans the rollout from the agent's word,
        // carried with the labels (shared_rollout.rs).
        if self.sharded()
            && let Some(f) = Self::agent_facts(e)
        {
            d.annotations.insert(AGENT_UPGRADE.into(), f.encode());
        }
        d
    }

    /// The node as the API has it now (a watch event), for a node of this
    /// controller's: what differs from what it should carry is written
    /// again. A node not in the fleet is taken in if it carries the
    /// conditions the controller writes (a GPU node whose agent has not
    /// reported to this replica yet).
    pub fn observe(&self, node: &str, seen: Observed) {
        let differs = {
            let mut nodes = self.nodes.lock().unwrap();
            let e = match nodes.get_mut(node) {
                Some(e) => e,
                None if seen.ours() => nodes
                    .entry(node.to_string())
                    .or_insert_with(|| self.fresh(node)),
                None => return,
            };
            self.look(node, e, seen)
        };
        if differs {
            self.mark_dirty(node);
        }
    }

    /// Holds what the API has of a node against what it should carry and
    /// keeps it as what the writer knows. Returns whether the node must be
    /// written again (something of the controller's differs and is known:
    /// its agent reported, or is past its grace). Labels and taints of
    /// others are not looked at; labels of the controller's that the agent
    /// no longer reports go with the next write.
    pub(crate) fn look(&self, node: &str, e: &mut NodeEntry, seen: Observed) -> bool {
        if e.write.writing {
            // It may be this write's own work half done: looked at once
            // the write is over.
            if e.write.seen.as_ref().is_none_or(|s| newer(seen.rv, s.rv)) {
                e.write.seen = Some(seen);
            }
            return false;
        }
        let known = e.write.applied.as_ref().and_then(|a| a.rv);
        if !newer(seen.rv, known) {
            return false;
        }
        let before = e.write.applied.take().unwrap_or_default();
        let remade = before.uid.is_some() && before.uid != seen.uid;
        let d = self.wanted(e);
        let mut what: Vec<String> = Vec::new();
        if remade {
            what.push("the node was made again".into());
        }
        let labels_ok = d.keep_labels
            || d.labels.iter().all(|(k, v)| {
                let ok = seen.labels.get(k) == Some(v);
                if !ok {
                    what.push(format!("label {k}"));
                }
                ok
            });
        let notes_ok = d.keep_labels
            || d.annotations.iter().all(|(k, v)| {
                let ok = seen.annotations.get(k) == Some(v);
                if !ok {
                    what.push(format!("annotation {k}"));
                }
                ok
            });
        let labels_ok = labels_ok && notes_ok;
        // Ours as the API has them, in the order they are written.
        let conditions: Vec<(node::Condition, String)> = d
            .conditions
            .iter()
            .filter_map(|c| {
                seen.conditions
                    .iter()
                    .find(|(o, _)| o.kind == c.kind)
                    .cloned()
            })
            .collect();
        for c in &d.conditions {
            if !conditions.iter().any(|(o, _)| o == c) {
                what.push(format!("condition {}", c.kind));
            }
        }
        if !d.keep_taint && seen.taint != d.taint {
            what.push("the health taint".into());
        }
        e.write.applied = Some(Applied {
            labels: if labels_ok && !remade {
                before.labels
            } else {
                None
            },
            annotations: if labels_ok && !remade {
                before.annotations
            } else {
                None
            },
            conditions: Some(conditions),
            taint: Some(seen.taint),
            rv: seen.rv,
            uid: seen.uid,
        });
        if what.is_empty() || !(e.reported || e.gone.is_some()) {
            return false;
        }
        tracing::info!(node, differs = %what.join(", "), "the node differs in the API from what its agent says: writing it again");
        true
    }

    /// The node was deleted: nothing is written to it until it is made
    /// again (then all of it is). Without an agent connected (or a place
    /// in a rollout) it leaves the fleet.
    pub fn forget_in_api(&self, node: &str) {
        self.forget_marks(node);
        let mut nodes = self.nodes.lock().unwrap();
        let Some(e) = nodes.get_mut(node) else {
            return;
        };
        tracing::info!(node, "node deleted");
        if !e.live() && e.upgrade.is_none() {
            nodes.remove(node);
        } else {
            e.write.applied = None;
            e.write.seen = None;
        }
    }

    /// Nodes whose conditions the controller owns (as the API has them)
    /// and whose agent has not connected to this replica (`only`: that
    /// node, if so) are not reporting, for `why`. Returns how many.
    pub fn mark_unconnected(&self, only: Option<&str>, why: &str) -> usize {
        let marked: Vec<String> = {
            let mut nodes = self.nodes.lock().unwrap();
            nodes
                .iter_mut()
                .filter(|(name, _)| only.is_none_or(|o| o == name.as_str()))
                .filter(|(name, _)| self.owns(name))
                .filter(|(_, e)| {
                    e.hello.is_none()
                        && !e.live()
                        && e.gone.is_none()
                        && e.write
                            .applied
                            .as_ref()
                            .and_then(|a| a.conditions.as_ref())
                            .is_some_and(|c| !c.is_empty())
                })
                .map(|(name, e)| {
                    e.gone = Some(why.to_string());
                    name.clone()
                })
                .collect()
        };
        for node in &marked {
            tracing::warn!(node, why, "agent not reporting");
            self.mark_dirty(node);
        }
        marked.len()
    }

    /// Requeues a node whose write finished while another change came in.
    pub(crate) fn requeue(&self, node: &str) {
        let _ = self.queue.send(node.to_string());
    }
}

/// Whether a node's `resourceVersion` is later than another (either not
/// known: it may be).
fn newer(rv: Option<u64>, than: Option<u64>) -> bool {
    match (rv, than) {
        (Some(a), Some(b)) => a > b,
        _ => true,
    }
}
