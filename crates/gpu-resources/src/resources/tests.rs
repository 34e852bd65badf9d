use super::*;
use crate::config::PluginConfig;
use crate::test_support::inventory_of;

/// Replicas per GPU, by NVML index.
fn replicas_per_gpu(r: &Resource) -> BTreeMap<u32, u32> {
    let mut m = BTreeMap::new();
    for d in &r.devices {
        *m.entry(d.index).or_insert(0) += 1;
    }
    m
}

fn with_sharing(yaml: &str) -> PluginSettings {
    let c = PluginConfig::from_yaml(yaml, "c").unwrap();
    PluginSettings {
        time_slicing: c.sharing.time_slicing,
        ..PluginSettings::default()
    }
}

/// A MIG device whose compute instance is part of its GPU instance
/// only is left out by the mixed strategy, and named by
/// [`partial_compute`] (which the plugin stage logs once) — not logged
/// by every [`build`].
#[test]
fn a_partial_compute_instance_is_left_out_and_named() {
    let mut inv = inventory_of("h100-mig-2");
    let g = inv
        .gpus
        .iter_mut()
        .find(|g| !g.mig_devices.is_empty())
        .unwrap();
    let gpu_uuid = g.uuid.clone().unwrap();
    let m = &mut g.mig_devices[0];
    m.ci_slices = m.gi_slices.saturating_sub(1).max(1);
    assert_ne!(m.ci_slices, m.gi_slices, "a GPU instance of one slice");
    let (mig, profile) = (m.uuid.clone(), m.profile.clone());
    assert_eq!(
        partial_compute(&inv, MigStrategy::Mixed),
        [(gpu_uuid, mig.clone(), profile)]
    );
    assert!(partial_compute(&inv, MigStrategy::None).is_empty());
    let settings = PluginSettings {
        mig_strategy: MigStrategy::Mixed,
        ..PluginSettings::default()
    };
    let rs = build(&inv, &settings).unwrap();
    assert!(
        rs.iter().all(|r| r.devices.iter().all(|d| d.id != mig)),
        "{rs:#?}"
    );
    assert!(rs.iter().map(|r| r.devices.len()).sum::<usize>() > 0);
}

#[test]
fn whole_gpus_by_default() {
    let inv = inventory_of("h100-sxm-8");
    let rs = build(&inv, &PluginSettings::default()).unwrap();
    assert_eq!(rs.len(), 1);
    assert_eq!(rs[0].name, "nvidia.com/gpu");
    assert_eq!(rs[0].socket_name(), "nvidia-gpu.sock");
    assert_eq!(rs[0].devices.len(), 8);
    assert_eq!(
        rs[0].devices[0].id,
        "GPU-9d3b5a0e-1c7f-4e2a-8b61-0f2c3d4e5a01"
    );
    assert_eq!(rs[0].devices[7].numa_node, Some(1));
    assert!(!rs[0].shared);
}

#[test]
fn time_slicing_four_replicas() {
    let s = with_sharing(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n",
    );
    let rs = build(&inventory_of("t4-4"), &s).unwrap();
    assert_eq!(rs.len(), 1);
    assert_eq!(rs[0].name, "nvidia.com/gpu");
    assert_eq!(rs[0].devices.len(), 16);
    assert_eq!(
        rs[0].devices[5].id,
        "GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a41::1"
    );
    assert!(rs[0].shared);
}

#[test]
fn rename_by_default_and_per_gpu_replica_counts() {
    let s = with_sharing(
        "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n    - {name: nvidia.com/gpu, devices: [0, 1], replicas: 4}\n    - {name: nvidia.com/gpu, devices: [2], replicas: 2, rename: gpu.small}\n",
    );
    let rs = build(&inventory_of("t4-4"), &s).unwrap();
    let names: Vec<&str> = rs.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "nvidia.com/gpu",
            "nvidia.com/gpu.shared",
            "nvidia.com/gpu.small"
        ]
    );
    assert_eq!(rs[0].devices.len(), 1); // GPU 3 stays whole
    assert_eq!(replicas_per_gpu(&rs[1]), BTreeMap::from([(0, 4), (1, 4)]));
    assert_eq!(replicas_per_gpu(&rs[2]), BTreeMap::from([(2, 2)]));
    assert_eq!(rs[2].socket_name(), "nvidia-gpu.small.sock");
}

#[test]
fn conflicts_are_refused_with_the_gpu_named() {
    let twice = with_sharing(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, devices: [0], replicas: 2}\n    - {name: nvidia.com/gpu, devices: all, replicas: 3, rename: other}\n",
    );
    let err = build(&inventory_of("t4-4"), &twice).unwrap_err();
    assert!(
        matches!(
            err,
            ResourceError::SelectedTwice {
                first: 0,
                second: 1,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().starts_with("0 (GPU-5f0cf4a3"), "{err}");
    let mixed = with_sharing(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, devices: [0], replicas: 2}\n",
    );
    let err = build(&inventory_of("t4-4"), &mixed).unwrap_err();
    assert_eq!(
        err,
        ResourceError::MixedSharing {
            name: "nvidia.com/gpu".into(),
            device: "1".into()
        }
    );
}

fn mig(strategy: MigStrategy) -> Result<Vec<Resource>, ResourceError> {
    let settings = PluginSettings {
        mig_strategy: strategy,
        ..PluginSettings::default()
    };
    build(&inventory_of("h100-mig-2"), &settings)
}

#[test]
fn mig_mixed_one_resource_per_profile() {
    let rs = mig(MigStrategy::Mixed).unwrap();
    let summary: Vec<(&str, usize, String)> = rs
        .iter()
        .map(|r| (r.name.as_str(), r.devices.len(), r.socket_name()))
        .collect();
    assert_eq!(
        summary,
        [
            (
                "nvidia.com/mig-1g.10gb",
                9,
                "nvidia-mig-1g.10gb.sock".to_string()
            ),
            (
                "nvidia.com/mig-2g.20gb",
                1,
                "nvidia-mig-2g.20gb.sock".to_string()
            ),
            (
                "nvidia.com/mig-3g.40gb",
                1,
                "nvidia-mig-3g.40gb.sock".to_string()
            ),
        ]
    );
    let d = &rs[2].devices[0];
    assert!(d.id.starts_with("MIG-") && d.id == d.uuid);
    assert_eq!(d.index_name, "0:0");
    assert_eq!(d.gpu_uuid, "GPU-6a1f0c2e-5b3d-4e7f-8a9b-1c2d3e4f5a00");
    assert_eq!(rs[0].devices[8].index_name, "1:6");
}

#[test]
fn pass_device_specs_is_refused_for_mig_devices() {
    let settings = PluginSettings {
        mig_strategy: MigStrategy::Mixed,
        pass_device_specs: true,
        ..PluginSettings::default()
    };
    let err = build(&inventory_of("h100-mig-2"), &settings).unwrap_err();
    assert_eq!(err, ResourceError::PassDeviceSpecsMig);
    // Whole GPUs are fine.
    let whole = PluginSettings {
        mig_strategy: MigStrategy::None,
        pass_device_specs: true,
        ..PluginSettings::default()
    };
    assert!(build(&inventory_of("h100-mig-2"), &whole).is_ok());
}

#[test]
fn mig_none_advertises_whole_gpus() {
    let rs = mig(MigStrategy::None).unwrap();
    assert_eq!(rs.len(), 1);
    assert_eq!(rs[0].name, "nvidia.com/gpu");
    assert!(rs[0].devices.iter().all(|d| d.id.starts_with("GPU-")));
}

#[test]
fn mig_single_refuses_several_profiles_and_mixed_modes() {
    let err = mig(MigStrategy::Single).unwrap_err().to_string();
    assert_eq!(
        err,
        "mig.strategy single: the node has several MIG profiles (1g.10gb, 2g.20gb, 3g.40gb); single needs one (or use mixed)"
    );
    // One profile everywhere: MIG devices become nvidia.com/gpu.
    let mut inv = inventory_of("h100-mig-2");
    inv.gpus[0].mig_devices = inv.gpus[1].mig_devices[..3].to_vec();
    let settings = PluginSettings::default();
    assert_eq!(settings.mig_strategy, MigStrategy::Single);
    let rs = build(&inv, &settings).unwrap();
    assert_eq!(rs.len(), 1);
    assert_eq!(rs[0].name, "nvidia.com/gpu");
    assert_eq!(rs[0].devices.len(), 10);
    // A MIG-enabled GPU without devices, or one GPU without MIG, is refused.
    inv.gpus[0].mig_devices.clear();
    assert!(
        build(&inv, &settings)
            .unwrap_err()
            .to_string()
            .contains("GPU 0 has MIG enabled but no MIG devices")
    );
    inv.gpus[0].mig = Some(gpu_model::backend::MigMode {
        current: false,
        pending: false,
    });
    assert!(
        build(&inv, &settings)
            .unwrap_err()
            .to_string()
            .contains("GPU 0 has MIG disabled")
    );
}

#[test]
fn mig_devices_can_be_time_sliced_by_index_name() {
    let c = PluginConfig::from_yaml(
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/mig-3g.40gb, devices: [\"0:0\"], replicas: 2}\n",
            "c",
        )
        .unwrap();
    let settings = PluginSettings {
        mig_strategy: MigStrategy::Mixed,
        time_slicing: c.sharing.time_slicing,
        ..PluginSettings::default()
    };
    let rs = build(&inventory_of("h100-mig-2"), &settings).unwrap();
    let r = rs
        .iter()
        .find(|r| r.name == "nvidia.com/mig-3g.40gb")
        .unwrap();
    assert!(r.shared);
    assert_eq!(r.devices.len(), 2);
    assert!(r.devices[1].id.ends_with("::1"));
}

fn with_mps(yaml: &str, mig_strategy: MigStrategy) -> PluginSettings {
    let c = PluginConfig::from_yaml(yaml, "c").unwrap();
    PluginSettings {
        mig_strategy,
        mps: c.sharing.mps,
        ..PluginSettings::default()
    }
}

#[test]
fn mps_replicas_per_gpu_refuse_more_than_one_by_default() {
    let s = with_mps(
        "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, devices: [0, 1], replicas: 4, rename: gpu.mps4}\n    - {name: nvidia.com/gpu, devices: [2, 3], replicas: 2, rename: gpu.mps2}\n",
        MigStrategy::Single,
    );
    let rs = build(&inventory_of("t4-4"), &s).unwrap();
    let names: Vec<&str> = rs.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["nvidia.com/gpu.mps2", "nvidia.com/gpu.mps4"]);
    assert!(
        rs.iter()
            .all(|r| r.mps && r.shared && r.fail_requests_greater_than_one)
    );
    assert_eq!(replicas_per_gpu(&rs[0]), BTreeMap::from([(2, 2), (3, 2)]));
    assert_eq!(replicas_per_gpu(&rs[1]), BTreeMap::from([(0, 4), (1, 4)]));
    assert_eq!(
        rs[1].devices[1].id,
        "GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a40::1"
    );
    // The labels read the same entry: MPS, 4 replicas, renamed.
    let r = replication(&s, "nvidia.com/gpu").unwrap();
    assert_eq!(r.strategy, SharingStrategy::Mps);
    assert_eq!(
        (r.replicas, r.advertised_as.as_str()),
        (4, "nvidia.com/gpu.mps4")
    );
    // `failRequestsGreaterThanOne: false` lifts the limit.
    let relaxed = with_mps(
        "version: v1\nsharing:\n  mps:\n    failRequestsGreaterThanOne: false\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n",
        MigStrategy::Single,
    );
    let rs = build(&inventory_of("t4-4"), &relaxed).unwrap();
    assert_eq!(rs[0].name, "nvidia.com/gpu");
    assert!(rs[0].mps && !rs[0].fail_requests_greater_than_one);
    // Time-slicing still defaults to no limit, and is not MPS.
    let ts = with_sharing(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n",
    );
    let rs = build(&inventory_of("t4-4"), &ts).unwrap();
    assert!(!rs[0].mps && !rs[0].fail_requests_greater_than_one);
}

#[test]
fn mps_on_mig_is_refused_naming_the_gpu() {
    let all = "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n";
    // Strategy none: the MIG-enabled GPUs are advertised whole.
    let err = build(
        &inventory_of("h100-mig-2"),
        &with_mps(all, MigStrategy::None),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "sharing.mps.resources[0] selects GPU 0 (GPU-6a1f0c2e-5b3d-4e7f-8a9b-1c2d3e4f5a00), which is in MIG mode: MPS cannot share a MIG-enabled GPU or its MIG devices (MIG and MPS on one GPU); leave it out with `devices`, or disable MIG on it"
    );
    // Mixed: a MIG resource named for MPS.
    let mig = with_mps(
        "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/mig-3g.40gb, replicas: 2}\n",
        MigStrategy::Mixed,
    );
    let err = build(&inventory_of("h100-mig-2"), &mig).unwrap_err();
    assert!(
        matches!(&err, ResourceError::MpsOnMig { entry: 0, device } if device.starts_with("MIG device 0:0 (MIG-")),
        "{err}"
    );
    // Mixed, one GPU out of MIG mode: MPS shares that one; the MIG
    // GPU's devices are their own resources, not shared.
    let mut inv = inventory_of("h100-mig-2");
    inv.gpus[1].mig = Some(gpu_model::backend::MigMode {
        current: false,
        pending: false,
    });
    inv.gpus[1].mig_devices.clear();
    let rs = build(&inv, &with_mps(all, MigStrategy::Mixed)).unwrap();
    let gpu = rs.iter().find(|r| r.name == GPU_RESOURCE).unwrap();
    assert!(gpu.mps);
    assert_eq!(replicas_per_gpu(gpu), BTreeMap::from([(1, 2)]));
    assert!(
        rs.iter()
            .filter(|r| r.name != GPU_RESOURCE)
            .all(|r| !r.shared && !r.mps)
    );
}

#[test]
fn mps_on_gpus_that_cannot_do_it_is_refused() {
    let two = with_mps(
        "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, devices: [1], replicas: 2, rename: gpu.mps}\n",
        MigStrategy::Single,
    );
    let mut inv = inventory_of("t4-4");
    inv.gpus[1].model = Some("Tesla P100-PCIE-16GB".into());
    inv.gpus[1].compute_capability = Some(ComputeCapability { major: 6, minor: 0 });
    let err = build(&inv, &two).unwrap_err();
    assert_eq!(
        err.to_string(),
        "sharing.mps.resources[0] selects GPU 1 (GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a41), which cannot be shared with MPS: a Tesla P100-PCIE-16GB has compute capability 6.0; the per-client thread and memory limits that divide it into replicas need 7.0 (Volta) or newer"
    );
    // The same GPU left out of the entry is fine.
    let other = with_mps(
        "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, devices: [0], replicas: 2, rename: gpu.mps}\n",
        MigStrategy::Single,
    );
    assert!(build(&inv, &other).is_ok());
    inv.gpus[1].compute_capability = None;
    assert!(
        build(&inv, &two)
            .unwrap_err()
            .to_string()
            .contains("NVML did not report the compute capability")
    );
    let many = with_mps(
        "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 49}\n",
        MigStrategy::Single,
    );
    let err = build(&inventory_of("t4-4"), &many).unwrap_err();
    assert_eq!(
        err.to_string(),
        "sharing.mps.resources[0].replicas: 49 replicas of GPU 0 (GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a40), but an MPS server serves at most 48 clients per GPU"
    );
}

/// Time-slicing may give one resource's GPUs different replica counts;
/// MPS may not (one daemon, one thread share): it says to rename.
#[test]
fn one_mps_resource_has_one_replica_count() {
    let mixed = "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, devices: [0, 1], replicas: 4}\n    - {name: nvidia.com/gpu, devices: [2, 3], replicas: 2}\n";
    let err = build(&inventory_of("t4-4"), &with_mps(mixed, MigStrategy::Single)).unwrap_err();
    assert!(
        err.to_string().starts_with(
            "MPS resource nvidia.com/gpu would divide GPU 0 into 4 replicas and GPU 2 into 2"
        ),
        "{err}"
    );
    let ts = with_sharing(&mixed.replace("mps:", "timeSlicing:"));
    assert!(build(&inventory_of("t4-4"), &ts).is_ok());
}

#[test]
fn no_gpu_no_resources() {
    assert!(
        build(&inventory_of("no-gpu"), &PluginSettings::default())
            .unwrap()
            .is_empty()
    );
}
