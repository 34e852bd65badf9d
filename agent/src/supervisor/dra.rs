//! The DRA kubelet plugin as a supervised task ([`RunningDra`]): the node's
//! claims (checkpoint recovered at start), the controller's allocations fed
//! in as they arrive, and the kubelet's sockets served in the background.

use std::sync::{Arc, Mutex};

use gpu_agent_proto::report::v1 as pb;
use gpu_dra::claims::{MemoryAllocations, NodeClaims, TimeSlicePort};
use gpu_dra::kubelet::{Dirs, Registration};
use hostlib::HostRoot;
use tokio::sync::{Notify, oneshot, watch};

use super::dra_mps::DraMps;
use crate::inventory::Inventory;
use crate::policy::Policy;
use crate::state::{DraClaimStatus, DraStatus};

/// The task's name in `status`.
pub(super) const TASK: &str = "dra";

/// What a running plugin was started with: a change restarts it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct DraSetting {
    pub(super) kubelet_root_dir: String,
    pub(super) cdi_dir: String,
    pub(super) node_name: String,
}

impl DraSetting {
    pub(super) fn of(policy: &Policy, node_name: &str) -> Self {
        DraSetting {
            kubelet_root_dir: policy
                .host_paths
                .kubelet_root_dir
                .trim_end_matches('/')
                .to_string(),
            cdi_dir: policy.cdi.spec_dir.trim_end_matches('/').to_string(),
            node_name: node_name.to_string(),
        }
    }
}

/// The DRA plugin, served in the background.
pub(super) struct RunningDra {
    pub(super) setting: DraSetting,
    pub(super) claims: Arc<NodeClaims>,
    registration: watch::Receiver<Registration>,
    /// How many claims the controller's last list held (`None`: none yet).
    fed: Arc<Mutex<Option<usize>>>,
    socket: String,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), String>>>,
    feeder: tokio::task::JoinHandle<()>,
    /// The claims' MPS daemons, or why this node runs none.
    mps: Result<DraMps, String>,
}

/// What the plugin's claims are shared with: the MPS daemons and who
/// changes the GPUs' time slices (`Err`: why this node does not; claims
/// that need it are refused with the words).
pub(super) struct DraSharing {
    pub(super) mps: Result<DraMps, String>,
    pub(super) time_slice: Result<Arc<dyn TimeSlicePort>, String>,
    /// Told when a prepare waits for a claim's allocation: the report
    /// checks in at once to fetch it.
    pub(super) report_now: Arc<Notify>,
}

impl RunningDra {
    /// Opens the node's claims (`inv`: DRA's GPUs only) and serves them;
    /// `sharing.mps` runs the daemons of claims with MPS sharing (`Err`:
    /// why this node runs none; those claims are refused), and
    /// `sharing.time_slice` changes the time slices of claims' GPUs. The
    /// daemons of claims still prepared are started again in the
    /// background (those already running, kept from the plugin's last run,
    /// go on), and the GPUs of prepares cut short set back. An error: the
    /// checkpoint or the sockets' directories could not be used (it names
    /// the file); the daemons come back with it, running.
    pub(super) fn start(
        host: &HostRoot,
        setting: DraSetting,
        inv: &Inventory,
        feed: watch::Receiver<Option<Arc<pb::DraClaims>>>,
        health: watch::Receiver<gpu_model::health::HealthView>,
        changed: Arc<Notify>,
        sharing: DraSharing,
    ) -> Result<Self, (String, Option<DraMps>)> {
        let DraSharing {
            mps,
            time_slice,
            report_now,
        } = sharing;
        let mut opts = gpu_dra::claims::Options::new(setting.node_name.clone());
        opts.cdi_dir = setting.cdi_dir.clone();
        opts.node_spec = format!(
            "{}/{}",
            setting.cdi_dir,
            gpu_dra::claims::cdi::NODE_SPEC_FILE
        );
        let root = &setting.kubelet_root_dir;
        let dirs = match Dirs::on(
            host,
            &format!("{root}/plugins_registry"),
            &format!("{root}/plugins"),
        ) {
            Ok(d) => d,
            Err(e) => return Err((e.to_string(), mps.ok())),
        };
        let allocations =
            Arc::new(MemoryAllocations::new().when_missing(move || report_now.notify_one()));
        let port = mps.as_ref().ok().map(DraMps::port);
        let claims =
            match NodeClaims::open_with_mps(host.clone(), opts, allocations.clone(), inv, port) {
                Ok(c) => Arc::new(c.with_time_slice(time_slice)),
                Err(e) => return Err((e.to_string(), mps.ok())),
            };
        {
            let (claims, changed) = (claims.clone(), changed.clone());
            let restore_mps = mps.is_ok();
            // Blocks until each daemon serves: off the async threads.
            tokio::task::spawn_blocking(move || {
                let reset = claims.restore_time_slices();
                let restarted = restore_mps && !claims.restore_mps().is_empty();
                if restarted || !reset.is_empty() {
                    changed.notify_one();
                }
            });
        }
        // What start-up found is said once, by recovery ("DRA claims recovered").
        let socket = format!(
            "{root}/plugins_registry/{}",
            gpu_dra::kubelet::registration_socket_name()
        );
        let (reg_tx, registration) = watch::channel(Registration::Unknown);
        let fed = Arc::new(Mutex::new(None));
        let feeder = tokio::spawn(feed_allocations(
            feed,
            allocations,
            registration.clone(),
            fed.clone(),
            changed.clone(),
        ));
        let (stop, stopped) = oneshot::channel::<()>();
        let served: Arc<dyn gpu_dra::claim::Claims> = Arc::new(Told {
            claims: claims.clone(),
            changed: changed.clone(),
        });
        let health = gpu_dra::kubelet::HealthSource::from_claims(&claims, health);
        let task = tokio::spawn(async move {
            let r = gpu_dra::kubelet::serve(&dirs, served, health, reg_tx, async {
                let _ = stopped.await;
            })
            .await
            .map_err(|e| e.to_string());
            changed.notify_one();
            r
        });
        Ok(RunningDra {
            setting,
            claims,
            registration,
            fed,
            socket,
            stop: Some(stop),
            task: Some(task),
            feeder,
            mps,
        })
    }

    /// Resolves when the plugin stops on its own.
    pub(super) async fn ended(&mut self) -> Result<(), String> {
        let Some(task) = self.task.as_mut() else {
            return std::future::pending().await;
        };
        let r = task.await;
        self.task = None;
        match r {
            Ok(r) => r,
            Err(e) => Err(format!("the task panicked or was cancelled: {e}")),
        }
    }

    /// What `status` shows of it; `gpus` are DRA's GPUs, `unmatched` the
    /// selectors that name none.
    pub(super) fn status(&self, gpus: Vec<String>, unmatched: Vec<String>) -> DraStatus {
        let reg = self.registration.borrow().clone();
        let s = self.claims.status();
        let phases = match &self.mps {
            Ok(m) => m.phases(),
            Err(_) => Default::default(),
        };
        DraStatus {
            registered: reg.is_registered(),
            registration: match reg {
                Registration::Unknown => "waiting for the kubelet".into(),
                Registration::Registered => "registered".into(),
                Registration::Refused { error } => format!("refused: {error}"),
            },
            socket: self.socket.clone(),
            gpus,
            unmatched,
            devices: self.claims.device_names(),
            allocations: *self.fed.lock().unwrap_or_else(|e| e.into_inner()),
            recovery: s.recovery.summary(),
            claims: s
                .claims
                .into_iter()
                .map(|c| DraClaimStatus {
                    mps: c.mps.then(|| {
                        phases
                            .get(&c.uid)
                            .cloned()
                            .unwrap_or_else(|| "not running".into())
                    }),
                    uid: c.uid,
                    namespace: c.namespace,
                    name: c.name,
                    state: serde_json::to_value(c.state)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_string))
                        .unwrap_or_default(),
                    devices: c.devices,
                })
                .collect(),
            error: None,
            mps_unavailable: match &self.mps {
                Ok(m) => m.unavailable(),
                Err(why) => Some(why.clone()),
            },
        }
    }

    /// Stops serving: the registration socket goes first, then `dra.sock`;
    /// then every claim's daemon quits (the plugin is turned off, or the
    /// agent stops).
    pub(super) async fn stop(self) {
        if let Some(m) = self.stop_keeping_mps().await {
            m.stop().await;
        }
    }

    /// Stops serving and hands over the claims' daemons, running, to the
    /// plugin's next run.
    pub(super) async fn stop_keeping_mps(mut self) -> Option<DraMps> {
        self.feeder.abort();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            match task.await {
                Ok(Err(e)) => tracing::error!(task = TASK, error = %e, "the DRA plugin failed"),
                Err(e) => tracing::error!(task = TASK, error = %e, "the DRA plugin task failed"),
                Ok(Ok(())) => {}
            }
        }
        self.mps.ok()
    }

    /// A plugin that ended on its own: its claims' daemons, running, for
    /// the next run.
    pub(super) fn into_mps(mut self) -> Option<DraMps> {
        self.feeder.abort();
        if let Some(task) = self.task.take() {
            task.abort();
        }
        self.mps.ok()
    }
}

/// The node's claims as the kubelet's calls reach them: `status` and the
/// report hear of every prepare and unprepare.
struct Told {
    claims: Arc<NodeClaims>,
    changed: Arc<Notify>,
}

impl gpu_dra::claim::Claims for Told {
    fn prepare(
        &self,
        claims: &[gpu_dra::claim::ClaimRef],
    ) -> std::collections::BTreeMap<String, gpu_dra::claim::PrepareOutcome> {
        let r = self.claims.prepare(claims);
        self.changed.notify_one();
        r
    }

    fn unprepare(
        &self,
        claims: &[gpu_dra::claim::ClaimRef],
    ) -> std::collections::BTreeMap<String, Result<(), String>> {
        let r = self.claims.unprepare(claims);
        self.changed.notify_one();
        r
    }
}

/// Hands every list the controller sends to prepare at once (a pass may be
/// running), and tells the supervisor when the list or the kubelet's verdict
/// changes (for `status` and the report).
async fn feed_allocations(
    mut feed: watch::Receiver<Option<Arc<pb::DraClaims>>>,
    allocations: Arc<MemoryAllocations>,
    mut registration: watch::Receiver<Registration>,
    fed: Arc<Mutex<Option<usize>>>,
    changed: Arc<Notify>,
) {
    let take = |list: &Option<Arc<pb::DraClaims>>| {
        if let Some(list) = list {
            allocations.replace_all(gpu_dra::claims::feed::allocations(list));
            *fed.lock().unwrap_or_else(|e| e.into_inner()) = Some(list.claims.len());
        }
    };
    take(&feed.borrow_and_update());
    let mut feed_open = true;
    let mut reg_open = true;
    while feed_open || reg_open {
        tokio::select! {
            r = feed.changed(), if feed_open => match r {
                Ok(()) => take(&feed.borrow_and_update()),
                Err(_) => feed_open = false,
            },
            r = registration.changed(), if reg_open => {
                if r.is_err() {
                    reg_open = false;
                }
            }
        }
        changed.notify_one();
    }
}
