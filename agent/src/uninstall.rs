//! `gpu-agent uninstall`: the host as it was before gpu-agent. Every host
//! file it changed is put back byte for byte (mode and owner too), every
//! file it made is removed (runtime drop-ins, CDI specs, the CDI hook
//! program, the labels file, the operator's validation files it wrote, its
//! state, locks, backups and driver bundles), and so are the directories it
//! made. Loaded kernel modules, and the device nodes that go with them,
//! stay: unloading a driver under running GPU work is not a clean-up.

use std::path::PathBuf;

use hostlib::managed::{ManagedError, ManagedFiles, Restored};
use hostlib::{HostError, HostRoot, Syscalls};

use crate::supervisor::{DRIVER_READY, PLUGIN_READY, TOOLKIT_READY, VALIDATIONS_DIR};

/// gpu-agent's own directories: everything in them is its.
pub const OWN_DIRS: &[&str] = &["/var/lib/gpu-agent", "/run/gpu-agent", "/run/nvidia/mps"];

#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    #[error(
        "{lock}: gpu-agent (pid {pid}) is running and would change the host again; stop it first (systemctl stop gpu-agent, or delete its DaemonSet)"
    )]
    Running { pid: u32, lock: PathBuf },
    #[error(transparent)]
    Managed(#[from] ManagedError),
    #[error(transparent)]
    Host(#[from] HostError),
}

/// What uninstalling did, one line a change (`restored /etc/...`).
pub fn uninstall(
    host: &HostRoot,
    sys: &dyn Syscalls,
    wait: bool,
) -> Result<Vec<String>, UninstallError> {
    if let Some(pid) = crate::state::agent_running(host) {
        return Err(UninstallError::Running {
            pid,
            lock: host.resolve(crate::state::LOCK_FILE)?,
        });
    }
    let mut done = Vec::new();
    let files = ManagedFiles::lock(host, sys, wait)?;
    let made = files.created_dirs()?;
    for r in files.restore()? {
        done.push(match r {
            Restored::Rewritten(p) => format!("restored {p}"),
            Restored::Removed(p) => format!("removed {p}"),
        });
    }
    for name in [DRIVER_READY, TOOLKIT_READY, PLUGIN_READY] {
        let path = format!("{VALIDATIONS_DIR}/{name}");
        if remove(host, &path, false)? {
            done.push(format!("removed {path}"));
        }
    }
    // The lock goes with /run/gpu-agent.
    drop(files);
    for dir in OWN_DIRS {
        // Our own lock alone (taken just now) is not worth a line.
        let only_lock = std::fs::read_dir(host.resolve(dir)?).is_ok_and(|rd| {
            rd.filter_map(Result::ok).all(|e| {
                e.path()
                    == host
                        .resolve(hostlib::managed::LOCK_FILE)
                        .unwrap_or_default()
            })
        });
        if remove(host, dir, true)? && !only_lock {
            done.push(format!("removed {dir}/"));
        }
    }
    // Directories made for what is gone now, deepest first (a file someone
    // else put there keeps its directory); the validation directory too
    // when it is empty, as the operator's validator leaves none behind.
    let mut dirs: Vec<String> = made;
    dirs.extend(["/run/nvidia".to_string(), VALIDATIONS_DIR.to_string()]);
    dirs.sort_by_key(|d| std::cmp::Reverse(d.matches('/').count()));
    dirs.dedup();
    for d in dirs {
        if hostlib::managed::remove_dir_if_empty(host, &d)? {
            done.push(format!("removed {d}/"));
        }
    }
    Ok(done)
}

/// Removes a host file (or, with `tree`, a directory and all in it);
/// true when there was one. Made through descriptors in the host root
/// ([`HostRoot::remove_file`], [`HostRoot::remove_all`]): a link swapped
/// in on the way cannot take the removal outside it.
fn remove(host: &HostRoot, path: &str, tree: bool) -> Result<bool, HostError> {
    if tree {
        host.remove_all(path)
    } else {
        host.remove_file(path)
    }
}
