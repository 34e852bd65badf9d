//! The policy's section the MIG front end owns: `spec.migManager`. The
//! agent's policy assembles it (and checks it against the layouts).

use gpu_model::config::ConfigSource;
use serde::{Deserialize, Serialize};

use crate::config::MigPartedConfig;

fn yes() -> bool {
    true
}

/// `spec.migManager`: MIG layouts in mig-parted's format.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MigManagerSpec {
    #[serde(default = "yes")]
    pub enabled: bool,
    /// The layouts (ClusterPolicy's `config.name`/`config.default`, plus
    /// the config itself from a `file` or `inline`; default: gpu-agent's
    /// built-in layouts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<MigManagerConfig>,
    /// The layout to apply, by name; unset (and no `config.default`): MIG
    /// is left as it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
    /// Reboot the node when only a reboot can apply a MIG mode change
    /// (mig-manager's `WITH_REBOOT`). Default false: the state says so.
    #[serde(default)]
    pub reboot: bool,
    /// How long to wait for processes using a GPU whose layout changes.
    #[serde(default = "default_gpu_clients_timeout")]
    pub gpu_clients_timeout_seconds: u64,
}

fn default_gpu_clients_timeout() -> u64 {
    300
}

impl Default for MigManagerSpec {
    fn default() -> Self {
        MigManagerSpec {
            enabled: true,
            config: None,
            default: None,
            reboot: false,
            gpu_clients_timeout_seconds: default_gpu_clients_timeout(),
        }
    }
}

impl MigManagerSpec {
    /// The layout selected: `default`, else ClusterPolicy's `config.default`
    /// (whose `""`, as the operator's CRD allows, selects none).
    pub fn selected_layout(&self) -> Option<&str> {
        self.default.as_deref().or_else(|| self.config_default())
    }

    /// `config.default`, `""` meaning unset.
    pub fn config_default(&self) -> Option<&str> {
        self.config
            .as_ref()
            .and_then(|c| c.default.as_deref())
            .filter(|d| !d.is_empty())
    }
}

/// `spec.migManager.config`: mig-parted's layouts.
pub type MigManagerConfig = ConfigSource<MigPartedConfig>;
