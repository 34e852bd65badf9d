//! The `runtime` stage: containerd / CRI-O / Docker configured for the
//! `nvidia` runtime and CDI; reloaded only when a file changed.

use super::{Context, StageState};
use crate::policy::ContainerRuntime;
use crate::runtime;

/// Plans the container runtime's configuration; with `ctx.apply`, writes
/// it and reloads the runtime, only when something changed.
pub(super) fn runtime_stage(
    ctx: &Context<'_>,
    no_cdi: &mut Option<String>,
) -> (StageState, String) {
    let p = ctx.policy;
    let rt = p.operator.default_runtime;
    let name = format!("{rt:?}").to_lowercase();
    let present: &[&str] = match rt {
        ContainerRuntime::Containerd => &[
            p.toolkit.containerd.binary.as_str(),
            p.toolkit.containerd.config.as_str(),
        ],
        ContainerRuntime::Crio => &["/usr/bin/crio", "/etc/crio"],
        ContainerRuntime::Docker => &["/usr/bin/dockerd", "/etc/docker"],
    };
    if !present.iter().any(|path| ctx.host.exists(path)) {
        return (
            StageState::Waiting,
            format!(
                "no {name} on this host (none of {}); nothing to configure",
                present.join(", ")
            ),
        );
    }
    // A running agent remembers containerd's version per binary (asking
    // costs ~20 ms before the plugin can register); `status` asks afresh.
    let version = match (rt, ctx.apply) {
        (ContainerRuntime::Containerd, Some(_)) => {
            runtime::containerd::cached_host_version(ctx.host, &p.toolkit.containerd.binary)
        }
        _ => None,
    };
    let plan = match runtime::plan(ctx.host, p, version) {
        Ok(plan) => plan,
        Err(e) => return (StageState::Failed, e.to_string()),
    };
    no_cdi.clone_from(&plan.no_cdi);
    let notes = if plan.notes.is_empty() {
        String::new()
    } else {
        format!(" ({})", plan.notes.join("; "))
    };
    if plan.changes.is_empty() {
        return (
            StageState::Done,
            format!("{name} already configured; not reloaded{notes}"),
        );
    }
    let paths: Vec<&str> = plan.changes.iter().map(|c| c.path.as_str()).collect();
    let Some(runner) = ctx.apply else {
        return (
            StageState::Ready,
            format!(
                "would change {} (`gpu-agent runtime configure --dry-run` shows how){notes}",
                paths.join(", ")
            ),
        );
    };
    let written = match runtime::apply(ctx.host, ctx.syscalls, &plan, true) {
        Ok(w) => w,
        Err(e) => return (StageState::Failed, e.to_string()),
    };
    if written.is_empty() {
        return (
            StageState::Done,
            format!("{name} already configured; not reloaded{notes}"),
        );
    }
    ctx.changed(format!("wrote {}", written.join(", ")));
    match runtime::reload(ctx.host, rt, &plan.unit, p.toolkit.reload, runner) {
        Ok(did) => (
            StageState::Done,
            format!("wrote {}; {did}{notes}", written.join(", ")),
        ),
        Err(e) => (
            StageState::Failed,
            format!("wrote {}, but {e}", written.join(", ")),
        ),
    }
}
