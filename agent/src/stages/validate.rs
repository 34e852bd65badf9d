//! The `validate` stage: in-process checks of every stage that ran, in
//! milliseconds (the GPU Operator's validator chain takes minutes). Each
//! checked stage gets a [`Validation`]; the supervisor writes the operator's
//! status files (`/run/nvidia/validations/driver-ready`, `toolkit-ready`,
//! `plugin-ready`) from them, and removes a file when its check fails.
//!
//! - driver: the modules are loaded; the kernel module's version equals
//!   NVML's and, when gpu-agent installed it, the bundle's.
//! - devnodes: every node the driver needs is there, with the right
//!   major:minor and mode.
//! - runtime: the runtime's configuration (as the files on the host say)
//!   has the `nvidia` runtime and CDI as the policy asks.
//! - cdi: the spec on the host parses, and every node, library and hook it
//!   names exists.
//! - plugin (by the supervisor): registered, and the kubelet listed devices.

use super::{Context, Stage, StageState, StageStatus, Validation};
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
    let now = crate::state::now();
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
        if ok {
            checked.push(st.stage.name());
        } else {
            tracing::error!(stage = st.stage.name(), "validation failed: {detail}");
            failed.push(format!("{}: {detail}", st.stage.name()));
        }
        st.validation = Some(Validation {
            ok,
            detail,
            since: now,
        });
    }
    // The time goes to the log, not the detail: an unchanged node's
    // state must not change from one reconcile to the next.
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

/// Checks the stages `deferred` again after they ran late.
pub fn revalidate(
    ctx: &Context<'_>,
    inv: &Inventory,
    stages: &mut [StageStatus],
    deferred: &[Stage],
) {
    let now = crate::state::now();
    for st in stages.iter_mut().filter(|s| deferred.contains(&s.stage)) {
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

/// `None`: nothing to check (the stage did not run to `done`).
fn check(ctx: &Context<'_>, inv: &Inventory, st: &StageStatus) -> Option<Result<String, String>> {
    if st.state != StageState::Done {
        return None;
    }
    match st.stage {
        Stage::Driver => Some(check_driver(ctx, inv)),
        Stage::Devnodes => Some(check_devnodes(ctx, inv)),
        Stage::Runtime => Some(check_runtime(ctx)),
        Stage::Cdi => Some(check_cdi(ctx, inv)),
        _ => None,
    }
}

fn check_driver(ctx: &Context<'_>, inv: &Inventory) -> Result<String, String> {
    if inv.gpus.is_empty() && !inv.driver.is_loaded() {
        return Ok("no GPU and no driver".into());
    }
    // The bundle gpu-agent installed, if it manages the driver.
    let bundle = if ctx.policy.driver.enabled && !ctx.simulated {
        kmod::bundle::current(ctx.host)
            .ok()
            .flatten()
            .and_then(|name| kmod::bundle::read_installed(ctx.host, &name).ok())
            .map(|m| m.driver_version)
    } else {
        None
    };
    let nvml = inv.backend.driver_version.clone();
    let ask = move || {
        nvml.clone()
            .ok_or_else(|| "NVML did not answer".to_string())
    };
    let version = crate::driver::validate(
        ctx.sys,
        bundle.as_deref(),
        inv.backend
            .error
            .is_none()
            .then_some(&ask as &dyn Fn() -> Result<String, String>),
    )
    .map_err(|e| e.to_string())?;
    let modules: Vec<&str> = inv.driver.modules.iter().map(|m| m.name.as_str()).collect();
    Ok(format!(
        "driver {version} loaded ({}){}",
        modules.join(", "),
        if bundle.is_some() {
            "; matches the bundle and NVML"
        } else if inv.backend.error.is_none() {
            "; NVML agrees"
        } else {
            ""
        }
    ))
}

fn check_devnodes(ctx: &Context<'_>, inv: &Inventory) -> Result<String, String> {
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

fn check_runtime(ctx: &Context<'_>) -> Result<String, String> {
    let p = ctx.policy;
    let version = match p.operator.default_runtime {
        crate::policy::ContainerRuntime::Containerd => {
            crate::runtime::containerd::cached_host_version(ctx.host, &p.toolkit.containerd.binary)
        }
        _ => None,
    };
    let plan = crate::runtime::plan(ctx.host, p, version).map_err(|e| e.to_string())?;
    if plan.changes.is_empty() {
        let want_cdi = p.cdi.enabled && plan.no_cdi.is_none();
        let cdi = if want_cdi { " and CDI" } else { "" };
        let files = format!(
            "the configuration has the {:?} runtime{cdi}",
            p.operator.runtime_class
        );
        if p.operator.default_runtime != crate::policy::ContainerRuntime::Containerd
            || ctx.simulated
        {
            return Ok(files);
        }
        use crate::runtime::containerd::DumpCheck;
        match containerd_dump(ctx, want_cdi)? {
            DumpCheck::Accepted(d) => Ok(d),
            DumpCheck::CannotRun(why) => Ok(format!("{files} ({why}; the files were checked)")),
        }
    } else {
        let paths: Vec<&str> = plan.changes.iter().map(|c| c.path.as_str()).collect();
        Err(format!(
            "{} no longer say what gpu-agent wrote",
            paths.join(", ")
        ))
    }
}

/// The host's containerd asked (`config dump`) once per binary and
/// configuration: a reconcile of an unchanged node does not run it again.
fn containerd_dump(
    ctx: &Context<'_>,
    want_cdi: bool,
) -> Result<crate::runtime::containerd::DumpCheck, String> {
    use std::hash::{Hash, Hasher};
    use std::os::unix::fs::MetadataExt;
    use std::sync::Mutex;
    type Cached = (u64, Result<crate::runtime::containerd::DumpCheck, String>);
    static LAST: Mutex<Option<Cached>> = Mutex::new(None);
    let c = &ctx.policy.toolkit.containerd;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (
        ctx.host.path(),
        &c.binary,
        &c.config,
        &ctx.policy.operator.runtime_class,
        want_cdi,
    )
        .hash(&mut h);
    if let Ok(m) = ctx
        .host
        .resolve(&c.binary)
        .and_then(|p| std::fs::metadata(&p).map_err(|e| hostlib::HostError::io(p, e)))
    {
        (m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec()).hash(&mut h);
    }
    ctx.host
        .read_optional(&c.config)
        .ok()
        .flatten()
        .hash(&mut h);
    if let Ok(names) = ctx.host.read_dir_names(&c.drop_in_dir) {
        for n in names {
            let path = format!("{}/{n}", c.drop_in_dir);
            (n, ctx.host.read_optional(&path).ok().flatten()).hash(&mut h);
        }
    }
    let key = h.finish();
    let mut last = LAST.lock().unwrap();
    if let Some((k, r)) = last.as_ref()
        && *k == key
    {
        return r.clone();
    }
    let r = crate::runtime::containerd::dump_check(
        ctx.host,
        &c.binary,
        &c.config,
        &ctx.policy.operator.runtime_class,
        want_cdi,
    );
    *last = Some((key, r.clone()));
    r
}

fn check_cdi(ctx: &Context<'_>, inv: &Inventory) -> Result<String, String> {
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
        detail: if not.is_empty() {
            not.join("; ")
        } else if board.is_empty() {
            "no devices to advertise".into()
        } else {
            format!(
                "{} resource(s) registered and listed by the kubelet",
                board.len()
            )
        },
        since: crate::state::now(),
    }
}

/// Every enabled stage validated: what readiness (systemd READY, a
/// DaemonSet's probe) means.
pub fn ready(stages: &[StageStatus]) -> bool {
    stages.iter().all(|s| match s.stage {
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
