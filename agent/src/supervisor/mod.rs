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

mod mps;
pub mod notify;
mod policy_watch;
mod report;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hostlib::HostRoot;
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio::time::Instant;

use crate::caps::HeldCaps;
use crate::health::{HealthBoard, HealthMonitor, HealthPolicy, HealthView, kernel_log};
use crate::inventory::Inventory;
use crate::metrics::server::{ExporterConfig, PodLabels};
use crate::plugin::manager::{self, PluginError, PluginManager, ResourceStatus, StatusBoard};
use crate::plugin::resources::Resource;
use crate::policy::Policy;
use crate::source::NodeView;
use crate::stages::{self, Context, PluginPlan, Repair, Stage, StageState, Validation};
use crate::state::{self, AgentState};

/// The first restart of a failed task comes after this; each failure in a
/// row doubles it, up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(300);
/// A task that ran this long without failing starts its backoff afresh.
const STABLE_AFTER: Duration = Duration::from_secs(600);
/// Policy file events within this time are one change (an editor writes a
/// file in several steps; a ConfigMap update is several renames).
const POLICY_SETTLE: Duration = Duration::from_millis(150);
/// The kernel-log reader's task name in `status`.
const KERNEL_LOG: &str = "kernel-log";
/// The metrics exporter's task name.
const METRICS: &str = "metrics";
/// The report stream's task name.
const REPORT: &str = "report";

/// What `gpu-agent run` was asked for.
#[derive(Debug)]
pub struct Options {
    pub host: HostRoot,
    /// The policy file (in this process's filesystem: a ConfigMap volume in
    /// a DaemonSet), read again when it changes; `None`: the defaults.
    pub policy_path: Option<PathBuf>,
    pub policy: Policy,
    pub view: NodeView,
    pub caps: HeldCaps,
    /// Stamp the state file every this many seconds (0: never).
    pub heartbeat: u64,
    /// Run the stages once and exit.
    pub once: bool,
    /// Report to the cluster controller (`None`: the agent works alone).
    pub report: Option<crate::report::ReportConfig>,
}

/// The agent could not run.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error(transparent)]
    Lock(#[from] state::LockError),
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("cannot handle signals: {0}")]
    Signals(#[source] std::io::Error),
}

/// One supervised task, for `status` (the state file's type).
pub use crate::state::TaskStatus;

/// The host-files lock for a pass, waited for while another process holds
/// it (its pid and what it does are logged). `None` when it cannot be
/// taken at all: the writers then take it (or fail) each on their own.
fn host_files_lock(host: &HostRoot, what: &str) -> Option<hostlib::managed::HostFilesLock> {
    hostlib::managed::HostFilesLock::take(host, what, true)
        .inspect_err(|e| tracing::warn!(error = %e, "cannot take the host-files lock for the pass"))
        .ok()
}

/// Runs the agent until SIGTERM/SIGINT (or one pass with `once`). Returns
/// whether no stage failed (the last pass).
pub fn run(mut opts: Options) -> Result<bool, SupervisorError> {
    // Least privilege (caps.rs): only what the enabled stages use is kept,
    // before any other thread starts (capabilities belong to a thread) and
    // before any stage runs. A reload cannot have a dropped one back, so
    // with a controller the cluster's policy counts too: the last one it
    // sent, or (none remembered) what any policy may ask for.
    let remembered = opts
        .report
        .is_some()
        .then(|| remembered_cluster_policy(&opts.host))
        .flatten();
    let cluster = match (&opts.report, &remembered) {
        (None, _) => crate::caps::ClusterPolicy::NoController,
        (Some(_), Some(p)) => crate::caps::ClusterPolicy::Remembered(p),
        (Some(_), None) => crate::caps::ClusterPolicy::Unknown,
    };
    let (held, privileges) = crate::caps::restrict(&crate::caps::Setting {
        policy: &opts.policy,
        host_is_system: opts.host.is_system(),
        cluster,
    });
    opts.caps = held;
    // nvmlInit (10.7 ms on a real H100) runs beside what follows, on a
    // thread started now: it holds only the capabilities kept.
    opts.view.start_opening();
    // One agent per host; `status` knows it lives by this lock.
    let _lock = state::AgentLock::take(&opts.host)?;
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        host_root = %opts.host.path().display(),
        simulated = opts.view.simulated.as_deref().unwrap_or("no"),
        caps = %opts.caps.names().join(","),
        "gpu-agent starting"
    );
    log_unacted(&opts.policy);
    let mut sup = Supervisor::new(opts);
    sup.st.privileges = Some(privileges);
    if sup.opts.once {
        let pass = sup.first_pass();
        let ok = pass.ok();
        sup.st.stopped_at = Some(state::now());
        sup.sync_state();
        return Ok(ok);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("gpu-agent-worker")
        .enable_all()
        .build()
        .map_err(SupervisorError::Runtime)?;
    // The policy is watched before the first pass reads the host: a change
    // made meanwhile is not missed.
    let policy_watch = {
        let _guard = rt.enter();
        sup.opts
            .policy_path
            .as_deref()
            .and_then(|p| match policy_watch::PolicyWatch::new(p) {
                Ok(w) => Some(w),
                Err(e) => {
                    tracing::warn!(error = %e, "policy changes will be seen on SIGHUP only");
                    None
                }
            })
    };
    let pass = sup.first_pass();
    let ok = rt.block_on(sup.serve(pass, policy_watch))?;
    Ok(ok)
}

/// The last policy the controller sent, as remembered on the host; `None`
/// when there is none or it no longer parses (said in the log).
fn remembered_cluster_policy(host: &HostRoot) -> Option<Policy> {
    let path = crate::caps::CLUSTER_POLICY_MEMORY;
    let text = host.read_to_string(path).ok()?;
    match Policy::from_cluster_yaml(&text, path) {
        Ok((p, _)) => Some(p),
        Err(e) => {
            tracing::warn!(file = path, error = %e, "the remembered cluster policy does not parse; capabilities any policy may need are kept");
            None
        }
    }
}

/// Remembers the controller's policy for the next start (its capabilities
/// are chosen before the controller can be asked); written only when it
/// changed.
fn remember_cluster_policy(host: &HostRoot, yaml: &str) {
    let path = crate::caps::CLUSTER_POLICY_MEMORY;
    if host.read_to_string(path).is_ok_and(|old| old == yaml) {
        return;
    }
    if let Err(e) = host.write_atomic(path, yaml.as_bytes(), 0o600) {
        tracing::warn!(file = path, error = %e, "cannot remember the cluster's policy; the next start keeps what any policy may need");
    }
}

/// Names, once per policy, the device-plugin config's keys that gpu-agent
/// takes but does not act on: WARN where containers will miss what the key
/// asks for, INFO otherwise.
fn log_unacted(policy: &Policy) {
    let Ok(settings) = crate::plugin::settings(&policy.device_plugin, policy.mig.strategy) else {
        return;
    };
    for u in &settings.unacted {
        if u.warn {
            tracing::warn!(key = %u.key, what_instead = %u.why, "device-plugin config key not acted on");
        } else {
            tracing::info!(key = %u.key, what_instead = %u.why, "device-plugin config key not acted on");
        }
    }
}

/// [`stages::LogMemory::news`]'s name for a reconcile without a device list.
const NO_DEVICE_LIST: &str = "no device list";
/// The same for a workload check that fails.
const WORKLOAD_FAILED: &str = "workload check failed";

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

#[derive(Default)]
struct TaskControl {
    restarts: u32,
    backoff: Option<Duration>,
    started: Option<Instant>,
    restart_at: Option<Instant>,
    /// The same, in Unix seconds, for `status` (fixed when the restart is
    /// planned: the state file does not change while the task waits).
    restart_unix: Option<u64>,
    last_error: Option<String>,
}

impl Supervisor {
    fn new(opts: Options) -> Self {
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

    fn context(&self, policy_serve_first: bool) -> Context<'_> {
        let o = &self.opts;
        Context {
            policy: &o.policy,
            caps: &o.caps,
            sys: &o.view.sys,
            backend: o.view.backend.as_ref(),
            host: &o.host,
            apply: Some(&hostlib::command::SystemRunner),
            syscalls: &hostlib::LinuxSyscalls,
            simulated: o.view.simulated.is_some(),
            drain: None,
            serve_first: policy_serve_first,
            changes: Default::default(),
            mig_hold: None,
            upgrade: self.rollout.gate(self.controller_policy.is_some()),
            logged: Some(&self.logged),
        }
    }

    /// Where the pass found the node in the cluster's driver rollout: kept
    /// for the report; a go-ahead is spent once tried, a failure remembered.
    fn took_upgrade(&mut self, out: Option<crate::driver::UpgradeStatus>) {
        self.rollout.took(out.as_ref());
        self.st.upgrade = out;
    }

    fn first_pass(&mut self) -> stages::Pass {
        let started = std::time::Instant::now();
        let host_files = host_files_lock(&self.opts.host, "the first pass");
        let ctx = self.context(!self.opts.once);
        let pass = stages::run_pass(&ctx);
        let upgrade = ctx.upgrade.out.take();
        drop(ctx);
        drop(host_files);
        self.took_upgrade(upgrade);
        self.st.mig = keep_mig_since(self.st.mig.take(), pass.mig.clone());
        self.st.stages = pass.stages.clone();
        self.st.inventory = pass.inventory.clone();
        crate::metrics::agent::pass_took(started.elapsed());
        tracing::debug!(ms = started.elapsed().as_secs_f64() * 1e3, "first pass");
        // With stages left for after the registration, the operator's files
        // wait for them (after_registration): judged now, the deferred
        // stages' "not run yet" would remove the files a restarted agent's
        // pods and the operator's tools rely on, only to write them again
        // milliseconds later.
        if pass.deferred.is_empty() {
            self.validation_files();
        }
        pass
    }

    async fn serve(
        mut self,
        pass: stages::Pass,
        mut policy_watch: Option<policy_watch::PolicyWatch>,
    ) -> Result<bool, SupervisorError> {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).map_err(SupervisorError::Signals)?;
        let mut int = signal(SignalKind::interrupt()).map_err(SupervisorError::Signals)?;
        let mut hup = signal(SignalKind::hangup()).map_err(SupervisorError::Signals)?;
        if let Some(inv) = &pass.inventory {
            self.inventory = Some(watch::Sender::new(Arc::new(inv.clone())));
        }
        self.plugin_plan = pass.plugin.clone();
        // Allocations wait for what the first pass has yet to make.
        let before_allocation: Vec<Stage> = stages::BEFORE_ALLOCATION
            .into_iter()
            .filter(|s| pass.deferred.contains(s))
            .collect();
        if !before_allocation.is_empty() {
            let names: Vec<&str> = before_allocation.iter().map(|s| s.name()).collect();
            self.preparing.send_replace(Some(names.join(", ")));
        }
        // The device plugin follows the health monitor's view: it starts first.
        self.start_health();
        // MPS replicas are advertised once their daemons serve.
        self.reconcile_mps().await;
        self.start_plugin();
        // What the pass found, for `status`, before anything waits.
        self.refresh();
        self.sync_state();
        // The kubelet hears from us first; then the rest of the first pass.
        if let Some(p) = &self.plugin {
            p.first_attempts(
                &self.changed,
                Duration::from_secs(1),
                Duration::from_millis(250),
            )
            .await;
            self.refresh();
            self.sync_state();
        }
        self.start_metrics();
        self.start_report();
        if let Some(inv) = pass.inventory.clone()
            && !pass.deferred.is_empty()
        {
            self.after_registration(&inv, &pass.deferred, &before_allocation);
        }
        self.workload_check(true).await;
        self.refresh();
        self.sync_state();
        // Changed between `main` reading it and the watch starting?
        let mut policy_due: Option<Instant> = match &self.opts.policy_path {
            Some(p) if Policy::from_file(p).ok().as_ref() != Some(&self.opts.policy) => {
                Some(Instant::now())
            }
            _ => None,
        };
        let mut next_reconcile = self.next_reconcile();
        let heartbeat = self.opts.heartbeat;
        let mut tick = tokio::time::interval(Duration::from_secs(heartbeat.max(1)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        // systemd's watchdog (WatchdogSec=): pinged from this loop only, so
        // a loop that hangs is restarted. No watchdog, no timer.
        let mut watchdog = self.systemd.ping_every().map(|every| {
            let mut i = tokio::time::interval(every);
            i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            i
        });
        loop {
            let beat = async {
                if heartbeat > 0 {
                    tick.tick().await;
                } else {
                    std::future::pending::<()>().await;
                }
            };
            let ping = async {
                match watchdog.as_mut() {
                    Some(i) => {
                        i.tick().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            let restart_due = self.tasks.values().filter_map(|t| t.restart_at).min();
            let at = |t: Option<Instant>| async move {
                match t {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            let policy_event = async {
                match policy_watch.as_mut() {
                    Some(w) => w.next().await,
                    None => std::future::pending().await,
                }
            };
            let plugin_ended = async {
                match self.plugin.as_mut() {
                    Some(p) => p.ended().await,
                    None => std::future::pending().await,
                }
            };
            let kmsg_ended = async {
                match self.kmsg.as_mut() {
                    Some(h) => h.await,
                    None => std::future::pending().await,
                }
            };
            let metrics_ended = async {
                match self.metrics.as_mut() {
                    Some(h) => h.await,
                    None => std::future::pending().await,
                }
            };
            let mps_ended = self.mps.ended();
            let desired = async {
                match self.desired.as_mut() {
                    Some(rx) => rx.recv().await,
                    None => std::future::pending().await,
                }
            };
            let report_ended = async {
                match self.report_task.as_mut() {
                    Some(h) => h.await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = ping => {
                    self.systemd.ping();
                    continue;
                }
                _ = beat => {
                    if let Err(e) = self.file.stamp(&self.opts.host) {
                        tracing::warn!(error = %e, "cannot stamp the state file; `gpu-agent status` will think this agent hangs");
                    }
                    continue;
                }
                _ = self.changed.notified() => {}
                outcome = plugin_ended => self.task_ended("plugin", outcome),
                r = kmsg_ended => self.kernel_log_ended(r),
                (resource, why) = mps_ended => {
                    tracing::error!(task = mps::TASK, resource = %resource, "MPS control daemon stopped");
                    self.task_ended(mps::TASK, Err(why));
                }
                r = metrics_ended => {
                    self.metrics = None;
                    let outcome = match r {
                        Ok(o) => o,
                        Err(e) => Err(format!("the task panicked or was cancelled: {e}")),
                    };
                    self.task_ended(METRICS, outcome);
                }
                Some(d) = desired => {
                    self.controller_desired(d).await;
                    next_reconcile = self.next_reconcile();
                }
                r = report_ended => {
                    // It only ends by panicking: it reconnects on its own.
                    self.report_task = None;
                    self.report = None;
                    let why = match r {
                        Ok(()) => "stopped on its own".to_string(),
                        Err(e) => format!("the task panicked or was cancelled: {e}"),
                    };
                    self.task_ended(REPORT, Err(why));
                }
                _ = at(restart_due) => self.restart_due_tasks(),
                relevant = policy_event => {
                    if relevant {
                        policy_due = Some(Instant::now() + POLICY_SETTLE);
                    }
                    continue;
                }
                _ = at(policy_due) => {
                    policy_due = None;
                    self.reconcile("the policy file changed", true).await;
                    next_reconcile = self.next_reconcile();
                }
                _ = at(next_reconcile) => {
                    self.reconcile("interval", false).await;
                    next_reconcile = self.next_reconcile();
                }
                _ = hup.recv() => {
                    self.systemd.reloading();
                    self.reconcile("SIGHUP", true).await;
                    next_reconcile = self.next_reconcile();
                }
                _ = term.recv() => break,
                _ = int.recv() => break,
            }
            self.refresh();
            self.sync_state();
        }
        tracing::info!("gpu-agent stopping");
        self.systemd.stopping();
        if let Some(k) = self.kmsg.take() {
            k.abort();
        }
        if let Some(m) = self.metrics.take() {
            m.abort();
        }
        if let Some(r) = self.report_task.take() {
            r.abort();
        }
        if let Some(h) = self.health.take() {
            h.stop();
        }
        if let Some(p) = self.take_plugin() {
            p.stop().await;
        }
        // No more replicas are handed out: the MPS daemons may quit.
        self.mps.stop_all(self.opts.view.backend.as_ref()).await;
        // The device plugin is gone with us: scripts waiting on it must not
        // think it serves.
        validation_file(&self.opts.host, PLUGIN_READY, None);
        self.st.stopped_at = Some(state::now());
        self.st.ready = false;
        self.sync_state();
        Ok(!self.st.stages.iter().any(|s| s.state == StageState::Failed))
    }

    /// The stages the first pass left until the device plugin registered:
    /// first what containers need (then allocations go ahead), then the
    /// rest (validation, labels). Under the host-files lock, as a pass.
    fn after_registration(&mut self, inv: &Inventory, deferred: &[Stage], first: &[Stage]) {
        let started = std::time::Instant::now();
        let host_files = host_files_lock(&self.opts.host, "the first pass (after registration)");
        let ctx = self.context(false);
        let mut stages_now = self.st.stages.clone();
        stages::run_deferred(&ctx, first, inv, &mut stages_now);
        if self.preparing.send_replace(None).is_some() {
            tracing::info!(
                stages = %first.iter().map(|s| s.name()).collect::<Vec<_>>().join(", "),
                "the node is ready for containers; allocations go ahead"
            );
        }
        let rest: Vec<Stage> = deferred
            .iter()
            .copied()
            .filter(|s| !first.contains(s))
            .collect();
        stages::run_deferred(&ctx, &rest, inv, &mut stages_now);
        drop(ctx);
        drop(host_files);
        self.st.stages = stages_now;
        tracing::debug!(
            ms = started.elapsed().as_secs_f64() * 1e3,
            "first pass, after registration"
        );
        self.validation_files();
    }

    fn next_reconcile(&self) -> Option<Instant> {
        let secs = self.opts.policy.reconcile_interval_seconds;
        (secs > 0).then(|| Instant::now() + Duration::from_secs(secs))
    }

    /// Runs the stages again: each compares and repairs only what differs.
    /// With `reload`, the policy file is read first (an invalid one is
    /// logged and the running policy kept).
    async fn reconcile(&mut self, trigger: &str, reload: bool) {
        let mut policy_changed = false;
        // The policy from the file (or the defaults), with what the
        // controller asks for on top.
        let source = match (&self.controller_policy, &self.opts.policy_path, reload) {
            (_, _, false) => None,
            (Some(yaml), _, true) => {
                let origin = "the cluster's ClusterPolicy";
                let read = Policy::from_cluster_yaml(yaml, origin).map(|(p, ignored)| {
                    if !ignored.is_empty() && ignored != self.st.policy_ignored {
                        tracing::info!(keys = %ignored.join(", "), "ClusterPolicy keys gpu-agent does not use: left out");
                    }
                    self.st.policy_ignored = ignored;
                    p
                });
                Some((origin.to_string(), read))
            }
            (None, Some(path), true) => {
                self.st.policy_ignored.clear();
                Some((path.display().to_string(), Policy::from_file(path)))
            }
            (None, None, true) => {
                self.st.policy_ignored.clear();
                Some(("the defaults".to_string(), Ok(Policy::default())))
            }
        };
        self.st.policy_from_cluster = self.controller_policy.is_some();
        if let Some((path, read)) = source {
            match read.map(|p| self.with_controller(p)) {
                Ok(p) => {
                    self.st.policy_error = None;
                    policy_changed = p != self.opts.policy;
                    if !policy_changed && trigger != "SIGHUP" {
                        tracing::debug!("the policy file changed on disk, its meaning did not");
                        return;
                    }
                    if policy_changed {
                        tracing::info!(policy = %path, "policy changed");
                        if crate::plugin::settings(&p.device_plugin, p.mig.strategy)
                            .map(|s| s.unacted)
                            .ok()
                            != crate::plugin::settings(
                                &self.opts.policy.device_plugin,
                                self.opts.policy.mig.strategy,
                            )
                            .map(|s| s.unacted)
                            .ok()
                        {
                            log_unacted(&p);
                        }
                        self.drain_for_driver_change(&p).await;
                        self.opts.policy = p;
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "the policy is invalid; keeping the running one");
                    self.st.policy_error = Some(e.to_string());
                    return;
                }
            }
        }
        let _span = tracing::info_span!("reconcile", trigger).entered();
        let started = std::time::Instant::now();
        let mig_hold = self
            .prepare_mig_change(trigger == "SIGHUP" || policy_changed)
            .await;
        // Not while another process changes host files (a driver upgrade):
        // the pass waits for it, and holds the lock to its end.
        let host_files = host_files_lock(&self.opts.host, &format!("reconcile ({trigger})"));
        let (mut pass, upgrade) = {
            let mut ctx = self.context(false);
            ctx.mig_hold = mig_hold;
            let pass = stages::run_pass(&ctx);
            (pass, ctx.upgrade.out.take())
        };
        drop(host_files);
        self.took_upgrade(upgrade);
        self.st.mig = keep_mig_since(self.st.mig.take(), pass.mig.take());
        let now = state::now();
        let plugin_state = pass
            .stages
            .iter()
            .find(|s| s.stage == Stage::Plugin)
            .map(|s| s.state);
        for s in std::mem::take(&mut pass.stages) {
            let Some(old) = self.st.stages.iter_mut().find(|o| o.stage == s.stage) else {
                continue;
            };
            // The plugin's and health's live states come from their tasks.
            let live = matches!(s.stage, Stage::Plugin | Stage::Health | Stage::Metrics)
                && s.state == StageState::Ready
                && matches!(old.state, StageState::Done | StageState::Waiting);
            let mut new = s;
            new.repairs = old.repairs;
            new.last_repair = old.last_repair.take();
            if !new.changed.is_empty() {
                let what = new.changed.join("; ");
                if policy_changed {
                    tracing::info!(stage = new.stage.name(), changed = %what, "applied the new policy");
                } else {
                    new.repairs += 1;
                    tracing::warn!(stage = new.stage.name(), repaired = %what, "drift repaired");
                    new.last_repair = Some(Repair { at: now, what });
                }
            }
            if live {
                old.repairs = new.repairs;
                old.last_repair = new.last_repair;
                old.changed = new.changed;
                old.needs = new.needs;
                old.missing = new.missing;
            } else {
                new.validation = keep_since(old.validation.take(), new.validation);
                *old = new;
            }
        }
        let conditions = pass
            .inventory
            .as_ref()
            .map(|i| crate::health::conditions(i, self.st.inventory.as_ref()));
        // A GPU NVML has lost stays what the front ends know (advertised,
        // and unhealthy by its condition) until NVML sees it again: no new
        // inventory, no new device list.
        let lost = pass
            .inventory
            .as_ref()
            .is_some_and(|i| !i.backend.lost.is_empty());
        if lost {
            pass.plugin = None;
        }
        // The front ends hear of a new inventory only when the node's GPUs
        // changed (not their temperatures).
        if let Some(inv) = pass.inventory.filter(|_| !lost) {
            let same = self
                .st
                .inventory
                .as_ref()
                .is_some_and(|old| same_node(old, &inv));
            if !same {
                tracing::info!("the node's GPUs changed");
                match &self.inventory {
                    Some(tx) => {
                        tx.send_replace(Arc::new(inv.clone()));
                    }
                    None => self.inventory = Some(watch::Sender::new(Arc::new(inv.clone()))),
                }
                self.st.inventory = Some(inv);
            }
        }
        self.health_policy.send_if_modified(|p| {
            let new = self.opts.policy.health.to_policy();
            if *p == new {
                false
            } else {
                *p = new;
                true
            }
        });
        // Said once while it lasts, not at every reconcile.
        let no_list = pass.plugin.is_none() && plugin_state != Some(StageState::Disabled);
        let no_list_news = self.logged.news(NO_DEVICE_LIST, no_list.then_some(""));
        match pass.plugin {
            Some(plan) => {
                let settings_changed = self
                    .plugin_plan
                    .as_ref()
                    .is_none_or(|old| old.settings != plan.settings)
                    || self.plugin_dir.as_deref()
                        != Some(self.opts.policy.host_paths.device_plugin_dir().as_str());
                let resources_changed = self
                    .plugin_plan
                    .as_ref()
                    .is_none_or(|old| old.resources != plan.resources);
                self.plugin_plan = Some(plan);
                // New MPS resources have their daemons before they are served.
                self.reconcile_mps().await;
                match &self.plugin {
                    Some(_) if settings_changed => {
                        // New allocation settings: served by a new plugin.
                        tracing::info!(
                            stage = "plugin",
                            "device-plugin settings changed; restarting the device plugin"
                        );
                        if let Some(p) = self.take_plugin() {
                            p.stop().await;
                        }
                        self.start_plugin();
                    }
                    Some(p) if resources_changed => {
                        let resources = self
                            .plugin_plan
                            .as_ref()
                            .map(|p| p.resources.clone())
                            .unwrap_or_default();
                        let _ = p.updater.send(resources);
                    }
                    Some(_) => {}
                    None => self.start_plugin(),
                }
            }
            None if plugin_state == Some(StageState::Disabled) => {
                if let Some(p) = self.take_plugin() {
                    tracing::info!(
                        stage = "plugin",
                        "the device plugin is turned off by the policy"
                    );
                    p.stop().await;
                }
                self.plugin_plan = None;
            }
            None => {
                // No plan this time (e.g. NVML did not answer): keep
                // advertising what was (health marks the devices), never
                // drop the node's capacity to zero for a passing failure.
                if self.plugin.is_some() && no_list_news {
                    tracing::warn!(
                        stage = "plugin",
                        "no device list this reconcile; the device plugin keeps the last one"
                    );
                }
            }
        }
        self.reconcile_mps().await;
        if self.health.is_none() {
            self.start_health();
        } else if let (Some(h), Some(c)) = (&self.health, conditions) {
            h.set_conditions(c);
        }
        // `spec.health.kernelLog` turned on or off by the new policy.
        if policy_changed {
            if self.opts.policy.health.kernel_log {
                self.start_kernel_log();
            } else if let Some(k) = self.kmsg.take() {
                k.abort();
                let t = self.tasks.entry(KERNEL_LOG).or_default();
                t.started = None;
                t.restart_at = None;
                t.last_error = Some("off: spec.health.kernelLog is false".into());
            }
        }
        self.reconcile_metrics();
        self.validation_files();
        crate::metrics::agent::pass_took(started.elapsed());
        tracing::debug!(ms = started.elapsed().as_secs_f64() * 1e3, "reconciled");
        // A container is started only when the runtime, CDI or driver
        // changed (or the policy did), not at every reconcile.
        let touched = self.st.stages.iter().any(|s| {
            matches!(
                s.stage,
                Stage::Driver | Stage::Devnodes | Stage::Runtime | Stage::Cdi
            ) && !s.changed.is_empty()
        });
        self.workload_check(touched || policy_changed).await;
    }

    /// Before a pass that changes the MIG layout of some GPUs: the state
    /// says `pending`, the device plugin stops advertising those GPUs (the
    /// kubelet sees their devices go, no stale capacity), and the processes
    /// holding them are waited for (`spec.migManager.gpuClientsTimeoutSeconds`).
    /// `Some(why)` when they are still held: the pass then does not apply.
    /// A layout whose apply failed (and was rolled back) is tried again only
    /// when `retry` (a new policy, SIGHUP), not at every interval.
    async fn prepare_mig_change(&mut self, retry: bool) -> Option<String> {
        let plan = {
            let inv = self.st.inventory.as_ref()?;
            let control = self.opts.view.backend.mig_control()?;
            let (config, origin, layout) =
                crate::mig::selected(&self.opts.policy.mig_manager).ok()??;
            crate::mig::plan(control, inv, &config, &origin, &layout).ok()?
        };
        if plan.is_noop() {
            return None;
        }
        if !retry
            && let Some(m) = &self.st.mig
            && m.layout == plan.layout
            && m.state == crate::mig::MigConfigState::Failed
            && crate::mig::apply_failed(&m.detail)
        {
            return Some(format!(
                "it failed before and is tried again on a policy change or SIGHUP ({})",
                m.detail
            ));
        }
        tracing::info!(layout = %plan.layout, plan = %plan.summary(), "MIG layout change ahead");
        self.st.mig = keep_mig_since(
            self.st.mig.take(),
            Some(crate::mig::MigStatus {
                layout: plan.layout.clone(),
                state: crate::mig::MigConfigState::Pending,
                detail: plan.summary(),
                since: state::now(),
            }),
        );
        self.sync_state();
        let gone: std::collections::BTreeSet<&str> =
            plan.changing().map(|g| g.uuid.as_str()).collect();
        if let (Some(p), Some(plan_now)) = (&self.plugin, self.plugin_plan.as_mut()) {
            let keep: Vec<Resource> = plan_now
                .resources
                .iter()
                .map(|r| Resource {
                    devices: r
                        .devices
                        .iter()
                        .filter(|d| !gone.contains(d.gpu_uuid.as_str()))
                        .cloned()
                        .collect(),
                    ..r.clone()
                })
                .collect();
            let want: Vec<(String, usize)> = keep
                .iter()
                .filter(|r| !r.devices.is_empty())
                .map(|r| (r.name.clone(), r.devices.len()))
                .collect();
            tracing::info!(
                stage = "mig",
                gpus = gone.len(),
                "no longer advertising the GPUs whose layout changes"
            );
            plan_now.resources = keep.clone();
            let _ = p.updater.send(keep);
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let now: Vec<(String, usize)> = p
                    .board
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|r| (r.resource.clone(), r.devices))
                    .collect();
                if now == want || Instant::now() >= deadline {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            // The streams send the shorter lists on their own tasks.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let timeout = Duration::from_secs(self.opts.policy.mig_manager.gpu_clients_timeout_seconds);
        let deadline = Instant::now() + timeout;
        loop {
            let control = self.opts.view.backend.mig_control()?;
            let held = crate::mig::holders(control, &self.opts.host, &plan);
            if held.is_empty() {
                return None;
            }
            if Instant::now() >= deadline {
                return Some(crate::mig::holders_message(&held, timeout));
            }
            tracing::info!(stage = "mig", holders = %held.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "), "waiting for processes to leave the GPUs");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// `spec.validator.workload`: a short-lived container with one GPU
    /// injected by CDI, through the node's CRI runtime (after the runtime
    /// and CDI validated). `due`: run it even if it ran before.
    async fn workload_check(&mut self, due: bool) {
        let p = &self.opts.policy;
        if !p.validator.enabled || !p.validator.workload {
            self.st.workload = None;
            return;
        }
        if !due && self.st.workload.as_ref().is_some_and(|w| w.ok) {
            return;
        }
        let verdict = self.run_workload().await;
        let now = state::now();
        let v = match verdict {
            Ok(detail) => {
                self.logged.news(WORKLOAD_FAILED, None);
                tracing::info!(stage = "validate", "workload check passed: {detail}");
                Validation {
                    ok: true,
                    detail,
                    since: now,
                }
            }
            Err(detail) => {
                // Tried again at every reconcile; said when its words change.
                if self.logged.news(WORKLOAD_FAILED, Some(&detail)) {
                    tracing::error!(stage = "validate", "workload check failed: {detail}");
                } else {
                    tracing::debug!(stage = "validate", "workload check failed: {detail}");
                }
                Validation {
                    ok: false,
                    detail,
                    since: now,
                }
            }
        };
        self.st.workload = keep_since(self.st.workload.take(), Some(v));
        self.validation_files();
    }

    async fn run_workload(&self) -> Result<String, String> {
        use crate::policy::ContainerRuntime;
        let p = &self.opts.policy;
        if self.opts.view.simulated.is_some() {
            return Err("a simulated node cannot run a container with a GPU".into());
        }
        let validated = |stage: Stage| {
            self.st
                .stages
                .iter()
                .any(|s| s.stage == stage && s.validation.as_ref().is_some_and(|v| v.ok))
        };
        if !(validated(Stage::Runtime) && validated(Stage::Cdi)) {
            return Err("waits until the runtime and the CDI spec are validated".into());
        }
        let socket = match (&p.validator.cri_socket, p.operator.default_runtime) {
            (Some(s), _) => s.clone(),
            (None, ContainerRuntime::Containerd) => "/run/containerd/containerd.sock".into(),
            (None, ContainerRuntime::Crio) => "/var/run/crio/crio.sock".into(),
            (None, ContainerRuntime::Docker) => {
                return Err("this node's runtime is Docker, which has no CRI to run the check through (set spec.validator.criSocket to cri-dockerd's socket)".into());
            }
        };
        let resolved = self
            .opts
            .host
            .resolve(&socket)
            .map_err(|e| format!("the CRI socket {socket}: {e}"))?;
        if let Some(why) = crate::workload::cannot_run_reason(&resolved).await {
            return Err(format!("this node cannot run the check: {why}"));
        }
        let Some(inv) = &self.st.inventory else {
            return Err("no inventory".into());
        };
        let Some(index) = inv.gpus.iter().find_map(|g| g.index) else {
            return Err("no GPU NVML names by index".into());
        };
        let spec_path = crate::cdi::spec_path(&p.cdi.spec_dir);
        let spec: crate::cdi::Spec = self
            .opts
            .host
            .read_to_string(&spec_path)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str(&t).map_err(|e| format!("{spec_path}: {e}")))?;
        let device = format!("{}={index}", spec.kind);
        let mut check = crate::workload::WorkloadCheck::new(
            &self.opts.host,
            resolved,
            &p.validator.workload_image,
            &device,
        );
        if !check.expect_from_spec(&spec) {
            return Err(format!("{spec_path} has no device {device}"));
        }
        check
            .run()
            .await
            .map(|r| r.summary())
            .map_err(|e| e.to_string())
    }

    /// A new driver in the policy may mean an upgrade: stop advertising GPUs
    /// first (resources unregistered) and let the device plugin act on it
    /// before the pass blocks this thread.
    async fn drain_for_driver_change(&mut self, new: &Policy) {
        let old = &self.opts.policy;
        if !(new.driver.enabled && new.driver.bundle.is_some() && driver_source_changed(old, new)) {
            return;
        }
        // Under the cluster's rollout the GPUs stay advertised until the
        // controller's go-ahead.
        if self.controller_policy.is_some() {
            return;
        }
        self.stop_advertising().await;
    }

    /// Withdraws every resource from the kubelet (waiting up to 10 s for
    /// the unregistering); the next pass registers them again.
    async fn stop_advertising(&mut self) {
        let Some(plugin) = &self.plugin else { return };
        let _ = plugin.updater.send(Vec::new());
        let deadline = Instant::now() + Duration::from_secs(10);
        while plugin.board.lock().unwrap().iter().any(|r| r.registered) && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The next pass registers the resources again.
        self.plugin_plan = None;
    }

    /// The MPS daemons follow the device plugin's plan: one per MPS-shared
    /// resource (none on a simulated node, which has no MPS to run).
    async fn reconcile_mps(&mut self) {
        let mut plans = match (&self.plugin_plan, &self.inventory) {
            (Some(plan), Some(inv)) => {
                crate::plugin::mps::plans(&plan.settings, &plan.resources, &inv.borrow())
            }
            _ => Vec::new(),
        };
        if self.opts.view.simulated.is_some() && !plans.is_empty() {
            tracing::debug!(
                task = mps::TASK,
                "a simulated node runs no MPS control daemon; MPS replicas are advertised only"
            );
            plans.clear();
        }
        if plans.is_empty() && self.mps.is_empty() {
            return;
        }
        let backend = self.opts.view.backend.as_ref();
        if self.mps.update(plans, backend).await {
            self.task_started(mps::TASK);
            self.mps.wait_started().await;
        }
        if self.mps.is_empty() {
            self.tasks.remove(mps::TASK);
        }
    }

    /// After the backoff: the daemons that stopped start again.
    fn restart_mps(&mut self) {
        if self.mps.start_missing(self.opts.view.backend.as_ref()) {
            self.task_started(mps::TASK);
        }
    }

    /// Takes the device plugin out, to stop or replace it: its
    /// registrations are carried over (the count never goes back), and
    /// `status` no longer shows its resources, whose sockets go with it.
    fn take_plugin(&mut self) -> Option<RunningPlugin> {
        let p = self.plugin.take()?;
        for r in p.board.lock().unwrap().iter() {
            *self
                .registrations_before
                .entry(r.resource.clone())
                .or_default() += r.registrations;
        }
        self.st.plugin.clear();
        Some(p)
    }

    fn start_plugin(&mut self) {
        // One that ended on its own is replaced.
        drop(self.take_plugin());
        let Some(plan) = self.plugin_plan.clone() else {
            return;
        };
        let Some(inv) = self.inventory.as_ref().map(|tx| tx.borrow().clone()) else {
            return;
        };
        let health = self.health.as_ref().map(|h| h.view.clone());
        let dir = self.opts.policy.host_paths.device_plugin_dir();
        // The kubelet makes its plugin directory; where it has not yet, we
        // make it, noted so that `gpu-agent uninstall` removes it again.
        if !manager::plugin_dir(&self.opts.host, &dir).is_ok_and(|d| d.is_dir())
            && let Err(e) =
                hostlib::managed::ManagedFiles::lock(&self.opts.host, &hostlib::LinuxSyscalls, true)
                    .and_then(|f| f.create_dir(&dir))
        {
            tracing::warn!(stage = "plugin", dir = %dir, error = %e, "cannot make the kubelet's plugin directory");
        }
        self.plugin_dir = Some(dir.clone());
        match RunningPlugin::start(
            &self.opts.host,
            &dir,
            plan,
            inv,
            self.changed.clone(),
            health,
            Some(self.preparing.subscribe()),
        ) {
            Ok(p) => {
                self.plugin = Some(p);
                self.task_started("plugin");
            }
            Err(e) => self.task_ended("plugin", Err(e.to_string())),
        }
    }

    fn start_health(&mut self) {
        let planned = self
            .st
            .stages
            .iter()
            .any(|s| s.stage == Stage::Health && s.state == StageState::Ready);
        let Some(inv) = self.inventory.as_ref() else {
            return;
        };
        if !planned {
            return;
        }
        match RunningHealth::start(
            self.opts.view.backend.as_ref(),
            &self.opts.policy,
            inv.subscribe(),
            self.health_policy.subscribe(),
            self.changed.clone(),
            self.events.clone(),
        ) {
            Ok(h) => {
                self.st.health = h.board.lock().unwrap().clone();
                self.health = Some(h);
                self.task_started("health");
                self.start_kernel_log();
            }
            Err(e) => {
                if let Some(s) = self.st.stages.iter_mut().find(|s| s.stage == Stage::Health) {
                    s.state = StageState::Failed;
                    s.detail = e.clone();
                }
            }
        }
    }

    /// Follows the kernel log (`spec.health.kernelLog`) beside the health
    /// monitor; a run that fails is started again like any task.
    fn start_kernel_log(&mut self) {
        let Some(h) = &self.health else { return };
        let Some(inv) = &self.inventory else { return };
        if !self.opts.policy.health.kernel_log || self.kmsg.is_some() {
            return;
        }
        let recover_after = self.opts.policy.health.to_policy().recover_after;
        let since = self
            .kmsg_since
            .get_or_insert_with(|| kernel_log::Since::new(recover_after))
            .clone();
        self.kmsg = Some(tokio::spawn(kernel_log::follow(
            self.opts.host.clone(),
            inv.subscribe(),
            h.events.clone(),
            since,
        )));
        self.task_started(KERNEL_LOG);
    }

    /// The kernel-log reader ended: off for good (nothing to read here), or
    /// failed (started again with backoff).
    fn kernel_log_ended(
        &mut self,
        r: Result<Result<kernel_log::Ended, String>, tokio::task::JoinError>,
    ) {
        self.kmsg = None;
        match r {
            Ok(Ok(ended)) => {
                let t = self.tasks.entry(KERNEL_LOG).or_default();
                t.started = None;
                if let kernel_log::Ended::Off(why) = ended {
                    t.last_error = Some(why);
                }
            }
            Ok(Err(e)) => self.task_ended(KERNEL_LOG, Err(e)),
            Err(e) => self.task_ended(
                KERNEL_LOG,
                Err(format!("the task panicked or was cancelled: {e}")),
            ),
        }
    }

    fn task_started(&mut self, name: &'static str) {
        let t = self.tasks.entry(name).or_default();
        t.started = Some(Instant::now());
        t.restart_at = None;
    }

    /// A task stopped on its own: logged, shown, started again with backoff.
    fn task_ended(&mut self, name: &'static str, outcome: Result<(), String>) {
        let t = self.tasks.entry(name).or_default();
        let error = match outcome {
            Ok(()) => "stopped on its own".to_string(),
            Err(e) => e,
        };
        let stable = t.started.is_some_and(|s| s.elapsed() >= STABLE_AFTER);
        let backoff = match (t.backoff, stable) {
            (Some(b), false) => (b * 2).min(MAX_BACKOFF),
            _ => FIRST_BACKOFF,
        };
        t.backoff = Some(backoff);
        t.restart_at = Some(Instant::now() + backoff);
        t.restart_unix = Some(state::now() + backoff.as_secs());
        t.last_error = Some(error.clone());
        t.started = None;
        tracing::error!(task = name, error = %error, restart_in = ?backoff, "task failed; starting it again");
        if name == METRICS
            && let Some(s) = self
                .st
                .stages
                .iter_mut()
                .find(|s| s.stage == Stage::Metrics)
        {
            s.state = StageState::Failed;
            s.detail = format!("the metrics exporter stopped ({error}); restarting in {backoff:?}");
        }
        if name == "plugin" {
            self.plugin = None;
            if let Some(s) = self.st.stages.iter_mut().find(|s| s.stage == Stage::Plugin) {
                s.state = StageState::Failed;
                s.detail =
                    format!("the device plugin stopped ({error}); restarting in {backoff:?}");
                s.validation = None;
            }
        }
    }

    fn restart_due_tasks(&mut self) {
        let now = Instant::now();
        let due: Vec<&'static str> = self
            .tasks
            .iter()
            .filter(|(_, t)| t.restart_at.is_some_and(|at| at <= now))
            .map(|(n, _)| *n)
            .collect();
        for name in due {
            if let Some(t) = self.tasks.get_mut(name) {
                t.restart_at = None;
                t.restarts += 1;
            }
            tracing::info!(task = name, "starting the task again");
            match name {
                "plugin" => self.start_plugin(),
                KERNEL_LOG => self.start_kernel_log(),
                METRICS => self.start_metrics(),
                REPORT => self.start_report(),
                mps::TASK => self.restart_mps(),
                _ => {}
            }
        }
    }

    /// Copies the tasks' live status into the state.
    fn refresh(&mut self) {
        if let Some(p) = &self.plugin {
            self.st.plugin = p.board.lock().unwrap().clone();
            for r in &mut self.st.plugin {
                r.registrations += self
                    .registrations_before
                    .get(&r.resource)
                    .copied()
                    .unwrap_or(0);
            }
            stages::apply_plugin_status(&mut self.st.stages, &self.st.plugin);
            let v = stages::plugin_validation(&self.st.plugin);
            if let Some(s) = self.st.stages.iter_mut().find(|s| s.stage == Stage::Plugin) {
                s.validation = keep_since(s.validation.take(), Some(v));
            }
        }
        if let Some(h) = &self.health {
            self.st.health = h.board.lock().unwrap().clone();
            stages::apply_health_status(&mut self.st.stages, &self.st.health);
        }
        self.refresh_pod_labels();
        let tasks: Vec<TaskStatus> = self
            .tasks
            .iter()
            .map(|(name, t)| TaskStatus {
                name: name.to_string(),
                running: t.started.is_some(),
                restarts: t.restarts,
                last_error: t.last_error.clone(),
                restart_at: t.restart_at.and(t.restart_unix),
            })
            .collect();
        self.st.tasks = tasks;
        let workload_ok = !(self.opts.policy.validator.enabled
            && self.opts.policy.validator.workload)
            || self.st.workload.as_ref().is_some_and(|w| w.ok);
        self.st.ready = stages::ready(&self.st.stages) && workload_ok;
        let plugin_ok = self
            .st
            .stages
            .iter()
            .find(|s| s.stage == Stage::Plugin)
            .and_then(|s| s.validation.as_ref())
            .is_some_and(|v| v.ok);
        validation_file(&self.opts.host, PLUGIN_READY, plugin_ok.then_some(""));
    }

    /// Writes (or removes) the operator's validation files for the stages
    /// validated so far.
    fn validation_files(&self) {
        let state = |stage: Stage| self.st.stages.iter().find(|s| s.stage == stage);
        // Validated: on, and its check passed.
        let checked = |stage: Stage| {
            state(stage).is_some_and(|s| {
                s.state != StageState::Disabled && s.validation.as_ref().is_some_and(|v| v.ok)
            })
        };
        let ok = |stage: Stage| {
            checked(stage) || state(stage).is_some_and(|s| s.state == StageState::Disabled)
        };
        // A file says something was validated: never when every stage it
        // stands for is off.
        let driver_ok = ok(Stage::Driver)
            && ok(Stage::Devnodes)
            && (checked(Stage::Driver) || checked(Stage::Devnodes));
        let driver_text = stages::driver_ready_text(&self.opts.host, &self.opts.policy);
        validation_file(
            &self.opts.host,
            DRIVER_READY,
            driver_ok.then_some(driver_text.as_str()),
        );
        // With the workload check asked for, the toolkit is ready when a
        // container got its GPU (as the operator's toolkit validation means).
        let workload_asked =
            self.opts.policy.validator.enabled && self.opts.policy.validator.workload;
        let workload_passed = self.st.workload.as_ref().is_some_and(|w| w.ok);
        let workload_ok = !workload_asked || workload_passed;
        let toolkit_ok = ok(Stage::Runtime)
            && ok(Stage::Cdi)
            && workload_ok
            && (checked(Stage::Runtime) || checked(Stage::Cdi) || workload_passed);
        validation_file(&self.opts.host, TOOLKIT_READY, toolkit_ok.then_some(""));
    }

    /// `p` with what the controller asks of this node: its MIG layout
    /// (the node's `nvidia.com/mig.config` label) as `spec.migManager.default`.
    fn with_controller(&self, mut p: Policy) -> Policy {
        if let Some(layout) = &self.controller_mig {
            p.mig_manager.default = Some(layout.clone());
        }
        p
    }

    /// The controller's wishes changed: the policy is worked out again and,
    /// if that changes it, reconciled.
    async fn controller_desired(&mut self, d: gpu_agent_proto::report::v1::Desired) {
        let layout = (!d.mig_layout.is_empty()).then_some(d.mig_layout);
        let policy = (!d.policy_yaml.is_empty()).then_some(d.policy_yaml);
        if let Some(yaml) = &policy
            && Policy::from_cluster_yaml(yaml, "the cluster's ClusterPolicy").is_ok()
        {
            remember_cluster_policy(&self.opts.host, yaml);
        }
        let go_ahead =
            (d.upgrade_go_ahead && !d.driver_version.is_empty()).then_some(d.driver_version);
        let heard = self.rollout.hear(go_ahead.clone());
        if heard.go_ahead {
            // The GPUs are withdrawn before the modules go (whatever else
            // this message changes).
            tracing::info!(
                driver = go_ahead.as_deref().unwrap_or(""),
                "gpu-controller gives the go-ahead to upgrade the driver"
            );
            self.stop_advertising().await;
        }
        if layout == self.controller_mig && policy == self.controller_policy {
            if heard.go_ahead || heard.first {
                // A go-ahead, or the first word (driver changes were held
                // until the controller spoke): a pass.
                self.reconcile("the controller's word on the driver", false)
                    .await;
            }
            return;
        }
        if layout != self.controller_mig {
            tracing::info!(
                layout = layout.as_deref().unwrap_or("(none)"),
                "the controller selects a MIG layout"
            );
        }
        if policy != self.controller_policy {
            tracing::info!(
                "the controller {} the cluster's ClusterPolicy",
                if policy.is_some() {
                    "sends"
                } else {
                    "withdraws"
                }
            );
        }
        self.controller_mig = layout;
        self.controller_policy = policy;
        self.reconcile("the controller's settings", true).await;
    }

    /// Starts the report stream to the controller, when one is configured.
    /// It runs for the agent's life: it reconnects on its own.
    fn start_report(&mut self) {
        let Some(cfg) = self.opts.report.clone() else {
            return;
        };
        *self.link.lock().unwrap() = crate::report::ControllerLink {
            endpoint: cfg.endpoint.clone(),
            node_name: cfg.node_name.clone(),
            since: state::now(),
            ..Default::default()
        };
        let tx = watch::Sender::new(Arc::new(self.node_report()));
        let (desired_tx, desired_rx) = mpsc::unbounded_channel();
        self.desired = Some(desired_rx);
        let inputs = crate::report::client::Inputs {
            report: tx.subscribe(),
            events: self.events.subscribe(),
            link: self.link.clone(),
            changed: self.changed.clone(),
            desired: desired_tx,
        };
        self.report = Some(tx);
        self.report_task = Some(tokio::spawn(crate::report::client::run(cfg, inputs)));
        self.task_started(REPORT);
    }

    /// The node as the report tells it now.
    fn node_report(&mut self) -> gpu_agent_proto::report::v1::NodeReport {
        let labels = match &self.st.inventory {
            Some(inv) if self.opts.policy.gfd.enabled => crate::labels::node_labels(
                inv,
                &self.opts.policy.device_plugin,
                self.opts.policy.mig.strategy,
            )
            .ok(),
            _ => Some(Default::default()),
        };
        if let Some(l) = labels {
            self.report_labels = l;
        }
        report::node_report(&self.st, &self.report_labels)
    }

    /// Hands the report task the node as it is now, if that changed; and
    /// the link's state to `status`.
    fn publish_report(&mut self) {
        if self.opts.report.is_none() {
            return;
        }
        self.st.controller = Some(self.link.lock().unwrap().clone());
        if self.report.is_none() {
            return;
        }
        let now = self.node_report();
        if let Some(tx) = &self.report {
            tx.send_if_modified(|r| {
                if **r == now {
                    false
                } else {
                    *r = Arc::new(now);
                    true
                }
            });
        }
    }

    /// Starts the metrics exporter when its stage planned it.
    fn start_metrics(&mut self) {
        if self.metrics.is_some() {
            return;
        }
        let Some(inv) = self.inventory.as_ref() else {
            return;
        };
        let planned = self.st.stages.iter().any(|s| {
            s.stage == Stage::Metrics && matches!(s.state, StageState::Ready | StageState::Failed)
        }) && self.opts.policy.dcgm_exporter.enabled;
        if !planned {
            return;
        }
        let fail = |st: &mut AgentState, why: String| {
            if let Some(s) = st.stages.iter_mut().find(|s| s.stage == Stage::Metrics) {
                s.state = StageState::Failed;
                s.detail = why;
            }
        };
        let cfg = match ExporterConfig::from_spec(&self.opts.policy.dcgm_exporter) {
            Ok(c) => c,
            Err(e) => return fail(&mut self.st, e.to_string()),
        };
        let no_gpu = self
            .st
            .inventory
            .as_ref()
            .is_some_and(|i| i.gpus.is_empty());
        let sampler = match self.opts.view.backend.sampler() {
            Ok(s) => s,
            // A node without a GPU has nothing to sample: the agent's own
            // series are still served, and the stage is not failed.
            Err(_) if no_gpu => Box::new(crate::backend::NoGpuSampler),
            Err(e) => return fail(&mut self.st, format!("cannot sample the GPUs: {e}")),
        };
        let listener = match crate::metrics::server::bind(&cfg) {
            Ok(l) => l,
            Err(e) => {
                // Started again with backoff (the port may be freed).
                self.task_started(METRICS);
                return self.task_ended(METRICS, Err(e));
            }
        };
        let bound = listener.local_addr().unwrap_or(cfg.listen);
        // Through the host root: /var/lib/kubelet may be a link on the host.
        let pod_socket_path = self.opts.policy.host_paths.pod_resources_socket();
        let pod_socket = match self.opts.host.resolve(&pod_socket_path) {
            Ok(p) => p,
            Err(e) => {
                return fail(
                    &mut self.st,
                    format!("the kubelet's pod-resources socket: {e}"),
                );
            }
        };
        let (pod_labels, pod_labels_rx) = watch::channel(PodLabels::Unknown);
        self.pod_labels = Some((pod_socket_path, pod_labels_rx));
        self.metrics = Some(tokio::spawn(crate::metrics::server::run(
            cfg.clone(),
            listener,
            inv.subscribe(),
            sampler,
            pod_socket,
            pod_labels,
            self.changed.clone(),
        )));
        self.metrics_detail = format!(
            "serving {} field(s) on http://{bound}/metrics, sampled every {} ms while scraped",
            cfg.fields.fields.len(),
            cfg.interval.as_millis()
        );
        if let Some(s) = self
            .st
            .stages
            .iter_mut()
            .find(|s| s.stage == Stage::Metrics)
        {
            s.state = StageState::Done;
            s.detail = self.metrics_detail.clone();
        }
        self.metrics_config = Some(cfg);
        self.task_started(METRICS);
    }

    /// The metrics stage says whether the series carry pod labels, and why
    /// not: in its detail, and as its validation where a kubelet is there
    /// to be asked (a node without one has no pods to name).
    fn refresh_pod_labels(&mut self) {
        let Some((socket, rx)) = &self.pod_labels else {
            return;
        };
        if self.metrics.is_none() {
            return;
        }
        let kubelet_here = self
            .opts
            .host
            .resolve(format!(
                "{}/{}",
                self.opts.policy.host_paths.device_plugin_dir(),
                manager::KUBELET_SOCKET
            ))
            .is_ok_and(|p| p.exists());
        let (ok, words) = match &*rx.borrow() {
            PodLabels::Unknown => return,
            PodLabels::Attributed => (
                true,
                format!("pod labels from the kubelet's pod-resources API ({socket})"),
            ),
            PodLabels::Missing(why) if kubelet_here => (
                false,
                format!(
                    "no pod labels: {why}. The kubelet serves its pod-resources API under its --root-dir: set spec.hostPaths.kubeletRootDir if that is not {} (kubelets before 1.28 serve it only with the KubeletPodResources feature gate)",
                    self.opts.policy.host_paths.kubelet_root_dir
                ),
            ),
            PodLabels::Missing(why) => (
                true,
                format!("no pod labels: no kubelet on this node ({why})"),
            ),
        };
        let now = state::now();
        let detail = format!("{}; {words}", self.metrics_detail);
        if let Some(s) = self
            .st
            .stages
            .iter_mut()
            .find(|s| s.stage == Stage::Metrics && s.state == StageState::Done)
        {
            s.detail = detail;
            let v = Validation {
                ok,
                detail: words,
                since: now,
            };
            s.validation = keep_since(s.validation.take(), Some(v));
        }
    }

    /// After a reconcile: the exporter follows the policy (off, or started
    /// again on a new address, counters file or interval).
    fn reconcile_metrics(&mut self) {
        let want = self
            .opts
            .policy
            .dcgm_exporter
            .enabled
            .then(|| ExporterConfig::from_spec(&self.opts.policy.dcgm_exporter).ok())
            .flatten();
        let pod_socket = self.opts.policy.host_paths.pod_resources_socket();
        let pod_socket_changed = self
            .pod_labels
            .as_ref()
            .is_some_and(|(s, _)| *s != pod_socket);
        if self.metrics.is_some() && (want != self.metrics_config || pod_socket_changed) {
            if let Some(m) = self.metrics.take() {
                m.abort();
            }
            tracing::info!(
                stage = "metrics",
                "the exporter's policy changed; starting it again"
            );
            let t = self.tasks.entry(METRICS).or_default();
            t.started = None;
            self.metrics_config = None;
            // The stage kept the running exporter's word (done): planned
            // again, or the exporter would not start (a new counters file
            // stopped it for good).
            if let Some(s) = self
                .st
                .stages
                .iter_mut()
                .find(|s| s.stage == Stage::Metrics && s.state == StageState::Done)
            {
                s.state = StageState::Ready;
            }
        }
        let waiting = self
            .tasks
            .get(METRICS)
            .is_some_and(|t| t.restart_at.is_some());
        if self.metrics.is_none() && !waiting {
            self.start_metrics();
        } else if self.metrics.is_some()
            && let Some(s) = self
                .st
                .stages
                .iter_mut()
                .find(|s| s.stage == Stage::Metrics)
        {
            // The pass planned it again; the running exporter's word stands.
            s.state = StageState::Done;
            s.detail = self.metrics_detail.clone();
        }
    }

    fn sync_state(&mut self) {
        if self.st.stopped_at.is_none() {
            self.systemd.update(&self.st);
        }
        self.publish_report();
        record_series(&self.st);
        if let Err(e) = self.file.sync(&mut self.st, &self.opts.host) {
            tracing::warn!(error = %e, "cannot write the state file; `gpu-agent status` will not see this agent");
        }
    }
}

/// Stage states, repairs and registrations into the agent's own series
/// (`gpu_agent_…`), from the agent's state.
fn record_series(st: &AgentState) {
    crate::metrics::agent::set_status(
        st.stages
            .iter()
            .map(|x| (x.stage.name().to_string(), x.state.label().to_string()))
            .collect(),
        st.stages
            .iter()
            .map(|x| (x.stage.name().to_string(), x.repairs))
            .collect(),
        st.plugin
            .iter()
            .map(|r| (r.resource.clone(), r.registrations))
            .collect(),
    );
}

/// The GPU Operator's validation directory, and the files gpu-agent keeps there.
pub const VALIDATIONS_DIR: &str = "/run/nvidia/validations";
pub const DRIVER_READY: &str = "driver-ready";
pub const TOOLKIT_READY: &str = "toolkit-ready";
pub const PLUGIN_READY: &str = "plugin-ready";

/// Writes `content` to the validation file `name` when it differs, or
/// removes the file (`None`).
fn validation_file(host: &HostRoot, name: &str, content: Option<&str>) {
    let path = format!("{VALIDATIONS_DIR}/{name}");
    let result = match content {
        Some(text) => match host.read_optional(&path) {
            Ok(Some(old)) if old == text => Ok(()),
            _ => host
                .write_atomic(&path, text.as_bytes(), 0o644)
                .map(|_| tracing::info!(stage = "validate", file = %path, "written")),
        },
        None => host
            .resolve_no_follow(&path)
            .and_then(|p| match std::fs::remove_file(&p) {
                Ok(()) => {
                    tracing::info!(stage = "validate", file = %path, "removed");
                    Ok(())
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(hostlib::HostError::io(p, e)),
            }),
    };
    if let Err(e) = result {
        tracing::warn!(stage = "validate", file = %path, error = %e, "cannot update the validation file");
    }
}

/// A validation result keeps its `since` while it says the same.
/// The new MIG status, keeping when it began if the layout and state did not change.
fn keep_mig_since(
    old: Option<crate::mig::MigStatus>,
    new: Option<crate::mig::MigStatus>,
) -> Option<crate::mig::MigStatus> {
    match (old, new) {
        (Some(o), Some(mut n)) if o.layout == n.layout && o.state == n.state => {
            n.since = o.since;
            Some(n)
        }
        (_, n) => n,
    }
}

fn keep_since(old: Option<Validation>, new: Option<Validation>) -> Option<Validation> {
    match (old, new) {
        (Some(o), Some(mut n)) if o.ok == n.ok && o.detail == n.detail => {
            n.since = o.since;
            Some(n)
        }
        (_, n) => n,
    }
}

/// The same GPUs, MIG devices and driver (telemetry aside).
pub fn same_node(a: &Inventory, b: &Inventory) -> bool {
    let strip = |i: &Inventory| {
        let mut i = i.clone();
        for g in &mut i.gpus {
            g.telemetry = Default::default();
        }
        i
    };
    strip(a) == strip(b)
}

/// The driver the policy asks for is not the one it asked for before.
fn driver_source_changed(old: &Policy, new: &Policy) -> bool {
    let (a, b) = (&old.driver, &new.driver);
    (
        &a.bundle,
        &a.bundle_sha256,
        &a.version,
        &a.module_dir,
        a.use_open_kernel_modules,
    ) != (
        &b.bundle,
        &b.bundle_sha256,
        &b.version,
        &b.module_dir,
        b.use_open_kernel_modules,
    )
}

/// The device plugin, served in the background.
#[derive(Debug)]
pub struct RunningPlugin {
    board: StatusBoard,
    updater: mpsc::UnboundedSender<Vec<Resource>>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), PluginError>>>,
}

impl RunningPlugin {
    /// Serves `plan` (devices' health from `health`, if given; allocations
    /// held while `preparing` says the node is not ready for containers).
    pub fn start(
        host: &HostRoot,
        dir: &str,
        plan: PluginPlan,
        inventory: Arc<Inventory>,
        changed: Arc<Notify>,
        health: Option<watch::Receiver<HealthView>>,
        preparing: Option<crate::plugin::server::Preparing>,
    ) -> Result<Self, PluginError> {
        let dir = manager::plugin_dir(host, dir).map_err(|e| PluginError::Dir {
            path: host.path().join(dir.trim_start_matches('/')),
            source: std::io::Error::other(e.to_string()),
        })?;
        let mut mgr = PluginManager::new(
            dir,
            plan.resources,
            inventory,
            Arc::new(plan.settings),
            host.clone(),
        )
        .with_change_signal(changed.clone());
        if let Some(h) = health {
            mgr = mgr.with_health(h);
        }
        if let Some(p) = preparing {
            mgr = mgr.with_preparing(p);
        }
        let board = mgr.board();
        let updater = mgr.updater();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let result = mgr
                .run(async {
                    let _ = stopped.await;
                })
                .await;
            changed.notify_one();
            result
        });
        Ok(RunningPlugin {
            board,
            updater,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// Resolves when the plugin task ends on its own.
    async fn ended(&mut self) -> Result<(), String> {
        let Some(task) = self.task.as_mut() else {
            return std::future::pending().await;
        };
        let r = task.await;
        self.task = None;
        match r {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(e) => Err(format!("the task panicked or was cancelled: {e}")),
        }
    }

    /// Waits until every resource's first registration was answered
    /// (accepted or refused, within `limit`) and the kubelet listed the
    /// accepted ones' devices (within `list_grace` after that).
    async fn first_attempts(&self, changed: &Notify, limit: Duration, list_grace: Duration) {
        let answered = |b: &[ResourceStatus]| {
            b.iter()
                .all(|r| r.registrations > 0 || r.last_error.is_some())
        };
        let listed = |b: &[ResourceStatus]| b.iter().all(|r| r.lists > 0 || r.last_error.is_some());
        for (done, wait) in [
            (&answered as &dyn Fn(&[ResourceStatus]) -> bool, limit),
            (&listed, list_grace),
        ] {
            let deadline = Instant::now() + wait;
            loop {
                let finished = self.task.as_ref().is_none_or(|t| t.is_finished());
                if done(&self.board.lock().unwrap()) || finished {
                    break;
                }
                tokio::select! {
                    _ = changed.notified() => {}
                    _ = tokio::time::sleep_until(deadline) => return,
                }
            }
        }
    }

    /// Copies the plugins' status into `st` (the demo's view).
    pub fn refresh(&self, st: &mut AgentState) {
        st.plugin = self.board.lock().unwrap().clone();
        stages::apply_plugin_status(&mut st.stages, &st.plugin);
    }

    /// Stops serving; the sockets are removed.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            match task.await {
                Ok(Err(e)) => tracing::error!(stage = "plugin", error = %e, "device plugin failed"),
                Err(e) => {
                    tracing::error!(stage = "plugin", error = %e, "device plugin task failed")
                }
                Ok(Ok(())) => {}
            }
        }
    }
}

/// The health monitor and its sources.
#[derive(Debug)]
pub struct RunningHealth {
    board: HealthBoard,
    view: watch::Receiver<HealthView>,
    conditions: watch::Sender<crate::health::Conditions>,
    /// Where the monitor's events come from (the NVML watcher's, and the
    /// kernel log's).
    events: mpsc::UnboundedSender<crate::backend::HealthEvent>,
    stop: Option<oneshot::Sender<()>>,
}

impl RunningHealth {
    /// Starts the monitor on `backend`'s events.
    pub fn start(
        backend: &dyn crate::backend::GpuBackend,
        policy: &Policy,
        inventory: watch::Receiver<Arc<Inventory>>,
        health_policy: watch::Receiver<HealthPolicy>,
        changed: Arc<Notify>,
        events: tokio::sync::broadcast::Sender<crate::health::EventRecord>,
    ) -> Result<Self, String> {
        let (tx, rx) = mpsc::unbounded_channel();
        backend
            .watch_health(tx.clone())
            .map_err(|e| e.to_string())?;
        let uuids = crate::health::watched_uuids(&inventory.borrow());
        let monitor = HealthMonitor::new(policy.health.to_policy(), uuids)
            .with_change_signal(changed)
            .with_events(events);
        let board = monitor.board();
        let view = monitor.subscribe();
        let conditions = watch::Sender::new(crate::health::conditions(&inventory.borrow(), None));
        let (stop, stopped) = oneshot::channel::<()>();
        let inputs = crate::health::Inputs {
            inventory: Some(inventory.clone()),
            policy: Some(health_policy),
            conditions: Some(conditions.subscribe()),
        };
        tokio::spawn(monitor.run(rx, inputs, async {
            let _ = stopped.await;
        }));
        Ok(RunningHealth {
            board,
            view,
            conditions,
            events: tx,
            stop: Some(stop),
        })
    }

    /// NVML's conditions (lost GPU, pending reset, thermal) at a reconcile.
    fn set_conditions(&self, seen: crate::health::Conditions) {
        self.conditions.send_if_modified(|c| {
            if *c == seen {
                false
            } else {
                *c = seen;
                true
            }
        });
    }

    /// The live health of every GPU.
    pub fn board(&self) -> HealthBoard {
        self.board.clone()
    }

    /// The health the device plugin follows.
    pub fn view(&self) -> watch::Receiver<HealthView> {
        self.view.clone()
    }

    pub fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}
