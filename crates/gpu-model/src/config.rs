//! The shape ClusterPolicy gives a front end's config (the device plugin's,
//! the MIG manager's).

use serde::{Deserialize, Serialize};

/// A config section as ClusterPolicy has it (`spec.devicePlugin.config`,
/// `spec.migManager.config`): the ConfigMap's name and the entry used by
/// default, plus the config itself, from a `file` or `inline`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    deny_unknown_fields,
    rename_all = "camelCase",
    bound(deserialize = "T: Deserialize<'de>")
)]
pub struct ConfigSource<T> {
    /// The ConfigMap name (in Kubernetes) holding the configs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The entry used when the node's label does not name one (the
    /// device-plugin config; the MIG layout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
    /// A config file in NVIDIA's schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<std::path::PathBuf>,
    /// The same config, inline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inline: Option<T>,
}

impl<T> Default for ConfigSource<T> {
    fn default() -> Self {
        ConfigSource {
            name: None,
            default: None,
            file: None,
            inline: None,
        }
    }
}
