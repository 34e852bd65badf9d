//! The container runtime stage: plan the config changes, show them as a
//! unified diff, write them through [`hostlib::managed`] (atomic, original
//! kept once, restorable byte for byte), and never touch a file whose
//! content would not change.
//!
//! Built: containerd, CRI-O (drop-in), Docker (daemon.json), reload only on
//! change. Coming: CDI specs.
//!
//! What makes each runtime read a changed config (from their docs):
//! - containerd reads its config only at start: it must be restarted
//!   (`systemctl restart containerd`). Its SIGHUP handling is not a reload
//!   (a SIGHUP'd containerd under systemd just goes down and comes back,
//!   the restart storm users of the NVIDIA toolkit report), so we never signal it.
//! - CRI-O reloads only some options on SIGHUP; a new runtime handler needs
//!   a restart (`systemctl restart crio`).
//! - Docker reloads `runtimes` and `features` from daemon.json on SIGHUP
//!   (`signal`), or restarts (`systemctl restart docker`).

pub mod change;
pub mod containerd;
pub mod crio;
pub mod docker;
pub mod error;
pub mod spec;

use hostlib::HostRoot;
use hostlib::Syscalls;
use hostlib::command::CommandRunner;
use hostlib::managed::{ManagedFiles, Restored};

pub use change::FileChange;
pub use error::RuntimeError;
pub use spec::{ContainerRuntime, ReloadMode, ToolkitSpec};

/// What the policy wants of the container runtime (the agent's
/// `Policy::runtime_wanted`).
#[derive(Clone, Copy, Debug)]
pub struct Wanted<'a> {
    /// `spec.operator.defaultRuntime`.
    pub runtime: ContainerRuntime,
    /// `spec.operator.runtimeClass`: the runtime name to add.
    pub runtime_class: &'a str,
    /// `spec.toolkit`.
    pub toolkit: &'a ToolkitSpec,
    /// `spec.cdi.enabled`: the runtime should inject CDI devices.
    pub enable_cdi: bool,
}

/// Where the host's NVIDIA container runtime may be.
const NVIDIA_RUNTIME_PATHS: &[&str] = &[
    "/usr/bin/nvidia-container-runtime",
    "/usr/local/nvidia/toolkit/nvidia-container-runtime",
];

/// The host's `nvidia-container-runtime`, if it has one.
pub fn host_nvidia_runtime(host: &HostRoot) -> Option<String> {
    NVIDIA_RUNTIME_PATHS
        .iter()
        .find(|p| host.exists(p))
        .map(|p| p.to_string())
}

/// The planned changes for the policy's runtime.
#[derive(Debug)]
pub struct RuntimePlan {
    pub runtime: ContainerRuntime,
    pub changes: Vec<FileChange>,
    pub notes: Vec<String>,
    /// The systemd unit a restart goes to (k3s/RKE2 restart their own containerd).
    pub unit: String,
    /// Why the runtime will not inject CDI devices, when that is known.
    pub no_cdi: Option<String>,
}

/// Plans the configuration of the policy's container runtime.
pub fn plan(
    host: &HostRoot,
    want: &Wanted<'_>,
    containerd_version: Option<containerd::Version>,
) -> Result<RuntimePlan, RuntimeError> {
    let runtime = want.runtime;
    match runtime {
        ContainerRuntime::Containerd => {
            let c = &want.toolkit.containerd;
            let version = containerd_version.or_else(|| containerd::host_version(host, &c.binary));
            let opts = containerd::Options {
                config: c.config.clone(),
                drop_in_dir: c.drop_in_dir.clone(),
                runtime_name: want.runtime_class.to_string(),
                set_as_default: want.toolkit.set_as_default,
                enable_cdi: want.enable_cdi,
                binary_name: host_nvidia_runtime(host),
            };
            let mut p = match containerd::template_for(host, &c.config) {
                Some(template) => containerd::plan_template(host, &opts, version, &template)?,
                None => containerd::plan(host, &opts, version)?,
            };
            if version.is_none() {
                p.notes.push(format!("cannot run {} --version through the host root; planned from the config's shape", c.binary));
            }
            Ok(RuntimePlan {
                runtime,
                changes: p.changes,
                notes: p.notes,
                unit: p.unit,
                no_cdi: p.no_cdi,
            })
        }
        ContainerRuntime::Crio => {
            let opts = crio::Options {
                drop_in: "/etc/crio/crio.conf.d/99-nvidia.conf".into(),
                config: "/etc/crio/crio.conf".into(),
                runtime_name: want.runtime_class.to_string(),
                runtime_path: host_nvidia_runtime(host),
                set_as_default: want.toolkit.set_as_default,
            };
            let changes = crio::plan(host, &opts)?;
            let mut notes = Vec::new();
            if opts.runtime_path.is_none() {
                notes.push("no nvidia-container-runtime on the host: CRI-O injects GPUs through CDI alone (it reads /etc/cdi and /var/run/cdi)".into());
            }
            Ok(RuntimePlan {
                runtime,
                changes,
                notes,
                unit: unit(runtime).into(),
                no_cdi: None,
            })
        }
        ContainerRuntime::Docker => {
            let opts = docker::Options {
                config: "/etc/docker/daemon.json".into(),
                runtime_name: want.runtime_class.to_string(),
                runtime_path: host_nvidia_runtime(host),
                set_as_default: want.toolkit.set_as_default,
                enable_cdi: want.enable_cdi,
            };
            Ok(RuntimePlan {
                runtime,
                changes: docker::plan(host, &opts)?,
                notes: Vec::new(),
                unit: unit(runtime).into(),
                no_cdi: None,
            })
        }
    }
}

/// Writes a plan (under the host-files lock). Returns the host paths that changed.
pub fn apply(
    host: &HostRoot,
    sys: &dyn Syscalls,
    plan: &RuntimePlan,
    wait_for_lock: bool,
) -> Result<Vec<String>, RuntimeError> {
    let files = ManagedFiles::lock(host, sys, wait_for_lock)?;
    let mut changed = Vec::new();
    for c in &plan.changes {
        if files.write(&c.path, c.after.as_bytes(), 0o644)? {
            changed.push(c.path.clone());
        }
    }
    Ok(changed)
}

/// Puts every file gpu-agent changed back as it was.
pub fn restore(
    host: &HostRoot,
    sys: &dyn Syscalls,
    wait_for_lock: bool,
) -> Result<Vec<Restored>, RuntimeError> {
    let files = ManagedFiles::lock(host, sys, wait_for_lock)?;
    Ok(files.restore()?)
}

/// The systemd unit of a runtime.
fn unit(runtime: ContainerRuntime) -> &'static str {
    match runtime {
        ContainerRuntime::Containerd => "containerd",
        ContainerRuntime::Crio => "crio",
        ContainerRuntime::Docker => "docker",
    }
}

/// Makes the runtime read its changed config, as the policy says; returns
/// what was done, in words. Call it only when files changed.
pub fn reload(
    host: &HostRoot,
    runtime: ContainerRuntime,
    unit: &str,
    mode: ReloadMode,
    runner: &dyn CommandRunner,
) -> Result<String, RuntimeError> {
    let name = unit;
    let err = |source| RuntimeError::Reload {
        runtime: name.to_string(),
        source,
    };
    match mode {
        ReloadMode::None => Ok(format!(
            "not reloaded (spec.toolkit.reload is none): restart {name} to apply"
        )),
        ReloadMode::Restart => {
            // On the host's own systemd: through chroot when the host root is not ours.
            let mut argv: Vec<String> = Vec::new();
            if !host.is_system() {
                argv.push("chroot".into());
                argv.push(host.path().display().to_string());
            }
            argv.extend(["systemctl", "restart", name].map(String::from));
            runner.run(&argv).map_err(err)?;
            Ok(format!("restarted {name}"))
        }
        ReloadMode::Signal if runtime == ContainerRuntime::Docker => {
            let pid_file = "/var/run/docker.pid";
            let pid = host
                .read_to_string(pid_file)
                .map_err(RuntimeError::Host)?
                .trim()
                .parse::<u32>()
                .map_err(|_| {
                    RuntimeError::ReloadMode(format!("{pid_file} does not hold a process id"))
                })?;
            runner
                .run(&["kill".into(), "-s".into(), "HUP".into(), pid.to_string()])
                .map_err(err)?;
            Ok(format!(
                "sent SIGHUP to dockerd (pid {pid}) to reload daemon.json"
            ))
        }
        ReloadMode::Signal => Err(RuntimeError::ReloadMode(format!(
            "{name} does not reload its config on a signal; set spec.toolkit.reload to restart or none"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hostlib::command::RecordingRunner;

    #[test]
    fn restart_goes_through_the_hosts_systemd() {
        let dir = tempfile::tempdir().unwrap();
        let host = HostRoot::new(dir.path()).unwrap();
        let r = RecordingRunner::new();
        let said = reload(
            &host,
            ContainerRuntime::Containerd,
            "containerd",
            ReloadMode::Restart,
            &r,
        )
        .unwrap();
        assert_eq!(said, "restarted containerd");
        let root = host.path().display().to_string();
        assert_eq!(
            r.calls(),
            vec![vec![
                "chroot".to_string(),
                root,
                "systemctl".into(),
                "restart".into(),
                "containerd".into()
            ]]
        );
        let r = RecordingRunner::new();
        reload(
            &HostRoot::system(),
            ContainerRuntime::Crio,
            "crio",
            ReloadMode::Restart,
            &r,
        )
        .unwrap();
        assert_eq!(
            r.calls(),
            vec![vec![
                "systemctl".to_string(),
                "restart".into(),
                "crio".into()
            ]]
        );
    }

    #[test]
    fn none_runs_nothing_and_signal_is_docker_only() {
        let r = RecordingRunner::new();
        let said = reload(
            &HostRoot::system(),
            ContainerRuntime::Containerd,
            "containerd",
            ReloadMode::None,
            &r,
        )
        .unwrap();
        assert!(said.contains("restart containerd to apply"));
        assert!(
            reload(
                &HostRoot::system(),
                ContainerRuntime::Containerd,
                "containerd",
                ReloadMode::Signal,
                &r
            )
            .is_err()
        );
        assert!(r.calls().is_empty());
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("var/run")).unwrap();
        std::fs::write(dir.path().join("var/run/docker.pid"), "4242\n").unwrap();
        let host = HostRoot::new(dir.path()).unwrap();
        reload(
            &host,
            ContainerRuntime::Docker,
            "docker",
            ReloadMode::Signal,
            &r,
        )
        .unwrap();
        assert_eq!(
            r.calls(),
            vec![vec![
                "kill".to_string(),
                "-s".into(),
                "HUP".into(),
                "4242".into()
            ]]
        );
    }

    #[test]
    fn a_failed_restart_says_what_the_host_said() {
        let r = RecordingRunner::new();
        r.fail_with("Unit containerd.service not found.");
        let err = reload(
            &HostRoot::system(),
            ContainerRuntime::Containerd,
            "containerd",
            ReloadMode::Restart,
            &r,
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "reloading containerd: `systemctl restart containerd` failed: Unit containerd.service not found."
        );
    }
}
