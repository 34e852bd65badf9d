use super::*;

const NVIDIA_EXAMPLE: &str = r#"
version: v1
flags:
  migStrategy: none
sharing:
  timeSlicing:
    renameByDefault: false
    failRequestsGreaterThanOne: false
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"#;

#[test]
fn nvidia_time_slicing_example_parses_as_is() {
    let c = PluginConfig::from_yaml(NVIDIA_EXAMPLE, "c").unwrap();
    assert_eq!(c.sharing_strategy(), SharingStrategy::TimeSlicing);
    let r = &c.sharing.time_slicing.as_ref().unwrap().resources[0];
    assert_eq!(r.replicas, 4);
    assert!(r.devices.selects(7, "GPU-x", "7"));
}

#[test]
fn device_selections() {
    let text = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, devices: [0, \"GPU-b\", \"3\"], replicas: 2}\n    - {name: nvidia.com/gpu, devices: 2, replicas: 8}\n    - {name: nvidia.com/gpu, devices: all, replicas: 3}\n";
    let c = PluginConfig::from_yaml(text, "c").unwrap();
    let rs = &c.sharing.time_slicing.unwrap().resources;
    assert!(rs[0].devices.selects(0, "GPU-a", "0"));
    assert!(rs[0].devices.selects(1, "GPU-b", "1"));
    assert!(rs[0].devices.selects(3, "GPU-d", "3"));
    assert!(!rs[0].devices.selects(2, "GPU-c", "2"));
    // A MIG device on GPU 0 is not GPU 0.
    assert!(!rs[0].devices.selects(0, "MIG-x", "0:1"));
    assert!(rs[1].devices.selects(1, "x", "1") && !rs[1].devices.selects(2, "x", "2"));
    assert!(rs[2].devices.selects(99, "x", "99"));
}

#[test]
fn refusals_name_the_key() {
    let cases = [
        ("version: v2\n", "version"),
        (
            "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 1}\n",
            "sharing.mps.resources[0].replicas",
        ),
        (
            "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2, rename: \"a b\"}\n",
            "sharing.mps.resources[0].rename",
        ),
        (
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, devices: [0], replicas: 2}\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, devices: [1], replicas: 2}\n",
            "sharing.timeSlicing",
        ),
        ("version: v1\nflags:\n  mpsRoot: run/mps\n", "flags.mpsRoot"),
        (
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 1}\n",
            "sharing.timeSlicing.resources[0].replicas",
        ),
        (
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: example.com/gpu, replicas: 2}\n",
            "sharing.timeSlicing.resources[0].name",
        ),
        (
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2, devcies: all}\n",
            "sharing.timeSlicing.resources[0].devcies",
        ),
        (
            "version: v1\nflags:\n  plugin:\n    deviceIdStrateg: uuid\n",
            "flags.plugin.deviceIdStrateg",
        ),
        (
            "version: v1\nflags:\n  plugin:\n    deviceListStrategy: [envvar, magic]\n",
            "flags.plugin.deviceListStrategy",
        ),
    ];
    for (text, path) in cases {
        let err = PluginConfig::from_yaml(text, "c.yaml").unwrap_err();
        assert_eq!(err.path, path, "{err}");
    }
}

/// NVIDIA's MPS example, as its docs give it, read the way its plugin
/// reads it: MPS wins, and more than one replica per request is
/// refused unless the config says otherwise.
#[test]
fn nvidia_mps_example_parses_as_is() {
    let text = "version: v1\nsharing:\n  mps:\n    renameByDefault: true\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 10\n";
    let c = PluginConfig::from_yaml(text, "c").unwrap();
    assert_eq!(c.sharing_strategy(), SharingStrategy::Mps);
    let mps = c.sharing.mps.as_ref().unwrap();
    assert!(mps.rename_by_default);
    assert_eq!(mps.fail_requests_greater_than_one, None);
    assert!(SharingStrategy::Mps.fail_requests_greater_than_one_default());
    assert!(!SharingStrategy::TimeSlicing.fail_requests_greater_than_one_default());
    assert_eq!(mps.resources[0].replicas, 10);
    assert_eq!(mps.resources[0].devices, DeviceSelection::All);
    // Per-GPU replica counts and renames, as for time-slicing.
    let c = PluginConfig::from_yaml(
            "version: v1\nflags:\n  mpsRoot: /var/run/mps\nsharing:\n  mps:\n    failRequestsGreaterThanOne: false\n    resources:\n    - {name: nvidia.com/gpu, devices: [0, 1], replicas: 4}\n    - {name: nvidia.com/gpu, devices: [\"GPU-c\"], replicas: 2, rename: gpu.small}\n",
            "c",
        )
        .unwrap();
    let mps = c.sharing.mps.unwrap();
    assert_eq!(mps.fail_requests_greater_than_one, Some(false));
    assert!(mps.resources[1].devices.selects(2, "GPU-c", "2"));
    assert_eq!(c.flags.mps_root.as_deref(), Some("/var/run/mps"));
}

/// An empty `mps` section shares nothing: time-slicing beside it stands
/// (only both with entries is refused).
#[test]
fn empty_mps_section_leaves_time_slicing() {
    let c = PluginConfig::from_yaml(
            "version: v1\nsharing:\n  mps: {}\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n",
            "c",
        )
        .unwrap();
    assert_eq!(c.sharing_strategy(), SharingStrategy::TimeSlicing);
    let none = PluginConfig::from_yaml("version: v1\nsharing:\n  mps: {}\n", "c").unwrap();
    assert_eq!(none.sharing_strategy(), SharingStrategy::None);
}

#[test]
fn both_strategies_at_once_are_refused_in_words() {
    let err = PluginConfig::from_yaml(
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n",
            "c.yaml",
        )
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("sharing.timeSlicing: cannot be combined with sharing.mps"),
        "{err}"
    );
}

#[test]
fn resource_names_are_qualified_names() {
    for ok in [
        "nvidia.com/gpu",
        "nvidia.com/gpu.shared",
        "nvidia.com/mig-1g.10gb",
        "nvidia.com/a",
    ] {
        assert!(valid_resource_name(ok), "{ok}");
    }
    for bad in [
        "gpu",
        "nvidia.com/",
        "nvidia.com/..",
        "nvidia.com/.gpu",
        "nvidia.com/gpu-",
        "nvidia.com/a b",
        "nvidia.com/a/b",
    ] {
        assert!(!valid_resource_name(bad), "{bad}");
    }
    assert!(!valid_resource_name(&format!(
        "nvidia.com/{}",
        "g".repeat(64)
    )));
}

/// Every key of NVIDIA's schema, spelled as upstream's struct tags spell
/// them (k8s-device-plugin v0.20.0, `api/config/v1`), is taken.
const EVERY_UPSTREAM_KEY: &str = r#"
version: v1
flags:
  migStrategy: mixed
  failOnInitError: true
  mpsRoot: /run/nvidia/mps
  nvidiaDriverRoot: /run/nvidia/driver
  nvidiaDevRoot: /
  gdrcopyEnabled: true
  gdsEnabled: false
  mofedEnabled: false
  useNodeFeatureAPI: true
  deviceDiscoveryStrategy: auto
  plugin:
    passDeviceSpecs: true
    deviceListStrategy: [envvar, cdi-cri]
    deviceIDStrategy: index
    cdiAnnotationPrefix: cdi.k8s.io/
    nvidiaCTKPath: /usr/bin/nvidia-ctk
    containerDriverRoot: /driver-root
    sharedDevicesAllocationPolicy: packed
  gfd:
    oneshot: false
    noTimestamp: true
    sleepInterval: 60s
    outputFile: /etc/kubernetes/node-feature-discovery/features.d/gfd
    machineTypeFile: /sys/class/dmi/id/product_name
resources:
  gpus:
  - pattern: "*A100*"
    name: a100
  mig:
  - pattern: "1g.10gb"
    name: mig-small
sharing:
  timeSlicing:
    renameByDefault: true
    failRequestsGreaterThanOne: true
    resources:
    - name: nvidia.com/gpu
      rename: gpu.shared
      devices: [0, "1"]
      replicas: 4
imex:
  channelIDs: [0]
  required: true
"#;

#[test]
fn every_key_upstream_has_is_taken_in_upstreams_spelling() {
    let c = PluginConfig::from_yaml(EVERY_UPSTREAM_KEY, "c.yaml").unwrap();
    let p = c.flags.plugin.as_ref().unwrap();
    assert_eq!(p.device_id_strategy, Some(DeviceIdStrategy::Index));
    assert_eq!(p.nvidia_ctk_path.as_deref(), Some("/usr/bin/nvidia-ctk"));
    assert_eq!(c.flags.use_node_feature_api, Some(true));
    assert_eq!(c.flags.mig_strategy, Some(MigStrategy::Mixed));
    assert_eq!(c.imex.as_ref().unwrap().channel_ids, [0]);
    // Written back in upstream's spelling.
    let back = serde_yaml_ng::to_string(&c).unwrap();
    for key in [
        "deviceIDStrategy:",
        "nvidiaCTKPath:",
        "useNodeFeatureAPI:",
        "channelIDs:",
    ] {
        assert!(back.contains(key), "{key} in {back}");
    }
    assert_eq!(PluginConfig::from_yaml(&back, "back").unwrap(), c);
    // Each key gpu-agent does not act on is named, the ones that leave
    // containers without something asked for as warnings.
    let named: Vec<(String, bool)> = c
        .not_acted_on()
        .into_iter()
        .map(|u| (u.key, u.warn))
        .collect();
    let expected: Vec<(String, bool)> = [
        ("flags.failOnInitError", false),
        ("flags.nvidiaDriverRoot", false),
        ("flags.gdrcopyEnabled", true),
        ("flags.useNodeFeatureAPI", false),
        ("flags.plugin.nvidiaCTKPath", false),
        ("flags.plugin.containerDriverRoot", false),
        ("flags.gfd.oneshot", false),
        ("flags.gfd.sleepInterval", false),
        ("flags.gfd.outputFile", false),
        ("flags.gfd.machineTypeFile", false),
        ("resources", true),
        ("imex", true),
    ]
    .into_iter()
    .map(|(k, w)| (k.to_string(), w))
    .collect();
    assert_eq!(named, expected);
}

/// The camelCase spellings gpu-agent documented before are still taken
/// (NVIDIA's reader matches keys in any case, so they work there too).
#[test]
fn earlier_spellings_are_still_taken() {
    let c = PluginConfig::from_yaml(
            "version: v1\nflags:\n  useNodeFeatureApi: false\n  plugin:\n    deviceIdStrategy: index\n    nvidiaCtkPath: /x\nimex:\n  channelIds: [0]\n",
            "c",
        )
        .unwrap();
    let p = c.flags.plugin.unwrap();
    assert_eq!(p.device_id_strategy, Some(DeviceIdStrategy::Index));
    assert_eq!(p.nvidia_ctk_path.as_deref(), Some("/x"));
    assert_eq!(c.flags.use_node_feature_api, Some(false));
}

/// As NVIDIA's plugin reads them: no `version` is v1, and a resource
/// name without its prefix is an `nvidia.com/` one.
#[test]
fn upstream_defaults_hold() {
    let c = PluginConfig::from_yaml(
        "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 2}\n",
        "c",
    )
    .unwrap();
    assert_eq!(c.version, "v1");
    assert_eq!(
        c.sharing.time_slicing.unwrap().resources[0].name,
        "nvidia.com/gpu"
    );
    // A key no version of the schema has stays an error, naming it.
    let err = PluginConfig::from_yaml("flags:\n  migStrategyy: none\n", "c.yaml").unwrap_err();
    assert_eq!(err.path, "flags.migStrategyy");
    assert!(err.message.contains("migStrategy"), "{err}");
}

#[test]
fn device_list_strategy_one_or_many() {
    let c = PluginConfig::from_yaml(
        "version: v1\nflags:\n  plugin:\n    deviceListStrategy: [cdi-annotations, cdi-cri]\n",
        "c",
    )
    .unwrap();
    let s = c
        .flags
        .plugin
        .unwrap()
        .device_list_strategy
        .unwrap()
        .to_vec();
    assert_eq!(
        s,
        [
            DeviceListStrategy::CdiAnnotations,
            DeviceListStrategy::CdiCri
        ]
    );
}
