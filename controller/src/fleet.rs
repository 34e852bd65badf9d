//! What the controller knows of the fleet: each node's latest report as its
//! agent told it, whether a stream is live, and the node's write state. The
//! controller keeps nothing on disk: after a restart the agents reconnect and
//! send their snapshots, and the watch of the nodes ([`crate::drift`]) says
//! what the API has of each; a node whose conditions the controller owns
//! and whose agent does not come back is marked not reporting once the
//! grace has passed since this replica took over.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gpu_agent_proto::report::v1 as pb;
use tokio::sync::{mpsc, oneshot};

use crate::node::{self, Desired, TaintPolicy};
use crate::upgrade::{NodeUpgrade, Seen, Step, UpgradePolicy};
use crate::writer::{Applied, Observed};

/// Recent health events and repairs kept per node.
const RECENT: usize = 32;

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
    /// The node's `nvidia.com/mig.config` label, as the API has it.
    pub mig_label: Option<String>,
    /// Its place in a driver rollout, if any.
    pub upgrade: Option<NodeUpgrade>,
    pub write: WriteState,
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
    pub applied: Option<crate::writer::Applied>,
    pub last_error: Option<String>,
    /// The node as the watch last saw it while a write was under way
    /// (looked at once the write is over).
    pub seen: Option<Observed>,
}

/// The fleet.
#[derive(Debug)]
pub struct Fleet {
    nodes: Mutex<HashMap<String, NodeEntry>>,
    queue: mpsc::UnboundedSender<String>,
    next_stream: AtomicU64,
    pub taint: TaintPolicy,
    /// How long a node's conditions stay as they were after its agent's
    /// stream ends (an agent restarting is not news), and, for a node whose
    /// agent has not connected, after this replica took over.
    pub grace: Duration,
    /// Where health events and repairs go to become Kubernetes Events.
    events: Option<mpsc::Sender<crate::events::NodeEvent>>,
    /// Events dropped because that queue was full.
    pub events_dropped: AtomicU64,
    /// The cluster's ClusterPolicy as each agent is sent it (the
    /// ConfigMaps it names resolved: config_maps.rs).
    policy: Mutex<Option<std::sync::Arc<crate::config_maps::PolicyTexts>>>,
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
                taint,
                grace,
                events: None,
                events_dropped: AtomicU64::new(0),
                policy: Mutex::new(None),
                policy_changed: tokio::sync::Notify::new(),
                upgrade_policy: Mutex::new(None),
                upgrade_changed: tokio::sync::Notify::new(),
                upgrade_moves: AtomicU64::new(0),
            },
            rx,
        )
    }

    /// Health events and repairs are also sent to `tx` (for Kubernetes
    /// Events); when it is full they are dropped and counted.
    pub fn with_events(mut self, tx: mpsc::Sender<crate::events::NodeEvent>) -> Self {
        self.events = Some(tx);
        self
    }

    fn tell(&self, e: crate::events::NodeEvent) {
        if let Some(tx) = &self.events
            && tx.try_send(e).is_err()
        {
            self.events_dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Runs `f` on a node's entry (made if new).
    pub fn with<T>(&self, node: &str, f: impl FnOnce(&mut NodeEntry) -> T) -> T {
        let mut nodes = self.nodes.lock().unwrap();
        f(nodes.entry(node.to_string()).or_default())
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
        });
        self.send_desired(&name);
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

    /// What the controller wants of the node, for its agent.
    fn desired_of(e: &NodeEntry, policy: Option<&str>) -> pb::Desired {
        let up = e
            .upgrade
            .as_ref()
            .filter(|u| u.step != Step::UpgradeDone && !u.target.is_empty());
        pb::Desired {
            mig_layout: e.mig_label.clone().unwrap_or_default(),
            policy_yaml: policy.unwrap_or_default().to_string(),
            driver_version: up.map(|u| u.target.clone()).unwrap_or_default(),
            // Only while the controller waits for the agent to upgrade: a
            // failed node is not told to try again.
            upgrade_go_ahead: up.is_some_and(|u| u.step == Step::ValidationRequired),
            drain: false,
        }
    }

    /// The cluster's ClusterPolicy changed (or went): every agent is told.
    pub fn set_policy(&self, policy: Option<crate::config_maps::PolicyTexts>) {
        {
            let mut p = self.policy.lock().unwrap();
            if p.as_deref() == policy.as_ref() {
                return;
            }
            match &policy {
                Some(t) => {
                    tracing::info!(cluster_policy = %t.name, "sending the ClusterPolicy to the agents")
                }
                None => tracing::info!("no ClusterPolicy: agents keep their own policy"),
            }
            *p = policy.map(std::sync::Arc::new);
        }
        self.policy_changed.notify_one();
        for node in self.names() {
            self.send_desired(&node);
        }
    }

    /// Sends the node's agent what is wanted of it, if that changed.
    pub fn send_desired(&self, node: &str) {
        let policy = self
            .policy
            .lock()
            .unwrap()
            .as_ref()
            .map(|p| p.for_node(node));
        let msg = self.with(node, |e| {
            let want = Self::desired_of(e, policy.as_deref());
            if e.sent.as_ref() == Some(&want) {
                return None;
            }
            let down = e.down.clone()?;
            e.sent = Some(want.clone());
            Some((down, want))
        });
        if let Some((down, want)) = msg {
            tracing::info!(node, mig_layout = %want.mig_layout, driver = %want.driver_version, upgrade_go_ahead = want.upgrade_go_ahead, "telling the agent what is wanted");
            let msg = pb::ControllerMessage {
                seq: 0,
                body: Some(pb::controller_message::Body::Desired(want)),
            };
            // A full queue: the agent is not reading; its stream ends soon.
            if down.try_send(Ok(msg)).is_err() {
                tracing::warn!(node, "the agent does not read its stream");
            }
        }
    }

    /// The node's `nvidia.com/mig.config` label as the API has it now.
    pub fn set_mig_label(&self, node: &str, value: Option<String>) {
        let changed = self.with(node, |e| {
            let changed = e.mig_label != value;
            e.mig_label = value;
            changed
        });
        if changed {
            self.send_desired(node);
        }
    }

    /// Nodes whose `nvidia.com/mig.config` label is set.
    pub fn mig_labelled(&self) -> Vec<String> {
        let nodes = self.nodes.lock().unwrap();
        nodes
            .iter()
            .filter(|(_, e)| e.mig_label.is_some())
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// The grace after a stream ended ran out: if no stream came back, the
    /// node's conditions say its agent is not reporting.
    pub fn expire(&self, node: &str, why: &str) {
        let gone = self.with(node, |e| {
            if e.stream.is_some() {
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
            Body::HealthEvent(ev) => self.tell(crate::events::NodeEvent::health(node, ev)),
            Body::Repair(r) => self.tell(crate::events::NodeEvent::repair(node, r)),
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
                    } = c;
                    macro_rules! take {
                    ($($f:ident),*) => {$( if $f.is_some() { r.$f = $f; } )*};
                }
                    take!(inventory, stages, labels, health, mig, upgrade, policy);
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
    /// the rollout sees it.
    pub fn upgrade_view(&self) -> Vec<Seen> {
        let nodes = self.nodes.lock().unwrap();
        let mut v: Vec<Seen> = nodes
            .iter()
            .filter(|(_, e)| e.hello.is_some() || e.upgrade.is_some())
            .map(|(name, e)| {
                let agent = e.report.upgrade.clone().unwrap_or_default();
                Seen {
                    node: name.clone(),
                    step: e.upgrade.clone(),
                    agent_state: agent.state,
                    agent_version: agent.driver_version,
                    agent_detail: agent.detail,
                    driver_version: e
                        .report
                        .inventory
                        .as_ref()
                        .map(|i| i.driver_version.clone())
                        .unwrap_or_default(),
                    ready: e.report.stages.as_ref().is_some_and(|s| s.ready),
                    connected: e.stream.is_some(),
                    reported: e.report.stages.is_some(),
                    unavailable: None,
                }
            })
            .collect();
        v.sort_by(|a, b| a.node.cmp(&b.node));
        v
    }

    /// Moves a node's upgrade on: written to the node (label, condition),
    /// told to its agent, and said as an Event when the step changed.
    pub fn set_upgrade(&self, node: &str, next: Option<NodeUpgrade>) {
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
            let changed = e.upgrade.as_ref().map(|u| u.step) != next.as_ref().map(|u| u.step);
            // A step decided on an older view must not blank a target the
            // agent's report filled in meanwhile.
            let kept = e.upgrade.as_ref().map(|u| u.target.clone());
            e.upgrade = next.clone();
            if let (Some(u), Some(t)) = (e.upgrade.as_mut(), kept)
                && u.target.is_empty()
            {
                u.target = t;
            }
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
                    self.tell(crate::events::NodeEvent {
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

    /// The node needs writing: queued for the writer unless it is already.
    pub fn mark_dirty(&self, node: &str) {
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

    fn wanted(&self, e: &NodeEntry) -> Desired {
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
                None if seen.ours() => nodes.entry(node.to_string()).or_default(),
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
        let mut nodes = self.nodes.lock().unwrap();
        let Some(e) = nodes.get_mut(node) else {
            return;
        };
        tracing::info!(node, "node deleted");
        if e.stream.is_none() && e.upgrade.is_none() {
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
                .filter(|(_, e)| {
                    e.hello.is_none()
                        && e.stream.is_none()
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

    /// The fleet as the page and `/fleet.json` show it, nodes by name.
    pub fn view(&self) -> serde_json::Value {
        let nodes = self.nodes.lock().unwrap();
        let mut names: Vec<&String> = nodes.keys().collect();
        names.sort();
        let (mut gpus, mut unhealthy, mut connected) = (0usize, 0usize, 0usize);
        let mut rollout: std::collections::BTreeMap<Step, usize> = Default::default();
        let mut failed: Vec<&str> = Vec::new();
        let list: Vec<serde_json::Value> = names
            .into_iter()
            .map(|name| {
                let e = &nodes[name];
                let r = &e.report;
                let health: HashMap<&str, &pb::GpuHealth> = r
                    .health
                    .iter()
                    .flat_map(|h| &h.gpus)
                    .map(|g| (g.uuid.as_str(), g))
                    .collect();
                let inv = r.inventory.clone().unwrap_or_default();
                let gpu_list: Vec<serde_json::Value> = inv
                    .gpus
                    .iter()
                    .map(|g| {
                        let h = health.get(g.uuid.as_str());
                        let healthy = h.is_none_or(|h| h.healthy);
                        gpus += 1;
                        if !healthy {
                            unhealthy += 1;
                        }
                        serde_json::json!({
                            "index": g.index,
                            "uuid": g.uuid,
                            "model": g.model,
                            "pciBusId": g.pci_bus_id,
                            "memoryMiB": g.memory_mib,
                            "healthy": healthy,
                            "reason": h.map(|h| h.reason.as_str()).unwrap_or(""),
                            "advice": h.map(|h| h.advice.as_str()).unwrap_or(""),
                            "migDevices": g.mig_devices.iter().map(|m| &m.profile).collect::<Vec<_>>(),
                        })
                    })
                    .collect();
                if e.stream.is_some() {
                    connected += 1;
                }
                let desired = self.wanted(e);
                let api = e.write.applied.as_ref();
                let (conditions, tainted) = match api.and_then(|a| a.conditions.as_ref()) {
                    // Not reported to this replica yet, within the grace:
                    // as the API has them.
                    Some(c) if !e.reported && e.gone.is_none() => (
                        c.iter().map(|(c, _)| c.clone()).collect(),
                        api.and_then(|a| a.taint).unwrap_or(false),
                    ),
                    _ => (desired.conditions, desired.taint),
                };
                if let Some(u) = &e.upgrade {
                    *rollout.entry(u.step).or_insert(0usize) += 1;
                    if u.step == Step::UpgradeFailed {
                        failed.push(name.as_str());
                    }
                }
                serde_json::json!({
                    "name": name,
                    "connected": e.stream.is_some(),
                    "notReporting": e.gone,
                    "agentVersion": e.hello.as_ref().map(|h| h.agent_version.as_str()).unwrap_or(""),
                    "driverVersion": inv.driver_version,
                    "cudaVersion": inv.cuda_version,
                    "simulated": inv.simulated,
                    "ready": r.stages.as_ref().is_some_and(|s| s.ready),
                    "gpus": gpu_list,
                    "conditions": conditions.iter().map(|c| serde_json::json!({
                        "type": c.kind, "status": c.status, "reason": c.reason, "message": c.message,
                    })).collect::<Vec<_>>(),
                    "tainted": tainted,
                    "mig": r.mig.as_ref().map(|m| serde_json::json!({"layout": m.layout, "state": m.state, "detail": m.detail})),
                    "upgrade": e.upgrade.as_ref().map(|u| serde_json::json!({"state": u.step.label(), "driverVersion": u.target, "detail": u.detail})),
                    "events": e.events.iter().rev().take(10).map(|ev| serde_json::json!({
                        "gpu": ev.gpu_uuid, "xid": ev.xid, "reason": ev.reason, "advice": ev.advice,
                        "unhealthy": ev.unhealthy, "atUnixMs": ev.at_unix_ms,
                    })).collect::<Vec<_>>(),
                    "repairs": e.repairs.iter().rev().take(10).map(|r| serde_json::json!({
                        "stage": r.stage, "what": r.what, "atUnix": r.at_unix,
                    })).collect::<Vec<_>>(),
                    "writeError": e.write.last_error,
                })
            })
            .collect();
        // The driver rollout in one line: how many nodes at each step.
        let rollout = (!rollout.is_empty()).then(|| {
            let mut text = format!(
                "driver rollout: {}",
                rollout
                    .iter()
                    .map(|(step, n)| format!("{n} {}", step.label()))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            if !failed.is_empty() {
                text.push_str(&format!("; stopped by {}", failed.join(", ")));
            }
            text
        });
        serde_json::json!({
            "summary": {
                "nodes": list.len(),
                "connected": connected,
                "gpus": gpus,
                "unhealthyGpus": unhealthy,
                "rollout": rollout,
            },
            "nodes": list,
        })
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

    /// The running ClusterPolicy's name, and what its status should say:
    /// (ready, message). `None` when no ClusterPolicy is sent.
    pub fn policy_status(&self) -> Option<(String, bool, String)> {
        let policy = self.policy.lock().unwrap().clone()?;
        let name = policy.name.clone();
        let nodes = self.nodes.lock().unwrap();
        let mut names: Vec<&String> = nodes
            .keys()
            .filter(|n| nodes[*n].stream.is_some())
            .collect();
        names.sort();
        let mut ignored = std::collections::BTreeSet::new();
        let mut problems = Vec::new();
        for n in &names {
            let r = &nodes[*n].report;
            let p = r.policy.clone().unwrap_or_default();
            ignored.extend(p.ignored_keys.iter().cloned());
            if !p.error.is_empty() {
                problems.push(format!("{n}: the policy is not applied: {}", p.error));
            } else if p.source != "ClusterPolicy" {
                problems.push(format!("{n}: not running it yet"));
            } else if !r.stages.as_ref().is_some_and(|s| s.ready) {
                problems.push(format!("{n}: not every stage is validated"));
            }
        }
        // ConfigMaps it names that are not used come first.
        let unused = policy.problems_for(&names);
        let mut message = unused.iter().map(|p| format!("{p}; ")).collect::<String>();
        message.push_str(&format!(
            "{} of {} reporting nodes run it",
            names.len() - problems.len(),
            names.len()
        ));
        if !problems.is_empty() {
            message.push_str(&format!(" ({})", problems.join("; ")));
        }
        if !ignored.is_empty() {
            message.push_str(&format!(
                "; keys gpu-agent does not use: {}",
                ignored.into_iter().collect::<Vec<_>>().join(", ")
            ));
        }
        Some((name, problems.is_empty() && unused.is_empty(), message))
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
