//! The kubelet device plugin (API v1beta1): one gRPC server per resource on
//! its own Unix socket, registered with the kubelet and re-registered when
//! the kubelet restarts.

pub mod allocate;
pub mod config;
pub mod kubelet;
pub mod manager;
pub mod mps;
pub mod preferred;
pub mod resources;
pub mod server;
pub mod socket;

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

#[cfg(test)]
mod settings_tests {
    use super::*;
    use crate::plugin::config::{DeviceIdStrategy, DeviceListStrategy};
    use crate::policy::Policy;

    #[test]
    fn policy_keys_win_over_config_flags() {
        let p = Policy::from_yaml(
            "spec:\n  devicePlugin:\n    deviceIdStrategy: index\n    config:\n      inline:\n        version: v1\n        flags:\n          plugin:\n            deviceIdStrategy: uuid\n            deviceListStrategy: [cdi-cri]\n            passDeviceSpecs: true\n        sharing:\n          timeSlicing:\n            resources:\n            - {name: nvidia.com/gpu, replicas: 4}\n",
            "p",
        )
        .unwrap();
        let s = settings(&p.device_plugin, p.mig.strategy).unwrap();
        assert_eq!(s.id_strategy, DeviceIdStrategy::Index);
        assert_eq!(s.list_strategies, [DeviceListStrategy::CdiCri]);
        assert!(s.pass_device_specs);
        assert_eq!(s.time_slicing.unwrap().resources[0].replicas, 4);
    }

    #[test]
    fn config_file_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("dp.yaml");
        std::fs::write(&f, "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 1}\n").unwrap();
        let p = Policy::from_yaml(
            &format!(
                "spec:\n  devicePlugin:\n    config:\n      file: {}\n",
                f.display()
            ),
            "p",
        )
        .unwrap();
        let err = settings(&p.device_plugin, p.mig.strategy)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("dp.yaml: sharing.timeSlicing.resources[0].replicas"),
            "{err}"
        );
        let p = Policy::from_yaml(
            "spec:\n  devicePlugin:\n    config:\n      file: /nonexistent/dp.yaml\n",
            "p",
        )
        .unwrap();
        assert!(
            settings(&p.device_plugin, p.mig.strategy)
                .unwrap_err()
                .to_string()
                .starts_with("/nonexistent/dp.yaml: cannot read")
        );
    }

    #[test]
    fn inline_config_errors_carry_the_policy_path() {
        let err = Policy::from_yaml(
            "spec:\n  devicePlugin:\n    config:\n      inline:\n        version: v1\n        sharing:\n          mps:\n            resources:\n            - {name: nvidia.com/gpu, replicas: 1}\n",
            "p.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with(
                "p.yaml: spec.devicePlugin.config.inline.sharing.mps.resources[0].replicas: 1 replicas"
            ),
            "{err}"
        );
    }

    #[test]
    fn mps_settings_come_from_the_config() {
        let p = Policy::from_yaml(
            "spec:\n  devicePlugin:\n    config:\n      inline:\n        version: v1\n        flags:\n          mpsRoot: /var/run/nvidia-mps\n        sharing:\n          mps:\n            resources:\n            - {name: nvidia.com/gpu, replicas: 3}\n",
            "p",
        )
        .unwrap();
        let s = settings(&p.device_plugin, p.mig.strategy).unwrap();
        assert!(s.time_slicing.is_none());
        assert_eq!(s.mps.as_ref().unwrap().resources[0].replicas, 3);
        assert_eq!(s.mps_root, "/var/run/nvidia-mps");
        let (strategy, spec) = s.sharing().unwrap();
        assert_eq!(strategy, crate::plugin::config::SharingStrategy::Mps);
        assert_eq!(spec.resources.len(), 1);
        // Without the flag, NVIDIA's operator default.
        let d = settings(&Policy::default().device_plugin, None).unwrap();
        assert_eq!(d.mps_root, crate::plugin::resources::DEFAULT_MPS_ROOT);
        assert!(d.sharing().is_none());
    }

    /// The config's `flags.migStrategy` counts when the policy names none;
    /// the policy's `spec.mig.strategy` wins otherwise, and the config's is
    /// then named as not acted on.
    #[test]
    fn config_mig_strategy_counts_unless_the_policy_names_one() {
        let config = "    config:\n      inline:\n        version: v1\n        flags:\n          migStrategy: mixed\n";
        let p = Policy::from_yaml(&format!("spec:\n  devicePlugin:\n{config}"), "p").unwrap();
        let s = settings(&p.device_plugin, p.mig.strategy).unwrap();
        assert_eq!(s.mig_strategy, MigStrategy::Mixed);
        assert!(s.unacted.is_empty(), "{:?}", s.unacted);
        let p = Policy::from_yaml(
            &format!("spec:\n  mig:\n    strategy: none\n  devicePlugin:\n{config}"),
            "p",
        )
        .unwrap();
        let s = settings(&p.device_plugin, p.mig.strategy).unwrap();
        assert_eq!(s.mig_strategy, MigStrategy::None);
        assert_eq!(s.unacted.len(), 1);
        assert_eq!(
            s.unacted[0].to_string(),
            "flags.migStrategy (mixed: the policy's spec.mig.strategy (none) wins, as the operator's MIG_STRATEGY does)"
        );
        // Neither: single, ClusterPolicy's default.
        let s = settings(&Policy::default().device_plugin, None).unwrap();
        assert_eq!(s.mig_strategy, MigStrategy::Single);
    }
}
