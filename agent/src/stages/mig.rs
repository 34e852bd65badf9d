//! The `mig` stage: the selected mig-parted layout, applied through NVML
//! before the device nodes, CDI spec and device plugin are worked out, so
//! that they describe the new MIG devices. A layout already in place
//! changes nothing; a failed one is rolled back (crate::mig).

use std::time::Duration;

use super::context::Context;
use super::status::StageState;
use crate::inventory::Inventory;
use crate::mig::{self, Applied, ApplyEnv, MigConfigState, MigStatus};

/// What the stage did: its outcome, the MIG state to record (none when no
/// layout is selected or when only looking), and whether the layout changed.
pub(super) struct MigOutcome {
    pub outcome: (StageState, String),
    pub status: Option<MigStatus>,
    pub changed: bool,
}

fn status(layout: &str, state: MigConfigState, detail: &str) -> Option<MigStatus> {
    Some(MigStatus {
        layout: layout.to_string(),
        state,
        detail: detail.to_string(),
        since: gpu_model::util::now(),
    })
}

pub(super) fn mig_stage(ctx: &Context<'_>, inv: &Inventory) -> MigOutcome {
    let done = |state, detail: String, st| MigOutcome {
        outcome: (state, detail),
        status: st,
        changed: false,
    };
    let (config, origin, layout) = match mig::selected(&ctx.policy.mig_manager) {
        Err(e) => return done(StageState::Failed, e.to_string(), None),
        Ok(None) => {
            return done(
                StageState::Done,
                "no layout selected (spec.migManager.default); MIG is left as it is".into(),
                None,
            );
        }
        Ok(Some(s)) => s,
    };
    let failed = |detail: String| MigOutcome {
        status: status(&layout, MigConfigState::Failed, &detail),
        outcome: (StageState::Failed, detail),
        changed: false,
    };
    let Some(control) = ctx.backend.mig_control() else {
        return failed(format!(
            "layout {layout:?} is selected, but MIG is changed through NVML and the {} backend has none",
            ctx.backend.name()
        ));
    };
    let plan = match mig::plan(control, inv, &config, &origin, &layout) {
        Ok(p) => p,
        Err(e) => return failed(e.to_string()),
    };
    if plan.is_noop() {
        let detail = plan.summary();
        return MigOutcome {
            status: status(&layout, MigConfigState::Success, &detail),
            outcome: (StageState::Done, detail),
            changed: false,
        };
    }
    let Some(runner) = ctx.apply else {
        return done(
            StageState::Ready,
            format!("layout {layout:?} would change {}", plan.summary()),
            None,
        );
    };
    if let Some(why) = &ctx.mig_hold {
        return failed(format!("layout {layout:?} not applied: {why}"));
    }
    let timeout = Duration::from_secs(ctx.policy.mig_manager.gpu_clients_timeout_seconds);
    if let Err(why) = mig::wait_for_holders(control, ctx.host, &plan, timeout) {
        return failed(format!("layout {layout:?} not applied: {why}"));
    }
    let env = ApplyEnv {
        host: ctx.host,
        runner,
        reboot: ctx.policy.mig_manager.reboot,
    };
    tracing::info!(layout = %layout, plan = %plan.summary(), "applying the MIG layout");
    match mig::apply(control, &env, &plan) {
        Ok(Applied::Done(what)) => {
            let what = mig::grouped(&what);
            let detail = format!("layout {layout:?} applied: {what}");
            ctx.changed(format!("MIG layout {layout:?}: {what}"));
            MigOutcome {
                status: status(&layout, MigConfigState::Success, &detail),
                outcome: (StageState::Done, detail),
                changed: true,
            }
        }
        Ok(Applied::Rebooting(why)) => MigOutcome {
            status: status(&layout, MigConfigState::Rebooting, &why),
            outcome: (StageState::Ready, why),
            changed: false,
        },
        Err(e) => failed(format!("layout {layout:?}{}{e}", mig::APPLY_FAILED)),
    }
}
