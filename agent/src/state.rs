//! The running agent's state file, `/run/gpu-agent/state.json` under the
//! host root, and its lock, `/run/gpu-agent/agent.lock`.
//!
//! `run` holds the lock (flock) for as long as it lives and writes the
//! state file when what it says changes: an idle agent writes nothing and
//! wakes for nothing. `status` knows a live agent by the held lock, which
//! works across PID and mount namespaces (a DaemonSet's agent, `status` on
//! the host) and is released by the kernel when the agent dies, however it
//! dies. With `run --heartbeat SECS` the agent also stamps the file's
//! modification time (no data, no fsync) so that `status` can tell a hung
//! agent from a live one.
//!
//! Modes: the directory is made 0700 and both files are 0600, so no other
//! user can read the state or take the lock (a shared `flock` held by
//! anyone who can open the lock file would keep the agent from starting).
//! `status` runs as root, as the agent does; run by another user it cannot
//! read the state and inspects the host instead, saying why.

use std::time::UNIX_EPOCH;

use hostlib::{HostError, HostRoot};
use serde::{Deserialize, Serialize};

use crate::health::GpuHealth;
use crate::inventory::Inventory;
use crate::plugin::manager::ResourceStatus;
use crate::stages::StageStatus;
/// Seconds since the epoch (the model's: the report stamps with it too).
pub use gpu_model::util::now;

/// Where the state file lives, as a host path.
pub const STATE_FILE: &str = "/run/gpu-agent/state.json";
/// The lock a running agent holds, as a host path.
pub const LOCK_FILE: &str = "/run/gpu-agent/agent.lock";
/// The state file's and the lock's mode; their directory's is 0700.
pub const STATE_MODE: u32 = 0o600;
/// The format written; a reader refuses others.
pub const FORMAT: u32 = 1;

/// What the running agent tells `status`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AgentState {
    pub format: u32,
    pub pid: u32,
    pub version: String,
    /// Unix seconds.
    pub started_at: u64,
    /// The last sign of life: when the agent wrote the file, or (as read)
    /// the file's modification time if that is later.
    pub updated_at: u64,
    /// Set when the agent stopped cleanly.
    pub stopped_at: Option<u64>,
    /// How often the file's mtime is stamped (0: never).
    pub heartbeat_secs: u64,
    pub host_root: String,
    pub policy: Option<String>,
    /// The node description, when GPUs are simulated.
    pub simulated: Option<String>,
    pub held_caps: Vec<String>,
    /// Each held capability with the stages that use it, and what was
    /// dropped at start (`run` only; see caps.rs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub privileges: Option<crate::caps::Privileges>,
    pub stages: Vec<StageStatus>,
    pub inventory: Option<Inventory>,
    /// The device plugin's resources: socket, registration, device health.
    #[serde(default)]
    pub plugin: Vec<ResourceStatus>,
    /// Every watched GPU's health.
    #[serde(default)]
    pub health: Vec<GpuHealth>,
    /// The supervised tasks (device plugin, health, kernel log).
    #[serde(default)]
    pub tasks: Vec<TaskStatus>,
    /// Every enabled stage validated (READY for systemd and probes).
    #[serde(default)]
    pub ready: bool,
    /// `spec.reconcileIntervalSeconds` of the running policy.
    #[serde(default)]
    pub reconcile_interval_secs: u64,
    /// The workload check (`spec.validator.workload`), when asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<crate::stages::Validation>,
    /// Why the policy file on disk is not the running policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_error: Option<String>,
    /// The MIG layout (`nvidia.com/mig.config.state`), when one is selected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<crate::mig::MigStatus>,
    /// Where the node stands in the cluster's driver rollout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upgrade: Option<crate::driver::UpgradeStatus>,
    /// The running policy is the cluster's ClusterPolicy (from the
    /// controller), not the file.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub policy_from_cluster: bool,
    /// Keys of that ClusterPolicy gpu-agent does not use.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub policy_ignored: Vec<String>,
    /// The report stream to the cluster controller, when one is configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller: Option<crate::report::ControllerLink>,
    /// The DRA kubelet plugin, while `spec.dra.enabled`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dra: Option<DraStatus>,
}

/// The DRA kubelet plugin as `status` shows it: what is true now.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DraStatus {
    /// The kubelet accepted the plugin.
    pub registered: bool,
    /// The kubelet's verdict in words (`registered`, `refused: …`,
    /// `waiting for the kubelet`, `not serving: …`).
    pub registration: String,
    /// The registration socket the kubelet watches (a host path).
    pub socket: String,
    /// The GPUs DRA hands out, by UUID (or PCI address without one).
    pub gpus: Vec<String>,
    /// `spec.dra.gpus` selectors that name no GPU of this node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unmatched: Vec<String>,
    /// The devices a claim may be prepared with now (`gpu-0`, MIG devices).
    pub devices: Vec<String>,
    /// Claims allocated to this node, as the controller last handed them
    /// over (`None`: no word from a controller yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocations: Option<usize>,
    /// What start-up found of the checkpoint and did, in words.
    pub recovery: String,
    /// The node's claims now.
    pub claims: Vec<DraClaimStatus>,
    /// Why the plugin is not serving, when it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Why claims asking for MPS sharing fail on this node, if they do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps_unavailable: Option<String>,
}

/// One claim on the node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DraClaimStatus {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    /// `preparing` or `prepared`.
    pub state: String,
    pub devices: Vec<String>,
    /// Its MPS control daemon (`starting`, `serving`, `failed: …`), when
    /// the claim shares its GPUs through MPS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps: Option<String>,
}

/// A state file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Host(#[from] HostError),
    #[error("{path}: not a gpu-agent state file: {message}")]
    Parse { path: String, message: String },
}

/// One supervised task, for `status`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskStatus {
    pub name: String,
    pub running: bool,
    /// Times it was started again after failing.
    pub restarts: u32,
    /// Why it last stopped, if it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// Unix seconds of the next start, while waiting to restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_at: Option<u64>,
}

/// Is the agent that wrote the state still there?
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// It holds its lock (and, with a heartbeat, stamped within three).
    Live { age_secs: u64 },
    /// It holds its lock but stopped stamping for three heartbeats: it hangs.
    Hung { age_secs: u64 },
    /// Nobody holds the lock and the agent never said it stopped: it was
    /// killed or crashed.
    Stale { age_secs: u64 },
    /// The agent stopped cleanly.
    Stopped { age_secs: u64 },
    /// Another agent (this pid) holds the lock and has not written its
    /// state yet: the file is a predecessor's.
    Starting { pid: u32 },
}

/// A running agent's hold on [`LOCK_FILE`]; released when dropped or when
/// the process dies.
#[derive(Debug)]
pub struct AgentLock {
    _lock: nix::fcntl::Flock<std::fs::File>,
}

/// Another agent holds the lock, or the lock file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "another gpu-agent is running on this host ({}); stop it first (systemctl stop gpu-agent{})",
        match pid { Some(p) => format!("pid {p} holds {path}"), None => format!("it holds {path}") },
        match pid { Some(p) => format!(", or kill {p}"), None => ", or kill the pid `gpu-agent status` shows".into() }
    )]
    Held { path: String, pid: Option<u32> },
    #[error(transparent)]
    Host(#[from] HostError),
}

impl AgentLock {
    /// Takes the lock, and writes this process's pid into the file. A lock
    /// held only for a moment (`status` looking) is waited for, up to half a
    /// second; an agent that holds it is not.
    ///
    /// The directory is made (0700) and opened in the host root, and the
    /// lock file opened relative to it, never through a link (see
    /// [`private_dir`]).
    pub fn take(host: &HostRoot) -> Result<Self, LockError> {
        use nix::fcntl::{Flock, FlockArg, OFlag};
        use std::io::{Seek, Write};
        use std::os::unix::fs::PermissionsExt;
        let lock_path = std::path::Path::new(LOCK_FILE);
        let (dir, dir_path) = private_dir(
            host,
            lock_path.parent().and_then(|p| p.to_str()).unwrap_or("/"),
        )?;
        let name = lock_path.file_name().expect("LOCK_FILE names a file");
        let path = dir_path.join(name);
        let io = |e| HostError::io(&path, e);
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(500);
        let mut lock = loop {
            let file = nix::fcntl::openat(
                &dir,
                name,
                OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                nix::sys::stat::Mode::from_bits_truncate(STATE_MODE),
            )
            .map(std::fs::File::from)
            .map_err(|e| io(e.into()))?;
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(lock) => break lock,
                Err((_, nix::errno::Errno::EWOULDBLOCK))
                    if std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
                    return Err(LockError::Held {
                        path: path.display().to_string(),
                        // The holder writes its pid once it has the lock.
                        pid: agent_running(host).filter(|p| *p != 0),
                    });
                }
                Err((_, errno)) => return Err(io(std::io::Error::from(errno)).into()),
            }
        };
        // Root's alone (a lock file of an older agent may be wider); it
        // says who holds it.
        lock.set_permissions(std::fs::Permissions::from_mode(STATE_MODE))
            .map_err(io)?;
        lock.set_len(0).map_err(io)?;
        lock.rewind().map_err(io)?;
        writeln!(lock, "{}", std::process::id()).map_err(io)?;
        Ok(AgentLock { _lock: lock })
    }
}

/// Makes the agent's own directory `host_path` (a host path) with mode
/// 0700 and opens it: its parent opened (made as usual when missing) in
/// the host root ([`HostRoot::dir`]), the directory made with `mkdirat`
/// in it and opened without following a link (a link there is an error
/// naming it). One that exists, owned by this user with group or other
/// bits (made by an older agent, or by a command before the agent ran), is
/// narrowed to 0700 through that descriptor. Returns the descriptor and
/// the path it is at, for messages.
pub fn private_dir(
    host: &HostRoot,
    host_path: &str,
) -> Result<(std::os::fd::OwnedFd, std::path::PathBuf), HostError> {
    use nix::fcntl::OFlag;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let asked = std::path::Path::new(host_path);
    let (Some(parent), Some(name)) = (asked.parent(), asked.file_name()) else {
        return Err(HostError::io(
            asked,
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a directory in a directory",
            ),
        ));
    };
    let parent = host.dir(parent, true)?;
    let dir = parent.path().join(name);
    let io = |e| HostError::io(&dir, e);
    let made = match nix::sys::stat::mkdirat(
        parent.fd(),
        name,
        nix::sys::stat::Mode::from_bits_truncate(0o700),
    ) {
        Ok(()) => true,
        Err(nix::errno::Errno::EEXIST) => false,
        Err(e) => return Err(io(e.into())),
    };
    let fd = nix::fcntl::openat(
        parent.fd(),
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| io(e.into()))?;
    if made {
        return Ok((fd, dir));
    }
    let f = std::fs::File::from(fd);
    let meta = f.metadata().map_err(io)?;
    let mode = meta.mode() & 0o7777;
    if meta.uid() == nix::unistd::geteuid().as_raw() && mode & 0o077 != 0 {
        f.set_permissions(std::fs::Permissions::from_mode(0o700))
            .map_err(io)?;
        tracing::info!(path = %dir.display(), was = format!("{mode:o}"), "narrowed the agent's directory to 0700");
    }
    Ok((f.into(), dir))
}

/// The pid written by the live agent that holds the lock on this host
/// (0 when it wrote none), or `None` when no agent holds it. The pid is
/// read from the file the lock was tried on.
pub fn agent_running(host: &HostRoot) -> Option<u32> {
    use nix::fcntl::{Flock, FlockArg};
    use std::io::Read;
    let file = host.open(LOCK_FILE).ok()?;
    match Flock::lock(file, FlockArg::LockSharedNonblock) {
        Err((mut file, nix::errno::Errno::EWOULDBLOCK)) => {
            let mut text = String::new();
            Some(
                file.read_to_string(&mut text)
                    .ok()
                    .and_then(|_| text.trim().parse().ok())
                    .unwrap_or(0),
            )
        }
        _ => None,
    }
}

impl AgentState {
    /// A fresh state for this process, started now.
    pub fn new(host_root: &HostRoot, heartbeat_secs: u64, held_caps: Vec<String>) -> Self {
        let now = now();
        AgentState {
            format: FORMAT,
            pid: std::process::id(),
            version: env!("CARGO_PKG_VERSION").into(),
            started_at: now,
            updated_at: now,
            stopped_at: None,
            heartbeat_secs,
            host_root: host_root.path().display().to_string(),
            policy: None,
            simulated: None,
            held_caps,
            privileges: None,
            stages: Vec::new(),
            inventory: None,
            plugin: Vec::new(),
            health: Vec::new(),
            tasks: Vec::new(),
            ready: false,
            reconcile_interval_secs: 0,
            workload: None,
            policy_error: None,
            mig: None,
            upgrade: None,
            policy_from_cluster: false,
            policy_ignored: Vec::new(),
            controller: None,
            dra: None,
        }
    }

    /// Whether the agent that wrote this state is there at `now`; `holder`:
    /// the pid of the live agent holding the lock ([`agent_running`]).
    pub fn liveness(&self, now: u64, holder: Option<u32>) -> Liveness {
        let age_secs = now.saturating_sub(self.updated_at);
        match holder {
            Some(pid) if pid != self.pid && pid != 0 => Liveness::Starting { pid },
            Some(_) if self.heartbeat_secs > 0 && age_secs > 3 * self.heartbeat_secs => {
                Liveness::Hung { age_secs }
            }
            Some(_) => Liveness::Live { age_secs },
            None => match self.stopped_at {
                Some(at) => Liveness::Stopped {
                    age_secs: now.saturating_sub(at),
                },
                None => Liveness::Stale { age_secs },
            },
        }
    }

    /// Writes the state atomically, mode 0600 (see the module docs).
    pub fn write(&self, host: &HostRoot) -> Result<(), HostError> {
        let json = serde_json::to_vec_pretty(self).expect("state serialises");
        host.write_atomic(STATE_FILE, &json, STATE_MODE)?;
        Ok(())
    }

    /// Reads the state file, or `None` when there is none.
    pub fn read(host: &HostRoot) -> Result<Option<Self>, StateError> {
        use std::io::Read;
        // Read and stamped through one descriptor: the file as it was opened.
        let mut file = match host.open(STATE_FILE) {
            Ok(f) => f,
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let real = host.resolve(STATE_FILE)?;
        let mut text = String::new();
        file.read_to_string(&mut text)
            .map_err(|e| HostError::io(&real, e))?;
        let path = real.display().to_string();
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| StateError::Parse {
                path: path.clone(),
                message: e.to_string(),
            })?;
        let format = value.get("format").and_then(|f| f.as_u64());
        if format != Some(u64::from(FORMAT)) {
            return Err(StateError::Parse {
                path,
                message: format!("format {format:?}, this gpu-agent reads format {FORMAT}"),
            });
        }
        let mut st: AgentState = serde_json::from_value(value).map_err(|e| StateError::Parse {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let stamped = file
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs());
        st.updated_at = st.updated_at.max(stamped);
        Ok(Some(st))
    }
}

/// Writes the state file only when its content changes.
#[derive(Debug, Default)]
pub struct StateFile {
    /// What was last written, `updated_at` left out.
    last: Option<Vec<u8>>,
}

impl StateFile {
    /// Writes `st` (with `updated_at` now) when it says something new and
    /// returns true.
    pub fn sync(&mut self, st: &mut AgentState, host: &HostRoot) -> Result<bool, HostError> {
        let at = std::mem::replace(&mut st.updated_at, 0);
        let body = serde_json::to_vec(st).expect("state serialises");
        st.updated_at = at;
        if self.last.as_ref() == Some(&body) {
            return Ok(false);
        }
        st.updated_at = now();
        st.write(host)?;
        self.last = Some(body);
        Ok(true)
    }

    /// A sign of life: the file's mtime set to now; no data written, no
    /// fsync, nothing serialised (once a state was written).
    pub fn stamp(&self, host: &HostRoot) -> Result<(), HostError> {
        if self.last.is_some() {
            host.touch(STATE_FILE)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn sample() -> AgentState {
        AgentState {
            format: FORMAT,
            pid: 42,
            version: "0.1.0".into(),
            started_at: 1000,
            updated_at: 1000,
            stopped_at: None,
            heartbeat_secs: 10,
            host_root: "/".into(),
            policy: None,
            simulated: None,
            held_caps: vec![],
            privileges: None,
            stages: vec![],
            inventory: None,
            plugin: vec![],
            health: vec![],
            tasks: vec![],
            ready: false,
            reconcile_interval_secs: 0,
            workload: None,
            policy_error: None,
            mig: None,
            upgrade: None,
            policy_from_cluster: false,
            policy_ignored: Vec::new(),
            controller: None,
            dra: None,
        }
    }

    #[test]
    fn liveness_by_lock_and_heartbeat() {
        let mut s = sample();
        let me = Some(42);
        assert_eq!(s.liveness(1030, me), Liveness::Live { age_secs: 30 });
        assert_eq!(s.liveness(1031, me), Liveness::Hung { age_secs: 31 });
        assert_eq!(s.liveness(1031, None), Liveness::Stale { age_secs: 31 });
        assert_eq!(
            s.liveness(1031, Some(77)),
            Liveness::Starting { pid: 77 },
            "the lock holder is another agent: the file is its predecessor's"
        );
        s.heartbeat_secs = 0;
        assert_eq!(
            s.liveness(999_999, me),
            Liveness::Live { age_secs: 998_999 },
            "without stamps, the lock alone says it lives"
        );
        s.stopped_at = Some(1005);
        assert_eq!(s.liveness(1031, None), Liveness::Stopped { age_secs: 26 });
        assert_eq!(s.liveness(1031, Some(77)), Liveness::Starting { pid: 77 });
    }

    #[test]
    fn the_lock_is_held_once_and_seen_by_others() {
        let dir = tempfile::tempdir().unwrap();
        let host = HostRoot::new(dir.path()).unwrap();
        assert_eq!(agent_running(&host), None);
        let lock = AgentLock::take(&host).unwrap();
        assert_eq!(agent_running(&host), Some(std::process::id()));
        let err = AgentLock::take(&host).unwrap_err().to_string();
        let me = std::process::id();
        assert_eq!(
            err,
            format!(
                "another gpu-agent is running on this host (pid {me} holds {}/run/gpu-agent/agent.lock); stop it first (systemctl stop gpu-agent, or kill {me})",
                dir.path().display()
            )
        );
        drop(lock);
        assert_eq!(agent_running(&host), None);
        assert!(AgentLock::take(&host).is_ok());
    }

    #[test]
    fn the_agents_directory_is_private_and_never_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let host = HostRoot::new(dir.path()).unwrap();
        let run = host.resolve("/run/gpu-agent").unwrap();
        let lock = AgentLock::take(&host).unwrap();
        let mode =
            |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&run), 0o700);
        assert_eq!(mode(&run.join("agent.lock")), 0o600);
        drop(lock);
        // An older agent's wider directory and lock are narrowed.
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(
            run.join("agent.lock"),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        let lock = AgentLock::take(&host).unwrap();
        assert_eq!(mode(&run), 0o700);
        assert_eq!(mode(&run.join("agent.lock")), 0o600);
        drop(lock);
        // A link in the directory's place (out of the root) is refused,
        // naming it; nothing is made where it points.
        let outside = tempfile::tempdir().unwrap();
        std::fs::remove_dir_all(&run).unwrap();
        std::os::unix::fs::symlink(outside.path(), &run).unwrap();
        let err = AgentLock::take(&host).unwrap_err().to_string();
        assert!(err.contains("run/gpu-agent"), "{err}");
        assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
        assert_eq!(agent_running(&host), None);
    }

    #[test]
    fn written_only_when_changed_and_stamped_otherwise() {
        let dir = tempfile::tempdir().unwrap();
        let host = HostRoot::new(dir.path()).unwrap();
        let path = host.resolve(STATE_FILE).unwrap();
        let mut file = StateFile::default();
        let mut st = sample();
        assert!(file.sync(&mut st, &host).unwrap());
        let written = std::fs::read(&path).unwrap();
        let ino = std::fs::metadata(&path).unwrap().ino();
        // Unchanged: same bytes, same inode (no rename), only the mtime moves.
        let old = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000);
        std::fs::File::open(&path)
            .unwrap()
            .set_modified(old)
            .unwrap();
        assert!(!file.sync(&mut st, &host).unwrap());
        file.stamp(&host).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), written);
        assert_eq!(std::fs::metadata(&path).unwrap().ino(), ino);
        let read = AgentState::read(&host).unwrap().unwrap();
        assert!(
            read.updated_at >= now() - 5,
            "the stamp counts as a sign of life"
        );
        // Changed: written anew.
        st.stages.push(crate::stages::StageStatus::new(
            crate::stages::Stage::Discover,
            crate::stages::StageState::Done,
            "8 GPUs".into(),
        ));
        assert!(file.sync(&mut st, &host).unwrap());
        assert_ne!(std::fs::read(&path).unwrap(), written);
    }

    #[test]
    fn round_trip_and_bad_files() {
        let dir = tempfile::tempdir().unwrap();
        let host = HostRoot::new(dir.path()).unwrap();
        assert_eq!(AgentState::read(&host).unwrap(), None);
        sample().write(&host).unwrap();
        let mut got = AgentState::read(&host).unwrap().unwrap();
        assert!(
            got.updated_at >= now() - 5,
            "the file's mtime is the later sign of life"
        );
        got.updated_at = 1000;
        assert_eq!(got, sample());
        host.write_atomic(STATE_FILE, b"{\"format\": 9}", 0o644)
            .unwrap();
        let err = AgentState::read(&host).unwrap_err().to_string();
        assert!(
            err.contains("run/gpu-agent/state.json") && err.contains("format Some(9)"),
            "{err}"
        );
        host.write_atomic(STATE_FILE, b"not json", 0o644).unwrap();
        assert!(AgentState::read(&host).is_err());
    }
}
