//! The `plugin` stage: the resources the device plugin advertises, and
//! the running plugins' registration for `status`.

use super::stage::Stage;
use super::status::{StageState, StageStatus};
use crate::plugin::manager::ResourceStatus;
use crate::policy::Policy;

/// Whether the device plugin hands out CDI names, which the container
/// runtime must then resolve (an unreadable device-plugin config counts as
/// yes: the plugin stage reports it).
pub(super) fn hands_out_cdi_names(policy: &Policy) -> bool {
    policy.device_plugin.enabled
        && crate::plugin::settings(&policy.device_plugin, policy.mig.strategy)
            .map_or(true, |s| s.hands_out_cdi_names())
}

/// Sets the plugin stage from the running plugins' status: `done` when every
/// resource is registered, `waiting` (with the kubelet's answer) otherwise.
pub fn apply_plugin_status(stages: &mut [StageStatus], board: &[ResourceStatus]) {
    let Some(st) = stages.iter_mut().find(|s| s.stage == Stage::Plugin) else {
        return;
    };
    if board.is_empty() {
        st.state = StageState::Done;
        st.detail = "no devices to advertise; nothing registered".into();
        return;
    }
    let parts: Vec<String> = board
        .iter()
        .map(|r| match (&r.registered, &r.last_error) {
            (true, _) => format!("{}: {} device(s), registered", r.resource, r.devices),
            (false, Some(e)) => format!("{}: not registered ({e}); retrying", r.resource),
            (false, None) => format!("{}: registering", r.resource),
        })
        .collect();
    st.state = if board.iter().all(|r| r.registered) {
        StageState::Done
    } else {
        StageState::Waiting
    };
    st.detail = parts.join("; ");
}

/// What the device plugin will advertise (`ready`: a running agent serves
/// it); `no_cdi`: why the runtime will not inject CDI devices, if it will not.
pub(super) fn plugin_stage(
    ctx: &super::context::Context<'_>,
    inv: &crate::inventory::Inventory,
    no_cdi: Option<&str>,
) -> ((StageState, String), Option<super::status::PluginPlan>) {
    let settings = match crate::plugin::settings(&ctx.policy.device_plugin, ctx.policy.mig.strategy)
    {
        Ok(s) => s,
        Err(e) => return ((StageState::Failed, e.to_string()), None),
    };
    let partial = crate::plugin::resources::partial_compute(inv, settings.mig_strategy);
    let words: Vec<String> = partial.iter().map(|(_, m, p)| format!("{m} {p}")).collect();
    if ctx.news(
        "plugin:partial-compute",
        (!words.is_empty()).then(|| words.join(", ")).as_deref(),
    ) {
        for (gpu, mig, profile) in &partial {
            tracing::warn!(stage = "plugin", gpu_uuid = %gpu, mig = %mig, profile = %profile, "MIG device with a partial compute instance is not advertised (mixed strategy)");
        }
    }
    match crate::plugin::resources::build(inv, &settings) {
        Ok(resources) if resources.is_empty() && !inv.gpus.is_empty() => (
            (
                StageState::Waiting,
                super::context::undescribed(inv, "advertised"),
            ),
            None,
        ),
        Ok(resources) => {
            let cdi_names = settings.hands_out_cdi_names();
            let plan = super::status::PluginPlan {
                settings,
                resources,
            };
            let mut detail = plan.summary();
            if !plan.settings.unacted.is_empty() {
                let keys: Vec<&str> = plan
                    .settings
                    .unacted
                    .iter()
                    .map(|u| u.key.as_str())
                    .collect();
                detail = format!(
                    "{detail}; device-plugin config keys not acted on: {}",
                    keys.join(", ")
                );
            }
            let warning = no_cdi.filter(|_| cdi_names).map(|why| {
                format!(
                    "warning: the device-list strategy hands out CDI names, but {why}: containers get no GPU through them (use envvar, or a runtime with CDI)"
                )
            });
            // Said once, not at every reconcile (the detail keeps it).
            if ctx.news("plugin: CDI names without CDI", warning.as_deref())
                && let Some(warning) = &warning
            {
                tracing::warn!(stage = "plugin", "{warning}");
            }
            if let Some(warning) = warning {
                detail = format!("{detail}; {warning}");
            }
            ((StageState::Ready, detail), Some(plan))
        }
        Err(e) => ((StageState::Failed, e.to_string()), None),
    }
}
