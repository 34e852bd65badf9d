//! What a stage came to ([`StageState`], [`StageStatus`]) and what a pass
//! produced ([`Pass`]): plain data, below every stage.

use serde::{Deserialize, Serialize};

use super::stage::Stage;
use crate::inventory::Inventory;
use crate::plugin::resources::{PluginSettings, Resource};

/// Where a stage stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StageState {
    Done,
    /// Worked out, but it takes a running agent to carry out (e.g. the
    /// device plugin's resources when `status` inspects the host).
    Ready,
    Failed,
    /// A needed capability is missing.
    Blocked,
    /// Waiting on an earlier stage that failed or is blocked.
    Waiting,
    /// Turned off by the policy.
    Disabled,
    /// Not built yet.
    NotImplemented,
}

impl StageState {
    pub fn label(self) -> &'static str {
        match self {
            StageState::Done => "done",
            StageState::Ready => "ready",
            StageState::Failed => "failed",
            StageState::Blocked => "blocked",
            StageState::Waiting => "waiting",
            StageState::Disabled => "disabled",
            StageState::NotImplemented => "not implemented",
        }
    }
}

/// One stage's status, as `gpu-agent status` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageStatus {
    pub stage: Stage,
    pub state: StageState,
    /// One line saying why, or what was done.
    pub detail: String,
    /// Capabilities the stage needs.
    pub needs: Vec<String>,
    /// Of those, the ones this process does not hold.
    pub missing: Vec<String>,
    /// What this stage changed on the host in its last pass.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changed: Vec<String>,
    /// Drift repaired by reconciles since the agent started.
    #[serde(default)]
    pub repairs: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_repair: Option<Repair>,
    /// The stage's last validation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation: Option<Validation>,
}

impl StageStatus {
    pub fn new(stage: Stage, state: StageState, detail: String) -> Self {
        StageStatus {
            stage,
            state,
            detail,
            needs: Vec::new(),
            missing: Vec::new(),
            changed: Vec::new(),
            repairs: 0,
            last_repair: None,
            validation: None,
        }
    }
}

/// One repair: drift a reconcile found and put right.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Repair {
    /// Unix seconds.
    pub at: u64,
    pub what: String,
}

/// A stage's validation: in-process checks of what the stage set up.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Validation {
    pub ok: bool,
    /// What was checked, or what failed.
    pub detail: String,
    /// Unix seconds since which the result is the same.
    pub since: u64,
}

/// What one pass produced.
#[derive(Debug)]
pub struct Pass {
    pub stages: Vec<StageStatus>,
    pub inventory: Option<Inventory>,
    /// The device plugin's resources, for `run` to serve.
    pub plugin: Option<PluginPlan>,
    /// Stages left for [`run_deferred`] (with `serve_first`).
    pub deferred: Vec<Stage>,
    /// The MIG layout's state, when one is selected.
    pub mig: Option<crate::mig::MigStatus>,
}

/// What the device plugin will advertise.
#[derive(Debug, Clone)]
pub struct PluginPlan {
    pub settings: PluginSettings,
    pub resources: Vec<Resource>,
}

impl PluginPlan {
    /// `nvidia.com/gpu: 8 device(s)`, or that there is nothing to advertise.
    pub fn summary(&self) -> String {
        if self.resources.is_empty() {
            return "no devices to advertise".into();
        }
        self.resources
            .iter()
            .map(|r| format!("{}: {} device(s)", r.name, r.devices.len()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl Pass {
    /// True when no stage failed.
    pub fn ok(&self) -> bool {
        !self.stages.iter().any(|s| s.state == StageState::Failed)
    }
}
