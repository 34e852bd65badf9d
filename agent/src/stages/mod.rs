//! The agent's ordered stages (ARCHITECTURE.md, "The data's way through one
//! node"). Each stage says what it needs (capabilities, earlier stages) and
//! whether the policy turns it on. A stage that is not built yet reports
//! `not implemented`, never `done`.

mod cdi;
mod devnodes;
mod discover;
mod driver;
mod health;
mod labels;
mod metrics;
mod mig;
mod plugin;
mod runtime;
mod validate;

pub use health::apply_health_status;
pub use plugin::apply_plugin_status;
pub use validate::{driver_ready_text, host_ready, plugin_validation, ready, revalidate};

use hostlib::HostRoot;
use serde::{Deserialize, Serialize};

use crate::backend::GpuBackend;
use crate::caps::{Capability, HeldCaps};
use crate::inventory::Inventory;
use crate::plugin::resources::{PluginSettings, Resource};
use crate::policy::Policy;
use hostlib::Syscalls;
use hostlib::command::CommandRunner;

/// Every stage, in the order the agent runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    Discover,
    Driver,
    Devnodes,
    Runtime,
    Cdi,
    Validate,
    Plugin,
    Health,
    Labels,
    Metrics,
    Mig,
}

impl Stage {
    pub const ALL: [Stage; 11] = [
        Stage::Discover,
        Stage::Driver,
        // Before the nodes, the CDI spec and the device plugin: they
        // describe the MIG devices the layout makes.
        Stage::Mig,
        Stage::Devnodes,
        Stage::Runtime,
        Stage::Cdi,
        Stage::Validate,
        Stage::Plugin,
        Stage::Health,
        Stage::Labels,
        Stage::Metrics,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Stage::Discover => "discover",
            Stage::Driver => "driver",
            Stage::Devnodes => "devnodes",
            Stage::Runtime => "runtime",
            Stage::Cdi => "cdi",
            Stage::Validate => "validate",
            Stage::Plugin => "plugin",
            Stage::Health => "health",
            Stage::Labels => "labels",
            Stage::Metrics => "metrics",
            Stage::Mig => "mig",
        }
    }

    /// What the stage does, in a few words.
    pub fn purpose(self) -> &'static str {
        match self {
            Stage::Discover => "find GPUs (sysfs, /proc, NVML)",
            Stage::Driver => "verify the driver bundle, load kernel modules",
            Stage::Devnodes => "create /dev/nvidia* and /dev/char links",
            Stage::Runtime => "configure containerd / CRI-O / Docker",
            Stage::Cdi => "write CDI specs for every GPU",
            Stage::Validate => "check every stage, write validation status",
            Stage::Plugin => "serve the kubelet device-plugin API",
            Stage::Health => "watch XIDs, ECC and temperature",
            Stage::Labels => "write GPU feature-discovery labels",
            Stage::Metrics => "export Prometheus metrics on :9400",
            Stage::Mig => "apply the MIG layout",
        }
    }

    /// Capabilities the stage's system calls need.
    pub fn needs(self) -> &'static [Capability] {
        match self {
            Stage::Discover
            | Stage::Validate
            | Stage::Plugin
            | Stage::Labels
            | Stage::Metrics
            | Stage::Cdi => &[],
            Stage::Driver => &[Capability::CAP_SYS_MODULE],
            Stage::Devnodes => &[Capability::CAP_MKNOD],
            // Writing /etc as root; a reload runs the host's systemctl.
            Stage::Runtime => &[],
            // NVML events need no capability; the kernel log needs
            // CAP_SYSLOG only where kernel.dmesg_restrict is 1, and without
            // it health goes on from NVML (the reader says why it is off).
            Stage::Health => &[],
            // MIG reconfiguration through NVML is a privileged operation.
            Stage::Mig => &[Capability::CAP_SYS_ADMIN],
        }
    }

    /// [`Stage::needs`] for this policy and node: the host-driver mode
    /// loads no module, and a simulated node gets no system calls.
    pub fn needs_under(self, policy: &Policy, simulated: bool) -> &'static [Capability] {
        match self {
            Stage::Driver if simulated || !policy.driver.enabled => &[],
            Stage::Devnodes if simulated => &[],
            Stage::Mig if simulated || policy.mig_manager.selected_layout().is_none() => &[],
            other => other.needs(),
        }
    }

    /// Earlier stages this one waits on.
    pub fn after(self) -> &'static [Stage] {
        match self {
            Stage::Discover => &[],
            Stage::Driver => &[Stage::Discover],
            Stage::Devnodes => &[Stage::Driver],
            Stage::Runtime => &[Stage::Discover],
            Stage::Cdi => &[Stage::Devnodes],
            // Validation checks what is done and says what is not; it does
            // not hold the front ends back (a CDI file gone missing must not
            // take the GPUs' capacity away): it takes readiness away.
            Stage::Validate | Stage::Plugin | Stage::Labels | Stage::Metrics | Stage::Health => {
                &[Stage::Discover]
            }
            Stage::Mig => &[Stage::Driver],
        }
    }

    /// `Some(reason)` when the policy turns the stage off.
    pub fn disabled_by(self, p: &Policy) -> Option<&'static str> {
        match self {
            Stage::Runtime if !p.toolkit.enabled => Some("spec.toolkit.enabled is false"),
            Stage::Cdi if !p.cdi.enabled => Some("spec.cdi.enabled is false"),
            Stage::Validate if !p.validator.enabled => Some("spec.validator.enabled is false"),
            Stage::Plugin if !p.device_plugin.enabled => Some("spec.devicePlugin.enabled is false"),
            Stage::Health if !p.device_plugin.enabled && !p.dcgm_exporter.enabled => {
                Some("both spec.devicePlugin and spec.dcgmExporter are disabled")
            }
            Stage::Labels if !p.gfd.enabled => Some("spec.gfd.enabled is false"),
            Stage::Metrics if !p.dcgm_exporter.enabled => {
                Some("spec.dcgmExporter.enabled is false")
            }
            Stage::Mig if !p.mig_manager.enabled => Some("spec.migManager.enabled is false"),
            _ => None,
        }
    }

    /// Built and running for real.
    pub fn implemented(self) -> bool {
        matches!(
            self,
            Stage::Discover
                | Stage::Driver
                | Stage::Devnodes
                | Stage::Runtime
                | Stage::Cdi
                | Stage::Validate
                | Stage::Plugin
                | Stage::Health
                | Stage::Metrics
                | Stage::Labels
                | Stage::Mig
        )
    }
}

/// Where a stage stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StageState {
    Done,
    /// Worked out, but it takes a running agent to carry out (e.g. the
    /// device plugin's resources when `status` inspects the host).
    Ready,
    Failed,
    /// A needed capability is missing.
    Blocked,
    /// Waiting on an earlier stage that failed or is blocked.
    Waiting,
    /// Turned off by the policy.
    Disabled,
    /// Not built yet.
    NotImplemented,
}

impl StageState {
    pub fn label(self) -> &'static str {
        match self {
            StageState::Done => "done",
            StageState::Ready => "ready",
            StageState::Failed => "failed",
            StageState::Blocked => "blocked",
            StageState::Waiting => "waiting",
            StageState::Disabled => "disabled",
            StageState::NotImplemented => "not implemented",
        }
    }
}

/// One stage's status, as `gpu-agent status` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageStatus {
    pub stage: Stage,
    pub state: StageState,
    /// One line saying why, or what was done.
    pub detail: String,
    /// Capabilities the stage needs.
    pub needs: Vec<String>,
    /// Of those, the ones this process does not hold.
    pub missing: Vec<String>,
    /// What this stage changed on the host in its last pass.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changed: Vec<String>,
    /// Drift repaired by reconciles since the agent started.
    #[serde(default)]
    pub repairs: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_repair: Option<Repair>,
    /// The stage's last validation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation: Option<Validation>,
}

impl StageStatus {
    pub fn new(stage: Stage, state: StageState, detail: String) -> Self {
        StageStatus {
            stage,
            state,
            detail,
            needs: Vec::new(),
            missing: Vec::new(),
            changed: Vec::new(),
            repairs: 0,
            last_repair: None,
            validation: None,
        }
    }
}

/// One repair: drift a reconcile found and put right.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Repair {
    /// Unix seconds.
    pub at: u64,
    pub what: String,
}

/// A stage's validation: in-process checks of what the stage set up.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Validation {
    pub ok: bool,
    /// What was checked, or what failed.
    pub detail: String,
    /// Unix seconds since which the result is the same.
    pub since: u64,
}

/// What one pass produced.
#[derive(Debug)]
pub struct Pass {
    pub stages: Vec<StageStatus>,
    pub inventory: Option<Inventory>,
    /// The device plugin's resources, for `run` to serve.
    pub plugin: Option<PluginPlan>,
    /// Stages left for [`run_deferred`] (with `serve_first`).
    pub deferred: Vec<Stage>,
    /// The MIG layout's state, when one is selected.
    pub mig: Option<crate::mig::MigStatus>,
}

/// What the device plugin will advertise.
#[derive(Debug, Clone)]
pub struct PluginPlan {
    pub settings: PluginSettings,
    pub resources: Vec<Resource>,
}

impl PluginPlan {
    /// `nvidia.com/gpu: 8 device(s)`, or that there is nothing to advertise.
    pub fn summary(&self) -> String {
        if self.resources.is_empty() {
            return "no devices to advertise".into();
        }
        self.resources
            .iter()
            .map(|r| format!("{}: {} device(s)", r.name, r.devices.len()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl Pass {
    /// True when no stage failed.
    pub fn ok(&self) -> bool {
        !self.stages.iter().any(|s| s.state == StageState::Failed)
    }
}

/// Everything a pass reads.
#[derive(Debug)]
pub struct Context<'a> {
    pub policy: &'a Policy,
    pub caps: &'a HeldCaps,
    /// Where sysfs and /proc are read (the host root, or a simulated tree).
    pub sys: &'a HostRoot,
    pub backend: &'a dyn GpuBackend,
    /// The host whose files the agent changes.
    pub host: &'a HostRoot,
    /// How to run host commands when stages may change the host; `None`:
    /// look only (`status`), change nothing.
    pub apply: Option<&'a dyn CommandRunner>,
    /// The privileged calls stages make on the host.
    pub syscalls: &'a dyn Syscalls,
    /// The node is simulated (`--simulate`, the demo): the driver and
    /// device-node stages plan against the simulated tree and make no
    /// system calls.
    pub simulated: bool,
    /// Stops the device plugin's advertising before a driver upgrade;
    /// `None`: nothing is advertised yet.
    pub drain: Option<&'a dyn crate::driver::Drain>,
    /// `run`'s first pass: the stages the kubelet's registration does not
    /// need ([`AFTER_REGISTRATION`]) are left for [`run_deferred`], so the
    /// kubelet hears from us sooner.
    pub serve_first: bool,
    /// What stages changed on the host during this pass (drained per stage).
    pub changes: ChangeLog,
    /// Why a MIG layout change must not be applied this pass (the
    /// supervisor found its GPUs still in use).
    pub mig_hold: Option<String>,
    /// Driver upgrades under the cluster's rollout (the controller's
    /// go-ahead), and where this pass found the node.
    pub upgrade: crate::driver::UpgradeGate,
    /// What earlier passes of this process said in the log (the running
    /// agent's): a pass then logs at INFO only what changed. `None`: a
    /// one-shot pass (`status`, `run --once`, the demo) says everything.
    pub logged: Option<&'a LogMemory>,
}

/// What the running agent's passes last said in the log, so that a pass
/// that changes nothing says nothing above DEBUG (docs/operations.md): a
/// stage's state is logged when it changes, or when the stage changed the
/// host; its words when they change, except from those of a pass that
/// changed the host to those of one that found it as left ("wrote X" to "X
/// is up to date"); a GPU when it is found or no longer found; a warning of
/// discovery when it is new.
#[derive(Debug, Default)]
pub struct LogMemory(std::sync::Mutex<Said>);

#[derive(Debug, Default)]
struct Said {
    /// Each stage's last state and detail, and whether that pass changed the host.
    stages: std::collections::HashMap<Stage, (StageState, String, bool)>,
    /// The GPUs last found (bus id, then what was said of each); `None`
    /// before the first discovery.
    gpus: Option<std::collections::BTreeMap<String, GpuSaid>>,
    /// Discovery's warnings of the last pass.
    warnings: std::collections::BTreeSet<String>,
    /// Other conditions by name ([`LogMemory::news`]), while they hold.
    conditions: std::collections::HashMap<String, String>,
}

/// What the log says of a GPU found: a UUID NVML gives later, or another
/// model, is news.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuSaid {
    pub id: String,
    pub model: String,
}

impl LogMemory {
    /// Whether `stage` coming to `state` with `detail` is news (and
    /// remembers it); `changed_host`: this pass of the stage changed the host.
    pub fn stage_is_news(
        &self,
        stage: Stage,
        state: StageState,
        detail: &str,
        changed_host: bool,
    ) -> bool {
        let mut said = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let news = match said.stages.get(&stage) {
            None => true,
            Some((was, _, _)) if *was != state => true,
            Some(_) if changed_host => true,
            Some((_, words, _)) if words == detail => false,
            // Its words change: news, unless they went from a change made
            // to finding it made.
            Some((_, _, was_change)) => !was_change,
        };
        said.stages
            .insert(stage, (state, detail.to_string(), changed_host));
        news
    }

    /// The GPUs found now, by bus id: those not found (or said otherwise)
    /// before, and those no longer found.
    pub fn gpus_found(
        &self,
        now: std::collections::BTreeMap<String, GpuSaid>,
    ) -> (Vec<String>, Vec<(String, GpuSaid)>) {
        let mut said = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let before = said.gpus.take().unwrap_or_default();
        let new = now
            .iter()
            .filter(|(bus, what)| before.get(*bus) != Some(what))
            .map(|(bus, _)| bus.clone())
            .collect();
        let gone = before
            .into_iter()
            .filter(|(bus, _)| !now.contains_key(bus))
            .collect();
        said.gpus = Some(now);
        (new, gone)
    }

    /// Whether the condition `key` changed since it was last told: `now` is
    /// what it says now (`None`: it no longer holds). A condition that
    /// holds pass after pass in the same words is said once.
    pub fn news(&self, key: &str, now: Option<&str>) -> bool {
        let mut said = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let before = match now {
            Some(text) => said.conditions.insert(key.to_string(), text.to_string()),
            None => said.conditions.remove(key),
        };
        before.as_deref() != now
    }

    /// Of discovery's warnings now, those the last pass did not have.
    pub fn new_warnings<'w>(&self, now: &'w [String]) -> Vec<&'w String> {
        let mut said = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let new = now.iter().filter(|w| !said.warnings.contains(*w)).collect();
        said.warnings = now.iter().cloned().collect();
        new
    }
}

/// Host changes a stage made, in words (`wrote /var/run/cdi/nvidia.yaml`).
pub type ChangeLog = std::cell::RefCell<Vec<String>>;

impl Context<'_> {
    /// Whether the condition `key` (`None`: it no longer holds) is news to
    /// the running agent ([`LogMemory::news`]); always, without one.
    pub fn news(&self, key: &str, now: Option<&str>) -> bool {
        self.logged.is_none_or(|m| m.news(key, now))
    }

    /// Records a change made to the host.
    pub fn changed(&self, what: impl Into<String>) {
        let what = what.into();
        tracing::info!(changed = %what, "host changed");
        self.changes.borrow_mut().push(what);
    }
}

/// The stages `run`'s first pass leaves until the device plugin has
/// registered ([`Context::serve_first`]): none of them is needed to tell the
/// kubelet what the node has. The first three make what a container needs
/// (device nodes, the runtime's configuration, the CDI spec): the device
/// plugin's `Allocate` waits for them (`plugin::server`); validation and
/// labels gate nothing.
pub const AFTER_REGISTRATION: [Stage; 5] = [
    Stage::Devnodes,
    Stage::Runtime,
    Stage::Cdi,
    Stage::Validate,
    Stage::Labels,
];

/// Of [`AFTER_REGISTRATION`], the stages an allocation needs done first.
pub const BEFORE_ALLOCATION: [Stage; 3] = [Stage::Devnodes, Stage::Runtime, Stage::Cdi];

/// What a deferred stage says until it runs.
pub const DEFERRED_DETAIL: &str = "runs right after the device plugin's first registration";

/// A pass under way: what the stages run so far produced.
#[derive(Default)]
struct Progress {
    stages: Vec<StageStatus>,
    inventory: Option<Inventory>,
    plugin: Option<PluginPlan>,
    /// Why the container runtime will not inject CDI devices, if known.
    runtime_no_cdi: Option<String>,
    mig: Option<crate::mig::MigStatus>,
}

/// Runs the stages in order, once. With `ctx.serve_first`, the stages of
/// [`AFTER_REGISTRATION`] that could run are left for [`run_deferred`]
/// (listed in [`Pass::deferred`], `ready` until then).
pub fn run_pass(ctx: &Context<'_>) -> Pass {
    let mut p = Progress::default();
    let mut deferred = Vec::new();
    for stage in Stage::ALL {
        let defer = ctx.serve_first && AFTER_REGISTRATION.contains(&stage) && p.inventory.is_some();
        let status = run_stage(ctx, stage, &mut p, defer);
        if defer && status.state == StageState::Ready && status.detail == DEFERRED_DETAIL {
            deferred.push(stage);
        }
        p.stages.push(status);
    }
    Pass {
        stages: p.stages,
        inventory: p.inventory,
        plugin: p.plugin,
        deferred,
        mig: p.mig,
    }
}

/// Runs `stage` (or, with `defer`, only says it will run later, once its
/// gate lets it) and returns its status.
fn run_stage(ctx: &Context<'_>, stage: Stage, p: &mut Progress, defer: bool) -> StageStatus {
    let stage_needs = stage.needs_under(ctx.policy, ctx.simulated);
    let needs: Vec<String> = stage_needs.iter().map(|c| c.to_string()).collect();
    let missing = ctx.caps.missing(stage_needs);
    // A driver is loaded (the kernel says so): what works with it need not
    // wait on a driver stage that cannot manage modules or reach a pinned
    // version.
    let driver_loaded = p
        .inventory
        .as_ref()
        .is_some_and(|inv| inv.driver.version.is_some());
    let (state, detail) = if let Some(gated) = gate(
        stage,
        stage.implemented(),
        ctx.policy,
        &missing,
        &p.stages,
        driver_loaded,
    ) {
        let gated = match gated {
            // A capability dropped at start says so (caps.rs).
            (StageState::Blocked, _) => (StageState::Blocked, ctx.caps.blocked_detail(&missing)),
            other => other,
        };
        // A layout that is asked for and cannot be applied yet is pending,
        // pass after pass (the node's mig.config.state label must not go
        // from pending to nothing and back).
        if stage == Stage::Mig
            && matches!(gated.0, StageState::Waiting | StageState::Blocked)
            && let Some(layout) = ctx.policy.mig_manager.selected_layout()
        {
            p.mig = Some(crate::mig::MigStatus {
                layout: layout.to_string(),
                state: crate::mig::MigConfigState::Pending,
                detail: gated.1.clone(),
                since: crate::state::now(),
            });
        }
        gated
    } else if defer {
        (StageState::Ready, DEFERRED_DETAIL.to_string())
    } else {
        let _span = tracing::info_span!("stage", stage = stage.name()).entered();
        let waiting = || (StageState::Waiting, "waiting on discover".to_string());
        match stage {
            Stage::Discover => {
                let (outcome, inv) = discover::discover_stage(ctx);
                p.inventory = inv;
                outcome
            }
            Stage::Plugin => match p.inventory.as_ref() {
                None => waiting(),
                Some(inv) => {
                    let (outcome, plan) =
                        plugin::plugin_stage(ctx, inv, p.runtime_no_cdi.as_deref());
                    p.plugin = plan;
                    outcome
                }
            },
            Stage::Driver => match p.inventory.as_ref() {
                None => waiting(),
                Some(inv) => driver::driver_stage(ctx, inv),
            },
            Stage::Mig => match p.inventory.as_ref() {
                None => waiting(),
                Some(inv) => {
                    let m = mig::mig_stage(ctx, inv);
                    p.mig = m.status;
                    if m.changed {
                        // The later stages describe the new MIG devices.
                        let (_, again) = discover::discover_stage(ctx);
                        if again.is_some() {
                            p.inventory = again;
                        }
                    }
                    m.outcome
                }
            },
            Stage::Devnodes => match p.inventory.as_ref() {
                None => waiting(),
                Some(inv) => devnodes::devnodes_stage(ctx, inv),
            },
            Stage::Runtime => {
                runtime::runtime_stage(ctx, p.inventory.as_ref(), &mut p.runtime_no_cdi)
            }
            Stage::Cdi => match p.inventory.as_ref() {
                None => waiting(),
                Some(inv) => cdi::cdi_stage(ctx, inv),
            },
            Stage::Validate => match p.inventory.as_ref() {
                None => waiting(),
                Some(inv) => validate::validate_stage(ctx, inv, &mut p.stages),
            },
            Stage::Health => match p.inventory.as_ref() {
                None => waiting(),
                Some(inv) => health::health_plan(inv, ctx.policy),
            },
            Stage::Metrics => match p.inventory.as_ref() {
                None => waiting(),
                Some(inv) => metrics::metrics_plan(inv, ctx.policy),
            },
            Stage::Labels => match p.inventory.as_ref() {
                None => waiting(),
                Some(inv) => labels::labels_stage(ctx, inv),
            },
        }
    };
    log_stage(ctx, stage, state, &detail);
    let mut status = StageStatus {
        needs,
        missing,
        changed: ctx.changes.take(),
        ..StageStatus::new(stage, state, detail)
    };
    // Stages after `validate` are checked as soon as they ran.
    if let Some(inv) = p.inventory.as_ref() {
        validate::validate_late(ctx, inv, &mut status);
    }
    status
}

/// Runs the stages a `serve_first` pass left for later (those of `deferred`
/// that `stages` still shows waiting for it), in their order, replacing
/// their entries in `stages`. Each is gated again on what the ones before
/// it came to (the CDI spec waits on device nodes that could not be made).
pub fn run_deferred(
    ctx: &Context<'_>,
    deferred: &[Stage],
    inventory: &Inventory,
    stages: &mut Vec<StageStatus>,
) {
    let mut p = Progress {
        stages: std::mem::take(stages),
        inventory: Some(inventory.clone()),
        ..Progress::default()
    };
    for stage in Stage::ALL.into_iter().filter(|s| deferred.contains(s)) {
        let Some(at) = p.stages.iter().position(|s| s.stage == stage) else {
            continue;
        };
        if !(p.stages[at].state == StageState::Ready && p.stages[at].detail == DEFERRED_DETAIL) {
            continue;
        }
        let status = run_stage(ctx, stage, &mut p, false);
        p.stages[at] = status;
        if stage == Stage::Runtime
            && let Some(why) = p.runtime_no_cdi.as_deref()
            && plugin::hands_out_cdi_names(ctx.policy)
        {
            tracing::warn!(
                stage = "plugin",
                "the device-list strategy hands out CDI names, but {why}: containers get no GPU through them (use envvar, or a runtime with CDI)"
            );
        }
    }
    *stages = p.stages;
}

/// Logs a stage's outcome: at its level when it is news to the running
/// agent ([`LogMemory`]) or there is none, at DEBUG otherwise.
fn log_stage(ctx: &Context<'_>, stage: Stage, state: StageState, detail: &str) {
    let changed_host = !ctx.changes.borrow().is_empty();
    if ctx
        .logged
        .is_some_and(|m| !m.stage_is_news(stage, state, detail, changed_host))
    {
        tracing::debug!(stage = stage.name(), state = state.label(), "{detail}");
        return;
    }
    match state {
        StageState::Failed => tracing::error!(stage = stage.name(), "{detail}"),
        StageState::Blocked | StageState::Waiting => {
            tracing::warn!(stage = stage.name(), state = state.label(), "{detail}")
        }
        _ => tracing::info!(stage = stage.name(), state = state.label(), "{detail}"),
    }
}

/// Why GPUs the node has cannot be used yet: the backend does not describe them.
pub(super) fn undescribed(inv: &Inventory, what: &str) -> String {
    format!(
        "{} GPU(s) on the node, none can be {what} until {} describes them: {}",
        inv.gpus.len(),
        inv.backend.name,
        inv.backend.error.as_deref().unwrap_or("no UUIDs reported")
    )
}

/// Why a stage does not run now, or `None` when it should run. `implemented`
/// is a parameter so that tests can ask about stages not built yet.
/// `driver_loaded`: a driver is loaded, so a failed or blocked driver stage
/// holds back no stage (they work with the loaded driver); with none
/// loaded they wait.
fn gate(
    stage: Stage,
    implemented: bool,
    policy: &Policy,
    missing: &[String],
    earlier: &[StageStatus],
    driver_loaded: bool,
) -> Option<(StageState, String)> {
    if let Some(reason) = stage.disabled_by(policy) {
        return Some((StageState::Disabled, reason.to_string()));
    }
    if !implemented {
        let mut detail = format!("{} (not built yet)", stage.purpose());
        if !missing.is_empty() {
            detail.push_str(&format!("; will need {}, not held", missing.join(", ")));
        }
        return Some((StageState::NotImplemented, detail));
    }
    if !missing.is_empty() {
        return Some((
            StageState::Blocked,
            format!("missing {}", missing.join(", ")),
        ));
    }
    let stuck_on = stage.after().iter().find(|dep| {
        earlier.iter().any(|s| {
            s.stage == **dep
                && match s.state {
                    StageState::Failed | StageState::Blocked => {
                        !(**dep == Stage::Driver && driver_loaded)
                    }
                    StageState::Waiting => true,
                    _ => false,
                }
        })
    })?;
    Some((
        StageState::Waiting,
        format!("waiting on {}", stuck_on.name()),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::sim_node;

    fn pass(policy: &Policy, caps: &HeldCaps) -> Pass {
        let (_dir, sys, backend) = sim_node("h100-sxm-8");
        inspect(&sys, &backend, policy, caps, true)
    }

    /// One pass that only looks (nothing applied) over a node's files;
    /// `simulated: false` treats them as a real host's (capabilities count).
    fn inspect(
        sys: &HostRoot,
        backend: &dyn GpuBackend,
        policy: &Policy,
        caps: &HeldCaps,
        simulated: bool,
    ) -> Pass {
        let recording = hostlib::RecordingSyscalls::new();
        run_pass(&Context {
            simulated,
            ..looking(sys, backend, policy, caps, &recording, None)
        })
    }

    /// A context that only looks (nothing applied) at a simulated node's
    /// files, with the running agent's log memory when `logged` is given.
    fn looking<'a>(
        sys: &'a HostRoot,
        backend: &'a dyn GpuBackend,
        policy: &'a Policy,
        caps: &'a HeldCaps,
        syscalls: &'a hostlib::RecordingSyscalls,
        logged: Option<&'a LogMemory>,
    ) -> Context<'a> {
        Context {
            policy,
            caps,
            sys,
            backend,
            host: sys,
            apply: None,
            syscalls,
            simulated: true,
            drain: None,
            serve_first: false,
            changes: Default::default(),
            mig_hold: None,
            upgrade: Default::default(),
            logged,
        }
    }

    #[test]
    fn serve_first_leaves_what_registration_does_not_need_for_after_it() {
        let policies = [
            Policy::default(),
            Policy::from_yaml(
                "spec:\n  devicePlugin:\n    deviceListStrategy: [envvar, cdi-cri]\n",
                "p",
            )
            .unwrap(),
            Policy::from_yaml("spec:\n  cdi: {enabled: false}\n", "p").unwrap(),
        ];
        let (_dir, sys, backend) = sim_node("h100-sxm-8");
        let caps = HeldCaps::from_caps(&[]);
        let recording = hostlib::RecordingSyscalls::new();
        let ctx = |policy| Context {
            policy,
            caps: &caps,
            sys: &sys,
            backend: &backend,
            host: &sys,
            apply: None,
            syscalls: &recording,
            simulated: true,
            drain: None,
            serve_first: true,
            changes: Default::default(),
            mig_hold: None,
            upgrade: Default::default(),
            logged: None,
        };
        // Also when the plugin hands out CDI names: Allocate waits for the spec.
        for policy in &policies[..2] {
            let mut p = run_pass(&ctx(policy));
            // What registration needs ran: the GPUs, the driver, the plan.
            assert_eq!(state_of(&p, Stage::Discover).state, StageState::Done);
            assert_eq!(state_of(&p, Stage::Driver).state, StageState::Done);
            let plugin = state_of(&p, Stage::Plugin);
            assert_eq!(plugin.state, StageState::Ready);
            assert_eq!(plugin.detail, "nvidia.com/gpu: 8 device(s)");
            assert_eq!(p.plugin.as_ref().unwrap().resources[0].devices.len(), 8);
            // The rest says it runs after, and readiness waits for it.
            assert_eq!(p.deferred, AFTER_REGISTRATION);
            for stage in AFTER_REGISTRATION {
                let st = state_of(&p, stage);
                assert_eq!(
                    (st.state, st.detail.as_str()),
                    (StageState::Ready, DEFERRED_DETAIL),
                    "{stage:?}"
                );
            }
            assert!(!ready(&p.stages));
            let inv = p.inventory.clone().unwrap();
            run_deferred(&ctx(policy), &p.deferred, &inv, &mut p.stages);
            let order: Vec<Stage> = p.stages.iter().map(|s| s.stage).collect();
            assert_eq!(order, Stage::ALL);
            assert!(
                state_of(&p, Stage::Devnodes)
                    .detail
                    .starts_with("simulated node: would make 14 of 14 device node(s)"),
                "{}",
                state_of(&p, Stage::Devnodes).detail
            );
            let cdi = state_of(&p, Stage::Cdi);
            assert!(cdi.detail.starts_with("would write"), "{}", cdi.detail);
            assert_eq!(state_of(&p, Stage::Runtime).state, StageState::Waiting);
            for stage in AFTER_REGISTRATION {
                assert_ne!(state_of(&p, stage).detail, DEFERRED_DETAIL, "{stage:?}");
            }
        }
        // A stage the policy turns off is not deferred: it says so at once.
        let p = run_pass(&ctx(&policies[2]));
        assert!(!p.deferred.contains(&Stage::Cdi));
        assert_eq!(state_of(&p, Stage::Cdi).state, StageState::Disabled);
        // Without serve_first nothing is deferred.
        let p = pass(&Policy::default(), &caps);
        assert!(p.deferred.is_empty());
        assert!(p.stages.iter().all(|s| s.detail != DEFERRED_DETAIL));
    }

    fn state_of(p: &Pass, stage: Stage) -> &StageStatus {
        p.stages.iter().find(|s| s.stage == stage).unwrap()
    }

    #[test]
    fn discover_and_plugin_run_and_nothing_unbuilt_claims_done() {
        let p = pass(&Policy::default(), &HeldCaps::from_caps(&[]));
        assert!(p.ok());
        assert_eq!(p.stages.len(), Stage::ALL.len());
        let d = state_of(&p, Stage::Discover);
        assert_eq!(d.state, StageState::Done);
        assert_eq!(
            d.detail,
            "8 GPU(s): 8x NVIDIA H100 80GB HBM3; driver 550.127.08"
        );
        assert_eq!(p.inventory.as_ref().unwrap().gpus.len(), 8);
        let plugin = state_of(&p, Stage::Plugin);
        assert_eq!(plugin.state, StageState::Ready);
        assert_eq!(plugin.detail, "nvidia.com/gpu: 8 device(s)");
        assert_eq!(p.plugin.as_ref().unwrap().resources[0].devices.len(), 8);
        for s in &p.stages {
            if !s.stage.implemented() {
                assert_eq!(s.state, StageState::NotImplemented, "{:?}", s.stage);
            }
        }
        // A simulated node: the driver is observed, nothing is loaded or made.
        let d = state_of(&p, Stage::Driver);
        assert_eq!(d.state, StageState::Done);
        assert_eq!(
            d.detail,
            "driver 550.127.08 (open) loaded (simulated node: no module touched)"
        );
        let n = state_of(&p, Stage::Devnodes);
        assert_eq!(n.state, StageState::Ready);
        assert!(
            n.detail.starts_with("simulated node: would make 14 of 14 device node(s): /dev/nvidiactl, /dev/nvidia-modeset, /dev/nvidia0,"),
            "{}",
            n.detail
        );
        // On a real node the driver stage needs CAP_SYS_MODULE; the
        // host-driver mode loads nothing and needs none.
        let policy = Policy::default();
        assert_eq!(
            Stage::Driver.needs_under(&policy, false),
            &[Capability::CAP_SYS_MODULE]
        );
        assert!(Stage::Driver.needs_under(&policy, true).is_empty());
        let host_driver = Policy::from_yaml("spec:\n  driver: {enabled: false}\n", "p").unwrap();
        assert!(Stage::Driver.needs_under(&host_driver, false).is_empty());
        assert_eq!(
            Stage::Devnodes.needs_under(&host_driver, false),
            &[Capability::CAP_MKNOD]
        );
    }

    #[test]
    fn policy_turns_stages_off_with_the_reason() {
        let policy = Policy::from_yaml(
            "spec:\n  driver: {enabled: false}\n  toolkit: {enabled: false}\n",
            "p",
        )
        .unwrap();
        let p = pass(&policy, &HeldCaps::from_caps(&[]));
        // The host-driver mode: the driver is recorded, no module touched.
        let d = state_of(&p, Stage::Driver);
        assert_eq!(d.state, StageState::Done);
        assert_eq!(
            d.detail,
            "host driver 550.127.08 (open) loaded; modules not managed (spec.driver.enabled is false)"
        );
        assert_eq!(state_of(&p, Stage::Runtime).state, StageState::Disabled);
    }

    #[test]
    fn missing_capability_blocks_and_later_stages_wait() {
        let policy = Policy::default();
        let missing = vec!["CAP_SYS_MODULE".to_string()];
        let (state, detail) = gate(Stage::Driver, true, &policy, &missing, &[], false).unwrap();
        assert_eq!(state, StageState::Blocked);
        assert_eq!(detail, "missing CAP_SYS_MODULE");
        let earlier = vec![StageStatus {
            needs: missing.clone(),
            missing,
            ..StageStatus::new(Stage::Driver, state, detail)
        }];
        let (state, detail) = gate(Stage::Devnodes, true, &policy, &[], &earlier, false).unwrap();
        assert_eq!(state, StageState::Waiting);
        assert_eq!(detail, "waiting on driver");
        assert_eq!(
            gate(Stage::Runtime, true, &policy, &[], &earlier, false),
            None
        );
        // With a driver loaded, a blocked (or failed) driver stage holds
        // nothing back: devnodes, CDI and MIG work with the loaded driver.
        assert_eq!(
            gate(Stage::Devnodes, true, &policy, &[], &earlier, true),
            None
        );
        assert_eq!(gate(Stage::Mig, true, &policy, &[], &earlier, true), None);
    }

    /// A layout asked for whose stage cannot run (here: CAP_SYS_ADMIN not
    /// held on a real node) is `pending`, the same at every pass: the
    /// node's mig.config.state label went pending, then nothing, then
    /// pending again, twice a minute.
    #[test]
    fn a_layout_that_cannot_be_applied_yet_stays_pending() {
        let (_dir, sys, backend) = sim_node("h100-mig-2");
        let policy =
            Policy::from_yaml("spec:\n  migManager:\n    default: all-1g.10gb\n", "p").unwrap();
        let caps = HeldCaps::from_caps(&[]);
        for _ in 0..2 {
            let p = inspect(&sys, &backend, &policy, &caps, false);
            assert_eq!(state_of(&p, Stage::Mig).state, StageState::Blocked);
            let m = p.mig.expect("a pending MIG state");
            assert_eq!(m.layout, "all-1g.10gb");
            assert_eq!(m.state, crate::mig::MigConfigState::Pending);
            assert!(m.detail.contains("CAP_SYS_ADMIN"), "{}", m.detail);
        }
    }

    /// A pinned driver version the node cannot reach (no bundle brings it)
    /// fails the driver stage in words, and holds back none of the stages
    /// that work with the loaded driver (they waited on it, for good).
    #[test]
    fn a_pinned_version_the_node_cannot_reach_holds_nothing_back() {
        let (_dir, sys, backend) = sim_node("h100-sxm-8");
        let policy = Policy::from_yaml(
            "spec:\n  driver:\n    version: 595.91.07\n  migManager:\n    default: all-disabled\n",
            "p",
        )
        .unwrap();
        let caps = HeldCaps::from_caps(&[
            Capability::CAP_SYS_MODULE,
            Capability::CAP_MKNOD,
            Capability::CAP_SYS_ADMIN,
        ]);
        let p = inspect(&sys, &backend, &policy, &caps, false);
        let d = state_of(&p, Stage::Driver);
        assert_eq!(d.state, StageState::Failed, "{}", d.detail);
        assert!(
            d.detail
                .contains("driver 550.127.08 is loaded, spec.driver.version asks for 595.91.07"),
            "{}",
            d.detail
        );
        for s in [Stage::Mig, Stage::Devnodes, Stage::Cdi] {
            let st = state_of(&p, s);
            assert!(
                !st.detail.starts_with("waiting on"),
                "{}: {:?} {}",
                s.name(),
                st.state,
                st.detail
            );
        }
    }

    #[test]
    fn every_stage_after_only_names_earlier_stages() {
        for (i, s) in Stage::ALL.iter().enumerate() {
            for dep in s.after() {
                let j = Stage::ALL.iter().position(|x| x == dep).unwrap();
                assert!(j < i, "{} waits on later stage {}", s.name(), dep.name());
            }
        }
    }

    /// What `f` logs at DEBUG and above, a line an event, the level first.
    fn logs_of(f: impl FnOnce()) -> Vec<String> {
        use std::sync::{Arc, Mutex};
        #[derive(Clone, Default)]
        struct Buf(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let writer = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .without_time()
            .with_ansi(false)
            .with_target(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        text.lines().map(|l| l.trim_start().to_string()).collect()
    }

    /// The lines the default level (INFO) shows.
    fn shown(lines: &[String]) -> Vec<&String> {
        lines.iter().filter(|l| !l.starts_with("DEBUG")).collect()
    }

    #[test]
    fn a_pass_that_changes_nothing_logs_nothing_above_debug() {
        let (_dir, sys, backend) = sim_node("h100-sxm-8");
        // No containerd: the runtime stage waits, a WARN said once.
        let caps = HeldCaps::from_caps(&[]);
        let policy = Policy::default();
        let recording = hostlib::RecordingSyscalls::new();
        let memory = LogMemory::default();
        let ctx = || looking(&sys, &backend, &policy, &caps, &recording, Some(&memory));
        let first = logs_of(|| {
            run_pass(&ctx());
        });
        let found = first.iter().filter(|l| l.contains("found GPU")).count();
        assert_eq!(found, 8, "{first:#?}");
        assert!(
            first
                .iter()
                .any(|l| l.starts_with("WARN") && l.contains("state=\"waiting\"")),
            "{first:#?}"
        );
        for _ in 0..3 {
            let again = logs_of(|| {
                run_pass(&ctx());
            });
            assert!(shown(&again).is_empty(), "{:#?}", shown(&again));
            // Each stage's state is still there, at DEBUG.
            let states = again.iter().filter(|l| l.contains(" state=")).count();
            assert_eq!(states, Stage::ALL.len(), "{again:#?}");
        }
        // Without the running agent's memory (`status`, `run --once`),
        // a pass says everything.
        let once = logs_of(|| {
            run_pass(&Context {
                logged: None,
                ..ctx()
            });
        });
        assert_eq!(
            once.iter().filter(|l| l.contains("found GPU")).count(),
            8,
            "{once:#?}"
        );
        assert!(shown(&once).len() >= Stage::ALL.len(), "{once:#?}");
    }

    /// The labels' warnings (two GPU models here) are said once while they
    /// hold, not at every reconcile; `gpu-agent labels` and a pass without
    /// the agent's memory say them each time.
    #[test]
    fn a_lasting_label_warning_is_said_once() {
        let (_dir, sys, backend) = sim_node("a100-h100-mixed");
        let caps = HeldCaps::from_caps(&[]);
        let policy = Policy::default();
        let recording = hostlib::RecordingSyscalls::new();
        let memory = LogMemory::default();
        let ctx = |logged| looking(&sys, &backend, &policy, &caps, &recording, logged);
        let models = |lines: &[String]| {
            lines
                .iter()
                .filter(|l| l.starts_with("WARN") && l.contains("multiple GPU models"))
                .count()
        };
        let first = logs_of(|| {
            run_pass(&ctx(Some(&memory)));
        });
        assert_eq!(models(&first), 1, "{first:#?}");
        for _ in 0..3 {
            let again = logs_of(|| {
                run_pass(&ctx(Some(&memory)));
            });
            assert_eq!(models(&again), 0, "{again:#?}");
            assert!(shown(&again).is_empty(), "{:#?}", shown(&again));
        }
        let once = logs_of(|| {
            run_pass(&ctx(None));
        });
        assert!(models(&once) >= 1, "{once:#?}");
    }

    /// A device node the driver leaves to the administrator is warned
    /// once while it stays so, again when it changes or comes back.
    #[test]
    fn a_node_left_to_the_administrator_is_said_once() {
        use kmod::devnodes::Outcome;
        let (_dir, sys, backend) = sim_node("h100-sxm-8");
        let caps = HeldCaps::from_caps(&[]);
        let policy = Policy::default();
        let recording = hostlib::RecordingSyscalls::new();
        let memory = LogMemory::default();
        let ctx = Context {
            simulated: false,
            ..looking(&sys, &backend, &policy, &caps, &recording, Some(&memory))
        };
        let left = |is: &str| {
            vec![
                Outcome::LeftToAdmin {
                    path: "/dev/nvidia0".into(),
                    is: is.into(),
                },
                Outcome::Unchanged("/dev/nvidiactl".into()),
            ]
        };
        let warned = |out: Vec<Outcome>| {
            logs_of(|| devnodes::tell_left_to_admin(&ctx, &out))
                .iter()
                .filter(|l| l.starts_with("WARN") && l.contains("left to the administrator"))
                .count()
        };
        assert_eq!(warned(left("missing")), 1);
        assert_eq!(warned(left("missing")), 0);
        assert_eq!(warned(left("missing")), 0);
        assert_eq!(warned(left("a regular file")), 1, "it changed");
        assert_eq!(
            warned(vec![Outcome::Unchanged("/dev/nvidia0".into())]),
            0,
            "made right by the administrator"
        );
        assert_eq!(warned(left("missing")), 1, "it came back");
    }

    #[test]
    fn a_stage_is_news_when_its_state_or_words_change() {
        use StageState::*;
        let m = LogMemory::default();
        let s = Stage::Cdi;
        assert!(m.stage_is_news(s, Done, "wrote spec.json: 8 GPU(s)", true));
        // From the words of a change to those of finding it made: not news.
        assert!(!m.stage_is_news(s, Done, "spec.json is up to date: 8 GPU(s)", false));
        assert!(!m.stage_is_news(s, Done, "spec.json is up to date: 8 GPU(s)", false));
        // Other words without a change: news.
        assert!(m.stage_is_news(s, Done, "spec.json is up to date: 7 GPU(s)", false));
        // A change made, in the same words: news.
        assert!(m.stage_is_news(s, Done, "spec.json is up to date: 7 GPU(s)", true));
        // Another state: news; the same failure again: not; in other words: news.
        assert!(m.stage_is_news(s, Failed, "no space left", false));
        assert!(!m.stage_is_news(s, Failed, "no space left", false));
        assert!(m.stage_is_news(s, Failed, "read-only file system", false));
        // Each stage has its own memory.
        assert!(m.stage_is_news(Stage::Labels, Failed, "no space left", false));
    }

    #[test]
    fn a_condition_is_news_when_it_begins_changes_or_ends() {
        let m = LogMemory::default();
        assert!(!m.news("k", None), "nothing held, nothing holds");
        assert!(m.news("k", Some("a")));
        assert!(!m.news("k", Some("a")));
        assert!(m.news("k", Some("b")));
        assert!(m.news("k", None));
        assert!(!m.news("k", None));
        assert!(m.news("k", Some("b")), "again after it was over");
        assert!(m.news("other", Some("b")));
    }

    #[test]
    fn gpus_are_news_when_found_said_otherwise_or_gone() {
        let m = LogMemory::default();
        let said = |id: &str| GpuSaid {
            id: id.into(),
            model: "H100".into(),
        };
        let node = |gpus: &[(&str, &str)]| -> std::collections::BTreeMap<String, GpuSaid> {
            gpus.iter()
                .map(|(bus, id)| (bus.to_string(), said(id)))
                .collect()
        };
        let (new, gone) = m.gpus_found(node(&[
            ("0000:18:00.0", "GPU-a"),
            ("0000:2a:00.0", "GPU-b"),
        ]));
        assert_eq!((new.len(), gone.len()), (2, 0));
        let (new, gone) = m.gpus_found(node(&[
            ("0000:18:00.0", "GPU-a"),
            ("0000:2a:00.0", "GPU-b"),
        ]));
        assert!(new.is_empty() && gone.is_empty());
        // NVML gives a UUID where there was only the bus id; one GPU gone.
        let (new, gone) = m.gpus_found(node(&[("0000:18:00.0", "GPU-c")]));
        assert_eq!(new, ["0000:18:00.0"]);
        assert_eq!(gone, [("0000:2a:00.0".to_string(), said("GPU-b"))]);
    }
}
