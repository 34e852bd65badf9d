//! The `runtime` stage: containerd / CRI-O / Docker configured for the
//! `nvidia` runtime and CDI; reloaded only when a file changed.

use super::context::Context;
use super::status::StageState;
use crate::policy::ContainerRuntime;
use crate::runtime;

/// The files that tell the policy's container runtime is on the host.
fn runtime_files(p: &crate::policy::Policy) -> Vec<&str> {
    match p.operator.default_runtime {
        ContainerRuntime::Containerd => vec![
            p.toolkit.containerd.binary.as_str(),
            p.toolkit.containerd.config.as_str(),
        ],
        ContainerRuntime::Crio => vec!["/usr/bin/crio", "/etc/crio"],
        ContainerRuntime::Docker => vec!["/usr/bin/dockerd", "/etc/docker"],
    }
}

fn runtime_present(ctx: &Context<'_>) -> bool {
    runtime_files(ctx.policy)
        .iter()
        .any(|path| ctx.host.exists(path))
}

/// A node without a GPU and without a driver needs no GPU runtime: that is a
/// fact, not something to wait for.
fn no_gpu_runtime(inv: &crate::inventory::Inventory) -> Option<String> {
    (inv.gpus.is_empty() && !inv.driver.is_loaded())
        .then(|| "no NVIDIA GPU and no container runtime on this host: nothing to configure".into())
}

/// Plans the container runtime's configuration; with `ctx.apply`, writes
/// it and reloads the runtime, only when something changed.
pub(super) fn runtime_stage(
    ctx: &Context<'_>,
    inv: Option<&crate::inventory::Inventory>,
    no_cdi: &mut Option<String>,
) -> (StageState, String) {
    let p = ctx.policy;
    let rt = p.operator.default_runtime;
    let name = format!("{rt:?}").to_lowercase();
    let present = runtime_files(p);
    if !present.iter().any(|path| ctx.host.exists(path)) {
        if let Some(why) = inv.and_then(no_gpu_runtime) {
            return (StageState::Done, why);
        }
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
    let plan = match runtime::plan(ctx.host, &p.runtime_wanted(), version) {
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

/// Validation: is what this stage set up still there and right?
pub(super) fn validate(
    ctx: &Context<'_>,
    inv: &crate::inventory::Inventory,
) -> Result<String, String> {
    let p = ctx.policy;
    if let (false, Some(why)) = (runtime_present(ctx), no_gpu_runtime(inv)) {
        return Ok(why);
    }
    let version = match p.operator.default_runtime {
        crate::policy::ContainerRuntime::Containerd => {
            crate::runtime::containerd::cached_host_version(ctx.host, &p.toolkit.containerd.binary)
        }
        _ => None,
    };
    let plan =
        crate::runtime::plan(ctx.host, &p.runtime_wanted(), version).map_err(|e| e.to_string())?;
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
