//! The policy's sections the container runtime front end owns:
//! `spec.toolkit` ([`ToolkitSpec`]) and the runtime `spec.operator` names
//! ([`ContainerRuntime`]). The agent's policy assembles them.

use serde::{Deserialize, Serialize};

fn yes() -> bool {
    true
}

/// `spec.toolkit`: the container runtime's configuration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ToolkitSpec {
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Make the `nvidia` runtime the container runtime's default.
    #[serde(default)]
    pub set_as_default: bool,
    /// How the runtime picks up a changed config: `restart` (systemd,
    /// default), `signal` (Docker only: SIGHUP reloads daemon.json), `none`.
    /// Only ever when its config actually changed.
    #[serde(default)]
    pub reload: ReloadMode,
    #[serde(default)]
    pub containerd: ContainerdSpec,
}

/// `spec.toolkit.reload`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReloadMode {
    #[default]
    Restart,
    Signal,
    None,
}

impl Default for ToolkitSpec {
    fn default() -> Self {
        ToolkitSpec {
            enabled: true,
            set_as_default: false,
            reload: ReloadMode::default(),
            containerd: ContainerdSpec::default(),
        }
    }
}

/// `spec.toolkit.containerd`: where containerd's files are (host paths).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ContainerdSpec {
    /// The main config (`/etc/containerd/config.toml`; RKE2/k3s keep theirs elsewhere).
    #[serde(default = "default_containerd_config")]
    pub config: String,
    /// Where the drop-in goes on containerd ≥ 2.1 (`/etc/containerd/conf.d`).
    #[serde(default = "default_containerd_drop_in")]
    pub drop_in_dir: String,
    /// The containerd binary asked for its version (`/usr/bin/containerd`).
    #[serde(default = "default_containerd_binary")]
    pub binary: String,
}

fn default_containerd_config() -> String {
    "/etc/containerd/config.toml".into()
}

fn default_containerd_drop_in() -> String {
    "/etc/containerd/conf.d".into()
}

fn default_containerd_binary() -> String {
    "/usr/bin/containerd".into()
}

impl Default for ContainerdSpec {
    fn default() -> Self {
        ContainerdSpec {
            config: default_containerd_config(),
            drop_in_dir: default_containerd_drop_in(),
            binary: default_containerd_binary(),
        }
    }
}

/// `spec.operator.defaultRuntime`: the container runtime to configure.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ContainerRuntime {
    #[default]
    Containerd,
    Crio,
    Docker,
}
