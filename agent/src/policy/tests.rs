#[test]
fn a_cluster_policy_with_keys_gpu_agent_does_not_know_is_taken_naming_them() {
    let text = "apiVersion: nvidia.com/v1\nkind: ClusterPolicy\nmetadata:\n  name: cluster-policy\nspec:\n  driver:\n    enabled: false\n    repository: nvcr.io/nvidia\n    image: driver\n  sandboxWorkloads:\n    enabled: false\n  mig:\n    strategy: mixed\n";
    let (p, ignored) =
        super::Policy::from_cluster_yaml(text, "ClusterPolicy cluster-policy").unwrap();
    assert!(!p.driver.enabled);
    assert_eq!(
        ignored,
        [
            "spec.driver.repository",
            "spec.driver.image",
            "spec.sandboxWorkloads"
        ]
    );
    // A wrong value is still an error.
    let bad = "spec:\n  driver:\n    enabled: maybe\n  foo: 1\n";
    let e = super::Policy::from_cluster_yaml(bad, "ClusterPolicy x")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("ClusterPolicy x: spec.driver.enabled: "),
        "{e}"
    );
}

use super::*;

fn fixture(rel: &str) -> (String, String) {
    let path = format!("{}/../tests/fixtures/{rel}", env!("CARGO_MANIFEST_DIR"));
    (std::fs::read_to_string(&path).unwrap(), path)
}

#[test]
fn the_gpu_operator_charts_default_cluster_policy_is_taken() {
    let (text, path) = fixture("policies/cluster/gpu-operator-default.yaml");
    let (p, ignored) = Policy::from_cluster_yaml(&text, &path).unwrap_or_else(|e| panic!("{e}"));
    assert!(p.driver.enabled && p.toolkit.enabled && p.cdi.enabled);
    assert_eq!(p.driver.version.as_deref(), Some("595.91.07"));
    // `kernelModuleConfig: {name: ""}`: no ConfigMap, no parameters.
    assert!(p.driver.kernel_module_config.is_empty());
    assert_eq!(p.operator.runtime_class, "nvidia");
    assert_eq!(p.mig.strategy, Some(MigStrategy::Single));
    assert_eq!(p.mig_manager.selected_layout(), Some("all-disabled"));
    assert!(p.dcgm_exporter.enabled && p.dcgm_exporter.config.is_none());
    // Every key of the operator's that gpu-agent does not use (in the
    // order they were found); the empty ConfigMap name is not among them.
    let image = ["repository", "image", "version", "imagePullPolicy"];
    let mut expected: Vec<String> = [
        "spec.hostPaths.rootFS",
        "spec.hostPaths.driverInstallDir",
        "spec.daemonsets",
    ]
    .iter()
    .map(|k| k.to_string())
    .collect();
    expected.extend(image.iter().map(|k| format!("spec.validator.{k}")));
    expected.push("spec.validator.plugin".into());
    expected.push("spec.psa".into());
    for k in ["useNvidiaDriverCRD", "kernelModuleType", "usePrecompiled"] {
        expected.push(format!("spec.driver.{k}"));
    }
    for k in [
        "repository",
        "image",
        "imagePullPolicy",
        "startupProbe",
        "rdma",
        "manager",
    ] {
        expected.push(format!("spec.driver.{k}"));
    }
    for k in [
        "repoConfig",
        "certConfig",
        "licensingConfig",
        "virtualTopology",
        "upgradePolicy",
    ] {
        expected.push(format!("spec.driver.{k}"));
    }
    for k in [
        "vgpuManager",
        "kataManager",
        "vfioManager",
        "vgpuDeviceManager",
        "ccManager",
    ] {
        expected.push(format!("spec.{k}"));
    }
    expected.extend(image.iter().map(|k| format!("spec.toolkit.{k}")));
    expected.push("spec.toolkit.installDir".into());
    expected.extend(image.iter().map(|k| format!("spec.devicePlugin.{k}")));
    expected.push("spec.dcgm".into());
    expected.extend(image.iter().map(|k| format!("spec.dcgmExporter.{k}")));
    expected.push("spec.dcgmExporter.serviceMonitor".into());
    expected.push("spec.dcgmExporter.service".into());
    expected.extend(image.iter().map(|k| format!("spec.gfd.{k}")));
    expected.extend(image.iter().map(|k| format!("spec.migManager.{k}")));
    expected.push("spec.migManager.gpuClientsConfig".into());
    for k in [
        "nodeStatusExporter",
        "gds",
        "gdrcopy",
        "sandboxWorkloads",
        "sandboxDevicePlugin",
        "kataSandboxDevicePlugin",
    ] {
        expected.push(format!("spec.{k}"));
    }
    let mut ignored = ignored;
    ignored.sort();
    expected.sort();
    assert_eq!(ignored, expected);
}

#[test]
fn the_operators_config_map_keys_are_taken_and_named_as_left_out() {
    let text = "spec:\n  driver:\n    kernelModuleConfig:\n      name: kernel-module-params\n      nvidia: {NVreg_EnableGpuFirmware: \"0\"}\n  dcgmExporter:\n    config:\n      name: custom-dcgm-metrics\n";
    let (p, ignored) = Policy::from_cluster_yaml(text, "c").unwrap();
    assert_eq!(
        ignored,
        [
            "spec.driver.kernelModuleConfig.name",
            "spec.dcgmExporter.config.name"
        ]
    );
    // The parameters given here are used; the ConfigMap names no file.
    assert_eq!(p.module_params()["nvidia"]["NVreg_EnableGpuFirmware"], "0");
    assert_eq!(p.module_params().len(), 1);
    assert_eq!(p.dcgm_exporter.config, None);
    // A policy file takes the same shapes (the names are not read).
    assert_eq!(Policy::from_yaml(text, "f").unwrap(), p);
    // Empty names (and null) name no ConfigMap: nothing left out.
    let empty = "spec:\n  driver:\n    kernelModuleConfig: {name: \"\"}\n  dcgmExporter:\n    config: {name: null}\n";
    let (p, ignored) = Policy::from_cluster_yaml(empty, "c").unwrap();
    assert!(ignored.is_empty(), "{ignored:?}");
    assert_eq!(p, Policy::default());
    // gpu-agent's own shapes are unchanged.
    let own = "spec:\n  dcgmExporter:\n    config: /etc/gpu-agent/dcgm-metrics.csv\n";
    let p = Policy::from_yaml(own, "f").unwrap();
    assert_eq!(
        p.dcgm_exporter.config,
        Some(CountersConfig::File(
            "/etc/gpu-agent/dcgm-metrics.csv".into()
        ))
    );
    let round = serde_yaml_ng::to_string(&serde_json::json!({ "spec": p })).unwrap();
    assert_eq!(Policy::from_yaml(&round, "r").unwrap(), p);
}

/// gpu-controller sends the counters ConfigMap's file beside its name
/// (`inline`): the name is then not left out, and the text is the
/// counters file; the kernel module ConfigMap comes as parameters.
#[test]
fn the_config_maps_content_sent_by_the_controller_is_taken() {
    let text = "spec:\n  driver:\n    kernelModuleConfig:\n      nvidia: {NVreg_EnableGpuFirmware: \"0\"}\n  dcgmExporter:\n    config:\n      name: custom-dcgm-metrics\n      inline: \"DCGM_FI_DEV_GPU_TEMP, gauge, temperature\\n\"\n";
    let (p, ignored) = Policy::from_cluster_yaml(text, "c").unwrap();
    assert!(ignored.is_empty(), "{ignored:?}");
    let counters = CountersConfig::Inline {
        name: Some("custom-dcgm-metrics".into()),
        text: "DCGM_FI_DEV_GPU_TEMP, gauge, temperature\n".into(),
    };
    assert_eq!(p.dcgm_exporter.config.as_ref(), Some(&counters));
    assert_eq!(
        counters.origin(),
        "ConfigMap custom-dcgm-metrics, dcgm-metrics.csv"
    );
    assert_eq!(p.module_params()["nvidia"]["NVreg_EnableGpuFirmware"], "0");
    let round = serde_yaml_ng::to_string(&serde_json::json!({ "spec": p })).unwrap();
    assert_eq!(Policy::from_yaml(&round, "r").unwrap(), p);
    // Inline without a name (a policy file may give it so).
    let own = "spec:\n  dcgmExporter:\n    config: {inline: \"\"}\n";
    let p = Policy::from_yaml(own, "f").unwrap();
    assert_eq!(
        p.dcgm_exporter.config,
        Some(CountersConfig::Inline {
            name: None,
            text: String::new()
        })
    );
}

#[test]
fn wrong_shapes_of_the_config_map_keys_are_still_refused_naming_the_key() {
    let cases = [
        (
            "driver:\n    kernelModuleConfig: nvidia\n",
            "spec.driver.kernelModuleConfig",
            "expected parameters per module",
        ),
        (
            "driver:\n    kernelModuleConfig: [nvidia]\n",
            "spec.driver.kernelModuleConfig",
            "invalid type: sequence",
        ),
        (
            "driver:\n    kernelModuleConfig: {name: {NVreg_X: \"1\"}}\n",
            "spec.driver.kernelModuleConfig.name",
            "expected a ConfigMap name (a string)",
        ),
        (
            "driver:\n    kernelModuleConfig: {nvidia: \"NVreg_X=1\"}\n",
            "spec.driver.kernelModuleConfig.nvidia",
            "invalid type: string",
        ),
        (
            "driver:\n    kernelModuleConfig: {nvidia: {NVreg_X: [1]}}\n",
            "spec.driver.kernelModuleConfig.nvidia.NVreg_X",
            "invalid type: sequence",
        ),
        (
            "driver:\n    kernelModuleConfig: {nvidia-fs: {a: \"1\"}}\n",
            "spec.driver.kernelModuleConfig.nvidia-fs",
            "not a module gpu-agent loads",
        ),
        (
            "dcgmExporter:\n    config: 5\n",
            "spec.dcgmExporter.config",
            "expected a counters file (a host path) or the GPU Operator's {name: <ConfigMap>}",
        ),
        (
            "dcgmExporter:\n    config: [a.csv]\n",
            "spec.dcgmExporter.config",
            "invalid type: sequence",
        ),
        (
            "dcgmExporter:\n    config: {name: [x]}\n",
            "spec.dcgmExporter.config.name",
            "invalid type: sequence",
        ),
    ];
    for (spec, path, message) in cases {
        let text = format!("spec:\n  {spec}");
        for err in [
            Policy::from_yaml(&text, "p").unwrap_err().to_string(),
            Policy::from_cluster_yaml(&text, "p")
                .unwrap_err()
                .to_string(),
        ] {
            assert!(err.starts_with(&format!("p: {path}: ")), "{path}: {err}");
            assert!(err.contains(message), "{path}: {err}");
        }
    }
    // A key the operator's `{name}` does not have: refused in a file,
    // left out and named under the cluster's ClusterPolicy.
    let text = "spec:\n  dcgmExporter:\n    config: {name: m, data: x}\n";
    let err = Policy::from_yaml(text, "p").unwrap_err().to_string();
    assert!(
        err.starts_with(
            "p: spec.dcgmExporter.config.data: unknown key (expected one of: name, inline)"
        ),
        "{err}"
    );
    let (_, ignored) = Policy::from_cluster_yaml(text, "p").unwrap();
    assert_eq!(
        ignored,
        [
            "spec.dcgmExporter.config.data",
            "spec.dcgmExporter.config.name"
        ]
    );
}

#[test]
fn an_empty_mig_config_default_selects_no_layout() {
    let text = "spec:\n  migManager:\n    config: {name: \"\", default: \"\"}\n";
    let p = Policy::from_yaml(text, "p").unwrap();
    assert_eq!(p.mig_manager.selected_layout(), None);
    let text = "spec:\n  migManager:\n    default: all-balanced\n    config: {default: \"\"}\n";
    let p = Policy::from_yaml(text, "p").unwrap();
    assert_eq!(p.mig_manager.selected_layout(), Some("all-balanced"));
}

#[test]
fn empty_policy_is_all_defaults() {
    let p = Policy::from_yaml("", "p").unwrap();
    assert_eq!(p, Policy::default());
    assert!(p.driver.enabled && p.toolkit.enabled && p.device_plugin.enabled);
    assert_eq!(
        p.mig.strategy, None,
        "single unless the device-plugin config names one (plugin::settings)"
    );
    assert_eq!(p.operator.default_runtime, ContainerRuntime::Containerd);
    assert_eq!(p.operator.runtime_class, "nvidia");
}

#[test]
fn cluster_policy_shape_is_accepted() {
    let text = "apiVersion: nvidia.com/v1\nkind: ClusterPolicy\nmetadata:\n  name: cluster-policy\nspec:\n  driver:\n    enabled: false\n  toolkit:\n    enabled: false\n  mig:\n    strategy: mixed\n";
    let p = Policy::from_yaml(text, "p").unwrap();
    assert!(!p.driver.enabled && !p.toolkit.enabled);
    assert_eq!(p.mig.strategy, Some(MigStrategy::Mixed));
}

#[test]
fn unknown_key_is_named() {
    let err =
        Policy::from_yaml("spec:\n  devicePlugin:\n    enabeld: false\n", "p.yaml").unwrap_err();
    assert!(
            err.to_string().starts_with(
                "p.yaml: spec.devicePlugin.enabeld: unknown key (expected one of: enabled, config, deviceListStrategy,"
            ),
            "{err}"
        );
}

#[test]
fn wrong_type_and_bad_values_are_named() {
    let cases = [
        (
            "spec:\n  driver:\n    enabled: \"yes please\"\n",
            "spec.driver.enabled",
        ),
        ("spec:\n  mig:\n    strategy: both\n", "spec.mig.strategy"),
        (
            "spec:\n  operator:\n    defaultRuntime: podman\n",
            "spec.operator.defaultRuntime",
        ),
        (
            "spec:\n  operator:\n    runtimeClass: Nvidia_GPU\n",
            "spec.operator.runtimeClass",
        ),
        (
            "spec:\n  driver:\n    version: latest\n",
            "spec.driver.version",
        ),
        (
            "spec:\n  cdi:\n    enabled: false\n    default: true\n",
            "spec.cdi.default",
        ),
        ("kind: Deployment\n", "kind"),
        ("spec: [1, 2]\n", "spec"),
    ];
    for (text, path) in cases {
        let err = Policy::from_yaml(text, "p.yaml").unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("p.yaml: {path}: ")),
            "{path}: {err}"
        );
    }
}
