//! The ResourceClaims allocated to each node's devices of ours (issue 31),
//! sent down its agent's stream as `DraClaims`: the node's whole list, only
//! when it changed, again on every new stream, so the agent's
//! `NodePrepareResources` answers from memory.
//!
//! The lists are kept apart from the nodes' entries: they are the claims
//! watch's (every replica runs it), not an agent's word, and stay when the
//! entries are forgotten (`reset`). Nothing is sent until the watch has
//! listed every claim once: an empty list before then would tell an agent
//! that its prepared claims are gone. An agent is sent a list once its node
//! has claims or its report says it serves DRA (the plugin registered, or
//! claims prepared); from then on every change, an empty list included.

use std::collections::{BTreeMap, BTreeSet};

use gpu_agent_proto::report::v1 as pb;

use super::{Fleet, NodeEntry};

impl Fleet {
    /// Whether the node's agent says it serves DRA.
    pub(super) fn serves_dra(e: &NodeEntry) -> bool {
        e.report
            .dra
            .as_ref()
            .is_some_and(|d| d.registered || !d.prepared_claims.is_empty())
    }

    /// Every node's claims, after a complete listing (a node left out has
    /// none): each agent whose list changed is sent it.
    pub fn replace_dra_claims(&self, all: BTreeMap<String, pb::DraClaims>) {
        let mut nodes: BTreeSet<String> = self.names().into_iter().collect();
        {
            let mut lists = self.dra_claims.lock().unwrap();
            nodes.extend(lists.iter().flat_map(|l| l.keys().cloned()));
            nodes.extend(all.keys().cloned());
            *lists = Some(
                all.into_iter()
                    .filter(|(_, l)| !l.claims.is_empty())
                    .collect(),
            );
        }
        for node in nodes {
            self.send_dra_claims(&node);
        }
    }

    /// One node's whole list changed (after the first complete listing;
    /// ignored before it).
    pub fn set_dra_claims(&self, node: &str, claims: pb::DraClaims) {
        {
            let mut lists = self.dra_claims.lock().unwrap();
            let Some(lists) = lists.as_mut() else {
                return;
            };
            if claims.claims.is_empty() {
                lists.remove(node);
            } else {
                lists.insert(node.to_string(), claims);
            }
        }
        self.send_dra_claims(node);
    }

    /// The node's claims as its agent should have them (`None`: the claims
    /// are not listed yet).
    pub fn dra_claims_of(&self, node: &str) -> Option<pb::DraClaims> {
        let lists = self.dra_claims.lock().unwrap();
        lists
            .as_ref()
            .map(|l| l.get(node).cloned().unwrap_or_default())
    }

    /// Sends the node's agent its claims, if they changed since the last
    /// sent on this stream.
    pub(super) fn send_dra_claims(&self, node: &str) {
        // Held while sending: two callers send in the order the lists
        // changed, never an older list last.
        let lists = self.dra_claims.lock().unwrap();
        let Some(lists) = lists.as_ref() else {
            return;
        };
        let want = lists.get(node).cloned().unwrap_or_default();
        let down = {
            let mut nodes = self.nodes.lock().unwrap();
            let Some(e) = nodes.get_mut(node) else {
                return;
            };
            if e.dra_sent.as_ref() == Some(&want)
                || (e.dra_sent.is_none() && want.claims.is_empty() && !Self::serves_dra(e))
            {
                return;
            }
            let Some(down) = e.down.clone() else {
                return;
            };
            e.dra_sent = Some(want.clone());
            down
        };
        tracing::info!(
            node,
            claims = want.claims.len(),
            "sending the agent its node's ResourceClaims"
        );
        let msg = pb::ControllerMessage {
            seq: 0,
            body: Some(pb::controller_message::Body::DraClaims(want)),
        };
        // A full queue: the agent is not reading; its stream ends soon.
        if down.try_send(Ok(msg)).is_err() {
            tracing::warn!(node, "the agent does not read its stream");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::sync::mpsc;

    use super::*;
    use crate::model::node::TaintPolicy;

    type Rx = mpsc::Receiver<Result<pb::ControllerMessage, tonic::Status>>;

    fn fleet() -> Fleet {
        Fleet::new(TaintPolicy::default(), Duration::from_secs(1)).0
    }

    /// An agent on `node` (serving DRA or not): its stream's receiving end.
    fn agent(f: &Fleet, node: &str, dra: bool) -> Rx {
        let (tx, rx) = mpsc::channel(16);
        let hello = pb::Hello {
            node_name: node.into(),
            ..Default::default()
        };
        f.connect(hello, tx);
        let report = pb::NodeReport {
            dra: dra.then(|| pb::DraState {
                registered: true,
                ..Default::default()
            }),
            ..Default::default()
        };
        f.apply(node, pb::agent_message::Body::Snapshot(report));
        rx
    }

    /// The DraClaims lists that came down so far, by their claims' UIDs.
    fn got(rx: &mut Rx) -> Vec<Vec<String>> {
        let mut out = Vec::new();
        while let Ok(Ok(m)) = rx.try_recv() {
            if let Some(pb::controller_message::Body::DraClaims(l)) = m.body {
                out.push(l.claims.into_iter().map(|c| c.uid).collect());
            }
        }
        out
    }

    fn list(uids: &[&str]) -> pb::DraClaims {
        pb::DraClaims {
            claims: uids
                .iter()
                .map(|u| pb::DraClaim {
                    uid: u.to_string(),
                    ..Default::default()
                })
                .collect(),
        }
    }

    #[test]
    fn nothing_is_sent_before_the_claims_are_listed_then_each_change_once() {
        let f = fleet();
        let mut a = agent(&f, "a", true);
        let mut b = agent(&f, "b", true);
        let mut c = agent(&f, "c", false);
        f.set_dra_claims("a", list(&["u1"]));
        assert!(got(&mut a).is_empty(), "not listed yet: nothing said");
        assert_eq!(f.dra_claims_of("a"), None);

        f.replace_dra_claims(BTreeMap::from([("a".to_string(), list(&["u1"]))]));
        assert_eq!(got(&mut a), [["u1"]]);
        assert_eq!(
            got(&mut b),
            [Vec::<String>::new()],
            "serves DRA: told it has none"
        );
        assert!(got(&mut c).is_empty(), "no DRA and no claims: nothing");

        // The same lists again: nothing.
        f.replace_dra_claims(BTreeMap::from([("a".to_string(), list(&["u1"]))]));
        f.set_dra_claims("b", list(&[]));
        assert!(got(&mut a).is_empty() && got(&mut b).is_empty());

        // A claim on the node without DRA in its report: sent all the same.
        f.set_dra_claims("c", list(&["u3"]));
        assert_eq!(got(&mut c), [["u3"]]);
        f.set_dra_claims("c", list(&[]));
        assert_eq!(got(&mut c), [Vec::<String>::new()], "and its end");

        // A re-list without a's claim: a is sent its empty list.
        f.replace_dra_claims(BTreeMap::new());
        assert_eq!(got(&mut a), [Vec::<String>::new()]);
        assert!(got(&mut b).is_empty());
    }

    #[test]
    fn a_new_stream_gets_the_list_again_and_the_lists_outlive_a_reset() {
        let f = fleet();
        f.replace_dra_claims(BTreeMap::from([("a".to_string(), list(&["u1", "u2"]))]));
        let mut a = agent(&f, "a", true);
        assert_eq!(got(&mut a), [["u1", "u2"]]);
        let mut again = agent(&f, "a", true);
        assert_eq!(got(&mut again), [["u1", "u2"]]);
        f.reset();
        assert_eq!(f.dra_claims_of("a"), Some(list(&["u1", "u2"])));
        let mut after = agent(&f, "a", true);
        assert_eq!(got(&mut after), [["u1", "u2"]]);
    }
}
