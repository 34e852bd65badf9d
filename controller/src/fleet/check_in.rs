//! Agents' check-ins (`CheckIn`): one unary call at a time, nothing held
//! between them. A check-in brings the node's whole report (a snapshot) or
//! the sections changed since the last answered one, and the health events
//! and repairs the agent has not seen acknowledged; the answer carries what
//! is wanted of the node (only when it differs from what the agent holds:
//! versions are hashes of the wishes, so nothing per node is kept for
//! them), the node's claims likewise, and the interval to the next one.
//!
//! A change applies only on top of the state this replica answered with
//! the `base` the agent sends back; any other base (this replica restarted,
//! or the node's shard came to it) is answered with "send a snapshot".
//! Happenings are taken once each: numbered by the agent process, those at
//! or below the last taken number are not told again.
//!
//! A node checked in through is live until it misses two check-ins
//! ([`Fleet::sweep_check_ins`]); then its conditions say its agent is not
//! reporting, as when a stream ends and the grace runs out.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use gpu_agent_proto::report::v1 as pb;
use prost::Message;
use sha2::Digest;

use super::{CheckIns, Fleet, NodeEntry};

/// A 64-bit version of a message: the first 8 bytes of its encoding's
/// SHA-256, never 0 (0 means "none").
fn version(m: &impl Message) -> u64 {
    let d = sha2::Sha256::digest(m.encode_to_vec());
    u64::from_be_bytes(d[..8].try_into().unwrap_or([0; 8])) | 1
}

impl NodeEntry {
    /// Whether the node's agent is reporting to this replica: a stream is
    /// live, or it checks in on time.
    pub fn live(&self) -> bool {
        self.stream.is_some() || self.check_ins.as_ref().is_some_and(|c| !c.late)
    }

    /// The loaded driver's version, as its agent reports it ("": none yet).
    pub fn driver_version(&self) -> String {
        self.report
            .inventory
            .as_ref()
            .map(|i| i.driver_version.clone())
            .unwrap_or_default()
    }

    /// Whether its agent reports every stage ready.
    pub fn ready(&self) -> bool {
        self.report.stages.as_ref().is_some_and(|s| s.ready)
    }
}

impl Fleet {
    /// Takes one check-in of `node` (its token's node) and answers it; the
    /// next is due within `interval`.
    pub fn check_in(
        &self,
        node: &str,
        req: pb::CheckInRequest,
        interval: Duration,
    ) -> pb::CheckInAnswer {
        use pb::agent_message::Body;
        let hello = req.hello.unwrap_or_default();
        let agent = (hello.boot_id.clone(), hello.agent_started_at);
        let first_seq = req.first_seq;
        let now = Instant::now();
        // What of it applies, decided under the lock; applied after.
        let (report, fresh_happenings, base, send_snapshot, came_back, acked) =
            self.with(node, |e| {
                let came_back = !e.live();
                let known = e.check_ins.as_ref().filter(|c| c.base == req.base);
                let (report, base, send_snapshot) = match (req.snapshot, req.change) {
                    (Some(s), _) => {
                        let base = format!(
                            "{:x}-{}",
                            self.nonce,
                            self.next_base.fetch_add(1, Ordering::Relaxed)
                        );
                        (Some(Body::Snapshot(s)), base, false)
                    }
                    (None, change) => match known {
                        Some(c) => (change.map(Body::Change), c.base.clone(), false),
                        // Not this replica's state: nothing of it applies.
                        None => (None, String::new(), true),
                    },
                };
                let taken = match &e.check_ins {
                    Some(c) if c.agent == agent => c.taken,
                    _ => 0,
                };
                let sent = req.happenings.len() as u64;
                let fresh: Vec<Body> = req
                    .happenings
                    .into_iter()
                    .enumerate()
                    .filter(|(i, _)| first_seq + *i as u64 > taken)
                    .filter_map(|(_, h)| match h.body? {
                        pb::happening::Body::HealthEvent(ev) => Some(Body::HealthEvent(ev)),
                        pb::happening::Body::Repair(r) => Some(Body::Repair(r)),
                    })
                    .collect();
                // Every happening sent is taken: told now, or told before.
                let taken = if sent == 0 {
                    taken
                } else {
                    taken.max(first_seq + sent - 1)
                };
                e.hello = Some(hello.clone());
                e.gone = None;
                e.check_ins = Some(CheckIns {
                    base: base.clone(),
                    last: now,
                    interval,
                    agent: agent.clone(),
                    taken,
                    late: false,
                });
                (report, fresh, base, send_snapshot, came_back, taken)
            });
        if came_back {
            tracing::info!(node, version = %hello.agent_version, "agent checking in");
            self.policy_changed.notify_one();
        }
        for h in fresh_happenings {
            self.apply(node, h);
        }
        if let Some(r) = report {
            self.apply(node, r);
        }
        self.check_ins_answered.fetch_add(1, Ordering::Relaxed);
        let mut answer = pb::CheckInAnswer {
            base,
            acked_seq: acked,
            send_snapshot,
            interval_seconds: interval.as_secs().max(1) as u32,
            ..Default::default()
        };
        let policy = self
            .policy
            .lock()
            .unwrap()
            .as_ref()
            .map(|p| p.for_node(node));
        let (desired, claims_wanted) = self.with(node, |e| {
            (Self::desired_of(e, policy.as_deref()), Self::serves_dra(e))
        });
        let v = version(&desired);
        answer.desired_version = v;
        if v != req.desired_version {
            tracing::info!(node, mig_layout = %desired.mig_layout, driver = %desired.driver_version, upgrade_go_ahead = desired.upgrade_go_ahead, "telling the agent what is wanted");
            answer.desired = Some(desired);
        }
        if let Some(claims) = self.dra_claims_of(node)
            && (claims_wanted || !claims.claims.is_empty() || req.dra_claims_version != 0)
        {
            let v = version(&claims);
            answer.dra_claims_version = v;
            if v != req.dra_claims_version {
                tracing::info!(
                    node,
                    claims = claims.claims.len(),
                    "sending the agent its node's ResourceClaims"
                );
                answer.dra_claims = Some(claims);
            }
        }
        answer
    }

    /// Nodes that missed two check-ins are late: their agent is not
    /// reporting. Returns when the next may be late (`None`: no node
    /// checks in).
    pub fn sweep_check_ins(&self) -> Option<Instant> {
        let now = Instant::now();
        let mut next: Option<Instant> = None;
        let late: Vec<String> = {
            let mut nodes = self.nodes.lock().unwrap();
            nodes
                .iter_mut()
                .filter_map(|(name, e)| {
                    let c = e.check_ins.as_mut().filter(|c| !c.late)?;
                    let due = c.last + 2 * c.interval + LATE_AFTER;
                    if due > now {
                        next = Some(next.map_or(due, |n| n.min(due)));
                        return None;
                    }
                    c.late = true;
                    (e.stream.is_none()).then(|| name.clone())
                })
                .collect()
        };
        for node in late {
            self.expire(&node, "the agent missed two check-ins");
        }
        next
    }

    /// Nodes that check in to this replica.
    pub fn checking_in(&self) -> usize {
        let nodes = self.nodes.lock().unwrap();
        nodes
            .values()
            .filter(|e| e.check_ins.as_ref().is_some_and(|c| !c.late))
            .count()
    }
}

/// Slack past two missed check-ins before a node is late.
const LATE_AFTER: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::node::TaintPolicy;

    fn fleet() -> Fleet {
        Fleet::new(TaintPolicy::default(), Duration::from_secs(1)).0
    }

    fn hello() -> pb::Hello {
        pb::Hello {
            node_name: "n1".into(),
            agent_version: "1".into(),
            boot_id: "b".into(),
            agent_started_at: 7,
            dropped_events: 0,
        }
    }

    fn event(n: u64) -> pb::Happening {
        pb::Happening {
            body: Some(pb::happening::Body::HealthEvent(pb::HealthEvent {
                gpu_uuid: "GPU-1".into(),
                xid: 79,
                reason: format!("XID 79 #{n}"),
                ..Default::default()
            })),
        }
    }

    fn labels(v: &str) -> pb::NodeReport {
        pb::NodeReport {
            labels: Some(pb::Labels {
                labels: [("nvidia.com/gpu.count".to_string(), v.to_string())].into(),
            }),
            ..Default::default()
        }
    }

    const T: Duration = Duration::from_secs(30);

    #[test]
    fn a_change_applies_only_on_the_base_this_replica_answered() {
        let f = fleet();
        // A change with no base: a snapshot is asked for, nothing applied.
        let a = f.check_in(
            "n1",
            pb::CheckInRequest {
                hello: Some(hello()),
                change: Some(labels("8")),
                ..Default::default()
            },
            T,
        );
        assert!(a.send_snapshot);
        assert!(f.with("n1", |e| e.report.labels.is_none()));
        let a = f.check_in(
            "n1",
            pb::CheckInRequest {
                hello: Some(hello()),
                snapshot: Some(labels("8")),
                ..Default::default()
            },
            T,
        );
        assert!(!a.send_snapshot);
        assert_eq!(a.interval_seconds, 30);
        let b = f.check_in(
            "n1",
            pb::CheckInRequest {
                hello: Some(hello()),
                base: a.base.clone(),
                change: Some(labels("4")),
                ..Default::default()
            },
            T,
        );
        assert!(!b.send_snapshot);
        assert_eq!(b.base, a.base);
        assert_eq!(
            f.with("n1", |e| e.report.labels.clone()).unwrap().labels["nvidia.com/gpu.count"],
            "4"
        );
        // Another replica's base: refused, a snapshot asked for.
        let c = f.check_in(
            "n1",
            pb::CheckInRequest {
                hello: Some(hello()),
                base: "other-1".into(),
                change: Some(labels("2")),
                ..Default::default()
            },
            T,
        );
        assert!(c.send_snapshot);
        assert_eq!(
            f.with("n1", |e| e.report.labels.clone()).unwrap().labels["nvidia.com/gpu.count"],
            "4"
        );
    }

    #[test]
    fn happenings_are_taken_once_and_acknowledged() {
        let (tx, mut rx) = tokio::sync::mpsc::channel(16);
        let f = fleet().with_events(tx);
        let req = |first_seq, n: std::ops::Range<u64>| pb::CheckInRequest {
            hello: Some(hello()),
            snapshot: Some(labels("8")),
            first_seq,
            happenings: n.map(event).collect(),
            ..Default::default()
        };
        assert_eq!(f.check_in("n1", req(1, 1..4), T).acked_seq, 3);
        // The answer was lost: the agent sends 1..3 again, and 4.
        assert_eq!(f.check_in("n1", req(1, 1..5), T).acked_seq, 4);
        let mut told = 0;
        while rx.try_recv().is_ok() {
            told += 1;
        }
        assert_eq!(told, 4, "each event told once");
        assert_eq!(f.with("n1", |e| e.events.len()), 4);
        // A new agent process numbers from 1 again.
        let mut h = hello();
        h.agent_started_at = 8;
        let mut r = req(1, 1..2);
        r.hello = Some(h);
        assert_eq!(f.check_in("n1", r, T).acked_seq, 1);
        assert!(rx.try_recv().is_ok(), "the new process's event is told");
    }

    #[test]
    fn wishes_are_sent_only_when_they_differ_from_what_the_agent_holds() {
        let f = fleet();
        let first = f.check_in(
            "n1",
            pb::CheckInRequest {
                hello: Some(hello()),
                snapshot: Some(labels("8")),
                ..Default::default()
            },
            T,
        );
        assert!(first.desired.is_some());
        assert_ne!(first.desired_version, 0);
        let again = f.check_in(
            "n1",
            pb::CheckInRequest {
                hello: Some(hello()),
                base: first.base.clone(),
                desired_version: first.desired_version,
                ..Default::default()
            },
            T,
        );
        assert_eq!(again.desired, None);
        assert_eq!(again.desired_version, first.desired_version);
        f.set_mig_label("n1", Some("all-1g.10gb".into()));
        let changed = f.check_in(
            "n1",
            pb::CheckInRequest {
                hello: Some(hello()),
                base: first.base,
                desired_version: first.desired_version,
                ..Default::default()
            },
            T,
        );
        assert_eq!(changed.desired.unwrap().mig_layout, "all-1g.10gb");
        // No claims listed yet: none sent, version 0.
        assert_eq!(changed.dra_claims_version, 0);
    }

    #[test]
    fn a_node_that_misses_two_check_ins_is_late() {
        let f = fleet();
        f.check_in(
            "n1",
            pb::CheckInRequest {
                hello: Some(hello()),
                snapshot: Some(labels("8")),
                ..Default::default()
            },
            Duration::from_millis(1),
        );
        assert!(f.with("n1", |e| e.live()));
        assert_eq!(f.checking_in(), 1);
        // Due at last + 2 ms + the slack.
        assert!(f.sweep_check_ins().is_some());
        f.with("n1", |e| {
            e.check_ins.as_mut().unwrap().last -= LATE_AFTER + Duration::from_secs(1)
        });
        assert_eq!(f.sweep_check_ins(), None);
        assert!(!f.with("n1", |e| e.live()));
        assert!(f.with("n1", |e| e.gone.is_some()));
    }
}
