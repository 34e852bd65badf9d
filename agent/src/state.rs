//! The running agent's state file, `/run/gpu-agent/state.json` under the
//! host root. `run` writes it after every pass and refreshes it every
//! heartbeat; `status` reads it, and knows a stale file from a live one by
//! its age (which works across PID namespaces, unlike a PID check).

use std::time::{SystemTime, UNIX_EPOCH};

use hostlib::{HostError, HostRoot};
use serde::{Deserialize, Serialize};

use crate::health::GpuHealth;
use crate::inventory::Inventory;
use crate::plugin::manager::ResourceStatus;
use crate::stages::StageStatus;

/// Where the state file lives, as a host path.
pub const STATE_FILE: &str = "/run/gpu-agent/state.json";
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
    pub updated_at: u64,
    /// Set when the agent stopped cleanly.
    pub stopped_at: Option<u64>,
    /// How often `updated_at` is refreshed.
    pub heartbeat_secs: u64,
    pub host_root: String,
    pub policy: Option<String>,
    /// The node description, when GPUs are simulated.
    pub simulated: Option<String>,
    pub held_caps: Vec<String>,
    pub stages: Vec<StageStatus>,
    pub inventory: Option<Inventory>,
    /// The device plugin's resources: socket, registration, device health.
    #[serde(default)]
    pub plugin: Vec<ResourceStatus>,
    /// Every watched GPU's health.
    #[serde(default)]
    pub health: Vec<GpuHealth>,
}

/// A state file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Host(#[from] HostError),
    #[error("{path}: not a gpu-agent state file: {message}")]
    Parse { path: String, message: String },
}

/// Seconds since the epoch.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Is the agent that wrote the state still there?
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// Updated within three heartbeats.
    Live { age_secs: u64 },
    /// Not updated for longer: the agent died or hangs.
    Stale { age_secs: u64 },
    /// The agent stopped cleanly.
    Stopped { age_secs: u64 },
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
            stages: Vec::new(),
            inventory: None,
            plugin: Vec::new(),
            health: Vec::new(),
        }
    }

    /// How fresh the state is at `now`.
    pub fn liveness(&self, now: u64) -> Liveness {
        if let Some(at) = self.stopped_at {
            return Liveness::Stopped {
                age_secs: now.saturating_sub(at),
            };
        }
        let age_secs = now.saturating_sub(self.updated_at);
        if age_secs <= 3 * self.heartbeat_secs.max(1) {
            Liveness::Live { age_secs }
        } else {
            Liveness::Stale { age_secs }
        }
    }

    /// Writes the state atomically (mode 0644: status runs unprivileged).
    pub fn write(&self, host: &HostRoot) -> Result<(), HostError> {
        let json = serde_json::to_vec_pretty(self).expect("state serialises");
        host.write_atomic(STATE_FILE, &json, 0o644)?;
        Ok(())
    }

    /// Reads the state file, or `None` when there is none.
    pub fn read(host: &HostRoot) -> Result<Option<Self>, StateError> {
        let Some(text) = host.read_optional(STATE_FILE)? else {
            return Ok(None);
        };
        let path = host.resolve(STATE_FILE)?.display().to_string();
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
        serde_json::from_value(value)
            .map(Some)
            .map_err(|e| StateError::Parse {
                path,
                message: e.to_string(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            stages: vec![],
            inventory: None,
            plugin: vec![],
            health: vec![],
        }
    }

    #[test]
    fn liveness_by_age() {
        let mut s = sample();
        assert_eq!(s.liveness(1030), Liveness::Live { age_secs: 30 });
        assert_eq!(s.liveness(1031), Liveness::Stale { age_secs: 31 });
        s.stopped_at = Some(1005);
        assert_eq!(s.liveness(1031), Liveness::Stopped { age_secs: 26 });
    }

    #[test]
    fn round_trip_and_bad_files() {
        let dir = tempfile::tempdir().unwrap();
        let host = HostRoot::new(dir.path()).unwrap();
        assert_eq!(AgentState::read(&host).unwrap(), None);
        sample().write(&host).unwrap();
        assert_eq!(AgentState::read(&host).unwrap(), Some(sample()));
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
