//! GPU health. Sources: NVML events (XID errors, double-bit ECC), the kernel
//! log (`NVRM: Xid` lines in /dev/kmsg, [`kmsg`]), and NVML's view checked at
//! each reconcile (a GPU NVML has lost, pending retired pages or remapped
//! rows, temperature over the slowdown threshold). Each kind maps by policy
//! to ignore / log / unhealthy. The monitor publishes a [`HealthView`] on a
//! watch channel; the device plugin subscribes and every `ListAndWatch`
//! stream gets the new list at once. Unlike NVIDIA's plugin, a GPU comes
//! back to healthy when nothing critical has been seen for the policy's
//! recovery time, NVML answers for it and no reset is pending. When the
//! event wait itself fails, every GPU is unhealthy until NVML answers again.

pub mod kernel_log;
pub mod kmsg;

#[cfg(test)]
use gpu_backend::test_support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::Instant;

use gpu_model::backend::HealthEvent;
use gpu_model::inventory::Inventory;

/// XIDs NVIDIA's device plugin ignores by default (application errors and
/// the like, not a sick GPU): 13, 31, 43, 45, 68, 109.
pub const DEFAULT_IGNORED_XIDS: &[u64] = &[13, 31, 43, 45, 68, 109];

/// The same XID from NVML and from the kernel log within this window is one event.
pub const SAME_EVENT_WINDOW: Duration = Duration::from_secs(5);

/// What the device plugin sees of health, and the events the report sends.
pub use gpu_model::health::{EventRecord, HealthView};
/// The XID catalogue is the model's (kernel log, health and report read it).
pub use gpu_model::xid::{self, Severity};

/// `spec.health.on`: what each kind of event does.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct KindSeverities {
    /// XIDs not in `ignoredXids` and not in `xids` (default unhealthy).
    #[serde(default = "unhealthy")]
    pub xid: Severity,
    #[serde(default = "unhealthy")]
    pub double_bit_ecc: Severity,
    /// Temperature at or over NVML's slowdown threshold (default log).
    #[serde(default = "log")]
    pub thermal: Severity,
    /// Retired pages pending: the GPU needs a reset (default unhealthy).
    #[serde(default = "unhealthy")]
    pub retired_pages_pending: Severity,
    /// Remapped rows pending: the GPU needs a reset (default unhealthy).
    #[serde(default = "unhealthy")]
    pub remapped_rows_pending: Severity,
    /// NVML has lost the GPU (fallen off the bus; default unhealthy).
    #[serde(default = "unhealthy")]
    pub gpu_lost: Severity,
}

fn unhealthy() -> Severity {
    Severity::Unhealthy
}

fn log() -> Severity {
    Severity::Log
}

impl Default for KindSeverities {
    fn default() -> Self {
        KindSeverities {
            xid: Severity::Unhealthy,
            double_bit_ecc: Severity::Unhealthy,
            thermal: Severity::Log,
            retired_pages_pending: Severity::Unhealthy,
            remapped_rows_pending: Severity::Unhealthy,
            gpu_lost: Severity::Unhealthy,
        }
    }
}

/// `spec.health` (gpu-agent's own; NVIDIA sets these by environment).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HealthSpec {
    /// XIDs that do not make a GPU unhealthy, only logged (default 13, 31, 43, 45, 68, 109).
    #[serde(default = "default_ignored_xids")]
    pub ignored_xids: Vec<u64>,
    /// Per-XID severity, winning over `ignoredXids` and `on.xid`: `{94: log, 48: unhealthy}`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub xids: BTreeMap<u64, Severity>,
    /// What each kind of event does.
    #[serde(default)]
    pub on: KindSeverities,
    /// Read `NVRM: Xid` lines from the kernel log (/dev/kmsg) too (default true).
    #[serde(default = "yes")]
    pub kernel_log: bool,
    /// Seconds without a critical event after which a GPU is healthy again;
    /// 0: never (until the agent restarts). Default 300.
    #[serde(default = "default_recover_after")]
    pub recover_after_seconds: u64,
}

fn yes() -> bool {
    true
}

fn default_ignored_xids() -> Vec<u64> {
    DEFAULT_IGNORED_XIDS.to_vec()
}

fn default_recover_after() -> u64 {
    300
}

impl Default for HealthSpec {
    fn default() -> Self {
        HealthSpec {
            ignored_xids: default_ignored_xids(),
            xids: BTreeMap::new(),
            on: KindSeverities::default(),
            kernel_log: true,
            recover_after_seconds: default_recover_after(),
        }
    }
}

impl HealthSpec {
    /// As the health monitor takes it.
    pub fn to_policy(&self) -> HealthPolicy {
        HealthPolicy {
            ignored_xids: self.ignored_xids.iter().copied().collect(),
            xids: self.xids.clone(),
            on: self.on.clone(),
            recover_after: (self.recover_after_seconds > 0)
                .then(|| Duration::from_secs(self.recover_after_seconds)),
        }
    }
}

/// What counts and for how long.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthPolicy {
    pub ignored_xids: BTreeSet<u64>,
    pub xids: BTreeMap<u64, Severity>,
    pub on: KindSeverities,
    /// A GPU is healthy again after this long without a critical event;
    /// `None`: it stays unhealthy until the agent restarts.
    pub recover_after: Option<Duration>,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        HealthSpec::default().to_policy()
    }
}

impl HealthPolicy {
    /// What XID `xid` does under this policy: `xids` first; then
    /// `ignoredXids` (logged only); an XID of NVIDIA's default ignore list
    /// that the policy no longer ignores gets `on.xid`; any other XID gets
    /// the catalogue's severity, at most `on.xid` (unknown XIDs: `on.xid`,
    /// as NVIDIA's plugin).
    pub fn xid_severity(&self, xid: u64) -> Severity {
        if let Some(s) = self.xids.get(&xid) {
            *s
        } else if self.ignored_xids.contains(&xid) {
            Severity::Log
        } else if DEFAULT_IGNORED_XIDS.contains(&xid) {
            self.on.xid
        } else {
            xid::default_severity(xid).min(self.on.xid)
        }
    }
}

/// One GPU's health, for `status`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuHealth {
    pub uuid: String,
    pub healthy: bool,
    /// Why it is unhealthy (`XID 79`, `double-bit ECC error`, the wait error).
    pub reason: Option<String>,
    /// What to do about it (the XID catalogue's advice), while unhealthy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advice: Option<String>,
    /// The XID that made it unhealthy, when one did (DRA's device taint
    /// `gpu.nvidia.com/xid` carries it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xid: Option<u64>,
    /// NVML has lost it (fallen off the bus) and it is unhealthy (DRA's
    /// device taint `gpu.nvidia.com/gpu-lost`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lost: bool,
    /// Events seen since the agent started (critical or logged).
    pub events: u64,
}

/// The live health of every GPU.
pub type HealthBoard = Arc<Mutex<Vec<GpuHealth>>>;

/// Conditions NVML reports at a reconcile (not events): each holds until a
/// later check no longer sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Condition {
    Lost,
    RetiredPagesPending,
    RemappedRowsPending,
    Thermal,
}

impl Condition {
    fn text(self) -> &'static str {
        match self {
            Condition::RetiredPagesPending => {
                "retired pages pending: reset the GPU (drain it first)"
            }
            Condition::Lost => {
                "NVML has lost the GPU (fallen off the bus): drain and reboot the node"
            }
            Condition::RemappedRowsPending => {
                "remapped rows pending: reset the GPU (drain it first)"
            }
            Condition::Thermal => "temperature at or over the slowdown threshold",
        }
    }

    fn severity(self, p: &HealthPolicy) -> Severity {
        match self {
            Condition::RetiredPagesPending => p.on.retired_pages_pending,
            Condition::Lost => p.on.gpu_lost,
            Condition::RemappedRowsPending => p.on.remapped_rows_pending,
            Condition::Thermal => p.on.thermal,
        }
    }
}

#[derive(Default)]
struct State {
    reason: Option<String>,
    advice: Option<String>,
    /// The XID behind `reason`, when an XID is.
    xid: Option<u64>,
    last_critical: Option<Instant>,
    events: u64,
    /// NVML conditions seen at the last check.
    conditions: BTreeSet<Condition>,
    /// Recent XIDs (xid → when, from which source), for one event per XID
    /// seen by both NVML and the kernel log.
    recent: BTreeMap<u64, (Instant, bool)>,
}

/// Turns health events into the GPUs' health.
pub struct HealthMonitor {
    policy: HealthPolicy,
    gpus: BTreeMap<String, State>,
    /// Set while the backend cannot wait for events.
    blind: Option<String>,
    view: watch::Sender<HealthView>,
    board: HealthBoard,
    /// Told whenever the board changes.
    changed: Arc<Notify>,
    /// Where events that were not ignored are told (the report upward).
    events: Option<tokio::sync::broadcast::Sender<EventRecord>>,
}

impl std::fmt::Debug for HealthMonitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HealthMonitor")
            .field("gpus", &self.gpus.len())
            .finish()
    }
}

/// The GPUs health watches in an inventory: those NVML names.
pub fn watched_uuids(inv: &Inventory) -> Vec<String> {
    inv.gpus
        .iter()
        .filter(|g| g.index.is_some())
        .filter_map(|g| g.uuid.clone())
        .collect()
}

/// NVML conditions per GPU, as a reconcile's discovery saw them.
pub type Conditions = BTreeMap<String, BTreeSet<Condition>>;

/// The conditions in an inventory's NVML readings; a GPU NVML has lost is
/// named by its UUID in `known` (the last inventory in which NVML saw it).
pub fn conditions(inv: &Inventory, known: Option<&Inventory>) -> Conditions {
    let mut out = Conditions::new();
    for i in &inv.backend.lost {
        let uuid = known
            .and_then(|k| k.gpus.iter().find(|g| g.index == Some(*i)))
            .and_then(|g| g.uuid.clone());
        if let Some(uuid) = uuid {
            out.entry(uuid).or_default().insert(Condition::Lost);
        }
    }
    for g in &inv.gpus {
        let Some(uuid) = &g.uuid else { continue };
        let t = &g.telemetry;
        let mut set = BTreeSet::new();
        if t.retired_pages_pending == Some(true) {
            set.insert(Condition::RetiredPagesPending);
        }
        if t.remapped_rows_pending == Some(true) {
            set.insert(Condition::RemappedRowsPending);
        }
        if let (Some(now), Some(limit)) = (t.temperature_c, t.slowdown_temperature_c)
            && now >= limit
        {
            set.insert(Condition::Thermal);
        }
        if !set.is_empty() {
            out.insert(uuid.clone(), set);
        }
    }
    out
}

/// What the monitor follows besides events.
#[derive(Debug, Default)]
pub struct Inputs {
    /// New inventories change the watched GPUs.
    pub inventory: Option<watch::Receiver<Arc<Inventory>>>,
    /// A new policy changes the rules.
    pub policy: Option<watch::Receiver<HealthPolicy>>,
    /// NVML's conditions at each reconcile.
    pub conditions: Option<watch::Receiver<Conditions>>,
}

/// Whether a health event came from NVML or the kernel log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Nvml,
    KernelLog,
}

impl HealthMonitor {
    /// Watches the GPUs `uuids`.
    pub fn new(policy: HealthPolicy, uuids: impl IntoIterator<Item = String>) -> Self {
        let gpus: BTreeMap<String, State> =
            uuids.into_iter().map(|u| (u, State::default())).collect();
        let mut m = HealthMonitor {
            policy,
            gpus,
            blind: None,
            view: watch::Sender::new(HealthView::default()),
            board: Arc::default(),
            changed: Arc::new(Notify::new()),
            events: None,
        };
        m.publish();
        m
    }

    /// Notifies `changed` whenever a GPU's health changes.
    pub fn with_change_signal(mut self, changed: Arc<Notify>) -> Self {
        self.changed = changed;
        self
    }

    /// Tells every event that is not ignored on `events` (a receiver that
    /// lags loses the oldest, and is told how many).
    pub fn with_events(mut self, events: tokio::sync::broadcast::Sender<EventRecord>) -> Self {
        self.events = Some(events);
        self
    }

    /// The live health of every GPU.
    pub fn board(&self) -> HealthBoard {
        self.board.clone()
    }

    /// The health the device plugin follows.
    pub fn subscribe(&self) -> watch::Receiver<HealthView> {
        self.view.subscribe()
    }

    /// A new policy (reload): takes effect for the next events and recoveries.
    pub fn set_policy(&mut self, policy: HealthPolicy) {
        self.policy = policy;
    }

    /// The GPUs to watch after a new discovery: new ones are added (healthy),
    /// gone ones dropped, the rest keep their state.
    pub fn set_gpus(&mut self, uuids: impl IntoIterator<Item = String>) {
        let want: BTreeSet<String> = uuids.into_iter().collect();
        let before = self.gpus.len();
        self.gpus.retain(|u, _| want.contains(u));
        let mut added = false;
        for u in want {
            if let std::collections::btree_map::Entry::Vacant(e) = self.gpus.entry(u) {
                e.insert(State::default());
                added = true;
            }
        }
        if added || self.gpus.len() != before {
            tracing::info!(
                stage = "health",
                gpus = self.gpus.len(),
                "watching a new set of GPUs"
            );
            self.publish();
        }
    }

    /// Handles events until `shutdown` resolves (or every sender is gone and
    /// no inventory channel is left). New inventories on `inventory` change
    /// the watched GPUs, a new policy on `policy` the rules. Nothing runs
    /// between events: the only timer is the next recovery, armed while a
    /// GPU is unhealthy.
    pub async fn run(
        mut self,
        mut events: mpsc::UnboundedReceiver<HealthEvent>,
        inputs: Inputs,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        let Inputs {
            mut inventory,
            mut policy,
            mut conditions,
        } = inputs;
        tokio::pin!(shutdown);
        loop {
            let next = self.next_recovery();
            let recovery = async {
                match next {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            let new_inventory = async {
                match inventory.as_mut() {
                    Some(rx) => rx.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            let new_policy = async {
                match policy.as_mut() {
                    Some(rx) => rx.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            let new_conditions = async {
                match conditions.as_mut() {
                    Some(rx) => rx.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = &mut shutdown => return,
                ok = new_conditions => {
                    match (ok, conditions.as_ref()) {
                        (true, Some(rx)) => {
                            let seen = rx.borrow().clone();
                            self.conditions(&seen, Instant::now());
                        }
                        _ => conditions = None,
                    }
                }
                ev = events.recv() => match ev {
                    Some(ev) => self.apply(ev, Instant::now()),
                    None => return,
                },
                ok = new_inventory => {
                    match (ok, inventory.as_ref()) {
                        (true, Some(rx)) => {
                            let uuids = watched_uuids(&rx.borrow());
                            self.set_gpus(uuids);
                        }
                        _ => inventory = None,
                    }
                }
                ok = new_policy => {
                    match (ok, policy.as_ref()) {
                        (true, Some(rx)) => {
                            let p = rx.borrow().clone();
                            self.set_policy(p);
                        }
                        _ => policy = None,
                    }
                }
                _ = recovery => self.recover(Instant::now()),
            }
        }
    }

    /// When the next unhealthy GPU is due to recover, if any.
    pub fn next_recovery(&self) -> Option<Instant> {
        let after = self.policy.recover_after?;
        self.gpus
            .values()
            .filter(|st| st.reason.is_some() && st.conditions.is_empty())
            .filter_map(|st| st.last_critical)
            .map(|t| t + after)
            .min()
    }

    /// One event.
    pub fn apply(&mut self, ev: HealthEvent, now: Instant) {
        match ev {
            HealthEvent::Xid { uuid, xid } => self.xid(&uuid, xid, Source::Nvml, None, now),
            HealthEvent::KernelXid { uuid, xid, message } => {
                self.xid(&uuid, xid, Source::KernelLog, Some(message), now)
            }
            HealthEvent::DoubleBitEcc { uuid } => {
                let sev = self.policy.on.double_bit_ecc;
                self.event(&uuid, sev, None, "double-bit ECC error".into(), None, now)
            }
            HealthEvent::WaitFailed(e) => {
                tracing::error!(stage = "health", error = %e, "cannot watch GPU events: every GPU is unhealthy until NVML answers again");
                self.blind = Some(e);
                self.publish();
            }
            HealthEvent::Answering => {
                if self.blind.take().is_some() {
                    tracing::info!(stage = "health", "NVML answers again");
                    self.publish();
                }
            }
        }
    }

    fn xid(&mut self, uuid: &str, xid: u64, source: Source, message: Option<String>, now: Instant) {
        let Some(st) = self.gpus.get_mut(uuid) else {
            tracing::warn!(stage = "health", gpu_uuid = %uuid, xid, "XID for a GPU not in the inventory");
            return;
        };
        // The same XID from the other source a moment apart: one event.
        let kernel = source == Source::KernelLog;
        if let Some((at, from_kernel)) = st.recent.get(&xid)
            && *from_kernel != kernel
            && now.saturating_duration_since(*at) <= SAME_EVENT_WINDOW
        {
            tracing::debug!(stage = "health", gpu_uuid = %uuid, xid, "same XID from NVML and the kernel log: one event");
            st.recent.remove(&xid);
            return;
        }
        st.recent.insert(xid, (now, kernel));
        st.recent
            .retain(|_, (t, _)| now.saturating_duration_since(*t) <= SAME_EVENT_WINDOW);
        gpu_model::series::xid(uuid, xid);
        let advice = xid::describe(xid);
        let sev = self.policy.xid_severity(xid);
        let from = match source {
            Source::Nvml => "NVML",
            Source::KernelLog => "kernel log",
        };
        let reason = match &message {
            Some(m) => format!("XID {xid}, from the {from}: {m}"),
            None => format!("XID {xid}, from {from}"),
        };
        self.event(uuid, sev, Some(xid), reason, Some(advice), now);
    }

    fn event(
        &mut self,
        uuid: &str,
        sev: Severity,
        xid: Option<u64>,
        reason: String,
        advice: Option<String>,
        now: Instant,
    ) {
        let Some(st) = self.gpus.get_mut(uuid) else {
            tracing::warn!(stage = "health", gpu_uuid = %uuid, %reason, "event for a GPU not in the inventory");
            return;
        };
        let advice_text = advice.as_deref().unwrap_or("");
        if sev != Severity::Ignore
            && let Some(events) = &self.events
        {
            // No receiver (no controller): nothing is kept.
            let _ = events.send(EventRecord {
                uuid: uuid.to_string(),
                xid,
                reason: reason.clone(),
                advice: advice.clone(),
                unhealthy: sev == Severity::Unhealthy,
                at_unix_ms: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis() as u64)
                    .unwrap_or(0),
            });
        }
        match sev {
            Severity::Ignore => {}
            Severity::Log => {
                st.events += 1;
                tracing::info!(stage = "health", gpu_uuid = %uuid, %reason, advice = advice_text, "health event (logged only, by policy)");
                self.publish();
            }
            Severity::Unhealthy => {
                st.events += 1;
                tracing::warn!(stage = "health", gpu_uuid = %uuid, %reason, advice = advice_text, "GPU unhealthy");
                st.reason = Some(reason);
                st.advice = advice;
                st.xid = xid;
                st.last_critical = Some(now);
                self.publish();
            }
        }
    }

    /// NVML's view of each GPU at a reconcile: the conditions that hold now
    /// (a GPU not named has none). A condition that makes a GPU unhealthy
    /// holds it unhealthy until a check no longer sees it; the quiet period
    /// then starts.
    pub fn conditions(&mut self, seen: &BTreeMap<String, BTreeSet<Condition>>, now: Instant) {
        let uuids: Vec<String> = self.gpus.keys().cloned().collect();
        let mut changed = false;
        for uuid in uuids {
            let now_set = seen.get(&uuid).cloned().unwrap_or_default();
            let st = self.gpus.get_mut(&uuid).expect("listed");
            if st.conditions == now_set {
                continue;
            }
            changed = true;
            let new: Vec<Condition> = now_set.difference(&st.conditions).copied().collect();
            let gone = !st.conditions.is_subset(&now_set);
            st.conditions = now_set;
            if gone && st.conditions.is_empty() {
                // The quiet period runs from here.
                st.last_critical = Some(now);
                tracing::info!(stage = "health", gpu_uuid = %uuid, "NVML no longer reports a condition on this GPU");
            }
            for c in new {
                let sev = c.severity(&self.policy);
                self.event(&uuid, sev, None, c.text().to_string(), None, now);
            }
        }
        // A condition that ended changes the board (`lost`) though no event
        // came; publish only sends what differs.
        if changed {
            self.publish();
        }
    }

    /// GPUs without a critical event for the recovery time (and no
    /// condition holding them) are healthy again.
    pub fn recover(&mut self, now: Instant) {
        let Some(after) = self.policy.recover_after else {
            return;
        };
        let mut changed = false;
        for (uuid, st) in &mut self.gpus {
            if st.reason.is_some()
                && st
                    .conditions
                    .iter()
                    .all(|c| c.severity(&self.policy) != Severity::Unhealthy)
                && st
                    .last_critical
                    .is_some_and(|t| now.duration_since(t) >= after)
            {
                tracing::info!(stage = "health", gpu_uuid = %uuid, quiet_for = ?after, "GPU healthy again");
                st.reason = None;
                st.advice = None;
                st.xid = None;
                changed = true;
            }
        }
        if changed {
            self.publish();
        }
    }

    fn healthy(&self, uuid: &str) -> bool {
        self.blind.is_none() && self.gpus.get(uuid).is_none_or(|s| s.reason.is_none())
    }

    /// Publishes the view (only when it changed) and the board.
    fn publish(&mut self) {
        let view = HealthView {
            unhealthy: self
                .gpus
                .iter()
                .filter(|(u, _)| !self.healthy(u))
                .map(|(u, st)| {
                    let why = st
                        .reason
                        .clone()
                        .or_else(|| self.blind.clone())
                        .unwrap_or_default();
                    (u.clone(), why)
                })
                .collect(),
        };
        self.view.send_if_modified(|v| {
            if *v == view {
                false
            } else {
                *v = view;
                true
            }
        });
        let board: Vec<GpuHealth> = self
            .gpus
            .iter()
            .map(|(uuid, st)| GpuHealth {
                uuid: uuid.clone(),
                healthy: self.healthy(uuid),
                reason: st.reason.clone().or_else(|| self.blind.clone()),
                advice: st.advice.clone(),
                xid: st.xid,
                lost: !self.healthy(uuid) && st.conditions.contains(&Condition::Lost),
                events: st.events,
            })
            .collect();
        let mut b = self.board.lock().unwrap();
        if *b != board {
            *b = board;
            drop(b);
            self.changed.notify_one();
        }
    }
}

#[cfg(test)]
mod tests;
