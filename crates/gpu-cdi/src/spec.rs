//! The policy's section the CDI front end owns: `spec.cdi`. The agent's
//! policy assembles it.

use serde::{Deserialize, Serialize};

fn yes() -> bool {
    true
}

/// `spec.cdi`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CdiSpec {
    /// Write CDI specs and enable CDI in the runtime (default true: gpu-agent
    /// injects GPUs through CDI, so no NVIDIA toolkit is needed on the host).
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Make CDI the `nvidia` runtime's default injection mode.
    #[serde(default)]
    pub default: bool,
    /// Where the spec is written (a host path): `/var/run/cdi` (default,
    /// gone at reboot and rewritten at start) or `/etc/cdi`.
    #[serde(default = "default_spec_dir")]
    pub spec_dir: String,
    /// The program the spec's hooks run (a host path). Default: gpu-agent
    /// installs a copy of itself there, so the hooks work when the agent
    /// runs in a container too.
    #[serde(default = "default_hook_path")]
    pub hook_path: String,
}

fn default_spec_dir() -> String {
    "/var/run/cdi".into()
}

/// Where gpu-agent installs the copy of itself that CDI hooks run.
pub const INSTALLED_HOOK_PATH: &str = "/var/lib/gpu-agent/bin/gpu-agent";

fn default_hook_path() -> String {
    INSTALLED_HOOK_PATH.into()
}

impl Default for CdiSpec {
    fn default() -> Self {
        CdiSpec {
            enabled: true,
            default: false,
            spec_dir: default_spec_dir(),
            hook_path: default_hook_path(),
        }
    }
}
