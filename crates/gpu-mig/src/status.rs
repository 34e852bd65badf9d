//! Where the node's MIG layout stands, as the state file, `status` and the
//! report say it: the operator's `nvidia.com/mig.config.state` values.

use serde::{Deserialize, Serialize};

/// The operator's `nvidia.com/mig.config.state` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MigConfigState {
    Pending,
    Rebooting,
    Success,
    Failed,
}

impl MigConfigState {
    pub fn as_str(self) -> &'static str {
        match self {
            MigConfigState::Pending => "pending",
            MigConfigState::Rebooting => "rebooting",
            MigConfigState::Success => "success",
            MigConfigState::Failed => "failed",
        }
    }
}

/// Where the node's MIG layout stands (state file, `status`, the report).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigStatus {
    /// The selected layout.
    pub layout: String,
    pub state: MigConfigState,
    pub detail: String,
    /// Unix seconds of the last change of `state`.
    pub since: u64,
}
