//! The `validate` stage: in-process checks of every stage that ran, in
//! milliseconds (the GPU Operator's validator chain takes minutes). Each
//! checked stage gets a [`Validation`]; each stage's checks live in its own
//! file (`validate`), this stage runs them. The supervisor writes the operator's
//! status files (`/run/nvidia/validations/driver-ready`, `toolkit-ready`,
//! `plugin-ready`) from them, and removes a file when its check fails.
//!
//! - driver: the modules are loaded; the kernel module's version equals
//!   NVML's and, when gpu-agent installed it, the bundle's.
//! - devnodes: every node the driver needs is there, with the right
//!   major:minor and mode.
//! - runtime: the runtime's configuration (as the files on the host say)
//!   has the `nvidia` runtime and CDI as the policy asks, and the host's
//!   containerd (`config dump`, where it can run from here) accepts it and
//!   shows them.
//! - cdi: the spec on the host parses, and every node, library and hook it
//!   names exists.
//! - plugin (by the supervisor): registered, and the kubelet listed devices.
//! - labels (right after it runs, being later in the order): NFD's feature
//!   file holds exactly the node's labels.

use super::context::Context;
use super::stage::Stage;
use super::status::{StageState, StageStatus, Validation};
use crate::inventory::Inventory;
use crate::plugin::manager::ResourceStatus;
use crate::policy::Policy;
use hostlib::HostRoot;

/// Runs the checks for the stages before this one that are done, and
/// records each result in its entry.
pub(super) fn validate_stage(
    ctx: &Context<'_>,
    inv: &Inventory,
    stages: &mut [StageStatus],
) -> (StageState, String) {
    let started = std::time::Instant::now();
    let now = gpu_model::util::now();
    let mut checked = Vec::new();
    let mut failed = Vec::new();
    for st in stages.iter_mut() {
        let Some(result) = check(ctx, inv, st) else {
            continue;
        };
        let (ok, detail) = match result {
            Ok(d) => (true, d),
            Err(e) => (false, e),
        };
        log_validation(ctx, st.stage, ok, &detail);
        if ok {
            checked.push(st.stage.name());
        } else {
            failed.push(format!("{}: {detail}", st.stage.name()));
        }
        st.validation = Some(Validation {
            ok,
            detail,
            since: now,
        });
    }
    // The time goes to the log and the metrics, not the detail: an
    // unchanged node's state must not change from one reconcile to the next.
    crate::metrics::agent::validation_took(started.elapsed());
    tracing::debug!(
        stage = "validate",
        ms = started.elapsed().as_secs_f64() * 1e3,
        "checked"
    );
    if failed.is_empty() {
        (
            StageState::Done,
            if checked.is_empty() {
                "nothing to check yet".to_string()
            } else {
                format!("{} checked", checked.join(", "))
            },
        )
    } else {
        (StageState::Failed, failed.join("; "))
    }
}

/// Checks again those of `stages` named in `which` that are done, as the
/// validate stage would (the reconcile bench times every check this way).
pub fn revalidate(ctx: &Context<'_>, inv: &Inventory, stages: &mut [StageStatus], which: &[Stage]) {
    let now = gpu_model::util::now();
    for st in stages.iter_mut().filter(|s| which.contains(&s.stage)) {
        if let Some(r) = check(ctx, inv, st) {
            let (ok, detail) = match r {
                Ok(d) => (true, d),
                Err(e) => (false, e),
            };
            st.validation = Some(Validation {
                ok,
                detail,
                since: now,
            });
        }
    }
}

/// Checks a stage that runs after this one (labels) right after it ran,
/// unless the policy turns validation off.
pub(super) fn validate_late(ctx: &Context<'_>, inv: &Inventory, st: &mut StageStatus) {
    let after_me = Stage::ALL
        .iter()
        .position(|s| *s == st.stage)
        .zip(Stage::ALL.iter().position(|s| *s == Stage::Validate))
        .is_some_and(|(i, v)| i > v);
    if !after_me || Stage::Validate.disabled_by(ctx.policy).is_some() {
        return;
    }
    if let Some(r) = check(ctx, inv, st) {
        let (ok, detail) = match r {
            Ok(d) => (true, d),
            Err(e) => (false, e),
        };
        log_validation(ctx, st.stage, ok, &detail);
        st.validation = Some(Validation {
            ok,
            detail,
            since: gpu_model::util::now(),
        });
    }
}

/// A failed validation is an ERROR when it begins or its words change,
/// and passing again is INFO; the same failure pass after pass is DEBUG
/// (`gpu-agent status` shows it while it lasts).
fn log_validation(ctx: &Context<'_>, stage: Stage, ok: bool, detail: &str) {
    let key = format!("validation of {}", stage.name());
    let news = ctx.news(&key, (!ok).then_some(detail));
    match (ok, news) {
        (false, true) => tracing::error!(stage = stage.name(), "validation failed: {detail}"),
        (false, false) => tracing::debug!(stage = stage.name(), "validation failed: {detail}"),
        // Passing after a failure (without memory: every pass is news).
        (true, true) if ctx.logged.is_some() => {
            tracing::info!(stage = stage.name(), "validation passes again: {detail}")
        }
        (true, _) => {}
    }
}

/// `None`: nothing to check (the stage did not run to `done`).
fn check(ctx: &Context<'_>, inv: &Inventory, st: &StageStatus) -> Option<Result<String, String>> {
    if st.state != StageState::Done {
        return None;
    }
    match st.stage {
        Stage::Driver => Some(super::driver::validate(ctx, inv)),
        Stage::Devnodes => Some(super::devnodes::validate(ctx, inv)),
        Stage::Runtime => Some(super::runtime::validate(ctx, inv)),
        Stage::Cdi => Some(super::cdi::validate(ctx, inv)),
        Stage::Labels => Some(super::labels::validate(ctx, inv)),
        _ => None,
    }
}

/// The plugin is validated when every resource is registered and the
/// kubelet has listed its devices.
pub fn plugin_validation(board: &[ResourceStatus]) -> Validation {
    let not: Vec<String> = board
        .iter()
        .filter_map(|r| match (r.registered, r.lists) {
            (false, _) => Some(format!("{} not registered", r.resource)),
            (true, 0) => Some(format!(
                "{}: the kubelet has not listed its devices",
                r.resource
            )),
            _ => None,
        })
        .collect();
    Validation {
        ok: not.is_empty(),
        detail: if !not.is_empty() {
            not.join("; ")
        } else if board.is_empty() {
            "no devices to advertise".into()
        } else {
            format!(
                "{} resource(s) registered and listed by the kubelet",
                board.len()
            )
        },
        since: gpu_model::util::now(),
    }
}

/// Every enabled stage validated: what readiness (systemd READY, a
/// DaemonSet's probe) means.
pub fn ready(stages: &[StageStatus]) -> bool {
    ready_but(stages, None)
}

/// Every enabled stage that readies the host validated: the device plugin
/// aside, whose validation is the kubelet's word (under systemd the kubelet
/// may start after us, so waiting for it would hold back the units ordered
/// after gpu-agent).
pub fn host_ready(stages: &[StageStatus]) -> bool {
    ready_but(stages, Some(Stage::Plugin))
}

fn ready_but(stages: &[StageStatus], except: Option<Stage>) -> bool {
    stages.iter().all(|s| match s.stage {
        s2 if Some(s2) == except => true,
        Stage::Driver | Stage::Devnodes | Stage::Runtime | Stage::Cdi | Stage::Plugin => {
            s.state == StageState::Disabled || s.validation.as_ref().is_some_and(|v| v.ok)
        }
        Stage::Discover | Stage::Validate | Stage::Health => {
            matches!(s.state, StageState::Done | StageState::Disabled)
        }
        Stage::Labels | Stage::Metrics | Stage::Mig => true,
    })
}

/// `driver-ready`'s `KEY=value` lines, as the operator's validator writes
/// them: where the driver's files and device nodes are, on the host and
/// as this process sees them.
pub fn driver_ready_text(host: &HostRoot, policy: &Policy) -> String {
    let seen = host.path().display().to_string();
    format!(
        "IS_HOST_DRIVER={}\nNVIDIA_DRIVER_ROOT=/\nDRIVER_ROOT_CTR_PATH={seen}\nNVIDIA_DEV_ROOT=/\nDEV_ROOT_CTR_PATH={seen}\n",
        !policy.driver.enabled
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resource(registered: bool, lists: u64) -> ResourceStatus {
        ResourceStatus {
            resource: "nvidia.com/gpu".into(),
            socket: "/var/lib/kubelet/device-plugins/nvidia-gpu.sock".into(),
            devices: 8,
            unhealthy: 0,
            registered,
            registrations: u64::from(registered),
            last_error: None,
            lists,
        }
    }

    #[test]
    fn plugin_validation_says_what_holds_and_what_does_not() {
        let good = plugin_validation(&[resource(true, 1)]);
        assert!(good.ok);
        assert_eq!(
            good.detail,
            "1 resource(s) registered and listed by the kubelet"
        );
        let unlisted = plugin_validation(&[resource(true, 0)]);
        assert!(!unlisted.ok);
        assert_eq!(
            unlisted.detail,
            "nvidia.com/gpu: the kubelet has not listed its devices"
        );
        let unregistered = plugin_validation(&[resource(false, 0)]);
        assert!(!unregistered.ok);
        assert_eq!(unregistered.detail, "nvidia.com/gpu not registered");
        let none = plugin_validation(&[]);
        assert!(none.ok);
        assert_eq!(none.detail, "no devices to advertise");
    }
}
