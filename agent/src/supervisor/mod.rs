//! The running agent (`gpu-agent run`): one supervisor that runs the stages,
//! then keeps reconciling — every `spec.reconcileIntervalSeconds`, when the
//! policy file changes (inotify; a ConfigMap's `..data` swap included), on
//! SIGHUP — and runs the long-lived front ends as tasks: the device plugin
//! and the health monitor (NVML events, the kernel log). One inventory is
//! published on a watch channel; the front ends subscribe to it, none
//! re-discovers. A task that fails is logged, shown in `status` and started
//! again with backoff; the others go on. SIGTERM/SIGINT: every task stops,
//! sockets are removed, the state is written.
//!
//! Passes run on the thread that called [`run`]; the tasks run on one
//! runtime worker, so the device plugin serves while a pass runs.

mod controller;
mod exporter;
mod health;
mod mig_change;
mod mps;
pub mod notify;
mod plugin;
mod policy_watch;
mod readiness;
mod reconcile;
mod reload;
mod report;
mod run_loop;
mod tasks;
mod workload_check;

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::{Notify, mpsc, watch};

use crate::health::{HealthPolicy, kernel_log};
use crate::inventory::Inventory;
use crate::metrics::server::{ExporterConfig, PodLabels};
use crate::stages::{self, PluginPlan};
use crate::state::{self, AgentState};

pub use health::RunningHealth;
pub use plugin::RunningPlugin;
pub use readiness::{DRIVER_READY, PLUGIN_READY, TOOLKIT_READY, VALIDATIONS_DIR};
pub use reconcile::same_node;
pub use run_loop::{Options, SupervisorError, run};
use tasks::TaskControl;

/// One supervised task, for `status` (the state file's type).
pub use crate::state::TaskStatus;

/// The running agent's state and tasks.
struct Supervisor {
    opts: Options,
    st: AgentState,
    file: state::StateFile,
    /// Told by the tasks whenever what `status` shows changes.
    changed: Arc<Notify>,
    inventory: Option<watch::Sender<Arc<Inventory>>>,
    health_policy: watch::Sender<HealthPolicy>,
    plugin_plan: Option<PluginPlan>,
    plugin: Option<RunningPlugin>,
    /// Registrations of device plugins this agent ran before the current
    /// one, by resource: a restarted plugin's count (and
    /// `gpu_agent_plugin_registrations_total`) goes on from them.
    registrations_before: BTreeMap<String, u64>,
    /// The pod-resources socket (a host path) the running exporter asks,
    /// and whether it answers.
    pod_labels: Option<(String, watch::Receiver<PodLabels>)>,
    /// The kubelet's device-plugin directory the running plugin serves in
    /// (the policy's `spec.hostPaths`): a new one restarts the plugin.
    plugin_dir: Option<String>,
    /// `Some(stages)` while the first pass has not yet made what containers
    /// need (the device plugin registers before): allocations wait on it.
    preparing: watch::Sender<Option<String>>,
    health: Option<RunningHealth>,
    tasks: BTreeMap<&'static str, TaskControl>,
    /// The kernel-log reader's current run, and where its XIDs start.
    kmsg: Option<tokio::task::JoinHandle<Result<kernel_log::Ended, String>>>,
    kmsg_since: Option<kernel_log::Since>,
    /// The metrics exporter's run, and the configuration it serves.
    metrics: Option<tokio::task::JoinHandle<Result<(), String>>>,
    metrics_config: Option<ExporterConfig>,
    /// The serving exporter's stage detail (with the port it got).
    metrics_detail: String,
    /// One MPS control daemon per MPS-shared resource (task `mps`).
    mps: mps::MpsDaemons,
    /// Health events, told upward by the report task.
    events: tokio::sync::broadcast::Sender<crate::health::EventRecord>,
    /// The node as the report tells it, and the report task.
    report: Option<watch::Sender<Arc<gpu_agent_proto::report::v1::NodeReport>>>,
    report_task: Option<tokio::task::JoinHandle<()>>,
    link: Arc<std::sync::Mutex<crate::report::ControllerLink>>,
    /// The labels last worked out (kept when they cannot be worked out).
    report_labels: crate::labels::Labels,
    /// The controller's wishes, from the report task.
    desired: Option<mpsc::UnboundedReceiver<gpu_agent_proto::report::v1::Desired>>,
    /// The MIG layout the controller selects for this node, if any.
    controller_mig: Option<String>,
    /// The cluster's ClusterPolicy (YAML) the controller sends, if any: it
    /// runs instead of the policy file.
    controller_policy: Option<String>,
    /// The cluster's driver rollout: the controller's go-ahead, a failed try.
    rollout: crate::driver::Rollout,
    /// What systemd hears (READY, STATUS, watchdog); nothing outside it.
    systemd: notify::Systemd,
    /// What the passes last said in the log: a pass that changes nothing
    /// says nothing above DEBUG.
    logged: stages::LogMemory,
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
        Supervisor {
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
