//! The resources a node advertises, which the device plugin serves and the
//! labels describe: NVIDIA's device-plugin config ([`config`], with the
//! policy's `spec.devicePlugin` and `spec.mig` sections), sharing
//! (time-slicing, MPS), MIG strategies, and from them and the inventory the
//! resource list ([`resources`]). [`settings`] puts the policy's keys and the
//! config's flags together.

pub mod config;
pub mod resources;

#[cfg(test)]
use gpu_backend::test_support;

use hostlib::strict::YamlError;

use config::{DevicePluginSpec, MigStrategy, PluginConfig};
use resources::PluginSettings;

/// The device-plugin config named by the policy cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error(
        "{path}: cannot read the device-plugin config (spec.devicePlugin.config.file): {source}"
    )]
    Read {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Invalid(#[from] YamlError),
}

/// The device plugin's effective settings: the policy's `spec.devicePlugin`
/// keys, then the config's `flags.plugin`, then the defaults. The MIG
/// strategy is the policy's `spec.mig.strategy`, else the config's
/// `flags.migStrategy`, else `single`.
pub fn settings(
    dp: &DevicePluginSpec,
    mig_strategy: Option<MigStrategy>,
) -> Result<PluginSettings, SettingsError> {
    let config: Option<PluginConfig> = match dp.config.as_ref() {
        Some(c) if c.file.is_some() => {
            let path = c.file.clone().expect("checked");
            let text = std::fs::read_to_string(&path).map_err(|source| SettingsError::Read {
                path: path.clone(),
                source,
            })?;
            Some(PluginConfig::from_yaml(&text, &path.display().to_string())?)
        }
        Some(c) => c.inline.clone(),
        None => None,
    };
    let flags = config
        .as_ref()
        .and_then(|c| c.flags.plugin.clone())
        .unwrap_or_default();
    let d = PluginSettings::default();
    let mut unacted = config
        .as_ref()
        .map(PluginConfig::not_acted_on)
        .unwrap_or_default();
    let config_mig = config.as_ref().and_then(|c| c.flags.mig_strategy);
    if let (Some(policy), Some(file)) = (mig_strategy, config_mig)
        && policy != file
    {
        unacted.push(config::Unacted {
            key: "flags.migStrategy".into(),
            warn: false,
            why: format!(
                "{}: the policy's spec.mig.strategy ({}) wins, as the operator's MIG_STRATEGY does",
                file.as_str(),
                policy.as_str()
            ),
        });
    }
    Ok(PluginSettings {
        mig_strategy: mig_strategy.or(config_mig).unwrap_or_default(),
        unacted,
        list_strategies: dp
            .device_list_strategy
            .as_ref()
            .or(flags.device_list_strategy.as_ref())
            .map_or(d.list_strategies, |s| s.to_vec()),
        id_strategy: dp
            .device_id_strategy
            .or(flags.device_id_strategy)
            .unwrap_or(d.id_strategy),
        pass_device_specs: dp
            .pass_device_specs
            .or(flags.pass_device_specs)
            .unwrap_or(d.pass_device_specs),
        cdi_annotation_prefix: dp
            .cdi_annotation_prefix
            .clone()
            .or(flags.cdi_annotation_prefix)
            .unwrap_or(d.cdi_annotation_prefix),
        allocation_policy: dp
            .shared_devices_allocation_policy
            .or(flags.shared_devices_allocation_policy)
            .unwrap_or(d.allocation_policy),
        mps_root: config
            .as_ref()
            .and_then(|c| c.flags.mps_root.clone())
            .unwrap_or(d.mps_root),
        mps: config.as_ref().and_then(|c| c.sharing.mps.clone()),
        time_slicing: config.and_then(|c| c.sharing.time_slicing),
    })
}
