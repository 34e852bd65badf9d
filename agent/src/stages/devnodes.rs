//! The `devnodes` stage: `/dev/nvidia*`, `/dev/nvidia-caps/*` and the
//! `/dev/char` links, made when missing or wrong.

use super::context::Context;
use super::status::StageState;
use crate::inventory::Inventory;

/// `/dev/nvidia*` and `/dev/char` links for the loaded driver (also in the
/// host-driver mode).
pub(super) fn devnodes_stage(ctx: &Context<'_>, inv: &Inventory) -> (StageState, String) {
    use crate::driver;
    // Read the driver again: the driver stage may have just loaded it.
    let nodes = match driver::plan_nodes(ctx.sys, Some(inv)) {
        Ok(n) => n,
        Err(e) => return (StageState::Failed, e.to_string()),
    };
    if nodes.is_empty() {
        return if inv.gpus.is_empty() {
            (
                StageState::Done,
                "no NVIDIA driver loaded: no device node to make".into(),
            )
        } else {
            (
                StageState::Waiting,
                "the nvidia module is not loaded".into(),
            )
        };
    }
    let wrong: Vec<&str> = nodes
        .iter()
        .filter(|n| !kmod::devnodes::is_right(ctx.host, n))
        .map(|n| n.path.as_str())
        .collect();
    if ctx.simulated && ctx.apply.is_some() && !wrong.is_empty() {
        // A running agent on a simulated node: there is no device behind
        // the nodes, so none is made, and the stage is as done as it gets
        // (as the driver stage touches no module).
        return (
            StageState::Done,
            format!(
                "simulated node: {} device node(s) not made (no real GPU behind them): {}",
                wrong.len(),
                wrong.join(", ")
            ),
        );
    }
    if ctx.simulated || ctx.apply.is_none() {
        let why = if ctx.simulated {
            "simulated node: "
        } else {
            ""
        };
        return if wrong.is_empty() {
            (
                StageState::Done,
                format!("{} device node(s) right", nodes.len()),
            )
        } else {
            (
                StageState::Ready,
                format!(
                    "{why}would make {} of {} device node(s): {}",
                    wrong.len(),
                    nodes.len(),
                    wrong.join(", ")
                ),
            )
        };
    }
    match kmod::devnodes::ensure(ctx.host, ctx.syscalls, &nodes) {
        Ok(out) => {
            for o in &out {
                match o {
                    kmod::devnodes::Outcome::Created(p) => ctx.changed(format!("created {p}")),
                    kmod::devnodes::Outcome::Replaced { path, was } => {
                        ctx.changed(format!("replaced {path} (was {was})"))
                    }
                    _ => {}
                }
            }
            tell_left_to_admin(ctx, &out);
            (StageState::Done, driver::nodes_summary(&out))
        }
        Err(e) => (StageState::Failed, e.to_string()),
    }
}

/// Validation: is what this stage set up still there and right?
pub(super) fn validate(ctx: &Context<'_>, inv: &Inventory) -> Result<String, String> {
    if ctx.simulated {
        return Ok("simulated node: no device node to check".into());
    }
    let nodes = crate::driver::plan_nodes(ctx.sys, Some(inv)).map_err(|e| e.to_string())?;
    let wrong: Vec<&str> = nodes
        .iter()
        .filter(|n| !kmod::devnodes::is_right(ctx.host, n))
        .map(|n| n.path.as_str())
        .collect();
    if wrong.is_empty() {
        Ok(format!(
            "{} device node(s) present with the right numbers and mode",
            nodes.len()
        ))
    } else {
        Err(format!("missing or wrong: {}", wrong.join(", ")))
    }
}

/// Device nodes the driver says not to make or change and that are not as
/// it would make them: WARN once per node while that holds (said again
/// when it changes or comes back).
pub(super) fn tell_left_to_admin(ctx: &Context<'_>, out: &[kmod::devnodes::Outcome]) {
    let mut left = std::collections::BTreeSet::new();
    for o in out {
        if let kmod::devnodes::Outcome::LeftToAdmin { path, is } = o {
            left.insert(path.as_str());
            if ctx.news(&format!("devnodes:left:{path}"), Some(is)) {
                tracing::warn!(stage = "devnodes", node = %path, is = %is, "left to the administrator (the driver's ModifyDeviceFiles/DeviceFileModify is 0); not made or changed");
            }
        }
    }
    for o in out {
        let path = match o {
            kmod::devnodes::Outcome::Created(p) | kmod::devnodes::Outcome::Unchanged(p) => p,
            kmod::devnodes::Outcome::Replaced { path, .. } => path,
            kmod::devnodes::Outcome::LeftToAdmin { .. } => continue,
        };
        if !left.contains(path.as_str()) {
            ctx.news(&format!("devnodes:left:{path}"), None);
        }
    }
}
