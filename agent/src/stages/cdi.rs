//! The `cdi` stage: the CDI spec (`nvidia.com/gpu`) for every GPU, MIG
//! device and `all`, written when it differs from what is on the host.

use super::context::{Context, undescribed};
use super::status::StageState;
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

/// Validation: is what this stage set up still there and right?
pub(super) fn validate(ctx: &Context<'_>, inv: &Inventory) -> Result<String, String> {
    if inv.gpus.is_empty() && !inv.driver.is_loaded() {
        return Ok("no GPU and no driver: no spec".into());
    }
    let path = crate::cdi::spec_path(&ctx.policy.cdi.spec_dir);
    let text = ctx
        .host
        .read_to_string(&path)
        .map_err(|e| format!("cannot read the spec: {e}"))?;
    let spec: crate::cdi::Spec =
        serde_json::from_str(&text).map_err(|e| format!("{path} does not parse: {e}"))?;
    let mut named: Vec<&str> = Vec::new();
    let mut hooks: Vec<&str> = Vec::new();
    for edits in std::iter::once(&spec.container_edits)
        .chain(spec.devices.iter().map(|d| &d.container_edits))
    {
        named.extend(edits.device_nodes.iter().map(|n| n.path.as_str()));
        named.extend(edits.mounts.iter().map(|m| m.host_path.as_str()));
        hooks.extend(edits.hooks.iter().map(|h| h.path.as_str()));
    }
    named.sort_unstable();
    named.dedup();
    hooks.sort_unstable();
    hooks.dedup();
    // Driver files are where the stage found them (the host, or the
    // simulated tree); the hook program is on the host.
    let missing: Vec<&str> = named
        .iter()
        .copied()
        .filter(|p| !ctx.sys.exists(p) && !ctx.host.exists(p))
        .chain(hooks.iter().copied().filter(|p| !ctx.host.exists(p)))
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "{path} names what is not there: {}",
            missing.join(", ")
        ));
    }
    Ok(format!(
        "{path} parses; its {} device(s), {} node(s)/file(s) and {} hook program(s) exist",
        spec.devices.len(),
        named.len(),
        hooks.len()
    ))
}
