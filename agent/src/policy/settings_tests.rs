//! The device plugin's settings from a whole policy: YAML → policy →
//! `settings()` (gpu-resources'), including the policy's error paths.

use crate::plugin::config::{DeviceIdStrategy, DeviceListStrategy, MigStrategy};
use crate::plugin::settings;
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
