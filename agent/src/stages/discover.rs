//! The `discover` stage: the node's GPUs, driver and NVML view.

use crate::inventory::Inventory;

pub(super) fn discover_detail(inv: &Inventory) -> String {
    if inv.gpus.is_empty() {
        return "no NVIDIA GPU on this node".into();
    }
    let mut s = format!("{} GPU(s): {}", inv.gpus.len(), inv.models_summary());
    match (&inv.driver.version, &inv.backend.error) {
        (Some(v), None) => s.push_str(&format!("; driver {v}")),
        (None, None) => {}
        (_, Some(e)) => s.push_str(&format!("; {} unavailable: {e}", inv.backend.name)),
    }
    if !inv.warnings.is_empty() {
        s.push_str(&format!("; {} warning(s)", inv.warnings.len()));
    }
    s
}

/// Discovers the node (sysfs, /proc, the GPU backend): the inventory every
/// later stage and front end reads.
pub(super) fn discover_stage(
    ctx: &super::Context<'_>,
) -> ((super::StageState, String), Option<Inventory>) {
    match crate::inventory::discover(ctx.sys, ctx.backend) {
        Ok(inv) => {
            let detail = discover_detail(&inv);
            for w in &inv.warnings {
                tracing::warn!(stage = "discover", "{w}");
            }
            for g in &inv.gpus {
                tracing::info!(stage = "discover", gpu_uuid = %g.id(), bus_id = %g.bus_id, model = g.model.as_deref().unwrap_or("unknown"), "found GPU");
            }
            ((super::StageState::Done, detail), Some(inv))
        }
        Err(e) => ((super::StageState::Failed, e.to_string()), None),
    }
}
