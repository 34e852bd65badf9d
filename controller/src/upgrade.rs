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
//! more out of service); a NotReady one waits until it is Ready.
//!
//! A node that fails stops the rollout: it stays cordoned, its
//! `GPUDriverUpgraded` condition says why, and no further node starts until
//! it is fixed (its agent reports the wanted driver validated; the
//! controller then uncordons it and goes on). The state lives in the API
//! (labels, annotation): a new leader reads it back and carries on.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::Eviction;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::core::PartialObjectMeta;
use serde_json::{Value, json};

use crate::fleet::Fleet;
use crate::node::{FIELD_MANAGER, UPGRADE_STATE_LABEL};

/// Whether a node was unschedulable before its upgrade began ("true": it
/// is left cordoned afterwards); set with the cordon, removed at the end.
pub const INITIAL_UNSCHEDULABLE: &str =
    "nvidia.com/gpu-driver-upgrade.node-initial-state.unschedulable";
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
/// How long a node's agent has, by default, from the go-ahead to report
/// the new driver validated (it withdraws its GPUs, waits for their
/// processes, unloads, switches, loads and validates).
pub const VALIDATION_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// Why a node is out of service apart from its upgrade.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unavailable {
    /// Its `Ready` condition is not `True`.
    NotReady,
    /// `spec.unschedulable`, set by someone else (not by a rollout).
    Cordoned,
}

impl Unavailable {
    pub fn as_str(self) -> &'static str {
        match self {
            Unavailable::NotReady => "NotReady",
            Unavailable::Cordoned => "cordoned",
        }
    }

    /// Of a Node object: `None` when it is in service (or nothing is
    /// known of its status).
    pub fn of(n: &Node) -> Option<Unavailable> {
        let not_ready = n
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
            .is_some_and(|c| c.status != "True");
        if not_ready {
            return Some(Unavailable::NotReady);
        }
        let unschedulable = n
            .spec
            .as_ref()
            .and_then(|s| s.unschedulable)
            .unwrap_or(false);
        // Our own cordon notes the node was schedulable before.
        let ours = annotation(n, INITIAL_UNSCHEDULABLE) == Some("false");
        (unschedulable && !ours).then_some(Unavailable::Cordoned)
    }
}

/// NVIDIA's per-node upgrade states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Step {
    UpgradeRequired,
    CordonRequired,
    WaitForJobsRequired,
    PodDeletionRequired,
    DrainRequired,
    ValidationRequired,
    UncordonRequired,
    UpgradeDone,
    UpgradeFailed,
}

impl Step {
    pub const ALL: [Step; 9] = [
        Step::UpgradeRequired,
        Step::CordonRequired,
        Step::WaitForJobsRequired,
        Step::PodDeletionRequired,
        Step::DrainRequired,
        Step::ValidationRequired,
        Step::UncordonRequired,
        Step::UpgradeDone,
        Step::UpgradeFailed,
    ];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            Step::UpgradeRequired => "upgrade-required",
            Step::CordonRequired => "cordon-required",
            Step::WaitForJobsRequired => "wait-for-jobs-required",
            Step::PodDeletionRequired => "pod-deletion-required",
            Step::DrainRequired => "drain-required",
            Step::ValidationRequired => "validation-required",
            Step::UncordonRequired => "uncordon-required",
            Step::UpgradeDone => "upgrade-done",
            Step::UpgradeFailed => "upgrade-failed",
        }
    }

    pub fn from_label(s: &str) -> Option<Step> {
        Step::ALL.into_iter().find(|st| st.label() == s)
    }

    /// Between the start of a node's upgrade and its end: the node is
    /// unavailable and counts against `maxParallelUpgrades`.
    pub fn in_progress(self) -> bool {
        matches!(
            self,
            Step::CordonRequired
                | Step::WaitForJobsRequired
                | Step::PodDeletionRequired
                | Step::DrainRequired
                | Step::ValidationRequired
                | Step::UncordonRequired
        )
    }

    /// The condition's reason (CamelCase).
    fn reason(self) -> &'static str {
        match self {
            Step::UpgradeRequired => "UpgradeRequired",
            Step::CordonRequired => "CordonRequired",
            Step::WaitForJobsRequired => "WaitForJobsRequired",
            Step::PodDeletionRequired => "PodDeletionRequired",
            Step::DrainRequired => "DrainRequired",
            Step::ValidationRequired => "ValidationRequired",
            Step::UncordonRequired => "UncordonRequired",
            Step::UpgradeDone => "UpgradeDone",
            Step::UpgradeFailed => "UpgradeFailed",
        }
    }
}

/// One node's place in a rollout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeUpgrade {
    pub step: Step,
    /// The driver version the node is being moved to.
    pub target: String,
    /// When this step began (its timeout counts from here; after a
    /// controller restart, from when the new leader read it back).
    pub since: Instant,
    /// What happened, in words (why it failed, what it waits for).
    pub detail: String,
}

impl NodeUpgrade {
    pub fn new(step: Step, target: &str, detail: impl Into<String>) -> Self {
        NodeUpgrade {
            step,
            target: target.to_string(),
            since: Instant::now(),
            detail: detail.into(),
        }
    }

    /// The `GPUDriverUpgraded` condition: `True` once done, else `False`
    /// with the step as reason and the detail as message.
    pub fn condition(&self) -> crate::node::Condition {
        let status = if self.step == Step::UpgradeDone {
            "True"
        } else {
            "False"
        };
        let mut message = match self.step {
            Step::UpgradeDone => format!("driver {} validated", self.target),
            Step::UpgradeFailed => format!("upgrade to driver {} failed", self.target),
            s => format!("upgrading to driver {}: {}", self.target, s.label()),
        };
        if !self.detail.is_empty() {
            message.push_str(": ");
            message.push_str(&self.detail);
        }
        crate::node::Condition {
            kind: crate::node::UPGRADE_CONDITION,
            status,
            reason: self.step.reason().into(),
            message: crate::node::cut(message),
        }
    }
}

/// A count of nodes, or a percentage of them (`maxUnavailable`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Amount {
    Count(u32),
    Percent(u32),
}

impl Amount {
    /// Of `total` nodes: a percentage rounds up.
    pub fn of(self, total: usize) -> usize {
        match self {
            Amount::Count(n) => n as usize,
            Amount::Percent(p) => (total * p as usize).div_ceil(100),
        }
    }
}

/// A duration in words: `30 min`, `90 s`, `400 ms`.
fn span(d: Duration) -> String {
    let s = d.as_secs();
    if s == 0 {
        format!("{} ms", d.as_millis())
    } else if s >= 60 && s.is_multiple_of(60) {
        format!("{} min", s / 60)
    } else {
        format!("{s} s")
    }
}

/// How long a step may take (`None`: no limit, the API's `0`).
fn limit(seconds: u64) -> Option<Duration> {
    (seconds > 0).then(|| Duration::from_secs(seconds))
}

/// Which pods a step removes, and what it may do to them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Removal {
    /// Evict pods no controller runs (they are not recreated).
    pub force: bool,
    /// Evict pods with `emptyDir` volumes (their data is lost).
    pub delete_empty_dir: bool,
    pub timeout: Option<Duration>,
    /// A label selector (`drain.podSelector`), empty: every pod.
    pub selector: String,
}

/// `spec.driver.upgradePolicy` of the ClusterPolicy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpgradePolicy {
    pub auto_upgrade: bool,
    /// Nodes upgrading at once; 0: no limit.
    pub max_parallel: u32,
    pub max_unavailable: Amount,
    /// `waitForCompletion`: pods to wait for, and how long.
    pub wait_selector: String,
    pub wait_timeout: Option<Duration>,
    /// `gpuPodDeletion`.
    pub pod_deletion: Removal,
    /// `drain`, when enabled.
    pub drain: Option<Removal>,
    /// How long `validation-required` may last (the agent's switch and
    /// validation) before the node is `upgrade-failed`; not a key of the
    /// ClusterPolicy: gpu-controller's `--upgrade-validation-timeout-seconds`.
    pub validation_timeout: Option<Duration>,
}

impl Default for UpgradePolicy {
    /// The GPU Operator's defaults.
    fn default() -> Self {
        UpgradePolicy {
            auto_upgrade: true,
            max_parallel: 1,
            max_unavailable: Amount::Percent(25),
            wait_selector: String::new(),
            wait_timeout: None,
            pod_deletion: Removal {
                force: false,
                delete_empty_dir: false,
                timeout: limit(300),
                selector: String::new(),
            },
            drain: None,
            validation_timeout: Some(VALIDATION_TIMEOUT),
        }
    }
}

/// A key of `spec.driver.upgradePolicy` that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("spec.driver.upgradePolicy{key}: {why}")]
pub struct PolicyError {
    /// The key under `upgradePolicy`, with its leading dot.
    pub key: String,
    pub why: String,
}

impl UpgradePolicy {
    /// Reads it from a ClusterPolicy's `spec` (absent keys take the GPU
    /// Operator's defaults). Keys the operator has and gpu-agent does not
    /// use are left alone; a wrong type or value is an error naming it.
    pub fn from_spec(spec: &Value) -> Result<UpgradePolicy, PolicyError> {
        let mut p = UpgradePolicy::default();
        let Some(u) = spec.pointer("/driver/upgradePolicy") else {
            return Ok(p);
        };
        let err = |key: &str, why: &str| PolicyError {
            key: format!(".{key}"),
            why: why.into(),
        };
        if !u.is_object() {
            return Err(PolicyError {
                key: String::new(),
                why: "expected a mapping".into(),
            });
        }
        let bool_at = |key: &str, default: bool| -> Result<bool, PolicyError> {
            match u.pointer(&format!("/{}", key.replace('.', "/"))) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Bool(b)) => Ok(*b),
                Some(_) => Err(err(key, "expected true or false")),
            }
        };
        let uint_at = |key: &str, default: u64| -> Result<u64, PolicyError> {
            match u.pointer(&format!("/{}", key.replace('.', "/"))) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v
                    .as_u64()
                    .ok_or_else(|| err(key, "expected a whole number, 0 or more")),
            }
        };
        let str_at = |key: &str| -> Result<String, PolicyError> {
            match u.pointer(&format!("/{}", key.replace('.', "/"))) {
                None | Some(Value::Null) => Ok(String::new()),
                Some(Value::String(s)) => Ok(s.clone()),
                Some(_) => Err(err(key, "expected a label selector (a string)")),
            }
        };
        p.auto_upgrade = bool_at("autoUpgrade", true)?;
        p.max_parallel = u32::try_from(uint_at("maxParallelUpgrades", 1)?)
            .map_err(|_| err("maxParallelUpgrades", "too large"))?;
        p.max_unavailable = match u.get("maxUnavailable") {
            None | Some(Value::Null) => Amount::Percent(25),
            Some(Value::Number(n)) => Amount::Count(
                n.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| err("maxUnavailable", "expected a count or a percentage"))?,
            ),
            Some(Value::String(s)) => {
                let bad = || {
                    err(
                        "maxUnavailable",
                        &format!("{s:?} is not a count or a percentage like 25%"),
                    )
                };
                match s.strip_suffix('%') {
                    Some(p) => {
                        Amount::Percent(p.parse().ok().filter(|p| *p <= 100).ok_or_else(bad)?)
                    }
                    None => Amount::Count(s.parse().map_err(|_| bad())?),
                }
            }
            Some(_) => return Err(err("maxUnavailable", "expected a count or a percentage")),
        };
        p.wait_selector = str_at("waitForCompletion.podSelector")?;
        p.wait_timeout = limit(uint_at("waitForCompletion.timeoutSeconds", 0)?);
        p.pod_deletion = Removal {
            force: bool_at("gpuPodDeletion.force", false)?,
            delete_empty_dir: bool_at("gpuPodDeletion.deleteEmptyDir", false)?,
            timeout: limit(uint_at("gpuPodDeletion.timeoutSeconds", 300)?),
            selector: String::new(),
        };
        p.drain = if bool_at("drain.enable", false)? {
            Some(Removal {
                force: bool_at("drain.force", false)?,
                delete_empty_dir: bool_at("drain.deleteEmptyDir", false)?,
                timeout: limit(uint_at("drain.timeoutSeconds", 300)?),
                selector: str_at("drain.podSelector")?,
            })
        } else {
            None
        };
        Ok(p)
    }
}

/// What the orchestrator sees of one node.
#[derive(Clone, Debug)]
pub struct Seen {
    pub node: String,
    pub step: Option<NodeUpgrade>,
    /// The agent's own word: its upgrade state and the version it wants.
    pub agent_state: String,
    pub agent_version: String,
    pub agent_detail: String,
    /// The driver the agent reports loaded, and whether every stage validated.
    pub driver_version: String,
    pub ready: bool,
    /// The agent's stream is live, and it sent a report since this
    /// controller started (else nothing is known of it yet).
    pub connected: bool,
    pub reported: bool,
    /// Out of service apart from an upgrade (NotReady, cordoned by
    /// someone else); `None` also when not looked at.
    pub unavailable: Option<Unavailable>,
}

/// What [`plan`] decided.
#[derive(Debug)]
pub struct Planned {
    /// The nodes whose state changed, with the new state (`None`: no
    /// upgrade any more).
    pub moves: Vec<(String, Option<NodeUpgrade>)>,
    /// A node that could start was held back by nodes out of service
    /// (NotReady, cordoned by another, itself NotReady): they come back
    /// without a report, so the rollout must look again.
    pub held_back: bool,
}

/// Moves each node's state on from what its agent says, then starts the
/// next nodes the policy allows. Pure: the API steps follow in [`Upgrader`].
pub fn plan(policy: &UpgradePolicy, nodes: &[Seen]) -> Planned {
    let mut out: BTreeMap<String, Option<NodeUpgrade>> = BTreeMap::new();
    let mut now: BTreeMap<&str, Option<Step>> = BTreeMap::new();
    for n in nodes {
        let cur = n.step.as_ref().map(|s| s.step);
        // validation-required past its limit: the agent did not report the
        // driver validated (it may be gone): the node fails, visibly.
        let timed_out = |s: &NodeUpgrade| -> Option<NodeUpgrade> {
            let limit = policy.validation_timeout?;
            if s.step != Step::ValidationRequired || s.since.elapsed() < limit {
                return None;
            }
            let mut why = format!(
                "the agent did not report driver {} validated within {}",
                s.target,
                span(limit)
            );
            if !n.connected {
                why.push_str("; it is not connected");
            } else if !n.agent_detail.is_empty() {
                why.push_str("; it last said: ");
                why.push_str(&n.agent_detail);
            }
            Some(NodeUpgrade::new(Step::UpgradeFailed, &s.target, why))
        };
        if !n.reported {
            // Nothing is known of the node yet (a state read back from its
            // label waits for its agent's report), but for a validation
            // that took too long.
            match n.step.as_ref().and_then(timed_out) {
                Some(failed) => {
                    now.insert(&n.node, Some(Step::UpgradeFailed));
                    out.insert(n.node.clone(), Some(failed));
                }
                None => {
                    now.insert(&n.node, cur);
                }
            }
            continue;
        }
        let wants = n.agent_state == "upgrade-required" && !n.agent_version.is_empty();
        // The agent's word that the version is loaded and validated (its
        // inventory may still show the one it discovered before).
        let done_with =
            |target: &str| n.agent_state == "upgrade-done" && n.agent_version == target && n.ready;
        let next: Option<Option<NodeUpgrade>> = match (&n.step, cur) {
            (None, _) | (_, Some(Step::UpgradeDone)) if wants => Some(Some(NodeUpgrade::new(
                Step::UpgradeRequired,
                &n.agent_version,
                format!("driver {} loaded", n.driver_version),
            ))),
            // The cluster asks for the running driver again.
            (Some(_), Some(Step::UpgradeRequired)) if !wants => Some(None),
            (Some(s), Some(Step::UpgradeRequired)) if s.target != n.agent_version => {
                Some(Some(NodeUpgrade::new(
                    Step::UpgradeRequired,
                    &n.agent_version,
                    format!("driver {} loaded", n.driver_version),
                )))
            }
            (Some(s), Some(Step::ValidationRequired)) if done_with(&s.target) => Some(Some(
                NodeUpgrade::new(Step::UncordonRequired, &s.target, n.agent_detail.clone()),
            )),
            (Some(s), Some(Step::ValidationRequired)) if n.agent_state == "upgrade-failed" => {
                Some(Some(NodeUpgrade::new(
                    Step::UpgradeFailed,
                    &s.target,
                    n.agent_detail.clone(),
                )))
            }
            (Some(s), Some(Step::ValidationRequired)) if timed_out(s).is_some() => {
                Some(timed_out(s))
            }
            (Some(s), Some(Step::UpgradeFailed)) if done_with(&s.target) => {
                Some(Some(NodeUpgrade::new(
                    Step::UncordonRequired,
                    &s.target,
                    "fixed: the agent reports it validated",
                )))
            }
            // The cluster changed its mind in mid-upgrade: a node that runs
            // what is wanted now is done; one that wants another version
            // goes on towards that one.
            (Some(s), Some(st))
                if (st.in_progress() || st == Step::UpgradeFailed)
                    && st != Step::UncordonRequired
                    && n.agent_state == "upgrade-done"
                    && n.ready
                    && !n.agent_version.is_empty()
                    && n.agent_version != s.target =>
            {
                Some(Some(NodeUpgrade::new(
                    Step::UncordonRequired,
                    &n.agent_version,
                    "the cluster now asks for the driver it runs",
                )))
            }
            (Some(s), Some(st))
                if st.in_progress()
                    && wants
                    && !s.target.is_empty()
                    && n.agent_version != s.target =>
            {
                Some(Some(NodeUpgrade {
                    target: n.agent_version.clone(),
                    ..s.clone()
                }))
            }
            _ => None,
        };
        let step = match &next {
            Some(s) => s.as_ref().map(|s| s.step),
            None => cur,
        };
        now.insert(&n.node, step);
        if let Some(s) = next {
            out.insert(n.node.clone(), s);
        }
    }
    let in_progress = now.values().flatten().filter(|s| s.in_progress()).count();
    let failed = now
        .values()
        .flatten()
        .filter(|s| **s == Step::UpgradeFailed)
        .count();
    let mut held_back = false;
    if policy.auto_upgrade && failed == 0 {
        let allowed = policy.max_unavailable.of(nodes.len());
        let mut upgrading = in_progress;
        // Out of service now: upgrading, NotReady or cordoned by another.
        let upgrading_now = |n: &Seen| {
            now.get(n.node.as_str())
                .copied()
                .flatten()
                .is_some_and(Step::in_progress)
        };
        let mut down = nodes
            .iter()
            .filter(|n| n.unavailable.is_some() || upgrading_now(n))
            .count();
        let others_out = nodes
            .iter()
            .any(|n| n.unavailable.is_some() && !upgrading_now(n));
        for n in nodes {
            if now.get(n.node.as_str()).copied().flatten() != Some(Step::UpgradeRequired) {
                continue;
            }
            // A node whose agent is away would be cordoned and drained for
            // an upgrade nobody can do; a NotReady one's pods cannot be
            // moved off it.
            if !n.connected {
                continue;
            }
            if n.unavailable == Some(Unavailable::NotReady) {
                held_back = true;
                continue;
            }
            if policy.max_parallel > 0 && upgrading >= policy.max_parallel as usize {
                break;
            }
            // A node cordoned already takes nothing more out of service.
            let already_down = n.unavailable.is_some();
            if !already_down && down >= allowed {
                held_back |= others_out;
                continue;
            }
            let target = out
                .get(&n.node)
                .cloned()
                .flatten()
                .or_else(|| n.step.clone())
                .map(|s| s.target)
                .unwrap_or_default();
            out.insert(
                n.node.clone(),
                Some(NodeUpgrade::new(Step::CordonRequired, &target, "")),
            );
            upgrading += 1;
            if !already_down {
                down += 1;
            }
        }
    }
    Planned {
        moves: out.into_iter().collect(),
        held_back,
    }
}

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
    down: std::sync::Arc<BTreeMap<String, Unavailable>>,
    /// What the rollout was last held back by, as logged.
    held_by: String,
}

/// An API step that failed (tried again at the next look).
#[derive(Debug, thiserror::Error)]
#[error("node {node}: {what}: {source}")]
pub struct StepError {
    node: String,
    what: String,
    #[source]
    source: kube::Error,
}

/// A pod as a step sees it.
struct PodInfo {
    namespace: String,
    name: String,
    /// Its deletion began (evicted, deleted): when, and the grace period
    /// it was given.
    terminating: Option<(String, Option<i64>)>,
    /// Why it may not be evicted, if so.
    refused: Option<String>,
}

impl PodInfo {
    /// `ns/name`, or `ns/name (terminating since T, grace period N s)`.
    fn said(&self) -> String {
        match &self.terminating {
            None => format!("{}/{}", self.namespace, self.name),
            Some((since, grace)) => format!(
                "{}/{} (terminating since {since}{})",
                self.namespace,
                self.name,
                grace.map_or(String::new(), |g| format!(", grace period {g} s"))
            ),
        }
    }
}

/// What keeps a removal step waiting, in words: the pods still running
/// and those still terminating, apart.
fn left(pods: &[PodInfo]) -> String {
    let running: Vec<String> = pods
        .iter()
        .filter(|p| p.terminating.is_none())
        .map(PodInfo::said)
        .collect();
    let terminating: Vec<String> = pods
        .iter()
        .filter(|p| p.terminating.is_some())
        .map(PodInfo::said)
        .collect();
    let mut parts = Vec::new();
    if !running.is_empty() {
        parts.push(format!("{} still running", running.join(", ")));
    }
    if !terminating.is_empty() {
        parts.push(format!("{} still terminating", terminating.join(", ")));
    }
    parts.join("; ")
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
    async fn unavailable_nodes(
        &self,
    ) -> Result<std::sync::Arc<BTreeMap<String, Unavailable>>, kube::Error> {
        if let Some(a) = &*self.availability.lock().unwrap()
            && a.at.elapsed() < self.availability_ttl
        {
            return Ok(a.down.clone());
        }
        let mut down = BTreeMap::new();
        let mut lp = ListParams::default().limit(LIST_PAGE);
        loop {
            let page = self.nodes.list(&lp).await?;
            for n in &page.items {
                if let (Some(name), Some(why)) = (&n.metadata.name, Unavailable::of(n)) {
                    down.insert(name.clone(), why);
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
                Ok(down) => {
                    for s in &mut view {
                        s.unavailable = down.get(&s.node).copied();
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
            self.log_held_by(text, policy.max_unavailable.of(view.len()));
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

    fn api_err(node: &str, what: &str) -> impl FnOnce(kube::Error) -> StepError {
        let (node, what) = (node.to_string(), what.to_string());
        move |source| StepError { node, what, source }
    }

    async fn read_node(&self, node: &str) -> Result<Node, StepError> {
        self.nodes
            .get(node)
            .await
            .map_err(Self::api_err(node, "reading the node"))
    }

    /// A merge patch of the node under our field manager; `what` names it
    /// in an error.
    async fn patch_node(&self, node: &str, body: &Value, what: &str) -> Result<(), StepError> {
        self.nodes
            .patch(node, &merge_params(), &Patch::Merge(body))
            .await
            .map(|_| ())
            .map_err(Self::api_err(node, what))
    }

    async fn cordon(&self, fleet: &Fleet, node: &str, up: &NodeUpgrade) -> Result<(), StepError> {
        let n = self.read_node(node).await?;
        let was = n
            .spec
            .as_ref()
            .and_then(|s| s.unschedulable)
            .unwrap_or(false);
        let noted = annotation(&n, INITIAL_UNSCHEDULABLE).is_some();
        let mut body = json!({ "spec": { "unschedulable": true } });
        // The state before the upgrade is noted once, with the cordon: a
        // retry (or a new leader) finds it and does not take its own
        // cordon for the admin's.
        if !noted {
            let before = if was { "true" } else { "false" };
            body["metadata"] = json!({ "annotations": { INITIAL_UNSCHEDULABLE: before } });
        }
        self.patch_node(node, &body, "cordoning").await?;
        self.forget_availability();
        tracing::info!(node, to = %up.target, already_cordoned = was, "driver upgrade: node cordoned");
        fleet.set_upgrade(
            node,
            Some(NodeUpgrade::new(Step::WaitForJobsRequired, &up.target, "")),
        );
        Ok(())
    }

    /// A failed node is tried again when an admin asks, with the GPU
    /// Operator's annotation `nvidia.com/gpu-driver-upgrade-requested=true`
    /// (looked for every [`RETRY_LOOK`] while a node is failed): its GPU
    /// pods are looked at again and its agent given a new go-ahead.
    async fn retry_requested(
        &self,
        fleet: &Fleet,
        node: &str,
        up: &NodeUpgrade,
    ) -> Result<Option<Duration>, StepError> {
        let n = self.read_node(node).await?;
        let asked = annotation(&n, UPGRADE_REQUESTED) == Some("true");
        if !asked {
            return Ok(Some(RETRY_LOOK));
        }
        let body = json!({ "metadata": { "annotations": { UPGRADE_REQUESTED: null } } });
        self.patch_node(node, &body, "taking the retry request")
            .await?;
        tracing::info!(node, to = %up.target, "driver upgrade: tried again, as asked");
        fleet.set_upgrade(
            node,
            Some(NodeUpgrade::new(
                Step::PodDeletionRequired,
                &up.target,
                "tried again, as asked",
            )),
        );
        Ok(Some(Duration::ZERO))
    }

    async fn uncordon(&self, fleet: &Fleet, node: &str, up: &NodeUpgrade) -> Result<(), StepError> {
        let n = self.read_node(node).await?;
        let keep = annotation(&n, INITIAL_UNSCHEDULABLE) == Some("true");
        let mut body = json!({ "metadata": { "annotations": { INITIAL_UNSCHEDULABLE: null } } });
        if !keep {
            body["spec"] = json!({ "unschedulable": false });
        }
        self.patch_node(node, &body, "uncordoning").await?;
        self.forget_availability();
        tracing::info!(node, driver = %up.target, left_cordoned = keep, "driver upgrade done");
        let mut detail = up.detail.clone();
        if keep {
            if !detail.is_empty() {
                detail.push_str("; ");
            }
            detail.push_str("left cordoned: it was before the upgrade");
        }
        fleet.set_upgrade(
            node,
            Some(NodeUpgrade::new(Step::UpgradeDone, &up.target, detail)),
        );
        Ok(())
    }

    /// The node's pods that still run (not finished), with `selector`.
    async fn pods_on(&self, node: &str, selector: &str) -> Result<Vec<Pod>, StepError> {
        let mut lp = ListParams::default().fields(&format!("spec.nodeName={node}"));
        if !selector.is_empty() {
            lp = lp.labels(selector);
        }
        let list = self
            .pods
            .list(&lp)
            .await
            .map_err(Self::api_err(node, "listing its pods"))?;
        Ok(list
            .items
            .into_iter()
            .filter(|p| {
                !matches!(
                    p.status.as_ref().and_then(|s| s.phase.as_deref()),
                    Some("Succeeded" | "Failed")
                )
            })
            .collect())
    }

    async fn wait_for_jobs(
        &self,
        fleet: &Fleet,
        node: &str,
        up: &NodeUpgrade,
        policy: &UpgradePolicy,
    ) -> Result<Option<Duration>, StepError> {
        if !policy.wait_selector.is_empty() {
            let left = self.pods_on(node, &policy.wait_selector).await?;
            let timed_out = policy.wait_timeout.is_some_and(|t| up.since.elapsed() >= t);
            if !left.is_empty() && !timed_out {
                let detail = format!("waiting for {} ({})", names(&left), policy.wait_selector);
                if detail != up.detail {
                    fleet.set_upgrade(
                        node,
                        Some(NodeUpgrade {
                            detail,
                            ..up.clone()
                        }),
                    );
                }
                return Ok(Some(RECHECK));
            }
        }
        fleet.set_upgrade(
            node,
            Some(NodeUpgrade::new(Step::PodDeletionRequired, &up.target, "")),
        );
        Ok(Some(Duration::ZERO))
    }

    /// Pod deletion (`drain` false: the pods that use GPUs) or drain
    /// (every pod but DaemonSets' and static ones): evicts what may be
    /// evicted; moves on when none is left.
    async fn remove(
        &self,
        fleet: &Fleet,
        node: &str,
        up: &NodeUpgrade,
        policy: &UpgradePolicy,
        drain: bool,
    ) -> Result<Option<Duration>, StepError> {
        let rules = if drain {
            policy
                .drain
                .clone()
                .unwrap_or_else(|| policy.pod_deletion.clone())
        } else {
            policy.pod_deletion.clone()
        };
        let pods: Vec<PodInfo> = self
            .pods_on(node, &rules.selector)
            .await?
            .iter()
            .filter(|p| drained(p) && (drain || uses_gpus(p)))
            .map(|p| info(p, &rules))
            .collect();
        if pods.is_empty() {
            tracing::info!(node, to = %up.target, "driver upgrade: no GPU work left; the agent may upgrade");
            fleet.set_upgrade(
                node,
                Some(NodeUpgrade::new(Step::ValidationRequired, &up.target, "")),
            );
            return Ok(None);
        }
        let refused: Vec<String> = pods
            .iter()
            .filter(|p| p.terminating.is_none())
            .filter_map(|p| {
                p.refused
                    .as_ref()
                    .map(|why| format!("{}/{}: {why}", p.namespace, p.name))
            })
            .collect();
        let timed_out = rules.timeout.is_some_and(|t| up.since.elapsed() >= t);
        if !refused.is_empty() || timed_out {
            let why = if refused.is_empty() {
                format!(
                    "{} after {} s",
                    left(&pods),
                    rules.timeout.map_or(0, |t| t.as_secs())
                )
            } else {
                refused.join("; ")
            };
            if !drain && policy.drain.is_some() {
                tracing::warn!(node, why = %why, "driver upgrade: GPU pods not all evicted; draining the node");
                fleet.set_upgrade(
                    node,
                    Some(NodeUpgrade::new(Step::DrainRequired, &up.target, why)),
                );
                return Ok(Some(Duration::ZERO));
            }
            let what = if drain { "drain" } else { "GPU pod deletion" };
            tracing::error!(node, why = %why, "driver upgrade failed: {what} could not finish");
            fleet.set_upgrade(
                node,
                Some(NodeUpgrade::new(
                    Step::UpgradeFailed,
                    &up.target,
                    format!("{what} could not finish: {why}"),
                )),
            );
            return Ok(None);
        }
        let mut blocked = Vec::new();
        for p in pods.iter().filter(|p| p.terminating.is_none()) {
            if !self.leading() {
                // The next leader evicts what is left.
                return Ok(None);
            }
            let api: Api<Pod> = Api::namespaced(self.client.clone(), &p.namespace);
            match evict(&api, &p.namespace, &p.name).await {
                Ok(_) => {
                    tracing::info!(node, pod = %format!("{}/{}", p.namespace, p.name), "evicted")
                }
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                // A disruption budget says not now.
                Err(kube::Error::Api(s)) if s.code == 429 => {
                    blocked.push(format!("{}/{}: {}", p.namespace, p.name, s.message))
                }
                Err(e) => {
                    return Err(StepError {
                        node: node.into(),
                        what: format!("evicting {}/{}", p.namespace, p.name),
                        source: e,
                    });
                }
            }
        }
        let detail = if blocked.is_empty() {
            format!(
                "waiting for {} to go",
                pods.iter()
                    .map(PodInfo::said)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        } else {
            format!("eviction refused for now: {}", blocked.join("; "))
        };
        if detail != up.detail {
            fleet.set_upgrade(
                node,
                Some(NodeUpgrade {
                    detail,
                    ..up.clone()
                }),
            );
        }
        Ok(Some(RECHECK))
    }
}

/// Posts a `policy/v1` Eviction for the pod, so its disruption budgets
/// hold. (kube's `Api::evict` sends a body without apiVersion and kind and
/// with a snake-case `delete_options`, which strict validation refuses.)
async fn evict(api: &Api<Pod>, namespace: &str, name: &str) -> Result<(), kube::Error> {
    let body = Eviction {
        metadata: kube::core::ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            ..Default::default()
        },
        delete_options: None,
    };
    api.create_subresource::<_, serde_json::Value>("eviction", name, &PostParams::default(), &body)
        .await
        .map(|_| ())
}

/// A node's annotation, if it has it.
fn annotation<'a>(n: &'a Node, key: &str) -> Option<&'a str> {
    n.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

fn merge_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    }
}

fn names(pods: &[Pod]) -> String {
    pods.iter()
        .map(|p| {
            format!(
                "{}/{}",
                p.metadata.namespace.as_deref().unwrap_or(""),
                p.metadata.name.as_deref().unwrap_or("")
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether a pod asks for any `nvidia.com/` resource (whole GPUs, shared
/// replicas, MIG devices).
pub fn uses_gpus(p: &Pod) -> bool {
    let Some(spec) = &p.spec else { return false };
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .filter_map(|c| c.resources.as_ref())
        .flat_map(|r| r.limits.iter().flatten().chain(r.requests.iter().flatten()))
        .any(|(k, _)| k.starts_with("nvidia.com/"))
}

fn owner_kind(p: &Pod) -> Option<&str> {
    p.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
        .map(|o| o.kind.as_str())
}

/// Whether a drain removes the pod: not a DaemonSet's (it would come back
/// at once) nor a static pod (the kubelet's own).
fn drained(p: &Pod) -> bool {
    let mirror = p
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key("kubernetes.io/config.mirror"));
    !mirror && owner_kind(p) != Some("DaemonSet")
}

fn info(p: &Pod, rules: &Removal) -> PodInfo {
    let empty_dir = p
        .spec
        .as_ref()
        .and_then(|s| s.volumes.as_ref())
        .is_some_and(|v| v.iter().any(|v| v.empty_dir.is_some()));
    let refused = if owner_kind(p).is_none() && !rules.force {
        Some(
            "no controller runs it, so it would not come back (force: true evicts it anyway)"
                .to_string(),
        )
    } else if empty_dir && !rules.delete_empty_dir {
        Some("its emptyDir data would be lost (deleteEmptyDir: true evicts it anyway)".to_string())
    } else {
        None
    };
    PodInfo {
        namespace: p.metadata.namespace.clone().unwrap_or_default(),
        name: p.metadata.name.clone().unwrap_or_default(),
        terminating: p
            .metadata
            .deletion_timestamp
            .as_ref()
            .map(|t| (t.0.to_string(), p.metadata.deletion_grace_period_seconds)),
        refused,
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(node: &str, step: Option<Step>, agent: &str, driver: &str) -> Seen {
        Seen {
            node: node.into(),
            step: step.map(|s| NodeUpgrade::new(s, "560.35.03", "")),
            agent_state: agent.into(),
            agent_version: if agent.is_empty() {
                String::new()
            } else {
                "560.35.03".into()
            },
            agent_detail: String::new(),
            driver_version: driver.into(),
            ready: true,
            connected: true,
            reported: true,
            unavailable: None,
        }
    }

    #[test]
    fn the_operators_keys_and_defaults() {
        assert_eq!(
            UpgradePolicy::from_spec(&json!({})).unwrap(),
            UpgradePolicy::default()
        );
        let p = UpgradePolicy::from_spec(&json!({"driver": {"upgradePolicy": {
            "autoUpgrade": true, "maxParallelUpgrades": 0, "maxUnavailable": "50%",
            "waitForCompletion": {"timeoutSeconds": 0, "podSelector": "app=train"},
            "gpuPodDeletion": {"force": true, "timeoutSeconds": 60, "deleteEmptyDir": true},
            "drain": {"enable": true, "force": false, "podSelector": "", "timeoutSeconds": 0, "deleteEmptyDir": false},
        }}}))
        .unwrap();
        assert_eq!(p.max_parallel, 0);
        assert_eq!(p.max_unavailable, Amount::Percent(50));
        assert_eq!(p.wait_selector, "app=train");
        assert_eq!(p.wait_timeout, None);
        assert_eq!(p.pod_deletion.timeout, Some(Duration::from_secs(60)));
        assert!(p.pod_deletion.force && p.pod_deletion.delete_empty_dir);
        assert_eq!(p.drain.as_ref().unwrap().timeout, None);
        let e = UpgradePolicy::from_spec(
            &json!({"driver": {"upgradePolicy": {"maxUnavailable": "lots"}}}),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "spec.driver.upgradePolicy.maxUnavailable: \"lots\" is not a count or a percentage like 25%"
        );
        let e = UpgradePolicy::from_spec(
            &json!({"driver": {"upgradePolicy": {"drain": {"enable": "yes"}}}}),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "spec.driver.upgradePolicy.drain.enable: expected true or false"
        );
    }

    #[test]
    fn amounts_of_nodes() {
        assert_eq!(Amount::Percent(25).of(10), 3);
        assert_eq!(Amount::Percent(25).of(1), 1);
        assert_eq!(Amount::Percent(0).of(10), 0);
        assert_eq!(Amount::Count(2).of(10), 2);
    }

    #[test]
    fn one_node_at_a_time_by_default_in_name_order() {
        let nodes = vec![
            seen("b", None, "upgrade-required", "550.127.08"),
            seen("a", None, "upgrade-required", "550.127.08"),
            seen("c", None, "", "560.35.03"),
        ];
        let mut nodes = nodes;
        nodes.sort_by(|x, y| x.node.cmp(&y.node));
        let out = plan(&UpgradePolicy::default(), &nodes).moves;
        let steps: Vec<(&str, Option<Step>)> = out
            .iter()
            .map(|(n, s)| (n.as_str(), s.as_ref().map(|s| s.step)))
            .collect();
        assert_eq!(
            steps,
            [
                ("a", Some(Step::CordonRequired)),
                ("b", Some(Step::UpgradeRequired))
            ]
        );
    }

    #[test]
    fn a_failed_node_stops_the_rollout_until_it_is_fixed() {
        let mut nodes = vec![
            seen(
                "a",
                Some(Step::ValidationRequired),
                "upgrade-failed",
                "550.127.08",
            ),
            seen(
                "b",
                Some(Step::UpgradeRequired),
                "upgrade-required",
                "550.127.08",
            ),
        ];
        nodes[0].agent_detail = "rolled back to 550.127.08".into();
        let out = plan(&UpgradePolicy::default(), &nodes).moves;
        assert_eq!(out.len(), 1, "{out:?}");
        let a = out[0].1.clone().unwrap();
        assert_eq!(a.step, Step::UpgradeFailed);
        assert_eq!(
            a.condition().message,
            "upgrade to driver 560.35.03 failed: rolled back to 550.127.08"
        );
        // Still failed: nothing starts.
        let nodes = vec![
            seen(
                "a",
                Some(Step::UpgradeFailed),
                "upgrade-failed",
                "550.127.08",
            ),
            seen(
                "b",
                Some(Step::UpgradeRequired),
                "upgrade-required",
                "550.127.08",
            ),
        ];
        assert!(plan(&UpgradePolicy::default(), &nodes).moves.is_empty());
        // Fixed by hand: the agent runs the wanted driver, validated.
        let nodes = vec![
            seen("a", Some(Step::UpgradeFailed), "upgrade-done", "560.35.03"),
            seen(
                "b",
                Some(Step::UpgradeRequired),
                "upgrade-required",
                "550.127.08",
            ),
        ];
        let out = plan(&UpgradePolicy::default(), &nodes).moves;
        assert_eq!(out[0].1.as_ref().unwrap().step, Step::UncordonRequired);
    }

    #[test]
    fn parallel_and_unavailable_limits() {
        let nodes: Vec<Seen> = (0..8)
            .map(|i| seen(&format!("n{i}"), None, "upgrade-required", "550.127.08"))
            .collect();
        let started = |p: &UpgradePolicy| {
            plan(p, &nodes)
                .moves
                .iter()
                .filter(|(_, s)| s.as_ref().is_some_and(|s| s.step == Step::CordonRequired))
                .count()
        };
        let mut p = UpgradePolicy {
            max_parallel: 0,
            ..Default::default()
        };
        assert_eq!(started(&p), 2, "25% of 8");
        p.max_unavailable = Amount::Count(5);
        p.max_parallel = 3;
        assert_eq!(started(&p), 3);
        p.auto_upgrade = false;
        assert_eq!(started(&p), 0);
    }

    #[test]
    fn nodes_out_of_service_count_against_max_unavailable() {
        // 8 GPU nodes, 4 want the new driver; maxUnavailable 25% = 2.
        let mut nodes: Vec<Seen> = (0..8)
            .map(|i| {
                let want = if i < 4 { "upgrade-required" } else { "" };
                seen(&format!("n{i}"), None, want, "550.127.08")
            })
            .collect();
        let p = UpgradePolicy {
            max_parallel: 0,
            ..Default::default()
        };
        // The nodes started, and whether others were held back by nodes
        // out of service (the rollout looks again for those).
        let started = |nodes: &[Seen]| -> (Vec<String>, bool) {
            let planned = plan(&p, nodes);
            let started = planned
                .moves
                .into_iter()
                .filter(|(_, s)| s.as_ref().is_some_and(|s| s.step == Step::CordonRequired))
                .map(|(n, _)| n)
                .collect();
            (started, planned.held_back)
        };
        let none = Vec::<String>::new();
        // Held back by the allowance alone (no node out of service): not
        // held by others.
        assert_eq!(started(&nodes), (vec!["n0".into(), "n1".into()], false));
        // One node NotReady elsewhere: one starts, the others wait for it.
        nodes[6].unavailable = Some(Unavailable::NotReady);
        assert_eq!(started(&nodes), (vec!["n0".into()], true));
        // Two out of service: none starts...
        nodes[7].unavailable = Some(Unavailable::Cordoned);
        assert_eq!(started(&nodes), (none, true));
        // ...but one cordoned already may (it takes nothing more out).
        nodes[2].unavailable = Some(Unavailable::Cordoned);
        assert_eq!(started(&nodes), (vec!["n2".into()], true));
        // A NotReady node that wants the driver waits until it is Ready.
        nodes[2].unavailable = Some(Unavailable::NotReady);
        nodes[6].unavailable = None;
        nodes[7].unavailable = None;
        assert_eq!(
            started(&nodes),
            (vec!["n0".into()], true),
            "n2 NotReady counts and waits"
        );
        // maxParallelUpgrades still bounds a cordoned node's start.
        let one = UpgradePolicy::default();
        nodes[2].unavailable = Some(Unavailable::Cordoned);
        let out = plan(&one, &nodes).moves;
        let s: Vec<&str> = out
            .iter()
            .filter(|(_, s)| s.as_ref().is_some_and(|s| s.step == Step::CordonRequired))
            .map(|(n, _)| n.as_str())
            .collect();
        assert_eq!(s, ["n0"], "one at a time, by name");
    }

    #[test]
    fn a_validation_that_takes_too_long_fails_the_node() {
        let late = |since: Duration| -> NodeUpgrade {
            NodeUpgrade {
                since: Instant::now().checked_sub(since).unwrap(),
                ..NodeUpgrade::new(Step::ValidationRequired, "560.35.03", "")
            }
        };
        let mut n = seen("n0", None, "upgrade-required", "550.127.08");
        n.agent_detail = "driver 550.127.08 loaded".into();
        n.step = Some(late(Duration::from_secs(31 * 60)));
        let p = UpgradePolicy::default();
        let out = plan(&p, std::slice::from_ref(&n)).moves;
        let failed = out[0].1.as_ref().unwrap();
        assert_eq!(failed.step, Step::UpgradeFailed);
        assert_eq!(
            failed.detail,
            "the agent did not report driver 560.35.03 validated within 30 min; it last said: driver 550.127.08 loaded"
        );
        // Its agent gone (and not heard since this controller started).
        n.connected = false;
        n.reported = false;
        let out = plan(&p, std::slice::from_ref(&n)).moves;
        assert_eq!(
            out[0].1.as_ref().unwrap().detail,
            "the agent did not report driver 560.35.03 validated within 30 min; it is not connected"
        );
        // Within the limit, or without one, it waits.
        n.step = Some(late(Duration::from_secs(29 * 60)));
        assert!(plan(&p, std::slice::from_ref(&n)).moves.is_empty());
        n.step = Some(late(Duration::from_secs(31 * 60)));
        let unlimited = UpgradePolicy {
            validation_timeout: None,
            ..Default::default()
        };
        assert!(plan(&unlimited, std::slice::from_ref(&n)).moves.is_empty());
        // Reported done in time (or late): it goes on as usual.
        n.connected = true;
        n.reported = true;
        n.agent_state = "upgrade-done".into();
        n.agent_version = "560.35.03".into();
        let out = plan(&p, std::slice::from_ref(&n)).moves;
        assert_eq!(out[0].1.as_ref().unwrap().step, Step::UncordonRequired);
    }

    #[test]
    fn out_of_service_is_not_ready_or_cordoned_by_another() {
        let node = |ready: &str, unschedulable: bool, initial: Option<&str>| -> Node {
            let mut n = json!({
                "metadata": {"name": "n"},
                "spec": {"unschedulable": unschedulable},
                "status": {"conditions": [{"type": "Ready", "status": ready}]}
            });
            if let Some(v) = initial {
                n["metadata"]["annotations"] = json!({ INITIAL_UNSCHEDULABLE: v });
            }
            serde_json::from_value(n).unwrap()
        };
        assert_eq!(Unavailable::of(&node("True", false, None)), None);
        assert_eq!(
            Unavailable::of(&node("False", false, None)),
            Some(Unavailable::NotReady)
        );
        assert_eq!(
            Unavailable::of(&node("Unknown", true, None)),
            Some(Unavailable::NotReady)
        );
        assert_eq!(
            Unavailable::of(&node("True", true, None)),
            Some(Unavailable::Cordoned)
        );
        // Our own cordon (the node was schedulable before) is the upgrade's.
        assert_eq!(Unavailable::of(&node("True", true, Some("false"))), None);
        assert_eq!(
            Unavailable::of(&node("True", true, Some("true"))),
            Some(Unavailable::Cordoned)
        );
        // Nothing known of its status: not counted.
        let bare: Node = serde_json::from_value(json!({"metadata": {"name": "n"}})).unwrap();
        assert_eq!(Unavailable::of(&bare), None);
    }
}
