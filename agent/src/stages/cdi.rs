//! The `cdi` stage: the CDI spec (`nvidia.com/gpu`) for every GPU, MIG
//! device and `all`, written when it differs from what is on the host.

use super::{Context, StageState, undescribed};
use crate::inventory::Inventory;

/// Generates the CDI spec from the inventory (driver files looked up where
/// sysfs is read: the host, or the simulated tree); with `ctx.apply`,
/// writes it when it changed.
pub(super) fn cdi_stage(ctx: &Context<'_>, inv: &Inventory) -> (StageState, String) {
    let cdi = &ctx.policy.cdi;
    let opts = crate::cdi::Options {
        hook_path: cdi.hook_path.clone(),
    };
    let generated = match crate::cdi::generate(inv, ctx.sys, &opts) {
        Ok(g) => g,
        Err(crate::cdi::CdiError::NoDriver) if inv.gpus.is_empty() => {
            return (
                StageState::Done,
                "no GPUs and no driver: no CDI spec to write".into(),
            );
        }
        Err(e) => return (StageState::Failed, e.to_string()),
    };
    let path = crate::cdi::spec_path(&cdi.spec_dir);
    let summary = generated.summary();
    // Written even then (containers can ask by UUID), but not done until
    // NVML names the GPUs the way the device plugin hands them out.
    let undescribed_gpus = inv
        .gpus
        .iter()
        .any(|g| g.index.is_none() || g.uuid.is_none());
    let done = |detail: String| {
        if undescribed_gpus {
            (
                StageState::Waiting,
                format!("{}; {detail}", undescribed(inv, "named by index")),
            )
        } else {
            (StageState::Done, detail)
        }
    };
    if ctx.apply.is_none() {
        return match crate::cdi::up_to_date(ctx.host, &cdi.spec_dir, &generated) {
            Ok(true) => done(format!("{path} is up to date: {summary}")),
            Ok(false) if undescribed_gpus => done(format!("would write {path}: {summary}")),
            Ok(false) => (StageState::Ready, format!("would write {path}: {summary}")),
            Err(e) => (StageState::Failed, e.to_string()),
        };
    }
    match crate::cdi::apply(ctx.host, ctx.syscalls, &generated, cdi, true) {
        Ok(changed) if changed.is_empty() => done(format!("{path} is up to date: {summary}")),
        Ok(changed) => {
            ctx.changed(format!("wrote {}", changed.join(", ")));
            done(format!("wrote {}: {summary}", changed.join(", ")))
        }
        Err(e) => (StageState::Failed, e.to_string()),
    }
}
