//! One pass: the stages in order, each gated on the policy, the capabilities
//! held and the stages before it. The top of the stages: it calls each
//! stage's file, none of which calls it.

use super::context::Context;
use super::stage::Stage;
use super::status::{Pass, PluginPlan, StageState, StageStatus};
use super::{
    cdi, devnodes, discover, driver, health, labels, metrics, mig, plugin, runtime, validate,
};
use crate::inventory::Inventory;
use crate::policy::Policy;

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
                    // The GPUs `spec.dra.gpus` gives DRA are not the plugin's.
                    let (dra, _) = gpu_dra::spec::dra_gpus(&ctx.policy.dra, inv);
                    let mine = gpu_dra::spec::split(inv, &dra, false);
                    let ((state, mut detail), plan) =
                        plugin::plugin_stage(ctx, &mine, p.runtime_no_cdi.as_deref());
                    if !dra.is_empty() {
                        detail.push_str(&format!(
                            " ({} GPU(s) left to DRA by spec.dra.gpus)",
                            dra.len()
                        ));
                    }
                    p.plugin = plan;
                    (state, detail)
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

/// Why a stage does not run now, or `None` when it should run. `implemented`
/// is a parameter so that tests can ask about stages not built yet.
/// `driver_loaded`: a driver is loaded, so a failed or blocked driver stage
/// holds back no stage (they work with the loaded driver); with none
/// loaded they wait.
pub(super) fn gate(
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
