//! What the controller knows of the fleet: each node's latest report as its
//! agent told it, whether a stream is live, and the node's write state. The
//! controller keeps nothing on disk: after a restart the agents reconnect and
//! send their snapshots, and the watch of the nodes (the `drift` worker)
//! says what the API has of each; a node whose conditions the controller
//! owns and whose agent does not come back is marked not reporting once the
//! grace has passed since this replica took over.
//!
//! The store is the middle layer: it uses only the model below it, and the
//! workers above it (the writer, the rollout, the watches, the servers)
//! read and change it through its methods, never each other. Here: the
//! entries, agents' streams coming and going and their messages; by
//! concern, what each agent is sent (`agents.rs`) and the ResourceClaims
//! of its node (`dra_claims.rs`), the rollout's state
//! (`rollout.rs`), the node as the API should have it and has it
//! (`writes.rs`), and what the page and the ClusterPolicy status show
//! (`view.rs`).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gpu_agent_proto::report::v1 as pb;
use tokio::sync::{mpsc, oneshot};

use crate::model::node::{Applied, Observed, TaintPolicy};
use crate::model::node_event::NodeEvent;
use crate::model::policy_texts::PolicyTexts;
use crate::model::upgrade_policy::UpgradePolicy;
use crate::model::upgrade_state::NodeUpgrade;

mod agents;
mod check_in;
mod dra_claims;
mod dra_slices;
mod marks;
mod rollout;
mod shared_rollout;
mod view;
mod writes;

/// Recent health events and repairs kept per node: what `/fleet.json`
/// shows (an XID storm over 10,000 nodes keeps 100,000 at most, not
/// 320,000).
pub(crate) const RECENT: usize = 10;

/// One node, as its agent reported it.
#[derive(Debug, Default)]
pub struct NodeEntry {
    pub hello: Option<pb::Hello>,
    /// A snapshot came since this controller started: `report` is the
    /// agent's word, and the node may be written from it.
    pub reported: bool,
    pub report: pb::NodeReport,
    /// The live stream's id, while one is connected.
    pub stream: Option<u64>,
    /// Closes the live stream (a newer one for the same node replaces it).
    kick: Option<oneshot::Sender<()>>,
    /// Why the last stream ended, while none is live.
    pub gone: Option<String>,
    pub events: VecDeque<pb::HealthEvent>,
    pub repairs: VecDeque<pb::Repair>,
    /// The live stream's way down, and the last Desired sent on it.
    down: Option<Down>,
    sent: Option<pb::Desired>,
    /// The last ResourceClaims list sent on the live stream (dra_claims.rs).
    dra_sent: Option<pb::DraClaims>,
    /// Its check-ins, when its agent checks in (check_in.rs).
    pub check_ins: Option<CheckIns>,
    /// The node's `nvidia.com/mig.config` label, as the API has it.
    pub mig_label: Option<String>,
    /// Its place in a driver rollout, if any.
    pub upgrade: Option<NodeUpgrade>,
    pub write: WriteState,
}

/// A node's check-ins as this replica knows them.
#[derive(Debug)]
pub struct CheckIns {
    /// What the last answer's `base` was.
    pub(super) base: String,
    /// When the node last checked in.
    pub last: Instant,
    /// The interval it was told then.
    pub interval: Duration,
    /// The agent process (boot ID, start time) whose happenings were taken.
    pub(super) agent: (String, u64),
    /// Its happenings taken, up to this number.
    pub(super) taken: u64,
    /// It missed two check-ins ([`Fleet::sweep_check_ins`]).
    pub late: bool,
}

/// A stream's way down to its agent.
pub type Down = mpsc::Sender<Result<pb::ControllerMessage, tonic::Status>>;

/// The writer's bookkeeping for one node.
#[derive(Debug, Default)]
pub struct WriteState {
    /// A change waits to be written.
    pub queued: bool,
    /// The node's name is in the writer's queue.
    pub in_queue: bool,
    /// A write is under way.
    pub writing: bool,
    pub last_write: Option<Instant>,
    /// What the API has, as far as this controller knows (`None`: not read
    /// since the controller started).
    pub applied: Option<Applied>,
    pub last_error: Option<String>,
    /// The node as the watch last saw it while a write was under way
    /// (looked at once the write is over).
    pub seen: Option<Observed>,
}

/// The fleet.
pub struct Fleet {
    /// Each entry boxed: the map's table holds pointers, so growing it
    /// copies 10,000 pointers, not 10,000 entries (measured: 20 MiB of
    /// table at 10,000 nodes inline).
    nodes: Mutex<HashMap<String, Box<NodeEntry>>>,
    queue: mpsc::UnboundedSender<String>,
    next_stream: AtomicU64,
    /// This replica's answers' bases: a number of its own, and a count.
    nonce: u64,
    next_base: AtomicU64,
    pub taint: TaintPolicy,
    /// How long a node's conditions stay as they were after its agent's
    /// stream ends (an agent restarting is not news), and, for a node whose
    /// agent has not connected, after this replica took over.
    pub grace: Duration,
    /// Where health events and repairs go to become Kubernetes Events.
    events: Option<mpsc::Sender<NodeEvent>>,
    /// Events dropped because that queue was full.
    pub events_dropped: AtomicU64,
    /// Check-ins answered since this replica started.
    pub check_ins_answered: AtomicU64,
    /// The cluster's ClusterPolicy as each agent is sent it (the
    /// ConfigMaps it names resolved: config_maps.rs).
    policy: Mutex<Option<std::sync::Arc<PolicyTexts>>>,
    /// Told when what the ClusterPolicy's status says may have changed.
    pub policy_changed: tokio::sync::Notify,
    /// The ClusterPolicy's `spec.driver.upgradePolicy` (`None`: no
    /// ClusterPolicy, no rollout; an error: it cannot be used, in words).
    upgrade_policy: Mutex<Option<Result<UpgradePolicy, String>>>,
    /// Told when an agent's report, a node's upgrade state or the policy
    /// changed: the rollout looks again.
    pub upgrade_changed: tokio::sync::Notify,
    /// Moves of any node's upgrade state so far.
    pub upgrade_moves: AtomicU64,
    /// Each node's ResourceClaims, from the claims watch (`None` until it
    /// listed them all once; dra_claims.rs). Kept through `reset`.
    dra_claims: Mutex<Option<std::collections::BTreeMap<String, pb::DraClaims>>>,
    /// Told the name of each node the writer is told of (dra_slices.rs).
    dra_slices: Option<mpsc::UnboundedSender<String>>,
    /// Which nodes this replica serves and writes (`None`: every one; with
    /// sharding, those of its shards).
    owner: Option<Owner>,
    /// Sharded: what the API has of the driver rollout on each node that
    /// carries any of it, and the leader's moves (shared_rollout.rs).
    marks: Mutex<HashMap<String, marks::Marks>>,
    /// Sharded: the nodes whose label says `upgrade-done` and that carry
    /// nothing more of a rollout (no marks): a replica that takes one's
    /// shard over starts its entry at done, so its label stays, whether
    /// the watch saw the node before or after the shard came (only the
    /// name is kept; locked after `marks` where both are).
    quiet_done: Mutex<std::collections::HashSet<Box<str>>>,
    /// Sharded: whether this replica plans the rollout (`None`: it does not).
    rollout_leader: Option<tokio::sync::watch::Receiver<bool>>,
}

/// Whether this replica serves and writes a node.
pub type Owner = Box<dyn Fn(&str) -> bool + Send + Sync>;

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("nodes", &self.len())
            .finish_non_exhaustive()
    }
}

impl Fleet {
    /// A fleet and the writer's end of its queue.
    pub fn new(taint: TaintPolicy, grace: Duration) -> (Self, mpsc::UnboundedReceiver<String>) {
        let (queue, rx) = mpsc::unbounded_channel();
        (
            Fleet {
                nodes: Mutex::default(),
                queue,
                next_stream: AtomicU64::new(1),
                nonce: {
                    use std::hash::{BuildHasher, Hasher};
                    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
                    h.write_u128(
                        std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map(|t| t.as_nanos())
                            .unwrap_or(0),
                    );
                    h.finish()
                },
                next_base: AtomicU64::new(1),
                taint,
                grace,
                events: None,
                events_dropped: AtomicU64::new(0),
                check_ins_answered: AtomicU64::new(0),
                policy: Mutex::new(None),
                policy_changed: tokio::sync::Notify::new(),
                upgrade_policy: Mutex::new(None),
                upgrade_changed: tokio::sync::Notify::new(),
                upgrade_moves: AtomicU64::new(0),
                dra_claims: Mutex::new(None),
                dra_slices: None,
                owner: None,
                marks: Mutex::default(),
                quiet_done: Mutex::default(),
                rollout_leader: None,
            },
            rx,
        )
    }

    /// Health events and repairs are also sent to `tx` (for Kubernetes
    /// Events); when it is full they are dropped and counted.
    pub fn with_events(mut self, tx: mpsc::Sender<NodeEvent>) -> Self {
        self.events = Some(tx);
        self
    }

    /// Only the nodes `owns` says are served and written (sharding).
    pub fn with_owner(mut self, owns: impl Fn(&str) -> bool + Send + Sync + 'static) -> Self {
        self.owner = Some(Box::new(owns));
        self
    }

    /// Whether this replica serves and writes `node`.
    pub fn owns(&self, node: &str) -> bool {
        self.owner.as_ref().is_none_or(|f| f(node))
    }

    /// The entries of nodes this replica no longer owns are dropped (their
    /// streams closed): their new owner rebuilds them from the agents'
    /// snapshots. Returns how many.
    pub fn forget_unowned(&self) -> usize {
        let mut nodes = self.nodes.lock().unwrap();
        let before = nodes.len();
        nodes.retain(|name, e| {
            let keep = self.owns(name);
            if !keep && let Some(k) = e.kick.take() {
                let _ = k.send(());
            }
            keep
        });
        before - nodes.len()
    }

    fn tell(&self, e: NodeEvent) {
        if let Some(tx) = &self.events
            && tx.try_send(e).is_err()
        {
            let n = self.events_dropped.fetch_add(1, Ordering::Relaxed) + 1;
            if n.is_power_of_two() {
                tracing::warn!(
                    dropped = n,
                    "health events and repairs not made Kubernetes Events: their queue is full"
                );
            }
        }
    }

    /// Runs `f` on a node's entry (made if new).
    pub fn with<T>(&self, node: &str, f: impl FnOnce(&mut NodeEntry) -> T) -> T {
        let mut nodes = self.nodes.lock().unwrap();
        f(nodes
            .entry(node.to_string())
            .or_insert_with(|| self.fresh(node)))
    }

    /// A new entry: sharded, with the node's rollout step as the API has
    /// it (its shard came here in mid-rollout).
    fn fresh(&self, node: &str) -> Box<NodeEntry> {
        Box::new(NodeEntry {
            upgrade: self.marked_step(node),
            ..Default::default()
        })
    }

    /// How many nodes the fleet knows.
    pub fn len(&self) -> usize {
        self.nodes.lock().unwrap().len()
    }

    /// Whether it knows none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every node's name, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.nodes.lock().unwrap().keys().cloned().collect();
        v.sort();
        v
    }

    /// A new stream for `hello.node_name`: an older one for the same node
    /// is closed. Returns the stream's id and what closes it.
    pub fn connect(&self, hello: pb::Hello, down: Down) -> (u64, oneshot::Receiver<()>) {
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let name = hello.node_name.clone();
        self.with(&name, |e| {
            if let Some(old) = e.kick.take() {
                let _ = old.send(());
            }
            e.hello = Some(hello);
            e.stream = Some(id);
            e.kick = Some(tx);
            e.gone = None;
            e.down = Some(down);
            e.sent = None;
            e.dra_sent = None;
        });
        self.send_desired(&name);
        self.send_dra_claims(&name);
        (id, rx)
    }

    /// The stream `id` of `node` ended (a replaced stream changes nothing).
    /// Returns whether the node is now without a stream.
    pub fn disconnect(&self, node: &str, id: u64, why: &str) -> bool {
        self.with(node, |e| {
            if e.stream != Some(id) {
                return false;
            }
            e.stream = None;
            e.kick = None;
            e.down = None;
            tracing::info!(node, why, "agent stream ended");
            self.policy_changed.notify_one();
            true
        })
    }

    /// The grace after a stream ended ran out: if no stream came back, the
    /// node's conditions say its agent is not reporting.
    pub fn expire(&self, node: &str, why: &str) {
        let gone = self.with(node, |e| {
            if e.live() {
                return false;
            }
            e.gone = Some(why.to_string());
            true
        });
        if gone {
            tracing::warn!(node, why, "agent not reporting");
            self.mark_dirty(node);
        }
    }

    /// Takes one message of a live stream.
    pub fn apply(&self, node: &str, body: pb::agent_message::Body) {
        use pb::agent_message::Body;
        match &body {
            Body::HealthEvent(ev) => self.tell(NodeEvent::health(node, ev)),
            Body::Repair(r) => self.tell(NodeEvent::repair(node, r)),
            _ => {}
        }
        // What the driver rollout looks at, before and after the message.
        let rollout_view = |e: &NodeEntry| {
            (
                e.report.upgrade.clone(),
                e.report
                    .inventory
                    .as_ref()
                    .map(|i| i.driver_version.clone()),
                e.report.stages.as_ref().map(|s| s.ready),
            )
        };
        let (dirty, rollout_moved) = self.with(node, |e| {
            let before = rollout_view(e);
            let dirty = match body {
                Body::Snapshot(r) => {
                    e.report = r;
                    e.reported = true;
                    Self::fill_target(e);
                    true
                }
                Body::Change(c) => {
                    let r = &mut e.report;
                    // Every section, by name: a section added to the API and
                    // not taken here does not compile.
                    let pb::NodeReport {
                        inventory,
                        stages,
                        labels,
                        health,
                        mig,
                        upgrade,
                        policy,
                        dra,
                    } = c;
                    macro_rules! take {
                    ($($f:ident),*) => {$( if $f.is_some() { r.$f = $f; } )*};
                }
                    take!(inventory, stages, labels, health, mig, upgrade, policy, dra);
                    Self::fill_target(e);
                    true
                }
                Body::HealthEvent(ev) => {
                    if e.events.len() == RECENT {
                        e.events.pop_front();
                    }
                    e.events.push_back(ev);
                    false
                }
                Body::Repair(r) => {
                    if e.repairs.len() == RECENT {
                        e.repairs.pop_front();
                    }
                    e.repairs.push_back(r);
                    false
                }
                Body::Hello(_) => false,
            };
            (dirty, dirty && rollout_view(e) != before)
        });
        if dirty {
            self.mark_dirty(node);
            self.send_desired(node);
            self.send_dra_claims(node);
            self.policy_changed.notify_one();
        }
        // Most reports change nothing the rollout reads: it is not woken.
        if rollout_moved {
            self.upgrade_changed.notify_one();
        }
    }

    /// A state read back from the node's label has no target yet: the
    /// agent's report says which version it wants.
    fn fill_target(e: &mut NodeEntry) {
        if let (Some(u), Some(r)) = (e.upgrade.as_mut(), e.report.upgrade.as_ref())
            && u.target.is_empty()
        {
            u.target = r.driver_version.clone();
        }
    }

    /// This replica no longer leads: every stream is closed and the fleet
    /// forgotten (the next leader rebuilds it from the agents' snapshots).
    pub fn reset(&self) {
        let mut nodes = self.nodes.lock().unwrap();
        for e in nodes.values_mut() {
            if let Some(k) = e.kick.take() {
                let _ = k.send(());
            }
        }
        nodes.clear();
    }
}
