//! The `health` stage: what the health monitor watches, and its live
//! verdict for `status`.

use super::context::undescribed;
use super::stage::Stage;
use super::status::{StageState, StageStatus};
use crate::health::GpuHealth;
use crate::inventory::Inventory;
use crate::policy::Policy;

/// What the health stage will watch.
pub(super) fn health_plan(inv: &Inventory, policy: &Policy) -> (StageState, String) {
    let watched = inv
        .gpus
        .iter()
        .filter(|g| g.uuid.is_some() && g.index.is_some())
        .count();
    if watched == 0 && !inv.gpus.is_empty() {
        return (StageState::Waiting, undescribed(inv, "watched"));
    }
    if watched == 0 {
        return (StageState::Done, "no GPU to watch".to_string());
    }
    let h = &policy.health;
    let ignored: Vec<String> = h.ignored_xids.iter().map(u64::to_string).collect();
    let ignored = if ignored.is_empty() {
        "none".to_string()
    } else {
        ignored.join(", ")
    };
    let recovery = if h.recover_after_seconds == 0 {
        "never recovering without a restart".to_string()
    } else {
        format!(
            "healthy again after {} s without one",
            h.recover_after_seconds
        )
    };
    let kmsg = if h.kernel_log {
        " and the kernel log"
    } else {
        ""
    };
    (
        StageState::Ready,
        format!(
            "watch {watched} GPU(s) for XIDs (NVML{kmsg}) and double-bit ECC events (XIDs {ignored} only logged; {recovery})"
        ),
    )
}

/// Sets the health stage from the live health of every GPU.
pub fn apply_health_status(stages: &mut [StageStatus], board: &[GpuHealth]) {
    let Some(st) = stages.iter_mut().find(|s| s.stage == Stage::Health) else {
        return;
    };
    let sick: Vec<String> = board
        .iter()
        .filter(|g| !g.healthy)
        .map(|g| {
            format!(
                "{} ({})",
                g.uuid,
                g.reason.as_deref().unwrap_or("unhealthy")
            )
        })
        .collect();
    st.state = StageState::Done;
    st.detail = if sick.is_empty() {
        format!("watching {} GPU(s): all healthy", board.len())
    } else {
        format!(
            "watching {} GPU(s): {} unhealthy: {}",
            board.len(),
            sick.len(),
            sick.join(", ")
        )
    };
}
