//! The `discover` stage: the node's GPUs, driver and NVML view.

use crate::inventory::Inventory;

pub(super) fn discover_detail(inv: &Inventory) -> String {
    if inv.gpus.is_empty() {
        let mut s = String::from("no NVIDIA GPU on this node");
        if inv.driver.module_list == hostlib::driver::ModuleList::NoModuleSupport {
            s.push_str(" (kernel without loadable-module support)");
        }
        if !inv.unreadable.is_empty() {
            s.push_str(&format!(
                "; {} host file(s) unreadable",
                inv.unreadable.len()
            ));
        }
        return s;
    }
    let mut s = format!("{} GPU(s): {}", inv.gpus.len(), inv.models_summary());
    match (&inv.driver.version, &inv.backend.error) {
        (Some(v), None) => s.push_str(&format!("; driver {v}")),
        (None, None) => {}
        (_, Some(e)) => s.push_str(&format!("; {} unavailable: {e}", inv.backend.name)),
    }
    if let Some(u) = inv.unreadable.first() {
        s.push_str(&format!("; cannot read {u}"));
        if inv.unreadable.len() > 1 {
            s.push_str(&format!(" (and {} more)", inv.unreadable.len() - 1));
        }
    }
    if !inv.warnings.is_empty() {
        s.push_str(&format!("; {} warning(s)", inv.warnings.len()));
    }
    s
}

/// Discovers the node (sysfs, /proc, the GPU backend): the inventory every
/// later stage and front end reads. Always done: a host file that cannot be
/// read is a warning naming it, and the stages that need what it holds say
/// so themselves.
pub(super) fn discover_stage(
    ctx: &super::context::Context<'_>,
) -> ((super::status::StageState, String), Option<Inventory>) {
    let inv = crate::inventory::discover(ctx.sys, ctx.backend);
    let detail = discover_detail(&inv);
    log_discovery(ctx.logged, &inv);
    ((super::status::StageState::Done, detail), Some(inv))
}

/// Logs discovery's warnings and the GPUs found: with the running agent's
/// memory only what is new since its last pass (and the GPUs no longer
/// found), without it everything.
fn log_discovery(logged: Option<&super::context::LogMemory>, inv: &Inventory) {
    let warnings: Vec<&String> = match logged {
        Some(m) => m.new_warnings(&inv.warnings),
        None => inv.warnings.iter().collect(),
    };
    for w in warnings {
        tracing::warn!(stage = "discover", "{w}");
    }
    let now: std::collections::BTreeMap<String, super::context::GpuSaid> = inv
        .gpus
        .iter()
        .map(|g| {
            let said = super::context::GpuSaid {
                id: g.id(),
                model: g.model.clone().unwrap_or_else(|| "unknown".into()),
            };
            (g.bus_id.to_string(), said)
        })
        .collect();
    let (new, gone) = match logged {
        Some(m) => m.gpus_found(now),
        None => (now.into_keys().collect(), Vec::new()),
    };
    for g in inv
        .gpus
        .iter()
        .filter(|g| new.contains(&g.bus_id.to_string()))
    {
        tracing::info!(stage = "discover", gpu_uuid = %g.id(), bus_id = %g.bus_id, model = g.model.as_deref().unwrap_or("unknown"), "found GPU");
    }
    for (bus_id, was) in gone {
        tracing::warn!(stage = "discover", gpu_uuid = %was.id, %bus_id, model = %was.model, "GPU no longer found");
    }
}
