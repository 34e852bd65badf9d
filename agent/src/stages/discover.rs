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
