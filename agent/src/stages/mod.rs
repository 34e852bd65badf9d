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
mod stage;
mod validate;

pub use health::apply_health_status;
pub use plugin::apply_plugin_status;
pub use stage::Stage;
pub use validate::{driver_ready_text, host_ready, plugin_validation, ready, revalidate};

use hostlib::HostRoot;
use serde::{Deserialize, Serialize};

use crate::backend::GpuBackend;
use crate::caps::HeldCaps;
use crate::inventory::Inventory;
use crate::plugin::resources::{PluginSettings, Resource};
use crate::policy::Policy;
use hostlib::Syscalls;
use hostlib::command::CommandRunner;

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
                since: gpu_model::util::now(),
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
mod tests;
