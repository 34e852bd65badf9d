//! The `driver` stage: the host's driver recorded, or gpu-agent's bundle
//! installed and its modules loaded (an upgrade when the version differs).

use super::context::Context;
use super::status::StageState;
use crate::inventory::Inventory;

/// The driver: the host's (`spec.driver.enabled: false`: recorded, no
/// module touched), or gpu-agent's: the policy's bundle installed, modules
/// loaded with their parameters, an upgrade when the bundle's version is
/// not the loaded one.
pub(super) fn driver_stage(ctx: &Context<'_>, inv: &Inventory) -> (StageState, String) {
    let d = &ctx.policy.driver;
    let state = &inv.driver;
    let loaded = state.is_loaded();
    let loaded_text = || {
        format!(
            "driver {} ({}) loaded",
            state.version.as_deref().unwrap_or("of unknown version"),
            state
                .flavour
                .map(|f| format!("{f:?}").to_lowercase())
                .unwrap_or_else(|| "flavour unknown".into())
        )
    };
    if !d.enabled {
        return match (loaded, inv.gpus.is_empty()) {
            (true, _) => (
                StageState::Done,
                format!(
                    "host {}; modules not managed (spec.driver.enabled is false)",
                    loaded_text()
                ),
            ),
            (false, true) => (StageState::Done, "no NVIDIA GPU and no driver".into()),
            (false, false) => (
                StageState::Waiting,
                "no NVIDIA driver loaded on the host, and spec.driver.enabled is false: gpu-agent loads none".into(),
            ),
        };
    }
    if inv.gpus.is_empty() && !loaded {
        return (
            StageState::Done,
            "no NVIDIA GPU on this node: nothing to load".into(),
        );
    }
    if ctx.simulated {
        return if loaded {
            (
                StageState::Done,
                format!("{} (simulated node: no module touched)", loaded_text()),
            )
        } else {
            (
                StageState::Ready,
                "simulated node without a driver: a real node would load one here".into(),
            )
        };
    }
    // Loading and unloading need the list of loaded modules, whole.
    match state.module_list {
        hostlib::driver::ModuleList::NoModuleSupport => {
            return (
                StageState::Failed,
                "the kernel has no loadable-module support (no /proc/modules): gpu-agent cannot load a driver; use a kernel with the driver built in and spec.driver.enabled: false".into(),
            );
        }
        hostlib::driver::ModuleList::Unreadable | hostlib::driver::ModuleList::Read => {
            if let Some(u) = inv
                .unreadable
                .iter()
                .find(|u| u.path.ends_with("proc/modules"))
            {
                return (
                    StageState::Failed,
                    format!(
                        "cannot tell which modules are loaded, so none is loaded or unloaded: {u}"
                    ),
                );
            }
        }
    }
    match driver_apply(ctx, inv) {
        Ok((state, detail)) => (state, detail),
        Err(e) => (StageState::Failed, e.to_string()),
    }
}

pub(super) fn driver_apply(
    ctx: &Context<'_>,
    inv: &Inventory,
) -> Result<(StageState, String), crate::driver::DriverError> {
    use crate::driver;
    use kmod::bundle;
    let d = &ctx.policy.driver;
    let loaded_version = inv.driver.version.clone();
    // Without a bundle nothing can bring another version.
    if d.bundle.is_none()
        && let (Some(v), Some(have)) = (&d.version, &loaded_version)
        && v != have
    {
        return Err(driver::DriverError::Validate(format!(
            "driver {have} is loaded, spec.driver.version asks for {v}: give spec.driver.bundle with that version to upgrade (the other stages work with the loaded driver meanwhile)"
        )));
    }
    let nothing_of_ours =
        d.bundle.is_none() && d.module_dir.is_none() && bundle::current(ctx.host)?.is_none();
    if nothing_of_ours && let Some(have) = &loaded_version {
        // Loaded by someone else (the distribution's packages): keep it.
        return Ok((
            StageState::Done,
            format!(
                "driver {have} loaded (not by gpu-agent: no bundle or moduleDir in the policy)"
            ),
        ));
    }
    let kernel = driver::running_kernel(ctx.sys)?;
    let mut notes = Vec::new();
    // The policy's bundle, unpacked (once) beside the others.
    let mut wanted: Option<String> = None;
    // Installs and upgrades change host files: one writer at a time (a
    // `gpu-agent driver` command, another agent), held to the end.
    let mut lock: Option<hostlib::managed::HostFilesLock> = None;
    if let Some(b) = &d.bundle {
        let path = ctx.host.resolve(b)?;
        if ctx.apply.is_none() {
            return Ok((
                StageState::Ready,
                format!("would install {b} and load its modules"),
            ));
        }
        lock = Some(hostlib::managed::HostFilesLock::take(
            ctx.host,
            &format!("driver install {b} (the driver stage)"),
            true,
        )?);
        let expected = bundle::expected_sha256(&path, d.bundle_sha256.as_deref())?;
        let installed = bundle::install(
            ctx.host,
            &path,
            (&expected.0, &expected.1),
            &kernel,
            Box::new(|_| {}),
        )?;
        if let Some(v) = &d.version
            && v != &installed.manifest.driver_version
        {
            return Err(driver::DriverError::Validate(format!(
                "spec.driver.version is {v}, the bundle {b} holds {}",
                installed.manifest.driver_version
            )));
        }
        if installed.unpacked {
            ctx.changed(format!("unpacked {b}"));
            notes.push(format!(
                "unpacked {b} into {} ({} files)",
                installed.dir, installed.files
            ));
        }
        let name = installed.manifest.dir_name(&kernel);
        // Nothing loaded: nothing to drain, the policy's bundle becomes current.
        if !inv.driver.is_loaded() && bundle::current(ctx.host)?.as_deref() != Some(name.as_str()) {
            bundle::switch(ctx.host, &name)?;
        }
        wanted = Some(name);
    }
    let current = bundle::current(ctx.host)?;
    if let (Some(want), Some(have)) = (&wanted, &loaded_version) {
        let want_version = bundle::read_installed(ctx.host, want)?.driver_version;
        if &want_version != have || current.as_ref() != Some(want) {
            if !ctx.upgrade.may_upgrade(&want_version) {
                return Ok((StageState::Done, ctx.upgrade.hold(have, &want_version)));
            }
            if let Some(l) = &lock
                && let Err(e) =
                    l.doing(&format!("driver upgrade {want_version} (the driver stage)"))
            {
                tracing::warn!(stage = "driver", error = %e, "cannot say in the host-files lock what it is held for");
            }
            let up = driver::Upgrade {
                host: ctx.host,
                sys: ctx.syscalls,
                driver: &ctx.policy.driver,
                inv: Some(inv),
                kernel: &kernel,
                drain: ctx.drain.unwrap_or(&driver::NothingAdvertised),
                nvml: None,
            };
            let report = match up.run(want) {
                Ok(r) => r,
                Err(e) => {
                    ctx.upgrade
                        .say("upgrade-failed", &want_version, e.to_string());
                    return Err(e);
                }
            };
            ctx.upgrade
                .say("upgrade-done", &want_version, report.clone());
            ctx.changed(report.clone());
            return Ok((StageState::Done, join_notes(report, &notes)));
        }
        ctx.upgrade.say(
            "upgrade-done",
            &want_version,
            format!("driver {have} loaded"),
        );
    }
    let plan = driver::plan_load(ctx.host, &ctx.policy.driver, Some(inv), &kernel, None)?;
    if ctx.apply.is_none() {
        let todo: Vec<&str> = plan
            .specs
            .iter()
            .filter(|s| !inv.driver.modules.iter().any(|m| m.name == s.name))
            .map(|s| s.name.as_str())
            .collect();
        return Ok(if todo.is_empty() {
            (
                StageState::Done,
                format!("modules loaded from {}", plan.dir),
            )
        } else {
            (
                StageState::Ready,
                format!("would load {} from {}", todo.join(", "), plan.dir),
            )
        });
    }
    let outcomes = driver::load(ctx.host, ctx.syscalls, &plan, d.on_param_mismatch)?;
    let newly: Vec<String> = outcomes
        .iter()
        .filter_map(|o| match o {
            kmod::modules::LoadOutcome::Loaded { module, .. } => Some(module.clone()),
            kmod::modules::LoadOutcome::AlreadyLoaded { .. } => None,
        })
        .collect();
    if !newly.is_empty() {
        ctx.changed(format!("loaded {}", newly.join(", ")));
    }
    let want = plan.bundle.as_ref().map(|(_, v)| v.as_str());
    let version = driver::validate(ctx.host, want, None)?;
    let what = if newly.is_empty() {
        format!("driver {version} already loaded as the policy asks")
    } else {
        format!(
            "loaded {} from {} (driver {version}{})",
            newly.join(", "),
            plan.dir,
            if plan.why.is_empty() {
                String::new()
            } else {
                format!("; {}", plan.why)
            }
        )
    };
    Ok((StageState::Done, join_notes(what, &notes)))
}

pub(super) fn join_notes(what: String, notes: &[String]) -> String {
    if notes.is_empty() {
        what
    } else {
        format!("{what}; {}", notes.join("; "))
    }
}

/// Validation: is what this stage set up still there and right?
pub(super) fn validate(ctx: &Context<'_>, inv: &Inventory) -> Result<String, String> {
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
