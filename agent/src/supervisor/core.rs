//! The running agent's state ([`Supervisor`]): the one type whose work the
//! other files of the supervisor carry out, each a concern (`impl Supervisor`).

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::{Notify, mpsc, watch};

use super::health::RunningHealth;
use super::options::Options;
use super::plugin::RunningPlugin;
use super::tasks::TaskControl;
use super::{mps, notify};
use crate::health::{HealthPolicy, kernel_log};
use crate::inventory::Inventory;
use crate::metrics::server::{ExporterConfig, PodLabels};
use crate::stages::{self, PluginPlan};
use crate::state::{self, AgentState};

/// The running agent's state and tasks.
pub(super) struct Supervisor {
    pub(super) opts: Options,
    pub(super) st: AgentState,
    pub(super) file: state::StateFile,
    /// Told by the tasks whenever what `status` shows changes.
    pub(super) changed: Arc<Notify>,
    pub(super) inventory: Option<watch::Sender<Arc<Inventory>>>,
    pub(super) health_policy: watch::Sender<HealthPolicy>,
    pub(super) plugin_plan: Option<PluginPlan>,
    pub(super) plugin: Option<RunningPlugin>,
    /// Registrations of device plugins this agent ran before the current
    /// one, by resource: a restarted plugin's count (and
    /// `gpu_agent_plugin_registrations_total`) goes on from them.
    pub(super) registrations_before: BTreeMap<String, u64>,
    /// The pod-resources socket (a host path) the running exporter asks,
    /// and whether it answers.
    pub(super) pod_labels: Option<(String, watch::Receiver<PodLabels>)>,
    /// The kubelet's device-plugin directory the running plugin serves in
    /// (the policy's `spec.hostPaths`): a new one restarts the plugin.
    pub(super) plugin_dir: Option<String>,
    /// `Some(stages)` while the first pass has not yet made what containers
    /// need (the device plugin registers before): allocations wait on it.
    pub(super) preparing: watch::Sender<Option<String>>,
    pub(super) health: Option<RunningHealth>,
    pub(super) tasks: BTreeMap<&'static str, TaskControl>,
    /// The kernel-log reader's current run, and where its XIDs start.
    pub(super) kmsg: Option<tokio::task::JoinHandle<Result<kernel_log::Ended, String>>>,
    pub(super) kmsg_since: Option<kernel_log::Since>,
    /// The metrics exporter's run, and the configuration it serves.
    pub(super) metrics: Option<tokio::task::JoinHandle<Result<(), String>>>,
    pub(super) metrics_config: Option<ExporterConfig>,
    /// The serving exporter's stage detail (with the port it got).
    pub(super) metrics_detail: String,
    /// One MPS control daemon per MPS-shared resource (task `mps`).
    pub(super) mps: mps::MpsDaemons,
    /// Health events, told upward by the report task.
    pub(super) events: tokio::sync::broadcast::Sender<crate::health::EventRecord>,
    /// The node as the report tells it, and the report task.
    pub(super) report: Option<watch::Sender<Arc<gpu_agent_proto::report::v1::NodeReport>>>,
    pub(super) report_task: Option<tokio::task::JoinHandle<()>>,
    pub(super) link: Arc<std::sync::Mutex<crate::report::ControllerLink>>,
    /// The labels last worked out (kept when they cannot be worked out).
    pub(super) report_labels: crate::labels::Labels,
    /// The controller's wishes, from the report task.
    pub(super) desired: Option<mpsc::UnboundedReceiver<gpu_agent_proto::report::v1::Desired>>,
    /// The MIG layout the controller selects for this node, if any.
    pub(super) controller_mig: Option<String>,
    /// The cluster's ClusterPolicy (YAML) the controller sends, if any: it
    /// runs instead of the policy file.
    pub(super) controller_policy: Option<String>,
    /// The cluster's driver rollout: the controller's go-ahead, a failed try.
    pub(super) rollout: crate::driver::Rollout,
    /// What systemd hears (READY, STATUS, watchdog); nothing outside it.
    pub(super) systemd: notify::Systemd,
    /// What the passes last said in the log: a pass that changes nothing
    /// says nothing above DEBUG.
    pub(super) logged: stages::LogMemory,
    /// The DRA kubelet plugin, while `spec.dra.enabled`.
    pub(super) dra: Option<super::dra::RunningDra>,
    /// What DRA's MPS daemons keep between runs of the DRA plugin.
    pub(super) dra_mps: super::dra_mps::Kept,
    /// The claims the controller allocates to this node: the report task
    /// writes (`dra_feed_tx`, handed to it at its start), DRA reads.
    pub(super) dra_feed: watch::Receiver<Option<Arc<gpu_agent_proto::report::v1::DraClaims>>>,
    pub(super) dra_feed_tx: watch::Sender<Option<Arc<gpu_agent_proto::report::v1::DraClaims>>>,
    /// Told to have the report check in now (DRA waits for a claim).
    pub(super) report_now: Arc<Notify>,
}

impl Supervisor {
    pub(super) fn new(opts: Options) -> Self {
        let controller = opts.report.is_some();
        let mut st = AgentState::new(&opts.host, opts.heartbeat, opts.caps.names());
        st.policy = opts.policy_path.as_ref().map(|p| p.display().to_string());
        st.simulated = opts.view.simulated.clone();
        st.reconcile_interval_secs = opts.policy.reconcile_interval_seconds;
        let health_policy = watch::Sender::new(opts.policy.health.to_policy());
        // MPS daemons run through this binary's `host-exec`.
        let exe = std::env::current_exe().unwrap_or_else(|_| "/proc/self/exe".into());
        let mps = mps::MpsDaemons::new(
            opts.host.clone(),
            Arc::new(hostlib::process::HostSpawner::new(exe, opts.host.clone())),
        )
        .with_missing_caps({
            // `host-exec` chroots only into a host root that is not `/`
            // (and the trim at start drops CAP_SYS_CHROOT there).
            let needs: Vec<crate::caps::Capability> = mps::NEEDS
                .iter()
                .copied()
                .filter(|c| {
                    !(opts.host.is_system() && *c == crate::caps::Capability::CAP_SYS_CHROOT)
                })
                .collect();
            opts.caps.missing(&needs)
        });
        let (dra_feed_tx, dra_feed) = watch::channel(None);
        Supervisor {
            dra: None,
            dra_mps: Default::default(),
            dra_feed,
            dra_feed_tx,
            report_now: Arc::new(Notify::new()),
            mps,
            opts,
            st,
            file: state::StateFile::default(),
            changed: Arc::new(Notify::new()),
            inventory: None,
            health_policy,
            plugin_plan: None,
            plugin: None,
            registrations_before: BTreeMap::new(),
            pod_labels: None,
            plugin_dir: None,
            preparing: watch::Sender::new(None),
            health: None,
            tasks: BTreeMap::new(),
            kmsg: None,
            kmsg_since: None,
            metrics: None,
            metrics_config: None,
            metrics_detail: String::new(),
            events: tokio::sync::broadcast::Sender::new(crate::report::client::EVENT_BUFFER),
            report: None,
            report_task: None,
            link: Arc::default(),
            report_labels: Default::default(),
            desired: None,
            controller_mig: None,
            controller_policy: None,
            rollout: crate::driver::Rollout {
                controller,
                ..Default::default()
            },
            systemd: notify::Systemd::from_env(),
            logged: stages::LogMemory::default(),
        }
    }
}
