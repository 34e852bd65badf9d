//! GPU health: the backend's events (XID errors, double-bit ECC) turn a GPU
//! unhealthy for the device plugin (every `ListAndWatch` stream gets the
//! new list at once); unlike NVIDIA's plugin, a GPU comes back to healthy
//! when no critical event has been seen for the policy's recovery time. When
//! the event wait itself fails, every GPU is unhealthy until the backend
//! answers again.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::Instant;

use crate::backend::HealthEvent;
use crate::plugin::resources::Resource;

/// XIDs NVIDIA's device plugin ignores by default (application errors and
/// the like, not a sick GPU): 13, 31, 43, 45, 68, 109.
pub const DEFAULT_IGNORED_XIDS: &[u64] = &[13, 31, 43, 45, 68, 109];

/// What counts and for how long.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthPolicy {
    pub ignored_xids: BTreeSet<u64>,
    /// A GPU is healthy again after this long without a critical event;
    /// `None`: it stays unhealthy until the agent restarts.
    pub recover_after: Option<Duration>,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        HealthPolicy {
            ignored_xids: DEFAULT_IGNORED_XIDS.iter().copied().collect(),
            recover_after: Some(Duration::from_secs(300)),
        }
    }
}

/// `spec.health` (gpu-agent's own; NVIDIA sets these by environment).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HealthSpec {
    /// XIDs that do not make a GPU unhealthy (default 13, 31, 43, 45, 68, 109).
    #[serde(default = "default_ignored_xids")]
    pub ignored_xids: Vec<u64>,
    /// Seconds without a critical event after which a GPU is healthy again;
    /// 0: never (until the agent restarts). Default 300.
    #[serde(default = "default_recover_after")]
    pub recover_after_seconds: u64,
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
            recover_after_seconds: default_recover_after(),
        }
    }
}

impl HealthSpec {
    /// As the health monitor takes it.
    pub fn to_policy(&self) -> HealthPolicy {
        HealthPolicy {
            ignored_xids: self.ignored_xids.iter().copied().collect(),
            recover_after: (self.recover_after_seconds > 0)
                .then(|| std::time::Duration::from_secs(self.recover_after_seconds)),
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
    /// Critical events seen since the agent started.
    pub events: u64,
}

/// The live health of every GPU.
pub type HealthBoard = Arc<Mutex<Vec<GpuHealth>>>;

struct State {
    reason: Option<String>,
    last_critical: Option<Instant>,
    events: u64,
}

/// Applies health events to the device plugin's resources.
pub struct HealthMonitor {
    policy: HealthPolicy,
    gpus: BTreeMap<String, State>,
    /// Set while the backend cannot wait for events.
    blind: Option<String>,
    resources: Vec<watch::Sender<Resource>>,
    board: HealthBoard,
    /// Told whenever the board changes.
    changed: Arc<Notify>,
}

impl std::fmt::Debug for HealthMonitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HealthMonitor")
            .field("gpus", &self.gpus.len())
            .finish()
    }
}

impl HealthMonitor {
    /// Watches the GPUs `uuids`, updating `resources` (the device plugin's
    /// resource channels).
    pub fn new(
        policy: HealthPolicy,
        uuids: impl IntoIterator<Item = String>,
        resources: Vec<watch::Sender<Resource>>,
    ) -> Self {
        let gpus: BTreeMap<String, State> = uuids
            .into_iter()
            .map(|u| {
                (
                    u,
                    State {
                        reason: None,
                        last_critical: None,
                        events: 0,
                    },
                )
            })
            .collect();
        let mut m = HealthMonitor {
            policy,
            gpus,
            blind: None,
            resources,
            board: Arc::default(),
            changed: Arc::new(Notify::new()),
        };
        m.publish();
        m
    }

    /// Notifies `changed` whenever a GPU's health changes.
    pub fn with_change_signal(mut self, changed: Arc<Notify>) -> Self {
        self.changed = changed;
        self
    }

    /// The live health of every GPU.
    pub fn board(&self) -> HealthBoard {
        self.board.clone()
    }

    /// Handles events until `events` closes or `shutdown` resolves. Nothing
    /// runs between events: the only timer is the next recovery, armed
    /// while a GPU is unhealthy.
    pub async fn run(
        mut self,
        mut events: mpsc::UnboundedReceiver<HealthEvent>,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        loop {
            let next = self.next_recovery();
            let recovery = async {
                match next {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = &mut shutdown => return,
                ev = events.recv() => match ev {
                    Some(ev) => self.apply(ev, Instant::now()),
                    None => return,
                },
                _ = recovery => self.recover(Instant::now()),
            }
        }
    }

    /// When the next unhealthy GPU is due to recover, if any.
    pub fn next_recovery(&self) -> Option<Instant> {
        let after = self.policy.recover_after?;
        self.gpus
            .values()
            .filter(|st| st.reason.is_some())
            .filter_map(|st| st.last_critical)
            .map(|t| t + after)
            .min()
    }

    /// One event.
    pub fn apply(&mut self, ev: HealthEvent, now: Instant) {
        match ev {
            HealthEvent::Xid { uuid, xid } => {
                if self.policy.ignored_xids.contains(&xid) {
                    tracing::info!(stage = "health", gpu = %uuid, xid, "XID ignored by policy");
                    return;
                }
                self.critical(&uuid, format!("XID {xid}"), now);
            }
            HealthEvent::DoubleBitEcc { uuid } => {
                self.critical(&uuid, "double-bit ECC error".into(), now)
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

    fn critical(&mut self, uuid: &str, reason: String, now: Instant) {
        let Some(st) = self.gpus.get_mut(uuid) else {
            tracing::warn!(stage = "health", gpu = %uuid, %reason, "event for a GPU not in the inventory");
            return;
        };
        tracing::warn!(stage = "health", gpu = %uuid, %reason, "GPU unhealthy");
        st.reason = Some(reason);
        st.last_critical = Some(now);
        st.events += 1;
        self.publish();
    }

    /// GPUs without a critical event for the recovery time are healthy again.
    pub fn recover(&mut self, now: Instant) {
        let Some(after) = self.policy.recover_after else {
            return;
        };
        let mut changed = false;
        for (uuid, st) in &mut self.gpus {
            if st.reason.is_some()
                && st
                    .last_critical
                    .is_some_and(|t| now.duration_since(t) >= after)
            {
                tracing::info!(stage = "health", gpu = %uuid, quiet_for = ?after, "GPU healthy again");
                st.reason = None;
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

    /// Pushes the health to every resource (only where it changed) and the board.
    fn publish(&mut self) {
        for r in &self.resources {
            r.send_if_modified(|res| {
                let mut changed = false;
                for d in &mut res.devices {
                    let h = self.healthy(&d.gpu_uuid);
                    if d.healthy != h {
                        d.healthy = h;
                        changed = true;
                    }
                }
                changed
            });
        }
        let board: Vec<GpuHealth> = self
            .gpus
            .iter()
            .map(|(uuid, st)| GpuHealth {
                uuid: uuid.clone(),
                healthy: self.healthy(uuid),
                reason: st.reason.clone().or_else(|| self.blind.clone()),
                events: st.events,
            })
            .collect();
        *self.board.lock().unwrap() = board;
        self.changed.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::resources::{PluginSettings, build};
    use crate::test_support::inventory_of;

    fn setup(policy: HealthPolicy) -> (HealthMonitor, watch::Receiver<Resource>, Vec<String>) {
        let inv = inventory_of("t4-4");
        let r = build(&inv, &PluginSettings::default()).unwrap().remove(0);
        let uuids: Vec<String> = r.devices.iter().map(|d| d.uuid.clone()).collect();
        let (tx, rx) = watch::channel(r);
        (
            HealthMonitor::new(policy, uuids.clone(), vec![tx]),
            rx,
            uuids,
        )
    }

    fn health(rx: &watch::Receiver<Resource>) -> Vec<bool> {
        rx.borrow().devices.iter().map(|d| d.healthy).collect()
    }

    #[test]
    fn critical_xid_marks_one_gpu_and_it_recovers() {
        let (mut m, rx, uuids) = setup(HealthPolicy {
            recover_after: Some(Duration::from_secs(60)),
            ..HealthPolicy::default()
        });
        let t0 = Instant::now();
        m.apply(
            HealthEvent::Xid {
                uuid: uuids[1].clone(),
                xid: 79,
            },
            t0,
        );
        assert_eq!(health(&rx), [true, false, true, true]);
        let board = m.board().lock().unwrap().clone();
        assert_eq!(
            board
                .iter()
                .find(|g| g.uuid == uuids[1])
                .unwrap()
                .reason
                .as_deref(),
            Some("XID 79")
        );
        assert_eq!(m.next_recovery(), Some(t0 + Duration::from_secs(60)));
        m.recover(t0 + Duration::from_secs(59));
        assert_eq!(health(&rx), [true, false, true, true]);
        // Another event restarts the quiet period.
        m.apply(
            HealthEvent::DoubleBitEcc {
                uuid: uuids[1].clone(),
            },
            t0 + Duration::from_secs(30),
        );
        m.recover(t0 + Duration::from_secs(61));
        assert_eq!(health(&rx), [true, false, true, true]);
        assert_eq!(m.next_recovery(), Some(t0 + Duration::from_secs(90)));
        m.recover(t0 + Duration::from_secs(90));
        assert_eq!(health(&rx), [true; 4]);
        assert_eq!(m.next_recovery(), None, "nothing to wait for once healthy");
    }

    #[tokio::test(start_paused = true)]
    async fn the_monitor_sleeps_until_the_recovery_is_due_and_not_before() {
        let (m, rx, uuids) = setup(HealthPolicy {
            recover_after: Some(Duration::from_secs(60)),
            ..HealthPolicy::default()
        });
        let (tx, events) = mpsc::unbounded_channel();
        let task = tokio::spawn(m.run(events, std::future::pending()));
        tx.send(HealthEvent::Xid {
            uuid: uuids[2].clone(),
            xid: 48,
        })
        .unwrap();
        tokio::task::yield_now().await;
        assert_eq!(health(&rx), [true, true, false, true]);
        tokio::time::sleep(Duration::from_secs(59)).await;
        assert_eq!(health(&rx), [true, true, false, true]);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(health(&rx), [true; 4]);
        drop(tx);
        task.await.unwrap();
    }

    #[test]
    fn ignored_xids_change_nothing() {
        let (mut m, mut rx, uuids) = setup(HealthPolicy::default());
        rx.mark_unchanged();
        for xid in DEFAULT_IGNORED_XIDS {
            m.apply(
                HealthEvent::Xid {
                    uuid: uuids[0].clone(),
                    xid: *xid,
                },
                Instant::now(),
            );
        }
        assert!(!rx.has_changed().unwrap());
        assert_eq!(health(&rx), [true; 4]);
    }

    #[test]
    fn policy_can_unignore_and_disable_recovery() {
        let (mut m, rx, uuids) = setup(HealthPolicy {
            ignored_xids: BTreeSet::new(),
            recover_after: None,
        });
        let t0 = Instant::now();
        m.apply(
            HealthEvent::Xid {
                uuid: uuids[0].clone(),
                xid: 13,
            },
            t0,
        );
        m.recover(t0 + Duration::from_secs(86_400));
        assert_eq!(health(&rx), [false, true, true, true]);
    }

    #[test]
    fn failed_wait_blinds_every_gpu_until_nvml_answers() {
        let (mut m, rx, _) = setup(HealthPolicy::default());
        m.apply(
            HealthEvent::WaitFailed("NVML event wait: Unknown Error".into()),
            Instant::now(),
        );
        assert_eq!(health(&rx), [false; 4]);
        assert!(
            m.board()
                .lock()
                .unwrap()
                .iter()
                .all(|g| g.reason.as_deref() == Some("NVML event wait: Unknown Error"))
        );
        m.apply(HealthEvent::Answering, Instant::now());
        assert_eq!(health(&rx), [true; 4]);
    }
}
