//! Driver upgrades across the fleet. When the cluster's ClusterPolicy names
//! a driver that a node does not run, that node's agent reports
//! `upgrade-required` (and does not upgrade on its own: it waits for the
//! controller's go-ahead). The controller rolls the change out a few nodes
//! at a time, by the ClusterPolicy's `spec.driver.upgradePolicy` (the GPU
//! Operator's keys), walking each node through NVIDIA's upgrade states,
//! which it keeps in the node's `nvidia.com/gpu-driver-upgrade-state` label:
//!
//! ```text
//! upgrade-required → cordon-required → wait-for-jobs-required
//!   → pod-deletion-required [→ drain-required] → validation-required
//!   → uncordon-required → upgrade-done          (or upgrade-failed)
//! ```
//!
//! - cordon: `spec.unschedulable` set (a node that was cordoned already is
//!   noted in an annotation and left cordoned at the end);
//! - wait for jobs: pods matching `waitForCompletion.podSelector` finish;
//! - pod deletion: the node's pods that use GPUs (any `nvidia.com/`
//!   resource) are evicted through the Eviction API, so disruption budgets
//!   hold; pods not run by a controller, or with `emptyDir` data, are
//!   evicted only when the policy says so (`force`, `deleteEmptyDir`);
//! - drain (when `drain.enable` and pod deletion could not finish): every
//!   pod but DaemonSets' and static ones, by `drain.podSelector`;
//! - validation: the agent is told the version and given the go-ahead; it
//!   unloads, switches, loads and validates (rolling back on failure) and
//!   reports `upgrade-done` with the new driver, or `upgrade-failed`;
//! - uncordon, done.
//!
//! `maxUnavailable` counts every GPU node out of service, not only those
//! upgrading: a node whose kubelet is NotReady, or that someone else
//! cordoned, uses up the allowance as well (the nodes are listed, a page at
//! a time, when a node could start, at most every [`AVAILABILITY_TTL`]). A
//! node cordoned already may start even then (its upgrade takes nothing
//! more out of service); a NotReady one waits until it is Ready. Sharded,
//! the same list counts the GPU nodes of other replicas that are in no
//! rollout (the leader keeps nothing of them), and a percentage is of
//! every GPU node listed.
//!
//! A node that fails stops the rollout: it stays cordoned, its
//! `GPUDriverUpgraded` condition says why, and no further node starts until
//! it is fixed (its agent reports the wanted driver validated; the
//! controller then uncordons it and goes on). The state lives in the API
//! (labels, annotation): a new leader reads it back and carries on.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use kube::core::PartialObjectMeta;

use crate::fleet::Fleet;
use crate::model::node::{CONDITIONS, Observed, UPGRADE_STATE_LABEL};
use crate::model::upgrade_notes::UPGRADE_STEP;
use crate::model::upgrade_plan::{Seen, plan};
use crate::model::upgrade_policy::Amount;
// The rollout's vocabulary, where it was before it moved down into the
// model (the tests use `Step` and `UpgradePolicy` from here).
pub use crate::model::upgrade_policy::{UpgradePolicy, VALIDATION_TIMEOUT};
pub use crate::model::upgrade_state::{INITIAL_UNSCHEDULABLE, NodeUpgrade, Step, Unavailable};

mod pods;
mod steps;

pub use pods::uses_gpus;

/// Set to "true" by an admin on a failed node: try its upgrade again.
pub const UPGRADE_REQUESTED: &str = "nvidia.com/gpu-driver-upgrade-requested";
/// How often a failed node is looked at for that request.
pub const RETRY_LOOK: Duration = Duration::from_secs(30);
/// How often pods are looked at again while a node waits for them.
pub const RECHECK: Duration = Duration::from_secs(5);
/// Changes this close together are looked at once.
const COALESCE: Duration = Duration::from_millis(200);
/// How long one list of the nodes that are out of service serves the
/// rollout (a large fleet is not listed at every report), and how soon a
/// rollout held back by them looks again.
pub const AVAILABILITY_TTL: Duration = Duration::from_secs(10);
/// Nodes per page of that list.
const LIST_PAGE: u32 = 500;
/// Does the API steps of a rollout.
#[derive(Clone)]
pub struct Upgrader {
    nodes: Api<Node>,
    meta: Api<PartialObjectMeta<Node>>,
    pods: Api<Pod>,
    client: kube::Client,
    /// The nodes out of service at the last list, and when it was taken.
    availability: std::sync::Arc<std::sync::Mutex<Option<Availability>>>,
    /// How long that list serves ([`AVAILABILITY_TTL`]).
    availability_ttl: Duration,
    /// `validation-required`'s limit ([`VALIDATION_TIMEOUT`]).
    validation_timeout: Option<Duration>,
    /// Whether this replica leads (`None`: it always does).
    leader: Option<tokio::sync::watch::Receiver<bool>>,
}

/// One list of the nodes that are out of service (see [`Unavailable`]).
#[derive(Debug)]
struct Availability {
    at: Instant,
    down: std::sync::Arc<Listed>,
    /// What the rollout was last held back by, as logged.
    held_by: String,
}

/// What one list of every node says: the nodes out of service, and how
/// many GPU nodes there are (a few bytes whatever the fleet's size).
#[derive(Debug, Default)]
struct Listed {
    /// Each node out of service, and whether it is a GPU node (it carries
    /// the conditions the controller writes).
    down: BTreeMap<String, (Unavailable, bool)>,
    /// The GPU nodes listed.
    gpu: usize,
}

impl std::fmt::Debug for Upgrader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upgrader").finish_non_exhaustive()
    }
}

impl Upgrader {
    pub fn new(client: kube::Client) -> Self {
        Upgrader {
            nodes: Api::all(client.clone()),
            meta: Api::all(client.clone()),
            pods: Api::all(client.clone()),
            client,
            availability: Default::default(),
            availability_ttl: AVAILABILITY_TTL,
            validation_timeout: Some(VALIDATION_TIMEOUT),
            leader: None,
        }
    }

    /// Acts only while `leader` says this replica leads: a lease lost in
    /// the middle of a look stops it before its next API call, and the
    /// next leader carries on from the nodes' labels.
    pub fn with_leader(mut self, leader: tokio::sync::watch::Receiver<bool>) -> Self {
        self.leader = Some(leader);
        self
    }

    fn leading(&self) -> bool {
        self.leader.as_ref().is_none_or(|l| *l.borrow())
    }

    /// How long a node's agent has from the go-ahead to report the new
    /// driver validated (`None`: no limit).
    pub fn with_validation_timeout(mut self, limit: Option<Duration>) -> Self {
        self.validation_timeout = limit;
        self
    }

    /// How long one list of the nodes out of service serves the rollout,
    /// and how soon a rollout held back by them looks again.
    pub fn with_availability_ttl(mut self, ttl: Duration) -> Self {
        self.availability_ttl = ttl;
        self
    }

    /// The nodes out of service (NotReady, cordoned by another), from a
    /// list of every node a page at a time, taken at most every
    /// [`Upgrader::with_availability_ttl`] (or after a cordon or uncordon of ours).
    async fn unavailable_nodes(&self) -> Result<std::sync::Arc<Listed>, kube::Error> {
        if let Some(a) = &*self.availability.lock().unwrap()
            && a.at.elapsed() < self.availability_ttl
        {
            return Ok(a.down.clone());
        }
        let mut down = Listed::default();
        let mut lp = ListParams::default().limit(LIST_PAGE);
        loop {
            let page = self.nodes.list(&lp).await?;
            for n in &page.items {
                let gpu = n
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| CONDITIONS.contains(&c.type_.as_str())));
                down.gpu += usize::from(gpu);
                if let (Some(name), Some(why)) = (&n.metadata.name, Unavailable::of(n)) {
                    down.down.insert(name.clone(), (why, gpu));
                }
            }
            match page.metadata.continue_.as_deref() {
                Some(token) if !token.is_empty() => lp = lp.continue_token(token),
                _ => break,
            }
        }
        let down = std::sync::Arc::new(down);
        let mut a = self.availability.lock().unwrap();
        let held_by = a.take().map(|a| a.held_by).unwrap_or_default();
        *a = Some(Availability {
            at: Instant::now(),
            down: down.clone(),
            held_by,
        });
        Ok(down)
    }

    /// A cordon or uncordon of ours changes what a list would say.
    fn forget_availability(&self) {
        if let Some(a) = &mut *self.availability.lock().unwrap() {
            a.at = Instant::now()
                .checked_sub(self.availability_ttl)
                .unwrap_or(a.at);
        }
    }

    /// Logs what holds the rollout back, when that changed.
    fn log_held_by(&self, held_by: String, allowed: usize) {
        let mut a = self.availability.lock().unwrap();
        let Some(a) = &mut *a else { return };
        if a.held_by != held_by {
            if !held_by.is_empty() {
                tracing::info!(
                    max_unavailable = allowed,
                    out_of_service = %held_by,
                    "driver upgrade: waiting for GPU nodes out of service (maxUnavailable counts them, and a NotReady node does not start)"
                );
            }
            a.held_by = held_by;
        }
    }

    /// Reads back the states the API holds (a new leader carries on where
    /// the last one was).
    pub async fn recover(&self, fleet: &Fleet) -> Result<usize, kube::Error> {
        let list = self
            .meta
            .list_metadata(&ListParams::default().labels(UPGRADE_STATE_LABEL))
            .await?;
        let mut n = 0;
        for m in list.items {
            // Sharded: what a node carries of the rollout (its step: the
            // annotation, else the label), kept unless the watch of the
            // nodes has it already; a node of this replica's takes it.
            if fleet.sharded()
                && let Some(name) = &m.metadata.name
            {
                fleet.recover_noted(name, &Observed::of(&m.metadata, None, None));
                n += 1;
                continue;
            }
            // Not sharded (any more): a step a sharded leader left on the
            // node would mislead the next sharded one; it is taken off.
            if let Some(name) = &m.metadata.name
                && m.metadata
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key(UPGRADE_STEP))
            {
                self.drop_step_note(name).await?;
            }
            let (Some(name), Some(labels)) = (m.metadata.name, m.metadata.labels) else {
                continue;
            };
            let Some(step) = labels
                .get(UPGRADE_STATE_LABEL)
                .and_then(|v| Step::from_label(v))
            else {
                continue;
            };
            // The target version comes with the agent's next report.
            if fleet.recover_upgrade(&name, NodeUpgrade::new(step, "", "")) {
                n += 1;
            }
        }
        Ok(n)
    }

    /// One look at the fleet: states moved on, new nodes started, each
    /// node's API step done. Returns when to look again (`None`: only when
    /// something changes).
    pub async fn step(&self, fleet: &Fleet) -> Option<Duration> {
        if !self.leading() {
            return None;
        }
        let policy = fleet.upgrade_policy()?;
        let policy = match policy {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "driver upgrades are not rolled out");
                return None;
            }
        };
        let moves = fleet
            .upgrade_moves
            .load(std::sync::atomic::Ordering::Relaxed);
        let mut again = None;
        let mut view = fleet.upgrade_view();
        // Only when a node could start are the others' states listed.
        let could_start = |v: &[Seen]| {
            v.iter().any(|s| {
                s.connected
                    && (s.agent_state == "upgrade-required"
                        || s.step.as_ref().map(|u| u.step) == Some(Step::UpgradeRequired))
            })
        };
        let mut this_look = policy.clone();
        this_look.validation_timeout = self.validation_timeout;
        if policy.auto_upgrade && could_start(&view) {
            match self.unavailable_nodes().await {
                Ok(listed) => {
                    for s in &mut view {
                        s.unavailable = listed.down.get(&s.node).map(|d| d.0);
                    }
                    if fleet.sharded() {
                        count_the_unseen(&mut view, &listed, &mut this_look);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot list the nodes to count those out of service; no node starts its driver upgrade until they can be counted");
                    this_look.auto_upgrade = false;
                    again = Some(RECHECK);
                }
            }
        }
        let planned = plan(&this_look, &view);
        for (node, next) in planned.moves {
            fleet.set_upgrade(&node, next);
        }
        // Held back by nodes out of service: they come back without a
        // report, so the rollout looks again.
        if planned.held_back {
            again = Some(self.availability_ttl);
            let out: Vec<String> = view
                .iter()
                .filter(|s| !s.step.as_ref().is_some_and(|u| u.step.in_progress()))
                .filter_map(|s| s.unavailable.map(|w| format!("{} {}", s.node, w.as_str())))
                .collect();
            let mut text = out[..out.len().min(10)].join(", ");
            if out.len() > 10 {
                text.push_str(&format!(" and {} more", out.len() - 10));
            }
            self.log_held_by(text, this_look.max_unavailable.of(view.len()));
        } else if this_look.auto_upgrade {
            self.log_held_by(String::new(), 0);
        }
        for s in fleet.upgrade_view() {
            // A validation's limit is looked at when it passes.
            if let (Some(up), Some(limit)) = (&s.step, this_look.validation_timeout)
                && up.step == Step::ValidationRequired
            {
                let left = limit.saturating_sub(up.since.elapsed());
                again = Some(again.map_or(left, |a: Duration| a.min(left)));
            }
        }
        for s in fleet.upgrade_view() {
            let Some(up) = s.step else { continue };
            if !self.leading() {
                tracing::info!(node = %s.node, "no longer leading: the driver rollout stops here, and the next leader carries on from the nodes' labels");
                return None;
            }
            let result = match up.step {
                Step::CordonRequired => self.cordon(fleet, &s.node, &up).await.map(|_| None),
                Step::WaitForJobsRequired => self.wait_for_jobs(fleet, &s.node, &up, &policy).await,
                Step::PodDeletionRequired => self.remove(fleet, &s.node, &up, &policy, false).await,
                Step::DrainRequired => self.remove(fleet, &s.node, &up, &policy, true).await,
                Step::UncordonRequired => self.uncordon(fleet, &s.node, &up).await.map(|_| None),
                Step::UpgradeFailed => self.retry_requested(fleet, &s.node, &up).await,
                _ => Ok(None),
            };
            match result {
                Ok(Some(d)) => again = Some(again.map_or(d, |a: Duration| a.min(d))),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(node = %s.node, error = %e, "driver upgrade step failed; trying again");
                    again = Some(RECHECK);
                }
            }
        }
        // Sharded: the steps decided written for the nodes' holders.
        for e in self.publish_steps(fleet).await {
            tracing::warn!(error = %e, "driver upgrade step failed; trying again");
            again = Some(RECHECK);
        }
        // A node that moved on may let the next step (or node) go at once.
        if fleet
            .upgrade_moves
            .load(std::sync::atomic::Ordering::Relaxed)
            != moves
        {
            again = Some(Duration::ZERO);
        }
        again
    }
}

/// Sharded, the leader's view lacks the GPU nodes of other replicas that
/// are in no rollout (it keeps nothing of them): as unsharded, they count.
/// Those out of service are added to `view` (against maxUnavailable; never
/// moved, nothing being known of them), and a percentage is of every GPU
/// node listed.
fn count_the_unseen(view: &mut Vec<Seen>, listed: &Listed, policy: &mut UpgradePolicy) {
    let unseen: Vec<Seen> = listed
        .down
        .iter()
        // The view is by name.
        .filter(|(name, (_, gpu))| {
            *gpu && view
                .binary_search_by(|s| s.node.as_str().cmp(name.as_str()))
                .is_err()
        })
        .map(|(name, (why, _))| Seen {
            node: name.clone(),
            step: None,
            agent_state: String::new(),
            agent_version: String::new(),
            agent_detail: String::new(),
            driver_version: String::new(),
            ready: false,
            connected: false,
            reported: false,
            unavailable: Some(*why),
        })
        .collect();
    view.extend(unseen);
    let base = view.len().max(listed.gpu);
    let allowed = policy.max_unavailable.of(base);
    policy.max_unavailable = Amount::Count(u32::try_from(allowed).unwrap_or(u32::MAX));
}

/// Rolls driver upgrades out while this replica leads: a look whenever an
/// agent's upgrade state, the ClusterPolicy or leadership changes, and
/// every few seconds only while a node waits for its pods.
pub async fn run(
    up: Upgrader,
    fleet: std::sync::Arc<Fleet>,
    mut leader: tokio::sync::watch::Receiver<bool>,
) {
    let mut recovered = false;
    let mut again: Option<Duration> = None;
    loop {
        let wait = async {
            match again {
                Some(d) => tokio::time::sleep(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = fleet.upgrade_changed.notified() => {
                // Reports come in bursts: one look for the lot.
                tokio::time::sleep(COALESCE).await;
            }
            _ = wait => {}
            r = leader.changed() => if r.is_err() { return },
        }
        if !*leader.borrow() {
            recovered = false;
            again = None;
            continue;
        }
        if !recovered {
            match up.recover(&fleet).await {
                Ok(n) => {
                    recovered = true;
                    if n > 0 {
                        tracing::info!(
                            nodes = n,
                            "driver upgrades read back from the nodes' labels"
                        );
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the nodes' driver upgrade states; trying again");
                    again = Some(RECHECK);
                    continue;
                }
            }
        }
        again = up.step(&fleet).await;
    }
}
