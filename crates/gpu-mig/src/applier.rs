//! The applier: a plan carried out through [`MigControl`] (modes, GPU
//! resets, instances, a check), with the previous layout put back on failure.

use hostlib::HostRoot;
use hostlib::command::CommandRunner;

use crate::layout::{WantedGi, layout_of};
use crate::planner::{GpuPlan, Plan};
use gpu_model::mig::{ErrorKind, GiProfile, MigControl, MigError, Placement, place};

/// How an apply ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// Every GPU has its wanted layout; what changed, by GPU index.
    Done(Vec<(u32, String)>),
    /// A GPU's mode change waits for a reboot, which was asked for.
    Rebooting(String),
}

/// Whether a failed state's detail says the apply itself failed (and was
/// rolled back), as opposed to waiting on processes.
pub fn apply_failed(detail: &str) -> bool {
    detail.contains(APPLY_FAILED)
}

/// Marks an apply failure in the stage's detail.
pub const APPLY_FAILED: &str = " failed and was rolled back: ";

/// An apply that failed; the previous layout was put back (or the message
/// says what could not be).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApplyError {
    pub message: String,
}

/// What the applier may do beyond NVML.
#[derive(Debug)]
pub struct ApplyEnv<'a> {
    pub host: &'a HostRoot,
    /// Runs the host's `systemctl reboot` when a reboot is allowed.
    pub runner: &'a dyn CommandRunner,
    /// `spec.migManager.reboot`.
    pub reboot: bool,
}

/// Applies `plan`'s changes; on failure every changed GPU gets its
/// previous layout back.
pub fn apply(
    control: &dyn MigControl,
    env: &ApplyEnv<'_>,
    plan: &Plan,
) -> Result<Applied, ApplyError> {
    let changing: Vec<&GpuPlan> = plan.changing().collect();
    let mut touched: Vec<&GpuPlan> = Vec::new();
    let mut done = Vec::new();
    let result = (|| -> Result<Option<String>, String> {
        // 1. Modes (a GPU turning MIG off loses its instances first).
        let mut need_reset = Vec::new();
        for g in &changing {
            touched.push(*g);
            let mode = control.mode(&g.uuid).map_err(|e| e.to_string())?;
            if !g.wanted.enabled && mode.current {
                clear(control, &g.uuid).map_err(|e| e.to_string())?;
            }
            if mode.pending != g.wanted.enabled {
                control
                    .set_mode(&g.uuid, g.wanted.enabled)
                    .map_err(|e| e.to_string())?;
            }
            let now = control.mode(&g.uuid).map_err(|e| e.to_string())?;
            if now.current != g.wanted.enabled {
                need_reset.push(*g);
            }
        }
        // 2. Resets for modes that wait for one.
        for g in &need_reset {
            reset(env.host, g)?;
            let now = control.mode(&g.uuid).map_err(|e| e.to_string())?;
            if now.current != g.wanted.enabled {
                let why = format!(
                    "GPU {} ({}): MIG mode {} is pending and a GPU reset did not apply it; only a reboot can",
                    g.index,
                    g.uuid,
                    if g.wanted.enabled { "on" } else { "off" }
                );
                if env.reboot {
                    let mut argv: Vec<String> = Vec::new();
                    if !env.host.is_system() {
                        argv.push("chroot".into());
                        argv.push(env.host.path().display().to_string());
                    }
                    argv.extend(["systemctl", "reboot"].map(String::from));
                    env.runner.run(&argv).map_err(|e| format!("{why}; {e}"))?;
                    return Ok(Some(format!(
                        "{why}: rebooting the node (spec.migManager.reboot)"
                    )));
                }
                return Err(format!(
                    "{why}; reboot the node, or let gpu-agent do it with spec.migManager.reboot: true"
                ));
            }
            done.push((g.index, "reset to apply MIG mode".to_string()));
        }
        // 3. Instances.
        for g in &changing {
            if !g.wanted.enabled {
                done.push((g.index, "MIG off".to_string()));
                continue;
            }
            clear(control, &g.uuid).map_err(|e| e.to_string())?;
            create(control, g).map_err(|e| format!("GPU {} ({}): {e}", g.index, g.uuid))?;
            // 4. Check.
            let instances = control.instances(&g.uuid).map_err(|e| e.to_string())?;
            let profiles = control.gi_profiles(&g.uuid).map_err(|e| e.to_string())?;
            let now = layout_of(control, &g.uuid, true, &instances, &profiles)
                .map_err(|e| e.to_string())?;
            if now != g.wanted {
                return Err(format!(
                    "GPU {} ({}): after applying, NVML shows {} instead of {}",
                    g.index,
                    g.uuid,
                    now.describe(),
                    g.wanted.describe()
                ));
            }
            done.push((g.index, g.wanted.describe()));
        }
        Ok(None)
    })();
    match result {
        Ok(None) => Ok(Applied::Done(done)),
        Ok(Some(why)) => Ok(Applied::Rebooting(why)),
        Err(why) => {
            let mut message = format!("{why}; ");
            let mut failures = Vec::new();
            for g in touched.iter().rev() {
                if let Err(e) = restore(control, env.host, g) {
                    failures.push(format!("GPU {}: {e}", g.index));
                }
            }
            if failures.is_empty() {
                message.push_str("the previous layout is back");
            } else {
                message.push_str(&format!(
                    "putting the previous layout back failed too: {}",
                    failures.join("; ")
                ));
            }
            Err(ApplyError { message })
        }
    }
}

/// Destroys every compute instance, then every GPU instance.
fn clear(control: &dyn MigControl, uuid: &str) -> Result<(), MigError> {
    let mode = control.mode(uuid)?;
    if !mode.current {
        return Ok(());
    }
    for gi in control.instances(uuid)? {
        for ci in &gi.cis {
            control.destroy_ci(uuid, gi.id, ci.id)?;
        }
        control.destroy_gi(uuid, gi.id)?;
    }
    Ok(())
}

/// How many placement solutions are tried before giving up.
const MAX_TRIES: usize = 16;

/// Creates the wanted instances, trying placements until NVML takes one.
fn create(control: &dyn MigControl, g: &GpuPlan) -> Result<(), String> {
    let profiles = control.gi_profiles(&g.uuid).map_err(|e| e.to_string())?;
    let mut by_gi: Vec<(&WantedGi, &GiProfile)> = Vec::new();
    for gi in &g.wanted.gis {
        let p = profiles
            .iter()
            .find(|p| p.name == gi.profile)
            .ok_or_else(|| {
                format!(
                    "no MIG profile {} on this GPU (it has: {})",
                    gi.profile,
                    profiles
                        .iter()
                        .map(|p| p.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })?;
        by_gi.push((gi, p));
    }
    let options: Vec<&[Placement]> = by_gi.iter().map(|(_, p)| p.placements.as_slice()).collect();
    let solutions = place::solutions(&options, &[], MAX_TRIES);
    if solutions.is_empty() {
        return Err(format!(
            "{} do not fit together (no placement leaves them apart)",
            g.wanted.describe()
        ));
    }
    let mut last = String::new();
    for (attempt, solution) in solutions.iter().enumerate() {
        match create_at(control, &g.uuid, &by_gi, solution) {
            Ok(()) => return Ok(()),
            Err(e) => {
                tracing::debug!(gpu_uuid = %g.uuid, attempt, error = %e, "placement refused; trying another");
                last = e.to_string();
                clear(control, &g.uuid).map_err(|e| e.to_string())?;
            }
        }
    }
    Err(format!(
        "NVML refused every placement tried ({}): {last}",
        solutions.len()
    ))
}

fn create_at(
    control: &dyn MigControl,
    uuid: &str,
    gis: &[(&WantedGi, &GiProfile)],
    at: &[Placement],
) -> Result<(), MigError> {
    for ((want, profile), &placement) in gis.iter().zip(at) {
        let gi = control.create_gi(uuid, profile.id, placement)?;
        let cps = control.ci_profiles(uuid, gi)?;
        for &slices in &want.cis {
            let cp = cps.iter().find(|c| c.slices == slices).ok_or_else(|| MigError {
                gpu: uuid.to_string(),
                call: "nvmlGpuInstanceGetComputeInstanceProfileInfo",
                message: format!(
                    "GPU instance {gi} ({}) has no compute-instance profile of {slices} slice(s)",
                    profile.name
                ),
                kind: ErrorKind::NotSupported,
            })?;
            control.create_ci(uuid, gi, cp.id)?;
        }
    }
    Ok(())
}

/// Puts a GPU's previous instances (same profiles, same placements) and
/// mode back.
fn restore(control: &dyn MigControl, host: &HostRoot, g: &GpuPlan) -> Result<(), String> {
    let mode = control.mode(&g.uuid).map_err(|e| e.to_string())?;
    if mode.current {
        clear(control, &g.uuid).map_err(|e| e.to_string())?;
    }
    if mode.pending != g.mode.pending {
        control
            .set_mode(&g.uuid, g.mode.pending)
            .map_err(|e| e.to_string())?;
        let now = control.mode(&g.uuid).map_err(|e| e.to_string())?;
        if now.current != g.mode.current {
            reset(host, g)?;
        }
    }
    let now = control.mode(&g.uuid).map_err(|e| e.to_string())?;
    if now.current {
        for gi in &g.instances {
            let id = control
                .create_gi(
                    &g.uuid,
                    gi.profile_id,
                    Placement {
                        start: gi.placement.0,
                        size: gi.placement.1,
                    },
                )
                .map_err(|e| e.to_string())?;
            for ci in &gi.cis {
                control
                    .create_ci(&g.uuid, id, ci.profile_id)
                    .map_err(|e| e.to_string())?;
            }
        }
    }
    Ok(())
}

/// Resets a GPU through its PCI function (`/sys/bus/pci/devices/<bdf>/reset`
/// under the host root).
fn reset(host: &HostRoot, g: &GpuPlan) -> Result<(), String> {
    use std::io::Write;
    let file = format!("/sys/bus/pci/devices/{}/reset", g.bus_id);
    let path = host.resolve(&file).map_err(|e| e.to_string())?;
    tracing::info!(gpu_uuid = %g.uuid, path = %file, "resetting the GPU to apply its MIG mode");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|mut f| f.write_all(b"1"))
        .map_err(|e| {
            format!(
                "GPU {} ({}): cannot reset it through {file}: {e}",
                g.index, g.uuid
            )
        })
}
